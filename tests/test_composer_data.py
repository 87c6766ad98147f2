"""composer.py on real caption files (issue 18): captions read without decoding images (Karpathy
JSON, shards), region features read per item (one file or one file per image), the paper's
protocol (--n counts images, R@10), mcd --targets and multi-split pools, the parse subcommand,
--help."""
import argparse
import io
import json
import os
import re
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import composer as C  # noqa: E402
import lifecycle  # noqa: E402

data = pytest.importorskip("data")

CAPTIONS = ["A man rides a horse.", "A dog is running on the grass.", "Two women sit on a bench.",
            "A boy in a red shirt kicks a ball.", "A cat sleeping on a chair.", "A woman holds an umbrella.",
            "Children play soccer in a park.", "A man with a hat reads a newspaper."]


def karpathy(tmp_path, n_images=6, per_image=5, splits=("train", "test")):
    """A dataset_flickr30k.json in the released layout; no image file exists."""
    images, k = [], 0
    for split in splits:
        for i in range(n_images):
            sents = [{"raw": CAPTIONS[(k + j) % len(CAPTIONS)], "tokens": [], "sentid": k * 10 + j}
                     for j in range(per_image)]
            images.append({"filename": f"{split}{i}.jpg", "imgid": k, "split": split, "sentences": sents,
                           "sentids": []})
            k += 1
    path = tmp_path / "dataset_flickr30k.json"
    path.write_text(json.dumps({"images": images, "dataset": "flickr30k"}))
    return str(path), [im["filename"][:-4] for im in images]


def region_file(path, keys, n=4, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    feats, boxes = torch.randn(len(keys), n, d, generator=g), torch.rand(len(keys), n, 5, generator=g)
    n_regions = torch.tensor([n - (i % 2) for i in range(len(keys))])
    save_file({"feats": feats, "boxes": boxes, "n_regions": n_regions}, str(path), metadata={"keys": json.dumps(keys)})
    return feats, boxes, n_regions


def test_region_store_one_file_and_per_image_files_agree(tmp_path):
    keys = [f"img{i}" for i in range(5)]
    feats, boxes, nr = region_file(tmp_path / "regions.safetensors", keys)
    os.makedirs(tmp_path / "dir")
    for i, k in enumerate(keys):
        save_file({"feats": feats[i, :nr[i]].clone(), "boxes": boxes[i, :nr[i]].clone()},
                  str(tmp_path / "dir" / f"{k}.safetensors"))
    for src in (str(tmp_path / "regions.safetensors"), str(tmp_path / "dir")):
        rs = C.RegionStore(src)
        for k in keys:
            rs.check(k)
        st = rs.select([keys[3], keys[0]])
        f, b, m = st.get(torch.tensor([0, 1]))
        assert f.shape == (2, 4, 6) and m.tolist() == [[True] * 3 + [False], [True] * 4]
        assert torch.equal(f[0, :3], feats[3, :3]) and torch.equal(b[1], boxes[0]) and not f[0, 3].any()
    with pytest.raises(C.CRGError, match="no regions"):
        C.RegionStore(str(tmp_path / "regions.safetensors")).check("other")
    blob = (tmp_path / "regions.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(blob[:len(blob) // 2])
    with pytest.raises(C.CRGError, match="cut short"):
        C.RegionStore(str(tmp_path / "cut.safetensors"))


def test_text_only_training_and_eval_without_images(tmp_path, capsys):
    """Karpathy JSON + one region file, no JPEG anywhere: train, then the paper's protocol."""
    js, keys = karpathy(tmp_path)
    region_file(tmp_path / "regions.safetensors", keys)
    out = str(tmp_path / "run")
    C.main(["train", "--data", js, "--features", "regions", "--regions", str(tmp_path / "regions.safetensors"),
            "--out_dir", out, "--max_steps", "2", "--batch_size", "4", "--width", "16", "--heads", "2",
            "--ct_layers", "1", "--vocab_size", "200", "--n_neg_img", "1", "--n_neg_txt", "1", "--dtype", "fp32",
            "--log_interval", "1"])
    assert ("30 train captions / 6 images, 30 parsed by the built-in bracketer"
            in capsys.readouterr().err.splitlines()[0])
    res = C.main(["eval", "--ckpt", out, "--no_phrases"])["test"]      # default: the whole test split
    assert (res["images"], res["captions"], res["bracketer"]) == (6, 30, 30) and "t2i_r10" in res
    res = C.main(["eval", "--ckpt", out, "--no_phrases", "--eval_size", "2"])["test"]  # counts images
    assert (res["images"], res["captions"]) == (2, 10)


def test_shards_read_without_decoding(tmp_path):
    """graph over tar shards reads only .txt/.tree: the .jpg members are not images at all."""
    with tarfile.open(tmp_path / "00000.tar", "w") as tf:
        for i, cap in enumerate(CAPTIONS):
            for ext, blob in (("jpg", b"not a jpeg"), ("txt", cap.encode()),
                              *([("tree", b"(NP (DT a) (NN dog))")] if i == 0 else [])):
                ti = tarfile.TarInfo(f"{i:05d}.{ext}")
                ti.size = len(blob)
                tf.addfile(ti, io.BytesIO(blob))
    args = C.parse_args(["graph", "--data", str(tmp_path / "00000.tar")])
    items = C._spec_items(args, args.data, "train", None)
    assert [it["caption"] for it in items] == CAPTIONS and items[0]["tree"] == "(NP (DT a) (NN dog))"
    crgs, _, skipped, n_bracketed = C._collect(argparse_ns(max_skip_frac=0.5), str(tmp_path / "00000.tar"),
                                               "train", None)
    assert dict(skipped) == {"tree_mismatch": 1} and n_bracketed == len(CAPTIONS) - 1


def argparse_ns(**kw):
    import argparse
    return argparse.Namespace(image_root=None, csv_img_key="filepath", csv_caption_key="title", csv_separator=None,
                              **kw)


def test_mcd_targets_and_pool_over_splits(tmp_path):
    windows = [{"start": s, "compound_divergence": cd} for s, cd in [(0, 0.4), (5, 0.3), (10, 0.22), (15, 0.1)]]
    assert [w["start"] for w in C.pick_windows(windows, [0.15, 0.2, 0.31, 0.9])] == [15, 10, 5, 0]
    js, _ = karpathy(tmp_path, splits=("train", "val", "test"))
    args = C.parse_args(["mcd", "--train", js, "--pool", js, "--pool_split", "val,test", "--pool_size", "10",
                         "--size", "4", "--targets", "0.0,1.0", "--out_dir", str(tmp_path / "mcd")])
    by_img, _, nb = C._pool(args)
    assert sorted(by_img) == [f"test{i}" for i in range(4)] + [f"val{i}" for i in range(6)] and nb == 50
    with pytest.raises(C.ComposerError, match="target 1 is out of reach of this pool"):
        C.cmd_mcd(args)  # no window of this pool is near divergence 1.0: nothing written
    assert not (tmp_path / "mcd").exists()
    args.nearest = True
    res = C.cmd_mcd(args)
    assert res["pool"] == 10
    written = sorted(os.listdir(tmp_path / "mcd"))
    for t in [n[len("target_"):-len(".jsonl")] for n in written if n.startswith("target_")]:
        lines = [json.loads(l) for l in open(tmp_path / "mcd" / f"target_{t}.jsonl")]
        assert len({it["key"] for it in lines}) == 4 and len(lines) == 20  # 4 images with all 5 captions


def test_mcd_target_problems():
    windows = [{"start": s, "compound_divergence": cd} for s, cd in [(0, 0.031), (5, 0.02), (10, 0.012)]]
    assert C.target_problems([0.02, 0.03], windows, 0.1) == []   # 0.1 of the range 0.012..0.031: 0.0019
    p = C.target_problems([0.15, 0.2, 0.012], windows, 0.1)
    assert p[0].startswith("target 0.15 is out of reach") and "nearest reachable compound divergence 0.031" in p[0]
    assert "targets 0.15 and 0.2 pick the same window" in p[2] and len(p) == 3


def test_mcd_cli_out_of_reach_exits_nonzero(tmp_path, capsys):
    js, _ = karpathy(tmp_path, splits=("train", "test"))
    argv = ["mcd", "--train", js, "--pool", js, "--size", "3", "--targets", "0.9,0.95",
            "--out_dir", str(tmp_path / "m")]
    with pytest.raises(SystemExit) as e:
        C.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("error: target 0.9 is out of reach") and "--nearest" in err[-1]
    C.main(argv + ["--nearest"])
    out = capsys.readouterr()
    assert "pick the same window" in out.err and sorted(os.listdir(tmp_path / "m")) == [
        "mcd.jsonl", "random.jsonl", "target_0.9.jsonl", "windows.json"]


def test_parse_subcommand(tmp_path, capsys):
    js, _ = karpathy(tmp_path, n_images=2, per_image=2, splits=("test",))
    out = str(tmp_path / "parsed.json")
    assert C.main(["parse", js, "--out", out, "--parser", "builtin"]) == 4
    sents = [s for im in json.load(open(out))["images"] for s in im["sentences"]]
    assert all(s["tree"] == C.bracket(s["raw"]) for s in sents)
    std = capsys.readouterr()
    assert std.out == "" and std.err.splitlines()[0] == f"start: composer.py parse | {js} | parser builtin | out {out}"
    assert re.fullmatch(rf"done: parsed 4 captions in \d+s \| wrote {re.escape(out)}", std.err.splitlines()[-1])
    if not any(importable(m) for m in ("benepar", "stanza")):  # without a parser: how to get one
        with pytest.raises(SystemExit) as e:
            C.main(["parse", js, "--out", out])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and "pip install benepar" in err[0]


def importable(name):
    import importlib.util
    return importlib.util.find_spec(name) is not None


def test_help_lists_subcommands():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "composer.py"), "--help"], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=60)
    assert r.returncode == 0 and all(f"\n    {c} " in r.stdout
                                     for c in ("train", "eval", "graph", "mcd", "parse", "summarize"))


def test_csv_captions_and_trees_without_images(tmp_path):
    """open_clip's CSV layout with renamed columns (--csv_img_key / --csv_caption_key) and a tree
    column: graph reads it with no image present; the tree rows skip the bracketer."""
    rows = ["img\tcap\ttree", "a.jpg\tA man rides a horse.\t", "b.jpg\ta dog\t(NP (DT a) (NN dog))",
            "c.jpg\tTwo dogs play in the snow.\t"]
    (tmp_path / "train.tsv").write_text("\n".join(rows) + "\n")
    st = C.main(["graph", "--data", str(tmp_path / "train.tsv"), "--csv_img_key", "img", "--csv_caption_key", "cap"])
    assert (st["captions"], st["images"], st["bracketer"]) == (3, 3, 2)
    with pytest.raises(SystemExit) as e:
        C.main(["graph", "--data", str(tmp_path / "train.tsv")])  # default column names: one error line
    assert e.value.code == 2


def test_tokenizer_reads_a_csv_with_renamed_columns(tmp_path):
    """train's tokenizer takes its captions with the same --csv_* flags as the data."""
    (tmp_path / "train.tsv").write_text("img\tcap\na.jpg\tA zebra grazes near a fence.\n")
    args = argparse.Namespace(data=str(tmp_path / "train.tsv"), image_root=None, csv_img_key="img",
                              csv_caption_key="cap", csv_separator=None, vocab=None, vocab_size=200, max_len=77)
    tok = C.build_tokenizer(args)
    assert tok.decode(tok("a zebra grazes near a fence.")[0]) == "a zebra grazes near a fence."


def test_regions_checked_from_headers_and_bad_items_skipped_when_first_read(tmp_path, monkeypatch, capsys):
    """Start-up reads only safetensors headers; an item with NaNs is found on its first read,
    counted once, stands as one zero region, and too many such items stop the run."""
    keys = [f"k{i}" for i in range(4)]
    for i, k in enumerate(keys):
        feats = torch.randn(3, 6)
        if i == 2:
            feats[1, 4] = float("nan")
        save_file({"feats": feats, "boxes": torch.rand(3, 5)}, str(tmp_path / f"{k}.safetensors"))
    save_file({"feats": torch.randn(3, 6, dtype=torch.float64)[:, :5].contiguous(), "boxes": torch.rand(3, 5)},
              str(tmp_path / "wrongdim.safetensors"))
    items = [{"source": "x", "key": k, "caption": "a dog", "tree": "(NP (DT a) (NN dog))"} for k in keys + ["wrongdim"]]
    reads = []
    real_rows = C.TensorFile.rows
    monkeypatch.setattr(C.TensorFile, "rows", lambda self, *a: reads.append(self.path) or real_rows(self, *a))
    args = argparse.Namespace(data="x", features="regions", regions=str(tmp_path), max_skip_frac=0.5)
    sp = C.load_split(args, None, None, items=items)
    assert reads == [] and sp.keys == keys and dict(sp.skipped) == {"bad_regions": 1}  # wrong D: from the header
    for _ in range(2):
        f, b, m = sp.store.get([2, 0])
    assert dict(sp.skipped) == {"bad_regions": 2} and capsys.readouterr().err.count("non-finite") == 1
    assert m.tolist() == [[True, False, False], [True, True, True]] and not f[0].any() and torch.isfinite(f).all()
    strict = C.load_split(argparse.Namespace(**{**vars(args), "max_skip_frac": 0.2}), None, None, items=items[:4])
    with pytest.raises(C.ComposerError, match="1 of 4 region items are bad"):
        strict.store.get([2])


def test_images_without_a_graph_stay_candidates(tmp_path):
    """Each caption ranks all test images, also one whose captions all fail to build a graph."""
    keys = ["a", "b", "c"]
    region_file(tmp_path / "r.safetensors", keys)
    items = [{"source": "x", "key": "a", "caption": "a dog", "tree": "(NP (DT a) (NN dog))"},
             {"source": "x", "key": "b", "caption": "a cat", "tree": "(NP (DT a) (NN cat))"},
             {"source": "x", "key": "c", "caption": "", "tree": None}]  # no graph: no_caption
    args = argparse.Namespace(data="x", features="regions", regions=str(tmp_path / "r.safetensors"), max_skip_frac=0.5)
    sp = C.load_split(args, None, None, items=items)
    assert sp.keys == keys and sp.cap_img == [0, 1] and dict(sp.skipped) == {"no_caption": 1}
    tok = data.build_tokenizer(captions=["a dog", "a cat"], vocab_size=100)
    compiler = C.TextCompiler(tok)
    C.attach_compiler(sp, compiler, 0.5)
    model = C.Composer(C.ModelConfig(vocab_size=tok.vocab_size, feat_dim=6, width=16, heads=2, ct_layers=1))
    res, S = C.evaluate(model, compiler, sp, "cpu", phrases=False)
    assert res["images"] == 3 and tuple(S.shape) == (2, 3)


def test_folds_rank_each_caption_within_its_gallery(tmp_path):
    """--folds K (COCO's 5 x 1K protocol): image j sits in gallery j % K, a caption is scored only
    against its image's gallery, and R@k equals a naive per-caption count on the all-pairs scores."""
    words = ["dog", "cat", "cow", "pig", "hen", "owl", "fox"]
    keys = [f"k{i}" for i in range(len(words))]
    region_file(tmp_path / "r.safetensors", keys)
    items = [{"source": "x", "key": k, "caption": f"a big {w}", "tree": f"(NP (DT a) (JJ big) (NN {w}))"}
             for k, w in zip(keys, words)]
    args = argparse.Namespace(data="x", features="regions", regions=str(tmp_path / "r.safetensors"), max_skip_frac=0.5)
    sp = C.load_split(args, None, None, items=items)
    tok = data.build_tokenizer(captions=[it["caption"] for it in items], vocab_size=100)
    compiler = C.TextCompiler(tok)
    C.attach_compiler(sp, compiler, 0.5)
    torch.manual_seed(0)
    model = C.Composer(C.ModelConfig(vocab_size=tok.vocab_size, feat_dim=6, width=16, heads=2, ct_layers=1))
    full, S1 = C.evaluate(model, compiler, sp, "cpu", phrases=False)
    res, S3 = C.evaluate(model, compiler, sp, "cpu", phrases=True, folds=3)
    assert (res["folds"], res["gallery"], res["images"], res["captions"]) == (3, 3, 7, 7)
    same = torch.tensor([[j % 3 == g % 3 for j in range(7)] for g in sp.cap_img])
    assert torch.allclose(S3[same], S1[same], atol=1e-5) and torch.isneginf(S3[~same]).all()
    for k in (1, 5):
        hits = sum(sum(bool(S1[i, j] >= S1[i, g]) for j in range(7) if j != g and j % 3 == g % 3) < k
                   for i, g in enumerate(sp.cap_img))
        assert res[f"t2i_r{k}"] == round(100.0 * hits / 7, 2)
    assert full["folds"] == 1 and torch.isfinite(S1).all()
    with pytest.raises(C.ComposerError, match="--folds 8"):
        C.evaluate(model, compiler, sp, "cpu", phrases=False, folds=8)


def fake_package(root, name, body=""):
    d = root / name
    d.mkdir()
    (d / "__init__.py").write_text(body)


def test_parse_says_which_model_is_missing(tmp_path, monkeypatch, capsys):
    """benepar / stanza installed without their models: the error names the model and the command."""
    js, _ = karpathy(tmp_path, n_images=1, per_image=1, splits=("test",))
    pk = tmp_path / "pk"
    pk.mkdir()
    monkeypatch.syspath_prepend(str(pk))
    for m in ("benepar", "stanza", "spacy", "en_core_web_sm", "en_core_web_md"):
        monkeypatch.delitem(sys.modules, m, raising=False)
    fake_package(pk, "benepar")
    fake_package(pk, "stanza", "class Pipeline:\n    def __init__(self, *a, **k):\n"
                               "        raise FileNotFoundError('Resources file not found')\n")

    def error(*argv):
        with pytest.raises(SystemExit) as e:
            C.main(["parse", js, "--out", str(tmp_path / "o.json"), *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1
        return err[0]

    assert "benepar is installed but spaCy is not" in error("--parser", "benepar")
    assert "stanza is installed but its English models are not" in error("--parser", "stanza")
    assert "stanza.download('en'" in error("--parser", "stanza")
    fake_package(pk, "spacy", "loaded = []\nclass _NLP:\n    def add_pipe(self, name, config):\n"
                              "        raise LookupError('benepar_en3 not found')\n"
                              "def load(name):\n    loaded.append(name)\n    return _NLP()\n")
    assert "no spaCy English model" in error("--parser", "benepar")
    fake_package(pk, "en_core_web_sm")  # only the small pipeline: benepar takes it
    err = error()  # auto: both are installed, neither has its model
    assert "its model benepar_en3 is not" in err and "benepar.download('benepar_en3')" in err and "stanza" in err
    import spacy
    assert spacy.loaded == ["en_core_web_sm"]


def test_summarize_reads_final_evals_and_pairs_seeds(tmp_path, capsys):
    """`composer.py summarize`: one group per model (modulator / +mvsa named), t2i_r<k> of the final
    eval record as fractions, paired difference against the baseline on the shared seeds; a run written before the
    names were t2i_r<k> (R@<k> under "eval") reads the same."""
    runs = {"c0": ("composer", "film", False, 0, 30.0), "c1": ("composer", "film", False, 1, 34.0),
            "s0": ("single", "film", False, 0, 20.0), "s1": ("single", "film", False, 1, 26.0),
            "r0": ("composer", "replace", False, 0, 50.0), "v0": ("vilbert", "film", True, 0, 40.0)}
    for d, (method, modulator, mvsa, seed, r1) in runs.items():
        os.makedirs(tmp_path / d)
        lifecycle.save_json(str(tmp_path / d / "config.json"), {"args": {"method": method, "modulator": modulator,
                                                                    "concept_mvsa": mvsa, "seed": seed}})
        with open(tmp_path / d / "metrics.jsonl", "w") as f:
            f.write(json.dumps({"step": 1, "phase": "train", "loss": 1.0, "lr": 1e-3, "time": 0.0}) + "\n")
            ev = {"mcd": {"t2i_r1": r1, "t2i_r5": 90.0, "t2i_r10": 99.0, "images": 5}}
            if d == "v0":   # the earlier layout
                ev = {"eval": {"mcd": {"R@1": r1, "R@5": 90.0, "R@10": 99.0}}}
            f.write(json.dumps({"step": 2, "phase": "eval", "time": 0.0, "final": True, **ev}) + "\n")
    os.makedirs(tmp_path / "unfinished")
    groups = C.main(["summarize", str(tmp_path)])
    assert set(groups) == {"composer", "single", "composer replace", "vilbert +mvsa"}
    assert groups["single"]["mcd t2i_r1"] == {0: 0.2, 1: 0.26} and groups["vilbert +mvsa"]["mcd t2i_r5"] == {0: 0.9}
    assert set(groups["composer"]) == {"mcd t2i_r1", "mcd t2i_r5"}
    out = capsys.readouterr().out
    d = np.array([-0.10, -0.08])       # single - composer on seeds 0 and 1
    from lifecycle import T975
    half = T975[0] * d.std(ddof=1) / np.sqrt(2)
    row = next(ln for ln in out.splitlines() if ln.startswith("| single - composer (2) |"))
    assert row.split(" | ")[1] == f"{100 * d.mean():+.1f} ± {100 * half:.1f}"
    # a later `composer.py eval --out RUN/eval.json` (e.g. on larger splits) replaces the final record
    lifecycle.save_json(str(tmp_path / "s1" / "eval.json"), {"mcd": {"t2i_r1": 36.0, "t2i_r5": 95.0}})
    assert C.main(["summarize", str(tmp_path)])["single"]["mcd t2i_r1"] == {0: 0.2, 1: 0.36}
