"""eval_compositional.py scores a checkpoint with the code that trained it: the script its
config.json records. Two forks of il_clip.py, written here by text substitution and trained for
a few steps as their own processes: a softmax fork (torch.softmax where the codebook head calls
sparsemax) and a SigLIP-style fork (a learnable logit_bias in CLIP, used by a sigmoid loss). Eval
must give each fork's own end-of-run shapes numbers and name the fork; --script overrides; a
changed, missing or foreign script is one line."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import data
import lifecycle
import eval_compositional as E

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--method", "codebook", "--code_temp", "1", "--codebook", "32", "--model_args", "width=32", "layers=1",
        "heads=2", "embed_dim=32", "image_size=32", "patch_size=8", "code_dim=32", "--batch_size", "8",
        "--warmup", "1", "--max_steps", "6", "--vocab_size", "300", "--eval_size", "20"]
FORKS = {  # name: [(text of il_clip.py, its replacement)]
    "softmax": [("        return s, sparsemax(s, dim=-1)\n", "        return s, torch.softmax(s, dim=-1)\n")],
    "siglip": [("        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))\n",
                "        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))\n"
                "        self.logit_bias = nn.Parameter(torch.tensor(-10.))\n"),
               ("    loss = contrastive_loss(img, txt, scale, neg_txt, neg_valid, neg_img)\n",
                "    logits = scale * img @ txt.t() + model.logit_bias\n"
                "    loss = -F.logsigmoid((2 * torch.eye(len(logits), device=device) - 1) * logits).sum()"
                " / len(logits)\n")]}
CATEGORIES = [*data.SHAPES_CATEGORIES, "systematicity", "productivity"]
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def fork_source(subs):
    with open(os.path.join(ROOT, "il_clip.py")) as f:
        src = f.read()
    for old, new in subs:
        assert src.count(old) == 1, old   # il_clip.py changed: the fork no longer applies
        src = src.replace(old, new)
    return src


@pytest.fixture(scope="module")
def forks(tmp_path_factory):
    """{name: (fork script, its out_dir)}, each trained by its own process (run from tmp: only
    data.py comes from the repository)."""
    root, out = tmp_path_factory.mktemp("forks"), {}
    for name, subs in FORKS.items():
        script = root / f"il_clip_{name}.py"
        script.write_text(fork_source(subs))
        run = root / name
        p = subprocess.run([sys.executable, str(script), *TINY, "--out_dir", str(run)], cwd=root, env=ENV,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr
        out[name] = (str(script), str(run))
    return out


def evaluate(ckpt, out, *flags):
    return subprocess.run([sys.executable, "eval_compositional.py", "--ckpt", ckpt, "--eval_size", "20",
                           "--no_progress", "--out", str(out), *flags], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("name", list(FORKS))
def test_eval_scores_a_fork_with_its_own_code(forks, name, tmp_path):
    script, run = forks[name]
    p = evaluate(run, tmp_path / "r.json")
    assert p.returncode == 0, p.stderr
    blob = json.loads((tmp_path / "r.json").read_text())
    assert blob["script"] == {"path": script, "sha256": lifecycle.script_record(script)["sha256"], "changed": False}
    assert f"code {script}," in p.stderr and "has changed" not in p.stderr
    # the fork's own end-of-run numbers (in percent, or fractions from before that switch), the same 20 items
    own = json.loads(open(os.path.join(run, "shapes_eval.json")).read())
    assert own["scored"]["items_per_category"] == blob["results"]["shapes"]["n_per_category"] == 20
    own = E.shapes_percent(own)
    for cat in CATEGORIES:
        assert blob["results"]["shapes"][cat] == round(own[cat], 2), cat


def test_script_override_and_what_the_unforked_code_makes_of_a_fork(forks, tmp_path):
    """--script il_clip.py scores the softmax fork's weights with sparsemax: other numbers, the
    JSON names il_clip.py and says it is not the recorded text; il_clip.py refuses the SigLIP
    fork's logit_bias in one line."""
    _, run = forks["softmax"]
    own = E.shapes_percent(json.loads(open(os.path.join(run, "shapes_eval.json")).read()))
    p = evaluate(run, tmp_path / "r.json", "--script", os.path.join(ROOT, "il_clip.py"))
    assert p.returncode == 0, p.stderr
    blob = json.loads((tmp_path / "r.json").read_text())
    assert blob["script"]["path"] == os.path.join(ROOT, "il_clip.py") and blob["script"]["changed"] is True
    assert "has changed since it trained this checkpoint" in p.stderr
    assert any(blob["results"]["shapes"][c] != round(own[c], 2) for c in CATEGORIES)
    p = evaluate(forks["siglip"][1], tmp_path / "s.json", "--script", os.path.join(ROOT, "il_clip.py"))
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(err) == 1 and "unexpected keys logit_bias" in err[0]


def copy_run(run, dest, **script):
    """A copy of a run's checkpoint whose config.json records `script` fields changed."""
    shutil.copytree(os.path.join(run, "checkpoint"), dest)
    cfg = lifecycle.read_json(str(dest / "config.json"))
    cfg["script"] = {**cfg["script"], **script}
    lifecycle.save_json(str(dest / "config.json"), cfg)
    return str(dest)


def test_changed_and_missing_scripts(forks, tmp_path, capsys):
    script, run = forks["softmax"]
    edited = tmp_path / "edited.py"
    edited.write_text(open(script).read() + "\n# edited after training\n")
    ckpt = copy_run(run, tmp_path / "changed", path=str(edited), name="edited.py")
    assert E.main(["--ckpt", ckpt, "--eval_size", "5", "--no_progress", "--out", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert f"note: {edited} has changed since it trained this checkpoint" in err and f"code {edited}," in err
    assert json.loads((tmp_path / "r.json").read_text())["script"]["changed"] is True
    ckpt = copy_run(run, tmp_path / "missing", path=str(tmp_path / "gone" / "gone.py"), name="gone.py")
    assert E.main(["--ckpt", ckpt, "--no_progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: gone.py: training script not found") and "--script" in err[0]


def test_checkpoints_of_other_scripts_get_one_line_naming_the_script_and_its_reader(forks, tmp_path, capsys):
    weights = os.path.join(forks["softmax"][1], "checkpoint", "model.safetensors")
    cases = {  # config.json -> what the line must say
        "composer": ({"args": {}, "model": {"dim": 32},
                      "script": lifecycle.script_record(os.path.join(ROOT, "composer.py"))},
                     "a checkpoint of composer.py", "python composer.py eval --ckpt"),
        "finetune": ({"cmd": "finetune", "task": "classification", "results": {}},   # recorded no script yet
                     "a checkpoint of mm_learngene.py", "python mm_learngene.py report --results"),
        "vision": ({"model": {"vision_width": 32}, "modality": "vision"}, "a vision-only descendant",
                   "--modality clip")}
    for name, (cfg, what, how) in cases.items():
        os.makedirs(tmp_path / name)
        shutil.copy(weights, tmp_path / name)
        lifecycle.save_json(str(tmp_path / name / "config.json"), cfg)
        assert E.main(["--ckpt", str(tmp_path / name), "--no_progress"]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and what in err[0] and how in err[0], (name, err)


def test_analyses_load_snapshots_and_compared_runs_with_their_code(forks, tmp_path):
    """A generation snapshot is read by the run's own module (its config.json need not record a
    script); a --compare_ckpts run by the script it records (the SigLIP fork beside the softmax
    one: il_clip.py would refuse its logit_bias); the codebook figure uses the fork's softmax
    weights (every code active, which sparsemax never gives at this temperature)."""
    script, run = forks["softmax"]
    args = E.get_args(["--ckpt", run, "--plot_dir", str(tmp_path), "--probe_steps", "2", "--probe_eval_every", "1",
                       "--probe_eval_size", "8", "--probe_batch", "4", "--viz_images", "16", "--no_progress",
                       "--compare_ckpts", forks["siglip"][1]])
    model, tok, config = E.load_checkpoint(run, args, args.script)
    assert E.script_of(model).__file__ == script
    snap = tmp_path / "gen1"
    shutil.copytree(os.path.join(run, "checkpoint"), snap)
    cfg = lifecycle.read_json(str(snap / "config.json"))
    del cfg["script"]
    lifecycle.save_json(str(snap / "config.json"), cfg)
    assert type(E.load_snapshot(str(snap), model, run, args)) is type(model)
    assert type(E.fresh_language_agent(model, 7)) is type(model)
    r = E.bench_codebook(args, model, tok, config)
    assert r["active_codes"] == 32
    r = E.bench_easy_to_learn(args, model, tok, config)
    assert set(r) >= {"softmax", "siglip"} and [c["step"] for c in r["siglip"]["curve"]] == [0, 1, 2]


def test_bare_weights_use_il_clip_beside_eval(tmp_path):
    """--init weights record no script: il_clip.py beside eval_compositional.py builds them."""
    import il_clip
    from safetensors.torch import save_file
    cfg = il_clip.ModelConfig(embed_dim=32, image_size=32, patch_size=8, vision_width=32, vision_layers=1,
                              vision_heads=1, context_length=77, vocab_size=49408, text_width=32, text_layers=1,
                              text_heads=1, eot_token_id=49407)
    save_file(il_clip.CLIP(cfg).state_dict(), str(tmp_path / "w.safetensors"))
    args = E.get_args(["--init", str(tmp_path / "w.safetensors"), "--vocab",
                       os.path.join(ROOT, "tests", "fixtures", "bpe_simple_vocab_16e6.txt.gz")])
    model, _, config = E.load_checkpoint(args.init, args, args.script)
    beside = os.path.join(ROOT, "il_clip.py")
    assert config["script_used"]["path"] == beside and config["script_used"]["changed"] is None
    assert E.script_of(model).__file__ == beside
