"""Conditioned initialization vs what a user would otherwise run, side by side in one run.

CPU (always): a Llama-1B-shaped attention stack (16 layers, D = 2048, 32 Q heads and 8 KV heads of
head_dim 64: per layer Q [2048, 2048] = 32 blocks [64, 2048], K [512, 2048] = 8 blocks, V [512, 2048]
rectangular identity), fp32:

* ``condinit``: one ``conditioned_init_layers_`` call over all layers (Q/K/V and biases);
* ``per-head orthogonal_``: ``nn.init.orthogonal_`` on every Q/K head block + ``eye_`` for V
  (the same semantics, what one writes without condinit);
* ``whole-matrix orthogonal_``: ``nn.init.orthogonal_`` on every whole Q/K matrix + ``eye_`` for V;
* ``batched torch.linalg.qr``: ``torch.randn`` of all Q/K blocks, one batched QR ([640, 2048, 64]);
* ``torch.randn``: of as many elements as the stack (Q+K+V), and of the Q/K blocks only.

GPU (skipped without CUDA): the Llama-3-70B stack (80 layers, D = 8192, 64 Q heads, 8 KV heads of
128; 5760 Q/K blocks of [128, 8192]) in bf16 storage, timed with CUDA events after a warmup, vs the
batched ``torch.linalg.qr`` and the per-head ``orthogonal_`` loop (both timed on a subset of the
blocks and extrapolated linearly, as the output says).

Run ``python benchmarks/bench_init.py`` (one table), or ``pytest benchmarks/bench_init.py`` for the
pytest-benchmark versions (a 4-layer slice of the CPU stack).
"""
from __future__ import annotations

import argparse
import math
import time

import torch

LLAMA_1B = dict(layers=16, D=2048, H=32, Hkv=8, d=64)
LLAMA_70B = dict(layers=80, D=8192, H=64, Hkv=8, d=128)


def make_stack(layers, D, H, Hkv, d, dtype=torch.float32, device="cpu"):
    return [{"q": torch.empty(H * d, D, dtype=dtype, device=device),
             "k": torch.empty(Hkv * d, D, dtype=dtype, device=device),
             "v": torch.empty(Hkv * d, D, dtype=dtype, device=device)} for _ in range(layers)]


def condinit_init(stack, cfg, seed=0, **kw):
    from condinit.init import conditioned_init_layers_
    conditioned_init_layers_(stack, num_heads=cfg["H"], num_kv_heads=cfg["Hkv"], seed=seed, **kw)


def per_head_orthogonal(stack, cfg, layers=None):
    d = cfg["d"]
    with torch.no_grad():
        for L in (stack if layers is None else stack[:layers]):
            for w in (L["q"], L["k"]):
                for h in range(w.shape[0] // d):
                    torch.nn.init.orthogonal_(w[h * d:(h + 1) * d])
            torch.nn.init.eye_(L["v"])


def whole_orthogonal(stack, cfg):
    with torch.no_grad():
        for L in stack:
            torch.nn.init.orthogonal_(L["q"])
            torch.nn.init.orthogonal_(L["k"])
            torch.nn.init.eye_(L["v"])


def batched_qr(cfg, blocks=None, device="cpu"):
    n = blocks if blocks is not None else cfg["layers"] * (cfg["H"] + cfg["Hkv"])
    W = torch.randn(n, cfg["D"], cfg["d"], device=device)
    Q, R = torch.linalg.qr(W)
    return Q * torch.sign(R.diagonal(dim1=-2, dim2=-1)).unsqueeze(-2)


def elements(cfg, qk_only=False):
    per = (cfg["H"] + cfg["Hkv"]) * cfg["d"] * cfg["D"]
    if not qk_only:
        per += cfg["Hkv"] * cfg["d"] * cfg["D"]
    return cfg["layers"] * per


def _best(fn, repeats):
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class _substitute_rng:
    """Replace ``block_randn`` inside condinit by ``fill(out)`` (to time the rest of the engine)."""

    def __init__(self, fill):
        self.fill = fill

    def __enter__(self):
        from condinit.init import philox as rnd
        self.rnd, self.orig = rnd, rnd.block_randn
        rnd.block_randn = lambda seed, stream, ids, shape, *, out=None, **kw: self.fill(out)
        return self

    def __exit__(self, *exc):
        self.rnd.block_randn = self.orig
        return False


def run_cpu(repeats=3, whole=True):
    from condinit.init.philox import RANDN, block_randn, stream_id
    cfg = LLAMA_1B
    stack = make_stack(**cfg)
    rows = []
    rng_backend = RANDN.choose("cpu")
    native = rng_backend != "torch"
    pool = torch.randn(64, cfg["d"], cfg["D"])
    notes = []
    if native:
        condinit_init(stack, cfg)  # warmup (allocations, lazy imports)
        t_ci = _best(lambda: condinit_init(stack, cfg), repeats)
        rows.append(("condinit conditioned_init_layers_", t_ci))
    else:
        notes.append("block_randn's native CPU kernel is not built (only the slow torch reference "
                     "Philox is): condinit is timed with its Gaussians from torch's normal_ instead")
        with _substitute_rng(lambda out: out.normal_()):
            condinit_init(stack, cfg)
            t_ci = _best(lambda: condinit_init(stack, cfg), repeats)
        rows.append(("condinit conditioned_init_layers_ (Gaussians: torch normal_)", t_ci))
    with _substitute_rng(lambda out: out.copy_(pool[:out.shape[0]])):
        t_rest = _best(lambda: condinit_init(stack, cfg), repeats)
    rows.append(("  condinit without Gaussian generation (fill = memcpy)", t_rest))
    if native:
        buf = torch.empty(16, cfg["d"], cfg["D"])
        nb = cfg["layers"] * (cfg["H"] + cfg["Hkv"])

        def rng_only():
            for s in range(0, nb, 16):
                block_randn(0, stream_id("q"), range(s, s + 16), (cfg["d"], cfg["D"]), out=buf)
        rows.append((f"  block_randn of the Q/K blocks alone ({rng_backend})", _best(rng_only, repeats)))
    rows.append(("per-head nn.init.orthogonal_ loop (640 blocks) + eye_", _best(lambda: per_head_orthogonal(stack, cfg), max(1, repeats - 1))))
    if whole:
        rows.append(("whole-matrix nn.init.orthogonal_ loop (32 matrices) + eye_", _best(lambda: whole_orthogonal(stack, cfg), 1)))
    rows.append(("torch.randn + one batched torch.linalg.qr [640, 2048, 64]", _best(lambda: batched_qr(cfg), max(1, repeats - 1))))
    n_all, n_qk = elements(cfg), elements(cfg, qk_only=True)
    rows.append((f"torch.randn of the stack's {n_all / 1e6:.1f}M elements (Q+K+V)", _best(lambda: torch.randn(n_all), repeats)))
    rows.append((f"torch.randn of the Q/K blocks' {n_qk / 1e6:.1f}M elements", _best(lambda: torch.randn(n_qk), repeats)))
    load = ""
    try:
        import os
        load = f", load average {os.getloadavg()[0]:.1f}"
    except OSError:
        pass
    print(f"\nCPU, Llama-1B-shaped stack (16 layers, D=2048, 32 Q / 8 KV heads of 64), fp32, "
          f"{torch.get_num_threads()} threads{load}, best of {repeats}")
    for note in notes:
        print("note: " + note)
    print(f"{'what':64s} {'time [s]':>9s} {'/ condinit':>11s}")
    for name, t in rows:
        print(f"{name:64s} {t:9.3f} {t / t_ci:10.2f}x")
    return dict(rows)


def run_gpu(subset_blocks=256, loop_blocks=64):
    if not torch.cuda.is_available():
        print("\nGPU section skipped: CUDA not available")
        return None
    cfg = LLAMA_70B
    dev = "cuda"
    stack = make_stack(**cfg, dtype=torch.bfloat16, device=dev)
    nb = cfg["layers"] * (cfg["H"] + cfg["Hkv"])

    def timed(fn, reps=3):
        fn()
        torch.cuda.synchronize()
        best = math.inf
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
        return best

    rows = []
    for method in ("auto", "polar"):
        t = timed(lambda: condinit_init(stack, cfg, method=method))
        rows.append((f"condinit conditioned_init_layers_ (method={method})", t, ""))
    t_ci = rows[0][1]
    t_qr = timed(lambda: batched_qr(cfg, blocks=subset_blocks, device=dev), reps=2) * nb / subset_blocks
    rows.append((f"torch.randn + batched torch.linalg.qr [{nb}, 8192, 128] fp32", t_qr,
                 f"timed on {subset_blocks} blocks, extrapolated x{nb / subset_blocks:.1f}"))
    sub = [{"q": s["q"], "k": s["k"], "v": s["v"]} for s in stack[:1]]
    per_layer = cfg["H"] + cfg["Hkv"]

    def loop():
        with torch.no_grad():
            k = 0
            for w in (sub[0]["q"], sub[0]["k"]):
                for h in range(w.shape[0] // cfg["d"]):
                    if k >= loop_blocks:
                        return
                    torch.nn.init.orthogonal_(w[h * cfg["d"]:(h + 1) * cfg["d"]])
                    k += 1
    t_loop = timed(loop, reps=1) * nb / min(loop_blocks, per_layer)
    rows.append(("per-head nn.init.orthogonal_ loop", t_loop,
                 f"timed on {min(loop_blocks, per_layer)} blocks, extrapolated x{nb / min(loop_blocks, per_layer):.0f}"))
    n = elements(cfg)
    t_rand = timed(lambda: torch.randn(n // 8, device=dev, dtype=torch.bfloat16)) * 8
    rows.append((f"torch.randn of the stack's {n / 1e9:.2f}G elements (bf16)", t_rand, "timed on 1/8, x8"))
    bytes_written = n * 2
    print(f"\nGPU {torch.cuda.get_device_name(0)}, Llama-3-70B stack (80 layers, D=8192, 64 Q / 8 KV heads "
          f"of 128), bf16 storage, CUDA events, best of 3 after warmup")
    print(f"{'what':64s} {'time [s]':>9s} {'vs condinit':>12s}  note")
    for name, t, note in rows:
        print(f"{name:64s} {t:9.4f} {t / t_ci:11.2f}x  {note}")
    print(f"condinit writes {bytes_written / 1e9:.1f} GB of weights: {bytes_written / t_ci / 1e12:.2f} TB/s effective")
    return rows


# --------------------------------------------------------------------------------------------------
# pytest-benchmark (a 4-layer slice of the CPU stack)

SMALL = dict(LLAMA_1B, layers=4)


def test_bench_condinit(benchmark):
    import pytest
    from condinit.init.philox import RANDN
    if RANDN.choose("cpu") == "torch":
        pytest.skip("block_randn's native CPU kernel is not built (the torch reference takes minutes)")
    stack = make_stack(**SMALL)
    benchmark.pedantic(condinit_init, args=(stack, SMALL), rounds=3, warmup_rounds=1)


def test_bench_condinit_without_rng(benchmark):
    stack = make_stack(**SMALL)
    pool = torch.randn(64, SMALL["d"], SMALL["D"])
    with _substitute_rng(lambda out: out.copy_(pool[:out.shape[0]])):
        benchmark.pedantic(condinit_init, args=(stack, SMALL), rounds=3, warmup_rounds=1)


def test_bench_per_head_orthogonal(benchmark):
    stack = make_stack(**SMALL)
    benchmark.pedantic(per_head_orthogonal, args=(stack, SMALL), rounds=2)


def test_bench_batched_qr(benchmark):
    benchmark.pedantic(batched_qr, args=(SMALL,), rounds=2)


def test_bench_randn_same_elements(benchmark):
    n = elements(SMALL)
    benchmark.pedantic(torch.randn, args=(n,), rounds=3)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-whole", action="store_true", help="skip the (slow) whole-matrix orthogonal_ loop")
    p.add_argument("--no-gpu", action="store_true")
    p.add_argument("--gpu-only", action="store_true")
    args = p.parse_args()
    if not args.gpu_only:
        run_cpu(args.repeats, whole=not args.no_whole)
    if not args.no_gpu:
        run_gpu()


if __name__ == "__main__":
    main()
