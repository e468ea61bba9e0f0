"""safetensors checkpoints: atomic writes with a ``condinit`` header entry, safe reads, and finding
attention weights in a checkpoint by name (for ``condinit inspect``).

Writes are atomic: a temporary file in the destination's directory, ``fsync``, ``os.replace``, then
``fsync`` of the directory; on any error the temporary file is removed and nothing is left behind.
Shared (tied) tensors are written once (``safetensors.torch.save_model``).

Reads never unpickle: a file that is not safetensors (a ``torch.save`` zip, a pickle, a truncated
file) is rejected with a ValueError saying so, before any tensor is touched.

The ``condinit`` metadata entry (a JSON string in the safetensors header) written by ``condinit init``::

    {"format": 1, "family": "llama", "seed": 0, "method": "auto", "v_mode": "identity",
     "num_heads": 32, "num_kv_heads": 8, "head_dim": 64,
     "layers": [{"index": 0, "name": "model.layers.0.self_attn", "num_heads": 32, "num_kv_heads": 8,
                 "head_dim": 64, "q": {"tensor": "model.layers.0.self_attn.q_proj.weight", "start": 0,
                 "stop": 2048, "transposed": false}, "k": {...}, "v": {...}}, ...]}
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import tempfile
from typing import Optional

import torch
from torch import nn

__all__ = ["save_model_atomic", "atomic_output", "check_output_path", "condinit_metadata", "open_checkpoint",
           "read_metadata", "locate_attention", "projection_blocks", "PICKLE_SUFFIXES"]

METADATA_KEY = "condinit"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".tar")


# ------------------------------------------------------------------------------------------------
# writing

def check_output_path(path) -> str:
    """Validate an output path before any work: its directory exists and is writable, and the path
    itself is not a directory. Returns the absolute path."""
    path = os.path.abspath(os.fspath(path))
    d = os.path.dirname(path)
    if os.path.isdir(path):
        raise ValueError(f"output {path} is a directory, expected a file path")
    if not os.path.exists(d):
        raise ValueError(f"output directory {d} does not exist")
    if not os.path.isdir(d):
        raise ValueError(f"output directory {d} is not a directory")
    try:  # os.access is not enough (root, read-only mounts): create and remove a probe file
        fd, probe = tempfile.mkstemp(dir=d, prefix=".condinit-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"output directory {d} is not writable: {exc.strerror or exc}") from None
    return path


@contextlib.contextmanager
def atomic_output(path):
    """Yield a temporary path next to ``path``; on success fsync it and rename it over ``path``,
    on error remove it."""
    path = check_output_path(path)
    d, base = os.path.split(path)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{base}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename durable; not possible on every filesystem
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def save_model_atomic(model: nn.Module, path, metadata: Optional[dict] = None) -> str:
    """Write ``model``'s state dict to ``path`` as safetensors, atomically; shared tensors once."""
    from safetensors.torch import save_model

    meta = {str(k): (v if isinstance(v, str) else json.dumps(v)) for k, v in (metadata or {}).items()}
    with atomic_output(path) as tmp:
        save_model(model, tmp, metadata=meta)
    return os.path.abspath(path)


def condinit_metadata(model: nn.Module, report, family: str, extra: Optional[dict] = None) -> dict:
    """The ``condinit`` header entry for a model conditioned by :func:`condinit.apply` (see module doc)."""
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
        for p, proj in l.spec.projections():
            ent[p] = {"tensor": names.get(id(proj.weight)), "start": proj.start, "stop": proj.stop,
                      "transposed": proj.transposed}
        layers.append(ent)
    first = layers[0] if layers else {}
    meta = {"format": 1, "family": family, "seed": report.seed, "method": report.method,
            "v_mode": report.v_mode, "num_heads": first.get("num_heads"), "num_kv_heads": first.get("num_kv_heads"),
            "head_dim": first.get("head_dim"), "layers": layers}
    meta.update(extra or {})
    return {METADATA_KEY: json.dumps(meta, separators=(",", ":"))}


# ------------------------------------------------------------------------------------------------
# reading

def _sniff(path: str) -> None:
    """Reject what is not safetensors before handing it to the parser, with a message that says what it is."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if head[:4] == b"PK\x03\x04":
            raise ValueError(f"{path} is a zip archive (a torch.save checkpoint?), not safetensors; condinit reads "
                             f"only safetensors files and never unpickles")
        if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
            raise ValueError(f"{path} is a pickle file, not safetensors; condinit reads only safetensors files and "
                             f"never unpickles")
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file: {size} bytes, too short for a header")
        (n,) = struct.unpack("<Q", head)
        if n < 2 or n > size - 8:
            hint = " (a pickle checkpoint?)" if path.lower().endswith(PICKLE_SUFFIXES) else ""
            raise ValueError(f"{path} is not a readable safetensors file{hint}: header length {n} does not fit in "
                             f"{size} bytes (truncated or another format)")
        header = fh.read(n)
    try:
        hdr = json.loads(header)
    except ValueError:
        raise ValueError(f"{path} is not a readable safetensors file: its header is not JSON") from None
    end = 0
    for k, v in hdr.items():
        if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v:
            end = max(end, int(v["data_offsets"][1]))
    if 8 + n + end > size:
        raise ValueError(f"{path} is truncated: its header describes {8 + n + end} bytes, the file has {size}")


def open_checkpoint(path):
    """``safetensors.safe_open(path, "pt")`` after checking that ``path`` really is a complete safetensors file."""
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"{path} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory, expected a .safetensors file")
    _sniff(path)
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as exc:  # SafetensorError is not exported as a stable class
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from None


def read_metadata(fh) -> Optional[dict]:
    """The parsed ``condinit`` header entry of an open checkpoint, or None."""
    meta = fh.metadata() or {}
    raw = meta.get(METADATA_KEY)
    if raw is None:
        return None
    try:
        val = json.loads(raw)
    except ValueError:
        raise ValueError(f"the '{METADATA_KEY}' metadata entry is not valid JSON") from None
    if not isinstance(val, dict):
        raise ValueError(f"the '{METADATA_KEY}' metadata entry is not a JSON object")
    return val


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
                     num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None) -> list[dict]:
    """Attention layers of a checkpoint: ``[{name, num_heads, num_kv_heads, head_dim, q: {tensor, start,
    stop, transposed}, k, v}]``.

    ``shapes``: tensor name -> shape. The ``condinit`` metadata gives everything; otherwise layers
    are found by the name patterns of the supported families and head counts come from
    ``num_heads`` (required), ``head_dim`` (default ``q rows / num_heads``) and ``num_kv_heads``
    (default ``k rows / head_dim``). Options given explicitly override the metadata's head counts.
    """
    if metadata and metadata.get("layers"):
        out = []
        for ent in metadata["layers"]:
            ent = dict(ent)
            for p in ("q", "k", "v"):
                t = ent.get(p, {}).get("tensor")
                if t not in shapes:
                    raise ValueError(f"condinit metadata names tensor {t!r} for {ent.get('name')}.{p}, which is not in "
                                     f"the file")
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
            raise ValueError("the checkpoint has no condinit metadata: pass --num-heads (and --head-dim / "
                             "--num-kv-heads when they cannot be inferred) to split its attention weights into heads")
        rec = {"name": prefix}
        if "fused" in ent:
            tname, shape, transposed = ent["fused"]
            total = shape[1] if transposed else shape[0]
            kv = num_kv_heads if num_kv_heads is not None else num_heads
            d = head_dim if head_dim is not None else total // (num_heads + 2 * kv)
            if (num_heads + 2 * kv) * d != total:
                raise ValueError(f"{tname}: {total} fused output rows do not split into {num_heads} + 2 x {kv} heads of "
                                 f"{d}")
            at = 0
            for p, rows in (("q", num_heads * d), ("k", kv * d), ("v", kv * d)):
                rec[p] = {"tensor": tname, "start": at, "stop": at + rows, "transposed": transposed}
                at += rows
        else:
            qrows = ent["q"][1][0]
            d = head_dim if head_dim is not None else qrows // num_heads
            if d < 1 or num_heads * d != qrows:
                raise ValueError(f"{ent['q'][0]}: {qrows} rows do not split into {num_heads} heads"
                                 + (f" of {head_dim}" if head_dim else ""))
            kv = num_kv_heads if num_kv_heads is not None else ent["k"][1][0] // d
            for p in "qkv":
                rows = ent[p][1][0]
                rec[p] = {"tensor": ent[p][0], "start": 0, "stop": rows, "transposed": False}
            if ent["k"][1][0] != kv * d:
                raise ValueError(f"{ent['k'][0]}: {ent['k'][1][0]} rows do not split into {kv} heads of {d}")
        rec.update(num_heads=num_heads, num_kv_heads=kv, head_dim=d)
        found.append(rec)
    return found


def projection_blocks(fh, loc: dict, p: str, cache: dict) -> torch.Tensor:
    """Per-head blocks ``[heads, head_dim, in]`` (float32, nn.Linear layout) of projection ``p`` of layer
    ``loc`` from an open checkpoint; ``cache`` keeps the last tensor read (fused layers read it once)."""
    ent = loc[p]
    name = ent["tensor"]
    if cache.get("name") != name:
        cache["name"], cache["tensor"] = name, fh.get_tensor(name)
    w = cache["tensor"]
    w = w[:, ent["start"]:ent["stop"]].t() if ent["transposed"] else w[ent["start"]:ent["stop"]]
    heads = loc["num_heads"] if p == "q" else loc["num_kv_heads"]
    d = loc["head_dim"]
    if w.shape[0] != heads * d:
        raise ValueError(f"{name}: {p} has {w.shape[0]} rows, expected {heads} heads x {d}")
    return w.float().reshape(heads, d, w.shape[1])
