"""A model-only torch.distributed.checkpoint (DCP) directory of a conditioned model: torchtitan's
seed checkpoint.

:func:`write_dcp` conditions the model in place (:func:`condinit.apply`, shard by shard for FSDP2 /
tensor-parallel DTensors) and saves ``model.state_dict()`` with
``torch.distributed.checkpoint.save``: every rank writes its own shards in parallel, and the
coordinator writes the ``.metadata`` file last. The keys are the model's own: for torchtitan's
models ``layers.{i}.attention.qkv_linear.wq.weight`` and so on (``FusedQKVLinear`` splits ``wqkv``
on save), which torchtitan's ``CheckpointManager`` reads at step 0 of a model-only checkpoint
(``--checkpoint.initial_load_path DIR``, ``initial_load_model_only``).

:func:`write_torchtitan_seed` (``condinit init --format dcp --torchtitan MODEL:FLAVOR``) builds
torchtitan's model from its own registry entry on every rank, FSDP2-sharded over all ranks, and
writes it the same way: each rank initializes, conditions and writes only its rows, and the
directory has the same bytes for any number of ranks.
"""
from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import torch
from torch import nn

from condinit.io.atomic import check_output_dir, fsync_dir, removed_on_sigterm, removing_temps_on_sigterm
from condinit.io.dirlock import LOCK_NAME, directory_lock

__all__ = ["write_dcp", "write_torchtitan_seed", "plan_torchtitan_seed", "save_torchtitan_state", "torchtitan_model",
           "TorchtitanModel", "SeedPlan", "SeedReport", "RankShare", "TORCHTITAN_INSTALL", "INIT_BLOCK_ELEMENTS"]


def write_dcp(model: nn.Module, out_dir, *, seed: int, **apply_kwargs):
    """Condition ``model`` (:func:`condinit.apply` with ``seed`` and ``apply_kwargs``) and write its
    state dict to the DCP directory ``out_dir``; returns the :class:`~condinit.models.ApplyReport`.

    Call it on every rank of an initialized process group (a collective, like
    ``torch.distributed.checkpoint.save``) or in a single process. ``out_dir`` must be an empty,
    writable directory or one that can be created; it is checked before anything is written. The
    model must hold values (after ``to_empty`` and its own init for a meta-built model, or a meta
    model that :func:`condinit.apply` materializes).

    Examples:
        >>> with torch.device("meta"):
        ...     model = Llama3Model.Config(...).build()
        >>> fully_shard(model, mesh=mesh); model.to_empty(device="cuda"); model.init_states()
        >>> write_dcp(model, "seed_ckpt/", seed=0)      # on every rank
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"write_dcp: model must be an nn.Module, got {type(model).__name__}")
    try:
        out_dir = check_empty_dir(out_dir)       # an empty directory, or one that can be created, writable
    except ValueError as exc:
        raise ValueError(f"write_dcp: {exc}") from None
    import torch.distributed.checkpoint as dcp

    from condinit.models.apply import apply

    report = apply(model, seed=seed, **apply_kwargs)
    dcp.save(model.state_dict(), checkpoint_id=out_dir)
    return report


# ---------------------------------------------------------------------------------------------------
# torchtitan seed checkpoints written by every rank: ``condinit init --format dcp --torchtitan ...``

TORCHTITAN_INSTALL = "pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring_parser"

# Row blocks of the rank-invariant own init: a block holds at least this many elements (whole rows)
# and is drawn from its own generator, so a rank draws only the blocks its rows touch
INIT_BLOCK_ELEMENTS = 1 << 20


class TorchtitanModel(NamedTuple):
    """A torchtitan registry entry: ``model`` (``torchtitan.models.<model>``), ``flavor`` and the
    model config its ``model_registry(flavor)`` gives (``config.build()`` builds the model)."""

    model: str
    flavor: str
    config: object

    @property
    def name(self) -> str:
        return f"{self.model}:{self.flavor}"


class RankShare(NamedTuple):
    """What one rank of a seed checkpoint holds and writes: its rank and its bytes of tensors."""

    rank: int
    bytes: int


class SeedPlan(NamedTuple):
    """What :func:`write_torchtitan_seed` would write (:func:`plan_torchtitan_seed`): the model, the
    number of parameters, the storage dtype, the bytes of the whole state dict, each rank's bytes
    (FSDP2's split of every tensor's rows), and the largest tensor whose init is drawn whole on
    every rank (name, float32 bytes; ``(None, 0)`` if none)."""

    model: TorchtitanModel
    num_parameters: int
    dtype: torch.dtype
    total_bytes: int
    ranks: list
    drawn_whole: tuple


class SeedReport(NamedTuple):
    """What :func:`write_torchtitan_seed` wrote: the directory, its plan, the conditioning report
    (:class:`~condinit.models.ApplyReport`), the seconds of the whole write on this rank, and every
    rank's peak resident memory in bytes (``ru_maxrss``, in rank order)."""

    out_dir: str
    plan: SeedPlan
    apply: object
    time_s: float
    peak_rss: list


def _import_torchtitan_models():
    try:
        import torchtitan.models as models
        from torchtitan.protocols.module import Module  # noqa: F401  (the init protocol used below)
    except ImportError as exc:
        raise ImportError(f"torchtitan is not importable ({exc}); install it with: {TORCHTITAN_INSTALL}") from exc
    return models


def torchtitan_model(spec: str) -> TorchtitanModel:
    """The torchtitan registry entry ``spec`` = ``"MODEL:FLAVOR"`` (``"llama3:8B"``): the package
    ``torchtitan.models.MODEL`` and its ``model_registry(FLAVOR)``. Nothing is built.

    Raises:
        ImportError: torchtitan is not installed (the message names the install line).
        ValueError: ``spec`` is not ``MODEL:FLAVOR``, or names a model or flavor torchtitan does
            not have (the message lists those it has).
    """
    import importlib
    import pkgutil

    if not isinstance(spec, str):
        raise TypeError(f"torchtitan model must be a str MODEL:FLAVOR, got {type(spec).__name__}")
    model, sep, flavor = spec.partition(":")
    if not sep or not model or not flavor:
        raise ValueError(f"torchtitan model {spec!r}: expected MODEL:FLAVOR, e.g. llama3:8B")
    models = _import_torchtitan_models()
    known = sorted(getattr(models, "_supported_models", None)     # torchtitan's own list of its models
                   or (m.name for m in pkgutil.iter_modules(models.__path__) if m.ispkg and m.name != "common"))
    if model not in known:
        raise ValueError(f"torchtitan model {spec!r}: torchtitan has no model {model!r}; it has {', '.join(known)}")
    try:
        mod = importlib.import_module(f"torchtitan.models.{model}")
    except ImportError as exc:
        raise ImportError(f"torchtitan model {spec!r}: importing torchtitan.models.{model} failed ({exc}); "
                          f"torchtitan is installed as: {TORCHTITAN_INSTALL}") from exc
    registry = getattr(mod, "model_registry", None)
    if not callable(registry):
        raise ValueError(f"torchtitan model {spec!r}: torchtitan.models.{model} has no model_registry")
    flavors = [k for name, table in vars(mod).items() if name.endswith("_configs") and isinstance(table, dict)
               for k in table]
    if flavor not in flavors:
        raise ValueError(f"torchtitan model {spec!r}: unknown flavor {flavor!r}; torchtitan's {model} flavors: "
                         f"{', '.join(flavors)}")
    return TorchtitanModel(model, flavor, registry(flavor).model)


def _build_on_meta(tt: TorchtitanModel, dtype: torch.dtype) -> nn.Module:
    """The model on the meta device, its floating parameters cast to ``dtype`` (buffers, e.g. the
    complex RoPE cache, keep theirs; a tied parameter stays one)."""
    with torch.device("meta"):
        model = tt.config.build()
    cast: dict = {}
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if p.is_floating_point() and p.dtype != dtype:
                if id(p) not in cast:
                    cast[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                setattr(mod, name, cast[id(p)])
    return model


def _init_kind(fn) -> str:
    """How an init function of a torchtitan ``param_init`` table is drawn rank-invariantly:
    ``"skip"`` (torchtitan's ``skip_param_init``: a tied weight), ``"fill"`` (``zeros_`` /
    ``ones_`` / ``constant_``: no draw, applied to the local part), ``"rows"`` (``normal_`` /
    ``trunc_normal_`` / ``uniform_``: elementwise i.i.d., drawn in row blocks with its
    ``generator``), ``"whole"`` (anything else: drawn on the whole tensor)."""
    import functools

    from torchtitan.models.common.param_init import skip_param_init

    init = torch.nn.init
    base, plain = fn, True
    if isinstance(fn, functools.partial):
        base, plain = fn.func, not fn.args and "generator" not in fn.keywords
    if base is skip_param_init:
        return "skip"
    if plain and base in (init.zeros_, init.ones_, init.constant_):
        return "fill"
    if plain and base in (init.normal_, init.trunc_normal_, init.uniform_):
        return "rows"
    return "whole"


def _param_tables(model: nn.Module) -> list:
    """``[(module, prefix)]``: the torchtitan modules holding parameters, each parameter covered by
    its module's ``param_init`` table (checked on the meta model: ValueError naming the first
    parameter torchtitan would not initialize by such a table)."""
    from torchtitan.protocols.module import Module

    tables = []
    for prefix, mod in model.named_modules():
        own = [n for n, _ in mod.named_parameters(recurse=False)]
        if not own:
            continue
        where = f"{prefix}.{own[0]}" if prefix else own[0]
        if not isinstance(mod, Module):
            raise ValueError(f"parameter {where}: its module ({type(mod).__name__}) is not a torchtitan Module, so "
                             f"torchtitan's init_states() does not initialize it")
        table = mod._param_init
        if table is None or any(n not in table for n in own):
            raise ValueError(f"parameter {where}: {type(mod).__name__} has no param_init entry for it (its "
                             f"reset_parameters() draws from torch's generator, which repeats on every rank's "
                             f"shard on the CPU); not supported")
        tables.append((mod, prefix))
    return tables


def _rank_invariant(fn, name: str, seed: int):
    """``fn`` (one ``param_init`` entry of parameter ``name``) drawn as a function of ``seed`` and
    ``name`` only, whatever the rank holds (see :func:`write_torchtitan_seed`)."""
    from condinit.models.sharded import local_part
    from condinit.models.stream.streams import seeded, unit_seed

    kind = _init_kind(fn)

    def init(param):
        if kind == "skip":
            return fn(param)
        local, offset, shape = local_part(param, name)
        if kind == "fill":
            fn(local)
            return
        if local.numel() == 0:
            return
        work = torch.promote_types(local.dtype, torch.float32)
        if kind == "rows" and local.dim() >= 1 and tuple(local.shape[1:]) == tuple(shape[1:]):
            per_row = max(1, local[0].numel())
            rows = max(1, INIT_BLOCK_ELEMENTS // per_row)
            first, n = offset[0], local.shape[0]
            for b in range(first // rows, -(-(first + n) // rows)):
                a, e = b * rows, min((b + 1) * rows, shape[0])
                g = torch.Generator(device=local.device)
                g.manual_seed(unit_seed(seed, f"torchtitan init\0{name}\0rows {a}"))
                block = torch.empty((e - a, *shape[1:]), dtype=work, device=local.device)
                fn(block, generator=g)
                lo, hi = max(a, first), min(e, first + n)
                local[lo - first:hi - first].copy_(block[lo - a:hi - a])
            return
        whole = torch.empty(shape, dtype=work, device=local.device)
        with seeded(local.device, unit_seed(seed, f"torchtitan init\0{name}")):
            fn(whole)
        local.copy_(whole[tuple(slice(o, o + s) for o, s in zip(offset, local.shape))])

    return init


def _init_states(model: nn.Module, tables: list, seed: int) -> None:
    """torchtitan's ``init_states()`` (buffers, weight tying, every ``param_init`` function), with
    each parameter's init function drawn rank-invariantly (:func:`_rank_invariant`). When the model
    has no persistent buffer, its buffers (RoPE caches: not saved, one per layer, e.g. 2 GB for
    Llama 3 8B) are computed on the meta device (``buffer_device``) and then allocated on the CPU
    uninitialized, never written or read, so their pages take no resident memory."""
    saved_buffers = any(name not in mod._non_persistent_buffers_set
                        for mod in model.modules() for name, _ in mod.named_buffers(recurse=False))
    buffer_device = None if saved_buffers else torch.device("meta")
    saved = [(mod, mod.__dict__.get("_param_init", _MISSING)) for mod, _ in tables]
    try:
        for mod, prefix in tables:
            mod._param_init = {n: _rank_invariant(fn, f"{prefix}.{n}" if prefix else n, seed)
                               for n, fn in mod._param_init.items()}
        with torch.no_grad():
            model.init_states(buffer_device=buffer_device)
        for mod in model.modules():
            for name, b in list(mod.named_buffers(recurse=False)):
                if b is not None and b.is_meta:
                    mod.register_buffer(name, torch.empty(b.shape, dtype=b.dtype, device="cpu"), persistent=False)
    finally:
        for mod, table in saved:
            if table is _MISSING:
                del mod._param_init
            else:
                mod._param_init = table


_MISSING = object()


def _rows_of(rows: int, world: int, rank: int) -> int:
    """The rows of dim 0 that rank ``rank`` of ``world`` holds under FSDP2 (``torch.chunk``)."""
    chunk = -(-rows // world)
    return max(0, min(chunk, rows - rank * chunk))


def _plan(tt: TorchtitanModel, model: nn.Module, tables: list, world: int, dtype: torch.dtype) -> SeedPlan:
    state = _saved_tensors(model)       # a fused wqkv is written as its rows of wq / wk / wv
    shares = []
    for r in range(world):
        total = 0
        for t in state.values():
            if t.dim() == 0:
                total += t.element_size() if r == 0 else 0
            else:
                total += _rows_of(t.shape[0], world, r) * (t.numel() // t.shape[0]) * t.element_size()
        shares.append(RankShare(r, total))
    whole = (None, 0)
    for mod, prefix in tables:
        for n, p in mod.named_parameters(recurse=False):
            if _init_kind(mod._param_init[n]) == "whole" and p.numel() * 4 > whole[1]:
                whole = (f"{prefix}.{n}" if prefix else n, p.numel() * 4)
    params = sum(p.numel() for p in model.parameters())
    return SeedPlan(tt, params, dtype, sum(t.numel() * t.element_size() for t in state.values()), shares, whole)


FUSED_QKV = "torchtitan.models.common.attention.FusedQKVLinear"


def _saved_tensors(model: nn.Module) -> dict:
    """``{state-dict name: tensor}`` as ``model.state_dict()`` names them, without its hooks: every
    parameter and persistent buffer under every name (a tied one under each); a fused ``wqkv``
    under its own name here (:func:`_save_items` writes it as torchtitan's stock wq / wk / wv)."""
    state = {}
    for prefix, mod in model.named_modules(remove_duplicate=False):
        head = f"{prefix}." if prefix else ""
        for name, p in mod.named_parameters(recurse=False):
            state[head + name] = p.detach()
        for name, b in mod.named_buffers(recurse=False):
            if name not in mod._non_persistent_buffers_set:
                state[head + name] = b
    return state


def _fused_qkv_modules(model: nn.Module) -> list:
    """``[(prefix, module)]``: torchtitan's ``FusedQKVLinear`` modules (by dotted class name)."""
    return [(prefix, m) for prefix, m in model.named_modules()
            if f"{type(m).__module__}.{type(m).__qualname__}" == FUSED_QKV]


def _save_items(model: nn.Module) -> tuple:
    """``(state, pieces)`` for ``dcp.save``: ``state`` the tensors written as they are (this rank's
    DTensor shards, or plain tensors), ``pieces`` ``{name: (global shape, [(first row, local
    rows)])}``: each fused ``wqkv`` written under torchtitan's stock keys ``wq`` / ``wk`` / ``wv``
    (what its ``state_dict`` post-hook saves and its pre-hook merges on load), each rank its own
    rows of them, cut from its rows of ``wqkv`` (per key/value group: ``H/H_kv`` query heads, one
    key head, one value head). torchtitan's hook would gather every layer's whole ``wqkv`` on every
    rank first."""
    from condinit.models.sharded import local_part

    state = _saved_tensors(model)
    pieces: dict = {}
    for prefix, mod in _fused_qkv_modules(model):
        hd, hpk, r = mod.head_dim, mod.heads_per_kv, mod.r_dim
        head = f"{prefix}." if prefix else ""
        for param in ("weight", "bias"):
            key = f"{head}wqkv.{param}"
            if key not in state:
                continue
            local, offset, shape = local_part(state.pop(key), key)
            if any(offset[1:]) or tuple(local.shape[1:]) != tuple(shape[1:]):
                raise ValueError(f"{key}: only rows of it may be local to a rank (FSDP2's Shard(0)), got "
                                 f"offset {tuple(offset)} shape {tuple(local.shape)} of {tuple(shape)}")
            n_kv, tail = shape[0] // (r * hd), tuple(shape[1:])
            parts = (("wq", 0, hpk * hd), ("wk", hpk * hd, hd), ("wv", (hpk + 1) * hd, hd))
            for name, _, rows in parts:
                pieces[f"{head}{name}.{param}"] = ((n_kv * rows, *tail), [])
            a, b = offset[0], offset[0] + local.shape[0]
            for g in range(a // (r * hd), -(-b // (r * hd))):
                for name, start, rows in parts:
                    lo, hi = max(g * r * hd + start, a), min(g * r * hd + start + rows, b)
                    if lo < hi:
                        pieces[f"{head}{name}.{param}"][1].append(
                            (g * rows + lo - g * r * hd - start, local[lo - a:hi - a]))
    return state, pieces


def save_torchtitan_state(model: nn.Module, checkpoint_id, *, no_dist: bool = False) -> None:
    """``dcp.save`` of ``model`` into ``checkpoint_id`` in torchtitan's stock state-dict layout, with
    nothing gathered: every tensor as this rank holds it, each fused ``wqkv`` as this rank's rows of
    ``wq`` / ``wk`` / ``wv`` (:func:`_save_items`, :func:`_pieces_planner`)."""
    import torch.distributed.checkpoint as dcp

    state, pieces = _save_items(model)
    dcp.save(state, checkpoint_id=checkpoint_id, planner=_pieces_planner(pieces), no_dist=no_dist)


def _check_layout(tt: TorchtitanModel, meta: nn.Module) -> None:
    """On the meta model, before anything is allocated: the blocks ``fully_shard`` wraps are in
    ``model.layers``, and :func:`_save_items` gives the keys and shapes of torchtitan's own
    ``state_dict()`` (ValueError otherwise)."""
    if not isinstance(getattr(meta, "layers", None), nn.ModuleDict):
        raise ValueError(f"torchtitan {tt.name}: the model has no ModuleDict `layers` of blocks to fully_shard")
    state, pieces = _save_items(meta)
    mine = {**{k: tuple(v.shape) for k, v in state.items()}, **{k: size for k, (size, _) in pieces.items()}}
    theirs = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    if mine != theirs:
        raise ValueError(f"torchtitan {tt.name}: its state dict's keys or shapes are not those condinit writes "
                         f"(differing: {sorted(set(mine.items()) ^ set(theirs.items()))[:4]}); not supported")


def _pieces_planner(pieces: dict):
    """torch.distributed.checkpoint's default save planner plus one write item per piece (its rows
    at their global offset): the pieces of all ranks make up each tensor, as DCP checks."""
    import dataclasses

    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    class PiecesPlanner(DefaultSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            items, self._pieces = [], {}
            for fqn, (size, parts) in pieces.items():
                self.mappings.setdefault(fqn, (fqn,))
                for row, t in parts:
                    offsets = torch.Size([row] + [0] * (len(size) - 1))
                    self._pieces[(fqn, tuple(offsets))] = t
                    items.append(WriteItem(
                        index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.size()),
                                                    properties=TensorProperties.create_from_tensor(t),
                                                    size=torch.Size(size))))
            self.plan = dataclasses.replace(plan, items=plan.items + items,
                                            planner_data=self.mappings if self.flatten_state_dict else None)
            return self.plan

        def lookup_object(self, index):
            if index.fqn in pieces:
                return self._pieces[(index.fqn, tuple(index.offset))]
            return super().lookup_object(index)

    return PiecesPlanner()


def _check_dtype(dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return dtype


def plan_torchtitan_seed(model: str, world: int = 1, *, dtype: torch.dtype = torch.float32) -> SeedPlan:
    """What :func:`write_torchtitan_seed` for ``model`` (``"MODEL:FLAVOR"``) would write over
    ``world`` ranks: built on the meta device, nothing allocated or written."""
    from condinit._validate import check_int

    world = check_int("world", world, min=1)
    dtype = _check_dtype(dtype)
    tt = torchtitan_model(model)
    meta = _build_on_meta(tt, dtype)
    return _plan(tt, meta, _param_tables(meta), world, dtype)


def check_empty_dir(out_dir) -> str:
    """``out_dir`` as an absolute path, symlinks resolved (the files are moved into the directory
    it names): an empty directory (its writers' lock file aside), or one that can be created,
    writable (a ValueError otherwise)."""
    try:
        out_dir = os.path.realpath(check_output_dir(out_dir))
    except ValueError as exc:
        raise ValueError(f"out_dir: {exc}") from None
    if os.path.isdir(out_dir) and set(os.listdir(out_dir)) - {LOCK_NAME}:
        raise ValueError(f"out_dir {out_dir} is not empty (a DCP directory is written whole)")
    return out_dir


def _locked_empty_dir(out_dir, held: contextlib.ExitStack) -> str:
    """Rank 0's start of a write: ``out_dir`` checked (:func:`check_empty_dir`), made if absent
    (removed again if the write fails), locked for the write (the lock entered into ``held``:
    released on exit and on SIGTERM) and checked empty again under the lock."""
    out_dir = check_empty_dir(out_dir)
    if not os.path.isdir(out_dir):
        os.makedirs(out_dir)
        held.callback(_remove_if_empty, out_dir)     # after the lock's release: a failed write leaves nothing
    held.enter_context(removing_temps_on_sigterm())
    held.enter_context(directory_lock(out_dir))
    return check_empty_dir(out_dir)


def _remove_if_empty(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _move_into(tmp_dir: str, out_dir: str) -> None:
    """Every file of the complete DCP directory ``tmp_dir`` moved into the empty, locked ``out_dir``,
    ``.metadata`` last (the checkpoint loads from then on); ``tmp_dir`` removed. A failed move takes
    back the files already moved."""
    names = sorted(os.listdir(tmp_dir), key=lambda name: name == ".metadata")
    moved = []
    try:
        for name in names:
            os.rename(os.path.join(tmp_dir, name), os.path.join(out_dir, name))
            moved.append(os.path.join(out_dir, name))
    except BaseException:
        for path in moved:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    os.rmdir(tmp_dir)
    fsync_dir(out_dir)  # make the moves durable


def write_torchtitan_seed(model: str, out_dir, *, seed: int, dtype: torch.dtype = torch.float32,
                          **apply_kwargs) -> SeedReport:
    """torchtitan's model ``model`` (``"MODEL:FLAVOR"``, its own registry entry, e.g.
    ``"llama3:8B"``) with conditioned attention, as a model-only DCP seed checkpoint in ``out_dir``,
    written by every rank of the default process group in parallel (or by one process).

    Every rank builds the model on the meta device (cast to ``dtype`` there), ``fully_shard`` s
    every block of ``model.layers`` and the root over a 1-D mesh of all ranks (none with one
    process), ``to_empty`` on the CPU, runs torchtitan's ``init_states()`` (its buffers, weight
    tying and every parameter's ``param_init`` function), :func:`condinit.apply` (``seed``,
    ``apply_kwargs``) and ``torch.distributed.checkpoint.save``: each rank holds and writes its rows
    of every tensor, about 1/world of the model.

    **Rank-invariant init.** On a CPU mesh DTensor has no offset-tracked generator: each rank draws
    its shard from its own generator, so with equal seeds every rank's shard gets the same values.
    So each ``param_init`` function runs on plain tensors instead: ``normal_`` / ``trunc_normal_`` /
    ``uniform_`` (elementwise i.i.d.) on blocks of whole rows of at least ``INIT_BLOCK_ELEMENTS``
    elements, each block with its own generator seeded from ``seed``, the parameter's name and the
    block's first row (a rank draws only the blocks its rows touch, one block at a time); fills
    (``zeros_`` / ``ones_`` / ``constant_``) on the local part; any other function (torchtitan's
    fused-``wqkv`` init, which draws q, k, v whole) on the whole tensor, torch's generator seeded from
    ``seed`` and the name, each rank keeping its rows. Draws are in float32 (or the parameter's
    wider dtype) and rounded once to ``dtype``. The checkpoint therefore has the same bytes for every
    number of ranks; its values are torchtitan's init functions' draws, not those of a
    single-process ``init_states()`` with ``torch.manual_seed``.

    Peak memory per rank: its shard of the model in ``dtype``, plus one row block, plus the largest
    tensor drawn whole (float32, transient; :attr:`SeedPlan.drawn_whole`), plus what
    :func:`condinit.apply` generates per head block.

    ``out_dir`` (symlinks resolved) must be empty or absent (checked on rank 0 before anything is
    built). Rank 0 makes it and holds its writers' lock (:func:`condinit.io.dirlock.directory_lock`,
    the one ``condinit init --out DIR/`` takes) from that check to the end, for the whole job: a
    second writer is refused naming this one's PID and host. The tensors are written into a
    temporary sibling directory whose files rank 0 moves into ``out_dir`` once ``dcp.save`` has
    finished (``.metadata`` last), so a failed write leaves no partial checkpoint under
    ``out_dir``. Loads with ``dcp.load`` into the model torchtitan builds, sharded
    any way or not at all (torchtitan: ``--checkpoint.initial_load_path DIR``, model only).

    Raises:
        ImportError: torchtitan is not installed (naming the install line).
        ValueError: an unknown model or flavor, ``out_dir`` not empty or being written by another
            process (:class:`~condinit.io.dirlock.DirectoryLocked`), a parameter torchtitan's
            ``param_init`` tables do not cover; on every rank, before anything is written.
    """
    import resource
    import shutil
    import time
    import uuid
    import warnings

    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    from condinit._validate import check_seed
    from condinit.models.apply import apply
    from condinit.models.stream.ranks import decided, ranks_of

    start = time.perf_counter()
    seed = check_seed("seed", seed)
    dtype = _check_dtype(dtype)
    ranks = ranks_of()
    with contextlib.ExitStack() as held:    # rank 0 holds the directory's lock for the whole job
        error, target = None, None
        if ranks.rank == 0:
            try:
                target = _locked_empty_dir(out_dir, held)
                parent, base = os.path.split(target)
                target = (target, os.path.join(parent, f".{base}.condinit-partial-{uuid.uuid4().hex[:12]}"))
                held.enter_context(removed_on_sigterm(target[1]))
            except (ValueError, OSError) as exc:
                error = exc
        out_dir, tmp_dir = decided(ranks, target, error)
        tt = torchtitan_model(model)
        meta = _build_on_meta(tt, dtype)
        tables = _param_tables(meta)
        plan = _plan(tt, meta, tables, ranks.size, dtype)
        _check_layout(tt, meta)
        if ranks.size > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (ranks.size,))
            for block in meta.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(meta, mesh=mesh)
        net = meta.to_empty(device="cpu")
        _init_states(net, tables, seed)
        report = apply(net, seed=seed, **apply_kwargs)
        done = False
        try:
            with warnings.catch_warnings():   # one process: dcp.save says it assumes so, as intended
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                try:
                    save_torchtitan_state(net, tmp_dir, no_dist=ranks.size == 1)
                except CheckpointException as exc:      # a BaseException: the first failed rank's own error instead
                    rank, (first, _) = min(exc.failures.items(), key=lambda kv: kv[0])
                    if not isinstance(first, Exception):
                        raise
                    first.add_note(f"rank {rank} of {ranks.size}, in torch.distributed.checkpoint.save; nothing "
                                   f"written to {out_dir}")
                    raise first from exc
            if ranks.size > 1:
                dist.barrier()
            if ranks.rank == 0:
                _move_into(tmp_dir, out_dir)     # into the empty directory this job holds locked
            done = True
        finally:
            if not done and ranks.rank == 0:
                shutil.rmtree(tmp_dir, ignore_errors=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peaks = [peak]
    if ranks.size > 1:
        peaks = [None] * ranks.size
        dist.all_gather_object(peaks, peak)
    return SeedReport(out_dir, plan, report, time.perf_counter() - start, peaks)
