"""
Evaluate an il_clip.py / mm_learngene.py checkpoint on compositional and recognition
benchmarks, and run the analysis probes of the IL-CLIP paper (section 4.4).

    python eval_compositional.py --ckpt out/il                       # built-in shapes benchmark
    python eval_compositional.py --ckpt out/il --benchmarks all \
        --sugarcrepe sugarcrepe/ --sugarcrepe_images coco/val2017 --out results.json
    python eval_compositional.py --init ViT-B-32.safetensors --vocab bpe_simple_vocab_16e6.txt.gz

Benchmarks (--benchmarks a,b,...; default `shapes`; `all` = every one below):
  shapes        the built-in benchmark of data.py: 7 SugarCrepe categories (pair accuracy) +
                systematicity / productivity (R@1 among positive + hard negatives). No files.
  sugarcrepe    --sugarcrepe DIR ({subset}.json x 7) --sugarcrepe_images DIR (COCO val2017);
                per subset, Table 1's add / replace / swap means, and the mean of the 7
  crepe         --crepe DIR (the released CSVs, searched recursively) --crepe_images DIR (Visual
                Genome: VG_100K/, VG_100K_2/; the CSV's image_path when present); per file, and
                per productivity type (atom, negate, swap) the mean over complexities 4-12
  cola          --cola FILE (JSON list of [img1, cap1, img2, cap2]) --cola_images DIR
  winoground    --winoground DIR (examples.jsonl + images/ or images.zip, at DIR or DIR/data)
  zeroshot      --zeroshot DIR|shapes (ImageFolder) [--classnames F] [--templates NAME|F]:
                top-1, top-5 (null under 5 classes), mean per-class recall (CLIP_benchmark's)
  retrieval     --retrieval FILE|shapes (Karpathy JSON) --retrieval_images DIR [--retrieval_split]
  linear_probe  --linear_probe DIR|shapes (ImageFolder with train/ and test/); no weight decay
                (the IL paper's appendix) unless --linear_probe_l2_sweep
  easy_to_learn frozen vision agent + codebook, a fresh language agent (fixed seed) trained on
                --probe_data; accuracy curve for --ckpt and every --compare_ckpts on one plot (Fig. 5)
  spectral      product of per-layer spectral norms (power iteration; Fig. 4's quantity, NOT a
                Lipschitz bound: see spectral_product), per gen{g}/ snapshot, for --ckpt and
                every --compare_ckpts on one plot
  codebook      top-k --viz_data images per code as a PNG grid (Fig. 6)
All accuracies are in percent. Output: a markdown table on stdout, JSON to --out, PNGs to
--plot_dir. What each number covers sits beside it: n_scored and n_skipped (malformed rows,
images not found or unreadable), and a mean is null, with the reason, unless every subset
it averages was scored in full. A benchmark whose flags are not given is skipped; one whose
paths do not exist, or that scored nothing, is an `error:` line and exit status 2 at the
end (the other benchmarks still run). Scoring conventions (stated once): a hard-negative
comparison is correct only if the positive scores strictly higher, so a tie counts as
wrong; R@k ranks ties pessimistically (a negative that ties the best positive is ranked
above it).
"""
import argparse
import ast
import copy
import csv
import glob
import io
import json
import math
import os
import random
import re
import sys
import zipfile
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from tqdm import tqdm

import data

BENCHMARKS = ["shapes", "sugarcrepe", "crepe", "cola", "winoground", "zeroshot", "retrieval",
              "linear_probe", "easy_to_learn", "spectral", "codebook"]
SUGARCREPE_SUBSETS = ["add_obj", "add_att", "replace_obj", "replace_att", "replace_rel", "swap_obj", "swap_att"]
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif")
# OpenAI CLIP's 80 ImageNet prompt templates (CLIP repo, notebooks/Prompt_Engineering_for_ImageNet.ipynb)
OPENAI_IMAGENET_TEMPLATES = [
    'a bad photo of a {}.', 'a photo of many {}.', 'a sculpture of a {}.', 'a photo of the hard to see {}.',
    'a low resolution photo of the {}.', 'a rendering of a {}.', 'graffiti of a {}.', 'a bad photo of the {}.',
    'a cropped photo of the {}.', 'a tattoo of a {}.', 'the embroidered {}.', 'a photo of a hard to see {}.',
    'a bright photo of a {}.', 'a photo of a clean {}.', 'a photo of a dirty {}.', 'a dark photo of the {}.',
    'a drawing of a {}.', 'a photo of my {}.', 'the plastic {}.', 'a photo of the cool {}.',
    'a close-up photo of a {}.', 'a black and white photo of the {}.', 'a painting of the {}.',
    'a painting of a {}.', 'a pixelated photo of the {}.', 'a sculpture of the {}.', 'a bright photo of the {}.',
    'a cropped photo of a {}.', 'a plastic {}.', 'a photo of the dirty {}.', 'a jpeg corrupted photo of a {}.',
    'a blurry photo of the {}.', 'a photo of the {}.', 'a good photo of the {}.', 'a rendering of the {}.',
    'a {} in a video game.', 'a photo of one {}.', 'a doodle of a {}.', 'a close-up photo of the {}.',
    'a photo of a {}.', 'the origami {}.', 'the {} in a video game.', 'a sketch of a {}.', 'a doodle of the {}.',
    'a origami {}.', 'a low resolution photo of a {}.', 'the toy {}.', 'a rendition of the {}.',
    'a photo of the clean {}.', 'a photo of a large {}.', 'a rendition of a {}.', 'a photo of a nice {}.',
    'a photo of a weird {}.', 'a blurry photo of a {}.', 'a cartoon {}.', 'art of a {}.', 'a sketch of the {}.',
    'a embroidered {}.', 'a pixelated photo of a {}.', 'itap of the {}.', 'a jpeg corrupted photo of the {}.',
    'a good photo of a {}.', 'a plushie {}.', 'a photo of the nice {}.', 'a photo of the small {}.',
    'a photo of the weird {}.', 'the cartoon {}.', 'art of the {}.', 'a drawing of the {}.',
    'a photo of the large {}.', 'a black and white photo of a {}.', 'the plushie {}.', 'a dark photo of a {}.',
    'itap of a {}.', 'graffiti of the {}.', 'a toy {}.', 'itap of my {}.', 'a photo of a cool {}.',
    'a photo of a small {}.', 'a tattoo of the {}.',
]
# --templates NAME: a named set; --templates FILE: your own (one per line, with `{}`)
TEMPLATES = {"clip8": ["a photo of a {}.", "a picture of a {}.", "a rendering of a {}.", "a drawing of a {}.",
                       "a photo of the {}.", "a close-up photo of a {}.", "a photo of a small {}.",
                       "a photo of a large {}."],  # 8 of the 80, the default
             "openai_imagenet": OPENAI_IMAGENET_TEMPLATES}


class ConfigError(Exception):
    """A user mistake in flags or checkpoints: printed as `error: ...`, exit 2."""


class Skip(Exception):
    """A benchmark that cannot run here (its files were not given or not found)."""


def warn(msg):
    tqdm.write(f"warning: {msg}", file=sys.stderr)


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="an il_clip.py / mm_learngene.py out_dir")
    p.add_argument("--init", help="OpenAI-format weights (.safetensors / .pt) instead of --ckpt")
    p.add_argument("--vocab", help="bpe_simple_vocab_16e6.txt.gz, the tokenizer for --init weights")
    p.add_argument("--quick_gelu", action=argparse.BooleanOptionalAction, default=None,
                   help="the MLP activation of the loaded weights: QuickGELU (OpenAI's CLIP, open_clip's *-quickgelu) or "
                        "exact GELU (--no-quick_gelu: open_clip's LAION / DataComp ViT-B-32). Default None: what the "
                        "checkpoint's config.json says; for --init weights the open_clip_config.json / config.json "
                        "beside them, else QuickGELU (assumed, said so). Printed.")
    p.add_argument("--benchmarks", default="shapes", help=f"comma list of {','.join(BENCHMARKS)} or all")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--plot_dir", help="where PNGs go (default: the --out folder, else the checkpoint dir)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch_size", type=int, default=64, help="images / captions per forward pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no_progress", action="store_true", help="no tqdm bars")
    # built-in data
    p.add_argument("--shapes_n", type=int, default=200, help="shapes benchmark items per category")
    p.add_argument("--shapes_seed", type=int, default=0)
    # released benchmarks
    p.add_argument("--sugarcrepe"), p.add_argument("--sugarcrepe_images")
    p.add_argument("--crepe"), p.add_argument("--crepe_images")
    p.add_argument("--cola"), p.add_argument("--cola_images")
    p.add_argument("--winoground")
    p.add_argument("--zeroshot", default="shapes", help="ImageFolder DIR, or `shapes`")
    p.add_argument("--classnames", help="class names, one per line in sorted-folder order (default: folder names)")
    p.add_argument("--templates", default="clip8", help=f"zero-shot prompt templates: {' | '.join(TEMPLATES)} "
                   "(OpenAI's 80 ImageNet templates) or a FILE, one per line with {} (default: clip8, 8 of the 80)")
    p.add_argument("--retrieval", default="shapes", help="Karpathy JSON FILE, or `shapes`")
    p.add_argument("--retrieval_images", help="image root of the Karpathy JSON")
    p.add_argument("--retrieval_split", default="test")
    p.add_argument("--linear_probe", default="shapes", help="ImageFolder DIR with train/ and test/, or `shapes`")
    p.add_argument("--linear_probe_l2_sweep", action="store_true",
                   help="linear probe: pick the L2 strength on held-out train (CLIP's protocol); default: none, as the IL "
                        "paper's appendix")
    p.add_argument("--linear_probe_val_frac", type=float, default=0.2,
                   help="--linear_probe_l2_sweep: train fraction held out to pick the L2 strength")
    # analysis
    p.add_argument("--compare_ckpts", default="",
                   help="easy_to_learn, spectral: more checkpoints drawn in the same plot (comma list; Figs. 4, 5)")
    p.add_argument("--probe_data", help="easy_to_learn: any --data spec (default: the checkpoint's training data)")
    p.add_argument("--viz_data", help="codebook: any --data spec (default: the checkpoint's training data)")
    p.add_argument("--image_root", help="--probe_data / --viz_data image root (default: the checkpoint's)")
    p.add_argument("--csv_img_key", help="--probe_data / --viz_data CSV image column (default: the checkpoint's)")
    p.add_argument("--csv_caption_key", help="--probe_data / --viz_data CSV caption column (default: the checkpoint's)")
    p.add_argument("--csv_separator", help="--probe_data / --viz_data CSV separator (default: the checkpoint's)")
    p.add_argument("--probe_steps", type=int, default=200)
    p.add_argument("--probe_batch", type=int, default=64)
    p.add_argument("--probe_lr", type=float, default=5e-4)
    p.add_argument("--probe_eval_every", type=int, default=20)
    p.add_argument("--probe_eval_n", type=int, default=256, help="held-out --probe_data pairs for the accuracy curve")
    p.add_argument("--probe_seed", type=int, default=1234, help="seed of the fresh language agent (same for every checkpoint)")
    p.add_argument("--power_iters", type=int, default=100)
    p.add_argument("--viz_codes", type=int, default=8, help="codebook: how many codes (the most used ones)")
    p.add_argument("--viz_topk", type=int, default=5)
    p.add_argument("--viz_images", type=int, default=500, help="codebook: --viz_data images searched")
    args = p.parse_args(argv)
    names = BENCHMARKS if args.benchmarks == "all" else [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    unknown = [b for b in names if b not in BENCHMARKS]
    if unknown:
        raise ConfigError(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)} or all")
    args.benchmark_list = names
    if bool(args.ckpt) == bool(args.init):
        raise ConfigError("give exactly one of --ckpt OUT_DIR or --init WEIGHTS")
    return args


# -----------------------------------------------------------------------------
# Model and tokenizer

KNOWN_SCRIPTS = ("il_clip.py", "mm_learngene.py")


def load_checkpoint(path, args):
    """(model, tokenizer, config) from an out_dir, a checkpoint/ folder or a weights file,
    via il_clip.load_model with args.quick_gelu (None: the config's; QuickGELU for bare
    weights). Refuses, with one line, checkpoints of other methods and tokenizers that do
    not fit."""
    try:
        import il_clip
    except ImportError as e:
        raise ConfigError(f"cannot import il_clip.py ({e}); run from the repository root") from None
    if not os.path.exists(path):
        raise ConfigError(f"{path}: checkpoint not found")
    path = data.checkpoint_dir(path)
    cfg_path = os.path.join(path, "config.json")
    if os.path.isdir(path) and os.path.exists(cfg_path):
        with open(cfg_path) as f:
            try:
                cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{cfg_path}: invalid JSON ({e.msg}, line {e.lineno})") from None
        model_cfg = cfg.get("model") if isinstance(cfg, dict) else None
        if not (isinstance(model_cfg, dict) and {"vision_width", "text_width", "vocab_size"} <= set(model_cfg)):
            raise ConfigError(f"{path}: config.json holds no CLIP model config: a checkpoint of another method "
                              f"(composer.py?); eval_compositional.py evaluates {' / '.join(KNOWN_SCRIPTS)} checkpoints")
        if cfg.get("modality", "clip") != "clip":
            raise ConfigError(f"{path}: a {cfg['modality']}-only mm_learngene.py descendant; these benchmarks need "
                              f"both towers (expand with --modality clip)")
    try:
        model, tok, config = il_clip.load_model(path, device=args.device, quick_gelu=args.quick_gelu)
    except (data.DataError, il_clip.ConfigError) as e:
        raise ConfigError(str(e)) from None
    except (KeyError, ValueError, RuntimeError, OSError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path}: not an il_clip.py / mm_learngene.py checkpoint or OpenAI-format weights ({msg})") from None
    if tok is None:
        if not args.vocab:
            raise ConfigError(f"{path}: weights without a tokenizer; give --vocab bpe_simple_vocab_16e6.txt.gz")
        tok = data.build_tokenizer(vocab_path=args.vocab, context_length=model_field(model, config, "context_length", 77))
    check_tokenizer(tok, model, config, path)
    model.to(args.device).eval()
    return model, tok, config


def model_field(model, config, name, default=None):
    """A model-config value: model.cfg / model.config (dataclass or dict), else config.json."""
    for holder in (getattr(model, "cfg", None), getattr(model, "config", None), config, (config or {}).get("model")):
        if holder is None:
            continue
        value = holder.get(name) if isinstance(holder, dict) else getattr(holder, name, None)
        if value is not None:
            return value
    return default


def check_tokenizer(tok, model, config, path):
    vocab = model_field(model, config, "vocab_size")
    eot = model_field(model, config, "eot_token_id")
    ctx = model_field(model, config, "context_length")
    problems = []
    if vocab is not None and tok.vocab_size != vocab:
        problems.append(f"tokenizer has {tok.vocab_size} tokens, the model's embedding {vocab}")
    if eot is not None and tok.eot_id != eot:
        problems.append(f"tokenizer EOT id {tok.eot_id}, the model pools at {eot}")
    if ctx is not None and tok.context_length != ctx:
        problems.append(f"tokenizer context {tok.context_length}, the model's {ctx}")
    if problems:
        raise ConfigError(f"{path}: tokenizer mismatch: {'; '.join(problems)}")


# -----------------------------------------------------------------------------
# Embeddings: computed in batches, once per unique image and caption, shared by benchmarks

@dataclass(frozen=True)
class ImageRef:
    """An image to embed: a file, a member of a zip file (path = the zip), or an in-memory
    PIL; optionally cropped to box = (x, y, w, h)."""
    key: str
    path: str = None
    box: tuple = None
    pil: object = None
    member: str = None

    def open(self):
        if self.member is not None:
            with zipfile.ZipFile(self.path) as z:
                img = Image.open(io.BytesIO(z.read(self.member)))
        else:
            img = self.pil if self.pil is not None else Image.open(self.path)
        img = img.convert("RGB")
        if self.box is not None:
            x, y, w, h = self.box
            img = img.crop((x, y, x + w, y + h))
        return img


def file_ref(path, box=None):
    path = os.path.abspath(path)
    key = path if box is None else f"{path}#{','.join(str(v) for v in box)}"
    return ImageRef(key, path=path, box=box)


class Embedder:
    def __init__(self, model, tokenizer, image_size, batch_size=64, device="cpu", progress=True):
        self.model, self.tokenizer, self.batch_size, self.device = model, tokenizer, batch_size, device
        self.transform = data.eval_transform(image_size)
        self.progress = progress
        self.image_cache, self.text_cache, self.bad_images = {}, {}, {}

    def _bar(self, n, desc):
        return tqdm(total=n, desc=desc, unit="item", disable=not self.progress or n == 0, leave=False)

    @torch.no_grad()
    def images(self, refs):
        """{key: embedding} for every ref whose image could be read (the others are warned
        about once and left out, so a benchmark can drop the rows that use them)."""
        todo = list({r.key: r for r in refs if r.key not in self.image_cache and r.key not in self.bad_images}.values())
        bar = self._bar(len(todo), "images")
        for i in range(0, len(todo), self.batch_size):
            chunk, tensors = [], []
            for r in todo[i:i + self.batch_size]:
                try:
                    tensors.append(self.transform(r.open()))
                    chunk.append(r)
                except (OSError, ValueError, KeyError, zipfile.BadZipFile, Image.DecompressionBombError) as e:
                    self.bad_images[r.key] = str(e)
                    warn(f"{r.path or r.key}: cannot read image ({type(e).__name__}); rows that use it are skipped")
            if chunk:
                z = self.model.encode_image(torch.stack(tensors).to(self.device)).float().cpu()
                self.image_cache.update(zip((r.key for r in chunk), z))
            bar.update(len(todo[i:i + self.batch_size]))
        bar.close()
        return {r.key: self.image_cache[r.key] for r in refs if r.key in self.image_cache}

    @torch.no_grad()
    def texts(self, captions):
        """[N, E] embeddings of the captions, in order."""
        todo = list(dict.fromkeys(c for c in captions if c not in self.text_cache))
        bar = self._bar(len(todo), "captions")
        for i in range(0, len(todo), self.batch_size):
            chunk = todo[i:i + self.batch_size]
            z = self.model.encode_text(self.tokenizer(chunk).to(self.device)).float().cpu()
            self.text_cache.update(zip(chunk, z))
            bar.update(len(chunk))
        bar.close()
        if not captions:
            return torch.zeros(0, 0)
        return torch.stack([self.text_cache[c] for c in captions])


# -----------------------------------------------------------------------------
# Scores (pure functions of embeddings; rows hold ImageRefs and captions)

def pct(x):
    return round(100.0 * float(x), 4)


@dataclass
class Part:
    """One subset as read from its files: the rows that can be scored, and how many rows
    were skipped before scoring (malformed, or the image not found)."""
    rows: list
    skipped: int = 0


def usable(rows, emb_images, refs_of):
    """Rows whose images were all read (the rest are counted as skipped by the caller)."""
    return [r for r in rows if all(ref.key in emb_images for ref in refs_of(r))]


def counted(scores, rows, part):
    """scores | n_scored | n_skipped: what a number covers sits beside it. Nothing scored:
    every score is None, never a number for what was not measured."""
    n_skipped = part.skipped + len(part.rows) - len(rows)
    if not rows:
        scores = {k: None for k in scores}
    return scores | {"n_scored": len(rows), "n_skipped": n_skipped}


def pair_accuracy(emb, part):
    """part.rows: (image, positive, negative). Correct iff s(img, pos) > s(img, neg), strictly."""
    images = emb.images([r[0] for r in part.rows])
    rows = usable(part.rows, images, lambda r: [r[0]])
    if not rows:
        return counted({"acc": None}, rows, part)
    img = torch.stack([images[r[0].key] for r in rows])
    pos, neg = emb.texts([r[1] for r in rows]), emb.texts([r[2] for r in rows])
    correct = (img * pos).sum(-1) > (img * neg).sum(-1)
    return counted({"acc": pct(correct.float().mean())}, rows, part)


def r1_among_negatives(emb, part):
    """part.rows: (image, positive, [negatives]). R@1 (image -> text) as CREPE's
    get_one2many_rank: the rank of the positive among itself + its hard negatives is 0 iff
    it scores strictly higher than every negative (a tie ranks it below), so a row with an
    empty negative list has rank 0: correct, as the official script scores it."""
    images = emb.images([r[0] for r in part.rows])
    rows = usable(part.rows, images, lambda r: [r[0]])
    if not rows:
        return counted({"acc": None}, rows, part)
    captions = sorted({c for r in rows for c in [r[1], *r[2]]})
    text, index = emb.texts(captions), {c: i for i, c in enumerate(captions)}
    correct = 0
    for r in rows:
        s = (text[[index[c] for c in [r[1], *r[2]]]] * images[r[0].key]).sum(-1)  # equal captions tie exactly
        correct += bool(len(s) == 1 or s[0] > s[1:].max())
    return counted({"acc": pct(correct / len(rows))}, rows, part)


def winoground_scores(s):
    """s: [N, 2, 2] similarities s[n, caption, image]. Winoground's three scores:
    text  (each image prefers its caption):  s00 > s10 and s11 > s01
    image (each caption prefers its image):  s00 > s01 and s11 > s10   (= text -> image)
    group: both."""
    text = (s[:, 0, 0] > s[:, 1, 0]) & (s[:, 1, 1] > s[:, 0, 1])
    image = (s[:, 0, 0] > s[:, 0, 1]) & (s[:, 1, 1] > s[:, 1, 0])
    return {"text": pct(text.float().mean()), "image": pct(image.float().mean()),
            "group": pct((text & image).float().mean())}


def pair_of_pairs(emb, part):
    """part.rows: (image0, caption0, image1, caption1) -> Winoground scores."""
    images = emb.images([ref for r in part.rows for ref in (r[0], r[2])])
    rows = usable(part.rows, images, lambda r: [r[0], r[2]])
    if not rows:
        return counted({"text": None, "image": None, "group": None}, rows, part)
    img = torch.stack([torch.stack([images[r[0].key], images[r[2].key]]) for r in rows])  # [N, 2, E]
    cap = torch.stack([emb.texts([r[1], r[3]]) for r in rows])  # [N, 2, E]
    return counted(winoground_scores((cap[:, :, None] * img[:, None]).sum(-1)), rows, part)


def complete_mean(parts, names, metric="acc"):
    """The mean of `metric` over the subsets `names`, only when every one of them was scored
    in full; otherwise None and the reason (a mean over what happened to be readable is not
    the benchmark's mean)."""
    missing = [n for n in names if n not in parts or not parts[n].get("n_scored")]
    partial = [f"{n} ({parts[n]['n_skipped']} skipped)" for n in names
               if n not in missing and parts[n].get("n_skipped")]
    if missing or partial:
        why = [f"not scored: {', '.join(missing)}"] * bool(missing) + [f"incomplete: {', '.join(partial)}"] * bool(partial)
        return {metric: None, "reason": "; ".join(why)}
    return {metric: round(sum(parts[n][metric] for n in names) / len(names), 4), "over": len(names)}


def n_scored(result):
    """Items scored anywhere in a benchmark's result (None when it does not count items)."""
    if not isinstance(result, dict):
        return None
    counts = [result["n_scored"]] if "n_scored" in result else []
    counts += [c for c in (n_scored(v) for v in result.values()) if c is not None]
    return sum(counts) if counts else None


def recall_at_k(sim, positive, ks=(1, 5, 10), chunk=1024):
    """sim [Q, D], positive bool [Q, D] (each query has >= 1 positive). A query is a hit at k
    iff some positive is among its k best-scored items; ties rank against the positive."""
    hits = {k: 0 for k in ks}
    for i in range(0, sim.shape[0], chunk):
        s, p = sim[i:i + chunk], positive[i:i + chunk]
        best = s.masked_fill(~p, float("-inf")).max(1).values
        n_above = ((s >= best[:, None]) & ~p).sum(1)
        for k in ks:
            hits[k] += int((n_above < k).sum())
    return {k: pct(hits[k] / sim.shape[0]) for k in ks}


def retrieval_scores(emb, items):
    """items: [(ImageRef, [captions])]. Image -> text and text -> image R@1/5/10."""
    images = emb.images([it[0] for it in items])
    kept = usable(items, images, lambda it: [it[0]])
    if not kept:
        raise data.DataError(f"none of the {len(items)} images could be read")
    img = torch.stack([images[it[0].key] for it in kept])
    captions = [c for it in kept for c in it[1]]
    owner = torch.tensor([i for i, it in enumerate(kept) for _ in it[1]])
    txt = emb.texts(captions)
    positive = owner[None, :] == torch.arange(len(kept))[:, None]  # [images, captions]
    i2t = recall_at_k(img @ txt.T, positive)
    t2i = recall_at_k(txt @ img.T, positive.T)
    out = {f"i2t_R@{k}": v for k, v in i2t.items()} | {f"t2i_R@{k}": v for k, v in t2i.items()}
    out["mean_R"] = round(sum(i2t.values()) / 3 / 2 + sum(t2i.values()) / 3 / 2, 4)
    return counted(out, kept, Part(items)) | {"n_captions": len(captions)}


def zeroshot_weights(emb, classnames, templates):
    """Class embeddings: normalise each prompt's embedding, average over templates, re-normalise."""
    prompts = [t.format(c) for c in classnames for t in templates]
    z = F.normalize(emb.texts(prompts).view(len(classnames), len(templates), -1), dim=-1)
    return F.normalize(z.mean(1), dim=-1)


def classification_scores(logits, labels, ks=(1, 5)):
    """CLIP_benchmark's zero-shot metrics: top-k accuracy (None when there are fewer than k
    classes: top-k would be trivially 100) and mean per-class recall (balanced accuracy:
    the recall of each class present in `labels`, averaged with equal weight)."""
    out = {}
    for k in ks:
        hit = (logits.topk(k, dim=1).indices == labels[:, None]).any(1) if k <= logits.shape[1] else None
        out[f"top{k}"] = None if hit is None else pct(hit.float().mean())
    pred = logits.argmax(1)
    recalls = [(pred[labels == c] == c).float().mean() for c in labels.unique()]
    out["mean_per_class_recall"] = pct(sum(recalls) / len(recalls))
    return out


def fit_logistic(x, y, n_classes, weight_decay, max_iter=100):
    """Multinomial logistic regression with L2 penalty by L-BFGS (full batch)."""
    w = torch.zeros(x.shape[1], n_classes, requires_grad=True)
    b = torch.zeros(n_classes, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=max_iter, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(x @ w + b, y) + weight_decay * (w * w).sum()
        loss.backward()
        return loss
    opt.step(closure)
    return w.detach(), b.detach()


L2_SWEEP = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)


def linear_probe(train_x, train_y, test_x, test_y, n_classes, sweep=False, val_frac=0.2, seed=0):
    """Logistic regression on frozen image features. Default: the IL paper's appendix
    setting, no weight decay, fitted on all of train. `sweep`: pick the L2 strength from
    L2_SWEEP on a held-out part of train (CLIP's protocol), then refit on all of train."""
    out = {"weight_decay": 0.0}
    if sweep:
        perm = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(seed))
        n_val = max(1, int(len(train_x) * val_frac))
        val, fit = perm[:n_val], perm[n_val:]
        val_acc = {}
        for wd in L2_SWEEP:
            w, b = fit_logistic(train_x[fit], train_y[fit], n_classes, wd)
            val_acc[wd] = float(((train_x[val] @ w + b).argmax(1) == train_y[val]).float().mean())
        best = max(L2_SWEEP, key=lambda wd: (val_acc[wd], wd))  # ties: the stronger regulariser
        out = {"weight_decay": best, "val_top1": pct(val_acc[best])}
    w, b = fit_logistic(train_x, train_y, n_classes, out["weight_decay"])
    acc = ((test_x @ w + b).argmax(1) == test_y).float().mean()
    return {"top1": pct(acc)} | out | {"n_train": len(train_x), "n_test": len(test_x)}


# -----------------------------------------------------------------------------
# Readers for the released formats. A malformed row is reported (file:line) and skipped.

def json_rows(path):
    """[(line, key, value)] of a top-level JSON list (key = index) or object, so a
    malformed row can be reported with its line."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise data.DataError(f"{path}: cannot read ({e})") from None
    dec, rows, n, line, seen = json.JSONDecoder(), [], 0, 1, 0

    def skip(i):
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        return i

    def line_of(pos):
        nonlocal line, seen
        line, seen = line + text.count("\n", seen, pos), pos
        return line
    try:
        i = skip(0)
        if i >= len(text) or text[i] not in "[{":
            raise data.DataError(f"{path}: expected a JSON list or object")
        close = "]" if text[i] == "[" else "}"
        i = skip(i + 1)
        while i < len(text) and text[i] != close:
            key = n
            if close == "}":
                key, i = dec.raw_decode(text, i)
                i = skip(i)
                if text[i:i + 1] != ":":
                    raise data.DataError(f"{path}: line {line_of(i)}: expected ':'")
                i = skip(i + 1)
            value, end = dec.raw_decode(text, i)
            rows.append((line_of(i), key, value))
            n, i = n + 1, skip(end)
            if text[i:i + 1] == ",":
                i = skip(i + 1)
            elif text[i:i + 1] != close:
                raise data.DataError(f"{path}: line {line_of(i)}: expected ',' or '{close}'")
    except json.JSONDecodeError as e:
        raise data.DataError(f"{path}: line {e.lineno}: invalid JSON ({e.msg})") from None
    return rows


def bad_row(path, line, why):
    warn(f"{path}:{line}: {why}; row skipped")


def find_image(root, name, exts=("",) + IMAGE_EXTS):
    """root/name, root/basename(name) (URLs, foreign prefixes), with or without an extension."""
    for cand in (name, os.path.basename(str(name).rstrip("/"))):
        for ext in exts:
            path = os.path.join(root, f"{cand}{ext}")
            if os.path.isfile(path):
                return path
    return None


def require(*paths_and_flags):
    """Skip (a benchmark whose flag was not given) or fail (a path that was given but does
    not exist: a user mistake that must not pass as an empty result)."""
    for path, flag in paths_and_flags:
        if not path:
            raise Skip(f"no {flag} given")
    for path, flag in paths_and_flags:
        if not os.path.exists(path):
            raise data.DataError(f"{path}: not found (given as {flag})")


def read_sugarcrepe(root, image_root):
    """{subset: Part} for the subset files present ({subset}.json, SugarCrepe's data/ layout;
    early commits of the repository spell the object subsets add_ent / replace_ent / swap_ent)."""
    out = {}
    for subset in SUGARCREPE_SUBSETS:
        path = os.path.join(root, f"{subset}.json")
        early = os.path.join(root, f"{subset[:-len('_obj')]}_ent.json") if subset.endswith("_obj") else path
        path = early if not os.path.exists(path) and os.path.exists(early) else path  # *_ent.json: early releases
        if not os.path.exists(path):
            warn(f"{path} not found; SugarCrepe subset {subset} not scored")
            continue
        part = out[subset] = Part([])
        for line, key, v in json_rows(path):
            if not isinstance(v, dict) or not all(isinstance(v.get(k), str) for k in ("filename", "caption", "negative_caption")):
                bad_row(path, line, f"entry {key!r} needs string fields filename, caption, negative_caption")
                part.skipped += 1
                continue
            img = find_image(image_root, v["filename"], ("",))
            if img is None:
                bad_row(path, line, f"image {v['filename']} not found under {image_root}")
                part.skipped += 1
                continue
            part.rows.append((file_ref(img), v["caption"], v["negative_caption"]))
    if not out:
        raise Skip(f"no {{{','.join(SUGARCREPE_SUBSETS)}}}.json in {root}")
    return out


def parse_list(text):
    """A CREPE hard-negative cell: a Python / JSON list literal of strings."""
    value = ast.literal_eval(text)
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise ValueError("not a list of strings")
    return list(value)


CREPE_TYPES = ("atom", "negate", "swap")  # productivity hard-negative types, as CREPE's files spell them
CREPE_COMPLEXITIES = range(4, 13)


def crepe_subsets(path, fieldnames):
    """{subset name: hard-negative column} of one released CREPE CSV:
    prod_hard_negatives/{type}/prod_vg_hard_negs_{type}_complexity_{n}.csv (column hard_negs)
    -> productivity/{type}/complexity_{n}; syst_hard_negatives/
    syst_vg_hard_negs_{seen,unseen}_compounds_in_{dataset}.csv (valid_hard_negs_{atom,comp})
    -> systematicity/{dataset}/{seen,unseen}_compounds/{atom,comp}. Other names keep their stem."""
    stem = os.path.splitext(os.path.basename(path))[0]
    if "hard_negs" in fieldnames:
        m = re.fullmatch(r"prod_vg_hard_negs_(\w+?)_complexity_(\d+)", stem)
        return {f"productivity/{m[1]}/complexity_{m[2]}" if m else f"productivity/{stem}": "hard_negs"}
    m = re.fullmatch(r"syst_vg_hard_negs_(\w+?)_in_(\w+)", stem)
    prefix = f"systematicity/{m[2]}/{m[1]}" if m else f"systematicity/{stem}"
    return {f"{prefix}/{col[len('valid_hard_negs_'):]}": col for col in fieldnames
            if col.startswith("valid_hard_negs_")}


def find_vg_image(image_root, row):
    """A Visual Genome image in the released layout: the CSV's image_path when present (as
    given, or its last two parts / its name under image_root), else {image_id}.jpg in
    image_root/VG_100K/, image_root/VG_100K_2/ or image_root/."""
    given = (row.get("image_path") or "").strip()
    cands = [given] if given and os.path.isabs(given) else []
    if given:
        parts = given.replace("\\", "/").split("/")
        cands += [os.path.join(image_root, *parts[-2:]), os.path.join(image_root, parts[-1]),
                  os.path.join(image_root, given)]
    iid = str(row["image_id"]).strip()
    iid = iid[:-2] if iid.endswith(".0") else iid  # ids written as floats by pandas
    cands += [os.path.join(image_root, sub, f"{iid}{ext}") for sub in ("VG_100K", "VG_100K_2", "")
              for ext in ("", ".jpg")]
    return next((c for c in cands if os.path.isfile(c)), None)


def read_crepe_file(path, image_root, out):
    """Add one CREPE CSV's rows to out {subset: Part}."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        fields = reader.fieldnames or []
        missing = [c for c in ("image_id", "x", "y", "width", "height", "caption") if c not in fields]
        subsets = crepe_subsets(path, fields)
        if missing or not subsets:
            warn(f"{path}: not a CREPE hard-negative CSV (needs image_id,x,y,width,height,caption and "
                 f"hard_negs or valid_hard_negs_*); file skipped")
            return
        parts = {name: out.setdefault(name, Part([])) for name in subsets}
        for row in reader:
            line = reader.line_num
            try:
                box = tuple(int(round(float(row[c]))) for c in ("x", "y", "width", "height"))
                negs = {name: parse_list(row[col]) for name, col in subsets.items()}
                img = find_vg_image(image_root, row)
                why = None if img else f"image {row['image_id']} not found under {image_root} (VG_100K/, VG_100K_2/)"
            except (ValueError, SyntaxError, TypeError) as e:
                why = f"bad box or hard-negative list ({type(e).__name__})"
            if why:
                bad_row(path, line, why)
                for part in parts.values():
                    part.skipped += 1
                continue
            for name, n in negs.items():
                parts[name].rows.append((file_ref(img, box), row["caption"], n))


def read_crepe(root, image_root):
    """{subset: Part} of every CREPE CSV under root (searched recursively)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(root, "**", "*.csv"), recursive=True)):
        read_crepe_file(path, image_root, out)
    if not out:
        raise Skip(f"no CREPE CSV (hard_negs / valid_hard_negs_*) under {root}")
    return out


def pair_of_pairs_row(path, line, find, names, captions, part):
    """Append (image0, caption0, image1, caption1) to part, or count the row as skipped
    (reported) when an image is missing. find: name -> ImageRef or None."""
    refs = [find(str(n)) for n in names]
    if None in refs:
        bad_row(path, line, f"image {names[refs.index(None)]} not found")
        part.skipped += 1
    else:
        part.rows.append((refs[0], captions[0], refs[1], captions[1]))


def read_cola(path, image_root):
    part = Part([])
    find = lambda name: (lambda p: p and file_ref(p))(find_image(image_root, name, ("",)))
    for line, _, v in json_rows(path):
        if not (isinstance(v, list) and len(v) == 4 and all(isinstance(s, str) for s in v)):
            bad_row(path, line, "expected [image1, caption1, image2, caption2]")
            part.skipped += 1
            continue
        pair_of_pairs_row(path, line, find, [v[0], v[2]], [v[1], v[3]], part)
    return part


def winoground_images(folder):
    """name -> ImageRef for Winoground's images: folder/images/{name}.png, else straight out
    of folder/images.zip (the Hugging Face release ships the zip; no unzip needed)."""
    image_dir, zip_path = os.path.join(folder, "images"), os.path.join(folder, "images.zip")
    if os.path.isdir(image_dir):
        return lambda name: (lambda p: p and file_ref(p))(find_image(image_dir, name, ("",) + IMAGE_EXTS))
    if not os.path.isfile(zip_path):
        return lambda name: None
    try:
        with zipfile.ZipFile(zip_path) as z:
            members = {os.path.splitext(os.path.basename(m))[0]: m for m in z.namelist() if not m.endswith("/")}
    except (zipfile.BadZipFile, OSError) as e:
        raise data.DataError(f"{zip_path}: cannot read ({e})") from None
    zip_path = os.path.abspath(zip_path)
    return lambda name: (lambda m: m and ImageRef(f"{zip_path}::{m}", path=zip_path, member=m))(
        members.get(os.path.splitext(name)[0]))


def read_winoground(root):
    """The released layout: examples.jsonl (id, image_0, image_1, caption_0, caption_1) with
    images/{image}.png or images.zip beside it, at root or root/data."""
    cands = [os.path.join(root, "examples.jsonl"), os.path.join(root, "data", "examples.jsonl")]
    path = next((c for c in cands if os.path.exists(c)), None)
    if path is None:
        raise Skip(f"no examples.jsonl in {root} or {root}/data")
    find, part = winoground_images(os.path.dirname(path)), Part([])
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                v = json.loads(text)
                names, caps = [v["image_0"], v["image_1"]], [v["caption_0"], v["caption_1"]]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                bad_row(path, line, f"needs image_0, image_1, caption_0, caption_1 ({type(e).__name__})")
                part.skipped += 1
                continue
            pair_of_pairs_row(path, line, find, names, caps, part)
    return part


def read_image_folder(root):
    """data.image_folder (root/<class>/<image>, classes sorted) as ImageRefs."""
    paths, labels, classes = data.image_folder(root)
    return classes, [(file_ref(p), y) for p, y in zip(paths, labels)]


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [s.strip() for s in f if s.strip()]


# -----------------------------------------------------------------------------
# Benchmarks: each returns {metric: value} (and may raise Skip)

def shapes_refs(seed, n, name, images):
    return [ImageRef(f"shapes/{seed}/{n}/{name}/{i}", pil=img) for i, img in enumerate(images)]


_SHAPES_BENCH = {}


def shapes_benchmark(seed, n):
    if (seed, n) not in _SHAPES_BENCH:
        _SHAPES_BENCH[(seed, n)] = data.shapes_benchmark(seed=seed, n=n)
    return _SHAPES_BENCH[(seed, n)]


def bench_shapes(args, emb):
    """The built-in benchmark: generated, so every item is scored (the flat layout of
    data.shapes_benchmark: accuracy per category, mean of the 7, R@1 per split)."""
    bench, out = shapes_benchmark(args.shapes_seed, args.shapes_n), {}
    for cat in data.SHAPES_CATEGORIES:
        refs = shapes_refs(args.shapes_seed, args.shapes_n, cat, [it["image"] for it in bench[cat]])
        rows = [(r, it["caption"], it["negative_caption"]) for r, it in zip(refs, bench[cat])]
        out[cat] = pair_accuracy(emb, Part(rows))["acc"]
    out["mean_7"] = round(sum(out[c] for c in data.SHAPES_CATEGORIES) / 7, 4)
    for split in ("systematicity", "productivity"):
        refs = shapes_refs(args.shapes_seed, args.shapes_n, split, [it["image"] for it in bench[split]])
        rows = [(r, it["caption"], it["negatives"]) for r, it in zip(refs, bench[split])]
        out[split] = r1_among_negatives(emb, Part(rows))["acc"]
    return out | {"n_per_category": args.shapes_n}


def bench_sugarcrepe(args, emb):
    """Accuracy per subset, the paper's Table 1 columns (add, replace, swap: means of their
    subsets) and the mean of all 7; a mean is given only over subsets scored in full."""
    require((args.sugarcrepe, "--sugarcrepe"), (args.sugarcrepe_images, "--sugarcrepe_images"))
    parts = read_sugarcrepe(args.sugarcrepe, args.sugarcrepe_images)
    out = {s: pair_accuracy(emb, parts[s]) if s in parts else
           {"acc": None, "n_scored": 0, "n_skipped": 0, "reason": f"{s}.json not found"} for s in SUGARCREPE_SUBSETS}
    for group in ("add", "replace", "swap"):
        out[group] = complete_mean(out, [s for s in SUGARCREPE_SUBSETS if s.startswith(f"{group}_")])
    out["mean"] = complete_mean(out, SUGARCREPE_SUBSETS)
    return out


def bench_crepe(args, emb):
    """Image -> text R@1 per CSV subset, and per productivity type (atom, negate, swap; the
    paper's Table 1 calls atom "replace") the mean over complexities 4-12."""
    require((args.crepe, "--crepe"), (args.crepe_images, "--crepe_images"))
    out = {name: r1_among_negatives(emb, part) for name, part in sorted(read_crepe(args.crepe, args.crepe_images).items())}
    for kind in CREPE_TYPES:
        if any(name.startswith(f"productivity/{kind}/") for name in out):
            names = [f"productivity/{kind}/complexity_{c}" for c in CREPE_COMPLEXITIES]
            out[f"productivity/{kind}/mean_4-12"] = complete_mean(out, names)
    return out


def bench_cola(args, emb):
    require((args.cola, "--cola"), (args.cola_images, "--cola_images"))
    r = pair_of_pairs(emb, read_cola(args.cola, args.cola_images))
    # Cola multi-object: both captions must retrieve their own image (text -> image)
    return {"t2i": r["image"], "i2t": r["text"], "group": r["group"], "n_scored": r["n_scored"],
            "n_skipped": r["n_skipped"]}


def bench_winoground(args, emb):
    require((args.winoground, "--winoground"))
    return pair_of_pairs(emb, read_winoground(args.winoground))


def shapes_classification_set(split, n, seed):
    items = [data.shapes_classification(split, i, seed) for i in range(n)]
    refs = [ImageRef(f"shapes-cls/{seed}/{split}/{i}", pil=img) for i, (img, _) in enumerate(items)]
    return list(data.SHAPE_NAMES), list(zip(refs, [label for _, label in items]))


def classification_features(emb, items):
    """(features, labels, n_skipped): the images that could not be read are left out and counted."""
    images = emb.images([r for r, _ in items])
    kept = usable(items, images, lambda it: [it[0]])
    if not kept:
        raise data.DataError(f"none of the {len(items)} images could be read")
    return torch.stack([images[r.key] for r, _ in kept]), torch.tensor([y for _, y in kept]), len(items) - len(kept)


def read_templates(spec):
    """--templates: a named set (TEMPLATES) or a file with one template per line."""
    if spec in TEMPLATES:
        return TEMPLATES[spec]
    if not os.path.isfile(spec):
        raise data.DataError(f"{spec}: not a template file nor one of {', '.join(TEMPLATES)}")
    templates = read_lines(spec)
    bad = [t for t in templates if "{}" not in t]
    if bad or not templates:
        raise data.DataError(f"{spec}: " + (f"template without {{}}: {bad[0]!r}" if bad else "no templates"))
    return templates


def bench_zeroshot(args, emb):
    if args.zeroshot == "shapes":
        classnames, items = shapes_classification_set("test", max(args.shapes_n, 100), args.shapes_seed)
    else:
        require((args.zeroshot, "--zeroshot"))
        folders, items = read_image_folder(args.zeroshot)
        classnames = read_lines(args.classnames) if args.classnames else [c.replace("_", " ") for c in folders]
        if len(classnames) != len(folders):
            raise data.DataError(f"{args.classnames}: {len(classnames)} class names for {len(folders)} class folders")
    templates = read_templates(args.templates)
    x, y, skipped = classification_features(emb, items)
    w = zeroshot_weights(emb, classnames, templates)
    return classification_scores(x @ w.T, y) | {"n_scored": len(y), "n_skipped": skipped, "classes": len(classnames),
                                                "templates": args.templates if args.templates in TEMPLATES else len(templates)}


def bench_retrieval(args, emb):
    if args.retrieval == "shapes":
        n = max(args.shapes_n, 100)
        scenes = [data.shapes_scene("test", i, args.shapes_seed) for i in range(n)]
        items = [(ImageRef(f"shapes-scene/{args.shapes_seed}/test/{i}", pil=s.image), [s.caption])
                 for i, s in enumerate(scenes)]
    else:
        require((args.retrieval, "--retrieval"), (args.retrieval_images, "--retrieval_images"))
        items = [(file_ref(path), caps) for path, caps in
                 data.karpathy_items(args.retrieval, args.retrieval_images, args.retrieval_split)]
    return retrieval_scores(emb, items)


def bench_linear_probe(args, emb):
    if args.linear_probe == "shapes":
        n = max(4 * args.shapes_n, 200)
        classnames, train = shapes_classification_set("train", n, args.shapes_seed)
        _, test = shapes_classification_set("test", n // 2, args.shapes_seed)
    else:
        require((args.linear_probe, "--linear_probe"))
        train_dir, test_dir = (os.path.join(args.linear_probe, s) for s in ("train", "test"))
        require((train_dir, "--linear_probe"), (test_dir, "--linear_probe"))
        classnames, train = read_image_folder(train_dir)
        test_classes, test = read_image_folder(test_dir)
        if test_classes != classnames:
            raise data.DataError(f"{args.linear_probe}: train/ and test/ have different class folders")
    (tx, ty, train_skipped), (vx, vy, test_skipped) = classification_features(emb, train), classification_features(emb, test)
    out = linear_probe(tx, ty, vx, vy, len(classnames), args.linear_probe_l2_sweep, args.linear_probe_val_frac, args.seed)
    return out | {"n_scored": len(vy), "n_skipped": test_skipped, "n_train_skipped": train_skipped}


# -----------------------------------------------------------------------------
# Analysis (paper section 4.4)

def spectral_norm(w, iters=100, tol=1e-7, seed=0):
    """Largest singular value of a matrix by power iteration on W^T W (conv kernels are
    flattened to [out, in * kh * kw], exact for a stride = kernel patch embedding)."""
    w = w.detach().float().reshape(w.shape[0], -1)
    g = torch.Generator().manual_seed(seed)
    v = F.normalize(torch.randn(w.shape[1], generator=g), dim=0)
    sigma = 0.0
    for _ in range(iters):
        u = F.normalize(w @ v, dim=0)
        v = F.normalize(w.T @ u, dim=0)
        new = float(torch.dot(u, w @ v))
        if abs(new - sigma) <= tol * max(new, 1e-12):
            return new
        sigma = new
    return sigma


VISION_PREFIXES = ("visual.", "image_query.")  # il_clip.VISION_PREFIXES


def spectral_layers(model):
    """The linear maps of a model in parameter order: every weight with >= 2 dims except
    lookup tables (token / positional / class embeddings)."""
    return [(n, p) for n, p in model.named_parameters() if p.dim() >= 2 and "embedding" not in n]


def spectral_product(model, iters=100):
    """The paper's Fig. 4 quantity, Gouk et al. (paper ref. [19]): the product of the
    per-layer spectral norms, as log10 (astronomically large for a transformer), for all
    layers (both agents + the shared codebook), the vision agent (`visual.*`,
    `image_query.*`) and the language agent (the rest but the codebook).
    It is NOT an upper bound of this network's Lipschitz constant, and is not called one:
    residual paths (1 + L(block)) are not in the product, LayerNorm's slope reaches
    max|gain| / sqrt(eps) (about 316x at eps = 1e-5) on inputs of small spread, and
    dot-product self-attention is not globally Lipschitz (Kim et al., ICML 2021); it is finite
    here only because LayerNorm bounds its inputs, and a sound bound through all of that is
    astronomically loose. The product measures the size of the weights, which is what Fig. 4
    compares across generations."""
    per_layer = {n: spectral_norm(p, iters) for n, p in spectral_layers(model)}
    log = lambda names: round(sum(math.log10(max(per_layer[n], 1e-30)) for n in names), 6)
    vision = [n for n in per_layer if n.startswith(VISION_PREFIXES)]
    text = [n for n in per_layer if not n.startswith(VISION_PREFIXES) and n != "codebook"]
    return {"log10_product": log(per_layer), "log10_vision": log(vision), "log10_text": log(text),
            "layers": len(per_layer), "spectral_norms": {n: round(v, 6) for n, v in per_layer.items()}}


def out_dir_of(ckpt):
    """The out_dir of a --ckpt given as an out_dir or as its checkpoint/ folder (where
    gen{g}/ snapshots and config.json live)."""
    ckpt = os.path.normpath(ckpt)
    return os.path.dirname(ckpt) if os.path.basename(ckpt) == "checkpoint" else ckpt


def generation_snapshots(ckpt):
    """Generation snapshots inside an out_dir: sub-folders (gen*/ or generations/*/) with
    a model.safetensors, or files *gen*.safetensors; sorted by the number in the name."""
    if not ckpt or not os.path.isdir(ckpt):
        return []
    root = out_dir_of(ckpt)
    found = glob.glob(os.path.join(root, "gen*", "model.safetensors")) + \
        glob.glob(os.path.join(root, "generations", "*", "model.safetensors"))
    found = [os.path.dirname(p) for p in found] + glob.glob(os.path.join(root, "*gen*.safetensors")) + \
        glob.glob(os.path.join(root, "generations", "*.safetensors"))
    num = lambda p: int("".join(ch for ch in os.path.basename(p) if ch.isdigit()) or -1)
    return sorted(set(found), key=lambda p: (num(p), p))


def spectral_curve(ckpt, model, args):
    """{"final": spectral_product of the checkpoint, "generations": [per snapshot]}."""
    out = spectral_product(model, args.power_iters)
    curve = []
    for path in generation_snapshots(ckpt):
        snap = load_snapshot(path, model, ckpt, args)
        curve.append({"snapshot": os.path.relpath(path, out_dir_of(ckpt))} |
                     {k: v for k, v in spectral_product(snap, args.power_iters).items() if k != "spectral_norms"})
    return out | ({"generations": curve} if curve else {})


def bench_spectral(args, model, tok, config):
    """The product of spectral norms per generation snapshot, for --ckpt and every
    --compare_ckpts checkpoint on one plot (paper Fig. 4: IL-CLIP's generations against
    Codebook-CLIP). A checkpoint without snapshots is drawn as a flat line at its value."""
    runs = {run_name(args.ckpt or args.init): spectral_curve(args.ckpt, model, args)}
    for path in compare_ckpts(args):
        runs[run_name(path)] = spectral_curve(path, load_checkpoint(path, args)[0], args)
    n_gen = max([len(r.get("generations", [])) for r in runs.values()] + [2])
    series = {}
    for name, r in runs.items():
        gens = r.get("generations")
        series[name] = [(i, g["log10_vision"]) for i, g in enumerate(gens)] if gens else \
            [(0, r["log10_vision"]), (n_gen - 1, r["log10_vision"])]
    png = os.path.join(args.plot_dir, "spectral.png")
    draw_line_plot(png, series, "vision agent: product of spectral norms (not a Lipschitz bound)",
                   "generation snapshot", "log10 product")
    main = runs.pop(next(iter(runs)))
    return main | ({"compare": runs} if runs else {}) | {"png": png}


def load_snapshot(path, model, ckpt, args):
    """A generation snapshot: a folder loadable by il_clip.load_model, or a bare state dict
    loaded into a copy of the model."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return load_checkpoint(path, args)[0]
    from safetensors.torch import load_file
    snap = copy.deepcopy(model)
    try:
        snap.load_state_dict(load_file(os.path.join(path, "model.safetensors") if os.path.isdir(path) else path))
    except RuntimeError as e:
        raise ConfigError(f"{path}: generation snapshot does not match the model of {ckpt} ({str(e).splitlines()[0]})") from None
    return snap


def run_name(path):
    path = os.path.normpath(path)
    return os.path.basename(out_dir_of(path)) if os.path.isdir(path) else os.path.basename(path)


def compare_ckpts(args):
    return [p.strip() for p in args.compare_ckpts.split(",") if p.strip()]


def analysis_data(args, config, flag):
    """(spec, make_loader keywords) an analysis runs on: --probe_data / --viz_data, else the
    checkpoint's own training data (config.json "data", with its image root and CSV keys).
    Weights that do not say (--init) need the flag: never a silent fallback to shapes."""
    cfg = config if isinstance(config, dict) else {}
    spec = getattr(args, flag) or cfg.get("data")
    if not spec:
        raise Skip(f"give --{flag} (any --data spec): the weights do not say what data they were trained on")
    pick = lambda k, default: getattr(args, k) if getattr(args, k) is not None else cfg.get(k, default)
    return spec, {"image_root": pick("image_root", None), "csv_img_key": pick("csv_img_key", "filepath"),
                  "csv_caption_key": pick("csv_caption_key", "title"), "csv_separator": pick("csv_separator", None)}


def loader_for(spec, kw, split, tok, image_size, batch_size, train, seed=0):
    """data.make_loader for an analysis: a DataError (bad spec, unreadable files) is the
    analysis's error line, not a crash."""
    return data.make_loader(spec, split, batch_size=batch_size, tokenizer=tok, image_size=image_size, train=train,
                            seed=seed, drop_last=train, **kw)


def eval_batches(spec, kw, tok, size, batch_size, n):
    """Up to n held-out (image, caption) pairs: the `val` split where the format has one
    (shapes, Karpathy JSON), else the first n pairs of the data in loader order."""
    loader = loader_for(spec, kw, "val", tok, size, batch_size, train=False)
    batches, seen = [], 0
    for b in loader:
        if len(b["caption"]):
            batches.append(b)
            seen += len(b["caption"])
        if seen >= n:
            break
    if not batches:
        raise data.DataError(f"{spec}: no readable image-caption pair for the analysis")
    return batches, loader


def bench_codebook(args, model, tok, config):
    """Top-k images of --viz_data per code (paper Eq. 2: r_i = max over patches of <f_p, c_i>)
    for the codes used most (largest total sparsemax weight over the images; Fig. 6)."""
    if not getattr(getattr(model, "cfg", None), "codebook_size", 0):
        raise Skip("the model has no codebook (needs il_clip.py --method codebook / il)")
    spec, kw = analysis_data(args, config, "viz_data")
    batches, loader = eval_batches(spec, kw, tok, image_size_of(model, config), args.batch_size, args.viz_images)
    images = torch.cat([b["image"] for b in batches])[:args.viz_images]
    captions = [c for b in batches for c in b["caption"]][:args.viz_images]
    scores, weights = [], []
    with torch.no_grad():
        for i in range(0, len(images), args.batch_size):
            s, w = image_code_scores(model, images[i:i + args.batch_size].to(args.device))
            scores.append(s.float().cpu()), weights.append(w.float().cpu())
    scores, weights = torch.cat(scores), torch.cat(weights)  # [N, K]
    usage = weights.sum(0)
    codes = usage.argsort(descending=True)[:args.viz_codes].tolist()
    rows, out = [], {}
    for c in codes:
        top = scores[:, c].topk(min(args.viz_topk, len(images))).indices.tolist()
        out[str(c)] = {"usage": round(float(usage[c]), 6), "captions": [captions[i] for i in top]}
        rows.append((f"code {c}", [to_pil(images[i]) for i in top]))
    png = os.path.join(args.plot_dir, "codebook.png")
    draw_image_grid(png, rows)
    return {"data": spec, "n_images": len(images), "n_skipped": loader.skipped, "codes": out,
            "active_codes": int((usage > 0).sum()), "png": png}


def to_pil(x):
    """A data.eval_transform tensor back to a PIL image (undo the CLIP normalisation)."""
    mean, std = torch.tensor(data.CLIP_MEAN)[:, None, None], torch.tensor(data.CLIP_STD)[:, None, None]
    arr = ((x.float().cpu() * std + mean).clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
    return Image.fromarray(arr)


def image_code_scores(model, images):
    """Per-code scores of images, r_i = max over patches of q(f_p) . c_i (paper Eq. 2, with
    il_clip's scaling and temperature), and their sparsemax weights w_i (Eq. 3): [B, K] each."""
    return model.code_scores(model.visual.forward_tokens(images), None, model.image_query)


def image_size_of(model, config):
    return int(model_field(model, config, "image_size", data.SHAPES_IMAGE_SIZE))


def fresh_language_agent(model, seed):
    """A copy of the model whose language agent (il_clip.agent_params(.., "language"): token +
    positional embedding, text transformer, ln_final, text projection, text query map) is
    re-initialised as at step 0 from `seed` (il_clip's own spawn initialiser, so every
    checkpoint of one architecture gets the same student), everything else frozen."""
    import il_clip
    student = copy.deepcopy(model).cpu()
    fresh = copy.deepcopy(student)
    fresh.init_agent("language", torch.Generator().manual_seed(seed))
    names = {n for n, _ in il_clip.agent_params(student, "language")}
    src = dict(fresh.named_parameters())
    with torch.no_grad():
        for n, p in student.named_parameters():
            if n in names:
                p.copy_(src[n])
            p.requires_grad_(n in names)
    return student


def in_batch_accuracy(img, txt):
    """Mean of image -> text and text -> image top-1 within the batch."""
    s = img @ txt.T
    target = torch.arange(len(s))
    return 0.5 * float((s.argmax(1) == target).float().mean() + (s.argmax(0) == target).float().mean())


def easy_to_learn_curve(model, tok, config, args, spec, kw):
    """Train a fresh language agent against the frozen vision agent + codebook on `spec`;
    in-batch accuracy on held-out pairs every probe_eval_every steps."""
    size, device = image_size_of(model, config), args.device
    student = fresh_language_agent(model, args.probe_seed).to(device)
    student.eval()  # no dropout; vision statistics stay fixed
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.probe_lr, weight_decay=0.0)
    scale = float(student.logit_scale.exp().clamp(max=100)) if hasattr(student, "logit_scale") else 1 / 0.07
    train = loader_for(spec, kw, "train", tok, size, args.probe_batch, train=True, seed=args.probe_seed).forever()
    val, _ = eval_batches(spec, kw, tok, size, args.probe_batch, args.probe_eval_n)
    with torch.no_grad():
        val_img = [student.encode_image(b["image"].to(device)) for b in val]

    def evaluate():
        with torch.no_grad():
            accs = [in_batch_accuracy(vi, student.encode_text(b["text"].to(device))) for vi, b in zip(val_img, val)]
        return pct(sum(accs) / len(accs))
    curve = [(0, evaluate())]
    for step in tqdm(range(1, args.probe_steps + 1), desc="easy-to-learn", disable=args.no_progress, leave=False):
        batch = next(train)
        with torch.no_grad():
            img = student.encode_image(batch["image"].to(device))
        txt = student.encode_text(batch["text"].to(device))
        logits = scale * img @ txt.T
        target = torch.arange(len(logits), device=device)
        loss = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % args.probe_eval_every == 0 or step == args.probe_steps:
            curve.append((step, evaluate()))
    return curve


def bench_easy_to_learn(args, model, tok, config):
    """The Fig. 5 probe for --ckpt and every --compare_ckpts checkpoint, all on the same
    --probe_data (default: --ckpt's training data) and the same student seed."""
    spec, kw = analysis_data(args, config, "probe_data")
    runs = {run_name(args.ckpt or args.init): (model, tok, config)}
    for path in compare_ckpts(args):
        runs[run_name(path)] = load_checkpoint(path, args)
    curves = {name: easy_to_learn_curve(m, t, c, args, spec, kw) for name, (m, t, c) in runs.items()}
    png = os.path.join(args.plot_dir, "easy_to_learn.png")
    draw_line_plot(png, curves, "fresh language agent vs frozen vision agent", "step", "in-batch accuracy (%)")
    out = {name: {"final": c[-1][1], "curve": [{"step": s, "acc": a} for s, a in c]} for name, c in curves.items()}
    return out | {"data": spec, "png": png, "seed": args.probe_seed, "steps": args.probe_steps}


# -----------------------------------------------------------------------------
# PNGs with PIL only

PALETTE = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127)]


def draw_line_plot(path, series, title, xlabel, ylabel, size=(640, 420)):
    """series: {name: [(x, y), ...]} -> a line plot with axes, tick labels and a legend."""
    W, H = size
    left, right, top, bottom = 60, 20, 30, 50
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    pts = [p for s in series.values() for p in s if math.isfinite(p[1])]
    if not pts:
        pts = [(0, 0), (1, 1)]
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    pad = 0.05 * (y1 - y0)
    y0, y1 = y0 - pad, y1 + pad
    X = lambda x: left + (x - x0) / (x1 - x0) * (W - left - right)
    Y = lambda y: H - bottom - (y - y0) / (y1 - y0) * (H - top - bottom)
    d.rectangle([left, top, W - right, H - bottom], outline="black")
    for i in range(5):
        xv, yv = x0 + i * (x1 - x0) / 4, y0 + i * (y1 - y0) / 4
        d.line([X(xv), H - bottom, X(xv), H - bottom + 4], fill="black")
        d.text((X(xv) - 10, H - bottom + 6), f"{xv:.4g}", fill="black")
        d.line([left - 4, Y(yv), left, Y(yv)], fill="black")
        d.text((4, Y(yv) - 5), f"{yv:.4g}", fill="black")
    d.text((W // 2 - 3 * len(title), 8), title, fill="black")
    d.text((W // 2 - 3 * len(xlabel), H - 18), xlabel, fill="black")
    d.text((4, top - 22), ylabel, fill="black")
    for k, (name, s) in enumerate(series.items()):
        colour = PALETTE[k % len(PALETTE)]
        xy = [(X(x), Y(y)) for x, y in s if math.isfinite(y)]
        if len(xy) > 1:
            d.line(xy, fill=colour, width=2)
        for x, y in xy:
            d.ellipse([x - 2, y - 2, x + 2, y + 2], fill=colour)
        d.line([left + 10, top + 10 + 14 * k, left + 30, top + 10 + 14 * k], fill=colour, width=3)
        d.text((left + 36, top + 4 + 14 * k), str(name), fill="black")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    img.save(path)


def draw_image_grid(path, rows, cell=64, label_w=80):
    """rows: [(label, [PIL images])] -> one row per label."""
    cols = max((len(ims) for _, ims in rows), default=1)
    img = Image.new("RGB", (label_w + cols * (cell + 4), max(1, len(rows)) * (cell + 4)), "white")
    d = ImageDraw.Draw(img)
    for r, (label, ims) in enumerate(rows):
        y = r * (cell + 4) + 2
        d.text((4, y + cell // 2 - 5), label, fill="black")
        for c, im in enumerate(ims):
            img.paste(im.convert("RGB").resize((cell, cell)), (label_w + c * (cell + 4), y))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    img.save(path)


# -----------------------------------------------------------------------------
# Report

# counts and settings: kept in the JSON, left out of the table (counts get their own columns)
META_KEYS = {"n", "n_scored", "n_skipped", "n_train_skipped", "n_per_category", "n_images", "n_captions", "n_train",
             "n_test", "classes", "templates", "layers", "seed", "steps", "weight_decay", "spectral_norms", "curve",
             "codes", "png", "generations", "over", "reason"}


def flatten(results):
    """(benchmark, metric, value, n scored, n skipped, reason) rows for the table: numbers and
    nulls (a null carries its reason), nested dicts dotted (a subset's "acc" named by the
    subset alone); the counts are those of the dict
    the number sits in (blank where the number is not a score over items)."""
    rows = []

    def walk(bench, prefix, v):
        for k, x in v.items():
            if k in META_KEYS:
                continue
            if isinstance(x, dict):
                walk(bench, f"{prefix}{k}.", x)
            elif x is None or (isinstance(x, (int, float)) and not isinstance(x, bool)):
                name = prefix[:-1] if k == "acc" and prefix else f"{prefix}{k}"  # add_obj, not add_obj.acc
                rows.append((bench, name, x, v.get("n_scored", ""), v.get("n_skipped", ""), v.get("reason", "")))
    for bench, r in results.items():
        walk(bench, "", r)
    return rows


def markdown_table(results, skipped, errors):
    lines = ["| benchmark | metric | value | scored | skipped |", "|---|---|---|---|---|"]
    for bench, metric, v, n_ok, n_bad, why in flatten(results):
        value = f"null ({why})" if v is None and why else "null" if v is None else f"{v:.2f}" if isinstance(v, float) else v
        lines.append(f"| {bench} | {metric} | {value} | {n_ok} | {n_bad} |")
    for label, whys in (("not run", skipped), ("ERROR", errors)):
        lines += [f"| {bench} | {label} | {why} | | |" for bench, why in whys.items()]
    return "\n".join(lines)


def run_benchmarks(args, emb, model, tok, config):
    """(results, skipped, errors). A benchmark whose files were not given is skipped; one that
    fails, or scored no item at all, is an error: its line is printed now, the others still
    run, and the exit status says so at the end."""
    scorers = {"shapes": bench_shapes, "sugarcrepe": bench_sugarcrepe, "crepe": bench_crepe, "cola": bench_cola,
               "winoground": bench_winoground, "zeroshot": bench_zeroshot, "retrieval": bench_retrieval,
               "linear_probe": bench_linear_probe}
    analyses = {"easy_to_learn": bench_easy_to_learn, "spectral": bench_spectral, "codebook": bench_codebook}
    results, skipped, failed = {}, {}, {}
    for name in args.benchmark_list:
        try:
            results[name] = scorers[name](args, emb) if name in scorers else analyses[name](args, model, tok, config)
            if n_scored(results[name]) == 0:
                raise data.DataError("scored nothing: no item could be read (see the warnings above)")
        except Skip as e:
            skipped[name] = str(e)
            print(f"skipped {name}: {e}", file=sys.stderr)
        except data.DataError as e:
            failed[name] = str(e)
            print(f"error: {name}: {e}", file=sys.stderr)
    return results, skipped, failed


def run(args):
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    path = args.ckpt or args.init
    model, tok, config = load_checkpoint(path, args)
    quick_gelu = bool(model_field(model, config, "quick_gelu"))
    source = config.get("quick_gelu_source", "config")     # "assumed": il_clip.load_model said so
    print(f"model: {path}: activation {'QuickGELU' if quick_gelu else 'GELU'} ({source})", file=sys.stderr)
    if args.plot_dir is None:
        args.plot_dir = os.path.dirname(os.path.abspath(args.out)) if args.out else (
            out_dir_of(args.ckpt) if args.ckpt else os.path.dirname(os.path.abspath(args.init)))
    emb = Embedder(model, tok, image_size_of(model, config), args.batch_size, args.device, not args.no_progress)
    results, skipped, failed = run_benchmarks(args, emb, model, tok, config)
    print(markdown_table(results, skipped, failed))
    blob = {"checkpoint": os.path.abspath(path), "quick_gelu": quick_gelu, "quick_gelu_source": source,
            "results": results, "skipped": skipped,
            "errors": failed, "args": {k: v for k, v in vars(args).items() if k != "benchmark_list"}}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        tmp = f"{args.out}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(blob, f, indent=1)
        os.replace(tmp, args.out)
    return blob


def main(argv=None):
    try:
        blob = run(get_args(argv))
    except (ConfigError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 2 if blob["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
