"""
CLIP, Codebook-CLIP (FDT), NegCLIP and IL-CLIP (iterated learning) in one file.

    python il_clip.py                                   # IL-CLIP tiny on the built-in shapes data
    python il_clip.py --method clip --max_steps 300     # plain CLIP baseline
    torchrun --standalone --nproc_per_node=8 il_clip.py --data cc3m --model ViT-B-32

Paper: "Iterated Learning Improves Compositionality in Large Vision-Language Models" (Zheng et al.,
CVPR 2024); what it leaves open is marked `Choice:` where it is decided. Reads top to bottom: config
-> model -> sparsemax / codebook head -> losses -> NegCLIP's negative captions -> IL schedule ->
compute_loss (every loss term) -> IL phases (set_trainable, spawn) -> train -> shapes benchmark
score; then one infrastructure section (what state.pt holds, MFU, the loss curve's series) and
main. data.py holds the loaders, the tokenizer and the shapes data; lifecycle.py the run lifecycle.
"""
import argparse
import copy
import gc
import importlib.util
import json
import math
import os
import random
import re
import sys
import time
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.parametrizations import spectral_norm
from safetensors.torch import save_file

import data
import lifecycle

if dist.is_available():
    # Imported before any process group exists: its `group=group.WORLD` defaults are evaluated on
    # import. Imported later (by DDP, through torch._dynamo), they hold the group past
    # destroy_process_group and its gloo threads abort the process at exit ("terminate called...").
    import torch.distributed.nn.functional  # noqa: F401

# -----------------------------------------------------------------------------
# config
# a user mistake in flags or files: main() prints `error: <msg>` and exits 2
ConfigError = data.DataError


@dataclass
class ModelConfig:
    embed_dim: int = 128
    image_size: int = 64
    patch_size: int = 8
    vision_width: int = 128
    vision_layers: int = 4
    vision_heads: int = 4
    context_length: int = 32
    vocab_size: int = 1000
    text_width: int = 128
    text_layers: int = 4
    text_heads: int = 4
    eot_token_id: int = 49407
    quick_gelu: bool = False
    mlp_ratio: float = 4.0
    codebook_size: int = 0        # K; 0 = plain CLIP head (CLS / EOT projection)
    code_dim: int = 512           # D of the codes and of the query maps (FDT: 512)
    code_sim: str = "dot"         # "dot": q.c / sqrt(D) / T (FDT reference); "cos": cos(q, c) / T
    spectral_norm: bool = False   # Lipschitz-regularised ablation (paper Table 3)


MODEL_PRESETS = {
    # CPU-sized, for the 64x64 shapes data: 64 patches of 8x8, short captions.
    "tiny": dict(embed_dim=128, image_size=64, patch_size=8, vision_width=128, vision_layers=4,
                 vision_heads=4, context_length=32, vocab_size=1000, text_width=128, text_layers=4,
                 text_heads=4, quick_gelu=False, code_dim=128),
    **{f"ViT-B-{p}": dict(embed_dim=512, image_size=224, patch_size=p, vision_width=768,
                          vision_layers=12, vision_heads=12, context_length=77, vocab_size=49408,
                          text_width=512, text_layers=12, text_heads=8, quick_gelu=True,
                          code_dim=512)
       for p in (32, 16)},
    "ViT-S-16": dict(embed_dim=384, image_size=224, patch_size=16, vision_width=384,
                     vision_layers=12, vision_heads=6, context_length=77, vocab_size=49408,
                     text_width=384, text_layers=12, text_heads=6, quick_gelu=False,
                     code_dim=512),
}

# Paper defaults (Table 4 / section 4.1) with --data cc3m|cc12m|datacomp, and the scaled-down
# defaults used on the built-in shapes data (sized so `python il_clip.py` runs ~10 min on 2 CPU
# cores).
# generations=5: the paper gives no count ("K training cycles"); 5 is this repo's choice, which
# with its CC3M step counts (6000 + 5 x (1000 + 5000) + 12000) gives 48k steps.
PAPER_DEFAULTS = dict(model="ViT-B-32", batch_size=1024, lr=5e-4, warmup=500, rewarm=500,
                      codebook=16384, code_temp=1000.0,
                      t_warm=6000, t_distill=1000, t_interact=5000, generations=5, t_extend=12000,
                      context_length=77, vocab_size=49408, neg_pool=16384,
                      log_interval=50, save_interval=1000)
SHAPES_DEFAULTS = dict(model="tiny", batch_size=64, lr=1e-3, warmup=50, rewarm=25,
                       codebook=1024, code_temp=100.0,
                       t_warm=300, t_distill=40, t_interact=160, generations=3, t_extend=100,
                       context_length=32, vocab_size=1000, neg_pool=1024,
                       log_interval=20, save_interval=200)
CODE_TEMP_ITERS = 1000      # T = T0 * decay^(step / 1000) (FDT's schedule), floor 0.01
KD_TEMP = 1.0               # Hinton KD temperature of the distill phase


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" where X says something; what None or an off switch means, the help
    says."""

    def _get_help_string(self, action):
        if (action.default is None or action.default is False or action.default == []
                or "default" in action.help):
            return action.help
        return super()._get_help_string(action)


def build_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1], allow_abbrev=False,
                                formatter_class=HelpFormatter)
    by_data = lambda k: f"default: {SHAPES_DEFAULTS[k]} on shapes, {PAPER_DEFAULTS[k]} on web data"
    a = p.add_argument_group("data").add_argument
    a("--data", default="shapes", help="shapes | cc3m | cc12m | datacomp | shards | csv | ...")
    a("--image_root", default=None,
      help="image folder for a CSV / Karpathy JSON --data (default: paths as written)")
    a("--csv_img_key", default="filepath", help="the CSV's image column")
    a("--csv_caption_key", default="title", help="the CSV's caption column")
    a("--csv_separator", default=None, help="default: data.py picks by file extension")
    a("--resampled", action="store_true",
      help="draw shards with replacement (open_clip's --dataset-resampled)")
    a("--vocab", default=None,
      help="CLIP's bpe_simple_vocab_16e6.txt.gz (default: a BPE trained on the captions)")
    a("--vocab_size", type=int, default=None,
      help=f"size of the trained BPE ({by_data('vocab_size')})")
    a = p.add_argument_group("model").add_argument
    a("--model", default=None, help=f"preset: {', '.join(MODEL_PRESETS)} ({by_data('model')})")
    a("--model_args", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
      help="override the preset: width, layers, heads (both towers, or vision_/text_ KEY), "
           "embed_dim, image_size, patch_size, context_length, code_dim, mlp_ratio")
    a("--init", default=None,
      help="OpenAI/open_clip-layout weights (.safetensors or .pt) (default: random init)")
    a("--quick_gelu", action=argparse.BooleanOptionalAction, default=None,
      help="default: the preset's; with --init what open_clip_config.json / config.json beside the "
           "weights says, else OpenAI's QuickGELU (assumed, and recorded so; --no-quick_gelu for "
           "open_clip's LAION/DataComp ViT-B-32, GELU)")
    a = p.add_argument_group("method").add_argument
    a("--method", default="il", choices=["clip", "codebook", "negclip", "il"],
      help="the loss and schedule")
    a("--negatives", action="store_true", help="add NegCLIP hard negatives to --method il")
    a("--neg_pool", type=int, default=None, help=f"NegCLIP's image pool ({by_data('neg_pool')})")
    a("--codebook", type=int, default=None,
      help=f"K codes, 0 = none ({by_data('codebook')}; with codebook / il)")
    a("--code_temp", type=float, default=None,
      help="T0 of the code temperature T = T0 * decay^(step/1000), floor 0.01, dividing the "
           "scores: a large T0 spreads sparsemax's weight over many codes (a softmax at T0=100 "
           f"would be near uniform), a small one makes it sparse ({by_data('code_temp')})")
    a("--code_temp_decay", type=float, default=1.0, help="the decay of T per 1000 steps")
    a("--code_sim", default="dot", choices=["dot", "cos"],
      help="dot: q.c/sqrt(D)/T (FDT); cos: cos(q,c)/T, in [-1/T, 1/T]: use a T near 0.01-0.1")
    a("--spawn", default="language", choices=["language", "vision", "alternate"],
      help="the agent re-initialised")
    a("--no_freeze_codebook", action="store_true", help="train the codebook during distill")
    a("--distill_loss", default="kd", choices=["kd", "cos"],
      help="kd: Hinton KD of the logits; cos: of embeddings")
    a("--distill_train_vision", action="store_true",
      help="train the non-spawned agent during distill (frozen by default; "
           "needs --distill_loss kd)")
    a("--spectral_norm", action="store_true", help="spectral norm on every nn.Linear and attention "
      "in_proj (not patch conv, embeddings, projections, codebook)")
    a = p.add_argument_group("schedule (steps)").add_argument
    a("--max_steps", type=int, default=None, help="default: the IL schedule's total")
    a("--t_warm", type=int, default=None, help=f"warm-up generation ({by_data('t_warm')})")
    a("--t_distill", type=int, default=None, help=f"distill phase ({by_data('t_distill')})")
    a("--t_interact", type=int, default=None, help=f"interact phase ({by_data('t_interact')})")
    a("--generations", type=int, default=None,
      help=f"spawns ({by_data('generations')}; the paper gives no count)")
    a("--t_extend", type=int, default=None,
      help=f"the last interaction's extension ({by_data('t_extend')})")
    a("--warmup", type=int, default=None, help=f"linear LR warm-up ({by_data('warmup')})")
    a("--rewarm", type=int, default=None,
      help=f"linear LR re-warm-up at each generation start ({by_data('rewarm')})")
    a("--lr_schedule", default="global", choices=["global", "generation", "il_cycles"],
      help="global: one cosine over max_steps (paper); generation: warm-up + cosine to 0 within "
           "the warm-up, each generation, the extension; il_cycles: generation's cycles for any "
           "method (a no-spawn control)")
    a = p.add_argument_group("optimisation").add_argument
    a("--batch_size", type=int, default=None,
      help=f"global batch, all ranks and micro-steps ({by_data('batch_size')})")
    a("--accum", type=int, default=1, help="gradient accumulation micro-steps")
    a("--lr", type=float, default=None, help=f"peak LR, see --lr_schedule ({by_data('lr')})")
    a("--wd", type=float, default=0.1,
      help="AdamW weight decay (not on gains, biases, logit_scale)")
    a("--betas", type=float, nargs=2, default=(0.9, 0.98), help="AdamW betas")
    a("--eps", type=float, default=1e-6, help="AdamW eps")
    a("--grad_clip", type=float, default=1.0, help="gradient norm clip, 0 = off")
    a("--seed", type=int, default=0, help="init, data order, spawns, NegCLIP negatives")
    a = p.add_argument_group("machine").add_argument
    a("--device", default=None,
      help="cpu | cuda (default: cuda when available; under torchrun cuda:LOCAL_RANK)")
    a("--dtype", default=None, choices=["fp32", "bf16"],
      help="autocast dtype (default: bf16 on CUDA, else fp32)")
    a("--compile", action="store_true", help="torch.compile the encoders")
    a("--num_workers", type=int, default=0, help="data loading processes per rank")
    a = p.add_argument_group("output").add_argument
    a("--out_dir", default="out/il_clip",
      help="checkpoint/, metrics.jsonl, loss_curve.png, shapes_eval.json")
    a("--resume", action="store_true", help="continue the run in out_dir with its saved flags")
    a("--overwrite", action="store_true",
      help="replace the checkpoint and results of an earlier run in out_dir")
    a("--stop_at", type=int, default=None,
      help="stop here with a checkpoint, as if preempted (default: --max_steps)")
    a("--log_interval", type=int, default=None,
      help=f"steps per metrics.jsonl line ({by_data('log_interval')})")
    a("--save_interval", type=int, default=None,
      help=f"steps per checkpoint ({by_data('save_interval')})")
    a("--eval_size", type=int, default=1000,
      help="shapes benchmark items per category (0 = no eval; 1000: a standard error of at most "
           "1.6 points)")
    a("--wandb", default=None, metavar="PROJECT",
      help="also send metrics.jsonl's records to this Weights & Biases project (rank 0; needs "
           "`pip install wandb`; default: off)")
    args = p.parse_args(argv)
    opts = {s: act.dest for act in p._actions for s in act.option_strings}
    tokens = [t.split("=")[0] for t in (sys.argv[1:] if argv is None else argv)]
    # set on the command line (--resume compares)
    args.given = sorted({opts[t] for t in tokens if t in opts})
    if args.resume and args.overwrite:
        raise ConfigError("--resume continues the run in --out_dir, --overwrite replaces it: "
                          "give one")
    return args if args.resume else check_args(args)    # --resume: the saved flags, in run()


def check_args(args):
    """Fill the data-dependent defaults and reject contradictory flags (ConfigError)."""
    # on every rank, before anything is written
    if args.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb needs the wandb package (pip install wandb)")
    if args.negatives and args.method not in ("il", "negclip"):
        raise ConfigError("--negatives goes with --method il (negclip always uses them)")
    defaults = SHAPES_DEFAULTS if args.data.startswith("shapes") else PAPER_DEFAULTS
    for k, v in defaults.items():
        if k != "codebook" and getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.codebook is None:
        args.codebook = defaults["codebook"] if args.method in ("codebook", "il") else 0
    if args.codebook and args.method in ("clip", "negclip"):
        raise ConfigError(f"--codebook is for --method codebook|il, not {args.method}")
    if args.model not in MODEL_PRESETS:
        raise ConfigError(f"unknown --model {args.model!r} (presets: {', '.join(MODEL_PRESETS)})")
    if args.distill_train_vision and args.distill_loss == "cos":
        raise ConfigError("--distill_train_vision needs --distill_loss kd (the cos loss does not "
                          "involve the other agent, so it would get no gradient)")
    # cos scores lie in [-1/T, 1/T]
    if args.code_sim == "cos" and args.codebook and args.code_temp > 1:
        print(f"warning: --code_sim cos with --code_temp {args.code_temp}: the sparsemax weights "
              f"are nearly uniform; use --code_temp 0.01-0.1", file=sys.stderr)
    if min(args.t_warm, args.t_distill, args.t_interact, args.generations, args.t_extend) < 0:
        raise ConfigError("IL step counts must be >= 0")
    if args.max_steps is None:
        args.max_steps = make_schedule(args).total
    args.model_overrides = parse_model_args(args.model_args)
    # the tokenizer's
    args.context_length = args.model_overrides.pop("context_length", args.context_length)
    return args


def parse_model_args(pairs):
    """["width=64", "layers=6"] -> {"vision_width": 64, "text_width": 64, ...}, typed as
    ModelConfig."""
    own_flag = {"vocab_size", "eot_token_id", "quick_gelu", "codebook_size", "code_sim",
                "spectral_norm"}
    # int, float, str
    field_type = {f.name: f.type for f in fields(ModelConfig) if f.name not in own_flag}
    out = {}
    for kv in pairs:
        key, _, value = kv.partition("=")
        names = [f"vision_{key}", f"text_{key}"] if key in ("width", "layers", "heads") else [key]
        if not value or any(n not in field_type for n in names):
            raise ConfigError(f"--model_args {kv!r}: expected KEY=VALUE, KEY one of width, layers, "
                              f"heads, {', '.join(field_type)}")
        try:
            out.update({n: field_type[n](value) for n in names})
        except ValueError:
            typ = field_type[names[0]].__name__
            raise ConfigError(f"--model_args {kv!r}: {value!r} is not a valid {typ}") from None
    return out


# -----------------------------------------------------------------------------
# model (OpenAI CLIP layout and key names; batch-first tensors, SDPA attention)
class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class Attention(nn.Module):
    """nn.MultiheadAttention's parameter names (in_proj_weight/bias, out_proj) with SDPA."""

    def __init__(self, width, heads):
        super().__init__()
        assert width % heads == 0, "width must be divisible by heads"
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x, causal=False):
        B, T, C = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))


class ResidualAttentionBlock(nn.Module):
    def __init__(self, width, heads, mlp_ratio, quick_gelu):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        hidden = int(width * mlp_ratio)
        self.mlp = nn.Sequential(OrderedDict([("c_fc", nn.Linear(width, hidden)),
                                              ("gelu", QuickGELU() if quick_gelu else nn.GELU()),
                                              ("c_proj", nn.Linear(hidden, width))]))

    def forward(self, x, causal=False):
        x = x + self.attn(self.ln_1(x), causal=causal)
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, width, layers, heads, mlp_ratio, quick_gelu):
        super().__init__()
        self.width, self.layers = width, layers
        self.resblocks = nn.ModuleList(
            [ResidualAttentionBlock(width, heads, mlp_ratio, quick_gelu) for _ in range(layers)])

    def forward(self, x, causal=False):
        for block in self.resblocks:
            x = block(x, causal=causal)
        return x


@torch.no_grad()
def _normal(module, name, std, g):
    """N(0, std^2) into `module.name`, or into the original where spectral norm parametrizes it."""
    sn = getattr(module, "parametrizations", {})
    t = sn[name].original if name in sn else getattr(module, name)
    t.copy_(torch.randn(t.shape, generator=g) * std)


@torch.no_grad()
def _reset_norms_and_biases(module):
    for m in module.modules():
        if isinstance(m, nn.LayerNorm):
            m.weight.fill_(1.0)
            m.bias.zero_()
        elif isinstance(m, (nn.Linear, Attention)):
            for n in ("bias", "in_proj_bias"):
                if getattr(m, n, None) is not None:
                    getattr(m, n).zero_()


def _init_transformer(tr, g):
    """OpenAI CLIP's init (initialize_parameters), applied to both towers."""
    w, L = tr.width, tr.layers
    attn_std, proj_std, fc_std = w ** -0.5, (w ** -0.5) * ((2 * L) ** -0.5), (2 * w) ** -0.5
    _reset_norms_and_biases(tr)
    for blk in tr.resblocks:
        _normal(blk.attn, "in_proj_weight", attn_std, g)
        _normal(blk.attn.out_proj, "weight", proj_std, g)
        _normal(blk.mlp.c_fc, "weight", fc_std, g)
        _normal(blk.mlp.c_proj, "weight", proj_std, g)


class QueryMap(nn.Module):
    """FDT query map: LN(d) -> Linear(d, D) -> GELU -> LN(D) -> Linear(D, D), per token."""

    def __init__(self, width, dim):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.fc_1 = nn.Linear(width, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.fc_2 = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc_2(self.ln_2(F.gelu(self.fc_1(self.ln_1(x)))))

    def init_weights(self, g):
        # N(0, 1/fan_in): unit-variance queries, so q.c/sqrt(D) starts at unit scale
        _reset_norms_and_biases(self)
        for fc in (self.fc_1, self.fc_2):
            _normal(fc, "weight", fc.in_features ** -0.5, g)


class VisionTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.image_size % cfg.patch_size:
            raise ConfigError(f"image_size {cfg.image_size} is not a multiple of "
                              f"patch_size {cfg.patch_size}")
        w = cfg.vision_width
        self.grid = cfg.image_size // cfg.patch_size
        self.conv1 = nn.Conv2d(3, w, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(w))
        self.positional_embedding = nn.Parameter(torch.zeros(self.grid ** 2 + 1, w))
        self.ln_pre = nn.LayerNorm(w)
        self.transformer = Transformer(w, cfg.vision_layers, cfg.vision_heads, cfg.mlp_ratio,
                                       cfg.quick_gelu)
        self.ln_post = nn.LayerNorm(w)
        self.proj = nn.Parameter(torch.zeros(w, cfg.embed_dim))
        self.init_weights(torch.Generator().manual_seed(0))     # usable alone (CLIP re-seeds)

    def init_weights(self, g):
        w = self.class_embedding.shape[0]
        _normal(self.conv1, "weight", self.conv1.weight[0].numel() ** -0.5, g)
        for name in ("class_embedding", "positional_embedding", "proj"):
            _normal(self, name, w ** -0.5, g)
        _reset_norms_and_biases(self)
        _init_transformer(self.transformer, g)

    def _blocks(self, images):
        x = self.conv1(images).flatten(2).transpose(1, 2)                      # [B, P, w]
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)
        return self.transformer(self.ln_pre(x))

    def forward_tokens(self, images):
        """Patch tokens of the last block, without CLS, before ln_post: [B, P, width]."""
        return self._blocks(images)[:, 1:]

    def forward(self, images):
        return self.ln_post(self._blocks(images)[:, 0]) @ self.proj


class TextTransformer(nn.Module):
    """The language tower, attributes at the top level: CLIP (a subclass) gets OpenAI's key
    names."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        w = cfg.text_width
        self.token_embedding = nn.Embedding(cfg.vocab_size, w)
        self.positional_embedding = nn.Parameter(torch.zeros(cfg.context_length, w))
        self.transformer = Transformer(w, cfg.text_layers, cfg.text_heads, cfg.mlp_ratio,
                                       cfg.quick_gelu)
        self.ln_final = nn.LayerNorm(w)
        self.text_projection = nn.Parameter(torch.zeros(w, cfg.embed_dim))
        self.init_text_weights(torch.Generator().manual_seed(0))  # usable alone (CLIP re-seeds)

    def init_text_weights(self, g):
        _normal(self.token_embedding, "weight", 0.02, g)
        _normal(self, "positional_embedding", 0.01, g)
        _normal(self, "text_projection", self.cfg.text_width ** -0.5, g)
        _reset_norms_and_biases(self.ln_final)
        _init_transformer(self.transformer, g)

    def forward_tokens(self, text):
        """Token features after ln_final [B, L, w] and the EOT position [B] (first EOT id)."""
        x = self.token_embedding(text) + self.positional_embedding[: text.shape[1]]
        x = self.ln_final(self.transformer(x, causal=True))
        eot = (text == self.cfg.eot_token_id).int().argmax(-1)
        return x, eot

    def forward(self, text):
        x, eot = self.forward_tokens(text)
        return x[torch.arange(x.shape[0], device=x.device), eot] @ self.text_projection


class CLIP(TextTransformer):
    # DDP's find_unused_parameters: not needed for a trained parameter that a phase's loss leaves
    # out (StepLoss gives it a zero gradient) nor for frozen ones (see train()); a fork whose
    # forward skips a parameter on some steps of a phase only sets True (open_clip does where a
    # tower is skipped)
    find_unused_parameters = False

    def __init__(self, cfg: ModelConfig, seed=0):
        super().__init__(cfg)
        self.visual = VisionTransformer(cfg)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        if cfg.codebook_size:
            self.codebook = nn.Parameter(torch.zeros(cfg.codebook_size, cfg.code_dim))
            self.image_query = QueryMap(cfg.vision_width, cfg.code_dim)
            self.text_query = QueryMap(cfg.text_width, cfg.code_dim)
            # current sparsemax temperature T (a schedule: T0 * w^(step/iters), floor 0.01); saved
            self.register_buffer("code_temperature", torch.tensor(1.0))
        # the whole init from `seed`: vision, language, codebook
        g = torch.Generator().manual_seed(seed)
        self.init_agent("vision", g)
        self.init_agent("language", g)
        if cfg.codebook_size:
            _normal(self, "codebook", 1.0, g)       # N(0, 1)
        # paper Table 3's ablation: every nn.Linear and attention in_proj
        if cfg.spectral_norm:
            for m in list(self.modules()):
                if isinstance(m, (nn.Linear, Attention)):
                    spectral_norm(m, "in_proj_weight" if isinstance(m, Attention) else "weight")
        # The codebook head replaces the CLS/EOT projections: these stay in the state dict (OpenAI
        # key layout for --init and load_model) but are frozen, so DDP and AdamW never see them.
        for n in UNUSED_WITH_CODEBOOK if cfg.codebook_size else ():
            self.get_parameter(n).requires_grad_(False)

    def init_agent(self, agent, g):
        """Re-initialise a whole agent exactly as at step 0 (used at every IL spawn)."""
        if agent == "vision":
            self.visual.init_weights(g)
            if self.cfg.codebook_size:
                self.image_query.init_weights(g)
        else:
            self.init_text_weights(g)
            if self.cfg.codebook_size:
                self.text_query.init_weights(g)

    # --- heads
    def code_scores(self, tokens, valid, query, max_tokens=None):
        """r_k = max over valid tokens of q(f_p) . c_k / (sqrt(D) T) (paper Eq. 2; `--code_sim cos`:
        cos / T) and their sparsemax weights (Eq. 3)."""
        q, codes = query(tokens), self.codebook
        if self.cfg.code_sim == "cos":
            q, codes = F.normalize(q, dim=-1), F.normalize(codes, dim=-1)
            scale = 1.0 / self.code_temperature
        else:
            scale = 1.0 / (math.sqrt(self.cfg.code_dim) * self.code_temperature)
        s = max_code_scores(q, codes, valid, max_tokens=max_tokens) * scale   # [B, K]
        return s, sparsemax(s, dim=-1)

    def codebook_embed(self, tokens, valid, query, max_tokens=None):
        return self.code_scores(tokens, valid, query, max_tokens)[1] @ self.codebook.float()

    def encode_image(self, images):
        if self.cfg.codebook_size:
            x = self.codebook_embed(self.visual.forward_tokens(images), None, self.image_query)
        else:
            x = self.visual(images)
        return F.normalize(x.float(), dim=-1)

    def encode_text(self, text):
        if self.cfg.codebook_size:
            x, eot = self.forward_tokens(text)
            # non-pad tokens = positions <= the first EOT (data.py contract)
            valid = torch.arange(text.shape[1], device=text.device)[None] <= eot[:, None]
            x = self.codebook_embed(x, valid, self.text_query, max_tokens=self.cfg.context_length)
        else:
            x = TextTransformer.forward(self, text)
        return F.normalize(x.float(), dim=-1)

    def forward(self, images, text):
        """The one call DDP wraps: both embeddings and the logit scale capped at 100 (OpenAI, FDT;
        with the codebook clamp [3, 6] the scale used lies in [20.1, 100])."""
        return (self.encode_image(images), self.encode_text(text),
                self.logit_scale.exp().clamp(max=100))

    @torch.no_grad()
    def clamp_logit_scale_(self):
        """After every optimizer step: OpenAI CLIP keeps ln(scale) in [0, ln 100]; with a codebook,
        FDT's reference code keeps it in [3, 6] (a fork changing the temperature changes it
        here)."""
        self.logit_scale.clamp_(*((3.0, 6.0) if self.cfg.codebook_size else (0.0, math.log(100))))


UNUSED_WITH_CODEBOOK = ("text_projection", "visual.proj",
                        "visual.ln_post.weight", "visual.ln_post.bias")
VISION_PREFIXES = ("visual.", "image_query.")
LANGUAGE_PREFIXES = ("token_embedding.", "positional_embedding", "transformer.", "ln_final.",
                     "text_projection", "text_query.")


def agent_params(model, agent):
    pre = VISION_PREFIXES if agent == "vision" else LANGUAGE_PREFIXES
    return [(n, p) for n, p in model.named_parameters() if n.startswith(pre)]


# -----------------------------------------------------------------------------
# sparsemax (Martins & Astudillo 2016) and the memory-lean codebook scores
class _Sparsemax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z):
        # the threshold tau of the last dim by a full sort (Martins & Astudillo 2016, Alg. 1)
        zs = z.sort(dim=-1, descending=True).values
        r = torch.arange(1, zs.shape[-1] + 1, device=z.device, dtype=z.dtype)
        cs = zs.cumsum(-1) - 1
        # support size >= 1; a NaN row (a diverged run) counts 0 and is clamped, so it gives NaN
        # weights and the non-finite-loss stop instead of an out-of-bounds gather
        ksz = (r * zs > cs).sum(-1, keepdim=True).clamp(min=1)
        out = torch.clamp(z - cs.gather(-1, ksz - 1) / ksz.to(z.dtype), min=0)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        # closed form: on the support S, grad - mean_S(grad); zero elsewhere
        (out,) = ctx.saved_tensors
        supp = out > 0
        g = g * supp
        v = g.sum(-1, keepdim=True) / supp.sum(-1, keepdim=True).clamp(min=1).to(g.dtype)
        return torch.where(supp, g - v, torch.zeros_like(g))


def sparsemax(x, dim=-1):
    """Exact sparsemax along `dim` (Euclidean projection onto the simplex), in at least float32."""
    z = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    out = _Sparsemax.apply(z.transpose(dim, -1).contiguous())
    return out.transpose(dim, -1).to(x.dtype)


class _MaxCodeScores(torch.autograd.Function):
    """s[b, k] = max_p q[b, p] . C[k] in sample chunks; the B x P x K scores (3.3 GB at ViT-B/32,
    K=16384) are never kept: backward routes the gradient to the argmax token per (b, k)."""

    @staticmethod
    def forward(ctx, q, codes, valid, budget, max_tokens):
        B, P, D = q.shape
        K = codes.shape[0]
        cb = codes.to(q.dtype)
        chunk = max(1, budget // max(1, (max_tokens or P) * K))
        out = torch.empty(B, K, device=q.device, dtype=torch.promote_types(q.dtype, torch.float32))
        idx = torch.empty(B, K, device=q.device, dtype=torch.long)
        for s in range(0, B, chunk):
            sc = torch.matmul(q[s:s + chunk], cb.t())                          # [b, P, K]
            if valid is not None:
                sc.masked_fill_(~valid[s:s + chunk, :, None], float("-inf"))
            out[s:s + chunk], idx[s:s + chunk] = sc.max(dim=1)
        ctx.save_for_backward(q, codes, idx)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, g):
        q, codes, idx = ctx.saved_tensors
        B, P, D = q.shape
        K = codes.shape[0]
        cb = codes.to(q.dtype)
        dq = torch.zeros_like(q) if ctx.needs_input_grad[0] else None
        acc = torch.promote_types(q.dtype, torch.float32)
        dc = torch.zeros(K, D, device=q.device, dtype=acc) if ctx.needs_input_grad[1] else None
        for s in range(0, B, ctx.chunk):
            b = min(ctx.chunk, B - s)
            # one-hot routing matrix A[k, b, p] = g[b, k] at p = argmax, built per chunk.
            # Code-major, so that dC = A @ q is one GEMM over (b, p) with no copy of A (a [b, K, P]
            # layout needs a transposed copy of the chunk for it), and dq reads A through a
            # transposed view.
            A = torch.zeros(K, b, P, device=q.device, dtype=q.dtype)
            A.scatter_(2, idx[s:s + b].t()[:, :, None], g[s:s + b].t()[:, :, None].to(q.dtype))
            if dq is not None:
                dq[s:s + b] = A.permute(1, 2, 0) @ cb                       # [b, P, K] @ [K, D]
            if dc is not None:
                dc += (A.view(K, b * P) @ q[s:s + b].reshape(b * P, D)).to(acc)
        return dq, (dc.to(codes.dtype) if dc is not None else None), None, None, None


# 128 MiB of float32 scores at a time (bench.py --levers tries others)
CODE_SCORES_PER_CHUNK = 1 << 25


def max_code_scores(q, codes, valid=None, budget=None, max_tokens=None):
    """max over valid tokens ([B, P] bool) of q @ codes.T -> [B, K] float32, in sample chunks of
    budget (default CODE_SCORES_PER_CHUNK) // (max_tokens x K) scores (a fixed `max_tokens`: no
    recompile per text length). Pads get -inf (FDT's reference zeroes pad features, clamping scores
    at >= 0)."""
    return _MaxCodeScores.apply(q, codes, valid, budget or CODE_SCORES_PER_CHUNK, max_tokens)


# -----------------------------------------------------------------------------
# distributed helpers and losses
class _AllGather(torch.autograd.Function):
    """Every rank's rows in rank order; backward returns each rank's summed gradient to its rows'
    owner (open_clip's gather_with_grad). Synchronous collectives (torch 2.13's names): with the
    asynchronous functional all-gather, 2-rank gloo runs died about 1 in 100 (heap corruption in
    gloo's worker)."""

    @staticmethod
    def forward(ctx, x):
        out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, g):
        out = g.new_empty((g.shape[0] // dist.get_world_size(), *g.shape[1:]))
        dist.reduce_scatter_single(out, g.contiguous())
        return out


def gather(x):
    """All ranks' rows of x, differentiable (_AllGather); x itself in one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    return _AllGather.apply(x)


def contrastive_loss(img, txt, scale, neg_txt=None, neg_txt_valid=None, neg_img=None):
    """Symmetric InfoNCE, local rows against all-gathered columns (mean over ranks = the
    single-process loss). NegCLIP: negative captions as extra image->text columns, negative images
    (already global) as extra text->image columns."""
    B = img.shape[0]
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    labels = torch.arange(B, device=img.device) + rank * B
    all_img, all_txt = gather(img), gather(txt)
    txt_cols = all_txt if neg_txt is None else torch.cat([all_txt, gather(neg_txt)])
    img_cols = all_img if neg_img is None else torch.cat([all_img, neg_img])
    li = scale * img @ txt_cols.t()
    if neg_txt_valid is not None:   # a caption with nothing to swap gets no negative column
        keep = torch.cat([torch.ones(all_txt.shape[0], dtype=torch.bool, device=img.device),
                          gather(neg_txt_valid)])
        li = li.masked_fill(~keep[None], float("-inf"))
    lt = scale * txt @ img_cols.t()
    return (F.cross_entropy(li, labels) + F.cross_entropy(lt, labels)) / 2


def kd_loss(anchor, student, teacher, scale, temp=1.0):
    """Hinton KD between teacher and student image<->text logits, both directions. `anchor`
    are the other agent's embeddings (local rows); columns are all-gathered."""
    all_a, all_s, all_t = gather(anchor), gather(student), gather(teacher)

    def kl(s_logits, t_logits):
        return F.kl_div(F.log_softmax(s_logits / temp, -1), F.log_softmax(t_logits / temp, -1),
                        log_target=True, reduction="batchmean") * temp ** 2

    a2x = kl(scale * anchor @ all_s.t(), scale * anchor @ all_t.t())
    x2a = kl(scale * student @ all_a.t(), scale * teacher @ all_a.t())
    return (a2x + x2a) / 2


class ImagePool:
    """FIFO pool of detached global image embeddings (same on every rank); an image's hard
    negative is its nearest neighbour here."""

    def __init__(self, size, dim, device):
        self.emb = torch.zeros(size, dim, device=device)
        self.ptr = torch.zeros((), dtype=torch.long, device=device)
        self.count = 0      # python int: how many rows are filled (no device sync)

    def nearest(self, x):
        if self.count == 0:
            return None
        pool = self.emb[: self.count]
        return pool[(x @ pool.t()).argmax(-1)]

    def push(self, x):
        n, size = x.shape[0], self.emb.shape[0]
        idx = (self.ptr + torch.arange(n, device=x.device)) % size
        self.emb[idx] = x.detach().float()
        self.ptr = (self.ptr + n) % size
        self.count = min(size, self.count + n)


# -----------------------------------------------------------------------------
# NegCLIP's hard-negative captions (Yuksekgonul et al. 2023, "When and why vision-language models
# behave like bags-of-words", Sec. 5), made in the loader's workers: data.make_loader(batch_extra=
# NegativeCaptions(tokenizer, seed)) adds "neg_text" and "neg_valid" to every batch. Two words of
# one part of speech are swapped, or a spatial relation flipped. Choice: no tagger is allowed, so
# parts of speech come from a closed-class lexicon, adjective suffixes and the position in a
# left-to-right noun-phrase chunk; a word of unknown class (an -ing or -ed pre-modifier) is never
# swapped.
DETERMINERS = set("a an the this that these those some several many his her their its my your "
                  "our each every another no one two three four five six seven eight nine "
                  "ten".split())
CLOSED_CLASS = DETERMINERS | set(
    "of in on at with by near under over above below behind beside between into onto "
    "through across along around during for against inside outside toward towards "
    "past down up off out from about among like after before without beneath "
    "underneath next to and or but while as who which where when whose he she it they "
    "we you him them is are was were be been being am has have had do does did can "
    "could will would there very high".split())
COLOUR_WORDS = set("red orange yellow green blue purple pink brown black white gray grey cyan "
                   "magenta silver gold".split())
ADJECTIVES = COLOUR_WORDS | set(
    "small large big little tiny huge tall short long young old new wooden empty busy "
    "calm soft smiling happy snowy sunny dark bright open full clean dirty wet dry "
    "hot cold fresh round square striped crowded concrete pretty beautiful cute sandy "
    "grassy rocky cloudy furry colorful".split())
ADJ_SUFFIX = re.compile(r".{3,}(ful|ous|ive|able|ible|ish|less)$")
IRREGULAR_PLURALS = set("men women children people feet teeth mice geese sheep".split())
COORDINATORS = {"and", "or", "&"}
RELATION_OPPOSITES = {"in front of": "behind", "behind": "in front of",
                      "to the left of": "to the right of", "to the right of": "to the left of",
                      "on top of": "under", "underneath": "on top of",
                      "above": "below", "below": "above", "over": "under", "under": "over",
                      "inside": "outside", "outside": "inside",
                      "next to": "far from", "near": "far from", "far from": "next to",
                      "left": "right", "right": "left"}


def tag_caption(words):
    """Coarse tags: DET, CLOSED, ADJ, NOUN (chunk head, .plural), MOD (pre-head nominal), VBG, VBZ,
    VBN."""
    low = [w.lower() for w in words] + [""]
    # "a man rides a horse": an -s word after an open-class word and before a closed-class one
    vbz = {i for i in range(1, len(low) - 1)
           if low[i].endswith("s") and not low[i].endswith("ss")
           and low[i - 1].isalpha() and low[i - 1] not in CLOSED_CLASS | ADJECTIVES
           and low[i + 1] in CLOSED_CLASS}
    tags, in_np = [], False
    for i, w in enumerate(low[:-1]):
        nxt = low[i + 1]
        nominal_next = (nxt and i + 1 not in vbz and nxt not in CLOSED_CLASS
                        and not nxt.endswith(("ing", "ed")))
        if w in DETERMINERS:
            tag, in_np = "DET", True
        elif w in CLOSED_CLASS or not w.isalpha():
            tag, in_np = "CLOSED", False
        elif w in ADJECTIVES or ADJ_SUFFIX.match(w):
            tag, in_np = "ADJ", True
        elif w.endswith("ing") and not in_np:
            tag = "VBG"
        elif w.endswith("ed") and len(w) > 4 and not in_np:
            tag = "VBN"
        elif i in vbz:
            tag, in_np = "VBZ", False
        elif nominal_next and (in_np or w.endswith(("ing", "ed"))):
            tag, in_np = "MOD", True             # "dirt road", "parking lot", "striped shirt"
        else:
            plural = (w in IRREGULAR_PLURALS
                      or (w.endswith("s") and not w.endswith(("ss", "us", "is"))))
            tag, in_np = "NOUN.pl" if plural else "NOUN", False
        tags.append(tag)
    return tags


def reorders_conjuncts(low, comma, i, j):
    """Whether exchanging words i < j only reorders two conjuncts of a coordination, which keeps the
    meaning ("a man and a woman" -> "a woman and a man", "bananas, apples and oranges" -> "oranges,
    apples and bananas"): a false negative. With conjuncts L X_i R and L' X_j R' (bounded by commas
    and coordinators), the swap gives L X_j R ... L' X_i R', a reordering when L = L' and R = R'."""
    art = lambda ws: ["a" if w == "an" else w for w in ws]
    r_end = next((k for k in range(i, j) if comma[k] or low[k + 1] in COORDINATORS), None)
    if r_end is None:
        return False                       # no coordination between the two words
    l_start = max(k for k in range(i, j) if comma[k] or low[k] in COORDINATORS) + 1
    right, left = low[i + 1:r_end + 1], low[l_start:j]
    return (len(left) <= i and art(low[i - len(left):i]) == art(left)
            and art(low[j + 1:j + 1 + len(right)]) == art(right))


def negative_caption(caption, rng):
    """A NegCLIP hard negative: two nouns (same number), two adjectives or two verbs of one form
    exchanged (never adjacent, never two sides of a coordination), or one spatial relation replaced
    by its opposite as a whole phrase ("in front of" -> "behind"). None when the caption offers
    nothing."""
    words = caption.split()
    core = [w.strip(".,;:!?\"'") for w in words]
    low = [w.lower() for w in core]
    # a colour swaps with a colour only
    tags = [t + ".colour" if t == "ADJ" and low[i] in COLOUR_WORDS else t
            for i, t in enumerate(tag_caption(core))]
    comma = [w.rstrip("\"'").endswith((",", ";")) for w in words]
    text = caption.lower()
    spans = []                                    # relation phrases, longest first, not overlapping
    for phrase in sorted(RELATION_OPPOSITES, key=len, reverse=True):
        for m in re.finditer(rf"\b{phrase}\b", text):
            if not any(m.start() < e and s < m.end() for s, e, _ in spans):
                spans.append((m.start(), m.end(), phrase))
    in_relation = {len(text[:s].split()) + k
                   for s, e, _ in spans for k in range(len(text[s:e].split()))}
    options = []
    for kind in ("NOUN", "NOUN.pl", "ADJ", "ADJ.colour", "VBG", "VBZ"):
        idx = [i for i, t in enumerate(tags) if t == kind and i not in in_relation]
        pairs = [(i, j) for i in idx for j in idx
                 if j > i + 1 and low[i] != low[j] and not reorders_conjuncts(low, comma, i, j)]
        if pairs:
            options.append(("swap", pairs))
    if spans:
        options.append(("flip", spans))
    if not options:
        return None
    kind, cands = rng.choice(options)
    if kind == "swap":
        i, j = rng.choice(cands)
        out = list(words)
        out[i], out[j] = words[i].replace(core[i], core[j]), words[j].replace(core[j], core[i])
    else:                                         # `text` is the caption lower-cased: same offsets
        s, e, phrase = rng.choice(cands)
        out = (caption[:s] + RELATION_OPPOSITES[phrase] + caption[e:]).split()
    for i in range(len(out) - 1):               # keep "a"/"an" right, or the article gives it away
        if out[i].lower() in ("a", "an"):
            an = out[i + 1][0].lower() in "aeiou"
            out[i] = ("An" if an else "A") if out[i][0].isupper() else ("an" if an else "a")
    neg = " ".join(out)
    return neg if neg.lower() != caption.lower() else None


class NegativeCaptions:
    """The loader's `batch_extra`: negatives made and tokenized in the data workers (~10 ms per 256
    captions), re-drawn each epoch from (seed, epoch, sample key) as NegCLIP samples one of several
    per caption, so a resumed run draws the same ones. neg_valid: False where nothing can be
    swapped."""

    def __init__(self, tokenizer, seed):
        self.tokenizer, self.seed = tokenizer, seed

    def __call__(self, batch, epoch):
        negs = [negative_caption(c, random.Random(f"negclip/{self.seed}/{epoch}/{k}/{c}"))
                for c, k in zip(batch["caption"], batch["key"])]
        return {"neg_text": self.tokenizer([n if n is not None else c
                                            for n, c in zip(negs, batch["caption"])]),
                "neg_valid": torch.tensor([n is not None for n in negs])}


# -----------------------------------------------------------------------------
# iterated-learning schedule and learning rate
class ILSchedule:
    """warm-up [0, t_warm) = generation 0, then `generations` x [spawn -> distill -> interact],
    the last interaction extended by t_extend."""

    def __init__(self, t_warm, t_distill, t_interact, generations, t_extend, enabled=True,
                 cycles=None):
        self.t_warm = t_warm
        self.t_distill = t_distill
        self.generations = generations
        self.enabled = enabled
        self.gen_len = t_distill + t_interact
        self.total = t_warm + generations * self.gen_len + t_extend
        self.spawn_steps = ([t_warm + g * self.gen_len for g in range(generations)]
                            if enabled else [])
        # LR cycle starts: the spawns, or IL's generation starts without a spawn (cycles=True: a
        # control run)
        self.cycle_starts = ([t_warm + g * self.gen_len for g in range(generations)]
                             if cycles else self.spawn_steps)

    def at(self, step):
        """(phase, generation, start step of that generation)."""
        if not self.enabled:
            return "train", 0, 0
        if step < self.t_warm or self.generations == 0:
            return "warmup", 0, 0
        g = min((step - self.t_warm) // max(1, self.gen_len), self.generations - 1)
        start = self.t_warm + g * self.gen_len
        phase = "distill" if step - start < self.t_distill else "interact"
        return phase, g + 1, start

    def cycle(self, step, end):
        """[start, stop) of the LR cycle holding step under --lr_schedule generation / il_cycles:
        the warm-up, each generation (distill + interact), the extension; the run's last cycle
        stops at `end`."""
        cuts = [0, *self.cycle_starts] + [g + self.gen_len for g in self.cycle_starts[-1:]]
        return max(c for c in cuts if c <= step), min([c for c in cuts if c > step] + [end])


def make_schedule(args):
    return ILSchedule(args.t_warm, args.t_distill, args.t_interact, args.generations,
                      args.t_extend, enabled=args.method == "il",
                      cycles=args.lr_schedule == "il_cycles")


def spawn_agent(args, generation):
    if args.spawn == "alternate":
        return "language" if generation % 2 == 1 else "vision"
    return args.spawn


def spawn_seed(seed, generation):
    """Same on every rank and on resume."""
    return (seed * 1_000_003 + 7919 * generation) % (2 ** 62)


def warmup_cosine(s, length, warm, peak):
    """Step s of a cycle of `length` steps: linear warm-up over `warm` steps, then cosine decay to
    0."""
    if s < warm:
        return peak * (s + 1) / warm
    return 0.5 * peak * (1 + math.cos(math.pi * min(1.0, (s - warm) / max(1, length - warm))))


def get_lr(step, args, sched):
    # paper Table 4: one cosine over the run, re-warmed up to its current point
    if args.lr_schedule == "global":
        lr = warmup_cosine(step, args.max_steps, args.warmup, args.lr)
        phase, gen, start = sched.at(step)
        if gen > 0 and args.rewarm > 0:  # linear re-warm-up at the start of every generation
            lr *= min(1.0, (step - start + 1) / args.rewarm)
        return lr
    # Choice: (the paper gives no such schedule) each cycle (warm-up, each generation, the
    # extension) warms up to the full peak and decays to 0, so late generations learn as much as
    # early ones.
    start, end = sched.cycle(step, args.max_steps)
    return warmup_cosine(step - start, end - start, args.warmup if start == 0 else args.rewarm,
                         args.lr)


# -----------------------------------------------------------------------------
# weights: --init, load_model
def load_model(path, device="cpu", quick_gelu=None):
    """-> (model, tokenizer or None, config) from an out_dir, a checkpoint/ folder or an
    OpenAI-layout weight file. The activation: `quick_gelu`, else the checkpoint's config, else
    lifecycle.weights_activation's (an assumption is said on stderr); config["quick_gelu_source"]
    says which."""
    folder = (lifecycle.checkpoint_dir(path) if os.path.isdir(path)
              else os.path.dirname(os.path.abspath(path)))
    if os.path.isdir(path):
        config = lifecycle.read_json(os.path.join(folder, "config.json"))
        names = {f.name for f in fields(ModelConfig)}
        cfg = ModelConfig(**{k: v for k, v in config["model"].items() if k in names})
        sd = lifecycle.read_weights(os.path.join(folder, "model.safetensors"))
        source = config.get("quick_gelu_source", "config")
    else:
        sd = lifecycle.read_weights(path)
        # OpenAI's conventions: a bare file has no config
        hparams = lifecycle.clip_hparams(sd, path)
        if "codebook" in sd:        # this script's codebook head
            hparams["codebook_size"], hparams["code_dim"] = sd["codebook"].shape
        cfg = ModelConfig(**hparams)
        cfg.quick_gelu, source = lifecycle.weights_activation(None, path)
        config = {"model": asdict(cfg)}
    if quick_gelu is not None:
        cfg.quick_gelu, source = bool(quick_gelu), "flag"
    elif source == "assumed":
        print(lifecycle.assumed_activation_note(path, trained=os.path.isdir(path)), file=sys.stderr)
    config["model"]["quick_gelu"], config["quick_gelu_source"] = cfg.quick_gelu, source
    model = CLIP(cfg)
    lifecycle.load_state(model, sd, path)
    tok = next((data.Tokenizer.load(d) for d in (folder, path)
                if os.path.isfile(os.path.join(d, "tokenizer.json"))), None)
    return model.to(device).eval(), tok, config


# -----------------------------------------------------------------------------
# the loss of one micro-batch: every term a forker may change sits here
def trim_padding(text, eot_id: int, multiple: int = 8):
    """Drop the token columns after a CPU batch's last EOT, rounded up to a multiple of 8 (tensor
    cores, few compiled lengths): exact when nothing reads past a caption's EOT (a causal text
    tower; the codebook head masks those positions). A device tensor is returned as is (finding the
    EOT would sync)."""
    if text.device.type != "cpu":
        return text
    n = int((text == eot_id).int().argmax(-1).max()) + 1
    return text[:, :min(text.shape[1], -(-n // multiple) * multiple)]


def compute_loss(model, batch, phase, agent, teacher, pool, args):
    """One micro-batch -> (loss to backpropagate, contrastive loss for the log, the logit scale
    used, text length after trimming, NegCLIP's global image embeddings for train() to add to the
    pool, or None). NegCLIP's negative captions ride in the same text batch (one forward per
    micro-batch)."""
    device = model.logit_scale.device
    # uint8 -> normalised float on the device
    images = data.normalize_images(batch["image"], device)
    text, n = batch["text"], batch["text"].shape[0]
    negclip = pool is not None and phase != "distill"
    if negclip:
        text = torch.cat([text, batch["neg_text"]])            # made by the loader's workers
    text = trim_padding(text, model.cfg.eot_token_id)         # on the CPU: no device sync
    text_len = text.shape[1]
    text = text.to(device, non_blocking=True)
    img, txt, scale = model(images, text)
    txt, neg_txt = txt[:n], (txt[n:] if negclip else None)
    if phase == "distill":
        # distill (paper Sec. 3.2): the spawned agent learns the old generation's logits (kd_loss);
        # the scale is the student's, detached (logit_scale is frozen here)
        with torch.no_grad():
            t_emb = (teacher.encode_text(text) if agent == "language"
                     else teacher.encode_image(images))
        s_emb, o_emb = (txt, img) if agent == "language" else (img, txt)
        logged = contrastive_loss(img.detach(), txt.detach(), scale.detach())  # Fig. 3's curve
        if args.distill_loss == "cos":
            return (1 - (s_emb * t_emb).sum(-1)).mean(), logged, scale.detach(), text_len, None
        return (kd_loss(o_emb, s_emb, t_emb, scale.detach(), KD_TEMP), logged, scale.detach(),
                text_len, None)
    neg_valid = neg_img = all_img = None
    if negclip:
        # NegCLIP's extra columns (contrastive_loss): the negative captions, each image's pool
        # neighbour
        neg_valid = batch["neg_valid"].to(device, non_blocking=True)
        all_img = gather(img.detach())
        neg_img = pool.nearest(all_img)
    loss = contrastive_loss(img, txt, scale, neg_txt, neg_valid, neg_img)
    return loss, loss.detach(), scale.detach(), text_len, all_img


class StepLoss(nn.Module):
    """compute_loss as the forward() DDP wraps: a term that uses a parameter directly (a learnable
    bias, a weight penalty) gets its gradient averaged over ranks like the rest (around the model
    alone, DDP fails on it: "marked as ready twice"). Every trained parameter enters the loss: one
    that this phase's loss leaves out (a fork's SigLIP bias in distill) enters times 0
    (lifecycle.unused_parameters, found at the first step of each trainable set), so it trains alike
    on 1 process and under torchrun. The loss and the gradients of the others are unchanged."""

    def __init__(self, model, args):
        super().__init__()
        self.model, self.args, self.unused = model, args, None

    def forward(self, batch, phase, agent, teacher, pool):
        loss, *out = compute_loss(self.model, batch, phase, agent, teacher, pool, self.args)
        if self.unused is None:
            self.unused = lifecycle.unused_parameters(
                loss, [p for p in self.model.parameters() if p.requires_grad])
        if self.unused:
            loss = loss + sum(p.reshape(-1)[0] for p in self.unused) * 0.0
        return loss, *out


# -----------------------------------------------------------------------------
# model + optimizer, the IL phases (trainable sets, spawn)
def setup_distributed(args):
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if int(os.environ.get("RANK", -1)) == -1:
        return 0, 1
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(args.device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    return rank, world


def build_tokenizer(args, rank, world):
    """Rank 0 reads --vocab or trains a BPE on the captions into out_dir; every rank loads that."""
    if rank == 0 and not (args.resume
                          and os.path.isfile(os.path.join(args.out_dir, "tokenizer.json"))):
        captions = None if args.vocab else data.captions_for_tokenizer(
            args.data, image_root=args.image_root, img_key=args.csv_img_key,
            caption_key=args.csv_caption_key, separator=args.csv_separator)
        os.makedirs(args.out_dir, exist_ok=True)
        data.build_tokenizer(vocab_path=args.vocab, captions=captions, vocab_size=args.vocab_size,
                             context_length=args.context_length).save(args.out_dir)
    if world > 1:
        dist.barrier()
    return data.Tokenizer.load(args.out_dir)


def model_config(args, tok):
    """The preset, then --model_args and --quick_gelu (with --init: lifecycle.weights_activation);
    the tokenizer fixes vocabulary and length. args.quick_gelu_source records the activation's
    source."""
    cfg = ModelConfig(**{**MODEL_PRESETS[args.model], **args.model_overrides})
    cfg.vocab_size, cfg.context_length, cfg.eot_token_id = (tok.vocab_size, tok.context_length,
                                                            tok.eot_id)
    args.quick_gelu_source = "preset"
    if args.init:
        cfg.quick_gelu, args.quick_gelu_source = lifecycle.weights_activation(args.quick_gelu,
                                                                              args.init)
    elif args.quick_gelu is not None:
        cfg.quick_gelu, args.quick_gelu_source = args.quick_gelu, "flag"
    cfg.codebook_size, cfg.code_sim, cfg.spectral_norm = (args.codebook, args.code_sim,
                                                          args.spectral_norm)
    return cfg


def param_groups(model):
    """AdamW groups: no weight decay on gains, biases, 1-d embeddings and logit_scale."""
    params = list(model.named_parameters())
    no_decay = {n for n, p in params
                if p.ndim < 2 or "ln_" in n or "bias" in n or "logit_scale" in n}
    return [p for n, p in params if n not in no_decay], [p for n, p in params if n in no_decay]


def build_model_and_optimizer(args, cfg, device):
    model = CLIP(cfg, seed=args.seed).to(device)
    if args.init:
        lifecycle.load_state(model, lifecycle.read_weights(args.init), args.init,
                             allow_missing=("codebook", "image_query.", "text_query.",
                                            "code_temperature"))
        if getattr(args, "quick_gelu_source", None) == "assumed":
            print(lifecycle.assumed_activation_note(args.init), file=sys.stderr)
    decay, no_decay = param_groups(model)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr,
                            betas=tuple(args.betas), eps=args.eps, fused=device.type == "cuda")
    if args.compile:
        compile_encoders(model)
    return model, opt


def compile_encoders(model):
    """Compile the encoders only (instance attributes shadow the methods): IL logic stays
    eager."""
    model.encode_image, model.encode_text = (torch.compile(model.encode_image),
                                             torch.compile(model.encode_text))


def frozen_copy(model, compile=False):
    """A frozen deep copy (the distillation teacher), without the compiled encoders of
    `model`."""
    compiled = {k: model.__dict__.pop(k) for k in ("encode_image", "encode_text")
                if k in model.__dict__}
    copied = copy.deepcopy(model).eval().requires_grad_(False)
    model.__dict__.update(compiled)
    if compile:
        compile_encoders(copied)
    return copied


def set_trainable(model, args, phase, agent):
    """requires_grad per IL phase: a frozen parameter gets no .grad, so AdamW leaves it bitwise
    unchanged (train() wraps each trainable set in a DDP of its own)."""
    frozen = set(UNUSED_WITH_CODEBOOK) if model.cfg.codebook_size else set()
    if phase == "distill":
        frozen.add("logit_scale")                          # the KD logits use a detached scale
        if not args.no_freeze_codebook:
            frozen.add("codebook")                         # paper: the codebook evolves smoothly
        if not args.distill_train_vision:                  # the other agent
            frozen |= {n for n, _ in agent_params(
                model, "vision" if agent == "language" else "language")}
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)


def spawn(model, opt, args, gen):
    """The IL spawn (paper Sec. 3.2) -> the frozen teacher (a copy of the model); the spawned agent
    is re-initialised as at step 0 from a generation seed (on the CPU: same numbers on every rank),
    its AdamW state cleared. Same Parameters, so the optimizer survives."""
    agent = spawn_agent(args, gen)
    teacher = frozen_copy(model, args.compile)
    fresh = frozen_copy(model).cpu()
    fresh.init_agent(agent, torch.Generator().manual_seed(spawn_seed(args.seed, gen)))
    src = dict(fresh.named_parameters())
    with torch.no_grad():
        for n, p in agent_params(model, agent):
            p.copy_(src[n].to(p.device))
            opt.state.pop(p, None)
    return teacher


# -----------------------------------------------------------------------------
# training
@dataclass
class RunState:
    """Everything the training loop carries from step to step (what a checkpoint saves)."""
    args: argparse.Namespace        # the flags, data-dependent defaults filled by check_args
    rank: int                       # this process; rank 0 logs and writes checkpoints
    world: int                      # number of processes (torchrun's WORLD_SIZE)
    device: torch.device
    autocast: object                # bf16 autocast on CUDA (--dtype), else a no-op context
    tok: data.Tokenizer             # saved beside every checkpoint
    cfg: ModelConfig
    model: CLIP                     # the bare model: checkpoints, evaluation, IL freezing
    opt: torch.optim.Optimizer      # AdamW
    sched: ILSchedule               # step -> (phase, generation)
    loader: object                  # data.make_loader's; its position is checkpointed
    batches: object                 # loader.forever(): epoch after epoch
    pool: ImagePool | None          # NegCLIP's image embeddings (None without negatives)
    metrics_path: str               # out_dir/metrics.jsonl
    step: int = 0                   # optimizer steps done
    spawned: int = 0                # the last generation spawned (0: none yet)
    teacher: CLIP | None = None     # the previous generation, frozen, during distill
    # since the last log line: loss, contrastive loss, non-finite count
    sums: torch.Tensor | None = None
    n_loss: int = 0                 # micro-batches summed in `sums`
    text_tokens: int = 0            # their trimmed text lengths, summed (the log's text_len)
    newest_damaged: bool = False    # resumed from checkpoint.prev: the next save keeps it
    stopped_by: str | None = None   # the stop signal, as the ranks agreed on it
    wandb: object = None            # the wandb module with --wandb (rank 0), else None


def setup(args, rank, world, ckpt=None):
    """The run's state, restored from `ckpt` (lifecycle.load_checkpoint's) on --resume."""
    device = torch.device(args.device)
    dt = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if args.batch_size % (world * args.accum):
        raise ConfigError(f"--batch_size {args.batch_size} is not divisible by "
                          f"world_size x accum = {world * args.accum}")
    if args.init and not os.path.isfile(args.init):
        raise ConfigError(f"--init file not found: {args.init}")
    # e.g. cc3m without shards: DataError saying where it looked
    data.resolve_data(args.data, args.image_root)
    tok = build_tokenizer(args, rank, world)
    cfg = model_config(args, tok)
    model, opt = build_model_and_optimizer(args, cfg, device)
    pool = negatives = None
    if args.method == "negclip" or args.negatives:
        pool = ImagePool(args.neg_pool, cfg.code_dim if cfg.codebook_size else cfg.embed_dim,
                         device)
        negatives = NegativeCaptions(tok, args.seed)   # hard-negative captions, made in the workers
    loader = data.make_loader(
        args.data, split="train", batch_size=args.batch_size // (world * args.accum), tokenizer=tok,
        image_size=cfg.image_size, train=True, rank=rank, world_size=world,
        num_workers=args.num_workers,
        seed=args.seed, resampled=args.resampled, drop_last=True, image_root=args.image_root,
        csv_img_key=args.csv_img_key, csv_caption_key=args.csv_caption_key,
        csv_separator=args.csv_separator, pin_memory=device.type == "cuda", batch_extra=negatives)
    r = RunState(args=args, rank=rank, world=world, device=device, tok=tok, cfg=cfg, model=model,
                 opt=opt,
                 autocast=(nullcontext() if dt == "fp32"
                           else torch.autocast(device.type, dtype=torch.bfloat16)),
                 sched=make_schedule(args), loader=loader, batches=loader.forever(), pool=pool,
                 metrics_path=os.path.join(args.out_dir, "metrics.jsonl"),
                 sums=torch.zeros(3, device=device))
    if ckpt is not None:
        load_checkpoint(r, ckpt)
    elif rank == 0:
        # a fresh log (a symbolic link there is replaced, not followed)
        lifecycle.write_file(r.metrics_path, "")
    return r


def train(r):
    """The step loop. -> "done" | "stopped" (a signal) | "nan"."""
    args, model = r.args, r.model
    end = args.max_steps if args.stop_at is None else min(args.max_steps, args.stop_at)
    t_last, step_last, trainable_for = time.time(), r.step, None
    if r.step >= end:          # nothing to train (e.g. --max_steps 0 to export --init weights)
        save_checkpoint(r)
    bar = lifecycle.progress(total=end, initial=r.step, desc="train", unit="step",
                             disable=r.rank != 0)
    while r.step < end:
        phase, gen, _ = r.sched.at(r.step)
        agent = spawn_agent(args, gen) if phase == "distill" else None
        if gen > r.spawned and r.step in r.sched.spawn_steps:
            save_generation_snapshot(r, gen - 1)
            r.teacher, r.spawned = spawn(model, r.opt, args, gen), gen
        if phase != "distill":
            r.teacher = None
        if (phase, agent) != trainable_for:
            set_trainable(model, args, phase, agent)
            trainable_for = (phase, agent)
            fwd = StepLoss(model, args)         # every loss term inside DDP's forward
            # DDP fixes its parameter set at construction (and broadcasts rank 0's weights, equal on
            # every rank): one wrapper per trainable set, so it need not search for unused ones
            if r.world > 1:
                fwd = torch.nn.parallel.DistributedDataParallel(
                    fwd, find_unused_parameters=model.find_unused_parameters)
        lr = get_lr(r.step, args, r.sched)
        for group in r.opt.param_groups:
            group["lr"] = lr
        if r.cfg.codebook_size:
            model.code_temperature.fill_(
                max(0.01, args.code_temp * args.code_temp_decay ** (r.step / CODE_TEMP_ITERS)))
        # forward/backward, gradients averaged over ranks by DDP on the last micro-batch only
        for micro in range(args.accum):
            batch = next(r.batches)
            with fwd.no_sync() if r.world > 1 and micro < args.accum - 1 else nullcontext():
                with r.autocast:
                    loss, logged, scale, text_len, new_images = fwd(batch, phase, agent,
                                                                    r.teacher, r.pool)
                (loss / args.accum).backward()
            if new_images is not None:
                r.pool.push(new_images)
            r.sums += torch.stack([loss.detach(), logged, (~torch.isfinite(loss.detach())).float()])
            r.n_loss += 1
            r.text_tokens += text_len
        if args.grad_clip > 0:      # over the parameters with a gradient (a frozen one has none)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        r.opt.step()
        r.opt.zero_grad(set_to_none=True)
        model.clamp_logit_scale_()
        r.step += 1
        bar.update()
        # sync points (the loop's only host-device syncs): log steps, save steps, phase changes
        # (a --stop_at step saves without a log line: the resumed run logs as an uninterrupted one)
        log_now = (r.step % args.log_interval == 0 or r.step == args.max_steps
                   or r.sched.at(r.step)[0] != phase)
        save_now = r.step % args.save_interval == 0 or r.step == end
        stop = lifecycle.stop_code()
        if not (log_now or save_now or (r.world == 1 and stop)):
            continue
        stats = torch.cat([r.sums / max(1, r.n_loss), torch.tensor([stop], device=r.device)])
        if r.world > 1:           # mean loss over ranks; nonzero if any rank is bad / signalled
            dist.all_reduce(stats)
            stats[:2] /= r.world
        loss_v, clip_v, bad, stop = stats.tolist()
        r.stopped_by = lifecycle.stopped_by(stop)
        if bad or (save_now or stop) and not lifecycle.all_finite(
                [model.state_dict(), list(r.opt.state.values())]):
            bar.close()
            if r.rank == 0:
                print(f"error: non-finite loss or weights at step <= {r.step} (phase {phase}, "
                      f"generation {gen}); stopping, the last good checkpoint in {args.out_dir} "
                      f"is kept", file=sys.stderr)
            return "nan"
        if log_now:
            now = time.time()
            sps = (r.step - step_last) * args.batch_size / max(now - t_last, 1e-9)
            text_len = r.text_tokens / max(1, r.n_loss)
            rec = {"step": r.step, "loss": loss_v, "clip": clip_v, "lr": lr, "phase": phase,
                   "generation": gen,
                   "logit_scale": scale.item(),     # the scale the loss used
                   "samples_per_s": round(sps, 2), "text_len": round(text_len, 2),
                   "mfu": lifecycle.estimate_mfu(r.cfg, sps, r.device, text_len), "time": now}
            if r.rank == 0:
                lifecycle.log_record(r.metrics_path, rec, r.wandb)
                bar.set_postfix(loss=f"{loss_v:.4f}", phase=phase, gen=gen)
            r.sums.zero_()
            r.n_loss = r.text_tokens = 0
            t_last, step_last = now, r.step
        if save_now or stop:
            save_checkpoint(r)
            if r.rank == 0:
                draw_loss_curve(r.metrics_path, os.path.join(args.out_dir, "loss_curve.png"),
                                r.sched.spawn_steps,
                                args.method + ("+neg" if args.negatives else ""))
        if stop:
            bar.close()
            return "stopped"
    bar.close()
    if r.spawned and end == args.max_steps:
        save_generation_snapshot(r, r.spawned)
    return "done"


# -----------------------------------------------------------------------------
# the built-in shapes benchmark, scored at the end of a run on `shapes`
SHAPES_METRICS = data.SHAPES_METRICS


def evaluate_shapes(model, tokenizer, n=1000, n_val=data.SHAPES_VAL_PAIRS, seed=0, batch_size=256,
                    progress=False):
    """The model on the built-in benchmark (data.score_shapes, the scorer eval_compositional.py's
    `shapes` calls too), in percent: i2t / t2i R@1 on `n_val` val scenes and the hard-negative
    accuracy of each category."""
    was_training = model.training
    model.eval()
    res = data.score_shapes(model.encode_image, model.encode_text, tokenizer, model.cfg.image_size,
                            model.logit_scale.device, n, n_val, seed, batch_size, progress)
    model.train(was_training)
    return res


# =============================================================================
# infrastructure: il_clip's part of the run lifecycle (the rest is data.py's: the out_dir lock, the
# checkpoint files and their fallback, write errors, stop signals, wandb, the curve), MFU, the loss
# curve. Nothing here changes training.
# state.pt, checked to its leaves before --resume restores anything from it
# (lifecycle.read_checkpoint)
STATE_TYPES = {"step": int, "spawned": int, "optimizer": lifecycle.OPTIMIZER_STATE,
               "loader": data.LOADER_STATE,
               "log": {"sums": torch.Tensor, "n": int, "text_tokens": int},
               "rng": lifecycle.RNG_STATE,
               # distill: the previous generation, frozen
               "teacher": ({...: torch.Tensor}, type(None)),
               # NegCLIP's images
               "pool": ({"emb": torch.Tensor, "ptr": torch.Tensor, "count": int}, type(None))}
# the flags --resume takes from its command line (ALWAYS_NOW always, the others when given); the
# rest define the run: given with --resume, they must equal the saved values
ALWAYS_NOW = {"out_dir", "resume", "overwrite", "given", "stop_at", "device"}
RUN_CONTROL = ALWAYS_NOW | {"save_interval", "log_interval", "num_workers", "eval_size", "compile",
                            "wandb"}
# what --overwrite removes from out_dir: the earlier run's checkpoints and results
RUN_FILES = (r"checkpoint(\..*)?|gen\d+",
             r"metrics\.jsonl|shapes_eval\.json|config\.json|wandb_id\.txt|.*\.png")


def resumed_args(args, config):
    """--resume: the saved run's flags and the run-control flags given now (a changed run-defining
    flag: DataError)."""
    saved = {k: config[k] for k in vars(args) if k in config} | {"model": config["preset"]}
    given = {k: getattr(args, k) for k in args.given}
    saved = lifecycle.resumed_flags(given, saved, RUN_CONTROL, args.out_dir, ALWAYS_NOW)
    return check_args(argparse.Namespace(**(vars(args) | saved)))


def save_checkpoint(r):
    """Everything --resume needs to continue bit-exactly from r.step (rank 0 writes)."""
    if r.rank != 0:
        return
    state = {"step": r.step, "spawned": r.spawned, "optimizer": r.opt.state_dict(),
             "loader": r.loader.state_dict(),
             "teacher": r.teacher.state_dict() if r.teacher is not None else None,
             "pool": ({"emb": r.pool.emb, "ptr": r.pool.ptr, "count": r.pool.count}
                      if r.pool is not None else None),
             "log": {"sums": r.sums, "n": r.n_loss, "text_tokens": r.text_tokens},
             "rng": lifecycle.rng_state(r.device)}
    lifecycle.save_checkpoint(r.args.out_dir, r.model.state_dict(), state, run_config(r), r.tok,
                              r.step, r.newest_damaged)
    r.newest_damaged = False


def run_config(r):
    """config.json: the flags, the model config and the script that trained it (also wandb's
    config)."""
    return {**vars(r.args), "preset": r.args.model, "model": asdict(r.cfg), "world_size": r.world,
            "script": lifecycle.script_record(__file__)}


def load_checkpoint(r, ckpt):
    """save_checkpoint undone (ckpt: lifecycle.load_checkpoint's); metrics.jsonl is cut back to the
    resumed step."""
    folder, sd, state, _, r.newest_damaged = ckpt
    lifecycle.load_state(r.model, sd, folder)
    r.opt.load_state_dict(state["optimizer"])
    r.loader.load_state_dict(state["loader"])
    if state["teacher"] is not None:
        r.teacher = frozen_copy(r.model, r.args.compile)
        r.teacher.load_state_dict(state["teacher"])
    if r.pool is not None:
        r.pool.emb.copy_(state["pool"]["emb"])
        r.pool.ptr.copy_(state["pool"]["ptr"])
        r.pool.count = state["pool"]["count"]
    r.step, r.spawned = state["step"], state["spawned"]
    r.sums.copy_(state["log"]["sums"])
    r.n_loss, r.text_tokens = state["log"]["n"], state["log"]["text_tokens"]
    lifecycle.set_rng_state(state["rng"], r.device)
    if r.rank == 0:
        lifecycle.cut_metrics(r.metrics_path, r.step)


def save_generation_snapshot(r, gen):
    """out_dir/gen{gen}/model.safetensors at the end of generation `gen` (0 = warm-up), for
    eval_compositional.py's per-generation analyses (paper Figs. 4, 5)."""
    if r.rank == 0:
        d = os.path.join(r.args.out_dir, f"gen{gen}")
        sd = {k: v.detach().to("cpu").contiguous() for k, v in r.model.state_dict().items()}
        with lifecycle.writing(d):
            os.makedirs(d, exist_ok=True)
            lifecycle.atomic_write(
                os.path.join(d, "model.safetensors"),
                lambda p: lifecycle.fsync(p, lambda q: save_file(sd, q, {"step": str(r.step)})))


# -----------------------------------------------------------------------------
# the loss curve (paper Fig. 3), drawn by lifecycle.draw_curves (matplotlib)
CLIP_LOSS_COLOUR = "0.55"           # grey: the contrastive loss of every phase
PHASE_STYLE = {"warmup": ("warm-up", "tab:blue"), "distill": ("distill (KD loss)", "tab:orange"),
               "interact": ("interact", "tab:green")}
# a run without IL phases ("train"): one colour, named by its method
METHOD_COLOUR = "tab:purple"


def phase_style(phase, method):
    """(legend label, colour): IL's phases by their names, a single-phase run by its method."""
    return PHASE_STYLE.get(phase, (method, METHOD_COLOUR))


def loss_series(recs, method):
    """[(label, points, style)]: the contrastive loss in grey where it differs from the loss
    somewhere (distill: the loss is KD), and the loss as one line per phase; each stretch of a phase
    starts at the point before it, so the curve stays joined (a segment takes the colour of the
    phase it ends in)."""
    series = []
    if any(m["clip"] != m["loss"] for m in recs):
        series.append(("contrastive loss", [(m["step"], m["clip"]) for m in recs],
                       {"color": CLIP_LOSS_COLOUR, "linewidth": 1}))
    for phase in dict.fromkeys(m["phase"] for m in recs):
        label, colour = phase_style(phase, method)
        # own: the indices of this phase's records, the only points with a marker
        pts, own = [], []
        for i, m in enumerate(recs):
            if m["phase"] == phase:
                if i and recs[i - 1]["phase"] != phase:     # the joint with the stretch before
                    if pts:     # a gap after the stretch before
                        pts.append((recs[i - 1]["step"], math.nan))
                    pts.append((recs[i - 1]["step"], recs[i - 1]["loss"]))
                own.append(len(pts))
                pts.append((m["step"], m["loss"]))
        series.append((label, pts, {"color": colour, "linewidth": 2, "markevery": own}))
    return series


def draw_loss_curve(metrics_path, png_path, spawns=(), method="il"):
    """The loss coloured by phase and, in grey, the contrastive loss of every phase: Fig. 3's spike
    at each spawn (a dotted line, "gen K") shows in the grey curve. Returns the Figure."""
    with open(metrics_path) if os.path.isfile(metrics_path) else nullcontext([]) as f:
        # not the eval records
        recs = [m for m in map(json.loads, filter(str.strip, f)) if "loss" in m]
    for m in recs:      # metrics.jsonl written before the contrastive loss was named "clip"
        m.setdefault("clip", m.get("clip_loss", m["loss"]))
    return lifecycle.draw_curves(
        png_path,
        f"il_clip.py --method {method}: training loss (mean over each log interval)",
        loss_series(recs, method),
        [(s, f"spawn, gen {i + 1}") for i, s in enumerate(spawns)])


# -----------------------------------------------------------------------------
# main
def run(argv=None):
    t0 = time.time()
    args = build_args(argv)
    rank, world = setup_distributed(args)
    lifecycle.claim_out_dir(args.out_dir, rank, world, args.device, args.resume, args.overwrite,
                            RUN_FILES)
    ckpt = (lifecycle.load_checkpoint(args.out_dir, STATE_TYPES, args.device, rank)
            if args.resume else None)
    if ckpt is not None:
        args = resumed_args(args, ckpt[3])
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    r = setup(args, rank, world, ckpt=ckpt)
    if rank == 0:
        r.wandb = (lifecycle.start_wandb(args.wandb, args.out_dir, run_config(r), ckpt is not None)
                   if args.wandb else None)
        start_line(r, ckpt is not None)
        lifecycle.warmup_note(args.warmup, args.max_steps)
    status = train(r)
    if status == "done" and r.step >= args.max_steps and rank == 0 and args.eval_size > 0 \
            and args.data.startswith("shapes"):
        res = evaluate_shapes(r.model, r.tok, n=args.eval_size, progress=True)
        path = os.path.join(args.out_dir, "shapes_eval.json")
        with lifecycle.writing(path):
            lifecycle.save_json(path, res | {"scored": {"items_per_category": args.eval_size,
                                                        "val_pairs": data.SHAPES_VAL_PAIRS}})
        lifecycle.log_record(r.metrics_path,
                             {"step": r.step, "phase": "eval", "time": time.time(), **res}, r.wandb)
        # a markdown table
        rows = [list(res), ["---"] * len(res), [lifecycle.percent(v) for v in res.values()]]
        print("\n".join("| " + " | ".join(row) + " |" for row in rows))
        print(f"scored: {args.eval_size} items per category (every item), "
              f"retrieval on {data.SHAPES_VAL_PAIRS} val pairs (percent)")
    if r.wandb is not None:
        r.wandb.finish()
    if rank == 0 and status != "nan":       # (the non-finite stop has printed its error line)
        end_line(r, status, time.time() - t0)
    if world > 1:
        dist.barrier()
    return {"done": 0, "stopped": 0, "nan": 1}[status]


def start_line(r, resumed):
    """start: script, method, parameter count, device x world size, data (+ its size), out_dir."""
    a, size = r.args, r.loader.num_samples
    negatives = " --negatives" if a.negatives else ""
    return lifecycle.start_line(__file__, f"--method {a.method}{negatives}", [
        f"{sum(p.numel() for p in r.model.parameters()) / 1e6:.2f}M parameters",
        f"{r.device} x {r.world}",
        f"data {a.data}{f' ({size} train pairs)' if size else ''}"],
        a.out_dir, r.step if resumed else None)


def end_line(r, status, seconds):
    """done / stopped: the step reached, the time, what the run wrote where, how to continue."""
    a, out = r.args, r.args.out_dir
    cmd = lifecycle.resume_command(__file__, r.world, out)
    if status == "stopped":
        return lifecycle.stop_line(r.stopped_by, r.step, a.max_steps, cmd)
    gens = sorted((n for n in os.listdir(out) if re.fullmatch(r"gen\d+", n)),
                  key=lambda n: int(n[3:]))
    names = ["checkpoint", *gens, "metrics.jsonl", "loss_curve.png", "shapes_eval.json"]
    wrote = [os.path.join(out, n) + ("/" if os.path.isdir(os.path.join(out, n)) else "")
             for n in names if os.path.exists(os.path.join(out, n))]
    more = [f"continue with: {cmd}"] if r.step < a.max_steps else []
    return lifecycle.done_line(f"step {r.step}/{a.max_steps}", seconds, wrote, more)


def main(argv=None):
    # a caller's group is the caller's to end
    owns_pg = dist.is_available() and not dist.is_initialized()
    # installed until main returns: a SIGTERM during the final save or the evaluation does not kill
    # it
    handlers = lifecycle.catch_stop_signals()
    try:
        return run(argv)
    except data.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        # before its first step: the out_dir it made goes
        lifecycle.release_out_dir(failed=True)
        return 2
    finally:
        lifecycle.release_out_dir()
        if owns_pg and dist.is_initialized():
            # torch's order: the group goes last, once, on every path, after run() has returned
            gc.collect()    # the DDP wrappers (in reference cycles) hold the group: they go first
            dist.destroy_process_group()
        lifecycle.restore_signals(handlers)


if __name__ == "__main__":
    lifecycle.hold_stop_signals_to_exit()
    sys.exit(main())
