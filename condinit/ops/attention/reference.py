"""Tiled PyTorch reference of fused attention: forward (with log-sum-exp), VJP, fused JVP and
the backward through the JVP.

This is the ``torch`` backend of the ``attention_fwd`` / ``attention_bwd`` / ``attention_jvp`` /
``attention_jvp_bwd`` ops
and the readable statement of what the Triton and C++ kernels compute (docs/design.md, "Attention"). It
walks blocks of queries x blocks of keys with an online softmax, so besides the inputs and outputs
it holds O(block_q * block_k) scores at a time, never an N x N matrix. Accumulation is in float32
(float64 when the inputs are float64); outputs are cast back to the input dtype.

Conventions shared by every backend:

* ``q`` is ``[B, H, Nq, d]``; ``k``, ``v`` are ``[B, Hkv, Nk, d]`` with ``Hkv | H``; query head
  ``h`` reads key/value head ``h // (H // Hkv)`` (grouped-query attention). Here the ``G = H / Hkv``
  query heads of a group are a broadcast dimension: ``q`` is viewed as ``[B, Hkv, G, Nq, d]`` and
  ``k``, ``v`` as ``[B, Hkv, 1, Nk, d]``, so K and V are never repeated.
* ``S = scale * Q K^T`` under the mask (``causal``, ``window_left``, ``window_right``, ``q_lens``,
  ``kv_lens``) of :func:`condinit.attention` and docs/design.md ("Attention", "Masks").
* ``lse[b, h, i] = log(sum_j exp(S_ij))`` over the attended keys, float32 (float64 for float64
  inputs). A row that attends no key has ``out = 0``, tangent 0, ``lse = -inf`` and gradient 0.
* Tangents are 5-D ``[P, B, H or Hkv, N, d]``: ``P`` probes share one pass over the primal tiles.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = ["attention_fwd", "attention_bwd", "attention_jvp", "attention_jvp_bwd", "attention_naive",
           "BLOCK_Q", "BLOCK_K"]

# Big enough that the Python loop is not the cost on CPU, small enough that a block of scores
# ([B, H, BLOCK_Q, BLOCK_K] per probe) stays cache- and memory-friendly.
BLOCK_Q = 256
BLOCK_K = 256

_NEG_INF = float("-inf")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(x: Tensor, hkv: int) -> Tensor:
    """[..., B, H, N, d] -> [..., B, Hkv, G, N, d] (a view)."""
    *lead, b, h, n, d = x.shape
    return x.reshape(*lead, b, hkv, h // hkv, n, d)


def _ungrouped(x: Tensor) -> Tensor:
    """[..., B, Hkv, G, N, d] -> [..., B, H, N, d]."""
    *lead, b, hkv, g, n, d = x.shape
    return x.reshape(*lead, b, hkv * g, n, d)


def _grouped_inputs(q, k, v, tq, tk, tv, hkv: int, scale: float, acc_dtype):
    """Primals and tangents in the accumulation dtype, grouped for GQA, with the scale folded into
    Q and Q': q ``[B, Hkv, G, Nq, d]``, k/v ``[B, Hkv, 1, Nk, d]``, tangents with a leading ``P``
    (None stays None)."""
    qg = _grouped(q, hkv).to(acc_dtype) * scale
    kg = k.to(acc_dtype).unsqueeze(2)
    vg = v.to(acc_dtype).unsqueeze(2)
    tqg = _grouped(tq, hkv).to(acc_dtype) * scale if tq is not None else None
    tkg = tk.to(acc_dtype).unsqueeze(3) if tk is not None else None
    tvg = tv.to(acc_dtype).unsqueeze(3) if tv is not None else None
    return qg, kg, vg, tqg, tkg, tvg


class _Mask:
    """Which keys each query row attends, and the blocks that need masking.

    Row ``i`` of batch ``b`` attends the keys ``lo[b, i] <= j < hi[b, i]`` (the mask of
    docs/design.md, "Attention", "Masks"); rows ``i >= Lq`` attend nothing. Every constraint is an
    interval, so the allowed keys of a row are one interval and ``lo``, ``hi`` grow with ``i``.
    """

    def __init__(self, nq: int, nk: int, causal: bool, window_left: int, window_right: int,
                 q_lens: Optional[Tensor], kv_lens: Optional[Tensor], device):
        self.nq, self.nk = nq, nk
        self.trivial = (not causal and window_left < 0 and window_right < 0 and q_lens is None
                        and kv_lens is None)
        if self.trivial:
            return
        i = torch.arange(nq, dtype=torch.int64)[None, :]                        # bounds on the host
        lq = (q_lens.to("cpu", torch.int64) if q_lens is not None else torch.full((1,), nq))[:, None]
        lk = (kv_lens.to("cpu", torch.int64) if kv_lens is not None else torch.full((1,), nk))[:, None]
        diag = i + (lk - lq)                                                    # [B or 1, Nq]
        hi = lk.expand_as(diag)
        if causal:
            hi = torch.minimum(hi, diag + 1)
        if window_right >= 0:
            hi = torch.minimum(hi, diag + window_right + 1)
        lo = torch.zeros_like(hi)
        if window_left >= 0:
            lo = torch.maximum(lo, diag - window_left)
        valid = i < lq
        self.lo = torch.where(valid, lo, 0)
        self.hi = torch.where(valid, torch.maximum(hi, self.lo), 0)             # empty: hi <= lo
        self.lo_dev, self.hi_dev = self.lo.to(device), self.hi.to(device)

    def key_blocks(self, i0: int, i1: int, block_k: int) -> list[tuple[int, int]]:
        """The key blocks ``[j0, j1)`` that rows ``[i0, i1)`` may attend (aligned to ``block_k``)."""
        if self.trivial:
            start, end = 0, self.nk
        else:
            lo, hi = self.lo[:, i0:i1], self.hi[:, i0:i1]
            live = hi > lo
            if not live.any():
                return []
            start = int(lo[live].min()) // block_k * block_k
            end = int(hi[live].max())
        return [(j0, min(self.nk, j0 + block_k)) for j0 in range(start, end, block_k)]

    def block(self, i0: int, i1: int, j0: int, j1: int) -> Optional[Tensor]:
        """Bool ``[B or 1, 1, 1, bq, bk]`` of the allowed pairs of a block (broadcasts over the kv
        heads and the query heads of a group), None when all are allowed."""
        if self.trivial:
            return None
        lo, hi = self.lo[:, i0:i1], self.hi[:, i0:i1]
        if bool((lo <= j0).all()) and bool((hi >= j1).all()):
            return None
        j = torch.arange(j0, j1, device=self.lo_dev.device)
        allowed = (j >= self.lo_dev[:, i0:i1, None]) & (j < self.hi_dev[:, i0:i1, None])
        return allowed[:, None, None]


def _mm(a: Tensor, x: Tensor, allowed: Optional[Tensor]) -> Tensor:
    """``a @ x`` where ``a`` is 0 outside ``allowed`` (a mask over its last two dims), exact when
    ``x`` holds NaN / Inf in rows that only masked-out pairs touch: those never contribute (a
    plain product gives ``0 * NaN = NaN``). A non-finite entry that an allowed pair touches
    makes the result NaN there."""
    if allowed is None:
        return a @ x
    finite = torch.isfinite(x)
    if bool(finite.all()):
        return a @ x
    out = a @ torch.where(finite, x, torch.zeros_like(x))
    hit = (allowed.to(x.dtype) @ (~finite).to(x.dtype)) > 0
    return torch.where(hit, torch.full_like(out, float("nan")), out)


def _zero_outside(x: Optional[Tensor], allowed: Optional[Tensor]) -> Optional[Tensor]:
    """Score-shaped ``x`` set to 0 at masked-out pairs (which may hold NaN from masked inputs)."""
    if x is None or allowed is None:
        return x
    return x.masked_fill(~allowed, 0.0)


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                  window_left: int = -1, window_right: int = -1, q_lens: Optional[Tensor] = None,
                  kv_lens: Optional[Tensor] = None,
                  block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> tuple[Tensor, Tensor]:
    """Forward: ``out = softmax(scale * Q K^T) V`` and ``lse = logsumexp(scale * Q K^T)``.

    Online softmax per query block: running max ``m``, ``l = rowsum(exp(S - m))`` and
    ``acc = exp(S - m) V``, rescaled by ``alpha = exp(m_old - m_new)`` when ``m`` grows.
    """
    out, _, lse = attention_jvp(q, k, v, None, None, None, causal, scale, window_left, window_right,
                                q_lens, kv_lens, block_q, block_k)
    return out, lse


def attention_jvp(q: Tensor, k: Tensor, v: Tensor, tq: Optional[Tensor], tk: Optional[Tensor],
                  tv: Optional[Tensor], causal: bool, scale: float,
                  window_left: int = -1, window_right: int = -1, q_lens: Optional[Tensor] = None,
                  kv_lens: Optional[Tensor] = None,
                  block_q: int = BLOCK_Q, block_k: int = BLOCK_K
                  ) -> tuple[Tensor, Optional[Tensor], Tensor]:
    """Fused single-pass JVP: ``(out, tout, lse)`` for tangents ``[P, ...]`` (None = zero tangent).

    With ``S' = scale (Q' K^T + Q K'^T)``, ``P~ = exp(S - m)`` and ``l = rowsum(P~)`` carry, next
    to ``acc = P~ V``, the sums ``accA = P~ V'``, ``accB = (P~ * S') V`` and
    ``r = rowsum(P~ * S')``, all rescaled by the same ``alpha``. Then ``O = acc / l`` and
    ``O' = (accA + accB) / l - (r / l) O``. The primal tiles (scores, exponentials, ``m``, ``l``)
    are computed once and shared by all ``P`` probes. When every tangent is None only the
    forward runs and ``tout`` is None.

    Differentiable with plain torch autograd (every op is); :func:`condinit.attention_jvp` gets
    its gradients from :func:`attention_jvp_bwd` instead, which holds no per-block intermediates.
    """
    B, H, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    acc_dtype = _acc_dtype(q.dtype)
    with_tangent = tq is not None or tk is not None or tv is not None
    P = next(t.shape[0] for t in (tq, tk, tv) if t is not None) if with_tangent else 0

    # The scale is folded into Q and Q' (S = (s Q) K^T, S' = (s Q') K^T + (s Q) K'^T): no
    # elementwise pass over the score blocks for it.
    qg, kg, vg, tqg, tkg, tvg = _grouped_inputs(q, k, v, tq, tk, tv, Hkv, scale, acc_dtype)
    # With both Q' and K', S' = [s Q', s Q] [K, K']^T: one product with inner dim 2d.
    both = tqg is not None and tkg is not None
    mask = _Mask(Nq, Nk, causal, window_left, window_right, q_lens, kv_lens, q.device)
    if both:
        kcat = torch.cat([kg.expand(P, *kg.shape), tkg], dim=-1)            # [P, B, Hkv, 1, Nk, 2d]

    outs, touts, lses = [], [], []
    for i0 in range(0, Nq, block_q):
        i1 = min(Nq, i0 + block_q)
        qb = qg[..., i0:i1, :]
        tqb = tqg[..., i0:i1, :] if tqg is not None else None
        if both:
            qcat = torch.cat([tqb, qb.expand(P, *qb.shape)], dim=-1)        # [P, B, Hkv, G, bq, 2d]
        rows = qb.shape[:-1]                                            # [B, Hkv, G, bq]
        m = qb.new_full(rows, _NEG_INF)
        l = qb.new_zeros(rows)
        acc = qb.new_zeros(qb.shape)
        if with_tangent:
            acc_tangent = qb.new_zeros((P,) + qb.shape)                      # accA + accB, summed as we go
            r = qb.new_zeros((P,) + rows)
        for j0, j1 in mask.key_blocks(i0, i1, block_k):
            kb, vb = kg[..., j0:j1, :], vg[..., j0:j1, :]
            s = qb @ kb.transpose(-1, -2)                               # [B, Hkv, G, bq, bk]
            allowed = mask.block(i0, i1, j0, j1)
            if allowed is not None:
                s = s.masked_fill(~allowed, _NEG_INF)
            # m only stabilizes the exponentials; the result does not depend on it, so it is
            # held constant for autograd (exact, and avoids differentiating through max).
            m_new = torch.maximum(m, s.detach().amax(-1))
            m_safe = torch.where(m_new == _NEG_INF, torch.zeros_like(m_new), m_new)  # empty rows
            alpha = torch.exp(m - m_safe)
            p = torch.exp(s - m_safe[..., None])                        # P~, 0 where masked
            l = alpha * l + p.sum(-1)
            acc = alpha[..., None] * acc + _mm(p, vb, allowed)
            if with_tangent:
                if both:                                                # S' = s (Q' K^T + Q K'^T)
                    ds = qcat @ kcat[..., j0:j1, :].transpose(-1, -2)
                elif tqb is not None:
                    ds = tqb @ kb.transpose(-1, -2)
                elif tkg is not None:
                    ds = qb @ tkg[..., j0:j1, :].transpose(-1, -2)
                else:
                    ds = None
                ds = _zero_outside(ds, allowed)
                a = alpha[..., None]
                upd = acc_tangent * a
                if ds is not None:
                    ps = p * ds                                         # P~ * S' (0 where masked)
                    r = alpha * r + ps.sum(-1)
                    upd = upd + _mm(ps, vb, allowed)                    # accB
                else:
                    r = alpha * r
                if tvg is not None:
                    upd = upd + _mm(p, tvg[..., j0:j1, :], allowed)     # accA
                acc_tangent = upd
            m = m_new
        nonempty = l != 0   # l is 0 exactly when the row sees no key; a NaN l must stay NaN
        l_safe = torch.where(nonempty, l, torch.ones_like(l))
        o = torch.where(nonempty[..., None], acc / l_safe[..., None], torch.zeros_like(acc))
        outs.append(o)
        lses.append(torch.where(nonempty, m + torch.log(l_safe), torch.full_like(l, _NEG_INF)))
        if with_tangent:
            to = acc_tangent / l_safe[..., None] - (r / l_safe)[..., None] * o
            touts.append(torch.where(nonempty[..., None], to, torch.zeros_like(to)))
    out = _ungrouped(torch.cat(outs, dim=-2)).to(q.dtype)
    lse = torch.cat(lses, dim=-1).reshape(B, H, Nq)
    tout = _ungrouped(torch.cat(touts, dim=-2)).to(q.dtype) if with_tangent else None
    return out, tout, lse


def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  causal: bool, scale: float,
                  window_left: int = -1, window_right: int = -1, q_lens: Optional[Tensor] = None,
                  kv_lens: Optional[Tensor] = None,
                  block_q: int = BLOCK_Q, block_k: int = BLOCK_K
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """VJP from the saved ``lse`` (the flash backward): ``(dq, dk, dv)``.

    ``P = exp(S - lse)``, ``D = rowsum(dO * O)``, ``dP = dO V^T``, ``dS = P * (dP - D)``,
    ``dQ = scale dS K``, ``dK = scale dS^T Q``, ``dV = P^T dO``; ``dK`` and ``dV`` sum over the
    query heads of each group.
    """
    B, H, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    acc_dtype = _acc_dtype(q.dtype)
    qg = _grouped(q, Hkv).to(acc_dtype) * scale              # s Q: S = (s Q) K^T, dK = dS^T (s Q)
    dog = _grouped(dout, Hkv).to(acc_dtype)
    og = _grouped(out, Hkv).to(acc_dtype)
    kg = k.to(acc_dtype).unsqueeze(2)
    vg = v.to(acc_dtype).unsqueeze(2)
    lseg = lse.to(acc_dtype).reshape(B, Hkv, H // Hkv, Nq)
    # Empty rows (lse = -inf) have P = exp(-inf - 0) = 0 everywhere.
    lseg = torch.where(lseg == _NEG_INF, torch.zeros_like(lseg), lseg)
    mask = _Mask(Nq, Nk, causal, window_left, window_right, q_lens, kv_lens, q.device)
    dk = torch.zeros(B, Hkv, Nk, d, dtype=acc_dtype, device=q.device)
    dv = torch.zeros_like(dk)
    dqs = []
    for i0 in range(0, Nq, block_q):
        i1 = min(Nq, i0 + block_q)
        qb, dob = qg[..., i0:i1, :], dog[..., i0:i1, :]
        lb = lseg[..., i0:i1, None]
        D = (dob * og[..., i0:i1, :]).sum(-1, keepdim=True)             # [B, Hkv, G, bq, 1]
        dq = torch.zeros_like(qb)
        for j0, j1 in mask.key_blocks(i0, i1, block_k):
            kb, vb = kg[..., j0:j1, :], vg[..., j0:j1, :]
            s = qb @ kb.transpose(-1, -2)
            allowed = mask.block(i0, i1, j0, j1)
            if allowed is not None:
                s = s.masked_fill(~allowed, _NEG_INF)
            p = _zero_outside(torch.exp(s - lb), allowed)               # [B, Hkv, G, bq, bk]
            dp = dob @ vb.transpose(-1, -2)
            ds = _zero_outside(p * (dp - D), allowed)
            allowed_t = allowed.transpose(-1, -2) if allowed is not None else None
            dq += _mm(ds, kb, allowed)
            dk[..., j0:j1, :] += _mm(ds.transpose(-1, -2), qb, allowed_t).sum(2)
            dv[..., j0:j1, :] += _mm(p.transpose(-1, -2), dob, allowed_t).sum(2)
        dqs.append(dq)
    dq = _ungrouped(torch.cat(dqs, dim=-2)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _tangent_scores(qb: Tensor, tqb: Optional[Tensor], kb: Tensor, tkb: Optional[Tensor]
                    ) -> Optional[Tensor]:
    """``S' = (s Q') K^T + (s Q) K'^T`` of a block, ``[P, ..., bq, bk]``; None when both tangents
    are None (S' = 0). ``qb`` and ``tqb`` carry the scale."""
    ds = tqb @ kb.transpose(-1, -2) if tqb is not None else None
    if tkb is not None:
        part = qb @ tkb.transpose(-1, -2)
        ds = part if ds is None else ds + part
    return ds


def attention_jvp_bwd(gout: Tensor, gtout: Tensor, q: Tensor, k: Tensor, v: Tensor,
                      tq: Optional[Tensor], tk: Optional[Tensor], tv: Optional[Tensor],
                      out: Tensor, tout: Tensor, lse: Tensor, causal: bool, scale: float,
                      window_left: int = -1, window_right: int = -1, q_lens: Optional[Tensor] = None,
                      kv_lens: Optional[Tensor] = None,
                      block_q: int = BLOCK_Q, block_k: int = BLOCK_K
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward through the fused JVP: ``(dq, dk, dv, dtq, dtk, dtv)`` of a loss on
    ``(out, tout)`` with upstream gradients ``gout`` ``[B, H, Nq, d]`` and ``gtout``
    ``[P, B, H, Nq, d]``, from the saved ``out``, ``tout`` ``[P, ...]`` and ``lse``.

    Per probe, with ``P = exp(S - lse)`` and ``S'`` recomputed per block (docs/design.md,
    "Attention")::

        r   = rowsum(P * S')            d'  = rowsum(gO' * O)
        D   = rowsum(gO * O) + sum_p (rowsum(gO'_p * O'_p) - r_p d'_p)
        dP' = gO' V^T                   gS' = P * (dP' - d')
        gP  = gO V^T + sum_p (gO'_p V'_p^T + dP'_p * (S'_p - r_p) - S'_p d'_p)
        gS  = P * (gP - D)
        dq  = s (gS K + sum_p gS'_p K'_p)     dk = s (gS^T Q + sum_p gS'_p^T Q'_p)
        dv  = P^T gO + sum_p P'_p^T gO'_p     (P' = P * (S' - r))
        dtq = s gS' K      dtk = s gS'^T Q     dtv = P^T gO'

    ``r`` is not saved by the forward (the JVP op's outputs are the same on every backend):
    each query block first sweeps its keys for ``r`` (the products of ``S`` and ``S'``), then
    sweeps them again for the gradients. Memory: the inputs, the gradients and O(block_q *
    block_k) scores per probe and head; never an N x N matrix. ``dk``, ``dv``, ``dtk``, ``dtv``
    sum over the query heads of each group, ``dq`` and ``dk`` over the probes. A None tangent
    is a zero tangent (its products are skipped) and still gets its gradient.
    """
    B, H, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    P = gtout.shape[0]
    acc_dtype = _acc_dtype(q.dtype)
    # Scale folded into Q and Q' as in the forward: S = (s Q) K^T, and dk = gS^T (s Q) etc.
    qg, kg, vg, tqg, tkg, tvg = _grouped_inputs(q, k, v, tq, tk, tv, Hkv, scale, acc_dtype)
    gog = _grouped(gout, Hkv).to(acc_dtype)
    gtog = _grouped(gtout, Hkv).to(acc_dtype)                                # [P, B, Hkv, G, Nq, d]
    og = _grouped(out, Hkv).to(acc_dtype)
    lseg = lse.to(acc_dtype).reshape(B, Hkv, H // Hkv, Nq)
    # Empty rows (lse = -inf) have P = exp(-inf - 0) = 0 everywhere, hence zero gradients.
    lseg = torch.where(lseg == _NEG_INF, torch.zeros_like(lseg), lseg)
    # Row statistics from the saved outputs; D gets its -sum_p r_p d'_p once r is known.
    delta_t = (gtog * og).sum(-1)                                            # d' [P, B, Hkv, G, Nq]
    D_saved = (gog * og).sum(-1) + (gtog * _grouped(tout, Hkv).to(acc_dtype)).sum(-1).sum(0)

    mask = _Mask(Nq, Nk, causal, window_left, window_right, q_lens, kv_lens, q.device)
    dk = torch.zeros(B, Hkv, Nk, d, dtype=acc_dtype, device=q.device)
    dv = torch.zeros_like(dk)
    dtk = torch.zeros((P,) + tuple(dk.shape), dtype=acc_dtype, device=q.device)
    dtv = torch.zeros_like(dtk)
    dqs, dtqs = [], []
    for i0 in range(0, Nq, block_q):
        i1 = min(Nq, i0 + block_q)
        qb, gob, gtob = qg[..., i0:i1, :], gog[..., i0:i1, :], gtog[..., i0:i1, :]
        tqb = tqg[..., i0:i1, :] if tqg is not None else None
        lb = lseg[..., i0:i1, None]
        dlt = delta_t[..., i0:i1, None]                                      # [P, B, Hkv, G, bq, 1]
        key_blocks = mask.key_blocks(i0, i1, block_k)

        def probs(j0: int, j1: int, allowed: Optional[Tensor]) -> Tensor:
            """P = exp(S - lse) of the block, 0 where masked."""
            s = qb @ kg[..., j0:j1, :].transpose(-1, -2)                     # [B, Hkv, G, bq, bk]
            if allowed is not None:
                s = s.masked_fill(~allowed, _NEG_INF)
            return _zero_outside(torch.exp(s - lb), allowed)

        def scores_t(j0: int, j1: int, allowed: Optional[Tensor]) -> Optional[Tensor]:
            return _zero_outside(_tangent_scores(qb, tqb, kg[..., j0:j1, :],
                                                 tkg[..., j0:j1, :] if tkg is not None else None),
                                 allowed)

        # Sweep 1: r = rowsum(P * S') per probe (0 when S' = 0).
        r = qb.new_zeros((P,) + qb.shape[:-1] + (1,))                        # [P, B, Hkv, G, bq, 1]
        if tqg is not None or tkg is not None:
            for j0, j1 in key_blocks:
                allowed = mask.block(i0, i1, j0, j1)
                r += (probs(j0, j1, allowed) * scores_t(j0, j1, allowed)).sum(-1, keepdim=True)
        D = D_saved[..., i0:i1, None] - (r * dlt).sum(0)                     # [B, Hkv, G, bq, 1]

        # Sweep 2: the gradients.
        dq = torch.zeros_like(qb)
        dtq = qb.new_zeros((P,) + qb.shape)
        for j0, j1 in key_blocks:
            kb, vb = kg[..., j0:j1, :], vg[..., j0:j1, :]
            tkb = tkg[..., j0:j1, :] if tkg is not None else None
            allowed = mask.block(i0, i1, j0, j1)
            allowed_t = allowed.transpose(-1, -2) if allowed is not None else None
            p = probs(j0, j1, allowed)
            ds = scores_t(j0, j1, allowed)                                   # S' or None
            dpt = gtob @ vb.transpose(-1, -2)                                # dP' [P, B, Hkv, G, bq, bk]
            gp = gob @ vb.transpose(-1, -2)                                  # gP  [B, Hkv, G, bq, bk]
            if tvg is not None:
                gp = gp + (gtob @ tvg[..., j0:j1, :].transpose(-1, -2)).sum(0)
            if ds is not None:
                gp = gp + (dpt * (ds - r) - ds * dlt).sum(0)
            # (Masked pairs are set to 0: a NaN row statistic must not reach masked keys.)
            gst = _zero_outside(p * (dpt - dlt), allowed)                    # gS' [P, ...]
            gs = _zero_outside(p * (gp - D), allowed)                        # gS
            dq += _mm(gs, kb, allowed)
            if tkb is not None:
                dq += _mm(gst, tkb, allowed).sum(0)
            dtq += _mm(gst, kb, allowed)
            t = lambda x: x.transpose(-1, -2)  # noqa: E731
            dk[..., j0:j1, :] += _mm(t(gs), qb, allowed_t).sum(2)
            if tqb is not None:
                dk[..., j0:j1, :] += _mm(t(gst), tqb, allowed_t).sum((0, 3))
            dv[..., j0:j1, :] += _mm(t(p), gob, allowed_t).sum(2)
            if ds is not None:                                               # P' = 0 when S' = 0
                pt = _zero_outside(p * (ds - r), allowed)
                dv[..., j0:j1, :] += _mm(t(pt), gtob, allowed_t).sum((0, 3))
            dtk[..., j0:j1, :] += _mm(t(gst), qb, allowed_t).sum(3)
            dtv[..., j0:j1, :] += _mm(t(p), gtob, allowed_t).sum(3)
        dqs.append(dq)
        dtqs.append(dtq)
    dq = _ungrouped(torch.cat(dqs, dim=-2)) * scale
    dtq = _ungrouped(torch.cat(dtqs, dim=-2)) * scale
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dtq.to(q.dtype), dtk.to(k.dtype),
            dtv.to(v.dtype))


def attention_naive(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                    scale: Optional[float] = None) -> Tensor:
    """Materializing attention (the N x N matrix), for tests: ``softmax(scale Q K^T + mask) V``.

    Differentiable by torch autograd / torch.func in any mode; empty causal rows give 0.
    """
    B, H, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kr = k.repeat_interleave(H // Hkv, dim=1)
    vr = v.repeat_interleave(H // Hkv, dim=1)
    s = scale * (q @ kr.transpose(-1, -2))
    if causal:
        i = torch.arange(Nq, device=q.device)[:, None]
        j = torch.arange(Nk, device=q.device)[None, :]
        allowed = j <= i + (Nk - Nq)
        nonempty = allowed.any(-1, keepdim=True)
        # Empty rows: softmax over a row of zeros (finite in every AD mode), then zeroed.
        s = torch.where(nonempty, s.masked_fill(~allowed, _NEG_INF), torch.zeros_like(s))
        p = torch.where(nonempty, torch.softmax(s, dim=-1), torch.zeros_like(s))
    else:
        p = torch.softmax(s, dim=-1)
    return p @ vr
