"""mm_learngene.py training that survives preemption and divergence: the checkpoint/ folder
(state.pt + sha256.json) atomic as a set with a fallback to checkpoint.prev/, no checkpoint with
non-finite weights, saves at --save_interval's own multiples, metrics.jsonl rewound on resume,
SIGTERM to torchrun's whole process group with 2 loader workers; the run lifecycle (--resume with
the saved flags, --overwrite, Ctrl-C, the lock, write errors) and the warm-up cut to a short run;
the teacher's --quick_gelu."""
import argparse
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import mm_learngene as M
from test_mm_learngene import EXTRACT, ENV, ROOT, _ListLoader, expect_error, run_cli, saved_step, teacher  # noqa: F401
from conftest import disk_full_at_save, error_lines


def toy_args(**kw):
    return argparse.Namespace(**{**dict(lr=1e-2, wd=0.0, warmup=1, grad_clip=1.0, dtype="fp32", log_interval=3,
                                        save_interval=2, batch_size=8), **kw})


def toy_batches(n=8):
    return [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(n)]


def sq_loss(m, x):
    loss = m(x).pow(2).mean()
    return loss, {}


def test_saves_at_save_interval_whatever_log_interval(tmp_path, monkeypatch):
    saved = []
    real = M.lifecycle.save_checkpoint
    monkeypatch.setattr(M.lifecycle, "save_checkpoint", lambda *a, **k: (saved.append(a[2]["step"]), real(*a, **k)))
    torch.manual_seed(0)
    M.train_phase(torch.nn.Linear(4, 1), sq_loss, _ListLoader(toy_batches()), toy_args(), 0, 1, "cpu", 7,
                  out_dir=str(tmp_path), tag="t")
    assert saved == [2, 4, 6, 7]
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [3, 6, 7]
    M.train_phase(torch.nn.Linear(4, 1), sq_loss, _ListLoader(toy_batches()), toy_args(), 0, 1, "cpu", 7,
                  out_dir=str(tmp_path), tag="t")   # a fresh run into the same out_dir starts a fresh log
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [3, 6, 7]
    files = ["config.json", "model.safetensors", "sha256.json", "state.pt"]
    assert sorted(os.listdir(tmp_path / "checkpoint")) == files
    # the save before the newest is kept, for a damaged newest one to fall back to
    assert saved_step(tmp_path) == 7 and not os.path.exists(tmp_path / "checkpoint.tmp")
    assert torch.load(tmp_path / "checkpoint.prev" / "state.pt", weights_only=True)["step"] == 6


def test_non_finite_weights_are_never_saved(tmp_path):
    """Every loss is finite but the weights turn NaN in step 4 (after its loss was taken): the
    save at step 4 refuses, the step-2 checkpoint stays."""
    def poisoning_loss(m, x):
        loss, parts = sq_loss(m, x)
        if not torch.isnan(x).any() and x[0, 0].item() == toy_batches()[3][0, 0].item():
            with torch.no_grad():
                m.weight.fill_(float("nan"))
        return loss, parts
    torch.manual_seed(0)
    with pytest.raises(M.NonFiniteError, match="non-finite weights at step 4"):
        M.train_phase(torch.nn.Linear(4, 1), poisoning_loss, _ListLoader(toy_batches()), toy_args(log_interval=100),
                      0, 1, "cpu", 7, out_dir=str(tmp_path), tag="t")
    assert saved_step(tmp_path) == 2
    assert all(torch.isfinite(v).all() for v in load_file(str(tmp_path / "checkpoint" / "model.safetensors")).values())


def test_non_finite_exit_code_is_1(monkeypatch, capsys):
    def diverge(a):
        raise M.NonFiniteError("extract: non-finite loss at a step <= 3; stopped, the last good checkpoint is kept")
    monkeypatch.setattr(M, "cmd_report", diverge)
    with pytest.raises(SystemExit) as e:
        M.main(["report", "--results", "x"])
    assert e.value.code == 1 and capsys.readouterr().err.strip().startswith("extract: non-finite loss")


def extract_args(teacher, out):  # noqa: F811
    return EXTRACT + ["--teacher", str(teacher), "--out_dir", str(out)]


def test_resume_rewinds_metrics_and_falls_back_to_prev(teacher, tmp_path, capsys):  # noqa: F811
    args = extract_args(teacher, tmp_path / "r")
    M.main(args)                                   # 3 steps in one go: the reference
    one = load_file(str(tmp_path / "r" / "learngene.safetensors"))
    args = extract_args(teacher, tmp_path / "s")
    with pytest.raises(SystemExit):
        M.main(args + ["--stop_at", "2"])
    ck = tmp_path / "s" / "checkpoint"
    with open(tmp_path / "s" / "metrics.jsonl", "a") as f:      # logged after the checkpoint, then killed
        f.write(json.dumps({"step": 3, "loss": 0.0}) + "\n")
    shutil.copytree(ck, tmp_path / "s" / "checkpoint.prev")       # a complete previous checkpoint
    data = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(data[: len(data) // 2])  # killed mid-write of the newer one
    capsys.readouterr()
    M.main(args + ["--resume"])
    assert "resuming from the previous checkpoint" in capsys.readouterr().err
    two = load_file(str(tmp_path / "s" / "learngene.safetensors"))
    assert all(torch.equal(one[k], two[k]) for k in one)
    steps = [json.loads(x)["step"] for x in open(tmp_path / "s" / "metrics.jsonl")]
    assert steps == [1, 2, 3]


def rewrite_state(folder, change):
    """state.pt changed by `change(state)` and sha256.json made to vouch for it (a state of wrong types
    that no checksum catches)."""
    st = torch.load(folder / "state.pt", weights_only=True)
    change(st)
    torch.save(st, folder / "state.pt")
    sums = json.loads((folder / "sha256.json").read_text())
    sums["state.pt"] = M.lifecycle.sha256(folder / "state.pt")
    (folder / "sha256.json").write_text(json.dumps(sums))


DAMAGE = {"truncate": (lambda ck: (ck / "state.pt").write_bytes((ck / "state.pt").read_bytes()[:40]),
                       "state.pt: damaged"),
          "bitflip": (lambda ck: (ck / "model.safetensors").write_bytes(
              (lambda b: b[:-3] + bytes([b[-3] ^ 1]) + b[-2:])((ck / "model.safetensors").read_bytes())),
                      "model.safetensors: damaged"),
          "missing": (lambda ck: os.remove(ck / "config.json"), "config.json: missing"),
          "no_sums": (lambda ck: os.remove(ck / "sha256.json"), "sha256.json: no such file"),
          "types": (lambda ck: rewrite_state(ck, lambda st: st.update(step="7")), "state.pt: wrong types"),
          "deep_types": (lambda ck: rewrite_state(ck, lambda st: st["rng"].update(python=[1])),
                         "state.pt: wrong types")}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_checkpoint_without_prev_is_one_error_line(teacher, tmp_path, capsys, damage):  # noqa: F811
    args = extract_args(teacher, tmp_path / "s")
    with pytest.raises(SystemExit):
        M.main(args + ["--stop_at", "1"])
    harm, fragment = DAMAGE[damage]
    harm(tmp_path / "s" / "checkpoint")
    expect_error(args + ["--resume"], capsys, fragment)


@pytest.mark.parametrize("damage", ["truncate", "types", "missing"])
def test_damaged_newest_falls_back_to_prev_with_a_note(teacher, tmp_path, capsys, damage):  # noqa: F811
    """Saves at steps 1 and 2 (checkpoint.prev/ is step 1's); step 2's damaged: the run resumes
    from step 1 with one note and ends with the one-go learngene."""
    ref = tmp_path / "ref"
    M.main(extract_args(teacher, ref))
    args = extract_args(teacher, tmp_path / "s") + ["--save_interval", "1"]
    with pytest.raises(SystemExit):
        M.main(args + ["--stop_at", "2"])
    DAMAGE[damage][0](tmp_path / "s" / "checkpoint")
    capsys.readouterr()
    M.main(args + ["--resume"])
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("note: ") and "previous checkpoint" in err[0] \
        and "(step 1)" in err[0] and DAMAGE[damage][1] in err[0], err
    a, b = (load_file(str(d / "learngene.safetensors")) for d in (ref, tmp_path / "s"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_to_the_process_group_with_two_workers(teacher, tmp_path):  # noqa: F811
    """As torchrun's agent and SLURM do: SIGTERM to every process (agent, ranks, loader workers).
    The workers ignore it, the ranks agree on a step, rank 0 saves once, the ranks exit 0;
    the resumed run ends with the uninterrupted run's learngene."""
    out = tmp_path / "s"
    argv = extract_args(teacher, out) + ["--num_workers", "2", "--max_steps", "100000"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                os.path.join(ROOT, "mm_learngene.py")]
    p = subprocess.Popen(torchrun + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT,
                         start_new_session=True)
    t0 = time.time()
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 2:
        assert p.poll() is None and time.time() - t0 < 120, "training never started"
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    step = saved_step(out)
    assert f"stopped by SIGTERM at step {step}/100000 | checkpoint saved | continue with: torchrun " \
        f"--nproc_per_node=2 mm_learngene.py extract --resume --out_dir {out}" in stderr, stderr
    assert "DataLoader worker" not in stderr and "non-finite" not in stderr, stderr
    # same --max_steps (the LR schedule depends on it), both stopped one step later
    more = ["--num_workers", "2", "--max_steps", "100000", "--stop_at", str(step + 1)]
    run_cli(extract_args(teacher, out) + more + ["--resume"], nproc=2)
    run_cli(extract_args(teacher, tmp_path / "ref") + more, nproc=2)
    a, b = (load_file(str(d / "checkpoint" / "model.safetensors")) for d in (out, tmp_path / "ref"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_teacher_quick_gelu_flag_with_open_clip(tmp_path, teacher):  # noqa: F811
    """open_clip's random ViT-B-32 (GELU) and ViT-B-32-quickgelu with the same weights, saved as
    one bare OpenAI-layout file: the default (a bare file = QuickGELU) matches the quickgelu
    model and not the GELU one; --no-quick_gelu the reverse."""
    from conftest import import_open_clip
    open_clip = import_open_clip()
    images = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    quick = open_clip.create_model("ViT-B-32-quickgelu", pretrained=None).eval()
    plain = open_clip.create_model("ViT-B-32", pretrained=None).eval()
    plain.load_state_dict(quick.state_dict())
    path = tmp_path / "ViT-B-32.safetensors"
    save_file({k: v.contiguous() for k, v in quick.state_dict().items()}, str(path))
    shutil.copy(teacher / "tokenizer.json", tmp_path / "tokenizer.json")
    with torch.no_grad():
        feats = {True: torch.nn.functional.normalize(quick.encode_image(images), dim=-1),
                 False: torch.nn.functional.normalize(plain.encode_image(images), dim=-1)}
        for flag, want in ((None, True), (False, False)):
            model, _, cfg = M.load_teacher(str(path), quick_gelu=flag)
            assert cfg.quick_gelu is want
            mine = model.encode_image(images)
            torch.testing.assert_close(mine, feats[want], rtol=1e-4, atol=1e-4)
            assert not torch.allclose(mine, feats[not want], atol=1e-3)


def test_teacher_readers_accept_every_layout(teacher, tmp_path):  # noqa: F811
    """out_dir with checkpoint/ (COMMON layout), the checkpoint/ folder itself, the old layout
    (model.safetensors in out_dir) and a bare weights file all give the same teacher."""
    out = tmp_path / "run"
    shutil.copytree(teacher, out / "checkpoint")
    (out / "checkpoint" / "model.safetensors").rename(out / "checkpoint" / "model.safetensors.tmp")
    save_file(load_file(str(out / "checkpoint" / "model.safetensors.tmp")),
              str(out / "checkpoint" / "model.safetensors"), metadata={"step": "5"})
    (out / "model.safetensors").write_bytes(b"a stale file the reader must not take")
    ref, _, ref_cfg = M.load_teacher(str(teacher))
    for path in (out, out / "checkpoint", teacher / "model.safetensors"):
        model, tok, cfg = M.load_teacher(str(path))
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
        assert cfg == ref_cfg                 # the config.json beside a weights file is read too


# --- the run lifecycle (common to the three training scripts) and write errors ----------------


def test_full_disk_is_one_line_and_keeps_the_previous_checkpoint(teacher, tmp_path, capsys, monkeypatch):  # noqa: F811
    """The writer fails with ENOSPC at the step-4 save (after writing part of a file): one error
    line naming out_dir and the size needed, exit 2, checkpoint.tmp/ gone, step 2's checkpoint
    as it was."""
    out = str(tmp_path / "o")
    disk_full_at_save(monkeypatch, 4)
    expect_error(extract_args(teacher, out) + ["--max_steps", "4", "--save_interval", "2"], capsys, "MiB needed")
    assert not os.path.exists(os.path.join(out, "checkpoint.tmp")) and saved_step(out) == 2
    M.lifecycle.read_checkpoint(os.path.join(out, "checkpoint"), M.STATE_TYPES)       # complete, its sha256 sums hold


@pytest.mark.parametrize("what", ["metrics", "png", "results"])
def test_write_errors_anywhere_are_one_line(teacher, tmp_path, capsys, monkeypatch, what):  # noqa: F811
    """EIO on metrics.jsonl, EFBIG on the loss curve PNG, EDQUOT on a finetune's results JSON:
    one error line naming the file, exit 2."""
    code = {"metrics": errno.EIO, "png": errno.EFBIG, "results": errno.EDQUOT}[what]
    if what == "metrics":
        def log(path, *a):
            raise OSError(code, os.strerror(code), path)
        monkeypatch.setattr(M.lifecycle, "log_record", log)
    elif what == "png":
        def draw(path, *a, **k):
            raise OSError(code, os.strerror(code), path)
        monkeypatch.setattr(M.lifecycle, "draw_curves", draw)
    else:
        real = M.atomic_write_json

        def write(obj, path):
            if path.endswith("results.json"):
                raise OSError(code, os.strerror(code), path)
            real(obj, path)
        monkeypatch.setattr(M, "atomic_write_json", write)
    if what == "results":
        args = ["finetune", "--init", "scratch", "--max_steps", "1", "--warmup", "1", "--batch_size", "8",
                "--eval_size", "8", "--out_dir", str(tmp_path / "o")]
    else:
        args = extract_args(teacher, tmp_path / "o")
    with pytest.raises(SystemExit) as e:
        M.main(args)
    err = "\n".join(error_lines(capsys.readouterr().err))
    assert e.value.code == 2 and err.startswith("error: ") and "\n" not in err and os.strerror(code).lower() in err, err
    assert {"metrics": "metrics.jsonl", "png": "loss_curve.png", "results": "results.json"}[what] in err


def test_a_second_run_on_a_busy_out_dir_exits_2_naming_the_holder(teacher, tmp_path, capsys):  # noqa: F811
    out = str(tmp_path / "o")
    os.makedirs(out)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"f = open({os.path.join(out, '.lock')!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
                               "f.truncate(0); f.write(str(os.getpid())); f.flush(); print('held', flush=True)\n"
                               "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        expect_error(extract_args(teacher, out), capsys, f"process {holder.pid}")
        assert sorted(os.listdir(out)) == [".lock"]                  # nothing written
    finally:
        holder.kill()
        holder.wait()
    M.main(extract_args(teacher, out))        # the holder's lock went with it
    assert saved_step(out) == 3


def test_resume_with_nothing_to_resume_is_one_error_line(teacher, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "o"
    os.makedirs(out / "checkpoint.tmp")     # a SIGTERM before the first save was complete
    expect_error(extract_args(teacher, out) + ["--resume"], capsys, "nothing to resume yet")
    expect_error(["extract", "--out_dir", str(out), "--resume"], capsys, "nothing to resume yet")
    expect_error(["extract", "--out_dir", str(out)], capsys, "extract needs --init")


def test_resume_with_only_out_dir_continues_with_the_saved_flags(teacher, tmp_path, capsys):  # noqa: F811
    """extract and finetune: stopped, then `--resume --out_dir X` alone ends with the one-go run's
    weights; run control (--log_interval) may change, a run-defining flag may not."""
    M.main(extract_args(teacher, tmp_path / "one") + ["--lr", "3e-3"])
    with pytest.raises(SystemExit):
        M.main(extract_args(teacher, tmp_path / "two") + ["--lr", "3e-3", "--stop_at", "1"])
    expect_error(["extract", "--out_dir", str(tmp_path / "two"), "--resume", "--lr", "1e-3"], capsys,
                 "--lr 0.001 differs from the saved run's 0.003")
    expect_error(["extract", "--out_dir", str(tmp_path / "two"), "--resume", "--aux_width", "64"], capsys,
                 "--aux_width 64 differs")
    M.main(["extract", "--out_dir", str(tmp_path / "two"), "--resume", "--log_interval", "2", "--lr", "3e-3"])
    a, b = (load_file(str(tmp_path / d / "learngene.safetensors")) for d in ("one", "two"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    M.main(["expand", "--learngene", str(tmp_path / "one" / "learngene.safetensors"), "--layers", "3",
            "--out_dir", str(tmp_path / "d")])
    ft = ["finetune", "--init", str(tmp_path / "d"), "--activate_steps", "2", "--max_steps", "3", "--batch_size",
          "8", "--eval_size", "8"]
    M.main(ft + ["--out_dir", str(tmp_path / "f1")])
    with pytest.raises(SystemExit):     # after the activation, in fine-tuning
        M.main(ft + ["--out_dir", str(tmp_path / "f2"), "--stop_at", "2"])
    capsys.readouterr()
    expect_error(["finetune", "--out_dir", str(tmp_path / "f2"), "--resume", "--task", "classification"], capsys,
                 "--task classification differs from the saved run's retrieval")
    M.main(["finetune", "--out_dir", str(tmp_path / "f2"), "--resume"])
    ra, rb = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("f1", "f2"))
    assert ra == rb


def test_new_run_on_a_checkpoint_needs_overwrite(teacher, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "o"
    M.main(extract_args(teacher, out))
    before = (out / "checkpoint" / "state.pt").read_bytes()
    expect_error(extract_args(teacher, out), capsys,
                 "continue it with --resume, or use another --out_dir, or --overwrite")
    assert (out / "checkpoint" / "state.pt").read_bytes() == before
    (out / "notes.txt").write_text("the user's own file")
    M.main(extract_args(teacher, out) + ["--overwrite", "--max_steps", "2"])
    assert saved_step(out) == 2 and not (out / "checkpoint.prev").exists() and (out / "notes.txt").exists()
    assert [json.loads(x)["step"] for x in open(out / "metrics.jsonl")] == [1, 2]
    ft = tmp_path / "ft"
    args = ["finetune", "--init", "scratch", "--max_steps", "1", "--warmup", "1", "--batch_size", "8", "--eval_size",
            "8", "--out_dir", str(ft)]
    M.main(args)
    expect_error(args, capsys, "--overwrite")
    M.main(args + ["--overwrite"])


def test_a_warmup_longer_than_the_run_is_cut_to_a_tenth(tmp_path, capsys, monkeypatch):
    lrs = []
    real = M.get_lr
    monkeypatch.setattr(M, "get_lr", lambda step, n, lr, warmup: (lrs.append(warmup), real(step, n, lr, warmup))[1])
    M.train_phase(torch.nn.Linear(4, 1), sq_loss, _ListLoader(toy_batches()), toy_args(warmup=10_000), 0, 1, "cpu",
                  30, tag="t")
    err = capsys.readouterr().err.strip().splitlines()
    assert set(lrs) == {3} and len(err) == 1 and err[0].startswith("note: t: the warm-up of 10000 steps") \
        and "warming up for 3 steps (10% of the run)" in err[0], err
    lrs.clear()
    M.train_phase(torch.nn.Linear(4, 1), sq_loss, _ListLoader(toy_batches()), toy_args(warmup=20), 0, 1, "cpu", 30)
    assert set(lrs) == {20} and capsys.readouterr().err == ""


def _start(argv, out, after=0):
    """The script in a process of its own, once it has logged a step after `after`."""
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "mm_learngene.py")] + argv, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    t0 = time.time()
    while not (out / "metrics.jsonl").exists() or \
            not any(json.loads(x)["step"] > after for x in (out / "metrics.jsonl").read_text().splitlines()):
        assert p.poll() is None and time.time() - t0 < 120, p.communicate()
        time.sleep(0.1)
    return p


def test_ctrl_c_saves_like_sigterm_and_a_second_exits_at_once(teacher, tmp_path, capsys, monkeypatch):  # noqa: F811
    out = tmp_path / "s"
    p = _start(extract_args(teacher, out) + ["--max_steps", "100000"], out)
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=120)
    step = saved_step(out)
    assert p.returncode == 0 and f"stopped by SIGINT at step {step}/100000 | checkpoint saved" in stderr, stderr
    assert f"continue with: python mm_learngene.py extract --resume --out_dir {out}" in stderr
    real = M.distill_loss

    def two_ctrl_c(*a):          # two Ctrl-C within one step: the second one exits at once
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        return real(*a)

    def exit_now(code):         # os._exit would end pytest too: the same exit, with the cleanup visible
        raise SystemExit(code)
    monkeypatch.setattr(M, "distill_loss", two_ctrl_c)
    monkeypatch.setattr(os, "_exit", exit_now)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        M.main(["extract", "--out_dir", str(out), "--resume"])
    err = error_lines(capsys.readouterr().err)
    assert e.value.code == 130 and err == ["error: interrupted again: exiting without saving"], err
    assert saved_step(out) == step and signal.getsignal(signal.SIGINT) is not M.lifecycle._on_stop_signal


def test_a_sigterm_during_the_final_save_does_not_kill_the_run(teacher, tmp_path, monkeypatch):  # noqa: F811
    real = M.atomic_save_file

    def save_and_signal(tensors, path, metadata=None):
        os.kill(os.getpid(), signal.SIGTERM)          # the handler is still installed: a flag, not an exit
        real(tensors, path, metadata)
    monkeypatch.setattr(M, "atomic_save_file", save_and_signal)
    M.main(extract_args(teacher, tmp_path / "o"))
    assert (tmp_path / "o" / "learngene.safetensors").exists() and saved_step(tmp_path / "o") == 3


@pytest.mark.parametrize("limit", [50_000, 600_000])    # inside model.safetensors (~396 kB), inside state.pt (~841 kB)
def test_a_real_file_size_limit_during_a_checkpoint_save_is_one_line(teacher, tmp_path, limit):  # noqa: F811
    """EFBIG from the kernel (RLIMIT_FSIZE; Python ignores SIGXFSZ) while the checkpoint is written, in
    safetensors' writer (which says "(os error 27)" only in its message) and in torch.save's: one line, exit 2."""
    import resource

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    out = tmp_path / "o"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "mm_learngene.py")] + extract_args(teacher, out) +
                       ["--save_interval", "1"], preexec_fn=small_files, capture_output=True, text=True, env=ENV,
                       cwd=ROOT, timeout=240)
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error") or "Traceback" in ln]
    assert r.returncode == 2 and len(err) == 1, r.stderr[-3000:]
    assert err[0].startswith(f"error: {out}: file too large for the step-1 checkpoint"), err
    assert not (out / "checkpoint.tmp").exists()
