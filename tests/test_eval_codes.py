"""eval_compositional.code_support: how many codes the sparsemax head gives each image and caption,
checked against the support found by a naive loop over the sorted scores (Martins & Astudillo 2016)."""
import torch

import data
import eval_compositional as E
import il_clip


def naive_support(z):
    """k(z) = max {k : 1 + k z_(k) > z_(1) + ... + z_(k)}, z sorted descending, one row at a time."""
    out = []
    for row in z.double().tolist():
        row, k, total = sorted(row, reverse=True), 0, 0.0
        for j, v in enumerate(row, 1):
            total += v
            if 1 + j * v > total:
                k = j
        out.append(k)
    return torch.tensor(out, dtype=torch.float)


def test_code_support_counts_the_sparsemax_support_of_images_and_captions():
    tok = data.build_tokenizer(captions=data.captions_for_tokenizer("shapes", 500), vocab_size=300)
    cfg = il_clip.ModelConfig(**{**il_clip.MODEL_PRESETS["tiny"], "vocab_size": tok.vocab_size, "codebook_size": 64,
                                 "context_length": tok.context_length, "eot_token_id": tok.eot_id})
    model = il_clip.CLIP(cfg, seed=1).eval()
    model.code_temperature.fill_(0.05)          # a sparse head: the support varies from sample to sample
    got = E.code_support(model, tok, n=24)
    scenes = [data.shapes_scene("val", i) for i in range(24)]
    tf = data.eval_transform(cfg.image_size)
    with torch.no_grad():
        s_img = E.image_code_scores(model, data.normalize_images(torch.stack([tf(s.image) for s in scenes])))[0]
        text = tok([s.caption for s in scenes])
        x, eot = model.forward_tokens(text)
        valid = torch.arange(text.shape[1])[None] <= eot[:, None]
        s_txt = model.code_scores(x, valid, model.text_query, max_tokens=cfg.context_length)[0]
    for name, s in (("image", s_img), ("caption", s_txt)):
        k = naive_support(s)
        assert got[name]["codes_median"] == float(k.median()) and got[name]["codes_mean"] == round(float(k.mean()), 2)
        assert 1 <= k.min() < k.max() < 64 and got[name]["codebook_size"] == 64 and got[name]["n"] == 24
    assert got["image"]["codes_used_by_any"] <= 64
