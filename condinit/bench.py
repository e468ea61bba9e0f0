"""Kernel throughput on this machine: condinit's kernels against the machine's ceilings and against
what a user would otherwise run, side by side in one run (``condinit bench``; docs/design.md,
"Backends").

Sections (each a list of :class:`Row`):

``ceilings``
    The machine's matrix rate for the dtype (one large square GEMM, ``2 n^3`` FLOPs) and its memory
    copy bandwidth (``dst.copy_(src)``, read + write bytes), measured in the same run.
``init``
    Conditioned initialization of an attention stack (Q/K per-head semi-orthogonal, V the
    rectangular identity): the batched ``conditioned_init_layers_``; ``semi_orthogonal_`` called
    once per weight (as ``torch.nn.init`` users and model ``init_weights`` loops call it); the
    floor (Gaussians by ``normal_``, one Gram, a float64 Cholesky and a triangular solve, per chunk,
    at torch's rates: one CholeskyQR pass, the least any exact method does); the per-head
    ``torch.nn.init.orthogonal_`` loop; one batched ``torch.linalg.qr`` with its Gaussians;
    ``torch.randn`` of as many elements; and condinit's own Gaussians (``block_randn``) alone.
``attention``
    The fused attention forward against SDPA's best backend (every SDPA backend forced in turn,
    the fastest that runs is the baseline); the JVP against ``torch.func.jvp`` over SDPA MATH (the
    only SDPA backend with forward-mode AD) and as a ratio to SDPA's fused forward; ``probes``
    tangents in one call against as many single-probe calls; the backward
    against SDPA's best backward; the backward through the tangent output (reverse over forward)
    against the same through SDPA MATH.

Every row says which backend ran: condinit's rows name the backend its tables chose
(``Op.choose``, the same call the public function makes; ``--backend`` forces one and a forced
backend that cannot run the call fails the row, never falls back), the SDPA rows the
``SDPBackend`` that ran.

Timing: CPU rows take the median wall time of ``repeats`` calls after a warm-up call; CUDA rows
the median of CUDA-event times after warm-up. Baselines that loop over blocks in Python (the
per-head ``orthogonal_`` loop; on GPUs also the batched QR, which cuSOLVER runs block by block)
can be timed on a subset and scaled linearly (``baseline_blocks``; the row says so).

FLOP conventions (those of FlashAttention's benchmarks and Triton's fused-attention tutorial):
attention forward ``4 B H Nq Nk d``, halved when causal with ``Nq = Nk``; backward 2.5x the
forward; JVP 3x; backward through the tangent output 7.5x. Init: the matrix products of
CholeskyQR2 (4 of ``2 d^2 D`` per block), and the bytes of the weights written once.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Callable, Optional, Sequence

import torch

__all__ = ["InitShape", "AttentionShape", "BenchConfig", "Row", "Timer", "INIT_PRESETS", "make_stack",
           "init_batched", "init_per_tensor", "init_floor", "per_head_orthogonal", "batched_qr",
           "ATTENTION_PRESETS", "FLOP_CONVENTIONS", "math_jvp", "attention_backends", "sdpa_best",
           "default_config", "ceiling_rows", "init_rows",
           "attention_rows", "run", "format_table", "to_json", "machine_info", "attention_flops"]

FLOP_CONVENTIONS = {
    "matmul": "2 n^3 per n x n x n GEMM",
    "copy": "bytes read + bytes written",
    "attention_fwd": "4 B H Nq Nk d, halved for causal with Nq = Nk",
    "attention_bwd": "2.5 x attention_fwd",
    "attention_jvp": "3 x attention_fwd (per probe)",
    "attention_jvp_bwd": "7.5 x attention_fwd (backward through the tangent output)",
    "init": "CholeskyQR2: 4 GEMMs of 2 d^2 D per d x D block (the floor: a Gram 2 d^2 D + a triangular "
            "solve d^2 D); bytes: the weights written once",
}
ATTENTION_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "jvp": 3.0, "jvp_bwd": 7.5}


@dataclasses.dataclass(frozen=True)
class InitShape:
    """An attention stack: ``layers`` x (Q ``[heads*head_dim, hidden]``, K and V ``[kv_heads*head_dim,
    hidden]``)."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def blocks(self) -> int:
        return self.layers * (self.heads + self.kv_heads)

    def label(self) -> str:
        return (f"{self.layers} layers, D={self.hidden}, {self.heads}/{self.kv_heads} heads of "
                f"{self.head_dim}")


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int

    def label(self) -> str:
        kv = f"/{self.kv_heads}" if self.kv_heads != self.heads else ""
        return f"B={self.batch} H={self.heads}{kv} N={self.seq} d={self.head_dim}"


INIT_PRESETS = {
    "llama-1b": InitShape(16, 2048, 32, 8, 64),
    "llama-3-8b": InitShape(32, 4096, 32, 8, 128),
    "llama-3-70b": InitShape(80, 8192, 64, 8, 128),
    "vit-ti": InitShape(12, 192, 3, 3, 64),
    "vit-b": InitShape(12, 768, 12, 12, 64),
    "quick": InitShape(2, 512, 8, 2, 64),
}
ATTENTION_PRESETS = {
    "cpu": AttentionShape(1, 8, 8, 1024, 64),
    "gpu": AttentionShape(1, 16, 16, 8192, 128),
    "quick": AttentionShape(1, 2, 2, 128, 64),
}


def parse_shape(text: str, kind: str):
    """An :class:`InitShape` / :class:`AttentionShape` from a preset name or comma-separated ints
    (init: ``LAYERS,D,HEADS,KV_HEADS,HEAD_DIM``; attention: ``B,H,HKV,N,d``)."""
    presets, cls = (INIT_PRESETS, InitShape) if kind == "init" else (ATTENTION_PRESETS, AttentionShape)
    if text in presets:
        return presets[text]
    fields = [f.name for f in dataclasses.fields(cls)]
    parts = text.split(",")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = None
    if values is None or len(values) != len(fields) or any(v < 1 for v in values):
        raise ValueError(f"{kind} shape must be a preset ({', '.join(presets)}) or {len(fields)} "
                         f"positive ints {','.join(f.upper() for f in fields)}, got {text!r}")
    shape = cls(*values)
    if shape.heads % shape.kv_heads:
        raise ValueError(f"{kind} shape: kv_heads={shape.kv_heads} must divide heads={shape.heads}")
    return shape


@dataclasses.dataclass
class BenchConfig:
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    sections: tuple[str, ...] = ("ceilings", "init", "attention")
    init_shape: InitShape = INIT_PRESETS["llama-1b"]
    attention_shape: AttentionShape = ATTENTION_PRESETS["cpu"]
    causal: bool = True
    repeats: int = 3
    backend: Optional[str] = None        # force condinit's backend (attention and orthogonalize)
    baseline_blocks: Optional[int] = None  # time block-loop baselines on at most this many blocks
    matmul_size: int = 2048
    copy_bytes: int = 256 << 20
    skip: tuple[str, ...] = ()           # row keys not to run (e.g. "math_jvp" on a small GPU)
    probes: int = 4                      # the multi-probe JVP row: this many probes in one call


def default_config(device: str = "cpu", quick: bool = False, **overrides) -> BenchConfig:
    """The defaults of ``condinit bench`` for ``device`` (``quick``: a small run, seconds)."""
    gpu = torch.device(device).type == "cuda"
    cfg = BenchConfig(device=device, dtype=torch.bfloat16 if gpu else torch.float32)
    if gpu:
        cfg.init_shape = INIT_PRESETS["llama-3-70b"]
        cfg.attention_shape = ATTENTION_PRESETS["gpu"]
        cfg.matmul_size, cfg.copy_bytes, cfg.baseline_blocks = 8192, 2 << 30, 256
    if quick:
        cfg.init_shape = INIT_PRESETS["quick"] if not gpu else InitShape(8, 8192, 64, 8, 128)
        cfg.attention_shape = ATTENTION_PRESETS["quick"] if not gpu else AttentionShape(1, 16, 16, 2048, 128)
        cfg.repeats = 2
        cfg.matmul_size = 512 if not gpu else 4096
        cfg.copy_bytes = 32 << 20 if not gpu else 512 << 20
    for key, value in overrides.items():
        if value is not None:
            setattr(cfg, key, value)
    return cfg


# ---------------------------------------------------------------------------------------------------
# timing

@dataclasses.dataclass
class Timing:
    seconds: float             # median
    best: float
    all: list[float]
    scale: float = 1.0         # extrapolation factor already applied to the figures above


class Timer:
    """Median time of ``fn()`` on ``device``: wall clock on the CPU, CUDA events on GPUs (after a
    synchronize), ``warmup`` untimed calls first."""

    def __init__(self, device, repeats: int = 3, warmup: int = 1):
        self.device = torch.device(device)
        self.repeats, self.warmup = max(1, repeats), warmup

    def __call__(self, fn: Callable[[], object], scale: float = 1.0) -> Timing:
        cuda = self.device.type == "cuda"
        for _ in range(self.warmup):
            fn()
        times = []
        if cuda:
            torch.cuda.synchronize(self.device)
        for _ in range(self.repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize(self.device)
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        times = [t * scale for t in times]
        return Timing(statistics.median(times), min(times), times, scale)


@dataclasses.dataclass
class Row:
    """One measurement. ``key`` identifies it across runs (``init.batched``); ``ratios``: this row's
    time over other rows' (``{key of the other row: ratio}``); ``rate``: achieved FLOP/s or B/s and
    ``of_ceiling`` its fraction of the machine's measured ceiling."""
    section: str
    key: str
    name: str
    backend: str
    seconds: Optional[float] = None
    best: Optional[float] = None
    flops: Optional[float] = None
    bytes: Optional[float] = None
    rate: Optional[float] = None
    rate_unit: str = ""
    of_ceiling: Optional[float] = None
    ratios: dict = dataclasses.field(default_factory=dict)
    aim: Optional[str] = None
    note: str = ""
    error: Optional[str] = None
    peak_bytes: Optional[int] = None

    @property
    def ok(self) -> bool:
        return self.error is None


class _Section:
    """Rows of one section, with the progress callback and the error guard."""

    def __init__(self, name: str, timer: Timer, progress: Callable[[str], None],
                 on_row: Optional[Callable[[Row], None]] = None):
        self.name, self.timer, self.progress, self.on_row = name, timer, progress, on_row
        self.rows: list[Row] = []

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row(row)
        return row

    def get(self, key: str) -> Optional[Row]:
        return next((r for r in self.rows if r.key == key and r.ok), None)

    def measure(self, key: str, name: str, backend, fn: Callable[[], object], *, scale: float = 1.0,
                flops=None, nbytes=None, note: str = "", setup: Optional[Callable[[], object]] = None,
                peak_memory: bool = False) -> Row:
        """Time ``fn`` (built by ``setup()`` when given, so that setup errors are the row's too).
        ``backend``: a string or a callable returning one (evaluated inside the guard). A failure
        becomes the row's ``error`` (the run goes on); it is never replaced by another backend."""
        self.progress(f"{self.name}: {name}")
        row = Row(self.name, f"{self.name}.{key}", name, "?", note=note)
        try:
            row.backend = backend() if callable(backend) else backend
            if setup is not None:
                fn = setup()
            cuda = self.timer.device.type == "cuda"
            if cuda and peak_memory:
                torch.cuda.synchronize(self.timer.device)
                torch.cuda.reset_peak_memory_stats(self.timer.device)
                base = torch.cuda.memory_allocated(self.timer.device)
            t = self.timer(fn, scale)
            if cuda and peak_memory:
                row.peak_bytes = int(torch.cuda.max_memory_allocated(self.timer.device) - base)
            row.seconds, row.best = t.seconds, t.best
            row.flops, row.bytes = flops, nbytes
        except Exception as exc:  # recorded on the row and shown in the table: nothing is hidden
            row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return self.add(row)


def _rates(rows: Sequence[Row], matmul: Optional[Row], copy: Optional[Row]) -> None:
    for r in rows:
        if not r.ok or not r.seconds:
            continue
        if r.flops:
            r.rate, r.rate_unit = r.flops / r.seconds, "FLOP/s"
            if matmul is not None and matmul.rate and r is not matmul:
                r.of_ceiling = r.rate / matmul.rate
        elif r.bytes:
            r.rate, r.rate_unit = r.bytes / r.seconds, "B/s"
            if copy is not None and copy.rate and r is not copy:
                r.of_ceiling = r.rate / copy.rate


def _ratio(row: Row, other: Optional[Row]) -> None:
    if row.ok and other is not None and other.ok and other.seconds:
        row.ratios[other.key] = row.seconds / other.seconds


# ---------------------------------------------------------------------------------------------------
# ceilings

def ceiling_rows(cfg: BenchConfig, progress=lambda s: None, on_row=None) -> list[Row]:
    dev = torch.device(cfg.device)
    sec = _Section("ceilings", Timer(dev, cfg.repeats), progress, on_row)
    n = cfg.matmul_size
    dtypes = [cfg.dtype] + ([torch.float32] if cfg.dtype != torch.float32 else [])
    for dtype in dtypes:
        def setup(dtype=dtype):
            a = torch.randn(n, n, device=dev).to(dtype)
            b = torch.randn(n, n, device=dev).to(dtype)
            c = torch.empty(n, n, device=dev, dtype=dtype)
            return lambda: torch.mm(a, b, out=c)
        sec.measure(f"matmul_{_dt(dtype)}", f"matmul {n}^3 {_dt(dtype)} (ceiling)", _matmul_library(dev, dtype),
                    None, setup=setup, flops=2.0 * n ** 3,
                    note="fp32 as the caller's matmul precision allows" if dtype == torch.float32 else "")
    numel = cfg.copy_bytes // 4

    def copy_setup():
        src = torch.ones(numel, device=dev)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    sec.measure("copy", f"memory copy {cfg.copy_bytes / 2**20:.0f} MiB (ceiling)", "torch copy_", None,
                setup=copy_setup, nbytes=2.0 * numel * 4)
    for r in sec.rows:   # a ceiling is the best rate reached, not the typical one
        if r.ok and r.best:
            r.rate, r.rate_unit = (r.flops or r.bytes) / r.best, "FLOP/s" if r.flops else "B/s"
            r.note = "; ".join(x for x in (r.note, "rate from the fastest call") if x)
    return sec.rows


def _matmul_library(dev: torch.device, dtype) -> str:
    if dev.type == "cuda":
        return "cuBLAS"
    return "MKL" if torch.backends.mkl.is_available() and dtype == torch.float32 else "torch CPU BLAS"


def _dt(dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
            torch.float64: "fp64"}.get(dtype, str(dtype).replace("torch.", ""))


# ---------------------------------------------------------------------------------------------------
# init

def make_stack(shape: InitShape, device, dtype=torch.float32):
    """Empty Q/K/V weights of ``shape``: a list of ``{"q", "k", "v"}`` dicts, one per layer."""
    return [{"q": torch.empty(shape.heads * shape.head_dim, shape.hidden, device=device, dtype=dtype),
             "k": torch.empty(shape.kv_heads * shape.head_dim, shape.hidden, device=device, dtype=dtype),
             "v": torch.empty(shape.kv_heads * shape.head_dim, shape.hidden, device=device, dtype=dtype)}
            for _ in range(shape.layers)]


def init_backend(device, backend=None, block_shape=(64, 2048), method: str = "auto") -> str:
    """``orthogonalize=<backend> (<method>), randn=<backend>``: what condinit's tables choose."""
    from condinit.ops.orthogonalize.op import ORTHOGONALIZE, resolve_method
    from condinit.ops.random.op import RANDN
    concrete = resolve_method(*block_shape, method)
    orth = ORTHOGONALIZE.choose(device, backend, method=concrete)
    return f"orthogonalize={orth} ({concrete}), randn={RANDN.choose(device)}"


def init_batched(stack, shape: InitShape, seed: int = 0, **kw) -> None:
    """condinit's batched path: one ``conditioned_init_layers_`` call over the stack."""
    from condinit.init import conditioned_init_layers_
    conditioned_init_layers_(stack, num_heads=shape.heads, num_kv_heads=shape.kv_heads, seed=seed, **kw)


def init_per_tensor(stack, shape: InitShape, seed: int = 0, method: str = "auto") -> None:
    """One ``semi_orthogonal_`` call per Q and K weight (its heads as blocks) and ``rect_identity_``
    for V: how ``torch.nn.init`` users and model ``init_weights`` loops initialize."""
    from condinit.init import rect_identity_, semi_orthogonal_
    d = shape.head_dim
    for i, layer in enumerate(stack):
        semi_orthogonal_(layer["q"], head_dim=d, seed=seed, stream=2 * i, method=method)
        semi_orthogonal_(layer["k"], head_dim=d, seed=seed, stream=2 * i + 1, method=method)
        rect_identity_(layer["v"])


def per_head_orthogonal(stack, shape: InitShape, max_blocks: Optional[int] = None) -> None:
    """``torch.nn.init.orthogonal_`` on every Q/K head block and ``eye_`` for V (the same semantics,
    written without condinit); the first ``max_blocks`` blocks only when given."""
    d, done = shape.head_dim, 0
    with torch.no_grad():
        for layer in stack:
            for w in (layer["q"], layer["k"]):
                for h in range(w.shape[0] // d):
                    if max_blocks is not None and done >= max_blocks:
                        return
                    torch.nn.init.orthogonal_(w[h * d:(h + 1) * d])
                    done += 1
            torch.nn.init.eye_(layer["v"])


def batched_qr(shape: InitShape, device, blocks: Optional[int] = None) -> torch.Tensor:
    """``torch.randn`` of the Q/K blocks and one batched ``torch.linalg.qr`` with the sign fix."""
    n = blocks if blocks is not None else shape.blocks
    W = torch.randn(n, shape.hidden, shape.head_dim, device=device)
    Q, R = torch.linalg.qr(W)
    return Q * torch.sign(R.diagonal(dim1=-2, dim2=-1)).unsqueeze(-2)


def init_floor(stack, shape: InitShape, device, chunk: int) -> None:
    """The floor of any exact method, at torch's rates: per chunk of ``chunk`` Q/K blocks, Gaussians
    by ``normal_``, one Gram (``bmm``), a float64 Cholesky and a triangular solve written into the
    weights; V by ``eye_``. One CholeskyQR pass (CholeskyQR2 does a second, cheaper one)."""
    d, D = shape.head_dim, shape.hidden
    buf = torch.empty(chunk, d, D, device=device)
    with torch.no_grad():
        for layer in stack:
            for w in (layer["q"], layer["k"]):
                blocks = w.view(-1, d, D)
                for s in range(0, blocks.shape[0], chunk):
                    k = min(chunk, blocks.shape[0] - s)
                    A = buf[:k].normal_()
                    G = torch.bmm(A, A.transpose(1, 2))
                    L = torch.linalg.cholesky(G.double()).float()
                    blocks[s:s + k].copy_(torch.linalg.solve_triangular(L, A, upper=False))
            torch.nn.init.eye_(layer["v"])


def condinit_gaussians(shape: InitShape, device, chunk: int) -> None:
    """The Gaussians of the batched path alone: ``block_randn`` of every Q/K block, by chunks."""
    from condinit.ops.random.op import block_randn, stream_id
    buf = torch.empty(chunk, shape.head_dim, shape.hidden, device=device)
    for s in range(0, shape.blocks, chunk):
        k = min(chunk, shape.blocks - s)
        block_randn(0, stream_id("q"), range(s, s + k), (shape.head_dim, shape.hidden), out=buf[:k])


def _randn_backend(device) -> str:
    from condinit.ops.random.op import RANDN
    return RANDN.choose(device)


def init_rows(cfg: BenchConfig, progress=lambda s: None, on_row=None) -> list[Row]:
    from condinit.ops.orthogonalize.op import chunk_blocks, gemm_dtype
    dev = torch.device(cfg.device)
    shape = cfg.init_shape
    sec = _Section("init", Timer(dev, cfg.repeats), progress, on_row)
    storage = cfg.dtype
    stack = make_stack(shape, dev, storage)
    nb = shape.blocks
    d, D = shape.head_dim, shape.hidden
    elements = shape.layers * (shape.heads + 2 * shape.kv_heads) * d * D
    gemm_flops = 4 * 2.0 * d * d * D * nb
    written = elements * torch.empty((), dtype=storage).element_size()
    tag = f"({shape.label()}, {_dt(storage)})"
    kw = {"backend": cfg.backend} if cfg.backend else {}
    backend = lambda: init_backend(dev, cfg.backend, (d, D))  # noqa: E731
    batched = sec.measure("batched", f"condinit conditioned_init_layers_ {tag}", backend,
                          lambda: init_batched(stack, shape, **kw), flops=gemm_flops)
    per = sec.measure("per_tensor", "condinit semi_orthogonal_ per weight + rect_identity_",
                      lambda: init_backend(dev, None, (d, D)), lambda: init_per_tensor(stack, shape),
                      flops=gemm_flops, note=f"{2 * shape.layers} calls")
    per.aim = "<= 1.2x batched"
    chunk = chunk_blocks(d, D, dev.type, None, gemm_dtype(dev.type))
    floor = sec.measure("floor", "floor: normal_ + Gram + Cholesky + triangular solve",
                        "torch " + ("cuBLAS/cuSOLVER" if dev.type == "cuda" else _matmul_library(dev, torch.float32)),
                        lambda: init_floor(stack, shape, dev, chunk), flops=3.0 * d * d * D * nb,
                        note=f"chunks of {chunk} blocks, one CholeskyQR pass")
    batched.aim = "<= 1.3x floor"
    limit = cfg.baseline_blocks
    loop_blocks = min(nb, limit) if limit else nb
    if "orthogonal_loop" not in cfg.skip:
        def loop_setup():
            if storage in (torch.float32, torch.float64):
                loop_stack = stack
            else:  # orthogonal_'s QR has no bf16/fp16 kernel: the loop runs on fp32 weights
                layers = min(shape.layers, -(-loop_blocks // (shape.heads + shape.kv_heads)))
                loop_stack = make_stack(dataclasses.replace(shape, layers=layers), dev, torch.float32)
            return lambda: per_head_orthogonal(loop_stack, shape, loop_blocks)
        sec.measure("orthogonal_loop", "per-head torch.nn.init.orthogonal_ loop + eye_", "torch (LAPACK)" if
                    dev.type == "cpu" else "torch (cuSOLVER)", None, setup=loop_setup, scale=nb / loop_blocks,
                    note=_scaled(loop_blocks, nb))
    qr_blocks = min(nb, limit) if (limit and dev.type == "cuda") else nb
    if "batched_qr" not in cfg.skip:
        sec.measure("batched_qr", f"torch.randn + batched torch.linalg.qr [{nb}, {D}, {d}]",
                    "torch (LAPACK)" if dev.type == "cpu" else "torch (cuSOLVER)",
                    lambda: batched_qr(shape, dev, qr_blocks), scale=nb / qr_blocks, note=_scaled(qr_blocks, nb))
    sec.measure("randn", f"torch.randn of the stack's {elements / 1e6:.1f}M elements ({_dt(storage)})", "torch",
                lambda: torch.randn(elements, device=dev, dtype=storage))
    sec.measure("block_randn", "  of which condinit's Gaussians: block_randn of the Q/K blocks",
                lambda: _randn_backend(dev), lambda: condinit_gaussians(shape, dev, chunk),
                note="part of the batched row")
    for r in (batched, per, floor, sec.get("init.randn")):
        if r is not None and r.ok:
            r.bytes = written   # the weights (or numbers) written once: a bandwidth view
    _ratio(per, batched)
    _ratio(batched, floor)
    for key in ("orthogonal_loop", "batched_qr", "randn"):
        other = sec.get(f"init.{key}")
        _ratio(batched, other)
    return sec.rows


def _scaled(timed: int, total: int) -> str:
    return "" if timed == total else f"timed on {timed} of {total} blocks, scaled x{total / timed:.1f}"


# ---------------------------------------------------------------------------------------------------
# attention

def attention_flops(shape: AttentionShape, causal: bool, kind: str = "fwd") -> float:
    fwd = 4.0 * shape.batch * shape.heads * shape.seq * shape.seq * shape.head_dim
    if causal:
        fwd *= 0.5
    return fwd * ATTENTION_FLOP_FACTOR[kind]


def _sdpa_backends():
    from torch.nn.attention import SDPBackend
    names = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
    return [getattr(SDPBackend, n) for n in names if hasattr(SDPBackend, n)]


def _sdpa(q, k, v, causal):
    import torch.nn.functional as F
    kw = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)


def sdpa_best(q, k, v, causal: bool, timer: Timer, backward: bool = False):
    """(backend name, Timing, {backend: why not}) of the fastest SDPA backend for this call, each
    forced in turn with ``sdpa_kernel`` (a backend that cannot run it raises and is skipped, with
    its reason). ``backward``: time the backward (``dout`` of ones) instead of the forward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    best, why_not = None, {}
    for b in _sdpa_backends():
        if b == SDPBackend.MATH and best is not None:
            continue   # MATH is the reference, not a fused backend: only when nothing else runs
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with sdpa_kernel([b]):
                    if backward:
                        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                        out = _sdpa(*leaves, causal)
                        dout = torch.ones_like(out)
                        fn = lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)  # noqa: E731
                    else:
                        fn = lambda: _sdpa(q, k, v, causal)  # noqa: E731
                    t = timer(fn)
        except RuntimeError as exc:
            why_not[b.name] = str(exc).splitlines()[0][:120]
            continue
        if best is None or t.seconds < best[1].seconds:
            best = (b.name, t)
    if best is None:
        raise RuntimeError(f"no SDPA backend ran: {why_not}")
    return best[0], best[1], why_not


def math_jvp(q, k, v, tq, tk, tv, causal):
    """``torch.func.jvp`` over SDPA forced to MATH, its only backend with forward-mode AD."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.MATH]):
        return torch.func.jvp(lambda a, b, c: _sdpa(a, b, c, causal), (q, k, v), (tq, tk, tv))


def attention_backends(device, dtype, head_dim: int, backend=None) -> dict:
    """The backend each attention op runs for this call (what ``condinit.attention`` /
    ``attention_jvp`` choose)."""
    from condinit.ops.attention import op
    choose = lambda o: o.choose(device, backend, dtype=dtype, head_dim=head_dim)  # noqa: E731
    # the tangent backward has no Triton / CUDA row: attention_jvp then takes its automatic choice
    jvp_bwd_forced = backend if backend is None or backend in op.ATTENTION_JVP_BWD.impls else "auto"
    return {"fwd": choose(op.ATTENTION_FWD), "bwd": choose(op.ATTENTION_BWD), "jvp": choose(op.ATTENTION_JVP),
            "jvp_bwd": op.ATTENTION_JVP_BWD.choose(device, jvp_bwd_forced, dtype=dtype, head_dim=head_dim)}


def attention_rows(cfg: BenchConfig, progress=lambda s: None, on_row=None) -> list[Row]:
    import condinit
    dev = torch.device(cfg.device)
    s, dtype, causal = cfg.attention_shape, cfg.dtype, cfg.causal
    timer = Timer(dev, cfg.repeats)
    sec = _Section("attention", timer, progress, on_row)
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda h: torch.randn(s.batch, h, s.seq, s.head_dim, device=dev, generator=g).to(dtype)  # noqa: E731
    q, k, v = mk(s.heads), mk(s.kv_heads), mk(s.kv_heads)
    tq, tk, tv = mk(s.heads), mk(s.kv_heads), mk(s.kv_heads)
    tag = f"{s.label()} {_dt(dtype)}{' causal' if causal else ''}"
    fl = {kind: attention_flops(s, causal, kind) for kind in ATTENTION_FLOP_FACTOR}
    chosen = lambda kind: attention_backends(dev, dtype, s.head_dim, cfg.backend)[kind]  # noqa: E731
    kw = {"backend": cfg.backend} if cfg.backend else {}

    # SDPA's best fused forward and backward (measured first: the other rows compare to them)
    sdpa_fwd = _measure_sdpa(sec, "sdpa_fwd", f"SDPA forward, best backend ({tag})", q, k, v, causal, timer,
                             False, fl["fwd"])
    sdpa_bwd = _measure_sdpa(sec, "sdpa_bwd", "SDPA backward, best backend", q, k, v, causal, timer, True,
                             fl["bwd"])
    fwd = sec.measure("fwd", "condinit attention forward", lambda: chosen("fwd"),
                      lambda: condinit.attention(q, k, v, causal=causal, **kw), flops=fl["fwd"], peak_memory=True)
    _ratio(fwd, sdpa_fwd)
    fwd.aim = "<= 1.1x SDPA forward"

    if "math_jvp" not in cfg.skip:
        math_row = sec.measure("math_jvp", "torch.func.jvp over SDPA MATH", "SDPA MATH",
                               lambda: math_jvp(q, k, v, tq, tk, tv, causal), flops=fl["jvp"], peak_memory=True)
    else:
        math_row = None
    jvp = sec.measure("jvp", "condinit attention_jvp (1 probe)", lambda: chosen("jvp"),
                      lambda: condinit.attention_jvp(q, k, v, tq, tk, tv, causal=causal, **kw), flops=fl["jvp"],
                      peak_memory=True)
    _ratio(jvp, math_row)
    _ratio(jvp, sdpa_fwd)
    jvp.aim = "<= 2.5x SDPA forward (3x its FLOPs)"
    P = cfg.probes
    if P > 1 and "jvp_probes" not in cfg.skip:
        def probes_setup():
            t = [torch.randn(P, *x.shape, device=dev, generator=g).to(dtype) for x in (q, k, v)]
            return lambda: condinit.attention_jvp(q, k, v, *t, causal=causal, **kw)
        multi = sec.measure("jvp_probes", f"condinit attention_jvp, {P} probes in one call", lambda: chosen("jvp"),
                            None, setup=probes_setup, flops=P * fl["jvp"])
        if multi.ok and jvp.ok:   # against P single-probe calls (the row above)
            multi.ratios[f"attention.jvp*{P}"] = multi.seconds / (P * jvp.seconds)

    def bwd_setup():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = condinit.attention(*leaves, causal=causal, **kw)
        dout = torch.ones_like(out)
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    bwd = sec.measure("bwd", "condinit attention backward", lambda: chosen("bwd"), None, setup=bwd_setup,
                      flops=fl["bwd"])
    _ratio(bwd, sdpa_bwd)
    _ratio(bwd, sdpa_fwd)

    def tangent_bwd_setup(fn):
        def setup():
            leaves = [x.detach().requires_grad_() for x in (q, k, v, tq, tk, tv)]
            out, tout = fn(*leaves)
            grads = (torch.ones_like(out), torch.ones_like(tout))
            return lambda: torch.autograd.grad((out, tout), leaves, grads, retain_graph=True)
        return setup

    if "math_jvp_bwd" not in cfg.skip:
        math_tb = sec.measure("math_jvp_bwd", "backward through torch.func.jvp over SDPA MATH", "SDPA MATH", None,
                              setup=tangent_bwd_setup(lambda *x: math_jvp(*x, causal)), flops=fl["jvp_bwd"],
                              peak_memory=True)
    else:
        math_tb = None
    tb = sec.measure("jvp_bwd", "condinit attention_jvp backward (through the tangent)", lambda: chosen("jvp_bwd"),
                     None, setup=tangent_bwd_setup(
                         lambda a, b, c, ta, tb_, tc: condinit.attention_jvp(a, b, c, ta, tb_, tc, causal=causal, **kw)),
                     flops=fl["jvp_bwd"], peak_memory=True)
    _ratio(tb, math_tb)
    _ratio(tb, sdpa_fwd)
    tb.aim = "<= 0.2x the MATH one"
    return sec.rows


def _measure_sdpa(sec: _Section, key, name, q, k, v, causal, timer, backward, flops) -> Row:
    sec.progress(f"{sec.name}: {name}")
    row = Row(sec.name, f"{sec.name}.{key}", name, "?")
    try:
        backend, t, why_not = sdpa_best(q, k, v, causal, timer, backward)
        row.backend, row.seconds, row.best, row.flops = backend, t.seconds, t.best, flops
        if why_not:
            row.note = "not run: " + ", ".join(sorted(why_not))
    except Exception as exc:
        row.error = f"{type(exc).__name__}: {exc}"
    return sec.add(row)


# ---------------------------------------------------------------------------------------------------
# the whole run, the table, the JSON

SECTIONS = {"ceilings": ceiling_rows, "init": init_rows, "attention": attention_rows}


def run(cfg: BenchConfig, progress: Optional[Callable[[str], None]] = None,
        on_row: Optional[Callable[[Row], None]] = None) -> list[Row]:
    """Every row of ``cfg.sections`` (ceilings first: the others are rated against them).
    ``progress(what)`` is called before each measurement, ``on_row(row)`` after it (its rates and
    ratios are filled in once the section, or for rates the run, is done)."""
    progress = progress or (lambda s: None)
    rows: list[Row] = []
    for name in ("ceilings", "init", "attention"):
        if name in cfg.sections:
            rows += SECTIONS[name](cfg, progress, on_row)
    matmul = next((r for r in rows if r.key == f"ceilings.matmul_{_dt(cfg.dtype)}" and r.ok), None)
    copy = next((r for r in rows if r.key == "ceilings.copy" and r.ok), None)
    _rates([r for r in rows if r.section != "ceilings"], matmul, copy)
    return rows


def planned_rows(cfg: BenchConfig) -> int:
    """How many progress steps :func:`run` reports (for a progress bar)."""
    n = 0
    if "ceilings" in cfg.sections:
        n += 2 + (cfg.dtype != torch.float32)
    if "init" in cfg.sections:
        n += 7 - sum(k in cfg.skip for k in ("orthogonal_loop", "batched_qr"))
    if "attention" in cfg.sections:
        n += 8 + (cfg.probes > 1) - sum(k in cfg.skip for k in ("math_jvp", "math_jvp_bwd", "jvp_probes"))
    return n


def _fmt_rate(r: Row) -> str:
    if r.rate is None:
        return ""
    if r.rate_unit == "FLOP/s":
        text = f"{r.rate / 1e12:.2f} TFLOP/s" if r.rate >= 1e12 else f"{r.rate / 1e9:.1f} GFLOP/s"
    else:
        text = f"{r.rate / 1e9:.1f} GB/s"
    if r.of_ceiling is not None:
        text += f" ({100 * r.of_ceiling:.0f}%)"
    return text


def _short(key: str) -> str:
    return key.split(".", 1)[1]


def format_table(rows: Sequence[Row], header: str = "") -> str:
    """The rows as a plain-text table: what, backend, time, rate (% of the measured ceiling), and
    time ratios to the rows compared against (``0.5x sdpa_fwd``: half of that row's time)."""
    cols = ["section", "what", "backend", "time [ms]", "rate (% of ceiling)", "time / other row's", "note"]
    table = []
    for r in rows:
        if not r.ok:
            table.append([r.section, r.name, r.backend, "-", "", "", f"ERROR {r.error}"])
            continue
        ratios = ", ".join(f"{v:.3g}x {_short(k)}" for k, v in r.ratios.items())
        note = "; ".join(x for x in (r.note, f"aim {r.aim}" if r.aim else "",
                                    f"peak {r.peak_bytes / 2**20:.0f} MiB" if r.peak_bytes is not None else "") if x)
        table.append([r.section, r.name, r.backend, f"{r.seconds * 1e3:.2f}", _fmt_rate(r), ratios, note])
    widths = [max(len(c), *(len(t[i]) for t in table)) if table else len(c) for i, c in enumerate(cols)]
    widths[-1] = len(cols[-1])
    lines = [header] if header else []
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
    lines.append("  ".join("-" * w for w in widths))
    for t in table:
        lines.append("  ".join(x.rjust(w) if i == 3 else x.ljust(w) for i, (x, w) in enumerate(zip(t, widths))).rstrip())
    return "\n".join(lines)


def machine_info(device) -> dict:
    dev = torch.device(device)
    info = {"platform": platform.platform(), "processor": _cpu_model(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}
    try:
        info["load_average_1min"] = os.getloadavg()[0]
    except OSError:
        pass
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info.update(gpu=props.name, gpu_capability=f"{props.major}.{props.minor}",
                    gpu_memory_bytes=props.total_memory, gpu_sms=props.multi_processor_count)
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def versions() -> dict:
    from condinit import __version__, _ext
    out = {"condinit": __version__, "python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "native_extension": _ext.status()[1]}
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception as exc:  # reported, like `condinit info` does
        out["triton"] = f"unavailable ({type(exc).__name__})"
    return out


def to_json(rows: Sequence[Row], cfg: BenchConfig) -> dict:
    config = dataclasses.asdict(cfg)
    config["dtype"] = _dt(cfg.dtype)
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
            "machine": machine_info(cfg.device), "versions": versions(), "flop_conventions": FLOP_CONVENTIONS,
            "timing": ("median of CUDA-event times" if torch.device(cfg.device).type == "cuda"
                       else "median wall time") + f" of {cfg.repeats} calls after a warm-up call",
            "config": config, "rows": [dataclasses.asdict(r) for r in rows]}


def write_json(path, rows, cfg) -> None:
    with open(path, "w") as f:
        json.dump(to_json(rows, cfg), f, indent=1, default=str)
        f.write("\n")
