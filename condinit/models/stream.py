"""Streamed checkpoint writing: a conditioned Hugging Face model directory in bounded memory.

:func:`write_pretrained` writes what ``model.save_pretrained(dir)`` would write for the model that
``condinit.apply(model, seed=seed)`` gives, without ever holding the model: ``config.json`` (and
``generation_config.json`` for generative models), the weights as ``model-0000k-of-0000n.safetensors``
shards planned as ``save_pretrained`` plans them (state-dict order, tied weights once under the
name it keeps, a new shard when the next tensor would pass ``max_shard_size``, a bigger tensor alone
in its own shard) and ``model.safetensors.index.json``; a model that fits in one shard is the one
file ``model.safetensors``, without an index, as ``save_pretrained`` does.
``transformers.AutoModelForCausalLM.from_pretrained(dir)`` loads it with no missing or unexpected key.

**How.** The model is built on the meta device (nothing allocated). Each shard file's header is
known from the meta tensors alone, so the file is written tensor by tensor: a tensor is computed
when the file reaches it, written, and dropped. Tensors are computed in *units*:

* an attention layer that condinit conditions (every tensor of the modules holding its Q/K/V
  weights and biases): those modules' own init, then the layer's plan executed by the engine
  behind :func:`condinit.apply` (``InitPlan`` / ``run_plan``), with the layer index
  :func:`condinit.models.discover` gives it in the whole model. Blocks are pure functions of
  ``(seed, stream, block id)``: the Q/K/V weights are bit for bit those of
  ``condinit.apply(model, seed=seed)`` on the whole model (``docs/design.md``, "Random streams");
* any other module: its direct parameters and persistent buffers, filled by the model's own init
  rule, ``_init_weights`` of the nearest ``PreTrainedModel`` above it (what ``initialize_weights``
  dispatches), called on the module and then on each of its ancestors, in the order
  ``initialize_weights`` visits them (children before parents, so a parent's rescaling of a child
  wins); the rest of the model stays on meta, where init functions do nothing.

Torch's generator, which the own init draws from, is seeded per unit from ``seed`` and the
module's qualified name (and restored afterwards): a tensor's values depend on ``seed`` and its
name only, not on the shard size, the order of writing or other tensors. The files are
byte-identical from run to run. The own-init weights follow the same rule as ``apply`` on a
materialized model, with other random draws.

**Memory**: one unit plus the tensors of the current shard computed ahead of their turn (with one
storage dtype: none), whatever the model's size or ``max_shard_size``; the largest unit is usually
the embedding matrix.

**Files**: each file is written atomically (:func:`condinit.models.checkpoint.atomic_output`). A
previous ``model.safetensors.index.json`` / ``model.safetensors`` in the directory is removed
before the first shard is written and the index is written last, so an interrupted write never
leaves a directory that loads; shards of an earlier write that this one does not replace
(``model-*-of-*.safetensors``) are removed at the end, as ``save_pretrained`` does. Each shard's
header has ``"format": "pt"`` and the ``condinit`` entry of :func:`condinit.models.checkpoint
.condinit_metadata` restricted to the layers whose Q, K and V all lie in that shard (so
``condinit inspect`` can read every shard alone), plus ``"shard": [k, n]``; the index's
``metadata`` has ``total_size`` and ``total_parameters`` as ``save_pretrained`` writes them, and the
whole ``condinit`` entry (every layer) under ``"condinit"``.

Only Hugging Face ``PreTrainedModel`` classes: their init rule is what is reproduced here.
Models whose in-memory state-dict names differ from their checkpoint format (transformers'
weight-conversion mappings, e.g. some mixture-of-experts models) are written under their in-memory
names.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
from torch import nn

from condinit._validate import check_bool, check_choice, check_int, check_seed
from condinit.init.functional import V_MODES, run_plan
from condinit.init.orthogonalize import METHODS

from .adapters import describe
from .apply import (ApplyReport, AttentionLayer, LayerReport, UncoveredAttentionWarning, _covered,
                    _discover_for_writing, _listing, _patterns, _plan)
from .checkpoint import METADATA_KEY, _canonical_json, atomic_output, check_output_path, condinit_metadata

__all__ = ["write_pretrained", "plan_shards", "parse_shard_size", "PretrainedWriteReport", "WEIGHTS_NAME",
           "WEIGHTS_INDEX_NAME"]

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

# safetensors dtype names
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}

_SIZE_UNITS = {"TB": 10 ** 12, "GB": 10 ** 9, "MB": 10 ** 6, "KB": 10 ** 3,
               "TIB": 2 ** 40, "GIB": 2 ** 30, "MIB": 2 ** 20, "KIB": 2 ** 10}


@dataclass
class PretrainedWriteReport:
    """What :func:`write_pretrained` wrote: the directory, its files (weights files in order), the
    tensor bytes (``total_size`` as in the index), the parameter count, and the conditioning as an
    :class:`condinit.ApplyReport` (``apply``: layers, seed, uncovered modules; no singular values)."""

    out_dir: str
    files: list
    weight_map: dict
    total_size: int
    num_parameters: int
    apply: ApplyReport
    time_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def seed(self) -> int:
        return self.apply.seed

    @property
    def uncovered(self) -> list:
        return self.apply.uncovered


# ------------------------------------------------------------------------------------------------
# argument checks

def parse_shard_size(value) -> int:
    """Bytes for ``max_shard_size``: an int >= 1, or a string such as ``"5GB"`` / ``"500MB"``
    (powers of 10, as ``save_pretrained`` counts) or ``"2GiB"`` (powers of 2).

    Examples:
        >>> parse_shard_size("500MB")
        500000000
        >>> parse_shard_size(1 << 20)
        1048576
    """
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]I?B)\s*", value.upper())
        if m is None:
            raise ValueError(f"max_shard_size must be an int (bytes) or a size such as '5GB', '500MB', '2GiB', "
                             f"got {value!r}")
        size = int(float(m[1]) * _SIZE_UNITS[m[2]])
        if size < 1:
            raise ValueError(f"max_shard_size must be at least 1 byte, got {value!r}")
        return size
    return check_int("max_shard_size", value, min=1)


def _check_out_dir(out_dir) -> str:
    """The absolute output directory: an existing directory, or a new one in an existing directory."""
    path = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"out_dir {path} exists and is not a directory")
        return path
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ValueError(f"out_dir {path}: its parent directory {parent} does not exist")
    return path


def _is_pretrained(obj) -> bool:
    from transformers import PreTrainedModel

    return isinstance(obj, PreTrainedModel)


def _build_meta_model(config, model_class):
    """A meta-device model for a transformers config: ``model_class``, or the config's
    ``architectures[0]``, or the Auto class :func:`condinit.models.presets.model_class_for` picks."""
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM

    from .presets import model_class_for

    cls = model_class
    if cls is None:
        archs = getattr(config, "architectures", None) or []
        cls = getattr(transformers, archs[0], None) if archs else None
        if cls is None or not hasattr(cls, "_from_config"):
            cls = AutoModelForCausalLM if model_class_for(config.model_type, config) == "AutoModelForCausalLM" \
                else AutoModel
    with torch.device("meta"):
        if hasattr(cls, "from_config") and not hasattr(cls, "_from_config"):   # an Auto class
            return cls.from_config(config)
        return cls._from_config(config)


# ------------------------------------------------------------------------------------------------
# shard planning (what save_pretrained writes)

def _tied_patterns(model: nn.Module) -> list:
    pats = []
    for name, sub in model.named_modules():
        tied = getattr(sub, "_tied_weights_keys", None) or ()
        pats.extend(f"{name}.{k}" if name else k for k in tied)
    return pats


def _saved_state(model: nn.Module) -> dict:
    """``{key: meta tensor}`` in state-dict order, each shared tensor once, under the name that
    ``save_pretrained`` keeps (it drops the names that match a ``_tied_weights_keys`` pattern)."""
    objects = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mname}." if mname else ""
        for attr, t in mod._parameters.items():
            if t is not None:
                objects[prefix + attr] = t
        for attr, t in mod._buffers.items():
            if t is not None and attr not in mod._non_persistent_buffers_set:
                objects[prefix + attr] = t
    keys = list(model.state_dict(keep_vars=True).keys())
    groups: dict[int, list] = {}
    for k in keys:
        groups.setdefault(id(objects[k]), []).append(k)
    pats = _tied_patterns(model)
    drop = set()
    for names in groups.values():
        if len(names) < 2:
            continue
        found = 0
        for n in sorted(names):
            if any(re.search(p, n) for p in pats):
                found += 1
                if found < len(names):
                    drop.add(n)
        if len([n for n in names if n not in drop]) > 1:
            raise ValueError(f"tensors {sorted(names)} are one shared tensor, and the model's _tied_weights_keys "
                             f"({pats}) do not say which name a checkpoint keeps")
    return {k: objects[k] for k in keys if k not in drop}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_shards(model: nn.Module, max_shard_size: Union[int, str] = "5GB") -> dict:
    """The weights files ``save_pretrained`` would write for ``model`` (any device, meta included):
    ``{file name: [state-dict keys]}`` in order. Tied tensors appear once.

    Examples:
        >>> with torch.device("meta"):
        ...     model = transformers.AutoModelForCausalLM.from_config(config)
        >>> list(plan_shards(model, "500MB"))
        ['model-00001-of-00003.safetensors', 'model-00002-of-00003.safetensors', ...]
    """
    limit = parse_shard_size(max_shard_size)
    return _plan_files(_saved_state(model), limit)


def _plan_files(state: dict, limit: int) -> dict:
    shards, current, size = [], [], 0
    for k, t in state.items():
        n = _nbytes(t)
        if n > limit:
            shards.append([k])
            continue
        if size + n > limit:
            shards.append(current)
            current, size = [], 0
        current.append(k)
        size += n
    if current:
        shards.append(current)
    if len(shards) == 1:
        return {WEIGHTS_NAME: shards[0]}
    return {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": s for i, s in enumerate(shards)}


# ------------------------------------------------------------------------------------------------
# materializing units

def _unit_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"condinit own init\0{seed}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1   # torch.manual_seed takes [0, 2**63)


@contextlib.contextmanager
def _swapped(mod: nn.Module, tensors: dict):
    """Put ``{attr: tensor}`` into ``mod``'s parameters / buffers for the duration, then the old ones back."""
    old = {}
    try:
        for attr, t in tensors.items():
            table = mod._parameters if attr in mod._parameters else mod._buffers
            old[attr] = (table, table[attr])
            table[attr] = t
        yield
    finally:
        for attr, (table, t) in old.items():
            table[attr] = t


def _left_uninitialized(t: torch.Tensor) -> bool:
    """A floating tensor still holding a NaN of the fill (its sum is NaN: one pass, no mask the
    size of the tensor), or an integer one still all sentinel."""
    if t.is_floating_point():
        return bool(torch.isnan(t.sum()))
    return t.numel() > 0 and bool(t.eq(torch.iinfo(t.dtype).min).all())


class _Materializer:
    """Computes the tensors of a meta ``PreTrainedModel`` unit by unit (see module doc)."""

    def __init__(self, model, seed: int, method: str, v_mode: str, layers: Sequence[AttentionLayer],
                 memory_budget: Optional[int], state: dict):
        from transformers import PreTrainedModel

        self.model, self.seed, self.method, self.v_mode = model, seed, method, v_mode
        self.memory_budget = memory_budget
        self.modules = dict(model.named_modules())
        self.state = state
        # key -> (module name, attribute)
        self.owner = {}
        for mname, mod in self.modules.items():
            prefix = f"{mname}." if mname else ""
            for attr in list(mod._parameters) + list(mod._buffers):
                if prefix + attr in state and prefix + attr not in self.owner:
                    self.owner[prefix + attr] = (mname, attr)
        # each module's init function: _init_weights of the deepest PreTrainedModel at or above it
        self.init_of = {}
        for mname, mod in self.modules.items():
            parts = mname.split(".") if mname else []
            fn = None
            for i in range(len(parts) + 1):
                anc = self.modules[".".join(parts[:i])]
                if isinstance(anc, PreTrainedModel):
                    fn = anc._init_weights
            self.init_of[mname] = fn
        self.tensor_key = {id(t): k for k, t in state.items()}
        self.covered = {id(t) for t in _covered(layers)}
        self.layers = list(layers)
        self.layer_of_module = {}
        for pos, l in enumerate(self.layers):
            for _, proj in l.spec.projections():
                for t in (proj.weight, proj.bias):
                    if t is None:
                        continue
                    key = self.tensor_key.get(id(t))
                    if key is None:
                        raise ValueError(f"{l.name}: a Q/K/V tensor of this layer is not in the model's state dict")
                    self.layer_of_module[self.owner[key][0]] = pos
        self.unit_modules = {}
        for key, (mname, _) in self.owner.items():
            self.unit_modules.setdefault(("layer", self.layer_of_module[mname]) if mname in self.layer_of_module
                                         else ("module", mname), []).append(mname)
        self.unit_of = {key: (("layer", self.layer_of_module[m]) if m in self.layer_of_module else ("module", m))
                        for key, (m, _) in self.owner.items()}
        try:
            from transformers.initialization import guard_torch_init_functions
        except ImportError:   # transformers 4: torch.nn.init is not patched, nothing to guard
            guard_torch_init_functions = contextlib.nullcontext
        self.guard = guard_torch_init_functions

    def _own(self, mname: str) -> dict:
        """``{attr: real tensor}``: ``mname``'s direct state-dict tensors after the model's own init."""
        mod = self.modules[mname]
        prefix = f"{mname}." if mname else ""
        fresh, checked = {}, []
        for attr, t in list(mod._parameters.items()) + list(mod._buffers.items()):
            key = prefix + attr
            if t is None or self.owner.get(key) != (mname, attr):
                continue
            real = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            if isinstance(t, nn.Parameter):
                real = nn.Parameter(real, requires_grad=t.requires_grad)
            if id(t) in self.covered:
                real.detach().zero_()              # overwritten entirely by the conditioning
                real._is_hf_initialized = True     # the own init passes over it, as in apply
            elif real.is_floating_point():
                real.detach().fill_(float("nan"))           # anything the own init leaves is caught below
                checked.append(key)
            elif real.dtype == torch.bool:
                real.detach().zero_()
            else:
                real.detach().fill_(torch.iinfo(real.dtype).min)
                checked.append(key)
            fresh[attr] = real
        parts = mname.split(".") if mname else []
        chain = [".".join(parts[:i]) for i in range(len(parts), -1, -1)]   # the module, then its ancestors
        with _swapped(mod, fresh), torch.random.fork_rng(devices=[]), torch.no_grad(), self.guard():
            torch.manual_seed(_unit_seed(self.seed, mname))
            for name in chain:
                fn = self.init_of[name]
                if fn is not None:
                    fn(self.modules[name])
        for attr, real in fresh.items():
            real.__dict__.pop("_is_hf_initialized", None)
            key = prefix + attr
            if key in checked and _left_uninitialized(real.detach()):
                raise ValueError(f"{key}: the model's own init (_init_weights) leaves this tensor uninitialized; "
                                 f"write_pretrained cannot compute it")
        return fresh

    def unit(self, unit) -> dict:
        """``{key: tensor}`` for every state-dict tensor of ``unit``."""
        kind, ref = unit
        mnames = self.unit_modules[unit]
        own = {m: self._own(m) for m in mnames}
        if kind == "layer":
            l = self.layers[ref]
            with contextlib.ExitStack() as stack:
                for m in mnames:
                    stack.enter_context(_swapped(self.modules[m], own[m]))
                hit = describe(l.module)
                if hit is None:
                    raise ValueError(f"{l.name}: the layer is no longer recognised once materialized")
                live = AttentionLayer(l.index, l.name, l.module, hit.adapter, hit.spec, l.cross)
                with torch.no_grad():
                    plan, _ = _plan([live], self.v_mode, measure_before=False)
                    run_plan(plan, self.seed, self.method, memory_budget=self.memory_budget)
        out = {}
        for m in mnames:
            prefix = f"{m}." if m else ""
            for attr, t in own[m].items():
                out[prefix + attr] = t.detach()
        return out


# ------------------------------------------------------------------------------------------------
# writing

def _write_safetensors(path: str, keys: list, state: dict, metadata: dict, compute, bar=None) -> None:
    """Write a safetensors file of ``keys`` (headers from the meta tensors in ``state``), computing
    each tensor with ``compute(key)`` when the file reaches it. Data is ordered by element size
    (largest first, keeping each tensor aligned) then state-dict order; the header has sorted keys
    in compact JSON, padded with spaces to 8 bytes as safetensors does."""
    order = sorted(keys, key=lambda k: -state[k].element_size())
    header, at = {}, 0
    for k in order:
        t = state[k]
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"{k}: dtype {t.dtype} cannot be stored in safetensors by write_pretrained")
        n = _nbytes(t)
        header[k] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    header["__metadata__"] = metadata
    raw = _canonical_json(header).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    if len(raw) % 256 == 0x80 and 2 <= (len(raw) >> 8) % 256 <= 5:
        # the length's first two bytes would read as a pickle's PROTO opcode to readers that sniff
        # for one (condinit's own among them): eight more spaces of padding keep the file unambiguous
        raw += b" " * 8
    with atomic_output(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(len(raw).to_bytes(8, "little"))
            fh.write(raw)
            for k in order:
                t = compute(k)
                meta = state[k]
                if t.dtype != meta.dtype or tuple(t.shape) != tuple(meta.shape):
                    raise RuntimeError(f"{k}: computed {t.dtype} {tuple(t.shape)}, the header says {meta.dtype} "
                                       f"{tuple(meta.shape)}")
                if t.numel():
                    fh.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
                if bar is not None:
                    bar.update(_nbytes(t))
                del t


def _json_file(path: str, value) -> None:
    with atomic_output(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(value, indent=2, sort_keys=True) + "\n")


def write_pretrained(model_or_config, out_dir, *, seed: int = 0, method: str = "auto", v_mode: str = "identity",
                     dtype: Optional[torch.dtype] = None, max_shard_size: Union[int, str] = "5GB",
                     model_class=None, include=None, exclude=None, strict: bool = False,
                     memory_budget: Optional[int] = None, family: Optional[str] = None,
                     extra_metadata: Optional[dict] = None, progress: bool = False) -> PretrainedWriteReport:
    """Write a ``from_pretrained``-ready model directory of the conditioned model, streamed (see module doc).

    Args:
        model_or_config: a ``transformers.PretrainedConfig`` (the model is built from it on meta:
            ``model_class``, else the config's ``architectures[0]``, else ``AutoModelForCausalLM`` for
            decoder language models and ``AutoModel`` otherwise), or a ``PreTrainedModel`` whose
            tensors are all on the meta device (left as it is, apart from ``dtype``).
        out_dir: the directory; created (in an existing directory) when missing.
        seed: ``0 <= seed < 2**64``, for the conditioned Q/K (as ``condinit.apply(model, seed=seed)``)
            and the own init of everything else. Not drawn: the same call writes the same bytes.
        method, v_mode, include, exclude, strict, memory_budget: as in :func:`condinit.apply`.
        dtype: storage dtype (``torch.bfloat16``, ...); default: the model's, or the config's
            ``dtype``, or float32.
        max_shard_size: bytes per weights file, an int or ``"5GB"`` / ``"500MB"`` / ``"2GiB"`` (as
            ``save_pretrained``; a bigger tensor gets a file of its own).
        model_class: the transformers class to build a config with.
        family: the ``family`` field of the ``condinit`` metadata (default: the config's ``model_type``).
        extra_metadata: more fields for the ``condinit`` metadata (e.g. ``{"preset": ...}``).
        progress: a tqdm progress bar over the bytes written.

    Returns:
        :class:`PretrainedWriteReport`.

    Raises:
        ValueError / TypeError: a bad argument, a model that is not all on meta, no attention layer,
            ``strict`` with uncovered modules; all before anything is written.

    Examples:
        >>> config = transformers.LlamaConfig(num_hidden_layers=32, hidden_size=4096, ...)
        >>> rep = write_pretrained(config, "llama-8b-cond/", seed=0, dtype=torch.bfloat16, max_shard_size="5GB")
        >>> model = transformers.AutoModelForCausalLM.from_pretrained("llama-8b-cond/")
    """
    t_start = time.perf_counter()
    from transformers import PretrainedConfig

    seed = check_seed("seed", seed)
    check_choice("method", method, METHODS)
    check_choice("v_mode", v_mode, V_MODES)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    limit = parse_shard_size(max_shard_size)
    inc, exc = _patterns(include, "include"), _patterns(exclude, "exclude")
    strict = check_bool("strict", strict)
    memory_budget = check_int("memory_budget", memory_budget, min=1, allow_none=True)
    progress = check_bool("progress", progress)
    if family is not None and not isinstance(family, str):
        raise TypeError(f"family must be a string or None, got {type(family).__name__}")
    if extra_metadata is not None and not isinstance(extra_metadata, dict):
        raise TypeError(f"extra_metadata must be a dict or None, got {type(extra_metadata).__name__}")
    out_dir = _check_out_dir(out_dir)

    if isinstance(model_or_config, PretrainedConfig):
        config = model_or_config
        model = _build_meta_model(config, model_class)
        if dtype is None:
            cfg_dtype = getattr(config, "dtype", None)
            if isinstance(cfg_dtype, str):
                cfg_dtype = getattr(torch, cfg_dtype, None)
            dtype = cfg_dtype if isinstance(cfg_dtype, torch.dtype) else torch.float32
    elif _is_pretrained(model_or_config):
        if model_class is not None:
            raise ValueError("model_class is only used with a config; a model was given")
        model = model_or_config
        tensors = list(model.parameters()) + [b for b in model.buffers() if b is not None]
        if not all(t.is_meta for t in tensors):
            raise ValueError("write_pretrained: the model must be entirely on the meta device (build it under "
                             "torch.device('meta')); to save a materialized model use model.save_pretrained")
    else:
        raise TypeError(f"model_or_config must be a transformers PretrainedConfig or a meta-device PreTrainedModel, "
                        f"got {type(model_or_config).__name__}")
    if dtype is not None:
        model = model.to(dtype)
    model.eval()

    found = _discover_for_writing(model, 0, inc, exc, include, exclude, strict)
    layers, uncovered = found.layers, found.uncovered
    state = _saved_state(model)
    for k, t in state.items():
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"{k}: dtype {t.dtype} cannot be stored in safetensors by write_pretrained")
    files = _plan_files(state, limit)
    weight_map = {k: f for f, ks in files.items() for k in ks}
    paths = {f: check_output_path(os.path.join(out_dir, f)) if os.path.isdir(out_dir) else None for f in files}
    engine = _Materializer(model, seed, method, v_mode, layers, memory_budget, state)
    if uncovered:
        warnings.warn(f"write_pretrained: {len(uncovered)} attention-like module(s) of {type(model).__name__} are "
                      f"not conditioned and keep the model's own init (report.uncovered lists them; strict=True "
                      f"makes this an error): {_listing(uncovered, 10)}", UncoveredAttentionWarning, stacklevel=2)

    reports = [LayerReport(l.index, l.name, l.adapter, l.spec.num_heads, l.spec.num_kv_heads, l.spec.head_dim,
                           {p: tuple(proj.shape) for p, proj in l.spec.projections()}, layout=l.spec.layout,
                           cross=l.cross) for l in layers]
    report = ApplyReport(reports, seed, method, v_mode, 0, True, False, 0.0, 0.0, list(uncovered))
    fam = family if family is not None else getattr(model.config, "model_type", None)
    full_meta = json.loads(condinit_metadata(model, report, fam, extra=extra_metadata)[METADATA_KEY])
    num_parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    total_size = sum(_nbytes(t) for t in state.values())

    # writing starts here
    os.makedirs(out_dir, exist_ok=True)
    for f in files:
        if paths[f] is None:
            paths[f] = check_output_path(os.path.join(out_dir, f))
    for stale in (WEIGHTS_INDEX_NAME, WEIGHTS_NAME):   # never a loadable mix of old and new files
        path = os.path.join(out_dir, stale)
        if os.path.isfile(path) and not (stale == WEIGHTS_NAME and WEIGHTS_NAME in files):
            os.unlink(path)

    config = copy.deepcopy(model.config)
    config.dtype = str(next(iter(state.values())).dtype).split(".")[1] if state else None
    config.architectures = [type(model).__name__]
    with atomic_output(os.path.join(out_dir, "config.json")) as tmp:
        config.to_json_file(tmp, use_diff=True)
    gen = getattr(model, "generation_config", None)
    if gen is not None and callable(getattr(model, "can_generate", None)) and model.can_generate():
        with atomic_output(os.path.join(out_dir, "generation_config.json")) as tmp:
            gen.to_json_file(tmp, use_diff=True)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_size, unit="B", unit_scale=True, desc="condinit write", leave=False)
    ready: dict = {}       # computed tensors not yet written

    def compute(key):
        if key not in ready:
            for k, t in engine.unit(engine.unit_of[key]).items():
                if k in weight_map and k not in written:
                    ready[k] = t
        written.add(key)
        return ready.pop(key)

    written: set = set()
    try:
        n = len(files)
        for i, (fname, keys) in enumerate(files.items()):
            inside = set(keys)
            meta = dict(full_meta)
            meta["layers"] = [ent for ent in full_meta["layers"]
                              if all(ent[p]["tensor"] in inside for p in ("q", "k", "v"))]
            meta["shard"] = [i + 1, n]
            _write_safetensors(paths[fname], keys, state, {"format": "pt", METADATA_KEY: _canonical_json(meta)},
                               compute, bar)
    finally:
        if bar is not None:
            bar.close()
    if len(files) > 1:
        index = {"metadata": {"total_parameters": num_parameters, "total_size": total_size, "condinit": full_meta},
                 "weight_map": weight_map}
        _json_file(os.path.join(out_dir, WEIGHTS_INDEX_NAME), index)
    for name in os.listdir(out_dir):    # shards of an earlier write that this one did not replace
        if _SHARD_RE.match(name) and name not in files and os.path.isfile(os.path.join(out_dir, name)):
            os.unlink(os.path.join(out_dir, name))
    report.total_time_s = time.perf_counter() - t_start
    return PretrainedWriteReport(out_dir, [os.path.join(out_dir, f) for f in files], weight_map, total_size,
                                 num_parameters, report, report.total_time_s)
