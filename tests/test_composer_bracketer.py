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
    assert len(pairs) >= 100
    prim, conc, same = scores(pairs)
    print(f"gold set ({len(pairs)} captions): primitive F1 {prim:.3f}, concept F1 {conc:.3f}, "
          f"{same} identical graphs")
    assert prim >= 0.97 and conc >= 0.95


def test_bracketer_f1_on_heldout_captions():
    """Captions written before the rules were revised and never used to tune them: the figure a
    user can expect. Together with the tuning set they are >= 150 captions, a third held out."""
    pairs = read_pairs("composer_captions_heldout.txt")
    assert len(pairs) >= 50 and len(pairs) + len(read_pairs("composer_captions_gold.txt")) >= 150
    prim, conc, same = scores(pairs)
    print(f"held-out ({len(pairs)} captions): primitive F1 {prim:.3f}, concept F1 {conc:.3f}, "
          f"{same} identical graphs")
    assert prim >= 0.97 and conc >= 0.92


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


def prims(caption):
    return sorted(p.word for p in C.caption_crg(caption).primitives())


def test_suffix_words_are_nouns_unless_adjectival():
    # -ic / -al / -ian / -ese end many nouns: they are primitives; -ous / -ful / -ical stay adjectives
    assert prims("A musician playing music at a festival.") == ["festival", "music", "musician"]
    assert prims("Heavy traffic near the hospital.") == ["hospital", "traffic"]
    assert prims("A colorful painting on a tropical beach.") == ["beach", "painting"]


def test_possessive_is_pos_inside_the_np():
    tree = C.bracket("A little girl's dog.")
    assert "(NP (NP (DT a) (JJ little) (NN girl) (POS 's)) (NN dog))" in tree
    assert ([x.text for x in C.caption_crg("A little girl's dog.").concepts()]
            == ["a little girl 's", "a little girl 's dog"])
    assert "(VBZ 's)" in C.bracket("It's a dog.")  # a clitic verb after a pronoun


def test_hyphenated_words_are_one_token():
    assert prims("A man in a black t-shirt.") == ["man", "t-shirt"]
    assert ("(JJ long-haired)" in C.bracket("A long-haired woman.")
            and "(JJ red-and-white) " in C.bracket("A red-and-white sign."))


def test_adjective_heading_a_determiner_phrase_is_a_noun():
    # shapes' captions: "square" is a noun after "a large blue", an adjective before a noun
    assert prims("A small red circle to the left of a large blue square.") == ["circle", "left", "square"]
    assert prims("A square table.") == ["table"]


@pytest.mark.parametrize("caption,fragment", [
    ("The cake is being cut by the bride.", "(VBG being) (VBN cut) (PP (IN by)"),      # passive
    ("A boy was hit by a ball.", "(VBD was) (VBN hit)"),
    ("The player hit the ball.", "(VBD hit) (NP (DT the) (NN ball))"),                # past = base form
    ("A man sits while a dog runs.", "(SBAR (IN while) (S (NP (DT a) (NN dog)) (VP (VBZ runs))))"),
    ("A surfer rides a wave as the sun sets.", "(SBAR (IN as) (S (NP (DT the) (NN sun)) (VP (VBZ sets))))"),
    ("Someone is cooking.", "(NP (NN someone))"),                                      # PTB: NN
    ("The dog is so cute.", "(RB so) (JJ cute)"),
    ("The view is spectacular.", "(JJ spectacular)"),        # open word after a copula: an adjective
    ("A woman slices the bread.", "(VBZ slices) (NP (DT the) (NN bread))"),  # open word before an NP: the verb
    ("A man sittin on a bench.", "(VBG sittin)"),                                      # dropped g
])
def test_bracketer_tags_by_position(caption, fragment):
    assert fragment in C.bracket(caption)
