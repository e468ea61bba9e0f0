"""What only a direct call to an attention kernel can show (the op-level checks of every backend
are in tests/test_attention.py and tests/test_attention_jvp.py):

* the tiled torch reference: small tiles give what one tile gives (the online-softmax rescaling);
* the custom ops' fake kernels and the native (C++) ``condinit_C`` ops: output shapes and dtypes
  on meta tensors, and the layout checks that guard the kernels' memory accesses;
* the Triton kernels: unequal query / key tiles on the causal diagonal, an odd probe count
  against single-probe calls bit for bit, a deterministic backward, the GPU autotune lists, and
  the layout checks raised before a launch.
"""
import pytest
import torch

import condinit
from condinit.ops.attention import reference
from condinit.ops.attention.op import KERNEL_HEAD_DIMS

from attention_cases import (F64, f64, make_qkv, make_tangents, naive_attention, naive_jvp,
                             naive_vjp, randn, require)
from conftest import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")

FP32 = torch.float32


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
        out, tout, lse = torch.ops.condinit.attention_jvp(q, k, k, tq, None, None, False, 1.0, "torch")
        assert (out.shape, tout.shape, lse.shape) == (q.shape, tq.shape, (2, 4, 9))
        assert out.dtype == tout.dtype == dtype and lse.dtype == lse_dtype
        out, lse = torch.ops.condinit.attention_fwd(q, k, k, True, 1.0, "torch")
        assert out.shape == q.shape and lse.dtype == lse_dtype
        dq, dk, dv = torch.ops.condinit.attention_bwd(q, q, k, k, q, lse, False, 1.0, "torch")
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
    out, tout, lse = native.attention_jvp(q, k, k, t, tk, tk, False, 1.0)
    assert out.shape == q.shape and tout.shape == t.shape and lse.shape == (2, 4, 9) and lse.dtype == FP32
    dq, dk, dv = native.attention_bwd(q, q, k, k, q, torch.empty(2, 4, 9, device="meta"), False, 1.0)
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
            fn(*args)


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
    monkeypatch.setattr(triton_kernels, "_INTERPRET_CONFIG", dict(BLOCK_M=block_m, BLOCK_N=block_n))
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
            for kind in ("fwd", "jvp", "dkdv", "dq"):
                cfgs = triton_kernels._configs(kind, elem_bytes, block_d)
                assert cfgs and all(c.kwargs["BLOCK_M"] >= 16 and c.kwargs["BLOCK_N"] >= 16 for c in cfgs)
            assert triton_kernels._probes_per_program(elem_bytes, block_d, False, 4) == 1
            assert triton_kernels._probes_per_program(elem_bytes, block_d, True, 1) == 1
            pair = triton_kernels._probes_per_program(elem_bytes, block_d, True, 4)
            assert pair in (1, 2) and triton_kernels._configs("jvp", elem_bytes, block_d, pair)


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
    ]
    for match, fn, args in bad:
        with pytest.raises(ValueError, match=match):
            fn(*args)
