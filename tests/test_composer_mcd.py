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
    base = ["mcd", "--train", "shapes", "--train_size", "2000", "--pool", "shapes", "--pool_size", "500", "--size", "100",
            "--out_dir", str(out)]
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
