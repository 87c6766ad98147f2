"""NegCLIP hard-negative captions (issue: swap within one part of speech). The fixture is 80
real-style captions hand-tagged with Penn Treebank tags (spatial relations with an opposite are
tagged REL); the last 20 were written after the tagger was frozen. A negative is judged from the
gold tags alone, independently of the tagger (il_clip.tag_caption). Also: a swap never just
reorders the conjuncts of a coordination (a false negative), and the loader re-draws each caption's
negative every epoch, deterministically (resume replays it)."""
import os
import random
import re

import pytest
import torch

import data
import il_clip as M

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
            neg = M.negative_caption(caption, random.Random(seed))
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
    seen = {M.negative_caption(caption, random.Random(s)) for s in range(20)}
    assert seen <= allowed and seen, seen


def test_article_follows_the_swapped_word():
    neg = M.negative_caption("a red apple and an old umbrella", random.Random(0))
    assert neg in ("an old apple and a red umbrella", "a red umbrella and an old apple"), neg


def test_nothing_to_swap():
    assert M.negative_caption("a dog", random.Random(0)) is None
    assert M.negative_caption("", random.Random(0)) is None


def _tokens(text):
    return ["a" if t == "an" else t for t in re.findall(r"[\w'&-]+|[,;]", text.lower())]


def reorders_coordination(caption, negative):
    """Whether `negative` is `caption` with two conjuncts exchanged (the same meaning): a window
    that ends at a comma or before "and"/"or", and a later window that starts after one."""
    toks, neg = _tokens(caption), _tokens(negative)
    bound = [t in (",", ";", "and", "or", "&") for t in toks]
    first = next((k for k, (x, y) in enumerate(zip(toks, neg)) if x != y), len(toks))
    n = len(toks)
    return any(toks[:a] + toks[c:d] + toks[b:c] + toks[a:b] + toks[d:] == neg
               for a in range(first + 1) for b in range(a + 1, n) if bound[b]
               for c in range(b + 1, n) if bound[c - 1] for d in range(c + 1, n + 1))


def test_the_coordination_judge():
    assert reorders_coordination("a dog and a cat on a sofa", "a cat and a dog on a sofa")
    assert reorders_coordination("bananas, apples and oranges", "oranges, apples and bananas")
    assert reorders_coordination("a man riding a horse and a man riding a bike",
                                 "a man riding a bike and a man riding a horse")
    assert not reorders_coordination("a dog and a cat on a sofa", "a sofa and a cat on a dog")
    assert not reorders_coordination("a man riding a horse and a woman walking a dog",
                                     "a woman riding a horse and a man walking a dog")
    assert not reorders_coordination("a red apple and an old umbrella", "an old apple and a red umbrella")


@pytest.mark.parametrize("caption", [
    "bananas, apples and oranges", "A man and a woman", "a red and blue ball", "two men and two women",
    "a cup, a plate and a fork", "a red car or a blue car",
])
def test_coordination_sides_are_never_swapped(caption):
    """Each of these offers only swaps across a coordination that keep the meaning: no negative."""
    assert {M.negative_caption(caption, random.Random(s)) for s in range(20)} == {None}


@pytest.mark.parametrize("caption", [
    "a dog and a cat on a sofa",                              # sofa <-> dog, sofa <-> cat stay
    "a man riding a horse and a man riding a bike",          # not horse <-> bike
    "a man riding a horse and a woman walking a dog",       # man <-> woman changes who does what
    "a red apple and an old umbrella",                       # red <-> old, apple <-> umbrella
    "a man and a woman cutting a wedding cake on a table",
    "a mother and her daughter baking cookies",
])
def test_swaps_that_change_the_meaning_stay(caption):
    negs = {M.negative_caption(caption, random.Random(s)) for s in range(30)} - {None}
    assert negs and not any(reorders_coordination(caption, n) for n in negs), negs


def test_no_negative_of_the_fixture_reorders_a_coordination():
    for words, _ in load_tagged():
        caption = " ".join(words)
        for seed in range(5):
            neg = M.negative_caption(caption, random.Random(seed))
            assert neg is None or not reorders_coordination(caption, neg), (caption, neg)


def _negatives_by_key(loader, epochs):
    """Per epoch: {sample key: (caption, negative tokens, neg_valid)}."""
    return [{k: (c, tuple(t.tolist()), bool(v)) for b in loader
             for k, c, t, v in zip(b["key"], b["caption"], b["neg_text"], b["neg_valid"])} for _ in range(epochs)]


def test_negatives_are_redrawn_each_epoch_and_replay_exactly():
    """Made and tokenized in the loader's workers (the same with 0 or 1 worker); a caption's
    negative is one of its negatives, different across epochs, and a loader resumed mid-epoch
    draws the same ones as the uninterrupted run."""
    tok = data.build_tokenizer(captions=data.shapes_captions(200, 0), vocab_size=300, context_length=32)
    make = lambda workers: data.make_loader("shapes:train_size=64", batch_size=16, tokenizer=tok,
                                            num_workers=workers, batch_extra=M.NegativeCaptions(tok, seed=3))
    runs = _negatives_by_key(make(0), 3)
    assert _negatives_by_key(make(1), 3) == runs and len(runs[0]) == 64
    several = 0
    for key, (caption, _, _) in runs[0].items():
        options = {M.negative_caption(caption, random.Random(s)) for s in range(60)}
        allowed = {tuple(t.tolist()) for t in tok([n or caption for n in options])}
        assert all(run[key][1] in allowed and run[key][2] == (None not in options) for run in runs), caption
        if len(options) > 2:
            several += 1
            several -= len({run[key][1] for run in runs}) == 1       # the same negative 3 epochs running
    assert several >= 20                  # most captions with several negatives got another one
    resumed = make(0)
    resumed.load_state_dict({"epoch": 1, "batches_done": 2})
    rest = _negatives_by_key(resumed, 1)[0]
    assert len(rest) == 32 and all(runs[1][k] == v for k, v in rest.items())
