"""Finding a model's attention layers: their numbering, include / exclude, and the attention-like
modules that no adapter or structure covers (listed, never skipped silently)."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from torch import nn

from condinit._validate import check_int
from condinit.init.functional import MAX_LAYER_INDEX

from .discovery import looks_like_attention, why_not_recognised
from .registry import describe
from .report import uncovered_listing
from .spec import AttentionSpec, UnsupportedAttention

__all__ = ["find_attention", "discover", "discover_for_writing", "check_model", "check_patterns",
           "no_attention_error", "AttentionLayer", "Uncovered", "Discovery", "UncoveredAttentionWarning",
           "UncoveredAttentionError"]


class UncoveredAttentionWarning(UserWarning):
    """:func:`condinit.apply` left attention-like modules unconditioned (listed in ``report.uncovered``)."""


class UncoveredAttentionError(ValueError):
    """``apply(..., strict=True)`` found attention-like modules it cannot condition; nothing was written."""


@dataclass
class AttentionLayer:
    """One attention module found in a model: its layer index, qualified name, adapter and spec
    (``cross``: Q reads the decoder's states, K and V the encoder's). The spec is bound to the
    module (:meth:`AttentionSpec.bound_to`): it reads the module's tensors as they are at each use,
    also after they are materialized or swapped."""

    index: int
    name: str
    module: nn.Module
    adapter: str
    spec: AttentionSpec
    cross: bool = False

    def live(self) -> "AttentionLayer":
        """This layer with a spec that reads the module's current tensors: itself when its spec is
        bound to the module, else the module described again (an adapter that returned tensors the
        module holds under no parameter or buffer name)."""
        if self.spec.is_bound:
            return self
        hit = describe(self.module)
        if hit is None:
            raise ValueError(f"{self.name}: the layer is no longer recognised once materialized")
        return replace(self, adapter=hit.adapter, spec=hit.spec)


@dataclass(frozen=True)
class Uncovered:
    """An attention-like module that :func:`condinit.apply` does not condition, and why."""

    name: str
    cls: str
    reason: str

    def __str__(self):
        return f"{self.name or '(root)'} ({self.cls}): {self.reason}"


@dataclass
class Discovery:
    """What :func:`discover` found: the attention layers (after include/exclude) and the
    attention-like modules left out (``uncovered``), both in ``named_modules`` order."""

    layers: list
    uncovered: list


def find_attention(model: nn.Module, *, layer_offset: int = 0, include=None, exclude=None) -> list[AttentionLayer]:
    """Every attention module of ``model`` that condinit can condition, numbered as
    :mod:`condinit.models.apply` documents (:func:`discover` also lists what it cannot).

    ``include`` / ``exclude``: a pattern or a list of ``fnmatch`` patterns on module names (``""`` is
    the root), applied after numbering.

    Examples:
        >>> model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(64, 4), num_layers=2)
        >>> [(l.index, l.name, l.spec.num_heads) for l in find_attention(model)]
        [(0, 'layers.0.self_attn', 4), (1, 'layers.1.self_attn', 4)]
        >>> [l.index for l in find_attention(model, include="layers.1.*")]
        [1]
    """
    return discover(model, layer_offset=layer_offset, include=include, exclude=exclude).layers


def discover(model: nn.Module, *, layer_offset: int = 0, include=None, exclude=None) -> Discovery:
    """The attention layers of ``model`` and the attention-like modules that none covers.

    A module is a layer when an adapter or its structure describes it
    (:func:`condinit.models.describe`). It is *uncovered* when it is refused with a reason
    (multi-head latent attention, a fused projection whose layout its source does not confirm, no
    head count), when it holds a second set of Q/K/V projections that the layer leaves out, or when
    its class name says attention (:func:`condinit.models.discovery.looks_like_attention`) and no
    layer or refused module lies inside it. ``include`` / ``exclude`` select both lists.

    Examples:
        >>> found = discover(model)
        >>> [str(u) for u in found.uncovered]
        ['model.layers.0.self_attn (DeepseekV3Attention): multi-head latent attention ...']
    """
    check_model(model)
    layer_offset = check_int("layer_offset", layer_offset, min=0, max=MAX_LAYER_INDEX)
    return _discover(model, layer_offset, check_patterns(include, "include"), check_patterns(exclude, "exclude"))


def check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def _class_name(mod) -> str:
    return type(mod).__name__


def _selected(name: str, inc: Optional[list], exc: Optional[list]) -> bool:
    return ((inc is None or any(fnmatch.fnmatchcase(name, p) for p in inc))
            and not (exc and any(fnmatch.fnmatchcase(name, p) for p in exc)))


_CROSS_NAMES = {"encoder_attn", "EncDecAttention", "crossattention", "cross_attn", "cross_attention",
                "multihead_attn", "encoder_attention", "src_attn"}


def _is_cross(name: str, mod: nn.Module) -> bool:
    return getattr(mod, "is_cross_attention", None) is True or bool(_CROSS_NAMES & set(name.split(".")))


def discover_for_writing(model: nn.Module, layer_offset: int, inc, exc, include, exclude,
                          strict: bool, v_mode: str) -> Discovery:
    """:func:`_discover`, plus the checks every writer makes before its first write: some
    attention found, nothing uncovered under ``strict``, floating-point projections, and a V that
    ``v_mode`` can write in every layer (a grouped convolution holds only block-diagonal entries)."""
    found = _discover(model, layer_offset, inc, exc)
    if not found.layers:
        raise no_attention_error(model, include, exclude, found.uncovered)
    if found.uncovered and strict:
        raise UncoveredAttentionError(
            f"strict: {len(found.uncovered)} attention-like module(s) of {type(model).__name__} cannot be "
            f"conditioned, nothing was written ({_WHAT_TO_DO}): {uncovered_listing(found.uncovered)}")
    for l in found.layers:
        for p, proj in l.spec.projections():
            if not proj.weight.is_floating_point():
                raise TypeError(f"{l.name}: {p} weight has dtype {proj.weight.dtype}, expected a floating dtype")
        why = l.spec.v_identity_problem(v_mode)
        if why is not None:
            raise ValueError(f"{l.name}: v_mode={v_mode!r} cannot be written: {why}")
    return found


def _discover(model: nn.Module, layer_offset: int, inc: Optional[list], exc: Optional[list]) -> Discovery:
    found, uncovered, pending = [], [], []
    claimed: set = set()       # names of described or refused modules and all their ancestors
    stop = None                # the last described or refused module: its inside is its own (pre-order walk)

    def claim(name):
        claimed.add(name)
        parts = name.split(".") if name else []
        for i in range(len(parts)):
            claimed.add(".".join(parts[:i]))

    for order, (name, mod) in enumerate(model.named_modules()):
        if stop is not None and (stop == "" or name.startswith(stop + ".")):
            continue
        selected = _selected(name, inc, exc)
        try:
            hit = describe(mod)
        except UnsupportedAttention as exc_info:
            stop = name
            claim(name)
            if selected:
                uncovered.append((order, Uncovered(name, _class_name(mod), str(exc_info))))
            continue
        except ValueError as exc_info:
            if not selected:   # an excluded module: its inconsistency is not this call's business
                stop = name
                continue
            raise ValueError(f"{name or '(root)'} ({_class_name(mod)}): {exc_info}") from None
        if hit is None:
            if looks_like_attention(mod):
                pending.append((order, name, mod))
            continue
        stop = name
        claim(name)
        found.append(AttentionLayer(layer_offset + len(found), name, mod, hit.adapter, hit.spec, _is_cross(name, mod)))
        if hit.partial and selected:
            uncovered.append((order, Uncovered(name, _class_name(mod), hit.partial)))
    for order, name, mod in reversed(pending):   # innermost first: a wrapper of a listed module is not listed again
        if name in claimed or not _selected(name, inc, exc):
            continue
        claim(name)
        uncovered.append((order, Uncovered(name, _class_name(mod), why_not_recognised(mod))))
    uncovered.sort(key=lambda ent: ent[0])
    return Discovery([l for l in found if _selected(l.name, inc, exc)], [u for _, u in uncovered])


def check_patterns(pats, what):
    if pats is None:
        return None
    if isinstance(pats, str):
        return [pats]
    pats = list(pats)
    if not all(isinstance(p, str) for p in pats):
        raise TypeError(f"{what} must be a pattern string or a list of them, got {pats!r}")
    return pats


_WHAT_TO_DO = ("describe them with condinit.models.register_adapter(TheirClass, lambda m: AttentionSpec.from_linears"
               "(...) or AttentionSpec.from_fused(..., layout=...)) (condinit init: --adapter module:function), or "
               "acknowledge them with exclude=[...]")


def no_attention_error(model, include, exclude, uncovered: Sequence[Uncovered] = ()):
    if include is not None or exclude is not None:
        return ValueError(f"no attention layer of {type(model).__name__} matches include={include!r} "
                          f"exclude={exclude!r}")
    if uncovered:
        return UncoveredAttentionError(f"no attention layer of {type(model).__name__} can be conditioned (to condition "
                                       f"them, {_WHAT_TO_DO}); attention-like modules found: "
                                       f"{uncovered_listing(uncovered, 20)}")
    return ValueError(f"no attention layer found in {type(model).__name__}: no submodule has a registered adapter or "
                      f"the projections condinit reads (q_proj/k_proj/v_proj, query/key/value, qkv, ...); add one with "
                      f"condinit.models.register_adapter(YourAttention, lambda m: AttentionSpec.from_linears(...))")

