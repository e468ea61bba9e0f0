"""Timing and the rows of ``condinit bench``: the timer, the :class:`Row` each measurement becomes,
a section's rows with their error guard, the rates and time ratios filled in afterwards, and the
verdict of each row against its aim.

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

__all__ = ["Timing", "Timer", "Row", "Section", "fill_rates", "add_ratio", "set_aim", "judge", "VERDICTS"]

# A row's verdict against its aim: its time over another row's at most ``aim_max``.
VERDICTS = ("met", "not met", "no aim", "unknown")


@dataclasses.dataclass
class Timing:
    seconds: float             # median
    best: float
    all: list[float]
    scale: float = 1.0         # extrapolation factor already applied to the figures above


class Timer:
    """Median time of ``fn()`` on ``device``: wall clock on the CPU, CUDA events on GPUs (after a
    synchronize), ``warmup`` untimed calls first, then ``repeats`` timed calls, and more while
    their total is under ``min_seconds`` (at most :attr:`MAX_CALLS`): the fastest of many short
    calls is the rate of a quiet moment even on a busy machine."""

    MAX_CALLS = 1000

    def __init__(self, device, repeats: int = 3, warmup: int = 1, min_seconds: float = 0.0):
        self.device = torch.device(device)
        self.repeats, self.warmup, self.min_seconds = max(1, repeats), warmup, min_seconds

    def __call__(self, fn: Callable[[], object], scale: float = 1.0) -> Timing:
        cuda = self.device.type == "cuda"
        for _ in range(self.warmup):
            fn()
        times = []
        if cuda:
            torch.cuda.synchronize(self.device)
        while len(times) < self.repeats or (sum(times) < self.min_seconds and len(times) < self.MAX_CALLS):
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
    time over other rows' (``{key of the other row: ratio}``); ``rate``: achieved FLOP/s or B/s,
    ``ceiling`` the key of the ceiling row it is rated against and ``of_ceiling`` its fraction of
    that row's rate. ``aim``: the target in words, ``aim_key`` / ``aim_max``: the same as "time at
    most ``aim_max`` x row ``aim_key``'s", ``verdict`` one of :data:`VERDICTS`."""
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
    ceiling: Optional[str] = None
    of_ceiling: Optional[float] = None
    ratios: dict = dataclasses.field(default_factory=dict)
    aim: Optional[str] = None
    aim_key: Optional[str] = None
    aim_max: Optional[float] = None
    verdict: str = "no aim"
    note: str = ""
    error: Optional[str] = None
    peak_bytes: Optional[int] = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def above_ceiling(self) -> bool:
        """The rate exceeds its ceiling's: with ceilings that are upper bounds, timing noise."""
        return self.of_ceiling is not None and self.of_ceiling > 1.0


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


def fill_rates(rows: Sequence[Row], flop_ceiling: Optional[Row], copy: Optional[Row]) -> None:
    """Each row's rate (FLOP/s when it counts FLOPs, else B/s) and its fraction of the ceiling: the
    ``flop_ceiling`` row for FLOPs, ``copy`` for bytes (``None``: no ceiling measured)."""
    for r in rows:
        if not r.ok or not r.seconds:
            continue
        if r.flops:
            r.rate, r.rate_unit, ceiling = r.flops / r.seconds, "FLOP/s", flop_ceiling
        elif r.bytes:
            r.rate, r.rate_unit, ceiling = r.bytes / r.seconds, "B/s", copy
        else:
            continue
        if ceiling is not None and ceiling.rate and r is not ceiling:
            r.ceiling, r.of_ceiling = ceiling.key, r.rate / ceiling.rate
            if r.above_ceiling:
                r.note = "; ".join(x for x in (r.note, f"above its ceiling ({ceiling.key}): timing noise") if x)


def add_ratio(row: Row, other: Optional[Row]) -> None:
    if row.ok and other is not None and other.ok and other.seconds:
        row.ratios[other.key] = row.seconds / other.seconds


def set_aim(row: Row, other_key: str, at_most: float, words: str) -> None:
    """The aim "``row``'s time at most ``at_most`` x row ``other_key``'s" (``words``: the same, for
    the table); :func:`judge` gives the verdict."""
    row.aim, row.aim_key, row.aim_max = words, other_key, at_most


def judge(rows: Sequence[Row]) -> None:
    """Every row's verdict: ``met`` / ``not met`` against its aim (a row that failed does not meet
    it), ``no aim``, or ``unknown`` when the row it is compared with did not run (the note says so)."""
    ran = {r.key: r.ok for r in rows}
    for r in rows:
        if r.aim_key is None:
            r.verdict = "no aim"
        elif not r.ok:
            r.verdict = "not met"
        elif r.aim_key not in r.ratios:
            r.verdict = "unknown"
            why = "failed" if r.aim_key in ran else "did not run"
            r.note = "; ".join(x for x in (r.note, f"no verdict: {r.aim_key} {why}") if x)
        else:
            r.verdict = "met" if r.ratios[r.aim_key] <= r.aim_max else "not met"
