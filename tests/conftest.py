import os
import sys

# tests import the scripts of the repository root (data.py, il_clip.py, ...) as modules
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def import_open_clip():
    """open_clip for comparisons only (SPEC.md 6): it imports torchvision, which has no CPU
    build here, so every `torchvision.*` import is answered with a dummy module. Skips the
    calling test when open_clip is not installed."""
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import types

    import pytest

    if importlib.util.find_spec("open_clip") is None:
        pytest.skip("open_clip_torch is not installed")

    class _AnyMeta(type):
        def __getattr__(cls, name):
            return cls

    class _Any(metaclass=_AnyMeta):
        def __init__(self, *a, **k):
            pass

        def __call__(self, *a, **k):
            return self

    class _DummyTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name == "torchvision" or name.startswith("torchvision."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            module = types.ModuleType(spec.name)
            module.__path__ = []
            module.__getattr__ = lambda name: _Any
            return module

        def exec_module(self, module):
            pass

    if not any(isinstance(f, _DummyTorchvision.__class__) and type(f).__name__ == "_DummyTorchvision" for f in sys.meta_path):
        sys.meta_path.insert(0, _DummyTorchvision())
    import open_clip
    return open_clip
