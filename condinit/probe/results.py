"""The results of the spectrum estimators (:class:`SpectrumEstimate`, :class:`FrobeniusEstimate`), the
special results (``J = 0``, overflow, vanished products) and how the estimators take one or many operators."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from .autocast import autocast_disabled
from .operator import JacobianOperator

if TYPE_CHECKING:
    from .krylov import _Effective


def default_rank_rtol(dtype: torch.dtype) -> float:
    """A nonzero sigma_min / sigma_max below this counts as rank-deficient (a near-degeneracy the dtype
    resolves only roughly: the Krylov vectors carry null-space components of about ``eps kappa``)."""
    return 1e-10 if dtype == torch.float64 else 1e-5


@dataclass
class SpectrumEstimate:
    """Extreme singular values of one attention Jacobian, their brackets, and how they were obtained.

    ``sigma_min`` is the smallest *nonzero* singular value of ``J`` (``J`` on ``range(J^T)``,
    ``subspace``), whatever null directions the mask, window, padding, GQA or a short sequence
    create; ``kappa = sigma_max / sigma_min``, None when ``rank_deficient`` (``sigma_min <=
    rank_rtol sigma_max``) and for ``power`` (no sigma_min).
    ``sigma_max_lo <= sigma_max <= sigma_max_hi`` and likewise ``sigma_min_*``, ``kappa_*``: how each
    side is obtained and what it assumes is in ``bracket``. ``converged``: ``kappa_hi <= (1 + tol)
    kappa_lo`` (or, when rank-deficient, ``sigma_min_hi <= rank_rtol sigma_max_lo``). ``exact``: the
    Krylov space became invariant (it holds every distinct nonzero singular value; the brackets are
    then the products' rounding). ``wall_s``: seconds spent. ``J = 0`` gives ``sigma_max = sigma_min
    = 0``, ``rank_deficient``; values that overflow the operator's dtype give NaN sigmas and
    ``converged`` False; ``notes`` says why in both cases.
    ``sigma_min_floor``: the certified structural lower bound on sigma_min (:mod:`condinit.probe.floor`)
    that ``sigma_min_lo`` takes when it is the higher one; None where none exists (``bracket`` says why);
    ``sigma_min_ceiling`` the upper bound that comes with it (``sigma_min_hi`` takes it, plus rounding,
    when it is the lower one).
    Residuals are relative: ``||A^T u - sigma v|| / sigma`` for the Ritz pair of each value.
    """

    method: str
    sigma_max: float
    sigma_min: Optional[float]
    kappa: Optional[float]
    iterations: int
    residual_max: float
    residual_min: Optional[float]
    converged: bool
    rank_deficient: bool
    subspace: str
    null_dims: tuple
    shape: tuple
    seed: int
    wrt: str = ""
    notes: str = ""
    sigma_max_lo: Optional[float] = None
    sigma_max_hi: Optional[float] = None
    sigma_min_lo: Optional[float] = None
    sigma_min_hi: Optional[float] = None
    kappa_lo: Optional[float] = None
    kappa_hi: Optional[float] = None
    exact: bool = False
    tol: Optional[float] = None
    confidence: Optional[float] = None
    bracket: str = ""
    wall_s: float = 0.0
    sigma_min_floor: Optional[float] = None
    sigma_min_ceiling: Optional[float] = None

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self):
        if self.sigma_min is None or math.isnan(self.sigma_min):
            tail = ""
        elif self.rank_deficient:
            tail = f", sigma_min {self.sigma_min:.3e} (rank-deficient: below rank_rtol sigma_max)"
        else:
            tail = f", sigma_min {self.sigma_min:.4e}, kappa {self.kappa:.4e}"
            if self.kappa_lo is not None and self.kappa_hi is not None:
                tail += f" in [{self.kappa_lo:.4e}, {self.kappa_hi:.4e}]"
        return (f"{self.method}: sigma_max {self.sigma_max:.4e}{tail} ({self.iterations} it, residuals "
                f"{self.residual_max:.1e}" + (f"/{self.residual_min:.1e}" if self.residual_min is not None else "")
                + f", {'converged' if self.converged else 'not converged'})")


@dataclass
class FrobeniusEstimate:
    """Hutchinson estimate of ``||J||_F`` with a confidence interval (t interval on ``||J z||^2``).

    NaN values (with the reason in ``notes``) when ``J z`` overflows the operator's dtype.
    """

    method: str
    frobenius: float
    ci_low: float
    ci_high: float
    confidence: float
    samples: int
    std_err: float            # of the mean of ||J z||^2
    probes_per_launch: int
    shape: tuple
    seed: int
    wrt: str = ""
    notes: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self):
        return (f"{self.method}: ||J||_F {self.frobenius:.4e} in [{self.ci_low:.4e}, {self.ci_high:.4e}] "
                f"({self.confidence:.0%}, {self.samples} probes)")


# ------------------------------------------------------------------------------------------------
# helpers

def _check_operators(op) -> list:
    """``op`` as a list of operators (a single operator or a non-empty sequence of them)."""
    if isinstance(op, JacobianOperator):
        return [op]
    if isinstance(op, Sequence) and not isinstance(op, (str, bytes)):
        ops = list(op)
        if ops and all(isinstance(o, JacobianOperator) for o in ops):
            return ops
        raise TypeError("op must be a JacobianOperator or a non-empty sequence of them")
    raise TypeError(f"op must be a JacobianOperator or a sequence of them, got {type(op).__name__}")


def _many(op, ops: list, fn, **kw):
    """``fn`` on each operator (autocast off): one result for a single operator, a list for a sequence."""
    results = []
    for o in ops:
        with autocast_disabled(o.device):
            results.append(fn(o, **kw))
    return results[0] if isinstance(op, JacobianOperator) else results


def _overflow(op: JacobianOperator) -> Optional[str]:
    """Why the operator cannot be evaluated in its dtype (its attention output is not finite), or None."""
    _, _, _, out, lse = op._primal()
    if bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all()):
        return None
    return (f"the attention output at this input is not finite in {op.dtype} (the scores overflow: weights or "
            f"inputs too large for the dtype; try dtype=torch.float64)")


def _nonfinite_estimate(op: JacobianOperator, method: str, reason: str, *, iterations: int, seed: int,
                        subspace: str, sigma_min: bool = True) -> "SpectrumEstimate":
    nan = math.nan
    return SpectrumEstimate(
        method=method, sigma_max=nan, sigma_min=nan if sigma_min else None, kappa=None, iterations=iterations,
        residual_max=nan, residual_min=None, converged=False, rank_deficient=False, subspace=subspace,
        null_dims=tuple(op.null_dims), shape=tuple(op.shape), seed=seed, wrt=op.wrt,
        notes=f"not estimated: {reason}")


def _vanished_estimate(op: JacobianOperator, eff: "_Effective", method: str, seed: int,
                       what: str = "J^T J e = 0 for a random e") -> "SpectrumEstimate":
    """The products vanish (``J^T J e = 0`` for a random start ``e``, or the dense ``J`` is 0) although
    ``r > 0`` directions lie outside the known nulls.

    Exact arithmetic gives that only for ``J = 0``; in floating point it is what the products return
    when rounding cancels them (attention scores so large that ``|S'| |V|`` swamps the result, e.g.
    huge Q/K weights), so no spectrum is claimed: NaN values and the reason."""
    reason = (f"{what} although {eff.r} directions lie outside the known nulls: the products cancel to "
              f"rounding in {op.dtype} (attention scores too large?), so they are not reliable here")
    return _nonfinite_estimate(op, method, reason, iterations=0, seed=seed, subspace=eff.subspace())


def _zero_estimate(op: JacobianOperator, eff: "_Effective", method: str, seed: int) -> "SpectrumEstimate":
    """The exact result ``J = 0``: every direction is a known null (r = 0)."""
    side = "input" if eff.n_c == 0 else "output"
    why = f"every {side} direction is a known null direction (r = 0; e.g. x = 0 for wrt='weights')"
    return SpectrumEstimate(
        method=method, sigma_max=0.0, sigma_min=0.0, kappa=None, iterations=0, residual_max=0.0, residual_min=0.0,
        converged=True, rank_deficient=True, subspace=eff.subspace(), null_dims=tuple(op.null_dims),
        shape=tuple(op.shape), seed=seed, wrt=op.wrt,
        notes=f"J = 0 exactly: {why}, so sigma_max = sigma_min = 0 and kappa is not defined",
        sigma_max_lo=0.0, sigma_max_hi=0.0, sigma_min_lo=0.0, sigma_min_hi=0.0, exact=True, bracket="exact: J = 0")


def _operator_notes(op: JacobianOperator) -> list:
    """What an estimate's notes say about the operator: a plain-torch attention path, and what the
    module computes that the operator leaves out (the full account is in ``subspace``)."""
    out = []
    if getattr(op, "dense_path", False):
        out.append(f"attention, its JVP and VJP in plain torch ({op.dtype}, dense [B, H, N, N]): the fused kernels "
                   f"have no logit soft-capping")
    rounding = getattr(op, "rounding_dtype", op.dtype)
    if rounding != op.dtype:
        out.append(f"the QK-norm computes in {rounding} whatever its input: J is exact to {rounding} rounding, "
                   f"and the brackets allow for it")
    if getattr(op, "excluded", None):
        out.append("not modelled: " + "; ".join(op.excluded))
    return out


