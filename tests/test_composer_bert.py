"""--bert (paper section 5.1): a released BERT in Hugging Face layout initialises the text stream of
COMPOSER's Predicate Transformer, ViLBERT and VSE. Checked against `transformers` (skips without it)
on a small randomly initialised BertModel saved with save_pretrained (safetensors), in that layout and
in bert-base-uncased's (a "bert." prefix, LayerNorm gamma / beta)."""
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import composer as C  # noqa: E402

WORDS = ("[PAD] [UNK] [CLS] [SEP] [MASK] a an the two man dog dogs horse grass street woman rides ride "
         "##s are is running run ##ning on in with red blue . , ' s").split()
CAPTIONS = ["A man rides a horse.", "Two dogs are running on the grass.", "A woman in red, with a blue dog's hat."]
BERT_BASE = {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072, "num_hidden_layers": 12,
             "max_position_embeddings": 512, "type_vocab_size": 2, "vocab_size": 30522, "hidden_act": "gelu"}


@pytest.fixture(scope="module", params=["save_pretrained", "bert-base-uncased"])
def release(request, tmp_path_factory):
    """(directory, the transformers model) of a 4-layer random BERT in the released layout."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    d = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64)
    hf = transformers.BertModel(cfg).eval()
    with torch.no_grad():  # LayerNorms away from (1, 0), so a dropped one would show
        for n, p in hf.named_parameters():
            if "LayerNorm" in n:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(str(d), safe_serialization=True)
    (d / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    if request.param == "bert-base-uncased":  # BertForPreTraining's names, as the released file has them
        sd = load_file(str(d / "model.safetensors"))
        rn = lambda k: "bert." + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta")
        save_file({rn(k): v for k, v in sd.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    return str(d), hf


def bert_cfg(arch, pt=2, ct=2, max_len=24):
    return C.ModelConfig(arch=arch, vocab_size=len(WORDS), eot_token_id=WORDS.index("[SEP]"), max_len=max_len,
                         feat_dim=6, pt_layers=pt, ct_layers=ct, bert=True, **C.bert_sizes({
                             "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 128}))


def hf_states(hf, ids, mask):
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=torch.zeros_like(ids),
                  output_hidden_states=True).hidden_states


def test_wordpiece_matches_transformers(release):
    d, _ = release
    transformers = pytest.importorskip("transformers")
    ref = transformers.BertTokenizerFast.from_pretrained(d)  # reads the release's vocab.txt
    tok = C.BertTokenizer.from_release(d, context_length=20)
    ours = tok(CAPTIONS)
    theirs = ref(CAPTIONS, padding="max_length", max_length=20, truncation=True, return_tensors="pt")["input_ids"]
    assert torch.equal(ours, theirs) and (ours == WORDS.index("[UNK]")).any()  # "in" is no piece: [UNK] path too
    assert tok.decode(ours[0]) == ref.decode(theirs[0], skip_special_tokens=True)


@pytest.mark.parametrize("arch", ["vse", "vilbert"])
def test_caption_text_stream_equals_transformers(release, arch):
    """VSE's text encoder (all 4 layers) and ViLBERT's text-only layers (2) + its next stream layer."""
    d, hf = release
    tok = C.BertTokenizer.from_release(d, context_length=24)
    model = C.init_from_bert(C.MODELS[arch](bert_cfg(arch)), d).eval()
    tb = {"tokens": tok(CAPTIONS)}
    x, mask = C.embed_caption(model, tb)
    hs = hf_states(hf, C.caption_tokens(tb, model.cfg)[0], mask)
    assert torch.allclose(x, hs[0], atol=1e-5)  # embeddings: word + position + token type 0, LayerNorm
    with torch.no_grad():
        if arch == "vse":
            for b in model.blocks:
                x = b(x, mask)
            assert torch.allclose(x, hs[4], atol=1e-5)
        else:
            te = model.encode_text(tb)
            assert torch.allclose(te["x"], hs[2], atol=1e-5)
            assert torch.allclose(model.t_self[0](hs[2], mask), hs[3], atol=1e-5)  # BERT layer 2 between co-attentions


def test_predicate_transformer_equals_transformers(release):
    """COMPOSER: the PT over template tokens and the primitive embeddings are BERT's."""
    d, hf = release
    tok = C.BertTokenizer.from_release(d, context_length=24)
    model = C.Composer(bert_cfg("composer", pt=3, ct=1)).eval()
    placeholders = model.tok_emb.weight[len(WORDS):].clone()  # one learned row per tag: not BERT's
    C.init_from_bert(model, d)
    ids = tok(CAPTIONS)[:, 1:12]  # word pieces without [CLS] (templates have none)
    lens = (ids != 0).sum(1)
    tb = {"node_tok": ids, "node_len": lens, "prim_tok": ids, "prim_len": lens}
    with torch.no_grad():
        te = model.encode_text(tb)
    hs = hf_states(hf, ids, te["tmask"])
    m = te["tmask"][..., None]
    assert torch.allclose(te["pt"] * m, hs[3] * m, atol=1e-5) and torch.allclose(te["prim"], hs[0], atol=1e-5)
    assert torch.equal(model.tok_emb.weight[len(WORDS):], placeholders)


@pytest.mark.parametrize("arch", ["composer", "vilbert", "vse"])
def test_paper_sizes_take_bert_base_shapes(arch):
    """The paper preset (width 768, 12 heads, PT 6, CT 5) maps onto bert-base-uncased's tensors
    (shapes only: meta tensors, no download)."""
    sizes = C.bert_sizes(BERT_BASE)
    preset = C.SIZE_PRESETS["paper"]
    assert (sizes["width"], sizes["heads"], sizes["mlp_ratio"]) == (preset["width"], preset["heads"], 4)
    cfg = C.ModelConfig(arch=arch, vocab_size=30522, eot_token_id=102, max_len=40, feat_dim=2048,
                        pt_layers=preset["pt_layers"], ct_layers=preset["ct_layers"], bert=True, **sizes)
    with torch.device("meta"):
        model = C.MODELS[arch](cfg)
    w, ff = 768, 3072

    def base_shape(key):  # bert-base-uncased's tensor shapes, by name
        for end, shp in (("word_embeddings.weight", (30522, w)), ("position_embeddings.weight", (512, w)),
                         ("token_type_embeddings.weight", (2, w)), ("intermediate.dense.weight", (ff, w)),
                         ("intermediate.dense.bias", (ff,))):
            if key.endswith(end):
                return shp
        if key.endswith("output.dense.weight") and "attention" not in key:
            return (w, ff)
        return (w, w) if key.endswith("weight") and "LayerNorm" not in key else (w,)

    params = dict(model.named_parameters())
    targets = C.bert_targets(model)
    assert (len(model.bert_blocks()) <= BERT_BASE["num_hidden_layers"]
            and len(targets) == 4 + 14 * len(model.bert_blocks()))
    for name, (keys, make) in targets.items():
        src = [torch.empty(base_shape(key), device="meta") for key in keys]
        t = make(*src, params[name]) if make else src[0]
        assert t.shape == params[name].shape, name


def test_train_and_eval_with_bert(release, tmp_path, capsys):
    """--bert end to end: the WordPiece tokenizer is saved and read back by eval."""
    d, _ = release
    out = str(tmp_path / "run")
    C.main(["train", "--data", "shapes", "--method", "vse", "--bert", d, "--pt_layers", "1", "--ct_layers", "1",
            "--max_steps", "2", "--batch_size", "8", "--train_size", "16", "--eval_size", "8", "--max_len", "24",
            "--dtype", "fp32", "--out_dir", out, "--log_interval", "1"])
    assert json.load(open(os.path.join(out, "tokenizer.json")))["kind"] == "bert_wordpiece"
    res = C.main(["eval", "--ckpt", out, "--eval_size", "8", "--no_phrases"])["test"]
    assert res["images"] == 8
    with pytest.raises(SystemExit) as e:  # a missing release is one error line
        C.main(["train", "--data", "shapes", "--bert", str(tmp_path / "nothing"), "--out_dir", out])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("error: ") and "--bert needs a released BERT" in err[-1]
