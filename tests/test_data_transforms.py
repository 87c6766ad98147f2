"""data.py's image transforms against torchvision's (issue 26 item 1): the eval transform is
torchvision's Resize(size, bicubic) + CenterCrop(size) + OpenAI's normalisation, pixel for
pixel, on the common COCO sizes and odd ones; RandomResizedCrop's sizes, offsets and fallback
are torchvision's. torchvision cannot be installed here: the formulas are re-computed
independently, and the test against torchvision itself skips when it is absent."""
import random

import numpy as np
import pytest
import torch
from PIL import Image

import data

SIZES = [(640, 480), (480, 640), (640, 427), (500, 375), (375, 500), (333, 501), (225, 224), (224, 225),
         (227, 301), (224, 224), (100, 100), (64, 64), (1000, 223), (97, 130)]


def _noise(w, h, seed=0):
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8))


def _reference(img, size):
    """The eval pipeline written from the formulas: exact integer floor for the long side,
    round-half-to-even spelled out for the crop offset, numpy slicing for the crop."""
    w, h = img.size
    if w <= h:
        new = (size, size * h // w)
    else:
        new = (size * w // h, size)
    resized = np.asarray(img.resize(new, Image.BICUBIC) if new != (w, h) else img)

    def offset(d):          # round(d / 2), ties to the even neighbour
        k = d // 2
        return k + (d % 2) * (k % 2)
    y, x = offset(resized.shape[0] - size), offset(resized.shape[1] - size)
    crop = resized[y:y + size, x:x + size].astype(np.float32) / 255.0
    mean, std = np.array(data.CLIP_MEAN, np.float32), np.array(data.CLIP_STD, np.float32)
    return torch.from_numpy(((crop - mean) / std).transpose(2, 0, 1).copy())


@pytest.mark.parametrize("size", [224, 64, 33])
def test_eval_transform_equals_the_formulas(size):
    for i, (w, h) in enumerate(SIZES):
        img = _noise(w, h, i)
        got = data.normalize_images(data.eval_transform(size)(img))
        assert got.shape == (3, size, size)
        assert torch.equal(got, _reference(img, size)), (w, h, size)


def test_long_side_is_truncated_and_offset_rounds_half_to_even():
    assert data.Resize(224)(_noise(640, 480)).size == (298, 224)     # 298.67: torchvision keeps 298
    assert data.Resize(224)(_noise(427, 640)).size == (224, 335)     # 335.74
    assert data.Resize(224)(_noise(500, 375)).size == (298, 224)
    assert [data._centre_offset(224 + d, 224) for d in range(8)] == [0, 0, 1, 2, 2, 2, 3, 4]
    # a smaller image is padded with zeros, the odd pixel after it (torchvision's padding_ltrb)
    small = data.CenterCrop(5)(Image.new("RGB", (2, 5), (9, 9, 9)))
    assert np.asarray(small)[0, :, 0].tolist() == [0, 9, 9, 0, 0]


def test_square_images_are_unchanged_so_shapes_results_do_not_move():
    """The shapes images are square (64x64): eval_transform at their own size is the plain
    normalisation, and the training fallback of a square image is the whole image."""
    img = data.shapes_scene("val", 0).image
    assert torch.equal(data.eval_transform(64)(img), data.ToTensor()(img))
    crop = data.RandomResizedCrop(64, scale=(2.0, 2.0))      # no try fits: always the fallback
    assert np.array_equal(np.asarray(crop(img, random.Random(0))), np.asarray(img))


def test_random_resized_crop_draws_torchvision_sizes():
    """Every crop box is one torchvision's get_params could return: w, h = round(sqrt(area *
    aspect)), round(sqrt(area / aspect)) within the image, offsets in [0, W - w]."""
    boxes = []
    orig = Image.Image.resize

    def spy(self, size, resample=None, box=None, *a, **k):
        boxes.append((self.size, box))
        return orig(self, size, resample, box, *a, **k)
    img = _noise(640, 427)
    t = data.RandomResizedCrop(224, scale=(0.08, 1.0))
    try:
        Image.Image.resize = spy
        for seed in range(50):
            t(img, random.Random(seed))
    finally:
        Image.Image.resize = orig
    for (W, H), (x0, y0, x1, y1) in boxes:
        w, h = x1 - x0, y1 - y0
        assert 0 < w <= W and 0 < h <= H and 0 <= x0 <= W - w and 0 <= y0 <= H - h
        assert 0.08 * W * H * 0.99 <= w * h <= W * H * 1.01 and 3 / 4 * 0.95 <= w / h <= 4 / 3 * 1.05


@pytest.mark.parametrize("w,h,box", [(400, 100, (133, 0, 266, 100)), (100, 400, (0, 133, 100, 266)),
                                     (120, 100, (0, 0, 120, 100))])
def test_random_resized_crop_fallback_is_torchvisions(w, h, box):
    """No try fits (scale > 1): torchvision's fallback clamps the whole image to the ratio range
    (w = round(h * 4/3), h = round(w / (3/4))) and centres it with floor division."""
    img = _noise(w, h)
    got = data.RandomResizedCrop(32, scale=(2.0, 2.0))(img, random.Random(0))
    assert np.array_equal(np.asarray(got), np.asarray(img.resize((32, 32), Image.BICUBIC, box=box)))


def test_against_torchvision_itself():
    pytest.importorskip("torchvision")
    from torchvision import transforms as T
    ref = T.Compose([T.Resize(224, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(224), T.ToTensor(),
                     T.Normalize(data.CLIP_MEAN, data.CLIP_STD)])
    for i, (w, h) in enumerate(SIZES):
        img = _noise(w, h, i)
        assert torch.allclose(data.normalize_images(data.eval_transform(224)(img)), ref(img), atol=1e-6), (w, h)
