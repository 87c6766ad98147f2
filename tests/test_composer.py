"""Tests for composer.py: CRG, bracketer, level-batched composition, MCD divergence, losses,
bad input, torchrun (gloo) == single process, exact resume, CLI."""
import argparse
import errno
import json
import math
import os
import shutil
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from conftest import error_lines
import torch
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import composer as C  # noqa: E402
import data  # noqa: E402
import lifecycle
from conftest import disk_full_at_save  # noqa: E402

PAPER_TREE = ("(ROOT (S (NP (CD two) (NNS dogs)) (VP (VBP are) (VP (VBG running) "
              "(PP (IN on) (NP (DT the) (NN grass)))))))")


# ----------------------------------------------------------------------------- CRG

def test_crg_paper_example():
    c = C.crg_from_tree(PAPER_TREE, "two dogs are running on the grass")
    assert c.predicate == "[NP] are running on [NP]"
    assert [ch.text for ch in c.children] == ["two dogs", "the grass"]
    assert [ch.predicate for ch in c.children] == ["two [NNS]", "the [NN]"]
    assert [p.word for p in c.primitives()] == ["dogs", "grass"]
    assert c.height == 2 and c.text == "two dogs are running on the grass"
    # the rule-based bracketer gives the same CRG without a tree
    b = C.caption_crg("two dogs are running on the grass")
    assert [(x.text, x.predicate) for x in b.concepts()] == [(x.text, x.predicate) for x in c.concepts()]


def test_crg_nested_tree_and_edge_cases():
    sc = data.shapes_scene("train", 2)  # 3 objects: "A to the right of B and C"
    c = C.crg_from_tree(sc.tree, sc.caption)
    preds = [x.predicate for x in c.concepts()]
    assert preds[-1] == "[NP] and [NP]" and "[NP] to [NP]" in preds and "[NP] of [NP]" in preds
    assert c.height == 4
    rel = c.children[0]  # "a white triangle to the right of a small orange cross"
    assert rel.predicate == "[NP] to [NP]" and rel.children[1].predicate == "[NP] of [NP]"
    assert rel.children[1].children[0].predicate == "the [NN]"
    # nested: a concept inside a concept inside a concept, post-order with root last
    t = ("(S (NP (NP (DT a) (NN man)) (PP (IN in) (NP (DT a) (JJ red) (NN shirt)))) "
         "(VP (VBZ rides) (NP (DT a) (NN bike))) (. .))")
    c = C.crg_from_tree(t, "a man in a red shirt rides a bike.")
    assert [x.predicate for x in c.concepts()] == ["a [NN]", "a red [NN]", "[NP] in [NP]", "a [NN]", "[NP] rides [NP]"]
    # unary chains collapse; a one-word caption is a unary concept over its primitive
    u = C.crg_from_tree("(ROOT (NP (NP (DT the) (NN dog))))", "the dog")
    assert u.predicate == "the [NN]" and len(u.concepts()) == 1
    w = C.crg_from_tree("(NP (NN dog))", "dog")
    assert w.predicate == "[NN]" and w.height == 1


@pytest.mark.parametrize("tree,caption,kind", [
    ("(S (NP (DT a) (NN dog))", "a dog", "malformed_tree"),
    ("(S (NP (DT a) (NN dog)) extra)", "a dog", "malformed_tree"),
    ("(S (NP (DT a) dog (NN x)))", "a dog x", "malformed_tree"),
    ("(S (NP (DT a) (NN dog)))", "a cat", "tree_mismatch"),
    ("(S (NP (DT a) (JJ red)) (VP (VBZ is)))", "a red is", "no_primitive"),
])
def test_bad_trees(tree, caption, kind):
    with pytest.raises(C.CRGError) as e:
        C.crg_from_tree(tree, caption)
    assert e.value.kind == kind


def test_graph_cli_skips_and_errors(tmp_path, capsys):
    good = {"key": "a", "caption": "two dogs are running on the grass", "tree": PAPER_TREE}
    bad = [{"key": "b", "caption": "a dog", "tree": "(S (NP (DT a) (NN dog))"},
           {"key": "c", "caption": "a cat", "tree": "(S (NP (DT a) (NN dog)))"},
           {"key": "d", "caption": "a red", "tree": "(NP (DT a) (JJ red))"}]
    f = tmp_path / "caps.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [good] * 30 + bad))
    st = C.main(["graph", "--data", str(f)])
    assert st["skipped"] == {"malformed_tree": 1, "tree_mismatch": 1, "no_primitive": 1}
    assert (st["concepts"], st["predicates"], st["primitives"], st["avg_height"]) == (3, 3, 2, 2.0)
    assert st["bracketer"] == 0 and "0 parsed by the built-in bracketer" in capsys.readouterr().err
    f.write_text("\n".join(json.dumps(x) for x in bad))
    with pytest.raises(SystemExit) as e:
        C.main(["graph", "--data", str(f)])
    assert e.value.code == 2
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("error: ")


def test_region_files_wrong_shape_skipped(tmp_path):
    items = []
    for i in range(12):
        n = 3
        feats = torch.randn(n, 7) if i != 5 else torch.randn(n, 9)          # wrong D
        boxes = torch.rand(n, 5) if i != 7 else torch.rand(n, 4)            # wrong box width
        save_file({"feats": feats, "boxes": boxes}, str(tmp_path / f"k{i}.safetensors"))
        items.append({"source": "x", "key": f"k{i}", "caption": "two dogs are running on the grass",
                      "tree": PAPER_TREE})
    items.append({"source": "x", "key": "missing", "caption": "a dog", "tree": None})
    args = argparse.Namespace(data="x", features="regions", regions=str(tmp_path), max_skip_frac=0.5)
    sp = C.load_split(args, None, None, items=items)
    assert len(sp.keys) == 10 and sp.skipped == Counter(bad_regions=3)
    f, b, m = sp.store.get(list(range(10)))
    assert tuple(f.shape) == (10, 3, 7) and bool(m.all())
    k3 = load_file(str(tmp_path / "k3.safetensors"))
    assert torch.equal(f[sp.keys.index("k3")], k3["feats"]) and torch.equal(b[sp.keys.index("k3")], k3["boxes"])
    with pytest.raises(C.ComposerError):
        C.load_split(argparse.Namespace(**{**vars(args), "max_skip_frac": 0.1}), None, None, items=items)


# ----------------------------------------------------------------------------- model

def _tiny_setup(n=6):
    tok = data.build_tokenizer(captions=data.shapes_captions(300), vocab_size=300)
    comp = C.TextCompiler(tok)
    scs = [data.shapes_scene("train", i) for i in range(n)]
    comps = [comp.compile(C.caption_crg(s.caption, s.tree)) for s in scs]
    comps.append(comp.compile(C.caption_crg("two dogs are running on the grass", PAPER_TREE)))
    fs = [C.shapes_region_features(s.image, s.objects) for s in scs]
    return tok, comp, comps, C.FeatureStore([f for f, _ in fs], [b for _, b in fs])


@pytest.mark.parametrize("modulator,crossatt", [("film", True), ("mlp", True), ("replace", False)])
def test_level_batched_equals_recursion(modulator, crossatt):
    torch.manual_seed(0)
    tok, _, comps, st = _tiny_setup()
    cfg = C.ModelConfig(vocab_size=tok.vocab_size, eot_token_id=tok.eot_id, feat_dim=st.feat_dim, width=32,
                        heads=4, modulator=modulator, crossatt_primitives=crossatt)
    m = C.Composer(cfg).eval()
    tb = C.collate_text(comps)
    te = m.encode_text(tb)
    V, vm = m.encode_image(*st.get(torch.arange(len(st))))
    pc = torch.arange(len(comps)).repeat_interleave(len(st))
    pi = torch.arange(len(st)).repeat(len(comps))
    with torch.no_grad():
        root, aux = m.score_pairs(tb, te, V, vm, pc, pi)
        for q in range(len(pc)):
            ref = m.score_recursive(comps[pc[q]], *st.get(pi[q]))
            s0 = int(aux["node_start"][q])
            torch.testing.assert_close(aux["node_score"][s0:s0 + len(ref)], ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(root[q], ref[-1], atol=1e-5, rtol=1e-5)


def test_baselines_score_shapes():
    tok, comp, comps, st = _tiny_setup(4)
    caps = [data.shapes_scene("train", i).caption for i in range(4)]
    for arch in ("vse", "single", "vilbert"):
        cfg = C.ModelConfig(arch=arch, vocab_size=tok.vocab_size, eot_token_id=tok.eot_id, feat_dim=st.feat_dim,
                            width=32)
        m = C.MODELS[arch](cfg).eval()
        S = C.score_matrix(m, comp, [None] * 4, caps, st, list(range(4)), "cpu", cap_chunk=3, img_chunk=3)
        assert S.shape == (4, 4) and torch.isfinite(S).all()
        # chunking does not change the scores
        S2 = C.score_matrix(m, comp, [None] * 4, caps, st, list(range(4)), "cpu", cap_chunk=4, img_chunk=4)
        torch.testing.assert_close(S, S2, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- MCD

def test_divergence_fixtures_and_brute_force():
    def bigrams(sents):
        return Counter(" ".join(s.split()[i:i + 2]) for s in sents for i in range(len(s.split()) - 1))
    a = bigrams(["jump thrice", "walk twice"])
    assert C.compound_divergence(a, a) == pytest.approx(0.0, abs=1e-12)
    assert C.compound_divergence(a, bigrams(["jump twice", "walk thrice"])) == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    keys = [f"k{i}" for i in range(20)]
    for alpha in (0.1, 0.5):
        p = rng.integers(0, 5, 20)
        q = rng.integers(0, 5, 20)
        brute = 1 - np.sum((p / p.sum()) ** alpha * (q / q.sum()) ** (1 - alpha))
        got = C.chernoff_divergence(Counter(dict(zip(keys, p.tolist()))), Counter(dict(zip(keys, q.tolist()))), alpha)
        assert got == pytest.approx(brute, abs=1e-12)


def test_delta_ranking_matches_recomputation():
    rng = np.random.default_rng(1)
    keys = [f"c{i}" for i in range(12)]
    train = Counter({k: int(v) for k, v in zip(keys, rng.integers(0, 6, 12)) if v})
    items = [Counter({keys[j]: int(rng.integers(1, 3)) for j in rng.choice(12, 3, replace=False)}) for _ in range(15)]
    cd_all, deltas = C.delta_ranking(train, items)
    assert cd_all == pytest.approx(C.compound_divergence(train, sum(items, Counter())))
    for i in range(len(items)):
        rest = sum((it for j, it in enumerate(items) if j != i), Counter())
        assert deltas[i] == pytest.approx(C.compound_divergence(train, rest) - cd_all, abs=1e-12)


def test_mcd_split_on_shapes(tmp_path, capsys):
    res = C.main(["mcd", "--train", "shapes", "--train_size", "400", "--pool", "shapes", "--pool_split", "test",
                  "--pool_size", "200", "--size", "50", "--out_dir", str(tmp_path)])
    assert len(res["mcd"]) == 50
    std = capsys.readouterr()      # the summary JSON on stdout; the start and done lines on stderr
    assert json.loads(std.out)["written"] == [str(tmp_path / f) for f in ("mcd.jsonl", "random.jsonl", "windows.json")]
    err = std.err.splitlines()
    assert err[0] == (f"start: composer.py mcd | train shapes (train) | pool shapes (test) | size 50 | "
                      f"out_dir {tmp_path}")
    assert err[-1].startswith(f"done: MCD split of 50 images: compound divergence {res['mcd_compound_divergence']} "
                              f"(random split: {res['random_compound_divergence']}) in ")
    assert err[-1].endswith(f"s | wrote {tmp_path}/{{mcd.jsonl, random.jsonl, windows.json}}")
    assert res["mcd_compound_divergence"] > res["random_compound_divergence"]
    cds = [w["compound_divergence"] for w in res["windows"]]
    assert cds[0] == max(cds)  # graded splits: divergence falls along the ranking
    lines = (tmp_path / "mcd.jsonl").read_text().splitlines()
    assert len(lines) == 50 and json.loads(lines[0])["source"] == "shapes"


# ----------------------------------------------------------------------------- losses

def test_hinge_losses_by_hand():
    s = torch.tensor([1.0, 0.2])
    negc = torch.tensor([[0.5, 0.9], [0.0, -1.0]])
    negx = torch.tensor([[0.1], [0.6]])
    # concept 0: c- terms: [0.8-1+0.5]=0.3, [0.8-1+0.9]=0.7 -> mean 0.5; x- term: [0.8-1+0.1]_+=0 -> 0.5
    # concept 1: c- terms: 0.6, 0 -> 0.3; x- term: 0.8-0.2+0.6=1.2 -> 1.5; mean over concepts = 1.0
    assert float(C.mvsa_hinge(s, negc, negx, 0.8)) == pytest.approx(1.0)
    # order: parents [1.0, 0.1], children [0.9, 0.5]: [0.2-1+0.9]=0.1, [0.2-0.1+0.5]=0.6 -> 0.35
    assert float(C.order_loss(torch.tensor([1.0, 0.1]), torch.tensor([0.9, 0.5]), 0.2)) == pytest.approx(0.35)
    nll = float(C.mvsa_nll(s[:1], negc[:1], negx[:1]))
    assert nll == pytest.approx(-math.log(math.exp(1) / (math.exp(1) + math.exp(0.5) + math.exp(0.9) + math.exp(0.1))))
    m = float(C.match_loss(torch.tensor([2.0]), torch.tensor([[0.0, 1.0]])))
    assert m == pytest.approx(-math.log(math.exp(2) / (math.exp(2) + 1 + math.exp(1))))
    assert C._neg_concept([1, 1, 3], [1, 3]) == [0, 0, 1]
    assert C._neg_concept([1, 2, 2], [1, 1, 3]) == [0, 1, 0]  # no height 2: nearest (1 and 3 tie: lower), cyclic


# ----------------------------------------------------------------------------- training

TRAIN = ["--train_size", "48", "--eval_size", "0", "--batch_size", "8", "--width", "32", "--heads", "2",
         "--ct_layers", "3", "--warmup", "10", "--log_interval", "1", "--save_interval", "100", "--dtype", "fp32",
         "--n_neg_img", "2", "--n_neg_txt", "1", "--vocab_size", "300"]


def _run(args, nproc=1, timeout=120):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    cmd = [sys.executable] + (["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"]
                              if nproc > 1 else []) + [os.path.join(ROOT, "composer.py")] + args
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r


def weights(out):
    return load_file(os.path.join(out, "checkpoint", "model.safetensors"))


def saved_state(out, folder="checkpoint"):
    return torch.load(os.path.join(out, folder, "state.pt"), weights_only=True)


def same_weights(a, b):
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def one_error_line(capsys):
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_resume_exact_and_ddp_equals_single(tmp_path):
    full, part, ddp = str(tmp_path / "full"), str(tmp_path / "part"), str(tmp_path / "ddp")
    C.main(["train", "--out_dir", full, "--max_steps", "6"] + TRAIN)
    C.main(["train", "--out_dir", part, "--max_steps", "6", "--stop_at", "3"] + TRAIN)
    with open(os.path.join(part, "metrics.jsonl"), "a") as f:  # a log line past the checkpoint (a kill)
        f.write(json.dumps({"step": 4, "loss": 99.0}) + "\n")
    C.main(["train", "--resume", "--out_dir", part])            # the saved run's own flags
    steps = [r["step"] for r in map(json.loads, open(os.path.join(part, "metrics.jsonl"))) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # rewound to the checkpoint: no step twice
    assert same_weights(full, part), "resumed run differs from the uninterrupted one"
    sa, sb = saved_state(full), saved_state(part)
    assert sa["sampler"] == sb["sampler"] and sa["step"] == sb["step"] == 6
    assert saved_state(part, "checkpoint.prev")["step"] == 3
    config = lifecycle.read_json(os.path.join(full, "checkpoint", "config.json"))
    assert config["script"] == lifecycle.script_record(C.__file__) and "given" not in config["args"]
    _run(["--out_dir", ddp, "--max_steps", "6"] + TRAIN, nproc=2)
    d = load_file(os.path.join(ddp, "checkpoint", "model.safetensors"))
    # the logged (global-batch) losses agree step by step; the weights agree up to float
    # reordering amplified by Adam on near-zero gradients (update ~ lr * g / |g|)
    la, ld = [[r["loss"] for r in map(json.loads, open(os.path.join(x, "metrics.jsonl"))) if "loss" in r]
              for x in (full, ddp)]
    assert len(la) == len(ld) == 6 and np.allclose(la, ld, atol=1e-5, rtol=0), (la, ld)
    a = weights(full)
    for k in a:
        torch.testing.assert_close(d[k], a[k], atol=1e-3, rtol=1e-3)
    for f in ("config.json", "tokenizer.json", "metrics.jsonl", "loss_curve.png"):
        assert os.path.exists(os.path.join(full, f))
    assert sorted(os.listdir(os.path.join(full, "checkpoint"))) == sorted(lifecycle.CHECKPOINT_FILES + ("sha256.json",))
    assert not [f for f in os.listdir(full) if ".tmp" in f or ".prev" in f]
    # evaluation + interpretation view on the checkpoint
    out = C.main(["eval", "--ckpt", full, "--eval_size", "12", "--interpret", "1", "--parse_dropout", "0.5",
                  "--folds", "3", "--out", os.path.join(full, "eval.json")])
    assert (set(out["test"]) >= {"t2i_r1", "t2i_r5", "t2i_r10", "p2i_r1", "p2i_r5", "p2i_r10"}
            and out["test"]["gallery"] == 4)
    assert lifecycle.read_json(os.path.join(full, "eval.json")) == json.loads(json.dumps(out))


@pytest.mark.parametrize("model", [["vse"], ["vse", "--vse_loss", "sampled"], ["single"],
                                   ["vilbert", "--concept_mvsa"]])
def test_baseline_training_runs(tmp_path, model):
    out = C.main(["train", "--method", *model, "--out_dir", str(tmp_path), "--max_steps", "2"]
                 + TRAIN + ["--eval_size", "8"])
    assert 0 <= out["eval"]["in_domain"]["t2i_r1"] <= 100


def test_cli_bad_flags_one_line(tmp_path, capsys):
    for argv in (["--features", "regions", "--train_size", "8"], ["--width", "30", "--heads", "4", "--train_size", "8"],
                 ["eval", "--ckpt", str(tmp_path / "nope")]):
        with pytest.raises(SystemExit) as e:
            C.main(argv + (["--out_dir", str(tmp_path)] if argv[0] != "eval" else []))
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err


def test_damaged_or_foreign_weights_one_line(tmp_path, capsys):
    """eval --ckpt and --init read weights through lifecycle.read_weights: a truncated file or another
    model's weights is one `error:` line naming the file, exit 2."""
    out = str(tmp_path / "vse")
    C.main(["train", "--method", "vse", "--out_dir", out, "--max_steps", "1"] + TRAIN + ["--eval_size", "0"])
    weights = os.path.join(out, "checkpoint", "model.safetensors")
    good = open(weights, "rb").read()
    open(weights, "wb").write(good[:len(good) // 2])
    for argv in (["eval", "--ckpt", out, "--eval_size", "4"],
                 ["train", "--method", "vse", "--init", weights, "--out_dir", str(tmp_path / "i"),
                  "--max_steps", "1"] + TRAIN,
                 ["train", "--method", "single", "--init", str(tmp_path / "ok.safetensors"),
                  "--out_dir", str(tmp_path / "j"), "--max_steps", "1"] + TRAIN):
        open(tmp_path / "ok.safetensors", "wb").write(good)   # complete, but VSE's weights
        with pytest.raises(SystemExit) as e:
            C.main(argv)
        err = error_lines(capsys.readouterr().err)
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and ".safetensors" in err[0], err


def test_frozen_il_clip_patch_features(tmp_path):
    il_clip = pytest.importorskip("il_clip")
    cfg = il_clip.ModelConfig(**{**il_clip.MODEL_PRESETS["tiny"], "vision_layers": 1, "text_layers": 1,
                                 "vision_width": 32, "text_width": 32, "embed_dim": 32, "vision_heads": 2,
                                 "text_heads": 2})
    path = str(tmp_path / "clip.safetensors")
    save_file({k: v.contiguous() for k, v in il_clip.CLIP(cfg).state_dict().items()}, path)
    json.dump({"model": {"vision_heads": 2, "quick_gelu": cfg.quick_gelu}}, open(tmp_path / "config.json", "w"))
    out = C.main(["train", "--features", "clip", "--clip", path, "--out_dir", str(tmp_path / "o"), "--max_steps", "1"]
                 + TRAIN[:2] + ["--train_size", "16"] + TRAIN[4:] + ["--eval_size", "8"])
    assert out["eval"]["in_domain"]["images"] == 8  # 64 patch tokens per image as regions
    # composer.py's own copy of the ViT equals il_clip's forward_tokens (heads from config.json)
    model = il_clip.CLIP(cfg).eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "w.safetensors"))
    sd, heads, qg, size = C.load_clip_vision(str(tmp_path / "w.safetensors"))
    x = torch.randn(3, 3, size, size)
    with torch.no_grad():
        torch.testing.assert_close(C.vit_patch_tokens(sd, heads, qg, x), model.visual.forward_tokens(x),
                                   atol=1e-5, rtol=1e-5)


def test_recall_ties_count_against_the_query():
    S = torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    assert C.recall_at(S, [{0}, {1}], ks=(1, 2)) == {"t2i_r1": 50.0, "t2i_r2": 100.0}
    assert C.recall_at(S, [{0, 1}, {0, 2}], ks=(1,), name="p2i") == {"p2i_r1": 50.0}  # any correct image counts


def test_nonfinite_loss_stops_at_the_next_check_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    """The non-finite flag stays on the device and is read at log / checkpoint steps: a NaN at
    step 5 stops the run at step 6 with one line, and nothing after step 3 is saved."""
    real_step = C.train_step

    def nan_at_5(*a, **k):
        loss, parts = real_step(*a, **k)
        return (loss * float("nan"), parts) if a[6] == 4 else (loss, parts)   # a[6]: 0-based step
    monkeypatch.setattr(C, "train_step", nan_at_5)
    with pytest.raises(SystemExit) as e:
        C.main(["train", "--out_dir", str(tmp_path), "--max_steps", "9"] + TRAIN
               + ["--log_interval", "3", "--save_interval", "3"])
    err = error_lines(capsys.readouterr().err)
    assert e.value.code == 1 and len(err) == 1 and "non-finite loss at a step <= 6" in err[0], err
    assert saved_state(tmp_path)["step"] == 3
    logged = [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl") if "loss" in x]
    assert logged == [3]


def test_nonfinite_weights_are_never_saved(tmp_path, monkeypatch, capsys):
    """A finite loss but a NaN weight after the update (an optimizer blow-up): the save at step 2
    refuses, exit 1, and the step-1 checkpoint stays."""
    real_step = C.train_step

    def poison_after_1(model, *a, **k):
        if a[5] == 1:  # 0-based step 1: the update of step 2 starts from a NaN weight
            with torch.no_grad():
                next(model.parameters())[0].fill_(float("nan"))
        return real_step(model, *a, **k)
    monkeypatch.setattr(C, "train_step", poison_after_1)
    monkeypatch.setattr(C, "sync_values", lambda losses, bad, flag, world: [0.0] * len(losses) + [0.0, 0.0])
    with pytest.raises(SystemExit) as e:
        C.main(["train", "--out_dir", str(tmp_path), "--max_steps", "4"] + TRAIN + ["--save_interval", "1"])
    err = error_lines(capsys.readouterr().err)
    assert e.value.code == 1 and len(err) == 1 and "non-finite" in err[0], err
    assert saved_state(tmp_path)["step"] == 1
    assert all(torch.isfinite(t).all() for t in load_file(str(tmp_path / "checkpoint" / "model.safetensors")).values())


def test_sigterm_to_one_rank_stops_every_rank_and_resumes(tmp_path):
    """torchrun, 2 processes: SIGTERM to rank 1 alone; both ranks agree on the stop step at the
    next log step, rank 0 saves it, all exit 0; --resume continues from that step."""
    from conftest import sigterm_one_rank
    out = str(tmp_path / "s")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                os.path.join(ROOT, "composer.py")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    rc, stdout, stderr = sigterm_one_rank(torchrun + ["--out_dir", out, "--max_steps", "100000"] + TRAIN,
                                          os.path.join(out, "metrics.jsonl"), env=env)
    assert rc == 0, stderr
    step = saved_state(out)["step"]
    assert 0 < step < 100000 and f"stopped by SIGTERM at step {step}/100000 | checkpoint saved | continue with: " \
        f"torchrun --nproc_per_node=2 composer.py train --resume --out_dir {out}" in stderr
    _run(["--resume", "--out_dir", out, "--stop_at", str(step + 1)], nproc=2)
    assert saved_state(out)["step"] == step + 1


def test_damaged_checkpoint_falls_back_or_fails_in_one_line(tmp_path, capsys):
    """A bit flipped in the newest weights: sha256.json says so, --resume falls back to
    checkpoint.prev/ with a note and still ends bit-exactly as the uninterrupted run. A state.pt of
    the wrong types (its sha256 matching) with no previous checkpoint: one error line."""
    ref, out = str(tmp_path / "ref"), str(tmp_path / "run")
    every = ["--max_steps", "4", "--save_interval", "1"]
    C.main(["train", "--out_dir", ref] + TRAIN + every)
    C.main(["train", "--out_dir", out, "--stop_at", "3"] + TRAIN + every)
    ck = os.path.join(out, "checkpoint")
    blob = bytearray(open(os.path.join(ck, "model.safetensors"), "rb").read())
    blob[-5] ^= 0x10
    open(os.path.join(ck, "model.safetensors"), "wb").write(bytes(blob))
    capsys.readouterr()
    C.main(["train", "--resume", "--out_dir", out])
    out_err = capsys.readouterr()
    assert "model.safetensors: damaged" in out_err.err and "resuming from the previous checkpoint" in out_err.err
    assert "resumed at step 2" in out_err.err and same_weights(ref, out)
    torch.save({"step": "4", "sampler": [], "optimizer": {}, "rng": {}}, os.path.join(ck, "state.pt"))
    sums = lifecycle.read_json(os.path.join(ck, "sha256.json"))
    sums["state.pt"] = lifecycle.sha256(os.path.join(ck, "state.pt"))
    lifecycle.save_json(os.path.join(ck, "sha256.json"), sums)
    shutil.rmtree(os.path.join(out, "checkpoint.prev"))
    with pytest.raises(SystemExit) as e:
        C.main(["train", "--resume", "--out_dir", out])
    assert e.value.code == 2 and "state.pt: wrong types" in one_error_line(capsys)
    open(os.path.join(ck, "model.safetensors"), "wb").write(bytes(blob[:len(blob) // 2]))     # truncated
    with pytest.raises(SystemExit) as e:
        C.main(["train", "--resume", "--out_dir", out])
    assert e.value.code == 2 and "model.safetensors: damaged" in one_error_line(capsys)


def test_resume_refuses_a_changed_flag_and_a_new_run_refuses_a_used_out_dir(tmp_path, capsys):
    """--resume with a run-defining flag of another value, and a new run on an out_dir holding a
    checkpoint: one line each, exit 2, no file touched. --overwrite starts over."""
    out = str(tmp_path / "run")
    C.main(["train", "--out_dir", out, "--max_steps", "4", "--stop_at", "2"] + TRAIN)
    def files():
        return {os.path.join(dp, f): open(os.path.join(dp, f), "rb").read() for dp, _, fs in os.walk(out) for f in fs}
    before = files()
    capsys.readouterr()
    for argv, says in ((["--resume", "--lr", "0.5"], "--lr 0.5 differs from the saved run's 0.001"),
                       (["--resume", "--method", "vse"], "--method vse differs"),
                       (TRAIN, "holds the checkpoint of an earlier run: continue it with --resume")):
        with pytest.raises(SystemExit) as e:
            C.main(["train", "--out_dir", out] + argv)
        line = one_error_line(capsys)
        assert e.value.code == 2 and says in line and (argv is not TRAIN or "--overwrite" in line), line
        assert files() == before
    given = C.parse_args(["--split_file", "a.jsonl", "--no-quick_gelu", "--lr", "0.001", "--seed", "0"]).given
    assert given == {"split_file", "quick_gelu", "lr", "seed"}      # what the command line says, defaults or not
    # run-control flags may change; given flags equal to the saved ones are fine
    C.main(["train", "--out_dir", out, "--resume", "--log_interval", "2", "--lr", "0.001"])
    assert saved_state(out)["step"] == 4
    C.main(["train", "--out_dir", out, "--overwrite", "--max_steps", "1"] + TRAIN)
    assert saved_state(out)["step"] == 1 and not os.path.exists(os.path.join(out, "checkpoint.prev"))
    assert [json.loads(x)["step"] for x in open(os.path.join(out, "metrics.jsonl"))] == [1, 1]   # loss, final eval


def test_ctrl_c_saves_a_checkpoint_that_resumes_bit_exactly(tmp_path):
    """SIGINT (Ctrl-C) is handled like SIGTERM: a checkpoint at the next step, exit 0; --resume
    --out_dir then ends where an uninterrupted run with the same flags ends."""
    import signal
    import time
    out, ref = str(tmp_path / "run"), str(tmp_path / "ref")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "composer.py"), "--out_dir", out, "--max_steps", "100000"]
                         + TRAIN, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    metrics, t0 = os.path.join(out, "metrics.jsonl"), time.time()
    while not (os.path.isfile(metrics) and os.path.getsize(metrics)):
        assert p.poll() is None and time.time() - t0 < 120, p.stderr.read()
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr
    step = saved_state(out)["step"]
    assert f"stopped by SIGINT at step {step}/100000 | checkpoint saved | continue with: python composer.py train " \
        f"--resume --out_dir {out}" in stderr
    _run(["--resume", "--out_dir", out, "--stop_at", str(step + 2)])
    _run(["--out_dir", ref, "--max_steps", "100000", "--stop_at", str(step + 2)] + TRAIN)
    assert saved_state(out)["step"] == step + 2 and same_weights(ref, out)


def test_signal_handlers_stay_until_main_returns(tmp_path, monkeypatch):
    """A SIGTERM while the finished run writes its last files does not kill it; main() puts the previous handlers
    back when it returns (a second Ctrl-C exiting at once: tests/test_data_lifecycle.py)."""
    import signal
    before = signal.getsignal(signal.SIGTERM)
    real = C.draw_loss_curve

    def plot_under_sigterm(*a):
        os.kill(os.getpid(), signal.SIGTERM)
        real(*a)
    monkeypatch.setattr(C, "draw_loss_curve", plot_under_sigterm)
    out = C.main(["train", "--out_dir", str(tmp_path), "--max_steps", "1"] + TRAIN)
    assert out["step"] == 1 and os.path.isfile(tmp_path / "loss_curve.png")
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_write_errors_are_one_line_and_keep_the_last_checkpoint(tmp_path, monkeypatch, capsys, code):
    """A write error in the step-4 save: one line naming out_dir and the size, exit 2,
    checkpoint.tmp/ gone, step 2's checkpoint as it was. One in the loss plot: one line too."""
    out = str(tmp_path / "run")
    disk_full_at_save(monkeypatch, 4, code)
    with pytest.raises(SystemExit) as e:
        C.main(["train", "--out_dir", out, "--max_steps", "4"] + TRAIN + ["--save_interval", "2"])
    line = one_error_line(capsys)
    assert e.value.code == 2 and out in line and os.strerror(code).lower() in line and "MiB needed" in line, line
    assert not os.path.exists(os.path.join(out, "checkpoint.tmp")) and saved_state(out)["step"] == 2
    lifecycle.read_checkpoint(os.path.join(out, "checkpoint"), C.STATE_TYPES)       # whole: every sha256 matches
    monkeypatch.undo()

    def no_quota(metrics_path, png_path, *a):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), png_path)
    monkeypatch.setattr(C, "draw_loss_curve", no_quota)
    with pytest.raises(SystemExit) as e:
        C.main(["train", "--out_dir", out, "--resume"])
    assert e.value.code == 2 and "loss_curve.png: Disk quota exceeded" in one_error_line(capsys)


def test_eval_of_another_scripts_checkpoint_names_its_reader(tmp_path, capsys):
    """An il_clip.py out_dir (config.json with "script" and a CLIP "model", no "args"): one line
    naming the script and the command that evaluates it, not a TypeError."""
    ck = tmp_path / "clip" / "checkpoint"
    os.makedirs(ck)
    save_file({"visual.conv1.weight": torch.zeros(8, 3, 4, 4)}, str(ck / "model.safetensors"))
    lifecycle.save_json(str(ck / "config.json"), {"method": "clip", "model": {"vision_width": 8, "vision_layers": 1},
                                             "script": {"name": "il_clip.py", "path": "/x/il_clip.py", "sha256": "0"}})
    with pytest.raises(SystemExit) as e:
        C.main(["eval", "--ckpt", str(tmp_path / "clip")])
    line = one_error_line(capsys)
    assert (e.value.code == 2 and "il_clip.py" in line
            and f"python eval_compositional.py --ckpt {tmp_path / 'clip'}" in line)


FILM = "            return self.out((1 + self.a(p)) * c + self.b(p))\n"


def test_eval_scores_a_fork_with_the_forks_code(tmp_path, capsys):
    """A fork beside composer.py that keeps the weight names (a tanh on FiLM's scale) names itself in its
    start line and resume hint; `composer.py eval` beside it builds and scores the model with the fork's
    code (the numbers of the fork's own final evaluation); composer.py elsewhere refuses the record in one
    line, and with --script composer.py scores it with FiLM (other numbers), saying so."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("composer.py", "data.py", "lifecycle.py"):
        shutil.copy(os.path.join(ROOT, name), repo / name)
    src = open(os.path.join(ROOT, "composer.py")).read()
    assert src.count(FILM) == 1
    (repo / "composer_tanh.py").write_text(src.replace(FILM, FILM.replace("(1 + self.a(p))", "torch.tanh(self.a(p))")))
    fork, reader = (lifecycle.import_script(None, __file__, str(repo / n))[0] for n in ("composer_tanh.py",
                                                                                         "composer.py"))
    out = str(tmp_path / "run")
    argv = ["train", "--out_dir", out, "--max_steps", "3"] + TRAIN + ["--eval_size", "12"]
    fork.main(argv + ["--stop_at", "2"])
    std = capsys.readouterr()
    assert "start: composer_tanh.py train" in std.err and "python composer_tanh.py train --resume" in std.err
    own = fork.main(["train", "--resume", "--out_dir", out])["eval"]["in_domain"]
    capsys.readouterr()
    keys = ["t2i_r1", "t2i_r5", "t2i_r10", "p2i_r1", "p2i_r5", "p2i_r10"]
    ev = ["eval", "--ckpt", out, "--eval_size", "12"]
    res = reader.main(ev)["test"]
    assert {k: res[k] for k in keys} == {k: own[k] for k in keys}
    assert f"model: {out}: code {repo / 'composer_tanh.py'}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        C.main(ev)
    line = one_error_line(capsys)
    assert e.value.code == 2 and "'composer_tanh.py'" in line and "--script PATH" in line
    film = C.main(ev + ["--script", C.__file__])["test"]
    assert f"note: scoring with {C.__file__}, trained by composer_tanh.py" in capsys.readouterr().err
    assert any(film[k] != own[k] for k in keys)
    assert C.main(ev + ["--script", str(repo / "composer_tanh.py")])["test"] == res


def test_eval_refuses_a_damaged_checkpoint(tmp_path, capsys):
    """eval checks the checkpoint against its sha256.json first: a bit-flipped config.json is one line."""
    out = str(tmp_path / "vse")
    C.main(["train", "--method", "vse", "--out_dir", out, "--max_steps", "1"] + TRAIN)
    path = os.path.join(out, "checkpoint", "config.json")
    raw = bytearray(open(path, "rb").read())
    raw[-3] ^= 1
    open(path, "wb").write(bytes(raw))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        C.main(["eval", "--ckpt", out, "--eval_size", "4"])
    assert e.value.code == 2 and one_error_line(capsys) == f"error: {path}: damaged (its sha256 is not the one in " \
                                                           "sha256.json)"


def test_paper_sizes_are_the_default_on_real_data():
    """PT 6 / CT 5 at BERT-base width (paper section 4) unless the data is shapes; flags win."""
    shapes = C.parse_args([])
    assert (shapes.model, shapes.width, shapes.pt_layers, shapes.ct_layers) == ("shapes", 64, 1, 3)
    real = C.parse_args(["--data", "dataset_flickr30k.json"])
    assert (real.model, real.width, real.heads, real.pt_layers, real.ct_layers) == ("paper", 768, 12, 6, 5)
    assert C._ct_kinds(5)[-1] == C._ct_kinds(5)[0]          # the CT ends in self-attention, as it starts
    mixed = C.parse_args(["--data", "dataset_flickr30k.json", "--width", "256", "--ct_layers", "3"])
    assert (mixed.width, mixed.heads, mixed.pt_layers, mixed.ct_layers) == (256, 12, 6, 3)


@pytest.mark.parametrize("model", [["composer"], ["composer", "--modulator", "mlp"], ["vse"], ["single"],
                                   ["vilbert", "--concept_mvsa"]])
def test_bf16_autocast_steps_match_fp32(tmp_path, monkeypatch, model):
    """A GPU trains under bf16 autocast (--dtype bf16, the default). The same steps under bf16
    autocast on the CPU run (scattering theta's bf16 scores into an fp32 buffer once failed on an
    H200) and log fp32's losses to bf16 precision."""
    losses = {}
    for bf16 in (False, True):
        if bf16:
            monkeypatch.setattr(C, "autocast", lambda device, dtype: torch.autocast("cpu", dtype=torch.bfloat16))
        out = str(tmp_path / f"bf16_{bf16}")
        C.main(["train", "--method", *model, "--out_dir", out, "--max_steps", "3"] + TRAIN)
        losses[bf16] = [r["loss"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "loss" in r]
    assert len(losses[True]) == 3 and all(math.isfinite(x) for x in losses[True])
    assert losses[True] != losses[False]        # bf16 autocast was on
    np.testing.assert_allclose(losses[True], losses[False], rtol=0.01, atol=0.005)   # seen: <= 0.011 apart
