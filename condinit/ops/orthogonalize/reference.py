"""The PyTorch orthonormalizations of ``[B, m, n]`` wide blocks (``m <= n``), the ``torch``
backend of :func:`condinit.ops.orthogonalize.orthogonalize` (and the polar iteration the Triton
backend drives with its own GEMMs). Methods (docs/design.md, "Orthogonalization"):

``householder``
    ``W^T = Q R`` (``torch.linalg.qr``) with the sign fix ``diag(R) > 0``, i.e. ``W = R^T Q^T``.
    Exact and backward stable for any conditioning. Of a Gaussian block this ``Q`` is Haar
    distributed (Mezzadri 2007); without the sign fix it is not.
``cholqr2``
    CholeskyQR2: ``G = W W^T`` (batched GEMM), ``L = chol(G)`` in float64 (``m x m``, tiny),
    ``W <- L^{-1} W`` with an explicit triangular inverse and a batched GEMM, twice. ``W = L Q``
    with ``L`` lower triangular and ``diag(L) > 0`` is the same factorization as the sign-fixed
    Householder QR, so both give the *same* ``Q`` (up to rounding). Stable while
    ``kappa(W) <~ u^{-1/2}``; a Gaussian ``m x n`` block with ``n >= 4m`` has
    ``kappa ~ (sqrt(n)+sqrt(m)) / (sqrt(n)-sqrt(m)) <= 3``. A block whose Cholesky fails
    (``cholesky_ex`` info), whose first factor is too ill-conditioned, or whose second Gram is not
    close to ``I`` falls back, alone, to Householder. Cost: 4 GEMMs of ``2 m^2 n`` flops. The
    second pass's Gram is ``I + E`` with ``|E| ~ 1e-6``: its Cholesky factor's inverse is taken as
    ``I - tril(E, -1) - diag(E)/2``, exact to ``O(m |E|^2)`` (used when that is < 1e-9; else the
    float64 Cholesky), which saves a second batch of tiny LAPACK calls.
``polar``
    The polar factor ``U V^T`` of ``W = U S V^T`` by odd polynomial iterations
    ``X <- (alpha I + beta X X^T) X`` in fp32. Each step uses the optimal cubic for the current
    singular-value interval ``[l, 1]`` (the Polar Express / scaled Newton-Schulz construction):
    ``alpha = beta (1 + l + l^2)``, ``beta = 2 / (2/(3 sqrt 3) (1 + l + l^2)^{3/2} + l + l^2)``,
    normalized so the largest image is 1; ``l = 1`` is Newton-Schulz ``(3/2, -1/2)``. ``X_0``
    is scaled by ``sigma_max`` (exact from the small Gram's eigenvalues when ``m <= 256``, else the
    bound ``min(||G||_F, ||G||_inf)``). Iterations stop per block once ``max|X X^T - I| <= tol``
    (``tol = 1e-6`` or the fp32 rounding floor of the Gram, whichever is larger); a block that
    does not converge falls back to ``svd``. On CUDA the two GEMMs of a step run as Triton kernels
    (``condinit.kernels.orthogonalize.polar``).
``svd``
    ``U V^T`` from ``torch.linalg.svd``: the paper's own construction, the reference.
``auto``
    ``cholqr2`` for wide (or tall) blocks with aspect ratio ``>= 4`` (well-conditioned when
    Gaussian), ``householder`` otherwise (measured fastest on CPU; see benchmarks/bench_init.py).

Polar and SVD give the polar factor, QR and CholeskyQR the Q factor: different matrices, the same
(Haar) distribution for Gaussian input.

CPU threads ("LAPACK on the CPU" below): Householder, SVD and CholeskyQR2 run block by block in
the native kernels, the chunk in one OpenMP team, each block on single-threaded MKL, so a block's
bits depend neither on the thread count nor on the batch split. MKL's per-thread setting is never
trusted blindly and never a reason to raise: a block whose calls MKL reports ran without it is
recomputed (its bits then are those of one thread again), and where the setting cannot be made at
all (no extension, no setter) the declared fallback is torch's own batched calls.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["torch_chunk", "polar_iterate_", "polar_tol"]

# CholeskyQR2 falls back when the first factor's diagonal spread (a lower bound on kappa(W)) is above
# this (pass-1 orthogonality error ~ u32 kappa^2 must stay << 1 for pass 2 to finish the job) ...
CHOLQR_MAX_DIAG_RATIO = 1.0e2
# ... or when the second Gram is farther than this from I (pass 1 did not get close enough).
CHOLQR_MAX_GRAM2_DEVIATION = 1.0e-2
# polar: target max|X X^T - I|, and how many extra Newton-Schulz steps after the schedule.
POLAR_TOL = 1.0e-6
POLAR_EXTRA_STEPS = 6
POLAR_DEFAULT_LOWER = 1.0e-3   # assumed sigma_min / sigma_max when it is not computed exactly
POLAR_EXACT_SCALE_MAX_M = 256  # eigvalsh of the m x m Gram for m up to this

_U32 = 2.0 ** -24
# polar: the largest Gram eigenvalue used for the 1/sigma_max scale is at least this, so the fp32
# scale**2 stays finite (a zero block keeps X = 0 and ends in the SVD fallback).
POLAR_MIN_TOP = 2.0 ** -120


def _eye(m: int, device, dtype) -> torch.Tensor:
    return torch.eye(m, device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# the methods, on a contiguous fp32 chunk A [C, m, n], m <= n. ``A`` may be clobbered; the result is
# written to ``out`` (contiguous fp32 [C, m, n], may alias ``A``). ``gemm``: the GEMM dtype
# (:func:`gemm_dtype`); every matrix product goes through :func:`_bmm` / :func:`_gram`.

def _bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, gemm: torch.dtype) -> torch.Tensor:
    """``out = a @ b`` (batched) computed in ``gemm``, rounded once into ``out``."""
    if gemm == torch.float32:
        return torch.bmm(a.float(), b, out=out)
    out.copy_(torch.bmm(a.to(gemm), b.to(gemm)))
    return out


def _gram(X: torch.Tensor, gemm: torch.dtype) -> torch.Tensor:
    """``X X^T`` in ``gemm`` (kept in that dtype: everything that reads it is tiny)."""
    Xg = X.to(gemm)
    return torch.bmm(Xg, Xg.transpose(1, 2))


def _householder_serial_(A: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    Q, R = torch.linalg.qr(A.transpose(1, 2))          # A^T = Q R, Q [C, n, m]
    d = R.diagonal(dim1=-2, dim2=-1)
    sign = torch.where(d < 0, -1.0, 1.0).to(Q.dtype)   # sign(0) := +1
    out.copy_((Q * sign.unsqueeze(1)).transpose(1, 2))
    return out


def _householder_(A: torch.Tensor, out: torch.Tensor, draw=None) -> torch.Tensor:
    if _per_block_lapack(A):
        torch.ops.condinit_C.orthonormal_blocks_(A, out, "householder", torch.float32, *_draw_args(draw))
        return out
    return _householder_serial_(A, out)


def _svd_serial_(A: torch.Tensor, out: torch.Tensor, gemm: torch.dtype) -> torch.Tensor:
    U, _, Vh = torch.linalg.svd(A, full_matrices=False)   # U [C, m, m], Vh [C, m, n]
    return _bmm(U, Vh, out, gemm)


def _svd_(A: torch.Tensor, out: torch.Tensor, gemm: torch.dtype, draw=None) -> torch.Tensor:
    if _per_block_lapack(A):
        torch.ops.condinit_C.orthonormal_blocks_(A, out, "svd", gemm, *_draw_args(draw))
        return out
    return _svd_serial_(A, out, gemm)


# ---------------------------------------------------------------------------------------------------
# LAPACK on the CPU: one block per call, single-threaded MKL, the whole batch in one OpenMP team
#
# MKL's multithreaded QR, SVD and Cholesky reduce in an order that depends on the number of
# threads, so the same block would get other bits with 1 and with 2 torch threads; and the batched
# torch calls open one OpenMP region per matrix (per triangular solve, per QR panel) and per small
# elementwise step, each of which waits at its barrier for a thread the OS has descheduled: with
# two busy processes beside it, the Llama-1B stack (CholeskyQR2) took 4-13x its quiet time. On the
# CPU these methods therefore run in the native kernels of csrc/orthogonalize/lapack_blocks_cpu.cpp:
# one at::parallel_for per chunk (one team of the caller's torch threads, which take blocks from a
# shared counter), every block computed alone with single-threaded MKL (MKL_Set_Num_Threads_Local,
# a setting of each team thread only, restored after; no process setting changes). MKL drops that
# setting at a thread's first factorization: each team thread first runs a tiny one and sets it
# again, and a block is written only once MKL reports that the setting held through its calls,
# else it is recomputed from its input (a warning, never an exception, should MKL drop it three
# times running). A block's bits thus depend on its data only: not on the thread count, nor on how
# the batch is split. CholeskyQR2 there is the same algorithm as :func:`_cholqr2_` below (same
# steps, float64 factors, thresholds and Householder fallback), its GEMMs per block.
#
# Not supported, declared: without the native extension (condinit._C not built), on other devices,
# and where MKL's per-thread setter cannot be found in an MKL build, the factorizations run as torch
# runs them (the batched torch.linalg calls here); with a torch built without MKL, the native
# kernels run each LAPACK call nested in the team as that library runs nested calls. Their bits may
# then depend on the thread count.

_NATIVE_BLOCKS: Optional[bool] = None


def _per_block_lapack(t: torch.Tensor) -> bool:
    """Whether ``t``'s factorizations run in the per-block native kernels (see above)."""
    global _NATIVE_BLOCKS
    if t.device.type != "cpu":
        return False
    if _NATIVE_BLOCKS is None:
        from condinit import _ext
        _NATIVE_BLOCKS = (_ext.has_op("orthonormal_blocks_", "CPU") and _ext.has_op("cholqr2_blocks_", "CPU")
                          and bool(torch.ops.condinit_C.per_block_single_thread()))
    return _NATIVE_BLOCKS


def _first_order_max(m: int) -> float:
    """The largest ``max|E|`` of a second-pass Gram ``I + E`` whose first-order inverse factor is used."""
    return min(1e-5, math.sqrt(1e-9 / m))


def _chol_inverse(G: torch.Tensor, *, near_identity: bool):
    """``L^{-1}`` (float64) of ``G = L L^T`` computed in float64, and a mask of blocks to redo."""
    G64 = G.double()
    L, info = torch.linalg.cholesky_ex(G64)
    d = L.diagonal(dim1=-2, dim2=-1)
    bad = info != 0
    if near_identity:
        eye = _eye(G.shape[-1], G.device, torch.float64)
        bad |= (G64 - eye).abs().flatten(1).amax(1) > CHOLQR_MAX_GRAM2_DEVIATION
    else:
        bad |= ~(d.amax(-1) <= CHOLQR_MAX_DIAG_RATIO * d.amin(-1))   # also catches NaN
    if bool(bad.any()):
        L = torch.where(bad[:, None, None], _eye(G.shape[-1], G.device, torch.float64), L)
    eye = _eye(G.shape[-1], G.device, torch.float64).expand_as(L)
    return torch.linalg.solve_triangular(L, eye, upper=False), bad


def _near_identity_chol_inverse(G: torch.Tensor):
    """``L^{-1}`` for ``G = I + E = L L^T`` with small ``E`` (the second CholeskyQR pass).

    ``L = I + F + O(m |E|^2)`` with ``F = tril(E, -1) + diag(E) / 2``, so ``L^{-1} = I - F`` to
    ``O(m |E|^2)``: below fp32 rounding when ``|E| <= sqrt(u64-ish / m)``, which a pass-1 result of a
    well-conditioned block satisfies (|E| ~ 1e-6). Other blocks take the float64 Cholesky. The
    result has ``G``'s dtype."""
    m = G.shape[-1]
    eye = _eye(m, G.device, G.dtype)
    E = G - eye
    dev = E.abs().flatten(1).amax(1)
    first_order_ok = dev <= _first_order_max(m)
    F = E.tril(-1)
    F.diagonal(dim1=-2, dim2=-1).copy_(E.diagonal(dim1=-2, dim2=-1) * 0.5)
    Linv = eye - F
    if bool(first_order_ok.all()):
        return Linv, torch.zeros_like(first_order_ok)
    exact, bad = _chol_inverse(G, near_identity=True)
    return torch.where(first_order_ok[:, None, None], Linv, exact.to(G.dtype)), bad & ~first_order_ok


def _cholqr2_(A: torch.Tensor, out: torch.Tensor, scratch: Optional[torch.Tensor],
              gemm: torch.dtype, draw=None) -> torch.Tensor:
    if _per_block_lapack(A):
        torch.ops.condinit_C.cholqr2_blocks_(A, out, gemm, CHOLQR_MAX_DIAG_RATIO, CHOLQR_MAX_GRAM2_DEVIATION,
                                             _first_order_max(A.shape[1]), *_draw_args(draw))
        return out
    B = scratch if scratch is not None else torch.empty_like(A)
    Linv, bad = _chol_inverse(_gram(A, gemm), near_identity=False)
    _bmm(Linv.to(gemm), A, B, gemm)
    Linv, bad2 = _near_identity_chol_inverse(_gram(B, gemm))
    bad |= bad2
    fallback = None
    if bool(bad.any()):  # decided before ``out`` (which may alias A) is written
        idx = bad.nonzero().flatten()
        sub = A.index_select(0, idx)
        fallback = (idx, _householder_(sub, torch.empty_like(sub)))
    _bmm(Linv, B, out, gemm)
    if fallback is not None:
        out.index_copy_(0, *fallback)
    return out


def _cubic_coefficients(lower: torch.Tensor):
    """(alpha, beta, new_lower) of the minimax odd cubic ``alpha x - beta x^3`` on ``[lower, 1]``,
    scaled so its maximum on the interval is 1 (float64 tensors)."""
    l = lower.clamp(0.0, 1.0)
    s = 1.0 + l + l * l
    beta = 2.0 / ((2.0 / (3.0 * math.sqrt(3.0))) * s.pow(1.5) + l + l * l)
    alpha = beta * s
    low_img = beta * (l + l * l)             # p(l) = p(1) = 1 - E
    high_img = 2.0 - low_img                 # p(x*) = 1 + E
    return alpha / high_img, beta / high_img, low_img / high_img


def polar_tol(n: int) -> float:
    """Target of the polar iteration: 1e-6, or the fp32 rounding floor of a length-n Gram entry."""
    return max(POLAR_TOL, 4.0 * _U32 * math.sqrt(n))


def _polar_scale(G: torch.Tensor):
    """(1/sigma_max, sigma_min/sigma_max lower bound) per block from the Gram G = W W^T."""
    m = G.shape[-1]
    if m <= POLAR_EXACT_SCALE_MAX_M:
        lam = torch.linalg.eigvalsh(G.double())
        top = lam[:, -1].clamp_min(POLAR_MIN_TOP)
        smax = top.sqrt() * (1.0 + 1e-4)   # headroom for the fp32 rounding of the Gram
        lower = (lam[:, 0].clamp_min(0.0) / top).sqrt() * (1.0 - 1e-3)
    else:
        G64 = G.double()
        bound = torch.minimum(G64.flatten(1).norm(dim=1), G64.abs().sum(-1).amax(-1))
        smax = bound.clamp_min(POLAR_MIN_TOP).sqrt()
        lower = torch.full_like(smax, POLAR_DEFAULT_LOWER)
    return 1.0 / smax, lower


def polar_iterate_(A: torch.Tensor, out: torch.Tensor, gram, step, scratch: Optional[torch.Tensor],
                   gemm: torch.dtype):
    """The polar iteration with pluggable GEMMs: ``gram(X) -> X X^T`` and
    ``step(X, G, alpha, beta, Y)``: ``Y = alpha X + beta G X`` (alpha, beta: fp32 [C]). ``gemm``:
    the GEMM dtype of the SVD that finishes blocks which do not converge."""
    C, m, n = A.shape
    tol = polar_tol(n)
    eye = _eye(m, A.device, torch.float32)
    G = gram(A)
    scale, lower = _polar_scale(G)
    # X_0 = scale * A is folded into the first step: Y = scale (alpha I + beta scale^2 G) A.
    G = G * (scale * scale).to(G.dtype)[:, None, None]
    X, Y = A, scratch if scratch is not None else torch.empty_like(A)
    # Per-block step budget: the block's own schedule (until its interval [l, 1] has closed) plus a
    # few Newton-Schulz polish steps; nothing depends on the other blocks of the chunk.
    limit = torch.zeros(C, dtype=torch.int64, device=A.device)
    l = lower.clone()
    for _ in range(60):
        open_ = l < 1.0 - 1e-9
        if not bool(open_.any()):
            break
        limit += open_
        l = torch.where(open_, _cubic_coefficients(l)[2], l)
    limit += POLAR_EXTRA_STEPS
    l = lower
    done = torch.zeros(C, dtype=torch.bool, device=A.device)
    steps = 0
    while True:
        if steps:
            G = gram(X)
            done |= (G - eye).abs().flatten(1).amax(1) <= tol
        active = ~done & (limit > steps)
        if not bool(active.any()):
            break
        alpha, beta, l = _cubic_coefficients(l)
        if steps == 0:
            alpha, beta = alpha * scale, beta * scale
        # finished blocks take the exact identity step alpha = 1, beta = 0
        alpha = torch.where(active, alpha, 1.0).float()
        beta = torch.where(active, -beta, 0.0).float()
        step(X, G, alpha, beta, Y)
        X, Y = Y, X
        steps += 1
    if not bool(done.all()):
        # X_k = p_k(A A^T) A has A's singular vectors, so its polar factor is A's: finish by SVD
        idx = (~done).nonzero().flatten()
        sub = X.index_select(0, idx)
        X.index_copy_(0, idx, _svd_(sub, torch.empty_like(sub), gemm))
    if X.data_ptr() != out.data_ptr():
        out.copy_(X)
    return out


def _polar_(A: torch.Tensor, out: torch.Tensor, scratch: Optional[torch.Tensor],
            gemm: torch.dtype) -> torch.Tensor:
    def step(X, G, alpha, beta, Y):
        M = G * beta.to(G.dtype)[:, None, None]
        M.diagonal(dim1=-2, dim2=-1).add_(alpha.to(G.dtype)[:, None])
        _bmm(M, X, Y, gemm)

    return polar_iterate_(A, out, lambda X: _gram(X, gemm), step, scratch, gemm)


def draws_inside(A: torch.Tensor, method: str) -> bool:
    """Whether :func:`torch_chunk` can draw the chunk's Gaussians itself (its ``draw`` argument):
    the factorizations that run on the native per-block kernels, which draw each block on the
    thread that factors it (one OpenMP team per chunk instead of two)."""
    return method in ("householder", "svd", "cholqr2") and _per_block_lapack(A)


def _draw_args(draw):
    if draw is None:
        return ()
    seed, rows = draw
    return rows, seed & 0xFFFFFFFF, seed >> 32


def torch_chunk(A: torch.Tensor, method: str, out: torch.Tensor, scratch: Optional[torch.Tensor],
                 gemm: torch.dtype, draw=None) -> torch.Tensor:
    """One chunk, PyTorch math (the ``torch`` backend). ``draw`` = ``(seed, rows)``, only where
    :func:`draws_inside` holds: A's contents are ignored and block ``b`` is first drawn as
    ``condinit_C::philox_randn`` draws block ``rows[b, 1]`` of stream ``rows[b, 0]`` (int64 ``[C,
    2]``) under ``seed``."""
    if draw is not None and not draws_inside(A, method):
        raise ValueError(f"torch_chunk: draw= needs the native per-block kernels, not method {method!r} here")
    if method == "householder":
        return _householder_(A, out, draw)
    if method == "svd":
        return _svd_(A, out, gemm, draw)
    if method == "cholqr2":
        return _cholqr2_(A, out, scratch, gemm, draw)
    return _polar_(A, out, scratch, gemm)
