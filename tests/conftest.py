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

    if "open_clip" in sys.modules:
        return sys.modules["open_clip"]
    finder = _DummyTorchvision()
    sys.meta_path.insert(0, finder)
    try:
        import open_clip
    finally:
        # take the dummy away again: torch itself probes for torchvision (e.g. torch.testing),
        # and a dummy left in sys.modules would break later tests of other files
        sys.meta_path.remove(finder)
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    return open_clip
