"""Attention adapters: where a module keeps its Q/K/V projections, in one declarative description.

An adapter turns an attention module into an :class:`AttentionSpec`: head counts and, for each of
Q, K and V, a :class:`Projection` saying which parameter holds it, which rows of the ``nn.Linear``
layout ``[out, in]`` matrix it occupies, and whether the parameter is stored transposed (``[in,
out]``, GPT-2's ``Conv1D``); a parameter of another shape is read as the matrix it reshapes to
(``matrix_shape``), a grouped convolution as a block-diagonal one (``in_groups``). Fused weights
hold three projections; in some models their rows alternate per head or per group of heads
(``layout``, see :func:`fused_layout`). From that
description :func:`condinit.apply` reads ``[rows, in]`` views and writes conditioned values back in
place, also into a shard of a DTensor (it only has to intersect row/column ranges), so an adapter
never copies or re-registers a parameter.

How a module is recognised (:func:`describe`), first match wins:

1. an adapter registered for its class, looked up along the MRO (a subclass of a supported class
   is supported; an adapter registered for ``nn.Module`` sees every module). An adapter returns
   ``None`` for a module it does not handle, and the lookup goes on;
2. its structure: three separate projections under one of the naming families of
   :data:`SEPARATE_NAMES` (``q_proj/k_proj/v_proj``, ``query/key/value``, T5's ``q/k/v``, ...), a
   ``q`` projection with a fused ``kv`` (:data:`Q_KV_NAMES`), a fused ``qk`` with a ``v``
   (:data:`QK_V_NAMES`), or one fused projection
   (:data:`FUSED_NAMES`: ``qkv``, ``Wqkv``, ``qkv_proj``, ``c_attn``, ``in_proj_weight``, ...). Head
   counts come from the module's attributes (``num_heads``, ``num_attention_heads``, ``n_heads``,
   ``num_key_value_heads``, ``head_dim``, ...) or its own ``config`` (``num_attention_heads``,
   ``num_key_value_heads``, ``head_dim``), and must agree with the projections' row counts. A
   projection may be an ``nn.Linear`` (or transformers' ``Conv1D``) or a wrapper holding exactly
   one (a clipping linear). A query projection whose rows alternate each head's query and output
   gate (Qwen3-Next, Qwen3.5: ``chunk(q_proj(x).view(..., -1, 2 * head_dim), 2)``, read from the
   source) has its query rows conditioned and its gate rows left alone.

Separate projections have one reading. A fused projection does not: ``[Q; K; V]`` thirds and
per-head interleaved ``[H, 3, d]`` rows have the same shape. Structure alone accepts a fused
projection only when the class's own source (``inspect.getsource``) splits it as contiguous parts:
a reshape to ``(..., 3, num_heads, head_dim)``, or a ``split`` / ``chunk`` of the projection's raw
output, assigned to query, key, value in that order. Everything else that looks like attention is
refused with a reason (:class:`UnsupportedAttention`), never guessed; the built-in adapters below
cover the interleaved layouts that were read from the models' code.

Registry keys are classes or ``"module.path.QualName"`` strings; built-in adapters for third-party
libraries are keyed by string so that neither transformers nor timm is imported by condinit.

Add your own in a few lines::

    from condinit.models import register_adapter, AttentionSpec

    register_adapter(MyAttention, lambda m: AttentionSpec.from_linears(
        m.wq, m.wk, m.wv, num_heads=m.n_heads, num_kv_heads=m.n_kv_heads))
    register_adapter(MyFused, lambda m: AttentionSpec.from_fused(      # rows [H, 3, d]
        m.wqkv.weight, num_heads=m.heads, bias=m.wqkv.bias, layout="per_head"))

Built in (explicit adapters): ``torch.nn.MultiheadAttention`` (fused ``in_proj_weight``, or
separate ``q/k/v_proj_weight`` with one shared bias; inside ``nn.Transformer*`` layers too), timm
``Attention`` (fused ``qkv``), GPT-2 and its copies (``Conv1D c_attn``, stored transposed;
cross-attention ``q_attn`` + ``c_attn`` = ``[K; V]``), GPT-NeoX, GPT-NeoX-Japanese, BLOOM,
Persimmon (``query_key_value``, ``[H, 3, d]``), Falcon (``[H, 3, d]``, multi-query ``[Q; K; V]``, or
the new decoder architecture's ``[H_kv, H/H_kv + 2, d]`` groups), GPTBigCode (multi-query ``[Q; K;
V]``, multi-head ``[H, 3d]``), Phi-3 (``qkv_proj``, ``[Q; K; V]`` with GQA), DeBERTa (``in_proj``
``[H, 3, d]`` with separate ``q_bias`` / ``v_bias``), CodeGen (``qkv_proj`` in 4 groups ordered
Q, V, K), XLNet (``[D, H, d]`` parameters, ``matrix_shape``), JetMoE (query experts ``[E, H_kv d,
D]`` plus ``kv_proj``), SqueezeBERT (grouped kernel-size-1 ``Conv1d``, ``in_groups``), AIMv2's
attention-pooling head (a learned query, ``fixed``). Refused with a reason: multi-head latent
attention (DeepSeek-V2/V3 and others: ``q_a_proj/q_b_proj``, ``kv_a_proj_with_mqa/kv_b_proj``),
linear attention (MiniMax lightning attention, gated delta nets, retention: no softmax),
Reformer's shared ``query_key``, deformable attention (no query or key projections), GPTBigCode
cross-attention, a grouped convolution whose heads span several groups.
:func:`looks_like_attention` says which unrecognised modules :func:`condinit.apply` must report
instead of skipping them. See ``docs/design.md``, "Model layouts".
"""
from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Union

import torch
from torch import nn

from condinit._validate import check_bool, check_choice, check_int, check_tensor

from .sharded import is_dtensor

__all__ = ["Projection", "AttentionSpec", "AttentionAdapter", "UnsupportedAttention", "Described", "LAYOUTS",
           "SEPARATE_NAMES", "Q_KV_NAMES", "QK_V_NAMES", "FUSED_NAMES", "fused_layout", "heads_of", "register_adapter",
           "unregister_adapter", "get_adapter", "registered_adapters", "describe", "spec_of", "looks_like_attention",
           "why_not_recognised"]

# Row layouts of a fused Q/K/V weight (see fused_layout).
LAYOUTS = ("contiguous", "per_head", "per_group", "grouped")


class UnsupportedAttention(ValueError):
    """An attention module that condinit recognises but does not condition; the message says why.

    Raised by :func:`describe` (and may be raised by a user adapter): :func:`condinit.apply` lists
    such modules in ``report.uncovered``, warns, and with ``strict=True`` refuses the model.
    """


@dataclass(frozen=True)
class Projection:
    """One of Q, K, V: rows of the nn.Linear-layout matrix held by ``weight``, in ``groups`` runs.

    ``weight`` is the parameter (``[out_total, in]``, or ``[in, out_total]`` when ``transposed``).
    Group ``g`` is rows ``start + g*stride : stop + g*stride``; the projection's logical ``[rows,
    in]`` matrix is its groups stacked in order (``rows = groups * (stop - start)``). One group (the
    default) is a plain row range: the whole first dimension for an unfused projection, a third of
    a ``[Q; K; V]`` weight. Several groups describe interleaved layouts, e.g. GPT-NeoX's
    ``[H, 3, d]``: Q is ``start=0, stop=d, groups=H, stride=3d``.

    ``matrix_shape`` (optional): the parameter is not 2-D, and this 2-D shape is the matrix it is
    read as (its row-major reshape, a view of the same storage), in which rows, ``transposed`` and
    the groups above are counted: XLNet's ``[D, H, d]`` query (``einsum("ibh,hnd->ibnd")``) is
    ``matrix_shape=(D, H*d), transposed=True``, a stack of expert projections ``[E, out, in]`` is
    ``(E*out, in)``, a ``Conv1d`` with kernel size 1 ``[out, in, 1]`` is ``(out, in)``. Writes go to
    the parameter itself.

    ``in_groups`` (optional, grouped convolutions): the matrix's rows form ``in_groups`` equal
    blocks and block ``b`` reads input channels ``b*C : (b+1)*C`` (``C`` the matrix's columns), so
    the logical matrix is block-diagonal, ``[rows, in_groups * C]``, with zeros the parameter does
    not store. Not with ``transposed``.

    ``fixed`` (Q only): the tensor is the query itself, a learned query of attention pooling (AIMv2's
    ``cls_token``), read as ``[H d, 1]`` (a projection of the constant 1, ``matrix_shape=(H d, 1)``).
    It is no projection of the tokens, so the method has no ``W_Q`` there: it is left as the model
    made it, and K and V are conditioned as in any layer.

    ``bias`` (optional, 1-D) holds group ``g``'s entries at ``bias_start + g*bias_stride`` onwards
    (``bias_start`` defaults to ``start``, ``bias_stride`` to ``stride``: a fused bias follows its
    weight).

    Examples:
        >>> w = torch.nn.Linear(64, 3 * 64).weight            # 4 heads of 16, rows [H, 3, d]
        >>> q = Projection(w, 0, 16, groups=4, stride=48)
        >>> q.rows, q.shape
        (64, (64, 64))
        >>> x = torch.nn.Parameter(torch.empty(64, 4, 16))    # XLNet: q_head = einsum("ibh,hnd->ibnd", h, x)
        >>> Projection(x, 0, 64, transposed=True, matrix_shape=(64, 64)).shape
        (64, 64)
        >>> c = torch.nn.Conv1d(64, 64, 1, groups=4).weight   # [64, 16, 1], block-diagonal [64, 64]
        >>> Projection(c, 0, 64, matrix_shape=(64, 16), in_groups=4).shape
        (64, 64)
    """

    weight: torch.Tensor
    start: int
    stop: int
    transposed: bool = False
    bias: Optional[torch.Tensor] = None
    bias_start: Optional[int] = None
    groups: int = 1
    stride: int = 0
    bias_stride: Optional[int] = None
    matrix_shape: Optional[tuple] = None
    in_groups: int = 1
    fixed: bool = False

    def __post_init__(self):
        if not isinstance(self.weight, torch.Tensor):
            raise TypeError(f"Projection: weight must be a tensor, got {type(self.weight).__name__}")
        if self.matrix_shape is None:
            if self.weight.dim() != 2:
                raise TypeError(f"Projection: weight must be a 2-D tensor, got shape {tuple(self.weight.shape)} "
                                f"(a parameter of another shape needs matrix_shape, the matrix it is read as)")
        else:
            shape = self.matrix_shape
            if not (isinstance(shape, tuple) and len(shape) == 2):
                raise TypeError(f"Projection: matrix_shape must be a tuple (rows, cols), got {shape!r}")
            for name, v in zip(("rows", "cols"), shape):
                check_int(f"Projection matrix_shape {name}", v, min=1)
            if shape[0] * shape[1] != self.weight.numel():
                raise ValueError(f"Projection: matrix_shape {shape} does not hold the {self.weight.numel()} "
                                 f"elements of a weight of shape {tuple(self.weight.shape)}")
            if not self.weight.is_meta and not is_dtensor(self.weight):
                try:
                    self.weight.detach().view(shape)
                except RuntimeError:
                    raise ValueError(f"Projection: a weight of shape {tuple(self.weight.shape)} and strides "
                                     f"{self.weight.stride()} cannot be viewed as matrix_shape {shape}") from None
        check_int("Projection start", self.start, min=0)
        check_int("Projection stop", self.stop, min=self.start + 1)
        check_bool("Projection transposed", self.transposed)
        check_int("Projection groups", self.groups, min=1)
        check_int("Projection stride", self.stride, min=0)
        check_int("Projection in_groups", self.in_groups, min=1)
        check_bool("Projection fixed", self.fixed)
        if self.fixed and self.bias is not None:
            raise ValueError("Projection: a fixed (learned) query has no bias")
        if self.groups > 1 and self.stride < self.stop - self.start:
            raise ValueError(f"Projection: stride {self.stride} is below the {self.stop - self.start} rows of a group: "
                             f"groups would overlap")
        size = self.storage_rows
        if self.span_stop > size:
            raise ValueError(f"Projection: rows up to {self.span_stop} of a weight with {size} "
                             f"{'columns (transposed)' if self.transposed else 'rows'}")
        if self.in_groups > 1:
            if self.transposed:
                raise ValueError("Projection: in_groups (a grouped convolution) with transposed=True")
            if size % self.in_groups:
                raise ValueError(f"Projection: {size} rows do not form {self.in_groups} equal blocks (in_groups)")
        if self.bias is not None:
            if not isinstance(self.bias, torch.Tensor) or self.bias.dim() != 1:
                raise TypeError(f"Projection: bias must be a 1-D tensor or None, got {type(self.bias).__name__}")
            check_int("Projection bias_start", self.bias_start, min=0, allow_none=True)
            check_int("Projection bias_stride", self.bias_stride, min=0, allow_none=True)
            end = self.bias_offset + (self.groups - 1) * self.bias_step + self.group_rows
            if end > self.bias.shape[0]:
                raise ValueError(f"Projection: bias entries up to {end} of a bias with {self.bias.shape[0]}")

    @property
    def storage_shape(self) -> tuple:
        """Shape of the matrix the rows are counted in: ``matrix_shape``, or the weight's own."""
        return tuple(self.matrix_shape) if self.matrix_shape is not None else tuple(self.weight.shape)

    @property
    def storage_rows(self) -> int:
        """Rows of that matrix (its columns when ``transposed``): the extent ``start`` / ``stop`` index."""
        return self.storage_shape[1 if self.transposed else 0]

    @property
    def group_rows(self) -> int:
        return self.stop - self.start

    @property
    def rows(self) -> int:
        return self.groups * self.group_rows

    @property
    def span_stop(self) -> int:
        """One past the last storage row (column when transposed) the projection occupies."""
        return self.start + (self.groups - 1) * self.stride + self.group_rows

    @property
    def bias_offset(self) -> int:
        return self.start if self.bias_start is None else self.bias_start

    @property
    def bias_step(self) -> int:
        return self.stride if self.bias_stride is None else self.bias_stride

    @property
    def block_in_features(self) -> int:
        """Input columns one stored row reads: ``in_features`` / ``in_groups``."""
        shape = self.storage_shape
        return shape[0] if self.transposed else shape[1]

    @property
    def block_rows(self) -> int:
        """Storage rows per block of a grouped convolution (all rows for ``in_groups=1``)."""
        return self.storage_rows // self.in_groups

    @property
    def in_features(self) -> int:
        return self.block_in_features * self.in_groups

    @property
    def shape(self) -> tuple[int, int]:
        """Logical ``[rows, in_features]`` (nn.Linear layout)."""
        return (self.rows, self.in_features)

    def matrix(self, t: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The (plain, non-DTensor) weight, or ``t`` shaped like it, as the 2-D matrix of
        ``storage_shape``: a view, writes go through. Detached."""
        w = (self.weight if t is None else t).detach()
        return w if self.matrix_shape is None else w.view(self.storage_shape)

    def local_matrix(self, local: torch.Tensor, offset: tuple, name: str) -> tuple[torch.Tensor, tuple]:
        """The local part of the weight (``condinit.models.sharded.local_part``) as a part of the
        2-D matrix: ``(view, (row offset, col offset))``. A weight read through ``matrix_shape`` or
        ``in_groups`` must be held whole (a shard of it is no block of the matrix)."""
        if self.matrix_shape is None and self.in_groups == 1:
            return local, offset
        if tuple(local.shape) != tuple(self.weight.shape) or any(offset):
            raise ValueError(f"{name}: a sharded weight of shape {tuple(self.weight.shape)} read as a "
                             f"{self.storage_shape} matrix (matrix_shape, in_groups) is not supported; gather it on "
                             f"each rank first")
        return local.view(self.storage_shape), (0, 0)

    def segments(self) -> list[tuple[int, int, int]]:
        """``(logical_row, storage_lo, storage_hi)`` per group: storage rows ``lo:hi`` (columns when
        transposed) hold logical rows ``logical_row : logical_row + hi - lo``."""
        n = self.group_rows
        return [(g * n, self.start + g * self.stride, self.stop + g * self.stride) for g in range(self.groups)]

    def blocks(self) -> list[tuple[int, int, int, int]]:
        """``(logical_row, storage_lo, storage_hi, logical_col)``: :meth:`segments` cut at the blocks
        of a grouped convolution; the stored rows ``lo:hi`` read logical input columns
        ``logical_col : logical_col + block_in_features`` (``logical_col`` 0 without ``in_groups``)."""
        if self.in_groups == 1:
            return [(r, lo, hi, 0) for r, lo, hi in self.segments()]
        out, n, c = [], self.block_rows, self.block_in_features
        for r, lo, hi in self.segments():
            at = lo
            while at < hi:
                end = min(hi, (at // n + 1) * n)
                out.append((r + at - lo, at, end, (at // n) * c))
                at = end
        return out

    def bias_segments(self) -> list[tuple[int, int]]:
        """``(lo, hi)`` entries of ``bias`` per group (empty without a bias)."""
        if self.bias is None:
            return []
        n, at, step = self.group_rows, self.bias_offset, self.bias_step
        return [(at + g * step, at + g * step + n) for g in range(self.groups)]

    def view(self, t: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[rows, in]`` of the (plain, non-DTensor) weight in nn.Linear layout: a view (writes go
        through) for one group, a copy of the groups stacked for several, and a block-diagonal copy
        (zeros where a grouped convolution stores nothing) with ``in_groups``."""
        w = self.matrix(t)
        if self.in_groups > 1:
            out = w.new_zeros(self.shape)
            c = self.block_in_features
            for r, lo, hi, col in self.blocks():
                out[r:r + hi - lo, col:col + c] = w[lo:hi]
            return out
        parts = [w[:, lo:hi].t() if self.transposed else w[lo:hi] for _, lo, hi in self.segments()]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def read_bias(self) -> Optional[torch.Tensor]:
        """This projection's ``[rows]`` bias entries (a view for one group, a copy for several), or None."""
        if self.bias is None:
            return None
        b = self.bias.detach()
        parts = [b[lo:hi] for lo, hi in self.bias_segments()]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass(frozen=True)
class AttentionSpec:
    """What :func:`condinit.apply` needs to know about one attention module.

    ``q`` has ``num_heads * head_dim`` rows, ``k`` and ``v`` ``num_kv_heads * head_dim`` (GQA/MQA when
    ``num_kv_heads < num_heads``; it must divide ``num_heads``). Head ``h`` of Q is logical rows
    ``h*head_dim:(h+1)*head_dim`` (a group of a :class:`Projection` holds whole heads). Projections
    sharing a weight must not share rows. Every check runs at construction, so a wrong description
    fails before anything is written.

    Examples:
        >>> w = torch.nn.MultiheadAttention(64, 4).in_proj_weight          # fused [3 * 64, 64]
        >>> AttentionSpec(Projection(w, 0, 64), Projection(w, 64, 128), Projection(w, 128, 192),
        ...               num_heads=4, num_kv_heads=4, head_dim=16)
        >>> AttentionSpec.from_fused(w, num_heads=4)                       # the same, in one call
    """

    q: Projection
    k: Projection
    v: Projection
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self):
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            check_int(name, getattr(self, name), min=1)
        for name, p in self.projections():
            if not isinstance(p, Projection):
                raise TypeError(f"AttentionSpec: {name} must be a Projection, got {type(p).__name__}")
        if self.k.fixed or self.v.fixed:
            raise ValueError("AttentionSpec: only q can be fixed (a learned query)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"AttentionSpec: num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if self.q.rows != self.num_heads * self.head_dim:
            raise ValueError(f"AttentionSpec: q has {self.q.rows} rows, expected num_heads * head_dim = "
                             f"{self.num_heads} * {self.head_dim}")
        for name, p in (("k", self.k), ("v", self.v)):
            if p.rows != self.num_kv_heads * self.head_dim:
                raise ValueError(f"AttentionSpec: {name} has {p.rows} rows, expected num_kv_heads * head_dim"
                                 f" = {self.num_kv_heads} * {self.head_dim}")
        for name, p in self.projections():
            if p.group_rows % self.head_dim:
                raise ValueError(f"AttentionSpec: {name} groups of {p.group_rows} rows do not hold whole heads of "
                                 f"head_dim {self.head_dim}")
        spans: dict[int, list] = {}
        for name, p in self.projections():
            spans.setdefault(id(p.weight), []).extend((lo, hi, name) for _, lo, hi in p.segments())
        for iv in spans.values():
            iv.sort()
            for (lo0, hi0, n0), (lo1, hi1, n1) in zip(iv, iv[1:]):
                if lo1 < hi0:
                    raise ValueError(f"AttentionSpec: {n0} and {n1} share rows {lo1}:{min(hi0, hi1)} of one weight")
        d = self.head_dim
        for name, p in (("q", self.q), ("k", self.k)):
            # a head's block is semi-orthogonal only if its rows read one block of input channels
            for r, lo, hi, _ in p.blocks() if p.in_groups > 1 else ():
                if r % d or (hi - lo) % d:
                    raise UnsupportedAttention(
                        f"{name}: a grouped convolution with {p.in_groups} groups of {p.block_rows} output channels "
                        f"and heads of head_dim {d}: a head's rows span several groups, so its block is "
                        f"block-diagonal, which condinit's per-head draw does not produce (it conditions grouped "
                        f"projections whose every head lies in one group)")
        self.v_identity_problem("identity", raise_it=True)

    def v_identity_problem(self, v_mode: str, raise_it: bool = False) -> Optional[str]:
        """Why V's rectangular identity (``v_mode`` ``"identity"`` or ``"identity_per_head"``)
        cannot be written into a block-diagonal (grouped convolution) V, or None when it can."""
        v = self.v
        if v.in_groups == 1:
            return None
        c, why = v.block_in_features, None
        for r, lo, hi, col in v.blocks():
            for i in range(r, r + hi - lo):
                j = i if v_mode == "identity" else i % self.head_dim
                if j < v.in_features and not col <= j < col + c:
                    why = (f"v: the {'rectangular identity' if v_mode == 'identity' else 'per-head identity'} has "
                           f"a one at row {i}, column {j}, outside the input channels {col}:{col + c} its group of "
                           f"the grouped convolution reads")
                    break
            if why:
                break
        if why and raise_it:
            raise UnsupportedAttention(why)
        return why

    def projections(self):
        return (("q", self.q), ("k", self.k), ("v", self.v))

    @property
    def layout(self) -> str:
        """``"separate"`` (three weights), or the fused layout: ``"contiguous"``, ``"per_head"``,
        ``"per_group"``, ``"grouped"`` (see :func:`fused_layout`), ``"mixed"`` otherwise."""
        ws = {id(p.weight) for _, p in self.projections()}
        if len(ws) == 3:
            return "separate"
        g = self.q.groups
        if len(ws) == 2 or {p.groups for _, p in self.projections()} != {g}:
            return "mixed" if g > 1 or self.k.groups > 1 or self.v.groups > 1 else "separate"
        if g == 1:
            return "contiguous"
        if g == self.num_heads and self.num_heads == self.num_kv_heads:
            return "per_head"
        return "per_group" if g == self.num_kv_heads else "grouped"

    @classmethod
    def from_linears(cls, q: nn.Module, k: nn.Module, v: nn.Module, *, num_heads: int,
                     num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None) -> "AttentionSpec":
        """Spec for three separate ``nn.Linear``-like modules (``.weight`` ``[out, in]``, ``.bias``).

        ``head_dim`` defaults to ``q.out_features / num_heads``; ``num_kv_heads`` to ``k``'s row count
        divided by ``head_dim`` (so GQA needs no extra argument).

        Examples:
            >>> register_adapter(MyAttention, lambda m: AttentionSpec.from_linears(
            ...     m.wq, m.wk, m.wv, num_heads=m.n_heads))                # GQA read from wk's rows
        """
        return cls.from_weights(q.weight, k.weight, v.weight, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                head_dim=head_dim, q_bias=getattr(q, "bias", None),
                                k_bias=getattr(k, "bias", None), v_bias=getattr(v, "bias", None))

    @classmethod
    def from_weights(cls, q_weight, k_weight, v_weight, *, num_heads: int, num_kv_heads: Optional[int] = None,
                     head_dim: Optional[int] = None, q_bias=None, k_bias=None, v_bias=None) -> "AttentionSpec":
        """Spec for three separate ``[out, in]`` weight tensors (and optional biases).

        Examples:
            >>> m = torch.nn.MultiheadAttention(24, 4, kdim=17, vdim=33)
            >>> AttentionSpec.from_weights(m.q_proj_weight, m.k_proj_weight, m.v_proj_weight, num_heads=4)
        """
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight), ("v_weight", v_weight)):
            check_tensor(name, w, dim=2)
        _check_heads(num_heads, num_kv_heads, head_dim)
        head_dim = _head_dim(q_weight.shape[0], num_heads, head_dim)
        if num_kv_heads is None:
            if k_weight.shape[0] % head_dim:
                raise ValueError(f"k has {k_weight.shape[0]} rows, not a multiple of head_dim {head_dim}")
            num_kv_heads = k_weight.shape[0] // head_dim
        return cls(Projection(q_weight, 0, q_weight.shape[0], bias=q_bias),
                   Projection(k_weight, 0, k_weight.shape[0], bias=k_bias),
                   Projection(v_weight, 0, v_weight.shape[0], bias=v_bias),
                   num_heads, int(num_kv_heads), head_dim)

    @classmethod
    def from_fused(cls, weight, *, num_heads: int, num_kv_heads: Optional[int] = None,
                   head_dim: Optional[int] = None, bias=None, transposed: bool = False,
                   order: str = "qkv", layout: str = "contiguous", groups: Optional[int] = None) -> "AttentionSpec":
        """Spec for one fused weight holding Q, K and V along its output dimension.

        ``weight`` is ``[(H + 2 H_kv) d, in]`` (``[in, ...]`` when ``transposed``); ``bias`` (optional)
        is laid out like its rows. ``layout`` says how the rows alternate (:func:`fused_layout`):
        ``"contiguous"`` ``[Q; K; V]``, ``"per_head"`` ``[H, 3, d]`` (GPT-NeoX, BLOOM, Falcon-RW,
        GPTBigCode), ``"per_group"`` ``[H_kv, H/H_kv + 2, d]`` (Falcon's new decoder architecture),
        ``"grouped"`` with ``groups=n``; ``order`` is the order of Q, K, V inside each group. Read
        the layout from the model's ``forward``: the shapes of all layouts agree.

        Examples:
            >>> AttentionSpec.from_fused(timm_attn.qkv.weight, num_heads=12, bias=timm_attn.qkv.bias)
            >>> AttentionSpec.from_fused(gpt2_attn.c_attn.weight, num_heads=12, transposed=True)  # Conv1D
            >>> AttentionSpec.from_fused(neox_attn.query_key_value.weight, num_heads=16,
            ...                          bias=neox_attn.query_key_value.bias, layout="per_head")
        """
        check_tensor("weight", weight, dim=2)
        transposed = check_bool("transposed", transposed)
        total = weight.shape[1] if transposed else weight.shape[0]
        parts = fused_layout(total, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, order=order,
                             layout=layout, groups=groups)
        H, Hkv, d = parts.pop("heads")
        projs = {name: Projection(weight, start, stop, transposed, bias, groups=n, stride=stride)
                 for name, (start, stop, n, stride) in parts.items()}
        return cls(projs["q"], projs["k"], projs["v"], H, Hkv, d)


def fused_layout(total_rows: int, *, num_heads: int, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, order: str = "qkv", layout: str = "contiguous",
                 groups: Optional[int] = None) -> dict:
    """Where Q, K and V sit in a fused weight of ``total_rows`` output rows.

    The rows form ``n`` equal groups; each holds ``H/n`` query heads, ``H_kv/n`` key heads and
    ``H_kv/n`` value heads, as three runs in ``order`` (head ``h`` of Q is in group ``h // (H/n)``).
    ``layout`` picks ``n``: ``"contiguous"`` 1 (``[Q; K; V]``), ``"per_head"`` ``H`` (``[H, 3, d]``,
    needs ``H_kv == H``), ``"per_group"`` ``H_kv`` (``[H_kv, H/H_kv + 2, d]``), ``"grouped"``
    ``groups`` (e.g. CodeGen's 4 model-parallel groups). ``num_kv_heads`` defaults to ``num_heads``,
    ``head_dim`` to ``total_rows / (H + 2 H_kv)``.

    Returns ``{"q": (start, stop, n, stride), "k": ..., "v": ..., "heads": (H, H_kv, d)}``: the
    first group's rows and the distance between groups, as :class:`Projection` takes them.

    Examples:
        >>> fused_layout(48, num_heads=4, layout="per_head")["k"]
        (4, 8, 4, 12)
        >>> fused_layout(48, num_heads=4)["k"]
        (16, 32, 1, 16)
    """
    check_int("total_rows", total_rows, min=1)
    _check_heads(num_heads, num_kv_heads, head_dim)
    check_choice("layout", layout, LAYOUTS)
    check_int("groups", groups, min=1, allow_none=True)
    if not isinstance(order, str) or sorted(order) != ["k", "q", "v"]:
        raise ValueError(f"order must be a permutation of 'qkv', got {order!r}")
    H = num_heads
    Hkv = H if num_kv_heads is None else num_kv_heads
    if H % Hkv:
        raise ValueError(f"num_kv_heads={Hkv} must divide num_heads={H}")
    if (layout == "grouped") != (groups is not None):
        raise ValueError("groups is given exactly when layout='grouped'" if groups is not None
                         else "layout='grouped' needs groups=n")
    if layout == "per_head" and Hkv != H:
        raise ValueError(f"layout='per_head' needs num_kv_heads == num_heads, got {Hkv} and {H}; a [H_kv, H/H_kv "
                         f"+ 2, d] weight is layout='per_group'")
    n = {"contiguous": 1, "per_head": H, "per_group": Hkv, "grouped": groups}[layout]
    if H % n or Hkv % n:
        raise ValueError(f"{n} groups must divide num_heads={H} and num_kv_heads={Hkv}")
    if head_dim is None:
        if total_rows % (H + 2 * Hkv):
            raise ValueError(f"fused weight with {total_rows} output rows does not split into "
                             f"{H} + 2 x {Hkv} heads")
        head_dim = total_rows // (H + 2 * Hkv)
    d = head_dim
    if (H + 2 * Hkv) * d != total_rows:
        raise ValueError(f"fused weight has {total_rows} output rows, expected (num_heads + 2 * num_kv_heads) * "
                         f"head_dim = ({H} + 2 * {Hkv}) * {d} = {(H + 2 * Hkv) * d}")
    sizes = {"q": H // n * d, "k": Hkv // n * d, "v": Hkv // n * d}
    stride = sum(sizes.values())
    out, at = {}, 0
    for name in order:
        out[name] = (at, at + sizes[name], n, stride if n > 1 else 0)
        at += sizes[name]
    out["heads"] = (H, Hkv, d)
    return out


def _check_heads(num_heads, num_kv_heads, head_dim) -> None:
    check_int("num_heads", num_heads, min=1)
    check_int("num_kv_heads", num_kv_heads, min=1, allow_none=True)
    check_int("head_dim", head_dim, min=1, allow_none=True)


def _head_dim(rows: int, num_heads: int, head_dim: Optional[int]) -> int:
    if head_dim is None:
        if rows % num_heads:
            raise ValueError(f"q has {rows} rows, not divisible by num_heads={num_heads}")
        head_dim = rows // num_heads
    return int(head_dim)


class AttentionAdapter:
    """Maps one kind of attention module to its :class:`AttentionSpec`.

    Subclass and override :meth:`spec` (and set ``name``), or pass any callable ``module -> AttentionSpec``
    to :func:`register_adapter`, which wraps it in this class. ``spec`` returns None for a module it
    does not handle (the lookup goes on, see :func:`describe`) and raises
    :class:`UnsupportedAttention` for one that must not be conditioned.
    """

    name = "custom"

    def __init__(self, fn: Optional[Callable[[nn.Module], Optional[AttentionSpec]]] = None,
                 name: Optional[str] = None):
        self._fn = fn
        if name is not None:
            self.name = name
        elif fn is not None:
            self.name = getattr(fn, "__name__", "custom")

    def spec(self, module: nn.Module) -> Optional[AttentionSpec]:
        if self._fn is None:
            raise NotImplementedError(f"{type(self).__name__}.spec")
        return self._fn(module)

    def __repr__(self):
        return f"<AttentionAdapter {self.name}>"


# ------------------------------------------------------------------------------------------------
# head counts, from the module's attributes or its own config

_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "heads", "num_head", "num_attn_heads")
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads", "n_kv_head")
_HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim", "d_head", "dim_head")
_HEAD_CFG = ("num_attention_heads", "n_head", "n_heads", "num_heads")
_KV_HEAD_CFG = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
_HEAD_DIM_CFG = ("head_dim", "d_kv", "kv_channels")


def _int_attr(obj, names) -> tuple[Optional[int], Optional[str]]:
    """The first attribute of ``names`` on ``obj`` that is an int >= 1, and its name."""
    for n in names:
        try:
            v = getattr(obj, n, None)
        except (AttributeError, KeyError, NotImplementedError):  # a config property without a value
            v = None
        if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
            return v, n
    return None, None


def _own_config(m: nn.Module):
    cfg = getattr(m, "config", None)
    return None if cfg is None or isinstance(cfg, (nn.Module, dict, torch.Tensor)) else cfg


def heads_of(m: nn.Module, q_rows: int, k_rows: int, *, num_heads: Optional[int] = None,
             num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None) -> tuple[int, int, int]:
    """``(num_heads, num_kv_heads, head_dim)`` of attention module ``m`` with ``q_rows`` query rows and
    ``k_rows`` key rows: given values first, then ``m``'s attributes, then ``m.config``; missing ones
    derived from the row counts. Raises :class:`UnsupportedAttention` when the number of heads is
    nowhere to be found, ValueError when what was found contradicts the rows."""
    cfg = _own_config(m)
    src_h = "given"
    if num_heads is None:
        num_heads, src_h = _int_attr(m, _HEAD_ATTRS)
        src_h = f"attribute {src_h}" if num_heads is not None else None
    if num_heads is None and cfg is not None:
        num_heads, src_h = _int_attr(cfg, _HEAD_CFG)
        src_h = f"config.{src_h}" if num_heads is not None else None
    if num_heads is None:
        raise UnsupportedAttention(f"cannot find the number of heads (no attribute {', '.join(_HEAD_ATTRS)}, and no "
                                   f"config.num_attention_heads)")
    H = num_heads
    src_d = "given"
    if head_dim is None:
        head_dim, src_d = _int_attr(m, _HEAD_DIM_ATTRS)
        src_d = f"attribute {src_d}" if head_dim is not None else None
    if head_dim is None and cfg is not None:
        cd, name = _int_attr(cfg, _HEAD_DIM_CFG)
        if cd is not None and cd * H == q_rows:   # a config value is used only where it fits the rows
            head_dim, src_d = cd, f"config.{name}"
    if head_dim is None:
        if q_rows % H:
            raise ValueError(f"q has {q_rows} rows, not divisible by {H} heads ({src_h})")
        head_dim = q_rows // H
    d = head_dim
    if H * d != q_rows:
        raise ValueError(f"q has {q_rows} rows, but {H} heads ({src_h}) of head_dim {d} ({src_d}) need {H * d}")
    src_kv = "given"
    if num_kv_heads is None:
        num_kv_heads, src_kv = _int_attr(m, _KV_HEAD_ATTRS)
        src_kv = f"attribute {src_kv}" if num_kv_heads is not None else None
        groups, _ = _int_attr(m, ("num_key_value_groups",))
        if num_kv_heads is None and groups is not None and H % groups == 0:
            num_kv_heads, src_kv = H // groups, "num_heads / attribute num_key_value_groups"
    if num_kv_heads is None and cfg is not None:
        ckv, name = _int_attr(cfg, _KV_HEAD_CFG)
        if ckv is not None and ckv * d == k_rows:
            num_kv_heads, src_kv = ckv, f"config.{name}"
    if num_kv_heads is None:
        if k_rows % d:
            raise ValueError(f"k has {k_rows} rows, not a multiple of head_dim {d}")
        num_kv_heads, src_kv = k_rows // d, "k rows / head_dim"
    Hkv = num_kv_heads
    if Hkv * d != k_rows:
        raise ValueError(f"k has {k_rows} rows, but {Hkv} key/value heads ({src_kv}) of head_dim {d} need {Hkv * d}")
    if H % Hkv:
        raise ValueError(f"{Hkv} key/value heads ({src_kv}) do not divide {H} heads ({src_h})")
    return H, Hkv, d


# ------------------------------------------------------------------------------------------------
# built-in adapters (layouts read from each model's own forward)

def _mha_spec(m: nn.MultiheadAttention) -> AttentionSpec:
    if m._qkv_same_embed_dim:
        return AttentionSpec.from_fused(m.in_proj_weight, num_heads=m.num_heads, bias=m.in_proj_bias)
    e = m.embed_dim
    b = m.in_proj_bias
    # Separate weights (kdim/vdim differ from embed_dim) still share one [3E] in_proj_bias.
    return AttentionSpec(Projection(m.q_proj_weight, 0, e, bias=b, bias_start=0),
                         Projection(m.k_proj_weight, 0, e, bias=b, bias_start=e),
                         Projection(m.v_proj_weight, 0, e, bias=b, bias_start=2 * e),
                         m.num_heads, m.num_heads, m.head_dim)


def _hf_gpt2(m: nn.Module) -> AttentionSpec:
    """HF GPT-2 and its copies: Conv1D stores ``weight`` as ``[in, out]`` (x @ W + b); ``c_attn``
    fuses Q, K, V, split with ``.split(split_size, dim=2)`` (K, V for cross-attention, whose Q is
    ``q_attn``)."""
    cross = getattr(m, "is_cross_attention", False) is True
    e = m.c_attn.weight.shape[1] // (2 if cross else 3)
    H, _, d = heads_of(m, e, e)
    if cross:
        e = H * d
        return AttentionSpec(Projection(m.q_attn.weight, 0, e, True, m.q_attn.bias),
                             Projection(m.c_attn.weight, 0, e, True, m.c_attn.bias),
                             Projection(m.c_attn.weight, e, 2 * e, True, m.c_attn.bias), H, H, d)
    return AttentionSpec.from_fused(m.c_attn.weight, num_heads=H, head_dim=d, bias=m.c_attn.bias, transposed=True)


def _timm_attention(m: nn.Module) -> AttentionSpec:
    """timm ``Attention``: fused ``qkv`` Linear ``[3 H d, D]`` in q, k, v order."""
    return AttentionSpec.from_fused(m.qkv.weight, num_heads=m.num_heads, head_dim=m.head_dim, bias=m.qkv.bias)


def _fused_linear(m: nn.Module, attr: str, layout: str, *, num_heads=None, num_kv_heads=None, head_dim=None,
                  order: str = "qkv", groups: Optional[int] = None) -> AttentionSpec:
    lin = getattr(m, attr)
    total = lin.weight.shape[0]
    if num_heads is None:
        num_heads, _ = _int_attr(m, _HEAD_ATTRS)
        if num_heads is None and _own_config(m) is not None:
            num_heads, _ = _int_attr(_own_config(m), _HEAD_CFG)
        if num_heads is None:
            raise UnsupportedAttention("cannot find the number of heads")
    if head_dim is None:
        head_dim, _ = _int_attr(m, _HEAD_DIM_ATTRS)
    return AttentionSpec.from_fused(lin.weight, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                    bias=lin.bias, order=order, layout=layout, groups=groups)


def _hf_per_head(attr: str):
    """``[H, 3, d]`` rows: GPT-NeoX (``view(..., -1, 3 * head_size).chunk(3)``), GPT-NeoX-Japanese,
    BLOOM and Persimmon (``view(..., num_heads, 3, head_dim)``)."""
    def spec(m):
        return _fused_linear(m, attr, "per_head")
    spec.__name__ = f"per_head_{attr}"
    return spec


def _hf_falcon(m: nn.Module) -> AttentionSpec:
    """Falcon's ``_split_heads``: the new decoder architecture views ``query_key_value`` as
    ``[H_kv, H/H_kv + 2, d]`` (a group's query heads, its key, its value); multi-query as ``[H + 2,
    d]`` (``[Q; K; V]`` with one K/V head); otherwise ``[H, 3, d]`` (Falcon-RW)."""
    H, d = m.num_heads, m.head_dim
    if m.new_decoder_architecture:
        return _fused_linear(m, "query_key_value", "per_group", num_heads=H, num_kv_heads=m.num_kv_heads, head_dim=d)
    if m.multi_query:
        return _fused_linear(m, "query_key_value", "contiguous", num_heads=H, num_kv_heads=1, head_dim=d)
    return _fused_linear(m, "query_key_value", "per_head", num_heads=H, head_dim=d)


def _hf_gpt_bigcode(m: nn.Module) -> AttentionSpec:
    """GPTBigCode: multi-query ``c_attn(x).split((embed_dim, kv_dim, kv_dim))`` is ``[Q; K; V]``
    with one K/V head; multi-head ``view(..., num_heads, 3 * head_dim).split(head_dim)`` is per
    head. Its cross-attention splits ``c_attn`` into ``(head_dim, head_dim)``, which fits no
    multi-head layout: refused."""
    if getattr(m, "is_cross_attention", False):
        raise UnsupportedAttention("GPTBigCode cross-attention: its forward splits c_attn(encoder states) into "
                                   "(head_dim, head_dim), which holds K and V only for a single head")
    if m.multi_query:
        return _fused_linear(m, "c_attn", "contiguous", num_heads=m.num_heads, num_kv_heads=1, head_dim=m.head_dim)
    return _fused_linear(m, "c_attn", "per_head", num_heads=m.num_heads, head_dim=m.head_dim)


def _hf_phi3(m: nn.Module) -> AttentionSpec:
    """Phi-3 ``qkv_proj``: ``qkv[..., :H d]``, then ``H_kv d`` key rows, then the values."""
    H, _ = _int_attr(m.config, ("num_attention_heads",))
    return _fused_linear(m, "qkv_proj", "contiguous", num_heads=H, num_kv_heads=m.num_key_value_heads,
                         head_dim=m.head_dim)


def _hf_deberta(m: nn.Module) -> AttentionSpec:
    """DeBERTa (v1) ``DisentangledSelfAttention``: ``in_proj`` (no bias) read through
    ``view(..., H, -1).chunk(3, dim=-1)``, so rows ``[H, 3, d]``; Q and V biases are separate
    ``[H d]`` parameters ``q_bias`` / ``v_bias`` (K has none)."""
    H, d = m.num_attention_heads, m.attention_head_size
    w = m.in_proj.weight
    if m.in_proj.bias is not None:
        raise UnsupportedAttention("DeBERTa in_proj with its own bias: not the layout of transformers' "
                                   "DisentangledSelfAttention")
    return AttentionSpec(Projection(w, 0, d, groups=H, stride=3 * d, bias=m.q_bias, bias_start=0, bias_stride=d),
                         Projection(w, d, 2 * d, groups=H, stride=3 * d),
                         Projection(w, 2 * d, 3 * d, groups=H, stride=3 * d, bias=m.v_bias, bias_start=0,
                                    bias_stride=d), H, H, d)


def _hf_codegen(m: nn.Module) -> AttentionSpec:
    """CodeGen ``qkv_proj``: ``view(..., mp_num, 3 * local_dim).split(local_dim)`` assigned to
    query, value, key: ``mp_num`` (4) groups of ``[Q; V; K]``."""
    return _fused_linear(m, "qkv_proj", "grouped", num_heads=m.num_attention_heads, head_dim=m.head_dim,
                         order="qvk", groups=m.mp_num)


def _hf_xlnet(m: nn.Module) -> AttentionSpec:
    """XLNet ``XLNetRelativeAttention``: parameters ``q``, ``k``, ``v`` of shape ``[D, H, d]`` used as
    ``einsum("ibh,hnd->ibnd", x, W)``, i.e. ``x @ W.reshape(D, H * d)``: an ``[in, out]`` matrix
    (transposed) whose column ``h*d + i`` is channel ``i`` of head ``h``. The projections have no
    biases; ``r_w_bias``, ``r_r_bias`` and ``r_s_bias`` are the per-head vectors of the relative
    attention's content, position and segment terms (Transformer-XL's ``u``, ``v``), left as the
    model made them with ``r`` and ``seg_embed``, like every relative-position parameter."""
    H, d = m.n_head, m.d_head
    projs = []
    for name in ("q", "k", "v"):
        w = getattr(m, name)
        if tuple(w.shape) != (m.d_model, H, d):
            raise UnsupportedAttention(f"XLNet {name} has shape {tuple(w.shape)}, not (d_model, n_head, d_head) = "
                                       f"({m.d_model}, {H}, {d}): not the layout of transformers' "
                                       f"XLNetRelativeAttention")
        projs.append(Projection(w, 0, H * d, transposed=True, matrix_shape=(m.d_model, H * d)))
    return AttentionSpec(*projs, H, H, d)


def _hf_jetmoe(m: nn.Module) -> AttentionSpec:
    """JetMoE's mixture of attention heads (``JetMoeAttention``): expert ``e`` of
    ``experts.input_linear`` (``[E, H_kv d, D]``, ``F.linear(x, weight[e])``) projects the query of
    ``H_kv`` heads; a token's ``top_k`` experts give its ``top_k * H_kv`` query heads
    (``view(..., -1, head_dim)``), and query head ``s * H_kv + j`` attends to key/value head ``j``
    of ``kv_proj`` (``chunk(2)``: ``[K; V]``, then ``repeat(1, top_k, 1, 1)``). Q is every
    expert's heads, ``E * H_kv`` of them (expert ``e``'s head ``j`` is head ``e * H_kv + j``), each
    semi-orthogonal; the router, the output experts and the layer's bias are not Q/K/V."""
    Hkv, d = m.num_key_value_heads, m.head_dim
    w = m.experts.input_linear.weight
    kv = m.kv_proj
    E, rows, D = w.shape
    if rows != Hkv * d or kv.weight.shape[0] != 2 * Hkv * d:
        raise UnsupportedAttention(f"JetMoE query experts of {rows} rows and kv_proj of {kv.weight.shape[0]} rows "
                                   f"do not hold {Hkv} heads of head_dim {d} (and twice that): not the layout of "
                                   f"transformers' JetMoeAttention")
    q = Projection(w, 0, E * rows, matrix_shape=(E * rows, D))
    k = Projection(kv.weight, 0, Hkv * d, bias=kv.bias)
    v = Projection(kv.weight, Hkv * d, 2 * Hkv * d, bias=kv.bias)
    return AttentionSpec(q, k, v, E * Hkv, Hkv, d)


def _hf_aimv2_pooling(m: nn.Module) -> AttentionSpec:
    """AIMv2's attention-pooling head (``Aimv2AttentionPoolingHead``): the query is the learned
    ``cls_token`` (``[1, 1, D]`` reshaped to ``(1, H, D / H)``), the keys and values ``k_proj`` /
    ``v_proj`` of the tokens, ``F.scaled_dot_product_attention`` per head. The query is no
    projection (``fixed``: left as the model made it); K and V are conditioned."""
    H, D = m.num_heads, m.hidden_size
    if D % H or m.cls_token.numel() != D:
        raise UnsupportedAttention(f"AIMv2 pooling head with hidden_size {D}, {H} heads and a cls_token of "
                                   f"{m.cls_token.numel()} entries: not the layout of transformers' "
                                   f"Aimv2AttentionPoolingHead")
    q = Projection(m.cls_token, 0, D, matrix_shape=(D, 1), fixed=True)
    return AttentionSpec(q, _lin_proj(m.k_proj), _lin_proj(m.v_proj), H, H, D // H)


def _hf_squeezebert(m: nn.Module) -> AttentionSpec:
    """SqueezeBERT ``SqueezeBertSelfAttention``: ``query``, ``key``, ``value`` are ``nn.Conv1d(C, C,
    kernel_size=1, groups=g)`` on ``[N, C, W]`` (weight ``[C, C/g, 1]``: a block-diagonal ``[C, C]``
    matrix, ``in_groups=g``), read per head through ``view(N, H, d, W)``. A head is conditioned in
    the ``C/g`` input channels its group reads; a head whose rows span two groups is refused, and
    so is a V whose identity would need entries outside its groups (see :class:`Projection`)."""
    H, d = m.num_attention_heads, m.attention_head_size
    projs = []
    for name in ("query", "key", "value"):
        conv = getattr(m, name)
        if not (isinstance(conv, nn.Conv1d) and conv.kernel_size == (1,) and conv.stride == (1,)
                and conv.padding in ((0,), "valid") and conv.dilation == (1,)):
            raise UnsupportedAttention(f"SqueezeBERT {name} is not a Conv1d with kernel size 1, stride 1 and no "
                                       f"padding ({conv!r}): it is no per-position projection")
        out, cin, _ = conv.weight.shape
        projs.append(Projection(conv.weight, 0, out, bias=conv.bias, matrix_shape=(out, cin), in_groups=conv.groups))
    return AttentionSpec(*projs, H, H, d)


_REGISTRY: dict[Union[type, str], AttentionAdapter] = {}


def _key(cls_or_name) -> Union[type, str]:
    if isinstance(cls_or_name, str):
        if "." not in cls_or_name:
            raise ValueError(f"register_adapter: a string key must be 'module.path.ClassName', got {cls_or_name!r}")
        return cls_or_name
    if isinstance(cls_or_name, type) and issubclass(cls_or_name, nn.Module):
        return cls_or_name
    raise TypeError(f"register_adapter: cls must be an nn.Module subclass or a 'module.path.ClassName' "
                    f"string, got {cls_or_name!r}")


def register_adapter(cls: Union[type, str],
                     adapter: Union[AttentionAdapter, Callable[[nn.Module], Optional[AttentionSpec]]],
                     *, name: Optional[str] = None) -> AttentionAdapter:
    """Register ``adapter`` for modules of class ``cls`` (and its subclasses, unless they have their own).

    ``cls``: an ``nn.Module`` subclass or its ``"module.path.QualName"`` (lets you register a class
    without importing its library); ``nn.Module`` itself registers an adapter that sees every
    module no more specific adapter handled. ``adapter``: an :class:`AttentionAdapter`, or a
    callable ``module -> AttentionSpec`` (wrapped; ``name`` labels it in reports) that returns None
    for modules it does not handle. Replaces an earlier registration for the same key. Returns the
    registered adapter.

    Examples:
        >>> register_adapter(MyAttention, lambda m: AttentionSpec.from_linears(
        ...     m.wq, m.wk, m.wv, num_heads=m.n_heads, num_kv_heads=m.n_kv_heads))
        >>> register_adapter("mylib.layers.FusedAttention",             # without importing mylib
        ...                  lambda m: AttentionSpec.from_fused(m.qkv.weight, num_heads=m.heads), name="mylib")
    """
    key = _key(cls)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"register_adapter: name must be a str or None, got {type(name).__name__}")
    if not isinstance(adapter, AttentionAdapter):
        if not callable(adapter):
            raise TypeError(f"register_adapter: adapter must be an AttentionAdapter or a callable "
                            f"module -> AttentionSpec, got {type(adapter).__name__}")
        adapter = AttentionAdapter(adapter, name=name or (key.__name__ if isinstance(key, type) else key.rsplit(".", 1)[1]))
    elif name is not None:
        adapter.name = name
    _REGISTRY[key] = adapter
    return adapter


def unregister_adapter(cls: Union[type, str]) -> None:
    """Remove the adapter registered for ``cls`` (KeyError if there is none)."""
    del _REGISTRY[_key(cls)]


def registered_adapters() -> dict:
    """A copy of the registry: key (class or dotted name) -> adapter."""
    return dict(_REGISTRY)


def _registered_chain(module: nn.Module):
    for klass in type(module).__mro__:
        if klass is object:
            break
        hit = _REGISTRY.get(klass)
        if hit is None:
            hit = _REGISTRY.get(f"{klass.__module__}.{klass.__qualname__}")
        if hit is not None:
            yield hit


def get_adapter(module: nn.Module) -> Optional[AttentionAdapter]:
    """The adapter registered for ``module``'s class or nearest registered base class, or None
    (structural discovery is not consulted: see :func:`describe`)."""
    return next(_registered_chain(module), None)


# ------------------------------------------------------------------------------------------------
# discovery by structure

# Naming families of three separate projections (child modules with a 2-D weight).
SEPARATE_NAMES = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"),
                  ("q_lin", "k_lin", "v_lin"), ("query_proj", "key_proj", "value_proj"), ("wq", "wk", "wv"),
                  ("Wq", "Wk", "Wv"), ("W_q", "W_k", "W_v"), ("to_q", "to_k", "to_v"),
                  ("linear_q", "linear_k", "linear_v"), ("q_linear", "k_linear", "v_linear"),
                  ("project_q", "project_k", "project_v"), ("q_head", "k_head", "v_head"),
                  ("projection_query", "projection_key", "projection_value"))
# A query projection and a fused [K; V] projection.
Q_KV_NAMES = (("q", "kv"), ("q_proj", "kv_proj"), ("to_q", "to_kv"), ("query", "key_value"))
# A fused [Q; K] projection and a value projection (timm ConViT's GPSA, TNT).
QK_V_NAMES = (("qk", "v"), ("qk_proj", "v_proj"))
# One fused [Q; K; V] projection (a child module, or a parameter for in_proj_weight).
FUSED_NAMES = ("qkv", "Wqkv", "qkv_proj", "c_attn", "query_key_value", "to_qkv", "W_pack", "qkv_linear", "att_proj",
               "in_proj")
_AMBIGUOUS_FUSED = {"in_proj"}   # also the input projection of Mamba-style mixers: needs an attention class name

_MLA_REASON = ("multi-head latent attention (q_a_proj/q_b_proj, kv_a_proj_with_mqa/kv_b_proj): Q, K and V are "
               "products of low-rank factors and part of every key is a rope key shared by all heads, so the "
               "method's per-head W_Q, W_K, W_V are not parameters of this module; condinit does not guess which "
               "factors to condition (register an adapter for the factors you choose)")

_ATTENTION_NAME = re.compile(r"attention|attn", re.I)
# attention without a softmax over scores: the method conditions softmax attention
_LINEAR_ATTENTION_NAME = re.compile(r"Lightning(Attention|Attn)|DeltaNet|Delta(Rule)?(Attention|Attn)|"
                                    r"Linear(Self)?(Attention|Attn)|Retention")
_LINEAR_REASON = ("linear attention (no softmax over the scores: lightning attention, a gated delta rule, retention): "
                  "the method conditions softmax attention, so this layer is left as the model made it")
# "attention" in the sense of channel / spatial gating (squeeze-excite and its kin): no queries and keys
_GATING_NAME = re.compile(r"(Channel|Spatial|Split|SelectiveKernel|Coord|Triplet|Gather|Efficient[Cc]hannel)"
                          r"(Attn|Attention)\w*$|Cbam|^Eca|^Ceca|SqueezeExcite")
# names that say attention but are parts of an attention block, not the attention itself
_PART_NAME = re.compile(r"(Output|Dropout|Norm|Mask|Embeddings?|Rotary\w*|Bias|Scaling|MLP|FeedForward|FFN)$")


def _is_linear_like(mod) -> bool:
    w = getattr(mod, "weight", None) if isinstance(mod, nn.Module) else None
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return False
    b = getattr(mod, "bias", None)
    return b is None or (isinstance(b, torch.Tensor) and b.dim() == 1)


def _is_conv1d(mod) -> bool:
    """transformers' ``Conv1D``: an nn.Linear stored ``[in, out]``, computing ``x @ W + b``."""
    return type(mod).__name__ == "Conv1D" and isinstance(getattr(mod, "nf", None), int)


_FUSED_ROLES = {"qkv": "qkv", "wqkv": "qkv", "qk": "qk", "kv": "kv"}


def _projection_roles(m: nn.Module) -> dict:
    """``role -> [child names]`` of ``m``'s children that hold a matrix (2-D or more) and are named
    like a query, key or value projection (``q_proj``, ``to_key``, ``value``) or a fused one
    (``qkv``, ``qk``, ``kv``, ``query_key_value``)."""
    roles: dict[str, list] = {}
    for n, c in m.named_children():
        if not any(t.dim() >= 2 for t in c.parameters()):   # norms, dropouts, rotary tables
            continue
        low = n.lower()
        role = "qkv" if low in ("query_key_value", "w_pack") else None
        for t in low.split("_"):
            role = role or _ROLE_WORDS.get(t) or _FUSED_ROLES.get(t)
        if role is not None:
            roles.setdefault(role, []).append(n)
    return roles


def looks_like_attention(module: nn.Module) -> bool:
    """Whether ``module`` looks like attention: it holds projections named for two of query, key
    and value (``qk`` + ``v``, ``q_proj`` + ``k_proj``, ...), or its class name says attention
    (``Attention`` / ``Attn``), is not a part of one (``...Output``, ``...Dropout``, ...) nor
    channel/spatial gating (squeeze-excite, CBAM), and it holds parameters."""
    name = type(module).__name__
    if _GATING_NAME.search(name) or _PART_NAME.search(name):
        return False
    covered = {r for role in _projection_roles(module) for r in role}
    if len(covered & {"q", "k", "v"}) >= 2:
        return True
    return _ATTENTION_NAME.search(name) is not None and next(module.parameters(), None) is not None


class Described(NamedTuple):
    """What :func:`describe` found: the adapter's name, the spec, and (``partial``) a reason when
    the module also holds attention projections the spec leaves out."""

    adapter: str
    spec: AttentionSpec
    partial: Optional[str] = None


def describe(module: nn.Module) -> Optional[Described]:
    """How ``module`` keeps its Q/K/V (see the module doc for the order of lookups), or None when it
    is not recognised as an attention module.

    Raises :class:`UnsupportedAttention` for an attention module that must not be conditioned
    (with the reason), ValueError when what the module says about its heads contradicts its
    projections.

    Examples:
        >>> describe(torch.nn.MultiheadAttention(64, 4)).spec.num_heads
        4
        >>> describe(torch.nn.Linear(4, 4)) is None
        True
    """
    for adapter in _registered_chain(module):
        spec = adapter.spec(module)
        if spec is None:
            continue
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"adapter {adapter.name} returned {type(spec).__name__}, expected AttentionSpec or None")
        return Described(adapter.name, spec)
    return _structural(module)


def spec_of(module: nn.Module) -> AttentionSpec:
    """The :class:`AttentionSpec` of one attention module (:func:`describe`); ValueError naming the
    class when it is not recognised, :class:`UnsupportedAttention` when it is refused.

    Examples:
        >>> spec_of(torch.nn.MultiheadAttention(64, 4)).head_dim
        16
    """
    found = describe(module)
    if found is None:
        raise ValueError(f"{type(module).__module__}.{type(module).__qualname__} is not recognised as attention: no "
                         f"adapter is registered for it and it has none of the projection names condinit reads; "
                         f"register one with condinit.models.register_adapter")
    return found.spec


def _projection_module(mod) -> Optional[nn.Module]:
    """``mod`` when it is linear-like; the one linear-like module inside a wrapper that holds nothing
    else (a clipping or casting wrapper around an nn.Linear); else None."""
    if _is_linear_like(mod):
        return mod
    if not isinstance(mod, nn.Module) or next(mod.parameters(recurse=False), None) is not None:
        return None
    inner = [c for c in mod.modules() if c is not mod and next(c.parameters(recurse=False), None) is not None]
    if len(inner) == 1 and _is_linear_like(inner[0]):
        return inner[0]
    return None


def _structural(m: nn.Module) -> Optional[Described]:
    children = dict(m.named_children())
    linear = {n: p for n, p in ((n, _projection_module(c)) for n, c in children.items()) if p is not None}
    if ("kv_a_proj_with_mqa" in linear or "kv_b_proj" in linear
            or ("q_a_proj" in linear and "q_b_proj" in linear)):
        raise UnsupportedAttention(_MLA_REASON)
    if "query_key" in linear and "value" in linear:
        raise UnsupportedAttention("shared query_key projection (Reformer LSH attention): Q and K are one matrix, "
                                   "so they cannot be two independent semi-orthogonal matrices")
    if _LINEAR_ATTENTION_NAME.search(type(m).__name__) and _projection_roles(m):
        raise UnsupportedAttention(_LINEAR_REASON)
    if "sampling_offsets" in linear and "attention_weights" in linear:
        raise UnsupportedAttention("deformable attention: it has no query or key projections (sampling offsets and "
                                   "attention weights are predicted from the query), so there is no W_Q, W_K to "
                                   "condition")
    for names in SEPARATE_NAMES:
        if all(n in linear for n in names):
            return _separate(m, names, linear)
    for qn, kvn in Q_KV_NAMES:
        if qn in linear and kvn in linear:
            return _q_kv(m, qn, kvn, linear)
    for qkn, vn in QK_V_NAMES:
        if qkn in linear and vn in linear:
            return _qk_v(m, qkn, vn, linear)
    for fn in FUSED_NAMES:
        if fn in linear:
            if fn in _AMBIGUOUS_FUSED and not looks_like_attention(m):
                return None
            return _fused(m, fn, linear[fn])
    w = getattr(m, "in_proj_weight", None)
    if isinstance(w, nn.Parameter) and w.dim() == 2:
        return _fused(m, "in_proj_weight", None)
    return None


def _lin_proj(lin, start=0, stop=None) -> Projection:
    transposed = _is_conv1d(lin)
    rows = lin.weight.shape[1 if transposed else 0]
    return Projection(lin.weight, start, rows if stop is None else stop, transposed, getattr(lin, "bias", None))


def _separate(m, names, linear) -> Described:
    qn, kn, vn = names
    q, k, v = (_lin_proj(linear[n]) for n in names)
    gated = q.rows % 2 == 0 and _source_says_gated_query(type(m), qn)
    H, Hkv, d = heads_of(m, q.rows // 2 if gated else q.rows, k.rows)
    if gated:   # rows [H, 2, d]: each head's query, then its output gate (left as it is)
        q = Projection(q.weight, 0, d, q.transposed, q.bias, groups=H, stride=2 * d)
    if v.rows != Hkv * d:
        raise UnsupportedAttention(f"{vn} has {v.rows} rows, not {Hkv} key/value heads of head_dim {d} (a value head "
                                   f"size different from the key's)")
    partial = None
    # a second complete set of projections (Longformer's query_global/..., LiLT's layout_query/...)
    for other in linear:
        for pre, post in ([other.split(qn, 1)] if qn in other and other != qn else []):
            if f"{pre}{kn}{post}" in linear and f"{pre}{vn}{post}" in linear:
                partial = (f"also holds {pre}{qn}{post}/{pre}{kn}{post}/{pre}{vn}{post}, a second set of query/key/"
                           f"value projections that is not conditioned")
    label = f"auto({qn}/{kn}/{vn}{', gated query' if gated else ''})"
    return Described(label, AttentionSpec(q, k, v, H, Hkv, d), partial)


def _qk_v(m, qkn, vn, linear) -> Described:
    qk_lin = linear[qkn]
    if not _source_says_contiguous(type(m), qkn, 2, ("q", "k")):
        raise UnsupportedAttention(_unconfirmed(type(m), qkn, "[Q; K]"))
    v = _lin_proj(linear[vn])
    qk_rows = qk_lin.weight.shape[1 if _is_conv1d(qk_lin) else 0]
    if qk_rows % 2:
        raise ValueError(f"{qkn} has {qk_rows} rows, not two equal halves Q and K")
    H, Hkv, d = heads_of(m, qk_rows // 2, qk_rows // 2)
    half = H * d
    q, k = _lin_proj(qk_lin, 0, half), _lin_proj(qk_lin, half, 2 * half)
    if v.rows != Hkv * d:
        raise UnsupportedAttention(f"{vn} has {v.rows} rows, not {Hkv} value heads of head_dim {d}")
    return Described(f"auto({qkn}+{vn})", AttentionSpec(q, k, v, H, Hkv, d))


def _q_kv(m, qn, kvn, linear) -> Described:
    kv_lin = linear[kvn]
    if not _source_says_contiguous(type(m), kvn, 2):
        raise UnsupportedAttention(_unconfirmed(type(m), kvn, "[K; V]"))
    q = _lin_proj(linear[qn])
    kv_rows = kv_lin.weight.shape[1 if _is_conv1d(kv_lin) else 0]
    if kv_rows % 2:
        raise ValueError(f"{kvn} has {kv_rows} rows, not two equal halves K and V")
    H, Hkv, d = heads_of(m, q.rows, kv_rows // 2)
    half = Hkv * d
    k, v = _lin_proj(kv_lin, 0, half), _lin_proj(kv_lin, half, 2 * half)
    return Described(f"auto({qn}+{kvn})", AttentionSpec(q, k, v, H, Hkv, d))


def _fused(m, name, lin) -> Described:
    if not _source_says_contiguous(type(m), name, 3):
        raise UnsupportedAttention(_unconfirmed(type(m), name, "[Q; K; V]"))
    if lin is None:                     # an in_proj_weight parameter, with in_proj_bias
        weight, bias, transposed = m.in_proj_weight, getattr(m, "in_proj_bias", None), False
    else:
        weight, bias, transposed = lin.weight, getattr(lin, "bias", None), _is_conv1d(lin)
    total = weight.shape[1 if transposed else 0]
    H, Hkv, d = _fused_heads(m, total)
    parts = fused_layout(total, num_heads=H, num_kv_heads=Hkv, head_dim=d)
    separate_bias = bias is None and any(isinstance(getattr(m, f"{p}_bias", None), torch.Tensor) for p in "qkv")
    projs = {}
    for p in "qkv":
        start, stop, _, _ = parts[p]
        if separate_bias:   # BEiT / EVA / Swin-v2: q_bias and v_bias parameters, k_bias a zero buffer or none
            b = getattr(m, f"{p}_bias", None)
            b = b if isinstance(b, nn.Parameter) else None
            projs[p] = Projection(weight, start, stop, transposed, b, bias_start=0 if b is not None else None)
        else:
            projs[p] = Projection(weight, start, stop, transposed, bias)
    return Described(f"auto({name})", AttentionSpec(projs["q"], projs["k"], projs["v"], H, Hkv, d))


def _fused_heads(m, total: int) -> tuple[int, int, int]:
    """Head counts of a contiguous fused projection of ``total`` rows: ``H`` from the module (or its
    config), ``d`` and ``H_kv`` from attributes or the rows (``H_kv = H`` when neither says)."""
    cfg = _own_config(m)
    H, _ = _int_attr(m, _HEAD_ATTRS)
    if H is None and cfg is not None:
        H, _ = _int_attr(cfg, _HEAD_CFG)
    if H is None:
        raise UnsupportedAttention("cannot find the number of heads (no attribute num_heads / num_attention_heads / "
                                   "n_heads, and no config.num_attention_heads)")
    d, _ = _int_attr(m, _HEAD_DIM_ATTRS)
    Hkv, _ = _int_attr(m, _KV_HEAD_ATTRS)
    if Hkv is None and cfg is not None:
        Hkv, _ = _int_attr(cfg, _KV_HEAD_CFG)
    if d is None and Hkv is not None:
        if total % (H + 2 * Hkv):
            raise ValueError(f"fused projection of {total} rows does not split into {H} + 2 x {Hkv} heads")
        d = total // (H + 2 * Hkv)
    if d is None:
        Hkv = H
        if total % (3 * H):
            raise ValueError(f"fused projection of {total} rows does not split into 3 x {H} heads")
        d = total // (3 * H)
    if Hkv is None:
        rest = total - H * d
        if rest <= 0 or rest % (2 * d):
            raise ValueError(f"fused projection of {total} rows does not hold {H} query heads of head_dim {d} and "
                             f"equal K and V parts")
        Hkv = rest // (2 * d)
    return H, Hkv, d


def _unconfirmed(cls, name, what) -> str:
    return (f"fused projection {name}: its source does not show it split as contiguous {what} parts in that "
            f"order (per-head interleaved layouts have the same shape); register an adapter with "
            f"AttentionSpec.from_fused(..., layout=...) read from {cls.__qualname__}.forward")


# The fused projection's split, read from the class's source with whitespace and comments removed.
_HEADS_RE = r"(?:self\.)?(?:num_heads|num_attention_heads|n_heads|n_head|heads|num_head|nh)"
_SPLITS = r"(?:split|chunk|tensor_split)"
_SHAPE_OPS = r"(?:view|reshape|unflatten|transpose|permute)"


@functools.lru_cache(maxsize=None)
def _class_source(cls) -> Optional[str]:
    """The source of the methods ``cls`` uses (each name's effective definition along the MRO up to
    ``nn.Module``: an overridden base method does not count), or None when any is unavailable;
    read once per class."""
    texts, seen = [], set()
    for klass in cls.__mro__:
        if klass is nn.Module or klass is object or klass.__module__.startswith("torch."):
            break
        for name, obj in vars(klass).items():
            fn = obj.fget if isinstance(obj, property) else getattr(obj, "__func__", obj)
            if name in seen or not inspect.isfunction(fn):
                continue
            seen.add(name)
            try:
                texts.append(inspect.getsource(fn))
            except (OSError, TypeError):     # defined in a REPL, source not shipped
                return None
    return "\n".join(texts) if texts else None


_ROLE_WORDS = {"q": "q", "query": "q", "queries": "q", "xq": "q", "k": "k", "key": "k", "keys": "k", "xk": "k",
               "v": "v", "value": "v", "values": "v", "xv": "v"}


def _role(name: str) -> Optional[str]:
    """``"q"``, ``"k"`` or ``"v"`` for a variable named like a query, key or value (``query_states``,
    ``k``, ``values``), else None."""
    return _ROLE_WORDS.get(name.lstrip("_").lower().split("_", 1)[0])


def _source_says_gated_query(cls, name: str) -> bool:
    """Whether ``cls`` reads its query projection ``name`` as ``[H, 2, d]``: each head's query, then
    an output gate (Qwen3-Next, Qwen3.5: ``query, gate = torch.chunk(q_proj(x).view(..., -1,
    head_dim * 2), 2, dim=-1)``)."""
    raw = _class_source(cls)
    if raw is None:
        return False
    src = re.sub(r"\s+", "", re.sub(r"#[^\n]*", "", raw))
    m = re.search(rf"\(?(\w+),(\w+)\)?=torch\.chunk\(self\.{name}\([^()]*\)\.view\([^()]*,-1,self\.head_dim\*2\),2,"
                  rf"dim=-1\)", src)
    return m is not None and _role(m[1]) == "q" and _role(m[2]) is None


def why_not_recognised(m: nn.Module) -> str:
    """Why an attention-like module is not recognised: what it holds."""
    children = dict(m.named_children())
    roles = _projection_roles(m)
    if roles:
        named = [n for ns in roles.values() for n in ns]
        unreadable = [n for n in named if _projection_module(children[n]) is None]
        if unreadable:
            return (f"its {', '.join(unreadable)} ({', '.join(sorted({type(children[n]).__name__ for n in unreadable}))}) "
                    f"are not linear projections with a 2-D weight condinit can read")
        present = {r for role in roles for r in role}
        missing = [r for r in ("q", "k", "v") if r not in present]
        if missing:
            what = {"q": "query", "k": "key", "v": "value"}
            return (f"it holds {', '.join(named)} but no {' or '.join(what[r] for r in missing)} projection (a learned "
                    f"query, keys and values taken from another layer, or no such role)")
        kinds = sorted({type(children[n]).__name__ for n in named})
        return f"its projections {', '.join(named)} ({', '.join(kinds)}) follow no naming family condinit reads"
    held = [f"{n}: {type(c).__name__}" for n, c in children.items()] + [n for n, _ in m.named_parameters(recurse=False)]
    return f"its class name says attention, but it holds no projections condinit can read ({', '.join(held) or 'nothing'})"


def _source_says_contiguous(cls, name: str, parts: int, roles: Optional[tuple] = None) -> bool:
    """Whether ``cls``'s source splits the output of its fused projection ``name`` into ``parts``
    contiguous runs holding ``roles`` in that order (default Q, K, V for 3 parts, K, V for 2): a
    reshape to ``(..., parts, num_heads, ...)``,
    an einops ``(3 h d)``, or a split/chunk of the raw output, and nothing that views it per head
    first (``(num_heads, 3, d)``, ``(num_heads, 3 * d)``)."""
    raw = _class_source(cls)
    if raw is None or name not in raw:
        return False
    if name == "in_proj_weight" and "multi_head_attention_forward(" in raw:
        return True          # torch's own function: in_proj_weight is [Q; K; V] (_in_projection_packed)
    einops_thirds = re.search(rf"\(\s*(?:three|{parts}|qkv|kv)\s+h\s+d\s*\)", raw) is not None
    einops_interleaved = re.search(rf"\(\s*h\s+(?:three|{parts}|qkv|kv)\s+d\s*\)", raw) is not None
    code = re.sub(r"#[^\n]*", "", raw)
    src = re.sub(r"\s+", "", code)
    call = rf"(?:self\.{name}\([^()]*\)|F\.linear\([^()]*self\.{name}(?:\.weight)?\b[^()]*\))"
    thirds = re.search(rf"\.(?:reshape|view)\([^()]*?,{parts},(?:-1|{_HEADS_RE})[,)]", src) is not None \
        or re.search(rf"unflatten\(-?\d,\({parts},", src) is not None or einops_thirds
    split_raw = re.search(rf"{call}\.{_SPLITS}\(", src) is not None
    for var in re.findall(rf"(\w+)={call}(?![.\[(*+@-])", src):
        reshaped = re.search(rf"\b{var}={var}\.{_SHAPE_OPS}\(", src) is not None
        if not reshaped and (re.search(rf"\b{var}\.{_SPLITS}\(", src) or re.search(rf"torch\.{_SPLITS}\({var},", src)):
            split_raw = True
    head_dim = r"(?:self\.)?(?:head_dim|head_size|dim_head|d_head|local_dim|attention_head_size)\b"
    interleaved = (re.search(rf"{_HEADS_RE},{parts}[,*)]", src) is not None              # (..., H, 3, d), (H, 3 * d)
                   or re.search(rf"(?:{_HEADS_RE}|-1),{parts}\*", src) is not None           # (..., -1, 3 * d)
                   or re.search(rf"(?:{_HEADS_RE}|-1),{head_dim}\*{parts}\b", src) is not None  # (H, d * 3)
                   or re.search(rf"{_HEADS_RE},-1\)\.(?:split|chunk)", src) is not None     # (H, -1).split
                   or einops_interleaved)
    if interleaved or not (thirds or split_raw):
        return False
    # the parts are assigned to query, key, value (key, value) in that order, and never in another
    want = tuple(roles) if roles is not None else ("q", "k", "v")[3 - parts:]
    lhs = r"(?<![\w.])\(?" + r"\s*,\s*".join([r"(\w+)"] * parts) + r"\s*\)?\s*=(?!=)"
    orders = {tuple(_role(n) for n in names) for names in re.findall(lhs, code)}
    return {o for o in orders if set(o) == set(want) and len(o) == parts} == {want}


def _register_builtins():
    register_adapter(nn.MultiheadAttention, _mha_spec, name="torch.MultiheadAttention")
    tf = "transformers.models"
    for path in ("gpt2.modeling_gpt2.GPT2Attention", "imagegpt.modeling_imagegpt.ImageGPTAttention",
                 "openai.modeling_openai.Attention",
                 "decision_transformer.modeling_decision_transformer.DecisionTransformerGPT2Attention"):
        register_adapter(f"{tf}.{path}", _hf_gpt2, name=f"hf.{path.rsplit('.', 1)[1]}")
    for path, attr in (("gpt_neox.modeling_gpt_neox.GPTNeoXAttention", "query_key_value"),
                       ("gpt_neox_japanese.modeling_gpt_neox_japanese.GPTNeoXJapaneseAttention", "query_key_value"),
                       ("bloom.modeling_bloom.BloomAttention", "query_key_value"),
                       ("persimmon.modeling_persimmon.PersimmonAttention", "query_key_value")):
        register_adapter(f"{tf}.{path}", _hf_per_head(attr), name=f"hf.{path.rsplit('.', 1)[1]}")
    for path, fn in (("falcon.modeling_falcon.FalconAttention", _hf_falcon),
                     ("gpt_bigcode.modeling_gpt_bigcode.GPTBigCodeAttention", _hf_gpt_bigcode),
                     ("phi3.modeling_phi3.Phi3Attention", _hf_phi3),
                     ("phi4_multimodal.modeling_phi4_multimodal.Phi4MultimodalAttention", _hf_phi3),
                     ("deberta.modeling_deberta.DisentangledSelfAttention", _hf_deberta),
                     ("codegen.modeling_codegen.CodeGenAttention", _hf_codegen),
                     ("xlnet.modeling_xlnet.XLNetRelativeAttention", _hf_xlnet),
                     ("jetmoe.modeling_jetmoe.JetMoeAttention", _hf_jetmoe),
                     ("squeezebert.modeling_squeezebert.SqueezeBertSelfAttention", _hf_squeezebert),
                     ("aimv2.modeling_aimv2.Aimv2AttentionPoolingHead", _hf_aimv2_pooling)):
        register_adapter(f"{tf}.{path}", fn, name=f"hf.{path.rsplit('.', 1)[1]}")
    register_adapter("timm.layers.attention.Attention", _timm_attention, name="timm.Attention")


_register_builtins()
