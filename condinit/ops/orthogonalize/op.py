"""Batched orthogonalization of per-head blocks: the core of conditioned initialization.

A stack ``W`` of ``B`` blocks ``m x n`` is mapped to blocks with orthonormal rows (``m <= n``,
``Q Q^T = I_m``) or orthonormal columns (``m > n``, ``Q^T Q = I_n``). Every method below works on
the *wide* orientation (``m <= n``); a tall block is handled as its transpose. Methods
(docs/design.md, "Orthogonalization"):

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

Precision: the GEMMs are IEEE fp32. When the caller's torch settings let fp32 matmuls on the
device run in TF32 or bf16 (``torch.set_float32_matmul_precision("high")`` or ``"medium"``,
``torch.backends.cuda.matmul.allow_tf32``, the ``fp32_precision`` settings of ``torch.backends``),
which would leave ``|Q Q^T - I| ~ 1e-3``, the GEMMs run in float64 instead, which those settings
never touch, each result rounded to fp32 once. The settings are read, never changed.

Determinism: every block's result depends only on its own data, never on how many or which other
blocks were processed with it: on GPUs blocks run in chunks of a fixed number of blocks (a
function of the block shape, the memory budget and the GEMM precision above; a short chunk is
padded with copies of a real block), on the CPU in chunks of at least 2 blocks (MKL's batched GEMM
gives the same per-block bits for every batch size >= 2), each chunk on one thread; see
:func:`run_chunks`.

Thread count: on the CPU every Householder and SVD factorization runs on one MKL thread and a
chunk's blocks are spread over the caller's threads, so those bits do not depend on
``torch.get_num_threads()`` either (:func:`_lapack_per_block`); the GEMM-based methods were
measured independent of it.

Backends (the ``orthogonalize`` table of :mod:`condinit._backends`): ``torch`` runs the chunks one
after the other on the calling thread with the caller's thread settings (no process setting is
changed); ``triton`` runs ``polar`` with the Triton GEMMs, one chunk after the other. Chunk
buffers come from a small CPU workspace kept between calls (:class:`_Workspace`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from typing import Callable, Optional

import torch

from condinit import _backends
from condinit._validate import check_choice, check_int, check_no_internal_overlap, check_tensor, overlaps

__all__ = ["orthogonalize", "METHODS", "ORTHOGONALIZE", "resolve_method", "chunk_blocks",
           "gemm_dtype", "run_chunks"]

METHODS = ("auto", "householder", "cholqr2", "polar", "svd")

# auto: CholeskyQR2 when the long side is at least this many times the short side.
CHOLQR_MIN_ASPECT = 4
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

# Default scratch budget per chunk buffer (bytes): CPU chunks stay cache-sized, GPU chunks are big.
DEFAULT_BUDGET = {"cpu": 16 << 20, "cuda": 1 << 30}
MAX_CHUNK_BLOCKS = {"cpu": 64}  # per device type (default 256): bounds the padding work of a short call
# float64 GEMMs take float64 copies of their operands and result: chunks that many times smaller.
FLOAT64_GEMM_MEMORY_FACTOR = 3
_U32 = 2.0 ** -24
# orthogonalize: a block whose largest |entry| is outside this range is first scaled by a power of 2
# (exact) to bring it to [0.5, 1): the result is scale invariant, and the fp32 Gram of an unscaled
# 1e19 block overflows, that of a 1e-30 block underflows. Blocks inside it (Gaussians) are untouched.
SAFE_PEAK = (2.0 ** -32, 2.0 ** 32)
# polar: the largest Gram eigenvalue used for the 1/sigma_max scale is at least this, so the fp32
# scale**2 stays finite (a zero block keeps X = 0 and ends in the SVD fallback).
POLAR_MIN_TOP = 2.0 ** -120


# ---------------------------------------------------------------------------------------------------
# helpers shared with condinit.init.functional

def resolve_method(m: int, n: int, method: str) -> str:
    """The concrete method ``"auto"`` stands for, for an ``m x n`` block."""
    if method != "auto":
        return method
    small, big = min(m, n), max(m, n)
    return "cholqr2" if big >= CHOLQR_MIN_ASPECT * small and small >= 2 else "householder"


def gemm_dtype(device_type: str) -> torch.dtype:
    """The dtype of the GEMMs on ``device_type``: float32 while the caller's settings keep fp32
    matmuls IEEE, else float64 (module docstring, "Precision"). Reads the settings only."""
    getter = getattr(torch._C, "_get_fp32_precision_getter", None)
    if getter is not None:
        # Per-backend settings (torch >= 2.9), each "none" until set: it then inherits its parent's.
        backend = {"cuda": "cuda", "cpu": "mkldnn"}.get(device_type)
        chain = ([(backend, "matmul"), (backend, "all")] if backend else []) + [("generic", "all")]
        precision = next((p for p in (getter(b, op) for b, op in chain) if p != "none"), "ieee")
        reduced = precision != "ieee"
    else:
        reduced = torch.get_float32_matmul_precision() != "highest" or (
            device_type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
    return torch.float64 if reduced else torch.float32


def chunk_blocks(m: int, n: int, device_type: str, memory_budget: Optional[int] = None,
                 gemm: torch.dtype = torch.float32) -> int:
    """Blocks per chunk for ``m x n`` blocks: ``memory_budget`` bytes of fp32 per scratch buffer
    (less with float64 GEMMs), at least 2 (a batch of one takes a different BLAS path, hence other
    bits)."""
    if memory_budget is None:
        memory_budget = DEFAULT_BUDGET.get(device_type, DEFAULT_BUDGET["cuda"])
    per_block = 4 * m * n * (FLOAT64_GEMM_MEMORY_FACTOR if gemm == torch.float64 else 1)
    return max(2, min(MAX_CHUNK_BLOCKS.get(device_type, 256), int(memory_budget) // per_block))


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


def _torch_chunk(A: torch.Tensor, method: str, out: torch.Tensor, scratch: Optional[torch.Tensor],
                 gemm: torch.dtype) -> torch.Tensor:
    """One chunk, PyTorch math (the ``torch`` backend)."""
    if method == "householder":
        return _householder_(A, out)
    if method == "svd":
        return _svd_(A, out, gemm)
    if method == "cholqr2":
        return _cholqr2_(A, out, scratch, gemm)
    return _polar_(A, out, scratch, gemm)


def _triton_chunk(A: torch.Tensor, method: str, out: torch.Tensor, scratch: Optional[torch.Tensor],
                  gemm: torch.dtype) -> torch.Tensor:
    """One chunk of ``polar`` with the Triton GEMMs (IEEE fp32 whatever the torch settings)."""
    from condinit.kernels.orthogonalize import polar as kpolar
    return polar_iterate_(A, out, kpolar.gram, kpolar.step, scratch, gemm)


# ---------------------------------------------------------------------------------------------------
# chunking: one job per call, run by the chosen backend

class _Workspace:
    """Chunk buffers kept between calls on the CPU.

    A call that initializes one weight (``semi_orthogonal_`` per tensor, as ``torch.nn.init``
    users and model ``init_weights`` loops call it) would otherwise allocate and first-touch two
    fresh chunk buffers (16 MiB each by default) per call, which costs as much as a good part of
    the factorization itself. Up to ``KEEP`` free buffers of at most ``MAX_KEPT_BYTES`` each stay
    allocated for the next call (a few tens of MiB, like a BLAS workspace); bigger ones (a
    ``memory_budget`` above the default) are freed. On GPUs the caching allocator already does
    this, so buffers there are plain allocations. Thread safe: concurrent calls take different
    buffers."""

    KEEP = 3
    MAX_KEPT_BYTES = 2 * DEFAULT_BUDGET["cpu"]

    def __init__(self):
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, numel: int, device: torch.device) -> torch.Tensor:
        """A flat float32 tensor of at least ``numel`` elements (contents arbitrary)."""
        if device.type == "cpu":
            with self._lock:
                fits = [i for i, t in enumerate(self._free) if t.numel() >= numel]
                if fits:
                    return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(numel, dtype=torch.float32, device=device)

    def give(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu" or 4 * t.numel() > self.MAX_KEPT_BYTES:
            return
        with self._lock:
            self._free.append(t)
            if len(self._free) > self.KEEP:   # keep the largest
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))


_WORKSPACE = _Workspace()


@dataclasses.dataclass
class _Job:
    """``num_blocks`` blocks of wide shape ``shape`` split into ``chunks`` ([start, stop) ranges).

    ``fill(start, stop, A)`` writes the inputs of blocks [start, stop) into ``A``; ``sink(start,
    stop, R)`` receives their results; ``direct(start, stop)`` may return a contiguous fp32 tensor
    to write a whole chunk's result into (then ``sink`` is not called for it)."""
    method: str
    shape: tuple[int, int]
    device: torch.device
    chunks: list[tuple[int, int]]
    rows: int                      # blocks per chunk buffer
    padded: Optional[int]          # GPUs: every chunk is padded to exactly this many blocks
    gemm: torch.dtype
    fill: Callable
    sink: Callable
    direct: Optional[Callable]
    width: int = 0                 # columns of the work buffer: n, or n rounded up (see buffers)

    def __post_init__(self):
        m, n = self.shape
        # MKL's kernels give different bits for a block depending on its address modulo 64 bytes,
        # and in a [C, m, n] buffer block i starts at i*m*n floats: unless m*n is a multiple of
        # 16, the same block would get other bits at another position in its chunk (so sharded,
        # chunked and whole-model runs would differ). On the CPU the work buffer therefore has n
        # rounded up to a multiple of 16, the extra columns zero: every block and row is aligned,
        # and zero columns change nothing in the math (Gram, triangular apply, polar steps and
        # QR of A^T keep them exactly zero).
        self.width = (n + 15) // 16 * 16 if self.device.type == "cpu" else n

    @contextlib.contextmanager
    def buffers(self):
        """One worker's chunk buffer and scratch (and, with padded columns, a staging buffer),
        taken from the CPU workspace (:class:`_Workspace`) for the ``with`` block. Their contents
        on entry are arbitrary: :meth:`run` writes every element it reads."""
        m, n = self.shape
        shapes = [(self.rows, m, self.width)]
        if self.method in ("cholqr2", "polar"):
            shapes.append((self.rows, m, self.width))
        if self.width != n:
            shapes.append((self.rows, m, n))
        taken = [_WORKSPACE.take(math.prod(shape), self.device) for shape in shapes]
        try:
            views = [t[:math.prod(shape)].view(shape) for t, shape in zip(taken, shapes)]
            A = views[0]
            scratch = views[1] if self.method in ("cholqr2", "polar") else None
            staging = views[-1] if self.width != n else None
            yield A, scratch, staging
        finally:
            for t in taken:
                _WORKSPACE.give(t)

    def run(self, index: int, buffers, chunk_math: Callable) -> None:
        """Chunk ``index``, in ``buffers``, by ``chunk_math`` (:func:`_torch_chunk` or
        :func:`_triton_chunk`)."""
        start, stop = self.chunks[index]
        k = stop - start
        if self.padded is not None:
            size = self.padded
        else:  # CPU: at least 2 blocks, except for the methods LAPACK runs matrix by matrix
            size = k if self.method in ("householder", "svd") else max(2, k)
        A_full, S_full, staging = buffers
        A = A_full[:size]
        S = S_full[:size] if S_full is not None else None
        n = self.shape[1]
        if staging is None:
            self.fill(start, stop, A[:k])
        else:
            self.fill(start, stop, staging[:k])
            A[:k, :, :n].copy_(staging[:k])
            A[:k, :, n:].zero_()
        if k < size:  # pad with copies of a real block; their results are discarded
            A[k:].copy_(A[k - 1:k].expand(size - k, *A.shape[1:]))
        dest = (self.direct(start, stop) if (self.direct is not None and k == size and staging is None)
                else None)
        chunk_math(A, self.method, dest if dest is not None else A, S, self.gemm)
        if dest is None:
            self.sink(start, stop, A[:k] if staging is None else staging[:k].copy_(A[:k, :, :n]))


def _plan(num_blocks: int, block_shape, method: str, device: torch.device, fill, sink, direct,
          memory_budget, breaks) -> _Job:
    m, n = block_shape
    gemm = gemm_dtype(device.type)
    C = chunk_blocks(m, n, device.type, memory_budget, gemm)
    cpu = device.type == "cpu"
    cuts = sorted(set(b for b in breaks if 0 < b < num_blocks)) if cpu else []
    chunks = []
    start, ci = 0, 0
    while start < num_blocks:
        while ci < len(cuts) and cuts[ci] <= start:
            ci += 1
        stop = min(num_blocks, start + C, cuts[ci] if ci < len(cuts) else num_blocks)
        chunks.append((start, stop))
        start = stop
    rows = min(C, max(2, num_blocks)) if cpu else C
    return _Job(method, (m, n), device, chunks, rows, None if cpu else C, gemm, fill, sink, direct)


def run_chunks(num_blocks: int, block_shape, method: str, device, fill, sink, *,
               memory_budget=None, backend=None, direct=None, breaks=()) -> None:
    """Orthogonalize ``num_blocks`` blocks of wide shape ``block_shape`` chunk by chunk.

    ``fill(start, stop, A)`` writes the inputs of blocks [start, stop) into ``A`` (contiguous fp32
    ``[stop-start, m, n]``); ``sink(start, stop, R)`` receives their orthonormalized fp32 results.
    ``direct(start, stop)`` may return a contiguous fp32 tensor to write a whole chunk's result into
    (then ``sink`` is not called for it). ``breaks``: block offsets where, on the CPU, a chunk should
    end (destination boundaries, so that chunks can be written directly). The callbacks of
    different chunks may run concurrently (CPU) and must touch disjoint memory. ``method`` is
    concrete (not ``"auto"``); ``backend`` is chosen here, once for the whole call.

    Batched BLAS may pick another algorithm for another batch size (and on the CPU a batch of one
    goes through a multithreaded GEMM): on GPUs every chunk is padded to exactly
    ``chunk_blocks(...)`` blocks with copies of a real block. On the CPU (MKL) every batch size >= 2
    was measured to give the same per-block bits (tests/test_orthogonalize.py checks it), so chunks
    there are at most that long, split at ``breaks``, and padded to 2 blocks only (not at all for
    Householder and SVD, which LAPACK runs matrix by matrix).

    CPU parallelism: the chunks run one after the other with the caller's intra-op threads; no
    thread or precision setting of the process changes. (Running whole chunks single-threaded in
    one OpenMP region was faster on small shared machines, but MKL LAPACK calls inside such a
    region deadlocked once torch.set_num_threads had turned MKL's dynamic threading off.) The
    LAPACK factorizations inside a chunk (Householder, SVD) run one MKL thread each on worker
    threads of their own (:func:`_lapack_per_block`): no OpenMP region is nested.
    """
    device = torch.device(device)
    name = ORTHOGONALIZE.choose(device, backend, method=method)
    ORTHOGONALIZE(name, _plan(num_blocks, block_shape, method, device, fill, sink, direct,
                              memory_budget, breaks))


# ---------------------------------------------------------------------------------------------------
# backends: op "orthogonalize", one argument (the _Job)

# What each backend runs (one table: the choice and `condinit info` read it).
ORTHOGONALIZE = _backends.Op("orthogonalize")


@ORTHOGONALIZE.register("torch", devices=(_backends.ANY_DEVICE,))
def _orthogonalize_torch(job: _Job) -> None:
    with job.buffers() as buffers:
        for index in range(len(job.chunks)):
            job.run(index, buffers, _torch_chunk)


@ORTHOGONALIZE.register("triton", devices=("cuda", "cpu"), limits={"method": ("polar",)})
def _orthogonalize_triton(job: _Job) -> None:
    with job.buffers() as buffers:   # one chunk at a time: the Triton interpreter is not thread-safe
        for index in range(len(job.chunks)):
            job.run(index, buffers, _triton_chunk)


# ---------------------------------------------------------------------------------------------------
# public API

@torch.no_grad()  # an initializer, not a differentiable op
def orthogonalize(stack: torch.Tensor, method: str = "auto", *, out: Optional[torch.Tensor] = None,
                  backend: Optional[str] = None, memory_budget: Optional[int] = None) -> torch.Tensor:
    """Orthonormalize every block of ``stack`` ``[..., m, n]`` (``[m, n]`` is one block).

    Rows become orthonormal when ``m <= n`` (``Q Q^T = I_m``), columns when ``m > n``. Computed in
    fp32 (float64 for the small ``m x m`` factorizations, and for the GEMMs when the caller allows
    reduced-precision fp32 matmuls) and rounded once into the output dtype. Each block's result
    depends only on that block (docs/design.md, "Orthogonalization").

    Args:
        stack: real floating tensor, ``ndim >= 2``, finite.
        method: ``"auto"``, ``"householder"``, ``"cholqr2"``, ``"polar"`` or ``"svd"`` (module
            docstring).
        out: optional output of ``stack``'s shape and device (any floating dtype, any strides
            whose elements do not share memory); ``stack`` itself (in place) or memory disjoint
            from it; default a new tensor like ``stack``.
        backend: force a backend of the ``"orthogonalize"`` op (``"torch"``, ``"triton"``);
            default automatic (:mod:`condinit._backends`).
        memory_budget: bytes of fp32 scratch per chunk buffer (default 16 MiB on CPU, 1 GiB on GPU).

    Returns ``out``.

    Examples:
        >>> W = torch.randn(8, 64, 2048)            # 8 blocks of 64 x 2048
        >>> Q = orthogonalize(W)                     # rows of every block orthonormal
        >>> torch.allclose(Q[0] @ Q[0].T, torch.eye(64), atol=1e-5)
        True
        >>> orthogonalize(torch.randn(300, 20), "householder").shape   # tall: columns
        torch.Size([300, 20])
    """
    check_tensor("stack", stack, floating=True, min_dim=2)
    check_choice("method", method, METHODS)
    check_tensor("out", out, floating=True, allow_none=True)
    check_choice("backend", backend, _backends.BACKENDS + ("auto",), allow_none=True)
    check_int("memory_budget", memory_budget, min=1, allow_none=True)
    if any(s == 0 for s in stack.shape):
        raise ValueError(f"stack must not have a zero-size dim, got shape {tuple(stack.shape)}")
    if out is not None and (out.shape != stack.shape or out.device != stack.device):
        raise ValueError(f"out must have stack's shape {tuple(stack.shape)} and device {stack.device}, "
                         f"got {tuple(out.shape)} on {out.device}")
    if out is not None:
        check_no_internal_overlap("out", out)
        in_place = (out.data_ptr() == stack.data_ptr() and out.dtype == stack.dtype
                    and out.stride() == stack.stride())
        if not in_place and overlaps(out, stack):
            raise ValueError("out overlaps stack in memory without being stack itself: pass stack "
                             "(in place) or a tensor with its own memory")
    m, n = stack.shape[-2:]
    tall = m > n
    wm, wn = (n, m) if tall else (m, n)
    concrete = resolve_method(wm, wn, method)
    name = ORTHOGONALIZE.choose(stack.device, backend, method=concrete)
    if out is None:
        out = torch.empty_like(stack)
    if stack.device.type == "meta":
        return out
    src = stack.reshape(-1, m, n)
    if tall:
        src = src.transpose(1, 2)
    num = src.shape[0]
    peak = src.abs().amax(dim=(1, 2))   # NaN when a block holds NaN: one pass for both checks
    if not bool(torch.isfinite(peak).all()):
        raise ValueError("stack must be finite (it holds NaN or Inf)")
    rescale = (peak > 0) & ((peak < SAFE_PEAK[0]) | (peak > SAFE_PEAK[1]))
    factors = None
    if bool(rescale.any()):
        # 2**-e with peak = f 2**e, f in [0.5, 1): exact in float64 for every input dtype
        exponent = torch.frexp(peak.double()).exponent
        factors = torch.where(rescale, torch.ldexp(torch.ones_like(peak, dtype=torch.float64), -exponent),
                              1.0)[:, None, None]
    # results go straight into ``out`` when it is a contiguous fp32 wide stack, else via a buffer
    fast = out.dtype == torch.float32 and out.is_contiguous() and not tall
    res = out.view(-1, m, n) if fast else torch.empty((num, wm, wn), dtype=torch.float32, device=stack.device)

    def fill(start, stop, A):
        if factors is None:
            A.copy_(src[start:stop])
        else:
            A.copy_(src[start:stop] * factors[start:stop])

    def sink(start, stop, R):
        res[start:stop].copy_(R)

    ORTHOGONALIZE(name, _plan(num, (wm, wn), concrete, stack.device, fill, sink,
                              lambda start, stop: res[start:stop], memory_budget, ()))
    if not fast:
        out.copy_((res.transpose(1, 2) if tall else res).reshape(stack.shape))
    return out
