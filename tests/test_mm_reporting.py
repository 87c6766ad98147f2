"""mm_learngene.py reports as reporting.md says (issue 39 items 4-6): a start line and a done line on
stdout, no JSON per log step there (the records go to metrics.jsonl, one schema), --help grouped with
the informative defaults shown, a loss curve with a title and labelled axes."""
import argparse
import json

from PIL import Image

import mm_learngene as M
from test_mm_learngene import EXTRACT, teacher  # noqa: F401


def test_start_and_done_lines_and_no_json_on_stdout(teacher, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "lg"
    M.main(EXTRACT + ["--teacher", str(teacher), "--out_dir", str(out)])
    lines = capsys.readouterr().out.splitlines()
    start = next(l for l in lines if l.startswith("start: "))
    assert "mm_learngene.py extract --method mmlg" in start and "parameters | cpu x 1 | data shapes" in start
    assert start.endswith(f"out_dir {out}")
    assert lines[-1] == f"done: step 3/3 in {lines[-1].split(' in ')[1].split('s |')[0]}s | wrote {out}/" \
                        "{learngene.safetensors, checkpoint/, metrics.jsonl, loss_curve.png}"
    assert not any(l.lstrip().startswith("{") for l in lines)
    records = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all({"step", "phase", "loss", "lr", "time"} <= r.keys() and r["phase"] == "extract" for r in records)
    img = Image.open(out / "loss_curve.png")
    assert img.size == (900, 460) and len(img.getcolors(1 << 16)) > 2


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


def test_loss_curve_ticks_are_round_and_distinct():
    ticks = M.lifecycle.nice_ticks(3.6381, 3.6389, n=10)     # the curve is drawn by lifecycle.draw_curves
    assert len(ticks) >= 4 and len(set(M.lifecycle.tick_labels(ticks))) == len(ticks)
    assert M.lifecycle.nice_ticks(0, 7, integer=True) == [0, 2, 4, 6]       # whole steps only
