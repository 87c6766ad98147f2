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
from conftest import require_real_wandb
import torch

import data
import lifecycle
import il_clip as M
from test_il_clip import IL, ROOT, TINY, run_main

SCHEMA = {"step": int, "phase": str, "loss": float, "lr": float, "time": float}


def test_start_and_end_lines_percent_results_and_the_eval_record(tmp_path, capsys):
    out = str(tmp_path / "r")
    assert run_main(TINY + IL + ["--eval_size", "6", "--out_dir", out]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    start, end = lines[0], lines[-1]
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
    assert " | ".join(f"{metrics[k]:.1f}" for k in M.SHAPES_METRICS) in "\n".join(lines)   # the printed table
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
    end = capsys.readouterr().out.strip().splitlines()[-1]
    assert end.startswith("done: step 2/4 in ") and end.endswith(f" | continue with: python il_clip.py --resume "
                                                                   f"--out_dir {out}"), end
    assert run_main(["--resume", "--out_dir", out]) == 0
    start = capsys.readouterr().out.splitlines()[0]
    assert start.startswith("start: il_clip.py --method clip | ") and start.endswith(" | resumed at step 2")


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
    assert M.phase_style("train", "negclip") == ("negclip", M.METHOD_COLOUR)
    assert M.METHOD_COLOUR not in [c for _, c in M.PHASE_STYLE.values()]
    assert M.phase_style("warmup", "il") == ("warm-up", M.PHASE_STYLE["warmup"][1])
    recs = [{"step": s, "phase": "train", "loss": 4.0 - s / 10, "clip_loss": 4.0 - s / 10, "lr": 1e-3, "time": 0.0}
            for s in range(1, 9)]
    assert M.legend_entries(recs, "clip") == [("clip", M.METHOD_COLOUR)]
    il = [dict(r, phase=p) for r, p in zip(recs, ["warmup", "warmup", "distill", "interact"])]
    il[2]["clip_loss"] = 5.0                                    # distill: the loss is KD
    assert [label for label, _ in M.legend_entries(il, "il", [2])] == [
        "warm-up", "distill", "interact", "contrastive loss", "spawn"]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in recs) + json.dumps({"step": 8, "phase": "eval"}) + "\n")
    M.draw_loss_curve(str(metrics), str(tmp_path / "c.png"), method="clip")
    from PIL import Image
    colours = {c for _, c in Image.open(tmp_path / "c.png").convert("RGB").getcolors(1 << 20)}
    assert M.METHOD_COLOUR in colours and M.PHASE_STYLE["warmup"][1] not in colours


@pytest.mark.parametrize("hi", [1, 3, 7, 12, 37, 1000, 48000])
def test_step_ticks_are_whole_numbers_inside_the_range(hi):
    ticks = lifecycle.nice_ticks(0, hi, integer=True)
    assert ticks[0] == 0 and ticks[-1] <= hi and len(ticks) >= 2 - (hi < 2)
    assert all(float(t).is_integer() for t in ticks) and len(set(ticks)) == len(ticks)
    assert all("." not in s for s in lifecycle.tick_labels(ticks))


@pytest.mark.parametrize("lo,hi", [(3.6381, 3.6383), (0.5, 4.7), (1e-4, 3e-4), (2.0, 2.0 + 1e-6)])
def test_loss_ticks_read_differently_and_lie_in_the_range(lo, hi):
    ticks = lifecycle.nice_ticks(lo, hi)
    labels = lifecycle.tick_labels(ticks)
    assert len(ticks) >= 2 and lo - 1e-12 <= ticks[0] and ticks[-1] <= hi + 1e-12
    assert len(set(labels)) == len(labels)
    assert all(abs(float(s) - t) <= (hi - lo) / 10 for s, t in zip(labels, ticks))   # a label reads its tick


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
