"""An upper bound on kappa(J), the condition number of the attention weight Jacobian.

The bound is Theorem 3.1 of Conditioned Initialization for Attention (2026); its derivation is in
``docs/design.md``, "The attention Jacobian". For one head and one sequence ``X`` (``N x D``), with
``S`` the scores and ``P = softmax(S)``::

    kappa(J) <= kappa(X)^3 kappa(Lambda(P)) kappa(W_V) (kappa(W_Q) + kappa(W_K)) + kappa(X) kappa(P)

Definitions used here (each value is float64):

* ``kappa(X_b)`` over the ``min(N, D)`` singular values of sequence ``b``; ``kappa(W_Q,h)`` etc. over
  the ``d`` singular values of head ``h``'s ``[d, D]`` row block (key/value head ``g(h)`` under GQA).
* ``S = s (X W_Q,h^T + b_Q)(X W_K,g^T + b_K)^T`` with the layer's scale ``s`` and the causal mask
  when ``causal``; ``kappa(P)`` of the ``N x N`` attention matrix.
* ``Lambda(P)``: the softmax Jacobian ``dP/dS`` is block-diagonal over rows, block ``i`` being
  ``Lambda(p_i) = Diag(p_i) - p_i p_i^T`` on the keys row ``i`` attends. Each block is singular
  (``Lambda 1 = 0``), so kappa is taken over nonzero singular values, and aggregated over rows as the
  kappa of the whole block-diagonal matrix: ``max_i lambda_max(Lambda(p_i)) / min_i lambda_2(Lambda(p_i))``
  (rows attending a single key have ``Lambda = 0`` and are skipped). The eigenvalues come from the
  secular equation ``1 = sum_j p_j^2 / (p_j - lambda)`` (rank-one downdate of ``Diag(p)``; they
  interlace the sorted ``p``), solved by bisection: O(N^2) per head, no ``N x N x N`` tensor.

The bound covers one head on one sequence; the layer's value is the maximum over heads and batch
elements (``per_head`` holds them all). The measured kappa(J) beside it (``measured``) is the whole
layer's weight Jacobian (all heads, the whole batch, on the complement of its known nulls; see
:mod:`condinit.probe.estimators`), which is not itself covered by a per-head bound: read the two as
the predicted and the observed quantity side by side.

Vacuous cases: the bound is reported as None, with the reason in ``notes``, whenever a term is
infinite or undefined: a rank-deficient ``X_b`` (repeated tokens, ``x = 0``: ``kappa(X) = inf``), a
rank-deficient weight block, a singular attention matrix ``P``, or a softmax Jacobian that is 0
(every row attends a single key, e.g. one token, ``N = 1``: ``Lambda(P) = 0`` has no nonzero
singular value). Non-finite ``x`` or weights raise :class:`~condinit.probe.operator.NonFiniteError`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from condinit._validate import check_bool, check_int, check_seed

from .autocast import autocast_disabled

__all__ = ["ConditionNumberBound", "condition_number_bound", "softmax_jacobian_kappa"]


@dataclass
class ConditionNumberBound:
    """The bound's terms for one layer (max over heads / batch) and the measured kappa(J)."""

    bound: Optional[float]
    kappa_X: Optional[float]
    kappa_WQ: Optional[float]
    kappa_WK: Optional[float]
    kappa_WV: Optional[float]
    kappa_Lambda: Optional[float]
    kappa_softmax: Optional[float]
    per_head: list            # [B][H] bound per (sequence, head), None where vacuous
    measured_kappa: Optional[float] = None
    measured: Optional[object] = None     # SpectrumEstimate
    notes: str = ""                       # why the bound is vacuous (None), when it is
    definition: str = ("bound = max over (b, h) of kappa(X_b)^3 kappa(Lambda(P_bh)) kappa(W_V,g) (kappa(W_Q,h) + "
                       "kappa(W_K,g)) + kappa(X_b) kappa(P_bh); kappa(Lambda) over nonzero singular values of the "
                       "row-block-diagonal softmax Jacobian; see condinit.probe.bound")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["measured"] = self.measured.to_dict() if self.measured is not None else None
        return d


def _svdvals(M: Tensor) -> Tensor:
    """Singular values of ``M [..., m, n]``, taken of the tall orientation: LAPACK on a wide matrix is
    many times slower than on its transpose, with the same values."""
    return torch.linalg.svdvals(M.mT if M.shape[-1] > M.shape[-2] else M)


def _kappa(s: Tensor, rtol: float = 1e-13) -> Tensor:
    """sigma_max / sigma_min per row of singular values ``[..., r]``; inf when rank-deficient."""
    smax, smin = s[..., 0], s[..., -1]
    return torch.where(smin > rtol * smax, smax / smin.clamp_min(1e-300), torch.full_like(smax, math.inf))


def _singular_p(sP: Tensor, kP: Tensor, causal: bool) -> str:
    """Why ``kappa(P)`` is inf for some heads, with the smallest ratio ``sigma_min(P) / sigma_max(P)``."""
    ratio = float((sP[..., -1] / sP[..., 0].clamp_min(1e-300)).min())
    why = ("): lower triangular with a positive diagonal, P is invertible, but its smallest singular value falls "
           "exponentially with N") if causal else "; e.g. repeated tokens)"
    return (f"kappa(P) = inf: the {'causal ' if causal else ''}attention matrix is singular to float64 for "
            f"{int(torch.isinf(kP).sum())} of {kP.numel()} (sequence, head) pairs (sigma_min(P) / sigma_max(P) "
            f"down to {ratio:.1e}, at most 1e-13{why}")


def _secular_root(p: Tensor, lo: Tensor, hi: Tensor, iters: int = 100) -> Tensor:
    """Root of ``1 - sum_j p_j^2 / (p_j - lam)`` in ``(lo, hi)`` (decreasing there), by bisection."""
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        f = 1.0 - (p * p / (p - mid.unsqueeze(-1))).sum(-1)
        # f > 0 left of the root
        lo = torch.where(f > 0, mid, lo)
        hi = torch.where(f > 0, hi, mid)
    return 0.5 * (lo + hi)


def softmax_jacobian_kappa(P: Tensor) -> Tensor:
    """kappa over nonzero singular values of ``blockdiag_i(Diag(p_i) - p_i p_i^T)`` for ``P`` ``[..., N, N]``.

    Zero entries (masked keys) are outside the row's support. Returns ``[...]``; inf if every row
    attends a single key (always so for ``N = 1``: then ``Lambda(P) = 0``).
    """
    P = P.to(torch.float64)
    if P.shape[-1] < 2:
        return torch.full(P.shape[:-2], math.inf, dtype=torch.float64, device=P.device)
    ps, _ = torch.sort(P, dim=-1)                      # ascending
    N = P.shape[-1]
    nz = (ps > 0).sum(-1)                              # support size per row
    z = N - nz                                          # index of the smallest nonzero entry
    ok = nz >= 2
    zi = z.clamp(max=N - 2).unsqueeze(-1)
    p_lo = ps.gather(-1, zi).squeeze(-1)               # smallest two nonzero entries
    p_lo2 = ps.gather(-1, zi + 1).squeeze(-1)
    lam2 = _secular_root(ps, p_lo, p_lo2)              # in (p_(1), p_(2)) on the support
    lmax = _secular_root(ps, ps[..., -2], ps[..., -1])  # in (p_(n-1), p_(n))
    lam2 = torch.where(p_lo == p_lo2, p_lo, lam2)      # a repeated value is itself an eigenvalue
    lmax = torch.where(ps[..., -2] == ps[..., -1], ps[..., -1], lmax)
    big = torch.where(ok, lmax, torch.zeros_like(lmax)).amax(-1)
    small = torch.where(ok, lam2, torch.full_like(lam2, math.inf)).amin(-1)
    return torch.where(torch.isfinite(small) & (small > 0), big / small.clamp_min(1e-300),
                       torch.full_like(big, math.inf))


def _where_inf(k: Tensor) -> str:
    idx = torch.isinf(k).nonzero().flatten().tolist()
    return ", ".join(map(str, idx[:8])) + (", ..." if len(idx) > 8 else "")


def _fin(x) -> Optional[float]:
    x = float(x)
    return x if math.isfinite(x) else None


def condition_number_bound(layer: nn.Module, x: Tensor, *, causal: bool = False, scale: Optional[float] = None,
                           measure: bool = True, steps: int = 20, seed: int = 0,
                           dtype=torch.float64) -> ConditionNumberBound:
    """Upper bound on kappa(J) of ``layer``'s weight Jacobian on the batch ``x`` ``[B, N, D]``.

    The bound is Theorem 3.1 of Conditioned Initialization for Attention (2026), evaluated per
    (sequence, head) and maximized (see the module doc for the definitions). ``measure=True`` also
    runs :func:`condinit.probe.lanczos_svd` (``steps``, ``seed``) on the layer's weight Jacobian
    (before ``W_O``) and fills ``measured_kappa`` / ``measured``, to read beside the bound.
    ``causal``, ``scale`` and ``dtype`` are as for :class:`~condinit.probe.JacobianOperator`.
    ``bound`` is None when it is vacuous (a term infinite or undefined: rank-deficient ``X``, one
    token, ...); ``notes`` then says which term and why. NaN or Inf in ``x`` or the weights raise
    :class:`~condinit.probe.NonFiniteError`.

    Examples:
        >>> layer = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        >>> x = torch.randn(1, 12, 16)
        >>> res = condinit.condition_number_bound(layer, x, steps=200, seed=0)
        >>> res.bound, res.measured_kappa      # the bound beside the measured kappa(J)
    """
    from .estimators import lanczos_svd
    from .operator import JacobianOperator

    check_bool("measure", measure)
    check_int("steps", steps, min=1)
    check_seed("seed", seed)
    # the theorem is about the bare A(X): no QK-norm, RoPE or soft-capping the module may apply
    op = JacobianOperator(layer, x, wrt="weights", causal=causal, dtype=dtype, scale=scale, transforms="none")
    B, N, H, Hkv, d, G = op.B, op.N, op.H, op.Hkv, op.d, op.G
    f64 = torch.float64
    with torch.no_grad(), autocast_disabled(op.device):
        X = op.X.to(f64)
        kX = _kappa(_svdvals(X))                                              # [B]
        blocks = lambda w, h: w.to(f64).reshape(h, d, -1)                     # noqa: E731
        kQ = _kappa(_svdvals(blocks(op.Wq, H)))                               # [H]
        kK = _kappa(_svdvals(blocks(op.Wk, Hkv))).repeat_interleave(G)
        kV = _kappa(_svdvals(blocks(op.Wv, Hkv))).repeat_interleave(G)
        q, k, _, _, _ = op._primal()
        k = k.to(f64).repeat_interleave(G, dim=1)
        S = op.scale * (q.to(f64) @ k.transpose(-1, -2))                      # [B, H, N, N]
        if causal:
            S = S.masked_fill(torch.ones(N, N, dtype=torch.bool, device=S.device).triu(1), -math.inf)
        P = torch.softmax(S, dim=-1)
        scores_finite = bool(torch.isfinite(P).all())
        if scores_finite:
            sP = _svdvals(P)
            kP = _kappa(sP)                                                   # [B, H]
            kL = softmax_jacobian_kappa(P)                                    # [B, H]
        else:   # scores overflow float64: P (and every term built on it) is undefined
            kP = kL = torch.full((B, H), math.nan, dtype=f64, device=P.device)
        kx = kX[:, None]
        bound = kx ** 3 * kL * kV * (kQ + kK) + kx * kP                       # [B, H]
    per_head = [[_fin(v) for v in row] for row in bound.tolist()]
    finite = [v for row in per_head for v in row if v is not None]
    vacuous = not finite or any(v is None for row in per_head for v in row)
    reasons = []
    if not scores_finite:
        reasons.append(f"the scores overflow {f64} (softmax not finite): kappa(P) and kappa(Lambda(P)) undefined")
    if bool(torch.isinf(kX).any()):
        reasons.append(f"kappa(X_b) = inf for sequence(s) {_where_inf(kX)}: X_b is rank-deficient (e.g. repeated "
                       f"tokens, x = 0)")
    for name, kw in (("W_Q,h", kQ), ("W_K,g", kK), ("W_V,g", kV)):
        if bool(torch.isinf(kw).any()):
            reasons.append(f"kappa({name}) = inf: a head's weight block is rank-deficient")
    if scores_finite and bool(torch.isinf(kL).any()):
        reasons.append("kappa(Lambda(P)) undefined: every row attends a single key, so the softmax Jacobian is 0"
                       + (" (N = 1: one token)" if N == 1 else ""))
    if scores_finite and bool(torch.isinf(kP).any()):
        reasons.append(_singular_p(sP, kP, causal))
    if vacuous and not reasons:
        reasons.append("the product of the (finite) terms overflows float64")
    res = ConditionNumberBound(
        bound=None if vacuous else max(finite), kappa_X=_fin(kX.max()), kappa_WQ=_fin(kQ.max()),
        kappa_WK=_fin(kK.max()), kappa_WV=_fin(kV.max()), kappa_Lambda=_fin(kL.max()),
        kappa_softmax=_fin(kP.max()), per_head=per_head,
        notes=("bound vacuous: " + "; ".join(reasons)) if vacuous else "")
    if measure:
        est = lanczos_svd(op, steps=steps, seed=seed)
        res.measured, res.measured_kappa = est, est.kappa
    return res
