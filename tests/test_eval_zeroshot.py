"""The zero-shot suite (IL paper Table 2): each reader on a small fixture written here in its
dataset's released layout, the built-in class names, and the Table 2 row."""
import io
import json
import os
import pickle
import struct
import types
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

import data
import eval_compositional as E
from test_eval_compositional import (  # noqa: F401 (emb: fixture)
    BLUE, GREEN, RED, ColourModel, WordTokenizer, args, emb, solid)


def pixels(ref):
    return np.asarray(ref.open())


def rgb_stack(n, size, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


# ----------------------------------------------------------------------------- CIFAR

class Py2Pickler(pickle._Pickler):
    """Writes bytes as Python 2 `str` (SHORT_BINSTRING / BINSTRING), as cPickle wrote the CIFAR batches."""
    dispatch = pickle._Pickler.dispatch.copy()

    def save_py2_str(self, obj):
        n = len(obj)
        self.write(pickle.SHORT_BINSTRING + bytes([n]) + obj if n < 256
                   else pickle.BINSTRING + struct.pack("<i", n) + obj)
        self.memoize(obj)
    dispatch[bytes] = save_py2_str


def cifar_python_batch(path, images, labels, key):
    batch = {b"batch_label": b"testing batch 1 of 1", key: labels,
             b"data": images.transpose(0, 3, 1, 2).reshape(len(images), 3072), b"filenames": [b"x.png"] * len(labels)}
    buf = io.BytesIO()
    Py2Pickler(buf, protocol=2).dump(batch)
    # the released files name numpy 1's module
    path.write_bytes(buf.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n"))


def test_cifar10_python_batch_through_the_plain_unpickler(tmp_path):
    images, labels = rgb_stack(5, 32), [3, 0, 9, 1, 3]
    os.makedirs(tmp_path / "cifar-10-batches-py")
    cifar_python_batch(tmp_path / "cifar-10-batches-py" / "test_batch", images, labels, b"labels")
    assert b"cnumpy.core.multiarray\n_reconstruct" in (tmp_path / "cifar-10-batches-py" / "test_batch").read_bytes()
    names, items, _ = E.read_cifar(str(tmp_path), 10)
    assert names[3] == "cat" and [y for _, y in items] == labels
    for (ref, _), img in zip(items, images):
        assert np.array_equal(pixels(ref), img)


def test_cifar_pickle_that_would_run_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    os.makedirs(tmp_path / "cifar-10-batches-py")
    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(pickle.dumps({"data": Evil()}, protocol=2))
    with pytest.raises(data.DataError, match="refusing to load (posix|os|nt).system"):
        E.read_cifar(str(tmp_path), 10)


def test_cifar100_binary_version_uses_the_fine_label(tmp_path):
    images, coarse, fine = rgb_stack(4, 32, 1), [1, 2, 3, 4], [0, 55, 99, 30]
    os.makedirs(tmp_path / "cifar-100-binary")
    rows = [bytes([c, f]) + img.transpose(2, 0, 1).tobytes() for c, f, img in zip(coarse, fine, images)]
    (tmp_path / "cifar-100-binary" / "test.bin").write_bytes(b"".join(rows))
    names, items, _ = E.read_cifar(str(tmp_path), 100)
    assert len(names) == 100 and names[1] == "aquarium_fish" and names[99] == "worm"
    assert [y for _, y in items] == fine and np.array_equal(pixels(items[2][0]), images[2])
    (tmp_path / "cifar-100-binary" / "test.bin").write_bytes(b"".join(rows)[:-1])
    with pytest.raises(data.DataError, match="whole number of records"):
        E.read_cifar(str(tmp_path), 100)


# ----------------------------------------------------------------------------- STL-10

def test_stl10_binary_is_column_major(tmp_path):
    images, labels = rgb_stack(3, 96, 2), [1, 10, 4]  # labels 1-10 in the release
    os.makedirs(tmp_path / "stl10_binary")
    # each channel stored column by column (MATLAB order): write [n, c, col, row]
    (tmp_path / "stl10_binary" / "test_X.bin").write_bytes(images.transpose(0, 3, 2, 1).tobytes())
    (tmp_path / "stl10_binary" / "test_y.bin").write_bytes(bytes(labels))
    names, items, _ = E.read_stl10(str(tmp_path))
    assert [y for _, y in items] == [0, 9, 3] and names[9] == "truck"
    for (ref, _), img in zip(items, images):
        assert np.array_equal(pixels(ref), img)


# ----------------------------------------------------------------------------- ImageNet family

def test_imagenet_val_wnid_folders_get_imagenet_names(tmp_path):
    val = tmp_path / "val"
    solid(val / "n01443537" / "ILSVRC2012_val_00000001.JPEG", RED)
    solid(val / "n15075141" / "ILSVRC2012_val_00000002.JPEG", BLUE)
    names, items, note = E.zeroshot_sets()["imagenet1k"].reader(str(tmp_path))
    assert len(names) == 1000 and names[1] == "goldfish" and names[999] == "toilet paper"
    assert [y for _, y in items] == [1, 999] and "2 of 1000" in note


def test_imagenet_a_and_r_heads_are_their_200_classes(tmp_path):
    solid(tmp_path / "imagenet-a" / "n01498041" / "0.jpg", RED)  # stingray: in A and R
    names, items, _ = E.zeroshot_sets()["imagenet-a"].reader(str(tmp_path))
    assert len(names) == 200 and names[0] == "stingray" and items[0][1] == 0
    names_r, _, _ = E.zeroshot_sets()["imagenet-r"].reader(str(tmp_path / "imagenet-a"))
    assert len(names_r) == 200 and names_r[0] == "goldfish"
    solid(tmp_path / "imagenet-a" / "n01440764" / "1.jpg", RED)  # tench: not an ImageNet-A class
    with pytest.raises(data.DataError, match="not among this dataset's 200 WordNet IDs"):
        E.zeroshot_sets()["imagenet-a"].reader(str(tmp_path))


def test_plain_zeroshot_dir_of_wnids_is_mapped_not_prompted_as_ids(tmp_path, capsys):
    assert E.folder_classnames(["n01440764", "n01443537"]) == ["tench", "goldfish"]
    assert E.folder_classnames(["red_car", "blue"]) == ["red car", "blue"]
    assert E.folder_classnames(["n99999999", "cat"]) == ["n99999999", "cat"]
    assert "look like WordNet IDs" in capsys.readouterr().err


# ----------------------------------------------------------------------------- split-list datasets

def test_pets_test_list(tmp_path):
    solid(tmp_path / "oxford-iiit-pet" / "images" / "Abyssinian_201.jpg", RED)
    solid(tmp_path / "oxford-iiit-pet" / "images" / "yorkshire_terrier_9.jpg", BLUE)
    os.makedirs(tmp_path / "oxford-iiit-pet" / "annotations")
    (tmp_path / "oxford-iiit-pet" / "annotations" / "test.txt").write_text(
        "Abyssinian_201 1 1 1\nyorkshire_terrier_9 37 2 25\nbroken\n")
    names, items, _ = E.read_pets(str(tmp_path))
    assert [(os.path.basename(r.path), names[y]) for r, y in items[:2]] == [
        ("Abyssinian_201.jpg", "Abyssinian"), ("yorkshire_terrier_9.jpg", "Yorkshire Terrier")]
    assert items[2] == (None, f"{tmp_path / 'oxford-iiit-pet' / 'annotations' / 'test.txt'}:3: malformed line")


def test_food101_meta_test_json(tmp_path):
    root = tmp_path / "food-101"
    solid(root / "images" / "apple_pie" / "1011328.jpg", RED)
    solid(root / "images" / "waffles" / "24.jpg", BLUE)
    os.makedirs(root / "meta")
    (root / "meta" / "test.json").write_text(json.dumps({"waffles": ["waffles/24"],
                                                         "apple_pie": ["apple_pie/1011328"]}))
    names, items, _ = E.read_food101(str(tmp_path))
    assert names == ["apple pie", "waffles"]
    assert [(os.path.basename(r.path), y) for r, y in items] == [("1011328.jpg", 0), ("24.jpg", 1)]


def test_sun397_class_list_and_partition(tmp_path):
    root = tmp_path / "SUN397"
    a = solid(root / "a" / "abbey" / "sun_aaa.jpg", RED)
    b = solid(root / "a" / "apartment_building" / "outdoor" / "sun_bbb.jpg", BLUE)
    solid(root / "a" / "abbey" / "sun_ccc.jpg", GREEN)
    (root / "ClassName.txt").write_text("/a/abbey\n/a/apartment_building/outdoor\n")
    names, items, note = E.read_sun397(str(tmp_path))
    assert names == ["abbey", "apartment building outdoor"] and "all images" in note
    assert sorted((os.path.basename(r.path), y) for r, y in items) == [("sun_aaa.jpg", 0), ("sun_bbb.jpg", 1),
                                                                       ("sun_ccc.jpg", 0)]
    (root / "Testing_01.txt").write_text("/a/abbey/sun_aaa.jpg\n/a/apartment_building/outdoor/sun_bbb.jpg\n")
    _, items, note = E.read_sun397(str(tmp_path))
    assert ([(r.path, y) for r, y in items] == [(os.path.abspath(a), 0), (os.path.abspath(b), 1)]
            and "Testing_01" in note)


def test_caltech101_folders_map_to_clip_benchmark_names(tmp_path):
    cats = tmp_path / "caltech101" / "101_ObjectCategories"
    solid(cats / "Faces_easy" / "image_0001.jpg", RED)
    solid(cats / "yin_yang" / "image_0001.jpg", BLUE)
    os.makedirs(cats / "BACKGROUND_Google")
    names, items, _ = E.read_caltech101(str(tmp_path))
    assert (len(names) == 102 and names[0] == "background" and names[2] == "centered face"
            and names[101] == "yin and yang symbol")
    assert [y for _, y in items] == [2, 101]


def test_voc2007_one_crop_per_object(tmp_path):
    root = tmp_path / "VOCdevkit" / "VOC2007"
    img = Image.new("RGB", (40, 20), RED)
    img.paste(BLUE, (20, 0, 40, 20))
    os.makedirs(root / "JPEGImages"), os.makedirs(root / "Annotations"), os.makedirs(root / "ImageSets" / "Main")
    img.save(root / "JPEGImages" / "000001.jpg", quality=100)
    obj = "<object><name>{}</name><pose>Left</pose><truncated>0</truncated><difficult>{}</difficult>" \
          "<bndbox><xmin>{}</xmin><ymin>2</ymin><xmax>{}</xmax><ymax>18</ymax></bndbox></object>"
    (root / "Annotations" / "000001.xml").write_text(
        f"<annotation><folder>VOC2007</folder><filename>000001.jpg</filename>"
        f"{obj.format('cat', 0, 2, 16)}{obj.format('tvmonitor', 1, 24, 38)}</annotation>")
    (root / "Annotations" / "000002.xml").write_text("<annotation><object>")
    (root / "ImageSets" / "Main" / "aeroplane_test.txt").write_text("000001 -1\n000002 -1\n")
    names, items, note = E.read_voc2007(str(tmp_path))
    assert [names[y] for r, y in items if r] == ["cat", "tvmonitor"]
    assert items[2][0] is None and "000002.xml: ParseError" in items[2][1]     # counted as skipped, with why
    left, right = items[0][0].open(), items[1][0].open()
    assert left.size == (14, 16) and right.size == (14, 16)
    assert np.abs(np.asarray(left, float) - RED).max() < 40 and np.abs(np.asarray(right, float) - BLUE).max() < 40


# ----------------------------------------------------------------------------- Flowers102 (.mat)

def mat_element(kind, payload):
    return struct.pack("<II", kind, len(payload)) + payload + bytes(-len(payload) % 8)


def mat_v5(path, arrays, compress=False):
    """A MATLAB v5 file of double row vectors (the layout the Flowers102 .mat files use)."""
    out = b"MATLAB 5.0 MAT-file, written by the test".ljust(116) + bytes(8) + struct.pack("<H", 0x0100) + b"IM"
    for name, values in arrays.items():
        v = np.asarray(values, dtype="<f8")
        body = (mat_element(6, struct.pack("<II", 6, 0)) + mat_element(5, struct.pack("<ii", 1, len(v)))
                + mat_element(1, name.encode()) + mat_element(9, v.tobytes()))
        element = mat_element(14, body)
        out += struct.pack("<II", 15, len(zlib.compress(element))) + zlib.compress(element) if compress else element
    path.write_bytes(out)


@pytest.mark.parametrize("compress", [False, True])
def test_flowers102_mat_files(tmp_path, compress):
    for i, colour in ((1, RED), (2, GREEN), (3, BLUE)):
        solid(tmp_path / "flowers-102" / "jpg" / f"image_{i:05d}.jpg", colour)
    mat_v5(tmp_path / "flowers-102" / "imagelabels.mat", {"labels": [77, 1, 102]}, compress)
    mat_v5(tmp_path / "flowers-102" / "setid.mat", {"trnid": [2], "valid": [1], "tstid": [3, 1]}, compress)
    names, items, _ = E.read_flowers102(str(tmp_path))
    assert [(os.path.basename(r.path), y) for r, y in items] == [("image_00003.jpg", 101), ("image_00001.jpg", 76)]
    assert names[0] == "pink primrose" and len(names) == 102


def test_mat_reader_against_scipy(tmp_path):
    sio = pytest.importorskip("scipy.io")
    arrays = {"labels": np.arange(1, 8, dtype=np.float64)[None], "tstid": np.array([[5, 6, 300]], dtype=np.uint16),
              "m": np.arange(6, dtype=np.int32).reshape(2, 3)}
    for compress in (False, True):
        sio.savemat(tmp_path / "x.mat", arrays, do_compression=compress)
        got = E.mat_v5_arrays(str(tmp_path / "x.mat"))
        for k, v in arrays.items():
            assert np.array_equal(got[k], v), (k, compress)
    (tmp_path / "bad.mat").write_bytes(b"not a mat file")
    with pytest.raises(data.DataError, match="not a MATLAB v5"):
        E.mat_v5_arrays(str(tmp_path / "bad.mat"))


# ----------------------------------------------------------------------------- ObjectNet, RESISC45

def test_objectnet_keeps_the_classes_shared_with_imagenet(tmp_path):
    root = tmp_path / "objectnet-1.0"
    solid(root / "images" / "alarm_clock" / "a.png", RED)
    solid(root / "images" / "air_freshener" / "b.png", BLUE)  # not an ImageNet class: not scored
    solid(root / "images" / "banana" / "c.png", GREEN)
    os.makedirs(root / "mappings")
    (root / "mappings" / "folder_to_objectnet_label.json").write_text(json.dumps(
        {"alarm_clock": "Alarm clock", "air_freshener": "Air freshener", "banana": "Banana"}))
    (root / "mappings" / "objectnet_to_imagenet_1k.json").write_text(json.dumps(
        {"Banana": "banana", "Alarm clock": "analog clock; digital clock"}))
    names, items, _ = E.read_objectnet(str(tmp_path))
    assert names == ["alarm clock", "banana"]
    assert [(os.path.basename(r.path), y) for r, y in items] == [("a.png", 0), ("c.png", 1)]


def test_resisc45_folders(tmp_path):
    root = tmp_path / "NWPU-RESISC45"
    for f in E.RESISC45_FOLDERS:
        os.makedirs(root / f)
    solid(root / "sea_ice" / "sea_ice_001.jpg", BLUE)
    names, items, _ = E.read_resisc45(str(tmp_path))
    assert len(names) == 45 and names[items[0][1]] == "sea_ice"   # TFDS's (so CLIP_benchmark's) name
    os.rmdir(root / "wetland")
    with pytest.raises(data.DataError):
        E.read_resisc45(str(tmp_path))


# ----------------------------------------------------------------------------- VTAB: CLEVR, smallNORB, DMLab

def test_clevr_count_from_the_scenes_json(tmp_path):
    root = tmp_path / "CLEVR_v1.0"
    solid(root / "images" / "val" / "CLEVR_val_000000.png", RED)
    solid(root / "images" / "val" / "CLEVR_val_000001.png", BLUE)
    os.makedirs(root / "scenes")
    scene = lambda i, n: {"image_index": i, "image_filename": f"CLEVR_val_{i:06d}.png", "split": "val",
                          "objects": [{"shape": "cube", "pixel_coords": [1, 2, 9.5]}] * n}
    (root / "scenes" / "CLEVR_val_scenes.json").write_text(json.dumps(
        {"info": {"split": "val"}, "scenes": [scene(0, 3), scene(1, 10)]}))
    names, items, _ = E.read_clevr(str(tmp_path))
    assert [names[y] for _, y in items] == ["three", "ten"]


def norb_file(path, array, magic):
    dims = list(array.shape) + [1] * (3 - array.ndim)
    path.write_bytes(struct.pack("<ii", magic, array.ndim) + struct.pack(f"<{len(dims)}i", *dims) + array.tobytes())


def test_smallnorb_binary_matrices_azimuth(tmp_path):
    stem = "smallnorb-5x01235x9x18x6x2x96x96-testing-"
    dat = np.random.default_rng(3).integers(0, 256, (3, 2, 96, 96), dtype=np.uint8)
    info = np.array([[0, 1, 0, 5], [3, 8, 34, 0], [5, 2, 18, 1]], dtype="<i4")  # instance, elevation, azimuth, light
    norb_file(tmp_path / f"{stem}dat.mat", dat, 0x1E3D4C55)
    norb_file(tmp_path / f"{stem}cat.mat", np.array([0, 4, 2], dtype="<i4"), 0x1E3D4C54)
    norb_file(tmp_path / f"{stem}info.mat", info, 0x1E3D4C54)
    names, items, _ = E.read_smallnorb(str(tmp_path))
    assert len(names) == 18 and [y for _, y in items] == [0, 17, 9]
    assert np.array_equal(pixels(items[1][0]), np.repeat(dat[1, 0][..., None], 3, axis=2))  # first camera, grey
    assert E.norb_matrix(str(tmp_path / f"{stem}cat.mat")).tolist() == [0, 4, 2]


def pb_varint(v):
    out = b""
    while True:
        out += bytes([v & 0x7F | (0x80 if v > 0x7F else 0)])
        v >>= 7
        if not v:
            return out


def pb_field(number, payload):
    return pb_varint(number << 3 | 2) + pb_varint(len(payload)) + payload


def tf_example(features, packed=True):
    entries = b""
    for key, v in features.items():
        if isinstance(v, bytes):
            feature = pb_field(1, pb_field(1, v))
        else:
            ints = pb_field(1, pb_varint(v)) if packed else pb_varint(1 << 3) + pb_varint(v)
            feature = pb_field(3, ints)
        entries += pb_field(1, pb_field(1, key.encode()) + pb_field(2, feature))
    return pb_field(1, entries)


def crc32c(blob):
    crc = 0xFFFFFFFF
    for b in blob:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def tfrecord(records):
    masked = lambda c: (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    out = b""
    for r in records:
        n = struct.pack("<Q", len(r))
        out += n + struct.pack("<I", masked(crc32c(n))) + r + struct.pack("<I", masked(crc32c(r)))
    return out


def test_crc32c_is_the_castagnoli_crc():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value


def test_dmlab_tfrecords(tmp_path):
    jpegs = []
    for colour in (RED, BLUE):
        buf = io.BytesIO()
        Image.new("RGB", (48, 36), colour).save(buf, format="JPEG")
        jpegs.append(buf.getvalue())
    records = [tf_example({"image": jpegs[0], "filename": b"a.jpg", "label": 4}),
               tf_example({"filename": b"b.jpg", "label": 1, "image": jpegs[1]}, packed=False)]
    os.makedirs(tmp_path / "dmlab")
    (tmp_path / "dmlab" / "dmlab-test.tfrecord-00000-of-00001").write_bytes(tfrecord(records))
    (tmp_path / "dmlab" / "dmlab-train.tfrecord-00000-of-00001").write_bytes(tfrecord(records[:1]))
    names, items, _ = E.read_dmlab(str(tmp_path))
    assert [names[y] for _, y in items] == ["far lemon", "far apple/melon"]
    assert np.abs(np.asarray(items[1][0].open(), float) - BLUE).max() < 40
    (tmp_path / "dmlab" / "dmlab-test.tfrecord-00000-of-00001").write_bytes(tfrecord(records)[:-30])
    with pytest.raises(data.DataError, match="dmlab-test.tfrecord"):
        E.read_dmlab(str(tmp_path))


# ----------------------------------------------------------------------------- the suite

def test_names_flags_and_benchmark_list():
    a = E.get_args(["--init", "w.pt", "--zeroshot", "ImageNet-1k=/in", "--zeroshot", "IN-sketch=/sk",
                    "--zeroshot_suite", "il_clip"])
    assert a.zeroshot_sets == {"imagenet1k": "/in", "imagenet-sketch": "/sk"} and a.zeroshot is None
    assert a.benchmark_list == ["shapes", "zeroshot/imagenet1k", "zeroshot/imagenet-sketch"]
    a = E.get_args(["--init", "w.pt", "--benchmarks", "zeroshot", "--zeroshot", "dir", "--zeroshot", "cifar10=/c"])
    assert (a.zeroshot, a.benchmark_list) == ("dir", ["zeroshot", "zeroshot/cifar10"])
    a = E.get_args(["--init", "w.pt", "--benchmarks", "zeroshot"])    # no data flag: skipped, never shapes
    assert (a.zeroshot, a.benchmark_list) == (None, ["zeroshot"])
    with pytest.raises(E.ConfigError, match="unknown dataset 'cifar11'"):
        E.get_args(["--init", "w.pt", "--zeroshot", "cifar11=/c"])
    assert [s.column for s in E.zeroshot_sets().values()] == [
        "ImageNet1k", "CIFAR-100", "CIFAR-10", "STL-10", "VOC2007", "Caltech101", "SUN397", "Pets", "Flowers102",
        "Food101", "ObjectNet", "CLEVR", "Smallnorb", "Resisc45", "DMLAB", "ImageNet-A", "ImageNet-R", "IN-sketch"]


def test_suite_row_scores_what_was_given_and_means_only_those(tmp_path, monkeypatch):
    # two sets scored by the colour stand-in model (their class names are colour words), one broken path
    folder = tmp_path / "f"
    solid(folder / "a" / "1.png", RED), solid(folder / "b" / "2.png", BLUE), solid(folder / "b" / "3.png", RED)
    colour_reader = lambda p: (["red", "blue"], E.read_image_folder(p)[1], "fixture")
    sets = E.zeroshot_sets()
    sets["cifar10"] = sets["cifar10"]._replace(reader=colour_reader, templates=["a {} photo"])
    sets["stl10"] = sets["stl10"]._replace(reader=colour_reader, templates=["{}"])
    monkeypatch.setattr(E, "zeroshot_sets", lambda: sets)
    a = args(zeroshot=None, zeroshot_suite="il_clip",
             zeroshot_sets={"cifar10": str(folder), "stl10": str(folder), "pets": str(tmp_path / "no_pets")},
             benchmark_list=["zeroshot/cifar10", "zeroshot/stl10", "zeroshot/pets"])
    emb = E.Embedder(ColourModel(), WordTokenizer(), image_size=16, batch_size=2, progress=False)
    results, skipped, failed = E.run_benchmarks(a, emb, None, None, None)
    assert results["zeroshot/cifar10"]["top1"] == pytest.approx(200 / 3, abs=5e-3)  # 3.png is red, labelled b
    assert "not found" in failed["zeroshot/pets"]
    row = E.zeroshot_suite_row(results, failed)
    assert row["CIFAR-10"] == {"top1": pytest.approx(66.6667, abs=5e-3), "n_scored": 3, "n_skipped": 0}
    assert row["Pets"]["top1"] is None and "not found" in row["Pets"]["reason"]
    assert row["Mean"]["top1"] == pytest.approx(200 / 3, abs=5e-3) and row["Mean"]["over"] == 2
    assert len(row["Mean"]["not_scored"]) == 16 and "Pets" in row["Mean"]["not_scored"]
    table = E.suite_table(row)
    assert (table.splitlines()[2].startswith("| top-1 | — | — | 66.7 | 66.7 | —")
            and "not scored: ImageNet1k" in table)


def test_cli_prints_the_table2_row_and_exits_2_on_a_broken_set(tmp_path, monkeypatch, capsys):
    root = tmp_path / "cifar-10-batches-bin"
    os.makedirs(root)
    images = np.zeros((2, 32, 32, 3), np.uint8)
    (root / "test_batch.bin").write_bytes(b"".join(bytes([y]) + im.transpose(2, 0, 1).tobytes()
                                                   for y, im in zip((0, 9), images)))
    monkeypatch.setattr(E, "load_checkpoint",
                        lambda path, a, script=None: (ColourModel(), WordTokenizer(), {"image_size": 16}))
    out = tmp_path / "r.json"
    code = E.main(["--init", "w.pt", "--benchmarks", "zeroshot", "--zeroshot", f"CIFAR-10={tmp_path}", "--zeroshot",
                   f"pets={tmp_path / 'missing'}", "--zeroshot_suite", "il_clip", "--no_progress", "--out", str(out)])
    std = capsys.readouterr()
    assert code == 2 and "error: zeroshot/pets" in std.err
    assert "IL-CLIP paper, Table 2 (zero-shot top-1):" in std.out and "| n_scored | 0 | 0 | 2 |" in std.out
    blob = json.loads(out.read_text())
    assert blob["zeroshot_suite"]["CIFAR-10"]["n_scored"] == 2 and blob["zeroshot_suite"]["Mean"]["over"] == 1
    assert blob["results"]["zeroshot/cifar10"]["split"] == "test batch"


def test_clip_benchmark_webdataset_export(tmp_path, monkeypatch):
    import tarfile
    root = tmp_path / "wds_vtab-dmlab"
    os.makedirs(root / "test")
    (root / "classnames.txt").write_text("red\nblue\n")
    (root / "zeroshot_classification_templates.txt").write_text("{c}\n")
    (root / "test" / "nshards.txt").write_text("1\n")
    with tarfile.open(root / "test" / "0.tar", "w") as tar:
        for i, (colour, label) in enumerate(((RED, 0), (BLUE, 1), (BLUE, 0))):
            buf = io.BytesIO()
            Image.new("RGB", (20, 20), colour).save(buf, format="WEBP", lossless=True)
            for ext, blob in (("webp", buf.getvalue()), ("cls", str(label).encode())):
                info = tarfile.TarInfo(f"s{i:07d}.{ext}")
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
    names, items, _ = E.read_clip_benchmark_wds(str(tmp_path))
    assert names == ["red", "blue"] and [y for _, y in items] == [0, 1, 0]
    assert np.array_equal(pixels(items[1][0]), np.full((20, 20, 3), BLUE, np.uint8))
    # given for any named set, the export is read in place of the raw release
    a = args(zeroshot_sets={"dmlab": str(root)})
    emb = E.Embedder(ColourModel(), WordTokenizer(), image_size=16, batch_size=2, progress=False)
    r = E.bench_zeroshot_set("dmlab")(a, emb)
    assert (r["top1"], r["n_scored"], r["split"]) == (pytest.approx(200 / 3, abs=5e-3), 3,
                                                      "CLIP_benchmark webdataset, test split")


def test_a_label_outside_the_class_list_is_an_error_not_a_silent_miss(tmp_path, emb):
    solid(tmp_path / "images" / "Abyssinian_1.jpg", RED)
    os.makedirs(tmp_path / "annotations")
    (tmp_path / "annotations" / "test.txt").write_text("Abyssinian_1 38 1 1\n")
    with pytest.raises(data.DataError, match="1 labels outside 0-36"):
        E.bench_zeroshot_set("pets")(args(zeroshot_sets={"pets": str(tmp_path)}), emb)
