"""Captioning in mm_learngene.py (paper Sec. 4.4, Table 2): COCO caption metrics against hand
computation and pycocoevalcap, the raw GPT-2 against the released key layout, decoding, and
`finetune --task caption` (vision encoder and LM frozen, only the ClipCap mapper trained)."""
import json
import math
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

import data
import mm_learngene as M
from test_data import parse_shapes_caption


def test_bleu_hand_computed():
    # clipped counts: unigrams the x2 (ref has 2) + cat x2 (ref has 1) -> 3/4; bigrams "the cat" x2
    # (ref 1) + "cat the" -> 1/3; hypothesis 4 words, reference 6: brevity penalty exp(1 - 6/4)
    b = M.bleu({"x": ["the cat sat on the mat"]}, {"x": ["the cat the cat"]})
    assert b[0] == pytest.approx(0.75 * math.exp(-0.5), rel=1e-9)
    assert b[1] == pytest.approx(math.sqrt(0.75 / 3) * math.exp(-0.5), rel=1e-9)
    # the closest reference length, ties to the shorter one (2, not 4, for a 3-word hypothesis): no penalty
    assert M.bleu({"x": ["a b", "a b c d"]}, {"x": ["a b c"]})[0] == pytest.approx(1.0, rel=1e-9)
    # corpus BLEU sums counts over images before dividing (not a mean of sentence scores)
    b = M.bleu({"x": ["a b"], "y": ["c d"]}, {"x": ["a b"], "y": ["c e"]})
    assert b[0] == pytest.approx(3 / 4, rel=1e-9) and b[1] == pytest.approx(math.sqrt(3 / 4 * 1 / 2), rel=1e-9)


def test_rouge_l_hand_computed():
    # LCS(a b c d e, a c e f) = 3: P = 3/4, R = 3/5, F_beta (beta 1.2)
    p, r = 3 / 4, 3 / 5
    f = (1 + 1.44) * p * r / (r + 1.44 * p)
    assert M.rouge_l({"x": ["a b c d e"]}, {"x": ["a c e f"]}) == pytest.approx(f, rel=1e-12)
    # max precision and max recall over references, taken separately
    assert M.rouge_l({"x": ["a b", "a b c d e f"]}, {"x": ["a b c"]}) == \
        pytest.approx(2.44 * 1 * 1 / (1 + 1.44 * 1), rel=1e-12)


def test_cider_d_hand_computed():
    # two images, disjoint words: every document frequency is 1, every weight tf * log(2).
    # Image 1: hypothesis = reference -> cosine 1 at n = 1..4 -> 10. Image 2: "e f g" against
    # "e f g h": n=1 3/sqrt(3*4), n=2 2/sqrt(2*3), n=3 1/sqrt(1*2), n=4 0; length penalty
    # exp(-(2-3)^2 / (2*36)) from the bigram counts.
    refs = {"1": ["a b c d"], "2": ["e f g h"]}
    hyps = {"1": ["a b c d"], "2": ["e f g"]}
    two = 10 * (3 / math.sqrt(12) + 2 / math.sqrt(6) + 1 / math.sqrt(2)) / 4 * math.exp(-1 / 72)
    assert M.cider_d(refs, hyps) == pytest.approx((10 + two) / 2, rel=1e-12)
    # an n-gram in every image's references has idf log(2/2) = 0: it earns nothing
    assert M.cider_d({"1": ["a"], "2": ["a"]}, {"1": ["a"], "2": ["a"]}) == 0.0


def test_metrics_match_pycocoevalcap():
    pytest.importorskip("pycocoevalcap")
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge
    rng = random.Random(0)
    words = "a red blue small large circle square star above below left of the".split()
    sent = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(2, 9)))
    refs = {str(i): [sent() for _ in range(rng.randint(1, 5))] for i in range(40)}
    hyps = {k: [sent() if rng.random() < 0.6 else v[0]] for k, v in refs.items()}
    ref_bleu, _ = Bleu(4).compute_score(refs, hyps, verbose=0)
    for mine, ref in zip(M.bleu(refs, hyps), ref_bleu):
        assert mine == pytest.approx(ref, rel=1e-9, abs=1e-12)
    assert M.cider_d(refs, hyps) == pytest.approx(Cider().compute_score(refs, hyps)[0], rel=1e-9)
    assert M.rouge_l(refs, hyps) == pytest.approx(Rouge().compute_score(refs, hyps)[0], rel=1e-9)


def test_empty_hypotheses_are_scored_empty():
    """A model that emits nothing (or only punctuation) is scored on an empty caption, as
    pycocoevalcap does: no stand-in word that could earn n-gram matches."""
    refs = {"1": ["a red circle", "a big red circle"], "2": ["a blue square above a star"], "3": ["x y z ."]}
    hyps = {"1": [""], "2": ["a blue square"], "3": ["..."]}
    s = M.caption_scores(refs, hyps)
    # image 2 alone earns matches: 3 of 3 unigrams, 2 of 2 bigrams, 1 trigram; no 4-gram
    tok = {k: [M.caption_tokens(r) for r in v] for k, v in refs.items()}
    emp = {k: [M.caption_tokens(v[0])] for k, v in hyps.items()}
    assert emp["3"] == [""] and s["bleu1"] == round(100 * M.bleu(tok, emp)[0], 2)
    assert M.rouge_l(tok, emp) == pytest.approx(M.rouge_l({"2": tok["2"]}, {"2": emp["2"]}) / 3, rel=1e-12)
    all_empty = M.caption_scores(refs, {k: [""] for k in refs})
    assert all_empty["cider"] == 0 and all_empty["rouge_l"] == 0 and all_empty["bleu1"] == 0
    pytest.importorskip("pycocoevalcap")
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge
    for h in (emp, {k: [""] for k in refs}):
        for mine, ref in zip(M.bleu(tok, h), Bleu(4).compute_score(tok, h, verbose=0)[0]):
            assert mine == pytest.approx(ref, rel=1e-9, abs=1e-12)
        assert M.cider_d(tok, h) == pytest.approx(Cider().compute_score(tok, h)[0], rel=1e-9, abs=1e-12)
        assert M.rouge_l(tok, h) == pytest.approx(Rouge().compute_score(tok, h)[0], rel=1e-9, abs=1e-12)


# the paraphrases shapes_references may use, mapped back to the grammar's words by hand
BACK_TO_GRAMMAR = [(" on the left of ", " LEFT "), (" to the left of ", " LEFT "), (" left of ", " LEFT "),
                   (" on the right of ", " RIGHT "), (" to the right of ", " RIGHT "), (" right of ", " RIGHT "),
                   (" LEFT ", " to the left of "), (" RIGHT ", " to the right of "), (" over ", " above "),
                   (" under ", " below "), (" beneath ", " below "), (" little ", " small "), (" tiny ", " small "),
                   (" big ", " large "), (" violet ", " purple "), (" disc ", " circle "), (" plus sign ", " cross "),
                   (" rhombus ", " diamond ")]


def to_grammar(text):
    t = " " + text.removeprefix("there is ") + " "
    for a, b in BACK_TO_GRAMMAR:
        t = t.replace(a, b)
    return t.strip()


def test_shapes_references_are_true_distinct_and_deterministic():
    """Five references per image, the first the image's own caption, all different, each true
    of the image once its synonyms are mapped back (parsed by the grammar's parser, checked by
    caption_is_true); the same seed gives the same references; across images the object order,
    the copula, synonyms and relation paraphrases all occur."""
    seen = set()
    for split in ("train", "test", "productivity"):
        for i in range(120):
            scene = data.shapes_scene(split, i, 0, 32)
            refs = M.shapes_references(scene, 5, random.Random(f"t/{split}/{i}"))
            assert refs == M.shapes_references(scene, 5, random.Random(f"t/{split}/{i}"))
            assert len(refs) == 5 == len(set(refs)) and refs[0] == scene.caption
            for r in refs:
                struct = parse_shapes_caption(to_grammar(r))
                assert struct is not None and data.caption_is_true(struct, scene.objects), (scene.caption, r)
                if struct.phrases[0].shape != scene.struct.phrases[0].shape:
                    seen.add("order")
                seen.update(w for w in ("is", "there", "disc", "rhombus", "beneath", "over", "big", "left")
                            if w in r.split() and w not in scene.caption.split())
    assert seen == {"order", "is", "there", "disc", "rhombus", "beneath", "over", "big", "left"}


def test_best_constant_and_nearest_caption():
    """The constant baseline is the candidate with the highest corpus CIDEr-D when given to
    every image (checked against pycocoevalcap's Cider when present, else cider_d); the
    nearest-neighbour baseline takes the caption of the highest-cosine pool image."""
    rng = random.Random(1)
    refs = {str(i): M.shapes_references(data.shapes_scene("train", i, 0), 5, rng) for i in range(30)}
    cands = sorted({v[0] for v in refs.values()})
    try:
        from pycocoevalcap.cider.cider import Cider
        cider = lambda c: Cider().compute_score(refs, {k: [c] for k in refs})[0]
    except ImportError:
        cider = lambda c: M.cider_d(refs, {k: [c] for k in refs})
    scores = [cider(c) for c in cands]
    assert M.constant_ciders(refs, cands) == pytest.approx(scores, rel=1e-9, abs=1e-12)
    best, pool_cider = M.best_constant(refs, cands)
    assert best == cands[scores.index(max(scores))] and pool_cider == round(100 * max(scores), 2)
    g = torch.Generator().manual_seed(0)
    pool_feats, query = torch.randn(30, 8, generator=g), torch.randn(7, 8, generator=g)
    pool = M.CaptionPool(pool_feats, cands[:30] + ["x"] * (30 - len(cands[:30])), refs)
    want = []
    for q in query:
        cos = [float(q @ p / (q.norm() * p.norm())) for p in pool_feats]
        want.append(pool.captions[cos.index(max(cos))])
    assert pool.nearest(query) == want and pool.constant == best


def write_released_gpt2(folder, d=16, layers=2, heads=2, vocab_text=None, positions=40):
    """A tiny randomly initialised GPT-2 in the released HF layout: `transformer.` prefix,
    Conv1D weights [in, out], the causal-mask buffer attn.bias, a tied lm_head; its byte-level
    BPE as vocab.json + merges.txt."""
    from tokenizers import ByteLevelBPETokenizer
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(vocab_text or ["a red circle above a blue square"] * 20, vocab_size=300,
                            special_tokens=[M.GPT2_EOS], show_progress=False)
    os.makedirs(folder, exist_ok=True)
    tok.save_model(str(folder))
    V, P = tok.get_vocab_size(), positions
    g = torch.Generator().manual_seed(0)
    r = lambda *s: 0.2 * torch.randn(*s, generator=g)
    sd = {"transformer.wte.weight": r(V, d), "transformer.wpe.weight": r(P, d),
          "transformer.ln_f.weight": 1 + r(d), "transformer.ln_f.bias": r(d)}
    for i in range(layers):
        h = f"transformer.h.{i}."
        sd.update({h + "ln_1.weight": 1 + r(d), h + "ln_1.bias": r(d),
                   h + "ln_2.weight": 1 + r(d), h + "ln_2.bias": r(d),
                   h + "attn.c_attn.weight": r(d, 3 * d), h + "attn.c_attn.bias": r(3 * d),
                   h + "attn.c_proj.weight": r(d, d), h + "attn.c_proj.bias": r(d),
                   h + "mlp.c_fc.weight": r(d, 4 * d), h + "mlp.c_fc.bias": r(4 * d),
                   h + "mlp.c_proj.weight": r(4 * d, d), h + "mlp.c_proj.bias": r(d),
                   h + "attn.bias": torch.tril(torch.ones(P, P)).view(1, 1, P, P)})
    sd["lm_head.weight"] = sd["transformer.wte.weight"].clone()
    save_file(sd, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"n_head": heads, "n_embd": d, "n_layer": layers}, f)
    return {k.removeprefix("transformer."): v for k, v in sd.items()}


def naive_gpt2_logits(sd, ids, heads):
    """GPT-2 written out position by position from the released tensors (x @ W for Conv1D)."""
    ln = lambda x, p: torch.nn.functional.layer_norm(x, x.shape[-1:], sd[p + ".weight"], sd[p + ".bias"], 1e-5)
    gelu = lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    x = sd["wte.weight"][ids] + sd["wpe.weight"][: len(ids)]
    d = x.shape[1]
    hd = d // heads
    layers = len({k.split(".")[1] for k in sd if k.startswith("h.")})
    for i in range(layers):
        h = f"h.{i}."
        qkv = ln(x, h + "ln_1") @ sd[h + "attn.c_attn.weight"] + sd[h + "attn.c_attn.bias"]
        q, k, v = qkv[:, :d], qkv[:, d:2 * d], qkv[:, 2 * d:]
        out = torch.zeros_like(x)
        for t in range(len(ids)):
            for j in range(heads):
                s = slice(j * hd, (j + 1) * hd)
                w = torch.softmax(k[: t + 1, s] @ q[t, s] / math.sqrt(hd), 0)
                out[t, s] = w @ v[: t + 1, s]
        x = x + out @ sd[h + "attn.c_proj.weight"] + sd[h + "attn.c_proj.bias"]
        m = gelu(ln(x, h + "ln_2") @ sd[h + "mlp.c_fc.weight"] + sd[h + "mlp.c_fc.bias"])
        x = x + m @ sd[h + "mlp.c_proj.weight"] + sd[h + "mlp.c_proj.bias"]
    return ln(x, "ln_f") @ sd["wte.weight"].t()


def test_gpt2_loads_released_layout_and_matches_naive(tmp_path):
    sd = write_released_gpt2(tmp_path / "gpt2")
    lm, tok = M.load_gpt2(str(tmp_path / "gpt2"))
    assert not any(p.requires_grad for p in lm.parameters())
    ids = tok.encode("a red circle above a blue square")
    assert tok.decode(ids) == "a red circle above a blue square" and tok.eos is not None
    got = lm(lm.wte(torch.tensor([ids])))[0]
    torch.testing.assert_close(got, naive_gpt2_logits(sd, torch.tensor(ids), 2), rtol=1e-5, atol=1e-5)
    os.remove(tmp_path / "gpt2" / "vocab.json")
    with pytest.raises(M.ConfigError, match="LM tokenizer"):
        M.load_gpt2(str(tmp_path / "gpt2"))


def test_damaged_gpt2_folder_is_one_error_naming_the_file(tmp_path):
    """--lm's weights and config.json are read through data.py: a damaged file is a DataError
    naming it (main prints it as one `error:` line), not a traceback."""
    write_released_gpt2(tmp_path / "gpt2")
    cfg = tmp_path / "gpt2" / "config.json"
    good = cfg.read_text()
    cfg.write_text("{not json")
    with pytest.raises(data.DataError, match="config.json: malformed JSON"):
        M.load_gpt2(str(tmp_path / "gpt2"))
    cfg.write_text(good)
    (tmp_path / "gpt2" / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(data.DataError, match="cannot read weights .*model.safetensors"):
        M.load_gpt2(str(tmp_path / "gpt2"))


def tiny_captioner(tmp_path):
    """(lm, tokenizer, ClipCap) over a released-layout GPT-2 fixture and a one-layer ViT, seeded."""
    write_released_gpt2(tmp_path / "gpt2")
    lm, tok = M.load_gpt2(str(tmp_path / "gpt2"))
    cfg = M.ModelConfig(embed_dim=8, image_size=16, patch_size=8, vision_width=16, vision_layers=1, vision_heads=2,
                        text_layers=0)
    torch.manual_seed(0)
    return lm, tok, M.ClipCap(M.VisionTransformer(cfg), lm, tok, cfg.embed_dim)


def test_beam_search_scores_at_least_greedy(tmp_path):
    """Beam search keeps the best length-normalised sequence it found; greedy is one of its
    candidates' prefixes, so with the same stopping rule beam >= greedy in normalised score."""
    lm, tok, cap = tiny_captioner(tmp_path)
    images = torch.randn(3, 3, 16, 16)

    def score(prefix, ids):
        logp = lm(torch.cat([prefix, lm.wte(torch.tensor(ids[:-1], dtype=torch.long))])[None])[0].log_softmax(-1)
        return sum(logp[prefix.shape[0] - 1 + t, i].item() for t, i in enumerate(ids)) / len(ids)
    greedy, beam = M.generate(cap, images, beam=1, max_len=8), M.generate(cap, images, beam=4, max_len=8)
    with torch.no_grad():
        for p, g, b in zip(cap.prefix(images), greedy, beam):
            assert score(p, b) >= score(p, g) - 1e-5


def test_finetune_caption_trains_only_the_mapper(tmp_path, capsys):
    """shapes: the stand-in GPT is trained once and labelled; the checkpoint holds only the
    mapper (the encoder and LM are frozen); every metric is reported with what was scored."""
    tok = data.build_tokenizer(captions=data.shapes_captions(200), vocab_size=300, context_length=24)
    cfg = M.ModelConfig(embed_dim=16, image_size=32, patch_size=8, vision_width=16, vision_layers=2, vision_heads=2,
                        context_length=24, vocab_size=tok.vocab_size, text_width=16, text_layers=2, text_heads=2,
                        eot_token_id=tok.eot_id)
    torch.manual_seed(0)
    sd = M.CLIP(cfg).state_dict()
    M.write_descendant(str(tmp_path / "pt"), sd, cfg, "clip", None, {})
    tok.save(str(tmp_path / "pt"))
    M.train_shapes_lm(str(tmp_path / "shapes_lm"), 0, steps=5)   # a short stand-in (reused by finetune)
    lm = tmp_path / "shapes_lm"
    assert capsys.readouterr().err.splitlines() == [
        f"stand-in LM: {lm}: training a 2-layer GPT on pairs of shapes reference captions to stand in for GPT-2 "
        f"(5 steps, a few minutes on a CPU, once: runs beside this one reuse it)"]
    M.main(["finetune", "--init", str(tmp_path / "pt"), "--task", "caption", "--max_steps", "3", "--batch_size", "8",
            "--eval_size", "6", "--log_interval", "1", "--beam", "2", "--out_dir", str(tmp_path / "cap")])
    assert (f"stand-in LM: {lm}: a 2-layer GPT trained on pairs of shapes reference captions, standing in for GPT-2 "
            f"(trained by an earlier run, reused)") in capsys.readouterr().err.splitlines()
    res = json.loads((tmp_path / "cap" / "results.json").read_text())
    assert res["lm"].startswith("stand-in") and res["lm"].endswith(str(lm)) and res["n_images"] == 6
    assert res["beam"] == 2
    assert 1 <= res["n_distinct_captions"] <= 6
    assert all(0 <= res[k] <= 100 for k in ("bleu1", "bleu4", "rouge_l")) and res["cider"] >= 0
    ck = load_file(str(tmp_path / "cap" / "finetune" / "checkpoint" / "model.safetensors"))
    assert ck and all(k.startswith("mapper.") for k in ck)
    assert json.loads((tmp_path / "shapes_lm" / "config.json").read_text())["steps"] == 5


def test_finetune_caption_baselines_on_shapes_references(tmp_path, capsys):
    """--baselines: the model, the constant caption and the nearest-neighbour caption are scored
    on the same images against five references each; report prints a row for each."""
    tok = data.build_tokenizer(captions=data.shapes_captions(200), vocab_size=300, context_length=24)
    cfg = M.ModelConfig(embed_dim=16, image_size=32, patch_size=8, vision_width=16, vision_layers=1, vision_heads=2,
                        context_length=24, vocab_size=tok.vocab_size, text_width=16, text_layers=1, text_heads=2,
                        eot_token_id=tok.eot_id)
    torch.manual_seed(0)
    M.write_descendant(str(tmp_path / "pt"), M.CLIP(cfg).state_dict(), cfg, "clip", None, {})
    tok.save(str(tmp_path / "pt"))
    M.train_shapes_lm(str(tmp_path / "shapes_lm"), 0, steps=2)
    M.main(["finetune", "--init", str(tmp_path / "pt"), "--task", "caption", "--max_steps", "1", "--batch_size", "8",
            "--eval_size", "6", "--baselines", "--baseline_pool", "40", "--out_dir", str(tmp_path / "cap")])
    res = json.loads((tmp_path / "cap" / "results.json").read_text())
    assert res["n_images"] == 6 and res["n_refs"] == 30
    base = res["baselines"]
    assert base["pool_images"] == 40 and base["constant"]["n_distinct_captions"] == 1
    pool_caps = {data.shapes_scene("train", i, 0, 32).caption for i in range(40)}
    assert base["constant"]["caption"] in pool_caps
    assert 1 <= base["nearest"]["n_distinct_captions"] <= 6
    for b in ("constant", "nearest"):
        assert all(0 <= base[b][k] <= 100 for k in ("bleu4", "rouge_l")) and base[b]["cider"] >= 0
    # grounding: captions.json says per image whether the model's caption is true; the rates agree with
    # the test grammar's parser and data.caption_is_true on the scenes, image by image
    per_image = json.loads((tmp_path / "cap" / "captions.json").read_text())
    assert len(per_image) == 6
    scene = lambda k: data.shapes_scene(k[:-8], int(k[-8:]), 0, 32)
    true = lambda c, k: (s := parse_shapes_caption(to_grammar(c))) is not None and data.caption_is_true(
        s, scene(k).objects)
    assert [r["true"] for r in per_image.values()] == [true(r["caption"], k) for k, r in per_image.items()]
    assert res["truth_rate"] == round(100 * sum(r["true"] for r in per_image.values()) / 6, 2)
    assert base["constant"]["truth_rate"] == round(100 * sum(true(base["constant"]["caption"], k)
                                                             for k in per_image) / 6, 2)
    assert base["nearest"]["truth_rate"] == round(100 * sum(true(r["nearest"], k)
                                                            for k, r in per_image.items()) / 6, 2)
    capsys.readouterr()
    M.main(["report", "--results", str(tmp_path / "cap")])
    out = capsys.readouterr().out
    assert "constant caption (baseline)" in out and "nearest caption (baseline)" in out
    assert f"cider {base['constant']['cider']:.1f}, " in out
    assert f"truth_rate {base['constant']['truth_rate']:.1f}, " in out
    assert f"repeated_object_rate {base['constant']['repeated_object_rate']:.1f} |" in out


def test_shapes_stand_in_leaves_the_global_rng_alone(tmp_path):
    """The run that trains the stand-in LM draws the mapper's init like the runs that reuse it."""
    torch.manual_seed(3)
    before = torch.get_rng_state()
    M.train_shapes_lm(str(tmp_path / "lm"), 0, steps=2)
    assert torch.equal(torch.get_rng_state(), before)
    lm, tok = M.load_gpt2(str(tmp_path / "lm"))
    assert tok.decode(tok.encode("a red circle")) == "a red circle" and len(lm.h) == 2


def test_an_lm_too_short_for_prefix_and_caption_is_one_line(tmp_path, capsys):
    write_released_gpt2(tmp_path / "gpt2", positions=32)
    with pytest.raises(SystemExit) as e:
        M.main(["finetune", "--init", "scratch", "--layers", "1", "--task", "caption", "--image_size", "32",
                "--lm", str(tmp_path / "gpt2"), "--max_steps", "1", "--out_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err == (f"error: {tmp_path / 'gpt2'}: the LM has 32 positions; captioning needs 40 "
                                         f"(the mapper's 10-token prefix and captions of up to 30)")
