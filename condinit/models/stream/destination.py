"""What is already where a streamed write goes: symlinks and another model (refused unless
``overwrite``), shards a ``resume`` keeps, and the free disk space.

A symlink in the place of a file the write creates (a shard, ``config.json``,
``generation_config.json``, the index) would send the write outside the directory: it is refused
(:func:`symlinked`), and with ``overwrite`` the link itself is replaced by a regular file, its
target never touched. A shard that is a symlink is never kept by a resume. No file outside the
directory is read: a symlink there that leads out of it (a shard name outside the plan, say) is
refused before anything is read.

A directory that holds another model (another ``config.json``, or weights whose ``condinit`` entry
names another seed, method, dtype or layout, or weights without one) is refused. ``resume=True``
keeps every planned shard already there whose size and header (tensor names, shapes, offsets and
metadata, all known beforehand) are exactly what this write would give. (A shard damaged after it
was completely written, with an intact header, is not detected: ``overwrite=True`` rewrites
everything.)
"""
from __future__ import annotations

import json
import os
import shutil
import stat
from typing import Optional

from condinit.io.atomic import open_nofollow, special_file
from condinit.io.safetensors_format import (CONFIG_NAME, SHARD_NAME_RE, WEIGHTS_INDEX_NAME, WEIGHTS_NAME,
                                            canonical_json, read_header)

from ..checkpoint import METADATA_KEY

__all__ = ["check_out_dir", "missing_parent", "symlinked", "not_regular", "other_model", "complete", "free_bytes",
           "needed_bytes"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def check_out_dir(out_dir, missing_parent_ok: bool = False) -> str:
    """The absolute output directory: an existing directory, or a new one in an existing directory
    (``missing_parent_ok``: in a directory that does not exist yet either, for a dry run's plan)."""
    path = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"out_dir {path} exists and is not a directory")
        return path
    if not missing_parent_ok and not os.path.isdir(os.path.dirname(path)):
        raise ValueError(missing_parent(path))
    return path


def missing_parent(out_dir: str) -> str:
    """The refusal of an output directory whose parent directory does not exist."""
    return f"out_dir {out_dir}: its parent directory {os.path.dirname(out_dir)} does not exist"


def symlinked(out_dir: str, names) -> Optional[str]:
    """The first of ``names`` (files this write creates in ``out_dir``) that is a symlink, as
    ``"NAME is a symlink to TARGET"``, or None."""
    for name in names:
        path = os.path.join(out_dir, name)
        if os.path.islink(path):
            target = os.path.normpath(os.path.join(out_dir, os.readlink(path)))
            return f"{name} is a symlink to {target}"
    return None


def not_regular(out_dir: str, names) -> Optional[str]:
    """The first of ``names`` (files this write creates in ``out_dir``) that is there as something
    no file can replace atomically (a directory, a FIFO, a device, a socket), as ``"NAME is a FIFO
    (named pipe)"``, or None. Nothing is opened."""
    for name in names:
        kind = special_file(os.path.join(out_dir, name))
        if kind is not None:
            return f"{name} is {kind}"
    return None


def _identity(meta: dict) -> dict:
    """The fields of a ``condinit`` entry that say which model it is (not which shard)."""
    return {k: v for k, v in meta.items() if k not in ("shard", "layers")}


def _first_difference(old: dict, new: dict) -> str:
    for k in sorted(set(old) | set(new)):
        if old.get(k) != new.get(k):
            return f"{k}: {_short(old.get(k))} there, {_short(new.get(k))} here"
    return ""


def _short(v) -> str:
    text = json.dumps(v, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def _link_outside(out_dir: str, name: str) -> Optional[str]:
    """Where the entry ``name`` of ``out_dir`` leads if it is a symlink whose target (all links
    followed) is outside ``out_dir``; else None."""
    path = os.path.join(out_dir, name)
    if not os.path.islink(path):
        return None
    root, target = os.path.realpath(out_dir), os.path.realpath(path)
    return None if os.path.commonpath([root, target]) == root else target


def other_model(out_dir: str, config_text: Optional[str], metadata: dict, planned: set) -> Optional[str]:
    """Why ``out_dir`` holds a model other than the one about to be written (``metadata``: its whole
    ``condinit`` entry), or None (nothing there, or this model: same config, same ``condinit``
    identity)."""
    if not os.path.isdir(out_dir):
        return None
    names = sorted(os.listdir(out_dir))
    for name in names:   # every file read below: none through a link that leaves the directory
        if name in (CONFIG_NAME, WEIGHTS_INDEX_NAME) or name.endswith(".safetensors"):
            outside = _link_outside(out_dir, name)
            if outside is not None:
                return (f"{name} is a symlink to {outside}, outside the directory (condinit never reads a "
                        f"file outside it)")
    if config_text is not None and CONFIG_NAME in names:
        try:
            with open(os.path.join(out_dir, CONFIG_NAME), encoding="utf-8") as fh:
                old = json.load(fh)
        except (OSError, ValueError, RecursionError):   # RecursionError: nested too deeply to parse
            return f"its {CONFIG_NAME} is not readable JSON"
        new = json.loads(config_text)
        if not isinstance(old, dict):
            return f"its {CONFIG_NAME} is not a JSON object"
        old = {k: v for k, v in old.items() if k != "transformers_version"}
        new = {k: v for k, v in new.items() if k != "transformers_version"}
        if old != new:
            return f"its {CONFIG_NAME} differs ({_first_difference(old, new)})"
    metadata = json.loads(canonical_json(metadata))   # compared as a reader of the files parses it
    ours = _identity(metadata)
    our_layers = [canonical_json(ent) for ent in metadata.get("layers", [])]
    for name in names:
        path = os.path.join(out_dir, name)
        if not os.path.isfile(path):
            continue
        if name == WEIGHTS_INDEX_NAME:
            try:
                with open(path, encoding="utf-8") as fh:
                    meta = (json.load(fh).get("metadata") or {}).get(METADATA_KEY)
            except (OSError, ValueError, RecursionError, AttributeError):
                return f"its {name} is not a readable index"
        elif name.endswith(".safetensors") and (name in planned or SHARD_NAME_RE.match(name) or name == WEIGHTS_NAME):
            try:
                raw = (read_header(path).get("__metadata__") or {}).get(METADATA_KEY)
                meta = json.loads(raw) if raw is not None else None
            except (ValueError, RecursionError):
                if name in planned:   # an unfinished or damaged file this write replaces anyway
                    continue
                return f"{name} is not a readable safetensors file"
        elif name.endswith(_WEIGHT_SUFFIXES):
            return f"it holds weights this write does not produce ({name})"
        else:
            continue
        if not isinstance(meta, dict):
            return f"{name} was not written by condinit (no condinit metadata)"
        if _identity(meta) != ours:
            return f"{name} is another condinit model ({_first_difference(_identity(meta), ours)})"
        layers = meta.get("layers") or []
        if not isinstance(layers, list) or any(canonical_json(ent) not in our_layers for ent in layers):
            return f"{name} describes other attention layers"
    return None


def _regular_size(path: str) -> Optional[int]:
    """The size of ``path`` if it is a regular file (not a symlink), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def complete(path: str, head: bytes, size: int) -> bool:
    """Whether ``path`` is the file this write would give: a regular file (not a symlink), its size,
    and its header (every tensor's name, dtype, shape and offsets, and the metadata) byte for byte."""
    try:
        if _regular_size(path) != size:
            return False
        with open(path, "rb", opener=open_nofollow) as fh:
            return fh.read(len(head)) == head
    except OSError:
        return False


def free_bytes(path: str) -> int:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent)."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def needed_bytes(paths: dict, sizes: dict, keep: set, follow_symlinks: bool = True) -> int:
    """Bytes the write needs free: every file it writes, less the files it replaces (freed at their
    rename; with ``follow_symlinks=False`` a symlink is replaced itself and frees nothing), but the
    largest of those, held until its own replacement is complete."""
    new = sum(sizes[f] for f in paths if f not in keep)
    size = (lambda p: os.path.getsize(p) if os.path.isfile(p) else None) if follow_symlinks else _regular_size
    replaced = [n for n in (size(paths[f]) for f in paths if f not in keep) if n is not None]
    return new - sum(replaced) + max(replaced, default=0)
