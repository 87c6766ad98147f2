"""bench.py: the paths it times compute what the plain ones do (no timed assertions).
compiled vs eager is not tested here: inductor's C++ compile of even the tiny model takes
longer on the shared 2-core CPU than this file's budget (tests/test_il_clip_fast.py covers --compile)."""
import math
import re
import sys
import types

import pytest
import torch

import bench
import il_clip
import lifecycle
from conftest import import_open_clip


def test_chunked_codebook_head_matches_naive_and_counts_less_memory():
    g = torch.Generator().manual_seed(0)
    B, P, K, D = 8, 7, 300, 16
    q = torch.randn(B, P, D, generator=g, dtype=torch.float64, requires_grad=True)
    c = torch.randn(K, D, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(B, D, generator=g, dtype=torch.float64)
    outs = []
    for naive in (False, True):
        q.grad = c.grad = None
        y = bench.codebook_head(q, c, naive=naive)
        (y * t).sum().backward()
        outs.append((y.detach(), q.grad.clone(), c.grad.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # the memory probe sees the B x P x K scores of the naive head, and only a 2-sample chunk of
    # them in il_clip's chunked head
    B, P, K, D = 8, 49, 512, 8
    ours, _ = bench.head_peak(B, P, K, D, False, torch.device("cpu"), budget=P * K)
    naive, _ = bench.head_peak(B, P, K, D, True, torch.device("cpu"))
    assert naive >= B * P * K * 4 > ours


def test_live_tensor_bytes_counts_allocations_and_frees():
    x = torch.randn(256, 256, requires_grad=True)             # pre-existing: not counted
    with bench.LiveTensorBytes() as m:
        y = (x @ x).relu()                                    # 256 KiB, kept by relu for backward
        assert m.live == 256 * 256 * 4
        y.sum().backward()
        del y
        x.grad = None
    assert m.live == 0 and m.peak >= 2 * 256 * 256 * 4


def test_synthetic_text_has_one_eot_and_pads_after():
    text, eot_id = bench.synthetic_text(50, 1000, 32, torch.Generator().manual_seed(0)), 999
    assert ((text == eot_id).sum(1) == 1).all() and (text[:, 0] == 998).all()
    eot = (text == eot_id).int().argmax(-1)
    assert (eot == text.argmax(-1)).all()                     # open_clip's argmax pooling agrees
    pos = torch.arange(32)[None]
    assert (text[pos > eot[:, None]] == 0).all() and (text[pos < eot[:, None]] != 0).all()
    cfg = bench.model_config("tiny", "clip", 0)
    assert cfg.eot_token_id == cfg.vocab_size - 1                 # the model pools where synthetic_text puts EOT


def _args(**kw):
    a = dict(model="tiny", batch_size=4, codebook=64, compile=False, dtype="fp32", steps=2, untimed=1)
    a.update(kw)
    return types.SimpleNamespace(**a)


@pytest.mark.parametrize("method", ["clip", "il"])
def test_trainer_bench_times_il_clips_step(method, monkeypatch):
    """run_trainer times il_clip.compute_loss in every phase it claims, with il_clip's frozen sets."""
    seen, real = [], il_clip.compute_loss

    def spy(model, batch, phase, agent, teacher, pool, args):
        frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
        seen.append((phase, agent, teacher is not None, "codebook" in frozen))
        return real(model, batch, phase, agent, teacher, pool, args)
    monkeypatch.setattr(il_clip, "compute_loss", spy)
    res = bench.run_trainer(_args(), method, torch.device("cpu"))
    assert res["step_s"] > 0 and res["cfg"].codebook_size == (64 if method == "il" else 0)
    if method == "il":
        # warm-up 1, distill: warm-up 1 + 1 timed (language spawned, codebook frozen), interact 1
        assert seen == [("train", None, False, False)] + [("distill", "language", True, True)] * 2 \
            + [("interact", None, False, False)]
        assert res["spawn_s"] > 0 and math.isfinite(res["step_s"]) and (res["d"], res["i"]) == (1, 1)
    else:
        assert seen == [("train", None, False, False)] * 3


def test_open_clip_reference_is_the_same_model():
    open_clip = import_open_clip()
    cfg = bench.model_config("tiny", "clip", 0)
    ours = il_clip.CLIP(cfg)
    theirs = bench.open_clip_model(open_clip, cfg)
    shapes = lambda m: sorted(tuple(p.shape) for p in m.parameters())
    assert shapes(ours) == shapes(theirs)
    # same state-dict layout (OpenAI key names): our weights load into open_clip's model
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not missing and not unexpected
    g = torch.Generator().manual_seed(0)
    images = torch.randn(2, 3, cfg.image_size, cfg.image_size, generator=g)
    text = bench.synthetic_text(2, cfg.vocab_size, cfg.context_length, g)
    with torch.no_grad():
        a, b = ours.eval()(images, text)[:2], theirs.eval()(images, text)[:2]
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_target_rows_judge_each_target_against_its_machines_threshold():
    values = {"clip_mfu": 0.35, "codebook_over_clip": 1.151, "il_over_codebook": 0.97,
              "vs_open_clip": 1.1, "codebook_head_bytes": 1e9}
    gpu = {r["key"]: r["ok"] for r in bench.target_rows(values, gpu=True)}
    # at the threshold counts as met for >= / <=, not for the strict "< 1 GB"
    assert gpu == {"clip_mfu": True, "codebook_over_clip": False, "il_over_codebook": True,
                   "vs_open_clip": False, "codebook_head_bytes": False}
    cpu = {r["key"]: r["ok"] for r in bench.target_rows(values, gpu=False)}
    # on the CPU only the open_clip ratio (>= 1.0) and the head memory are targets
    assert cpu == {"clip_mfu": None, "codebook_over_clip": None, "il_over_codebook": None,
                   "vs_open_clip": True, "codebook_head_bytes": False}
    missing = bench.target_rows({"codebook_head_bytes": 4e8}, gpu=False)
    assert [r["ok"] for r in missing] == [None, None, None, None, True]      # not measured: no verdict


def test_targets_run_measures_every_method_and_derives_the_ratios(monkeypatch, tmp_path, capsys):
    import json
    heads, real_head_peak = [], bench.head_peak

    def small_head(B, P, K, D, naive, device):
        heads.append((B, P, K, D, naive))
        return real_head_peak(8, P, 256, 16, naive, device)       # the real probe, smaller
    monkeypatch.setattr(bench, "head_peak", small_head)
    out = tmp_path / "targets.json"
    argv = ["--targets", "--batch_size", "4", "--codebook", "64", "--steps", "2", "--untimed", "1",
            "--rounds", "1", "--json", str(out)]
    assert bench.main(argv) == 0
    assert heads == [(256, 49, 16384, 512, False)]     # the fixed size, chunked head
    report = json.loads(out.read_text())
    runs, v = report["runs"], {r["key"]: r["value"] for r in report["targets"]}
    assert report["command"] == "python bench.py " + " ".join(argv) and report["config"]["batch_size"] == 4
    assert runs["codebook"]["cfg"]["codebook_size"] == 64 and runs["clip"]["cfg"]["codebook_size"] == 0
    assert v["codebook_over_clip"] == pytest.approx(runs["codebook"]["step_s"] / runs["clip"]["step_s"])
    assert v["il_over_codebook"] == pytest.approx(runs["il"]["step_s"] / runs["codebook"]["step_s"])
    assert v["clip_mfu"] is None and v["codebook_head_bytes"] == report["codebook_head"]["bytes"] > 0
    if "open_clip" in runs:
        assert v["vs_open_clip"] == pytest.approx(runs["open_clip"]["step_s"] / runs["clip"]["step_s"])
    else:
        assert v["vs_open_clip"] is None
    table = capsys.readouterr().out
    assert "| codebook head peak memory, B=256 P=49 K=16384 D=512 |" in table and "targets met" in table


@pytest.mark.parametrize("model,codebook,text_len",
                         [("ViT-B-32", 0, None), ("ViT-B-32", 16384, 32), ("tiny", 1024, None)])
def test_flops_per_pair_matches_torch_flop_counter(model, codebook, text_len):
    """The MFU numerator, lifecycle.estimate_flops_per_pair, against torch's FlopCounterMode over a
    real forward (on the meta device: shapes only, no arithmetic), times 3 for a training step."""
    from torch.utils.flop_counter import FlopCounterMode
    cfg = bench.model_config(model, "codebook" if codebook else "clip", codebook)
    L = text_len or cfg.context_length
    with torch.device("meta"):
        net = il_clip.CLIP(cfg)
        images = torch.empty(2, 3, cfg.image_size, cfg.image_size)
        text = torch.zeros(2, L, dtype=torch.long)
        with FlopCounterMode(display=False) as counter:
            net.encode_image(images), net.encode_text(text)
    counted = 3 * counter.get_total_flops() / 2
    assert lifecycle.estimate_flops_per_pair(cfg, text_len) == pytest.approx(counted, rel=1e-9)
    if model == "ViT-B-32" and not codebook:
        assert counted == pytest.approx(44.3e9, rel=2e-3)        # the 14.8 GFLOPs forward x 3


def test_peak_flops_by_device_name():
    assert lifecycle.peak_flops("NVIDIA H100 80GB HBM3") == lifecycle.peak_flops("NVIDIA H200") == 989e12
    assert lifecycle.peak_flops("NVIDIA H100 PCIe") == 756e12 and lifecycle.peak_flops("NVIDIA H100 NVL") == 835e12
    assert lifecycle.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and lifecycle.peak_flops("Tesla T4") is None


def test_open_clip_step_is_timed_like_ours():
    """The reference run: open_clip's CLIP + ClipLoss through the same optimizer step."""
    import_open_clip()
    res = bench.run_trainer(_args(), "open_clip", torch.device("cpu"))
    assert res["method"] == "clip" and res["cfg"].codebook_size == 0 and res["step_s"] > 0


def test_missing_open_clip_is_one_line(monkeypatch, capsys):
    """Where open_clip cannot be imported, the reference is skipped with one line saying why."""
    import builtins
    real_import = builtins.__import__

    def no_open_clip(name, *a, **k):
        if name == "open_clip":
            raise ImportError("No module named 'open_clip'")
        return real_import(name, *a, **k)
    monkeypatch.delitem(sys.modules, "open_clip", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_open_clip)
    assert bench.import_open_clip() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["no open_clip reference: No module named 'open_clip' (pip install open_clip_torch)"]


def test_composer_mode_times_two_paths_that_agree(capsys):
    assert bench.main(["--composer", "--batch_size", "8", "--steps", "4"]) == 0
    out, err = capsys.readouterr()
    assert "composer forward, 8 caption-image pairs" in out
    assert err.splitlines()[0].startswith("start: bench.py --composer | --model tiny | batch 8 | fp32 | CPU (")
    assert err.splitlines()[0].endswith(" | script il_clip.py | out the lines on stdout")
    assert re.fullmatch(r"done: measured in \d+s \| wrote nothing", err.splitlines()[-1]), err
    assert float(out.rsplit("max |node score diff| ", 1)[1]) < 1e-5     # level-batched == node-by-node


@pytest.mark.parametrize("argv,expect", [
    (["--codebook_memory", "--batch_size", "4", "--codebook", "512"], "P=196: chunked"),
    (["--data", "shapes", "--num_workers", "0", "--steps", "2"], "skipped 0"),
])
def test_each_mode_runs_and_reports(argv, expect, capsys):
    assert bench.main(argv) == 0
    assert expect in capsys.readouterr().out


def test_script_flag_times_the_forks_own_step(tmp_path, monkeypatch, capsys):
    """--script PATH: bench imports the fork and times its compute_loss (il_clip.py's is not called)."""
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = open(os.path.join(root, "il_clip.py")).read()
    head = "def compute_loss(model, batch, phase, agent, teacher, pool, args):\n"
    assert src.count(head) == 1
    fork = tmp_path / "il_clip_fork.py"
    fork.write_text(src.replace(head, "CALLS = []\n\n\n" + head + "    CALLS.append(phase)\n"))
    monkeypatch.setattr(bench, "il_clip", bench.il_clip)        # restored after the test
    monkeypatch.setattr(il_clip, "compute_loss", lambda *a: pytest.fail("il_clip.py's step was timed"))
    assert bench.main(["--script", str(fork), "--batch_size", "4", "--steps", "1", "--untimed", "1"]) == 0
    assert bench.il_clip.__file__ == str(fork) and bench.il_clip.CALLS == ["train", "train"]
    assert "samples/s" in capsys.readouterr().out


def test_data_mode_reports_both_stored_sizes_and_the_cores_to_feed(capsys):
    import re
    assert bench.main(["--data", "--num_workers", "1", "--rounds", "1", "--images", "12", "--batch_size", "4",
                       "--feed", "6204"]) == 0
    out = capsys.readouterr().out
    costs = {}
    # of the printed costs, each rounded to 0.005: the ratio a/b moves by up to 0.005 (1 + a/b) / b, +0.005
    slack = lambda a, b: 0.005 * (1 + a / b) / (b - 0.005) + 0.0051   # noqa: E731
    for stored in (256, 512):
        lines = out.splitlines()
        at = next(i for i, ln in enumerate(lines) if f"stored {stored} px" in ln)
        line, steady = lines[at], lines[at + 1]
        plain, zero, one = map(float, re.findall(r"(?:loop|workers) (\d+\.\d+)", line))
        ratios = [float(x) for x in re.findall(r"(\d+\.\d+)x plain[);]", line)]
        assert ratios[0] == pytest.approx(zero / plain, abs=slack(zero, plain))
        assert ratios[1] == pytest.approx(one / plain, abs=slack(one, plain))
        parallel = float(re.search(r"1 plain loops at once, (\d+\.\d+)\)", line).group(1))
        at_once = float(re.search(r"(\d+\.\d+)x 1 plain loops", line).group(1))
        assert at_once == pytest.approx(one / parallel, abs=slack(one, parallel))  # the loop in as many processes
        # steady state: the slope between the 8-image (one batch per shard) and the 12-image epoch; 4 images
        # apart, start-up noise can make it negative, and then --feed falls back to the full epoch
        if "not separable at 12 images" in steady:
            costs[stored] = one
            continue
        assert "steady state" in steady and "the slope between 8- and 12-image epochs" in steady
        zero_s, one_s = map(float, re.findall(r"workers (\d+\.\d+)", steady))
        assert float(re.search(r"(\d+\.\d+)x plain\)", steady).group(1)) == pytest.approx(
            zero_s / plain, abs=slack(zero_s, plain))
        costs[stored] = one_s
    # the cores: samples/s x CPU seconds per sample in steady state (main process + workers), rounded up
    cores = [int(x) for x in re.findall(r"(\d+) cores at (?:256|512) px", out)]
    assert cores == pytest.approx([6204 * costs[256] / 1e3 + 0.5, 6204 * costs[512] / 1e3 + 0.5], abs=0.55)


def test_data_mode_ratios_pair_the_two_costs_of_each_round(monkeypatch, capsys):
    """A ratio is the median over rounds of loader / plain measured in the same round, not least over least:
    with these costs least over least would say 1.20x. Steady state: (the full epoch's CPU - the short epoch's) /
    (the images between them); here every epoch costs 3.2 ms of start-up beyond its images."""
    cost = {"plain": [2.0, 4.0, 2.4], "parallel": [2.0, 4.0, 2.4], 0: [2.4, 4.2, 2.5], 1: [2.4, 4.4, 2.6]}
    calls = {k: iter(v * 2) for k, v in cost.items()}       # 3 rounds at each stored size
    monkeypatch.setattr(bench, "plain_loop", lambda jpegs, size: next(calls["plain"]))
    monkeypatch.setattr(bench, "plain_parallel", lambda jpegs, size, n: next(calls["parallel"]))
    steady = {}

    def epoch(pattern, size, w, batch):     # -> (rate, CPU ms per image, images, skipped)
        if "short" not in pattern:
            per_image = next(calls[w])          # of the 16-image epoch: 16 x steady + 3.2 ms
            steady[w] = per_image - 3.2 / 16
            return 0.0, per_image, 16, 0
        return 0.0, (8 * steady[w] + 3.2) / 8, 8, 0
    monkeypatch.setattr(bench, "loader_epoch", epoch)
    monkeypatch.setattr(bench, "transport_ms", lambda *a: 0.1)      # not under test here
    monkeypatch.setattr(bench, "jpeg_shards", lambda d, n, stored: (d + "/{0..1}.tar", [b"jpeg"] * n))
    assert bench.main(["--data", "--num_workers", "1", "--rounds", "3", "--images", "16", "--batch_size", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, ln in enumerate(out) if "stored 256 px" in ln)
    assert ("plain PIL loop 2.00; make_loader 0 workers 2.40 (1.05x plain), 1 workers 2.40 (1.10x plain; 1.10x"
            in out[at])
    # steady: 0 workers 2.2, 4.0, 2.3 (median ratio 1.00), 1 worker 2.2, 4.2, 2.4 (1.05); start-up 3.2 ms
    assert "start-up, 3 / 3 CPU ms" in out[at + 1]
    assert "0 workers 2.20 (1.00x plain), 1 workers 2.20 (1.05x plain; 1.05x 1 plain loops at once)" in out[at + 1]


def test_data_mode_without_a_positive_slope_says_so_and_feeds_from_the_full_epoch(monkeypatch, capsys):
    """The short epoch costing more than the full one (start-up noise beyond the images between them):
    no steady state is printed, and --feed uses the full epoch's cost."""
    monkeypatch.setattr(bench, "plain_loop", lambda jpegs, size: 2.0)
    monkeypatch.setattr(bench, "plain_parallel", lambda jpegs, size, n: 2.0)
    monkeypatch.setattr(bench, "loader_epoch", lambda pattern, size, w, batch:
                        (0.0, 9.0, 8, 0) if "short" in pattern else (0.0, 5.0, 16, 0))   # slope (80 - 72) / 8 = 1
    monkeypatch.setattr(bench, "transport_ms", lambda *a: 0.1)
    monkeypatch.setattr(bench, "jpeg_shards", lambda d, n, stored: (d + "/{0..1}.tar", [b"jpeg"] * n))
    assert bench.main(["--data", "--num_workers", "1", "--rounds", "1", "--images", "16", "--batch_size", "4",
                       "--feed", "1000"]) == 0
    out = capsys.readouterr().out
    assert "steady state (each" in out and "not separable" not in out and "1 cores at 256 px" in out
    monkeypatch.setattr(bench, "loader_epoch", lambda pattern, size, w, batch:
                        (0.0, 11.0, 8, 0) if "short" in pattern else (0.0, 5.0, 16, 0))  # slope (80 - 88) / 8 < 0
    assert bench.main(["--data", "--num_workers", "1", "--rounds", "1", "--images", "16", "--batch_size", "4",
                       "--feed", "1000"]) == 0
    out = capsys.readouterr().out
    assert out.count("steady state: not separable at 16 images") == 2 and "steady state (each" not in out
    assert "5 cores at 256 px, 5 cores at 512 px" in out        # 1000 samples/s x 5 ms, the full epoch


def test_loader_cpu_counts_the_workers(tmp_path):
    """loader_epoch's CPU ms per image includes the workers' (joined children): with the decoding in
    the workers, the main process alone would count a fraction of it."""
    import resource
    pattern, _ = bench.jpeg_shards(str(tmp_path), 16, 256)
    self0 = resource.getrusage(resource.RUSAGE_SELF)
    _, ms, n, skipped = bench.loader_epoch(pattern, 224, 2, 4)
    self1 = resource.getrusage(resource.RUSAGE_SELF)
    main_ms = (self1.ru_utime + self1.ru_stime - self0.ru_utime - self0.ru_stime) / n * 1e3
    assert n == 16 and skipped == 0 and ms > 2 * main_ms


def test_data_wait_trains_il_clip_on_normalised_jpeg_batches(monkeypatch, capsys):
    seen, real = [], il_clip.compute_loss

    def spy(model, batch, *a):
        seen.append((batch["image"].dtype, tuple(batch["image"].shape), float(batch["image"].mean()), batch["text"]))
        return real(model, batch, *a)
    monkeypatch.setattr(il_clip, "compute_loss", spy)
    assert bench.main(["--data_wait", "--num_workers", "1", "--steps", "2", "--untimed", "1", "--batch_size", "4",
                       "--images", "8"]) == 0
    assert [s[:2] for s in seen] == [(torch.float32, (4, 3, 64, 64))] * 3       # tiny's 64 px, normalised
    assert all(-1.5 < m < 1.5 for _, _, m, _ in seen)                            # CLIP-normalised, not 0..255
    assert all(t.shape == (4, 32) and (t[:, 0] > 0).all() for *_, t in seen)     # tokenized captions, SOT first
    out = capsys.readouterr().out
    wait = float(out.rsplit("= ", 1)[1].split("%")[0])
    assert "waiting for the next batch" in out and 0 <= wait <= 100


def test_levers_time_each_lever_with_its_compile_scope_and_chunking(monkeypatch, tmp_path, capsys):
    """--levers: each row runs the step it names (the step-compiled rows go through one compiled
    closure of model + loss, the others through il_clip's compiled encoders), the chunk budget is set
    for its row only and restored, ratios are against CLIP at the same batch."""
    import json
    compiled, budgets, real_apply = [], [], il_clip._MaxCodeScores.apply
    monkeypatch.setattr(torch, "compile", lambda fn=None, mode=None, **kw: compiled.append(mode) or fn)
    monkeypatch.setattr(il_clip._MaxCodeScores, "apply",
                        lambda q, c, v, budget, mt: budgets.append(budget) or real_apply(q, c, v, budget, mt))
    monkeypatch.setattr(bench, "LEVERS", [("clip base", "clip", 4, "encoders", None),
                                          ("clip graphs", "clip", 4, "step+cudagraphs", None),
                                          ("codebook chunked", "codebook", 4, "step", 123)])
    out = tmp_path / "levers.json"
    assert bench.main(["--levers", "--codebook", "64", "--steps", "2", "--untimed", "1", "--out", str(out)]) == 0
    # encoders: two compiled methods (mode None); step+cudagraphs: reduce-overhead; step: default mode
    assert compiled == [None, None, "reduce-overhead", None]
    assert set(budgets) == {123} and il_clip.CODE_SCORES_PER_CHUNK == 1 << 25
    rows = json.loads(out.read_text())["rows"]
    assert [r["compiled"] for r in rows] == ["encoders", "step+cudagraphs", "step"] and rows[2]["chunk_scores"] == 123
    table = capsys.readouterr().out
    ratio = rows[2]["step_ms"] / rows[0]["step_ms"]
    assert f"| codebook chunked | 4 |" in table and f"{ratio:.3f}x |" in table


def test_seed_sets_the_timed_models_weights(monkeypatch):
    """--seed reaches the model built for the timed steps (default 0, as before the flag)."""
    seeds, real = [], il_clip.CLIP
    monkeypatch.setattr(il_clip, "CLIP", lambda cfg, seed=0: seeds.append(seed) or real(cfg, seed=seed))
    bench.run_trainer(_args(seed=7), "clip", torch.device("cpu"))
    bench.run_trainer(_args(), "clip", torch.device("cpu"))
    assert seeds == [7, 0]
