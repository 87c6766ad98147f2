"""
Throughput, MFU and memory of il_clip.py's training step (nanoGPT's bench.py is the model).

    python bench.py --model tiny --method il --batch_size 64  # training step, CPU
    python bench.py --model ViT-B-32 --method clip --batch_size 256 --compile --dtype bf16  # GPU
    python bench.py --data --feed 6204                        # loader vs plain PIL, cores to feed
    python bench.py --data shapes --num_workers 0             # one --data spec
    python bench.py --data_wait                               # JPEG-fed il_clip: time waiting for data
    python bench.py --codebook_memory                         # codebook head memory
    python bench.py --script il_clip_softmax.py --method codebook  # a fork's training step
    python bench.py --composer                                # COMPOSER recursion
    python bench.py --targets --model ViT-B-32 --compile --json targets.json # every target, checked

How it measures: il_clip's step on one synthetic on-device batch, timed between two device syncs
(the step keeps its host-device overlap). IL: distill and interact timed apart, and one
il_clip.spawn (teacher copy, re-initialised agent), combined at the paper's schedule (5 x 1000
distill steps and 5 spawns in 48k). Memory: CUDA max_memory_allocated; CPU peak RSS (VmHWM) minus
the RSS before the model was built (a lower bound after the process's first model). A shared CPU
drifts, so --targets / --data alternate the runs --rounds times and keep the best; compare ratios
from one run, never across runs. --data: img2dataset-style JPEGs (shorter side 256 or 512, q95) in
2 shards, CPU time of main process + workers per image (getrusage).
--targets times open_clip's CLIP + ClipLoss too where open_clip_torch is installed.
"""
import argparse
import contextlib
import gc
import io
import itertools
import math
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tarfile
import tempfile
import time
import weakref

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import data
import lifecycle
import il_clip


# timing and memory
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def proc_bytes(field="VmRSS", path="/proc/self/status"):
    """A kB field of /proc (VmRSS, VmHWM = peak RSS since the last reset, MemAvailable), Linux."""
    with open(path) as f:
        return next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":")), 0)


class PeakMemory:
    """Peak bytes since start() above those held when built. CUDA: max_memory_allocated.
    CPU: peak RSS (VmHWM), a lower bound after the process's first model (the allocator
    reuses memory it kept)."""

    def __init__(self, device):
        self.device, self.cuda = device, device.type == "cuda"
        self.base = torch.cuda.memory_allocated(device) if self.cuda else proc_bytes()
        self.kind = ("max_memory_allocated" if self.cuda
                     else "peak RSS delta (VmHWM), a lower bound after the first run")

    def start(self):
        if self.cuda:
            return torch.cuda.reset_peak_memory_stats(self.device)
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def peak(self):
        return (torch.cuda.max_memory_allocated(self.device) if self.cuda
                else proc_bytes("VmHWM")) - self.base


def fmt_bytes(n):
    return f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def device_name(device):
    return (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"CPU ({torch.get_num_threads()} threads)")


def timed(step, n, device, untimed=0, mem=None):
    """Wall seconds per call of step() over n calls after `untimed` ones
    (caches, allocator, compile)."""
    for _ in range(untimed):
        step()
    sync(device)
    if mem is not None:
        mem.start()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync(device)
    return (time.perf_counter() - t0) / n


# il_clip.py's training step (or open_clip's), written out, on one synthetic on-device batch
def synthetic_text(B, vocab_size, context_length, g):
    """[B, L] token ids: SOT = vocab_size - 2, words, EOT = vocab_size - 1 (the largest id, which
    open_clip's argmax pooling finds) at a random position 2..L-1, zero padding after it."""
    text = torch.randint(1, vocab_size - 2, (B, context_length), generator=g)
    eot = torch.randint(2, context_length, (B,), generator=g)[:, None]
    pos = torch.arange(context_length)[None]
    text[:, 0] = vocab_size - 2
    return torch.where(pos == eot, vocab_size - 1, torch.where(pos > eot, 0, text))


def model_config(model, method, codebook):
    cfg = il_clip.ModelConfig(**il_clip.MODEL_PRESETS[model])
    cfg.codebook_size = codebook if method in ("codebook", "il") else 0
    cfg.eot_token_id = cfg.vocab_size - 1       # synthetic_text's EOT
    return cfg


def run_trainer(args, method, device):
    """Times il_clip.py's training step, or ("open_clip") open_clip's CLIP + ClipLoss in it. `il`:
    distill (language spawned) and interact steps timed apart after untimed warm-ups, and one spawn
    alone; its step_s is their average at the paper's schedule."""
    open_clip = import_open_clip() if method == "open_clip" else None
    K = args.codebook if args.codebook is not None else (1024 if args.model == "tiny" else 16384)
    cfg = model_config(args.model, method, K)
    il_args = il_clip.build_args(["--model", args.model,
                                  "--method", "clip" if open_clip else method]
                                 + (["--codebook", str(K)] if cfg.codebook_size else [])
                                 + (["--compile"] if args.compile else []))
    mem = PeakMemory(device)
    seed = getattr(args, "seed", 0)
    torch.manual_seed(seed)
    model = (open_clip_model(open_clip, cfg).to(device).train() if open_clip
             else il_clip.CLIP(cfg, seed=seed).to(device))
    decay, no_decay = il_clip.param_groups(model)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=5e-4, betas=(0.9, 0.98), eps=1e-6, fused=device.type == "cuda")
    lever = getattr(args, "lever", "encoders")
    if open_clip:
        fwd, loss_fn = torch.compile(model) if args.compile else model, open_clip.loss.ClipLoss()
    elif args.compile and (lever == "encoders" or method == "il"):
        il_clip.compile_encoders(model)
    elif args.compile:
        # --levers: the towers and the loss in one compiled graph, optionally CUDA-graphed
        fwd_loss = torch.compile(lambda im, tx: il_clip.contrastive_loss(*model(im, tx)),
                                 mode="reduce-overhead" if lever == "step+cudagraphs" else None)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16"
                else contextlib.nullcontext())
    g, B = torch.Generator().manual_seed(seed), args.batch_size
    images = torch.randn(B, 3, cfg.image_size, cfg.image_size, generator=g).to(device)
    # il_clip's text stays on the CPU: compute_loss trims its padding there (no device sync)
    text = synthetic_text(B, cfg.vocab_size, cfg.context_length, g).to(device if open_clip else "cpu")
    batch = {"image": images, "text": text}

    def step(phase="train", teacher=None):
        with autocast:
            if open_clip:
                loss = loss_fn(*fwd(images, text))
            elif args.compile and lever != "encoders" and method != "il":
                if lever == "step+cudagraphs":
                    torch.compiler.cudagraph_mark_step_begin()
                loss = fwd_loss(images, il_clip.trim_padding(text, cfg.eot_token_id)
                                .to(device, non_blocking=True))
            else:
                loss = il_clip.compute_loss(model, batch, phase, "language" if teacher else None,
                                            teacher, None, il_args)[0]
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            model.logit_scale.clamp_(*((3.0, 6.0) if cfg.codebook_size else (0.0, math.log(100))))

    if not open_clip:
        il_clip.set_trainable(model, il_args, "train", None)
    res = {"method": "clip" if open_clip else method, "cfg": cfg, "mem_kind": mem.kind}
    if method != "il":
        return {**res, "step_s": timed(step, args.steps, device, args.untimed, mem),
                "peak_bytes": mem.peak()}
    for _ in range(args.untimed):
        step()
    d = max(1, round(args.steps / 6))           # the paper's 1000 distill : 5000 interact
    i = max(1, args.steps - d)
    sync(device)
    t = time.perf_counter()
    teacher = il_clip.spawn(model, opt, il_args, 1)
    sync(device)
    res["spawn_s"] = time.perf_counter() - t
    il_clip.set_trainable(model, il_args, "distill", "language")
    res["distill_s"] = timed(lambda: step("distill", teacher), d, device, args.untimed, mem)
    il_clip.set_trainable(model, il_args, "interact", None)
    res["interact_s"] = timed(lambda: step("interact"), i, device)
    # the paper's schedule: 48000 steps, 5 x 1000 distill, 5 spawns, the rest contrastive
    res["step_s"] = (5000 * res["distill_s"] + 43000 * res["interact_s"]
                     + 5 * res["spawn_s"]) / 48000
    return {**res, "d": d, "i": i, "peak_bytes": mem.peak()}


def report_train(args, res, device, label="il_clip"):
    cfg, step = res["cfg"], res["step_s"]
    flops, sps = lifecycle.estimate_flops_per_pair(cfg), args.batch_size / step
    mfu = lifecycle.estimate_mfu(cfg, sps, device)
    print(f"{label} {args.model} {res['method']} "
          f"{f'K={cfg.codebook_size} ' if cfg.codebook_size else ''}batch {args.batch_size} "
          f"{args.dtype}{' compiled' if args.compile else ''} on {device_name(device)}")
    if res["method"] == "il":
        print(f"  distill step {res['distill_s'] * 1e3:.1f} ms ({res['d']} timed), "
              f"interact step {res['interact_s'] * 1e3:.1f} ms ({res['i']} timed), "
              f"spawn {res['spawn_s'] * 1e3:.0f} ms")
        print(f"  IL average at the paper's schedule (5 x 1000 distill steps, 5 spawns in 48k): "
              f"{step * 1e3:.1f} ms/step")
    else:
        print(f"  step {step * 1e3:.1f} ms")
    print(f"  {sps:,.1f} samples/s, {flops / 1e9:.2f} GFLOPs/pair/step -> "
          f"{flops * sps / 1e12:.3f} TFLOP/s, "
          f"MFU {'n/a (no GPU peak for this device)' if mfu is None else f'{mfu:.1%}'}")
    print(f"  peak memory {fmt_bytes(res['peak_bytes'])} ({res['mem_kind']})")


# the reference: the same configuration with open_clip's model and ClipLoss
def import_open_clip():
    """open_clip for the reference runs only (the project never imports it); None, saying why, where
    it cannot be imported."""
    try:
        import open_clip
        return open_clip
    except ImportError as e:        # open_clip_torch not installed, or its torchvision missing
        print(f"no open_clip reference: {e} (pip install open_clip_torch)", file=sys.stderr)


def open_clip_model(open_clip, cfg):
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg
    vision = CLIPVisionCfg(layers=cfg.vision_layers, width=cfg.vision_width,
                           head_width=cfg.vision_width // cfg.vision_heads, mlp_ratio=cfg.mlp_ratio,
                           patch_size=cfg.patch_size, image_size=cfg.image_size)
    text = CLIPTextCfg(context_length=cfg.context_length, vocab_size=cfg.vocab_size,
                       width=cfg.text_width, heads=cfg.text_heads, layers=cfg.text_layers,
                       mlp_ratio=cfg.mlp_ratio)
    return CLIP(cfg.embed_dim, vision, text, quick_gelu=cfg.quick_gelu)


def alternating_rounds(args, device, methods):
    """Every method's run in turn, --rounds times (drift on the shared CPU hits all alike); reports
    and returns each method's fastest run."""
    runs = {m: [] for m in methods}
    for _ in range(args.rounds):
        for m in methods:
            runs[m].append(run_trainer(args, m, device))
    best = {m: min(rs, key=lambda r: r["step_s"]) for m, rs in runs.items()}
    for m, r in best.items():
        report_train(args, r, device, "open_clip" if m == "open_clip" else "il_clip")
    return best


# --data: the input pipeline alone
def cpu_seconds():
    """CPU time of this process and its joined children (the loader's
    workers), to the microsecond."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def loader_epoch(pattern, size, workers, batch, tok=None, max_batches=None):
    """(images/s after the first batch, CPU ms/image of main + workers,
    images read, samples skipped)."""
    c = cpu_seconds()
    loader = data.make_loader(pattern, batch_size=batch, tokenizer=tok, image_size=size, train=True,
                              num_workers=workers, drop_last=False, shuffle_buffer=64)
    it = iter(loader)
    n = len(next(it)["caption"])          # workers started, first batch out: not timed
    t = time.perf_counter()
    m = sum(len(b["caption"]) for b in itertools.islice(it, max_batches))
    return m / (time.perf_counter() - t), (cpu_seconds() - c) / (n + m) * 1e3, n + m, loader.skipped


class _OneImage(torch.utils.data.Dataset):
    """n samples of one fixed uint8 224 px image: a loader over it costs its batch
    transport alone, no decode."""

    def __init__(self, n):
        self.n, self.image = n, torch.randint(0, 256, (3, 224, 224), dtype=torch.uint8,
                                              generator=torch.Generator())

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"image": self.image, "caption": "c", "key": str(i)}


def transport_ms(n, workers, batch, slots):
    """CPU ms/image (main + workers) of moving n uint8 224 px images from `workers` workers to the
    main process, through reused shared-memory slots (data._SharedBatches) or fresh shared memory
    per batch (slots=False)."""
    loader = data.MapLoader(_OneImage(n), batch, num_workers=workers,
                            image_size=224 if slots else None)
    c = cpu_seconds()
    m = sum(len(b["caption"]) for b in loader)
    return (cpu_seconds() - c) / m * 1e3


def jpeg_shards(folder, n, short_side, shards=2):
    """n shapes scenes as img2dataset writes them (4:3, shorter side `short_side`, JPEG
    q95, noise for photo-like sizes) in `shards` tars of KEY.jpg + KEY.txt with
    NNNNN_stats.json -> (brace pattern, JPEGs)."""
    rng, jpegs = np.random.default_rng(0), []
    for i in range(n):
        scene = data.shapes_scene("train", i)
        x = np.asarray(scene.image.resize((short_side * 4 // 3, short_side), Image.BICUBIC),
                       np.float32)
        buf = io.BytesIO()
        Image.fromarray(np.clip(x + rng.normal(0, 12, x.shape), 0, 255).astype(np.uint8)).save(
            buf, "JPEG", quality=95)
        jpegs.append((buf.getvalue(), scene.caption))
    for s in range(shards):
        keys = range(s, n, shards)
        with tarfile.open(os.path.join(folder, f"{s:05d}.tar"), "w") as tf:
            for i, ext in itertools.product(keys, ("jpg", "txt")):
                blob = jpegs[i][0] if ext == "jpg" else jpegs[i][1].encode()
                info = tarfile.TarInfo(f"{i:09d}.{ext}")
                info.size = len(blob)
                tf.addfile(info, io.BytesIO(blob))
        lifecycle.save_json(os.path.join(folder, f"{s:05d}_stats.json"), {"successes": len(keys)})
    return os.path.join(folder, f"{{00000..{shards - 1:05d}}}.tar"), [j for j, _ in jpegs]


def plain_loop(jpegs, size):
    """CPU ms/image of the least a loader does: decode, RGB, a centred crop of 95% of the
    area (the mean of make_loader's training crop, scale 0.9-1) resized to size x size
    (bicubic), a uint8 tensor. No draft."""
    c = cpu_seconds()
    for b in jpegs:
        img = Image.open(io.BytesIO(b)).convert("RGB")
        w, h = img.size
        cw, ch = round(w * 0.95 ** 0.5), round(h * 0.95 ** 0.5)
        img = img.resize((size, size), Image.BICUBIC,
                         box=((w - cw) // 2, (h - ch) // 2, (w + cw) // 2, (h + ch) // 2))
        torch.from_numpy(np.array(img))
    return (cpu_seconds() - c) / len(jpegs) * 1e3


def plain_parallel(jpegs, size, n):
    """plain_loop run by n forked processes at once, each on its share: CPU ms/image with as
    many busy cores as make_loader's n workers (two busy cores slow each other: shared
    caches, memory bandwidth, clocks)."""
    ps = [mp.get_context("fork").Process(target=plain_loop, args=(jpegs[i::n], size))
          for i in range(n)]
    c = cpu_seconds()
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    return (cpu_seconds() - c) / len(jpegs) * 1e3


def bench_data(args, device):
    """`--data SPEC`: that data through make_loader (decode or render + augment + tokenize).
    `--data`: --images shapes scenes as img2dataset JPEGs, stored at 256 px (img2dataset's default;
    decoded in full for 224) and at 512 px (JPEG draft decoding at 1/2), read at 224 px by a plain
    PIL loop and by make_loader with 0 and --num_workers workers, alternated --rounds times, the
    least CPU kept; N workers are also set against N plain loops at once (as many busy cores).
    Steady state: the slope between an epoch of one batch per shard and the full one, which takes
    out each epoch's start-up (forking workers, their copy-on-write faults) that a long epoch
    amortises. `--feed R`: the cores that R samples/s take, in steady state."""
    B, workers = args.batch_size, args.num_workers if args.num_workers is not None else 2
    if args.data != "jpeg":
        tok = data.build_tokenizer(captions=data.captions_for_tokenizer(args.data), vocab_size=1000,
                                   context_length=32)
        size = il_clip.MODEL_PRESETS[args.model]["image_size"]
        rate, cpu_ms, n, skipped = loader_epoch(args.data, size, workers, B, tok, args.steps)
        print(f"data {args.data}: image {size}, batch {B}, num_workers {workers}: "
              f"{rate:,.1f} samples/s, {cpu_ms:.2f} CPU ms/sample, {n} samples "
              f"(first batch and tokenizer not timed), skipped {skipped}")
        return 0
    print(f"{args.images} img2dataset JPEGs in 2 shards read at 224 px, batch {B}, "
          f"{os.cpu_count()} CPUs, CPU ms per image (main process + workers, each epoch's worker "
          f"start-up included), least of {args.rounds} rounds; each ratio is the median over "
          f"rounds of the two costs measured side by side in a round (the machine's speed drifts):")
    costs, tiny = {}, 2 * B     # the short epoch: one batch per shard (one per worker at 2 workers)
    for stored in (256, 512):
        with tempfile.TemporaryDirectory() as d:
            pattern, jpegs = jpeg_shards(d, args.images, stored)
            os.mkdir(os.path.join(d, "short"))
            short_pattern = (jpeg_shards(os.path.join(d, "short"), tiny, stored)[0]
                             if args.images > tiny else None)
            runs = {k: [] for k in ("plain", "parallel", 0, workers,
                                    "steady0", "steady", "start0", "start")}
            for _ in range(args.rounds):
                runs["plain"].append(plain_loop(jpegs, 224))
                runs["parallel"].append(plain_parallel(jpegs, 224, max(1, workers)))
                for w, tag in ((0, "0"), (workers, "")):
                    _, ms, n, _ = loader_epoch(pattern, 224, w, B)
                    runs[w].append(ms)
                    # steady state: the slope between the short and the full epoch
                    if short_pattern:
                        _, ms_short, n_short, _ = loader_epoch(short_pattern, 224, w, B)
                        runs["steady" + tag].append((ms * n - ms_short * n_short) / (n - n_short))
                        runs["start" + tag].append(ms_short * n_short
                                                   - runs["steady" + tag][-1] * n_short)
        (plain, parallel), ms = ((min(runs[k]) for k in ("plain", "parallel")),
                                 {w: min(runs[w]) for w in (0, workers)})
        # with few images the start-up noise can exceed the images between the two epochs:
        # no slope then
        separable = short_pattern and min(runs["steady0"] + runs["steady"]) > 0
        costs[stored] = min(runs["steady"]) if separable else ms[workers]
        kib = sum(map(len, jpegs)) / len(jpegs) / 1024
        ratio = lambda a, b: statistics.median(x / y for x, y in zip(runs[a], runs[b]))
        print(f"  stored {stored} px ({kib:.0f} KiB){', draft 1/2' if stored == 512 else ''}: "
              f"plain PIL loop {plain:.2f}; make_loader 0 workers {ms[0]:.2f} "
              f"({ratio(0, 'plain'):.2f}x plain), {workers} workers {ms[workers]:.2f} "
              f"({ratio(workers, 'plain'):.2f}x plain; {ratio(workers, 'parallel'):.2f}x "
              f"{max(1, workers)} plain loops at once, {parallel:.2f})")
        if short_pattern and not separable:
            print(f"    steady state: not separable at {args.images} images (a slope between "
                  f"{tiny}- and {args.images}-image epochs at or below zero, start-up noise "
                  f"exceeding the images between them; use more --images); "
                  f"--feed uses the full epoch")
        elif short_pattern:
            print(f"    steady state (each epoch's start-up, "
                  f"{statistics.median(runs['start0']):.0f} / "
                  f"{statistics.median(runs['start']):.0f} CPU ms at 0 / {workers} workers, "
                  f"taken out: the slope between {tiny}- and {args.images}-image epochs): "
                  f"0 workers {min(runs['steady0']):.2f} ({ratio('steady0', 'plain'):.2f}x plain), "
                  f"{workers} workers {min(runs['steady']):.2f} "
                  f"({ratio('steady', 'plain'):.2f}x plain; "
                  f"{ratio('steady', 'parallel'):.2f}x {max(1, workers)} plain loops at once)")
    if workers:
        runs = {True: [], False: []}
        for _ in range(args.rounds):
            for slots in runs:
                runs[slots].append(transport_ms(4096, workers, B, slots))
        print(f"  batch transport alone (4096 images, no decode), {workers} workers: "
              f"{min(runs[True]):.3f} ms/image through reused shared-memory slots, "
              f"{min(runs[False]):.3f} through fresh shared memory per batch (median difference "
              f"{statistics.median(b - a for a, b in zip(runs[True], runs[False])):.3f})")
    if args.feed:
        print(f"  feeding {args.feed:,.0f} samples/s takes "
              + ", ".join(f"{math.ceil(args.feed * ms / 1e3)} cores at {stored} px"
                          for stored, ms in costs.items())
              + " (cores as fast as these, steady state where separable;"
                " make_loader's main process included)")
    return 0


def bench_data_wait(args, device):
    """`--data_wait`: il_clip's model trained on JPEG shards (img2dataset-style, 256 px)
    through make_loader with --num_workers workers: the fraction of step time spent
    waiting for the next batch."""
    B, workers = args.batch_size, args.num_workers if args.num_workers is not None else 2
    with tempfile.TemporaryDirectory() as d:
        pattern, _ = jpeg_shards(d, max(args.images, B * (args.steps + args.untimed + 1)), 256)
        tok = data.build_tokenizer(captions=data.captions_for_tokenizer(pattern), vocab_size=1000,
                                   context_length=32)
        il_args = il_clip.build_args(["--model", args.model, "--method", "clip", "--data", pattern])
        cfg = il_clip.model_config(il_args, tok)
        model, opt = il_clip.build_model_and_optimizer(il_args, cfg, device)
        il_clip.set_trainable(model, il_args, "train", None)
        bf16 = args.dtype == "bf16"
        autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if bf16
                    else contextlib.nullcontext())
        batches = data.make_loader(pattern, batch_size=B, tokenizer=tok, image_size=cfg.image_size,
                                   num_workers=workers, pin_memory=device.type == "cuda").forever()
        wait = total = 0.0
        for i in range(args.untimed + args.steps):  # the first steps start the workers: not timed
            t0 = time.perf_counter()
            b = next(batches)
            t1 = time.perf_counter()
            with autocast:  # the uint8 batch normalised on the device, as the training scripts do
                batch = {"image": data.normalize_images(b["image"], device), "text": b["text"]}
                loss = il_clip.compute_loss(model, batch, "train", None, None, None, il_args)[0]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
            if i >= args.untimed:
                wait, total = wait + t1 - t0, total + time.perf_counter() - t0
    print(f"il_clip {args.model} clip on JPEG shards ({cfg.image_size} px from 256 px), batch {B}, "
          f"{workers} workers, {device_name(device)}, {os.cpu_count()} CPUs: "
          f"step {total / args.steps * 1e3:.1f} ms, waiting for the next batch "
          f"{wait / args.steps * 1e3:.1f} ms = {wait / total:.1%} of step time "
          f"({args.steps} steps timed)")
    return 0


# --codebook_memory: the codebook head alone, chunked (il_clip) vs naive
class LiveTensorBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak live bytes of the tensor storages that ops under this mode create (a
    weakref finalizer sees them freed). Exact on the CPU, blind to allocator overhead
    and scratch inside one kernel."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.seen = 0, 0, set()

    def _free(self, key, n):
        self.live -= n
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        storages = lambda x: [t.untyped_storage()  # noqa: E731
                              for t in torch.utils._pytree.tree_leaves(x)
                              if isinstance(t, torch.Tensor)]
        inputs = {st.data_ptr() for st in storages((args, kwargs))}
        for st in storages(out):
            key, n = st.data_ptr(), st.nbytes()
            if n and key not in inputs and key not in self.seen:
                self.seen.add(key)
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(st, self._free, key, n)
        return out


def codebook_head(q, codes, naive=False, **chunking):
    """query-map output q [B, P, D] -> max over tokens -> sparsemax over K
    -> weighted sum of codes."""
    if naive:
        s = (q @ codes.t()).max(dim=1).values                    # materialises B x P x K
    else:
        s = il_clip.max_code_scores(q, codes, **chunking)        # chunking: il_clip's `budget`
    w = il_clip.sparsemax(s / math.sqrt(q.shape[-1]), dim=-1)
    return F.normalize(w @ codes, dim=-1)


def head_peak(B, P, K, D, naive, device, **chunking):
    """(peak bytes of one forward + backward of codebook_head, how they were counted)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, P, D, generator=g).to(device).requires_grad_()
    codes = torch.randn(K, D, generator=g).to(device).requires_grad_()
    target = torch.randn(B, D, generator=g).to(device)
    gc.collect()
    if device.type == "cuda":
        mem = PeakMemory(device)
        mem.start()
        (codebook_head(q, codes, naive, **chunking) * target).sum().backward()
        sync(device)
        return mem.peak(), mem.kind
    with LiveTensorBytes() as m:
        (codebook_head(q, codes, naive, **chunking) * target).sum().backward()
    return m.peak, "live tensor storage bytes (TorchDispatchMode)"


def bench_codebook_memory(args, device):
    B, K, D = args.batch_size, args.codebook or 16384, args.code_dim
    print(f"codebook head forward + backward, B={B}, K={K}, D={D}, exact sparsemax, fp32, "
          f"{device_name(device)}")
    avail = proc_bytes("MemAvailable", "/proc/meminfo")
    for P in (49, 196):
        ours, kind = head_peak(B, P, K, D, False, device)
        naive_need = B * P * K * 4
        naive_s = (fmt_bytes(head_peak(B, P, K, D, True, device)[0])
                   if device.type == "cuda" or 3 * naive_need < avail
                   else f"skipped (B*P*K*4 = {fmt_bytes(naive_need)}, too close to free memory)")
        print(f"  P={P:3d}: chunked {fmt_bytes(ours):>10}   naive {naive_s:>10}   (B*P*K fp32 = "
              f"{fmt_bytes(naive_need)}, B*K fp32 = {fmt_bytes(B * K * 4)})  [{kind}]")
    return 0


# --composer: level-batched composition vs node-by-node recursion
def bench_composer(args, device):
    import composer
    n = args.batch_size
    scenes = [data.shapes_scene("train", i) for i in range(n)]
    tok = data.build_tokenizer(captions=[s.caption for s in scenes], vocab_size=1000,
                               context_length=32)
    cfg = composer.ModelConfig(vocab_size=tok.vocab_size, eot_token_id=tok.eot_id)
    torch.manual_seed(0)
    model = composer.Composer(cfg).to(device).eval()
    compiler = composer.TextCompiler(tok, cfg.max_len)
    comps = [compiler.compile(composer.caption_crg(s.caption, s.tree)) for s in scenes]
    regions = [composer.shapes_region_features(s.image, s.objects) for s in scenes]
    store = composer.FeatureStore([r[0] for r in regions], [r[1] for r in regions])
    feats, boxes, mask = store.get(torch.arange(n), device)

    def batched():
        tb = {k: v.to(device) if torch.is_tensor(v) else v
              for k, v in composer.collate_text(comps).items()}
        V, vm = model.encode_image(feats, boxes, mask)
        idx = torch.arange(n, device=device)
        return model.score_pairs(tb, model.encode_text(tb), V, vm, idx, idx)[1]["node_score"]

    def recursive():
        return torch.cat([model.score_recursive(c, feats[i], boxes[i], mask[i])
                          for i, c in enumerate(comps)])

    with torch.no_grad():
        a, b = batched(), recursive()                            # warm-up, and the outputs compared
        tb_, tr_ = (statistics.median(timed(fn, 1, device) for _ in range(max(1, args.steps // 4)))
                    for fn in (batched, recursive))
    print(f"composer forward, {n} caption-image pairs "
          f"({sum(len(c['nodes']) for c in comps)} concept nodes, "
          f"max depth {max(max(x['level'] for x in c['nodes']) for c in comps)}), "
          f"width {cfg.width}, {device_name(device)}:")
    print(f"  level-batched {tb_ * 1e3:.1f} ms ({n / tb_:,.1f} pairs/s), "
          f"node-by-node {tr_ * 1e3:.1f} ms ({n / tr_:,.1f} pairs/s): {tr_ / tb_:.1f}x; "
          f"max |node score diff| {float((a - b).abs().max()):.2e}")
    return 0


# --levers: what moves CLIP's MFU and the codebook head's cost, one lever at a time (GPU)
# (label, method, per-GPU batch, what is compiled, codebook scores per chunk or None: il_clip's)
LEVERS = [
    ("CLIP: encoders compiled (il_clip --compile)", "clip", 256, "encoders", None),
    ("CLIP: towers + loss in one graph, CUDA graphs", "clip", 256, "step+cudagraphs", None),
    ("Codebook-CLIP: encoders compiled (il_clip --compile)", "codebook", 256, "encoders", None),
    ("Codebook-CLIP: one graph, 2^27 scores per chunk", "codebook", 256, "step", 1 << 27),
    ("CLIP: encoders compiled (il_clip --compile)", "clip", 128, "encoders", None),
    ("CLIP: towers + loss in one graph, CUDA graphs", "clip", 128, "step+cudagraphs", None),
    ("CLIP: towers + loss in one graph", "clip", 256, "step", None),
    ("CLIP: towers + loss in one graph", "clip", 512, "step", None),
]


def bench_levers(args, device):
    """Each LEVERS row timed alone (--steps after --untimed, one round), printed as soon as
    measured, so a cut-off run still reports its first rows; with --json, a report."""
    import platform
    default_budget = il_clip.CODE_SCORES_PER_CHUNK
    rows, clip_ms = [], {}
    print(f"| {args.model}, {args.dtype}, {device_name(device)}, torch {torch.__version__} "
          f"| batch | step | samples/s | MFU | peak memory | / CLIP (same batch, baseline) |\n"
          f"|---|---|---|---|---|---|---|", flush=True)
    for label, method, batch, lever, budget in LEVERS:
        run = argparse.Namespace(**{**vars(args), "batch_size": batch, "lever": lever,
                                    "compile": True})
        il_clip.CODE_SCORES_PER_CHUNK = budget or default_budget
        try:
            res = run_trainer(run, method, device)
        finally:
            il_clip.CODE_SCORES_PER_CHUNK = default_budget
        ms, sps = res["step_s"] * 1e3, batch / res["step_s"]
        mfu = lifecycle.estimate_mfu(res["cfg"], sps, device)
        if method == "clip" and lever == "encoders":
            clip_ms[batch] = ms
        ratio = f"{ms / clip_ms[batch]:.3f}x" if method != "clip" and batch in clip_ms else ""
        print(f"| {label} | {batch} | {ms:.1f} ms | {sps:,.0f} | "
              f"{'-' if mfu is None else f'{mfu:.1%}'} | "
              f"{fmt_bytes(res['peak_bytes'])} | {ratio} |", flush=True)
        rows.append({"label": label, "method": method, "batch": batch, "compiled": lever,
                     "chunk_scores": budget, "step_ms": ms, "samples_per_s": sps, "mfu": mfu,
                     "peak_bytes": res["peak_bytes"]})
        del res
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
    if args.json:
        report = {"device": device_name(device), "torch": torch.__version__,
                  "python": platform.python_version(),
                  "command": "python bench.py " + " ".join(args.argv), "rows": rows}
        lifecycle.atomic_write(args.json, lambda p: lifecycle.save_json(p, report))
    return 0


# --targets: every speed target measured in one run and checked against its threshold
# (key, what is measured, comparison, threshold on a GPU, threshold on the CPU;
# None = not a target there)
TARGETS = [
    ("clip_mfu", "CLIP MFU (dense bf16 peak)", ">=", 0.35, None),
    ("codebook_over_clip", "Codebook-CLIP step time / CLIP step time", "<=", 1.15, None),
    ("il_over_codebook", "IL average step (paper schedule) / Codebook-CLIP step", "<=", 1.02, None),
    ("vs_open_clip", "samples/s, il_clip CLIP / open_clip CLIP + ClipLoss", ">=", 1.2, 1.0),
    ("codebook_head_bytes", "codebook head peak memory, B=256 P=49 K=16384 D=512", "<", 1e9, 1e9),
]
OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, "<": lambda a, b: a < b}


def target_rows(values, gpu):
    """Per target: value, this machine kind's threshold and verdict (None:
    not measured / not a target)."""
    rows = []
    for key, what, op, on_gpu, on_cpu in TARGETS:
        threshold, value = (on_gpu if gpu else on_cpu), values.get(key)
        ok = None if threshold is None or value is None else bool(OPS[op](value, threshold))
        rows.append({"key": key, "what": what, "op": op,
                     "threshold": threshold, "value": value, "ok": ok})
    return rows


def bench_targets(args, device):
    """CLIP, Codebook-CLIP, IL (and open_clip when installed), fastest of --rounds, and the codebook
    head's peak memory: a table and, with --json, a report."""
    import dataclasses
    import platform
    methods = ["clip", "codebook", "il"] + (["open_clip"] if import_open_clip() else [])
    res = alternating_rounds(args, device, methods)
    clip_step = res["clip"]["step_s"]
    head_bytes, head_kind = head_peak(256, 49, 16384, 512, False, device)
    rows = target_rows({
        "clip_mfu": lifecycle.estimate_mfu(res["clip"]["cfg"], args.batch_size / clip_step, device),
        "codebook_over_clip": res["codebook"]["step_s"] / clip_step,
        "il_over_codebook": res["il"]["step_s"] / res["codebook"]["step_s"],
        # samples/s ratio = inverse step-time ratio (same batch)
        "vs_open_clip": res["open_clip"]["step_s"] / clip_step if "open_clip" in res else None,
        "codebook_head_bytes": head_bytes}, device.type == "cuda")
    print(f"codebook head (B=256, P=49, K=16384, D=512, fp32) peak {fmt_bytes(head_bytes)} "
          f"[{head_kind}]")
    print(f"\ntargets on {device_name(device)}: {args.model}, batch {args.batch_size}, "
          f"{args.dtype}, K={res['codebook']['cfg'].codebook_size}"
          f"{', compiled' if args.compile else ''} "
          f"(the GPU thresholds are set for ViT-B-32, batch 256, bf16, K=16384)\n"
          f"| target | measured | threshold | met |\n|---|---|---|---|")

    def fmt(key, v):
        if v is None:
            return "-"
        if key == "codebook_head_bytes":
            return f"{v / 1e9:.2f} GB"
        if key == "clip_mfu":
            return f"{v:.1%}"
        return f"{v:.3f}x"

    for r in rows:
        thr = "-" if r["threshold"] is None else f"{r['op']} {fmt(r['key'], r['threshold'])}"
        verdict = {True: "yes", False: "**no**",
                   None: "n/a" if r["threshold"] is None else "not measured"}[r["ok"]]
        print(f"| {r['what']} | {fmt(r['key'], r['value'])} | {thr} | {verdict} |")
    judged = [r for r in rows if r["ok"] is not None]
    print(f"{sum(r['ok'] for r in judged)} of {len(judged)} targets met on this machine"
          + ("" if "open_clip" in res else " (open_clip not importable: no reference)"))
    if args.json:
        runs = {m: {k: (dataclasses.asdict(v) if k == "cfg" else v) for k, v in r.items()}
                for m, r in res.items()}
        report = {"device": device_name(device), "torch": torch.__version__,
                  "python": platform.python_version(),
                  "command": "python bench.py " + " ".join(args.argv),
                  "config": {k: getattr(args, k) for k in ("model", "batch_size", "dtype",
                                                           "compile", "steps", "untimed")},
                  "targets": rows, "runs": runs,
                  "codebook_head": {"bytes": head_bytes, "counted_by": head_kind}}
        # a reader never sees half a file
        lifecycle.atomic_write(args.json, lambda p: lifecycle.save_json(p, report))
    return 0


def main(argv=None):
    global il_clip      # --script: bench imports the script it measures
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default="tiny", choices=list(il_clip.MODEL_PRESETS))
    a("--method", default="clip", choices=["clip", "codebook", "il"])
    a("--batch_size", type=int, default=None, help="default: 64 for tiny, 256 otherwise")
    a("--codebook", type=int, default=None,
      help="K (default: 1024 for tiny, 16384 otherwise and for --codebook_memory)")
    a("--compile", action="store_true")
    a("--dtype", default=None, choices=["fp32", "bf16"], help="default: bf16 on CUDA, fp32 on CPU")
    a("--device", default=None, help="cpu | cuda (default: cuda when available)")
    a("--steps", type=int, default=10, help="timed steps")
    a("--untimed", type=int, default=3, help="steps run before timing starts (not an LR warm-up)")
    a("--rounds", type=int, default=2, help="--targets / --data: alternations, best kept")
    a("--data", nargs="?", const="jpeg", default=None,
      help="the loader alone: JPEG shards vs plain PIL, or an il_clip.py --data spec")
    a("--num_workers", type=int, default=None,
      help="--data / --data_wait: loader workers (default 2)")
    a("--images", type=int, default=256, help="--data / --data_wait: JPEGs in the shards")
    a("--feed", type=float, default=None, help="--data: the cores that this many samples/s take")
    a("--data_wait", action="store_true",
      help="il_clip on JPEG shards: the step time spent waiting for data")
    a("--codebook_memory", action="store_true", help="peak memory of the codebook head alone")
    a("--code_dim", type=int, default=512, help="--codebook_memory: D of codes and queries")
    a("--composer", action="store_true", help="level-batched vs node-by-node composition")
    a("--targets", action="store_true", help="measure every speed target and check each")
    a("--levers", action="store_true",
      help="CLIP and Codebook-CLIP steps with each MFU lever in turn (GPU)")
    a("--out", "--json", dest="json", default=None,
      help="--targets / --levers: also write the report to this JSON file")
    a("--seed", type=int, default=0, help="weights and synthetic batch of the timed steps")
    a("--script", default=None,
      help="time a fork's step: an il_clip.py-style script at PATH (default: il_clip.py)")
    args = p.parse_args(argv)
    if args.script:
        il_clip = lifecycle.import_script(None, __file__, args.script)[0]
    args.argv = sys.argv[1:] if argv is None else list(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    args.batch_size = (args.batch_size
                       or (64 if args.model == "tiny" and not args.codebook_memory else 256))
    modes = {"data": bench_data, "codebook_memory": bench_codebook_memory,
             "composer": bench_composer, "targets": bench_targets,
             "data_wait": bench_data_wait, "levers": bench_levers}
    mode = next((m for m in modes if getattr(args, m)), None)
    t0 = time.time()
    lifecycle.start_line(__file__, f"--{mode}" if mode else f"--method {args.method}", [
        f"--model {args.model}", f"batch {args.batch_size}", args.dtype, device_name(device),
        f"script {os.path.basename(il_clip.__file__)}",
        f"out {args.json or 'the lines on stdout'}"])
    if mode:
        code = modes[mode](args, device)
    else:
        report_train(args, run_trainer(args, args.method, device), device)
        code = 0
    wrote = [args.json] if args.json and mode in ("targets", "levers") else []
    lifecycle.done_line("measured", time.time() - t0, wrote)
    return code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (data.DataError, il_clip.ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
