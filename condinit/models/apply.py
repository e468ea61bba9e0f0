"""``condinit.apply``: conditioned initialization of every attention layer of a model.

For each attention module an adapter describes (:mod:`condinit.models.adapters`), the paper's
Algorithm 1 (DESIGN.md section 2): per head, ``W_Q`` and ``W_K`` get independent Haar-random
semi-orthogonal ``[head_dim, in]`` row blocks (orthonormal rows, every singular value 1), ``W_V``
the rectangular identity over the whole ``[H_kv * head_dim, in]`` matrix (``v_mode="identity"``; or
``I_{d x in}`` in every head block with ``"identity_per_head"``), Q/K/V biases zero. Every other
parameter is left bitwise alone.

**Layer index.** Attention modules are numbered in the order ``model.named_modules()`` yields them
(a module inside a matched attention module is not visited again), plus ``layer_offset``. The index
picks the random blocks: head ``h`` of layer ``L``'s Q is block ``L * 2**32 + h`` of stream
``stream_id("q")``, K block ``L * 2**32 + h`` of ``stream_id("k")`` (the numbering of
:func:`condinit.init.conditioned_init_`). ``include`` / ``exclude`` (``fnmatch`` patterns on module
names) select layers *after* numbering, so initializing a model in pieces, or only some layers,
gives the same weights as one call on the whole model.

**Batching.** Same-shaped Q (or K) blocks of all selected layers are generated and orthogonalized
together (``condinit.init.conditioned_blocks``), in launches of at most ``buffer_bytes`` of float32
blocks, then copied (rounded once to the storage dtype) into each layer's rows. The buffer bounds
the extra memory, whatever the model size.

**Meta models** (every parameter on ``torch.device("meta")``): materialized on ``device`` with the
model's own init for everything but the Q/K/V weights and biases being conditioned (see
:mod:`condinit.models.deferred`), then conditioned as above; no second full-size copy is ever held.

**Sharded models** (DTensor parameters, e.g. after FSDP2 ``fully_shard``): each rank fills its own
shard, generating only the blocks its rows touch, with no communication (see
:mod:`condinit.models.sharded`); the result equals a single-process apply bit for bit.

No attention layer found (or none left after include/exclude): ``ValueError``.
"""
from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from condinit.init.functional import LAYER_STRIDE

from .adapters import AttentionSpec, Projection, get_adapter, registered_adapters
from .deferred import has_meta, materialize_
from .sharded import is_dtensor, local_part, overlap

__all__ = ["apply", "find_attention", "AttentionLayer", "BlockStats", "LayerReport", "ApplyReport",
           "DEFAULT_BUFFER_BYTES", "V_MODES"]

DEFAULT_BUFFER_BYTES = 128 << 20
V_MODES = ("identity", "identity_per_head")


# ------------------------------------------------------------------------------------------------
# discovery

@dataclass
class AttentionLayer:
    """One attention module found in a model: its layer index, qualified name, adapter and spec."""

    index: int
    name: str
    module: nn.Module
    adapter: str
    spec: AttentionSpec


def find_attention(model: nn.Module, *, layer_offset: int = 0, include=None, exclude=None) -> list[AttentionLayer]:
    """Every attention module of ``model`` that has an adapter, numbered as documented in this module.

    ``include`` / ``exclude``: a pattern or a list of ``fnmatch`` patterns on module names (``""`` is
    the root), applied after numbering.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(layer_offset, bool) or not isinstance(layer_offset, int) or layer_offset < 0:
        raise ValueError(f"layer_offset must be an int >= 0, got {layer_offset!r}")
    inc, exc = _patterns(include, "include"), _patterns(exclude, "exclude")
    found, matched = [], []
    for name, mod in model.named_modules():
        if any(name.startswith(m + ".") or m == "" for m in matched):
            continue
        adapter = get_adapter(mod)
        if adapter is None:
            continue
        matched.append(name)
        spec = adapter.spec(mod)
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"adapter {adapter.name} returned {type(spec).__name__} for {name!r}, expected AttentionSpec")
        found.append(AttentionLayer(layer_offset + len(found), name, mod, adapter.name, spec))
    return [l for l in found
            if (inc is None or any(fnmatch.fnmatchcase(l.name, p) for p in inc))
            and not (exc and any(fnmatch.fnmatchcase(l.name, p) for p in exc))]


def _patterns(pats, what):
    if pats is None:
        return None
    if isinstance(pats, str):
        return [pats]
    pats = list(pats)
    if not all(isinstance(p, str) for p in pats):
        raise TypeError(f"{what} must be a pattern string or a list of them, got {pats!r}")
    return pats


def _no_attention_error(model, include, exclude):
    if include is not None or exclude is not None:
        return ValueError(f"no attention layer of {type(model).__name__} matches include={include!r} "
                          f"exclude={exclude!r}")
    keys = sorted(k.__name__ if isinstance(k, type) else k.rsplit(".", 1)[1] for k in registered_adapters())
    return ValueError(f"no attention layer found in {type(model).__name__}: no submodule is of a class with a "
                      f"registered adapter ({', '.join(keys)}); add one with "
                      f"condinit.models.register_adapter(YourAttention, lambda m: AttentionSpec.from_linears(...))")


# ------------------------------------------------------------------------------------------------
# report

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
        smax, smin, cond = _spectrum(stack)
        return cls.from_heads(smax, smin, cond)


# Blocks whose fp32-Gram estimate of kappa exceeds this are measured again by condinit.init.spectrum.
_FAST_MAX_COND = 100.0


def _spectrum(stack: torch.Tensor):
    """Per-block ``(sigma_max, sigma_min, cond)`` (float64, CPU) of a ``[B, m, n]`` stack.

    Fast path for the report: the ``min(m,n)``-square Gram in fp32 (one batched GEMM, no float64
    copy of the blocks) and its eigenvalues in float64. Singular values from a fp32 Gram are
    accurate to ~1e-6 relative while kappa is moderate (init blocks: 1 after, ~1.5-3 before);
    blocks with an estimated kappa above 100 are measured again exactly by
    :func:`condinit.init.spectrum`.
    """
    from condinit.init import spectrum

    x = stack if stack.dtype == torch.float32 else stack.float()
    if x.shape[-2] > x.shape[-1]:
        x = x.transpose(-1, -2)
    ev = torch.linalg.eigvalsh(torch.matmul(x, x.transpose(-1, -2)).double())
    smax = ev[:, -1].clamp_min(0).sqrt()
    smin = ev[:, 0].clamp_min(0).sqrt()
    redo = ~(smax <= _FAST_MAX_COND * smin)
    if bool(redo.any()):
        exact = spectrum(stack[redo])
        smax[redo], smin[redo] = exact[0].to(smax), exact[1].to(smin)
    cond = torch.where(smin > 0, smax / smin, torch.full_like(smax, float("inf")))
    return smax.cpu(), smin.cpu(), cond.cpu()


@dataclass
class LayerReport:
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

    def to_dict(self) -> dict:
        def st(s):
            return None if s is None else {"sigma_max": s.sigma_max, "sigma_min": s.sigma_min, "cond": s.cond,
                                           "cond_per_head": list(s.cond_per_head)}
        return {"index": self.index, "name": self.name, "adapter": self.adapter, "num_heads": self.num_heads,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "shapes": {k: list(v) for k, v in self.shapes.items()},
                "before": {k: st(v) for k, v in self.before.items()},
                "after": {k: st(v) for k, v in self.after.items()}, "time_s": self.time_s}


@dataclass
class ApplyReport:
    """What :func:`apply` did: one :class:`LayerReport` per conditioned layer, plus totals.

    ``print(report)`` (or ``report.print()``) shows a table; ``report.to_dict()`` is JSON-friendly.
    ``time_s`` per layer is the wall time of the batched launches that produced its blocks,
    apportioned by block count, plus its V and bias writes. ``init_time_s`` is the time spent
    materializing a meta model (its own init); ``total_time_s`` everything, reports included.
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

    def __len__(self):
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def to_dict(self) -> dict:
        return {"seed": self.seed, "method": self.method, "v_mode": self.v_mode, "launches": self.launches,
                "materialized": self.materialized, "sharded": self.sharded, "init_time_s": self.init_time_s,
                "total_time_s": self.total_time_s, "layers": [l.to_dict() for l in self.layers]}

    def table(self, max_rows: Optional[int] = None):
        """A ``rich.table.Table`` with one row per (layer, projection)."""
        from rich.table import Table

        t = Table(title=f"condinit.apply: {len(self.layers)} attention layers, seed {self.seed}, method "
                        f"{self.method}, V {self.v_mode}, {self.launches} launches, {self.total_time_s:.3f} s"
                        + (" (materialized from meta)" if self.materialized else "")
                        + (" (local shards)" if self.sharded else ""))
        for col in ("layer", "name", "adapter", "heads", "proj", "shape", "before σmax/σmin/κ",
                    "after σmax/σmin/κ", "ms"):
            t.add_column(col, justify="right" if col in ("layer", "ms") else "left")
        layers = self.layers if max_rows is None else self.layers[:max_rows]
        for l in layers:
            for i, p in enumerate(("q", "k", "v")):
                first = i == 0
                t.add_row(str(l.index) if first else "", l.name if first else "", l.adapter if first else "",
                          f"{l.num_heads}/{l.num_kv_heads}x{l.head_dim}" if first else "", p,
                          "x".join(str(s) for s in l.shapes[p]), _fmt(l.before.get(p)), _fmt(l.after.get(p)),
                          f"{1e3 * l.time_s:.1f}" if first else "")
        if max_rows is not None and len(self.layers) > max_rows:
            t.caption = f"... {len(self.layers) - max_rows} more layers"
        return t

    def print(self, console=None, max_rows: Optional[int] = None):
        (console or wide_console()).print(self.table(max_rows))

    def __str__(self):
        con = wide_console(force_width=True)
        with con.capture() as cap:
            con.print(self.table())
        return cap.get()


def wide_console(force_width: bool = False):
    """A rich Console; when output is not a terminal (a pipe, a file, a test) it is 200 columns wide
    instead of rich's 80, so that tables keep full module names."""
    import sys

    from rich.console import Console

    if force_width or not sys.stdout.isatty():
        return Console(width=200)
    return Console()


def _fmt(s: Optional[BlockStats]) -> str:
    if s is None:
        return "-"
    return f"{s.sigma_max:.7g}/{s.sigma_min:.7g}/{s.cond:.7g}"


# ------------------------------------------------------------------------------------------------
# planning: intersect each projection with the local region of its storage

@dataclass
class _Region:
    """The part of one projection's logical ``[rows, in]`` matrix that is local, and a view of it."""

    r_lo: int
    r_hi: int
    c_lo: int
    c_hi: int
    view: torch.Tensor  # [r_hi - r_lo, c_hi - c_lo], aliasing the (local) storage


def _local_region(proj: Projection, name: str) -> Optional[_Region]:
    local, off, gshape = local_part(proj.weight, name)
    rows, cols = proj.shape
    if proj.transposed:  # storage [in, out_total]: logical rows are storage columns
        r = overlap(off[1], off[1] + local.shape[1], proj.start, proj.stop)
        c = (off[0], off[0] + local.shape[0])
        if r is None or c[0] >= c[1]:
            return None
        view = local[c[0] - off[0]:c[1] - off[0], r[0] - off[1]:r[1] - off[1]].t()
    else:
        r = overlap(off[0], off[0] + local.shape[0], proj.start, proj.stop)
        c = (off[1], off[1] + local.shape[1])
        if r is None or c[0] >= c[1]:
            return None
        view = local[r[0] - off[0]:r[1] - off[0], c[0] - off[1]:c[1] - off[1]]
    return _Region(r[0] - proj.start, r[1] - proj.start, c[0], c[1], view)


def _zero_bias_(proj: Projection, name: str):
    if proj.bias is None:
        return
    local, off, _ = local_part(proj.bias, name)
    s = overlap(off[0], off[0] + local.shape[0], proj.bias_offset, proj.bias_offset + proj.rows)
    if s is not None:
        local[s[0] - off[0]:s[1] - off[0]].zero_()


@dataclass
class _Item:
    """Heads ``h0:h1`` of one Q/K projection of one layer, and where their local rows go."""

    report: LayerReport
    proj: str
    first_id: int       # block id of head h0
    h0: int
    h1: int
    d: int
    row_lo: int         # logical rows row_lo:row_hi (within heads h0:h1) are local
    row_hi: int
    c_lo: int
    c_hi: int
    dest: torch.Tensor  # [row_hi - row_lo, c_hi - c_lo]


def _covered(layers: Sequence[AttentionLayer]) -> list[torch.Tensor]:
    """Parameters that the Q/K/V weights and biases of ``layers`` overwrite entirely."""
    spans: dict[int, tuple[torch.Tensor, int, list]] = {}

    def add(t, dim, lo, hi):
        ent = spans.setdefault(id(t), (t, t.shape[dim], []))
        ent[2].append((lo, hi))

    for l in layers:
        for _, p in l.spec.projections():
            add(p.weight, 1 if p.transposed else 0, p.start, p.stop)
            if p.bias is not None:
                add(p.bias, 0, p.bias_offset, p.bias_offset + p.rows)
    out = []
    for t, size, iv in spans.values():
        at = 0
        for lo, hi in sorted(iv):
            if lo > at:
                break
            at = max(at, hi)
        if at >= size:
            out.append(t)
    return out


# ------------------------------------------------------------------------------------------------
# the public entry point

def apply(model: nn.Module, *, seed: Optional[int] = 0, method: str = "auto", v_mode: str = "identity",
          include: Union[str, Sequence[str], None] = None, exclude: Union[str, Sequence[str], None] = None,
          report: bool = True, layer_offset: int = 0, device=None, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
          init_fn: Optional[Callable[[nn.Module], None]] = None, check_init: bool = True,
          progress: bool = False) -> ApplyReport:
    """Conditioned initialization of every attention layer of ``model``, in place (see module doc).

    Args:
        model: any ``nn.Module``; attention submodules are found through registered adapters.
        seed: ``0 <= seed < 2**64``; None draws one from torch's default generator (so
            ``torch.manual_seed`` controls it). The report records the seed used.
        method: orthogonalization method passed to ``condinit.init.conditioned_blocks`` ("auto",
            or one the engine names).
        v_mode: ``"identity"`` (rectangular identity over the whole V matrix) or
            ``"identity_per_head"`` (``I_{d x in}`` in every head's rows).
        include, exclude: ``fnmatch`` patterns on module names selecting layers (after numbering).
        report: measure singular values of every Q/K/V head block before (when the weights hold
            values: not for meta or sharded models) and after.
        layer_offset: added to every layer index (initialize a sub-module as part of a bigger model).
        device: where to materialize a meta model (default CPU). Only for meta models.
        buffer_bytes: upper bound on the float32 blocks generated per launch.
        init_fn: for meta models, ``init_fn(model)`` replaces the model's own init of the other
            parameters (see :mod:`condinit.models.deferred`).
        check_init: for meta models, check that the own init left no parameter uninitialized.
        progress: show a tqdm progress bar over launches.

    Returns:
        :class:`ApplyReport`.

    Raises:
        ValueError: no attention layer (after include/exclude), bad argument, partly-meta model.
        TypeError: a Q/K/V weight that is not floating point, a bad argument type.
    """
    from condinit.init.random import seed_from

    t_start = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if v_mode not in V_MODES:
        raise ValueError(f"v_mode must be one of {V_MODES}, got {v_mode!r}")
    from condinit.init.orthogonalize import check_method

    check_method(method)
    if isinstance(buffer_bytes, bool) or not isinstance(buffer_bytes, int) or buffer_bytes < 1:
        raise ValueError(f"buffer_bytes must be a positive int, got {buffer_bytes!r}")
    seed = seed_from(None, seed) if seed is not None else seed_from(None)

    layers = find_attention(model, layer_offset=layer_offset, include=include, exclude=exclude)
    if not layers:
        raise _no_attention_error(model, include, exclude)

    for l in layers:  # every check before the first write (or allocation)
        for p, proj in l.spec.projections():
            if not proj.weight.is_floating_point():
                raise TypeError(f"{l.name}: {p} weight has dtype {proj.weight.dtype}, expected a floating dtype")
    params = list(model.parameters())
    meta = has_meta(model)
    init_time = 0.0
    if meta:
        if not all(p.is_meta for p in params):
            raise ValueError("model is partly on the meta device: materialize it fully (or build all of it on meta) "
                             "before condinit.apply")
        t0 = time.perf_counter()
        materialize_(model, device, skip=_covered(layers), init_fn=init_fn, check=check_init)
        init_time = time.perf_counter() - t0
        names = {l.name for l in layers}
        layers = [l for l in find_attention(model, layer_offset=layer_offset) if l.name in names]
    elif device is not None:
        raise ValueError(f"device={device!r} is only used to materialize a meta model; this model is already on "
                         f"{params[0].device if params else 'no device'} (move it with model.to(device) instead)")

    sharded = any(is_dtensor(p.weight) for l in layers for _, p in l.spec.projections())
    with torch.no_grad():
        reports, items, v_jobs = _plan(layers, report=report and not meta and not sharded,
                                       buffer_bytes=buffer_bytes)
        launches = _run(items, seed, method, buffer_bytes, report, progress)
        v_cache: dict = {}
        for rep, spec, name in v_jobs:
            t0 = time.perf_counter()
            _write_v(spec, v_mode, name)
            for p, proj in spec.projections():
                _zero_bias_(proj, f"{name}.{p} bias")
            rep.time_s += time.perf_counter() - t0
            if report:
                key = (v_mode, spec.num_kv_heads, spec.head_dim, spec.v.in_features)
                if key not in v_cache:
                    v_cache[key] = BlockStats.of(_v_blocks(v_mode, *key[1:]))
                rep.after["v"] = v_cache[key]
    return ApplyReport(reports, seed, method, v_mode, launches, meta, sharded, init_time,
                       time.perf_counter() - t_start)


def _plan(layers, *, report: bool, buffer_bytes: int):
    reports, items, v_jobs = [], [], []
    for l in layers:
        s = l.spec
        rep = LayerReport(l.index, l.name, l.adapter, s.num_heads, s.num_kv_heads, s.head_dim,
                          {p: tuple(proj.shape) for p, proj in s.projections()})
        for p, proj in s.projections():
            if not proj.weight.is_floating_point():
                raise TypeError(f"{l.name}: {p} weight has dtype {proj.weight.dtype}, expected a floating dtype")
            rep.before[p] = None
            rep.after[p] = None
            if report:
                heads = s.num_heads if p == "q" else s.num_kv_heads
                w = proj.view().float()
                rep.before[p] = BlockStats.of(w.reshape(heads, s.head_dim, proj.in_features))
        d = s.head_dim
        for p, proj, heads in (("q", s.q, s.num_heads), ("k", s.k, s.num_kv_heads)):
            reg = _local_region(proj, f"{l.name}.{p}")
            if reg is None:
                continue
            max_heads = max(1, buffer_bytes // (4 * d * proj.in_features))
            h_first, h_last = reg.r_lo // d, (reg.r_hi - 1) // d
            for h0 in range(h_first, h_last + 1, max_heads):
                h1 = min(h0 + max_heads, h_last + 1)
                lo, hi = max(reg.r_lo, h0 * d), min(reg.r_hi, h1 * d)
                items.append(_Item(rep, p, l.index * LAYER_STRIDE + h0, h0, h1, d, lo, hi, reg.c_lo, reg.c_hi,
                                   reg.view[lo - reg.r_lo:hi - reg.r_lo]))
        v_jobs.append((rep, s, l.name))
        reports.append(rep)
    return reports, items, v_jobs


def _run(items: list, seed: int, method: str, buffer_bytes: int, report: bool, progress: bool) -> int:
    """Generate every Q/K block in launches grouped by (projection, block shape, device)."""
    from condinit.init import conditioned_blocks
    from condinit.init.random import stream_id

    groups: dict = {}
    for it in items:
        groups.setdefault((it.proj, it.d, _in_features(it), it.dest.device), []).append(it)
    chunks = []
    for (p, d, n, dev), its in groups.items():
        max_blocks = max(1, buffer_bytes // (4 * d * n))
        cur, count = [], 0
        for it in its:
            nb = it.h1 - it.h0
            if cur and count + nb > max_blocks:
                chunks.append((p, d, n, dev, cur))
                cur, count = [], 0
            cur.append(it)
            count += nb
        if cur:
            chunks.append((p, d, n, dev, cur))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(sum(i.h1 - i.h0 for i in c[4]) for c in chunks), unit="block", desc="condinit",
                   leave=False)
    acc: dict = {}
    try:
        for p, d, n, dev, its in chunks:
            t0 = time.perf_counter()
            ids = torch.cat([torch.arange(i.first_id, i.first_id + i.h1 - i.h0, dtype=torch.int64) for i in its])
            blocks = conditioned_blocks(seed, stream_id(p), ids.to(dev), (d, n), method, dev)
            at = 0
            for it in its:
                nb = it.h1 - it.h0
                sub = blocks[at:at + nb]
                flat = sub.reshape(nb * d, n)
                it.dest.copy_(flat[it.row_lo - it.h0 * d:it.row_hi - it.h0 * d, it.c_lo:it.c_hi])
                at += nb
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            dt = time.perf_counter() - t0
            total = ids.numel()
            at = 0
            for it in its:
                nb = it.h1 - it.h0
                it.report.time_s += dt * nb / total
                if report:
                    sub = blocks[at:at + nb]
                    stored = sub.to(it.dest.dtype).float() if it.dest.dtype != torch.float32 else sub
                    smax, smin, cond = _spectrum(stored)
                    ent = acc.setdefault((id(it.report), p), (it.report, []))
                    ent[1].append((smax, smin, cond))
                at += nb
            del blocks
            if bar is not None:
                bar.update(total)
    finally:
        if bar is not None:
            bar.close()
    for (_, p), (rep, parts) in acc.items():
        rep.after[p] = BlockStats.from_heads(torch.cat([x[0] for x in parts]), torch.cat([x[1] for x in parts]),
                                             torch.cat([x[2] for x in parts]))
    return len(chunks)


def _in_features(it: _Item) -> int:
    return it.report.shapes[it.proj][1]


def _write_v(spec: AttentionSpec, v_mode: str, name: str):
    """V = rectangular identity: ``W[r, c] = 1`` where ``c == r`` (whole matrix) or ``c == r mod d``
    (per head), 0 elsewhere; written straight into the local region, no generation needed."""
    reg = _local_region(spec.v, f"{name}.v")
    if reg is None:
        return
    reg.view.zero_()
    dev = reg.view.device
    rows = torch.arange(reg.r_lo, reg.r_hi, device=dev)
    cols = rows if v_mode == "identity" else rows % spec.head_dim
    keep = (cols >= reg.c_lo) & (cols < reg.c_hi)
    if bool(keep.any()):
        reg.view[rows[keep] - reg.r_lo, cols[keep] - reg.c_lo] = 1


def _v_blocks(v_mode: str, num_kv_heads: int, d: int, n: int) -> torch.Tensor:
    w = torch.zeros(num_kv_heads * d, n)
    rows = torch.arange(num_kv_heads * d)
    cols = rows if v_mode == "identity" else rows % d
    keep = cols < n
    w[rows[keep], cols[keep]] = 1
    return w.reshape(num_kv_heads, d, n)
