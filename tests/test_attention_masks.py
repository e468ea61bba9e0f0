"""The attention masks (causal, sliding window, per-sequence lengths) and packed sequences, on
every backend of the mask tables runnable here, against a float64 naive reference written in
``attention_cases.py`` (the N x N mask materialized, ``torch.func.jvp`` for tangents,
``torch.autograd`` for gradients).

Checked: out, tangent and all six gradients of a random loss on both outputs of
``attention_jvp`` (and out + three gradients of ``attention``) over a sampled grid (N in {1, 17,
128, 333}, Nq != Nk, GQA 1/2/8, head dims {16, 64, 72, 80, 128, 256}, each mask kind, P in {1, 3});
varlen batches with lengths {1, 5, 64, 130} packed together; a MeanFlow-style loss on the
tangent; the tangent backward's memory at two N; NaN-poisoned output buffers; NaN propagation
(a NaN that an allowed pair touches gives NaN, a masked one changes nothing); rows with nothing
to attend to; argument errors and the tables' mask limits.
"""
import math

import pytest
import torch

import condinit
from condinit import _backends
from condinit.ops.attention.op import ATTENTION_BWD, ATTENTION_FWD, ATTENTION_JVP, ATTENTION_JVP_BWD

from attention_cases import allowed_pairs, naive_masked
from conftest import assert_close, peak_extra_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

F64, FP32 = torch.float64, torch.float32
NAMES = ("q", "k", "v", "tq", "tk", "tv")
# The backends with masked kernels on the CPU; the C++ kernels take float32 in (float64 inputs
# run on the reference), the reference float64 too.
BACKENDS = {"torch": F64, "cpp-cpu": FP32}


def require(backend):
    for op in (ATTENTION_FWD, ATTENTION_BWD, ATTENTION_JVP, ATTENTION_JVP_BWD):
        ok, why = _backends.available(backend, "cpu", op.impls[backend].native_op)
        if not ok:
            pytest.skip(f"{backend} cannot run {op.name} here: {why}")


def randn(shape, dtype, rng):
    """Drawn in float64 and rounded to ``dtype``: the reference sees the same rounded values."""
    return torch.randn(shape, generator=rng, dtype=F64).to(dtype)


def lens(values):
    return torch.tensor(values, dtype=torch.int32) if values is not None else None


def naive(inputs, mask, scale):
    """(out, tangent [P, ...]) of the naive masked attention, differentiable (float64 leaves)."""
    q, k, v, tq, tk, tv = inputs
    f = lambda a, b, c: naive_masked(a, b, c, mask, scale)  # noqa: E731
    touts = [torch.func.jvp(f, (q, k, v), (tq[p], tk[p], tv[p]))[1] for p in range(tq.shape[0])]
    return f(q, k, v), torch.stack(touts)


def floors(ref):
    """Error floors: a gradient that is 0 in exact arithmetic (dq of a row seeing one key) comes
    out as rounding noise of its group's size; measured against 0.1 x the group's largest."""
    primal = 0.1 * max(r.abs().max().item() for r in ref[:3])
    tangent = 0.1 * max(r.abs().max().item() for r in ref[3:])
    return (primal,) * 3 + (tangent,) * 3


# (B, H, Hkv, Nq, Nk, d, P, causal, window, q_lens, kv_lens): a sample of the grid in which
# every N, head dim, GQA ratio, mask kind and probe count appears, Nq != Nk both ways.
CASES = [
    (1, 1, 1, 1, 1, 16, 1, True, None, None, None),                 # N = 1
    (2, 2, 1, 17, 17, 64, 3, True, (4, -1), None, None),            # sliding window, GQA 2
    (2, 8, 1, 17, 128, 72, 1, False, (5, 3), None, [100, 17]),      # window both sides, GQA 8, pad keys
    (3, 2, 2, 128, 17, 80, 3, True, None, [128, 60, 1], [17, 9, 0]),  # lens, an empty sequence
    (1, 8, 4, 333, 333, 16, 1, True, (63, -1), None, None),         # several tiles, HF window 64
    (2, 4, 2, 128, 333, 128, 1, False, None, [128, 77], [333, 130]),  # padding only
    (2, 2, 1, 333, 128, 256, 3, True, (20, -1), [333, 200], [128, 128]),  # causal+window+lens
    (1, 8, 8, 17, 333, 64, 3, False, (-1, 0), None, [301]),         # right bound only
]


def case_id(c):
    B, H, Hkv, Nq, Nk, d, P, causal, window, ql, kl = c
    kinds = ("causal" if causal else "") + (f"w{window[0]},{window[1]}" if window else "") + (
        "-lens" if ql is not None or kl is not None else "")
    return f"B{B}H{H}kv{Hkv}-{Nq}x{Nk}-d{d}-P{P}-{kinds or 'none'}"


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_masked_attention_matches_float64_autograd(backend, case, rng):
    """attention_jvp: out, tangent and the six gradients of a random loss on both outputs;
    attention: out and the three gradients of the flash backward. Rows with no key get exactly
    zero outputs and dq, dtq; padded keys exactly zero dk, dv, dtk, dtv."""
    require(backend)
    dtype = BACKENDS[backend]
    B, H, Hkv, Nq, Nk, d, P, causal, window, ql, kl = case
    scale = 0.8 / math.sqrt(d)
    inputs = tuple(randn(s, dtype, rng) for s in (
        (B, H, Nq, d), (B, Hkv, Nk, d), (B, Hkv, Nk, d), (P, B, H, Nq, d), (P, B, Hkv, Nk, d), (P, B, Hkv, Nk, d)))
    gout, gtout = randn((B, H, Nq, d), dtype, rng), randn((P, B, H, Nq, d), dtype, rng)
    mask = allowed_pairs(B, Nq, Nk, causal, window, ql, kl)
    kw = dict(causal=causal, window=window, q_lens=lens(ql), kv_lens=lens(kl), scale=scale, backend=backend)

    leaves = [x.clone().requires_grad_() for x in inputs]
    out, tout = condinit.attention_jvp(*leaves, **kw)
    grads = torch.autograd.grad((out, tout), leaves, (gout, gtout))
    ref_leaves = [x.to(F64).requires_grad_() for x in inputs]
    out_ref, tout_ref = naive(ref_leaves, mask, scale)
    ref = torch.autograd.grad((out_ref, tout_ref), ref_leaves, (gout.to(F64), gtout.to(F64)),
                              retain_graph=True)
    assert_close(out, out_ref, dtype, "out")
    assert_close(tout, tout_ref, dtype, "tangent")
    for name, g, r, fl in zip(NAMES, grads, ref, floors(ref)):
        assert g.shape == r.shape and g.dtype == dtype, name
        assert_close(g, r, dtype, f"d loss / d {name}", fl, factor=2)

    empty_rows = ~mask.any(-1)[:, 0]                                       # [B, Nq]
    unseen_keys = ~mask.any(-2)[:, 0]                                      # [B, Nk]
    for t in (out, tout[0], grads[0], grads[3][0]):
        assert (t.transpose(1, 2)[empty_rows] == 0).all()
    for t in (grads[1], grads[2], grads[4][0], grads[5][0]):
        assert (t.transpose(1, 2)[unseen_keys] == 0).all()

    prim = [x.clone().requires_grad_() for x in inputs[:3]]
    out2 = condinit.attention(*prim, **kw)
    grads2 = torch.autograd.grad(out2, prim, gout)
    ref2 = torch.autograd.grad(out_ref, ref_leaves[:3], gout.to(F64))
    assert_close(out2, out_ref, dtype, "attention out")
    for name, g, r, fl in zip(NAMES, grads2, ref2, floors(ref2 + ref2)):
        assert_close(g, r, dtype, f"attention d out / d {name}", fl, factor=2)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_varlen_matches_each_sequence_alone(backend, rng):
    """attention_jvp_varlen / attention_varlen over sequences of lengths {1, 5, 64, 130} packed
    together (keys of other lengths), causal with a window, GQA 2, 3 probes: each sequence's
    outputs and all gradients equal those of the naive attention of that sequence alone."""
    require(backend)
    dtype = BACKENDS[backend]
    lq, lk = [1, 5, 64, 130], [3, 5, 64, 129]
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist())
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist())
    H, Hkv, d, P, scale, window = 4, 2, 72, 3, 0.2, (40, -1)
    Tq, Tk = sum(lq), sum(lk)
    inputs = tuple(randn(s, dtype, rng) for s in (
        (Tq, H, d), (Tk, Hkv, d), (Tk, Hkv, d), (P, Tq, H, d), (P, Tk, Hkv, d), (P, Tk, Hkv, d)))
    gout, gtout = randn((Tq, H, d), dtype, rng), randn((P, Tq, H, d), dtype, rng)
    leaves = [x.clone().requires_grad_() for x in inputs]
    out, tout = condinit.attention_jvp_varlen(
        *leaves, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=130, max_seqlen_k=130, causal=True,
        window=window, scale=scale, backend=backend)
    grads = torch.autograd.grad((out, tout), leaves, (gout, gtout))

    ref_leaves = [x.to(F64).requires_grad_() for x in inputs]
    outs, touts = [], []
    for s in range(len(lq)):
        qs, ks = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        q, k, v = (x[r].transpose(0, 1)[None] for x, r in zip(ref_leaves[:3], (qs, ks, ks)))
        tq, tk, tv = (x[:, r].transpose(1, 2)[:, None] for x, r in zip(ref_leaves[3:], (qs, ks, ks)))
        o, t = naive((q, k, v, tq, tk, tv), allowed_pairs(1, lq[s], lk[s], True, window), scale)
        outs.append(o[0].transpose(0, 1))
        touts.append(t[:, 0].transpose(1, 2))
    out_ref, tout_ref = torch.cat(outs), torch.cat(touts, 1)
    ref = torch.autograd.grad((out_ref, tout_ref), ref_leaves, (gout.to(F64), gtout.to(F64)))
    assert_close(out, out_ref, dtype, "out")
    assert_close(tout, tout_ref, dtype, "tangent")
    for name, g, r, fl in zip(NAMES, grads, ref, floors(ref)):
        assert_close(g, r, dtype, f"d loss / d {name}", fl, factor=2)
    out2 = condinit.attention_varlen(*inputs[:3], cu_q, cu_k, 130, 130, causal=True, window=window,
                                     scale=scale, backend=backend)
    assert_close(out2, out_ref, dtype, "attention_varlen out")


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_meanflow_tangent_loss_gradient(backend, rng):
    """The gradient of ||tangent_out - target||^2 (a MeanFlow / consistency-model loss on the
    JVP) w.r.t. q, k, v equals float64 autograd through the naive JVP, with a sliding window and
    key padding."""
    require(backend)
    dtype = BACKENDS[backend]
    B, H, Hkv, N, d = 2, 4, 2, 96, 64
    q, k, v = (randn(s, dtype, rng) for s in ((B, H, N, d), (B, Hkv, N, d), (B, Hkv, N, d)))
    tq, tk, tv = (randn(x.shape, dtype, rng) for x in (q, k, v))
    target = randn(q.shape, dtype, rng)
    kv = [96, 70]
    kw = dict(causal=True, window=(31, -1), kv_lens=lens(kv), q_lens=lens(kv), backend=backend)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    _, tout = condinit.attention_jvp(*leaves, tq, tk, tv, **kw)
    grads = torch.autograd.grad((tout - target).square().sum(), leaves)
    mask = allowed_pairs(B, N, N, True, (31, -1), kv, kv)
    ref_leaves = [x.to(F64).requires_grad_() for x in (q, k, v)]
    f = lambda a, b, c: naive_masked(a, b, c, mask, 1 / math.sqrt(d))  # noqa: E731
    _, tout_ref = torch.func.jvp(f, tuple(ref_leaves), tuple(t.to(F64) for t in (tq, tk, tv)))
    ref = torch.autograd.grad((tout_ref - target.to(F64)).square().sum(), ref_leaves)
    for name, g, r in zip("qkv", grads, ref):
        assert_close(g, r, dtype, f"d ||tangent - target||^2 / d {name}", 0.1 * max(x.abs().max() for x in ref),
                     factor=2)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_tangent_backward_memory_grows_linearly(backend, rng):
    """The backward through attention_jvp (masked: window and key padding) holds O(N) memory:
    from N = 512 to 2048 its peak extra memory grows about 4x (an N x N intermediate would make
    it 16x), a small multiple of one input."""
    require(backend)

    def peak(N):
        q, k, v, tq = (randn((1, 4, N, 64), FP32, rng).requires_grad_() for _ in range(4))
        out, tout = condinit.attention_jvp(q, k, v, tq, causal=True, window=(255, -1), kv_lens=lens([N - 7]),
                                           q_lens=lens([N - 3]), backend=backend)
        gout, gtout = torch.randn_like(out), torch.randn_like(tout)
        return peak_extra_bytes(lambda: torch.autograd.grad((out, tout), (q, k, v, tq), (gout, gtout))), q.nbytes

    small, _ = peak(512)
    big, one_input = peak(2048)
    assert small > 0
    assert big / small < 6, f"peak {small} B at N=512, {big} B at N=2048"
    assert big < 40 * one_input, f"peak {big} B, one input {one_input} B"


MASKED_CALLS = [
    dict(causal=True, window=(7, -1), q_lens=[40, 1], kv_lens=[33, 0]),
    dict(causal=False, window=(3, 5), kv_lens=[20, 33]),
]


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("kw", MASKED_CALLS, ids=["causal-window-lens", "window-lens"])
def test_outputs_fully_written(backend, kw, rng, nan_poison):
    """With torch.empty & co. returning NaN, every output and gradient of masked calls is
    finite: every element is written (rows with no key included)."""
    require(backend)
    dtype = BACKENDS[backend]
    inputs = [randn(s, dtype, rng).requires_grad_() for s in (
        (2, 4, 40, 16), (2, 2, 33, 16), (2, 2, 33, 16), (2, 2, 4, 40, 16), (2, 2, 2, 33, 16), (2, 2, 2, 33, 16))]
    kw = dict(kw, q_lens=lens(kw.get("q_lens")), kv_lens=lens(kw.get("kv_lens")), backend=backend)
    out, tout = condinit.attention_jvp(*inputs, **kw)
    grads = torch.autograd.grad((out, tout), inputs, (torch.ones_like(out), torch.ones_like(tout)))
    out2 = condinit.attention(*inputs[:3], **kw)
    grads2 = torch.autograd.grad(out2, inputs[:3], torch.ones_like(out2))
    for name, t in zip(("out", "tout", "attention out") + NAMES + NAMES[:3], (out, tout, out2, *grads, *grads2)):
        assert torch.isfinite(t).all(), name


def _run_all(inputs, kw):
    """out, tout and the six gradients of attention_jvp, then out and three gradients of
    attention (the flash backward), for a loss of ones."""
    leaves = [x.clone().requires_grad_() for x in inputs]
    out, tout = condinit.attention_jvp(*leaves, **kw)
    grads = torch.autograd.grad((out, tout), leaves, (torch.ones_like(out), torch.ones_like(tout)))
    prim = leaves[:3]
    out2 = condinit.attention(*prim, **kw)
    grads2 = torch.autograd.grad(out2, prim, torch.ones_like(out2))
    return (out, tout, *grads, out2, *grads2)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_nan_propagates_only_where_attended(backend, rng):
    """A NaN in a key a row attends makes that row NaN (not 0, as a NaN-dropping max would);
    NaN / Inf in masked-out places (padded keys and queries, keys outside the window or after
    the causal diagonal, in q, k, v and the tangents) change no output and no gradient."""
    require(backend)
    dtype = BACKENDS[backend]
    B, H, Hkv, N, d = 2, 2, 1, 150, 16
    inputs = [randn(s, dtype, rng) for s in (
        (B, H, N, d), (B, Hkv, N, d), (B, Hkv, N, d), (1, B, H, N, d), (1, B, Hkv, N, d), (1, B, Hkv, N, d))]
    kw = dict(causal=True, window=(9, -1), q_lens=lens([150, 100]), kv_lens=lens([150, 120]), backend=backend)
    clean = _run_all(inputs, kw)

    poisoned = [x.clone() for x in inputs]
    for x in poisoned[1:3] + poisoned[4:]:       # keys 120.. of batch 1 are padding
        x[..., 1, :, 120:, :] = float("nan")
    for x in (poisoned[0], poisoned[3]):         # queries 100.. of batch 1 are padding
        x[..., 1, :, 100:, :] = float("inf")
    # batch 0: key 70 is seen by rows 70..79 only (causal, window 10); rows < 70 and >= 80 not
    poisoned[2][0, :, 70] = float("nan")
    results = _run_all(poisoned, kw)
    rows_hit = torch.zeros(B, N, dtype=torch.bool)
    rows_hit[0, 70:80] = True
    names = ("out", "tout") + NAMES + ("attention out",) + NAMES[:3]
    for name, a, b in zip(names, results, clean):
        if name in ("out", "tout", "attention out"):
            hit = a.transpose(-3, -2)[..., rows_hit, :, :] if name == "tout" else a.transpose(1, 2)[rows_hit]
            assert hit.isnan().all(), f"{name}: a NaN value in an attended key must give NaN"
            keep = ~rows_hit
            sel = (lambda t: t.transpose(-3, -2)[..., keep, :, :]) if name == "tout" else (
                lambda t: t.transpose(1, 2)[keep])
            torch.testing.assert_close(sel(a), sel(b), msg=name)
    # Gradients: every gradient of batch 1 (only masked poison there) equals the clean one.
    for name, a, b in zip(names, results, clean):
        if name not in ("out", "tout", "attention out"):
            a1, b1 = (t[:, 1] if t.dim() == 5 else t[1] for t in (a, b))
            torch.testing.assert_close(a1, b1, msg=f"batch 1 d/d {name}")


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_rows_with_nothing_to_attend(backend, rng):
    """kv_lens 0, q_lens 0, and a window that keeps no key (causal with Nq > Nk): outputs,
    tangents and gradients are exactly 0 there; the other rows are unaffected."""
    require(backend)
    dtype = BACKENDS[backend]
    inputs = [randn(s, dtype, rng) for s in (
        (3, 2, 20, 16), (3, 2, 9, 16), (3, 2, 9, 16), (1, 3, 2, 20, 16), (1, 3, 2, 9, 16), (1, 3, 2, 9, 16))]
    kw = dict(causal=True, window=(2, -1), q_lens=lens([20, 0, 20]), kv_lens=lens([9, 9, 0]), backend=backend)
    out, tout, dq, dk, dv, dtq, dtk, dtv, out2, dq2, dk2, dv2 = _run_all(inputs, kw)
    for t in (out, tout[0], dq, dtq[0], dk, dv, dtk[0], dtv[0], out2, dq2, dk2, dv2):
        assert (t[1:] == 0).all()
    # batch 0: causal bottom-right with Nq = 20 > Nk = 9 leaves rows 0..10 without keys
    for t in (out, tout[0], dq, dtq[0], out2, dq2):
        assert (t[0, :, :11] == 0).all() and (t[0, :, 11:] != 0).any()


def test_unmasked_degenerate_masks_are_bitwise_the_same(rng):
    """Lengths equal to the full sizes and window (-1, -1) are the unmasked call, bit for bit."""
    q, k, v = (randn((2, 4, 150, 32), FP32, rng) for _ in range(3))
    tq = randn((2, 2, 4, 150, 32), FP32, rng)
    for backend in ("torch", "cpp-cpu"):
        if backend == "cpp-cpu":
            require(backend)
        plain = condinit.attention_jvp(q, k, v, tq, causal=True, backend=backend)
        same = condinit.attention_jvp(q, k, v, tq, causal=True, window=(-1, -1), q_lens=[150, 150],
                                      kv_lens=[150, 150], backend=backend)
        for a, b in zip(plain, same):
            assert torch.equal(a, b), backend


@pytest.mark.parametrize("kwargs,error,match", [
    ({"window": 3}, TypeError, "window"),
    ({"window": (3,)}, TypeError, "window"),
    ({"window": (-2, 0)}, ValueError, r"window\[0\]"),
    ({"window": (0, 1.5)}, TypeError, r"window\[1\]"),
    ({"q_lens": torch.tensor([1.0, 2.0])}, TypeError, "q_lens must be an integer"),
    ({"q_lens": torch.tensor([1, 2, 3])}, ValueError, r"q_lens must have shape \[B\]"),
    ({"kv_lens": torch.tensor([1, 9])}, ValueError, r"kv_lens must be in \[0, 7\]"),
    ({"kv_lens": [1, -1]}, ValueError, r"kv_lens must be in \[0, 7\]"),
    ({"causal": 1}, TypeError, "causal"),
])
def test_argument_errors(kwargs, error, match):
    q, k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    with pytest.raises(error, match=match):
        condinit.attention(q, k, v, **kwargs)
    with pytest.raises(error, match=match):
        condinit.attention_jvp(q, k, v, torch.randn_like(q), **kwargs)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"cu_seqlens_q": torch.tensor([0, 3, 4])}, ValueError, "cu_seqlens_q must start at 0"),
    ({"cu_seqlens_k": torch.tensor([0, 6])}, ValueError, "same number of sequences"),
    ({"max_seqlen_q": 2}, ValueError, "max_seqlen_q"),
    ({"cu_seqlens_q": torch.tensor([0.0, 5.0])}, TypeError, "cu_seqlens_q must be an integer"),
])
def test_varlen_argument_errors(kwargs, error, match):
    q, k = torch.randn(5, 2, 8), torch.randn(6, 1, 8)
    args = dict(cu_seqlens_q=torch.tensor([0, 2, 5]), cu_seqlens_k=torch.tensor([0, 3, 6]), max_seqlen_q=3,
                max_seqlen_k=3)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        condinit.attention_varlen(q, k, k, **args)


def test_tables_declare_the_mask_kinds():
    """The torch and cpp-cpu rows run every mask kind; the Triton and CUDA rows declare theirs,
    and a call needing a kind a row lacks is refused by that row (subset check), never run."""
    for op in (ATTENTION_FWD, ATTENTION_BWD, ATTENTION_JVP, ATTENTION_JVP_BWD):
        for backend in ("torch", "cpp-cpu"):
            assert op.impls[backend].not_supported("cpu", {"masks": ("causal", "window", "lens")}) is None
        for backend in ("triton", "cuda"):
            if backend not in op.impls:
                continue
            declared = dict(op.impls[backend].limits)["masks"]
            for kind in ("causal", "window", "lens"):
                why = op.impls[backend].not_supported("cuda", {"masks": (kind,)})
                assert (why is None) == (kind in declared), (op.name, backend, kind, why)
    row = ATTENTION_FWD.impls["triton"]
    if "window" not in dict(row.limits)["masks"]:
        assert "window" in row.not_supported("cuda", {"masks": ("causal", "window")})
        ok, _ = _backends.available("triton", "cpu")
        if ok:
            with pytest.raises(condinit.BackendUnavailableError, match="masks"):
                condinit.attention(torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16),
                                   window=(1, 1), backend="triton")


def test_masks_under_vmap_jacfwd_and_compile(rng):
    """The mask arguments pass through torch.vmap (lens repeated over the vmapped batch),
    forward AD of a vmapped call, jacfwd == jacrev, and torch.compile(fullgraph=True)."""
    q, k, v = (randn((3, 2, 2, 9, 8), F64, rng) for _ in range(3))
    kl = torch.tensor([9, 4])
    f = lambda a, b, c: condinit.attention(a, b, c, causal=True, window=(3, -1), q_lens=kl, kv_lens=kl)  # noqa: E731
    looped = torch.stack([f(q[i], k[i], v[i]) for i in range(3)])
    torch.testing.assert_close(torch.vmap(f)(q, k, v), looped, rtol=0, atol=0)
    t = [randn(x.shape, F64, rng) for x in (q, k, v)]
    _, tout = torch.func.jvp(torch.vmap(f), (q, k, v), tuple(t))
    tout_loop = torch.stack([torch.func.jvp(f, (q[i], k[i], v[i]), (t[0][i], t[1][i], t[2][i]))[1]
                             for i in range(3)])
    torch.testing.assert_close(tout, tout_loop)
    jf = torch.func.jacfwd(lambda a: f(a, k[0], v[0]))(q[0])
    jr = torch.func.jacrev(lambda a: f(a, k[0], v[0]))(q[0])
    torch.testing.assert_close(jf, jr)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q[0], k[0], v[0]), looped[0])
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_gradient_through_the_forward_mode_tangent(backend, rng):
    """A loss on torch.func.jvp's tangent of condinit.attention (masked) differentiates under
    torch.autograd and torch.func.grad, and equals float64 autograd through the naive JVP."""
    require(backend)
    dtype = BACKENDS[backend]
    q, k, v = (randn((2, 4, 40, 16), dtype, rng) for _ in range(3))
    t = tuple(randn(x.shape, dtype, rng) for x in (q, k, v))
    kl = [40, 23]
    f = lambda a, b, c: condinit.attention(a, b, c, causal=True, window=(9, -1), kv_lens=lens(kl),  # noqa: E731
                                           q_lens=lens(kl), backend=backend)
    loss = lambda a, b, c: torch.func.jvp(f, (a, b, c), t)[1].square().sum()  # noqa: E731
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    grads = torch.autograd.grad(loss(*leaves), leaves)
    grads_func = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    mask = allowed_pairs(2, 40, 40, True, (9, -1), kl, kl)
    ref_leaves = [x.to(F64).requires_grad_() for x in (q, k, v)]
    g = lambda a, b, c: naive_masked(a, b, c, mask, 0.25)  # noqa: E731
    ref = torch.autograd.grad(torch.func.jvp(g, tuple(ref_leaves), tuple(x.to(F64) for x in t))[1].square().sum(),
                              ref_leaves)
    floor = 0.1 * max(r.abs().max().item() for r in ref)
    for name, a, b, r in zip("qkv", grads, grads_func, ref):
        assert_close(a, r, dtype, f"torch.autograd d/d {name}", floor, factor=2)
        assert_close(b, r, dtype, f"torch.func.grad d/d {name}", floor, factor=2)
