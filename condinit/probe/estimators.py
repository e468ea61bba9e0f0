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
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from condinit._validate import check_choice, check_int, check_real, check_seed

from .autocast import autocast_disabled
from .operator import JacobianOperator

__all__ = ["SpectrumEstimate", "FrobeniusEstimate", "lanczos_svd", "power_sigma_max", "condition_number",
           "frobenius_hutchinson", "default_rank_rtol", "dense_preferred"]

_STEPS = 300          # default step budget of lanczos_svd / condition_number
_TOL = 0.1            # converged: kappa's bracket within 10 % (kappa_hi <= (1 + tol) kappa_lo)
_CONFIDENCE = 0.999   # sigma_max's upper bound holds with this probability over the random start
_FLOOR = 64           # a new Krylov vector of norm below _FLOOR * eps * ||A|| * ||p|| is rounding
_DENSE_FLOPS = 2e11   # dense="auto": the dense SVD at most this many flops (about 10 s on one CPU core) ...
_DENSE_ENTRIES = 1 << 24   # ... and its matrix at most this many entries (128 MB of float64)

_BRACKET_EXACT = ("exact: the Krylov space is invariant (it is range(J^T)), so the Ritz values are the nonzero "
                  "singular values; each within its residual / sqrt(2) (Bauer-Fike on [[0, J], [J^T, 0]]) and the "
                  "rounding f = 512 eps s_1 sqrt(k) of k steps (assumed at most that, as a norm)")
_BRACKET_DENSE = ("exact: dense SVD in float64 of J assembled from {q} products in {dtype}; each singular value "
                  "within 64 eps ||J|| + 64 eps_64 ||J|| (assuming the products' rounding moves J by at most 64 eps "
                  "||J|| in norm: Weyl); the nonzero ones are those above 64 eps s_1 ({rank} of them)")
_BRACKET_KRYLOV = (
    "sigma_max >= the largest Ritz value - f and sigma_min <= the smallest + f, f = 512 eps s_1 sqrt(k) the "
    "rounding of k steps (assumed at most that, as a norm; the Krylov space lies in range(J^T)); sigma_max <= "
    "(s_1 + f) / sqrt(1 - e) with probability >= confidence over the random start (Kuczynski-Wozniakowski); "
    "sigma_min >= max(s_k - eta_k, s_k - eta_k^2 / (s_{k-1} - eta_{k-1} - s_k)) - f assuming the two smallest "
    "Ritz values approximate the two smallest nonzero singular values (residual bound and Kato-Temple with that "
    "gap)")


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
    if getattr(op, "excluded", None):
        out.append("not modelled: " + "; ".join(op.excluded))
    return out


def _generator(op: JacobianOperator, seed: int) -> torch.Generator:
    # CPU generator for portability (same stream on any device); tensors are moved afterwards
    return torch.Generator(device="cpu").manual_seed(seed)


def _randn(op, size, gen, lead=()):
    return torch.randn(*lead, size, generator=gen, dtype=torch.float64).to(op.device, op.dtype)


class _Effective:
    """The operator ``A`` the bidiagonalization runs on: ``J``, or ``J^T`` when ``J`` is wide on the
    complement of its known nulls (``m' < n'``), so that ``A``'s input side ``E`` is the smaller one.

    ``fwd`` is ``A`` (``E -> F``), ``adj`` is ``A^T``. When ``A = J^T`` and the weights' side is
    cheaper in projection-output coordinates, vectors of ``F`` (the weights) are pairs ``[G; K G]``
    (:meth:`JacobianOperator.coord_rmv`). The known nulls only orient the run and bound its length
    (``rank(J) <= r = min(m', n')``): the Krylov space stays in ``range(A^T)`` by construction, so
    unknown nulls never enter it either."""

    def __init__(self, op: JacobianOperator):
        kin, kout = op.null_dims
        self.op = op
        self.n_c, self.m_c = op.n - kin, op.m - kout
        self.transposed = self.m_c < self.n_c
        self.coords = self.transposed and getattr(op, "projection_coordinates", False)
        if self.coords:
            self.fwd, self.adj = self._coord_fwd, lambda f: op.coord_mv(f[1])
        elif self.transposed:
            self.fwd, self.adj = op.rmv, op.mv
        else:
            self.fwd, self.adj = op.mv, op.rmv
        self.size_in = op.m if self.transposed else op.n
        self.r = min(self.n_c, self.m_c)

    def random_out(self, gen) -> Tensor:
        """A Gaussian vector of ``F`` (a pair ``[G; K G]`` with Gaussian ``G`` in coordinates)."""
        op = self.op
        if self.coords:
            g = _randn(op, op.B * op.N * sum(s[0] for s in op._in_shapes), gen)
            return torch.stack([g, op.coord_gram(g)])
        return _randn(op, op.n if self.transposed else op.m, gen)

    def _coord_fwd(self, e: Tensor) -> Tensor:
        g = self.op.coord_rmv(e)
        return torch.stack([g, self.op.coord_gram(g)])

    def subspace(self) -> str:
        op = self.op
        return (f"sigma_min = the smallest nonzero singular value of J (J on range(J^T)); the Krylov space is "
                f"kept in range(J^T) / range(J) by construction, so null directions of J (known or not: the "
                f"causal mask's early rows, windows, padding, GQA, N < head_dim) never enter it. rank(J) <= "
                f"r = min(m', n') = {self.r}, with n' = {self.n_c} (of n = {op.n}) and m' = {self.m_c} (of "
                f"m = {op.m}) the dimensions of the complements of the known null directions. Known nulls: "
                f"{op.null_description} Operator: {op.description}")


def _norm(w: Tensor) -> Tensor:
    """The norm of a vector, or of a coordinate pair ``[G; K G]`` (``sqrt(<G, K G>)``)."""
    if w.dim() == 2:
        return torch.dot(w[0], w[1]).clamp(min=0).sqrt()
    return torch.linalg.vector_norm(w)


class _Basis:
    """Orthonormal vectors in blocks that grow as needed (at most ``rows``; no per-step re-stacking).

    A vector may also be a coordinate pair ``[2, size]`` = ``[G; K G]`` (the weights' long side in
    projection-output coordinates, see :meth:`JacobianOperator.coord_rmv`), orthonormal in the
    inner product ``<G_1, K G_2>``."""

    def __init__(self, rows: int):
        self.rows, self.k = rows, 0
        self.blocks: list = []
        self._free = 0

    def append(self, v: Tensor):
        if self._free == 0:      # the next block as large as all before it (at least 8 rows)
            size = min(max(8, self.k), self.rows - self.k)
            self.blocks.append(v.new_empty(size, *v.shape))
            self._free = size
        blk = self.blocks[-1]
        blk[blk.shape[0] - self._free] = v
        self._free -= 1
        self.k += 1

    def _filled(self):
        for i, blk in enumerate(self.blocks):
            yield blk if i < len(self.blocks) - 1 else blk[: blk.shape[0] - self._free]

    def _remove(self, w: Tensor) -> Tensor:
        # classical Gram-Schmidt over all blocks: every coefficient from the same w
        if w.dim() == 2:
            cs = [(Q, Q[:, 0] @ w[1]) for Q in self._filled()]
            for Q, c in cs:
                w = w - torch.tensordot(c, Q, dims=1)
            return w
        cs = [(Q, Q @ w) for Q in self._filled()]
        for Q, c in cs:
            w = w - Q.t() @ c
        return w

    def reorth(self, w: Tensor) -> Tensor:
        """Full reorthogonalization; a second pass only when the first removed most of ``w``
        (Kahan / Parlett: twice is enough, once is when the norm drops by less than 1/sqrt(2))."""
        if self.k:
            before = _norm(w)
            w = self._remove(w)
            if not bool(_norm(w) > 0.7071 * before):
                w = self._remove(w)
        return w


# ------------------------------------------------------------------------------------------------
# Golub-Kahan-Lanczos on range(J^T) / range(J)

def _kw_epsilon(k: int, dim: int, confidence: float) -> float:
    """Kuczynski-Wozniakowski (1992, Thm 4.2a): after ``k`` Lanczos steps on a PSD ``M`` (dimension
    ``dim``) from a uniformly random start, ``P(theta < (1 - e) lambda_max) <= 1.648 sqrt(dim)
    exp(-sqrt(e) (2k - 1))``; the ``e`` at which that probability is ``1 - confidence``."""
    return (math.log(1.648 * math.sqrt(dim) / (1.0 - confidence)) / (2 * k - 1)) ** 2


def _bracket(s: list, res: list, k: int, exhausted: bool, dim: int, confidence: float, eps: float) -> dict:
    """Lower / upper bounds on sigma_max, sigma_min and kappa from the Ritz values ``s`` (descending)
    and residuals ``res`` (``||A^T u_i - s_i v_i||``) after ``k`` steps (docs/design.md, "The attention
    Jacobian", "Brackets")."""
    eta = [r / math.sqrt(2.0) for r in res]        # residual of the augmented [[0, A], [A^T, 0]]
    s1, sk = s[0], s[-1]
    # the rounding of k products and reorthogonalizations (assumed at most this, as a norm: it grows with
    # the steps, and a Ritz value can dip below the smallest nonzero singular value by that much)
    fl = 8 * _FLOOR * eps * s1 * math.sqrt(max(k, 1))
    if exhausted:        # the Krylov space is invariant: the Ritz values are the singular values, to rounding
        smax = (s1 - fl, s1 + eta[0] + fl)
        smin = (max(sk - eta[-1] - fl, 0.0), sk + fl)
    else:
        e = _kw_epsilon(k, dim, confidence)
        smax = (s1 - fl, (s1 + fl) / math.sqrt(1.0 - e) if e < 1.0 else math.inf)
        lo = sk - eta[-1]                          # a singular value lies within eta of s_k: sigma_min (assumed)
        if k >= 2:                                 # Kato-Temple with sigma_2 >= s_{k-1} - eta_{k-1} (assumed)
            gap = (s[-2] - eta[-2]) - sk
            if gap > 0:
                lo = max(lo, sk - eta[-1] ** 2 / gap)
        smin = (max(lo - fl, 0.0), sk + fl)
    kappa = (smax[0] / smin[1] if smin[1] > 0 else math.inf, smax[1] / smin[0] if smin[0] > 0 else math.inf)
    return {"sigma_max": smax, "sigma_min": smin, "kappa": kappa}


def _ritz(alphas: list, betas: list):
    """Singular values (descending) of the upper bidiagonal ``B_k`` and each Ritz pair's residual
    ``beta_{k+1} |P[k-1, i]|`` (``B_k = P S W^T``)."""
    k = len(alphas)
    Bk = torch.zeros(k, k, dtype=torch.float64)
    Bk[range(k), range(k)] = torch.tensor(alphas, dtype=torch.float64)
    if k > 1:
        Bk[range(k - 1), range(1, k)] = torch.tensor(betas[:k - 1], dtype=torch.float64)
    P, s, _ = torch.linalg.svd(Bk)
    beta = betas[k - 1] if len(betas) >= k else 0.0
    return s.tolist(), (abs(beta) * P[-1, :].abs()).tolist()


def _converged(b: dict, tol: float, rtol: float) -> bool:
    """The kappa bracket within ``tol`` (relative width), or sigma_min certainly below ``rtol sigma_max``."""
    (klo, khi), (smin_lo, smin_hi), (smax_lo, _) = b["kappa"], b["sigma_min"], b["sigma_max"]
    return khi <= (1.0 + tol) * klo or smin_hi <= rtol * smax_lo


def _settled(history: list, tol: float) -> bool:
    """The smallest Ritz value has moved by at most ``tol / 4`` (relative) over the last third of the
    steps (at least 8): a value found only lately may still be one a smaller singular value has not
    yet displaced, so it is not yet taken as sigma_min."""
    it, smin = history[-1]
    window = max(8, it // 3)
    earlier = [s for k, s in history if k <= it - window]
    return bool(earlier) and earlier[-1] - smin <= 0.25 * tol * smin


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
    gen = _generator(op, seed)
    eps = torch.finfo(op.dtype).eps
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
    V, U = _Basis(k_max + 1), _Basis(k_max)
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
            bracket = _bracket(s, res, it, False, eff.size_in, confidence, eps)
            history.append((it, s[-1]))
            if _converged(bracket, tol, rtol) and _settled(history, tol):
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
    bracket = _bracket(s, res, k, exhausted, eff.size_in, confidence, eps)
    smax, smin = s[0], s[-1]
    rank_def = smax == 0.0 or smin <= rtol * smax
    converged = _converged(bracket, tol, rtol)
    res_max = res[0] / smax if smax > 0 else 0.0
    res_min = res[-1] / smin if smin > 0 else math.inf
    notes = []
    if not converged:
        why = f"the time budget ({time_budget:g} s)" if stop == "time" else f"the step budget ({steps} steps)"
        notes.append(f"not converged: kappa in [{bracket['kappa'][0]:.4g}, {bracket['kappa'][1]:.4g}] is wider "
                     f"than tol = {tol:g} after {k} steps ({why} reached); the Ritz values are inside the "
                     f"spectrum (sigma_max >= {smax:.4g}, sigma_min <= {smin:.4g}); raise steps or time_budget")
    if stop == "noise":
        notes.append(f"the Krylov space reached the rounding floor of {op.dtype} at step {k + 1}: J has no "
                     f"further direction above it that this dtype resolves" + (
                         "" if converged else "; dtype=torch.float64 resolves smaller singular values"))
    if rank_def and smax > 0:
        notes.append(f"sigma_min/sigma_max = {smin / smax:.1e} <= rank_rtol = {rtol:.0e}: J has a nonzero singular "
                     f"value this small on range(J^T) (a genuine near-degeneracy, not a mask null); kappa not "
                     f"reported")
    return SpectrumEstimate(
        method=method, sigma_max=smax, sigma_min=smin, kappa=None if rank_def else smax / smin,
        iterations=k, residual_max=res_max, residual_min=None if math.isinf(res_min) else res_min,
        converged=bool(converged), rank_deficient=bool(rank_def), subspace=eff.subspace(),
        null_dims=tuple(op.null_dims), shape=tuple(op.shape), seed=seed, wrt=op.wrt,
        notes="; ".join(notes + _operator_notes(op)),
        sigma_max_lo=bracket["sigma_max"][0], sigma_max_hi=bracket["sigma_max"][1],
        sigma_min_lo=bracket["sigma_min"][0], sigma_min_hi=bracket["sigma_min"][1],
        kappa_lo=None if rank_def else bracket["kappa"][0], kappa_hi=None if rank_def else bracket["kappa"][1],
        exact=exhausted, tol=tol, confidence=confidence,
        bracket=_BRACKET_EXACT if exhausted else _BRACKET_KRYLOV, wall_s=time.perf_counter() - t0)


def _check_dense(dense):
    if dense not in (False, True, "auto") or not isinstance(dense, (bool, str)):
        raise ValueError(f"dense must be False, True or 'auto', got {dense!r}")
    return dense


def _check_budget(steps, tol, time_budget, confidence, rank_rtol):
    check_int("steps", steps, min=1, allow_none=True)
    given, steps = steps, _STEPS if steps is None else steps
    rank_rtol = check_real("rank_rtol", rank_rtol, min=0.0, max=1.0, allow_none=True)
    tol = check_real("tol", tol, min=0.0)
    time_budget = check_real("time_budget", time_budget, min=0.0, min_open=True, allow_none=True)
    confidence = check_real("confidence", confidence, min=0.0, min_open=True, max=1.0)
    if confidence == 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence} (a certain bound needs the whole range)")
    return dict(steps=steps, tol=tol, time_budget=time_budget, confidence=confidence, rank_rtol=rank_rtol,
                steps_given=given)


def lanczos_svd(op: Union[JacobianOperator, Sequence[JacobianOperator]], steps: Optional[int] = None, seed: int = 0, *,
                tol: float = _TOL, time_budget: Optional[float] = None, confidence: float = _CONFIDENCE,
                rank_rtol: Optional[float] = None, dense: Union[bool, str] = False):
    """sigma_max and the smallest nonzero sigma_min of ``J``, with brackets, by Golub-Kahan-Lanczos.

    The bidiagonalization starts from ``J^T J e`` (``e`` random) and forms each new vector as one fresh
    product ``J p`` or ``J^T z``, so the Krylov space lies in ``range(J^T)`` / ``range(J)`` and its Ritz
    values approximate the nonzero singular values only (full reorthogonalization in the operator's
    dtype, singular values of the ``k x k`` bidiagonal in float64). It stops as soon as kappa's
    bracket is within ``tol`` (``kappa_hi <= (1 + tol) kappa_lo``, checked every few steps), after
    ``steps`` steps (each one JVP and one VJP), after ``time_budget`` seconds (None: no limit), or
    when the Krylov space is all of ``range(J)`` (then the values are exact: ``exact``).
    The brackets (``sigma_max_lo`` ... ``kappa_hi``; ``bracket`` says how): ``sigma_max_hi`` holds
    with probability ``confidence`` over the random start, ``sigma_min_lo`` assumes the smallest two
    Ritz values approximate the smallest two nonzero singular values (docs/design.md, "The attention
    Jacobian"). ``sigma_min <= rank_rtol * sigma_max`` is reported as rank-deficient (default
    :func:`default_rank_rtol` of the operator's dtype). ``seed`` (in ``[0, 2**64)``) seeds the
    private generator of the start vector. ``dense``: False (the default) always runs Lanczos;
    ``"auto"`` takes the dense SVD instead (``method`` ``"dense-svd"``, exact, the choice and its
    cost in ``notes``) when it is cheaper than the ``r`` Lanczos steps exactness would take (than
    ``min(steps, r)`` steps when ``steps`` is given; default 300 Lanczos steps) and small
    (:func:`dense_preferred`); True always takes it. The dense path is not bounded by ``steps`` or
    ``time_budget`` (its cost is: about 2e11 flops at most under ``"auto"``). Returns a
    :class:`SpectrumEstimate` (a list for a sequence of operators).

    Examples:
        >>> layer = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        >>> op = condinit.JacobianOperator(layer, torch.randn(1, 12, 16))
        >>> est = condinit.lanczos_svd(op, seed=0)          # stops when kappa is within 10 %
        >>> est.kappa, (est.kappa_lo, est.kappa_hi), est.converged, est.iterations
        >>> est = condinit.lanczos_svd(op, steps=10_000, tol=0.0)   # to the end: est.exact
        >>> condinit.lanczos_svd(op, dense="auto").method             # "dense-svd" for a layer this small
    """
    ops = _check_operators(op)
    kw = _check_budget(steps, tol, time_budget, confidence, rank_rtol)
    check_seed("seed", seed)
    return _many(op, ops, _lanczos_one, seed=seed, dense=_check_dense(dense), **kw)


def condition_number(op: Union[JacobianOperator, Sequence[JacobianOperator]], steps: Optional[int] = None, seed: int = 0,
                     *, method: str = "auto", tol: float = _TOL, time_budget: Optional[float] = None,
                     confidence: float = _CONFIDENCE, rank_rtol: Optional[float] = None):
    """kappa(J) = sigma_max / sigma_min over the nonzero singular values of ``J``, with its bracket.

    ``method="lanczos"``: :func:`lanczos_svd` (``steps``, ``seed``, ``tol``, ``time_budget``,
    ``confidence``); ``"dense"``: exact, the singular values (``torch.linalg.svdvals`` in float64) of
    ``J`` assembled from one product per basis vector of its shorter side (rows in
    projection-output coordinates for a wide weight Jacobian), the nonzero ones those above
    ``64 eps s_1`` (``eps`` of the operator's dtype), each bracketed by that rounding; at most
    2**24 entries. ``"auto"`` (the default): ``"dense"`` where it is cheaper than the Lanczos run
    to exactness and small (:func:`dense_preferred`), else ``"lanczos"``; the estimate's ``method``
    and ``notes`` say which. Returns a :class:`SpectrumEstimate` (a list for a sequence of
    operators); its ``kappa`` is None when ``J`` is rank-deficient (``sigma_min <= rank_rtol
    sigma_max``).

    Examples:
        >>> layer = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        >>> op = condinit.JacobianOperator(layer, torch.randn(1, 12, 16))
        >>> est = condinit.condition_number(op, seed=0)     # method "auto": a dense SVD for a layer this small
        >>> est.method, est.kappa, est.kappa_lo, est.kappa_hi, est.converged
        >>> condinit.condition_number(op, method="lanczos", seed=0)      # Lanczos, stops within 10 %
    """
    ops = _check_operators(op)
    kw = _check_budget(steps, tol, time_budget, confidence, rank_rtol)
    check_seed("seed", seed)
    check_choice("method", method, ("auto", "lanczos", "dense"))
    if method == "dense":
        return _many(op, ops, _dense_one, rank_rtol=kw["rank_rtol"], tol=kw["tol"])
    return _many(op, ops, _lanczos_one, seed=seed, dense="auto" if method == "auto" else False, **kw)


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


def dense_preferred(op: JacobianOperator, steps: Optional[int] = None) -> bool:
    """Whether ``dense="auto"`` (:func:`lanczos_svd`, :func:`condition_number`) takes the dense path for
    ``op``: its dense SVD is cheaper than the Lanczos run to exactness and small (at most about 2e11
    flops and 2**24 entries), and its attention output is finite in its dtype. Such an operator is
    best built in float64 (its bracket is then the rounding of float64)."""
    eff = _Effective(op)
    return eff.r > 0 and _dense_plan(eff, steps) is not None and _overflow(op) is None


def _dense_matrix(eff: "_Effective") -> Tensor:
    """The ``[q, p]`` float64 matrix of :func:`_dense_shape` (``M M^T = A^T A``, so its singular values
    are ``J``'s), ``q`` products sent in blocks of probes."""
    op = eff.op
    q, p = _dense_shape(eff)
    M = torch.empty(q, p, dtype=torch.float64, device=op.device)
    root = None
    if eff.coords:       # <G_1, K G_2> = <K^{1/2} G_1, K^{1/2} G_2>
        lam, Q = torch.linalg.eigh(op._gram().to(torch.float64))
        root = (Q * lam.clamp(min=0).sqrt()) @ Q.t()
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
    eps = torch.finfo(op.dtype).eps
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
        notes.append(f"kappa's bracket [{klo:.4g}, {khi:.4g}] is the rounding of {op.dtype}: build the operator with "
                     f"dtype=torch.float64 for a tighter one")
    return SpectrumEstimate(
        method=method, sigma_max=smax, sigma_min=smin, kappa=kappa, iterations=0,
        residual_max=0.0, residual_min=0.0, converged=bool(smin_hi <= rtol * (smax - fl) if rank_def else khi <= (1.0 + tol) * klo),
        rank_deficient=bool(rank_def), subspace=eff.subspace(),
        null_dims=tuple(op.null_dims), shape=tuple(op.shape), seed=0, wrt=op.wrt,
        notes="; ".join(notes + _operator_notes(op)),
        sigma_max_lo=smax - fl, sigma_max_hi=smax + fl, sigma_min_lo=smin_lo, sigma_min_hi=smin_hi,
        kappa_lo=klo, kappa_hi=khi, exact=True, tol=tol,
        bracket=_BRACKET_DENSE.format(q=q, dtype=op.dtype, rank=rank), wall_s=time.perf_counter() - t0)


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
