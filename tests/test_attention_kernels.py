"""What only a direct call to an attention kernel can show (the op-level checks of every backend
are in tests/test_attention.py and tests/test_attention_jvp.py):

* the tiled torch reference: small tiles give what one tile gives (the online-softmax rescaling);
* the custom ops' fake kernels and the native (C++) ``condinit_C`` ops: output shapes and dtypes
  on meta tensors, and the layout checks that guard the kernels' memory accesses;
* the Triton kernels: unequal query / key tiles on the causal diagonal, an odd probe count
  against single-probe calls bit for bit, a deterministic backward, the GPU autotune lists, the
  JVP at the first tiles of the 16-bit GPU lists (64-key tiles), and the layout checks raised
  before a launch;
* the Triton kernels with masks (causal, sliding and two-sided windows, per-sequence lengths)
  called directly: forward, flash backward, JVP and the backward through the tangent output
  against float64 autograd of a naive masked attention written here, rows and keys that nothing
  attends, NaN in padded positions (ignored) and in attended entries (propagated), padded head
  dims, bf16 / fp16, and the tile ranges a window skips.
"""
import pytest
import torch

import condinit
from condinit.ops.attention import reference
from condinit.ops.attention.op import KERNEL_HEAD_DIMS

from attention_cases import (F64, f64, joint_floor, make_qkv, make_tangents, naive_attention,
                             naive_jvp, naive_vjp, randn, require)
from conftest import assert_close

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

FP32 = torch.float32
# The mask arguments of every attention op (window_left, window_right, q_lens, kv_lens): none.
NO_MASK = (-1, -1, None, None)


# ------------------------------------------------------------------------------------------------
# torch reference
# ------------------------------------------------------------------------------------------------

def test_reference_tiles_agree_with_one_tile(rng):
    """The online-softmax rescaling across key tiles and the causal tile skipping: 32 x 16 tiles
    give what one tile gives (the public op's default tiles are larger than the tested N)."""
    q, k, v = make_qkv(1, 4, 2, 70, 90, 16, F64, rng)
    tq, tk, tv = make_tangents(q, k, v, 2, rng)
    one = reference.attention_jvp(q, k, v, tq, tk, tv, True, 0.7, block_q=128, block_k=128)
    tiled = reference.attention_jvp(q, k, v, tq, tk, tv, True, 0.7, block_q=32, block_k=16)
    for name, a, b in zip(("out", "tangent", "lse"), tiled, one):
        assert_close(a, b, F64, name)
    dout = randn(q.shape, F64, rng)
    g1 = reference.attention_bwd(dout, q, k, v, one[0], one[2], True, 0.7, block_q=128, block_k=128)
    g2 = reference.attention_bwd(dout, q, k, v, one[0], one[2], True, 0.7, block_q=32, block_k=16)
    for name, a, b in zip(("dq", "dk", "dv"), g2, g1):
        assert_close(a, b, F64, name)


# ------------------------------------------------------------------------------------------------
# custom ops (fake kernels) and the native condinit_C ops
# ------------------------------------------------------------------------------------------------

def test_fake_kernels_shapes_and_dtypes():
    """The meta kernels torch.compile traces with: out like q, tangent [P, ...], lse [B, H, Nq]."""
    for dtype, lse_dtype in ((FP32, FP32), (torch.bfloat16, FP32), (F64, F64)):
        q = torch.empty(2, 4, 9, 16, device="meta", dtype=dtype)
        k = torch.empty(2, 2, 5, 16, device="meta", dtype=dtype)
        tq = torch.empty(3, 2, 4, 9, 16, device="meta", dtype=dtype)
        out, tout, lse = torch.ops.condinit.attention_jvp(q, k, k, tq, None, None, False, 1.0, *NO_MASK, "torch")
        assert (out.shape, tout.shape, lse.shape) == (q.shape, tq.shape, (2, 4, 9))
        assert out.dtype == tout.dtype == dtype and lse.dtype == lse_dtype
        out, lse = torch.ops.condinit.attention_fwd(q, k, k, True, 1.0, *NO_MASK, "torch")
        assert out.shape == q.shape and lse.dtype == lse_dtype
        dq, dk, dv = torch.ops.condinit.attention_bwd(q, q, k, k, q, lse, False, 1.0, *NO_MASK, "torch")
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)


@pytest.fixture
def native():
    require("cpp-cpu")
    return torch.ops.condinit_C


def test_native_meta_shapes(native):
    q = torch.empty(2, 4, 9, 16, device="meta")
    k = torch.empty(2, 2, 5, 16, device="meta")
    t = torch.empty(3, 2, 4, 9, 16, device="meta")
    tk = torch.empty(3, 2, 2, 5, 16, device="meta")
    out, tout, lse = native.attention_jvp(q, k, k, t, tk, tk, False, 1.0, *NO_MASK)
    assert out.shape == q.shape and tout.shape == t.shape and lse.shape == (2, 4, 9) and lse.dtype == FP32
    dq, dk, dv = native.attention_bwd(q, q, k, k, q, torch.empty(2, 4, 9, device="meta"), False, 1.0,
                                    *NO_MASK)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


def test_native_layout_checks(native):
    """The C++ kernels index raw pointers: a layout they cannot index raises, naming what."""
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    t5 = torch.randn(1, 1, 4, 8, 16)
    tk5 = torch.randn(1, 1, 2, 8, 16)
    lse = torch.zeros(1, 4, 8)
    fwd, jvp, bwd = native.attention_fwd, native.attention_jvp, native.attention_bwd
    bad = [
        ("float32, float16, bfloat16", fwd, (q.int(), k.int(), k.int(), False, 1.0)),
        ("same dtype", fwd, (q, k.double(), k, False, 1.0)),
        ("same shape", fwd, (q, k, k[:, :, :4], False, 1.0)),
        ("must divide", fwd, (q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16), False, 1.0)),
        ("head dim", fwd, (q, k[..., :8].contiguous(), k[..., :8].contiguous(), False, 1.0)),
        ("4-D", fwd, (q[0], k, k, False, 1.0)),
        ("contiguous", fwd, (q.transpose(2, 3).contiguous().transpose(2, 3), k, k, False, 1.0)),
        ("tq must have shape", jvp, (q, k, k, t5[:, :, :2], tk5, tk5, False, 1.0)),
        ("tk must have shape", jvp, (q, k, k, t5, t5, tk5, False, 1.0)),
        ("5-D", jvp, (q, k, k, q, k, k, False, 1.0)),
        ("dtype", jvp, (q, k, k, t5.double(), tk5, tk5, False, 1.0)),
        ("lse must be float32", bwd, (q, q, k, k, q, lse.double(), False, 1.0)),
        ("lse must have shape", bwd, (q, q, k, k, q, lse[:, :2], False, 1.0)),
        ("dout and out must have the shape", bwd, (q[:, :, :4], q, k, k, q, lse, False, 1.0)),
    ]
    for match, fn, args in bad:
        with pytest.raises(RuntimeError, match=match):
            fn(*args, *NO_MASK)


# ------------------------------------------------------------------------------------------------
# Triton kernels (under TRITON_INTERPRET=1)
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def triton_kernels():
    require("triton")
    from condinit.kernels import attention
    return attention


@pytest.mark.triton
@pytest.mark.parametrize("block_m, block_n", [(32, 16), (16, 32)])
def test_triton_unequal_tiles_on_the_causal_diagonal(triton_kernels, block_m, block_n, rng, nan_poison,
                                                     monkeypatch):
    """BLOCK_M != BLOCK_N (as on a GPU): the causal key range, the unmasked / masked split of the
    forward and dQ loops and the query range of the dK/dV loop, with Nq > Nk and Nq < Nk."""
    monkeypatch.setattr(triton_kernels.configs, "INTERPRET_CONFIG", dict(BLOCK_M=block_m, BLOCK_N=block_n))
    for n_q, n_k in ((40, 17), (17, 71)):
        q, k, v = make_qkv(1, 2, 1, n_q, n_k, 16, FP32, rng)
        tangents = make_tangents(q, k, v, 2, rng)
        dout = randn(q.shape, FP32, rng)
        out, tout = condinit.attention_jvp(q, k, v, *tangents, causal=True, scale=0.25, backend="triton")
        ref_out, ref_tout = naive_jvp(*f64(q, k, v, *tangents), True, 0.25)
        assert_close(out, ref_out, FP32, f"out {n_q}x{n_k}")
        assert_close(tout, ref_tout, FP32, f"tangent {n_q}x{n_k}")
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        grads = torch.autograd.grad(condinit.attention(*leaves, causal=True, scale=0.25, backend="triton"),
                                    leaves, dout)
        ref = naive_vjp(*f64(q, k, v, dout), True, 0.25)
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
            assert_close(g, r, FP32, f"{name} {n_q}x{n_k}")


@pytest.mark.triton
def test_triton_odd_probe_count_and_deterministic_backward(triton_kernels, rng, nan_poison):
    """P = 3 (the last program's second probe slot repeats a probe and must not be stored) equals
    three 4-D single-probe calls bit for bit, the JVP's out and lse are the forward's bits, and
    the backward gives the same bits twice."""
    q, k, v = make_qkv(1, 2, 1, 17, 17, 16, FP32, rng)
    tq, tk, tv = make_tangents(q, k, v, 3, rng)
    out, tout, lse = triton_kernels.attention_jvp(q, k, v, tq, tk, tv, True, 0.3)
    out_f, lse_f = triton_kernels.attention_fwd(q, k, v, True, 0.3)
    assert torch.equal(out, out_f) and torch.equal(lse, lse_f), "the JVP's primal tiles are the forward's"
    for p in range(3):
        _, tout1, _ = triton_kernels.attention_jvp(q, k, v, tq[p], tk[p], tv[p], True, 0.3)
        assert tout1.shape == q.shape and torch.equal(tout[p], tout1)
    assert_close(tout[2], naive_jvp(*f64(q, k, v, tq[2:], tk[2:], tv[2:]), True, 0.3)[1][0], FP32, "tangent 2")
    dout = randn(q.shape, FP32, rng)
    first = triton_kernels.attention_bwd(dout, q, k, v, out, lse, True, 0.3)
    second = triton_kernels.attention_bwd(dout, q, k, v, out, lse, True, 0.3)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert_close(out, naive_attention(*f64(q, k, v), True, 0.3), FP32, "out")


@pytest.mark.triton
def test_triton_gpu_launch_configs(triton_kernels):
    """The GPU launch lists (not run here): every dtype and head dim the table declares has a list
    for each kernel (a GPU call cannot miss one), tiles are >= 16 (tl.dot), and two probes per
    program only for JVP calls with several probes."""
    for elem_bytes in (2, 4):                                    # bf16 / fp16, fp32
        for d in KERNEL_HEAD_DIMS:
            block_d = max(16, 1 << (d - 1).bit_length())         # the padded head dim
            for kind in ("fwd", "jvp", "dkdv", "dq", "jvp_bwd_rows", "jvp_bwd_dq", "jvp_bwd_dkdv"):
                cfgs = triton_kernels.configs.configs(kind, elem_bytes, block_d)
                assert cfgs and all(c.kwargs["BLOCK_M"] >= 16 and c.kwargs["BLOCK_N"] >= 16 for c in cfgs)
            assert triton_kernels.configs.probes_per_program(elem_bytes, block_d, False, 4) == 1
            assert triton_kernels.configs.probes_per_program(elem_bytes, block_d, True, 1) == 1
            pair = triton_kernels.configs.probes_per_program(elem_bytes, block_d, True, 4)
            assert pair in (1, 2) and triton_kernels.configs.configs("jvp", elem_bytes, block_d, pair)


@pytest.mark.triton
def test_triton_layout_checks_before_launch(triton_kernels):
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    fwd, jvp, bwd = triton_kernels.attention_fwd, triton_kernels.attention_jvp, triton_kernels.attention_bwd
    kv3, kv32, d512 = torch.randn(1, 3, 8, 16), torch.randn(1, 2, 8, 32), torch.randn(1, 1, 4, 512)
    bad = [
        ("bad layout", fwd, (q, kv3, kv3, False, 0.25)),                 # Hkv does not divide H
        ("bad layout", fwd, (q, kv32, kv32, False, 0.25)),               # head dims differ
        ("bad layout", fwd, (d512, d512, d512, False, 1.0)),             # head dim > 256
        ("bad tangent layout", jvp, (q, k, k, q[None], k[None, :, :1], k[None], False, 0.25)),
        ("bad tangent layout", jvp, (q, k, k, q.expand(2, *q.shape), k[None], k[None], False, 0.25)),
        ("lse must be float32", bwd, (q, q, k, k, torch.zeros_like(q), torch.zeros(1, 4, 8, dtype=F64), False, 0.25)),
        ("q_lens must be int32", fwd, (q, k, k, False, 0.25, -1, -1, torch.tensor([8]), None)),
        ("kv_lens must be int32", fwd, (q, k, k, False, 0.25, -1, -1, None, torch.tensor([8, 8], dtype=torch.int32))),
        ("tout .* must be shaped like tq", triton_kernels.attention_jvp_bwd,
         (q, q[None], q, k, k, q[None], k[None], k[None], q, q[None, :, :, :4], torch.zeros(1, 4, 8), False, 0.25)),
        ("bad tangent layout", triton_kernels.attention_jvp_bwd,
         (q, q[None], q, k, k, q[None], q[None], k[None], q, q[None], torch.zeros(1, 4, 8), False, 0.25)),
    ]
    for match, fn, args in bad:
        with pytest.raises(ValueError, match=match):
            fn(*args)


# ------------------------------------------------------------------------------------------------
# Triton kernels with masks, against a float64 naive masked reference (written here)
# ------------------------------------------------------------------------------------------------

def allowed_pairs(B, n_q, n_k, causal, window_left, window_right, q_lens, kv_lens):
    """[B, 1, Nq, Nk] bool, the mask contract read literally: with Lq, Lk the lengths of batch b
    and off = Lk - Lq, key j is allowed for query i iff i < Lq, j < Lk, (not causal or
    j <= i + off), (window_left < 0 or j >= i + off - window_left) and (window_right < 0 or
    j <= i + off + window_right)."""
    i = torch.arange(n_q)[:, None]
    j = torch.arange(n_k)[None, :]
    masks = []
    for b in range(B):
        len_q = int(q_lens[b]) if q_lens is not None else n_q
        len_k = int(kv_lens[b]) if kv_lens is not None else n_k
        off = len_k - len_q
        m = (i < len_q) & (j < len_k)
        if causal:
            m &= j <= i + off
        if window_left >= 0:
            m &= j >= i + off - window_left
        if window_right >= 0:
            m &= j <= i + off + window_right
        masks.append(m)
    return torch.stack(masks)[:, None]


def masked_attention(q, k, v, allowed, scale):
    """(softmax(scale q k^T restricted to allowed) v, lse) with the N x N matrix; a row with no
    allowed key gives 0 and lse = -inf."""
    group = q.shape[1] // k.shape[1]
    s = scale * q @ k.repeat_interleave(group, 1).transpose(-1, -2)
    s = s.masked_fill(~allowed, float("-inf"))
    seen = allowed.any(-1, keepdim=True)
    p = torch.softmax(torch.where(seen, s, 0.0), -1) * seen
    return p @ v.repeat_interleave(group, 1), torch.logsumexp(s, -1)


def masked_reference(q, k, v, tq, tk, tv, gout, gtout, allowed, scale):
    """float64: out, lse, tangents [P, ...] (torch.func.jvp), the flash VJP of ``gout`` and the six
    gradients of <gout, out> + <gtout, tout> (torch.func.vjp through the JVP)."""
    f = lambda a, b, c: masked_attention(a, b, c, allowed, scale)[0]  # noqa: E731

    def with_tangents(a, b, c, ta, tb, tc):
        pairs = [torch.func.jvp(f, (a, b, c), (ta[p], tb[p], tc[p])) for p in range(ta.shape[0])]
        return pairs[0][0], torch.stack([t for _, t in pairs])

    (out, tout), pullback = torch.func.vjp(with_tangents, q, k, v, tq, tk, tv)
    vjp = torch.func.vjp(f, q, k, v)[1](gout)
    return out, masked_attention(q, k, v, allowed, scale)[1], tout, vjp, pullback((gout, gtout))


# (B, H, Hkv, Nq, Nk, d, P, causal, window_left, window_right, q_lens, kv_lens, tiles): every mask
# kind alone and combined, GQA 1/2, head dims 16 / 72 / 128 (72 padded to 128), N in {1, 17, 70},
# Nq != Nk both ways, P in {1, 3}; rows with nothing to attend to (causal Nq > Nk, a zero length,
# a window past the keys), key tiles the window skips, and tiles that straddle a length.
MASK_CASES = {
    "none": (1, 2, 1, 17, 70, 16, 1, False, -1, -1, None, None, (16, 16)),
    "causal-gqa2-d72": (1, 2, 1, 70, 17, 72, 3, True, -1, -1, None, None, (32, 16)),
    "sliding-window": (1, 2, 2, 70, 70, 16, 1, True, 7, -1, None, None, (16, 16)),
    "window-two-sided-d128": (1, 2, 1, 17, 70, 128, 1, False, 5, 3, None, None, (16, 16)),
    "window-right-only": (1, 2, 1, 17, 17, 16, 3, False, -1, 2, None, None, (16, 16)),
    "key-padding-gqa2": (2, 4, 2, 17, 17, 72, 1, False, -1, -1, None, [17, 6], (16, 16)),
    "lens-causal-window": (3, 2, 1, 33, 24, 16, 3, True, 4, -1, [33, 1, 17], [24, 0, 20], (16, 16)),
    "lens-q-only-window": (2, 2, 1, 33, 17, 16, 1, False, 0, 40, [9, 33], None, (16, 16)),
    "n1-causal": (1, 2, 1, 1, 1, 16, 1, True, -1, -1, None, None, (16, 16)),
    "n1-query-window": (1, 2, 1, 1, 17, 16, 3, True, 3, -1, None, [9], (16, 16)),
}


def _lens(x):
    return None if x is None else torch.tensor(x, dtype=torch.int32)


def _run_all(kernels, q, k, v, tq, tk, tv, gout, gtout, causal, scale, mask):
    out, lse = kernels.attention_fwd(q, k, v, causal, scale, *mask)
    jvp_out, tout, jvp_lse = kernels.attention_jvp(q, k, v, tq, tk, tv, causal, scale, *mask)
    vjp = kernels.attention_bwd(gout, q, k, v, out, lse, causal, scale, *mask)
    grads = kernels.attention_jvp_bwd(gout, gtout, q, k, v, tq, tk, tv, out, tout, lse, causal, scale, *mask)
    return out, lse, jvp_out, tout, jvp_lse, vjp, grads


@pytest.mark.triton
@pytest.mark.parametrize("name", list(MASK_CASES))
def test_triton_masked_kernels_against_float64(triton_kernels, name, rng, nan_poison, monkeypatch):
    """Forward (out, lse), flash backward (dq, dk, dv), JVP (out, tangents) and the backward
    through the tangent output (six gradients) of each mask kind, against float64 autograd of
    naive masked attention; rows with no allowed key give exact zeros and lse = -inf, padded keys
    exact zero gradients; the JVP's out and lse are the forward's bits."""
    B, H, Hkv, n_q, n_k, d, P, causal, wl, wr, q_lens, kv_lens, tiles = MASK_CASES[name]
    monkeypatch.setattr(triton_kernels.configs, "INTERPRET_CONFIG", dict(BLOCK_M=tiles[0], BLOCK_N=tiles[1]))
    scale = 1.5 / d ** 0.5
    q, k, v = make_qkv(B, H, Hkv, n_q, n_k, d, FP32, rng)
    tq, tk, tv = make_tangents(q, k, v, P, rng)
    gout, gtout = randn(q.shape, FP32, rng), randn(tq.shape, FP32, rng)
    mask = (wl, wr, _lens(q_lens), _lens(kv_lens))
    allowed = allowed_pairs(B, n_q, n_k, causal, *mask)
    ref_out, ref_lse, ref_tout, ref_vjp, ref_grads = masked_reference(
        *f64(q, k, v, tq, tk, tv, gout, gtout), allowed, scale)

    out, lse, jvp_out, tout, jvp_lse, vjp, grads = _run_all(triton_kernels, q, k, v, tq, tk, tv, gout, gtout,
                                                            causal, scale, mask)
    assert_close(out, ref_out, FP32, "out")
    seen = allowed.any(-1).expand(B, H, n_q)
    assert torch.equal(lse.isneginf(), ~seen), "lse = -inf exactly on the rows with no allowed key"
    assert_close(lse[seen], ref_lse[seen], FP32, "lse")
    assert torch.equal(jvp_out, out) and torch.equal(jvp_lse, lse), "the JVP's primal is the forward's"
    assert_close(tout, ref_tout, FP32, "tangent")
    for what, got, ref in zip(("dq", "dk", "dv"), vjp, ref_vjp):
        assert_close(got, ref, FP32, f"flash {what}", floor=joint_floor(ref_vjp))
    for what, got, ref in zip(("dq", "dk", "dv", "dtq", "dtk", "dtv"), grads, ref_grads):
        assert_close(got, ref, FP32, f"tangent-backward {what}", floor=joint_floor(ref_grads))

    empty = ~seen                                                     # [B, H, Nq]
    for what, x in (("out", out), ("dq", vjp[0]), ("tangent-backward dq", grads[0])):
        assert (x[empty] == 0).all(), f"{what} is not exactly 0 on rows with no allowed key"
    for what, x in (("tangent", tout), ("dtq", grads[3])):
        assert (x[:, empty] == 0).all(), f"{what} is not exactly 0 on rows with no allowed key"
    unseen_keys = ~allowed.any(-2).expand(B, Hkv, n_k)                # [B, Hkv, Nk]
    for what, x in (("dk", vjp[1]), ("dv", vjp[2]), ("tangent-backward dk", grads[1]),
                    ("tangent-backward dv", grads[2])):
        assert (x[unseen_keys] == 0).all(), f"{what} is not exactly 0 on keys no query attends"
    for what, x in (("dtk", grads[4]), ("dtv", grads[5])):
        assert (x[:, unseen_keys] == 0).all(), f"{what} is not exactly 0 on keys no query attends"


# (d, P, causal, window_left, kv_lens, GQA group): the 16-bit JVP lists' first GPU tiles, with a
# ragged last key tile, a padded head dim, key padding, a window, and two probes per program.
GPU_TILE_CASES = {
    "d128-causal-ragged": (128, 2, True, -1, None, 1),
    "d72-window-key-padding-gqa2": (72, 1, True, 40, [150, 77], 2),
    "d64-two-probes-odd-p": (64, 3, False, -1, [131, 150], 2),
}


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP32])
@pytest.mark.parametrize("name", list(GPU_TILE_CASES))
def test_triton_jvp_at_the_gpu_key_tiles(triton_kernels, name, dtype, rng, nan_poison, monkeypatch):
    """The JVP with the first (BLOCK_M, BLOCK_N) of the 16-bit GPU list for its head dim (64-key
    tiles) under the interpreter, against float64 autograd of the masked naive attention: the
    tangent products of a tile, the rescaling across wide tiles, ragged and masked tails."""
    d, P, causal, wl, kv_lens, group = GPU_TILE_CASES[name]
    block_d = triton_kernels.configs.common_meta(d)["BLOCK_D"]
    ppp = triton_kernels.configs.probes_per_program(2, block_d, True, P)
    first = triton_kernels.configs.configs("jvp", 2, block_d, ppp)[0].kwargs
    block_m, block_n = first["BLOCK_M"], first["BLOCK_N"]
    assert block_n >= 32
    monkeypatch.setattr(triton_kernels.configs, "INTERPRET_CONFIG", dict(BLOCK_M=block_m, BLOCK_N=block_n))
    B, Hkv, n_q, n_k = 2, 1, 140, 150
    q, k, v = make_qkv(B, Hkv * group, Hkv, n_q, n_k, d, dtype, rng)
    tq, tk, tv = make_tangents(q, k, v, P, rng)
    mask = (wl, -1, None, _lens(kv_lens))
    allowed = allowed_pairs(B, n_q, n_k, causal, *mask)
    scale = 1.0 / d ** 0.5
    f = lambda a, b, c: masked_attention(a, b, c, allowed, scale)[0]  # noqa: E731
    ref = [torch.func.jvp(f, f64(q, k, v), f64(tq[p], tk[p], tv[p])) for p in range(P)]
    out, tout, lse = triton_kernels.attention_jvp(q, k, v, tq, tk, tv, causal, scale, *mask)
    assert out.dtype == tout.dtype == dtype and tout.shape == tq.shape
    assert_close(out, ref[0][0], dtype, "out")
    for p in range(P):
        assert_close(tout[p], ref[p][1], dtype, f"tangent {p}")
    assert torch.equal(out, triton_kernels.attention_fwd(q, k, v, causal, scale, *mask)[0])


@pytest.mark.triton
def test_triton_nan_in_padding_is_ignored_and_deterministic(triton_kernels, rng, nan_poison, monkeypatch):
    """NaN in every padded position (query rows >= Lq, keys >= Lk) of every input changes no bit
    of any output (they are never read into a product); two runs give the same bits."""
    B, H, Hkv, n_q, n_k, d, P = 2, 1, 1, 33, 24, 16, 2
    q_lens, kv_lens = torch.tensor([20, 33], dtype=torch.int32), torch.tensor([24, 7], dtype=torch.int32)
    q, k, v = make_qkv(B, H, Hkv, n_q, n_k, d, FP32, rng)
    tq, tk, tv = make_tangents(q, k, v, P, rng)
    gout, gtout = randn(q.shape, FP32, rng), randn(tq.shape, FP32, rng)
    pad_q = torch.arange(n_q)[None, :] >= q_lens[:, None]             # [B, Nq]
    pad_k = torch.arange(n_k)[None, :] >= kv_lens[:, None]

    def fill(x, pad, value, lead=0):
        x = x.clone()
        idx = (slice(None),) * lead
        x[idx + (pad[:, None, :, None].expand(x.shape[lead:]),)] = value
        return x

    def inputs(value):
        return (fill(q, pad_q, value), fill(k, pad_k, value), fill(v, pad_k, value),
                fill(tq, pad_q, value, 1), fill(tk, pad_k, value, 1), fill(tv, pad_k, value, 1),
                fill(gout, pad_q, value), fill(gtout, pad_q, value, 1))

    mask = (5, 3, q_lens, kv_lens)
    clean = _run_all(triton_kernels, *inputs(0.0), False, 0.3, mask)
    poisoned = _run_all(triton_kernels, *inputs(float("nan")), False, 0.3, mask)
    flat = lambda r: [r[0], r[1], r[2], r[3], r[4], *r[5], *r[6]]  # noqa: E731
    for a, b in zip(flat(clean), flat(poisoned)):
        assert not b.isnan().any(), "a NaN in a padded position reached an output"
        assert torch.equal(a, b)
    # The backward kernels again: the same bits (no atomics).
    out, lse, _, tout, _, vjp, grads = poisoned
    q, k, v, tq, tk, tv, gout, gtout = inputs(float("nan"))
    again = (*triton_kernels.attention_bwd(gout, q, k, v, out, lse, False, 0.3, *mask),
             *triton_kernels.attention_jvp_bwd(gout, gtout, q, k, v, tq, tk, tv, out, tout, lse, False, 0.3, *mask))
    assert all(torch.equal(a, b) for a, b in zip(again, (*vjp, *grads)))


@pytest.mark.triton
def test_triton_nan_in_an_attended_entry_propagates(triton_kernels, rng, nan_poison):
    """As in SDPA: a NaN key makes exactly the rows that attend it NaN (out, lse, tangent, their
    dq); a NaN query row makes only its own row NaN; the mask never drops a NaN into a 0."""
    B, H, Hkv, n, d = 1, 2, 1, 33, 16
    q, k, v = make_qkv(B, H, Hkv, n, n, d, FP32, rng)
    tq, tk, tv = make_tangents(q, k, v, 1, rng)
    gout, gtout = randn(q.shape, FP32, rng), randn(tq.shape, FP32, rng)
    for causal, window in ((True, (6, -1)), (False, (3, 3))):
        k_nan = k.clone()
        k_nan[0, 0, 20] = float("nan")
        allowed = allowed_pairs(B, n, n, causal, *window, None, None)[0, 0]    # [Nq, Nk]
        attends = allowed[:, 20]
        mask = (*window, None, None)
        out, lse, _, tout, _, vjp, grads = _run_all(triton_kernels, q, k_nan, v, tq, tk, tv, gout, gtout,
                                                    causal, 0.3, mask)
        for what, x in (("out", out[0, :, :, 0]), ("lse", lse[0]), ("tangent", tout[0, 0, :, :, 0])):
            assert torch.equal(x.isnan(), attends.expand_as(x)), f"{what}: NaN rows {x.isnan()}"
        assert vjp[0][0, :, attends].isnan().all() and grads[0][0, :, attends].isnan().all()
        q_nan = q.clone()
        q_nan[0, 1, 30] = float("nan")
        out, lse = triton_kernels.attention_fwd(q_nan, k, v, causal, 0.3, *mask)
        assert out[0, 1, 30].isnan().all() and lse[0, 1, 30].isnan()
        rows = torch.ones(2, n, dtype=torch.bool)
        rows[1, 30] = False
        assert not out[0][rows].isnan().any() and not lse[0][rows].isnan().any()


@pytest.mark.triton
def test_triton_tiny_and_wide_head_dims(triton_kernels, rng, nan_poison):
    """Head dims padded inside the kernels (1, 3: to 16; 200: to 256): the JVP and the backward
    through the tangent against float64."""
    for d in (1, 3, 200):
        q, k, v = make_qkv(1, 2, 1, 17, 9, d, FP32, rng)
        tq, tk, tv = make_tangents(q, k, v, 1, rng)
        gout, gtout = randn(q.shape, FP32, rng), randn(tq.shape, FP32, rng)
        allowed = allowed_pairs(1, 17, 9, True, -1, -1, None, None)
        ref_out, _, ref_tout, _, ref_grads = masked_reference(*f64(q, k, v, tq, tk, tv, gout, gtout), allowed, 0.3)
        out, tout, lse = triton_kernels.attention_jvp(q, k, v, tq, tk, tv, True, 0.3)
        grads = triton_kernels.attention_jvp_bwd(gout, gtout, q, k, v, tq, tk, tv, out, tout, lse, True, 0.3)
        assert_close(out, ref_out, FP32, f"out d={d}")
        assert_close(tout, ref_tout, FP32, f"tangent d={d}")
        for what, got, ref in zip(("dq", "dk", "dv", "dtq", "dtk", "dtv"), grads, ref_grads):
            assert_close(got, ref, FP32, f"{what} d={d}", floor=joint_floor(ref_grads))


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision_masked(triton_kernels, dtype, rng, nan_poison):
    """bf16 / fp16 inputs (operands rounded to the dtype before each product, fp32 accumulators):
    a sliding window with key padding, every output against float64 of the rounded inputs."""
    B, H, Hkv, n_q, n_k, d, P = 2, 2, 1, 24, 24, 16, 1
    mask = (8, -1, None, torch.tensor([24, 12], dtype=torch.int32))
    q, k, v = make_qkv(B, H, Hkv, n_q, n_k, d, dtype, rng)
    tq, tk, tv = make_tangents(q, k, v, P, rng)
    gout, gtout = randn(q.shape, dtype, rng), randn(tq.shape, dtype, rng)
    allowed = allowed_pairs(B, n_q, n_k, True, *mask)
    ref_out, _, ref_tout, ref_vjp, ref_grads = masked_reference(
        *f64(q, k, v, tq, tk, tv, gout, gtout), allowed, 0.3)
    out, lse, _, tout, _, vjp, grads = _run_all(triton_kernels, q, k, v, tq, tk, tv, gout, gtout, True, 0.3, mask)
    assert out.dtype == tout.dtype == grads[4].dtype == dtype and lse.dtype == FP32
    factor = 2
    assert_close(out, ref_out, dtype, "out", factor=factor)
    assert_close(tout, ref_tout, dtype, "tangent", factor=factor)
    for what, got, ref in zip(("dq", "dk", "dv"), vjp, ref_vjp):
        assert_close(got, ref, dtype, f"flash {what}", floor=joint_floor(ref_vjp), factor=factor)
    for what, got, ref in zip(("dq", "dk", "dv", "dtq", "dtk", "dtv"), grads, ref_grads):
        assert_close(got, ref, dtype, f"tangent-backward {what}", floor=joint_floor(ref_grads), factor=factor)


@pytest.mark.triton
def test_triton_window_skips_key_tiles(triton_kernels):
    """The tile ranges the kernels loop over (``tiles.tile_range``, run in a probe kernel): a sliding
    window visits O(W / BLOCK_N + 1) key tiles per query tile, not all of them; the tiles visited
    cover every allowed pair once, and the unmasked ones hold allowed pairs only."""
    import numpy as np
    import triton
    import triton.language as tl
    global _tile_range  # the interpreter runs the probe's source against this module's globals
    _tile_range = triton_kernels.tiles.tile_range

    @triton.jit
    def probe(Out, n_own, len_own, len_other, lo_off, hi_off, BLOCK_OWN: tl.constexpr,
              BLOCK_OTHER: tl.constexpr):
        pid = tl.program_id(0)
        got = _tile_range(pid * BLOCK_OWN, n_own, len_own, len_other, lo_off, hi_off, BLOCK_OWN, BLOCK_OTHER)
        for i in tl.static_range(6):
            tl.store(Out + pid * 6 + i, got[i])

    n_q = n_k = 256
    for causal, wl, wr, bm, bn in ((True, 15, -1, 16, 16), (False, 8, 40, 32, 16), (True, -1, -1, 16, 32),
                                   (False, -1, -1, 32, 16)):
        _, _, left, right, _ = triton_kernels.host.mask_args(torch.empty(1, 1, n_q, 1), torch.empty(1, 1, n_k, 1),
                                                         causal, wl, wr, None, None)
        allowed = allowed_pairs(1, n_q, n_k, causal, wl, wr, None, None)[0, 0].numpy()
        # query tiles over keys (lo_off = off - left, hi_off = off + right, off = 0), and key tiles
        # over queries (offsets negated and swapped)
        for own, n_own, n_other, b_own, b_other, lo_off, hi_off, pairs in (
                ("query", n_q, n_k, bm, bn, -left, right, allowed),
                ("key", n_k, n_q, bn, bm, -right, left, allowed.T)):
            n_tiles = n_own // b_own
            res = torch.zeros(n_tiles * 6, dtype=torch.int32)
            probe[(n_tiles,)](res, n_own, n_own, n_other, lo_off, hi_off, BLOCK_OWN=b_own, BLOCK_OTHER=b_other)
            most = 0
            for tile, (lo, n_masked, n_left, gap, full_lo, n_full) in enumerate(res.view(-1, 6).tolist()):
                start = tile * b_own
                tiles = ([lo + t * b_other + (gap if t >= n_left else 0) for t in range(n_masked)]
                         + [full_lo + t * b_other for t in range(n_full)])
                assert len(set(tiles)) == len(tiles) and all(s % b_other == 0 for s in tiles)
                covered = np.zeros(n_other, bool)
                for s in tiles:
                    covered[s:s + b_other] = True
                rows = pairs[start:start + b_own]
                assert not (rows & ~covered[None, :]).any(), f"{own} tile {start}: an allowed pair is skipped"
                for s in range(full_lo, full_lo + n_full * b_other, b_other):
                    assert rows[:, s:s + b_other].all(), f"{own} tile {start}: unmasked tile {s} holds masked pairs"
                most = max(most, len(tiles))
            if wl >= 0:
                span = wl + 1 + (0 if causal else wr)
                assert most <= (span + b_own) // b_other + 2, (own, most)
            elif not causal:
                assert most == n_other // b_other
