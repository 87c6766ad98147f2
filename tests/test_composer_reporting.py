"""composer.py's reporting (issue 39 items 4-7, notes/reporting.md): start and end lines and no JSON per log step on
stdout, metrics.jsonl's common schema with the loss as the mean over the log interval (resumed runs log the same),
metric names in percent, the loss plot's ticks, --help grouped with defaults, and --wandb (a fake module always, the
real package in offline mode when installed)."""
import importlib.machinery
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import read_figure, require_real_wandb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import composer as C  # noqa: E402
import data  # noqa: E402

pytest.importorskip("data")

TRAIN = ["--train_size", "48", "--eval_size", "8", "--batch_size", "8", "--width", "32", "--heads", "2",
         "--ct_layers", "3", "--warmup", "2", "--save_interval", "100", "--dtype", "fp32", "--n_neg_img", "2",
         "--n_neg_txt", "1", "--vocab_size", "300"]


def records(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def test_start_and_end_lines_and_the_metrics_schema(tmp_path, capsys):
    out = str(tmp_path / "run")
    C.main(["--out_dir", out, "--max_steps", "6", "--log_interval", "3"] + TRAIN)
    std = capsys.readouterr()
    lines = std.err.strip().splitlines()
    assert std.out == "" and len(lines) == 2, lines     # no JSON line per log step; the talk on stderr
    assert lines[0].startswith("start: composer.py train --method composer | ") and " parameters | cpu x 1 | " in \
        lines[0] and "| data shapes (48 train captions / 48 images" in lines[0] and lines[0].endswith(f"out_dir {out}")
    ev = records(out)[-1]["in_domain"]
    assert re.fullmatch(rf"done: step 6/6 \(in_domain t2i_r1 {ev['t2i_r1']:.1f}, t2i_r5 {ev['t2i_r5']:.1f}\) in \d+s "
                        rf"\| wrote {re.escape(out)}/\{{checkpoint/, metrics.jsonl, loss_curve.png\}}", lines[1]), lines
    recs = records(out)
    assert [(r["step"], r["phase"]) for r in recs] == [(3, "train"), (6, "train"), (6, "eval")]
    for r in recs:
        assert isinstance(r["step"], int) and isinstance(r["time"], float)
        assert ("loss" in r and "lr" in r) == (r["phase"] == "train")
    ev = recs[-1]["in_domain"]
    assert recs[-1]["final"] and {"t2i_r1", "t2i_r5", "t2i_r10", "p2i_r1", "p2i_r5", "p2i_r10"} <= set(ev)
    assert all(0 <= ev[k] <= 100 for k in ev if "_r" in k) and ev["t2i_r10"] == 100.0    # 8 images: percent
    # the logged loss is the mean of the interval's global-batch losses (the same run logged at every step)
    ref = str(tmp_path / "ref")
    C.main(["--out_dir", ref, "--max_steps", "6", "--log_interval", "1"] + TRAIN)
    per_step = [r for r in records(ref) if r["phase"] == "train"]
    for r in recs[:2]:
        steps = per_step[r["step"] - 3:r["step"]]
        for k in ("loss", "match", "mvsa", "order"):
            assert r[k] == pytest.approx(np.mean([s[k] for s in steps]), abs=2e-6), k


def test_a_resumed_run_logs_the_same_interval_means(tmp_path, capsys):
    """Stopped mid-interval (step 2 of 4), the sums so far are saved with the checkpoint: --resume logs what the
    uninterrupted run logs."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    C.main(["--out_dir", a, "--max_steps", "8", "--log_interval", "4"] + TRAIN)
    C.main(["--out_dir", b, "--max_steps", "8", "--log_interval", "4", "--stop_at", "2"] + TRAIN)
    C.main(["--resume", "--out_dir", b])
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("time", "samples_per_s")} for r in rs]
    assert strip(records(a)) == strip(records(b)) and len(records(a)) == 3
    capsys.readouterr()


def test_the_loss_curve_has_every_term_with_markers_at_few_points(tmp_path):
    """loss_curve.png of a short run (5 logged steps): the total and its three terms, each line the metrics.jsonl
    values with a marker at every point, whole-number steps from 0, a legend on the canvas."""
    rows = [{"step": s, "phase": "train", "loss": 3.0 - s / 10, "match": 2.0 - s / 20, "mvsa": 0.9, "order": 0.1 * s,
             "lr": 1e-3, "time": 0.0} for s in (1, 2, 3, 4, 5)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows + [{"step": 5, "phase": "eval", "time": 0.0}]))
    args = C.parse_args(["--out_dir", str(tmp_path / "run")])
    (ax,) = read_figure(C.draw_loss_curve(str(metrics), str(tmp_path / "c.png"), args))
    assert ax["legend"] == ["composer (total)", "l_match", "l_mvsa", "l_order"]
    assert ax["xlabel"] == "step (optimizer steps)" and ax["ylabel"].startswith("loss (")
    for (label, xs, ys, line), key in zip(ax["lines"], ("loss", "match", "mvsa", "order")):
        assert xs == [1, 2, 3, 4, 5] and ys == pytest.approx([r[key] for r in rows]) and line.get_marker() == "o"
    assert ax["xlim"][0] == 0 and ax["xticks"] == ["0", "1", "2", "3", "4", "5"]


def test_eval_prints_a_table_between_its_start_and_done_lines(tmp_path, capsys):
    out = str(tmp_path / "run")
    C.main(["--out_dir", out, "--max_steps", "2"] + TRAIN)
    capsys.readouterr()
    res = C.main(["eval", "--ckpt", out, "--eval_size", "6", "--out", str(tmp_path / "e.json")])
    std = capsys.readouterr()
    err = [ln for ln in std.err.splitlines() if not ln.startswith("model: ")]  # the code it runs
    assert err[0] == f"start: composer.py eval | {out} (composer) | " + err[0].split(" | ", 2)[2]
    assert err[0].endswith(f" | cpu x 1 | data shapes | out {tmp_path / 'e.json'}")
    assert re.fullmatch(rf"done: test evaluated in \d+s \| wrote {re.escape(str(tmp_path / 'e.json'))}", err[-1])
    table = std.out.splitlines()
    head = table[0].strip("| ").split(" | ")
    row = dict(zip(head, table[2].strip("| ").split(" | ")))
    assert row["split"] == "test" and row["images"] == "6" and row["t2i_r1"] == f"{res['test']['t2i_r1']:.1f}"
    assert json.loads((tmp_path / "e.json").read_text()) == res


def test_help_is_grouped_and_shows_defaults(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")    # argparse wraps help at the terminal's width

    def help_text(cmd):
        with pytest.raises(SystemExit) as e:
            C.main([cmd, "--help"])
        assert e.value.code == 0
        return capsys.readouterr().out

    for cmd, groups in (("train", ["data", "model", "method", "schedule", "optimisation", "machine", "output"]),
                        ("eval", ["checkpoint and data", "evaluation", "machine and output"]),
                        ("mcd", ["training set and pool", "split", "output"])):
        text = help_text(cmd)
        assert all(f"\n{g}:\n" in text for g in groups), text
        assert "(default: None)" not in text and "(default: False)" not in text
    assert "--lr LR peak learning rate (AdamW) (default: 0.001)" in " ".join(help_text("train").split())


FAKE_WANDB = '''
import json, os
LOG = os.environ["FAKE_WANDB_LOG"]
def _rec(*call):
    with open(LOG, "a") as f:
        f.write(json.dumps(call) + "\\n")
def init(**kw):
    _rec("init", kw)
def log(rec, step=None):
    _rec("log", rec, step)
def finish():
    _rec("finish")
'''


def _train(argv, env):
    return subprocess.run([sys.executable, os.path.join(ROOT, "composer.py")] + argv, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env}, cwd=ROOT, timeout=300)


def test_wandb_gets_every_metrics_record_with_a_fake_module(tmp_path, monkeypatch):
    """A stand-in `wandb` module (imported in place of the real one, installed or not) records every call."""
    log, out = tmp_path / "calls.jsonl", str(tmp_path / "run")
    monkeypatch.setenv("FAKE_WANDB_LOG", str(log))
    fake = type(sys)("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)   # composer.py checks with find_spec first
    exec(FAKE_WANDB, fake.__dict__)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    C.main(["--out_dir", out, "--max_steps", "4", "--log_interval", "2", "--stop_at", "2", "--wandb", "proj"] + TRAIN)
    C.main(["--resume", "--out_dir", out])     # continues the same W&B run, still logging
    calls = [json.loads(line) for line in open(log)]
    inits = [c[1] for c in calls if c[0] == "init"]
    run_id = open(os.path.join(out, "wandb_id.txt")).read().strip()
    assert len(inits) == 2 and inits[0]["id"] == inits[1]["id"] == run_id
    assert inits[0]["project"] == "proj" and inits[0]["name"] == "run" and inits[0]["resume"] == "allow"
    assert inits[0]["config"]["max_steps"] == 4 and inits[0]["config"]["wandb"] == "proj"
    logged = [(c[1], c[2]) for c in calls if c[0] == "log"]
    assert [rec for rec, _ in logged] == records(out) and all(step == rec["step"] for rec, step in logged)
    assert [c[0] for c in calls].count("finish") == 2 and calls[-1] == ["finish"]
    # --overwrite starts a new W&B run
    C.main(["--out_dir", out, "--overwrite", "--max_steps", "2", "--wandb", "proj"] + TRAIN)
    assert [json.loads(line) for line in open(log)][-4][1]["id"] != inits[0]["id"]


def test_wandb_missing_is_one_line(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "wandb.py").write_text("raise ImportError('no wandb here')\n")
    r = _train(["--out_dir", str(tmp_path / "run"), "--max_steps", "2", "--wandb", "p"] + TRAIN,
               {"PYTHONPATH": f"{broken}{os.pathsep}{ROOT}"})
    assert r.returncode == 2 and r.stderr.strip() == "error: --wandb needs the wandb package (pip install wandb)"
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


def test_wandb_offline_with_the_real_package(tmp_path):
    require_real_wandb()
    out = str(tmp_path / "run")
    r = _train(["--out_dir", out, "--max_steps", "2", "--log_interval", "1", "--wandb", "composer-test"] + TRAIN,
               {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true", "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    run_id = open(os.path.join(out, "wandb_id.txt")).read().strip()
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-") and d.endswith(run_id)]
    assert len(runs) == 1, os.listdir(tmp_path / "wandb")
    assert os.path.isfile(tmp_path / "wandb" / runs[0] / f"run-{run_id}.wandb")
