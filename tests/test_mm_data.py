"""mm_learngene.py on real data layouts: ImageNet-style folders, a Karpathy JSON whose images
sit under a separate root, img2dataset shards without count files; whole-split evaluation
and its opt-in subsamples; Table 4's ablations at initialisation; the activation data."""
import argparse
import io
import json
import math
import os
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

import data
import lifecycle
import eval_compositional as E
import mm_learngene as M
from test_mm_learngene import EXTRACT, expect_error, extracted, hand_layer, randomise, small_cfg, teacher  # noqa: F401


def jpeg(colour, size=20):
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, "JPEG")
    return buf.getvalue()


def test_stratified_subsample():
    labels = [0] * 50 + [1] * 30 + [2] * 20        # class-sorted, like a folder listing
    pick = M.stratified_subsample(labels, 10, seed=0)
    assert len(pick) == 10 == len(set(pick)) and pick == sorted(pick)
    assert [sum(labels[i] == c for i in pick) for c in range(3)] == [5, 3, 2]
    assert pick == M.stratified_subsample(labels, 10, seed=0) != M.stratified_subsample(labels, 10, seed=1)
    # largest remainder: 7 of (50, 30, 20) -> quotas 3.5, 2.1, 1.4 -> 4, 2, 1
    pick = M.stratified_subsample(labels, 7, seed=0)
    assert [sum(labels[i] == c for i in pick) for c in range(3)] == [4, 2, 1]
    assert M.stratified_subsample(labels, 500, 0) == list(range(100))


def test_shapes_class_label_matches_the_generator():
    assert all(M.shapes_class_label("test", i, 0) == data.shapes_classification("test", i, 0, 16)[1] for i in range(20))


def make_imagefolder(root, eval_name="val"):
    """ImageNet layout: train/ has 3 classes, the eval split lacks 'ant' (indices must still come
    from train/) and holds one corrupt JPEG in 13 (skipped and counted, not a traceback)."""
    colours = {"ant": "red", "bee": "green", "cat": "blue"}
    for split, classes, n in (("train", ["ant", "bee", "cat"], 4), (eval_name, ["bee", "cat"], 6)):
        for c in classes:
            os.makedirs(os.path.join(root, split, c))
            for i in range(n):
                with open(os.path.join(root, split, c, f"{i}.JPEG"), "wb") as f:
                    f.write(jpeg(colours[c]))
    with open(os.path.join(root, eval_name, "cat", "bad.jpg"), "wb") as f:
        f.write(b"\xff\xd8 not a jpeg")


def cls_args(root, **kw):
    base = dict(data=str(root), eval_split="auto", train_size=None, eval_size=None, seed=0, batch_size=4,
                num_workers=0)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("eval_name", ["val", "test"])
def test_imagefolder_train_val_and_train_test(tmp_path, eval_name):
    make_imagefolder(tmp_path, eval_name)
    train, test, classes, info = M.classification_data(cls_args(tmp_path), 16, 0, 1)
    assert classes == ["ant", "bee", "cat"] and info["eval_data"].endswith(eval_name)
    labels = [y for b in test for y in b["label"].tolist()]
    assert sorted(labels) == [1] * 6 + [2] * 6 and test.skipped == 1    # bee = 1, cat = 2 as in train/
    clf = M.Classifier(M.VisionTransformer(M.ModelConfig(image_size=16, patch_size=8, vision_width=16, vision_layers=1,
                                                         vision_heads=2, text_layers=0)), 3)
    r = M.eval_classification(clf, test, "cpu", 3)
    assert r["n_images"] == 12 and r["n_classes_scored"] == 2 and r["n_classes"] == 3 and r["eval_skipped"] == 1
    assert train.num_samples == 12


def test_imagefolder_flat_and_unknown_class_are_errors(tmp_path):
    make_imagefolder(tmp_path / "tree")
    with pytest.raises(M.ConfigError, match="flat folder"):
        M.classification_data(cls_args(tmp_path / "tree" / "train"), 16, 0, 1)
    os.makedirs(tmp_path / "tree" / "val" / "dog")
    with open(tmp_path / "tree" / "val" / "dog" / "0.jpg", "wb") as f:
        f.write(jpeg("white"))
    with pytest.raises(M.ConfigError, match="'dog' is not in the training folder"):
        M.classification_data(cls_args(tmp_path / "tree"), 16, 0, 1)


def test_shapes_classification_whole_split_and_stratified_subsample():
    train, test, classes, info = M.classification_data(cls_args("shapes", batch_size=8), 16, 0, 1)
    assert test.num_samples == 1000 and info["eval_subset"] == "whole split"
    train, test, _, info = M.classification_data(cls_args("shapes", eval_size=60, train_size=24, batch_size=8),
                                                 16, 0, 1)
    labels = [y for b in test for y in b["label"].tolist()]
    assert len(labels) == 60 and len(set(labels)) == 6 and "stratified" in info["eval_subset"]
    assert train.num_samples == 24


def make_karpathy(tmp_path, n_test=6):
    """Flickr30k layout: no 'filepath', images under a root apart from the JSON."""
    images = []
    os.makedirs(tmp_path / "flickr_images")
    for i in range(n_test + 4):
        name = f"{1000 + i}.jpg"
        with open(tmp_path / "flickr_images" / name, "wb") as f:
            f.write(jpeg((20 * i, 100, 200 - 10 * i)))
        images.append({"filename": name, "imgid": i, "split": "test" if i < n_test else "train",
                       "sentences": [{"raw": f"photo {i} caption {j}.", "tokens": []} for j in range(5)]})
    (tmp_path / "ann").mkdir()
    path = tmp_path / "ann" / "dataset_flickr30k.json"
    path.write_text(json.dumps({"images": images, "dataset": "flickr30k"}))
    return str(path)


def test_karpathy_image_root_and_retrieval_counted_in_images(tmp_path):
    spec = make_karpathy(tmp_path)
    tok = data.build_tokenizer(captions=[f"photo {i} caption {j}" for i in range(10) for j in range(5)], vocab_size=300,
                               context_length=16)
    a = argparse.Namespace(data=spec, eval_split="auto", eval_size=None, seed=0,
                           image_root=str(tmp_path / "flickr_images"), csv_img_key="filepath",
                           csv_caption_key="title", csv_separator=None)
    cfg = M.ModelConfig(embed_dim=8, image_size=16, patch_size=8, vision_width=16, vision_layers=1, vision_heads=2,
                        context_length=16, vocab_size=tok.vocab_size, text_width=16, text_layers=1, text_heads=2,
                        eot_token_id=tok.eot_id)
    model = M.CLIP(cfg)
    r = M.eval_retrieval(model, M.retrieval_loader(a, tok, 16, batch_size=4), "cpu")
    assert (r["n_images"], r["n_texts"], r["eval_skipped"]) == (6, 30, 0)
    a.eval_size = 4                          # 4 IMAGES with all their captions, not 4 captions
    r = M.eval_retrieval(model, M.retrieval_loader(a, tok, 16, batch_size=4), "cpu")
    assert (r["n_images"], r["n_texts"]) == (4, 20)
    a.image_root = None                      # without it every image is missing: the loader says so
    with pytest.raises(data.DataError, match="skipped"):
        M.eval_retrieval(model, M.retrieval_loader(a, tok, 16, batch_size=4), "cpu")


def write_shards(folder, n_shards=2, per=5):
    """img2dataset webdataset output without its _stats.json / sizes.json count files."""
    os.makedirs(folder)
    for s in range(n_shards):
        with tarfile.open(os.path.join(folder, f"{s:05d}.tar"), "w") as tf:
            for i in range(per):
                key = f"{s:05d}{i:04d}"
                for ext, blob in (("jpg", jpeg((40 * i, 80, 120))), ("txt", f"a photo number {i}".encode()),
                                  ("json", b"{}")):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(blob)
                    tf.addfile(info, io.BytesIO(blob))
    return folder


def test_activation_on_shards_without_count_files(tmp_path, extracted, capsys):  # noqa: F811
    shards = write_shards(str(tmp_path / "shards"))
    assert data.resolve_data(shards)["num_samples"] is None and M.count_shard_samples(shards) == 10
    lg = str(extracted / "learngene.safetensors")
    M.main(["expand", "--learngene", lg, "--layers", "2", "--out_dir", str(tmp_path / "d")])
    M.main(["finetune", "--init", str(tmp_path / "d"), "--activate_data", shards, "--activate_frac", "1",
            "--max_steps", "1", "--batch_size", "4", "--eval_size", "8", "--log_interval", "1",
            "--out_dir", str(tmp_path / "ft")])
    res = json.loads((tmp_path / "ft" / "results.json").read_text())
    assert res["activation_samples"] == 10 and res["activation_steps"] == 2 and res["activation_data"] == shards
    assert "counted 10 samples" in capsys.readouterr().out


def test_count_of_a_truncated_shard_is_its_whole_records_before_the_cut(tmp_path):
    shard = os.path.join(write_shards(str(tmp_path / "shards"), n_shards=1, per=6), "00000.tar")
    with tarfile.open(shard) as tf:
        members = tf.getmembers()
    middle = members[len(members) // 2]                     # cut inside a member's bytes, half-way through the shard
    cut = middle.offset_data + middle.size // 2
    ends = {}                                               # key -> where its last member's bytes end
    for m in members:
        key = m.name.split(".")[0]
        ends[key] = max(ends.get(key, 0), m.offset_data + m.size)
    whole = sum(end <= cut for end in ends.values())
    assert 0 < whole < 6
    with open(shard, "r+b") as f:
        f.truncate(cut)
    assert M.count_shard_samples(shard) == whole


def test_activation_data_comes_from_the_learngene_or_is_required(tmp_path, extracted, capsys):  # noqa: F811
    lg = str(extracted / "learngene.safetensors")
    M.main(["expand", "--learngene", lg, "--layers", "2", "--out_dir", str(tmp_path / "d")])
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["extract_data"]["data"] == "shapes"          # what extract ran on
    del cfg["extract_data"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    expect_error(["finetune", "--init", str(tmp_path / "d"), "--data", make_karpathy(tmp_path), "--max_steps", "1"],
                 capsys, "pass --activate_data")


def test_activation_record_travels_and_its_absence_is_one_error(tmp_path, teacher, capsys, monkeypatch):  # noqa: F811
    """Extract with relative --data / --image_root in one folder, fine-tune from another: the
    record holds absolute paths, so the activation finds the data. Without the data, one error
    line says they are the learngene's activation data, where they were, and --activate_data."""
    make_karpathy(tmp_path)
    monkeypatch.chdir(tmp_path)
    M.main(EXTRACT + ["--teacher", str(teacher), "--data", "ann/dataset_flickr30k.json", "--image_root",
                      "flickr_images", "--out_dir", "lg"])
    M.main(["expand", "--learngene", "lg/learngene.safetensors", "--layers", "2", "--out_dir", "d"])
    rec = json.loads((tmp_path / "d" / "config.json").read_text())["extract_data"]
    assert rec["data"] == str(tmp_path / "ann" / "dataset_flickr30k.json")
    assert rec["image_root"] == str(tmp_path / "flickr_images")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    ft = ["finetune", "--init", str(tmp_path / "d"), "--activate_steps", "1", "--max_steps", "1", "--batch_size", "4",
          "--eval_size", "8", "--log_interval", "1", "--warmup", "1", "--out_dir", "ft", "--overwrite"]
    M.main(ft)
    res = json.loads((tmp_path / "elsewhere" / "ft" / "results.json").read_text())
    assert res["activation_data"] == rec["data"] and res["activation_steps"] == 1
    os.rename(tmp_path / "flickr_images", tmp_path / "moved_images")
    expect_error(ft, capsys, "the learngene's activation data are missing")
    os.rename(tmp_path / "ann", tmp_path / "moved_ann")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        M.main(ft)
    err = capsys.readouterr().err
    assert "activation data are missing" in err and rec["data"] in err and "pass --activate_data" in err
    assert str(tmp_path / "lg" / "learngene.safetensors") in err
    M.main(ft[:3] + ["--activate_data", "shapes"] + ft[3:])       # the override needs no record


def table6_data(tmp_path, task, n_train=60):
    """More training samples than Table 6's batch: a Karpathy JSON of n_train images x 5
    captions, or an ImageFolder of 2 x 150 images."""
    if task == "classification":
        for split, n in (("train", 150), ("val", 1)):
            for c in ("ant", "bee"):
                os.makedirs(tmp_path / "cls" / split / c)
                for i in range(n):
                    (tmp_path / "cls" / split / c / f"{i}.jpg").write_bytes(jpeg("red", 8))
        return str(tmp_path / "cls"), []
    (tmp_path / "img").mkdir()
    images = []
    for i in range(n_train + 2):
        (tmp_path / "img" / f"{i}.jpg").write_bytes(jpeg((2 * i, 0, 0), 8))
        images.append({"filename": f"{i}.jpg", "split": "train" if i < n_train else "test",
                       "sentences": [{"raw": f"photo {i} caption {j}"} for j in range(5)]})
    (tmp_path / "kp.json").write_text(json.dumps({"images": images}))
    return str(tmp_path / "kp.json"), ["--image_root", str(tmp_path / "img")]


class Stop(Exception):
    """Raised by the patched schedule once the Table 6 values it received are recorded."""


@pytest.mark.parametrize("task", ["extract", "retrieval", "classification", "caption"])
def test_table6_values_reach_the_optimizer_and_schedule(tmp_path, monkeypatch, capsys, task, teacher):  # noqa: F811
    """Off shapes every Table 6 value is the default of extract and finetune: lr and weight
    decay in the AdamW groups, lr in the schedule, the global batch in the loader, and the
    epochs in the schedule's length (ceil(epochs * samples / batch)); Table 6's warm-up, longer
    than these short runs, is cut to 10% of the run with one note. Stopped at the first step."""
    lr, wd, warmup, batch, epochs = M.TABLE6[task]
    assert (lr, wd, warmup, batch, epochs) == {
        "extract": (1e-3, 0.1, 10_000, 512, 32), "retrieval": (5e-5, 0.01, 10_000, 256, 50),
        "classification": (1e-4, 0.01, 5_000, 256, 500), "caption": (2e-5, 0.01, 5_000, 256, 10)}[task]
    seen = {}
    real_opt, real_phase = M.make_optimizer, M.train_phase

    def make_optimizer(model, lr_, wd_, device):
        opt = real_opt(model, lr_, wd_, device)
        seen["groups"] = [(g["lr"], g["weight_decay"], len(g["params"])) for g in opt.param_groups]
        return opt

    def get_lr(step, max_steps, lr_, warmup_):
        seen["schedule"] = (step, max_steps, lr_, warmup_)
        raise Stop

    def train_phase(model, loss_fn, loader, *args, **kw):
        seen["batch"] = loader.batch_size
        return real_phase(model, loss_fn, loader, *args, **kw)
    monkeypatch.setattr(M, "make_optimizer", make_optimizer)
    monkeypatch.setattr(M, "get_lr", get_lr)
    monkeypatch.setattr(M, "train_phase", train_phase)
    spec, extra = table6_data(tmp_path, task, 110 if task == "extract" else 60)
    samples = 550 if task == "extract" else 300
    cmd = ["extract", "--teacher", str(teacher)] if task == "extract" else \
        ["finetune", "--init", "scratch", "--layers", "1", "--task", task]
    if task == "caption":
        from test_mm_caption import write_released_gpt2
        write_released_gpt2(tmp_path / "gpt2")
        extra += ["--lm", str(tmp_path / "gpt2")]
    with pytest.raises(Stop):
        M.main([*cmd, "--data", spec, "--out_dir", str(tmp_path / "out"), *extra])
    assert seen["batch"] == batch
    steps = math.ceil(epochs * samples / batch)
    assert warmup > steps and seen["schedule"] == (0, steps, lr, steps // 10)
    assert f"the warm-up of {warmup} steps is longer than the run ({steps} steps)" in capsys.readouterr().err
    decayed = [g for g in seen["groups"] if g[1] > 0]
    assert [g[1] for g in decayed] == [wd] and all(g[0] == lr for g in seen["groups"])


def test_shapes_keeps_its_defaults_and_extract_takes_table6():
    """On shapes: Table 6's lr and weight decay; fine-tuning 300 steps, batch 64, warm-up 30 and
    extraction 500 steps, batch 64, warm-up 50 (as before). Off shapes extraction takes Table 6's
    first column; flags given win over the table."""
    def resolved(argv, column):
        a = M.build_parser().parse_args(argv)
        M.table6_defaults(a, column)
        return a.lr, a.wd, a.max_steps, a.batch_size, a.warmup, a.epochs
    assert resolved(["finetune", "--init", "x", "--task", "caption"], "caption") == (2e-5, 0.01, 300, 64, 30, None)
    assert resolved(["extract", "--teacher", "t"], "extract") == (1e-3, 0.1, 500, 64, 50, None)
    assert resolved(["extract", "--teacher", "t", "--data", "cc3m"], "extract") == (1e-3, 0.1, None, 512, 10_000, 32)
    assert resolved(["finetune", "--init", "x", "--data", "kp.json", "--batch_size", "32", "--warmup", "7", "--lr",
                     "1e-3"], "retrieval") == (1e-3, 0.01, None, 32, 7, 50)
    assert resolved(["finetune", "--init", "x", "--epochs", "2"], "retrieval") == (5e-5, 0.01, None, 64, 30, 2)


@pytest.mark.parametrize("part", ["no_mm", "only_mm"])
def test_ablation_at_initialisation_from_one_full_learngene(part):
    """Table 4: descendants of the FULL learngene with a term of Eq. 1-2 left out, the kept
    term at its extracted coefficient; the rest of the descendant equals the full one."""
    aux = randomise(M.AuxCLIP(small_cfg(layers=4))).eval()
    lg_sd = aux.state_dict()
    full, _ = M.descendant_state(aux, 3, "clip")
    abl, _ = M.descendant_state(aux, 3, "clip", part=part)
    for tower, prefix in (("visual", "visual.transformer.resblocks."), ("text", "transformer.resblocks.")):
        for i, k in enumerate(M.expand_order(3, 2)):
            want = hand_layer(lg_sd, tower, k % 2, k, part)
            for n in M.LINEAR_NAMES:
                torch.testing.assert_close(abl[f"{prefix}{i}.{n}"], want[n], rtol=0, atol=1e-6)
                assert not torch.equal(abl[f"{prefix}{i}.{n}"], full[f"{prefix}{i}.{n}"])
    for k in full:
        if ".resblocks." not in k or k.rsplit(".", 2)[-2].startswith("ln_"):
            assert torch.equal(abl[k], full[k]), k


def test_expand_part_cli_and_refusals(tmp_path, extracted, capsys):  # noqa: F811
    lg = str(extracted / "learngene.safetensors")
    M.main(["expand", "--learngene", lg, "--layers", "2", "--part", "only_mm", "--out_dir", str(tmp_path / "o")])
    assert json.loads((tmp_path / "o" / "config.json").read_text())["part"] == "only_mm"
    expect_error(["expand", "--learngene", lg, "--layers", "2", "--modality", "text"], capsys, "text-only")


def test_retrieval_on_csv_needs_held_out_eval_data(tmp_path):
    (tmp_path / "a.jpg").write_bytes(jpeg("red"))
    (tmp_path / "train.csv").write_text("filepath\ttitle\na.jpg\ta red square\n")
    a = argparse.Namespace(data=str(tmp_path / "train.csv"), eval_data=None, eval_split="auto", eval_size=None, seed=0,
                           image_root=None, csv_img_key="filepath", csv_caption_key="title", csv_separator=None)
    with pytest.raises(M.ConfigError, match="pass --eval_data"):
        M.retrieval_loader(a, None, 16)
    a.eval_data = str(tmp_path / "train.csv")
    assert M.retrieval_loader(a, None, 16).num_samples == 1


def test_finetune_classification_two_ranks_equal_one_process(tmp_path, extracted):  # noqa: F811
    """torchrun with 2 gloo ranks (batch 8 = 2 x 4, the data loader shards by rank) ends with the
    single process's weights and the same whole-split score."""
    from test_mm_learngene import run_cli
    from safetensors.torch import load_file
    lg = str(extracted / "learngene.safetensors")
    M.main(["expand", "--learngene", lg, "--layers", "2", "--modality", "vision", "--out_dir", str(tmp_path / "v")])
    args = ["finetune", "--init", str(tmp_path / "v"), "--task", "classification", "--max_steps", "3",
            "--batch_size", "8", "--train_size", "48", "--eval_size", "30", "--log_interval", "1", "--dtype", "fp32"]
    run_cli(args + ["--out_dir", str(tmp_path / "one")])
    run_cli(args + ["--out_dir", str(tmp_path / "two")], nproc=2)
    a, b = (load_file(str(tmp_path / r / "model.safetensors")) for r in ("one", "two"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    ra, rb = (json.loads((tmp_path / r / "results.json").read_text()) for r in ("one", "two"))
    assert ra["n_images"] == rb["n_images"] == 30 and ra["top1"] == rb["top1"]


def test_scratch_tokenizer_reads_a_csv_with_renamed_columns(tmp_path):
    """finetune --init scratch trains its BPE on --data's captions, read with the --csv_* flags."""
    (tmp_path / "train.csv").write_text("img,cap\na.jpg,A zebra grazes near a fence.\n")
    a = argparse.Namespace(init="scratch", like=None, model="shapes", modality="clip", task="retrieval",
                           data=str(tmp_path / "train.csv"), image_root=None, csv_img_key="img", csv_caption_key="cap",
                           csv_separator=None, layers=1, image_size=32, seed=0)
    model, tok, cfg, modality, kind, _ = M.load_init(a)
    assert kind == "scratch" and tok.decode(tok("a zebra grazes near a fence.")[0]) == "a zebra grazes near a fence."


def test_report_seeds_pairs_each_setting_with_mmlg_of_its_size(tmp_path, capsys):
    """report --seeds: one group per (init, part, layers, task), the caption baselines as groups of
    their own, scores as fractions, and each group's paired difference against MM-LG at the same
    size and task (computed here by hand for w/o MM and the nearest-neighbour caption)."""
    cap = {"mmlg": (20.0, 22.0), "tleg": (19.0, 23.0)}
    for seed in (0, 1, 2):
        for part, r1 in (("both", 15.0 + seed), ("no_mm", 8.0 + 2 * seed)):
            d = tmp_path / f"ret_{part}_s{seed}"
            os.makedirs(d)
            lifecycle.save_json(str(d / "results.json"), {"kind": "mmlg", "part": part, "layers": 6, "task": "retrieval",
                                                     "seed": seed, "i2t_r1": r1, "t2i_r1": r1 - 1})
        for kind, (b4, nearest) in cap.items():
            d = tmp_path / f"cap_{kind}_s{seed}"
            os.makedirs(d)
            lifecycle.save_json(str(d / "results.json"), {
                "kind": kind, "part": "both", "layers": 6, "task": "caption", "seed": seed,
                "bleu4": b4 + seed, "cider": 50.0, "rouge_l": 40.0,
                "baselines": {"nearest": {"bleu4": nearest, "cider": 120.0 + seed, "rouge_l": 48.0},
                              "pool_images": 1000}})
    M.main(["report", "--seeds", str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    row = next(ln for ln in out if ln.startswith("| mmlg no_mm 6 retrieval - mmlg both 6 retrieval (3) |"))
    d = np.array([8.0 - 15.0, 10.0 - 16.0, 12.0 - 17.0]) / 100
    assert row.split(" | ")[1] == f"{100 * d.mean():+.1f} ± {100 * lifecycle.T975[1] * d.std(ddof=1) / np.sqrt(3):.1f}*"
    row = next(ln for ln in out if ln.startswith("| nearest caption (mmlg) 6 - mmlg both 6 caption (3) |"))
    d = np.array([70.0, 71.0, 72.0]) / 100            # cider: (120 + seed) - 50
    assert row.split(" | ")[2] == f"{100 * d.mean():+.1f} ± {100 * lifecycle.T975[1] * d.std(ddof=1) / np.sqrt(3):.1f}*"
    assert any(ln.startswith("| tleg both 6 caption - mmlg both 6 caption (3) |") for ln in out)


def test_report_seeds_names_a_mapper_by_what_it_reads(tmp_path, capsys):
    """A caption fine-tune whose mapper reads the grid or the oracle's scene is its own group
    ("mmlg+grid ..."), so ClipCap's embedding, the grid and the oracle pair by seed in one folder."""
    for seed in (0, 1, 2):
        for inputs, truth in (("embed", 4.0), ("grid", 7.0 + seed), ("scene", 40.0)):
            d = tmp_path / f"{inputs}_s{seed}"
            os.makedirs(d)
            lifecycle.save_json(str(d / "results.json"), {
                "kind": "mmlg", "part": "both", "layers": 6, "task": "caption", "seed": seed,
                "caption_input": inputs, "bleu4": 20.0, "truth_rate": truth, "repeated_object_rate": 1.0,
                "baselines": {"nearest": {"bleu4": 21.0, "truth_rate": 4.5}, "pool_images": 1000}})
    M.main(["report", "--seeds", str(tmp_path), "--baseline", "mmlg+grid both 6 caption"])
    out = capsys.readouterr().out.splitlines()
    header = next(ln for ln in out if ln.startswith("| paired difference"))
    col = header.split(" | ").index("truth_rate")
    row = next(ln for ln in out if ln.startswith("| mmlg both 6 caption - mmlg+grid both 6 caption (3) |"))
    d = np.array([4.0 - 7.0, 4.0 - 8.0, 4.0 - 9.0]) / 100
    assert row.split(" | ")[col] == f"{100 * d.mean():+.1f} ± {100 * lifecycle.T975[1] * d.std(ddof=1) / np.sqrt(3):.1f}*"
    assert any(ln.startswith("| mmlg+scene both 6 caption - mmlg+grid both 6 caption (3) |") for ln in out)
    assert any(ln.startswith("| nearest caption (mmlg+grid) 6 - mmlg+grid both 6 caption (3) |") for ln in out)


def test_finetune_caption_on_the_grid_two_ranks_equal_one_process(tmp_path, extracted):  # noqa: F811
    """--caption_input grid under torchrun with 2 gloo ranks (the image keys travel with the batch
    through DDP's forward) ends with the single process's mapper and the same captions."""
    from test_mm_learngene import run_cli
    from test_mm_caption import write_released_gpt2
    from safetensors.torch import load_file
    write_released_gpt2(tmp_path / "gpt2", vocab_text=data.shapes_captions(200))
    M.main(["expand", "--learngene", str(extracted / "learngene.safetensors"), "--layers", "2",
            "--out_dir", str(tmp_path / "d")])
    args = ["finetune", "--init", str(tmp_path / "d"), "--task", "caption", "--caption_input", "grid",
            "--lm", str(tmp_path / "gpt2"), "--activate_frac", "0", "--data", "shapes:train_size=48",
            "--max_steps", "3", "--batch_size", "8", "--eval_size", "12", "--log_interval", "1", "--dtype", "fp32"]
    run_cli(args + ["--out_dir", str(tmp_path / "one")])
    run_cli(args + ["--out_dir", str(tmp_path / "two")], nproc=2)
    a, b = (load_file(str(tmp_path / r / "model.safetensors")) for r in ("one", "two"))
    assert a.keys() == b.keys() and any(k.startswith("mapper.") for k in a)
    for k in a:     # Adam's steps on near-zero gradients carry the ranks' summation order
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=2e-4)
    ca, cb = (json.loads((tmp_path / r / "captions.json").read_text()) for r in ("one", "two"))
    assert len(ca) == 12 and ca == cb
    assert json.loads((tmp_path / "one" / "results.json").read_text())["caption_input"] == "grid"
