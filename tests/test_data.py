"""Tests of data.py's core: the shapes dataset, its hard negatives, the tokenizer, the transforms
and the map-style DDP loader."""
import hashlib
import os
import io
import random

import numpy as np
import pytest
import torch
from PIL import Image

import data
import lifecycle


def _png_bytes(img):
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def parse_shapes_caption(text: str):
    """Parse a caption of the shapes grammar back into a data.CaptionStruct; None if it is not
    grammatical: the check that captions, hard negatives and references stay grammatical."""
    words = text.split()
    pos = 0

    def phrase():
        nonlocal pos
        if pos >= len(words) or words[pos] not in ("a", "an"):
            return None
        article = words[pos]
        pos += 1
        size = None
        if pos < len(words) and words[pos] in data.SIZE_NAMES:
            size = words[pos]
            pos += 1
        if pos + 1 < len(words) and words[pos] in data.COLOURS and words[pos + 1] in data.SHAPE_NAMES:
            p = data.Phrase(words[pos], words[pos + 1], size)
            pos += 2
            return p if article == data._article(p) else None
        return None

    def relation():
        nonlocal pos
        for rel in data.RELATION_NAMES:
            rw = rel.split()
            if words[pos:pos + len(rw)] == rw:
                pos += len(rw)
                return rel
        return None

    first = phrase()
    if first is None:
        return None
    if pos == len(words):
        return data.CaptionStruct("single", [first])
    if words[pos] == "and":
        pos += 1
        second = phrase()
        return data.CaptionStruct("and", [first, second]) if second and pos == len(words) else None
    copula = words[pos] == "is"
    pos += copula
    rel = relation()
    second = phrase() if rel else None
    if second is None:
        return None
    if pos == len(words):
        return data.CaptionStruct("copula" if copula else "rel", [first, second], [rel])
    if copula:
        return None
    if words[pos] == "and":
        pos += 1
        third = phrase()
        return data.CaptionStruct("rel_and", [first, second, third], [rel]) if third and pos == len(words) else None
    rel2 = relation()
    third = phrase() if rel2 else None
    return data.CaptionStruct("chain", [first, second, third], [rel, rel2]) if third and pos == len(words) else None


def test_shapes_is_deterministic_and_seed_dependent():
    a = [data.shapes_scene("train", i, seed=0) for i in range(20)]
    b = [data.shapes_scene("train", i, seed=0) for i in range(20)]
    c = [data.shapes_scene("train", i, seed=1) for i in range(20)]
    digest = lambda scenes: hashlib.sha256(b"".join(_png_bytes(s.image) + s.caption.encode()
                                                    for s in scenes)).hexdigest()
    assert digest(a) == digest(b)
    assert digest(a) != digest(c)


def test_shapes_caption_is_true_of_its_image_and_matches_its_tree():
    for split in data.SHAPES_SPLITS:
        for i in range(40):
            s = data.shapes_scene(split, i)
            assert data.caption_is_true(s.struct, s.objects)
            assert parse_shapes_caption(s.caption) == s.struct
            leaves = [tok.rstrip(")") for tok in s.tree.split() if not tok.startswith("(")]
            assert " ".join(leaves) == s.caption
            assert s.tree.count("(") == s.tree.count(")")
            for o in s.objects:  # boxes are inside the image
                assert 0 <= o.box[0] < o.box[2] <= s.image.width and 0 <= o.box[1] < o.box[3] <= s.image.height


def test_relation_geometry_against_pixels():
    """The stated relation agrees with the centroid of the object's drawn pixels."""
    for i in range(30):
        s = data.shapes_scene("train", i)
        x = np.asarray(s.image).astype(int)
        for a, rel, b in s.relations:
            cents = []
            for o in (s.objects[a], s.objects[b]):
                x0, y0, x1, y1 = o.box
                patch = x[y0:y1 + 1, x0:x1 + 1]
                target = np.array(data.COLOURS[o.colour])
                ys, xs = np.nonzero(np.abs(patch - target).max(-1) <= 25)
                cents.append((xs.mean() + x0, ys.mean() + y0))
            dx, dy = cents[1][0] - cents[0][0], cents[1][1] - cents[0][1]
            expect = (("to the left of" if dx > 0 else "to the right of") if abs(dx) >= abs(dy)
                      else ("above" if dy > 0 else "below"))
            assert rel == expect


def test_held_out_compounds_never_in_train_and_always_in_systematicity():
    for i in range(300):
        s = data.shapes_scene("train", i)
        assert not any((o.colour, o.shape) in data.HELD_OUT_COMPOUNDS for o in s.objects)
    for i in range(50):
        s = data.shapes_scene("systematicity", i)
        assert any((o.colour, o.shape) in data.HELD_OUT_COMPOUNDS for o in s.objects)


def test_productivity_captions_are_longer_than_any_training_caption():
    train_rel = max(len(data.shapes_scene("train", i).relations) for i in range(300))
    assert train_rel == 1
    assert all(len(data.shapes_scene("productivity", i).relations) == 2 for i in range(30))


def test_hard_negatives_differ_stay_grammatical_and_are_false():
    bench = data.shapes_benchmark(seed=0, n=30)
    assert set(data.SHAPES_CATEGORIES) <= set(bench)
    for cat in data.SHAPES_CATEGORIES:
        assert len(bench[cat]) == 30
        for item in bench[cat]:
            pos, neg = parse_shapes_caption(item["caption"]), parse_shapes_caption(item["negative_caption"])
            assert neg is not None, item["negative_caption"]
            assert item["negative_caption"] != item["caption"]
            if cat.startswith("swap"):  # a swap keeps the bag of words (articles may turn a <-> an)
                content = lambda c: sorted(w for w in c.split() if w not in ("a", "an"))
                assert content(item["negative_caption"]) == content(item["caption"])
            if cat.startswith("add"):
                assert len(item["negative_caption"].split()) > len(item["caption"].split())
            if cat == "replace_rel":
                assert pos.phrases == neg.phrases and pos.relations != neg.relations
    for split in ("systematicity", "productivity"):
        for item in bench[split]:
            assert len(item["negatives"]) >= 2 and item["caption"] not in item["negatives"]
            assert all(parse_shapes_caption(n) is not None for n in item["negatives"])


def test_negatives_are_false_of_the_scene():
    rng = random.Random(0)
    for i in range(60):
        s = data.shapes_scene("test", i)
        for cat in data.SHAPES_CATEGORIES:
            neg = data.make_negative(cat, s, rng)
            if neg is not None:
                assert not data.caption_is_true(parse_shapes_caption(neg), s.objects)


def test_grammar_rejects_non_captions():
    for bad in ["", "a red", "red circle", "a red circle above", "a orange star", "a red circle and",
                "a red circle is above a blue square and a green star", "a huge red circle"]:
        assert parse_shapes_caption(bad) is None, bad


def test_classification_labels_match_the_drawn_shape():
    labels = [data.shapes_classification("train", i)[1] for i in range(60)]
    assert set(labels) == set(range(len(data.SHAPE_NAMES)))


@pytest.fixture(scope="module")
def shapes_tok():
    return data.build_tokenizer(captions=data.shapes_captions(500), vocab_size=300, context_length=40)


def test_trained_tokenizer_round_trips_and_keeps_eot(shapes_tok, tmp_path):
    tok = shapes_tok
    caps = [data.shapes_scene("train", i).caption for i in range(20)] + ["Some UNSEEN words, 123!"]
    ids = tok(caps)
    assert ids.shape == (len(caps), 40) and ids.dtype == torch.long
    for cap, row in zip(caps, ids):
        assert row[0] == tok.sot_id
        eot = (row == tok.eot_id).nonzero()
        assert len(eot) == 1 and (row[eot[0, 0] + 1:] == tok.pad_id).all()
        assert tok.decode(row) == " ".join(cap.lower().split())
    long = " ".join(["a small red circle to the left of a large blue square"] * 5)
    row = tok(long)[0]
    assert row[-1] == tok.eot_id and row[0] == tok.sot_id and (row != tok.pad_id).all()
    tok.save(str(tmp_path))
    again = data.Tokenizer.load(str(tmp_path))
    assert torch.equal(again(caps), ids) and again.context_length == 40


def test_tokenizer_load_errors_are_one_line(tmp_path):
    with pytest.raises(data.DataError, match="not found"):
        data.Tokenizer.load(str(tmp_path / "nope"))
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(data.DataError, match="tokenizer.json"):
        data.Tokenizer.load(str(tmp_path))


def _clip_vocab_path():
    from conftest import import_open_clip
    open_clip = import_open_clip()
    import os
    path = os.path.join(os.path.dirname(open_clip.__file__), "bpe_simple_vocab_16e6.txt.gz")
    if not os.path.exists(path):
        pytest.skip("open_clip has no bpe vocabulary file")
    return path


def test_clip_bpe_matches_open_clip_tokenizer():
    path = _clip_vocab_path()
    from open_clip.tokenizer import SimpleTokenizer  # noqa: E402 (imported through the hook)
    ref = SimpleTokenizer(path)
    tok = data.build_tokenizer(vocab_path=path)
    caps = ["a photo of a dog.", "Two  DOGS are running on the grass!", "it's 2023, isn't it?", "naïve café"]
    assert tok.vocab_size == 49408 and tok.sot_id == 49406 and tok.eot_id == 49407
    for cap in caps:
        ours = tok(cap)[0]
        theirs = [49406] + ref.encode(cap) + [49407]
        assert ours[: len(theirs)].tolist() == theirs, cap


def test_transforms_shapes_and_determinism():
    img = data.shapes_scene("train", 3).image.resize((80, 60))
    t = data.train_transform(32, scale=(0.5, 1.0), flip=True)
    x = t(img, random.Random(5))
    y = t(img, random.Random(5))
    assert x.shape == (3, 32, 32) and x.dtype == torch.uint8 and torch.equal(x, y)
    # the flip: mirrored with probability 1/2, drawn from the sample's rng
    flips = [data.RandomFlip()(img, random.Random(s)).tobytes() == img.transpose(Image.FLIP_LEFT_RIGHT).tobytes()
             for s in range(200)]
    assert 70 < sum(flips) < 130 and all(f == (random.Random(s).random() < 0.5) for s, f in enumerate(flips))
    e = data.eval_transform(32)(img)
    assert e.shape == (3, 32, 32)
    # normalisation: a constant image maps to (v - mean) / std
    const = Image.new("RGB", (40, 40), (255, 0, 128))
    z = data.normalize_images(data.eval_transform(32)(const))
    expect = (torch.tensor([1.0, 0.0, 128 / 255]) - torch.tensor(data.CLIP_MEAN)) / torch.tensor(data.CLIP_STD)
    assert torch.allclose(z[:, 5, 5], expect, atol=1e-6)


def test_resize_centre_crop_against_manual_pil():
    img = Image.fromarray(np.random.RandomState(0).randint(0, 255, (50, 90, 3), dtype=np.uint8))
    ours = data.Compose([data.Resize(32), data.CenterCrop(32)])(img)
    w = 90 * 32 // 50                     # torchvision truncates the long side: 57, not 58
    ref = img.resize((w, 32), Image.BICUBIC).crop((12, 0, 44, 32))      # round(25 / 2) = 12
    assert np.array_equal(np.asarray(ours), np.asarray(ref))


def test_map_loader_ranks_partition_each_epoch_and_resume():
    seen = {}
    for rank in range(2):
        ld = data.make_loader("shapes:train_size=40", batch_size=4, rank=rank, world_size=2, seed=3, image_size=32)
        keys = [k for b in ld for k in b["key"]]
        assert len(keys) == 20
        seen[rank] = keys
    assert not set(seen[0]) & set(seen[1]) and len(set(seen[0]) | set(seen[1])) == 40
    # a different epoch has a different order; resuming mid-epoch continues with the next batch
    ld = data.make_loader("shapes:train_size=40", batch_size=4, rank=0, world_size=2, seed=3, image_size=32)
    it = ld.forever()
    torch_rng = torch.get_rng_state()
    first = [next(it)["key"] for _ in range(7)]  # 5 batches of epoch 0 then 2 of epoch 1
    # the loader leaves the global torch RNG alone (DataLoader draws a seed per iterator from it
    # unless given a generator): a resume, one iterator more, would shift a fork's dropout
    assert torch.equal(torch.get_rng_state(), torch_rng)
    assert [k for b in first[:5] for k in b] == seen[0] and first[5] != first[0]
    state = ld.state_dict()
    assert state["epoch"] == 1 and state["batches_done"] == 2
    nxt = next(it)["key"]
    ld2 = data.make_loader("shapes:train_size=40", batch_size=4, rank=0, world_size=2, seed=3, image_size=32)
    ld2.load_state_dict(state)
    assert next(ld2.forever())["key"] == nxt


def test_loader_tokenizes_and_bad_spec_is_one_line(shapes_tok):
    ld = data.make_loader("shapes:train_size=16", batch_size=8, tokenizer=shapes_tok, image_size=32)
    b = next(iter(ld))
    assert b["image"].shape == (8, 3, 32, 32) and b["text"].shape == (8, 40)
    assert b["tree"][0].startswith("(ROOT")
    with pytest.raises(data.DataError):
        data.make_loader("shapes:foo=1")


def test_summarize_runs_blank_cells_and_no_star_without_an_interval(tmp_path, capsys):
    """A metric only some runs have is a blank cell (its method's paired row is kept, n counts the
    seeds); a paired difference with zero spread gets no star (no interval to exclude zero)."""
    def read(folder):
        return tuple(lifecycle.read_json(os.path.join(folder, "run.json")))
    for method, seed, res in [("a", 0, {"x": 0.5, "y": 0.1}), ("a", 1, {"x": 0.6}), ("b", 0, {"x": 0.4}),
                              ("b", 1, {"x": 0.5})]:
        os.makedirs(tmp_path / f"{method}{seed}")
        lifecycle.save_json(str(tmp_path / f"{method}{seed}" / "run.json"), [method, seed, res])
    lifecycle.summarize_runs(str(tmp_path), read, baseline="b")
    out = capsys.readouterr().out.splitlines()
    cells = {ln.split(" | ")[0]: [c.strip(" |") for c in ln.split(" | ")[1:]] for ln in out if ln.startswith("| ")}
    assert cells["| a (2)"][1] == "10.0" and cells["| b (2)"][1] == ""     # y: one seed (no ±); blank for b
    assert cells["| a - b (2)"] == ["+10.0 ± 0.0", ""]      # zero spread: no star; y: blank
