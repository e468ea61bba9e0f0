"""Shard planning: which tensors a checkpoint holds, under which names, in which weights files, as
``save_pretrained`` plans them.

State-dict order, tied weights once under the name ``save_pretrained`` keeps, a new shard when the
next tensor would pass ``max_shard_size``, a bigger tensor alone in its own shard; a model that fits
in one shard is the one file ``model.safetensors``.
"""
from __future__ import annotations

import re
from typing import Union

from torch import nn

from condinit._util import tensor_bytes
from condinit._validate import check_int
from condinit.io.safetensors_format import WEIGHTS_NAME, shard_name

__all__ = ["parse_shard_size", "plan_shards", "plan_files", "saved_state"]

_SIZE_UNITS = {"TB": 10 ** 12, "GB": 10 ** 9, "MB": 10 ** 6, "KB": 10 ** 3, "B": 1,
               "TIB": 2 ** 40, "GIB": 2 ** 30, "MIB": 2 ** 20, "KIB": 2 ** 10}


def parse_shard_size(value, name: str = "max_shard_size") -> int:
    """Bytes for ``max_shard_size``: an int >= 1, or a string such as ``"5GB"`` / ``"500MB"``
    (powers of 10, as ``save_pretrained`` counts), ``"2GiB"`` (powers of 2) or plain digits (bytes).
    ``name`` starts the error message.

    Examples:
        >>> parse_shard_size("500MB")
        500000000
        >>> parse_shard_size(1 << 20)
        1048576
    """
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]I?B|B)?\s*", value.upper())
        if m is None:
            raise ValueError(f"{name} must be a size such as 5GB, 500MB, 2GiB or a number of bytes, got {value!r}")
        size = int(float(m[1]) * _SIZE_UNITS[m[2] or "B"])
        if size < 1:
            raise ValueError(f"{name} must be at least 1 byte, got {value!r}")
        return size
    return check_int(name, value, min=1)


def _tied_patterns(model: nn.Module) -> list:
    pats = []
    for name, sub in model.named_modules():
        tied = getattr(sub, "_tied_weights_keys", None) or ()
        pats.extend(f"{name}.{k}" if name else k for k in tied)
    return pats


def saved_state(model: nn.Module) -> dict:
    """``{key: tensor}`` in state-dict order, each shared tensor once, under the name that
    ``save_pretrained`` keeps (it drops the names that match a ``_tied_weights_keys`` pattern)."""
    objects = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mname}." if mname else ""
        for attr, t in mod._parameters.items():
            if t is not None:
                objects[prefix + attr] = t
        for attr, t in mod._buffers.items():
            if t is not None and attr not in mod._non_persistent_buffers_set:
                objects[prefix + attr] = t
    keys = list(model.state_dict(keep_vars=True).keys())
    groups: dict[int, list] = {}
    for k in keys:
        groups.setdefault(id(objects[k]), []).append(k)
    pats = _tied_patterns(model)
    drop = set()
    for names in groups.values():
        if len(names) < 2:
            continue
        found = 0
        for n in sorted(names):
            if any(re.search(p, n) for p in pats):
                found += 1
                if found < len(names):
                    drop.add(n)
        if len([n for n in names if n not in drop]) > 1:
            raise ValueError(f"tensors {sorted(names)} are one shared tensor, and the model's _tied_weights_keys "
                             f"({pats}) do not say which name a checkpoint keeps")
    return {k: objects[k] for k in keys if k not in drop}


def plan_shards(model: nn.Module, max_shard_size: Union[int, str] = "5GB") -> dict:
    """The weights files ``save_pretrained`` would write for ``model`` (any device, meta included):
    ``{file name: [state-dict keys]}`` in order. Tied tensors appear once.

    Examples:
        >>> with torch.device("meta"):
        ...     model = transformers.AutoModelForCausalLM.from_config(config)
        >>> list(plan_shards(model, "500MB"))
        ['model-00001-of-00003.safetensors', 'model-00002-of-00003.safetensors', ...]
    """
    limit = parse_shard_size(max_shard_size)
    return plan_files(saved_state(model), limit)


def plan_files(state: dict, limit: int) -> dict:
    """``{file name: [keys]}`` for the tensors of ``state`` (``{key: tensor}``, in order) in files of
    at most ``limit`` bytes each (a bigger tensor alone in its own file)."""
    shards, current, size = [], [], 0
    for k, t in state.items():
        n = tensor_bytes(t)
        if n > limit:
            shards.append([k])
            continue
        if size + n > limit:
            shards.append(current)
            current, size = [], 0
        current.append(k)
        size += n
    if current:
        shards.append(current)
    if len(shards) == 1:
        return {WEIGHTS_NAME: shards[0]}
    return {shard_name(i + 1, len(shards)): s for i, s in enumerate(shards)}
