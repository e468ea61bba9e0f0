"""The safetensors file format as condinit writes and reads it: header encoding and checked
reading, canonical JSON, the dtype table and the Hugging Face file names.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of UTF-8 JSON (one
entry ``{"dtype", "shape", "data_offsets"}`` per tensor, offsets relative to the data, plus an
optional ``"__metadata__"`` map of strings to strings), then the tensor data. condinit writes the
header with sorted keys in compact JSON (:func:`canonical_json`), padded with spaces to a multiple
of 8 bytes, so the same tensors and metadata give the same bytes.
"""
from __future__ import annotations

import json
import os
import re
import struct
from typing import NamedTuple, Optional

import torch

__all__ = ["WEIGHTS_NAME", "WEIGHTS_INDEX_NAME", "CONFIG_NAME", "SHARD_NAME_RE", "shard_name", "PICKLE_SUFFIXES",
           "MAX_HEADER_BYTES", "Dtype", "DTYPES", "DTYPE_NAMES", "DTYPE_BYTES", "EncodedHeader", "header_metadata",
           "encode_header", "read_header", "canonicalize_header", "canonical_json", "json_text", "show_value", "is_int"]

# Hugging Face model directories: one weights file, or shards listed by an index
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
SHARD_NAME_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

# File suffixes of pickle-based checkpoints (torch.save and friends), which condinit never reads
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".tar")

# safetensors refuses headers above 100 MB; bounding the length first keeps a hostile length field
# from making us read (and parse) an arbitrary amount of the file.
MAX_HEADER_BYTES = 100_000_000


def shard_name(k: int, n: int) -> str:
    """The file name of shard ``k`` (1-based) of ``n``: ``model-00001-of-00003.safetensors``."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


class Dtype(NamedTuple):
    """A safetensors dtype: its name in headers, bytes per element, and the torch dtype written
    under that name (None: read, never written)."""

    name: str
    itemsize: int
    torch: Optional[torch.dtype]


DTYPES = (
    Dtype("F64", 8, torch.float64), Dtype("F32", 4, torch.float32), Dtype("F16", 2, torch.float16),
    Dtype("BF16", 2, torch.bfloat16), Dtype("I64", 8, torch.int64), Dtype("I32", 4, torch.int32),
    Dtype("I16", 2, torch.int16), Dtype("I8", 1, torch.int8), Dtype("U8", 1, torch.uint8),
    Dtype("BOOL", 1, torch.bool), Dtype("F8_E4M3", 1, torch.float8_e4m3fn), Dtype("F8_E5M2", 1, torch.float8_e5m2),
    Dtype("F8_E8M0", 1, None), Dtype("U16", 2, None), Dtype("U32", 4, None), Dtype("U64", 8, None),
)
# torch dtype -> safetensors name, for the dtypes condinit writes
DTYPE_NAMES = {d.torch: d.name for d in DTYPES if d.torch is not None}
# safetensors name -> bytes per element; a dtype not listed here is left to safetensors to judge
DTYPE_BYTES = {d.name: d.itemsize for d in DTYPES}


def canonical_json(value) -> str:
    """Sorted keys, compact separators, UTF-8 kept as is: one byte string per value."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def json_text(value) -> str:
    """JSON text as ``save_pretrained`` writes its index: indented by 2, sorted keys, a final newline."""
    return json.dumps(value, indent=2, sort_keys=True) + "\n"


def show_value(value, limit: int = 60) -> str:
    """A short one-line repr of a value read from a file, for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def is_int(v) -> bool:
    """An ``int`` that is not a ``bool`` (JSON integers as Python parses them)."""
    return isinstance(v, int) and not isinstance(v, bool)


# ------------------------------------------------------------------------------------------------
# writing

class EncodedHeader(NamedTuple):
    """A safetensors file planned from meta tensors: ``head`` (the length prefix and the header, the
    file's first bytes), ``order`` (the tensor names in data order) and ``size`` (the file's bytes)."""

    head: bytes
    order: list
    size: int


def header_metadata(metadata: Optional[dict]) -> dict:
    """The ``__metadata__`` map of a header holding ``metadata``: keys as strings, every value that is
    not a string as its :func:`canonical_json` (the one place where metadata is serialized)."""
    return {str(k): (v if isinstance(v, str) else canonical_json(v)) for k, v in (metadata or {}).items()}


def encode_header(keys: list, state: dict, metadata: dict) -> EncodedHeader:
    """The header of a safetensors file of the tensors ``keys`` (shapes and dtypes from the tensors,
    typically meta, in ``state``) with ``metadata`` as its ``__metadata__`` (values that are not
    strings stored as JSON: :func:`header_metadata`). The data order is the
    largest element size first (keeping each tensor aligned), then the order of ``keys``. The header
    has sorted keys in compact JSON, padded with spaces to 8 bytes as safetensors does.

    Raises:
        TypeError: a tensor whose dtype safetensors cannot store (not in :data:`DTYPE_NAMES`).
    """
    order = sorted(keys, key=lambda k: -state[k].element_size())
    header, at = {}, 0
    for k in order:
        t = state[k]
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"{k}: dtype {t.dtype} cannot be stored in safetensors by write_pretrained")
        n = t.numel() * t.element_size()
        header[k] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    header["__metadata__"] = header_metadata(metadata)
    raw = canonical_json(header).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    if len(raw) % 256 == 0x80 and 2 <= (len(raw) >> 8) % 256 <= 5:
        # the length's first two bytes would read as a pickle's PROTO opcode to readers that sniff
        # for one (read_header among them): eight more spaces of padding keep the file unambiguous
        raw += b" " * 8
    head = len(raw).to_bytes(8, "little") + raw
    return EncodedHeader(head, order, len(head) + at)


def canonicalize_header(path: str) -> None:
    """Rewrite a safetensors header in place with sorted keys: safetensors writes its ``__metadata__``
    map in an order that changes from run to run. Re-encoding the same JSON with another key order
    does not change its length, so the tensor data stays where it is."""
    with open(path, "rb+") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n).decode("utf-8"))
        text = canonical_json(header).encode("utf-8")
        if len(text) > n:
            raise RuntimeError(f"{path}: the sorted safetensors header is {len(text)} bytes, longer than the "
                               f"{n} bytes written")
        fh.seek(8)
        fh.write(text.ljust(n, b" "))  # safetensors pads its header with spaces


# ------------------------------------------------------------------------------------------------
# reading

def read_header(path: str) -> dict:
    """The parsed safetensors header of ``path``, checked: a ValueError naming the file and the problem
    for anything that is not a complete safetensors file (a zip or pickle checkpoint, a truncated
    file, a header that is not JSON, entries without dtype / shape / data_offsets or whose offsets
    do not match their dtype and shape). Never unpickles."""
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
        raise ValueError(f"{bad} '__metadata__' must map names to strings, got {show_value(meta)}")
    end = 0
    for name, ent in hdr.items():
        if name == "__metadata__":
            continue
        if not isinstance(ent, dict):
            raise ValueError(f"{bad} {name!r} must be an object with dtype, shape and data_offsets, got "
                             f"{show_value(ent)}")
        dtype, shape, offsets = ent.get("dtype"), ent.get("shape"), ent.get("data_offsets")
        if not isinstance(dtype, str):
            raise ValueError(f"{bad} {name!r}: dtype must be a string, got {show_value(dtype)}")
        if not (isinstance(shape, list) and all(is_int(s) and s >= 0 for s in shape)):
            raise ValueError(f"{bad} {name!r}: shape must be a list of integers >= 0, got {show_value(shape)}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"{bad} {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end, got "
                             f"{show_value(offsets)}")
        if dtype in DTYPE_BYTES:
            nbytes = DTYPE_BYTES[dtype]
            for s in shape:
                nbytes *= s
            if offsets[1] - offsets[0] != nbytes:
                raise ValueError(f"{bad} {name!r}: {dtype} {shape} needs {nbytes} bytes, its data_offsets "
                                 f"{offsets} give {offsets[1] - offsets[0]}")
        end = max(end, offsets[1])
    if 8 + n + end > size:
        raise ValueError(f"{path} is truncated: its header describes {8 + n + end} bytes, the file has {size}")
    return hdr
