"""One of Q, K, V in its parameter (:class:`Projection`): which rows of which matrix it occupies, and
the views and local parts :func:`condinit.apply` reads and writes through."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from condinit._validate import check_bool, check_int

from .binding import Ref, resolve
from .sharded import Partition, is_dtensor, local_part

__all__ = ["Projection"]


@dataclass(frozen=True, eq=False, init=False)
class Projection:
    """One of Q, K, V: rows of the nn.Linear-layout matrix held by ``weight``, in ``groups`` runs.

    ``weight`` is the parameter (``[out_total, in]``, or ``[in, out_total]`` when ``transposed``),
    given as a tensor or as a :class:`Ref` to it (``weight_source`` is what was given; ``weight``
    reads it now); ``bias`` likewise.
    Group ``g`` is rows ``start + g*stride : stop + g*stride``; the projection's logical ``[rows,
    in]`` matrix is its groups stacked in order (``rows = groups * (stop - start)``). One group (the
    default) is a plain row range: the whole first dimension for an unfused projection, a third of
    a ``[Q; K; V]`` weight. Several groups describe interleaved layouts, e.g. GPT-NeoX's
    ``[H, 3, d]``: Q is ``start=0, stop=d, groups=H, stride=3d``.

    ``matrix_shape`` (optional): the parameter is not 2-D, and this 2-D shape is the matrix it is
    read as (its row-major reshape, a view of the same storage), in which rows, ``transposed`` and
    the groups above are counted: XLNet's ``[D, H, d]`` query (``einsum("ibh,hnd->ibnd")``) is
    ``matrix_shape=(D, H*d), transposed=True``, a stack of expert projections ``[E, out, in]`` is
    ``(E*out, in)``, a ``Conv1d`` with kernel size 1 ``[out, in, 1]`` is ``(out, in)``. Writes go to
    the parameter itself.

    ``in_groups`` (optional, grouped convolutions): the matrix's rows form ``in_groups`` equal
    blocks and block ``b`` reads input channels ``b*C : (b+1)*C`` (``C`` the matrix's columns), so
    the logical matrix is block-diagonal, ``[rows, in_groups * C]``, with zeros the parameter does
    not store. Not with ``transposed``.

    ``fixed`` (Q only): the tensor is the query itself, a learned query of attention pooling (AIMv2's
    ``cls_token``), read as ``[H d, 1]`` (a projection of the constant 1, ``matrix_shape=(H d, 1)``).
    It is no projection of the tokens, so the method has no ``W_Q`` there: it is left as the model
    made it, and K and V are conditioned as in any layer.

    ``bias`` (optional, 1-D) holds group ``g``'s entries at ``bias_start + g*bias_stride`` onwards
    (``bias_start`` defaults to ``start``, ``bias_stride`` to ``stride``: a fused bias follows its
    weight).

    ``partition`` / ``bias_partition`` (optional, :class:`~condinit.models.sharded.Partition`): the
    plain tensor given is this process's slice of a global weight (bias) held by several, as an
    engine's tensor-parallel linear holds it (Megatron-Core's ``ColumnParallelLinear``: rows
    ``rank * n : (rank + 1) * n``). Everything above (rows, groups, ``stride``, ``bias_start``)
    counts in the global tensor; :func:`condinit.apply` writes the local slice, as for a DTensor
    shard. Not with ``matrix_shape`` or ``in_groups``; :meth:`view` and :meth:`read_bias` refuse
    (no process holds the whole matrix).

    Examples:
        >>> w = torch.nn.Linear(64, 3 * 64).weight            # 4 heads of 16, rows [H, 3, d]
        >>> q = Projection(w, 0, 16, groups=4, stride=48)
        >>> q.rows, q.shape
        (64, (64, 64))
        >>> x = torch.nn.Parameter(torch.empty(64, 4, 16))    # XLNet: q_head = einsum("ibh,hnd->ibnd", h, x)
        >>> Projection(x, 0, 64, transposed=True, matrix_shape=(64, 64)).shape
        (64, 64)
        >>> c = torch.nn.Conv1d(64, 64, 1, groups=4).weight   # [64, 16, 1], block-diagonal [64, 64]
        >>> Projection(c, 0, 64, matrix_shape=(64, 16), in_groups=4).shape
        (64, 64)
    """

    weight_source: Union[torch.Tensor, Ref]
    start: int
    stop: int
    transposed: bool
    bias_source: Union[torch.Tensor, Ref, None]
    bias_start: Optional[int]
    groups: int
    stride: int
    bias_stride: Optional[int]
    matrix_shape: Optional[tuple]
    in_groups: int
    fixed: bool
    partition: Optional[Partition]
    bias_partition: Optional[Partition]

    def __init__(self, weight, start: int, stop: int, transposed: bool = False, bias=None,
                 bias_start: Optional[int] = None, groups: int = 1, stride: int = 0,
                 bias_stride: Optional[int] = None, matrix_shape: Optional[tuple] = None, in_groups: int = 1,
                 fixed: bool = False, partition: Optional[Partition] = None,
                 bias_partition: Optional[Partition] = None):
        values = dict(weight_source=weight, start=start, stop=stop, transposed=transposed, bias_source=bias,
                      bias_start=bias_start, groups=groups, stride=stride, bias_stride=bias_stride,
                      matrix_shape=matrix_shape, in_groups=in_groups, fixed=fixed, partition=partition,
                      bias_partition=bias_partition)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self._check()

    @property
    def weight(self) -> torch.Tensor:
        """The parameter holding the rows, as the module holds it now (see :class:`Ref`)."""
        return resolve(self.weight_source)

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return resolve(self.bias_source)

    def bound(self, places: dict) -> "Projection":
        """The same rows with the weight and bias referenced where ``places`` (:func:`tensor_places`)
        finds them; a tensor it does not list is kept as it is."""
        bias = self.bias
        return Projection(places.get(id(self.weight), self.weight_source), self.start, self.stop, self.transposed,
                          None if bias is None else places.get(id(bias), self.bias_source), self.bias_start,
                          self.groups, self.stride, self.bias_stride, self.matrix_shape, self.in_groups, self.fixed,
                          self.partition, self.bias_partition)

    def _check(self):
        if not isinstance(self.weight, torch.Tensor):
            raise TypeError(f"Projection: weight must be a tensor, got {type(self.weight).__name__}")
        if self.matrix_shape is None:
            if self.weight.dim() != 2:
                raise TypeError(f"Projection: weight must be a 2-D tensor, got shape {tuple(self.weight.shape)} "
                                f"(a parameter of another shape needs matrix_shape, the matrix it is read as)")
        else:
            shape = self.matrix_shape
            if not (isinstance(shape, tuple) and len(shape) == 2):
                raise TypeError(f"Projection: matrix_shape must be a tuple (rows, cols), got {shape!r}")
            for name, v in zip(("rows", "cols"), shape):
                check_int(f"Projection matrix_shape {name}", v, min=1)
            if shape[0] * shape[1] != self.weight.numel():
                raise ValueError(f"Projection: matrix_shape {shape} does not hold the {self.weight.numel()} "
                                 f"elements of a weight of shape {tuple(self.weight.shape)}")
            if not self.weight.is_meta and not is_dtensor(self.weight):
                try:
                    self.weight.detach().view(shape)
                except RuntimeError:
                    raise ValueError(f"Projection: a weight of shape {tuple(self.weight.shape)} and strides "
                                     f"{self.weight.stride()} cannot be viewed as matrix_shape {shape}") from None
        for what, part, t in (("weight", self.partition, self.weight), ("bias", self.bias_partition, self.bias)):
            if part is None:
                continue
            if not isinstance(part, Partition):
                raise TypeError(f"Projection: {what}_partition must be a condinit.models.sharded.Partition or None, "
                                f"got {type(part).__name__}")
            if not isinstance(t, torch.Tensor):
                raise ValueError("Projection: a bias_partition without a bias")
            part.check(t, f"Projection {what}")
        if self.partition is not None and (self.matrix_shape is not None or self.in_groups > 1):
            raise ValueError("Projection: a partition of a weight read through matrix_shape or in_groups is not "
                             "supported (a slice of the parameter is no block of the matrix)")
        check_int("Projection start", self.start, min=0)
        check_int("Projection stop", self.stop, min=self.start + 1)
        check_bool("Projection transposed", self.transposed)
        check_int("Projection groups", self.groups, min=1)
        check_int("Projection stride", self.stride, min=0)
        check_int("Projection in_groups", self.in_groups, min=1)
        check_bool("Projection fixed", self.fixed)
        if self.fixed and self.bias is not None:
            raise ValueError("Projection: a fixed (learned) query has no bias")
        if self.groups > 1 and self.stride < self.stop - self.start:
            raise ValueError(f"Projection: stride {self.stride} is below the {self.stop - self.start} rows of a group: "
                             f"groups would overlap")
        size = self.storage_rows
        if self.span_stop > size:
            raise ValueError(f"Projection: rows up to {self.span_stop} of a weight with {size} "
                             f"{'columns (transposed)' if self.transposed else 'rows'}")
        if self.in_groups > 1:
            if self.transposed:
                raise ValueError("Projection: in_groups (a grouped convolution) with transposed=True")
            if size % self.in_groups:
                raise ValueError(f"Projection: {size} rows do not form {self.in_groups} equal blocks (in_groups)")
        if self.bias is not None:
            if not isinstance(self.bias, torch.Tensor) or self.bias.dim() != 1:
                raise TypeError(f"Projection: bias must be a 1-D tensor or None, got {type(self.bias).__name__}")
            check_int("Projection bias_start", self.bias_start, min=0, allow_none=True)
            check_int("Projection bias_stride", self.bias_stride, min=0, allow_none=True)
            end = self.bias_offset + (self.groups - 1) * self.bias_step + self.group_rows
            size = self.bias.shape[0] if self.bias_partition is None else self.bias_partition.size
            if end > size:
                raise ValueError(f"Projection: bias entries up to {end} of a bias with {size}")

    @property
    def storage_shape(self) -> tuple:
        """Shape of the matrix the rows are counted in: ``matrix_shape``, the global shape of a
        ``partition``, or the weight's own."""
        if self.matrix_shape is not None:
            return tuple(self.matrix_shape)
        if self.partition is not None:
            return self.partition.global_shape(self.weight)
        return tuple(self.weight.shape)

    @property
    def distributed(self) -> bool:
        """Whether this process holds only part of the weight (a DTensor, or a ``partition``)."""
        return self.partition is not None or is_dtensor(self.weight)

    def local_weight(self, name: str) -> tuple[torch.Tensor, tuple, tuple]:
        """``(local, global_offset, global_shape)`` of the weight (:func:`condinit.models.sharded.local_part`)."""
        return local_part(self.weight, name, self.partition)

    def local_bias(self, name: str) -> tuple[torch.Tensor, tuple, tuple]:
        """The same for the bias (which must exist)."""
        return local_part(self.bias, name, self.bias_partition)

    def _whole(self, what: str) -> None:
        part, t = (self.partition, self.weight) if what == "weight" else (self.bias_partition, self.bias)
        if part is not None:
            raise ValueError(f"Projection: this process holds only entries {part.offset}:"
                             f"{part.offset + t.shape[part.dim]} along dim {part.dim} of the {what} (a partition "
                             f"of {part.size}); gather it first")

    @property
    def storage_rows(self) -> int:
        """Rows of that matrix (its columns when ``transposed``): the extent ``start`` / ``stop`` index."""
        return self.storage_shape[1 if self.transposed else 0]

    @property
    def group_rows(self) -> int:
        return self.stop - self.start

    @property
    def rows(self) -> int:
        return self.groups * self.group_rows

    @property
    def span_stop(self) -> int:
        """One past the last storage row (column when transposed) the projection occupies."""
        return self.start + (self.groups - 1) * self.stride + self.group_rows

    @property
    def bias_offset(self) -> int:
        return self.start if self.bias_start is None else self.bias_start

    @property
    def bias_step(self) -> int:
        return self.stride if self.bias_stride is None else self.bias_stride

    @property
    def block_in_features(self) -> int:
        """Input columns one stored row reads: ``in_features`` / ``in_groups``."""
        shape = self.storage_shape
        return shape[0] if self.transposed else shape[1]

    @property
    def block_rows(self) -> int:
        """Storage rows per block of a grouped convolution (all rows for ``in_groups=1``)."""
        return self.storage_rows // self.in_groups

    @property
    def in_features(self) -> int:
        return self.block_in_features * self.in_groups

    @property
    def shape(self) -> tuple[int, int]:
        """Logical ``[rows, in_features]`` (nn.Linear layout)."""
        return (self.rows, self.in_features)

    def matrix(self, t: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The (plain, non-DTensor) weight, or ``t`` shaped like it, as the 2-D matrix of
        ``storage_shape``: a view, writes go through. Detached."""
        w = (self.weight if t is None else t).detach()
        return w if self.matrix_shape is None else w.view(self.storage_shape)

    def local_matrix(self, local: torch.Tensor, offset: tuple, name: str) -> tuple[torch.Tensor, tuple]:
        """The local part of the weight (``condinit.models.sharded.local_part``) as a part of the
        2-D matrix: ``(view, (row offset, col offset))``. A weight read through ``matrix_shape`` or
        ``in_groups`` must be held whole (a shard of it is no block of the matrix)."""
        if self.matrix_shape is None and self.in_groups == 1:
            return local, offset
        if tuple(local.shape) != tuple(self.weight.shape) or any(offset):
            raise ValueError(f"{name}: a sharded weight of shape {tuple(self.weight.shape)} read as a "
                             f"{self.storage_shape} matrix (matrix_shape, in_groups) is not supported; gather it on "
                             f"each rank first")
        return local.view(self.storage_shape), (0, 0)

    def segments(self) -> list[tuple[int, int, int]]:
        """``(logical_row, storage_lo, storage_hi)`` per group: storage rows ``lo:hi`` (columns when
        transposed) hold logical rows ``logical_row : logical_row + hi - lo``."""
        n = self.group_rows
        return [(g * n, self.start + g * self.stride, self.stop + g * self.stride) for g in range(self.groups)]

    def blocks(self) -> list[tuple[int, int, int, int]]:
        """``(logical_row, storage_lo, storage_hi, logical_col)``: :meth:`segments` cut at the blocks
        of a grouped convolution; the stored rows ``lo:hi`` read logical input columns
        ``logical_col : logical_col + block_in_features`` (``logical_col`` 0 without ``in_groups``)."""
        if self.in_groups == 1:
            return [(r, lo, hi, 0) for r, lo, hi in self.segments()]
        out, n, c = [], self.block_rows, self.block_in_features
        for r, lo, hi in self.segments():
            at = lo
            while at < hi:
                end = min(hi, (at // n + 1) * n)
                out.append((r + at - lo, at, end, (at // n) * c))
                at = end
        return out

    def bias_segments(self) -> list[tuple[int, int]]:
        """``(lo, hi)`` entries of ``bias`` per group (empty without a bias)."""
        if self.bias is None:
            return []
        n, at, step = self.group_rows, self.bias_offset, self.bias_step
        return [(at + g * step, at + g * step + n) for g in range(self.groups)]

    def view(self, t: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[rows, in]`` of the (plain, non-DTensor) weight in nn.Linear layout: a view (writes go
        through) for one group, a copy of the groups stacked for several, and a block-diagonal copy
        (zeros where a grouped convolution stores nothing) with ``in_groups``."""
        self._whole("weight")
        w = self.matrix(t)
        if self.in_groups > 1:
            out = w.new_zeros(self.shape)
            c = self.block_in_features
            for r, lo, hi, col in self.blocks():
                out[r:r + hi - lo, col:col + c] = w[lo:hi]
            return out
        parts = [w[:, lo:hi].t() if self.transposed else w[lo:hi] for _, lo, hi in self.segments()]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def read_bias(self) -> Optional[torch.Tensor]:
        """This projection's ``[rows]`` bias entries (a view for one group, a copy for several), or None."""
        if self.bias is None:
            return None
        self._whole("bias")
        b = self.bias.detach()
        parts = [b[lo:hi] for lo, hi in self.bias_segments()]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
