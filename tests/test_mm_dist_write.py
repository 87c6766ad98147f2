"""mm_learngene.py under torchrun (issue 40): a write error on rank 0 (ENOSPC during a checkpoint save)
is one `error:` line from rank 0, and every rank exits 2 at once, instead of the other ranks failing
in their next collective or hanging. Run as a script, this file is the torchrun driver."""
import errno
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import mm_learngene as M  # noqa: E402

if __name__ != "__main__":
    from test_mm_learngene import EXTRACT, teacher  # noqa: F401,E402


def driver(out, argv):
    """Rank 0's second checkpoint save hits a full disk; each rank writes down how it exited."""
    rank = int(os.environ.get("RANK", 0))
    real, calls = M.lifecycle.save_checkpoint, []

    def full_disk(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*a, **k)
    M.lifecycle.save_checkpoint = full_disk
    code = 0
    try:
        M.main(argv)
    except SystemExit as e:
        code = e.code
    with open(os.path.join(out, f"exit{rank}.json"), "w") as f:
        json.dump({"rank": rank, "code": code}, f)
    sys.exit(code)


def test_write_error_on_rank0_stops_every_rank_with_one_line(teacher, tmp_path):  # noqa: F811
    import torch
    out = tmp_path / "lg"
    argv = EXTRACT + ["--max_steps", "6", "--save_interval", "2", "--teacher", str(teacher), "--out_dir", str(out)]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                        os.path.abspath(__file__), str(tmp_path)] + argv, cwd=ROOT, capture_output=True, text=True,
                       timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    exits = sorted(json.loads((tmp_path / f"exit{k}.json").read_text())["code"] for k in (0, 1))
    assert exits == [2, 2], r.stderr[-3000:]
    errors = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1 and "no space left on device" in errors[0].lower(), r.stderr[-3000:]
    assert torch.load(out / "checkpoint" / "state.pt", weights_only=True)["step"] == 2   # the last good one


if __name__ == "__main__":
    driver(sys.argv[1], sys.argv[2:])
