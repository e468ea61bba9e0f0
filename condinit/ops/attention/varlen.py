"""Packed variable-length sequences (FlashAttention's varlen layout) on the dense fused op.

``q`` ``[Tq, H, d]`` and ``k``, ``v`` ``[Tk, Hkv, d]`` hold ``S`` sequences back to back; sequence
``s`` is ``q[cu_seqlens_q[s]:cu_seqlens_q[s + 1]]`` (and likewise for keys). The functions here
pack them into a padded batch ``[S, H, max_seqlen, d]``, run :func:`condinit.attention` /
:func:`condinit.attention_jvp` with ``q_lens`` / ``kv_lens`` (no attention across sequences,
padded keys never read, padded queries zero), and unpack. Packing and unpacking are an index
gather (``index_select``), so every AD mode and ``torch.func`` transform goes through them.

Memory: ``O(S * max_seqlen)`` per tensor for the padded copies, besides the ``O(N)`` of the
attention itself; the padded rows cost kernel time in proportion to how unequal the lengths are.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from condinit._validate import check_int, check_tensor
from condinit.ops.attention.op import attention, attention_jvp

__all__ = ["attention_varlen", "attention_jvp_varlen"]


def _check_cu(name: str, cu, total: int, device) -> Tensor:
    check_tensor(name, cu, dim=1)
    if cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {cu.dtype}")
    if cu.numel() < 2:
        raise ValueError(f"{name} must have S + 1 >= 2 entries (prefix sums of the sequence lengths), "
                         f"got {cu.numel()}")
    cu = cu.to(device=device, dtype=torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must start at 0, not decrease and end at the token count {total}, "
                         f"got {cu.tolist()}")
    return cu


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, floating=True)
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [tokens, heads, d] (packed sequences), got shape "
                             f"{tuple(t.shape)}")
    cu_q = _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    cu_k = _check_cu("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
                         f"got {cu_q.numel() - 1} and {cu_k.numel() - 1}")
    lens_q, lens_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    max_q = check_int("max_seqlen_q", max_seqlen_q, min=max(1, int(lens_q.max())))
    max_k = check_int("max_seqlen_k", max_seqlen_k, min=max(1, int(lens_k.max())))
    return cu_q, cu_k, lens_q, lens_k, max_q, max_k


class _Packing:
    """Gather indices between the packed ``[T, ...]`` layout and the padded ``[S * L, ...]`` one."""

    def __init__(self, cu: Tensor, lens: Tensor, max_len: int, total: int):
        t = torch.arange(max_len, device=cu.device)
        valid = t < lens[:, None]                                            # [S, L]
        # Padded position (s, t) reads token cu[s] + t; a padding position reads an appended zero row.
        self.gather = torch.where(valid, cu[:-1, None] + t, total).reshape(-1)
        # Token cu[s] + t sits at padded position s * L + t (tokens are in sequence order).
        self.scatter = torch.arange(valid.numel(), device=cu.device)[valid.reshape(-1)]
        self.S, self.L = lens.numel(), max_len

    def pad(self, x: Tensor, lead: int = 0) -> Tensor:
        """``[..lead.., T, heads, d]`` -> ``[..lead.., S, heads, L, d]``."""
        zero = x.new_zeros(x.shape[:lead] + (1,) + x.shape[lead + 1:])
        y = torch.cat([x, zero], dim=lead).index_select(lead, self.gather)
        y = y.reshape(y.shape[:lead] + (self.S, self.L) + y.shape[lead + 1:])
        return y.transpose(lead + 1, lead + 2)

    def unpad(self, y: Tensor, lead: int = 0) -> Tensor:
        """``[..lead.., S, heads, L, d]`` -> ``[..lead.., T, heads, d]``."""
        y = y.transpose(lead + 1, lead + 2)
        y = y.reshape(y.shape[:lead] + (self.S * self.L,) + y.shape[lead + 2:])
        return y.index_select(lead, self.scatter)


def _packings(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    cu_q, cu_k, lens_q, lens_k, max_q, max_k = _check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return (_Packing(cu_q, lens_q, max_q, q.shape[0]), _Packing(cu_k, lens_k, max_k, k.shape[0]),
            lens_q, lens_k)


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     window: Optional[tuple[int, int]] = None, scale: Optional[float] = None,
                     backend: Optional[str] = None) -> Tensor:
    """:func:`condinit.attention` on packed variable-length sequences (FlashAttention's varlen
    layout); no attention across sequences.

    Args:
        q: ``[Tq, H, d]``, the ``S`` query sequences back to back.
        k, v: ``[Tk, Hkv, d]`` (``Hkv`` divides ``H``).
        cu_seqlens_q, cu_seqlens_k: int ``[S + 1]`` prefix sums of the sequence lengths
            (``0, len_0, len_0 + len_1, ..., T``).
        max_seqlen_q, max_seqlen_k: at least the longest sequence; the padded batch is
            ``[S, H, max_seqlen, d]``.
        causal, window, scale, backend: as in :func:`condinit.attention`, per sequence
            (causal is bottom-right aligned when a sequence's query and key lengths differ).

    Returns ``[Tq, H, d]``. Differentiable in every mode, like :func:`condinit.attention`.
    Memory: ``O(S * max_seqlen)`` for the padded copies (``docs/design.md``, "Attention").

    Examples:
        >>> q = torch.randn(5 + 64, 8, 64); k = v = torch.randn(5 + 64, 2, 64)
        >>> cu = torch.tensor([0, 5, 69])
        >>> out = condinit.attention_varlen(q, k, v, cu, cu, 64, 64, causal=True)
    """
    pq, pk, lens_q, lens_k = _packings(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = attention(pq.pad(q), pk.pad(k), pk.pad(v), causal=causal, window=window, q_lens=lens_q,
                    kv_lens=lens_k, scale=scale, backend=backend)
    return pq.unpad(out)


def attention_jvp_varlen(q: Tensor, k: Tensor, v: Tensor, tq: Optional[Tensor] = None,
                         tk: Optional[Tensor] = None, tv: Optional[Tensor] = None, *,
                         cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                         max_seqlen_k: int, causal: bool = False,
                         window: Optional[tuple[int, int]] = None, scale: Optional[float] = None,
                         backend: Optional[str] = None, grad_through_tangent: bool = True
                         ) -> tuple[Tensor, Tensor]:
    """:func:`condinit.attention_jvp` on packed variable-length sequences: ``(out, tangent_out)``.

    ``q``, ``k``, ``v``, ``cu_seqlens_*``, ``max_seqlen_*`` as in :func:`attention_varlen`;
    tangents shaped like their primal or with a leading probe dim ``[P, T, heads, d]`` (None: zero);
    the other keywords as in :func:`condinit.attention_jvp`. Returns ``out`` ``[Tq, H, d]`` and
    ``tangent_out`` ``[Tq, H, d]`` or ``[P, Tq, H, d]``; gradients flow through both.

    Examples:
        >>> cu = torch.tensor([0, 5, 69])
        >>> q = torch.randn(69, 8, 64); k = v = torch.randn(69, 2, 64)
        >>> out, tout = condinit.attention_jvp_varlen(q, k, v, tq=torch.randn_like(q), cu_seqlens_q=cu,
        ...                                           cu_seqlens_k=cu, max_seqlen_q=64, max_seqlen_k=64)
    """
    pq, pk, lens_q, lens_k = _packings(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    probe = None
    for name, t, x in (("tq", tq, q), ("tk", tk, k), ("tv", tv, v)):
        if t is None:
            continue
        check_tensor(name, t, floating=True)
        has_p = t.dim() == x.dim() + 1
        if t.shape[has_p:] != x.shape or (probe is not None and has_p != probe):
            raise ValueError(f"{name} must have the shape of its primal {tuple(x.shape)}, or [P, "
                             f"*{tuple(x.shape)}] like the other tangents, got {tuple(t.shape)}")
        probe = has_p
    lead = 1 if probe else 0
    tangents = [p.pad(t, lead) if t is not None else None for p, t in ((pq, tq), (pk, tk), (pk, tv))]
    out, tout = attention_jvp(pq.pad(q), pk.pad(k), pk.pad(v), *tangents, causal=causal, window=window,
                              q_lens=lens_q, kv_lens=lens_k, scale=scale, backend=backend,
                              grad_through_tangent=grad_through_tangent)
    return pq.unpad(out), pq.unpad(tout, lead)
