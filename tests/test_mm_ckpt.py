"""mm_learngene.py training that survives preemption and divergence: the checkpoint/ folder
atomic as a set with a fallback to checkpoint.prev/, no checkpoint with non-finite weights,
saves at --save_interval's own multiples, metrics.jsonl rewound on resume, SIGTERM to
torchrun's whole process group with 2 loader workers; the teacher's --quick_gelu."""
import argparse
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
from test_mm_learngene import EXTRACT, ENV, ROOT, _ListLoader, expect_error, run_cli, teacher  # noqa: F401


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
    real = M.write_checkpoint
    monkeypatch.setattr(M, "write_checkpoint", lambda *a, **k: (saved.append(a[4]["step"]), real(*a, **k)))
    torch.manual_seed(0)
    M.train_phase(torch.nn.Linear(4, 1), sq_loss, _ListLoader(toy_batches()), toy_args(), 0, 1, "cpu", 7,
                  out_dir=str(tmp_path), tag="t")
    assert saved == [2, 4, 6, 7]
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [3, 6, 7]
    M.train_phase(torch.nn.Linear(4, 1), sq_loss, _ListLoader(toy_batches()), toy_args(), 0, 1, "cpu", 7,
                  out_dir=str(tmp_path), tag="t")   # a fresh run into the same out_dir starts a fresh log
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [3, 6, 7]
    assert sorted(os.listdir(tmp_path / "checkpoint")) == sorted(M.CHECKPOINT_FILES)
    assert not os.path.exists(tmp_path / "checkpoint.prev") and not os.path.exists(tmp_path / "checkpoint.tmp")


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
    assert json.loads((tmp_path / "checkpoint" / "train_state.json").read_text())["step"] == 2
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
    assert "resuming from the previous complete checkpoint" in capsys.readouterr().err
    two = load_file(str(tmp_path / "s" / "learngene.safetensors"))
    assert all(torch.equal(one[k], two[k]) for k in one)
    steps = [json.loads(x)["step"] for x in open(tmp_path / "s" / "metrics.jsonl")]
    assert steps == [1, 2, 3]


@pytest.mark.parametrize("damage", ["truncate", "json", "steps", "missing"])
def test_damaged_checkpoint_without_prev_is_one_error_line(teacher, tmp_path, capsys, damage):  # noqa: F811
    args = extract_args(teacher, tmp_path / "s")
    with pytest.raises(SystemExit):
        M.main(args + ["--stop_at", "1"])
    ck = tmp_path / "s" / "checkpoint"
    if damage == "truncate":
        (ck / "train_state.safetensors").write_bytes((ck / "train_state.safetensors").read_bytes()[:40])
    elif damage == "json":
        (ck / "train_state.json").write_text('{"step": 1, "loa')
    elif damage == "steps":
        sd = load_file(str(ck / "model.safetensors"))
        save_file(sd, str(ck / "model.safetensors"), metadata={"step": "7"})
    else:
        os.remove(ck / "config.json")
    expect_error(args + ["--resume"], capsys, {"truncate": "train_state.safetensors: damaged",
                                               "json": "train_state.json: malformed JSON", "steps": "from step 7",
                                               "missing": "config.json: missing"}[damage])


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
    step = json.loads((out / "checkpoint" / "train_state.json").read_text())["step"]
    assert f"SIGTERM, checkpoint saved at step {step}" in stdout, stderr
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
    save_file(load_file(str(out / "checkpoint" / "model.safetensors.tmp")), str(out / "checkpoint" / "model.safetensors"),
              metadata={"step": "5"})
    (out / "model.safetensors").write_bytes(b"a stale file the reader must not take")
    ref, _, ref_cfg = M.load_teacher(str(teacher))
    for path in (out, out / "checkpoint", teacher / "model.safetensors"):
        model, tok, cfg = M.load_teacher(str(path))
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
        assert cfg == ref_cfg                 # the config.json beside a weights file is read too
