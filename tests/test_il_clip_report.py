"""il_clip.py's reporting (issue 39 items 4-7): the start and end lines, the shapes results in
percent under one name per metric, metrics.jsonl's schema, the progress bars, the loss curve,
--help and --wandb."""
import glob
import io
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import read_figure, require_real_wandb
import torch

import data
import il_clip as M
from test_il_clip import IL, ROOT, TINY, run_main

SCHEMA = {"step": int, "phase": str, "loss": float, "lr": float, "time": float}


def test_start_and_end_lines_percent_results_and_the_eval_record(tmp_path, capsys):
    out = str(tmp_path / "r")
    assert run_main(TINY + IL + ["--eval_size", "6", "--out_dir", out]) == 0
    std = capsys.readouterr()
    talk = [ln for ln in std.err.splitlines() if ln.startswith(("start: ", "done: "))]
    assert len(talk) == 2, std.err
    start, end = talk
    n_params = sum(p.numel() for p in M.load_model(out)[0].parameters())
    assert start == (f"start: il_clip.py --method il | {n_params / 1e6:.2f}M parameters | cpu x 1 | "
                     f"data shapes ({len(data.ShapesDataset('train'))} train pairs) | out_dir {out}")
    assert re.fullmatch(rf"done: step 12/12 in \d+s \| wrote {re.escape(out)}/\{{checkpoint/, gen0/, gen1/, gen2/, "
                        r"metrics.jsonl, loss_curve.png, shapes_eval.json\}", end), end
    res = json.load(open(os.path.join(out, "shapes_eval.json")))
    metrics = {k: v for k, v in res.items() if k != "scored"}
    assert list(metrics) == list(M.SHAPES_METRICS)
    # percent: every category score is a whole number of items out of 6, x 100 / 6, 2 decimals
    shares = {round(100 * hits / 6, 2) for hits in range(7)}
    assert all(metrics[c] in shares for c in [*data.SHAPES_CATEGORIES, "systematicity", "productivity"])
    assert metrics["sugarcrepe_mean"] == pytest.approx(sum(metrics[c] for c in data.SHAPES_CATEGORIES) / 7, abs=0.01)
    assert 0 <= metrics["i2t_r1"] <= 100 and any(v > 1 for v in metrics.values())
    # stdout holds the results only: the table (one decimal, as every command prints a percent) and what was scored
    lines = std.out.splitlines()
    assert lines[:3] == ["| " + " | ".join(M.SHAPES_METRICS) + " |", "| " + " | ".join(["---"] * 12) + " |",
                         "| " + " | ".join(f"{metrics[k]:.1f}" for k in M.SHAPES_METRICS) + " |"]
    assert len(lines) == 4 and lines[3].startswith("scored: 6 items per category")
    recs = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    for rec in recs[:-1]:
        assert {k: type(rec[k]) for k in SCHEMA} == SCHEMA, rec
    assert recs[-1] == {"step": 12, "phase": "eval", "time": recs[-1]["time"], **metrics}
    # a finished run resumed is evaluated again: still one eval record
    assert run_main(["--resume", "--out_dir", out]) == 0
    assert [json.loads(x)["phase"] for x in open(os.path.join(out, "metrics.jsonl"))].count("eval") == 1
    # a resumed run says so; a run stopped early says how to continue
    assert run_main(TINY + ["--method", "clip", "--max_steps", "4", "--stop_at", "2", "--out_dir", out,
                            "--overwrite"]) == 0
    end = capsys.readouterr().err.strip().splitlines()[-1]
    assert end.startswith("done: step 2/4 in ") and end.endswith(f" | continue with: python il_clip.py --resume "
                                                                   f"--out_dir {out}"), end
    assert run_main(["--resume", "--out_dir", out]) == 0
    start = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("start: "))
    assert start.startswith("start: il_clip.py --method clip | ") and start.endswith(" | resumed at step 2")


def test_a_warmup_longer_than_the_run_gets_a_note_and_the_schedule_stays(tmp_path, capsys):
    args = TINY + ["--method", "clip", "--max_steps", "4", "--eval_size", "0", "--log_interval", "1"]
    assert run_main(args + ["--warmup", "10", "--out_dir", str(tmp_path / "a")]) == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note: --warmup")]
    assert notes == ["note: --warmup 10 is longer than the run (4 steps): the learning rate rises to 40% of --lr and "
                     "never reaches its peak (--warmup 1: 10% of the run)"]
    lr = [json.loads(x)["lr"] for x in open(tmp_path / "a" / "metrics.jsonl")]
    assert lr == pytest.approx([M.warmup_cosine(s, 4, 10, lr[0] * 10) for s in range(4)])   # the schedule as asked
    assert lr[-1] == pytest.approx(0.4 * lr[0] * 10)
    assert run_main(args + ["--warmup", "2", "--out_dir", str(tmp_path / "b")]) == 0
    assert "note: --warmup" not in capsys.readouterr().err


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_final_evaluation_has_a_progress_bar_on_a_terminal(monkeypatch):
    tok = data.build_tokenizer(captions=data.captions_for_tokenizer("shapes", 500), vocab_size=300)
    cfg = M.ModelConfig(**{**M.MODEL_PRESETS["tiny"], "vocab_size": tok.vocab_size, "vision_layers": 1,
                           "text_layers": 1, "context_length": tok.context_length, "eot_token_id": tok.eot_id})
    model = M.CLIP(cfg).eval()
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    quiet = M.evaluate_shapes(model, tok, n=3, n_val=5)
    assert term.getvalue() == ""
    loud = M.evaluate_shapes(model, tok, n=3, n_val=5, progress=True)
    assert loud == quiet and "shapes eval" in term.getvalue() and f"{5 + 3 * 9}/{5 + 3 * 9}" in term.getvalue()


def test_a_single_phase_run_is_one_colour_named_by_its_method(tmp_path):
    """The loss curve of a one-phase run: one line named by the method, its points the metrics.jsonl records (not
    the eval record), markers at a few points, whole-number steps, a legend on the canvas."""
    assert M.phase_style("train", "negclip") == ("negclip", M.METHOD_COLOUR)
    assert M.METHOD_COLOUR not in [c for _, c in M.PHASE_STYLE.values()]
    recs = [{"step": s, "phase": "train", "loss": 4.0 - s / 10, "clip": 4.0 - s / 10, "lr": 1e-3, "time": 0.0}
            for s in range(1, 9)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in recs) + json.dumps({"step": 8, "phase": "eval"}) + "\n")
    (ax,) = read_figure(M.draw_loss_curve(str(metrics), str(tmp_path / "c.png"), method="clip"))
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ax["legend"] == ["clip"] and ax["xlabel"] == "step (optimizer steps)" and ax["ylabel"] == "loss (nats)"
    assert ax["title"] == "il_clip.py --method clip: training loss (mean over each log interval)"
    (label, xs, ys, line), = ax["lines"]
    assert xs == [r["step"] for r in recs] and ys == pytest.approx([r["loss"] for r in recs])
    assert line.get_marker() == "o" and line.get_color() == M.METHOD_COLOUR
    assert all(t.isdigit() for t in ax["xticks"]) and ax["xlim"][0] == 0


def test_the_il_curve_has_each_phase_its_spawns_and_the_contrastive_loss(tmp_path):
    """IL: a line per phase holding its records' losses (joined to the record before each of its stretches), the
    contrastive loss in grey at every record, a dotted line at each spawn named by its generation."""
    phases = ["warmup"] * 3 + ["distill"] * 2 + ["interact"] * 3 + ["distill"] * 2 + ["interact"] * 2
    recs = [{"step": 2 * (i + 1), "phase": p, "loss": 1.0 + i % 4 + (p == "distill"), "clip": 2.0 + i, "lr": 1e-3,
             "time": 0.0} for i, p in enumerate(phases)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in recs))
    fig = M.draw_loss_curve(str(metrics), str(tmp_path / "c.png"), [6, 16, 99])
    (ax,) = read_figure(fig)
    assert ax["legend"] == ["contrastive loss", "warm-up", "distill (KD loss)", "interact"]
    lines = {label: (xs, ys) for label, xs, ys, _ in ax["lines"] if not label.startswith("_")}
    assert lines["contrastive loss"] == ([r["step"] for r in recs], [r["clip"] for r in recs])
    for phase, label in (("warmup", "warm-up"), ("distill", "distill (KD loss)"), ("interact", "interact")):
        xs, ys = lines[label]
        own = [(r["step"], r["loss"]) for r in recs if r["phase"] == phase]
        joints = [(a["step"], a["loss"]) for a, b in zip(recs, recs[1:]) if b["phase"] == phase != a["phase"]]
        assert sorted(zip(xs, ys)) == sorted(own + joints), phase
    spawns = [line.get_xdata()[0] for line in fig.axes[0].get_lines() if line.get_label().startswith("_")]
    assert spawns == [6, 16] and [t.get_text() for t in fig.axes[0].texts] == ["spawn, gen 1", "spawn, gen 2"]


def test_help_is_grouped_and_shows_every_informative_default(capsys):
    with pytest.raises(SystemExit):
        M.build_args(["--help"])
    text = capsys.readouterr().out
    heads = [ln[:-1] for ln in text.splitlines() if re.fullmatch(r"[a-z][a-z ()]*:", ln)]
    assert heads == ["options", "data", "model", "method", "schedule (steps)", "optimisation", "machine", "output"]
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: [])" not in text
    flat = " ".join(text.split())
    for shown in ("--wd WD AdamW weight decay (not on gains, biases, logit_scale) (default: 0.1)",
                  "(default: 64 on shapes, 1024 on web data)", "--seed SEED", "(default: 0)",
                  "--wandb PROJECT", "default: off"):
        assert shown in flat, shown
    # every flag has a help text (argparse shows a default only beside one): beside it or on the next line
    lines = text.splitlines()
    flags = [i for i, ln in enumerate(lines) if re.match(r"  --\w", ln)]
    assert len(flags) > 50
    bare = [lines[i] for i in flags if "  " not in lines[i].strip() and not lines[i + 1].startswith(" " * 20)]
    assert bare == []


FAKE_WANDB = '''
import json, os
def _call(*args):
    with open(os.environ["FAKE_WANDB_CALLS"], "a") as f:
        f.write(json.dumps(args) + "\\n")
def init(**kw):
    _call("init", kw)
def log(rec, step=None):
    _call("log", rec, step)
def finish():
    _call("finish")
'''


def test_wandb_gets_every_metrics_record_and_resume_continues_its_run(tmp_path, monkeypatch, capsys):
    """A fake `wandb` module first on the path records its calls: init (project, the out_dir's name,
    the run's config, resume="allow" with one id across --resume), one log per metrics.jsonl record
    at its step, finish."""
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "wandb.py").write_text(FAKE_WANDB)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_WANDB_CALLS", str(calls))
    out = str(tmp_path / "myrun")
    assert run_main(TINY + IL + ["--eval_size", "3", "--stop_at", "5", "--wandb", "proj", "--out_dir", out]) == 0
    assert run_main(["--resume", "--out_dir", out]) == 0          # --wandb comes from the saved run
    got = [json.loads(x) for x in open(calls)]
    inits = [c[1] for c in got if c[0] == "init"]
    assert [c[0] for c in got if c[0] != "log"] == ["init", "finish", "init", "finish"]
    run_id = open(os.path.join(out, "wandb_id.txt")).read().strip()
    for kw in inits:
        assert {k: kw[k] for k in ("project", "name", "id", "resume")} == {
            "project": "proj", "name": "myrun", "id": run_id, "resume": "allow"}
        assert kw["config"]["method"] == "il" and kw["config"]["model"]["codebook_size"] == 64
    recs = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [(c[1], c[2]) for c in got if c[0] == "log"] == [(r, r["step"]) for r in recs]
    assert recs[-1]["phase"] == "eval" and [r["step"] for r in recs] == list(range(1, 13)) + [12]
    monkeypatch.setitem(sys.modules, "wandb", None)                 # not installed
    capsys.readouterr()
    assert run_main(TINY + ["--wandb", "proj", "--out_dir", str(tmp_path / "no")]) == 2
    assert capsys.readouterr().err == "error: --wandb needs the wandb package (pip install wandb)\n"
    assert not os.path.exists(tmp_path / "no")                      # refused before anything is written


def test_wandb_offline_with_the_real_package(tmp_path):
    require_real_wandb()
    out = str(tmp_path / "w")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "OMP_NUM_THREADS": "1",
           "WANDB_SILENT": "true"}
    cmd = [sys.executable, os.path.join(ROOT, "il_clip.py"), *TINY, "--method", "clip", "--max_steps", "4",
           "--wandb", "proj", "--out_dir", out]
    for extra in (["--stop_at", "2"], ["--resume"]):
        r = subprocess.run(cmd + extra, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    run_id = open(os.path.join(out, "wandb_id.txt")).read().strip()
    runs = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*")))
    assert len(runs) == 2 and all(d.endswith(f"-{run_id}") for d in runs), runs   # one wandb run, continued
    assert all(os.path.getsize(os.path.join(d, f"run-{run_id}.wandb")) > 0 for d in runs)
