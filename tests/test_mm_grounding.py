"""Grounding of shapes captions in mm_learngene.py (issue 43 item 4): a caption is scored true of its
image when it parses in the shapes grammar (with the references' synonyms) and data.caption_is_true
holds; checked here against hand-built scenes whose truths are worked out by hand. Also: the
stand-in LM is trained on reference pairs, batched greedy decoding equals a hand loop."""
import json
import random

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
    assert got == {"truth_rate": round(100 * sum(t for *_, t in CASES) / len(CASES), 2),
                   "grammatical_rate": round(100 * sum(g for _, _, g, _ in CASES) / len(CASES), 2)}
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
