"""safetensors checkpoints: atomic writes with a ``condinit`` header entry, safe reads, and finding
attention weights in a checkpoint by name (for ``condinit inspect``).

Writes (:func:`atomic_output`, :func:`save_model_atomic`):

* Atomic: a temporary file in the destination's directory, ``fsync``, ``os.replace``, then
  ``fsync`` of the directory. The old file stays intact until the rename: on any error, on
  Ctrl-C and on SIGTERM the temporary file is removed and nothing is left behind. SIGKILL cannot
  be caught: the next write to the same destination removes the temporary files of writers that
  are gone (their names carry a host tag and the writer's PID; see :func:`atomic_output`).
* Modes: a new file gets ``0o666 & ~umask`` (what ``open(path, "w")`` gives); an overwritten file
  keeps its mode. The file is owned by the writer (the rename makes a new inode).
* Symlinks are written through: a destination that is a symlink keeps the link, and the file it
  points to is replaced atomically in that file's own directory (a dangling link creates its
  target, as a shell redirection does). Destinations that are not regular files (devices, FIFOs,
  sockets) are refused before any work.
* Reproducible: the safetensors header is written with sorted keys in compact JSON, so the same
  tensors and metadata give byte-identical files from run to run.

Reads never unpickle: a file that is not safetensors (a ``torch.save`` zip, a pickle, a truncated
file) is rejected with a ValueError saying so, before any tensor is touched. The header is parsed
and checked here (length, JSON, structure, offsets) before safetensors sees the file, and the
``condinit`` entry is checked field by field, so a damaged or hostile file gives a one-line
ValueError naming the file and what is wrong, never a traceback.

The ``condinit`` metadata entry (a JSON string in the safetensors header) written by ``condinit init``::

    {"format": 1, "family": "llama", "seed": 0, "method": "auto", "v_mode": "identity",
     "qk_gain": 1.0, "v_gain": 1.0, "num_heads": 32, "num_kv_heads": 8, "head_dim": 64,
     "layers": [{"index": 0, "name": "model.layers.0.self_attn", "num_heads": 32, "num_kv_heads": 8,
                 "head_dim": 64, "layout": "separate", "q": {"tensor": "model.layers.0.self_attn.q_proj.weight",
                 "start": 0, "stop": 2048, "transposed": false}, "k": {...}, "v": {...}}, ...],
     "uncovered": [{"name": ..., "class": ..., "reason": ...}]}

(keys are stored sorted). A projection whose rows alternate with the others' (GPT-NeoX's ``[H, 3,
d]``, Falcon's groups) also has ``"groups"`` and ``"stride"``: group ``g`` is rows ``start + g*stride
: stop + g*stride``, the groups stacked in order give the projection's heads; without them the
projection is the one row range ``start:stop``. ``"uncovered"`` lists the attention-like modules
``condinit.apply`` left unconditioned, and why. Where real models keep their attention weights: docs/design.md, "Model layouts".
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import signal
import socket
import stat
import struct
import tempfile
import threading
import time
from typing import Optional

import torch
from torch import nn

from .._validate import check_int

__all__ = ["save_model_atomic", "atomic_output", "check_output_path", "condinit_metadata", "open_checkpoint",
           "read_metadata", "locate_attention", "projection_blocks", "Checkpoint", "ShardedCheckpoint",
           "PICKLE_SUFFIXES"]

METADATA_KEY = "condinit"
METADATA_FORMAT = 1
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".tar")

# safetensors refuses headers above 100 MB; bounding the length first keeps a hostile length field
# from making us read (and parse) an arbitrary amount of the file.
MAX_HEADER_BYTES = 100_000_000


def _canonical_json(value) -> str:
    """Sorted keys, compact separators, UTF-8 kept as is: one byte string per value."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _show(value, limit: int = 60) -> str:
    """A short one-line repr of a value read from a file, for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ------------------------------------------------------------------------------------------------
# writing

_FILE_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def _resolve_output(path) -> tuple[str, str]:
    """``(shown, dest)``: the absolute path as given, and the file that will be replaced (symlinks
    followed), after every check of :func:`check_output_path`."""
    shown = os.path.abspath(os.fspath(path))
    dest = os.path.realpath(shown)
    via = f" (the target of symlink {shown})" if dest != shown else ""
    try:
        st = os.stat(dest)
    except (FileNotFoundError, NotADirectoryError):  # the directory checks below say which
        st = None
    except OSError as exc:  # ELOOP: a symlink cycle
        raise ValueError(f"output {shown} cannot be used: {exc.strerror or exc}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise ValueError(f"output {dest}{via} is a directory, expected a file path")
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _FILE_KINDS if test(st.st_mode)), "not a regular file")
            raise ValueError(f"output {dest}{via} is {kind}; condinit writes only regular files (it replaces the "
                             f"file atomically)")
    d = os.path.dirname(dest)
    if not os.path.exists(d):
        raise ValueError(f"output directory {d}{via} does not exist")
    if not os.path.isdir(d):
        raise ValueError(f"output directory {d}{via} is not a directory")
    try:  # os.access is not enough (root, read-only mounts): create and remove a probe file
        fd, probe = tempfile.mkstemp(dir=d, prefix=".condinit-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"output directory {d}{via} is not writable: {exc.strerror or exc}") from None
    return shown, dest


def check_output_path(path) -> str:
    """Validate an output path before any work; returns it as an absolute path (symlinks kept).

    Checked: the file that will be written (a symlink's target: writes go through links) is a
    regular file or does not exist yet, and its directory exists and is writable. A directory, a
    device node such as ``/dev/null``, a FIFO or a socket is refused with a ValueError naming the
    path and what it is.

    Examples:
        >>> out = check_output_path("model.safetensors")
        >>> check_output_path("/dev/null")
        Traceback (most recent call last):
        ValueError: output /dev/null is a character device; condinit writes only regular files ...
    """
    return _resolve_output(path)[0]


# Temporary files: ".{base}.{host tag}.{pid}.{random}.tmp" in the destination's directory. The host
# tag and PID let a later write tell a temporary file whose writer is gone (SIGKILL, power loss)
# from one that is being written right now, which it must never delete.
_HOST_TAG = hashlib.blake2s(socket.gethostname().encode("utf-8", "surrogateescape"), digest_size=4).hexdigest()
_BASE_CHARS = 180  # keeps the temporary name under the usual 255-byte limit for long destinations
# A temporary file whose writer cannot be checked (another host, or a PID now used by another
# process) is stale once it has not been modified for this long; a live writer modifies its file
# until the rename.
STALE_TEMP_AGE_S = 3600.0

_ACTIVE_TEMPS: set = set()         # temporary files being written by this process
# creation + registration vs. the sweep and the SIGTERM handler (which keeps it: no temporary file is
# made after it); reentrant, as the handler runs in the main thread, possibly inside a holder
_TEMPS_LOCK = threading.RLock()
_TEMP_DIRS: set = set()             # (directory, temporary-name prefix) of every temporary file made
_sigterm_depth = 0                 # nesting of main-thread writes that installed the handler
_sigterm_previous = None


def _temp_pattern(base: str):
    return re.compile(rf"^\.{re.escape(base[:_BASE_CHARS])}\.([0-9a-f]{{8}})\.([0-9]+)\.[a-z0-9_]+\.tmp$")


def _writer_alive(pid: int) -> bool:
    if pid <= 0 or os.name == "nt":  # os.kill(pid, 0) terminates the process on Windows
        return pid > 0
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except OSError:  # EPERM: it exists, owned by another user
        return True
    return True


def _sweep_stale_temps(d: str, base: str) -> None:
    """Remove this destination's temporary files left by writers that are gone."""
    pattern = _temp_pattern(base)
    try:
        names = os.listdir(d)
    except OSError:
        return
    now = time.time()
    for name in names:
        m = pattern.match(name)
        if m is None:
            continue
        tmp = os.path.join(d, name)
        host, pid = m[1], int(m[2])
        with _TEMPS_LOCK:
            if tmp in _ACTIVE_TEMPS:
                continue
            try:
                age = now - os.lstat(tmp).st_mtime
            except OSError:
                continue
            if host == _HOST_TAG and pid == os.getpid():
                stale = True  # ours, not being written: left by an earlier process with this PID
            elif host == _HOST_TAG and not _writer_alive(pid):
                stale = True
            else:
                stale = age > STALE_TEMP_AGE_S
            if stale:
                # best effort: a leftover we may not remove (another user's, a read-only
                # directory entry) must not stop this write
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


def _temp_prefix(base: str) -> str:
    return f".{base[:_BASE_CHARS]}.{_HOST_TAG}.{os.getpid()}."


def _new_temp(d: str, base: str) -> str:
    with _TEMPS_LOCK:
        _TEMP_DIRS.add((d, _temp_prefix(base)))
        fd, tmp = tempfile.mkstemp(dir=d, prefix=_temp_prefix(base), suffix=".tmp")
        _ACTIVE_TEMPS.add(tmp)
    os.close(fd)
    return tmp


def _on_sigterm(signum, frame):
    # The default action would end the process here and leave full-size temporary files behind:
    # remove them, then terminate the way the default action does (killed by the signal). The lock
    # is taken and kept: a writer thread finishes making (and registering) a temporary file first,
    # and makes none after. The directories are swept too, for a file this thread made but had not
    # registered when the signal came.
    _TEMPS_LOCK.acquire()
    for tmp in tuple(_ACTIVE_TEMPS):
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    for d, prefix in tuple(_TEMP_DIRS):
        with contextlib.suppress(OSError):
            for name in os.listdir(d):
                if name.startswith(prefix) and name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(d, name))
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    raise SystemExit(128 + signum)  # not reached: the signal's default action ends the process


@contextlib.contextmanager
def _removing_temps_on_sigterm():
    """Install :func:`_on_sigterm` for the duration of a write, where SIGTERM would otherwise end the
    process without cleanup: only over the default action (an application's own handler or SIG_IGN
    decides for itself), and only in the main thread (``signal.signal`` works nowhere else; writes
    from other threads rely on the sweep)."""
    global _sigterm_depth, _sigterm_previous
    installed = False
    if threading.current_thread() is threading.main_thread():
        if _sigterm_depth > 0:
            installed = True
            _sigterm_depth += 1
        elif signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            try:
                _sigterm_previous = signal.signal(signal.SIGTERM, _on_sigterm)
            except ValueError:  # not the main interpreter
                pass
            else:
                installed = True
                _sigterm_depth = 1
    try:
        yield
    finally:
        if installed:
            _sigterm_depth -= 1
            if _sigterm_depth == 0 and signal.getsignal(signal.SIGTERM) is _on_sigterm:
                signal.signal(signal.SIGTERM, _sigterm_previous)


def _current_umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no /proc: read it by setting it (briefly), then put it back
    os.umask(mask)
    return mask


def _final_mode(dest: str) -> int:
    try:
        st = os.stat(dest)
    except FileNotFoundError:
        return 0o666 & ~_current_umask()
    return stat.S_IMODE(st.st_mode)


@contextlib.contextmanager
def atomic_output(path):
    """Yield a temporary path next to ``path``'s file; on success fsync it and rename it over the file,
    on error (or SIGTERM) remove it. The old file is untouched until the rename.

    ``path`` is checked first (:func:`check_output_path`). A symlink is written through: the file it
    points to is replaced, in that file's directory, and the link stays. The result has the mode of
    the file it replaces, or ``0o666 & ~umask`` when new. The temporary file is
    ``.{name}.{host tag}.{pid}.{random}.tmp``; each write first removes this destination's temporary
    files whose writer on this host is gone (SIGKILL) or that nobody has modified for an hour,
    never those of a live writer.

    Examples:
        >>> with atomic_output("curves.csv") as tmp:
        ...     with open(tmp, "w") as fh:
        ...         fh.write("step,loss\\n")
    """
    _, dest = _resolve_output(path)
    d, base = os.path.split(dest)
    _sweep_stale_temps(d, base)
    with _removing_temps_on_sigterm():
        tmp = _new_temp(d, base)
        try:
            yield tmp
            os.chmod(tmp, _final_mode(dest))
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, dest)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            with _TEMPS_LOCK:
                _ACTIVE_TEMPS.discard(tmp)
    with contextlib.suppress(OSError):  # make the rename durable; not possible on every filesystem
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _canonicalize_header(path: str) -> None:
    """Rewrite a safetensors header in place with sorted keys: safetensors writes its ``__metadata__``
    map in an order that changes from run to run. Re-encoding the same JSON with another key order
    does not change its length, so the tensor data stays where it is."""
    with open(path, "rb+") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n).decode("utf-8"))
        text = _canonical_json(header).encode("utf-8")
        if len(text) > n:
            raise RuntimeError(f"{path}: the sorted safetensors header is {len(text)} bytes, longer than the "
                               f"{n} bytes written")
        fh.seek(8)
        fh.write(text.ljust(n, b" "))  # safetensors pads its header with spaces


def save_model_atomic(model: nn.Module, path, metadata: Optional[dict] = None) -> str:
    """Write ``model``'s state dict to ``path`` as safetensors, atomically (:func:`atomic_output`);
    shared (tied) tensors once. ``metadata`` values that are not strings are stored as JSON. The
    header has sorted keys: the same tensors and metadata give a byte-identical file. Returns the
    absolute path (as given: a symlink is written through, not replaced).

    Examples:
        >>> model = torch.nn.Linear(4, 4)
        >>> save_model_atomic(model, "linear.safetensors", {"note": "example"})
        '/.../linear.safetensors'
    """
    from safetensors.torch import save_model

    meta = {str(k): (v if isinstance(v, str) else _canonical_json(v)) for k, v in (metadata or {}).items()}
    with atomic_output(path) as tmp:
        save_model(model, tmp, metadata=meta)
        _canonicalize_header(tmp)
    return os.path.abspath(os.fspath(path))


def condinit_metadata(model: nn.Module, report, family: str, extra: Optional[dict] = None) -> dict:
    """The ``condinit`` header entry for a model conditioned by :func:`condinit.apply` (see module doc),
    as ``{"condinit": json}`` with sorted keys (the same model and report give the same string).

    Examples:
        >>> report = condinit.apply(model, seed=0)
        >>> meta = condinit_metadata(model, report, "llama", extra={"preset": "tiny-llama"})
        >>> save_model_atomic(model, "tiny.safetensors", meta)
    """
    names = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    from .apply import find_attention

    layers = []
    by_name = {l.name: l for l in find_attention(model)}
    for rep in report.layers:
        l = by_name.get(rep.name)
        if l is None:
            continue
        ent = {"index": rep.index, "name": rep.name, "num_heads": rep.num_heads,
               "num_kv_heads": rep.num_kv_heads, "head_dim": rep.head_dim}
        ent["layout"] = l.spec.layout
        for p, proj in l.spec.projections():
            ent[p] = {"tensor": names.get(id(proj.weight)), "start": proj.start, "stop": proj.stop,
                      "transposed": proj.transposed}
            if proj.groups > 1:   # interleaved rows: group g is start + g*stride : stop + g*stride
                ent[p].update(groups=proj.groups, stride=proj.stride)
            if proj.matrix_shape is not None:   # a 3-D / conv weight: rows counted in this reshape of it
                ent[p]["matrix_shape"] = list(proj.matrix_shape)
            if proj.in_groups > 1:              # a grouped convolution: the stored blocks of a block-diagonal W
                ent[p]["in_groups"] = proj.in_groups
            if proj.fixed:                      # a learned query: left as the model made it
                ent[p]["fixed"] = True
        layers.append(ent)
    first = layers[0] if layers else {}
    meta = {"format": METADATA_FORMAT, "family": family, "seed": report.seed, "method": report.method,
            "v_mode": report.v_mode, "qk_gain": report.qk_gain, "v_gain": report.v_gain,
            "num_heads": first.get("num_heads"), "num_kv_heads": first.get("num_kv_heads"),
            "head_dim": first.get("head_dim"), "layers": layers,
            "uncovered": [{"name": u.name, "class": u.cls, "reason": u.reason}
                          for u in getattr(report, "uncovered", ())]}
    meta.update(extra or {})
    return {METADATA_KEY: _canonical_json(meta)}


# ------------------------------------------------------------------------------------------------
# reading

# Bytes per element of the safetensors dtypes; a dtype not listed here is left to safetensors to judge.
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _read_header(path: str) -> dict:
    """The parsed safetensors header of ``path``, checked: a ValueError naming the file and the problem
    for anything that is not a complete safetensors file."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if head[:4] == b"PK\x03\x04":
            raise ValueError(f"{path} is a zip archive (a torch.save checkpoint?), not safetensors; condinit reads "
                             f"only safetensors files and never unpickles")
        # A pickle starts with PROTO (0x80, protocol 2-5); so may a valid header length (640, 896,
        # ...): it is a pickle only when that length does not fit the file or no JSON follows.
        looks_pickled = len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5
        if looks_pickled and (len(head) < 8 or not 2 <= struct.unpack("<Q", head)[0] <= size - 8
                              or fh.read(1) != b"{"):
            raise ValueError(f"{path} is a pickle file, not safetensors; condinit reads only safetensors files and "
                             f"never unpickles")
        fh.seek(8)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file: {size} bytes, too short for a header")
        (n,) = struct.unpack("<Q", head)
        if n < 2 or n > size - 8:
            hint = " (a pickle checkpoint?)" if path.lower().endswith(PICKLE_SUFFIXES) else ""
            raise ValueError(f"{path} is not a readable safetensors file{hint}: header length {n} does not fit in "
                             f"{size} bytes (truncated or another format)")
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{path} is not a readable safetensors file: header length {n} is above the "
                             f"{MAX_HEADER_BYTES}-byte limit of safetensors")
        raw = fh.read(n)
    try:
        hdr = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ValueError(f"{path} is not a readable safetensors file: its header is JSON nested too deeply "
                         f"to parse") from None
    except ValueError:  # also UnicodeDecodeError
        raise ValueError(f"{path} is not a readable safetensors file: its header is not UTF-8 JSON") from None
    if not isinstance(hdr, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(
            type(hdr), "null")
        raise ValueError(f"{path} is not a readable safetensors file: its header is {kind} in JSON, expected an "
                         f"object")
    bad = f"{path} is not a readable safetensors file: header entry"
    meta = hdr.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ValueError(f"{bad} '__metadata__' must map names to strings, got {_show(meta)}")
    end = 0
    for name, ent in hdr.items():
        if name == "__metadata__":
            continue
        if not isinstance(ent, dict):
            raise ValueError(f"{bad} {name!r} must be an object with dtype, shape and data_offsets, got {_show(ent)}")
        dtype, shape, offsets = ent.get("dtype"), ent.get("shape"), ent.get("data_offsets")
        if not isinstance(dtype, str):
            raise ValueError(f"{bad} {name!r}: dtype must be a string, got {_show(dtype)}")
        if not (isinstance(shape, list) and all(_is_int(s) and s >= 0 for s in shape)):
            raise ValueError(f"{bad} {name!r}: shape must be a list of integers >= 0, got {_show(shape)}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"{bad} {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end, got "
                             f"{_show(offsets)}")
        if dtype in _DTYPE_BYTES:
            nbytes = _DTYPE_BYTES[dtype]
            for s in shape:
                nbytes *= s
            if offsets[1] - offsets[0] != nbytes:
                raise ValueError(f"{bad} {name!r}: {dtype} {shape} needs {nbytes} bytes, its data_offsets "
                                 f"{offsets} give {offsets[1] - offsets[0]}")
        end = max(end, offsets[1])
    if 8 + n + end > size:
        raise ValueError(f"{path} is truncated: its header describes {8 + n + end} bytes, the file has {size}")
    return hdr


try:
    from safetensors import SafetensorError as _SafetensorError
except ImportError:  # safetensors without the exported error class
    _SafetensorError = Exception
_READ_ERRORS = (_SafetensorError, OSError)


def _one_line(exc) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


class Checkpoint:
    """An open safetensors file (what :func:`open_checkpoint` returns): the ``safe_open`` handle's
    ``keys`` / ``metadata`` / ``get_slice`` / ``get_tensor``, with ``path`` for error messages and
    read errors as ValueErrors naming the file and the tensor."""

    def __init__(self, path: str, handle):
        self.path = path
        self._handle = handle

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return self._handle.__exit__(*exc_info)

    def keys(self):
        return self._handle.keys()

    def metadata(self):
        return self._handle.metadata()

    def get_slice(self, name):
        try:
            return self._handle.get_slice(name)
        except _READ_ERRORS as exc:
            raise ValueError(f"{self.path}: cannot read tensor {name!r}: {_one_line(exc)}") from None

    def get_tensor(self, name):
        try:
            return self._handle.get_tensor(name)
        except _READ_ERRORS as exc:
            raise ValueError(f"{self.path}: cannot read tensor {name!r}: {_one_line(exc)}") from None

    def __getattr__(self, name):
        return getattr(self._handle, name)


def open_checkpoint(path) -> Checkpoint:
    """``safetensors.safe_open(path, "pt")`` after checking that ``path`` really is a complete safetensors
    file (header length, JSON, structure, offsets): anything else is a ValueError naming the file
    and what is wrong. Use it as a context manager.

    A directory is read as a Hugging Face model directory (:class:`ShardedCheckpoint`): through
    its ``model.safetensors.index.json``, or its one ``model.safetensors``.

    Examples:
        >>> with open_checkpoint("tiny.safetensors") as fh:
        ...     meta = read_metadata(fh)
        ...     shapes = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    """
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"{path} does not exist")
    if os.path.isdir(path):
        return _open_directory(path)
    if not os.path.isfile(path):
        raise ValueError(f"{path} is not a regular file, expected a .safetensors file")
    _read_header(path)
    try:
        handle = safe_open(path, framework="pt", device="cpu")
    except Exception as exc:  # whatever safetensors still objects to, after the checks above
        raise ValueError(f"{path} is not a readable safetensors file: {_one_line(exc)}") from None
    return Checkpoint(path, handle)


INDEX_NAME = "model.safetensors.index.json"
SINGLE_WEIGHTS_NAME = "model.safetensors"


class ShardedCheckpoint:
    """A Hugging Face model directory of safetensors shards, read through its index: the
    :class:`Checkpoint` interface (``keys``, ``metadata``, ``get_slice``, ``get_tensor``, ``path``)
    over all shards. Each shard is opened (header checked, memory-mapped) when first read, so
    reading tensor by tensor holds one tensor at a time. ``metadata()`` gives the ``condinit``
    entry of the index (every layer), or else the shards' entries merged. Every tensor the index
    names is checked, at open, to be in the shard it names."""

    def __init__(self, path: str, weight_map: dict, index_meta: Optional[dict]):
        self.path = path
        self._map = weight_map
        self._index_meta = index_meta
        self._handles: dict = {}
        try:
            for fname in dict.fromkeys(weight_map.values()):
                keys = set(self._shard(fname).keys())
                missing = [k for k, f in weight_map.items() if f == fname and k not in keys]
                if missing:
                    raise ValueError(f"{path}: {INDEX_NAME} puts tensor {missing[0]!r} in {fname}, which does not "
                                     f"hold it ({len(missing)} such tensor(s); an unfinished or mixed directory?)")
        except BaseException:
            self.close()
            raise

    def _shard(self, fname: str) -> Checkpoint:
        fh = self._handles.get(fname)
        if fh is None:
            fpath = os.path.join(self.path, fname)
            if not os.path.isfile(fpath):
                raise ValueError(f"{self.path}: {INDEX_NAME} names shard {fname}, which is missing (an unfinished "
                                 f"write? condinit init --resume finishes it)")
            fh = self._handles[fname] = open_checkpoint(fpath)
        return fh

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False

    def close(self) -> None:
        for fh in self._handles.values():
            fh.__exit__(None, None, None)
        self._handles.clear()

    def keys(self):
        return list(self._map)

    def metadata(self):
        meta = self._index_meta
        if meta is None:
            merged, layers = None, []
            for fname in dict.fromkeys(self._map.values()):
                raw = (self._shard(fname).metadata() or {}).get(METADATA_KEY)
                if raw is None:
                    continue
                try:
                    ent = json.loads(raw)
                except ValueError:
                    raise ValueError(f"{os.path.join(self.path, fname)}: the '{METADATA_KEY}' metadata entry is not "
                                     f"valid JSON") from None
                if not isinstance(ent, dict):
                    raise ValueError(f"{os.path.join(self.path, fname)}: the '{METADATA_KEY}' metadata entry is not "
                                     f"a JSON object")
                merged = merged or {k: v for k, v in ent.items() if k not in ("layers", "shard")}
                if isinstance(ent.get("layers"), list):
                    layers += ent["layers"]
            if merged is None:
                return {}
            meta = dict(merged, layers=layers)   # the shards' layers, in shard order (index order)
        return {METADATA_KEY: _canonical_json(meta)}

    def _route(self, name):
        fname = self._map.get(name)
        if fname is None:
            raise ValueError(f"{self.path}: no tensor {name!r} in {INDEX_NAME}")
        return self._shard(fname)

    def get_slice(self, name):
        return self._route(name).get_slice(name)

    def get_tensor(self, name):
        return self._route(name).get_tensor(name)


def _open_directory(path: str):
    """:func:`open_checkpoint` of a directory: its index, or its one weights file."""
    index = os.path.join(path, INDEX_NAME)
    if not os.path.isfile(index):
        single = os.path.join(path, SINGLE_WEIGHTS_NAME)
        if os.path.isfile(single):
            return open_checkpoint(single)
        raise ValueError(f"{path} is a directory without {INDEX_NAME} or {SINGLE_WEIGHTS_NAME}; expected a "
                         f".safetensors file or a Hugging Face model directory")
    try:
        with open(index, encoding="utf-8") as fh:
            data = json.load(fh)
    except RecursionError:
        raise ValueError(f"{index} is JSON nested too deeply to parse") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{index} is not readable JSON: {_one_line(exc)}") from None
    wmap = data.get("weight_map") if isinstance(data, dict) else None
    if not (isinstance(wmap, dict) and wmap and all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items())):
        raise ValueError(f"{index}: weight_map must be a non-empty object of tensor name -> shard file name")
    for fname in set(wmap.values()):
        if os.path.basename(fname) != fname or fname in (".", "..") or not fname.endswith(".safetensors"):
            raise ValueError(f"{index}: shard {_show(fname)} must be a .safetensors file name in the directory")
    meta = data.get("metadata")
    cond = meta.get(METADATA_KEY) if isinstance(meta, dict) else None
    if cond is not None and not isinstance(cond, dict):
        raise ValueError(f"{index}: metadata.{METADATA_KEY} must be an object, got {_show(cond)}")
    return ShardedCheckpoint(path, wmap, cond)


_LAYER_INTS = ("num_heads", "num_kv_heads", "head_dim")


def _check_metadata(meta, where: str) -> dict:
    """``meta`` (the parsed ``condinit`` entry) if every field it has has the type the readers expect;
    otherwise a ValueError naming ``where`` and the field."""
    def fail(field, expected, got):
        raise ValueError(f"{where}: condinit metadata field {field} must be {expected}, got {_show(got)}")

    if not isinstance(meta, dict):
        fail("(the entry itself)", "a JSON object", meta)
    if "format" in meta and meta["format"] != METADATA_FORMAT:
        fail("format", f"{METADATA_FORMAT} (the only format this version reads)", meta["format"])
    for key in ("family", "method", "v_mode", "preset", "dtype"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            fail(key, "a string", meta[key])
    if meta.get("seed") is not None and not (_is_int(meta["seed"]) and meta["seed"] >= 0):
        fail("seed", "an integer >= 0", meta["seed"])
    for key in ("qk_gain", "v_gain"):   # absent in files written before the gains existed: 1, the paper's
        g = meta.get(key)
        if g is not None and not (isinstance(g, (int, float)) and not isinstance(g, bool) and 0 < g < float("inf")):
            fail(key, "a finite number > 0", g)
    for key in _LAYER_INTS:
        if meta.get(key) is not None and not (_is_int(meta[key]) and meta[key] >= 1):
            fail(key, "an integer >= 1 or null", meta[key])
    layers = meta.get("layers")
    if layers is None:
        return meta
    if not isinstance(layers, list):
        fail("layers", "a list", layers)
    for i, ent in enumerate(layers):
        at = f"layers[{i}]"
        if not isinstance(ent, dict):
            fail(at, "an object", ent)
        if not isinstance(ent.get("name"), str):
            fail(f"{at}.name", "a string", ent.get("name"))
        if "index" in ent and not (_is_int(ent["index"]) and ent["index"] >= 0):
            fail(f"{at}.index", "an integer >= 0", ent["index"])
        for key in _LAYER_INTS:
            if not (_is_int(ent.get(key)) and ent[key] >= 1):
                fail(f"{at}.{key}", "an integer >= 1", ent.get(key))
        for p in ("q", "k", "v"):
            proj = ent.get(p)
            if not isinstance(proj, dict):
                fail(f"{at}.{p}", "an object {tensor, start, stop, transposed}", proj)
            if not isinstance(proj.get("tensor"), str):
                fail(f"{at}.{p}.tensor", "a tensor name (string)", proj.get("tensor"))
            for key in ("start", "stop"):
                if not (_is_int(proj.get(key)) and proj[key] >= 0):
                    fail(f"{at}.{p}.{key}", "an integer >= 0", proj.get(key))
            if proj["start"] >= proj["stop"]:
                fail(f"{at}.{p}.start", f"below stop ({proj['stop']})", proj["start"])
            if not isinstance(proj.get("transposed"), bool):
                fail(f"{at}.{p}.transposed", "true or false", proj.get("transposed"))
            if "groups" in proj and not (_is_int(proj["groups"]) and proj["groups"] >= 1):
                fail(f"{at}.{p}.groups", "an integer >= 1", proj["groups"])
            if "stride" in proj and not (_is_int(proj["stride"]) and proj["stride"] >= proj["stop"] - proj["start"]):
                fail(f"{at}.{p}.stride", f"an integer >= stop - start ({proj['stop'] - proj['start']})", proj["stride"])
            if proj.get("groups", 1) > 1 and "stride" not in proj:
                fail(f"{at}.{p}.stride", "present with groups > 1", None)
            shape = proj.get("matrix_shape")
            if shape is not None and not (isinstance(shape, list) and len(shape) == 2
                                          and all(_is_int(n) and n >= 1 for n in shape)):
                fail(f"{at}.{p}.matrix_shape", "a list of two integers >= 1", shape)
        if "layout" in ent and not isinstance(ent["layout"], str):
            fail(f"{at}.layout", "a string", ent["layout"])
    uncovered = meta.get("uncovered")
    if uncovered is not None:
        if not isinstance(uncovered, list):
            fail("uncovered", "a list", uncovered)
        for i, ent in enumerate(uncovered):
            if not (isinstance(ent, dict) and all(isinstance(ent.get(k), str) for k in ("name", "class", "reason"))):
                fail(f"uncovered[{i}]", "an object {name, class, reason} of strings", ent)
    return meta


def read_metadata(fh) -> Optional[dict]:
    """The parsed and checked ``condinit`` header entry of an open checkpoint (:func:`open_checkpoint`),
    or None when there is none. A field of the wrong type is a ValueError naming the file and the field.

    Examples:
        >>> with open_checkpoint("tiny.safetensors") as fh:
        ...     read_metadata(fh)["family"]
        'llama'
    """
    where = getattr(fh, "path", "checkpoint")
    meta = fh.metadata() or {}
    raw = meta.get(METADATA_KEY)
    if raw is None:
        return None
    try:
        val = json.loads(raw)
    except RecursionError:
        raise ValueError(f"{where}: the '{METADATA_KEY}' metadata entry is JSON nested too deeply to parse") from None
    except ValueError:
        raise ValueError(f"{where}: the '{METADATA_KEY}' metadata entry is not valid JSON") from None
    if not isinstance(val, dict):
        raise ValueError(f"{where}: the '{METADATA_KEY}' metadata entry is not a JSON object")
    _check_metadata(val, where)
    names = {n for ent in val.get("layers") or () for n in (ent[p]["tensor"] for p in ("q", "k", "v"))}
    keys = set(fh.keys())
    shapes = {n: tuple(fh.get_slice(n).get_shape()) for n in names if n in keys}
    _check_metadata_tensors(val, shapes, where)
    return val


def _check_metadata_tensors(meta: dict, shapes: dict, where: str) -> None:
    """Every Q/K/V the (type-checked) metadata names is a 2-D tensor of the file with those rows."""
    for ent in meta.get("layers") or ():
        for p in ("q", "k", "v"):
            proj = ent[p]
            t = proj["tensor"]
            if t not in shapes:
                raise ValueError(f"{where}: condinit metadata names tensor {t!r} for {ent['name']}.{p}, which is "
                                 f"not in the file")
            shape = tuple(shapes[t])
            if "matrix_shape" in proj:   # a parameter read as this matrix (its reshape)
                if math.prod(shape) != math.prod(proj["matrix_shape"]):
                    raise ValueError(f"{where}: condinit metadata reads tensor {t!r} (shape {list(shape)}) for "
                                     f"{ent['name']}.{p} as a {proj['matrix_shape']} matrix, which it does not hold")
                shape = tuple(proj["matrix_shape"])
            if len(shape) != 2:
                raise ValueError(f"{where}: condinit metadata names tensor {t!r} ({len(shape)}-D, shape "
                                 f"{list(shape)}) for {ent['name']}.{p}, expected a 2-D projection weight")
            rows = shape[1] if proj["transposed"] else shape[0]
            end = _span_stop(proj)
            if end > rows:
                raise ValueError(f"{where}: condinit metadata gives rows {proj['start']}:{end} of "
                                 f"tensor {t!r} for {ent['name']}.{p}, which has {rows}")


def _span_stop(proj: dict) -> int:
    """One past the last row of a projection entry (``groups`` runs ``stride`` apart)."""
    return proj["stop"] + (proj.get("groups", 1) - 1) * proj.get("stride", 0)


def _entry_rows(proj: dict) -> list:
    """Storage row ranges of a projection entry, in logical order."""
    n, step = proj.get("groups", 1), proj.get("stride", 0)
    return [(proj["start"] + g * step, proj["stop"] + g * step) for g in range(n)]


# Name patterns of the supported families, for checkpoints without condinit metadata.
#   separate:  (prefix, {q: name, k: name, v: name})
#   fused:     one tensor holding q, k, v (transposed for GPT-2 Conv1D)
_SEPARATE = [
    re.compile(r"^(?P<prefix>.*)\.(?P<p>q|k|v)_proj\.weight$"),          # llama, mistral, qwen2, ViT (transformers 5)
    re.compile(r"^(?P<prefix>.*)\.(?P<p>query|key|value)\.weight$"),     # BERT, RoBERTa, ViT (transformers 4)
    re.compile(r"^(?P<prefix>.*)\.(?P<p>q|k|v)_proj_weight$"),            # nn.MultiheadAttention, kdim != embed_dim
    re.compile(r"^(?P<prefix>.*)\.(?P<p>wq|wk|wv)\.weight$"),             # Meta llama reference, torchtitan
]
_FUSED = [
    (re.compile(r"^(?P<prefix>.*)\.c_attn\.weight$"), True),              # GPT-2 Conv1D [in, 3E]
    (re.compile(r"^(?P<prefix>.*)\.qkv\.weight$"), False),                # timm [3E, E]
    (re.compile(r"^(?P<prefix>.*)\.in_proj_weight$"), False),             # nn.MultiheadAttention [3E, E]
    (re.compile(r"^(?P<prefix>.*)\.(?:query_key_value|Wqkv|qkv_proj)\.weight$"), False),
]
_CANON = {"q": "q", "k": "k", "v": "v", "query": "q", "key": "k", "value": "v", "wq": "q", "wk": "k", "wv": "v"}


def _layer_sort_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def locate_attention(shapes: dict, metadata: Optional[dict] = None, *, num_heads: Optional[int] = None,
                     num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
                     source: Optional[str] = None) -> list[dict]:
    """Attention layers of a checkpoint: ``[{name, num_heads, num_kv_heads, head_dim, q: {tensor, start,
    stop, transposed}, k, v}]``.

    ``shapes``: tensor name -> shape. The ``condinit`` metadata gives everything; otherwise layers
    are found by the name patterns of the supported families and head counts come from
    ``num_heads`` (required), ``head_dim`` (default ``q rows / num_heads``) and ``num_kv_heads``
    (default ``k rows / head_dim``). Options given explicitly override the metadata's head counts.
    ``source`` (the file's name) starts every error message. Metadata that does not fit the tensors
    (a field of the wrong type, a missing or 1-D tensor, rows out of range) is a ValueError.

    Examples:
        >>> with open_checkpoint("tiny.safetensors") as fh:
        ...     shapes = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
        ...     layers = locate_attention(shapes, read_metadata(fh), source="tiny.safetensors")
        >>> locate_attention({"h.0.attn.c_attn.weight": (48, 144)}, num_heads=4)[0]["k"]
        {'tensor': 'h.0.attn.c_attn.weight', 'start': 48, 'stop': 96, 'transposed': True}
    """
    for name, val in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        check_int(name, val, min=1, allow_none=True)
    where = source or "checkpoint"
    pre = f"{source}: " if source else ""
    if metadata is not None:
        _check_metadata(metadata, where)
        _check_metadata_tensors(metadata, shapes, where)
    if metadata and metadata.get("layers"):
        out = []
        for ent in metadata["layers"]:
            ent = dict(ent)
            if num_heads is not None:
                ent["num_heads"] = num_heads
            if num_kv_heads is not None:
                ent["num_kv_heads"] = num_kv_heads
            if head_dim is not None:
                ent["head_dim"] = head_dim
            out.append(ent)
        return out
    layers: dict[str, dict] = {}
    for name in shapes:
        for pat in _SEPARATE:
            m = pat.match(name)
            if m and len(shapes[name]) == 2:
                layers.setdefault(m["prefix"], {})[_CANON[m["p"]]] = (name, shapes[name])
                break
        else:
            for pat, transposed in _FUSED:
                m = pat.match(name)
                if m and len(shapes[name]) == 2:
                    layers.setdefault(m["prefix"], {})["fused"] = (name, shapes[name], transposed)
                    break
    found = []
    for prefix in sorted(layers, key=_layer_sort_key):
        ent = layers[prefix]
        if "fused" not in ent and not all(p in ent for p in "qkv"):
            continue
        if num_heads is None:
            raise ValueError(f"{pre}the checkpoint has no condinit metadata: pass --num-heads (and --head-dim / "
                             "--num-kv-heads when they cannot be inferred) to split its attention weights into heads")
        rec = {"name": prefix}
        if "fused" in ent:
            tname, shape, transposed = ent["fused"]
            total = shape[1] if transposed else shape[0]
            kv = num_kv_heads if num_kv_heads is not None else num_heads
            d = head_dim if head_dim is not None else total // (num_heads + 2 * kv)
            if (num_heads + 2 * kv) * d != total:
                raise ValueError(f"{pre}{tname}: {total} fused output rows do not split into {num_heads} + 2 x {kv} "
                                 f"heads of {d}")
            at = 0
            for p, rows in (("q", num_heads * d), ("k", kv * d), ("v", kv * d)):
                rec[p] = {"tensor": tname, "start": at, "stop": at + rows, "transposed": transposed}
                at += rows
        else:
            qrows = ent["q"][1][0]
            d = head_dim if head_dim is not None else qrows // num_heads
            if d < 1 or num_heads * d != qrows:
                raise ValueError(f"{pre}{ent['q'][0]}: {qrows} rows do not split into {num_heads} heads"
                                 + (f" of {head_dim}" if head_dim else ""))
            kv = num_kv_heads if num_kv_heads is not None else ent["k"][1][0] // d
            for p in "qkv":
                rows = ent[p][1][0]
                rec[p] = {"tensor": ent[p][0], "start": 0, "stop": rows, "transposed": False}
            if ent["k"][1][0] != kv * d:
                raise ValueError(f"{pre}{ent['k'][0]}: {ent['k'][1][0]} rows do not split into {kv} heads of {d}")
        rec.update(num_heads=num_heads, num_kv_heads=kv, head_dim=d)
        found.append(rec)
    return found


def projection_blocks(fh, loc: dict, p: str, cache: dict) -> torch.Tensor:
    """Per-head blocks ``[heads, head_dim, in]`` (float32, nn.Linear layout) of projection ``p`` of layer
    ``loc`` (from :func:`locate_attention`) from an open checkpoint; ``cache`` keeps the last tensor
    read (fused layers read it once). A tensor that is not a 2-D weight with those rows is a
    ValueError naming the file and the tensor.

    Examples:
        >>> with open_checkpoint("tiny.safetensors") as fh:
        ...     loc = locate_attention(shapes, read_metadata(fh))[0]
        ...     projection_blocks(fh, loc, "q", {}).shape
        torch.Size([8, 32, 256])
    """
    where = getattr(fh, "path", "checkpoint")
    ent = loc[p]
    name = ent["tensor"]
    if cache.get("name") != name:
        cache["name"], cache["tensor"] = name, fh.get_tensor(name)
    w = cache["tensor"]
    what = f"tensor {name!r} ({loc['name']}.{p})"
    if "matrix_shape" in ent and w.numel() == math.prod(ent["matrix_shape"]):
        w = w.reshape(ent["matrix_shape"])
    if w.dim() != 2:
        raise ValueError(f"{where}: {what} is {w.dim()}-D with shape {list(w.shape)}, expected a 2-D projection "
                         f"weight")
    rows = w.shape[1] if ent["transposed"] else w.shape[0]
    if not 0 <= ent["start"] < ent["stop"] <= _span_stop(ent) <= rows:
        raise ValueError(f"{where}: {what}: rows {ent['start']}:{_span_stop(ent)} are out of range, it has {rows}")
    parts = [w[:, lo:hi].t() if ent["transposed"] else w[lo:hi] for lo, hi in _entry_rows(ent)]
    w = parts[0] if len(parts) == 1 else torch.cat(parts)
    heads = loc["num_heads"] if p == "q" else loc["num_kv_heads"]
    d = loc["head_dim"]
    if w.shape[0] != heads * d:
        raise ValueError(f"{where}: {what} has {w.shape[0]} rows, expected {heads} heads x {d}")
    return w.float().reshape(heads, d, w.shape[1])
