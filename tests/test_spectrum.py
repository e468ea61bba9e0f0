"""spectrum() against float64 svdvals, and recondition_(): cond <= max_cond, singular vectors and
sigma_max kept, blocks within the bound untouched, bad input rejected before any write."""
import math

import pytest
import torch

from condinit.init import recondition_, spectrum
from helpers import assert_refused


def _stack(shape, rng, spread=None):
    W = torch.randn(*shape, generator=rng, dtype=torch.float64)
    if spread is not None:  # make the blocks' condition numbers ~ spread
        m, n = shape[-2:]
        k = min(m, n)
        s = torch.logspace(0, -math.log10(spread), k, dtype=torch.float64)
        U, _, Vh = torch.linalg.svd(W, full_matrices=False)
        W = U @ torch.diag_embed(s.expand(*shape[:-2], k)) @ Vh
    return W.float()


@pytest.mark.parametrize("method", ["auto", "svd", "gram"])
@pytest.mark.parametrize("shape", [(17, 123), (123, 17), (3, 33, 33), (4, 64, 256), (2, 3, 5, 40), (1, 1)])
def test_spectrum_matches_float64_svdvals(method, shape, rng):
    W = _stack(shape, rng)
    sp = spectrum(W, method=method)
    sv = torch.linalg.svdvals(W.double())
    assert sp.sigma_max.shape == shape[:-2] and sp.sigma_max.dtype == torch.float64
    torch.testing.assert_close(sp.sigma_max, sv[..., 0], rtol=1e-10, atol=0)
    torch.testing.assert_close(sp.sigma_min, sv[..., -1], rtol=1e-7, atol=0)
    torch.testing.assert_close(sp.cond, sv[..., 0] / sv[..., -1], rtol=1e-7, atol=0)


def test_spectrum_gram_redoes_ill_conditioned_blocks(rng):
    W = _stack((3, 8, 64), rng, spread=1e7)
    sp = spectrum(W, method="gram")
    sv = torch.linalg.svdvals(W.double())
    torch.testing.assert_close(sp.sigma_min, sv[..., -1], rtol=1e-7, atol=0)
    Z = torch.randn(2, 8, 64, generator=rng)
    Z[:, -1] = 0
    assert bool(torch.isinf(spectrum(Z).cond).all())


@pytest.mark.parametrize("method", ["svd", "gram", "auto"])
@pytest.mark.parametrize("shape", [(6, 16, 80), (5, 80, 16), (4, 24, 24)])
def test_recondition_clamps(method, shape, rng):
    W = _stack(shape, rng, spread=1e3)
    W[1] = _stack(shape[1:], rng, spread=2.0)        # already within the bound: must stay bit-identical
    before = W.clone()
    U, S, Vh = torch.linalg.svd(before.double(), full_matrices=False)
    assert recondition_(W, max_cond=10.0, method=method) is W
    assert torch.equal(W[1], before[1])
    sp = spectrum(W)
    assert bool((sp.cond <= 10.0 * (1 + 1e-5)).all())
    torch.testing.assert_close(sp.sigma_max, S[:, 0], rtol=1e-5, atol=0)
    # singular vectors kept: U^T W V is diagonal with the clamped values
    D = U.transpose(1, 2) @ W.double() @ Vh.transpose(1, 2)
    want = torch.maximum(S, S[:, :1] / 10.0)
    torch.testing.assert_close(D, torch.diag_embed(want), atol=1e-5 * S[:, :1].max().item(), rtol=0)


def test_recondition_per_head_and_dtypes(rng):
    w = _stack((48, 40), rng, spread=1e4)
    heads = w.clone().view(3, 16, 40)
    recondition_(heads, max_cond=5.0)
    recondition_(w, max_cond=5.0, head_dim=16)
    assert torch.equal(w.view(3, 16, 40), heads)
    b = _stack((2, 16, 40), rng, spread=1e3).bfloat16()
    recondition_(b, max_cond=4.0, method="gram")
    assert b.dtype == torch.bfloat16
    assert bool((spectrum(b).cond <= 4.0 * (1 + 0.1)).all())     # bf16 rounding of the result
    t = _stack((40, 24), rng, spread=1e3).t()                      # non-contiguous 2-D weight
    ref = t.contiguous().clone()
    recondition_(t, max_cond=3.0)
    recondition_(ref, max_cond=3.0)
    assert t.stride() == (1, 24) and torch.equal(t, ref)


def test_recondition_rank_deficient_with_gram(rng):
    W = torch.randn(2, 8, 64, generator=rng)
    W[0, -1] = W[0, 0]                               # sigma_min = 0: the Gram route cannot, SVD can
    recondition_(W, max_cond=20.0, method="gram")
    assert bool((spectrum(W).cond <= 20.0 * (1 + 1e-5)).all())


def test_recondition_bad_input_untouched(rng):
    w = torch.randn(4, 8, 16, generator=rng)
    assert_refused(lambda: recondition_(w, max_cond=0.5), [w], ValueError, "max_cond")
    assert_refused(lambda: recondition_(w, max_cond=float("nan")), [w], ValueError, "max_cond")
    # a finite bound: no clamping is no call
    assert_refused(lambda: recondition_(w, max_cond=float("inf")), [w], ValueError, "max_cond")
    assert_refused(lambda: recondition_(w, max_cond=True), [w], TypeError, "max_cond")
    assert_refused(lambda: recondition_(w, max_cond=2.0, method="eig"), [w], ValueError, "method")
    assert_refused(lambda: spectrum(w, method="eig"), [w], ValueError, "method")
    assert_refused(lambda: recondition_(w[0], max_cond=2.0, head_dim=True), [w], TypeError, "head_dim")
    assert_refused(lambda: recondition_(w, max_cond=2.0, head_dim=4), [w], ValueError, "head_dim")
    w2 = torch.randn(12, 16, generator=rng)
    assert_refused(lambda: recondition_(w2, max_cond=2.0, head_dim=5), [w2], ValueError, "head_dim")
    bad = w.clone()
    bad[2, 3, 4] = float("inf")
    assert_refused(lambda: recondition_(bad, max_cond=2.0), [bad], ValueError, "finite")
    for t, exc in ((torch.ones(4, 4, dtype=torch.int64), TypeError),
                   (torch.ones(4, 4, dtype=torch.complex64), TypeError), (torch.ones(4), ValueError)):
        assert_refused(lambda: recondition_(t, max_cond=2.0), [t], exc, "stack_or_weight")
    with pytest.raises(ValueError, match="zero-size"):
        spectrum(torch.ones(0, 3, 3))
    m = torch.empty(3, 4, 4, device="meta")
    assert recondition_(m, max_cond=2.0) is m
