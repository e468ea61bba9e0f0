"""A certified lower bound on sigma_min(J) from the structure of attention (docs/design.md, "The
attention Jacobian", "A floor under sigma_min").

For one sequence and one key/value group (``G`` query heads ``h`` reading key/value head ``g``), the
output tangent of query row ``i`` of head ``h`` is

    dO_hi = M_hi a_hi + sum_j p_hij dv_j + (key terms),   M_hi = s V^T Lambda(p_hi) diag(tau_hi) K

with ``a_hi`` the row's query tangent (after RoPE: a rotation, which leaves singular values alone),
``dv_j`` the value tangents, ``Lambda(p) = Diag(p) - p p^T`` the softmax Jacobian and ``tau`` the
soft-cap's derivative (1 without one). The three tangent kinds are independent variables, so

    J J^T = J_Q J_Q^T + J_K J_K^T + J_V J_V^T  >=  J_Q J_Q^T + J_V J_V^T  >=  (D + P_s P_s^T) (x) I_d

where ``J_Q J_Q^T`` is block diagonal over the rows ``(h, i)`` with blocks ``M_hi M_hi^T >=
sigma_min(M_hi)^2 I``, ``D = diag(sigma_min(M_hi)^2)`` and ``P_s = [P_1; ...; P_G]`` the group's
attention matrices stacked (``J_V J_V^T = P_s P_s^T (x) I_d``). When ``C = D + P_s P_s^T`` is
positive definite, ``J`` reaches every output direction and ``sigma_min(J)^2 >= lambda_min(C)``.
For ``wrt="weights"`` the tangents are ``X dW^T`` and ``J J^T >= sigma_min(X)^2 (...)`` (``X`` the
``B N x D`` stacked input, of full row rank only when ``B N <= D``); ``W_O`` multiplies the floor by
its smallest singular value when it has full rank.

Where no floor exists, :func:`sigma_min_floor` says why: ``wrt="input"`` (the three projections
share ``dX``, so the terms are not independent), causal attention with ``G > 1`` (the first query
of every head of a group sees only key 0: ``J`` has output directions no tangent reaches, so no
bound on the whole output space holds), a QK-norm on the queries (its Jacobian can be nearly
singular; the query term is left out and only the value term counts), ``B N > D``, or ``C``
singular to rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .autocast import autocast_disabled

__all__ = ["Floor", "MAX_FLOOR_FLOPS", "floor_flops", "sigma_min_floor"]

# Rounding allowance: each float64 factorization is taken to move its matrix by at most this many eps
# of its norm (Weyl), as for the dense path.
_ROUNDING = 64


@dataclass(frozen=True)
class Floor:
    """``value``: a lower bound on the smallest nonzero singular value of ``J`` (None: no floor, ``reason``
    says why); ``terms``: which tangent terms it counts; ``ceiling``: an upper bound on it from the
    Rayleigh quotient of ``J J^T`` on the floor's weakest directions (None without a floor or with
    ``W_O``), before the products' rounding."""

    value: Optional[float]
    reason: str = ""
    terms: str = ""
    ceiling: Optional[float] = None


def _less(v: Tensor, top: Tensor, eps: float = torch.finfo(torch.float64).eps) -> Tensor:
    """``v`` lowered by the rounding allowance of a factorization of norm ``top`` (``eps``: of float64, or
    of the coarser precision the matrix was computed in), clamped at 0."""
    return (v - _ROUNDING * eps * top).clamp_min(0.0)


def _smallest(sv: Tensor, eps: float = torch.finfo(torch.float64).eps) -> Tensor:
    """Lower bound on the smallest singular value from ``svdvals`` output ``[..., r]`` (descending)."""
    return _less(sv[..., -1], sv[..., 0], eps)


def _group(op, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """For one sequence and key/value group (``q`` ``[G, N, d]``, ``k``, ``v`` ``[N, d]``, float64): ``P_s``
    ``[G N, N]`` and ``sigma_min(M_hi)^2`` lowered by rounding, ``[G N]`` (zeros with a QK-norm on the
    queries, whose term is then left out)."""
    N, d = op.N, op.d
    s = op.scale * (q @ k.T)
    tau = None
    if op.softcap is not None:
        th = torch.tanh(s / op.softcap)
        s, tau = th * op.softcap, 1 - th * th
    allowed = op.allowed_keys(0, N)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    P = torch.softmax(s, dim=-1)
    if op.q_norm is not None:
        return P.reshape(-1, N), torch.zeros(P.shape[0] * N, dtype=P.dtype, device=P.device)
    w = P if tau is None else P * tau
    vk = (v.unsqueeze(-1) * k.unsqueeze(-2)).reshape(N, d * d)        # v_j k_j^T
    o = P @ v                                                           # the output rows
    M = (w @ vk).reshape(-1, N, d, d) - o.unsqueeze(-1) * (w @ k).unsqueeze(-2)
    eps = torch.finfo(op.rounding_dtype).eps          # q, k, v are exact to the products' precision
    return P.reshape(-1, N), _smallest(torch.linalg.svdvals(op.scale * M), eps).reshape(-1) ** 2


def floor_flops(op) -> float:
    """The floor's approximate cost in flops: per query head two ``N x N x d^2`` products and ``N`` SVDs of
    ``d x d``, per key/value group one eigendecomposition of ``G N x G N``."""
    B, H, N, d = op.B, op.H, op.N, op.d
    return B * H * (2.0 * N * N * d * d + 10.0 * N * d ** 3) + B * op.Hkv * 4.0 * (op.G * N) ** 3


# The floor is not computed above this cost (about a second or two of float64 on two cores).
MAX_FLOOR_FLOPS = 2e11


def sigma_min_floor(op) -> Floor:
    """A certified lower bound on the smallest nonzero singular value of ``op`` (a
    :class:`~condinit.probe.JacobianOperator`), or None with the reason (module doc). Float64 from the
    operator's linearization point; computed once per operator."""
    cached = getattr(op, "_floor", None)
    if cached is None:
        with torch.no_grad(), autocast_disabled(op.device):
            cached = _floor(op)
        op._floor = cached
    return cached


def _floor(op) -> Floor:
    if op.wrt == "input":
        return Floor(None, "wrt='input': the projections share dX, so the query and value terms are not independent")
    if op.causal and op.G > 1:
        return Floor(None, f"causal with {op.G} query heads per key/value head: the first query of every head sees "
                           f"only key 0, so J has output directions no tangent reaches")
    f64 = torch.float64
    scale_in = 1.0
    if op.wrt == "weights":
        X = op.X.to(f64).reshape(op.B * op.N, op.D)
        if op.B * op.N > op.D:
            return Floor(None, f"wrt='weights' with B N = {op.B * op.N} > D = {op.D}: X X^T is singular")
        scale_in = float(_smallest(torch.linalg.svdvals(X)))
        if scale_in == 0.0:
            return Floor(None, "wrt='weights': X is rank-deficient to rounding")
    if floor_flops(op) > MAX_FLOOR_FLOPS:
        return Floor(None, f"not computed: about {floor_flops(op):.1e} flops, above {MAX_FLOOR_FLOPS:.0e}")
    q, k, v, _, _ = op._primal()
    if not all(bool(torch.isfinite(t).all()) for t in (q, k, v)):
        return Floor(None, "the linearization point is not finite")
    G = op.G
    terms = (f"value term only ({op.q_norm.name} on the queries)" if op.q_norm is not None
             else "query and value terms")
    lam, weakest = math.inf, None  # sqrt(lambda_min(C)), the smallest over the groups, and where
    for b in range(op.B):
        for g in range(op.Hkv):
            Ps, D = _group(op, q[b, g * G:(g + 1) * G].to(f64), k[b, g].to(f64), v[b, g].to(f64))
            if not bool(torch.isfinite(Ps).all()):
                return Floor(None, "the attention probabilities are not finite in float64")
            # C = F F^T with F = [P_s | D^(1/2)]: sigma_min(F) = sqrt(lambda_min(C)), to an absolute rounding
            # of eps ||F|| (an eigensolver on C would lose it below eps ||C||)
            F = torch.cat([Ps, torch.diag(D.sqrt())], dim=1)
            # P_s is float32-exact where a QK-norm computes in float32 (op.rounding_dtype): allowed for
            low = float(_smallest(torch.linalg.svdvals(F), torch.finfo(op.rounding_dtype).eps))
            if low < lam:
                lam, weakest = low, (b, g, F)
    if lam == 0.0:
        return Floor(None, f"D + P_s P_s^T is singular to rounding ({terms})")
    value = scale_in * lam
    if op._wo is not None:
        sw = torch.linalg.svdvals(op._wo.to(f64))
        low = float(_smallest(sw))
        if low == 0.0:
            return Floor(None, "W_O is rank-deficient to rounding")
        return Floor(value * low, terms=terms)
    return Floor(value, terms=terms, ceiling=_ceiling(op, *weakest))


def _ceiling(op, b: int, g: int, F: Tensor) -> float:
    """``sigma_min(J) <= sigma_min(J^T Y)`` for orthonormal ``Y`` (``J`` is onto: the floor is positive):
    ``Y = c (x) e_1 ... c (x) e_d`` on group ``g`` of sequence ``b``, ``c`` the left singular vector of
    ``F`` for its smallest singular value (the direction the floor finds weakest). One VJP launch of
    ``d`` probes on that group's block."""
    G, N, d = op.G, op.N, op.d
    c = torch.linalg.svd(F, full_matrices=False)[0][:, -1].reshape(G, N)
    blk, h0 = (op.kv_blocks()[g], 0) if op.kv_blocks_exact is None else (op, g * G)
    Y = torch.zeros(blk.B, blk.H, N, d, d, dtype=torch.float64, device=c.device)
    for e in range(d):
        Y[b, h0:h0 + G, :, e, e] = c
    Z = blk.rmatmat(Y.reshape(-1, d).to(op.device, op.dtype))
    return float(torch.linalg.svdvals(Z.to(torch.float64))[-1])
