"""A model-only torch.distributed.checkpoint (DCP) directory of a conditioned model: torchtitan's
seed checkpoint.

:func:`write_dcp` conditions the model in place (:func:`condinit.apply`, shard by shard for FSDP2 /
tensor-parallel DTensors) and saves ``model.state_dict()`` with
``torch.distributed.checkpoint.save``: every rank writes its own shards in parallel, and the
coordinator writes the ``.metadata`` file last. The keys are the model's own: for torchtitan's
models ``layers.{i}.attention.qkv_linear.wq.weight`` and so on (``FusedQKVLinear`` splits ``wqkv``
on save), which torchtitan's ``CheckpointManager`` reads at step 0 of a model-only checkpoint
(``--checkpoint.initial_load_path DIR``, ``initial_load_model_only``).
"""
from __future__ import annotations

import os

from torch import nn

from condinit.io.atomic import check_output_dir

__all__ = ["write_dcp"]


def write_dcp(model: nn.Module, out_dir, *, seed: int, **apply_kwargs):
    """Condition ``model`` (:func:`condinit.apply` with ``seed`` and ``apply_kwargs``) and write its
    state dict to the DCP directory ``out_dir``; returns the :class:`~condinit.models.ApplyReport`.

    Call it on every rank of an initialized process group (a collective, like
    ``torch.distributed.checkpoint.save``) or in a single process. ``out_dir`` must be an empty,
    writable directory or one that can be created; it is checked before anything is written. The
    model must hold values (after ``to_empty`` and its own init for a meta-built model, or a meta
    model that :func:`condinit.apply` materializes).

    Examples:
        >>> with torch.device("meta"):
        ...     model = Llama3Model.Config(...).build()
        >>> fully_shard(model, mesh=mesh); model.to_empty(device="cuda"); model.init_states()
        >>> write_dcp(model, "seed_ckpt/", seed=0)      # on every rank
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"write_dcp: model must be an nn.Module, got {type(model).__name__}")
    try:
        out_dir = check_output_dir(out_dir)       # a directory, or one that can be created, writable
    except ValueError as exc:
        raise ValueError(f"write_dcp: out_dir: {exc}") from None
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ValueError(f"write_dcp: out_dir {out_dir} is not empty (a DCP directory is written whole)")
    import torch.distributed.checkpoint as dcp

    from condinit.models.apply import apply

    report = apply(model, seed=seed, **apply_kwargs)
    dcp.save(model.state_dict(), checkpoint_id=out_dir)
    return report
