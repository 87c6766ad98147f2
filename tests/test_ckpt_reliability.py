"""Reliability of the three training scripts' checkpoint sections and data checks: a full disk,
two runs on one out_dir, --resume with nothing to resume, a checkpoint of another size, bad data
in a run shorter than an epoch, and composer's metrics.jsonl on a fresh run and on --resume."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import error_lines
import torch
from safetensors.torch import load_file

import composer as C
import data
import il_clip as I
import mm_learngene as M
from test_composer import TRAIN
from test_il_clip import TINY
from test_mm_learngene import EXTRACT, teacher  # noqa: F401
from conftest import disk_full_at_save

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
CLIP = TINY + ["--method", "clip", "--max_steps", "4", "--save_interval", "2"]


def saved_step(out):
    """The step of out_dir/checkpoint/: state.pt (the common layout), else train_state.json."""
    ck = os.path.join(out, "checkpoint")
    if os.path.isfile(os.path.join(ck, "state.pt")):
        return torch.load(os.path.join(ck, "state.pt"), weights_only=True)["step"]
    return json.load(open(os.path.join(ck, "train_state.json")))["step"]


def one_error_line(capsys):
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def exit_code(main, argv):
    """main's exit status, whether it returns it (il_clip) or exits (composer, mm_learngene)."""
    try:
        rc = main(argv)
        return rc if isinstance(rc, int) else 0      # composer's train returns its results
    except SystemExit as e:
        return e.code


# one (main, argv for an out_dir) per script
SCRIPTS = {"il_clip": (I.main, lambda out, t: CLIP + ["--out_dir", out]),
           "composer": (C.main, lambda out, t: ["train"] + TRAIN + ["--out_dir", out, "--max_steps", "4",
                                                                   "--save_interval", "2"])}


@pytest.mark.parametrize("script", SCRIPTS)
def test_full_disk_is_one_line_and_keeps_the_previous_checkpoint(script, tmp_path, capsys, monkeypatch,
                                                                 teacher):  # noqa: F811
    """The writer fails with ENOSPC at the step-4 save (after writing part of a file): one error
    line naming out_dir and the size needed, exit 2, checkpoint.tmp/ gone, step 2's checkpoint
    byte for byte as it was."""
    main, argv = SCRIPTS[script]
    out = str(tmp_path / "o")
    disk_full_at_save(monkeypatch, 4)
    assert exit_code(main, argv(out, teacher)) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: ") and out in line and "no space left" in line and "MiB needed" in line, line
    assert not os.path.exists(os.path.join(out, "checkpoint.tmp"))
    assert saved_step(out) == 2
    load_file(os.path.join(out, "checkpoint", "model.safetensors"))       # complete


def _tmpfs(tmp_path, size="600k"):
    d = tmp_path / "small"
    d.mkdir()
    if shutil.which("mount") is None or \
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                           capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    return d


def test_full_disk_on_a_real_small_filesystem(tmp_path, capsys):
    """A 600 KB tmpfs as out_dir, too small for the checkpoint (weights + AdamW moments)."""
    d = _tmpfs(tmp_path)
    try:
        out = str(d / "o")
        rc = I.main(TINY + ["--method", "clip", "--max_steps", "2", "--save_interval", "1", "--model_args", "width=64",
                            "--out_dir", out])
        line = one_error_line(capsys)
        assert rc == 2 and out in line and "no space left" in line, line
        assert not os.path.exists(os.path.join(out, "checkpoint.tmp"))
    finally:
        subprocess.run(["umount", "--lazy", str(d)])    # detached even if the test left a file open there


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_second_run_on_a_busy_out_dir_exits_2_naming_the_holder(script, tmp_path, capsys, teacher):  # noqa: F811
    main, argv = SCRIPTS[script]
    out = str(tmp_path / "o")
    os.makedirs(out)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"f = open({os.path.join(out, '.lock')!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
                               "f.truncate(0); f.write(str(os.getpid())); f.flush(); print('held', flush=True)\n"
                               "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert exit_code(main, argv(out, teacher)) == 2
        line = one_error_line(capsys)
        assert f"process {holder.pid}" in line and out in line, line
        assert sorted(os.listdir(out)) == [".lock"]                  # nothing written
    finally:
        holder.kill()
        holder.wait()
    # the holder was killed: its lock went with it, the next run goes ahead
    assert exit_code(main, argv(out, teacher)) == 0
    assert saved_step(out) == 4


@pytest.mark.parametrize("script", SCRIPTS)
def test_resume_with_nothing_to_resume_is_one_error_line(script, tmp_path, capsys, teacher):  # noqa: F811
    main, argv = SCRIPTS[script]
    out = str(tmp_path / "o")
    os.makedirs(os.path.join(out, "checkpoint.tmp"))     # a SIGTERM before the first save was complete
    assert exit_code(main, argv(out, teacher) + ["--resume"]) == 2
    assert "nothing to resume yet" in one_error_line(capsys)


def test_resume_with_nothing_to_resume_under_torchrun_is_said_once(tmp_path):
    out = str(tmp_path / "o")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                        os.path.join(ROOT, "composer.py"), "--out_dir", out, "--resume"] + TRAIN,
                       capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=180)
    assert r.returncode != 0 and r.stderr.count("nothing to resume yet") == 1, r.stderr


def test_composer_and_mm_checkpoint_of_another_size_is_one_line(tmp_path, capsys, teacher):  # noqa: F811
    co = str(tmp_path / "c")
    C.main(["train", "--out_dir", co, "--max_steps", "2", "--stop_at", "1"] + TRAIN)
    wider = [a if a != "32" else "48" for a in TRAIN]                  # --width 48
    assert exit_code(C.main, ["train", "--out_dir", co, "--max_steps", "2", "--resume"] + wider) == 2
    assert "--width 48 differs from the saved run's 32" in one_error_line(capsys)
    from test_mm_ckpt import sq_loss, toy_args, toy_batches
    from test_mm_learngene import _ListLoader
    mm = str(tmp_path / "m")
    M.train_phase(torch.nn.Linear(4, 1), sq_loss, _ListLoader(toy_batches()), toy_args(), 0, 1, "cpu", 2, out_dir=mm)
    with pytest.raises(data.DataError, match="shape mismatch weight"):
        M.train_phase(torch.nn.Linear(4, 2), sq_loss, _ListLoader(toy_batches()), toy_args(), 0, 1, "cpu", 4,
                      out_dir=mm, resume=True)


def test_composer_fresh_run_starts_a_fresh_metrics_log(tmp_path):
    out = str(tmp_path / "o")
    for extra in ([], ["--overwrite"]):       # two fresh runs into one out_dir: the second's log only
        C.main(["train", "--out_dir", out, "--max_steps", "3"] + TRAIN + extra)
        steps = [r["step"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "loss" in r]
        assert steps == [1, 2, 3]


def test_bad_data_stops_a_run_shorter_than_an_epoch(tmp_path, capsys):
    """12 of 52 images missing (23%), 6 steps of 8 (less than one epoch): the 10% rule stops it."""
    (tmp_path / "imgs").mkdir()
    rows = []
    for i in range(52):
        scene = data.shapes_scene("train", i)
        if i % 13 >= 3:                                  # 12 of 52 are never written
            scene.image.save(tmp_path / "imgs" / f"{i}.png")
        rows.append(f"imgs/{i}.png\t{scene.caption}")
    (tmp_path / "d.tsv").write_text("filepath\ttitle\n" + "\n".join(rows) + "\n")
    out = str(tmp_path / "o")
    rc = I.main(TINY + ["--data", str(tmp_path / "d.tsv"), "--image_root", str(tmp_path), "--method", "clip",
                        "--max_steps", "6", "--out_dir", out])
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert rc == 2 and len(line) == 1 and "missing image file" in line[0] and "max_skip_fraction" in line[0], err
    assert not os.path.exists(os.path.join(out, "checkpoint"))


def test_the_skip_check_runs_as_batches_are_read():
    """MapLoader: a data set that is 30% bad stops at the first batch that brings the count to the
    minimum, before the epoch ends; 5% bad reads the whole epoch."""
    class Bad(torch.utils.data.Dataset):
        def __init__(self, every):
            self.every = every

        def __len__(self):
            return 200

        def __getitem__(self, i):
            if i % self.every == 0:
                return data.Skip("missing image file", str(i))
            return {"image": torch.zeros(3, 4, 4), "caption": "a", "tree": None, "key": str(i)}
    loader = data.MapLoader(Bad(3), 10, train=False, drop_last=False)
    it = iter(loader)
    with pytest.raises(data.DataError, match="skipped 17 of 50"):
        for _ in range(20):
            next(it)
    assert loader.batches_done == 5
    assert sum(len(b["caption"]) for b in data.MapLoader(Bad(20), 10, train=False, drop_last=False)) == 190


def test_a_lock_left_by_a_killed_process_does_not_block(tmp_path):
    """SIGKILL a run while it trains; the next run on the folder (with --resume) goes ahead."""
    out = str(tmp_path / "o")
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "il_clip.py")] + TINY +
                         ["--method", "clip", "--max_steps", "100000", "--save_interval", "1", "--out_dir", out],
                         env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    t0 = time.time()
    while not os.path.isfile(os.path.join(out, "checkpoint", "state.pt")):
        assert p.poll() is None and time.time() - t0 < 120, p.stderr.read()
        time.sleep(0.2)
    p.kill()
    p.wait()
    assert I.main(["--stop_at", str(saved_step(out) + 1), "--out_dir", out, "--resume"]) == 0


def test_finetune_resume_with_no_phase_saved_is_one_error_line(tmp_path, capsys):
    """mm_learngene finetune --resume where neither the activation nor the fine-tuning phase has
    saved a checkpoint: the same one line as extract, not a fresh start."""
    out = str(tmp_path / "ft")
    os.makedirs(os.path.join(out, "finetune", "checkpoint.tmp"))
    argv = ["finetune", "--init", "scratch", "--task", "retrieval", "--out_dir", out, "--resume",
            "--max_steps", "2", "--batch_size", "8", "--eval_size", "8"]
    assert exit_code(M.main, argv) == 2
    assert "nothing to resume yet" in one_error_line(capsys)
    assert not os.path.exists(os.path.join(out, "results.json"))
