"""One Golub-Kahan-Lanczos run on one operator, kept in range(J^T) / range(J), stopped when kappa's
bracket is within tol, at a step or time budget, or when the Krylov space is invariant."""
from __future__ import annotations

import math
import time
from typing import Optional

import torch

from .brackets import (_BRACKET_CEILING, _BRACKET_EXACT, _BRACKET_FLOOR, _BRACKET_KRYLOV, _BRACKET_NO_FLOOR, _bracket, _converged, _ritz,
                       _settled)
from .dense_svd import _dense_one, _dense_plan
from .floor import sigma_min_floor
from .krylov import _FLOOR, _Basis, _Effective, _generator, _norm
from .operator import JacobianOperator
from .results import (SpectrumEstimate, _nonfinite_estimate, _operator_notes, _overflow, _vanished_estimate,
                      _zero_estimate, default_rank_rtol)


def _lanczos_one(op: JacobianOperator, *, steps: int, seed: int, rank_rtol: Optional[float], tol: float,
                 time_budget: Optional[float], confidence: float, dense=False, steps_given=None):
    t0 = time.perf_counter()
    method = "golub-kahan-lanczos"
    eff = _Effective(op)
    if eff.r == 0:
        return _zero_estimate(op, eff, method, seed)
    if dense is True:
        return _dense_one(op, rank_rtol=rank_rtol, tol=tol)
    if dense == "auto":
        why = _dense_plan(eff, None if steps_given is None else steps)
        if why is not None:
            return _dense_one(op, rank_rtol=rank_rtol, tol=tol, why=why)
    reason = _overflow(op)
    if reason is not None:
        return _nonfinite_estimate(op, method, reason, iterations=0, seed=seed, subspace=eff.subspace())
    floor = sigma_min_floor(op)
    gen = _generator(op, seed)
    eps = torch.finfo(op.rounding_dtype).eps
    rtol = default_rank_rtol(op.dtype) if rank_rtol is None else rank_rtol
    # start in range(A^T): v_1 = A^T y_1 with y_1 Gaussian on F (scaled to ||v_1|| = 1)
    y = eff.random_out(gen)
    v = eff.adj(y)
    nrm = float(_norm(v))
    if not math.isfinite(nrm):
        return _nonfinite_estimate(op, method, f"J^T J e is not finite in {op.dtype} (overflow)", iterations=0,
                                   seed=seed, subspace=eff.subspace())
    if nrm == 0.0:
        return _vanished_estimate(op, eff, method, seed)
    v, y = v / nrm, y / nrm
    k_max = min(steps, eff.r)
    V, U = _Basis(k_max + 1), _Basis(k_max, gram=op.coord_gram if eff.coords else None)
    V.append(v)
    alphas, betas = [], []
    x_prev, beta, scale = None, 0.0, 0.0
    exhausted, stop, bracket, every, history = False, "steps", None, 1, []
    for it in range(1, k_max + 1):
        # A V_k = U_k B_k, A^T U_k = V_k B_k^T + beta_{k+1} v_{k+1} e_k^T, with x_k, y_k such that
        # A x_k = u_k and A^T y_k = v_k: each new vector is one fresh product A p / A^T z, so it lies in
        # range(A) / range(A^T) up to that product's rounding (docs/design.md: "Why the range is kept")
        p = v if x_prev is None else v - beta * x_prev
        u = U.reorth(eff.fwd(p))
        alpha = float(_norm(u))
        if not math.isfinite(alpha):
            return _nonfinite_estimate(op, method, f"J v is not finite in {op.dtype} at step {it} (overflow)",
                                       iterations=it, seed=seed, subspace=eff.subspace())
        scale = max(scale, alpha, beta)
        if alpha <= _FLOOR * eps * scale * max(1.0, float(_norm(p))):
            # A v_k lies in span(U_{k-1}) to rounding: v_k adds no direction of range(A^T) above the
            # rounding floor; B_{k-1} stands, bracketed as any Krylov space (its residuals need not be small:
            # in float32 the floor can lie above J's smallest nonzero singular values)
            stop = "noise"
            if it == 1:
                return _vanished_estimate(op, eff, method, seed)
            break
        u = u / alpha
        U.append(u)
        alphas.append(alpha)
        x = p / alpha
        z = u - alpha * y
        w = V.reorth(eff.adj(z))
        beta = float(_norm(w))
        if not math.isfinite(beta):
            return _nonfinite_estimate(op, method, f"J^T u is not finite in {op.dtype} at step {it} (overflow)",
                                       iterations=it, seed=seed, subspace=eff.subspace())
        betas.append(beta)
        scale = max(scale, beta)
        if beta <= _FLOOR * eps * scale * max(1.0, float(_norm(z))) or it == eff.r:
            exhausted, stop = True, "range"  # the Krylov space is invariant: all of range(A^T)
            break
        if it == k_max:
            break
        if it % every == 0:
            s, res = _ritz(alphas, betas)
            history.append((it, s[-1]))
            settled = _settled(history, tol)
            bracket = _bracket(s, res, it, False, eff.size_in, confidence, eps, floor.value, floor.ceiling, settled)
            if settled and _converged(bracket, tol, rtol):
                stop = "converged"
                break
            every = max(1, it // 16)
        if time_budget is not None and time.perf_counter() - t0 >= time_budget:
            stop = "time"
            break
        v, y, x_prev = w / beta, z / beta, x
        V.append(v)
    k = len(alphas)
    s, res = _ritz(alphas, betas)
    if not history or history[-1][0] != k:
        history.append((k, s[-1]))
    bracket = _bracket(s, res, k, exhausted, eff.size_in, confidence, eps, floor.value, floor.ceiling,
                       _settled(history, tol))
    exhausted = exhausted and not bracket["short"]     # ended short of J's weakest direction: not exact
    smax, smin = _inside(s[0], bracket["sigma_max"]), _inside(s[-1], bracket["sigma_min"])
    rank_def = smax == 0.0 or smin <= rtol * smax    # holds too where the bracket alone says so
    converged = _converged(bracket, tol, rtol)
    res_max = res[0] / smax if smax > 0 else 0.0
    res_min = res[-1] / smin if smin > 0 else math.inf
    notes = []
    if not converged:
        why = (f"the time budget ({time_budget:g} s) reached" if stop == "time" else
               f"the rounding floor of {op.dtype} reached" if stop == "noise" else
               f"the step budget ({steps} steps) reached")
        notes.append(f"not converged: kappa in [{bracket['kappa'][0]:.4g}, {bracket['kappa'][1]:.4g}] is wider "
                     f"than tol = {tol:g} after {k} steps ({why}); sigma_max >= {smax:.4g}, sigma_min <= "
                     f"{smin:.4g}" + ("" if smin == s[-1] else f" (the certified ceiling: the smallest Ritz value, "
                                      f"{s[-1]:.4g}, lies above it)") + "; " + (
                         "dtype=torch.float64 goes further" if stop == "noise" else "raise steps or time_budget"))
    if stop == "noise":
        notes.append(f"the Krylov space reached the rounding floor of {op.dtype} at step {k + 1}: J has no "
                     f"further direction above it that this dtype resolves" + (
                         "" if converged else "; dtype=torch.float64 resolves smaller singular values"))
    if rank_def and smax > 0:
        notes.append(f"sigma_min/sigma_max = {smin / smax:.1e} <= rank_rtol = {rtol:.0e}: J has a nonzero singular "
                     f"value this small on range(J^T) (a genuine near-degeneracy, not a mask null); kappa not "
                     f"reported")
    return SpectrumEstimate(
        method=method, sigma_max=smax, sigma_min=smin, kappa=None if rank_def else _inside(smax / smin, bracket["kappa"]),
        iterations=k, residual_max=res_max, residual_min=None if math.isinf(res_min) else res_min,
        converged=bool(converged), rank_deficient=bool(rank_def), subspace=eff.subspace(),
        null_dims=tuple(op.null_dims), shape=tuple(op.shape), seed=seed, wrt=op.wrt,
        notes="; ".join(notes + _operator_notes(op)),
        sigma_max_lo=bracket["sigma_max"][0], sigma_max_hi=bracket["sigma_max"][1],
        sigma_min_lo=bracket["sigma_min"][0], sigma_min_hi=bracket["sigma_min"][1],
        kappa_lo=None if rank_def else bracket["kappa"][0], kappa_hi=None if rank_def else bracket["kappa"][1],
        exact=exhausted, tol=tol, confidence=confidence,
        sigma_min_floor=floor.value, sigma_min_ceiling=floor.ceiling,
        bracket=(_BRACKET_EXACT if exhausted else _BRACKET_KRYLOV) + (
            _BRACKET_FLOOR.format(floor=floor.value, terms=floor.terms) if floor.value is not None
            else _BRACKET_NO_FLOOR.format(reason=floor.reason)) + (
            _BRACKET_CEILING.format(ceiling=floor.ceiling) if floor.ceiling is not None else ""),
        wall_s=time.perf_counter() - t0)



def _inside(value: float, bounds: tuple) -> float:
    """``value`` moved into its certified ``bounds`` (lo, hi): a Ritz value can lie outside them by the
    rounding the bounds allow for, and the smallest one above a certified ceiling on sigma_min (the
    Krylov space has not yet reached J's weakest directions), where the ceiling is the better estimate."""
    lo, hi = bounds
    return min(max(value, lo), hi)
