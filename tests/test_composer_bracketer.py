"""The built-in bracketer against parser-style gold trees of real-style captions (issue 18):
primitive F1 and concept F1 over tests/fixtures/composer_captions_{gold,heldout}.txt, and PTB
function tags."""
import os
import sys
from collections import Counter

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import composer as C  # noqa: E402

FIXTURES = os.path.join(ROOT, "tests", "fixtures")


def read_pairs(name):
    lines = [l.rstrip("\n") for l in open(os.path.join(FIXTURES, name)) if l.strip() and not l.startswith("#")]
    assert len(lines) % 2 == 0
    return list(zip(lines[0::2], lines[1::2]))


def micro_f1(gold_lists, pred_lists):
    """F1 of multisets summed over captions (micro average)."""
    tp = n_pred = n_gold = 0
    for g, p in zip(gold_lists, pred_lists):
        tp += sum((Counter(g) & Counter(p)).values())
        n_pred += len(p)
        n_gold += len(g)
    prec, rec = tp / n_pred, tp / n_gold
    return 2 * prec * rec / (prec + rec)


def bracketed(caption):
    """The built-in bracketer's CRG, or None when it finds no primitive (scored as empty)."""
    try:
        return C.caption_crg(caption)
    except C.CRGError:
        return None


def scores(pairs):
    gold = [C.crg_from_tree(t, c) for c, t in pairs]
    pred = [bracketed(c) for c, _ in pairs]  # no tree: the built-in bracketer
    prims = lambda g: [p.word for p in g.primitives()] if g else []
    nodes = lambda g: [(x.text, x.predicate) for x in g.concepts()] if g else []
    prim = micro_f1([prims(g) for g in gold], [prims(b) for b in pred])
    conc = micro_f1([[t for t, _ in nodes(g)] for g in gold], [[t for t, _ in nodes(b)] for b in pred])
    same = sum(nodes(g) == nodes(b) for g, b in zip(gold, pred))
    return prim, conc, same


def test_micro_f1_by_hand():
    # 2 of 3 predicted right, 2 of 4 gold found: P = 2/3, R = 1/2, F1 = 4/7
    assert micro_f1([["a", "b"], ["c", "d"]], [["a", "x"], ["c"]]) == pytest.approx(4 / 7)
    assert micro_f1([["a", "a"]], [["a"]]) == pytest.approx(2 * 1 * 0.5 / 1.5)  # multisets


def test_bracketer_f1_on_real_style_captions():
    pairs = read_pairs("composer_captions_gold.txt")
    assert len(pairs) >= 60
    prim, conc, same = scores(pairs)
    print(f"gold set ({len(pairs)} captions): primitive F1 {prim:.3f}, concept F1 {conc:.3f}, "
          f"{same} identical graphs")
    assert prim >= 0.95 and conc >= 0.85


def test_bracketer_f1_on_heldout_captions():
    """Captions written after the rules were frozen: the figure a user can expect."""
    pairs = read_pairs("composer_captions_heldout.txt")
    prim, conc, same = scores(pairs)
    print(f"held-out ({len(pairs)} captions): primitive F1 {prim:.3f}, concept F1 {conc:.3f}, "
          f"{same} identical graphs")
    assert prim >= 0.95 and conc >= 0.85


@pytest.mark.parametrize("caption,predicate", [
    ("A man rides a horse.", "[NP] rides [NP]"),                # present tense after the subject
    ("Two dogs play in the snow.", "[NP] play in [NP]"),        # base form after a plural subject
    ("The dog caught the frisbee.", "[NP] caught [NP]"),        # irregular past
    ("A man walked his dog.", "[NP] walked [NP]"),              # regular past
    ("A girl has eaten a sandwich.", "[NP] has eaten [NP]"),    # participle after an auxiliary
])
def test_bracketer_verbs_in_every_tense(caption, predicate):
    assert C.caption_crg(caption).predicate == predicate


def test_bracketer_ing_nouns_and_adjectives():
    c = C.caption_crg("A man is painting the building.")
    assert [p.word for p in c.primitives()] == ["man", "building"]
    c = C.caption_crg("A purple and beige striped umbrella.")
    assert [p.word for p in c.primitives()] == ["umbrella"] and c.predicate == "a purple and beige striped [NN]"
    c = C.caption_crg("A woman swimming in a swimming pool.")
    assert sorted(p.word for p in c.primitives()) == ["pool", "swimming", "woman"]


def test_ptb_function_tags_are_stripped():
    tree = ("(S (NP-SBJ=1 (DT a) (NN man)) (VP (VBZ rides) (NP-2 (DT a) (NN horse)) "
            "(PP-LOC (IN on) (NP (DT the) (NN beach)))) (-NONE- *T*-1) (. .))")
    c = C.crg_from_tree(tree, "a man rides a horse on the beach.")
    assert [(x.tag, x.predicate) for x in c.concepts()] == [
        ("NP", "a [NN]"), ("NP", "a [NN]"), ("NP", "the [NN]"), ("S", "[NP] rides [NP] on [NP]")]
    assert C._strip_function_tags("-LRB-") == "-LRB-" and C._strip_function_tags("PRP$") == "PRP$"
