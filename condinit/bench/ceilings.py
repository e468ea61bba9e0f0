"""The ``ceilings`` rows of ``condinit bench``: the machine's matrix rate for the dtype (one large
square GEMM, ``2 n^3`` FLOPs) and its memory copy bandwidth (``dst.copy_(src)``, read + write
bytes), measured in the same run; the other rows' rates are given as fractions of them."""
from __future__ import annotations

import torch

from .config import BenchConfig, dtype_name
from .measure import Row, Section, Timer

__all__ = ["ceiling_rows", "matmul_library"]


def ceiling_rows(cfg: BenchConfig, progress=lambda s: None, on_row=None) -> list[Row]:
    dev = torch.device(cfg.device)
    sec = Section("ceilings", Timer(dev, cfg.repeats), progress, on_row)
    n = cfg.matmul_size
    dtypes = [cfg.dtype] + ([torch.float32] if cfg.dtype != torch.float32 else [])
    for dtype in dtypes:
        def setup(dtype=dtype):
            a = torch.randn(n, n, device=dev).to(dtype)
            b = torch.randn(n, n, device=dev).to(dtype)
            c = torch.empty(n, n, device=dev, dtype=dtype)
            return lambda: torch.mm(a, b, out=c)
        sec.measure(f"matmul_{dtype_name(dtype)}", f"matmul {n}^3 {dtype_name(dtype)} (ceiling)", matmul_library(dev, dtype),
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


def matmul_library(dev: torch.device, dtype) -> str:
    if dev.type == "cuda":
        return "cuBLAS"
    return "MKL" if torch.backends.mkl.is_available() and dtype == torch.float32 else "torch CPU BLAS"
