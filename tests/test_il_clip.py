"""Unit tests of il_clip.py: sparsemax, the chunked codebook max, the IL schedule / spawn /
freeze / optimizer-state logic, resume, --init round trip, bad input (all tiny, CPU)."""
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import error_lines
import torch
from safetensors.torch import load_file, save_file

import data
import lifecycle
import il_clip as M

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a 1-layer, width-32 model on 32x32 shapes images: a training step takes a few ms
TINY = ["--model_args", "width=32", "layers=1", "heads=2", "embed_dim=32", "image_size=32", "patch_size=8",
        "code_dim=32", "--batch_size", "8", "--log_interval", "1",
        "--eval_size", "0", "--warmup", "2", "--rewarm", "1"]
IL = ["--method", "il", "--codebook", "64", "--t_warm", "3", "--t_distill", "2", "--t_interact", "2",
      "--generations", "2", "--t_extend", "1"]


def run_main(argv):
    return M.main(argv)


def weights(out_dir):
    """The latest checkpoint's weights (out_dir/checkpoint/), or a gen{g}/ snapshot's."""
    return load_file(os.path.join(lifecycle.checkpoint_dir(out_dir), "model.safetensors"))


def train_state(out_dir, folder="checkpoint"):
    return torch.load(os.path.join(out_dir, folder, "state.pt"), weights_only=True)


def same(a, b):
    """Nested training states equal: tensors bit for bit, everything else by ==."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# ----------------------------------------------------------------------------- sparsemax

def brute_force_simplex_projection(z):
    """argmin_p ||p - z|| over the simplex by enumerating every support set."""
    n, best, best_d = z.shape[0], None, float("inf")
    for k in range(1, n + 1):
        for S in itertools.combinations(range(n), k):
            S = list(S)
            p = torch.zeros_like(z)
            p[S] = z[S] - (z[S].sum() - 1) / k
            if (p >= 0).all():
                d = (p - z).norm().item()
                if d < best_d:
                    best, best_d = p, d
    return best


def test_sparsemax_matches_entmax_at_width_16384():
    entmax = pytest.importorskip("entmax")
    g = torch.Generator().manual_seed(0)
    for dtype, scale in ((torch.float64, 1.0), (torch.float32, 1.0), (torch.float32, 30.0)):
        x = (torch.randn(16, 16384, generator=g) * scale).to(dtype)
        ref = entmax.sparsemax(x, dim=-1)
        out = M.sparsemax(x, dim=-1)
        # 1e-6 at unit scale; float32 rounding of the threshold grows with the input's scale
        assert (out - ref).abs().max().item() < 1e-6 * scale, (dtype, scale)
        assert torch.allclose(out.sum(-1), torch.ones(16, dtype=dtype), atol=1e-5)
    x = torch.randn(5, 7, 9, generator=g, dtype=torch.float64)   # another dim
    assert (M.sparsemax(x, dim=1) - entmax.sparsemax(x, dim=1)).abs().max().item() < 1e-12


def test_sparsemax_is_the_simplex_projection():
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        z = torch.randn(7, generator=g, dtype=torch.float64) * 2
        assert torch.allclose(M.sparsemax(z[None])[0], brute_force_simplex_projection(z), atol=1e-12)


def test_sparsemax_gradcheck():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 12, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: M.sparsemax(t, dim=-1), (x,))
    assert torch.autograd.gradcheck(lambda t: M.sparsemax(t, dim=0), (x,))


def test_sparsemax_of_a_diverged_row_is_nan_not_an_index_error():
    """A NaN score row (a diverged codebook run) must reach the non-finite-loss stop, not end in
    an out-of-bounds gather inside the sort path."""
    x = torch.randn(3, 10)
    x[1] = float("nan")
    out = M.sparsemax(x)
    assert out[1].isnan().all() and torch.allclose(out[[0, 2]].sum(-1), torch.ones(2))


# ----------------------------------------------------------------------------- codebook head

@pytest.mark.parametrize("budget", [1, 7 * 13 * 2, 1 << 25])
def test_chunked_max_scores_match_naive(budget):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 7, 16, generator=g, dtype=torch.float64, requires_grad=True)
    C = torch.randn(13, 16, generator=g, dtype=torch.float64, requires_grad=True)
    valid = torch.ones(5, 7, dtype=torch.bool)
    valid[0, 3:] = False
    valid[2, 1:] = False
    # naive: the full B x P x K tensor, pads at -inf
    naive = (q @ C.t()).masked_fill(~valid[..., None], float("-inf")).max(1).values
    out = M.max_code_scores(q, C, valid, budget=budget)
    assert torch.allclose(out, naive, rtol=0, atol=1e-12)
    up = torch.randn(5, 13, generator=g, dtype=torch.float64)
    ga = torch.autograd.grad(out, (q, C), up)
    gb = torch.autograd.grad(naive, (q, C), up)
    for a, b in zip(ga, gb):
        assert torch.allclose(a, b, atol=1e-12)
    # pads really are excluded: a code anti-aligned with every real token keeps its negative max
    assert torch.allclose(out[2], q[2, 0] @ C.t(), rtol=0, atol=1e-12) and (out[2] < 0).any()


def test_codebook_embedding_end_to_end_grad():
    cfg = M.ModelConfig(
        embed_dim=16, image_size=16, patch_size=8, vision_width=16, vision_layers=1, vision_heads=2,
        context_length=8, vocab_size=20, text_width=16, text_layers=1, text_heads=2, eot_token_id=19,
        codebook_size=32, code_dim=16)
    m = M.CLIP(cfg, seed=0)
    text = torch.tensor([[1, 5, 19, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 19]])
    e = m.encode_text(text)
    assert torch.allclose(e.norm(dim=-1), torch.ones(2))
    e.sum().backward()
    assert m.codebook.grad is not None and m.text_query.fc_2.weight.grad is not None


# ----------------------------------------------------------------------------- model layout / --init

OPENAI_KEYS = ["visual.conv1.weight", "visual.class_embedding", "visual.positional_embedding",
               "visual.ln_pre.weight", "visual.transformer.resblocks.0.attn.in_proj_weight",
               "visual.transformer.resblocks.0.attn.in_proj_bias",
               "visual.transformer.resblocks.0.attn.out_proj.weight", "visual.transformer.resblocks.0.ln_1.weight",
               "visual.transformer.resblocks.0.mlp.c_fc.weight", "visual.transformer.resblocks.0.mlp.c_proj.bias",
               "visual.transformer.resblocks.0.ln_2.bias", "visual.ln_post.weight", "visual.proj",
               "token_embedding.weight", "positional_embedding", "transformer.resblocks.0.attn.in_proj_weight",
               "transformer.resblocks.0.mlp.c_fc.weight", "ln_final.weight", "text_projection", "logit_scale"]


def test_openai_key_layout_and_shapes():
    cfg = M.ModelConfig(**M.MODEL_PRESETS["ViT-B-32"])
    sd = {k: v.shape for k, v in _meta_state_dict(cfg).items()}
    assert set(OPENAI_KEYS) <= set(sd)
    assert sd["visual.positional_embedding"] == (50, 768) and sd["visual.proj"] == (768, 512)
    assert sd["transformer.resblocks.11.attn.in_proj_weight"] == (1536, 512)
    assert sd["positional_embedding"] == (77, 512) and sd["token_embedding.weight"] == (49408, 512)
    assert not any(k.startswith(("codebook", "image_query", "text_query")) for k in sd)
    meta = {k: torch.empty(v, device="meta") for k, v in sd.items()}
    inferred = M.ModelConfig(**lifecycle.clip_hparams(meta, "ViT-B-32"))   # a bare file: OpenAI's conventions
    assert (inferred.vision_layers, inferred.text_layers, inferred.image_size, inferred.patch_size) == (12, 12, 224, 32)
    assert (inferred.vision_heads, inferred.text_heads, inferred.eot_token_id, inferred.quick_gelu) == (12, 8, 49407, True)
    with pytest.raises(lifecycle.DataError, match="cannot read the text tower .missing ln_final.weight"):
        lifecycle.clip_hparams({k: v for k, v in meta.items() if k != "ln_final.weight"}, "x.safetensors")


def _meta_state_dict(cfg):
    class Meta(M.CLIP):
        def init_weights(self, seed):
            """No init: meta tensors have shapes only."""
    with torch.device("meta"):
        return Meta(cfg).state_dict()


def test_init_round_trip_and_load_model(tmp_path):
    a = str(tmp_path / "a")
    assert run_main(TINY + ["--method", "clip", "--max_steps", "0", "--seed", "5", "--out_dir", a]) == 0
    sd = weights(a)
    sd = {k: v + 0.01 * torch.randn_like(v) for k, v in sd.items()}      # something no init produces
    pt, st = str(tmp_path / "w.pt"), str(tmp_path / "w.safetensors")
    torch.save({"state_dict": {"module." + k: v for k, v in sd.items()}}, pt)
    save_file(sd, st)
    for f in (pt, st):
        b = str(tmp_path / ("b" + os.path.basename(f)))
        assert run_main(TINY + ["--method", "clip", "--max_steps", "0", "--init", f, "--out_dir", b]) == 0
        got = weights(b)
        assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    # a codebook model takes CLIP weights and initialises only its codebook head
    c = str(tmp_path / "c")
    assert run_main(TINY + ["--method", "codebook", "--codebook", "16", "--max_steps", "0", "--init", st,
                            "--out_dir", c]) == 0
    assert torch.equal(weights(c)["visual.conv1.weight"], sd["visual.conv1.weight"])
    model, tok, config = M.load_model(a)
    assert tok is not None and config["model"]["vision_width"] == 32
    model2, _, config2 = M.load_model(st)      # OpenAI-format file: the config comes from the shapes
    assert config2["model"]["vision_layers"] == 1 and config2["model"]["image_size"] == 32
    x = torch.randn(2, 3, 32, 32)
    assert model.encode_image(x).shape == (2, 32)


def _one_error_line(capsys):
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_bad_input_lines(tmp_path, capsys):
    out = str(tmp_path / "o")
    assert run_main(TINY + ["--init", str(tmp_path / "nope.pt"), "--out_dir", out]) == 2
    assert "--init file not found" in _one_error_line(capsys)
    w = str(tmp_path / "w")
    assert run_main(TINY + ["--method", "clip", "--max_steps", "0", "--out_dir", w]) == 0
    capsys.readouterr()
    assert run_main(TINY + ["--method", "clip", "--model_args", "width=48",
                            "--init", os.path.join(w, "checkpoint", "model.safetensors"), "--out_dir", out]) == 2
    line = _one_error_line(capsys)
    assert "config/weights mismatch" in line and "shape mismatch" in line
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    assert run_main(TINY + ["--init", str(tmp_path / "junk.pt"), "--out_dir", out]) == 2
    assert "cannot read weights" in _one_error_line(capsys)
    os.environ["DATA_ROOT"] = str(tmp_path / "no_data_here")
    try:
        assert run_main(["--data", "cc3m", "--out_dir", out, "--eval_size", "0"]) == 2
    finally:
        del os.environ["DATA_ROOT"]
    assert "cc3m" in _one_error_line(capsys)
    assert run_main(TINY + ["--method", "clip", "--codebook", "8", "--out_dir", out]) == 2
    _one_error_line(capsys)


def test_model_args_override_the_preset(tmp_path, capsys):
    args = M.build_args(["--model_args", "width=48", "layers=2", "--model_args", "layers=3", "text_heads=4",
                         "mlp_ratio=2", "context_length=24"])
    assert args.model_overrides == {"vision_width": 48, "text_width": 48, "vision_layers": 3, "text_layers": 3,
                                    "text_heads": 4, "mlp_ratio": 2.0}          # repeated flags extend, last wins
    assert args.context_length == 24                                       # the tokenizer's length
    out = str(tmp_path / "m")
    assert run_main(TINY + ["--method", "clip", "--max_steps", "0", "--model_args", "context_length=24",
                            "text_layers=2", "--out_dir", out]) == 0
    model = M.load_model(out)[0]
    assert model.positional_embedding.shape[0] == 24 and len(model.transformer.resblocks) == 2
    assert len(model.visual.transformer.resblocks) == 1 and model.cfg.vision_width == 32
    capsys.readouterr()
    for bad, says in ((["depth=2"], "'depth=2': expected KEY=VALUE"), (["width=wide"], "'wide' is not a valid int"),
                      (["vocab_size=10"], "expected KEY=VALUE"), (["width"], "expected KEY=VALUE")):
        assert run_main(TINY + ["--model_args", *bad, "--out_dir", out]) == 2
        assert says in _one_error_line(capsys)


def test_csv_with_renamed_columns_trains_and_builds_its_tokenizer_from_them(tmp_path):
    """open_clip's CSV layout with other column names: the tokenizer's captions are read with the
    same --csv_* flags as the training data."""
    (tmp_path / "imgs").mkdir()
    rows = []
    for i in range(16):
        scene = data.shapes_scene("train", i)
        scene.image.save(tmp_path / "imgs" / f"{i}.png")
        rows.append(f"imgs/{i}.png;{scene.caption}")
    (tmp_path / "d.csv").write_text("img;cap\n" + "\n".join(rows) + "\n")
    out = str(tmp_path / "o")
    assert run_main(TINY + ["--data", str(tmp_path / "d.csv"), "--image_root", str(tmp_path), "--csv_img_key", "img",
                            "--csv_caption_key", "cap", "--csv_separator", ";", "--method", "clip",
                            "--max_steps", "2", "--out_dir", out]) == 0
    tok = data.Tokenizer.load(out)
    assert tok.decode(tok(scene.caption)[0]) == scene.caption


# ----------------------------------------------------------------------------- IL schedule

def test_il_schedule_phases_and_lr():
    s = M.ILSchedule(t_warm=5, t_distill=2, t_interact=3, generations=3, t_extend=4)
    assert s.total == 5 + 3 * 5 + 4 and s.spawn_steps == [5, 10, 15]
    expect = (["warmup"] * 5 + (["distill"] * 2 + ["interact"] * 3) * 3 + ["interact"] * 4)
    gens = [0] * 5 + [1] * 5 + [2] * 5 + [3] * 5 + [3] * 4
    for step in range(s.total):
        phase, gen, start = s.at(step)
        assert (phase, gen) == (expect[step], gens[step]), step
        assert start == (0 if gen == 0 else 5 + 5 * (gen - 1))
    assert M.ILSchedule(5, 2, 3, 3, 4, enabled=False).at(7) == ("train", 0, 0)
    # global cosine x linear re-warm-up at each generation start
    args = type("A", (), dict(lr=1.0, min_lr=0.0, warmup=2, rewarm=2, max_steps=s.total, lr_schedule="global"))()
    lrs = [M.get_lr(t, args, s) for t in range(s.total)]
    assert lrs[0] == 0.5 and lrs[1] == 1.0
    for start in s.spawn_steps:
        assert lrs[start] == pytest.approx(0.5 * M.get_lr(start, args, M.ILSchedule(5, 2, 3, 3, 4, enabled=False)))
        assert lrs[start + 1] == pytest.approx(M.get_lr(start + 1, args, M.ILSchedule(5, 2, 3, 3, 4, enabled=False)))
    assert M.spawn_seed(0, 1) != M.spawn_seed(0, 2) and M.spawn_seed(3, 1) == M.spawn_seed(3, 1)


def _lr_args(**kw):
    return type("A", (), dict(dict(lr=2.0, warmup=2, rewarm=2, lr_schedule="generation"), **kw))()


def _naive_lr(t, cycles, args):
    """By hand: find t's cycle in an explicit list, then linear warm-up and cosine to 0 at its end."""
    for a, b in cycles:
        if a <= t < b:
            w, s = (args.warmup if a == 0 else args.rewarm), t - a
            return args.lr * (s + 1) / w if s < w else args.lr * 0.5 * (1 + math.cos(math.pi * (s - w) / (b - a - w)))
    raise AssertionError(t)


def test_lr_schedule_global_is_the_one_cosine_with_rewarm_it_was():
    s = M.ILSchedule(t_warm=5, t_distill=2, t_interact=3, generations=3, t_extend=4)
    args = _lr_args(lr_schedule="global", max_steps=s.total)
    for t in range(s.total):       # the formula of commit b0cd085, written out
        lr = 2.0 * (t + 1) / 2 if t < 2 else 0.5 * 2.0 * (1 + math.cos(math.pi * min(1.0, (t - 2) / (s.total - 2))))
        gen_start = max([0] + [g for g in s.spawn_steps if g <= t])
        lr *= min(1.0, (t - gen_start + 1) / 2) if gen_start else 1.0
        assert M.get_lr(t, args, s) == lr, t


@pytest.mark.parametrize("max_steps", [24, 30, 17])
def test_lr_schedule_generation_restarts_a_full_cycle_per_generation(max_steps):
    s = M.ILSchedule(t_warm=5, t_distill=2, t_interact=3, generations=3, t_extend=4)   # total 24
    args = _lr_args(max_steps=max_steps)
    # warm-up, three generations, the extension (to the run's end), cut at max_steps
    cycles = [(a, min(b, max_steps)) for a, b in [(0, 5), (5, 10), (10, 15), (15, 20), (20, max(24, max_steps))]
              if a < max_steps]
    lrs = [M.get_lr(t, args, s) for t in range(max_steps)]
    assert lrs == pytest.approx([_naive_lr(t, cycles, args) for t in range(max_steps)], rel=1e-12, abs=1e-12)
    for a, b in cycles:
        assert lrs[a] == 1.0 and lrs[a + 1] == 2.0            # first step of the cycle; the peak after warm-up
        # last step: cosine at (L-1-w)/(L-w): 1/4 of the peak for the 5-step cycles
        if b - a == 5:
            assert lrs[b - 1] == pytest.approx(0.5)
    assert max_steps != 24 or lrs[-1] == pytest.approx(1.0)          # the 4-step extension ends at cos(pi/2)
    # il_cycles, the no-spawn control: IL's cycles for a run that never spawns
    control = M.ILSchedule(5, 2, 3, 3, 4, enabled=False, cycles=True)
    assert [M.get_lr(t, args, control) for t in range(max_steps)] == lrs and control.spawn_steps == []
    # without IL there is one cycle: the same as the global cosine
    off = M.ILSchedule(5, 2, 3, 3, 4, enabled=False)
    assert [M.get_lr(t, args, off) for t in range(max_steps)] == \
        [M.get_lr(t, _lr_args(lr_schedule="global", max_steps=max_steps), off) for t in range(max_steps)]


@pytest.mark.parametrize("method, schedule", [("il", "generation"), ("codebook", "il_cycles")])
def test_lr_schedule_generation_is_what_each_phase_trains_with(tmp_path, method, schedule):
    """IL under `generation`; the no-spawn control (Codebook-CLIP under `il_cycles`) gets the same LRs."""
    out = str(tmp_path / "g")
    assert run_main(TINY + IL + ["--method", method, "--lr_schedule", schedule, "--out_dir", out]) == 0
    recs = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    args = _lr_args(lr=1e-3, warmup=2, rewarm=1)      # TINY + IL: 3 warm-up, 2 x (2 + 2), extension 1
    cycles = [(0, 3), (3, 7), (7, 11), (11, 12)]
    assert [r["step"] for r in recs] == list(range(1, 13))
    assert [r["lr"] for r in recs] == pytest.approx([_naive_lr(r["step"] - 1, cycles, args) for r in recs],
                                                     rel=1e-12)
    assert [r["lr"] for r in recs if r["step"] - 1 in (3, 7, 11)] == [1e-3] * 3 and recs[1]["lr"] == 1e-3


def _trainer(tmp_path, extra=()):
    args = M.build_args(TINY + IL + ["--out_dir", str(tmp_path / "t"), "--wd", "0.5"] + list(extra))
    M.setup_distributed(args)
    return M.setup(args, 0, 1)


def _trainable(r, phase, gen):
    M.set_trainable(r.model, r.args, phase, M.spawn_agent(r.args, gen) if phase == "distill" else None)
    return {n: p.requires_grad for n, p in r.model.named_parameters()}


def test_spawn_reinitialises_language_agent_and_distill_freezes(tmp_path):
    tr = _trainer(tmp_path)
    tr.args.stop_at = 3                                  # end of warm-up
    assert M.train(tr) == "done"
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    lang = {n for n, _ in M.agent_params(tr.model, "language")}
    vis = {n for n, _ in M.agent_params(tr.model, "vision")}
    assert lang and vis and not (lang & vis)
    assert {"token_embedding.weight", "positional_embedding", "text_projection", "ln_final.weight",
            "transformer.resblocks.0.attn.in_proj_weight", "text_query.fc_1.weight"} <= lang
    # the whole parameter set is covered: agents + the shared codebook + logit_scale
    assert lang | vis | {"codebook", "logit_scale"} == {n for n, _ in tr.model.named_parameters()}
    params = dict(tr.model.named_parameters())
    # every language tensor in use has AdamW state (text_projection is unused with a codebook head)
    assert all(len(tr.opt.state[params[n]]) > 0 for n in lang - {"text_projection"})
    tr.args.stop_at = 4                                  # the spawn step + one distill step
    assert M.train(tr) == "done"
    after_distill_1 = {k: v.clone() for k, v in tr.model.state_dict().items()}
    # expected re-initialisation: a fresh model's init_agent with the generation's seed
    fresh = M.CLIP(tr.cfg, seed=123)
    fresh.init_agent("language", torch.Generator().manual_seed(M.spawn_seed(tr.args.seed, 1)))
    tr2 = _trainer(tmp_path / "2")
    tr2.args.stop_at = 3
    M.train(tr2)
    tr2.teacher = M.spawn(tr2.model, tr2.opt, tr2.args, 1)
    for n, p in tr2.model.named_parameters():
        if n in lang:
            assert torch.equal(p, dict(fresh.named_parameters())[n]), n
            assert not torch.equal(p, before[n]), n
            assert len(tr2.opt.state.get(p, {})) == 0, n            # AdamW state cleared
        else:
            assert torch.equal(p, before[n]), n                       # vision + codebook untouched
            assert len(tr2.opt.state[p]) > 0 or n in ("visual.proj", "visual.ln_post.weight",
                                                      "visual.ln_post.bias"), n
    assert tr2.teacher is not None
    # during distill: codebook and vision bitwise unchanged (despite weight decay 0.5), language trains
    tr.args.stop_at = 5                                  # end of generation 1's distill
    M.train(tr)
    for n, v in tr.model.state_dict().items():
        if n in vis or n in ("codebook", "logit_scale"):
            assert torch.equal(v, before[n]), n
    assert not torch.equal(tr.model.state_dict()["text_query.fc_2.weight"], after_distill_1["text_query.fc_2.weight"])
    tr.args.stop_at = 6                                  # first interact step: everything trains again
    M.train(tr)
    assert not torch.equal(tr.model.codebook, before["codebook"])
    assert not torch.equal(tr.model.visual.conv1.weight, before["visual.conv1.weight"])


def test_ablation_flags_freeze_and_spawn_targets(tmp_path):
    tr = _trainer(tmp_path, ["--no_freeze_codebook", "--distill_train_vision", "--spawn", "alternate"])
    w = _trainable(tr, "distill", 1)
    assert w["codebook"] and w["visual.conv1.weight"] and not w["logit_scale"]
    assert M.spawn_agent(tr.args, 1) == "language" and M.spawn_agent(tr.args, 2) == "vision"
    tr = _trainer(tmp_path / "v", ["--spawn", "vision", "--code_sim", "cos", "--code_temp", "0.1"])
    w = _trainable(tr, "distill", 1)
    assert w["visual.conv1.weight"] and not w["token_embedding.weight"] and not w["codebook"]
    tr.args.stop_at = 4
    assert M.train(tr) == "done"           # spawn vision + distill runs
    tr = _trainer(tmp_path / "s", ["--spectral_norm", "--codebook", "0", "--distill_loss", "cos"])
    assert any("parametrizations" in n for n, _ in tr.model.named_parameters())
    tr.args.stop_at = 5
    assert M.train(tr) == "done"


# ----------------------------------------------------------------------------- resume / signals / NaN

@pytest.mark.parametrize("extra,stop", [(IL + ["--negatives"], 4), (["--method", "negclip"], 3),
                                        (["--method", "clip", "--log_interval", "3"], 4),
                                        (IL + ["--lr_schedule", "generation"], 4)])
def test_resume_n_plus_m_equals_one_go(tmp_path, extra, stop):
    """--stop_at N then `--resume --out_dir` alone (the saved flags) equals one run: weights, the
    whole training state (optimizer, RNGs, data position, IL teacher, NegCLIP pool, log sums), and
    the log (cut back to the checkpoint, no step twice; a log interval cut by the stop averages the
    same losses)."""
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    common = TINY + extra + ["--max_steps", "7", "--save_interval", "100"]
    assert run_main(common + ["--out_dir", one]) == 0
    assert run_main(common + ["--out_dir", two, "--stop_at", str(stop)]) == 0
    assert train_state(two)["step"] == stop
    assert (train_state(two)["teacher"] is not None) == ("il" in extra)  # stopped in distill: the teacher saved
    with open(os.path.join(two, "metrics.jsonl"), "a") as f:   # logged after the checkpoint, then killed
        f.write(json.dumps({"step": stop + 1, "loss": 99.0}) + "\n")
    assert run_main(["--resume", "--out_dir", two]) == 0
    a, b = weights(one), weights(two)
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = train_state(one), train_state(two)
    assert same(sa, sb) and not same(sa, train_state(two, "checkpoint.prev"))
    assert (sa["pool"] is not None) == bool({"--negatives", "negclip"} & set(extra))   # NegCLIP's image pool saved
    ra, rb = ([json.loads(x) for x in open(os.path.join(d, "metrics.jsonl"))] for d in (one, two))
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    assert [(r["loss"], r["clip"], r["lr"]) for r in ra] == [(r["loss"], r["clip"], r["lr"]) for r in rb]
    if "il" in extra:  # generation snapshots (for eval's per-generation analyses) survive the resume
        for d in (one, two):
            assert sorted(x for x in os.listdir(d) if x.startswith("gen")) == ["gen0", "gen1"]
        g0a, g1a, g0b = (weights(os.path.join(d, g)) for d, g in ((one, "gen0"), (one, "gen1"), (two, "gen0")))
        assert all(torch.equal(g1a[k], a[k]) for k in a)                   # last generation = final weights
        assert all(torch.equal(g0a[k], g0b[k]) for k in a)
        assert not torch.equal(g0a["token_embedding.weight"], a["token_embedding.weight"])


def test_saves_at_multiples_of_save_interval_whatever_the_log_interval(tmp_path, monkeypatch):
    saved, real = [], M.save_checkpoint
    monkeypatch.setattr(M, "save_checkpoint", lambda r: (saved.append(r.step), real(r)))
    out = str(tmp_path / "s")
    assert run_main(TINY + ["--method", "clip", "--max_steps", "7", "--log_interval", "3",
                            "--save_interval", "2", "--out_dir", out]) == 0
    assert saved == [2, 4, 6, 7]
    assert [json.loads(x)["step"] for x in open(os.path.join(out, "metrics.jsonl"))] == [3, 6, 7]
    assert sorted(os.listdir(out)) == [".lock", "checkpoint", "checkpoint.prev", "config.json", "loss_curve.png",
                                       "metrics.jsonl", "tokenizer.json"]       # no checkpoint.tmp left behind
    assert sorted(os.listdir(os.path.join(out, "checkpoint"))) == sorted(lifecycle.CHECKPOINT_FILES + ("sha256.json",))
    assert train_state(out)["step"] == 7 and train_state(out, "checkpoint.prev")["step"] == 6
    sums = json.load(open(os.path.join(out, "checkpoint", "sha256.json")))
    assert (set(sums) == set(lifecycle.CHECKPOINT_FILES)
            and sums["state.pt"] == lifecycle.sha256(os.path.join(out, "checkpoint", "state.pt")))


def _damage(ck, how):
    if how == "missing":
        os.remove(os.path.join(ck, "state.pt"))
    elif how == "bit-flip":                      # one bit of model.safetensors' weights
        with open(os.path.join(ck, "model.safetensors"), "r+b") as f:
            f.seek(-100, os.SEEK_END)
            byte = f.read(1)[0]
            f.seek(-100, os.SEEK_END)
            f.write(bytes([byte ^ 0x10]))
    elif how == "truncated":
        with open(os.path.join(ck, "state.pt"), "r+b") as f:
            f.truncate(os.path.getsize(f.name) // 2)
    else:                                        # "types": a state.pt of the wrong shape, its sha256 updated
        torch.save({"step": "2", "optimizer": []}, os.path.join(ck, "state.pt"))
        sums = json.load(open(os.path.join(ck, "sha256.json")))
        json.dump(sums | {"state.pt": lifecycle.sha256(os.path.join(ck, "state.pt"))},
                  open(os.path.join(ck, "sha256.json"), "w"))


@pytest.mark.parametrize("how,says", [("bit-flip", "model.safetensors: damaged"), ("missing", "state.pt: missing"),
                                      ("truncated", "state.pt: damaged"), ("types", "state.pt: wrong types")])
def test_damaged_newest_checkpoint_falls_back_to_prev_or_is_one_error_line(tmp_path, capsys, how, says):
    """A damaged newest checkpoint: with no usable checkpoint.prev/ one error line naming the file;
    with it, a note, and the resumed run ends exactly as an uninterrupted one."""
    import shutil
    out, ref = str(tmp_path / "d"), str(tmp_path / "ref")
    argv = TINY + ["--method", "clip", "--max_steps", "4", "--save_interval", "1"]
    assert run_main(argv + ["--out_dir", ref]) == 0
    assert run_main(argv + ["--out_dir", out, "--stop_at", "3"]) == 0
    ck, prev = os.path.join(out, "checkpoint"), os.path.join(out, "checkpoint.prev")
    _damage(ck, how)
    os.rename(prev, str(tmp_path / "prev"))
    capsys.readouterr()
    assert run_main(["--resume", "--out_dir", out]) == 2
    line = _one_error_line(capsys)
    assert os.path.join(ck, says) in line, line
    os.rename(str(tmp_path / "prev"), prev)
    assert run_main(["--resume", "--out_dir", out]) == 0
    err = capsys.readouterr().err
    assert (f"note: {os.path.join(ck, says)}" in err and "resuming from the previous checkpoint" in err
            and "step 2" in err)
    a, b = weights(ref), weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a) and same(train_state(ref), train_state(out))
    assert train_state(out, "checkpoint.prev")["step"] == 3            # the damaged one was not kept as prev


def _signal_when_training(cmd, out, sig=signal.SIGTERM):
    """Start `cmd` in its own session, wait for the first log line, send `sig` to the whole process
    group (as torchrun's agent, SLURM and Ctrl-C do: the loader workers get it too)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env_1thread(),
                         start_new_session=True)
    metrics, t0 = os.path.join(out, "metrics.jsonl"), time.time()
    while not (os.path.isfile(metrics) and os.path.getsize(metrics) > 0) and time.time() - t0 < 120:
        time.sleep(0.2)
    os.killpg(p.pid, sig)
    out, err = p.communicate(timeout=120)
    return p.returncode, out.decode() + err.decode()     # the start, stop and error lines are on stderr


def env_1thread():
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def test_sigterm_with_loader_workers_saves_and_resumes(tmp_path):
    out = str(tmp_path / "s")
    argv = TINY + ["--method", "clip", "--num_workers", "2", "--out_dir", out]
    rc, err = _signal_when_training([sys.executable, os.path.join(ROOT, "il_clip.py")] + argv +
                                    ["--max_steps", "100000"], out)
    step = train_state(out)["step"]
    assert rc == 0 and f"stopped by SIGTERM at step {step}/100000 | checkpoint saved" in err, err[-1500:]
    assert "Traceback" not in err, err[-1500:]
    assert run_main(["--resume", "--out_dir", out, "--stop_at", str(step + 1)]) == 0
    assert train_state(out)["step"] == step + 1


def test_ctrl_c_saves_a_checkpoint_that_resumes_bit_exactly(tmp_path):
    out, ref = str(tmp_path / "i"), str(tmp_path / "ref")
    argv = TINY + ["--method", "codebook", "--codebook", "16", "--max_steps", "100000", "--save_interval", "100000",
                   "--num_workers", "1"]
    rc, err = _signal_when_training([sys.executable, os.path.join(ROOT, "il_clip.py")] + argv + ["--out_dir", out],
                                    out, signal.SIGINT)
    step = train_state(out)["step"]
    assert rc == 0 and "Traceback" not in err, err[-1500:]
    assert f"stopped by SIGINT at step {step}/100000 | checkpoint saved | continue with: python il_clip.py --resume " \
        f"--out_dir {out}" in err, err
    assert run_main(["--resume", "--out_dir", out, "--stop_at", str(step + 2)]) == 0
    assert run_main(argv + ["--out_dir", ref, "--stop_at", str(step + 2)]) == 0
    a, b = weights(ref), weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a) and same(train_state(ref), train_state(out))


def test_a_second_ctrl_c_exits_at_once(monkeypatch, capsys):
    exits = []
    monkeypatch.setattr(data.os, "_exit", exits.append)
    old = lifecycle.catch_stop_signals()                    # what il_clip.main installs
    try:
        lifecycle._on_stop_signal(signal.SIGTERM, None)
        lifecycle._on_stop_signal(signal.SIGTERM, None)
        assert lifecycle.stop_requested() == "SIGTERM" and exits == []   # the first asks for a save at the next sync point
        lifecycle._on_stop_signal(signal.SIGINT, None)
    finally:
        lifecycle.restore_signals(old)
    assert exits == [130] and "exiting without saving" in _one_error_line(capsys)


def _files(out):
    """Every file under out (but the lock, rewritten by every run) -> (mtime, bytes)."""
    return {p: (os.stat(p).st_mtime_ns, open(p, "rb").read()) for d, _, fs in os.walk(out)
            for p in (os.path.join(d, f) for f in fs) if not p.endswith(".lock")}


def test_a_new_run_on_a_finished_out_dir_is_refused_and_overwrite_replaces_it(tmp_path, capsys):
    out = str(tmp_path / "o")
    argv = TINY + IL + ["--max_steps", "6", "--eval_size", "4", "--out_dir", out]
    assert run_main(argv) == 0
    files = _files(out)
    assert os.path.join(out, "shapes_eval.json") in files and os.path.isdir(os.path.join(out, "gen0"))
    capsys.readouterr()
    assert run_main(argv) == 2
    line = _one_error_line(capsys)
    assert out in line and "--resume" in line and "--overwrite" in line and "--out_dir" in line
    assert _files(out) == files
    assert run_main(TINY + ["--method", "clip", "--max_steps", "2", "--save_interval", "1", "--out_dir", out,
                            "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == [".lock", "checkpoint", "checkpoint.prev", "config.json", "loss_curve.png",
                                       "metrics.jsonl", "tokenizer.json"]       # no gen*/, no shapes_eval.json
    assert [json.loads(x)["step"] for x in open(os.path.join(out, "metrics.jsonl"))] == [1, 2]


def test_resume_refuses_a_changed_run_defining_flag_and_takes_run_control_flags(tmp_path, capsys):
    out = str(tmp_path / "o")
    assert run_main(TINY + ["--method", "clip", "--max_steps", "6", "--stop_at", "2", "--out_dir", out]) == 0
    capsys.readouterr()
    for flag in (["--lr", "0.5"], ["--method", "negclip"], ["--max_steps", "7"], ["--model_args", "width=64"],
                 ["--lr_schedule", "generation"]):
        assert run_main(["--resume", "--out_dir", out] + flag) == 2
        assert f"--resume: {flag[0]} " in _one_error_line(capsys)
    # the same values, and run-control flags, are accepted
    assert run_main(TINY + ["--method", "clip", "--max_steps", "6", "--resume", "--out_dir", out, "--stop_at", "4",
                            "--log_interval", "2", "--save_interval", "3"]) == 0
    assert train_state(out)["step"] == 4 and train_state(out, "checkpoint.prev")["step"] == 3
    assert [json.loads(x)["step"] for x in open(os.path.join(out, "metrics.jsonl"))] == [1, 2, 4]
    config = json.load(open(os.path.join(out, "checkpoint", "config.json")))
    assert config["lr"] == 1e-3 and config["max_steps"] == 6 and config["preset"] == "tiny"


@pytest.mark.parametrize("target", ["metrics.jsonl", "loss_curve.png"])
def test_a_write_error_is_one_line_and_keeps_the_checkpoint(tmp_path, capsys, monkeypatch, target):
    """A full disk (/dev/full) under metrics.jsonl or the loss curve PNG: one error line, exit 2. (The log is
    appended to in place and never through a link: /dev/full is opened in its stead.)"""
    out = str(tmp_path / "w")
    os.makedirs(out)
    if target == "metrics.jsonl":
        monkeypatch.setattr(lifecycle, "open_to_append", lambda path: open("/dev/full", "a"))
    else:       # lifecycle.atomic_write's temp file
        os.symlink("/dev/full", os.path.join(out, f"{target}.tmp{os.getpid()}"))
    rc = run_main(TINY + ["--method", "clip", "--max_steps", "4", "--save_interval", "2", "--out_dir", out])
    line = _one_error_line(capsys)
    assert rc == 2 and os.path.join(out, target) in line and "no space left on device" in line, line
    if target == "loss_curve.png":                     # drawn after the step-2 save: that checkpoint stands
        assert train_state(out)["step"] == 2


@pytest.mark.parametrize("method", ["clip", "codebook"])
def test_nonfinite_stops_and_never_saves_a_nonfinite_checkpoint(tmp_path, capsys, method):
    out = str(tmp_path / "n")
    rc = run_main(TINY + ["--method", method, "--max_steps", "50", "--lr", "1e30", "--grad_clip", "0",
                          "--warmup", "0", "--save_interval", "1", "--out_dir", out])
    assert rc == 1
    assert "non-finite loss or weights" in _one_error_line(capsys)
    step = train_state(out)["step"]
    assert step < 50
    assert all(torch.isfinite(v).all() for v in weights(out).values())
    assert lifecycle.all_finite(train_state(out)) and train_state(out)["optimizer"]["state"]


def test_logit_scale_used_in_the_loss_is_at_most_100():
    cfg = M.ModelConfig(embed_dim=16, image_size=16, patch_size=8, vision_width=16, vision_layers=1,
                        vision_heads=2, context_length=8, vocab_size=20, text_width=16, text_layers=1,
                        text_heads=2, eot_token_id=19, codebook_size=8, code_dim=16)
    m = M.CLIP(cfg)
    text = torch.tensor([[1, 5, 19, 0, 0, 0, 0, 0]])
    for v, want in ((6.0, 100.0), (4.0, math.exp(4.0))):      # the codebook clamp's top: exp(6) = 403
        with torch.no_grad():
            m.logit_scale.fill_(v)
        scale = m(torch.randn(1, 3, 16, 16), text)[2]
        assert scale.item() == pytest.approx(want)
    # the unused projections of codebook mode are frozen (DDP and AdamW never see them)
    assert [n for n, p in m.named_parameters() if not p.requires_grad] == list(M.UNUSED_WITH_CODEBOOK)


def test_distill_logs_the_contrastive_loss_and_the_curve_plots_it(tmp_path):
    out = str(tmp_path / "c")
    assert run_main(TINY + IL + ["--out_dir", out]) == 0
    recs = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    distill = [r for r in recs if r["phase"] == "distill"]
    assert distill and all(math.isfinite(r["clip"]) and r["clip"] != r["loss"] for r in distill)
    assert all(r["clip"] == r["loss"] for r in recs if r["phase"] != "distill")
    fig = M.draw_loss_curve(os.path.join(out, "metrics.jsonl"), os.path.join(out, "loss_curve.png"))
    grey = next(line for line in fig.axes[0].get_lines() if line.get_label() == "contrastive loss")
    assert grey.get_color() == M.CLIP_LOSS_COLOUR and list(grey.get_ydata()) == [r["clip"] for r in recs if "clip" in r]


def test_contradictory_distill_flags_are_one_error_line(tmp_path, capsys):
    assert run_main(TINY + IL + ["--distill_train_vision", "--distill_loss", "cos",
                                 "--out_dir", str(tmp_path / "x")]) == 2
    assert "--distill_train_vision needs --distill_loss kd" in _one_error_line(capsys)
    M.build_args(TINY + IL + ["--code_sim", "cos", "--out_dir", str(tmp_path / "y")])
    assert "nearly uniform" in capsys.readouterr().err


def test_negclip_caption_swaps():
    import random
    rng = random.Random(0)
    assert M.negative_caption("a white star", rng) is None          # nothing to swap
    for cap in ["a small purple star above a blue cross", "a white triangle to the right of an orange cross",
                "a green diamond is above a purple star", "a man riding a brown horse next to a white tent"]:
        for seed in range(5):
            neg = M.negative_caption(cap, random.Random(seed))
            assert neg is not None and neg != cap
            assert sorted(neg.replace(" an ", " a ").split()) == sorted(cap.replace(" an ", " a ").split()) \
                or any(w in neg.split() for w in ("below", "above", "left", "right"))
            words = neg.split()
            for a, b in zip(words, words[1:]):                       # articles agree with the next word
                if a in ("a", "an"):
                    assert (a == "an") == (b[0] in "aeiou"), neg
    pool = M.ImagePool(4, 2, "cpu")
    assert pool.nearest(torch.ones(1, 2)) is None
    pool.push(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert torch.equal(pool.nearest(torch.tensor([[0.1, 0.9]])), torch.tensor([[0.0, 1.0]]))
