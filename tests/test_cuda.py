"""Every script's CUDA path on a machine with a GPU: short runs with `--device cuda` (bf16 autocast,
the default there), `--compile` where a script has it, nccl under torchrun. Skipped without CUDA
(CI has none): run `python -m pytest -q tests/test_cuda.py` on a GPU machine."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ANCESTRY = ["--method", "clip", "--model_args", "width=64", "heads=4", "layers=6", "image_size=32", "patch_size=8",
            "context_length=24", "--batch_size", "32", "--eval_size", "0", "--max_steps", "40"]


def run(script, *args, torchrun=False, timeout=600):
    pre = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"] if torchrun else [])
    r = subprocess.run(pre + [os.path.join(ROOT, script), *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout


def losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def test_il_clip_and_eval_on_cuda(tmp_path):
    neg = tmp_path / "negclip"
    table = run("il_clip.py", "--device", "cuda", "--compile", "--method", "negclip", "--max_steps", 60,
                "--eval_size", 100, "--out_dir", neg)
    assert "| i2t_r1 |" in table and losses(neg)[-1] < losses(neg)[0]
    run("il_clip.py", "--device", "cuda", "--t_warm", 10, "--t_distill", 5, "--t_interact", 5, "--generations", 2,
        "--t_extend", 0, "--eval_size", 0, "--out_dir", tmp_path / "il", torchrun=True)     # nccl, two spawns
    assert os.path.isfile(tmp_path / "il" / "gen2" / "model.safetensors")
    run("eval_compositional.py", "--device", "cuda", "--ckpt", neg, "--eval_size", 100, "--out", tmp_path / "eval.json")
    assert json.loads((tmp_path / "eval.json").read_text())


def test_mm_learngene_on_cuda(tmp_path):
    run("il_clip.py", "--device", "cuda", *ANCESTRY, "--out_dir", tmp_path / "ancestry")
    run("mm_learngene.py", "extract", "--device", "cuda", "--compile", "--teacher", tmp_path / "ancestry",
        "--aux_width", 32, "--aux_heads", 2, "--max_steps", 40, "--batch_size", 32, "--out_dir", tmp_path / "lg")
    run("mm_learngene.py", "expand", "--learngene", tmp_path / "lg" / "learngene.safetensors", "--layers", 8,
        "--out_dir", tmp_path / "d8")
    for task in ("retrieval", "caption", "classification"):
        out = tmp_path / f"ft_{task}"
        run("mm_learngene.py", "finetune", "--device", "cuda", "--init", tmp_path / "d8", "--task", task,
            "--max_steps", 30, "--batch_size", 32, "--activate_data", "shapes:train_size=320", "--eval_size", 50,
            "--out_dir", out)
        assert os.path.isfile(out / "results.json")


def test_composer_on_cuda(tmp_path):
    out = tmp_path / "composer"
    run("composer.py", "train", "--device", "cuda", "--compile", "--max_steps", 60, "--eval_size", 50, "--out_dir", out)
    assert losses(out)[-1] < losses(out)[0]
    run("composer.py", "eval", "--device", "cuda", "--ckpt", out, "--eval_size", 50, "--out", tmp_path / "eval.json")
    assert json.loads((tmp_path / "eval.json").read_text())
