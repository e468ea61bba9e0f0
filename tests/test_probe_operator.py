"""JacobianOperator against float64 dense Jacobians of a naive attention layer (torch.func.jacrev)."""
import math

import pytest
import torch
from torch import nn

from condinit.models import AttentionSpec, register_adapter, unregister_adapter
from condinit.probe import JacobianOperator, lanczos_svd

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


class TinyAttention(nn.Module):
    """Separate q/k/v projections with biases (GQA from the row counts), registered below."""

    def __init__(self, D, H, Hkv, d, g):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, r * d, dtype=F64) for r in (H, Hkv, Hkv))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=F64) / math.sqrt(D))
        self.num_heads, self.head_dim = H, d


@pytest.fixture(autouse=True, scope="module")
def _adapter():
    register_adapter(TinyAttention, lambda m: AttentionSpec.from_linears(m.q_proj, m.k_proj, m.v_proj,
                                                                          num_heads=m.num_heads))
    yield
    unregister_adapter(TinyAttention)


def naive_attention(q, k, v, causal, scale):
    G = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(G, -3), v.repeat_interleave(G, -3)
    s = scale * q @ k.transpose(-1, -2)
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v


def reference_jacobian(m: TinyAttention, x, wrt, causal):
    """Dense [m, n] Jacobian by jacrev of the naive layer (float64)."""
    H, d = m.num_heads, m.head_dim
    Hkv = m.k_proj.weight.shape[0] // d
    B, N, _ = x.shape
    sc = 1 / math.sqrt(d)
    heads = lambda y, h: y.reshape(B, N, h, d).transpose(1, 2)  # noqa: E731
    W = [m.q_proj.weight.detach(), m.k_proj.weight.detach(), m.v_proj.weight.detach()]
    b = [m.q_proj.bias.detach(), m.k_proj.bias.detach(), m.v_proj.bias.detach()]

    def from_qkv(q, k, v):
        return naive_attention(q, k, v, causal, sc).reshape(-1)

    def from_weights(wq, wk, wv):
        return from_qkv(heads(x @ wq.T + b[0], H), heads(x @ wk.T + b[1], Hkv), heads(x @ wv.T + b[2], Hkv))

    def from_input(xx):
        return from_qkv(*(heads(xx @ w.T + bb, h) for w, bb, h in zip(W, b, (H, Hkv, Hkv))))

    if wrt == "weights":
        js = torch.func.jacrev(from_weights, argnums=(0, 1, 2))(*W)
    elif wrt == "input":
        js = (torch.func.jacrev(from_input)(x),)
    else:
        qkv = [heads(x @ w.T + bb, h) for w, bb, h in zip(W, b, (H, Hkv, Hkv))]
        js = torch.func.jacrev(from_qkv, argnums=(0, 1, 2))(*qkv)
    return torch.cat([j.reshape(j.shape[0], -1) for j in js], dim=1)


def make(wrt, causal, B=1, N=8, D=16, H=2, Hkv=2, d=8, seed=0, x_fn=None):
    g = torch.Generator().manual_seed(seed)
    m = TinyAttention(D, H, Hkv, d, g)
    x = torch.randn(B, N, D, generator=g, dtype=F64)
    if x_fn is not None:
        x = x_fn(x)
    if wrt == "qkv":
        with torch.no_grad():
            heads = lambda y, h: y.reshape(B, N, h, d).transpose(1, 2)  # noqa: E731
            qkv = tuple(heads(lin(x), h) for lin, h in ((m.q_proj, H), (m.k_proj, Hkv), (m.v_proj, Hkv)))
        op = JacobianOperator(qkv, None, wrt="qkv", causal=causal)
    else:
        op = JacobianOperator(m, x, wrt=wrt, causal=causal)
    return m, x, op


CASES = [(wrt, causal, hk) for wrt in ("weights", "input", "qkv") for causal in (False, True)
         for hk in ((2, 2), (2, 1))]


@pytest.mark.parametrize("wrt,causal,hk", CASES)
def test_dense_matches_jacrev_and_adjoint(wrt, causal, hk):
    H, Hkv = hk
    m, x, op = make(wrt, causal, B=2 if wrt != "weights" else 1, N=7, D=12, H=H, Hkv=Hkv, d=6, seed=H + Hkv)
    J = op.dense()
    Jref = reference_jacobian(m, x, wrt, causal)
    assert op.shape == tuple(Jref.shape)
    torch.testing.assert_close(J, Jref, atol=1e-10, rtol=1e-10)
    g = torch.Generator().manual_seed(7)
    t = torch.randn(op.n, generator=g, dtype=F64)
    u = torch.randn(op.m, generator=g, dtype=F64)
    lhs, rhs = float(op.mv(t) @ u), float(t @ op.rmv(u))
    assert abs(lhs - rhs) <= 1e-10 * max(1.0, abs(lhs))
    # multi-probe launches agree with single probes
    T = torch.randn(op.n, 3, generator=g, dtype=F64)
    U = torch.randn(op.m, 3, generator=g, dtype=F64)
    torch.testing.assert_close(op.matmat(T), torch.stack([op.mv(T[:, i]) for i in range(3)], 1), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(op.rmatmat(U), torch.stack([op.rmv(U[:, i]) for i in range(3)], 1), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(op.rmatmat(U), Jref.t() @ U, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("wrt,causal,hk", CASES)
def test_known_nulls_are_exact(wrt, causal, hk):
    H, Hkv = hk
    m, x, op = make(wrt, causal, N=8, D=16, H=H, Hkv=Hkv, d=4 if Hkv < H else 8, seed=3)
    J = reference_jacobian(m, x, wrt, causal)
    eye_n = torch.eye(op.n, dtype=F64)
    Pin = op.project_input(eye_n)               # rows: P e_i (P symmetric)
    torch.testing.assert_close(Pin, Pin.t(), atol=1e-10, rtol=0)
    torch.testing.assert_close(Pin @ Pin, Pin, atol=1e-10, rtol=0)
    kin, kout = op.null_dims
    assert int(round(float(torch.trace(eye_n - Pin)))) == kin
    # J vanishes on the removed directions: J (I - P) = 0
    assert float((J @ (eye_n - Pin)).abs().max()) < 1e-10 * float(J.abs().max())
    eye_m = torch.eye(op.m, dtype=F64)
    Pout = op.project_output(eye_m)
    assert int(round(float(torch.trace(eye_m - Pout)))) == kout
    assert float(((eye_m - Pout) @ J).abs().max()) < 1e-10 * float(J.abs().max())
    if wrt == "qkv":                            # independent: explicit key shifts K' = 1 c^T
        assert kin == op.B * op.Hkv * op.d
        sizes = op._in_sizes
        t = torch.zeros(op.n, dtype=F64)
        tk = t[sizes[0]:sizes[0] + sizes[1]].view(op.B, op.Hkv, op.N, op.d)
        tk[:] = torch.randn(op.B, op.Hkv, 1, op.d, dtype=F64)
        assert float(op.mv(t).abs().max()) < 1e-12
    if causal and Hkv < H:
        assert kout == op.B * Hkv * (H // Hkv - 1) * op.d


def test_weights_gauge_and_constant_feature_tall():
    """Tall weight Jacobian (B N H > (H + 2 Hkv) D): without the Q/K gauge and the key shift
    (X has a constant feature, so 1 is in range(X)) sigma_min would be exactly 0."""
    def const_feature(x):
        x = x.clone()
        x[..., 0] = 1.0
        return x

    m, x, op = make("weights", False, B=4, N=8, D=8, H=2, Hkv=2, d=4, seed=5, x_fn=const_feature)
    assert op.n < op.m
    J = reference_jacobian(m, x, "weights", False)
    assert float(torch.linalg.svdvals(J)[-1]) < 1e-10 * float(torch.linalg.svdvals(J)[0])
    assert "key shifts dW_K" in op.null_description and "gauge" in op.null_description
    Jc = J @ op.project_input(torch.eye(op.n, dtype=F64))
    s = torch.linalg.svdvals(Jc)
    r = op.n - op.null_dims[0]
    assert float(s[r - 1]) > 1e-6 * float(s[0])
    est = lanczos_svd(op, steps=op.n, seed=1)
    assert not est.rank_deficient
    assert est.sigma_min == pytest.approx(float(s[r - 1]), rel=1e-2)


def test_mha_with_output_proj_matches_module():
    """nn.MultiheadAttention (fused in_proj), include_output_proj: J of the module's own forward."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(12, 3, batch_first=True, dtype=F64)
    x = torch.randn(2, 5, 12, dtype=F64)
    op = JacobianOperator(mha, x, wrt="input", include_output_proj=True)
    J = op.dense()
    ref = torch.func.jacrev(lambda xx: mha(xx, xx, xx, need_weights=False)[0].reshape(-1))(x).reshape(op.m, -1)
    torch.testing.assert_close(J, ref, atol=1e-10, rtol=1e-10)
    state = {k: v.clone() for k, v in mha.state_dict().items()}
    lanczos_svd(op, steps=5)
    assert all(torch.equal(state[k], v) for k, v in mha.state_dict().items())
    assert all(p.grad is None for p in mha.parameters())


def test_to_scipy_and_float32():
    m, x, op = make("weights", False, N=8, D=16, H=2, Hkv=2, d=8, seed=2)
    lo = op.to_scipy()
    import numpy as np

    t = np.random.default_rng(0).standard_normal(op.n)
    u = np.random.default_rng(1).standard_normal(op.m)
    assert lo.shape == op.shape
    np.testing.assert_allclose(lo.matvec(t), op.mv(torch.from_numpy(t)).numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lo.rmatvec(u), op.rmv(torch.from_numpy(u)).numpy(), rtol=1e-12, atol=1e-12)
    T = np.random.default_rng(2).standard_normal((op.n, 3))
    np.testing.assert_allclose(lo.matmat(T), op.matmat(torch.from_numpy(T)).numpy(), rtol=1e-12, atol=1e-12)
    op32 = JacobianOperator(m, x, wrt="weights", dtype=torch.float32)
    assert op32.dtype == torch.float32
    t32 = torch.from_numpy(t)
    torch.testing.assert_close(op32.mv(t32).double(), op.mv(t32), atol=1e-4, rtol=1e-4)


def test_bad_input():
    m, x, op = make("weights", False)
    with pytest.raises(ValueError, match="not recognised as attention"):
        JacobianOperator(nn.Linear(4, 4), torch.randn(1, 3, 4))
    with pytest.raises(ValueError, match="D = 16"):
        JacobianOperator(m, torch.randn(1, 8, 15, dtype=F64))
    with pytest.raises(ValueError, match="wrt must be"):
        JacobianOperator(m, x, wrt="bias")
    with pytest.raises(ValueError, match="no output projection"):
        JacobianOperator(m, x, include_output_proj=True)
    with pytest.raises(ValueError, match="use wrt='qkv'"):
        JacobianOperator((torch.randn(1, 2, 4, 4),) * 3, None, wrt="weights")
    with pytest.raises(ValueError, match="above the limit"):
        op.dense(max_entries=10)
    with pytest.raises(ValueError, match="length"):
        op.mv(torch.randn(op.n + 1, dtype=F64))


def test_operator_is_a_snapshot():
    """Later in-place updates of the layer do not change the operator; the layer is never modified."""
    m, x, op = make("weights", True)
    t = torch.randn(op.n, dtype=F64)
    y0 = op.mv(t)
    before = [p.clone() for p in m.parameters()]
    with torch.no_grad():
        m.q_proj.weight.mul_(2.0)
    torch.testing.assert_close(op.mv(t), y0, atol=0, rtol=0)
    assert torch.equal(m.k_proj.weight, before[2]) and torch.equal(m.q_proj.weight, 2 * before[0])
