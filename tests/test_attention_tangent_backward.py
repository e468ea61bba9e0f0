"""Gradients through condinit.attention_jvp's tangent output (the ``attention_jvp_bwd`` op).

Against a float64 naive reference written here (softmax attention with the N x N matrix,
``torch.func.jvp`` for the tangent, ``torch.autograd.grad`` of a random linear loss on
``(out, tangent_out)``): every backend of the tangent-backward table runnable here, forced
through ``CONDINIT_BACKEND=attention_jvp_bwd=...`` (the forward is the automatic JVP), for
N = 1, ragged and multi-tile N, causal with Nq != Nk both ways (rows that see no key), GQA,
P = 1 and 3 probes, float32 / bfloat16 / float64. Then None tangents, the tiled reference with
small blocks, the C++ kernel's determinism, ``grad_through_tangent=False``, the error on a
second-order gradient, ``torch.func``, ``torch.compile``, a forced backend without a
tangent-backward row, and the backward's O(N) memory.
"""
import dataclasses
import math
import weakref

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import condinit
from condinit import _backends
from condinit.ops.attention import reference
from condinit.ops.attention.op import ATTENTION_BWD, ATTENTION_JVP_BWD

from conftest import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")

F64, FP32, BF16 = torch.float64, torch.float32, torch.bfloat16
NAMES = ("q", "k", "v", "tq", "tk", "tv")


# ------------------------------------------------------------------------------------------------
# the float64 reference
# ------------------------------------------------------------------------------------------------

def naive_attention(q, k, v, causal, scale):
    """softmax(scale q k^T + mask) v, the N x N matrix materialized; GQA by repeating k, v; a
    row that sees no key gives 0 (finite in every AD mode)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = scale * q @ k.transpose(-1, -2)
    n_q, n_k = q.shape[2], k.shape[2]
    i = torch.arange(n_q)[:, None]
    j = torch.arange(n_k)[None, :]
    seen = (j <= i + (n_k - n_q)) if causal else torch.ones(n_q, n_k, dtype=torch.bool)
    row_sees = seen.any(-1, keepdim=True)
    s = torch.where(seen & row_sees, s, torch.where(row_sees, float("-inf"), 0.0))
    return (torch.softmax(s, -1) * row_sees) @ v


def naive_outputs(q, k, v, tq, tk, tv, causal, scale):
    """(out, tangent [P, ...]) by torch.func.jvp, one probe at a time."""
    f = lambda a, b, c: naive_attention(a, b, c, causal, scale)  # noqa: E731
    touts = [torch.func.jvp(f, (q, k, v), (tq[p], tk[p], tv[p]))[1] for p in range(tq.shape[0])]
    return f(q, k, v), torch.stack(touts)


def naive_grads(inputs, gout, gtout, causal, scale):
    """d <gout, out> + <gtout, tangent> / d (q, k, v, tq, tk, tv), in float64."""
    leaves = [x.detach().to(F64).requires_grad_() for x in inputs]
    out, tout = naive_outputs(*leaves, causal, scale)
    loss = (out * gout.to(F64)).sum() + (tout * gtout.to(F64)).sum()
    return torch.autograd.grad(loss, leaves)


def randn(shape, dtype, rng):
    """Drawn in float64 and rounded to dtype: the reference sees the same rounded values."""
    return torch.randn(shape, generator=rng, dtype=F64).to(dtype)


def make_inputs(case, P, dtype, rng):
    B, H, Hkv, Nq, Nk, d, causal = case
    q, k, v = randn((B, H, Nq, d), dtype, rng), randn((B, Hkv, Nk, d), dtype, rng), randn((B, Hkv, Nk, d), dtype, rng)
    tangents = tuple(randn((P,) + tuple(x.shape), dtype, rng) for x in (q, k, v))
    return (q, k, v) + tangents, randn(q.shape, dtype, rng), randn((P,) + tuple(q.shape), dtype, rng)


def floors(ref):
    """Error floors: a gradient that is 0 in exact arithmetic (dq of a row seeing one key) comes
    out as rounding noise of its group's size; measured against 0.1 x the group's largest."""
    primal = 0.1 * max(r.abs().max().item() for r in ref[:3])
    tangent = 0.1 * max(r.abs().max().item() for r in ref[3:])
    return (primal,) * 3 + (tangent,) * 3


# ------------------------------------------------------------------------------------------------
# backends
# ------------------------------------------------------------------------------------------------

BACKENDS = ("torch", "cpp-cpu")


def require(backend):
    ok, why = _backends.available(backend, "cpu", ATTENTION_JVP_BWD.impls[backend].native_op)
    if not ok:
        pytest.skip(f"{backend} cannot run attention_jvp_bwd here: {why}")


@pytest.fixture
def tangent_backward(forced_backend, monkeypatch):
    """``tangent_backward("cpp-cpu")`` forces that row of the tangent-backward table and returns
    a list that records the backend of every call it receives."""
    def force(backend):
        require(backend)
        forced_backend(f"attention_jvp_bwd={backend}")
        calls = []
        for name, impl in ATTENTION_JVP_BWD.impls.items():
            def spy(*args, _fn=impl.fn, _name=name):
                calls.append(_name)
                return _fn(*args)
            monkeypatch.setitem(ATTENTION_JVP_BWD.impls, name, dataclasses.replace(impl, fn=spy))
        return calls
    return force


# (B, H, Hkv, Nq, Nk, d, causal)
CASES = [
    (1, 1, 1, 1, 1, 16, False),         # N = 1: dq and dk are exactly 0
    (2, 2, 1, 17, 17, 16, True),        # ragged N, GQA 2
    (1, 4, 2, 70, 70, 32, False),       # two C++ query tiles, GQA 2
    (1, 2, 1, 70, 33, 16, True),        # causal Nq > Nk: rows 0..36 see no key
    (1, 2, 2, 33, 300, 24, True),       # causal Nq < Nk, three C++ key tiles, odd head dim
]


def case_id(case):
    B, H, Hkv, Nq, Nk, d, causal = case
    return f"B{B}H{H}kv{Hkv}-{Nq}x{Nk}-d{d}" + ("-causal" if causal else "")


def _params():
    params = []
    for backend in BACKENDS:
        for case in CASES:
            for P in (1, 3):
                for dtype in (FP32, BF16, F64):
                    if dtype != FP32 and case[3] * case[4] > 5000:   # the big shapes in float32 only
                        continue
                    params.append(pytest.param(backend, case, P, dtype,
                                               id=f"{backend}-{case_id(case)}-P{P}-{str(dtype)[6:]}"))
    return params


@pytest.mark.parametrize("backend,case,P,dtype", _params())
def test_gradients_match_float64_autograd(backend, case, P, dtype, rng, tangent_backward):
    """All six gradients of a random linear loss on (out, tangent [P, ...]); rows that see no
    key get exactly zero dq and dtq."""
    calls = tangent_backward(backend)
    *_, Nq, Nk, d, causal = case
    scale = 0.7 / math.sqrt(d)
    inputs, gout, gtout = make_inputs(case, P, dtype, rng)
    leaves = [x.clone().requires_grad_() for x in inputs]
    out, tout = condinit.attention_jvp(*leaves, causal=causal, scale=scale)
    grads = torch.autograd.grad((out, tout), leaves, (gout, gtout))
    assert calls == [backend]
    ref = naive_grads(inputs, gout, gtout, causal, scale)
    for name, g, r, x, floor in zip(NAMES, grads, ref, inputs, floors(ref)):
        assert g.dtype == dtype and g.shape == x.shape, name
        assert_close(g, r, dtype, f"d loss / d {name}", floor)
    empty = Nq - Nk if causal and Nq > Nk else 0
    assert (grads[0][..., :empty, :] == 0).all() and (grads[3][..., :empty, :] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_none_tangents(backend, rng, tangent_backward):
    """A None tangent is a zero tangent and gets no gradient (None); the given ones get theirs;
    a tangent without probe dim gets a gradient without one."""
    tangent_backward(backend)
    case = (1, 4, 2, 23, 19, 16, True)
    inputs, gout, gtout = make_inputs(case, 2, FP32, rng)
    zeros = [torch.zeros_like(t) for t in inputs[3:]]
    for present in ((1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 0, 1)):
        given = [t if p else None for t, p in zip(inputs[3:], present)]
        leaves = [x.clone().requires_grad_() for x in inputs[:3]] + [
            t.clone().requires_grad_() if t is not None else None for t in given]
        out, tout = condinit.attention_jvp(*leaves, causal=True)
        wrt = [x for x in leaves if x is not None]
        grads = iter(torch.autograd.grad((out, tout), wrt, (gout, gtout)))
        full = inputs[:3] + tuple(t if p else z for t, z, p in zip(inputs[3:], zeros, present))
        ref = naive_grads(full, gout, gtout, True, 0.25)
        fl = floors(ref)
        for i, (name, r) in enumerate(zip(NAMES, ref)):
            if i < 3 or present[i - 3]:
                assert_close(next(grads), r, FP32, f"{present}: d loss / d {name}", fl[i])
    q, k, v = (x.clone().requires_grad_() for x in inputs[:3])
    tq = inputs[3][0].clone().requires_grad_()
    _, tout = condinit.attention_jvp(q, k, v, tq, causal=True)
    assert tout.shape == q.shape
    (g,) = torch.autograd.grad(tout, tq, gtout[0])
    assert g.shape == tq.shape


def test_reference_with_small_blocks(rng):
    """The tiled reference walking many query and key blocks (ragged last ones, the causal
    diagonal inside blocks, blocks that see no key) equals the float64 naive gradients."""
    case = (1, 4, 2, 45, 29, 16, True)
    inputs, gout, gtout = make_inputs(case, 3, F64, rng)
    out, tout, lse = reference.attention_jvp(*inputs, True, 0.3)
    grads = reference.attention_jvp_bwd(gout, gtout, *inputs, out, tout, lse, True, 0.3, block_q=8, block_k=5)
    ref = naive_grads(inputs, gout, gtout, True, 0.3)
    for name, g, r, floor in zip(NAMES, grads, ref, floors(ref)):
        assert_close(g, r, F64, f"d loss / d {name}", floor)


def test_cpp_kernel_is_deterministic(rng):
    """Each output row is written by one task in a fixed order: bitwise equal results for 1 and
    2 threads."""
    require("cpp-cpu")
    inputs, gout, gtout = make_inputs((1, 4, 2, 150, 260, 16, True), 2, FP32, rng)
    out, tout, lse = torch.ops.condinit_C.attention_jvp(*inputs, True, 0.25, -1, -1, None, None)
    args = (gout, gtout, *inputs, out, tout, lse, True, 0.25, -1, -1, None, None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.condinit_C.attention_jvp_bwd(*args)
        torch.set_num_threads(2)
        two = torch.ops.condinit_C.attention_jvp_bwd(*args)
    finally:
        torch.set_num_threads(threads)
    for name, a, b in zip(NAMES, one, two):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------------------------------------
# grad_through_tangent=False, second order, torch.func
# ------------------------------------------------------------------------------------------------

def test_without_grad_through_tangent(rng, monkeypatch):
    """tangent_out comes back detached; the backward is the flash backward of out alone, with
    the same gradients as the full path for a loss that does not use the tangent."""
    ran = []
    for name, impl in ATTENTION_BWD.impls.items():
        def spy(*args, _fn=impl.fn, _name=name):
            ran.append(_name)
            return _fn(*args)
        monkeypatch.setitem(ATTENTION_BWD.impls, name, dataclasses.replace(impl, fn=spy))
    inputs, gout, _ = make_inputs((1, 4, 2, 37, 41, 16, True), 2, FP32, rng)
    leaves = [x.clone().requires_grad_() for x in inputs]
    out, tout = condinit.attention_jvp(*leaves, causal=True, grad_through_tangent=False)
    assert out.requires_grad and not tout.requires_grad
    flash = torch.autograd.grad(out, leaves[:3], gout)
    assert len(ran) == 1
    out_full, _ = condinit.attention_jvp(*leaves, causal=True)
    full = torch.autograd.grad(out_full, leaves, gout)       # gtout = 0
    assert len(ran) == 1                                      # the tangent backward ran, not the flash one
    for name, a, b in zip(NAMES, flash, full):
        assert_close(a, b, FP32, f"d loss / d {name}")
    assert all((g == 0).all() for g in full[3:])
    ref = torch.func.vjp(lambda *xs: naive_attention(*xs, True, 0.25),
                         *(x.to(F64) for x in inputs[:3]))[1](gout.to(F64))
    for name, a, r in zip(NAMES, flash, ref):
        assert_close(a, r, FP32, f"flash d loss / d {name}")
    with pytest.raises(TypeError, match="grad_through_tangent must be a bool"):
        condinit.attention_jvp(*inputs, grad_through_tangent=1)


def test_second_order_raises(rng):
    """A second derivative through the tangent backward raises (eager and torch.func alike:
    never a silent zero); first-order gradients with create_graph=True still work."""
    inputs, _, _ = make_inputs((1, 2, 1, 9, 11, 16, True), 2, F64, rng)

    def loss(*xs):
        out, tout = condinit.attention_jvp(*xs, causal=True, backend="torch")
        return out.sin().sum() + tout.square().sum()
    leaves = [x.clone().requires_grad_() for x in inputs]
    grads = torch.autograd.grad(loss(*leaves), leaves, create_graph=True)
    ref = torch.func.grad(lambda *xs: (lambda o, t: o.sin().sum() + t.square().sum())(
        *naive_outputs(*xs, True, 0.25)), argnums=tuple(range(6)))(*inputs)
    for name, g, r, floor in zip(NAMES, grads, ref, floors(ref)):
        assert_close(g, r, F64, f"d loss / d {name}", floor)
    with pytest.raises(RuntimeError, match="second-order gradients through the backward of its tangent"):
        torch.autograd.grad(grads[0].sum(), leaves, allow_unused=True)
    with pytest.raises(RuntimeError, match="second-order gradients through the backward of its tangent"):
        torch.func.grad(lambda *xs: torch.func.grad(loss)(*xs).sum())(*inputs)


def test_vmap_of_grad(rng):
    """torch.func.vmap over torch.func.grad (the vmap rule of condinit::attention_jvp_bwd)
    equals a loop."""
    inputs, _, gtout = make_inputs((1, 2, 1, 9, 11, 16, True), 3, F64, rng)
    q, k, v, tq = inputs[:4]

    def grad_q(t):
        return torch.func.grad(lambda a: (condinit.attention_jvp(a, k, v, t, causal=True)[1] * gtout[0]).sum())(q)
    batched = torch.func.vmap(grad_q)(tq)
    looped = torch.stack([grad_q(t) for t in tq])
    assert_close(batched, looped, F64, "vmap over probes")


@pytest.mark.slow
def test_torch_compile_backward(rng):
    """fullgraph through the op's fake kernel, forward and backward (aot_eager: cheap)."""
    inputs, gout, gtout = make_inputs((1, 4, 2, 13, 21, 16, True), 2, FP32, rng)
    torch._dynamo.reset()

    def loss(q, k, v, tq):
        out, tout = condinit.attention_jvp(q, k, v, tq, None, None, causal=True)
        return (out * gout).sum() + (tout * gtout).sum()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    leaves = [x.clone().requires_grad_() for x in inputs[:4]]
    for a, b in zip(torch.autograd.grad(compiled(*leaves), leaves), torch.autograd.grad(loss(*leaves), leaves)):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


@pytest.mark.triton
def test_forced_backend_runs_its_own_tangent_backward(rng, monkeypatch):
    """backend="triton" forces the JVP, and the tangent backward runs Triton's row too (the
    gradients are right)."""
    ok, why = _backends.available("triton", "cpu")
    if not ok:
        pytest.skip(why)
    ran = []
    for name, impl in ATTENTION_JVP_BWD.impls.items():
        def spy(*args, _fn=impl.fn, _name=name):
            ran.append(_name)
            return _fn(*args)
        monkeypatch.setitem(ATTENTION_JVP_BWD.impls, name, dataclasses.replace(impl, fn=spy))
    inputs, gout, gtout = make_inputs((1, 2, 1, 9, 9, 16, True), 1, FP32, rng)
    leaves = [x.clone().requires_grad_() for x in inputs]
    grads = torch.autograd.grad(condinit.attention_jvp(*leaves, causal=True, backend="triton"), leaves,
                                (gout, gtout))
    assert ran == ["triton"]
    ref = naive_grads(inputs, gout, gtout, True, 0.25)
    for name, g, r, floor in zip(NAMES, grads, ref, floors(ref)):
        assert_close(g, r, FP32, f"d loss / d {name}", floor)


# ------------------------------------------------------------------------------------------------
# memory
# ------------------------------------------------------------------------------------------------

class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created by the ops run inside (views and in-place results of
    one storage counted once; storages of tensors that existed before are not counted)."""

    def __init__(self, *existing):
        super().__init__()
        self.external = {t.untyped_storage().data_ptr() for t in existing}
        self.refs, self.size = {}, {}
        self.now = self.peak = 0

    def _release(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.now -= self.size.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key in self.external:
                continue
            if key not in self.refs:
                self.refs[key] = 0
                self.size[key] = t.untyped_storage().nbytes()
                self.now += self.size[key]
                self.peak = max(self.peak, self.now)
            self.refs[key] += 1
            weakref.finalize(t, self._release, key)
        return out


def _backward_peak(N, rng):
    inputs, gout, gtout = make_inputs((1, 2, 1, N, N, 16, True), 1, FP32, rng)
    out, tout, lse = reference.attention_jvp(*inputs, True, 0.25)
    existing = (gout, gtout, *inputs, out, tout, lse)
    with torch.no_grad(), LiveBytes(*existing) as mode:
        reference.attention_jvp_bwd(*existing, True, 0.25, block_q=64, block_k=64)
    return mode.peak, sum(x.nbytes for x in existing)


@pytest.mark.slow
def test_backward_memory_is_linear_in_n(rng):
    """The tiled reference (the torch row, which also serves GPUs) holds O(N) memory: going from
    N = 256 to 1024 multiplies its peak by about 4 (an N x N intermediate would make it 16), and
    the peak stays a small multiple of the inputs and saved outputs."""
    small, _ = _backward_peak(256, rng)
    big, saved = _backward_peak(1024, rng)
    assert big / small < 6, f"peak {small} B at N=256, {big} B at N=1024"
    assert big < 4 * saved, f"peak {big} B for {saved} B of inputs and saved outputs"
