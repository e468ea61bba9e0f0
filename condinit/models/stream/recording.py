"""Dispatch-mode recorders: what a model's constructors write while it is built on the meta device,
and what its own init writes into a unit's fresh meta tensors.

**Constructor values.** ``from_config`` starts every tensor from what its module's constructor
wrote, and ``_init_weights`` overwrites what it covers; some tensors only a constructor sets (CLIP's
``logit_scale = nn.Parameter(torch.tensor(2.6592))``, a ``Conv1D``'s ``normal(0, 0.02)`` weight in
OpenAI-GPT, an activation's learned constants). So the meta model is built under a recorder
(:class:`BuildRecorder`, :func:`build_on_meta`): tensors of at most :data:`SMALL_NUMEL` elements are
computed on the CPU as well (torch's CPU generator seeded meanwhile: the same values for the same
seed), bigger ones get their creation (``zeros`` / ``ones`` / ``full``) and later fills and
whole-tensor ``normal_`` recorded, the normals then drawn as own-init normals of the tensor's name.

**Init writes.** :class:`WriteRecorder` records every write the model's init makes to the fresh
meta tensors of a unit: fills of contiguous ranges (:class:`Fill`) and own-init normals
(:class:`Normal`); any other write makes the tensor not replayable, with the reason.
"""
from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple, Union

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .streams import seeded

__all__ = ["SMALL_NUMEL", "FOLLOWED_INITS", "Fill", "Normal", "Write", "ConstructorValue", "ConstructorWrites",
           "Constructed", "MetaBuild", "BuildRecorder", "WriteRecorder", "build_on_meta", "storage_key",
           "written_tensors", "init_function_table"]

# The init primitives whose writes the recorders follow (through the operators they call); any
# other one on a recorded tensor makes it unknown (some do nothing on meta tensors)
FOLLOWED_INITS = ("normal_", "zeros_", "ones_", "constant_")
# torch.nn.init's primitives that return at once on a meta tensor
_META_NOOP_INITS = ("trunc_normal_", "dirac_", "orthogonal_", "sparse_")
# Tensors of at most this many elements are computed on the CPU alongside a meta build, so that the
# values only their constructors set are known (BuildRecorder)
SMALL_NUMEL = 1 << 16


class Fill(NamedTuple):
    """Elements ``start:stop`` (of the tensor's storage, row-major) set to ``value``."""

    start: int
    stop: int
    value: Union[bool, int, float]


class Normal(NamedTuple):
    """Elements ``start:stop`` set to ``mean + std * z``, ``z`` the tensor's own-init normals."""

    start: int
    stop: int
    mean: float
    std: float


Write = Union[Fill, Normal]


class ConstructorValue(NamedTuple):
    """A tensor's value as its constructors computed it (on the CPU, beside the meta build)."""

    tensor: torch.Tensor


class ConstructorWrites(NamedTuple):
    """The writes of a tensor's constructors, in order, the first covering the whole tensor."""

    writes: list


Constructed = Union[ConstructorValue, ConstructorWrites]


class MetaBuild(NamedTuple):
    """A model built on the meta device, and what its constructors wrote: ``{state-dict name:
    Constructed}`` for the tensors whose constructors' writes are known and cover every element."""

    model: nn.Module
    constructed: dict


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (shared by its views and ``.data``; meta tensors included)."""
    return t.untyped_storage()._cdata


def written_tensors(func, args, kwargs) -> list:
    """The tensors an operator writes: its arguments the schema marks written (``out=`` included)."""
    found = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            found += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return found


def init_function_table():
    """transformers' table of the torch init primitives its guarded ``init.*`` functions call
    (transformers >= 5), or None."""
    try:
        from transformers import initialization
    except ImportError:
        return None
    return getattr(initialization, "TORCH_INIT_FUNCTIONS", None)


def _whole_storage(t: torch.Tensor) -> bool:
    """``t`` is contiguous and spans its whole storage."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def build_on_meta(build: Callable[[], nn.Module], seed: int) -> MetaBuild:
    """``build()`` on the meta device under a :class:`BuildRecorder`, torch's CPU generator seeded
    with ``seed`` meanwhile: the model and what its constructors wrote.

    Examples:
        >>> built = build_on_meta(lambda: transformers.CLIPModel._from_config(config), seed=0)
        >>> built.constructed["logit_scale"]
        ConstructorValue(tensor=tensor(2.6592))
    """
    recorder = BuildRecorder()
    with seeded(torch.device("cpu"), seed), torch.device("meta"), recorder, _TensorLiterals(recorder), \
            recorder.unfollowed_inits():
        model = build()
    return MetaBuild(model, recorder.values(model))


class _TensorLiterals(TorchFunctionMode):
    """``torch.tensor`` / ``torch.as_tensor`` during a meta build (their data never reaches an
    operator a dispatch mode sees): the value is made on the CPU too, as the new tensor's shadow."""

    def __init__(self, recorder: "BuildRecorder"):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.tensor, torch.as_tensor) and isinstance(out, torch.Tensor) and out.is_meta \
                and out.numel() <= SMALL_NUMEL:
            try:
                self.recorder.adopt(out, func(*args, **{**kwargs, "device": "cpu"}))
            except Exception:   # not followed: the tensor's value stays unknown
                pass
        return out


class BuildRecorder(TorchDispatchMode):
    """What the constructors write into the tensors of a model built on the meta device: the values
    ``from_config`` starts from, which the model's ``_init_weights`` then overwrites (or, for a
    tensor only its constructor sets, e.g. CLIP's ``logit_scale`` or a ``Conv1D``'s normal weight,
    keeps).

    A storage of at most :data:`SMALL_NUMEL` elements gets a *shadow*: each operator on it runs on
    the CPU as well (torch's generator included; its ``empty`` holds NaN, or the integer minimum,
    which marks an element nobody wrote). A bigger one gets its writes recorded as
    :class:`WriteRecorder` records them (``zeros`` / ``ones`` / ``full`` / ``empty`` at creation,
    then fills of contiguous ranges and ``normal_`` of the whole tensor, which becomes own-init
    normals). Any other operator that creates or writes a storage makes it unknown."""

    _CREATE = {torch.ops.aten.zeros.default: 0, torch.ops.aten.ones.default: 1}

    def __init__(self):
        super().__init__()
        self.shadow: dict = {}    # storage key -> the storage's elements on the CPU (1-D)
        self.writes: dict = {}    # storage key -> [Write] (bigger storages)
        self.unknown: set = set()
        self._alive: list = []    # the storages seen, kept so that no key is reused meanwhile

    @contextlib.contextmanager
    def unfollowed_inits(self):
        """``torch.nn.init``'s primitives that do nothing on a meta tensor (no operator shows their
        write) make the tensor they are given unknown for the duration, in ``torch.nn.init`` and in
        transformers' table of them. (A model module that imported one by name is not reached.)"""
        def marking(original):
            def init_fn(tensor, *args, **kwargs):
                if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                    self._forget(tensor)
                return original(tensor, *args, **kwargs)
            return init_fn

        tables = [vars(torch.nn.init)] + [t for t in (init_function_table(),) if t is not None]
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
        if cpu.dtype != meta.dtype or cpu.shape != meta.shape or not cpu.is_contiguous() or not _whole_storage(meta):
            return
        self.shadow[self._track(meta)] = cpu.reshape(-1).clone()

    def _track(self, t: torch.Tensor) -> int:
        key = storage_key(t)
        self._alive.append(t.untyped_storage())
        return key

    def _forget(self, t: torch.Tensor) -> None:
        """What ``t``'s storage holds is not known."""
        key = self._track(t)
        self.shadow.pop(key, None)
        self.unknown.add(key)

    def _cpu(self, t: torch.Tensor):
        flat = self.shadow.get(storage_key(t))
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
        inputs = {storage_key(t) for t in flat_in if isinstance(t, torch.Tensor) and t.is_meta}
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_meta]
        created = [t for t in outs if storage_key(t) not in inputs]
        written = [t for t in written_tensors(func, args, kwargs) if t.is_meta]
        for t in created + written:
            self._track(t)
        small = all(t.untyped_storage().nbytes() <= SMALL_NUMEL * t.element_size() for t in created + written)
        shadowed = all(storage_key(t) in self.shadow for t in flat_in if isinstance(t, torch.Tensor) and t.is_meta)
        if small and shadowed:
            self._shadow(func, args, kwargs, out, created)
            return
        for t in written:
            key = storage_key(t)
            record = self.writes.get(key)
            if key in self.shadow or record is None:
                raise ValueError("a write this cannot follow")
            record.append(self._write_of(func, args, kwargs, t))
        for t in created:
            self.writes[storage_key(t)] = self._creation_of(func, args, t)

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
            self.shadow[storage_key(t)] = flat

    def _creation_of(self, func, args, t) -> list:
        if not _whole_storage(t):
            raise ValueError("a view")
        if func in self._CREATE:
            return [Fill(0, t.numel(), self._CREATE[func])]
        if func is torch.ops.aten.full.default:
            return [Fill(0, t.numel(), args[1])]
        if str(func).startswith(("aten.empty", "aten.new_empty")):
            return []
        raise ValueError("created by a computation")

    @staticmethod
    def _write_of(func, args, kwargs, t) -> Write:
        if not t.is_contiguous() or kwargs.get("generator") is not None:
            raise ValueError("a write through a strided view, or from a given generator")
        a, b = t.storage_offset(), t.storage_offset() + t.numel()
        if func is torch.ops.aten.zero_.default:
            return Fill(a, b, 0)
        if func is torch.ops.aten.fill_.Scalar:
            return Fill(a, b, args[1])
        if func is torch.ops.aten.normal_.default and a == 0 and b * t.element_size() == t.untyped_storage().nbytes() \
                and len(args) <= 3:
            return Normal(a, b, float(args[1]) if len(args) > 1 else 0.0, float(args[2]) if len(args) > 2 else 1.0)
        raise ValueError("another write")

    def values(self, model: nn.Module) -> dict:
        """``{state-dict name: Constructed}`` for the tensors whose constructors' writes are known and
        cover every element."""
        found = {}
        for name, t in list(model.named_parameters(remove_duplicate=False)) + \
                list(model.named_buffers(remove_duplicate=False)):
            if t is None or t.numel() == 0:
                continue
            if not t.is_meta:     # made on the CPU (a legacy constructor ignores the meta device)
                found[name] = ConstructorValue(t.detach().clone())
                continue
            key = storage_key(t)
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
                    found[name] = ConstructorWrites([Fill(0, flat.numel(), flat[0].item())])
                else:
                    found[name] = ConstructorValue(v)
            elif self.writes.get(key) and _whole_storage(t):
                writes = self.writes[key]
                if any(w.start == 0 and w.stop == t.numel() for w in writes):
                    found[name] = ConstructorWrites(list(writes))
        return found


class WriteRecorder(TorchDispatchMode):
    """Every write the model's init makes to the fresh meta tensors of a unit, in order.

    :meth:`watch` gets the tensors: ``{storage (storage_key): (state-dict key, base tensor)}``. A
    write (an operator argument the schema marks written, ``out=`` included) to one of them is
    recorded in ``writes[key]`` as a :class:`Fill` when it is ``fill_`` / ``zero_`` of a contiguous
    range of the tensor; own-init normals are recorded by :meth:`normal` (the init table's
    ``normal_`` calls it instead of drawing) as a :class:`Normal`. Any other write makes the tensor
    not replayable (``unsupported[key]``: why)."""

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
            if t.numel() and self.fresh.get(storage_key(t), (None,))[0] != key:
                self.unsupported.setdefault(key, "its storage was replaced (tensor.data = ...)")

    def _range(self, t: torch.Tensor, what: str):
        hit = self.fresh.get(storage_key(t))
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
        self.writes[key].append(Normal(span[0], span[1], float(mean), float(std)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in written_tensors(func, args, kwargs):
            key, span = self._range(t, str(func))
            if key is None or span is None:
                continue
            if func in self._FILLS and (func is torch.ops.aten.zero_.default or
                                        isinstance(args[1], (bool, int, float))):
                self.writes[key].append(Fill(span[0], span[1], args[1] if len(args) > 1 else 0))
            else:
                self.unsupported.setdefault(key, f"{func} writes it")
        return func(*args, **kwargs)
