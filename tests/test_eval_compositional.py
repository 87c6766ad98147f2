"""eval_compositional.py: every benchmark format on a tiny fixture written here, scored by a
deterministic stand-in model with hand-computed expected scores (ties included: strict `>`
counts a tie as wrong); R@k against brute force; zero-shot template averaging against an
independent computation; the spectral-norm product against exact spectral norms (and why it
is no Lipschitz bound); then the CLI end to end on a tiny il_clip.py checkpoint; last, the
results over seeds (95% t-intervals against a hand computation and scipy, paired differences)."""
import csv
import importlib.util
import json
import math
import os
import shutil
import types
import zipfile

import numpy as np
import pytest
from conftest import read_figure
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

import data
import lifecycle
import eval_compositional as E

# ----------------------------------------------------------------------------- stand-in model
# Image embedding: the colour of the image, relu(2 * mean RGB - 1) per channel, normalised:
# solid red -> (1, 0, 0), yellow -> (1, 1, 0)/sqrt2, blue -> (0, 0, 1), exact zeros elsewhere.
# Text embedding: counts of the words red / green / blue, normalised (a bag of words, so
# "red" and "red red" embed identically: an exact tie).
RED, GREEN, BLUE, YELLOW = (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)
WORDS = {"red": 1, "green": 2, "blue": 3}


class WordTokenizer:
    vocab_size, context_length, eot_id, pad_id = 5, 8, 4, 0

    def __call__(self, texts):
        texts = [texts] if isinstance(texts, str) else texts
        out = torch.zeros(len(texts), self.context_length, dtype=torch.long)
        for i, t in enumerate(texts):
            ids = [WORDS.get(w, 0) for w in t.lower().split()][: self.context_length]
            out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out


class ColourModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.mean = torch.tensor(data.CLIP_MEAN).view(1, 3, 1, 1)
        self.std = torch.tensor(data.CLIP_STD).view(1, 3, 1, 1)
        self.images_seen, self.texts_seen = 0, 0

    def encode_image(self, x):
        self.images_seen += len(x)
        rgb = (x * self.std + self.mean).mean((2, 3))
        return F.normalize(torch.relu(2 * rgb - 1), dim=-1)

    def encode_text(self, tokens):
        self.texts_seen += len(tokens)
        counts = torch.stack([(tokens == i).sum(1) for i in (1, 2, 3)], dim=1).float()
        return F.normalize(counts, dim=-1)


@pytest.fixture
def emb():
    return E.Embedder(ColourModel(), WordTokenizer(), image_size=16, batch_size=3, progress=False)


def solid(path, colour, size=(16, 16)):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def args(**kw):
    base = dict(eval_size=5, shapes_seed=0, seed=0, sugarcrepe=None, sugarcrepe_images=None, crepe=None,
                crepe_images=None, cola=None, cola_images=None, winoground=None, zeroshot=None, classnames=None,
                templates="clip8", retrieval=None, retrieval_images=None, retrieval_split="test",
                linear_probe=None, linear_probe_l2_sweep=False, linear_probe_val_frac=0.2, no_progress=True)
    return types.SimpleNamespace(**(base | kw))


# ----------------------------------------------------------------------------- SugarCrepe

def test_sugarcrepe_strict_ties_and_bad_rows(tmp_path, emb, capsys):
    img = tmp_path / "coco"
    solid(img / "red.jpg", RED), solid(img / "yellow.jpg", YELLOW), solid(img / "blue.jpg", BLUE)
    sc = tmp_path / "sugarcrepe"
    sc.mkdir()
    add_obj = {
        "0": {"filename": "red.jpg", "caption": "a red ball", "negative_caption": "a red and blue ball"},  # 1 > .71
        "1": {"filename": "yellow.jpg", "caption": "red and green", "negative_caption": "red"},           # 1 > .71
        "2": {"filename": "red.jpg", "caption": "a red cube", "negative_caption": "a red red cube"},       # tie: wrong
        "3": {"filename": "blue.jpg", "caption": "a red thing", "negative_caption": "a blue thing"},      # 0 < 1
        "4": {"filename": "red.jpg", "caption": "no negative here"},                                      # malformed
        "5": {"filename": "missing.jpg", "caption": "red", "negative_caption": "blue"},                   # no image
    }
    (sc / "add_obj.json").write_text(json.dumps(add_obj, indent=1))
    (sc / "swap_att.json").write_text(json.dumps({"0": {"filename": "blue.jpg", "caption": "blue",
                                                        "negative_caption": "red blue"}}))
    r = E.bench_sugarcrepe(args(sugarcrepe=str(sc), sugarcrepe_images=str(img)), emb)
    assert r["add_obj"] == {"acc": 50.0, "n_scored": 4, "n_skipped": 2}
    assert r["swap_att"] == {"acc": 100.0, "n_scored": 1, "n_skipped": 0}
    assert r["add_att"] == {"acc": None, "n_scored": 0, "n_skipped": 0, "reason": "add_att.json not found"}
    # no mean over what happened to be readable: 5 subsets absent, add_obj incomplete
    mean = r["sugarcrepe_mean"]
    assert mean["acc"] is None and "add_att" in mean["reason"] and "add_obj (2 skipped)" in mean["reason"]
    assert r["add"]["acc"] is None and r["swap"]["acc"] is None
    err = capsys.readouterr().err
    lines = (sc / "add_obj.json").read_text().splitlines()
    line_4 = next(i for i, s in enumerate(lines, 1) if s.strip().startswith('"4"'))
    assert f"{sc / 'add_obj.json'}:{line_4}:" in err and "row skipped" in err
    assert "missing.jpg not found" in err
    assert "replace_rel.json not found" in err  # absent subsets: one line each, not a crash


def test_embeddings_are_cached_per_unique_image_and_caption(tmp_path, emb):
    solid(tmp_path / "red.png", RED)
    rows = [(E.file_ref(str(tmp_path / "red.png")), "red", "blue")] * 3
    E.pair_accuracy(emb, E.Part(rows))
    E.pair_accuracy(emb, E.Part([(E.file_ref(str(tmp_path / "red.png")), "red", "green")]))
    assert emb.model.images_seen == 1 and emb.model.texts_seen == 3


def test_sugarcrepe_table1_means_only_over_complete_subsets(tmp_path, emb):
    img = tmp_path / "coco"
    solid(img / "red.jpg", RED), solid(img / "blue.jpg", BLUE)
    sc = tmp_path / "sugarcrepe"
    sc.mkdir()
    right = {"filename": "red.jpg", "caption": "red", "negative_caption": "blue"}
    wrong = {"filename": "blue.jpg", "caption": "red", "negative_caption": "blue"}
    # subset i holds i + 1 rows of which the first is wrong: accuracy i / (i + 1); swap_obj under
    # its early name swap_ent.json
    for i, subset in enumerate(E.SUGARCREPE_SUBSETS):
        (sc / f"{subset.replace('swap_obj', 'swap_ent')}.json").write_text(
            json.dumps({str(k): wrong if k == 0 else right for k in range(i + 1)}))
    r = E.bench_sugarcrepe(args(sugarcrepe=str(sc), sugarcrepe_images=str(img)), emb)
    acc = {s: 100 * i / (i + 1) for i, s in enumerate(E.SUGARCREPE_SUBSETS)}
    assert all(r[s]["acc"] == pytest.approx(acc[s], abs=5e-3) for s in acc)
    assert r["add"]["acc"] == pytest.approx((acc["add_obj"] + acc["add_att"]) / 2, abs=0.01)
    assert r["replace"]["acc"] == pytest.approx((acc["replace_obj"] + acc["replace_att"] + acc["replace_rel"]) / 3,
                                                abs=0.01)
    assert r["swap"]["acc"] == pytest.approx((acc["swap_obj"] + acc["swap_att"]) / 2, abs=0.01)
    assert r["sugarcrepe_mean"] == {"acc": pytest.approx(sum(acc.values()) / 7, abs=0.01), "over": 7}
    os.remove(img / "blue.jpg")  # half the images gone: every subset loses its first row
    emb.image_cache.clear()
    r = E.bench_sugarcrepe(args(sugarcrepe=str(sc), sugarcrepe_images=str(img)), emb)
    assert r["add_obj"] == {"acc": None, "n_scored": 0, "n_skipped": 1}
    assert r["swap_att"] == {"acc": 100.0, "n_scored": 6, "n_skipped": 1}
    assert (r["sugarcrepe_mean"]["acc"] is None
            and r["sugarcrepe_mean"]["reason"].startswith("not scored: add_obj; incomplete:"))
    assert E.n_scored(r) == sum(range(7))


def test_missing_files_skip_with_what_was_looked_for(tmp_path, emb):
    with pytest.raises(E.Skip, match="no --sugarcrepe given"):
        E.bench_sugarcrepe(args(), emb)
    with pytest.raises(E.Skip, match="no --sugarcrepe_images given"):
        E.bench_sugarcrepe(args(sugarcrepe=str(tmp_path)), emb)
    # a path given but wrong is the user's mistake: an error, never an empty result
    with pytest.raises(data.DataError, match="nope: not found \\(given as --crepe\\)"):
        E.bench_crepe(args(crepe=str(tmp_path / "nope"), crepe_images=str(tmp_path)), emb)
    with pytest.raises(data.DataError, match="given as --sugarcrepe_images"):
        E.bench_sugarcrepe(args(sugarcrepe=str(tmp_path), sugarcrepe_images=str(tmp_path / "coco")), emb)
    with pytest.raises(E.Skip, match="examples.jsonl"):
        E.bench_winoground(args(winoground=str(tmp_path)), emb)


def test_json_rows_lines_and_invalid_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('[\n ["a", 1],\n\n {"b": 2}\n]')
    assert [(line, key) for line, key, _ in E.json_rows(str(p))] == [(2, 0), (4, 1)]
    p.write_text('{"0": {"a": 1},\n "1": {"a": }\n}')
    with pytest.raises(data.DataError, match=r"x.json: line 2: invalid JSON"):
        E.json_rows(str(p))


# ----------------------------------------------------------------------------- CREPE

def crepe_csv(path, header, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def one2many_rank(image, texts):
    """CREPE's get_one2many_rank (crepe_eval_utils.py), rewritten: the position of the
    positive (index 0) in the texts sorted by descending similarity."""
    ranking = torch.argsort(image[None] @ texts.T, descending=True)
    return int(torch.where(ranking == 0)[1][0])


PROD = ["image_id", "x", "y", "width", "height", "caption", "hard_negs"]


def test_crepe_released_layout_crops_and_counts_ties_wrong(tmp_path, emb, capsys):
    vg = tmp_path / "vg"
    im = Image.new("RGB", (20, 10), RED)
    im.paste(Image.new("RGB", (10, 10), BLUE), (10, 0))  # left half red, right half blue
    os.makedirs(vg / "VG_100K"), os.makedirs(vg / "VG_100K_2"), os.makedirs(vg / "elsewhere")
    im.save(vg / "VG_100K" / "7.jpg"), im.save(vg / "VG_100K_2" / "8.jpg"), im.save(vg / "elsewhere" / "9.jpg")
    crepe = tmp_path / "crepe"
    crepe_csv(crepe / "prod_hard_negatives" / "swap" / "prod_vg_hard_negs_swap_complexity_4.csv", PROD, [
        [7, 0, 0, 10, 10, "red", "['blue', 'green']"],   # red crop: 1 > 0: right
        [8, 10, 0, 10, 10, "red", "['blue']"],           # blue crop (VG_100K_2): 0 < 1: wrong
        [7, 0, 0, 10, 10, "red", "['red red', 'blue']"],  # tie with 'red red': wrong
        [7, 0, 0, 10, 10, "red", "[not a list"],          # malformed: line 5, skipped
        [7, 0, 0, 10, 10, "red", "[]"],                   # no negative: rank 0, right (as the official script)
        [6, 0, 0, 10, 10, "red", "['blue']"]])            # no such image: skipped
    header = ["image_id", "x", "y", "width", "height", "caption", "valid_hard_negs_comp", "valid_hard_negs_atom",
              "image_path"]
    crepe_csv(crepe / "syst_hard_negatives" / "syst_vg_hard_negs_seen_compounds_in_cc12m.csv", header, [
        [7, 0, 0, 10, 10, "red", "['blue']", "['red red']", ""],      # comp right, atom tie: wrong
        # image_path; atom empty: right
        [9, 10, 0, 10, 10, "blue", "['red']", "[]", "/data/visual_genome/elsewhere/9.jpg"]])
    r = E.bench_crepe(args(crepe=str(crepe), crepe_images=str(vg)), emb)
    assert r["productivity/swap/complexity_4"] == {"acc": 50.0, "n_scored": 4, "n_skipped": 2}
    assert r["productivity/swap/mean_4-12"]["acc"] is None  # complexities 5-12 not there
    assert "productivity/swap/complexity_5" in r["productivity/swap/mean_4-12"]["reason"]
    assert r["systematicity/cc12m/seen_compounds/comp"] == {"acc": 100.0, "n_scored": 2, "n_skipped": 0}
    assert r["systematicity/cc12m/seen_compounds/atom"] == {"acc": 50.0, "n_scored": 2, "n_skipped": 0}
    err = capsys.readouterr().err
    assert "prod_vg_hard_negs_swap_complexity_4.csv:5:" in err and "image 6 not found" in err


def test_crepe_matches_get_one2many_rank_and_means_over_complexities(tmp_path, emb):
    """Every productivity type (spelled as CREPE's files: atom, negate, swap) at complexities
    4-12: R@1 equals the official rank's (on tie-free rows) and the per-type mean is the
    mean of the 9; a type with one complexity incomplete has no mean."""
    vg = tmp_path / "VG"
    colours = {1: RED, 2: BLUE, 3: YELLOW}
    for iid, c in colours.items():
        solid(str(vg / "VG_100K" / f"{iid}.jpg"), c)
    g = torch.Generator().manual_seed(0)
    pool = ["red", "blue", "green", "red green", "blue green", "red blue green green"]
    model, tok, tf = ColourModel(), WordTokenizer(), data.eval_transform(16)
    expected = {}
    for kind in ("atom", "negate", "swap"):
        for c in range(4, 13):
            rows, right = [], []
            while len(rows) < 5:
                iid = int(torch.randint(1, 4, (1,), generator=g))
                pick = torch.randperm(len(pool), generator=g)[:int(torch.randint(1, 4, (1,), generator=g))].tolist()
                caption, negs = pool[pick[0]], [pool[k] for k in pick[1:]]
                image = model.encode_image(data.normalize_images(tf(Image.new("RGB", (16, 16), colours[iid]))[None]))[0]
                texts = model.encode_text(tok([caption] + negs))
                if ((texts[1:] @ image) == texts[0] @ image).any():
                    continue  # a tie: the official argsort order is arbitrary there (ours ranks it wrong)
                rows.append([iid, 0, 0, 16, 16, caption, repr(negs)])
                right.append(one2many_rank(image, texts) < 1)
            if kind == "negate" and c == 12:
                rows.append([99, 0, 0, 16, 16, "red", "['blue']"])  # image missing: complexity 12 incomplete
            crepe_csv(tmp_path / "crepe" / kind / f"prod_vg_hard_negs_{kind}_complexity_{c}.csv", PROD, rows)
            expected[(kind, c)] = 100 * sum(right) / len(right)
    r = E.bench_crepe(args(crepe=str(tmp_path / "crepe"), crepe_images=str(vg)), emb)
    for (kind, c), acc in expected.items():
        assert r[f"productivity/{kind}/complexity_{c}"]["acc"] == pytest.approx(acc, abs=5e-3), (kind, c)
    for kind in ("atom", "swap"):
        mean = sum(expected[(kind, c)] for c in range(4, 13)) / 9
        assert r[f"productivity/{kind}/mean_4-12"] == {"acc": pytest.approx(mean, abs=0.01), "over": 9}
    assert r["productivity/negate/mean_4-12"] == {
        "acc": None, "reason": "incomplete: productivity/negate/complexity_12 (1 skipped)"}


# ----------------------------------------------------------------------------- Cola / Winoground
# (image0, caption0, image1, caption1) and s[caption][image]:
#  A red "red" | blue "blue"                 -> text, image, group right
#  B red "red" | yellow "red green"           -> all right (1 > .71 everywhere)
#  C red "red" | yellow "red"                 -> s00 = s10 = 1: text wrong (tie); s11 < s10: image wrong
#  D red "red blue" | yellow "red green"      -> s00 = s10 = .71 (tie): text wrong; .71 > .5, 1 > .71: image right
# text 2/4, image (text -> image) 3/4, group 2/4.
WINO = [("red", "red", "blue", "blue"), ("red", "red", "yellow", "red green"), ("red", "red", "yellow", "red"),
        ("red", "red blue", "yellow", "red green")]


def colour_images(root):
    for name, c in (("red", RED), ("blue", BLUE), ("yellow", YELLOW)):
        solid(os.path.join(root, f"{name}.png"), c)


def test_cola_multi_object(tmp_path, emb, capsys):
    colour_images(tmp_path / "imgs")
    rows = [[f"https://host/x/{i0}.png", c0, f"{i1}.png", c1] for i0, c0, i1, c1 in WINO] + [["red.png", "red"]]
    (tmp_path / "cola.json").write_text(json.dumps(rows))
    r = E.bench_cola(args(cola=str(tmp_path / "cola.json"), cola_images=str(tmp_path / "imgs")), emb)
    assert (r["t2i"], r["i2t"], r["group"], r["n_scored"], r["n_skipped"]) == (75.0, 50.0, 50.0, 4, 1)
    assert "cola.json:1:" in capsys.readouterr().err  # a one-line JSON: the bad row is on line 1


def test_cola_finds_visual_genome_images_in_its_released_folders(tmp_path, emb):
    """Cola's rows name Visual Genome URLs; with --cola_images vg/ (as for CREPE) the images are
    in vg/VG_100K/ and vg/VG_100K_2/."""
    for sub, name, c in (("VG_100K", "1", RED), ("VG_100K_2", "2", BLUE), ("VG_100K", "3", YELLOW)):
        solid(os.path.join(tmp_path, "vg", sub, f"{name}.jpg"), c)
    url = "https://cs.stanford.edu/people/rak248/{}/{}.jpg"
    rows = [[url.format("VG_100K", 1), "red", url.format("VG_100K_2", 2), "blue"],
            [url.format("VG_100K", 3), "yellow", url.format("VG_100K_2", 2), "blue"]]
    (tmp_path / "cola.json").write_text(json.dumps(rows))
    r = E.bench_cola(args(cola=str(tmp_path / "cola.json"), cola_images=str(tmp_path / "vg")), emb)
    assert (r["n_scored"], r["n_skipped"]) == (2, 0)


def winoground_examples(folder, rows):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "examples.jsonl"), "w") as f:
        for k, (i0, c0, i1, c1) in enumerate(rows):
            f.write(json.dumps({"id": k, "image_0": i0, "image_1": i1, "caption_0": c0, "caption_1": c1,
                                "tag": "Object", "secondary_tag": "", "num_main_preds": 1,
                                "collapsed_tag": "Object"}) + "\n")


def test_winoground_scores(tmp_path, emb):
    colour_images(tmp_path / "wino" / "images")
    winoground_examples(tmp_path / "wino", WINO)
    r = E.bench_winoground(args(winoground=str(tmp_path / "wino")), emb)
    assert (r["text"], r["image"], r["group"], r["n_scored"], r["n_skipped"]) == (50.0, 75.0, 50.0, 4, 0)


def test_winoground_reads_images_zip_of_the_hf_release(tmp_path, emb):
    """facebook/winoground on the Hub: data/examples.jsonl and data/images.zip (images/{name}.png
    inside), read without unzipping; a missing member is a skipped row."""
    colour_images(tmp_path / "png")
    with zipfile.ZipFile(tmp_path / "hf" / "data" / "images.zip"
                         if os.makedirs(tmp_path / "hf" / "data") is None else "", "w") as z:
        for name in ("red", "blue", "yellow"):
            z.write(tmp_path / "png" / f"{name}.png", f"images/{name}.png")
    winoground_examples(tmp_path / "hf" / "data", WINO + [("red", "red", "green", "green")])
    r = E.bench_winoground(args(winoground=str(tmp_path / "hf")), emb)
    assert (r["text"], r["image"], r["group"], r["n_scored"], r["n_skipped"]) == (50.0, 75.0, 50.0, 4, 1)
    (tmp_path / "empty" / "data").mkdir(parents=True)
    winoground_examples(tmp_path / "empty" / "data", WINO)  # neither images/ nor images.zip
    r = E.bench_winoground(args(winoground=str(tmp_path / "empty")), emb)
    assert r["text"] is None and (r["n_scored"], r["n_skipped"]) == (0, 4) and E.n_scored(r) == 0


def test_winoground_scores_formula_on_hand_matrices():
    s = torch.tensor([[[1.0, 0.0], [0.0, 1.0]],     # all right
                      [[0.5, 0.4], [0.6, 0.9]],     # image right; text: 0.5 > 0.6 no
                      [[0.5, 0.5], [0.1, 0.9]]])    # image tie: wrong; text right
    r = E.winoground_scores(s)
    assert (r["text"], r["image"], r["group"]) == (66.67, 66.67, 33.33)    # percent, 2 decimals


# ----------------------------------------------------------------------------- shapes

def test_shapes_matches_an_independent_loop(emb):
    bench = data.shapes_benchmark(seed=0, n=5)
    r = E.bench_shapes(args(), emb)
    m, tok, tf = ColourModel(), WordTokenizer(), data.eval_transform(16)
    for cat in data.SHAPES_CATEGORIES:
        right = 0
        for it in bench[cat]:
            i = m.encode_image(data.normalize_images(tf(it["image"])[None]))[0]
            p, n = m.encode_text(tok([it["caption"], it["negative_caption"]]))
            right += float((i * p).sum()) > float((i * n).sum())
        assert r[cat] == pytest.approx(100 * right / 5), cat
    for split in ("systematicity", "productivity"):
        right = 0
        for it in bench[split]:
            i = m.encode_image(data.normalize_images(tf(it["image"])[None]))[0]
            s = (m.encode_text(tok([it["caption"]] + it["negatives"])) * i).sum(-1)
            right += bool(s[0] > s[1:].max())
        assert r[split] == pytest.approx(100 * right / 5), split


# ----------------------------------------------------------------------------- zero-shot

def test_zeroshot_template_averaging_and_topk(tmp_path, emb):
    classnames, templates = ["red", "green", "blue"], ["a {} photo", "a {} and red photo"]
    w = E.zeroshot_weights(emb, classnames, templates)
    m, tok = ColourModel(), WordTokenizer()
    for c, name in enumerate(classnames):  # independent: per-template unit vectors, mean, unit
        vs = [m.encode_text(tok(t.format(name)))[0] for t in templates]
        v = sum(x / x.norm() for x in vs) / len(vs)
        assert torch.allclose(w[c], v / v.norm(), atol=1e-6)
    folder = tmp_path / "folder"
    solid(folder / "red" / "a.png", RED), solid(folder / "green" / "b.png", GREEN)
    solid(folder / "green" / "c.png", YELLOW)   # (.38, .92, 0) . yellow = .92 > red's .71: green
    solid(folder / "blue" / "d.png", BLUE), solid(folder / "blue" / "e.png", RED)  # the one miss
    (tmp_path / "templates.txt").write_text("\n".join(templates))
    r = E.bench_zeroshot(args(zeroshot=str(folder), templates=str(tmp_path / "templates.txt")), emb)
    # 3 classes: top-5 would be trivially 100, so it is null; recall red 1/1, green 2/2, blue 1/2
    assert (r["top1"], r["top5"], r["n_scored"], r["classes"], r["templates"]) == (80.0, None, 5, 3, 2)
    assert r["mean_per_class_recall"] == pytest.approx(100 * (1 + 1 + 0.5) / 3, abs=5e-3)


def test_classification_scores_against_a_loop():
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(50, 7, generator=g), torch.randint(0, 6, (50,), generator=g)  # class 6 never a label
    r = E.classification_scores(logits, labels)
    order = logits.argsort(1, descending=True)
    assert r["top1"] == pytest.approx(100 * sum(int(order[i, 0] == labels[i]) for i in range(50)) / 50, abs=5e-3)
    assert r["top5"] == pytest.approx(100 * sum(int(labels[i] in order[i, :5]) for i in range(50)) / 50, abs=5e-3)
    present = sorted(set(labels.tolist()))
    recall = [sum(int(order[i, 0] == c) for i in range(50) if labels[i] == c) / int((labels == c).sum())
              for c in present]
    assert r["mean_per_class_recall"] == pytest.approx(100 * sum(recall) / len(recall), abs=5e-3)


def test_openai_imagenet_templates_by_name(tmp_path):
    assert len(E.read_templates("openai_imagenet")) == 80 and len(set(E.TEMPLATES["openai_imagenet"])) == 80
    assert all("{}" in t for t in E.TEMPLATES["openai_imagenet"])
    with pytest.raises(data.DataError, match="not a template file nor one of clip8, openai_imagenet"):
        E.read_templates(str(tmp_path / "nope.txt"))
    spec = importlib.util.find_spec("open_clip")
    if spec is None:
        pytest.skip("open_clip_torch is not installed")
    path = os.path.join(os.path.dirname(spec.origin), "zero_shot_metadata.py")
    mod_spec = importlib.util.spec_from_file_location("zero_shot_metadata", path)  # no torchvision needed
    meta = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(meta)
    assert E.TEMPLATES["openai_imagenet"] == [f("{}") for f in meta.OPENAI_IMAGENET_TEMPLATES]


# ----------------------------------------------------------------------------- retrieval

def test_recall_at_k_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    sim = torch.randn(30, 60, generator=g)
    owner = torch.arange(60) // 2                      # two captions per image
    positive = owner[None] == torch.arange(30)[:, None]
    for s, p in ((sim, positive), (sim.T, positive.T)):
        r = E.recall_at_k(s, p, ks=(1, 5, 10), chunk=7)
        for k in (1, 5, 10):
            top = s.argsort(dim=1, descending=True)[:, :k]
            brute = sum(bool(p[q, top[q]].any()) for q in range(len(s))) / len(s)
            assert r[k] == round(100 * brute, 2)


def test_recall_ties_rank_against_the_positive():
    sim = torch.tensor([[1.0, 1.0, 0.0]])
    assert E.recall_at_k(sim, torch.tensor([[True, False, False]]), ks=(1, 2)) == {1: 0.0, 2: 100.0}


def test_retrieval_on_karpathy_json(tmp_path, emb):
    root = tmp_path / "coco"
    colour_images(root / "val2014")
    solid(root / "val2014" / "red2.png", RED)
    images = [{"filepath": "val2014", "filename": "red.png", "split": "test",
               "sentences": [{"raw": "red"}, {"raw": "red thing"}]},
              {"filepath": "val2014", "filename": "blue.png", "split": "test", "sentences": [{"raw": "blue"}]},
              {"filepath": "val2014", "filename": "yellow.png", "split": "test", "sentences": [{"raw": "red green"}]},
              # a train image that would tie with red.png for "red" if the split were ignored
              {"filepath": "val2014", "filename": "red2.png", "split": "train", "sentences": [{"raw": "green"}]}]
    (tmp_path / "karpathy.json").write_text(json.dumps({"images": images}))
    r = E.bench_retrieval(args(retrieval=str(tmp_path / "karpathy.json"), retrieval_images=str(root)), emb)
    assert (r["i2t_r1"], r["t2i_r1"], r["n_scored"], r["n_skipped"], r["n_captions"]) == (100.0, 100.0, 3, 0, 4)
    # one test image gone: R@K over the 2 left would be easier than the benchmark's, so none is given
    os.remove(root / "val2014" / "blue.png")
    fresh = E.Embedder(ColourModel(), WordTokenizer(), image_size=16, batch_size=3, progress=False)  # no cache
    with pytest.raises(data.DataError, match="1 of 3 images could not be read.*R@K over a smaller gallery"):
        E.bench_retrieval(args(retrieval=str(tmp_path / "karpathy.json"), retrieval_images=str(root)), fresh)


def test_a_benchmark_without_its_data_flag_is_not_run(emb, capsys):
    """--benchmarks zeroshot,retrieval,linear_probe with no data flags: all three skipped with the
    flag they lack (shapes runs only when named), nothing scored."""
    a = E.get_args(["--init", "w.pt", "--benchmarks", "zeroshot,retrieval,linear_probe"])
    results, skipped, failed = E.run_benchmarks(a, emb, None, None, {})
    assert results == {} and failed == {}
    assert skipped == {"zeroshot": "no --zeroshot given", "retrieval": "no --retrieval given",
                       "linear_probe": "no --linear_probe given"}
    a = E.get_args(["--init", "w.pt", "--benchmarks", "retrieval", "--retrieval", "shapes", "--eval_size", "5"])
    assert E.run_benchmarks(a, emb, None, None, {})[0]["retrieval"]["n_scored"] == data.SHAPES_VAL_PAIRS


# ----------------------------------------------------------------------------- linear probe

def blobs(n, spread, g, centres):
    y = torch.arange(n) % 3
    return centres[y] + spread * torch.randn(n, 8, generator=g), y


def test_linear_probe_separable_blobs(monkeypatch):
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(3, 8, generator=g) * 4
    (tx, ty), (vx, vy) = blobs(60, 0.3, g, centres), blobs(30, 0.3, g, centres)
    r = E.linear_probe(tx, ty, vx, vy, 3, sweep=False)          # no weight decay: no finite optimum
    assert r["top1"] == 100.0 and r["weight_decay"] == 0.0 and "val_top1" not in r
    monkeypatch.setattr(E, "L2_SWEEP", (1e-4, 1e-2, 100.0))
    r = E.linear_probe(tx, ty, vx, vy, 3)                       # the default: swept on held-out train
    assert r["top1"] == 100.0 and r["weight_decay"] in (1e-4, 1e-2) and r["converged"]  # 100 underfits


@pytest.mark.parametrize("spread", [0.3, 3.0])   # separable, and overlapping (non-separable) classes
def test_logistic_fit_converges_to_the_regularised_optimum(spread):
    """The fitted model is the optimum of mean CE + wd |W|^2: its gradient vanishes (checked in
    float64 by autograd), and it equals scikit-learn's fit with C = 1 / (2 wd n) where installed."""
    g = torch.Generator().manual_seed(1)
    centres = torch.randn(3, 8, generator=g) * 2
    x, y = blobs(90, spread, g, centres)
    wd = 1e-3
    w, b, fit = E.fit_logistic(x, y, 3, wd)
    assert fit["converged"] and fit["iterations"] < 1000
    w64, b64 = w.double().requires_grad_(), b.double().requires_grad_()
    loss = F.cross_entropy(x.double() @ w64 + b64, y) + wd * (w64 * w64).sum()
    loss.backward()
    assert float(w64.grad.abs().max()) < 1e-5 and float(b64.grad.abs().max()) < 1e-5
    sklearn = pytest.importorskip("sklearn.linear_model")
    x64 = x.double().numpy()      # (scikit-learn fits float32 input in float32)
    ref = sklearn.LogisticRegression(C=1 / (2 * wd * len(x)), tol=1e-10, max_iter=10_000).fit(x64, y.numpy())
    probs = torch.softmax(x.double() @ w.double() + b.double(), 1).numpy()
    assert np.abs(probs - ref.predict_proba(x64)).max() < 5e-5


# ----------------------------------------------------------------------------- spectral norms

def test_spectral_product_equals_product_of_numpy_singular_values():
    """Against numpy's SVD, including a matrix whose top two singular values nearly tie (where
    power iteration converges slowly)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 4))
    with torch.no_grad():
        u, _, vt = torch.linalg.svd(torch.randn(12, 16), full_matrices=False)
        model[2].weight.copy_(u @ torch.diag(torch.tensor([3.0, 2.999] + [1.0] * 10)) @ vt)
    exact = math.prod(float(np.linalg.svd(m.weight.detach().double().numpy(), compute_uv=False)[0])
                      for m in model if isinstance(m, nn.Linear))
    r = E.spectral_product(model)
    assert r["layers"] == 3
    assert 10 ** r["log10_product"] == pytest.approx(exact, rel=5e-6)   # the log is rounded to 6 places
    assert r["spectral_norms"]["2.weight"] == pytest.approx(3.0, rel=1e-6)
    conv = torch.randn(6, 3, 4, 4)
    assert E.spectral_norm(conv) == pytest.approx(float(np.linalg.svd(conv.reshape(6, -1).double().numpy(),
                                                                      compute_uv=False)[0]), rel=1e-12)


# ----------------------------------------------------------------------------- PNGs

def test_pngs_are_drawn_with_matplotlib_and_read_as_their_data(tmp_path):
    """draw_line_plot: each series its points (a NaN left out), in the order given, each with its own marker and
    dash (equal series stay visible), values not offsets on y, whole numbers on x; draw_image_grid: a row per label,
    each image once, the title wrapped onto the canvas."""
    series = {"a": [(0, 3.6381), (10, 3.6385), (20, 3.6389)], "b": [(0, 3.6381), (10, 3.6385), (20, 3.6389)],
              "c": [(0, 3.6383), (10, float("nan")), (20, 3.6384)]}
    fig = E.draw_line_plot(str(tmp_path / "p.png"), series, "a title", "probe step", "accuracy (%)")
    (ax,) = read_figure(fig)
    assert Image.open(tmp_path / "p.png").size == (900, 420)
    assert (ax["title"], ax["xlabel"], ax["ylabel"], ax["legend"]) == ("a title", "probe step", "accuracy (%)",
                                                                      ["a", "b", "c"])
    assert [(label, xs, ys) for label, xs, ys, _ in ax["lines"]] == [
        ("a", [0, 10, 20], [3.6381, 3.6385, 3.6389]), ("b", [0, 10, 20], [3.6381, 3.6385, 3.6389]),
        ("c", [0, 20], [3.6383, 3.6384])]
    styles = [(line.get_marker(), line.get_linestyle()) for *_, line in ax["lines"]]
    assert len(set(styles)) == 3 and ax["lines"][0][3].get_linewidth() > ax["lines"][1][3].get_linewidth()
    assert all(t.startswith("3.638") for t in ax["yticks"]) and all(t.isdigit() for t in ax["xticks"])
    images = [Image.new("RGB", (8, 8), RED), Image.new("RGB", (8, 8), GREEN)]
    fig = E.draw_image_grid(str(tmp_path / "g.png"), [("code 3", images), ("code 7", images[:1])], "codes " * 20)
    read_figure(fig)
    assert [a.get_ylabel() for a in fig.axes[::2]] == ["code 3", "code 7"]
    assert [len(a.get_images()) for a in fig.axes] == [1, 1, 1, 0]
    assert fig.axes[0].get_images()[0].get_array()[0, 0].tolist() == list(RED)
    assert Image.open(tmp_path / "g.png").size == tuple(round(v * 100) for v in fig.get_size_inches())


def test_spectral_product_is_no_lipschitz_bound_of_a_residual_block():
    """Why the figure is not called a bound: for f(x) = x + W2 relu(W1 x) the product of the
    spectral norms is tiny while a measured |f(x) - f(y)| / |x - y| is about 1 (the residual
    path); and LayerNorm's slope grows (up to |gain| / sqrt(eps)) as the input's spread shrinks."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    with torch.no_grad():
        for m in (block[0], block[2]):
            m.weight.mul_(1e-3)
    product = 10 ** E.spectral_product(block)["log10_product"]
    x, y = torch.randn(64, 16), torch.randn(64, 16)
    with torch.no_grad():
        ratio = ((x + block(x)) - (y + block(y))).norm(dim=1) / (x - y).norm(dim=1)
    assert product < 1e-5 and ratio.min() > 0.99
    ln, base, d = nn.LayerNorm(16), torch.randn(1, 16), 1e-6 * torch.randn(1, 16)
    with torch.no_grad():
        slope = [float((ln(base * s + d) - ln(base * s)).norm() / d.norm()) for s in (1.0, 1e-2)]
    assert slope[1] > 50 * slope[0]


# ----------------------------------------------------------------------------- easy-to-learn probe

def test_easy_to_learn_held_out_pairs_are_never_trained_on(tmp_path):
    """For every --probe_data kind the probe's held-out pairs and its training pairs share no
    key: the val split of shapes and of a Karpathy JSON, a seeded ~10% of CSV rows, tar shard
    members and ImageFolder files (their readers have no split)."""
    out = tmp_path / "export"
    assert data.main(["make-shapes", "--out_dir", str(out), "--train", "120", "--test", "60",
                      "--shard_size", "40"]) == 0
    tok = data.build_tokenizer(captions=data.shapes_captions(200), vocab_size=300, context_length=32)
    a = types.SimpleNamespace(probe_seed=3, probe_batch=8, probe_eval_size=64)
    specs = {"shapes": "shapes:train_size=120", "karpathy": str(out / "karpathy" / "dataset_shapes.json"),
             "csv": str(out / "csv" / "train.tsv"), "tar": str(out / "shards" / "{00000..00002}.tar"),
             "imagefolder": str(out / "imagefolder" / "train")}
    for kind, spec in specs.items():
        kw = {"image_root": None, "csv_img_key": "filepath", "csv_caption_key": "title", "csv_separator": None}
        assert (E.held_out_rule(spec, kw, 3) is None) == (kind in ("shapes", "karpathy")), kind
        train, val = E.probe_batches(spec, kw, tok, 32, a)
        held = {k for b in val for k in b["key"]}
        seen = {k for _, b in zip(range(40), train) for k in b["key"]}   # 40 batches: every epoch's pairs
        assert held and seen and not held & seen, kind


@pytest.fixture(scope="module")
def il_run(tmp_path_factory):
    """A 3-step il_clip.py IL run: gen0/ (end of warm-up), gen1/, gen2/ (= the final weights)."""
    import il_clip
    out = str(tmp_path_factory.mktemp("il") / "run")
    assert il_clip.main(["--model_args", "width=32", "layers=1", "heads=2", "embed_dim=32", "image_size=32",
                         "patch_size=8", "code_dim=32", "--batch_size", "8", "--eval_size", "0", "--warmup", "1",
                         "--rewarm", "1", "--vocab_size", "300", "--method", "il", "--codebook", "32", "--t_warm", "1",
                         "--t_distill", "1", "--t_interact", "0", "--generations", "2", "--t_extend", "0",
                         "--out_dir", out]) == 0
    return out


def probe_args(run, tmp_path, *extra):
    return E.get_args(["--ckpt", run, "--plot_dir", str(tmp_path), "--probe_steps", "6", "--probe_eval_every", "2",
                       "--probe_eval_size", "16", "--probe_batch", "8", "--probe_lr", "1e-2", "--probe_auc_steps", "4",
                       "--no_progress", *extra])


def test_easy_to_learn_probes_every_checkpoint_at_one_fixed_logit_scale(il_run, tmp_path):
    """The checkpoint's learnt logit scale no longer reaches the probe; --probe_logit_scale does."""
    a = probe_args(il_run, tmp_path)
    model, tok, config = E.load_checkpoint(il_run, a)
    spec, kw = E.analysis_data(a, config, "probe_data")
    curve = E.easy_to_learn_curve(model, tok, config, a, spec, kw)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(100.0))         # was ln(1/0.07) + 3 steps of training
    assert E.easy_to_learn_curve(model, tok, config, a, spec, kw) == curve
    a.probe_logit_scale = 100.0                          # the probe's own scale does reach the loss
    assert E.easy_to_learn_curve(model, tok, config, a, spec, kw) != curve
    assert E.get_args(["--ckpt", il_run]).probe_logit_scale == pytest.approx(14.2857, abs=1e-4)
    for bad in (["--probe_logit_scale", "0"], ["--probe_auc_steps", "19"], ["--probe_auc_steps", "3",
                                                                             "--probe_steps", "4"]):
        with pytest.raises(E.ConfigError, match=bad[0]):
            E.get_args(["--ckpt", il_run] + bad)


def test_easy_to_learn_auc_is_the_mean_accuracy_up_to_n_steps():
    curve = [(0, 5.0), (20, 40.0), (40, 55.0), (60, 70.0), (80, 90.0), (90, 91.0)]
    assert E.curve_auc(curve, 60) == (40.0 + 55.0 + 70.0) / 3            # step 0 (before learning) left out
    assert E.curve_auc(curve, 59) == 47.5 and E.curve_auc(curve, 20) == 40.0
    assert E.curve_auc(curve, 1000) == pytest.approx((40 + 55 + 70 + 90 + 91) / 5)


def test_easy_to_learn_one_curve_per_generation_snapshot(il_run, tmp_path):
    a = probe_args(il_run, tmp_path, "--probe_generations")
    model, tok, config = E.load_checkpoint(il_run, a)
    r = E.bench_easy_to_learn(a, model, tok, config)
    run = r["run"]
    assert r["logit_scale"] == pytest.approx(1 / 0.07) and r["auc_steps"] == 4
    assert [g["snapshot"] for g in run["generations"]] == ["gen0", "gen1", "gen2"]
    for entry in [run] + run["generations"]:
        accs = {p["step"]: p["acc"] for p in entry["curve"]}
        assert list(accs) == [0, 2, 4, 6] and entry["final"] == accs[6]
        assert entry["auc"] == round((accs[2] + accs[4]) / 2, 2)     # by hand: steps 2 and 4
    assert run["generations"][-1]["curve"] == run["curve"]          # gen2/ holds the final weights
    assert os.path.getsize(tmp_path / "easy_to_learn.png") > 0
    # each snapshot is probed with its own weights: a gen1/ whose codebook is redrawn learns otherwise
    from safetensors.torch import load_file, save_file
    other = str(tmp_path / "other")
    shutil.copytree(il_run, other)
    sd = load_file(os.path.join(other, "gen1", "model.safetensors"))
    sd["codebook"] = torch.randn(sd["codebook"].shape, generator=torch.Generator().manual_seed(5))
    save_file(sd, os.path.join(other, "gen1", "model.safetensors"))
    gens = E.bench_easy_to_learn(probe_args(other, tmp_path, "--probe_generations"), model, tok, config)["other"]
    assert gens["generations"][0] == run["generations"][0] and gens["generations"][1] != run["generations"][1]
    # without the flag: the checkpoint alone, same curve
    a = probe_args(il_run, tmp_path)
    assert E.bench_easy_to_learn(a, model, tok, config)["run"] == {k: v for k, v in run.items() if k != "generations"}


# ----------------------------------------------------------------------------- results over seeds
def test_t_interval_against_hand_computation_and_scipy():
    """The 95% t-interval of 5 values, computed by hand: mean 0.6, s = sqrt(0.025) = 0.158114,
    t(0.975, 4) = 2.7764 -> half-width 2.7764 * 0.158114 / sqrt(5) = 0.196324."""
    m, h = lifecycle.mean_ci([0.4, 0.5, 0.6, 0.7, 0.8])
    assert m == pytest.approx(0.6) and h == pytest.approx(0.196324, abs=1e-5)
    assert math.isnan(lifecycle.mean_ci([0.3])[1])
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 7, 30, 31, 45, 200):
        assert lifecycle.t975(df) == pytest.approx(scipy_stats.t.ppf(0.975, df), abs=2e-4)


def test_paired_difference_uses_shared_seeds_only():
    """A - B over the seeds both ran; its interval is the t-interval of the per-seed differences,
    narrower than the unpaired spread when the seeds move both methods together."""
    a = {0: 0.70, 1: 0.80, 2: 0.60, 3: 0.75, 9: 0.1}
    b = {0: 0.68, 1: 0.77, 2: 0.57, 3: 0.73, 5: 0.9}
    m, h, n = lifecycle.paired_diff(a, b)
    d = np.array([0.02, 0.03, 0.03, 0.02])
    assert n == 4 and m == pytest.approx(d.mean())
    assert h == pytest.approx(lifecycle.T975[2] * d.std(ddof=1) / 2)   # df = 3
    assert m - h > 0                                   # excludes zero although the groups overlap
    assert lifecycle.paired_diff({0: 1.0}, {1: 1.0})[2] == 0


def test_summarize_runs_means_and_intervals_over_seeds(tmp_path, capsys):
    """Runs grouped by config method (+neg), mean ± 95% t-interval over seeds, paired differences
    against the baseline on shared seeds, folders without both files skipped; against numpy."""
    rng = np.random.default_rng(0)
    runs = {"a0": ("il", False, 0), "a1": ("il", False, 1), "a2": ("il", False, 2), "b0": ("il", True, 0),
            "c0": ("clip", False, 0), "c1": ("clip", False, 1), "c2": ("clip", False, 2)}
    written = {}
    for d, (method, neg, seed) in runs.items():
        res = {k: float(rng.uniform()) for k in ["i2t_r1", "t2i_r1", *data.SHAPES_CATEGORIES]}
        os.makedirs(tmp_path / d)
        lifecycle.save_json(str(tmp_path / d / "config.json"), {"method": method, "negatives": neg, "seed": seed})
        lifecycle.save_json(str(tmp_path / d / "shapes_eval.json"), res)
        written.setdefault(method + ("+neg" if neg else ""), []).append(res)
    os.makedirs(tmp_path / "incomplete")            # no shapes_eval.json: not counted
    lifecycle.save_json(str(tmp_path / "incomplete" / "config.json"), {"method": "il"})
    groups = E.summarize_runs(str(tmp_path), baseline="clip")
    assert {k: len(v["i2t_r1"]) for k, v in groups.items()} == {"il": 3, "il+neg": 1, "clip": 3}
    out = capsys.readouterr().out.splitlines()
    col = 1 + 2 + data.SHAPES_CATEGORIES.index("replace_att")
    il = np.array([r["replace_att"] for r in written["il"]])
    cell = next(ln for ln in out if ln.startswith("| il (3) |")).split(" | ")[col]
    assert cell == f"{100 * il.mean():.1f} ± {100 * lifecycle.T975[1] * il.std(ddof=1) / np.sqrt(3):.1f}"
    d = il - np.array([r["replace_att"] for r in written["clip"]])
    cell = next(ln for ln in out if ln.startswith("| il - clip (3) |")).split(" | ")[col]
    assert cell.rstrip("*") == f"{100 * d.mean():+.1f} ± {100 * lifecycle.T975[1] * d.std(ddof=1) / np.sqrt(3):.1f}"
    assert next(ln for ln in out if ln.startswith("| il+neg - clip (1) |"))
    means = [np.mean([r[c] for c in data.SHAPES_CATEGORIES]) for r in written["il"]]
    assert np.allclose(list(groups["il"]["sugarcrepe_mean"].values()), means)
    with pytest.raises(data.DataError):
        E.summarize_runs(str(tmp_path / "incomplete"))
    with pytest.raises(data.DataError, match="no such folder"):
        E.summarize_runs(str(tmp_path / "missing"))


def test_shapes_run_reads_the_easy_to_learn_probe(tmp_path):
    """A run folder with the easy_to_learn JSON gains the probe's accuracy at step 20 and at its
    last step (fractions); 'scored' is not a metric."""
    lifecycle.save_json(str(tmp_path / "config.json"), {"method": "il", "seed": 3})
    res = {k: 0.5 for k in ["i2t_r1", "t2i_r1", *data.SHAPES_CATEGORIES]}
    lifecycle.save_json(str(tmp_path / "shapes_eval.json"), res | {"scored": {"items_per_category": 1000}})
    assert "probe_final" not in E.shapes_run(str(tmp_path))[2]
    curve = [{"step": 0, "acc": 1.0}, {"step": 20, "acc": 40.0}, {"step": 40, "acc": 55.5}]
    lifecycle.save_json(str(tmp_path / "probe.json"), {"results": {"easy_to_learn": {
        "run": {"final": 55.5, "curve": curve}, "data": "shapes", "seed": 1234, "steps": 40}}})
    method, seed, got = E.shapes_run(str(tmp_path))
    assert (method, seed) == ("il", 3) and "scored" not in got and "probe_auc" not in got   # written before auc
    assert got["probe_step20"] == pytest.approx(0.40) and got["probe_final"] == pytest.approx(0.555)
    lifecycle.save_json(str(tmp_path / "probe.json"), {"results": {"easy_to_learn": {
        "run": {"final": 55.5, "auc": 47.75, "curve": curve}, "data": "shapes", "auc_steps": 40}}})
    assert E.shapes_run(str(tmp_path))[2]["probe_auc"] == pytest.approx(0.4775)
    lifecycle.save_json(str(tmp_path / "probe.json"), {"results": {"easy_to_learn": {
        "run": {"final": 55.5, "curve": curve[::2]}, "data": "shapes"}}})    # no step 20: one clear error
    with pytest.raises(data.DataError, match="step 20"):
        E.shapes_run(str(tmp_path))


def test_shapes_runs_in_percent_and_older_fraction_files_read_alike(tmp_path, capsys):
    """il_clip.py's shapes_eval.json in percent (reporting's names, sugarcrepe_mean among them) and one written
    before that switch (fractions, no sugarcrepe_mean) give the same results and table: told apart by the key,
    not by size (productivity 0.4% is below 1 in percent)."""
    frac = {"i2t_r1": 0.149, "t2i_r1": 0.2, **{c: 0.5 + 0.01 * i for i, c in enumerate(data.SHAPES_CATEGORIES)},
            "systematicity": 0.3, "productivity": 0.004}
    percent = {k: round(100 * v, 2) for k, v in frac.items()}
    percent["sugarcrepe_mean"] = round(sum(percent[c] for c in data.SHAPES_CATEGORIES) / 7, 2)
    got, tables = {}, {}
    for name, res in (("fractions", frac), ("percent", percent)):
        run = tmp_path / name / "run0"
        os.makedirs(run)
        lifecycle.save_json(str(run / "config.json"), {"method": "il", "seed": 0})
        lifecycle.save_json(str(run / "shapes_eval.json"), res | {"scored": {"items_per_category": 1000}})
        got[name] = E.shapes_run(str(run))[2]
        E.summarize_runs(str(tmp_path / name))
        tables[name] = capsys.readouterr().out
    assert got["percent"] == pytest.approx(got["fractions"], abs=1e-6) and set(got["percent"]) == set(got["fractions"])
    assert got["percent"]["productivity"] == pytest.approx(0.004) and got["percent"]["i2t_r1"] == pytest.approx(0.149)
    assert tables["percent"] == tables["fractions"] and "| 14.9 | 20.0 |" in tables["percent"]


def test_il_clip_end_of_run_table_equals_eval_compositional():
    """il_clip.py's end of run and eval_compositional.py's shapes benchmark score with one function
    (data.score_shapes; test_shapes_matches_an_independent_loop checks it); eval's --retrieval shapes, a
    scorer of its own, gives the end of run's R@1 on the same gallery."""
    import il_clip
    tok = data.build_tokenizer(captions=data.captions_for_tokenizer("shapes", 2000), vocab_size=300)
    cfg = il_clip.ModelConfig(**{**il_clip.MODEL_PRESETS["tiny"], "vocab_size": tok.vocab_size,
                                 "context_length": tok.context_length, "eot_token_id": tok.eot_id})
    model = il_clip.CLIP(cfg, seed=3).eval()
    ours = E.shapes_percent(il_clip.evaluate_shapes(model, tok, n=12, batch_size=5))   # its default gallery
    emb = E.Embedder(model, tok, image_size=cfg.image_size, batch_size=7, progress=False)
    ref = E.bench_shapes(args(eval_size=12), emb)
    for cat in [*data.SHAPES_CATEGORIES, "systematicity", "productivity", "sugarcrepe_mean"]:
        assert ref[cat] == pytest.approx(ours[cat], abs=0.01), cat   # eval rounds to 2 places
    assert len({round(ref[c]) for c in data.SHAPES_CATEGORIES}) > 1   # not all the same trivial score
    # --retrieval shapes is the same gallery (SHAPES_VAL_PAIRS val scenes, some captions repeated: a hit for every
    # scene a caption describes), so i2t_r1 / t2i_r1 mean one thing in both
    ret = E.bench_retrieval(args(retrieval="shapes"), emb)
    assert ret["n_scored"] == ret["n_captions"] == data.SHAPES_VAL_PAIRS
    assert len({data.shapes_scene("val", i).caption for i in range(data.SHAPES_VAL_PAIRS)}) < data.SHAPES_VAL_PAIRS
    assert (ret["i2t_r1"], ret["t2i_r1"]) == (round(ours["i2t_r1"], 2), round(ours["t2i_r1"], 2))
    assert 0 < ret["t2i_r1"] < 100 and ret["i2t_r1"] <= ret["i2t_r5"] <= ret["i2t_r10"]
