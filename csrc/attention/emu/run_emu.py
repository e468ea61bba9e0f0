"""Build the CPU emulation of attention_kernels.cu and compare it with the float64 reference (see README.md).

    python csrc/attention/emu/run_emu.py [--smem 232448] [--case B,H,Hkv,Nq,Nk,d,causal,P ...] [--no-wmma]
"""
import argparse
import ctypes
import math
import os
import re
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from attention_cases import naive_attention, naive_lse  # noqa: E402

DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def build(outdir, wmma):
    src = open(os.path.join(HERE, "..", "attention_kernels.cu")).read()
    src = src.replace("extern __shared__ __align__(128) unsigned char smem[];", "unsigned char* smem = mock_smem();")
    src, n = re.subn(r"(attention_\w+_kernel<T>)<<<\(unsigned\)blocks, ([^,]*), smem, stream>>>\(p\);",
                     r"emu_launch(\1, (unsigned)blocks, \2, smem, stream, p);", src)
    assert n == 2, "kernel launches not found"
    kern = os.path.join(outdir, "kern.cpp")
    open(kern, "w").write(src)
    lib = os.path.join(outdir, "libemu.so")
    arch = ["-D__CUDA_ARCH__=800"] if wmma else []  # 800: fp16/bf16 products go through the emulated WMMA
    subprocess.check_call(["g++", "-std=c++20", "-O2", "-fPIC", "-shared", "-pthread", *arch, "-I" + os.path.join(HERE, "mock"),
                           "-I" + os.path.join(HERE, ".."), "-x", "c++", kern, os.path.join(HERE, "emu_wrap.cc"),
                           "-o", lib])
    return ctypes.CDLL(lib)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / (b.norm() + 1e-12)).item()


def run(lib, B, H, Hkv, Nq, Nk, d, causal, P, dtype, seed=0):
    I, F = ctypes.c_int64, ctypes.c_float
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    q, k, v = mk(B, H, Nq, d), mk(B, Hkv, Nk, d), mk(B, Hkv, Nk, d)
    tq, tk, tv = mk(P, B, H, Nq, d), mk(P, B, Hkv, Nk, d), mk(P, B, Hkv, Nk, d)
    do = mk(B, H, Nq, d)
    sc, c, dims = 0.7 / math.sqrt(d), int(causal), (I(B), I(H), I(Hkv), I(Nq), I(Nk), I(d))
    nan = float("nan")
    out, lse = torch.full_like(q, nan), torch.full((B, H, Nq), nan)
    assert lib.emu_fwd(DT[dtype], *dims, c, F(sc), ptr(q), ptr(k), ptr(v), ptr(out), ptr(lse)) == 0
    out2, lse2, tout = torch.full_like(q, nan), torch.full((B, H, Nq), nan), torch.full_like(tq, nan)
    lib.emu_ws.restype = ctypes.c_int64
    ws = torch.full((lib.emu_ws(*dims, I(P)),), nan)
    assert lib.emu_jvp(DT[dtype], *dims, c, F(sc), I(P), ptr(q), ptr(k), ptr(v), ptr(tq), ptr(tk), ptr(tv),
                       ptr(out2), ptr(tout), ptr(lse2), ptr(ws)) == 0
    D = (do.float() * out.float()).sum(-1).contiguous()
    dq_acc, dk, dv = torch.zeros(B, H, Nq, d), torch.full_like(k, nan), torch.full_like(v, nan)
    assert lib.emu_bwd(DT[dtype], *dims, c, F(sc), ptr(do), ptr(q), ptr(k), ptr(v), ptr(lse), ptr(D), ptr(dq_acc),
                       ptr(dk), ptr(dv)) == 0
    q64, k64, v64, tq64, tk64, tv64, do64 = (x.double() for x in (q, k, v, tq, tk, tv, do))
    fn = lambda a, b, cc: naive_attention(a, b, cc, causal, sc)  # noqa: E731
    o_ref, l_ref = fn(q64, k64, v64), naive_lse(q64, k64, causal, sc)
    t_ref = torch.stack([torch.func.jvp(fn, (q64, k64, v64), (tq64[p], tk64[p], tv64[p]))[1] for p in range(P)])
    gq, gk, gv = torch.func.vjp(fn, q64, k64, v64)[1](do64)
    errs = dict(out=rel(out, o_ref), out_jvp=rel(out2, o_ref), tout=rel(tout, t_ref), dq=rel(dq_acc.to(dtype), gq),
                dk=rel(dk, gk), dv=rel(dv, gv))
    inf_ok = torch.equal(torch.isneginf(lse), torch.isneginf(l_ref)) and torch.equal(torch.isneginf(lse2), torch.isneginf(l_ref))
    fin = torch.isfinite(l_ref)
    lse_err = (lse.double()[fin] - l_ref[fin]).abs().max().item() if fin.any() else 0.0
    has_nan = any(torch.isnan(x).any().item() for x in (out, out2, tout, dq_acc, dk, dv))
    ok = inf_ok and not has_nan and all(e <= TOL[dtype] for e in errs.values()) and lse_err < 1e-5
    return ok, errs, lse_err


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smem", type=int, default=232448, help="emulated max shared memory per block (bytes)")
    ap.add_argument("--case", action="append", help="B,H,Hkv,Nq,Nk,d,causal(0/1),P")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--no-wmma", action="store_true", help="scalar products for fp16/bf16 too (no __CUDA_ARCH__)")
    a = ap.parse_args()
    os.environ["EMU_SMEM"] = str(a.smem)
    cases = [tuple(int(x) for x in c.split(",")) for c in a.case] if a.case else \
        [(1, 2, 1, 17, 17, 16, 1, 2), (1, 2, 2, 40, 7, 32, 1, 1), (1, 4, 2, 33, 70, 80, 0, 2)]
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(tmp, wmma=not a.no_wmma)
        bad = 0
        for case in cases:
            for name in a.dtypes.split(","):
                dt = getattr(torch, name)
                ok, errs, lse_err = run(lib, *case[:6], bool(case[6]), case[7], dt)
                bad += not ok
                print(a.smem, case, name, "OK " if ok else "BAD", " ".join(f"{k}={v:.1e}" for k, v in errs.items()),
                      f"lse={lse_err:.1e}", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
