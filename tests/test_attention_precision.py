"""Precision of the attention backward when the softmax saturates (large logits).

The flash backward forms ``D = rowsum(dO * O)`` from the stored output, so ``dP - D`` cancels in
rounding noise; docs/design.md ("Attention", precision at saturated softmax) states the bound
checked here: per query row, ``|dq_i - dq_i^exact| <= c u s |dO_i| max|v| max|k|`` for a saturated
row, times ``(1 + s |q_i| max|k|)`` for a row whose softmax is spread (there fp32 logits carry an
absolute error ``u s |q_i| |k|``, which no fp32 implementation avoids).
"""
import pytest
import torch

import condinit
from condinit import _backends

F64 = torch.float64
U32 = 2.0 ** -24  # fp32 unit roundoff


def _backends_here():
    out = ["torch"]
    if _backends.available("cpp-cpu", "cpu", "attention_bwd")[0]:
        out.append("cpp-cpu")
    return out


@pytest.mark.parametrize("backend", _backends_here())
@pytest.mark.parametrize("logit", [1e1, 1e4, 1e6])
def test_dq_error_bounded_at_saturated_softmax(backend, logit, rng):
    B, H, N, d = 1, 2, 33, 16
    # inputs exactly representable in fp32, so the float64 reference sees the same problem
    q, k, v, do = (torch.randn(B, H, N, d, generator=rng).double() for _ in range(4))
    scale = logit / d  # s * |q.k| ~ logit
    q64 = q.clone().requires_grad_()
    k64 = k.clone().requires_grad_()
    p64 = torch.softmax(scale * q64 @ k64.transpose(-1, -2), -1)
    (p64 @ v).backward(do)
    saturated = p64.detach().amax(-1) > 1 - 1e-12                       # [B, H, N]
    qf, kf = q.float().requires_grad_(), k.float().requires_grad_()
    condinit.attention(qf, kf, v.float(), scale=scale, backend=backend).backward(do.float())
    vmax = v.norm(dim=-1).amax(-1, keepdim=True)          # [B, H, 1]
    kmax = k.norm(dim=-1).amax(-1, keepdim=True)
    bound = 8 * d ** 0.5 * U32 * scale * do.norm(dim=-1) * vmax * kmax    # [B, H, N]
    bound = torch.where(saturated, bound, bound * (1 + scale * q.norm(dim=-1) * kmax))
    err_q = (qf.grad.double() - q64.grad).norm(dim=-1)
    assert bool((err_q <= bound).all()), f"dq error {err_q.max():.3e} above its bound {bound.min():.3e}"
    # dk sums over query rows: the bound adds up over the rows
    qmax = q.norm(dim=-1).amax(-1)
    bound_k = 8 * d ** 0.5 * U32 * scale * (do.norm(dim=-1).sum(-1) * vmax[..., 0] * qmax) * (
        1 + scale * qmax * kmax[..., 0])
    err_k = (kf.grad.double() - k64.grad).norm(dim=-1).amax(-1)
    assert bool((err_k <= bound_k).all()), f"dk error {err_k.max():.3e} above its bound"
    # the bound is not vacuous: at ordinary logits the gradient itself is far larger, and at
    # large ones most rows are saturated, where the bound has no logit factor
    if logit <= 10:
        assert bool((bound < 1e-2 * q64.grad.norm(dim=-1).amax()).all())
    else:
        assert saturated.float().mean() > 0.5


# ------------------------------------------------------------------------------------------------
# float64 on the C++ CPU kernels: forward, JVP, VJP and the tangent backward to ~1e-12 relative
# ------------------------------------------------------------------------------------------------
# The references are written here from the mask contract (condinit.attention's docstring): a
# dense float64 softmax over an explicit [B, Nq, Nk] visibility mask, its torch.func.jvp / vjp,
# and torch's own scaled_dot_product_attention (MATH backend) in float64 on the rows that see a key.

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from condinit.ops.attention.explain import dispatch_log  # noqa: E402

REL64 = 1e-12

# B, H, Hkv, Nq, Nk, d, causal, window, q_lens, kv_lens: every mask kind, GQA 2:1 and 4:1, tiles
# of the forward (128 x 256) and backward (64 x 128) kernels crossed, N below / above d, d = 1, 3.
F64_CASES = [pytest.param(*c, marks=pytest.mark.slow) for c in (
    (2, 4, 2, 37, 37, 16, True, None, None, None),
    (1, 4, 1, 300, 300, 64, True, (40, -1), None, None),
    (2, 2, 2, 45, 70, 8, False, (5, 7), None, None),
    (2, 4, 2, 50, 50, 3, True, None, [50, 31], [50, 31]),
    (3, 2, 1, 20, 33, 5, False, None, None, [33, 1, 17]),
    (1, 2, 2, 1, 257, 32, True, None, None, None),
    (1, 2, 2, 40, 9, 1, True, None, None, None),
    (2, 8, 2, 130, 140, 80, True, (60, -1), [130, 100], [140, 90]),
)] + [(2, 2, 1, 11, 13, 4, True, (3, -1), [11, 7], [13, 6])]   # the fast tier's case: every mask kind at once


def _visible(B, Nq, Nk, causal, window, q_lens, kv_lens):
    """[B, Nq, Nk]: query i of entry b attends key j (the documented contract)."""
    i, j = torch.arange(Nq)[:, None], torch.arange(Nk)[None, :]
    out = []
    for b in range(B):
        Lq = q_lens[b] if q_lens else Nq
        Lk = kv_lens[b] if kv_lens else Nk
        off = Lk - Lq
        ok = (i < Lq) & (j < Lk)
        if causal:
            ok &= j <= i + off
        if window is not None and window[0] >= 0:
            ok &= j >= i + off - window[0]
        if window is not None and window[1] >= 0:
            ok &= j <= i + off + window[1]
        out.append(ok)
    return torch.stack(out)


def _dense(vis, scale):
    """softmax(scale q k^T masked) v in float64; rows that see no key give 0."""
    m = vis[:, None]
    seen = m.any(-1, keepdim=True)

    def f(q, k, v):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = (scale * q @ k.transpose(-1, -2)).masked_fill(~m, float("-inf"))
        return torch.softmax(torch.where(seen, s, 0.0), -1) * seen @ v
    return f


def _sdpa_math(vis, scale):
    def f(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=vis[:, None], scale=scale,
                                                                    enable_gqa=q.shape[1] != k.shape[1])
    return f


def _rel(a, b, rows=None):
    """max |a - b| / max |b| over the rows given ([B, 1 or H, Nq] bool) or all."""
    a, b = a.detach(), b.detach()
    if rows is not None:
        a, b = a * rows[..., None], b * rows[..., None]
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@pytest.mark.skipif(not _backends.available("cpp-cpu", "cpu", "attention_fwd")[0], reason="no C++ CPU kernel")
@pytest.mark.parametrize("B,H,Hkv,Nq,Nk,d,causal,window,q_lens,kv_lens", F64_CASES)
def test_float64_cpp_cpu_matches_float64_references(B, H, Hkv, Nq, Nk, d, causal, window, q_lens, kv_lens, rng):
    """Values, tangents, gradients and the tangent backward's six gradients of the float64 C++
    CPU kernels (which the dispatch log shows ran) within 1e-12 of the float64 references."""
    scale = 0.9 * d ** -0.5
    x = lambda *s: torch.randn(*s, generator=rng, dtype=F64)  # noqa: E731
    q, k, v = x(B, H, Nq, d), x(B, Hkv, Nk, d), x(B, Hkv, Nk, d)
    P = 2
    tq, tk, tv = x(P, B, H, Nq, d), x(P, B, Hkv, Nk, d), x(P, B, Hkv, Nk, d)
    gout, gtout = x(B, H, Nq, d), x(P, B, H, Nq, d)
    lens = dict(q_lens=torch.tensor(q_lens) if q_lens else None, kv_lens=torch.tensor(kv_lens) if kv_lens else None)
    kw = dict(causal=causal, window=window, scale=scale, **lens)
    vis = _visible(B, Nq, Nk, causal, window, q_lens, kv_lens)
    rows = vis.any(-1)[:, None]                                     # [B, 1, Nq]: rows that see a key
    ref, math = _dense(vis, scale), _sdpa_math(vis, scale)

    with dispatch_log() as log:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = condinit.attention(*leaves, backend="cpp-cpu", **kw)
        grads = torch.autograd.grad(out, leaves, gout)
        tleaves = [t.clone().requires_grad_() for t in (q, k, v, tq, tk, tv)]
        o2, tout = condinit.attention_jvp(*tleaves, backend="cpp-cpu", **kw)
        tgrads = torch.autograd.grad((o2 * gout).sum() + (tout * gtout).sum(), tleaves)
    assert {(r.op, r.backend, r.dtype) for r in log} == {
        (op, "cpp-cpu", F64) for op in ("attention_fwd", "attention_bwd", "attention_jvp", "attention_jvp_bwd")}

    # forward: the dense reference, SDPA MATH (rows that see a key), the tiled torch reference
    expected = ref(q, k, v)
    assert out.dtype == F64 and _rel(out, expected) < REL64
    assert _rel(out, math(q, k, v), rows) < REL64
    assert _rel(out, condinit.attention(q, k, v, backend="torch", **kw)) < REL64
    assert (out * ~rows[..., None]).abs().max() == 0                 # rows that see no key: exactly 0
    assert _rel(o2, expected) < REL64
    # JVP, each probe, against torch.func.jvp of both references
    for p in range(P):
        t_ref = torch.func.jvp(ref, (q, k, v), (tq[p], tk[p], tv[p]))[1]
        assert _rel(tout[p], t_ref) < REL64, f"tangent of probe {p}"
        assert _rel(tout[p], torch.func.jvp(math, (q, k, v), (tq[p], tk[p], tv[p]))[1], rows) < REL64
    # VJP against torch.func.vjp of both references (gradients summed over the GQA group)
    for name, g, r, s in zip("qkv", grads, torch.func.vjp(ref, q, k, v)[1](gout),
                             torch.func.vjp(math, q, k, v)[1](gout * rows[..., None])):
        scale_of = max(r.abs().max(), 1e-300)
        assert float((g - r).abs().max() / scale_of) < REL64, f"d{name}"
        assert float((g - s).abs().max() / scale_of) < REL64, f"d{name} vs SDPA"
    # tangent backward: gradients of <gout, out> + sum_p <gtout_p, tout_p> w.r.t. all six inputs

    def loss(q_, k_, v_, tq_, tk_, tv_):
        total = (ref(q_, k_, v_) * gout).sum()
        for p in range(P):
            total = total + (torch.func.jvp(ref, (q_, k_, v_), (tq_[p], tk_[p], tv_[p]))[1] * gtout[p]).sum()
        return total
    expected_grads = torch.func.grad(loss, argnums=tuple(range(6)))(q, k, v, tq, tk, tv)
    for name, g, r in zip(("q", "k", "v", "tq", "tk", "tv"), tgrads, expected_grads):
        assert float((g - r).abs().max() / max(r.abs().max(), 1e-300)) < REL64, f"tangent backward: d{name}"
