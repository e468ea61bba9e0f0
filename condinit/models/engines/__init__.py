"""Training engines: torchtitan, and torch.distributed.checkpoint output.

Importing this package registers the engines' attention adapters by dotted class name
(:func:`condinit.models.register_adapter`), so no engine is imported until a model of it is seen.

* :mod:`.torchtitan`: ``GQAttention`` (fused ``wqkv`` per key/value group, or ``wq/wk/wv``);
  FSDP2 and tensor-parallel DTensors are written shard by shard by :func:`condinit.apply`.
* :mod:`.megatron`: Megatron-Core ``SelfAttention`` (fused ``linear_qkv`` per query group); each
  tensor-parallel rank's plain-tensor row partition is written in place by :func:`condinit.apply`.
* :mod:`.deepspeed`: ZeRO-3 partitioned parameters (a model built under ``deepspeed.zero.Init``):
  :func:`condinit.apply` finds the layers from their full shapes and writes one gathered
  attention module at a time; no adapter, DeepSpeed is imported only once such a parameter is seen.
* :mod:`.dcp`: a model-only torch.distributed.checkpoint directory (:func:`.dcp.write_dcp`),
  torchtitan's seed checkpoint.
"""
from condinit.models.registry import register_adapter

from . import megatron as _megatron
from . import torchtitan as _torchtitan

register_adapter(_torchtitan.GQA_ATTENTION, _torchtitan.gqa_spec, name="torchtitan.GQAttention")
register_adapter(_megatron.SELF_ATTENTION, _megatron.self_attention_spec, name="megatron.SelfAttention")
