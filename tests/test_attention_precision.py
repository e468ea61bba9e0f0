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
