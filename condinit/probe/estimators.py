"""Spectrum estimators for attention Jacobians, matrix-free and seeded.

Derivations: ``docs/design.md``, "The attention Jacobian".

* :func:`lanczos_svd` -- Golub-Kahan-Lanczos bidiagonalization (one JVP and one VJP per step, full
  reorthogonalization): ``sigma_max`` and ``sigma_min`` together from the singular values of the
  bidiagonal, with residual bounds, without squaring kappa.
* :func:`condition_number` -- kappa from :func:`lanczos_svd` (or exactly from ``op.dense()``).
* :func:`power_sigma_max` -- power iteration on ``J^T J``, ``sigma_max`` only.
* :func:`frobenius_hutchinson` -- ``||J||_F`` from Rademacher probes through the multi-probe JVP,
  with a confidence interval.

Which ``sigma_min``. ``J`` (``m x n``) has exact null directions (:class:`~condinit.probe.JacobianOperator`
lists them: key shifts on the input side, unreachable outputs on the output side), so its smallest
singular value in the usual sense is 0. Every estimator here works on the *effective operator*
``A = P_out J P_in``, with ``P_in`` / ``P_out`` the orthogonal projectors onto the complements of the
known null directions (of dimensions ``n' = n - k_in`` and ``m' = m - k_out``), and reports
``sigma_min = sigma_r(A)``, ``r = min(m', n')``: the smallest singular value of ``J`` restricted to
that complement. When ``m' < n'`` (``J`` wide, the usual case for ``wrt="qkv"``) the
bidiagonalization runs on ``A^T`` so that ``sigma_r`` is its smallest singular value over its whole
(smaller) input space; when ``n' <= m'`` it runs on ``A``. The result's ``subspace`` field says this
in words. A ``sigma_min`` below ``rank_rtol * sigma_max`` is reported as ``rank_deficient`` (kappa
None) rather than as a noisy number or inf: the layer has a null direction beyond the known ones.

Degenerate data. When the complement is empty (``r = 0``: every input, or every output, direction
is a known null, e.g. ``x = 0`` for ``wrt="weights"``), ``J = 0`` exactly: the estimate is
``sigma_max = sigma_min = 0``, ``rank_deficient`` (kappa None), ``converged``, with the reason in
``notes``. The operator refuses non-finite data (:class:`~condinit.probe.operator.NonFiniteError`);
when finite data overflow the operator's dtype (the attention output, or ``J v`` / ``J^T u``, is
not finite: e.g. huge weights in float32) the estimators return NaN values, ``converged`` False,
and the reason in ``notes``, instead of failing inside an SVD. The estimators run with autocast
off (in the operator's dtype), also when called inside an autocast region.

Randomness comes from a private ``torch.Generator`` seeded with ``seed``: the user's RNG streams
are never touched, and results are deterministic given the seed. Each function takes one operator
or a sequence of them (layers are estimated one after another; the probes of one layer share launches).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from condinit._validate import check_choice, check_int, check_real, check_seed

from .autocast import autocast_disabled
from .operator import JacobianOperator

__all__ = ["SpectrumEstimate", "FrobeniusEstimate", "lanczos_svd", "power_sigma_max", "condition_number",
           "frobenius_hutchinson", "default_rank_rtol"]

_LANCZOS_TOL = 1e-2   # relative residual below which a Lanczos estimate counts as converged


def default_rank_rtol(dtype: torch.dtype) -> float:
    """sigma_min / sigma_max below this counts as rank-deficient (what the dtype can resolve)."""
    return 1e-10 if dtype == torch.float64 else 1e-5


@dataclass
class SpectrumEstimate:
    """Extreme singular values of one attention Jacobian and how they were obtained.

    ``sigma_min`` / ``kappa`` refer to ``J`` on the complement of its known null directions
    (``subspace``); ``kappa`` is None when ``rank_deficient`` and for ``power`` (no sigma_min).
    ``J = 0`` (an empty complement, e.g. ``x = 0``) gives ``sigma_max = sigma_min = 0``,
    ``rank_deficient``; values that overflow the operator's dtype give NaN sigmas and
    ``converged`` False; ``notes`` says why in both cases.
    Residuals are relative: ``||A^T u - sigma v|| / sigma`` for the Ritz pair of each value.
    Lanczos Ritz values bracket from inside: ``sigma_max`` is a lower bound and ``sigma_min`` an upper
    bound of the true values (so an unconverged ``kappa`` is a lower bound).
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

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self):
        if self.sigma_min is None or math.isnan(self.sigma_min):
            tail = ""
        elif self.rank_deficient:
            tail = f", sigma_min {self.sigma_min:.3e} (rank-deficient beyond the known nulls)"
        else:
            tail = f", sigma_min {self.sigma_min:.4e}, kappa {self.kappa:.4e}"
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


def _zero_estimate(op: JacobianOperator, eff: "_Effective", method: str, seed: int) -> "SpectrumEstimate":
    """The exact result when the complement is empty (r = 0): every direction is a known null, J = 0."""
    side = "input" if eff.n_c == 0 else "output"
    return SpectrumEstimate(
        method=method, sigma_max=0.0, sigma_min=0.0, kappa=None, iterations=0, residual_max=0.0, residual_min=0.0,
        converged=True, rank_deficient=True, subspace=eff.subspace(), null_dims=tuple(op.null_dims),
        shape=tuple(op.shape), seed=seed, wrt=op.wrt,
        notes=f"J = 0 exactly: every {side} direction is a known null direction (r = 0; e.g. x = 0 for "
              f"wrt='weights'), so sigma_max = sigma_min = 0 and kappa is not defined")


def _operator_notes(op: JacobianOperator) -> list:
    """What an estimate's notes say about the operator: a plain-torch attention path, and what the
    module computes that the operator leaves out (the full account is in ``subspace``)."""
    out = []
    if getattr(op, "dense_path", False):
        out.append(f"attention, its JVP and VJP in plain torch ({op.dtype}, dense [B, H, N, N]): the fused kernels "
                   f"have no logit soft-capping")
    if getattr(op, "excluded", None):
        out.append("not modelled: " + "; ".join(op.excluded))
    return out


def _generator(op: JacobianOperator, seed: int) -> torch.Generator:
    # CPU generator for portability (same stream on any device); tensors are moved afterwards
    return torch.Generator(device="cpu").manual_seed(seed)


def _randn(op, size, gen, lead=()):
    return torch.randn(*lead, size, generator=gen, dtype=torch.float64).to(op.device, op.dtype)


class _Effective:
    """``A = P_out J P_in`` oriented so that its input side is the smaller complement (see module doc)."""

    def __init__(self, op: JacobianOperator):
        kin, kout = op.null_dims
        self.op = op
        self.n_c, self.m_c = op.n - kin, op.m - kout
        self.transposed = self.m_c < self.n_c
        # Only the start vector is projected: every later vector is J v or J^T u, which lies in
        # range(J) / range(J^T), orthogonal to the known nulls (they are in null(J^T) / null(J)), so
        # P_out J P_in acts as J on the Krylov space; the projections would only remove rounding
        # (which J and J^T annihilate again) at the cost of a pass over the long vectors per step.
        if self.transposed:   # A^T: input R^m (projected start), output R^n
            self.mv, self.rmv = op.rmv, op.mv
            self.proj_in, self.size_in, self.size_out = op.project_output, op.m, op.n
        else:
            self.mv, self.rmv = op.mv, op.rmv
            self.proj_in, self.size_in, self.size_out = op.project_input, op.n, op.m
        self.r = min(self.n_c, self.m_c)

    def subspace(self) -> str:
        op = self.op
        side = ("J is wide on the complement (m' < n'): sigma_min = smallest singular value of J^T on the "
                "output-side complement" if self.transposed else
                "J is tall on the complement (n' <= m'): sigma_min = min ||J t|| over unit t in the input-side "
                "complement")
        return (f"sigma_min = sigma_r(P_out J P_in), r = min(m', n') = {self.r}, with n' = {self.n_c} (of "
                f"n = {op.n}) and m' = {self.m_c} (of m = {op.m}) the dimensions of the orthogonal complements "
                f"of the known null directions; {side}. Known nulls: {op.null_description} "
                f"Operator: {op.description}")


def _norm(w: Tensor) -> Tensor:
    """The norm of a vector, or of a coordinate pair ``[G; K G]`` (``sqrt(<G, K G>)``)."""
    if w.dim() == 2:
        return torch.dot(w[0], w[1]).clamp(min=0).sqrt()
    return torch.linalg.vector_norm(w)


class _Basis:
    """Orthonormal vectors in a preallocated ``[rows, size]`` buffer (no per-step re-stacking).

    A vector may also be a coordinate pair ``[2, size]`` = ``[G; K G]`` (the weights' long side in
    projection-output coordinates, see :meth:`JacobianOperator.coord_rmv`), orthonormal in the
    inner product ``<G_1, K G_2>``."""

    def __init__(self, rows: int, like: Tensor):
        self.M = like.new_empty(rows, *like.shape)
        self.k = 0

    def append(self, v: Tensor):
        self.M[self.k] = v
        self.k += 1

    def last(self) -> Tensor:
        return self.M[self.k - 1]

    def _remove(self, Q: Tensor, w: Tensor) -> Tensor:
        if w.dim() == 2:
            c = Q[:, 0] @ w[1]
            return w - torch.tensordot(c, Q, dims=1)
        return w - Q.t() @ (Q @ w)

    def reorth(self, w: Tensor) -> Tensor:
        """Full reorthogonalization; a second pass only when the first removed most of ``w``
        (Kahan / Parlett: twice is enough, once is when the norm drops by less than 1/sqrt(2))."""
        if self.k:
            Q = self.M[: self.k]
            before = _norm(w)
            w = self._remove(Q, w)
            if not bool(_norm(w) > 0.7071 * before):
                w = self._remove(Q, w)
        return w


# ------------------------------------------------------------------------------------------------
# Golub-Kahan-Lanczos

def _lanczos_one(op: JacobianOperator, *, steps: int, seed: int, rank_rtol: Optional[float], tol: float):
    method = "golub-kahan-lanczos"
    eff = _Effective(op)
    if eff.r == 0:
        return _zero_estimate(op, eff, method, seed)
    reason = _overflow(op)
    if reason is not None:
        return _nonfinite_estimate(op, method, reason, iterations=0, seed=seed, subspace=eff.subspace())
    gen = _generator(op, seed)
    eps = torch.finfo(op.dtype).eps
    v = eff.proj_in(_randn(op, eff.size_in, gen))
    v = v / torch.linalg.vector_norm(v)
    k_max = min(steps, eff.r)
    V, U, alphas, betas = _Basis(k_max + 1, v), None, [], []
    V.append(v)
    beta, u_prev = 0.0, None
    scale_est = 0.0
    # the long side (A^T's output, the weights) in projection-output coordinates when that is cheaper
    coords = eff.transposed and getattr(op, "projection_coordinates", False)
    for it in range(1, k_max + 1):
        # upper bidiagonal: A V_k = U_k B_k,  A^T U_k = V_k B_k^T + beta_k v_{k+1} e_k^T
        if coords:
            g = op.coord_rmv(V.last())
            u = torch.stack([g, op.coord_gram(g)])
        else:
            u = eff.mv(V.last())
        if U is None:
            U = _Basis(k_max, u)
        if u_prev is not None:
            u = u - beta * u_prev
        u = U.reorth(u)
        alpha = float(_norm(u))
        if not math.isfinite(alpha):
            return _nonfinite_estimate(op, method, f"J v is not finite in {op.dtype} at step {it} (overflow)",
                                       iterations=it, seed=seed, subspace=eff.subspace())
        scale_est = max(scale_est, alpha, beta)
        if alpha <= 100 * eps * max(scale_est, 1e-300):
            alphas.append(0.0)       # A v = 0 on the complement: B_k ends with a zero column
            betas.append(0.0)
            break
        u = u / alpha
        U.append(u)
        alphas.append(alpha)
        w = (op.coord_mv(u[1]) if coords else eff.rmv(u)) - alpha * V.last()
        w = V.reorth(w)
        beta = float(torch.linalg.vector_norm(w))
        if not math.isfinite(beta):
            return _nonfinite_estimate(op, method, f"J^T u is not finite in {op.dtype} at step {it} (overflow)",
                                       iterations=it, seed=seed, subspace=eff.subspace())
        betas.append(beta)
        scale_est = max(scale_est, beta)
        if beta <= 100 * eps * scale_est or it == k_max:
            break                    # invariant subspace found (exact Ritz values), or out of steps
        V.append(w / beta)
        u_prev = U.last()
    k = len(alphas)
    Bk = torch.zeros(k, k, dtype=torch.float64)
    Bk[range(k), range(k)] = torch.tensor(alphas, dtype=torch.float64)
    if k > 1:
        Bk[range(k - 1), range(1, k)] = torch.tensor(betas[:-1], dtype=torch.float64)
    P, s, _ = torch.linalg.svd(Bk)
    res = (abs(betas[-1]) * P[-1, :].abs()).tolist()     # ||A^T u_i - s_i v_i|| for each Ritz pair
    smax, smin = float(s[0]), float(s[-1])
    rtol = default_rank_rtol(op.dtype) if rank_rtol is None else rank_rtol
    res_max = res[0] / smax if smax > 0 else 0.0
    # sigma_min is only a Ritz value of the complement when the Krylov space is not yet all of it
    complete = k >= eff.r or betas[-1] <= 100 * eps * scale_est
    rank_def = smax == 0.0 or smin <= rtol * smax
    res_min = (res[-1] / smin) if smin > 0 else math.inf
    converged = res_max <= tol and (complete or rank_def or res_min <= tol)
    notes = []
    if not complete and res_min > tol:
        notes.append("sigma_min not converged: Ritz values approach sigma_min from above; raise steps")
    if smax == 0.0:
        notes.append("J vanishes on the Krylov space of the start vector (sigma_max = 0); kappa not reported")
    if rank_def and smax > 0:
        notes.append(f"sigma_min/sigma_max = {smin / smax:.1e} <= rank_rtol = {rtol:.0e}: J has null directions "
                     f"beyond the known ones (e.g. N <= head_dim, causal early rows under GQA); kappa not reported")
    return SpectrumEstimate(
        method=method, sigma_max=smax, sigma_min=smin, kappa=None if rank_def else smax / smin,
        iterations=k, residual_max=res_max, residual_min=None if math.isinf(res_min) else res_min,
        converged=bool(converged), rank_deficient=bool(rank_def), subspace=eff.subspace(),
        null_dims=tuple(op.null_dims), shape=tuple(op.shape), seed=seed, wrt=op.wrt,
        notes="; ".join(notes + _operator_notes(op)))


def lanczos_svd(op: Union[JacobianOperator, Sequence[JacobianOperator]], steps: int = 20, seed: int = 0, *,
                rank_rtol: Optional[float] = None, tol: float = _LANCZOS_TOL):
    """sigma_max and sigma_min (on the complement of the known nulls) by Golub-Kahan-Lanczos.

    ``steps`` bidiagonalization steps (each one JVP and one VJP; at most ``r``, where the Krylov
    space is the whole complement and the values are exact), full reorthogonalization in the
    operator's dtype, singular values of the ``k x k`` bidiagonal in float64. ``converged`` when the
    relative residuals are below ``tol`` (sigma_min converges more slowly than sigma_max).
    ``sigma_min <= rank_rtol * sigma_max`` is reported as rank-deficient (default
    :func:`default_rank_rtol` of the operator's dtype). ``seed`` (in ``[0, 2**64)``) seeds the
    private generator of the start vector. Returns a :class:`SpectrumEstimate` (a list for a
    sequence of operators).

    Examples:
        >>> layer = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        >>> op = condinit.JacobianOperator(layer, torch.randn(1, 12, 16))
        >>> est = condinit.lanczos_svd(op, steps=20, seed=0)
        >>> est.sigma_max, est.residual_max, est.converged   # sigma_max converges first, sigma_min later
        >>> est = condinit.lanczos_svd(op, steps=200, seed=0)   # steps >= r: exact
        >>> est.sigma_min, est.kappa, est.converged
    """
    ops = _check_operators(op)
    check_int("steps", steps, min=1)
    check_seed("seed", seed)
    rank_rtol = check_real("rank_rtol", rank_rtol, min=0.0, max=1.0, allow_none=True)
    tol = check_real("tol", tol, min=0.0)
    return _many(op, ops, _lanczos_one, steps=steps, seed=seed, rank_rtol=rank_rtol, tol=tol)


def condition_number(op: Union[JacobianOperator, Sequence[JacobianOperator]], steps: int = 20, seed: int = 0, *,
                     method: str = "lanczos", rank_rtol: Optional[float] = None):
    """kappa(J) = sigma_max / sigma_min on the complement of the known nulls (see the module doc).

    ``method="lanczos"``: :func:`lanczos_svd` (``steps``, ``seed``); ``"dense"``: exact, from
    ``op.dense()`` projected on the complements and ``torch.linalg.svdvals`` (tiny layers only;
    ``steps`` and ``seed`` unused). Returns a :class:`SpectrumEstimate` (a list for a sequence of
    operators); its ``kappa`` is None when ``J`` is rank-deficient beyond the known nulls.

    Examples:
        >>> layer = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        >>> op = condinit.JacobianOperator(layer, torch.randn(1, 12, 16))
        >>> condinit.condition_number(op, steps=200, seed=0).kappa       # Lanczos
        >>> condinit.condition_number(op, method="dense").kappa          # exact, tiny layers only
    """
    ops = _check_operators(op)
    check_int("steps", steps, min=1)
    check_seed("seed", seed)
    check_choice("method", method, ("lanczos", "dense"))
    rank_rtol = check_real("rank_rtol", rank_rtol, min=0.0, max=1.0, allow_none=True)
    if method == "dense":
        return _many(op, ops, _dense_one, rank_rtol=rank_rtol)
    return _many(op, ops, _lanczos_one, steps=steps, seed=seed, rank_rtol=rank_rtol, tol=_LANCZOS_TOL)


def _dense_one(op: JacobianOperator, *, rank_rtol):
    eff = _Effective(op)
    J = op.dense()
    if eff.r == 0:
        return _zero_estimate(op, eff, "dense-svd", 0)
    reason = _overflow(op)
    Jc = op.project_output(op.project_input(J).t()).t()
    if reason is None and not bool(torch.isfinite(Jc).all()):
        reason = f"J is not finite in {op.dtype} (overflow)"
    if reason is not None:
        return _nonfinite_estimate(op, "dense-svd", reason, iterations=0, seed=0, subspace=eff.subspace())
    s = torch.linalg.svdvals(Jc.to(torch.float64))
    smax, smin = float(s[0]), float(s[eff.r - 1]) if eff.r > 0 else 0.0
    rtol = default_rank_rtol(op.dtype) if rank_rtol is None else rank_rtol
    rank_def = smax == 0.0 or smin <= rtol * smax
    return SpectrumEstimate(
        method="dense-svd", sigma_max=smax, sigma_min=smin, kappa=None if rank_def else smax / smin, iterations=0,
        residual_max=0.0, residual_min=0.0, converged=True, rank_deficient=bool(rank_def), subspace=eff.subspace(),
        null_dims=tuple(op.null_dims), shape=tuple(op.shape), seed=0, wrt=op.wrt)


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
