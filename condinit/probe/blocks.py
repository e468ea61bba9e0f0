"""kappa of a Jacobian that is block diagonal over its key/value groups: one estimate per block
(:meth:`JacobianOperator.kv_blocks`), combined into certified brackets for the whole ``J``."""
from __future__ import annotations

import math
import time
from typing import Callable

from .krylov import _Effective
from .operator import JacobianOperator
from .results import SpectrumEstimate, _nonfinite_estimate, default_rank_rtol

_BRACKET_BLOCKS = (
    "J = diag(J_1, ..., J_{n}) over its {n} key/value groups (exact: each group's outputs read only its own "
    "variables), so its singular values are the union of the blocks': sigma_max in [max_g lo_g, max_g hi_g], "
    "sigma_min in [min_g lo_g, min_g hi_g] over the blocks with J_g != 0, kappa in [max lo / min hi, max hi / "
    "min lo]; each block's upper bound on sigma_max at confidence 1 - (1 - confidence) / {n}, so all {n} hold "
    "with probability >= confidence (union bound). Per block: {inner}")


def blocks_estimate(op: JacobianOperator, one: Callable, *, seed: int, confidence: float, tol: float,
                    rank_rtol, time_budget, steps: int, **kw) -> SpectrumEstimate:
    """``one(block, seed=..., confidence=..., tol=..., rank_rtol=..., time_budget=..., steps=..., **kw)``
    on each key/value block of ``op`` in turn, combined as :data:`_BRACKET_BLOCKS` says; ``one(op, ...)``
    itself when ``op`` has a single block. The step and time budgets are shared: each block gets what
    is left over the blocks left (a block's step costs about ``1 / Hkv`` of a step on ``J``)."""
    blocks = op.kv_blocks()
    if len(blocks) == 1:
        return one(op, seed=seed, confidence=confidence, tol=tol, rank_rtol=rank_rtol, time_budget=time_budget,
                   steps=steps, **kw)
    t0 = time.perf_counter()
    nb = len(blocks)
    conf = 1.0 - (1.0 - confidence) / nb
    ests = []
    for g, blk in enumerate(blocks):
        left = None if time_budget is None else max(time_budget - (time.perf_counter() - t0), 1e-3) / (nb - g)
        share = max(1, (steps - sum(e.iterations for e in ests)) // (nb - g))
        e = one(blk, seed=(seed + g) % 2 ** 64, confidence=conf, tol=tol, rank_rtol=rank_rtol, time_budget=left,
                steps=share, **kw)
        ests.append(e)
        if math.isnan(e.sigma_max) or (e.sigma_min is not None and math.isnan(e.sigma_min)):
            return _nonfinite_estimate(op, e.method, f"key/value group {g}: " + e.notes.removeprefix("not estimated: "),
                                       iterations=sum(x.iterations for x in ests), seed=seed,
                                       subspace=e.subspace)
    return _combine(op, ests, seed=seed, confidence=confidence, tol=tol, rank_rtol=rank_rtol,
                    wall=time.perf_counter() - t0)


def _combine(op: JacobianOperator, ests: list, *, seed: int, confidence: float, tol: float, rank_rtol,
             wall: float) -> SpectrumEstimate:
    nb = len(ests)
    live = [e for e in ests if e.sigma_max > 0]
    kin, kout = (sum(e.null_dims[i] for e in ests) for i in (0, 1))
    common = dict(null_dims=(kin, kout), shape=tuple(op.shape), seed=seed, wrt=op.wrt, tol=tol,
                  confidence=confidence, iterations=sum(e.iterations for e in ests), wall_s=wall)
    methods = sorted({e.method for e in ests})
    method = methods[0] if len(methods) == 1 else "+".join(methods)
    n_c = sum(e.shape[1] - e.null_dims[0] for e in ests)      # shape (m, n), null_dims (input, output)
    m_c = sum(e.shape[0] - e.null_dims[1] for e in ests)
    r_blocks = sum(min(e.shape[0] - e.null_dims[1], e.shape[1] - e.null_dims[0]) for e in ests)
    subspace = (f"J is block diagonal over its {nb} key/value groups; sigma_min is the smallest nonzero singular "
                f"value over the blocks. rank(J) <= sum of the blocks' r_g = {r_blocks} <= r = min(m', n') = "
                f"{min(m_c, n_c)}, with n' = {n_c} (of n = {op.n}) and m' = {m_c} (of m = {op.m}). Block 0: "
                + ests[0].subspace)
    if not live:          # every block is J_g = 0
        e = ests[0]
        return SpectrumEstimate(
            method=method, sigma_max=0.0, sigma_min=0.0, kappa=None, residual_max=0.0, residual_min=0.0,
            converged=True, rank_deficient=True, subspace=subspace, notes=e.notes, sigma_max_lo=0.0,
            sigma_max_hi=0.0, sigma_min_lo=0.0, sigma_min_hi=0.0, exact=True, bracket="exact: J = 0", **common)
    top = max(live, key=lambda e: e.sigma_max)
    bot = min(live, key=lambda e: e.sigma_min)
    smax, smin = top.sigma_max, bot.sigma_min
    smax_lo, smax_hi = max(e.sigma_max_lo for e in live), max(e.sigma_max_hi for e in live)
    smin_lo, smin_hi = min(e.sigma_min_lo for e in live), min(e.sigma_min_hi for e in live)
    rtol = default_rank_rtol(op.dtype) if rank_rtol is None else rank_rtol
    rank_def = smin <= rtol * smax
    klo = smax_lo / smin_hi if smin_hi > 0 else math.inf
    khi = smax_hi / smin_lo if smin_lo > 0 else math.inf
    converged = smin_hi <= rtol * smax_lo if rank_def else khi <= (1.0 + tol) * klo
    notes = []
    if not converged and not rank_def:
        notes.append(f"not converged: kappa in [{klo:.4g}, {khi:.4g}] is wider than tol = {tol:g} over the {nb} "
                     f"key/value blocks ({common['iterations']} steps in all); raise steps or time_budget")
    if rank_def:
        notes.append(f"sigma_min/sigma_max = {smin / smax:.1e} <= rank_rtol = {rtol:.0e}: J has a nonzero singular "
                     f"value this small (a genuine near-degeneracy, not a mask null); kappa not reported")
    for g, e in enumerate(ests):
        if e.notes:
            notes.append(f"block {g}: {e.notes}")
    return SpectrumEstimate(
        method=method, sigma_max=smax, sigma_min=smin, kappa=None if rank_def else smax / smin,
        residual_max=top.residual_max, residual_min=bot.residual_min, converged=bool(converged),
        rank_deficient=bool(rank_def), subspace=subspace, notes="; ".join(notes),
        sigma_max_lo=smax_lo, sigma_max_hi=smax_hi, sigma_min_lo=smin_lo, sigma_min_hi=smin_hi,
        kappa_lo=None if rank_def else klo, kappa_hi=None if rank_def else khi, exact=all(e.exact for e in ests),
        bracket=_BRACKET_BLOCKS.format(n=nb, inner=bot.bracket), **common)


def blocks_reach_exactness(op: JacobianOperator, steps: int) -> bool:
    """Whether ``steps`` Lanczos steps, shared among the key/value blocks of ``op``, take every block to
    exactness (each block's rank bound ``r_g``; they add up to at most the whole's ``r``)."""
    blocks = op.kv_blocks()
    return len(blocks) > 1 and sum(_Effective(b).r for b in blocks) <= steps
