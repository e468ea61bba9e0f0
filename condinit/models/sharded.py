"""Local shards of DTensor parameters: which part of the global tensor this rank holds.

:func:`condinit.apply` writes each rank's shard directly, with no communication: it intersects the
shard's global row/column ranges with each projection's rows, generates the whole per-head blocks
those rows touch (orthogonalization needs a whole block) with the counter-based generator, and copies
the overlapping part. Because every block is a pure function of ``(seed, stream, block id)``, the
assembled full tensor equals, bit for bit, a single-process :func:`condinit.apply` with the same seed.

What a rank generates, per placement of a ``[rows, in]`` projection:

* ``Shard(0)`` (FSDP2's placement, and row-wise tensor parallel): only the heads its rows overlap,
  at most ``ceil(rows_local / head_dim) + 1`` blocks.
* ``Shard(1)`` (column-wise): every row is local, so **every block of the projection** is generated
  on every rank (each keeps its columns). Same cost as unsharded; memory stays bounded by the
  generation buffer, not the tensor.
* ``Replicate()``: the whole projection, like a single process.
* Fused weights (``in_proj_weight``, timm ``qkv``) and stored-transposed ones (GPT-2 ``Conv1D``, whose
  ``Shard(0)`` splits the *input* dimension) are handled the same way, through the
  projection's row range and orientation.

``Partial`` placements (pending reductions) hold no well-defined values and are rejected.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

__all__ = ["is_dtensor", "local_part"]


def _dtensor_cls():
    # A DTensor can only exist once its module was imported: look it up instead of importing it
    # (importing torch.distributed.tensor costs seconds, on every plain apply()).
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None)


def is_dtensor(t) -> bool:
    cls = _dtensor_cls()
    return cls is not None and isinstance(t, cls)


def local_part(t: torch.Tensor, name: str = "tensor") -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """``(local, global_offset, global_shape)`` for a plain tensor or a DTensor.

    ``local`` is a detached tensor that aliases the storage this rank holds (writes go through),
    covering global indices ``[offset[i], offset[i] + local.shape[i])`` of a tensor of shape
    ``global_shape``. A plain tensor is its own local part at offset 0.
    """
    if not is_dtensor(t):
        return t.detach(), (0,) * t.dim(), tuple(t.shape)
    from torch.distributed.tensor import Replicate, Shard

    for p in t.placements:
        if type(p) not in (Shard, Replicate):
            raise ValueError(f"{name}: DTensor placement {p} is not supported (only Shard(dim) and Replicate(); "
                             f"a Partial tensor has no values to initialize)")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    with torch.no_grad():
        local = t.to_local().detach()
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"{name}: local shard has shape {tuple(local.shape)}, expected {tuple(shape)} from its "
                         f"placements {t.placements}")
    return local, tuple(int(o) for o in offset), tuple(t.shape)


def local_device(t: torch.Tensor) -> torch.device:
    local = t.to_local() if is_dtensor(t) else t
    return local.device


def overlap(lo: int, hi: int, a: int, b: int) -> Optional[tuple[int, int]]:
    """Intersection of ``[lo, hi)`` and ``[a, b)``, or None when empty."""
    s, e = max(lo, a), min(hi, b)
    return (s, e) if s < e else None
