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

:class:`Projection` lives in :mod:`condinit.models.projection`, :class:`Ref` in
:mod:`condinit.models.binding` and :func:`fused_layout` in :mod:`condinit.models.layout`; all three
are importable from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch
from torch import nn

from condinit._validate import check_bool, check_int, check_tensor

from .binding import Ref, resolve, tensor_places
from .layout import LAYOUTS, check_heads, fused_layout, head_dim_of
from .projection import Projection

__all__ = ["Ref", "Projection", "OutputProjection", "AttentionDetails", "AttentionSpec", "Described",
           "UnsupportedAttention", "LAYOUTS", "fused_layout", "tensor_places"]


class UnsupportedAttention(ValueError):
    """An attention module that condinit recognises but does not condition; the message says why.

    Raised by :func:`condinit.models.describe` (and may be raised by a user adapter):
    :func:`condinit.apply` lists such modules in ``report.uncovered``, warns, and with
    ``strict=True`` refuses the model.
    """


@dataclass(frozen=True)
class OutputProjection:
    """The module's output projection ``W_O``: ``weight`` ``[out, H d]`` (``[H d, out]`` when
    ``transposed``, GPT-2's ``Conv1D``), a tensor or a :class:`Ref` to it."""

    weight: Union[torch.Tensor, Ref]
    transposed: bool = False

    def matrix(self) -> torch.Tensor:
        """``W_O`` in ``[out, in]`` layout, as the module holds it now (detached)."""
        w = resolve(self.weight).detach()
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
        check_heads(num_heads, num_kv_heads, head_dim)
        head_dim = head_dim_of(q_weight.shape[0], num_heads, head_dim)
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



class Described(NamedTuple):
    """What :func:`condinit.models.describe` found: the adapter's name, the spec (bound to the
    module), and (``partial``) a reason when the module also holds attention projections the spec
    leaves out."""

    adapter: str
    spec: AttentionSpec
    partial: Optional[str] = None
