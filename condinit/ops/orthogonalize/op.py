"""Batched orthogonalization of per-head blocks: the core of conditioned initialization.

A stack ``W`` of ``B`` blocks ``m x n`` is mapped to blocks with orthonormal rows (``m <= n``,
``Q Q^T = I_m``) or orthonormal columns (``m > n``, ``Q^T Q = I_n``). Every method
(:mod:`condinit.ops.orthogonalize.reference`; docs/design.md, "Orthogonalization") works on the
*wide* orientation (``m <= n``); a tall block is handled as its transpose.

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

Thread count: on the CPU every Householder, SVD and CholeskyQR2 block is factored on one MKL
thread, a chunk's blocks spread over one OpenMP team of the caller's threads (the native per-block
kernels, :mod:`condinit.ops.orthogonalize.reference`, "LAPACK on the CPU"), so those bits do not
depend on ``torch.get_num_threads()`` either; the GEMM-based polar iteration was measured
independent of it.

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
from condinit.ops.orthogonalize.reference import draws_inside as _draws_inside, polar_iterate_, torch_chunk

__all__ = ["orthogonalize", "METHODS", "ORTHOGONALIZE", "resolve_method", "chunk_blocks",
           "gemm_dtype", "run_chunks"]

METHODS = ("auto", "householder", "cholqr2", "polar", "svd")

# auto: CholeskyQR2 when the long side is at least this many times the short side.
CHOLQR_MIN_ASPECT = 4
# Default scratch budget per chunk buffer (bytes): CPU chunks stay cache-sized, GPU chunks are big.
DEFAULT_BUDGET = {"cpu": 16 << 20, "cuda": 1 << 30}
MAX_CHUNK_BLOCKS = {"cpu": 64}  # per device type (default 256): bounds the padding work of a short call
# float64 GEMMs take float64 copies of their operands and result: chunks that many times smaller.
FLOAT64_GEMM_MEMORY_FACTOR = 3
# orthogonalize: a block whose largest |entry| is outside this range is first scaled by a power of 2
# (exact) to bring it to [0.5, 1): the result is scale invariant, and the fp32 Gram of an unscaled
# 1e19 block overflows, that of a 1e-30 block underflows. Blocks inside it (Gaussians) are untouched.
SAFE_PEAK = (2.0 ** -32, 2.0 ** 32)


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
    to write a whole chunk's result into (then ``sink`` is not called for it); ``draw(start,
    stop)`` may return ``(seed, rows)`` for a factorization that draws the inputs itself (see
    :func:`run_chunks`; then ``fill`` is not called for that chunk)."""
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
    draw: Optional[Callable] = None

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

    def run(self, index: int, buffers, chunk_math: Callable, draws_inside: bool = False) -> None:
        """Chunk ``index``, in ``buffers``, by ``chunk_math`` (:func:`torch_chunk` or
        :func:`_triton_chunk`). ``draws_inside``: ``chunk_math`` takes a ``draw`` argument where
        :func:`~condinit.ops.orthogonalize.reference.draws_inside` holds."""
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
        draw = None
        if (draws_inside and self.draw is not None and staging is None
                and _draws_inside(A, self.method)):
            draw = self.draw(start, stop)
        if draw is not None:
            seed, rows = draw
            if k < size:  # pad with draws of a real block; their results are discarded
                rows = torch.cat([rows, rows[-1:].expand(size - k, 2)])
            draw = (seed, rows)
        elif staging is None:
            self.fill(start, stop, A[:k])
        else:
            self.fill(start, stop, staging[:k])
            A[:k, :, :n].copy_(staging[:k])
            A[:k, :, n:].zero_()
        if draw is None and k < size:  # pad with copies of a real block; their results are discarded
            A[k:].copy_(A[k - 1:k].expand(size - k, *A.shape[1:]))
        dest = (self.direct(start, stop) if (self.direct is not None and k == size and staging is None)
                else None)
        extra = {} if draw is None else {"draw": draw}
        chunk_math(A, self.method, dest if dest is not None else A, S, self.gemm, **extra)
        if dest is None:
            self.sink(start, stop, A[:k] if staging is None else staging[:k].copy_(A[:k, :, :n]))


def _plan(num_blocks: int, block_shape, method: str, device: torch.device, fill, sink, direct,
          memory_budget, breaks, draw=None) -> _Job:
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
    return _Job(method, (m, n), device, chunks, rows, None if cpu else C, gemm, fill, sink, direct, draw=draw)


def run_chunks(num_blocks: int, block_shape, method: str, device, fill, sink, *,
               memory_budget=None, backend=None, direct=None, breaks=(), draw=None) -> None:
    """Orthogonalize ``num_blocks`` blocks of wide shape ``block_shape`` chunk by chunk.

    ``fill(start, stop, A)`` writes the inputs of blocks [start, stop) into ``A`` (contiguous fp32
    ``[stop-start, m, n]``); ``sink(start, stop, R)`` receives their orthonormalized fp32 results.
    ``direct(start, stop)`` may return a contiguous fp32 tensor to write a whole chunk's result into
    (then ``sink`` is not called for it). ``breaks``: block offsets where, on the CPU, a chunk should
    end (destination boundaries, so that chunks can be written directly). The callbacks of
    different chunks may run concurrently (CPU) and must touch disjoint memory. ``method`` is
    concrete (not ``"auto"``); ``backend`` is chosen here, once for the whole call.

    ``draw(start, stop)``, optional, returns ``(seed, rows)`` when the inputs ``fill`` would write
    are the Gaussians of ``condinit_C::philox_randn`` (block ``rows[i, 1]`` of stream ``rows[i,
    0]``, int64 ``[stop - start, 2]``, under ``seed``), or None. Where the chunk's factorization
    runs on the native per-block kernels (``reference.draws_inside``), each block is then drawn
    by the thread that factors it, in the same OpenMP team, instead of in a region of its own
    before (same bits); elsewhere ``fill`` runs as usual.

    Batched BLAS may pick another algorithm for another batch size (and on the CPU a batch of one
    goes through a multithreaded GEMM): on GPUs every chunk is padded to exactly
    ``chunk_blocks(...)`` blocks with copies of a real block. On the CPU (MKL) every batch size >= 2
    was measured to give the same per-block bits (tests/test_orthogonalize.py checks it), so chunks
    there are at most that long, split at ``breaks``, and padded to 2 blocks only (not at all for
    Householder and SVD, which LAPACK runs matrix by matrix).

    CPU parallelism: the chunks run one after the other with the caller's intra-op threads; no
    thread or precision setting of the process changes (MKL's single-thread setting is per thread
    and restored). Inside a chunk the factorizations (Householder, SVD, CholeskyQR2) run block by
    block in one OpenMP team, each block on single-threaded MKL (the native per-block kernels of
    :mod:`condinit.ops.orthogonalize.reference`): no OpenMP region is nested and no other thread
    pool exists.
    """
    device = torch.device(device)
    name = ORTHOGONALIZE.choose(device, backend, method=method)
    ORTHOGONALIZE(name, _plan(num_blocks, block_shape, method, device, fill, sink, direct,
                              memory_budget, breaks, draw))


# ---------------------------------------------------------------------------------------------------
# backends: op "orthogonalize", one argument (the _Job)

# What each backend runs (one table: the choice and `condinit info` read it).
ORTHOGONALIZE = _backends.Op("orthogonalize")


@ORTHOGONALIZE.register("torch", devices=(_backends.ANY_DEVICE,))
def _orthogonalize_torch(job: _Job) -> None:
    with job.buffers() as buffers:
        for index in range(len(job.chunks)):
            job.run(index, buffers, torch_chunk, draws_inside=True)


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
