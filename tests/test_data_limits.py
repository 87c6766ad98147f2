"""data.py on too little or oddly formatted data (issue 16 items 6 and 7): one `error:` line for
a batch larger than the data and for brace patterns that name nothing readable; `data.py check`
exits 2 on no data and counts samples dropped by drop_last apart from skipped ones; brace
expansion (the `braceexpand` package) keeps the shard patterns it documents; the img2dataset
command uses img2dataset's real flags; the CSV flags on `data.py check`; a UTF-8 byte-order mark
in CSV and JSON."""
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from conftest import error_lines
import torch
from PIL import Image

import data
import lifecycle
import eval_compositional as E

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _png(seed=0) -> bytes:
    buf = io.BytesIO()
    data.shapes_scene("train", seed).image.save(buf, format="PNG")
    return buf.getvalue()


def _shard(path, n_good, n_bad=0, stats=True) -> str:
    """n_good image+caption samples then n_bad captions without an image; img2dataset's
    {shard}_stats.json beside it when `stats`."""
    with tarfile.open(path, "w") as tf:
        members = [m for i in range(n_good) for m in ((f"g{i:03d}.png", _png(i)), (f"g{i:03d}.txt", b"a red circle"))]
        members += [(f"z{i:03d}.txt", b"no image") for i in range(n_bad)]
        for name, blob in members:
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tf.addfile(info, io.BytesIO(blob))
    if stats:
        with open(str(path)[:-4] + "_stats.json", "w") as f:
            json.dump({"successes": n_good}, f)
    return str(path)


def _cli(capsys, *args):
    """`python data.py ARGS` in this process (a subprocess costs a torch import): (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = data.main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


# --- brace expansion ---------------------------------------------------------------------

# data.expand_braces is the `braceexpand` package behind a one-line error. These cases pin what
# shard specs rely on (a braceexpand release that changed them fails here): its 0.1.7
# documentation's examples, plus steps, padding, descending ranges and escaped or literal braces.
BRACEEXPAND_CASES = [
    ("item{1..3}", ["item1", "item2", "item3"]),
    ("{a..c}", ["a", "b", "c"]),
    ("index.html{,.backup}", ["index.html", "index.html.backup"]),
    ("python{2.{5..7},3.{2,3}}", ["python2.5", "python2.6", "python2.7", "python3.2", "python3.3"]),
    ("{07..10}", ["07", "08", "09", "10"]),
    ("{a..g..2}", ["a", "c", "e", "g"]),
    ("{4..1}", ["4", "3", "2", "1"]),
    ("{2..-1}", ["2", "1", "0", "-1"]),
    (r"{1\{2,3}", ["1{2", "3"]),
    ("{0..9..3}", ["0", "3", "6", "9"]),
    ("{1..10..-4}", ["1", "5", "9"]),
    ("{10..1..4}", ["10", "6", "2"]),
    ("d/{00008..00011}.tar", ["d/00008.tar", "d/00009.tar", "d/00010.tar", "d/00011.tar"]),
    ("{8..011}", ["008", "009", "010", "011"]),
    ("{-05..5..5}", ["-05", "000", "005"]),
    ("{0..2}", ["0", "1", "2"]),
    ("{x}.tar", ["{x}.tar"]),
    ("{}", ["{}"]),
    ("a{b}c{d,e}", ["a{b}cd", "a{b}ce"]),
    (r"\{a,b\}", ["{a,b}"]),
    (r"x\\{a,b}", ["x\\a", "x\\b"]),
    ("{,}", ["", ""]),
    ("{a,{b,c}d}", ["a", "bd", "cd"]),
    ("{Y..b}", ["Y", "Z", "a", "b"]),
    ("{c..a}", ["c", "b", "a"]),
    ("{e..a..2}", ["e", "c", "a"]),
    ("{b..A}", ["b", "a"] + [chr(c) for c in range(ord("Z"), ord("A") - 1, -1)]),
    ("shard-{a,b}-{1..2}.tar", ["shard-a-1.tar", "shard-a-2.tar", "shard-b-1.tar", "shard-b-2.tar"]),
]


@pytest.mark.parametrize("pattern, expected", BRACEEXPAND_CASES)
def test_expand_braces_as_braceexpand_documents(pattern, expected):
    assert data.expand_braces(pattern) == expected


@pytest.mark.parametrize("pattern", ["d/{0..3.tar", "d/{{0..3}.tar", "{a,{b}"])
def test_unbalanced_braces_are_one_line_errors(pattern):
    with pytest.raises(data.DataError, match="unbalanced braces") as e:
        data.resolve_data(pattern)
    assert "\n" not in str(e.value)


# --- too little data ---------------------------------------------------------------------

def test_batch_larger_than_counted_shards_is_an_error_at_once(tmp_path):
    shard = _shard(tmp_path / "00000.tar", 3)
    with pytest.raises(data.DataError, match=r"3 samples .*fewer than one global batch \(4 x 2 ranks\)"):
        data.make_loader(shard, batch_size=4, world_size=2)


def test_no_shard_at_all_is_an_error():
    with pytest.raises(data.DataError, match="no shard to read"):
        data.ShardLoader([], batch_size=2)


def test_batch_larger_than_uncounted_shards_is_an_error_not_stopiteration(tmp_path):
    """Without _stats.json the size is known only after reading: a training loop's plain
    next(iter(loader)) gets the DataError, not a bare StopIteration."""
    shard = _shard(tmp_path / "00000.tar", 3, n_bad=1, stats=False)
    loader = data.make_loader(shard, batch_size=4, train=False, max_skip_fraction=1.0)
    with pytest.raises(data.DataError) as e:
        next(iter(loader))
    assert str(e.value) == (f"{shard}: rank 0 got no batch in a whole epoch (samples: 0 good, 1 skipped, "
                            f"3 dropped by drop_last; batch 4 x 1 ranks x 1 workers)")


def test_batch_larger_than_a_csv_is_an_error(tmp_path, capsys):
    Image.open(io.BytesIO(_png())).save(tmp_path / "a.png")
    (tmp_path / "d.csv").write_text("filepath,title\na.png,one\na.png,two\n")
    with pytest.raises(data.DataError, match="2 samples, fewer than one global batch"):
        data.make_loader(str(tmp_path / "d.csv"), batch_size=3)
    r = _cli(capsys, "check", "--data", str(tmp_path / "d.csv"), "--batch_size", "3", "--drop_last")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(f"error: {tmp_path / 'd.csv'}: 2 samples")


def test_dropped_samples_are_counted_apart_from_skipped(tmp_path):
    """The skip fraction is over what was read: 1 bad of 2 read is 50%, not "1 of 1 (100%)"."""
    shard = _shard(tmp_path / "s.tar", 1, n_bad=1, stats=False)
    loader = data.make_loader(shard, batch_size=2, train=False, max_skip_fraction=0.4)
    with pytest.raises(data.DataError, match=r"skipped 1 of 2 samples read \(50%; 0 used, 1 dropped by drop_last\)"):
        list(loader)
    shapes = data.make_loader("shapes:train_size=10", batch_size=4)        # map-style: 10 = 2 x 4 + 2
    assert len(list(shapes)) == 2 and (shapes.good, shapes.dropped, shapes.skipped) == (8, 2, 0)
    ranks = [data.make_loader("shapes:train_size=11", batch_size=2, rank=r, world_size=2) for r in (0, 1)]
    assert [len(list(r)) for r in ranks] == [2, 2] and sum(r.dropped for r in ranks) == 3   # 11 = 2 x 2 x 2 + 3
    assert ranks[0].state_dict()["dropped"] == ranks[0].dropped


def test_check_counts_dropped_and_fails_on_no_data(tmp_path, capsys):
    shard = _shard(tmp_path / "00000.tar", 10, n_bad=2)
    r = _cli(capsys, "check", "--data", shard, "--batch_size", "4", "--drop_last")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and (out["good"], out["skipped"], out["dropped"]) == (8, 2, 2)
    bad = _shard(tmp_path / "bad.tar", 0, n_bad=3, stats=False)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "data.py"), "check", "--data", bad], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)   # the real exit code of the command
    out = json.loads(r.stdout)
    assert r.returncode == 2 and (out["good"], out["skipped"]) == (0, 3)
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {bad}: rank 0 got no batch in a whole epoch")
    r = _cli(capsys, "check", "--data", str(tmp_path / "{00000..00001}.tar"))
    assert r.returncode == 2 and "1 of 2 shards do not exist" in r.stderr and "Traceback" not in r.stderr


def test_check_says_one_start_and_one_done_line_and_suggests_a_near_miss(tmp_path, capsys):
    """stdout holds the JSON alone; stderr the start line and the done line with the counts. A --data spec that
    names nothing but is close to a known name (shapes, the presets) gets a 'did you mean', with its options kept."""
    shard = _shard(tmp_path / "00000.tar", 10, n_bad=2)
    r = _cli(capsys, "check", "--data", shard, "--batch_size", "4")
    assert r.returncode == 0 and json.loads(r.stdout)["good"] == 10
    err = r.stderr.splitlines()
    assert err[0] == f"start: data.py check | data {shard} (train)" and len(err) == 2
    assert re.fullmatch(r"done: 10 good, 2 skipped, 0 dropped samples in \d+s \| wrote nothing", err[1]), err
    for spec, near in (("shapse", "shapes"), ("shape:train_size=8", "shapes:train_size=8"), ("cc3n", "cc3m"),
                       ("datacomps", "datacomp"), (str(tmp_path / "nothing.csv"), None)):
        r = _cli(capsys, "check", "--data", spec)
        hint = f" (did you mean {near}?)" if near else ""
        assert r.returncode == 2 and r.stderr == f"error: {spec}: no such file or directory{hint}\n", r.stderr
    with pytest.raises(data.DataError, match=r"^shapse: no such file or directory \(did you mean shapes\?\)$"):
        data.make_loader("shapse")      # what every script's --data meets


def test_make_shapes_names_what_it_wrote(tmp_path, capsys):
    out = str(tmp_path / "sd")
    r = _cli(capsys, "make-shapes", "--out_dir", out, "--train", "3", "--test", "2", "--shard_size", "2")
    assert r.returncode == 0 and json.loads(r.stdout)["shards"]["shards"] == 2
    err = r.stderr.splitlines()
    assert err[0] == f"start: data.py make-shapes | 3 train scenes, 2 per test set | out_dir {out}" and len(err) == 2
    assert re.fullmatch(rf"done: the shapes data in 6 formats in \d+s \| wrote {re.escape(out)}/\{{shards/, "
                        r"sugarcrepe/, crepe/, csv/, karpathy/, imagefolder/, manifest.json\}", err[1]), err


# --- formats -----------------------------------------------------------------------------

def test_csv_and_json_with_a_byte_order_mark(tmp_path):
    Image.open(io.BytesIO(_png())).save(tmp_path / "a.png")
    (tmp_path / "bom.csv").write_bytes("\ufefffilepath\ttitle\na.png\ta red circle\n".encode("utf-8"))
    assert [it.caption for it in data.csv_items(str(tmp_path / "bom.csv"))] == ["a red circle"]
    blob = {"images": [{"filename": "a.png", "split": "test", "sentences": [{"raw": "a red circle"}]}]}
    (tmp_path / "k.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(blob).encode("utf-8"))
    assert E.karpathy_items(str(tmp_path / "k.json"), str(tmp_path)) == [(str(tmp_path / "a.png"), ["a red circle"])]


def test_check_takes_the_csv_flags(tmp_path, capsys):
    Image.open(io.BytesIO(_png())).save(tmp_path / "a.png")
    (tmp_path / "d.csv").write_text("img;text\na.png;one\na.png;two\na.png;\n")
    r = _cli(capsys, "check", "--data", str(tmp_path / "d.csv"), "--csv_img_key", "img", "--csv_caption_key", "text",
             "--csv_separator", ";")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and (out["good"], out["skipped"]) == (2, 1)
    r = _cli(capsys, "check", "--data", str(tmp_path / "d.csv"))
    assert r.returncode == 2 and "--csv_img_key" in r.stderr and len(error_lines(r.stderr)) == 1


# img2dataset.download()'s parameters (img2dataset/main.py, rom1504/img2dataset at 08538ff), which
# its fire CLI takes as --flags; and the values its reader/writer accept for the formats
IMG2DATASET_FLAGS = {
    "url_list", "image_size", "output_folder", "processes_count", "resize_mode", "resize_only_if_bigger",
    "upscale_interpolation", "downscale_interpolation", "encode_quality", "skip_reencode", "output_format",
    "input_format", "url_col", "caption_col", "thread_count", "number_sample_per_shard", "extract_exif",
    "save_additional_columns", "timeout", "enable_wandb", "wandb_project", "oom_shard_count", "compute_md5",
    "distributor", "subjob_size", "retries", "disable_all_reencoding", "incremental_mode", "max_shard_retry"}
ALLOWED_VALUES = {"output_format": {"files", "webdataset", "parquet", "tfrecord", "dummy"},
                  "input_format": {"txt", "txt.gz", "csv", "csv.gz", "tsv", "tsv.gz", "json", "json.gz", "jsonl",
                                   "jsonl.gz", "parquet"},
                  "resize_mode": {"no", "keep_ratio", "keep_ratio_largest", "center_crop", "border"}}


@pytest.mark.parametrize("name", sorted(data.DATA_PRESETS))
def test_img2dataset_command_uses_real_flags(name, tmp_path, monkeypatch):
    monkeypatch.setenv("DATA_ROOT", str(tmp_path))
    with pytest.raises(data.DataError) as e:
        data.resolve_data(name)
    command = str(e.value).split("make them with: ", 1)[1]
    assert command == data.img2dataset_command(name, str(tmp_path / name))
    words = shlex.split(command.split("&& ")[-1])
    assert words[0] == "img2dataset" and len(words) % 2 == 1
    flags = dict(zip(words[1::2], words[2::2]))
    assert all(f.startswith("--") and f[2:] in IMG2DATASET_FLAGS for f in flags), flags
    for flag, allowed in ALLOWED_VALUES.items():
        assert flags[f"--{flag}"] in allowed
    assert flags["--output_format"] == "webdataset" and flags["--output_folder"] == str(tmp_path / name)
    assert int(flags["--processes_count"]) > 0 and int(flags["--thread_count"]) > 0


# --- the loader's arithmetic after the speed work (issue 16 item 8; speed itself is measured
# outside the tests) ------------------------------------------------------------------------

def test_normalisation_equals_the_arithmetic():
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (17, 23, 3), dtype=np.uint8)
    pixels[0, :3] = [[0, 0, 0], [255, 255, 255], [1, 128, 254]]
    u = data.ToTensor()(Image.fromarray(pixels))
    assert u.dtype == torch.uint8 and torch.equal(u, torch.from_numpy(pixels).permute(2, 0, 1))
    x = data.normalize_images(u[None])[0]
    mean = np.asarray(data.CLIP_MEAN, np.float32)[:, None, None]
    std = np.asarray(data.CLIP_STD, np.float32)[:, None, None]
    per_pixel = (pixels.transpose(2, 0, 1).astype(np.float32) / np.float32(255.0) - mean) / std
    assert x.dtype == torch.float32 and x.shape == (3, 17, 23)
    assert torch.equal(x, torch.from_numpy(per_pixel))                  # bit-identical to float32 arithmetic
    closed = (pixels.transpose(2, 0, 1) / 255.0 - np.asarray(data.CLIP_MEAN)[:, None, None]) / np.asarray(
        data.CLIP_STD)[:, None, None]
    assert np.abs(x.numpy() - closed).max() < 1e-6                       # and to float64 within rounding
    gray = data.ToTensor()(Image.fromarray(pixels[..., 0], "L"))
    assert torch.equal(gray, data.ToTensor()(Image.fromarray(pixels[..., 0], "L").convert("RGB")))


def test_collate_stack_equals_torch_stack_with_and_without_workers():
    images = [torch.randn(3, 5, 7) for _ in range(4)]
    assert torch.equal(data._stack_images(images)[0], torch.stack(images)) and data._stack_images(images)[1] is None
    views = [torch.randint(0, 256, (5, 7, 3), dtype=torch.uint8).permute(2, 0, 1) for _ in range(4)]  # as ToTensor's
    stacked, _ = data._stack_images(views)
    assert torch.equal(stacked, torch.stack(views)) and stacked.is_contiguous()
    make = lambda w: data.make_loader("shapes:train_size=12", batch_size=4, image_size=32, num_workers=w)  # noqa: E731
    alone, workers = list(make(0)), list(make(1))
    assert len(alone) == 3 and all(torch.equal(a["image"], b["image"]) for a, b in zip(alone, workers))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # torch.jit itself is deprecated in 2.13
def test_a_torchscript_archive_is_refused_and_converted_only_on_request(tmp_path, capsys):
    """OpenAI's .pt files are TorchScript: read_weights never runs their code (one line naming the
    converter); `data.py convert-weights` is the explicit step, and its safetensors equal the archive."""
    lin = torch.jit.script(torch.nn.Linear(3, 2))
    path = str(tmp_path / "ViT-fake.pt")
    lin.save(path)
    with pytest.raises(data.DataError, match="TorchScript archive.*convert-weights") as e:
        lifecycle.read_weights(path)
    assert "\n" not in str(e.value)
    assert data.main(["convert-weights", path]) == 0
    sd = lifecycle.read_weights(str(tmp_path / "ViT-fake.safetensors"))
    assert set(sd) == {"weight", "bias"} and torch.equal(sd["weight"], lin.weight.detach())


def test_a_huge_caption_is_cut_before_tokenizing(monkeypatch):
    """A 10 MB caption reaches the text cleaning and the tokenizer cut to MAX_CAPTION_CHARS, and
    gives the ids of its head (77 tokens come from far fewer characters)."""
    tok = data.build_tokenizer(captions=["a red circle above a blue square"] * 20, vocab_size=300, context_length=16)
    seen, clean = [], data.clip_clean
    monkeypatch.setattr(data, "clip_clean", lambda t: seen.append(len(t)) or clean(t))
    head = "a red circle above a blue square " * 200
    ids = tok([head + "x" * 10_000_000])
    assert max(seen) == data.MAX_CAPTION_CHARS and torch.equal(ids, tok([head[:data.MAX_CAPTION_CHARS]]))


@pytest.mark.parametrize("image", [{"filename": 7, "split": "test"}, {"filename": "a.png", "filepath": ["x"],
                                                                      "split": "test"}, "a.png"])
def test_a_karpathy_image_entry_of_the_wrong_type_is_one_line(tmp_path, image):
    path = tmp_path / "dataset_x.json"
    path.write_text(json.dumps({"images": [image]}))
    with pytest.raises(data.DataError, match=r"dataset_x.json: malformed Karpathy JSON: images\[0\]"):
        E.karpathy_items(str(path))


def test_a_karpathy_json_nested_too_deep_is_one_line_naming_the_file(tmp_path):
    """100,000 nested brackets: the decoder's RecursionError is the one-line error naming the file, in
    training's reader (data.karpathy_images) and the evaluation's (karpathy_items), not "retrieval: RecursionError"."""
    path = tmp_path / "dataset_deep.json"
    path.write_text("[" * 100000 + "]" * 100000)
    for read in (lambda: data.karpathy_images(str(path), None, "train"), lambda: E.karpathy_items(str(path))):
        with pytest.raises(data.DataError, match=f"^{path}: malformed JSON \\(maximum recursion depth") as e:
            read()
        assert "\n" not in str(e.value)
