"""Estimators of one norm of ``J`` each: sigma_max by power iteration on ``J^T J`` and ``||J||_F`` by
Hutchinson's estimator with Rademacher probes through the multi-probe JVP."""
from __future__ import annotations

import math
from typing import Sequence, Union

import torch

from condinit._validate import check_int, check_real, check_seed

from .krylov import _generator, _randn
from .operator import JacobianOperator
from .results import FrobeniusEstimate, SpectrumEstimate, _check_operators, _many, _nonfinite_estimate, \
    _operator_notes, _overflow

# ------------------------------------------------------------------------------------------------
# power iteration

def _power_one(op: JacobianOperator, *, iters: int, seed: int, tol: float):
    reason = _overflow(op)
    if reason is not None:
        return _nonfinite_estimate(op, "power", reason, iterations=0, seed=seed, subspace="n/a (sigma_max only)",
                                   sigma_min=False)
    gen = _generator(op, seed)
    v = _randn(op, op.n, gen)
    v = v / torch.linalg.vector_norm(v)
    sigma, res, it = 0.0, math.inf, 0
    for it in range(1, iters + 1):
        u = op.mv(v)
        sigma = float(torch.linalg.vector_norm(u))
        if not math.isfinite(sigma):
            return _nonfinite_estimate(op, "power", f"J v is not finite in {op.dtype} at iteration {it} (overflow)",
                                       iterations=it, seed=seed, subspace="n/a (sigma_max only)", sigma_min=False)
        if sigma == 0.0:
            res = 0.0
            break
        w = op.rmv(u)                                  # J^T J v
        if not bool(torch.isfinite(w).all()):
            return _nonfinite_estimate(op, "power", f"J^T J v is not finite in {op.dtype} at iteration {it} "
                                       f"(overflow)", iterations=it, seed=seed, subspace="n/a (sigma_max only)",
                                       sigma_min=False)
        # relative residual of the eigenpair (sigma^2, v) of J^T J
        res = float(torch.linalg.vector_norm(w - sigma ** 2 * v)) / sigma ** 2
        v = w / torch.linalg.vector_norm(w)
        if res <= tol:
            break
    return SpectrumEstimate(
        method="power", sigma_max=sigma, sigma_min=None, kappa=None, iterations=it, residual_max=res,
        residual_min=None, converged=res <= tol, rank_deficient=False, subspace="n/a (sigma_max only)",
        null_dims=tuple(op.null_dims), shape=tuple(op.shape), seed=seed, wrt=op.wrt,
        notes="; ".join(["power iteration on J^T J; sigma_max from below, error ~ residual^2"] + _operator_notes(op)))


def power_sigma_max(op: Union[JacobianOperator, Sequence[JacobianOperator]], iters: int = 50, seed: int = 0, *,
                    tol: float = 1e-6):
    """sigma_max by power iteration on ``J^T J`` (one JVP + one VJP per iteration), stopping when the
    relative eigen-residual ``||J^T J v - s^2 v|| / s^2`` is below ``tol``. Returns a
    :class:`SpectrumEstimate` (a list for a sequence of operators) with ``sigma_min`` None.

    Examples:
        >>> layer = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        >>> op = condinit.JacobianOperator(layer, torch.randn(1, 12, 16))
        >>> condinit.power_sigma_max(op, iters=100, seed=0).sigma_max
    """
    ops = _check_operators(op)
    check_int("iters", iters, min=1)
    check_seed("seed", seed)
    tol = check_real("tol", tol, min=0.0)
    return _many(op, ops, _power_one, iters=iters, seed=seed, tol=tol)


# ------------------------------------------------------------------------------------------------
# Hutchinson

def _t_quantile(p: float, dof: int) -> float:
    try:
        from scipy.special import stdtrit   # much lighter to import than scipy.stats
        return float(stdtrit(dof, p))
    except ImportError:          # normal approximation
        from statistics import NormalDist
        return NormalDist().inv_cdf(p)


def _hutch_one(op: JacobianOperator, *, samples: int, seed: int, probes_per_launch: int, confidence: float):
    reason = _overflow(op)
    if reason is not None:
        nan = math.nan
        return FrobeniusEstimate(method="hutchinson-rademacher", frobenius=nan, ci_low=nan, ci_high=nan,
                                 confidence=confidence, samples=0, std_err=nan, probes_per_launch=probes_per_launch,
                                 shape=tuple(op.shape), seed=seed, wrt=op.wrt, notes=f"not estimated: {reason}")
    gen = _generator(op, seed)
    vals = []
    done = 0
    # wide weight Jacobians: ||J||_F^2 = E ||J^T z||^2 over output-side z, and ||J^T z||^2 = <G, K G> in
    # projection-output coordinates (one VJP launch and one K G product, no X dW^T per probe)
    adjoint = getattr(op, "projection_coordinates", False) and op.m < op.n
    while done < samples:
        p = min(probes_per_launch, samples - done)
        z = torch.randint(0, 2, (p, op.m if adjoint else op.n), generator=gen, dtype=torch.int8)
        z = z.to(op.device, op.dtype) * 2 - 1
        if adjoint:
            with torch.no_grad():
                G = torch.cat(op._cotangents(z), dim=-1).reshape(p, op.B * op.N, -1)
                sq = (G * (op._gram() @ G)).sum(dim=(1, 2))
        else:
            sq = op._matmat_rows(z).to(torch.float64).pow(2).sum(dim=1)   # one multi-probe JVP launch
        vals.append(sq.to(torch.float64).cpu())
        done += p
    x = torch.cat(vals)
    if not bool(torch.isfinite(x).all()):
        nan = math.nan
        return FrobeniusEstimate(method="hutchinson-rademacher", frobenius=nan, ci_low=nan, ci_high=nan,
                                 confidence=confidence, samples=samples, std_err=nan,
                                 probes_per_launch=probes_per_launch, shape=tuple(op.shape), seed=seed, wrt=op.wrt,
                                 notes=f"not estimated: ||J z||^2 is not finite in {op.dtype} (overflow)")
    mean = float(x.mean())
    se = float(x.std(unbiased=True)) / math.sqrt(samples) if samples > 1 else math.inf
    q = _t_quantile(0.5 + confidence / 2, samples - 1) if samples > 1 else math.inf
    lo, hi = max(mean - q * se, 0.0), mean + q * se
    return FrobeniusEstimate(method="hutchinson-rademacher", frobenius=math.sqrt(mean), ci_low=math.sqrt(lo),
                             ci_high=math.sqrt(hi), confidence=confidence, samples=samples, std_err=se,
                             probes_per_launch=probes_per_launch, shape=tuple(op.shape), seed=seed, wrt=op.wrt,
                             notes="output-side probes: ||J^T z||^2 (one flash VJP launch)" if adjoint else "")


def frobenius_hutchinson(op: Union[JacobianOperator, Sequence[JacobianOperator]], samples: int = 32, seed: int = 0,
                         *, probes_per_launch: int = 8, confidence: float = 0.95):
    """``||J||_F^2 = E ||J z||^2`` over Rademacher ``z``, ``samples`` probes sent ``probes_per_launch``
    at a time through one multi-probe JVP; the interval is a Student t interval on the mean of
    ``||J z||^2`` at ``confidence`` (in ``(0, 1)``), square-rooted. For a wide weight Jacobian
    (``wrt="weights"``, ``m < n``, ``B N < 2 D``) the probes are on the output side instead,
    ``||J||_F^2 = E ||J^T z||^2``, through one flash VJP launch (``notes`` says so). Returns a
    :class:`FrobeniusEstimate` (a list for a sequence of operators).

    Examples:
        >>> layer = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        >>> op = condinit.JacobianOperator(layer, torch.randn(1, 12, 16))
        >>> fro = condinit.frobenius_hutchinson(op, samples=32, seed=0)
        >>> fro.frobenius, (fro.ci_low, fro.ci_high)
    """
    ops = _check_operators(op)
    check_int("samples", samples, min=2)
    check_int("probes_per_launch", probes_per_launch, min=1)
    check_seed("seed", seed)
    confidence = check_real("confidence", confidence, min=0.0, min_open=True, max=1.0)
    if confidence == 1.0:   # a 100 % interval is unbounded
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return _many(op, ops, _hutch_one, samples=samples, seed=seed, probes_per_launch=probes_per_launch,
                 confidence=confidence)
