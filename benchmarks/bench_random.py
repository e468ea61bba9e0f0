"""Counter-based Gaussians (condinit.ops.random.op.block_randn) against torch.randn, same element count.

The default size is the Q and K head blocks of a Llama-1B-shaped model (16 layers x (32 Q + 8 K
heads) = 640 blocks of 64 x 2048 = 83,886,080 float32 normals), the Gaussian part of its
conditioned initialization. The target: the whole conditioned init (these Gaussians plus
CholeskyQR2) costs at most one torch.randn of the same size.

    python benchmarks/bench_random.py [--blocks 640] [--repeat 5] [--skip-torch-backend]
    python -m pytest benchmarks/bench_random.py            # pytest-benchmark, 64 blocks (8.4M)

Both wall time and process CPU time are shown: on a shared machine the wall time of every row,
torch.randn's too, depends on who else is running; CPU time much less so. The ratio compares the
medians of the wall times measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import pytest
import torch

from condinit import _backends
from condinit.ops.random import op as R

M, N = 64, 2048
PYTEST_BLOCKS = int(os.environ.get("CONDINIT_BENCH_RANDOM_BLOCKS", "64"))
SEED = 0x5EED


def _cpp_ok() -> bool:
    return _backends.available("cpp-cpu", "cpu", "philox_randn")[0]


# ------------------------------------------------------------------------------------------------
# pytest-benchmark

def test_torch_randn(benchmark):
    benchmark(torch.randn, PYTEST_BLOCKS, M, N)


@pytest.mark.skipif(not _cpp_ok(), reason="cpp-cpu backend unavailable")
def test_block_randn_cpp(benchmark):
    benchmark(R.block_randn, SEED, 1, range(PYTEST_BLOCKS), (M, N), backend="cpp-cpu")


@pytest.mark.skipif(not _cpp_ok(), reason="cpp-cpu backend unavailable")
def test_block_randn_cpp_out(benchmark):
    out = torch.empty(PYTEST_BLOCKS, M, N)
    benchmark(R.block_randn, SEED, 1, range(PYTEST_BLOCKS), (M, N), out=out, backend="cpp-cpu")


def test_block_randn_torch_backend(benchmark):
    blocks = max(1, PYTEST_BLOCKS // 16)  # the reference is slow; a sixteenth of the size
    benchmark.pedantic(R.block_randn, args=(SEED, 1, range(blocks), (M, N)), kwargs={"backend": "torch"},
                       rounds=2, iterations=1)


# ------------------------------------------------------------------------------------------------
# table

def _time(fn, repeat):
    fn()  # warm-up (first-touch of allocator pools, thread pool start)
    walls, cpus = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        x = fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
        del x
    return walls, cpus


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=640, help="blocks of 64 x 2048 (640: Llama-1B Q+K)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--skip-torch-backend", action="store_true", help="skip the (slow) PyTorch reference row")
    args = ap.parse_args(argv)
    B = args.blocks
    numel = B * M * N
    print(f"{numel:,} float32 normals ({B} blocks of {M} x {N}); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; repeat {args.repeat}")

    rows = [("torch.randn", lambda: torch.randn(B, M, N), args.repeat)]
    if _cpp_ok():
        out = torch.empty(B, M, N)
        rows.append(("condinit block_randn cpp-cpu", lambda: R.block_randn(SEED, 1, range(B), (M, N), backend="cpp-cpu"),
                     args.repeat))
        rows.append(("condinit block_randn cpp-cpu, out=",
                     lambda: R.block_randn(SEED, 1, range(B), (M, N), out=out, backend="cpp-cpu"), args.repeat))
    else:
        print("cpp-cpu backend unavailable:", _backends.available("cpp-cpu", "cpu", "philox_randn")[1])
    if not args.skip_torch_backend:
        rows.append(("condinit block_randn torch (reference)",
                     lambda: R.block_randn(SEED, 1, range(B), (M, N), backend="torch"), 1))

    results = []
    for name, fn, rep in rows:
        walls, cpus = _time(fn, rep)
        results.append((name, statistics.median(walls), min(walls), statistics.median(cpus)))
    base = results[0][1]
    print(f"{'':40s} {'wall median s':>14s} {'wall min s':>11s} {'CPU s':>8s} {'Mnormal/s':>10s} {'vs torch.randn':>15s}")
    for name, med, mn, cpu in results:
        print(f"{name:40s} {med:14.3f} {mn:11.3f} {cpu:8.3f} {numel / med / 1e6:10.0f} {base / med:14.2f}x")
    print("(vs torch.randn: torch.randn's median wall time / this row's; > 1 means faster)")


if __name__ == "__main__":
    main()
