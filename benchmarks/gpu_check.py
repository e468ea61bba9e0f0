"""One script for a machine with one NVIDIA GPU: build, check every GPU path, time it, report.

    python benchmarks/gpu_check.py [--log gpu_check.log] [--skip-build] [--quick]

1. builds condinit with its CUDA extension (``pip install --no-build-isolation --no-deps -e .``,
   archs of the visible GPU only), unless ``--skip-build``;
2. checks every GPU path against float64 references on fresh random inputs:
   the counter-based generator (cuda vs the CPU backends), every orthogonalization method,
   the batched conditioned init (GPU equals CPU), and the attention op's Triton and CUDA
   kernels (forward, backward, JVP with probes; fp32 / fp16 / bf16; causal; GQA; awkward N);
3. times them against their baselines, side by side: conditioned init of a Llama-3-70B-shaped
   stack vs batched ``torch.linalg.qr`` and the per-head ``orthogonal_`` loop; attention JVP
   (bf16, N=8192, d=128) vs ``torch.func.jvp`` over SDPA's MATH backend, and its TFLOP/s
   (3x the forward's FLOPs) against the bf16 matrix rate measured in the same run;
4. prints a short table last and writes the full log to ``--log`` (default ``$OUT/gpu_check.log``
   when ``$OUT`` is set, else ``gpu_check.log``).

Designed to finish in under 8 minutes on one H200. Exit status 0 when every check passed.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# --cpu-dry-run runs the same code on the CPU at toy sizes with the CPU backends, so the script's
# own logic is checked on every CI run, before any GPU time is spent on it.
DRY = False
DEV = "cuda"
GPU_BACKENDS = ("triton", "cuda")
RANDN_BACKEND = "cuda"
LOG = None
RESULTS = []  # (section, name, status, detail)


def log(msg=""):
    print(msg, flush=True)
    if LOG is not None:
        LOG.write(msg + "\n")
        LOG.flush()


def record(section, name, ok, detail=""):
    status = "PASS" if ok is True else ("FAIL" if ok is False else ok)
    RESULTS.append((section, name, status, detail))
    log(f"[{status}] {section}: {name} {detail}")


def guarded(section):
    """Run a check function; an exception is recorded as ERROR and the script goes on."""
    def deco(fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                fn(*a, **k)
            except Exception as exc:
                record(section, fn.__name__, "ERROR", f"{type(exc).__name__}: {exc}")
                log(traceback.format_exc())
            log(f"   ({fn.__name__} took {time.perf_counter() - t0:.1f} s)")
        return wrapper
    return deco


# --------------------------------------------------------------------------------------------- build
def build():
    import torch
    major, minor = torch.cuda.get_device_capability(0)
    env = {**os.environ, "CONDINIT_STRICT_BUILD": "1", "MAX_JOBS": str(os.cpu_count() or 8),
           "TORCH_CUDA_ARCH_LIST": f"{major}.{minor}"}
    env.setdefault("CUDA_HOME", "/usr/local/cuda")
    cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index", "-e", ROOT]
    log(f"$ {' '.join(cmd)}  (TORCH_CUDA_ARCH_LIST={env['TORCH_CUDA_ARCH_LIST']})")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    log(proc.stdout[-20000:])
    log(proc.stderr[-20000:])
    record("build", "pip install -e . with CUDA", proc.returncode == 0, f"{time.perf_counter() - t0:.0f} s")
    return proc.returncode == 0


# --------------------------------------------------------------------------------------------- helpers
def rel_err(x, ref, floor=1e-30):
    """max |x - ref| / max |ref|; ``floor`` bounds the denominator from below (a gradient that is
    exactly zero, e.g. dq when each row sees one key, would otherwise divide rounding noise by 0)."""
    x, ref = x.double().cpu(), ref.double().cpu()
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(floor)).item()


def cuda_time(fn, warmup=2, iters=5):
    """Median milliseconds of fn() timed with CUDA events after warm-up."""
    import torch
    if DEV == "cpu":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


TOL = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}


# --------------------------------------------------------------------------------------------- init engine
@guarded("init")
def check_randn():
    import torch
    from condinit.init.philox import block_randn
    ids = [0, 5, 123456789, 2**33 + 7]
    gpu = block_randn(1234, 7, ids, (64, 1000), device=DEV, backend=RANDN_BACKEND).cpu()
    cpu = block_randn(1234, 7, ids, (64, 1000), device="cpu")
    diff = (gpu - cpu).abs().max().item()
    same = torch.equal(gpu, cpu)
    # The generator is designed bit-identical across backends (fixed fp32 operation sequences).
    record("init", "randn cuda == cpu bit for bit", same, f"max|diff|={diff:.2e}")


@guarded("init")
def check_orthogonalize():
    import torch
    from condinit.init import orthogonalize
    g = torch.Generator(device=DEV).manual_seed(0)
    shapes = [(64, 1, 1), (96, 64, 2048), (8, 128, 8192), (4, 256, 16384), (2, 17, 123), (2, 300, 40)]
    for shape in (shapes[:2] + shapes[4:] if DRY else shapes):
        x = torch.randn(shape, device=DEV, generator=g)
        for method in ("householder", "cholqr2", "polar", "svd"):
            q = orthogonalize(x, method=method)
            m, n = shape[-2:]
            gram = q @ q.mT if m <= n else q.mT @ q
            err = (gram - torch.eye(min(m, n), device=DEV)).abs().max().item()
            record("init", f"orthogonalize {method} {shape}", err <= 1e-5, f"max|WW^T-I|={err:.1e}")
    x = torch.randn(16, 64, 4096, device=DEV, generator=g)
    d = (orthogonalize(x, method="cholqr2") - orthogonalize(x, method="householder")).abs().max().item()
    record("init", "cholqr2 Q == householder Q (sign-fixed)", d <= 1e-5, f"max|diff|={d:.1e}")


@guarded("init")
def check_conditioned_init_gpu_equals_cpu():
    import torch
    from condinit.init import conditioned_init_layers_
    L, D, H, Hkv, d = 3, 512, 8, 2, 64

    def make(device):
        return [dict(q=torch.empty(H * d, D, device=device), k=torch.empty(Hkv * d, D, device=device),
                     v=torch.empty(Hkv * d, D, device=device)) for _ in range(L)]

    cpu, gpu = make("cpu"), make(DEV)
    conditioned_init_layers_(cpu, num_heads=H, num_kv_heads=Hkv, seed=11)
    conditioned_init_layers_(gpu, num_heads=H, num_kv_heads=Hkv, seed=11)
    err = max((a[n] - b[n].cpu()).abs().max().item() for a, b in zip(cpu, gpu) for n in "qkv")
    record("init", "conditioned_init_layers_ cuda == cpu", err <= 1e-5, f"max|diff|={err:.1e}")


# --------------------------------------------------------------------------------------------- attention
def naive_attention(q, k, v, causal, scale):
    import torch
    H, Hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    s = scale * q @ k.mT
    if not causal:
        return torch.softmax(s, dim=-1) @ v
    nq, nk = q.shape[2], k.shape[2]
    mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
    # a finite fill keeps rows that see no key NaN-free (also in their gradients); zero them after
    p = torch.softmax(s.masked_fill(~mask, torch.finfo(s.dtype).min), dim=-1)
    return (p * mask.any(-1, keepdim=True)) @ v


@guarded("attention")
def check_attention(backend):
    import torch
    import condinit
    cases = [  # B, H, Hkv, Nq, Nk, d, causal
        (1, 2, 2, 1, 1, 64, False), (2, 4, 2, 17, 17, 16, True), (1, 8, 1, 128, 128, 128, True),
        (1, 4, 4, 333, 333, 80, False), (1, 2, 1, 200, 64, 64, True), (1, 2, 2, 64, 300, 256, True),
        (1, 8, 2, 129, 257, 96, False), (1, 2, 2, 1000, 1000, 32, True),
    ][: 4 if DRY else None]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        worst = {"out": 0.0, "tout": 0.0, "grad": 0.0}
        for B, H, Hkv, Nq, Nk, d, causal in cases:
            mk = lambda h, n: torch.randn(B, h, n, d, device=DEV, dtype=torch.float64)
            q, k, v = mk(H, Nq), mk(Hkv, Nk), mk(Hkv, Nk)
            P = 2
            tq, tk, tv = (torch.randn(P, *t.shape, device=DEV, dtype=torch.float64) for t in (q, k, v))
            scale = d ** -0.5
            # float64 reference: value, tangents (per probe), gradients
            ref_out = naive_attention(q, k, v, causal, scale)
            ref_t = torch.stack([torch.func.jvp(lambda a, b, c: naive_attention(a, b, c, causal, scale),
                                                (q, k, v), (tq[p], tk[p], tv[p]))[1] for p in range(P)])
            dout = torch.randn_like(ref_out)
            _, vjp = torch.func.vjp(lambda a, b, c: naive_attention(a, b, c, causal, scale), q, k, v)
            ref_g = vjp(dout)
            c = lambda t: t.to(dtype).contiguous()
            out, tout = condinit.attention_jvp(c(q), c(k), c(v), c(tq), c(tk), c(tv), causal=causal,
                                               scale=scale, backend=backend)
            qq, kk, vv = (c(t).requires_grad_() for t in (q, k, v))
            o2 = condinit.attention(qq, kk, vv, causal=causal, scale=scale, backend=backend)
            grads = torch.autograd.grad(o2, (qq, kk, vv), c(dout))
            nan = any(torch.isnan(t).any().item() for t in (out, tout, o2, *grads))
            worst["out"] = max(worst["out"], rel_err(out, ref_out), rel_err(o2, ref_out))
            worst["tout"] = max(worst["tout"], rel_err(tout, ref_t))
            # inputs are unit Gaussians, so gradients are O(1): floor the denominator at 1
            worst["grad"] = max(worst["grad"], *(rel_err(a, b, floor=1.0) for a, b in zip(grads, ref_g)))
            if nan:
                record("attention", f"{backend} {dtype} {B,H,Hkv,Nq,Nk,d,causal}", False, "NaN in output")
        tol = TOL[str(dtype).split(".")[1]]
        ok = all(v <= tol for v in worst.values())
        record("attention", f"{backend} {str(dtype)[6:]} fwd/jvp(P=2)/bwd vs float64",
               ok, " ".join(f"{k}={v:.1e}" for k, v in worst.items()) + f" (tol {tol:.0e})")


# --------------------------------------------------------------------------------------------- timing
TIMINGS = []  # (what, condinit_ms, baseline name, baseline_ms, extra)


@guarded("timing")
def time_matmul_rate():
    import torch
    n = 512 if DRY else 8192
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    ms = cuda_time(lambda: a @ a, warmup=3, iters=10)
    rate = 2 * n ** 3 / ms / 1e9
    TIMINGS.append((f"bf16 matmul {n}^3 (ceiling)", ms, "", float("nan"), f"{rate:.1f} TFLOP/s"))
    a32 = torch.randn(n, n, device=DEV)
    with_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    ms32 = cuda_time(lambda: a32 @ a32, warmup=2, iters=5)
    torch.backends.cuda.matmul.allow_tf32 = with_tf32
    TIMINGS.append((f"fp32 matmul {n}^3 (ceiling)", ms32, "", float("nan"), f"{2 * n ** 3 / ms32 / 1e9:.1f} TFLOP/s"))
    globals()["BF16_RATE"] = rate


@guarded("timing")
def time_init_70b(quick):
    import torch
    from condinit.init import conditioned_init_layers_
    L, D, H, Hkv, d = (8 if quick else 80), 8192, 64, 8, 128
    if DRY:
        L, D, H, Hkv = 1, 1024, 8, 2
    layers = [dict(q=torch.empty(H * d, D, device=DEV), k=torch.empty(Hkv * d, D, device=DEV),
                   v=torch.empty(Hkv * d, D, device=DEV)) for _ in range(L)]
    ms = cuda_time(lambda: conditioned_init_layers_(layers, num_heads=H, num_kv_heads=Hkv, seed=0),
                   warmup=1, iters=3)
    nblocks = L * (H + Hkv)

    # batched QR: cuSOLVER loops over the batch (pytorch#143281), so time 640 blocks, extrapolate
    qr_blocks = min(nblocks, 640)

    def batched_qr():
        g = torch.randn(qr_blocks, D, d, device=DEV)
        q, r = torch.linalg.qr(g)
        q.mul_(torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2))
    ms_qr = cuda_time(batched_qr, warmup=1, iters=3) * nblocks / qr_blocks
    # per-head orthogonal_ loop: time 64 heads, extrapolate (the full loop takes minutes)
    w = torch.empty(d, D, device=DEV)
    ms_loop64 = cuda_time(lambda: [torch.nn.init.orthogonal_(w) for _ in range(64)], warmup=1, iters=3)
    ms_loop = ms_loop64 * nblocks / 64
    tag = f"Llama-3-70B Q/K/V ({L} layers, {nblocks} blocks 128x8192)"
    TIMINGS.append((tag, ms, f"batched torch.linalg.qr (extrapolated from {qr_blocks})", ms_qr, f"{ms_qr / ms:.1f}x"))
    TIMINGS.append((tag, ms, "per-head orthogonal_ loop (extrapolated from 64)", ms_loop, f"{ms_loop / ms:.0f}x"))
    # fp32 writes of Q/K/V once: the bandwidth floor
    nbytes = 4 * L * (H + 2 * Hkv) * d * D
    log(f"   init writes {nbytes / 1e9:.1f} GB: floor at 4.8 TB/s = {nbytes / 4.8e12 * 1e3:.1f} ms")


@guarded("timing")
def time_attention_jvp(quick):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import condinit
    B, H, N, d = 1, 16, (4096 if quick else 8192), 128
    dtype = torch.bfloat16
    if DRY:
        H, N, dtype = 2, 256, torch.float32
    rate = globals().get("BF16_RATE")

    def reset_peak():
        if DEV == "cuda":
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        return 0

    def peak(base):
        return torch.cuda.max_memory_allocated() - base if DEV == "cuda" else float("nan")
    for causal in (False, True):
        q, k, v, tq, tk, tv = (torch.randn(B, H, N, d, device=DEV, dtype=dtype) for _ in range(6))
        fwd_flops = 4 * B * H * N * N * d * (0.5 if causal else 1.0)

        def math_jvp():
            with sdpa_kernel(SDPBackend.MATH):
                return torch.func.jvp(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal),
                                      (q, k, v), (tq, tk, tv))
        base = reset_peak()
        ms_math = cuda_time(math_jvp, warmup=1, iters=3)
        mem_math = peak(base)
        for backend in GPU_BACKENDS:
            try:
                fn = lambda: condinit.attention_jvp(q, k, v, tq, tk, tv, causal=causal, backend=backend)
                base = reset_peak()
                ms = cuda_time(fn, warmup=2, iters=5)
                mem = peak(base)
            except Exception as exc:
                record("timing", f"attention_jvp {backend} causal={causal}", "ERROR", str(exc))
                continue
            tflops = 3 * fwd_flops / ms / 1e9
            extra = f"{ms_math / ms:.1f}x faster, {tflops:.0f} TFLOP/s"
            if rate:
                extra += f" = {100 * tflops / rate:.0f}% of bf16 matmul"
            extra += f", mem {mem / 2**20:.0f} MiB vs {mem_math / 2**20:.0f} MiB"
            TIMINGS.append((f"attention_jvp {backend} {str(dtype)[6:]} B{B} H{H} N{N} d{d} causal={causal}", ms,
                            "torch.func.jvp(SDPA MATH)", ms_math, extra))
        # forward and multi-probe, best backend
        fwd_ms = cuda_time(lambda: condinit.attention(q, k, v, causal=causal), warmup=2, iters=5)
        with sdpa_kernel(SDPBackend.MATH if DRY else SDPBackend.FLASH_ATTENTION):
            sdpa_ms = cuda_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), warmup=2, iters=5)
        TIMINGS.append((f"attention fwd {str(dtype)[6:]} N{N} causal={causal}", fwd_ms, "SDPA flash", sdpa_ms,
                        f"{fwd_flops / fwd_ms / 1e9:.0f} TFLOP/s"))
        P = 8
        tqs, tks, tvs = (torch.randn(P, B, H, N // 2, d, device=DEV, dtype=dtype) for _ in range(3))
        qh, kh, vh = q[:, :, : N // 2].contiguous(), k[:, :, : N // 2].contiguous(), v[:, :, : N // 2].contiguous()
        ms_multi = cuda_time(lambda: condinit.attention_jvp(qh, kh, vh, tqs, tks, tvs, causal=causal), 1, 3)
        ms_sep = cuda_time(lambda: [condinit.attention_jvp(qh, kh, vh, tqs[p], tks[p], tvs[p], causal=causal)
                                    for p in range(P)], 1, 3)
        TIMINGS.append((f"attention_jvp P={P} probes, N{N // 2} causal={causal}", ms_multi,
                        f"{P} separate attention_jvp calls", ms_sep, f"{ms_sep / ms_multi:.2f}x"))
        del q, k, v, tq, tk, tv
        if DEV == "cuda":
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------- main
def main():
    global LOG
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_log = os.path.join(os.environ["OUT"], "gpu_check.log") if os.environ.get("OUT") else "gpu_check.log"
    parser.add_argument("--log", default=default_log)
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smaller timing shapes")
    parser.add_argument("--autotune", action="store_true",
                        help="let the Triton attention kernels autotune for the timings (adds ~1-2 min); "
                             "default: their first, pre-screened config")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run the script's logic on the CPU at toy sizes with the CPU backends (no build)")
    args = parser.parse_args()
    global DRY, DEV, GPU_BACKENDS, RANDN_BACKEND
    if args.cpu_dry_run:
        DRY, DEV, GPU_BACKENDS, RANDN_BACKEND = True, "cpu", ("cpp-cpu", "torch"), "cpp-cpu"
        args.skip_build = True
    LOG = open(args.log, "w")
    t_start = time.perf_counter()
    import torch
    log(f"condinit gpu_check {time.strftime('%Y-%m-%d %H:%M:%S')}; python {sys.version.split()[0]}, "
        f"torch {torch.__version__}")
    if not DRY and not torch.cuda.is_available():
        log("no CUDA GPU visible: nothing to check")
        return 1
    device_name = "CPU dry run" if DRY else torch.cuda.get_device_name(0)
    if not DRY:
        log(f"GPU: {device_name}, capability {torch.cuda.get_device_capability(0)}")
    if not args.skip_build:
        if not build():
            log("build failed: the checks run with whatever backends load")
        # the freshly built extension must be imported by a new interpreter
        cmd = [sys.executable, os.path.abspath(__file__), "--skip-build", "--log", args.log + ".checks"]
        cmd += ["--quick"] * args.quick + ["--autotune"] * args.autotune
        rc = subprocess.call(cmd)
        LOG.write(open(args.log + ".checks").read())
        LOG.close()
        os.remove(args.log + ".checks")
        return rc
    from condinit.commands.info import collect
    info = collect()
    log(f"native extension: {info['native_extension']}")
    for row in info["backends"]:
        if row["device"] == DEV:
            log(f"   {row['op']:<24} {row['backend']:<8} {'yes' if row['available'] else 'no '} {row['reason']}")
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh inputs each run
    check_randn()
    check_orthogonalize()
    check_conditioned_init_gpu_equals_cpu()
    # correctness checks run many shapes: no autotuning there (each config would compile)
    os.environ["CONDINIT_ATTN_AUTOTUNE"] = "0"
    for backend in GPU_BACKENDS:
        check_attention(backend)
    os.environ["CONDINIT_ATTN_AUTOTUNE"] = "1" if args.autotune else "0"
    time_matmul_rate()
    time_init_70b(args.quick)
    time_attention_jvp(args.quick)

    log("")
    log(f"=== condinit gpu_check summary ({device_name}, torch {torch.__version__}, "
        f"{time.perf_counter() - t_start:.0f} s) ===")
    failed = [r for r in RESULTS if r[2] != "PASS"]
    log(f"checks: {len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    for sec, name, status, detail in failed:
        log(f"  {status} {sec}: {name} {detail}")
    log(f"{'what':<62} {'condinit ms':>11}  {'baseline':<44} {'ms':>9}  note")
    for what, ms, base, base_ms, extra in TIMINGS:
        bms = "" if math.isnan(base_ms) else f"{base_ms:9.2f}"
        log(f"{what:<62} {ms:11.2f}  {base:<44} {bms:>9}  {extra}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
