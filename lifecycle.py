"""
lifecycle.py -- what the training scripts share besides the data: one run's life in its out_dir.

  * files: JSON, durable and atomic writes, one-line errors for a full disk or a read-only folder;
  * weights: the reader for this repo's checkpoints, OpenAI / open_clip files and the activation
    they state, the TorchScript conversion behind `data.py convert-weights`, and the training
    script a checkpoint records (script_record; find_script's trust rule, import_script);
  * the run lifecycle: one run per out_dir (a lock), checkpoints that survive a crash and their
    fallback, stop signals (the loader workers' too), metrics.jsonl (+ wandb);
  * the voice of every command: its start and done lines, progress bars; plots (matplotlib, Agg);
  * measurement: the FLOPs of a CLIP step and MFU (bench.py and il_clip.py);
  * results over seeds: run folders grouped, mean and 95% t-interval, paired differences.

data.py (the data) and the training scripts import it; it imports nothing of this repository.
"""
import contextlib
import errno
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import sys

import numpy as np
import torch
from PIL import Image


class DataError(Exception):
    """A problem with the user's data or paths. Scripts print it as one line, no traceback."""


# -----------------------------------------------------------------------------
# Files: JSON, durable and atomic writes, weights. Each training script writes and reads its own
# checkpoints (out_dir/checkpoint/: model.safetensors, config.json, state.pt ...); readers find the
# weights with checkpoint_dir.

def read_json(path: str):
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: tolerate a byte-order mark
            return json.load(f)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    # nested too deep, too big
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, MemoryError) as e:
        raise DataError(f"{path}: malformed JSON ({e or type(e).__name__})") from None


def fsync(path: str, write=None):
    """write(path) if given, then flush the file or folder to disk: a checkpoint must survive a
    power cut or SIGKILL."""
    if write is not None:
        write(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write):
    """write(tmp), then rename over `path`: a reader never sees half a file (nor
    a failed write's tmp)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:        # a failed write's tmp (after the rename there is none)
        if os.path.isfile(tmp):
            os.remove(tmp)


# a write that cannot be done for want of room or of a working disk (full disk, quota, file-size
# limit, failing disk), of permission (a folder made read-only, a read-only mount) or on a path of
# the wrong kind (a file where a folder belongs, or the reverse)
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)
WRITE_ERRNOS = (*DISK_ERRNOS, errno.EACCES, errno.EPERM, errno.EROFS, errno.EEXIST, errno.ENOTDIR,
                errno.EISDIR)


@contextlib.contextmanager
def writing(path: str, what: str = ""):
    """A write that fails for want of room, of a working disk or of permission, or on a path of the
    wrong kind (WRITE_ERRNOS) -> DataError, one line naming the file (the OSError's own if it names
    one) and `what` was being written. Other errors pass."""
    try:
        yield
    except Exception as e:
        if write_error(e) is None:
            raise
        # atomic_write's temp
        name = re.sub(rf"\.tmp{os.getpid()}$", "", str(getattr(e, "filename", None) or path))
        raise DataError(f"{name}: cannot write: {write_error(e)}{what}") from None


def save_json(path: str, obj):
    def write(p):
        with open(p, "w") as f:
            json.dump(obj, f, indent=1)
    fsync(path, write)


def write_file(path: str, blob):
    """`blob` (bytes, a str as UTF-8, a PIL image as PNG) as the file `path`, atomically, its folder
    made if missing."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

    def write(tmp):
        if isinstance(blob, Image.Image):
            return blob.save(tmp, format="PNG")
        with open(tmp, "wb") as f:
            f.write(blob.encode("utf-8") if isinstance(blob, str) else blob)
    with writing(path):
        atomic_write(path, write)


def open_to_append(path: str):
    """`path` opened to append, created if missing, never through a symbolic
    link (O_NOFOLLOW): a link planted in out_dir must not send the run's writes
    to its target. A link there is one DataError line."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise DataError(symlink_refused(path)) from None
        raise
    return os.fdopen(fd, "a")


def symlink_refused(path: str) -> str:
    return (f"{path}: a symbolic link; a run writes its own files, never through a link "
            f"(remove it, or --overwrite)")


def remove(path: str):
    """A file, a folder with its files, or a symbolic link (the link, never what it points to)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


OPENAI_EXTRA_KEYS = {"input_resolution", "context_length", "vocab_size"}   # ints in OpenAI's .pt


def is_torchscript(path: str) -> bool:
    """A TorchScript archive (OpenAI's .pt files): a zip holding constants.pkl,
    a format that carries code."""
    import zipfile
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("constants.pkl") for n in z.namelist())
    except (zipfile.BadZipFile, OSError):     # not a zip (a plain pickle), unreadable
        return False


def check_torchscript(path: str):
    """convert-weights' input: an existing TorchScript archive (anything else is refused before a
    byte is written or any code runs)."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    if not is_torchscript(path):
        raise DataError(f"{path}: not a TorchScript archive (convert-weights is for OpenAI's .pt "
                        f"files; a plain state dict .pt or .safetensors loads as it is)")


def convert_torchscript(path: str) -> tuple:
    """A TorchScript archive you trust -> its tensors in PATH.safetensors beside it, atomically;
    loading it runs the code it carries. -> (written path, number of tensors)."""
    from safetensors.torch import save_file
    sd = torch.jit.load(path, map_location="cpu").state_dict()
    out = path.rsplit(".", 1)[0] + ".safetensors"
    contiguous = {k: v.contiguous() for k, v in sd.items()}
    atomic_write(out, lambda tmp: save_file(contiguous, tmp))
    return out, len(sd)


def read_weights(path: str) -> dict:
    """A state dict of tensors from .safetensors or a torch .pt (weights_only: no pickled code
    runs); TorchScript archives (OpenAI's) are refused (convert-weights); open_clip's
    {"state_dict": ...}, DDP's "module." unwrapped."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: weights file not found")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            sd = load_file(path)
        else:
            if is_torchscript(path):    # OpenAI's .pt files carry code: never run here
                raise DataError(f"{path}: a TorchScript archive (a format that carries code); "
                                f"if you trust it, convert it once: "
                                f"python data.py convert-weights {path}")
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except DataError:
        raise
    except Exception as e:
        first = (str(e).splitlines() or [""])[0][:200]
        raise DataError(f"cannot read weights {path}: {type(e).__name__}: {first}") from None
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise DataError(f"{path} does not hold a state dict")
    return {k[7:] if k.startswith("module.") else k: v for k, v in sd.items()
            if torch.is_tensor(v) and k not in OPENAI_EXTRA_KEYS}


# OpenAI's layout names every tensor, and most hyperparameters follow from their shapes. Three do
# not show: the heads (OpenAI: width // 64), the EOT id (OpenAI: the last id) and the activation
# (OpenAI: QuickGELU). A config.json beside the weights (this repo's runs and descendants) states
# them; a bare weights file gets OpenAI's conventions.
TOWER_KEYS = {"visual": ("visual.conv1.weight", "visual.positional_embedding", "visual.proj",
                         "visual.ln_post.weight"),
              "text": ("token_embedding.weight", "positional_embedding", "text_projection",
                       "ln_final.weight")}


def clip_hparams(sd: dict, path: str, config: dict | None = None,
                 towers=("visual", "text")) -> dict:
    """The hyperparameters of OpenAI-layout CLIP weights, named as il_clip's / mm_learngene's
    ModelConfig fields: the shapes of the towers in `towers` (a vision-only descendant has no text
    tower), and what `config` (the config.json beside the weights, if any) states of the heads, the
    EOT id and the activation."""
    config = config or {}
    model = config.get("model") if isinstance(config.get("model"), dict) else {}

    def stated(key, default):
        for d in (model, config.get("model_config") or {}, config):
            if key in d:
                return d[key]
        return default

    def count(prefix):
        return len({k[len(prefix):].split(".")[0] for k in sd if k.startswith(prefix)})

    for tower in towers:
        missing = [k for k in TOWER_KEYS[tower] if k not in sd]
        if missing:
            name = "vision" if tower == "visual" else "text"
            raise DataError(f"{path}: cannot read the {name} tower "
                            f"(missing {missing[0]}; not OpenAI CLIP layout)")
    hp = {}
    if "visual" in towers:
        width, _, patch, _ = sd["visual.conv1.weight"].shape
        grid = round(math.sqrt(sd["visual.positional_embedding"].shape[0] - 1))
        hp["vision_width"] = width
        hp["patch_size"] = patch
        hp["image_size"] = grid * patch
        hp["vision_layers"] = count("visual.transformer.resblocks.")
        hp["vision_heads"] = stated("vision_heads", max(1, width // 64))
        hp["embed_dim"] = sd["visual.proj"].shape[1]
    if "text" in towers:
        width = sd["ln_final.weight"].shape[0]
        hp["text_width"] = width
        hp["vocab_size"] = sd["token_embedding.weight"].shape[0]
        hp["context_length"] = sd["positional_embedding"].shape[0]
        hp["text_layers"] = count("transformer.resblocks.")
        hp["text_heads"] = stated("text_heads", max(1, width // 64))
        hp["embed_dim"] = sd["text_projection"].shape[1]
    bare = not config
    vocab_size = hp.get("vocab_size")
    eot = stated("eot_token_id", vocab_size - 1 if bare and vocab_size else None)
    if eot is not None:
        hp["eot_token_id"] = eot
    hp["quick_gelu"] = bool(stated("quick_gelu", bare))
    return hp


def load_state(model, sd: dict, source: str, allow_missing=()):
    """model.load_state_dict(sd); missing (but `allow_missing`), unexpected or
    misshaped keys: one error line."""
    own = model.state_dict()
    problems = {"missing keys": [k for k in own if k not in sd and not k.startswith(allow_missing)],
                "unexpected keys": [k for k in sd if k not in own],
                "shape mismatch": [f"{k} {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
                                   for k in own if k in sd and sd[k].shape != own[k].shape]}
    problems = [f"{what} {', '.join(ks[:3])}{' ...' if len(ks) > 3 else ''}"
                for what, ks in problems.items() if ks]
    if problems:
        raise DataError(f"config/weights mismatch for {source}: " + "; ".join(problems))
    model.load_state_dict(sd, strict=False)


# The MLP activation of foreign weights is not in the tensors. open_clip's hub layout puts
# open_clip_config.json ({"model_cfg": {..., "quick_gelu": true}, "preprocess_cfg": ...}; no
# "quick_gelu" means GELU, as open_clip builds it) beside open_clip_model.safetensors; this
# repo's runs put config.json ({"model": {"quick_gelu": ...}}) beside model.safetensors.
ACTIVATION_FILES = ("open_clip_config.json", "config.json")


def _stated_activation(cfg) -> bool | None:
    """quick_gelu as a config file states it, else None (also where it repeats
    "quick_gelu_source": "assumed")."""
    if not isinstance(cfg, dict):
        return None
    model = cfg.get("model")
    if isinstance(model, dict) and "quick_gelu" in model:
        return None if cfg.get("quick_gelu_source") == "assumed" else bool(model["quick_gelu"])
    model_cfg = cfg.get("model_cfg", cfg)   # open_clip reads a hub config or a bare model config
    if isinstance(model_cfg, dict) and ("model_cfg" in cfg or "vision_cfg" in model_cfg):
        return bool(model_cfg.get("quick_gelu", False))
    return None


def weights_activation(flag, weights: str, folders=()) -> tuple:
    """(quick_gelu, source) of a weights file: the flag when given ("flag"), else what a config file
    beside the weights (or in `folders`) says (source: its path), else OpenAI's QuickGELU,
    "assumed" (the caller says so: open_clip's LAION / DataComp models are GELU)."""
    if flag is not None:
        return bool(flag), "flag"
    for folder in dict.fromkeys([os.path.dirname(os.path.abspath(weights)), *folders]):
        for name in ACTIVATION_FILES:
            path = os.path.join(folder, name)
            if os.path.isfile(path) and (value := _stated_activation(read_json(path))) is not None:
                return value, path
    return True, "assumed"


def assumed_activation_note(path: str, trained: bool = False) -> str:
    """The stderr line when weights_activation said "assumed" (`trained`: the
    checkpoint's run assumed it)."""
    what = (("its run assumed OpenAI's QuickGELU for --init weights "
             "that did not say their activation") if trained else
            ("no open_clip_config.json or config.json beside it says its activation: "
             "assuming OpenAI's QuickGELU"))
    return (f"note: {path}: {what} "
            f"(--no-quick_gelu for GELU models such as open_clip's LAION / DataComp ViT-B-32)")


def checkpoint_dir(path: str) -> str:
    """An out_dir -> its checkpoint/ when that holds a model.safetensors (all training scripts),
    else `path` as is."""
    inner = os.path.join(path, "checkpoint")
    return inner if os.path.isfile(os.path.join(inner, "model.safetensors")) else path


def script_record(file: str) -> dict:
    """config.json's "script": a checkpoint's reader imports it, so a fork's weights run the fork's
    own model code."""
    path = os.path.abspath(file)
    with open(path, "rb") as f:
        return {"name": os.path.basename(path), "path": path,
                "sha256": hashlib.sha256(f.read()).hexdigest()}


def find_script(record, reader: str, script: str | None = None, default: str | None = None):
    """-> (path, note): the training script to build a checkpoint's model with, by the one trust
    rule of every reader of checkpoints (a checkpoint never runs code the user did not choose),
    decided before anything is imported:
      * the script `record` names (config.json's "script", see script_record) is run only from the
        folder of the program reading it (`reader`: its __file__), found there by its bare file
        name; a fork lives beside the original. Neither its recorded path nor the working
        directory is ever searched;
      * anything else (a path elsewhere, a name with a folder in it, a file found only in the
        working directory) runs only when the user names it: `script`, their --script PATH.
        Otherwise a DataError naming the record and --script;
      * `note` (None, or a line to print before the import): the file found is not the recorded
        text (sha256), or `script` is another file than the one that trained the checkpoint.
    `default` (a bare name beside the reader) serves weights that record no script
    (OpenAI / open_clip files)."""
    folder, me = os.path.dirname(os.path.abspath(reader)), os.path.basename(reader)
    if record is not None and not isinstance(record, dict):
        # a bare string, say: only a bare file name beside the reader passes
        record = {"name": record}
    name, sha = ((record.get("name"), record.get("sha256")) if record is not None
                 else (default, None))
    record = record or {}
    if script is not None:
        if not os.path.isfile(script):
            raise DataError(f"--script {script}: no such file")
        path = os.path.abspath(script)
    else:
        bare = (isinstance(name, str) and name.endswith(".py") and name == os.path.basename(name)
                and "\0" not in name)
        path = os.path.join(folder, name) if bare else None
        if path is None or not os.path.isfile(path):
            where = record.get("path")
            what = f"{name!r}" + (f" (recorded at {where!r})"
                                  if isinstance(where, str) and where != name else "")
            raise DataError(f"the checkpoint's training script {what} is not a file beside {me} "
                            f"in {folder}, the only place a recorded script is run from: put the "
                            f"fork there, or name the file to run with --script PATH")
    have = script_record(path)["sha256"]
    if not isinstance(sha, str) or sha == have:
        return path, None
    if script is not None and os.path.basename(path) != name:
        return path, f"note: scoring with {path}, trained by {name or 'another script'} (--script)"
    return path, (f"note: {path} has changed since it trained this checkpoint "
                  f"(sha256 {have[:12]}, recorded {sha[:12]})")


def import_script(record, reader: str, script: str | None = None, default: str | None = None):
    """-> (module, path, note): find_script's file, its note printed first, imported once per file
    (its classes keep one identity)."""
    import importlib.machinery
    import importlib.util
    path, note = find_script(record, reader, script, default)
    if note and os.environ.get("RANK", "0") == "0":     # every rank imports, rank 0 says so
        print(note, file=sys.stderr, flush=True)
    module_name = "_script_" + hashlib.sha256(path.encode()).hexdigest()[:12]
    if module_name not in sys.modules:
        # --script may name any file
        loader = importlib.machinery.SourceFileLoader(module_name, path)
        spec = importlib.util.spec_from_file_location(module_name, path, loader=loader)
        sys.modules[module_name] = module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[module_name]
            raise DataError(f"{path}: cannot import the training script "
                            f"({type(e).__name__}: {e})") from None
    return sys.modules[module_name], path, note


# -----------------------------------------------------------------------------
# The run lifecycle every training script shares: one run per out_dir, checkpoints that survive a
# crash, stop signals, metrics.jsonl (+ wandb); the voice and plots follow below. The method scripts
# keep only what is their own: what state.pt holds and how it is restored. out_dir/checkpoint/
# holds model.safetensors, config.json (flags, model config, "script"), tokenizer.json, state.pt
# (torch.save; read with weights_only=True: no pickled code runs) and sha256.json of them, written
# last. A save fills checkpoint.tmp/, fsyncs it, renames checkpoint/ -> checkpoint.prev/ (what a
# damaged newest falls back to) and checkpoint.tmp/ -> checkpoint/.
CHECKPOINT_FILES = ("model.safetensors", "config.json", "tokenizer.json", "state.pt")
# what eval_compositional.py writes into a run folder by default (its plots, without --plot_dir or
# --out) or by the README's names (--out RUN/eval.json, RUN/probe.json): --overwrite removes them
# with the run they scored
EVAL_FILES = (r"eval\.json", r"probe\.json", r"spectral\.png", r"codebook\.png",
              r"easy_to_learn\.png")
_lock = None        # this process's open out_dir/.lock
_stop = []          # the stop signals received, by name
# see claim_out_dir, hold_stop_signals_to_exit
_run = {"created": None, "started": False, "hold_signals": False}


def write_error(e: BaseException) -> str | None:
    """'no space left on device' etc. when e (or what it was raised during) is a WRITE_ERRNOS
    error, else None; safetensors says it only in its message ("(os error 28)")."""
    code = write_errno(e)
    return None if code is None else os.strerror(code).lower()


def write_errno(e: BaseException) -> int | None:
    while e is not None:
        code = next((c for c in WRITE_ERRNOS
                     if getattr(e, "errno", None) == c or f"(os error {c})" in str(e)), None)
        if code is not None:
            return code
        # not through a `from None`
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return None


def out_dir_problems(dirs) -> list:
    """What keeps a run from writing into `dirs` (out_dir, a phase's folder): each must be a
    writable folder (or not exist yet), its checkpoint/ and checkpoint.prev/ folders (writable: a
    save renames them), its metrics.jsonl a writable file, not a symbolic link (the log is appended
    to in place)."""
    problems = []
    for d in dirs:
        folders = [d, os.path.join(d, "checkpoint"), os.path.join(d, "checkpoint.prev")]
        for path in folders:
            if os.path.lexists(path) and not os.path.isdir(path):
                problems.append(f"{path}: not a folder (a file is there)")
            elif os.path.isdir(path) and not os.access(path, os.W_OK | os.X_OK):
                problems.append(f"{path}: not writable (permission denied)")
        log = os.path.join(d, "metrics.jsonl")
        if os.path.islink(log):
            problems.append(symlink_refused(log))
        elif os.path.lexists(log) and not os.path.isfile(log):
            problems.append(f"{log}: not a file (a folder is there)")
        elif os.path.isfile(log) and not os.access(log, os.W_OK):
            problems.append(f"{log}: not writable (permission denied)")
    return problems


def make_out_dir(out_dir) -> str | None:
    """os.makedirs(out_dir), a failure in one DataError line naming the path; -> the topmost folder
    it created (None: out_dir was there)."""
    top, parent = None, os.path.abspath(out_dir)
    while not os.path.lexists(parent):
        top, parent = parent, os.path.dirname(parent)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
            raise DataError(f"{out_dir}: not a folder (a file is there); "
                            f"give another --out_dir") from None
        if top is not None and not os.path.isdir(parent):
            raise DataError(f"{out_dir}: cannot make the folder: {parent} is a file") from None
        raise DataError(f"{out_dir}: cannot make the folder: {e.strerror.lower()}") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise DataError(f"{out_dir}: not writable (permission denied)")
    return top


def claim_out_dir(out_dir, rank, world, device, resume=False, overwrite=False, run_files=(),
                  phase_dirs=()):
    """Before anything is written: one run per out_dir (rank 0 holds an flock on out_dir/.lock,
    which the kernel drops when the process ends, killed or not); --resume needs a checkpoint (in
    out_dir or one of `phase_dirs`); a new run replaces one only with --overwrite, which removes the
    names in out_dir and `phase_dirs` that match a `run_files` pattern or EVAL_FILES (a symbolic
    link: the link). Then out_dir_problems: each is one line. Rank 0 raises DataError; the other
    ranks exit 2 (on_rank0)."""
    def claim():
        global _lock
        import fcntl
        created = make_out_dir(out_dir)
        path = os.path.join(out_dir, ".lock")
        try:
            _lock = os.fdopen(
                os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), "r+")
        except OSError as e:
            raise DataError(symlink_refused(path) if e.errno == errno.ELOOP else
                            f"{path}: cannot open the lock: {e.strerror.lower()}") from None
        try:
            fcntl.flock(_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _lock.seek(0)
            holder = _lock.read().strip() or "?"
            release_out_dir()
            raise DataError(f"{out_dir} is in use by another run: "
                            f"process {holder} holds {out_dir}/.lock") from None
        _run["created"] = created     # ours: a command that fails before its first step removes it
        _lock.truncate(0)
        print(os.getpid(), file=_lock, flush=True)
        dirs = [out_dir, *phase_dirs]
        for d in dirs if overwrite and not resume else []:
            for name in os.listdir(d) if os.path.isdir(d) else []:
                if any(re.fullmatch(p, name) for p in (*run_files, *EVAL_FILES)):
                    with writing(os.path.join(d, name), " (--overwrite removes it)"):
                        remove(os.path.join(d, name))
        problems = out_dir_problems(dirs)
        if problems:
            raise DataError("; ".join(problems))
        saved = any(has_checkpoint(d) for d in dirs)
        if resume and not saved:
            raise DataError(f"--resume: nothing to resume yet in {out_dir} (no checkpoint saved)")
        if saved and not (resume or overwrite):
            raise DataError(f"{out_dir} holds the checkpoint of an earlier run: continue it with "
                            f"--resume, or use another --out_dir, or --overwrite to replace it")
    release_out_dir()
    # every rank learns it, so none waits in a collective rank 0 left
    on_rank0(claim, rank, world, device)


def has_checkpoint(out_dir) -> bool:
    """A checkpoint to resume from (checkpoint/, or checkpoint.prev/ alone: the
    newest deleted or half-switched)."""
    return any(os.path.isdir(os.path.join(out_dir, c)) for c in ("checkpoint", "checkpoint.prev"))


def release_out_dir(failed=False):
    """Unlock out_dir. A command that `failed` before its first step (no record logged, no
    checkpoint saved) removes the out_dir it made (claim_out_dir): a mistyped path or flag leaves no
    folder holding only .lock behind."""
    global _lock
    if failed and _run["created"] and not _run["started"]:
        shutil.rmtree(_run["created"], ignore_errors=True)
    _run.update(created=None, started=False)
    if _lock is not None:
        _lock.close()
        _lock = None


def on_rank0(fn, rank, world, device, user_errors=(DataError,)):
    """fn() on rank 0 (a save, a results file), and every rank learns how it went: a user or write
    error is one line on rank 0, and the other ranks exit with the same status instead of hanging
    in their next collective."""
    if world == 1:
        return fn()
    error = None
    if rank == 0:
        try:
            fn()
        except Exception as e:
            error = e
    code = 0 if error is None else 2 if isinstance(error, user_errors) or write_error(error) else 1
    code = torch.tensor(float(code), device=device)
    torch.distributed.broadcast(code, 0)
    if error is not None:
        raise error
    if code.item():
        raise SystemExit(int(code.item()))


def unused_parameters(loss, params) -> list:
    """The parameters of `params` that the autograd graph of `loss` does not reach (a term's
    parameter that this phase's loss leaves out). A training step adds them to the loss times 0:
    their gradient is then zero instead of none, so DDP (find_unused_parameters=False, which waits
    for every parameter) finishes its reduction, and AdamW treats them alike on 1 process and on N
    ranks. Walked once per set of trained parameters: about 1 ms."""
    reached, seen, todo = set(), set(), [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        # AccumulateGrad: a leaf (parameter) reached
        if getattr(fn, "variable", None) is not None:
            reached.add(id(fn.variable))
        todo.extend(f for f, _ in fn.next_functions)
    return [p for p in params if id(p) not in reached]


def tensors_in(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, (dict, list, tuple)):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from tensors_in(v)


def all_finite(obj) -> bool:
    """Every floating-point tensor in a nested dict/list finite? (checked before
    a save: never a NaN checkpoint)"""
    flags = [torch.isfinite(t).all() for t in tensors_in(obj) if t.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def save_checkpoint(out_dir, weights, state, config, tokenizer, step, newest_damaged=False):
    """Write a checkpoint (rank 0 only), as the layout above says; out_dir/config.json and
    tokenizer.json too, for readers of out_dir. A write error is one DataError line;
    checkpoint.tmp/ is removed, the earlier checkpoints kept. A damaged newest (newest_damaged) is
    replaced without becoming checkpoint.prev/."""
    from safetensors.torch import save_file
    tmp, final, prev = (os.path.join(out_dir, n)
                        for n in ("checkpoint.tmp", "checkpoint", "checkpoint.prev"))
    weights = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
    try:
        remove(tmp)     # a failed save's, a file, a link: the save's own folder is always new
        os.makedirs(tmp)
        save_file(weights, os.path.join(tmp, "model.safetensors"), {"step": str(step)})
        # a Python file: a write error keeps its errno
        with open(os.path.join(tmp, "state.pt"), "wb") as f:
            torch.save(state, f)
        for folder in (tmp, out_dir):
            atomic_write(os.path.join(folder, "config.json"), lambda p: save_json(p, config))
            if tokenizer is not None:
                tokenizer.save(folder)
        names = sorted(os.listdir(tmp))
        for name in names:
            fsync(os.path.join(tmp, name))
        save_json(os.path.join(tmp, "sha256.json"),
                  {n: sha256(os.path.join(tmp, n)) for n in names})
        fsync(tmp)
        if os.path.lexists(final) and not newest_damaged:
            remove(prev)
            os.replace(final, prev)
        remove(final)
        os.replace(tmp, final)
        fsync(out_dir)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if write_error(e) is None:
            raise
        # permission, a read-only disk, a path of the wrong kind
        if write_errno(e) not in DISK_ERRNOS:
            raise DataError(f"{getattr(e, 'filename', None) or out_dir}: {write_error(e)} "
                            f"for the step-{step} checkpoint; "
                            f"the previous checkpoint is kept") from None
        need = sum(t.nbytes for t in tensors_in([weights, state])) / 2 ** 20
        raise DataError(f"{out_dir}: {write_error(e)} for the step-{step} checkpoint "
                        f"(about {need:.1f} MiB needed, "
                        f"{shutil.disk_usage(out_dir).free / 2 ** 20:.1f} MiB free); "
                        f"the previous checkpoint is kept") from None
    _run["started"] = True


# state.pt is checked to its leaves before a run restores anything from it (read_checkpoint): a
# whole file of the wrong content falls back to checkpoint.prev/ like a damaged one. A spec is a
# type (isinstance), {key: spec} (a dict with those keys, a key ending in "?" optional; {...: spec}:
# each other value), [spec] (a list or tuple of them), (what, test) for a leaf no type names
# (test(value) true), or a tuple of specs, one of which holds.

def accepts(set_state):
    """A test: set_state(value) (on a throwaway generator) raises nothing."""
    def test(value):
        try:
            set_state(value)
        except Exception:
            return False
        return True
    return test


def numpy_state(n):
    """rng_state's "numpy" entry (the MT19937 key as an int64 tensor: torch.save-able) as
    np.random.set_state takes it."""
    return (n[0], np.asarray(n[1].cpu() if torch.is_tensor(n[1]) else n[1]).astype(np.uint32),
            *n[2:])


BYTE_TENSOR = ("a uint8 tensor", lambda t: torch.is_tensor(t) and t.dtype == torch.uint8)
RNG_STATE = {"torch": ("torch's generator state",
                       accepts(lambda t: torch.Generator().set_state(t.cpu()))),
             "cuda": [BYTE_TENSOR],
             "python": ("Python's random state", accepts(lambda v: random.Random().setstate(v))),
             "numpy": ("NumPy's random state",
                       accepts(lambda n: np.random.RandomState().set_state(numpy_state(n))))}
NUMBER = (int, float)
OPTIMIZER_STATE = {"state": {...: {...: (torch.Tensor, *NUMBER)}},  # per parameter: step, moments
                   "param_groups": [{"params": [int],
                                     ...: (torch.Tensor, *NUMBER, bool, str, type(None), tuple)}]}


def spec_errors(value, spec, where="") -> list:
    """Where `value` departs from `spec` (above), as 'where: what was expected'."""
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return [f"{where}: dict"]
        found = []
        for key, s in spec.items():
            name = key[:-1] if isinstance(key, str) and key.endswith("?") else key
            if key is ...:
                found += [e for k, v in value.items() if k not in spec and f"{k}?" not in spec
                          for e in spec_errors(v, s, f"{where}.{k}".lstrip("."))]
            elif name in value:
                found += spec_errors(value[name], s, f"{where}.{name}".lstrip("."))
            elif name == key:       # missing: said as what was expected there
                found += spec_errors(object(), s, f"{where}.{name}".lstrip("."))
        return found
    if isinstance(spec, list):
        if not isinstance(value, (list, tuple)):
            return [f"{where}: list"]
        return [e for i, v in enumerate(value) for e in spec_errors(v, spec[0], f"{where}[{i}]")]
    if isinstance(spec, tuple) and isinstance(spec[0], str):
        return [] if spec[1](value) else [f"{where}: {spec[0]}"]
    alternatives = spec if isinstance(spec, tuple) else (spec,)
    if any(isinstance(value, t) for t in alternatives if isinstance(t, type)):
        return []
    # ({...}, type(None)): a dict or None
    nested = [t for t in alternatives if not isinstance(t, type)]
    if nested:
        return spec_errors(value, nested[0], where)
    return [f"{where}: {' or '.join(t.__name__ for t in alternatives)}"]


def check_sums(folder, required, only=None):
    """The files of a checkpoint folder against its sha256.json: a DataError naming the first that
    is missing or damaged. `required` must be listed there; `only` (names): check just those of the
    listed files (a reader that needs no state.pt), else every listed file."""
    sums = read_json(os.path.join(folder, "sha256.json"))
    if not isinstance(sums, dict):
        raise DataError(f"{folder}/sha256.json: damaged (not a table of file sums)")
    for name in dict.fromkeys([*required, *(n for n in sums if only is None or n in only)]):
        path = os.path.join(folder, name)
        if name not in sums or not os.path.isfile(path):
            raise DataError(f"{path}: missing (incomplete checkpoint)")
        if sha256(path) != sums[name]:
            raise DataError(f"{path}: damaged (its sha256 is not the one in sha256.json)")


def check_read_files(weights: str):
    """What a reader of a checkpoint (evaluation) reads, checked before it reads
    it: the weights file and the config.json / tokenizer.json beside it, against
    the sha256.json there when there is one (released weights have none and load
    as they are). A damaged file is a DataError naming it."""
    folder = os.path.dirname(os.path.abspath(weights))
    if os.path.isfile(os.path.join(folder, "sha256.json")):
        check_sums(folder, [], only={os.path.basename(weights), "config.json", "tokenizer.json"})


def read_checkpoint(folder, state_types, device="cpu"):
    """(weights, state, config) of a checkpoint folder whose files all match its sha256.json and
    whose state.pt matches the spec `state_types` to its leaves; else a DataError naming what is
    missing, damaged or of wrong types."""
    from safetensors.torch import load_file
    if not os.path.isdir(folder):
        raise DataError(f"{folder}: missing")
    check_sums(folder, ["model.safetensors", "config.json", "state.pt"])
    path = os.path.join(folder, "state.pt")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise DataError(f"{path}: unreadable "
                        f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]})") from None
    bad = spec_errors(state, state_types)
    if bad:
        raise DataError(f"{path}: wrong types "
                        f"(expected {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''})")
    return (load_file(os.path.join(folder, "model.safetensors")), state,
            read_json(os.path.join(folder, "config.json")))


def load_checkpoint(out_dir, state_types, device="cpu", rank=0):
    """(folder, weights, state, config, newest_damaged) of out_dir/checkpoint/ when it is whole
    (read_checkpoint), else of checkpoint.prev/, said in a note on stderr; a DataError naming the
    damaged file(s) when neither is."""
    errors = []
    for folder in (os.path.join(out_dir, "checkpoint"), os.path.join(out_dir, "checkpoint.prev")):
        if errors and not os.path.isdir(folder):
            break
        try:
            found = (folder, *read_checkpoint(folder, state_types, device), bool(errors))
        except DataError as e:
            errors.append(str(e))
            continue
        if errors and rank == 0:
            print(f"note: {errors[0]}; resuming from the previous checkpoint {folder} "
                  f"(step {found[2]['step']})", file=sys.stderr, flush=True)
        return found
    raise DataError("; and ".join(errors))


def rng_state(device) -> dict:
    """Every RNG a run draws from, as torch.save / weights_only can carry them."""
    n = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if str(device).startswith("cuda") else [],
            "numpy": [n[0], torch.from_numpy(n[1].astype(np.int64)), *n[2:]]}


def set_rng_state(rng: dict, device):
    torch.set_rng_state(rng["torch"].cpu())
    if rng["cuda"] and str(device).startswith("cuda"):
        torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])
    np.random.set_state(numpy_state(rng["numpy"]))
    random.setstate(rng["python"])


def resumed_flags(given: dict, saved: dict, run_control, where: str, always_now=()) -> dict:
    """--resume continues a run with its own flags: a run-defining flag given now (`given`: name ->
    value) must equal the saved value (DataError otherwise); a run-control flag may change. Returns
    the saved values of the flags not given now (run control included: a resumed run logs and saves
    as it did), but `always_now`."""
    for name in sorted(set(given) & set(saved) - set(run_control)):
        now = json.loads(json.dumps(given[name]))
        if now != saved[name]:
            raise DataError(f"--resume: --{name} {now} differs from the saved run's {saved[name]} "
                            f"({where}); drop it to continue that run, or start a new one in "
                            f"another --out_dir")
    return {k: v for k, v in saved.items() if k not in given and k not in always_now}


def cut_metrics(path, step):
    """metrics.jsonl back to the resumed step (no step logged twice; a finished
    run resumed is evaluated again)."""
    with open(path) if os.path.isfile(path) else contextlib.nullcontext([]) as f:
        kept = "".join(ln for ln in f if ln.strip() and (m := json.loads(ln))["step"] <= step
                       and m.get("phase") != "eval")
    # closed before the rename: a flush that fails at close (full disk) must raise here
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(kept)
    with writing(path):
        atomic_write(path, lambda tmp: fsync(tmp, write))


def log_record(path, rec, wandb=None, wandb_step=None):
    """One metrics.jsonl line (rank 0), appended in place, never through a symbolic link; with
    --wandb also sent to Weights & Biases at its step."""
    with writing(path), open_to_append(path) as f:
        f.write(json.dumps(rec) + "\n")
    _run["started"] = True
    if wandb is not None:
        wandb.log(rec, step=rec["step"] if wandb_step is None else wandb_step)


def start_wandb(project, out_dir, config, resumed):
    """--wandb PROJECT (nanoGPT's wandb_log), rank 0: a W&B run named after out_dir with the run's
    config; its id is kept in out_dir/wandb_id.txt, so --resume continues the same W&B run."""
    try:
        import wandb
    except ImportError:
        raise DataError("--wandb needs the wandb package (pip install wandb)") from None
    path = os.path.join(out_dir, "wandb_id.txt")
    run_id = open(path).read().strip() if resumed and os.path.isfile(path) else os.urandom(4).hex()
    write_file(path, run_id + "\n")
    wandb.init(project=project, name=os.path.basename(os.path.abspath(out_dir)), id=run_id,
               resume="allow", config=config)
    return wandb


def _on_stop_signal(signum, frame):
    if signum == signal.SIGINT and _stop:
        print("error: interrupted again: exiting without saving", file=sys.stderr, flush=True)
        os._exit(130)
    # a further SIGTERM: already stopping, nothing more to do
    _stop.append(signal.Signals(signum).name)


def catch_stop_signals() -> dict:
    """SIGTERM / SIGINT ask the run to stop: the script's loop sees stop_requested(), the ranks
    agree, it saves and stops. Further SIGTERMs change nothing; a Ctrl-C after the first signal
    exits at once, without a save (the last checkpoint stays). Returns the old handlers."""
    _stop.clear()
    return {s: signal.signal(s, _on_stop_signal) for s in (signal.SIGTERM, signal.SIGINT)}


def hold_stop_signals_to_exit():
    """For a script run as its own process (its __main__): once a run is stopping, restore_signals
    leaves SIGTERM ignored until the process ends, so a scheduler's repeated SIGTERM cannot turn a
    saved stop into a killed job (status -15) while the process exits. Called from a script's
    main() in-process, handlers are restored."""
    _run["hold_signals"] = True


def restore_signals(handlers: dict):
    # SIG_IGN, not the stop handler: the interpreter's exit resets Python's handlers to the default
    # (a SIGINT then exits at once)
    if _stop and _run["hold_signals"]:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return
    for s, h in handlers.items():
        signal.signal(s, h)


def worker_ignores_sigterm():
    """In a DataLoader worker (data.py's worker_init_fn): SIGTERM ignored. torchrun's agent and
    SLURM send it to the whole process group, and a worker killed by it would crash the rank before
    it could checkpoint (the rank saves, then shuts them down). Forked with SIGTERM blocked
    (start_workers), one sent meanwhile is dropped."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def start_workers(dl):
    """iter(dl) with SIGTERM blocked while the workers are forked: between fork and
    worker_ignores_sigterm, torch's worker handler would let a SIGTERM sent to the process group
    kill the worker (and the rank with it)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return iter(dl)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def stop_requested() -> str | None:
    """The stop signal received ("SIGTERM" before "SIGINT"), or None."""
    return "SIGTERM" if "SIGTERM" in _stop else _stop[0] if _stop else None


# a stop signal as a number the ranks sum at a sync point: any SIGTERM counts 1, a SIGINT
# 1/1024 (exact in float32)
STOP_CODES = {"SIGTERM": 1.0, "SIGINT": 2.0 ** -10}


def stop_code() -> float:
    return STOP_CODES.get(stop_requested(), 0.0)


def stopped_by(total: float) -> str | None:
    """The signal behind a sum of stop_code() over the ranks (SIGTERM before SIGINT), None for 0."""
    return next((name for name, code in STOP_CODES.items() if total >= code), None)


def resume_command(script, world, out_dir, cmd=""):
    """The command that continues a run: the same launcher (torchrun with as
    many processes, or python)."""
    launcher = f"torchrun --nproc_per_node={world}" if world > 1 else "python"
    return (f"{launcher} {os.path.basename(script)}{f' {cmd}' if cmd else ''} "
            f"--resume --out_dir {out_dir}")


def stop_line(by, step, max_steps, command):
    """The last line of a run stopped with a checkpoint (rank 0), in place of its done line and on
    the same stream: by what (the signal, --stop_at), where, and how to continue (resume_command)."""
    return say(f"stopped by {by} at step {step}/{max_steps} | checkpoint saved | "
               f"continue with: {command}")


def progress(iterable=None, unit="step", **kw):
    """A tqdm bar on stderr, on rank 0 at an interactive terminal only (a log
    file gets the start and done lines). Bars count optimizer steps ("step") or,
    for evaluation and data work, items ("item")."""
    from tqdm import tqdm
    kw["disable"] = (kw.get("disable") or not sys.stderr.isatty()
                     or os.environ.get("RANK", "0") != "0")
    return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, unit=unit, **kw)


# -----------------------------------------------------------------------------
# The voice of every command: one `start:` line, tqdm bars, one `done:` line. They go to stderr, as
# the bars and notes do; stdout carries only results (tables, JSON), so `> table.md` or `| jq` get
# nothing else.

def say(line: str) -> str:
    """A status line on stderr (rank 0's to print); returned, for tests."""
    print(line, file=sys.stderr, flush=True)
    return line


def start_line(script: str, command: str = "", details=(), out_dir=None, resumed_at=None) -> str:
    """`start: SCRIPT COMMAND | detail | ... | out_dir DIR`: what runs, on what, where it writes; a
    resumed run says `| resumed at step N` on it. script: __file__; details: short texts
    (parameters, device, data); resumed_at: a step, or a text such as "finetune step N"."""
    parts = [f"start: {os.path.basename(script)} {command}".rstrip(), *details]
    if out_dir is not None:
        parts.append(f"out_dir {out_dir}")
    if resumed_at is not None:     # a step, or where in a multi-phase run ("finetune step 12")
        where = resumed_at if isinstance(resumed_at, str) else f"step {resumed_at}"
        parts.append(f"resumed at {where}")
    return say(" | ".join(parts))


def done_line(result: str, seconds: float, wrote=(), more=()) -> str:
    """`done: RESULT in Ns | wrote PATHS | more ...`: the paths as the user gave them (folders end
    in "/"), those in one folder grouped as `folder/{a, b}`, `wrote nothing` when there are none;
    `more`: what to do next."""
    return say(" | ".join([f"done: {result} in {seconds:.0f}s", f"wrote {paths_text(wrote)}",
                           *more]))


def paths_text(paths) -> str:
    """"out/a/{x, y/}, z.json" for ["out/a/x", "out/a/y/", "z.json"]: one
    folder's files grouped, in order."""
    groups = {}
    for p in paths:
        head, tail = os.path.split(p.rstrip("/"))
        groups.setdefault(head, []).append(tail + ("/" if p.endswith("/") else ""))
    text = [os.path.join(h, n[0]) if len(n) == 1 else f"{os.path.join(h, '')}{{{', '.join(n)}}}"
            for h, n in groups.items()]
    return ", ".join(text) or "nothing"


def warmup_note(warmup, steps):
    """A note (rank 0) when the linear LR warm-up is longer than the run: its peak is never reached.
    The schedule itself is left as asked (a short test run keeps the full run's warm-up slope). No
    run (0 steps): no note."""
    if warmup and 0 < steps < warmup:
        say(f"note: --warmup {warmup} is longer than the run ({steps} steps): the learning rate "
            f"rises to {steps / warmup:.0%} of --lr and never reaches its peak "
            f"(--warmup {max(1, steps // 10)}: 10% of the run)")


def percent(v) -> str:
    """A percent as every command prints it: one decimal (a run's standard error is above a tenth
    of a point)."""
    return "null" if v is None else f"{v:.1f}"


# -----------------------------------------------------------------------------
# Plots: matplotlib on its Agg canvas (no display needed). Each drawing function returns its
# Figure, so a test can read the axes (limits, labels, legend, line data) instead of pixels.
# a series of at most this many points gets markers (a single point is otherwise invisible)
FEW_POINTS = 30


def new_figure(size=(9, 4.2)):
    """A Figure with one Axes on an Agg canvas, laid out so labels and an
    outside legend fit (constrained)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=size, dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def plot_series(ax, label, xs, ys, **style):
    """One line; a non-finite or None y breaks it; markers when it has few points."""
    ys = [math.nan if y is None or not math.isfinite(y) else y for y in ys]
    if sum(map(math.isfinite, ys)) <= FEW_POINTS:
        style = {"marker": "o", "markersize": 4} | style
    return ax.plot(xs, ys, label=label, **style)


def finish_axes(ax, title, xlabel, ylabel):
    """Title, axis labels, whole-number x ticks (x counts steps or generations: never 0.5 of one), a
    light grid and the legend outside the axes, on the right, where it never hides a line."""
    from matplotlib.ticker import MaxNLocator
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=9,
                  frameon=False)


def save_figure(fig, path):
    """The figure as a PNG at `path`, written whole or not at all (write_file)."""
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_file(path, buf.getvalue())
    return fig


def draw_curves(png_path, title, series, marks=(), xlabel="step (optimizer steps)",
                ylabel="loss (nats)"):
    """A line plot of training curves, saved as PNG; returns the Figure. series:
    [(label, [(x, y)], style)] with matplotlib style keywords (color, linewidth ...);
    marks: [(x, text)] vertical lines, each labelled at the top (IL's spawns, a phase
    change). A mark beyond the last point is left out."""
    fig, ax = new_figure()
    x_max = max((p[0] for _, pts, _ in series for p in pts), default=0)
    for label, pts, style in series:
        plot_series(ax, label, [p[0] for p in pts], [p[1] for p in pts], **style)
    for x, text in [m for m in marks if m[0] <= x_max]:
        ax.axvline(x, color="0.35", linestyle=":", linewidth=1)
        ax.annotate(text, (x, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -10),
                    textcoords="offset points", fontsize=8, color="0.25")
    # a run starts at step 0: a short run's few points are not spread over a wide axis
    ax.set_xlim(left=0)
    finish_axes(ax, title, xlabel, ylabel)
    return save_figure(fig, png_path)


# -----------------------------------------------------------------------------
# Measurement: training FLOPs of a CLIP step and model FLOPs utilisation (MFU)

def estimate_flops_per_pair(cfg, text_len=None):
    """Training FLOPs per pair (3 x forward, 2 per MAC) at text length `text_len` (default full)."""
    P, T = (cfg.image_size // cfg.patch_size) ** 2, text_len or cfg.context_length
    tower = lambda n, w, L: L * (12 * n * w * w + 2 * n * n * w)       # QKV, out, MLP + attention
    macs = (tower(P + 1, cfg.vision_width, cfg.vision_layers)
            + P * 3 * cfg.patch_size ** 2 * cfg.vision_width)
    macs += tower(T, cfg.text_width, cfg.text_layers)
    if cfg.codebook_size:   # query maps, token x code scores, the weighted sum of the codes
        K, D = cfg.codebook_size, cfg.code_dim
        macs += sum(n * (w * D + D * D) + n * K * D + K * D
                    for n, w in ((P, cfg.vision_width), (T, cfg.text_width)))
    else:
        macs += (cfg.vision_width + cfg.text_width) * cfg.embed_dim
    return 3 * 2 * macs


# dense bf16 peak FLOP/s by device-name fragment, first match wins: the PCIe and NVL H100s run
# lower clocks than the SXM part that `torch.cuda.get_device_name` calls "NVIDIA H100 80GB HBM3"
PEAK_FLOPS = {"H200": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12,
              "A100": 312e12, "A10": 125e12, "L4": 121e12}


def peak_flops(device_name):
    return next((v for k, v in PEAK_FLOPS.items() if k in device_name), None)


def estimate_mfu(cfg, pairs_per_s, device, text_len=None):
    """Model FLOPs utilisation against the dense bf16 peak of the GPU (None on CPU/unknown)."""
    peak = (peak_flops(torch.cuda.get_device_name(device)) if str(device).startswith("cuda")
            else None)
    return None if peak is None else estimate_flops_per_pair(cfg, text_len) * pairs_per_s / peak


# -----------------------------------------------------------------------------
# Results over seeds: the run folders of the training scripts, grouped, with 95% intervals
# (every script's `summarize`/`report --seeds` reads its runs with its own read_run)

# t_{0.975, df} for df = 1..30 (standard tables); beyond 30 the Cornish-Fisher expansion is
# within 1e-4
T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
        2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
        2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)


def t975(df: int) -> float:
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def mean_ci(values) -> tuple:
    """(mean, half-width of the two-sided 95% Student-t interval) over seeds;
    nan width for one seed."""
    v = np.asarray(values, dtype=np.float64)
    h = t975(len(v) - 1) * float(v.std(ddof=1)) / math.sqrt(len(v)) if len(v) > 1 else math.nan
    return float(v.mean()), h


def paired_diff(a: dict, b: dict) -> tuple:
    """Paired difference A - B over the seeds both have ({seed: value} each):
    (mean, half-width, n)."""
    seeds = sorted(set(a) & set(b))
    return ((*mean_ci([a[s] - b[s] for s in seeds]), len(seeds)) if seeds
            else (math.nan, math.nan, 0))


def _pct(m: float, h: float, diff: bool = False) -> str:
    """m ± h in %; a paired difference (`diff`) is signed, and starred where its interval excludes
    zero (a star needs an interval: two seeds or more, some spread)."""
    head = f"{100 * m:+.1f}" if diff else f"{100 * m:.1f}"
    return ((head if math.isnan(h) else f"{head} ± {100 * h:.1f}")
            + ("*" if diff and h > 0 and abs(m) > h else ""))


def results_table(rows: dict, label: str = "method") -> str:
    """Markdown table in %: {name: {metric: value or [per-seed values]}} (a
    list: mean ± 95% t-interval half-width)."""
    # a column some row lacks is blank there
    cols = list(dict.fromkeys(c for r in rows.values() for c in r))

    def fmt(v):
        if v is None:
            return ""
        if isinstance(v, str):  # a cell already formatted
            return v
        if isinstance(v, list):
            return _pct(*mean_ci(v))
        return f"{100 * v:.1f}"

    lines = ([[label, *cols], ["---"] * (len(cols) + 1)]
             + [[n] + [fmt(r.get(c)) for c in cols] for n, r in rows.items()])
    return "\n".join("| " + " | ".join(ln) + " |" for ln in lines)


def summarize_runs(root: str, read_run, baseline=None) -> dict:
    """Run folders under `root` that `read_run` reads (-> (group, seed, {metric: fraction}) or a
    list), grouped; prints mean ± 95% t-interval per group and each group's paired difference
    against its baseline (a group, default the first, or a function group -> group) on shared seeds
    (*: excludes 0). -> {group: {metric: {seed: value}}}"""
    if not os.path.isdir(root):
        raise DataError(f"{root}: no such folder of runs")
    groups = {}
    for d in sorted(os.listdir(root)):
        runs = read_run(os.path.join(root, d)) if os.path.isdir(os.path.join(root, d)) else None
        # one run or several
        for name, seed, res in [runs] if isinstance(runs, tuple) else runs or []:
            for k, v in res.items():
                groups.setdefault(name, {}).setdefault(k, {})[seed] = v
    if not groups:
        raise DataError(f"{root}: no finished run folder in it")
    if not callable(baseline):      # one group every other is paired with, or a rule per group
        fixed = baseline or next(iter(groups))
        if fixed not in groups:
            raise DataError(f"{root}: no runs of baseline {fixed!r} "
                            f"(methods: {', '.join(groups)})")
        baseline = lambda name: fixed
    # one table per kind of run (retrieval, captioning ...), told by its first metric;
    # a metric only some of its runs have is a column, blank where absent
    tables = {}
    for name, r in groups.items():
        tables.setdefault(next(iter(r)), []).append(name)
    for names in tables.values():
        cols = list(dict.fromkeys(c for n in names for c in groups[n]))
        n_seeds = {n: len({s for v in groups[n].values() for s in v}) for n in names}
        print(results_table(
            {f"{n} ({n_seeds[n]})": {k: list(v.values()) for k, v in groups[n].items()}
             for n in names},
            label="method (n seeds)"))
        paired = {}
        for name, base in ((n, baseline(n)) for n in names
                           if baseline(n) in names and baseline(n) != n):
            a, b = groups[name], groups[base]
            d = {c: paired_diff(a[c], b[c]) for c in cols if c in a and c in b}
            paired[f"{name} - {base} ({max((k for *_, k in d.values()), default=0)})"] = {
                c: _pct(*d[c][:2], diff=True) if c in d else "" for c in cols}
        if paired:
            print(f"\n{results_table(paired, 'paired difference (n seeds)')}\n"
                  f"(* the paired 95% interval excludes zero)\n")
    return groups
