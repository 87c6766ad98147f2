"""NegCLIP hard-negative captions (issue: swap within one part of speech). The fixture is 80
real-style captions hand-tagged with Penn Treebank tags (spatial relations with an opposite are
tagged REL); the last 20 were written after the tagger was frozen. A negative is judged from the
gold tags alone, independently of the tagger (data.tag_caption)."""
import os
import random

import pytest

import data

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "negclip_captions.txt")


def load_tagged(path=FIXTURE):
    out = []
    with open(path) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                toks = [t.rsplit("/", 1) for t in line.split()]
                out.append(([w for w, _ in toks], [t for _, t in toks]))
    return out


def edit_is_grammatical(words, gold, negative):
    """True when `negative` exchanges two non-adjacent words with one gold tag, or replaces words
    inside one REL phrase (a relation flip); a/an agreement changes are ignored."""
    art = lambda ws: ["a" if w in ("a", "an") else w for w in ws]
    pos, neg = art([w.lower() for w in words]), art([w.lower() for w in negative.split()])
    if pos == neg:
        return False
    if len(pos) == len(neg):
        diff = [i for i in range(len(pos)) if pos[i] != neg[i]]
        if len(diff) == 2:
            i, j = diff
            if (pos[i], pos[j]) == (neg[j], neg[i]):
                return j > i + 1 and gold[i] == gold[j] and gold[i] != "REL"
    p = 0
    while p < min(len(pos), len(neg)) and pos[p] == neg[p]:
        p += 1
    s = 0
    while s < min(len(pos), len(neg)) - p and pos[-1 - s] == neg[-1 - s]:
        s += 1
    span = range(p, len(pos) - s)
    return len(span) > 0 and all(gold[k] == "REL" for k in span)


def test_negatives_swap_within_one_part_of_speech():
    tagged = load_tagged()
    assert len(tagged) >= 80
    made = good = 0
    for words, gold in tagged:
        caption = " ".join(words)
        for seed in range(5):
            neg = data.negative_caption(caption, random.Random(seed))
            if neg is None:
                continue
            made += 1
            assert neg.lower() != caption.lower()
            good += edit_is_grammatical(words, gold, neg)
    assert made >= 0.9 * 5 * len(tagged)          # nearly every caption offers a swap
    assert good / made >= 0.95, f"{good}/{made} grammatical"


@pytest.mark.parametrize("caption, allowed", [
    ("A man rides a horse on the beach.", {"A horse rides a man on the beach.", "A beach rides a horse on the man.",
                                           "A man rides a beach on the horse."}),   # the verb stays a verb
    ("a dog sitting in front of a red car", {"a dog sitting behind a red car", "a car sitting in front of a red dog"}),
    ("a cat to the left of a small box", {"a cat to the right of a small box", "a box to the left of a small cat"}),
])
def test_negative_examples(caption, allowed):
    seen = {data.negative_caption(caption, random.Random(s)) for s in range(20)}
    assert seen <= allowed and seen, seen


def test_article_follows_the_swapped_word():
    neg = data.negative_caption("a red apple and an old umbrella", random.Random(0))
    assert neg in ("an old apple and a red umbrella", "a red umbrella and an old apple"), neg


def test_nothing_to_swap():
    assert data.negative_caption("a dog", random.Random(0)) is None
    assert data.negative_caption("", random.Random(0)) is None
