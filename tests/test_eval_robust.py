"""eval_compositional.py on hostile and damaged inputs: one bad benchmark (any exception) is its
ERROR row and the others finish; label/image counts that disagree are an error; partial reads
are counted in n_skipped with their reasons; readers keep memory bounded (lengths checked
against the file and a cap before anything is allocated); a reader's unexpected exception is one
line naming the file."""
import io
import json
import os
import pickle
import struct
import zipfile
import zlib

import numpy as np
import pytest
import torch

import data
import eval_compositional as E
from test_eval_compositional import BLUE, RED, ColourModel, WordTokenizer, args, emb, solid  # noqa: F401 (emb: fixture)
from test_eval_zeroshot import cifar_python_batch, mat_element, mat_v5, rgb_stack, tf_example, tfrecord


def cifar10_bin(root, labels):
    os.makedirs(root)
    (root / "test_batch.bin").write_bytes(b"".join(bytes([y]) + bytes(3072) for y in labels))


def test_one_bad_benchmark_is_its_error_row_and_the_others_finish(tmp_path, monkeypatch, capsys):
    """A crash inside a scorer (here shapes), a hostile file (a TFRecord whose length field says
    2**60) and unreadable text (a binary test.txt) each become their own ERROR row, with the reason
    in the markdown table; CIFAR-10 is scored; exit status 2."""
    cifar10_bin(tmp_path / "cifar10" / "cifar-10-batches-bin", [0, 9])
    os.makedirs(tmp_path / "dmlab")
    (tmp_path / "dmlab" / "dmlab-test.tfrecord-00000-of-00001").write_bytes(struct.pack("<QI", 2 ** 60, 0) + bytes(64))
    os.makedirs(tmp_path / "pets" / "annotations"), os.makedirs(tmp_path / "pets" / "images")
    (tmp_path / "pets" / "annotations" / "test.txt").write_bytes(b"\xff\xfe\x00garbage")
    monkeypatch.setattr(E, "load_checkpoint",
                        lambda path, a, script=None: (ColourModel(), WordTokenizer(), {"image_size": 16}))
    monkeypatch.setattr(E, "bench_shapes", lambda a, emb: 1 / 0)
    out = tmp_path / "r.json"
    code = E.main(["--init", "w.pt", "--benchmarks", "shapes,zeroshot", "--no_progress", "--out", str(out)]
                  + [f"--zeroshot={k}={tmp_path / k}" for k in ("cifar10", "dmlab", "pets")])
    std = capsys.readouterr()
    assert code == 2
    blob = json.loads(out.read_text())
    assert set(blob["results"]) == {"zeroshot/cifar10"} and blob["results"]["zeroshot/cifar10"]["n_scored"] == 2
    assert "| shapes | ERROR | ZeroDivisionError: division by zero | | |" in std.out
    tf = tmp_path / "dmlab" / "dmlab-test.tfrecord-00000-of-00001"
    assert f"| zeroshot/dmlab | ERROR | {tf}: record at byte 0 says {2 ** 60} bytes" in std.out
    assert (f"| zeroshot/pets | ERROR | {tmp_path / 'pets' / 'annotations' / 'test.txt'}: unreadable "
            "(UnicodeDecodeError" in std.out)
    assert all(f"error: {b}:" in std.err for b in ("shapes", "zeroshot/dmlab", "zeroshot/pets"))


def test_cifar_labels_and_images_must_agree_and_shapes_bound_the_arrays(tmp_path):
    root = tmp_path / "cifar-10-batches-py"
    os.makedirs(root)
    cifar_python_batch(root / "test_batch", rgb_stack(2, 32), [0, 1, 2], b"labels")
    with pytest.raises(data.DataError, match="test_batch: 3 labels for 2 images"):
        E.read_cifar(str(tmp_path), 10)
    # nested lists sharing one memoised inner list would blow up in np.asarray: refused unbuilt
    inner = list(range(1000))
    cifar_python_batch(root / "test_batch", rgb_stack(2, 32), [inner, inner], b"labels")
    with pytest.raises(data.DataError, match="not N x 3072 uint8 pixels .* with N integer labels"):
        E.read_cifar(str(tmp_path), 10)
    batch = {"data": [[0] * 3072] * 2, "labels": [0, 1]}     # pixels as lists: not the release's array
    (root / "test_batch").write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(data.DataError, match="not N x 3072 uint8 pixels"):
        E.read_cifar(str(tmp_path), 10)


def test_tfrecord_length_beyond_the_file_or_the_cap(tmp_path, monkeypatch):
    path = tmp_path / "dmlab-test.tfrecord-00000-of-00001"
    path.write_bytes(struct.pack("<QI", 2 ** 60, 0) + bytes(16))
    with pytest.raises(data.DataError, match=f"{path}: record at byte 0 says {2 ** 60} bytes"):
        list(E.tfrecords(str(path)))
    good = tfrecord([tf_example({"image": b"x" * 5000, "label": 1})])
    path.write_bytes(good)
    assert len(list(E.tfrecords(str(path)))) == 1
    monkeypatch.setattr(E, "MAX_BLOB", 4096)      # the stated cap, below this record's length
    with pytest.raises(data.DataError, match="4096-byte cap"):
        list(E.tfrecords(str(path)))
    # a field whose length runs past its message: not located outside the record
    with pytest.raises(ValueError, match="runs past its message"):
        E.protobuf_fields(b"\x0a\x7f" + bytes(10), 0, 12)


def test_mat_sizes_and_compressed_elements_under_a_cap(tmp_path, monkeypatch):
    path = tmp_path / "imagelabels.mat"
    header = b"MATLAB 5.0 MAT-file".ljust(116) + bytes(8) + struct.pack("<H", 0x0100) + b"IM"
    path.write_bytes(header + struct.pack("<II", 14, 2 ** 31) + bytes(24))      # an element larger than the file
    with pytest.raises(data.DataError, match=f"{path}: malformed MATLAB v5 file .*runs past the end"):
        E.mat_v5_arrays(str(path))
    mat_v5(path, {"labels": np.arange(20000)}, compress=True)                   # 160 kB inflated
    assert E.mat_v5_arrays(str(path))["labels"].ravel().tolist() == list(range(20000))
    monkeypatch.setattr(E, "MAX_BLOB", 1 << 16)
    with pytest.raises(data.DataError, match="inflates past the 65536-byte cap"):
        E.mat_v5_arrays(str(path))
    bomb = zlib.compress(bytes(1 << 24), 9)                                     # 16 MiB of zeros in 16 kB
    assert len(bomb) < 1 << 16
    with pytest.raises(ValueError, match="65536-byte cap"):
        E.inflate(bomb)
    mat_v5(path, {"labels": np.arange(20000)})                                  # a file over the cap
    with pytest.raises(data.DataError, match="over the 65536-byte cap"):
        E.mat_v5_arrays(str(path))


def test_zip_member_sizes_beyond_the_file_or_the_cap(tmp_path, monkeypatch):
    path = tmp_path / "images.zip"
    png = io.BytesIO()
    from PIL import Image
    Image.new("RGB", (8, 8), RED).save(png, format="PNG")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("images/ex_0_img_0.png", png.getvalue())
    ref = E.ImageRef("k", path=str(path), member="images/ex_0_img_0.png")
    assert ref.open().size == (8, 8)
    blob = bytearray(path.read_bytes())
    cd = blob.index(b"PK\x01\x02")                                     # central directory entry
    blob[cd + 20:cd + 28] = struct.pack("<II", 2 ** 31, 2 ** 31)       # compressed / uncompressed sizes
    path.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="declares 2147483648 bytes: over the cap or the file"):
        E.ImageRef("k", path=str(path), member="images/ex_0_img_0.png").open()


def test_partial_reads_are_counted_with_their_reason(tmp_path, emb):
    """Pets: a malformed test.txt line and an image that is not there are both in n_skipped, each
    with its reason; the mean covers what was scored."""
    root = tmp_path / "oxford-iiit-pet"
    solid(root / "images" / "Abyssinian_1.jpg", RED)
    os.makedirs(root / "annotations")
    (root / "annotations" / "test.txt").write_text("Abyssinian_1 1 1 1\nnot-a-row\nBengal_2 6 1 6\n")
    a = args(zeroshot_sets={"pets": str(tmp_path)})
    r = E.bench_zeroshot_set("pets")(a, emb)
    assert r["n_scored"] == 1 and r["n_skipped"] == 2
    why = r["skipped_because"]
    assert why[0] == f"{root / 'annotations' / 'test.txt'}:2: malformed line"
    assert why[1].startswith(f"{root / 'images' / 'Bengal_2.jpg'}: FileNotFoundError")


def test_a_readers_unexpected_exception_is_one_line_naming_the_file(tmp_path, monkeypatch):
    deep = tmp_path / "add_obj.json"
    deep.write_text("[" * 100000 + "]" * 100000)            # RecursionError inside the JSON decoder
    with pytest.raises(data.DataError, match=f"^{deep}: .*RecursionError"):
        E.json_rows(str(deep))
    food = tmp_path / "food-101"
    os.makedirs(food / "images"), os.makedirs(food / "meta")
    (food / "meta" / "test.json").write_text('{"apple_pie": 5}')    # TypeError: an int is not a list
    with pytest.raises(data.DataError, match=f"^{tmp_path}: unreadable \\(TypeError"):
        E.names_file(E.read_food101)(str(tmp_path))
    os.makedirs(tmp_path / "stl10_binary")
    for f in ("test_X.bin", "test_y.bin"):
        (tmp_path / "stl10_binary" / f).write_bytes(bytes(8))

    def no_memory(*a, **kw):
        raise MemoryError()
    monkeypatch.setattr(E.np, "fromfile", no_memory)
    with pytest.raises(data.DataError, match=f"^{tmp_path}: unreadable \\(MemoryError"):
        E.names_file(E.read_stl10)(str(tmp_path))


def test_uint8_loader_images_reach_the_model_normalised():
    """The analyses' images go through data.normalize_images: a uint8 batch and its normalised
    float twin give the same code scores and the same PIL picture."""
    x = torch.from_numpy(rgb_stack(2, 16).transpose(0, 3, 1, 2).copy())
    assert np.array_equal(np.asarray(E.to_pil(x[0])), np.asarray(E.to_pil(data.normalize_images(x)[0])))
    m = ColourModel()
    assert torch.equal(m.encode_image(data.normalize_images(x, "cpu")),
                       m.encode_image(data.normalize_images(
                           x.float().div(255).sub(torch.tensor(data.CLIP_MEAN)[:, None, None])
                           .div(torch.tensor(data.CLIP_STD)[:, None, None]), "cpu")))
