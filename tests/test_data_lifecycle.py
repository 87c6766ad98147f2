"""data.py's run lifecycle (lock, checkpoints, fallback, RNG, resume flags, metrics, signals, plots), checked
directly; the training scripts' tests check it again end to end through each script."""
import errno
import json
import math
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image

import data
import lifecycle

TYPES = {"step": int, "optimizer": dict, "rng": dict}


class Tok:
    def save(self, folder):
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            f.write("{}")


def trained_state(step):
    torch.manual_seed(step)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, {"step": step, "optimizer": opt.state_dict(), "rng": lifecycle.rng_state("cpu")}


def test_save_load_round_trip_and_fallback(tmp_path, capsys):
    out = str(tmp_path)
    for step in (3, 4):
        model, state = trained_state(step)
        lifecycle.save_checkpoint(out, model.state_dict(), state, {"step": step}, Tok(), step)
    assert sorted(os.listdir(tmp_path / "checkpoint")) == sorted([*lifecycle.CHECKPOINT_FILES, "sha256.json"])
    folder, weights, st, config, damaged = lifecycle.load_checkpoint(out, TYPES)
    assert (folder, st["step"], config, damaged) == (str(tmp_path / "checkpoint"), 4, {"step": 4}, False)
    assert torch.equal(weights["weight"], model.weight.detach())
    assert torch.equal(st["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    with open(tmp_path / "checkpoint" / "model.safetensors", "r+b") as f:   # one flipped byte in the weights
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    folder, _, st, _, damaged = lifecycle.load_checkpoint(out, TYPES)
    assert (folder, st["step"], damaged) == (str(tmp_path / "checkpoint.prev"), 3, True)
    assert "damaged" in capsys.readouterr().err
    model, state = trained_state(5)     # saving over a damaged newest keeps the good previous one
    lifecycle.save_checkpoint(out, model.state_dict(), state, {}, Tok(), 5, newest_damaged=True)
    assert lifecycle.load_checkpoint(str(tmp_path), TYPES)[2]["step"] == 5
    assert lifecycle.read_checkpoint(str(tmp_path / "checkpoint.prev"), TYPES)[1]["step"] == 3


def test_unusable_checkpoints_name_the_files(tmp_path):
    model, state = trained_state(1)
    lifecycle.save_checkpoint(str(tmp_path), model.state_dict(), state, {}, None, 1)
    with pytest.raises(data.DataError, match=r"state.pt: wrong types \(expected extra: list\)"):
        lifecycle.load_checkpoint(str(tmp_path), TYPES | {"extra": list})
    os.remove(tmp_path / "checkpoint" / "config.json")
    with pytest.raises(data.DataError, match=r"config.json: missing"):
        lifecycle.load_checkpoint(str(tmp_path), TYPES)


def test_write_error_is_one_line_and_keeps_the_previous(tmp_path, monkeypatch):
    model, state = trained_state(1)
    lifecycle.save_checkpoint(str(tmp_path), model.state_dict(), state, {}, Tok(), 1)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(data.DataError) as e:
        lifecycle.save_checkpoint(str(tmp_path), model.state_dict(), state, {}, Tok(), 2)
    assert "no space left on device for the step-2 checkpoint" in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "checkpoint.tmp")
    monkeypatch.undo()
    assert lifecycle.load_checkpoint(str(tmp_path), TYPES)[2]["step"] == 1


def test_file_size_limit_is_one_line(tmp_path):
    """A real RLIMIT_FSIZE hit inside state.pt (torch.save to a path would fail with no errno to name)."""
    code = ("import resource, sys, torch, data, lifecycle, test_data_lifecycle as t\n"
            "model, state = t.trained_state(1)\n"
            "state['pad'] = torch.zeros(1 << 18)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (600_000, 600_000))\n"
            "try:\n    lifecycle.save_checkpoint(sys.argv[1], model.state_dict(), state, {}, None, 1)\n"
            "except data.DataError as e:\n    print(e)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(data.__file__), os.path.dirname(__file__)]))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env)
    assert (out.stdout.strip().endswith("the previous checkpoint is kept")
            and "file too large for the step-1" in out.stdout)
    assert not os.path.exists(tmp_path / "checkpoint.tmp")


def test_claim_out_dir(tmp_path):
    out = str(tmp_path / "run")
    with pytest.raises(data.DataError, match="nothing to resume"):
        lifecycle.claim_out_dir(out, 0, 1, "cpu", resume=True)
    lifecycle.release_out_dir()
    model, state = trained_state(1)
    lifecycle.save_checkpoint(out, model.state_dict(), state, {}, None, 1)
    open(os.path.join(out, "metrics.jsonl"), "w").close()
    open(os.path.join(out, "notes.txt"), "w").close()
    with pytest.raises(data.DataError, match="--overwrite"):
        lifecycle.claim_out_dir(out, 0, 1, "cpu")
    lifecycle.claim_out_dir(out, 0, 1, "cpu", overwrite=True, run_files=(r"checkpoint(\..*)?", r"metrics\.jsonl"))
    assert sorted(os.listdir(out)) == [".lock", "config.json", "notes.txt"]
    holder = subprocess.Popen([sys.executable, "-c", "import sys, lifecycle\n"
                               "lifecycle.claim_out_dir(sys.argv[1], 0, 1, 'cpu');"
                               " print('held', flush=True); sys.stdin.read()", out], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(data.__file__))
    lifecycle.release_out_dir()      # let the child take it
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(data.DataError, match=f"in use by another run: process {holder.pid} holds"):
            lifecycle.claim_out_dir(out, 0, 1, "cpu", resume=True)
    finally:
        holder.communicate("")


def test_rng_state_round_trip():
    st = lifecycle.rng_state("cpu")
    drawn = (torch.rand(3), np.random.rand(3), random.random())
    lifecycle.set_rng_state(st, "cpu")
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(drawn[0], again[0]) and np.array_equal(drawn[1], again[1]) and drawn[2] == again[2]
    st["numpy"][1] = st["numpy"][1].tolist()    # the older checkpoints' plain list
    lifecycle.set_rng_state(st, "cpu")
    assert np.array_equal(np.random.rand(3), drawn[1])


def test_resumed_flags():
    saved = {"lr": 1e-3, "seed": 0, "max_steps": 10, "out_dir": "a"}
    assert lifecycle.resumed_flags({"max_steps": 10, "out_dir": "b"}, saved, {"out_dir"}, "x") == {"lr": 1e-3, "seed": 0}
    with pytest.raises(data.DataError, match=r"--lr 0.01 differs from the saved run's 0.001 \(x\)"):
        lifecycle.resumed_flags({"lr": 0.01}, saved, {"out_dir"}, "x")


def test_cut_metrics_and_log_record(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    recs = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)] + [{"step": 3, "phase": "eval", "acc": 1}]
    for r in recs:
        lifecycle.log_record(path, r)
    lifecycle.cut_metrics(path, 2)
    assert [json.loads(ln) for ln in open(path)] == [r for r in recs if r["step"] <= 2 and "phase" not in r]


def test_cut_metrics_keeps_the_old_file_when_the_flush_at_close_fails(tmp_path, monkeypatch):
    """A full disk often shows only when the buffered data is flushed, at close: the cut file must not replace
    metrics.jsonl then (an unclosed file's failed flush is swallowed at garbage collection)."""
    import builtins
    path = str(tmp_path / "metrics.jsonl")
    for s in (1, 2, 3):
        lifecycle.log_record(path, {"step": s})
    before, real = open(path).read(), builtins.open

    class FlushFailsAtClose:        # buffers the writes; close() fails as a flush to a full disk does
        def __init__(self, f):
            self.f = f

        def write(self, text):
            return len(text)

        def close(self):
            self.f.close()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()
    monkeypatch.setattr(builtins, "open", lambda p, mode="r", *a, **k: FlushFailsAtClose(real(p, mode, *a, **k))
                        if "w" in mode else real(p, mode, *a, **k))
    with pytest.raises(data.DataError, match="cannot write: no space left on device"):
        lifecycle.cut_metrics(path, 2)
    monkeypatch.undo()
    assert open(path).read() == before and os.listdir(tmp_path) == ["metrics.jsonl"]


def test_stop_signals():
    old = lifecycle.catch_stop_signals()
    try:
        assert lifecycle.stop_requested() is None
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert lifecycle.stop_requested() == "SIGINT"
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert lifecycle.stop_requested() == "SIGTERM"
    finally:
        lifecycle.restore_signals(old)
    assert signal.getsignal(signal.SIGTERM) == old[signal.SIGTERM]


@pytest.mark.parametrize("lo,hi,integer", [(0, 7, True), (0, 1234, True), (0.512, 0.538, False), (2.2, 6.9, False)])
def test_ticks_are_round_distinct_and_inside(lo, hi, integer):
    ticks = lifecycle.nice_ticks(lo, hi, integer=integer)
    assert 2 <= len(ticks) <= 11 and all(lo - 1e-9 <= t <= hi + 1e-9 for t in ticks)
    steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:])}
    assert len(steps) == 1
    step = steps.pop()
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(abs(mantissa - m) < 1e-6 for m in (1, 2, 5)) and (not integer or step == int(step))
    labels = lifecycle.tick_labels(ticks)
    assert len(set(labels)) == len(labels)


def test_draw_curves(tmp_path):
    png = str(tmp_path / "c.png")
    red, blue = (200, 0, 0), (0, 0, 200)
    lifecycle.draw_curves(png, "t", [("a", red, [(0, 1.0), (5, math.nan), (10, 2.0)], 2), ("b", blue, [(0, 2), (10, 1)], 2)],
                     vlines=[(5, "gen 1", (0, 150, 0))])
    img = Image.open(png).convert("RGB")
    colours = {c for _, c in img.getcolors(1 << 20)}
    assert img.size == (900, 420) and {red, blue, (0, 150, 0)} <= colours
