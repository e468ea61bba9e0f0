"""Attention Jacobian probes (issue 5; math in DESIGN.md sections 2-4).

* :class:`JacobianOperator` -- one attention layer's Jacobian (w.r.t. its Q/K/V weights, its
  input, or q/k/v) as a matrix-free operator: ``mv`` is one fused JVP, ``matmat`` one multi-probe
  launch, ``rmv`` the flash VJP; ``to_scipy()``, ``dense()`` for tiny layers.
* estimators: :func:`lanczos_svd`, :func:`condition_number`, :func:`power_sigma_max`,
  :func:`frobenius_hutchinson` (results say how they were obtained and on which subspace).
* :func:`theorem31_bound` -- the paper's Theorem 3.1 bound per layer.
* :class:`JacobianMonitor` -- forward hooks that sample a training step and log the estimates,
  without changing training.
"""
from .bound import Theorem31Bound, theorem31_bound
from .estimators import (FrobeniusEstimate, SpectrumEstimate, condition_number, frobenius_hutchinson,
                         lanczos_svd, power_sigma_max)
from .monitor import JacobianMonitor
from .operator import JacobianOperator

__all__ = ["JacobianOperator", "JacobianMonitor", "lanczos_svd", "power_sigma_max", "condition_number",
           "frobenius_hutchinson", "theorem31_bound", "SpectrumEstimate", "FrobeniusEstimate", "Theorem31Bound"]
