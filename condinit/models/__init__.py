"""Conditioned initialization of real models: attention adapters, ``apply``, deferred (meta) and
sharded (FSDP2 / DTensor) init, presets and safetensors checkpoints.

    import condinit
    report = condinit.apply(model, seed=0)      # every attention layer, in place
    print(report)                               # per-layer singular values before / after

See :mod:`condinit.models.apply` for what is done and how layers are numbered,
:mod:`condinit.models.find` for which modules it conditions and which it lists as uncovered,
:mod:`condinit.models.report` for what it reports,
:mod:`condinit.models.registry` for how attention modules are recognised (registered adapters, then
their structure, :mod:`condinit.models.discovery`) and for adding one (``register_adapter``),
:mod:`condinit.models.spec` for the description an adapter returns, :mod:`condinit.models.families`
for the built-in adapters,
:mod:`condinit.models.deferred` for meta-device models and :mod:`condinit.models.sharded` for DTensors.
Importing this package imports neither transformers nor timm and never initializes CUDA.
"""
from . import families  # noqa: F401  (registers the built-in adapters)
from .registry import (AttentionAdapter, describe, get_adapter, register_adapter, registered_adapters, spec_of,
                       unregister_adapter)
from .spec import LAYOUTS, AttentionSpec, Described, Projection, UnsupportedAttention, fused_layout
from .apply import (V_MODES, AttentionLayer, Discovery, Uncovered, UncoveredAttentionError, UncoveredAttentionWarning,
                    apply, discover, find_attention)
from .report import ApplyReport, BlockStats, LayerReport
from .deferred import has_meta, materialize_

__all__ = ["apply", "find_attention", "discover", "describe", "spec_of", "register_adapter", "unregister_adapter",
           "get_adapter", "registered_adapters", "AttentionAdapter", "AttentionSpec", "Projection", "fused_layout",
           "LAYOUTS", "Described", "UnsupportedAttention", "AttentionLayer", "Discovery", "Uncovered",
           "UncoveredAttentionWarning", "UncoveredAttentionError", "ApplyReport", "LayerReport", "BlockStats",
           "materialize_", "has_meta", "V_MODES"]
