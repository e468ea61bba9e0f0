"""Conditioned initialization vs what a user would otherwise run, side by side in one run.

The rows are those of ``condinit bench --sections ceilings,init`` (the library
:mod:`condinit.bench` measures them; this script adds nothing to the method): on a Llama-1B-shaped
stack by default (16 layers, D = 2048, 32 Q heads and 8 KV heads of head_dim 64: per layer Q
[2048, 2048] = 32 blocks [64, 2048], K [512, 2048] = 8 blocks, V [512, 2048] rectangular identity),
fp32:

* ``condinit conditioned_init_layers_``: one batched call over all layers;
* ``condinit semi_orthogonal_`` once per Q and K weight + ``rect_identity_`` for V (per tensor);
* the floor: Gaussians by ``normal_``, one Gram, a Cholesky and a triangular solve, at torch's rates;
* ``per-head orthogonal_``: ``nn.init.orthogonal_`` on every Q/K head block + ``eye_`` for V;
* ``batched torch.linalg.qr``: ``torch.randn`` of all Q/K blocks, one batched QR ([640, 2048, 64]);
* ``torch.randn`` of as many elements as the stack (Q+K+V); condinit's ``block_randn`` alone;

plus, with ``--whole``, the whole-matrix ``orthogonal_`` loop (minutes on 2 cores). With a GPU
(``--device cuda``) the default stack is Llama-3-70B-shaped (80 layers, D = 8192, 64 Q heads, 8 KV
heads of 128) in bf16 storage, timed with CUDA events, the block-loop baselines timed on 256 blocks
and scaled (the rows say so).

    python benchmarks/bench_init.py [--device cpu] [--shape llama-1b] [--repeats 3] [--whole]
    python -m pytest benchmarks/bench_init.py --benchmark-enable    # pytest-benchmark, 4 layers
"""
from __future__ import annotations

import argparse

import torch

from condinit import bench

LLAMA_1B = bench.INIT_PRESETS["llama-1b"]
LLAMA_70B = bench.INIT_PRESETS["llama-3-70b"]
SMALL = bench.InitShape(4, 2048, 32, 8, 64)   # pytest-benchmark: a 4-layer slice of the CPU stack


def whole_orthogonal(stack) -> None:
    """``nn.init.orthogonal_`` on every whole Q and K matrix + ``eye_`` for V."""
    with torch.no_grad():
        for layer in stack:
            torch.nn.init.orthogonal_(layer["q"])
            torch.nn.init.orthogonal_(layer["k"])
            torch.nn.init.eye_(layer["v"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default=None, help="a preset of condinit.bench.INIT_PRESETS or L,D,H,HKV,d")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--whole", action="store_true", help="also the whole-matrix orthogonal_ loop (slow)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    cfg = bench.default_config(args.device, sections=("ceilings", "init"), repeats=args.repeats,
                               init_shape=bench.parse_shape(args.shape, "init") if args.shape else None)
    rows = bench.run(cfg, progress=lambda s: print(f"... {s}", flush=True))
    if args.whole:
        stack = bench.make_stack(cfg.init_shape, cfg.device, cfg.dtype)
        t = bench.Timer(cfg.device, repeats=1, warmup=0)(lambda: whole_orthogonal(stack))
        rows.append(bench.Row("init", "init.whole_orthogonal", "whole-matrix nn.init.orthogonal_ loop + eye_",
                              "torch", seconds=t.seconds, best=t.best))
        batched = next(r for r in rows if r.key == "init.batched")
        if batched.ok:
            batched.ratios["init.whole_orthogonal"] = batched.seconds / t.seconds
    print(bench.format_table(rows, f"{cfg.init_shape.label()}, {bench.dtype_name(cfg.dtype)}, {torch.get_num_threads()} "
                                   f"threads, median of {cfg.repeats}"))
    if args.json:
        bench.write_json(args.json, rows, cfg)
    return 0


# --------------------------------------------------------------------------------------------------
# pytest-benchmark (a 4-layer slice of the CPU stack), the library's functions

def _native_randn():
    import pytest
    from condinit.ops.random.op import RANDN
    if RANDN.choose("cpu") == "torch":
        pytest.skip("block_randn's native CPU kernel is not built (the torch reference takes minutes)")


def test_bench_condinit_batched(benchmark):
    _native_randn()
    stack = bench.make_stack(SMALL, "cpu")
    benchmark.pedantic(bench.init_batched, args=(stack, SMALL), rounds=3, warmup_rounds=1)


def test_bench_condinit_per_tensor(benchmark):
    _native_randn()
    stack = bench.make_stack(SMALL, "cpu")
    benchmark.pedantic(bench.init_per_tensor, args=(stack, SMALL), rounds=3, warmup_rounds=1)


def test_bench_floor(benchmark):
    stack = bench.make_stack(SMALL, "cpu")
    benchmark.pedantic(bench.init_floor, args=(stack, SMALL, "cpu", 32), rounds=3, warmup_rounds=1)


def test_bench_per_head_orthogonal(benchmark):
    stack = bench.make_stack(SMALL, "cpu")
    benchmark.pedantic(bench.per_head_orthogonal, args=(stack, SMALL), rounds=2)


def test_bench_batched_qr(benchmark):
    benchmark.pedantic(bench.batched_qr, args=(SMALL, "cpu"), rounds=2)


def test_bench_randn_same_elements(benchmark):
    n = SMALL.layers * (SMALL.heads + 2 * SMALL.kv_heads) * SMALL.head_dim * SMALL.hidden
    benchmark.pedantic(torch.randn, args=(n,), rounds=3)


if __name__ == "__main__":
    main()
