"""The exact path of the estimators: ``J`` assembled from one product per basis vector of its shorter
side, its singular values in float64, bracketed by rounding; and when ``dense="auto"`` takes it."""
from __future__ import annotations

import math
import time
from typing import Optional

import torch
from torch import Tensor

from .brackets import _TOL
from .krylov import _FLOOR, _Effective
from .operator import JacobianOperator
from .results import (SpectrumEstimate, _nonfinite_estimate, _operator_notes, _overflow, _vanished_estimate,
                      _zero_estimate, default_rank_rtol)

_DENSE_FLOPS = 2e11   # dense="auto": the dense SVD at most this many flops (about 10 s on one CPU core) ...
_DENSE_ENTRIES = 1 << 24   # ... and its matrix at most this many entries (128 MB of float64)
_BRACKET_DENSE = ("exact: dense SVD in float64 of J assembled from {q} products in {dtype}; each singular value "
                  "within 64 eps ||J|| + 64 eps_64 ||J|| (assuming the products' rounding moves J by at most 64 eps "
                  "||J|| in norm: Weyl); the nonzero ones are those above 64 eps s_1 ({rank} of them)")


def _dense_shape(eff: "_Effective") -> tuple:
    """``(q, p)``: the dense matrix with ``J``'s singular values that the dense path builds, one row per
    basis vector of ``A``'s input side ``E`` (``q`` of them): rows of ``J`` (``A = J^T``; in
    projection-output coordinates ``K^{1/2} G``, ``p = B N rows``) or columns of ``J`` (``A = J``)."""
    op = eff.op
    if eff.coords:
        return eff.size_in, op.B * op.N * sum(s[0] for s in op._in_shapes)
    return eff.size_in, (op.n if eff.transposed else op.m)


def _product_flops(op: JacobianOperator) -> float:
    """A rough count of one product ``J v`` or ``J^T u``: the attention JVP / VJP (a few attention
    passes) plus the projections' ``X dW^T`` / ``G^T X`` for ``wrt="weights"``."""
    att = 24.0 * op.B * op.H * op.N * op.N * op.d
    rows = sum(s[0] for s in op._in_shapes) if op.wrt != "qkv" else 0
    return att + 4.0 * op.B * op.N * (op.D or 0) * rows


def _dense_plan(eff: "_Effective", steps: Optional[int] = None) -> Optional[str]:
    """Why ``dense="auto"`` takes the dense path here, or None when it does not: the dense SVD (``q``
    products and ``4 p q^2`` flops) is cheaper than the ``r`` Lanczos steps that exactness would take
    (``2 r`` products and ``2 r^2 (q + p)`` flops of reorthogonalization), at most ``_DENSE_FLOPS``
    flops and ``_DENSE_ENTRIES`` entries."""
    q, p = _dense_shape(eff)
    lo, hi = min(p, q), max(p, q)
    svd = 4.0 * hi * lo * lo
    if q * p > _DENSE_ENTRIES or svd > _DENSE_FLOPS:
        return None
    prod = _product_flops(eff.op)
    dense = q * prod + svd
    side = 2 * p if eff.coords else p
    k = eff.r if steps is None else min(steps, eff.r)      # a step budget the caller set bounds the work
    lanczos = 2.0 * k * prod + 2.0 * k ** 2 * (q + side)
    if dense > lanczos:
        return None
    return (f"dense SVD chosen (dense='auto'): the dense J ({q} x {p}) costs about {dense / 1e9:.3g} GFLOP, the "
            f"{k} Lanczos steps " + ("exactness would take" if k == eff.r else "of the step budget") +
            f" about {lanczos / 1e9:.3g} GFLOP")


def dense_preferred(op: JacobianOperator, steps: Optional[int] = None, blocks: bool = True) -> bool:
    """Whether ``dense="auto"`` (:func:`lanczos_svd`, :func:`condition_number`) takes the dense path for
    ``op`` (with ``blocks``, for each of its key/value blocks, ``steps`` shared among them): its dense
    SVD is cheaper than the Lanczos run to exactness and small (at most about 2e11 flops and 2**24
    entries), and its attention output is finite in its dtype. Such an operator is best built in
    float64 (its bracket is then the rounding of float64)."""
    n_parts = op.Hkv if blocks and op.kv_blocks_exact is None else 1
    if _least_entries(op, n_parts) > _DENSE_ENTRIES:
        return False            # decided from the shapes, before any block or known null is set up
    parts = op.kv_blocks() if blocks else [op]
    share = None if steps is None else max(1, steps // len(parts))
    effs = [_Effective(p) for p in parts]
    return all(e.r > 0 and _dense_plan(e, share) is not None for e in effs) and _overflow(op) is None


def _least_entries(op: JacobianOperator, n_parts: int) -> int:
    """A lower bound on the entries of the dense matrix :func:`_dense_shape` gives for each of ``n_parts``
    equal key/value blocks of ``op``: ``m`` times the shorter of ``n`` and, for ``wrt="weights"``, the
    projection-output coordinates' ``B N rows``, whichever side the run orients."""
    m, n = op.m // n_parts, op.n // n_parts
    side = n
    if op.wrt == "weights":
        side = min(n, op.B * op.N * sum(s[0] for s in op._in_shapes) // n_parts)
    return m * side


def _dense_matrix(eff: "_Effective") -> Tensor:
    """The ``[q, p]`` float64 matrix of :func:`_dense_shape` (``M M^T = A^T A``, so its singular values
    are ``J``'s), ``q`` products sent in blocks of probes."""
    op = eff.op
    q, p = _dense_shape(eff)
    M = torch.empty(q, p, dtype=torch.float64, device=op.device)
    root = None
    if eff.coords:       # <G_1, K G_2> = <K^{1/2} G_1, K^{1/2} G_2>
        # K^{1/2} = U S U^T from X = U S V^T: its values carry X's rounding (eps ||X||), where the square
        # roots of K's eigenvalues would carry sqrt(eps) ||X|| and turn a null of X (repeated tokens) into
        # spurious singular values of J about sqrt(eps) below its largest
        U, S, _ = torch.linalg.svd(op.X.reshape(-1, op.D).to(torch.float64), full_matrices=False)
        root = (U * S) @ U.t()
    chunk = max(1, min(q, 64, (1 << 22) // max(1, p)))
    for i in range(0, q, chunk):
        c = min(chunk, q - i)
        probes = torch.zeros(c, q, device=op.device, dtype=op.dtype)
        probes[:, i:i + c].diagonal().fill_(1)
        with torch.no_grad():
            if eff.coords:
                G = torch.cat(op._cotangents(probes), dim=-1).reshape(c, op.B * op.N, -1).to(torch.float64)
                M[i:i + c] = (root @ G).reshape(c, -1)
            elif eff.transposed:
                M[i:i + c] = op._rmatmat_rows(probes).to(torch.float64)
            else:
                M[i:i + c] = op._matmat_rows(probes).to(torch.float64)
    return M


def _dense_one(op: JacobianOperator, *, rank_rtol, tol: float = _TOL, why: Optional[str] = None):
    t0 = time.perf_counter()
    method = "dense-svd"
    eff = _Effective(op)
    if eff.r == 0:
        return _zero_estimate(op, eff, method, 0)
    q, p = _dense_shape(eff)
    if why is None and q * p > _DENSE_ENTRIES:
        raise ValueError(f"method='dense': the dense J of this operator is {q} x {p} = {q * p} entries, above "
                         f"{_DENSE_ENTRIES}; use method='lanczos' (or 'auto')")
    reason = _overflow(op)
    M = None
    if reason is None:
        M = _dense_matrix(eff)
        if not bool(torch.isfinite(M).all()):
            reason = (f"J is not finite in {op.dtype} (overflow in its products: they are not reliable here; "
                      f"attention scores too large?)")
    if reason is not None:
        return _nonfinite_estimate(op, method, reason, iterations=0, seed=0, subspace=eff.subspace())
    s = torch.linalg.svdvals(M.t() if M.shape[1] > M.shape[0] else M)
    del M
    eps = torch.finfo(op.rounding_dtype).eps
    s1 = float(s[0])
    rank = int((s > _FLOOR * eps * s1).sum())
    if rank == 0:
        return _vanished_estimate(op, eff, method, 0, what="the dense J is 0")
    smax, smin = s1, float(s[rank - 1])
    fl = _FLOOR * (eps + torch.finfo(torch.float64).eps) * s1
    rtol = default_rank_rtol(op.dtype) if rank_rtol is None else rank_rtol
    smin_lo, smin_hi = max(smin - fl, 0.0), smin + fl
    rank_def = smin <= rtol * smax
    kappa = None if rank_def else smax / smin
    klo = None if rank_def else (smax - fl) / smin_hi
    khi = None if rank_def else ((smax + fl) / smin_lo if smin_lo > 0 else math.inf)
    notes = [why] if why else []
    if rank_def:
        notes.append(f"sigma_min/sigma_max = {smin / smax:.1e} <= rank_rtol = {rtol:.0e}: J has a nonzero singular "
                     f"value this small (a genuine near-degeneracy, not a mask null); kappa not reported")
    elif khi > (1.0 + tol) * klo:
        notes.append(f"kappa's bracket [{klo:.4g}, {khi:.4g}] is the rounding of {op.rounding_dtype}" + (
            ": build the operator with dtype=torch.float64 for a tighter one" if op.dtype != torch.float64 else ""))
    return SpectrumEstimate(
        method=method, sigma_max=smax, sigma_min=smin, kappa=kappa, iterations=0,
        residual_max=0.0, residual_min=0.0, converged=bool(smin_hi <= rtol * (smax - fl) if rank_def else khi <= (1.0 + tol) * klo),
        rank_deficient=bool(rank_def), subspace=eff.subspace(),
        null_dims=tuple(op.null_dims), shape=tuple(op.shape), seed=0, wrt=op.wrt,
        notes="; ".join(notes + _operator_notes(op)),
        sigma_max_lo=smax - fl, sigma_max_hi=smax + fl, sigma_min_lo=smin_lo, sigma_min_hi=smin_hi,
        kappa_lo=klo, kappa_hi=khi, exact=True, tol=tol,
        bracket=_BRACKET_DENSE.format(q=q, dtype=op.dtype, rank=rank), wall_s=time.perf_counter() - t0)

