"""Certified brackets on sigma_max, sigma_min and kappa from the Ritz values and residuals of a
Golub-Kahan-Lanczos run (docs/design.md, "The attention Jacobian", "Brackets"), and when to stop."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .krylov import _FLOOR

_TOL = 0.1            # converged: kappa's bracket within 10 % (kappa_hi <= (1 + tol) kappa_lo)

_BRACKET_EXACT = ("exact: the Krylov space is invariant (it is range(J^T)), so the Ritz values are the nonzero "
                  "singular values; each within its residual / sqrt(2) (Bauer-Fike on [[0, J], [J^T, 0]]) and the "
                  "rounding f = 512 eps s_1 sqrt(k) of k steps (assumed at most that, as a norm)")
_BRACKET_KRYLOV = (
    "sigma_max >= the largest Ritz value - f and sigma_min <= the smallest + f, f = 512 eps s_1 sqrt(k) the "
    "rounding of k steps (assumed at most that, as a norm; the Krylov space lies in range(J^T)); sigma_max <= "
    "(s_1 + f) / sqrt(1 - e) with probability >= confidence over the random start (Kuczynski-Wozniakowski); "
    "sigma_min >= max(s_k - eta_k, s_k - eta_k^2 / (s_{k-1} - eta_{k-1} - s_k)) - f once s_k has settled, assuming "
    "the two smallest Ritz values approximate the two smallest nonzero singular values (residual bound and "
    "Kato-Temple with that gap; before s_k settles, no lower bound from the Ritz values)")
_BRACKET_FLOOR = ("; sigma_min >= {floor:.6g}, a certified floor on the nonzero spectrum from the {terms} (J J^T >= "
                  "the sum over the value-subspace directions m of (D_m + P_s P_s^T), each bounded on its range; "
                  "condinit.probe.floor), where it is the higher lower bound")
_BRACKET_CEILING = ("; sigma_min <= {ceiling:.6g} + f_1, the Rayleigh quotient of J J^T on the floor's weakest "
                    "directions (they lie in range(J)), f_1 = 512 eps s_1 the rounding of the one product that "
                    "computes it, where it is the lower upper bound")
_BRACKET_NO_FLOOR = "; no certified floor under sigma_min: {reason}"



def _kw_epsilon(k: int, dim: int, confidence: float) -> float:
    """Kuczynski-Wozniakowski (1992, Thm 4.2a): after ``k`` Lanczos steps on a PSD ``M`` (dimension
    ``dim``) from a uniformly random start, ``P(theta < (1 - e) lambda_max) <= 1.648 sqrt(dim)
    exp(-sqrt(e) (2k - 1))``; the ``e`` at which that probability is ``1 - confidence``."""
    return (math.log(1.648 * math.sqrt(dim) / (1.0 - confidence)) / (2 * k - 1)) ** 2


def _bracket(s: list, res: list, k: int, exhausted: bool, dim: int, confidence: float, eps: float,
             floor: Optional[float] = None, ceiling: Optional[float] = None, settled: bool = True) -> dict:
    """Lower / upper bounds on sigma_max, sigma_min and kappa from the Ritz values ``s`` (descending)
    and residuals ``res`` (``||A^T u_i - s_i v_i||``) after ``k`` steps (docs/design.md, "The attention
    Jacobian", "Brackets"); ``floor`` / ``ceiling``: certified lower / upper bounds on sigma_min
    (:mod:`condinit.probe.floor`; the ceiling before the rounding of the one product that computes it),
    taken where tighter;
    ``settled``: whether the smallest Ritz value has settled (:func:`_settled`), without which the
    residual / Kato-Temple lower bound on sigma_min (which assumes it approximates sigma_min) is not used.
    ``short``: the ceiling lies under the Ritz values' lower bound (the run stopped short of J's weakest
    direction, so it is not exact even where the Krylov space is invariant)."""
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
        lo = sk - eta[-1] if settled else 0.0      # a singular value lies within eta of s_k: sigma_min (assumed)
        if k >= 2 and settled:                                 # Kato-Temple with sigma_2 >= s_{k-1} - eta_{k-1} (assumed)
            gap = (s[-2] - eta[-2]) - sk
            if gap > 0:
                lo = max(lo, sk - eta[-1] ** 2 / gap)
        smin = (max(lo - fl, 0.0), sk + fl)
    if floor is not None:
        smin = (max(smin[0], floor), smin[1])
    short = False
    if ceiling is not None:          # one product (a VJP launch) computed it: its rounding is that of one step
        smin = (smin[0], min(smin[1], ceiling + 8 * _FLOOR * eps * s1))
        short = smin[0] > smin[1]
        if short:
            # the ceiling (a direction in range(J)) finds one weaker than every Ritz value: the Krylov space
            # stopped short of it (it lies at the rounding floor), so only the certified floor stands below
            smin = (floor if floor is not None else 0.0, smin[1])
    kappa = (smax[0] / smin[1] if smin[1] > 0 else math.inf, smax[1] / smin[0] if smin[0] > 0 else math.inf)
    return {"sigma_max": smax, "sigma_min": smin, "kappa": kappa, "short": short}


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

