"""Megatron-Core's self-attention (``megatron.core.transformer.attention.SelfAttention``): the
attention of its ``GPTModel`` and of the decoders built from its layer specs.

``SelfAttention`` holds Q, K and V in one fused ``linear_qkv`` (a ``ColumnParallelLinear``) whose
output ``get_query_key_value_tensors`` views as ``[ng, (np/ng + 2) * hn]`` and splits into
``[np/ng * hn, hn, hn]``: per query group its query heads, its key head, its value head
(``layout="per_group"``); with ``attention_output_gate`` a gate of ``np/ng`` heads sits between the
query and the key heads, and is left as the model made it.

**Tensor parallelism.** Each rank holds a plain tensor (no DTensor): rows
``rank * n : (rank + 1) * n`` of the fused weight (and of its bias), ``n = output_size_per_partition``,
with ``rank`` and the world size read from the layer's own tensor-parallel process group
(``linear_qkv.tp_group``). The spec describes the global layout and carries the rank's
:class:`~condinit.models.sharded.Partition`, so :func:`condinit.apply` writes each rank's rows
with no communication, and the ranks' partitions stacked equal a single-process apply of the
same model (TP = 1) bit for bit. That holds both when Megatron builds the master weight and
splits it (``use_cpu_initialization=True``) and when each rank initializes its partition on the
device. With fewer query groups than ranks a partition holds part of a group: still a row range of
the global weight, written the same way.

Megatron is never imported here: the adapter reads the module's attributes (``config``,
``linear_qkv``). Refused with the reason (listed in ``report.uncovered``): a ``linear_qkv`` of
another class (Transformer Engine's ``TELayerNormColumnParallelLinear``, whose partition layout is
not read here), a strided partition (``partition_stride != 1``).
"""
from __future__ import annotations

from torch import nn

from condinit.models.sharded import Partition
from condinit.models.spec import AttentionSpec, Projection, UnsupportedAttention

SELF_ATTENTION = "megatron.core.transformer.attention.SelfAttention"
COLUMN_PARALLEL_LINEAR = "megatron.core.tensor_parallel.layers.ColumnParallelLinear"


def _is_column_parallel(m: nn.Module) -> bool:
    return any(f"{c.__module__}.{c.__qualname__}" == COLUMN_PARALLEL_LINEAR for c in type(m).__mro__)


def _partition(lin: nn.Module, rows: int):
    """This rank's ``Partition`` of ``lin``'s output rows (None when it holds them all)."""
    local = lin.weight.shape[0]
    if local == rows:
        return None
    group = getattr(lin, "tp_group", None)
    if group is None:
        raise UnsupportedAttention(f"linear_qkv holds {local} of {rows} rows and names no tp_group: its rank's "
                                   f"partition is not known")
    rank, size = group.rank(), group.size()
    if getattr(lin.weight, "partition_stride", 1) != 1 or getattr(lin.weight, "partition_dim", 0) != 0:
        raise UnsupportedAttention(f"linear_qkv partitioned along dim {getattr(lin.weight, 'partition_dim', 0)} "
                                   f"with stride {getattr(lin.weight, 'partition_stride', 1)}: only contiguous "
                                   f"row partitions (dim 0, stride 1) are read")
    if local * size != rows:
        raise ValueError(f"linear_qkv holds {local} rows on each of {size} tensor-parallel ranks, expected "
                         f"{rows} / {size}")
    return Partition(dim=0, offset=rank * local, size=rows)


def self_attention_spec(m: nn.Module) -> AttentionSpec:
    cfg, lin = m.config, m.linear_qkv
    if not _is_column_parallel(lin):
        raise UnsupportedAttention(f"Megatron SelfAttention with linear_qkv of class {type(lin).__qualname__}: "
                                   f"its partition layout is not read (ColumnParallelLinear is)")
    if not isinstance(getattr(lin, "weight", None), nn.Parameter):
        raise UnsupportedAttention("Megatron SelfAttention whose linear_qkv holds no weight (it is passed to forward)")
    H = cfg.num_attention_heads
    G = cfg.num_query_groups or H
    d = cfg.kv_channels
    if H % G:
        raise ValueError(f"num_query_groups={G} does not divide num_attention_heads={H}")
    hq = H // G
    gate = hq if getattr(cfg, "attention_output_gate", False) else 0
    group_rows = (hq + gate + 2) * d
    rows = G * group_rows
    if tuple(lin.weight.shape[1:]) != (lin.input_size,):
        raise ValueError(f"linear_qkv weight of shape {tuple(lin.weight.shape)}, expected [rows, {lin.input_size}]")
    part = _partition(lin, rows)
    bias = lin.bias if getattr(lin, "bias", None) is not None and lin.bias.dim() == 1 else None
    bias_part = None if part is None or bias is None else Partition(0, part.offset, rows)

    def proj(start, heads):
        return Projection(lin.weight, start * d, (start + heads) * d, bias=bias, groups=G, stride=group_rows,
                          partition=part, bias_partition=bias_part)

    return AttentionSpec(proj(0, hq), proj(hq + gate, 1), proj(hq + gate + 1, 1), H, G, d)
