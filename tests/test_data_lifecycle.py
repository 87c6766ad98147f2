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
from conftest import read_figure

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


@pytest.mark.parametrize("hi,lo,span", [(1, 3.6381, 2e-4), (7, 0.512, 0.026), (400, 2.2, 4.7), (48000, 1e-4, 2e-4)])
def test_curves_read_as_their_data_with_whole_steps_and_distinct_labels(tmp_path, hi, lo, span):
    """draw_curves: each series is its points (a non-finite one leaves a gap), the steps are whole numbers from 0,
    no tick label repeats even on a nearly flat curve, markers on a short series, the legend and a mark's line on
    the canvas, the PNG written."""
    xs = sorted({0, hi // 3, hi // 2, hi})
    a = [(x, lo + span * i / len(xs)) for i, x in enumerate(xs)]
    b = [(x, lo + span * (1 - i / len(xs))) for i, x in enumerate(xs)]
    b[1] = (b[1][0], math.nan)
    png = str(tmp_path / "c.png")
    fig = lifecycle.draw_curves(png, "a title", [("a", a, {"color": "tab:red"}), ("b", b, {"color": "tab:blue"})],
                                marks=[(hi // 2, "gen 1"), (hi + 1, "beyond the last point")])
    (ax,) = read_figure(fig)
    assert Image.open(png).size == (900, 420)
    assert ax["title"] == "a title" and ax["xlabel"] == "step (optimizer steps)" and ax["ylabel"] == "loss (nats)"
    assert ax["legend"] == ["a", "b"] and ax["xlim"][0] == 0
    named = [(label, xs_, ys) for label, xs_, ys, _ in ax["lines"] if not label.startswith("_")]
    assert named == [("a", [p[0] for p in a], [p[1] for p in a]),
                     ("b", [p[0] for p in b if math.isfinite(p[1])], [p[1] for p in b if math.isfinite(p[1])])]
    assert all(line.get_marker() == "o" for label, *_, line in ax["lines"] if not label.startswith("_"))
    assert all(t.replace(",", "").isdigit() for t in ax["xticks"]) and len(ax["yticks"]) >= 3
    assert [t.get_text() for t in fig.axes[0].texts] == ["gen 1"]      # a mark beyond the data is left out


def test_a_long_series_has_no_markers_and_the_legend_stays_on_the_canvas(tmp_path):
    long_names = [f"series {i} with a long legend label that would be cut at a fixed right edge" for i in range(6)]
    fig = lifecycle.draw_curves(str(tmp_path / "c.png"), "t", [(n, [(s, s * (i + 1)) for s in range(200)], {})
                                                               for i, n in enumerate(long_names)])
    (ax,) = read_figure(fig)      # asserts the legend and every label lie on the canvas
    assert ax["legend"] == long_names and all(line.get_marker() in ("None", None, "") for *_, line in ax["lines"])


def test_start_and_done_lines_are_one_format_on_stderr(capsys):
    line = lifecycle.start_line("/x/y/il_clip.py", "--method il", ["2.00M parameters", "cpu x 1"], "out/a")
    assert line == "start: il_clip.py --method il | 2.00M parameters | cpu x 1 | out_dir out/a"
    assert lifecycle.start_line("data.py", "check", ["data shapes"], resumed_at=4) == \
        "start: data.py check | data shapes | resumed at step 4"
    done = lifecycle.done_line("step 3/3", 2.4, ["out/a/checkpoint/", "out/a/metrics.jsonl", "/abs/x.json"],
                               ["continue with: python il_clip.py --resume --out_dir out/a"])
    assert done == ("done: step 3/3 in 2s | wrote out/a/{checkpoint/, metrics.jsonl}, /abs/x.json | "
                    "continue with: python il_clip.py --resume --out_dir out/a")
    assert lifecycle.done_line("scored", 0) == "done: scored in 0s | wrote nothing"
    assert lifecycle.paths_text(["r.json"]) == "r.json"
    std = capsys.readouterr()
    assert std.out == "" and std.err.splitlines() == [line, "start: data.py check | data shapes | resumed at step 4",
                                                      done, "done: scored in 0s | wrote nothing"]
    assert [lifecycle.percent(v) for v in (12.345, 0.05, 100, None)] == ["12.3", "0.1", "100.0", "null"]
    for warmup, steps in ((50, 20), (50, 50), (50, 0), (0, 5)):     # a note only where the peak is never reached
        lifecycle.warmup_note(warmup, steps)
    assert capsys.readouterr().err.splitlines() == [
        "note: --warmup 50 is longer than the run (20 steps): the learning rate rises to 40% of --lr and never "
        "reaches its peak (--warmup 2: 10% of the run)"]
