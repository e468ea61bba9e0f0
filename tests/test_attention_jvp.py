"""condinit.attention_jvp on every backend runnable here, against one float64 naive reference.

The same backends as tests/test_attention.py, forced with ``backend=``: the output and the
tangent for tangents without a probe dim and with P = 1, 2, 3 probes, None (zero) tangents,
the gradients through both outputs with respect to all six inputs, dtypes, vmap, second order,
torch.compile, argument errors, and a kernel error reaching the caller.
"""
import warnings

import pytest
import torch

import condinit
from condinit._backends import BackendUnavailableError
from condinit.ops.attention.op import ATTENTION_JVP

from attention_cases import (CASES, DEVICE, F64, ODD_HEAD_DIM_CASES, TRITON_CASES, accepts,
                             backend_param, backend_params, case_id, empty_rows, f64, joint_floor,
                             make_qkv, make_tangents, naive_jvp, randn, require)
from conftest import assert_close
from helpers import make_chosen_kernel_raise, make_kernels_unreachable, valid_attention_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

FP32 = torch.float32


def _probe_params():
    """(backend, case, P): every case with no probe dim (P None) and P = 1, 3 on the fast
    backends; on Triton one P per tiny case (None, 3, 2)."""
    params = []
    for b in DEVICE:
        if b == "triton":
            combos = list(zip(TRITON_CASES, (None, 3, 2)))
        else:
            combos = [(c, P) for c in CASES + ODD_HEAD_DIM_CASES if accepts(b, FP32, c[5])
                      for P in (None, 1, 3)]
        params += [backend_param(b, c, P, id=f"{b}-{case_id(c)}-P{P}") for c, P in combos]
    return params


def _ad_dtype(backend):
    return F64 if accepts(backend, F64, 16) else FP32


@pytest.mark.parametrize("backend,case,P", _probe_params())
def test_output_and_tangent(backend, case, P, rng, nan_poison):
    """out and the tangent of every probe in float32 against float64 torch.func.jvp; rows that
    see no key give exact zeros."""
    device = require(backend)
    B, H, Hkv, Nq, Nk, d, causal = case
    scale = 0.7 * d ** -0.5
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, d, FP32, rng, device)
    tangents = make_tangents(q, k, v, P or 1, rng)
    given = tangents if P is not None else tuple(t[0] for t in tangents)
    out, tout = condinit.attention_jvp(q, k, v, *given, causal=causal, scale=scale, backend=backend)
    ref_out, ref_tout = naive_jvp(*f64(q, k, v, *tangents), causal, scale)
    assert out.dtype == tout.dtype == FP32
    assert tout.shape == ((P,) if P is not None else ()) + tuple(q.shape)
    assert_close(out, ref_out, FP32, "out")
    assert_close(tout, ref_tout if P is not None else ref_tout[0], FP32, "tangent")
    empty = empty_rows(Nq, Nk, causal)
    assert (out[..., :empty, :] == 0).all() and (tout[..., :empty, :] == 0).all()


def _grad_params():
    params = []
    for b in DEVICE:
        cases = TRITON_CASES[1:2] if b == "triton" else [CASES[1], CASES[2], CASES[4]]
        params += [backend_param(b, c, id=f"{b}-{case_id(c)}") for c in cases]
    return params


@pytest.mark.slow
@pytest.mark.parametrize("backend,case", _grad_params())
def test_gradients_through_both_outputs(backend, case, rng):
    """d loss / d (q, k, v, tq, tk, tv) for a loss on (out, tangent), 2 probes, against float64
    torch.func.vjp of the naive (out, tangent)."""
    device = require(backend)
    B, H, Hkv, Nq, Nk, d, causal = case
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, d, FP32, rng, device)
    tangents = make_tangents(q, k, v, 2, rng)
    gout, gtout = randn(q.shape, FP32, rng, device), randn((2,) + tuple(q.shape), FP32, rng, device)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, *tangents)]
    out, tout = condinit.attention_jvp(*leaves, causal=causal, scale=0.3, backend=backend)
    grads = torch.autograd.grad((out, tout), leaves, (gout, gtout))
    ref = torch.func.vjp(lambda *xs: naive_jvp(*xs, causal, 0.3), *f64(q, k, v, *tangents))[1](
        tuple(f64(gout, gtout)))
    for name, g, r, x in zip(("q", "k", "v", "tq", "tk", "tv"), grads, ref, leaves):
        assert g.dtype == FP32 and g.shape == x.shape
        assert_close(g, r, FP32, f"d loss / d {name}", joint_floor(ref))
    empty = empty_rows(Nq, Nk, causal)   # a row that sees no key: no gradient to its q, tq
    assert (grads[0][..., :empty, :] == 0).all() and (grads[3][..., :empty, :] == 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params())
def test_none_tangents(backend, rng):
    """A None tangent is a zero tangent (and gets no gradient); all None gives a zero tangent
    shaped like out; a 4-D tangent gives a 4-D tangent, equal to probe 0 of the 5-D call."""
    device = require(backend)
    shape = (1, 2, 1, 9, 13, 16) if backend == "triton" else (1, 4, 2, 17, 23, 16)
    q, k, v = make_qkv(*shape, FP32, rng, device)
    tq, tk, tv = make_tangents(q, k, v, 2, rng)
    zero = lambda t: torch.zeros_like(t)  # noqa: E731
    for given in [(tq, None, None), (None, tk, None), (None, None, tv), (tq, None, tv)]:
        full = [t if t is not None else zero(r) for t, r in zip(given, (tq, tk, tv))]
        out, tout = condinit.attention_jvp(q, k, v, *given, causal=True, backend=backend)
        out_f, tout_f = condinit.attention_jvp(q, k, v, *full, causal=True, backend=backend)
        assert tout.shape == tq.shape
        torch.testing.assert_close(tout, tout_f, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, out_f)
        leaves = [t.clone().requires_grad_() if t is not None else None for t in given]
        grads = torch.autograd.grad(condinit.attention_jvp(q, k, v, *leaves, causal=True, backend=backend)[1].sum(),
                                    [t for t in leaves if t is not None])
        present = [t for t in given if t is not None]
        assert all(g.shape == t.shape and g.abs().sum() > 0 for g, t in zip(grads, present))
    out, tout = condinit.attention_jvp(q, k, v, causal=True, backend=backend)
    assert tout.shape == q.shape and (tout == 0).all()
    _, t4 = condinit.attention_jvp(q, k, v, tq[0], None, tv[0], causal=True, backend=backend)
    _, t5 = condinit.attention_jvp(q, k, v, tq, None, tv, causal=True, backend=backend)
    assert t4.shape == q.shape
    torch.testing.assert_close(t4, t5[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", backend_params())
def test_probes_share_one_launch(backend, rng):
    """A P-probe call equals P single-probe calls (the probe indexing of the kernels; an odd P
    leaves the last program of a two-probe kernel one probe)."""
    device = require(backend)
    shape = (1, 2, 1, 9, 9, 16) if backend == "triton" else (1, 4, 2, 50, 50, 64)
    q, k, v = make_qkv(*shape, FP32, rng, device)
    P = 3 if backend == "triton" else 5
    tangents = make_tangents(q, k, v, P, rng)
    _, tout = condinit.attention_jvp(q, k, v, *tangents, causal=True, scale=0.3, backend=backend)
    for p in range(P):
        _, tp = condinit.attention_jvp(q, k, v, *(t[p] for t in tangents), causal=True, scale=0.3,
                                       backend=backend)
        torch.testing.assert_close(tout[p], tp, rtol=1e-5, atol=1e-6)


def _dtype_params():
    return [backend_param(b, dt, id=f"{b}-{str(dt)[6:]}") for b in DEVICE
            for dt in (torch.float16, torch.bfloat16, F64) if accepts(b, dt, 64)]


@pytest.mark.parametrize("backend,dtype", _dtype_params())
def test_dtypes(backend, dtype, rng, nan_poison):
    device = require(backend)
    shape, causal = ((1, 2, 1, 17, 9, 16), True) if backend == "triton" else ((1, 4, 2, 33, 47, 64), True)
    q, k, v = make_qkv(*shape, dtype, rng, device)
    tangents = make_tangents(q, k, v, 2, rng)
    out, tout = condinit.attention_jvp(q, k, v, *tangents, causal=causal, backend=backend)
    ref_out, ref_tout = naive_jvp(*f64(q, k, v, *tangents), causal, shape[-1] ** -0.5)
    assert out.dtype == tout.dtype == dtype
    assert_close(out, ref_out, dtype, "out")
    assert_close(tout, ref_tout, dtype, "tangent")


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params())
def test_vmap(backend, rng):
    """vmap over the probe-like leading dim of the tangents only (primals unbatched), and over a
    non-leading dim of q with tangents for q only."""
    device = require(backend)
    dtype = _ad_dtype(backend)
    q, k, v = make_qkv(2, 2, 1, 7, 9, 16, dtype, rng, device)
    tq, tk, tv = make_tangents(q, k, v, 3, rng)
    f = lambda a, b, c: condinit.attention_jvp(q, k, v, a, b, c, causal=True, backend=backend)[1]  # noqa: E731
    t = torch.func.vmap(f)(tq, tk, tv)
    assert_close(t, naive_jvp(*f64(q, k, v, tq, tk, tv), True, 0.25)[1], dtype, "vmap over tangents")
    q5 = randn((2, 3, 2, 7, 16), dtype, rng, device)                     # [B, V, H, N, d]
    tq5 = randn(q5.shape, dtype, rng, device)
    g = lambda a, ta: condinit.attention_jvp(a, k, v, ta, None, None, backend=backend)  # noqa: E731
    out, tout = torch.func.vmap(g, in_dims=(1, 1), out_dims=1)(q5, tq5)
    zeros = torch.zeros((1,) + tuple(k.shape), dtype=F64, device=device)
    for i in range(3):
        ref_out, ref_t = naive_jvp(*f64(q5[:, i], k, v, tq5[None, :, i]), zeros, zeros, False, 0.25)
        assert_close(out[:, i], ref_out, dtype, f"vmap dim 1 out [{i}]")
        assert_close(tout[:, i], ref_t[0], dtype, f"vmap dim 1 tangent [{i}]")


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params())
def test_grad_and_double_backward_of_a_jvp_loss(backend, rng):
    """torch.func.grad of a loss on (out, tangent); a second derivative through the tangent
    backward is refused with a clear error (it is first-order only), and with
    grad_through_tangent=False the flash backward of out stays twice differentiable."""
    device = require(backend)
    dtype = _ad_dtype(backend)
    q, k, v = make_qkv(1, 2, 1, 8, 10, 16, dtype, rng, device)
    xs = (q, k, v, *make_tangents(q, k, v, 2, rng))

    def loss(fn, *args):
        out, tout = fn(*args)
        return out.sin().sum() + tout.square().sum()
    ours = lambda *a: condinit.attention_jvp(*a, causal=True, backend=backend)  # noqa: E731
    ref = lambda *a: naive_jvp(*a, True, 0.25)                                  # noqa: E731
    g = torch.func.grad(lambda *a: loss(ours, *a), argnums=tuple(range(6)))(*xs)
    g_ref = torch.func.grad(lambda *a: loss(ref, *a), argnums=tuple(range(6)))(*f64(*xs))
    for name, a, b in zip(("q", "k", "v", "tq", "tk", "tv"), g, g_ref):
        assert_close(a, b, dtype, f"grad {name}", joint_floor(g_ref))

    leaves = [x.clone().requires_grad_() for x in xs]
    gq = torch.autograd.grad(loss(ours, *leaves), leaves[0], create_graph=True)[0]
    with pytest.raises(RuntimeError, match="second"):
        torch.autograd.grad(gq.sum(), leaves)

    def second(fn, args):
        leaves = [x.clone().requires_grad_() for x in args]
        gq = torch.autograd.grad(fn(*leaves)[0].sin().sum(), leaves[0], create_graph=True)[0]
        return torch.autograd.grad(gq.sum(), leaves[:3])
    first_only = lambda *a: condinit.attention_jvp(*a, causal=True, backend=backend,  # noqa: E731
                                                    grad_through_tangent=False)
    h, h_ref = second(first_only, xs), second(ref, f64(*xs))
    for name, a, b in zip(("q", "k", "v"), h, h_ref):
        assert_close(a, b, dtype, f"d (sum d loss / d q) / d {name}", joint_floor(h_ref))


@pytest.mark.parametrize("backend", backend_params())
def test_non_contiguous_tangents(backend, rng):
    device = require(backend)
    q, k, v = make_qkv(*((1, 2, 2, 9, 11, 16) if backend == "triton" else (1, 4, 2, 19, 19, 16)), FP32, rng, device)
    tangents = make_tangents(q, k, v, 2, rng)
    strided = lambda x: x.transpose(-2, -3).contiguous().transpose(-2, -3)  # noqa: E731
    args = [strided(x) for x in (q, k, v, *tangents)]
    assert not any(a.is_contiguous() for a in args)
    for a, b in zip(condinit.attention_jvp(*args, causal=True, backend=backend),
                    condinit.attention_jvp(q, k, v, *tangents, causal=True, backend=backend)):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_torch_compile(rng):
    """fullgraph through the custom op's fake kernel (aot_eager: cheap); the automatic backend."""
    q, k, v = make_qkv(1, 4, 2, 13, 21, 16, FP32, rng)
    tq = randn(q.shape, FP32, rng)
    torch._dynamo.reset()
    f = lambda q, k, v, t: condinit.attention_jvp(q, k, v, t, None, None, causal=True)  # noqa: E731
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(q, k, v, tq), f(q, k, v, tq)):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


def _bad_calls():
    q, k, v = valid_attention_inputs()
    tq, tk, tv = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
    return [
        ("q 3-D", ValueError, "q must be 4-D", (q[0], k, v, None, None, tv[0]), {}),
        ("mixed dtype", TypeError, "v must have q's dtype", (q, k, v.double(), tq, None, None), {}),
        ("causal", TypeError, "causal must be a bool", (q, k, v, tq, None, None), {"causal": None}),
        ("scale", ValueError, "scale must be finite", (q, k, v, tq, None, None), {"scale": float("inf")}),
        ("backend", ValueError, "backend must be one of", (q, k, v, tq, None, None), {"backend": "gpu"}),
        ("tq shape", ValueError, "tq must have q's shape", (q, k, v, tq[..., :8], None, None), {}),
        ("tk dtype", TypeError, "tk must have k's dtype", (q, k, v, None, tk.double(), None), {}),
        ("tv int", TypeError, "tv must be a floating", (q, k, v, None, None, tv.int()), {}),
        ("tq not a tensor", TypeError, "tq must be a torch.Tensor", (q, k, v, tq.tolist(), None, None), {}),
        ("probe dim mix", ValueError, "all have a leading probe dim", (q, k, v, tq[None], tk, None), {}),
        ("P mismatch", ValueError, "probe count", (q, k, v, tq.expand(2, -1, -1, -1, -1),
                                                   tk.expand(3, -1, -1, -1, -1), None), {}),
        ("P = 0", ValueError, "tq must have q's shape", (q, k, v, torch.zeros((0,) + tuple(q.shape)), None, None), {}),
        ("tangent device", ValueError, "tv must be on v's device", (q, k, v, None, None, tv.to("meta")), {}),
    ]


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
def test_bad_arguments_raise_clear_errors(case, monkeypatch):
    """Validated once, before any kernel runs."""
    _, exc, match, args, kwargs = case
    make_kernels_unreachable(monkeypatch, ATTENTION_JVP)
    with pytest.raises(exc, match=match):
        condinit.attention_jvp(*args, **kwargs)


def test_a_kernel_error_reaches_the_caller(rng, monkeypatch):
    """The automatically chosen JVP kernel raising: that exception, no warning, no fallback."""
    q, k, v = make_qkv(1, 2, 1, 5, 5, 16, FP32, rng)
    chosen = ATTENTION_JVP.choose("cpu", None, dtype=FP32, head_dim=16)
    error = RuntimeError(f"{chosen} kernel exploded")
    make_chosen_kernel_raise(monkeypatch, ATTENTION_JVP, chosen, error)
    with warnings.catch_warnings(), pytest.raises(RuntimeError) as raised:
        warnings.simplefilter("error")
        condinit.attention_jvp(q, k, v, q)
    assert raised.value is error


def test_forced_backend_that_cannot_run_raises(rng):
    q, k, v = make_qkv(1, 2, 1, 5, 5, 320, FP32, rng)
    with pytest.raises(BackendUnavailableError, match="attention_jvp: backend 'triton' .*head_dim 320"):
        condinit.attention_jvp(q, k, v, q, backend="triton")
