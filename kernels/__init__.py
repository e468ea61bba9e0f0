"""Triton kernels of condinit, installed as ``condinit.kernels``: one folder per op family
(``attention``, ``orthogonalize``), beside the op's Python side in ``condinit/ops/<family>/``.

Each folder holds the ``@triton.jit`` kernels and the host functions that launch them. Import them
only through the ops in ``condinit`` (which check that triton is usable first): importing this
package itself never imports triton.
"""
