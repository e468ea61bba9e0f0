"""The ``condinit`` checkpoint metadata and the readers of safetensors checkpoints: the header
entry that ``condinit init`` writes, a safe writer of a model's state dict with it, and checked
reads of files and Hugging Face model directories.

Writes (:func:`save_model_atomic`) go through :func:`condinit.io.atomic.atomic_output` (atomic,
SIGTERM-safe, modes kept) and are reproducible: the safetensors header is written with sorted keys
in compact JSON, so the same tensors and metadata give byte-identical files from run to run.

Reads never unpickle: a file that is not safetensors (a ``torch.save`` zip, a pickle, a truncated
file) is rejected with a ValueError saying so, before any tensor is touched. The header is parsed
and checked (:func:`condinit.io.safetensors_format.read_header`: length, JSON, structure, offsets)
before safetensors sees the file, and the ``condinit`` entry is checked field by field, so a damaged
or hostile file gives a one-line ValueError naming the file and what is wrong, never a traceback.

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
``condinit.apply`` left unconditioned, and why. A shard of a model directory holds the layers whose
Q, K and V all lie in it, and ``"shard": [k, n]`` (:func:`shard_metadata`). Where real models keep
their attention weights: docs/design.md, "Model layouts".
"""
from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Optional, Sequence

from torch import nn

from ..io.atomic import atomic_output
from ..io.safetensors_format import (WEIGHTS_INDEX_NAME, WEIGHTS_NAME, canonical_json, canonicalize_header,
                                     header_metadata, is_int, read_header, show_value)

if TYPE_CHECKING:
    from .apply import AttentionLayer
    from .report import ApplyReport

__all__ = ["save_model_atomic", "condinit_metadata", "shard_metadata", "open_checkpoint", "read_metadata",
           "check_metadata", "check_metadata_tensors", "entry_stop", "entry_rows", "Checkpoint", "ShardedCheckpoint",
           "parse_metadata_entry", "METADATA_KEY", "METADATA_FORMAT"]

METADATA_KEY = "condinit"
METADATA_FORMAT = 1


# ------------------------------------------------------------------------------------------------
# writing

def save_model_atomic(model: nn.Module, path, metadata: Optional[dict] = None) -> str:
    """Write ``model``'s state dict to ``path`` as safetensors, atomically
    (:func:`condinit.io.atomic.atomic_output`); shared (tied) tensors once. ``metadata`` values that
    are not strings are stored as JSON (:func:`condinit.io.safetensors_format.header_metadata`). The
    header has sorted keys: the same tensors and metadata give a byte-identical file. Returns the
    absolute path (as given: a symlink is written through, not replaced).

    Examples:
        >>> model = torch.nn.Linear(4, 4)
        >>> save_model_atomic(model, "linear.safetensors", {"note": "example"})
        '/.../linear.safetensors'
    """
    from safetensors.torch import save_model

    with atomic_output(path) as tmp:
        save_model(model, tmp, metadata=header_metadata(metadata))
        canonicalize_header(tmp)
    return os.path.abspath(os.fspath(path))


def condinit_metadata(model: nn.Module, layers: Sequence[AttentionLayer], report: ApplyReport, family: str,
                      extra: Optional[dict] = None) -> dict:
    """The ``condinit`` header entry (see module doc) of ``model`` conditioned as ``report`` says, as a
    JSON object: one entry per layer of ``report`` that ``layers`` (the model's
    :class:`~condinit.models.AttentionLayer`\\ s, as :func:`condinit.models.find_attention` gives
    them) describes under its name, each Q/K/V named by ``model``'s parameter names; ``extra``
    fields added last. It is serialized where the header is written (:func:`save_model_atomic`,
    :func:`condinit.io.safetensors_format.encode_header`), with sorted keys.

    Examples:
        >>> report = condinit.apply(model, seed=0)
        >>> meta = condinit_metadata(model, find_attention(model), report, "llama", extra={"preset": "tiny-llama"})
        >>> save_model_atomic(model, "tiny.safetensors", {METADATA_KEY: meta})
    """
    names = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    entries = []
    by_name = {l.name: l for l in layers}
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
            heads = l.spec.num_heads if p == "q" else l.spec.num_kv_heads
            if p in ("q", "k", "v") and proj.rows != heads * l.spec.head_dim:   # latent attention's K / V rows
                ent[p]["head_dim"] = proj.rows // heads
        entries.append(ent)
    first = entries[0] if entries else {}
    meta = {"format": METADATA_FORMAT, "family": family, "seed": report.seed, "method": report.method,
            "v_mode": report.v_mode, "qk_gain": report.qk_gain, "v_gain": report.v_gain,
            "num_heads": first.get("num_heads"), "num_kv_heads": first.get("num_kv_heads"),
            "head_dim": first.get("head_dim"), "layers": entries,
            "uncovered": [{"name": u.name, "class": u.cls, "reason": u.reason}
                          for u in getattr(report, "uncovered", ())]}
    meta.update(extra or {})
    return meta


def shard_metadata(meta: dict, tensors: set, k: int, n: int) -> dict:
    """The ``condinit`` entry ``meta`` as shard ``k`` of ``n`` of a model directory holds it: only the
    layers whose Q, K and V all lie in the shard's ``tensors``, and ``"shard": [k, n]``."""
    inside = [ent for ent in meta["layers"] if all(ent[p]["tensor"] in tensors for p in ("q", "k", "v"))]
    return dict(meta, layers=inside, shard=[k, n])


# ------------------------------------------------------------------------------------------------
# reading

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
    read_header(path)
    try:
        handle = safe_open(path, framework="pt", device="cpu")
    except Exception as exc:  # whatever safetensors still objects to, after the checks above
        raise ValueError(f"{path} is not a readable safetensors file: {_one_line(exc)}") from None
    return Checkpoint(path, handle)


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
                    raise ValueError(f"{path}: {WEIGHTS_INDEX_NAME} puts tensor {missing[0]!r} in {fname}, which does "
                                     f"not hold it ({len(missing)} such tensor(s); an unfinished or mixed directory?)")
        except BaseException:
            self.close()
            raise

    def _shard(self, fname: str) -> Checkpoint:
        fh = self._handles.get(fname)
        if fh is None:
            fpath = os.path.join(self.path, fname)
            if not os.path.isfile(fpath):
                raise ValueError(f"{self.path}: {WEIGHTS_INDEX_NAME} names shard {fname}, which is missing (an "
                                 f"unfinished write? condinit init --resume finishes it)")
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
                ent = parse_metadata_entry(raw, os.path.join(self.path, fname))
                merged = merged or {k: v for k, v in ent.items() if k not in ("layers", "shard")}
                if isinstance(ent.get("layers"), list):
                    layers += ent["layers"]
            if merged is None:
                return {}
            meta = dict(merged, layers=layers)   # the shards' layers, in shard order (index order)
        return {METADATA_KEY: canonical_json(meta)}

    def _route(self, name):
        fname = self._map.get(name)
        if fname is None:
            raise ValueError(f"{self.path}: no tensor {name!r} in {WEIGHTS_INDEX_NAME}")
        return self._shard(fname)

    def get_slice(self, name):
        return self._route(name).get_slice(name)

    def get_tensor(self, name):
        return self._route(name).get_tensor(name)


def _open_directory(path: str):
    """:func:`open_checkpoint` of a directory: its index, or its one weights file."""
    index = os.path.join(path, WEIGHTS_INDEX_NAME)
    if not os.path.isfile(index):
        single = os.path.join(path, WEIGHTS_NAME)
        if os.path.isfile(single):
            return open_checkpoint(single)
        raise ValueError(f"{path} is a directory without {WEIGHTS_INDEX_NAME} or {WEIGHTS_NAME}; expected a "
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
            raise ValueError(f"{index}: shard {show_value(fname)} must be a .safetensors file name in the directory")
    meta = data.get("metadata")
    cond = meta.get(METADATA_KEY) if isinstance(meta, dict) else None
    if cond is not None and not isinstance(cond, dict):
        raise ValueError(f"{index}: metadata.{METADATA_KEY} must be an object, got {show_value(cond)}")
    return ShardedCheckpoint(path, wmap, cond)


# ------------------------------------------------------------------------------------------------
# the condinit entry

_LAYER_INTS = ("num_heads", "num_kv_heads", "head_dim")


def check_metadata(meta, where: str) -> dict:
    """``meta`` (the parsed ``condinit`` entry) if every field it has has the type the readers expect;
    otherwise a ValueError naming ``where`` and the field."""
    def fail(field, expected, got):
        raise ValueError(f"{where}: condinit metadata field {field} must be {expected}, got {show_value(got)}")

    if not isinstance(meta, dict):
        fail("(the entry itself)", "a JSON object", meta)
    if "format" in meta and meta["format"] != METADATA_FORMAT:
        fail("format", f"{METADATA_FORMAT} (the only format this version reads)", meta["format"])
    for key in ("family", "method", "v_mode", "preset", "dtype"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            fail(key, "a string", meta[key])
    if meta.get("seed") is not None and not (is_int(meta["seed"]) and meta["seed"] >= 0):
        fail("seed", "an integer >= 0", meta["seed"])
    for key in ("qk_gain", "v_gain"):   # absent in files written before the gains existed: 1, the paper's
        g = meta.get(key)
        if g is not None and not (isinstance(g, (int, float)) and not isinstance(g, bool) and 0 < g < float("inf")):
            fail(key, "a finite number > 0", g)
    for key in _LAYER_INTS:
        if meta.get(key) is not None and not (is_int(meta[key]) and meta[key] >= 1):
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
        if "index" in ent and not (is_int(ent["index"]) and ent["index"] >= 0):
            fail(f"{at}.index", "an integer >= 0", ent["index"])
        for key in _LAYER_INTS:
            if not (is_int(ent.get(key)) and ent[key] >= 1):
                fail(f"{at}.{key}", "an integer >= 1", ent.get(key))
        for p in ("q", "k", "v"):
            proj = ent.get(p)
            if not isinstance(proj, dict):
                fail(f"{at}.{p}", "an object {tensor, start, stop, transposed}", proj)
            if not isinstance(proj.get("tensor"), str):
                fail(f"{at}.{p}.tensor", "a tensor name (string)", proj.get("tensor"))
            for key in ("start", "stop"):
                if not (is_int(proj.get(key)) and proj[key] >= 0):
                    fail(f"{at}.{p}.{key}", "an integer >= 0", proj.get(key))
            if proj["start"] >= proj["stop"]:
                fail(f"{at}.{p}.start", f"below stop ({proj['stop']})", proj["start"])
            if not isinstance(proj.get("transposed"), bool):
                fail(f"{at}.{p}.transposed", "true or false", proj.get("transposed"))
            if "groups" in proj and not (is_int(proj["groups"]) and proj["groups"] >= 1):
                fail(f"{at}.{p}.groups", "an integer >= 1", proj["groups"])
            if "stride" in proj and not (is_int(proj["stride"]) and proj["stride"] >= proj["stop"] - proj["start"]):
                fail(f"{at}.{p}.stride", f"an integer >= stop - start ({proj['stop'] - proj['start']})", proj["stride"])
            if proj.get("groups", 1) > 1 and "stride" not in proj:
                fail(f"{at}.{p}.stride", "present with groups > 1", None)
            if "head_dim" in proj and not (is_int(proj["head_dim"]) and proj["head_dim"] >= 1):
                fail(f"{at}.{p}.head_dim", "an integer >= 1", proj["head_dim"])
            shape = proj.get("matrix_shape")
            if shape is not None and not (isinstance(shape, list) and len(shape) == 2
                                          and all(is_int(n) and n >= 1 for n in shape)):
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


def parse_metadata_entry(raw: str, where: str) -> dict:
    """The ``condinit`` header entry ``raw`` (JSON text) of the file ``where`` as a dict; a ValueError
    naming ``where`` when it is not a JSON object (or is nested too deeply to parse)."""
    try:
        val = json.loads(raw)
    except RecursionError:
        raise ValueError(f"{where}: the '{METADATA_KEY}' metadata entry is JSON nested too deeply to parse") from None
    except ValueError:
        raise ValueError(f"{where}: the '{METADATA_KEY}' metadata entry is not valid JSON") from None
    if not isinstance(val, dict):
        raise ValueError(f"{where}: the '{METADATA_KEY}' metadata entry is not a JSON object")
    return val


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
    val = parse_metadata_entry(raw, where)
    check_metadata(val, where)
    names = {n for ent in val.get("layers") or () for n in (ent[p]["tensor"] for p in ("q", "k", "v"))}
    keys = set(fh.keys())
    shapes = {n: tuple(fh.get_slice(n).get_shape()) for n in names if n in keys}
    check_metadata_tensors(val, shapes, where)
    return val


def check_metadata_tensors(meta: dict, shapes: dict, where: str) -> None:
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
            end = entry_stop(proj)
            if end > rows:
                raise ValueError(f"{where}: condinit metadata gives rows {proj['start']}:{end} of "
                                 f"tensor {t!r} for {ent['name']}.{p}, which has {rows}")


def entry_stop(proj: dict) -> int:
    """One past the last row of a projection entry (``groups`` runs ``stride`` apart)."""
    return proj["stop"] + (proj.get("groups", 1) - 1) * proj.get("stride", 0)


def entry_rows(proj: dict) -> list:
    """Storage row ranges of a projection entry, in logical order."""
    n, step = proj.get("groups", 1), proj.get("stride", 0)
    return [(proj["start"] + g * step, proj["stop"] + g * step) for g in range(n)]
