"""
data.py -- the one module shared by every script of this repo.

  * the built-in `shapes` dataset: procedural images of 1-3 coloured shapes in spatial
    relations, captions from a small grammar with gold PTB trees, and a compositional test
    set with SugarCrepe-style hard negatives, a systematicity split (held-out
    colour-shape compounds) and a productivity split (longer captions);
  * the tokenizer (CLIP BPE from `bpe_simple_vocab_16e6.txt.gz`, or a BPE trained on the
    training captions), built with the `tokenizers` library;
  * image transforms written with PIL + numpy + torch (no torchvision);
  * readers for real data and a DDP-aware loader whose position can be saved and resumed.

Run `python data.py --help` for the commands (make-shapes, check).
"""
import argparse
import gzip
import json
import math
import os
import random
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter


class DataError(Exception):
    """A problem with the user's data or paths. Scripts print it as one line, no traceback."""


# -----------------------------------------------------------------------------
# The `shapes` dataset
#
# Grammar (every caption is lower case, no punctuation):
#   object   := ("a"|"an") [size] colour shape          e.g. "a small red circle", "an orange star"
#   relation := "to the left of" | "to the right of" | "above" | "below"
#   caption  := object                                  (1 object)
#             | object relation object                  (2 objects)
#             | object "is" relation object             (2 objects, copula form)
#             | object "and" object                     (2 objects, no relation)
#             | object relation object "and" object     (3 objects; the relation binds the
#                                                        first two, the third is only present)
#             | object relation object relation object  (productivity split only: a chain,
#                                                        A rel1 B and B rel2 C)
# Size words are mentioned with probability 1/2 per object, so "add_att" negatives exist.
# Relations are geometric and unambiguous: objects of a related pair are placed so that
# |dx| and |dy| of their centres differ by at least RELATION_MARGIN pixels, and exactly one
# of the four relations holds between any ordered pair.
# Held-out compounds (systematicity): one colour-shape pair per colour never occurs in
# the train/val/test splits, in images or captions, including hard negatives.

SHAPE_NAMES = ["circle", "square", "triangle", "star", "cross", "diamond"]
COLOURS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 90, 235), "yellow": (235, 215, 40),
    "purple": (150, 60, 200), "orange": (245, 135, 30), "white": (235, 235, 235), "cyan": (40, 205, 215),
}
COLOUR_NAMES = list(COLOURS)
SIZE_NAMES = ["small", "large"]
SIZE_RADIUS = {"small": (5, 7), "large": (10, 13)}  # radius range in pixels at 64x64
RELATION_NAMES = ["to the left of", "to the right of", "above", "below"]
HELD_OUT_COMPOUNDS = frozenset((c, SHAPE_NAMES[i % len(SHAPE_NAMES)]) for i, c in enumerate(COLOUR_NAMES))
SHAPES_CATEGORIES = ["replace_obj", "replace_att", "replace_rel", "swap_obj", "swap_att", "add_obj", "add_att"]
SHAPES_SPLITS = ["train", "val", "test", "systematicity", "productivity"]
SHAPES_SIZES = {"train": 100_000, "val": 1000, "test": 1000, "systematicity": 1000, "productivity": 1000}
SHAPES_IMAGE_SIZE = 64
RELATION_MARGIN = 4


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
    """A caption before it is rendered to words: phrases + how they are joined.
    form: "single" | "rel" | "copula" | "and" | "rel_and" | "chain"; relations[i] relates
    phrase i to phrase i+1 ("rel", "copula", "rel_and" use relations[0]; "chain" both)."""
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
    (ax, ay), (bx, by) = a.centre, b.centre
    dx, dy = bx - ax, by - ay
    if abs(dx) >= abs(dy):
        return "to the left of" if dx > 0 else "to the right of"
    return "above" if dy > 0 else "below"


def _article(p: Phrase) -> str:
    return "an" if (p.size or p.colour)[0] in "aeiou" else "a"


def _phrase_words(p: Phrase) -> list:
    return [_article(p)] + ([p.size] if p.size else []) + [p.colour, p.shape]


def render_caption(s: CaptionStruct) -> str:
    w = [_phrase_words(p) for p in s.phrases]
    r = [rel.split() for rel in s.relations]
    if s.form == "single":
        words = w[0]
    elif s.form == "rel":
        words = w[0] + r[0] + w[1]
    elif s.form == "copula":
        words = w[0] + ["is"] + r[0] + w[1]
    elif s.form == "and":
        words = w[0] + ["and"] + w[1]
    elif s.form == "rel_and":
        words = w[0] + r[0] + w[1] + ["and"] + w[2]
    elif s.form == "chain":
        words = w[0] + r[0] + w[1] + r[1] + w[2]
    else:
        raise ValueError(f"unknown caption form {s.form!r}")
    return " ".join(words)


def _np_tree(p: Phrase) -> str:
    size = f" (JJ {p.size})" if p.size else ""
    return f"(NP (DT {_article(p)}){size} (JJ {p.colour}) (NN {p.shape}))"


def _pp_tree(relation: str, np_tree: str) -> str:
    if relation in ("above", "below"):
        return f"(PP (IN {relation}) {np_tree})"
    side = relation.split()[2]  # "to the left of" -> left
    return f"(PP (TO to) (NP (NP (DT the) (NN {side})) (PP (IN of) {np_tree})))"


def caption_tree(s: CaptionStruct) -> str:
    """Gold PTB constituency tree of a caption (Penn Treebank tags, one root)."""
    n = [_np_tree(p) for p in s.phrases]
    if s.form == "single":
        return f"(ROOT {n[0]})"
    if s.form == "rel":
        return f"(ROOT (NP {n[0]} {_pp_tree(s.relations[0], n[1])}))"
    if s.form == "copula":
        return f"(ROOT (S {n[0]} (VP (VBZ is) {_pp_tree(s.relations[0], n[1])})))"
    if s.form == "and":
        return f"(ROOT (NP {n[0]} (CC and) {n[1]}))"
    if s.form == "rel_and":
        return f"(ROOT (NP (NP {n[0]} {_pp_tree(s.relations[0], n[1])}) (CC and) {n[2]}))"
    if s.form == "chain":
        inner = f"(NP {n[1]} {_pp_tree(s.relations[1], n[2])})"
        return f"(ROOT (NP {n[0]} {_pp_tree(s.relations[0], inner)}))"
    raise ValueError(f"unknown caption form {s.form!r}")


def parse_shapes_caption(text: str):
    """Parse a caption of the shapes grammar back into a CaptionStruct; None if it is not
    grammatical. Used to check that hard negatives stay grammatical."""
    words = text.split()
    pos = 0

    def phrase():
        nonlocal pos
        if pos >= len(words) or words[pos] not in ("a", "an"):
            return None
        article = words[pos]
        pos += 1
        size = None
        if pos < len(words) and words[pos] in SIZE_NAMES:
            size = words[pos]
            pos += 1
        if pos < len(words) and words[pos] in COLOURS and pos + 1 < len(words) and words[pos + 1] in SHAPE_NAMES:
            p = Phrase(words[pos], words[pos + 1], size)
            pos += 2
            return p if article == _article(p) else None
        return None

    def relation():
        nonlocal pos
        for rel in RELATION_NAMES:
            rw = rel.split()
            if words[pos:pos + len(rw)] == rw:
                pos += len(rw)
                return rel
        return None

    first = phrase()
    if first is None:
        return None
    if pos == len(words):
        return CaptionStruct("single", [first])
    if words[pos] == "and":
        pos += 1
        second = phrase()
        return CaptionStruct("and", [first, second]) if second and pos == len(words) else None
    copula = words[pos] == "is"
    pos += copula
    rel = relation()
    second = phrase() if rel else None
    if second is None:
        return None
    if pos == len(words):
        return CaptionStruct("copula" if copula else "rel", [first, second], [rel])
    if copula:
        return None
    if words[pos] == "and":
        pos += 1
        third = phrase()
        return CaptionStruct("rel_and", [first, second, third], [rel]) if third and pos == len(words) else None
    rel2 = relation()
    third = phrase() if rel2 else None
    return CaptionStruct("chain", [first, second, third], [rel, rel2]) if third and pos == len(words) else None


def _stated_relations(s: CaptionStruct) -> list:
    if s.form in ("rel", "copula", "rel_and"):
        return [(0, s.relations[0], 1)]
    if s.form == "chain":
        return [(0, s.relations[0], 1), (1, s.relations[1], 2)]
    return []


def caption_is_true(s: CaptionStruct, objects: list) -> bool:
    """Does the caption describe the scene? True iff the phrases can be assigned to distinct
    objects with matching attributes such that every stated relation holds."""
    import itertools
    rels = _stated_relations(s)
    for assign in itertools.permutations(range(len(objects)), len(s.phrases)):
        ok = all(objects[o].colour == p.colour and objects[o].shape == p.shape and p.size in (None, objects[o].size)
                 for p, o in zip(s.phrases, assign))
        if ok and all(relation_between(objects[assign[i]], objects[assign[j]]) == r for i, r, j in rels):
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
            lo, hi = SIZE_RADIUS[o.size]
            r = rng.uniform(lo, hi) * scale
            cx = rng.uniform(r + 1, image_size - r - 1)
            cy = rng.uniform(r + 1, image_size - r - 1)
            o.box = (round(cx - r), round(cy - r), round(cx + r), round(cy + r))
        overlap = any(
            math.dist(a.centre, b.centre) < (a.box[2] - a.box[0] + b.box[2] - b.box[0]) / 2 + 2 * scale
            for k, a in enumerate(objects) for b in objects[k + 1:])
        ambiguous = any(
            abs(abs(objects[j].centre[0] - objects[i].centre[0]) - abs(objects[j].centre[1] - objects[i].centre[1]))
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
        k = r * 0.85
        draw.rectangle((cx - k, cy - k, cx + k, cy + k), fill=rgb)
    elif o.shape == "triangle":
        draw.polygon([(cx, y0), (x1, y1 - r * 0.2), (x0, y1 - r * 0.2)], fill=rgb)
    elif o.shape == "diamond":
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=rgb)
    elif o.shape == "star":
        pts = []
        for k in range(10):
            rad = r if k % 2 == 0 else r * 0.45
            a = -math.pi / 2 + k * math.pi / 5
            pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
        draw.polygon(pts, fill=rgb)
    elif o.shape == "cross":
        t = r * 0.35
        draw.rectangle((x0, cy - t, x1, cy + t), fill=rgb)
        draw.rectangle((cx - t, y0, cx + t, y1), fill=rgb)
    else:
        raise ValueError(o.shape)


def render_scene(objects: list, rng: random.Random, image_size: int = SHAPES_IMAGE_SIZE) -> Image.Image:
    """Dark, slightly varied background; every object's colour jittered by up to +-20 per
    channel so that colour names are categories, not single pixel values."""
    bg = tuple(rng.randint(10, 60) for _ in range(3))
    img = Image.new("RGB", (image_size, image_size), bg)
    draw = ImageDraw.Draw(img)
    for o in objects:
        rgb = tuple(min(255, max(0, v + rng.randint(-20, 20))) for v in COLOURS[o.colour])
        _draw_object(draw, o, rgb)
    return img


def _split_seed(split: str, index: int, seed: int) -> str:
    return f"shapes/{seed}/{split}/{index}"  # str seeds are hashed with sha512: stable across runs


def _seen_compounds():
    return [(c, s) for c in COLOUR_NAMES for s in SHAPE_NAMES if (c, s) not in HELD_OUT_COMPOUNDS]


def _scene_layout(split: str, rng: random.Random):
    """(number of objects, caption form) for a split: train/val/test have 1-3 objects and at
    most one relation; productivity has 3 objects and two relations (a chain)."""
    if split == "productivity":
        return 3, "chain"
    u = rng.random()
    if u < 0.15:
        return 1, "single"
    if u < 0.80:
        return 2, rng.choice(["rel", "rel", "copula", "and"])
    return 3, "rel_and"


def shapes_scene(split: str = "train", index: int = 0, seed: int = 0, image_size: int = SHAPES_IMAGE_SIZE) -> Scene:
    """Scene `index` of a split: deterministic in (split, index, seed); same seed, same bytes."""
    if split not in SHAPES_SPLITS:
        raise DataError(f"shapes: unknown split {split!r} (choose from {', '.join(SHAPES_SPLITS)})")
    rng = random.Random(_split_seed(split, index, seed))
    seen = _seen_compounds()
    while True:
        n, form = _scene_layout(split, rng)
        if split == "systematicity":
            # at least one held-out compound, the rest seen ones
            held = rng.choice(sorted(HELD_OUT_COMPOUNDS))
            objects = [Obj(shape=held[1], colour=held[0], size=rng.choice(SIZE_NAMES))]
            objects += _sample_objects(rng, n - 1, [c for c in seen if c != held])
            rng.shuffle(objects)
        else:
            objects = _sample_objects(rng, n, seen)
        struct_rel = {"rel": [(0, 1)], "copula": [(0, 1)], "rel_and": [(0, 1)], "chain": [(0, 1), (1, 2)]}.get(form, [])
        if not _place(rng, objects, struct_rel, image_size):
            continue
        phrases = [Phrase(o.colour, o.shape, o.size if rng.random() < 0.5 else None) for o in objects]
        relations = [relation_between(objects[i], objects[j]) for i, j in struct_rel]
        struct = CaptionStruct(form, phrases, relations)
        image = render_scene(objects, rng, image_size)
        return Scene(image=image, caption=render_caption(struct), tree=caption_tree(struct), objects=objects,
                     relations=[(i, r, j) for (i, j), r in zip(struct_rel, relations)], struct=struct)


# --- hard negatives (SugarCrepe's 7 categories, on the caption structure) ---

def _copy_struct(s: CaptionStruct) -> CaptionStruct:
    return CaptionStruct(s.form, [Phrase(p.colour, p.shape, p.size) for p in s.phrases], list(s.relations))


def _negative_candidates(category: str, s: CaptionStruct, objects: list, rng: random.Random) -> list:
    """Candidate negatives of one category (possibly empty); validity is checked by the caller."""
    out = []
    k = len(s.phrases)
    if category == "replace_obj":
        for i in range(k):
            for shape in SHAPE_NAMES:
                if shape != s.phrases[i].shape:
                    t = _copy_struct(s); t.phrases[i].shape = shape; out.append(t)
    elif category == "replace_att":
        for i in range(k):
            for colour in COLOUR_NAMES:
                if colour != s.phrases[i].colour:
                    t = _copy_struct(s); t.phrases[i].colour = colour; out.append(t)
            if s.phrases[i].size:
                t = _copy_struct(s); t.phrases[i].size = "small" if s.phrases[i].size == "large" else "large"; out.append(t)
    elif category == "replace_rel":
        for r_idx, rel in enumerate(s.relations):
            for other in RELATION_NAMES:
                if other != rel:
                    t = _copy_struct(s); t.relations[r_idx] = other; out.append(t)
    elif category == "swap_obj":
        for i in range(k):
            for j in range(i + 1, k):
                if s.phrases[i].shape != s.phrases[j].shape:
                    t = _copy_struct(s)
                    t.phrases[i].shape, t.phrases[j].shape = s.phrases[j].shape, s.phrases[i].shape
                    out.append(t)
    elif category == "swap_att":
        for i in range(k):
            for j in range(i + 1, k):
                if s.phrases[i].colour != s.phrases[j].colour:
                    t = _copy_struct(s)
                    t.phrases[i].colour, t.phrases[j].colour = s.phrases[j].colour, s.phrases[i].colour
                    out.append(t)
                if s.phrases[i].size and s.phrases[j].size and s.phrases[i].size != s.phrases[j].size:
                    t = _copy_struct(s)
                    t.phrases[i].size, t.phrases[j].size = s.phrases[j].size, s.phrases[i].size
                    out.append(t)
    elif category == "add_obj":
        if s.form in ("single", "rel", "and"):  # append "and a <absent object>"
            for c, sh in _seen_compounds():
                extra = Phrase(c, sh, rng.choice([None, *SIZE_NAMES]))
                if s.form == "single":
                    out.append(CaptionStruct("and", [s.phrases[0], extra]))
                elif s.form == "rel":
                    out.append(CaptionStruct("rel_and", [*s.phrases, extra], list(s.relations)))
    elif category == "add_att":
        for i in range(k):
            if s.phrases[i].size is None:
                # phrases are made in object order, so phrase i describes objects[i]
                wrong = "small" if objects[i].size == "large" else "large"
                t = _copy_struct(s); t.phrases[i].size = wrong; out.append(t)
    else:
        raise ValueError(category)
    return out


def _compounds_seen(s: CaptionStruct) -> bool:
    return all((p.colour, p.shape) not in HELD_OUT_COMPOUNDS for p in s.phrases)


def make_negative(category: str, scene: Scene, rng: random.Random, allow_held_out: bool = False):
    """A caption of `category` that is grammatical, different from the positive and false of
    the image (checked by `caption_is_true`); None if the scene admits none."""
    cands = _negative_candidates(category, scene.struct, scene.objects, rng)
    rng.shuffle(cands)
    for t in cands:
        if (allow_held_out or _compounds_seen(t)) and not caption_is_true(t, scene.objects):
            text = render_caption(t)
            if text != scene.caption:
                return text
    return None


def shapes_benchmark(seed: int = 0, n: int = 200, image_size: int = SHAPES_IMAGE_SIZE) -> dict:
    """The built-in compositional benchmark. For each SugarCrepe category, n items
    {"image", "caption", "negative_caption"} drawn from the test split (scenes that admit no
    negative of the category are skipped); for systematicity / productivity, n items
    {"image", "caption", "negatives"} (CREPE style: R@1 among the positive + negatives)."""
    out = {}
    for c, category in enumerate(SHAPES_CATEGORIES):
        items, index = [], 0
        rng = random.Random(f"shapes-bench/{seed}/{category}")
        while len(items) < n:
            # each category walks its own stream of test-split scenes
            scene = shapes_scene("test", 1_000_000 * (c + 1) + index, seed, image_size)
            index += 1
            neg = make_negative(category, scene, rng)
            if neg is not None:
                items.append({"image": scene.image, "caption": scene.caption, "negative_caption": neg})
        out[category] = items
    for split, cats in (("systematicity", ["swap_att", "swap_obj", "replace_att", "replace_obj"]),
                        ("productivity", ["replace_rel", "swap_obj", "swap_att", "replace_att"])):
        items, index = [], 0
        rng = random.Random(f"shapes-bench/{seed}/{split}")
        while len(items) < n:
            scene = shapes_scene(split, index, seed, image_size)
            index += 1
            negs = [make_negative(cat, scene, rng, allow_held_out=True) for cat in cats]
            negs = list(dict.fromkeys(x for x in negs if x is not None))
            if len(negs) >= 2:
                items.append({"image": scene.image, "caption": scene.caption, "negatives": negs})
        out[split] = items
    return out


def shapes_classification(split: str = "train", index: int = 0, seed: int = 0, image_size: int = SHAPES_IMAGE_SIZE):
    """(image, class index into SHAPE_NAMES) of a single-object image (any colour or size)."""
    rng = random.Random(f"shapes-cls/{seed}/{split}/{index}")
    label = rng.randrange(len(SHAPE_NAMES))
    obj = Obj(shape=SHAPE_NAMES[label], colour=rng.choice(COLOUR_NAMES), size=rng.choice(SIZE_NAMES))
    _place(rng, [obj], [], image_size)
    return render_scene([obj], rng, image_size), label


def shapes_captions(n: int = 5000, seed: int = 0) -> list:
    """Training captions (no rendering needed beyond the scene) to train a tokenizer on."""
    return [shapes_scene("train", i, seed).caption for i in range(n)]


# -----------------------------------------------------------------------------
# Tokenizer

def _bytes_to_unicode() -> dict:
    """GPT-2/CLIP's reversible byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


SOT_TOKEN, EOT_TOKEN, PAD_TOKEN, UNK_TOKEN = "<|startoftext|>", "<|endoftext|>", "<pad>", "<unk>"


class Tokenizer:
    """Captions -> LongTensor [B, context_length]: SOT, BPE ids, EOT, then pad id 0.
    Truncation keeps EOT as the last token (as OpenAI CLIP's `truncate=True`)."""

    def __init__(self, backend, kind: str, context_length: int = 77):
        self.backend, self.kind, self.context_length = backend, kind, context_length
        self.sot_id = backend.token_to_id(SOT_TOKEN)
        self.eot_id = backend.token_to_id(EOT_TOKEN)
        self.pad_id = 0
        self.vocab_size = backend.get_vocab_size()

    def __call__(self, texts) -> torch.Tensor:
        if isinstance(texts, str):
            texts = [texts]
        out = torch.zeros(len(texts), self.context_length, dtype=torch.long)
        for row, enc in enumerate(self.backend.encode_batch(list(texts), add_special_tokens=False)):
            ids = [self.sot_id] + enc.ids[: self.context_length - 2] + [self.eot_id]
            out[row, : len(ids)] = torch.tensor(ids)
        return out

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.eot_id in ids:
            ids = ids[: ids.index(self.eot_id)]
        ids = [i for i in ids if i != self.sot_id]
        return self.backend.decode(ids).strip()

    def save(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        blob = {"kind": self.kind, "context_length": self.context_length,
                "tokenizer": json.loads(self.backend.to_str())}
        _atomic_write_text(os.path.join(directory, "tokenizer.json"), json.dumps(blob))

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
        except (json.JSONDecodeError, KeyError, Exception) as e:
            raise DataError(f"{path}: not a tokenizer file written by this repo ({type(e).__name__})") from None
        return cls(backend, blob["kind"], blob["context_length"])


def _clip_normalizer_and_pretokenizer():
    from tokenizers import Regex, normalizers, pre_tokenizers
    # OpenAI CLIP: whitespace cleanup + lower-case, then its word regex, then byte-level chars
    normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                       normalizers.Strip(), normalizers.Lowercase()])
    pattern = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="removed", invert=True),
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
    chars = list(_bytes_to_unicode().values())
    vocab = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges] + [SOT_TOKEN, EOT_TOKEN]
    backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=merges,
                                 end_of_word_suffix="</w>", continuing_subword_prefix="", unk_token=EOT_TOKEN))
    backend.normalizer, backend.pre_tokenizer = _clip_normalizer_and_pretokenizer()
    backend.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Replace("</w>", " ")])
    backend.add_special_tokens([SOT_TOKEN, EOT_TOKEN])
    return Tokenizer(backend, "clip_bpe", context_length)


def trained_bpe_tokenizer(captions, vocab_size: int = 1000, context_length: int = 77) -> Tokenizer:
    """A small byte-level BPE (GPT-2 style) trained on the training captions, used when no CLIP
    vocabulary is given. Ids: 0 pad, 1 SOT, 2 EOT, 3 unk. All 256 bytes are in the alphabet,
    so no text is ever unknown; lower-case and whitespace cleanup as CLIP's."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers
    captions = [c for c in captions if c and c.strip()]
    if not captions:
        raise DataError("cannot train a tokenizer: no captions")
    backend = Backend(models.BPE(unk_token=UNK_TOKEN))
    backend.normalizer = _clip_normalizer_and_pretokenizer()[0]
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD_TOKEN, SOT_TOKEN, EOT_TOKEN, UNK_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(captions, trainer=trainer)
    return Tokenizer(backend, "trained_bpe", context_length)


def build_tokenizer(vocab_path: str | None = None, captions=None, vocab_size: int = 1000,
                    context_length: int = 77) -> Tokenizer:
    if vocab_path:
        return clip_bpe_tokenizer(vocab_path, context_length)
    return trained_bpe_tokenizer(captions or [], vocab_size, context_length)


# -----------------------------------------------------------------------------
# Transforms: PIL image -> float tensor [3, S, S]; each random transform takes an optional
# `rng` (random.Random) so a dataset can make augmentation a pure function of
# (seed, epoch, index): a resumed run then sees exactly the same pixels.

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, img, rng=None):
        rng = rng or random
        for t in self.transforms:
            img = t(img, rng)
        return img


class RandomResizedCrop:
    """Crop a random area fraction in `scale` with aspect ratio in `ratio` (log-uniform),
    resize to size x size with bicubic; falls back to a centre crop (as torchvision)."""

    def __init__(self, size, scale=(0.9, 1.0), ratio=(3 / 4, 4 / 3)):
        self.size, self.scale, self.ratio = size, scale, ratio

    def __call__(self, img, rng):
        w, h = img.size
        for _ in range(10):
            area = w * h * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(math.log(self.ratio[0]), math.log(self.ratio[1])))
            cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if 0 < cw <= w and 0 < ch <= h:
                x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
                return img.resize((self.size, self.size), Image.BICUBIC, box=(x, y, x + cw, y + ch))
        return CenterCrop(self.size)(Resize(self.size)(img, rng), rng)


class Resize:
    """Resize the shorter side to `size` (bicubic)."""

    def __init__(self, size):
        self.size = size

    def __call__(self, img, rng=None):
        w, h = img.size
        s = self.size / min(w, h)
        return img.resize((max(self.size, round(w * s)), max(self.size, round(h * s))), Image.BICUBIC)


class CenterCrop:
    def __init__(self, size):
        self.size = size

    def __call__(self, img, rng=None):
        w, h = img.size
        x, y = (w - self.size) // 2, (h - self.size) // 2
        return img.crop((x, y, x + self.size, y + self.size))


class ColorJitter:
    """Brightness, contrast, saturation factors uniform in [1-s, 1+s], hue shift in [-hue, hue],
    applied in a random order (as torchvision)."""

    def __init__(self, brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1, p=0.8):
        self.b, self.c, self.s, self.h, self.p = brightness, contrast, saturation, hue, p

    def __call__(self, img, rng):
        if rng.random() >= self.p:
            return img
        x = np.asarray(img, dtype=np.float32) / 255.0
        ops = [0, 1, 2, 3]
        rng.shuffle(ops)
        for op in ops:
            if op == 0 and self.b:
                x = x * rng.uniform(1 - self.b, 1 + self.b)
            elif op == 1 and self.c:
                mean = (x @ np.array([0.299, 0.587, 0.114], np.float32)).mean()
                x = (x - mean) * rng.uniform(1 - self.c, 1 + self.c) + mean
            elif op == 2 and self.s:
                gray = (x @ np.array([0.299, 0.587, 0.114], np.float32))[..., None]
                x = (x - gray) * rng.uniform(1 - self.s, 1 + self.s) + gray
            elif op == 3 and self.h:
                hsv = np.asarray(Image.fromarray((np.clip(x, 0, 1) * 255).astype(np.uint8)).convert("HSV"), np.int16)
                hsv[..., 0] = (hsv[..., 0] + round(rng.uniform(-self.h, self.h) * 255)) % 256
                x = np.asarray(Image.fromarray(hsv.astype(np.uint8), "HSV").convert("RGB"), np.float32) / 255.0
            x = np.clip(x, 0, 1)
        return Image.fromarray((x * 255 + 0.5).astype(np.uint8))


class RandomGrayscale:
    def __init__(self, p=0.2):
        self.p = p

    def __call__(self, img, rng):
        return img.convert("L").convert("RGB") if rng.random() < self.p else img


class RandomGaussianBlur:
    def __init__(self, p=0.5, sigma=(0.1, 2.0)):
        self.p, self.sigma = p, sigma

    def __call__(self, img, rng):
        return img.filter(ImageFilter.GaussianBlur(rng.uniform(*self.sigma))) if rng.random() < self.p else img


class RandomHorizontalFlip:
    """Off by default: a flip turns "left of" into "right of", which is wrong for captions."""

    def __init__(self, p=0.5):
        self.p = p

    def __call__(self, img, rng):
        return img.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < self.p else img


class ToNormalizedTensor:
    def __init__(self, mean=CLIP_MEAN, std=CLIP_STD):
        self.mean = torch.tensor(mean).view(3, 1, 1)
        self.std = torch.tensor(std).view(3, 1, 1)

    def __call__(self, img, rng=None):
        x = torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255.0
        return (x - self.mean) / self.std


def train_transform(image_size: int, scale=(0.9, 1.0), color_jitter: float = 0.0, grayscale: float = 0.0,
                    blur: float = 0.0, flip: bool = False) -> Compose:
    """open_clip's training transform (RandomResizedCrop scale (0.9, 1)) plus optional
    SimCLR-style augmentations (off by default, as in CLIP)."""
    ts = [RandomResizedCrop(image_size, scale)]
    if color_jitter:
        ts.append(ColorJitter(color_jitter, color_jitter, color_jitter, color_jitter / 4))
    if grayscale:
        ts.append(RandomGrayscale(grayscale))
    if blur:
        ts.append(RandomGaussianBlur(blur))
    if flip:
        ts.append(RandomHorizontalFlip())
    return Compose(ts + [ToNormalizedTensor()])


def eval_transform(image_size: int) -> Compose:
    return Compose([Resize(image_size), CenterCrop(image_size), ToNormalizedTensor()])


# -----------------------------------------------------------------------------
# Datasets and the loader

def _atomic_write_text(path: str, text: str):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _sample_rng(seed: int, epoch: int, index: int) -> random.Random:
    return random.Random(f"aug/{seed}/{epoch}/{index}")


class ShapesDataset(torch.utils.data.Dataset):
    """Map-style view of one shapes split. The shapes images are generated at the model's
    resolution and not augmented: a crop could cut an object away, a flip swaps left and
    right, a colour jitter changes colour names; every sample is already a fresh draw."""

    def __init__(self, split="train", size=None, seed=0, image_size=SHAPES_IMAGE_SIZE, tokenizer=None):
        self.split, self.seed, self.image_size, self.tokenizer = split, seed, image_size, tokenizer
        self.size = size or SHAPES_SIZES[split]
        self.to_tensor = ToNormalizedTensor()
        self.epoch = 0

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        scene = shapes_scene(self.split, index, self.seed, self.image_size)
        return {"image": self.to_tensor(scene.image), "caption": scene.caption, "tree": scene.tree,
                "key": f"{self.split}{index:08d}"}


def collate(samples: list, tokenizer=None) -> dict:
    """List of sample dicts -> batch dict; None samples (skipped bad input) are dropped."""
    samples = [s for s in samples if s is not None]
    batch = {"image": torch.stack([s["image"] for s in samples]),
             "caption": [s["caption"] for s in samples],
             "tree": [s.get("tree") for s in samples],
             "key": [s.get("key") for s in samples]}
    if tokenizer is not None:
        batch["text"] = tokenizer(batch["caption"])
    return batch


class _Collate:  # picklable for worker processes
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, samples):
        return collate(samples, self.tokenizer)


class MapLoader:
    """DDP loader over a map-style dataset. Each epoch draws a permutation from (seed, epoch)
    (the same on every rank), drops the tail so that every rank gets the same number of
    full batches, and gives rank r the indices r, r + W, r + 2W, ... Its position (epoch,
    batches consumed) is a JSON-able state, so a resumed run continues with the next batch."""

    def __init__(self, dataset, batch_size, tokenizer=None, train=True, rank=0, world_size=1, num_workers=0,
                 seed=0, drop_last=True):
        self.dataset, self.batch_size, self.tokenizer = dataset, batch_size, tokenizer
        self.train, self.rank, self.world_size = train, rank, world_size
        self.num_workers, self.seed, self.drop_last = num_workers, seed, drop_last
        self.epoch, self.batches_done = 0, 0
        self.num_samples = len(dataset)
        self.skipped = 0
        if drop_last and len(dataset) < batch_size * world_size:
            raise DataError(f"dataset has {len(dataset)} samples, fewer than one global batch "
                            f"({batch_size} x {world_size} ranks)")

    def set_epoch(self, epoch):
        if epoch != self.epoch:
            self.epoch, self.batches_done = epoch, 0

    def _rank_batches(self) -> list:
        n = len(self.dataset)
        if self.train:
            g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        per_step = self.batch_size * self.world_size
        if self.drop_last:
            order = order[: n // per_step * per_step]
        mine = order[self.rank::self.world_size]
        return [mine[i:i + self.batch_size] for i in range(0, len(mine), self.batch_size)]

    def __len__(self):
        return len(self._rank_batches())

    def __iter__(self):
        """The rest of the current epoch; afterwards the loader points at the next epoch."""
        batches = self._rank_batches()[self.batches_done:]
        if hasattr(self.dataset, "epoch"):
            self.dataset.epoch = self.epoch
        dl = torch.utils.data.DataLoader(self.dataset, batch_sampler=batches, num_workers=self.num_workers,
                                         collate_fn=_Collate(self.tokenizer), persistent_workers=False)
        for batch in dl:
            self.batches_done += 1
            self.skipped += self.batch_size - len(batch["caption"])
            if len(batch["caption"]):
                yield batch
        self.epoch, self.batches_done = self.epoch + 1, 0

    def forever(self):
        """Batches across epochs without end (for step-based training loops)."""
        while True:
            yield from self

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self.batches_done, "skipped": self.skipped}

    def load_state_dict(self, state: dict):
        self.epoch, self.batches_done = int(state["epoch"]), int(state["batches_done"])
        self.skipped = int(state.get("skipped", 0))


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


def make_loader(spec: str, split: str = "train", batch_size: int = 64, tokenizer=None, image_size: int = 64,
                train: bool = True, rank: int = 0, world_size: int = 1, num_workers: int = 0, seed: int = 0,
                resampled: bool = False, drop_last: bool = True, image_root: str | None = None):
    """The loader for a `--data` spec (see the module docstring and SPEC.md section 1)."""
    if spec == "shapes" or spec.startswith("shapes:"):
        opts = parse_shapes_spec(spec)
        size = opts.get("train_size") if split == "train" else None
        ds = ShapesDataset(split, size, opts.get("seed", 0), image_size, tokenizer)
        return MapLoader(ds, batch_size, tokenizer, train, rank, world_size, num_workers, seed, drop_last)
    raise DataError(f"{spec}: unknown data spec")


def captions_for_tokenizer(spec: str, max_captions: int = 100_000) -> list:
    if spec == "shapes" or spec.startswith("shapes:"):
        return shapes_captions(min(max_captions, 5000), parse_shapes_spec(spec).get("seed", 0))
    raise DataError(f"{spec}: unknown data spec")
