"""Streamed checkpoint writing: a conditioned Hugging Face model directory in bounded memory.

:func:`write_pretrained` writes what ``model.save_pretrained(dir)`` would write for the model that
``condinit.apply(model, seed=seed)`` gives, without ever holding the model: ``config.json`` (and
``generation_config.json`` for generative models), the weights as ``model-0000k-of-0000n.safetensors``
shards planned as ``save_pretrained`` plans them (state-dict order, tied weights once under the
name it keeps, a new shard when the next tensor would pass ``max_shard_size``, a bigger tensor alone
in its own shard) and ``model.safetensors.index.json``; a model that fits in one shard is the one
file ``model.safetensors``, without an index, as ``save_pretrained`` does.
``transformers.AutoModelForCausalLM.from_pretrained(dir)`` loads it with no missing or unexpected key.
:func:`write_checkpoint` writes the same tensors as one ``.safetensors`` file (``condinit init --out
FILE.safetensors``).

**How.** The model is built on the meta device (nothing allocated). Each shard file's header is
known from the meta tensors alone, so the file is written tensor by tensor: a tensor is computed
(on ``device``) when the file reaches it, handed to a writer thread, and dropped once written, so
generation and disk writes overlap. Tensors are computed in *units*:

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
  wins, e.g. GPT-2's ``c_proj``); the rest of the model stays on meta, where init functions do
  nothing. So norms get ones / zeros, linears and embeddings ``normal(0, initializer_range)``,
  rotary buffers their frequencies, exactly as the model's code says.

**Constructor values.** ``from_config`` starts every tensor from what its module's constructor
wrote, and ``_init_weights`` overwrites what it covers; some tensors only a constructor sets (CLIP's
``logit_scale = nn.Parameter(torch.tensor(2.6592))``, a ``Conv1D``'s ``normal(0, 0.02)`` weight in
OpenAI-GPT, an activation's learned constants). So the meta model is built under a recorder
(:class:`_BuildRecorder`): tensors of at most ``_SMALL_NUMEL`` elements are computed on the CPU as
well (torch's CPU generator seeded from ``seed``: the same values for the same seed), bigger ones
get their creation (``zeros`` / ``ones`` / ``full``) and later fills and whole-tensor ``normal_``
recorded, the normals then drawn as own-init normals of the tensor's name. A unit's tensors start
from these values where the init leaves them; a tensor whose constructor did anything else (or a
model given already built on meta) has no known starting value, and what its init leaves is an
error as before.

**Pieces.** A module unit is first initialized on fresh *meta* tensors (nothing allocated), with
every write to them recorded (:class:`_WriteRecorder`, a ``TorchDispatchMode``). When every tensor's
writes are own-init normals of the whole tensor and fills (``ones_`` / ``zeros_`` / ``constant_`` /
``fill_`` of the whole tensor or of a contiguous part, e.g. an embedding's padding row), the unit
is not materialized: each tensor is drawn in pieces of at most ``_PIECE_BYTES`` (the last write of
the whole tensor, its constructor's writes first where the init writes it only in part, then the
fills after it, restricted to the piece; the own-init stream can start at any block), and each piece
goes to the writer while the next is drawn. These are the elements the
init computes. Any other write (a draw from torch's generator, arithmetic on the tensor, a copy, a
write through a non-contiguous view), a tensor the init does not write whole, or an init that fails
on meta tensors (one that reads values) makes the unit computed whole as described above.

**Own-init random draws.** Every ``normal_`` that the model's init makes on a state-dict tensor
(transformers' ``init.normal_``, which ``torch.nn.init.normal_`` is routed to while the init runs)
is drawn from condinit's counter-based generator (:func:`condinit.ops.random.op.block_randn`) in
the tensor's own stream: element ``e`` (row-major) of tensor ``name`` is lane ``e % 2**16`` of
block ``(h31(name) << 32) + e // 2**16`` of stream ``s(name)``, with ``s`` and ``h31`` the first
4 bytes and the next 31 bits of BLAKE2b(``"condinit own init\\0" + name``) (:func:`own_init_stream`),
then ``mean + std * z`` rounded once to the tensor's dtype (the ``normal`` table of
:mod:`condinit.ops.random.op`: on the CPU one pass of the C++ kernel, straight into the tensor's
dtype; elsewhere the float32 normals scaled in a buffer and copied, with the same bits). A view of
a tensor (e.g. one row) has a stream of its own named after the view. So these weights are bit-identical whatever the shard
size, the chunking, the order of writing or the device (the generator is; ``docs/design.md``,
"Random streams"). Any other random draw of an init (``uniform_``, ``trunc_normal_``, a tensor's own
``.normal_()`` method as transformers 4 models call it) comes from torch's generator, seeded per
unit from ``seed`` and the module's qualified name (and restored afterwards): still a function of
``seed`` and the name only, but device dependent.

**Memory**: one unit computed whole (usually an attention layer: its Q/K/V, and the
orthogonalization's scratch, in chunks of ``_CPU_LAYER_BUDGET`` on the CPU unless ``memory_budget``
says otherwise) plus the tensors of the current shard computed ahead of their turn (at most another
unit) plus the writer's queue (``_MAX_QUEUED_BYTES`` not yet written, besides a bigger tensor being
written) plus the piece being drawn, plus at most 128 MB of written tensors' buffers kept for reuse
(``_BufferPool``: no page faults on the next pieces and layers; every piece buffer has one size),
whatever the model's size or ``max_shard_size``. The embedding matrix, an MLP's weights, the
output head are drawn in pieces.
Written data goes to the page cache (not the process's resident memory); the writer starts its
writeback to disk as it goes and drops what is on disk from the cache (``_Writeback``), so the disk
works while tensors are computed and the cache holds only ~128 MB of the file being written (a big
tensor is written in 64 MB pieces for that).

**Files**: each file is written atomically (:func:`condinit.models.checkpoint.atomic_output`); the
writer thread ``fsync``s a shard before its rename. SIGTERM (and Ctrl-C, and any error) removes
the shard being written, so an interrupted write leaves only complete shards and never a partial
file. A previous ``model.safetensors.index.json`` / ``model.safetensors`` in the directory is
removed before the first shard is written and the index is written last, so an interrupted write
never leaves a directory that loads; shards of an earlier write that this one does not replace
(``model-*-of-*.safetensors``) are removed at the end, as ``save_pretrained`` does. Each shard's
header has ``"format": "pt"`` and the ``condinit`` entry of :func:`condinit.models.checkpoint
.condinit_metadata` restricted to the layers whose Q, K and V all lie in that shard (so
``condinit inspect`` can read every shard alone), plus ``"shard": [k, n]``; the index's
``metadata`` has ``total_size`` and ``total_parameters`` as ``save_pretrained`` writes them, and the
whole ``condinit`` entry (every layer) under ``"condinit"``. Headers are deterministic: the same
call writes the same bytes.

**Before anything is written**: every argument is checked; a directory that holds another model
(another ``config.json``, or weights whose ``condinit`` entry names another seed, method, dtype or
layout, or weights without one) is refused unless ``overwrite=True``; the free space of the
destination's filesystem (``shutil.disk_usage``) is compared with the bytes to write. ``resume=True``
keeps every planned shard already there whose size and header (tensor names, shapes, offsets and
metadata, all known beforehand) are exactly what this write would give, and writes the rest:
rerunning an interrupted write with ``resume=True`` finishes it, and gives the same directory as
an uninterrupted run. (A shard damaged after it was completely written, with an intact header, is
not detected: ``overwrite=True`` rewrites everything.)

Only Hugging Face ``PreTrainedModel`` classes: their init rule is what is reproduced here.
Models whose in-memory state-dict names differ from their checkpoint format (transformers'
weight-conversion mappings, e.g. some mixture-of-experts models) are written under their in-memory
names.
"""
from __future__ import annotations

import collections
import collections.abc
import contextlib
import copy
import hashlib
import json
import math
import os
import re
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from condinit._validate import check_bool, check_choice, check_int, check_seed
from condinit.init.functional import V_MODES, check_gains, run_plan
from condinit.ops.orthogonalize.op import DEFAULT_BUDGET, METHODS
from condinit.ops.random.op import NORMAL, NORMAL_CHUNK

from .registry import describe
from .apply import (ApplyReport, AttentionLayer, LayerReport, UncoveredAttentionWarning, covered_tensors,
                    discover_for_writing, uncovered_listing, check_patterns, plan_blocks)
from .checkpoint import (METADATA_KEY, _canonical_json, _read_header, _removing_temps_on_sigterm, atomic_output,
                         check_output_path, condinit_metadata)

__all__ = ["write_pretrained", "write_checkpoint", "plan_shards", "parse_shard_size", "own_init_stream",
           "own_normal_", "PretrainedWriteReport", "WritePlan", "WEIGHTS_NAME", "WEIGHTS_INDEX_NAME"]

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

# safetensors dtype names
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}

_SIZE_UNITS = {"TB": 10 ** 12, "GB": 10 ** 9, "MB": 10 ** 6, "KB": 10 ** 3, "B": 1,
               "TIB": 2 ** 40, "GIB": 2 ** 30, "MIB": 2 ** 20, "KIB": 2 ** 10}

# The init primitives whose writes the recorders follow (through the operators they call); any
# other one on a recorded tensor makes it unknown (some do nothing on meta tensors)
_FOLLOWED_INITS = ("normal_", "zeros_", "ones_", "constant_")
# torch.nn.init's primitives that return at once on a meta tensor
_META_NOOP_INITS = ("trunc_normal_", "dirac_", "orthogonal_", "sparse_")
# Tensors of at most this many elements are computed on the CPU alongside a meta build, so that the
# values only their constructors set are known (_BuildRecorder)
_SMALL_NUMEL = 1 << 16
# Own-init normals: elements per Philox block (the block id's low word counts blocks)
OWN_INIT_BLOCK = 1 << 16
# Bytes of computed tensors waiting for the writer thread before the generator waits for it: enough
# to keep the disk busy while the next unit is computed, small next to a shard.
_MAX_QUEUED_BYTES = 32 * 2 ** 20
# Bytes per piece of a tensor computed in pieces (a replayed own init): the writer writes one while
# the next is computed, and the pieces' buffers are reused.
_PIECE_BYTES = 8 * 2 ** 20
# The orthogonalization's scratch per buffer on the CPU when memory_budget is None: one layer at a
# time is as fast in 4 MiB chunks as in apply's 16 MiB (and the result is the same for any budget).
_CPU_LAYER_BUDGET = 4 * 2 ** 20
# False: each tensor is written before the next one is computed (no overlap; benchmarks compare)
_OVERLAP_WRITES = True


@dataclass
class WritePlan:
    """What a write will do (``dry_run=True`` computes only this): ``files`` as ``[(name, bytes,
    tensors)]`` in order (``keep``: the names a ``resume`` keeps), the bytes to write and on disk,
    the free space, the peak resident-memory estimate (this process now, plus the writer's queue,
    the pieces being drawn, the largest unit computed whole (``largest_unit``: ``(name, bytes)``,
    ``(None, 0)`` if none) and one computed ahead, and scratch), how many of the ``units`` are
    drawn in pieces of at most ``piece_bytes`` (``replayed_units``; ``whole_modules``: the other
    modules besides attention layers, each with why its init is not replayed), and the generation time
    estimated from rates measured on this machine (``rates``; ``None`` unless measured)."""

    files: list
    total_size: int
    write_bytes: int
    free_bytes: Optional[int]
    peak_memory_bytes: int
    largest_unit: tuple
    keep: list = field(default_factory=list)
    units: int = 0
    replayed_units: int = 0
    piece_bytes: int = 0
    whole_modules: dict = field(default_factory=dict)
    rates: Optional[dict] = None
    estimated_seconds: Optional[float] = None


@dataclass
class PretrainedWriteReport:
    """What :func:`write_pretrained` wrote: the directory, its files (weights files in order), the
    tensor bytes (``total_size`` as in the index), the parameter count, and the conditioning as an
    :class:`condinit.ApplyReport` (``apply``: layers, seed, uncovered modules; no singular values).
    ``plan``: the :class:`WritePlan`; ``kept``: the shards a resume found complete; ``dry_run``:
    nothing was written."""

    out_dir: str
    files: list
    weight_map: dict
    total_size: int
    num_parameters: int
    apply: ApplyReport
    time_s: float = 0.0
    extra: dict = field(default_factory=dict)
    plan: Optional[WritePlan] = None
    kept: list = field(default_factory=list)
    dry_run: bool = False

    @property
    def seed(self) -> int:
        return self.apply.seed

    @property
    def uncovered(self) -> list:
        return self.apply.uncovered


# ------------------------------------------------------------------------------------------------
# argument checks

def parse_shard_size(value, name: str = "max_shard_size") -> int:
    """Bytes for ``max_shard_size``: an int >= 1, or a string such as ``"5GB"`` / ``"500MB"``
    (powers of 10, as ``save_pretrained`` counts), ``"2GiB"`` (powers of 2) or plain digits (bytes).
    ``name`` starts the error message.

    Examples:
        >>> parse_shard_size("500MB")
        500000000
        >>> parse_shard_size(1 << 20)
        1048576
    """
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]I?B|B)?\s*", value.upper())
        if m is None:
            raise ValueError(f"{name} must be a size such as 5GB, 500MB, 2GiB or a number of bytes, got {value!r}")
        size = int(float(m[1]) * _SIZE_UNITS[m[2] or "B"])
        if size < 1:
            raise ValueError(f"{name} must be at least 1 byte, got {value!r}")
        return size
    return check_int(name, value, min=1)


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


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


def _build_meta_model(config, model_class, seed: int = 0):
    """``(model, constructed)``: a meta-device model for a transformers config (``model_class``, or
    the config's ``architectures[0]``, or the Auto class :func:`condinit.models.presets.model_class_for`
    picks) and what its constructors wrote into its state (:class:`_BuildRecorder`, :meth:`values`),
    torch's CPU generator seeded from ``seed`` meanwhile."""
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
    recorder = _BuildRecorder()
    try:
        with _seeded(torch.device("cpu"), _unit_seed(seed, "\0build")), torch.device("meta"), recorder, \
                _TensorLiterals(recorder), recorder.unfollowed_inits():
            if hasattr(cls, "from_config") and not hasattr(cls, "_from_config"):   # an Auto class
                model = cls.from_config(config)
            else:
                model = cls._from_config(config)
    except Exception as exc:
        raise ValueError(f"config (model_type {getattr(config, 'model_type', None)!r}): transformers' "
                         f"{getattr(cls, '__name__', cls)} does not build a model from it ({type(exc).__name__}: "
                         f"{str(exc)[:300]}); name the model class to build in the config's \"architectures\"") \
            from exc
    return model, recorder.values(model)


class _TensorLiterals(TorchFunctionMode):
    """``torch.tensor`` / ``torch.as_tensor`` during a meta build (their data never reaches an
    operator a dispatch mode sees): the value is made on the CPU too, as the new tensor's shadow."""

    def __init__(self, recorder: "_BuildRecorder"):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.tensor, torch.as_tensor) and isinstance(out, torch.Tensor) and out.is_meta \
                and out.numel() <= _SMALL_NUMEL:
            try:
                self.recorder.adopt(out, func(*args, **{**kwargs, "device": "cpu"}))
            except Exception:   # not followed: the tensor's value stays unknown
                pass
        return out


class _BuildRecorder(TorchDispatchMode):
    """What the constructors write into the tensors of a model built on the meta device: the values
    ``from_config`` starts from, which the model's ``_init_weights`` then overwrites (or, for a
    tensor only its constructor sets, e.g. CLIP's ``logit_scale`` or a ``Conv1D``'s normal weight,
    keeps).

    A storage of at most ``_SMALL_NUMEL`` elements gets a *shadow*: each operator on it runs on
    the CPU as well (torch's generator included; its ``empty`` holds NaN, or the integer minimum,
    which marks an element nobody wrote). A bigger one gets its writes recorded as
    :class:`_WriteRecorder` records them (``zeros`` / ``ones`` / ``full`` / ``empty`` at creation,
    then fills of contiguous ranges and ``normal_`` of the whole tensor, which becomes own-init
    normals). Any other operator that creates or writes a storage makes it unknown."""

    _CREATE = {torch.ops.aten.zeros.default: 0, torch.ops.aten.ones.default: 1}

    def __init__(self):
        super().__init__()
        self.shadow: dict = {}    # storage key -> the storage's elements on the CPU (1-D)
        self.writes: dict = {}    # storage key -> [writes] (bigger storages)
        self.unknown: set = set()
        self._alive: list = []    # the storages seen, kept so that no key is reused meanwhile

    @contextlib.contextmanager
    def unfollowed_inits(self):
        """``torch.nn.init``'s primitives that do nothing on a meta tensor (``_META_NOOP_INITS``; no
        operator shows their write) make the tensor they are given unknown for the duration, in
        ``torch.nn.init`` and in transformers' table of them. (A model module that imported one by
        name is not reached.)"""
        def marking(original):
            def init_fn(tensor, *args, **kwargs):
                if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                    self._forget(tensor)
                return original(tensor, *args, **kwargs)
            return init_fn

        tables = [vars(torch.nn.init)] + [t for t in (_init_function_table(),) if t is not None]
        patched = []
        try:
            for table in tables:
                for name in _META_NOOP_INITS:
                    if name in table:
                        patched.append((table, name, table[name]))
                        table[name] = marking(table[name])
            yield
        finally:
            for table, name, original in reversed(patched):
                table[name] = original

    def adopt(self, meta: torch.Tensor, cpu: torch.Tensor) -> None:
        """``cpu`` (contiguous, the same dtype and shape) is the value of the new tensor ``meta``."""
        if (cpu.dtype != meta.dtype or cpu.shape != meta.shape or not cpu.is_contiguous() or not meta.is_contiguous()
                or meta.storage_offset() != 0 or meta.untyped_storage().nbytes() != meta.numel() * meta.element_size()):
            return
        self.shadow[self._track(meta)] = cpu.reshape(-1).clone()

    def _track(self, t: torch.Tensor) -> int:
        key = _storage_key(t)
        self._alive.append(t.untyped_storage())
        return key

    def _forget(self, t: torch.Tensor) -> None:
        """What ``t``'s storage holds is not known."""
        key = self._track(t)
        self.shadow.pop(key, None)
        self.unknown.add(key)

    def _cpu(self, t: torch.Tensor):
        flat = self.shadow.get(_storage_key(t))
        if flat is None or flat.dtype != t.dtype:
            raise LookupError
        return flat.as_strided(t.shape, t.stride(), t.storage_offset())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self._follow(func, args, kwargs, out)
        except Exception:   # anything this cannot follow: what the operator created or wrote is unknown
            flat_in, _ = tree_flatten((args, kwargs))
            for t in tree_flatten(out)[0] + [a for a in flat_in if isinstance(a, torch.Tensor)]:
                if isinstance(t, torch.Tensor) and t.is_meta:
                    self._forget(t)
        return out

    def _follow(self, func, args, kwargs, out) -> None:
        flat_in, _ = tree_flatten((args, kwargs))
        inputs = {_storage_key(t) for t in flat_in if isinstance(t, torch.Tensor) and t.is_meta}
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_meta]
        created = [t for t in outs if _storage_key(t) not in inputs]
        written = [t for t in _written_tensors(func, args, kwargs) if t.is_meta]
        for t in created + written:
            self._track(t)
        small = all(t.untyped_storage().nbytes() <= _SMALL_NUMEL * t.element_size() for t in created + written)
        shadowed = all(_storage_key(t) in self.shadow for t in flat_in if isinstance(t, torch.Tensor) and t.is_meta)
        if small and shadowed:
            self._shadow(func, args, kwargs, out, created)
            return
        for t in written:
            key = _storage_key(t)
            record = self.writes.get(key)
            if key in self.shadow or record is None:
                raise ValueError("a write this cannot follow")
            record.append(self._write_of(func, args, kwargs, t))
        for t in created:
            self.writes[_storage_key(t)] = self._creation_of(func, args, kwargs, t)

    def _shadow(self, func, args, kwargs, out, created) -> None:
        def cpu(x):
            if isinstance(x, torch.Tensor) and x.is_meta:
                return self._cpu(x)
            if isinstance(x, torch.device) and x.type == "meta":
                return torch.device("cpu")
            return x
        cargs, ckwargs = tree_map(cpu, (args, kwargs))
        res = func(*cargs, **ckwargs)
        pairs = dict(zip(map(id, tree_flatten(out)[0]), tree_flatten(res)[0]))
        for t in created:
            c = pairs[id(t)]
            if (c.dtype != t.dtype or c.stride() != t.stride() or c.storage_offset() != t.storage_offset()
                    or c.untyped_storage().nbytes() != t.untyped_storage().nbytes()):
                raise ValueError("the CPU result is laid out differently")
            flat = torch.empty(0, dtype=c.dtype).set_(c.untyped_storage(), 0, (c.untyped_storage().nbytes()
                                                                               // c.element_size(),), (1,))
            if str(func).startswith(("aten.empty", "aten.new_empty")):
                flat.fill_(float("nan") if flat.is_floating_point() else
                           (False if flat.dtype == torch.bool else torch.iinfo(flat.dtype).min))
            self.shadow[_storage_key(t)] = flat

    def _creation_of(self, func, args, kwargs, t) -> list:
        if not (t.is_contiguous() and t.storage_offset() == 0
                and t.untyped_storage().nbytes() == t.numel() * t.element_size()):
            raise ValueError("a view")
        if func in self._CREATE:
            return [("fill", 0, t.numel(), self._CREATE[func])]
        if func is torch.ops.aten.full.default:
            return [("fill", 0, t.numel(), args[1])]
        if str(func).startswith(("aten.empty", "aten.new_empty")):
            return []
        raise ValueError("created by a computation")

    @staticmethod
    def _write_of(func, args, kwargs, t) -> tuple:
        if not t.is_contiguous() or kwargs.get("generator") is not None:
            raise ValueError("a write through a strided view, or from a given generator")
        a, b = t.storage_offset(), t.storage_offset() + t.numel()
        if func is torch.ops.aten.zero_.default:
            return ("fill", a, b, 0)
        if func is torch.ops.aten.fill_.Scalar:
            return ("fill", a, b, args[1])
        if func is torch.ops.aten.normal_.default and a == 0 and b * t.element_size() == t.untyped_storage().nbytes() \
                and len(args) <= 3:
            return ("normal", a, b, float(args[1]) if len(args) > 1 else 0.0, float(args[2]) if len(args) > 2 else 1.0)
        raise ValueError("another write")

    def values(self, model: nn.Module) -> dict:
        """``{state-dict name: ("value", CPU tensor) | ("writes", [writes])}`` for the tensors whose
        constructors' writes are known and cover every element."""
        found = {}
        for name, t in list(model.named_parameters(remove_duplicate=False)) + \
                list(model.named_buffers(remove_duplicate=False)):
            if t is None or t.numel() == 0:
                continue
            if not t.is_meta:     # made on the CPU (a legacy constructor ignores the meta device)
                found[name] = ("value", t.detach().clone())
                continue
            key = _storage_key(t)
            if key in self.unknown:
                continue
            if key in self.shadow:
                try:
                    v = self._cpu(t).clone()
                except LookupError:
                    continue
                if v.is_floating_point():
                    unset = bool(torch.isnan(v).any())
                else:
                    unset = v.dtype != torch.bool and bool(v.eq(torch.iinfo(v.dtype).min).any())
                if unset:      # an element no constructor wrote (or a NaN it wrote: not followed)
                    continue
                flat = v.reshape(-1)
                if bool(flat.eq(flat[0]).all()):    # a constant: a fill, which pieces can replay
                    found[name] = ("writes", [("fill", 0, flat.numel(), flat[0].item())])
                else:
                    found[name] = ("value", v)
            elif self.writes.get(key) and t.is_contiguous() and t.storage_offset() == 0 \
                    and t.untyped_storage().nbytes() == t.numel() * t.element_size():
                writes = self.writes[key]
                if any(w[1] == 0 and w[2] == t.numel() for w in writes):
                    found[name] = ("writes", list(writes))
        return found


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
# own-init normals from the counter-based generator

def own_init_stream(name: str) -> tuple[int, int]:
    """``(stream, first block id)`` of the own-init normals of the state-dict tensor ``name``
    (see the module doc): BLAKE2b of ``"condinit own init\\0" + name``, first 4 bytes the stream,
    the next 31 bits the high word of the block id.

    Examples:
        >>> stream, first = own_init_stream("model.embed_tokens.weight")
        >>> first % 2 ** 32, 0 <= stream < 2 ** 32
        (0, True)
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    d = hashlib.blake2b(f"condinit own init\0{name}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(d[:4], "little"), (int.from_bytes(d[4:], "little") & 0x7FFFFFFF) << 32


def own_normal_(tensor: torch.Tensor, seed: int, name: str, mean: float = 0.0, std: float = 1.0, *,
                offset: int = 0) -> torch.Tensor:
    """Fill ``tensor`` (floating, any device and layout) with ``mean + std * z``, ``z`` the
    own-init normals of ``name`` under ``seed`` (see the module doc), each rounded once to the
    tensor's dtype: the same bits on every device and for every chunking. ``offset`` (a multiple
    of ``2**16``) starts at that element of the stream: ``tensor`` gets elements ``offset,
    offset + 1, ...`` of the tensor ``name``, so a big tensor can be drawn piece by piece.

    Examples:
        >>> w = torch.empty(4096, 2048, dtype=torch.bfloat16)
        >>> _ = own_normal_(w, 0, "model.layers.0.mlp.up_proj.weight", std=0.02)
        >>> torch.equal(w[:1], own_normal_(torch.empty(1, 2048, dtype=torch.bfloat16), 0,
        ...                                "model.layers.0.mlp.up_proj.weight", std=0.02))
        True
        >>> torch.equal(w[1024:], own_normal_(torch.empty(3072, 2048, dtype=torch.bfloat16), 0,
        ...                                   "model.layers.0.mlp.up_proj.weight", std=0.02, offset=1024 * 2048))
        True
    """
    seed = check_seed("seed", seed)
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise TypeError(f"tensor must be a floating torch.Tensor, got {getattr(tensor, 'dtype', type(tensor))}")
    offset = check_int("offset", offset, min=0)
    if offset % OWN_INIT_BLOCK:
        raise ValueError(f"offset must be a multiple of {OWN_INIT_BLOCK}, got {offset}")
    stream, first = own_init_stream(name)
    first += offset // OWN_INIT_BLOCK
    mean, std = float(mean), float(std)
    n = tensor.numel()
    blocks = -(-(offset + n) // OWN_INIT_BLOCK)
    if blocks >= 1 << 32:
        raise ValueError(f"{name}: {offset + n} elements are more than own_normal_ draws for one tensor (2**48)")
    blocks -= offset // OWN_INIT_BLOCK
    if n == 0:
        return tensor
    with torch.no_grad():
        dest = tensor if tensor.is_contiguous() else torch.empty(tensor.shape, dtype=tensor.dtype,
                                                                 device=tensor.device)
        backend = NORMAL.choose(dest.device, dtype=dest.dtype)
        ids = torch.arange(first, first + blocks, dtype=torch.int64, device=dest.device)
        NORMAL(backend, seed, stream, ids, 1, OWN_INIT_BLOCK, mean, std, dest)
        if dest is not tensor:
            tensor.copy_(dest)
    return tensor


def _init_function_table():
    """transformers' table of the torch init primitives its guarded ``init.*`` functions call
    (transformers >= 5), or None."""
    try:
        from transformers import initialization
    except ImportError:
        return None
    return getattr(initialization, "TORCH_INIT_FUNCTIONS", None)


# ------------------------------------------------------------------------------------------------
# materializing units

def _unit_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"condinit own init\0{seed}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1   # torch.manual_seed takes [0, 2**63)


@contextlib.contextmanager
def _seeded(device: torch.device, seed: int):
    """torch's generator of the CPU (and of ``device`` if it is a GPU) seeded with ``seed`` for the
    duration, their states restored after."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if devices:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


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


class _BufferPool:
    """CPU buffers of tensors already written, handed out again for tensors of the same byte size.

    A fresh allocation of a big tensor costs a page fault per 4 KB page on its first write, about
    as much as drawing its normals; the tensors of one layer recur in every layer, so their buffers
    are reused instead. Holds at most ``max_bytes`` (buffers of at least ``min_bytes``); thread safe
    (the writer thread gives, the generating thread takes)."""

    def __init__(self, max_bytes: int = 128 * 2 ** 20, min_bytes: int = 2 ** 20):
        self.max_bytes, self.min_bytes = max_bytes, min_bytes
        self._free: dict = {}
        self._held = 0
        self._lock = threading.Lock()

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            bufs = self._free.get(n)
            if bufs:
                self._held -= n
                return bufs.pop().view(dtype).view(shape)
        return torch.empty(shape, dtype=dtype)

    def give(self, t: torch.Tensor) -> None:
        n = _nbytes(t)
        if (t.device.type != "cpu" or n < self.min_bytes or t.storage_offset() != 0 or not t.is_contiguous()
                or t.untyped_storage().nbytes() != n):
            return
        with self._lock:
            if self._held + n <= self.max_bytes:
                self._free.setdefault(n, []).append(t.detach().reshape(-1).view(torch.uint8))
                self._held += n


def _storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (shared by its views and ``.data``; meta tensors included)."""
    return t.untyped_storage()._cdata


def _written_tensors(func, args, kwargs) -> list:
    """The tensors an operator writes: its arguments the schema marks written (``out=`` included)."""
    found = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            found += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return found


class _WriteRecorder(TorchDispatchMode):
    """Every write the model's init makes to the fresh meta tensors of a unit, in order.

    :meth:`watch` gets the tensors: ``{storage (_storage_key): (state-dict key, base tensor)}``. A
    write (an operator argument the schema marks written, ``out=`` included) to one of them is
    recorded in ``writes[key]`` as ``("fill", start, stop, value)`` when it is ``fill_`` / ``zero_``
    of a contiguous range of the tensor; own-init normals are recorded by :meth:`normal` (the init
    table's ``normal_`` calls it instead of drawing) as ``("normal", start, stop, mean, std)``. Any
    other write makes the tensor not replayable (``unsupported[key]``: why)."""

    _FILLS = (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default)

    def __init__(self):
        super().__init__()
        self.fresh: dict = {}
        self.writes: dict = {}
        self.unsupported: dict = {}

    def watch(self, fresh: dict) -> None:
        self.fresh = fresh
        self.writes = {key: [] for key, _ in fresh.values()}

    def check_storages(self, tensors: dict) -> None:
        """``tensors`` (``{key: tensor}``) after the init: one whose storage was replaced
        (``tensor.data = ...``) got values the recorded writes do not show."""
        for key, t in tensors.items():
            if t.numel() and self.fresh.get(_storage_key(t), (None,))[0] != key:
                self.unsupported.setdefault(key, "its storage was replaced (tensor.data = ...)")

    def _range(self, t: torch.Tensor, what: str):
        hit = self.fresh.get(_storage_key(t))
        if hit is None:
            return None, None
        key, base = hit
        if not t.is_contiguous():
            self.unsupported.setdefault(key, f"{what} on a non-contiguous view")
            return key, None
        start = t.storage_offset() - base.storage_offset()
        return key, (start, start + t.numel())

    def refuse(self, t: torch.Tensor, what: str) -> None:
        key, _ = self._range(t, what)
        if key is not None:
            self.unsupported.setdefault(key, f"{what} writes it")

    def normal(self, t: torch.Tensor, name: str, mean: float, std: float) -> None:
        key, span = self._range(t, "normal_")
        if key is None or span is None:
            return
        if name != key:
            self.unsupported.setdefault(key, "normal_ on a part of it")
            return
        self.writes[key].append(("normal", span[0], span[1], float(mean), float(std)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in _written_tensors(func, args, kwargs):
            key, span = self._range(t, str(func))
            if key is None or span is None:
                continue
            if func in self._FILLS and (func is torch.ops.aten.zero_.default or
                                        isinstance(args[1], (bool, int, float))):
                self.writes[key].append(("fill", span[0], span[1], args[1] if len(args) > 1 else 0))
            else:
                self.unsupported.setdefault(key, f"{func} writes it")
        return func(*args, **kwargs)


@dataclass
class _Replay:
    """A state-dict tensor produced in pieces from the writes its init was recorded making: the
    last write of the whole tensor (own-init normals of ``key`` with ``mean`` / ``std``, or a fill
    with ``value``), then the fills of ranges after it, in order. Every piece holds exactly the
    elements the init computes (own-init normals are counter-based: any piece can be drawn alone)."""

    key: str
    numel: int
    dtype: torch.dtype
    base: tuple
    fills: list

    @classmethod
    def from_writes(cls, key: str, meta: torch.Tensor, writes: list) -> Optional["_Replay"]:
        n = meta.numel()
        whole = [i for i, w in enumerate(writes) if w[1] == 0 and w[2] == n]
        if not whole:
            return None
        base, rest = writes[whole[-1]], writes[whole[-1] + 1:]
        if base[0] == "normal" and not meta.is_floating_point():
            return None
        if any(w[0] != "fill" for w in rest):
            return None
        return cls(key, n, meta.dtype, base, [w[1:] for w in rest])

    def pieces(self, seed: int, piece_bytes: int, take) -> "collections.abc.Iterator[tuple]":
        """The tensor's elements in order as ``(piece, buffer)``: ``buffer`` a 1-D tensor from
        ``take(numel, dtype)`` (the same size for every piece: whole ``2**16``-element blocks,
        ``piece_bytes`` at most), ``piece`` its first elements (all of it but at the end)."""
        if self.numel == 0:
            return
        per = max(OWN_INIT_BLOCK, piece_bytes // self.dtype.itemsize // OWN_INIT_BLOCK * OWN_INIT_BLOCK)
        per = min(per, -(-self.numel // OWN_INIT_BLOCK) * OWN_INIT_BLOCK)
        for a in range(0, self.numel, per):
            buf = take(per, self.dtype)
            piece = buf[:min(self.numel, a + per) - a]
            self.write_into(piece, seed, a)
            yield piece, buf

    def write_into(self, out: torch.Tensor, seed: int, start: int = 0) -> None:
        """Elements ``start, start + 1, ...`` of the tensor into ``out`` (1-D; ``start`` a multiple
        of ``2**16`` when the tensor's base write is own-init normals)."""
        a, b = start, start + out.numel()
        if self.base[0] == "normal":
            own_normal_(out, seed, self.key, self.base[3], self.base[4], offset=a)
        else:
            out.fill_(self.base[3])
        for lo, hi, value in self.fills:
            lo, hi = max(lo, a), min(hi, b)
            if lo < hi:
                out[lo - a:hi - a].fill_(value)


class _Materializer:
    """Computes the tensors of a meta ``PreTrainedModel`` unit by unit (see module doc), on ``device``."""

    def __init__(self, model, seed: int, method: str, v_mode: str, layers: Sequence[AttentionLayer],
                 memory_budget: Optional[int], state: dict, device: torch.device, qk_gain: float = 1.0,
                 v_gain: float = 1.0, constructed: Optional[dict] = None):
        from transformers import PreTrainedModel

        self.model, self.seed, self.method, self.v_mode = model, seed, method, v_mode
        # state-dict key -> what the constructors wrote (_BuildRecorder.values), where known: a
        # value, or writes that make a _Replay of the saved tensor
        self.constructed = {k: v for k, v in (constructed or {}).items() if k in state and
                            (v[0] == "value" or _Replay.from_writes(k, state[k], v[1]) is not None)}
        self.memory_budget, self.device, self.qk_gain, self.v_gain = memory_budget, device, qk_gain, v_gain
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
        self.covered = {id(t) for t in covered_tensors(layers)}
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
        self.unit_of = {key: (("layer", self.layer_of_module[m]) if m in self.layer_of_module else ("module", m))
                        for key, (m, _) in self.owner.items()}
        self.unit_modules = {}
        for key, (mname, _) in self.owner.items():
            mods = self.unit_modules.setdefault(self.unit_of[key], [])
            if mname not in mods:
                mods.append(mname)
        try:
            from transformers.initialization import guard_torch_init_functions
        except ImportError:   # transformers 4: torch.nn.init is not patched, nothing to guard
            guard_torch_init_functions = contextlib.nullcontext
        self.guard = guard_torch_init_functions
        self.init_table = _init_function_table()
        self.pool = _BufferPool() if device.type == "cpu" else None
        self._fresh: dict = {}     # storage (_storage_key) -> (key, tensor) of the unit being initialized
        self._whole: set = set()   # keys a patched normal_ filled entirely
        self._recorder: Optional[_WriteRecorder] = None
        self._replays: dict = {}   # module unit -> {key: _Replay}, or None: materialized whole
        self.whole_why: dict = {}  # module unit materialized whole -> why it is not replayed

    def unit_bytes(self, unit) -> int:
        """Bytes of the state-dict tensors of ``unit``."""
        total = 0
        for m in self.unit_modules[unit]:
            prefix = f"{m}." if m else ""
            mod = self.modules[m]
            for attr, t in list(mod._parameters.items()) + list(mod._buffers.items()):
                if t is not None and self.owner.get(prefix + attr) == (m, attr):
                    total += _nbytes(t)
        return total

    def _name_of(self, tensor: torch.Tensor) -> Optional[str]:
        """The stream name of a tensor handed to ``normal_``: a state-dict key of the unit being
        initialized, a view of one (named after its geometry), or None (anything else)."""
        if not self._fresh:
            return None
        hit = self._fresh.get(_storage_key(tensor))
        if hit is None:
            return None
        key, base = hit
        if (tensor.storage_offset() == base.storage_offset() and tuple(tensor.shape) == tuple(base.shape)
                and tensor.stride() == base.stride() and tensor.dtype == base.dtype):
            return key
        return f"{key}@{tensor.storage_offset()}:{list(tensor.shape)}:{list(tensor.stride())}"

    @contextlib.contextmanager
    def _own_normals(self):
        """transformers' guarded init functions (and ``torch.nn.init`` under the guard) while a
        unit is initialized: ``normal_`` drawn by :func:`own_normal_` for the unit's tensors, and
        every tensor one of them fills whole recorded in ``_whole`` (each of these primitives
        writes every element of the tensor it is given)."""
        table = self.init_table
        if table is None:
            yield
            return
        originals = dict(table)

        def recording(fname, original):
            def fill(tensor, *args, **kwargs):
                name = self._name_of(tensor)
                if self._recorder is not None and name is not None and fname not in _FOLLOWED_INITS:
                    # some of these do nothing on a meta tensor (trunc_normal_, orthogonal_, ...):
                    # refused here, not left to what reaches the dispatcher
                    self._recorder.refuse(tensor, fname)
                if fname == "normal_" and name is not None and kwargs.get("generator") is None and len(args) < 3:
                    mean = args[0] if args else kwargs.get("mean", 0.0)
                    std = args[1] if len(args) > 1 else kwargs.get("std", 1.0)
                    if self._recorder is not None:
                        self._recorder.normal(tensor, name, mean, std)
                    else:
                        own_normal_(tensor, self.seed, name, mean, std)
                else:   # not a state-dict tensor of this unit, or another rule: the model's own code decides
                    original(tensor, *args, **kwargs)
                if name is not None and "@" not in name:
                    self._whole.add(name)
                return tensor
            return fill

        for fname, original in originals.items():
            table[fname] = recording(fname, original)
        try:
            yield
        finally:
            table.update(originals)

    def _init_module(self, mname: str, fill: bool, recorder: Optional[_WriteRecorder] = None) -> tuple[dict, list]:
        """``({attr: real tensor}, keys to check)``: ``mname``'s direct state-dict tensors after
        the model's own init, floating ones allocated NaN-filled (``fill``) or uninitialized.
        With a ``recorder`` (see :meth:`_record`), fresh meta tensors instead, every write recorded."""
        mod = self.modules[mname]
        prefix = f"{mname}." if mname else ""
        fresh, checked = {}, []
        for attr, t in list(mod._parameters.items()) + list(mod._buffers.items()):
            key = prefix + attr
            if t is None or self.owner.get(key) != (mname, attr):
                continue
            if recorder is not None:
                real = torch.empty(t.shape, dtype=t.dtype, device="meta")
            elif self.pool is not None:
                real = self.pool.take(tuple(t.shape), t.dtype)
            else:
                real = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            if isinstance(t, nn.Parameter):
                real = nn.Parameter(real, requires_grad=t.requires_grad)
            if id(t) in self.covered:
                real._is_hf_initialized = True     # the own init passes over it, as in apply; run_plan writes it all
            elif recorder is not None:
                pass                                        # meta: nothing to fill, every write is recorded
            elif key in self.constructed and (fill or not real.is_floating_point()):
                self._from_constructor(real.detach(), key)  # from_config's starting values
            elif real.is_floating_point():
                if fill:
                    real.detach().fill_(float("nan"))       # anything the own init leaves is caught below
                checked.append(key)
            elif real.dtype == torch.bool:
                real.detach().zero_()
            else:
                real.detach().fill_(torch.iinfo(real.dtype).min)
                checked.append(key)
            fresh[attr] = real
        parts = mname.split(".") if mname else []
        chain = [".".join(parts[:i]) for i in range(len(parts), -1, -1)]   # the module, then its ancestors
        self._fresh = {_storage_key(real): (prefix + attr, real.detach()) for attr, real in fresh.items()
                       if real.numel()}
        self._whole = set()
        if recorder is not None:
            recorder.watch(self._fresh)
        self._recorder = recorder
        try:
            # recording needs no seed: a random draw of torch's generator is a write it does not replay
            seeded = _seeded(self.device, _unit_seed(self.seed, mname)) if recorder is None else recorder
            with _swapped(mod, fresh), seeded, torch.no_grad(), self.guard(), self._own_normals():
                for name in chain:
                    fn = self.init_of[name]
                    if fn is not None:
                        fn(self.modules[name])
            if recorder is not None:
                recorder.check_storages({prefix + attr: real for attr, real in fresh.items()})
        finally:
            self._fresh, self._recorder = {}, None
        for real in fresh.values():
            real.__dict__.pop("_is_hf_initialized", None)
        return fresh, [k for k in checked if k not in self._whole]

    def _from_constructor(self, real: torch.Tensor, key: str) -> None:
        """Write into ``real`` what the model's constructors wrote into tensor ``key`` (a value
        computed on the CPU, or fills and own-init normals of ``key``)."""
        kind, what = self.constructed[key]
        if kind == "value":
            real.copy_(what.reshape(real.shape))
        else:
            _Replay.from_writes(key, real, what).write_into(real.view(-1), self.seed)

    def _own(self, mname: str) -> dict:
        """``{attr: real tensor}``: ``mname``'s direct state-dict tensors after the model's own init.

        Floating tensors start uninitialized: when every one of them was filled whole by an init
        primitive, that is all. Otherwise the init is run again (it is a pure function of the seed
        and the names) on NaN-filled tensors, and a tensor still holding a NaN (an integer one, its
        fill value) is an error: nothing is ever written that the model's init did not write."""
        fresh, unsure = self._init_module(mname, fill=False)
        floating_unsure = [k for k in unsure if self.state[k].is_floating_point()]
        if floating_unsure:
            fresh, unsure = self._init_module(mname, fill=True)
        prefix = f"{mname}." if mname else ""
        for attr, real in fresh.items():
            key = prefix + attr
            if key in unsure and _left_uninitialized(real.detach()):
                raise ValueError(f"{key}: the model's own init (_init_weights) leaves this tensor uninitialized; "
                                 f"write_pretrained cannot compute it")
        return fresh

    def replays(self, unit) -> Optional[dict]:
        """``{key: _Replay}`` for every state-dict tensor of a module ``unit`` whose init, run on
        fresh meta tensors, makes only writes a :class:`_Replay` redoes (own-init normals and fills,
        the last whole write of each tensor first); None otherwise (and for attention layers),
        when the unit is materialized whole (``whole_why[unit]`` says why). Recorded once per unit."""
        if unit not in self._replays:
            self._replays[unit], why = self._record(unit)
            if why is not None:
                self.whole_why[unit] = why
        return self._replays[unit]

    def _record(self, unit) -> tuple:
        """``({key: _Replay}, None)``, or ``(None, why not)``."""
        if unit[0] != "module":
            return None, None
        mname = unit[1]
        recorder = _WriteRecorder()
        try:
            fresh, _ = self._init_module(mname, fill=False, recorder=recorder)
        except Exception as exc:   # an init that needs real values (e.g. reads them): run it on real tensors
            return None, f"its init fails on meta tensors ({type(exc).__name__}: {str(exc)[:80]})"
        prefix = f"{mname}." if mname else ""
        out = {}
        for attr, t in fresh.items():
            key = prefix + attr
            if key in recorder.unsupported:
                return None, f"{key}: {recorder.unsupported[key]}"
            if t.numel() == 0:
                out[key] = _Replay(key, 0, t.dtype, ("fill", 0, 0, 0), [])
                continue
            writes = recorder.writes.get(key, [])
            replay = _Replay.from_writes(key, t, writes)
            made = self.constructed.get(key)
            if replay is None and made is not None and made[0] == "writes":   # from the constructor's
                replay = _Replay.from_writes(key, t, made[1] + writes)
            if replay is None:
                if made is not None and made[0] == "value":
                    return None, f"{key}: its value comes from its constructor (computed on the CPU)"
                return None, f"{key}: not written whole by own-init normals or a fill"
            out[key] = replay
        return out, None

    def unit(self, unit) -> dict:
        """``{key: tensor}`` for every state-dict tensor of ``unit``; a :class:`_Replay` instead of
        the tensor for every tensor of a unit that :meth:`replays` replays."""
        replays = self.replays(unit)
        if replays is not None:
            return dict(replays)
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
                    plan, _ = plan_blocks([live], self.v_mode, measure_before=False, qk_gain=self.qk_gain,
                                    v_gain=self.v_gain)
                    run_plan(plan, self.seed, self.method, memory_budget=self.memory_budget)
        out = {}
        for m in mnames:
            prefix = f"{m}." if m else ""
            for attr, t in own[m].items():
                out[prefix + attr] = t.detach()
        return out


# ------------------------------------------------------------------------------------------------
# files

def _shard_header(keys: list, state: dict, metadata: dict) -> tuple[bytes, list, int]:
    """``(head, order, file size)`` of a safetensors file of ``keys`` (from the meta tensors in
    ``state``): ``head`` is the length prefix and the header, ``order`` the tensors in data order
    (largest element size first, keeping each tensor aligned, then state-dict order). The header has
    sorted keys in compact JSON, padded with spaces to 8 bytes as safetensors does."""
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
    head = len(raw).to_bytes(8, "little") + raw
    return head, order, len(head) + at


class _Aborted(Exception):
    """The generating side gave up: the writer drops the file it is writing."""


class _Progress:
    """Bytes written: a tqdm bar (rate, ETA) when tqdm is installed, else a line on stderr every
    ``every_s`` seconds. Updated from the writer thread."""

    def __init__(self, total: int, desc: str, every_s: float = 10.0):
        self.total, self.desc, self.every_s = total, desc, every_s
        self.done, self.t0, self.last = 0, time.perf_counter(), time.perf_counter()
        try:
            from tqdm.auto import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=desc, leave=False,
                            smoothing=0.1)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            print(f"{self.desc}: {_fmt_bytes(self.done)} of {_fmt_bytes(self.total)} "
                  f"({100 * self.done / max(self.total, 1):.0f}%), {rate / 1e6:.0f} MB/s, ETA {eta:.0f} s",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Writeback:
    """Starts the disk writing of a file's data as it is written, instead of at its final ``fsync``.

    The kernel writes dirty pages back only past a threshold (``dirty_background_ratio``, ~10 % of
    memory) or after ~30 s: a shard smaller than that would sit in the page cache, the disk idle,
    until the ``fsync`` at its end, and the run would take generation time plus disk time.
    ``posix_fadvise(DONTNEED)`` on a written range starts its writeback without waiting (Linux) and
    drops the range written before it, already on disk, from the cache: the disk works while the
    next tensors are computed, and the page cache holds about ``2 * step`` bytes of the file. A
    hint only; the ``fsync`` before the rename is what makes the file durable."""

    step = 64 * 2 ** 20

    def __init__(self, fh, at: int):
        self.fh, self.at = fh, at
        self.started = self.dropped = at   # offsets: writeback asked up to, cache dropped up to
        self.enabled = hasattr(os, "posix_fadvise")

    def wrote(self, n: int) -> None:
        self.at += n
        if not self.enabled or self.at - self.started < self.step:
            return
        self.fh.flush()
        fd = self.fh.fileno()
        os.posix_fadvise(fd, self.dropped, self.at - self.dropped, os.POSIX_FADV_DONTNEED)
        self.dropped, self.started = self.started, self.at


class _Writer:
    """Writes files on a thread of its own, so the disk works while the next tensors are computed:
    ``begin(path, head)``, ``put(tensor)`` for each tensor in order, ``end()``; then ``finish()``
    (waits, raises the writer's error) or ``abort()`` (drops the file being written). Each file goes
    through :func:`atomic_output` and is fsynced before its rename. ``put`` waits while more than
    ``max_queued`` bytes are queued and not yet written (one bigger tensor is let through alone)."""

    def __init__(self, progress: Optional[_Progress], max_queued: Optional[int] = None,
                 pool: Optional[_BufferPool] = None):
        self._pool = pool
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._queued, self._max_queued = 0, _MAX_QUEUED_BYTES if max_queued is None else max_queued
        self.error: Optional[BaseException] = None
        self.written: list = []
        self._progress = progress
        self._thread = threading.Thread(target=self._run, name="condinit-writer", daemon=True)
        self._thread.start()

    def _push(self, item, nbytes: int = 0) -> None:
        with self._cond:
            while self.error is None and self._queued > 0 and self._queued + nbytes > self._max_queued:
                self._cond.wait()
            if self.error is not None:
                raise self.error
            self._items.append(item)
            self._queued += nbytes
            self._cond.notify_all()

    def _pop(self):
        with self._cond:
            while not self._items:
                self._cond.wait()
            return self._items.popleft()

    def begin(self, path: str, head: bytes) -> None:
        self._push(("begin", path, head))

    def put(self, tensor: torch.Tensor, buffer: Optional[torch.Tensor] = None) -> None:
        """Queue ``tensor`` for writing; then its buffer (``buffer``, of which ``tensor`` is a part,
        else ``tensor``) goes to the buffer pool."""
        self._push(("data", tensor, tensor if buffer is None else buffer), _nbytes(tensor))
        if not _OVERLAP_WRITES:
            with self._cond:
                while self.error is None and self._queued > 0:
                    self._cond.wait()

    def end(self) -> None:
        self._push(("end",))

    def _run(self) -> None:
        try:
            while True:
                item = self._pop()
                if item[0] != "begin":
                    return
                _, path, head = item
                with atomic_output(path) as tmp:
                    with open(tmp, "wb") as fh:
                        fh.write(head)
                        flush = _Writeback(fh, len(head))
                        while True:
                            item = self._pop()
                            if item[0] == "end":
                                break
                            if item[0] != "data":
                                raise _Aborted()
                            t, buf = item[1], item[2]
                            del item
                            n = _nbytes(t)
                            # in pieces, writeback started after each: one big write (the 525 MB
                            # embedding) would leave it to the kernel's dirty throttling (~300 MB/s
                            # here instead of the disk's ~2.5 GB/s). Each piece written leaves the
                            # queue, so the generator goes on before the end of a big tensor.
                            data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if n else None
                            piece = None
                            for at in range(0, n, flush.step):
                                piece = data[at:at + flush.step]
                                fh.write(piece)
                                flush.wrote(len(piece))
                                with self._cond:
                                    self._queued -= len(piece)
                                    self._cond.notify_all()
                                if self._progress is not None:
                                    self._progress.update(len(piece))
                            del data, piece, t
                            if self._pool is not None:
                                self._pool.give(buf)
                            del buf
                        fh.flush()
                        os.fsync(fh.fileno())
                self.written.append(path)
        except BaseException as exc:   # handed to the generating thread, which raises it
            with self._cond:
                self.error = exc
                self._cond.notify_all()

    def finish(self) -> None:
        self._push(("stop",))
        self._thread.join()
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        with self._cond:
            self._items.clear()
            self._queued = 0
            self._items.append(("abort",))
            self._cond.notify_all()
        self._thread.join()


def _json_text(value) -> str:
    return json.dumps(value, indent=2, sort_keys=True) + "\n"


def _write_text(path: str, text: str) -> None:
    with atomic_output(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)


# ------------------------------------------------------------------------------------------------
# what is already in the destination

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


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


def _other_model(out_dir: str, config_text: Optional[str], full_meta: dict, planned: set) -> Optional[str]:
    """Why ``out_dir`` holds a model other than the one about to be written, or None (nothing
    there, or this model: same config, same ``condinit`` identity)."""
    if not os.path.isdir(out_dir):
        return None
    names = sorted(os.listdir(out_dir))
    if config_text is not None and CONFIG_NAME in names:
        try:
            with open(os.path.join(out_dir, CONFIG_NAME), encoding="utf-8") as fh:
                old = json.load(fh)
        except (OSError, UnicodeDecodeError, ValueError):
            return f"its {CONFIG_NAME} is not readable JSON"
        new = json.loads(config_text)
        if not isinstance(old, dict):
            return f"its {CONFIG_NAME} is not a JSON object"
        old = {k: v for k, v in old.items() if k != "transformers_version"}
        new = {k: v for k, v in new.items() if k != "transformers_version"}
        if old != new:
            return f"its {CONFIG_NAME} differs ({_first_difference(old, new)})"
    ours = _identity(full_meta)
    our_layers = [_canonical_json(ent) for ent in full_meta.get("layers", [])]
    for name in names:
        path = os.path.join(out_dir, name)
        if not os.path.isfile(path):
            continue
        if name == WEIGHTS_INDEX_NAME:
            try:
                with open(path, encoding="utf-8") as fh:
                    meta = (json.load(fh).get("metadata") or {}).get(METADATA_KEY)
            except (OSError, UnicodeDecodeError, ValueError, AttributeError):
                return f"its {name} is not a readable index"
            where = name
        elif name.endswith(".safetensors") and (name in planned or _SHARD_RE.match(name) or name == WEIGHTS_NAME):
            try:
                raw = (_read_header(path).get("__metadata__") or {}).get(METADATA_KEY)
                meta = json.loads(raw) if raw is not None else None
            except ValueError:
                if name in planned:   # an unfinished or damaged file this write replaces anyway
                    continue
                return f"{name} is not a readable safetensors file"
            where = name
        elif name.endswith(_WEIGHT_SUFFIXES):
            return f"it holds weights this write does not produce ({name})"
        else:
            continue
        if not isinstance(meta, dict):
            return f"{where} was not written by condinit (no condinit metadata)"
        if _identity(meta) != ours:
            return f"{where} is another condinit model ({_first_difference(_identity(meta), ours)})"
        if any(_canonical_json(ent) not in our_layers for ent in meta.get("layers") or ()):
            return f"{where} describes other attention layers"
    return None


def _complete(path: str, head: bytes, size: int) -> bool:
    """Whether ``path`` is the file this write would give: its size, and its header (every tensor's
    name, dtype, shape and offsets, and the metadata) byte for byte."""
    try:
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            return False
        with open(path, "rb") as fh:
            return fh.read(len(head)) == head
    except OSError:
        return False


def _free_bytes(path: str) -> int:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent)."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def _needed_bytes(paths: dict, sizes: dict, keep: set) -> int:
    """Bytes the write needs free: every file it writes, less the files it replaces (freed at their
    rename), but the largest of those, held until its own replacement is complete."""
    new = sum(sizes[f] for f in paths if f not in keep)
    replaced = [os.path.getsize(paths[f]) for f in paths if f not in keep and os.path.isfile(paths[f])]
    return new - sum(replaced) + max(replaced, default=0)


def _current_rss() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------------------------
# the write

@dataclass
class _Job:
    model: nn.Module
    state: dict
    engine: _Materializer
    report: ApplyReport
    full_meta: dict
    num_parameters: int
    total_size: int
    device: torch.device


def _prepare(model_or_config, *, seed, method, v_mode, qk_gain, v_gain, dtype, model_class, include, exclude,
             strict, memory_budget, family, extra_metadata, device) -> _Job:
    """Every check and the whole plan, nothing written."""
    from transformers import PretrainedConfig

    seed = check_seed("seed", seed)
    check_choice("method", method, METHODS)
    check_choice("v_mode", v_mode, V_MODES)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    inc, exc = check_patterns(include, "include"), check_patterns(exclude, "exclude")
    strict = check_bool("strict", strict)
    memory_budget = check_int("memory_budget", memory_budget, min=1, allow_none=True)
    if family is not None and not isinstance(family, str):
        raise TypeError(f"family must be a string or None, got {type(family).__name__}")
    if extra_metadata is not None and not isinstance(extra_metadata, dict):
        raise TypeError(f"extra_metadata must be a dict or None, got {type(extra_metadata).__name__}")
    try:
        device = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda', got {device!r}") from None
    if device.type == "meta":
        raise ValueError("device must be a real device (cpu, cuda, ...), got meta")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: no CUDA device is available")

    if isinstance(model_or_config, PretrainedConfig):
        config = model_or_config
        model, constructed = _build_meta_model(config, model_class, seed)
        if dtype is None:
            cfg_dtype = getattr(config, "dtype", None)
            if isinstance(cfg_dtype, str):
                cfg_dtype = getattr(torch, cfg_dtype, None)
            dtype = cfg_dtype if isinstance(cfg_dtype, torch.dtype) else torch.float32
    elif _is_pretrained(model_or_config):
        constructed = {}       # built elsewhere: what its constructors wrote is not known
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

    found = discover_for_writing(model, 0, inc, exc, include, exclude, strict, v_mode)
    layers, uncovered = found.layers, found.uncovered
    qk_gain, v_gain = check_gains(qk_gain, v_gain, [p.weight.dtype for l in layers for p in (l.spec.q, l.spec.k)],
                                  [l.spec.v.weight.dtype for l in layers])
    state = _saved_state(model)
    for k, t in state.items():
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"{k}: dtype {t.dtype} cannot be stored in safetensors by write_pretrained")
    if memory_budget is None and device.type == "cpu":
        memory_budget = _CPU_LAYER_BUDGET
    engine = _Materializer(model, seed, method, v_mode, layers, memory_budget, state, device, qk_gain, v_gain,
                           constructed)
    if uncovered:
        warnings.warn(f"write_pretrained: {len(uncovered)} attention-like module(s) of {type(model).__name__} are "
                      f"not conditioned and keep the model's own init (report.uncovered lists them; strict=True "
                      f"makes this an error): {uncovered_listing(uncovered, 10)}", UncoveredAttentionWarning, stacklevel=3)
    reports = [LayerReport(l.index, l.name, l.adapter, l.spec.num_heads, l.spec.num_kv_heads, l.spec.head_dim,
                           {p: tuple(proj.shape) for p, proj in l.spec.projections()}, layout=l.spec.layout,
                           cross=l.cross) for l in layers]
    report = ApplyReport(reports, seed, method, v_mode, 0, True, False, 0.0, 0.0, list(uncovered), qk_gain, v_gain)
    fam = family if family is not None else getattr(model.config, "model_type", None)
    full_meta = json.loads(condinit_metadata(model, report, fam, extra=extra_metadata)[METADATA_KEY])
    num_parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    total_size = sum(_nbytes(t) for t in state.values())
    return _Job(model, state, engine, report, full_meta, num_parameters, total_size, device)


@contextlib.contextmanager
def _compute_threads(device: torch.device, leave_one: bool = True):
    """torch's CPU threads while tensors are computed: all cores but one (``leave_one``), which is
    the writer thread's, while pieces are drawn (the writer writes each piece while the next is
    drawn; torch's threads on every core stall one another and the writer: 2-3x slower on two
    cores); every core for a unit computed whole (an attention layer's orthogonalization: the
    writer has at most its queue to write meanwhile; 1.2x faster for Llama-3-8B here). Results do
    not depend on it (counter-based streams; the orthogonalization is bit-identical across thread
    counts)."""
    threads = torch.get_num_threads()
    if device.type == "cpu" and leave_one:
        torch.set_num_threads(max(1, threads - 1))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _measure_rates(job: _Job) -> dict:
    """Generation rates on this machine, from a short run with the threads the write uses
    (:func:`_compute_threads`): own-init elements per second (the model's main dtype) and seconds
    per conditioned attention layer (its first one, computed)."""
    dtypes = collections.Counter()
    for t in job.state.values():
        if t.is_floating_point():
            dtypes[t.dtype] += t.numel()
    dtype = dtypes.most_common(1)[0][0] if dtypes else torch.float32
    with _compute_threads(job.device):
        probe = torch.empty(1 << 22, dtype=dtype, device=job.device)
        own_normal_(probe, 0, "rate probe")   # first call: allocations and kernel set-up
        t0 = time.perf_counter()
        own_normal_(probe, 0, "rate probe", std=0.02)
        if job.device.type == "cuda":
            torch.cuda.synchronize(job.device)
        own_rate = probe.numel() / max(time.perf_counter() - t0, 1e-9)
        del probe
    layer_units = [u for u in job.engine.unit_modules if u[0] == "layer"]
    layer_s = 0.0
    if layer_units:
        with _compute_threads(job.device, leave_one=False):
            t0 = time.perf_counter()
            job.engine.unit(layer_units[0])
            if job.device.type == "cuda":
                torch.cuda.synchronize(job.device)
            layer_s = time.perf_counter() - t0
    return {"own_elements_per_s": own_rate, "layer_s": layer_s, "dtype": str(dtype).replace("torch.", "")}


def _make_plan(job: _Job, files: dict, heads: dict, sizes: dict, keep: list, free: Optional[int],
               write_bytes: int, measure: bool) -> WritePlan:
    engine = job.engine
    units = engine.unit_modules
    unit_bytes = {u: engine.unit_bytes(u) for u in units}
    # computed whole: attention layers, and module units whose init is not replayed in pieces
    whole = {u: b for u, b in unit_bytes.items() if engine.replays(u) is None}
    largest = max(whole.items(), key=lambda kv: kv[1]) if whole else ((None, None), 0)
    layer_numel = max((t.numel() for k, t in job.state.items() if engine.unit_of[k][0] == "layer"), default=0)
    budget = engine.memory_budget or DEFAULT_BUDGET.get(job.device.type, DEFAULT_BUDGET["cuda"])
    scratch = 4 * NORMAL_CHUNK + 3 * min(4 * layer_numel, budget)
    queued = min(_MAX_QUEUED_BYTES, job.total_size)
    pieces = 2 * _PIECE_BYTES if len(whole) < len(units) else 0
    on_host = job.device.type == "cpu"
    # the queue, the pieces being drawn, a unit computed whole and one computed ahead, the layer
    # scratch, and the buffers of written tensors kept for reuse (those of the largest unit at most)
    peak = _current_rss() + queued + pieces + (2 * largest[1] + scratch if on_host else 0)
    if largest[0][0] is None:
        unit_name = None
    else:
        unit_name = largest[0][1] if largest[0][0] == "module" else engine.layers[largest[0][1]].name
    plan = WritePlan([(f, sizes[f], len(files[f])) for f in files], job.total_size, write_bytes, free, peak,
                     (unit_name, largest[1]), list(keep), len(units), len(units) - len(whole), _PIECE_BYTES,
                     {u[1]: why for u, why in engine.whole_why.items()})
    if measure:
        rates = _measure_rates(job)
        own = sum(t.numel() for k, t in job.state.items() if job.engine.unit_of[k][0] == "module")
        todo = {k for f in files if f not in keep for k in files[f]}
        frac = sum(_nbytes(job.state[k]) for k in todo) / max(job.total_size, 1)
        n_layers = sum(1 for u in units if u[0] == "layer")
        plan.rates = rates
        plan.estimated_seconds = frac * (own / rates["own_elements_per_s"] + n_layers * rates["layer_s"])
    return plan


def _run_write(job: _Job, jobs: list, progress: bool, desc: str) -> None:
    """Write ``jobs`` (``[(path, head, order)]``) in order: tensors computed here, written by a
    :class:`_Writer` thread, with the threads :func:`_compute_threads` gives (units computed whole
    on every core, pieces with one core left to the writer). SIGTERM in the main thread removes
    the file being written."""
    engine, state = job.engine, job.state
    todo = {k for _, _, order in jobs for k in order}
    ready: dict = {}       # computed tensors not yet handed to the writer
    done: set = set()

    def compute(key):
        if key not in ready:
            unit = engine.unit_of[key]
            with _compute_threads(job.device, leave_one=engine.replays(unit) is not None):
                tensors = engine.unit(unit)
            for k, t in tensors.items():
                if k in todo and k not in done:
                    ready[k] = t
        done.add(key)
        t = ready.pop(key)
        meta = state[key]
        if isinstance(t, _Replay):
            if t.dtype != meta.dtype or t.numel != meta.numel():
                raise RuntimeError(f"{key}: replayed {t.dtype} x {t.numel}, the header says {meta.dtype} "
                                   f"{tuple(meta.shape)}")
            return t
        if t.dtype != meta.dtype or tuple(t.shape) != tuple(meta.shape):
            raise RuntimeError(f"{key}: computed {t.dtype} {tuple(t.shape)}, the header says {meta.dtype} "
                               f"{tuple(meta.shape)}")
        return t.to("cpu").contiguous() if t.device.type != "cpu" else t.contiguous()

    def take(n: int, dtype: torch.dtype) -> torch.Tensor:
        if engine.pool is not None:
            return engine.pool.take((n,), dtype)
        return torch.empty(n, dtype=dtype, device=job.device)

    def put(item) -> None:
        if not isinstance(item, _Replay):
            writer.put(item)
            return
        with _compute_threads(job.device):
            for piece, buf in item.pieces(engine.seed, _PIECE_BYTES, take):
                if piece.device.type != "cpu":
                    writer.put(piece.to("cpu"))
                else:
                    writer.put(piece, buf)

    total = sum(_nbytes(state[k]) for k in todo)
    bar = _Progress(total, desc) if progress and total else None
    with _removing_temps_on_sigterm():
        writer = _Writer(bar, pool=engine.pool)
        try:
            for path, head, order in jobs:
                writer.begin(path, head)
                for k in order:
                    put(compute(k))
                writer.end()
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        finally:
            if bar is not None:
                bar.close()


def write_pretrained(model_or_config, out_dir, *, seed: int = 0, method: str = "auto", v_mode: str = "identity",
                     qk_gain: float = 1.0, v_gain: float = 1.0, dtype: Optional[torch.dtype] = None,
                     max_shard_size: Union[int, str] = "5GB", model_class=None, include=None, exclude=None,
                     strict: bool = False, memory_budget: Optional[int] = None, family: Optional[str] = None,
                     extra_metadata: Optional[dict] = None, progress: bool = False, device=None,
                     resume: bool = False, overwrite: bool = False, dry_run: bool = False) -> PretrainedWriteReport:
    """Write a ``from_pretrained``-ready model directory of the conditioned model, streamed (see module doc).

    Args:
        model_or_config: a ``transformers.PretrainedConfig`` (the model is built from it on meta:
            ``model_class``, else the config's ``architectures[0]``, else ``AutoModelForCausalLM`` for
            decoder language models and ``AutoModel`` otherwise), or a ``PreTrainedModel`` whose
            tensors are all on the meta device (left as it is, apart from ``dtype``).
        out_dir: the directory; created (in an existing directory) when missing.
        max_shard_size: bytes per weights file, an int or ``"5GB"`` / ``"500MB"`` / ``"2GiB"`` (as
            ``save_pretrained``; a bigger tensor gets a file of its own).
        resume: keep the planned shards already in ``out_dir`` that are complete (size and header
            exactly as this write gives them), write the rest.
        overwrite: write even when ``out_dir`` holds another model (its files of the same names are
            replaced, its other shards removed).
        seed: ``0 <= seed < 2**64``, for the conditioned Q/K (as ``condinit.apply(model, seed=seed)``)
            and the own init of everything else. Not drawn: the same call writes the same bytes.
        method, v_mode, qk_gain, v_gain, include, exclude, strict, memory_budget: as in
            :func:`condinit.apply`.
        dtype: storage dtype (``torch.bfloat16``, ...); default: the model's, or the config's
            ``dtype``, or float32.
        device: where tensors are computed (``"cpu"``, ``"cuda"``); they are written from the CPU.
        model_class: the transformers class to build a config with.
        family: the ``family`` field of the ``condinit`` metadata (default: the config's ``model_type``).
        extra_metadata: more fields for the ``condinit`` metadata (e.g. ``{"preset": ...}``).
        progress: a progress bar over the bytes written (tqdm; else a line every 10 s on stderr).
        dry_run: plan, check and measure only (``report.plan``); nothing is written.
    Returns:
        :class:`PretrainedWriteReport`.

    Raises:
        ValueError / TypeError: a bad argument, a model that is not all on meta, no attention layer,
            ``strict`` with uncovered modules, another model in ``out_dir`` (without ``overwrite``),
            too little free disk space; all before anything is written.

    Examples:
        >>> config = transformers.LlamaConfig(num_hidden_layers=32, hidden_size=4096, ...)
        >>> rep = write_pretrained(config, "llama-8b-cond/", seed=0, dtype=torch.bfloat16, max_shard_size="5GB")
        >>> model = transformers.AutoModelForCausalLM.from_pretrained("llama-8b-cond/")
        >>> rep = write_pretrained(config, "llama-8b-cond/", dtype=torch.bfloat16, resume=True)  # after a crash
    """
    t_start = time.perf_counter()
    limit = parse_shard_size(max_shard_size)
    progress = check_bool("progress", progress)
    resume = check_bool("resume", resume)
    overwrite = check_bool("overwrite", overwrite)
    dry_run = check_bool("dry_run", dry_run)
    out_dir = _check_out_dir(out_dir)
    job = _prepare(model_or_config, seed=seed, method=method, v_mode=v_mode, qk_gain=qk_gain, v_gain=v_gain,
                   dtype=dtype, model_class=model_class, include=include, exclude=exclude, strict=strict,
                   memory_budget=memory_budget, family=family, extra_metadata=extra_metadata, device=device)
    model, state, full_meta = job.model, job.state, job.full_meta
    files = _plan_files(state, limit)
    weight_map = {k: f for f, ks in files.items() for k in ks}
    paths = {f: check_output_path(os.path.join(out_dir, f)) if os.path.isdir(out_dir) else os.path.join(out_dir, f)
             for f in files}

    heads, orders, sizes = {}, {}, {}
    n = len(files)
    for i, (fname, keys) in enumerate(files.items()):
        inside = set(keys)
        meta = dict(full_meta)
        meta["layers"] = [ent for ent in full_meta["layers"]
                          if all(ent[p]["tensor"] in inside for p in ("q", "k", "v"))]
        meta["shard"] = [i + 1, n]
        heads[fname], orders[fname], sizes[fname] = _shard_header(
            keys, state, {"format": "pt", METADATA_KEY: _canonical_json(meta)})

    config = copy.deepcopy(model.config)
    config.dtype = str(next(iter(state.values())).dtype).split(".")[1] if state else None
    config.architectures = [type(model).__name__]
    config_text = config.to_json_string(use_diff=True)
    gen = getattr(model, "generation_config", None)
    gen_text = gen.to_json_string(use_diff=True) if gen is not None and callable(getattr(model, "can_generate", None)) \
        and model.can_generate() else None
    index_text = None
    if n > 1:
        index_text = _json_text({"metadata": {"total_parameters": job.num_parameters, "total_size": job.total_size,
                                              METADATA_KEY: full_meta}, "weight_map": weight_map})

    # refusals: nothing is written before these
    if not overwrite:
        why = _other_model(out_dir, config_text, full_meta, set(files))
        if why is not None:
            raise ValueError(f"out_dir {out_dir} already holds another model: {why}; pass overwrite=True "
                             f"(--overwrite) to replace it, or choose another directory")
    keep = [f for f in files if resume and _complete(paths[f], heads[f], sizes[f])]
    need = _needed_bytes(paths, sizes, set(keep)) + len(config_text) + len(index_text or "") + len(gen_text or "")
    free = _free_bytes(out_dir)
    if need > free:
        raise ValueError(f"not enough disk space for {out_dir}: the write needs {_fmt_bytes(need)} "
                         f"({len(files) - len(keep)} weights file(s)), the filesystem has {_fmt_bytes(free)} free")
    if dry_run:
        plan = _make_plan(job, files, heads, sizes, keep, free, need, measure=True)
        job.report.total_time_s = time.perf_counter() - t_start
        return PretrainedWriteReport(out_dir, [paths[f] for f in files], weight_map, job.total_size,
                                     job.num_parameters, job.report, job.report.total_time_s, plan=plan,
                                     kept=[paths[f] for f in keep], dry_run=True)
    plan = _make_plan(job, files, heads, sizes, keep, free, need, measure=False)

    # writing starts here
    os.makedirs(out_dir, exist_ok=True)
    for f in files:
        paths[f] = check_output_path(paths[f])
    for stale in (WEIGHTS_INDEX_NAME, WEIGHTS_NAME):   # never a loadable mix of old and new files
        path = os.path.join(out_dir, stale)
        if os.path.isfile(path) and stale not in files:
            os.unlink(path)
    _write_text(os.path.join(out_dir, CONFIG_NAME), config_text)
    if gen_text is not None:
        _write_text(os.path.join(out_dir, "generation_config.json"), gen_text)
    _run_write(job, [(paths[f], heads[f], orders[f]) for f in files if f not in keep], progress, "condinit write")
    if index_text is not None:
        _write_text(os.path.join(out_dir, WEIGHTS_INDEX_NAME), index_text)
    for name in os.listdir(out_dir):    # shards of an earlier write that this one did not replace
        if _SHARD_RE.match(name) and name not in files and os.path.isfile(os.path.join(out_dir, name)):
            os.unlink(os.path.join(out_dir, name))
    job.report.total_time_s = time.perf_counter() - t_start
    return PretrainedWriteReport(out_dir, [paths[f] for f in files], weight_map, job.total_size,
                                 job.num_parameters, job.report, job.report.total_time_s, plan=plan,
                                 kept=[paths[f] for f in keep])


def write_checkpoint(model_or_config, path, *, seed: int = 0, method: str = "auto", v_mode: str = "identity",
                     qk_gain: float = 1.0, v_gain: float = 1.0, dtype: Optional[torch.dtype] = None,
                     model_class=None, include=None, exclude=None, strict: bool = False,
                     memory_budget: Optional[int] = None, family: Optional[str] = None,
                     extra_metadata: Optional[dict] = None, progress: bool = False, device=None,
                     dry_run: bool = False) -> PretrainedWriteReport:
    """Write the conditioned model as one ``.safetensors`` file, streamed: the tensors of
    :func:`write_pretrained` (bit for bit, whatever its ``max_shard_size``), the ``condinit`` entry
    of every layer in the header; the file is replaced atomically.

    Args:
        path: the file.
        model_or_config, seed, method, v_mode, qk_gain, v_gain, dtype, device, model_class, include,
            exclude, strict, memory_budget, family, extra_metadata, progress, dry_run: as in
            :func:`write_pretrained`.
    Returns:
        :class:`PretrainedWriteReport` (``out_dir``: the file's directory).

    Examples:
        >>> rep = write_checkpoint(transformers.LlamaConfig(...), "llama.safetensors", dtype=torch.bfloat16)
    """
    t_start = time.perf_counter()
    progress = check_bool("progress", progress)
    dry_run = check_bool("dry_run", dry_run)
    path = check_output_path(path)
    job = _prepare(model_or_config, seed=seed, method=method, v_mode=v_mode, qk_gain=qk_gain, v_gain=v_gain,
                   dtype=dtype, model_class=model_class, include=include, exclude=exclude, strict=strict,
                   memory_budget=memory_budget, family=family, extra_metadata=extra_metadata, device=device)
    keys = list(job.state)
    name = os.path.basename(path)
    head, order, size = _shard_header(keys, job.state, {"format": "pt", METADATA_KEY: _canonical_json(job.full_meta)})
    need = _needed_bytes({name: path}, {name: size}, set())
    free = _free_bytes(path)
    if need > free:
        raise ValueError(f"not enough disk space for {path}: the write needs {_fmt_bytes(need)}, the filesystem "
                         f"has {_fmt_bytes(free)} free")
    plan = _make_plan(job, {name: keys}, {name: head}, {name: size}, [], free, need, measure=dry_run)
    if not dry_run:
        _run_write(job, [(path, head, order)], progress, "condinit write")
    job.report.total_time_s = time.perf_counter() - t_start
    return PretrainedWriteReport(os.path.dirname(path), [path], {k: name for k in keys}, job.total_size,
                                 job.num_parameters, job.report, job.report.total_time_s, plan=plan, dry_run=dry_run)
