"""torchtitan's attention (``torchtitan.models.common.attention.GQAttention``): Llama 3 and the
other decoders built on it.

``GQAttention`` holds its projections in ``qkv_linear``, one of two classes:

* ``FusedQKVLinear`` (what torchtitan's Llama 3 configs build): one ``wqkv`` linear whose output
  ``forward`` views as ``[H_kv, H/H_kv + 2, d]`` (``qkv.view(bs, seqlen, -1, r_dim, head_dim)``,
  then ``torch.split(t, [heads_per_kv, 1, 1], dim=-2)``): per key/value group its query heads, its
  key head, its value head (``layout="per_group"``). Tensor parallel shards ``wqkv`` row-wise
  (``ColwiseParallel``) in whole groups; FSDP2 shards it along rows as well: both are ``Shard(0)``
  DTensors, which :func:`condinit.apply` writes shard by shard.
* ``QKVLinear``: separate ``wq`` / ``wk`` / ``wv`` linears.

Either way the state dict holds torchtitan's stock keys ``...attention.qkv_linear.wq.weight``,
``wk``, ``wv`` (``FusedQKVLinear`` splits ``wqkv`` on save and merges on load), which is what its
checkpoint loader reads (see :mod:`condinit.models.engines.dcp`). torchtitan is never imported here:
the adapter reads the module's attributes (``n_heads``, ``n_kv_heads``, ``head_dim``).
"""
from __future__ import annotations

from torch import nn

from condinit.models.spec import AttentionSpec, UnsupportedAttention

GQA_ATTENTION = "torchtitan.models.common.attention.GQAttention"


def gqa_spec(m: nn.Module) -> AttentionSpec:
    H, Hkv, d = m.n_heads, m.n_kv_heads, m.head_dim
    qkv = m.qkv_linear
    kind = type(qkv).__name__
    if kind == "FusedQKVLinear":
        return AttentionSpec.from_fused(qkv.wqkv.weight, num_heads=H, num_kv_heads=Hkv, head_dim=d,
                                        bias=qkv.wqkv.bias, layout="per_group")
    if kind == "QKVLinear":
        return AttentionSpec.from_linears(qkv.wq, qkv.wk, qkv.wv, num_heads=H, num_kv_heads=Hkv, head_dim=d)
    raise UnsupportedAttention(f"torchtitan GQAttention with qkv_linear of class {kind}: its Q/K/V layout is not "
                               f"known (FusedQKVLinear and QKVLinear are)")
