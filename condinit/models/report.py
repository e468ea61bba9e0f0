"""What :func:`condinit.apply` (and a streamed write) reports: per layer the heads, shapes and
singular values of every Q/K/V head block before and after, and the tables that print it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from condinit.init.spectrum import spectrum

if TYPE_CHECKING:
    from .apply import AttentionLayer, Uncovered

__all__ = ["BlockStats", "LayerReport", "ApplyReport", "uncovered_groups", "uncovered_listing", "uncovered_table",
           "wide_console"]

NAMES_SHOWN = 3     # module names shown per distinct reason


@dataclass
class BlockStats:
    """Singular values of one projection's per-head blocks: largest over heads, smallest over heads,
    worst condition number over heads, and each head's condition number."""

    sigma_max: float
    sigma_min: float
    cond: float
    cond_per_head: tuple = ()

    @classmethod
    def from_heads(cls, smax: torch.Tensor, smin: torch.Tensor, cond: torch.Tensor) -> "BlockStats":
        return cls(float(smax.max()), float(smin.min()), float(cond.max()), tuple(float(c) for c in cond))

    @classmethod
    def of(cls, stack: torch.Tensor) -> "BlockStats":
        """Of the ``[heads, m, n]`` blocks of ``stack`` (:func:`condinit.init.spectrum`, float64)."""
        return cls.from_heads(*spectrum(stack))


@dataclass
class LayerReport:
    """What :func:`condinit.apply` did to one layer: its index, name, adapter, heads, the ``[rows, in]``
    shape of each projection (``shapes``), layout, and the singular values of its head blocks
    ``before`` and ``after`` (:class:`BlockStats` per projection, None where not measured)."""

    index: int
    name: str
    adapter: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    shapes: dict
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    time_s: float = 0.0
    layout: str = "separate"
    cross: bool = False
    shared: dict = field(default_factory=dict)   # projection -> the earlier layer's projection whose weight it is

    @classmethod
    def of(cls, layer: AttentionLayer) -> "LayerReport":
        """The report of ``layer`` before anything is measured."""
        s = layer.spec
        return cls(index=layer.index, name=layer.name, adapter=layer.adapter, num_heads=s.num_heads,
                   num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                   shapes={p: tuple(proj.shape) for p, proj in s.projections()}, layout=s.layout, cross=layer.cross)

    def to_dict(self) -> dict:
        def st(s):
            return None if s is None else {"sigma_max": s.sigma_max, "sigma_min": s.sigma_min, "cond": s.cond,
                                           "cond_per_head": list(s.cond_per_head)}
        return {"index": self.index, "name": self.name, "adapter": self.adapter, "num_heads": self.num_heads,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "layout": self.layout,
                "cross": self.cross,
                "shapes": {k: list(v) for k, v in self.shapes.items()},
                "before": {k: st(v) for k, v in self.before.items()},
                "after": {k: st(v) for k, v in self.after.items()}, "time_s": self.time_s,
                "shared": dict(self.shared)}


@dataclass
class ApplyReport:
    """What :func:`condinit.apply` did: one :class:`LayerReport` per conditioned layer, plus totals, and
    ``uncovered``: the attention-like modules it left as they were, each with the reason
    (:class:`~condinit.models.Uncovered`).

    ``print(report)`` (or ``report.print()``) shows a table per layer and projection, then the
    uncovered modules; ``report.to_dict()`` is JSON-friendly. ``qk_gain`` / ``v_gain``: the gains
    the weights were written with (1: the paper's method).
    ``time_s`` per layer is the wall time of the batched launches that produced its blocks,
    apportioned by block count, plus its V and bias writes. ``launches``: the number of chunks
    generated and orthogonalized. ``init_time_s`` is the time spent materializing a meta model (its
    own init); ``total_time_s`` everything, reports included.
    """

    layers: list
    seed: int
    method: str
    v_mode: str
    launches: int = 0
    materialized: bool = False
    sharded: bool = False
    init_time_s: float = 0.0
    total_time_s: float = 0.0
    uncovered: list = field(default_factory=list)
    qk_gain: float = 1.0
    v_gain: float = 1.0

    def __len__(self):
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def to_dict(self) -> dict:
        return {"seed": self.seed, "method": self.method, "v_mode": self.v_mode, "qk_gain": self.qk_gain,
                "v_gain": self.v_gain, "launches": self.launches,
                "materialized": self.materialized, "sharded": self.sharded, "init_time_s": self.init_time_s,
                "total_time_s": self.total_time_s, "layers": [l.to_dict() for l in self.layers],
                "uncovered": [{"name": u.name, "class": u.cls, "reason": u.reason} for u in self.uncovered]}

    def table(self, max_rows: Optional[int] = None):
        """A ``rich.table.Table`` with one row per (layer, projection). Only what was measured has a
        column: the singular values before (not on a meta model) and after (not in a streamed
        write, whose files ``condinit inspect`` reads), the time per layer."""
        from rich.table import Table

        sigma = [(when, f"{when} σmax/σmin/κ") for when in ("before", "after")
                 if any(s is not None for l in self.layers for s in getattr(l, when).values())]
        timed = any(l.time_s > 0 for l in self.layers)
        t = Table(title=f"condinit.apply: {len(self.layers)} attention layers, seed {self.seed}, method "
                        f"{self.method}, V {self.v_mode}, gains Q/K {self.qk_gain:g} V {self.v_gain:g}, "
                        + (f"{self.launches} launches, " if self.launches else "") + f"{self.total_time_s:.3f} s"
                        + (" (materialized from meta)" if self.materialized else "")
                        + (" (local shards)" if self.sharded else ""))
        cols = ["layer", "name", "adapter", "heads", "layout", "proj", "shape"] + [c for _, c in sigma]
        for col in cols + (["ms"] if timed else []):
            t.add_column(col, justify="right" if col in ("layer", "ms") else "left", overflow="fold")
        layers = self.layers if max_rows is None else self.layers[:max_rows]
        for l in layers:
            for i, p in enumerate(("q", "k", "v")):
                first = i == 0
                t.add_row(str(l.index) if first else "", l.name if first else "", l.adapter if first else "",
                          f"{l.num_heads}/{l.num_kv_heads}x{l.head_dim}" if first else "",
                          (l.layout + (" (cross)" if l.cross else "")) if first else "", p,
                          "x".join(str(s) for s in l.shapes[p]), *(_fmt(getattr(l, when).get(p)) for when, _ in sigma),
                          *([f"{1e3 * l.time_s:.1f}" if first else ""] if timed else []))
        notes = []
        if max_rows is not None and len(self.layers) > max_rows:
            notes.append(f"... {len(self.layers) - max_rows} more layers")
        if not sigma and self.layers:
            notes.append("singular values not measured here: condinit inspect reads them from the written files")
        for l in self.layers:
            for p, first in l.shared.items():
                notes.append(f"{l.name}.{p} is {first} (one weight): conditioned once, as {first}")
        t.caption = "; ".join(notes) or None
        return t

    def uncovered_table(self):
        """A ``rich.table.Table`` of the uncovered modules, or None when there are none."""
        return uncovered_table(self.uncovered)

    def print(self, console=None, max_rows: Optional[int] = None):
        con = console or wide_console()
        con.print(self.table(max_rows))
        if self.uncovered:
            con.print(self.uncovered_table())

    def __str__(self):
        con = wide_console(force_width=True)
        with con.capture() as cap:
            self.print(con)
        return cap.get()


def uncovered_groups(uncovered: Sequence[Uncovered]) -> list:
    """``[(class, reason, names)]``: the uncovered modules grouped by class and reason, each group
    in the order its first module appears, its names in module order."""
    groups: dict = {}
    for u in uncovered:
        groups.setdefault((u.cls, u.reason), []).append(u.name or "(root)")
    return [(cls, reason, names) for (cls, reason), names in groups.items()]


def _first_names(names: Sequence[str]) -> str:
    return ", ".join(names[:NAMES_SHOWN]) + (", ..." if len(names) > NAMES_SHOWN else "")


def uncovered_listing(uncovered: Sequence[Uncovered], limit: Optional[int] = None) -> str:
    """The uncovered modules in one line per distinct class and reason: ``"NAME (Class): reason"``
    for one module, ``"N x Class (first, second, third, ...): reason"`` for several. One group
    reads inline; several start on a new line each. ``limit``: at most that many lines, then how
    many modules and reasons are left out.

    Examples:
        >>> uncovered_listing([Uncovered(f"layers.{i}.attn", "MLA", "low-rank factors") for i in range(24)])
        '24 x MLA (layers.0.attn, layers.1.attn, layers.2.attn, ...): low-rank factors'
    """
    groups = uncovered_groups(uncovered)
    shown = groups if limit is None else groups[:limit]
    lines = [f"{names[0]} ({cls}): {reason}" if len(names) == 1 else
             f"{len(names)} x {cls} ({_first_names(names)}): {reason}" for cls, reason, names in shown]
    rest = groups[len(shown):]
    if rest:
        lines.append(f"... {sum(len(g[2]) for g in rest)} more module(s) for {len(rest)} other reason(s)")
    return lines[0] if len(lines) == 1 else "".join("\n  " + line for line in lines)


def uncovered_table(uncovered: Sequence[Uncovered], title: Optional[str] = None):
    """A ``rich.table.Table`` of the attention-like modules that were not conditioned, one row per
    distinct class and reason (how many, the first names), or None when there are none."""
    if not uncovered:
        return None
    from rich.table import Table

    t = Table(title=title or f"not conditioned: {len(uncovered)} attention-like module(s), left as the model made them")
    for col in ("modules", "class", "names", "reason"):
        t.add_column(col, justify="right" if col == "modules" else "left", overflow="fold")
    for cls, reason, names in uncovered_groups(uncovered):
        t.add_row(str(len(names)), cls, _first_names(names), reason)
    return t


def wide_console(force_width: bool = False):
    """A rich Console; when output is not a terminal (a pipe, a file, a test) it is 200 columns wide
    instead of rich's 80, so that the per-projection tables keep whole module names."""
    import sys

    from rich.console import Console

    if force_width or not sys.stdout.isatty():
        return Console(width=200)
    return Console()


def _fmt(s: Optional[BlockStats]) -> str:
    if s is None:
        return "-"
    return f"{s.sigma_max:.4g}/{s.sigma_min:.4g}/{s.cond:.4g}"
