"""Launch configurations of the Triton attention kernels: the autotune lists, the spill limits
they were checked against, the autotuner per list and :func:`launch`.

GPU launch choices (to be timed on a GPU): ``CONFIGS`` holds one short autotune list per
(kernel, bytes per element, head-dim bucket, probes per program); fp32 has its own smaller tiles,
and sm_80 its own list where the sm_90 tiles spill there (``SM80_CONFIGS``).
Every entry fits the shared memory of both sm_80 and sm_90 and spills little where it runs, as compiled
offline by tests/test_gpu_resources.py (figures in BENCHMARKS.md, "Static resource model of the
GPU kernels"). The autotune key holds power-of-two buckets of (Nq, Nk), the padded head dim, the
causal and lengths flags, the JVP flag and the probes per program, and the tensors' dtypes.
``CONDINIT_ATTN_AUTOTUNE=0`` skips the autotuner and runs the first entry of the list for the
call's dtype. Causal programs stop the key loop at the diagonal and mask only the tiles
straddling it (or a ragged last tile); the query tiles are issued heaviest first.
``benchmarks/gpu_check.py`` checks and times the kernels on a GPU. Under the interpreter one fixed
16 x 16 config runs.
"""
import functools
import os

import torch
import triton

from condinit.kernels.attention.bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
from condinit.kernels.attention.fwd import attn_fwd_kernel
from condinit.kernels.attention.jvp_bwd import (attn_jvp_bwd_dkdv_kernel, attn_jvp_bwd_dq_kernel,
                                                attn_jvp_bwd_rows_kernel)


def interpret() -> bool:
    """Whether the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Under the interpreter: one small config, so ragged tiles, several tiles and the diagonal all
# show up at tiny N (tests swap in other block shapes).
INTERPRET_CONFIG = dict(BLOCK_M=16, BLOCK_N=16)

# GPU launch configurations: (kernel, bytes per element, head-dim bucket, probes per program) ->
# [(BLOCK_M, BLOCK_N, num_warps, num_stages), ...]. The head-dim bucket is the padded head dim
# BLOCK_D rounded up to 64, 128 or 256. "fwd" and "jvp" are the forward kernel without and with
# tangents; for "dkdv" BLOCK_N is the key tile that carries the two fp32 accumulators.
#
# Every entry was compiled offline for sm_80 and sm_90 (tests/test_gpu_resources.py; figures in
# BENCHMARKS.md, "Static resource model of the GPU kernels"): each fits both targets' shared
# memory per block (163 KiB on sm_80, 227 KiB on sm_90), so one list serves both (sm_80 has its
# own where SM80_CONFIGS gives one), and spills at most spill_limit bytes per thread on the
# targets it serves. The first entry, what runs with
# CONDINIT_ATTN_AUTOTUNE=0, is a large tile that spills little or nothing on both targets; the
# others are the autotuner's alternatives. Wider tiles than these spill: when ptxas (12.9, -O3)
# cannot fit a kernel in 255 registers it often drops to 32 registers and spills 3-13 KB per
# thread (the JVP above all, and sm_80 more often than sm_90), so a tile that fits sm_90 may be
# unusable on sm_80.
#
# The 16-bit JVP runs 64-key tiles at d <= 128 (m64n64k16 score products on sm_90). At d = 128
# it has no two-probe list: a third BLOCK_M x 128 fp32 accumulator next to 64-key tiles does not
# fit 255 registers (two probes at 128 x 32 spill 304 B per thread on sm_90 and 7.6 KB on sm_80),
# so several probes run one per program there, 6 products per probe and key tile instead of 5.
#
# fp32 inputs take IEEE fp32 products (FMA, no tensor cores): each thread then holds whole rows of
# both operands of a product, so fp32 gets small tiles over 8 warps, and two probes per program
# only at d <= 64.
CONFIGS = {
    # bf16 / fp16
    ("fwd", 2, 64, 1): [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3)],
    ("fwd", 2, 128, 1): [(128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3)],
    ("fwd", 2, 256, 1): [(128, 64, 8, 2), (64, 32, 4, 2), (64, 64, 4, 2)],
    ("jvp", 2, 64, 1): [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
    ("jvp", 2, 64, 2): [(128, 32, 8, 2), (128, 64, 8, 2), (128, 16, 8, 2), (64, 32, 4, 2)],
    ("jvp", 2, 128, 1): [(128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 8, 2)],
    ("jvp", 2, 256, 1): [(32, 16, 8, 2), (32, 32, 8, 2)],
    ("dkdv", 2, 64, 1): [(64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3)],
    ("dkdv", 2, 128, 1): [(32, 128, 8, 3), (32, 64, 8, 3), (64, 64, 8, 3), (32, 64, 4, 3)],
    ("dkdv", 2, 256, 1): [(32, 32, 8, 2), (32, 64, 8, 2), (16, 64, 8, 2)],
    ("dq", 2, 64, 1): [(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    ("dq", 2, 128, 1): [(128, 32, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3)],
    ("dq", 2, 256, 1): [(64, 64, 8, 2), (64, 32, 4, 2)],
    # fp32
    ("fwd", 4, 64, 1): [(32, 16, 8, 2), (64, 16, 8, 2)],
    ("fwd", 4, 128, 1): [(32, 16, 8, 2), (64, 16, 8, 2)],
    ("fwd", 4, 256, 1): [(32, 16, 8, 2), (16, 16, 4, 2)],
    ("jvp", 4, 64, 1): [(16, 16, 8, 2), (32, 16, 8, 2)],
    ("jvp", 4, 64, 2): [(16, 16, 8, 2)],
    ("jvp", 4, 128, 1): [(16, 16, 8, 2)],
    ("jvp", 4, 256, 1): [(16, 16, 8, 2)],
    ("dkdv", 4, 64, 1): [(16, 32, 8, 2), (16, 16, 4, 2)],
    ("dkdv", 4, 128, 1): [(16, 32, 8, 2), (16, 16, 4, 2)],
    ("dkdv", 4, 256, 1): [(16, 32, 8, 2), (16, 16, 4, 2)],
    ("dq", 4, 64, 1): [(32, 16, 8, 2), (16, 16, 4, 2)],
    ("dq", 4, 128, 1): [(32, 16, 8, 2), (16, 16, 4, 2)],
    ("dq", 4, 256, 1): [(32, 16, 8, 2), (16, 16, 4, 2)],
    # Backward through the tangent output: "jvp_bwd_rows" (the row statistics, a forward-like
    # sweep without accumulators), "jvp_bwd_dq" (two fp32 accumulators, BLOCK_M rows) and
    # "jvp_bwd_dkdv" (four fp32 accumulators, BLOCK_N keys).
    ("jvp_bwd_rows", 2, 64, 1): [(128, 64, 8, 2), (64, 64, 4, 2)],
    ("jvp_bwd_rows", 2, 128, 1): [(128, 32, 8, 2), (64, 64, 8, 2)],
    ("jvp_bwd_rows", 2, 256, 1): [(64, 32, 8, 2), (32, 32, 4, 2)],
    ("jvp_bwd_dq", 2, 64, 1): [(64, 32, 4, 2), (128, 32, 8, 2)],
    ("jvp_bwd_dq", 2, 128, 1): [(64, 32, 8, 2), (64, 16, 4, 2)],
    ("jvp_bwd_dq", 2, 256, 1): [(32, 16, 8, 2), (32, 32, 8, 2)],
    ("jvp_bwd_dkdv", 2, 64, 1): [(32, 64, 8, 2), (32, 32, 4, 2)],
    ("jvp_bwd_dkdv", 2, 128, 1): [(32, 32, 8, 2), (16, 32, 4, 2)],
    ("jvp_bwd_dkdv", 2, 256, 1): [(16, 16, 8, 2), (32, 16, 8, 2)],
    ("jvp_bwd_rows", 4, 64, 1): [(32, 16, 8, 2)],
    ("jvp_bwd_rows", 4, 128, 1): [(32, 16, 8, 2)],
    ("jvp_bwd_rows", 4, 256, 1): [(16, 16, 8, 2)],
    ("jvp_bwd_dq", 4, 64, 1): [(16, 16, 8, 2)],
    ("jvp_bwd_dq", 4, 128, 1): [(16, 16, 8, 2)],
    ("jvp_bwd_dq", 4, 256, 1): [(16, 16, 8, 1)],
    ("jvp_bwd_dkdv", 4, 64, 1): [(16, 16, 8, 2)],
    ("jvp_bwd_dkdv", 4, 128, 1): [(16, 16, 8, 1)],
    ("jvp_bwd_dkdv", 4, 256, 1): [(16, 16, 8, 1)],
}


# sm_80 (A100) takes its own list where the sm_90 tiles spill there: mma.sync keeps Q and tQ in
# registers (sm_90's wgmma reads them from shared memory), so the 16-bit JVP at d = 128 spills
# 464-512 B per thread on sm_80 at 128 x 64 (8-32 B on sm_90) and 56-96 B at 128 x 32; with two
# probes at d = 64, 128 x 64 spills 792 B on sm_80 (128-184 B on sm_90).
SM80_CONFIGS = {
    ("jvp", 2, 128, 1): [(128, 32, 8, 2), (64, 64, 8, 2)],
    ("jvp", 2, 64, 2): [(128, 32, 8, 2), (128, 16, 8, 2), (64, 32, 4, 2)],
}


def head_dim_bucket(block_d: int) -> int:
    return 64 if block_d <= 64 else block_d


def spill_limit(kind: str, elem_bytes: int, block_d: int) -> int:
    """Largest stack frame (spilled registers, bytes per thread) an entry of CONFIGS may need on
    sm_80 or sm_90 (checked by tests/test_gpu_resources.py). Exceptions: the fp32 JVP at
    d = 256 holds two fp32 BLOCK_M x 256 accumulators and Q, tQ as FMA operands, and spills
    about 4.5 KB per thread with every tile tl.dot allows (16 x 16 and up); for fp32 at that size
    the CUDA kernels (no spills) are the better backend."""
    if (kind, elem_bytes, head_dim_bucket(block_d)) == ("jvp", 4, 256):
        return 5 * 1024
    # The same at d = 256 for the fp32 tangent backward: its dQ kernel (two fp32 accumulators,
    # Q, tQ, gO') spills about 600 B per thread, its dK/dV kernel (four fp32 accumulators and the
    # K, V, tK, tV tiles) 1.7 KB on sm_90 and 2.5 KB on sm_80, with the smallest tiles tl.dot
    # allows.
    return {("jvp_bwd_dq", 4, 256): 1024, ("jvp_bwd_dkdv", 4, 256): 3072}.get(
        (kind, elem_bytes, head_dim_bucket(block_d)), 512)


def probes_per_program(elem_bytes: int, block_d: int, jvp: bool, n_probes: int) -> int:
    """2 when a JVP call has several probes and a two-probe list exists for its dtype and head
    dim (the pair shares S, P~ and P~ V), else 1."""
    two = jvp and n_probes > 1 and ("jvp", elem_bytes, head_dim_bucket(block_d), 2) in CONFIGS
    return 2 if two else 1


def configs(kind: str, elem_bytes: int, block_d: int, probes_per_program: int = 1, arch: int = 90) -> list:
    """The GPU launch configurations of one kernel (``"fwd"``, ``"jvp"``, ``"dkdv"``, ``"dq"``)
    for inputs of ``elem_bytes`` bytes per element, padded head dim ``block_d`` and
    ``probes_per_program`` on a GPU of compute capability ``arch`` (``10 * major + minor``: below
    90 the ``SM80_CONFIGS`` list where there is one), as :class:`triton.Config` (first one: the
    autotune-off choice)."""
    key = (kind, elem_bytes, head_dim_bucket(block_d), probes_per_program)
    entries = SM80_CONFIGS.get(key, CONFIGS[key]) if arch < 90 else CONFIGS[key]
    return [triton.Config(dict(BLOCK_M=m, BLOCK_N=n), num_warps=w, num_stages=s) for m, n, w, s in entries]


def device_arch(t) -> int:
    """``10 * major + minor``, the compute capability of the GPU that holds ``t``."""
    major, minor = torch.cuda.get_device_capability(t.device)
    return 10 * major + minor


KERNELS = {"fwd": attn_fwd_kernel, "jvp": attn_fwd_kernel, "dkdv": attn_bwd_dkdv_kernel,
            "dq": attn_bwd_dq_kernel, "jvp_bwd_rows": attn_jvp_bwd_rows_kernel,
            "jvp_bwd_dq": attn_jvp_bwd_dq_kernel, "jvp_bwd_dkdv": attn_jvp_bwd_dkdv_kernel}
# Autotune key: bucketed sequence lengths, the padded head dim, the causal and lengths flags and,
# for the forward kernel, the JVP flag and the probes per program; the autotuner appends the
# tensors' dtypes itself.
_BASE_KEY = ["tune_q", "tune_k", "BLOCK_D", "CAUSAL", "HAS_LENS"]
TUNE_KEY = {kind: _BASE_KEY for kind in KERNELS}
TUNE_KEY["fwd"] = TUNE_KEY["jvp"] = _BASE_KEY + ["JVP", "PROBES_PER_PROGRAM"]


@functools.lru_cache(maxsize=None)
def tuned(kind: str, elem_bytes: int, block_d: int, probes_per_program: int, arch: int):
    """One autotuner per config list."""
    return triton.autotune(configs(kind, elem_bytes, block_d, probes_per_program, arch),
                           key=TUNE_KEY[kind])(KERNELS[kind])


def bucket(n: int) -> int:
    # Autotune once per power-of-two bucket of the sequence length, not per length.
    return triton.next_power_of_2(max(int(n), 16))


def common_meta(head_dim: int) -> dict:
    """The compile-time arguments every kernel takes, for head dim ``head_dim``."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d, EVEN_D=head_dim == block_d,
        INTERPRETER=interpret(),
        DOT_PRECISION="ieee",  # fp32 inputs: IEEE products (no TF32); ignored for fp16 / bf16
    )


def launch(kind, grid_fn, args, meta):
    """Launch kernel ``kind`` on ``args`` (``args[0]`` is q) with compile-time arguments ``meta``.
    Interpreter: the fixed small config. GPU: the autotuner over the list of ``configs``, or with
    CONDINIT_ATTN_AUTOTUNE=0 its first config."""
    kernel = KERNELS[kind]
    if interpret():
        cfg = dict(INTERPRET_CONFIG)
        kernel[(grid_fn(cfg),)](*args, **meta, **cfg)
        return
    elem_bytes = args[0].element_size()
    ppp = meta.get("PROBES_PER_PROGRAM", 1)
    arch = device_arch(args[0])
    if os.environ.get("CONDINIT_ATTN_AUTOTUNE", "1") == "0":
        first = configs(kind, elem_bytes, meta["BLOCK_D"], ppp, arch)[0]
        kernel[(grid_fn(first.kwargs),)](*args, **meta, **first.kwargs,
                                         num_warps=first.num_warps, num_stages=first.num_stages)
    else:
        tuned(kind, elem_bytes, meta["BLOCK_D"], ppp, arch)[lambda m: (grid_fn(m),)](*args, **meta)

