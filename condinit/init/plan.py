"""The one planner and executor behind every initialization: an :class:`InitPlan` lists what a call
writes (random head blocks, rectangular identities, zeros), :func:`run_plan` writes it.

Call path. The public functions (``semi_orthogonal_``, ``conditioned_init_``,
``conditioned_init_layers_`` in ``condinit/init/functional.py``, ``apply`` in
``condinit/models/apply.py``, the streamed writer in ``condinit/models/stream/``) validate their
arguments, draw the seed and list what they write in an :class:`InitPlan` (``add_heads``: Q/K head
blocks, ``add_identity``: V, ``add_zero``: biases; ``apply`` passes each projection's local region,
which is all sharding needs). :func:`run_plan` is the one executor: per group of same-shaped blocks
:func:`run_group` calls ``run_chunks`` (``condinit/ops/orthogonalize/op.py``), which picks the
``ORTHOGONALIZE`` table's backend once (``ORTHOGONALIZE.choose``) to run every chunk: ``fill`` draws
its Gaussians through the ``RANDN`` table (``condinit/ops/random/``, ``RANDN.choose`` once per group),
the chunk is orthonormalized, and ``sink`` rounds each result once into its weight's dtype, in
place. V is written by :func:`rect_identity_region_`, the helper behind ``rect_identity_``.

All same-shaped blocks of all layers are processed in chunks of ``memory_budget`` bytes of fp32
scratch: one batched generate + orthogonalize per chunk, each result written once (fp32 compute,
rounded once into the weight's dtype) into the weights' own memory. Every group's backends are
chosen (``BackendUnavailableError`` when a forced one cannot run it) before the first write.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Hashable, NamedTuple, Optional, Sequence

import torch

from condinit.ops.orthogonalize.op import ORTHOGONALIZE, resolve_method, run_chunks
from condinit.ops.random.op import RANDN

__all__ = ["BlockRun", "IdentityWrite", "ZeroWrite", "InitPlan", "Observer", "PlanResult", "run_plan", "run_group",
           "rect_identity_region_"]


@dataclass
class BlockRun:
    """Consecutive blocks ``ids`` of ``stream`` and where their results go.

    Blocks have the logical shape ``[d, n]``; ``tall`` (``d > n``) blocks are generated as their
    wide transpose. Without ``window``, ``dest`` is a ``[k, wm, wn]`` view in the wide orientation
    (a transposed view for tall blocks) that receives every block whole. With ``window = (row_lo,
    row_hi, col_lo, col_hi)``, ``dest`` is a ``[row_hi - row_lo, col_hi - col_lo]`` view receiving
    those rows and columns of the run's logical ``[k * d, n]`` matrix (its blocks stacked): the
    local part of a sharded projection.
    """
    stream: int
    ids: torch.Tensor
    dest: torch.Tensor
    tall: bool
    gain: float = 1.0
    window: Optional[tuple[int, int, int, int]] = None
    owner: Optional[Hashable] = None


class IdentityWrite(NamedTuple):
    """``region`` aliases rows ``row_lo:`` and columns ``col_lo:`` of ``gain`` times a rectangular
    identity (per head of ``head_dim`` rows when given)."""
    region: torch.Tensor
    row_lo: int
    col_lo: int
    head_dim: Optional[int]
    gain: float
    owner: Optional[Hashable]


class ZeroWrite(NamedTuple):
    """``tensor`` is zeroed (a bias)."""
    tensor: torch.Tensor
    owner: Optional[Hashable]


class PlanResult(NamedTuple):
    """What :func:`run_plan` did: ``chunks`` run, and ``seconds`` of execution per plan owner."""
    chunks: int
    seconds: dict


class InitPlan:
    """What one initialization call writes: random head blocks, rectangular identities and zeros.

    Built by the public functions (and ``condinit.apply``) after validation, run by :func:`run_plan`.
    ``owner`` (any hashable, e.g. a layer number) attributes execution time. Meta tensors are
    skipped. Not part of the public API.
    """

    def __init__(self):
        self.groups: dict[tuple, list[BlockRun]] = {}     # (device, wide block shape) -> runs
        self.identities: list[IdentityWrite] = []
        self.zeros: list[ZeroWrite] = []

    @property
    def num_blocks(self) -> int:
        return sum(r.ids.numel() for runs in self.groups.values() for r in runs)

    def add_heads(self, stream: int, first_id: int, region: torch.Tensor, head_dim: int, in_features: int, *,
                  row_lo: int = 0, col_lo: int = 0, gain: float = 1.0, owner: Optional[Hashable] = None) -> None:
        """Head ``h`` of a logical ``[heads * head_dim, in_features]`` matrix is block
        ``first_id + h`` of ``stream``; ``region`` aliases its rows ``row_lo:row_lo + region.shape[0]``
        and columns ``col_lo:col_lo + region.shape[1]`` (the whole matrix by default). A 3-D
        ``region`` ``[k, head_dim, in_features]`` holds ``k`` whole heads from head ``row_lo //
        head_dim`` on, in any strides (heads whose rows alternate with other projections' rows)."""
        if region.device.type == "meta":
            return
        d, n = head_dim, in_features
        if region.dim() == 3:
            h0, tall = row_lo // d, d > n
            ids = torch.arange(first_id + h0, first_id + h0 + region.shape[0], dtype=torch.int64, device=region.device)
            run = BlockRun(stream, ids, region.transpose(1, 2) if tall else region, tall, gain, None, owner)
            self.groups.setdefault((region.device, (n, d) if tall else (d, n)), []).append(run)
            return
        rows, cols = region.shape
        h0, h1 = row_lo // d, (row_lo + rows + d - 1) // d
        tall = d > n
        wide = (n, d) if tall else (d, n)
        ids = torch.arange(first_id + h0, first_id + h1, dtype=torch.int64, device=region.device)
        if col_lo == 0 and cols == n and row_lo % d == 0 and rows % d == 0:
            blocks = region.unflatten(0, (h1 - h0, d))
            run = BlockRun(stream, ids, blocks.transpose(1, 2) if tall else blocks, tall, gain, None, owner)
        else:
            lo = row_lo - h0 * d
            run = BlockRun(stream, ids, region, tall, gain, (lo, lo + rows, col_lo, col_lo + cols), owner)
        self.groups.setdefault((region.device, wide), []).append(run)

    def add_identity(self, region: torch.Tensor, *, row_lo: int = 0, col_lo: int = 0,
                     head_dim: Optional[int] = None, gain: float = 1.0, owner: Optional[Hashable] = None) -> None:
        """``region`` aliases rows ``row_lo:`` and columns ``col_lo:`` of ``gain`` times a
        rectangular identity (per head of ``head_dim`` rows when given; see :func:`condinit.init.rect_identity_`)."""
        if region.device.type != "meta":
            self.identities.append(IdentityWrite(region, row_lo, col_lo, head_dim, gain, owner))

    def add_zero(self, tensor: torch.Tensor, *, owner: Optional[Hashable] = None) -> None:
        if tensor.device.type != "meta":
            self.zeros.append(ZeroWrite(tensor, owner))


# observe(run, first, stop, blocks): the fp32 results (wide orientation) of blocks first:stop of run
Observer = Callable[[BlockRun, int, int, torch.Tensor], None]


def run_plan(plan: InitPlan, seed: int, method: str, *, memory_budget: Optional[int] = None,
             backend: Optional[str] = None, observe: Optional[Observer] = None,
             on_chunk: Optional[Callable[[int], None]] = None) -> PlanResult:
    """Execute ``plan`` under ``seed``: every group of same-shaped blocks in chunks (see
    :func:`run_group`), then the identities and zeros. Arguments are not validated (the public
    functions did). Returns the chunks run and the seconds per owner; a group's time is shared among its
    runs' owners by block count."""
    launches = 0
    seconds: dict = {}

    def credit(owner, dt):
        if owner is not None:
            seconds[owner] = seconds.get(owner, 0.0) + dt

    # Every group's backends are chosen before anything is written: a backend that cannot run one
    # group raises here, with every destination untouched.
    chosen = {}
    for (device, wide) in plan.groups:
        concrete = resolve_method(*wide, method)
        chosen[device, wide] = (concrete, ORTHOGONALIZE.choose(device, backend, method=concrete))
        RANDN.choose(device)
    for (device, wide), runs in plan.groups.items():
        t0 = time.perf_counter()
        concrete, name = chosen[device, wide]
        launches += run_group(seed, runs, wide, concrete, device, memory_budget=memory_budget,
                             backend=name, observe=observe, on_chunk=on_chunk)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        total = sum(r.ids.numel() for r in runs)
        for r in runs:
            credit(r.owner, dt * r.ids.numel() / total)
    for region, row_lo, col_lo, head_dim, gain, owner in plan.identities:
        t0 = time.perf_counter()
        rect_identity_region_(region, row_lo, col_lo, head_dim, gain)
        credit(owner, time.perf_counter() - t0)
    for tensor, owner in plan.zeros:
        t0 = time.perf_counter()
        tensor.zero_()
        credit(owner, time.perf_counter() - t0)
    return PlanResult(launches, seconds)


def run_group(seed: int, runs: Sequence[BlockRun], wide_shape, method: str, device, *, memory_budget=None,
             backend=None, collect: Optional[torch.Tensor] = None, observe: Optional[Observer] = None,
             on_chunk: Optional[Callable[[int], None]] = None) -> int:
    """Generate + orthogonalize every block of ``runs`` (all of wide shape ``wide_shape``) in chunks
    and write each result to its run's ``dest`` (or into ``collect`` [total, m, n] fp32). Returns
    the number of chunks. ``on_chunk(blocks)`` is called once per chunk, ``observe`` once per run
    segment of a chunk (both possibly from CPU worker threads, one at a time)."""
    m, n = wide_shape
    offsets = [0]
    for r in runs:
        offsets.append(offsets[-1] + r.ids.numel())
    total = offsets[-1]
    if total == 0:
        return 0
    rng_backend = RANDN.choose(device)
    lock = threading.Lock()
    chunks = [0]

    def segments(start, stop):
        # (run, first index in run, last index in run, first index in chunk)
        for i, r in enumerate(runs):
            lo, hi = max(start, offsets[i]), min(stop, offsets[i + 1])
            if lo < hi:
                yield r, lo - offsets[i], hi - offsets[i], lo - start

    def count(start, stop):
        with lock:
            chunks[0] += 1
            if on_chunk is not None:
                on_chunk(stop - start)

    def fill(start, stop, A):
        for r, a, b, c in segments(start, stop):
            RANDN(rng_backend, seed, r.stream, r.ids[a:b], m, n, A[c:c + b - a])
        count(start, stop)

    def draw(start, stop):
        # the blocks RANDN's C++ CPU kernel would fill, for a factorization that draws them itself
        if rng_backend != "cpp-cpu":
            return None
        rows = torch.cat([torch.stack((torch.full_like(r.ids[a:b], r.stream), r.ids[a:b]), 1)
                          for r, a, b, _ in segments(start, stop)])
        count(start, stop)
        return seed, rows

    def sink(start, stop, R):
        if collect is not None:
            collect[start:stop].copy_(R)
            return
        for r, a, b, c in segments(start, stop):
            src = R[c:c + b - a]
            if r.gain != 1.0:
                src = src * r.gain
            if observe is not None:
                with lock:
                    observe(r, a, b, src)
            if r.window is None:
                r.dest[a:b].copy_(src)
            else:
                _write_window(r, a, b, src)

    def direct(start, stop):
        if collect is not None:
            return collect[start:stop]
        segs = list(segments(start, stop))
        if observe is not None or len(segs) != 1:
            return None
        r, a, b, _ = segs[0]
        if r.window is not None or r.gain != 1.0:
            return None
        d = r.dest[a:b]
        return d if d.dtype == torch.float32 and d.is_contiguous() else None

    run_chunks(total, (m, n), method, device, fill, sink, memory_budget=memory_budget,
               backend=backend, direct=direct, breaks=offsets if collect is None else (), draw=draw)
    return chunks[0]


def _write_window(r: BlockRun, a: int, b: int, src: torch.Tensor) -> None:
    """Copy the part of blocks ``a:b`` of ``r`` (``src``, wide orientation) inside ``r.window``."""
    logical = src.transpose(1, 2) if r.tall else src
    d, n = logical.shape[1:]
    row_lo, row_hi, col_lo, col_hi = r.window
    lo, hi = max(row_lo, a * d), min(row_hi, b * d)
    if lo < hi:
        rows = logical.reshape((b - a) * d, n)[lo - a * d:hi - a * d, col_lo:col_hi]
        r.dest[lo - row_lo:hi - row_lo].copy_(rows)


def rect_identity_region_(region: torch.Tensor, row_lo: int = 0, col_lo: int = 0,
                           head_dim: Optional[int] = None, gain: float = 1.0) -> None:
    """Write rows ``row_lo:`` and columns ``col_lo:`` of ``gain`` times the rectangular identity
    into ``region``: ``W[r, c] = gain`` (rounded once into ``region``'s dtype) where ``c == r``
    (``c == r % head_dim`` with ``head_dim``), else 0."""
    region.zero_()
    rows, cols = region.shape
    r = torch.arange(row_lo, row_lo + rows, device=region.device)
    c = r if head_dim is None else r % head_dim
    keep = (c >= col_lo) & (c < col_lo + cols)
    region[(r - row_lo)[keep], (c - col_lo)[keep]] = gain
