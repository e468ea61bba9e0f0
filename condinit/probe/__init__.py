"""Attention Jacobian probes (derivations: ``docs/design.md``, "The attention Jacobian").

* :class:`JacobianOperator` -- one attention layer's Jacobian (w.r.t. its Q/K/V weights, its
  input, or q/k/v) as a matrix-free operator: ``mv`` is one fused JVP, ``matmat`` one multi-probe
  launch, ``rmv`` the flash VJP; ``to_scipy()``, ``dense()`` for tiny layers.
* estimators: :func:`lanczos_svd`, :func:`condition_number`, :func:`power_sigma_max`,
  :func:`frobenius_hutchinson` (results say how they were obtained and on which subspace).
* :func:`condition_number_bound` -- the upper bound on kappa(J) per layer (Theorem 3.1 of
  Conditioned Initialization for Attention (2026)).
* :class:`JacobianMonitor` -- forward hooks that sample a training step and log the estimates,
  without changing training.
* :class:`InputCapture` -- the forward pre-hooks that capture attention layers' inputs.
* :class:`NonFiniteError` -- a ``ValueError``: the operator was given NaN / Inf data (``x``, ``q, k, v``
  or a layer's weights).
"""
from condinit._validate import NonFiniteError

from .bound import ConditionNumberBound, condition_number_bound
from .capture import InputCapture, layer_input
from .estimators import (FrobeniusEstimate, SpectrumEstimate, condition_number, frobenius_hutchinson,
                         lanczos_svd, power_sigma_max)
from .monitor import JacobianMonitor
from .operator import JacobianOperator

__all__ = ["JacobianOperator", "JacobianMonitor", "lanczos_svd", "power_sigma_max", "condition_number",
           "frobenius_hutchinson", "condition_number_bound", "SpectrumEstimate", "FrobeniusEstimate",
           "ConditionNumberBound", "InputCapture", "layer_input", "NonFiniteError"]
