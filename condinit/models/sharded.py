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
* ``_StridedShard`` (FSDP2's ``fully_shard`` over a "dp" mesh dimension layered on tensor parallel:
  a fused ``wqkv`` gets ``(_StridedShard(0, split_factor=tp), Shard(0))``): the rank's entries along a
  dimension need not be one contiguous range. :func:`global_indices` maps each local index to its
  global index by applying the placements left to right with torch's own split of each placement
  (the split ``distribute_tensor`` uses); :func:`local_boxes` cuts the local tensor into the
  contiguous boxes of that map, and each box is written like a ``Shard`` part. Uneven strided
  shards (entries not a multiple of ``split_factor`` times the mesh size) are refused: there torch's
  reading of the placement and FSDP2's storage can name different rows.
* Fused weights (``in_proj_weight``, timm ``qkv``) and stored-transposed ones (GPT-2 ``Conv1D``, whose
  ``Shard(0)`` splits the *input* dimension) are handled the same way, through the
  projection's row range and orientation.

``Partial`` placements (pending reductions) hold no well-defined values and are rejected, and so is
any other placement (named in the error).

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

__all__ = ["is_dtensor", "local_part", "local_boxes", "global_indices", "Box", "Partition"]


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


class Box(NamedTuple):
    """A contiguous box of a rank's local tensor: local indices ``local[d] : local[d] + shape[d]`` hold
    global indices ``offset[d] : offset[d] + shape[d]`` in every dimension ``d``."""

    local: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def slices(self) -> tuple[slice, ...]:
        """Index of the box in the local tensor (``local[box.slices()]`` is a view)."""
        return tuple(slice(a, a + n) for a, n in zip(self.local, self.shape))


def _placement_types():
    from torch.distributed.tensor import Replicate, Shard
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:      # a torch without strided shards: no DTensor can carry one
        _StridedShard = None
    return Replicate, Shard, _StridedShard


def _check_placements(placements, name: str) -> None:
    Replicate, Shard, Strided = _placement_types()
    for p in placements:
        if type(p) not in (Shard, Replicate, Strided):
            raise ValueError(f"{name}: DTensor placement {p!r} is not supported (only Shard(dim), _StridedShard(dim) "
                             f"and Replicate(); a Partial tensor has no values to initialize)")


def global_indices(global_shape, mesh_shape, coordinate, placements, name: str = "tensor",
                   ) -> list[Optional[torch.Tensor]]:
    """Per dimension of a DTensor of ``global_shape`` placed by ``placements`` on a mesh of
    ``mesh_shape``, seen from mesh ``coordinate``: the global index of each local index (a 1-D int64
    tensor), or None where the dimension is held whole.

    Placements apply left to right, as torch's ``compute_local_shape_and_global_offset`` applies
    them: each ``Shard`` / ``_StridedShard`` on mesh dimension ``m`` splits the indices the earlier
    placements left along its ``dim`` with the placement's own split (``_split_tensor``, what
    ``distribute_tensor`` scatters) and keeps chunk ``coordinate[m]``. A ``_StridedShard``'s chunk
    is not contiguous in general; it must split its entries evenly (their count a multiple of
    ``split_factor`` times the mesh dimension's size), else ValueError: there the placement's
    left-to-right reading and the right-to-left chunking FSDP2 stores can name different entries.
    Pure: no process group needed.
    """
    _check_placements(placements, name)
    Replicate, Shard, _ = _placement_types()
    if len(placements) != len(mesh_shape) or len(coordinate) != len(mesh_shape):
        raise ValueError(f"{name}: {len(placements)} placements, a mesh of shape {tuple(mesh_shape)} and "
                         f"coordinate {tuple(coordinate)} do not match")
    index: list[Optional[torch.Tensor]] = [None] * len(global_shape)
    for m, p in enumerate(placements):
        if type(p) is Replicate:
            continue
        d = p.dim
        if not 0 <= d < len(global_shape):
            raise ValueError(f"{name}: placement {p!r} shards dimension {d} of a {len(global_shape)}-d tensor")
        cur = torch.arange(global_shape[d]) if index[d] is None else index[d]
        if type(p) is not Shard:     # a _StridedShard
            n = int(p.split_factor) * int(mesh_shape[m])
            if cur.numel() % n:
                raise ValueError(f"{name}: DTensor placement {p!r} over {cur.numel()} entries of dim {d} is not "
                                 f"supported (uneven: not a multiple of split_factor x mesh size = {n}; torch's "
                                 f"reading of an uneven strided shard and FSDP2's storage of it can differ)")
        # split along p.dim, as the placement splits a tensor: the index vector laid along that dim
        chunks, _ = p._split_tensor(cur.reshape([1] * d + [-1]), int(mesh_shape[m]), with_padding=False)
        c = int(coordinate[m])
        index[d] = chunks[c].reshape(-1) if c < len(chunks) else cur[:0]
    return index


def _runs(index: Optional[torch.Tensor], size: int) -> list[tuple[int, int, int]]:
    """``(local_start, global_start, length)`` of the maximal runs of consecutive global indices."""
    if index is None:
        return [(0, 0, size)] if size else []
    if index.numel() == 0:
        return []
    cut = (torch.nonzero(index[1:] - index[:-1] != 1).view(-1) + 1).tolist()
    starts = [0] + cut
    ends = cut + [index.numel()]
    return [(a, int(index[a]), b - a) for a, b in zip(starts, ends)]


def local_boxes(t: torch.Tensor, name: str = "tensor", partition: Optional[Partition] = None,
                ) -> tuple[torch.Tensor, list[Box], tuple[int, ...]]:
    """``(local, boxes, global_shape)`` for a plain tensor or a DTensor: ``local`` a detached tensor
    aliasing the storage this rank holds (writes go through), ``boxes`` the :class:`Box` es it is
    made of (one for a plain tensor, a :class:`Partition`, ``Shard`` / ``Replicate`` placements;
    possibly several with ``_StridedShard``; none when the rank holds nothing)."""
    if partition is not None or not is_dtensor(t):
        local, offset, shape = local_part(t, name, partition)
        box = [Box((0,) * local.dim(), offset, tuple(local.shape))] if local.numel() else []
        return local, box, shape
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:          # this rank is not in the tensor's mesh: it holds nothing
        return t.to_local().detach(), [], tuple(t.shape)
    index = global_indices(tuple(t.shape), tuple(mesh.shape), coordinate, t.placements, name)
    with torch.no_grad():
        local = t.to_local().detach()
    expect = tuple(t.shape[d] if ix is None else ix.numel() for d, ix in enumerate(index))
    if tuple(local.shape) != expect:
        raise ValueError(f"{name}: local shard has shape {tuple(local.shape)}, expected {expect} from its "
                         f"placements {t.placements}")
    boxes = [[]]
    for d, ix in enumerate(index):
        boxes = [b + [r] for b in boxes for r in _runs(ix, local.shape[d])]
    return local, [Box(tuple(r[0] for r in b), tuple(r[1] for r in b), tuple(r[2] for r in b))
                   for b in boxes], tuple(t.shape)


def local_part(t: torch.Tensor, name: str = "tensor", partition: Optional[Partition] = None,
               ) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """``(local, global_offset, global_shape)`` for a plain tensor or a DTensor whose local part is
    one contiguous box of the global tensor (:func:`local_boxes` reads any shard).

    ``local`` is a detached tensor that aliases the storage this rank holds (writes go through),
    covering global indices ``[offset[i], offset[i] + local.shape[i])`` of a tensor of shape
    ``global_shape``. A plain tensor is its own local part at offset 0, or where ``partition``
    (:class:`Partition`, plain tensors only) places it. ValueError when the rank's entries are not
    one box (a ``_StridedShard`` placement can split them).
    """
    if partition is not None:
        partition.check(t, name)
        offset = [0] * t.dim()
        offset[partition.dim] = partition.offset
        return t.detach(), tuple(offset), partition.global_shape(t)
    if not is_dtensor(t):
        return t.detach(), (0,) * t.dim(), tuple(t.shape)
    local, boxes, shape = local_boxes(t, name)
    if len(boxes) > 1:
        raise ValueError(f"{name}: this rank's entries under placements {t.placements} are {len(boxes)} separate "
                         f"boxes of the global tensor, not one (read it with local_boxes)")
    offset = boxes[0].offset if boxes else tuple(t.shape)
    return local, tuple(int(o) for o in offset), shape


def local_device(t: torch.Tensor) -> torch.device:
    local = t.to_local() if is_dtensor(t) else t
    return local.device


def overlap(lo: int, hi: int, a: int, b: int) -> Optional[tuple[int, int]]:
    """Intersection of ``[lo, hi)`` and ``[a, b)``, or None when empty."""
    s, e = max(lo, a), min(hi, b)
    return (s, e) if s < e else None
