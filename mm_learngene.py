"""
mm_learngene.py -- MM-LG (Chen et al., "Extracting Multimodal Learngene in CLIP"), the first
public implementation, plus the learngene baselines it is compared with (He-LG, TLEG).

  extract   distil an ancestry CLIP (il_clip.py out_dir or OpenAI-layout weights) into a
            weight-shared auxiliary CLIP-ViT-S whose layers are built from the learngene
            (two block groups theta1, theta2 of {vision, language, multimodal} blocks plus
            coefficient vectors c^v, c^l, c^mv, c^ml); writes learngene.safetensors.
  expand    learngene -> a normal descendant (CLIP / vision / text, any depth up to 2x the
            unique layers) in OpenAI state-dict layout, as an out_dir that il_clip.py loads.
  finetune  activation (short contrastive training on a fraction of the data, one epoch)
            then fine-tuning for retrieval (I2T/T2I R@1) or classification (top-1).
            Baselines: --init scratch, --init <il_clip out_dir> (PT-FT), He-LG and TLEG
            descendants (extract --method helg|tleg), ablations extract --no_mm / --only_mm.
  report    parameter storage and pre-training cost, like the paper's Table 3.

Reads top to bottom: config -> model -> learngene parametrisations -> losses -> training
loop -> subcommands -> main. The only repo import is data.py (and il_clip.py, when present,
to load a teacher that may carry a codebook head).

Every choice the paper leaves open is marked "CHOICE:" next to the equation it concerns.
"""
import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import data


class ConfigError(Exception):
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
# the vision, language and multimodal blocks have the same shapes (SPEC.md 3).
AUX_PRESETS = {
    "shapes": dict(width=128, heads=4, layers=12, patch_size=8, embed_dim=128),
    "ViT-S-16": dict(width=384, heads=6, layers=12, patch_size=16, embed_dim=384),
}

# The Linear weights and biases of one transformer layer: the "theta" of the paper
# ("the entirety of weights and biases of linear processes for MSA and MLP", Sec. 3.1).
LINEAR_NAMES = ["attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight", "attn.out_proj.bias",
                "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"]
LN_NAMES = ["ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias"]
TOWERS = ("visual", "text")
# tower -> (unimodal block name, unimodal coefficient, multimodal coefficient), Eq. 1 and Eq. 2
TOWER_PARTS = {"visual": ("vision", "v", "mv"), "text": ("language", "l", "ml")}
LEARNGENE_PREFIXES = ("learngene.", "shared_ln.", "tleg.")

# -----------------------------------------------------------------------------
# Model: OpenAI CLIP layout (copied from il_clip.py's design on purpose: this script is
# forked on its own). One functional block so the weight-shared auxiliary model, the
# learngene expansion and the normal descendants run exactly the same arithmetic.


def block_fn(x, p: dict, heads: int, causal: bool, quick_gelu: bool):
    """Pre-LN transformer layer on [B, T, W] with parameters `p` in OpenAI key names."""
    B, T, W = x.shape
    h = F.layer_norm(x, (W,), p["ln_1.weight"], p["ln_1.bias"], 1e-5)
    q, k, v = F.linear(h, p["attn.in_proj_weight"], p["attn.in_proj_bias"]).split(W, dim=-1)
    q, k, v = (t.view(B, T, heads, W // heads).transpose(1, 2) for t in (q, k, v))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2).reshape(B, T, W)
    x = x + F.linear(a, p["attn.out_proj.weight"], p["attn.out_proj.bias"])
    h = F.linear(F.layer_norm(x, (W,), p["ln_2.weight"], p["ln_2.bias"], 1e-5), p["mlp.c_fc.weight"], p["mlp.c_fc.bias"])
    h = h * torch.sigmoid(1.702 * h) if quick_gelu else F.gelu(h)
    return x + F.linear(h, p["mlp.c_proj.weight"], p["mlp.c_proj.bias"])


class Attention(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.in_proj_weight = nn.Parameter(torch.empty(3 * w, w))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * w))
        self.out_proj = nn.Linear(w, w)


class MLP(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.c_fc = nn.Linear(w, 4 * w)
        self.c_proj = nn.Linear(4 * w, w)


class Block(nn.Module):
    """Parameter container of one layer (OpenAI names); `ln=False` gives a learngene theta."""

    def __init__(self, w, ln=True):
        super().__init__()
        self.attn, self.mlp = Attention(w), MLP(w)
        if ln:
            self.ln_1, self.ln_2 = nn.LayerNorm(w), nn.LayerNorm(w)

    def params(self) -> dict:
        return dict(self.named_parameters())


class LNPair(nn.Module):
    """ln_1, ln_2 of a layer; in MM-LG one pair per modality is shared by all layers (Sec. 3.1)."""

    def __init__(self, w):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(w), nn.LayerNorm(w)


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
        self.transformer = nn.Module()
        self.transformer.resblocks = nn.ModuleList(Block(w) for _ in range(cfg.vision_layers))
        for b in self.transformer.resblocks:
            init_block(b, w, cfg.vision_layers)
        self.ln_post = nn.LayerNorm(w)
        self.proj = nn.Parameter(scale * torch.randn(w, cfg.embed_dim))

    def forward(self, images, layers=None):
        """Pooled CLS feature after ln_post (before proj). `layers`: list of per-layer param
        dicts (the auxiliary model's computed layers); None = this module's own resblocks."""
        x = self.conv1(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1), x], 1) + self.positional_embedding
        x = self.ln_pre(x)
        for p in layers if layers is not None else [b.params() for b in self.transformer.resblocks]:
            x = block_fn(x, p, self.cfg.vision_heads, False, self.cfg.quick_gelu)
        return self.ln_post(x[:, 0])


class TextTransformer(nn.Module):
    """The text tower with OpenAI's top-level key names (token_embedding, positional_embedding,
    transformer.resblocks, ln_final, text_projection): CLIP subclasses it to keep that layout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        w, self.cfg = cfg.text_width, cfg
        self.token_embedding = nn.Embedding(cfg.vocab_size, w)
        self.positional_embedding = nn.Parameter(torch.empty(cfg.context_length, w))
        self.transformer = nn.Module()
        self.transformer.resblocks = nn.ModuleList(Block(w) for _ in range(cfg.text_layers))
        for b in self.transformer.resblocks:
            init_block(b, w, cfg.text_layers)
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
        return x[torch.arange(x.shape[0], device=x.device), (text == self.cfg.eot_token_id).int().argmax(-1)]

    def layer_list(self, tower):  # the auxiliary model overrides this
        return None

    def encode_text(self, text):
        return F.normalize(self.text_features(text, self.layer_list("text")) @ self.text_projection, dim=-1)


class CLIP(TextTransformer):
    """OpenAI-layout CLIP: text keys at top level, `visual.*`, `logit_scale`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.visual = VisionTransformer(cfg)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def encode_image(self, images):
        return F.normalize(self.visual(images, self.layer_list("visual")) @ self.visual.proj, dim=-1)

    def forward(self, images, text):
        return self.encode_image(images), self.encode_text(text), self.logit_scale.exp()


# -----------------------------------------------------------------------------
# Learngene parametrisations of the auxiliary model (paper Sec. 3.1, Fig. 3)
#
# INDEX MAPPING (paper Eq. 1-2, Fig. 3a; SPEC.md 3). The paper says: the two groups are
# "used alternately and repeatedly, one group is shared twice and then switched", and
# "every weight scalar element [of a coefficient vector of length L/2] is shared twice
# prior to the next one", and gives the example "layer 6: group 2, coefficient 3"
# (1-indexed). With 0-indexed layers i = 0..L-1 this reads
#     group g = (i // 2) % 2      coefficient k = i // 2
#     L = 12:  i  0  1  2  3  4  5  6  7  8  9 10 11
#              g  0  0  1  1  0  0  1  1  0  0  1  1      (0 = theta1, 1 = theta2)
#              k  0  0  1  1  2  2  3  3  4  4  5  5
# The paper's example ("layer 6: block group index 2, coefficient index 3") is this reading
# with 0-indexed layers and coefficients and 1-indexed group names: i = 6 -> g = 1 (theta2),
# k = 3 (c_3). Consecutive layer pairs (2k, 2k+1) are therefore identical.
# Hence only L/2 layers are distinct: unique layer k uses (g = k % 2, c[k]) -- exactly the
# 6-layer descendant of Fig. 3b.


def aux_index(i: int) -> tuple:
    """Auxiliary layer i -> (block group g, coefficient index k). Paper Eq. 1-2 / Fig. 3a."""
    return (i // 2) % 2, i // 2


def descendant_index(k: int) -> tuple:
    """Unique (6-layer descendant) layer k -> (g, k). Paper Fig. 3b: aux layers 2k and 2k+1."""
    return k % 2, k


def expand_order(n: int, unique: int) -> list:
    """Descendant depth n -> which unique layer each of its layers copies (paper Sec. 3.3):
    "replicate each of the first n-6 layers once and connect them in sequence"
    (8 -> [0,0,1,1,2,3,4,5]; 12 -> [0,0,1,1,...,5,5] = the auxiliary model).
    CHOICE: n < unique keeps the first n unique layers (the paper only builds 6, 8, 12)."""
    if n < 1:
        raise ConfigError(f"--layers must be >= 1, got {n}")
    if n > 2 * unique:
        raise ConfigError(f"--layers {n}: a learngene with {unique} unique layers fills at most {2 * unique} "
                          f"layers (each unique layer is replicated at most once)")
    if n <= unique:
        return list(range(n))
    rep = n - unique
    return [k for k in range(rep) for _ in (0, 1)] + list(range(rep, unique))


def mix(terms, name):
    """sum_j c_j * theta_j[name] -- the weighted sum of Eq. 1 / Eq. 2, one function for the
    auxiliary forward and the expansion so n = 12 reproduces the auxiliary model bit for bit."""
    out = None
    for c, theta in terms:
        t = c * theta[name]
        out = t if out is None else out + t
    return out


class AuxCLIP(CLIP):
    """The auxiliary CLIP built from the learngene.

    method "mmlg" (paper): learngene.theta{1,2}.{vision,language,multimodal}.<linear names>,
      learngene.coef.{v,l,mv,ml} (length L/2), shared_ln.{visual,text}.ln_{1,2}.*; the
      towers' own resblocks are empty. Layer i of the vision tower (Eq. 1):
          W_i^v = c^v[k] * theta_g^v + c^mv[k] * theta_g^m,   (g, k) = aux_index(i)
      and of the language tower (Eq. 2):
          W_i^l = c^l[k] * theta_g^l + c^ml[k] * theta_g^m
      part "no_mm" drops theta^m and c^mv, c^ml; part "only_mm" drops theta^v, theta^l,
      c^v, c^l (W_i^v = c^mv[k] theta_g^m, W_i^l = c^ml[k] theta_g^m).
    method "tleg" (Xia et al. 2024b; SPEC.md 3): per tower tleg.{visual,text}.{A,B} full
      blocks (Linear + LayerNorm), layer l of an L-layer stack = A + (l / L) * B.
    method "helg" (Wang et al. 2022): an ordinary CLIP distilled from the teacher; the
      learngene is its last `helg_layers` layers per tower (expand fills the rest randomly).
    Everything else (patch/token/positional embeddings, ln_pre, ln_post, ln_final,
    projections, logit_scale) is an ordinary parameter, stored with the learngene.
    """

    def __init__(self, cfg: ModelConfig, method="mmlg", part="both", helg_layers=3):
        L = cfg.vision_layers
        if cfg.vision_layers != cfg.text_layers or cfg.vision_width != cfg.text_width or L < 2 or L % 2:
            raise ConfigError("the auxiliary model needs both towers with the same width and the same even depth")
        own = L if method == "helg" else 0
        super().__init__(dataclasses.replace(cfg, vision_layers=own, text_layers=own))
        self.aux_layers, self.method, self.part, self.helg_layers = L, method, part, helg_layers
        self.cfg = dataclasses.replace(self.cfg, vision_layers=L, text_layers=L)
        w = cfg.vision_width
        if method == "mmlg":
            names = [n for n, keep in (("vision", part != "only_mm"), ("language", part != "only_mm"),
                                       ("multimodal", part != "no_mm")) if keep]
            self.learngene = nn.Module()
            for g in ("theta1", "theta2"):
                setattr(self.learngene, g, nn.ModuleDict({n: Block(w, ln=False) for n in names}))
                for b in getattr(self.learngene, g).values():
                    init_block(b, w, L)
            # CHOICE (init of c, not given by the paper): with both parts 1/sqrt(2) each, so
            # c*theta + c'*theta^m of two independent OpenAI-initialised blocks has the variance
            # of one; with a single part 1. Coefficients get no weight decay (it would pull
            # them, and with them every layer, towards zero).
            c0 = 1.0 if part != "both" else 2 ** -0.5
            coefs = [n for n, keep in (("v", part != "only_mm"), ("l", part != "only_mm"),
                                       ("mv", part != "no_mm"), ("ml", part != "no_mm")) if keep]
            self.learngene.coef = nn.ParameterDict({c: nn.Parameter(torch.full((L // 2,), c0)) for c in coefs})
            # Paper: "The Layer Normalization part is shared in each Transformer layer";
            # SPEC: one set per modality.
            self.shared_ln = nn.ModuleDict({t: LNPair(w) for t in TOWERS})
        elif method == "tleg":
            self.tleg = nn.ModuleDict({t: nn.ModuleDict({"A": Block(w), "B": Block(w)}) for t in TOWERS})
            for t in TOWERS:
                init_block(self.tleg[t]["A"], w, L)
                init_block(self.tleg[t]["B"], w, L)
                # CHOICE: B starts with the same random Linear init as A (so layers differ
                # from step 0) and zero LayerNorm gains/biases (LN of every layer starts as A's).
                with torch.no_grad():
                    for n in LN_NAMES:
                        self.tleg[t]["B"].get_parameter(n).zero_()
        elif method != "helg":
            raise ConfigError(f"unknown --method {method}")

    # --- the layers of a stack of depth n built from the learngene ---------------------------
    def mmlg_layer(self, tower, g, k):
        uni, cu, cm = TOWER_PARTS[tower]
        theta = getattr(self.learngene, ("theta1", "theta2")[g])
        coef = self.learngene.coef
        terms = []
        if self.part != "only_mm":
            terms.append((coef[cu][k], theta[uni].params()))
        if self.part != "no_mm":
            terms.append((coef[cm][k], theta["multimodal"].params()))
        p = {n: mix(terms, n) for n in LINEAR_NAMES}
        p.update(self.shared_ln[tower].named_parameters())
        return p

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

    def descendant_layers(self, tower, n, seed=0):
        """Per-layer param dicts of an n-layer descendant tower (paper Sec. 3.3)."""
        if self.method == "mmlg":
            return [self.mmlg_layer(tower, *descendant_index(k)) for k in expand_order(n, self.aux_layers // 2)]
        if self.method == "tleg":  # TLEG: theta_l = theta_A + (l / n) theta_B, l = 0..n-1
            return [self.tleg_layer(tower, l, n) for l in range(n)]
        # He-LG: the last K layers of the distilled model on top of n-K random layers
        if n < 1:
            raise ConfigError(f"--layers must be >= 1, got {n}")
        blocks = (self.visual.transformer.resblocks if tower == "visual" else self.transformer.resblocks)
        kept = [b.params() for b in blocks[self.aux_layers - min(n, self.helg_layers):]]
        gen = torch.Generator().manual_seed(seed * 2 + (tower == "text"))
        fresh = []
        for _ in range(n - len(kept)):
            b = Block(self.cfg.vision_width)
            init_block(b, self.cfg.vision_width, n, gen)
            fresh.append(b.params())
        return fresh + kept

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


def descendant_state(aux: AuxCLIP, n: int, modality: str, seed: int = 0) -> tuple:
    """Normal descendant state dict (OpenAI layout) + its ModelConfig. Paper Sec. 3.3:
    layers from the learngene; "components other than the learngene could be loaded directly
    like Embedding or Layer Normalization"; per-layer LNs = the shared ones (MM-LG)."""
    if modality not in ("clip", "vision", "text"):
        raise ConfigError(f"--modality must be clip, vision or text, got {modality}")
    towers = {"clip": TOWERS, "vision": ("visual",), "text": ("text",)}[modality]
    sd = {}
    with torch.no_grad():
        for k, v in aux.state_dict().items():
            if k.startswith(LEARNGENE_PREFIXES) or ".resblocks." in k:
                continue
            tower = "visual" if k.startswith("visual.") else ("clip" if k == "logit_scale" else "text")
            if tower in towers or (tower == "clip" and modality == "clip"):
                sd[k] = v.detach().clone()
        for tower in towers:
            prefix = "visual.transformer.resblocks." if tower == "visual" else "transformer.resblocks."
            for i, p in enumerate(aux.descendant_layers(tower, n, seed)):
                for name, t in p.items():
                    sd[f"{prefix}{i}.{name}"] = t.detach().clone().contiguous()
    cfg = dataclasses.replace(aux.cfg, vision_layers=n if "visual" in towers else 0,
                              text_layers=n if "text" in towers else 0)
    return sd, cfg


# -----------------------------------------------------------------------------
# Reading checkpoints: il_clip.py out_dirs, descendants, OpenAI-layout weight files


def read_state(path: str) -> tuple:
    """(state dict, config dict or {}) of an out_dir (model.safetensors + config.json) or a
    .safetensors / .pt (weights_only) OpenAI-layout file."""
    cfg = {}
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "config.json")):
            with open(os.path.join(path, "config.json")) as f:
                cfg = json.load(f)
        path = os.path.join(path, "model.safetensors")
    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such file")
    try:
        if path.endswith(".safetensors"):
            sd = load_file(path)
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
            sd = sd.get("state_dict", sd) if isinstance(sd, dict) else sd
            if not isinstance(sd, dict):
                raise ValueError("not a state dict")
    except Exception as e:  # a user's file: one line, no traceback
        raise ConfigError(f"{path}: cannot read weights ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    return {k.removeprefix("module."): v for k, v in sd.items()}, cfg


def _cfg_value(cfg: dict, key: str, default):
    for d in (cfg.get("model") if isinstance(cfg.get("model"), dict) else {}, cfg.get("model_config") or {}, cfg):
        if key in d:
            return d[key]
    return default


def infer_config(sd: dict, cfg: dict, path: str, need=("visual", "text")) -> ModelConfig:
    """ModelConfig from OpenAI-layout tensor shapes; heads (not visible in shapes) from
    config.json, else OpenAI's width // 64 convention."""
    required = {"visual": ["visual.conv1.weight", "visual.positional_embedding", "visual.proj", "visual.ln_post.weight"],
                "text": ["token_embedding.weight", "positional_embedding", "text_projection", "ln_final.weight"]}
    for tower in need:
        missing = [k for k in required[tower] if k not in sd]
        if missing:
            raise ConfigError(f"{path}: cannot read the {'vision' if tower == 'visual' else 'text'} tower "
                              f"(missing {missing[0]})")
    c = ModelConfig()
    count = lambda prefix: len({k[len(prefix):].split(".")[0] for k in sd if k.startswith(prefix)})
    if "visual" in need:
        vw, _, p, _ = sd["visual.conv1.weight"].shape
        grid = int(round(math.sqrt(sd["visual.positional_embedding"].shape[0] - 1)))
        c = dataclasses.replace(c, vision_width=vw, patch_size=p, image_size=grid * p,
                                vision_layers=count("visual.transformer.resblocks."),
                                vision_heads=_cfg_value(cfg, "vision_heads", max(1, vw // 64)),
                                embed_dim=sd["visual.proj"].shape[1])
    else:
        c = dataclasses.replace(c, vision_layers=0)
    if "text" in need:
        tw = sd["ln_final.weight"].shape[0]
        c = dataclasses.replace(c, text_width=tw, vocab_size=sd["token_embedding.weight"].shape[0],
                                context_length=sd["positional_embedding"].shape[0],
                                text_layers=count("transformer.resblocks."),
                                text_heads=_cfg_value(cfg, "text_heads", max(1, tw // 64)),
                                embed_dim=sd["text_projection"].shape[1])
    else:
        c = dataclasses.replace(c, text_layers=0)
    # a bare weight file (no config.json) follows OpenAI: QuickGELU, EOT = the last vocab id
    bare = not cfg
    return dataclasses.replace(c, eot_token_id=_cfg_value(cfg, "eot_token_id", c.vocab_size - 1 if bare else c.eot_token_id),
                               quick_gelu=bool(_cfg_value(cfg, "quick_gelu", bare)))


def load_teacher(path: str, vocab=None):
    """The frozen ancestry CLIP in eval mode: (model with encode_image/encode_text/logit_scale,
    tokenizer). Both towers are checked first so a broken file is one clear line; il_clip.py's
    loader is used when present (it knows codebook heads), else this script's CLIP."""
    sd, cfg = read_state(path)
    if any(k.startswith(LEARNGENE_PREFIXES) for k in sd):
        raise ConfigError(f"{path}: this is a learngene file, not a CLIP teacher")
    mcfg = infer_config(sd, cfg, path)
    tok = None
    try:
        import il_clip
        loader = getattr(il_clip, "load_model", None)
    except ImportError:
        loader = None
    if loader is not None:
        try:
            model, tok, _ = loader(path)
        except Exception as e:
            raise ConfigError(f"cannot read teacher {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    else:
        model = CLIP(mcfg)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if missing:
            raise ConfigError(f"{path}: cannot read the teacher towers (missing {missing[0]})")
    if tok is None:
        tdir = path if os.path.isdir(path) else os.path.dirname(path)
        if vocab:
            tok = data.build_tokenizer(vocab_path=vocab, context_length=mcfg.context_length)
        elif os.path.exists(os.path.join(tdir, "tokenizer.json")):
            tok = data.Tokenizer.load(tdir)
        else:
            raise ConfigError(f"{path}: no tokenizer.json beside the teacher; pass --vocab bpe_simple_vocab_16e6.txt.gz")
    model.eval().requires_grad_(False)
    return model, tok, mcfg


def load_learngene(path: str, width=None) -> tuple:
    """AuxCLIP + metadata (incl. the tokenizer JSON) from learngene.safetensors."""
    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such learngene file")
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
        sd = load_file(path)
        info = json.loads(meta["learngene"])
    except Exception as e:
        raise ConfigError(f"{path}: not a learngene file written by mm_learngene.py ({type(e).__name__})")
    cfg = ModelConfig(**info["model_config"])
    if width is not None and width != cfg.vision_width:
        raise ConfigError(f"{path}: learngene of width {cfg.vision_width}, expected width {width}")
    aux = AuxCLIP(cfg, info["method"], info["part"], info.get("helg_layers", 3))
    expected = aux.state_dict()
    for k, v in sd.items():
        if k in expected and expected[k].shape != v.shape:
            raise ConfigError(f"{path}: {k} has shape {tuple(v.shape)}, the file's config (width "
                              f"{cfg.vision_width}) needs {tuple(expected[k].shape)}: learngene from another width")
    missing, unexpected = aux.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ConfigError(f"{path}: learngene does not match its config (missing {missing[:1]}, unexpected {unexpected[:1]})")
    return aux, meta


# -----------------------------------------------------------------------------
# Losses (paper Eq. 3-8)


def gather(x, grad: bool):
    """All ranks' rows, in rank order; with grad for the local model's features."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    if grad:
        import torch.distributed.nn.functional as dnf
        return torch.cat(dnf.all_gather(x), 0)
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return torch.cat(out, 0)


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
    """CE(logit^aux, logit^anc) of Eq. 5-6. CHOICE (SPEC.md 3): soft-target cross-entropy with
    softmax(teacher logits) as the target distribution, row-wise, mean over rows, no extra
    distillation temperature (each model's own logit scale is its temperature)."""
    return -(teacher_logits.softmax(-1) * student_logits.log_softmax(-1)).sum(-1).mean()


def distill_loss(s_i2t, s_t2i, t_i2t, t_t2i):
    """Eq. 7: L_dist = (L_dist^i2t + L_dist^t2i) / 2."""
    return 0.5 * (soft_ce(s_i2t, t_i2t) + soft_ce(s_t2i, t_t2i))


# -----------------------------------------------------------------------------
# Training loop (nanoGPT conventions; shared by extract, activation and fine-tuning)


def setup_dist(device_arg):
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
    if device.startswith("cuda") and dtype in ("bfloat16", "float16"):
        return torch.autocast("cuda", dtype=getattr(torch, dtype))
    return contextlib.nullcontext()


def make_optimizer(model, lr, weight_decay, device):
    """AdamW(0.9, 0.98); weight decay on matrices only (not on gains, biases, coefficients,
    class embedding, logit_scale)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    extra = {"fused": True} if device.startswith("cuda") else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-6, **extra)


def lr_at(step, max_steps, lr, warmup):
    """Linear warm-up then cosine decay to lr/10 (CHOICE: the paper gives warm-up only)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, max_steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def atomic_save_file(tensors, path, metadata=None):
    tmp = path + ".tmp"
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp, metadata=metadata)
    os.replace(tmp, path)


def atomic_write_json(obj, path):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def optimizer_to_tensors(opt) -> tuple:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for name, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{pid}.{name}"] = v
            else:
                scalars[f"{pid}.{name}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_tensors(opt, tensors, info):
    state = {}
    for key, v in tensors.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    for key, v in info["scalars"].items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    opt.load_state_dict({"state": state, "param_groups": info["param_groups"]})


def plot_curve(metrics: list, path: str, key="loss"):
    """Loss curve PNG with PIL (no matplotlib in this project)."""
    from PIL import Image, ImageDraw
    pts = [(m["step"], m[key]) for m in metrics if key in m and math.isfinite(m[key])]
    if len(pts) < 2:
        return
    W, H, pad = 480, 300, 40
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    sx = lambda x: pad + (x - x0) / max(1e-9, x1 - x0) * (W - 2 * pad)
    sy = lambda y: H - pad - (y - y0) / max(1e-9, y1 - y0) * (H - 2 * pad)
    d.rectangle([pad, pad, W - pad, H - pad], outline="black")
    d.line([(sx(x), sy(y)) for x, y in pts], fill="blue", width=2)
    d.text((pad, 8), f"{key}: {ys[0]:.3f} -> {ys[-1]:.3f}", fill="black")
    d.text((pad, H - pad + 8), f"step {x0}", fill="black")
    d.text((W - pad - 60, H - pad + 8), f"step {x1}", fill="black")
    img.save(path)


class Trainer:
    """One training phase. `loss_fn(model, batch) -> (loss, {name: detached tensor})`, `model`
    being the DDP-wrapped module when world > 1. Nothing in a step waits for the device: the
    losses and a non-finite flag are read every `log_every` steps and before every checkpoint,
    so a NaN/inf stops the run before anything after it is saved. Checkpoints (when out_dir): model.safetensors,
    config.json, tokenizer.json, train_state.{safetensors,json}; all written atomically;
    `resume` continues exactly (optimizer, step, RNG, loader position)."""

    def __init__(self, model, loss_fn, loader, args, rank, world, device, out_dir=None, config=None,
                 tokenizer=None, tag="train", on_save=None):
        self.raw, self.loss_fn, self.loader, self.args = model, loss_fn, loader, args
        self.rank, self.world, self.device, self.out_dir, self.tag = rank, world, device, out_dir, tag
        self.config, self.tokenizer, self.on_save = config or {}, tokenizer, on_save
        self.model = model
        if world > 1:
            self.model = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.startswith("cuda") else None)
        if getattr(args, "compile", False):
            self.model = torch.compile(self.model)
        self.opt = make_optimizer(model, args.lr, args.weight_decay, device)
        self.step, self.metrics, self.stop = 0, [], False
        self.elapsed = 0.0

    def save(self):
        if self.out_dir is None or self.rank != 0:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        atomic_save_file(self.raw.state_dict(), os.path.join(self.out_dir, "model.safetensors"))
        atomic_write_json(self.config, os.path.join(self.out_dir, "config.json"))
        if self.tokenizer is not None:
            self.tokenizer.save(self.out_dir)
        tensors, info = optimizer_to_tensors(self.opt)
        atomic_save_file(tensors, os.path.join(self.out_dir, "train_state.safetensors"))
        atomic_write_json({"step": self.step, "elapsed": self.elapsed, "loader": self.loader.state_dict(),
                           "torch_rng": torch.get_rng_state().tolist(), "python_rng": list(random.getstate()[1]),
                           "numpy_rng": np.random.get_state()[1].tolist(), "optimizer": info},
                          os.path.join(self.out_dir, "train_state.json"))
        if self.on_save:
            self.on_save(self)

    def load(self):
        path = os.path.join(self.out_dir, "train_state.json")
        if not os.path.exists(path):
            raise ConfigError(f"--resume: {path} not found")
        with open(path) as f:
            st = json.load(f)
        self.raw.load_state_dict(load_file(os.path.join(self.out_dir, "model.safetensors")))
        optimizer_from_tensors(self.opt, load_file(os.path.join(self.out_dir, "train_state.safetensors")), st["optimizer"])
        self.step, self.elapsed = st["step"], st.get("elapsed", 0.0)
        self.loader.load_state_dict(st["loader"])
        torch.set_rng_state(torch.tensor(st["torch_rng"], dtype=torch.uint8))
        random.setstate((3, tuple(st["python_rng"]), None))
        np.random.set_state(("MT19937", np.array(st["numpy_rng"], dtype=np.uint32), 624, 0, 0.0))
        mpath = os.path.join(self.out_dir, "metrics.jsonl")
        if os.path.exists(mpath):
            with open(mpath) as f:
                self.metrics = [m for m in map(json.loads, f) if m["step"] <= self.step]

    def agree_flags(self, bad, done):
        """Every rank's non-finite flag and SIGTERM flag, combined (MAX) over ranks. SIGTERM reaches
        the ranks at different steps: agreeing here makes all of them stop at this same step, and
        none is left waiting in a collective the others have left. Returns whether to stop."""
        flags = torch.stack([bad.float(), torch.tensor(float(self.stop), device=self.device)])
        if self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad, stop = flags.tolist()
        if bad:
            raise ConfigError(f"{self.tag}: non-finite loss at a step <= {done}; stopped, "
                              f"the last good checkpoint is kept")
        return bool(stop)

    def run(self, max_steps, resume=False):
        a = self.args
        if resume:
            self.load()
        prev = signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stop", True))
        it = self.loader.forever()
        warmup = max(1, max_steps // 10) if a.warmup < 0 else a.warmup
        bar = range(self.step, max_steps)
        t0 = t_log = time.time()
        step_log = self.step
        bad = torch.zeros((), dtype=torch.bool, device=self.device)
        try:
            for self.step in bar:
                lr = lr_at(self.step, max_steps, a.lr, max(1, warmup))
                for g in self.opt.param_groups:
                    g["lr"] = lr
                batch = next(it)
                with autocast(self.device, a.dtype):
                    loss, parts = self.loss_fn(self.model, batch)
                bad |= ~torch.isfinite(loss.detach())
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                if a.grad_clip > 0:
                    nn.utils.clip_grad_norm_(self.raw.parameters(), a.grad_clip)
                self.opt.step()
                if hasattr(self.raw, "logit_scale"):
                    with torch.no_grad():
                        self.raw.logit_scale.clamp_(0, math.log(100))
                self.elapsed += time.time() - t0
                t0 = time.time()
                done = self.step + 1
                at_log = done % a.log_every == 0 or done == max_steps
                at_ckpt = bool(self.out_dir) and a.ckpt_every > 0 and done % a.ckpt_every == 0 and done < max_steps
                at_halt = bool(getattr(a, "halt_at", 0)) and done == a.halt_at and done < max_steps
                # flags are read (a device sync) only where every rank reads them at the same step;
                # one process may stop at any step
                stop = (at_log or at_ckpt or at_halt or (self.world == 1 and self.stop)) and self.agree_flags(bad, done)
                if self.rank == 0 and at_log:
                    vals = torch.stack([loss.detach().float(), *(v.float() for v in parts.values())]).tolist()
                    sps = a.batch_size * (done - step_log) / max(1e-9, time.time() - t_log)
                    t_log, step_log = time.time(), done
                    m = {"phase": self.tag, "step": done, "loss": vals[0], "lr": lr, "elapsed": round(self.elapsed, 3),
                         "samples_per_s": round(sps, 1), **dict(zip(parts, vals[1:]))}
                    self.metrics.append(m)
                    print(json.dumps(m), flush=True)
                    if self.out_dir:
                        os.makedirs(self.out_dir, exist_ok=True)
                        with open(os.path.join(self.out_dir, "metrics.jsonl"), "a") as f:
                            f.write(json.dumps(m) + "\n")
                self.step = done
                if (stop and done < max_steps) or at_halt:
                    self.save()
                    if self.rank == 0:
                        print(f"{self.tag}: {'SIGTERM' if stop else '--halt_at'}, checkpoint saved at step "
                              f"{done}; continue with --resume", flush=True)
                    if self.world > 1:      # as at the end of main: rank 0 has written before any rank exits
                        dist.barrier()
                    sys.exit(0)
                if at_ckpt:
                    self.save()
            self.agree_flags(bad, self.step)
            if self.out_dir:
                self.save()
                if self.rank == 0:
                    plot_curve(self.metrics, os.path.join(self.out_dir, "loss_curve.png"))
        finally:
            if prev is not None:
                signal.signal(signal.SIGTERM, prev)
        return self.metrics


def contrastive_loss_fn(model, batch, device):
    img, txt, scale = model(batch["image"].to(device), batch["text"].to(device))
    i2t, t2i, labels = clip_logits(img, txt, scale)
    loss = clip_loss(i2t, t2i, labels)
    return loss, {"clip": loss.detach()}


# -----------------------------------------------------------------------------
# Subcommand: extract (paper Sec. 3.1-3.2)


def cmd_extract(a):
    rank, world, device = setup_dist(a.device)
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    np.random.seed(a.seed)
    teacher, tok, tcfg = load_teacher(a.teacher, a.vocab)
    teacher.to(device)
    preset = dict(AUX_PRESETS[a.model])
    for k in ("width", "heads", "layers"):
        if getattr(a, f"aux_{k}") is not None:
            preset[k] = getattr(a, f"aux_{k}")
    if preset["width"] % preset["heads"]:
        raise ConfigError(f"width {preset['width']} is not divisible by {preset['heads']} heads")
    if preset["layers"] < 2 or preset["layers"] % 2:
        raise ConfigError(f"--aux_layers must be even and >= 2 (two layers per coefficient), got {preset['layers']}")
    # The student sees the teacher's images and tokens: same image size and tokenizer.
    cfg = ModelConfig(embed_dim=preset["embed_dim"] if a.aux_width is None else preset["width"],
                      image_size=tcfg.image_size, patch_size=a.patch_size or preset["patch_size"],
                      vision_width=preset["width"], vision_layers=preset["layers"], vision_heads=preset["heads"],
                      context_length=tok.context_length, vocab_size=tok.vocab_size, text_width=preset["width"],
                      text_layers=preset["layers"], text_heads=preset["heads"], eot_token_id=tok.eot_id,
                      quick_gelu=a.quick_gelu)
    if cfg.image_size % cfg.patch_size:
        raise ConfigError(f"image size {cfg.image_size} is not a multiple of patch size {cfg.patch_size}")
    part = "no_mm" if a.no_mm else ("only_mm" if a.only_mm else "both")
    if a.out_dir and os.path.exists(os.path.join(a.out_dir, "config.json")) and a.resume:
        with open(os.path.join(a.out_dir, "config.json")) as f:
            old = json.load(f)
        if old["model"]["vision_width"] != cfg.vision_width:
            raise ConfigError(f"--resume: {a.out_dir} holds a learngene of width {old['model']['vision_width']}, "
                              f"not {cfg.vision_width}")
    aux = AuxCLIP(cfg, a.method, part, a.helg_layers).to(device)
    loader = data.make_loader(a.data, "train", a.batch_size // world, tok, cfg.image_size, True, rank, world,
                              a.num_workers, a.seed)

    def loss_fn(model, batch):
        images, text = batch["image"].to(device), batch["text"].to(device)
        img, txt, scale = model(images, text)
        s_i2t, s_t2i, labels = clip_logits(img, txt, scale)
        with torch.no_grad():  # frozen teacher in eval mode, its own (frozen) logit scale
            t_i2t, t_t2i, _ = clip_logits(teacher.encode_image(images).float(), teacher.encode_text(text).float(),
                                          teacher.logit_scale.exp().float(), grad=False)
        l_clip = clip_loss(s_i2t, s_t2i, labels)
        l_dist = distill_loss(s_i2t, s_t2i, t_i2t, t_t2i)
        return l_clip + a.lambda_dist * l_dist, {"clip": l_clip.detach(), "dist": l_dist.detach()}  # Eq. 8

    config = {**{k: v for k, v in vars(a).items() if k != "func"}, "preset": a.model, "world_size": world,
              **aux.meta(), "model": dataclasses.asdict(aux.cfg), "teacher_config": dataclasses.asdict(tcfg)}

    def write_learngene(tr):
        tmp = os.path.join(a.out_dir, "tokenizer.json")
        with open(tmp) as f:
            tok_json = f.read()
        meta = {"learngene": json.dumps(aux.meta()), "tokenizer": tok_json,
                "extract": json.dumps({"step": tr.step, "elapsed": tr.elapsed, "batch_size": a.batch_size})}
        atomic_save_file(aux.state_dict(), os.path.join(a.out_dir, "learngene.safetensors"), meta)

    tr = Trainer(aux, loss_fn, loader, a, rank, world, device, a.out_dir, config, tok, "extract", write_learngene)
    tr.run(a.max_steps, a.resume)
    if rank == 0:
        n_lg = aux.learngene_numel()
        n_all = sum(p.numel() for p in aux.parameters())
        print(f"learngene: {os.path.join(a.out_dir, 'learngene.safetensors')}  learngene parameters "
              f"{n_lg:,} (blocks + coefficients), with non-learngene parts {n_all:,}", flush=True)


# -----------------------------------------------------------------------------
# Subcommand: expand (paper Sec. 3.3, Fig. 3b)


def write_descendant(out_dir, sd, cfg, modality, tok_json, extra):
    os.makedirs(out_dir, exist_ok=True)
    atomic_save_file(sd, os.path.join(out_dir, "model.safetensors"))
    c = dataclasses.asdict(cfg)
    # "model": the ModelConfig fields, the layout il_clip.load_model reads
    atomic_write_json({"model": c, "modality": modality, **extra}, os.path.join(out_dir, "config.json"))
    if tok_json is not None:
        with open(os.path.join(out_dir, "tokenizer.json") + ".tmp", "w") as f:
            f.write(tok_json)
        os.replace(os.path.join(out_dir, "tokenizer.json") + ".tmp", os.path.join(out_dir, "tokenizer.json"))


def cmd_expand(a):
    if a.layers < 1:
        raise ConfigError(f"--layers must be >= 1, got {a.layers}")
    aux, meta = load_learngene(a.learngene, a.width)
    sd, cfg = descendant_state(aux, a.layers, a.modality, a.seed)
    out = a.out_dir or f"out/descendant_{aux.method}_{a.modality}{a.layers}"
    write_descendant(out, sd, cfg, a.modality, meta.get("tokenizer"),
                     {"learngene": os.path.abspath(a.learngene), "method": aux.method, "part": aux.part,
                      "layers": a.layers, "layer_order": expand_order(a.layers, aux.aux_layers // 2)
                      if aux.method == "mmlg" else None})
    print(f"descendant: {out}  ({a.modality}, {a.layers} layers, {sum(v.numel() for v in sd.values()):,} parameters)")


# -----------------------------------------------------------------------------
# Subcommand: finetune (paper appendix A.2)


class Classifier(nn.Module):
    """Vision tower + linear head on the pooled CLS feature after ln_post (CHOICE: before
    `proj`, as usual for ViT fine-tuning)."""

    def __init__(self, visual: VisionTransformer, n_classes: int):
        super().__init__()
        self.visual = visual
        self.head = nn.Linear(visual.cfg.vision_width, n_classes)

    def forward(self, images):
        return self.head(self.visual(images))


class ClassificationLoader:
    """(image, label) batches for shapes (data.shapes_classification) or an ImageFolder, with
    the same interface as data's loaders (forever, state_dict, load_state_dict)."""

    def __init__(self, spec, split, batch_size, image_size, rank=0, world=1, seed=0, size=None):
        self.transform = data.eval_transform(image_size)
        if spec == "shapes" or spec.startswith("shapes:"):
            opts = data.parse_shapes_spec(spec)
            n = size or (opts.get("train_size", 5000) if split == "train" else 1000)
            sseed = opts.get("seed", 0)
            self.items = [("shapes", split, i, sseed) for i in range(n)]
            self.classes = list(data.SHAPE_NAMES)
            self.image_size = image_size
        else:
            root = os.path.join(spec, split) if os.path.isdir(os.path.join(spec, split)) else spec
            if not os.path.isdir(root):
                raise data.DataError(f"{spec}: not an ImageFolder directory")
            self.classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
            self.items = [(os.path.join(root, c, f), ci) for ci, c in enumerate(self.classes)
                          for f in sorted(os.listdir(os.path.join(root, c)))
                          if f.lower().endswith((".jpg", ".jpeg", ".png", ".webp", ".bmp"))]
            if size:
                self.items = self.items[:size]
            if not self.items:
                raise data.DataError(f"{root}: no images found")
        self.batch_size, self.rank, self.world, self.seed = batch_size, rank, world, seed
        self.epoch, self.done = 0, 0

    def _get(self, item):
        if item[0] == "shapes":
            img, label = data.shapes_classification(item[1], item[2], item[3], self.image_size)
            return self.transform(img), label
        from PIL import Image
        with Image.open(item[0]) as im:
            return self.transform(im.convert("RGB")), item[1]

    def batches(self, train=True):
        n = len(self.items)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)).tolist() \
            if train else list(range(n))
        per = self.batch_size * self.world
        if train:
            order = order[: n // per * per]
        mine = order[self.rank::self.world]
        return [mine[i:i + self.batch_size] for i in range(0, len(mine), self.batch_size)]

    def __iter__(self):
        for idx in self.batches()[self.done:]:
            self.done += 1
            ims, labels = zip(*(self._get(self.items[i]) for i in idx))
            yield {"image": torch.stack(ims), "label": torch.tensor(labels)}
        self.epoch, self.done = self.epoch + 1, 0

    def forever(self):
        while True:
            yield from self

    def state_dict(self):
        return {"epoch": self.epoch, "batches_done": self.done}

    def load_state_dict(self, s):
        self.epoch, self.done = s["epoch"], s["batches_done"]


def load_init(a):
    """(model, tokenizer, ModelConfig, modality, kind) for --init: a descendant out_dir, an
    il_clip.py out_dir / OpenAI weights (PT-FT), or `scratch` (config from --like or --model)."""
    if a.init == "scratch":
        if a.like:
            sd, cfgj = read_state(a.like)
            modality = cfgj.get("modality", "clip")
            cfg = infer_config(sd, cfgj, a.like, {"clip": TOWERS, "vision": ("visual",), "text": ("text",)}[modality])
            tok = data.Tokenizer.load(a.like) if os.path.exists(os.path.join(a.like, "tokenizer.json")) else None
        else:
            p = AUX_PRESETS[a.model]
            tok = None
            modality = a.modality
            cfg = None
        if tok is None:
            tok = data.build_tokenizer(captions=data.captions_for_tokenizer("shapes" if a.task == "classification"
                                                                            else a.data), context_length=77)
        if cfg is None:
            n = a.layers or 6
            cfg = ModelConfig(embed_dim=p["embed_dim"], image_size=a.image_size, patch_size=p["patch_size"],
                              vision_width=p["width"], vision_layers=n, vision_heads=p["heads"],
                              context_length=tok.context_length, vocab_size=tok.vocab_size, text_width=p["width"],
                              text_layers=n, text_heads=p["heads"], eot_token_id=tok.eot_id)
        elif a.layers:
            cfg = dataclasses.replace(cfg, vision_layers=a.layers if cfg.vision_layers else 0,
                                      text_layers=a.layers if cfg.text_layers else 0)
        torch.manual_seed(a.seed)
        model = CLIP(cfg) if modality == "clip" else VisionTransformer(cfg)
        return model, tok, cfg, modality, "scratch"
    sd, cfgj = read_state(a.init)
    if any(k.startswith(LEARNGENE_PREFIXES) for k in sd):
        raise ConfigError(f"{a.init}: a learngene file; run `expand` first and pass the descendant out_dir")
    modality = cfgj.get("modality", "clip")
    need = {"clip": TOWERS, "vision": ("visual",), "text": ("text",)}.get(modality)
    if need is None or modality == "text":
        raise ConfigError(f"{a.init}: finetune supports clip and vision descendants, not {modality}")
    cfg = infer_config(sd, cfgj, a.init, need)
    if modality == "clip":
        model = CLIP(cfg)
    else:
        model = VisionTransformer(cfg)
        sd = {k.removeprefix("visual."): v for k, v in sd.items() if k.startswith("visual.")}
    missing, _ = model.load_state_dict(sd, strict=False)
    if missing:
        raise ConfigError(f"{a.init}: cannot read the checkpoint (missing {missing[0]})")
    tok = data.Tokenizer.load(a.init) if os.path.isdir(a.init) and os.path.exists(os.path.join(a.init, "tokenizer.json")) else None
    if tok is None and modality == "clip":
        raise ConfigError(f"{a.init}: no tokenizer.json")
    kind = cfgj.get("method", "pretrained") if "learngene" in cfgj else "pretrained"
    return model, tok, cfg, modality, kind


def retrieval_hits(sim, owners):
    """Per-query R@1 hits from `sim` [images, texts] and `owners` [texts] (the image index
    each text belongs to). Ties count as misses (pessimistic ranking): an image is a hit only
    if its best correct text scores strictly higher than every text of another image; a text
    only if its image scores strictly higher than every other image. So a collapsed model
    scores 0, and two identical captions of different images (the shapes data repeats short
    ones such as "a white star") can never credit either image, whatever their order:
    `argmax` gave the hit to whichever came first. Returns (i2t [images], t2i [texts]) bool."""
    pos = owners[None, :] == torch.arange(sim.shape[0], device=sim.device)[:, None]
    best_pos = sim.masked_fill(~pos, -math.inf).amax(1)
    best_neg = sim.masked_fill(pos, -math.inf).amax(1)
    right = sim.t().gather(1, owners[:, None]).squeeze(1)
    wrong = sim.t().masked_fill(pos.t(), -math.inf).amax(1)
    return best_pos > best_neg, right > wrong


@torch.no_grad()
def eval_retrieval(model, spec, tok, image_size, device, split="test", n=None, batch_size=100):
    """I2T / T2I R@1 (%) on the first `n` texts of `split` (all when n is None). Images are
    grouped by sample key, so several captions of one image (Karpathy JSON) are all correct
    for it (I2T). Ties count as misses (see `retrieval_hits`). Identical token sequences are
    encoded once, so duplicate captions tie exactly, also across batches."""
    model.eval()
    loader = data.make_loader(spec, split, min(batch_size, n or batch_size), tok, image_size, train=False, drop_last=False)
    keys, img_feats, texts, owners = {}, [], [], []
    for batch in loader:
        take = len(batch["key"]) if not n else min(len(batch["key"]), n - len(owners))
        new = []
        for j, k in enumerate(batch["key"][:take]):
            if k not in keys:
                keys[k] = len(keys)
                new.append(j)
            owners.append(keys[k])
        texts.append(batch["text"][:take])
        if new:
            img_feats.append(model.encode_image(batch["image"][new].to(device)).float())
        if n and len(owners) >= n:
            break
    uniq, inverse = torch.unique(torch.cat(texts), dim=0, return_inverse=True)
    T = torch.cat([model.encode_text(uniq[i:i + batch_size].to(device)).float()
                   for i in range(0, len(uniq), batch_size)])[inverse.to(device)]
    I = torch.cat(img_feats)
    i2t, t2i = retrieval_hits(I @ T.t(), torch.tensor(owners, device=device))
    model.train()
    return {"i2t_r1": round(i2t.float().mean().item() * 100, 2), "t2i_r1": round(t2i.float().mean().item() * 100, 2),
            "n_images": len(I), "n_texts": len(T)}


@torch.no_grad()
def eval_classification(clf, loader, device):
    clf.eval()
    right = total = 0
    for idx in loader.batches(train=False):
        ims, labels = zip(*(loader._get(loader.items[i]) for i in idx))
        pred = clf(torch.stack(ims).to(device)).argmax(-1).cpu()
        right += (pred == torch.tensor(labels)).sum().item()
        total += len(idx)
    clf.train()
    return {"top1": round(100 * right / max(1, total), 2), "n": total}


def cmd_finetune(a):
    rank, world, device = setup_dist(a.device)
    torch.manual_seed(a.seed)
    model, tok, cfg, modality, kind = load_init(a)
    model.to(device)
    out = a.out_dir or f"out/finetune_{a.task}"
    results = {"init": a.init, "kind": kind, "task": a.task, "modality": modality,
               "layers": cfg.vision_layers or cfg.text_layers, "params": sum(p.numel() for p in model.parameters())}
    if modality == "vision" and a.task == "retrieval":
        raise ConfigError("retrieval needs a CLIP descendant (--modality clip at expand time)")

    def phase(tag, model_, loss_fn, loader, args, steps):
        """Run one phase with checkpoints in out/{tag}/; with --resume it continues from them
        (a finished phase loads its final state and runs no step)."""
        d = os.path.join(out, tag)
        resume = a.resume and os.path.exists(os.path.join(d, "train_state.json"))
        Trainer(model_, loss_fn, loader, args, rank, world, device, out_dir=d, config={"phase": tag, "init": a.init},
                tag=tag).run(steps, resume)
    # Activation (appendix A.2.1): contrastive training on --activate_frac of the
    # image-text data for --activate_epochs epoch(s). CHOICE: applied to every learngene
    # descendant (MM-LG, TLEG, He-LG alike), not to scratch or PT-FT; needs both towers
    # (a vision-only descendant is not activated); learning rate --activate_lr.
    activate = a.activate_frac > 0 and kind in ("mmlg", "tleg", "helg") and modality == "clip"
    if activate:
        act_loader = data.make_loader(a.activate_data, "train", a.batch_size // world, tok, cfg.image_size, True,
                                      rank, world, a.num_workers, a.seed)
        steps = a.activate_steps or max(1, int(a.activate_frac * act_loader.num_samples * a.activate_epochs) // a.batch_size)
        act_args = argparse.Namespace(**{**vars(a), "lr": a.activate_lr, "warmup": -1, "halt_at": 0})
        phase("activate", model, lambda m, b: contrastive_loss_fn(m, b, device), act_loader, act_args, steps)
        results["activation_steps"] = steps
    if a.task == "retrieval":
        loader = data.make_loader(a.data, "train", a.batch_size // world, tok, cfg.image_size, True, rank, world,
                                  a.num_workers, a.seed + 1)
        phase("finetune", model, lambda m, b: contrastive_loss_fn(m, b, device), loader, a, a.max_steps)
        if rank == 0:
            results.update(eval_retrieval(model, a.data, tok, cfg.image_size, device, a.eval_split, a.eval_size))
        final = model
    else:
        visual = model.visual if modality == "clip" else model
        train_loader = ClassificationLoader(a.data, "train", a.batch_size // world, cfg.image_size, rank, world,
                                            a.seed, a.train_size)
        clf = Classifier(visual, len(train_loader.classes)).to(device)

        def cls_loss(m, batch):
            loss = F.cross_entropy(m(batch["image"].to(device)), batch["label"].to(device))
            return loss, {}
        phase("finetune", clf, cls_loss, train_loader, a, a.max_steps)
        if rank == 0:
            test = ClassificationLoader(a.data, a.eval_split, 100, cfg.image_size, size=a.eval_size)
            results.update(eval_classification(clf, test, device))
        final = clf
    results["finetune_steps"] = a.max_steps
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        atomic_save_file(final.state_dict(), os.path.join(out, "model.safetensors"))
        atomic_write_json({**{k: v for k, v in vars(a).items() if k != "func"}, "results": results},
                          os.path.join(out, "config.json"))
        atomic_write_json(results, os.path.join(out, "results.json"))
        print("RESULT " + json.dumps(results), flush=True)


# -----------------------------------------------------------------------------
# Subcommand: report (paper Table 3: storage and pre-training cost)


def _run_cost(path):
    """(steps, seconds, batch) of a training out_dir (this script's or il_clip.py's)."""
    steps = secs = batch = None
    st = os.path.join(path, "train_state.json")
    if os.path.exists(st):
        with open(st) as f:
            j = json.load(f)
        steps, secs = j.get("step"), j.get("elapsed")
    cj = os.path.join(path, "config.json")
    if os.path.exists(cj):
        with open(cj) as f:
            batch = json.load(f).get("batch_size")
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


def cmd_report(a):
    aux, meta = load_learngene(a.learngene)
    lg = aux.learngene_numel()
    lg_all = sum(p.numel() for p in aux.parameters())
    rows = []
    total = 0
    for n in a.layers:
        sd, _ = descendant_state(aux, n, "clip", 0)
        cnt = sum(v.numel() for v in sd.values())
        total += cnt
        rows.append((n, cnt))
    ext = json.loads(meta.get("extract", "{}"))
    lines = ["| | parameters stored | ratio |", "|---|---:|---:|"]
    for n, cnt in rows:
        lines.append(f"| PT-FT {n}-layer CLIP | {cnt:,} | |")
    lines.append(f"| PT-FT total ({', '.join(str(n) for n in a.layers)} layers) | {total:,} | 100% |")
    lines.append(f"| {aux.method.upper()} learngene (blocks + coefficients) | {lg:,} | {100 * lg / total:.1f}% |")
    lines.append(f"| {aux.method.upper()} learngene file (+ embeddings, LNs, projections) | {lg_all:,} | "
                 f"{100 * lg_all / total:.1f}% |")
    lines += ["", "| pre-training | steps | batch | seconds |", "|---|---:|---:|---:|"]
    lines.append(f"| extraction (once, all sizes) | {ext.get('step')} | {ext.get('batch_size')} | "
                 f"{ext.get('elapsed', 0):.0f} |")
    pt_steps = pt_secs = 0
    for path in a.ptft or []:
        s, t, b = _run_cost(path)
        lines.append(f"| PT-FT pre-training {path} | {s} | {b} | {t if t is None else round(t)} |")
        pt_steps += s or 0
        pt_secs += t or 0
    if a.ptft and ext.get("elapsed"):
        lines.append(f"| PT-FT total / extraction | {pt_steps / max(1, ext.get('step') or 1):.2f}x steps | | "
                     f"{pt_secs / max(1e-9, ext['elapsed']):.2f}x time |")
    print("\n".join(lines))


# -----------------------------------------------------------------------------
# main


def add_train_flags(p, lr, steps, batch, warmup):
    p.add_argument("--data", default="shapes")
    p.add_argument("--out_dir", default=None)
    p.add_argument("--max_steps", type=int, default=steps)
    p.add_argument("--batch_size", type=int, default=batch, help="global batch size")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=warmup, help="warm-up steps (-1: 10%% of the steps)")
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--num_workers", type=int, default=0)
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--ckpt_every", type=int, default=200)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--model", default="shapes", choices=list(AUX_PRESETS))


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("extract", help="distil a teacher CLIP into the learngene (paper: batch 512, lr 1e-3, "
                                       "10k warm-up, 32 epochs of CC3M+CC12M, --model ViT-S-16)")
    p.add_argument("--teacher", required=True, help="il_clip.py out_dir or OpenAI-layout .safetensors/.pt")
    p.add_argument("--vocab", default=None, help="bpe_simple_vocab_16e6.txt.gz for a bare OpenAI weight file")
    add_train_flags(p, 1e-3, 500, 64, 50)
    p.add_argument("--aux_width", type=int, default=None)
    p.add_argument("--aux_heads", type=int, default=None)
    p.add_argument("--aux_layers", type=int, default=None)
    p.add_argument("--patch_size", type=int, default=None)
    p.add_argument("--quick_gelu", action="store_true")
    p.add_argument("--method", default="mmlg", choices=["mmlg", "tleg", "helg"])
    p.add_argument("--helg_layers", type=int, default=3, help="He-LG: layers per tower kept as the learngene")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--no_mm", action="store_true", help="ablation: no multimodal blocks")
    g.add_argument("--only_mm", action="store_true", help="ablation: multimodal blocks only")
    p.add_argument("--lambda_dist", type=float, default=1.0, help="lambda of Eq. 8 (paper: 1)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--halt_at", type=int, default=0, help="save a checkpoint and exit after this step")
    p.set_defaults(func=cmd_extract, out_dir="out/learngene")

    p = sub.add_parser("expand", help="learngene -> descendant out_dir (OpenAI layout)")
    p.add_argument("--learngene", required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--modality", default="clip", choices=["clip", "vision", "text"])
    p.add_argument("--width", type=int, default=None, help="expected width (checked)")
    p.add_argument("--seed", type=int, default=0, help="He-LG: seed of the random layers")
    p.add_argument("--out_dir", default=None)
    p.set_defaults(func=cmd_expand)

    p = sub.add_parser("finetune", help="activation + fine-tuning (retrieval or classification)")
    p.add_argument("--init", required=True, help="descendant out_dir, il_clip.py out_dir (PT-FT) or scratch")
    p.add_argument("--task", default="retrieval", choices=["retrieval", "classification"])
    add_train_flags(p, 1e-4, 300, 64, 30)
    p.add_argument("--like", default=None, help="scratch: copy config + tokenizer from this out_dir")
    p.add_argument("--layers", type=int, default=None, help="scratch: depth")
    p.add_argument("--modality", default="clip", choices=["clip", "vision"], help="scratch: towers")
    p.add_argument("--image_size", type=int, default=64, help="scratch without --like")
    p.add_argument("--activate_frac", type=float, default=0.1, help="paper: 10%% of the pre-training data")
    p.add_argument("--activate_epochs", type=float, default=1.0)
    p.add_argument("--activate_steps", type=int, default=None, help="override the computed activation steps")
    p.add_argument("--activate_data", default="shapes")
    p.add_argument("--activate_lr", type=float, default=5e-4)
    p.add_argument("--train_size", type=int, default=None, help="classification: training images")
    p.add_argument("--eval_split", default="test")
    p.add_argument("--eval_size", type=int, default=1000)
    p.add_argument("--resume", action="store_true", help="continue from out_dir/activate and out_dir/finetune")
    p.add_argument("--halt_at", type=int, default=0, help="save and exit after this fine-tuning step")
    p.set_defaults(func=cmd_finetune)

    p = sub.add_parser("report", help="storage / cost table (paper Table 3)")
    p.add_argument("--learngene", required=True)
    p.add_argument("--layers", type=int, nargs="+", default=[6, 8, 12])
    p.add_argument("--ptft", nargs="*", help="il_clip.py out_dirs of the directly pre-trained sizes")
    p.set_defaults(func=cmd_report)
    return ap


def main(argv=None):
    a = build_parser().parse_args(argv)
    try:
        a.func(a)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()      # no rank tears down its connections while another still writes
    except (ConfigError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
