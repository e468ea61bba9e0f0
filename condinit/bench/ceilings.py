"""The ``ceilings`` rows of ``condinit bench``: the machine's best rates, measured in the same run,
that the other rows are rated against.

GEMM rate per dtype: ``n x n x n`` products (``2 n^3`` FLOPs) through each library that runs
products of that dtype here, at the run's size (``matmul_size``) and, on the CPU, at
:data:`CACHE_SIZE` (operands resident in the cores' L2, the regime of the attention kernels'
tiles): on the CPU MKL's GEMM (``torch.mm``) and, for fp32, oneDNN's matmul
(``aten.mkldnn_linear`` on oneDNN tensors; oneDNN is the library of the brgemm micro-kernel the
CPU attention kernels call, faster than MKL on their tile shapes); on GPUs cuBLAS. A row of FLOPs
is rated against the fastest of these for the dtypes its products run in (:func:`gemm_ceiling`):
a kernel does its products no faster than the machine's fastest GEMM, so a rate above that
ceiling is timing noise, and the row says so. Copy bandwidth: ``dst.copy_(src)``, bytes read +
written. Each ceiling's rate comes from its fastest call, of at least :data:`CEILING_REPEATS`
and as many more as fit in :data:`CEILING_SECONDS`.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .config import BenchConfig, dtype_name
from .measure import Row, Section, Timer

__all__ = ["ceiling_rows", "ceiling_plan", "gemm_ceiling", "matmul_library", "CACHE_SIZE", "CEILING_REPEATS",
           "CEILING_SECONDS"]

CACHE_SIZE = 512        # n of the cache-resident GEMM ceilings on the CPU (3 fp32 operands: 3 MiB)
CEILING_REPEATS = 5     # at least this many timed calls per ceiling: its rate is the fastest one's
CEILING_SECONDS = 0.25  # and more calls while their total is under this


def ceiling_plan(cfg: BenchConfig) -> list[tuple[str, torch.dtype, int, str]]:
    """(key, dtype, n, library) of every GEMM ceiling the run measures."""
    dev = torch.device(cfg.device)
    plan = []
    for dtype in [cfg.dtype] + ([torch.float32] if cfg.dtype != torch.float32 else []):
        name = dtype_name(dtype)
        sizes = [cfg.matmul_size] + ([CACHE_SIZE] if dev.type == "cpu" and cfg.matmul_size != CACHE_SIZE else [])
        for n in sizes:
            plan.append((f"matmul_{name}" + ("" if n == cfg.matmul_size else f"_{n}"), dtype, n,
                         matmul_library(dev, dtype)))
        if dev.type == "cpu" and dtype == torch.float32 and _onednn_available():
            plan.append((f"matmul_{name}_onednn", dtype, CACHE_SIZE, "oneDNN"))
    return plan


def ceiling_rows(cfg: BenchConfig, progress=lambda s: None, on_row=None) -> list[Row]:
    dev = torch.device(cfg.device)
    timer = Timer(dev, max(cfg.repeats, CEILING_REPEATS), min_seconds=CEILING_SECONDS)
    sec = Section("ceilings", timer, progress, on_row)
    for key, dtype, n, library in ceiling_plan(cfg):
        def setup(dtype=dtype, n=n, library=library):
            a = torch.randn(n, n, device=dev).to(dtype)
            b = torch.randn(n, n, device=dev).to(dtype)
            if library == "oneDNN":   # a @ b^T in oneDNN's blocked layouts, packed once
                x, w = a.to_mkldnn(), b.to_mkldnn()
                return lambda: torch.ops.aten.mkldnn_linear(x, w, None)
            c = torch.empty(n, n, device=dev, dtype=dtype)
            return lambda: torch.mm(a, b, out=c)
        sec.measure(key, f"matmul {n}^3 {dtype_name(dtype)}", library, None, setup=setup, flops=2.0 * n ** 3)
    numel = cfg.copy_bytes // 4

    def copy_setup():
        src = torch.ones(numel, device=dev)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    sec.measure("copy", f"memory copy {cfg.copy_bytes / 2**20:.0f} MiB", "torch copy_", None,
                setup=copy_setup, nbytes=2.0 * numel * 4)
    for r in sec.rows:   # a ceiling is the best rate reached, not the typical one
        if r.ok and r.best:
            r.rate, r.rate_unit = (r.flops or r.bytes) / r.best, "FLOP/s" if r.flops else "B/s"
            r.note = "; ".join(n for n in (r.note, f"rate of the fastest call ({1e3 * r.best:.3g} ms; the time "
                                                   f"column is the median)") if n)
    return sec.rows


def gemm_ceiling(rows: Sequence[Row], dtypes) -> Optional[Row]:
    """The fastest GEMM ceiling row among ``rows`` whose dtype is one of ``dtypes`` (None if none ran)."""
    prefixes = [f"ceilings.matmul_{dtype_name(d)}" for d in dtypes]
    found = [r for r in rows if r.ok and r.rate and r.flops
             and any(r.key == p or r.key.startswith(p + "_") for p in prefixes)]
    return max(found, key=lambda r: r.rate, default=None)


def matmul_library(dev: torch.device, dtype) -> str:
    if dev.type == "cuda":
        return "cuBLAS"
    return "MKL" if torch.backends.mkl.is_available() and dtype == torch.float32 else "torch CPU BLAS"


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.aten, "mkldnn_linear")
