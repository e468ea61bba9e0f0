"""The adapter for ``torch.nn.MultiheadAttention`` (also inside ``nn.Transformer*`` layers).

A fused ``in_proj_weight`` ``[Q; K; V]``, or separate ``q/k/v_proj_weight`` (``kdim`` / ``vdim``
different from ``embed_dim``) with one shared ``[3E]`` bias.
"""
from __future__ import annotations

from torch import nn

from condinit.models.registry import register_adapter
from condinit.models.spec import AttentionSpec, Projection


def _mha_spec(m: nn.MultiheadAttention) -> AttentionSpec:
    if m._qkv_same_embed_dim:
        return AttentionSpec.from_fused(m.in_proj_weight, num_heads=m.num_heads, bias=m.in_proj_bias)
    e = m.embed_dim
    b = m.in_proj_bias
    # Separate weights (kdim/vdim differ from embed_dim) still share one [3E] in_proj_bias.
    return AttentionSpec(Projection(m.q_proj_weight, 0, e, bias=b, bias_start=0),
                         Projection(m.k_proj_weight, 0, e, bias=b, bias_start=e),
                         Projection(m.v_proj_weight, 0, e, bias=b, bias_start=2 * e),
                         m.num_heads, m.num_heads, m.head_dim)


register_adapter(nn.MultiheadAttention, _mha_spec, name="torch.MultiheadAttention")
