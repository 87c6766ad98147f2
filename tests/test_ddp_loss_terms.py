"""A fork's loss terms that use parameters directly (a learnable bias that the model's forward never
uses, a weight penalty) train under torchrun (2 processes, gloo) and equal one process, in
composer.py and mm_learngene.py (il_clip.py: test_il_clip_dist.py). Each script runs its loss inside
the forward() that DistributedDataParallel wraps (StepLoss). This file is also the torchrun worker."""
import json
import os
import subprocess
import sys

import torch
import torch.nn as nn
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import composer as C  # noqa: E402
import mm_learngene as MM  # noqa: E402
from test_composer import TRAIN  # noqa: E402
from test_mm_learngene import EXTRACT, teacher  # noqa: E402, F401 (fixture)


def add_bias(model):
    model.logit_bias = nn.Parameter(torch.tensor(-1.0))     # registered: trained, saved, synced by DDP
    return model


def extra_terms(model, batch_mean):
    """The bias times a statistic of this rank's batch (linear: its mean over ranks is the whole
    batch's, as the loss's) and a weight penalty on the model's first parameter."""
    return model.logit_bias * batch_mean + 1e-2 * next(model.parameters()).square().sum()


def composer_patches():
    real_model, real_step = C.make_model, C.train_step

    def make_model(*a):
        model, cfg = real_model(*a)
        return add_bias(model), cfg

    def train_step(model, compiler, sp, gidx, rank, world, step, args, device):
        loss, parts = real_step(model, compiler, sp, gidx, rank, world, step, args, device)
        return loss + extra_terms(model, gidx[rank::world].float().mean() / len(gidx)), parts
    return {"make_model": make_model, "train_step": train_step}


def mm_patches(rank0_only=False):
    """The extra terms in every step; `rank0_only`: only rank 0's steps use the bias (a branch
    that one rank's batch skips)."""
    class BiasAuxCLIP(MM.AuxCLIP):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            add_bias(self)
    real_phase = MM.train_phase

    def train_phase(model, loss_fn, *a, **k):
        def loss_with_terms(m, batch):
            loss, parts = loss_fn(m, batch)
            if rank0_only and int(os.environ.get("RANK", 0)):
                return loss, parts
            return loss + extra_terms(m, batch["image"].float().mean()), parts
        return real_phase(model, loss_with_terms, *a, **k)
    return {"AuxCLIP": BiasAuxCLIP, "train_phase": train_phase}


COMPOSER = ["train", "--max_steps", "4"] + TRAIN
RUNS = {"composer": (C, composer_patches, lambda teacher, out: COMPOSER + ["--out_dir", out]),
        "mm": (MM, mm_patches, lambda teacher, out: EXTRACT + ["--teacher", teacher, "--out_dir", out]),
        "mm_rank0": (MM, lambda: mm_patches(rank0_only=True),
                     lambda teacher, out: EXTRACT + ["--teacher", teacher, "--out_dir", out])}


def torchrun(name, teacher, out):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           os.path.abspath(__file__), name, str(teacher), str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _losses(out):
    return [r["loss"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "loss" in r]


def test_loss_terms_on_parameters_train_under_torchrun(teacher, tmp_path, monkeypatch):  # noqa: F811
    for name in ("composer", "mm"):
        module, patches, argv = RUNS[name]
        r = torchrun(name, teacher, tmp_path / "two" / name)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr   # the failing rank's whole message
        assert "Warning" not in r.stderr and "warn" not in r.stderr.lower(), r.stderr    # no deprecation or DDP warning
        with monkeypatch.context() as m:
            for k, v in patches().items():
                m.setattr(module, k, v)
            module.main(argv(str(teacher), str(tmp_path / "one" / name)))
        one, two = (str(tmp_path / run / name) for run in ("one", "two"))
        la, lb = _losses(one), _losses(two)
        assert len(la) == len(lb) > 1
        # the global batch's loss is logged (every rank's mean), as one process computes it
        assert all(abs(a - b) < 1e-5 * max(1.0, abs(a)) for a, b in zip(la, lb)), (la, lb)
        wa, wb = (load_file(os.path.join(d, "checkpoint", "model.safetensors")) for d in (one, two))
        assert wa["logit_bias"] != -1.0, name                     # trained
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], atol=1e-3, rtol=1e-3, msg=f"{name} {k}")


def test_a_parameter_one_rank_leaves_unused_trains(teacher, tmp_path):  # noqa: F811
    """mm_learngene under torchrun: only rank 0's steps use the bias. DDP gets a (zero) gradient for
    it from rank 1 too, so it trains (from rank 0's half of the mean) instead of a gloo error."""
    r = torchrun("mm_rank0", teacher, tmp_path)
    assert r.returncode == 0 and "Warning" not in r.stderr, r.stdout[-2000:] + r.stderr
    w = load_file(os.path.join(tmp_path, "checkpoint", "model.safetensors"))
    assert w["logit_bias"] != -1.0


if __name__ == "__main__":           # torchrun worker: NAME TEACHER OUT_DIR, trained with the extra terms
    module, patches, argv = RUNS[sys.argv[1]]
    for k, v in patches().items():
        setattr(module, k, v)
    module.main(argv(sys.argv[2], sys.argv[3]))
    from conftest import gloo_threads_left
    if gloo_threads_left():     # main() ended the process group, its threads with it
        sys.exit(f"gloo threads still running after main(): {gloo_threads_left()}")
