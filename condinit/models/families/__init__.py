"""The built-in adapters, registered on import (:func:`condinit.models.register_adapter`).

``torch.nn.MultiheadAttention`` (fused ``in_proj_weight``, or separate ``q/k/v_proj_weight`` with
one shared bias; inside ``nn.Transformer*`` layers too), timm ``Attention`` (fused ``qkv``), GPT-2
and its copies (``Conv1D c_attn``, stored transposed; cross-attention ``q_attn`` + ``c_attn`` =
``[K; V]``), GPT-NeoX, GPT-NeoX-Japanese, BLOOM, Persimmon (``query_key_value``, ``[H, 3, d]``),
Falcon (``[H, 3, d]``, multi-query ``[Q; K; V]``, or the new decoder architecture's ``[H_kv, H/H_kv
+ 2, d]`` groups), GPTBigCode (multi-query ``[Q; K; V]``, multi-head ``[H, 3d]``; cross-attention
refused), Phi-3 (``qkv_proj``, ``[Q; K; V]`` with GQA), DeBERTa (``in_proj`` ``[H, 3, d]`` with
separate ``q_bias`` / ``v_bias``), CodeGen (``qkv_proj`` in 4 groups ordered Q, V, K), XLNet
(``[D, H, d]`` parameters, ``matrix_shape``), JetMoE (query experts ``[E, H_kv d, D]`` plus
``kv_proj``), SqueezeBERT (grouped kernel-size-1 ``Conv1d``, ``in_groups``; a grouped convolution
whose heads span several groups is refused), AIMv2's attention-pooling head (a learned query,
``fixed``). Multi-head latent attention (DeepSeek-V2/V3 and its copies) by its factors, on request
(:mod:`condinit.models.families.mla`). See ``docs/design.md``, "Model layouts".
"""
# registration order: torch, then transformers, then timm, then multi-head latent attention (mla)
from . import torch_nn  # noqa: F401
from . import hf  # noqa: F401
from . import timm  # noqa: F401
from . import mla  # noqa: F401
