"""Conditioned initialization of multi-head latent attention through its low-rank factors
(DeepSeek-V2/V3 MLA; ``docs/design.md``, "Multi-head latent attention").

The layer's weights, in ``nn.Linear`` ``[out, in]`` layout (``D`` the model width, ``H`` heads,
``d_n`` / ``d_r`` / ``d_v`` the no-RoPE, RoPE and value head dims, ``r_q`` / ``r_kv`` the latent
ranks)::

    q_a   [r_q, D]                 the query's down projection (absent without the query LoRA)
    q_b   [H (d_n + d_r), r_q]     the query's up projection, head h = rows h (d_n + d_r) onwards
                                   (``q_proj`` [H (d_n + d_r), D] without the query LoRA)
    kv_a  [r_kv + d_r, D]          the KV latent's down projection, then the shared RoPE key
    kv_b  [H (d_n + d_v), r_kv]    per head: its no-RoPE key rows, then its value rows

and each latent goes through an RMSNorm (weight ``g``) before its up projection. What is written:

- ``q_a``: orthonormal rows (one Haar block of stream ``"q_latent"``, block ``L * 2**32``);
- ``q_b``: every head's ``[d_n + d_r, r_q]`` block orthonormal rows, times ``qk_gain`` (stream
  ``"q"``, block ``L * 2**32 + h``, as a Q head of an unfactored layer);
- ``kv_a``: its latent rows the rectangular identity ``I_{r_kv x D}``; its RoPE rows one Haar
  ``[d_r, D]`` block times ``qk_gain`` (stream ``"k"``, block ``L * 2**32 + H``: a key head of
  its own, shared by all query heads);
- ``kv_b``: every head's key rows a Haar ``[d_n, r_kv]`` block times ``qk_gain`` (stream ``"k"``,
  block ``L * 2**32 + h``); the value rows ``v_gain`` times the rectangular identity of the stacked
  ``[H d_v, r_kv]`` value matrix wrapped modulo ``r_kv`` (row ``i`` reads latent coordinate
  ``i mod r_kv``; the plain rectangular identity when ``H d_v <= r_kv``), or with
  ``v_mode="identity_per_head"`` ``I_{d_v x r_kv}`` in every head;
- the down projections' biases zero; the norms and ``W_O`` left as the model made them.

With the norm weights ``g = 1`` (the model's own init) each head's map from the input is then a
per-token scalar times a semi-orthogonal matrix: ``q_h(x) = s_q(x) W_qb,h W_qa x`` with
``s_q(x) = (|W_qa x|^2 / r_q + eps)^(-1/2)`` and ``W_qb,h W_qa (W_qb,h W_qa)^T = I``; the
no-RoPE key ``s_kv(x) W_kvb,h^K I_{r_kv x D} x``, the RoPE key ``W_pe x`` (no norm), the value
``s_kv(x) S_h x`` with ``S_h`` a selection of ``d_v`` distinct coordinates (``I_{d_v x D}``-like).
This needs ``r_q <= D``, ``d_n + d_r <= r_q``, ``r_kv <= D`` and ``d_n, d_v <= r_kv``
(:func:`latent_problem` says which fails).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from condinit._validate import check_choice, check_int
from condinit.init.functional import (K_STREAM, LAYER_STRIDE, MAX_HEADS, MAX_LAYER_INDEX, Q_STREAM, V_MODES,
                                      check_destinations, check_gains, check_seed_source, check_weight, draw_seed)
from condinit.init.plan import InitPlan, run_plan
from condinit.ops.orthogonalize.op import METHODS
from condinit.ops.random.op import stream_id

__all__ = ["LatentShape", "latent_attention_init_", "latent_problem", "plan_latent", "Q_LATENT_STREAM"]

Q_LATENT_STREAM = "q_latent"


@dataclass(frozen=True)
class LatentShape:
    """The sizes of one multi-head latent attention layer (see the module doc). ``q_rank`` is None
    without the query LoRA (``q_b`` is then ``q_proj``, reading the input directly)."""

    num_heads: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    q_rank: Optional[int]
    kv_rank: int
    in_features: int

    @property
    def qk_dim(self) -> int:
        """Rows of one query head: its no-RoPE then its RoPE dims."""
        return self.nope_dim + self.rope_dim

    @property
    def kv_dim(self) -> int:
        """Rows of one head in ``kv_b``: its key rows, then its value rows."""
        return self.nope_dim + self.v_dim


def latent_problem(shape: LatentShape) -> Optional[str]:
    """Why the factors of a layer of ``shape`` cannot give semi-orthogonal per-head maps (a product
    ``[d, r] x [r, D]`` has rank at most ``r``, so it is semi-orthogonal only for ``d <= r <= D``
    here), or None when they can."""
    s, D = shape, shape.in_features
    checks = [(s.kv_rank <= D, f"kv_lora_rank {s.kv_rank} exceeds the input width {D}"),
              (s.nope_dim <= s.kv_rank, f"the no-RoPE key head dim {s.nope_dim} exceeds kv_lora_rank {s.kv_rank}"),
              (s.v_dim <= s.kv_rank, f"the value head dim {s.v_dim} exceeds kv_lora_rank {s.kv_rank}")]
    if s.q_rank is not None:
        checks = [(s.q_rank <= D, f"q_lora_rank {s.q_rank} exceeds the input width {D}"),
                  (s.qk_dim <= s.q_rank, f"the query head dim {s.qk_dim} exceeds q_lora_rank {s.q_rank}")] + checks
    for ok, why in checks:
        if not ok:
            return (f"{why}: the product of the factors has rank below the head's smaller dimension, so no "
                    f"choice of them makes the head's map semi-orthogonal")
    return None


def check_latent(q_b, kv_a, kv_b, q_a, *, num_heads, nope_dim, rope_dim, v_dim) -> LatentShape:
    """The :class:`LatentShape` of the given weights (each checked, named by its argument);
    ValueError when the shapes do not fit together."""
    H = check_int("num_heads", num_heads, min=1, max=MAX_HEADS)
    dn = check_int("qk_nope_head_dim", nope_dim, min=1)
    dr = check_int("qk_rope_head_dim", rope_dim, min=1)
    dv = check_int("v_head_dim", v_dim, min=1)
    for name, w in (("q_b", q_b), ("kv_a", kv_a), ("kv_b", kv_b)):
        check_weight(w, name, dim=2)
    if q_a is not None:
        check_weight(q_a, "q_a", dim=2)
    D = kv_a.shape[1]
    if q_b.shape[0] != H * (dn + dr):
        raise ValueError(f"q_b has {q_b.shape[0]} rows, expected num_heads * (qk_nope_head_dim + qk_rope_head_dim)"
                         f" = {H} * ({dn} + {dr})")
    q_in = D if q_a is None else q_a.shape[0]
    if q_a is not None and q_a.shape[1] != D:
        raise ValueError(f"q_a reads {q_a.shape[1]} input features, kv_a {D}: both read the layer's input")
    if q_b.shape[1] != q_in:
        raise ValueError(f"q_b reads {q_b.shape[1]} features, expected {q_in} "
                         f"({'the input width' if q_a is None else 'the rows of q_a'})")
    r_kv = kv_a.shape[0] - dr
    if r_kv < 1:
        raise ValueError(f"kv_a has {kv_a.shape[0]} rows, expected kv_lora_rank + qk_rope_head_dim with "
                         f"qk_rope_head_dim = {dr}")
    if kv_b.shape != (H * (dn + dv), r_kv):
        raise ValueError(f"kv_b has shape {tuple(kv_b.shape)}, expected (num_heads * (qk_nope_head_dim + "
                         f"v_head_dim), kv_lora_rank) = ({H * (dn + dv)}, {r_kv})")
    return LatentShape(H, dn, dr, dv, None if q_a is None else q_a.shape[0], r_kv, D)


def _groups(w: torch.Tensor, start: int, rows: int, groups: int, stride: int) -> torch.Tensor:
    """``[groups, rows, cols]`` strided view of rows ``start + g*stride : start + g*stride + rows`` of ``w``."""
    return w.as_strided((groups, rows, w.shape[1]), (stride * w.stride(0), w.stride(0), w.stride(1)),
                        w.storage_offset() + start * w.stride(0))


def plan_latent(plan: InitPlan, shape: LatentShape, *, q_b, kv_a, kv_b, q_a=None, biases=(), layer: int = 0,
                v_mode: str = "identity", qk_gain: float = 1.0, v_gain: float = 1.0, owner=None) -> None:
    """Add the writes of one latent attention layer (the module doc) to ``plan``. Arguments are not
    validated (the public functions did); weights are detached plain (non-DTensor) tensors."""
    s, base = shape, layer * LAYER_STRIDE
    sq, sk = stream_id(Q_STREAM), stream_id(K_STREAM)
    H = s.num_heads
    if q_a is not None:
        plan.add_heads(stream_id(Q_LATENT_STREAM), base, q_a, s.q_rank, s.in_features, owner=owner)
    plan.add_heads(sq, base, q_b, s.qk_dim, q_b.shape[1], gain=qk_gain, owner=owner)
    plan.add_identity(kv_a[:s.kv_rank], owner=owner)
    plan.add_heads(sk, base, kv_a[s.kv_rank:], s.rope_dim, s.in_features, row_lo=H * s.rope_dim, gain=qk_gain,
                   owner=owner)
    plan.add_heads(sk, base, _groups(kv_b, 0, s.nope_dim, H, s.kv_dim), s.nope_dim, s.kv_rank, gain=qk_gain,
                   owner=owner)
    per_head = v_mode == "identity_per_head"
    for h in range(H):
        lo = h * s.kv_dim + s.nope_dim
        plan.add_identity(kv_b[lo:lo + s.v_dim], row_lo=h * s.v_dim, head_dim=s.v_dim if per_head else s.kv_rank,
                          gain=v_gain, owner=owner)
    for b in biases:
        if b is not None:
            plan.add_zero(b, owner=owner)


@torch.no_grad()
def latent_attention_init_(q_b: torch.Tensor, kv_a: torch.Tensor, kv_b: torch.Tensor, *, num_heads: int,
                           qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                           q_a: Optional[torch.Tensor] = None, q_a_bias: Optional[torch.Tensor] = None,
                           kv_a_bias: Optional[torch.Tensor] = None, seed: Optional[int] = None,
                           generator: Optional[torch.Generator] = None, layer_index: int = 0,
                           v_mode: str = "identity", qk_gain: float = 1.0, v_gain: float = 1.0,
                           method: str = "auto", memory_budget: Optional[int] = None) -> None:
    """Conditioned initialization of one multi-head latent attention layer through its factors, in
    place (the module doc says what is written and what each head's map becomes).

    ``q_b`` is ``q_b_proj.weight`` (with ``q_a = q_a_proj.weight``), or ``q_proj.weight`` without
    the query LoRA; ``kv_a`` is ``kv_a_proj_with_mqa.weight``, ``kv_b`` ``kv_b_proj.weight``.
    ``layer_index`` picks the layer's random blocks; ``seed`` default None: one draw from
    ``generator`` or torch's default generator. Shapes whose factors cannot give semi-orthogonal
    head maps (:func:`latent_problem`) raise ValueError before anything is written.

    Examples:
        >>> a = model.model.layers[0].self_attn                       # DeepseekV3Attention
        >>> latent_attention_init_(a.q_b_proj.weight, a.kv_a_proj_with_mqa.weight, a.kv_b_proj.weight,
        ...     q_a=a.q_a_proj.weight, num_heads=a.num_heads, qk_nope_head_dim=a.qk_nope_head_dim,
        ...     qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim, seed=0)
    """
    shape = check_latent(q_b, kv_a, kv_b, q_a, num_heads=num_heads, nope_dim=qk_nope_head_dim,
                         rope_dim=qk_rope_head_dim, v_dim=v_head_dim)
    why = latent_problem(shape)
    if why is not None:
        raise ValueError(why)
    for name, b, rows in (("q_a_bias", q_a_bias, shape.q_rank), ("kv_a_bias", kv_a_bias, kv_a.shape[0])):
        if b is not None:
            if q_a is None and name == "q_a_bias":
                raise ValueError("q_a_bias is given without q_a")
            check_weight(b, name, dim=1)
            if b.shape[0] != rows:
                raise ValueError(f"{name} has {b.shape[0]} entries, expected {rows}")
    check_choice("v_mode", v_mode, V_MODES)
    check_choice("method", method, METHODS)
    check_int("memory_budget", memory_budget, min=1, allow_none=True)
    seed = check_seed_source(seed, generator)
    layer_index = check_int("layer_index", layer_index, min=0, max=MAX_LAYER_INDEX)
    qk_gain, v_gain = check_gains(qk_gain, v_gain, [q_b.dtype, kv_a.dtype, kv_b.dtype], [kv_b.dtype])
    check_destinations([("q_a", q_a), ("q_b", q_b), ("kv_a", kv_a), ("kv_b", kv_b), ("q_a_bias", q_a_bias),
                         ("kv_a_bias", kv_a_bias)])
    plan = InitPlan()
    plan_latent(plan, shape, q_b=q_b, kv_a=kv_a, kv_b=kv_b, q_a=q_a, biases=(q_a_bias, kv_a_bias),
                layer=layer_index, v_mode=v_mode, qk_gain=qk_gain, v_gain=v_gain)
    run_plan(plan, draw_seed(seed, generator), method, memory_budget=memory_budget)
