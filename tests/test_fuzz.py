"""Property-based fuzz of the public entry points: ``orthogonalize``, ``semi_orthogonal_``,
``rect_identity_``, ``conditioned_init_``, ``spectrum``, ``condinit.attention``,
``condinit.attention_jvp``.

Random shapes (including 0 and 1), dtypes (float32/64, bfloat16, float16, int32), layouts
(transposed, sliced, expanded, overlapping views), values (NaN, Inf, huge, tiny) and argument
values (negative, bool, str, None, huge ints). Every call either

* raises ``ValueError`` / ``TypeError`` / ``condinit.BackendUnavailableError`` whose message names
  one of the function's parameters, every input tensor byte-identical afterwards, or
* returns a result that matches a float64 reference (orthonormal rows spanning the input's rows,
  the rectangular identity, naive attention and its JVP) within a per-dtype tolerance.

Examples are derandomized (a fixed seed: reproducible in CI) unless ``CONDINIT_FUZZ_RANDOM=1``;
then hypothesis picks a seed and prints it on failure (``--hypothesis-seed=<seed>`` replays it).
"""
import inspect
import math
import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import condinit  # noqa: E402
from condinit.init import conditioned_init_, orthogonalize, rect_identity_, semi_orthogonal_, spectrum  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
RANDOM = os.environ.get("CONDINIT_FUZZ_RANDOM") == "1"
FUZZ = settings(max_examples=int(os.environ.get("CONDINIT_FUZZ_EXAMPLES", "80")), deadline=None,
                derandomize=not RANDOM, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ERRORS = (ValueError, TypeError, condinit.BackendUnavailableError)
FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
DTYPES = FLOATS + (torch.int32,)
EPS = {torch.float32: 2.0 ** -23, torch.float64: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


# ---------------------------------------------------------------------------------------------------
# strategies

VALUES = ("normal",) * 9 + ("nan", "inf", "huge", "tiny", "zero")
LAYOUTS = ("contiguous",) * 4 + ("transposed", "transposed", "sliced", "sliced", "expanded")


@st.composite
def tensors(draw, shape, dtypes=DTYPES, values=VALUES, layouts=LAYOUTS):
    """A tensor of ``shape`` with a random dtype, value class and memory layout."""
    dtype = draw(st.sampled_from([d for d in dtypes if d.is_floating_point] * 4       # integers rarely
                                 + [d for d in dtypes if not d.is_floating_point]))
    kind = draw(st.sampled_from(values))
    layout = draw(st.sampled_from(layouts))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    g = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    base_shape = shape
    if layout == "transposed" and len(shape) >= 2:
        base_shape = shape[:-2] + (shape[-1], shape[-2])
    elif layout == "sliced" and len(shape) >= 1:
        base_shape = (2 * shape[0],) + shape[1:]
    elif layout == "expanded" and len(shape) >= 1:
        base_shape = (1,) + shape[1:]
    x = torch.randn(base_shape, generator=g, dtype=F64)
    if kind == "huge":
        x = x * 1e30
    elif kind == "tiny":
        x = x * 1e-30
    elif kind == "zero":
        x = torch.zeros_like(x)
    elif kind in ("nan", "inf") and x.numel():
        x.view(-1)[int(torch.randint(x.numel(), (1,), generator=g))] = math.nan if kind == "nan" else math.inf
    x = (x * 4).round().to(dtype) if dtype == torch.int32 else x.to(dtype)
    if layout == "transposed" and len(shape) >= 2:
        x = x.transpose(-1, -2)
    elif layout == "sliced" and len(shape) >= 1:
        x = x[::2]
    elif layout == "expanded" and len(shape) >= 1:
        x = x.expand(shape)
    assert tuple(x.shape) == shape
    return x


def rarely(valid, bad, one_in: int = 8):
    """``valid``, or ``bad`` about once in ``one_in`` draws (most calls must get far enough to be
    checked against the reference)."""
    return st.integers(0, one_in - 1).flatmap(lambda i: bad if i == 0 else valid)


dims = rarely(st.integers(1, 6) | st.sampled_from([8, 16]), st.just(0), 10)
small = st.integers(1, 4)
BAD = st.sampled_from([-1, 0, True, False, "2", None, 2 ** 70, 1.5, math.nan])
seeds = rarely(st.integers(0, 2 ** 64 - 1), st.sampled_from([-1, 2 ** 64, True, "0", 1.0]))
methods = rarely(st.sampled_from(["auto", "householder", "cholqr2", "polar", "svd"]), st.sampled_from(["qr", 3, None]))


# ---------------------------------------------------------------------------------------------------
# the contract

def _snapshot(args):
    return [(t, t.clone()) for t in args if isinstance(t, torch.Tensor)]


def _same(t, before) -> bool:
    if t.dtype != before.dtype or t.shape != before.shape:
        return False
    if not t.is_floating_point():
        return torch.equal(t, before)
    return torch.equal(t.isnan(), before.isnan()) and torch.equal(t.nan_to_num(0.0), before.nan_to_num(0.0))


def call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``: the result, or None after checking the error contract."""
    snap = _snapshot(list(args) + list(kwargs.values()))
    try:
        return fn(*args, **kwargs), True
    except ERRORS as exc:
        names = inspect.signature(fn).parameters
        msg = str(exc)
        assert any(name in msg for name in names), f"{type(exc).__name__} names no parameter of {fn.__name__}: {msg}"
        for i, (t, before) in enumerate(snap):
            assert _same(t, before), \
                f"input tensor {i} changed although {fn.__name__} raised {msg!r}"
        return None, False


def _orth_err(W: torch.Tensor) -> float:
    W = W.double()
    if W.shape[-2] > W.shape[-1]:
        W = W.transpose(-1, -2)
    return (W @ W.transpose(-1, -2) - torch.eye(W.shape[-2], dtype=F64)).abs().max().item() if W.numel() else 0.0


def _check_orthonormal_span(A: torch.Tensor, Q: torch.Tensor, what: str):
    """Q's blocks are orthonormal (rows, or columns when tall) and span A's (float64)."""
    eps = EPS[Q.dtype]
    assert Q.isfinite().all(), f"{what}: non-finite result"
    assert _orth_err(Q) <= 8 * eps + 1e-5, f"{what}: not orthonormal ({_orth_err(Q):.2e})"
    A64 = A.double()
    A64 = A64 / A64.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(1e-300)
    Q64 = Q.double()
    if Q.shape[-2] > Q.shape[-1]:
        A64, Q64 = A64.transpose(-1, -2), Q64.transpose(-1, -2)
    resid = (A64 - A64 @ Q64.transpose(-1, -2) @ Q64).abs().max().item() if A64.numel() else 0.0
    assert resid <= 64 * eps * max(A64.shape[-1], 1) + 1e-5, f"{what}: does not span the input ({resid:.2e})"


# ---------------------------------------------------------------------------------------------------
# the init engine

@FUZZ
@given(data=st.data(), m=dims, n=dims, batch=st.sampled_from([(), (1,), (3,), (0,), (2, 1)]), method=methods,
       budget=rarely(st.sampled_from([None, None, 1, 2 ** 62]), BAD), with_out=st.booleans())
@pytest.mark.slow
def test_fuzz_orthogonalize(data, m, n, batch, method, budget, with_out):
    stack = data.draw(tensors(batch + (m, n)))
    out = data.draw(tensors(batch + (m, n), dtypes=FLOATS, values=("zero",))) if with_out else None
    kwargs = {"memory_budget": budget} if budget is not None else {}
    res, ok = call(orthogonalize, stack, method, out=out, **kwargs)
    if ok:
        assert res.shape == stack.shape
        if res.numel():
            _check_orthonormal_span(stack, res, f"orthogonalize({method})")


@FUZZ
@given(data=st.data(), heads=small, d=small, cols=dims, head_dim=rarely(st.sampled_from([None, "d"]), BAD),
       gain=rarely(st.sampled_from([1.0, 0.5, 1e-30, 1.7e38]), BAD | st.sampled_from([3e38, 1e39, -0.0])), seed=seeds, method=methods)
def test_fuzz_semi_orthogonal(data, heads, d, cols, head_dim, gain, seed, method):
    w = data.draw(tensors((heads * d, cols)))
    hd = d if head_dim == "d" else head_dim
    res, ok = call(semi_orthogonal_, w, head_dim=hd, gain=gain, seed=seed, method=method)
    if ok:
        assert res is w
        blocks = (w.double() / gain).view(-1 if hd is None else heads, w.shape[0] if hd is None else d, cols)
        _check_orthonormal_span(blocks, blocks.to(w.dtype), "semi_orthogonal_")


@FUZZ
@given(data=st.data(), heads=small, d=small, cols=dims, per_head=rarely(st.booleans(), BAD),
       head_dim=rarely(st.sampled_from([None, "d"]), BAD))
def test_fuzz_rect_identity(data, heads, d, cols, per_head, head_dim):
    w = data.draw(tensors((heads * d, cols)))
    hd = d if head_dim == "d" else head_dim
    res, ok = call(rect_identity_, w, head_dim=hd, per_head=per_head)
    if ok:
        want = torch.eye(d, cols, dtype=F64).repeat(heads, 1) if per_head else torch.eye(heads * d, cols, dtype=F64)
        assert torch.equal(res.double(), want)


@FUZZ
@given(data=st.data(), kv=small, group=small, d=small, D=st.integers(1, 12), v_rows=small,
       num_heads=rarely(st.just("H"), BAD), seed=seeds,
       alias=rarely(st.none(), st.sampled_from(["qk", "qv", "rows"]), 4),
       layer_index=rarely(st.sampled_from([0, 3, 2 ** 31 - 1]), BAD | st.just(2 ** 31)), method=methods)
def test_fuzz_conditioned_init(data, kv, group, d, D, v_rows, num_heads, seed, alias, layer_index, method):
    H = kv * group
    q = data.draw(tensors((H * d, D)))
    k = data.draw(tensors((kv * d, D)))
    v = data.draw(tensors((v_rows, D)))
    aliased = True
    if alias == "qk":
        k = q
    elif alias == "qv":
        v = q
    elif alias == "rows" and H > kv:
        k = q[q.shape[0] - kv * d:]       # k's rows inside q's
    else:
        aliased = False
    heads = H if num_heads == "H" else num_heads
    res, ok = call(conditioned_init_, q, k, v, num_heads=heads, num_kv_heads=kv, seed=seed,
                   layer_index=layer_index, method=method)
    if ok:
        assert not aliased, "aliased destinations accepted"
        for name, w, h in (("q", q, H), ("k", k, kv)):
            blocks = w.double().view(h, d, D)
            _check_orthonormal_span(blocks, blocks.to(w.dtype), f"conditioned_init_ {name}")
        assert torch.equal(v.double(), torch.eye(v_rows, D, dtype=F64))


@FUZZ
@given(data=st.data(), m=dims, n=dims, batch=st.sampled_from([(), (2,), (0,)]),
       method=rarely(st.sampled_from(["auto", "svd", "gram"]), st.sampled_from(["eig", None, 1])))
def test_fuzz_spectrum(data, m, n, batch, method):
    stack = data.draw(tensors(batch + (m, n)))
    res, ok = call(spectrum, stack, method=method)
    if ok and stack.numel():
        X = stack.double().reshape(-1, m, n)
        for i in range(X.shape[0]):
            block = X[i]
            got = [f.reshape(-1)[i].item() for f in res]
            if not bool(block.isfinite().all()):
                assert all(math.isnan(g) for g in got), f"spectrum of a non-finite block: {got}"
                continue
            scale = block.abs().max().item()
            s = torch.linalg.svdvals(block / scale) * scale if scale > 0 else torch.zeros(min(m, n), dtype=F64)
            want = (s[0].item(), s[-1].item())
            for g, w in zip(got[:2], want):
                assert abs(g - w) <= 1e-6 * want[0] + (1e-6 * want[0] if stack.dtype != F64 else 0), \
                    f"spectrum {got} vs svdvals {want}"


# ---------------------------------------------------------------------------------------------------
# the attention op

def _naive_attention(q, k, v, causal, scale, skip_masked=True):
    """softmax(scale q k^T [causal]) v in float64. ``skip_masked``: a masked key's value row adds
    nothing (not even its NaN); else ``P @ v`` as torch's math attention computes it (``0 * NaN``)."""
    q, k, v = q.double(), k.double(), v.double()
    H, Hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    S = scale * q @ k.transpose(-1, -2)
    Nq, Nk = S.shape[-2:]
    if causal:
        keep = torch.ones(Nq, Nk, dtype=torch.bool).tril(Nk - Nq)
        S = S.masked_fill(~keep, -math.inf)
        empty = ~keep.any(-1)
        P = torch.softmax(S, dim=-1).masked_fill(empty[:, None], 0.0)   # a query with no key gets 0
        if not skip_masked:
            return P @ v
        return (P.unsqueeze(-1) * v.unsqueeze(-3)).masked_fill(~keep[:, :, None], 0.0).sum(-2)
    return torch.softmax(S, dim=-1) @ v


ATTN_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16) * 3 + (torch.int32,)
ATTN_TOL = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _attention_inputs(data, B, Hkv, group, Nq, Nk, d):
    dtype = data.draw(st.sampled_from(ATTN_DTYPES))
    layouts = LAYOUTS
    # huge values make the float64 reference itself meaningless (exp overflow): normal and tiny,
    # plus NaN / Inf, whose propagation is compared with the reference's
    values = ("normal",) * 8 + ("tiny", "zero", "nan")
    shapes = ((B, Hkv * group, Nq, d), (B, Hkv, Nk, d), (B, Hkv, Nk, d))
    return [data.draw(tensors(s, dtypes=(dtype,), values=values, layouts=layouts)) for s in shapes]


def _check_against(got, want, dtype, what, loose=None):
    """``got`` matches ``want``; NaN exactly where ``want`` has NaN, or (with ``loose``, the
    reference in which masked keys' values still enter as ``0 * v``) anywhere in between: whether a
    NaN in a masked key's value row reaches the output is left to the implementation."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    g, w = got.double(), want.double()
    upper = w.isnan() if loose is None else loose.isnan() | w.isnan()
    assert not (w.isnan() & ~g.isnan()).any(), f"{what}: a NaN of the reference is missing"
    assert not (g.isnan() & ~upper).any(), f"{what}: NaN where the reference has none"
    fin = ~w.isnan() & ~g.isnan()
    if fin.any():
        scale = max(w[fin].abs().max().item(), 1.0)
        err = (g[fin] - w[fin]).abs().max().item() / scale
        assert err <= ATTN_TOL[dtype], f"{what}: error {err:.2e} vs float64 reference"


attn_dims = dict(B=rarely(st.integers(1, 2), st.just(0)), Hkv=st.integers(1, 2), group=st.integers(1, 2),
                 Nq=rarely(st.integers(1, 5), st.just(0)), Nk=rarely(st.integers(1, 5), st.just(0)),
                 d=st.sampled_from([1, 4, 8, 16]))
attn_opts = dict(causal=rarely(st.booleans(), st.sampled_from([1, "yes", None])),
                 scale=rarely(st.sampled_from([None, None, 0.5, 0.0, -1.0]), st.sampled_from([math.inf, math.nan, "1", True])),
                 backend=rarely(st.sampled_from([None, None, "torch", "cpp-cpu", "auto"]), st.sampled_from(["bogus", 7, "cuda"])))


@FUZZ
@given(data=st.data(), **attn_dims, **attn_opts)
def test_fuzz_attention(data, B, Hkv, group, Nq, Nk, d, causal, scale, backend):
    q, k, v = _attention_inputs(data, B, Hkv, group, Nq, Nk, d)
    out, ok = call(condinit.attention, q, k, v, causal=causal, scale=scale, backend=backend)
    if ok:
        s = 1.0 / math.sqrt(d) if scale is None else scale
        _check_against(out, _naive_attention(q, k, v, causal, s), q.dtype, "attention",
                       loose=_naive_attention(q, k, v, causal, s, skip_masked=False))


@FUZZ
@given(data=st.data(), **attn_dims, **attn_opts, probes=st.sampled_from([None, 1, 2]),
       which=st.sampled_from(["qkv", "q", "v", "kv"]))
@pytest.mark.slow
def test_fuzz_attention_jvp(data, B, Hkv, group, Nq, Nk, d, causal, scale, backend, probes, which):
    q, k, v = _attention_inputs(data, B, Hkv, group, Nq, Nk, d)
    lead = () if probes is None else (probes,)
    tangents = {}
    for name, primal in zip("qkv", (q, k, v)):
        if name in which:
            g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31 - 1)))
            t = torch.randn(lead + tuple(primal.shape), generator=g, dtype=F64)
            tangents["t" + name] = t.to(primal.dtype) if primal.is_floating_point() else t
    res, ok = call(condinit.attention_jvp, q, k, v, causal=causal, scale=scale, backend=backend, **tangents)
    if ok:
        out, tout = res
        s = 1.0 / math.sqrt(d) if scale is None else scale
        primals = tuple(t.double().contiguous() for t in (q, k, v))   # torch.func.jvp refuses expanded primals
        zero = lambda p: torch.zeros(lead + tuple(p.shape), dtype=F64)  # noqa: E731
        tans = [tangents.get("t" + n, None) for n in "qkv"]
        tans = [zero(p) if t is None else t.double() for p, t in zip(primals, tans)]
        def reference(skip_masked):
            fn = lambda a, b, c: _naive_attention(a, b, c, causal, s, skip_masked)  # noqa: E731
            if probes is None:
                return torch.func.jvp(fn, primals, tuple(tans))
            pairs = [torch.func.jvp(fn, primals, tuple(t[i] for t in tans)) for i in range(probes)]
            return pairs[0][0], torch.stack([p[1] for p in pairs])

        (want_out, want_t), (loose_out, loose_t) = reference(True), reference(False)
        _check_against(out, want_out, q.dtype, "attention_jvp out", loose=loose_out)
        _check_against(tout, want_t, q.dtype, "attention_jvp tangent", loose=loose_t)
