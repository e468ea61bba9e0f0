"""The adapter for timm's ``Attention`` (ViT, DeiT, ...): a fused ``qkv`` Linear in q, k, v order.

Keyed by the class's dotted name, so timm is never imported by condinit.
"""
from __future__ import annotations

from torch import nn

from condinit.models.registry import register_adapter
from condinit.models.spec import AttentionSpec


def _timm_attention(m: nn.Module) -> AttentionSpec:
    """timm ``Attention``: fused ``qkv`` Linear ``[3 H d, D]`` in q, k, v order."""
    return AttentionSpec.from_fused(m.qkv.weight, num_heads=m.num_heads, head_dim=m.head_dim, bias=m.qkv.bias)


register_adapter("timm.layers.attention.Attention", _timm_attention, name="timm.Attention")
