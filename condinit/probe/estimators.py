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

Layout: :mod:`~condinit.probe.results` (the results), :mod:`~condinit.probe.krylov` (the effective
operator and the bases), :mod:`~condinit.probe.lanczos` (one run), :mod:`~condinit.probe.brackets`
(its certified brackets), :mod:`~condinit.probe.dense_svd` (the exact path), :mod:`~condinit.probe.norms`
(power iteration, Hutchinson), :mod:`~condinit.probe.blocks` (per key/value block); this module is the
front-end.

Randomness comes from a private ``torch.Generator`` seeded with ``seed``: the user's RNG streams
are never touched, and results are deterministic given the seed. Each function takes one operator
or a sequence of them (layers are estimated one after another; the probes of one layer share launches).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

from condinit._validate import check_choice, check_int, check_real, check_seed

from .blocks import blocks_estimate, blocks_reach_exactness
from .brackets import _TOL
from .dense_svd import _dense_one, dense_preferred
from .krylov import _Effective  # noqa: F401 (the effective operator, for tests and tools)
from .lanczos import _lanczos_one
from .norms import frobenius_hutchinson, power_sigma_max
from .operator import JacobianOperator
from .results import FrobeniusEstimate, SpectrumEstimate, _check_operators, _many, default_rank_rtol

__all__ = ["SpectrumEstimate", "FrobeniusEstimate", "lanczos_svd", "power_sigma_max", "condition_number",
           "frobenius_hutchinson", "default_rank_rtol", "dense_preferred", "check_dense", "exact_in_reach"]

DEFAULT_STEPS = 300   # default step budget of lanczos_svd / condition_number
_CONFIDENCE = 0.999   # sigma_max's upper bound holds with this probability over the random start


def check_dense(dense):
    """``dense`` as :func:`lanczos_svd` and :class:`~condinit.probe.JacobianMonitor` take it: False, True or
    ``"auto"`` (returned unchanged); anything else raises ValueError naming the argument."""
    if dense not in (False, True, "auto") or not isinstance(dense, (bool, str)):
        raise ValueError(f"dense must be False, True or 'auto', got {dense!r}")
    return dense


def _check_budget(steps, tol, time_budget, confidence, rank_rtol):
    check_int("steps", steps, min=1, allow_none=True)
    given, steps = steps, DEFAULT_STEPS if steps is None else steps
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
                rank_rtol: Optional[float] = None, dense: Union[bool, str] = False, blocks: Union[bool, str] = "auto"):
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
    ``time_budget`` (its cost is: about 2e11 flops at most under ``"auto"``). ``blocks``: where ``J`` is block
    diagonal over its key/value groups (:attr:`JacobianOperator.kv_blocks_exact`: ``wrt="weights"``
    or ``"qkv"`` without ``W_O``, more than one key/value head), True estimates each block on its own
    (the step and time budgets shared) and combines the brackets (:mod:`condinit.probe.blocks`;
    ``iterations`` is then the sum over the blocks); False runs on ``J`` whole; ``"auto"`` (the
    default) takes the blocks where the dense path is taken for every block (``dense`` not False and
    :func:`dense_preferred`; it costs ``1 / Hkv^2`` of the whole's dense SVD) or where a ``steps``
    the caller gives lets every block run to exactness (their reorthogonalization costs ``1 / Hkv``
    of the whole's), else ``J`` whole: on a layer Lanczos does not finish, one run on ``J`` reaches a
    higher ``kappa_lo`` in the same time than the blocks sharing it. Returns a
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
    blocks = _check_blocks(blocks)
    return _many(op, ops, _run, one=_lanczos_one, blocks=blocks, seed=seed, dense=check_dense(dense), **kw)


def condition_number(op: Union[JacobianOperator, Sequence[JacobianOperator]], steps: Optional[int] = None, seed: int = 0,
                     *, method: str = "auto", tol: float = _TOL, time_budget: Optional[float] = None,
                     confidence: float = _CONFIDENCE, rank_rtol: Optional[float] = None, blocks: Union[bool, str] = "auto"):
    """kappa(J) = sigma_max / sigma_min over the nonzero singular values of ``J``, with its bracket.

    ``method="lanczos"``: :func:`lanczos_svd` (``steps``, ``seed``, ``tol``, ``time_budget``,
    ``confidence``); ``"dense"``: exact, the singular values (``torch.linalg.svdvals`` in float64) of
    ``J`` assembled from one product per basis vector of its shorter side (rows in
    projection-output coordinates for a wide weight Jacobian), the nonzero ones those above
    ``64 eps s_1`` (``eps`` of the operator's dtype), each bracketed by that rounding; at most
    2**24 entries. ``"auto"`` (the default): ``"dense"`` where it is cheaper than the Lanczos run
    to exactness and small (:func:`dense_preferred`), else ``"lanczos"``; the estimate's ``method``
    and ``notes`` say which. ``blocks``: as for :func:`lanczos_svd` (the dense path per key/value
    block too). Returns a :class:`SpectrumEstimate` (a list for a sequence of
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
    blocks = _check_blocks(blocks)
    if method == "dense":
        return _many(op, ops, _run, one=_dense_block, blocks=blocks, seed=seed, dense=True, **kw)
    return _many(op, ops, _run, one=_lanczos_one, blocks=blocks, seed=seed,
                 dense="auto" if method == "auto" else False, **kw)


def _dense_block(op: JacobianOperator, *, rank_rtol, tol, **_):
    return _dense_one(op, rank_rtol=rank_rtol, tol=tol)


def _check_blocks(blocks):
    if blocks not in (False, True, "auto") or not isinstance(blocks, (bool, str)):
        raise ValueError(f"blocks must be False, True or 'auto', got {blocks!r}")
    return blocks


def _run(op: JacobianOperator, *, one, blocks, **kw):
    """``one`` on ``op``, or on each key/value block of ``op`` combined (``blocks``; ``"auto"``: where
    every block takes the dense path)."""
    if blocks == "auto":
        dense = kw.get("dense", False)
        steps = None if kw.get("steps_given") is None else kw["steps"]
        many = len(op.kv_blocks()) > 1
        blocks = dense is True or (many and dense == "auto" and dense_preferred(op, steps)) or \
            (many and steps is not None and blocks_reach_exactness(op, steps))
    return blocks_estimate(op, one, **kw) if blocks else one(op, **kw)


def exact_in_reach(op: JacobianOperator, steps: Optional[int] = None, dense: Union[bool, str] = "auto") -> bool:
    """Whether :func:`lanczos_svd` with these ``steps`` and ``dense`` will be exact on ``op``: the dense
    SVD is taken (``dense=True``, or ``"auto"`` and :func:`dense_preferred`), or Lanczos reaches the end of
    ``range(J)`` within the step budget (``r <= steps``, default 300). Such an operator is best built
    in float64: its rounding then cannot leave kappa's bracket wide, nor stop the Krylov space before
    the end, and the dense SVD costs about what it does in float32 (its matrix is float64 either way)."""
    if dense is True or (dense == "auto" and dense_preferred(op, steps)):
        return True
    return _Effective(op).r <= (DEFAULT_STEPS if steps is None else steps)
