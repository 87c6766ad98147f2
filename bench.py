"""
Throughput, MFU and memory of il_clip.py's training step (nanoGPT's bench.py is the model).

    python bench.py --model tiny --method il --batch_size 64                 # training step, CPU
    python bench.py --model ViT-B-32 --method clip --batch_size 256 --compile --dtype bf16   # GPU
    python bench.py --model tiny --method clip --reference open_clip         # ratio vs open_clip
    python bench.py --data                    # loader vs plain PIL at 224 px
    python bench.py --data shapes --num_workers 0                            # one --data spec
    python bench.py --codebook_memory                                        # codebook head memory
    python bench.py --composer                                               # COMPOSER recursion
    python bench.py --targets --model ViT-B-32 --compile --json targets.json # every target, checked
"""
METHOD = """
How it measures. The step is il_clip's, written out in run_trainer: CLIP, AdamW groups,
il_clip.compute_loss (KD to a frozen teacher in distill), grad clip and logit-scale clamp, on one
synthetic batch kept on the device. A timed window starts and ends with one device sync, so the
step keeps its host-device overlap. IL: distill and interact steps are timed apart and combined
at the paper's schedule (5 x 1000 distill steps and 5 spawns in 48k steps). Memory: CUDA's
max_memory_allocated; on the CPU the peak RSS (VmHWM, reset through /proc/self/clear_refs) minus
the RSS before the model was built. The CPU here is shared: --reference / --targets alternate the
runs --rounds times and keep the best, and CPU runs also report process CPU time. Compare ratios
from one run, never across runs. --data writes 256 shapes scenes as img2dataset does (shorter
side 256, JPEG q95) into 2 shards and alternates a plain PIL decode + resize loop with one
make_loader epoch (224 px, 2 workers, first batch untimed).
"""
import argparse
import contextlib
import gc
import io
import json
import math
import os
import statistics
import sys
import tarfile
import tempfile
import time
import types
import weakref

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import data
import il_clip

# -----------------------------------------------------------------------------
# timing and memory


def sync(device):
    return torch.cuda.synchronize(device) if device.type == "cuda" else None


def proc_bytes(field="VmRSS", path="/proc/self/status"):
    """A kB field of /proc (VmRSS, VmHWM = peak RSS since the last reset, MemAvailable), Linux."""
    with open(path) as f:
        return next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":")), 0)


class PeakMemory:
    """CUDA: max_memory_allocated since start(). CPU: VmHWM since start() minus the RSS at
    construction. A later run in one process reuses memory the allocator kept, which shows no
    RSS growth: its CPU figure is a lower bound (said in kind())."""
    built = 0

    def __init__(self, device):
        self.device, self.base = device, proc_bytes() if device.type != "cuda" else 0
        self.reused = device.type != "cuda" and PeakMemory.built > 0
        PeakMemory.built += 1

    def start(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def peak(self):
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else proc_bytes("VmHWM") - self.base

    def kind(self):
        return ("max_memory_allocated" if self.device.type == "cuda" else "peak RSS delta (VmHWM)"
                + ("; a lower bound: not the process's first run" if self.reused else ""))


def fmt_bytes(n):
    return f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"


def timed(step, n, device, mem=None):
    """(wall s, process CPU s) per call of step() over n calls, between two device syncs."""
    sync(device)
    if mem is not None:
        mem.start()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        step()
    sync(device)
    return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


# -----------------------------------------------------------------------------
# il_clip.py's training step, written out, on one synthetic on-device batch


class SyntheticTokenizer:
    """Sizes and ids of a tokenizer; EOT the largest id (open_clip's argmax pooling finds it)."""

    def __init__(self, vocab_size, context_length):
        self.vocab_size, self.context_length = vocab_size, context_length
        self.pad_id, self.sot_id, self.eot_id = 0, vocab_size - 2, vocab_size - 1

    def batch(self, B, device, g):
        L = self.context_length
        text = torch.randint(1, self.sot_id, (B, L), generator=g)
        n = torch.randint(2, L, (B,), generator=g)                  # position of EOT, 2..L-1
        pos = torch.arange(L)[None]
        text[:, 0] = self.sot_id
        text = torch.where(pos == n[:, None], self.eot_id, torch.where(pos > n[:, None], 0, text))
        return text.to(device)


def model_config(model, method, codebook):
    cfg = il_clip.ModelConfig(**il_clip.MODEL_PRESETS[model])
    cfg.codebook_size = codebook if method in ("codebook", "il") else 0
    cfg.eot_token_id = SyntheticTokenizer(cfg.vocab_size, cfg.context_length).eot_id
    return cfg


def adamw(model, device):
    decay, no_decay = il_clip.param_groups(model)
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=5e-4, betas=(0.9, 0.98), eps=1e-6, fused=device.type == "cuda")


def run_trainer(args, method, device):
    """Times il_clip.py's training step. `il`: distill (language spawned) and interact steps timed
    apart after an untimed warm-up of each, and one spawn timed on its own."""
    K = args.codebook if args.codebook is not None else (1024 if args.model == "tiny" else 16384)
    cfg = model_config(args.model, method, K)
    il_args = types.SimpleNamespace(distill_loss="kd", no_freeze_codebook=False, distill_train_vision=False)
    mem = PeakMemory(device)
    torch.manual_seed(0)
    model = il_clip.CLIP(cfg, seed=0).to(device)
    opt = adamw(model, device)
    if args.compile:
        il_clip.compile_encoders(model)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16" else contextlib.nullcontext()
    r = types.SimpleNamespace(device=device, cfg=cfg, pool=None, text_tokens=0, args=il_args, autocast=autocast)
    g = torch.Generator().manual_seed(0)
    batch = {"image": torch.randn(args.batch_size, 3, cfg.image_size, cfg.image_size, generator=g).to(device),
             "text": SyntheticTokenizer(cfg.vocab_size, cfg.context_length).batch(args.batch_size, "cpu", g)}

    def step(phase="train", teacher=None):
        loss, _ = il_clip.compute_loss(model, teacher, batch, phase, "language" if teacher else None, r)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            model.logit_scale.clamp_(*((3.0, 6.0) if cfg.codebook_size else (0.0, math.log(100))))

    il_clip.set_trainable(model, il_args, "train", None)
    for _ in range(args.warmup):
        step()
    res = {"method": method, "cfg": cfg, "mem_kind": mem.kind()}
    if method != "il":
        res["step_s"], res["cpu_s"] = timed(step, args.steps, device, mem)
        res["peak_bytes"] = mem.peak()
        return res
    d = max(1, round(args.steps / 6))           # the paper's 1000 distill : 5000 interact
    i = max(1, args.steps - d)
    sync(device)
    t = time.perf_counter()
    teacher = il_clip.frozen_copy(model, args.compile)
    model.init_agent("language", torch.Generator().manual_seed(1))
    for _, p in il_clip.agent_params(model, "language"):
        opt.state.pop(p, None)
    sync(device)
    res["spawn_s"] = time.perf_counter() - t
    il_clip.set_trainable(model, il_args, "distill", "language")
    for _ in range(args.warmup):
        step("distill", teacher)
    res["distill_s"], cpu_d = timed(lambda: step("distill", teacher), d, device, mem)
    il_clip.set_trainable(model, il_args, "interact", None)
    res["interact_s"], cpu_i = timed(lambda: step("interact"), i, device)
    res.update(d=d, i=i, cpu_s=(d * cpu_d + i * cpu_i) / (d + i), peak_bytes=mem.peak())
    res["window_avg_s"] = res["step_s"] = (d * res["distill_s"] + i * res["interact_s"] + res["spawn_s"]) / (d + i)
    # the paper's schedule: 48000 steps, 5 x 1000 distill, 5 spawns, the rest contrastive
    res["paper_avg_s"] = (5000 * res["distill_s"] + 43000 * res["interact_s"] + 5 * res["spawn_s"]) / 48000
    return res


def avg_step(res):
    """A run's cost per step: IL's paper-schedule average, otherwise the plain step time."""
    return res.get("paper_avg_s", res["step_s"])


def report_train(args, res, device, label="il_clip"):
    cfg, step = res["cfg"], avg_step(res)
    flops, sps = il_clip.estimate_flops_per_pair(cfg), args.batch_size / step
    mfu = il_clip.estimate_mfu(cfg, sps, device)
    print(f"{label} {args.model} {res['method']} {f'K={cfg.codebook_size} ' if cfg.codebook_size else ''}batch "
          f"{args.batch_size} {args.dtype}{' compiled' if args.compile else ''} on {device_name(device)}")
    if res["method"] == "il":
        print(f"  distill step {res['distill_s'] * 1e3:.1f} ms, interact step {res['interact_s'] * 1e3:.1f} ms, "
              f"spawn {res['spawn_s'] * 1e3:.0f} ms; window average ({res['d']} distill + {res['i']} interact "
              f"+ 1 spawn) {res['window_avg_s'] * 1e3:.1f} ms/step")
        print(f"  IL average at the paper's schedule (10.4% distill, 5 spawns in 48k steps): {step * 1e3:.1f} ms/step")
    else:
        print(f"  step {step * 1e3:.1f} ms")
    if device.type == "cpu":   # all threads' CPU time: less sensitive to other jobs on a shared CPU
        print(f"  process CPU time {res['cpu_s'] * 1e3:.1f} ms/step (wall-clock above)")
    print(f"  {sps:,.1f} samples/s, {flops / 1e9:.2f} GFLOPs/pair/step -> {flops * sps / 1e12:.3f} TFLOP/s, "
          f"MFU {'n/a (no GPU peak for this device)' if mfu is None else f'{mfu:.1%}'}")
    print(f"  peak memory {fmt_bytes(res['peak_bytes'])} ({res['mem_kind']})")
    return sps


# -----------------------------------------------------------------------------
# --reference open_clip: the same configuration with open_clip's model and ClipLoss


def import_open_clip():
    """open_clip, for comparisons only (SPEC.md 6; the tests use this too). It imports torchvision,
    which has no CPU build here: during the import every torchvision module is a dummy whose
    attributes accept anything; the dummies are removed afterwards (torch probes for torchvision)."""
    import importlib.abc
    import importlib.machinery
    if "open_clip" in sys.modules:
        return sys.modules["open_clip"]

    class AnyMeta(type):
        __getattr__ = lambda cls, name: cls

    class Any(metaclass=AnyMeta):
        def __init__(self, *args, **kwargs):
            """Accepts any arguments and stores nothing."""
        __call__ = lambda self, *args, **kwargs: self

    class DummyTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            return importlib.machinery.ModuleSpec(name, self, is_package=True) if name.split(".")[0] == "torchvision" else None

        def create_module(self, spec):
            module = types.ModuleType(spec.name)
            module.__path__, module.__getattr__ = [], lambda name: Any
            return module

        def exec_module(self, module):
            """The dummy module has no code to run."""

    finder = DummyTorchvision()
    sys.meta_path.insert(0, finder)
    try:
        import open_clip
    finally:
        sys.meta_path.remove(finder)
        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]
    return open_clip


def open_clip_model(open_clip, cfg):
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg
    vision = CLIPVisionCfg(layers=cfg.vision_layers, width=cfg.vision_width, head_width=cfg.vision_width // cfg.vision_heads,
                           mlp_ratio=cfg.mlp_ratio, patch_size=cfg.patch_size, image_size=cfg.image_size)
    text = CLIPTextCfg(context_length=cfg.context_length, vocab_size=cfg.vocab_size, width=cfg.text_width,
                       heads=cfg.text_heads, layers=cfg.text_layers, mlp_ratio=cfg.mlp_ratio)
    return CLIP(cfg.embed_dim, vision, text, quick_gelu=cfg.quick_gelu)


def run_open_clip(args, device):
    """open_clip CLIP + ClipLoss in the same step as il_clip's (autocast, AdamW groups, grad clip,
    logit_scale clamp, optional torch.compile)."""
    open_clip = import_open_clip()          # first: it installs the torchvision stand-in
    cfg = model_config(args.model, "clip", 0)
    mem = PeakMemory(device)
    torch.manual_seed(0)
    raw = open_clip_model(open_clip, cfg).to(device).train()
    opt, loss_fn = adamw(raw, device), open_clip.loss.ClipLoss()
    model = torch.compile(raw) if args.compile else raw
    ac = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16" else contextlib.nullcontext()
    g = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch_size, 3, cfg.image_size, cfg.image_size, generator=g).to(device)
    text = SyntheticTokenizer(cfg.vocab_size, cfg.context_length).batch(args.batch_size, device, g)

    def step():
        with ac:
            loss = loss_fn(*model(images, text))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            raw.logit_scale.clamp_(0, math.log(100))

    for _ in range(args.warmup):
        step()
    step_s, cpu_s = timed(step, args.steps, device, mem)
    return {"method": "clip", "cfg": cfg, "step_s": step_s, "cpu_s": cpu_s, "peak_bytes": mem.peak(), "mem_kind": mem.kind()}


def alternating_rounds(args, device, methods):
    """Every run per method ("open_clip" or il_clip's), in turn --rounds times: drift hits all alike."""
    runs = {m: [] for m in methods}
    for _ in range(args.rounds):
        for m in methods:
            runs[m].append(run_open_clip(args, device) if m == "open_clip" else run_trainer(args, m, device))
    return runs


def bench_reference(args, device):
    runs = alternating_rounds(args, device, [args.method, "open_clip"])
    ours, theirs = runs[args.method], runs["open_clip"]
    a = report_train(args, min(ours, key=avg_step), device)
    b = report_train(args, min(theirs, key=avg_step), device, label="open_clip")
    print(f"il_clip / open_clip samples/s: {a / b:.3f} (best of {args.rounds} alternating rounds each; per round: "
          + ", ".join(f"{t['step_s'] / avg_step(o):.3f}" for o, t in zip(ours, theirs)) + ")")
    if device.type == "cpu":
        cpu = lambda rs: min(r["cpu_s"] for r in rs)
        print(f"il_clip / open_clip by process CPU time per step: {cpu(theirs) / cpu(ours):.3f}")
    return 0


# -----------------------------------------------------------------------------
# --data: the input pipeline alone


def make_jpeg_shards(folder, n, n_shards=2):
    """n shapes scenes as img2dataset writes them (shorter side 256, JPEG quality 95; noise makes
    them photo-sized) in webdataset shards with *_stats.json. -> (brace pattern, JPEG bytes)."""
    rng, jpegs = np.random.default_rng(0), []
    for i in range(n):
        x = np.asarray(data.shapes_scene("train", i).image.resize((341, 256), Image.BICUBIC), np.float32)
        buf = io.BytesIO()
        Image.fromarray(np.clip(x + rng.normal(0, 12, x.shape), 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=95)
        jpegs.append(buf.getvalue())
    for s in range(n_shards):
        with tarfile.open(os.path.join(folder, f"{s:05d}.tar"), "w") as tf:
            for i in range(s, n, n_shards):
                for ext, blob in (("jpg", jpegs[i]), ("txt", f"caption {i}".encode())):
                    info = tarfile.TarInfo(f"{i:09d}.{ext}")
                    info.size = len(blob)
                    tf.addfile(info, io.BytesIO(blob))
        with open(os.path.join(folder, f"{s:05d}_stats.json"), "w") as f:
            json.dump({"successes": len(range(s, n, n_shards))}, f)
    return os.path.join(folder, "{%05d..%05d}.tar" % (0, n_shards - 1)), jpegs


def cpu_seconds():
    """CPU time of this process and its joined children (the loader's workers)."""
    import resource
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def plain_pil(jpegs, size):
    """(images/s, CPU ms/image) of open + decode + RGB + bicubic resize of the shorter side."""
    t, c = time.perf_counter(), cpu_seconds()
    for b in jpegs:
        img = Image.open(io.BytesIO(b)).convert("RGB")
        s = size / min(img.size)
        img.resize((round(img.size[0] * s), round(img.size[1] * s)), Image.BICUBIC)
    return len(jpegs) / (time.perf_counter() - t), (cpu_seconds() - c) / len(jpegs) * 1e3


def loader_epoch(pattern, size, workers, batch, tok=None, max_batches=None):
    """(images/s after the first batch, CPU ms/image of main + workers incl. start-up, images read,
    samples skipped) over one epoch or max_batches."""
    import itertools
    c = cpu_seconds()
    loader = data.make_loader(pattern, batch_size=batch, tokenizer=tok, image_size=size, train=True,
                              num_workers=workers, drop_last=False, shuffle_buffer=64)
    it = iter(loader)
    n = len(next(it)["caption"])          # workers started, first batch out: not timed
    t = time.perf_counter()
    m = sum(len(b["caption"]) for b in itertools.islice(it, max_batches))
    return m / (time.perf_counter() - t), (cpu_seconds() - c) / (n + m) * 1e3, n + m, loader.skipped


def bench_data(args):
    """`--data` alone: 256 img2dataset-layout JPEGs at 224 px, a plain PIL loop vs data.make_loader
    (--num_workers, default 2) alternated --rounds times, best kept.
    `--data SPEC`: that data through make_loader (decode or render + augment + tokenize)."""
    B, workers = args.batch_size, args.num_workers if args.num_workers is not None else 2
    if args.data != "jpeg":
        tok = data.build_tokenizer(captions=data.captions_for_tokenizer(args.data), vocab_size=1000, context_length=32)
        size = il_clip.MODEL_PRESETS[args.model]["image_size"]
        rate, cpu_ms, n, skipped = loader_epoch(args.data, size, workers, B, tok, args.steps)
        print(f"data {args.data}: image {size}, batch {B}, num_workers {workers}: {rate:,.1f} samples/s, "
              f"{cpu_ms:.2f} CPU ms/sample, {n} samples (first batch and tokenizer not timed), skipped {skipped}")
        return 0
    with tempfile.TemporaryDirectory() as d:
        pattern, jpegs = make_jpeg_shards(d, 256)
        plain, loader = [], []
        for _ in range(args.rounds):            # alternate, keep each one's best
            plain.append(plain_pil(jpegs, 224))
            loader.append(loader_epoch(pattern, 224, workers, B)[:2])
    (plain_rate, _), (rate, _) = max(plain), max(loader)
    res = {"plain_pil_img_s": round(plain_rate, 1), f"loader_{workers}w_img_s": round(rate, 1),
           "ratio": round(rate / plain_rate, 2), "plain_cpu_ms_per_img": round(min(c for _, c in plain), 3),
           "loader_cpu_ms_per_img": round(min(c for _, c in loader), 3),
           "jpeg_kb": round(sum(map(len, jpegs)) / len(jpegs) / 1024, 1), "cpus": os.cpu_count()}
    print(json.dumps(res, indent=1))
    return 0


# -----------------------------------------------------------------------------
# --codebook_memory: the codebook head alone, chunked (il_clip) vs naive


class LiveTensorBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak live bytes of the tensor storages that ops under this mode create (freed ones leave
    through a weakref finalizer; pre-existing storages not counted). Exact on the CPU, blind to
    allocator overhead and scratch inside one kernel."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen = set()

    def _free(self, key, n):
        self.live -= n
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat_in = torch.utils._pytree.tree_leaves((args, kwargs))
        inputs = {t.untyped_storage().data_ptr() for t in flat_in if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key, n = st.data_ptr(), st.nbytes()
            if n == 0 or key in inputs or key in self.seen:
                continue
            self.seen.add(key)
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._free, key, n)
        return out


def codebook_head(q, codes, naive=False, **chunking):
    """query-map output q [B, P, D] -> max over tokens -> sparsemax over K -> weighted sum of codes."""
    if naive:
        s = (q @ codes.t()).max(dim=1).values                    # materialises B x P x K
    else:
        s = il_clip.max_code_scores(q, codes, **chunking)        # chunking: il_clip's `budget`
    w = il_clip.sparsemax(s / math.sqrt(q.shape[-1]), dim=-1)
    return F.normalize(w @ codes, dim=-1)


def head_peak(B, P, K, D, naive, device, **chunking):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, P, D, generator=g).to(device).requires_grad_()
    codes = torch.randn(K, D, generator=g).to(device).requires_grad_()
    target = torch.randn(B, D, generator=g).to(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        (codebook_head(q, codes, naive, **chunking) * target).sum().backward()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, "CUDA max_memory_allocated"
    with LiveTensorBytes() as m:
        (codebook_head(q, codes, naive, **chunking) * target).sum().backward()
    return m.peak, "live tensor storage bytes (TorchDispatchMode)"


def bench_codebook_memory(args, device):
    B, K, D = args.batch_size, args.codebook or 16384, args.code_dim
    print(f"codebook head forward + backward, B={B}, K={K}, D={D}, exact sparsemax, fp32, {device_name(device)}")
    avail = proc_bytes("MemAvailable", "/proc/meminfo")
    for P in (49, 196):
        ours, kind = head_peak(B, P, K, D, False, device)
        naive_need = B * P * K * 4
        if device.type == "cuda" or 3 * naive_need < avail:
            naive_s = fmt_bytes(head_peak(B, P, K, D, True, device)[0])
        else:
            naive_s = f"skipped (B*P*K*4 = {fmt_bytes(naive_need)}, too close to free memory)"
        print(f"  P={P:3d}: chunked {fmt_bytes(ours):>10}   naive {naive_s:>10}   "
              f"(B*P*K fp32 = {fmt_bytes(naive_need)}, B*K fp32 = {fmt_bytes(B * K * 4)})  [{kind}]")
    return 0


# -----------------------------------------------------------------------------
# --composer: level-batched composition vs node-by-node recursion


def bench_composer(args, device):
    import composer
    n = args.batch_size
    scenes = [data.shapes_scene("train", i) for i in range(n)]
    tok = data.build_tokenizer(captions=[s.caption for s in scenes], vocab_size=1000, context_length=32)
    cfg = composer.ModelConfig(vocab_size=tok.vocab_size, eot_token_id=tok.eot_id)
    torch.manual_seed(0)
    model = composer.Composer(cfg).to(device).eval()
    compiler = composer.TextCompiler(tok, cfg.max_len)
    comps = [compiler.compile(composer.caption_crg(s.caption, s.tree)) for s in scenes]
    regions = [composer.shapes_region_features(s.image, s.objects) for s in scenes]
    store = composer.FeatureStore([r[0] for r in regions], [r[1] for r in regions])
    feats, boxes, mask = store.get(torch.arange(n), device)
    nodes = sum(len(c["nodes"]) for c in comps)

    def batched():
        tb = {k: v.to(device) if torch.is_tensor(v) else v for k, v in composer.collate_text(comps).items()}
        te = model.encode_text(tb)
        V, vm = model.encode_image(feats, boxes, mask)
        idx = torch.arange(n, device=device)
        return model.score_pairs(tb, te, V, vm, idx, idx)[1]["node_score"]

    def recursive():
        return torch.cat([model.score_recursive(c, feats[i], boxes[i], mask[i]) for i, c in enumerate(comps)])

    with torch.no_grad():
        a, b = batched(), recursive()                            # warm-up, and the outputs compared
        tb_, tr_ = (statistics.median(timed(fn, 1, device)[0] for _ in range(max(1, args.steps // 4)))
                    for fn in (batched, recursive))
    print(f"composer forward, {n} caption-image pairs ({nodes} concept nodes, max depth "
          f"{max(max(x['level'] for x in c['nodes']) for c in comps)}), width {cfg.width}, {device_name(device)}:")
    print(f"  level-batched {tb_ * 1e3:.1f} ms ({n / tb_:,.1f} pairs/s), node-by-node {tr_ * 1e3:.1f} ms "
          f"({n / tr_:,.1f} pairs/s): {tr_ / tb_:.1f}x; max |node score diff| {float((a - b).abs().max()):.2e}")
    return 0


# -----------------------------------------------------------------------------
# --targets: every speed target measured in one run and checked against its threshold

# (key, what is measured, comparison, threshold on a GPU, threshold on the CPU; None = not a target there)
TARGETS = [
    ("clip_mfu", "CLIP MFU (dense bf16 peak)", ">=", 0.35, None),
    ("codebook_over_clip", "Codebook-CLIP step time / CLIP step time", "<=", 1.15, None),
    ("il_over_codebook", "IL average step (paper schedule) / Codebook-CLIP step", "<=", 1.02, None),
    ("vs_open_clip", "samples/s, il_clip CLIP / open_clip CLIP + ClipLoss", ">=", 1.2, 1.0),
    ("codebook_head_bytes", "codebook head peak memory, B=256 P=49 K=16384 D=512", "<", 1e9, 1e9),
]
OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, "<": lambda a, b: a < b}


def target_rows(values, gpu):
    """Per target: value (None: not measured), this machine kind's threshold (None: set for the
    other kind) and verdict True / False / None (nothing to judge)."""
    rows = []
    for key, what, op, on_gpu, on_cpu in TARGETS:
        threshold, value = (on_gpu if gpu else on_cpu), values.get(key)
        ok = None if threshold is None or value is None else bool(OPS[op](value, threshold))
        rows.append({"key": key, "what": what, "op": op, "threshold": threshold, "value": value, "ok": ok})
    return rows


def fmt_target(key, v):
    return ("-" if v is None else f"{v / 1e9:.2f} GB" if key == "codebook_head_bytes"
            else f"{v:.1%}" if key == "clip_mfu" else f"{v:.3f}x")


def bench_targets(args, device):
    """CLIP, Codebook-CLIP, IL (and open_clip when installed) alternated --rounds times, fastest
    kept, and the codebook head's peak memory; a table and, with --json, a report."""
    import dataclasses
    import importlib.util
    import platform
    methods = ["clip", "codebook", "il"] + (["open_clip"] if importlib.util.find_spec("open_clip") else [])
    res = {m: min(rs, key=avg_step) for m, rs in alternating_rounds(args, device, methods).items()}
    clip_step = res["clip"]["step_s"]
    values = {"clip_mfu": il_clip.estimate_mfu(res["clip"]["cfg"], args.batch_size / clip_step, device),
              "codebook_over_clip": res["codebook"]["step_s"] / clip_step,
              "il_over_codebook": res["il"]["paper_avg_s"] / res["codebook"]["step_s"]}
    if "open_clip" in res:          # samples/s ratio = inverse step-time ratio (same batch)
        values["vs_open_clip"] = res["open_clip"]["step_s"] / clip_step
    head_bytes, head_kind = head_peak(256, 49, 16384, 512, False, device)
    values["codebook_head_bytes"] = head_bytes
    rows = target_rows(values, device.type == "cuda")
    for m, r in res.items():
        report_train(args, r, device, label="open_clip" if m == "open_clip" else "il_clip")
    print(f"codebook head (B=256, P=49, K=16384, D=512, fp32) peak {fmt_bytes(head_bytes)} [{head_kind}]")
    print(f"\ntargets on {device_name(device)}: {args.model}, batch {args.batch_size}, {args.dtype}"
          f"{', compiled' if args.compile else ''}\n| target | measured | threshold | met |\n|---|---|---|---|")
    for r in rows:
        thr = "-" if r["threshold"] is None else f"{r['op']} {fmt_target(r['key'], r['threshold'])}"
        verdict = {True: "yes", False: "**no**", None: "n/a" if r["threshold"] is None else "not measured"}[r["ok"]]
        print(f"| {r['what']} | {fmt_target(r['key'], r['value'])} | {thr} | {verdict} |")
    judged = [r for r in rows if r["ok"] is not None]
    print(f"{sum(r['ok'] for r in judged)} of {len(judged)} targets met on this machine"
          + ("" if "open_clip" in res else " (open_clip_torch not installed: no reference)"))
    K = res["codebook"]["cfg"].codebook_size
    issue_config = (args.model, args.batch_size, args.dtype, K) == ("ViT-B-32", 256, "bf16", 16384)
    if device.type == "cuda" and not issue_config:
        print(f"note: the GPU targets are set for ViT-B-32, batch 256, bf16, K=16384; this run is "
              f"{args.model}, batch {args.batch_size}, {args.dtype}, K={K}")
    if args.json:
        runs = {m: {k: (dataclasses.asdict(v) if k == "cfg" else v) for k, v in r.items()} for m, r in res.items()}
        report = {"device": device_name(device), "torch": torch.__version__, "python": platform.python_version(),
                  "command": "python bench.py " + " ".join(args.argv),
                  "config": {k: getattr(args, k) for k in ("model", "batch_size", "dtype", "compile", "steps", "warmup")},
                  "issue_config": issue_config, "targets": rows, "runs": runs,
                  "codebook_head": {"bytes": head_bytes, "counted_by": head_kind}}
        data.atomic_write(args.json, lambda p: open(p, "w").write(json.dumps(report, indent=1)))
        print(f"report written to {args.json}")
    return 0


# -----------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, epilog=METHOD, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default="tiny", choices=list(il_clip.MODEL_PRESETS))
    a("--method", default="clip", choices=["clip", "codebook", "il"])
    a("--batch_size", type=int, default=None, help="default: 64 for tiny, 256 otherwise")
    a("--codebook", type=int, default=None, help="K (default: 1024 for tiny, 16384 otherwise and for --codebook_memory)")
    a("--compile", action="store_true")
    a("--dtype", default=None, choices=["fp32", "bf16"], help="default: bf16 on CUDA, fp32 on CPU")
    a("--device", default=None, help="cpu | cuda (default: cuda when available)")
    a("--steps", type=int, default=10, help="timed steps")
    a("--warmup", type=int, default=3, help="untimed steps first")
    a("--reference", default=None, choices=["open_clip"], help="also time open_clip, print the ratio")
    a("--rounds", type=int, default=2, help="--reference / --targets / --data: alternate the runs this many times, "
      "keep each one's best (the CPU here is shared)")
    a("--data", nargs="?", const="jpeg", default=None, help="the input pipeline alone: JPEG shards at 224 px "
      "(plain PIL loop vs data.make_loader), or a --data spec of il_clip.py")
    a("--num_workers", type=int, default=None, help="--data: loader workers (default 2)")
    a("--codebook_memory", action="store_true", help="peak memory of the codebook head alone")
    a("--code_dim", type=int, default=512, help="--codebook_memory: D of codes and queries")
    a("--composer", action="store_true", help="level-batched vs node-by-node composition")
    a("--targets", action="store_true", help="measure every speed target (CLIP MFU, codebook and IL overhead, "
      "open_clip ratio, codebook head memory) and check each")
    a("--json", default=None, help="--targets: also write the report to this JSON file")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    args.batch_size = args.batch_size or (64 if args.model == "tiny" and not args.codebook_memory else 256)
    if args.data:
        return bench_data(args)
    if args.codebook_memory:
        return bench_codebook_memory(args, device)
    if args.composer:
        return bench_composer(args, device)
    if args.targets:
        return bench_targets(args, device)
    if args.reference == "open_clip":
        return bench_reference(args, device)
    report_train(args, run_trainer(args, args.method, device), device)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (data.DataError, il_clip.ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
