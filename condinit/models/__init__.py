"""Conditioned initialization of real models: attention adapters, ``apply``, deferred (meta) and
sharded (FSDP2 / DTensor) init, presets and safetensors checkpoints.

    import condinit
    report = condinit.apply(model, seed=0)      # every attention layer, in place
    print(report)                               # per-layer singular values before / after

See :mod:`condinit.models.apply` for what is done and how layers are numbered,
:mod:`condinit.models.adapters` for adding an attention class (``register_adapter``),
:mod:`condinit.models.deferred` for meta-device models and :mod:`condinit.models.sharded` for DTensors.
Importing this package imports neither transformers nor timm and never initializes CUDA.
"""
from .adapters import (AttentionAdapter, AttentionSpec, Projection, get_adapter, register_adapter,
                       registered_adapters, unregister_adapter)
from .apply import V_MODES, ApplyReport, AttentionLayer, BlockStats, LayerReport, apply, find_attention
from .deferred import has_meta, materialize_

__all__ = ["apply", "find_attention", "register_adapter", "unregister_adapter", "get_adapter", "registered_adapters",
           "AttentionAdapter", "AttentionSpec", "Projection", "AttentionLayer", "ApplyReport", "LayerReport",
           "BlockStats", "materialize_", "has_meta", "V_MODES"]
