"""eval_compositional.py end to end on a tiny il_clip.py checkpoint (trained here for two
steps with il_clip's smallest settings): the CLI, the analysis probes, generation
snapshots, and the one-line errors for checkpoints it must refuse."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import data
import eval_compositional as E
import il_clip

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--width", "32", "--layers", "1", "--heads", "2", "--embed_dim", "32", "--image_size", "32",
        "--patch_size", "8", "--batch_size", "8", "--code_dim", "32", "--eval_n", "0", "--warmup", "1",
        "--max_steps", "2", "--vocab_size", "300"]
FAST = ["--shapes_n", "5", "--probe_steps", "4", "--probe_eval_every", "2", "--probe_eval_n", "16",
        "--probe_batch", "8", "--viz_images", "20", "--viz_codes", "3", "--viz_topk", "2", "--power_iters", "30",
        "--no_progress"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for name, method in (("codebook", ["--method", "codebook", "--codebook", "32"]), ("clip", ["--method", "clip"])):
        out[name] = str(root / name)
        assert il_clip.main(TINY + method + ["--out_dir", out[name], "--seed", "1" if name == "clip" else "0"]) in (0, None)
    return out


def test_cli_end_to_end(ckpts, tmp_path):
    ck = ckpts["codebook"]
    sd = load_file(os.path.join(ck, "checkpoint", "model.safetensors"))
    for g in (1, 2):  # generation snapshots (Fig. 4): weights only, in the model's layout
        os.makedirs(os.path.join(ck, f"gen{g}"), exist_ok=True)
        save_file({k: v * (1.0 + 0.1 * g) if v.dim() >= 2 else v for k, v in sd.items()},
                  os.path.join(ck, f"gen{g}", "model.safetensors"))
    out = tmp_path / "res.json"
    p = subprocess.run([sys.executable, "eval_compositional.py", "--ckpt", ck, "--out", str(out),
                        "--benchmarks", "shapes,sugarcrepe,lipschitz,codebook,easy_to_learn",
                        "--probe_ckpts", ckpts["clip"]] + FAST,
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("| benchmark | metric | value |") and "| shapes | mean_7 |" in p.stdout
    assert "skipped sugarcrepe: no --sugarcrepe given" in p.stderr
    res = json.loads(out.read_text())["results"]
    assert set(res) == {"shapes", "lipschitz", "codebook", "easy_to_learn"}
    assert all(0 <= res["shapes"][c] <= 100 for c in data.SHAPES_CATEGORIES)
    # weights scaled by 1.1 then 1.2: every spectral norm scales, so the bound grows
    gens = res["lipschitz"]["generations"]
    assert [g["snapshot"] for g in gens] == ["gen1", "gen2"]
    assert gens[0]["log10_bound"] < gens[1]["log10_bound"]
    curves = res["easy_to_learn"]
    assert {"codebook", "clip"} <= set(curves) and [c["step"] for c in curves["codebook"]["curve"]] == [0, 2, 4]
    assert len(res["codebook"]["codes"]) == 3
    for png in ("lipschitz.png", "easy_to_learn.png", "codebook.png"):
        assert os.path.getsize(tmp_path / png) > 0


def test_code_scores_reproduce_the_models_image_embedding(ckpts):
    model, tok, config = E.load_checkpoint(ckpts["codebook"])
    x = torch.stack([data.eval_transform(32)(data.shapes_scene("test", i).image) for i in range(4)])
    with torch.no_grad():
        s, w = E.image_code_scores(model, x)
        assert torch.allclose(w.sum(-1), torch.ones(4), atol=1e-5) and (w >= 0).all()
        assert torch.allclose(torch.nn.functional.normalize(w @ model.codebook, dim=-1), model.encode_image(x), atol=1e-5)


def test_fresh_language_agent_is_the_same_for_every_checkpoint(ckpts):
    a = E.load_checkpoint(ckpts["codebook"])[0]
    b = E.load_checkpoint(ckpts["codebook"])[0]
    with torch.no_grad():
        for p in b.visual.parameters():
            p.add_(1.0)  # another "teacher" of the same architecture
    sa, sb = E.fresh_language_agent(a, 7), E.fresh_language_agent(b, 7)
    lang = {n for n, _ in il_clip.agent_params(a, "language")}
    pa, pb, orig = dict(sa.named_parameters()), dict(sb.named_parameters()), dict(a.named_parameters())
    for n in pa:
        if n in lang:
            assert torch.equal(pa[n], pb[n]) and pa[n].requires_grad, n
            assert not torch.equal(pa[n], orig[n]), n
        else:
            assert torch.equal(pa[n], orig[n]) and not pa[n].requires_grad, n


def test_refuses_other_methods_and_tokenizer_mismatch(ckpts, tmp_path, capsys):
    other = tmp_path / "composer"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"args": {}, "model": {"dim": 32, "concept_layers": 2}}))
    shutil.copy(os.path.join(ckpts["clip"], "checkpoint", "model.safetensors"), other)
    assert E.main(["--ckpt", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "another method" in err and len(err.splitlines()) == 1

    bad_tok = tmp_path / "badtok"
    shutil.copytree(ckpts["clip"], bad_tok)
    data.build_tokenizer(captions=data.shapes_captions(200), vocab_size=280, context_length=32).save(str(bad_tok / "checkpoint"))
    assert E.main(["--ckpt", str(bad_tok)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "tokenizer mismatch" in err and len(err.splitlines()) == 1

    assert E.main(["--ckpt", str(tmp_path / "nothing")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
    assert E.main(["--ckpt", ckpts["clip"], "--benchmarks", "shapes,bogus"]) == 2
    assert "unknown benchmark(s) bogus" in capsys.readouterr().err


def test_malformed_benchmark_file_is_an_error_line_and_others_still_run(ckpts, tmp_path, capsys):
    sc = tmp_path / "sc"
    sc.mkdir()
    (sc / "add_obj.json").write_text('{"0": {"filename": "a.png",\n "caption": }')
    rc = E.main(["--ckpt", ckpts["clip"], "--benchmarks", "sugarcrepe,lipschitz", "--sugarcrepe", str(sc),
                 "--sugarcrepe_images", str(sc), "--out", str(tmp_path / "r.json")] + FAST)
    captured = capsys.readouterr()
    assert rc == 2 and f"error: sugarcrepe: {sc / 'add_obj.json'}: line 2: invalid JSON" in captured.err
    blob = json.loads((tmp_path / "r.json").read_text())
    assert "lipschitz" in blob["results"] and "sugarcrepe" in blob["errors"]
