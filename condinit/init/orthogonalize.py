"""Batched orthogonalization of per-head blocks: the core of conditioned initialization.

A stack ``W`` of ``B`` blocks ``m x n`` is mapped to blocks with orthonormal rows (``m <= n``,
``Q Q^T = I_m``) or orthonormal columns (``m > n``, ``Q^T Q = I_n``). Every method below works on
the *wide* orientation (``m <= n``); a tall block is handled as its transpose. Methods
(DESIGN.md section 5):

``householder``
    ``W^T = Q R`` (``torch.linalg.qr``) with the sign fix ``diag(R) > 0``, i.e. ``W = R^T Q^T``.
    Exact and backward stable for any conditioning. Of a Gaussian block this ``Q`` is Haar
    distributed (Mezzadri 2007); without the sign fix it is not.
``cholqr2``
    CholeskyQR2: ``G = W W^T`` (fp32 batched GEMM), ``L = chol(G)`` in float64 (``m x m``, tiny),
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
    (``condinit.kernels.polar``).
``svd``
    ``U V^T`` from ``torch.linalg.svd``: the paper's own construction, the reference.
``auto``
    ``cholqr2`` for wide (or tall) blocks with aspect ratio ``>= 4`` (well-conditioned when
    Gaussian), ``householder`` otherwise (measured fastest on CPU; see benchmarks/bench_init.py).

Polar and SVD give the polar factor, QR and CholeskyQR the Q factor: different matrices, the same
(Haar) distribution for Gaussian input.

Determinism: every block's result depends only on its own data, never on how many or which other
blocks were processed with it: on GPUs blocks run in chunks of a fixed number of blocks (a
function of the block shape and the memory budget; a short chunk is padded with copies of a real
block), on the CPU in chunks of at least 2 blocks run single-threaded (MKL's batched GEMM gives
the same per-block bits for every batch size >= 2); see :func:`run_chunks`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from condinit import _backends

__all__ = ["orthogonalize", "METHODS", "resolve_method", "chunk_blocks", "orthogonalize_wide_"]

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
_U32 = 2.0 ** -24


# ---------------------------------------------------------------------------------------------------
# helpers shared with condinit.init.functional

def check_method(method) -> str:
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method


def resolve_method(m: int, n: int, method: str) -> str:
    """The concrete method ``"auto"`` stands for, for an ``m x n`` block."""
    if method != "auto":
        return method
    small, big = min(m, n), max(m, n)
    return "cholqr2" if big >= CHOLQR_MIN_ASPECT * small and small >= 2 else "householder"


def chunk_blocks(m: int, n: int, device_type: str, memory_budget: Optional[int] = None) -> int:
    """Blocks per chunk for ``m x n`` blocks: ``memory_budget`` bytes of fp32 per scratch buffer,
    at least 2 (a batch of one takes a different BLAS path, hence other bits)."""
    if memory_budget is None:
        memory_budget = DEFAULT_BUDGET.get(device_type, DEFAULT_BUDGET["cuda"])
    return max(2, min(MAX_CHUNK_BLOCKS.get(device_type, 256), int(memory_budget) // (4 * m * n)))


class _small_lapack:
    """Run the tiny batched ``m x m`` factorizations single-threaded on the CPU.

    torch calls LAPACK once per matrix of a batch, and MKL opens a parallel region in every call:
    for 64 x 64 matrices the thread synchronization costs more than the work, and on a loaded
    machine a region can wait a whole scheduler tick (measured: 0.5 s instead of 0.2 ms for 16
    64 x 64 triangular inverses at load ~10 on 2 cores). Changes torch's (process-wide) intra-op
    thread count for the duration of the call."""

    def __init__(self, device: torch.device):
        self.cpu = device.type == "cpu"

    def __enter__(self):
        self.threads = torch.get_num_threads() if self.cpu else 1
        if self.threads != 1:
            torch.set_num_threads(1)
        return self

    def __exit__(self, *exc):
        if self.threads != 1:
            torch.set_num_threads(self.threads)
        return False


def _eye(m: int, device, dtype) -> torch.Tensor:
    return torch.eye(m, device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# the methods, on a contiguous fp32 chunk A [C, m, n], m <= n. ``A`` may be clobbered; the result is
# written to ``out`` (contiguous fp32 [C, m, n], may alias ``A``).

def _householder_(A: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    Q, R = torch.linalg.qr(A.transpose(1, 2))          # A^T = Q R, Q [C, n, m]
    d = R.diagonal(dim1=-2, dim2=-1)
    sign = torch.where(d < 0, -1.0, 1.0).to(Q.dtype)   # sign(0) := +1
    out.copy_((Q * sign.unsqueeze(1)).transpose(1, 2))
    return out


def _svd_(A: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    U, _, Vh = torch.linalg.svd(A, full_matrices=False)   # U [C, m, m], Vh [C, m, n]
    torch.bmm(U, Vh, out=out)
    return out


def _gram(X: torch.Tensor) -> torch.Tensor:
    return torch.bmm(X, X.transpose(1, 2))


def _chol_inverse(G: torch.Tensor, *, near_identity: bool):
    """``L^{-1}`` (fp32) of ``G = L L^T`` computed in float64, and a mask of blocks to redo."""
    G64 = G.double()
    with _small_lapack(G.device):
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
        Linv = torch.linalg.solve_triangular(L, eye, upper=False)
    return Linv.float(), bad


def _near_identity_chol_inverse(G: torch.Tensor):
    """``L^{-1}`` for ``G = I + E = L L^T`` with small ``E`` (the second CholeskyQR pass).

    ``L = I + F + O(m |E|^2)`` with ``F = tril(E, -1) + diag(E) / 2``, so ``L^{-1} = I - F`` to
    ``O(m |E|^2)``: below fp32 rounding when ``|E| <= sqrt(u64-ish / m)``, which a pass-1 result of a
    well-conditioned block satisfies (|E| ~ 1e-6). Other blocks take the float64 Cholesky."""
    m = G.shape[-1]
    eye = _eye(m, G.device, torch.float32)
    E = G - eye
    dev = E.abs().flatten(1).amax(1)
    first_order_ok = dev <= min(1e-5, math.sqrt(1e-9 / m))
    F = E.tril(-1)
    F.diagonal(dim1=-2, dim2=-1).copy_(E.diagonal(dim1=-2, dim2=-1) * 0.5)
    Linv = eye - F
    if bool(first_order_ok.all()):
        return Linv, torch.zeros_like(first_order_ok)
    exact, bad = _chol_inverse(G, near_identity=True)
    return torch.where(first_order_ok[:, None, None], Linv, exact), bad & ~first_order_ok


def _cholqr2_(A: torch.Tensor, out: torch.Tensor, scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    B = scratch if scratch is not None else torch.empty_like(A)
    G = _gram(A)
    with _small_lapack(A.device):   # everything on the m x m Grams: tiny, single-threaded
        Linv, bad = _chol_inverse(G, near_identity=False)
    torch.bmm(Linv, A, out=B)
    G = _gram(B)
    with _small_lapack(A.device):
        Linv, bad2 = _near_identity_chol_inverse(G)
        bad |= bad2
    fallback = None
    if bool(bad.any()):  # decided before ``out`` (which may alias A) is written
        idx = bad.nonzero().flatten()
        sub = A.index_select(0, idx)
        fallback = (idx, _householder_(sub, torch.empty_like(sub)))
    torch.bmm(Linv, B, out=out)
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
        with _small_lapack(G.device):
            lam = torch.linalg.eigvalsh(G.double())
        top = lam[:, -1].clamp_min(1e-300)
        smax = top.sqrt() * (1.0 + 1e-4)   # headroom for the fp32 rounding of the Gram
        lower = (lam[:, 0].clamp_min(0.0) / top).sqrt() * (1.0 - 1e-3)
    else:
        G64 = G.double()
        bound = torch.minimum(G64.flatten(1).norm(dim=1), G64.abs().sum(-1).amax(-1))
        smax = bound.clamp_min(1e-300).sqrt()
        lower = torch.full_like(smax, POLAR_DEFAULT_LOWER)
    return 1.0 / smax, lower


def polar_iterate_(A: torch.Tensor, out: torch.Tensor, gram, step, scratch: Optional[torch.Tensor] = None):
    """The polar iteration with pluggable GEMMs: ``gram(X) -> X X^T`` and
    ``step(X, G, alpha, beta, Y)``: ``Y = alpha X + beta G X`` (alpha, beta: fp32 [C])."""
    C, m, n = A.shape
    tol = polar_tol(n)
    eye = _eye(m, A.device, torch.float32)
    G = gram(A)
    scale, lower = _polar_scale(G)
    # X_0 = scale * A is folded into the first step: Y = scale (alpha I + beta scale^2 G) A.
    G = G * (scale * scale).float()[:, None, None]
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
        with _small_lapack(A.device):
            if steps:
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
        X.index_copy_(0, idx, _svd_(sub, torch.empty_like(sub)))
    if X.data_ptr() != out.data_ptr():
        out.copy_(X)
    return out


def _torch_step(X, G, alpha, beta, Y):
    M = G * beta[:, None, None]
    M.diagonal(dim1=-2, dim2=-1).add_(alpha[:, None])
    torch.bmm(M, X, out=Y)


def _polar_(A: torch.Tensor, out: torch.Tensor, scratch=None) -> torch.Tensor:
    return polar_iterate_(A, out, _gram, _torch_step, scratch)


_METHOD_FNS = {"householder": _householder_, "cholqr2": _cholqr2_, "polar": _polar_, "svd": _svd_}


# ---------------------------------------------------------------------------------------------------
# backend registry: op "orthogonalize", args (A, method, out, scratch)

# What each backend runs (one table: the choice and `condinit info` read it).
ORTHOGONALIZE = _backends.Op("orthogonalize")


@ORTHOGONALIZE.register("torch", devices=(_backends.ANY_DEVICE,))
def _orthogonalize_torch(A: torch.Tensor, method: str, out: torch.Tensor, scratch=None) -> torch.Tensor:
    fn = _METHOD_FNS[method]
    if method in ("cholqr2", "polar"):
        return fn(A, out, scratch)
    return fn(A, out)


@ORTHOGONALIZE.register("triton", devices=("cuda", "cpu"), limits={"method": ("polar",)})
def _orthogonalize_triton(A: torch.Tensor, method: str, out: torch.Tensor, scratch=None) -> torch.Tensor:
    from condinit.kernels import polar as kpolar
    return polar_iterate_(A, out, kpolar.gram, kpolar.step, scratch)


def orthogonalize_wide_(A: torch.Tensor, method: str, out: torch.Tensor, *, scratch=None,
                        backend: Optional[str] = None) -> torch.Tensor:
    """Orthonormalize the rows of the contiguous fp32 chunk ``A`` [C, m, n] (m <= n, C >= 2) into
    ``out``; ``A`` (and ``scratch``, like ``A``) may be clobbered. ``method`` is concrete (not auto)."""
    return ORTHOGONALIZE(ORTHOGONALIZE.choose(A.device, backend, method=method), A, method, out, scratch)


def run_chunks(num_blocks: int, block_shape, method: str, device, fill, sink, *,
               memory_budget=None, backend=None, direct=None, breaks=()):
    """Drive the chunked computation of ``num_blocks`` blocks of wide shape ``block_shape``.

    ``fill(start, stop, A)`` writes the inputs of blocks [start, stop) into ``A`` (contiguous fp32
    ``[stop-start, m, n]``); ``sink(start, stop, R)`` receives their orthonormalized fp32 results.
    ``direct(start, stop)`` may return a contiguous fp32 tensor to write a whole chunk's result into
    (then ``sink`` is not called for it). ``breaks``: block offsets where, on the CPU, a chunk should
    end (destination boundaries, so that chunks can be written directly). The callbacks of
    different chunks may run concurrently (CPU) and must touch disjoint memory.

    Batched BLAS may pick another algorithm for another batch size (and on the CPU a batch of one
    goes through a multithreaded GEMM): on GPUs every chunk is padded to exactly
    ``chunk_blocks(...)`` blocks with copies of a real block. On the CPU (MKL) every batch size >= 2
    was measured to give the same per-block bits (tests/test_orthogonalize.py checks it), so chunks
    there are at most that long, split at ``breaks``, and padded to 2 blocks only (not at all for
    Householder and SVD, which LAPACK runs matrix by matrix).

    CPU parallelism: ``torch.get_num_threads()`` workers each run whole chunks single-threaded
    (torch's intra-op thread count is set to 1 for the duration of the call, then restored). The
    GEMMs here are small (``m = 64``): one OpenMP region per GEMM costs a barrier per call, and on
    a loaded machine a barrier waits for a descheduled thread (measured on 2 shared cores: 2
    intra-op threads 4-20x slower than 1); independent chunks per worker need no barrier at all.
    """
    m, n = block_shape
    device = torch.device(device)
    C = chunk_blocks(m, n, device.type, memory_budget)
    cpu = device.type == "cpu"
    lapack = method in ("householder", "svd")
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

    def buffers():
        A = torch.empty((rows, m, n), dtype=torch.float32, device=device)
        return A, (torch.empty_like(A) if method in ("cholqr2", "polar") else None)

    def one(start, stop, A_full, S_full):
        k = stop - start
        size = (k if lapack else max(2, k)) if cpu else C
        A = A_full[:size]
        S = S_full[:size] if S_full is not None else None
        fill(start, stop, A[:k])
        if k < size:  # pad with copies of a real block; their results are discarded
            A[k:].copy_(A[k - 1:k].expand(size - k, m, n))
        dest = direct(start, stop) if (direct is not None and k == size) else None
        orthogonalize_wide_(A, method, dest if dest is not None else A, scratch=S, backend=backend)
        if dest is None:
            sink(start, stop, A[:k])

    # TF32 / bf16 GEMMs (torch.set_float32_matmul_precision("high")) would leave |Q Q^T - I| ~ 1e-3
    precision = torch.get_float32_matmul_precision()
    threads = torch.get_num_threads()
    workers = min(threads, len(chunks)) if cpu and not lapack else 1
    if workers > 1 and ORTHOGONALIZE.choose(device, backend, method=method) != "torch":
        workers = 1   # the Triton interpreter is not thread-safe
    torch.set_float32_matmul_precision("highest")
    if cpu and not lapack:
        torch.set_num_threads(1)   # also for one worker: the same bits whatever the chunk count
    try:
        if workers <= 1:
            bufs = buffers()
            for start, stop in chunks:
                one(start, stop, *bufs)
        else:
            _run_workers(workers, chunks, buffers, one)
    finally:
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(precision)


def _run_workers(workers, chunks, buffers, one):
    import threading
    from concurrent.futures import ThreadPoolExecutor
    lock = threading.Lock()
    todo = iter(chunks)

    def worker():
        torch.set_grad_enabled(False)  # grad mode is thread-local: weights may require grad
        bufs = buffers()
        while True:
            with lock:
                item = next(todo, None)
            if item is None:
                return
            one(*item, *bufs)

    with ThreadPoolExecutor(workers) as pool:
        for f in [pool.submit(worker) for _ in range(workers)]:
            f.result()


# ---------------------------------------------------------------------------------------------------
# public API

def _check_floating(t, name: str):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_complex() or not t.is_floating_point():
        raise TypeError(f"{name} must be a real floating-point tensor (float32/float64/bfloat16/"
                        f"float16), got dtype {t.dtype}")


@torch.no_grad()  # an initializer, not a differentiable op
def orthogonalize(stack: torch.Tensor, method: str = "auto", *, out: Optional[torch.Tensor] = None,
                  backend: Optional[str] = None, memory_budget: Optional[int] = None) -> torch.Tensor:
    """Orthonormalize every block of ``stack`` ``[..., m, n]`` (``[m, n]`` is one block).

    Rows become orthonormal when ``m <= n`` (``Q Q^T = I_m``), columns when ``m > n``. Computed in
    fp32 (float64 for the small ``m x m`` factorizations) and rounded once into the output dtype.

    Args:
        stack: real floating tensor, ``ndim >= 2``, finite.
        method: ``"auto"``, ``"householder"``, ``"cholqr2"``, ``"polar"`` or ``"svd"`` (module
            docstring).
        out: optional output of ``stack``'s shape and device (any floating dtype, any strides);
            default a new tensor like ``stack``.
        backend: force a backend of the ``"orthogonalize"`` op (``"torch"``, ``"triton"``).
        memory_budget: bytes of fp32 scratch per chunk buffer (default 16 MiB on CPU, 1 GiB on GPU).

    Returns ``out``.
    """
    _check_floating(stack, "stack")
    check_method(method)
    if stack.dim() < 2:
        raise ValueError(f"stack must have at least 2 dims [..., m, n], got shape {tuple(stack.shape)}")
    if any(s == 0 for s in stack.shape):
        raise ValueError(f"stack must not have a zero-size dim, got shape {tuple(stack.shape)}")
    if out is not None:
        _check_floating(out, "out")
        if out.shape != stack.shape or out.device != stack.device:
            raise ValueError(f"out must have stack's shape {tuple(stack.shape)} and device {stack.device}, "
                             f"got {tuple(out.shape)} on {out.device}")
    else:
        out = torch.empty_like(stack)
    if stack.device.type == "meta":
        return out
    if not bool(torch.isfinite(stack).all()):
        raise ValueError("stack must be finite (it holds NaN or Inf)")
    m, n = stack.shape[-2:]
    tall = m > n
    src = stack.reshape(-1, m, n)
    if tall:
        src = src.transpose(1, 2)
    wm, wn = src.shape[1:]
    concrete = resolve_method(wm, wn, method)
    num = src.shape[0]
    # results go straight into ``out`` when it is a contiguous fp32 wide stack, else via a buffer
    fast = out.dtype == torch.float32 and out.is_contiguous() and not tall
    res = out.view(-1, m, n) if fast else torch.empty((num, wm, wn), dtype=torch.float32, device=stack.device)

    def fill(start, stop, A):
        A.copy_(src[start:stop])

    def sink(start, stop, R):
        res[start:stop].copy_(R)

    run_chunks(num, (wm, wn), concrete, stack.device, fill, sink, memory_budget=memory_budget,
               backend=backend, direct=lambda start, stop: res[start:stop])
    if not fast:
        out.copy_((res.transpose(1, 2) if tall else res).reshape(stack.shape))
    return out
