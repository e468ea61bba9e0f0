"""The CUDA attention kernels (csrc/attention/*.cu) on the CPU, through the
emulator of csrc/attention/emu (see its README.md): the .cu files compiled unchanged as host C++
against mock CUDA headers, with ``__CUDA_ARCH__ = 800`` as in nvcc's device pass, so fp16 / bf16
run the mma.sync code the GPU runs (the emulated mma.sync uses the PTX fragment layouts); one
thread per CUDA thread, shared memory filled with a NaN pattern.

It checks what a GPU-less machine can check of those kernels: fragment layouts, tiling, head-dim
padding, the masks, the online softmax, the per-probe JVP blocks, the two backward kernels,
synchronization and the launch plan under a shared-memory limit. Against float64 autograd of the
naive masked attention of tests/attention_cases.py. The emulator runs one CTA at a time: tiny
shapes.
"""
import ctypes
import math
import pathlib
import shutil
import sys

import pytest
import torch

from attention_cases import allowed_pairs, f64, joint_floor, make_qkv, make_tangents, naive_masked, randn
from conftest import assert_close

EMU_DIR = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "attention" / "emu"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++ (C++20)")]

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


def _run_emu():
    sys.path.insert(0, str(EMU_DIR))
    try:
        import run_emu
    finally:
        sys.path.remove(str(EMU_DIR))
    return run_emu


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    """The emulated kernels, built once per module by csrc/attention/emu/run_emu.py's build()."""
    return _run_emu().build(str(tmp_path_factory.mktemp("attention_emu")), arch=800)


def reference(q, k, v, tq, tk, tv, dout, causal, scale, window=None, q_lens=None, kv_lens=None):
    """float64 (out, tangents [P, ...], lse, (dq, dk, dv)) of the naive masked attention."""
    x = f64(q, k, v, tq, tk, tv, dout)
    (B, H, Nq, _), Nk = q.shape, k.shape[2]
    allowed = allowed_pairs(B, Nq, Nk, causal, window, q_lens, kv_lens)
    fn = lambda a, b, c: naive_masked(a, b, c, allowed, scale)  # noqa: E731
    out = fn(*x[:3])
    touts = torch.stack([torch.func.jvp(fn, x[:3], (x[3][p], x[4][p], x[5][p]))[1] for p in range(tq.shape[0])])
    grads = torch.func.vjp(fn, *x[:3])[1](x[6])
    group = H // k.shape[1]
    s = scale * x[0] @ x[1].repeat_interleave(group, 1).transpose(-1, -2)
    lse = torch.logsumexp(torch.where(allowed, s, -math.inf), -1)
    return out, touts, lse, grads, allowed


def check_all(emu, dtype, B, H, Hkv, Nq, Nk, d, causal, P, rng, window=None, q_lens=None, kv_lens=None):
    scale = 0.7 * d ** -0.5
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, d, dtype, rng)
    tq, tk, tv = make_tangents(q, k, v, P, rng)
    dout = randn(q.shape, dtype, rng)
    masks = dict(window=window, q_lens=q_lens, kv_lens=kv_lens)
    out, lse = emu.fwd(q, k, v, causal, scale, **masks)
    out_j, tout, lse_j = emu.jvp(q, k, v, tq, tk, tv, causal, scale, **masks)
    dq, dk, dv = emu.bwd(dout, q, k, v, out, lse, causal, scale, **masks)
    ref_out, ref_tout, ref_lse, ref_grads, allowed = reference(q, k, v, tq, tk, tv, dout, causal, scale, **masks)

    assert_close(out, ref_out, dtype, "fwd out")
    assert_close(out_j, ref_out, dtype, "jvp out")
    assert_close(tout, ref_tout, dtype, "tangent")
    floor = joint_floor(ref_grads)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert_close(got, ref, dtype, name, floor)
    empty = ~allowed.any(-1).expand(B, H, Nq)  # rows with no allowed key
    for name, got in (("fwd lse", lse), ("jvp lse", lse_j)):
        assert torch.isneginf(got[empty]).all(), f"{name}: a row with no allowed key has lse -inf"
        assert_close(got[~empty], ref_lse[~empty], FP32, name, floor=1.0)
    assert (out[empty] == 0).all() and (tout[:, empty] == 0).all() and (dq[empty] == 0).all()
    return q, k, v, out


# (B, H, Hkv, Nq, Nk, d, causal, P): ragged N and several tiles, causal both ways (Nq > Nk: rows
# that see no key), GQA 1 / 2 / 4 / 8, head dims 16, 72 and 128 (72 padded to 80 inside the kernels),
# one head dim that is not a multiple of the 16-byte vector (element-wise loads), one above 128
# (two blocks per row tile, one per output-column chunk), one to three probes.
CASES = [
    (1, 8, 1, 17, 17, 16, True, 3),      # GQA 8
    (1, 2, 2, 40, 7, 16, True, 1),
    (1, 4, 1, 33, 70, 72, False, 1),
    (1, 2, 1, 21, 37, 128, True, 1),
    (1, 2, 2, 9, 11, 5, False, 1),
    (1, 2, 1, 9, 20, 200, True, 2),     # two output-column chunks (128 + 80 of 208 padded)
    (1, 2, 1, 128, 128, 64, False, 1),  # every tile inside the mask: the full-tile path only
    (1, 4, 2, 150, 141, 32, True, 1),   # full tiles below the diagonal, boundary tiles, ragged tails
]


def _case_id(c):
    return "B{}H{}kv{}-{}x{}-d{}{}-P{}".format(*c[:6], "-causal" if c[6] else "", c[7])


# fp16 runs the bf16 code with the other mma.sync type: on the first three cases.
PARAMS = [pytest.param(c, dt, id=f"{_case_id(c)}-{str(dt)[6:]}")
          for i, c in enumerate(CASES) for dt in ((FP32, BF16, FP16) if i < 3 else (FP32, BF16))]


@pytest.mark.parametrize("case,dtype", PARAMS)
def test_emulated_kernels_against_float64(emu, case, dtype, rng):
    check_all(emu, dtype, *case, rng)


# Masks: sliding window (Hugging Face W = 5: causal, left 4), a two-sided window, per-sequence
# lengths (an empty query sequence, an empty key sequence, rows past Lq), all together with GQA.
MASKS = {
    "sliding-window": dict(causal=True, window=(4, -1)),
    "two-sided-window": dict(causal=False, window=(3, 2)),
    "lens": dict(causal=False, q_lens=[17, 0, 9], kv_lens=[30, 12, 0]),
    "causal-window-lens": dict(causal=True, window=(6, -1), q_lens=[13, 17, 4], kv_lens=[30, 5, 21]),
}


def _check_mask(emu, masks, mask, dtype, rng, *shape):
    m = dict(masks[mask])
    causal = m.pop("causal")
    check_all(emu, dtype, *shape[:6], causal, shape[6], rng, **m)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_emulated_kernels_masks(emu, mask, dtype, rng):
    _check_mask(emu, MASKS, mask, dtype, rng, 3, 4, 2, 17, 30, 24, 2)


# Long enough for tiles entirely inside the mask next to boundary tiles (64-key tiles of 16-row warps):
# a wide window, lengths with ragged tails and an empty sequence, and both with the causal mask.
LONG_MASKS = {
    "wide-window": dict(causal=False, window=(90, 70)),
    "long-lens": dict(causal=False, q_lens=[150, 0, 67], kv_lens=[133, 70, 150]),
    "causal-window-lens": dict(causal=True, window=(100, -1), q_lens=[150, 97, 129], kv_lens=[150, 141, 64]),
}


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
@pytest.mark.parametrize("mask", LONG_MASKS, ids=str)
def test_emulated_kernels_long_masks(emu, mask, dtype, rng):
    _check_mask(emu, LONG_MASKS, mask, dtype, rng, 3, 2, 1, 150, 150, 16, 1)


# Tile shapes of the kernels' mask tests: a warp's 16 rows against 64 / 32 / 16 keys, and a key-side
# warp's 16 keys against 32 / 16 queries.
TILE_SHAPES = ((16, 64), (16, 32), (16, 16), (32, 16))


@pytest.mark.parametrize("mask", [dict(causal=True), dict(causal=False, window=(40, 25)),
                                  dict(causal=True, window=(40, -1), q_lens=[90, 31], kv_lens=[70, 101]),
                                  dict(causal=False, window=(3_000_000, 2_500_000), q_lens=[0, 57]),
                                  dict(causal=True, window=(-1, 9), kv_lens=[0, 99])], ids=str)
def test_tile_mask_matches_the_mask(emu, mask, rng):
    """mask.cuh's tile_mask (32-bit offsets from the tile's corner, clamped) allows exactly the
    pairs of the mask, and calls a tile full exactly when all its pairs are allowed."""
    B, Nq, Nk = 2, 101, 113
    causal, window = mask["causal"], mask.get("window")
    q_lens, kv_lens = mask.get("q_lens"), mask.get("kv_lens")
    allowed = torch.zeros(B, Nq + 64, Nk + 64, dtype=torch.bool)  # tiles may reach past Nq / Nk
    allowed[:, :Nq, :Nk] = allowed_pairs(B, Nq, Nk, causal, window, q_lens, kv_lens)[:, 0]
    n_full = 0
    for b in range(B):
        for nq, nk in TILE_SHAPES:
            for _ in range(40):
                q0 = int(torch.randint(0, Nq, (1,), generator=rng))
                k0 = int(torch.randint(0, Nk, (1,), generator=rng))
                ok, full = emu.tile_mask(B, Nq, Nk, causal, window, q_lens, kv_lens, b, q0, k0, nq, nk)
                ref = allowed[b, q0:q0 + nq, k0:k0 + nk]
                assert torch.equal(ok, ref), (b, q0, k0, nq, nk)
                assert full == bool(ref.all()), (b, q0, k0, nq, nk)
                n_full += full
    assert n_full > 0  # both kinds of tile were drawn


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
def test_emulated_nan_propagation(emu, dtype, rng):
    """A NaN in an allowed (query, key) pair makes the row NaN; masked entries (past kv_lens, above
    the causal diagonal) holding NaN or Inf change nothing."""
    B, H, N, d, scale = 1, 1, 20, 16, 0.25
    q, k, v = make_qkv(B, H, H, N, N, d, dtype, rng)
    clean, _ = emu.fwd(q, k, v, True, scale, kv_lens=[16])
    k2, v2, q2 = k.clone(), v.clone(), q.clone()
    k2[0, 0, 10, 3] = math.nan      # allowed for rows >= 10 (causal), masked above the diagonal
    k2[0, 0, 18, :] = math.inf      # past kv_lens: never read
    v2[0, 0, 17, 0] = math.nan      # past kv_lens
    q2[0, 0, 4, 1] = math.nan       # row 4 only
    out, lse = emu.fwd(q2, k2, v2, True, scale, kv_lens=[16])
    # kv_lens = 16 with Nq = 20: off = -4, row i attends keys j <= i - 4 (rows 0..3 attend nothing).
    nan_rows = torch.isnan(out[0, 0]).any(-1)
    expect = torch.zeros(N, dtype=torch.bool)
    expect[14:] = True              # rows that attend key 10
    expect[4] = True                # the NaN query row (it attends key 0)
    assert nan_rows.tolist() == expect.tolist()
    assert torch.isnan(lse[0, 0, expect]).all()
    keep = ~expect
    assert torch.equal(out[0, 0, keep], clean[0, 0, keep])
    assert (out[0, 0, :4] == 0).all()  # rows with no allowed key


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
def test_emulated_nonfinite_values_in_masked_v(emu, dtype, rng):
    """NaN / Inf in V or V' at a key that the causal mask hides from some rows of the same tile:
    those rows are unchanged; the rows that attend the key get NaN (out and tangent for V, the
    tangent only for V')."""
    B, H, N, d, scale = 1, 1, 24, 16, 0.25
    q, k, v = make_qkv(B, H, H, N, N, d, dtype, rng)
    tq, tk, tv = make_tangents(q, k, v, 1, rng)
    out0, tout0, _ = emu.jvp(q, k, v, tq, tk, tv, True, scale)
    v2, tv2 = v.clone(), tv.clone()
    v2[0, 0, 9, 2] = math.nan       # rows >= 9 attend key 9
    tv2[0, 0, 0, 15, 0] = math.inf  # rows >= 15 attend key 15
    out, tout, _ = emu.jvp(q, k, v2, tq, tk, tv2, True, scale)
    rows = torch.arange(N)
    assert torch.equal(out[0, 0, :9], out0[0, 0, :9]) and torch.equal(tout[0, 0, 0, :9], tout0[0, 0, 0, :9])
    assert torch.isnan(out[0, 0, 9:]).all() and torch.isnan(tout[0, 0, 0, 9:]).all()
    out_t, tout_t, _ = emu.jvp(q, k, v, tq, tk, tv2, True, scale)
    assert torch.equal(out_t, out0)                                  # V' never enters out
    nan_rows = torch.isnan(tout_t[0, 0, 0]).all(-1)
    assert nan_rows.tolist() == (rows >= 15).tolist()
    assert torch.equal(tout_t[0, 0, 0, :15], tout0[0, 0, 0, :15])
    fwd_out, _ = emu.fwd(q, k, v2, True, scale)
    assert torch.equal(torch.isnan(fwd_out[0, 0]).all(-1), rows >= 9)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
def test_emulated_nonfinite_values_in_full_tiles(emu, dtype, rng):
    """NaN / Inf in V or V' at a key every row of the block attends (a tile inside the mask, where
    the kernel keeps non-finite values): they reach every row through P V, in their own column, as in
    the reference; the other columns, and out for V', are unchanged."""
    B, H, N, d, scale = 1, 1, 64, 16, 0.25
    q, k, v = make_qkv(B, H, H, N, N, d, dtype, rng)
    tq, tk, tv = make_tangents(q, k, v, 1, rng)
    v2, tv2 = v.clone(), tv.clone()
    v2[0, 0, 40, 3] = math.nan
    tv2[0, 0, 0, 7, 1] = math.inf
    clean, _ = emu.fwd(q, k, v, False, scale)
    out, _ = emu.fwd(q, k, v2, False, scale)
    other = torch.arange(d) != 3
    assert torch.isnan(out[0, 0, :, 3]).all() and torch.equal(out[..., other], clean[..., other])
    out0, tout0, _ = emu.jvp(q, k, v, tq, tk, tv, False, scale)
    out_t, tout_t, _ = emu.jvp(q, k, v, tq, tk, tv2, False, scale)
    other = torch.arange(d) != 1
    assert torch.equal(out_t, out0) and not torch.isfinite(tout_t[0, 0, 0, :, 1]).any()
    assert torch.equal(tout_t[..., other], tout0[..., other])


# A block of two warps: each thread copies 16 bytes into shared memory by cp.async, then reads the
# chunk of a thread of the other warp after a barrier, with the wait before the barrier or not.
_CP_ASYNC_PROBE = r"""
#include "attention/cuda/primitives.cuh"
using namespace condinit::attention_cuda;
struct Probe { const float* src; float* out; int wait_first; };
__global__ void probe_kernel(const Probe p) {
  CONDINIT_DYNAMIC_SMEM(smem);
  float* s = reinterpret_cast<float*>(smem);
  cp_async16(s + 4 * threadIdx.x, p.src + 4 * threadIdx.x, threadIdx.x % 2 ? 16 : 0);
  cp_async_commit();
  if (p.wait_first) cp_async_wait<0>();
  __syncthreads();
  for (int i = 0; i < 4; ++i) p.out[4 * threadIdx.x + i] = s[4 * ((threadIdx.x + 32) % blockDim.x) + i];
  cp_async_wait<0>();
}
extern "C" void run_probe(const float* src, float* out, int wait_first) {
  CONDINIT_LAUNCH(probe_kernel, dim3(1), 64, 64 * 16, nullptr, (Probe{src, out, wait_first}));
}
"""


def test_emulated_cp_async_lands_at_its_wait(tmp_path):
    """The emulated cp.async: with wait_group before the barrier every thread reads the other warp's
    16 bytes (or the zero fill of a 0-byte copy); without it, a chunk read before its thread's wait
    is still undefined (NaN)."""
    src_file = tmp_path / "cp_async_probe.cc"
    src_file.write_text(_CP_ASYNC_PROBE)
    lib = _run_emu().compile_library(str(tmp_path / "libprobe.so"), [str(src_file)])
    src = torch.randn(64 * 4, generator=torch.Generator().manual_seed(1))
    expect = src.view(64, 4).clone()
    expect[0::2] = 0.0                                   # even threads copy 0 bytes: zero fill
    expect = expect.roll(-32, 0)                          # thread t reads thread t + 32 (mod 64)
    for wait_first in (1, 0):
        out = torch.full((64 * 4,), 7.0)
        lib.run_probe(ctypes.c_void_p(src.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_int(wait_first))
        if wait_first:
            assert torch.equal(out.view(64, 4), expect)
        else:  # the warp that passes the barrier first reads before the other warp's wait
            assert torch.isnan(out).any()


def test_emulated_launch_plan_under_a_small_shared_memory_limit(emu, rng, monkeypatch):
    """A 72 KiB limit forces two warps per block instead of four (fp32, d = 128): same results."""
    limit = 72 * 1024
    monkeypatch.setenv("EMU_SMEM", str(limit))
    plans = {kind: emu.plan(kind, FP32, 128, limit) for kind in ("fwd", "jvp", "dq", "dkdv")}
    assert all(p["warps"] == 2 and p["smem_bytes"] <= limit for p in plans.values()), plans
    check_all(emu, FP32, 1, 2, 1, 19, 23, 128, True, 1, rng)


def test_emulated_16_bit_dtypes_need_sm80(emu, monkeypatch):
    """Below sm_80 (no bf16 / fp16 mma.sync) the launchers refuse 16-bit dtypes; fp32 runs."""
    monkeypatch.setenv("EMU_ARCH_MAJOR", "7")
    g = torch.Generator().manual_seed(0)
    for dtype in (BF16, FP16):
        q, k, v = make_qkv(1, 1, 1, 4, 4, 16, dtype, g)
        with pytest.raises(AssertionError, match="launch failed: 801"):
            emu.fwd(q, k, v, False, 0.25)
    q, k, v = make_qkv(1, 1, 1, 4, 4, 16, FP32, g)
    assert torch.isfinite(emu.fwd(q, k, v, False, 0.25)[0]).all()


# Tangent backward: (B, H, Hkv, Nq, Nk, d, causal, P, masks).
JVP_BWD_CASES = [
    (1, 2, 1, 17, 17, 16, True, 1, {}),
    (1, 4, 2, 20, 33, 72, True, 2, {}),                                   # two probes: per-probe tiles
    (2, 2, 1, 13, 21, 24, False, 1, dict(window=(3, 2), q_lens=[13, 5], kv_lens=[21, 0])),
    (1, 1, 1, 9, 12, 136, False, 1, {}),                                  # two output-column chunks
    (1, 2, 1, 130, 120, 16, True, 1, {}),                                 # full and boundary tiles
    (2, 2, 2, 100, 90, 16, False, 2, dict(window=(60, 40), q_lens=[100, 70], kv_lens=[83, 90])),
]


# fp16 shares the bf16 code (another mma.sync type): one case.
JVP_BWD_PARAMS = [pytest.param(c, dt, id=_case_id(c[:8]) + ("-masks" if c[8] else "") + f"-{str(dt)[6:]}")
                  for c in JVP_BWD_CASES for dt in (FP32, BF16)]
JVP_BWD_PARAMS.append(pytest.param(JVP_BWD_CASES[0], FP16, id=_case_id(JVP_BWD_CASES[0][:8]) + "-float16"))


@pytest.mark.parametrize("case,dtype", JVP_BWD_PARAMS)
def test_emulated_tangent_backward_against_float64(emu, case, dtype, rng):
    """Gradients of <gO, out> + <gO', tout> w.r.t. q, k, v, tq, tk, tv (the MeanFlow-style loss on the
    tangent included) against float64 autograd through the naive masked JVP."""
    check_tangent_backward(emu, dtype, case, rng)


def test_emulated_one_warp_blocks(emu, rng, monkeypatch):
    """Shared-memory limits that leave one or two warps per block (fp32, d = 200: 52 16-byte copies
    per tile row, more than the block's threads, so a thread's copies step along a row): same results."""
    for limit, kinds in ((96 * 1024, ("fwd", "jvp", "dq", "dkdv")), (112 * 1024, ("jvp_bwd_q", "jvp_bwd_kv"))):
        monkeypatch.setenv("EMU_SMEM", str(limit))
        warps = {kind: emu.plan(kind, FP32, 200, limit)["warps"] for kind in kinds}
        assert min(warps.values()) == 1 and max(warps.values()) <= 2, warps
        if limit == 96 * 1024:
            check_all(emu, FP32, 1, 2, 1, 21, 37, 200, True, 1, rng, window=(9, -1))
        else:
            check_tangent_backward(emu, FP32, (1, 2, 1, 19, 23, 200, True, 1, {}), rng)


def check_tangent_backward(emu, dtype, case, rng):
    B, H, Hkv, Nq, Nk, d, causal, P, masks = case
    scale = 0.7 * d ** -0.5
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, d, dtype, rng)
    tq, tk, tv = make_tangents(q, k, v, P, rng)
    gout, gtout = randn(q.shape, dtype, rng), randn(tq.shape, dtype, rng)
    out, tout, lse = emu.jvp(q, k, v, tq, tk, tv, causal, scale, **masks)
    grads = emu.jvp_bwd(gout, gtout, q, k, v, tq, tk, tv, out, tout, lse, causal, scale, **masks)

    x = [t.requires_grad_() for t in f64(q, k, v, tq, tk, tv)]
    allowed = allowed_pairs(B, Nq, Nk, causal, masks.get("window"), masks.get("q_lens"), masks.get("kv_lens"))
    fn = lambda a, b, c: naive_masked(a, b, c, allowed, scale)  # noqa: E731
    ref_tout = torch.stack([torch.func.jvp(fn, tuple(x[:3]), (x[3][p], x[4][p], x[5][p]))[1] for p in range(P)])
    loss = (fn(*x[:3]) * f64(gout)[0]).sum() + (ref_tout * f64(gtout)[0]).sum()
    refs = torch.autograd.grad(loss, x)
    floor = joint_floor(refs)
    for name, got, ref in zip(("dq", "dk", "dv", "dtq", "dtk", "dtv"), grads, refs):
        assert_close(got, ref, dtype, name, floor)
    if "kv_lens" in masks:  # padded keys get zero gradients
        for b, lk in enumerate(masks["kv_lens"]):
            for g in grads[1:3]:
                assert (g[b, :, lk:] == 0).all()
            for g in grads[4:6]:
                assert (g[:, b, :, lk:] == 0).all()
