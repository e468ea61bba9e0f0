"""What conditioned init writes into found attention layers: each projection's local region, the
:class:`~condinit.init.plan.InitPlan` of them (:func:`plan_blocks`), and the tensors it overwrites whole."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from condinit.init.functional import K_STREAM, LAYER_STRIDE, Q_STREAM
from condinit.init.plan import InitPlan
from condinit.ops.random.op import stream_id

from .find import AttentionLayer
from .projection import Projection
from .report import BlockStats, LayerReport
from .sharded import local_boxes, overlap

__all__ = ["plan_blocks", "covered_tensors"]


# local regions: each projection intersected with the part of its storage this process holds

@dataclass
class _Region:
    """The part of one projection's logical ``[rows, in]`` matrix that is local, and a view of it."""

    r_lo: int
    r_hi: int
    c_lo: int
    c_hi: int
    view: torch.Tensor  # [r_hi - r_lo, c_hi - c_lo], aliasing the (local) storage


def _local_regions(proj: Projection, name: str) -> list[_Region]:
    """The local part of each group of ``proj`` (rows in the projection's logical coordinates), per
    contiguous box of the local storage (one box unless a ``_StridedShard`` splits it)."""
    whole, boxes, _ = local_boxes(proj.weight, name, proj.partition)
    out = []
    for box in boxes:
        local, off = proj.local_matrix(whole[box.slices()], box.offset, name)
        for logical, lo, hi, col in proj.blocks():
            if proj.in_groups > 1:  # a grouped convolution (held whole): the block reads input columns col:
                out.append(_Region(logical, logical + hi - lo, col, col + local.shape[1], local[lo:hi]))
                continue
            if proj.transposed:  # storage [in, out_total]: logical rows are storage columns
                r = overlap(off[1], off[1] + local.shape[1], lo, hi)
                c = (off[0], off[0] + local.shape[0])
                if r is None or c[0] >= c[1]:
                    continue
                view = local[c[0] - off[0]:c[1] - off[0], r[0] - off[1]:r[1] - off[1]].t()
            else:
                r = overlap(off[0], off[0] + local.shape[0], lo, hi)
                c = (off[1], off[1] + local.shape[1])
                if r is None or c[0] >= c[1]:
                    continue
                view = local[r[0] - off[0]:r[1] - off[0], c[0] - off[1]:c[1] - off[1]]
            out.append(_Region(logical + r[0] - lo, logical + r[1] - lo, c[0], c[1], view))
    return out


def _storage_key(proj: Projection) -> Optional[tuple]:
    """What identifies the storage ``proj`` writes (the weight's memory and the rows of it the projection
    holds), so that two layers sharing a projection are told apart from two with equal shapes; None for
    a learned query, a distributed weight or one without storage (meta)."""
    if proj.fixed or proj.distributed or proj.weight.is_meta:
        return None
    w = proj.matrix()
    return (w.untyped_storage().data_ptr(), w.storage_offset(), tuple(w.shape), tuple(w.stride()),
            tuple(proj.segments()), proj.transposed)


def _one_head_groups(proj: Projection, head_dim: int) -> Optional[torch.Tensor]:
    """A ``[groups, head_dim, in]`` strided view of a plain (non-DTensor) projection whose groups
    are one head each (GPT-NeoX's ``[H, 3, d]``), or None."""
    if proj.groups == 1 or proj.group_rows != head_dim or proj.in_groups > 1 or proj.distributed:
        return None
    w = proj.matrix()
    row, col = (w.stride(1), w.stride(0)) if proj.transposed else (w.stride(0), w.stride(1))
    return w.as_strided((proj.groups, head_dim, proj.in_features), (proj.stride * row, row, col),
                        w.storage_offset() + proj.start * row)


def _local_biases(proj: Projection, name: str) -> list[torch.Tensor]:
    """The local part of each group of this projection's bias entries (empty: no bias, or none local)."""
    if proj.bias is None:
        return []
    whole, boxes, _ = local_boxes(proj.bias, name, proj.bias_partition)
    out = []
    for box in boxes:
        local, off = whole[box.slices()], box.offset
        for lo, hi in proj.bias_segments():
            s = overlap(off[0], off[0] + local.shape[0], lo, hi)
            if s is not None:
                out.append(local[s[0] - off[0]:s[1] - off[0]])
    return out


def covered_tensors(layers: Sequence[AttentionLayer]) -> list[torch.Tensor]:
    """Parameters that the Q/K/V weights and biases of ``layers`` overwrite entirely."""
    spans: dict[int, tuple[torch.Tensor, int, list]] = {}

    def add(t, size, lo, hi):
        ent = spans.setdefault(id(t), (t, size, []))
        ent[2].append((lo, hi))

    for l in layers:
        for _, p in l.spec.projections():
            for _, lo, hi in ([] if p.fixed else p.segments()):
                add(p.weight, p.storage_rows, lo, hi)
            for lo, hi in p.bias_segments():
                add(p.bias, p.bias.shape[0], lo, hi)
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



def plan_blocks(layers: Sequence[AttentionLayer], v_mode: str, *, measure_before: bool, qk_gain: float = 1.0,
                v_gain: float = 1.0):
    """The :class:`InitPlan` writing the local part of every layer's Q/K/V (Q/K times ``qk_gain``,
    V ``v_gain`` times the identity) and biases (owner: the layer's position in ``layers``), and
    one :class:`LayerReport` per layer (``before`` measured when asked). A projection in several
    groups (interleaved layouts) is planned group by group, each at its logical rows, so head ``h``
    is block ``h`` whatever the storage order."""
    plan, reports = InitPlan(), []
    sq, sk = stream_id(Q_STREAM), stream_id(K_STREAM)
    owners: dict = {}     # the storage a projection writes -> the first layer's projection that writes it
    for i, l in enumerate(layers):
        s = l.spec
        rep = LayerReport.of(l)
        reports.append(rep)
        if s.layout == "latent":     # multi-head latent attention: its factors (condinit.init.factors)
            rep.before.update(s.effective_stats() if measure_before else dict.fromkeys("qkv"))
            s.plan_into(plan, l.index, i, v_mode=v_mode, qk_gain=qk_gain, v_gain=v_gain)
            continue
        for p, proj in s.projections():
            heads = s.num_heads if p == "q" else s.num_kv_heads
            rep.before[p] = BlockStats.of(proj.view().reshape(heads, s.head_dim, proj.in_features)) \
                if measure_before else None
            rep.after[p] = None
            key = _storage_key(proj)
            if key is not None:
                # a projection shared with an earlier layer (the same weight): written once, as that layer's
                first = owners.setdefault(key, f"{l.name}.{p}")
                if first != f"{l.name}.{p}":
                    rep.shared[p] = first
        for p, proj, stream in (("q", s.q, sq), ("k", s.k, sk)):
            if proj.fixed or p in rep.shared:   # a learned query (nothing to write), or written by an earlier layer
                continue
            heads = _one_head_groups(proj, s.head_dim)
            if heads is not None:     # one view of every head: one run, batched like a contiguous weight
                plan.add_heads(stream, l.index * LAYER_STRIDE, heads, s.head_dim, proj.in_features,
                               gain=qk_gain, owner=i)
                continue
            for reg in _local_regions(proj, f"{l.name}.{p}"):
                # a grouped convolution's head is semi-orthogonal in the block of input channels it reads
                n = proj.block_in_features
                plan.add_heads(stream, l.index * LAYER_STRIDE, reg.view, s.head_dim, n,
                               row_lo=reg.r_lo, col_lo=reg.c_lo % n, gain=qk_gain, owner=i)
        why = s.v_identity_problem(v_mode)
        if why is not None:
            raise ValueError(f"{l.name}: v_mode={v_mode!r} cannot be written: {why}")
        for reg in (_local_regions(s.v, f"{l.name}.v") if "v" not in rep.shared else ()):
            plan.add_identity(reg.view, row_lo=reg.r_lo, col_lo=reg.c_lo,
                              head_dim=s.head_dim if v_mode == "identity_per_head" else None, gain=v_gain, owner=i)
        for p, proj in s.projections():
            if p in rep.shared:
                continue
            for bias in _local_biases(proj, f"{l.name}.{p} bias"):
                plan.add_zero(bias, owner=i)
    return plan, reports
