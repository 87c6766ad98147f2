"""
Evaluate an il_clip.py / mm_learngene.py checkpoint (or a fork's: the model is built by the script
its config.json records, --script overrides) on compositional and recognition benchmarks, and run
the analysis probes of the IL-CLIP paper (section 4.4).

    python eval_compositional.py --ckpt out/il                       # built-in shapes benchmark
    python eval_compositional.py --ckpt out/il --benchmarks all \
        --sugarcrepe sugarcrepe/ --sugarcrepe_images coco/val2017 --out results.json
    python eval_compositional.py --init ViT-B-32.safetensors --vocab bpe_simple_vocab_16e6.txt.gz
    # seeds: mean ± 95% interval per method, paired differences against the baseline
    python -c "import eval_compositional as ev; ev.summarize_runs('out/study/confirm', baseline='il')"

Benchmarks (--benchmarks a,b,...; default `shapes`; `all` = every one below):
  shapes        the built-in benchmark of data.py: 7 SugarCrepe categories (pair accuracy) +
                systematicity / productivity (R@1 among positive + hard negatives). No files.
  sugarcrepe    --sugarcrepe DIR ({subset}.json x 7) --sugarcrepe_images DIR (COCO val2017); per
                subset, Table 1's add / replace / swap means, and sugarcrepe_mean (the mean of
                the 7)
  crepe         --crepe DIR (the released CSVs, searched recursively) --crepe_images DIR (Visual
                Genome: VG_100K/, VG_100K_2/; the CSV's image_path when present); per file, and per
                productivity type (atom, negate, swap) the mean over complexities 4-12
  cola          --cola FILE (JSON list of [img1, cap1, img2, cap2]) --cola_images DIR
  winoground    --winoground DIR (examples.jsonl + images/ or images.zip, at DIR or DIR/data)
  zeroshot      --zeroshot DIR|shapes (ImageFolder; WordNet-ID folders get ImageNet's names)
                [--classnames F] [--templates NAME|F]: top-1, top-5 (null under 5 classes), mean
                per-class recall (CLIP_benchmark's). --zeroshot NAME=PATH (repeatable): one of the
                IL paper's 18 Table 2 datasets read in its released layout, with its own class names
                and templates (see zeroshot_sets); --zeroshot_suite il_clip prints Table 2's row
  retrieval     --retrieval FILE|shapes (Karpathy JSON; shapes: il_clip.py's end-of-run gallery, the
                first 1000 val pairs) --retrieval_images DIR [--retrieval_split]: i2t_r1 i2t_r5
                i2t_r10 t2i_r1 t2i_r5 t2i_r10
  linear_probe  --linear_probe DIR|shapes (ImageFolder with train/ and test/); L-BFGS to
                convergence, L2 strength swept on held-out train (CLIP's protocol;
                --no-linear_probe_l2_sweep: none)
  easy_to_learn frozen vision agent + codebook, a fresh language agent (fixed seed, fixed
                --probe_logit_scale) trained on --probe_data; accuracy curve and its `auc` over the
                first --probe_auc_steps for --ckpt and every --compare_ckpts (--probe_generations:
                each gen{g}/ snapshot too) on one plot (Fig. 5)
  spectral      product of per-layer spectral norms (exact SVD; Fig. 4's quantity, NOT a Lipschitz
                bound: see spectral_product), per gen{g}/ snapshot, for --ckpt and every
                --compare_ckpts on one plot
  codebook      top-k --viz_data images per code as a PNG grid (Fig. 6)
Every score is in percent (2 decimals in the JSON, 1 in the table); the analyses' other numbers say
their unit in their name (log10_*, active_codes, n_*). Output: a markdown table on stdout (the start
and done lines, bars and warnings on stderr), JSON to --out, PNGs (matplotlib) to --plot_dir. What
each number covers sits beside it: n_scored and n_skipped (malformed rows, images not found or
unreadable), and a mean is null, with the reason, unless every subset it averages was scored in
full. A benchmark whose flags are not given is skipped; one whose paths do not exist, that fails in
any way or that scored nothing is an ERROR row with its reason and exit status 2 at the end (the
other benchmarks still run). Scoring conventions (stated once): a hard-negative comparison is
correct only if the positive scores strictly higher, so a tie counts as wrong; R@k ranks ties
pessimistically (a negative that ties the best positive is ranked above it).
"""
import argparse
import ast
import codecs
import copy
import csv
import glob
import io
import json
import math
import os
import pickle
import random
import re
import struct
import sys
import tarfile
import textwrap
import time
import zipfile
import zlib
from collections import namedtuple
from dataclasses import dataclass, field
from xml.etree import ElementTree

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from tqdm import tqdm

import data
import lifecycle

BENCHMARKS = ["shapes", "sugarcrepe", "crepe", "cola", "winoground", "zeroshot", "retrieval",
              "linear_probe", "easy_to_learn", "spectral", "codebook"]
SUGARCREPE_SUBSETS = ["add_obj", "add_att", "replace_obj", "replace_att", "replace_rel", "swap_obj",
                      "swap_att"]
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif")


def _split(text):
    """A block below: '|'-separated names (whitespace normalised), or whitespace-separated
    tokens."""
    return [" ".join(x.split()) for x in text.split("|")] if "|" in text else text.split()


# OpenAI CLIP's 80 ImageNet prompt templates (CLIP repo,
# notebooks/Prompt_Engineering_for_ImageNet.ipynb)
OPENAI_IMAGENET_TEMPLATES = _split("""
a bad photo of a {}. | a photo of many {}. | a sculpture of a {}. | a photo of the hard to see {}. |
a low resolution photo of the {}. | a rendering of a {}. | graffiti of a {}. | a bad photo of the
{}. | a cropped photo of the {}. | a tattoo of a {}. | the embroidered {}. | a photo of a hard to
see {}. | a bright photo of a {}. | a photo of a clean {}. | a photo of a dirty {}. | a dark photo
of the {}. | a drawing of a {}. | a photo of my {}. | the plastic {}. | a photo of the cool {}. | a
close-up photo of a {}. | a black and white photo of the {}. | a painting of the {}. | a painting of
a {}. | a pixelated photo of the {}. | a sculpture of the {}. | a bright photo of the {}. | a
cropped photo of a {}. | a plastic {}. | a photo of the dirty {}. | a jpeg corrupted photo of a {}.
| a blurry photo of the {}. | a photo of the {}. | a good photo of the {}. | a rendering of the {}.
| a {} in a video game. | a photo of one {}. | a doodle of a {}. | a close-up photo of the {}. | a
photo of a {}. | the origami {}. | the {} in a video game. | a sketch of a {}. | a doodle of the {}.
| a origami {}. | a low resolution photo of a {}. | the toy {}. | a rendition of the {}. | a photo
of the clean {}. | a photo of a large {}. | a rendition of a {}. | a photo of a nice {}. | a photo
of a weird {}. | a blurry photo of a {}. | a cartoon {}. | art of a {}. | a sketch of the {}. | a
embroidered {}. | a pixelated photo of a {}. | itap of the {}. | a jpeg corrupted photo of the {}. |
a good photo of a {}. | a plushie {}. | a photo of the nice {}. | a photo of the small {}. | a photo
of the weird {}. | the cartoon {}. | art of the {}. | a drawing of the {}. | a photo of the large
{}. | a black and white photo of a {}. | the plushie {}. | a dark photo of a {}. | itap of a {}. |
graffiti of the {}. | a toy {}. | itap of my {}. | a photo of a cool {}. | a photo of a small {}. |
a tattoo of the {}.
""")
# --templates NAME: a named set; --templates FILE: your own (one per line, with `{}`)
TEMPLATES = {
    "clip8": ["a photo of a {}.", "a picture of a {}.", "a rendering of a {}.",
              "a drawing of a {}.", "a photo of the {}.", "a close-up photo of a {}.",
              "a photo of a small {}.", "a photo of a large {}."],  # 8 of the 80, the default
    "openai_imagenet": OPENAI_IMAGENET_TEMPLATES}


class ConfigError(Exception):
    """A user mistake in flags or checkpoints: printed as `error: ...`, exit 2."""


class Skip(Exception):
    """A benchmark that cannot run here (its files were not given or not found)."""


def warn(msg):
    tqdm.write(f"warning: {msg}", file=sys.stderr)


# bytes one TFRecord record, MAT file / inflated element or zip member may hold in memory
MAX_BLOB = 1 << 28


def names_file(read):
    """A reader on a hostile or damaged file fails in one line naming that file (MemoryError,
    RecursionError, TypeError ... included), never with a traceback."""
    def reader(path, *a):
        try:
            return read(path, *a)
        except (data.DataError, Skip):
            raise
        except Exception as e:  # noqa: BLE001
            raise data.DataError(f"{path}: unreadable ({type(e).__name__}: "
                                 f"{first_line(e)})") from None
    return reader


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help: each flag's "(default: X)" where X says something. Not for None, False or "" (the
    help text says what they mean), nor where the help already names its default."""
    def _get_help_string(self, action):
        text, d = action.help or "", action.default
        if (d in (None, "", argparse.SUPPRESS) or d is False or "default" in text
            or not action.option_strings):
            return text
        return f"{text} (default: {d})".strip()


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    g = p.add_argument_group("model: the checkpoint or weights to score")
    g.add_argument("--ckpt", help="an il_clip.py / mm_learngene.py out_dir")
    g.add_argument("--init", help="OpenAI-format weights (.safetensors / .pt) instead of --ckpt")
    g.add_argument("--vocab", help="bpe_simple_vocab_16e6.txt.gz, the tokenizer for --init weights")
    g.add_argument("--script", help="the model code for --ckpt and its snapshots (default: the "
                   "script its config.json records, run only from beside this file; il_clip.py for "
                   "--init weights); any other file runs only when named here; --compare_ckpts use "
                   "the scripts they record")
    g.add_argument("--quick_gelu", action=argparse.BooleanOptionalAction, default=None,
                   help="the MLP activation of the loaded weights: QuickGELU (OpenAI's CLIP, "
                   "open_clip's *-quickgelu) or exact GELU (--no-quick_gelu: open_clip's LAION / "
                   "DataComp ViT-B-32). Not given: what the checkpoint's config.json says; for "
                   "--init weights the open_clip_config.json / config.json beside them, else "
                   "QuickGELU (assumed, said so). Printed.")
    g = p.add_argument_group("benchmarks and the built-in shapes data")
    g.add_argument("--benchmarks", default="shapes", help=f"comma list of {','.join(BENCHMARKS)} "
                   "or all")
    g.add_argument("--eval_size", type=int, default=1000, help="shapes benchmark items per "
                   "category (retrieval shapes: always il_clip.py's "
                   f"{data.SHAPES_VAL_PAIRS} val pairs)")
    g.add_argument("--shapes_seed", type=int, default=0,
                   help="seed of the shapes benchmark and galleries")
    g = p.add_argument_group("data: the released compositional benchmarks (files; a benchmark "
                             "without them is skipped)")
    for name, what in (("sugarcrepe", "folder of {subset}.json"),
                       ("crepe", "folder of the released CSVs"),
                       ("cola", "JSON list of [img1, cap1, img2, cap2]")):
        g.add_argument(f"--{name}", help=what)
        g.add_argument(f"--{name}_images", help=f"image root of --{name}")
    g.add_argument("--winoground", help="folder with examples.jsonl + images/ or images.zip")
    g = p.add_argument_group("data: zero-shot, retrieval, linear probe")
    g.add_argument("--zeroshot", action="append", help="ImageFolder DIR, or `shapes`; or "
                   "NAME=PATH, repeatable: one of the IL paper's 18 Table 2 datasets in its "
                   f"released layout (names: {' '.join(zeroshot_sets())})")
    g.add_argument("--zeroshot_suite", choices=["il_clip"], help="print the IL paper's Table 2 row "
                   "(top-1 per dataset, n_scored, the mean over those scored) for the --zeroshot "
                   "NAME=PATH given")
    g.add_argument("--classnames", help="class names, one per line in sorted-folder order (not "
                   "given: folder names)")
    g.add_argument("--templates", default="clip8", help="zero-shot prompt templates: "
                   f"{' | '.join(TEMPLATES)} (OpenAI's 80 ImageNet templates) or a FILE, one per "
                   "line with {} (default: clip8, 8 of the 80)")
    g.add_argument("--retrieval", help="Karpathy JSON FILE, or `shapes` (il_clip.py's end-of-run "
                   f"gallery: {data.SHAPES_VAL_PAIRS} val pairs)")
    g.add_argument("--retrieval_images", help="image root of the Karpathy JSON")
    g.add_argument("--retrieval_split", default="test", help="the Karpathy JSON's split scored")
    g.add_argument("--linear_probe", help="ImageFolder DIR with train/ and test/, or `shapes`")
    g.add_argument("--linear_probe_l2_sweep", action=argparse.BooleanOptionalAction, default=True,
                   help="linear probe: pick the L2 strength on held-out train (the CLIP paper's "
                   "protocol; --no-linear_probe_l2_sweep: no weight decay)")
    g.add_argument("--linear_probe_val_frac", type=float, default=0.2,
                   help="--linear_probe_l2_sweep: train fraction held out to pick the L2 strength")
    g = p.add_argument_group("method: the analysis probes (easy_to_learn, spectral, codebook)")
    g.add_argument("--compare_ckpts", default="", help="easy_to_learn, spectral: more checkpoints "
                   "drawn in the same plot (comma list; Figs. 4, 5)")
    g.add_argument("--probe_data", help="easy_to_learn: any --data spec (not given: the "
                   "checkpoint's training data)")
    g.add_argument("--viz_data", help="codebook: any --data spec (not given: the "
                   "checkpoint's training data)")
    for key, what in (("image_root", "image root"), ("csv_img_key", "CSV image column"),
                      ("csv_caption_key", "CSV caption column"),
                      ("csv_separator", "CSV separator")):
        g.add_argument(f"--{key}", help=f"--probe_data / --viz_data {what} (not given: "
                       "the checkpoint's)")
    g.add_argument("--probe_steps", type=int, default=200, help="easy_to_learn: training steps of "
                   "the fresh agent")
    g.add_argument("--probe_batch", type=int, default=64, help="easy_to_learn: its batch size")
    g.add_argument("--probe_lr", type=float, default=5e-4,
                   help="easy_to_learn: its AdamW learning rate")
    g.add_argument("--probe_eval_every", type=int, default=20, help="easy_to_learn: steps between "
                   "accuracy points")
    g.add_argument("--probe_eval_size", type=int, default=256, help="easy_to_learn: held-out "
                   "pairs of the curve")
    g.add_argument("--probe_seed", type=int, default=1234, help="easy_to_learn: seed of the fresh "
                   "language agent (the same for every checkpoint)")
    g.add_argument("--probe_logit_scale", type=float, default=1 / 0.07,
                   help="easy_to_learn: the student's fixed logit scale, the same for every "
                   "checkpoint (default 1/0.07, CLIP's initial scale; not the "
                   "checkpoint's learnt one)")
    g.add_argument("--probe_generations", action="store_true", help="easy_to_learn: also probe "
                   "every gen{g}/ snapshot of each checkpoint, one curve each (Fig. 5)")
    g.add_argument("--probe_auc_steps", type=int, default=60, help="easy_to_learn: `auc` = mean "
                   "accuracy over the evaluation points after 1..N probe steps (learning speed, "
                   "Fig. 5's initial slope)")
    g.add_argument("--viz_codes", type=int, default=8, help="codebook: how many codes (the "
                   "most used ones)")
    g.add_argument("--viz_topk", type=int, default=5, help="codebook: images shown per code")
    g.add_argument("--viz_images", type=int, default=500, help="codebook: --viz_data "
                   "images searched")
    g = p.add_argument_group("machine")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device")
    g.add_argument("--batch_size", type=int, default=64, help="images / captions per forward pass")
    g.add_argument("--num_workers", type=int, default=0, help="DataLoader workers of the analyses' "
                   "--probe_data / --viz_data loaders (the benchmarks read their files "
                   "in this process)")
    g.add_argument("--seed", type=int, default=0, help="torch / python seed; the linear "
                   "probe's held-out split")
    g = p.add_argument_group("output")
    g.add_argument("--out", help="write the results as JSON here (not given: the table only)")
    g.add_argument("--plot_dir", help="where PNGs go (not given: the --out folder, else the "
                   "checkpoint dir)")
    g.add_argument("--no_progress", action="store_true", help="no tqdm bars")
    args = p.parse_args(argv)
    names = (BENCHMARKS if args.benchmarks == "all"
             else [b.strip() for b in args.benchmarks.split(",") if b.strip()])
    unknown = [b for b in names if b not in BENCHMARKS]
    if unknown:
        raise ConfigError(f"unknown benchmark(s) {', '.join(unknown)}; choose from "
                          f"{', '.join(BENCHMARKS)} or all")
    args.benchmark_list = names
    split_zeroshot_flags(args)
    if bool(args.ckpt) == bool(args.init):
        raise ConfigError("give exactly one of --ckpt OUT_DIR or --init WEIGHTS")
    if not 0 < args.probe_logit_scale < math.inf:
        raise ConfigError(f"--probe_logit_scale {args.probe_logit_scale}: expected a "
                          "positive number")
    if args.probe_auc_steps < min(args.probe_eval_every, args.probe_steps):
        raise ConfigError(f"--probe_auc_steps {args.probe_auc_steps}: no evaluation point in steps "
                          f"1..N (--probe_eval_every {args.probe_eval_every}, --probe_steps "
                          f"{args.probe_steps})")
    return args


# -----------------------------------------------------------------------------
# Model and tokenizer: built by the script that trained the checkpoint (config.json "script"),
# so a fork (sparsemax -> softmax, a SigLIP logit_bias ...) is scored with its own code

# scripts whose checkpoints these benchmarks cannot score, and what reads them instead
OTHER_READERS = {"composer.py": "python composer.py eval --ckpt {path}",
                 "mm_learngene.py": "python mm_learngene.py report --results {path} (a "
                                    "fine-tune's own metrics)"}


def refuse(path, maker, why):
    how = OTHER_READERS.get(maker, "the script's own evaluation").format(path=out_dir_of(path))
    return ConfigError(f"{path}: {why}: a checkpoint of {maker}, which "
                       f"{os.path.basename(__file__)} cannot score; use {how}")


def load_checkpoint(path, args, script=None):
    """(model, tokenizer, config) from an out_dir, a checkpoint/ folder or a weights file, built by
    load_model(path, device, quick_gelu) of the script config.json records, under
    lifecycle.find_script's trust rule (only by its bare name beside this file; `script`, --script,
    names any other; bare weights: il_clip.py beside this file). Its files are checked against
    sha256.json first, when there is one. config["script_used"] says which file ran. Refuses, with
    one line, checkpoints it cannot score and tokenizers that do not fit."""
    if not os.path.exists(path):
        raise ConfigError(f"{path}: checkpoint not found")
    path = lifecycle.checkpoint_dir(path)
    lifecycle.check_read_files(os.path.join(path, "model.safetensors") if os.path.isdir(path)
                               else path)
    cfg = (read_json(os.path.join(path, "config.json"))
           if os.path.isfile(os.path.join(path, "config.json")) else {})
    cfg = cfg if isinstance(cfg, dict) else {}
    record = cfg.get("script")
    named = record.get("name") if isinstance(record, dict) else None
    maker = named if isinstance(named, str) else (
        "mm_learngene.py" if {"phase", "task", "modality"} & set(cfg) else "composer.py")
    model_cfg = cfg.get("model")
    if cfg.get("modality", "clip") != "clip":
        raise refuse(path, maker, f"a {cfg['modality']}-only descendant (these benchmarks need "
                     "both towers: expand one with --modality clip)")
    if (cfg and not record and not (isinstance(model_cfg, dict)
                                    and {"vision_width", "text_width"} <= set(model_cfg))):
        raise refuse(path, maker, "config.json holds no CLIP model config")
    try:
        module, script_path, note = lifecycle.import_script(record, __file__, script,
                                                            default="il_clip.py")
    except data.DataError as e:
        raise ConfigError(f"{path}: {e}") from None
    if not callable(getattr(module, "load_model", None)):
        raise refuse(path, maker, f"{script_path} has no load_model(path, device, quick_gelu)")
    try:
        model, tok, config = module.load_model(path, device=args.device, quick_gelu=args.quick_gelu)
    # the script's own error line, else what went wrong, in one line
    except Exception as e:  # noqa: BLE001
        own = isinstance(e, (data.DataError, getattr(module, "ConfigError", data.DataError)))
        raise ConfigError(str(e) if own else f"{path}: {script_path} cannot load it "
                          f"({first_line(e)})") from None
    config["script_used"] = {"path": script_path,
                             "sha256": lifecycle.script_record(script_path)["sha256"],
                             "changed": (bool(note) if isinstance(record, dict)
                                         and record.get("sha256") else None)}
    if tok is None:
        if not args.vocab:
            raise ConfigError(f"{path}: weights without a tokenizer; give --vocab "
                              "bpe_simple_vocab_16e6.txt.gz")
        tok = data.build_tokenizer(vocab_path=args.vocab,
                                   context_length=model_field(model, config, "context_length", 77))
    check_tokenizer(tok, model, config, path)
    quick = bool(model_field(model, config, "quick_gelu"))
    print(f"model: {path}: code {script_path}, activation {'QuickGELU' if quick else 'GELU'} "
          f"({config.get('quick_gelu_source', 'config')})", file=sys.stderr)
    return model.to(args.device).eval(), tok, config


def script_of(model):
    """The module whose code built `model` (the checkpoint's own script, as imported above)."""
    return sys.modules[type(model).__module__]


def first_line(e):
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def model_field(model, config, name, default=None):
    """A model-config value: model.cfg / model.config (dataclass or dict), else config.json."""
    for holder in (getattr(model, "cfg", None), getattr(model, "config", None), config,
                   (config or {}).get("model")):
        if holder is None:
            continue
        value = holder.get(name) if isinstance(holder, dict) else getattr(holder, name, None)
        if value is not None:
            return value
    return default


def check_tokenizer(tok, model, config, path):
    problems = [f"tokenizer {what} {have}, the model's {want}" for what, have, key in (
        ("vocabulary", tok.vocab_size, "vocab_size"), ("EOT id", tok.eot_id, "eot_token_id"),
        ("context", tok.context_length, "context_length"))
        if (want := model_field(model, config, key)) not in (None, have)]
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
                info = z.getinfo(self.member)
                if info.file_size > MAX_BLOB or info.compress_size > os.path.getsize(self.path):
                    raise ValueError(f"{self.member} declares {info.file_size} bytes: over the "
                                     "cap or the file")
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
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.device = device
        self.transform = data.eval_transform(image_size)
        self.image_size = image_size
        self.progress = progress
        self.image_cache, self.text_cache, self.bad_images = {}, {}, {}

    def _bar(self, n, desc):
        return lifecycle.progress(total=n, desc=desc, unit="item",
                                  disable=not self.progress or n == 0, leave=False)

    @torch.no_grad()
    def images(self, refs):
        """{key: embedding} for every ref whose image could be read (the others are warned
        about once and left out, so a benchmark can drop the rows that use them)."""
        todo = list({r.key: r for r in refs if r.key not in self.image_cache
                     and r.key not in self.bad_images}.values())
        bar = self._bar(len(todo), "images")
        for i in range(0, len(todo), self.batch_size):
            chunk, tensors = [], []
            for r in todo[i:i + self.batch_size]:
                try:
                    tensors.append(self.transform(r.open()))
                    chunk.append(r)
                # any undecodable image is skipped, with its reason
                except Exception as e:  # noqa: BLE001
                    self.bad_images[r.key] = (f"{r.path or r.key}: {type(e).__name__}: "
                                              f"{first_line(e)}")
                    warn(f"{self.bad_images[r.key]}; rows that use it are skipped")
            if chunk:
                z = self.model.encode_image(data.normalize_images(torch.stack(tensors),
                                                                  self.device)).float().cpu()
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
    """A fraction as percent, rounded to 2 decimals: the unit of every score this script reports."""
    return round(100.0 * float(x), 2)


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
        # equal captions tie exactly
        s = (text[[index[c] for c in [r[1], *r[2]]]] * images[r[0].key]).sum(-1)
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
    # [N, 2, E]
    img = torch.stack([torch.stack([images[r[0].key], images[r[2].key]]) for r in rows])
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
        why = ([f"not scored: {', '.join(missing)}"] * bool(missing)
               + [f"incomplete: {', '.join(partial)}"] * bool(partial))
        return {metric: None, "reason": "; ".join(why)}
    return {metric: round(sum(parts[n][metric] for n in names) / len(names), 2), "over": len(names)}


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


def retrieval_scores(emb, items, same_caption=False):
    """items: [(ImageRef, [captions])]. Image -> text and text -> image R@1/5/10 (i2t_r1 ...
    t2i_r10) and mean_recall, their mean. A caption is a positive of its own image; with
    `same_caption`, of every image with a caption of the same text (il_clip.py's shapes retrieval:
    generated scenes repeat captions)."""
    images = emb.images([it[0] for it in items])
    kept = usable(items, images, lambda it: [it[0]])
    if len(kept) < len(items):   # R@K over a smaller gallery is easier: not the benchmark's number
        raise data.DataError(f"{len(items) - len(kept)} of {len(items)} images could not be read "
                             "(see the warnings above): R@K over a smaller gallery is not "
                             "comparable, so none is given")
    img = torch.stack([images[it[0].key] for it in kept])
    captions = [c for it in kept for c in it[1]]
    owner = torch.tensor([i for i, it in enumerate(kept) for _ in it[1]])
    txt = emb.texts(captions)
    positive = owner[None, :] == torch.arange(len(kept))[:, None]  # [images, captions]
    if same_caption:    # image i, caption j: some caption of i has j's text
        text_id = {c: k for k, c in enumerate(dict.fromkeys(captions))}
        ids = torch.tensor([text_id[c] for c in captions])
        positive = (positive.float() @ (ids[:, None] == ids[None, :]).float()) > 0
    i2t = recall_at_k(img @ txt.T, positive)
    t2i = recall_at_k(txt @ img.T, positive.T)
    out = {f"i2t_r{k}": v for k, v in i2t.items()} | {f"t2i_r{k}": v for k, v in t2i.items()}
    out["mean_recall"] = round(sum(i2t.values()) / 3 / 2 + sum(t2i.values()) / 3 / 2, 2)
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
        hit = ((logits.topk(k, dim=1).indices == labels[:, None]).any(1) if k <= logits.shape[1]
               else None)
        out[f"top{k}"] = None if hit is None else pct(hit.float().mean())
    pred = logits.argmax(1)
    recalls = [(pred[labels == c] == c).float().mean() for c in labels.unique()]
    out["mean_per_class_recall"] = pct(sum(recalls) / len(recalls))
    return out


def fit_logistic(x, y, n_classes, weight_decay, max_iter=1000, tol=1e-6):
    """Multinomial logistic regression, mean cross-entropy + weight_decay * |W|^2 (bias not
    penalised), by full-batch L-BFGS in float64 until the largest gradient entry is below `tol`
    (at most max_iter iterations). -> (W, b, {"iterations", "grad_max", "converged"})."""
    x = x.double()
    w = torch.zeros(x.shape[1], n_classes, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(n_classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=max_iter, max_eval=2 * max_iter,
                            tolerance_grad=tol, tolerance_change=1e-12, history_size=20,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(x @ w + b, y) + weight_decay * (w * w).sum()
        loss.backward()
        return loss
    opt.step(closure)
    closure()
    grad_max = float(max(w.grad.abs().max(), b.grad.abs().max()))
    fit = {"iterations": opt.state[w]["n_iter"], "grad_max": grad_max, "converged": grad_max <= tol}
    return w.detach().float(), b.detach().float(), fit


# L2 strengths swept on held-out train (the CLIP paper's protocol sweeps lambda; without any, a
# separable problem has no finite optimum and L-BFGS stops wherever max_iter leaves it)
L2_SWEEP = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)


def linear_probe(train_x, train_y, test_x, test_y, n_classes, sweep=True, val_frac=0.2, seed=0):
    """Logistic regression on frozen image features. `sweep` (default, the CLIP paper's
    protocol): pick the L2 strength from L2_SWEEP on a seeded held-out part of train, then refit
    on all of train; else no weight decay. Reports whether the final fit converged."""
    out = {"weight_decay": 0.0}
    if sweep:
        perm = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(seed))
        n_val = max(1, int(len(train_x) * val_frac))
        val, fit = perm[:n_val], perm[n_val:]
        val_acc = {}
        for wd in L2_SWEEP:
            w, b, _ = fit_logistic(train_x[fit], train_y[fit], n_classes, wd)
            val_acc[wd] = float(((train_x[val] @ w + b).argmax(1) == train_y[val]).float().mean())
        best = max(L2_SWEEP, key=lambda wd: (val_acc[wd], wd))  # ties: the stronger regulariser
        out = {"weight_decay": best, "val_top1": pct(val_acc[best])}
    w, b, fit = fit_logistic(train_x, train_y, n_classes, out["weight_decay"])
    if not fit["converged"]:
        warn(f"linear probe: L-BFGS stopped after {fit['iterations']} iterations with gradient "
             f"{fit['grad_max']:.2e} (not converged; an unregularised separable fit "
             "has no optimum)")
    acc = ((test_x @ w + b).argmax(1) == test_y).float().mean()
    return {"top1": pct(acc)} | out | fit | {"n_train": len(train_x), "n_test": len(test_x)}


# -----------------------------------------------------------------------------
# Readers for the released formats. A malformed row is reported (file:line) and skipped.

@names_file
def json_rows(path):
    """[(line, key, value)] of a top-level JSON list (key = index) or object, so a
    malformed row can be reported with its line."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        doc = json.loads(text)   # a syntax error: json's own line number
    except json.JSONDecodeError as e:
        raise data.DataError(f"{path}: line {e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(doc, (list, dict)):
        raise data.DataError(f"{path}: expected a JSON list or object")
    # the text is valid JSON: walk its top-level values for their lines
    dec = json.JSONDecoder()
    ws = re.compile(r"[ \t\r\n]*")
    rows = []
    line = 1
    seen = 0
    i = ws.match(text, ws.match(text).end() + 1).end()
    while text[i] not in "]}":
        key = len(rows)
        if isinstance(doc, dict):
            key, i = dec.raw_decode(text, i)
            i = ws.match(text, ws.match(text, i).end() + 1).end()      # past ':'
        value, i_end = dec.raw_decode(text, i)
        line, seen = line + text.count("\n", seen, i), i
        rows.append((line, key, value))
        i = ws.match(text, i_end).end()
        i = ws.match(text, i + 1).end() if text[i] == "," else i
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
        early = (os.path.join(root, f"{subset[:-len('_obj')]}_ent.json") if subset.endswith("_obj")
                 else path)
        # *_ent.json: early releases
        path = early if not os.path.exists(path) and os.path.exists(early) else path
        if not os.path.exists(path):
            warn(f"{path} not found; SugarCrepe subset {subset} not scored")
            continue
        part = out[subset] = Part([])
        for line, key, v in json_rows(path):
            fields = ("filename", "caption", "negative_caption")
            if not isinstance(v, dict) or not all(isinstance(v.get(k), str) for k in fields):
                bad_row(path, line, f"entry {key!r} needs string fields filename, caption, "
                        "negative_caption")
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


# productivity hard-negative types, as CREPE's files spell them
CREPE_TYPES = ("atom", "negate", "swap")
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
        return {f"productivity/{m[1]}/complexity_{m[2]}" if m
                else f"productivity/{stem}": "hard_negs"}
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


@names_file
def read_crepe_file(path, image_root, out):
    """Add one CREPE CSV's rows to out {subset: Part}."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        fields = reader.fieldnames or []
        missing = [c for c in ("image_id", "x", "y", "width", "height", "caption")
                   if c not in fields]
        subsets = crepe_subsets(path, fields)
        if missing or not subsets:
            warn(f"{path}: not a CREPE hard-negative CSV (needs image_id,x,y,width,height,caption "
                 "and hard_negs or valid_hard_negs_*); file skipped")
            return
        parts = {name: out.setdefault(name, Part([])) for name in subsets}
        for row in reader:
            line = reader.line_num
            try:
                box = tuple(int(round(float(row[c]))) for c in ("x", "y", "width", "height"))
                negs = {name: parse_list(row[col]) for name, col in subsets.items()}
                img = find_vg_image(image_root, row)
                why = (None if img else f"image {row['image_id']} not found under {image_root} "
                       "(VG_100K/, VG_100K_2/)")
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
    """Cola's JSON list of [image1, caption1, image2, caption2]; the images are Visual Genome URLs
    (.../VG_100K/{id}.jpg or .../VG_100K_2/{id}.jpg), looked up in image_root itself and in its
    VG_100K/ and VG_100K_2/ folders, as the CREPE reader does."""
    part = Part([])
    folders = [image_root] + [os.path.join(image_root, sub) for sub in ("VG_100K", "VG_100K_2")]

    def find(name):
        path = next((p for d in folders if (p := find_image(d, name, ("",)))), None)
        return path and file_ref(path)
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
        return lambda name: (lambda p: p and file_ref(p))(find_image(image_dir, name,
                                                                      ("",) + IMAGE_EXTS))
    if not os.path.isfile(zip_path):
        return lambda name: None
    try:
        with zipfile.ZipFile(zip_path) as z:
            members = {os.path.splitext(os.path.basename(m))[0]: m for m in z.namelist()
                       if not m.endswith("/")}
    except (zipfile.BadZipFile, OSError) as e:
        raise data.DataError(f"{zip_path}: cannot read ({e})") from None
    zip_path = os.path.abspath(zip_path)
    return lambda name: (lambda m: m and ImageRef(f"{zip_path}::{m}", path=zip_path, member=m))(
        members.get(os.path.splitext(name)[0]))


@names_file
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
                bad_row(path, line, "needs image_0, image_1, caption_0, caption_1 "
                        f"({type(e).__name__})")
                part.skipped += 1
                continue
            pair_of_pairs_row(path, line, find, names, caps, part)
    return part


def read_image_folder(root):
    """data.image_folder (root/<class>/<image>, classes sorted) as ImageRefs."""
    paths, labels, classes = data.image_folder(root)
    return classes, [(file_ref(p), y) for p, y in zip(paths, labels)]


@names_file
def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [s.strip() for s in f if s.strip()]


# -----------------------------------------------------------------------------
# Benchmarks: each returns {metric: value} (and may raise Skip)

def bench_shapes(args, emb):
    """The built-in benchmark, by data.score_shapes (il_clip.py's end of run calls it too: the same
    digits for any model code): accuracy per category, sugarcrepe_mean (the mean of the 7), R@1 per
    split. Generated, so every item is scored."""
    out = data.score_shapes(emb.model.encode_image, emb.model.encode_text, emb.tokenizer,
                            emb.image_size, emb.device, n=args.eval_size, n_val=0,
                            seed=args.shapes_seed, show_progress=emb.progress)
    return out | {"n_per_category": args.eval_size}


def bench_sugarcrepe(args, emb):
    """Accuracy per subset, the paper's Table 1 columns (add, replace, swap: means of their
    subsets) and the mean of all 7; a mean is given only over subsets scored in full."""
    require((args.sugarcrepe, "--sugarcrepe"), (args.sugarcrepe_images, "--sugarcrepe_images"))
    parts = read_sugarcrepe(args.sugarcrepe, args.sugarcrepe_images)
    out = {s: pair_accuracy(emb, parts[s]) if s in parts else
           {"acc": None, "n_scored": 0, "n_skipped": 0, "reason": f"{s}.json not found"}
           for s in SUGARCREPE_SUBSETS}
    for group in ("add", "replace", "swap"):
        out[group] = complete_mean(out, [s for s in SUGARCREPE_SUBSETS
                                         if s.startswith(f"{group}_")])
    out["sugarcrepe_mean"] = complete_mean(out, SUGARCREPE_SUBSETS)
    return out


def bench_crepe(args, emb):
    """Image -> text R@1 per CSV subset, and per productivity type (atom, negate, swap; the
    paper's Table 1 calls atom "replace") the mean over complexities 4-12."""
    require((args.crepe, "--crepe"), (args.crepe_images, "--crepe_images"))
    parts = read_crepe(args.crepe, args.crepe_images)
    out = {name: r1_among_negatives(emb, part) for name, part in sorted(parts.items())}
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
    """(features, labels, skipped): the images that could not be read are left out, each with its
    reason in `skipped`."""
    images = emb.images([r for r, _ in items])
    kept = usable(items, images, lambda it: [it[0]])
    if not kept:
        raise data.DataError(f"none of the {len(items)} images could be read")
    return (torch.stack([images[r.key] for r, _ in kept]), torch.tensor([y for _, y in kept]),
            [emb.bad_images[r.key] for r, _ in items if r.key not in images])


def read_templates(spec):
    """--templates: a named set (TEMPLATES) or a file with one template per line."""
    if spec in TEMPLATES:
        return TEMPLATES[spec]
    if not os.path.isfile(spec):
        raise data.DataError(f"{spec}: not a template file nor one of {', '.join(TEMPLATES)}")
    templates = read_lines(spec)
    bad = [t for t in templates if "{}" not in t]
    if bad or not templates:
        raise data.DataError(f"{spec}: " + (f"template without {{}}: {bad[0]!r}" if bad
                                            else "no templates"))
    return templates


def bench_zeroshot(args, emb):
    if args.zeroshot == "shapes":
        classnames, items = shapes_classification_set("test", max(args.eval_size, 100),
                                                      args.shapes_seed)
    else:
        require((args.zeroshot, "--zeroshot"))
        folders, items = read_image_folder(args.zeroshot)
        classnames = read_lines(args.classnames) if args.classnames else folder_classnames(folders)
        if len(classnames) != len(folders):
            raise data.DataError(f"{args.classnames}: {len(classnames)} class names for "
                                 f"{len(folders)} class folders")
    templates = read_templates(args.templates)
    return zeroshot_scores(emb, classnames, items, templates) | {
        "templates": args.templates if args.templates in TEMPLATES else len(templates)}


def zeroshot_scores(emb, classnames, items, templates, unread=()):
    """CLIP_benchmark's metrics of items [(ImageRef, label)]; what was not scored (`unread`: rows
    the reader could not read, then images that could not be decoded) is counted, with its
    reasons."""
    x, y, skipped = classification_features(emb, items)
    skipped = [*unread, *skipped]
    return (classification_scores(x @ zeroshot_weights(emb, classnames, templates).T, y)
            | {"n_scored": len(y), "n_skipped": len(skipped), "skipped_because": skipped[:20],
               "classes": len(classnames)})


def bench_retrieval(args, emb):
    # il_clip.py's end-of-run gallery (evaluate_shapes), so i2t_r1 means one thing
    if args.retrieval == "shapes":
        scenes = [data.shapes_scene("val", i, args.shapes_seed)
                  for i in lifecycle.progress(range(data.SHAPES_VAL_PAIRS),
                                              desc="shapes val scenes", unit="item",
                                              disable=args.no_progress, leave=False)]
        items = [(ImageRef(f"shapes-scene/{args.shapes_seed}/val/{i}", pil=s.image), [s.caption])
                 for i, s in enumerate(scenes)]
        return retrieval_scores(emb, items, same_caption=True)
    require((args.retrieval, "--retrieval"), (args.retrieval_images, "--retrieval_images"))
    items = [(file_ref(path), caps) for path, caps in
             karpathy_items(args.retrieval, args.retrieval_images, args.retrieval_split)]
    return retrieval_scores(emb, items)


def karpathy_items(json_path: str, image_root: str | None = None, split: str = "test",
                   with_trees=False) -> list:
    """Per-image caption lists for retrieval evaluation: [(image_path, [captions])], or
    [(image_path, [captions], [trees])] with `with_trees`. Empty captions are left out."""
    out = []
    for path, _, sents in data.karpathy_images(json_path, image_root, split):
        if isinstance(path, data.Skip):      # an evaluation gallery is scored whole or not at all
            raise data.DataError(f"{json_path}: {path.where}: {path.reason} {image_root}")
        sents = [(c, t) for c, t in sents if isinstance(c, str) and c.strip()]
        caps = [c for c, _ in sents]
        out.append((path, caps, [t for _, t in sents]) if with_trees else (path, caps))
    return out


def bench_linear_probe(args, emb):
    if args.linear_probe == "shapes":
        n = max(4 * args.eval_size, 200)
        classnames, train = shapes_classification_set("train", n, args.shapes_seed)
        _, test = shapes_classification_set("test", n // 2, args.shapes_seed)
    else:
        require((args.linear_probe, "--linear_probe"))
        train_dir, test_dir = (os.path.join(args.linear_probe, s) for s in ("train", "test"))
        require((train_dir, "--linear_probe"), (test_dir, "--linear_probe"))
        classnames, train = read_image_folder(train_dir)
        test_classes, test = read_image_folder(test_dir)
        if test_classes != classnames:
            raise data.DataError(f"{args.linear_probe}: train/ and test/ have "
                                 "different class folders")
    (tx, ty, train_skipped), (vx, vy, test_skipped) = (classification_features(emb, items)
                                                       for items in (train, test))
    out = linear_probe(tx, ty, vx, vy, len(classnames), args.linear_probe_l2_sweep,
                       args.linear_probe_val_frac, args.seed)
    return (out | {"n_scored": len(vy), "n_skipped": len(test_skipped),
                   "n_train_skipped": len(train_skipped)})


# -----------------------------------------------------------------------------
# Zero-shot suite: the IL paper's Table 2 (18 datasets, each read in its released layout)
#
# `--zeroshot NAME=PATH` (repeatable) reads one dataset where its release unpacks; class names and
# prompt templates are built in (the data block at the end of this section; CLIP_benchmark's lists,
# which is how CLIP-style papers score this suite). The test split is the official one unless the
# note beside the dataset says otherwise; `--zeroshot_suite il_clip` prints Table 2's row.

@dataclass(frozen=True)
class LazyRef(ImageRef):
    """An image decoded only when embedded: raw uint8 pixels (`array`, an HxW or HxWx3 view into a
    released binary) or encoded bytes at `span` = (offset, size) inside the file `path`."""
    array: object = field(default=None, compare=False, repr=False)
    span: tuple = None

    def open(self):
        if self.array is not None:
            return Image.fromarray(np.ascontiguousarray(self.array)).convert("RGB")
        if not 0 < self.span[1] <= MAX_BLOB:
            raise ValueError(f"an image of {self.span[1]} bytes at byte {self.span[0]}")
        with open(self.path, "rb") as f:
            f.seek(self.span[0])
            blob = f.read(self.span[1])
        return Image.open(io.BytesIO(blob)).convert("RGB")


def find_root(path, *markers):
    """The folder at or below `path` (up to 3 wrapper folders deep) that holds every marker (a file,
    folder or glob): releases unpack into named folders (cifar-10-batches-py/,
    VOCdevkit/VOC2007/)."""
    todo = [(path, 0)]
    while todo:
        d, depth = todo.pop(0)
        if all(glob.glob(os.path.join(glob.escape(d), m)) for m in markers):
            return d
        if depth < 3 and os.path.isdir(d):
            todo += [(os.path.join(d, s), depth + 1) for s in sorted(os.listdir(d))
                     if os.path.isdir(os.path.join(d, s)) and len(todo) < 64]
    raise data.DataError(f"{path}: not the released layout: no folder here with "
                         f"{', '.join(markers)}")


def array_refs(name, arrays):
    return [LazyRef(f"{name}#{i}", path=name, array=a) for i, a in enumerate(arrays)]


def wnid_tree(path, head_wnids, names):
    """ImageNet val / ImageNet-Sketch / -A / -R: one folder per WordNet ID (ILSVRC2012_img_val
    sorted into folders by the devkit's valprep.sh, as torchvision and CLIP_benchmark read it).
    Every class of the head is scored, so a missing folder removes images, never classes."""
    candidates = [path] + [os.path.join(path, sub)
                           for sub in ("val", "sketch", "imagenet-a", "imagenet-r")]
    root = next((d for d in candidates if os.path.isdir(d)
                 and any(WNID.fullmatch(s) for s in os.listdir(d))), path)
    folders, items = read_image_folder(root)
    index = {w: i for i, w in enumerate(head_wnids)}
    unknown = [f for f in folders if f not in index]
    if unknown:
        raise data.DataError(f"{root}: {len(unknown)} class folders are not among this dataset's "
                             f"{len(head_wnids)} WordNet IDs (first: {unknown[0]!r})")
    head = [names[IMAGENET_WNIDS.index(w)] for w in head_wnids]
    return (head, [(r, index[folders[y]]) for r, y in items],
            f"{len(folders)} of {len(head_wnids)} class folders")


def folder_classnames(folders):
    """Plain --zeroshot DIR: folder names as class names ('_' as spaces), except WordNet IDs, which
    are mapped to ImageNet's names (a prompt 'a photo of a n01440764.' measures nothing)."""
    wnids = [f for f in folders if WNID.fullmatch(f)]
    known = {w: n for w, n in zip(IMAGENET_WNIDS, IMAGENET_CLASSNAMES)}
    if wnids and all(f in known for f in folders):
        print(f"zeroshot: {len(folders)} WordNet-ID folders: ImageNet class names used",
              file=sys.stderr)
        return [known[f] for f in folders]
    if wnids:
        warn(f"{len(wnids)} class folders look like WordNet IDs but not all are ImageNet-1k's: "
             "prompts use the folder names; give --classnames")
    return [c.replace("_", " ") for c in folders]


class PlainUnpickler(pickle.Unpickler):
    """CIFAR's python batches are pickles: only numbers, strings, lists, dicts and numpy arrays are
    built; any other class or function (code a pickle could run) is refused."""
    ALLOWED = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype,
               ("_codecs", "encode"): codecs.encode,
               ("numpy.core.multiarray", "_reconstruct"): np.zeros(0).__reduce__()[0],
               ("numpy._core.multiarray", "_reconstruct"): np.zeros(0).__reduce__()[0]}

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not plain data")
        return self.ALLOWED[(module, name)]


def read_cifar(path, n_classes):
    """CIFAR-10/100 test set: the python version (cifar-10-batches-py/test_batch,
    cifar-100-python/test; rows of 1024 R, 1024 G, 1024 B bytes) or the binary version
    (test_batch.bin: 1 label byte + 3072; CIFAR-100's test.bin: coarse and fine label bytes +
    3072)."""
    py, binary, key = (("test_batch", "test_batch.bin", "labels") if n_classes == 10
                       else ("test", "test.bin", "fine_labels"))
    if (os.path.isdir(path) and not glob.glob(os.path.join(glob.escape(path), "**", py),
                                              recursive=True)):
        root = find_root(path, binary)  # the binary version, memory-mapped
        rec, skip = (np.memmap(os.path.join(root, binary), dtype=np.uint8, mode="r"),
                     1 if n_classes == 10 else 2)
        if rec.size % (skip + 3072):
            raise data.DataError(f"{os.path.join(root, binary)}: size is not a whole "
                                 "number of records")
        rec = rec.reshape(-1, skip + 3072)
        pixels, labels = rec[:, skip:], rec[:, skip - 1]
    else:
        root = find_root(path, py)
        file = os.path.join(root, py)
        try:
            with open(file, "rb") as f:
                batch = PlainUnpickler(f, encoding="latin1").load()
            pixels, labels = batch["data"], batch[key]
        except (pickle.UnpicklingError, KeyError, ValueError, EOFError, TypeError,
                AttributeError) as e:
            raise data.DataError(f"{file}: not a CIFAR python batch ({e})") from None
        # the declared shapes bound what is built: N x 3072 uint8 pixels, N integer labels
        if not (isinstance(pixels, np.ndarray) and pixels.dtype == np.uint8
                and pixels.shape[1:] == (3072,) and isinstance(labels, (list, np.ndarray))
                and all(isinstance(v, (int, np.integer)) for v in labels)):
            raise data.DataError(f"{file}: not N x 3072 uint8 pixels (`data`) with N integer "
                                 f"labels (`{key}`)")
        if len(labels) != len(pixels):
            raise data.DataError(f"{file}: {len(labels)} labels for {len(pixels)} images")
        labels = np.asarray(labels)
    images = pixels.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    names = CIFAR10_CLASSNAMES if n_classes == 10 else CIFAR100_CLASSNAMES
    return (names, list(zip(array_refs(os.path.join(root, "cifar-test"), images), labels.tolist())),
            "test batch")


def read_stl10(path):
    """STL-10 test set: stl10_binary/test_X.bin (uint8, N x 3 x 96 x 96, each channel column-major)
    and test_y.bin (labels 1-10)."""
    root = find_root(path, "test_X.bin", "test_y.bin")
    x = np.memmap(os.path.join(root, "test_X.bin"), dtype=np.uint8, mode="r")
    y = np.fromfile(os.path.join(root, "test_y.bin"), dtype=np.uint8).astype(np.int64) - 1
    if x.size != len(y) * 3 * 96 * 96:
        raise data.DataError(f"{root}: test_X.bin holds {x.size} bytes for {len(y)} labels "
                             "of 3x96x96 images")
    images = x.reshape(-1, 3, 96, 96).transpose(0, 3, 2, 1)  # column-major channels -> H x W x C
    return (STL10_CLASSNAMES, list(zip(array_refs(os.path.join(root, "test_X.bin"), images),
                                       y.tolist())), "test split")


@names_file
def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def split_list(path, parse):
    """[parse(fields)] of a whitespace-separated list file, '#' comments skipped; a bad line is
    warned about and kept as (None, why): a zero-shot reader's row that could not be read."""
    out = []
    for line_no, line in enumerate(read_lines(path), 1):
        if not line.startswith("#"):
            try:
                out.append(parse(line.split()))
            except (ValueError, IndexError):
                bad_row(path, line_no, "malformed line")
                out.append((None, f"{path}:{line_no}: malformed line"))
    return out


def read_pets(path):
    """Oxford-IIIT Pet: annotations/test.txt lines `Abyssinian_201 1 1 1` (image, class id 1-37,
    species, breed id), images/{image}.jpg."""
    root = find_root(path, os.path.join("annotations", "test.txt"), "images")
    rows = split_list(os.path.join(root, "annotations", "test.txt"),
                      lambda f: (f[0], int(f[1]) - 1))
    return (PETS, [(n and file_ref(os.path.join(root, "images", f"{n}.jpg")), y) for n, y in rows],
            "test.txt")


def read_food101(path):
    """Food-101: meta/test.json {class: ["class/id", ...]}, images/{class}/{id}.jpg; classes sorted,
    '_' as spaces (as CLIP_benchmark)."""
    root = find_root(path, os.path.join("meta", "test.json"), "images")
    split = read_json(os.path.join(root, "meta", "test.json"))
    classes = sorted(split)
    items = [(file_ref(os.path.join(root, "images", f"{f}.jpg")), y) for y, c in enumerate(classes)
             for f in split[c]]
    return [c.replace("_", " ") for c in classes], items, "meta/test.json"


def read_sun397(path):
    """SUN397: ClassName.txt (/a/abbey, /a/apartment_building/outdoor, ...), images
    {class}/sun_*.jpg. With a partition file (Partitions.zip: Testing_01.txt) beside it, its test
    images; without, every image, as CLIP_benchmark (torchvision's SUN397 has no split)."""
    root = find_root(path, "ClassName.txt")
    classes = [c[3:] if c[2:3] == "/" else c.lstrip("/")
               for c in read_lines(os.path.join(root, "ClassName.txt"))]
    index = {c: i for i, c in enumerate(classes)}
    names = [c.replace("_", " ").replace("/", " ") for c in classes]
    for part in (os.path.join(root, "Testing_01.txt"),
                 os.path.join(root, "Partitions", "Testing_01.txt")):
        if os.path.isfile(part):
            rel = [p.lstrip("/") for p in read_lines(part)]
            return (names, [(file_ref(os.path.join(root, p)), index[os.path.dirname(p)[2:]])
                            if os.path.dirname(p)[2:] in index
                            else (None, f"{part}: {p}: class not in ClassName.txt") for p in rel],
                    "Partitions/Testing_01.txt")
    items = [(file_ref(p), y) for y, c in enumerate(classes)
             for p in sorted(glob.glob(os.path.join(glob.escape(root), c[0], *c.split("/"),
                                                    "sun_*.jpg")))]
    return names, items, "all images (no partition file given; CLIP_benchmark's protocol)"


def read_caltech101(path):
    """Caltech101: 101_ObjectCategories/{category}/image_NNNN.jpg, all 102 folders
    (BACKGROUND_Google included) and every image, with CLIP_benchmark's names (it defines no test
    split)."""
    root = find_root(path, "101_ObjectCategories")
    index = {f: i for i, f in enumerate(CALTECH101_FOLDERS)}
    folders, items = read_image_folder(os.path.join(root, "101_ObjectCategories"))
    unknown = [f for f in folders if f not in index]
    if unknown:
        raise data.DataError(f"{root}: unknown Caltech101 category folder {unknown[0]!r}")
    names = [CALTECH101_RENAMED.get(f, f.replace("_", " ")) for f in CALTECH101_FOLDERS]
    return names, [(r, index[folders[y]]) for r, y in items], "all images"


def read_voc2007(path):
    """VOC2007, single-label (CLIP_benchmark's voc2007): every object box of the test images
    (ImageSets/Main/aeroplane_test.txt lists them) cropped from JPEGImages/, labelled by its class;
    Annotations/{id}.xml gives <object><name> and <bndbox> xmin ymin xmax ymax."""
    root = find_root(path, "Annotations", "JPEGImages",
                     os.path.join("ImageSets", "Main", "aeroplane_test.txt"))
    ids = split_list(os.path.join(root, "ImageSets", "Main", "aeroplane_test.txt"), lambda f: f[0])
    index, items = {c: i for i, c in enumerate(VOC2007_CLASSNAMES)}, []
    for i in ids:
        xml, objects = os.path.join(root, "Annotations", f"{i}.xml"), []
        try:
            for obj in ElementTree.parse(xml).getroot().iter("object"):
                x0, y0, x1, y1 = (int(float(obj.find("bndbox").find(k).text))
                                  for k in ("xmin", "ymin", "xmax", "ymax"))
                objects.append((file_ref(os.path.join(root, "JPEGImages", f"{i}.jpg"),
                                         (x0, y0, x1 - x0, y1 - y0)),
                                index[obj.find("name").text.strip()]))
        except Exception as e:  # noqa: BLE001: an unreadable annotation skips its image, counted
            objects = [(None, f"{xml}: {type(e).__name__}: {first_line(e)}")]
            warn(f"{objects[0][1]}; image skipped")
        items += objects
    return VOC2007_CLASSNAMES, items, "test objects"


@names_file
def mat_v5_arrays(path):
    """{name: float64 array} of the numeric matrices in a MATLAB v5 .mat file (Flowers102's
    imagelabels.mat, setid.mat): a 128-byte header, then tagged elements; miCOMPRESSED elements
    are zlib streams of further elements. Enough for these files, not a general reader."""
    if os.path.getsize(path) > MAX_BLOB:
        raise data.DataError(f"{path}: {os.path.getsize(path)} bytes, over the {MAX_BLOB}-byte cap "
                             "for a .mat file")
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 128 or blob[126:128] not in (b"IM", b"MI"):
        raise data.DataError(f"{path}: not a MATLAB v5 .mat file")
    end = "<" if blob[126:128] == b"IM" else ">"
    types = {1: "i1", 2: "u1", 3: "i2", 4: "u2", 5: "i4", 6: "u4", 7: "f4", 9: "f8", 12: "i8",
             13: "u8"}

    def elements(buf):
        pos = 0
        while pos + 8 <= len(buf):
            kind, size = struct.unpack(end + "II", buf[pos:pos + 8])
            if kind >> 16:  # small element: size and type in the first 4 bytes, data in the next 4
                size = kind >> 16  # the high 16 bits, taken before kind is masked below
                kind = kind & 0xFFFF
                start = pos + 4
                pos = pos + 8
            else:
                start, pos = pos + 8, pos + 8 + size + (-size % 8 if kind != 15 else 0)
            if start + size > len(buf):
                raise ValueError(f"an element of {size} bytes runs past the end")
            yield kind, buf[start:start + size]

    def matrix(body):
        parts = list(elements(body))
        dims = np.frombuffer(parts[1][1], dtype=end + "i4")
        name = parts[2][1].decode("latin1")
        kind, raw = parts[3] if len(parts) > 3 else (9, b"")
        if kind not in types:
            return name, None
        return name, (np.frombuffer(raw, dtype=end + types[kind]).astype(np.float64)
                      .reshape(dims[::-1]).T)

    out = {}
    try:
        for kind, body in elements(blob[128:]):
            kind, body = (next(elements(inflate(body)))) if kind == 15 else (kind, body)
            if kind == 14:
                name, value = matrix(body)
                out[name] = value
    except (struct.error, zlib.error, ValueError, IndexError, StopIteration) as e:
        raise data.DataError(f"{path}: malformed MATLAB v5 file ({e})") from None
    return out


def inflate(blob, chunk=1 << 20):
    """zlib-inflate in chunks, refusing more than MAX_BLOB bytes of output (a zip bomb stops
    there)."""
    z, out = zlib.decompressobj(), bytearray()
    while piece := z.decompress(blob, chunk):
        out += piece
        if len(out) > MAX_BLOB:
            raise ValueError(f"a compressed element inflates past the {MAX_BLOB}-byte cap")
        blob = z.unconsumed_tail
    return bytes(out)


def read_flowers102(path):
    """Oxford Flowers102: jpg/image_NNNNN.jpg, imagelabels.mat (labels 1-102 per image), setid.mat
    (tstid: the 6149 test image numbers)."""
    root = find_root(path, "jpg", "imagelabels.mat", "setid.mat")
    labels, split = (mat_v5_arrays(os.path.join(root, "imagelabels.mat")),
                     mat_v5_arrays(os.path.join(root, "setid.mat")))
    if labels.get("labels") is None or split.get("tstid") is None:
        raise data.DataError(f"{root}: imagelabels.mat needs `labels`, setid.mat needs `tstid`")
    y = labels["labels"].ravel().astype(int)
    items = [(file_ref(os.path.join(root, "jpg", f"image_{i:05d}.jpg")), int(y[i - 1]) - 1)
             for i in split["tstid"].ravel().astype(int)]
    return FLOWERS, items, "setid.mat tstid"


def read_objectnet(path):
    """ObjectNet 1.0: images/{folder}/*.png and mappings/folder_to_objectnet_label.json,
    objectnet_to_imagenet_1k.json; the 113 classes that map to ImageNet-1k (as CLIP_benchmark), each
    named by its ObjectNet label, lower-cased."""
    root = find_root(path, "images", os.path.join("mappings", "objectnet_to_imagenet_1k.json"))
    folder_of = {v: k for k, v in read_json(os.path.join(root, "mappings",
                                                         "folder_to_objectnet_label.json")).items()}
    shared = read_json(os.path.join(root, "mappings", "objectnet_to_imagenet_1k.json"))
    if any(label not in folder_of for label in shared):
        raise data.DataError(f"{root}/mappings: an ObjectNet label of "
                             "objectnet_to_imagenet_1k.json has no folder")
    overlap = sorted(folder_of[label] for label in shared)
    label_of = {v: k for k, v in folder_of.items()}
    items = [(file_ref(p), y) for y, f in enumerate(overlap)
             for p in sorted(glob.glob(os.path.join(glob.escape(root), "images", f, "*")))
             if p.lower().endswith(IMAGE_EXTS)]
    return ([label_of[f].lower() for f in overlap], items, f"{len(overlap)} classes shared "
            "with ImageNet-1k")


def read_resisc45(path):
    """NWPU-RESISC45: an ImageFolder of the 45 scene folders (700 images each), every image (VTAB's
    test split is the last 20% of TFDS's shuffled order, which the release does not carry)."""
    root = find_root(path, "airplane", "wetland")
    folders, items = read_image_folder(root)
    if folders != RESISC45_FOLDERS:
        raise data.DataError(f"{root}: expected the 45 RESISC45 class folders, "
                             f"found {len(folders)}")
    # TFDS's names: underscores kept
    return folders, items, "all images (VTAB's 20% test split needs TFDS)"


def read_clevr(path):
    """CLEVR v1.0, VTAB's count_all task: scenes/CLEVR_val_scenes.json, images/val/*.png; label =
    number of objects - 3 (3-10 objects). VTAB's test split is CLEVR's validation set."""
    root = find_root(path, os.path.join("scenes", "CLEVR_val_scenes.json"),
                     os.path.join("images", "val"))
    try:
        scenes = read_json(os.path.join(root, "scenes", "CLEVR_val_scenes.json"))["scenes"]
        rows = [(s["image_filename"], len(s["objects"]) - 3) for s in scenes]
    except (KeyError, TypeError) as e:
        raise data.DataError(f"{root}/scenes/CLEVR_val_scenes.json: "
                             f"{type(e).__name__}: {e}") from None
    items = [(file_ref(os.path.join(root, "images", "val", f)), y) for f, y in rows if 0 <= y < 8]
    return (CLEVR_COUNT, items, "validation set (VTAB test)" + (f", {len(rows) - len(items)} "
                                                                "scenes outside 3-10 objects"
                                                                if len(rows) > len(items) else ""))


def norb_matrix(path):
    """A smallNORB binary matrix: int32 magic (0x1E3D4C55 uint8, 0x1E3D4C54 int32), int32 ndim,
    max(3, ndim) int32 dims, then the data, little-endian (memory-mapped: the images are 450 MB)."""
    head = np.fromfile(path, dtype="<i4", count=5)
    if len(head) < 5 or head[0] not in (0x1E3D4C55, 0x1E3D4C54):
        raise data.DataError(f"{path}: not a smallNORB binary matrix")
    ndim = int(head[1])
    dims = tuple(int(d) for d in np.fromfile(path, dtype="<i4", count=ndim, offset=8))
    try:
        return np.memmap(path, dtype="u1" if head[0] == 0x1E3D4C55 else "<i4", mode="r",
                         offset=8 + 4 * max(3, ndim), shape=dims)
    except ValueError as e:
        raise data.DataError(f"{path}: shape {dims} does not fit the file ({e})") from None


def read_smallnorb(path):
    """smallNORB test set, VTAB's azimuth task (18 classes; info column 2 holds 0, 2, ..., 34):
    smallnorb-5x01235x9x18x6x2x96x96-testing-{dat,info}.mat, gunzipped; the first camera's image."""
    stem = "smallnorb-5x01235x9x18x6x2x96x96-testing-"
    root = find_root(path, f"{stem}dat.mat", f"{stem}info.mat")
    dat, info = (norb_matrix(os.path.join(root, f"{stem}dat.mat")),
                 norb_matrix(os.path.join(root, f"{stem}info.mat")))
    if dat.ndim != 4 or info.ndim != 2 or len(dat) != len(info):
        raise data.DataError(f"{root}: testing-dat.mat {dat.shape} and testing-info.mat "
                             f"{info.shape} do not pair up")
    refs = array_refs(os.path.join(root, f"{stem}dat.mat"), dat[:, 0])
    return SMALLNORB_AZIMUTH, list(zip(refs, (info[:, 2] // 2).tolist())), \
        "all 24,300 test pairs (VTAB scores half of TFDS's shuffled order)"


def varint(buf, pos):
    value = shift = 0
    while True:
        b = buf[pos]
        pos, value, shift = pos + 1, value | (b & 0x7F) << shift, shift + 7
        if b < 0x80:
            return value, pos


def protobuf_fields(buf, start, end):
    """{field number: [value]} of one protobuf message in buf[start:end]: an int for a varint, the
    (offset, size) of a length-delimited value (so image bytes are located, not copied)."""
    out, pos = {}, start
    while pos < end:
        key, pos = varint(buf, pos)
        if key & 7 == 0:
            value, pos = varint(buf, pos)
        elif key & 7 == 2:
            size, pos = varint(buf, pos)
            if pos + size > end:
                raise ValueError(f"a field of {size} bytes runs past its message")
            value, pos = (pos, size), pos + size
        elif key & 7 in (1, 5):
            value, pos = None, pos + (8 if key & 7 == 1 else 4)
        else:
            raise ValueError(f"protobuf wire type {key & 7}")
        out.setdefault(key >> 3, []).append(value)
    return out


def tf_example(buf):
    """{feature: [(offset, size)] (bytes_list) or [int] (int64_list)} of a tf.train.Example:
    Example.features (1) > Features.feature (1: map entries, key 1, value 2) > Feature.bytes_list
    (1) or int64_list (3) > value (1; int64 packed or not)."""
    out = {}
    (fo, fs), = protobuf_fields(buf, 0, len(buf))[1]
    for eo, es in protobuf_fields(buf, fo, fo + fs).get(1, []):
        entry = protobuf_fields(buf, eo, eo + es)
        (ko, ks), (vo, vs) = entry[1][0], entry[2][0]
        (kind, ((lo, ls),)), = protobuf_fields(buf, vo, vo + vs).items()
        values = protobuf_fields(buf, lo, lo + ls).get(1, [])
        if kind == 3:  # packed: one length-delimited run of varints
            values = [x for v in values for x in ([v] if isinstance(v, int)
                                                  else packed_varints(buf, *v))]
        out[bytes(buf[ko:ko + ks]).decode()] = values
    return out


def packed_varints(buf, offset, size):
    out, pos = [], offset
    while pos < offset + size:
        value, pos = varint(buf, pos)
        out.append(value)
    return out


def tfrecords(path):
    """(data offset, tf.train.Example) per record of a TFRecord file: uint64 length, uint32 masked
    CRC of the length, the data, uint32 masked CRC of the data (CRCs not checked: a damaged
    record fails to parse instead)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        while header := f.read(12):
            if len(header) < 12:
                raise ValueError("truncated record header")
            n = struct.unpack("<Q", header[:8])[0]
            if n > min(size - f.tell() - 4, MAX_BLOB):
                raise data.DataError(f"{path}: record at byte {f.tell() - 12} says {n} bytes: more "
                                     f"than the file holds or the {MAX_BLOB}-byte cap")
            offset, record = f.tell(), f.read(n)
            if len(record) < n or len(f.read(4)) < 4:
                raise ValueError("truncated record")
            yield offset, tf_example(record)


def read_dmlab(path):
    """DMLab (VTAB): dmlab.tar.gz's dmlab-test.tfrecord* (tf.train.Example: image = JPEG bytes,
    label = int64 0-5, filename); VTAB's test split is this whole split."""
    root = find_root(path, "dmlab-test.tfrecord*")
    files = sorted(glob.glob(os.path.join(glob.escape(root), "dmlab-test.tfrecord*")))
    items = []
    for file in files:
        try:
            for offset, ex in tfrecords(file):
                (io_, size), = ex["image"]
                items.append((LazyRef(f"{file}@{offset + io_}", path=file,
                                      span=(offset + io_, size)), ex["label"][0]))
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise data.DataError(f"{file}: record {len(items) + 1}: not a tf.train.Example with "
                                 f"image and label ({e})") from None
    return DMLAB, items, "test split (VTAB test)"


def read_clip_benchmark_wds(path):
    """CLIP_benchmark's webdataset export of any of these datasets (its `clip-benchmark/wds_*`
    releases on the Hugging Face Hub): classnames.txt, test/{0..n-1}.tar holding {key}.webp|png|jpg
    and {key}.cls (the label as text). Images are read in place from the uncompressed shards."""
    root = find_root(path, "classnames.txt", os.path.join("test", "*.tar"))
    shards = sorted(glob.glob(os.path.join(glob.escape(root), "test", "*.tar")),
                    key=lambda s: (len(os.path.basename(s)), os.path.basename(s)))
    items = []
    for shard in shards:
        groups = {}
        try:
            with tarfile.open(shard, "r:") as tar:  # uncompressed: images are read at their offsets
                for m in tar:
                    key, _, ext = os.path.basename(m.name).partition(".")
                    g = groups.setdefault(os.path.join(os.path.dirname(m.name), key), {})
                    if ext == "cls":
                        g["cls"] = tar.extractfile(m).read() if m.size < 64 else b"(over 64 bytes)"
                    elif ext.lower() in ("webp", "png", "jpg", "jpeg") and m.isfile():
                        g["image"] = (m.offset_data, m.size)
        except (OSError, tarfile.TarError) as e:
            raise data.DataError(f"{shard}: unreadable tar shard ({e})") from None
        for key, g in groups.items():
            try:
                items.append((LazyRef(f"{shard}/{key}", path=shard, span=g["image"]),
                              int(g["cls"].decode().strip())))
            except (KeyError, ValueError, UnicodeDecodeError):
                items.append((None, f"{shard}: {key}: no image or no integer .cls"))
                warn(f"{items[-1][1]}; sample skipped")
    return (read_lines(os.path.join(root, "classnames.txt")), items,
            "CLIP_benchmark webdataset, test split")


ZeroShotSet = namedtuple("ZeroShotSet", "column reader templates")


def zeroshot_sets():
    """Table 2's columns, in the paper's order: name -> (column, reader(path), templates)."""
    imagenet = OPENAI_IMAGENET_TEMPLATES
    return {
        "imagenet1k": ZeroShotSet("ImageNet1k",
                                  lambda p: wnid_tree(p, IMAGENET_WNIDS, IMAGENET_CLASSNAMES),
                                  imagenet),
        "cifar100": ZeroShotSet("CIFAR-100", lambda p: read_cifar(p, 100), CIFAR_TEMPLATES),
        "cifar10": ZeroShotSet("CIFAR-10", lambda p: read_cifar(p, 10), CIFAR_TEMPLATES),
        "stl10": ZeroShotSet("STL-10", read_stl10, A_THE_TEMPLATES),
        "voc2007": ZeroShotSet("VOC2007", read_voc2007, A_THE_TEMPLATES[:1]),
        "caltech101": ZeroShotSet("Caltech101", read_caltech101, CALTECH101_TEMPLATES),
        "sun397": ZeroShotSet("SUN397", read_sun397, A_THE_TEMPLATES),
        "pets": ZeroShotSet("Pets", read_pets, ["a photo of a {}, a type of pet."]),
        "flowers102": ZeroShotSet("Flowers102", read_flowers102,
                                  ["a photo of a {}, a type of flower."]),
        "food101": ZeroShotSet("Food101", read_food101, ["a photo of {}, a type of food."]),
        "objectnet": ZeroShotSet("ObjectNet", read_objectnet, imagenet),
        "clevr": ZeroShotSet("CLEVR", read_clevr, ["a picture of {} objects"]),
        "smallnorb": ZeroShotSet("Smallnorb", read_smallnorb,
                                 ["an object rotated at {}", "something rotated at {}",
                                  "{} rotation", "something at a {} angle"]),
        "resisc45": ZeroShotSet("Resisc45", read_resisc45,
                                ["a sattelite image of {}", "an aerial view of {}",
                                 "a sattelite photo of {}", "{} from above"]),
        "dmlab": ZeroShotSet("DMLAB", read_dmlab, ["{}"]),
        "imagenet-a": ZeroShotSet("ImageNet-A",
                                  lambda p: wnid_tree(p, IMAGENET_A_WNIDS, IMAGENET_CLASSNAMES),
                                  imagenet),
        "imagenet-r": ZeroShotSet("ImageNet-R",
                                  lambda p: wnid_tree(p, IMAGENET_R_WNIDS, IMAGENET_CLASSNAMES),
                                  imagenet),
        "imagenet-sketch": ZeroShotSet("IN-sketch",
                                       lambda p: wnid_tree(p, IMAGENET_WNIDS, IMAGENET_CLASSNAMES),
                                       imagenet),
    }


def zeroshot_set_name(name):
    """'ImageNet-1k', 'imagenet1k', 'IN-sketch', 'Flowers102' ... -> the key in zeroshot_sets(), or
    None."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    aliases = {"imagenet": "imagenet1k", "insketch": "imagenetsketch", "flowers": "flowers102",
               "oxfordpets": "pets"}
    key = aliases.get(key, key)
    return next((n for n in zeroshot_sets() if re.sub(r"[^a-z0-9]", "", n) == key), None)


def split_zeroshot_flags(args):
    """--zeroshot values: NAME=PATH (a named dataset) or a plain DIR|shapes (the last one wins).
    Sets args.zeroshot (plain; None when none was given: the benchmark is skipped) and
    args.zeroshot_sets; the `zeroshot` benchmark becomes one benchmark per named set (zeroshot/NAME)
    beside the plain one."""
    values, plain, sets = args.zeroshot or [], [], {}
    for v in values:
        name, sep, path = v.partition("=")
        if sep and zeroshot_set_name(name):
            sets[zeroshot_set_name(name)] = path
        elif sep and not os.path.exists(v):
            raise ConfigError(f"--zeroshot {v}: unknown dataset {name!r}; choose from "
                              f"{', '.join(zeroshot_sets())}")
        else:
            plain.append(v)
    args.zeroshot, args.zeroshot_sets = plain[-1] if plain else None, sets
    if args.zeroshot_suite and "zeroshot" not in args.benchmark_list:
        args.benchmark_list.append("zeroshot")
    if "zeroshot" in args.benchmark_list:
        i = args.benchmark_list.index("zeroshot")
        args.benchmark_list[i:i + 1] = (["zeroshot"] * (args.zeroshot is not None or not sets)
                                        + [f"zeroshot/{n}" for n in sets])
    return args


def bench_zeroshot_set(name):
    """The scorer of `zeroshot/NAME`: its reader, its class names and templates, CLIP_benchmark's
    metrics."""
    def score(args, emb):
        spec = zeroshot_sets()[name]
        require((args.zeroshot_sets[name], f"--zeroshot {name}=PATH"))
        path = args.zeroshot_sets[name]
        wds = (os.path.isfile(os.path.join(path, "classnames.txt"))
               and glob.glob(os.path.join(glob.escape(path), "test", "*.tar")))
        classnames, items, note = names_file(read_clip_benchmark_wds if wds else spec.reader)(path)
        # rows the reader could not read, with why
        unread = [why for ref, why in items if ref is None]
        items = [it for it in items if it[0] is not None]
        if not items:
            raise data.DataError(f"{path}: no {name} test images found ({note})")
        outside = [y for _, y in items if not 0 <= y < len(classnames)]
        if outside:
            raise data.DataError(f"{path}: {len(outside)} labels outside 0-{len(classnames) - 1} "
                                 f"(first: {outside[0]})")
        print(f"zeroshot/{name}: {len(items)} images, {len(classnames)} classes ({note})",
              file=sys.stderr)
        return (zeroshot_scores(emb, classnames, items, spec.templates, unread)
                | {"templates": len(spec.templates), "split": note})
    return score


def zeroshot_suite_row(results, failed):
    """The paper's Table 2 row: top-1 per dataset in its column order and the mean over the datasets
    scored (naming those that were not: a mean over fewer columns is not the paper's mean)."""
    row, scored, missing = {}, [], []
    for name, spec in zeroshot_sets().items():
        r = results.get(f"zeroshot/{name}")
        if r is not None and r.get("top1") is not None:
            row[spec.column] = {"top1": r["top1"], "n_scored": r["n_scored"],
                                "n_skipped": r["n_skipped"]}
            scored.append(r["top1"])
        else:
            row[spec.column] = {"top1": None, "n_scored": 0,
                                "reason": failed.get(f"zeroshot/{name}", "not given")}
            missing.append(spec.column)
    mean = round(sum(scored) / len(scored), 2) if scored else None
    row["Mean"] = {"top1": mean, "over": len(scored), "not_scored": missing}
    return row


def suite_table(row):
    cols = list(row)
    cell = lambda v: "—" if v is None else f"{v:.1f}"
    lines = ["| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|",
             "| top-1 | " + " | ".join(cell(row[c]["top1"]) for c in cols) + " |",
             "| n_scored | " + " | ".join(str(row[c].get("n_scored", "")) for c in cols[:-1])
             + " | |"]
    missing = row["Mean"]["not_scored"]
    if missing:
        lines.append(f"Mean over the {row['Mean']['over']} datasets scored; not scored: "
                     f"{', '.join(missing)}")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# Zero-shot suite data: class names and prompt templates (facts: the datasets' own metadata and
# CLIP_benchmark's en_classnames.json / en_zeroshot_classification_templates.json, LAION-AI)

WNID = re.compile(r"n\d{8}")


# ImageNet-1k's 1000 WordNet IDs, sorted: the class order of torchvision's ImageNet and of a
# wnid-folder tree
IMAGENET_WNIDS = _split("""
n01440764 n01443537 n01484850 n01491361 n01494475 n01496331 n01498041 n01514668 n01514859 n01518878
n01530575 n01531178 n01532829 n01534433 n01537544 n01558993 n01560419 n01580077 n01582220 n01592084
n01601694 n01608432 n01614925 n01616318 n01622779 n01629819 n01630670 n01631663 n01632458 n01632777
n01641577 n01644373 n01644900 n01664065 n01665541 n01667114 n01667778 n01669191 n01675722 n01677366
n01682714 n01685808 n01687978 n01688243 n01689811 n01692333 n01693334 n01694178 n01695060 n01697457
n01698640 n01704323 n01728572 n01728920 n01729322 n01729977 n01734418 n01735189 n01737021 n01739381
n01740131 n01742172 n01744401 n01748264 n01749939 n01751748 n01753488 n01755581 n01756291 n01768244
n01770081 n01770393 n01773157 n01773549 n01773797 n01774384 n01774750 n01775062 n01776313 n01784675
n01795545 n01796340 n01797886 n01798484 n01806143 n01806567 n01807496 n01817953 n01818515 n01819313
n01820546 n01824575 n01828970 n01829413 n01833805 n01843065 n01843383 n01847000 n01855032 n01855672
n01860187 n01871265 n01872401 n01873310 n01877812 n01882714 n01883070 n01910747 n01914609 n01917289
n01924916 n01930112 n01943899 n01944390 n01945685 n01950731 n01955084 n01968897 n01978287 n01978455
n01980166 n01981276 n01983481 n01984695 n01985128 n01986214 n01990800 n02002556 n02002724 n02006656
n02007558 n02009229 n02009912 n02011460 n02012849 n02013706 n02017213 n02018207 n02018795 n02025239
n02027492 n02028035 n02033041 n02037110 n02051845 n02056570 n02058221 n02066245 n02071294 n02074367
n02077923 n02085620 n02085782 n02085936 n02086079 n02086240 n02086646 n02086910 n02087046 n02087394
n02088094 n02088238 n02088364 n02088466 n02088632 n02089078 n02089867 n02089973 n02090379 n02090622
n02090721 n02091032 n02091134 n02091244 n02091467 n02091635 n02091831 n02092002 n02092339 n02093256
n02093428 n02093647 n02093754 n02093859 n02093991 n02094114 n02094258 n02094433 n02095314 n02095570
n02095889 n02096051 n02096177 n02096294 n02096437 n02096585 n02097047 n02097130 n02097209 n02097298
n02097474 n02097658 n02098105 n02098286 n02098413 n02099267 n02099429 n02099601 n02099712 n02099849
n02100236 n02100583 n02100735 n02100877 n02101006 n02101388 n02101556 n02102040 n02102177 n02102318
n02102480 n02102973 n02104029 n02104365 n02105056 n02105162 n02105251 n02105412 n02105505 n02105641
n02105855 n02106030 n02106166 n02106382 n02106550 n02106662 n02107142 n02107312 n02107574 n02107683
n02107908 n02108000 n02108089 n02108422 n02108551 n02108915 n02109047 n02109525 n02109961 n02110063
n02110185 n02110341 n02110627 n02110806 n02110958 n02111129 n02111277 n02111500 n02111889 n02112018
n02112137 n02112350 n02112706 n02113023 n02113186 n02113624 n02113712 n02113799 n02113978 n02114367
n02114548 n02114712 n02114855 n02115641 n02115913 n02116738 n02117135 n02119022 n02119789 n02120079
n02120505 n02123045 n02123159 n02123394 n02123597 n02124075 n02125311 n02127052 n02128385 n02128757
n02128925 n02129165 n02129604 n02130308 n02132136 n02133161 n02134084 n02134418 n02137549 n02138441
n02165105 n02165456 n02167151 n02168699 n02169497 n02172182 n02174001 n02177972 n02190166 n02206856
n02219486 n02226429 n02229544 n02231487 n02233338 n02236044 n02256656 n02259212 n02264363 n02268443
n02268853 n02276258 n02277742 n02279972 n02280649 n02281406 n02281787 n02317335 n02319095 n02321529
n02325366 n02326432 n02328150 n02342885 n02346627 n02356798 n02361337 n02363005 n02364673 n02389026
n02391049 n02395406 n02396427 n02397096 n02398521 n02403003 n02408429 n02410509 n02412080 n02415577
n02417914 n02422106 n02422699 n02423022 n02437312 n02437616 n02441942 n02442845 n02443114 n02443484
n02444819 n02445715 n02447366 n02454379 n02457408 n02480495 n02480855 n02481823 n02483362 n02483708
n02484975 n02486261 n02486410 n02487347 n02488291 n02488702 n02489166 n02490219 n02492035 n02492660
n02493509 n02493793 n02494079 n02497673 n02500267 n02504013 n02504458 n02509815 n02510455 n02514041
n02526121 n02536864 n02606052 n02607072 n02640242 n02641379 n02643566 n02655020 n02666196 n02667093
n02669723 n02672831 n02676566 n02687172 n02690373 n02692877 n02699494 n02701002 n02704792 n02708093
n02727426 n02730930 n02747177 n02749479 n02769748 n02776631 n02777292 n02782093 n02783161 n02786058
n02787622 n02788148 n02790996 n02791124 n02791270 n02793495 n02794156 n02795169 n02797295 n02799071
n02802426 n02804414 n02804610 n02807133 n02808304 n02808440 n02814533 n02814860 n02815834 n02817516
n02823428 n02823750 n02825657 n02834397 n02835271 n02837789 n02840245 n02841315 n02843684 n02859443
n02860847 n02865351 n02869837 n02870880 n02871525 n02877765 n02879718 n02883205 n02892201 n02892767
n02894605 n02895154 n02906734 n02909870 n02910353 n02916936 n02917067 n02927161 n02930766 n02939185
n02948072 n02950826 n02951358 n02951585 n02963159 n02965783 n02966193 n02966687 n02971356 n02974003
n02977058 n02978881 n02979186 n02980441 n02981792 n02988304 n02992211 n02992529 n02999410 n03000134
n03000247 n03000684 n03014705 n03016953 n03017168 n03018349 n03026506 n03028079 n03032252 n03041632
n03042490 n03045698 n03047690 n03062245 n03063599 n03063689 n03065424 n03075370 n03085013 n03089624
n03095699 n03100240 n03109150 n03110669 n03124043 n03124170 n03125729 n03126707 n03127747 n03127925
n03131574 n03133878 n03134739 n03141823 n03146219 n03160309 n03179701 n03180011 n03187595 n03188531
n03196217 n03197337 n03201208 n03207743 n03207941 n03208938 n03216828 n03218198 n03220513 n03223299
n03240683 n03249569 n03250847 n03255030 n03259280 n03271574 n03272010 n03272562 n03290653 n03291819
n03297495 n03314780 n03325584 n03337140 n03344393 n03345487 n03347037 n03355925 n03372029 n03376595
n03379051 n03384352 n03388043 n03388183 n03388549 n03393912 n03394916 n03400231 n03404251 n03417042
n03424325 n03425413 n03443371 n03444034 n03445777 n03445924 n03447447 n03447721 n03450230 n03452741
n03457902 n03459775 n03461385 n03467068 n03476684 n03476991 n03478589 n03481172 n03482405 n03483316
n03485407 n03485794 n03492542 n03494278 n03495258 n03496892 n03498962 n03527444 n03529860 n03530642
n03532672 n03534580 n03535780 n03538406 n03544143 n03584254 n03584829 n03590841 n03594734 n03594945
n03595614 n03598930 n03599486 n03602883 n03617480 n03623198 n03627232 n03630383 n03633091 n03637318
n03642806 n03649909 n03657121 n03658185 n03661043 n03662601 n03666591 n03670208 n03673027 n03676483
n03680355 n03690938 n03691459 n03692522 n03697007 n03706229 n03709823 n03710193 n03710637 n03710721
n03717622 n03720891 n03721384 n03724870 n03729826 n03733131 n03733281 n03733805 n03742115 n03743016
n03759954 n03761084 n03763968 n03764736 n03769881 n03770439 n03770679 n03773504 n03775071 n03775546
n03776460 n03777568 n03777754 n03781244 n03782006 n03785016 n03786901 n03787032 n03788195 n03788365
n03791053 n03792782 n03792972 n03793489 n03794056 n03796401 n03803284 n03804744 n03814639 n03814906
n03825788 n03832673 n03837869 n03838899 n03840681 n03841143 n03843555 n03854065 n03857828 n03866082
n03868242 n03868863 n03871628 n03873416 n03874293 n03874599 n03876231 n03877472 n03877845 n03884397
n03887697 n03888257 n03888605 n03891251 n03891332 n03895866 n03899768 n03902125 n03903868 n03908618
n03908714 n03916031 n03920288 n03924679 n03929660 n03929855 n03930313 n03930630 n03933933 n03935335
n03937543 n03938244 n03942813 n03944341 n03947888 n03950228 n03954731 n03956157 n03958227 n03961711
n03967562 n03970156 n03976467 n03976657 n03977966 n03980874 n03982430 n03983396 n03991062 n03992509
n03995372 n03998194 n04004767 n04005630 n04008634 n04009552 n04019541 n04023962 n04026417 n04033901
n04033995 n04037443 n04039381 n04040759 n04041544 n04044716 n04049303 n04065272 n04067472 n04069434
n04070727 n04074963 n04081281 n04086273 n04090263 n04099969 n04111531 n04116512 n04118538 n04118776
n04120489 n04125021 n04127249 n04131690 n04133789 n04136333 n04141076 n04141327 n04141975 n04146614
n04147183 n04149813 n04152593 n04153751 n04154565 n04162706 n04179913 n04192698 n04200800 n04201297
n04204238 n04204347 n04208210 n04209133 n04209239 n04228054 n04229816 n04235860 n04238763 n04239074
n04243546 n04251144 n04252077 n04252225 n04254120 n04254680 n04254777 n04258138 n04259630 n04263257
n04264628 n04265275 n04266014 n04270147 n04273569 n04275548 n04277352 n04285008 n04286575 n04296562
n04310018 n04311004 n04311174 n04317175 n04325704 n04326547 n04328186 n04330267 n04332243 n04335435
n04336792 n04344873 n04346328 n04347754 n04350905 n04355338 n04355933 n04356056 n04357314 n04366367
n04367480 n04370456 n04371430 n04371774 n04372370 n04376876 n04380533 n04389033 n04392985 n04398044
n04399382 n04404412 n04409515 n04417672 n04418357 n04423845 n04428191 n04429376 n04435653 n04442312
n04443257 n04447861 n04456115 n04458633 n04461696 n04462240 n04465501 n04467665 n04476259 n04479046
n04482393 n04483307 n04485082 n04486054 n04487081 n04487394 n04493381 n04501370 n04505470 n04507155
n04509417 n04515003 n04517823 n04522168 n04523525 n04525038 n04525305 n04532106 n04532670 n04536866
n04540053 n04542943 n04548280 n04548362 n04550184 n04552348 n04553703 n04554684 n04557648 n04560804
n04562935 n04579145 n04579432 n04584207 n04589890 n04590129 n04591157 n04591713 n04592741 n04596742
n04597913 n04599235 n04604644 n04606251 n04612504 n04613696 n06359193 n06596364 n06785654 n06794110
n06874185 n07248320 n07565083 n07579787 n07583066 n07584110 n07590611 n07613480 n07614500 n07615774
n07684084 n07693725 n07695742 n07697313 n07697537 n07711569 n07714571 n07714990 n07715103 n07716358
n07716906 n07717410 n07717556 n07718472 n07718747 n07720875 n07730033 n07734744 n07742313 n07745940
n07747607 n07749582 n07753113 n07753275 n07753592 n07754684 n07760859 n07768694 n07802026 n07831146
n07836838 n07860988 n07871810 n07873807 n07875152 n07880968 n07892512 n07920052 n07930864 n07932039
n09193705 n09229709 n09246464 n09256479 n09288635 n09332890 n09399592 n09421951 n09428293 n09468604
n09472597 n09835506 n10148035 n10565667 n11879895 n11939491 n12057211 n12144580 n12267677 n12620546
n12768682 n12985857 n12998815 n13037406 n13040303 n13044778 n13052670 n13054560 n13133613 n15075141
""")

# OpenAI CLIP's ImageNet class names, in IMAGENET_WNIDS order
IMAGENET_CLASSNAMES = _split("""
tench | goldfish | great white shark | tiger shark | hammerhead shark | electric ray | stingray |
rooster | hen | ostrich | brambling | goldfinch | house finch | junco | indigo bunting | American
robin | bulbul | jay | magpie | chickadee | American dipper | kite (bird of prey) | bald eagle |
vulture | great grey owl | fire salamander | smooth newt | newt | spotted salamander | axolotl |
American bullfrog | tree frog | tailed frog | loggerhead sea turtle | leatherback sea turtle | mud
turtle | terrapin | box turtle | banded gecko | green iguana | Carolina anole | desert grassland
whiptail lizard | agama | frilled-necked lizard | alligator lizard | Gila monster | European green
lizard | chameleon | Komodo dragon | Nile crocodile | American alligator | triceratops | worm snake
| ring-necked snake | eastern hog-nosed snake | smooth green snake | kingsnake | garter snake |
water snake | vine snake | night snake | boa constrictor | African rock python | Indian cobra |
green mamba | sea snake | Saharan horned viper | eastern diamondback rattlesnake | sidewinder
rattlesnake | trilobite | harvestman | scorpion | yellow garden spider | barn spider | European
garden spider | southern black widow | tarantula | wolf spider | tick | centipede | black grouse |
ptarmigan | ruffed grouse | prairie grouse | peafowl | quail | partridge | african grey parrot |
macaw | sulphur-crested cockatoo | lorikeet | coucal | bee eater | hornbill | hummingbird | jacamar
| toucan | duck | red-breasted merganser | goose | black swan | tusker | echidna | platypus |
wallaby | koala | wombat | jellyfish | sea anemone | brain coral | flatworm | nematode | conch |
snail | slug | sea slug | chiton | chambered nautilus | Dungeness crab | rock crab | fiddler crab |
red king crab | American lobster | spiny lobster | crayfish | hermit crab | isopod | white stork |
black stork | spoonbill | flamingo | little blue heron | great egret | bittern bird | crane bird |
limpkin | common gallinule | American coot | bustard | ruddy turnstone | dunlin | common redshank |
dowitcher | oystercatcher | pelican | king penguin | albatross | grey whale | killer whale | dugong
| sea lion | Chihuahua | Japanese Chin | Maltese | Pekingese | Shih Tzu | King Charles Spaniel |
Papillon | toy terrier | Rhodesian Ridgeback | Afghan Hound | Basset Hound | Beagle | Bloodhound |
Bluetick Coonhound | Black and Tan Coonhound | Treeing Walker Coonhound | English foxhound | Redbone
Coonhound | borzoi | Irish Wolfhound | Italian Greyhound | Whippet | Ibizan Hound | Norwegian
Elkhound | Otterhound | Saluki | Scottish Deerhound | Weimaraner | Staffordshire Bull Terrier |
American Staffordshire Terrier | Bedlington Terrier | Border Terrier | Kerry Blue Terrier | Irish
Terrier | Norfolk Terrier | Norwich Terrier | Yorkshire Terrier | Wire Fox Terrier | Lakeland
Terrier | Sealyham Terrier | Airedale Terrier | Cairn Terrier | Australian Terrier | Dandie Dinmont
Terrier | Boston Terrier | Miniature Schnauzer | Giant Schnauzer | Standard Schnauzer | Scottish
Terrier | Tibetan Terrier | Australian Silky Terrier | Soft-coated Wheaten Terrier | West Highland
White Terrier | Lhasa Apso | Flat-Coated Retriever | Curly-coated Retriever | Golden Retriever |
Labrador Retriever | Chesapeake Bay Retriever | German Shorthaired Pointer | Vizsla | English Setter
| Irish Setter | Gordon Setter | Brittany dog | Clumber Spaniel | English Springer Spaniel | Welsh
Springer Spaniel | Cocker Spaniel | Sussex Spaniel | Irish Water Spaniel | Kuvasz | Schipperke |
Groenendael dog | Malinois | Briard | Australian Kelpie | Komondor | Old English Sheepdog | Shetland
Sheepdog | collie | Border Collie | Bouvier des Flandres dog | Rottweiler | German Shepherd Dog |
Dobermann | Miniature Pinscher | Greater Swiss Mountain Dog | Bernese Mountain Dog | Appenzeller
Sennenhund | Entlebucher Sennenhund | Boxer | Bullmastiff | Tibetan Mastiff | French Bulldog | Great
Dane | St. Bernard | husky | Alaskan Malamute | Siberian Husky | Dalmatian | Affenpinscher | Basenji
| pug | Leonberger | Newfoundland dog | Great Pyrenees dog | Samoyed | Pomeranian | Chow Chow |
Keeshond | brussels griffon | Pembroke Welsh Corgi | Cardigan Welsh Corgi | Toy Poodle | Miniature
Poodle | Standard Poodle | Mexican hairless dog (xoloitzcuintli) | grey wolf | Alaskan tundra wolf |
red wolf or maned wolf | coyote | dingo | dhole | African wild dog | hyena | red fox | kit fox |
Arctic fox | grey fox | tabby cat | tiger cat | Persian cat | Siamese cat | Egyptian Mau | cougar |
lynx | leopard | snow leopard | jaguar | lion | tiger | cheetah | brown bear | American black bear |
polar bear | sloth bear | mongoose | meerkat | tiger beetle | ladybug | ground beetle | longhorn
beetle | leaf beetle | dung beetle | rhinoceros beetle | weevil | fly | bee | ant | grasshopper |
cricket insect | stick insect | cockroach | praying mantis | cicada | leafhopper | lacewing |
dragonfly | damselfly | red admiral butterfly | ringlet butterfly | monarch butterfly | small white
butterfly | sulphur butterfly | gossamer-winged butterfly | starfish | sea urchin | sea cucumber |
cottontail rabbit | hare | Angora rabbit | hamster | porcupine | fox squirrel | marmot | beaver |
guinea pig | common sorrel horse | zebra | pig | wild boar | warthog | hippopotamus | ox | water
buffalo | bison | ram (adult male sheep) | bighorn sheep | Alpine ibex | hartebeest | impala
(antelope) | gazelle | arabian camel | llama | weasel | mink | European polecat | black-footed
ferret | otter | skunk | badger | armadillo | three-toed sloth | orangutan | gorilla | chimpanzee |
gibbon | siamang | guenon | patas monkey | baboon | macaque | langur | black-and-white colobus |
proboscis monkey | marmoset | white-headed capuchin | howler monkey | titi monkey | Geoffroy's
spider monkey | common squirrel monkey | ring-tailed lemur | indri | Asian elephant | African bush
elephant | red panda | giant panda | snoek fish | eel | silver salmon | rock beauty fish | clownfish
| sturgeon | gar fish | lionfish | pufferfish | abacus | abaya | academic gown | accordion |
acoustic guitar | aircraft carrier | airliner | airship | altar | ambulance | amphibious vehicle |
analog clock | apiary | apron | trash can | assault rifle | backpack | bakery | balance beam |
balloon | ballpoint pen | Band-Aid | banjo | baluster / handrail | barbell | barber chair |
barbershop | barn | barometer | barrel | wheelbarrow | baseball | basketball | bassinet | bassoon |
swimming cap | bath towel | bathtub | station wagon | lighthouse | beaker | military hat (bearskin
or shako) | beer bottle | beer glass | bell tower | baby bib | tandem bicycle | bikini | ring binder
| binoculars | birdhouse | boathouse | bobsleigh | bolo tie | poke bonnet | bookcase | bookstore |
bottle cap | hunting bow | bow tie | brass memorial plaque | bra | breakwater | breastplate | broom
| bucket | buckle | bulletproof vest | high-speed train | butcher shop | taxicab | cauldron | candle
| cannon | canoe | can opener | cardigan | car mirror | carousel | tool kit | cardboard box / carton
| car wheel | automated teller machine | cassette | cassette player | castle | catamaran | CD player
| cello | mobile phone | chain | chain-link fence | chain mail | chainsaw | storage chest |
chiffonier | bell or wind chime | china cabinet | Christmas stocking | church | movie theater |
cleaver | cliff dwelling | cloak | clogs | cocktail shaker | coffee mug | coffeemaker | spiral or
coil | combination lock | computer keyboard | candy store | container ship | convertible | corkscrew
| cornet | cowboy boot | cowboy hat | cradle | construction crane | crash helmet | crate | infant
bed | Crock Pot | croquet ball | crutch | cuirass | dam | desk | desktop computer | rotary dial
telephone | diaper | digital clock | digital watch | dining table | dishcloth | dishwasher | disc
brake | dock | dog sled | dome | doormat | drilling rig | drum | drumstick | dumbbell | Dutch oven |
electric fan | electric guitar | electric locomotive | entertainment center | envelope | espresso
machine | face powder | feather boa | filing cabinet | fireboat | fire truck | fire screen |
flagpole | flute | folding chair | football helmet | forklift | fountain | fountain pen |
four-poster bed | freight car | French horn | frying pan | fur coat | garbage truck | gas mask or
respirator | gas pump | goblet | go-kart | golf ball | golf cart | gondola | gong | gown | grand
piano | greenhouse | radiator grille | grocery store | guillotine | hair clip | hair spray |
half-track | hammer | hamper | hair dryer | hand-held computer | handkerchief | hard disk drive |
harmonica | harp | combine harvester | hatchet | holster | home theater | honeycomb | hook | hoop
skirt | gymnastic horizontal bar | horse-drawn vehicle | hourglass | iPod | clothes iron | carved
pumpkin | jeans | jeep | T-shirt | jigsaw puzzle | rickshaw | joystick | kimono | knee pad | knot |
lab coat | ladle | lampshade | laptop computer | lawn mower | lens cap | letter opener | library |
lifeboat | lighter | limousine | ocean liner | lipstick | slip-on shoe | lotion | music speaker |
loupe magnifying glass | sawmill | magnetic compass | messenger bag | mailbox | tights | one-piece
bathing suit | manhole cover | maraca | marimba | mask | matchstick | maypole | maze | measuring cup
| medicine cabinet | megalith | microphone | microwave oven | military uniform | milk can | minibus
| miniskirt | minivan | missile | mitten | mixing bowl | mobile home | ford model t | modem |
monastery | monitor | moped | mortar and pestle | graduation cap | mosque | mosquito net | vespa |
mountain bike | tent | computer mouse | mousetrap | moving van | muzzle | metal nail | neck brace |
necklace | baby pacifier | notebook computer | obelisk | oboe | ocarina | odometer | oil filter |
pipe organ | oscilloscope | overskirt | bullock cart | oxygen mask | product packet / packaging |
paddle | paddle wheel | padlock | paintbrush | pajamas | palace | pan flute | paper towel |
parachute | parallel bars | park bench | parking meter | railroad car | patio | payphone | pedestal
| pencil case | pencil sharpener | perfume | Petri dish | photocopier | plectrum | Pickelhaube |
picket fence | pickup truck | pier | piggy bank | pill bottle | pillow | ping-pong ball | pinwheel |
pirate ship | drink pitcher | block plane | planetarium | plastic bag | plate rack | farm plow |
plunger | Polaroid camera | pole | police van | poncho | pool table | soda bottle | plant pot |
potter's wheel | power drill | prayer rug | printer | prison | missile | projector | hockey puck |
punching bag | purse | quill | quilt | race car | racket | radiator | radio | radio telescope | rain
barrel | recreational vehicle | fishing casting reel | reflex camera | refrigerator | remote control
| restaurant | revolver | rifle | rocking chair | rotisserie | eraser | rugby ball | ruler measuring
stick | sneaker | safe | safety pin | salt shaker | sandal | sarong | saxophone | scabbard |
weighing scale | school bus | schooner | scoreboard | CRT monitor | screw | screwdriver | seat belt
| sewing machine | shield | shoe store | shoji screen / room divider | shopping basket | shopping
cart | shovel | shower cap | shower curtain | ski | balaclava ski mask | sleeping bag | slide rule |
sliding door | slot machine | snorkel | snowmobile | snowplow | soap dispenser | soccer ball | sock
| solar thermal collector | sombrero | soup bowl | keyboard space bar | space heater | space shuttle
| spatula | motorboat | spider web | spindle | sports car | spotlight | stage | steam locomotive |
through arch bridge | steel drum | stethoscope | scarf | stone wall | stopwatch | stove | strainer |
tram | stretcher | couch | stupa | submarine | suit | sundial | sunglasses | sunglasses | sunscreen
| suspension bridge | mop | sweatshirt | swim trunks / shorts | swing | electrical switch | syringe
| table lamp | tank | tape player | teapot | teddy bear | television | tennis ball | thatched roof |
front curtain | thimble | threshing machine | throne | tile roof | toaster | tobacco shop | toilet
seat | torch | totem pole | tow truck | toy store | tractor | semi-trailer truck | tray | trench
coat | tricycle | trimaran | tripod | triumphal arch | trolleybus | trombone | hot tub | turnstile |
typewriter keyboard | umbrella | unicycle | upright piano | vacuum cleaner | vase | vaulted or
arched ceiling | velvet fabric | vending machine | vestment | viaduct | violin | volleyball | waffle
iron | wall clock | wallet | wardrobe | military aircraft | sink | washing machine | water bottle |
water jug | water tower | whiskey jug | whistle | hair wig | window screen | window shade | Windsor
tie | wine bottle | airplane wing | wok | wooden spoon | wool | split-rail fence | shipwreck |
sailboat | yurt | website | comic book | crossword | traffic or street sign | traffic light | dust
jacket | menu | plate | guacamole | consomme | hot pot | trifle | ice cream | popsicle | baguette |
bagel | pretzel | cheeseburger | hot dog | mashed potatoes | cabbage | broccoli | cauliflower |
zucchini | spaghetti squash | acorn squash | butternut squash | cucumber | artichoke | bell pepper |
cardoon | mushroom | Granny Smith apple | strawberry | orange | lemon | fig | pineapple | banana |
jackfruit | cherimoya (custard apple) | pomegranate | hay | carbonara | chocolate syrup | dough |
meatloaf | pizza | pot pie | burrito | red wine | espresso | tea cup | eggnog | mountain | bubble |
cliff | coral reef | geyser | lakeshore | promontory | sandbar | beach | valley | volcano | baseball
player | bridegroom | scuba diver | rapeseed | daisy | yellow lady's slipper | corn | acorn | rose
hip | horse chestnut seed | coral fungus | agaric | gyromitra | stinkhorn mushroom | earth star
fungus | hen of the woods mushroom | bolete | corn cob | toilet paper
""")

# the 200 classes of ImageNet-A and of ImageNet-R (Hendrycks et al.; the folders of their releases)
IMAGENET_A_WNIDS = _split("""
n01498041 n01531178 n01534433 n01558993 n01580077 n01614925 n01616318 n01631663 n01641577 n01669191
n01677366 n01687978 n01694178 n01698640 n01735189 n01770081 n01770393 n01774750 n01784675 n01819313
n01820546 n01833805 n01843383 n01847000 n01855672 n01882714 n01910747 n01914609 n01924916 n01944390
n01985128 n01986214 n02007558 n02009912 n02037110 n02051845 n02077923 n02085620 n02099601 n02106550
n02106662 n02110958 n02119022 n02123394 n02127052 n02129165 n02133161 n02137549 n02165456 n02174001
n02177972 n02190166 n02206856 n02219486 n02226429 n02231487 n02233338 n02236044 n02259212 n02268443
n02279972 n02280649 n02281787 n02317335 n02325366 n02346627 n02356798 n02361337 n02410509 n02445715
n02454379 n02486410 n02492035 n02504458 n02655020 n02669723 n02672831 n02676566 n02690373 n02701002
n02730930 n02777292 n02782093 n02787622 n02793495 n02797295 n02802426 n02814860 n02815834 n02837789
n02879718 n02883205 n02895154 n02906734 n02948072 n02951358 n02980441 n02992211 n02999410 n03014705
n03026506 n03124043 n03125729 n03187595 n03196217 n03223299 n03250847 n03255030 n03291819 n03325584
n03355925 n03384352 n03388043 n03417042 n03443371 n03444034 n03445924 n03452741 n03483316 n03584829
n03590841 n03594945 n03617480 n03666591 n03670208 n03717622 n03720891 n03721384 n03724870 n03775071
n03788195 n03804744 n03837869 n03840681 n03854065 n03888257 n03891332 n03935335 n03982430 n04019541
n04033901 n04039381 n04067472 n04086273 n04099969 n04118538 n04131690 n04133789 n04141076 n04146614
n04147183 n04179913 n04208210 n04235860 n04252077 n04252225 n04254120 n04270147 n04275548 n04310018
n04317175 n04344873 n04347754 n04355338 n04366367 n04376876 n04389033 n04399382 n04442312 n04456115
n04482393 n04507155 n04509417 n04532670 n04540053 n04554684 n04562935 n04591713 n04606251 n07583066
n07695742 n07697313 n07697537 n07714990 n07718472 n07720875 n07734744 n07749582 n07753592 n07760859
n07768694 n07831146 n09229709 n09246464 n09472597 n09835506 n11879895 n12057211 n12144580 n12267677
""")

IMAGENET_R_WNIDS = _split("""
n01443537 n01484850 n01494475 n01498041 n01514859 n01518878 n01531178 n01534433 n01614925 n01616318
n01630670 n01632777 n01644373 n01677366 n01694178 n01748264 n01770393 n01774750 n01784675 n01806143
n01820546 n01833805 n01843383 n01847000 n01855672 n01860187 n01882714 n01910747 n01944390 n01983481
n01986214 n02007558 n02009912 n02051845 n02056570 n02066245 n02071294 n02077923 n02085620 n02086240
n02088094 n02088238 n02088364 n02088466 n02091032 n02091134 n02092339 n02094433 n02096585 n02097298
n02098286 n02099601 n02099712 n02102318 n02106030 n02106166 n02106550 n02106662 n02108089 n02108915
n02109525 n02110185 n02110341 n02110958 n02112018 n02112137 n02113023 n02113624 n02113799 n02114367
n02117135 n02119022 n02123045 n02128385 n02128757 n02129165 n02129604 n02130308 n02134084 n02138441
n02165456 n02190166 n02206856 n02219486 n02226429 n02233338 n02236044 n02268443 n02279972 n02317335
n02325366 n02346627 n02356798 n02363005 n02364673 n02391049 n02395406 n02398521 n02410509 n02423022
n02437616 n02445715 n02447366 n02480495 n02480855 n02481823 n02483362 n02486410 n02510455 n02526121
n02607072 n02655020 n02672831 n02701002 n02749479 n02769748 n02793495 n02797295 n02802426 n02808440
n02814860 n02823750 n02841315 n02843684 n02883205 n02906734 n02909870 n02939185 n02948072 n02950826
n02951358 n02966193 n02980441 n02992529 n03124170 n03272010 n03345487 n03372029 n03424325 n03452741
n03467068 n03481172 n03494278 n03495258 n03498962 n03594945 n03602883 n03630383 n03649909 n03676483
n03710193 n03773504 n03775071 n03888257 n03930630 n03947888 n04086273 n04118538 n04133789 n04141076
n04146614 n04147183 n04192698 n04254680 n04266014 n04275548 n04310018 n04325704 n04347754 n04389033
n04409515 n04465501 n04487394 n04522168 n04536866 n04552348 n04591713 n07614500 n07693725 n07695742
n07697313 n07697537 n07714571 n07714990 n07718472 n07720875 n07734744 n07742313 n07745940 n07749582
n07753275 n07753592 n07768694 n07873807 n07880968 n07920052 n09472597 n09835506 n10565667 n12267677
""")

# CIFAR's batches.meta / meta label names as written: CLIP_benchmark prompts with torchvision's
# CIFAR100.classes, whose underscores it keeps ("aquarium_fish")
CIFAR10_CLASSNAMES = _split("airplane automobile bird cat deer dog frog horse ship truck")

CIFAR100_CLASSNAMES = _split("""
apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy bridge bus butterfly
camel can castle caterpillar cattle chair chimpanzee clock cloud cockroach couch crab crocodile cup
dinosaur dolphin elephant flatfish forest fox girl hamster house kangaroo keyboard lamp lawn_mower
leopard lion lizard lobster man maple_tree motorcycle mountain mouse mushroom oak_tree orange orchid
otter palm_tree pear pickup_truck pine_tree plain plate poppy porcupine possum rabbit raccoon ray
road rocket rose sea seal shark shrew skunk skyscraper snail snake spider squirrel streetcar
sunflower sweet_pepper table tank telephone television tiger tractor train trout tulip turtle
wardrobe whale willow_tree wolf woman worm
""")

# class_names.txt
STL10_CLASSNAMES = _split("airplane bird car cat deer dog horse monkey ship truck")
# VOC's class names, as written
VOC2007_CLASSNAMES = _split("aeroplane bicycle bird boat bottle bus car cat chair cow diningtable "
                            "dog horse motorbike person pottedplant sheep sofa train tvmonitor")

# Caltech101's 102 category folders, sorted; CLIP_benchmark renames some
CALTECH101_FOLDERS = _split("""
BACKGROUND_Google Faces Faces_easy Leopards Motorbikes accordion airplanes anchor ant barrel bass
beaver binocular bonsai brain brontosaurus buddha butterfly camera cannon car_side ceiling_fan
cellphone chair chandelier cougar_body cougar_face crab crayfish crocodile crocodile_head cup
dalmatian dollar_bill dolphin dragonfly electric_guitar elephant emu euphonium ewer ferry flamingo
flamingo_head garfield gerenuk gramophone grand_piano hawksbill headphone hedgehog helicopter ibis
inline_skate joshua_tree kangaroo ketch lamp laptop llama lobster lotus mandolin mayfly menorah
metronome minaret nautilus octopus okapi pagoda panda pigeon pizza platypus pyramid revolver rhino
rooster saxophone schooner scissors scorpion sea_horse snoopy soccer_ball stapler starfish
stegosaurus stop_sign strawberry sunflower tick trilobite umbrella watch water_lilly wheelchair
wild_cat windsor_chair wrench yin_yang
""")

CALTECH101_RENAMED = {"BACKGROUND_Google": "background",
                      "Faces": "off-center face",
                      "Faces_easy": "centered face",
                      "Leopards": "leopard",
                      "Motorbikes": "motorbike",
                      "airplanes": "airplane",
                      "car_side": "side of a car",
                      "cougar_body": "body of a cougar cat",
                      "cougar_face": "face of a cougar cat",
                      # sic, two spaces (CLIP_benchmark's)
                      "crocodile_head": "head of a  crocodile",
                      "flamingo_head": "head of a flamingo",
                      "snoopy": "snoopy (cartoon beagle)",
                      "yin_yang": "yin and yang symbol"}

# Oxford-IIIT Pet's 37 breeds, class ids 1-37 in order
PETS = _split("""
Abyssinian | American Bulldog | American Pit Bull Terrier | Basset Hound | Beagle | Bengal | Birman
| Bombay | Boxer | British Shorthair | Chihuahua | Egyptian Mau | English Cocker Spaniel | English
Setter | German Shorthaired | Great Pyrenees | Havanese | Japanese Chin | Keeshond | Leonberger |
Maine Coon | Miniature Pinscher | Newfoundland | Persian | Pomeranian | Pug | Ragdoll | Russian Blue
| Saint Bernard | Samoyed | Scottish Terrier | Shiba Inu | Siamese | Sphynx | Staffordshire Bull
Terrier | Wheaten Terrier | Yorkshire Terrier
""")

# Oxford Flowers102's names, labels 1-102 in order
FLOWERS = _split("""
pink primrose | hard-leaved pocket orchid | canterbury bells | sweet pea | english marigold | tiger
lily | moon orchid | bird of paradise | monkshood | globe thistle | snapdragon | colt's foot | king
protea | spear thistle | yellow iris | globe flower | purple coneflower | peruvian lily | balloon
flower | giant white arum lily | fire lily | pincushion flower | fritillary | red ginger | grape
hyacinth | corn poppy | prince of wales feathers | stemless gentian | artichoke | sweet william |
carnation | garden phlox | love in the mist | mexican aster | alpine sea holly | ruby-lipped
cattleya | cape flower | great masterwort | siam tulip | lenten rose | barbeton daisy | daffodil |
sword lily | poinsettia | bolero deep blue | wallflower | marigold | buttercup | oxeye daisy |
common dandelion | petunia | wild pansy | primula | sunflower | pelargonium | bishop of llandaff |
gaura | geranium | orange dahlia | pink and yellow dahlia | cautleya spicata | japanese anemone |
black-eyed susan | silverbush | californian poppy | osteospermum | spring crocus | bearded iris |
windflower | tree poppy | gazania | azalea | water lily | rose | thorn apple | morning glory |
passion flower | lotus | toad lily | anthurium | frangipani | clematis | hibiscus | columbine |
desert-rose | tree mallow | magnolia | cyclamen | watercress | canna lily | hippeastrum | bee balm |
air plant | foxglove | bougainvillea | camellia | mallow | mexican petunia | bromelia | blanket
flower | trumpet creeper | blackberry lily
""")

# NWPU-RESISC45's 45 class folders
RESISC45_FOLDERS = _split("""
airplane airport baseball_diamond basketball_court beach bridge chaparral church circular_farmland
cloud commercial_area dense_residential desert forest freeway golf_course ground_track_field harbor
industrial_area intersection island lake meadow medium_residential mobile_home_park mountain
overpass palace parking_lot railway railway_station rectangular_farmland river roundabout runway
sea_ice ship snowberg sparse_residential stadium storage_tank tennis_court terrace
thermal_power_station wetland
""")

CLEVR_COUNT = _split("three four five six seven eight nine ten")  # objects in the scene, 3-10
SMALLNORB_AZIMUTH = [str(i) for i in range(18)]  # TFDS names its 18 azimuth classes by number
# DMLab: {nearby, far, very far} x {apple/melon (reward), lemon (penalty)}
DMLAB = _split("""
nearby apple/melon | far apple/melon | very far apple/melon | nearby lemon | far lemon | very far
lemon
""")

# CLIP_benchmark's templates for CIFAR-10 and CIFAR-100
CIFAR_TEMPLATES = _split("""
a photo of a {}. | a blurry photo of a {}. | a black and white photo of a {}. | a low contrast photo
of a {}. | a high contrast photo of a {}. | a bad photo of a {}. | a good photo of a {}. | a photo
of a small {}. | a photo of a big {}. | a photo of the {}. | a blurry photo of the {}. | a black and
white photo of the {}. | a low contrast photo of the {}. | a high contrast photo of the {}. | a bad
photo of the {}. | a good photo of the {}. | a photo of the small {}. | a photo of the big {}.
""")

A_THE_TEMPLATES = ["a photo of a {}.", "a photo of the {}."]  # STL-10, SUN397; VOC2007 the first

CALTECH101_TEMPLATES = _split("""
a photo of a {}. | a painting of a {}. | a plastic {}. | a sculpture of a {}. | a sketch of a {}. |
a tattoo of a {}. | a toy {}. | a rendition of a {}. | a embroidered {}. | a cartoon {}. | a {} in a
video game. | a plushie {}. | a origami {}. | art of a {}. | graffiti of a {}. | a drawing of a {}.
| a doodle of a {}. | a photo of the {}. | a painting of the {}. | the plastic {}. | a sculpture of
the {}. | a sketch of the {}. | a tattoo of the {}. | the toy {}. | a rendition of the {}. | the
embroidered {}. | the cartoon {}. | the {} in a video game. | the plushie {}. | the origami {}. |
art of the {}. | graffiti of the {}. | a drawing of the {}. | a doodle of the {}.
""")


# -----------------------------------------------------------------------------
# Analysis (paper section 4.4)

def spectral_norm(w):
    """Largest singular value of a matrix, exactly (an SVD: at these sizes cheaper than enough
    power iterations; 100 of them under-estimated the log10 product by 2%). Conv kernels are
    flattened to [out, in * kh * kw], exact for a stride = kernel patch embedding."""
    return float(torch.linalg.svdvals(w.detach().double().reshape(w.shape[0], -1))[0])


VISION_PREFIXES = ("visual.", "image_query.")  # a model whose script does not say (il_clip.py's)


def spectral_layers(model):
    """The linear maps of a model in parameter order: every weight with >= 2 dims except
    lookup tables (token / positional / class embeddings)."""
    return [(n, p) for n, p in model.named_parameters() if p.dim() >= 2 and "embedding" not in n]


def spectral_product(model):
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
    per_layer = {n: spectral_norm(p) for n, p in spectral_layers(model)}
    log = lambda names: round(sum(math.log10(max(per_layer[n], 1e-30)) for n in names), 6)
    prefixes = getattr(script_of(model), "VISION_PREFIXES", VISION_PREFIXES)
    vision = [n for n in per_layer if n.startswith(prefixes)]
    text = [n for n in per_layer if not n.startswith(prefixes) and n != "codebook"]
    return {"log10_product": log(per_layer), "log10_vision": log(vision), "log10_text": log(text),
            "layers": len(per_layer), "spectral_norms": {n: round(v, 6)
                                                         for n, v in per_layer.items()}}


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
    found = ([os.path.dirname(p) for p in found]
             + glob.glob(os.path.join(root, "*gen*.safetensors"))
             + glob.glob(os.path.join(root, "generations", "*.safetensors")))
    num = lambda p: int("".join(ch for ch in os.path.basename(p) if ch.isdigit()) or -1)
    return sorted(set(found), key=lambda p: (num(p), p))


def spectral_curve(ckpt, model, args):
    """{"final": spectral_product of the checkpoint, "generations": [per snapshot]}."""
    out = spectral_product(model)
    curve = []
    for path in generation_snapshots(ckpt):
        snap = load_snapshot(path, model, ckpt, args)
        curve.append({"snapshot": os.path.relpath(path, out_dir_of(ckpt))} |
                     {k: v for k, v in spectral_product(snap).items() if k != "spectral_norms"})
    return out | ({"generations": curve} if curve else {})


def bench_spectral(args, model, tok, config):
    """The product of spectral norms per generation snapshot, for --ckpt and every
    --compare_ckpts checkpoint on one plot (paper Fig. 4: IL-CLIP's generations against
    Codebook-CLIP). A checkpoint without snapshots is drawn as a flat line at its value."""
    runs = {run_name(args.ckpt or args.init): spectral_curve(args.ckpt, model, args)}
    for path in compare_ckpts(args):
        runs[run_name(path)] = spectral_curve(path, load_checkpoint(path, args)[0], args)
    # x: the generation a snapshot ends (the number in its name: gen0/ is the end of the warm-up)
    gen_of = (lambda i, g: int("".join(ch for ch in os.path.basename(g["snapshot"]) if ch.isdigit())
                               or i))
    xs = ([gen_of(i, g) for r in runs.values() for i, g in enumerate(r.get("generations", []))]
          or [0, 1])
    series = {}
    for name, r in runs.items():
        gens = r.get("generations")
        if gens:
            series[f"{name} (gen{{K}}/ snapshots)"] = [(gen_of(i, g), g["log10_vision"])
                                                       for i, g in enumerate(gens)]
        else:       # drawn across the generations of the others
            flat = r["log10_vision"]
            series[f"{name} (final weights, no snapshots)"] = [(min(xs), flat), (max(xs), flat)]
    png = os.path.join(args.plot_dir, "spectral.png")
    draw_line_plot(png, series, "vision agent: product of spectral norms (Fig. 4; not a "
                   "Lipschitz bound)", "generation (snapshot gen{K}/; 0: end of the warm-up)",
                   "log10 of the product (unitless)")
    main = runs.pop(next(iter(runs)))
    return main | ({"compare": runs} if runs else {}) | {"png": png}


def load_snapshot(path, model, ckpt, args):
    """A generation snapshot, by the code that built `model` (the run's own script): a folder its
    load_model reads, or a bare state dict loaded into a copy of the model."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return script_of(model).load_model(path, device=args.device, quick_gelu=args.quick_gelu)[0]
    from safetensors.torch import load_file
    snap = copy.deepcopy(model)
    try:
        snap.load_state_dict(load_file(os.path.join(path, "model.safetensors")
                                       if os.path.isdir(path) else path))
    except RuntimeError as e:
        raise ConfigError(f"{path}: generation snapshot does not match the model of {ckpt} "
                          f"({first_line(e)})") from None
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
        raise Skip(f"give --{flag} (any --data spec): the weights do not say what data they "
                   "were trained on")
    pick = (lambda k, default: getattr(args, k) if getattr(args, k) is not None
            else cfg.get(k, default))
    return (spec, {"image_root": pick("image_root", None),
                   "csv_img_key": pick("csv_img_key", "filepath"),
                   "csv_caption_key": pick("csv_caption_key", "title"),
                   "csv_separator": pick("csv_separator", None),
                   "num_workers": getattr(args, "num_workers", 0)})


def loader_for(spec, kw, split, tok, image_size, batch_size, train, seed=0):
    """data.make_loader for an analysis: a DataError (bad spec, unreadable files) is the
    analysis's error line, not a crash."""
    return data.make_loader(spec, split, batch_size=batch_size, tokenizer=tok,
                            image_size=image_size, train=train, seed=seed, drop_last=train, **kw)


HELD_OUT_PERCENT = 10   # of a split-less dataset's pairs (by key), never trained on by the probe


def held_out_rule(spec, kw, seed):
    """None where the data has a val split (shapes, a Karpathy JSON with val images): held-out
    pairs come from it. Else (CSV, tar shards, ImageFolder: their readers have no split) a seeded
    ~10% of the pairs by key: key -> True if held out, the same rule for both sides."""
    src = data.resolve_data(spec, kw.get("image_root"))
    if src["kind"] == "shapes" or (src["kind"] == "karpathy" and
                                   karpathy_items(src["path"], src.get("image_root"), "val")):
        return None
    return lambda key: zlib.crc32(f"{seed}/{key}".encode()) % 100 < HELD_OUT_PERCENT


def select(batch, keep):
    """The rows of a loader batch whose key `keep` accepts."""
    rows = [i for i, k in enumerate(batch["key"]) if keep(k)]
    return {k: (v[rows] if torch.is_tensor(v) else [v[i] for i in rows])
            if k in ("image", "text", "caption", "key") else v for k, v in batch.items()}


def eval_batches(spec, kw, tok, size, batch_size, n, held_out=None):
    """Up to n (image, caption) pairs: the `val` split, or with `held_out` (held_out_rule) the
    pairs it holds out of the data in loader order."""
    loader = loader_for(spec, kw, "val" if held_out is None else "train", tok, size, batch_size,
                        train=False)
    batches, seen = [], 0
    for b in loader:
        b = b if held_out is None else select(b, held_out)
        if len(b["caption"]):
            batches.append(b)
            seen += len(b["caption"])
        if seen >= n:
            break
    if not batches:
        raise data.DataError(f"{spec}: no readable image-caption pair for the analysis"
                             + ("" if held_out is None else f" among the {HELD_OUT_PERCENT}% of "
                                "its pairs held out (too small a dataset?)"))
    return batches, loader


def bench_codebook(args, model, tok, config):
    """Top-k images of --viz_data per code (paper Eq. 2: r_i = max over patches of <f_p, c_i>)
    for the codes used most (largest total sparsemax weight over the images; Fig. 6)."""
    if not getattr(getattr(model, "cfg", None), "codebook_size", 0):
        raise Skip("the model has no codebook (needs il_clip.py --method codebook / il)")
    spec, kw = analysis_data(args, config, "viz_data")
    batches, loader = eval_batches(spec, kw, tok, image_size_of(model, config), args.batch_size,
                                   args.viz_images)
    images = torch.cat([b["image"] for b in batches])[:args.viz_images]
    captions = [c for b in batches for c in b["caption"]][:args.viz_images]
    scores, weights = [], []
    with torch.no_grad():
        for i in range(0, len(images), args.batch_size):
            s, w = image_code_scores(model, data.normalize_images(images[i:i + args.batch_size],
                                                                  args.device))
            scores.append(s.float().cpu()), weights.append(w.float().cpu())
    scores, weights = torch.cat(scores), torch.cat(weights)  # [N, K]
    usage = weights.sum(0)
    codes = usage.argsort(descending=True)[:args.viz_codes].tolist()
    rows, out = [], {}
    for c in codes:
        top = scores[:, c].topk(min(args.viz_topk, len(images))).indices.tolist()
        out[str(c)] = {"usage": round(float(usage[c]), 6), "captions": [captions[i] for i in top]}
        rows.append((f"code {c}\nweight {float(usage[c]):.3g}", [to_pil(images[i]) for i in top]))
    png = os.path.join(args.plot_dir, "codebook.png")
    draw_image_grid(png, rows, f"codebook: the {args.viz_topk} images of {spec} that score highest "
                    f"on each of the {len(codes)} most used codes (weight: its sparsemax weight "
                    "summed over the images; Fig. 6)")
    return {"data": spec, "n_images": len(images), "n_skipped": loader.skipped, "codes": out,
            "active_codes": int((usage > 0).sum()), "png": png}


def to_pil(x):
    """A loader's image (uint8, or CLIP-normalised float: undone) back to a PIL image."""
    mean, std = (torch.tensor(data.CLIP_MEAN)[:, None, None],
                 torch.tensor(data.CLIP_STD)[:, None, None])
    x = (x.cpu() if x.dtype == torch.uint8
         else ((x.float().cpu() * std + mean).clamp(0, 1) * 255).round().byte())
    arr = x.permute(1, 2, 0).numpy()
    return Image.fromarray(arr)


def image_code_scores(model, images):
    """Per-code scores of images, r_i = max over patches of q(f_p) . c_i (paper Eq. 2, with the
    scaling and temperature of the model's script), and their sparsemax weights w_i (Eq. 3): [B, K]
    each."""
    return model.code_scores(model.visual.forward_tokens(images), None, model.image_query)


def code_support(model, tok, n=256, seed=0):
    """How sparse the codebook head is: the sparsemax support (codes with weight > 0) per image and
    per caption of `n` shapes val scenes, its median, the mean largest weight, and the codes any of
    them uses."""
    scenes = [data.shapes_scene("val", i, seed=seed) for i in range(n)]
    tf, device = data.eval_transform(image_size_of(model, {})), model.logit_scale.device
    with torch.no_grad():
        w_img = image_code_scores(model,
                                  data.normalize_images(torch.stack([tf(s.image) for s in scenes]),
                                                        device))[1]
        text = tok([s.caption for s in scenes]).to(device)
        x, eot = model.forward_tokens(text)
        valid = torch.arange(text.shape[1], device=device)[None] <= eot[:, None]
        w_txt = model.code_scores(x, valid, model.text_query,
                                  max_tokens=model.cfg.context_length)[1]
    out = {}
    for name, w in (("image", w_img.float()), ("caption", w_txt.float())):
        support = (w > 0).sum(1).float()
        out[name] = {"codes_median": float(support.median()),
                     "codes_mean": round(float(support.mean()), 2),
                     "max_weight_mean": round(float(w.max(1).values.mean()), 4),
                     "codes_used_by_any": int((w > 0).any(0).sum()), "codebook_size": w.shape[1],
                     "n": n}
    return out


def codes_per_sample(pattern):
    """`python -c "import eval_compositional as ev; ev.codes_per_sample('out/run*')"`: code_support
    of every il_clip.py checkpoint the glob matches, one line each."""
    import glob
    args = argparse.Namespace(device="cpu", quick_gelu=None, vocab=None)
    found = {}
    # run folders, not their logs
    for path in sorted(p for p in glob.glob(pattern) if os.path.isdir(p)):
        model, tok, _ = load_checkpoint(path, args)
        found[path] = r = code_support(model, tok)
        print(f"{path}: " + "; ".join(f"{k} {v['codes_median']:.0f} codes (median; mean "
                                      f"{v['codes_mean']}, largest weight "
                                      f"{v['max_weight_mean']:.2f}), "
                                      f"{v['codes_used_by_any']}/{v['codebook_size']} used by "
                                      f"any of {v['n']}" for k, v in r.items()))
    return found


def image_size_of(model, config):
    return int(model_field(model, config, "image_size", data.SHAPES_IMAGE_SIZE))


def fresh_language_agent(model, seed):
    """A copy of the model whose language agent (agent_params(.., "language") of the model's own
    script: token + positional embedding, text transformer, ln_final, text projection, text query
    map) is re-initialised as at step 0 from `seed` (the script's own spawn initialiser, so every
    checkpoint of one architecture gets the same student), everything else frozen."""
    student = copy.deepcopy(model).cpu()
    fresh = copy.deepcopy(student)
    fresh.init_agent("language", torch.Generator().manual_seed(seed))
    names = {n for n, _ in script_of(model).agent_params(student, "language")}
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
    return (0.5 * float((s.argmax(1) == target).float().mean()
                        + (s.argmax(0) == target).float().mean()))


def probe_batches(spec, kw, tok, size, args):
    """(endless training batches, held-out batches) of the easy-to-learn probe: disjoint for
    every kind of data (held_out_rule)."""
    held_out = held_out_rule(spec, kw, args.probe_seed)
    train = loader_for(spec, kw, "train", tok, size, args.probe_batch, train=True,
                       seed=args.probe_seed).forever()
    if held_out is not None:   # the held-out pairs never reach the student
        train = (b for b in map(lambda b: select(b, lambda k: not held_out(k)), train)
                 if len(b["caption"]) > 1)
    return (train, eval_batches(spec, kw, tok, size, args.probe_batch, args.probe_eval_size,
                                held_out)[0])


def easy_to_learn_curve(model, tok, config, args, spec, kw):
    """Train a fresh language agent against the frozen vision agent + codebook on `spec`;
    in-batch accuracy on held-out pairs every probe_eval_every steps."""
    size, device = image_size_of(model, config), args.device
    student = fresh_language_agent(model, args.probe_seed).to(device)
    student.eval()  # no dropout; vision statistics stay fixed
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.probe_lr, weight_decay=0.0)
    # Choice: one fixed scale for every checkpoint, not each one's learnt scale (CLIP ~17, IL ~23 on
    # shapes): the scale sets how sharp the student's softmax is, hence its effective step size, so
    # probing each checkpoint at its own scale would compare scales, not representations. 1/0.07: a
    # fresh CLIP's start.
    scale = args.probe_logit_scale
    train, val = probe_batches(spec, kw, tok, size, args)
    with torch.no_grad():
        val_img = [student.encode_image(data.normalize_images(b["image"], device)) for b in val]

    def evaluate():
        with torch.no_grad():
            accs = [in_batch_accuracy(vi, student.encode_text(b["text"].to(device)))
                    for vi, b in zip(val_img, val)]
        return pct(sum(accs) / len(accs))
    curve = [(0, evaluate())]
    for step in lifecycle.progress(range(1, args.probe_steps + 1), desc="easy-to-learn",
                                   disable=args.no_progress, leave=False):
        batch = next(train)
        with torch.no_grad():
            img = student.encode_image(data.normalize_images(batch["image"], device))
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


def curve_auc(curve, n):
    """Learning speed: the mean accuracy over the evaluation points after 1..n probe steps (the
    normalised area under the curve there; step 0, before any learning, is left out)."""
    accs = [a for s, a in curve if 0 < s <= n]
    return round(sum(accs) / len(accs), 2)


def probe_result(curve, args):
    return {"final": curve[-1][1], "auc": curve_auc(curve, args.probe_auc_steps),
            "curve": [{"step": s, "acc": a} for s, a in curve]}


def bench_easy_to_learn(args, model, tok, config):
    """The Fig. 5 probe for --ckpt and every --compare_ckpts checkpoint, all on the same
    --probe_data (default: --ckpt's training data), the same student seed and logit scale;
    with --probe_generations also for each checkpoint's gen{g}/ snapshots (Fig. 5: one curve
    per generation)."""
    spec, kw = analysis_data(args, config, "probe_data")
    runs = {run_name(args.ckpt or args.init): (args.ckpt, model, tok, config)}
    for path in compare_ckpts(args):
        runs[run_name(path)] = (path, *load_checkpoint(path, args))
    out, curves = {}, {}
    for name, (path, m, t, c) in runs.items():
        final = easy_to_learn_curve(m, t, c, args, spec, kw)
        gens = []
        for snap_path in generation_snapshots(path) if args.probe_generations else []:
            snap = load_snapshot(snap_path, m, path, args)
            # the last snapshot is often the final weights
            a, b = snap.state_dict(), m.state_dict()
            same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            curve = final if same else easy_to_learn_curve(snap, t, c, args, spec, kw)
            snap_name = os.path.relpath(snap_path, out_dir_of(path))
            gens.append({"snapshot": snap_name} | probe_result(curve, args))
            curves[f"{name}: {snap_name}/ snapshot"] = curve
        curves[f"{name}: final weights"] = final
        out[name] = probe_result(final, args) | ({"generations": gens} if gens else {})
    png = os.path.join(args.plot_dir, "easy_to_learn.png")
    draw_line_plot(png, curves, "easy-to-learn probe: a fresh language agent against the frozen "
                   "vision agent (Fig. 5)", "probe step (optimizer steps)",
                   "held-out in-batch accuracy (%)")
    return out | {"data": spec, "png": png, "seed": args.probe_seed, "steps": args.probe_steps,
                  "logit_scale": args.probe_logit_scale, "auc_steps": args.probe_auc_steps}


# -----------------------------------------------------------------------------
# PNGs, drawn with matplotlib (lifecycle's figure helpers); each function returns its Figure

MARKERS, DASHES = "osD^vP*X", ["-", "--", "-.", ":"]


def draw_line_plot(path, series, title, xlabel, ylabel):
    """series: {name: [(x, y), ...]} -> a line plot; x counts something (steps, generations):
    whole-number ticks. Series that coincide (a last snapshot is the final weights) stay apart to
    the eye: each has its own marker and dash, and each later one is drawn thinner, on top."""
    fig, ax = lifecycle.new_figure((9, 4.2))
    for k, (name, pts) in enumerate(series.items()):
        lifecycle.plot_series(ax, name, [p[0] for p in pts], [p[1] for p in pts],
                              marker=MARKERS[k % len(MARKERS)], markevery=max(1, len(pts) // 25),
                              linestyle=DASHES[k % len(DASHES)], linewidth=max(0.8, 2.4 - 0.4 * k),
                              markersize=max(3.0, 7.0 - k), markerfacecolor="none")
    # values, not offsets from one: close values read apart
    ax.ticklabel_format(axis="y", useOffset=False)
    lifecycle.finish_axes(ax, title, xlabel, ylabel)
    return lifecycle.save_figure(fig, path)


def draw_image_grid(path, rows, title):
    """rows: [(label, [PIL images])] -> one row of images per label, the label to its left."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    cols = max((len(ims) for _, ims in rows), default=1)
    width = 1.6 + 1.1 * cols
    # a narrow grid wraps its title, never cuts it
    title = "\n".join(textwrap.wrap(title, int(width * 12)))
    height = 0.2 + 0.2 * title.count("\n") + 1.1 * max(1, len(rows))
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(max(1, len(rows)), cols, squeeze=False)
    for r, (label, ims) in enumerate(rows):
        axes[r][0].set_ylabel(label, rotation=0, ha="right", va="center", fontsize=9)
        for c, ax in enumerate(axes[r]):
            ax.set_xticks([])
            ax.set_yticks([])
            if c < len(ims):
                ax.imshow(ims[c].convert("RGB"))
            else:
                ax.set_axis_off()
    fig.suptitle(title, fontsize=10)
    return lifecycle.save_figure(fig, path)


# -----------------------------------------------------------------------------
# Results over seeds of il_clip.py runs (the statistics are lifecycle.summarize_runs')

def shapes_percent(res):
    """il_clip.py's end-of-run shapes results (evaluate_shapes, shapes_eval.json) -> {metric:
    percent} with sugarcrepe_mean. Percent is told by key: the percent results carry sugarcrepe_mean
    (reporting's names); those written before (fractions) have none, and are scaled."""
    res = {k: v for k, v in res.items() if k != "scored"}       # the metrics, not what was scored
    if "sugarcrepe_mean" not in res:
        res = {k: 100 * v for k, v in res.items()}
        res["sugarcrepe_mean"] = sum(res[c] for c in data.SHAPES_CATEGORIES) / 7
    return res


def shapes_run(folder: str):
    """(method, seed, results as fractions, what lifecycle.summarize_runs takes) of an il_clip.py
    out_dir with shapes_eval.json, else None; a fork's runs are a group of their own ("codebook
    il_clip_top8.py"), paired with the original's by seed. With the easy-to-learn probe's output in
    probe.json (--benchmarks easy_to_learn --out RUN/probe.json), also its held-out accuracy at step
    20, its `auc` (learning speed, Fig. 5's slope) and its accuracy at the last step."""
    res_path, cfg_path = (os.path.join(folder, "shapes_eval.json"),
                          os.path.join(folder, "config.json"))
    if not (os.path.isfile(res_path) and os.path.isfile(cfg_path)):
        return None
    cfg, res = lifecycle.read_json(cfg_path), shapes_percent(lifecycle.read_json(res_path))
    probe_path = os.path.join(folder, "probe.json")
    if os.path.isfile(probe_path):
        probe = lifecycle.read_json(probe_path).get("results", {}).get("easy_to_learn", {})
        runs = [r for r in probe.values() if isinstance(r, dict) and "curve" in r]
        at = {p["step"]: p["acc"] for p in runs[0]["curve"]} if len(runs) == 1 else {}
        if 20 not in at:    # another run's curves (--compare_ckpts), or no evaluation at step 20
            raise data.DataError(f"{probe_path}: not one easy_to_learn curve with step 20 "
                                 "(probe this run alone, --probe_eval_every dividing 20)")
        res |= {"probe_step20": at[20], "probe_final": runs[0]["curve"][-1]["acc"]}
        if "auc" in runs[0]:    # probe.json from before the auc was written has none
            res["probe_auc"] = runs[0]["auc"]
    script = cfg.get("script", {}).get("name") if isinstance(cfg.get("script"), dict) else None
    fork = f" {script}" if isinstance(script, str) and script != "il_clip.py" else ""
    return (cfg.get("method", folder) + ("+neg" if cfg.get("negatives") else "") + fork,
            cfg.get("seed", folder), {k: v / 100 for k, v in res.items()})


def summarize_runs(root: str, baseline: str | None = None, read_run=shapes_run) -> dict:
    """lifecycle.summarize_runs over il_clip.py run folders (shapes_eval.json, probe.json)."""
    return lifecycle.summarize_runs(root, read_run, baseline)


# -----------------------------------------------------------------------------
# Report

# counts and settings: kept in the JSON, left out of the table (counts get their own columns)
META_KEYS = {"n", "n_scored", "n_skipped", "n_train_skipped", "n_per_category", "n_images",
             "n_captions", "n_train", "n_test", "classes", "templates", "layers", "seed", "steps",
             "weight_decay", "spectral_norms", "curve", "codes", "png", "generations", "over",
             "reason", "logit_scale", "auc_steps"}


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
                # add_obj, not add_obj.acc
                name = prefix[:-1] if k == "acc" and prefix else f"{prefix}{k}"
                rows.append((bench, name, x, v.get("n_scored", ""), v.get("n_skipped", ""),
                             v.get("reason", "")))
    for bench, r in results.items():
        walk(bench, "", r)
    return rows


NOT_PERCENT = ("log10_", "n_", "active_codes", "usage")   # numbers of the table that are not scores


def markdown_table(results, skipped, errors):
    lines = ["| benchmark | metric | value | scored | skipped |", "|---|---|---|---|---|"]
    for bench, metric, v, n_ok, n_bad, why in flatten(results):
        if v is None:
            value = f"null ({why})" if why else "null"
        else:
            value = (v if isinstance(v, int) or metric.split(".")[-1].startswith(NOT_PERCENT)
                     else lifecycle.percent(v))
        lines.append(f"| {bench} | {metric} | {value} | {n_ok} | {n_bad} |")
    for label, whys in (("not run", skipped), ("ERROR", errors)):
        lines += [f"| {bench} | {label} | {' '.join(why.split()).replace('|', '/')} | | |"
                  for bench, why in whys.items()]
    return "\n".join(lines)


def run_benchmarks(args, emb, model, tok, config):
    """(results, skipped, errors). A benchmark whose files were not given is skipped; one that
    fails (any exception: a hostile file, a checkpoint it cannot load, a bug), or scored no
    item at all, is an error: its line is printed now, the others still run, the table shows
    the reason and the exit status says so at the end."""
    scorers = ({"shapes": bench_shapes, "sugarcrepe": bench_sugarcrepe, "crepe": bench_crepe,
                "cola": bench_cola, "winoground": bench_winoground, "zeroshot": bench_zeroshot,
                "retrieval": bench_retrieval, "linear_probe": bench_linear_probe}
               | {f"zeroshot/{n}": bench_zeroshot_set(n)
                  for n in getattr(args, "zeroshot_sets", {})})
    analyses = {"easy_to_learn": bench_easy_to_learn, "spectral": bench_spectral,
                "codebook": bench_codebook}
    results, skipped, failed = {}, {}, {}
    for name in lifecycle.progress(args.benchmark_list, desc="benchmarks", unit="item",
                                   disable=args.no_progress or len(args.benchmark_list) < 2):
        try:
            results[name] = (scorers[name](args, emb) if name in scorers
                             else analyses[name](args, model, tok, config))
            if n_scored(results[name]) == 0:
                raise data.DataError("scored nothing: no item could be read (see the "
                                     "warnings above)")
        except Skip as e:
            skipped[name] = str(e)
            tqdm.write(f"skipped {name}: {e}", file=sys.stderr)
        except Exception as e:  # noqa: BLE001: one benchmark never sinks the others
            user_error = isinstance(e, (data.DataError, ConfigError))
            failed[name] = str(e) if user_error else f"{type(e).__name__}: {first_line(e)}"
            tqdm.write(f"error: {name}: {failed[name]}", file=sys.stderr)
    return results, skipped, failed


def run(args):
    t0 = time.time()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    path = args.ckpt or args.init
    model, tok, config = load_checkpoint(path, args, args.script)
    lifecycle.start_line(__file__, path, [
        f"benchmarks {','.join(args.benchmark_list)}",
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters",
        f"{args.device} x 1", f"out {args.out or 'the table only'}"])
    quick_gelu = bool(model_field(model, config, "quick_gelu"))
    # "assumed": the script's load_model said so
    source = config.get("quick_gelu_source", "config")
    if args.plot_dir is None:
        args.plot_dir = (os.path.dirname(args.out) if args.out
                         else out_dir_of(args.ckpt) if args.ckpt
                         # as given: the done line names the files so
                         else os.path.dirname(args.init)) or "."
    emb = Embedder(model, tok, image_size_of(model, config), args.batch_size, args.device,
                   not args.no_progress)
    results, skipped, failed = run_benchmarks(args, emb, model, tok, config)
    print(markdown_table(results, skipped, failed))
    blob = {"checkpoint": os.path.abspath(path), "script": config.get("script_used"),
            "quick_gelu": quick_gelu, "quick_gelu_source": source, "results": results,
            "skipped": skipped, "errors": failed, "args": {k: v for k, v in vars(args).items()
                                                           if k != "benchmark_list"}}
    if getattr(args, "zeroshot_suite", None):
        blob["zeroshot_suite"] = zeroshot_suite_row(results, failed)
        print(f"\nIL-CLIP paper, Table 2 (zero-shot top-1):\n{suite_table(blob['zeroshot_suite'])}")
    if args.out:
        # a full disk (quota, size limit, I/O error): one line, no half file left
        with lifecycle.writing(args.out):
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            lifecycle.atomic_write(args.out, lambda p: lifecycle.save_json(p, blob))
    files = ([args.out] * bool(args.out) + [r["png"] for r in results.values()
                                            if isinstance(r, dict) and "png" in r])
    lifecycle.done_line(f"{len(results)} of {len(args.benchmark_list)} benchmarks scored"
                        + (f", {len(failed)} failed" if failed else ""), time.time() - t0, files)
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
