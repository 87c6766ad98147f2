"""mm_learngene.py reports as every command does (issues 39, 57): one start line and one done line on stderr for
each subcommand, no JSON per log step (the records go to metrics.jsonl, one schema), --help grouped with the
informative defaults shown, a loss curve whose lines are the metrics.jsonl values."""
import argparse
import json
import re

import pytest
from conftest import read_figure
from safetensors.torch import load_file

import mm_learngene as M
from test_mm_learngene import EXTRACT, extracted, teacher  # noqa: F401


def test_start_and_done_lines_and_no_json_on_stdout(teacher, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "lg"
    M.main(EXTRACT + ["--teacher", str(teacher), "--out_dir", str(out)])
    std = capsys.readouterr()
    assert std.out == ""                # extract has no table: every line is talk, on stderr
    lines = std.err.splitlines()
    start = next(l for l in lines if l.startswith("start: "))
    assert "mm_learngene.py extract --method mmlg" in start and "parameters | cpu x 1 | data shapes" in start
    assert start.endswith(f" | teacher {teacher} (GELU) | out_dir {out}")
    done = re.fullmatch(r"done: step 3/3, learngene parameters ([\d,]+) \(blocks \+ coefficients; ([\d,]+) with the "
                        r"non-learngene parts\) in \d+s \| wrote (.*)", lines[-1])
    assert done and done[3] == f"{out}/{{learngene.safetensors, checkpoint/, metrics.jsonl, loss_curve.png}}", lines[-1]
    aux = M.load_learngene(str(out / "learngene.safetensors"))[0]
    assert int(done[1].replace(",", "")) == aux.learngene_numel()
    assert int(done[2].replace(",", "")) == sum(p.numel() for p in aux.parameters())
    records = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all({"step", "phase", "loss", "lr", "time", "clip", "dist"} <= r.keys() and r["phase"] == "extract"
               for r in records)
    # the curve: the loss and its two terms, each line the metrics.jsonl values, on a canvas that holds the legend
    (ax,) = read_figure(M.draw_loss_curve(str(out), "extract"))
    assert ax["legend"] == ["extraction loss (Eq. 8)", "CLIP loss", "distillation loss"]
    assert ax["xlabel"] == "step (optimizer steps)" and ax["ylabel"] == "loss (nats)" and "extract" in ax["title"]
    for (label, xs, ys, line), key in zip(ax["lines"], ("loss", "clip", "dist")):
        assert xs == [1, 2, 3] and ys == pytest.approx([r[key] for r in records]) and line.get_marker() == "o"


def test_expand_and_report_start_and_end_in_one_format(extracted, tmp_path, capsys):  # noqa: F811
    M.main(["expand", "--learngene", str(extracted / "learngene.safetensors"), "--layers", "4",
            "--out_dir", str(tmp_path / "d")])
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == (f"start: mm_learngene.py expand --layers 4 --modality clip | learngene "
                        f"{extracted / 'learngene.safetensors'} (mmlg) | part both | out_dir {tmp_path / 'd'}")
    n = sum(v.numel() for v in load_file(str(tmp_path / "d" / "model.safetensors")).values())
    assert re.fullmatch(rf"done: a 4-layer clip descendant, {n:,} parameters in \d+s \| wrote "
                        rf"{re.escape(str(tmp_path / 'd'))}/\{{model.safetensors, config.json, tokenizer.json\}}",
                        lines[-1]), lines[-1]
    M.main(["report", "--learngene", str(extracted / "learngene.safetensors"), "--layers", "2", "4"])
    std = capsys.readouterr()
    lg = extracted / "learngene.safetensors"
    assert std.err.splitlines()[0] == f"start: mm_learngene.py report | --learngene {lg}"
    assert re.fullmatch(r"done: 1 table printed in \d+s \| wrote nothing", std.err.splitlines()[-1])
    assert "learngene (blocks + coefficients)" in std.out


def test_help_is_grouped_with_defaults_shown():
    ap = M.build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name in ("extract", "finetune"):
        text = sub[name].format_help()
        for group in ("data:", "schedule", "optimisation:", "machine:", "output:", "model:", "method"):
            assert f"\n{group}" in text, (name, group)
        assert "(default: None)" not in text and "(default: 10)" in text and "(default: 0)" in text
    assert "(default: out/learngene)" in sub["extract"].format_help()
    assert "--init INIT, --teacher INIT" in sub["extract"].format_help()
    assert "(default: [6, 8, 12])" in sub["report"].format_help()
