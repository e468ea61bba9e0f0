"""DeepSpeed ZeRO-3: models built under ``deepspeed.zero.Init``, their parameters partitioned.

Under ``deepspeed.zero.Init`` every parameter is partitioned as soon as its module is built: each
rank keeps a flat ``1/world`` slice in ``param.ds_tensor`` and the module itself sees an empty
``param.data`` (``param.ds_shape`` is the full shape) until ``deepspeed.zero.GatheredParameters``
gathers it. :func:`condinit.apply` recognises such parameters by their ZeRO-3 attributes
(``ds_id`` and a ``ds_status`` other than ``AVAILABLE``; DeepSpeed is imported only once one is
seen) and conditions the model one attention layer at a time, called on every rank:

1. **Discovery** reads shapes, never values: while it runs, each partitioned parameter's ``data``
   is a zero-stride view of one element expanded to ``ds_shape`` (no memory), restored afterwards
   (also when discovery raises). Layers are numbered as on an unpartitioned model.
2. **Writing**, per selected layer: the attention module's parameters (and any Q/K/V parameter an
   adapter names outside it) are gathered with ``GatheredParameters(..., modifier_rank=0)``; the
   first rank of their ZeRO process group conditions the whole module with a plain
   :func:`condinit.apply` at the layer's index; on leaving the context DeepSpeed broadcasts that
   rank's values and re-partitions them. At most one attention module is gathered at a time, and
   the other ranks generate nothing. Every block is a pure function of ``(seed, stream, block id)``,
   so the result equals a single-process :func:`condinit.apply` of the same model; the gathered
   parameters that are not Q/K/V (the output projection, a QK-norm) are re-partitioned from the
   same values, bit for bit, and no other parameter is touched.

``seed=None``: the first rank's draw is broadcast, so every rank reports (and writes) the same
seed; an explicit ``seed`` must be the same on every rank. The report (before/after singular values
of every head block) is measured by the writing rank and broadcast with the seed, so every rank
returns the same :class:`condinit.models.report.ApplyReport`.

Call it after building the model under ``deepspeed.zero.Init`` and before ``deepspeed.initialize``:
the engine's optimizer keeps fp32 copies of the partitions, which its next step writes back, so a
model whose parameters already belong to one is refused (:func:`check_partitioned`). A model whose parameters are all gathered
(inside the caller's own ``GatheredParameters``) is a plain model to :func:`condinit.apply`.
"""
from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from typing import Sequence

import torch
from torch import nn

__all__ = ["is_partitioned", "check_partitioned", "full_shapes", "write_partitioned"]


def is_partitioned(p: torch.Tensor) -> bool:
    """Whether ``p`` is a ZeRO-3 parameter whose values are not gathered now (its ``data`` does not
    hold the tensor)."""
    status = getattr(p, "ds_status", None)
    return hasattr(p, "ds_id") and status is not None and getattr(status, "name", None) != "AVAILABLE"


def check_partitioned(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a partitioned ZeRO-3 parameter.

    Raises ValueError when its ZeRO-3 parameters already belong to the optimizer of a DeepSpeed
    engine (``deepspeed.initialize`` sets ``_z3_optimizer`` on each): the optimizer keeps its own
    fp32 copy of every partition and its next step would write the old values back, whether or not
    the parameters are gathered now."""
    found = False
    for p in model.parameters():
        if hasattr(p, "ds_id") and getattr(p, "_z3_optimizer", None) is not None:
            raise ValueError("the model's ZeRO-3 parameters already belong to a DeepSpeed engine's optimizer, whose "
                             "fp32 copies condinit.apply does not write: call condinit.apply after building the "
                             "model under deepspeed.zero.Init and before deepspeed.initialize")
        found = found or is_partitioned(p)
    return found


@contextmanager
def full_shapes(model: nn.Module):
    """Within the context, every partitioned parameter of ``model`` has its full shape
    (``ds_shape``) as a zero-stride view of one element: for reading shapes and dtypes only."""
    held = []
    try:
        for p in model.parameters():
            if is_partitioned(p):
                held.append((p, p.data))
                p.data = torch.empty((), dtype=p.dtype, device=p.data.device).expand(tuple(p.ds_shape))
        yield
    finally:
        for p, data in held:
            p.data = data


def _layer_params(layer) -> list:
    """The ZeRO-3 parameters a layer's write reads: its module's, and Q/K/V tensors held elsewhere."""
    out = {id(p): p for p in layer.module.parameters()}
    for _, proj in layer.spec.projections():
        for t in (proj.weight, proj.bias):
            if t is not None:
                out.setdefault(id(t), t)
    return [p for p in out.values() if hasattr(p, "ds_id")]


def _writer(params: Sequence[nn.Parameter], name: str):
    """``(is this rank the writer, the writer's global rank, the process group)`` for one layer."""
    import torch.distributed as dist

    groups = {id(p.ds_process_group): p.ds_process_group for p in params}
    if len(groups) != 1:
        raise ValueError(f"{name}: its parameters are partitioned over {len(groups)} different ZeRO process groups; "
                         f"condinit conditions a layer whose Q/K/V share one group")
    group = next(iter(groups.values()))
    return dist.get_rank(group=group) == 0, dist.get_global_rank(group, 0), group


def write_partitioned(layers: Sequence, uncovered: Sequence, *, seed: int, seed_drawn: bool, method: str,
                      v_mode: str, qk_gain: float, v_gain: float, report: bool, memory_budget, progress: bool,
                      mla: str, t_start: float):
    """Condition ``layers`` of a ZeRO-3 partitioned model (found by :func:`condinit.apply` within
    :func:`full_shapes`), one gathered layer at a time (see module doc). Collective: every rank of
    the model's process group calls it with the same layers."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from condinit.models.apply import UncoveredAttentionWarning, apply
    from condinit.models.report import ApplyReport

    if not dist.is_initialized():
        raise RuntimeError("the model's parameters are ZeRO-3 partitioned but torch.distributed is not initialized: "
                           "call condinit.apply on every rank, after deepspeed.init_distributed()")
    todo = []    # every layer's parameters and writer, checked before the first write
    for l in layers:
        params = _layer_params(l)
        todo.append((l, params, *_writer(params, l.name)))
    comm_device = torch.device(get_accelerator().current_device_name())
    if seed_drawn:       # every rank writes and reports the first rank's draw
        box = [seed]
        dist.broadcast_object_list(box, src=0, device=comm_device)
        seed = box[0]
    bar = None
    if progress and dist.get_rank() == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(layers), unit="layer", desc="condinit", leave=False)
    reports, launches = [], 0
    try:
        for l, params, writes, src, group in todo:
            box, error = [None], None
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                if writes:
                    try:
                        with warnings.catch_warnings():   # its uncovered parts were listed for the whole model
                            warnings.simplefilter("ignore", UncoveredAttentionWarning)
                            rep = apply(l.module, seed=seed, method=method, v_mode=v_mode, qk_gain=qk_gain,
                                        v_gain=v_gain, report=report, layer_offset=l.index,
                                        memory_budget=memory_budget, mla=mla)
                        (layer_rep,) = rep.layers
                        layer_rep.name, layer_rep.cross = l.name, l.cross
                        box = [(layer_rep, rep.launches, None)]
                    except Exception as exc:    # the other ranks wait for this rank's result: tell them
                        error = exc
                        box = [(None, 0, f"{type(exc).__name__}: {exc}")]
            dist.broadcast_object_list(box, src=src, group=group, device=comm_device)
            layer_rep, n, failed = box[0]
            if error is not None:
                raise error
            if failed is not None:
                raise RuntimeError(f"{l.name}: condinit.apply failed on rank {src}, which writes this layer: {failed}")
            reports.append(layer_rep)
            launches += n
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return ApplyReport(layers=reports, seed=seed, method=method, v_mode=v_mode, launches=launches,
                       total_time_s=time.perf_counter() - t_start, uncovered=list(uncovered), qk_gain=qk_gain,
                       v_gain=v_gain)
