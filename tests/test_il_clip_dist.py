"""torchrun (2 processes, gloo) gives the same losses and the same updated weights as one
process on the combined batch, for every method. One torchrun launch trains every method
(this file is its worker script); the single-process references run in the pytest process."""
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import il_clip as M  # noqa: E402

# eps 1e-3: AdamW's first steps are ~lr * sign(grad); a large eps keeps the update linear in
# the gradient, so float-rounding differences of the all-reduce cannot flip a sign
COMMON = ["--width", "32", "--layers", "1", "--heads", "2", "--embed_dim", "32", "--image_size", "32",
          "--patch_size", "8", "--batch_size", "8", "--code_dim", "32", "--log_interval", "1",
          "--eval_n", "0", "--warmup", "1", "--rewarm", "1", "--eps", "1e-3", "--lr", "1e-3",
          "--grad_clip", "1.0"]
IL = ["--codebook", "64", "--t_warm", "1", "--t_distill", "1", "--t_interact", "1", "--generations", "1",
      "--t_extend", "0"]
METHODS = {
    "clip": ["--method", "clip", "--max_steps", "2"],
    "codebook": ["--method", "codebook", "--codebook", "64", "--max_steps", "2"],
    "negclip": ["--method", "negclip", "--max_steps", "3"],
    "il": ["--method", "il"] + IL,                                       # warm-up, spawn+distill, interact
    # small buckets: many all-reduces launched from the backward hooks, across phase changes
    "il_neg_vision": ["--method", "il", "--negatives", "--spawn", "vision", "--accum", "2", "--bucket_mb", "0.005"] + IL,
    "il_buckets": ["--method", "il", "--bucket_mb", "0.005"] + IL + ["--t_warm", "2", "--t_distill", "2",
                                                                     "--t_interact", "2"],
}


def test_torchrun_two_ranks_equal_one_process(tmp_path):
    worker = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
         os.path.abspath(__file__), str(tmp_path / "ddp")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert worker.returncode == 0, worker.stderr[-3000:]
    from safetensors.torch import load_file
    for name, argv in METHODS.items():
        one = str(tmp_path / "one" / name)
        assert M.main(COMMON + argv + ["--out_dir", one]) == 0
        two = str(tmp_path / "ddp" / name)
        la = [json.loads(x) for x in open(os.path.join(one, "metrics.jsonl"))]
        lb = [json.loads(x) for x in open(os.path.join(two, "metrics.jsonl"))]
        assert [r["phase"] for r in la] == [r["phase"] for r in lb]
        for a, b in zip(la, lb):
            assert abs(a["loss"] - b["loss"]) < 1e-5, (name, a, b)
        wa, wb = load_file(os.path.join(one, "model.safetensors")), load_file(os.path.join(two, "model.safetensors"))
        assert json.load(open(os.path.join(two, "config.json")))["world_size"] == 2
        for k in wa:
            assert torch.allclose(wa[k], wb[k], rtol=1e-4, atol=1e-6), (name, k, (wa[k] - wb[k]).abs().max())


if __name__ == "__main__":        # torchrun worker: every method, one process group
    import torch.distributed as dist
    dist.init_process_group("gloo")
    out = sys.argv[1]
    for name, argv in METHODS.items():
        rc = M.main(COMMON + argv + ["--out_dir", os.path.join(out, name)])
        if rc != 0:
            sys.exit(rc)
    dist.destroy_process_group()


def test_grad_reducer_overlaps_backward_and_reduces_each_gradient_once(tmp_path):
    """GradReducer's bookkeeping on a one-rank gloo group (the collectives are identities; the
    two-rank numbers are the torchrun test above). Told world=2, it must halve every gradient
    exactly once. It must launch buckets from the backward hooks once it knows what to wait
    for, and it must stay exact when a phase freezes or unfreezes parameters."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                                    torch.nn.Tanh(), torch.nn.Linear(8, 2))
        red = M.GradReducer(model.parameters(), world=2, bucket_bytes=1)      # one parameter per bucket
        launched = []
        real_launch = red._launch
        red._launch = lambda idx: (launched.extend(idx), real_launch(idx))
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
        first = list(model[0].parameters())

        def step(frozen, accum=1):
            for p in first:
                p.requires_grad_(not frozen)
            model.zero_grad(set_to_none=True)
            for micro in range(accum):
                red.armed = micro == accum - 1
                model(x[micro::accum]).pow(2).sum().backward()
            ref = {p: p.grad.clone() for p in model.parameters() if p.grad is not None}
            during = len(launched)
            red.finish()
            reduced = list(launched)
            launched.clear()
            assert sorted(reduced) == sorted(set(reduced))                     # each gradient once
            assert {id(red.params[j]) for j in reduced} == {id(p) for p in ref}
            for p, g in ref.items():
                assert torch.equal(p.grad, g / 2)
            return during, len(ref)

        assert step(False) == (0, 6)            # nothing known yet: all reduced in finish()
        assert step(False, accum=2) == (6, 6)   # now every bucket goes out during backward
        during, n = step(True)                  # first layer frozen: the rest still overlaps
        assert n == 4 and during == 4 and first[0].grad is None
        assert step(False)[1] == 6              # unfrozen again: the new gradients are not lost
        assert step(False) == (6, 6)
    finally:
        dist.destroy_process_group()


def test_grad_reducer_rebuilds_buckets_in_the_order_backward_produces_gradients(tmp_path):
    """Like CLIP (text tower registered first, encoded last; the codebook used by both towers),
    tower `a` is registered first but run last, and `shared` feeds both. Reverse registration
    order would hold every bucket back until `shared`'s gradient, the very last one. After the
    first step the buckets follow the recorded arrival order: each goes out the moment its
    gradient arrives. A parameter frozen at that first step is bucketed after the others; once
    unfrozen it is reduced exactly once, and its first gradient rebuilds the buckets again."""
    import torch.distributed as dist
    from torch import nn

    class TwoTowers(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
            self.b = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
            self.shared = nn.Parameter(torch.ones(4))

        def forward(self, x):
            hb = self.b(x * self.shared)
            return (self.a(x * self.shared) * hb).sum()

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = TwoTowers()
        red = M.GradReducer(model.parameters(), world=2, bucket_bytes=1)       # one parameter per bucket
        arrivals, launches = [], []          # param index per hook call; (hooks so far, bucket) per launch
        for j, p in enumerate(red.params):   # registered after the reducer's hooks: runs after them
            p.register_post_accumulate_grad_hook(lambda _p, j=j: arrivals.append(j))
        real_launch = red._launch
        red._launch = lambda idx: (launches.append((len(arrivals), sorted(idx))), real_launch(idx))
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))

        by_param = {id(p): j for j, p in enumerate(red.params)}

        def step(frozen=()):
            for p in model.parameters():
                p.requires_grad_(id(p) not in {id(f) for f in frozen})
            model.zero_grad(set_to_none=True)
            arrivals.clear(), launches.clear()
            red.armed = True
            model(x).backward()
            ref = {p: p.grad.clone() for p in model.parameters() if p.grad is not None}
            during = [(h, idx) for h, idx in launches]
            red.finish()
            assert sorted(j for _, idx in launches for j in idx) == sorted(by_param[id(p)] for p in ref)
            for p, g in ref.items():
                assert torch.equal(p.grad, g / 2)
            return during, list(arrivals)

        frozen = tuple(model.b[0].parameters())
        assert step(frozen)[0] == []                    # first step: order unknown, all in finish()
        shared, b0 = by_param[id(model.shared)], [by_param[id(p)] for p in frozen]
        assert red.rebuilds == 1 and red.buckets[-3:] == [[shared], [b0[1]], [b0[0]]]
        a_params = {by_param[id(p)] for p in model.a.parameters()}
        assert {j for b in red.buckets[:4] for j in b} == a_params     # tower a: registered first, run last
        during, arrived = step(frozen)                  # same set: every bucket at its gradient's arrival
        assert during == [(i, [j]) for i, j in enumerate(arrived)] and len(arrived) == 7
        during, arrived = step()                        # unfrozen: b0's first gradients, reduced once
        assert red.rebuilds == 2 and len(arrived) == 9
        during, arrived = step()
        # every bucket at its own gradient's arrival (the hook count there is its position)
        assert during == [(i, [j]) for i, j in enumerate(arrived)] and arrived[-1] == shared
        assert red.rebuilds == 2
    finally:
        dist.destroy_process_group()


def test_sigterm_to_one_rank_stops_every_rank_and_resumes(tmp_path):
    """il_clip.py under torchrun: SIGTERM to rank 1 alone; the ranks agree on it at the next log
    step, a checkpoint is saved, all exit 0, and --resume continues from it."""
    from conftest import sigterm_one_rank
    out = str(tmp_path / "s")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                os.path.join(ROOT, "il_clip.py")] + COMMON + ["--method", "clip", "--out_dir", out]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    rc, _, stderr = sigterm_one_rank(torchrun + ["--max_steps", "100000"], os.path.join(out, "metrics.jsonl"),
                                     env=env)
    assert rc == 0, stderr[-3000:]
    step = json.load(open(os.path.join(out, "train_state.json")))["step"]
    assert 0 < step < 100000 and f"sigterm: step {step}/100000" in stderr
    r = subprocess.run(torchrun + ["--max_steps", str(step + 1), "--resume"], env=env, capture_output=True,
                       text=True, timeout=180, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.load(open(os.path.join(out, "train_state.json")))["step"] == step + 1
