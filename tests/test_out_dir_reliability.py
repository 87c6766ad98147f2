"""Reliability, round four, as a user meets it: out_dir files never written through a symbolic link; a path of the
wrong kind or a folder without write permission is one line before training (and a read-only folder mid-run one line
with the checkpoint kept); state.pt checked to its leaves; a stopping run that a SIGTERM storm does not kill;
convert-weights on a plain pickle; mm_learngene's --resume and expand keeping what they were told; --overwrite
clearing what eval wrote; a command that fails before training leaving no folder behind."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import composer as C
import data
import eval_compositional as E
import il_clip as I
import lifecycle
import mm_learngene as M
from conftest import error_lines
from test_composer import TRAIN
from test_il_clip import TINY
from test_mm_learngene import EXTRACT, teacher  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
CLIP = TINY + ["--method", "clip"]


def exit_code(main, argv):
    """main's exit status, whether it returns it (il_clip) or exits (composer, mm_learngene)."""
    try:
        rc = main(argv)
        return rc if isinstance(rc, int) else 0
    except SystemExit as e:
        return e.code


def one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def step_of(folder):
    return torch.load(os.path.join(folder, "state.pt"), weights_only=True)["step"]


# one (main, argv for an out_dir) per script; mm_learngene's extract reads its teacher only after the out_dir checks
SCRIPTS = {"il_clip": (I.main, lambda out: CLIP + ["--max_steps", "2", "--out_dir", out]),
           "composer": (C.main, lambda out: ["train"] + TRAIN + ["--max_steps", "2", "--out_dir", out]),
           "mm_learngene": (M.main, lambda out: EXTRACT + ["--init", "no-teacher-needed", "--out_dir", out])}


# -----------------------------------------------------------------------------
# 1. never through a symbolic link

def test_a_symlinked_metrics_log_is_refused_and_overwrite_removes_the_link(tmp_path, capsys):
    out, target = tmp_path / "o", tmp_path / "elsewhere.txt"
    out.mkdir()
    target.write_text("precious\n")
    os.symlink(target, out / "metrics.jsonl")
    assert I.main(CLIP + ["--max_steps", "2", "--out_dir", str(out)]) == 2
    line = one_error_line(capsys)
    assert f"{out / 'metrics.jsonl'}: a symbolic link" in line and "--overwrite" in line, line
    assert I.main(CLIP + ["--max_steps", "2", "--out_dir", str(out), "--overwrite"]) == 0
    assert target.read_text() == "precious\n" and not os.path.islink(out / "metrics.jsonl")
    assert [json.loads(x)["step"] for x in open(out / "metrics.jsonl")] == [1, 2]


def test_a_symlinked_lock_is_refused_and_its_target_untouched(tmp_path, capsys):
    out, target = tmp_path / "o", tmp_path / "elsewhere.txt"
    out.mkdir()
    target.write_text("precious\n")
    os.symlink(target, out / ".lock")
    assert exit_code(C.main, ["train"] + TRAIN + ["--max_steps", "2", "--out_dir", str(out)]) == 2
    assert f"{out / '.lock'}: a symbolic link" in one_error_line(capsys)
    assert target.read_text() == "precious\n" and os.listdir(out) == [".lock"]


def test_a_link_planted_in_a_running_out_dir_is_not_written_through(tmp_path):
    """log_record appends in place (O_NOFOLLOW): a link that appears after the checks is refused, not followed."""
    target = tmp_path / "elsewhere.txt"
    target.write_text("precious\n")
    os.symlink(target, tmp_path / "metrics.jsonl")
    with pytest.raises(data.DataError, match="metrics.jsonl: a symbolic link"):
        lifecycle.log_record(str(tmp_path / "metrics.jsonl"), {"step": 1, "loss": 0.5})
    assert target.read_text() == "precious\n"


def test_overwrite_removes_a_symlinked_checkpoint_never_its_target(tmp_path, capsys):
    out, shared = tmp_path / "o", tmp_path / "shared"
    shared.mkdir()
    (shared / "state.pt").write_text("someone else's")
    out.mkdir()
    os.symlink(shared, out / "checkpoint")
    assert I.main(CLIP + ["--max_steps", "2", "--out_dir", str(out)]) == 2      # looks like an earlier run's
    assert "--overwrite" in one_error_line(capsys)
    assert I.main(CLIP + ["--max_steps", "2", "--out_dir", str(out), "--overwrite"]) == 0
    assert (shared / "state.pt").read_text() == "someone else's" and os.listdir(shared) == ["state.pt"]
    assert not os.path.islink(out / "checkpoint") and step_of(out / "checkpoint") == 2


# -----------------------------------------------------------------------------
# 2. the out_dir's shape and permissions: one line before any training

def make_wrong(tmp_path, case):
    """The out_dir argument for `case`, with the wrong thing made on disk; -> (out_dir, the path the line names)."""
    out = tmp_path / "o"
    if case == "out_dir is a file":
        out.write_text("notes")
        return out, out
    if case == "out_dir below a file":
        (tmp_path / "f").write_text("notes")
        return tmp_path / "f" / "o", tmp_path / "f"
    out.mkdir()
    name = {"checkpoint is a file": "checkpoint", "checkpoint.prev is a file": "checkpoint.prev",
            "metrics.jsonl is a folder": "metrics.jsonl"}[case]
    if name == "metrics.jsonl":
        (out / name).mkdir()
    else:
        (out / name).write_text("notes")
    return out, out / name


@pytest.mark.parametrize("case", ["out_dir is a file", "out_dir below a file", "checkpoint is a file",
                                  "checkpoint.prev is a file", "metrics.jsonl is a folder"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_path_of_the_wrong_kind_is_one_line_before_training(script, case, tmp_path, capsys):
    main, argv = SCRIPTS[script]
    out, named = make_wrong(tmp_path, case)
    before = sorted(os.listdir(out)) if out.is_dir() else None
    assert exit_code(main, argv(str(out))) == 2
    said = capsys.readouterr()
    err = said.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {named}") and "start:" not in said.out, said
    assert any(why in err[0] for why in ("a file is there", "is a file", "a folder is there")), err
    if before is not None:                                   # nothing written but the lock
        assert sorted(os.listdir(out)) == sorted({*before, ".lock"})


def as_nobody():
    """setpriv's prefix that runs a command as the unprivileged user nobody (the suite runs as root, which a chmod
    does not stop); skips where that is impossible."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a command as an unprivileged user")
    try:
        import pwd
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody")
    return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


def test_a_read_only_out_dir_is_one_line_before_training_and_mid_run():
    """As an unprivileged user: an out_dir without write permission is refused before training; one made read-only
    while the run trains stops it at its next write with one line, the last checkpoint kept."""
    prefix = as_nobody()
    with tempfile.TemporaryDirectory() as tmp:      # pytest's tmp_path is root's alone (0700)
        os.chmod(tmp, 0o777)
        out = os.path.join(tmp, "o")
        os.makedirs(out)
        shutil.chown(out, "nobody", "nogroup")
        os.chmod(out, 0o555)
        cmd = prefix + [sys.executable, os.path.join(ROOT, "il_clip.py")] + CLIP + ["--out_dir", out]
        env = {**ENV, "HOME": tmp, "PYTHONDONTWRITEBYTECODE": "1"}
        r = subprocess.run(cmd + ["--max_steps", "2"], capture_output=True, text=True, env=env, cwd=tmp, timeout=120)
        assert r.returncode == 2 and r.stderr.strip() == f"error: {out}: not writable (permission denied)", r.stderr
        assert os.listdir(out) == []
        os.chmod(out, 0o755)
        p = subprocess.Popen(cmd + ["--max_steps", "100000", "--save_interval", "2"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=tmp)
        try:
            t0 = time.time()
            while not os.path.isfile(os.path.join(out, "checkpoint", "sha256.json")):
                assert p.poll() is None and time.time() - t0 < 120, p.communicate()
                time.sleep(0.1)
            os.chmod(out, 0o555)
            _, err = p.communicate(timeout=120)
        finally:
            p.kill()
        lines = error_lines(err)       # without the start line
        assert p.returncode == 2 and len(lines) == 1, err
        # at the next save ("... for the step-N checkpoint; the previous checkpoint is kept") or, if the chmod came
        # just after a save, at the loss curve drawn after it
        assert lines[0].startswith(f"error: {out}") and "permission denied" in lines[0], lines[0]
        os.chmod(out, 0o755)
        folder, _, state, _, _ = lifecycle.load_checkpoint(out, I.STATE_TYPES)      # whole, sums and types
        assert state["step"] >= 2 and state["step"] % 2 == 0


# -----------------------------------------------------------------------------
# 3. state.pt checked to its leaves; 5. the fallback note names what is missing

@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """An il_clip run stopped at step 3 of 4 with checkpoints of steps 3 and 2 (checkpoint.prev/)."""
    out = str(tmp_path_factory.mktemp("run") / "o")
    assert I.main(CLIP + ["--max_steps", "4", "--stop_at", "3", "--save_interval", "1", "--out_dir", out]) == 0
    return out


def rewrite_state(folder, change):
    """state.pt changed by `change(state)` and sha256.json updated to match: a file whose sums hold."""
    path = os.path.join(folder, "state.pt")
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)
    sums = json.load(open(os.path.join(folder, "sha256.json")))
    sums["state.pt"] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    json.dump(sums, open(os.path.join(folder, "sha256.json"), "w"))


WRONG_LEAVES = {"rng.torch: torch's generator state": lambda s: s["rng"].update(torch="abc"),
                "rng.numpy: NumPy's random state": lambda s: s["rng"]["numpy"].__setitem__(1, "abc"),
                "optimizer.state.0.exp_avg: Tensor": lambda s: s["optimizer"]["state"][0].update(exp_avg="x"),
                "loader.batches_done: int": lambda s: s["loader"].update(batches_done="3")}


@pytest.mark.parametrize("expected", WRONG_LEAVES)
def test_a_wrong_nested_type_in_state_pt_falls_back_or_is_one_line(stopped_run, expected, tmp_path, capsys):
    out = str(tmp_path / "o")
    shutil.copytree(stopped_run, out)
    rewrite_state(os.path.join(out, "checkpoint"), WRONG_LEAVES[expected])
    capsys.readouterr()
    assert I.main(["--resume", "--out_dir", out]) == 0
    note = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note: ")]
    assert len(note) == 1 and f"state.pt: wrong types (expected {expected}" in note[0], note
    assert f"resuming from the previous checkpoint {out}/checkpoint.prev (step 2)" in note[0]
    assert step_of(os.path.join(out, "checkpoint")) == 4
    shutil.rmtree(os.path.join(out, "checkpoint.prev"))      # no earlier checkpoint: one line
    rewrite_state(os.path.join(out, "checkpoint"), WRONG_LEAVES[expected])
    assert I.main(["--resume", "--out_dir", out]) == 2
    assert f"wrong types (expected {expected}" in one_error_line(capsys)


def test_a_deleted_checkpoint_falls_back_with_a_note_naming_the_folder(stopped_run, tmp_path, capsys):
    out = str(tmp_path / "o")
    shutil.copytree(stopped_run, out)
    shutil.rmtree(os.path.join(out, "checkpoint"))
    capsys.readouterr()
    assert I.main(["--resume", "--out_dir", out, "--stop_at", "3"]) == 0
    note = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note: ")]
    assert note == [f"note: {out}/checkpoint: missing; resuming from the previous checkpoint {out}/checkpoint.prev "
                    f"(step 2)"], note


def test_convert_weights_on_anything_but_torchscript_is_one_line(tmp_path, capsys):
    plain = str(tmp_path / "plain.pt")
    torch.save({"visual.proj": torch.zeros(2, 2)}, plain)
    assert data.main(["convert-weights", plain]) == 2
    assert one_error_line(capsys) == (f"error: {plain}: not a TorchScript archive (convert-weights is for OpenAI's "
                                      f".pt files; a plain state dict .pt or .safetensors loads as it is)")
    assert data.main(["convert-weights", str(tmp_path / "missing.pt")]) == 2
    assert one_error_line(capsys) == f"error: {tmp_path / 'missing.pt'}: no such file"
    assert sorted(os.listdir(tmp_path)) == ["plain.pt"]


# -----------------------------------------------------------------------------
# 4. a stopping run ignores a SIGTERM storm and exits 0

STORM = {"il_clip": lambda teacher, out: ["il_clip.py"] + CLIP + ["--out_dir", out],           # noqa: F811
         "composer": lambda teacher, out: ["composer.py", "train"] + TRAIN + ["--out_dir", out],
         "mm_learngene": lambda teacher, out: ["mm_learngene.py"] + EXTRACT + ["--teacher", str(teacher),
                                                                             "--out_dir", out]}


@pytest.mark.parametrize("script", STORM)
def test_a_sigterm_storm_after_the_stop_still_exits_0(script, teacher, tmp_path):  # noqa: F811
    """A scheduler that repeats SIGTERM until the job is gone: the first asks for the save, the rest (through the
    save, the teardown and the interpreter's exit) change nothing; the run exits 0 with its checkpoint whole."""
    out = str(tmp_path / "o")
    argv = STORM[script](teacher, out)
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, argv[0]), *argv[1:], "--max_steps", "100000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    metrics, t0 = os.path.join(out, "metrics.jsonl"), time.time()
    while not (os.path.isfile(metrics) and os.path.getsize(metrics)):
        assert p.poll() is None and time.time() - t0 < 120, p.communicate()
        time.sleep(0.1)
    sent, t0 = 0, time.time()
    while p.poll() is None:
        if time.time() - t0 > 120:
            p.kill()
            pytest.fail(f"still running 120 s after the first SIGTERM: {p.communicate()}")
        p.send_signal(signal.SIGTERM)
        sent += 1
        time.sleep(0.002)
    stdout, stderr = p.communicate()
    step = lifecycle.load_checkpoint(out, {"step": int})[2]["step"]
    assert p.returncode == 0 and sent > 1, (p.returncode, sent, stderr[-2000:])
    assert f"stopped by SIGTERM at step {step}/100000 | checkpoint saved | continue with: python {argv[0]}" in stderr


# -----------------------------------------------------------------------------
# 6. runs that keep what they were told

def test_composer_stop_and_resume_lines(tmp_path, capsys):
    out = str(tmp_path / "o")
    C.main(["train"] + TRAIN + ["--max_steps", "3", "--stop_at", "1", "--out_dir", out])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"stopped by --stop_at at step 1/3 | checkpoint saved | continue with: python composer.py train --resume "
        f"--out_dir {out}")
    C.main(["train", "--resume", "--out_dir", out])
    std = capsys.readouterr()
    lines = std.out.splitlines() + std.err.splitlines()
    start = [ln for ln in std.err.splitlines() if ln.startswith("start: ")]
    assert len(start) == 1 and start[0].endswith(f"out_dir {out} | resumed at step 1"), lines
    assert not any("resumed from" in ln for ln in lines)


def test_mm_resume_keeps_the_saved_run_control_flags(teacher, tmp_path, capsys):  # noqa: F811
    out = str(tmp_path / "o")
    argv = EXTRACT + ["--teacher", str(teacher), "--out_dir", out, "--max_steps", "6", "--save_interval", "2"]
    with pytest.raises(SystemExit):
        M.main(argv + ["--stop_at", "3"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"stopped by --stop_at at step 3/6 | checkpoint saved | continue with: python mm_learngene.py extract "
        f"--resume --out_dir {out}")
    M.main(["extract", "--out_dir", out, "--resume"])       # --log_interval 1 and --save_interval 2 kept
    start = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("start: ")]
    assert len(start) == 1 and start[0].endswith(f"out_dir {out} | resumed at step 3"), start
    saved = json.load(open(os.path.join(out, "checkpoint", "config.json")))["args"]
    assert saved["log_interval"] == 1 and saved["save_interval"] == 2 and saved["stop_at"] is None
    assert [json.loads(x)["step"] for x in open(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3, 4, 5, 6]
    assert step_of(os.path.join(out, "checkpoint.prev")) == 4       # saved at 4 (not only at the end)


def test_expand_refuses_an_existing_descendant_without_overwrite(teacher, tmp_path, capsys):  # noqa: F811
    M.main(EXTRACT + ["--teacher", str(teacher), "--out_dir", str(tmp_path / "lg")])
    expand = ["expand", "--learngene", str(tmp_path / "lg" / "learngene.safetensors"), "--out_dir", str(tmp_path / "d")]
    M.main(expand + ["--layers", "2"])
    weights = open(tmp_path / "d" / "model.safetensors", "rb").read()
    capsys.readouterr()
    assert exit_code(M.main, expand + ["--layers", "3"]) == 2
    assert f"{tmp_path / 'd'} holds a descendant already" in one_error_line(capsys)
    assert open(tmp_path / "d" / "model.safetensors", "rb").read() == weights
    M.main(expand + ["--layers", "3", "--overwrite"])
    assert json.load(open(tmp_path / "d" / "config.json"))["layers"] == 3


def test_overwrite_clears_what_eval_wrote_into_the_run_folder(stopped_run, tmp_path):
    out = str(tmp_path / "o")
    shutil.copytree(stopped_run, out)
    assert E.main(["--ckpt", out, "--eval_size", "4", "--out", os.path.join(out, "eval.json"), "--no_progress"]) == 0
    assert os.path.isfile(os.path.join(out, "eval.json"))
    assert I.main(CLIP + ["--max_steps", "1", "--out_dir", out, "--overwrite"]) == 0
    assert not os.path.exists(os.path.join(out, "eval.json"))


FAILS_EARLY = {"il_clip": (I.main, lambda out: CLIP + ["--max_steps", "2", "--data", "missing.tsv", "--out_dir", out]),
               "composer": (C.main, lambda out: ["train"] + TRAIN + ["--data", "missing.tsv", "--out_dir", out]),
               "mm_learngene": (M.main, lambda out: ["finetune", "--init", "scratch", "--data", "missing.tsv",
                                                     "--max_steps", "2", "--out_dir", out])}


@pytest.mark.parametrize("script", FAILS_EARLY)
def test_a_command_that_fails_before_training_removes_the_out_dir_it_made(script, tmp_path, capsys):
    main, argv = FAILS_EARLY[script]
    assert exit_code(main, argv(str(tmp_path / "new" / "run"))) == 2      # it made new/ and new/run/
    assert "missing.tsv" in one_error_line(capsys) and os.listdir(tmp_path) == []
    (tmp_path / "mine").mkdir()                                          # the user's folder stays
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    assert exit_code(main, argv(str(tmp_path / "mine"))) == 2
    assert sorted(os.listdir(tmp_path / "mine")) == [".lock", "notes.txt"]
