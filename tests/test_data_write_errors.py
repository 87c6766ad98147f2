"""A write that fails for want of room or of a working disk (ENOSPC, EDQUOT, EFBIG, EIO) in `python data.py
make-shapes` / `convert-weights` is one `error:` line naming the file, exit 2, and no half-written file: simulated
in-process (open's writes raise the errno) and for real under a file-size limit (RLIMIT_FSIZE) in a subprocess."""
import builtins
import errno
import os
import resource
import subprocess
import sys

import pytest
from conftest import error_lines

import data
import lifecycle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["make-shapes", "--train", "4", "--test", "2", "--shard_size", "2"]


class FailingFile:
    """An open file whose writes fail with `code`, as the kernel's would."""
    def __init__(self, f, code):
        self.f, self.code = f, code

    def write(self, _):
        raise OSError(self.code, os.strerror(self.code))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)


def fail_writes_under(monkeypatch, root, code):
    real = builtins.open

    def fake_open(path, mode="r", *a, **k):
        f = real(path, mode, *a, **k)
        return FailingFile(f, code) if str(path).startswith(str(root)) and set(mode) & set("wax+") else f
    monkeypatch.setattr(builtins, "open", fake_open)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO])
def test_make_shapes_write_error_is_one_line(tmp_path, monkeypatch, capsys, code):
    fail_writes_under(monkeypatch, tmp_path, code)
    assert data.main([*SMALL, "--out_dir", str(tmp_path / "out")]) == 2
    err = error_lines(capsys.readouterr().err)    # its start line names the folder (and so this test)
    shard = tmp_path / "out" / "shards" / "00000.tar"
    assert err == [f"error: {shard}: cannot write: {os.strerror(code).lower()}"]
    assert os.listdir(shard.parent) == []       # the failed write's tmp file is not left behind


def test_make_shapes_under_a_real_file_size_limit(tmp_path):
    """EFBIG from the kernel: a 1000-byte RLIMIT_FSIZE (Python ignores SIGXFSZ, so the write fails)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
    p = subprocess.run([sys.executable, "data.py", *SMALL, "--out_dir", str(tmp_path / "out")], cwd=ROOT,
                       preexec_fn=limit, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"})
    err = [ln.strip() for ln in error_lines(p.stderr) if "error" in ln or "Traceback" in ln]
    assert p.returncode == 2 and err == [f"error: {tmp_path / 'out' / 'shards' / '00000.tar'}: cannot write: "
                                         "file too large"], p.stderr


def test_writing_reads_the_errno_and_safetensors_message():
    with pytest.raises(data.DataError, match="^x.bin: cannot write: no space left on device$"):
        with lifecycle.writing("x.bin"):
            raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(data.DataError, match="^w.safetensors: cannot write: file too large$"):
        with lifecycle.writing("w.safetensors"):     # safetensors' Rust io::Error, not an OSError
            raise RuntimeError("Error while serializing: IoError(File too large (os error 27))")
    with pytest.raises(data.DataError, match="^x.bin: cannot write: permission denied$"):    # a read-only folder
        with lifecycle.writing("x.bin"):
            raise PermissionError(errno.EACCES, "Permission denied")
    with pytest.raises(FileNotFoundError):        # not a failed write: not this policy's
        with lifecycle.writing("x.bin"):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory")
