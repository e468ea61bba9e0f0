"""condinit: conditioned initialization for attention, and fused attention JVP/VJP kernels.

Public API (imported lazily, so ``import condinit`` is cheap, never initializes CUDA and never
fails because triton or the native extension is missing):

* conditioned initialization (``condinit.init``): :func:`orthogonalize`, :func:`semi_orthogonal_`,
  :func:`rect_identity_`, :func:`conditioned_init_`, :func:`conditioned_init_layers_`,
  :func:`spectrum`, :func:`recondition_`;
* fused attention with forward- and reverse-mode AD (``condinit.attention``):
  :func:`attention`, :func:`attention_jvp`, :func:`attention_varlen`, :func:`attention_jvp_varlen`;
* forward-mode AD through existing models (``condinit.ops.attention.sdpa``,
  ``condinit.integrations``): :func:`sdpa` (``F.scaled_dot_product_attention`` on the fused op),
  :func:`patch_sdpa` (route ``F.scaled_dot_product_attention`` to it), :func:`register_hf_attention`
  (Hugging Face ``attn_implementation="condinit"``);
* real models (``condinit.models``): :func:`apply`, :func:`register_adapter`, :func:`find_attention`;
* attention Jacobian probes (``condinit.probe``): :class:`JacobianOperator`, :class:`JacobianMonitor`,
  :func:`lanczos_svd`, :func:`power_sigma_max`, :func:`condition_number`,
  :func:`frobenius_hutchinson`, :func:`condition_number_bound`; the monitor also logs max attention
  logit, attention entropy and ``||W_Q,h^T W_K,h||_2`` per head and issues :class:`ConditioningWarning`
  alerts on user thresholds;
* trainer callbacks for the monitor (imported only when asked; ``import condinit`` imports neither
  framework): ``condinit.integrations.trainer.JacobianMonitorCallback`` (Hugging Face ``Trainer``),
  ``condinit.integrations.lightning.JacobianMonitorCallback`` (Lightning);

``python -m condinit info`` lists which backends (cuda, triton, cpp-cpu, torch) each op can use;
``condinit plot RUN_DIR`` draws a monitor run's kappa, max logit and entropy per layer.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "orthogonalize": "condinit.init",
    "semi_orthogonal_": "condinit.init",
    "rect_identity_": "condinit.init",
    "conditioned_init_": "condinit.init",
    "conditioned_init_layers_": "condinit.init",
    "spectrum": "condinit.init",
    "recondition_": "condinit.init",
    "attention": "condinit.ops.attention",
    "attention_jvp": "condinit.ops.attention",
    "attention_varlen": "condinit.ops.attention",
    "attention_jvp_varlen": "condinit.ops.attention",
    "sdpa": "condinit.ops.attention.sdpa",
    "patch_sdpa": "condinit.ops.attention.sdpa",
    "explain": "condinit.ops.attention.explain",
    "register_hf_attention": "condinit.integrations.hf",
    "conditioned_blocks": "condinit.init",
    "apply": "condinit.models",
    "register_adapter": "condinit.models",
    "find_attention": "condinit.models",
    "JacobianOperator": "condinit.probe",
    "JacobianMonitor": "condinit.probe",
    "ConditioningWarning": "condinit.probe.alerts",
    "lanczos_svd": "condinit.probe",
    "power_sigma_max": "condinit.probe",
    "condition_number": "condinit.probe",
    "frobenius_hutchinson": "condinit.probe",
    "condition_number_bound": "condinit.probe",
    "BackendUnavailableError": "condinit._backends",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'condinit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
