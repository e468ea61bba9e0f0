"""condinit.explain and the dispatch log: what explain says runs is what the dispatch log records
when the call runs (forward, backward, forward mode, the backward through the tangent); sdpa's
fused and dense paths; forced and unavailable backends; argument errors; and that a float64
Jacobian probe runs the C++ CPU kernels.
"""
import pytest
import torch

import condinit
from condinit import _backends
from condinit.ops.attention.explain import Explanation, dispatch_log

F64 = torch.float64
HAS_CPP = _backends.available("cpp-cpu", "cpu", "attention_fwd")[0]
needs_cpp = pytest.mark.skipif(not HAS_CPP, reason="no C++ CPU kernel in this build")


def _qkv(rng, B=2, H=4, Hkv=2, Nq=9, Nk=9, d=8, dtype=F64):
    return (torch.randn(B, H, Nq, d, generator=rng, dtype=dtype),
            torch.randn(B, Hkv, Nk, d, generator=rng, dtype=dtype),
            torch.randn(B, Hkv, Nk, d, generator=rng, dtype=dtype))


def _ran(log) -> dict:
    """kernel op -> the set of backends that ran it."""
    out = {}
    for r in log:
        out.setdefault(r.op, set()).add(r.backend)
    return out


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("backend", [None, pytest.param("torch", marks=pytest.mark.slow)])
def test_attention_explained_backends_are_what_runs(dtype, backend, rng):
    q, k, v = _qkv(rng, dtype=dtype)
    kw = dict(causal=True, window=(3, -1), kv_lens=torch.tensor([9, 5]), backend=backend)
    e = condinit.explain(q, k, v, **kw)
    assert isinstance(e, Explanation) and e.path == "fused" and bool(e.forced) == (backend is not None)
    assert e.dtype == dtype and e.accumulate == (F64 if dtype == F64 else torch.float32)
    assert "causal" in e.mask and "window (left 3, right unbounded)" in e.mask and "kv_lens [9, 5]" in e.mask
    with dispatch_log() as log:
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = condinit.attention(*leaves, **kw)
        out.sum().backward()
        tangents = tuple(torch.randn_like(x) for x in (q, k, v))
        _, tout = torch.func.jvp(lambda a, b, c: condinit.attention(a, b, c, **kw), tuple(leaves), tangents)
        torch.autograd.grad(tout.square().sum(), leaves)
    ran = _ran(log)
    assert set(ran) == set(e.backends) == {"attention_fwd", "attention_bwd", "attention_jvp", "attention_jvp_bwd"}
    for op, backend_name in e.backends.items():
        assert ran[op] == {backend_name}, op
    expected = backend or ("cpp-cpu" if HAS_CPP else "torch")
    assert set(e.backends.values()) == {expected}
    assert all(r.dtype == dtype and r.masks == ("causal", "window", "lens") for r in log)
    text = str(e)
    assert text.startswith("condinit.attention: cpu") and all(f"{op}  " in text for op in e.backends)


@pytest.mark.parametrize("grad_through_tangent", [True, False])
def test_attention_jvp_explained(grad_through_tangent, rng):
    q, k, v = _qkv(rng)
    tk = torch.randn((3,) + tuple(k.shape), generator=rng, dtype=F64)
    e = condinit.explain(q, k, v, op="attention_jvp", tk=tk, grad_through_tangent=grad_through_tangent)
    bwd = "attention_jvp_bwd" if grad_through_tangent else "attention_bwd"
    assert set(e.backends) == {"attention_jvp", bwd} and "3 probes" in e.reason and e.shapes["tk"] == tk.shape
    with dispatch_log() as log:
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, tout = condinit.attention_jvp(*leaves, tk=tk, grad_through_tangent=grad_through_tangent)
        (out.sum() + (tout.sum() if grad_through_tangent else 0)).backward()
    assert _ran(log) == {op: {b} for op, b in e.backends.items()}
    assert [r.probes for r in log if r.op == "attention_jvp"] == [3]


def test_a_passed_over_row_says_why(rng, monkeypatch):
    """With the C++ row unavailable the choice is the reference, and the explanation says why."""
    real = _backends.available
    monkeypatch.setattr(_backends, "available", lambda backend, *a: (False, "extension not built here")
                        if backend == "cpp-cpu" else real(backend, *a))
    q, k, v = _qkv(rng)
    e = condinit.explain(q, k, v)
    assert set(e.backends.values()) == {"torch"}
    assert e.passed_over["attention_fwd"] == ("cpp-cpu: extension not built here",)
    assert "passed over cpp-cpu: extension not built here" in str(e)
    with dispatch_log() as log:
        condinit.attention(q, k, v)
    assert _ran(log) == {"attention_fwd": {"torch"}}


def test_float64_is_in_the_cpp_cpu_rows_and_in_no_gpu_row():
    """The table: float64 is in the C++ CPU rows of every attention op and in no GPU row."""
    from condinit.ops.attention.backends import ATTENTION_BWD, ATTENTION_FWD, ATTENTION_JVP, ATTENTION_JVP_BWD
    for op in (ATTENTION_FWD, ATTENTION_BWD, ATTENTION_JVP, ATTENTION_JVP_BWD):
        assert op.impls["cpp-cpu"].not_supported("cpu", {"dtype": F64, "head_dim": 300, "masks": ()}) is None
        for gpu in ("cuda", "triton"):
            assert "dtype float64 not in" in op.impls[gpu].not_supported("cuda", {"dtype": F64})


@needs_cpp
def test_sdpa_fused_paths_report_the_kernel_calls(rng):
    q, k, v = _qkv(rng, Nq=12, Nk=12)
    pad = torch.ones(2, 1, 12, 12, dtype=torch.bool)
    pad[0, ..., :4] = False                                     # left padding of entry 0
    e = condinit.explain(q, k, v, op="sdpa", attn_mask=pad, enable_gqa=True)
    assert e.path == "fused" and [c.masks for c in e.calls] == [("lens",)]
    assert e.calls[0].backend == "cpp-cpu" and e.backends["attention_fwd"] == "cpp-cpu"
    assert "attn_mask bool [2, 1, 12, 12], run as 1 kernel call: lens" in e.mask
    # SDPA's top-left causal with more queries than keys: a causal block and an unmasked tail
    q2 = torch.randn(2, 4, 15, 8, generator=rng, dtype=F64)
    e = condinit.explain(q2, k, v, op="sdpa", is_causal=True, enable_gqa=True)
    assert [c.masks for c in e.calls] == [("causal",), ()] and "2 kernel calls: causal + no mask" in e.mask
    with dispatch_log() as log:
        condinit.sdpa(q2, k, v, is_causal=True, enable_gqa=True)
    assert tuple(log) == e.calls


def test_sdpa_dense_paths_say_why(rng):
    q, k, v = _qkv(rng, Nq=6, Nk=6)
    per_head = torch.rand(2, 4, 6, 6, generator=rng) > 0.3
    per_head[..., 0] = True
    e = condinit.explain(q, k, v, op="sdpa", attn_mask=per_head, enable_gqa=True)
    assert e.path == "dense" and e.backends == {} and e.calls == () and "differs per head" in e.reason
    assert str(e).splitlines()[1].startswith("path: dense (plain torch ops")
    e = condinit.explain(q, k, torch.randn(2, 2, 6, 5, dtype=F64), op="sdpa", enable_gqa=True)
    assert e.path == "dense" and "value head dim 5 differs from the query's 8" in e.reason
    bias = torch.zeros(6, 6, dtype=F64, requires_grad=True)
    e = condinit.explain(q, k, v, op="sdpa", attn_mask=bias, enable_gqa=True)
    assert e.path == "dense" and "cannot be read" in e.reason
    with dispatch_log() as log:
        condinit.sdpa(q, k, v, attn_mask=per_head, enable_gqa=True)
    assert len(log) == 0 and str(log) == "no attention kernel ran"


def test_explain_checks_its_arguments_as_the_op_does(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="op must be one of"):
        condinit.explain(q, k, v, op="attention_fwd")
    with pytest.raises(TypeError, match="explain\\(op='attention'\\).*is_causal"):
        condinit.explain(q, k, v, is_causal=True)
    with pytest.raises(Exception) as from_explain:
        condinit.explain(q, k[:, :, :, :4], v)
    with pytest.raises(Exception) as from_op:
        condinit.attention(q, k[:, :, :, :4], v)
    assert type(from_explain.value) is type(from_op.value) and str(from_explain.value) == str(from_op.value)
    with pytest.raises(_backends.BackendUnavailableError, match="'cuda' cannot run"):
        condinit.explain(q, k, v, backend="cuda")


def test_dispatch_logs_nest_and_close(rng):
    q, k, v = _qkv(rng)
    with dispatch_log() as outer:
        with dispatch_log() as inner:
            condinit.attention(q, k, v)
        condinit.attention(q, k, v, causal=True)
    assert len(inner) == 1 and len(outer) == 2 and outer[0] == inner[0]
    condinit.attention(q, k, v)
    assert len(outer) == 2
    assert "attention_fwd on" in str(inner) and "B=2 H=4 Hkv=2 Nq=9 Nk=9 d=8; no mask" in str(inner)


@pytest.mark.slow
@needs_cpp
def test_a_float64_jacobian_probe_runs_the_cpp_kernels(rng):
    """The probes and the monitor work in float64: their JVPs and VJPs run the C++ CPU kernels."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    layer = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(1, 10, 16, generator=rng)
    op = condinit.JacobianOperator(layer, x, wrt="weights", causal=True, dtype=F64)
    with dispatch_log() as log:
        op.mv(torch.randn(op.n, generator=rng, dtype=F64))
        op.rmv(torch.randn(op.m, generator=rng, dtype=F64))
    ran = _ran(log)
    assert {"attention_jvp", "attention_bwd"} <= set(ran) and all(b == {"cpp-cpu"} for b in ran.values())
    assert all(r.dtype == F64 and "causal" in r.masks for r in log)
    assert "cpp-cpu" in op.description


def test_only_the_forced_op_says_forced(forced_backend, rng):
    """CONDINIT_BACKEND forcing one kernel op: only that op's row says "(forced)"; the others keep the
    automatic choice and what it passed over."""
    q, k, v = _qkv(rng, dtype=torch.float32)
    forced_backend("attention_bwd=torch")
    e = condinit.explain(q, k, v, causal=True)
    assert e.forced == ("attention_bwd",) and e.backends["attention_bwd"] == "torch"
    lines = {line.split()[0]: line for line in str(e).splitlines() if line.startswith("attention_")}
    assert "(forced)" in lines["attention_bwd"]
    assert all("(forced)" not in line for op, line in lines.items() if op != "attention_bwd"), lines
