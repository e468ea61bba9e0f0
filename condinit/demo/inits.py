"""The attention initializations ``condinit demo`` compares: four methods and two ablations.

Every model first gets the same *base* init (``base_init_``, timm / GPT-2 style): every weight
matrix, embedding, position embedding and class token from a normal distribution with std 0.02
truncated at two standard deviations, biases zero, LayerNorm ``(1, 0)``. With the global RNG seeded
identically, every init below therefore starts from bitwise the same non-attention weights; only
the attention projections differ.

``default``
    The base init itself: ``W_Q, W_K, W_V, W_O`` ~ truncated normal, std 0.02.

``mimetic`` (Trockman & Kolter, "Mimetic initialization of self-attention layers", ICML 2023)
    Row convention (scores ``X W_Q W_K^T X^T``, values ``X W_V W_O``). Per head ``h``, draw
    ``Z1 ~ N(0, 1/D)`` (``D x D``), take the SVD ``alpha1 Z1 + beta1 I = U S V^T`` and set
    ``W_Q^h = U_d S_d^{1/2}``, ``W_K^h = V_d S_d^{1/2}`` (first ``d = head_dim`` singular
    triplets), so ``W_Q^h W_K^h^T`` is the best rank-``d`` approximation of the target. For the
    value/output product, over the whole layer (as in the authors' code): ``alpha2 Z2 - beta2 I =
    U S V^T``, ``W_V = U S^{1/2}``, ``W_O = S^{1/2} V^T``, so ``W_V W_O`` equals the target exactly.
    Their defaults: ``alpha1 = beta1 = 0.7``, ``alpha2 = beta2 = 0.4``. Q/K/V/O biases zero.

``conditioned`` (this package, the paper's Algorithm 1)
    ``condinit.apply(model, seed=seed)``: per head Haar semi-orthogonal ``W_Q``, ``W_K``,
    rectangular-identity ``W_V``, zero Q/K/V biases; ``W_O`` keeps the base init.

``conditioned-qk`` (ablation: Q/K conditioned, V default)
    ``conditioned``, then ``W_V`` and its bias put back to the base init: the Q/K part of the
    method alone.

``conditioned-v0.1`` (ablation: conditioned, V = 0.1 I)
    ``condinit.apply(model, seed=seed, v_gain=0.1)``: the method with ``W_V = 0.1 I``, so the
    attention branch starts nearer the scale of the (std 0.02) residual stream.

``spectral`` (Saratchandran & Lucey, "Spectral conditioning of attention", NeurIPS 2025)
    A fixed correction ``lambda I`` added to each of ``W_Q``, ``W_K``, ``W_V``: the module computes
    with ``W + lambda I_{E x D}`` (``I_{E x D}``: rectangular identity of the projection's
    ``[E, D]`` ``nn.Linear`` matrix, so head ``h`` gets its own block of coordinates, as condinit's
    ``W_V``) while only ``W`` (base init) is trained; ``lambda I`` is a buffer, never updated and
    never weight-decayed. Done with ``torch.nn.utils.parametrize`` on ``in_proj_weight``.
    ``lambda = 10`` as in their paper. The correction is fixed for the whole run, so this is a
    reparametrization that starts from ``W_0 + lambda I``, not just a different starting point.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils import parametrize

from condinit._validate import SEED_MAX, check_choice, check_real, check_seed

__all__ = ["INITS", "INIT_LABELS", "base_init_", "mimetic_init_", "spectral_condition_", "SpectralShift", "initialize_"]

INITS = ("default", "mimetic", "conditioned", "spectral", "conditioned-qk", "conditioned-v0.1")
INIT_LABELS = {"default": "default (trunc. normal 0.02)", "mimetic": "mimetic", "conditioned": "conditioned",
               "spectral": "spectral (W + 10 I)", "conditioned-qk": "Q/K conditioned, V default",
               "conditioned-v0.1": "conditioned, V = 0.1 I"}
BASE_STD = 0.02


def _trunc_normal_(t: torch.Tensor, std: float = BASE_STD) -> None:
    nn.init.trunc_normal_(t, mean=0.0, std=std, a=-2 * std, b=2 * std)


@torch.no_grad()
def base_init_(model: nn.Module) -> nn.Module:
    """Truncated-normal(0.02) weights, zero biases, LayerNorm (1, 0); draws from the global RNG."""
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(_owner(model, name), nn.LayerNorm):
            p.fill_(1.0 if leaf == "weight" else 0.0)
        elif "bias" in leaf:
            p.zero_()
        else:
            _trunc_normal_(p)
    return model


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    mod_name = param_name.rsplit(".", 1)[0] if "." in param_name else ""
    return model.get_submodule(mod_name)


def _check_mha(m: nn.Module) -> None:
    if not isinstance(m, nn.MultiheadAttention) or not m._qkv_same_embed_dim:
        raise TypeError("expected an nn.MultiheadAttention with a fused in_proj_weight (kdim == vdim == embed_dim)")


@torch.no_grad()
def mimetic_init_(mha: nn.MultiheadAttention, *, alpha1: float = 0.7, beta1: float = 0.7, alpha2: float = 0.4,
                  beta2: float = 0.4, generator: torch.Generator | None = None) -> nn.MultiheadAttention:
    """Mimetic init of one ``nn.MultiheadAttention`` in place (see module doc); float64 SVDs."""
    _check_mha(mha)
    alpha1, beta1, alpha2, beta2 = (check_real(name, v) for name, v in (("alpha1", alpha1), ("beta1", beta1),
                                                                       ("alpha2", alpha2), ("beta2", beta2)))
    e, h, d = mha.embed_dim, mha.num_heads, mha.head_dim
    w = mha.in_proj_weight                     # [3E, E] = [W_Q; W_K; W_V] in [out, in] layout
    eye = torch.eye(e, dtype=torch.float64)
    for head in range(h):
        z1 = torch.randn(e, e, dtype=torch.float64, generator=generator) / math.sqrt(e)
        u, s, vh = torch.linalg.svd(alpha1 * z1 + beta1 * eye)
        root = s[:d].sqrt()
        rows = slice(head * d, (head + 1) * d)
        # nn.Linear stores W^T: the [d, E] row block of head h is (U_d S_d^1/2)^T for Q, (V_d S_d^1/2)^T for K.
        w[rows].copy_((u[:, :d] * root).T)
        w[e:2 * e][rows].copy_(root[:, None] * vh[:d])
    z2 = torch.randn(e, e, dtype=torch.float64, generator=generator) / math.sqrt(e)
    u, s, vh = torch.linalg.svd(alpha2 * z2 - beta2 * eye)
    root = s.sqrt()
    w[2 * e:].copy_((u * root).T)                    # W_V (row convention U S^1/2)
    mha.out_proj.weight.copy_((root[:, None] * vh).T)  # W_O (row convention S^1/2 V^T)
    if mha.in_proj_bias is not None:
        mha.in_proj_bias.zero_()
    if mha.out_proj.bias is not None:
        mha.out_proj.bias.zero_()
    return mha


class SpectralShift(nn.Module):
    """Parametrization ``W -> W + lambda * [I; I; I]`` of a fused ``[3E, D]`` in_proj_weight."""

    def __init__(self, rows: int, cols: int, lam: float, parts: int = 3):
        super().__init__()
        self.lam = float(lam)
        eye = torch.eye(rows // parts, cols)
        self.register_buffer("shift", self.lam * eye.repeat(parts, 1))

    def forward(self, w):
        return w + self.shift.to(w.dtype)


def spectral_condition_(mha: nn.MultiheadAttention, *, lam: float = 10.0) -> nn.MultiheadAttention:
    """Add the fixed ``lam * I`` correction to W_Q, W_K, W_V of one MHA (see module doc)."""
    _check_mha(mha)
    lam = check_real("lam", lam)
    w = mha.in_proj_weight
    parametrize.register_parametrization(mha, "in_proj_weight", SpectralShift(w.shape[0], w.shape[1], lam))
    return mha


def initialize_(model: nn.Module, init: str, *, seed: int) -> nn.Module:
    """Base init, then ``init`` on every ``nn.MultiheadAttention``; seeds the global RNG with ``seed``
    (in ``[0, 2**64)``).

    The base init's draws come first, so the non-attention weights are identical across inits.
    """
    check_choice("init", init, INITS)
    check_seed("seed", seed)
    torch.manual_seed(seed)
    base_init_(model)
    mhas = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
    if init == "mimetic":
        g = torch.Generator().manual_seed((seed + 7919) % SEED_MAX)
        for m in mhas:
            mimetic_init_(m, generator=g)
    elif init in ("conditioned", "conditioned-qk", "conditioned-v0.1"):
        import condinit
        saved_v = [(m.in_proj_weight[2 * m.embed_dim:].clone(), m.in_proj_bias[2 * m.embed_dim:].clone()
                    if m.in_proj_bias is not None else None) for m in mhas]
        condinit.apply(model, seed=seed, v_gain=0.1 if init == "conditioned-v0.1" else 1.0, report=False)
        if init == "conditioned-qk":
            with torch.no_grad():
                for m, (w_v, b_v) in zip(mhas, saved_v):
                    m.in_proj_weight[2 * m.embed_dim:].copy_(w_v)
                    if b_v is not None:
                        m.in_proj_bias[2 * m.embed_dim:].copy_(b_v)
    elif init == "spectral":
        for m in mhas:
            spectral_condition_(m, lam=10.0)
    return model
