"""Tests of mm_learngene.py: index mapping, expansion arithmetic, distillation loss,
ablations, il_clip compatibility, DDP equality, exact resume, bad input."""
import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from conftest import error_lines
import torch
from safetensors.torch import load_file

import data
import lifecycle
import mm_learngene as M

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E_FILE = os.path.join(ROOT, "eval_compositional.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def small_cfg(layers=12, width=16, heads=2, vocab=50, ctx=8, image=16):
    return M.ModelConfig(embed_dim=width, image_size=image, patch_size=8, vision_width=width, vision_layers=layers,
                         vision_heads=heads, context_length=ctx, vocab_size=vocab, text_width=width,
                         text_layers=layers, text_heads=heads, eot_token_id=2)


def randomise(aux, seed=0):
    """Coefficients away from their (equal) init so a wrong index shows up."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in aux.parameters():
            if p.ndim == 1 and p.numel() == aux.aux_layers // 2:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif p.ndim == 1:  # LN gains/biases, biases
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return aux


def inputs(cfg, B=3):
    g = torch.Generator().manual_seed(1)
    images = torch.randn(B, 3, cfg.image_size, cfg.image_size, generator=g)
    text = torch.randint(3, cfg.vocab_size, (B, cfg.context_length), generator=g)
    text[:, 0] = 1
    text[torch.arange(B), torch.tensor([3, 5, 7])[:B]] = 2
    return images, text


# The hand-written table of the paper's Fig. 3a for L = 12 (0-indexed layers; theta1 = 0):
# 0,1 -> theta1, c0; 2,3 -> theta2, c1; 4,5 -> theta1, c2; 6,7 -> theta2, c3; 8,9 -> theta1, c4;
# 10,11 -> theta2, c5
HAND_TABLE = [(0, 0), (0, 0), (1, 1), (1, 1), (0, 2), (0, 2), (1, 3), (1, 3), (0, 4), (0, 4), (1, 5), (1, 5)]


def hand_layer(sd, tower, g, k, part="both"):
    """c * theta + c' * theta^m written out from the saved tensors."""
    uni, cu, cm = {"visual": ("vision", "v", "mv"), "text": ("language", "l", "ml")}[tower]
    th = f"learngene.theta{g + 1}"
    out = {}
    for n in M.LINEAR_NAMES:
        w = 0
        if part != "only_mm":
            w = w + sd[f"learngene.coef.{cu}"][k] * sd[f"{th}.{uni}.{n}"]
        if part != "no_mm":
            w = w + sd[f"learngene.coef.{cm}"][k] * sd[f"{th}.multimodal.{n}"]
        out[n] = w
    for n in M.LN_NAMES:
        out[n] = sd[f"shared_ln.{tower}.{n}"]
    return out


def test_index_mapping_matches_hand_table():
    assert [M.aux_index(i) for i in range(12)] == HAND_TABLE
    # the paper's example: layer 6 -> group 2 (theta2), coefficient 3
    assert M.aux_index(6) == (1, 3)
    aux = randomise(M.AuxCLIP(small_cfg()))
    sd = aux.state_dict()
    for tower in M.TOWERS:
        layers = aux.layer_list(tower)
        assert len(layers) == 12
        for i, (g, k) in enumerate(HAND_TABLE):
            want = hand_layer(sd, tower, g, k)
            for n, t in want.items():
                torch.testing.assert_close(layers[i][n], t, rtol=1e-6, atol=1e-7)


def test_expand_order():
    assert M.expand_order(6, 6) == [0, 1, 2, 3, 4, 5]
    assert M.expand_order(8, 6) == [0, 0, 1, 1, 2, 3, 4, 5]
    assert M.expand_order(12, 6) == [k for k in range(6) for _ in (0, 1)]
    assert M.expand_order(3, 6) == [0, 1, 2]
    for bad in (0, 13):
        with pytest.raises(M.ConfigError):
            M.expand_order(bad, 6)


@pytest.mark.parametrize("n", [6, 8])
def test_descendant_weights_are_weighted_sums(n):
    aux = randomise(M.AuxCLIP(small_cfg()))
    sd_aux = aux.state_dict()
    sd, cfg = M.descendant_state(aux, n, "clip")
    assert cfg.vision_layers == cfg.text_layers == n
    order = {6: [0, 1, 2, 3, 4, 5], 8: [0, 0, 1, 1, 2, 3, 4, 5]}[n]
    for tower, prefix in (("visual", "visual.transformer.resblocks."), ("text", "transformer.resblocks.")):
        for i, k in enumerate(order):
            want = hand_layer(sd_aux, tower, k % 2, k)  # 6-layer descendant layer k: (group k % 2, c[k])
            for name, t in want.items():
                torch.testing.assert_close(sd[f"{prefix}{i}.{name}"], t, rtol=1e-6, atol=1e-7)
    if n == 8:  # replicated layers are identical, the following ones are not
        w = lambda i: sd[f"visual.transformer.resblocks.{i}.attn.in_proj_weight"]
        assert torch.equal(w(0), w(1)) and torch.equal(w(2), w(3)) and not torch.equal(w(3), w(4))
    for k, v in sd_aux.items():  # non-learngene parts are copied unchanged
        if not k.startswith(M.LEARNGENE_PREFIXES):
            assert torch.equal(sd[k], v)
    assert not any(k.startswith(M.LEARNGENE_PREFIXES) for k in sd)


def test_n12_reproduces_auxiliary_forward_exactly():
    cfg = small_cfg()
    aux = randomise(M.AuxCLIP(cfg)).eval()
    sd, dcfg = M.descendant_state(aux, 12, "clip")
    desc = M.CLIP(dcfg)
    desc.load_state_dict(sd, strict=True)
    images, text = inputs(cfg)
    with torch.no_grad():
        assert torch.equal(aux.encode_image(images), desc.encode_image(images))
        assert torch.equal(aux.encode_text(text), desc.encode_text(text))


def test_distillation_loss_hand_computation():
    s = torch.tensor([[2.0, 0.5, -1.0], [0.0, 1.0, 0.3], [-0.5, 0.2, 1.5]])
    t = torch.tensor([[3.0, 0.0, 0.0], [1.0, 2.0, -1.0], [0.0, 0.5, 2.5]])

    def ce_rows(S, T):  # mean_i sum_j -softmax(T_i)_j log softmax(S_i)_j
        total = 0.0
        for i in range(3):
            zt = sum(math.exp(x) for x in T[i])
            zs = sum(math.exp(x) for x in S[i])
            total += sum(-(math.exp(T[i][j]) / zt) * (S[i][j] - math.log(zs)) for j in range(3))
        return total / 3

    S, T = s.tolist(), t.tolist()
    St, Tt = s.t().tolist(), t.t().tolist()
    want = 0.5 * (ce_rows(S, T) + ce_rows(St, Tt))
    got = M.distill_loss(s, s.t(), t, t.t()).item()
    assert abs(got - want) < 1e-6
    # L_CLIP with identity targets (Eq. 4)
    want_clip = 0.5 * sum(-(S[i][i] - math.log(sum(math.exp(x) for x in S[i]))) / 3
                          + -(St[i][i] - math.log(sum(math.exp(x) for x in St[i]))) / 3 for i in range(3))
    assert abs(M.clip_loss(s, s.t(), torch.arange(3)).item() - want_clip) < 1e-6


def test_logit_scale_capped_at_100_in_forward_and_teacher():
    """A loaded model whose stored logit_scale exceeds ln 100 (no training step has clamped it)
    scales its logits by 100, as CLIP caps them; the teacher's distillation targets too."""
    cfg = small_cfg(layers=2)
    torch.manual_seed(0)
    model = M.CLIP(cfg).eval()
    images, text = inputs(cfg)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(1000.0))
        img, txt, scale = model(images, text)
        assert scale.item() == pytest.approx(100.0, rel=1e-6)
        t_i2t, t_t2i = M.teacher_logits(model, images, text)
        torch.testing.assert_close(t_i2t, 100.0 * img @ txt.t())
        torch.testing.assert_close(t_t2i, 100.0 * txt @ img.t())
        model.logit_scale.fill_(math.log(20.0))       # below the cap: unchanged
        assert model(images, text)[2].item() == pytest.approx(20.0, rel=1e-6)


@pytest.mark.parametrize("part", ["no_mm", "only_mm"])
def test_ablations_drop_the_part(part):
    aux = randomise(M.AuxCLIP(small_cfg(layers=4), part=part))
    sd_aux = aux.state_dict()
    keys = set(sd_aux)
    if part == "no_mm":
        assert not any("multimodal" in k for k in keys) and "learngene.coef.mv" not in keys
        assert "learngene.coef.ml" not in keys and any(".vision." in k for k in keys)
    else:
        assert not any(".vision." in k or ".language." in k for k in keys)
        assert "learngene.coef.v" not in keys and "learngene.coef.l" not in keys
    sd, _ = M.descendant_state(aux, 2, "clip")
    for tower, prefix in (("visual", "visual.transformer.resblocks."), ("text", "transformer.resblocks.")):
        for k in range(2):
            for name, t in hand_layer(sd_aux, tower, k % 2, k, part).items():
                torch.testing.assert_close(sd[f"{prefix}{k}.{name}"], t)
    if part == "only_mm":  # both towers are multiples of the same theta^m
        v = sd["visual.transformer.resblocks.0.mlp.c_fc.weight"] / sd_aux["learngene.coef.mv"][0]
        l = sd["transformer.resblocks.0.mlp.c_fc.weight"] / sd_aux["learngene.coef.ml"][0]
        torch.testing.assert_close(v, l)


def test_tleg_and_helg_expansion():
    aux = randomise(M.AuxCLIP(small_cfg(layers=4), method="tleg"))
    sd_aux = aux.state_dict()
    sd, _ = M.descendant_state(aux, 5, "vision")
    assert not any(not k.startswith("visual.") for k in sd)
    for l in range(5):
        for n in M.LINEAR_NAMES + M.LN_NAMES:
            want = sd_aux[f"tleg.visual.A.{n}"] + (l / 5) * sd_aux[f"tleg.visual.B.{n}"]
            torch.testing.assert_close(sd[f"visual.transformer.resblocks.{l}.{n}"], want)
    aux = M.AuxCLIP(small_cfg(layers=4), method="helg", helg_layers=2)
    sd_aux = aux.state_dict()
    sd, _ = M.descendant_state(aux, 5, "text")
    for i in range(2):  # the last 2 of 5 are the aux's last 2 layers
        for n in M.LINEAR_NAMES:
            assert torch.equal(sd[f"transformer.resblocks.{3 + i}.{n}"], sd_aux[f"transformer.resblocks.{2 + i}.{n}"])
    assert not torch.equal(sd["transformer.resblocks.0.attn.in_proj_weight"],
                           sd_aux["transformer.resblocks.0.attn.in_proj_weight"])


def test_descendant_loads_into_il_clip(tmp_path):
    il_clip = pytest.importorskip("il_clip")
    aux = randomise(M.AuxCLIP(small_cfg(layers=4))).eval()
    sd, cfg = M.descendant_state(aux, 3, "clip")
    M.write_descendant(str(tmp_path / "d"), sd, cfg, "clip", None, {})
    model, _, _ = il_clip.load_model(str(tmp_path / "d"))  # strict: raises on a missing key
    names = {f.name for f in dataclasses.fields(il_clip.ModelConfig)}
    icfg = il_clip.ModelConfig(**{k: v for k, v in dataclasses.asdict(cfg).items() if k in names})
    missing, unexpected = il_clip.CLIP(icfg).load_state_dict(sd, strict=False)
    assert missing == [] and unexpected == []
    mine = M.CLIP(cfg)
    mine.load_state_dict(sd)
    images, text = inputs(cfg)
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image(images), mine.encode_image(images), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.encode_text(text), mine.encode_text(text), rtol=1e-5, atol=1e-5)
    vsd, vcfg = M.descendant_state(aux, 3, "vision")
    vis = il_clip.VisionTransformer(il_clip.ModelConfig(**{k: v for k, v in dataclasses.asdict(vcfg).items()
                                                           if k in names}))
    missing, unexpected = vis.load_state_dict({k.removeprefix("visual."): v for k, v in vsd.items()}, strict=False)
    assert missing == [] and unexpected == []


# --- command line: extract (1 process, torchrun 2 processes, halt + resume), bad input ------


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher")
    tok = data.build_tokenizer(captions=data.shapes_captions(200), vocab_size=300, context_length=24)
    cfg = M.ModelConfig(embed_dim=32, image_size=32, patch_size=8, vision_width=32, vision_layers=1, vision_heads=2,
                        context_length=24, vocab_size=tok.vocab_size, text_width=32, text_layers=1, text_heads=2,
                        eot_token_id=tok.eot_id)
    torch.manual_seed(0)
    M.atomic_save_file(M.CLIP(cfg).state_dict(), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"model": dataclasses.asdict(cfg)}))
    tok.save(str(out))
    return out


EXTRACT = ["extract", "--aux_width", "32", "--aux_heads", "2", "--aux_layers", "4", "--max_steps", "3",
           "--batch_size", "8", "--warmup", "1", "--log_interval", "1", "--save_interval", "0"]


def saved_step(out_dir):
    """The step of the training state in out_dir/checkpoint/ (state.pt, read as the script reads it)."""
    return torch.load(os.path.join(out_dir, "checkpoint", "state.pt"), weights_only=True)["step"]


def run_cli(args, nproc=1):
    pre = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone"] \
        if nproc > 1 else [sys.executable]
    r = subprocess.run(pre + [os.path.join(ROOT, "mm_learngene.py")] + args, env=ENV, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    assert "Warning" not in r.stderr, r.stderr       # no deprecation or DDP warning under torchrun either
    return r.stdout


@pytest.fixture(scope="module")
def extracted(teacher, tmp_path_factory):
    out = tmp_path_factory.mktemp("lg1")
    M.main(EXTRACT + ["--teacher", str(teacher), "--out_dir", str(out)])
    return out


def test_extract_ddp_equals_single_process(teacher, extracted, tmp_path):
    run_cli(EXTRACT + ["--teacher", str(teacher), "--out_dir", str(tmp_path / "ddp")], nproc=2)
    a = load_file(str(extracted / "learngene.safetensors"))
    b = load_file(str(tmp_path / "ddp" / "learngene.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    assert not torch.equal(a["learngene.coef.v"], torch.full_like(a["learngene.coef.v"], 2 ** -0.5))  # it trained


def test_extract_resume_is_exact(teacher, extracted, tmp_path, capsys):
    args = EXTRACT + ["--teacher", str(teacher), "--out_dir", str(tmp_path / "r")]
    with pytest.raises(SystemExit) as e:
        M.main(args + ["--stop_at", "1"])
    assert e.value.code == 0 and "stopped by --stop_at" in capsys.readouterr().err
    M.main(args + ["--resume"])
    assert "learngene parameters" in capsys.readouterr().err
    a = load_file(str(extracted / "learngene.safetensors"))
    b = load_file(str(tmp_path / "r" / "learngene.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    steps = [json.loads(l)["step"] for l in open(tmp_path / "r" / "metrics.jsonl")]
    assert steps == [1, 2, 3]


def test_expand_and_finetune_cli(extracted, tmp_path, capsys):
    lg = str(extracted / "learngene.safetensors")
    M.main(["expand", "--learngene", lg, "--layers", "4", "--out_dir", str(tmp_path / "d4")])
    M.main(["expand", "--learngene", lg, "--layers", "3", "--modality", "vision", "--out_dir", str(tmp_path / "v3")])
    cfg = json.loads((tmp_path / "d4" / "config.json").read_text())
    assert cfg["model"]["vision_layers"] == 4 and cfg["layer_order"] == [0, 0, 1, 1]
    common = ["--max_steps", "2", "--batch_size", "8", "--eval_size", "20", "--log_interval", "1"]
    M.main(["finetune", "--init", str(tmp_path / "d4"), "--task", "retrieval", "--activate_steps", "1",
            "--out_dir", str(tmp_path / "ft")] + common)
    res = json.loads((tmp_path / "ft" / "results.json").read_text())
    assert res["activation_steps"] == 1 and 0 <= res["i2t_r1"] <= 100 and res["n_images"] == 20
    M.main(["finetune", "--init", str(tmp_path / "v3"), "--task", "classification", "--train_size", "16",
            "--out_dir", str(tmp_path / "ftc")] + common)
    assert "top1" in json.loads((tmp_path / "ftc" / "results.json").read_text())
    M.main(["finetune", "--init", "scratch", "--like", str(tmp_path / "d4"), "--task", "retrieval",
            "--out_dir", str(tmp_path / "scr")] + common)
    res = json.loads((tmp_path / "scr" / "results.json").read_text())
    assert res["kind"] == "scratch" and "activation_steps" not in res and res["layers"] == 4
    M.main(["report", "--learngene", lg, "--layers", "2", "3", "4"])
    assert "learngene (blocks + coefficients)" in capsys.readouterr().out


def expect_error(args, capsys, fragment):
    with pytest.raises(SystemExit) as e:
        M.main(args)
    assert e.value.code == 2
    err = "\n".join(error_lines(capsys.readouterr().err))     # the earlier commands' start and done lines aside
    assert err.startswith("error: ") and "\n" not in err and fragment in err, err


def test_a_codebook_teacher_is_refused_naming_the_run_to_use(tmp_path, capsys):
    """extract needs a plain CLIP: an il_clip.py codebook / IL run is one error line saying which run to give."""
    import il_clip
    out = str(tmp_path / "cb")
    assert il_clip.main(["--method", "codebook", "--codebook", "16", "--model_args", "width=32", "layers=1", "heads=2",
                         "embed_dim=32", "image_size=32", "patch_size=8", "code_dim=32", "--batch_size", "8",
                         "--max_steps", "0", "--eval_size", "0", "--vocab_size", "300", "--out_dir", out]) == 0
    capsys.readouterr()
    expect_error(EXTRACT + ["--teacher", out, "--out_dir", str(tmp_path / "lg")], capsys,
                 f"{out}: a codebook-head teacher (il_clip.py --method codebook) is not supported, its embeddings are "
                 f"not CLIP's: use an il_clip.py --method clip (or negclip) run, or OpenAI / open_clip weights")


def test_bad_input(teacher, extracted, tmp_path, capsys):
    lg = str(extracted / "learngene.safetensors")
    expect_error(["expand", "--learngene", lg, "--layers", "0"], capsys, "--layers must be >= 1")
    expect_error(["expand", "--learngene", lg, "--layers", "5"], capsys, "fills at most 4 layers")
    expect_error(["expand", "--learngene", lg, "--layers", "2", "--width", "64"], capsys, "width 32")
    expect_error(["expand", "--learngene", str(teacher / "model.safetensors"), "--layers", "2"], capsys,
                 "not a learngene file")
    # a learngene file whose tensors come from another width than its header says
    sd = load_file(lg)
    from safetensors import safe_open
    with safe_open(lg, "pt") as f:
        meta = f.metadata()
    info = json.loads(meta["learngene"])
    info["model_config"]["vision_width"] = info["model_config"]["text_width"] = 64
    info["model_config"]["embed_dim"] = 64
    M.atomic_save_file(sd, str(tmp_path / "w.safetensors"), {**meta, "learngene": json.dumps(info)})
    expect_error(["expand", "--learngene", str(tmp_path / "w.safetensors"), "--layers", "2"], capsys, "another width")
    # a teacher whose text tower cannot be read
    tsd = load_file(str(teacher / "model.safetensors"))
    (tmp_path / "bad").mkdir()
    M.atomic_save_file({k: v for k, v in tsd.items() if k.startswith("visual.")},
                       str(tmp_path / "bad" / "model.safetensors"))
    (tmp_path / "bad" / "config.json").write_text((teacher / "config.json").read_text())
    expect_error(["extract", "--teacher", str(tmp_path / "bad"), "--max_steps", "1"], capsys, "text tower")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    expect_error(["extract", "--teacher", str(tmp_path / "junk.safetensors"), "--max_steps", "1"], capsys,
                 "cannot read weights")
    expect_error(["extract", "--teacher", str(teacher), "--aux_layers", "3", "--max_steps", "1"], capsys, "even")


class OracleStub(torch.nn.Module):
    """encode_image/encode_text = one-hot of the caption id written into the image / token 1:
    a perfect model, except that identical captions of different images are truly ambiguous.
    `collapse=True` returns one constant embedding for everything."""

    def __init__(self, collapse=False):
        super().__init__()
        self.collapse = collapse

    def _one_hot(self, ids):
        out = torch.nn.functional.one_hot(ids.long(), 8).float()
        return torch.ones_like(out) / 8 ** 0.5 if self.collapse else out

    def encode_image(self, images):
        return self._one_hot(images[:, 0, 0, 0])

    def encode_text(self, text):
        return self._one_hot(text[:, 1])


def fake_loader(items, batch_size=2):
    """A retrieval loader stand-in: items = [(key, image caption id, text caption id)]."""
    out = []
    for s in range(0, len(items), batch_size):
        chunk = items[s:s + batch_size]
        out.append({"key": [k for k, _, _ in chunk],
                    "image": torch.tensor([float(i) for _, i, _ in chunk]).view(-1, 1, 1, 1).expand(-1, 3, 4, 4),
                    "text": torch.tensor([[1, t, 2] for _, _, t in chunk])})
    return out


def test_retrieval_hits_ties_are_misses():
    # images 0 and 1 have identical captions (texts 0 and 1 tie exactly); image 2 is clean
    sim = torch.tensor([[.9, .9, .1], [.9, .9, .1], [.1, .1, .8]])
    i2t, t2i = M.retrieval_hits(sim, torch.tensor([0, 1, 2]))
    assert i2t.tolist() == [False, False, True] and t2i.tolist() == [False, False, True]
    i2t, t2i = M.retrieval_hits(torch.full((4, 4), .3), torch.arange(4))  # collapsed embeddings
    assert not i2t.any() and not t2i.any()
    # two captions of image 0 (Karpathy): the best correct one must beat every wrong one
    i2t, t2i = M.retrieval_hits(torch.tensor([[.5, .9, .7], [.7, .1, .6]]), torch.tensor([0, 0, 1]))
    assert i2t.tolist() == [True, False] and t2i.tolist() == [False, True, False]


def test_eval_retrieval_duplicate_captions_and_collapse():
    """Regression: argmax credited a duplicated caption to whichever copy came first, and a
    collapsed model scored 100/n (12.5 at n = 8) instead of 0."""
    items = [("a", 0, 0), ("b", 1, 1), ("c", 2, 2), ("d", 0, 0), ("e", 3, 3), ("f", 4, 4), ("g", 5, 5), ("h", 6, 6)]
    r = M.eval_retrieval(OracleStub(), fake_loader(items), "cpu")
    # images/texts "a" and "d" (one batch apart) share caption 0: both miss, both ways
    assert r == {"i2t_r1": 75.0, "t2i_r1": 75.0, "n_images": 8, "n_texts": 8, "eval_skipped": 0}
    r = M.eval_retrieval(OracleStub(collapse=True), fake_loader(items), "cpu")
    assert r["i2t_r1"] == 0 and r["t2i_r1"] == 0
    # several captions of one image (same key) are all correct for it
    r = M.eval_retrieval(OracleStub(), fake_loader([("a", 0, 0), ("b", 1, 1), ("b", 1, 1), ("c", 2, 2)]), "cpu")
    assert r == {"i2t_r1": 100.0, "t2i_r1": 100.0, "n_images": 3, "n_texts": 4, "eval_skipped": 0}


@pytest.mark.parametrize("task", ["retrieval", "classification"])
def test_finetune_resume_is_exact(extracted, tmp_path, capsys, task):
    """Activation and fine-tuning checkpoint into out_dir/activate and out_dir/finetune; a run
    halted in fine-tuning and resumed ends with the one-go weights and results (the finished
    activation phase is loaded, not rerun)."""
    lg = str(extracted / "learngene.safetensors")
    d = tmp_path / "d"
    M.main(["expand", "--learngene", lg, "--layers", "3", "--out_dir", str(d)])
    args = ["finetune", "--init", str(d), "--task", task, "--activate_steps", "2", "--max_steps", "4",
            "--batch_size", "8", "--eval_size", "20", "--log_interval", "1", "--train_size", "32"]
    M.main(args + ["--out_dir", str(tmp_path / "one")])
    with pytest.raises(SystemExit) as e:
        M.main(args + ["--out_dir", str(tmp_path / "two"), "--stop_at", "2"])
    assert e.value.code == 0 and "stopped by --stop_at" in capsys.readouterr().err
    assert saved_step(tmp_path / "two" / "finetune") == 2
    M.main(args + ["--out_dir", str(tmp_path / "two"), "--resume"])
    a, b = (load_file(str(tmp_path / r / "model.safetensors")) for r in ("one", "two"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = (json.loads((tmp_path / r / "results.json").read_text()) for r in ("one", "two"))
    assert ra == rb and ra["activation_steps"] == 2
    records = [json.loads(x) for x in open(tmp_path / "two" / "finetune" / "metrics.jsonl")]
    assert [m["step"] for m in records] == [1, 2, 3, 4, 4] and records[-1]["phase"] == "eval"
    for m in records[:-1]:      # metrics.jsonl's schema (reporting): step, phase, loss, lr, time
        assert {"step", "phase", "loss", "lr", "time"} <= m.keys() and m["phase"] == "finetune"
    score = M.RESULT_COLUMNS[task][0]       # the eval record holds the results' scores, in percent
    assert records[-1][score] == ra[score] and "loss" not in records[-1]


class _ListLoader:
    """The loader interface train_phase uses, over a fixed list of batches."""

    def __init__(self, batches):
        self.batches, self.done = batches, 0

    def forever(self):
        while True:
            self.done += 1
            yield self.batches[(self.done - 1) % len(self.batches)]

    def state_dict(self):       # data.LOADER_STATE's layout: batches read in (one endless) epoch 0
        return {"epoch": 0, "batches_done": self.done}

    def load_state_dict(self, s):
        self.done = s["batches_done"]


def test_trainer_nan_stops_without_saving_anything_after_it(tmp_path):
    """The non-finite check is read at log and checkpoint steps (no sync per step): a NaN at
    step 5 stops the run at the next check, and the checkpoint on disk is the last one before."""
    model = torch.nn.Linear(4, 1)
    xs = [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    xs[4] = xs[4].clone().fill_(float("nan"))           # the 5th step's batch

    def loss_fn(m, x):
        loss = m(x).pow(2).mean()
        return loss, {"sq": loss.detach()}
    args = argparse.Namespace(lr=1e-2, wd=0.0, warmup=1, grad_clip=1.0, dtype="fp32", log_interval=3,
                              save_interval=3, batch_size=8)
    with pytest.raises(M.NonFiniteError, match="non-finite loss at a step <= 6"):
        M.train_phase(model, loss_fn, _ListLoader(xs), args, 0, 1, "cpu", 8, out_dir=str(tmp_path), tag="t")
    assert saved_step(tmp_path) == 3
    saved = load_file(str(tmp_path / "checkpoint" / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in saved.values())
    logged = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in logged] == [3] and logged[0]["sq"] == pytest.approx(logged[0]["loss"])


def test_sigterm_to_one_rank_stops_every_rank_and_resumes(teacher, tmp_path):
    """torchrun, 2 processes: SIGTERM to rank 1 alone; every rank stops at the same (next log)
    step, rank 0 saves, all exit 0; --resume continues from that step."""
    from conftest import sigterm_one_rank
    out = tmp_path / "s"
    argv = EXTRACT + ["--teacher", str(teacher), "--out_dir", str(out)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                os.path.join(ROOT, "mm_learngene.py")]
    rc, stdout, stderr = sigterm_one_rank(torchrun + argv + ["--max_steps", "100000"],
                                          str(out / "metrics.jsonl"), env=ENV)
    assert rc == 0, stderr
    step = saved_step(out)
    assert 0 < step < 100000 and f"stopped by SIGTERM at step {step}/100000 | checkpoint saved" in stderr
    assert f"continue with: torchrun --nproc_per_node=2 mm_learngene.py extract --resume --out_dir {out}" in stderr
    run_cli(["extract", "--out_dir", str(out), "--resume", "--stop_at", str(step + 1)], nproc=2)
    assert saved_step(out) == step + 1


@pytest.mark.parametrize("method", ["mmlg", "tleg", "helg"])
def test_bf16_autocast_extract_matches_fp32(teacher, tmp_path, monkeypatch, method):
    """A GPU extracts under bf16 autocast (--dtype bf16, the default). The same steps under bf16
    autocast on the CPU run and log fp32's losses to bf16 precision."""
    losses = {}
    for bf16 in (False, True):
        if bf16:
            monkeypatch.setattr(M, "autocast", lambda device, dtype: torch.autocast("cpu", dtype=torch.bfloat16))
        out = tmp_path / f"bf16_{bf16}"
        M.main(EXTRACT + ["--teacher", str(teacher), "--method", method, "--out_dir", str(out)])
        losses[bf16] = [json.loads(line)["loss"] for line in open(out / "metrics.jsonl")]
    assert len(losses[True]) == 3 and all(math.isfinite(x) for x in losses[True])
    assert losses[True] != losses[False]        # bf16 autocast was on
    torch.testing.assert_close(losses[True], losses[False], rtol=0.01, atol=0.005)


# --- the evaluation contract (load_model) and readers of a checkpoint that records its script ----


def test_load_model_is_the_evaluation_contract(extracted, tmp_path):
    """eval_compositional.py imports the script a checkpoint records and calls its load_model: a
    CLIP descendant and a retrieval fine-tune load, with L2-normalised embeddings equal to the
    descendant's own; a vision-only descendant or a classification fine-tune is one ConfigError."""
    lg = str(extracted / "learngene.safetensors")
    M.main(["expand", "--learngene", lg, "--layers", "3", "--out_dir", str(tmp_path / "d")])
    M.main(["expand", "--learngene", lg, "--layers", "3", "--modality", "vision", "--out_dir", str(tmp_path / "v")])
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    module, path, note = lifecycle.import_script(config["script"], E_FILE)     # as eval_compositional.py does
    assert path == os.path.abspath(M.__file__) and note is None
    model, tok, cfg = module.load_model(str(tmp_path / "d"), device="cpu", quick_gelu=None)
    sd, dcfg = M.descendant_state(M.load_learngene(lg)[0], 3, "clip")
    ref = M.CLIP(dcfg).eval()
    ref.load_state_dict(sd)
    images, text = inputs(dcfg)
    with torch.no_grad():
        img, txt = model.encode_image(images), model.encode_text(text)
        assert torch.equal(img, ref.encode_image(images)) and torch.equal(txt, ref.encode_text(text))
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(len(img)))
    assert tok is not None and cfg["model"]["vision_layers"] == 3 and not model.training
    with pytest.raises(M.ConfigError, match="vision model; evaluation needs both towers"):
        M.load_model(str(tmp_path / "v"))
    common = ["--max_steps", "1", "--warmup", "1", "--batch_size", "8", "--eval_size", "8", "--activate_steps", "1"]
    M.main(["finetune", "--init", str(tmp_path / "d"), "--out_dir", str(tmp_path / "ft")] + common)
    model, tok, cfg = M.load_model(str(tmp_path / "ft"))
    final = load_file(str(tmp_path / "ft" / "model.safetensors"))
    assert tok is not None and all(torch.equal(v, final[k]) for k, v in model.state_dict().items())
    assert cfg["script"]["name"] == "mm_learngene.py"
    M.main(["finetune", "--init", str(tmp_path / "v"), "--task", "classification", "--train_size", "8",
            "--out_dir", str(tmp_path / "ftc")] + common)
    with pytest.raises(M.ConfigError, match="classification fine-tune model; evaluation needs both towers"):
        M.load_model(str(tmp_path / "ftc"))


def make_fork(tmp_path):
    """A fork of this script, outside the repository, that leaves a mark when imported and when its load_model
    reads a checkpoint."""
    fork = tmp_path / "fork" / "mm_fork.py"
    fork.parent.mkdir()
    fork.write_text(open(M.__file__).read() + f"\n\nopen({str(tmp_path / 'imported')!r}, 'a')\n"
                    "_load_model = load_model\n\n\n"
                    "def load_model(path, device='cpu', quick_gelu=None):\n"
                    f"    open({str(tmp_path / 'mark')!r}, 'a').write(str(path) + '\\n')\n"
                    "    return _load_model(path, device, quick_gelu)\n")
    return fork


@pytest.mark.parametrize("reader", ["extract", "finetune"])
def test_readers_build_the_model_from_the_recorded_script(extracted, teacher, tmp_path, capsys, monkeypatch, reader):
    """extract --init (alias --teacher) and finetune --init read a checkpoint with the load_model of the
    script it records, by lifecycle.find_script's trust rule: a fork outside this script's folder (its
    recorded path, or a relative path in the working directory) is one `error:` line before any import,
    and is run when named with --script (with the note when it changed since); no record: this script's
    own reader, with the same result."""
    if reader == "extract":
        src = teacher
        argv = lambda init, out: ["extract", "--init", str(init), "--aux_width", "32", "--aux_heads", "2",
                                  "--aux_layers", "4", "--max_steps", "2", "--batch_size", "8", "--warmup", "1",
                                  "--out_dir", str(out)]
        result = "learngene.safetensors"
    else:
        src = tmp_path / "d"
        M.main(["expand", "--learngene", str(extracted / "learngene.safetensors"), "--layers", "2",
                "--out_dir", str(src)])
        argv = lambda init, out: ["finetune", "--init", str(init), "--max_steps", "2", "--warmup", "1", "--batch_size",
                                  "8", "--eval_size", "8", "--activate_steps", "1", "--out_dir", str(out)]
        result = "model.safetensors"
    fork = make_fork(tmp_path)
    outs = {}
    for case in ("own", "elsewhere", "cwd", "fork", "changed"):
        ck = tmp_path / f"ck_{case}"
        shutil.copytree(src, ck)
        config = json.loads((ck / "config.json").read_text())
        record = lifecycle.script_record(str(fork))
        if case == "own":
            config.pop("script", None)
        elif case == "changed":
            record["sha256"] = "0" * 64
        elif case == "cwd":     # a downloaded folder's own file, evaluated from inside it
            shutil.copy(fork, ck / "mm_fork.py")
            record["path"] = "mm_fork.py"
        if case != "own":
            config["script"] = record
        (ck / "config.json").write_text(json.dumps(config))
        capsys.readouterr()
        named = ["--script", str(fork)] if case in ("fork", "changed") else []
        with monkeypatch.context() as m:
            m.chdir(ck)
            if case in ("elsewhere", "cwd"):
                with pytest.raises(SystemExit) as e:
                    M.main(argv(ck, tmp_path / f"out_{case}"))
                err = capsys.readouterr().err.strip().splitlines()
                assert e.value.code == 2 and len(err) == 1 and "'mm_fork.py'" in err[0], (case, err)
                assert f"beside mm_learngene.py in {ROOT}" in err[0] and "--script PATH" in err[0], err
                assert not (tmp_path / "imported").exists() and not (tmp_path / f"out_{case}" / result).exists()
                continue
            M.main(argv(ck, tmp_path / f"out_{case}") + named)
        err = capsys.readouterr().err
        assert (tmp_path / "mark").exists() == (case != "own"), case
        (tmp_path / "mark").unlink(missing_ok=True)
        assert ("has changed since it trained this checkpoint" in err) == (case == "changed"), err
        outs[case] = load_file(str(tmp_path / f"out_{case}" / result))
    for case in ("fork", "changed"):
        assert all(torch.equal(outs["own"][k], outs[case][k]) for k in outs["own"]), case


def test_report_reads_the_cost_of_a_run_from_its_training_state(extracted, capsys):
    """report --ptft: steps and seconds from checkpoint/state.pt, the batch from config.json."""
    M.main(["report", "--learngene", str(extracted / "learngene.safetensors"), "--layers", "2",
            "--ptft", str(extracted)])
    st = torch.load(extracted / "checkpoint" / "state.pt", weights_only=True)
    assert f"| PT-FT pre-training {extracted} | 3 | 8 | {round(st['elapsed'])} |" in capsys.readouterr().out
