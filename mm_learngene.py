"""
mm_learngene.py -- MM-LG (Chen et al., "Extracting Multimodal Learngene in CLIP"), the first
public implementation, plus the learngene baselines it is compared with (He-LG, TLEG).

  extract   distil an ancestry CLIP (--init: il_clip.py out_dir or OpenAI-layout weights) into a
            weight-shared auxiliary CLIP-ViT-S whose layers are built from the learngene (two block
            groups theta1, theta2 of {vision, language, multimodal} blocks plus coefficient vectors
            c^v, c^l, c^mv, c^ml); writes learngene.safetensors.
  expand    learngene -> a normal descendant (CLIP or vision tower, any depth up to 2x the unique
            layers) in OpenAI state-dict layout, as an out_dir that il_clip.py loads.
  finetune  activation (short contrastive training on 10% of the learngene's extraction data, one
            epoch) then fine-tuning with Table 6's settings: retrieval (I2T/T2I R@1), classification
            (top-1) or captioning (--task caption: ClipCap mapper into a frozen GPT-2; BLEU,
            CIDEr-D, ROUGE-L against every reference, 5 per shapes image; --baselines adds the best
            constant and the nearest-neighbour caption). Whole eval splits by default. Baselines:
            --init scratch, --init <il_clip out_dir> (PT-FT), He-LG and TLEG descendants (extract
            --method helg|tleg); Table 4's ablations: expand --part no_mm|only_mm.
  report    parameter storage and pre-training cost (Table 3); finetune results side by side.

Reads top to bottom: config -> model -> learngene parametrisations -> losses -> training loop ->
subcommands -> main, then one short section of infrastructure: what a checkpoint holds; the run
lifecycle itself (checkpoints, the out_dir lock, --resume / --overwrite, signals, write errors) is
lifecycle.py's. The only repo imports are data.py and lifecycle.py; a checkpoint that records
another training script is read with that script's load_model (by bare name, or --script PATH).

Every choice the paper leaves open is marked "CHOICE:" next to the equation it concerns.
"""
import argparse
import collections
import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import pathlib
import random
import signal
import sys
import time
import types
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

import data
import lifecycle

if dist.is_available():
    # Imported before any process group exists: these functions take `group=group.WORLD` as a
    # default, evaluated on import. Imported later (DDP does, through torch._dynamo), the defaults
    # hold the group past destroy_process_group, so its gloo worker threads run on into interpreter
    # exit, where one freeing a Python tensor aborts the process ("terminate called without an
    # active exception").
    import torch.distributed.nn.functional  # noqa: F401


class ConfigError(data.DataError):
    """User-facing configuration / input problem: printed as `error: ...`, exit code 2."""


# -----------------------------------------------------------------------------
# Config

@dataclass
class ModelConfig:
    """Same field names as il_clip.ModelConfig (the subset a plain CLIP needs)."""
    embed_dim: int = 128
    image_size: int = 64
    patch_size: int = 8
    vision_width: int = 128
    vision_layers: int = 12
    vision_heads: int = 4
    context_length: int = 77
    vocab_size: int = 1000
    text_width: int = 128
    text_layers: int = 12
    text_heads: int = 4
    eot_token_id: int = 2
    quick_gelu: bool = False


# Auxiliary model presets. Paper (appendix A.1): ViT-S, width 384, 6 heads, 12 layers.
# `shapes` is the CPU-sized default for the built-in data; both towers share width/heads so
# the vision, language and multimodal blocks have the same shapes.
AUX_PRESETS = {
    "shapes": dict(width=128, heads=4, layers=12, patch_size=8, embed_dim=128),
    "ViT-S-16": dict(width=384, heads=6, layers=12, patch_size=16, embed_dim=384),
}

# Table 6 (appendix A.3), the defaults when --data is not shapes: (lr, weight decay, warm-up steps,
# global batch, epochs) for extraction and each fine-tuning task. Captioning's weight decay is blank
# in the table; 0.01 like the others is a CHOICE. The table leaves open the optimizer, its betas and
# the decay after warm-up: CHOICE AdamW(0.9, 0.98, eps 1e-6), weight decay on matrices only, cosine
# decay to lr/10 (make_optimizer, get_lr).
TABLE6 = {"extract": (1e-3, 0.1, 10_000, 512, 32), "retrieval": (5e-5, 0.01, 10_000, 256, 50),
          "classification": (1e-4, 0.01, 5_000, 256, 500), "caption": (2e-5, 0.01, 5_000, 256, 10)}
# On shapes: Table 6's lr and weight decay with CPU-sized steps, batch and warm-up
SHAPES_SIZED = {"extract": {"max_steps": 500, "batch_size": 64, "warmup": 50},
                "finetune": {"max_steps": 300, "batch_size": 64, "warmup": 30}}

# The Linear weights and biases of one transformer layer: the "theta" of the paper
# ("the entirety of weights and biases of linear processes for MSA and MLP", Sec. 3.1).
LINEAR_NAMES = ["attn.in_proj_weight", "attn.in_proj_bias",
                "attn.out_proj.weight", "attn.out_proj.bias",
                "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"]
LN_NAMES = ["ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias"]
TOWERS = ("visual", "text")
MODALITY_TOWERS = {"clip": TOWERS, "vision": ("visual",), "text": ("text",)}   # expand --modality
# tower -> (unimodal block name, unimodal coefficient, multimodal coefficient), Eq. 1 and Eq. 2
TOWER_PARTS = {"visual": ("vision", "v", "mv"), "text": ("language", "l", "ml")}
LEARNGENE_PREFIXES = ("learngene.", "shared_ln.", "tleg.")

# -----------------------------------------------------------------------------
# Model: OpenAI CLIP layout (copied from il_clip.py's design on purpose: this script is
# forked on its own). One functional block so the weight-shared auxiliary model, the
# learngene expansion and the normal descendants run exactly the same arithmetic.


def attention(q, k, v, heads: int, causal: bool):
    """Multi-head SDPA on [B, T, W] queries, keys and values (also GPT-2's, below)."""
    B, T, W = q.shape
    q, k, v = (t.view(B, T, heads, W // heads).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2).reshape(B, T, W)


def block_fn(x, p: dict, heads: int, causal: bool, quick_gelu: bool):
    """Pre-LN transformer layer on [B, T, W] with parameters `p` in OpenAI key names."""
    W = x.shape[-1]
    h = F.layer_norm(x, (W,), p["ln_1.weight"], p["ln_1.bias"], 1e-5)
    q, k, v = F.linear(h, p["attn.in_proj_weight"], p["attn.in_proj_bias"]).split(W, dim=-1)
    x = x + F.linear(attention(q, k, v, heads, causal), p["attn.out_proj.weight"],
                     p["attn.out_proj.bias"])
    h = F.layer_norm(x, (W,), p["ln_2.weight"], p["ln_2.bias"], 1e-5)
    h = F.linear(h, p["mlp.c_fc.weight"], p["mlp.c_fc.bias"])
    h = h * torch.sigmoid(1.702 * h) if quick_gelu else F.gelu(h)
    return x + F.linear(h, p["mlp.c_proj.weight"], p["mlp.c_proj.bias"])


class Block(nn.Module):
    """Parameter container of one layer (OpenAI names); `ln=False` gives a learngene theta."""

    def __init__(self, w, ln=True):
        super().__init__()
        self.attn, self.mlp = nn.Module(), nn.Module()
        self.attn.in_proj_weight = nn.Parameter(torch.empty(3 * w, w))
        self.attn.in_proj_bias = nn.Parameter(torch.zeros(3 * w))
        self.attn.out_proj = nn.Linear(w, w)
        self.mlp.c_fc, self.mlp.c_proj = nn.Linear(w, 4 * w), nn.Linear(4 * w, w)
        if ln:
            self.ln_1, self.ln_2 = nn.LayerNorm(w), nn.LayerNorm(w)

    def params(self) -> dict:
        return dict(self.named_parameters())


def init_block(b: Block, width: int, layers: int, gen=None):
    """OpenAI CLIP init (attn std w^-1/2, proj std w^-1/2 (2L)^-1/2, fc std (2w)^-1/2).
    CHOICE: Linear biases start at zero (OpenAI leaves PyTorch's uniform default)."""
    attn_std, proj_std, fc_std = width ** -0.5, width ** -0.5 * (2 * layers) ** -0.5, (2 * width) ** -0.5
    with torch.no_grad():
        for t, std in ((b.attn.in_proj_weight, attn_std), (b.attn.out_proj.weight, proj_std),
                       (b.mlp.c_fc.weight, fc_std), (b.mlp.c_proj.weight, proj_std)):
            t.copy_(torch.randn(t.shape, generator=gen) * std)
        for t in (b.attn.in_proj_bias, b.attn.out_proj.bias, b.mlp.c_fc.bias, b.mlp.c_proj.bias):
            t.zero_()
    return b


def transformer_stack(width: int, layers: int) -> nn.Module:
    """OpenAI's `transformer.resblocks`: `layers` blocks, OpenAI-initialised."""
    stack = nn.Module()
    stack.resblocks = nn.ModuleList(Block(width) for _ in range(layers))
    for b in stack.resblocks:
        init_block(b, width, layers)
    return stack


class VisionTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        w, self.cfg = cfg.vision_width, cfg
        scale = w ** -0.5
        grid = cfg.image_size // cfg.patch_size
        self.conv1 = nn.Conv2d(3, w, cfg.patch_size, cfg.patch_size, bias=False)
        self.class_embedding = nn.Parameter(scale * torch.randn(w))
        self.positional_embedding = nn.Parameter(scale * torch.randn(grid * grid + 1, w))
        self.ln_pre = nn.LayerNorm(w)
        self.transformer = transformer_stack(w, cfg.vision_layers)
        self.ln_post = nn.LayerNorm(w)
        self.proj = nn.Parameter(scale * torch.randn(w, cfg.embed_dim))

    def forward(self, images, layers=None, all_tokens=False):
        """Pooled CLS feature after ln_post (before proj); `all_tokens`: every token after ln_post
        [B, 1 + grid^2, W]. `layers`: list of per-layer param dicts (the auxiliary model's computed
        layers); None = this module's own resblocks."""
        x = self.conv1(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1), x], 1) + \
            self.positional_embedding
        x = self.ln_pre(x)
        for p in layers if layers is not None else [b.params() for b in self.transformer.resblocks]:
            x = block_fn(x, p, self.cfg.vision_heads, False, self.cfg.quick_gelu)
        return self.ln_post(x if all_tokens else x[:, 0])


class TextTransformer(nn.Module):
    """The text tower with OpenAI's top-level key names: CLIP subclasses it to keep that layout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        w, self.cfg = cfg.text_width, cfg
        self.token_embedding = nn.Embedding(cfg.vocab_size, w)
        self.positional_embedding = nn.Parameter(torch.empty(cfg.context_length, w))
        self.transformer = transformer_stack(w, cfg.text_layers)
        self.ln_final = nn.LayerNorm(w)
        self.text_projection = nn.Parameter(torch.randn(w, cfg.embed_dim) * w ** -0.5)
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)

    def text_features(self, text, layers=None):
        x = self.token_embedding(text) + self.positional_embedding[: text.shape[1]]
        for p in layers if layers is not None else [b.params() for b in self.transformer.resblocks]:
            x = block_fn(x, p, self.cfg.text_heads, True, self.cfg.quick_gelu)
        x = self.ln_final(x)
        # EOT pooling (contract): first position equal to eot_token_id
        return x[torch.arange(x.shape[0], device=x.device),
                 (text == self.cfg.eot_token_id).int().argmax(-1)]

    def layer_list(self, tower):  # the auxiliary model overrides this
        return None

    def encode_text(self, text):
        return F.normalize(self.text_features(text, self.layer_list("text"))
                           @ self.text_projection, dim=-1)


def capped_scale(model):
    """exp(logit_scale) capped at 100 (CLIP Sec. 2.5: "clipped to prevent scaling the logits by more
    than 100"), also for loaded weights whose scale was stored above ln 100."""
    return model.logit_scale.exp().clamp(max=100.0)


class CLIP(TextTransformer):
    """OpenAI-layout CLIP: text keys at top level, `visual.*`, `logit_scale`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.visual = VisionTransformer(cfg)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def encode_image(self, images):
        return F.normalize(self.visual(images, self.layer_list("visual"))
                           @ self.visual.proj, dim=-1)

    def forward(self, images, text):
        return self.encode_image(images), self.encode_text(text), capped_scale(self)


# -----------------------------------------------------------------------------
# Learngene parametrisations of the auxiliary model (paper Sec. 3.1, Fig. 3)
#
# INDEX MAPPING (paper Eq. 1-2, Fig. 3a). The two groups are "used alternately and repeatedly,
# one group is shared twice and then switched", and "every weight scalar element [of a coefficient
# vector of length L/2] is shared twice prior to the next one". With 0-indexed layers i = 0..L-1:
#     group g = (i // 2) % 2      coefficient k = i // 2
#     L = 12:  i  0  1  2  3  4  5  6  7  8  9 10 11
#              g  0  0  1  1  0  0  1  1  0  0  1  1      (0 = theta1, 1 = theta2)
#              k  0  0  1  1  2  2  3  3  4  4  5  5
# The paper's example "layer 6: group 2, coefficient 3" is i = 6 -> g = 1 (theta2), k = 3 with
# 1-indexed group names. Layers 2k and 2k+1 are identical, so only L/2 are distinct: unique layer k
# uses (g = k % 2, c[k]), the 6-layer descendant of Fig. 3b.


def aux_index(i: int) -> tuple:
    """Auxiliary layer i -> (block group g, coefficient index k). Paper Eq. 1-2 / Fig. 3a."""
    return (i // 2) % 2, i // 2


def expand_order(n: int, unique: int) -> list:
    """Descendant depth n -> which unique layer each of its layers copies (paper Sec. 3.3):
    "replicate each of the first n-6 layers once and connect them in sequence" (8 ->
    [0,0,1,1,2,3,4,5]; 12 -> [0,0,1,1,...,5,5] = the auxiliary model). CHOICE: n < unique keeps the
    first n unique layers (the paper only builds 6, 8, 12)."""
    if n < 1:
        raise ConfigError(f"--layers must be >= 1, got {n}")
    if n > 2 * unique:
        raise ConfigError(f"--layers {n}: a learngene with {unique} unique layers fills at most "
                          f"{2 * unique} layers (each unique layer is replicated at most once)")
    if n <= unique:
        return list(range(n))
    rep = n - unique
    return [k for k in range(rep) for _ in (0, 1)] + list(range(rep, unique))


def mmlg_learngene(w: int, L: int, part: str) -> nn.Module:
    """theta1, theta2 = {vision, language, multimodal} blocks (Linear weights only) and the
    coefficient vectors c^v, c^l, c^mv, c^ml of length L/2 (paper Sec. 3.1)."""
    uni, mm = part != "only_mm", part != "no_mm"
    names, coefs = (["vision", "language"] * uni + ["multimodal"] * mm,
                    ["v", "l"] * uni + ["mv", "ml"] * mm)
    lg = nn.Module()
    for g in ("theta1", "theta2"):
        setattr(lg, g, nn.ModuleDict({n: Block(w, ln=False) for n in names}))
        for b in getattr(lg, g).values():
            init_block(b, w, L)
    # CHOICE (init of c, not given by the paper): with both parts 1/sqrt(2) each, so c*theta +
    # c'*theta^m of two independent OpenAI-initialised blocks has the variance of one; with a single
    # part 1. Coefficients get no weight decay (it would pull them, and with them every layer,
    # towards zero).
    c0 = 1.0 if part != "both" else 2 ** -0.5
    lg.coef = nn.ParameterDict({c: nn.Parameter(torch.full((L // 2,), c0)) for c in coefs})
    return lg


def tleg_learngene(w: int, L: int) -> nn.ModuleDict:
    """TLEG: per tower two full blocks A, B (layer l of L = A + (l / L) B)."""
    tleg = nn.ModuleDict({t: nn.ModuleDict({"A": Block(w), "B": Block(w)}) for t in TOWERS})
    for t in TOWERS:
        init_block(tleg[t]["A"], w, L)
        init_block(tleg[t]["B"], w, L)
        # CHOICE: B starts with the same random Linear init as A (so layers differ from step 0) and
        # zero LayerNorm gains/biases (LN of every layer starts as A's).
        for n in LN_NAMES:
            nn.init.zeros_(tleg[t]["B"].get_parameter(n))
    return tleg


class AuxCLIP(CLIP):
    """The auxiliary CLIP built from the learngene.

    method "mmlg" (paper): learngene.theta{1,2}.{vision,language,multimodal}.<linear names>,
      learngene.coef.{v,l,mv,ml} (length L/2), shared_ln.{visual,text}.ln_{1,2}.*; the towers' own
      resblocks are empty. Layer i, (g, k) = aux_index(i), of the vision tower (Eq. 1) and the
      language tower (Eq. 2):
        W_i^v = c^v[k] theta_g^v + c^mv[k] theta_g^m,   W_i^l = c^l[k] theta_g^l + c^ml[k] theta_g^m
      part "no_mm" drops the theta^m terms, part "only_mm" the theta^v, theta^l terms.
    method "tleg" (Xia et al. 2024b): per tower tleg.{visual,text}.{A,B} full blocks (Linear +
      LayerNorm), layer l of an L-layer stack = A + (l / L) * B.
    method "helg" (Wang et al. 2022): an ordinary CLIP distilled from the teacher; the learngene is
      its last `helg_layers` layers per tower (expand fills the rest randomly).
    Embeddings, ln_pre/post/final, projections and logit_scale are ordinary parameters, stored with
    it."""

    def __init__(self, cfg: ModelConfig, method="mmlg", part="both", helg_layers=3):
        L = cfg.vision_layers
        if cfg.vision_layers != cfg.text_layers or cfg.vision_width != cfg.text_width or L < 2 or L % 2:
            raise ConfigError("the auxiliary model needs both towers with the same width and the "
                              "same even depth")
        own = L if method == "helg" else 0
        super().__init__(dataclasses.replace(cfg, vision_layers=own, text_layers=own))
        self.aux_layers = L
        self.method = method
        self.part = part
        self.helg_layers = helg_layers
        self.cfg = dataclasses.replace(self.cfg, vision_layers=L, text_layers=L)
        w = cfg.vision_width
        if method == "mmlg":
            self.learngene = mmlg_learngene(w, L, part)
            # Paper: "The Layer Normalization part is shared in each Transformer layer";
            # CHOICE: one set per modality (the learngene holds the linear layers, not the norms).
            self.shared_ln = nn.ModuleDict({t: nn.ModuleDict({"ln_1": nn.LayerNorm(w),
                                                              "ln_2": nn.LayerNorm(w)})
                                            for t in TOWERS})
        elif method == "tleg":
            self.tleg = tleg_learngene(w, L)
        elif method != "helg":
            raise ConfigError(f"unknown --method {method}")

    # --- the layers of a stack of depth n built from the learngene ---------------------------
    def mmlg_layer(self, tower, g, k, part=None):
        """Eq. 1 / Eq. 2 for (group g, coefficient k). `part` (Table 4's ablations at
        initialisation) leaves a term out of the sum (see AuxCLIP); the kept term keeps its
        extracted coefficient."""
        part = part or self.part
        if part != self.part and self.part != "both":
            raise ConfigError(f"--part {part}: this learngene was extracted with part {self.part}")
        uni, cu, cm = TOWER_PARTS[tower]
        theta, coef = getattr(self.learngene, ("theta1", "theta2")[g]), self.learngene.coef
        terms = ([(coef[cu][k], theta[uni].params())] if part != "only_mm" else []) + \
            ([(coef[cm][k], theta["multimodal"].params())] if part != "no_mm" else [])
        # the same sum for the auxiliary forward and the expansion: n = 12 reproduces the auxiliary
        # model bit for bit
        p = {n: functools.reduce(torch.add, [c * t[n] for c, t in terms]) for n in LINEAR_NAMES}
        return {**p, **dict(self.shared_ln[tower].named_parameters())}

    def tleg_layer(self, tower, l, n):
        A, B = self.tleg[tower]["A"].params(), self.tleg[tower]["B"].params()
        return {name: A[name] + (l / n) * B[name] for name in LINEAR_NAMES + LN_NAMES}

    def layer_list(self, tower):
        """The auxiliary model's own L layers."""
        if self.method == "mmlg":
            return [self.mmlg_layer(tower, *aux_index(i)) for i in range(self.aux_layers)]
        if self.method == "tleg":
            return [self.tleg_layer(tower, l, self.aux_layers) for l in range(self.aux_layers)]
        return None

    def descendant_layers(self, tower, n, seed=0, part=None):
        """Per-layer param dicts of an n-layer descendant tower (paper Sec. 3.3)."""
        if n < 1:
            raise ConfigError(f"--layers must be >= 1, got {n}")
        # unique layer k = aux layers 2k and 2k+1: (g, k) = (k % 2, k), Fig. 3b
        if self.method == "mmlg":
            return [self.mmlg_layer(tower, k % 2, k, part)
                    for k in expand_order(n, self.aux_layers // 2)]
        if self.method == "tleg":  # TLEG: theta_l = theta_A + (l / n) theta_B, l = 0..n-1
            return [self.tleg_layer(tower, l, n) for l in range(n)]
        # He-LG: the last K layers of the distilled model on top of n-K random layers
        blocks = (self.visual.transformer.resblocks if tower == "visual"
                  else self.transformer.resblocks)
        kept = [b.params() for b in blocks[self.aux_layers - min(n, self.helg_layers):]]
        gen, w = torch.Generator().manual_seed(seed * 2 + (tower == "text")), self.cfg.vision_width
        return [init_block(Block(w), w, n, gen).params() for _ in range(n - len(kept))] + kept

    def learngene_numel(self) -> int:
        """Parameters of the learngene proper (blocks + coefficients; He-LG: kept layers)."""
        if self.method == "helg":
            per_layer = sum(p.numel() for p in self.transformer.resblocks[0].parameters())
            return 2 * min(self.helg_layers, self.aux_layers) * per_layer
        return sum(v.numel() for k, v in self.state_dict().items()
                   if k.startswith(("learngene.", "tleg.")))

    def meta(self) -> dict:
        return {"method": self.method, "part": self.part, "helg_layers": self.helg_layers,
                "model_config": dataclasses.asdict(self.cfg)}


def descendant_state(aux: AuxCLIP, n: int, modality: str, seed: int = 0, part=None) -> tuple:
    """Normal descendant state dict (OpenAI layout) + its ModelConfig. Paper Sec. 3.3:
    layers from the learngene; "components other than the learngene could be loaded directly
    like Embedding or Layer Normalization"; per-layer LNs = the shared ones (MM-LG)."""
    towers, sd = MODALITY_TOWERS[modality], {}
    with torch.no_grad():
        for k, v in aux.state_dict().items():
            if k.startswith(LEARNGENE_PREFIXES) or ".resblocks." in k:
                continue        # the layers are built from the learngene below
            tower = "visual" if k.startswith("visual.") else ("clip" if k == "logit_scale" else "text")
            # logit_scale: only a CLIP's
            if tower in towers or (tower == "clip" and modality == "clip"):
                sd[k] = v.clone()
        for tower in towers:
            prefix = "visual.transformer.resblocks." if tower == "visual" else "transformer.resblocks."
            for i, p in enumerate(aux.descendant_layers(tower, n, seed, part)):
                for name, t in p.items():
                    sd[f"{prefix}{i}.{name}"] = t.detach().clone().contiguous()
    cfg = dataclasses.replace(aux.cfg, vision_layers=n if "visual" in towers else 0,
                              text_layers=n if "text" in towers else 0)
    return sd, cfg


# -----------------------------------------------------------------------------
# Reading checkpoints: il_clip.py out_dirs, descendants, OpenAI-layout weight files


def weights_folder(path: str) -> str:
    """The folder whose config.json and tokenizer.json go with the weights at `path`."""
    return lifecycle.checkpoint_dir(path) if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def read_state(path: str) -> tuple:
    """(state dict, config dict or {}) of an out_dir, a checkpoint/ folder or an OpenAI-layout
    .safetensors / .pt, with the config.json beside it if there is one (a bare file: OpenAI's
    conventions, see infer_config)."""
    folder = weights_folder(path)
    if os.path.isdir(path):
        path = os.path.join(folder, "model.safetensors")
    cfg_path = os.path.join(folder, "config.json")
    cfg = lifecycle.read_json(cfg_path) if os.path.exists(cfg_path) else {}
    return lifecycle.read_weights(path), cfg    # "module." and extra keys dropped


def folder_tokenizer(path: str):
    """The data.Tokenizer saved beside the weights at `path`, or None."""
    folder = weights_folder(path)
    return data.Tokenizer.load(folder) if os.path.exists(os.path.join(folder, "tokenizer.json")) else None


def infer_config(sd: dict, cfg: dict, path: str, need=("visual", "text")) -> ModelConfig:
    """ModelConfig of OpenAI-layout weights (lifecycle.clip_hparams: shapes, and what config.json
    states); the towers not in `need` keep 0 layers."""
    hparams = lifecycle.clip_hparams(sd, path, cfg, need)
    return ModelConfig(**{"vision_layers": 0, "text_layers": 0, **hparams})


def recorded_model(path: str, quick_gelu=None, script=None):
    """(model, tokenizer or None, config dict) from the load_model of the script the checkpoint at
    `path` records ("script"), so a fork's checkpoint is read by the fork's model code; under
    lifecycle.find_script's trust rule (only by its bare name beside this file; `script`, --script,
    names any other file). None without a record."""
    cfg_path = os.path.join(weights_folder(path), "config.json")
    record = lifecycle.read_json(cfg_path).get("script") if os.path.isfile(cfg_path) else None
    if record is None and script is None:
        return None
    try:
        module = lifecycle.import_script(record, __file__, script)[0]
    except data.DataError as e:
        raise ConfigError(f"{path}: {e}") from None
    try:
        return module.load_model(path, device="cpu", quick_gelu=quick_gelu)
    except Exception as e:      # that script's ConfigError is a class of its own: one line here too
        if type(e).__name__ in ("ConfigError", "DataError"):
            raise ConfigError(str(e)) from None
        raise


def load_teacher(path: str, vocab=None, quick_gelu=None, script=None):
    """The frozen ancestry CLIP in eval mode: (model, tokenizer, ModelConfig), built by the
    load_model of the script the checkpoint records (or --script), else by this script's (used
    through encode_image, encode_text, logit_scale). A codebook-head teacher (il_clip --method
    codebook) is refused: its embeddings are not CLIP's."""
    model, tok, config = recorded_model(path, quick_gelu, script) or load_model(path, quick_gelu=quick_gelu)
    m = config.get("model") or {}
    if m.get("codebook_size"):
        method = config.get("method", "codebook")
        raise ConfigError(f"{path}: a codebook-head teacher (il_clip.py --method {method}) is not "
                          f"supported, its embeddings are not CLIP's: use an il_clip.py --method "
                          f"clip (or negclip) run, or OpenAI / open_clip weights")
    mcfg = ModelConfig(**{f.name: m[f.name] for f in dataclasses.fields(ModelConfig)
                          if f.name in m})
    if vocab:
        tok = data.build_tokenizer(vocab_path=vocab, context_length=mcfg.context_length)
    if tok is None:
        raise ConfigError(f"{path}: no tokenizer.json beside the teacher; pass --vocab "
                          f"bpe_simple_vocab_16e6.txt.gz")
    return model.eval().requires_grad_(False), tok, mcfg


def load_model(path, device="cpu", quick_gelu=None):
    """-> (CLIP in eval mode, tokenizer or None, config dict) of a CLIP descendant (expand
    --modality clip), a retrieval fine-tune's out_dir, an il_clip.py out_dir or OpenAI-layout
    weights: the contract eval_compositional.py calls (as il_clip.load_model); encode_image /
    encode_text give L2-normalised embeddings. `quick_gelu` None: what the open_clip_config.json /
    config.json beside the weights says, else OpenAI's QuickGELU, said on stderr."""
    sd, cfg = read_state(path)
    what = "learngene" if any(k.startswith(LEARNGENE_PREFIXES) for k in sd) else \
        cfg.get("modality", "clip") if cfg.get("task", "retrieval") == "retrieval" else \
        f"{cfg['task']} fine-tune"
    if what != "clip":
        raise ConfigError(f"{path}: a {what} model; evaluation needs both towers (a CLIP "
                          f"descendant, expand --modality clip, or a retrieval fine-tune)")
    weights = os.path.join(weights_folder(path), "model.safetensors") if os.path.isdir(path) else path
    quick_gelu, source = lifecycle.weights_activation(quick_gelu, weights)
    if source == "assumed":
        print(lifecycle.assumed_activation_note(path, trained=os.path.isdir(path)), file=sys.stderr)
    mcfg = dataclasses.replace(infer_config(sd, cfg, path), quick_gelu=quick_gelu)
    model = CLIP(mcfg)
    lifecycle.load_state(model, sd, path)
    return model.to(device).eval(), folder_tokenizer(path), {**cfg, "model": dataclasses.asdict(mcfg)}


def load_learngene(path: str, width=None) -> tuple:
    """AuxCLIP + metadata (incl. the tokenizer JSON) from learngene.safetensors."""
    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such learngene file")
    try:
        with safe_open(path, "pt") as f:
            meta, sd = f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
        info = json.loads(meta["learngene"])
    except Exception as e:
        raise ConfigError(f"{path}: not a learngene file written by mm_learngene.py "
                          f"({type(e).__name__})")
    cfg = ModelConfig(**info["model_config"])
    if width is not None and width != cfg.vision_width:
        raise ConfigError(f"{path}: learngene of width {cfg.vision_width}, expected width {width}")
    aux = AuxCLIP(cfg, info["method"], info["part"], info.get("helg_layers", 3))
    expected = aux.state_dict()
    for k, v in sd.items():
        if k in expected and expected[k].shape != v.shape:
            raise ConfigError(f"{path}: {k} has shape {tuple(v.shape)}, the file's config (width "
                              f"{cfg.vision_width}) needs {tuple(expected[k].shape)}: learngene "
                              f"from another width")
    missing, unexpected = aux.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ConfigError(f"{path}: learngene does not match its config (missing {missing[:1]}, "
                          f"unexpected {unexpected[:1]})")
    return aux, meta


# -----------------------------------------------------------------------------
# Losses (paper Eq. 3-8)


class _AllGather(torch.autograd.Function):
    """Every rank's rows in rank order; the backward sums each rank's gradient for these rows and
    returns it to their owner (open_clip's gather_with_grad). Both collectives are synchronous: with
    torch's asynchronous functional all-gather, 2-rank gloo runs died about 1 in 100 (heap
    corruption found in gloo's worker thread)."""

    @staticmethod
    def forward(ctx, x):
        out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
        # torch 2.13's name for all_gather_into_tensor
        dist.all_gather_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, g):
        out = g.new_empty((g.shape[0] // dist.get_world_size(), *g.shape[1:]))
        dist.reduce_scatter_single(out, g.contiguous())
        return out


def gather(x, grad: bool):
    """All ranks' rows, in rank order; with grad for the local model's features (_AllGather)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    return _AllGather.apply(x if grad else x.detach())


def clip_logits(img, txt, scale, grad=True):
    """Eq. 3, local rows against all ranks' columns: (i2t [B, BW], t2i [B, BW], labels)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    all_img, all_txt = gather(img, grad), gather(txt, grad)
    labels = torch.arange(img.shape[0], device=img.device) + rank * img.shape[0]
    return scale * img @ all_txt.t(), scale * txt @ all_img.t(), labels


def clip_loss(i2t, t2i, labels):
    """Eq. 4: L_CLIP = (CE(logit, I) + CE(logit^T, I)) / 2."""
    return 0.5 * (F.cross_entropy(i2t, labels) + F.cross_entropy(t2i, labels))


def soft_ce(student_logits, teacher_logits):
    """CE(logit^aux, logit^anc) of Eq. 5-6. CHOICE: soft-target cross-entropy, target
    softmax(teacher logits), row-wise, mean over rows, no extra distillation temperature (each
    model's own logit scale is its temperature)."""
    return -(teacher_logits.softmax(-1) * student_logits.log_softmax(-1)).sum(-1).mean()


@torch.no_grad()
def teacher_logits(teacher, images, text):
    """The frozen ancestry's (i2t, t2i) logits of Eq. 5-6, with its own logit scale, capped at 100
    as the student's."""
    t_i2t, t_t2i, _ = clip_logits(teacher.encode_image(images).float(),
                                  teacher.encode_text(text).float(),
                                  capped_scale(teacher).float(), grad=False)
    return t_i2t, t_t2i


def distill_loss(s_i2t, s_t2i, t_i2t, t_t2i):
    """Eq. 7: L_dist = (L_dist^i2t + L_dist^t2i) / 2."""
    return 0.5 * (soft_ce(s_i2t, t_i2t) + soft_ce(s_t2i, t_t2i))


# -----------------------------------------------------------------------------
# Training loop (nanoGPT conventions; shared by extract, activation and fine-tuning)


def setup_distributed(device_arg):
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = device_arg or ("cuda" if torch.cuda.is_available() else "cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda") and world > 1:
        device = f"cuda:{local}"
        torch.cuda.set_device(device)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return rank, world, device


def autocast(device, dtype):
    if device.startswith("cuda") and dtype == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_optimizer(model, lr, weight_decay, device):
    """AdamW(0.9, 0.98); weight decay on matrices only (not gains, biases, coefficients,
    class_embedding, logit_scale)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-6,
                             fused=device.startswith("cuda") or None)


def get_lr(step, max_steps, lr, warmup):
    """Linear warm-up then cosine decay to lr/10 (CHOICE: the paper gives warm-up only)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, max_steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def atomic_save_file(tensors, path, metadata=None):
    """A .safetensors outside the checkpoint set (learngene, descendant, final model) with its
    own metadata, written whole or not at all (lifecycle.atomic_write) and fsynced
    (lifecycle.fsync)."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    lifecycle.atomic_write(path, lambda tmp: lifecycle.fsync(
        tmp, lambda f: save_file(tensors, f, metadata=metadata)))


def atomic_write_json(obj, path):
    lifecycle.atomic_write(path, lambda tmp: lifecycle.save_json(tmp, obj))


class NonFiniteError(Exception):
    """Divergence: printed as one line, exit code 1; the last good checkpoint stays."""


def warmup_steps(warmup, max_steps, tag, rank):
    """--warmup (-1: 10% of the run). CHOICE: a warm-up longer than the run (Table 6's 10k steps on
    a small set) would never reach the peak lr, so it is cut to 10% of the run, said in one note."""
    if warmup > max_steps and rank == 0:
        print(f"note: {tag}: the warm-up of {warmup} steps is longer than the run ({max_steps} "
              f"steps); warming up for {max(1, max_steps // 10)} steps (10% of the run)",
              file=sys.stderr, flush=True)
    return max(1, max_steps // 10 if warmup < 0 or warmup > max_steps else warmup)


def agree_flags(bad, world, device, tag, done):
    """Every rank's non-finite flag and the signal it received (SIGTERM, SIGINT; 0: none), combined
    (MAX) over ranks. A signal reaches the ranks at different steps: agreeing here makes all of them
    stop at this same step, and none is left waiting in a collective the others have left. Returns
    the signal to stop for, or 0."""
    sig = lifecycle.stop_requested()
    flags = torch.stack([bad.float(),
                         torch.tensor(float(signal.Signals[sig] if sig else 0), device=device)])
    if world > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    bad, sig = flags.tolist()
    if bad:
        raise NonFiniteError(f"{tag}: non-finite loss at a step <= {done}; stopped, the last good "
                             f"checkpoint is kept")
    return int(sig)


PHASE_STYLE = {"extract": ("extraction loss (Eq. 8)", "tab:blue"),
               "activate": ("activation: CLIP loss", "tab:orange"),
               "finetune": ("fine-tuning loss", "tab:green")}
TERM_STYLE = {"clip": ("CLIP loss", "0.55"), "dist": ("distillation loss", "tab:red")}


def draw_loss_curve(out_dir, tag):
    """out_dir/loss_curve.png: the phase's training loss per logged step (its metrics.jsonl),
    labelled by phase, and its terms where it has more than one (extract: CLIP + distillation).
    Returns the Figure."""
    path = os.path.join(out_dir, "metrics.jsonl")
    with open(path) if os.path.isfile(path) else contextlib.nullcontext([]) as f:
        recs = [m for m in map(json.loads, filter(str.strip, f)) if "loss" in m]
    label, colour = PHASE_STYLE.get(tag, (tag, "tab:blue"))
    series = [(label, [(m["step"], m["loss"]) for m in recs], {"color": colour, "linewidth": 2})]
    if sum(k in TERM_STYLE for k in (recs[0] if recs else {})) > 1:
        series += [(name, [(m["step"], m[k]) for m in recs], {"color": c, "linewidth": 1})
                   for k, (name, c) in TERM_STYLE.items()]
    return lifecycle.draw_curves(os.path.join(out_dir, "loss_curve.png"),
                                 f"mm_learngene.py {tag}: training loss per logged step", series)


class StepLoss(nn.Module):
    """loss_fn(model, batch) as the forward() that DDP wraps, so every loss term runs inside it: a
    term that uses a parameter directly (a learnable bias, a weight penalty) gets its gradient
    averaged over ranks like the rest, and loss_fn sees the model itself with 1 rank or many.
    `touch` (under DDP): every trained parameter enters the loss, times 0, so one that a rank's step
    leaves unused (a fork's term, a branch some batches skip) gets a zero gradient there and DDP's
    buckets match on every rank. CHOICE: this, not find_unused_parameters, which walks the graph
    every step and warns when nothing is unused; the loss and the other gradients are unchanged."""

    def __init__(self, model, loss_fn, touch=False):
        super().__init__()
        self.model, self.loss_fn, self.touch = model, loss_fn, touch

    def forward(self, batch):
        loss, parts = self.loss_fn(self.model, batch)
        if self.touch:
            loss = loss + sum(p.reshape(-1)[0] for p in self.model.parameters()
                              if p.requires_grad) * 0.0
        return loss, parts


def log_record(out_dir, m):
    """One metrics.jsonl record (rank 0), also to --wandb, where a later phase logs after the
    earlier phases' steps."""
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        lifecycle.log_record(os.path.join(out_dir, "metrics.jsonl"), m, _wandb["run"],
                             m["step"] + _wandb["offset"])


def train_phase(model, loss_fn, loader, args, rank, world, device, max_steps, out_dir=None,
                config=None, tokenizer=None, tag="train", on_save=None, resume=False):
    """One training phase. `loss_fn(model, batch) -> (loss, {name: detached tensor})`, run inside
    DDP's forward when world > 1 (StepLoss). Nothing in a step waits for the device: the
    losses and a non-finite flag are read at log steps, save steps and --stop_at. Saves at
    multiples of --save_interval, at --stop_at, on SIGTERM / SIGINT and at the end. `resume`:
    continue from out_dir's checkpoint (True), or from one already read
    (lifecycle.load_checkpoint's)."""
    step_loss = StepLoss(model, loss_fn, touch=world > 1)
    ddp = nn.parallel.DistributedDataParallel(
        step_loss, device_ids=[device] if device.startswith("cuda") else None) \
        if world > 1 else step_loss
    fwd = torch.compile(ddp) if getattr(args, "compile", False) else ddp
    # the state of the phase that a checkpoint holds (save_run, load_run)
    run = types.SimpleNamespace(raw=model, opt=make_optimizer(model, args.lr, args.wd, device),
                                loader=loader, out_dir=out_dir, config=config or {},
                                tokenizer=tokenizer, tag=tag, rank=rank, on_save=on_save,
                                device=device, step=0, elapsed=0.0, newest_damaged=False)
    # no gradient carried over from an earlier phase (a resumed run starts without one)
    model.zero_grad(set_to_none=True)
    trained = [p for p in model.parameters() if p.requires_grad]
    if resume:
        load_run(run, None if resume is True else resume)
    elif out_dir and rank == 0 and os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
        # a fresh run into an old out_dir: a fresh log
        os.remove(os.path.join(out_dir, "metrics.jsonl"))
    it = loader.forever()
    warmup = warmup_steps(args.warmup, max_steps, tag, rank)
    bad = torch.zeros((), dtype=torch.bool, device=device)
    t0 = t_log = time.time()
    step_log = run.step
    bar = lifecycle.progress(range(run.step, max_steps), desc=tag, initial=run.step,
                             total=max_steps)
    # --wandb: one run per process; a phase (finetune after activate) logs after the earlier phases'
    # steps
    _wandb["offset"], _wandb["next"] = _wandb["next"], _wandb["next"] + max_steps
    for step in bar:
        lr = get_lr(step, max_steps, args.lr, warmup)
        for g in run.opt.param_groups:
            g["lr"] = lr
        batch = next(it)
        with autocast(device, args.dtype):
            loss, parts = fwd(batch)
        bad |= ~torch.isfinite(loss.detach())
        run.opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip > 0:     # the trained parameters only: a frozen one may hold a stale grad
            nn.utils.clip_grad_norm_(trained, args.grad_clip)
        run.opt.step()
        if hasattr(model, "logit_scale"):
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
        run.elapsed += time.time() - t0
        t0 = time.time()
        run.step = done = step + 1
        at_log = done % args.log_interval == 0 or done == max_steps
        at_save = (bool(out_dir) and args.save_interval > 0 and done % args.save_interval == 0
                   and done < max_steps)
        at_stop = (getattr(args, "stop_at", None) is not None and done == args.stop_at
                   and done < max_steps)
        # flags are read (a device sync) only where every rank reads them at the same step;
        # one process may stop at any step
        sig = (at_log or at_save or at_stop or (world == 1 and lifecycle.stop_requested())) and \
            agree_flags(bad, world, device, tag, done)
        if at_log:      # the global batch's losses: every rank's mean (equal local batches)
            vals = torch.stack([loss.detach().float(), *(v.float() for v in parts.values())])
            if world > 1:
                dist.all_reduce(vals)
            vals = (vals / world).tolist()
            sps = args.batch_size * (done - step_log) / max(1e-9, time.time() - t_log)
            t_log, step_log = time.time(), done
            rec = {"step": done, "phase": tag, "loss": vals[0], "lr": lr,
                   "time": round(time.time(), 3), "elapsed": round(run.elapsed, 3),
                   "samples_per_s": round(sps, 1), **dict(zip(parts, vals[1:]))}
            lifecycle.on_rank0(lambda: log_record(out_dir, rec), rank, world, device)
            bar.set_postfix(loss=f"{vals[0]:.4f}", lr=f"{lr:.2e}", refresh=False)
        if (sig and done < max_steps) or at_stop:
            # rank 0 has written before any rank exits
            lifecycle.on_rank0(lambda: save_run(run), rank, world, device)
            if rank == 0:
                cmd = lifecycle.resume_command(__file__, world, args.out_dir, getattr(args, "cmd", ""))
                lifecycle.stop_line(signal.Signals(sig).name if sig else "--stop_at", done,
                                    max_steps, cmd)
            sys.exit(0)
        if at_save:
            lifecycle.on_rank0(lambda: save_run(run), rank, world, device)
    bar.close()
    agree_flags(bad, world, device, tag, run.step)
    if out_dir:
        lifecycle.on_rank0(lambda: (save_run(run), draw_loss_curve(out_dir, tag)), rank,
                           world, device)
    return run


def contrastive_loss_fn(model, batch, device):
    img, txt, scale = model(data.normalize_images(batch["image"], device), batch["text"].to(device))
    i2t, t2i, labels = clip_logits(img, txt, scale)
    loss = clip_loss(i2t, t2i, labels)
    return loss, {"clip": loss.detach()}


# -----------------------------------------------------------------------------
# Data flags: --data, --image_root and the CSV flags travel together (recorded by extract and
# expand, read back by finetune's activation)

CSV_FLAGS = ("csv_img_key", "csv_caption_key", "csv_separator")
SOURCE_KEYS = ("data", "image_root") + CSV_FLAGS


def is_shapes(spec: str) -> bool:
    return spec == "shapes" or spec.startswith("shapes:")


def data_source(a) -> dict:
    return {k: getattr(a, k) for k in SOURCE_KEYS}


def recorded_source(a) -> dict:
    """data_source with --data and --image_root made absolute (shapes and the named presets
    stay names): the record in a learngene must name the same files from any working folder."""
    src = data_source(a)
    if not (is_shapes(src["data"]) or src["data"] in data.DATA_PRESETS):
        src["data"] = os.path.abspath(src["data"])
    if src["image_root"]:
        src["image_root"] = os.path.abspath(src["image_root"])
    return src


def table6_defaults(a, column: str):
    """Fill the flags left unset: Table 6's `column` off shapes; on shapes its lr and weight decay
    with SHAPES_SIZED steps, batch and warm-up. Off shapes an unset --max_steps follows from
    --epochs (train_steps)."""
    lr, wd, warmup, batch, epochs = TABLE6[column]
    if is_shapes(a.data):
        values = {"lr": lr, "wd": wd,
                  **SHAPES_SIZED["extract" if column == "extract" else "finetune"]}
        if a.epochs is not None:        # --epochs asked on shapes: the steps follow from it
            del values["max_steps"]
    else:
        values = {"lr": lr, "wd": wd, "warmup": warmup, "batch_size": batch, "epochs": epochs}
    for k, v in values.items():
        if getattr(a, k) is None:
            setattr(a, k, v)


def train_steps(a, loader, src: dict, rank: int, tag: str) -> int:
    """--max_steps, else --epochs over the training loader: ceil(epochs * samples / batch)."""
    if a.max_steps is not None:
        return a.max_steps
    return max(1, math.ceil(a.epochs * epoch_samples(loader, src, rank, tag) / a.batch_size))


def csv_options(a) -> dict:
    """The CSV flags in data.file_items / data.captions_for_tokenizer's names (img_key, ...)."""
    return {k.removeprefix("csv_"): getattr(a, k) for k in CSV_FLAGS}


def train_loader(a, src: dict, tok, image_size, rank, world, seed, ordered=False):
    """The training loader of data source `src` (data_source's keys), --batch_size split over
    the ranks; a CSV flag that is None (not recorded) takes data.make_loader's default.
    `ordered`: the training split in data order, every sample, eval transforms."""
    csv = {k: src[k] for k in CSV_FLAGS if src.get(k) is not None}
    return data.make_loader(src["data"], "train", 100 if ordered else a.batch_size // world, tok,
                            image_size, not ordered, rank, world, a.num_workers, seed,
                            drop_last=not ordered, image_root=src["image_root"], **csv)


# -----------------------------------------------------------------------------
# Subcommand: extract (paper Sec. 3.1-3.2)


def cmd_extract(a):
    t_start = time.time()
    table6_defaults(a, "extract")
    rank, world, device = setup_distributed(a.device)
    # before any write there
    lifecycle.claim_out_dir(a.out_dir, rank, world, device, a.resume, a.overwrite, RUN_FILES)
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    np.random.seed(a.seed)
    teacher, tok, tcfg = load_teacher(a.init, a.vocab, a.quick_gelu, a.script)
    teacher.to(device)
    preset = dict(AUX_PRESETS[a.model])
    for k in ("width", "heads", "layers"):
        if getattr(a, f"aux_{k}") is not None:
            preset[k] = getattr(a, f"aux_{k}")
    if preset["width"] % preset["heads"]:
        raise ConfigError(f"width {preset['width']} is not divisible by {preset['heads']} heads")
    if preset["layers"] < 2 or preset["layers"] % 2:
        raise ConfigError(f"--aux_layers must be even and >= 2 (two layers per coefficient), got "
                          f"{preset['layers']}")
    # The student sees the teacher's images and tokens: same image size and tokenizer.
    cfg = ModelConfig(embed_dim=preset["embed_dim"] if a.aux_width is None else preset["width"],
                      image_size=tcfg.image_size, patch_size=a.patch_size or preset["patch_size"],
                      vision_width=preset["width"], vision_layers=preset["layers"],
                      vision_heads=preset["heads"], context_length=tok.context_length,
                      vocab_size=tok.vocab_size, text_width=preset["width"],
                      text_layers=preset["layers"], text_heads=preset["heads"],
                      eot_token_id=tok.eot_id, quick_gelu=False)  # the student is a new model: GELU
    if cfg.image_size % cfg.patch_size:
        raise ConfigError(f"image size {cfg.image_size} is not a multiple of patch size "
                          f"{cfg.patch_size}")
    part = "no_mm" if a.no_mm else ("only_mm" if a.only_mm else "both")
    aux = AuxCLIP(cfg, a.method, part, a.helg_layers).to(device)
    loader = train_loader(a, data_source(a), tok, cfg.image_size, rank, world, a.seed)
    a.max_steps = train_steps(a, loader, data_source(a), rank, "extract")

    def loss_fn(model, batch):
        images, text = data.normalize_images(batch["image"], device), batch["text"].to(device)
        img, txt, scale = model(images, text)
        s_i2t, s_t2i, labels = clip_logits(img, txt, scale)
        t_i2t, t_t2i = teacher_logits(teacher, images, text)
        l_clip = clip_loss(s_i2t, s_t2i, labels)
        l_dist = distill_loss(s_i2t, s_t2i, t_i2t, t_t2i)
        # Eq. 8
        return l_clip + a.lambda_dist * l_dist, {"clip": l_clip.detach(), "dist": l_dist.detach()}

    config = {"args": run_flags(a), "world_size": world, **aux.meta(),
              "model": dataclasses.asdict(aux.cfg), "teacher_config": dataclasses.asdict(tcfg)}
    ckpt = lifecycle.load_checkpoint(a.out_dir, STATE_TYPES, rank=rank) if a.resume else None
    start_line(a, f"extract --method {a.method}", aux, device, world, loader, rank,
               [f"teacher {a.init} ({'QuickGELU' if tcfg.quick_gelu else 'GELU'})"],
               ckpt and f"step {ckpt[2]['step']}")
    _wandb["run"] = lifecycle.start_wandb(a.wandb, a.out_dir, config, a.resume) \
        if a.wandb and rank == 0 else None

    def write_learngene(tr):
        tok_json = pathlib.Path(a.out_dir, "tokenizer.json").read_text()
        meta = {"learngene": json.dumps(aux.meta()), "tokenizer": tok_json,
                "extract": json.dumps({"step": tr.step, "elapsed": tr.elapsed,
                                       "batch_size": a.batch_size, **recorded_source(a)})}
        atomic_save_file(aux.state_dict(), os.path.join(a.out_dir, "learngene.safetensors"), meta)

    train_phase(aux, loss_fn, loader, a, rank, world, device, a.max_steps, a.out_dir, config, tok,
                "extract", write_learngene, ckpt)
    if rank == 0:
        end_line(a, a.max_steps, t_start,
                 ["learngene.safetensors", "checkpoint/", "metrics.jsonl", "loss_curve.png"],
                 f", learngene parameters {aux.learngene_numel():,} (blocks + coefficients; "
                 f"{sum(p.numel() for p in aux.parameters()):,} with the non-learngene parts)")


# -----------------------------------------------------------------------------
# Subcommand: expand (paper Sec. 3.3, Fig. 3b)


def write_descendant(out_dir, sd, cfg, modality, tok_json, extra):
    os.makedirs(out_dir, exist_ok=True)
    atomic_save_file(sd, os.path.join(out_dir, "model.safetensors"))
    # "model": the ModelConfig fields, the layout il_clip.load_model reads
    atomic_write_json({"model": dataclasses.asdict(cfg), "modality": modality, **extra,
                       "script": lifecycle.script_record(__file__)},
                      os.path.join(out_dir, "config.json"))
    if tok_json is not None:    # the learngene's copy of the teacher's tokenizer.json, as written
        write = lambda tmp: lifecycle.fsync(tmp, lambda f: pathlib.Path(f).write_text(tok_json))
        lifecycle.atomic_write(os.path.join(out_dir, "tokenizer.json"), write)


def cmd_expand(a):
    t_start = time.time()
    if a.modality == "text":
        raise ConfigError("--modality text: no task of finetune trains a text-only descendant (the "
                          "paper's tasks are retrieval, classification and captioning); expand "
                          "--modality clip for a text tower")
    aux, meta = load_learngene(a.learngene, a.width)
    if a.part != "both" and aux.method != "mmlg":
        raise ConfigError(f"--part {a.part}: only an MM-LG learngene has a multimodal part to drop")
    part = aux.part if a.part == "both" else a.part
    out = a.out_dir or f"out/descendant_{aux.method}_{a.modality}{a.layers}"
    # runs fine-tuned from it
    if os.path.exists(os.path.join(out, "model.safetensors")) and not a.overwrite:
        raise ConfigError(f"{out} holds a descendant already (a fine-tune may name it as its "
                          f"--init): use another --out_dir, or --overwrite to replace it")
    lifecycle.claim_out_dir(out, 0, 1, "cpu", overwrite=a.overwrite, run_files=RUN_FILES)
    lifecycle.start_line(__file__, f"expand --layers {a.layers} --modality {a.modality}",
                         [f"learngene {a.learngene} ({aux.method})", f"part {a.part}"], out)
    sd, cfg = descendant_state(aux, a.layers, a.modality, a.seed, part)
    extract = json.loads(meta.get("extract", "{}"))
    write_descendant(out, sd, cfg, a.modality, meta.get("tokenizer"),
                     {"learngene": os.path.abspath(a.learngene), "method": aux.method, "part": part,
                      "extract_data": {k: extract.get(k) for k in SOURCE_KEYS},
                      "layers": a.layers, "layer_order": expand_order(a.layers, aux.aux_layers // 2)
                      if aux.method == "mmlg" else None})
    lifecycle.done_line(f"a {a.layers}-layer {a.modality} descendant, "
                        f"{sum(v.numel() for v in sd.values()):,} parameters",
                        time.time() - t_start,
                        [os.path.join(out, n) for n in ("model.safetensors", "config.json", "tokenizer.json")
                         if os.path.isfile(os.path.join(out, n))])


# -----------------------------------------------------------------------------
# Subcommand: finetune (paper appendix A.2)


class Classifier(nn.Module):
    """Vision tower + linear head on the pooled CLS feature after ln_post (CHOICE: before
    `proj`, as usual for ViT fine-tuning)."""

    def __init__(self, visual: VisionTransformer, n_classes: int):
        super().__init__()
        self.visual = visual
        # `proj` is not used here: frozen, so DDP does not wait for a gradient it never gets
        # (and its value stays the descendant's)
        visual.proj.requires_grad_(False)
        self.head = nn.Linear(visual.cfg.vision_width, n_classes)

    def forward(self, images):
        return self.head(self.visual(images))


def load_init(a):
    """(model, tokenizer, ModelConfig, modality, kind) for --init: a descendant out_dir, an
    il_clip.py out_dir / OpenAI weights (PT-FT), or `scratch` (config from --like or --model)."""
    if a.init == "scratch":
        modality, cfg, tok = a.modality, None, None
        if a.like:
            sd, cfgj = read_state(a.like)
            modality = cfgj.get("modality", "clip")
            cfg, tok = infer_config(sd, cfgj, a.like, MODALITY_TOWERS[modality]), folder_tokenizer(a.like)
        if tok is None:
            captions = (data.captions_for_tokenizer("shapes") if a.task == "classification" else
                        data.captions_for_tokenizer(a.data, image_root=a.image_root,
                                                    **csv_options(a)))
            tok = data.build_tokenizer(captions=captions, context_length=77)
        if cfg is None:
            p, n = AUX_PRESETS[a.model], a.layers or 6
            cfg = ModelConfig(embed_dim=p["embed_dim"], image_size=a.image_size,
                              patch_size=p["patch_size"], vision_width=p["width"], vision_layers=n,
                              vision_heads=p["heads"], context_length=tok.context_length,
                              vocab_size=tok.vocab_size, text_width=p["width"], text_layers=n,
                              text_heads=p["heads"], eot_token_id=tok.eot_id)
        elif a.layers:
            cfg = dataclasses.replace(cfg, vision_layers=a.layers if cfg.vision_layers else 0,
                                      text_layers=a.layers if cfg.text_layers else 0)
        torch.manual_seed(a.seed)
        model = CLIP(cfg) if modality == "clip" else VisionTransformer(cfg)
        return model, tok, cfg, modality, "scratch", {}
    sd, cfgj = read_state(a.init)
    if any(k.startswith(LEARNGENE_PREFIXES) for k in sd):
        raise ConfigError(f"{a.init}: a learngene file; run `expand` first and pass the "
                          f"descendant out_dir")
    modality = cfgj.get("modality", "clip")
    need = MODALITY_TOWERS.get(modality)
    if need is None or modality == "text":
        raise ConfigError(f"{a.init}: finetune supports clip and vision descendants, "
                          f"not {modality}")
    # a CLIP checkpoint that records its script is read by that script's load_model (a fork's
    # layout and activation); its OpenAI-layout weights are then fine-tuned in this script's CLIP,
    # built below: the reader's random init must not shift this run's draws
    with torch.random.fork_rng(devices=[]):
        found = recorded_model(a.init, script=a.script) if modality == "clip" else None
    sd, tok = (found[0].state_dict(), found[1]) if found else (sd, folder_tokenizer(a.init))
    cfg = infer_config(sd, found[2] if found else cfgj, a.init, need)
    model = CLIP(cfg) if modality == "clip" else VisionTransformer(cfg)
    if modality == "vision":
        sd = {k.removeprefix("visual."): v for k, v in sd.items() if k.startswith("visual.")}
    missing, _ = model.load_state_dict(sd, strict=False)
    if missing:
        raise ConfigError(f"{a.init}: cannot read the checkpoint (missing {missing[0]})")
    if tok is None and modality == "clip":
        raise ConfigError(f"{a.init}: no tokenizer.json")
    kind = cfgj.get("method", "pretrained") if "learngene" in cfgj else "pretrained"
    return model, tok, cfg, modality, kind, cfgj


def stratified_subsample(labels: list, n: int, seed: int) -> list:
    """`n` of the indices of `labels`, seeded, each class in proportion to its size (largest
    remainder, ties to the larger class then the lower label), in index order. Used for the opt-in
    --train_size / --eval_size (the first n of a class-sorted split would be the first few classes
    only)."""
    if n >= len(labels):
        return list(range(len(labels)))
    groups = {}
    for i, y in enumerate(labels):
        groups.setdefault(y, []).append(i)
    quota = {y: n * len(g) / len(labels) for y, g in groups.items()}
    take = {y: int(q) for y, q in quota.items()}
    rest = sorted(groups, key=lambda y: (-(quota[y] - take[y]), -len(groups[y]), y))
    for y in rest[:n - sum(take.values())]:
        take[y] += 1
    rng = random.Random(f"subsample/{seed}")
    return sorted(i for y in sorted(groups) for i in rng.sample(groups[y], take[y]))


def shapes_class_label(split: str, index: int, seed: int) -> int:
    """The label data.shapes_classification draws first from the same RNG (no rendering)."""
    return random.Random(f"shapes-cls/{seed}/{split}/{index}").randrange(len(data.SHAPE_NAMES))


class ShapesClassification(torch.utils.data.Dataset):
    """data.shapes_classification images as data.MapLoader samples (never augmented: each
    image is already a fresh draw of colour, size and place)."""

    def __init__(self, split, indices, seed, image_size):
        self.split = split
        self.indices = indices
        self.seed = seed
        self.image_size = image_size
        self.to_tensor = data.ToTensor()

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        img, label = data.shapes_classification(self.split, self.indices[i], self.seed,
                                                self.image_size)
        return {"image": self.to_tensor(img), "caption": data.SHAPE_NAMES[label],
                "key": f"{self.split}{self.indices[i]:08d}", "label": label}


def imagefolder_splits(root: str, eval_split: str) -> tuple:
    """(train folder, eval folder) of an ImageNet-style tree: root/train/ with root/val/ (ImageNet)
    or root/test/; `eval_split` "auto" takes val/, else test/. A flat folder (class folders directly
    under root) is an error: training and scoring on the same images would be a silently wrong
    number."""
    train = os.path.join(root, "train")
    if not os.path.isdir(train):
        raise ConfigError(f"{root}: an ImageFolder needs train/ and val/ (or test/) sub-folders of "
                          f"class folders (root/train/<class>/*.jpg); a flat folder has no "
                          f"held-out split")
    names = ["val", "test"] if eval_split == "auto" else [eval_split]
    for name in names:
        if os.path.isdir(os.path.join(root, name)):
            return train, os.path.join(root, name)
    raise ConfigError(f"{root}: no {' or '.join(n + '/' for n in names)} folder beside train/ to "
                      f"evaluate on")


def folder_items(folder: str, classes: list) -> list:
    """data.Item per image of `folder`, labelled by its class's index in `classes` (the
    TRAINING folder's sorted class list, so a class missing from one split shifts nothing)."""
    paths, labels, names = data.image_folder(folder)
    unknown = sorted(set(names) - set(classes))
    if unknown:
        raise ConfigError(f"{folder}: class folder {unknown[0]!r} is not in the training "
                          f"folder's classes")
    return [data.Item(p, names[y].replace("_", " "), None, os.path.relpath(p, folder),
                      classes.index(names[y]))
            for p, y in zip(paths, labels)]


def classification_data(a, image_size, rank, world):
    """(train loader, eval loader, class names, what was evaluated) for shapes or an
    ImageFolder tree. Images go through data.py's reader: a bad image is skipped and counted.
    Whole splits unless --train_size / --eval_size ask for a seeded stratified subsample."""
    if is_shapes(a.data):
        opts = data.parse_shapes_spec(a.data)
        s, classes = opts.get("seed", 0), list(data.SHAPE_NAMES)
        sizes = {"train": opts.get("train_size", 5000), "test": 1000}
        split = "test" if a.eval_split == "auto" else a.eval_split
        labels = {sp: [shapes_class_label(sp, i, s) for i in range(sizes.get(sp, 1000))]
                  for sp in ("train", split)}
        pick = {sp: stratified_subsample(labels[sp], n or len(labels[sp]), a.seed)
                for sp, n in (("train", a.train_size), (split, a.eval_size))}
        train_ds = ShapesClassification("train", pick["train"], s, image_size)
        eval_ds = ShapesClassification(split, pick[split], s, image_size)
        eval_name = f"shapes {split}"
    else:
        train_dir, eval_dir = imagefolder_splits(a.data, a.eval_split)
        classes = data.image_folder(train_dir)[2]
        train_items, eval_items = folder_items(train_dir, classes), folder_items(eval_dir, classes)
        train_items = [train_items[i] for i in stratified_subsample(
            [it.label for it in train_items], a.train_size or len(train_items), a.seed)]
        eval_items = [eval_items[i] for i in stratified_subsample(
            [it.label for it in eval_items], a.eval_size or len(eval_items), a.seed)]
        # classification augmentation (Table 6 fine-tuning): random resized crop (0.08, 1) + flip
        aug = data.train_transform(image_size, scale=(0.08, 1.0), flip=True)
        train_ds = data.FileDataset(train_items, aug, a.seed)
        eval_ds = data.FileDataset(eval_items, data.eval_transform(image_size), a.seed)
        eval_name = eval_dir
    train = data.MapLoader(train_ds, a.batch_size // world, train=True, rank=rank, world_size=world,
                           num_workers=a.num_workers, seed=a.seed, name=a.data,
                           image_size=image_size)
    test = data.MapLoader(eval_ds, 100, train=False, drop_last=False, name=eval_name)
    subsample = f"seeded stratified subsample (seed {a.seed})" if a.eval_size else "whole split"
    return train, test, classes, {"eval_data": eval_name, "eval_subset": subsample}


@torch.no_grad()
def eval_classification(clf, loader, device, n_classes):
    """Top-1 (%) over every readable image of `loader`; skipped images are counted apart."""
    clf.eval()
    right = total = 0
    seen, skipped0 = set(), loader.skipped      # the loader's counter runs across epochs
    for batch in loader:
        pred = clf(data.normalize_images(batch["image"], device)).argmax(-1).cpu()
        right += (pred == batch["label"]).sum().item()
        total += len(pred)
        seen.update(batch["label"].tolist())
    clf.train()
    return {"top1": round(100 * right / max(1, total), 2), "n_images": total,
            "n_classes_scored": len(seen), "n_classes": n_classes,
            "eval_skipped": loader.skipped - skipped0}


def retrieval_loader(a, tok, image_size, batch_size=100):
    """Loader over the retrieval eval split: every image with all its captions, or with --eval_size
    N a seeded sample of N IMAGES (each with all its captions; COCO 5k / Flickr30k 1k count images).
    Tar shards are evaluated whole."""
    split = "test" if a.eval_split == "auto" else a.eval_split
    spec = getattr(a, "eval_data", None) or a.data
    src = data.resolve_data(spec, a.image_root)
    if src["kind"] in ("csv", "tar") and not getattr(a, "eval_data", None):
        raise ConfigError(f"{a.data}: a CSV or shard set has no test split; pass --eval_data (a "
                          f"Karpathy JSON, CSV or shards held out from training)")
    if src["kind"] == "tar":
        if a.eval_size:
            raise ConfigError(f"{spec}: --eval_size needs a listed split (Karpathy JSON, CSV, "
                              f"shapes); tar shards are evaluated whole")
        return data.make_loader(spec, split, batch_size, tok, image_size, train=False,
                                drop_last=False)
    if src["kind"] == "shapes":
        ds = data.ShapesDataset(split, None, src.get("seed", 0), image_size)
        keys = [f"{split}{i:08d}" for i in range(len(ds))]
    else:
        items = data.file_items(src, split, csv_options(a))
        ds = data.FileDataset(items, data.eval_transform(image_size), a.seed)
        keys = [it.key for it in items]
    if a.eval_size:
        uniq = sorted(set(keys))
        if a.eval_size < len(uniq):
            chosen = set(random.Random(f"subsample/{a.seed}").sample(uniq, a.eval_size))
            ds = torch.utils.data.Subset(ds, [i for i, k in enumerate(keys) if k in chosen])
    return data.MapLoader(ds, batch_size, tokenizer=tok, train=False, drop_last=False, name=spec)


def retrieval_hits(sim, owners):
    """Per-query R@1 hits (i2t [images], t2i [texts], bool) from `sim` [images, texts] and `owners`
    [texts] (each text's image). Ties count as misses: a hit scores strictly higher than every wrong
    candidate, so a collapsed model scores 0 and two identical captions of different images (shapes
    repeats short ones such as "a white star") credit neither, whatever their order (`argmax`
    credited the first)."""
    pos = owners[None, :] == torch.arange(sim.shape[0], device=sim.device)[:, None]
    best_pos = sim.masked_fill(~pos, -math.inf).amax(1)
    best_neg = sim.masked_fill(pos, -math.inf).amax(1)
    right = sim.t().gather(1, owners[:, None]).squeeze(1)
    wrong = sim.t().masked_fill(pos.t(), -math.inf).amax(1)
    return best_pos > best_neg, right > wrong


@torch.no_grad()
def eval_retrieval(model, loader, device, batch_size=100):
    """I2T / T2I R@1 (%) over every batch of `loader`; images grouped by sample key (several
    captions of one image are all correct for it). Identical token sequences are encoded once:
    duplicates tie exactly."""
    model.eval()
    keys = {}
    img_feats = []
    texts = []
    owners = []
    skipped0 = getattr(loader, "skipped", 0)    # the loader's counter runs across epochs
    for batch in loader:
        new = []
        for j, k in enumerate(batch["key"]):
            if k not in keys:
                keys[k] = len(keys)
                new.append(j)
            owners.append(keys[k])
        texts.append(batch["text"])
        if new:
            img_feats.append(model.encode_image(data.normalize_images(batch["image"][new], device)).float())
    uniq, inverse = torch.unique(torch.cat(texts), dim=0, return_inverse=True)
    T = torch.cat([model.encode_text(uniq[i:i + batch_size].to(device)).float()
                   for i in range(0, len(uniq), batch_size)])[inverse.to(device)]
    I = torch.cat(img_feats)
    i2t, t2i = retrieval_hits(I @ T.t(), torch.tensor(owners, device=device))
    model.train()
    return {"i2t_r1": round(i2t.float().mean().item() * 100, 2),
            "t2i_r1": round(t2i.float().mean().item() * 100, 2), "n_images": len(I),
            "n_texts": len(T), "eval_skipped": getattr(loader, "skipped", 0) - skipped0}


def count_shard_samples(spec: str, image_root=None) -> int:
    """Samples of a shard set without count files (no _stats.json / sizes.json): the loader's
    records that hold an image, from the tar headers alone. A damaged shard counts the records
    before the damage (its error record holds no image)."""
    return sum(any(e in rec for e in data.IMAGE_EXTS)
               for shard in data.resolve_data(spec, image_root)["shards"]
               for rec in data.tar_records(shard, keep_exts=()))


def epoch_samples(loader, src: dict, rank: int, tag: str) -> int:
    """Samples in one epoch of `loader` over data source `src`; shards without count files are
    counted."""
    n = loader.num_samples
    if n is None:
        n = count_shard_samples(src["data"], src["image_root"])
        if rank == 0:
            print(f"{tag}: {src['data']} has no count files; counted {n} samples in the "
                  f"shards", flush=True)
    return n


def activation_source(a, init_cfg: dict) -> dict:
    """Activation data (appendix A.2.1: 10% of the pre-training data, one epoch): --activate_data,
    else the data the learngene was extracted on, recorded by extract and expand. Never a silent
    `shapes` for real fine-tuning data."""
    rec = init_cfg.get("extract_data") or {}
    spec = a.activate_data or rec.get("data")
    if spec is None:
        raise ConfigError(f"{a.init}: the descendant does not record its learngene's extraction "
                          f"data; pass --activate_data (the paper: its pre-training data, "
                          f"CC3M + CC12M)")
    if a.activate_data is None:
        src = {k: rec.get(k) for k in SOURCE_KEYS}
        try:
            data.resolve_data(src["data"], src["image_root"])
            if src["image_root"] and not os.path.isdir(src["image_root"]):
                raise data.DataError(f"--image_root {src['image_root']}: no such directory")
        except data.DataError as e:
            raise ConfigError(f"{a.init}: the learngene's activation data are missing ({e}); they "
                              f"were recorded at extraction in "
                              f"{init_cfg.get('learngene', a.init)}; pass --activate_data "
                              f"to override")
        return src
    return {**data_source(a), "data": a.activate_data}


def activate(a, model, tok, cfg, init_cfg, phase, results, rank, world, device):
    """Contrastive training on --activate_frac of the activation data for --activate_epochs."""
    src = activation_source(a, init_cfg)
    loader = train_loader(a, src, tok, cfg.image_size, rank, world, a.seed)
    n = epoch_samples(loader, src, rank, "activation")
    steps = a.activate_steps or max(1, int(a.activate_frac * n * a.activate_epochs) // a.batch_size)
    act_args = argparse.Namespace(**{**vars(a), "lr": a.activate_lr, "warmup": -1, "stop_at": None})
    phase("activate", model, lambda m, b: contrastive_loss_fn(m, b, device), loader,
          act_args, steps)
    results.update({"activation_data": src["data"], "activation_samples": n,
                    "activation_steps": steps})


# A fine-tuning task: (a, model, tok, cfg, modality, results, rank, world, device) -> (the module
# trained and saved, loss_fn, training loader, evaluate() -> the scores, called on rank 0).

def image_subset(a) -> str:
    """What retrieval and captioning scored (--eval_size counts images)."""
    return f"seeded sample of {a.eval_size} images (seed {a.seed})" if a.eval_size else "whole split"


def classification_task(a, model, tok, cfg, modality, results, rank, world, device):
    visual = model.visual if modality == "clip" else model
    train, test, classes, info = classification_data(a, cfg.image_size, rank, world)
    clf = Classifier(visual, len(classes)).to(device)

    def cls_loss(m, batch):
        return F.cross_entropy(m(data.normalize_images(batch["image"], device)),
                               batch["label"].to(device)), {}

    def evaluate():
        return {**info, **eval_classification(clf, test, device, len(classes)),
                "train_images": train.num_samples, "train_skipped": train.skipped}
    return clf, cls_loss, train, evaluate


def retrieval_task(a, model, tok, cfg, modality, results, rank, world, device):
    if modality == "vision":
        raise ConfigError("retrieval needs a CLIP descendant (--modality clip at expand time)")
    loader = train_loader(a, data_source(a), tok, cfg.image_size, rank, world, a.seed + 1)

    def evaluate():
        return {**eval_retrieval(model, retrieval_loader(a, tok, cfg.image_size), device),
                "eval_subset": image_subset(a)}
    return model, lambda m, b: contrastive_loss_fn(m, b, device), loader, evaluate


def cmd_finetune(a):
    t_start = time.time()
    rank, world, device = setup_distributed(a.device)
    out = a.out_dir
    # before any write
    lifecycle.claim_out_dir(out, rank, world, device, a.resume, a.overwrite, RUN_FILES,
                            phase_dirs(a))
    table6_defaults(a, a.task)
    torch.manual_seed(a.seed)
    model, tok, cfg, modality, kind, init_cfg = load_init(a)
    model.to(device)
    results = {"init": a.init, "kind": kind, "part": init_cfg.get("part", "both"), "task": a.task,
               "modality": modality, "layers": cfg.vision_layers or cfg.text_layers, "lr": a.lr,
               "wd": a.wd, "seed": a.seed, "params": sum(p.numel() for p in model.parameters())}
    # --resume: the newest phase's checkpoint is read now, for the start line; an earlier phase's in
    # its turn
    newest = next((t for t in ("finetune", "activate")
                   if lifecycle.has_checkpoint(os.path.join(out, t))), None)
    ckpts = {newest: lifecycle.load_checkpoint(os.path.join(out, newest), STATE_TYPES, rank=rank)} \
        if a.resume else {}
    resumed = f"{newest} step {ckpts[newest][2]['step']}" if a.resume else None
    start_line(a, f"finetune --task {a.task} --init {a.init}", model, device, world, None, rank,
               resumed=resumed)
    _wandb["run"] = lifecycle.start_wandb(a.wandb, out, run_flags(a), a.resume) \
        if a.wandb and rank == 0 else None

    def phase(tag, model_, loss_fn, loader, args, steps):
        """Run one phase with checkpoints in out/{tag}/; with --resume it continues from them
        (a finished phase loads its final state and runs no step)."""
        d = os.path.join(out, tag)
        resume = ckpts.get(tag) or a.resume and lifecycle.has_checkpoint(d)
        train_phase(model_, loss_fn, loader, args, rank, world, device, out_dir=d,
                    config={"phase": tag, "init": a.init, "args": run_flags(a)}, tag=tag,
                    resume=resume, max_steps=steps)
    # Activation (appendix A.2.1). CHOICE: applied to every learngene descendant (MM-LG, TLEG, He-LG
    # alike), not to scratch or PT-FT; needs both towers (a vision-only descendant is not
    # activated); learning rate --activate_lr.
    if a.activate_frac > 0 and kind in ("mmlg", "tleg", "helg") and modality == "clip":
        activate(a, model, tok, cfg, init_cfg, phase, results, rank, world, device)
    task = {"retrieval": retrieval_task, "classification": classification_task,
            "caption": caption_task}[a.task]
    final, loss_fn, train, evaluate = task(a, model, tok, cfg, modality, results, rank,
                                           world, device)
    a.max_steps = train_steps(a, train, data_source(a), rank, "finetune")
    results.update({"batch_size": a.batch_size, "warmup": a.warmup, "epochs": a.epochs})
    phase("finetune", final, loss_fn, train, a, a.max_steps)
    results["finetune_steps"] = a.max_steps

    def finish():       # rank 0: the evaluation and every file it writes
        results.update(evaluate())
        log_record(os.path.join(out, "finetune"),
                   {"step": a.max_steps, "phase": "eval", "time": round(time.time(), 3),
                    **{k: results[k] for k in EVAL_KEYS[a.task] if k in results}})
        os.makedirs(out, exist_ok=True)
        atomic_save_file(final.state_dict(), os.path.join(out, "model.safetensors"))
        # "model", "modality", "script": what load_model needs to read a retrieval fine-tune
        atomic_write_json({**run_flags(a), "results": results, "model": dataclasses.asdict(cfg),
                           "modality": modality, "script": lifecycle.script_record(__file__)},
                          os.path.join(out, "config.json"))
        if tok is not None:
            tok.save(out)
        atomic_write_json(results, os.path.join(out, "results.json"))
        print(f"{a.task}: " + ", ".join(f"{k} {score_text(k, results[k])}"
                                        for k in EVAL_KEYS[a.task] if k in results),
              flush=True)
        end_line(a, a.max_steps, t_start, ["model.safetensors", "config.json", "results.json"] +
                 ["captions.json"] * (a.task == "caption") +
                 [f"{t}/" for t in ("activate", "finetune") if os.path.isdir(os.path.join(out, t))])
    lifecycle.on_rank0(finish, rank, world, device)


# -----------------------------------------------------------------------------
# Captioning (paper Sec. 4.4, Table 2): ClipCap (Mokady & Hertz 2021) with its transformer mapping
# network. The descendant's vision encoder and the language model are frozen; only the mapper is
# trained. The language model is GPT-2 in raw PyTorch, in the released HF key layout (wte, wpe,
# h.{i}.ln_1, h.{i}.attn.c_attn (Conv1D: weight [in, out]), h.{i}.attn.c_proj, h.{i}.ln_2,
# h.{i}.mlp.c_fc, h.{i}.mlp.c_proj, ln_f; optional `transformer.` prefix).

GPT2_EOS = "<|endoftext|>"


class Conv1D(nn.Module):
    """GPT-2's linear layer: weight stored [in, out] (the released checkpoints' layout)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class GPT2Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
        self.attn, self.mlp = nn.Module(), nn.Module()
        self.attn.c_attn, self.attn.c_proj = Conv1D(d, 3 * d), Conv1D(d, d)
        self.mlp.c_fc, self.mlp.c_proj = Conv1D(d, 4 * d), Conv1D(4 * d, d)

    def forward(self, x):
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(x.shape[-1], dim=-1)
        x = x + self.attn.c_proj(attention(q, k, v, self.heads, True))
        # GPT-2's gelu_new
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2 (Radford et al. 2019) on input embeddings (ClipCap feeds a prefix); LM head tied to
    wte."""

    def __init__(self, vocab_size, n_positions, d, layers, heads):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, d), nn.Embedding(n_positions, d)
        self.h = nn.ModuleList(GPT2Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, eps=1e-5)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.01)

    def forward(self, embeds):
        x = embeds + self.wpe(torch.arange(embeds.shape[1], device=embeds.device))
        for b in self.h:
            x = b(x)
        return self.ln_f(x) @ self.wte.weight.t()


class LMTokenizer:
    """`tokenizers` byte-level BPE of a language model: tokenizer.json, or vocab.json +
    merges.txt."""

    def __init__(self, folder):
        import tokenizers
        try:
            if os.path.exists(os.path.join(folder, "tokenizer.json")):
                self.backend = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
            else:
                self.backend = tokenizers.ByteLevelBPETokenizer(os.path.join(folder, "vocab.json"),
                                                                os.path.join(folder, "merges.txt"))
        except Exception as e:
            raise ConfigError(f"{folder}: cannot read the LM tokenizer (tokenizer.json or "
                              f"vocab.json + merges.txt: {type(e).__name__})")
        self.eos = self.backend.token_to_id(GPT2_EOS)
        if self.eos is None:
            raise ConfigError(f"{folder}: the LM tokenizer has no {GPT2_EOS} token")

    def encode(self, text):
        # GPT-2 words carry a leading space
        return self.backend.encode(" " + " ".join(text.split())).ids

    def decode(self, ids):
        return self.backend.decode([i for i in ids if i != self.eos]).strip()


def load_gpt2(folder: str) -> tuple:
    """(frozen GPT2 in eval mode, LMTokenizer) from a folder with model.safetensors in the
    released HF layout; heads from its config.json ("n_head"), else d // 64."""
    path = os.path.join(folder, "model.safetensors")
    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such file (--lm wants a folder with GPT-2's "
                          f"model.safetensors)")
    sd = {k.removeprefix("transformer."): v for k, v in lifecycle.read_weights(path).items()}
    # the causal-mask buffers h.{i}.attn.bias / .masked_bias and the tied lm_head are not weights
    # here
    sd = {k: v for k, v in sd.items()
          if k.split(".")[-2:] not in (["attn", "bias"], ["attn", "masked_bias"])
          and k != "lm_head.weight"}
    if "wte.weight" not in sd or "wpe.weight" not in sd:
        raise ConfigError(f"{path}: not a GPT-2 checkpoint (no wte.weight / wpe.weight)")
    cfg_path = os.path.join(folder, "config.json")
    cfg = lifecycle.read_json(cfg_path) if os.path.exists(cfg_path) else {}
    vocab, d = sd["wte.weight"].shape
    layers = len({k.split(".")[1] for k in sd if k.startswith("h.")})
    lm = GPT2(vocab, sd["wpe.weight"].shape[0], d, layers, cfg.get("n_head", max(1, d // 64)))
    missing, unexpected = lm.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ConfigError(f"{path}: GPT-2 keys do not match (missing {missing[:1]}, unexpected "
                          f"{unexpected[:1]})")
    return lm.eval().requires_grad_(False), LMTokenizer(folder)


class TransformerMapper(nn.Module):
    """ClipCap's transformer mapping network: the image embedding -> `clip_length` tokens,
    concatenated with `prefix_length` learned constants, through a transformer; the outputs
    at the constants are the prefix fed to the LM (ClipCap: 10 + 10 tokens, 8 layers).
    `token_input`: the input is already a set of tokens [B, T, dim_clip] (the encoder's grid, or
    the oracle's objects), each mapped to one LM-wide token by the same Linear."""

    def __init__(self, dim_clip, dim_lm, prefix_length=10, clip_length=10, layers=8, heads=8,
                 token_input=False):
        super().__init__()
        self.clip_length = clip_length
        out_tokens = 1 if token_input else clip_length
        self.linear = nn.Linear(dim_clip, out_tokens * dim_lm)
        self.prefix_const = nn.Parameter(torch.randn(prefix_length, dim_lm))
        layer = nn.TransformerEncoderLayer(dim_lm, heads, 2 * dim_lm, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.transformer = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x):
        if x.dim() == 3:
            x = self.linear(x)
        else:
            x = self.linear(x).view(x.shape[0], self.clip_length, -1)
        prefix = self.prefix_const.unsqueeze(0).expand(x.shape[0], -1, -1)
        return self.transformer(torch.cat([x, prefix], 1))[:, x.shape[1]:]


SCENE_TOKEN_WIDTH = len(data.COLOUR_NAMES) + len(data.SHAPE_NAMES) + len(data.SIZE_NAMES) + 2


def scene_tokens(scene: data.Scene, image_size: int) -> torch.Tensor:
    """The oracle's input (--caption_input scene): one token per object, [3, 18], what a caption
    can state and no pixels: one-hot colour (8), shape (6) and size (2), and the centre (x, y) /
    image size; objects in a fixed order (colour, then shape: no caption order leaks), zeros past
    the scene's objects."""
    out = torch.zeros(3, SCENE_TOKEN_WIDTH)
    shape_at = len(data.COLOUR_NAMES)
    size_at = shape_at + len(data.SHAPE_NAMES)
    objects = sorted(scene.objects, key=lambda o: (data.COLOUR_NAMES.index(o.colour),
                                                   data.SHAPE_NAMES.index(o.shape)))
    for i, o in enumerate(objects):
        out[i, data.COLOUR_NAMES.index(o.colour)] = 1
        out[i, shape_at + data.SHAPE_NAMES.index(o.shape)] = 1
        out[i, size_at + data.SIZE_NAMES.index(o.size)] = 1
        out[i, -2:] = torch.tensor(o.centre) / image_size
    return out


class ClipCap(nn.Module):
    """Frozen vision encoder -> mapper -> frozen LM. Only the mapper is a registered module
    (trained, checkpointed, DDP-synchronised); the frozen parts sit in a tuple. What the mapper
    reads (--caption_input): "embed", CLIP's image embedding (ClipCap); "grid", every token of the
    encoder's last layer; "scene", the oracle: the true objects of a shapes image (scene_tokens,
    `scene_of`: image key -> data.Scene), no pixels. grid and scene are this repository's, not the
    paper's (RESULTS.md, "The captioner's limit")."""

    def __init__(self, visual, lm, tok, dim_clip, heads=8, inputs="embed", scene_of=None):
        super().__init__()
        self.frozen = (visual.eval().requires_grad_(False), lm, tok)
        self.inputs = inputs
        self.scene_of = scene_of
        d = lm.wte.weight.shape[1]
        if inputs == "grid":
            dim_clip = visual.cfg.vision_width
        if inputs == "scene":
            dim_clip = SCENE_TOKEN_WIDTH
        self.mapper = TransformerMapper(dim_clip, d, heads=heads if d % heads == 0 else 1,
                                        token_input=inputs != "embed")

    @torch.no_grad()
    def embed(self, images):
        """CLIP's image embedding: the frozen encoder's pooled feature through `proj`."""
        visual = self.frozen[0]
        return (visual(images) @ visual.proj).float()

    @torch.no_grad()
    def features(self, images, keys):
        """What the mapper reads of these images (`keys`: their image keys)."""
        if self.inputs == "grid":
            return self.frozen[0](images, all_tokens=True).float()
        if self.inputs == "scene":
            size = images.shape[-1]
            return torch.stack([scene_tokens(self.scene_of(k), size) for k in keys]).to(images.device)
        return self.embed(images)

    def prefix(self, images, keys=None):
        return self.mapper(self.features(images, keys))

    def forward(self, images, tokens, keys=None):
        """Teacher-forced logits of `tokens` [B, T] after the prefix: [B, T, vocab]."""
        lm = self.frozen[1]
        p = self.prefix(images, keys)
        return lm(torch.cat([p, lm.wte(tokens)], 1))[:, p.shape[1] - 1:-1]


def pad_ids(ids, eos):
    """(tokens [B, T], mask [B, T]) of token id lists, padded with EOS (masked out)."""
    T = max(map(len, ids))
    tokens = torch.full((len(ids), T), eos, dtype=torch.long)
    mask = torch.zeros(len(ids), T, dtype=torch.bool)
    for i, s in enumerate(ids):
        tokens[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), True
    return tokens, mask


def repeat_bans(ids: list, n: int) -> list:
    """The tokens that would repeat an n-gram already in `ids` (n 0: none), as Hugging Face's
    no_repeat_ngram_size: "a blue star and a blue star" is never true of a shapes image, whose
    objects differ."""
    if n <= 0 or len(ids) < n - 1:
        return []
    tail = ids[len(ids) - n + 1:]
    return [ids[i + n - 1] for i in range(len(ids) - n + 1) if ids[i:i + n - 1] == tail]


def ban(logits, rows: list, n: int):
    """-inf, in place, at each row's repeat_bans."""
    for r, ids in enumerate(rows):
        logits[r, repeat_bans(ids, n)] = -math.inf
    return logits


@torch.no_grad()
def generate(model, images, beam=1, max_len=30, keys=None, no_repeat=0):
    """Captions (token id lists) for `images`: greedy (beam 1) or beam search with scores
    divided by length (ClipCap's generate_beam); `no_repeat` n: no n-gram twice (repeat_bans).
    No KV cache: captions are short."""
    lm, tok = model.frozen[1], model.frozen[2]
    if beam == 1:       # greedy: every image at once, one token each step
        prefix = model.prefix(images, keys)
        ids = torch.empty(len(prefix), 0, dtype=torch.long, device=prefix.device)
        for _ in range(max_len):
            logits = lm(torch.cat([prefix, lm.wte(ids)], 1))[:, -1]
            if no_repeat:
                logits = ban(logits, ids.tolist(), no_repeat)
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
            if (ids == tok.eos).any(1).all():
                break
        return [row[:row.index(tok.eos) + 1] if tok.eos in row else row for row in ids.tolist()]
    out = []
    for p in model.prefix(images, keys):
        beams = [([], 0.0, False)]                       # (ids, sum log-prob, finished)
        for _ in range(max_len):
            live = [b for b in beams if not b[2]]
            if not live:
                break
            emb = torch.stack([torch.cat([p, lm.wte(torch.tensor(ids, dtype=torch.long, device=p.device))])
                               for ids, _, _ in live])
            logp = lm(emb)[:, -1].float().log_softmax(-1)
            if no_repeat:
                logp = ban(logp, [b[0] for b in live], no_repeat)
            cand = [b for b in beams if b[2]]
            top = logp.topk(beam, -1)
            for (ids, s, _), vals, idx in zip(live, top.values.tolist(), top.indices.tolist()):
                cand += [(ids + [i], s + v, i == tok.eos) for v, i in zip(vals, idx)]
            beams = sorted(cand, key=lambda b: b[1] / len(b[0]), reverse=True)[:beam]
        out.append(max(beams, key=lambda b: b[1] / len(b[0]))[0])
    return out


# --- caption metrics, as the COCO caption evaluation (pycocoevalcap) defines them ------------
# Inputs are {image id: [tokenised strings]} (refs) and {image id: [one hypothesis]}.

def ngram_counts(words, n):
    return collections.Counter(tuple(words[i:i + k]) for k in range(1, n + 1)
                               for i in range(len(words) - k + 1))


def bleu(refs: dict, hyps: dict, n=4) -> list:
    """Corpus BLEU-1..n (Papineni et al.): clipped n-gram matches summed over the corpus; the
    brevity penalty uses per sentence the reference length closest to the hypothesis (ties
    to the shorter), as pycocoevalcap's option 'closest'."""
    tiny, small = 1e-15, 1e-9
    correct = [0] * n
    guess = [0] * n
    testlen = 0
    reflen = 0
    for k in refs:
        words = hyps[k][0].split()
        maxref = collections.Counter()      # each n-gram's largest count in one reference
        for r in refs[k]:
            for g, c in ngram_counts(r.split(), n).items():
                maxref[g] = max(maxref[g], c)
        for g, c in ngram_counts(words, n).items():
            correct[len(g) - 1] += min(c, maxref[g])    # clipped
        for j in range(n):
            guess[j] += max(0, len(words) - j)
        testlen += len(words)
        reflen += min((abs(len(r.split()) - len(words)), len(r.split())) for r in refs[k])[1]
    ratio = (testlen + tiny) / (reflen + small)
    bp = math.exp(1 - 1 / ratio) if ratio < 1 else 1.0
    out, prod = [], 1.0
    for j in range(n):
        prod *= (correct[j] + tiny) / (guess[j] + small)
        out.append(prod ** (1 / (j + 1)) * bp)
    return out


def cider_vectors(refs: dict, n=4):
    """CIDEr's tf-idf n-gram vectors with document frequencies from the references: vec(text)
    -> (per-n {n-gram: weight}, per-n norms, bigram count), and every reference's vector."""
    df = collections.Counter(g for k in refs
                             for g in {g for r in refs[k] for g in ngram_counts(r.split(), n)})
    log_n = math.log(len(refs))

    @functools.lru_cache(maxsize=None)
    def vec(text):
        v, norm = [{} for _ in range(n)], [0.0] * n
        counts = ngram_counts(text.split(), n)
        for g, tf in counts.items():
            v[len(g) - 1][g] = tf * (log_n - math.log(max(1.0, df[g])))
            norm[len(g) - 1] += v[len(g) - 1][g] ** 2
        return v, [math.sqrt(x) for x in norm], sum(c for g, c in counts.items() if len(g) == 2)
    return vec, {k: [vec(r) for r in refs[k]] for k in refs}


def cider_d(refs: dict, hyps: dict, n=4, sigma=6.0) -> float:
    """Corpus CIDEr-D (Vedantam et al. 2015) as pycocoevalcap's Cider: tf-idf n-gram vectors with
    document frequencies from the references, clipped hypothesis weights, a Gaussian length penalty
    (sigma 6; "length" = the bigram count, as there), the mean over n = 1..4 and over references,
    x10; the mean over images."""
    vec, ref_vecs = cider_vectors(refs, n)
    out = 0.0
    for k in refs:
        vh, nh, lh = vec(hyps[k][0])
        total = [0.0] * n
        for vr, nr, lr in ref_vecs[k]:
            penalty = math.exp(-((lh - lr) ** 2) / (2 * sigma ** 2))
            for j in range(n):
                rj = vr[j]      # n-grams absent from the reference add exactly 0: skipped
                val = sum(min(w, rj[g]) * rj[g] for g, w in vh[j].items() if g in rj)
                if nh[j] and nr[j]:
                    val /= nh[j] * nr[j]
                total[j] += val * penalty
        out += 10.0 * sum(total) / n / len(refs[k])
    return out / len(refs)


def constant_ciders(refs: dict, candidates: list, n=4, sigma=6.0) -> list:
    """cider_d(refs, {every image: [c]}) for each candidate c, through an inverted index of
    the references' n-grams: the same sum, term by term, regrouped by n-gram (the constant
    baseline scores ~1000 candidates against ~5000 references)."""
    vec, ref_vecs = cider_vectors(refs, n)
    # n-gram -> (weight, norm, length, 1 / refs of its image)
    post = collections.defaultdict(list)
    for k, vs in ref_vecs.items():
        for vr, nr, lr in vs:
            for j in range(n):
                for g, w in vr[j].items():
                    if w > 0:       # a zero weight adds exactly 0
                        post[g].append((w, nr[j], lr, 1 / len(vs)))
    post = {g: np.array(v).T for g, v in post.items()}
    out = []
    for c in candidates:
        vh, nh, lh = vec(c)
        total = 0.0
        for j in range(n):
            for g, w in vh[j].items():
                if w > 0 and g in post:
                    rg, nr, lr, per = post[g]
                    total += float(np.sum(np.minimum(w, rg) * rg / (nh[j] * nr) * per *
                                          np.exp(-((lh - lr) ** 2) / (2 * sigma ** 2))))
        out.append(10.0 * total / n / len(refs))
    return out


def lcs_len(a, b):
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(refs: dict, hyps: dict, beta=1.2) -> float:
    """ROUGE-L (Lin & Och 2004) as pycocoevalcap: LCS precision and recall, each the max over
    references, F with beta 1.2; mean over images."""
    total = 0.0
    for k in refs:
        c = hyps[k][0].split(" ")
        lcs = [lcs_len(r.split(" "), c) for r in refs[k]]
        p = max(l / len(c) for l in lcs)
        r = max(l / len(ref.split(" ")) for l, ref in zip(lcs, refs[k]))
        total += (1 + beta ** 2) * p * r / (r + beta ** 2 * p) if p and r else 0.0
    return total / len(refs)


def caption_tokens(text: str) -> str:
    """Lower case, punctuation dropped, one space between words. CHOICE: stands in for the COCO
    evaluation's Java PTBTokenizer (which also drops punctuation); contractions such as "man's" stay
    one word here, two there."""
    return " ".join("".join(ch if ch.isalnum() or ch == "'" else " "
                            for ch in text.lower()).split())


def caption_scores(refs: dict, hyps: dict) -> dict:
    """BLEU-1..4, CIDEr-D, ROUGE-L, all x100 as the paper's Table 2 reports them."""
    refs = {k: [caption_tokens(r) for r in v] for k, v in refs.items()}
    hyps = {k: [caption_tokens(v[0])] for k, v in hyps.items()}   # an empty caption is scored empty
    return {**{f"bleu{j + 1}": round(100 * x, 2) for j, x in enumerate(bleu(refs, hyps))},
            "cider": round(100 * cider_d(refs, hyps), 2),
            "rouge_l": round(100 * rouge_l(refs, hyps), 2)}


# Several references per shapes image (shapes_references), as COCO has five: with one
# reference and shapes' small grammar, one fixed caption out-scored every model on CIDEr-D.
SHAPES_REFERENCES = 5
# Synonyms and paraphrases that keep the meaning; the grammar's own word comes first.
REFERENCE_WORDS = {
    "size": {"small": ["small", "little", "tiny"], "large": ["large", "big"]},
    "colour": {"purple": ["purple", "violet"]},
    "shape": {"circle": ["circle", "disc"], "square": ["square"], "triangle": ["triangle"],
              "star": ["star"], "cross": ["cross", "plus sign"], "diamond": ["diamond", "rhombus"]},
    "relation": {"to the left of": ["to the left of", "left of", "on the left of"],
                 "to the right of": ["to the right of", "right of", "on the right of"],
                 "above": ["above", "over"], "below": ["below", "under", "beneath"]},
}
CONVERSE = {"to the left of": "to the right of", "to the right of": "to the left of",
            "above": "below", "below": "above"}


def _reference_struct(scene: data.Scene, rng: random.Random) -> data.CaptionStruct:
    """A caption structure about the scene's objects, in the grammar: sizes mentioned or not,
    "X rel Y" or "X is rel Y", object order reversed with the converse relation, the two
    objects of an "and" caption in either order or related when the relation is clear."""
    objs, s = scene.objects, scene.struct
    phrases = [data.Phrase(o.colour, o.shape, o.size if rng.random() < 0.5 else None) for o in objs]
    form, rels = s.form, list(s.relations)
    # related instead where the relation is as clear as captions state (placement margin)
    if form == "and":
        (a, b), margin = objs[:2], data.RELATION_MARGIN * scene.image.size[0] / data.SHAPES_IMAGE_SIZE
        if abs(abs(b.centre[0] - a.centre[0]) - abs(b.centre[1] - a.centre[1])) >= margin \
                and rng.random() < 0.5:
            form, rels = "rel", [data.relation_between(a, b)]
    if form in ("rel", "copula"):
        form = rng.choice(["rel", "copula"])
    order = list(range(len(phrases)))
    if form == "and":
        rng.shuffle(order)
    elif form != "single" and rng.random() < 0.5:
        if form == "chain":         # "A r1 B r2 C" = "C r2' B r1' A"
            order, rels = order[::-1], [CONVERSE[r] for r in rels[::-1]]
        else:                       # "A r B ..." = "B r' A ..."
            order[:2], rels[0] = [1, 0], CONVERSE[rels[0]]
    return data.CaptionStruct(form, [phrases[i] for i in order], rels)


def shapes_references(scene: data.Scene, n: int, rng: random.Random) -> list:
    """`n` distinct captions of the scene, each true of it: its own caption first, then
    paraphrases (_reference_struct, checked by caption_is_true) in words drawn from
    REFERENCE_WORDS, some opened by "there is". Deterministic in `rng`'s seed."""
    refs = [scene.caption]
    for _ in range(100 * n):
        if len(refs) == n:
            break
        t = _reference_struct(scene, rng)
        if not data.caption_is_true(t, scene.objects):
            continue
        text = data.render_caption(t, lambda kind, v: rng.choice(REFERENCE_WORDS[kind].get(v, [v])))
        if t.form in ("single", "rel") and rng.random() < 0.3:
            text = "there is " + text
        if text not in refs:
            refs.append(text)
    return refs


def shapes_scene_of(spec: str, image_size: int):
    """image key ("{split}{index:08d}", ShapesDataset's) -> its data.Scene, for shapes `spec`."""
    seed = data.parse_shapes_spec(spec).get("seed", 0)
    return functools.lru_cache(maxsize=None)(
        lambda key: data.shapes_scene(key[:-8], int(key[-8:]), seed, image_size))


def reference_captions(spec: str, image_size: int):
    """(image key, the data's captions of it) -> its reference captions: on shapes
    shapes_references of the scene, else the captions the data list for the image."""
    if not is_shapes(spec):
        return lambda key, captions: captions
    seed, scene_of = data.parse_shapes_spec(spec).get("seed", 0), shapes_scene_of(spec, image_size)
    return lambda key, captions: shapes_references(
        scene_of(key), SHAPES_REFERENCES, random.Random(f"shapes-refs/{seed}/{key[:-8]}/{int(key[-8:])}"))


# --- grounding on shapes: is a caption true of its image? (no benchmark on real data can say) -----
# every word a shapes caption or reference uses -> the grammar's word (REFERENCE_WORDS read
# backwards)
GRAMMAR_WORDS = {kind: {tuple(w.split()): w for w in names} for kind, names in (
    ("size", data.SIZE_NAMES), ("colour", data.COLOUR_NAMES), ("shape", data.SHAPE_NAMES),
    ("relation", data.RELATION_NAMES))}
for _kind, _words in REFERENCE_WORDS.items():
    GRAMMAR_WORDS[_kind].update((tuple(syn.split()), w) for w, syns in _words.items()
                                for syn in syns)


def parse_shapes_caption(text: str):
    """A caption in the shapes grammar, in REFERENCE_WORDS' words and with an optional "there is"
    (every reference's form) -> its data.CaptionStruct in the grammar's words; None if it is not
    one. CHOICE: "a" and "an" are not checked against the next word (an article changes no fact)."""
    words, pos = caption_tokens(text).removeprefix("there is ").split(), 0

    def word(kind):
        nonlocal pos
        # "left of" after "to the left of"
        for w in sorted(GRAMMAR_WORDS[kind], key=len, reverse=True):
            if tuple(words[pos:pos + len(w)]) == w:
                pos += len(w)
                return GRAMMAR_WORDS[kind][w]

    def phrase():
        nonlocal pos
        if words[pos:pos + 1] not in (["a"], ["an"]):
            return None
        pos += 1
        size, colour, shape = word("size"), word("colour"), word("shape")
        return data.Phrase(colour, shape, size) if colour and shape else None

    def next_is(w):
        nonlocal pos
        hit = words[pos:pos + 1] == [w]
        pos += hit
        return hit

    phrases, rels, form = [phrase()], [], "single"
    if next_is("and"):
        phrases, form = phrases + [phrase()], "and"
    elif pos < len(words):
        form = "copula" if next_is("is") else "rel"
        rels, phrases = [word("relation")], phrases + [phrase()]
        if form == "rel" and next_is("and"):
            phrases, form = phrases + [phrase()], "rel_and"
        elif form == "rel" and pos < len(words):
            rels, phrases, form = rels + [word("relation")], phrases + [phrase()], "chain"
    ok = pos == len(words) and all(phrases) and all(rels)
    return data.CaptionStruct(form, phrases, rels) if ok else None


def grounding(hyps: dict, scene_of) -> dict:
    """The share (%) of captions ({image key: [caption]}) that are true of their image: parsed by
    parse_shapes_caption and checked by data.caption_is_true, the check every reference passes;
    the share in the grammar at all (a caption outside it counts as not true); and the share that
    name one object twice ("a blue star and a blue star": never true, a scene's objects differ)."""
    parsed = {k: parse_shapes_caption(h[0]) for k, h in hyps.items()}
    true = sum(p is not None and data.caption_is_true(p, scene_of(k).objects)
               for k, p in parsed.items())
    grammatical = [p for p in parsed.values() if p is not None]
    repeated = sum(len({(q.colour, q.shape) for q in p.phrases}) < len(p.phrases)
                   for p in grammatical)
    return {"truth_rate": round(100 * true / len(hyps), 2),
            "grammatical_rate": round(100 * len(grammatical) / len(hyps), 2),
            "repeated_object_rate": round(100 * repeated / len(hyps), 2)}


def train_shapes_lm(folder: str, seed: int, steps: int = 1000):
    """The stand-in for GPT-2 on `shapes`: a 2-layer GPT (same class, same released key layout, same
    loader) with its own byte-level BPE, trained on two references of one training image in a row
    ("<eos> r1 <eos> r2 <eos>"); written to `folder` once and reused. Why pairs: ClipCap's frozen
    GPT-2 continues what its context says, and the mapper's prefix is that context. A stand-in
    trained on single captions never has to read a context (nothing before a caption tells anything
    about it), so no prefix could steer it: the mapper's loss stayed at the LM's own and the
    captioner wrote the same 13-15 captions for 1000 images. Trained on pairs, the second caption
    follows from the first (the same objects in other words): it reads its context."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers
    cfg_path = os.path.join(folder, "config.json")
    if os.path.exists(os.path.join(folder, "model.safetensors")) and os.path.exists(cfg_path):
        if lifecycle.read_json(cfg_path).get("text") == "reference pairs":
            lifecycle.say(f"stand-in LM: {folder}: a 2-layer GPT trained on pairs of shapes "
                          f"reference captions, standing in for GPT-2 (trained by an earlier "
                          f"run, reused)")
            return
        print(f"note: {folder}: a stand-in LM trained on single captions (it ignores the image); "
              f"retraining it",
              file=sys.stderr, flush=True)
    lifecycle.say(f"stand-in LM: {folder}: training a 2-layer GPT on pairs of shapes reference "
                  f"captions to stand in for GPT-2 ({steps} steps, a few minutes on a CPU, once: "
                  f"runs beside this one reuse it)")
    refs = [shapes_references(data.shapes_scene("train", i, seed), SHAPES_REFERENCES,
                              random.Random(f"shapes-lm/{seed}/{i}")) for i in range(5000)]
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([r for rs in refs for r in rs], trainers.BpeTrainer(
        vocab_size=400, special_tokens=[GPT2_EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(folder, exist_ok=True)
    backend.save(os.path.join(folder, "tokenizer.json"))
    tok = LMTokenizer(folder)
    # its own RNG streams: the run that trains the stand-in must draw the mapper's init like the
    # runs that reuse it
    rng = random.Random(f"shapes-lm/{seed}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        lm = GPT2(backend.get_vocab_size(), 64, 128, 2, 4)
        opt = torch.optim.AdamW(lm.parameters(), lr=2e-3, weight_decay=0.01)
        for step in lifecycle.progress(range(steps), desc="stand-in LM"):
            for g in opt.param_groups:
                g["lr"] = get_lr(step, steps, 2e-3, max(1, steps // 10))
            pairs = [rng.sample(refs[rng.randrange(len(refs))], 2) for _ in range(64)]
            tokens, mask = pad_ids([tok.encode(x) + [tok.eos] + tok.encode(y) + [tok.eos]
                                    for x, y in pairs], tok.eos)
            # EOS opens a text (GPT-2)
            seq = torch.cat([torch.full((len(pairs), 1), tok.eos), tokens], 1)
            loss = F.cross_entropy(lm(lm.wte(seq[:, :-1]))[mask], tokens[mask])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    atomic_save_file(lm.state_dict(), os.path.join(folder, "model.safetensors"))
    atomic_write_json({"n_head": 4,
                       "stand_in": "a 2-layer GPT trained on pairs of shapes references, not GPT-2",
                       "text": "reference pairs", "final_lm_loss": round(loss.item(), 4),
                       "steps": steps}, cfg_path)


class CaptionPool:
    """Training images for the captioning baselines: their image embeddings (ClipCap's input, for
    cosine similarity), their first training caption, and the best constant caption chosen on
    them."""

    def __init__(self, feats, captions, refs):
        self.feats, self.captions = F.normalize(feats, dim=-1), captions
        self.constant, self.constant_cider = best_constant(refs, sorted(set(captions)))

    def nearest(self, feats) -> list:
        """The caption of the most similar pool image, per row of `feats`."""
        return [self.captions[i]
                for i in (F.normalize(feats, dim=-1) @ self.feats.t()).argmax(1).tolist()]


def best_constant(refs: dict, candidates: list) -> tuple:
    """(caption, CIDEr-D x100) of the candidate that, given to every image of `refs`, scores the
    highest corpus CIDEr-D against their references (the first of equals)."""
    refs = {k: [caption_tokens(r) for r in v] for k, v in refs.items()}
    totals = constant_ciders(refs, [caption_tokens(c) for c in candidates])
    best = candidates[max(range(len(candidates)), key=totals.__getitem__)]
    return best, round(100 * cider_d(refs, {k: [caption_tokens(best)] for k in refs}), 2)


@torch.no_grad()
def caption_pool(a, cap, image_size, device) -> CaptionPool:
    """The first --baseline_pool images of the training split, in data order."""
    src = data_source(a)
    refs_of = reference_captions(src["data"], image_size)
    captions, feats = {}, []        # image key -> its training captions (a Karpathy JSON lists 5)
    for batch in train_loader(a, src, None, image_size, 0, 1, a.seed, ordered=True):
        new = []
        for j, (k, c) in enumerate(zip(batch["key"], batch["caption"])):
            if k not in captions:
                if len(captions) == a.baseline_pool:
                    break
                captions[k] = []
                new.append(j)
            captions[k].append(c)
        if new:
            feats.append(cap.embed(data.normalize_images(batch["image"][new], device)))
        if len(captions) == a.baseline_pool:
            break
    return CaptionPool(torch.cat(feats), [c[0] for c in captions.values()],
                       {k: refs_of(k, c) for k, c in captions.items()})


@torch.no_grad()
def eval_captioning(model, loader, device, beam, refs_of, pool=None, scene_of=None,
                    no_repeat=0):
    """Captions every eval image once (its key), scored against all its references (`refs_of`);
    on shapes (`scene_of`) also the share of captions true of their image (grounding). With a
    CaptionPool, the two baselines are scored on the same images and references: its constant
    caption, and each image's nearest pool image's caption. Returns (scores, every image's
    captions)."""
    model.mapper.eval()
    captions = {}
    hyps = {}
    nearest = {}
    lm_tok = model.frozen[2]
    skipped0 = getattr(loader, "skipped", 0)
    bar = lifecycle.progress(desc="captioning", unit="item")
    for batch in loader:
        bar.update(len(batch["key"]))
        new = [j for j, k in enumerate(batch["key"]) if k not in captions]
        for k, c in zip(batch["key"], batch["caption"]):
            captions.setdefault(k, []).append(c)
        if new:
            images, keys = data.normalize_images(batch["image"][new], device), [batch["key"][j] for j in new]
            ids = generate(model, images, beam, keys=keys, no_repeat=no_repeat)
            hyps.update({k: [lm_tok.decode(s)] for k, s in zip(keys, ids)})
            if pool is not None:
                nearest.update({k: [c] for k, c in zip(keys, pool.nearest(model.embed(images)))})
    bar.close()
    model.mapper.train()
    refs = {k: refs_of(k, v) for k, v in captions.items()}

    def scores(h):
        # how many different captions: a mapper that ignores the image writes one caption for every
        # image, and that can still score (the most frequent caption's n-grams)
        return {**caption_scores(refs, h), "n_distinct_captions": len({c[0] for c in h.values()}),
                **(grounding(h, scene_of) if scene_of else {})}
    out = {**scores(hyps), "n_images": len(refs), "n_refs": sum(map(len, refs.values())),
           "beam": beam, "no_repeat_ngram": no_repeat,
           "eval_skipped": getattr(loader, "skipped", 0) - skipped0,
           "examples": [{"ref": refs[k][0], "hyp": hyps[k][0]} for k in list(refs)[:3]]}
    per_image = {k: {"caption": hyps[k][0], "references": refs[k]} for k in refs}
    for k, r in per_image.items():
        if scene_of:
            r["true"] = grounding({k: [r["caption"]]}, scene_of)["truth_rate"] == 100
        if pool is not None:
            r["nearest"] = nearest[k][0]
    if pool is not None:
        out["baselines"] = {
            "constant": {**scores({k: [pool.constant] for k in refs}), "caption": pool.constant,
                         "pool_cider": pool.constant_cider},
            "nearest": scores(nearest), "pool_images": len(pool.captions),
            "similarity": "cosine of the frozen vision encoder's image embedding (ClipCap's input)"}
    return out, per_image


def caption_task(a, model, tok, cfg, modality, results, rank, world, device):
    """Table 2's protocol: vision encoder and LM frozen, the ClipCap mapper trained."""
    lm_dir = a.lm
    if lm_dir is None:
        if not is_shapes(a.data):
            raise ConfigError("--task caption needs --lm <folder with GPT-2's model.safetensors "
                              "and tokenizer.json or vocab.json + merges.txt>; only shapes "
                              "has a stand-in")
        # a cache beside out_dir (README: shapes_lm/), so the runs under one parent folder share the
        # stand-in
        lm_dir = os.path.join(os.path.dirname(os.path.normpath(a.out_dir)), "shapes_lm")
        lifecycle.on_rank0(lambda: train_shapes_lm(lm_dir, 0), rank, world, device)
        results["lm"] = f"stand-in: a 2-layer GPT trained on pairs of shapes references (not GPT-2), {lm_dir}"
    else:
        results["lm"] = os.path.abspath(lm_dir)
    lm, ltok = load_gpt2(lm_dir)
    if lm.wpe.num_embeddings < 10 + 30:
        raise ConfigError(f"{lm_dir}: the LM has {lm.wpe.num_embeddings} positions; captioning "
                          f"needs 40 (the mapper's 10-token prefix and captions of up to 30)")
    lm.to(device)
    visual = model.visual if modality == "clip" else model
    spec = getattr(a, "eval_data", None) or a.data
    scene_of = shapes_scene_of(spec, cfg.image_size) if is_shapes(spec) else None
    cap = ClipCap(visual, lm, ltok, cfg.embed_dim, inputs=a.caption_input, scene_of=scene_of)
    cap.to(device)
    results["caption_input"] = a.caption_input
    # captioned images: shapes, Karpathy JSON, CSV, shards; evaluated as retrieval's split
    train = train_loader(a, data_source(a), None, cfg.image_size, rank, world, a.seed)
    test = retrieval_loader(a, None, cfg.image_size)
    refs_of = reference_captions(spec, cfg.image_size)

    def loss_fn(m, batch):
        # at most 30 tokens with EOS
        ids = [ltok.encode(c)[:29] + [ltok.eos] for c in batch["caption"]]
        tokens, mask = (t.to(device) for t in pad_ids(ids, ltok.eos))
        images = data.normalize_images(batch["image"], device)
        logits = m(images, tokens, batch["key"])
        return F.cross_entropy(logits[mask].float(), tokens[mask]), {}

    def evaluate():
        t0 = time.time()
        pool = caption_pool(a, cap, cfg.image_size, device) if a.baselines else None
        scores, per_image = eval_captioning(cap, test, device, a.beam, refs_of, pool, scene_of,
                                            a.no_repeat_ngram)
        atomic_write_json(per_image, os.path.join(a.out_dir, "captions.json"))
        return {**scores, "eval_subset": image_subset(a),
                "eval_seconds": round(time.time() - t0, 1)}
    return cap, loss_fn, train, evaluate


# -----------------------------------------------------------------------------
# Subcommand: report (paper Table 3: storage and pre-training cost)


def _run_cost(path):
    """(steps, seconds, batch) of a training out_dir (this script's or il_clip.py's)."""
    steps = secs = batch = None
    st = os.path.join(lifecycle.checkpoint_dir(path), "state.pt")
    if os.path.exists(st):
        try:
            j = torch.load(st, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ConfigError(f"{st}: cannot read the training state "
                              f"({type(e).__name__})") from None
        steps, secs = j.get("step"), j.get("elapsed")
    cj = os.path.join(path, "config.json")
    if os.path.exists(cj):
        j = lifecycle.read_json(cj)
        batch = j.get("batch_size") or (j.get("args") or {}).get("batch_size")
    mj = os.path.join(path, "metrics.jsonl")
    if secs is None and os.path.exists(mj):
        with open(mj) as f:
            last = [json.loads(l) for l in f if l.strip()]
        if last and "elapsed" in last[-1]:
            secs = last[-1]["elapsed"]
        elif len(last) > 1 and "time" in last[-1]:  # il_clip.py logs wall-clock timestamps
            span = last[-1]["time"] - last[0]["time"]
            secs = span * last[-1]["step"] / max(1, last[-1]["step"] - last[0]["step"])
        if last:
            steps = steps or last[-1].get("step")
    return steps, secs, batch


RESULT_COLUMNS = {"retrieval": ["i2t_r1", "t2i_r1"], "classification": ["top1"],
                  "caption": ["bleu4", "cider", "rouge_l", "truth_rate", "repeated_object_rate"]}
# the scores (percent) of a fine-tune's eval record in metrics.jsonl and its last line
EVAL_KEYS = {**RESULT_COLUMNS, "caption": ["bleu1", "bleu2", "bleu3", "bleu4", "cider", "rouge_l",
                                           "truth_rate", "grammatical_rate",
                                           "repeated_object_rate", "n_distinct_captions"]}


def results_table(dirs: list) -> str:
    """One row per finetune out_dir (its results.json): what was initialised (method, part,
    layers), the scores, and what was scored (images, classes, subset)."""
    lines = ["| run | init | part | layers | task | scores | evaluated |",
             "|---|---|---|---:|---|---|---|"]
    for d in dirs:
        path = os.path.join(d, "results.json")
        if not os.path.exists(path):
            raise ConfigError(f"{path}: no such file (not a finished finetune out_dir)")
        r = lifecycle.read_json(path)
        scores = ", ".join(f"{k} {score_text(k, r[k])}"
                           for k in RESULT_COLUMNS.get(r.get("task"), []) if k in r)
        what = f"{r.get('n_images')} images" + \
            (f", {r['n_classes']} classes" if "n_classes" in r else "") + \
            (f", {r['n_refs']} refs" if "n_refs" in r else "") + \
            f", {r.get('eval_subset', 'whole split')}" + \
            (f"; {r['n_distinct_captions']} distinct captions" if "n_distinct_captions" in r else "")
        name = os.path.basename(os.path.normpath(d))
        lines.append(f"| {name} | {r.get('kind')} | {r.get('part', 'both')} | {r.get('layers')} | "
                     f"{r.get('task')} | {scores} | {what} |")
        for b, br in ((b, br) for b, br in r.get("baselines", {}).items() if isinstance(br, dict)):
            scores = ", ".join(f"{k} {score_text(k, br[k])}"
                               for k in RESULT_COLUMNS["caption"] if k in br)
            lines.append(f"| {name} | {b} caption (baseline) | | | caption | {scores} | the same "
                         f"images; {br['n_distinct_captions']} distinct captions |")
    return "\n".join(lines)


def finetune_run(folder):
    """(init method part layers task, seed, {score: fraction}) of a finished finetune out_dir;
    a captioning run also yields its two baselines as groups of their own (the nearest-neighbour
    caption named by the encoder whose embedding found the neighbour); a mapper that reads more
    than ClipCap's embedding is named by what it reads ("mmlg+grid")."""
    path = os.path.join(folder, "results.json")
    if not os.path.isfile(path):
        return None
    r = lifecycle.read_json(path)
    cols = RESULT_COLUMNS.get(r.get("task"), [])
    kind = r["kind"]
    if r.get("caption_input", "embed") != "embed":
        kind = f"{kind}+{r['caption_input']}"
    name = f"{kind} {r.get('part', 'both')} {r['layers']} {r['task']}"
    runs = [(name, r.get("seed", 0), {k: r[k] / 100 for k in cols if k in r})]
    runs += [(f"{b} caption" + (f" ({kind})" if b == "nearest" else "") + f" {r['layers']}",
              r.get("seed", 0), {k: br[k] / 100 for k in cols if k in br})
             for b, br in r.get("baselines", {}).items()
             if isinstance(br, dict)]
    return runs


def score_text(key, v):
    """A score as printed: percents (and CIDEr-D x 100) to one decimal, counts as they are."""
    return str(v) if key.startswith("n_") else lifecycle.percent(v)


def cmd_report(a):
    t_start = time.time()
    asked = [f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
             for k in ("results", "seeds", "learngene")
             if (v := getattr(a, k))]
    lifecycle.start_line(__file__, "report", asked or ["nothing asked"])
    if a.results:
        print(results_table(a.results))
    # one group per (init, part, layers, task); each paired with MM-LG at its size and task
    if a.seeds:
        # "tleg both 6 caption" and "nearest caption 6" -> "mmlg both 6 caption"
        def mmlg_of(group):
            words = group.split()
            layers, task = (words[-2], words[-1]) if words[-1] in RESULT_COLUMNS else (words[-1], "caption")
            return a.baseline or f"mmlg both {layers} {task}"
        lifecycle.summarize_runs(a.seeds, finetune_run, mmlg_of)
    if a.learngene:
        storage_report(a)
    elif not (a.results or a.seeds):
        raise ConfigError("report needs --learngene (Table 3), --results (finetune out_dirs) "
                          "and/or --seeds DIR")
    lifecycle.done_line(f"{len(asked)} table{'s' if len(asked) > 1 else ''} printed",
                        time.time() - t_start)


def storage_report(a):
    aux, meta = load_learngene(a.learngene)
    lg = aux.learngene_numel()
    lg_all = sum(p.numel() for p in aux.parameters())
    rows = [(n, sum(v.numel() for v in descendant_state(aux, n, "clip", 0)[0].values()))
            for n in a.layers]
    total = sum(cnt for _, cnt in rows)
    ext = json.loads(meta.get("extract", "{}"))
    lines = ["| | parameters stored | ratio |", "|---|---:|---:|",
             *[f"| PT-FT {n}-layer CLIP | {cnt:,} | |" for n, cnt in rows],
             f"| PT-FT total ({', '.join(str(n) for n in a.layers)} layers) | {total:,} | 100% |",
             f"| {aux.method.upper()} learngene (blocks + coefficients) | {lg:,} | "
             f"{100 * lg / total:.1f}% |",
             f"| {aux.method.upper()} learngene file (+ embeddings, LNs, projections) | {lg_all:,} "
             f"| {100 * lg_all / total:.1f}% |",
             "", "| pre-training | steps | batch | seconds |", "|---|---:|---:|---:|",
             f"| extraction (once, all sizes) | {ext.get('step')} | {ext.get('batch_size')} | "
             f"{ext.get('elapsed', 0):.0f} |"]
    pt_steps = pt_secs = 0
    for path in a.ptft or []:
        s, t, b = _run_cost(path)
        lines.append(f"| PT-FT pre-training {path} | {s} | {b} | {t if t is None else round(t)} |")
        pt_steps += s or 0
        pt_secs += t or 0
    if a.ptft and ext.get("elapsed"):
        lines.append(f"| PT-FT total / extraction | {pt_steps / max(1, ext.get('step') or 1):.2f}x "
                     f"steps | | {pt_secs / max(1e-9, ext['elapsed']):.2f}x time |")
    print("\n".join(lines))


# -----------------------------------------------------------------------------
# main


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help with "(default: X)" where X says something (not None, False or already in the
    help)."""

    def _get_help_string(self, action):
        h = action.help or ""
        if action.option_strings and action.default not in (None, argparse.SUPPRESS) \
                and action.default is not False and "default" not in h:
            h += " (default: %(default)s)"
        return h


def add_train_flags(p, lr_help="", data_help=""):
    """The training flags in groups; those left unset are filled from Table 6 (table6_defaults)."""
    g = p.add_argument_group("data")
    g.add_argument("--data", default="shapes",
                   help=data_help or "shapes, tar shards, CSV, Karpathy JSON")
    g.add_argument("--image_root", help="folder the image paths of a CSV / Karpathy JSON are under")
    g.add_argument("--csv_img_key", default="filepath", help="CSV column of the image paths")
    g.add_argument("--csv_caption_key", default="title", help="CSV column of the captions")
    g.add_argument("--csv_separator", help="default: tab if the header has one, else comma")
    g.add_argument("--num_workers", type=int, default=0, help="data loading processes per rank")
    g = p.add_argument_group("schedule (unset: Table 6's, see --lr)")
    g.add_argument("--max_steps", type=int,
                   help="default: from --epochs off shapes, Table 6 sized on shapes")
    g.add_argument("--epochs", type=float,
                   help="epochs when --max_steps is not given (default: Table 6's off shapes)")
    g.add_argument("--warmup", type=int, help="warm-up steps (-1: 10%% of the steps)")
    g.add_argument("--batch_size", type=int, help="global batch size")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, help=lr_help)
    g.add_argument("--wd", type=float,
                   help="AdamW weight decay on matrices (not on gains, biases, coefficients)")
    g.add_argument("--grad_clip", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("machine")
    g.add_argument("--device", help="default: cuda if available, else cpu")
    g.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"],
                   help="autocast dtype on CUDA (CPU: fp32)")
    g.add_argument("--compile", action="store_true", help="torch.compile the training step")
    g = p.add_argument_group("output")
    g.add_argument("--out_dir", help="the run's folder (finetune: out/finetune_<task> when unset)")
    g.add_argument("--log_interval", type=int, default=10, help="steps per metrics.jsonl record")
    g.add_argument("--save_interval", type=int, default=200,
                   help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--stop_at", type=int,
                   help="stop at this step with a checkpoint, as if preempted")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --out_dir with its saved flags")
    g.add_argument("--overwrite", action="store_true",
                   help="a new run on an out_dir with a checkpoint: remove it")
    g.add_argument("--wandb", metavar="PROJECT",
                   help="also send the metrics.jsonl records to this Weights & Biases project "
                        "(rank 0; needs `pip install wandb`)")
    return p.add_argument_group("model")


SCRIPT_HELP = ("the model code for --init's checkpoint (default: the script its config.json "
               "records, run only from beside this file; any other file only when named here)")


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_parser = functools.partial(sub.add_parser, formatter_class=HelpFormatter)
    p = add_parser("extract", help="distil a teacher CLIP into the learngene (paper: CC3M+CC12M, "
                                   "--model ViT-S-16, Table 6's schedule: the defaults off shapes)")
    g = add_train_flags(p, lr_help="default: Table 6 (1e-3, --wd 0.1); off shapes also warm-up 10k "
                                   "steps, batch 512, --epochs 32; on shapes 500 steps, batch 64, "
                                   "warm-up 50")
    g.add_argument("--init", "--teacher", dest="init",
                   help="the ancestry (teacher): il_clip.py out_dir, checkpoint/ folder or "
                        "OpenAI-layout .safetensors/.pt (--teacher: an alias)")
    g.add_argument("--script", help=SCRIPT_HELP)
    g.add_argument("--vocab", help="bpe_simple_vocab_16e6.txt.gz for a bare OpenAI weight file")
    g.add_argument("--quick_gelu", action=argparse.BooleanOptionalAction,
                   help="the teacher's activation (printed at start); default: what "
                        "open_clip_config.json / config.json beside it says, else (a bare weight "
                        "file) QuickGELU as OpenAI's CLIPs")
    g.add_argument("--model", default="shapes", choices=list(AUX_PRESETS),
                   help="the auxiliary model's preset")
    for flag in ("--aux_width", "--aux_heads", "--aux_layers", "--patch_size"):
        g.add_argument(flag, type=int, help="default: the preset's")
    g = p.add_argument_group("method")
    g.add_argument("--method", default="mmlg", choices=["mmlg", "tleg", "helg"])
    g.add_argument("--helg_layers", type=int, default=3,
                   help="He-LG: layers per tower kept as the learngene")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--no_mm", action="store_true",
                   help="extra (not Table 4): extract without multimodal blocks")
    x.add_argument("--only_mm", action="store_true",
                   help="extra (not Table 4): extract multimodal blocks only")
    g.add_argument("--lambda_dist", type=float, default=1.0, help="lambda of Eq. 8 (paper: 1)")
    p.set_defaults(func=cmd_extract, out_dir="out/learngene")
    p = add_parser("expand", help="learngene -> descendant out_dir (OpenAI layout)")
    p.add_argument("--learngene", required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--modality", default="clip", choices=["clip", "vision", "text"])
    p.add_argument("--part", default="both", choices=["both", "no_mm", "only_mm"],
                   help="Table 4's ablations at initialisation, from one full MM-LG learngene: "
                        "no_mm leaves the multimodal term c^m theta^m out of Eq. 1-2, only_mm the "
                        "unimodal term; the kept term keeps its extracted coefficient (nothing "
                        "rescaled or random); embeddings, LNs and projections stay")
    p.add_argument("--width", type=int, help="expected width (checked; default: not checked)")
    p.add_argument("--seed", type=int, default=0, help="He-LG: seed of the random layers")
    p.add_argument("--out_dir", help="default: out/descendant_<method>_<modality><layers>")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a descendant already in --out_dir")
    p.set_defaults(func=cmd_expand)
    p = add_parser("finetune",
                   help="activation + fine-tuning (retrieval, classification or captioning)")
    g = add_train_flags(p, lr_help="default: Table 6 per task (retrieval 5e-5, classification "
                                   "1e-4, caption 2e-5; --wd 0.01). Off shapes every Table 6 value "
                                   "is the default: warm-up 10k/5k/5k steps, batch 256, --epochs "
                                   "50/500/10; on shapes 300 steps, batch 64, warm-up 30. "
                                   "Classification trains with RandomResizedCrop(0.08-1) + flip on "
                                   "ImageFolder data",
                        data_help="retrieval/caption: shapes, Karpathy JSON, CSV, shards; "
                                  "classification: shapes or an ImageFolder root with train/ and "
                                  "val/ (or test/)")
    g.add_argument("--init", help="descendant out_dir, il_clip.py out_dir (PT-FT) or scratch")
    g.add_argument("--script", help=SCRIPT_HELP)
    g.add_argument("--model", default="shapes", choices=list(AUX_PRESETS),
                   help="scratch: the preset")
    g.add_argument("--like", help="scratch: copy config + tokenizer from this out_dir")
    g.add_argument("--layers", type=int, help="scratch: depth (default: 6, or --like's)")
    g.add_argument("--modality", default="clip", choices=["clip", "vision"], help="scratch: towers")
    g.add_argument("--image_size", type=int, default=64, help="scratch without --like")
    g = p.add_argument_group("method: task and activation (appendix A.2)")
    g.add_argument("--task", default="retrieval",
                   choices=["retrieval", "classification", "caption"])
    g.add_argument("--activate_frac", type=float, default=0.1,
                   help="paper: 10%% of the pre-training data")
    g.add_argument("--activate_epochs", type=float, default=1.0)
    g.add_argument("--activate_steps", type=int,
                   help="default: computed from --activate_frac and --activate_epochs")
    g.add_argument("--activate_data",
                   help="default: the learngene's extraction data, recorded in the descendant "
                        "(required if not recorded)")
    g.add_argument("--activate_lr", type=float, default=5e-4)
    g.add_argument("--train_size", type=int,
                   help="classification: a seeded class-stratified subsample of N training images "
                        "(default: all)")
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval_split", default="auto",
                   help="auto: ImageFolder val/ else test/; shapes/JSON: test")
    g.add_argument("--eval_size", type=int,
                   help="opt-in seeded subsample: N images (classification: stratified by class; "
                        "retrieval and captioning: N images with all their captions). Default: the "
                        "whole split")
    g.add_argument("--eval_data",
                   help="retrieval/caption evaluation data when --data is a CSV or shards (no test "
                        "split); default: --data's test split")
    g = p.add_argument_group("captioning")
    g.add_argument("--lm", help="folder with GPT-2's model.safetensors + tokenizer.json (or "
                                "vocab.json + merges.txt); default on shapes: a stand-in GPT "
                                "trained beside --out_dir")
    g.add_argument("--beam", type=int, default=1, help="decoding: 1 greedy, >1 beam search")
    g.add_argument("--no_repeat_ngram", type=int, default=0,
                   help="decoding: no n-gram of this many tokens twice in a caption (0: off)")
    g.add_argument("--caption_input", default="embed", choices=["embed", "grid", "scene"],
                   help="what the mapper reads: embed, CLIP's image embedding (ClipCap); grid, "
                        "every token of the encoder's last layer; scene (shapes), the oracle: "
                        "the true objects, no pixels")
    g.add_argument("--baselines", action="store_true",
                   help="also score the best constant caption (the pool's training caption of "
                        "highest CIDEr-D) and the nearest-neighbour caption (of the pool image "
                        "most similar in the frozen encoder's embedding), on the same images and "
                        "references")
    g.add_argument("--baseline_pool", type=int, default=1000,
                   help="--baselines: the first N training images")
    p.set_defaults(func=cmd_finetune)
    p = add_parser("report",
                   help="storage / cost table (paper Table 3) and fine-tuning results side by side")
    p.add_argument("--learngene", help="learngene.safetensors: Table 3's storage and cost")
    p.add_argument("--layers", type=int, nargs="+", default=[6, 8, 12],
                   help="--learngene: descendant depths")
    p.add_argument("--ptft", nargs="*",
                   help="il_clip.py out_dirs of the directly pre-trained sizes")
    p.add_argument("--results", nargs="*", help="finetune out_dirs: one row each (Tables 1, 2, 4)")
    p.add_argument("--seeds",
                   help="a folder of finetune out_dirs (several seeds): mean ± 95%% interval per "
                        "setting and paired differences against --baseline")
    p.add_argument("--baseline",
                   help="with --seeds: the setting every other is paired with, e.g. 'mmlg both 6 "
                        "retrieval' (default: MM-LG of the same size and task)")
    p.set_defaults(func=cmd_report)
    return ap


def main(argv=None):
    a = build_parser().parse_args(argv)     # argv None: sys.argv[1:], here and in resume_flags
    _wandb.update(run=None, offset=0, next=0)
    handlers = lifecycle.catch_stop_signals()
    try:
        if a.cmd in ("extract", "finetune"):
            a.out_dir = a.out_dir or f"out/finetune_{a.task}"
            if a.resume:
                resume_flags(a, argv)
            # (with --resume, claim_out_dir says what is missing)
            if a.init is None and not a.resume:
                raise ConfigError(f"{a.cmd} needs --init "
                                  f"({'the teacher' if a.cmd == 'extract' else 'a descendant'})")
            oracle = a.cmd == "finetune" and a.caption_input == "scene"
            if oracle and not (is_shapes(a.data) and a.eval_data in (None, a.data)):
                raise ConfigError("--caption_input scene (the oracle) reads the true objects of "
                                  "shapes images: it needs --data shapes and no other --eval_data")
        # on every rank, before training: the package is optional
        if getattr(a, "wandb", None):
            try:
                import wandb  # noqa: F401
            except ImportError:
                raise ConfigError("--wandb needs the wandb package (pip install wandb)") from None
        a.func(a)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()      # no rank tears down its connections while another still writes
    except data.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        # before its first step: the out_dir it made goes
        lifecycle.release_out_dir(failed=True)
        sys.exit(2)
    except NonFiniteError as e:
        print(str(e), file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as e:
        if lifecycle.write_error(e) is None:
            raise
        print(f"error: {getattr(e, 'filename', None) or a.out_dir}: {lifecycle.write_error(e)}; "
              f"the last good checkpoint is kept", file=sys.stderr)
        lifecycle.release_out_dir(failed=True)
        sys.exit(2)
    finally:
        if _wandb["run"] is not None:
            _wandb["run"].finish()
        lifecycle.release_out_dir()
        # only now: a signal during the final save is not fatal
        lifecycle.restore_signals(handlers)
        if dist.is_available() and dist.is_initialized():
            gc.collect()    # the DDP wrapper (in a reference cycle) holds the group: it goes first
            dist.destroy_process_group()


# -----------------------------------------------------------------------------
# Infrastructure: the run lifecycle is data.py's (the out_dir lock, checkpoint/ with sha256.json and
# the fallback to checkpoint.prev/, RNG states, write errors, stop signals, metrics.jsonl + wandb,
# the curve). This script's own: what a phase's state.pt holds (step, time, loader position, AdamW
# state, RNG states) and its restore, the flags --resume lets change, the files --overwrite removes,
# the start and done lines.

# --resume: run-control flags may change; those not given now keep their saved values,
# but ALWAYS_NOW's
ALWAYS_NOW = ("stop_at", "device", "resume", "overwrite", "out_dir")
RUN_CONTROL = (*ALWAYS_NOW, "save_interval", "log_interval", "num_workers")
RUN_FILES = (r"metrics\.jsonl", r"loss_curve\.png", r"learngene\.safetensors", r"results\.json",
             r"model\.safetensors", r"config\.json", r"tokenizer\.json", r"captions\.json",
             r"wandb_id(\.txt)?", r"checkpoint(\.prev|\.tmp)?")
# state.pt, checked to its leaves before --resume restores anything from it
# (lifecycle.read_checkpoint)
STATE_TYPES = {"step": int, "elapsed": (int, float), "loader": data.LOADER_STATE,
               "optimizer": lifecycle.OPTIMIZER_STATE, "rng": lifecycle.RNG_STATE}
# --wandb: the module while a run is open; phase step offsets
_wandb = {"run": None, "offset": 0, "next": 0}


def start_line(a, what, model, device, world, loader, rank, more=(), resumed=None):
    """The run's first line (rank 0): script, subcommand, parameters, device x world size, data,
    `more`, out_dir, and with --resume where it continues (`resumed`: "step N", "finetune step
    N")."""
    if rank == 0:
        n = f" ({loader.num_samples} training samples)" if getattr(loader, "num_samples", None) else ""
        details = [f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters",
                   f"{device} x {world}", f"data {a.data}{n}", *more]
        lifecycle.start_line(__file__, what, details, a.out_dir, resumed)


def end_line(a, steps, t_start, files, result=""):
    """The run's last line (rank 0): steps (and `result`), time, what was written where."""
    wrote = [os.path.join(a.out_dir, f) for f in files]
    lifecycle.done_line(f"step {steps}/{steps}{result}", time.time() - t_start, wrote)


def save_run(run):
    """Rank 0 writes; never a checkpoint with non-finite weights or optimizer state."""
    if run.out_dir is None or run.rank != 0:
        return
    sd, opt = run.raw.state_dict(), run.opt.state_dict()
    if not lifecycle.all_finite([sd, opt["state"]]):
        raise NonFiniteError(f"{run.tag}: non-finite weights at step {run.step}; stopped, the last "
                             f"good checkpoint is kept")
    state = {"step": run.step, "elapsed": run.elapsed, "loader": run.loader.state_dict(),
             "optimizer": opt, "rng": lifecycle.rng_state(run.device)}
    lifecycle.save_checkpoint(run.out_dir, sd, state,
                              {**run.config, "script": lifecycle.script_record(__file__)},
                         run.tokenizer, run.step, run.newest_damaged)
    run.newest_damaged = False
    if run.on_save:
        run.on_save(run)


def load_run(run, ckpt=None):
    """The newest usable checkpoint (`ckpt`, or read now) into model, optimizer, loader and RNGs:
    the run goes on bit-exactly."""
    ckpt = ckpt or lifecycle.load_checkpoint(run.out_dir, STATE_TYPES, rank=run.rank)
    folder, model_sd, st, _, run.newest_damaged = ckpt
    lifecycle.load_state(run.raw, model_sd, folder)
    try:
        run.opt.load_state_dict(st["optimizer"])
        run.loader.load_state_dict(st["loader"])
        lifecycle.set_rng_state(st["rng"], run.device)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError) as e:
        raise data.DataError(f"{folder}/state.pt: wrong types ({type(e).__name__}: {e})") from None
    run.step, run.elapsed = st["step"], st["elapsed"]
    if run.rank == 0:       # no step logged twice
        lifecycle.cut_metrics(os.path.join(run.out_dir, "metrics.jsonl"), run.step)


def phase_dirs(a):
    return [os.path.join(a.out_dir, t) for t in ("activate", "finetune")] \
        if a.cmd == "finetune" else [a.out_dir]


def resume_flags(a, argv):
    """--resume: the saved run's flags (its newest checkpoint's config.json that sha256.json vouches
    for); a run-defining flag given with another value is refused; run control may change."""
    for folder in (os.path.join(d, c) for d in phase_dirs(a)[::-1]
                   for c in ("checkpoint", "checkpoint.prev")):
        with contextlib.suppress(OSError, data.DataError, LookupError, TypeError):
            path = os.path.join(folder, "config.json")
            if lifecycle.sha256(path) == \
                    lifecycle.read_json(os.path.join(folder, "sha256.json"))["config.json"]:
                saved = lifecycle.read_json(path)["args"]
                break
    else:
        return                       # claim_out_dir says there is nothing to resume
    ap = build_parser()             # the flags given on the command line: every default suppressed
    for p in [ap, *next(x for x in ap._actions
                        if isinstance(x, argparse._SubParsersAction)).choices.values()]:
        p._defaults.clear()
        for action in p._actions:
            action.default = argparse.SUPPRESS
    for k, v in lifecycle.resumed_flags(vars(ap.parse_args(argv)), saved, RUN_CONTROL,
                                        path, ALWAYS_NOW).items():
        if hasattr(a, k):
            setattr(a, k, v)


def run_flags(a) -> dict:
    return {k: v for k, v in vars(a).items() if k != "func"}


if __name__ == "__main__":
    lifecycle.hold_stop_signals_to_exit()
    main()
