"""Per-block singular-value extremes and spectral clamping (reconditioning) of weights.

:func:`spectrum` returns ``sigma_max``, ``sigma_min`` and ``kappa = sigma_max / sigma_min`` of every
``m x n`` block of a stack, computed in float64 by one of two routes:

* ``svd``: ``torch.linalg.svdvals`` (exact to float64 rounding, for any block);
* ``gram``: the eigenvalues of the small Gram ``W W^T`` (``m <= n``; ``W^T W`` otherwise) by
  ``eigvalsh``, ``sigma = sqrt(lambda)``. For wide blocks (``n >> m``) this costs one
  ``2 m^2 n`` GEMM instead of an SVD. The Gram squares kappa: ``sigma_min`` keeps a relative
  accuracy of about ``u64 kappa^2``, so blocks whose Gram estimate of kappa exceeds 1e6 are redone
  by ``svd``.

``auto`` takes ``gram`` when the long side is at least twice the short side, ``svd`` otherwise.

A float64 block is first scaled by a power of two that brings its largest entry into ``[0.5, 1)``,
and the singular values are scaled back: exact, and it keeps the Gram (and the SVD) in range for
any finite scale, so ``1e30 W`` and ``1e-30 W`` give ``1e30`` / ``1e-30`` times the singular values
of ``W`` and the same ``cond``. Blocks stored in float32, bfloat16 or float16 need no scaling: their
entries lie within ``[2^-149, 2^128]`` in magnitude, so every product and every sum of ``n < 2^31``
products in the float64 Gram stays a normal float64 number (within ``[2^-298, 2^287]``), and a
power-of-two scaling would change no bit; skipping it saves two passes over the float64 copy. A block holding NaN or Inf gets NaN ``sigma_max``, ``sigma_min`` and
``cond`` (the other blocks are unaffected); an all-zero block gets 0, 0 and ``inf``.

:func:`recondition_` clamps every block's singular values to ``[sigma_max / max_cond, sigma_max]``
in place, keeping its singular vectors: ``W <- U diag(max(s, sigma_max / max_cond)) V^T``
(``svd`` route), or ``W <- U diag(max(s, floor) / s) U^T W`` with ``W W^T = U diag(s^2) U^T``
(``gram`` route; blocks with ``s_min`` too small for the Gram to resolve use the ``svd`` route).
Blocks already within the bound are not written at all.
"""
from __future__ import annotations

import math
from collections import namedtuple
from typing import Optional

import torch

from condinit._validate import check_choice, check_int, check_real, check_tensor

__all__ = ["Spectrum", "spectrum", "recondition_"]

Spectrum = namedtuple("Spectrum", ["sigma_max", "sigma_min", "cond"])
Spectrum.__doc__ = """Per-block ``sigma_max``, ``sigma_min``, ``cond = sigma_max / sigma_min`` (float64)."""

SPECTRUM_METHODS = ("auto", "svd", "gram")
GRAM_MAX_COND = 1.0e6          # beyond this the Gram route cannot resolve sigma_min: use SVD
_CHUNK_BYTES = 64 << 20        # float64 working set per chunk
# storage dtypes whose values' float64 Gram never leaves the normal range (module docstring)
_NORMAL_GRAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_stack(t, name: str):
    check_tensor(name, t, floating=True, min_dim=2)
    if any(s == 0 for s in t.shape):
        raise ValueError(f"{name} must not have a zero-size dim, got shape {tuple(t.shape)}")


def _route(m: int, n: int, method: str) -> str:
    if method != "auto":
        return method
    return "gram" if max(m, n) >= 2 * min(m, n) else "svd"


def _chunks(num: int, m: int, n: int):
    step = max(1, _CHUNK_BYTES // (8 * m * n))
    for s in range(0, num, step):
        yield s, min(num, s + step)


def _times_pow2(t: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``t * 2**e`` per leading index (``e`` int, broadcast over trailing dims), exact unless the
    result under/overflows; in two halves so that ``2**e`` itself stays finite for ``|e| > 1023``."""
    e = e.reshape(e.shape + (1,) * (t.dim() - e.dim()))
    half = torch.div(e, 2, rounding_mode="floor")
    one = torch.ones(e.shape, dtype=t.dtype, device=t.device)
    return t * torch.ldexp(one, half) * torch.ldexp(one, e - half)


def _unit_exponent(X: torch.Tensor) -> torch.Tensor:
    """Per block of X [k, m, n] (finite, not all zero): ``e`` with ``max |X 2**-e|`` in ``[0.5, 1)``."""
    return torch.frexp(X.abs().amax(dim=(1, 2)))[1]


def _extremes(X: torch.Tensor, route: str):
    """(sigma_max, sigma_min) of the float64 blocks X [k, m, n] (entries of order 1)."""
    if route == "gram":
        s = _gram_eig(X, False)[0]
        hi, lo = s[:, -1], s[:, 0]
        redo = ~(hi <= GRAM_MAX_COND * lo)
        if bool(redo.any()):
            sv = torch.linalg.svdvals(X[redo])
            hi = hi.clone(); lo = lo.clone()
            hi[redo], lo[redo] = sv[:, 0], sv[:, -1]
        return hi, lo
    sv = torch.linalg.svdvals(X)
    return sv[:, 0], sv[:, -1]


def _gram_eig(X: torch.Tensor, vectors: bool):
    """Eigen-decomposition of the small Gram of float64 blocks X [k, m, n] (ascending)."""
    Xw = X if X.shape[1] <= X.shape[2] else X.transpose(1, 2)
    G = torch.bmm(Xw, Xw.transpose(1, 2))
    if vectors:
        lam, U = torch.linalg.eigh(G)
        return lam.clamp_min(0.0).sqrt(), U, Xw
    return torch.linalg.eigvalsh(G).clamp_min(0.0).sqrt(), None, Xw


@torch.no_grad()
def spectrum(stack: torch.Tensor, *, method: str = "auto") -> Spectrum:
    """``Spectrum(sigma_max, sigma_min, cond)`` of every block of ``stack`` ``[..., m, n]``.

    Each field is a float64 tensor of shape ``stack.shape[:-2]`` (0-d for one ``[m, n]`` matrix).
    ``sigma_min`` is the ``min(m, n)``-th singular value; ``cond`` is ``inf`` where it is 0.
    A block with a NaN or Inf entry gets NaN in all three fields; any finite scale is exact (each
    block is scaled by a power of two before the decomposition and the result scaled back).
    ``method``: ``"auto"``, ``"svd"`` or ``"gram"`` (module docstring).

    Examples:
        >>> from condinit.init import semi_orthogonal_, spectrum
        >>> q = semi_orthogonal_(torch.empty(8 * 64, 512), head_dim=64, seed=0)
        >>> sigma_max, sigma_min, cond = spectrum(q.view(8, 64, 512))   # per head; all 1.0
        >>> spectrum(torch.randn(64, 512)).cond                           # one matrix: a 0-d tensor
    """
    _check_stack(stack, "stack")
    check_choice("method", method, SPECTRUM_METHODS)
    lead = stack.shape[:-2]
    m, n = stack.shape[-2:]
    blocks = stack.reshape(-1, m, n)
    route = _route(m, n, method)
    smax = torch.empty(blocks.shape[0], dtype=torch.float64, device=stack.device)
    smin = torch.empty_like(smax)
    cond = torch.empty_like(smax)
    if stack.device.type != "meta":
        with torch.no_grad():
            for a, b in _chunks(blocks.shape[0], m, n):
                raw = blocks[a:b]
                low, high = torch.aminmax(raw.reshape(b - a, -1), dim=1)   # NaN where a block holds NaN
                amax = torch.maximum(low.abs(), high.abs()).double()
                good = torch.isfinite(amax) & (amax > 0)
                # zero blocks: 0, 0, inf; non-finite blocks: NaN (their SVD is undefined)
                finite = torch.isfinite(amax)
                zero = torch.zeros_like(amax)
                nan = torch.full_like(amax, math.nan)
                hi, lo = torch.where(finite, zero, nan), torch.where(finite, zero, nan)
                kappa = torch.where(finite, torch.full_like(amax, math.inf), nan)
                if bool(good.all()):
                    idx = None
                    Xg = raw.double()
                else:
                    idx = good.nonzero().flatten()
                    Xg = raw[idx].double()
                if Xg.shape[0]:
                    if raw.dtype in _NORMAL_GRAM_DTYPES:
                        s_hi, s_lo = _extremes(Xg, route)
                        k = torch.where(s_lo > 0, s_hi / s_lo, torch.full_like(s_hi, math.inf))
                    else:
                        e = _unit_exponent(Xg)
                        s_hi, s_lo = _extremes(_times_pow2(Xg, -e), route)
                        k = torch.where(s_lo > 0, s_hi / s_lo, torch.full_like(s_hi, math.inf))
                        s_hi, s_lo = _times_pow2(s_hi, e), _times_pow2(s_lo, e)
                    if idx is None:
                        hi, lo, kappa = s_hi, s_lo, k
                    else:
                        hi[idx], lo[idx], kappa[idx] = s_hi, s_lo, k
                smax[a:b], smin[a:b], cond[a:b] = hi, lo, kappa
    else:
        cond = torch.where(smin > 0, smax / smin, torch.full_like(smax, math.inf))
    return Spectrum(smax.reshape(lead), smin.reshape(lead), cond.reshape(lead))


@torch.no_grad()
def recondition_(stack_or_weight: torch.Tensor, *, max_cond: float, head_dim: Optional[int] = None,
                 method: str = "svd") -> torch.Tensor:
    """Clamp every block's singular values to ``[sigma_max / max_cond, sigma_max]``, in place.

    Blocks: the ``[..., m, n]`` blocks of a stack (``ndim >= 3``), or of a 2-D weight either the
    whole matrix or, with ``head_dim``, each head's ``[head_dim, cols]`` row block. Singular vectors
    and ``sigma_max`` are kept, so ``cond <= max_cond`` afterwards (up to the rounding of the
    storage dtype); blocks with ``cond <= max_cond`` are left untouched (not even rewritten).
    Computed in float64. ``method``: ``"svd"`` (default), ``"gram"`` or ``"auto"`` (module
    docstring). ``max_cond``: a finite number >= 1. Returns the tensor.

    Examples:
        >>> from condinit.init import recondition_
        >>> w = torch.randn(8 * 64, 512)
        >>> recondition_(w, max_cond=2.0, head_dim=64)           # every head's kappa <= 2
        >>> recondition_(torch.randn(16, 64, 64), max_cond=10.0)  # every block of a stack
    """
    w = stack_or_weight
    _check_stack(w, "stack_or_weight")
    max_cond = check_real("max_cond", max_cond, min=1.0)
    check_choice("method", method, SPECTRUM_METHODS)
    head_dim = check_int("head_dim", head_dim, min=1, allow_none=True)
    if head_dim is not None:
        if w.dim() != 2:
            raise ValueError(f"head_dim is for a 2-D weight, got shape {tuple(w.shape)}")
        if w.shape[0] % head_dim:
            raise ValueError(f"head_dim={head_dim} must divide the rows of the weight ({w.shape[0]})")
    if w.device.type == "meta":
        return w
    if not bool(torch.isfinite(w).all()):
        raise ValueError("stack_or_weight must be finite (it holds NaN or Inf)")
    if w.dim() == 2:
        blocks = w.unflatten(0, (w.shape[0] // head_dim, head_dim)) if head_dim else w.unsqueeze(0)
    elif w.dim() == 3:
        blocks = w
    else:
        try:
            blocks = w.view(-1, *w.shape[-2:])
        except RuntimeError:  # leading dims not viewable as one: work on a copy, write back once
            blocks = None
    target = blocks if blocks is not None else w.reshape(-1, *w.shape[-2:]).clone()
    m, n = target.shape[-2:]
    route = _route(m, n, method)
    with torch.no_grad():
        for a, b in _chunks(target.shape[0], m, n):
            X = target[a:b].double()
            # exact power-of-two scaling per block keeps the Gram in range at any scale (module doc)
            amax = X.abs().amax(dim=(1, 2))
            e = torch.where(amax > 0, torch.frexp(amax)[1], torch.zeros_like(amax, dtype=torch.int32))
            new, idx = _clamp_chunk(_times_pow2(X, -e), float(max_cond), route)
            if idx.numel():
                target[a:b].index_copy_(0, idx, _times_pow2(new, e[idx]).to(target.dtype))
        if blocks is None:
            w.copy_(target.view(w.shape))
    return w


def _clamp_chunk(X: torch.Tensor, max_cond: float, route: str):
    """(reconditioned blocks, their indices in X) for the blocks of X [k, m, n] with cond > max_cond."""
    if route == "gram":
        s, U, Xw = _gram_eig(X, True)
        smax, smin = s[:, -1], s[:, 0]
        floor = smax / max_cond
        need = ~(smin >= floor)
        # the Gram resolves sigma_min only to ~u64 kappa^2: redo tiny ones by SVD
        use_svd = need & ~(smin * GRAM_MAX_COND >= smax)
        use_gram = need & ~use_svd
        out, idx = [], []
        if bool(use_gram.any()):
            g = use_gram.nonzero().flatten()
            sg = s[g]
            fac = torch.maximum(sg, floor[g, None]) / sg
            Ug = U[g]
            Xn = torch.bmm(Ug * fac[:, None, :], torch.bmm(Ug.transpose(1, 2), Xw[g]))
            if X.shape[1] > X.shape[2]:
                Xn = Xn.transpose(1, 2)
            out.append(Xn)
            idx.append(g)
        if bool(use_svd.any()):
            g = use_svd.nonzero().flatten()
            out.append(_svd_clamp(X[g], max_cond))
            idx.append(g)
        if not idx:
            return X[:0], torch.zeros(0, dtype=torch.int64, device=X.device)
        return torch.cat(out), torch.cat(idx)
    sv = torch.linalg.svdvals(X)
    need = ~(sv[:, -1] >= sv[:, 0] / max_cond)
    g = need.nonzero().flatten()
    if g.numel() == 0:
        return X[:0], g
    return _svd_clamp(X[g], max_cond), g


def _svd_clamp(X: torch.Tensor, max_cond: float) -> torch.Tensor:
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    S = torch.maximum(S, S[:, :1] / max_cond)
    return torch.bmm(U * S[:, None, :], Vh)
