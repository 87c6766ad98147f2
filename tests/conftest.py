import contextlib
import os
import sys

import pytest

# tests import the scripts of the repository root (data.py, il_clip.py, ...) as modules
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    # raised inside torch when torch._inductor is first imported (torch/utils/mkldnn.py decorates with
    # torch.jit.script_method); the repository never calls it, and the README's commands print nothing of it
    config.addinivalue_line("filterwarnings", r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")


def import_open_clip():
    """open_clip for comparisons only (the project never imports it); skips the calling test when open_clip_torch is not
    installed. This machine has no CPU build of torchvision, which open_clip imports at module level
    (its image transforms, unused here): while open_clip imports, every torchvision module is a
    dummy whose attributes accept anything, and the dummies are removed afterwards (torch probes
    for torchvision). bench.py then finds open_clip already imported."""
    import importlib.abc
    import importlib.machinery
    import importlib.util

    import pytest

    if importlib.util.find_spec("open_clip") is None:
        pytest.skip("open_clip_torch is not installed")
    if "open_clip" in sys.modules:
        return sys.modules["open_clip"]

    class AnyMeta(type):
        __getattr__ = lambda cls, name: cls
    Any = AnyMeta("Any", (), {"__init__": lambda self, *a, **k: None, "__call__": lambda self, *a, **k: self})

    class DummyTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "torchvision":
                return importlib.machinery.ModuleSpec(name, self, is_package=True)

        def exec_module(self, module):
            module.__getattr__ = lambda name: Any

    have_torchvision = importlib.util.find_spec("torchvision") is not None
    finder = DummyTorchvision()
    if not have_torchvision:
        sys.meta_path.insert(0, finder)
        # timm (open_clip's optional towers) needs a real torchvision: hidden, open_clip goes without it
        hide_timm = sys.modules.setdefault("timm", None) is None
    try:
        import open_clip
    finally:
        if not have_torchvision:
            sys.meta_path.remove(finder)
            if hide_timm:
                del sys.modules["timm"]
            for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
                del sys.modules[name]
    return open_clip


def sigterm_one_rank(cmd, progress_file, env=None, timeout=180):
    """Runs `cmd` (a 2-process torchrun launch), waits until `progress_file` has content (training
    has begun), then sends SIGTERM to the LOCAL_RANK=1 worker alone: a preemption reaches the ranks
    at different moments, and the others must learn of it rather than wait in a collective the
    signalled rank has left. Returns (returncode, stdout, stderr); fails the test on a hang."""
    import signal
    import subprocess
    import time

    import pytest

    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)

    def workers():
        """{LOCAL_RANK: pid} of the launcher's children (torchrun puts them in their own sessions)."""
        found = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env_vars = [v for v in f.read().split(b"\0") if v.startswith(b"LOCAL_RANK=")]
            except OSError:
                continue
            if ppid == p.pid and env_vars:
                found[int(env_vars[0].split(b"=")[1])] = int(pid)
        return found

    def give_up(why):
        for pid in [*workers().values(), p.pid]:
            with contextlib.suppress(OSError):      # already gone
                os.kill(pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{why}\n{out[-1500:]}\n{err}")

    t0 = time.time()
    while not (os.path.isfile(progress_file) and os.path.getsize(progress_file) > 0):
        if p.poll() is not None or time.time() - t0 > timeout:
            give_up("training never started")
        time.sleep(0.2)
    rank1 = workers().get(1)
    if rank1 is None:
        give_up("no LOCAL_RANK=1 worker found")
    os.kill(rank1, signal.SIGTERM)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        give_up("the run hung after SIGTERM to one rank")
    return p.returncode, out, err


def gloo_threads_left():
    """Names of this process's gloo threads (from /proc; [] where there is none). A process group
    that outlives destroy_process_group keeps them running into interpreter exit, where one that
    frees a Python tensor aborts the process ("terminate called without an active exception")."""
    names = []
    for t in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        with contextlib.suppress(OSError), open(f"/proc/self/task/{t}/comm") as f:
            names.append(f.read().strip())
    return [n for n in names if "gloo" in n]


def require_real_wandb():
    """Skip unless the wandb package is installed. `importorskip("wandb")` is not enough: a fake wandb.py
    that an earlier test imported (with its folder on sys.path) stays in sys.modules after the path is
    restored, and a subprocess would then not find the package."""
    import importlib.metadata
    try:
        importlib.metadata.version("wandb")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("wandb is not installed")


def disk_full_at_save(monkeypatch, step, code=None):
    """The checkpoint save of `step` fails with `code` (ENOSPC) after writing part of model.safetensors (every
    training script saves through lifecycle.save_checkpoint, which imports safetensors' save_file when it saves)."""
    import errno
    import safetensors.torch
    code = code or errno.ENOSPC
    real = safetensors.torch.save_file

    def full_disk(tensors, path, metadata=None):
        if metadata and metadata.get("step") == str(step):
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
            raise OSError(code, os.strerror(code))
        real(tensors, path, metadata)
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)


def read_figure(fig):
    """What a reader sees in a matplotlib Figure (lifecycle's plots), drawn first: one dict per Axes with its title,
    axis labels, x and y view limits, the tick labels inside them, the legend's texts and every line as (label, xs,
    ys, Line2D) with its non-finite points left out. Asserts the figure is readable: no tick label repeats on its
    axis, and the whole drawing (legend included) lies on the canvas."""
    import math
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.get_tightbbox(renderer)
    assert box.x0 >= -1e-6 and box.y0 >= -1e-6, box
    assert box.x1 <= fig.get_figwidth() + 1e-6 and box.y1 <= fig.get_figheight() + 1e-6, box
    axes = []
    for ax in fig.axes:
        ticks = {}
        for name, axis, (lo, hi) in (("x", ax.xaxis, ax.get_xlim()), ("y", ax.yaxis, ax.get_ylim())):
            lo, hi = min(lo, hi), max(lo, hi)
            ticks[name] = [t.get_text() for v, t in zip(axis.get_ticklocs(), axis.get_ticklabels())
                           if lo - 1e-9 * abs(hi - lo) <= v <= hi + 1e-9 * abs(hi - lo)]
            assert len(set(ticks[name])) == len(ticks[name]), (name, ticks[name])
        legend = ax.get_legend()
        if legend is not None:
            lb = legend.get_window_extent(renderer)
            assert lb.x0 >= 0 and lb.y0 >= 0 and lb.x1 <= fig.bbox.x1 + 1e-6 and lb.y1 <= fig.bbox.y1 + 1e-6, lb
        lines = []
        for line in ax.get_lines():
            pts = [(float(x), float(y)) for x, y in zip(line.get_xdata(), line.get_ydata()) if math.isfinite(y)]
            lines.append((line.get_label(), [p[0] for p in pts], [p[1] for p in pts], line))
        axes.append({"title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
                     "xlim": ax.get_xlim(), "ylim": ax.get_ylim(), "xticks": ticks["x"], "yticks": ticks["y"],
                     "legend": [t.get_text() for t in legend.get_texts()] if legend is not None else [],
                     "lines": lines})
    return axes


TALK = ("start: ", "done: ", "stopped by ", "note: --warmup ")   # what commands say on stderr, not errors


def error_lines(text):
    """A command's stderr without its talk (its start and done lines, the warm-up note): what a user error must be
    exactly one line of."""
    return [ln for ln in text.strip().splitlines() if not ln.startswith(TALK)]
