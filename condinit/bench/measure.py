"""Timing and the rows of ``condinit bench``: the timer, the :class:`Row` each measurement becomes,
a section's rows with their error guard, and the rates and time ratios filled in afterwards.

Timing: CPU rows take the median wall time of ``repeats`` calls after a warm-up call; CUDA rows
the median of CUDA-event times after warm-up. Baselines that loop over blocks in Python (the
per-head ``orthogonal_`` loop; on GPUs also the batched QR, which cuSOLVER runs block by block)
can be timed on a subset and scaled linearly (``baseline_blocks``; the row says so).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Optional, Sequence

import torch

__all__ = ["Timing", "Timer", "Row", "Section", "fill_rates", "add_ratio"]


@dataclasses.dataclass
class Timing:
    seconds: float             # median
    best: float
    all: list[float]
    scale: float = 1.0         # extrapolation factor already applied to the figures above


class Timer:
    """Median time of ``fn()`` on ``device``: wall clock on the CPU, CUDA events on GPUs (after a
    synchronize), ``warmup`` untimed calls first."""

    def __init__(self, device, repeats: int = 3, warmup: int = 1):
        self.device = torch.device(device)
        self.repeats, self.warmup = max(1, repeats), warmup

    def __call__(self, fn: Callable[[], object], scale: float = 1.0) -> Timing:
        cuda = self.device.type == "cuda"
        for _ in range(self.warmup):
            fn()
        times = []
        if cuda:
            torch.cuda.synchronize(self.device)
        for _ in range(self.repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize(self.device)
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        times = [t * scale for t in times]
        return Timing(statistics.median(times), min(times), times, scale)


@dataclasses.dataclass
class Row:
    """One measurement. ``key`` identifies it across runs (``init.batched``); ``ratios``: this row's
    time over other rows' (``{key of the other row: ratio}``); ``rate``: achieved FLOP/s or B/s and
    ``of_ceiling`` its fraction of the machine's measured ceiling."""
    section: str
    key: str
    name: str
    backend: str
    seconds: Optional[float] = None
    best: Optional[float] = None
    flops: Optional[float] = None
    bytes: Optional[float] = None
    rate: Optional[float] = None
    rate_unit: str = ""
    of_ceiling: Optional[float] = None
    ratios: dict = dataclasses.field(default_factory=dict)
    aim: Optional[str] = None
    note: str = ""
    error: Optional[str] = None
    peak_bytes: Optional[int] = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Section:
    """Rows of one section, with the progress callback and the error guard."""

    def __init__(self, name: str, timer: Timer, progress: Callable[[str], None],
                 on_row: Optional[Callable[[Row], None]] = None):
        self.name, self.timer, self.progress, self.on_row = name, timer, progress, on_row
        self.rows: list[Row] = []

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row(row)
        return row

    def get(self, key: str) -> Optional[Row]:
        return next((r for r in self.rows if r.key == key and r.ok), None)

    def measure(self, key: str, name: str, backend, fn: Callable[[], object], *, scale: float = 1.0,
                flops=None, nbytes=None, note: str = "", setup: Optional[Callable[[], object]] = None,
                peak_memory: bool = False) -> Row:
        """Time ``fn`` (built by ``setup()`` when given, so that setup errors are the row's too).
        ``backend``: a string or a callable returning one (evaluated inside the guard). A failure
        becomes the row's ``error`` (the run goes on); it is never replaced by another backend."""
        self.progress(f"{self.name}: {name}")
        row = Row(self.name, f"{self.name}.{key}", name, "?", note=note)
        try:
            row.backend = backend() if callable(backend) else backend
            if setup is not None:
                fn = setup()
            cuda = self.timer.device.type == "cuda"
            if cuda and peak_memory:
                torch.cuda.synchronize(self.timer.device)
                torch.cuda.reset_peak_memory_stats(self.timer.device)
                base = torch.cuda.memory_allocated(self.timer.device)
            t = self.timer(fn, scale)
            if cuda and peak_memory:
                row.peak_bytes = int(torch.cuda.max_memory_allocated(self.timer.device) - base)
            row.seconds, row.best = t.seconds, t.best
            row.flops, row.bytes = flops, nbytes
        except Exception as exc:  # recorded on the row and shown in the table: nothing is hidden
            row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return self.add(row)


def fill_rates(rows: Sequence[Row], matmul: Optional[Row], copy: Optional[Row]) -> None:
    for r in rows:
        if not r.ok or not r.seconds:
            continue
        if r.flops:
            r.rate, r.rate_unit = r.flops / r.seconds, "FLOP/s"
            if matmul is not None and matmul.rate and r is not matmul:
                r.of_ceiling = r.rate / matmul.rate
        elif r.bytes:
            r.rate, r.rate_unit = r.bytes / r.seconds, "B/s"
            if copy is not None and copy.rate and r is not copy:
                r.of_ceiling = r.rate / copy.rate


def add_ratio(row: Row, other: Optional[Row]) -> None:
    if row.ok and other is not None and other.ok and other.seconds:
        row.ratios[other.key] = row.seconds / other.seconds
