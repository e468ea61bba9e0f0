"""The shared correctness grid of the attention ops, run on every backend available on this CPU:
the torch reference, the C++ CPU kernels (cpp-cpu, when the extension has them) and the Triton
kernels under TRITON_INTERPRET=1 (tiny cases: the interpreter is slow).

Each backend is forced through the custom ops ``condinit::attention_fwd / _bwd / _jvp`` and checked
against float64 torch.func over a naive attention: ``out``, ``lse``, the tangent of every probe,
``dq, dk, dv``; rows that see no key give exact zeros and ``lse = -inf``; no NaN anywhere, with
Python-side allocations poisoned with NaN so an element a kernel forgets to write fails.
"""
import importlib
import math
import os

import pytest
import torch

from condinit import _backends
from condinit.ops.attention import attention, attention_jvp, reference

from conftest import TOLERANCES

F64 = torch.float64
OPS = ("attention_fwd", "attention_bwd", "attention_jvp")

# Kernel developers can run this grid against a separately built library holding the
# condinit_C attention ops (same variable as tests/test_attention_cpp.py).
if os.environ.get("CONDINIT_TEST_NATIVE_LIB"):
    torch.ops.load_library(os.environ["CONDINIT_TEST_NATIVE_LIB"])
fwd_op = torch.ops.condinit.attention_fwd
bwd_op = torch.ops.condinit.attention_bwd
jvp_op = torch.ops.condinit.attention_jvp


def _unavailable(backend):
    for op in OPS:
        ok, why = _backends.backend_status(backend, "cpu", op)
        if not ok:
            return f"{backend} backend unavailable for {op} on CPU: {why}"
    if backend == "triton":
        try:
            mod = importlib.import_module("condinit.kernels.attention")
        except Exception as exc:  # triton missing or the kernel module broken
            return f"condinit.kernels.attention does not import: {type(exc).__name__}: {exc}"
        missing = [f for f in OPS if not hasattr(mod, f)]
        if missing:
            return f"condinit.kernels.attention lacks {missing}"
    return None


def _need(backend):
    why = _unavailable(backend)
    if why:
        pytest.skip(why)
    return backend


def _per_backend(cases_for):
    """pytest params (backend, case) for every backend; Triton ones carry the `triton` mark."""
    params = []
    for b in ("torch", "cpp-cpu", "triton"):
        marks = [pytest.mark.triton] if b == "triton" else []
        params += [pytest.param(b, c, marks=marks, id=f"{b}-{'-'.join(map(str, c))}") for c in cases_for(b)]
    return params


@pytest.fixture(params=["torch", "cpp-cpu", pytest.param("triton", marks=pytest.mark.triton)])
def backend(request):
    return _need(request.param)


@pytest.fixture
def nan_poison(monkeypatch):
    """torch.empty / empty_like / new_empty return NaN-filled floating tensors (Python-side
    allocations, e.g. a Triton launcher's outputs)."""
    def poison(t):
        if t.is_floating_point() and t.device.type != "meta":
            t.fill_(float("nan"))
        return t
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: poison(new_empty(self, *a, **kw)))


def _randn(shape, dtype, g):
    return torch.randn(shape, generator=g, dtype=F64).to(dtype)


def _naive(causal, scale):
    return lambda q, k, v: reference.attention_naive(q, k, v, causal, scale)


def _reference(q, k, v, tq, tk, tv, dout, causal, scale):
    """float64: out, lse, tout [P, ...], (dq, dk, dv) for cotangent dout."""
    x = [t.to(F64) for t in (q, k, v)]
    f = _naive(causal, scale)
    out, vjp_fn = torch.func.vjp(f, *x)
    touts = [torch.func.jvp(f, tuple(x), (tq[p].to(F64), tk[p].to(F64), tv[p].to(F64)))[1]
             for p in range(tq.shape[0])]
    H, Hkv, Nq, Nk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    s = scale * (x[0] @ x[1].repeat_interleave(H // Hkv, 1).transpose(-1, -2))
    if causal:
        i, j = torch.arange(Nq)[:, None], torch.arange(Nk)[None, :]
        s = s.masked_fill(j > i + (Nk - Nq), float("-inf"))
    return out, torch.logsumexp(s, -1), torch.stack(touts), vjp_fn(dout.to(F64))


def _check(actual, expected, dtype, what, floor=0.0):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not actual.isnan().any(), f"{what}: NaN (element not written?)"
    atol, rtol = TOLERANCES[dtype]
    err = (actual.to(F64) - expected).abs().max().item()
    scale = max(expected.abs().max().item(), floor)
    rel = err / scale if scale > 0 else err
    assert rel <= max(atol, rtol), f"{what}: relative error {rel:.3e} > {max(atol, rtol):.1e}"


def run_case(backend, B, H, Hkv, Nq, Nk, d, P, causal, dtype, g):
    q, k, v = _randn((B, H, Nq, d), dtype, g), _randn((B, Hkv, Nk, d), dtype, g), _randn((B, Hkv, Nk, d), dtype, g)
    tq, tk, tv = (_randn((P,) + tuple(x.shape), dtype, g) for x in (q, k, v))
    dout = _randn(q.shape, dtype, g)
    scale = 1.0 / math.sqrt(d)
    ref_out, ref_lse, ref_tout, ref_grads = _reference(q, k, v, tq, tk, tv, dout, causal, scale)
    empty = Nq - Nk if causal and Nq > Nk else 0   # rows 0..empty-1 attend no key

    out, lse = fwd_op(q, k, v, causal, scale, backend)
    assert out.dtype == dtype and lse.dtype == torch.float32
    _check(out, ref_out, dtype, "fwd out")
    assert lse.shape == (B, H, Nq)
    assert torch.isneginf(lse[..., :empty]).all(), "lse of an empty row must be -inf"
    lse_tol = max(TOLERANCES[dtype]) * max(1.0, ref_lse[..., empty:].abs().max().item())
    assert (lse[..., empty:].to(F64) - ref_lse[..., empty:]).abs().max().item() <= lse_tol, "lse"
    assert (out[..., :empty, :] == 0).all()

    out_j, tout, lse_j = jvp_op(q, k, v, tq, tk, tv, causal, scale, backend)
    assert tout.dtype == dtype and tout.shape == (P,) + tuple(q.shape)
    _check(out_j, ref_out, dtype, "jvp out")
    _check(tout, ref_tout, dtype, "jvp tangent")
    assert (tout[..., :empty, :] == 0).all()
    assert torch.equal(torch.isneginf(lse_j), torch.isneginf(lse))

    dq, dk, dv = bwd_op(dout, q, k, v, out, lse, causal, scale, backend)
    floor = 0.1 * max(r.abs().max().item() for r in ref_grads)  # one key: dq is exactly 0
    for name, gr, rg in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert gr.dtype == dtype
        _check(gr, rg, dtype, name, floor)
    assert (dq[..., :empty, :] == 0).all()


# (B, H, Hkv, Nq, Nk, d, P, causal): N in {1, 17, 128, 333}, Nq != Nk (causal Nq > Nk: empty
# rows), GQA 1/2/8, d in {16, 64, 80, 128}, P in {1, 3}.
GRID = [
    (1, 1, 1, 1, 1, 16, 1, False),
    (2, 2, 1, 1, 17, 64, 3, True),
    (1, 2, 2, 17, 17, 80, 1, True),
    (2, 4, 2, 17, 128, 16, 3, False),
    (1, 8, 1, 128, 17, 64, 3, True),
    (1, 2, 2, 128, 128, 128, 1, True),
    (1, 2, 1, 333, 128, 80, 1, False),
    (1, 2, 1, 128, 333, 16, 3, True),
    (1, 1, 1, 333, 333, 64, 1, True),
]
# The Triton interpreter runs one program at a time: a handful of tiny cases.
TRITON_GRID = [
    (1, 1, 1, 1, 1, 16, 1, False),
    (1, 2, 1, 17, 9, 16, 2, True),      # empty rows, GQA 2, P = 2 (both probes in one program)
    (1, 2, 2, 9, 33, 80, 3, True),      # non power-of-two head dim, P = 3
]


@pytest.mark.parametrize("backend_name,case", _per_backend(lambda b: TRITON_GRID if b == "triton" else GRID))
def test_fp32_grid(backend_name, case, rng, nan_poison):
    run_case(_need(backend_name), *case, torch.float32, rng)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(backend, dtype, rng, nan_poison):
    case = (1, 2, 1, 17, 9, 16, 2, True) if backend == "triton" else (1, 4, 2, 77, 128, 64, 2, True)
    run_case(backend, *case, dtype, rng)


def test_probes_share_one_launch(backend, rng):
    """A P-probe call equals P single-probe calls (probe indexing in the kernels)."""
    B, H, Hkv, N, d, P = (1, 2, 1, 9, 16, 3) if backend == "triton" else (1, 4, 2, 50, 64, 5)
    q, k, v = _randn((B, H, N, d), torch.float32, rng), _randn((B, Hkv, N, d), torch.float32, rng), \
        _randn((B, Hkv, N, d), torch.float32, rng)
    t = [_randn((P,) + tuple(x.shape), torch.float32, rng) for x in (q, k, v)]
    _, tout, _ = jvp_op(q, k, v, *t, True, 0.3, backend)
    for p in range(P):
        _, tp, _ = jvp_op(q, k, v, *(x[p:p + 1] for x in t), True, 0.3, backend)
        torch.testing.assert_close(tout[p], tp[0], rtol=1e-5, atol=1e-6)


def test_public_api_on_backend(backend, rng):
    """attention / attention_jvp with backend=...: autograd and the probe-dim plumbing."""
    q, k, v = (_randn(s, torch.float32, rng) for s in ((1, 2, 13, 16), (1, 1, 11, 16), (1, 1, 11, 16)))
    tq, tk, tv = (_randn(x.shape, torch.float32, rng) for x in (q, k, v))
    out, tout = attention_jvp(q, k, v, tq, None, tv, causal=True, backend=backend)
    ref_out, ref_tout = torch.func.jvp(_naive(True, 0.25), (q.double(), k.double(), v.double()),
                                       (tq.double(), torch.zeros_like(k, dtype=F64), tv.double()))
    _check(out, ref_out, torch.float32, "out")
    _check(tout, ref_tout, torch.float32, "tangent")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    grads = torch.autograd.grad(attention(*leaves, causal=True, backend=backend).square().sum(), leaves)
    ref = torch.func.grad(lambda *x: _naive(True, 0.25)(*x).square().sum(), argnums=(0, 1, 2))(
        q.double(), k.double(), v.double())
    for gr, rg in zip(grads, ref):
        _check(gr, rg, torch.float32, "grad")
    tq2 = torch.func.jvp(lambda a: attention(a, k, v, causal=True, backend=backend), (q,), (tq,))[1]
    torch.testing.assert_close(tq2, attention_jvp(q, k, v, tq, None, None, causal=True, backend=backend)[1])


def test_automatic_choice_prefers_the_cpp_kernel():
    chosen = [i.backend for i in _backends.select("attention_jvp", "cpu", head_dim=64, dtype=torch.float32)]
    expected = ["torch"] if _unavailable("cpp-cpu") else ["cpp-cpu", "torch"]
    assert chosen == expected
    # a head dim the kernels do not take, or float64: the reference only
    assert [i.backend for i in _backends.select("attention_jvp", "cpu", head_dim=24, dtype=torch.float32)] == ["torch"]
    assert [i.backend for i in _backends.select("attention_fwd", "cpu", head_dim=64, dtype=F64)] == ["torch"]
