"""The description of one attention module: where its Q/K/V live, its heads, and what the probes need.

An :class:`AttentionSpec` gives the head counts and, for each of Q, K and V, a :class:`Projection`
saying which parameter holds it, which rows of the ``nn.Linear`` layout ``[out, in]`` matrix it
occupies, and whether the parameter is stored transposed (``[in, out]``, GPT-2's ``Conv1D``); a
parameter of another shape is read as the matrix it reshapes to (``matrix_shape``), a grouped
convolution as a block-diagonal one (``in_groups``). Fused weights hold three projections; in some
models their rows alternate per head or per group of heads (``layout``, see :func:`fused_layout`).
From that description :func:`condinit.apply` reads ``[rows, in]`` views and writes conditioned
values back in place, also into a shard of a DTensor (it only has to intersect row/column ranges),
so a description never copies or re-registers a parameter.

A spec that :func:`condinit.models.describe` returns is bound to its module (:meth:`AttentionSpec.bound_to`):
its tensors are :class:`Ref` s, attributes of the module's submodules read at each use, so the same
description serves after the module's tensors are materialized, swapped or unsharded. It also
carries :class:`AttentionDetails`, what the module computes around the projections (score scale,
output projection, QK-norm, RoPE, sliding window, logit soft-cap), which the probes model.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch
from torch import nn

from condinit._validate import check_bool, check_choice, check_int, check_tensor

from .sharded import Partition, is_dtensor, local_part

__all__ = ["Ref", "Projection", "OutputProjection", "AttentionDetails", "AttentionSpec", "Described",
           "UnsupportedAttention", "LAYOUTS", "fused_layout"]

# Row layouts of a fused Q/K/V weight (see fused_layout).
LAYOUTS = ("contiguous", "per_head", "per_group", "grouped")


class UnsupportedAttention(ValueError):
    """An attention module that condinit recognises but does not condition; the message says why.

    Raised by :func:`condinit.models.describe` (and may be raised by a user adapter):
    :func:`condinit.apply` lists such modules in ``report.uncovered``, warns, and with
    ``strict=True`` refuses the model.
    """


@dataclass(frozen=True, eq=False)
class Ref:
    """Attribute ``name`` of module ``owner`` (a parameter, a buffer or a submodule), read at each
    use (:meth:`get`): what a bound description holds instead of the tensors themselves."""

    owner: nn.Module
    name: str

    def get(self):
        return getattr(self.owner, self.name)

    def __repr__(self):
        return f"Ref({type(self.owner).__name__}.{self.name})"


def _resolve(source):
    """The object a :class:`Ref` points to now, or ``source`` itself when it is no Ref."""
    return source.get() if isinstance(source, Ref) else source


def tensor_places(module: nn.Module) -> dict:
    """``id(tensor) -> Ref`` for every parameter and buffer of ``module`` and of its submodules
    (the first name of a tensor held under several)."""
    places: dict = {}
    for owner in module.modules():
        for name, t in itertools.chain(owner.named_parameters(recurse=False), owner.named_buffers(recurse=False)):
            places.setdefault(id(t), Ref(owner, name))
    return places


@dataclass(frozen=True, eq=False, init=False)
class Projection:
    """One of Q, K, V: rows of the nn.Linear-layout matrix held by ``weight``, in ``groups`` runs.

    ``weight`` is the parameter (``[out_total, in]``, or ``[in, out_total]`` when ``transposed``),
    given as a tensor or as a :class:`Ref` to it (``weight_source`` is what was given; ``weight``
    reads it now); ``bias`` likewise.
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

    ``partition`` / ``bias_partition`` (optional, :class:`~condinit.models.sharded.Partition`): the
    plain tensor given is this process's slice of a global weight (bias) held by several, as an
    engine's tensor-parallel linear holds it (Megatron-Core's ``ColumnParallelLinear``: rows
    ``rank * n : (rank + 1) * n``). Everything above (rows, groups, ``stride``, ``bias_start``)
    counts in the global tensor; :func:`condinit.apply` writes the local slice, as for a DTensor
    shard. Not with ``matrix_shape`` or ``in_groups``; :meth:`view` and :meth:`read_bias` refuse
    (no process holds the whole matrix).

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

    weight_source: Union[torch.Tensor, Ref]
    start: int
    stop: int
    transposed: bool
    bias_source: Union[torch.Tensor, Ref, None]
    bias_start: Optional[int]
    groups: int
    stride: int
    bias_stride: Optional[int]
    matrix_shape: Optional[tuple]
    in_groups: int
    fixed: bool
    partition: Optional[Partition]
    bias_partition: Optional[Partition]

    def __init__(self, weight, start: int, stop: int, transposed: bool = False, bias=None,
                 bias_start: Optional[int] = None, groups: int = 1, stride: int = 0,
                 bias_stride: Optional[int] = None, matrix_shape: Optional[tuple] = None, in_groups: int = 1,
                 fixed: bool = False, partition: Optional[Partition] = None,
                 bias_partition: Optional[Partition] = None):
        values = dict(weight_source=weight, start=start, stop=stop, transposed=transposed, bias_source=bias,
                      bias_start=bias_start, groups=groups, stride=stride, bias_stride=bias_stride,
                      matrix_shape=matrix_shape, in_groups=in_groups, fixed=fixed, partition=partition,
                      bias_partition=bias_partition)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self._check()

    @property
    def weight(self) -> torch.Tensor:
        """The parameter holding the rows, as the module holds it now (see :class:`Ref`)."""
        return _resolve(self.weight_source)

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return _resolve(self.bias_source)

    def bound(self, places: dict) -> "Projection":
        """The same rows with the weight and bias referenced where ``places`` (:func:`tensor_places`)
        finds them; a tensor it does not list is kept as it is."""
        bias = self.bias
        return Projection(places.get(id(self.weight), self.weight_source), self.start, self.stop, self.transposed,
                          None if bias is None else places.get(id(bias), self.bias_source), self.bias_start,
                          self.groups, self.stride, self.bias_stride, self.matrix_shape, self.in_groups, self.fixed,
                          self.partition, self.bias_partition)

    def _check(self):
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
        for what, part, t in (("weight", self.partition, self.weight), ("bias", self.bias_partition, self.bias)):
            if part is None:
                continue
            if not isinstance(part, Partition):
                raise TypeError(f"Projection: {what}_partition must be a condinit.models.sharded.Partition or None, "
                                f"got {type(part).__name__}")
            if not isinstance(t, torch.Tensor):
                raise ValueError("Projection: a bias_partition without a bias")
            part.check(t, f"Projection {what}")
        if self.partition is not None and (self.matrix_shape is not None or self.in_groups > 1):
            raise ValueError("Projection: a partition of a weight read through matrix_shape or in_groups is not "
                             "supported (a slice of the parameter is no block of the matrix)")
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
            size = self.bias.shape[0] if self.bias_partition is None else self.bias_partition.size
            if end > size:
                raise ValueError(f"Projection: bias entries up to {end} of a bias with {size}")

    @property
    def storage_shape(self) -> tuple:
        """Shape of the matrix the rows are counted in: ``matrix_shape``, the global shape of a
        ``partition``, or the weight's own."""
        if self.matrix_shape is not None:
            return tuple(self.matrix_shape)
        if self.partition is not None:
            return self.partition.global_shape(self.weight)
        return tuple(self.weight.shape)

    @property
    def distributed(self) -> bool:
        """Whether this process holds only part of the weight (a DTensor, or a ``partition``)."""
        return self.partition is not None or is_dtensor(self.weight)

    def local_weight(self, name: str) -> tuple[torch.Tensor, tuple, tuple]:
        """``(local, global_offset, global_shape)`` of the weight (:func:`condinit.models.sharded.local_part`)."""
        return local_part(self.weight, name, self.partition)

    def local_bias(self, name: str) -> tuple[torch.Tensor, tuple, tuple]:
        """The same for the bias (which must exist)."""
        return local_part(self.bias, name, self.bias_partition)

    def _whole(self, what: str) -> None:
        part, t = (self.partition, self.weight) if what == "weight" else (self.bias_partition, self.bias)
        if part is not None:
            raise ValueError(f"Projection: this process holds only entries {part.offset}:"
                             f"{part.offset + t.shape[part.dim]} along dim {part.dim} of the {what} (a partition "
                             f"of {part.size}); gather it first")

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
        self._whole("weight")
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
        self._whole("bias")
        b = self.bias.detach()
        parts = [b[lo:hi] for lo, hi in self.bias_segments()]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass(frozen=True)
class OutputProjection:
    """The module's output projection ``W_O``: ``weight`` ``[out, H d]`` (``[H d, out]`` when
    ``transposed``, GPT-2's ``Conv1D``), a tensor or a :class:`Ref` to it."""

    weight: Union[torch.Tensor, Ref]
    transposed: bool = False

    def matrix(self) -> torch.Tensor:
        """``W_O`` in ``[out, in]`` layout, as the module holds it now (detached)."""
        w = _resolve(self.weight).detach()
        return w.t() if self.transposed else w


@dataclass(frozen=True)
class AttentionDetails:
    """What an attention module computes around its Q/K/V projections, as the probes model it
    (:class:`condinit.probe.JacobianOperator`, :class:`condinit.probe.JacobianMonitor`).

    ``scale``: the score scale ``s`` of ``softmax(s Q K^T)``. ``output``: ``W_O``, or None.
    ``q_norm`` / ``k_norm``: :class:`Ref` s to the QK-norm modules applied to the projections'
    outputs, or None. ``position_embeddings_arg``: the position of ``position_embeddings`` (the
    rotary ``(cos, sin)``) among the parameters of the module's ``forward``, None when it takes
    none. ``sliding_window``: keys per query of a sliding window (None: none). ``softcap``: ``c``
    of logit soft-capping ``c tanh(s / c)`` (None: none). ``dropout``: the attention dropout
    probability (in effect in training mode). ``causal``: the module's own ``is_causal``.
    """

    scale: float
    output: Optional[OutputProjection] = None
    q_norm: Optional[Ref] = None
    k_norm: Optional[Ref] = None
    position_embeddings_arg: Optional[int] = None
    sliding_window: Optional[int] = None
    softcap: Optional[float] = None
    dropout: float = 0.0
    causal: bool = False


@dataclass(frozen=True)
class AttentionSpec:
    """What :func:`condinit.apply` needs to know about one attention module.

    ``q`` has ``num_heads * head_dim`` rows, ``k`` and ``v`` ``num_kv_heads * head_dim`` (GQA/MQA when
    ``num_kv_heads < num_heads``; it must divide ``num_heads``). Head ``h`` of Q is logical rows
    ``h*head_dim:(h+1)*head_dim`` (a group of a :class:`Projection` holds whole heads). Projections
    sharing a weight must not share rows. Every check runs at construction, so a wrong description
    fails before anything is written. ``details`` (:class:`AttentionDetails`): what the module
    computes around the projections; :func:`condinit.models.describe` fills it.

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
    details: Optional[AttentionDetails] = None

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
    def is_bound(self) -> bool:
        """Whether every weight and bias is a :class:`Ref` (read from its module at each use)."""
        return all(isinstance(p.weight_source, Ref) and (p.bias_source is None or isinstance(p.bias_source, Ref))
                   for _, p in self.projections())

    def bound_to(self, module: nn.Module, details: Optional[AttentionDetails] = None) -> "AttentionSpec":
        """This layout with every weight and bias that ``module`` holds referenced by where it holds
        it (a :class:`Ref`, read at each use), and ``details`` (default: this spec's own)."""
        places = tensor_places(module)
        return AttentionSpec(self.q.bound(places), self.k.bound(places), self.v.bound(places), self.num_heads,
                             self.num_kv_heads, self.head_dim, self.details if details is None else details)

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




class Described(NamedTuple):
    """What :func:`condinit.models.describe` found: the adapter's name, the spec (bound to the
    module), and (``partial``) a reason when the module also holds attention projections the spec
    leaves out."""

    adapter: str
    spec: AttentionSpec
    partial: Optional[str] = None
