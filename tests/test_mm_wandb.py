"""--wandb PROJECT in mm_learngene.py (issue 39 item 7, nanoGPT's wandb_log): rank 0 sends every
metrics.jsonl record to W&B at its step, one W&B run per out_dir that --resume continues; without the
package, one line and exit 2 before training. (a) a fake `wandb` module that records its calls,
always; (b) the real package offline, where it is installed."""
import glob
import json
import os
import subprocess
import sys

import pytest
from conftest import require_real_wandb

import mm_learngene as M
from test_mm_learngene import ENV, EXTRACT, ROOT, teacher  # noqa: F401

FAKE = '''import json, os
def _rec(call, **kw):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps({"call": call, **kw}, default=str) + "\\n")
def init(**kw): _rec("init", **kw)
def log(record, step=None): _rec("log", record=record, step=step)
def finish(): _rec("finish")
'''


@pytest.fixture
def fake_wandb(tmp_path, monkeypatch):
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "wandb.py").write_text(FAKE)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setenv("FAKE_WANDB_LOG", str(tmp_path / "calls.jsonl"))
    return lambda: [json.loads(x) for x in open(tmp_path / "calls.jsonl")]


def test_wandb_calls_match_metrics_jsonl_and_resume_continues_the_run(teacher, fake_wandb, tmp_path):  # noqa: F811
    out = tmp_path / "lg"
    args = EXTRACT + ["--max_steps", "4", "--teacher", str(teacher), "--out_dir", str(out), "--wandb", "proj"]
    with pytest.raises(SystemExit):
        M.main(args + ["--stop_at", "2"])
    M.main(["extract", "--resume", "--out_dir", str(out), "--log_interval", "1"])
    calls = fake_wandb()
    inits = [c for c in calls if c["call"] == "init"]
    assert len(inits) == 2 and inits[0]["id"] == inits[1]["id"] == (out / "wandb_id.txt").read_text().strip()
    assert all(c["project"] == "proj" and c["name"] == "lg" and c["resume"] == "allow" for c in inits)
    assert inits[0]["config"]["args"]["max_steps"] == 4
    logged = [(c["step"], c["record"]) for c in calls if c["call"] == "log"]
    records = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [r for _, r in logged] == records and [s for s, _ in logged] == [r["step"] for r in records] == [1, 2, 3, 4]
    assert calls[-1]["call"] == "finish"


def test_wandb_missing_package_is_one_line_before_training(teacher, tmp_path, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setitem(sys.modules, "wandb", None)     # `import wandb` raises ImportError
    with pytest.raises(SystemExit) as e:
        M.main(EXTRACT + ["--teacher", str(teacher), "--out_dir", str(tmp_path / "x"), "--wandb", "proj"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == "error: --wandb needs the wandb package (pip install wandb)\n"
    assert not (tmp_path / "x").exists()


def test_real_wandb_offline(teacher, tmp_path):  # noqa: F811
    require_real_wandb()
    env = {**ENV, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    out = tmp_path / "lg"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "mm_learngene.py")] + EXTRACT +
                       ["--teacher", str(teacher), "--out_dir", str(out), "--wandb", "proj"],
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    run_id = (out / "wandb_id.txt").read_text().strip()
    runs = glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and glob.glob(os.path.join(runs[0], f"run-{run_id}.wandb"))
