"""condinit.attention / condinit.attention_jvp: values, tangents and every gradient against float64
torch.func over a naive (materializing) attention; AD transforms; torch.compile; input errors.

Runs on the automatic backend (the C++ CPU kernel when built, else the tiled torch reference) and
on the torch reference explicitly; tests/test_attention_backends.py covers each backend.
"""
import math

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import condinit
from condinit import _backends
from condinit._backends import BackendUnavailableError
from condinit.ops.attention import attention, attention_jvp, reference

from conftest import TOLERANCES

F64 = torch.float64


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def _randn(shape, dtype, g):
    return torch.randn(shape, generator=g, dtype=F64).to(dtype)


def make_inputs(B, H, Hkv, Nq, Nk, d, P, dtype, g, probe_dim=True):
    q = _randn((B, H, Nq, d), dtype, g)
    k = _randn((B, Hkv, Nk, d), dtype, g)
    v = _randn((B, Hkv, Nk, d), dtype, g)
    lead = (P,) if probe_dim else ()
    tq, tk, tv = (_randn(lead + tuple(x.shape), dtype, g) for x in (q, k, v))
    return q, k, v, tq, tk, tv


def naive_jvp(q, k, v, tq, tk, tv, causal, scale):
    """(out, tout [P, ...]) in float64 by torch.func.jvp through the naive attention."""
    f = lambda q_, k_, v_: reference.attention_naive(q_, k_, v_, causal, scale)  # noqa: E731
    outs = [torch.func.jvp(f, (q, k, v), (tq[p], tk[p], tv[p])) for p in range(tq.shape[0])]
    return outs[0][0], torch.stack([t for _, t in outs])


def naive_lse(q, k, causal, scale):
    H, Hkv = q.shape[1], k.shape[1]
    s = scale * (q @ k.repeat_interleave(H // Hkv, dim=1).transpose(-1, -2))
    if causal:
        Nq, Nk = q.shape[2], k.shape[2]
        i, j = torch.arange(Nq)[:, None], torch.arange(Nk)[None, :]
        s = s.masked_fill(j > i + (Nk - Nq), float("-inf"))
    return torch.logsumexp(s, dim=-1)


def rel_err(actual, expected, floor=0.0):
    """max |actual - expected| / max(max |expected|, floor) (absolute error when both are 0)."""
    actual, expected = actual.to(F64), expected.to(F64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert not actual.isnan().any(), "NaN in result"
    err = (actual - expected).abs().max().item()
    scale = max(expected.abs().max().item(), floor)
    return err / scale if scale > 0 else err


def assert_close(actual, expected, dtype, what="", floor=0.0):
    atol, rtol = TOLERANCES[dtype]
    err = rel_err(actual, expected, floor)
    assert err <= max(rtol, atol), f"{what}: relative error {err:.3e} > {max(rtol, atol):.1e}"


def joint_floor(refs):
    """A gradient that is exactly 0 in exact arithmetic (one key: the softmax is constant) comes
    out as rounding noise of the size of its siblings' terms: measure it against 0.1 x the
    largest gradient of the group rather than against 0."""
    return 0.1 * max(r.abs().max().item() for r in refs)


def check_against_naive(q, k, v, tq, tk, tv, causal, scale, dtype, g, backend=None):
    """out, tout, dq/dk/dv (attention backward) and the six gradients through (out, tout) of
    attention_jvp, against float64 torch.func on the naive attention."""
    P = tq.shape[0]
    x64 = [x.to(F64) for x in (q, k, v, tq, tk, tv)]
    ref_out, ref_tout = naive_jvp(*x64, causal, scale)
    dout = _randn(ref_out.shape, dtype, g)
    gtout = _randn(ref_tout.shape, dtype, g)

    # forward + fused JVP
    out, tout = attention_jvp(q, k, v, tq, tk, tv, causal=causal, scale=scale, backend=backend)
    assert out.dtype == dtype and tout.dtype == dtype and tout.shape == (P,) + tuple(q.shape)
    assert_close(out, ref_out, dtype, "out")
    assert_close(tout, ref_tout, dtype, "tangent_out")

    # reverse mode of attention (flash VJP)
    prim = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = attention(*prim, causal=causal, scale=scale, backend=backend)
    assert_close(o.detach(), ref_out, dtype, "attention out")
    grads = torch.autograd.grad(o, prim, dout)
    f = lambda a, b, c: reference.attention_naive(a, b, c, causal, scale)  # noqa: E731
    ref_grads = torch.func.vjp(f, *x64[:3])[1](dout.to(F64))
    for name, gr, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert gr.dtype == dtype
        assert_close(gr, rg, dtype, name, joint_floor(ref_grads))

    # gradients through both outputs of attention_jvp, w.r.t. all six inputs
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, tq, tk, tv)]
    out2, tout2 = attention_jvp(*leaves, causal=causal, scale=scale, backend=backend)
    grads6 = torch.autograd.grad((out2, tout2), leaves, (dout, gtout))
    ref6 = torch.func.vjp(lambda *xs: naive_jvp(*xs, causal, scale), *x64)[1](
        (dout.to(F64), gtout.to(F64)))
    for name, gr, rg in zip(("q", "k", "v", "tq", "tk", "tv"), grads6, ref6):
        assert_close(gr, rg, dtype, f"d loss / d {name} through (out, tangent_out)", joint_floor(ref6))


# ------------------------------------------------------------------------------------------------
# values, tangents and gradients
# ------------------------------------------------------------------------------------------------

# (B, H, Hkv, Nq, Nk, d, P, causal): together they cover N in {1, 17, 128, 333}, Nq != Nk both
# ways (causal with Nq > Nk has rows that see no key), GQA ratios 1/2/8, d in {16, 64, 80, 128}
# and P in {1, 3}.
GRID = [
    (1, 1, 1, 1, 1, 16, 1, False),
    (2, 2, 1, 1, 17, 64, 3, True),
    (1, 2, 2, 17, 17, 80, 3, True),
    (2, 4, 2, 17, 128, 16, 1, False),
    (1, 8, 1, 128, 17, 64, 3, True),       # Nq > Nk: 111 empty rows per head
    (1, 4, 4, 128, 128, 128, 1, True),
    (1, 2, 1, 333, 128, 80, 1, False),
    (1, 2, 1, 128, 333, 16, 3, True),
    (1, 2, 2, 333, 333, 64, 1, True),
    (2, 8, 1, 17, 1, 128, 3, False),
]


@pytest.mark.parametrize("B,H,Hkv,Nq,Nk,d,P,causal", GRID)
def test_fp32_against_float64_naive(B, H, Hkv, Nq, Nk, d, P, causal, rng):
    """Automatic backend, fp32 compute: relative error <= 1e-5 on every output and gradient."""
    x = make_inputs(B, H, Hkv, Nq, Nk, d, P, torch.float32, rng)
    check_against_naive(*x, causal, 1.0 / math.sqrt(d), torch.float32, rng)


@pytest.mark.parametrize("B,H,Hkv,Nq,Nk,d,P,causal", [GRID[2], (1, 4, 1, 40, 23, 16, 2, True)])
def test_float64_reference_is_exact(B, H, Hkv, Nq, Nk, d, P, causal, rng):
    x = make_inputs(B, H, Hkv, Nq, Nk, d, P, F64, rng)
    check_against_naive(*x, causal, 0.3, F64, rng, backend="torch")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_half_precision(dtype, causal, rng):
    q, k, v, tq, tk, tv = make_inputs(1, 4, 2, 33, 47, 64, 2, dtype, rng)
    x64 = [x.to(F64) for x in (q, k, v, tq, tk, tv)]
    ref_out, ref_tout = naive_jvp(*x64, causal, 0.125)
    out, tout = attention_jvp(q, k, v, tq, tk, tv, causal=causal)
    assert out.dtype == dtype and tout.dtype == dtype
    assert_close(out, ref_out, dtype, "out")
    assert_close(tout, ref_tout, dtype, "tangent_out")
    prim = [x.clone().requires_grad_() for x in (q, k, v)]
    dout = _randn(out.shape, dtype, rng)
    grads = torch.autograd.grad(attention(*prim, causal=causal), prim, dout)
    ref = torch.func.vjp(lambda a, b, c: reference.attention_naive(a, b, c, causal), *x64[:3])[1](
        dout.to(F64))
    for gr, rg in zip(grads, ref):
        assert gr.dtype == dtype
        assert_close(gr, rg, dtype, "grad")


def test_reference_tiles_agree_with_one_block(rng):
    """The online-softmax rescaling across key blocks: small blocks == one block."""
    q, k, v, tq, tk, tv = make_inputs(1, 4, 2, 70, 90, 16, 2, F64, rng)
    one = reference.attention_jvp(q, k, v, tq, tk, tv, True, 0.7, block_q=128, block_k=128)
    tiled = reference.attention_jvp(q, k, v, tq, tk, tv, True, 0.7, block_q=32, block_k=16)
    for a, b in zip(tiled, one):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    dout = torch.randn(q.shape, generator=rng, dtype=F64)
    g1 = reference.attention_bwd(dout, q, k, v, one[0], one[2], True, 0.7, block_q=128, block_k=128)
    g2 = reference.attention_bwd(dout, q, k, v, one[0], one[2], True, 0.7, block_q=32, block_k=16)
    for a, b in zip(g2, g1):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_lse_and_empty_rows(rng):
    """lse = logsumexp of the scores; a row with no key: out = tangent = grad = 0, lse = -inf."""
    Nq, Nk = 40, 15  # causal: rows 0..24 see no key
    q, k, v, tq, tk, tv = make_inputs(2, 4, 2, Nq, Nk, 16, 3, torch.float32, rng)
    out, lse = torch.ops.condinit.attention_fwd(q, k, v, True, 0.25, None)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, Nq)
    ref = naive_lse(q.double(), k.double(), True, 0.25)
    empty = slice(0, Nq - Nk)
    assert torch.isneginf(lse[..., empty]).all()
    torch.testing.assert_close(lse[..., Nq - Nk:].double(), ref[..., Nq - Nk:], rtol=1e-5, atol=1e-5)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, tq, tk, tv)]
    out, tout = attention_jvp(*leaves, causal=True, scale=0.25)
    assert (out[..., empty, :] == 0).all() and (tout[..., empty, :] == 0).all()
    assert not out.isnan().any() and not tout.isnan().any()
    grads = torch.autograd.grad((out.sum() + tout.square().sum()), leaves)
    assert all(not gr.isnan().any() for gr in grads)
    assert (grads[0][..., empty, :] == 0).all() and (grads[3][..., empty, :] == 0).all()
    prim = [x.clone().requires_grad_() for x in (q, k, v)]
    o = attention(*prim, causal=True, scale=0.25)
    dq, dk, dv = torch.autograd.grad(o, prim, torch.randn(o.shape, generator=rng))
    assert (dq[..., empty, :] == 0).all()
    assert not any(t.isnan().any() for t in (dq, dk, dv))


def test_none_tangents_and_probe_dim(rng):
    """None = zero tangent; a tangent without probe dim gives a tangent without probe dim."""
    q, k, v, tq, tk, tv = make_inputs(1, 4, 2, 17, 23, 16, 2, torch.float32, rng)
    z = lambda t: torch.zeros_like(t)  # noqa: E731
    for given in [(tq, None, None), (None, tk, None), (None, None, tv), (tq, None, tv), (None, None, None)]:
        full = [t if t is not None else z(r) for t, r in zip(given, (tq, tk, tv))]
        out, tout = attention_jvp(q, k, v, *given, causal=True)
        out_f, tout_f = attention_jvp(q, k, v, *full, causal=True)
        if all(t is None for t in given):  # no tangent, no probe dim: a zero tangent like out
            assert tout.shape == q.shape and (tout == 0).all()
            tout = tout.expand_as(tout_f)
        assert tout.shape == tq.shape
        torch.testing.assert_close(tout, tout_f, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, out_f)
    out, t0 = attention_jvp(q, k, v, tq[0], tk[0], tv[0])
    _, t2 = attention_jvp(q, k, v, tq, tk, tv)
    assert t0.shape == q.shape
    torch.testing.assert_close(t0, t2[0], rtol=1e-6, atol=1e-6)
    _, tnone = attention_jvp(q, k, v, None, tk[1], None)
    assert tnone.shape == q.shape


def test_non_contiguous_inputs(rng):
    q, k, v, tq, tk, tv = make_inputs(1, 4, 2, 19, 19, 16, 2, torch.float32, rng)
    nc = lambda x: x.transpose(-2, -3).contiguous().transpose(-2, -3)  # noqa: E731
    args = [nc(x) for x in (q, k, v, tq, tk, tv)]
    assert not args[0].is_contiguous()
    for a, b in zip(attention_jvp(*args, causal=True), attention_jvp(q, k, v, tq, tk, tv, causal=True)):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(attention(*args[:3]), attention(q, k, v))


# ------------------------------------------------------------------------------------------------
# AD transforms and torch.compile
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def small(rng):
    return make_inputs(1, 4, 2, 9, 11, 16, 1, F64, rng, probe_dim=False)


def _naive(causal):
    return lambda q, k, v: reference.attention_naive(q, k, v, causal)


def _ours(causal, backend=None):
    return lambda q, k, v: attention(q, k, v, causal=causal, backend=backend)


@pytest.mark.parametrize("causal", [False, True])
def test_func_jvp_matches_attention_jvp(small, causal):
    q, k, v, tq, tk, tv = small
    out, tout = torch.func.jvp(_ours(causal), (q, k, v), (tq, tk, tv))
    out_f, tout_f = attention_jvp(q, k, v, tq, tk, tv, causal=causal)
    torch.testing.assert_close(out, out_f)
    torch.testing.assert_close(tout, tout_f)
    ref_out, ref_tout = torch.func.jvp(_naive(causal), (q, k, v), (tq, tk, tv))
    assert rel_err(tout, ref_tout) < 1e-12 and rel_err(out, ref_out) < 1e-12


def test_forward_ad_dual_numbers(small):
    q, k, v, tq, tk, tv = small
    with fwAD.dual_level():
        out = attention(fwAD.make_dual(q, tq), k, fwAD.make_dual(v, tv), causal=True)
        tout = fwAD.unpack_dual(out).tangent
    ref = torch.func.jvp(_naive(True), (q, k, v), (tq, torch.zeros_like(k), tv))[1]
    assert rel_err(tout, ref) < 1e-12


@pytest.mark.parametrize("causal", [False, True])
def test_func_vjp_jacfwd_jacrev(small, causal):
    q, k, v, *_ = small
    dout = torch.randn_like(q)
    ours = torch.func.vjp(_ours(causal), q, k, v)[1](dout)
    ref = torch.func.vjp(_naive(causal), q, k, v)[1](dout)
    for a, b in zip(ours, ref):
        assert rel_err(a, b) < 1e-12
    J_ref = torch.func.jacrev(_naive(causal), argnums=(0, 1, 2))(q, k, v)
    for transform in (torch.func.jacfwd, torch.func.jacrev):
        J = transform(_ours(causal), argnums=(0, 1, 2))(q, k, v)
        for a, b in zip(J, J_ref):
            assert rel_err(a, b) < 1e-12, transform.__name__


def test_double_backward_of_attention(small):
    """Second order through the flash VJP (Hessian-vector products): the bwd op is differentiable."""
    q, k, v, *_ = small
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def hvp(fn):
        gq, gk, gv = torch.autograd.grad(fn(*leaves).sin().sum(), leaves, create_graph=True)
        return torch.autograd.grad((gq * gq).sum() + (gk * gv).sum(), leaves)
    for a, b in zip(hvp(_ours(True)), hvp(_naive(True))):
        assert rel_err(a, b) < 1e-12


def test_vmap_over_attention_and_attention_jvp(rng):
    q, k, v, tq, tk, tv = make_inputs(3, 2, 1, 7, 9, 16, 2, F64, rng)
    out = torch.func.vmap(_ours(True))(q[:, None], k[:, None], v[:, None])   # V = 3, B = 1
    torch.testing.assert_close(out[:, 0], reference.attention_naive(q, k, v, True))
    # vmap over a probe-like leading dim of the tangents only, and over a non-leading dim
    f = lambda a, b, c: attention_jvp(q, k, v, a, b, c, causal=True)[1]  # noqa: E731
    t = torch.func.vmap(f, in_dims=(0, 0, 0))(tq, tk, tv)
    torch.testing.assert_close(t, attention_jvp(q, k, v, tq, tk, tv, causal=True)[1])
    # a non-leading vmapped dim, with k, v not vmapped (expanded by the vmap rule)
    q5 = torch.randn(2, 3, 2, 7, 16, generator=rng, dtype=F64)            # [B, V, H, N, d]
    o5 = torch.func.vmap(_ours(False), in_dims=(1, None, None), out_dims=1)(q5, k[:2], v[:2])
    ref = torch.stack([reference.attention_naive(q5[:, i], k[:2], v[:2]) for i in range(3)], 1)
    torch.testing.assert_close(o5, ref)


def test_gradients_of_a_jvp_loss(rng):
    """torch.func.grad and double backward through attention_jvp (backward is differentiable)."""
    q, k, v, tq, tk, tv = make_inputs(1, 2, 1, 8, 10, 16, 2, F64, rng)
    def loss(fn, *xs):
        out, tout = fn(*xs)
        return out.sin().sum() + tout.square().sum()
    ours = lambda *xs: attention_jvp(*xs, causal=True)  # noqa: E731
    ref = lambda *xs: naive_jvp(*xs, True, 0.25)        # noqa: E731
    g = torch.func.grad(lambda *xs: loss(ours, *xs), argnums=tuple(range(6)))(q, k, v, tq, tk, tv)
    g_ref = torch.func.grad(lambda *xs: loss(ref, *xs), argnums=tuple(range(6)))(q, k, v, tq, tk, tv)
    for a, b in zip(g, g_ref):
        assert rel_err(a, b) < 1e-12
    leaves = [x.clone().requires_grad_() for x in (q, k, v, tq, tk, tv)]
    hv = torch.autograd.grad(torch.autograd.grad(loss(ours, *leaves), leaves[0], create_graph=True)[0].sum(), leaves)
    hv_ref = torch.autograd.grad(torch.autograd.grad(loss(ref, *leaves), leaves[0], create_graph=True)[0].sum(), leaves)
    for a, b in zip(hv, hv_ref):
        assert rel_err(a, b) < 1e-10


def test_torch_compile_fullgraph(rng):
    q, k, v, *_ = make_inputs(1, 4, 2, 13, 21, 16, 1, torch.float32, rng, probe_dim=False)
    torch._dynamo.reset()

    def f(q, k, v):
        return (condinit.attention(q, k, v, causal=True) * 2).sin()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = compiled(*leaves)
    grads = torch.autograd.grad(out.sum(), leaves)
    leaves2 = [x.clone().requires_grad_() for x in (q, k, v)]
    out2 = f(*leaves2)
    grads2 = torch.autograd.grad(out2.sum(), leaves2)
    torch.testing.assert_close(out, out2)
    for a, b in zip(grads, grads2):
        torch.testing.assert_close(a, b)
    # and the fused JVP (inference) under compile
    tq = torch.randn(q.shape, generator=rng)
    cj = torch.compile(lambda q, k, v, t: attention_jvp(q, k, v, t, None, None)[1], fullgraph=True,
                       backend="aot_eager")
    torch.testing.assert_close(cj(q, k, v, tq), attention_jvp(q, k, v, tq, None, None)[1])


def test_torch_compile_inductor(rng):
    """The default (inductor) backend traces the custom ops through their fake kernels."""
    q, k, v, *_ = make_inputs(1, 2, 1, 9, 9, 16, 1, torch.float32, rng, probe_dim=False)
    torch._dynamo.reset()
    f = lambda q, k, v: condinit.attention(q, k, v) + 1  # noqa: E731
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v))


# ------------------------------------------------------------------------------------------------
# backend selection and input errors
# ------------------------------------------------------------------------------------------------

def test_head_dim_unsupported_by_kernels(rng):
    """d = 24: the kernels decline (supports hook); auto falls back to torch, forced raises."""
    q, k, v, tq, tk, tv = make_inputs(1, 2, 1, 9, 9, 24, 1, torch.float32, rng)
    ref_out, ref_tout = naive_jvp(*(x.double() for x in (q, k, v, tq, tk, tv)), False, 24 ** -0.5)
    out, tout = attention_jvp(q, k, v, tq, tk, tv)
    assert rel_err(out, ref_out) < 1e-5 and rel_err(tout, ref_tout) < 1e-5
    for backend in ("cpp-cpu", "triton", "cuda"):
        with pytest.raises(BackendUnavailableError):
            attention(q, k, v, backend=backend)
    # float64 is the reference's alone
    with pytest.raises(BackendUnavailableError):
        attention(q.double(), k.double(), v.double(), backend="cpp-cpu")


def test_forced_torch_backend_by_env(rng, monkeypatch):
    q, k, v, *_ = make_inputs(1, 2, 1, 5, 5, 16, 1, torch.float32, rng, probe_dim=False)
    monkeypatch.setenv(_backends.ENV_VAR, "attention_fwd=torch")
    chosen = _backends.select("attention_fwd", "cpu", head_dim=16, dtype=torch.float32)
    assert [i.backend for i in chosen] == ["torch"]
    torch.testing.assert_close(attention(q, k, v), reference.attention_naive(q, k, v))
    torch.testing.assert_close(attention(q, k, v, backend="auto"), reference.attention_naive(q, k, v))


def _bad_calls():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 8, 16, generator=g)
    k = torch.randn(1, 2, 6, 16, generator=g)
    v = torch.randn(1, 2, 6, 16, generator=g)
    tq, tk, tv = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
    return [
        ("q 3-D", ValueError, "q must be 4-D", (q[0], k, v), {}),
        ("k 5-D", ValueError, "k must be 4-D", (q, k[None], v), {}),
        ("empty", ValueError, "empty", (q[:, :, :0], k, v), {}),
        ("int q", TypeError, "q must be a floating-point", (q.long(), k, v), {}),
        ("not a tensor", TypeError, "v must be a torch.Tensor", (q, k, v.tolist()), {}),
        ("mixed dtype", TypeError, "k must have q's dtype", (q, k.double(), v), {}),
        ("batch", ValueError, "batch size", (q, k.expand(2, -1, -1, -1), v), {}),
        ("head dim", ValueError, "head dim", (q, k[..., :8], v[..., :8]), {}),
        ("Nk mismatch", ValueError, "same shape", (q, k, v[:, :, :5]), {}),
        ("Hkv", ValueError, "must divide", (q, torch.randn(1, 3, 6, 16), torch.randn(1, 3, 6, 16)), {}),
        ("device", ValueError, "device", (q, k.to("meta"), v), {}),
        ("causal", TypeError, "causal must be a bool", (q, k, v), {"causal": 1}),
        ("scale", TypeError, "scale must be", (q, k, v), {"scale": "0.1"}),
        ("scale nan", ValueError, "scale must be finite", (q, k, v), {"scale": float("nan")}),
        ("backend", ValueError, "backend must be one of", (q, k, v), {"backend": "cudnn"}),
        ("tq shape", ValueError, "tq must have q's shape", (q, k, v, tq[..., :8], None, None), {}),
        ("tk dtype", TypeError, "tk must have k's dtype", (q, k, v, None, tk.double(), None), {}),
        ("tv int", TypeError, "tv must be a floating-point", (q, k, v, None, None, tv.int()), {}),
        ("probe dim mix", ValueError, "all have a leading probe dim", (q, k, v, tq[None], tk, None), {}),
        ("P mismatch", ValueError, "probe count", (q, k, v, tq.expand(2, -1, -1, -1, -1),
                                                   tk.expand(3, -1, -1, -1, -1), None), {}),
        ("tangent device", ValueError, "tv must be on", (q, k, v, None, None, tv.to("meta")), {}),
    ]


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
def test_bad_inputs_raise_clear_errors(case):
    _, exc, match, args, kwargs = case
    fn = attention_jvp if len(args) == 6 else attention
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)
    if len(args) == 3:  # the same checks guard attention_jvp's primals and options
        with pytest.raises(exc, match=match):
            attention_jvp(*args, **kwargs)


def test_public_names(rng):
    """condinit.attention is the function (the op family lives in the subpackage condinit.ops.attention)."""
    import importlib
    import inspect

    assert importlib.import_module("condinit.ops.attention.reference") is reference
    assert condinit.attention_jvp is attention_jvp
    assert "causal" in inspect.signature(condinit.attention).parameters
    q = torch.randn(1, 2, 5, 16, generator=rng)
    torch.testing.assert_close(condinit.attention(q, q, q, causal=True), attention(q, q, q, causal=True))
    importlib.import_module("condinit.ops.attention")  # must not rebind condinit.attention
    assert condinit.attention is attention
