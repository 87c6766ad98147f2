"""Grounding of shapes captions in mm_learngene.py (issue 43 item 4): a caption is scored true of its
image when it parses in the shapes grammar (with the references' synonyms) and data.caption_is_true
holds; checked here against hand-built scenes whose truths are worked out by hand. Also: the
stand-in LM is trained on reference pairs, batched greedy decoding equals a hand loop."""
import json
import random

import pytest
import torch

import data
import mm_learngene as M
from test_data import parse_shapes_caption as grammar_parser
from test_mm_caption import tiny_captioner, to_grammar


def obj(shape, colour, size, cx, cy, r=4):
    return data.Obj(shape, colour, size, (cx - r, cy - r, cx + r, cy + r))


# two hand-built scenes: A = a large red circle at (5, 5), a small blue star at (45, 5) (so the circle is
# to the left of the star, by 40 px in x and 0 in y); B = a small green square alone
SCENES = {"A": [obj("circle", "red", "large", 5, 5), obj("star", "blue", "small", 45, 5)],
          "B": [obj("square", "green", "small", 20, 40)]}
# (scene, caption, in the grammar?, true of the scene?): every truth worked out by hand from the boxes
CASES = [("A", "a red circle to the left of a blue star", True, True),
         ("A", "a blue star to the left of a red circle", True, False),     # the converse is what holds
         ("A", "a blue star is on the right of a red disc", True, True),    # synonyms, copula, converse
         ("A", "there is a big red circle", True, True),
         ("A", "a small red circle", True, False),                           # the circle is large
         ("A", "a violet circle", True, False),                              # no purple object
         ("A", "a red circle and a blue star", True, True),
         ("A", "a red circle and a red circle", True, False),                # two distinct objects needed
         ("A", "a red circle above a blue star", True, False),
         ("A", "a tiny blue star beneath a red circle and a green square", True, False),   # no green square
         ("A", "red circle blue star", False, False),                        # not in the grammar
         ("A", "a red circle is", False, False),
         ("B", "a small green square", True, True),
         ("B", "an green square", True, True),                               # the article is not checked
         ("B", "a green square to the left of a green square", True, False),
         ("B", "", False, False)]


def test_truth_rate_against_hand_built_scenes():
    scene_of = lambda key: data.Scene(None, "", "", SCENES[key.split("/")[0]], [])
    hyps = {f"{s}/{i}": [c] for i, (s, c, _, _) in enumerate(CASES)}
    got = M.grounding(hyps, scene_of)
    # by hand: the two captions that name one object twice
    repeated = ["a red circle and a red circle", "a green square to the left of a green square"]
    assert got == {"truth_rate": round(100 * sum(t for *_, t in CASES) / len(CASES), 2),
                   "grammatical_rate": round(100 * sum(g for _, _, g, _ in CASES) / len(CASES), 2),
                   "repeated_object_rate": round(100 * len(repeated) / len(CASES), 2)}
    for i, (s, c, gram, true) in enumerate(CASES):      # one by one: each case as worked out
        one = M.grounding({f"{s}/{i}": [c]}, scene_of)
        assert (one["grammatical_rate"], one["truth_rate"]) == (100 * gram, 100 * true), c


def test_every_reference_parses_as_the_test_grammar_reads_it_and_is_true():
    """parse_shapes_caption of a reference (synonyms, "there is", converse order) equals the test
    suite's own grammar parser on the reference mapped back to the grammar's words by hand."""
    for split in ("test", "productivity"):
        for i in range(60):
            scene = data.shapes_scene(split, i, 0, 32)
            for r in M.shapes_references(scene, 5, random.Random(f"g/{split}/{i}")):
                assert M.parse_shapes_caption(r) == grammar_parser(to_grammar(r)) is not None, r
            assert M.grounding({"k": [scene.caption]}, lambda k: scene)["truth_rate"] == 100


def test_greedy_decoding_of_a_batch_equals_a_hand_loop(tmp_path):
    lm, tok, cap = tiny_captioner(tmp_path)
    images = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        want = []
        for p in cap.prefix(images):        # one image at a time: the most likely next token until EOS
            ids = []
            while len(ids) < 8 and (not ids or ids[-1] != tok.eos):
                ids.append(lm(torch.cat([p, lm.wte(torch.tensor(ids, dtype=torch.long))])[None])[0, -1].argmax().item())
            want.append(ids)
    assert M.generate(cap, images, beam=1, max_len=8) == want


def test_stand_in_lm_is_trained_on_reference_pairs_and_replaces_an_old_one(tmp_path, capsys):
    folder = tmp_path / "lm"
    M.train_shapes_lm(str(folder), 0, steps=2)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["text"] == "reference pairs" and cfg["steps"] == 2
    lm, tok = M.load_gpt2(str(folder))      # the references' synonyms are in its BPE's words
    assert tok.decode(tok.encode("a violet rhombus beneath a big disc")) == "a violet rhombus beneath a big disc"
    (folder / "config.json").write_text(json.dumps({"n_head": 4, "steps": 400}))   # a stand-in of single captions
    M.train_shapes_lm(str(folder), 0, steps=3)
    assert "retraining it" in capsys.readouterr().err
    assert json.loads((folder / "config.json").read_text())["steps"] == 3


def ngrams(ids, n):
    return [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]


def test_repeat_bans_by_hand_and_no_ngram_twice_in_decoding(tmp_path):
    """--no_repeat_ngram n: repeat_bans worked out by hand; greedy and beam captions then hold no
    n-gram twice, where the same captioner without it repeats one."""
    assert M.repeat_bans([5, 6, 7, 5, 6], 3) == [7]             # "5 6" was followed by 7
    assert M.repeat_bans([5, 6, 7, 5, 6], 2) == [7]             # "6" was followed by 7
    assert M.repeat_bans([5, 6, 5], 2) == [6]
    assert sorted(M.repeat_bans([5, 6, 5], 1)) == [5, 5, 6]      # n 1: no token twice
    assert M.repeat_bans([5, 6, 7], 0) == [] and M.repeat_bans([5], 3) == []
    lm, tok, cap = tiny_captioner(tmp_path)
    images = torch.randn(6, 3, 16, 16)
    plain = M.generate(cap, images, beam=1, max_len=12)
    assert any(len(set(ngrams(c, 2))) < len(ngrams(c, 2)) for c in plain)   # the test can fail
    for beam in (1, 3):
        for c in M.generate(cap, images, beam=beam, max_len=12, no_repeat=2):
            assert len(set(ngrams(c, 2))) == len(ngrams(c, 2)), c


def test_the_mapper_reads_the_grid_or_the_oracles_objects(tmp_path):
    """--caption_input: grid = every last-layer token (its first is the pooled CLS feature);
    scene = one token per true object (scene_tokens, worked out by hand), no pixels."""
    lm, tok, cap = tiny_captioner(tmp_path)
    visual = cap.frozen[0]
    images = torch.randn(2, 3, 16, 16)
    grid = visual(images, all_tokens=True)
    assert grid.shape == (2, 1 + 2 * 2, 16) and torch.allclose(grid[:, 0], visual(images))
    scene = data.Scene(None, "", "", [obj("star", "blue", "small", 40, 8), obj("circle", "red", "large", 8, 24)], [])
    got = M.scene_tokens(scene, 64)
    want = torch.zeros(3, 18)
    # the red circle first (red before blue in COLOUR_NAMES): red 0, circle 8 + 0, large 14 + 1
    want[0, [0, 8, 15]] = 1
    want[0, 16:] = torch.tensor([8 / 64, 24 / 64])
    # the blue star: blue 2, star 8 + 3, small 14 + 0
    want[1, [2, 11, 14]] = 1
    want[1, 16:] = torch.tensor([40 / 64, 8 / 64])
    assert torch.equal(got, want)
    for inputs, width in (("grid", 16), ("scene", 18)):
        c = M.ClipCap(visual, lm, tok, 8, inputs=inputs, scene_of=lambda key: scene)
        assert c.mapper.linear.in_features == width
        logits = c(images, torch.zeros(2, 3, dtype=torch.long), keys=["a", "b"])
        logits.sum().backward()
        assert all(p.grad is not None for p in c.mapper.parameters())
        assert all(p.grad is None for p in visual.parameters())
    # the oracle sees no pixels: other images, the same prefix
    assert torch.equal(c.prefix(images, ["a", "b"]), c.prefix(torch.randn(2, 3, 16, 16), ["a", "b"]))


def test_the_oracle_on_other_data_is_one_line_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        M.main(["finetune", "--init", "scratch", "--task", "caption", "--caption_input", "scene",
                "--data", str(tmp_path / "train.csv"), "--out_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == ["error: --caption_input scene (the oracle) reads the true objects of shapes "
                                         "images: it needs --data shapes and no other --eval_data"]
    assert not (tmp_path / "run").exists()
