"""The materializer: the tensors of a meta ``PreTrainedModel`` computed unit by unit with the model's
own init (and, for attention layers, condinit's conditioning), or replayed in pieces.

Units:

* an attention layer that condinit conditions (:class:`LayerUnit`: every tensor of the modules
  holding its Q/K/V weights and biases): those modules' own init, then the layer's plan executed
  by the engine behind :func:`condinit.apply` (``InitPlan`` / ``run_plan``), with the layer index
  :func:`condinit.models.discover` gives it in the whole model; the Q/K/V weights are bit for bit
  those of ``condinit.apply(model, seed=seed)`` on the whole model;
* any other module (:class:`ModuleUnit`): its direct parameters and persistent buffers, filled by
  the model's own init rule, ``_init_weights`` of the nearest ``PreTrainedModel`` above it (what
  ``initialize_weights`` dispatches), called on the module and then on each of its ancestors, in
  the order ``initialize_weights`` visits them (children before parents, so a parent's rescaling of
  a child wins, e.g. GPT-2's ``c_proj``); the rest of the model stays on meta, where init functions
  do nothing. Every ``normal_`` of the init on the unit's tensors is drawn as own-init normals
  (:func:`condinit.models.stream.streams.own_normal_`); torch's generator is seeded per unit.

**Pieces.** A module unit is first initialized on fresh *meta* tensors, every write recorded
(:class:`condinit.models.stream.recording.WriteRecorder`). When every tensor's writes are own-init
normals of the whole tensor and fills (``ones_`` / ``zeros_`` / ``constant_`` / ``fill_`` of the
whole tensor or of a contiguous part, e.g. an embedding's padding row), the unit is not
materialized: each tensor is a :class:`Replay`, drawn in pieces (the last write of the whole
tensor, its constructor's writes first where the init writes it only in part, then the fills after
it, restricted to the piece). Any other write (a draw from torch's generator, arithmetic on the
tensor, a copy, a write through a non-contiguous view), a tensor the init does not write whole, or
an init that fails on meta tensors (one that reads values) makes the unit computed whole.
"""
from __future__ import annotations

import collections.abc
import contextlib
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from condinit.init.plan import run_plan

from ..apply import AttentionLayer, covered_tensors, plan_blocks
from .recording import (FOLLOWED_INITS, ConstructorValue, ConstructorWrites, Fill, Normal, Write, WriteRecorder,
                        init_function_table, storage_key)
from .streams import OWN_INIT_BLOCK, own_normal_, seeded, unit_seed
from .tuning import tuning
from .writer import BufferPool

__all__ = ["Conditioning", "LayerUnit", "ModuleUnit", "Unit", "Owner", "OwnInit", "Replay", "Materializer",
           "compute_threads"]


@dataclass(frozen=True)
class LayerUnit:
    """An attention layer condinit conditions: the modules holding its Q/K/V weights and biases
    (``position``: its place in :attr:`Conditioning.layers`)."""

    position: int


@dataclass(frozen=True)
class ModuleUnit:
    """The direct parameters and persistent buffers of the module ``name``."""

    name: str


Unit = Union[LayerUnit, ModuleUnit]


class Owner(NamedTuple):
    """Where a state-dict tensor lives: the module (qualified name) and its attribute."""

    module: str
    attr: str


class OwnInit(NamedTuple):
    """A module's direct state-dict tensors after the model's own init (``{attr: tensor}``), and
    the keys of those it leaves uninitialized."""

    tensors: dict
    uninitialized: list


class Conditioning(NamedTuple):
    """How the attention layers of a :class:`Materializer` are conditioned (as by :func:`condinit.apply`)."""

    layers: Sequence[AttentionLayer]
    method: str
    v_mode: str
    qk_gain: float = 1.0
    v_gain: float = 1.0
    memory_budget: Optional[int] = None


@contextlib.contextmanager
def compute_threads(device: torch.device, leave_one: bool = True):
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


@dataclass
class Replay:
    """A state-dict tensor produced in pieces from the writes its init was recorded making: the
    last write of the whole tensor (``base``: own-init normals of ``key``, or a fill), then the
    ``fills`` of ranges after it, in order. Every piece holds exactly the elements the init
    computes (own-init normals are counter-based: any piece can be drawn alone)."""

    key: str
    numel: int
    dtype: torch.dtype
    base: Write
    fills: list

    @classmethod
    def from_writes(cls, key: str, meta: torch.Tensor, writes: list) -> Optional["Replay"]:
        n = meta.numel()
        whole = [i for i, w in enumerate(writes) if w.start == 0 and w.stop == n]
        if not whole:
            return None
        base, rest = writes[whole[-1]], writes[whole[-1] + 1:]
        if isinstance(base, Normal) and not meta.is_floating_point():
            return None
        if any(not isinstance(w, Fill) for w in rest):
            return None
        return cls(key, n, meta.dtype, base, list(rest))

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
        if isinstance(self.base, Normal):
            own_normal_(out, seed, self.key, self.base.mean, self.base.std, offset=a)
        else:
            out.fill_(self.base.value)
        for fill in self.fills:
            lo, hi = max(fill.start, a), min(fill.stop, b)
            if lo < hi:
                out[lo - a:hi - a].fill_(fill.value)


class Materializer:
    """Computes the tensors of a meta ``PreTrainedModel`` unit by unit (see module doc), on ``device``.

    ``state``: ``{key: meta tensor}``, the tensors to compute under their names (their own-init
    streams). ``conditioning``: the attention layers to condition (their units are
    :class:`LayerUnit`); ``skip``: more tensors left uninitialized and unchecked (the caller
    conditions them). ``constructed``: what the constructors wrote
    (:attr:`condinit.models.stream.recording.MetaBuild.constructed`). ``pool``: where CPU buffers
    come from. ``check``: a tensor the own init leaves uninitialized is found (NaN-filled and rerun).
    """

    def __init__(self, model, state: dict, seed: int, device: torch.device, *,
                 conditioning: Optional[Conditioning] = None, skip: Iterable[torch.Tensor] = (),
                 constructed: Optional[dict] = None, pool: Optional[BufferPool] = None, check: bool = True):
        from transformers import PreTrainedModel

        self.model, self.seed, self.device, self.conditioning, self.check = model, seed, device, conditioning, check
        # state-dict key -> what the constructors wrote, where known: a value, or writes that make a
        # Replay of the saved tensor
        self.constructed = {k: v for k, v in (constructed or {}).items() if k in state and
                            (isinstance(v, ConstructorValue) or Replay.from_writes(k, state[k], v.writes) is not None)}
        self.modules = dict(model.named_modules())
        self.state = state
        self.owner = {}     # key -> Owner
        for mname, mod in self.modules.items():
            prefix = f"{mname}." if mname else ""
            for attr in list(mod._parameters) + list(mod._buffers):
                if prefix + attr in state and prefix + attr not in self.owner:
                    self.owner[prefix + attr] = Owner(mname, attr)
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
        self.layers = list(conditioning.layers) if conditioning is not None else []
        self.covered = {id(t) for t in covered_tensors(self.layers)} | {id(t) for t in skip}
        layer_of_module = {}
        for pos, l in enumerate(self.layers):
            for _, proj in l.spec.projections():
                for t in (proj.weight, proj.bias):
                    if t is None:
                        continue
                    key = self.tensor_key.get(id(t))
                    if key is None:
                        raise ValueError(f"{l.name}: a Q/K/V tensor of this layer is not in the model's state dict")
                    layer_of_module[self.owner[key].module] = pos
        self.unit_of = {key: LayerUnit(layer_of_module[m]) if m in layer_of_module else ModuleUnit(m)
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
        self.init_table = init_function_table()
        self.pool = pool
        self._fresh: dict = {}     # storage (storage_key) -> (key, tensor) of the unit being initialized
        self._whole: set = set()   # keys a patched normal_ filled entirely
        self._recorder: Optional[WriteRecorder] = None
        self._replays: dict = {}   # module unit -> {key: Replay}, or None: materialized whole
        self.whole_why: dict = {}  # module unit materialized whole -> why it is not replayed

    def unit_name(self, unit: Unit) -> str:
        """The module (or attention layer) a unit stands for."""
        return unit.name if isinstance(unit, ModuleUnit) else self.layers[unit.position].name

    def unit_bytes(self, unit: Unit) -> int:
        """Bytes of the state-dict tensors of ``unit``."""
        total = 0
        for m in self.unit_modules[unit]:
            prefix = f"{m}." if m else ""
            mod = self.modules[m]
            for attr, t in list(mod._parameters.items()) + list(mod._buffers.items()):
                if t is not None and self.owner.get(prefix + attr) == (m, attr):
                    total += t.numel() * t.element_size()
        return total

    def _name_of(self, tensor: torch.Tensor) -> Optional[str]:
        """The stream name of a tensor handed to ``normal_``: a state-dict key of the unit being
        initialized, a view of one (named after its geometry), or None (anything else)."""
        if not self._fresh:
            return None
        hit = self._fresh.get(storage_key(tensor))
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
                if self._recorder is not None and name is not None and fname not in FOLLOWED_INITS:
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

    def _init_module(self, mname: str, fill: bool, recorder: Optional[WriteRecorder] = None) -> tuple[dict, list]:
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
        self._fresh = {storage_key(real): (prefix + attr, real.detach()) for attr, real in fresh.items()
                       if real.numel()}
        self._whole = set()
        if recorder is not None:
            recorder.watch(self._fresh)
        self._recorder = recorder
        try:
            # recording needs no seed: a random draw of torch's generator is a write it does not replay
            seeding = seeded(self.device, unit_seed(self.seed, mname)) if recorder is None else recorder
            with _swapped(mod, fresh), seeding, torch.no_grad(), self.guard(), self._own_normals():
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
        made = self.constructed[key]
        if isinstance(made, ConstructorValue):
            real.copy_(made.tensor.reshape(real.shape))
        else:
            Replay.from_writes(key, real, made.writes).write_into(real.view(-1), self.seed)

    def own_init(self, mname: str) -> OwnInit:
        """``mname``'s direct state-dict tensors after the model's own init.

        Floating tensors start uninitialized: when every one of them was filled whole by an init
        primitive, that is all. Otherwise (with ``check``) the init is run again (it is a pure
        function of the seed and the names) on NaN-filled tensors, and the keys of the tensors still
        holding a NaN (an integer one, its fill value) are returned: nothing may be written that the
        model's init did not write."""
        fresh, unsure = self._init_module(mname, fill=False)
        if not self.check:
            return OwnInit(fresh, [])
        floating_unsure = [k for k in unsure if self.state[k].is_floating_point()]
        if floating_unsure:
            fresh, unsure = self._init_module(mname, fill=True)
        prefix = f"{mname}." if mname else ""
        left = [prefix + attr for attr, real in fresh.items()
                if prefix + attr in unsure and _left_uninitialized(real.detach())]
        return OwnInit(fresh, left)

    def replays(self, unit: Unit) -> Optional[dict]:
        """``{key: Replay}`` for every state-dict tensor of a module ``unit`` whose init, run on
        fresh meta tensors, makes only writes a :class:`Replay` redoes (own-init normals and fills,
        the last whole write of each tensor first); None otherwise (and for attention layers, and
        for every unit unless :attr:`Tuning.replay_units`), when the unit is materialized whole
        (``whole_why[unit]`` says why). Recorded once per unit."""
        if not tuning().replay_units:
            return None
        if unit not in self._replays:
            self._replays[unit], why = self._record(unit)
            if why is not None:
                self.whole_why[unit] = why
        return self._replays[unit]

    def _record(self, unit: Unit) -> tuple:
        """``({key: Replay}, None)``, or ``(None, why not)``."""
        if not isinstance(unit, ModuleUnit):
            return None, None
        mname = unit.name
        recorder = WriteRecorder()
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
                out[key] = Replay(key, 0, t.dtype, Fill(0, 0, 0), [])
                continue
            writes = recorder.writes.get(key, [])
            replay = Replay.from_writes(key, t, writes)
            made = self.constructed.get(key)
            if replay is None and isinstance(made, ConstructorWrites):   # from the constructor's writes
                replay = Replay.from_writes(key, t, made.writes + writes)
            if replay is None:
                if isinstance(made, ConstructorValue):
                    return None, f"{key}: its value comes from its constructor (computed on the CPU)"
                return None, f"{key}: not written whole by own-init normals or a fill"
            out[key] = replay
        return out, None

    def unit(self, unit: Unit) -> dict:
        """``{key: tensor}`` for every state-dict tensor of ``unit``; a :class:`Replay` instead of
        the tensor for every tensor of a unit that :meth:`replays` replays.

        Raises:
            ValueError: a tensor that the model's own init leaves uninitialized.
        """
        replays = self.replays(unit)
        if replays is not None:
            return dict(replays)
        mnames = self.unit_modules[unit]
        own = {}
        for m in mnames:
            own[m], left = self.own_init(m)
            if left:
                raise ValueError(f"{left[0]}: the model's own init (_init_weights) leaves this tensor "
                                 f"uninitialized; write_pretrained cannot compute it")
        if isinstance(unit, LayerUnit):
            self._condition(unit, mnames, own)
        out = {}
        for m in mnames:
            prefix = f"{m}." if m else ""
            for attr, t in own[m].items():
                out[prefix + attr] = t.detach()
        return out

    def _condition(self, unit: LayerUnit, mnames: list, own: dict) -> None:
        """The layer's plan run on its modules' tensors ``own`` (``{module: {attr: tensor}}``)."""
        c = self.conditioning
        l = self.layers[unit.position]
        with contextlib.ExitStack() as stack:
            for m in mnames:
                stack.enter_context(_swapped(self.modules[m], own[m]))
            live = l.live()     # the carried description, reading the swapped-in tensors
            with torch.no_grad():
                plan, _ = plan_blocks([live], c.v_mode, measure_before=False, qk_gain=c.qk_gain, v_gain=c.v_gain)
                run_plan(plan, self.seed, c.method, memory_budget=c.memory_budget)
