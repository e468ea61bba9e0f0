"""condinit.attention on every backend runnable here, against one float64 naive reference.

Backends: ``torch`` (the tiled reference), ``cpp-cpu`` (the C++ CPU kernels of the native
extension; skipped, with the reason, when they are not built) and ``triton`` (the Triton kernels
under TRITON_INTERPRET=1, tiny shapes), each forced with the public ``backend=`` argument; the
CUDA kernels too where a GPU is visible. Checked: the output, dq/dk/dv, forward mode
(``torch.func.jvp``, ``torch.autograd.forward_ad``), vmap / jacfwd / jacrev, double backward,
rows that see no key, NaN inputs, torch.compile, argument errors, and that the backend choice is
made once and never falls back silently. ``attention_jvp`` has tests/test_attention_jvp.py.
"""
import dataclasses
import importlib
import inspect
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import condinit
from condinit import _backends
from condinit._backends import BackendUnavailableError
from condinit.ops.attention import op as attention_op

from attention_cases import (CASES, DEVICE, F64, ODD_HEAD_DIM_CASES, accepts, backend_param,
                             backend_params, cases_per_backend, empty_rows, f64, joint_floor,
                             make_qkv, naive_attention, naive_lse, naive_vjp, randn, require)
from conftest import assert_close
from helpers import make_chosen_kernel_raise, make_kernels_unreachable, valid_attention_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

FP32 = torch.float32


def _attention(backend, causal, scale):
    return lambda q, k, v: condinit.attention(q, k, v, causal=causal, scale=scale, backend=backend)


def _naive(causal, scale):
    return lambda q, k, v: naive_attention(q, k, v, causal, scale)


def _ad_dtype(backend):
    """The AD-transform tests run in float64 where the backend takes it (an exact check of the
    plumbing), else in float32."""
    return F64 if accepts(backend, F64, 16) else FP32


# ------------------------------------------------------------------------------------------------
# values and gradients
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend,case", cases_per_backend())
def test_output_and_gradients(backend, case, rng, nan_poison):
    """out and dq, dk, dv in float32 against float64; rows that see no key are exactly 0."""
    device = require(backend)
    B, H, Hkv, Nq, Nk, d, causal = case
    scale = 0.7 * d ** -0.5
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, d, FP32, rng, device)
    dout = randn(q.shape, FP32, rng, device)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = condinit.attention(*leaves, causal=causal, scale=scale, backend=backend)
    grads = torch.autograd.grad(out, leaves, dout)

    q64, k64, v64, do64 = f64(q, k, v, dout)
    assert out.dtype == FP32 and out.shape == q.shape
    assert_close(out, naive_attention(q64, k64, v64, causal, scale), FP32, "out")
    ref = naive_vjp(q64, k64, v64, do64, causal, scale)
    for name, g, r, x in zip(("dq", "dk", "dv"), grads, ref, (q, k, v)):
        assert g.dtype == FP32 and g.shape == x.shape, name
        assert_close(g, r, FP32, name, joint_floor(ref))
    empty = empty_rows(Nq, Nk, causal)
    assert (out[..., :empty, :] == 0).all() and (grads[0][..., :empty, :] == 0).all()


def test_the_grid_covers_every_kernel_head_dim():
    """The shapes above take every head dim the kernel rows declare, and one they do not."""
    head_dims = {case[5] for case in CASES}
    assert head_dims == set(attention_op.KERNEL_HEAD_DIMS)
    assert all(case[5] not in head_dims for case in ODD_HEAD_DIM_CASES)


def _dtype_params():
    params = []
    for b in DEVICE:
        for dtype in (torch.float16, torch.bfloat16, F64):
            if accepts(b, dtype, 64):
                params.append(backend_param(b, dtype, id=f"{b}-{str(dtype)[6:]}"))
    return params


@pytest.mark.slow
@pytest.mark.parametrize("backend,dtype", _dtype_params())
def test_dtypes(backend, dtype, rng, nan_poison):
    """float16 / bfloat16 (and float64 where the backend takes it): output and gradients in the
    input dtype, within its tolerance; the default scale is 1 / sqrt(d)."""
    device = require(backend)
    shapes = [(1, 2, 1, 17, 9, 16, True), (1, 2, 1, 9, 33, 80, False)] if backend == "triton" else \
        [(1, 4, 2, 33, 47, 64, True), (1, 2, 2, 17, 17, 80, False)]
    for B, H, Hkv, Nq, Nk, d, causal in shapes:
        q, k, v = make_qkv(B, H, Hkv, Nq, Nk, d, dtype, rng, device)
        dout = randn(q.shape, dtype, rng, device)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = condinit.attention(*leaves, causal=causal, backend=backend)
        grads = torch.autograd.grad(out, leaves, dout)
        q64, k64, v64, do64 = f64(q, k, v, dout)
        scale = d ** -0.5
        assert out.dtype == dtype
        assert_close(out, naive_attention(q64, k64, v64, causal, scale), dtype, f"out {Nq}x{Nk}")
        ref = naive_vjp(q64, k64, v64, do64, causal, scale)
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
            assert g.dtype == dtype
            assert_close(g, r, dtype, f"{name} {Nq}x{Nk}", joint_floor(ref))


@pytest.mark.parametrize("backend", backend_params())
def test_lse_and_rows_that_see_no_key(backend, rng, nan_poison):
    """The forward op's log-sum-exp, in the dtype its fake kernel declares (float32, float64 for
    float64 inputs): -inf exactly on rows with no visible key (causal, Nq > Nk), whose output is
    0, and logsumexp of the scores elsewhere (accumulated in float32 at least)."""
    device = require(backend)
    B, H, Hkv, Nq, Nk, d = (1, 2, 1, 17, 9, 16) if backend == "triton" else (2, 4, 2, 40, 15, 32)
    empty = Nq - Nk
    for dtype in (dt for dt in (FP32, torch.bfloat16, F64) if accepts(backend, dt, d)):
        q, k, v = make_qkv(B, H, Hkv, Nq, Nk, d, dtype, rng, device)
        out, lse = torch.ops.condinit.attention_fwd(q, k, v, True, 0.25, -1, -1, None, None, backend)
        ref = naive_lse(*f64(q, k), True, 0.25)
        lse_dtype = F64 if dtype == F64 else FP32
        assert lse.dtype == lse_dtype and lse.shape == (B, H, Nq), f"{dtype} inputs: lse {lse.dtype}"
        assert torch.isneginf(lse[..., :empty]).all() and (out[..., :empty, :] == 0).all()
        assert_close(lse[..., empty:], ref[..., empty:], lse_dtype, f"lse ({dtype} inputs)", floor=1.0)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_input_reaches_the_rows_that_read_it(backend, where, rng):
    """A NaN in q (its row), in a key (every row that attends it) or in a value (that column of
    every row that attends it) comes out NaN there, not 0; a row that cannot see a NaN key is
    unaffected (causal masking), and every other element matches the reference."""
    device = require(backend)
    causal = where != "v"   # a masked value is multiplied by a 0 weight: NaN in the naive product
    B, H, Hkv, Nq, Nk, d = 1, 2, 1, 17, 9, 16
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, d, FP32, rng, device)
    row, key = 12, 3        # causal: key 3 is seen by rows i >= 3 + Nq - Nk = 11
    if where == "q":
        q[0, 1, row, 5] = float("nan")
    elif where == "k":
        k[0, 0, key, 5] = float("nan")
    else:
        v[0, 0, key, 5] = float("nan")
    out = condinit.attention(q, k, v, causal=causal, backend=backend)
    ref = naive_attention(*f64(q, k, v), causal, 0.25)
    nan = out.isnan()
    if where == "q":
        assert nan[0, 1, row].all() and nan.sum() == d, "exactly q's row is NaN"
    elif where == "k":
        assert nan[0, :, key + Nq - Nk:].all() and nan.sum() == H * (Nq - key - (Nq - Nk)) * d
    else:
        assert nan[0, :, :, 5].all() and nan.sum() == H * Nq
    assert_close(out, ref, FP32, "elements without NaN")   # rel_err: NaN only where ref is NaN


@pytest.mark.parametrize("backend", backend_params())
def test_non_contiguous_inputs_and_cotangent(backend, rng):
    """Transposed views as q, k, v and as the cotangent give what contiguous tensors give."""
    device = require(backend)
    q, k, v = make_qkv(*((1, 2, 1, 9, 11, 16) if backend == "triton" else (1, 4, 2, 19, 19, 16)), FP32, rng, device)
    dout = randn(q.shape, FP32, rng, device)
    strided = lambda x: x.transpose(1, 2).contiguous().transpose(1, 2)  # noqa: E731
    results = []
    for make in (lambda x: x.clone(), strided):
        leaves = [make(x).requires_grad_() for x in (q, k, v)]
        assert leaves[0].is_contiguous() == (make is not strided)
        out = condinit.attention(*leaves, causal=True, backend=backend)
        results.append((out, *torch.autograd.grad(out, leaves, make(dout))))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------------------
# forward mode, torch.func transforms, second order
# ------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("causal", [False, True])
def test_forward_mode(backend, causal, rng):
    """torch.func.jvp and forward_ad dual numbers (some primals without tangent) through the
    fused JVP op."""
    device = require(backend)
    dtype = _ad_dtype(backend)
    q, k, v = make_qkv(1, 4, 2, 9, 11, 16, dtype, rng, device)
    tq, tk, tv = (randn(x.shape, dtype, rng, device) for x in (q, k, v))
    ours = _attention(backend, causal, 0.3)
    out, tout = torch.func.jvp(ours, (q, k, v), (tq, tk, tv))
    ref_out, ref_tout = torch.func.jvp(_naive(causal, 0.3), f64(q, k, v), f64(tq, tk, tv))
    assert_close(out, ref_out, dtype, "out")
    assert_close(tout, ref_tout, dtype, "tangent")

    with fwAD.dual_level():
        dual = ours(fwAD.make_dual(q, tq), k, fwAD.make_dual(v, tv))
        primal, tangent = fwAD.unpack_dual(dual)
    zero = torch.zeros_like(k, dtype=F64)
    ref_tout = torch.func.jvp(_naive(causal, 0.3), f64(q, k, v), (*f64(tq), zero, *f64(tv)))[1]
    assert_close(primal, ref_out, dtype, "forward_ad primal")
    assert_close(tangent, ref_tout, dtype, "forward_ad tangent (k without tangent)")


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params())
def test_vmap(backend, rng):
    """vmap over a leading dim, and over a non-leading dim of q with k, v not vmapped."""
    device = require(backend)
    dtype = _ad_dtype(backend)
    q, k, v = make_qkv(3, 2, 1, 7, 9, 16, dtype, rng, device)
    ours = _attention(backend, True, 0.25)
    out = torch.func.vmap(ours)(q[:, None], k[:, None], v[:, None])           # V = 3, B = 1
    assert_close(out[:, 0], naive_attention(*f64(q, k, v), True, 0.25), dtype, "vmap dim 0")
    q5 = randn((2, 3, 2, 7, 16), dtype, rng, device)                          # [B, V, H, N, d]
    o5 = torch.func.vmap(_attention(backend, False, 0.25), in_dims=(1, None, None), out_dims=1)(
        q5, k[:2], v[:2])
    k64, v64 = f64(k[:2], v[:2])
    ref = torch.stack([naive_attention(f64(q5[:, i])[0], k64, v64, False, 0.25) for i in range(3)], 1)
    assert_close(o5, ref, dtype, "vmap dim 1, k and v unbatched")


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params())
def test_jvp_of_vmap_and_vmap_of_jvp(backend, rng):
    """Both compositions of forward AD and vmap give the per-example tangents."""
    device = require(backend)
    dtype = _ad_dtype(backend)
    q, k, v = make_qkv(3, 2, 1, 7, 9, 16, dtype, rng, device)
    tq, tk, tv = (randn(x.shape, dtype, rng, device) for x in (q, k, v))
    ours = _attention(backend, True, 0.25)
    args, tangents = (q[:, None], k[:, None], v[:, None]), (tq[:, None], tk[:, None], tv[:, None])
    ref = torch.func.jvp(_naive(True, 0.25), f64(q, k, v), f64(tq, tk, tv))[1]
    jv = torch.func.jvp(torch.func.vmap(ours), args, tangents)[1]
    vj = torch.func.vmap(lambda a, b, c, ta, tb, tc: torch.func.jvp(ours, (a, b, c), (ta, tb, tc))[1])(
        *args, *tangents)
    assert_close(jv[:, 0], ref, dtype, "jvp of vmap")
    assert_close(vj[:, 0], ref, dtype, "vmap of jvp")


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params())
def test_func_grad_and_grad_of_grad(backend, rng):
    """torch.func.grad (and grad of grad) over the op, against the float64 naive attention."""
    device = require(backend)
    dtype = _ad_dtype(backend)
    q, k, v = make_qkv(1, 2, 1, 7, 9, 16, dtype, rng, device)
    ours, ref = _attention(backend, True, 0.25), _naive(True, 0.25)
    g = torch.func.grad(lambda a: ours(a, k, v).sin().sum())(q)
    k64, v64 = f64(k, v)
    g_ref = torch.func.grad(lambda a: ref(a, k64, v64).sin().sum())(f64(q)[0])
    assert_close(g, g_ref, dtype, "func.grad")
    h = torch.func.grad(lambda a: torch.func.grad(lambda b: ours(b, k, v).sin().sum())(a).square().sum())(q)
    h_ref = torch.func.grad(lambda a: torch.func.grad(
        lambda b: ref(b, k64, v64).sin().sum())(a).square().sum())(f64(q)[0])
    assert_close(h, h_ref, dtype, "grad of grad", joint_floor([h_ref]))


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params())
def test_jacfwd_jacrev(backend, rng):
    """Full Jacobians by forward mode (fused JVP under vmap) and reverse mode (flash VJP under
    vmap) against the naive attention's."""
    device = require(backend)
    dtype = _ad_dtype(backend)
    # Under the interpreter every Jacobian column is a program: one head, 2 queries, 3 keys, and
    # the Jacobian in k alone (through the softmax, the path the others share).
    shape, argnums = ((1, 1, 1, 2, 3, 16), (1,)) if backend == "triton" else ((1, 2, 1, 3, 5, 16), (0, 1, 2))
    q, k, v = make_qkv(*shape, dtype, rng, device)
    ref = torch.func.jacrev(_naive(True, 0.25), argnums=argnums)(*f64(q, k, v))
    for transform in (torch.func.jacfwd, torch.func.jacrev):
        jac = transform(_attention(backend, True, 0.25), argnums=argnums)(q, k, v)
        for i, a, b in zip(argnums, jac, ref):
            assert_close(a, b, dtype, f"{transform.__name__} d out / d {'qkv'[i]}", joint_floor(ref))


@pytest.mark.parametrize("backend", backend_params())
def test_double_backward(backend, rng):
    """Hessian-vector products: the backward op is itself differentiable."""
    device = require(backend)
    dtype = _ad_dtype(backend)
    q, k, v = make_qkv(1, 4, 2, 9, 11, 16, dtype, rng, device)

    def hvp(fn, xs):
        leaves = [x.clone().requires_grad_() for x in xs]
        gq, gk, gv = torch.autograd.grad(fn(*leaves).sin().sum(), leaves, create_graph=True)
        return torch.autograd.grad((gq * gq).sum() + (gk * gv).sum(), leaves)

    ours = hvp(_attention(backend, True, 0.25), (q, k, v))
    ref = hvp(_naive(True, 0.25), f64(q, k, v))
    for name, a, b in zip(("q", "k", "v"), ours, ref):
        assert_close(a, b, dtype, f"hvp {name}", joint_floor(ref))


@pytest.mark.slow
def test_torch_compile(rng):
    """Dynamo traces the custom ops through their fake kernels, fullgraph, forward and backward
    (aot_eager: no code generation, so this stays cheap); the automatic backend."""
    q, k, v = make_qkv(1, 4, 2, 13, 21, 16, FP32, rng)
    torch._dynamo.reset()

    def f(q, k, v):
        return (condinit.attention(q, k, v, causal=True) * 2).sin()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, f):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        results.append((out, *torch.autograd.grad(out.sum(), leaves)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


@pytest.mark.slow
def test_torch_compile_forward_mode(rng):
    """Compiled functions taking a forward-mode tangent through condinit.attention (torch.func.jvp,
    a forward-AD dual level, vmap of jvp) give the float64 reference's tangent, never zeros; a
    compiled torch.func.grad too."""
    import torch.autograd.forward_ad as fwAD
    q, k, v = make_qkv(1, 2, 1, 7, 7, 8, torch.float64, rng)
    tq = torch.randn(q.shape, generator=rng, dtype=torch.float64)
    naive = _naive(True, 8 ** -0.5)
    f = lambda x: condinit.attention(x, k, v, causal=True)  # noqa: E731

    def dual(x, t):
        with fwAD.dual_level():
            return fwAD.unpack_dual(f(fwAD.make_dual(x, t))).tangent

    cases = [
        (lambda x, t: torch.func.jvp(f, (x,), (t,))[1], (q, tq),
         torch.func.jvp(lambda x: naive(x, k, v), (q,), (tq,))[1]),
        (dual, (q, tq), torch.func.jvp(lambda x: naive(x, k, v), (q,), (tq,))[1]),
        (lambda x, t: torch.func.vmap(lambda a, b: torch.func.jvp(f, (a,), (b,))[1])(x, t), (q[None], tq[None]),
         torch.func.jvp(lambda x: naive(x, k, v), (q,), (tq,))[1][None]),
        (lambda x: torch.func.grad(lambda a: f(a).sin().sum())(x), (q,),
         torch.func.grad(lambda a: naive(a, k, v).sin().sum())(q)),
    ]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for fn, args, ref in cases:
            torch._dynamo.reset()
            got = torch.compile(fn, backend="aot_eager")(*args)
            assert got.abs().max() > 0
            torch.testing.assert_close(got, ref)
    torch._dynamo.reset()
    # Dynamo tracing condinit's own code (the backend choice, its caches) warns about nothing
    ours = [str(w.message)[:200] for w in seen if "condinit" in str(w.message)]
    assert not ours, ours


@pytest.mark.slow
def test_torch_compile_inductor(rng):
    """The default (inductor) backend, forward only: generated code around the custom op."""
    q, k, v = make_qkv(1, 2, 1, 9, 9, 16, FP32, rng)
    torch._dynamo.reset()
    f = lambda q, k, v: condinit.attention(q, k, v) + 1  # noqa: E731
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v))
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------
# argument errors
# ------------------------------------------------------------------------------------------------

def _bad_calls():
    q, k, v = valid_attention_inputs()
    return [
        ("q 3-D", ValueError, "q must be 4-D", (q[0], k, v), {}),
        ("k 5-D", ValueError, "k must be 4-D", (q, k[None], v), {}),
        ("empty", ValueError, "q must have no empty dimension", (q[:, :, :0], k, v), {}),
        ("int q", TypeError, "q must be a floating", (q.long(), k, v), {}),
        ("not a tensor", TypeError, "v must be a .*Tensor", (q, k, v.tolist()), {}),
        ("mixed dtype", TypeError, "k must have q's dtype", (q, k.double(), v), {}),
        ("batch", ValueError, "batch size", (q, k.expand(2, -1, -1, -1), v), {}),
        ("head dim", ValueError, "head dim", (q, k[..., :8], v[..., :8]), {}),
        ("Nk mismatch", ValueError, "same shape", (q, k, v[:, :, :5]), {}),
        ("Hkv", ValueError, "must divide", (q, torch.randn(1, 3, 6, 16), torch.randn(1, 3, 6, 16)), {}),
        ("device", ValueError, "k must be on q's device", (q, k.to("meta"), v), {}),
        ("causal int", TypeError, "causal must be a bool", (q, k, v), {"causal": 1}),
        ("scale str", TypeError, "scale must be a real", (q, k, v), {"scale": "0.1"}),
        ("scale bool", TypeError, "scale must be a real", (q, k, v), {"scale": True}),
        ("scale nan", ValueError, "scale must be finite", (q, k, v), {"scale": float("nan")}),
        ("backend name", ValueError, "backend must be one of", (q, k, v), {"backend": "cudnn"}),
        ("backend type", TypeError, "backend must be a str", (q, k, v), {"backend": 1}),
    ]


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
def test_bad_arguments_raise_clear_errors(case, monkeypatch):
    """Validated once, before any kernel runs (every table row would raise if reached)."""
    _, exc, match, args, kwargs = case
    make_kernels_unreachable(monkeypatch, attention_op.ATTENTION_FWD, attention_op.ATTENTION_BWD,
                             attention_op.ATTENTION_JVP)
    with pytest.raises(exc, match=match):
        condinit.attention(*args, **kwargs)


# ------------------------------------------------------------------------------------------------
# backend choice: once per call, forced or automatic, never a silent fallback
# ------------------------------------------------------------------------------------------------

def _chosen(table, q):
    return table.choose(q.device, None, dtype=q.dtype, head_dim=q.shape[-1])


@pytest.mark.parametrize("stage", ["forward", "backward", "forward mode"])
def test_a_kernel_error_reaches_the_caller(stage, rng, monkeypatch):
    """The automatically chosen kernel raising: that exact exception reaches the caller, with no
    warning and no other backend tried (every other row would raise an AssertionError)."""
    q, k, v = make_qkv(1, 2, 1, 5, 5, 16, FP32, rng)
    table = {"forward": attention_op.ATTENTION_FWD, "backward": attention_op.ATTENTION_BWD,
             "forward mode": attention_op.ATTENTION_JVP}[stage]
    chosen = _chosen(table, q)
    error = RuntimeError(f"{chosen} kernel exploded")
    make_chosen_kernel_raise(monkeypatch, table, chosen, error)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with warnings.catch_warnings(), pytest.raises(RuntimeError) as raised:
        warnings.simplefilter("error")
        # torch.func's first use imports code that warns about torch.jit.script: torch's, not ours
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning)
        if stage == "forward":
            condinit.attention(q, k, v)
        elif stage == "backward":
            torch.autograd.grad(condinit.attention(*leaves).sum(), leaves)
        else:
            torch.func.jvp(condinit.attention, (q, k, v), (q, k, v))
    assert raised.value is error


def test_automatic_choice_on_cpu():
    """cpp-cpu when built (any head dim and dtype, float64 included), else the torch reference;
    Triton on the CPU (the interpreter) only when forced."""
    expected = "cpp-cpu" if _backends.available("cpp-cpu", "cpu", "attention_fwd")[0] else "torch"
    for table in (attention_op.ATTENTION_FWD, attention_op.ATTENTION_BWD, attention_op.ATTENTION_JVP):
        for dtype, head_dim in ((FP32, 64), (torch.bfloat16, 128), (FP32, 24)):
            assert table.choose("cpu", None, dtype=dtype, head_dim=head_dim) == expected
        assert table.choose("cpu", None, dtype=F64, head_dim=16) == expected
        assert table.choose("cpu", "auto", dtype=FP32, head_dim=64) == expected


@pytest.mark.parametrize("backend,dtype,head_dim,reason", [
    ("cuda", FP32, 64, "runs on cuda tensors only"),
    ("triton", FP32, 320, "head_dim 320 not in"),
    ("triton", F64, 64, "dtype float64 not in"),
])
def test_forced_backend_that_cannot_run_raises(backend, dtype, head_dim, reason, rng):
    q, k, v = make_qkv(1, 2, 1, 5, 5, head_dim, dtype, rng)
    with pytest.raises(BackendUnavailableError, match=f"backend '{backend}' cannot run .*{reason}"):
        condinit.attention(q, k, v, backend=backend)


def test_forced_triton_on_cpu_needs_the_interpreter(rng, monkeypatch):
    q, k, v = make_qkv(1, 2, 1, 5, 5, 16, FP32, rng)
    try:
        with monkeypatch.context() as env:
            env.delenv("TRITON_INTERPRET", raising=False)
            _backends.reset()
            with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
                condinit.attention(q, k, v, backend="triton")
    finally:
        _backends.reset()  # forget the availability cached without the variable


def test_backend_forced_by_environment(rng, forced_backend, monkeypatch):
    """CONDINIT_BACKEND per op or for all; ``backend="auto"`` overrides it."""
    q, k, v = make_qkv(1, 2, 1, 5, 5, 16, FP32, rng)
    calls = []
    for table in (attention_op.ATTENTION_FWD, attention_op.ATTENTION_BWD):
        impl = table.impls["torch"]
        spy = lambda *a, _fn=impl.fn, _name=table.name: calls.append(_name) or _fn(*a)  # noqa: E731
        monkeypatch.setitem(table.impls, "torch", dataclasses.replace(impl, fn=spy))
    forced_backend("attention_fwd=torch,attention_bwd=torch")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = condinit.attention(*leaves)
    torch.autograd.grad(out.sum(), leaves)
    assert calls == ["attention_fwd", "attention_bwd"]
    assert_close(out, naive_attention(*f64(q, k, v), False, 0.25), FP32, "out")

    forced_backend("cuda")
    with pytest.raises(BackendUnavailableError, match="attention_fwd: backend 'cuda'"):
        condinit.attention(q, k, v)
    assert_close(condinit.attention(q, k, v, backend="auto"), naive_attention(*f64(q, k, v), False, 0.25),
                 FP32, "backend='auto' under CONDINIT_BACKEND=cuda")


def test_public_names(rng):
    """condinit.attention is the function; importing the op family's modules does not rebind it."""
    assert importlib.import_module("condinit.ops.attention").attention is condinit.attention
    assert condinit.attention is attention_op.attention and condinit.attention_jvp is attention_op.attention_jvp
    assert {"causal", "scale", "backend"} <= set(inspect.signature(condinit.attention).parameters)
    assert condinit.BackendUnavailableError is BackendUnavailableError
    assert issubclass(BackendUnavailableError, RuntimeError)
