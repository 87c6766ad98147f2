"""
CLIP, Codebook-CLIP (FDT), NegCLIP and IL-CLIP (iterated learning) in one file.

    python il_clip.py                                   # IL-CLIP tiny on the built-in shapes data
    python il_clip.py --method clip --max_steps 300     # plain CLIP baseline
    torchrun --standalone --nproc_per_node=8 il_clip.py --data cc3m --model ViT-B-32

Paper: "Iterated Learning Improves Compositionality in Large Vision-Language Models"
(Zheng et al., CVPR 2024), ../shared/papers/il_clip.md; choices the paper leaves open follow
SPEC.md section 2 and are stated next to the code that makes them.
Reads top to bottom: config -> model -> sparsemax / codebook head -> losses -> IL schedule ->
checkpoints -> training loop -> evaluation -> main().
"""
import argparse
import copy
import functools
import json
import math
import os
import random
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields, replace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import data

# -----------------------------------------------------------------------------
# config


class ConfigError(Exception):
    """A user mistake in flags or files: main() prints `error: <msg>` and exits 2."""


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
    sparsemax_topk: int = 0       # 0 = exact sort-based sparsemax; >0 = top-k fast path + exact fallback
    spectral_norm: bool = False   # Lipschitz-regularised ablation (paper Table 3)


MODEL_PRESETS = {
    # CPU-sized, for the 64x64 shapes data: 64 patches of 8x8, short captions.
    "tiny": dict(embed_dim=128, image_size=64, patch_size=8, vision_width=128, vision_layers=4,
                 vision_heads=4, context_length=32, vocab_size=1000, text_width=128, text_layers=4,
                 text_heads=4, quick_gelu=False, code_dim=128),
    "ViT-B-32": dict(embed_dim=512, image_size=224, patch_size=32, vision_width=768, vision_layers=12,
                     vision_heads=12, context_length=77, vocab_size=49408, text_width=512,
                     text_layers=12, text_heads=8, quick_gelu=True, code_dim=512),
    "ViT-B-16": dict(embed_dim=512, image_size=224, patch_size=16, vision_width=768, vision_layers=12,
                     vision_heads=12, context_length=77, vocab_size=49408, text_width=512,
                     text_layers=12, text_heads=8, quick_gelu=True, code_dim=512),
    "ViT-S-16": dict(embed_dim=384, image_size=224, patch_size=16, vision_width=384, vision_layers=12,
                     vision_heads=6, context_length=77, vocab_size=49408, text_width=384,
                     text_layers=12, text_heads=6, quick_gelu=False, code_dim=512),
}

# Paper defaults (Table 4 / section 4.1) with --data cc3m|cc12m|datacomp, and the scaled-down
# defaults used on the built-in shapes data (sized so `python il_clip.py` runs ~10 min on 2 CPU cores).
PAPER_DEFAULTS = dict(model="ViT-B-32", batch_size=1024, lr=5e-4, warmup=500, rewarm=500,
                      codebook=16384, code_temp=1000.0, t_warm=6000, t_distill=1000,
                      t_interact=5000, generations=5, t_extend=12000, context_length=77,
                      vocab_size=49408, neg_pool=16384, log_interval=50, save_interval=1000)
SHAPES_DEFAULTS = dict(model="tiny", batch_size=64, lr=1e-3, warmup=50, rewarm=25,
                       codebook=1024, code_temp=100.0, t_warm=300, t_distill=40,
                       t_interact=160, generations=3, t_extend=100, context_length=32,
                       vocab_size=1000, neg_pool=1024, log_interval=20, save_interval=200)

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


class MLP(nn.Module):
    def __init__(self, width, hidden, quick_gelu):
        super().__init__()
        self.c_fc = nn.Linear(width, hidden)
        self.gelu = QuickGELU() if quick_gelu else nn.GELU()
        self.c_proj = nn.Linear(hidden, width)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class ResidualAttentionBlock(nn.Module):
    def __init__(self, width, heads, mlp_ratio, quick_gelu):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width, int(width * mlp_ratio), quick_gelu)

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


def _raw(module, name):
    """The stored tensor behind `module.name` (the original when spectral norm parametrizes it)."""
    if hasattr(module, "parametrizations") and name in module.parametrizations:
        return module.parametrizations[name].original
    return getattr(module, name)


@torch.no_grad()
def _normal(module, name, std, g):
    t = _raw(module, name)
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
        _normal(self.fc_1, "weight", self.fc_1.in_features ** -0.5, g)
        _normal(self.fc_2, "weight", self.fc_2.in_features ** -0.5, g)


class VisionTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.image_size % cfg.patch_size:
            raise ConfigError(f"image_size {cfg.image_size} is not a multiple of patch_size {cfg.patch_size}")
        w = cfg.vision_width
        self.grid = cfg.image_size // cfg.patch_size
        self.conv1 = nn.Conv2d(3, w, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(w))
        self.positional_embedding = nn.Parameter(torch.zeros(self.grid ** 2 + 1, w))
        self.ln_pre = nn.LayerNorm(w)
        self.transformer = Transformer(w, cfg.vision_layers, cfg.vision_heads, cfg.mlp_ratio, cfg.quick_gelu)
        self.ln_post = nn.LayerNorm(w)
        self.proj = nn.Parameter(torch.zeros(w, cfg.embed_dim))
        self.init_weights(torch.Generator().manual_seed(0))     # usable alone (CLIP re-seeds)

    def init_weights(self, g):
        w = self.class_embedding.shape[0]
        _normal(self.conv1, "weight", (self.conv1.weight[0].numel()) ** -0.5, g)
        _normal(self, "class_embedding", w ** -0.5, g)
        _normal(self, "positional_embedding", w ** -0.5, g)
        _normal(self, "proj", w ** -0.5, g)
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
    """The language tower. Attributes sit at the top level so that CLIP (a subclass) has
    OpenAI's text key names: token_embedding, positional_embedding, transformer, ln_final,
    text_projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        w = cfg.text_width
        self.token_embedding = nn.Embedding(cfg.vocab_size, w)
        self.positional_embedding = nn.Parameter(torch.zeros(cfg.context_length, w))
        self.transformer = Transformer(w, cfg.text_layers, cfg.text_heads, cfg.mlp_ratio, cfg.quick_gelu)
        self.ln_final = nn.LayerNorm(w)
        self.text_projection = nn.Parameter(torch.zeros(w, cfg.embed_dim))
        self.init_text_weights(torch.Generator().manual_seed(0))  # usable alone (CLIP re-seeds)

    def init_text_weights(self, g):
        _normal(self.token_embedding, "weight", 0.02, g)
        _normal(self, "positional_embedding", 0.01, g)
        _normal(self, "text_projection", self.cfg.text_width ** -0.5, g)
        self.ln_final.weight.data.fill_(1.0)
        self.ln_final.bias.data.zero_()
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
            # rows where the top-k sparsemax refinement had not settled (read with the logged stats)
            self.register_buffer("sparsemax_inexact", torch.zeros((), dtype=torch.long), persistent=False)
        self.init_weights(seed)
        if cfg.spectral_norm:
            apply_spectral_norm(self)

    def init_weights(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.init_agent("vision", g)
        self.init_agent("language", g)
        with torch.no_grad():
            self.logit_scale.fill_(math.log(1 / 0.07))
            if self.cfg.codebook_size:
                self.codebook.copy_(torch.randn(self.codebook.shape, generator=g))  # N(0, 1)

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
        """Per-code scores r_k = max over valid tokens of q(f_p) . c_k / (sqrt(D) T) (FDT; the
        paper's Eq. 2, with `--code_sim cos`: cos / T) and their sparsemax weights (Eq. 3).
        `max_tokens`: the largest token count this call can see (see max_code_scores)."""
        q = query(tokens)
        codes = self.codebook
        if self.cfg.code_sim == "cos":
            q, codes = F.normalize(q, dim=-1), F.normalize(codes, dim=-1)
            scale = 1.0 / self.code_temperature
        else:
            scale = 1.0 / (math.sqrt(self.cfg.code_dim) * self.code_temperature)
        s = max_code_scores(q, codes, valid, max_tokens=max_tokens) * scale   # [B, K]
        w, inexact = sparsemax(s, dim=-1, topk=self.cfg.sparsemax_topk, return_inexact=True)
        self.sparsemax_inexact.add_(inexact)
        return s, w

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
        return self.encode_image(images), self.encode_text(text), self.logit_scale.exp()


def apply_spectral_norm(model):
    """Spectral normalisation of every linear map (Lipschitz-regularised CLIP, paper Table 3)."""
    from torch.nn.utils.parametrizations import spectral_norm
    for m in list(model.modules()):
        if isinstance(m, nn.Linear):
            spectral_norm(m, "weight")
        elif isinstance(m, Attention):
            spectral_norm(m, "in_proj_weight")


VISION_PREFIXES = ("visual.", "image_query.")
LANGUAGE_PREFIXES = ("token_embedding.", "positional_embedding", "transformer.", "ln_final.",
                     "text_projection", "text_query.")


def agent_params(model, agent):
    pre = VISION_PREFIXES if agent == "vision" else LANGUAGE_PREFIXES
    return [(n, p) for n, p in model.named_parameters() if n.startswith(pre)]


# -----------------------------------------------------------------------------
# sparsemax (Martins & Astudillo 2016) and the memory-lean codebook scores


def _sparsemax_tau(z, k):
    """Threshold tau and support size for the last dim of z from its k largest values
    (k >= width means an exact full sort)."""
    zs = z.topk(k, dim=-1).values if k < z.shape[-1] else z.sort(dim=-1, descending=True).values
    r = torch.arange(1, zs.shape[-1] + 1, device=z.device, dtype=z.dtype)
    cs = zs.cumsum(-1) - 1
    ksz = (r * zs > cs).sum(-1, keepdim=True)             # support size, >= 1
    return cs.gather(-1, ksz - 1) / ksz.to(z.dtype), ksz


SPARSEMAX_REFINE_STEPS = 16   # measured need: <= 7 at the default k = 256, <= 11 at k = 2 (README)


def _michelot_step(z, tau):
    """One Newton step on sum_i max(z_i - tau, 0) = 1 (Michelot 1986): tau <- (sum of the values
    above tau - 1) / their count. The true threshold is a fixed point; from below, the iterates
    rise monotonically and reach it in finitely many steps (the set above tau only shrinks)."""
    above = z > tau
    n_above = above.sum(-1, keepdim=True)
    return (torch.where(above, z, 0).sum(-1, keepdim=True) - 1) / n_above.to(z.dtype), n_above


def _sparsemax_tau_topk(z, k):
    """tau from the k largest values, with no host-device sync (no graph break, no stall).
    If a row's support is smaller than k its top-k tau is exact: the k-th value lies outside the
    support, so everything below it does too. Otherwise the top-k tau is a lower bound of the true
    tau (the k values alone already sum to >= 1 above it), and Newton steps from it converge to
    the exact value; we run a fixed number for every row and keep them where the support
    overflowed, instead of branching on the data. Rows whose iterates still moved at the last
    step are counted as inexact (returned as a 0-dim tensor, read with the logged stats)."""
    tau, ksz = _sparsemax_tau(z, k)
    overflow = ksz >= k
    t, n_prev, n_above = tau, None, None
    for _ in range(SPARSEMAX_REFINE_STEPS):
        n_prev = n_above
        t, n_above = _michelot_step(z, t)
    inexact = (overflow & (n_above != n_prev)).sum()
    return torch.where(overflow, t, tau), inexact


class _Sparsemax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, topk):
        n = z.shape[-1]
        if 0 < topk < n:
            tau, inexact = _sparsemax_tau_topk(z, topk)
        else:
            tau, inexact = _sparsemax_tau(z, n)[0], torch.zeros((), dtype=torch.long, device=z.device)
        out = torch.clamp(z - tau, min=0)
        ctx.save_for_backward(out)
        ctx.mark_non_differentiable(inexact)
        return out, inexact

    @staticmethod
    def backward(ctx, g, _):
        # closed form: on the support S, grad - mean_S(grad); zero elsewhere
        (out,) = ctx.saved_tensors
        supp = out > 0
        g = g * supp
        v = g.sum(-1, keepdim=True) / supp.sum(-1, keepdim=True).to(g.dtype)
        return torch.where(supp, g - v, torch.zeros_like(g)), None


def sparsemax(x, dim=-1, topk=0, return_inexact=False):
    """Exact sparsemax along `dim` (Euclidean projection onto the simplex), computed in at
    least float32; `topk` > 0 enables the sync-free top-k fast path (same result). With
    `return_inexact`, also the number of rows where the fast path's refinement had not settled
    (0 in every case we have measured; see _sparsemax_tau_topk)."""
    dtype = x.dtype
    z = x.float() if dtype in (torch.float16, torch.bfloat16) else x
    z = z.transpose(dim, -1)
    out, inexact = _Sparsemax.apply(z.contiguous(), int(topk or 0))
    out = out.transpose(dim, -1).to(dtype)
    return (out, inexact) if return_inexact else out


class _MaxCodeScores(torch.autograd.Function):
    """s[b, k] = max_p q[b, p] . C[k] over valid tokens p, computed in chunks of samples.
    The B x P x K score tensor (1024 x 49 x 16384 fp32 = 3.3 GB) is never kept: backward
    needs only the argmax token per (sample, code), [B, K], and routes the gradient there."""

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
            m, i = sc.max(dim=1)
            out[s:s + chunk], idx[s:s + chunk] = m, i
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
            # one-hot routing matrix A[k, b, p] = g[b, k] at p = argmax, built per chunk. Code-major,
            # so that dC = A @ q is one GEMM over (b, p) with no copy of A (a [b, K, P] layout needs
            # a transposed copy of the chunk for it), and dq reads A through a transposed view.
            A = torch.zeros(K, b, P, device=q.device, dtype=q.dtype)
            A.scatter_(2, idx[s:s + b].t()[:, :, None], g[s:s + b].t()[:, :, None].to(q.dtype))
            if dq is not None:
                dq[s:s + b] = A.permute(1, 2, 0) @ cb                       # [b, P, K] @ [K, D]
            if dc is not None:
                dc += (A.view(K, b * P) @ q[s:s + b].reshape(b * P, D)).to(acc)
        return dq, (dc.to(codes.dtype) if dc is not None else None), None, None, None


def max_code_scores(q, codes, valid=None, budget=1 << 25, max_tokens=None):
    """max over tokens of q @ codes.T -> [B, K] float32. `valid` [B, P] bool marks real tokens.
    Samples go in chunks of budget // (max_tokens x K) score values. `max_tokens` (default P)
    should be a fixed bound when P varies between calls (trimmed text): a chunk size computed
    from P would make torch.compile specialise, and recompile, on every text length.
    Pads are excluded with -inf before the max (the FDT reference multiplies pad features by
    0 instead, which puts a 0 score into every max and so clamps all scores at >= 0: a code
    anti-aligned with every real token would still score 0 instead of its true negative max)."""
    return _MaxCodeScores.apply(q, codes, valid, budget, max_tokens)


# -----------------------------------------------------------------------------
# distributed helpers and losses


class _GatherWithGrad(torch.autograd.Function):
    """all_gather along dim 0 whose backward sums every rank's gradient for the local slice
    (open_clip's gather_with_grad; all_reduce works on gloo as well as NCCL)."""

    @staticmethod
    def forward(ctx, x):
        ws = dist.get_world_size()
        out = [torch.empty_like(x) for _ in range(ws)]
        dist.all_gather(out, x.contiguous())
        ctx.n = x.shape[0]
        return torch.cat(out, 0)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        r = dist.get_rank()
        return g[r * ctx.n:(r + 1) * ctx.n]


def gather(x):
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    if x.requires_grad:
        return _GatherWithGrad.apply(x)
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return torch.cat(out, 0)


def _rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class GradReducer:
    """Averages gradients over ranks while backward is still running, as DDP does, for a model
    whose trainable set changes with the IL phase and whose loss is not one forward() call.

    Parameters go into buckets of `bucket_bytes` (--bucket_mb; the first bucket 1 MiB at most,
    so the first all-reduce starts early). A post-accumulate-grad hook marks a parameter ready.
    Buckets are launched as async all-reduces strictly in bucket order, so every rank issues the
    same collectives in the same order. Each bucket waits for the parameters that had a gradient
    at the previous step. finish() then launches whatever is still pending, in order, and reduces
    any gradient nobody waited for. A phase change or an unused parameter therefore costs overlap
    for one step, never correctness. Only the last micro-batch of a step is `armed`.

    The first buckets follow reverse registration order. That is not the order backward produces
    gradients here: CLIP registers the text tower first and encodes it last, so its gradients
    arrive first, and the codebook's arrive after both towers. So armed steps record the arrival
    order, and a step in which a parameter produced its first gradient rebuilds the buckets in
    that order (rank 0's, broadcast). Whether that happened depends only on which parameters are
    trainable, the same on every rank, so all ranks rebuild together, and only a few times a run
    (once if the first step trains everything, as DDP). Then bucket i goes out as soon as its
    own gradients exist."""

    def __init__(self, params, world, bucket_bytes=25 << 20, first_bucket_bytes=1 << 20):
        self.params, self.world, self.armed = list(params), world, False
        self.bucket_bytes, self.first_bucket_bytes = bucket_bytes, first_bucket_bytes
        self.arrived, self.seen, self.rebuilds = [], set(), 0
        self._make_buckets(range(len(self.params) - 1, -1, -1))
        self.expected = [set() for _ in self.buckets]       # learnt at every finish()
        self.ready, self.next, self.pending = [set() for _ in self.buckets], 0, []
        for j, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, j))

    def _make_buckets(self, order):
        self.buckets, cur, size, cap = [], [], 0, min(self.bucket_bytes, self.first_bucket_bytes)
        for j in order:
            cur.append(j)
            size += self.params[j].numel() * self.params[j].element_size()
            if size >= cap:
                self.buckets.append(cur)
                cur, size, cap = [], 0, self.bucket_bytes
        if cur:
            self.buckets.append(cur)
        self.bucket_of = {j: i for i, b in enumerate(self.buckets) for j in b}

    def _on_grad(self, j, _param):
        if not self.armed:
            return
        self.arrived.append(j)
        self.ready[self.bucket_of[j]].add(j)
        while self.next < len(self.buckets) and self.ready[self.next] >= self.expected[self.next]:
            if self.expected[self.next]:
                self._launch(self.expected[self.next])
            self.next += 1

    def _launch(self, idx):
        grads = [self.params[j].grad for j in sorted(idx)]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.pending.append((dist.all_reduce(flat, async_op=True), flat, grads))

    def _rebuild_in_arrival_order(self):
        """This step's arrivals first, then the others in their current bucket order (earlier
        arrivals, then reverse registration order). Rank 0's order is used everywhere."""
        now = dict.fromkeys(self.arrived)
        order = list(now) + [j for b in self.buckets for j in b if j not in now]
        order = torch.tensor(order, device=self.params[0].device)
        dist.broadcast(order, 0)            # a few times a run: the only sync this class adds
        self._make_buckets(order.tolist())
        self.seen |= set(now)
        self.rebuilds += 1

    def _with_grad(self):
        return [{j for j in b if self.params[j].grad is not None} for b in self.buckets]

    def finish(self):
        """Wait for every reduction and write the averages into .grad."""
        have = self._with_grad()
        for i in range(len(self.buckets)):
            rest = have[i] - self.expected[i] if i < self.next else have[i]
            if rest:
                self._launch(rest)
        for work, flat, grads in self.pending:
            work.wait()
            flat /= self.world
            for g, avg in zip(grads, torch.split(flat, [g.numel() for g in grads])):
                g.copy_(avg.view_as(g))
        if not self.seen.issuperset(self.arrived):
            self._rebuild_in_arrival_order()
            have = self._with_grad()
        self.expected, self.arrived = have, []
        self.ready, self.next, self.pending = [set() for _ in self.buckets], 0, []


def contrastive_loss(img, txt, scale, neg_txt=None, neg_txt_valid=None, neg_img=None):
    """Symmetric InfoNCE with local rows against all-gathered columns; labels offset by rank.
    The mean over ranks equals the single-process loss on the combined batch. NegCLIP adds
    hard-negative captions as extra image->text columns and hard-negative image embeddings
    (already global) as extra text->image columns."""
    B = img.shape[0]
    labels = torch.arange(B, device=img.device) + _rank() * B
    all_img, all_txt = gather(img), gather(txt)
    txt_cols, img_cols = all_txt, all_img
    if neg_txt is not None:
        txt_cols = torch.cat([all_txt, gather(neg_txt)])
    if neg_img is not None:
        img_cols = torch.cat([all_img, neg_img])
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


# --- NegCLIP hard negatives (rule-based caption edits, no parser)

COLOURS = {"red", "green", "blue", "yellow", "purple", "orange", "white", "black", "gray", "grey",
           "pink", "brown", "cyan", "magenta", "gold", "silver"}
SIZES = {"small", "large", "big", "tiny", "huge", "medium", "little", "tall", "short"}
RELATION_FLIPS = {"left": "right", "right": "left", "above": "below", "below": "above",
                  "over": "under", "under": "over", "behind": "in front of", "front": "behind",
                  "top": "bottom", "bottom": "top", "inside": "outside", "outside": "inside"}
STOPWORDS = {"a", "an", "the", "of", "to", "on", "in", "at", "is", "are", "and", "with", "by",
             "its", "it", "there", "some", "two", "three", "one", "from", "near", "next", "front",
             "behind", "left", "right", "above", "below", "top", "bottom", "over", "under", "that",
             "this", "for", "as", "while", "who", "which", "inside", "outside"}


def negative_caption(caption, rng):
    """A hard negative by swapping linguistic elements: two attributes, two nouns (content
    words not next to each other), or a flipped spatial relation. Returns None when the caption
    offers nothing to swap."""
    words = caption.split()
    low = [w.lower().strip(".,") for w in words]
    attrs = [i for i, w in enumerate(low) if w in COLOURS or w in SIZES]
    nouns = [i for i, w in enumerate(low) if w not in STOPWORDS and i not in attrs and w.isalpha()]
    rels = [i for i, w in enumerate(low) if w in RELATION_FLIPS]
    options = []
    same_kind = [(i, j) for i in attrs for j in attrs if i < j and low[i] != low[j]
                 and (low[i] in COLOURS) == (low[j] in COLOURS)]
    if same_kind:
        options.append(("swap", same_kind))
    noun_pairs = [(i, j) for i in nouns for j in nouns if i < j and low[i] != low[j]]
    if noun_pairs:
        options.append(("swap", noun_pairs))
    if rels:
        options.append(("flip", rels))
    if not options:
        return None
    kind, cands = rng.choice(options)
    out = list(words)
    if kind == "swap":
        i, j = rng.choice(cands)
        out[i], out[j] = words[j], words[i]
    else:
        i = rng.choice(cands)
        out[i] = RELATION_FLIPS[low[i]]
    neg = " ".join(out).split()
    for i in range(len(neg) - 1):       # keep "a"/"an" right, or the article gives the negative away
        if neg[i].lower() in ("a", "an"):
            an = neg[i + 1][0].lower() in "aeiou"
            neg[i] = ("An" if an else "A") if neg[i][0].isupper() else ("an" if an else "a")
    neg = " ".join(neg)
    return neg if neg.lower() != caption.lower() else None


class NegativeCaptions:
    """The loader's `batch_extra` for NegCLIP: hard-negative captions made and tokenized in the
    data workers, off the training loop (about 10 ms per 256 captions on one core). A caption's
    negative is a fixed function of (seed, caption), as NegCLIP precomputes one per caption.
    neg_valid is False where a caption offers nothing to swap (its column is masked)."""

    def __init__(self, tokenizer, seed):
        self.tokenizer, self.seed = tokenizer, seed

    def __call__(self, batch):
        negs = [negative_caption(c, random.Random(f"{self.seed}:{c}")) for c in batch["caption"]]
        return {"neg_text": self.tokenizer([n if n is not None else c for n, c in zip(negs, batch["caption"])]),
                "neg_valid": torch.tensor([n is not None for n in negs])}


class ImagePool:
    """Running FIFO pool of (detached, global) image embeddings; hard image negatives are each
    image's nearest neighbour in the pool. Identical on every rank (fed gathered features)."""

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
# iterated-learning schedule and learning rate


class ILSchedule:
    """warm-up [0, t_warm), then `generations` x [spawn -> distill t_distill -> interact
    t_interact], the last generation's interaction extended by t_extend. Generation 0 is the
    warm-up; generation g >= 1 starts (spawns) at t_warm + (g-1)(t_distill + t_interact)."""

    def __init__(self, t_warm, t_distill, t_interact, generations, t_extend, enabled=True):
        self.t_warm, self.t_distill, self.t_interact = t_warm, t_distill, t_interact
        self.generations, self.t_extend, self.enabled = generations, t_extend, enabled
        self.gen_len = t_distill + t_interact

    @property
    def total(self):
        return self.t_warm + self.generations * self.gen_len + self.t_extend

    @property
    def spawn_steps(self):
        return [self.t_warm + g * self.gen_len for g in range(self.generations)] if self.enabled else []

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


def spawn_agent(args, generation):
    if args.spawn == "alternate":
        return "language" if generation % 2 == 1 else "vision"
    return args.spawn


def spawn_seed(seed, generation):
    """The re-initialisation seed of a generation: a function of (seed, generation) only, so it
    is identical on every rank and reproducible on resume."""
    return (seed * 1_000_003 + 7919 * generation) % (2 ** 62)


def get_lr(step, args, sched):
    if step < args.warmup:
        lr = args.lr * (step + 1) / args.warmup
    else:
        progress = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
        lr = args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))
    phase, gen, start = sched.at(step)
    if gen > 0 and args.rewarm > 0:      # linear re-warm-up at the start of every generation
        lr *= min(1.0, (step - start + 1) / args.rewarm)
    return lr


def code_temperature(step, args):
    return max(0.01, args.code_temp * args.code_temp_decay ** (step / max(1, args.code_temp_iters)))


# -----------------------------------------------------------------------------
# weights: --init, load_model, checkpoints (safetensors + JSON, atomic, no pickle)


OPENAI_EXTRA_KEYS = {"input_resolution", "context_length", "vocab_size"}   # ints in OpenAI's .pt


def read_state_dict(path):
    if not os.path.isfile(path):
        raise ConfigError(f"--init file not found: {path}")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            sd = load_file(path)
        else:
            try:
                sd = torch.load(path, map_location="cpu", weights_only=True)
            except RuntimeError as e:
                if "TorchScript" not in str(e) and "constants.pkl" not in str(e):
                    raise
                sd = torch.jit.load(path, map_location="cpu").state_dict()   # OpenAI's JIT archives
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"cannot read weights {path}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise ConfigError(f"{path} does not hold a state dict")
    return {k[7:] if k.startswith("module.") else k: v for k, v in sd.items()
            if torch.is_tensor(v) and k not in OPENAI_EXTRA_KEYS}


def config_from_state_dict(sd):
    """Infer a ModelConfig from OpenAI-layout weights (as open_clip's build_model_from_openai)."""
    try:
        vw = sd["visual.conv1.weight"].shape[0]
        patch = sd["visual.conv1.weight"].shape[-1]
        grid = round((sd["visual.positional_embedding"].shape[0] - 1) ** 0.5)
        tw = sd["ln_final.weight"].shape[0]
        count = lambda pre: len({k.split(".")[pre.count(".")] for k in sd if k.startswith(pre)})
        vocab = sd["token_embedding.weight"].shape[0]
        cfg = ModelConfig(
            embed_dim=sd["text_projection"].shape[1], image_size=grid * patch, patch_size=patch,
            vision_width=vw, vision_layers=count("visual.transformer.resblocks."),
            vision_heads=max(1, vw // 64), context_length=sd["positional_embedding"].shape[0],
            vocab_size=vocab, text_width=tw, text_layers=count("transformer.resblocks."),
            text_heads=max(1, tw // 64), eot_token_id=vocab - 1, quick_gelu=True)
    except KeyError as e:
        raise ConfigError(f"weights are not in OpenAI CLIP layout: missing key {e}")
    if "codebook" in sd:
        cfg.codebook_size, cfg.code_dim = sd["codebook"].shape
    return cfg


def load_state_checked(model, sd, source, allow_missing=()):
    """Load with one clear error line for a missing/unexpected key or a shape mismatch."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd and not k.startswith(allow_missing)]
    unexpected = [k for k in sd if k not in own]
    shapes = [f"{k} {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in sd and sd[k].shape != own[k].shape]
    problems = []
    if missing:
        problems.append(f"missing keys {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''}")
    if shapes:
        problems.append(f"shape mismatch {shapes[0]}{' ...' if len(shapes) > 1 else ''}")
    if problems:
        raise ConfigError(f"config/weights mismatch for {source}: " + "; ".join(problems))
    model.load_state_dict({k: v for k, v in sd.items()}, strict=False)


def load_model(path, device="cpu", quick_gelu=None):
    """-> (model, tokenizer or None, config dict) from an il_clip.py out_dir (also
    mm_learngene.py's) or an OpenAI-format weight file (.safetensors / .pt). quick_gelu:
    None = what the out_dir's config says (OpenAI's QuickGELU for a bare weight file),
    else QuickGELU (True) or exact GELU (False)."""
    if os.path.isdir(path):
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"{cfg_path} not found (not a checkpoint directory)")
        with open(cfg_path) as f:
            config = json.load(f)
        names = {f.name for f in fields(ModelConfig)}
        cfg = ModelConfig(**{k: v for k, v in config["model"].items() if k in names})
        wpath = os.path.join(path, "model.safetensors")
        sd = read_state_dict(wpath)
        tdir = path
    else:
        sd = read_state_dict(path)
        cfg = config_from_state_dict(sd)
    if quick_gelu is not None:
        cfg = replace(cfg, quick_gelu=quick_gelu)
    if not os.path.isdir(path):
        config = {"model": asdict(cfg)}
        tdir = os.path.dirname(os.path.abspath(path))
    model = CLIP(cfg)
    load_state_checked(model, sd, path)
    tok = data.Tokenizer.load(tdir) if os.path.isfile(os.path.join(tdir, "tokenizer.json")) else None
    return model.to(device).eval(), tok, config


def _atomic(path, write):
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


def save_tensors(path, tensors, step):
    from safetensors.torch import save_file
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    _atomic(path, lambda p: save_file(tensors, p, metadata={"step": str(step)}))


def save_json(path, obj):
    def write(p):
        with open(p, "w") as f:
            json.dump(obj, f, indent=1)
    _atomic(path, write)


# -----------------------------------------------------------------------------
# training


def build_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--data", default="shapes", help="shapes | cc3m | cc12m | datacomp | shards | csv | ...")
    a("--model", default=None, help=f"preset: {', '.join(MODEL_PRESETS)} (default tiny on shapes)")
    a("--method", default="il", choices=["clip", "codebook", "negclip", "il"])
    a("--negatives", action="store_true", help="add NegCLIP hard negatives to --method il")
    a("--out_dir", default="out/il_clip")
    a("--max_steps", type=int, default=None, help="default: the IL schedule's total")
    a("--stop_at", type=int, default=None, help="save and exit after this step (job chaining)")
    a("--batch_size", type=int, default=None, help="global batch (all ranks, all micro-steps)")
    a("--accum", type=int, default=1, help="gradient accumulation micro-steps")
    a("--bucket_mb", type=float, default=25.0, help="DDP: gradient all-reduce bucket size (MB)")
    a("--lr", type=float, default=None)
    a("--min_lr", type=float, default=0.0)
    a("--warmup", type=int, default=None)
    a("--rewarm", type=int, default=None, help="linear LR re-warm-up at each generation start")
    a("--wd", type=float, default=0.1)
    a("--beta1", type=float, default=0.9)
    a("--beta2", type=float, default=0.98)
    a("--eps", type=float, default=1e-6)
    a("--grad_clip", type=float, default=1.0, help="0 = off")
    a("--seed", type=int, default=0)
    a("--device", default=None)
    a("--dtype", default=None, choices=["fp32", "bf16"], help="autocast dtype (default bf16 on CUDA)")
    a("--compile", action="store_true")
    a("--init", default=None, help="OpenAI/open_clip-layout weights (.safetensors or .pt)")
    a("--vocab", default=None, help="bpe_simple_vocab_16e6.txt.gz for the CLIP BPE")
    a("--vocab_size", type=int, default=None)
    a("--context_length", type=int, default=None)
    a("--quick_gelu", action=argparse.BooleanOptionalAction, default=None)
    a("--width", type=int, default=None, help="override both towers' width (preset otherwise)")
    a("--layers", type=int, default=None, help="override both towers' depth")
    a("--heads", type=int, default=None, help="override both towers' heads")
    a("--embed_dim", type=int, default=None)
    a("--image_size", type=int, default=None)
    a("--patch_size", type=int, default=None)
    a("--num_workers", type=int, default=0)
    a("--resampled", action="store_true")
    a("--image_root", default=None, help="image folder for a CSV / Karpathy JSON --data")
    # codebook (FDT)
    a("--codebook", type=int, default=None, help="K codes (0 = none; default by method/data)")
    a("--code_dim", type=int, default=None)
    a("--code_temp", type=float, default=None, help="T0 of T = T0 * w^(step/iters), floor 0.01")
    a("--code_temp_decay", type=float, default=1.0, help="w")
    a("--code_temp_iters", type=int, default=1000)
    a("--code_sim", default="dot", choices=["dot", "cos"])
    a("--sparsemax_topk", type=int, default=None, help="0 = exact sort (default: 256 if K>2048)")
    # iterated learning
    a("--t_warm", type=int, default=None)
    a("--t_distill", type=int, default=None)
    a("--t_interact", type=int, default=None)
    a("--generations", type=int, default=None)
    a("--t_extend", type=int, default=None)
    a("--spawn", default="language", choices=["language", "vision", "alternate"])
    a("--no_freeze_codebook", action="store_true")
    a("--distill_loss", default="kd", choices=["kd", "cos"])
    a("--kd_temp", type=float, default=1.0)
    a("--distill_train_vision", action="store_true",
          help="train the non-spawned agent during distill (frozen by default)")
    a("--spectral_norm", action="store_true")
    a("--neg_pool", type=int, default=None)
    # logging / checkpoints / eval
    a("--log_interval", type=int, default=None)
    a("--save_interval", type=int, default=None)
    a("--resume", action="store_true", help="continue exactly from out_dir")
    a("--eval_n", type=int, default=200, help="shapes benchmark items per category (0 = no eval)")
    args = p.parse_args(argv)
    if args.negatives and args.method not in ("il", "negclip"):
        raise ConfigError("--negatives goes with --method il (negclip always uses them)")
    defaults = SHAPES_DEFAULTS if args.data.startswith("shapes") else PAPER_DEFAULTS
    for k, v in defaults.items():
        if k == "codebook":
            continue
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.codebook is None:
        args.codebook = defaults["codebook"] if args.method in ("codebook", "il") else 0
    if args.codebook and args.method in ("clip", "negclip"):
        raise ConfigError(f"--codebook is for --method codebook|il, not {args.method}")
    if args.model not in MODEL_PRESETS:
        raise ConfigError(f"unknown --model {args.model!r} (presets: {', '.join(MODEL_PRESETS)})")
    if args.sparsemax_topk is None:
        args.sparsemax_topk = 256 if args.codebook > 2048 else 0
    sched = make_schedule(args)
    if args.max_steps is None:
        args.max_steps = sched.total
    if min(args.t_warm, args.t_distill, args.t_interact, args.generations, args.t_extend) < 0:
        raise ConfigError("IL step counts must be >= 0")
    return args


def make_schedule(args):
    return ILSchedule(args.t_warm, args.t_distill, args.t_interact, args.generations,
                      args.t_extend, enabled=args.method == "il")


def setup_distributed(args):
    ddp = int(os.environ.get("RANK", -1)) != -1
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    owns_pg = False
    if ddp:
        rank, local_rank, world = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["WORLD_SIZE"])
        if args.device.startswith("cuda"):
            args.device = f"cuda:{local_rank}"
            torch.cuda.set_device(args.device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
            owns_pg = True
    else:
        rank, local_rank, world = 0, 0, 1
    return rank, world, owns_pg


def build_tokenizer(args, rank, world):
    tok_file = os.path.join(args.out_dir, "tokenizer.json")
    if args.resume and os.path.isfile(tok_file):
        return data.Tokenizer.load(args.out_dir)
    if rank == 0:
        captions = None if args.vocab else data.captions_for_tokenizer(args.data)
        tok = data.build_tokenizer(vocab_path=args.vocab, captions=captions,
                                   vocab_size=args.vocab_size, context_length=args.context_length)
        os.makedirs(args.out_dir, exist_ok=True)
        tok.save(args.out_dir)
    if world > 1:
        dist.barrier()
    return tok if rank == 0 else data.Tokenizer.load(args.out_dir)


def model_config(args, tok):
    cfg = ModelConfig(**MODEL_PRESETS[args.model])
    cfg.vocab_size, cfg.context_length, cfg.eot_token_id = tok.vocab_size, tok.context_length, tok.eot_id
    for flag, names in (("quick_gelu", ["quick_gelu"]), ("width", ["vision_width", "text_width"]),
                        ("layers", ["vision_layers", "text_layers"]), ("heads", ["vision_heads", "text_heads"]),
                        ("embed_dim", ["embed_dim"]), ("image_size", ["image_size"]),
                        ("patch_size", ["patch_size"])):
        if getattr(args, flag) is not None:
            for n in names:
                setattr(cfg, n, getattr(args, flag))
    cfg.codebook_size = args.codebook
    if args.code_dim:
        cfg.code_dim = args.code_dim
    cfg.code_sim, cfg.sparsemax_topk, cfg.spectral_norm = args.code_sim, args.sparsemax_topk, args.spectral_norm
    return cfg


def param_groups(model):
    """AdamW groups: no weight decay on gains, biases, 1-d embeddings and logit_scale."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.ndim < 2 or "ln_" in n or "bias" in n or "logit_scale" in n:
            no_decay.append(p)
        else:
            decay.append(p)
    return decay, no_decay


def estimate_flops_per_pair(cfg, text_len=None):
    """Training FLOPs per image-text pair (3 x forward; 2 FLOPs per MAC). `text_len`: the text
    length actually computed (after trim_text_padding; default the full context)."""
    def tower(T, w, L):
        return L * (12 * T * w * w + 2 * T * T * w)
    P = (cfg.image_size // cfg.patch_size) ** 2
    L_text = text_len or cfg.context_length
    macs = tower(P + 1, cfg.vision_width, cfg.vision_layers) + P * 3 * cfg.patch_size ** 2 * cfg.vision_width
    macs += tower(L_text, cfg.text_width, cfg.text_layers)
    if cfg.codebook_size:
        K, D = cfg.codebook_size, cfg.code_dim
        for T, w in ((P, cfg.vision_width), (L_text, cfg.text_width)):
            macs += T * (w * D + D * D) + T * K * D + K * D
    else:
        macs += (cfg.vision_width + cfg.text_width) * cfg.embed_dim
    return 3 * 2 * macs


# dense bf16 peak FLOP/s by device-name fragment, first match wins: the PCIe and NVL H100s run
# lower clocks than the SXM part that `torch.cuda.get_device_name` calls "NVIDIA H100 80GB HBM3"
PEAK_FLOPS = {"H200": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12,
              "A100": 312e12, "A10": 125e12, "L4": 121e12}


def peak_flops(device_name):
    """Dense bf16 peak of a GPU from its name (None when unknown)."""
    return next((v for k, v in PEAK_FLOPS.items() if k in device_name), None)


def estimate_mfu(cfg, pairs_per_s, device, text_len=None):
    """Model FLOPs utilisation against the dense bf16 peak of the GPU (None on CPU/unknown)."""
    if not str(device).startswith("cuda"):
        return None
    peak = peak_flops(torch.cuda.get_device_name(device))
    return None if peak is None else estimate_flops_per_pair(cfg, text_len) * pairs_per_s / peak


def trim_text_padding(text, eot_token_id, multiple=8):
    """Drop the columns after the batch's last EOT from a token batch still on the CPU (so the
    length is known without a device sync). The result is exact: under the causal mask no position
    up to a caption's EOT sees anything after it, and the codebook head ignores pads. Captions are
    short next to the 77-token context, so the text tower and the text codebook scores shrink with
    them. Rounded up to a multiple of 8 for tensor cores and so that compile sees few lengths."""
    if text.device.type != "cpu":
        return text
    n = int((text == eot_token_id).int().argmax(-1).max()) + 1
    return text[:, :min(text.shape[1], -(-n // multiple) * multiple)]


class Batches:
    """Endless iteration over a data.make_loader loader, epoch by epoch."""

    def __init__(self, loader):
        self.loader, self.it = loader, None

    def next(self):
        if self.it is None:
            self.it = iter(self.loader)
        epoch = self.loader.state_dict().get("epoch", 0)
        try:
            return next(self.it)
        except StopIteration:
            if self.loader.state_dict().get("epoch", 0) == epoch:   # loader did not advance itself
                self.loader.set_epoch(epoch + 1)
            self.it = iter(self.loader)
            return next(self.it)


class Trainer:
    def __init__(self, args, rank, world, tokenizer=None):
        self.args, self.rank, self.world = args, rank, world
        self.master = rank == 0
        self.device = torch.device(args.device)
        dt = args.dtype or ("bf16" if self.device.type == "cuda" else "fp32")
        self.autocast = nullcontext() if dt == "fp32" else torch.autocast(self.device.type, dtype=torch.bfloat16)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if args.batch_size % (world * args.accum):
            raise ConfigError(f"--batch_size {args.batch_size} is not divisible by world_size x accum = {world * args.accum}")
        self.micro = args.batch_size // (world * args.accum)
        self.sched = make_schedule(args)
        if args.init and not os.path.isfile(args.init):
            raise ConfigError(f"--init file not found: {args.init}")
        data.resolve_data(args.data, args.image_root)   # e.g. cc3m without shards: DataError saying where it looked
        self.tok = tokenizer or build_tokenizer(args, rank, world)     # bench.py passes its own
        self.cfg = model_config(args, self.tok)
        self.raw = CLIP(self.cfg, seed=args.seed).to(self.device)
        if args.init:
            sd = read_state_dict(args.init)
            load_state_checked(self.raw, sd, args.init,
                               allow_missing=("codebook", "image_query.", "text_query.", "code_temperature"))
        decay, no_decay = param_groups(self.raw)
        extra = {"fused": True} if self.device.type == "cuda" else {}
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps, **extra)
        # compile the two encoders (the IL phase logic stays outside the graphs); the raw module
        # is what gets saved
        self.encode_image, self.encode_text = self.compiled(self.raw.encode_image, self.raw.encode_text)
        self.set_teacher(None)
        self.spawned = 0          # last generation whose spawn has been performed
        self.step = 0
        self.pool = self.negatives = None
        if args.method == "negclip" or args.negatives:
            self.pool = ImagePool(args.neg_pool, self.cfg.embed_dim if not self.cfg.codebook_size
                                  else self.cfg.code_dim, self.device)
            self.negatives = NegativeCaptions(self.tok, args.seed)
        self.loader = data.make_loader(args.data, split="train", batch_size=self.micro, tokenizer=self.tok,
                                       image_size=self.cfg.image_size, train=True, rank=rank,
                                       world_size=world, num_workers=args.num_workers, seed=args.seed,
                                       resampled=args.resampled, drop_last=True, image_root=args.image_root,
                                       pin_memory=self.device.type == "cuda", batch_extra=self.negatives)
        self.batches = Batches(self.loader)
        self.stop_requested = False
        self.text_tokens = 0      # sum of trimmed text lengths since the last log (for the MFU)
        self.metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
        if args.resume:
            self.load_checkpoint()
        elif self.master:
            os.makedirs(args.out_dir, exist_ok=True)
            open(self.metrics_path, "w").close()
        if world > 1:       # identical start on every rank (init is seeded, this makes sure)
            for t in self.raw.state_dict().values():
                dist.broadcast(t, 0)
        self.reducer = (GradReducer(self.raw.parameters(), world, int(args.bucket_mb * 2**20))
                        if world > 1 else None)

    def compiled(self, *fns):
        return tuple(torch.compile(f) for f in fns) if self.args.compile else fns

    def set_teacher(self, model):
        """The frozen previous generation (None outside distillation). Under --compile its
        encoders are compiled too: a no-grad forward of one encoder, a third of a distill step."""
        self.teacher = model      # the encoders below hold it too: None releases all three
        self.teacher_encode_image, self.teacher_encode_text = (
            self.compiled(model.encode_image, model.encode_text) if model is not None else (None, None))

    # --- IL phases
    def trainable(self, phase, gen):
        """requires_grad per parameter for this phase. A frozen parameter gets no .grad, so
        AdamW skips it entirely: no update, no weight decay, no state change (bitwise frozen)."""
        args, want = self.args, {}
        spawned = spawn_agent(args, gen) if phase == "distill" else None
        other = {"language": "vision", "vision": "language"}.get(spawned)
        other_names = {n for n, _ in agent_params(self.raw, other)} if other else set()
        for n, p in self.raw.named_parameters():
            on = True
            if phase == "distill":
                if n == "codebook" and not args.no_freeze_codebook:
                    on = False
                elif n == "logit_scale":
                    on = False           # the KD logits use a detached scale
                elif n in other_names and not args.distill_train_vision:
                    on = False
            want[n] = on
        return want

    def spawn(self, gen):
        """New generation: keep the old agent as the distillation teacher, re-initialise the
        agent exactly as at step 0 from a generation-derived seed, clear its AdamW state."""
        agent = spawn_agent(self.args, gen)
        self.save_generation_snapshot(gen - 1)
        self.set_teacher(copy.deepcopy(self.raw).eval().requires_grad_(False))
        g = torch.Generator().manual_seed(spawn_seed(self.args.seed, gen))
        cpu = copy.deepcopy(self.raw).cpu()                  # init on CPU: same numbers everywhere
        cpu.init_agent(agent, g)
        with torch.no_grad():
            src = dict(cpu.named_parameters())
            for n, p in agent_params(self.raw, agent):
                p.copy_(src[n].to(p.device))
                self.opt.state.pop(p, None)
        self.spawned = gen

    # --- one micro-batch loss
    def loss(self, batch, phase, gen):
        args, m = self.args, self
        images = batch["image"].to(self.device, non_blocking=True)
        text = trim_text_padding(batch["text"], self.cfg.eot_token_id)
        self.text_tokens += text.shape[1]
        text = text.to(self.device, non_blocking=True)
        with self.autocast:
            if phase == "distill":
                agent = spawn_agent(args, gen)
                enc_s, enc_o = ((m.encode_text, m.encode_image) if agent == "language"
                                else (m.encode_image, m.encode_text))
                x_s, x_o = (text, images) if agent == "language" else (images, text)
                teach = self.teacher_encode_text if agent == "language" else self.teacher_encode_image
                with torch.no_grad():
                    t_emb = teach(x_s)
                o_emb = enc_o(x_o)
                s_emb = enc_s(x_s)
                if args.distill_loss == "cos":
                    return (1 - (s_emb * t_emb).sum(-1)).mean()
                return kd_loss(o_emb, s_emb, t_emb, self.raw.logit_scale.exp().detach(), args.kd_temp)
            img = m.encode_image(images)
            txt = m.encode_text(text)
            neg_txt = neg_valid = neg_img = None
            if self.pool is not None:
                negs = batch if "neg_text" in batch else self.negatives(batch)   # made by the loader
                # non_blocking: a blocking host-to-device copy would wait for the device (a sync)
                neg_tok = trim_text_padding(negs["neg_text"], self.cfg.eot_token_id)
                neg_txt = m.encode_text(neg_tok.to(self.device, non_blocking=True))
                neg_valid = negs["neg_valid"].to(self.device, non_blocking=True)
                all_img = gather(img.detach())
                neg_img = self.pool.nearest(all_img)
                self.pool.push(all_img)
            return contrastive_loss(img, txt, self.raw.logit_scale.exp(), neg_txt, neg_valid, neg_img)

    # --- checkpoints
    def save_generation_snapshot(self, gen):
        """Weights at the end of generation `gen` (0 = warm-up) as out_dir/gen{gen}/model.safetensors,
        for the per-generation analyses of eval_compositional.py (Lipschitz bound, paper Fig. 4;
        easy-to-learn probe, Fig. 5)."""
        if self.master:
            d = os.path.join(self.args.out_dir, f"gen{gen}")
            os.makedirs(d, exist_ok=True)
            save_tensors(os.path.join(d, "model.safetensors"), self.raw.state_dict(), self.step)

    def save_checkpoint(self):
        if not self.master:
            return
        a, d = self.args, self.args.out_dir
        os.makedirs(d, exist_ok=True)
        save_tensors(os.path.join(d, "model.safetensors"), self.raw.state_dict(), self.step)
        config = {k: v for k, v in vars(a).items()}
        config["model"] = asdict(self.cfg)
        config["world_size"] = self.world
        save_json(os.path.join(d, "config.json"), config)
        if not os.path.isfile(os.path.join(d, "tokenizer.json")):
            self.tok.save(d)
        osd = self.opt.state_dict()
        tensors, scalars = {}, {}
        for i, st in osd["state"].items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    tensors[f"opt.{i}.{k}"] = v
                else:
                    scalars[f"{i}.{k}"] = v
        if self.teacher is not None and self.sched.at(self.step)[0] == "distill":
            tensors.update({f"teacher.{k}": v for k, v in self.teacher.state_dict().items()})
        if self.pool is not None:
            tensors["pool.emb"], tensors["pool.ptr"] = self.pool.emb, self.pool.ptr
        save_tensors(os.path.join(d, "train_state.safetensors"), tensors, self.step)
        state = {
            "step": self.step, "spawned": self.spawned, "param_groups": osd["param_groups"],
            "opt_scalars": scalars, "loader": self.loader.state_dict(),
            "pool_count": self.pool.count if self.pool is not None else 0,
            "rng": {"torch": torch.get_rng_state().tolist(),
                    "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if self.device.type == "cuda" else None,
                    "numpy": [np.random.get_state()[0], np.random.get_state()[1].tolist()] + list(np.random.get_state()[2:]),
                    "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]]},
        }
        save_json(os.path.join(d, "train_state.json"), state)

    def load_checkpoint(self):
        from safetensors import safe_open
        from safetensors.torch import load_file
        d = self.args.out_dir
        paths = [os.path.join(d, f) for f in ("model.safetensors", "train_state.safetensors", "train_state.json")]
        for p in paths:
            if not os.path.isfile(p):
                raise ConfigError(f"--resume: {p} not found")
        with open(paths[2]) as f:
            state = json.load(f)
        for p in paths[:2]:
            with safe_open(p, "pt") as f:
                if f.metadata().get("step") != str(state["step"]):
                    raise ConfigError(f"--resume: {p} is from step {f.metadata().get('step')}, "
                                      f"train_state.json from step {state['step']} (interrupted save)")
        load_state_checked(self.raw, load_file(paths[0], device=str(self.device)), paths[0])
        ts = load_file(paths[1], device=str(self.device))
        opt_state = {}
        for k, v in ts.items():
            if k.startswith("opt."):
                _, i, name = k.split(".", 2)
                opt_state.setdefault(int(i), {})[name] = v
        for k, v in state["opt_scalars"].items():
            i, name = k.split(".", 1)
            opt_state.setdefault(int(i), {})[name] = v
        self.opt.load_state_dict({"state": opt_state, "param_groups": state["param_groups"]})
        self.step, self.spawned = state["step"], state["spawned"]
        teacher = {k[8:]: v for k, v in ts.items() if k.startswith("teacher.")}
        if teacher:
            self.set_teacher(copy.deepcopy(self.raw).eval().requires_grad_(False))
            self.teacher.load_state_dict(teacher)
        if self.pool is not None and "pool.emb" in ts:
            self.pool.emb.copy_(ts["pool.emb"])
            self.pool.ptr.copy_(ts["pool.ptr"])
            self.pool.count = state["pool_count"]
        self.loader.load_state_dict(state["loader"])
        rng = state["rng"]
        torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
        if rng.get("cuda") and self.device.type == "cuda":
            torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in rng["cuda"]])
        n = rng["numpy"]
        np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
        p = rng["python"]
        random.setstate((p[0], tuple(p[1]), p[2]))

    # --- the loop
    def log(self, rec):
        if self.master:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def train(self):
        from tqdm import tqdm
        args, raw = self.args, self.raw
        end = args.max_steps if args.stop_at is None else min(args.max_steps, args.stop_at)
        pbar = tqdm(total=end, initial=self.step, disable=not self.master, dynamic_ncols=True,
                    mininterval=1.0, desc=f"{args.method}")
        loss_sum = torch.zeros((), device=self.device)
        bad = torch.zeros((), dtype=torch.bool, device=self.device)
        n_loss, t_last, step_last = 0, time.time(), self.step
        prev_trainable = None
        status = "done"
        while self.step < end:
            phase, gen, _ = self.sched.at(self.step)
            if gen > self.spawned and self.step in self.sched.spawn_steps:
                self.spawn(gen)
            if phase != "distill":
                self.set_teacher(None)
            want = self.trainable(phase, gen)
            if want != prev_trainable:
                for n, p in raw.named_parameters():
                    p.requires_grad_(want[n])
                prev_trainable = want
            lr = get_lr(self.step, args, self.sched)
            for grp in self.opt.param_groups:
                grp["lr"] = lr
            if raw.cfg.codebook_size:
                raw.code_temperature.fill_(code_temperature(self.step, args))
            for micro in range(args.accum):
                if self.reducer is not None:    # reduce while the last micro-batch's backward runs
                    self.reducer.armed = micro == args.accum - 1
                loss = self.loss(self.batches.next(), phase, gen)
                (loss / args.accum).backward()
                loss_sum += loss.detach()
                bad |= ~torch.isfinite(loss.detach())
                n_loss += 1
            if self.reducer is not None:
                self.reducer.finish()
            if args.grad_clip > 0:
                params = [p for p in raw.parameters() if p.grad is not None]
                if params:
                    torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            with torch.no_grad():   # OpenAI: ln(100); FDT reference with a codebook: [3, 6]
                lo, hi = (3.0, 6.0) if raw.cfg.codebook_size else (0.0, math.log(100))
                raw.logit_scale.clamp_(lo, hi)
            self.step += 1
            pbar.update(1)
            last = self.step == end
            # log at intervals and at every phase change, so no record mixes two phases' losses
            if self.step % args.log_interval == 0 or last or self.sched.at(self.step)[0] != phase:
                # the only host-device syncs of the loop: loss, non-finite check, stop flag, and
                # the count of inexact top-k sparsemax rows (0 unless the refinement fell short)
                inexact = sum(m.sparsemax_inexact for m in (raw, self.teacher)
                              if m is not None and hasattr(m, "sparsemax_inexact"))
                stats = torch.stack([loss_sum / max(1, n_loss), bad.float(),
                                     torch.tensor(float(self.stop_requested), device=self.device),
                                     torch.as_tensor(inexact, device=self.device).float()])
                if self.world > 1:
                    dist.all_reduce(stats)
                    stats[0] /= self.world
                loss_v, is_bad, stop, n_inexact = stats.tolist()
                if is_bad:
                    if self.master:
                        print(f"error: non-finite loss at step <= {self.step} (phase {phase}, generation "
                              f"{gen}); stopping, the last good checkpoint in {args.out_dir} is kept",
                              file=sys.stderr)
                    status = "nan"
                    break
                dt = time.time() - t_last
                sps = (self.step - step_last) * args.batch_size / max(dt, 1e-9)
                text_len = self.text_tokens / max(1, n_loss)
                mfu = estimate_mfu(self.cfg, sps, self.device, text_len)
                rec = {"step": self.step, "loss": loss_v, "lr": lr, "phase": phase, "generation": gen,
                       "logit_scale": raw.logit_scale.item(), "samples_per_s": round(sps, 2),
                       "text_len": round(text_len, 2), "mfu": mfu, "time": time.time()}
                if n_inexact:
                    rec["sparsemax_inexact_rows"] = int(n_inexact)
                    if self.master:
                        print(f"warning: {int(n_inexact)} top-k sparsemax rows did not settle in "
                              f"{SPARSEMAX_REFINE_STEPS} refinement steps before step {self.step}; "
                              f"raise --sparsemax_topk (0 = exact sort)", file=sys.stderr)
                    for m in (raw, self.teacher):
                        if m is not None and hasattr(m, "sparsemax_inexact"):
                            m.sparsemax_inexact.zero_()
                self.log(rec)
                pbar.set_postfix(loss=f"{loss_v:.3f}", phase=phase, gen=gen)
                loss_sum.zero_()
                self.text_tokens = 0
                n_loss, t_last, step_last = 0, time.time(), self.step
                if stop:
                    self.save_checkpoint()
                    status = "sigterm"
                    break
                if self.step % args.save_interval == 0 or last:
                    self.save_checkpoint()
                    draw_loss_curve(self.metrics_path, os.path.join(args.out_dir, "loss_curve.png"),
                                    self.sched.spawn_steps) if self.master else None
            elif self.world == 1 and self.stop_requested:
                self.save_checkpoint()
                status = "sigterm"
                break
        pbar.close()
        if status == "done" and self.step == end:
            self.save_checkpoint()
            if self.spawned and end == args.max_steps:
                self.save_generation_snapshot(self.spawned)
            if self.master:
                draw_loss_curve(self.metrics_path, os.path.join(args.out_dir, "loss_curve.png"),
                                self.sched.spawn_steps)
        return status


# -----------------------------------------------------------------------------
# loss curve (paper Fig. 3) with PIL


def draw_loss_curve(metrics_path, png_path, boundaries=(), size=(900, 420)):
    from PIL import Image, ImageDraw
    recs = []
    if os.path.isfile(metrics_path):
        with open(metrics_path) as f:
            recs = [json.loads(line) for line in f if line.strip()]
    recs = [r for r in recs if "loss" in r and math.isfinite(r["loss"])]
    W, H = size
    L, R, T, B = 60, 20, 20, 40
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    d.rectangle([L, T, W - R, H - B], outline="black")
    if recs:
        xs, ys = [r["step"] for r in recs], [r["loss"] for r in recs]
        x0, x1 = 0, max(max(xs), 1)
        y0, y1 = min(ys), max(ys)
        y1 = y1 if y1 > y0 else y0 + 1
        px = lambda x: L + (W - L - R) * (x - x0) / (x1 - x0)
        py = lambda y: H - B - (H - T - B) * (y - y0) / (y1 - y0)
        for gi, b in enumerate(boundaries):
            if b <= x1:
                d.line([px(b), T, px(b), H - B], fill=(200, 120, 120))
                d.text((px(b) + 3, T + 2), f"gen {gi + 1}", fill=(160, 60, 60))
        colours = {"warmup": (40, 90, 200), "distill": (220, 120, 0), "interact": (30, 150, 60),
                   "train": (40, 90, 200)}
        for a, b in zip(recs, recs[1:]):
            d.line([px(a["step"]), py(a["loss"]), px(b["step"]), py(b["loss"])],
                   fill=colours.get(b.get("phase"), (0, 0, 0)), width=2)
        for v in (y0, (y0 + y1) / 2, y1):
            d.text((4, py(v) - 6), f"{v:.3f}", fill="black")
        d.text((L, H - B + 6), "0", fill="black")
        d.text((W - R - 40, H - B + 6), str(x1), fill="black")
    d.text((W // 2 - 100, H - 18), "step   (blue warm-up, orange distill, green interact)", fill="black")
    _atomic(png_path, lambda p: img.save(p, format="PNG"))


# -----------------------------------------------------------------------------
# evaluation on the built-in shapes benchmark


@torch.no_grad()
def _embed(model, tok, images, captions, image_size, device, bs=256):
    tf = data.eval_transform(image_size)
    ie, te = [], []
    for i in range(0, len(images), bs):
        x = torch.stack([tf(im) for im in images[i:i + bs]]).to(device)
        ie.append(model.encode_image(x).float().cpu())
    for i in range(0, len(captions), bs):
        te.append(model.encode_text(tok(captions[i:i + bs]).to(device)).float().cpu())
    return (torch.cat(ie) if ie else torch.zeros(0)), (torch.cat(te) if te else torch.zeros(0))


@torch.no_grad()
def evaluate_shapes(model, tok, device="cpu", n=200, n_val=500, seed=0):
    """Image->text / text->image R@1 on shapes val (a hit = the retrieved item has the same
    caption string) and hard-negative accuracy (strict >) per SugarCrepe category, plus
    systematicity / productivity (the positive must beat every negative)."""
    was_training = model.training
    model.eval()
    size = model.cfg.image_size
    scenes = [data.shapes_scene("val", i, seed=seed) for i in range(n_val)]
    caps = [s.caption for s in scenes]
    ie, te = _embed(model, tok, [s.image for s in scenes], caps, size, device)
    sim = ie @ te.t()
    same = torch.tensor([[a == b for b in caps] for a in caps])
    res = {"i2t_r1": same[torch.arange(n_val), sim.argmax(1)].float().mean().item(),
           "t2i_r1": same[sim.argmax(0), torch.arange(n_val)].float().mean().item()}
    bench = data.shapes_benchmark(seed=seed, n=n)
    for cat in list(data.SHAPES_CATEGORIES) + ["systematicity", "productivity"]:
        items = bench[cat]
        negs = [it["negatives"] if "negatives" in it else [it["negative_caption"]] for it in items]
        flat = [c for it, ng in zip(items, negs) for c in [it["caption"]] + list(ng)]
        ie, te = _embed(model, tok, [it["image"] for it in items], flat, size, device)
        correct, o = 0, 0
        for j, ng in enumerate(negs):
            s = te[o:o + 1 + len(ng)] @ ie[j]
            correct += int(bool((s[0] > s[1:]).all()))
            o += 1 + len(ng)
        res[cat] = correct / max(1, len(items))
    model.train(was_training)
    return res


def format_table(rows, label="method"):
    """Markdown table in %: one result dict, or one row per {name: {metric: value or [values
    over seeds]}} (lists shown as mean ± std)."""
    single = not isinstance(next(iter(rows.values())), dict)
    rows = {"": rows} if single else rows
    cols = list(next(iter(rows.values())))
    fmt = lambda v: (f"{100 * np.mean(v):.1f} ± {100 * (np.std(v, ddof=1) if len(v) > 1 else 0):.1f}"
                     if isinstance(v, list) else f"{100 * v:.1f}")      # sample std over seeds
    lines = [[label] + cols] + [[name] + [fmt(r[c]) for c in cols] for name, r in rows.items()]
    lines = [ln[1:] if single else ln for ln in lines]
    lines.insert(1, ["---"] * len(lines[0]))
    return "\n".join("| " + " | ".join(ln) + " |" for ln in lines)


def summarize(root):
    """Mean ± std (over seeds) of the shapes_eval.json of every run under `root`, grouped by
    method: `python -c "import il_clip; il_clip.summarize('out/compare')"`."""
    groups = {}
    for d in sorted(os.listdir(root)):
        res_path, cfg_path = os.path.join(root, d, "shapes_eval.json"), os.path.join(root, d, "config.json")
        if not (os.path.isfile(res_path) and os.path.isfile(cfg_path)):
            continue
        cfg, res = json.load(open(cfg_path)), json.load(open(res_path))
        res["sugarcrepe_mean"] = float(np.mean([res[c] for c in data.SHAPES_CATEGORIES]))
        name = cfg["method"] + ("+neg" if cfg.get("negatives") else "")
        for k, v in res.items():
            groups.setdefault(name, {}).setdefault(k, []).append(v)
    table = format_table(groups, label="method (n seeds)")
    for name, r in groups.items():
        table = table.replace(f"| {name} |", f"| {name} ({len(r['i2t_r1'])}) |", 1)
    print(table)
    return groups


# -----------------------------------------------------------------------------
# main


def run(argv=None):
    args = build_args(argv)
    rank, world, owns_pg = setup_distributed(args)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    trainer = Trainer(args, rank, world)

    def on_sigterm(signum, frame):
        trainer.stop_requested = True
    old = signal.signal(signal.SIGTERM, on_sigterm)
    t0 = time.time()
    try:
        status = trainer.train()
    finally:
        signal.signal(signal.SIGTERM, old)
    if rank == 0:
        print(f"{status}: step {trainer.step}/{args.max_steps} in {time.time() - t0:.0f}s, "
              f"checkpoint in {args.out_dir}", file=sys.stderr)
    if status == "done" and trainer.step >= args.max_steps and rank == 0 and args.eval_n > 0 \
            and args.data.startswith("shapes"):
        res = evaluate_shapes(trainer.raw, trainer.tok, trainer.device, n=args.eval_n)
        save_json(os.path.join(args.out_dir, "shapes_eval.json"), res)
        print(format_table(res))
    if world > 1:
        dist.barrier()
    if owns_pg:
        dist.destroy_process_group()
    return {"done": 0, "sigterm": 0, "nan": 1}[status]


def main(argv=None):
    try:
        return run(argv)
    except (data.DataError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
