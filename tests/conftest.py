import os
import sys

# tests import the scripts of the repository root (data.py, il_clip.py, ...) as modules
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def import_open_clip():
    """open_clip for comparisons only (SPEC.md 6), through bench.py's torchvision-dummy import
    hook; skips the calling test when open_clip_torch is not installed."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("open_clip") is None:
        pytest.skip("open_clip_torch is not installed")
    import bench
    return bench.import_open_clip()
