"""torchrun (2 processes, gloo) gives the same losses and the same updated weights as one
process on the combined batch, for every method and every IL phase, through torch's
DistributedDataParallel, also with a fork's loss term that uses parameters directly, and with a
SigLIP-style bias that the distill phase leaves unused (find_unused_parameters=False). One torchrun
launch trains every method (this file is its worker script); the single-process references run in
the pytest process."""
import gc
import json
import os
import signal
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import il_clip as M  # noqa: E402

# eps 1e-3: AdamW's first steps are ~lr * sign(grad); a large eps keeps the update linear in
# the gradient, so float-rounding differences of the all-reduce cannot flip a sign
COMMON = ["--model_args", "width=32", "layers=1", "heads=2", "embed_dim=32", "image_size=32", "patch_size=8",
          "code_dim=32", "--batch_size", "8", "--log_interval", "1",
          "--eval_size", "0", "--warmup", "1", "--rewarm", "1", "--eps", "1e-3", "--lr", "1e-3",
          "--grad_clip", "1.0"]
IL = ["--codebook", "64", "--t_warm", "1", "--t_distill", "1", "--t_interact", "1", "--generations", "1",
      "--t_extend", "0"]
METHODS = {
    "clip": ["--method", "clip", "--max_steps", "2"],
    "codebook": ["--method", "codebook", "--codebook", "64", "--max_steps", "2"],
    "negclip": ["--method", "negclip", "--max_steps", "3"],
    # warm-up, spawn + distill (frozen vision + codebook), interact: one DDP wrapper throughout
    "il": ["--method", "il"] + IL[:4] + ["--t_distill", "2", "--t_interact", "1", "--generations", "2",
                                          "--t_extend", "0"],
    # gradient accumulation (no_sync on the first micro-batch), vision spawn, negatives
    "il_neg_vision": ["--method", "il", "--negatives", "--spawn", "vision", "--accum", "2"] + IL,
}


class RankOneBranch(M.CLIP):
    """A fork's data-dependent branch: an extra parameter that only rank 1 uses (StepLoss gives rank 0 a
    zero gradient for it: DDP needs no search for unused parameters)."""

    def __init__(self, cfg, seed=0):
        super().__init__(cfg, seed)
        self.branch = nn.Parameter(torch.zeros(cfg.embed_dim))

    def forward(self, images, text):
        img, txt, scale = super().forward(images, text)
        if torch.distributed.get_rank() == 1:
            img = F.normalize(img + self.branch, dim=-1)
        return img, txt, scale


class BiasCLIP(M.CLIP):
    """A fork's loss-only parameter: a learnable bias (as SigLIP's) that forward() never uses."""

    def __init__(self, cfg, seed=0):
        super().__init__(cfg, seed)
        self.logit_bias = nn.Parameter(torch.tensor(-1.0))


def with_extra_terms(compute_loss):
    """compute_loss plus terms that use parameters directly, outside the model's forward: the bias
    times the mean image value (linear in the batch: the mean over ranks is the whole batch's) and
    a weight penalty on the positional embedding. Outside DDP's forward, the bias fails on 2 ranks
    with "marked as ready twice"."""
    def loss_with_extra_terms(model, batch, *rest):
        loss, *out = compute_loss(model, batch, *rest)
        extra = model.logit_bias * batch["image"].float().mean() + 1e-2 * model.positional_embedding.square().sum()
        return loss + extra, *out
    return loss_with_extra_terms


def with_bias_outside_distill(compute_loss):
    """A SigLIP-style fork's bias term, in the contrastive phases only: distill's KD loss leaves the bias
    unused, yet it is trained (not frozen), so DDP (find_unused_parameters=False) waits for its gradient.
    StepLoss gives it a zero one, on 1 process as on 2 ranks."""
    def loss_with_bias(model, batch, phase, *rest):
        loss, *out = compute_loss(model, batch, phase, *rest)
        if phase != "distill":
            loss = loss + model.logit_bias * batch["image"].float().mean()
        return loss, *out
    return loss_with_bias


LOSS_TERMS = {"clip_bias": METHODS["clip"], "il_bias": METHODS["il"]}
SIGLIP = ("il_siglip", METHODS["il"])


def _weights(out_dir):
    from safetensors.torch import load_file
    return load_file(os.path.join(out_dir, "checkpoint", "model.safetensors"))


def test_torchrun_two_ranks_equal_one_process(tmp_path):
    worker = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
         os.path.abspath(__file__), str(tmp_path / "ddp")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert worker.returncode == 0, worker.stderr
    for name, argv in METHODS.items():
        _one_equals_two(tmp_path, name, argv)
    clip, real = M.CLIP, M.compute_loss
    M.CLIP, M.compute_loss = BiasCLIP, with_extra_terms(real)
    try:
        for name, argv in LOSS_TERMS.items():
            assert _one_equals_two(tmp_path, name, argv)["logit_bias"] != -1.0        # trained
        M.compute_loss = with_bias_outside_distill(real)
        assert _one_equals_two(tmp_path, *SIGLIP)["logit_bias"] != -1.0
    finally:
        M.CLIP, M.compute_loss = clip, real
    # a parameter used on rank 1 only trained without a hang or a size mismatch: DDP averaged
    # rank 1's gradient with rank 0's nothing
    branch = _weights(str(tmp_path / "ddp" / "branch"))["branch"]
    assert branch.abs().sum() > 0


def _one_equals_two(tmp_path, name, argv):
    one = str(tmp_path / "one" / name)
    assert M.main(COMMON + argv + ["--out_dir", one]) == 0
    two = str(tmp_path / "ddp" / name)
    la = [json.loads(x) for x in open(os.path.join(one, "metrics.jsonl"))]
    lb = [json.loads(x) for x in open(os.path.join(two, "metrics.jsonl"))]
    assert [r["phase"] for r in la] == [r["phase"] for r in lb]
    if name in ("il", "il_bias", "il_siglip"):
        assert [r["phase"] for r in la] == ["warmup", "distill", "distill", "interact",
                                            "distill", "distill", "interact"]
    for a, b in zip(la, lb):
        for k in ("loss", "clip", "logit_scale"):
            assert abs(a[k] - b[k]) < 1e-5, (name, k, a, b)
    wa, wb = _weights(one), _weights(two)
    assert json.load(open(os.path.join(two, "checkpoint", "config.json")))["world_size"] == 2
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-4, atol=1e-6), (name, k, (wa[k] - wb[k]).abs().max())
    return wa


if __name__ == "__main__":        # torchrun worker: every method, one process group
    import torch.distributed as dist
    dist.init_process_group("gloo")
    out = sys.argv[1]
    for name, argv in METHODS.items():
        rc = M.main(COMMON + argv + ["--out_dir", os.path.join(out, name)])
        if rc != 0:
            sys.exit(rc)
    M.CLIP = RankOneBranch
    rc = M.main(COMMON + ["--method", "clip", "--max_steps", "2", "--out_dir", os.path.join(out, "branch")])
    real = M.compute_loss
    M.CLIP, M.compute_loss = BiasCLIP, with_extra_terms(real)
    for name, argv in LOSS_TERMS.items():
        rc = rc or M.main(COMMON + argv + ["--out_dir", os.path.join(out, name)])
    M.compute_loss = with_bias_outside_distill(real)
    rc = rc or M.main(COMMON + SIGLIP[1] + ["--out_dir", os.path.join(out, SIGLIP[0])])
    gc.collect()    # the DDP wrappers (in reference cycles) hold the group: they go first
    dist.destroy_process_group()
    from conftest import gloo_threads_left
    if gloo_threads_left():     # nothing else held the group: its threads ended with it
        sys.exit(f"gloo threads still running after destroy_process_group: {gloo_threads_left()}")
    sys.exit(rc)


def test_sigterm_to_the_process_group_under_torchrun_with_workers_saves_and_resumes(tmp_path):
    """As torchrun's agent and SLURM do: SIGTERM to the whole process group (agent, both ranks,
    their 2 loader workers each). The ranks agree at the next sync point, rank 0 saves once,
    every rank exits 0, and --resume continues from the checkpoint."""
    out = str(tmp_path / "s")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                os.path.join(ROOT, "il_clip.py")] + COMMON + ["--method", "clip", "--num_workers", "2",
                                                              "--out_dir", out]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    p = subprocess.Popen(torchrun + ["--max_steps", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=ROOT, start_new_session=True)
    metrics, t0 = os.path.join(out, "metrics.jsonl"), time.time()
    while not (os.path.isfile(metrics) and os.path.getsize(metrics) > 0) and time.time() - t0 < 180:
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=180)
    step = torch.load(os.path.join(out, "checkpoint", "state.pt"), weights_only=True)["step"]
    assert 0 < step < 100000 and f"stopped by SIGTERM at step {step}/100000 | checkpoint saved" in stderr, \
        stdout + stderr
    assert "continue with: torchrun --nproc_per_node=2 il_clip.py --resume --out_dir" in stderr, stderr
    assert 'il_clip.py", line' not in stderr, stderr      # no traceback through a rank (the agent's may follow)
    assert "exitcode  : 1" not in stderr and "ChildFailedError" not in stderr, stderr
    torchrun = torchrun[:torchrun.index(os.path.join(ROOT, "il_clip.py")) + 1]
    r = subprocess.run(torchrun + ["--resume", "--out_dir", out, "--stop_at", str(step + 1)], env=env,
                       capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert torch.load(os.path.join(out, "checkpoint", "state.pt"), weights_only=True)["step"] == step + 1


def test_torchrun_il_prints_no_warnings(tmp_path):
    """Every IL phase under torchrun (gloo) without a warning: no deprecated collective, and DDP,
    re-wrapped per trainable set, never asked to search for unused parameters it does not have."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                        os.path.join(ROOT, "il_clip.py")] + COMMON + ["--method", "il", "--negatives"] + IL
                       + ["--generations", "2", "--out_dir", str(tmp_path / "w")],
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}, cwd=ROOT,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert "warn" not in r.stderr.lower() and "deprecat" not in r.stderr.lower(), r.stderr
    assert [json.loads(x)["phase"] for x in open(tmp_path / "w" / "metrics.jsonl")] == [
        "warmup", "distill", "interact", "distill", "interact"]
