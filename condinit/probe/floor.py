"""A certified lower bound on the smallest nonzero singular value of J from the structure of attention
(docs/design.md, "The attention Jacobian", "A floor under sigma_min").

For one sequence and one key/value group (``G`` query heads ``h`` reading key/value head ``g``), the
output tangent of query row ``i`` of head ``h`` is

    dO_hi = s V^T Lambda(p_hi) diag(tau_hi) (K a_hi + b q_hi) + sum_j p_hij c_j

with ``a_hi`` the row's query tangent (after RoPE: a rotation, which leaves singular values alone),
``b``, ``c`` the key and value tangents, ``Lambda(p) = Diag(p) - p p^T`` the softmax Jacobian and ``tau``
the soft-cap's derivative (1 without one). Since ``1^T Lambda(p) = 0``, the query and key terms of a
row that attends a prefix ``0 .. c_i - 1`` of the keys (causal rows, the first rows of a left window,
every row without a mask) lie in ``S_i = span{v_j - v_0 : j < c_i}``, those of any other row in
``R^d``. Prefix sets are nested, so one orthonormal basis ``q_1 .. q_d`` (Gram-Schmidt on the value
differences in key order) has ``S_i`` inside ``span(q_1 .. q_{n_i})``. Written in that basis the
output splits into ``d`` pieces, and range(J) lies in ``R = (+)_m R_m``, ``R_m = span{e_hi : n_i >= m} +
range(P_s)`` with ``P_s = [P_1; ...; P_G]``. With ``M_hi = s V^T Lambda(p_hi) diag(tau_hi) K`` and
``sigma_hi = sigma_{n_i}(M_hi)`` on its subspace, leaving out the key term,

    J J^T >= J_Q J_Q^T + J_V J_V^T >= (+)_m C_m,     C_m = D_m + P_s P_s^T,
    D_m = diag_(h,i) [n_i >= m] sigma_hi^2

so ``sigma_min(J)^2 >= min_m lambda_min(C_m on R_m)`` over the nonzero spectrum: the bound holds on
range(J) whatever output directions no tangent reaches (causal grouped queries have many). A subspace
taken too large only lowers the bound, so rank decisions err that way. For ``wrt="weights"`` the
tangents are ``X dW^T`` and ``J J^T >= sigma_min(X)^2 (...)`` with the same range (``X``, the ``B N x
D`` stacked input, of full row rank only when ``B N <= D``); ``W_O`` multiplies the floor by its
smallest singular value when it has full rank.

Where no floor exists, :func:`sigma_min_floor` says why: ``wrt="input"`` (the three projections share
``dX``, so the terms are not independent), a QK-norm on the queries with ``G > 1`` (its Jacobian can be
nearly singular, so the query term is left out, and the value term alone does not reach all of
range(J)), ``B N > D``, or a bound that is 0 to rounding.
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
# Bisection steps for lambda_min of the pieces with rows below full rank (relative 1e-3 in sigma).
_BISECT = 12


@dataclass(frozen=True)
class Floor:
    """``value``: a lower bound on the smallest nonzero singular value of ``J`` (None: no floor, ``reason``
    says why); ``terms``: which tangent terms it counts; ``ceiling``: an upper bound on it from the
    Rayleigh quotient of ``J J^T`` on the floor's weakest directions, which lie in range(J) (None without
    a floor or with ``W_O``), before the products' rounding."""

    value: Optional[float]
    reason: str = ""
    terms: str = ""
    ceiling: Optional[float] = None


class _NoFloor(Exception):
    pass


def _less(v: Tensor, top, eps: float = torch.finfo(torch.float64).eps) -> Tensor:
    """``v`` lowered by the rounding allowance of a factorization of norm ``top`` (``eps``: of float64, or
    of the coarser precision the matrix was computed in), clamped at 0."""
    return (v - _ROUNDING * eps * top).clamp_min(0.0)


def _lowest(sv: Tensor, eps: float = torch.finfo(torch.float64).eps) -> Tensor:
    """Lower bound on the smallest singular value from ``svdvals`` output ``[..., r]`` (descending)."""
    return _less(sv[..., -1], sv[..., 0], eps)


def _chain(v: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The nested value subspaces: an orthonormal basis ``Q`` ``[d, d]`` of ``R^d`` and ``n`` ``[N + 1]``
    with ``span{v_j - v_0 : j < c}`` inside ``span(Q[:, :n[c]])`` (Gram-Schmidt in key order, twice). A
    difference within rounding of the values' norm is taken as a repeated value; any larger one adds a
    direction (a subspace too large only lowers the floor)."""
    N, d = v.shape
    diffs = v[1:] - v[:1]
    scale = float(diffs.norm(dim=1).max()) if N > 1 else 0.0
    basis, n = [], [0, 0]
    for j in range(N - 1):
        if len(basis) < d:
            r = diffs[j]
            for _ in range(2):
                if basis:
                    Qb = torch.stack(basis, 1)
                    r = r - Qb @ (Qb.T @ r)
            nr = float(r.norm())
            if nr > _ROUNDING * eps * scale:
                basis.append(r / nr)
        n.append(len(basis))
    # complete the basis (the directions no row's query term reaches come last)
    full = torch.linalg.qr(torch.cat([torch.stack(basis, 1) if basis else v.new_zeros(d, 0),
                                      torch.eye(d, dtype=v.dtype, device=v.device)], 1))[0]
    if basis:
        full[:, :len(basis)] = torch.stack(basis, 1)
    return full, torch.tensor(n[:N + 1], device=v.device)


def _rows(op, M: Tensor, v: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per row ``(h, i)``: ``n``, the dimension of a subspace that holds the row's query and key terms
    (``n_i`` of the chain for a row that attends a prefix of the keys, ``d`` for any other), and
    ``sigma = sigma_n(M_hi)`` on it, lowered by rounding (0 where ``n = 0`` or below rounding), both
    ``[G N]``; and the chain basis ``Q`` ``[d, d]``."""
    G, N, d = op.G, op.N, op.d
    Q, n_of = _chain(v, eps)
    allowed = op.allowed_keys(0, N)
    if allowed is None:
        n = n_of[N].repeat(N)
    else:
        count = allowed.sum(1)
        prefix = allowed.cumsum(1).gather(1, (count - 1).clamp_min(0).unsqueeze(1)).squeeze(1) == count
        n = torch.where(prefix, n_of[count], torch.full_like(count, d))
    QM = Q.T @ M                                                     # [G, N, d, d] in the chain basis
    sig = torch.zeros(G, N, dtype=M.dtype, device=M.device)
    for c in sorted(set(n.tolist()) - {0}):
        rows = n == c
        sv = torch.linalg.svdvals(QM[:, rows, :c, :])
        sig[:, rows] = _less(sv[..., c - 1], sv[..., 0], eps)
    return n.repeat(G), sig.reshape(-1), Q


def _smallest(A: Tensor, eps: float, what: str, on_range: bool = False) -> tuple[float, Tensor]:
    """``sigma_min`` of ``A`` (``on_range``: the smallest above rounding, for a bound on range(A)) lowered
    by rounding, and its left singular vector."""
    U, s, _ = torch.linalg.svd(A, full_matrices=False)
    i = int((s > _ROUNDING * eps * s[0]).sum()) - 1 if on_range else len(s) - 1
    low = float(_less(s[i], s[0], eps)) if i >= 0 else 0.0
    if low == 0.0:
        raise _NoFloor(f"{what} is singular to rounding")
    return low, U[:, i]


def _pieces(op, Ps: Tensor, n: Tensor, sig: Tensor, eps: float) -> tuple[float, Tensor, list]:
    """``min_m sqrt(lambda_min(C_m))`` on the ranges, lowered by rounding, with the weakest direction:
    ``c`` ``[G N]`` in range(C_m) and the pieces ``m`` (0-based) it is weakest for."""
    d = op.d
    top = int(n.max())
    found = []
    if top < d:                  # pieces no row's query term reaches: C = P_s P_s^T, range(P_s)
        low, c = _smallest(Ps, eps, "P_s on its range", on_range=True)
        found.append((low, c, list(range(top, d))))
    if top > 0:
        E = (n < top) | (sig == 0)   # rows below the top rank, or whose query term vanishes to rounding
        L = ~E
        F_L = torch.cat([Ps[L], torch.diag(sig[L])], 1)
        if not bool(E.any()):    # every row reaches S_top: one C = D + P_s P_s^T, positive definite
            low, c = _smallest(F_L, eps, "D + P_s P_s^T")
            found.append((low, c, list(range(top))))
        else:
            found.append(_below_top(Ps, n, sig, E, L, F_L, top, eps))
    low, c, ms = min(found, key=lambda f: f[0])
    return low, c, ms


def _below_top(Ps, n, sig, E, L, F_L, top: int, eps: float):
    """The pieces ``m < top`` where some rows (``E``) are below the top rank or have no query term:
    on all rows at once (:func:`_direct`) where ``E`` is at least half of them, else by bisection on the
    Schur complement of the other rows (:func:`_schur`); with one query head per group also the SVD
    floor of ``D + P P^T`` without the rows of ``E``, the higher one taken."""
    tries, why = [], None
    e, rows = int(E.sum()), len(n)   # the Schur complement pays where few rows are below the top rank
    cost = _pieces_flops(rows, e, top)
    try:
        if cost > MAX_FLOOR_FLOPS:   # more rows below full rank than the shapes foretold (windows)
            raise _NoFloor(f"not computed: {e} of {rows} rows below full rank, about {cost:.1e} flops")
        tries.append(_schur(Ps, n, sig, E, L, F_L, top, eps) if 2 * e < rows else _direct(Ps, n, sig, top, eps))
    except _NoFloor as err:
        why = err
    if Ps.shape[0] == Ps.shape[1]:
        # one query head per group: D + P P^T with the query term of the rows below top rank left
        # out is positive definite, and its floor (resolved to eps ||F|| by an SVD, where the
        # bisection resolves lambda to eps ||F||^2) holds for every piece m < top
        try:
            low, c = _smallest(torch.cat([Ps, torch.diag(torch.where(L, sig, torch.zeros_like(sig)))], 1),
                               eps, "D + P P^T")
            tries.append((low, c, list(range(top))))
        except _NoFloor:
            pass
    if not tries:
        raise why
    return max(tries, key=lambda f: f[0])


def _piece_sets(P: Tensor, n: Tensor, top: int, eps: float):
    """The distinct pieces over the rows ``P`` (their attention rows) with subspace dimensions ``n``:
    ``(ms, out, Pi)`` with ``ms`` the pieces ``m < top`` (0-based) that leave out the same rows ``out``
    (``n_i <= m``), and ``Pi`` the projector on the complement of ``R_m`` (``x`` on the rows left out
    with ``P_out^T x = 0``; a range too large only lowers the floor, so directions above rounding stay)."""
    sets = []
    for m in range(top):
        out = n <= m
        if sets and torch.equal(sets[-1][1], out):
            sets[-1][0].append(m)
            continue
        Pi = P.new_zeros(len(n), len(n))
        if bool(out.any()):
            Uz, sz, _ = torch.linalg.svd(P[out], full_matrices=False)
            Uz, idx = Uz[:, sz > _ROUNDING * eps * sz[0]], out.nonzero().squeeze(1)
            Pi[idx.unsqueeze(1), idx.unsqueeze(0)] = torch.eye(len(idx), dtype=P.dtype, device=P.device) - Uz @ Uz.T
        sets.append(([m], out, Pi))
    return sets


def _scales(Ps: Tensor, sig: Tensor) -> tuple[float, float, float]:
    """``||F_m||`` bounded above (``F_m F_m^T = C_m``), ``rho > ||C_m||`` and the rounding of the products
    forming ``C_m`` (``64 eps ||C_m||`` of float64)."""
    top2 = float(torch.linalg.matrix_norm(Ps, 2)) + float(sig.max())
    return top2, 2 * top2 ** 2, _ROUNDING * torch.finfo(Ps.dtype).eps * top2 ** 2


def _direct(Ps, n, sig, top, eps):
    """The pieces ``m < top`` on all rows at once, where most rows are below the top rank:
    ``lambda_min(C_m + rho Pi_m)`` by an eigensolver for every eighth piece, the first and the last; every
    other piece passes a Cholesky test at that minimum or gets its own eigensolve."""
    f64, dev = Ps.dtype, Ps.device
    top2, rho, delta = _scales(Ps, sig)
    C0, eye = Ps @ Ps.T, torch.eye(len(n), dtype=f64, device=dev)
    sets = _piece_sets(Ps, n, top, eps)

    def build(a: int) -> Tensor:
        _, out, Pi = sets[a]
        return C0 + torch.diag(torch.where(out, torch.zeros_like(sig), sig) ** 2) + rho * Pi

    lam = {a: float(torch.linalg.eigvalsh(build(a))[0]) for a in sorted({0, len(sets) - 1, *range(0, len(sets), 8)})}
    for a in range(len(sets)):
        bar = min(lam.values()) * (1 - 1e-6)
        if a not in lam and int(torch.linalg.cholesky_ex(build(a) - bar * eye).info) != 0:
            lam[a] = float(torch.linalg.eigvalsh(build(a))[0])
    bar = min(lam.values()) * (1 - 1e-6)
    a = min(lam, key=lam.get)
    low = math.sqrt(max(min(bar, lam[a]) - delta, 0.0)) - _ROUNDING * eps * top2
    if low <= 0.0:
        raise _NoFloor("D + P_s P_s^T is singular to rounding on its range")
    ms, out, Pi = sets[a]
    c = torch.linalg.eigh(build(a))[1][:, 0]
    c = c - Pi @ c                                # exactly in R_m: the complement projected out
    return low, c / c.norm(), ms


def _schur(Ps, n, sig, E, L, F_L, top, eps):
    """The pieces ``m < top`` where few rows (``E``) are below the top rank: the largest ``lambda`` with
    every ``C_m + rho Pi_m - lambda I`` positive definite (``Pi_m`` the projector on the complement of
    ``R_m``, which lies on the rows of ``E`` that piece ``m`` leaves out; ``rho > ||C_m||`` moves it above
    the eigenvalues on ``R_m``), by bisection on the Schur complement of the rows in ``L``, where ``C_LL =
    F_L F_L^T`` is positive definite and the same in every piece."""
    f64, dev = Ps.dtype, Ps.device
    PE, PL, nE, sE = Ps[E], Ps[L], n[E], sig[E]
    top2, rho, delta = _scales(Ps, sig)
    if bool(L.any()):
        mu, U = torch.linalg.eigh(F_L @ F_L.T)
        if float(mu[0]) <= 2 * delta:
            raise _NoFloor("D + P_s P_s^T is singular to rounding on the rows of full rank")
        Bt, start = (PE @ PL.T) @ U, float(mu[0]) - delta
    else:                                         # every row below the top rank: no Schur complement
        mu = U = Bt = None
        start = top2 ** 2
    A0 = PE @ PE.T
    pieces, Pis, Ts = [], [], []
    for ms, out, Pi in _piece_sets(PE, nE, top, eps):
        pieces.append((ms, out))
        Pis.append(Pi)
        Ts.append(A0 + torch.diag(torch.where(out, torch.zeros_like(sE), sE) ** 2) + rho * Pi)
    T0, eye = torch.stack(Ts), torch.eye(len(sE), dtype=f64, device=dev)

    def schur(lam: float) -> Tensor:
        T = T0 - (lam + delta) * eye
        return T if Bt is None else T - (Bt / (mu - lam)) @ Bt.T

    def ok(lam: float) -> bool:
        return bool((torch.linalg.cholesky_ex(schur(lam)).info == 0).all())

    lo = hi = start
    while not ok(lo):                             # step down to a passing lambda, then bisect (geometric)
        if lo <= 4 * delta:
            raise _NoFloor("D + P_s P_s^T is singular to rounding on its range")
        hi, lo = lo, max(lo * 1e-3, 4 * delta)
    if lo < hi:
        for _ in range(_BISECT):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    # the weakest piece (the first to fail just above the bound) and its direction in range(C_m)
    info = torch.linalg.cholesky_ex(schur(hi)).info
    a = int((info != 0).nonzero()[0]) if bool((info != 0).any()) else int(torch.argmin(
        torch.linalg.eigvalsh(schur(lo))[:, 0]))
    yE = torch.linalg.eigh(schur(lo)[a])[1][:, 0]
    c = torch.zeros(Ps.shape[0], dtype=f64, device=dev)
    c[E] = yE - Pis[a] @ yE
    if Bt is not None:
        c[L] = -(U / (mu - lo)) @ (Bt.T @ yE)
    sigma = math.sqrt(lo) - _ROUNDING * eps * top2
    if sigma <= 0.0:
        raise _NoFloor("D + P_s P_s^T is singular to rounding on its range")
    return sigma, c / c.norm(), pieces[a][0]


def _primal64(op) -> tuple[Tensor, Tensor, Tensor, float]:
    """``q``, ``k``, ``v`` (after RoPE) at the linearization point in float64, and the ``eps`` they are
    exact to. Recomputed in float64 from the operator's input and weights (exact copies of the layer's)
    where no QK-norm is in the way, so that a float32 operator's floor is that of the layer's exact
    Jacobian (the brackets allow for the products' rounding separately); else the operator's own, exact
    to the precision it computes in."""
    f64 = torch.float64
    if op.dtype == f64 or op._qkv_given is not None or op.q_norm is not None or op.k_norm is not None:
        q, k, v, _, _ = op._primal()
        return q.to(f64), k.to(f64), v.to(f64), torch.finfo(op.rounding_dtype).eps
    X = op.X.to(f64)
    q_lin, k_lin, v_lin = (op._lin(X, w.to(f64), None if b is None else b.to(f64)) for w, b in
                           ((op.Wq, op.bq), (op.Wk, op.bk), (op.Wv, op.bv)))
    # RoPE by the operator's own tables (exact in its dtype; the products promote to float64)
    q, k = op._qk_primal(q_lin, None, op.H), op._qk_primal(k_lin, None, op.Hkv)
    return q, k, op._heads(v_lin, op.Hkv), torch.finfo(f64).eps


def _group(op, q: Tensor, k: Tensor, v: Tensor, eps: float):
    """For one sequence and key/value group (``q`` ``[G, N, d]``, ``k``, ``v`` ``[N, d]``, float64, exact
    to ``eps``): the group's floor, its weakest direction ``c`` ``[G N]``, the chain basis and the pieces
    ``c`` is weakest for (module doc)."""
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
    if not bool(torch.isfinite(P).all()):
        raise _NoFloor("the attention probabilities are not finite in float64")
    Ps = P.reshape(-1, N)
    if op.q_norm is not None:       # the value term alone: onto only with one query head per group
        low, c = _smallest(Ps, eps, "P")
        return low, c, torch.eye(d, dtype=P.dtype, device=P.device), list(range(d))
    w = P if tau is None else P * tau
    vk = (v.unsqueeze(-1) * k.unsqueeze(-2)).reshape(N, d * d)        # v_j k_j^T
    o = P @ v                                                           # the output rows
    M = op.scale * ((w @ vk).reshape(-1, N, d, d) - o.unsqueeze(-1) * (w @ k).unsqueeze(-2))
    n, sig, Q = _rows(op, M, v, eps)
    low, c, ms = _pieces(op, Ps, n, sig, eps)
    return low, c, Q, ms


def floor_flops(op) -> float:
    """The floor's approximate cost in flops: per query head two ``N x N x d^2`` products and ``N`` SVDs of
    ``d x d``; per key/value group, where the rows below rank ``d`` (``G d`` of them under a causal mask)
    are at least half of the ``G N``, a Cholesky factorization of ``G N x G N`` per piece and an
    eigensolve for every eighth, else one eigendecomposition of ``G N x G N`` and the bisection's
    factorizations of the Schur complements (``G d x G d``, ``d`` pieces)."""
    B, H, N, d, G = op.B, op.H, op.N, op.d, op.G
    e = G * min(d, N) if (op.causal or op.window is not None) else 0
    return B * H * (2.0 * N * N * d * d + 10.0 * N * d ** 3) + B * op.Hkv * _pieces_flops(G * N, e, min(d, N))


def _pieces_flops(rows: int, e: int, pieces: int) -> float:
    """One group's pieces with ``e`` of its ``rows`` below the top rank: on all rows (:func:`_direct`) or
    by the Schur complement (:func:`_schur`), as :func:`_below_top` chooses."""
    if 2 * e >= rows:
        return (pieces / 3.0 + pieces / 2.0 + 8.0) * rows ** 3
    return 10.0 * rows ** 3 + (_BISECT + 8) * (2.0 * e * e * rows + pieces * e ** 3 / 3.0)


# The floor is not computed above this cost (a few seconds of float64 on two cores).
MAX_FLOOR_FLOPS = 1e12


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
    if op.q_norm is not None and op.G > 1:
        return Floor(None, f"{op.q_norm.name} on the queries with {op.G} query heads per key/value head: its "
                           f"Jacobian can be nearly singular, so the query term is left out, and the value term "
                           f"alone does not reach every output direction J reaches")
    f64 = torch.float64
    scale_in = 1.0
    if op.wrt == "weights":
        X = op.X.to(f64).reshape(op.B * op.N, op.D)
        if op.B * op.N > op.D:
            return Floor(None, f"wrt='weights' with B N = {op.B * op.N} > D = {op.D}: X X^T is singular")
        scale_in = float(_lowest(torch.linalg.svdvals(X)))
        if scale_in == 0.0:
            return Floor(None, "wrt='weights': X is rank-deficient to rounding")
    if floor_flops(op) > MAX_FLOOR_FLOPS:
        return Floor(None, f"not computed: about {floor_flops(op):.1e} flops, above {MAX_FLOOR_FLOPS:.0e}")
    q, k, v, eps = _primal64(op)
    if not all(bool(torch.isfinite(t).all()) for t in (q, k, v)):
        return Floor(None, "the linearization point is not finite")
    G = op.G
    terms = (f"value term only ({op.q_norm.name} on the queries)" if op.q_norm is not None
             else "query and value terms")
    lam, weakest = math.inf, None  # the smallest over the groups, and where
    for b in range(op.B):
        for g in range(op.Hkv):
            try:
                low, c, Q, ms = _group(op, q[b, g * G:(g + 1) * G], k[b, g], v[b, g], eps)
            except _NoFloor as e:
                return Floor(None, f"{e} ({terms})")
            if low < lam:
                lam, weakest = low, (b, g, c, Q, ms)
    value = scale_in * lam
    if op._wo is not None:
        sw = torch.linalg.svdvals(op._wo.to(f64))
        low = float(_lowest(sw))
        if low == 0.0:
            return Floor(None, "W_O is rank-deficient to rounding")
        return Floor(value * low, terms=terms)
    return Floor(value, terms=terms, ceiling=_ceiling(op, *weakest))


def _ceiling(op, b: int, g: int, c: Tensor, Q: Tensor, ms: list) -> float:
    """``sigma_min(J) <= sigma_min(J^T Y)`` over the nonzero spectrum for orthonormal ``Y`` in range(J):
    ``Y = c (x) q_m`` for the pieces ``m`` the floor finds weakest on group ``g`` of sequence ``b`` (``c``
    in range(C_m), ``q_m`` the chain basis' direction), one VJP launch of ``len(ms)`` probes on that
    group's block."""
    G, N, d = op.G, op.N, op.d
    c = c.reshape(G, N)
    blk, h0 = (op.kv_blocks()[g], 0) if op.kv_blocks_exact is None else (op, g * G)
    Y = torch.zeros(blk.B, blk.H, N, d, len(ms), dtype=torch.float64, device=c.device)
    for col, m in enumerate(ms):
        Y[b, h0:h0 + G, :, :, col] = c.unsqueeze(-1) * Q[:, m]
    Z = blk.rmatmat(Y.reshape(-1, len(ms)).to(op.device, op.dtype))
    return float(torch.linalg.svdvals(Z.to(torch.float64))[-1])
