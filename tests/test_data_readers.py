"""Tests of data.py's readers for real data: `make-shapes` round trips through every format,
the streaming shard loader (DDP split, shuffling, exact resume), bad input, presets, `check`."""
import csv
import io
import json
import logging
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

import data
import eval_compositional as E

N_TRAIN, N_TEST, SHARD = 60, 8, 16  # 4 shards: 16, 16, 16, 12


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes_export")
    assert data.main(["make-shapes", "--out_dir", str(out), "--train", str(N_TRAIN), "--test", str(N_TEST),
                      "--shard_size", str(SHARD)]) == 0
    return str(out)


def _pattern(d):
    return os.path.join(d, "shards", "{00000..00003}.tar")


def _read_all(loader):
    batches = list(loader)
    keys = [k for b in batches for k in b["key"]]
    return batches, keys


def _to_tensor(img):
    return data.ToTensor()(img)


# --- round trips -------------------------------------------------------------------------

def test_shards_round_trip_keys_captions_trees_pixels(shapes_dir):
    for spec in (_pattern(shapes_dir), os.path.join(shapes_dir, "shards")):
        loader = data.make_loader(spec, batch_size=7, image_size=64, train=False, drop_last=False)
        assert loader.num_samples == N_TRAIN and len(loader) == N_TRAIN // 7
        batches, keys = _read_all(loader)
        assert keys == [f"{i:09d}" for i in range(N_TRAIN)] and loader.skipped == 0
        images = torch.cat([b["image"] for b in batches])
        captions = [c for b in batches for c in b["caption"]]
        trees = [t for b in batches for t in b["tree"]]
        for i in range(N_TRAIN):
            scene = data.shapes_scene("train", i)
            assert captions[i] == scene.caption and trees[i] == scene.tree
            assert torch.equal(images[i], _to_tensor(scene.image))
    # a single tar; and the PNG bytes themselves decode to the rendered pixels
    single = os.path.join(shapes_dir, "shards", "00003.tar")
    _, keys = _read_all(data.make_loader(single, batch_size=5, train=False, drop_last=False))
    assert keys == [f"{i:09d}" for i in range(48, 60)]
    with tarfile.open(single) as tf:
        png = tf.extractfile("000000050.png").read()
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), np.asarray(data.shapes_scene("train", 50).image))


def test_karpathy_csv_imagefolder_round_trip(shapes_dir):
    kjson = os.path.join(shapes_dir, "karpathy", "dataset_shapes.json")
    for split in ("train", "val", "test"):
        scenes = [data.shapes_scene(split, i) for i in range(N_TEST)]
        for spec in (kjson, os.path.join(shapes_dir, "csv", f"{split}.tsv")):
            b = next(iter(data.make_loader(spec, split=split, batch_size=N_TEST, image_size=64, train=False)))
            assert b["caption"] == [s.caption for s in scenes] and b["tree"] == [s.tree for s in scenes]
            assert torch.equal(b["image"], torch.stack([_to_tensor(s.image) for s in scenes]))
        items = E.karpathy_items(kjson, split=split, with_trees=True)
        assert [(caps, trees) for _, caps, trees in items] == [([s.caption], [s.tree]) for s in scenes]
        assert all(np.array_equal(np.asarray(Image.open(p)), np.asarray(s.image))
                   for (p, _, _), s in zip(items, scenes))
    paths, labels, classes = data.image_folder(os.path.join(shapes_dir, "imagefolder", "test"))
    assert classes == sorted(data.SHAPE_NAMES) and len(paths) == N_TEST
    expect = sorted((data.SHAPE_NAMES[data.shapes_classification("test", i)[1]], i) for i in range(N_TEST))
    assert [(classes[y], int(os.path.basename(p)[:-4])) for p, y in zip(paths, labels)] == expect
    b = next(iter(data.make_loader(os.path.join(shapes_dir, "imagefolder", "test"), batch_size=4, train=False)))
    assert b["label"].tolist() == labels[:4] and b["caption"][0] == classes[labels[0]]


def test_sugarcrepe_and_crepe_files_match_the_benchmark(shapes_dir):
    bench = data.shapes_benchmark(n=N_TEST)
    for cat in data.SHAPES_CATEGORIES:
        rows = json.load(open(os.path.join(shapes_dir, "sugarcrepe", f"{cat}.json")))
        assert list(rows) == [str(i) for i in range(N_TEST)]
        for i, item in enumerate(bench[cat]):
            row = rows[str(i)]
            assert (row["caption"], row["negative_caption"]) == (item["caption"], item["negative_caption"])
            img = Image.open(os.path.join(shapes_dir, "sugarcrepe", "images", row["filename"]))
            assert np.array_equal(np.asarray(img), np.asarray(item["image"]))
    with open(os.path.join(shapes_dir, "crepe", "systematicity.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and set(rows[0]) == {"image_id", "x", "y", "width", "height", "caption", "valid_hard_negs_atom",
                                     "valid_hard_negs_comp"}
    for row in rows:
        item = bench["systematicity"][int(row["image_id"].split("_")[1])]
        negs = json.loads(row["valid_hard_negs_atom"]) + json.loads(row["valid_hard_negs_comp"])
        assert row["caption"] == item["caption"] and sorted(negs) == sorted(item["negatives"])
        assert (row["x"], row["y"], row["width"], row["height"]) == ("0", "0", "64", "64")
        assert os.path.exists(os.path.join(shapes_dir, "crepe", "images", row["image_id"] + ".png"))
    manifest = json.load(open(os.path.join(shapes_dir, "manifest.json")))
    assert manifest["shards"]["samples"] == N_TRAIN and manifest["shards"]["shards"] == 4


def test_captions_for_tokenizer_every_format(shapes_dir):
    train_caps = [data.shapes_scene("train", i).caption for i in range(N_TRAIN)]
    assert data.captions_for_tokenizer(_pattern(shapes_dir)) == train_caps
    assert data.captions_for_tokenizer(_pattern(shapes_dir), max_captions=5) == train_caps[:5]
    kcaps = [data.shapes_scene("train", i).caption for i in range(N_TEST)]
    assert data.captions_for_tokenizer(os.path.join(shapes_dir, "karpathy", "dataset_shapes.json")) == kcaps
    assert data.captions_for_tokenizer(os.path.join(shapes_dir, "csv", "train.tsv")) == kcaps


def test_train_transform_is_random_but_reproducible(shapes_dir):
    spec = os.path.join(shapes_dir, "csv", "test.tsv")
    a = next(iter(data.make_loader(spec, split="test", batch_size=4, image_size=32, train=True, seed=1)))
    b = next(iter(data.make_loader(spec, split="test", batch_size=4, image_size=32, train=True, seed=1)))
    e = next(iter(data.make_loader(spec, split="test", batch_size=4, image_size=32, train=False)))
    assert a["image"].shape == (4, 3, 32, 32) and torch.equal(a["image"], b["image"]) and a["key"] == b["key"]
    by_key = dict(zip(e["key"], e["image"]))
    assert any(not torch.equal(x, by_key[k]) for k, x in zip(a["key"], a["image"]) if k in by_key) or not by_key


# --- the streaming loader ------------------------------------------------------------------

def _epoch_keys(spec, rank, world, workers, epoch, **kw):
    loader = data.make_loader(spec, batch_size=3, rank=rank, world_size=world, num_workers=workers, seed=5,
                              drop_last=False, image_size=16, **kw)
    loader.set_epoch(epoch)
    return _read_all(loader)[1]


def test_two_ranks_two_workers_read_every_sample_once_per_epoch(shapes_dir):
    everything = {f"{i:09d}" for i in range(N_TRAIN)}
    orders = []
    for epoch in (0, 1):
        keys = [_epoch_keys(_pattern(shapes_dir), r, 2, 2, epoch) for r in range(2)]
        allk = keys[0] + keys[1]
        assert len(allk) == N_TRAIN and set(allk) == everything
        orders.append(allk)
    assert orders[0] != orders[1]  # epoch-seeded shard shuffle + shuffle buffer
    # fewer shards than (rank, worker) slots: records are split instead of shards
    single = os.path.join(shapes_dir, "shards", "00000.tar")
    allk = [k for r in range(2) for k in _epoch_keys(single, r, 2, 2, 0)]
    assert sorted(allk) == [f"{i:09d}" for i in range(16)]


def test_resampled_stream_is_endless_and_draws_shards(shapes_dir):
    loader = data.make_loader(_pattern(shapes_dir), batch_size=8, resampled=True, image_size=16, rank=1, world_size=2)
    it = loader.forever()
    keys = [k for _ in range(12) for k in next(it)["key"]]  # more than one epoch's worth for this rank
    assert len(keys) == 96 and loader.epoch >= 1 and set(keys) <= {f"{i:09d}" for i in range(N_TRAIN)}


@pytest.mark.parametrize("workers", [0, 2])
def test_shard_loader_resume_gives_the_next_batch(shapes_dir, workers):
    kw = dict(batch_size=4, num_workers=workers, seed=2, image_size=16, shuffle_buffer=10)
    loader = data.make_loader(_pattern(shapes_dir), **kw)
    it = loader.forever()
    for steps in (5, 14, 17):  # mid-epoch 0, after one worker ran dry, mid-epoch 1 (15 batches per epoch)
        while loader.epoch * 100 + loader.batches_done < (steps // 15) * 100 + steps % 15:
            next(it)
        state = json.loads(json.dumps(loader.state_dict()))
        nxt = next(it)
        again = data.make_loader(_pattern(shapes_dir), **kw)
        again.load_state_dict(state)
        got = next(again.forever())
        assert got["key"] == nxt["key"] and torch.equal(got["image"], nxt["image"])
    assert state["epoch"] == 1


# --- bad input ------------------------------------------------------------------------------

def _png(seed=0):
    buf = io.BytesIO()
    data.shapes_scene("train", seed).image.save(buf, format="PNG")
    return buf.getvalue()


def _jpeg():
    buf = io.BytesIO()
    data.shapes_scene("train", 0).image.save(buf, format="JPEG")
    return buf.getvalue()


def _write_tar(path, members):
    with tarfile.open(path, "w") as tf:
        for name, blob in members:
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tf.addfile(info, io.BytesIO(blob))
    return str(path)


def _good(prefix, n):
    return [m for i in range(n) for m in ((f"{prefix}{i:03d}.png", _png(i)), (f"{prefix}{i:03d}.txt", b"a red circle"))]


@pytest.fixture
def bad_shards(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    _write_tar(d / "a.tar", _good("a", 20) + [
        ("corrupt.jpg", b"\xff\xd8\xff\xe0 this is no jpeg"), ("corrupt.txt", b"a blue square"),
        ("cut.jpg", _jpeg()[:60]), ("cut.txt", b"a cut jpeg"),
        ("nocap.png", _png()),
        ("noimg.txt", b"a caption without an image"),
        ("empty.png", _png()), ("empty.txt", b"  \n")])
    whole = open(_write_tar(tmp_path / "whole.tar", _good("b", 20)), "rb").read()
    (d / "b.tar").write_bytes(whole[: len(whole) // 2])  # truncated mid-stream
    (d / "c.tar").write_bytes(b"")  # empty file
    _write_tar(d / "d.tar", [])  # a tar with no members
    return str(d)


def test_bad_samples_are_skipped_counted_and_logged(bad_shards, caplog):
    loader = data.make_loader(bad_shards, batch_size=4, train=False, drop_last=False, image_size=16,
                              max_skip_fraction=0.5)
    with caplog.at_level(logging.WARNING, logger="data"):
        _, keys = _read_all(loader)
    a_keys = [f"a{i:03d}" for i in range(20)]
    b_keys = [k for k in keys if k.startswith("b")]
    assert keys[:20] == a_keys and 0 < len(b_keys) < 20 and keys == a_keys + b_keys  # nothing else
    assert b_keys == [f"b{i:03d}" for i in range(len(b_keys))]  # the half-read sample is not returned
    assert dict(loader.skip_reasons) == {"undecodable image": 2, "image with no caption": 1, "caption with no image": 1,
                                         "empty caption": 1, "truncated or unreadable tar": 1, "empty tar": 2}
    assert loader.skipped == 8 and loader.good == len(keys)
    assert "corrupt" in caplog.text and "b.tar" in caplog.text
    out = data.check_data(bad_shards)
    assert out["skipped"] == 8 and out["good"] == len(keys) and out["skip_reasons"]["empty tar"] == 2


def _tar_variants(tmp_path):
    """Tars as img2dataset, webdataset and GNU tar write them, and damaged ones: name -> path."""
    members = _good("a", 3) + [("sub/dir/b000.jpg", _jpeg()), ("sub/dir/b000.txt", b"a red square"),
                               ("sub/dir/b000.json", b"{}")]
    long = [("x" * 120 + ".png", _png()), ("x" * 120 + ".txt", b"a long name")]   # a pax header (name > 100 bytes)
    out = {"plain": _write_tar(tmp_path / "plain.tar", members),
           "pax": _write_tar(tmp_path / "pax.tar", members + long)}
    for name, mode, fmt in (("ustar", "w", tarfile.USTAR_FORMAT), ("gnu", "w", tarfile.GNU_FORMAT),
                            ("gz", "w:gz", tarfile.PAX_FORMAT)):
        out[name] = str(tmp_path / f"{name}.tar")
        with tarfile.open(out[name], mode, format=fmt) as tf:
            folder = tarfile.TarInfo("sub/dir")
            folder.type = tarfile.DIRTYPE
            tf.addfile(folder)
            for n, blob in members:
                info = tarfile.TarInfo(n)
                info.size = len(blob)
                tf.addfile(info, io.BytesIO(blob))
            if name == "gnu":   # a hard link: left to tarfile
                link = tarfile.TarInfo("sub/dir/c000.png")
                link.type, link.linkname = tarfile.LNKTYPE, "a000.png"
                tf.addfile(link)
    whole = open(out["plain"], "rb").read()
    for cut in range(0, len(whole), 1500):      # cut anywhere: in a header, in data, in the end marker
        out[f"cut{cut}"] = str(tmp_path / f"cut{cut}.tar")
        open(out[f"cut{cut}"], "wb").write(whole[:cut])
    bad = bytearray(whole)
    with tarfile.open(out["plain"]) as tf:
        bad[tf.getmembers()[4].offset + 3] ^= 1     # a flipped bit in a later header: its checksum fails
    out["badsum"] = str(tmp_path / "badsum.tar")
    open(out["badsum"], "wb").write(bytes(bad))
    return out


def test_the_fast_tar_reader_gives_what_tarfile_gives(tmp_path, monkeypatch):
    tars = _tar_variants(tmp_path)
    read = lambda keep: {name: [dict(r) for r in data.tar_records(p, keep)] for name, p in tars.items()}
    fast, fast_txt = read(None), read({"txt"})
    assert [r["__key__"] for r in fast["plain"]] == ["a000", "a001", "a002", "sub/dir/b000"]
    assert fast["plain"][3]["jpg"] == _jpeg() and fast["plain"][0]["txt"] == b"a red circle"
    assert fast_txt["plain"][0] == {"__key__": "a000", "__shard__": tars["plain"], "png": b"", "txt": b"a red circle"}
    # the reference: tarfile alone (the fast reader refuses every file)
    monkeypatch.setattr(data, "_plain_tar_members", lambda path, want: (_ for _ in ()).throw(data._NotPlainTar()))
    assert read(None) == fast and read({"txt"}) == fast_txt
    monkeypatch.undo()
    # which files the fast reader reads itself, and which it leaves to tarfile (before giving any member)
    def fast_reads(p):
        try:
            return len(list(data._plain_tar_members(p, lambda n: True)))
        except data._NotPlainTar:
            return None
    assert fast_reads(tars["plain"]) == fast_reads(tars["ustar"]) == 9
    assert fast_reads(tars["pax"]) is fast_reads(tars["gz"]) is fast_reads(tars["gnu"]) is None  # pax, gzip, link
    assert fast_reads(tars["badsum"]) is None and fast_reads(tars["cut1500"]) is None
    assert "__error__" in fast["cut1500"][-1] and "__error__" not in fast["plain"][-1]
    # tarfile stops quietly at a damaged header; the reader says so instead of losing the shard's rest unseen
    assert [r["__key__"] for r in fast["badsum"]] == ["a000", "a001"]
    assert "damaged member header at byte" in fast["badsum"][-1]["__error__"]


def test_too_many_skips_stop_the_run(bad_shards):
    loader = data.make_loader(bad_shards, batch_size=4, train=False, drop_last=False, image_size=16)
    with pytest.raises(data.DataError, match=r"skipped 8 of .*max_skip_fraction=0.1"):
        _read_all(loader)


def test_all_bad_data_never_spins_forever(tmp_path):
    _write_tar(tmp_path / "x.tar", [("k.txt", b"caption only")])
    loader = data.make_loader(str(tmp_path / "x.tar"), batch_size=2, max_skip_fraction=1.0)
    with pytest.raises(data.DataError, match="no batch in a whole epoch"):
        next(loader.forever())


def test_dataset_level_problems_are_one_line_errors(tmp_path, shapes_dir):
    def err(spec, **kw):
        with pytest.raises(data.DataError) as e:
            data.make_loader(spec, **kw)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "no such file" in err(str(tmp_path / "nope.tar"))
    msg = err(os.path.join(shapes_dir, "shards", "{00000..00009}.tar"))
    assert "6 of 10 shards do not exist" in msg and "00004.tar" in msg
    (tmp_path / "k.json").write_text('{"images": [')
    assert "k.json: malformed JSON" in err(str(tmp_path / "k.json"))
    (tmp_path / "k2.json").write_text('{"images": [{"filename": "a.jpg", "split": "val"}]}')
    assert "no images with split 'train'" in err(str(tmp_path / "k2.json"))
    (tmp_path / "c.csv").write_text("path\tcaption\na.jpg\thello\n")
    assert "c.csv: malformed CSV: no column 'filepath'" in err(str(tmp_path / "c.csv"))
    (tmp_path / "bin.csv").write_bytes(b"\xff\xfe\x00garbage")
    assert "bin.csv: malformed CSV" in err(str(tmp_path / "bin.csv"))
    (tmp_path / "empty_dir").mkdir()
    assert "neither .tar shards nor class folders" in err(str(tmp_path / "empty_dir"))
    (tmp_path / "s").mkdir()
    shard = _write_tar(tmp_path / "s" / "00000.tar", _good("a", 2))
    (tmp_path / "s" / "00000_stats.json").write_text("{not json")
    assert "00000_stats.json: malformed JSON" in err(shard)
    (tmp_path / "notes.txt").write_text("x")
    assert "unknown data format" in err(str(tmp_path / "notes.txt"))


def test_csv_sample_level_problems_and_column_names(tmp_path):
    Image.open(io.BytesIO(_png(1))).save(tmp_path / "ok.png")
    (tmp_path / "bad.jpg").write_bytes(b"not a jpeg")
    rows = ["img,text", "ok.png,a red circle", "missing.png,gone", "bad.jpg,corrupt", "ok.png,", "ok.png"]
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    loader = data.make_loader(str(tmp_path / "d.csv"), batch_size=2, train=False, drop_last=False,
                              csv_img_key="img", csv_caption_key="text", max_skip_fraction=1.0)
    _, keys = _read_all(loader)
    assert len(keys) == 1 and loader.skipped == 4
    assert dict(loader.skip_reasons) == {"missing image file": 1, "undecodable image": 1, "empty caption": 1,
                                         "image with no caption": 1}


def test_presets_say_where_they_looked_and_how_to_make_shards(tmp_path, monkeypatch, shapes_dir):
    monkeypatch.setenv("DATA_ROOT", str(tmp_path))
    for name in ("cc3m", "cc12m", "datacomp"):
        with pytest.raises(data.DataError) as e:
            data.resolve_data(name)
        msg = str(e.value)
        assert os.path.join(str(tmp_path), name) in msg and "img2dataset" in msg and "--output_format webdataset" in msg
        assert "\n" not in msg
    os.makedirs(tmp_path / "cc3m")
    os.symlink(os.path.join(shapes_dir, "shards", "00000.tar"), tmp_path / "cc3m" / "00000.tar")
    src = data.resolve_data("cc3m")
    assert src["kind"] == "tar" and len(src["shards"]) == 1


def test_cli_check_and_error_exit(shapes_dir, capsys):
    assert data.main(["check", "--data", os.path.join(shapes_dir, "karpathy", "dataset_shapes.json"),
                      "--split", "val"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["good"] == N_TEST and out["skipped"] == 0 and out["kind"] == "karpathy"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "data.py"), "check", "--data", "/no/such/dir"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == "error: /no/such/dir: no such file or directory"


def test_expand_braces():
    assert data.expand_braces("d/{008..011}.tar") == ["d/008.tar", "d/009.tar", "d/010.tar", "d/011.tar"]
    assert data.expand_braces("{a,b}/{0..1}") == ["a/0", "a/1", "b/0", "b/1"]
    assert data.expand_braces("plain.tar") == ["plain.tar"]


def test_karpathy_several_captions_restval_and_bad_sentences(tmp_path):
    Image.open(io.BytesIO(_png(2))).save(tmp_path / "a.png")
    Image.open(io.BytesIO(_png(3))).save(tmp_path / "b.png")
    images = [{"filename": "a.png", "split": "train", "sentences": [{"raw": "one"}, {"raw": "two", "tree": "(X two)"}]},
              {"filename": "b.png", "split": "restval", "sentences": [{"raw": ""}, {"raw": "three"}]},
              {"filename": "b.png", "split": "train", "sentences": []},
              {"filename": "a.png", "split": "test", "sentences": [{"raw": "four"}]}]
    (tmp_path / "k.json").write_text(json.dumps({"images": images}))
    loader = data.make_loader(str(tmp_path / "k.json"), batch_size=8, train=False, drop_last=False,
                              max_skip_fraction=1.0)
    b = _read_all(loader)[0][0]
    assert (b["caption"] == ["one", "two", "three"] and b["key"] == ["a", "a", "b"]
            and b["tree"] == [None, "(X two)", None])
    assert dict(loader.skip_reasons) == {"empty caption": 1, "image with no caption": 1}
    items = E.karpathy_items(str(tmp_path / "k.json"), split="train")
    assert ([(os.path.basename(p), caps) for p, caps in items]
            == [("a.png", ["one", "two"]), ("b.png", ["three"]), ("b.png", [])])
    assert E.karpathy_items(str(tmp_path / "k.json"), str(tmp_path), "test") == [(str(tmp_path / "a.png"), ["four"])]


class _CaptionLengths:
    """A picklable batch_extra: entries computed from the collated batch and the epoch."""

    def __call__(self, batch, epoch):
        return {"caption_len": torch.tensor([len(c) for c in batch["caption"]]), "epoch": torch.tensor(epoch)}


def test_batch_extra_runs_in_the_shard_workers(shapes_dir):
    loader = data.make_loader(_pattern(shapes_dir), batch_size=7, image_size=64, train=False, drop_last=False,
                              num_workers=2, batch_extra=_CaptionLengths())
    batches, _ = _read_all(loader)
    assert batches and all(b["caption_len"].tolist() == [len(c) for c in b["caption"]] for b in batches)
    again, _ = _read_all(loader)                  # the next epoch: the workers are told which
    assert [int(b["epoch"]) for b in batches] == [0] * len(batches) and again
    assert [int(b["epoch"]) for b in again] == [1] * len(again)


def test_bench_times_the_shard_pipeline_alone(shapes_dir, capsys):
    """bench.py --data on real tar shards: decode + augment + tokenize at the tiny preset's 64 px;
    the first batch (untimed) and the 3 timed ones are read, nothing skipped."""
    import bench
    assert bench.main(["--data", _pattern(shapes_dir), "--batch_size", "8", "--steps", "3", "--untimed", "1",
                       "--num_workers", "0"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"data {_pattern(shapes_dir)}: image 64, batch 8, num_workers 0:")
    assert " 32 samples (" in line and line.endswith("skipped 0")


def test_a_path_outside_the_image_root_is_skipped_and_counted(tmp_path):
    """With --image_root given, `../` out of it, an absolute path elsewhere and a symlink out are
    skipped with their reason (never opened); eval's gallery reader refuses them in one line."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    for folder in (root, outside):
        Image.open(io.BytesIO(_png(2))).save(folder / "a.png")
    os.symlink(outside / "a.png", root / "link.png")
    names = ["a.png", "../outside/a.png", str(outside / "a.png"), "link.png"]
    images = [{"filename": n, "split": "train", "sentences": [{"raw": f"caption {i}"}]} for i, n in enumerate(names)]
    (tmp_path / "k.json").write_text(json.dumps({"images": images}))
    loader = data.make_loader(str(tmp_path / "k.json"), image_root=str(root), batch_size=8, train=False,
                              drop_last=False, max_skip_fraction=1.0)
    b = _read_all(loader)[0][0]
    assert b["caption"] == ["caption 0"] and dict(loader.skip_reasons) == {"image path outside --image_root": 3}
    with pytest.raises(data.DataError, match="outside --image_root"):
        E.karpathy_items(str(tmp_path / "k.json"), str(root), "train")
    # no --image_root: paths are taken against the JSON's folder as given (absolute CSV/JSON paths stay usable)
    assert len(E.karpathy_items(str(tmp_path / "k.json"), None, "train")) == 4
