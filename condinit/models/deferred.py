"""Deferred initialization: materialize a model built on the meta device, with its own init.

``with torch.device("meta"): model = Model(cfg)`` allocates nothing. :func:`materialize_` then

1. records which parameters are shared (tied embeddings): ``Module.to_empty`` gives each owner its
   own new tensor, so ties are restored afterwards (one allocation per shared parameter);
2. ``model.to_empty(device)`` allocates the model once, uninitialized, in its own dtype;
3. fills every floating parameter and buffer with NaN, so that anything no init touches is caught;
4. runs the model's **own** initialization on everything except the Q/K/V weights and biases that
   :func:`condinit.apply` is about to overwrite (``skip``), the way the model's library does it:

   * Hugging Face ``PreTrainedModel``: the streamed writer's own init
     (:func:`condinit.models.stream.own_init_`): each module's ``_init_weights`` (and its
     ancestors', in ``initialize_weights``' order) with every ``normal_`` drawn from the tensor's
     named counter-based stream under ``seed``, so the tensors are bit for bit those that
     ``condinit init`` / :func:`condinit.models.stream.write_pretrained` write with that seed (the
     model is allocated module by module instead of by ``to_empty``; ties are kept), then
     ``model.tie_weights()``. A sharded one (DTensor parameters) gets ``model.initialize_weights()``
     on its shards instead (torch's generator), with the skipped tensors flagged
     ``_is_hf_initialized`` so the library's guarded init functions pass over them;
   * anything else: ``reset_parameters()`` (or ``_reset_parameters()``, as ``nn.MultiheadAttention`` /
     ``nn.Transformer`` name it) on every module, children before parents (the order of
     construction, so a parent's scheme wins as it does at construction, and torch's generator is
     drawn in the same order as when the model is built on a real device); then the root's
     ``init_weights()`` if it has one taking no arguments (timm ``VisionTransformer``,
     torchtitan-style models). No reset is left out, not even one whose module's own parameters
     are all skipped: a reset may write its children's parameters too (``nn.MultiheadAttention``'s
     zeroes ``out_proj.bias``, which ``nn.Linear``'s reset had drawn at random), and only the
     module's own code knows. The skipped tensors it writes are overwritten next;
   * or ``init_fn(model)`` when given, instead of both;

5. checks that no non-skipped floating parameter or buffer is still NaN, and raises ValueError
   naming them otherwise (pass ``init_fn``). Integer buffers (e.g. ``position_ids``) cannot be
   checked this way; HF's ``_init_weights`` rebuilds the ones it owns.

Memory: the model itself, once; nothing else of its size.
"""
from __future__ import annotations

import inspect
import sys
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from condinit._validate import check_bool, check_seed
from condinit.init.functional import draw_seed

from .sharded import is_dtensor

__all__ = ["has_meta", "materialize_"]


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` lives on the meta device."""
    return any(t.is_meta for t in _tensors(model))


def _tensors(model):
    yield from model.parameters()
    yield from (b for b in model.buffers() if b is not None)


def _param_owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((mod, attr))
    return owners


def _is_pretrained(model) -> bool:
    """A transformers ``PreTrainedModel`` (whose module is then already imported)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


def _is_hf_model(model) -> bool:
    return (callable(getattr(model, "_init_weights", None)) and hasattr(model, "config")
            and (callable(getattr(model, "initialize_weights", None)) or callable(getattr(model, "init_weights", None))))


def _zero_arg_callable(fn) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    return all(p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in sig.parameters.values())


def _hf_init(model, skip_ids: set[int]):
    marked = []
    for p in model.parameters():
        if id(p) in skip_ids:
            p._is_hf_initialized = True
            marked.append(p)
    for mod in model.modules():
        if getattr(mod, "_is_hf_initialized", False):
            mod._is_hf_initialized = False
    try:
        if callable(getattr(model, "initialize_weights", None)):
            model.initialize_weights()
        else:  # transformers < 4.50
            with torch.no_grad():
                model.apply(model._init_weights)
    finally:
        # modules keep the flag HF sets after initializing them (as after a normal construction);
        # the parameters condinit overwrites lose the mark added above
        for p in marked:
            p.__dict__.pop("_is_hf_initialized", None)
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()


def _generic_init(model: nn.Module):
    with torch.no_grad():
        # post-order: children first, like construction
        def visit(mod):
            for child in mod.children():
                visit(child)
            for fn_name in ("reset_parameters", "_reset_parameters"):
                fn = getattr(mod, fn_name, None)
                if callable(fn) and _zero_arg_callable(fn):
                    fn()
                    break
        visit(model)
        root_init = getattr(model, "init_weights", None)
        if callable(root_init) and _zero_arg_callable(root_init):
            root_init()


def materialize_(model: nn.Module, device=None, *, skip: Iterable[torch.Tensor] = (),
                 init_fn: Optional[Callable[[nn.Module], None]] = None, check: bool = True,
                 seed: Optional[int] = None) -> nn.Module:
    """Allocate a meta-device ``model`` on ``device`` (default CPU) and run its own init (see module doc).

    ``skip``: parameters (as the meta model holds them) that the caller overwrites next; they are
    neither initialized nor checked. ``seed``: the own-init streams of a Hugging Face model
    (``0 <= seed < 2**64``; default None: one draw from torch's default generator, so
    ``torch.manual_seed`` controls it); not used by ``init_fn`` or by other models. Returns
    ``model`` (modified in place).

    Examples:
        >>> with torch.device("meta"):
        ...     model = MyModel(cfg)
        >>> materialize_(model, "cuda")                          # the model's own init, on the GPU
        >>> materialize_(model2, init_fn=lambda m: m.init_weights(std=0.02))
        >>> materialize_(llama_on_meta, seed=0)                 # the tensors condinit init --seed 0 writes
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"init_fn must be a callable init_fn(model) or None, got {type(init_fn).__name__}")
    check = check_bool("check", check)
    seed = check_seed("seed", seed, allow_none=True)
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "meta":
        raise ValueError("materialize_: device must be a real device (cpu, cuda, ...), got meta")
    if init_fn is None and _is_pretrained(model) and not any(is_dtensor(t) for t in _tensors(model)):
        # imported here: the stream package imports condinit.models.apply, which imports this module
        from .stream import own_init_

        _check_initialized(own_init_(model, draw_seed(seed, None), device, skip=skip, check=check))
        return model
    skip_names = set()
    by_id = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for t in skip:
        if id(t) in by_id:
            skip_names.add(by_id[id(t)])
    owners = _param_owners(model)
    tied = [own for own in owners.values() if len(own) > 1]
    model.to_empty(device=device)
    for own in tied:
        first_mod, first_attr = own[0]
        shared = first_mod._parameters[first_attr]
        for mod, attr in own[1:]:
            mod._parameters[attr] = shared
    params = dict(model.named_parameters(remove_duplicate=False))
    skip_ids = {id(params[n]) for n in skip_names if n in params}
    if check:
        with torch.no_grad():
            for t in _tensors(model):
                if t.is_floating_point() and id(t) not in skip_ids:
                    t.fill_(float("nan"))
    if init_fn is not None:
        init_fn(model)
    elif _is_hf_model(model):
        _hf_init(model, skip_ids)
    else:
        _generic_init(model)
    if check:
        bad = []
        seen = set()
        named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
        for name, t in named:
            if t is None or id(t) in seen or id(t) in skip_ids or not t.is_floating_point():
                continue
            seen.add(id(t))
            local = t.to_local() if hasattr(t, "to_local") else t
            if bool(torch.isnan(local).any()):
                bad.append(name)
        _check_initialized(bad)
    return model


def _check_initialized(bad: list) -> None:
    """Raise for the tensors ``bad`` (names) that the model's own init left uninitialized."""
    if bad:
        shown = ", ".join(bad[:8]) + (f" (+{len(bad) - 8} more)" if len(bad) > 8 else "")
        raise ValueError(f"materialize: {len(bad)} tensor(s) of the meta model were not initialized by its own "
                         f"init (no reset_parameters / _init_weights / init_weights covers them): {shown}; "
                         f"pass init_fn=callable(model) to initialize them")
