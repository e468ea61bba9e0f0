"""Counter-based Gaussian streams (Philox4x32-10 + Box-Muller; docs/design.md, "Random streams"):
:func:`block_randn` fills ``[len(block_ids), m, n]`` blocks, the ``NORMAL`` op scaled normals in any
float dtype, bitwise identical on every backend.
"""
from condinit.ops.random.op import block_randn, seed_from, stream_id

__all__ = ["block_randn", "seed_from", "stream_id"]
