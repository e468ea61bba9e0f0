"""The CUDA attention kernels (csrc/attention/attention_kernels.cu) on the CPU, through the
emulator of csrc/attention/emu (see its README.md): the .cu file compiled as host C++ against
mock CUDA headers, one thread per CUDA thread, shared memory filled with a NaN pattern.

It checks what a GPU-less machine can check of those kernels: tiling, masking, the online
softmax, the JVP workspace, synchronization and the tile-size choice under a shared-memory limit
(the fp16 / bf16 products go through the emulated WMMA fragments). Against the float64 naive
reference of tests/attention_cases.py. The emulator runs one CTA at a time: tiny shapes.
"""
import ctypes
import pathlib
import shutil
import sys

import pytest
import torch

from attention_cases import (empty_rows, f64, joint_floor, make_qkv, make_tangents,
                             naive_jvp, naive_lse, naive_vjp, randn)
from conftest import assert_close

EMU_DIR = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "attention" / "emu"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++ (C++20)")]

FP32 = torch.float32
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}   # emu_wrap.cc's DType


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    """The emulated kernels, built once per session by csrc/attention/emu/run_emu.py's build()."""
    sys.path.insert(0, str(EMU_DIR))
    try:
        import run_emu
    finally:
        sys.path.remove(str(EMU_DIR))
    return run_emu.build(str(tmp_path_factory.mktemp("attention_emu")), wmma=True)


def run_kernels(lib, q, k, v, tq, tk, tv, dout, causal, scale):
    """fwd, jvp and bwd launches of the emulated kernels, outputs NaN-filled beforehand."""
    i64, ptr = ctypes.c_int64, lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    (B, H, Nq, d), (Hkv, Nk), P = q.shape, k.shape[1:3], tq.shape[0]
    dims = tuple(i64(x) for x in (B, H, Hkv, Nq, Nk, d))
    common = (DTYPE_CODE[q.dtype], *dims, int(causal), ctypes.c_float(scale))
    nan = float("nan")
    out, lse = torch.full_like(q, nan), torch.full((B, H, Nq), nan)
    assert lib.emu_fwd(*common, ptr(q), ptr(k), ptr(v), ptr(out), ptr(lse)) == 0
    out_j, lse_j, tout = torch.full_like(q, nan), torch.full((B, H, Nq), nan), torch.full_like(tq, nan)
    lib.emu_ws.restype = ctypes.c_int64
    workspace = torch.full((lib.emu_ws(*dims, i64(P)),), nan)
    assert lib.emu_jvp(*common, i64(P), ptr(q), ptr(k), ptr(v), ptr(tq), ptr(tk), ptr(tv),
                       ptr(out_j), ptr(tout), ptr(lse_j), ptr(workspace)) == 0
    delta = (dout.float() * out.float()).sum(-1).contiguous()        # D = rowsum(dO o O), host side
    dq_acc = torch.zeros(B, H, Nq, d)                                 # float32 accumulator (atomics)
    dk, dv = torch.full_like(k, nan), torch.full_like(v, nan)
    assert lib.emu_bwd(*common, ptr(dout), ptr(q), ptr(k), ptr(v), ptr(lse), ptr(delta), ptr(dq_acc),
                       ptr(dk), ptr(dv)) == 0
    return out, lse, out_j, tout, lse_j, dq_acc.to(q.dtype), dk, dv


# (B, H, Hkv, Nq, Nk, d, causal, P): ragged N and several tiles, causal both ways (Nq > Nk: rows
# that see no key), GQA 2, a head dim that is not a power of two, one and two probes.
CASES = [
    (1, 2, 1, 17, 17, 16, True, 2),
    (1, 2, 2, 40, 7, 32, True, 1),
    (1, 2, 1, 33, 70, 80, False, 2),
]

def _case_id(c):
    return "B{}H{}kv{}-{}x{}-d{}{}-P{}".format(*c[:6], "-causal" if c[6] else "", c[7])


# Shared memory per block: 232448 (H100, the largest tiles) for every case and dtype, and 49152,
# which forces the smallest tiles (float32 needs the most), on the largest case.
PARAMS = [pytest.param(c, dt, 232448, id=f"{_case_id(c)}-{str(dt)[6:]}")
          for c in CASES for dt in (torch.float32, torch.float16, torch.bfloat16)]
PARAMS.append(pytest.param(CASES[2], torch.float32, 49152, id=f"{_case_id(CASES[2])}-float32-smem48k"))


@pytest.mark.parametrize("case,dtype,smem", PARAMS)
def test_emulated_cuda_kernels_against_float64(emu, case, dtype, smem, rng, monkeypatch):
    monkeypatch.setenv("EMU_SMEM", str(smem))   # read at every launch
    B, H, Hkv, Nq, Nk, d, causal, P = case
    scale = 0.7 * d ** -0.5
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, d, dtype, rng)
    tq, tk, tv = make_tangents(q, k, v, P, rng)
    dout = randn(q.shape, dtype, rng)
    out, lse, out_j, tout, lse_j, dq, dk, dv = run_kernels(emu, q, k, v, tq, tk, tv, dout, causal, scale)

    x64 = f64(q, k, v, tq, tk, tv)
    ref_out, ref_tout = naive_jvp(*x64, causal, scale)
    ref_grads = naive_vjp(*x64[:3], *f64(dout), causal, scale)
    ref_lse = naive_lse(*x64[:2], causal, scale)
    assert_close(out, ref_out, dtype, "fwd out")
    assert_close(out_j, ref_out, dtype, "jvp out")
    assert_close(tout, ref_tout, dtype, "tangent")
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert_close(g, r, dtype, name, joint_floor(ref_grads))
    empty = empty_rows(Nq, Nk, causal)
    for name, got in (("fwd lse", lse), ("jvp lse", lse_j)):
        assert torch.isneginf(got[..., :empty]).all(), f"{name}: a row that sees no key has lse -inf"
        assert_close(got[..., empty:], ref_lse[..., empty:], FP32, name, floor=1.0)
    assert (out[..., :empty, :] == 0).all() and (tout[..., :empty, :] == 0).all()
    assert (dq[..., :empty, :] == 0).all()
