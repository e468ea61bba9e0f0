"""The certified floor and ceiling under sigma_min (condinit.probe.floor) hold the truth, over seeded
random layers, and the Lanczos brackets take them.

The reference is the dense Jacobian of the layer's own forward by ``torch.func.jacrev`` (the naive
float64 attention of test_probe_operator, or a Hugging Face module's forward), its smallest nonzero
singular value the smallest above ``1e-10 sigma_max``: the floor bounds the nonzero spectrum, so it
holds where causal grouped-query attention leaves output directions no tangent reaches. Where no
floor exists the reason must match the case (``wrt="input"``, a QK-norm with grouped queries,
``B N > D``), never a silent None.
"""
import math

import pytest
import torch

from condinit.probe import lanczos_svd
from condinit.probe.floor import sigma_min_floor

from test_brackets import _bert_case, _hf_case, _tiny_case
from test_probe_operator import _adapter, make, reference_jacobian  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


def _smallest_nonzero(J: torch.Tensor) -> float:
    s = torch.linalg.svdvals(J)
    return float(s[s > 1e-10 * s[0]][-1])


def _check(op, J, what) -> bool:
    """The floor (and ceiling) against the reference; True when a floor was given."""
    f = sigma_min_floor(op)
    if f.value is None:
        assert f.reason, what
        if op.wrt == "input":
            assert "wrt='input'" in f.reason, (what, f.reason)
        elif op.q_norm is not None and op.G > 1:
            assert "on the queries with" in f.reason, (what, f.reason)
        return False
    assert f.value > 0 and not f.reason, (what, f)
    if float(torch.linalg.svdvals(J)[0]) == 0.0:
        return True
    smin = _smallest_nonzero(J)
    assert f.value <= smin * (1 + 1e-9), (what, f.value, smin)
    if op._wo is None:
        assert f.ceiling is not None and f.ceiling >= smin * (1 - 1e-9), (what, f.ceiling, smin)
    return True


def test_floor_holds_the_truth_fast(seed):
    g = torch.Generator().manual_seed(seed)
    given = sum(_check(op, J, what) for what, op, J in (_tiny_case(g, i) for i in range(40)))
    assert given >= 10, given


@pytest.mark.slow
def test_floor_holds_the_truth_many(seed):
    g = torch.Generator().manual_seed(seed)
    given = grouped = 0
    for what, op, J in (_tiny_case(g, i) for i in range(300)):
        ok = _check(op, J, what)
        given += ok
        grouped += ok and op.causal and op.G > 1
    assert given >= 120 and grouped >= 10, (given, grouped)


@pytest.mark.slow
def test_floor_holds_the_truth_hf_and_bert(seed, monkeypatch):
    """Llama (RoPE), Qwen3 (QK-norm: the value term alone), Gemma-2 (window, soft-capping), GPT-NeoX
    (partial rotary, biases) and BERT (bidirectional, biases)."""
    pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(seed)
    given = eligible = 0
    for i in range(24):
        with monkeypatch.context() as mp:
            what, op, J = (_hf_case if i < 16 else _bert_case)(g, i, mp)
            given += _check(op, J, what)
            eligible += op.wrt == "weights"          # the draw picks wrt; "input" never has a floor
    assert given >= max(1, eligible // 3), (given, eligible)


@pytest.mark.parametrize("causal,H,Hkv", [(True, 2, 2), (False, 2, 2), (True, 4, 2)])
def test_lanczos_brackets_take_the_floor(causal, H, Hkv, seed):
    """A short run on a multi-head layer: without the floor sigma_min_lo would be 0 (kappa_hi inf); with it
    the bracket is finite, certified, and holds the reference (also for causal grouped queries)."""
    m, x, op = make("weights", causal, N=20, D=48, H=H, Hkv=Hkv, d=8, seed=seed)
    J = reference_jacobian(m, x, "weights", causal)
    smin, smax = _smallest_nonzero(J), float(torch.linalg.svdvals(J)[0])
    est = lanczos_svd(op, steps=6, seed=seed % 1000, blocks=False)
    f = sigma_min_floor(op)
    assert not est.exact and f.value is not None and f.ceiling is not None
    assert est.sigma_min_floor == f.value and est.sigma_min_ceiling == f.ceiling
    assert f.value <= est.sigma_min_lo <= smin <= est.sigma_min_hi, (est.sigma_min_lo, smin, est.sigma_min_hi)
    assert est.sigma_min_hi <= f.ceiling * (1 + 1e-6) + 1e-9 * smax
    assert math.isfinite(est.kappa_hi) and est.kappa_lo <= smax / smin <= est.kappa_hi
    # six steps are far from sigma_min: the reported values are still inside their brackets (the
    # ceiling, not the smallest Ritz value, where that lies above it)
    assert est.sigma_min_lo <= est.sigma_min <= est.sigma_min_hi, (est.sigma_min_lo, est.sigma_min, est.sigma_min_hi)
    assert est.kappa_lo <= est.kappa <= est.kappa_hi, (est.kappa_lo, est.kappa, est.kappa_hi)
    assert "certified floor" in est.bracket and "Rayleigh quotient" in est.bracket
    blocks = lanczos_svd(op, steps=12, seed=seed % 1000, blocks=True)
    assert blocks.sigma_min_lo > 0 and blocks.sigma_min_lo <= smin <= blocks.sigma_min_hi


def test_no_floor_is_said(seed):
    """wrt='input': the projections share dX, so there is no floor, and the bracket says why."""
    _, _, op = make("input", True, N=10, D=32, H=2, Hkv=2, d=4, seed=seed)
    est = lanczos_svd(op, steps=4, seed=seed % 1000, blocks=False)
    assert est.sigma_min_floor is None and est.sigma_min_ceiling is None
    assert "no certified floor under sigma_min" in est.bracket and "wrt='input'" in est.bracket


@pytest.mark.parametrize("H,Hkv,d,N", [(4, 2, 4, 3), (4, 1, 4, 10), (2, 1, 8, 20), (8, 2, 2, 7)])
def test_causal_grouped_query_floor_on_the_range(H, Hkv, d, N, seed):
    """Causal grouped-query attention: J has output directions no tangent reaches (its rank is below its
    row count), yet the floor exists and lies under the smallest nonzero singular value, and the ceiling
    (a direction in range(J)) above it; for N below, at and above the head dimension."""
    g = torch.Generator().manual_seed(seed)
    for wrt in ("qkv", "weights"):
        m, x, op = make(wrt, True, N=N, D=max(24, N + 1), H=H, Hkv=Hkv, d=d,
                        seed=int(torch.randint(2 ** 31, (1,), generator=g)))
        J = reference_jacobian(m, x, wrt, True)
        s = torch.linalg.svdvals(J)
        assert int((s > 1e-10 * s[0]).sum()) < J.shape[0]          # not onto
        f = sigma_min_floor(op)
        smin = _smallest_nonzero(J)
        if f.value is None:
            # the floor leaves out the key term and can fall below what float64 resolves (lambda to
            # eps ||C||): then it is refused as such, and only where the weights' X mixes the rows
            assert wrt == "weights" and "singular to rounding on its range" in f.reason, (wrt, f.reason)
            continue
        assert 0 < f.value <= smin * (1 + 1e-9) and f.ceiling >= smin * (1 - 1e-9), (wrt, f, smin)


def test_floor_refuses_wide_weights_input(seed):
    """wrt='weights' with more rows than features: X X^T is singular, so the floor is not claimed."""
    _, _, op = make("weights", False, B=2, N=10, D=16, H=2, Hkv=2, d=4, seed=seed)
    f = sigma_min_floor(op)
    assert f.value is None and "B N = 20 > D = 16" in f.reason


def test_torch_multihead_attention_estimate_inside_its_bracket(seed):
    """torch's own nn.MultiheadAttention (one head, large inputs: a tiny sigma_min the Krylov space
    reaches late): at the default steps the reported kappa lies inside [kappa_lo, kappa_hi], and the
    bracket holds the dense reference of the module's own forward."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m = torch.nn.MultiheadAttention(32, 1, batch_first=True).double()
    x = 3 * torch.randn(2, 14, 32, generator=gen, dtype=torch.float64)
    from condinit.probe import JacobianOperator
    op = JacobianOperator(m, x, dtype=torch.float64)
    w = m.in_proj_weight.detach()

    def f(wq, wk, wv):
        params = {"in_proj_weight": torch.cat([wq, wk, wv]), "in_proj_bias": m.in_proj_bias.detach(),
                  "out_proj.weight": m.out_proj.weight.detach(), "out_proj.bias": m.out_proj.bias.detach()}
        return torch.func.functional_call(m, params, (x, x, x), {"need_weights": False})[0]
    # the operator's output is before the output projection (y = a W_o^T + b per token): undo it
    js = torch.func.jacrev(f, argnums=(0, 1, 2))(*w.chunk(3))
    J = torch.cat([j.reshape(-1, 32 * 32) for j in js], dim=1)
    J = torch.linalg.solve(torch.block_diag(*[m.out_proj.weight.detach()] * 28), J)
    s = torch.linalg.svdvals(J)
    smax, smin = float(s[0]), float(s[s > 1e-10 * s[0]][-1])
    est = lanczos_svd(op, seed=seed % 1000)
    assert est.sigma_max_lo <= smax <= est.sigma_max_hi
    assert est.sigma_min_lo <= smin <= est.sigma_min_hi, (est.sigma_min_lo, smin, est.sigma_min_hi)
    assert est.sigma_min_lo <= est.sigma_min <= est.sigma_min_hi, (est.sigma_min_lo, est.sigma_min, est.sigma_min_hi)
    if est.kappa is not None:
        assert est.kappa_lo <= est.kappa <= est.kappa_hi, (est.kappa_lo, est.kappa, est.kappa_hi)
        assert est.kappa_lo <= smax / smin <= est.kappa_hi


def test_float32_operator_floor_is_the_layers(seed):
    """A float32 operator's floor is computed from the layer's exact q, k, v (float64 from its exact
    float32 weights and input): the same as the float64 operator's, and under the float64 reference."""
    from condinit.probe import JacobianOperator

    g = torch.Generator().manual_seed(seed)
    m, x, _ = make("weights", True, N=10, D=32, H=4, Hkv=2, d=4, seed=int(torch.randint(2 ** 31, (1,), generator=g)))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.float().double())                     # float32 values: both operators see the same layer
    x = x.float().double()
    J = reference_jacobian(m, x, "weights", True)
    f64 = sigma_min_floor(JacobianOperator(m, x, wrt="weights", causal=True, dtype=torch.float64))
    f32 = sigma_min_floor(JacobianOperator(m, x, wrt="weights", causal=True, dtype=torch.float32))
    assert f64.value is not None, f64.reason
    smin, smax = _smallest_nonzero(J), float(torch.linalg.svdvals(J)[0])
    assert f32.value == pytest.approx(f64.value, rel=1e-9) and f32.value <= smin * (1 + 1e-9)
    # the ceiling from one float32 VJP launch, with the rounding the brackets allow for one product
    assert f32.ceiling + 512 * torch.finfo(torch.float32).eps * smax >= smin, (f32.ceiling, smin)


@pytest.mark.parametrize("N", [6, 20])
def test_floor_paths_agree(N, seed):
    """The two ways to bound the pieces (one eigensolver per piece on all rows; bisection on the Schur
    complement of the rows of full rank) agree to the bisection's tolerance."""
    import condinit.probe.floor as fl

    _, _, op = make("qkv", True, N=N, H=4, Hkv=1, d=4, seed=seed)
    q, k, v, eps = fl._primal64(op)
    s = (op.scale * (q[0] @ k[0, 0].T)).masked_fill(~op.allowed_keys(0, N), -math.inf)
    P = torch.softmax(s, -1)
    vk = (v[0, 0].unsqueeze(-1) * k[0, 0].unsqueeze(-2)).reshape(N, -1)
    M = op.scale * ((P @ vk).reshape(4, N, 4, 4) - (P @ v[0, 0]).unsqueeze(-1) * (P @ k[0, 0]).unsqueeze(-2))
    n, sig, _ = fl._rows(op, M, v[0, 0], eps)
    Ps, top = P.reshape(-1, N), int(n.max())
    E = (n < top) | (sig == 0)
    F_L = torch.cat([Ps[~E], torch.diag(sig[~E])], 1)
    a, b = fl._direct(Ps, n, sig, top, eps), fl._schur(Ps, n, sig, E, ~E, F_L, top, eps)
    assert a[0] == pytest.approx(b[0], rel=3e-3), (a[0], b[0])


def test_floor_cost_is_checked_on_the_rows_found(seed, monkeypatch):
    """The pieces' cost is checked again once the rows below full rank are known (a window can leave
    more of them than the shapes foretell): above the limit the floor is refused with its cost."""
    import condinit.probe.floor as fl

    _, _, op = make("qkv", True, N=12, H=4, Hkv=1, d=4, seed=seed)
    monkeypatch.setattr(fl, "floor_flops", lambda op: 0.0)
    monkeypatch.setattr(fl, "MAX_FLOOR_FLOPS", 1.0)
    f = sigma_min_floor(op)
    assert f.value is None and "not computed" in f.reason and "rows below full rank" in f.reason, f.reason
