"""Triton kernels of condinit, installed as ``condinit.kernels``.

Each module holds private ``@triton.jit`` kernels and the host functions that launch them. Import
them only through the ops in ``condinit`` (which check that triton is usable first): importing this
package itself never imports triton.
"""
