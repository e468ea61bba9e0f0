"""Batched orthonormalization of ``[B, m, n]`` blocks (docs/design.md, "Orthogonalization"):
Householder QR, CholeskyQR2, polar iterations (a Triton kernel on CUDA) and SVD, behind one
backend table. The public function is :func:`orthogonalize` (also ``condinit.init.orthogonalize``).
"""
from condinit.ops.orthogonalize.op import METHODS, orthogonalize

__all__ = ["orthogonalize", "METHODS"]
