"""Issue 41: loaders hand over uint8 [B, 3, H, W] and the step normalises (data.normalize_images).
The float path they replaced (ToNormalizedTensor, written out below as it was) and the uint8 path +
normalize_images agree bit for bit on the CPU, for the train and eval transforms, the shapes data
and whole loader batches with workers; JPEG draft decoding applies only where the stored image is
at least twice what the transform needs."""
import io
import os
import random
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

import data


class FloatPath:
    """The float path before issue 41 (data.ToNormalizedTensor), verbatim: the reference."""

    def __init__(self, mean=data.CLIP_MEAN, std=data.CLIP_STD):
        self.mean = np.asarray(mean, dtype=np.float32)[:, None, None]
        self.std = np.asarray(std, dtype=np.float32)[:, None, None]

    def __call__(self, img, rng=None):
        x = np.asarray(img if img.mode == "RGB" else img.convert("RGB")).transpose(2, 0, 1)
        out = np.empty(x.shape, dtype=np.float32)
        np.divide(x, np.float32(255.0), out=out)
        out -= self.mean
        out /= self.std
        return torch.from_numpy(out)


def _float_twin(compose):
    """The same transform with the old float tensor as its last step."""
    return data.Compose([*compose.transforms[:-1], FloatPath()])


def _photo(w, h, seed=0, noise=20):
    """Gradients plus pixel noise, a stand-in for a photo."""
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) * 127 / (w + h)], -1)
    noise = np.random.default_rng(seed).normal(0, noise, base.shape)
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def _jpeg(img, quality=95) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


@pytest.mark.parametrize("size", [224, 33])
def test_uint8_then_normalize_equals_the_float_path_bit_for_bit(size):
    for i, (w, h) in enumerate([(341, 256), (256, 256), (97, 130), (640, 427)]):
        img = _photo(w, h, i)
        for t in (data.eval_transform(size), data.train_transform(size, scale=(0.5, 1.0), flip=True)):
            x = t(img, random.Random(i))
            assert x.dtype == torch.uint8 and x.shape == (3, size, size)
            ref = _float_twin(t)(img, random.Random(i))     # same rng: the same crop and flip
            assert torch.equal(data.normalize_images(x[None])[0], ref), (w, h, size)


def test_shapes_samples_and_batches_equal_the_float_path(tmp_path):
    ds = data.ShapesDataset("val", size=6)
    for i in range(6):
        x = ds[i]["image"]
        assert x.dtype == torch.uint8
        assert torch.equal(data.normalize_images(x), FloatPath()(data.shapes_scene("val", i).image))
    # whole batches, stacked in a worker's shared memory, and collate's empty batch
    (b,) = list(data.make_loader("shapes:train_size=6", batch_size=6, image_size=64, num_workers=1))
    scenes = [data.shapes_scene("train", int(k[5:])) for k in b["key"]]
    assert b["image"].dtype == torch.uint8 and b["image"].shape == (6, 3, 64, 64)
    assert torch.equal(data.normalize_images(b["image"], "cpu"), torch.stack([FloatPath()(s.image) for s in scenes]))
    assert data.collate([data.Skip("x", "y")])["image"].dtype == torch.uint8
    # a float tensor (already normalised) passes through unchanged
    f = torch.randn(2, 3, 4, 4)
    assert data.normalize_images(f) is f


def _shard(path, images):
    with tarfile.open(path, "w") as tf:
        for i, blob in enumerate(images):
            for ext, b in (("jpg", blob), ("txt", f"caption {i}".encode())):
                info = tarfile.TarInfo(f"{i:05d}.{ext}")
                info.size = len(b)
                tf.addfile(info, io.BytesIO(b))


def test_jpeg_draft_only_where_the_stored_image_is_twice_the_need(tmp_path):
    seen = []

    def spy(img, rng):
        seen.append(img.size)
        return data.ToTensor()(img.resize((32, 32)))
    spy.draft = 100         # the transform needs a shorter side of 100 px
    for (w, h), decoded in [((400, 300), (200, 150)), ((420, 800), (105, 200)), ((199, 300), (199, 300)),
                            ((150, 150), (150, 150))]:
        seen.clear()
        s = data.make_sample(_jpeg(_photo(w, h)), "a caption", None, "k", spy, random.Random(0))
        assert isinstance(s, dict) and seen == [decoded], (w, h)
    # PNGs and transforms without `draft` decode in full
    png = io.BytesIO()
    _photo(400, 300).save(png, "PNG")
    seen.clear()
    data.make_sample(png.getvalue(), "c", None, "k", spy, random.Random(0))
    data.make_sample(_jpeg(_photo(400, 300)), "c", None, "k", lambda img, rng: seen.append(img.size) or spy(img, rng),
                     random.Random(0))
    assert seen[0] == (400, 300) and seen[1] == (400, 300)


def test_transform_drafts_keep_the_pixels_they_need():
    # eval: Resize(224) needs a 224 px shorter side; train: the smallest crop (scale 0.9) still holds
    # at least 224^2 pixels, so 256 px images (img2dataset's default) decode in full and 512 px ones at 1/2
    assert data.eval_transform(224).draft == 224 and data.train_transform(224).draft == 237
    assert data.train_transform(224, scale=(0.08, 1.0)).draft == 792
    small, big = _jpeg(_photo(341, 256)), _jpeg(_photo(683, 512))
    for t in (data.eval_transform(224), data.train_transform(224)):
        # a stored image under twice the need: the very pixels of a full decode
        full = t(Image.open(io.BytesIO(small)).convert("RGB"), random.Random(1))
        assert torch.equal(data.make_sample(small, "c", None, "k", t, random.Random(1))["image"], full)
    # twice the need: decoded at 1/2, close to the full decode where the image has no detail finer than
    # the target's pixels (the transform resamples down either way)
    t, big = data.eval_transform(224), _jpeg(_photo(683, 512, noise=2))
    full = t(Image.open(io.BytesIO(big)).convert("RGB")).float()
    drafted = data.make_sample(big, "c", None, "k", t, random.Random(1))["image"].float()
    assert drafted.shape == full.shape and (drafted - full).abs().mean() < 1.5


def test_loader_on_jpeg_shards_gives_uint8_batches_from_workers(tmp_path):
    images = [_jpeg(_photo(683, 512, i)) for i in range(6)]
    _shard(tmp_path / "00000.tar", images)
    batches = list(data.make_loader(str(tmp_path / "00000.tar"), batch_size=3, image_size=224, train=False,
                                    num_workers=2))
    assert [b["image"].dtype for b in batches] == [torch.uint8] * 2
    assert all(b["image"].shape == (3, 3, 224, 224) and b["image"].is_contiguous() for b in batches)
    t = data.eval_transform(224)
    by_key = {k: x for b in batches for k, x in zip(b["key"], b["image"])}
    for i, blob in enumerate(images):
        assert torch.equal(by_key[f"{i:05d}"], data.make_sample(blob, "c", None, "k", t, random.Random(0))["image"])


def test_shared_batch_slots_are_claimed_until_taken():
    """The protocol alone: a slot is given to one claim until the main process takes (copies out) its batch; a batch
    larger than a slot, or with every slot busy, gets None (the worker then uses fresh shared memory)."""
    slots = data._SharedBatches(2, 12)
    a, b = slots.claim((2, 5)), slots.claim((3, 4))
    assert (a[0], b[0]) == (0, 1) and slots.claim((1,)) is None and slots.claim((13,)) is None
    a[1].copy_(torch.arange(10, dtype=torch.uint8).view(2, 5))
    out = slots.take(data._Slot(0, (2, 5)), pin=False)
    assert torch.equal(out, torch.arange(10, dtype=torch.uint8).view(2, 5)) and not out.is_shared()
    again = slots.claim((2, 6))
    assert again[0] == 0 and slots.claim((1,)) is None
    again[1].fill_(7)       # the next batch in the slot leaves the batch taken out before untouched
    assert torch.equal(out, torch.arange(10, dtype=torch.uint8).view(2, 5))


@pytest.mark.parametrize("stored", ["shapes", "jpeg"])
def test_worker_batches_reuse_the_slots_and_stay_intact_while_held(tmp_path, stored):
    """2 workers, 12 batches through 5 slots, every batch kept: each equals the 0-worker batch (a slot reused under a
    held batch would change it), and none is in shared memory (each came through a slot, so slots were freed)."""
    if stored == "jpeg":
        _shard(tmp_path / "00000.tar", [_jpeg(_photo(40, 30, i)) for i in range(48)])
    spec = str(tmp_path / "00000.tar") if stored == "jpeg" else "shapes:train_size=48"
    make = lambda w, **kw: list(data.make_loader(spec, batch_size=4, image_size=32, num_workers=w,  # noqa: E731
                                                 train=False, shuffle_buffer=0, **kw))
    alone, workers = make(0), make(2)
    assert len(alone) == len(workers) == 12
    assert sorted(k for b in workers for k in b["key"]) == sorted(k for b in alone for k in b["key"])
    by_key = {k: x for b in alone for k, x in zip(b["key"], b["image"])}
    assert all(torch.equal(x, by_key[k]) for b in workers for k, x in zip(b["key"], b["image"]))
    assert not any(b["image"].is_shared() for b in workers)
    # images larger than the slots were sized for (a transform of 48 px on a 32 px loader): fresh shared memory
    big = make(2, transform=data.eval_transform(48)) if stored == "jpeg" else None
    if big is not None:
        assert all(b["image"].shape[-1] == 48 and b["image"].is_shared() for b in big)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_are_pinned_uint8_and_normalise_on_the_device():
    """pin_memory=True on CUDA: page-locked uint8 batches, copied with non_blocking and converted on the GPU to
    what the CPU path gives (within float32 rounding)."""
    (b,) = list(data.make_loader("shapes:train_size=8", batch_size=8, image_size=64, num_workers=1, pin_memory=True))
    assert b["image"].dtype == torch.uint8 and b["image"].is_pinned()
    on_gpu = data.normalize_images(b["image"], "cuda")
    assert on_gpu.is_cuda and on_gpu.dtype == torch.float32
    torch.testing.assert_close(on_gpu.cpu(), data.normalize_images(b["image"]), rtol=0, atol=1e-6)
