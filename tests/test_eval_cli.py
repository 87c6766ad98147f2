"""eval_compositional.py end to end on a tiny il_clip.py checkpoint (trained here for two
steps with il_clip's smallest settings): the CLI, the analysis probes, generation
snapshots, and the one-line errors for checkpoints it must refuse."""
import errno
import json
import os
import resource
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import data
import eval_compositional as E
from conftest import read_figure
import il_clip
import lifecycle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model_args", "width=32", "layers=1", "heads=2", "embed_dim=32", "image_size=32", "patch_size=8",
        "code_dim=32", "--batch_size", "8", "--eval_size", "0", "--warmup", "1",
        "--max_steps", "2", "--vocab_size", "300"]
FAST = ["--eval_size", "5", "--probe_steps", "4", "--probe_eval_every", "2", "--probe_eval_size", "16",
        "--probe_batch", "8", "--viz_images", "20", "--viz_codes", "3", "--viz_topk", "2",
        "--no_progress"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for name, method in (("codebook", ["--method", "codebook", "--codebook", "32"]), ("clip", ["--method", "clip"])):
        out[name] = str(root / name)
        assert il_clip.main(TINY + method + ["--out_dir", out[name],
                                             "--seed", "1" if name == "clip" else "0"]) in (0, None)
    return out


def test_cli_end_to_end(ckpts, tmp_path, monkeypatch, capsys):
    """The command as a user runs it (in this process, so the figures can be read): the table on stdout, one start
    and one done line on stderr, the JSON, and each PNG's figure drawn from the numbers in the JSON."""
    ck = ckpts["codebook"]
    sd = load_file(os.path.join(ck, "checkpoint", "model.safetensors"))
    for g in (1, 2):  # generation snapshots (Fig. 4): weights only, in the model's layout
        os.makedirs(os.path.join(ck, f"gen{g}"), exist_ok=True)
        save_file({k: v * (1.0 + 0.1 * g) if v.dim() >= 2 else v for k, v in sd.items()},
                  os.path.join(ck, f"gen{g}", "model.safetensors"))
    figures = {}
    for name in ("draw_line_plot", "draw_image_grid"):     # the figures, as they are saved
        real = getattr(E, name)
        monkeypatch.setattr(E, name, lambda path, *a, real=real: figures.setdefault(os.path.basename(path),
                                                                                     real(path, *a)))
    out = tmp_path / "res.json"
    assert E.main(["--ckpt", ck, "--out", str(out), "--benchmarks", "shapes,sugarcrepe,spectral,codebook,easy_to_learn",
                   "--compare_ckpts", ckpts["clip"], "--num_workers", "1"] + FAST) == 0
    std = capsys.readouterr()
    assert std.out.startswith("| benchmark | metric | value | scored | skipped |")
    assert "activation GELU (preset)" in std.err  # the tiny preset's exact GELU, said once
    assert "skipped sugarcrepe: no --sugarcrepe given" in std.err
    err = std.err.splitlines()     # one start line; the end line last, naming what was written
    start = [ln for ln in err if ln.startswith("start: ")]
    assert len(start) == 1 and start[0].startswith(f"start: eval_compositional.py {ck} | benchmarks shapes,sugarcrepe,"
                                                   "spectral,codebook,easy_to_learn | ")
    assert start[0].endswith(f"M parameters | cpu x 1 | out {out}")
    assert err[-1].startswith("done: 4 of 5 benchmarks scored in ") and err[-1].endswith(
        f"| wrote {tmp_path}/{{res.json, spectral.png, codebook.png, easy_to_learn.png}}")
    res = json.loads(out.read_text())["results"]
    assert "sugarcrepe_mean" in res["shapes"] and "mean_7" not in res["shapes"]
    assert set(res) == {"shapes", "spectral", "codebook", "easy_to_learn"}
    assert all(0 <= res["shapes"][c] <= 100 for c in data.SHAPES_CATEGORIES)
    # the table: percents with one decimal, the spectral log10 values as they are
    assert f"| shapes | sugarcrepe_mean | {res['shapes']['sugarcrepe_mean']:.1f} |" in std.out
    assert f"| spectral | log10_product | {res['spectral']['log10_product']} |" in std.out
    # weights scaled by 1.1 then 1.2: every spectral norm scales, so the product grows
    gens = res["spectral"]["generations"]
    assert [g["snapshot"] for g in gens] == ["gen1", "gen2"]
    assert gens[0]["log10_product"] < gens[1]["log10_product"]
    assert set(res["spectral"]["compare"]) == {"clip"}  # Fig. 4: the other checkpoint on the same plot
    assert res["codebook"]["data"] == res["easy_to_learn"]["data"] == "shapes"  # the checkpoint's training data
    curves = res["easy_to_learn"]
    assert {"codebook", "clip"} <= set(curves) and [c["step"] for c in curves["codebook"]["curve"]] == [0, 2, 4]
    assert len(res["codebook"]["codes"]) == 3
    for png in ("spectral.png", "easy_to_learn.png", "codebook.png"):
        assert open(tmp_path / png, "rb").read(4) == b"\x89PNG" and png in figures
    # spectral.png: x the generation each snapshot ends (whole numbers), y the JSON's log10 of the vision product
    (ax,) = read_figure(figures["spectral.png"])
    assert ax["legend"] == ["codebook (gen{K}/ snapshots)", "clip (final weights, no snapshots)"]
    (_, x0, y0, _), (_, x1, y1, _) = ax["lines"]
    assert x0 == [1, 2] and y0 == pytest.approx([g["log10_vision"] for g in gens])
    assert x1 == [1, 2] and y1 == pytest.approx([res["spectral"]["compare"]["clip"]["log10_vision"]] * 2)
    assert ax["xticks"] == ["1", "2"] and ax["ylabel"] == "log10 of the product (unitless)"
    assert ax["xlabel"].startswith("generation")
    # easy_to_learn.png: one curve per checkpoint, the JSON's accuracy at each probe step; the curves stay apart
    (ax,) = read_figure(figures["easy_to_learn.png"])
    assert ax["legend"] == ["codebook: final weights", "clip: final weights"]
    for (label, xs, ys, line), name in zip(ax["lines"], ("codebook", "clip")):
        assert xs == [c["step"] for c in curves[name]["curve"]] and ys == [c["acc"] for c in curves[name]["curve"]]
    assert len({(line.get_marker(), line.get_linestyle()) for *_, line in ax["lines"]}) == 2
    assert ax["ylabel"] == "held-out in-batch accuracy (%)" and ax["xticks"] == ["0", "1", "2", "3", "4"]
    # codebook.png: a row per code in the JSON's order, its top images
    fig = figures["codebook.png"]
    read_figure(fig)
    rows = [ax.get_ylabel() for ax in fig.axes if ax.get_ylabel()]
    assert [r.split("\n")[0] for r in rows] == [f"code {c}" for c in res["codebook"]["codes"]]
    assert sum(len(ax.get_images()) for ax in fig.axes) == 3 * 2


def test_code_scores_reproduce_the_models_image_embedding(ckpts):
    model, tok, config = E.load_checkpoint(ckpts["codebook"], E.get_args(["--ckpt", ckpts["codebook"]]))
    x = torch.stack([data.eval_transform(32)(data.shapes_scene("test", i).image) for i in range(4)])
    x = data.normalize_images(x)  # uint8 -> the model's input, as eval does
    with torch.no_grad():
        s, w = E.image_code_scores(model, x)
        assert torch.allclose(w.sum(-1), torch.ones(4), atol=1e-5) and (w >= 0).all()
        assert torch.allclose(torch.nn.functional.normalize(w @ model.codebook, dim=-1), model.encode_image(x),
                              atol=1e-5)


def test_fresh_language_agent_is_the_same_for_every_checkpoint(ckpts):
    a = E.load_checkpoint(ckpts["codebook"], E.get_args(["--ckpt", ckpts["codebook"]]))[0]
    b = E.load_checkpoint(ckpts["codebook"], E.get_args(["--ckpt", ckpts["codebook"]]))[0]
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
    assert (err.startswith("error:") and f"use python composer.py eval --ckpt {other}" in err
            and len(err.splitlines()) == 1)

    bad_tok = tmp_path / "badtok"
    shutil.copytree(ckpts["clip"], bad_tok)
    data.build_tokenizer(captions=data.shapes_captions(200), vocab_size=280,
                         context_length=32).save(str(bad_tok / "checkpoint"))
    sums = lifecycle.read_json(str(bad_tok / "checkpoint" / "sha256.json"))   # in order: not a damaged file
    sums["tokenizer.json"] = lifecycle.sha256(str(bad_tok / "checkpoint" / "tokenizer.json"))
    lifecycle.save_json(str(bad_tok / "checkpoint" / "sha256.json"), sums)
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
    rc = E.main(["--ckpt", ckpts["clip"], "--benchmarks", "sugarcrepe,spectral", "--sugarcrepe", str(sc),
                 "--sugarcrepe_images", str(sc), "--out", str(tmp_path / "r.json")] + FAST)
    captured = capsys.readouterr()
    assert rc == 2 and f"error: sugarcrepe: {sc / 'add_obj.json'}: line 2: invalid JSON" in captured.err
    blob = json.loads((tmp_path / "r.json").read_text())
    assert "spectral" in blob["results"] and "sugarcrepe" in blob["errors"]


def test_quick_gelu_flag_builds_the_named_activation(ckpts):
    """--quick_gelu / --no-quick_gelu reach il_clip.load_model: the loaded model equals one built
    by hand with that activation and the same weights (the tiny preset itself is GELU)."""
    from dataclasses import replace
    ck = ckpts["clip"]
    x = torch.stack([data.eval_transform(32)(data.shapes_scene("test", i).image) for i in range(2)])
    x = data.normalize_images(x)  # uint8 -> the model's input, as eval does
    sd = load_file(os.path.join(ck, "checkpoint", "model.safetensors"))
    outs = {}
    for flag, quick in (([], False), (["--quick_gelu"], True), (["--no-quick_gelu"], False)):
        model, _, config = E.load_checkpoint(ck, E.get_args(["--ckpt", ck] + flag))
        cfg = replace(il_clip.ModelConfig(**config["model"]), quick_gelu=quick)
        ref = il_clip.CLIP(cfg).eval()
        ref.load_state_dict(sd)
        with torch.no_grad():
            outs[tuple(flag)] = model.encode_image(x)
            assert torch.allclose(outs[tuple(flag)], ref.encode_image(x), atol=1e-6), flag
    assert not torch.allclose(outs[()], outs[("--quick_gelu",)], atol=1e-6)


def test_new_checkpoint_layout_and_errors_at_the_end(ckpts, tmp_path, capsys):
    """out_dir/checkpoint/ (COMMON layout) with gen{g}/ snapshots in the out_dir, given as the
    out_dir or as its checkpoint/ folder. A wrong image path and a Winoground without images
    are error lines and exit 2 at the end; the other benchmarks still run and report."""
    out_dir = tmp_path / "run"
    shutil.copytree(os.path.join(ckpts["codebook"], "checkpoint"), out_dir / "checkpoint")
    os.makedirs(out_dir / "gen1")
    shutil.copy(out_dir / "checkpoint" / "model.safetensors", out_dir / "gen1")
    wino = tmp_path / "wino"
    wino.mkdir()
    (wino / "examples.jsonl").write_text(json.dumps({"id": 0, "image_0": "a", "image_1": "b", "caption_0": "x",
                                                     "caption_1": "y"}) + "\n")
    for ck in (out_dir, out_dir / "checkpoint"):
        rc = E.main(["--ckpt", str(ck), "--benchmarks", "shapes,spectral,sugarcrepe,winoground", "--out",
                     str(tmp_path / "r.json"), "--sugarcrepe", str(tmp_path), "--sugarcrepe_images",
                     str(tmp_path / "no_coco"), "--winoground", str(wino)] + FAST)
        captured = capsys.readouterr()
        blob = json.loads((tmp_path / "r.json").read_text())
        assert rc == 2 and set(blob["results"]) == {"shapes", "spectral", "winoground"}
        assert [g["snapshot"] for g in blob["results"]["spectral"]["generations"]] == ["gen1"]
        assert "no_coco: not found (given as --sugarcrepe_images)" in blob["errors"]["sugarcrepe"]
        assert blob["results"]["winoground"]["n_skipped"] == 1 and "scored nothing" in blob["errors"]["winoground"]
        assert "error: winoground: scored nothing" in captured.err
        assert "| winoground | text | null | 0 | 1 |" in captured.out and "| sugarcrepe | ERROR | " in captured.out


def test_analyses_need_data_for_bare_weights(ckpts, tmp_path):
    """Weights that do not say what they were trained on (--init: config without "data") need
    --probe_data / --viz_data, never a silent shapes; given any --data spec (here a CSV of
    real image files), the analysis runs on it and says so."""
    a = E.get_args(["--ckpt", ckpts["codebook"], "--plot_dir", str(tmp_path)] + FAST)
    model, tok, config = E.load_checkpoint(ckpts["codebook"], a)
    bare = {"model": config["model"]}  # what il_clip.load_model says of a bare weights file
    for bench, flag in ((E.bench_easy_to_learn, "probe_data"), (E.bench_codebook, "viz_data")):
        with pytest.raises(E.Skip, match=f"give --{flag}"):
            bench(a, model, tok, bare)
    rows = ["filepath,title"]
    for i in range(40):      # a CSV has no split: the probe holds out a seeded 10% of it
        scene = data.shapes_scene("val", i)
        scene.image.save(tmp_path / f"{i}.png")
        rows.append(f"{i}.png,{scene.caption}")
    (tmp_path / "pairs.csv").write_text("\n".join(rows) + "\n")
    a.viz_data, a.probe_data, a.probe_batch, a.probe_eval_size = (
        str(tmp_path / "pairs.csv"), str(tmp_path / "pairs.csv"), 3, 6)
    r = E.bench_codebook(a, model, tok, bare)
    assert r["data"] == a.viz_data and r["n_images"] == 20 and r["n_skipped"] == 0
    assert all(c in [s.split(",", 1)[1] for s in rows[1:]] for code in r["codes"].values() for c in code["captions"])
    r = E.bench_easy_to_learn(a, model, tok, bare)
    assert r["data"] == a.viz_data and [c["step"] for c in r["codebook"]["curve"]] == [0, 2, 4]


def test_init_weights_give_open_clips_embeddings_with_either_activation(tmp_path):
    """--init on OpenAI-layout weights saved from open_clip CLIP models (random, small, one
    with QuickGELU as ViT-B-32-quickgelu, one with GELU as the LAION/DataComp ViT-B-32):
    eval's loader with the matching --quick_gelu / --no-quick_gelu gives open_clip's image
    and text embeddings; the default (None) is OpenAI's QuickGELU."""
    from conftest import import_open_clip
    open_clip = import_open_clip()
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg
    from safetensors.torch import save_file
    vocab = os.path.join(os.path.dirname(open_clip.__file__), "bpe_simple_vocab_16e6.txt.gz")
    x = torch.randn(2, 3, 32, 32)
    for quick, flags in ((True, []), (True, ["--quick_gelu"]), (False, ["--no-quick_gelu"])):
        torch.manual_seed(0)
        ref = CLIP(32, CLIPVisionCfg(layers=2, width=64, head_width=64, patch_size=16, image_size=32),
                   CLIPTextCfg(context_length=77, vocab_size=49408, width=64, heads=1, layers=2),
                   quick_gelu=quick).eval()
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.02 * torch.randn_like(p))  # no zero-initialised biases: every weight matters
        path = tmp_path / f"w{int(quick)}.safetensors"
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
        model, tok, _ = E.load_checkpoint(str(path), E.get_args(["--init", str(path), "--vocab", vocab] + flags))
        text = tok(["a photo of a dog", "two red cubes left of a ball"])
        with torch.no_grad():
            assert torch.allclose(model.encode_image(x), F.normalize(ref.encode_image(x), dim=-1), atol=1e-5), flags
            assert torch.allclose(model.encode_text(text), F.normalize(ref.encode_text(text), dim=-1), atol=1e-5), flags


def test_help_is_grouped_with_informative_defaults(capsys):
    with pytest.raises(SystemExit):
        E.get_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for group in ("model: the checkpoint or weights to score:", "benchmarks and the built-in shapes data:",
                  "method: the analysis probes", "machine:", "output:"):
        assert group in text
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "--eval_size EVAL_SIZE shapes benchmark items per category" in text and "(default: 1000)" in text
    assert "--num_workers NUM_WORKERS DataLoader workers" in text
    a = E.get_args(["--init", "w.pt", "--num_workers", "2"])
    assert E.analysis_data(a, {"data": "shapes"}, "probe_data")[1]["num_workers"] == 2   # reaches make_loader


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO])
def test_a_failed_json_or_png_write_is_one_line(ckpts, tmp_path, monkeypatch, capsys, code):
    """The --out JSON: one error line, exit 2, no half file; a PNG: its benchmark's ERROR row, the others
    scored, exit 2."""
    from test_data_write_errors import fail_writes_under
    fail_writes_under(monkeypatch, tmp_path, code)
    out, why = tmp_path / "r.json", os.strerror(code).lower()
    assert E.main(["--ckpt", ckpts["clip"], "--eval_size", "5", "--no_progress", "--out", str(out)]) == 2
    std = capsys.readouterr()
    assert [ln for ln in std.err.splitlines() if "error" in ln] == [f"error: {out}: cannot write: {why}"]
    assert os.listdir(tmp_path) == [] and "| shapes | sugarcrepe_mean |" in std.out
    png = tmp_path / "plots" / "spectral.png"
    assert E.main(["--ckpt", ckpts["clip"], "--eval_size", "5", "--no_progress", "--benchmarks", "shapes,spectral",
                   "--plot_dir", str(png.parent)]) == 2
    std = capsys.readouterr()
    assert [ln for ln in std.err.splitlines() if "error" in ln] == [f"error: spectral: {png}: cannot write: {why}"]
    assert f"| spectral | ERROR | {png}: cannot write: {why} |" in std.out and "| shapes | sugarcrepe_mean |" in std.out
    assert os.listdir(png.parent) == []


def test_the_json_under_a_real_file_size_limit(ckpts, tmp_path):
    """EFBIG from the kernel (RLIMIT_FSIZE below the JSON's size): one error line, exit 2."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "eval_compositional.py", "--ckpt", ckpts["clip"], "--eval_size", "5",
                        "--no_progress", "--out", str(out)], cwd=ROOT, preexec_fn=limit, capture_output=True,
                       text=True, timeout=300,
                       env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"})
    err = [ln for ln in p.stderr.splitlines() if "error" in ln or "Traceback" in ln]
    assert p.returncode == 2 and err == [f"error: {out}: cannot write: file too large"], p.stderr
    assert os.listdir(tmp_path) == []
