"""Estimators (Lanczos, power, Hutchinson) and the condition-number bound against float64 dense references."""
import math

import pytest
import torch

from condinit.probe import (condition_number, condition_number_bound, frobenius_hutchinson, lanczos_svd,
                            power_sigma_max)
from condinit.probe.bound import softmax_jacobian_kappa

from test_probe_operator import F64, _adapter, make, reference_jacobian  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


def complement_svdvals(op, J):
    """Singular values of P_out J P_in (the dense reference on the stated subspace) and r."""
    Pin = op.project_input(torch.eye(op.n, dtype=F64))
    Pout = op.project_output(torch.eye(op.m, dtype=F64))
    s = torch.linalg.svdvals(Pout @ J @ Pin)
    kin, kout = op.null_dims
    return s, min(op.n - kin, op.m - kout)


# full-rank configurations on the complement (N > head_dim so no data-dependent nulls)
FULL_RANK = [("weights", False, 2, 2, 8), ("weights", True, 2, 2, 8), ("weights", False, 2, 1, 4),
             ("input", False, 2, 2, 8), ("input", True, 2, 2, 8), ("input", False, 2, 1, 4),
             ("qkv", False, 2, 2, 8), ("qkv", True, 2, 2, 8), ("qkv", False, 2, 1, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("wrt,causal,H,Hkv,d", FULL_RANK)
def test_lanczos_power_frobenius_against_dense(wrt, causal, H, Hkv, d):
    m, x, op = make(wrt, causal, N=8, D=16, H=H, Hkv=Hkv, d=d, seed=11)
    J = reference_jacobian(m, x, wrt, causal)
    s, r = complement_svdvals(op, J)
    smax, smin = float(s[0]), float(s[r - 1])
    assert smin > 1e-8 * smax, "test configuration must be full rank on the complement"
    est = lanczos_svd(op, steps=r, seed=3)
    assert est.sigma_max == pytest.approx(smax, rel=1e-3)
    assert est.sigma_min == pytest.approx(smin, rel=1e-2)
    assert est.kappa == pytest.approx(smax / smin, rel=1e-2)
    assert est.converged and not est.rank_deficient
    assert f"r = min(m', n') = {r}" in est.subspace
    # a few steps: sigma_max already accurate, sigma_min from above
    few = lanczos_svd(op, steps=20, seed=3)
    assert few.sigma_max == pytest.approx(smax, rel=1e-3)
    assert few.sigma_min >= smin * (1 - 1e-9)
    pw = power_sigma_max(op, iters=300, seed=1, tol=1e-10)
    assert pw.sigma_max == pytest.approx(smax, rel=1e-3) and pw.sigma_min is None
    fro_exact = float(torch.linalg.matrix_norm(J))
    fe = frobenius_hutchinson(op, samples=48, seed=5, probes_per_launch=16, confidence=0.99)
    assert fe.ci_low <= fro_exact <= fe.ci_high
    assert fe.ci_low <= fe.frobenius <= fe.ci_high and fe.samples == 48


@pytest.mark.parametrize("wrt,causal", [("qkv", True), ("weights", False), ("input", True)])
def test_mask_nulls_do_not_make_it_rank_deficient(wrt, causal):
    """GQA with N <= head_dim (and causal GQA's early rows) has null directions beyond the known ones:
    the estimate stays in range(J), so sigma_min is J's smallest nonzero singular value."""
    m, x, op = make(wrt, causal, N=8, D=16, H=2, Hkv=1, d=8, seed=2)
    s = torch.linalg.svdvals(reference_jacobian(m, x, wrt, causal))
    nonzero = s[s > 1e-10 * s[0]]
    assert len(nonzero) < min(op.m, op.n), "test configuration must have null directions"
    est = lanczos_svd(op, steps=200, seed=0)
    assert est.sigma_max == pytest.approx(float(s[0]), rel=1e-6)
    assert est.sigma_min == pytest.approx(float(nonzero[-1]), rel=1e-6)
    assert not est.rank_deficient and est.kappa == pytest.approx(float(s[0] / nonzero[-1]), rel=1e-6)


def test_deterministic_and_private_rng():
    m, x, op = make("weights", True, seed=4)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = lanczos_svd(op, steps=10, seed=7)
    b = lanczos_svd(op, steps=10, seed=7)
    c = lanczos_svd(op, steps=10, seed=8)
    f1 = frobenius_hutchinson(op, samples=8, seed=1)
    f2 = frobenius_hutchinson(op, samples=8, seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    def timeless(e):
        return {k: v for k, v in e.to_dict().items() if k != "wall_s"}
    assert timeless(a) == timeless(b) and timeless(a) != timeless(c)
    assert f1.to_dict() == f2.to_dict()
    both = lanczos_svd([op, op], steps=10, seed=7)
    assert [timeless(e) for e in both] == [timeless(a), timeless(a)]


def test_estimator_bad_input():
    m, x, op = make("qkv", False)
    with pytest.raises(ValueError, match="steps"):
        lanczos_svd(op, steps=0)
    with pytest.raises(ValueError, match="samples"):
        frobenius_hutchinson(op, samples=1)
    with pytest.raises(ValueError, match="seed"):
        power_sigma_max(op, seed=-1)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\)"):
        lanczos_svd(op, steps=2, seed=2 ** 64)
    with pytest.raises(TypeError, match="steps"):
        lanczos_svd(op, steps=True)
    with pytest.raises(ValueError, match="confidence"):
        frobenius_hutchinson(op, confidence=1.0)
    assert lanczos_svd(op, steps=2, seed=2 ** 64 - 1).seed == 2 ** 64 - 1     # the whole seed range
    with pytest.raises(TypeError, match="JacobianOperator"):
        lanczos_svd("op")
    with pytest.raises(ValueError, match="method"):
        condition_number(op, method="eig")


def test_softmax_jacobian_kappa_matches_eigvalsh():
    g = torch.Generator().manual_seed(0)
    S = torch.randn(2, 7, 7, generator=g, dtype=F64) * 2
    S = S.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), -math.inf)
    P = torch.softmax(S, -1)
    ref = []
    for b in range(2):
        big, small = 0.0, math.inf
        for i in range(1, 7):                        # row 0 attends one key: Lambda = 0, skipped
            p = P[b, i, : i + 1]
            ev = torch.linalg.eigvalsh(torch.diag(p) - torch.outer(p, p))[1:]   # drop the 0 (Lambda 1 = 0)
            big, small = max(big, float(ev.max())), min(small, float(ev.min()))
        ref.append(big / small)
    torch.testing.assert_close(softmax_jacobian_kappa(P), torch.tensor(ref, dtype=F64), rtol=1e-9, atol=0)


def test_condition_number_bound_terms():
    m, x, op = make("weights", False, B=2, N=8, D=16, H=2, Hkv=2, d=8, seed=9)
    res = condition_number_bound(m, x, steps=op.n, seed=0)
    kX = max(float(torch.linalg.cond(x[b])) for b in range(2))
    assert res.kappa_X == pytest.approx(kX, rel=1e-9)
    wq = m.q_proj.weight.detach().reshape(2, 8, 16)
    assert res.kappa_WQ == pytest.approx(max(float(torch.linalg.cond(w)) for w in wq), rel=1e-9)
    assert len(res.per_head) == 2 and len(res.per_head[0]) == 2
    assert res.bound == pytest.approx(max(v for row in res.per_head for v in row))
    assert res.measured is not None and res.measured_kappa == res.measured.kappa
    assert res.bound > 1.0 and res.to_dict()["measured"]["method"] == "golub-kahan-lanczos"


def test_cli_probe_bad_input(tmp_path, capsys):
    from condinit.cli import main

    ckpt = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, ckpt)
    assert main(["probe", str(ckpt), "--preset", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
    assert main(["probe", str(ckpt), "--preset", "tiny-llama", "--steps", "0"]) == 2
    assert "--steps must be an int in [1, inf], got 0" in capsys.readouterr().err
    assert main(["probe", str(ckpt), "--preset", "tiny-llama", "--json", str(tmp_path / "o.json")]) == 2
    assert "not safetensors" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()
    assert main(["probe", str(ckpt), "--preset", "tiny-llama", "--plot", str(tmp_path / "no" / "p.png")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("wrt", ["weights", "qkv", "input"])
def test_dense_size_precheck_never_exceeds_the_matrix_built(wrt):
    """dense_preferred decides from the shapes first: its lower bound on the dense matrix's entries
    is at most the entries of the matrix each key/value block (or the whole J) would build, whichever
    side the run orients, for wide and tall layers."""
    from condinit.probe.dense_svd import _dense_shape, _least_entries
    from condinit.probe.krylov import _Effective

    for B, N, D, H, Hkv in ((1, 5, 32, 4, 2), (1, 12, 8, 2, 1), (2, 3, 6, 4, 4), (1, 20, 16, 4, 2)):
        _, _, op = make(wrt, True, B=B, N=N, D=D, H=H, Hkv=Hkv, d=4, seed=N)
        for blocks in (True, False):
            parts = op.kv_blocks() if blocks else [op]
            for part in parts:
                q, p = _dense_shape(_Effective(part))
                assert _least_entries(op, len(parts)) <= q * p, (wrt, B, N, D, H, Hkv, blocks)


def test_exact_in_reach_follows_dense():
    """A forced dense SVD is exact whatever its cost; without it, a step budget short of r is not."""
    from condinit.probe.estimators import exact_in_reach
    from condinit.probe.krylov import _Effective

    _, _, op = make("weights", True, N=12, D=16, H=2, Hkv=2, d=4, seed=3)
    assert _Effective(op).r > 2
    assert exact_in_reach(op, steps=2, dense=True)
    assert not exact_in_reach(op, steps=2, dense=False)
    assert exact_in_reach(op, steps=_Effective(op).r, dense=False)
