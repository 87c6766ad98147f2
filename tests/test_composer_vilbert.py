"""The ViLBERT baseline (two-stream co-attention, no pretraining) and "ViLBERT + MVSA" (paper
Table 5): co-attention runs both ways; the concept l_MVSA equals a pair-by-pair computation."""
import argparse
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import composer as C  # noqa: E402

data = pytest.importorskip("data")


def tiny_vilbert(feat_dim, vocab, eot):
    torch.manual_seed(0)
    cfg = C.ModelConfig(arch="vilbert", vocab_size=vocab, eot_token_id=eot, feat_dim=feat_dim, width=16, heads=2,
                        pt_layers=1, ct_layers=2)
    return C.ViLBERT(cfg).eval()


def test_coattention_updates_both_streams():
    co = C.CoAttention(8, 2, 2).eval()
    x, V = torch.randn(2, 5, 8), torch.randn(2, 4, 8)
    m, vm = torch.ones(2, 5, dtype=torch.bool), torch.ones(2, 4, dtype=torch.bool)
    x1, V1 = co(x, m, V, vm)
    x2, V2 = co(x + torch.randn_like(x), m, V, vm)     # new text: the visual stream changes
    assert not torch.allclose(V1, V2)
    x3, V3 = co(x, m, V + torch.randn_like(V), vm)     # new regions: the text stream changes
    assert not torch.allclose(x1, x3)
    m2 = m.clone()
    m2[:, 3:] = False                                  # masked text tokens are not attended to
    _, Va = co(x, m2, V, vm)
    xb = x.clone()
    xb[:, 3:] += 5.0
    _, Vb = co(xb, m2, V, vm)
    torch.testing.assert_close(Va, Vb)


def test_concept_mvsa_equals_pair_by_pair():
    scenes = [data.shapes_scene("train", i) for i in range(6)]
    tok = data.build_tokenizer(captions=data.shapes_captions(300), vocab_size=300)
    comp = C.TextCompiler(tok)
    fs = [C.shapes_region_features(s.image, s.objects) for s in scenes]
    store = C.FeatureStore([f for f, _ in fs], [b for _, b in fs])
    crgs = [C.caption_crg(s.caption, s.tree) for s in scenes]
    sp = C.Split([str(i) for i in range(6)], [s.caption for s in scenes], crgs, list(range(6)), store, None)
    model = tiny_vilbert(store.feat_dim, tok.vocab_size, tok.eot_id)
    args = argparse.Namespace(alpha=0.8, mvsa="hinge", n_neg_img=2, n_neg_txt=1)
    caps = [0, 1, 2, 3]
    local = torch.tensor([1, 3])                       # this rank's pairs
    ni = torch.tensor([[1, 2], [0, 2], [3, 0], [1, 2]])
    nt = torch.tensor([[2], [3], [0], [0]])
    V, vm = model.encode_image(*store.get(torch.tensor(caps)))
    with torch.no_grad():
        got = C.concept_mvsa(model, comp, sp, caps, local, ni, nt, V, vm, args, 2, "cpu")

        def score(text, img):
            tb = {"tokens": tok([text])}
            return float(model.score_pairs(tb, model.encode_text(tb), V, vm, torch.tensor([0]), torch.tensor([img]))[0])

        total = 0.0
        for i in local.tolist():
            cs, neg = crgs[caps[i]].concepts(), crgs[caps[nt[i, 0]]].concepts()
            for c in cs:
                same = [n for n in neg if n.height == c.height] or \
                    [n for n in neg if abs(n.height - c.height) == min(abs(x.height - c.height) for x in neg)]
                k = sum(1 for x in cs[:cs.index(c)] if x.height == c.height)
                s = score(c.text, i)
                total += max(0.0, 0.8 - s + score(same[k % len(same)].text, i))
                total += sum(max(0.0, 0.8 - s + score(c.text, j)) for j in ni[i].tolist()) / 2  # mean over negatives
        denom = sum(len(crgs[c].concepts()) for c in caps) / 2
    assert float(got) == pytest.approx(total / denom, rel=1e-4, abs=1e-5)
