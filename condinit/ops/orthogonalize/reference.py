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
"""
from __future__ import annotations

import math
import threading
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


def _householder_(A: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return _lapack_per_block(_householder_serial_, A, out)


def _svd_serial_(A: torch.Tensor, out: torch.Tensor, gemm: torch.dtype) -> torch.Tensor:
    U, _, Vh = torch.linalg.svd(A, full_matrices=False)   # U [C, m, m], Vh [C, m, n]
    return _bmm(U, Vh, out, gemm)


def _svd_(A: torch.Tensor, out: torch.Tensor, gemm: torch.dtype) -> torch.Tensor:
    return _lapack_per_block(lambda a, o: _svd_serial_(a, o, gemm), A, out)


# ---------------------------------------------------------------------------------------------------
# LAPACK on the CPU: one thread per factorization, the batch spread over the caller's threads
#
# MKL's multithreaded QR and SVD reduce in an order that depends on the number of threads, so the
# same block gets other bits with 1 and with 2 torch threads. Each factorization therefore runs on
# one MKL thread (``mkl_set_num_threads_local``: a setting of the calling thread only, restored
# after; no process-wide setting changes), and a chunk's blocks are split over up to
# ``torch.get_num_threads()`` worker threads, so a batch still uses the caller's cores. LAPACK
# factors the matrices of a batch one by one, so a block's bits do not depend on which sub-batch
# it lands in. Where torch is not built with MKL the LAPACK call runs as torch runs it (the bits
# may then depend on the thread count).

class _MKLThreads:
    """``MKL_Set_Num_Threads_Local`` / ``MKL_Get_Max_Threads`` of the MKL inside torch, or
    unavailable (``self.set is None``) when torch has no MKL or does not export them."""

    def __init__(self):
        self.set = self.get = None
        if not torch.backends.mkl.is_available():
            return
        import ctypes
        import os
        candidates = [os.path.join(os.path.dirname(torch.__file__), "lib", name)
                      for name in ("libtorch_cpu.so", "libtorch_cpu.dylib")]
        for path in [p for p in candidates if os.path.exists(p)] + [None]:
            try:
                lib = ctypes.CDLL(path)
                set_local, get_max = lib.MKL_Set_Num_Threads_Local, lib.MKL_Get_Max_Threads
            except (OSError, AttributeError):
                continue
            set_local.restype, set_local.argtypes = ctypes.c_int, [ctypes.c_int]
            get_max.restype, get_max.argtypes = ctypes.c_int, []
            self.set, self.get = set_local, get_max
            return


_MKL: Optional[_MKLThreads] = None
_POOL = None
_POOL_WORKERS = 0
_POOL_LOCK = threading.Lock()
# elements of the warm-up fill: above ATen's parallel grain size, so it opens an OpenMP region
_WARM_NUMEL = 1 << 16


def _mkl() -> _MKLThreads:
    global _MKL
    if _MKL is None:
        _MKL = _MKLThreads()
    return _MKL


def _one_mkl_thread(fn, A: torch.Tensor, out: torch.Tensor) -> None:
    """``fn(A, out)`` with MKL on one thread (this thread's setting only, restored after).

    GNU OpenMP drops the thread-local MKL setting when the calling thread's OpenMP team is first
    created or grows inside the call (torch's own parallel copies before the LAPACK call do
    that), which MKL reports afterwards: an OpenMP region is opened first (a warm-up fill of the
    caller's team size), and a call that lost the setting all the same is recomputed."""
    mkl = _mkl()
    for _ in range(2):
        torch.empty(_WARM_NUMEL).fill_(0.0)
        previous = mkl.set(1)
        try:
            fn(A, out)
            kept = mkl.get() == 1
        finally:
            mkl.set(previous)
        if kept:
            return
    raise RuntimeError("MKL did not keep one thread for the LAPACK call (its bits would depend on "
                       "the thread count)")


def _worker_pool(workers: int):
    """The LAPACK worker threads, at least ``workers`` of them (kept for later calls)."""
    global _POOL, _POOL_WORKERS
    with _POOL_LOCK:
        if _POOL is None or _POOL_WORKERS < workers:
            from concurrent.futures import ThreadPoolExecutor
            if _POOL is not None:
                _POOL.shutdown(wait=False)   # its running tasks finish; new ones go to the new pool
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="condinit-lapack")
            _POOL_WORKERS = workers
        return _POOL


def _lapack_per_block(fn, A: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``fn(A, out)`` (a batched LAPACK factorization, block by block) with bits independent of the
    thread count on the CPU: single-threaded MKL per factorization, the batch split over the
    caller's threads (see above). Elsewhere ``fn`` runs as is."""
    if A.device.type != "cpu" or _mkl().set is None:
        return fn(A, out)
    C = A.shape[0]
    workers = min(C, torch.get_num_threads())
    if workers <= 1:
        _one_mkl_thread(fn, A, out)
        return out
    cuts = [C * i // workers for i in range(workers + 1)]
    grad = torch.is_grad_enabled()

    def part(i):
        with torch.set_grad_enabled(grad):
            _one_mkl_thread(fn, A[cuts[i]:cuts[i + 1]], out[cuts[i]:cuts[i + 1]])

    pool = _worker_pool(workers - 1)
    futures = [pool.submit(part, i) for i in range(1, workers)]
    try:
        part(0)   # the calling thread takes the first part
    finally:
        for f in futures:
            f.result()   # waits for every part; re-raises a worker's exception here
    return out


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
    first_order_ok = dev <= min(1e-5, math.sqrt(1e-9 / m))
    F = E.tril(-1)
    F.diagonal(dim1=-2, dim2=-1).copy_(E.diagonal(dim1=-2, dim2=-1) * 0.5)
    Linv = eye - F
    if bool(first_order_ok.all()):
        return Linv, torch.zeros_like(first_order_ok)
    exact, bad = _chol_inverse(G, near_identity=True)
    return torch.where(first_order_ok[:, None, None], Linv, exact.to(G.dtype)), bad & ~first_order_ok


def _cholqr2_(A: torch.Tensor, out: torch.Tensor, scratch: Optional[torch.Tensor],
              gemm: torch.dtype) -> torch.Tensor:
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


def torch_chunk(A: torch.Tensor, method: str, out: torch.Tensor, scratch: Optional[torch.Tensor],
                 gemm: torch.dtype) -> torch.Tensor:
    """One chunk, PyTorch math (the ``torch`` backend)."""
    if method == "householder":
        return _householder_(A, out)
    if method == "svd":
        return _svd_(A, out, gemm)
    if method == "cholqr2":
        return _cholqr2_(A, out, scratch, gemm)
    return _polar_(A, out, scratch, gemm)
