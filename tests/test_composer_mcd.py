"""composer.py mcd (issue 43 item 6): a --targets value out of the pool's reachable compound-divergence range is refused
in one line, with a tolerance relative to that range."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import composer as C  # noqa: E402

pytest.importorskip("data")

# the windows of the README's shapes split (20000 train captions, a 5000-image test pool, size 1000): 0.0043..0.0258
SHAPES_WINDOWS = [{"start": 100 * i, "compound_divergence": cd} for i, cd in
                  enumerate([0.02579, 0.02206, 0.02072, 0.01811, 0.0121, 0.0076, 0.0043, 0.0051])]


def test_tolerance_is_a_fraction_of_the_reachable_range():
    # an absolute 0.01 took 0.035 (0.0092 above the pool's maximum) and 0.0 (0.0043 below its minimum) as reachable
    p = C.target_problems([0.035, 0.0], SHAPES_WINDOWS, 0.05)
    assert len(p) == 2 and p[0].startswith("target 0.035 is out of reach") and "0.0043..0.02579" in p[0]
    assert p[1].startswith("target 0 is out of reach") and "nearest reachable compound divergence 0.0043" in p[1]
    # in reach: a window's own divergence, and a target within 5% of the range (0.00107) of one
    assert C.target_problems([0.0043, 0.0131, 0.0266], SHAPES_WINDOWS, 0.05) == []
    assert C.target_problems([0.0271], SHAPES_WINDOWS, 0.05) != []       # 0.0013 above the maximum
    assert C.target_problems([0.0271], SHAPES_WINDOWS, 0.1) == []


def test_cli_refuses_out_of_range_targets_on_shapes(tmp_path, capsys):
    out = tmp_path / "mcd"
    base = ["mcd", "--train", "shapes", "--train_size", "2000", "--pool", "shapes", "--pool_size", "500",
            "--size", "100", "--out_dir", str(out)]
    for t in ("0.052", "0.0"):   # the pool's windows span 0.00522..0.04393
        with pytest.raises(SystemExit) as e:
            C.main(base + ["--targets", t])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and err[-1].startswith(f"error: target {float(t):g} is out of reach of this pool")
        assert not out.exists()
    for bad, msg in ((["--targets", "0.1,x"], "not a comma-separated list"), (["--tolerance", "-1"], "in [0, 1)")):
        with pytest.raises(SystemExit) as e:
            C.main(base + bad)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    res = C.main(base + ["--targets", "0.04393,0.02"])   # a window's own divergence and one inside the range
    capsys.readouterr()
    written = json.load(open(out / "windows.json"))
    assert [w["compound_divergence"] for w in res["windows"]] == [w["compound_divergence"] for w in written]
    assert sorted(os.listdir(out)) == ["mcd.jsonl", "random.jsonl", "target_0.02.jsonl", "target_0.04393.jsonl",
                                       "windows.json"]


def naive_divergence(train: list, test: list, alpha: float) -> float:
    """1 - sum_k p_k^alpha q_k^(1-alpha) over the union of compounds, from two lists of compound occurrences."""
    p = {k: train.count(k) / len(train) for k in set(train)}
    q = {k: test.count(k) / len(test) for k in set(test)}
    return 1.0 - sum(p.get(k, 0.0) ** alpha * q.get(k, 0.0) ** (1 - alpha) for k in set(p) | set(q))


def compounds_and_atoms(crgs):
    return [c.predicate for g in crgs for c in g.concepts()], [p.word for g in crgs for p in g.primitives()]


def test_hold_out_split_reaches_the_papers_compound_divergence(tmp_path, capsys):
    """`mcd --hold_out shapes`: the four held-out size-colour predicates are absent from the training captions (all
    their words present), and the MCD split written has a compound divergence in the paper's range (0.15-0.31),
    computed here by a naive loop over compound counts, with an atom divergence below 0.01."""
    import data
    held = C.hold_out_predicates("shapes")
    assert held == {"a small red [NN]", "a large blue [NN]", "a small purple [NN]", "a large white [NN]"}
    out = tmp_path / "mcd"
    res = C.main(["mcd", "--train", "shapes", "--train_size", "2000", "--hold_out", "shapes", "--pool", "shapes",
                  "--pool_size", "1000", "--size", "200", "--out_dir", str(out)])
    capsys.readouterr()
    train = [C.caption_crg(s.caption, s.tree) for s in (data.shapes_scene("train", i) for i in range(2000))]
    kept = [g for g in train if not held & {c.predicate for c in g.concepts()}]
    assert 0.15 < 1 - len(kept) / len(train) < 0.3       # a fifth of the training captions is left out
    tc, ta = compounds_and_atoms(kept)
    assert not held & set(tc) and {"small", "large", "red", "blue", "purple", "white"} <= set(" ".join(tc).split())
    rows = [json.loads(line) for line in open(out / "mcd.jsonl")]
    assert len({r["key"] for r in rows}) == 200 and all(r["split"] == "test" for r in rows)
    qc, qa = compounds_and_atoms([C.caption_crg(s.caption, s.tree) for s in
                                  (data.shapes_scene(r["split"], r["index"], r["seed"]) for r in rows)])
    cd, ad = naive_divergence(tc, qc, 0.1), naive_divergence(ta, qa, 0.5)
    assert 0.15 <= cd <= 0.31 and ad < 0.01, (cd, ad)
    assert abs(cd - res["mcd_compound_divergence"]) < 1e-4 and abs(ad - res["mcd_atom_divergence"]) < 1e-4
    rnd = [json.loads(line) for line in open(out / "random.jsonl")]
    qr, _ = compounds_and_atoms([C.caption_crg(s.caption, s.tree) for s in
                                 (data.shapes_scene(r["split"], r["index"], r["seed"]) for r in rnd)])
    assert naive_divergence(tc, qr, 0.1) < 0.1           # a random draw of the same pool stays near the training set


def test_training_leaves_the_held_out_captions_out(tmp_path):
    args = C.parse_args(["--hold_out", "shapes", "--train_size", "100", "--out_dir", str(tmp_path)])
    held = C.hold_out_predicates(args.hold_out)
    full = C.load_split(args, "train", 100)
    sp = C.load_split(args, "train", 100, hold_out=held)
    bad = [i for i, g in enumerate(full.crgs) if held & {c.predicate for c in g.concepts()}]
    assert sp.held_out == len(bad) > 0 and len(sp.captions) == 100 - len(bad) == len(sp.keys)
    assert sp.keys == [k for i, k in enumerate(full.keys) if i not in bad]
    assert C.hold_out_predicates("a b [NN], [NP] is above [NP]") == {"a b [NN]", "[NP] is above [NP]"}
    assert C.hold_out_predicates(None) == frozenset()
