"""Conditioned initialization (``docs/design.md``, "The method" and "Orthogonalization").

* :func:`orthogonalize`: batched orthonormalization of ``[B, m, n]`` blocks (Householder,
  CholeskyQR2, polar iterations with a Triton kernel on CUDA, SVD);
* :func:`semi_orthogonal_`, :func:`rect_identity_`: ``torch.nn.init``-style in-place initializers;
* :func:`conditioned_init_`, :func:`conditioned_init_layers_`: the paper's Algorithm 1 for one layer
  or a whole stack of layers in one batched pass; :func:`conditioned_blocks`: any blocks of a
  stream, as an initialization writes them;
* :func:`spectrum`, :func:`recondition_`: per-block singular-value extremes and spectral clamping.

Every initializer lists what it writes in an ``InitPlan`` and runs it with ``run_plan``, the one
planner and executor (:mod:`condinit.init.plan`). Randomness comes from
:mod:`condinit.ops.random.op` (counter-based, chunking-independent; ``docs/design.md``, "Random
streams").
"""
from condinit.init.functional import (conditioned_blocks, conditioned_init_, conditioned_init_layers_,
                                      rect_identity_, semi_orthogonal_)
from condinit.ops.orthogonalize.op import orthogonalize
from condinit.init.spectrum import Spectrum, recondition_, spectrum

__all__ = ["orthogonalize", "semi_orthogonal_", "rect_identity_", "conditioned_init_",
           "conditioned_init_layers_", "conditioned_blocks", "spectrum", "Spectrum", "recondition_"]
