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

**Partitions held as plain tensors.** Engines that shard without DTensors (Megatron-Core's
tensor-parallel linears) give each rank a plain tensor that is one contiguous slice of the global
weight along one dimension. A :class:`Partition` says which slice (an adapter reads it from the
engine's own process group and partition sizes) and :func:`local_part` then treats the tensor like
a DTensor shard: same intersection, same blocks, same bits as a single process.
"""
from __future__ import annotations

import sys
from typing import NamedTuple, Optional

import torch

from condinit._validate import check_int

__all__ = ["is_dtensor", "local_part", "Partition"]


class Partition(NamedTuple):
    """A plain tensor that is indices ``offset : offset + t.shape[dim]`` along ``dim`` of a global
    tensor whose ``dim`` has ``size`` entries (every other dimension whole): what one rank of a
    tensor-parallel engine holds. Row-parallel-by-output (column-parallel linear): ``dim=0``.

    Examples:
        >>> Partition(dim=0, offset=rank * 48, size=96)   # rank's half of a [96, in] fused weight
    """

    dim: int
    offset: int
    size: int

    def check(self, t: torch.Tensor, name: str) -> None:
        """ValueError unless ``t`` fits: ``dim`` one of its dimensions, the slice inside ``size``."""
        check_int(f"{name} partition dim", self.dim, min=0, max=t.dim() - 1)
        check_int(f"{name} partition offset", self.offset, min=0)
        check_int(f"{name} partition size", self.size, min=1)
        if is_dtensor(t):
            raise ValueError(f"{name}: a partition describes a plain tensor; a DTensor carries its own placements")
        if self.offset + t.shape[self.dim] > self.size:
            raise ValueError(f"{name}: a partition at offset {self.offset} of {t.shape[self.dim]} entries along dim "
                             f"{self.dim} runs past the global size {self.size}")

    def global_shape(self, t: torch.Tensor) -> tuple:
        shape = list(t.shape)
        shape[self.dim] = self.size
        return tuple(shape)


def _dtensor_cls():
    # A DTensor can only exist once its module was imported: look it up instead of importing it
    # (importing torch.distributed.tensor costs seconds, on every plain apply()).
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None)


def is_dtensor(t) -> bool:
    cls = _dtensor_cls()
    return cls is not None and isinstance(t, cls)


def local_part(t: torch.Tensor, name: str = "tensor", partition: Optional[Partition] = None,
               ) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """``(local, global_offset, global_shape)`` for a plain tensor or a DTensor.

    ``local`` is a detached tensor that aliases the storage this rank holds (writes go through),
    covering global indices ``[offset[i], offset[i] + local.shape[i])`` of a tensor of shape
    ``global_shape``. A plain tensor is its own local part at offset 0, or where ``partition``
    (:class:`Partition`, plain tensors only) places it.
    """
    if partition is not None:
        partition.check(t, name)
        offset = [0] * t.dim()
        offset[partition.dim] = partition.offset
        return t.detach(), tuple(offset), partition.global_shape(t)
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
