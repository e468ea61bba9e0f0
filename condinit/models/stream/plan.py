"""What a streamed write will do, before it does it: its files, bytes, free space, peak memory,
units and (measured on this machine) generation time.
"""
from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from condinit.ops.orthogonalize.op import DEFAULT_BUDGET
from condinit.ops.random.op import NORMAL_CHUNK

from .materialize import LayerUnit, ModuleUnit, compute_threads
from .prepare import Job
from .ranks import assign
from .streams import own_normal_
from .tuning import tuning

__all__ = ["PlannedFile", "LargestUnit", "Rates", "RankShare", "WritePlan", "make_plan"]


class PlannedFile(NamedTuple):
    """A weights file a write plans: its name, its size in bytes, how many tensors it holds."""

    name: str
    size: int
    tensors: int


class RankShare(NamedTuple):
    """What one rank of a write does: its rank, the files it writes (names, in file order), their
    bytes, and its generation time estimated from the rates measured here (None unless measured)."""

    rank: int
    files: list
    bytes: int
    estimated_seconds: Optional[float] = None


class LargestUnit(NamedTuple):
    """The largest unit computed whole (a module or an attention layer; None if none) and its bytes."""

    name: Optional[str]
    bytes: int


class Rates(NamedTuple):
    """Generation rates measured on this machine: own-init elements per second (of ``dtype``, the
    model's main dtype, named as in ``"float32"``) and seconds per conditioned attention layer."""

    own_elements_per_s: float
    layer_s: float
    dtype: str


@dataclass
class WritePlan:
    """What a write will do (``dry_run=True`` computes only this): ``files`` as
    :class:`PlannedFile` in order (``keep``: the names a ``resume`` keeps), the bytes to write and
    on disk, the free space, the peak resident-memory estimate (this process now, plus the writer's
    queue, the pieces being drawn, the largest unit computed whole (``largest_unit``) and one
    computed ahead, and scratch), how many of the ``units`` are drawn in pieces of at most
    ``piece_bytes`` (``replayed_units``; ``whole_modules``: the other modules besides attention
    layers, each with why its init is not replayed), and the generation time estimated from rates
    measured on this machine (``rates``: :class:`Rates`; ``None`` unless measured). ``ranks``:
    each rank's share (:class:`RankShare`, one for one process; the files still to write given out by
    :func:`condinit.models.stream.ranks.assign`), each rank's estimate counting the own-init
    elements and the attention layers of its own files at these rates (so ``estimated_seconds``
    of a multi-rank plan is the slowest rank's). ``refusals``: what the write would refuse (a dry
    run plans it anyway), the messages the write raises."""

    files: list
    total_size: int
    write_bytes: int
    free_bytes: Optional[int]
    peak_memory_bytes: int
    largest_unit: LargestUnit
    keep: list = field(default_factory=list)
    units: int = 0
    replayed_units: int = 0
    piece_bytes: int = 0
    whole_modules: dict = field(default_factory=dict)
    rates: Optional[Rates] = None
    estimated_seconds: Optional[float] = None
    ranks: list = field(default_factory=list)
    refusals: list = field(default_factory=list)


def _current_rss() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _measure_rates(job: Job) -> Rates:
    """Generation rates on this machine, from a short run with the threads the write uses
    (:func:`compute_threads`): own-init elements per second (the model's main dtype) and seconds
    per conditioned attention layer (its first one, computed)."""
    dtypes = collections.Counter()
    for t in job.state.values():
        if t.is_floating_point():
            dtypes[t.dtype] += t.numel()
    dtype = dtypes.most_common(1)[0][0] if dtypes else torch.float32
    with compute_threads(job.device):
        probe = torch.empty(1 << 22, dtype=dtype, device=job.device)
        own_normal_(probe, 0, "rate probe")   # first call: allocations and kernel set-up
        t0 = time.perf_counter()
        own_normal_(probe, 0, "rate probe", std=0.02)
        if job.device.type == "cuda":
            torch.cuda.synchronize(job.device)
        own_rate = probe.numel() / max(time.perf_counter() - t0, 1e-9)
        del probe
    layer_units = [u for u in job.engine.unit_modules if isinstance(u, LayerUnit)]
    layer_s = 0.0
    if layer_units:
        with compute_threads(job.device, leave_one=False):
            t0 = time.perf_counter()
            job.engine.unit(layer_units[0])
            if job.device.type == "cuda":
                torch.cuda.synchronize(job.device)
            layer_s = time.perf_counter() - t0
    return Rates(own_elements_per_s=own_rate, layer_s=layer_s, dtype=str(dtype).replace("torch.", ""))


def make_plan(job: Job, files: dict, sizes: dict, keep: list, free: Optional[int], write_bytes: int,
              measure: bool, world: int = 1, refusals=()) -> WritePlan:
    """The :class:`WritePlan` of writing ``files`` (``{name: [keys]}``, ``sizes``: ``{name: bytes}``)
    but ``keep``, shared by ``world`` ranks; ``measure``: the rates and the time estimates too."""
    engine = job.engine
    units = engine.unit_modules
    unit_bytes = {u: engine.unit_bytes(u) for u in units}
    # computed whole: attention layers, and module units whose init is not replayed in pieces
    whole = {u: b for u, b in unit_bytes.items() if engine.replays(u) is None}
    largest_unit, largest_bytes = max(whole.items(), key=lambda kv: kv[1]) if whole else (None, 0)
    layer_numel = max((t.numel() for k, t in job.state.items() if isinstance(engine.unit_of[k], LayerUnit)),
                      default=0)
    budget = engine.conditioning.memory_budget or DEFAULT_BUDGET.get(job.device.type, DEFAULT_BUDGET["cuda"])
    scratch = 4 * NORMAL_CHUNK + 3 * min(4 * layer_numel, budget)
    piece_bytes = tuning().piece_bytes
    queued = min(tuning().max_queued_bytes, job.total_size)
    pieces = 2 * piece_bytes if len(whole) < len(units) else 0
    on_host = job.device.type == "cpu"
    # the queue, the pieces being drawn, a unit computed whole and one computed ahead, the layer
    # scratch, and the buffers of written tensors kept for reuse (those of the largest unit at most)
    peak = _current_rss() + queued + pieces + (2 * largest_bytes + scratch if on_host else 0)
    unit_name = None if largest_unit is None else engine.unit_name(largest_unit)
    plan = WritePlan([PlannedFile(f, sizes[f], len(files[f])) for f in files], job.total_size, write_bytes, free,
                     peak, LargestUnit(unit_name, largest_bytes), list(keep), len(units), len(units) - len(whole),
                     piece_bytes, {u.name: why for u, why in engine.whole_why.items()}, refusals=list(refusals))
    shares = assign({f: sizes[f] for f in files if f not in keep}, world)
    plan.ranks = [RankShare(r, names, sum(sizes[f] for f in names)) for r, names in enumerate(shares)]
    if measure:
        rates = _measure_rates(job)

        def seconds(names) -> float:   # the own-init elements and the attention layers of these files
            keys = [k for f in names for k in files[f]]
            own = sum(job.state[k].numel() for k in keys if isinstance(engine.unit_of[k], ModuleUnit))
            layers = {engine.unit_of[k] for k in keys if isinstance(engine.unit_of[k], LayerUnit)}
            return own / rates.own_elements_per_s + len(layers) * rates.layer_s

        plan.rates = rates
        plan.ranks = [s._replace(estimated_seconds=seconds(s.files)) for s in plan.ranks]
        plan.estimated_seconds = max(s.estimated_seconds for s in plan.ranks)
    return plan
