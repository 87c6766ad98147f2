"""
data.py -- the data every script of this repo reads.

  * the built-in `shapes` dataset: procedural images of 1-3 coloured shapes in spatial relations,
    captions from a small grammar with gold PTB trees, SugarCrepe-style hard negatives, a
    systematicity split (held-out compounds) and a productivity split (longer captions);
  * the tokenizer (CLIP BPE from `bpe_simple_vocab_16e6.txt.gz`, or a BPE trained on the captions;
    `tokenizers`); image transforms with PIL + numpy + torch;
  * readers for real data (webdataset tar shards, open_clip CSV/TSV, Karpathy JSON, ImageFolder, the
    presets cc3m / cc12m / datacomp under $DATA_ROOT) behind one `make_loader(spec)`: uint8 batches
    that the step normalises on the device (normalize_images), split across DDP ranks and workers,
    bad samples skipped and counted, exact resume.

What a run does with its out_dir (checkpoints, lock, signals, logs, plots, weights files, results
over seeds) is lifecycle.py's; so is DataError (data.DataError), the user's one-line error.

Commands (python data.py COMMAND --help): make-shapes --out_dir DIR (the shapes data in the real
formats), check --data SPEC (good and skipped counts), convert-weights PATH (.pt -> .safetensors)
"""
import argparse
import collections
import contextlib
import csv
import difflib
import functools
import glob
import gzip
import html
import io
import itertools
import json
import logging
import math
import multiprocessing
import os
import random
import sys
import tarfile
import time
import zlib
from dataclasses import dataclass, field

import ftfy
import numpy as np
# numpy 2 imports it lazily: here once, not in each forked worker (torch seeds it)
import numpy.random  # noqa: F401
import torch
from braceexpand import UnbalancedBracesError, braceexpand
from PIL import Image, ImageDraw

from lifecycle import (DataError, check_torchscript, convert_torchscript, done_line, progress,
                       read_json, start_line, start_workers, worker_ignores_sigterm, write_file,
                       writing)


# -----------------------------------------------------------------------------
# The `shapes` dataset. Grammar (lower case, no punctuation): an object is ("a"|"an") [size] colour
# shape, e.g. "a small red circle"; a relation is one of RELATION_NAMES; a caption is one of
# CAPTION_FORMS ("rel_and": the relation binds the first two objects, the third is only present;
# "chain", A rel1 B and B rel2 C, in the productivity split only). Size words appear with
# probability 1/2 per object, so "add_att" negatives exist. Relations are geometric and unambiguous:
# a related pair's centres differ in |dx| and |dy| by at least RELATION_MARGIN pixels, and exactly
# one of the four relations holds between any ordered pair. Held-out compounds (systematicity): one
# colour-shape pair per colour never occurs in train/val/test: images, captions, hard negatives.

SHAPE_NAMES = ["circle", "square", "triangle", "star", "cross", "diamond"]
COLOURS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 90, 235),
    "yellow": (235, 215, 40), "purple": (150, 60, 200), "orange": (245, 135, 30),
    "white": (235, 235, 235), "cyan": (40, 205, 215),
}
COLOUR_NAMES = list(COLOURS)
SIZE_NAMES = ["small", "large"]
SIZE_RADIUS = {"small": (5, 7), "large": (10, 13)}  # radius range in pixels at 64x64
RELATION_NAMES = ["to the left of", "to the right of", "above", "below"]
HELD_OUT_COMPOUNDS = frozenset((c, SHAPE_NAMES[i % len(SHAPE_NAMES)])
                               for i, c in enumerate(COLOUR_NAMES))
SEEN_COMPOUNDS = [(c, s) for c in COLOUR_NAMES for s in SHAPE_NAMES
                  if (c, s) not in HELD_OUT_COMPOUNDS]
SHAPES_CATEGORIES = ["replace_obj", "replace_att", "replace_rel", "swap_obj", "swap_att",
                     "add_obj", "add_att"]
SHAPES_SPLITS = ["train", "val", "test", "systematicity", "productivity"]
SHAPES_METRICS = ("i2t_r1", "t2i_r1", *SHAPES_CATEGORIES, "sugarcrepe_mean", "systematicity",
                  "productivity")
SHAPES_SIZES = {"train": 100_000, "val": 1000, "test": 1000, "systematicity": 1000,
                "productivity": 1000}
SHAPES_IMAGE_SIZE = 64
SHAPES_VAL_PAIRS = 1000   # retrieval R@1 of the benchmark: a standard error of at most 1.6 points
RELATION_MARGIN = 4
# caption form -> its words: w<i> phrase i, r<i> the relation of phrase i to phrase i + 1
CAPTION_FORMS = {"single": "w0", "rel": "w0 r0 w1", "copula": "w0 is r0 w1", "and": "w0 and w1",
                 "rel_and": "w0 r0 w1 and w2", "chain": "w0 r0 w1 r1 w2"}


@dataclass
class Obj:
    shape: str
    colour: str
    size: str
    box: tuple = (0, 0, 0, 0)  # (x0, y0, x1, y1) in pixels

    @property
    def centre(self):
        return ((self.box[0] + self.box[2]) / 2, (self.box[1] + self.box[3]) / 2)


@dataclass
class Phrase:
    """One noun phrase of a caption: `size` is None when the caption does not mention it."""
    colour: str
    shape: str
    size: str | None = None


@dataclass
class CaptionStruct:
    """Phrases joined by `form` (CAPTION_FORMS); relations[i] joins phrases i, i+1."""
    form: str
    phrases: list
    relations: list = field(default_factory=list)


@dataclass
class Scene:
    image: Image.Image
    caption: str
    tree: str
    objects: list
    relations: list  # [(i, relation, j)] stated by the caption, indices into objects
    struct: CaptionStruct = None


def relation_between(a: Obj, b: Obj) -> str:
    """The one relation that holds for "a <rel> b" (dominant axis of the centre offset)."""
    dx, dy = b.centre[0] - a.centre[0], b.centre[1] - a.centre[1]
    if abs(dx) >= abs(dy):
        return "to the left of" if dx > 0 else "to the right of"
    return "above" if dy > 0 else "below"


def _article(p: Phrase) -> str:
    return "an" if (p.size or p.colour)[0] in "aeiou" else "a"


def _related_pairs(form: str) -> list:
    """(i, i + 1) for each relation the caption form states."""
    return [(i, i + 1) for i in range(2) if f"r{i}" in CAPTION_FORMS.get(form, "").split()]


def render_caption(s: CaptionStruct, word=None) -> str:
    """The caption; `word(kind, value)` may give a synonym (mm_learngene.shapes_references)."""
    word, parts = word or (lambda kind, value: value), {}
    for i, p in enumerate(s.phrases):
        words = (([word("size", p.size)] if p.size else []) + [word("colour", p.colour)]
                 + word("shape", p.shape).split())
        parts[f"w{i}"] = ["an" if words[0][0] in "aeiou" else "a"] + words
    parts.update((f"r{i}", word("relation", rel).split()) for i, rel in enumerate(s.relations))
    words = [parts[t] if t[1:].isdigit() else [t] for t in CAPTION_FORMS[s.form].split()]
    return " ".join(w for ws in words for w in ws)


def _pp_tree(relation: str, np_tree: str) -> str:
    if relation in ("above", "below"):
        return f"(PP (IN {relation}) {np_tree})"
    side = relation.split()[2]  # "to the left of" -> left
    return f"(PP (TO to) (NP (NP (DT the) (NN {side})) (PP (IN of) {np_tree})))"


# form -> PTB tree: {0}..{2} the phrases' NPs, {pp} relation 0's PP (a chain's: of NP 1 + PP 1)
TREE_FORMS = {"single": "(ROOT {0})", "rel": "(ROOT (NP {0} {pp}))",
              "copula": "(ROOT (S {0} (VP (VBZ is) {pp})))", "and": "(ROOT (NP {0} (CC and) {1}))",
              "rel_and": "(ROOT (NP (NP {0} {pp}) (CC and) {2}))", "chain": "(ROOT (NP {0} {pp}))"}


def caption_tree(s: CaptionStruct) -> str:
    """Gold PTB constituency tree of a caption (Penn Treebank tags, one root)."""
    n = [f"(NP (DT {_article(p)}){f' (JJ {p.size})' if p.size else ''} (JJ {p.colour}) (NN {p.shape}))"
         for p in s.phrases]
    obj = f"(NP {n[1]} {_pp_tree(s.relations[1], n[2])})" if s.form == "chain" else n[1 % len(n)]
    return TREE_FORMS[s.form].format(*n, pp=_pp_tree(s.relations[0], obj) if s.relations else "")


def caption_is_true(s: CaptionStruct, objects: list) -> bool:
    """True iff the phrases match distinct objects such that every stated relation holds."""
    rels = [(i, s.relations[i], j) for i, j in _related_pairs(s.form)]
    for assign in itertools.permutations(range(len(objects)), len(s.phrases)):
        ok = all(objects[o].colour == p.colour and objects[o].shape == p.shape
                 and p.size in (None, objects[o].size)
                 for p, o in zip(s.phrases, assign))
        if ok and all(relation_between(objects[assign[i]], objects[assign[j]]) == r
                      for i, r, j in rels):
            return True
    return False


def _sample_objects(rng: random.Random, n: int, allowed) -> list:
    """n objects with distinct (colour, shape) compounds drawn from `allowed` (a list)."""
    compounds = rng.sample(allowed, n)
    return [Obj(shape=s, colour=c, size=rng.choice(SIZE_NAMES)) for c, s in compounds]


def _place(rng: random.Random, objects: list, related: list, image_size: int) -> bool:
    """Random non-overlapping positions; pairs in `related` get an unambiguous relation."""
    scale = image_size / SHAPES_IMAGE_SIZE
    for _ in range(200):
        for o in objects:
            r = rng.uniform(*SIZE_RADIUS[o.size]) * scale
            cx, cy = (rng.uniform(r + 1, image_size - r - 1) for _ in range(2))
            o.box = (round(cx - r), round(cy - r), round(cx + r), round(cy + r))
        overlap = any(
            math.dist(a.centre, b.centre) < (a.box[2] - a.box[0] + b.box[2] - b.box[0]) / 2 + 2 * scale
            for k, a in enumerate(objects) for b in objects[k + 1:])
        ambiguous = any(
            abs(abs(objects[j].centre[0] - objects[i].centre[0])
                - abs(objects[j].centre[1] - objects[i].centre[1]))
            < RELATION_MARGIN * scale for i, j in related)
        if not overlap and not ambiguous:
            return True
    return False


def _draw_object(draw: ImageDraw.ImageDraw, o: Obj, rgb: tuple):
    x0, y0, x1, y1 = o.box
    cx, cy, r = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2
    if o.shape == "circle":
        draw.ellipse(o.box, fill=rgb)
    elif o.shape == "square":
        draw.rectangle((cx - r * 0.85, cy - r * 0.85, cx + r * 0.85, cy + r * 0.85), fill=rgb)
    elif o.shape == "triangle":
        draw.polygon([(cx, y0), (x1, y1 - r * 0.2), (x0, y1 - r * 0.2)], fill=rgb)
    elif o.shape == "diamond":
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=rgb)
    elif o.shape == "star":
        rads = [(r if k % 2 == 0 else r * 0.45, -math.pi / 2 + k * math.pi / 5) for k in range(10)]
        draw.polygon([(cx + rad * math.cos(a), cy + rad * math.sin(a)) for rad, a in rads], fill=rgb)
    elif o.shape == "cross":
        t = r * 0.35
        draw.rectangle((x0, cy - t, x1, cy + t), fill=rgb)
        draw.rectangle((cx - t, y0, cx + t, y1), fill=rgb)
    else:
        raise ValueError(o.shape)


def render_scene(objects: list, rng: random.Random,
                 image_size: int = SHAPES_IMAGE_SIZE) -> Image.Image:
    """Dark varied background; colours jittered +-20: colour names are categories, not pixels."""
    img = Image.new("RGB", (image_size, image_size), tuple(rng.randint(10, 60) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    for o in objects:
        _draw_object(draw, o, tuple(min(255, max(0, v + rng.randint(-20, 20)))
                                    for v in COLOURS[o.colour]))
    return img


def _scene_layout(split: str, rng: random.Random):
    """(objects, caption form): 1-3 objects, at most one relation; productivity: a chain of 3."""
    if split == "productivity":
        return 3, "chain"
    u = rng.random()
    if u < 0.15:
        return 1, "single"
    if u < 0.80:
        return 2, rng.choice(["rel", "rel", "copula", "and"])
    return 3, "rel_and"


def shapes_scene(split: str = "train", index: int = 0, seed: int = 0,
                 image_size: int = SHAPES_IMAGE_SIZE) -> Scene:
    """Scene `index` of a split: deterministic in (split, index, seed); same seed, same bytes."""
    if split not in SHAPES_SPLITS:
        raise DataError(f"shapes: unknown split {split!r} (choose from {', '.join(SHAPES_SPLITS)})")
    # str seeds are hashed with sha512: stable across runs
    rng = random.Random(f"shapes/{seed}/{split}/{index}")
    while True:
        n, form = _scene_layout(split, rng)
        if split == "systematicity":
            # at least one held-out compound, the rest seen ones
            held = rng.choice(sorted(HELD_OUT_COMPOUNDS))
            objects = [Obj(shape=held[1], colour=held[0], size=rng.choice(SIZE_NAMES))]
            objects += _sample_objects(rng, n - 1, [c for c in SEEN_COMPOUNDS if c != held])
            rng.shuffle(objects)
        else:
            objects = _sample_objects(rng, n, SEEN_COMPOUNDS)
        struct_rel = _related_pairs(form)
        if not _place(rng, objects, struct_rel, image_size):
            continue
        phrases = [Phrase(o.colour, o.shape, o.size if rng.random() < 0.5 else None) for o in objects]
        relations = [relation_between(objects[i], objects[j]) for i, j in struct_rel]
        struct = CaptionStruct(form, phrases, relations)
        return Scene(image=render_scene(objects, rng, image_size), caption=render_caption(struct),
                     tree=caption_tree(struct), objects=objects,
                     relations=[(i, r, j) for (i, j), r in zip(struct_rel, relations)], struct=struct)


# --- hard negatives (SugarCrepe's 7 categories, on the caption structure) ---

def _copy_struct(s: CaptionStruct, i: int = 0, **values) -> CaptionStruct:
    """A copy of `s` whose phrase i has the fields `values`."""
    t = CaptionStruct(s.form, [Phrase(p.colour, p.shape, p.size) for p in s.phrases],
                      list(s.relations))
    vars(t.phrases[i]).update(values)
    return t


def _negative_candidates(category: str, s: CaptionStruct, objects: list, rng: random.Random) -> list:
    """Candidate negatives of one category (possibly empty); validity is checked by the caller."""
    out, k = [], len(s.phrases)
    if category == "replace_obj":
        out = [_copy_struct(s, i, shape=x) for i in range(k) for x in SHAPE_NAMES
               if x != s.phrases[i].shape]
    elif category == "replace_att":
        for i, p in enumerate(s.phrases):
            out += [_copy_struct(s, i, colour=x) for x in COLOUR_NAMES if x != p.colour]
            if p.size:
                out.append(_copy_struct(s, i, size="small" if p.size == "large" else "large"))
    elif category == "replace_rel":
        # relation r by another (the phrases are never changed: shared)
        out = [CaptionStruct(s.form, s.phrases,
                             [x if q == r else y for q, y in enumerate(s.relations)])
               for r, rel in enumerate(s.relations) for x in RELATION_NAMES if x != rel]
    elif category in ("swap_obj", "swap_att"):
        fields = ("shape",) if category == "swap_obj" else ("colour", "size")
        for i, j in itertools.combinations(range(k), 2):
            for f in fields:    # swap two phrases' values where both have one and they differ
                a, b = getattr(s.phrases[i], f), getattr(s.phrases[j], f)
                if a and b and a != b:
                    t = _copy_struct(s, i, **{f: b})
                    setattr(t.phrases[j], f, a)
                    out.append(t)
    elif category == "add_obj":
        # append "and a <absent object>" (sizes drawn for an "and" too: same stream)
        extras = ([Phrase(c, sh, rng.choice([None, *SIZE_NAMES])) for c, sh in SEEN_COMPOUNDS]
                  if s.form in ("single", "rel", "and") else [])
        out = [CaptionStruct({"single": "and", "rel": "rel_and"}[s.form], [*s.phrases, x],
                             list(s.relations))
               for x in extras if s.form != "and"]
    elif category == "add_att":
        # phrases are made in object order, so phrase i describes objects[i]
        out = [_copy_struct(s, i, size="small" if objects[i].size == "large" else "large")
               for i, p in enumerate(s.phrases) if p.size is None]
    else:
        raise ValueError(category)
    return out


def make_negative(category: str, scene: Scene, rng: random.Random, allow_held_out: bool = False):
    """A caption of `category`: grammatical, not the positive, false of the image; None if none."""
    cands = _negative_candidates(category, scene.struct, scene.objects, rng)
    rng.shuffle(cands)
    for t in cands:
        seen = all((p.colour, p.shape) not in HELD_OUT_COMPOUNDS for p in t.phrases)
        if (allow_held_out or seen) and not caption_is_true(t, scene.objects):
            if (text := render_caption(t)) != scene.caption:
                return text
    return None


def shapes_benchmark(seed: int = 0, n: int = 1000, image_size: int = SHAPES_IMAGE_SIZE) -> dict:
    """The built-in benchmark: per SugarCrepe category, n items {"image", "caption",
    "negative_caption"} of test scenes (those with none skipped); systematicity / productivity: n
    items {"image", "caption", "negatives", "negative_categories"} (CREPE R@1; category i made
    negative i)."""
    def first_n(split, start, item):
        # item(scene) of scenes start, start + 1, ...: the first n that are not None
        return list(itertools.islice(
            filter(None, (item(shapes_scene(split, start + i, seed, image_size))
                          for i in itertools.count())), n))

    def pair(scene, category, rng):
        neg = make_negative(category, scene, rng)
        return neg and {"image": scene.image, "caption": scene.caption, "negative_caption": neg}

    def crepe(scene, cats, rng):
        found = {}  # negative -> the first category that made it (None: a category that made none)
        for cat in cats:
            found.setdefault(make_negative(cat, scene, rng, allow_held_out=True), cat)
        found.pop(None, None)
        return len(found) >= 2 and {"image": scene.image, "caption": scene.caption,
                                    "negatives": list(found),
                                    "negative_categories": list(found.values())}
    out = {}    # (first_n consumes each lambda at once: no late binding)
    # each category walks its own stream of test-split scenes
    for c, cat in enumerate(SHAPES_CATEGORIES):
        rng = random.Random(f"shapes-bench/{seed}/{cat}")
        out[cat] = first_n("test", 1_000_000 * (c + 1), lambda s: pair(s, cat, rng))
    for split, cats in (("systematicity", ["swap_att", "swap_obj", "replace_att", "replace_obj"]),
                        ("productivity", ["replace_rel", "swap_obj", "swap_att", "replace_att"])):
        rng = random.Random(f"shapes-bench/{seed}/{split}")
        out[split] = first_n(split, 0, lambda s: crepe(s, cats, rng))
    return out


@torch.no_grad()
def score_shapes(encode_image, encode_text, tokenizer, image_size: int, device="cpu",
                 n: int = 1000, n_val: int = SHAPES_VAL_PAIRS, seed: int = 0, batch_size: int = 256,
                 show_progress=False) -> dict:
    """The benchmark's one scorer (il_clip.py, eval_compositional.py: same digits for any model).
    encode_image(normalised [B, 3, S, S]), encode_text(ids [B, L]): the model's, on `batch_size`
    batches in a fixed order. -> percent (2 decimals): i2t / t2i R@1 on `n_val` val scenes (hit:
    same caption; none if n_val is 0) and, per category of shapes_benchmark(seed, n), the share of
    items whose positive strictly beats every negative; sugarcrepe_mean: mean of the 7."""
    tf = eval_transform(image_size)
    cats = [*SHAPES_CATEGORIES, "systematicity", "productivity"]
    bar = progress(total=n_val + n * len(cats), desc="shapes eval", unit="item",
                   disable=not show_progress)

    def embed(images, captions):
        ie = []
        for i in range(0, len(images), batch_size):
            batch = torch.stack([tf(im) for im in images[i:i + batch_size]])
            ie.append(encode_image(normalize_images(batch, device)).float().cpu())
        te = [encode_text(tokenizer(captions[i:i + batch_size]).to(device)).float().cpu()
              for i in range(0, len(captions), batch_size)]
        bar.update(len(images))
        return torch.cat(ie), torch.cat(te)

    def pct(hits, total):
        return round(100 * hits / total, 2)

    res = {}
    if n_val:
        scenes = [shapes_scene("val", i, seed=seed) for i in range(n_val)]
        caps = [s.caption for s in scenes]
        ie, te = embed([s.image for s in scenes], caps)
        sim = ie @ te.t()
        same = torch.tensor([[a == b for b in caps] for a in caps])
        res = {"i2t_r1": pct(same[torch.arange(n_val), sim.argmax(1)].sum().item(), n_val),
               "t2i_r1": pct(same[sim.argmax(0), torch.arange(n_val)].sum().item(), n_val)}
    bar.set_postfix_str("rendering the benchmark")
    bench = shapes_benchmark(seed=seed, n=n)
    for cat in cats:
        bar.set_postfix_str(cat)
        items = bench[cat]
        negs = [it["negatives"] if "negatives" in it else [it["negative_caption"]] for it in items]
        captions = [c for it, ng in zip(items, negs) for c in [it["caption"], *ng]]
        ie, te = embed([it["image"] for it in items], captions)
        per_item = te.split([1 + len(ng) for ng in negs])       # the positive first
        scores = [t @ ie[j] for j, t in enumerate(per_item)]
        res[cat] = pct(sum(bool((s[0] > s[1:]).all()) for s in scores), len(items))
    bar.close()
    pair_mean = sum(res[c] for c in SHAPES_CATEGORIES) / len(SHAPES_CATEGORIES)
    res["sugarcrepe_mean"] = round(pair_mean, 2)
    return {k: res[k] for k in SHAPES_METRICS if k in res}      # the order of every table of it


def shapes_classification(split: str = "train", index: int = 0, seed: int = 0,
                          image_size: int = SHAPES_IMAGE_SIZE):
    """(image, class index into SHAPE_NAMES) of a single-object image (any colour or size)."""
    rng = random.Random(f"shapes-cls/{seed}/{split}/{index}")
    label = rng.randrange(len(SHAPE_NAMES))
    obj = Obj(shape=SHAPE_NAMES[label], colour=rng.choice(COLOUR_NAMES), size=rng.choice(SIZE_NAMES))
    _place(rng, [obj], [], image_size)
    return render_scene([obj], rng, image_size), label


def shapes_captions(n: int = 5000, seed: int = 0) -> list:
    """Training captions to train a tokenizer on."""
    return [shapes_scene("train", i, seed).caption for i in range(n)]


# -----------------------------------------------------------------------------
# Tokenizer

def clip_clean(text: str) -> str:
    """OpenAI CLIP's caption cleaning before the BPE (simple_tokenizer.py's basic_clean and
    whitespace_clean): ftfy.fix_text (it also replaces lone surrogates, which the tokenizer cannot
    encode), html.unescape twice, whitespace runs -> " ", strip, lower-case: released weights saw
    `&amp;`, `it’s`, `ﬁ`, full-width, mojibake fixed."""
    # else fix_text would change nothing
    if not (text.isascii() and text.isprintable() and "&" not in text):
        text = html.unescape(html.unescape(ftfy.fix_text(text)))
    return " ".join(text.split()).lower()


SOT_TOKEN = "<|startoftext|>"
EOT_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
MAX_CAPTION_CHARS = 4096  # far past 77 tokens: captions are cut here before cleaning and tokenizing


class Tokenizer:
    """Captions -> LongTensor [B, context_length]: SOT, BPE ids of clip_clean(caption), EOT, pad id
    0. Truncation keeps EOT as the last token (OpenAI CLIP's `truncate=True`)."""

    def __init__(self, backend, kind: str, context_length: int = 77):
        backend = _special_tokens_not_in_text(backend)  # also for tokenizer.json files saved before
        if kind == "clip_bpe":
            # no normalizer: clip_clean did OpenAI's (a second NFC or the Rust lower-case, no final
            # sigma, changes ids); also for files saved before clip_clean
            backend.normalizer, backend.pre_tokenizer = None, _clip_normalizer_and_pretokenizer()[1]
        self.backend, self.kind, self.context_length = backend, kind, context_length
        self.sot_id, self.eot_id, self.pad_id = (backend.token_to_id(SOT_TOKEN),
                                                 backend.token_to_id(EOT_TOKEN), 0)
        self.vocab_size = backend.get_vocab_size()

    def __call__(self, texts) -> torch.Tensor:
        texts = [texts] if isinstance(texts, str) else texts
        out = torch.zeros(len(texts), self.context_length, dtype=torch.long)
        # a 10 MB caption costs no more than a long one
        texts = [clip_clean(t[:MAX_CAPTION_CHARS]) for t in texts]
        for row, enc in enumerate(self.backend.encode_batch(texts, add_special_tokens=False)):
            ids = [self.sot_id] + enc.ids[: self.context_length - 2] + [self.eot_id]
            out[row, : len(ids)] = torch.tensor(ids)
        return out

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        ids = ids[: ids.index(self.eot_id)] if self.eot_id in ids else ids
        return self.backend.decode([i for i in ids if i != self.sot_id]).strip()

    def save(self, directory: str):
        write_file(os.path.join(directory, "tokenizer.json"), json.dumps(
            {"kind": self.kind, "context_length": self.context_length,
             "tokenizer": json.loads(self.backend.to_str())}))

    @classmethod
    def load(cls, directory: str) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend
        path = os.path.join(directory, "tokenizer.json") if os.path.isdir(directory) else directory
        try:
            with open(path) as f:
                blob = json.load(f)
            backend = Backend.from_str(json.dumps(blob["tokenizer"]))
        except FileNotFoundError:
            raise DataError(f"{path}: tokenizer file not found") from None
        except Exception as e:
            # malformed JSON, no "tokenizer" key, a backend tokenizers cannot read
            raise DataError(f"{path}: not a tokenizer file written by this repo "
                            f"({type(e).__name__})") from None
        return cls(backend, blob["kind"], blob["context_length"])


def _special_tokens_not_in_text(backend):
    """The backend without `added_tokens` entries for SOT/EOT/pad/unk (still in the vocabulary):
    `tokenizers` matched "<|endoftext|>" inside a caption, an EOT id where pooling stops."""
    from tokenizers import Tokenizer as Backend
    blob = json.loads(backend.to_str())
    added = blob.get("added_tokens") or []
    blob["added_tokens"] = [t for t in added
                            if t["content"] not in {SOT_TOKEN, EOT_TOKEN, PAD_TOKEN, UNK_TOKEN}]
    return backend if len(blob["added_tokens"]) == len(added) else Backend.from_str(json.dumps(blob))


def _clip_normalizer_and_pretokenizer():
    from tokenizers import Regex, normalizers, pre_tokenizers
    # OpenAI CLIP: whitespace cleanup + lower-case (for the trained BPE; the CLIP BPE gets
    # clip_clean's text and no normalizer), then its word regex, then byte-level chars
    normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                       normalizers.Strip(), normalizers.Lowercase()])
    # no special-token alternatives (open_clip's SimpleTokenizer): a caption that contains the text
    # "<|endoftext|>" must not put an EOT id mid-sequence, where argmax pooling would stop;
    # contractions case-insensitive, as open_clip's re.IGNORECASE: "'ſ" (long s) is "'s" there
    pattern = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return normalizer, pre


def clip_bpe_tokenizer(vocab_path: str, context_length: int = 77) -> Tokenizer:
    """OpenAI CLIP's BPE (49408 tokens) from its `bpe_simple_vocab_16e6.txt.gz`."""
    from tokenizers import Tokenizer as Backend, decoders, models
    try:
        with gzip.open(vocab_path) as f:
            lines = f.read().decode("utf-8").split("\n")
    except FileNotFoundError:
        raise DataError(f"{vocab_path}: BPE vocabulary file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{vocab_path}: not a gzipped BPE merges file ({e})") from None
    merges = [tuple(m.split()) for m in lines[1:49152 - 256 - 2 + 1]]
    if len(merges) != 48894 or any(len(m) != 2 for m in merges):
        raise DataError(f"{vocab_path}: expected 48894 BPE merges, found a different file")
    # GPT-2/CLIP's reversible byte -> character table: printable bytes as themselves, then the rest
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = [chr(b) for b in printable] + [chr(256 + n) for n in range(256 - len(printable))]
    vocab = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges] + [SOT_TOKEN, EOT_TOKEN]
    backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=merges,
                                 end_of_word_suffix="</w>", continuing_subword_prefix="",
                                 unk_token=EOT_TOKEN))
    backend.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Replace("</w>", " ")])
    # SOT/EOT stay plain vocabulary (added tokens match in captions); Tokenizer sets pre-tokenizer
    return Tokenizer(backend, "clip_bpe", context_length)


def trained_bpe_tokenizer(captions, vocab_size: int = 1000, context_length: int = 77) -> Tokenizer:
    """A byte-level BPE (GPT-2 style) trained on the captions when no CLIP vocabulary is given, ids
    0 pad, 1 SOT, 2 EOT, 3 unk; all 256 bytes in the alphabet (no text unknown); CLIP's cleanup."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers
    if not (captions := [clip_clean(c) for c in captions if c and c.strip()]):
        raise DataError("cannot train a tokenizer: no captions")
    backend = Backend(models.BPE(unk_token=UNK_TOKEN))
    backend.normalizer, backend.decoder = _clip_normalizer_and_pretokenizer()[0], decoders.ByteLevel()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=[PAD_TOKEN, SOT_TOKEN, EOT_TOKEN, UNK_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(captions, trainer=trainer)
    return Tokenizer(backend, "trained_bpe", context_length)


def build_tokenizer(vocab_path: str | None = None, captions=None, vocab_size: int = 1000,
                    context_length: int = 77) -> Tokenizer:
    return (clip_bpe_tokenizer(vocab_path, context_length) if vocab_path
            else trained_bpe_tokenizer(captions or [], vocab_size, context_length))


# -----------------------------------------------------------------------------
# Transforms: PIL image -> uint8 tensor [3, S, S] (float on the device: normalize_images); a random
# transform takes `rng` (random.Random), so augmentation is a pure function of (seed, epoch, index):
# a resume sees the same pixels. `draft`: the shorter side a JPEG may decode to (make_sample).

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class Compose:
    def __init__(self, transforms):
        self.transforms, self.draft = transforms, getattr(transforms[0], "draft", None)

    def __call__(self, img, rng=None):
        rng = rng or random
        for t in self.transforms:
            img = t(img, rng)
        return img


class RandomResizedCrop:
    """torchvision's RandomResizedCrop (area in `scale`, log-uniform aspect in `ratio`, 10 tries,
    else the centred whole image clamped to `ratio`), bicubic to size x size; PIL resamples the crop
    by `box` (its filter may read just outside, as in the real scene; torchvision cuts first)."""

    def __init__(self, size, scale=(0.9, 1.0), ratio=(3 / 4, 4 / 3)):
        self.size, self.scale, self.ratio = size, scale, ratio
        # the smallest crop keeps >= size^2 pixels
        self.draft = math.ceil(size / math.sqrt(scale[0]))

    def __call__(self, img, rng):
        w, h = img.size
        for _ in range(10):
            area = w * h * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(math.log(self.ratio[0]), math.log(self.ratio[1])))
            cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if 0 < cw <= w and 0 < ch <= h:
                x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
                break
        else:                               # the fallback: a centred crop of the allowed aspect
            cw = round(h * max(self.ratio)) if w / h > max(self.ratio) else w
            ch = round(w / min(self.ratio)) if w / h < min(self.ratio) else h
            x, y = (w - cw) // 2, (h - ch) // 2
        return img.resize((self.size, self.size), Image.BICUBIC, box=(x, y, x + cw, y + ch))


class Resize:
    """torchvision's bicubic Resize(size) (OpenAI's and open_clip's eval): the shorter side becomes
    `size`, the longer int(size * long / short), truncated (640x480 at 224 -> 298x224, not 299)."""

    def __init__(self, size):
        self.size = self.draft = size

    def __call__(self, img, rng=None):
        w, h = img.size
        long = int(self.size * max(w, h) / min(w, h))
        new = (self.size, long) if w <= h else (long, self.size)
        return img if new == (w, h) else img.resize(new, Image.BICUBIC)


def _centre_offset(have: int, want: int) -> int:
    """torchvision's center_crop offset: round((have - want) / 2), half to even (a margin of 5
    starts at 2, one of 3 at 2); smaller: zero-padded, the odd pixel after (as PIL's crop)."""
    return int(round((have - want) / 2)) if have >= want else -((want - have) // 2)


class CenterCrop:
    def __init__(self, size):
        self.size = size

    def __call__(self, img, rng=None):
        w, h = img.size
        x, y = _centre_offset(w, self.size), _centre_offset(h, self.size)
        return img.crop((x, y, x + self.size, y + self.size))


class RandomFlip:
    """Horizontal flip, probability p (classification only: "left of" captions would be wrong)."""

    def __init__(self, p=0.5):
        self.p = p

    def __call__(self, img, rng):
        return img.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < self.p else img


class ToTensor:
    """PIL -> uint8 [3, H, W], contiguous. PIL keeps RGB as 4 bytes a pixel: packing one band at a
    time costs what packing RGB does, and lays the planes out channel-first with no transpose."""

    def __call__(self, img, rng=None):
        img = img if img.mode == "RGB" else img.convert("RGB")
        planes = [np.frombuffer(img.tobytes("raw", band), np.uint8) for band in "RGB"]
        return torch.from_numpy(np.stack(planes).reshape(3, img.height, img.width))


def normalize_images(images: torch.Tensor, device=None) -> torch.Tensor:
    """Loader images -> CLIP-normalised float32 on `device`: (x / 255 - mean) / std. uint8 moves as
    bytes (non_blocking if pinned): workers send a quarter of the bytes (timm's PrefetchLoader,
    FFCV). Three float32 passes: on CPU the per-pixel formula bit for bit. Float: as is."""
    x = images.to(device, non_blocking=True) if device is not None else images
    if x.dtype != torch.uint8:
        return x
    mean, std = (torch.tensor(v, dtype=torch.float32, device=x.device).view(-1, 1, 1)
                 for v in (CLIP_MEAN, CLIP_STD))
    return x.float().div_(255.0).sub_(mean).div_(std)


def train_transform(image_size: int, scale=(0.9, 1.0), flip: bool = False) -> Compose:
    """open_clip's training transform (RandomResizedCrop scale (0.9, 1), as CLIP), optional flip."""
    return Compose([RandomResizedCrop(image_size, scale), *([RandomFlip()] if flip else []),
                    ToTensor()])


def eval_transform(image_size: int) -> Compose:
    return Compose([Resize(image_size), CenterCrop(image_size), ToTensor()])


# -----------------------------------------------------------------------------
# Samples, batches and bad input. Every reader turns a record of the user's data into a sample
# {"image": uint8 [3, S, S], "caption", "tree" (PTB or None), "key"} or, if it is bad, a
# `Skip(reason, where)`. Skips travel in the batch (batch["_skips"], removed by the loader), so the
# main process counts and logs them whatever the number of workers. A run that skips more than
# `max_skip_fraction` (default 10%) of what it reads stops with a DataError: such data is a wrong
# path or a broken download, and training on the rest would silently be another experiment.

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
MAX_SKIP_FRACTION = 0.1
# the fraction is checked at every batch once this many samples (or an epoch's) were read
SKIP_CHECK_MIN = 50
SKIP_LOG_LINES = 20  # the first skips are logged one by one, later ones only counted
log = logging.getLogger("data")


@dataclass
class Skip:
    reason: str  # a short category, e.g. "undecodable image"; counted in loader.skip_reasons
    where: str  # the file / key it came from


def _sample_rng(seed: int, epoch: int, index) -> random.Random:
    """Per-sample augmentation RNG from (seed, epoch, index or key): resume is exact."""
    return random.Random(f"aug/{seed}/{epoch}/{index}")


def make_sample(image, caption, tree, key: str, transform, rng):
    """The one place where a record becomes a sample or a Skip. `image`: path, bytes or None."""
    if image is None:
        return Skip("caption with no image", key)
    if isinstance(image, Skip):         # refused when its path was resolved (_resolve_image)
        return Skip(image.reason, f"{key} ({image.where})")
    if caption is None or not caption.strip():
        return Skip("image with no caption" if caption is None else "empty caption", key)
    try:
        img = Image.open(io.BytesIO(image) if isinstance(image, bytes) else image)
        if img.format == "JPEG" and getattr(transform, "draft", None):
            # libjpeg's scaled IDCT: an image >= 2x the transform's need decodes at 1/2, 1/4 or 1/8
            # (the largest scale keeping the shorter side >= draft). Pixels differ from a full
            # decode + bicubic (accepted: the transform downsamples anyway)
            img.draft("RGB", (transform.draft, transform.draft))
        img.load()
        # convert() of RGB is a copy
        x = transform(img if img.mode == "RGB" else img.convert("RGB"), rng)
    except FileNotFoundError:
        return Skip("missing image file", f"{key} ({image})")
    except Exception as e:
        # PIL raises many types for bad bytes (OSError, SyntaxError, ValueError, ...)
        return Skip("undecodable image", f"{key} ({type(e).__name__}: {e})"[:200])
    return {"image": x, "caption": " ".join(caption.split()), "tree": tree or None, "key": key}


@dataclass
class _Slot:
    index: int      # which of _SharedBatches' slots holds the batch's images
    shape: tuple


class _SharedBatches:
    """One DataLoader iterator's image batches in shared-memory slots made once, reused: a worker
    stacks a batch into a free slot and sends its number; the main process copies it out (pinned for
    CUDA) and frees it. Fresh shared memory per batch page-faults on first touch: 0.17 ms per 224 px
    image on a 2-CPU VM, 7% of the decode (RESULTS.md). With prefetch_factor x workers batches in
    flight and 1 being copied out, slots never run out; a batch that fits none gets fresh memory."""

    def __init__(self, n_slots: int, slot_bytes: int):
        self.memory = torch.empty(n_slots, slot_bytes, dtype=torch.uint8).share_memory_()
        # 1 from a worker's claim until the main process copied
        self.busy = multiprocessing.Array("b", n_slots)

    def claim(self, shape: tuple):
        """In a worker: (slot number, a uint8 view of `shape` into it), or None."""
        n = math.prod(shape)
        if n <= self.memory.shape[1]:
            with self.busy.get_lock():
                busy = self.busy.get_obj()
                for i in range(len(busy)):
                    if not busy[i]:
                        busy[i] = 1
                        return i, self.memory[i, :n].view(shape)
        return None

    def take(self, slot: _Slot, pin: bool) -> torch.Tensor:
        """In the main process: the slot's images, copied out; the slot is free again."""
        # numpy's allocator reuses freed memory (a fresh torch.empty faults on every page again)
        out = (torch.empty(slot.shape, dtype=torch.uint8, pin_memory=True) if pin
               else torch.from_numpy(np.empty(slot.shape, np.uint8)))
        # one thread
        np.copyto(out.numpy(), self.memory[slot.index, :out.numel()].view(slot.shape).numpy())
        self.busy[slot.index] = 0
        return out


_worker_slots = None    # a worker's _SharedBatches (set by _init_worker)


def _stack_images(images: list) -> tuple:
    """torch.stack through numpy, one thread (torch's compete with training's). In a worker into
    shared memory, so sending copies nothing: a free _SharedBatches slot (+ its _Slot) or fresh."""
    first, shape = images[0], (len(images), *images[0].shape)
    claimed = (_worker_slots.claim(shape)
               if _worker_slots is not None and first.dtype == torch.uint8 else None)
    if claimed is not None:
        out = claimed[1]
    elif torch.utils.data.get_worker_info() is None:
        # numpy's allocator: fewer page faults
        out = torch.from_numpy(np.empty(shape, first.numpy().dtype))
    else:
        out = first.new(first._typed_storage()._new_shared(first.numel() * len(images),
                                                           device=first.device))
    np.stack([x.numpy() for x in images], out=out.resize_(shape).numpy())
    return out, _Slot(claimed[0], shape) if claimed is not None else None


def collate(samples: list, tokenizer=None, batch_extra=None, epoch: int = 0) -> dict:
    """Samples -> batch; Skips (and None) go to batch["_skips"] as (reason, where). `batch_extra`
    (picklable, (batch, epoch) -> dict) adds entries in workers; by epoch, replayed on resume."""
    good = [s for s in samples if isinstance(s, dict)]
    empty = torch.zeros(0, 3, 0, 0, dtype=torch.uint8)
    images, slot = _stack_images([s["image"] for s in good]) if good else (empty, None)
    batch = {"image": images, **{k: [s.get(k) for s in good] for k in ("caption", "tree", "key")},
             "_skips": [(s.reason, s.where) if isinstance(s, Skip) else ("bad sample", "?")
                        for s in samples if not isinstance(s, dict)]}
    if good and "label" in good[0]:
        batch["label"] = torch.tensor([s["label"] for s in good])
    if tokenizer is not None and good:
        batch["text"] = tokenizer(batch["caption"])
    if batch_extra is not None and good:
        batch.update(batch_extra(batch, epoch))
    if slot is not None:
        batch["image"] = slot   # sent as its slot number; the loader copies the images out
    return batch


# -----------------------------------------------------------------------------
# Map-style datasets: shapes (generated) and files listed by a CSV, Karpathy JSON or ImageFolder

class ShapesDataset(torch.utils.data.Dataset):
    """One shapes split, generated at the model's resolution, not augmented (a crop could cut an
    object away, a flip swaps left and right, a jitter changes colour names): each a fresh draw."""

    def __init__(self, split="train", size=None, seed=0, image_size=SHAPES_IMAGE_SIZE):
        self.split, self.seed, self.image_size = split, seed, image_size
        self.size, self.to_tensor, self.epoch = size or SHAPES_SIZES[split], ToTensor(), 0

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        scene = shapes_scene(self.split, index, self.seed, self.image_size)
        return {"image": self.to_tensor(scene.image), "caption": scene.caption, "tree": scene.tree,
                "key": f"{self.split}{index:08d}"}


# One listed sample: image path (None if not listed), caption, tree, key (the image's), label
Item = collections.namedtuple("Item", "image caption tree key label", defaults=(None,))


class FileDataset(torch.utils.data.Dataset):
    """Map-style dataset over `Item`s; images are read and transformed in __getitem__."""

    def __init__(self, items: list, transform, seed: int = 0):
        self.items = items
        self.transform = transform
        self.seed = seed
        self.epoch = 0

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        it = self.items[index]
        s = make_sample(*it[:4], self.transform, _sample_rng(self.seed, self.epoch, it.key))
        if isinstance(s, dict) and it.label is not None:
            s["label"] = it.label
        return s


def _resolve_image(path, base: str, confined: bool = False):
    """`path` against `base`; with --image_root (`confined`), a path that resolves outside it
    (`../../x.png`, `/etc/passwd`, a symlink out) becomes a Skip: counted, never read."""
    if not path:
        return None
    full, root = os.path.normpath(os.path.join(base, path)), os.path.realpath(base)
    if confined and os.path.commonpath([os.path.realpath(full), root]) != root:
        return Skip("image path outside --image_root", full)
    return full


def csv_items(path: str, image_root: str | None = None, img_key: str = "filepath",
              caption_key: str = "title", separator: str | None = None,
              tree_key: str = "tree") -> list:
    """open_clip's CSV/TSV: a header, columns `filepath`, `title` (overridable), tab-separated if
    the header has a tab, else commas; paths relative to `image_root` or the CSV folder; optional
    `tree` column (PTB)."""
    base = image_root or os.path.dirname(os.path.abspath(path))
    try:
        # -sig: a byte-order mark is not part of a name
        with open(path, newline="", encoding="utf-8-sig") as f:
            sep = separator or ("\t" if "\t" in f.readline() else ",")   # from the header line
            f.seek(0)
            reader = csv.DictReader(f, delimiter=sep)
            columns = reader.fieldnames or []
            if (missing := [c for c in (img_key, caption_key) if c not in columns]):
                raise DataError(f"{path}: malformed CSV: no column {missing[0]!r} "
                                f"(columns: {columns}; name the columns with --csv_img_key / "
                                f"--csv_caption_key)")
            name = os.path.basename(path)  # key: the image path as listed, else file name and line
            items = [Item(_resolve_image(row[img_key], base, image_root is not None),
                          row[caption_key], row.get(tree_key), row[img_key] or f"{name}:{n + 2}")
                     for n, row in enumerate(reader)]
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (csv.Error, UnicodeDecodeError) as e:
        raise DataError(f"{path}: malformed CSV ({e})") from None
    return items


def karpathy_images(json_path: str, image_root: str | None, split: str) -> list:
    """[(image path, key = filepath/filename sans extension, [(raw caption, tree or None), ...])] of
    a split of a Karpathy JSON; "train" also takes "restval" (COCO's usual 113k)."""
    blob = read_json(json_path)
    images = blob.get("images") if isinstance(blob, dict) else None
    if not isinstance(images, list):
        raise DataError(f"{json_path}: malformed Karpathy JSON: no 'images' list")
    root = image_root or os.path.dirname(os.path.abspath(json_path))
    wanted = {"train", "restval"} if split == "train" else {split}
    out = []
    for n, im in enumerate(images):
        if not isinstance(im, dict) or not isinstance(im.get("filename"), str) or \
                not isinstance(im.get("filepath", ""), str):
            raise DataError(f"{json_path}: malformed Karpathy JSON: images[{n}] has no "
                            "'filename' string")
        if im.get("split") in wanted:
            sents = [(s.get("raw"), s.get("tree")) for s in im.get("sentences", [])
                     if isinstance(s, dict)]
            name = os.path.join(im.get("filepath", ""), im["filename"])
            out.append((_resolve_image(name, root, image_root is not None),
                        os.path.splitext(name)[0], sents))
    if not out:
        raise DataError(f"{json_path}: no images with split {split!r} (splits present: "
                        f"{', '.join(sorted({str(im.get('split')) for im in images}))})")
    return out


def image_folder(root: str):
    """root/class_name/*.{jpg,jpeg,png,webp} -> (paths, labels, classes): every sub-folder sorted,
    empty ones too (so class indices do not shift)."""
    if not os.path.isdir(root):
        raise DataError(f"{root}: no such directory")
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    found = [(os.path.join(root, c, name), label) for label, c in enumerate(classes)
             for name in sorted(os.listdir(os.path.join(root, c)))
             if name.rsplit(".", 1)[-1].lower() in IMAGE_EXTS]
    if not found:
        raise DataError(f"{root}: no images in class folders (expected root/class_name/*.jpg)")
    return [p for p, _ in found], [y for _, y in found], classes


# -----------------------------------------------------------------------------
# Webdataset / img2dataset tar shards, read with `tarfile` in streaming mode. A record is the group
# of consecutive members sharing a key (the member name up to the first dot of its base name):
# {"__key__", "__shard__", "jpg": bytes, "txt": bytes, ...}. A truncated or unreadable tar yields
# one record {"__error__": ...} and stops; its half-read group is dropped (counted).

def expand_braces(pattern: str) -> list:
    """`dir/{00000..00003}.tar` -> 4 names by `braceexpand` (as webdataset and open_clip: {a,b},
    {1..10..3} / {a..e} ranges, zero padding, escapes); unbalanced braces are a DataError."""
    try:
        return list(braceexpand(pattern))
    except UnbalancedBracesError:
        raise DataError(f"{pattern}: unbalanced braces") from None


def tar_records(path: str, keep_exts=None):
    """Records of one tar, streaming; keep_exts: read only these members' bytes (others: b"")."""
    def want(name):     # the extension after the base name's first dot, as the record key splits it
        return keep_exts is None or name.rpartition("/")[2].partition(".")[2].lower() in keep_exts

    done = 0
    try:
        for rec in _group_records(path, _plain_tar_members(path, want)):
            yield rec
            done += 1
    except _NotPlainTar:
        # compressed, extension headers, damage: tarfile reads the rest again, and words any error
        yield from itertools.islice(_group_records(path, _tarfile_members(path, want)), done, None)


def _group_records(path: str, members):
    cur = None
    try:
        for name, blob in members:
            folder, base = os.path.split(name)
            stem, _, ext = base.partition(".")
            key = f"{folder}/{stem}" if folder else stem
            if cur is None or cur["__key__"] != key:
                if cur is not None:
                    yield cur
                cur = {"__key__": key, "__shard__": path}
            cur[ext.lower()] = blob
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        what = "empty tar" if cur is None and "empty" in str(e) else "truncated or unreadable tar"
        yield {"__key__": cur["__key__"] if cur else "", "__shard__": path,
               "__error__": f"{what} ({e})"}
        return
    yield (cur if cur is not None
           else {"__key__": "", "__shard__": path, "__error__": "empty tar (no members)"})


def _tarfile_members(path: str, want):
    """(name, bytes) of a tar's files by tarfile (any compression, pax, GNU); b"" if unwanted."""
    with tarfile.open(path, mode="r|*") as tf:
        for m in tf:
            if not m.isfile():
                continue
            blob = b""
            if want(m.name):
                # the bytes straight from the stream: an extractfile reader per member cost ~45%
                blob = tf.fileobj.read(m.size) if m.sparse is None else tf.extractfile(m).read()
                if len(blob) < m.size:
                    raise tarfile.ReadError("unexpected end of data")
            yield m.name, blob
        # tarfile stops quietly at a cut or damaged header: an uncompressed tar must hold its end
        # marker (two zero blocks) where tarfile stopped, else the rest would be lost without a word
        if tf.fileobj.comptype == "tar":
            with open(path, "rb") as f:
                f.seek(tf.offset)
                end = f.read(2 * tarfile.BLOCKSIZE)
            if (len(end) < 2 * tarfile.BLOCKSIZE
                    or end[:tarfile.BLOCKSIZE] != bytes(tarfile.BLOCKSIZE)):
                raise tarfile.ReadError(
                    "unexpected end of data" if len(end) < 2 * tarfile.BLOCKSIZE
                    else f"damaged member header at byte {tf.offset}")


class _NotPlainTar(Exception):
    """Raised by _plain_tar_members for a tar it leaves to tarfile."""


def _plain_tar_members(path: str, want):
    """_tarfile_members for img2dataset's and webdataset's tars (uncompressed, ustar, files and
    folders) from the 512-byte headers, a fifth of tarfile's cost (~5% of a worker's time). Others
    (compression, pax/GNU long names, links, bad checksum, early end) raise _NotPlainTar first."""
    block = tarfile.BLOCKSIZE
    # an OSError here is the record {"__error__"} tarfile's open would give
    with open(path, "rb") as f:
        while True:
            header = f.read(block)
            if header == bytes(block):
                # as tarfile: the zero block must be followed by a second block
                if len(f.read(block)) < block:
                    raise _NotPlainTar
                return
            try:
                size, checksum = (int(header[124:136].strip(b"\0 ") or b"0", 8),
                                  int(header[148:156].strip(b"\0 "), 8))
            except ValueError:      # base-256 numbers, garbage, a header cut short
                raise _NotPlainTar from None
            if (len(header) < block or header[257:262] != b"ustar" or header[156:157] not in b"05\0"
                    or checksum != 256 + sum(header[:148]) + sum(header[156:])):
                raise _NotPlainTar
            name, prefix = (header[a:b].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                            for a, b in ((0, 100), (345, 500)))
            name, kind = f"{prefix}/{name}" if prefix else name, header[156:157]
            # a folder, as tarfile: no data to skip
            if kind == b"5" or kind == b"\0" and name.endswith("/"):
                continue
            wanted = want(name)
            blob = f.read(size) if wanted else b""
            if len(blob) < size * wanted:
                raise _NotPlainTar
            f.seek(size - len(blob) + -size % block, os.SEEK_CUR)
            yield name, blob


def decode_record(rec: dict, transform, rng):
    """A tar record -> sample or Skip."""
    where = f"{rec['__shard__']}:{rec['__key__']}"
    if "__error__" in rec:
        return Skip(rec["__error__"].split(" (")[0], f"{where} {rec['__error__']}")
    image = next((rec[e] for e in IMAGE_EXTS if e in rec), None)
    try:
        caption = rec["txt"].decode("utf-8") if "txt" in rec else None
        tree = rec["tree"].decode("utf-8").strip() if "tree" in rec else None
    except UnicodeDecodeError:
        return Skip("caption not UTF-8", where)
    s = make_sample(image, caption, tree, rec["__key__"], transform, rng)
    if isinstance(s, Skip):
        s.where = f"{rec['__shard__']}:{s.where}"
    return s


def _shard_count(path: str) -> int | None:
    """Samples in a shard: its img2dataset _stats.json ("successes"), else sizes.json, else None."""
    folder, name = os.path.split(path)
    stats = os.path.join(folder, name.rsplit(".", 1)[0] + "_stats.json")
    if os.path.exists(stats):
        blob = read_json(stats)
        if isinstance(blob, dict) and isinstance(n := blob.get("successes", blob.get("count")), int):
            return n
        raise DataError(f"{stats}: malformed img2dataset stats (no 'successes' count)")
    sizes = os.path.join(folder, "sizes.json")
    blob = read_json(sizes) if os.path.exists(sizes) else None
    return blob.get(name) if isinstance(blob, dict) else None


def _shuffled(records, size: int, rng: random.Random):
    """Shuffle buffer of `size` records (raw bytes, before decoding)."""
    buf = []
    for r in records:
        if len(buf) < size:
            buf.append(r)
            continue
        i = rng.randrange(size)
        yield buf[i]
        buf[i] = r
    rng.shuffle(buf)
    yield from buf


# -----------------------------------------------------------------------------
# --data specs: presets, shard patterns, files, folders

# name -> how to make its shards: the released URL list (+ the header line img2dataset needs, which
# Google's CC3M/CC12M TSVs lack) and img2dataset.download()'s flags (img2dataset/main.py; tested).
DATA_PRESETS = {
    "cc3m": "sed -i '1s/^/caption\\turl\\n/' cc3m.tsv && img2dataset --url_list cc3m.tsv "
            "--input_format tsv --url_col url --caption_col caption",
    "cc12m": "sed -i '1s/^/url\\tcaption\\n/' cc12m.tsv && img2dataset --url_list cc12m.tsv "
             "--input_format tsv --url_col url --caption_col caption",
    "datacomp": "img2dataset --url_list datacomp_metadata/ --input_format parquet --url_col url "
                "--caption_col text",
}


def img2dataset_command(name: str, folder: str) -> str:
    """The shell command that writes preset `name`'s webdataset shards into `folder`."""
    return (f"{DATA_PRESETS[name]} --output_format webdataset --output_folder {folder} "
            f"--image_size 256 --resize_mode keep_ratio --processes_count 16 --thread_count 64")


def _tar_source(shards: list) -> dict:
    counts = [_shard_count(s) for s in shards]
    return {"kind": "tar", "shards": shards, "num_samples": None if None in counts else sum(counts)}


def resolve_data(spec: str, image_root: str | None = None) -> dict:
    """What a --data spec names: {"kind": shapes|tar|csv|karpathy|imagefolder, ...} with "shards" +
    "num_samples" (tar) or "path" + "image_root" (the others); a DataError if nothing."""
    if spec == "shapes" or spec.startswith("shapes:"):
        return {"kind": "shapes", **parse_shapes_spec(spec)}
    if spec in DATA_PRESETS:
        root = os.environ.get("DATA_ROOT", "./data")
        folder = os.path.join(root, spec)
        if not (shards := sorted(glob.glob(os.path.join(folder, "*.tar")))):
            raise DataError(f"{spec}: no webdataset shards (*.tar) in {folder} ($DATA_ROOT={root});"
                            f" make them with: {img2dataset_command(spec, folder)}")
        return _tar_source(shards)
    if "{" in spec:
        if not (shards := expand_braces(spec)):
            raise DataError(f"{spec}: the brace pattern names no shard")
        if (missing := [s for s in shards if not os.path.isfile(s)]):
            raise DataError(f"{spec}: {len(missing)} of {len(shards)} shards do not exist, "
                            f"first: {missing[0]}")
        return _tar_source(shards)
    if not os.path.exists(spec):
        # a near-miss of a known name (shapse, cc3n, shape:seed=1) is suggested
        name, colon, options = spec.partition(":")
        near = difflib.get_close_matches(name, ["shapes", *DATA_PRESETS], n=1, cutoff=0.7)
        hint = f" (did you mean {near[0]}{colon}{options}?)" if near else ""
        raise DataError(f"{spec}: no such file or directory{hint}")
    if os.path.isdir(spec):
        if shards := sorted(glob.glob(os.path.join(spec, "*.tar"))):
            return _tar_source(shards)
        if any(os.path.isdir(os.path.join(spec, d)) for d in os.listdir(spec)):
            return {"kind": "imagefolder", "path": spec, "image_root": image_root}
        raise DataError(f"{spec}: directory has neither .tar shards nor class folders")
    kind = {"tar": "tar", "csv": "csv", "tsv": "csv", "json": "karpathy"}.get(
        spec.rsplit(".", 1)[-1].lower())
    if kind is None:
        raise DataError(f"{spec}: unknown data format (expected shapes, cc3m/cc12m/datacomp, "
                        f".tar shards, .csv/.tsv, a Karpathy .json or an ImageFolder directory)")
    return (_tar_source([spec]) if kind == "tar"
            else {"kind": kind, "path": spec, "image_root": image_root})


def file_items(src: dict, split: str, csv_options: dict) -> list:
    if src["kind"] == "csv":
        return csv_items(src["path"], src["image_root"], **csv_options)
    if src["kind"] == "karpathy":
        # an Item per sentence, keyed by the image (retrieval groups by key); none: one, skipped
        return [item for path, key, sents in karpathy_images(src["path"], src["image_root"], split)
                for item in [Item(path, raw, tree, key) for raw, tree in sents]
                or [Item(path, None, None, key)]]
    paths, labels, classes = image_folder(src["path"])   # caption: the class name, '_' as spaces
    return [Item(p, classes[y].replace("_", " "), None, os.path.relpath(p, src["path"]), y)
            for p, y in zip(paths, labels)]


# -----------------------------------------------------------------------------
# Loaders. Both give dict batches, keep their position as a JSON-able state (epoch and
# batches consumed) so a resumed run continues with exactly the next batch, and count skips.

def _init_worker(slots, worker_id):
    """DataLoader worker_init_fn: the iterator's _SharedBatches; SIGTERM ignored (see lifecycle)."""
    global _worker_slots
    _worker_slots = slots
    worker_ignores_sigterm()


# a loader's state_dict as lifecycle.read_checkpoint checks it on resume (a MapLoader: no records)
LOADER_STATE = {"epoch": int, "batches_done": int, "skipped?": int, "good?": int, "dropped?": int,
                "skip_reasons?": {...: int}, "records_done?": [int], "last_worker?": int,
                "num_workers?": int, "world_size?": int}


class _Loader:
    def __init__(self, batch_size, num_samples, tokenizer=None, train=True, rank=0, world_size=1,
                 num_workers=0, seed=0, drop_last=True, name="data",
                 max_skip_fraction=MAX_SKIP_FRACTION, counted_by="", image_size=None):
        self.name = name
        self.batch_size = batch_size
        self.tokenizer = tokenizer
        self.train = train
        self.rank = rank
        self.world_size = world_size
        self.num_workers = num_workers
        self.seed = seed
        self.drop_last = drop_last
        self.max_skip_fraction = max_skip_fraction
        self.epoch = 0
        self.batches_done = 0
        self.good = 0
        self.skipped = 0
        self.dropped = 0  # dropped: drop_last
        self.skip_reasons = collections.Counter()
        self.num_samples = num_samples
        self.check_min = (max(1, min(SKIP_CHECK_MIN, num_samples // world_size)) if num_samples
                          else SKIP_CHECK_MIN)
        if drop_last and num_samples is not None and num_samples < batch_size * world_size:
            raise DataError(f"{name}: {num_samples} samples{counted_by}, fewer than one "
                            f"global batch ({batch_size} x {world_size} ranks)")
        # pinned batches: normalize_images' non_blocking copy is truly async, overlapping the step
        self.pin_memory, self.batch_extra = False, None     # batch_extra: see collate()
        # image_size (what the transform gives) sizes the workers' _SharedBatches slots; None: none
        self.image_bytes = 3 * image_size ** 2 if image_size else 0

    def set_epoch(self, epoch):
        if epoch != self.epoch:
            self.epoch, self.batches_done = epoch, 0
            self._new_epoch()

    def _new_epoch(self):
        """Hook for loaders that keep per-epoch state (ShardLoader resets its worker positions)."""

    def __iter__(self):
        """The rest of the current epoch; afterwards the loader points at the next epoch."""
        fresh, n_batches = self.batches_done == 0, 0
        dataset, how = self._epoch(fresh)
        # prefetch_factor 2
        slots = (_SharedBatches(2 * self.num_workers + 1, self.batch_size * self.image_bytes)
                 if self.num_workers and self.image_bytes else None)
        # a private generator: DataLoader otherwise seeds its workers from the global torch RNG at
        # every iterator, so a resume (one iterator more) would shift a fork's dropout; not samples
        dl = torch.utils.data.DataLoader(
            dataset, num_workers=self.num_workers, persistent_workers=False,
            pin_memory=self.pin_memory, worker_init_fn=functools.partial(_init_worker, slots),
            generator=torch.Generator().manual_seed(self.seed * 100_003 + self.epoch), **how)
        for batch in start_workers(dl):
            if isinstance(batch["image"], _Slot):
                batch["image"] = slots.take(batch["image"], self.pin_memory)
            self._advance(batch)
            self._account(batch)
            if batch["caption"]:
                n_batches += 1
                yield batch
        self._check_skips()
        if fresh and n_batches == 0:
            # too little data (a batch larger than the data, all samples bad, no shard for the rank)
            raise DataError(f"{self.name}: rank {self.rank} got no batch in a whole epoch "
                            f"(samples: {self.good} good, {self.skipped} skipped, {self.dropped} "
                            f"dropped by drop_last; batch {self.batch_size} x {self.world_size} "
                            f"ranks x {max(1, self.num_workers)} workers)")
        self.set_epoch(self.epoch + 1)

    def forever(self):
        """Batches across epochs, no end (step-based loops); an empty epoch raises, never spins."""
        while True:
            yield from self

    def _account(self, batch: dict):
        """Count the batch's samples and skips (logging the first); stop past max_skip_fraction."""
        for reason, where in batch.pop("_skips"):
            if self.skipped < SKIP_LOG_LINES:
                log.warning("data: skipped %s: %s", reason, where)
            self.skipped += 1
            self.skip_reasons[reason] += 1
        self.good += len(batch["caption"])
        self.dropped += batch.pop("_dropped", 0)
        if self.good + self.skipped + self.dropped >= self.check_min:
            self._check_skips()  # as batches are read: a run shorter than an epoch is checked too

    def _check_skips(self):
        seen = self.good + self.skipped + self.dropped
        if seen and self.skipped > self.max_skip_fraction * seen:
            common = ", ".join(f"{r} x{n}" for r, n in self.skip_reasons.most_common(3))
            raise DataError(f"{self.name}: skipped {self.skipped} of {seen} samples read "
                            f"({100 * self.skipped / seen:.0f}%; {self.good} used, {self.dropped} "
                            f"dropped by drop_last), more than "
                            f"max_skip_fraction={self.max_skip_fraction} ({common})")

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self.batches_done, "skipped": self.skipped,
                "good": self.good, "dropped": self.dropped, "skip_reasons": dict(self.skip_reasons)}

    def load_state_dict(self, state: dict):
        self.epoch, self.batches_done = int(state["epoch"]), int(state["batches_done"])
        self.skipped, self.good, self.dropped = (int(state.get(k, 0))
                                                 for k in ("skipped", "good", "dropped"))
        self.skip_reasons = collections.Counter(state.get("skip_reasons", {}))


class MapLoader(_Loader):
    """DDP loader over a map-style dataset: a permutation by (seed, epoch), the same on every rank,
    its tail cut so all ranks get as many full batches; rank r gets indices r, r + W, r + 2W ..."""

    def __init__(self, dataset, batch_size, **options):
        super().__init__(batch_size, len(dataset), **options)
        self.dataset = dataset

    def _rank_batches(self) -> list:
        n, per_step = len(self.dataset), self.batch_size * self.world_size
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(n, generator=g).tolist() if self.train else list(range(n))
        mine = order[: n // per_step * per_step if self.drop_last else n][self.rank::self.world_size]
        return [mine[i:i + self.batch_size] for i in range(0, len(mine), self.batch_size)]

    def __len__(self):
        return len(self._rank_batches())

    def _epoch(self, fresh: bool):
        """The DataLoader's dataset and batching for the rest of the epoch."""
        if fresh and self.drop_last:    # the tail cut to whole global batches, this rank's share
            kept = (len(self.dataset) // (self.batch_size * self.world_size)
                    * self.batch_size * self.world_size)
            self.dropped += len(range(kept, len(self.dataset))[self.rank::self.world_size])
        if hasattr(self.dataset, "epoch"):
            self.dataset.epoch = self.epoch
        return self.dataset, dict(
            batch_sampler=self._rank_batches()[self.batches_done:],
            collate_fn=functools.partial(collate, tokenizer=self.tokenizer,
                                         batch_extra=self.batch_extra, epoch=self.epoch))

    def _advance(self, batch: dict):
        self.batches_done += 1


class ShardStream(torch.utils.data.IterableDataset):
    """One (rank, dataloader worker) slot's share of an epoch's shards, as batches. S = world_size x
    max(1, num_workers) slots, slot = rank x workers + worker. Slot s reads shards s, s + S, ... of
    the list shuffled by (seed, epoch), the same on every rank; with fewer shards than slots, each
    slot reads all shards, keeping records s, s + S, ...: one slot reads each record. `resampled`:
    slot s draws ceil(#shards / S) shards with replacement by (seed, epoch, slot): data for all.
    Shuffled (train) before decoding: a resumed worker replays its records undecoded."""

    def __init__(self, loader, shards, transform, resampled, shuffle_buffer):
        for k in ("batch_size", "tokenizer", "seed", "train", "rank", "world_size", "drop_last"):
            # a copy of the loader's settings: workers get this object
            setattr(self, k, getattr(loader, k))
        self.shards = shards
        self.transform = transform
        self.resampled = resampled
        self.shuffle_buffer = shuffle_buffer
        self.workers, self.epoch, self.worker_offset = max(1, loader.num_workers), 0, 0
        # per logical worker: records consumed
        self.records_done, self.batch_extra = [0] * self.workers, None

    def _records(self, slot: int, n_slots: int):
        if self.resampled:
            rng = random.Random(f"resample/{self.seed}/{self.epoch}/{slot}")
            shards, stride = [rng.choice(self.shards)
                              for _ in range(-(-len(self.shards) // n_slots))], False
        else:
            shards = list(self.shards)
            if self.train:
                random.Random(f"shards/{self.seed}/{self.epoch}").shuffle(shards)
            stride = len(shards) < n_slots
            shards = shards if stride else shards[slot::n_slots]
        records = (r for shard in shards for r in tar_records(shard))
        if stride:
            records = (r for i, r in enumerate(records) if i % n_slots == slot)
        if self.train and self.shuffle_buffer > 1:
            records = _shuffled(records, self.shuffle_buffer,
                                random.Random(f"buffer/{self.seed}/{self.epoch}/{slot}"))
        return records

    def _batch(self, samples: list, logical: int, records: int, dropped: int = 0) -> dict:
        return {**collate(samples, self.tokenizer, self.batch_extra, self.epoch),
                "_dropped": dropped, "_meta": {"worker": logical, "records": records}}

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        logical = ((info.id if info else 0) + self.worker_offset) % self.workers
        slot, n_slots = self.rank * self.workers + logical, self.world_size * self.workers
        done = self.records_done[logical]
        pending, n_good, n = [], 0, done
        for n, rec in enumerate(itertools.islice(self._records(slot, n_slots), done, None), done + 1):
            s = decode_record(rec, self.transform, _sample_rng(self.seed, self.epoch, rec["__key__"]))
            pending.append(s)
            n_good += isinstance(s, dict)
            if n_good == self.batch_size:
                yield self._batch(pending, logical, n)
                pending, n_good = [], 0
        # the last partial batch (its samples dropped with drop_last; skips still reported)
        if pending:
            kept = [s for s in pending if not (self.drop_last and isinstance(s, dict))]
            yield self._batch(kept, logical, n, dropped=len(pending) - len(kept))


class ShardLoader(_Loader):
    """Streaming loader over tar shards (ShardStream: who reads what). Ranks may get different
    numbers of samples an epoch (shards differ in size); an epoch is per rank and `forever()` rolls
    into the next, so a step-based loop never waits for another rank (an epoch loop with DDP can
    desynchronise ranks: use `resampled=True` and a step count). State: also each worker's records
    and the last batch's worker: a resume replays records undecoded, same workers x ranks needed."""

    def __init__(self, shards, batch_size, transform=None, resampled=False, shuffle_buffer=1000,
                 num_samples=None, **options):
        if not shards:
            raise DataError(f"{options.get('name', 'data')}: no shard to read")
        super().__init__(batch_size, num_samples, counted_by=" (from the shards' counts)", **options)
        transform = transform or eval_transform(SHAPES_IMAGE_SIZE)
        self.stream = ShardStream(self, shards, transform, resampled, shuffle_buffer)
        self._new_epoch()

    def _new_epoch(self):
        self.records_done, self.last_worker = [0] * self.stream.workers, self.stream.workers - 1

    def __len__(self):
        """Nominal batches per rank and epoch (from the shard counts); TypeError when unknown."""
        if self.num_samples is None:
            raise TypeError("number of batches unknown: the shards have no _stats.json / sizes.json")
        return self.num_samples // (self.batch_size * self.world_size)

    def _epoch(self, fresh: bool):
        s = self.stream
        s.epoch, s.records_done, s.batch_extra = self.epoch, list(self.records_done), self.batch_extra
        s.worker_offset = (self.last_worker + 1) % s.workers
        # the worker's batch as is (not default_convert's walk)
        return s, dict(batch_size=None, collate_fn=dict)

    def _advance(self, batch: dict):
        meta = batch.pop("_meta")
        self.records_done[meta["worker"]], self.last_worker = meta["records"], meta["worker"]
        self.batches_done += bool(batch["caption"])

    def state_dict(self) -> dict:
        return {**super().state_dict(), "records_done": list(self.records_done),
                "last_worker": self.last_worker, "num_workers": self.stream.workers,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict):
        super().load_state_dict(state)
        self._new_epoch()
        if (state.get("num_workers") == self.stream.workers
                and state.get("world_size") == self.world_size):
            self.records_done = list(state["records_done"])
            self.last_worker = int(state["last_worker"])
        elif self.batches_done:
            log.warning("data: loader state saved with %s workers x %s ranks; "
                        "restarting epoch %d from its start",
                        state.get("num_workers"), state.get("world_size"), self.epoch)
            self.batches_done = 0


# -----------------------------------------------------------------------------
# make_loader: every --data spec

def parse_shapes_spec(spec: str) -> dict:
    """`shapes` or `shapes:train_size=20000,seed=1` -> options."""
    opts = {}
    if ":" in spec:
        for kv in spec.split(":", 1)[1].split(","):
            k, _, v = kv.partition("=")
            if k not in ("train_size", "seed") or not v.isdigit():
                raise DataError(f"{spec}: unknown shapes option {kv!r} (use train_size=N,seed=N)")
            opts[k] = int(v)
    return opts


def make_loader(spec: str, split: str = "train", batch_size: int = 64, tokenizer=None,
                image_size: int = 64, train: bool = True, rank: int = 0, world_size: int = 1,
                num_workers: int = 0, seed: int = 0, resampled: bool = False,
                drop_last: bool = True, image_root: str | None = None, *,
                shuffle_buffer: int = 1000, max_skip_fraction: float = MAX_SKIP_FRACTION,
                transform=None, csv_img_key: str = "filepath", csv_caption_key: str = "title",
                csv_separator: str | None = None, pin_memory: bool = False, batch_extra=None):
    """The loader for a `--data` spec: a MapLoader for shapes, CSV, Karpathy JSON (`split`) and
    ImageFolder (+ "label"), a ShardLoader for tar shards (one split). `transform` (PIL image, rng)
    -> tensor: default train_transform if `train`, else eval_transform. `batch_extra`: collate()."""
    src = resolve_data(spec, image_root)
    loader_args = dict(tokenizer=tokenizer, train=train, rank=rank, world_size=world_size,
                       num_workers=num_workers, seed=seed, drop_last=drop_last, name=spec,
                       max_skip_fraction=max_skip_fraction, image_size=image_size)
    transform = transform or (train_transform if train else eval_transform)(image_size)
    if src["kind"] == "shapes":     # generated at image_size, never skipped
        ds = ShapesDataset(split, src.get("train_size") if split == "train" else None,
                           src.get("seed", 0), image_size)
        loader = MapLoader(ds, batch_size, **loader_args)
    elif src["kind"] == "tar":
        loader = ShardLoader(src["shards"], batch_size, transform=transform, resampled=resampled,
                             shuffle_buffer=shuffle_buffer, num_samples=src["num_samples"],
                             **loader_args)
    else:
        items = file_items(src, split, dict(img_key=csv_img_key, caption_key=csv_caption_key,
                                            separator=csv_separator))
        loader = MapLoader(FileDataset(items, transform, seed), batch_size, **loader_args)
    loader.pin_memory, loader.batch_extra = pin_memory and torch.cuda.is_available(), batch_extra
    return loader


def captions_for_tokenizer(spec: str, max_captions: int = 100_000, split: str = "train",
                           image_root: str | None = None, **csv_options) -> list:
    """Training captions to train a BPE on (tar shards: only the .txt members are read)."""
    src = resolve_data(spec, image_root)
    if src["kind"] == "shapes":
        return shapes_captions(min(max_captions, 5000), src.get("seed", 0))
    if src["kind"] == "tar":
        records = (r for s in src["shards"] for r in tar_records(s, keep_exts={"txt"}))
        caps = (r["txt"].decode("utf-8", "replace") for r in records if r.get("txt"))
    else:
        caps = (it.caption for it in file_items(src, split, csv_options))
    return list(itertools.islice((c for c in caps if c and c.strip()), max_captions))


# -----------------------------------------------------------------------------
# `python data.py make-shapes`: the shapes data in the real formats
# OUT/shards/{00000..}.tar: img2dataset webdataset, {key}.png .txt .json .tree (key: train index,
#   9 digits); {shard}_stats.json per shard and sizes.json
# OUT/sugarcrepe/{cat}.json + images/: SugarCrepe {"0": {"filename", "caption", "negative_caption"}}
# OUT/crepe/*.csv + images/{image_id}.png: CREPE rows image_id,x,y,width,height,caption + negatives
#   (CREPE_FILES: systematicity.csv, productivity_{swap,replace}.csv); box = the whole image
# OUT/karpathy/dataset_shapes.json + {split}/: Karpathy JSON, splits train/val/test, one sentence
#   per image with raw, tokens and tree (image root = the JSON's folder, filepath = split)
# OUT/csv/{train,val,test}.tsv: open_clip TSV (filepath, title, tree) over the Karpathy images
# OUT/imagefolder/{train,test}/{shape}/*.png: classification (data.shapes_classification)
# OUT/manifest.json: what was written, with counts

def write_shapes_shards(out: str, n: int, seed: int, shard_size: int, image_size: int) -> dict:
    """Train scenes 0..n-1 in shards of `shard_size`; returns {shard file name: samples}."""
    folder, sizes = os.path.join(out, "shards"), {}
    for first in progress(range(0, n, shard_size), desc=f"shards of {shard_size}", unit="item",
                          leave=False):
        name, buf = f"{first // shard_size:05d}.tar", io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
            for i in range(first, min(n, first + shard_size)):
                scene, key = shapes_scene("train", i, seed, image_size), f"{i:09d}"
                meta = {"key": key, "caption": scene.caption, "status": "success",
                        "width": image_size, "height": image_size,
                        "objects": [vars(o) for o in scene.objects]}
                png = io.BytesIO()
                scene.image.save(png, format="PNG")
                for ext, blob in (("png", png.getvalue()), ("txt", scene.caption.encode()),
                                  ("json", json.dumps(meta).encode()), ("tree", scene.tree.encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    # fixed metadata: same seed, same bytes
                    info.size, info.mtime, info.mode = len(blob), 0, 0o644
                    tf.addfile(info, io.BytesIO(blob))
        sizes[name] = count = min(n, first + shard_size) - first
        write_file(os.path.join(folder, name), buf.getvalue())
        write_file(os.path.join(folder, name[:-4] + "_stats.json"), json.dumps(
            {"count": count, "successes": count, "failed_to_download": 0, "failed_to_resize": 0}))
    write_file(os.path.join(folder, "sizes.json"), json.dumps(sizes, indent=1))
    return sizes


# CREPE's released layout: systematicity CSVs carry `valid_hard_negs_atom` (here: replace_*
# negatives) and `valid_hard_negs_comp` (swap_*); productivity CSVs one `hard_negs` column,
# one file per negative kind named after it. (file stem, columns, category prefix per column)
CREPE_FILES = {"systematicity": [("systematicity", ["valid_hard_negs_atom", "valid_hard_negs_comp"],
                                  ["replace", "swap"])],
               "productivity": [("productivity_swap", ["hard_negs"], ["swap"]),
                                ("productivity_replace", ["hard_negs"], ["replace"])]}


def write_shapes_benchmarks(out: str, n: int, seed: int, image_size: int) -> dict:
    bench = shapes_benchmark(seed, n, image_size)
    for cat in progress(SHAPES_CATEGORIES, desc="sugarcrepe", unit="item", leave=False):
        rows = {str(i): {"filename": f"{cat}_{i:05d}.png", "caption": item["caption"],
                         "negative_caption": item["negative_caption"]}
                for i, item in enumerate(bench[cat])}
        for row, item in zip(rows.values(), bench[cat]):
            write_file(os.path.join(out, "sugarcrepe", "images", row["filename"]), item["image"])
        write_file(os.path.join(out, "sugarcrepe", f"{cat}.json"), json.dumps(rows, indent=1))
    for split in progress(("systematicity", "productivity"), desc="crepe", unit="item",
                          leave=False):
        for i, item in enumerate(bench[split]):
            write_file(os.path.join(out, "crepe", "images", f"{split}_{i:05d}.png"), item["image"])
        for name, columns, kinds in CREPE_FILES[split]:
            # lists as JSON strings (ast.literal_eval reads them too)
            buf = io.StringIO()
            writer = csv.writer(buf, lineterminator="\n")
            writer.writerow(["image_id", "x", "y", "width", "height", "caption"] + columns)
            for i, item in enumerate(bench[split]):
                negs = [[x for x, cat in zip(item["negatives"], item["negative_categories"])
                         if cat.startswith(kind)]
                        for kind in kinds]
                if any(negs):   # rows without a negative are left out; box = the whole image
                    writer.writerow([f"{split}_{i:05d}", 0, 0, item["image"].width,
                                     item["image"].height, item["caption"]]
                                    + [json.dumps(neg) for neg in negs])
            write_file(os.path.join(out, "crepe", f"{name}.csv"), buf.getvalue())
    return {k: len(v) for k, v in bench.items()}


def write_shapes_karpathy(out: str, n: int, seed: int, image_size: int) -> dict:
    images, rows = [], {}
    for split in ("train", "val", "test"):
        rows[split] = [("filepath", "title", "tree")]
        for i in progress(range(n), desc=f"karpathy {split}", unit="item", leave=False):
            scene, filename, k = shapes_scene(split, i, seed, image_size), f"{i:09d}.png", len(images)
            write_file(os.path.join(out, "karpathy", split, filename), scene.image)
            images.append({"filepath": split, "filename": filename, "split": split, "imgid": k,
                           "sentids": [k],
                           "sentences": [{"raw": scene.caption, "tokens": scene.caption.split(),
                                          "imgid": k, "sentid": k, "tree": scene.tree}]})
            rows[split].append((f"../karpathy/{split}/{filename}", scene.caption, scene.tree))
    write_file(os.path.join(out, "karpathy", "dataset_shapes.json"),
               json.dumps({"dataset": "shapes", "images": images}))
    for split, lines in rows.items():
        write_file(os.path.join(out, "csv", f"{split}.tsv"),
                   "".join("\t".join(r) + "\n" for r in lines))
    return {split: n for split in rows}


def write_shapes_imagefolder(out: str, n: int, seed: int, image_size: int) -> dict:
    for split in ("train", "test"):
        for name in SHAPE_NAMES:  # every class has its folder, even when no image drew it
            os.makedirs(os.path.join(out, "imagefolder", split, name), exist_ok=True)
        for i in progress(range(n), desc=f"imagefolder {split}", unit="item", leave=False):
            img, label = shapes_classification(split, i, seed, image_size)
            write_file(os.path.join(out, "imagefolder", split, SHAPE_NAMES[label], f"{i:06d}.png"),
                       img)
    return {"train": n, "test": n, "classes": SHAPE_NAMES}


def make_shapes(out_dir: str, train: int = 10_000, test: int = 500, seed: int = 0,
                shard_size: int = 1000, image_size: int = SHAPES_IMAGE_SIZE) -> dict:
    """Write every format (see the section comment); returns the manifest."""
    if train < 1 or test < 1 or shard_size < 1:
        raise DataError("make-shapes: --train, --test and --shard_size must be positive")
    t0 = time.time()
    shards = write_shapes_shards(out_dir, train, seed, shard_size, image_size)
    manifest = {"seed": seed, "image_size": image_size,
                "shards": {"pattern": os.path.join(out_dir, "shards",
                                                   f"{{00000..{len(shards) - 1:05d}}}.tar"),
                           "samples": train, "shards": len(shards)},
                "benchmarks": write_shapes_benchmarks(out_dir, test, seed, image_size),
                "karpathy": write_shapes_karpathy(out_dir, test, seed, image_size),
                "imagefolder": write_shapes_imagefolder(out_dir, test, seed, image_size)}
    manifest["seconds"] = round(time.time() - t0, 2)
    write_file(os.path.join(out_dir, "manifest.json"), json.dumps(manifest, indent=1))
    return manifest


# -----------------------------------------------------------------------------
# `python data.py check`: read a dataset once, count good and skipped samples

def check_data(spec: str, split: str = "train", image_root: str | None = None,
               batch_size: int = 64, num_workers: int = 0, image_size: int = 64,
               drop_last: bool = False, **csv_options) -> dict:
    """Reads a dataset once; counts good (in batches), skipped (by reason) and dropped (cut by
    drop_last, as training at this batch size would). No good sample: an "error" entry (exit 2)."""
    loader = make_loader(spec, split, batch_size, image_size=image_size, train=False,
                         num_workers=num_workers, drop_last=drop_last, image_root=image_root,
                         max_skip_fraction=1.0, **csv_options)
    t0, problem = time.time(), None
    with progress(desc="check", total=loader.num_samples, unit="item", leave=False) as bar:
        try:
            for batch in loader:
                bar.update(len(batch["caption"]))
        except DataError as e:
            if loader.good:
                raise
            problem = str(e)
    result = {"data": spec, "kind": resolve_data(spec, image_root)["kind"], "split": split,
              "declared_samples": loader.num_samples, "good": loader.good, "skipped": loader.skipped,
              "dropped": loader.dropped, "batch_size": batch_size, "drop_last": drop_last,
              "skip_reasons": dict(loader.skip_reasons), "seconds": round(time.time() - t0, 2)}
    return {**result, "error": problem} if problem else result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description="data.py: the shapes data in real formats, and data checks")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-shapes", help="write the shapes data as shards, SugarCrepe, CREPE, "
                                           "Karpathy, ImageFolder")
    m.add_argument("--out_dir", required=True)
    m.add_argument("--train", type=int, default=10_000, help="training scenes in the shards")
    m.add_argument("--test", type=int, default=500,
                   help="items per benchmark category / split / class set")
    for flag, default in (("--seed", 0), ("--shard_size", 1000), ("--image_size", SHAPES_IMAGE_SIZE)):
        m.add_argument(flag, type=int, default=default)
    c = sub.add_parser("check",
                       help="read a dataset once; print JSON counts of good and skipped samples")
    c.add_argument("--data", required=True)
    c.add_argument("--split", default="train")
    c.add_argument("--image_root", default=None)
    c.add_argument("--num_workers", type=int, default=0)
    c.add_argument("--batch_size", type=int, default=64,
                   help="per rank, as in training (counts what drop_last cuts)")
    c.add_argument("--drop_last", action="store_true",
                   help="drop the last partial batch, as training does")
    c.add_argument("--csv_img_key", default="filepath",
                   help="CSV/TSV column of the image paths (open_clip's name)")
    c.add_argument("--csv_caption_key", default="title", help="CSV/TSV column of the captions")
    c.add_argument("--csv_separator", default=None,
                   help="default: tab if the header has one, else comma")
    sub.add_parser("convert-weights",
                   help="a TorchScript .pt you trust (OpenAI's) -> PATH.safetensors; loading it "
                        "runs the code it carries").add_argument("path")
    args = vars(p.parse_args(argv))
    cmd = args.pop("cmd")
    t0 = time.time()
    what = {"convert-weights": [args.get("path")],
            "check": [f"data {args.get('data')} ({args.get('split')})"],
            "make-shapes": [f"{args.get('train')} train scenes, {args.get('test')} per test set"]}
    # a failed write (full disk, quota, size limit, I/O error): one line, exit 2
    writes = cmd != "check"
    try:
        if cmd == "convert-weights":    # nothing to convert: one error line, no code run
            check_torchscript(args["path"])
        if cmd == "check":      # a spec that names nothing: one error line, before the start line
            resolve_data(args["data"], args["image_root"])
        start_line(__file__, cmd, what[cmd], args.get("out_dir"))
        with writing(args.get("out_dir") or args["path"]) if writes else contextlib.nullcontext():
            if cmd == "convert-weights":
                out, n_tensors = convert_torchscript(args["path"])
                print(out)
                done_line(f"{n_tensors} tensors converted", time.time() - t0, [out])
                return 0
            if cmd == "make-shapes":
                result = make_shapes(**args)
            else:
                result = check_data(args.pop("data"), **args)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    if result.get("error"):
        print(f"error: {result['error']}", file=sys.stderr)
        return 2
    if cmd == "check":
        counts = f"{result['good']} good, {result['skipped']} skipped, {result['dropped']} dropped"
        done_line(f"{counts} samples", time.time() - t0)
    else:
        names = ("shards/", "sugarcrepe/", "crepe/", "csv/", "karpathy/", "imagefolder/",
                 "manifest.json")
        wrote = [os.path.join(args["out_dir"], n) for n in names
                 if os.path.exists(os.path.join(args["out_dir"], n))]
        done_line(f"the shapes data in {len(names) - 1} formats", time.time() - t0, wrote)
    return 0


if __name__ == "__main__":
    sys.exit(main())
