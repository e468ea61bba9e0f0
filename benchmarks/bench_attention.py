"""Benchmark: condinit's fused attention JVP against torch.func.jvp over SDPA (MATH backend).

    python benchmarks/bench_attention.py            # CPU, B=1, H=8, N=4096, d=64, causal, fp32
    python benchmarks/bench_attention.py --quick    # N=1024
    python benchmarks/bench_attention.py --vs-sdpa -N 2048 4096   # against torch's fused CPU SDPA
    python benchmarks/bench_attention.py -N 512 --dtype float64 --skip-math   # the probes' dtype
    python -m pytest benchmarks/bench_attention.py --benchmark-enable   # small pytest-benchmark cases

Side by side, in one run: ``condinit.attention_jvp`` on the automatic backend (the C++ CPU kernel
when the extension has it) and on the tiled torch reference, against what a user would otherwise
write: ``torch.func.jvp`` over ``F.scaled_dot_product_attention`` under
``sdpa_kernel(SDPBackend.MATH)`` (the only SDPA backend with forward-mode AD; it materializes the
N x N attention matrix and its tangent). Also the multi-probe ratio: one fused call with P = 8
probes against 8 single-probe calls.

Each measurement runs in a fresh subprocess, so one method's memory (allocator caches, the peak
high-water mark) cannot leak into another's. Peak extra memory = peak resident set size during
the timed calls minus the resident set size just before them (inputs already allocated): the
kernel resets the high-water mark (``/proc/self/clear_refs`` = 5) and ``VmHWM`` is read after;
where that is unavailable a sampling thread polls ``VmRSS`` every millisecond.

Targets: >= 10x faster than MATH and <= 5 % of its peak extra memory.

``--vs-sdpa``: condinit's kernels against torch's own fused CPU attention in the same run, for
each N given: the forward (``condinit.attention``) and the JVP (``condinit.attention_jvp``, one
probe) against ``F.scaled_dot_product_attention`` on its flash CPU backend (no forward AD of its
own), and the tangent backward (gradients of a loss on ``(out, tangent_out)`` through
``attention_jvp``) against autograd through ``torch.func.jvp`` over SDPA MATH (time of the
backward call; peak extra memory of JVP + backward). Targets: forward <= 1.1x SDPA's forward,
JVP <= 2.5x SDPA's forward, tangent backward >= 5x faster than MATH at <= 5 % of its memory.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

BAR_SPEEDUP = 10.0
BAR_MEMORY = 0.05


# ------------------------------------------------------------------------------------------------
# memory measurement (inside the child process)
# ------------------------------------------------------------------------------------------------

def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakRSS:
    """Peak extra resident memory (bytes) of the code inside the ``with`` block."""

    def __enter__(self):
        self.base = _status_kb("VmRSS")
        self._sampler = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self._hwm = _status_kb("VmHWM") <= self.base + 1024
        except OSError:
            self._hwm = False
        if not self._hwm:  # fall back to sampling
            self._peak, self._stop = self.base, threading.Event()

            def sample():
                while not self._stop.is_set():
                    self._peak = max(self._peak, _status_kb("VmRSS"))
                    time.sleep(0.001)

            self._sampler = threading.Thread(target=sample, daemon=True)
            self._sampler.start()
        return self

    def __exit__(self, *exc):
        if self._hwm:
            peak = _status_kb("VmHWM")
        else:
            self._stop.set()
            self._sampler.join()
            peak = max(self._peak, _status_kb("VmRSS"))
        self.extra_bytes = max(0, peak - self.base) * 1024
        self.method = "VmHWM" if self._hwm else "sampled VmRSS"
        return False


# ------------------------------------------------------------------------------------------------
# the methods (inside the child process)
# ------------------------------------------------------------------------------------------------

def _inputs(B, H, N, d, P, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, d, generator=g, dtype=dtype) for _ in range(3))
    tq, tk, tv = (torch.randn(P, B, H, N, d, generator=g, dtype=dtype) for _ in range(3))
    return q, k, v, tq, tk, tv


def _method(name: str, causal: bool):
    """Return (fn(q, k, v, tq, tk, tv) -> tangent, backend label)."""
    if name == "math":
        from condinit.bench import math_jvp

        def fn(q, k, v, tq, tk, tv):
            return torch.stack([math_jvp(q, k, v, tq[p], tk[p], tv[p], causal)[1] for p in range(tq.shape[0])])
        return fn, "torch.func.jvp(SDPA MATH)"

    import condinit

    backend = None if name in ("auto", "separate") else name
    if name == "separate":  # P single-probe calls on the automatic backend
        def fn(q, k, v, tq, tk, tv):
            return torch.stack([condinit.attention_jvp(q, k, v, tq[p], tk[p], tv[p], causal=causal)[1]
                                for p in range(tq.shape[0])])
    else:
        def fn(q, k, v, tq, tk, tv):
            return condinit.attention_jvp(q, k, v, tq, tk, tv, causal=causal, backend=backend)[1]
    return fn, backend


def _sdpa_child(cfg: dict) -> dict:
    """One ``--vs-sdpa`` measurement: median seconds of the timed part and peak extra memory."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import condinit
    name, causal, N = cfg["method"], cfg["causal"], cfg["N"]
    grad = name.endswith("tangent-bwd")
    q, k, v, tq, tk, tv = _inputs(cfg["B"], cfg["H"], N, cfg["d"], 1)
    tq, tk, tv = tq[0], tk[0], tv[0]
    if grad:
        q, k, v, tq, tk, tv = (x.requires_grad_() for x in (q, k, v, tq, tk, tv))

    def math_sdpa(a, b, c):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(a, b, c, is_causal=causal)

    def run():
        """Returns the seconds of the timed part."""
        if name == "sdpa-fwd":
            with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                t0 = time.perf_counter()
                F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return time.perf_counter() - t0
        if name == "condinit-fwd":
            with torch.no_grad():
                t0 = time.perf_counter()
                condinit.attention(q, k, v, causal=causal)
            return time.perf_counter() - t0
        if name == "condinit-jvp":
            with torch.no_grad():
                t0 = time.perf_counter()
                condinit.attention_jvp(q, k, v, tq, tk, tv, causal=causal)
            return time.perf_counter() - t0
        if name == "condinit-tangent-bwd":
            out, tout = condinit.attention_jvp(q, k, v, tq, tk, tv, causal=causal)
        else:  # math-tangent-bwd
            out, tout = torch.func.jvp(math_sdpa, (q, k, v), (tq, tk, tv))
        gout, gtout = torch.ones_like(out), torch.ones_like(tout)
        t0 = time.perf_counter()
        torch.autograd.grad((out, tout), (q, k, v, tq, tk, tv), (gout, gtout))
        return time.perf_counter() - t0

    run()  # warm-up at full size (thread pools, lazy imports, allocator)
    times = []
    with PeakRSS() as mem:
        for _ in range(cfg["repeats"]):
            times.append(run())
    return {"method": name, "N": N, "seconds": statistics.median(times), "all_seconds": times,
            "peak_extra_bytes": mem.extra_bytes, "threads": torch.get_num_threads()}


def vs_sdpa(args, base) -> list:
    """The ``--vs-sdpa`` table: per N, condinit's forward / JVP / tangent backward against
    SDPA's fused CPU forward and the MATH route's tangent backward, measured side by side."""
    results = []
    print(f"{'N':>6} {'SDPA flash fwd':>15} {'condinit fwd':>13} {'ratio':>7} {'condinit JVP':>13} {'ratio':>7}"
          f" {'MATH tangent bwd':>17} {'condinit t.bwd':>15} {'speedup':>8} {'memory':>8}")
    for N in args.N:
        row = {}
        methods = ["sdpa-fwd", "condinit-fwd", "condinit-jvp"]
        if not args.skip_math:
            methods += ["math-tangent-bwd"]
        methods += ["condinit-tangent-bwd"]
        for method in methods:
            repeats = 1 if method == "math-tangent-bwd" else args.repeats
            r = run_child({**base, "N": N, "method": method, "repeats": repeats, "vs_sdpa": True}, args.timeout)
            row[method] = r
            results.append(r)
        if any("error" in r for r in row.values()):
            print(f"{N:>6} error: " + "; ".join(f"{m}: {r['error']}" for m, r in row.items() if "error" in r))
            continue
        s = {m: r["seconds"] for m, r in row.items()}
        mb = {m: r["peak_extra_bytes"] for m, r in row.items()}
        math_part = (f" {s['math-tangent-bwd']:>17.3f} {s['condinit-tangent-bwd']:>15.3f} "
                     f"{s['math-tangent-bwd'] / s['condinit-tangent-bwd']:>7.1f}x "
                     f"{mb['condinit-tangent-bwd'] / max(1, mb['math-tangent-bwd']) * 100:>7.2f}%"
                     ) if "math-tangent-bwd" in s else f" {'-':>17} {s['condinit-tangent-bwd']:>15.3f}"
        print(f"{N:>6} {s['sdpa-fwd']:>15.3f} {s['condinit-fwd']:>13.3f} {s['condinit-fwd'] / s['sdpa-fwd']:>6.2f}x"
              f" {s['condinit-jvp']:>13.3f} {s['condinit-jvp'] / s['sdpa-fwd']:>6.2f}x" + math_part)
    print("ratios: condinit time / SDPA flash forward time (targets: forward <= 1.1x, JVP <= 2.5x); "
          "tangent backward: MATH time / condinit time (target >= 5x), condinit peak extra memory / "
          "MATH's (target <= 5 %)")
    return results


def _chosen_backend(q, backend):
    from condinit.bench import attention_backends
    return attention_backends(q.device, q.dtype, q.shape[-1], backend)["jvp"]


def child(cfg: dict) -> dict:
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    if cfg.get("native_lib"):
        torch.ops.load_library(cfg["native_lib"])
    if cfg.get("vs_sdpa"):
        return _sdpa_child(cfg)
    name, causal = cfg["method"], cfg["causal"]
    fn, label = _method(name, causal)
    # warm up on a small problem (lazy imports, kernel selection) without touching the peak
    dtype = getattr(torch, cfg.get("dtype", "float32"))
    fn(*_inputs(1, 2, 64, cfg["d"], cfg["P"], dtype))
    q, k, v, tq, tk, tv = _inputs(cfg["B"], cfg["H"], cfg["N"], cfg["d"], cfg["P"], dtype)
    if name != "math":
        label = _chosen_backend(q, None if name in ("auto", "separate") else name)
    times = []
    with PeakRSS() as mem:
        for _ in range(cfg["repeats"]):
            t0 = time.perf_counter()
            out = fn(q, k, v, tq, tk, tv)
            times.append(time.perf_counter() - t0)
            del out
    return {"method": name, "backend": label, "seconds": statistics.median(times), "all_seconds": times,
            "peak_extra_bytes": mem.extra_bytes, "memory_method": mem.method,
            "threads": torch.get_num_threads()}


def run_child(cfg: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(cfg)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"method": cfg["method"], "error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"method": cfg["method"], "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------

def _fmt_mb(b):
    return f"{b / 2**20:9.1f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N=1024 instead of 4096")
    ap.add_argument("-B", type=int, default=1)
    ap.add_argument("-H", type=int, default=8)
    ap.add_argument("-N", type=int, nargs="+", default=None, help="sequence length(s); several with --vs-sdpa")
    ap.add_argument("-d", type=int, default=64)
    ap.add_argument("--probes", type=int, default=8, help="P for the multi-probe comparison")
    ap.add_argument("--non-causal", action="store_true")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                    help="input dtype of the JVP comparison (float64: what the probes and the monitor use)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per condinit method (median)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--skip-math", action="store_true", help="skip the (slow, O(N^2) memory) MATH baseline")
    ap.add_argument("--skip-reference", action="store_true", help="skip the tiled torch reference")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per measurement")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--native-lib", help="kernel development: load this library of condinit_C ops "
                    "(a separately built attention kernel) in every measurement")
    ap.add_argument("--vs-sdpa", action="store_true", help="forward / JVP / tangent backward against torch's "
                    "fused CPU SDPA and the MATH route, for each -N")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0

    if args.vs_sdpa:
        args.N = args.N or [2048, 4096]
        base = {"B": args.B, "H": args.H, "d": args.d, "causal": not args.non_causal, "threads": args.threads,
                "native_lib": os.path.abspath(args.native_lib) if args.native_lib else None}
        print(f"attention vs torch SDPA, CPU, B={args.B} H={args.H} d={args.d} "
              f"{'non-causal' if args.non_causal else 'causal'} fp32; torch {torch.__version__}; torch threads "
              f"{args.threads or torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} CPUs; median of {args.repeats} (MATH: 1)")
        results = vs_sdpa(args, base)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"config": base, "results": results}, f, indent=1)
        return 0
    N = args.N[0] if args.N else (1024 if args.quick else 4096)
    causal = not args.non_causal
    base = {"B": args.B, "H": args.H, "N": N, "d": args.d, "causal": causal, "threads": args.threads,
            "native_lib": os.path.abspath(args.native_lib) if args.native_lib else None, "dtype": args.dtype}
    print(f"attention JVP, CPU, B={args.B} H={args.H} N={N} d={args.d} {'causal' if causal else 'non-causal'} "
          f"{args.dtype}; torch {torch.__version__}; torch threads {args.threads or torch.get_num_threads()}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if os.getloadavg()[0] > (os.cpu_count() or 1):
        print(f"warning: load average {os.getloadavg()[0]:.1f} > {os.cpu_count()} CPUs: timings are "
              "unreliable (try --threads 1)")

    runs = []
    if not args.skip_math:
        runs.append(("math", 1, 1))
    runs.append(("auto", 1, args.repeats))
    if not args.skip_reference:
        runs.append(("torch", 1, max(1, args.repeats - 2)))
    results = []
    for method, P, repeats in runs:
        r = run_child({**base, "method": method, "P": P, "repeats": repeats}, args.timeout)
        results.append(r)

    math_r = next((r for r in results if r["method"] == "math" and "error" not in r), None)
    print()
    print(f"{'method':<34}{'backend':<28}{'time (s)':>10}{'peak extra (MB)':>17}{'speedup':>10}{'mem ratio':>11}")
    for r in results:
        if "error" in r:
            print(f"{r['method']:<34}{'-':<28}  error: {r['error']}")
            continue
        label = {"math": "torch.func.jvp over SDPA", "auto": "condinit.attention_jvp (auto)",
                 "torch": "condinit.attention_jvp (ref.)"}[r["method"]]
        sp = mr = ""
        if math_r is not None and r is not math_r:
            sp = f"{math_r['seconds'] / r['seconds']:9.1f}x"
            mr = f"{r['peak_extra_bytes'] / max(1, math_r['peak_extra_bytes']) * 100:9.2f}%"
        print(f"{label:<34}{r['backend']:<28}{r['seconds']:10.3f}{_fmt_mb(r['peak_extra_bytes']):>17}{sp:>10}{mr:>11}")
    if math_r is not None:
        for r in results:
            if r is math_r or "error" in r:
                continue
            speed = math_r["seconds"] / r["seconds"]
            mem = r["peak_extra_bytes"] / max(1, math_r["peak_extra_bytes"])
            ok = speed >= BAR_SPEEDUP and mem <= BAR_MEMORY
            print(f"  bars for {r['method']} ({r['backend']}): speedup {speed:.1f}x (>= {BAR_SPEEDUP:.0f}x), "
                  f"memory {mem * 100:.2f}% (<= {BAR_MEMORY * 100:.0f}%): {'PASS' if ok else 'FAIL'}")

    # multi-probe: one fused call with P probes against P single-probe calls (automatic backend)
    P = args.probes
    fused = run_child({**base, "method": "auto", "P": P, "repeats": 1}, args.timeout)
    separate = run_child({**base, "method": "separate", "P": P, "repeats": 1}, args.timeout)
    results += [dict(fused, method=f"auto-P{P}"), dict(separate, method=f"separate-P{P}")]
    print()
    if "error" in fused or "error" in separate:
        print(f"multi-probe: error: {fused.get('error') or separate.get('error')}")
    else:
        print(f"multi-probe, P={P} ({fused['backend']}): fused {fused['seconds']:.3f} s, "
              f"{P} separate calls {separate['seconds']:.3f} s: {separate['seconds'] / fused['seconds']:.2f}x; "
              f"per probe {fused['seconds'] / P:.3f} s vs single-probe call {separate['seconds'] / P:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": base, "results": results}, f, indent=1)
    return 0


# ------------------------------------------------------------------------------------------------
# pytest-benchmark cases (small sizes): python -m pytest benchmarks/bench_attention.py --benchmark-enable
# ------------------------------------------------------------------------------------------------

def _small(P=1):
    return _inputs(1, 4, 256, 64, P)


def test_bench_attention_jvp_auto(benchmark):
    import condinit
    q, k, v, tq, tk, tv = _small()
    out, tout = benchmark(lambda: condinit.attention_jvp(q, k, v, tq, tk, tv, causal=True))
    assert torch.isfinite(tout).all()


def test_bench_attention_jvp_reference(benchmark):
    import condinit
    q, k, v, tq, tk, tv = _small()
    out, tout = benchmark(lambda: condinit.attention_jvp(q, k, v, tq, tk, tv, causal=True, backend="torch"))
    assert torch.isfinite(tout).all()


def test_bench_attention_jvp_four_probes(benchmark):
    import condinit
    q, k, v, tq, tk, tv = _small(P=4)
    out, tout = benchmark(lambda: condinit.attention_jvp(q, k, v, tq, tk, tv, causal=True))
    assert tout.shape[0] == 4


def test_bench_sdpa_math_jvp(benchmark):
    fn, _ = _method("math", True)
    q, k, v, tq, tk, tv = _small()
    tout = benchmark(lambda: fn(q, k, v, tq, tk, tv))
    assert torch.isfinite(tout).all()


def test_bench_attention_backward(benchmark):
    import condinit
    q, k, v, *_ = _small()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    grads = benchmark(lambda: torch.autograd.grad(condinit.attention(*leaves, causal=True).sum(), leaves))
    assert all(torch.isfinite(g).all() for g in grads)


if __name__ == "__main__":
    sys.exit(main())
