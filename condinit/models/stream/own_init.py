"""The model's own init of a meta-device ``PreTrainedModel``, in place, drawn as the streamed writer
draws it: ``condinit.apply`` on a meta model gives the bytes ``condinit init`` writes.

Every tensor is computed by the :class:`condinit.models.stream.materialize.Materializer` under the
name a checkpoint saves it by (its own-init stream), unit by unit while the rest of the model stays
on meta, exactly as :func:`condinit.models.stream.write_pretrained` computes it; then the model's
meta tensors are replaced by the computed ones (a tensor shared by several modules, e.g. tied
embeddings, stays one tensor). Non-persistent buffers (rotary frequencies, position ids) are
computed the same way under their first name.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from .materialize import Materializer
from .shards import saved_state

__all__ = ["own_init_"]


def _named_tensors(model: nn.Module) -> dict:
    """``{name: tensor}``: the tensors a checkpoint saves (under its names), then the other buffers,
    each tensor once."""
    state = saved_state(model)
    seen = {id(t) for t in state.values()}
    for name, t in model.named_buffers(remove_duplicate=False):
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            state[name] = t
    return state


def own_init_(model: nn.Module, seed: int, device: torch.device, *, skip: Iterable[torch.Tensor] = (),
              check: bool = True) -> list:
    """Allocate the meta-device ``PreTrainedModel`` ``model`` on ``device`` with its own init, in
    place (see module doc). ``skip``: tensors (as the meta model holds them) the caller overwrites
    next, allocated uninitialized. Then every module is marked initialized as ``initialize_weights``
    leaves it, and the model's weights are tied (``tie_weights``).

    Returns:
        The names of the floating tensors the own init leaves uninitialized (with ``check``; they
        hold NaN).
    """
    state = _named_tensors(model)
    engine = Materializer(model, state, seed, device, skip=skip, check=check)
    computed, left = {}, []
    for unit in engine.unit_modules:       # module units only: nothing is conditioned here
        replays = engine.replays(unit)
        if replays is not None:
            for key, replay in replays.items():
                t = torch.empty(state[key].shape, dtype=state[key].dtype, device=device)
                replay.write_into(t.view(-1), seed)
                computed[key] = t
            continue
        fresh, uninitialized = engine.own_init(unit.name)
        prefix = f"{unit.name}." if unit.name else ""
        computed.update({prefix + attr: t for attr, t in fresh.items()})
        left += [k for k in uninitialized if state[k].is_floating_point()]
    new = {}    # id of a meta tensor -> what replaces it everywhere
    for key, t in computed.items():
        old = state[key]
        if isinstance(old, nn.Parameter) and not isinstance(t, nn.Parameter):
            t = nn.Parameter(t, requires_grad=old.requires_grad)
        new[id(old)] = t if isinstance(old, nn.Parameter) else t.detach()
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for attr, old in table.items():
                if old is not None and id(old) in new:
                    table[attr] = new[id(old)]
        mod._is_hf_initialized = True
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    return left
