"""Build the CPU emulation of the CUDA attention kernels (csrc/attention/*.cu) and compare it with the float64 reference (see README.md).

    python csrc/attention/emu/run_emu.py [--smem 232448] [--case B,H,Hkv,Nq,Nk,d,causal,P ...] [--no-arch]
"""
import argparse
import ctypes
import glob
import math
import os
import re
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}   # attention_cuda.h's DType
SOURCES = sorted(glob.glob(os.path.join(HERE, "..", "*.cu")))


def kernel_kinds():
    """launch_plan's kernel kinds, read from kernel_kind.h: ``{"fwd": 0, ..., "jvp_bwd_kv": 6}``
    (``KernelKind::kJvpBwdKv`` -> ``"jvp_bwd_kv"``)."""
    with open(os.path.join(HERE, "..", "kernel_kind.h")) as f:
        body = re.search(r"enum class KernelKind[^{]*\{(.*?)\};", f.read(), re.S).group(1)
    return {re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower(): int(value)
            for name, value in re.findall(r"\bk(\w+)\s*=\s*(\d+)", body)}


KIND = kernel_kinds()


def build(outdir, arch=800):
    """Compile the kernels' .cu files unchanged as host C++ against mock/ (with ``CONDINIT_ATTN_EMU``:
    the launch and the dynamic shared memory go through the mock, mma.sync through mock/mma.h).
    ``arch`` sets ``__CUDA_ARCH__`` as nvcc's device pass does (800: the mma.sync path of fp16 /
    bf16 runs; None: no arch macro, where the 16-bit products trap)."""
    return Emulator(compile_library(os.path.join(outdir, "libemu.so"), [*SOURCES, os.path.join(HERE, "emu_wrap.cc")],
                                    arch))


def compile_library(lib, sources, arch=800):
    """``sources`` compiled as host C++ against mock/ into the shared library ``lib`` (a ctypes.CDLL)."""
    flags = ["-std=c++20", "-O2", "-fPIC", "-shared", "-pthread", "-fno-strict-aliasing", "-DCONDINIT_ATTN_EMU"]
    if arch is not None:
        flags.append(f"-D__CUDA_ARCH__={arch}")
    subprocess.check_call(["g++", *flags, "-I" + os.path.join(HERE, "mock"), "-I" + os.path.join(ROOT, "csrc"),
                           "-x", "c++", *sources, "-o", lib])
    return ctypes.CDLL(lib)


class Emulator:
    """ctypes front end of emu_wrap.cc: torch CPU tensors in, outputs NaN-filled before the launch."""

    def __init__(self, lib):
        self.lib = lib

    @staticmethod
    def _ptr(t):
        return ctypes.c_void_p(t.data_ptr()) if t is not None else ctypes.c_void_p(0)

    def _common(self, q, k, causal, scale, window, q_lens, kv_lens):
        (B, H, Nq, d), (Hkv, Nk) = q.shape, k.shape[1:3]
        left, right = window if window is not None else (-1, -1)
        dims = torch.tensor([B, H, Hkv, Nq, Nk, d, int(causal), left, right], dtype=torch.int64)
        lens = [None if x is None else torch.as_tensor(x, dtype=torch.int32).contiguous() for x in (q_lens, kv_lens)]
        self._keep = (dims, lens)
        return (self._ptr(dims), ctypes.c_float(scale), self._ptr(lens[0]), self._ptr(lens[1]))

    def fwd(self, q, k, v, causal, scale, window=None, q_lens=None, kv_lens=None):
        common = self._common(q, k, causal, scale, window, q_lens, kv_lens)
        out, lse = torch.full_like(q, math.nan), torch.full(q.shape[:3], math.nan)
        rc = self.lib.emu_fwd(DTYPE_CODE[q.dtype], *common, *map(self._ptr, (q, k, v, out, lse)))
        assert rc == 0, f"emulated fwd launch failed: {rc}"
        return out, lse

    def jvp(self, q, k, v, tq, tk, tv, causal, scale, window=None, q_lens=None, kv_lens=None):
        common = self._common(q, k, causal, scale, window, q_lens, kv_lens)
        out, lse, tout = torch.full_like(q, math.nan), torch.full(q.shape[:3], math.nan), torch.full_like(tq, math.nan)
        rc = self.lib.emu_jvp(DTYPE_CODE[q.dtype], *common, ctypes.c_int64(tq.shape[0]),
                              *map(self._ptr, (q, k, v, tq, tk, tv, out, tout, lse)))
        assert rc == 0, f"emulated jvp launch failed: {rc}"
        return out, tout, lse

    def bwd(self, dout, q, k, v, out, lse, causal, scale, window=None, q_lens=None, kv_lens=None):
        common = self._common(q, k, causal, scale, window, q_lens, kv_lens)
        delta = (dout.float() * out.float()).sum(-1).contiguous()   # D = rowsum(dO o O), as attention_cuda.cpp
        dq, dk, dv = torch.full_like(q, math.nan), torch.full_like(k, math.nan), torch.full_like(v, math.nan)
        rc = self.lib.emu_bwd(DTYPE_CODE[q.dtype], *common, *map(self._ptr, (dout, q, k, v, lse, delta, dq, dk, dv)))
        assert rc == 0, f"emulated bwd launch failed: {rc}"
        return dq, dk, dv

    def jvp_bwd(self, gout, gtout, q, k, v, tq, tk, tv, out, tout, lse, causal, scale, window=None, q_lens=None,
                kv_lens=None):
        """(dq, dk, dv, dtq, dtk, dtv): r from the kernel, then D and d' on the host (as
        attention_cuda.cpp), then the two gradient kernels."""
        common = self._common(q, k, causal, scale, window, q_lens, kv_lens)
        P = tq.shape[0]
        r = torch.full((P,) + tuple(q.shape[:3]), math.nan)
        rc = self.lib.emu_jvp_bwd_r(DTYPE_CODE[q.dtype], *common, ctypes.c_int64(P),
                                    *map(self._ptr, (q, k, tq, tk, lse, r)))
        assert rc == 0, f"emulated jvp_bwd_r launch failed: {rc}"
        o, to = out.float(), tout.float()
        dprime = (gtout.float() * o).sum(-1).contiguous()
        D = ((gout.float() * o).sum(-1) + ((gtout.float() * to).sum(-1) - r * dprime).sum(0)).contiguous()
        grads = [torch.full_like(x, math.nan) for x in (q, k, v, tq, tk, tv)]
        ptrs = (ctypes.c_void_p * 18)(*[x.data_ptr() for x in (gout, gtout, q, k, v, tq, tk, tv, lse, r, dprime, D,
                                                                *grads)])
        rc = self.lib.emu_jvp_bwd(DTYPE_CODE[q.dtype], *common, ctypes.c_int64(P), ptrs)
        assert rc == 0, f"emulated jvp_bwd launch failed: {rc}"
        return tuple(grads)

    def tile_mask(self, B, Nq, Nk, causal, window, q_lens, kv_lens, b, q0, k0, nq, nk):
        """mask.cuh's tile_mask of the tile at (query q0, key k0) of batch entry b, as a [nq, nk]
        bool tensor of its element test, and whether it calls the tile full."""
        left, right = window if window is not None else (-1, -1)
        dims = torch.tensor([B, 1, 1, Nq, Nk, 16, int(causal), left, right], dtype=torch.int64)
        lens = [None if x is None else torch.as_tensor(x, dtype=torch.int32).contiguous() for x in (q_lens, kv_lens)]
        ok = torch.zeros(nq, nk, dtype=torch.uint8)
        full = self.lib.emu_tile_mask(self._ptr(dims), self._ptr(lens[0]), self._ptr(lens[1]), ctypes.c_int64(b),
                                      ctypes.c_int64(q0), ctypes.c_int64(k0), ctypes.c_int(nq), ctypes.c_int(nk),
                                      self._ptr(ok))
        return ok.bool(), bool(full)

    def plan(self, kind, dtype, d, smem_limit):
        """launch_plan: dict(warps, smem_bytes, dpad, cols_per_block, loop_tile)."""
        out = (ctypes.c_int64 * 5)()
        self.lib.emu_plan(KIND[kind], DTYPE_CODE[dtype], ctypes.c_int64(d), ctypes.c_int64(smem_limit), out)
        return dict(zip(("warps", "smem_bytes", "dpad", "cols_per_block", "loop_tile"), list(out)))


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / (b.norm() + 1e-12)).item()


def reference(q, k, v, tq, tk, tv, dout, causal, scale):
    """float64 out, tangents, lse and (dq, dk, dv) of plain (causal) attention."""
    x = [t.double() for t in (q, k, v, tq, tk, tv, dout)]
    Nq, Nk, G = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    i, j = torch.arange(Nq)[:, None], torch.arange(Nk)[None, :]
    ok = (j <= i + Nk - Nq) if causal else torch.ones(Nq, Nk, dtype=torch.bool)

    def f(a, b, c):
        s = torch.where(ok, scale * a @ b.repeat_interleave(G, 1).transpose(-1, -2), -math.inf)
        seen = ok.any(-1, keepdim=True)
        return torch.where(seen, torch.softmax(torch.where(seen, s, 0.0), -1), 0.0) @ c.repeat_interleave(G, 1)

    out = f(*x[:3])
    touts = torch.stack([torch.func.jvp(f, tuple(x[:3]), (x[3][p], x[4][p], x[5][p]))[1] for p in range(tq.shape[0])])
    grads = torch.func.vjp(f, *x[:3])[1](x[6])
    lse = torch.logsumexp(torch.where(ok, scale * x[0] @ x[1].repeat_interleave(G, 1).transpose(-1, -2), -math.inf), -1)
    return out, touts, lse, grads


def run(emu, B, H, Hkv, Nq, Nk, d, causal, P, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    q, k, v = mk(B, H, Nq, d), mk(B, Hkv, Nk, d), mk(B, Hkv, Nk, d)
    tq, tk, tv = mk(P, B, H, Nq, d), mk(P, B, Hkv, Nk, d), mk(P, B, Hkv, Nk, d)
    do = mk(B, H, Nq, d)
    sc = 0.7 / math.sqrt(d)
    out, lse = emu.fwd(q, k, v, causal, sc)
    out2, tout, lse2 = emu.jvp(q, k, v, tq, tk, tv, causal, sc)
    dq, dk, dv = emu.bwd(do, q, k, v, out, lse, causal, sc)
    o_ref, t_ref, l_ref, (gq, gk, gv) = reference(q, k, v, tq, tk, tv, do, causal, sc)
    errs = dict(out=rel(out, o_ref), out_jvp=rel(out2, o_ref), tout=rel(tout, t_ref), dq=rel(dq, gq),
                dk=rel(dk, gk), dv=rel(dv, gv))
    inf_ok = torch.equal(torch.isneginf(lse), torch.isneginf(l_ref)) and torch.equal(torch.isneginf(lse2),
                                                                                     torch.isneginf(l_ref))
    fin = torch.isfinite(l_ref)
    lse_err = (lse.double()[fin] - l_ref[fin]).abs().max().item() if fin.any() else 0.0
    has_nan = any(torch.isnan(x).any().item() for x in (out, out2, tout, dq, dk, dv))
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    ok = inf_ok and not has_nan and all(e <= tol for e in errs.values()) and lse_err < 1e-4
    return ok, errs, lse_err


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smem", type=int, default=232448, help="emulated max shared memory per block (bytes)")
    ap.add_argument("--case", action="append", help="B,H,Hkv,Nq,Nk,d,causal(0/1),P")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    a = ap.parse_args()
    os.environ["EMU_SMEM"] = str(a.smem)
    cases = [tuple(int(x) for x in c.split(",")) for c in a.case] if a.case else \
        [(1, 2, 1, 17, 17, 16, 1, 2), (1, 2, 2, 40, 7, 32, 1, 1), (1, 4, 2, 33, 70, 80, 0, 2)]
    with tempfile.TemporaryDirectory() as tmp:
        emu = build(tmp)
        bad = 0
        for case in cases:
            for name in a.dtypes.split(","):
                dt = getattr(torch, name)
                ok, errs, lse_err = run(emu, *case[:6], bool(case[6]), case[7], dt)
                bad += not ok
                print(a.smem, case, name, "OK " if ok else "BAD", " ".join(f"{k}={v:.1e}" for k, v in errs.items()),
                      f"lse={lse_err:.1e}", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
