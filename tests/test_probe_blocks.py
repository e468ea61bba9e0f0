"""The key/value blocks of an attention Jacobian: each block is the diagonal block of the dense ``J``
(jacrev of a naive float64 layer), the rest of ``J`` is zero, and the combined estimates bracket the
singular values of the whole."""
import pytest
import torch

from condinit.probe import condition_number, lanczos_svd

from test_probe_operator import F64, _adapter, make, reference_jacobian  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


def _group_index(op, g, wrt):
    """Row and column indices of group ``g`` in ``J`` ([B, H, N, d] outputs; the inputs by ``wrt``)."""
    B, H, Hkv, N, d, D = op.B, op.H, op.Hkv, op.N, op.d, op.D
    G = H // Hkv
    rows = torch.arange(B * H * N * d).reshape(B, H, N, d)[:, g * G:(g + 1) * G].reshape(-1)
    if wrt == "weights":
        q = torch.arange(H * d * D).reshape(H * d, D)[g * G * d:(g + 1) * G * d].reshape(-1)
        k = H * d * D + torch.arange(Hkv * d * D).reshape(Hkv * d, D)[g * d:(g + 1) * d].reshape(-1)
        v = k + Hkv * d * D
    else:
        q = torch.arange(B * H * N * d).reshape(B, H, N, d)[:, g * G:(g + 1) * G].reshape(-1)
        k = B * H * N * d + torch.arange(B * Hkv * N * d).reshape(B, Hkv, N, d)[:, g].reshape(-1)
        v = k + B * Hkv * N * d
    return rows, torch.cat([q, k, v])


@pytest.mark.parametrize("wrt", ["weights", "qkv"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hk", [(4, 2), (3, 3), (4, 1)])
def test_blocks_are_the_diagonal_blocks(wrt, causal, hk, seed):
    H, Hkv = hk
    m, x, op = make(wrt, causal, B=2 if wrt == "qkv" else 1, N=5, D=7, H=H, Hkv=Hkv, d=3, seed=seed % 2 ** 31)
    J = reference_jacobian(m, x, wrt, causal)
    blocks = op.kv_blocks()
    assert len(blocks) == Hkv and (op.kv_blocks_exact is None) == (Hkv > 1)
    covered = torch.zeros_like(J, dtype=torch.bool)
    for g, blk in enumerate(blocks):
        r, c = _group_index(op, g, wrt)
        Jg = J[r][:, c]
        assert blk.shape == tuple(Jg.shape)
        torch.testing.assert_close(blk.dense(), Jg, rtol=1e-10, atol=1e-12 * float(J.abs().max()))
        covered[r.unsqueeze(1), c.unsqueeze(0)] = True
    if Hkv > 1:
        assert float(J[~covered].abs().max()) <= 1e-14 * float(J.abs().max())   # nothing off the blocks
    # the blocks' known nulls add up to the whole operator's
    assert tuple(map(sum, zip(*(b.null_dims for b in blocks)))) == op.null_dims


def test_blocks_refused_where_the_groups_couple():
    _, _, op = make("input", False, H=4, Hkv=2, d=3, D=7, N=5)
    assert "wrt='input'" in op.kv_blocks_exact and op.kv_blocks() == [op]
    _, _, op = make("weights", True, H=2, Hkv=1, d=3, D=7, N=5)
    assert op.kv_blocks_exact == "one key/value group"


@pytest.mark.slow
@pytest.mark.parametrize("wrt", ["weights", "qkv"])
def test_combined_brackets_hold_the_whole_spectrum(wrt, seed):
    """Per block, Lanczos to the end: the combined sigma_max / sigma_min / kappa equal the dense J's (over
    its nonzero singular values) to 1e-8, as without blocks; at the defaults the combined brackets hold
    them."""
    g = torch.Generator().manual_seed(seed)
    hits = 0
    for i in range(6):
        causal = bool(i % 2)
        H, Hkv = ((4, 2), (2, 2), (6, 3))[i % 3]
        s0 = int(torch.randint(2 ** 31, (1,), generator=g))
        m, x, op = make(wrt, causal, B=1, N=6, D=8, H=H, Hkv=Hkv, d=3, seed=s0)
        s = torch.linalg.svdvals(reference_jacobian(m, x, wrt, causal))
        nz = s[s > 1e-10 * s[0]]
        what = f"case {i}: H={H} Hkv={Hkv} causal={causal} seed={s0}"
        full = lanczos_svd(op, steps=10_000, tol=0.0, seed=i, blocks=True)
        assert full.exact and full.iterations > 0, (what, full.notes)
        assert abs(full.sigma_max - float(s[0])) <= 1e-8 * float(s[0]), what
        assert abs(full.sigma_min - float(nz[-1])) <= 1e-8 * float(nz[-1]), what
        assert abs(full.kappa - float(s[0] / nz[-1])) <= 1e-8 * float(s[0] / nz[-1]), what
        assert full.bracket.startswith("J = diag(J_1, ..., J_") and "block diagonal" in full.subspace
        one = lanczos_svd(op, steps=10_000, tol=0.0, seed=i, blocks=False)
        assert abs(one.kappa - full.kappa) <= 1e-8 * full.kappa, what
        for est in (lanczos_svd(op, seed=i, blocks=True), condition_number(op, seed=i, blocks=True)):
            assert est.sigma_max_lo <= float(s[0]) <= est.sigma_max_hi, (what, est.method)
            assert est.sigma_min_lo <= float(nz[-1]) <= est.sigma_min_hi, (what, est.method)
            assert est.kappa_lo <= float(s[0] / nz[-1]) <= est.kappa_hi, (what, est.method)
            hits += est.converged
        dense = condition_number(op, method="dense")         # blocks="auto": by blocks
        assert dense.method == "dense-svd" and dense.bracket.startswith("J = diag(J_1, ..., J_"), what
        assert abs(dense.kappa - full.kappa) <= 1e-8 * full.kappa, what
    assert hits >= 6      # most default runs end within tol


def test_blocks_auto_takes_them_for_the_dense_path_only():
    _, _, op = make("weights", True, H=4, Hkv=2, d=3, D=7, N=5)
    assert condition_number(op).bracket.startswith("J = diag(J_1, ..., J_2)")          # dense per block
    assert not lanczos_svd(op).bracket.startswith("J = diag")                          # Lanczos on J whole
    assert lanczos_svd(op, steps=10_000).bracket.startswith("J = diag(J_1, ..., J_2)")  # each block to the end
    assert not lanczos_svd(op, steps=10).bracket.startswith("J = diag")
    assert lanczos_svd(op, blocks=True).bracket.startswith("J = diag(J_1, ..., J_2)")
    assert not condition_number(op, blocks=False).bracket.startswith("J = diag")
    with pytest.raises(ValueError, match="blocks must be False, True or 'auto'"):
        lanczos_svd(op, blocks="yes")
