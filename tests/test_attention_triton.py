"""Triton attention kernels (condinit.kernels.attention) against a float64 naive reference.

Runs under TRITON_INTERPRET=1 on the CPU (tests/conftest.py sets it), so the shapes are tiny; the
interpreter uses 16 x 16 tiles, so N in {1, 17, 40} covers single, ragged and several tiles, the
causal diagonal (Nq != Nk both ways) and rows that see no key. Every output buffer the kernels
allocate is NaN-poisoned (torch.empty / empty_like patched) so an element a kernel forgets to
write fails the comparison.
"""
import math

import pytest
import torch

from conftest import TOLERANCES

triton = pytest.importorskip("triton")
attn = pytest.importorskip("condinit.kernels.attention")

pytestmark = pytest.mark.triton

# The conftest table, read as: |got - ref| <= atol * max(1, max |ref|) + rtol * |ref| (fp16 /
# bf16 errors measured at <= 0.2 of that bound; the kernels round P~ and P~ o S' to the input
# dtype before the products with V, as flash attention does).
_TOL = TOLERANCES


def _naive(q, k, v, causal, scale):
    """softmax(scale q k^T + mask) v with P materialized; rows that see no key give 0."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    s = scale * q @ k.transpose(-1, -2)
    n_q, n_k = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(n_q)[:, None]
        j = torch.arange(n_k)[None, :]
        s = s.masked_fill(j > i + (n_k - n_q), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return p @ v, lse


def _assert_close(name, got, ref, dtype):
    atol, rtol = _TOL[dtype]
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    got = got.double()
    assert not torch.isnan(got).any(), f"{name}: NaN in the kernel output"
    err = (got - ref).abs()
    bound = atol * max(1.0, ref.abs().max().item()) + rtol * ref.abs()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (f"{name}: max error {err.max().item():.3e} (ref max "
                                  f"{ref.abs().max().item():.3e}); worst at {worst.item()}: "
                                  f"{got.flatten()[worst].item()} vs {ref.flatten()[worst].item()}")


@pytest.fixture
def nan_poison(monkeypatch):
    """torch.empty / empty_like hand out NaN-filled memory while the kernels run."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def nan_empty_like(*args, **kwargs):
        t = empty_like(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    monkeypatch.setattr(torch, "empty_like", nan_empty_like)


def _inputs(rng, shape_q, shape_kv, n_probes, dtype):
    def r(*shape):
        return torch.randn(*shape, generator=rng, dtype=torch.float64).to(dtype)

    q, k, v = r(*shape_q), r(*shape_kv), r(*shape_kv)
    tq, tk, tv = r(n_probes, *shape_q), r(n_probes, *shape_kv), r(n_probes, *shape_kv)
    do = r(*shape_q)
    return q, k, v, tq, tk, tv, do


# (B, H, Hkv, Nq, Nk, d, causal, P, dtype): GQA ratio 2 and 1; Nq < Nk, Nq > Nk (causal: rows
# with no visible key), N = 1, ragged and multi-tile N; d = 80 exercises the padded head dim.
CASES = [
    pytest.param(1, 2, 1, 17, 40, 16, True, 2, torch.float32, id="gqa2-causal-17x40-d16-P2-fp32"),
    pytest.param(1, 2, 2, 40, 17, 80, True, 1, torch.float32, id="causal-emptyrows-40x17-d80-P1-fp32"),
    pytest.param(2, 2, 1, 17, 1, 16, True, 1, torch.float32, id="gqa2-causal-17x1-d16-P1-fp32"),
    pytest.param(1, 2, 1, 1, 17, 80, False, 2, torch.float32, id="gqa2-1x17-d80-P2-fp32"),
    pytest.param(1, 2, 2, 40, 40, 16, False, 1, torch.float32, id="40x40-d16-P1-fp32"),
    pytest.param(1, 2, 1, 40, 17, 80, True, 2, torch.float16, id="gqa2-causal-emptyrows-40x17-d80-P2-fp16"),
    pytest.param(1, 2, 1, 17, 40, 16, False, 1, torch.bfloat16, id="gqa2-17x40-d16-P1-bf16"),
]


@pytest.mark.parametrize("B, H, Hkv, Nq, Nk, d, causal, P, dtype", CASES)
def test_attention_matches_float64_reference(rng, nan_poison, B, H, Hkv, Nq, Nk, d, causal, P, dtype):
    q, k, v, tq, tk, tv, do = _inputs(rng, (B, H, Nq, d), (B, Hkv, Nk, d), P, dtype)
    scale = 1.0 / math.sqrt(d)
    q64, k64, v64 = q.double(), k.double(), v.double()
    ref_out, ref_lse = _naive(q64, k64, v64, causal, scale)

    out, lse = attn.attention_fwd(q, k, v, causal, scale)
    assert out.dtype == dtype and lse.dtype == torch.float32
    _assert_close("out", out, ref_out, dtype)
    empty_rows = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty_rows), "lse must be -inf exactly on rows with no key"
    _assert_close("lse", lse[~empty_rows], ref_lse[~empty_rows], torch.float32 if dtype == torch.float32 else dtype)
    if causal and Nq > Nk:
        assert empty_rows.any() and (out[empty_rows] == 0).all()

    out_j, tout, lse_j = attn.attention_jvp(q, k, v, tq, tk, tv, causal, scale)
    assert tout.shape == tq.shape and tout.dtype == dtype
    torch.testing.assert_close(out_j, out, rtol=0, atol=0)  # same kernel, same tiles
    torch.testing.assert_close(lse_j, lse, rtol=0, atol=0)
    for p in range(P):
        _, ref_t = torch.func.jvp(lambda a, b, c: _naive(a, b, c, causal, scale)[0], (q64, k64, v64),
                                  (tq[p].double(), tk[p].double(), tv[p].double()))
        _assert_close(f"tout[{p}]", tout[p], ref_t, dtype)
        if causal and Nq > Nk:
            assert (tout[p][empty_rows] == 0).all()

    dq, dk, dv = attn.attention_bwd(do, q, k, v, out, lse, causal, scale)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    _, vjp = torch.func.vjp(lambda a, b, c: _naive(a, b, c, causal, scale)[0], q64, k64, v64)
    ref_dq, ref_dk, ref_dv = vjp(do.double())
    _assert_close("dq", dq, ref_dq, dtype)
    _assert_close("dk", dk, ref_dk, dtype)
    _assert_close("dv", dv, ref_dv, dtype)
    if causal and Nq > Nk:
        assert (dq[empty_rows] == 0).all()


@pytest.mark.parametrize("block_m, block_n", [(32, 16), (16, 32)])
def test_unequal_tiles_on_the_causal_diagonal(rng, nan_poison, monkeypatch, block_m, block_n):
    """BLOCK_M != BLOCK_N (as on the GPU): the causal key range, the unmasked/masked split of the
    forward and dQ loops, and the query range of the dK/dV loop, both Nq > Nk and Nq < Nk."""
    monkeypatch.setattr(attn, "_INTERPRET_CONFIG", dict(BLOCK_M=block_m, BLOCK_N=block_n))
    for n_q, n_k in ((40, 17), (17, 71)):
        q, k, v, tq, tk, tv, do = _inputs(rng, (1, 2, n_q, 16), (1, 1, n_k, 16), 2, torch.float32)
        q64, k64, v64 = q.double(), k.double(), v.double()
        out, tout, lse = attn.attention_jvp(q, k, v, tq, tk, tv, True, 0.25)
        ref_out, _ = _naive(q64, k64, v64, True, 0.25)
        _assert_close("out", out, ref_out, torch.float32)
        for p in range(2):
            _, ref_t = torch.func.jvp(lambda a, b, c: _naive(a, b, c, True, 0.25)[0], (q64, k64, v64),
                                      (tq[p].double(), tk[p].double(), tv[p].double()))
            _assert_close(f"tout[{p}]", tout[p], ref_t, torch.float32)
        grads = attn.attention_bwd(do, q, k, v, out, lse, True, 0.25)
        _, vjp = torch.func.vjp(lambda a, b, c: _naive(a, b, c, True, 0.25)[0], q64, k64, v64)
        for name, g, ref in zip(("dq", "dk", "dv"), grads, vjp(do.double())):
            _assert_close(name, g, ref, torch.float32)


def test_gpu_launch_configs_are_valid():
    """The autotune lists (GPU only, not run here): tl.dot needs tiles >= 16, every list ends in a
    small config that fits fp32 inputs, and two probes per program only for multi-probe calls."""
    for block_d in (16, 32, 64, 128, 256):
        for jvp in (False, True):
            for multi in (False, True):
                cfgs = attn._fwd_configs(block_d, jvp, multi)
                pps = {c.kwargs["PROBES_PER_PROGRAM"] for c in cfgs}
                assert pps <= ({1, 2} if jvp and multi else {1})
                assert all(c.kwargs["BLOCK_M"] >= 16 and c.kwargs["BLOCK_N"] >= 16 for c in cfgs)
                assert cfgs[-1].kwargs["BLOCK_M"] * cfgs[-1].kwargs["BLOCK_N"] <= 32 * 32
        for kind in ("dkdv", "dq"):
            cfgs = attn._bwd_configs(block_d, kind)
            assert all(c.kwargs["BLOCK_M"] >= 16 and c.kwargs["BLOCK_N"] >= 16 for c in cfgs)


def test_odd_probe_count_and_single_probe_tangents(rng, nan_poison):
    """P = 3 (the last program's second probe slot is a repeat and must not be stored) equals
    three 4-D single-probe calls bit for bit, and the backward is deterministic."""
    q, k, v, tq, tk, tv, do = _inputs(rng, (1, 2, 17, 16), (1, 1, 17, 16), 3, torch.float32)
    out, tout, lse = attn.attention_jvp(q, k, v, tq, tk, tv, True, 0.3)
    for p in range(3):
        out1, tout1, lse1 = attn.attention_jvp(q, k, v, tq[p], tk[p], tv[p], True, 0.3)
        assert tout1.shape == q.shape
        torch.testing.assert_close(tout[p], tout1, rtol=0, atol=0)
    _, ref_t = torch.func.jvp(lambda a, b, c: _naive(a, b, c, True, 0.3)[0],
                              (q.double(), k.double(), v.double()), (tq[2].double(), tk[2].double(), tv[2].double()))
    _assert_close("tout[2]", tout[2], ref_t, torch.float32)
    g1 = attn.attention_bwd(do, q, k, v, out, lse, True, 0.3)
    g2 = attn.attention_bwd(do, q, k, v, out, lse, True, 0.3)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_bad_arguments_raise_before_launch():
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="divide"):
        attn.attention_fwd(q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16), False, 0.25)
    with pytest.raises(TypeError, match="dtype"):
        attn.attention_fwd(q, k.half(), k.half(), False, 0.25)
    with pytest.raises(ValueError, match="head dim"):
        attn.attention_fwd(torch.randn(1, 1, 4, 512), torch.randn(1, 1, 4, 512), torch.randn(1, 1, 4, 512), False, 1.0)
    with pytest.raises(ValueError, match="k/v shape"):
        attn.attention_fwd(q, torch.randn(1, 2, 8, 32), torch.randn(1, 2, 8, 32), False, 0.25)
    with pytest.raises(TypeError, match="causal"):
        attn.attention_fwd(q, k, k, 1, 0.25)
    with pytest.raises(ValueError, match="tk"):
        attn.attention_jvp(q, k, k, q[None], k[None, :, :1], k[None], False, 0.25)
    with pytest.raises(ValueError, match="probe count"):
        attn.attention_jvp(q, k, k, q.expand(2, *q.shape), k[None], k[None], False, 0.25)
    out, lse = torch.zeros_like(q), torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match="lse"):
        attn.attention_bwd(q, q, k, k, out, lse.double(), False, 0.25)


def test_supports():
    assert attn.supports(head_dim=128, dtype=torch.bfloat16, device="cuda") is None
    assert attn.supports(q=torch.randn(1, 1, 2, 80)) is None  # CPU under TRITON_INTERPRET=1
    assert "head_dim" in attn.supports(head_dim=512)
    assert "dtype" in attn.supports(dtype=torch.float64)
    assert all(attn.supports(head_dim=d) is None for d in attn.SUPPORTED_HEAD_DIMS)
