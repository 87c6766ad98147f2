"""eval_compositional.py scores a checkpoint with the code that trained it: the script its
config.json records, found only by its bare name beside eval_compositional.py (lifecycle.find_script's
trust rule); any other file runs only when the user names it with --script. Two forks of il_clip.py,
written here by text substitution beside il_clip.py in a copy of the scripts (as the README says to
fork) and trained for a few steps as their own processes: a top-8 fork (a softmax over the 8 best
codes where the codebook head calls sparsemax: a head that amplifies small numeric differences) and a
SigLIP-style fork (a learnable logit_bias in CLIP, used by a sigmoid loss). Eval must give each fork's
own end-of-run shapes numbers digit for digit and name the fork; hostile script records run no code;
a damaged checkpoint is refused."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

import data
import lifecycle
import eval_compositional as E

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--method", "codebook", "--code_temp", "1", "--codebook", "32", "--model_args", "width=32", "layers=1",
        "heads=2", "embed_dim=32", "image_size=32", "patch_size=8", "code_dim=32", "--batch_size", "8",
        "--warmup", "1", "--max_steps", "6", "--vocab_size", "300", "--eval_size", "20"]
FORKS = {  # name: [(text of il_clip.py, its replacement)]
    "topk": [("        return s, sparsemax(s, dim=-1)\n",
              "        top = s.topk(8, dim=-1)\n"
              "        return s, torch.zeros_like(s).scatter(-1, top.indices, torch.softmax(top.values, dim=-1))\n")],
    "siglip": [("        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))\n",
                "        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))\n"
                "        self.logit_bias = nn.Parameter(torch.tensor(-10.))\n"),
               ("    loss = contrastive_loss(img, txt, scale, neg_txt, neg_valid, neg_img)\n",
                "    logits = scale * img @ txt.t() + model.logit_bias\n"
                "    loss = -F.logsigmoid((2 * torch.eye(len(logits), device=device) - 1) * logits).sum()"
                " / len(logits)\n")]}
CATEGORIES = [*data.SHAPES_CATEGORIES, "sugarcrepe_mean", "systematicity", "productivity"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SCRIPTS = ("data.py", "lifecycle.py", "il_clip.py", "eval_compositional.py")


def fork_source(subs):
    with open(os.path.join(ROOT, "il_clip.py")) as f:
        src = f.read()
    for old, new in subs:
        assert src.count(old) == 1, old   # il_clip.py changed: the fork no longer applies
        src = src.replace(old, new)
    return src


def import_file(path):
    """A script of the copy, imported in-process (its `import data, lifecycle` get the repository's, the same text)."""
    spec = importlib.util.spec_from_file_location(f"copy_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def forks(tmp_path_factory):
    """(the copy's eval_compositional module, {name: (fork script, its out_dir)}): the scripts copied into
    root/repo/ with each fork beside il_clip.py, each fork trained by its own process, run from root/."""
    root, out = tmp_path_factory.mktemp("forks"), {}
    (root / "repo").mkdir()
    for name in SCRIPTS:
        shutil.copy(os.path.join(ROOT, name), root / "repo" / name)
    for name, subs in FORKS.items():
        script = root / "repo" / f"il_clip_{name}.py"
        script.write_text(fork_source(subs))
        run = root / name
        p = subprocess.run([sys.executable, str(script), *TINY, "--out_dir", str(run)], cwd=root, env=ENV,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr
        out[name] = (str(script), str(run))
    return import_file(root / "repo" / "eval_compositional.py"), out


def own_numbers(run):
    return json.loads(open(os.path.join(run, "shapes_eval.json")).read())


def error_lines(capsys):
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]


@pytest.mark.parametrize("name", list(FORKS))
def test_eval_scores_a_fork_with_its_own_code_digit_for_digit(forks, name, tmp_path, capsys):
    """Eval beside the fork gives the fork's own end-of-run numbers, every digit (one scorer: data.score_shapes)."""
    E2, runs = forks
    script, run = runs[name]
    assert E2.main(["--ckpt", run, "--eval_size", "20", "--no_progress", "--out", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    blob = json.loads((tmp_path / "r.json").read_text())
    assert blob["script"] == {"path": script, "sha256": lifecycle.script_record(script)["sha256"], "changed": False}
    assert f"code {script}," in err and "note:" not in err
    own = own_numbers(run)
    assert own["scored"]["items_per_category"] == blob["results"]["shapes"]["n_per_category"] == 20
    assert {c: blob["results"]["shapes"][c] for c in CATEGORIES} == {c: own[c] for c in CATEGORIES}


def test_a_top_k_head_needs_the_one_scorer(forks):
    """Why one scorer: the top-8 head turns the last-bit differences of another batching into other
    numbers, so two scorers that batch differently disagree on a fork (they agree on il_clip.py)."""
    E2, runs = forks
    script, run = runs["topk"]
    args = E.get_args(["--ckpt", run, "--script", script])
    model, tok, _ = E.load_checkpoint(run, args, args.script)
    score = lambda b: data.score_shapes(model.encode_image, model.encode_text, tok, 32, n=20, n_val=0, batch_size=b)
    own, ours = own_numbers(run), score(256)
    assert {c: ours[c] for c in CATEGORIES} == {c: own[c] for c in CATEGORIES}
    assert any(score(b) != ours for b in (1, 3, 7)), "the top-8 fork no longer depends on the batching"


def test_script_names_another_file_and_unforked_code_on_a_fork(forks, tmp_path, capsys):
    """--script il_clip.py scores the top-8 fork's weights with sparsemax: other numbers; the note says
    it scores with il_clip.py and the fork trained it (not that il_clip.py "has changed"), before the
    import; il_clip.py refuses the SigLIP fork's logit_bias in one line."""
    _, runs = forks
    il_clip = os.path.join(ROOT, "il_clip.py")
    run = runs["topk"][1]
    assert E.main(["--ckpt", run, "--eval_size", "20", "--no_progress", "--script", il_clip,
                   "--out", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert f"note: scoring with {il_clip}, trained by il_clip_topk.py" in err and "has changed" not in err
    blob = json.loads((tmp_path / "r.json").read_text())
    assert blob["script"]["path"] == il_clip and blob["script"]["changed"] is True
    own = own_numbers(run)
    assert any(blob["results"]["shapes"][c] != own[c] for c in CATEGORIES)
    assert E.main(["--ckpt", runs["siglip"][1], "--no_progress", "--script", il_clip]) == 2
    err = error_lines(capsys)
    assert len(err) == 1 and "unexpected keys logit_bias" in err[0]


def write_config(folder, cfg):
    """config.json, and its sha256.json sum (a hostile folder's sums are in order: only the trust rule stops it)."""
    lifecycle.save_json(os.path.join(folder, "config.json"), cfg)
    sums = lifecycle.read_json(os.path.join(folder, "sha256.json"))
    sums["config.json"] = lifecycle.sha256(os.path.join(folder, "config.json"))
    lifecycle.save_json(os.path.join(folder, "sha256.json"), sums)


def copy_run(run, dest, **script):
    """A copy of a run's checkpoint whose config.json records `script` fields changed."""
    shutil.copytree(os.path.join(run, "checkpoint"), dest)
    cfg = lifecycle.read_json(str(dest / "config.json"))
    cfg["script"] = {**cfg["script"], **script}
    write_config(str(dest), cfg)
    return str(dest)


def test_find_script_notes(forks, tmp_path):
    """Found by name beside the reader: no note, or "has changed" when its sha256 is not the recorded one;
    --script: no note for the recorded text, "scoring with X, trained by Y" for another file."""
    E2, runs = forks
    script = runs["topk"][0]
    record = lifecycle.script_record(script)
    assert lifecycle.find_script(record, E2.__file__) == (script, None)
    path, note = lifecycle.find_script({**record, "sha256": "0" * 64}, E2.__file__)
    assert path == script and note.startswith(f"note: {script} has changed since it trained this checkpoint")
    assert lifecycle.find_script(record, E.__file__, script) == (script, None)     # named: from anywhere
    other = runs["siglip"][0]
    assert lifecycle.find_script(record, E.__file__, other)[1] == f"note: scoring with {other}, trained by " \
                                                                  "il_clip_topk.py (--script)"
    assert lifecycle.find_script(None, E2.__file__, default="il_clip.py") == (os.path.join(
        os.path.dirname(script), "il_clip.py"), None)
    with pytest.raises(lifecycle.DataError, match=f"--script {tmp_path}/no.py: no such file"):
        lifecycle.find_script(record, E.__file__, str(tmp_path / "no.py"))


EVIL = "open({marker!r}, 'a').write(__file__ + '\\n')\n"


def test_hostile_script_records_run_no_code(forks, tmp_path, monkeypatch, capsys):
    """Ten script records that try to run a file the user did not choose, in a downloaded checkpoint
    folder evaluated from inside it (--ckpt .), the hostile files where each record points: each is one
    `error:` line naming the record and --script, written before any import, and no file runs (it would
    leave a marker). A folder that ships its own il_clip.py (and records it) gets the il_clip.py beside
    eval instead, with the note that it is not the recorded text."""
    E2, runs = forks
    repo = os.path.dirname(E2.__file__)
    marker = tmp_path / "ran"
    ck = copy_run(runs["topk"][1], tmp_path / "download")
    abs_evil = str(tmp_path / "elsewhere" / "evil.py")
    for path in (abs_evil, f"{ck}/evil.py", f"{ck}/sub/evil.py", f"{ck}/README.md", f"{tmp_path}/evil.py",
                 f"{os.path.dirname(repo)}/evil.py"):       # the last: ../evil.py joined onto the scripts' folder
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(EVIL.format(marker=str(marker)))
    records = {  # what config.json's "script" holds
        "absolute path": {"name": "evil.py", "path": abs_evil, "sha256": "0" * 64},
        "absolute name": {"name": abs_evil, "path": abs_evil},
        "relative path (the working directory)": {"name": "evil.py", "path": "evil.py"},
        "../ name": {"name": "../evil.py", "path": "../evil.py"},
        "name found only in the working directory": {"name": "evil.py"},
        "name with a folder": {"name": "sub/evil.py", "path": "sub/evil.py"},
        "not a .py file": {"name": "README.md"},
        "a bare string": "evil.py",
        "no name": {"path": abs_evil},
        "a NUL in the name": {"name": "evil.py\0.py"},
    }
    monkeypatch.chdir(ck)
    cfg = lifecycle.read_json(os.path.join(ck, "config.json"))
    for case, record in records.items():
        write_config(ck, {**cfg, "script": record})
        assert E2.main(["--ckpt", ".", "--no_progress"]) == 2, case
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: .: the checkpoint's training script"), (case, err)
        assert "--script PATH" in err[0] and f"beside eval_compositional.py in {repo}," in err[0], (case, err)
        assert not marker.exists(), case
    shutil.copy(os.path.join(ROOT, "il_clip.py"), "il_clip.py")
    with open("il_clip.py", "a") as f:
        f.write(EVIL.format(marker=str(marker)))
    write_config(ck, {**cfg, "script": {**lifecycle.script_record("il_clip.py"), "path": "il_clip.py"}})
    assert E2.main(["--ckpt", ".", "--eval_size", "5", "--no_progress", "--out", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"note: {repo}/il_clip.py has changed since it trained this checkpoint"), err
    assert json.loads((tmp_path / "r.json").read_text())["script"]["path"] == os.path.join(repo, "il_clip.py")
    assert not marker.exists()


def test_a_damaged_checkpoint_is_refused_and_one_without_sums_loads(forks, tmp_path, capsys):
    """Eval checks a checkpoint folder against its sha256.json before it reads it: a bit-flipped
    model.safetensors, config.json or tokenizer.json is one line naming it. Released weights come with no
    sums and load as they are; so does a checkpoint whose state.pt (which eval does not read) is gone."""
    E2, runs = forks
    run = runs["topk"][1]
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        ck = tmp_path / name
        shutil.copytree(os.path.join(run, "checkpoint"), ck)
        raw = bytearray((ck / name).read_bytes())
        raw[len(raw) // 2] ^= 1
        (ck / name).write_bytes(bytes(raw))
        assert E2.main(["--ckpt", str(ck), "--no_progress"]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: {ck}/{name}: damaged (its sha256 is not the one in sha256.json)"], err
    ck = tmp_path / "model.safetensors"
    (ck / "sha256.json").unlink()           # released weights: no sums, read as they are
    assert E2.main(["--ckpt", str(ck), "--eval_size", "5", "--no_progress"]) == 0
    ck = tmp_path / "no_state"
    shutil.copytree(os.path.join(run, "checkpoint"), ck)
    (ck / "state.pt").unlink()
    assert E2.main(["--ckpt", str(ck), "--eval_size", "5", "--no_progress"]) == 0
    capsys.readouterr()


def test_changed_and_missing_scripts(forks, tmp_path, capsys):
    """A fork beside eval that changed since training: scored, with the note written before its import
    (this one says so when imported); one not beside eval: one line, and run only when named."""
    E2, runs = forks
    script, run = runs["topk"]
    loud = os.path.join(os.path.dirname(script), "il_clip_loud.py")
    with open(loud, "w") as f:
        f.write(open(script).read() + "\nprint('imported', file=sys.stderr)\n")
    ckpt = copy_run(run, tmp_path / "changed", name="il_clip_loud.py", sha256="0" * 64)
    assert E2.main(["--ckpt", ckpt, "--eval_size", "5", "--no_progress", "--out", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"note: {loud} has changed since it trained this checkpoint") and err[1] == "imported"
    assert f"code {loud}," in "\n".join(err)
    assert json.loads((tmp_path / "r.json").read_text())["script"]["changed"] is True
    ckpt = copy_run(run, tmp_path / "missing", path=str(tmp_path / "gone" / "gone.py"), name="gone.py")
    assert E2.main(["--ckpt", ckpt, "--no_progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {ckpt}: the checkpoint's training script 'gone.py' "
                                               f"(recorded at '{tmp_path}/gone/gone.py') is not a file beside "
                                               "eval_compositional.py") and "--script PATH" in err[0], err
    # the fork run from the repository, where it is not beside eval: refused, and run when named
    assert E.main(["--ckpt", run, "--no_progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'il_clip_topk.py'" in err[0] and "--script PATH" in err[0], err
    assert E.main(["--ckpt", run, "--eval_size", "5", "--no_progress", "--script", script]) == 0
    assert f"code {script}," in capsys.readouterr().err


def test_checkpoints_of_other_scripts_get_one_line_naming_the_script_and_its_reader(forks, tmp_path, capsys):
    weights = os.path.join(forks[1]["topk"][1], "checkpoint", "model.safetensors")
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
    script); a --compare_ckpts run by the script it records (the SigLIP fork beside the top-8
    one: il_clip.py would refuse its logit_bias); the codebook analyses use the fork's top-8 head
    (every image on exactly 8 codes, which sparsemax does not give)."""
    E2, runs = forks
    script, run = runs["topk"]
    args = E2.get_args(["--ckpt", run, "--plot_dir", str(tmp_path), "--probe_steps", "2", "--probe_eval_every", "1",
                        "--probe_eval_size", "8", "--probe_batch", "4", "--viz_images", "16", "--no_progress",
                        "--compare_ckpts", runs["siglip"][1]])
    model, tok, config = E2.load_checkpoint(run, args, args.script)
    assert E2.script_of(model).__file__ == script
    snap = tmp_path / "gen1"
    shutil.copytree(os.path.join(run, "checkpoint"), snap)
    cfg = lifecycle.read_json(str(snap / "config.json"))
    del cfg["script"]
    write_config(str(snap), cfg)
    assert type(E2.load_snapshot(str(snap), model, run, args)) is type(model)
    assert type(E2.fresh_language_agent(model, 7)) is type(model)
    r = E2.bench_codebook(args, model, tok, config)
    assert r["active_codes"] >= 8
    support = E2.code_support(model, tok, n=16)["image"]
    assert support["codes_median"] == 8 and support["codes_mean"] == 8
    r = E2.bench_easy_to_learn(args, model, tok, config)
    assert set(r) >= {"topk", "siglip"} and [c["step"] for c in r["siglip"]["curve"]] == [0, 1, 2]


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


def test_results_over_seeds_group_a_forks_runs_apart(forks, tmp_path, capsys):
    """summarize_runs: a fork's runs are a group of their own, paired by seed with the original's."""
    _, runs = forks
    for name, run in (("base", runs["topk"][1]), ("fork", runs["topk"][1])):
        shutil.copytree(run, tmp_path / name, ignore=shutil.ignore_patterns("checkpoint*", "gen*"))
    cfg = lifecycle.read_json(str(tmp_path / "base" / "config.json"))
    lifecycle.save_json(str(tmp_path / "base" / "config.json"), {**cfg, "script": lifecycle.script_record(
        os.path.join(ROOT, "il_clip.py"))})
    assert [E.shapes_run(str(tmp_path / n))[0] for n in ("base", "fork")] == ["codebook", "codebook il_clip_topk.py"]
    groups = E.summarize_runs(str(tmp_path), baseline="codebook")
    assert set(groups) == {"codebook", "codebook il_clip_topk.py"}
    assert "codebook il_clip_topk.py" in capsys.readouterr().out
