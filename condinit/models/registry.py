"""The adapter registry: which adapter describes which attention class, and :func:`describe`.

How a module is recognised (:func:`describe`), first match wins:

1. an adapter registered for its class, looked up along the MRO (a subclass of a supported class
   is supported; an adapter registered for ``nn.Module`` sees every module). An adapter returns
   ``None`` for a module it does not handle, and the lookup goes on;
2. its structure (:mod:`condinit.models.discovery`): three separate projections under one of the
   naming families of :data:`~condinit.models.discovery.SEPARATE_NAMES`, a ``q`` projection with a
   fused ``kv``, a fused ``qk`` with a ``v``, or one fused projection whose split the class's own
   source confirms. Everything else that looks like attention is refused with a reason
   (:class:`~condinit.models.spec.UnsupportedAttention`), never guessed.

The spec found is bound to the module (:meth:`AttentionSpec.bound_to`) and carries the module's
:class:`~condinit.models.spec.AttentionDetails` (an adapter may set them; otherwise they are read
from the module's attributes, :func:`condinit.models.discovery.read_details`), so a layer is
described once and the description serves for as long as the module keeps its structure.

Registry keys are classes or ``"module.path.QualName"`` strings; the built-in adapters for
third-party libraries (:mod:`condinit.models.families`) are keyed by string so that neither
transformers nor timm is imported by condinit.

Add your own in a few lines::

    from condinit.models import register_adapter, AttentionSpec

    register_adapter(MyAttention, lambda m: AttentionSpec.from_linears(
        m.wq, m.wk, m.wv, num_heads=m.n_heads, num_kv_heads=m.n_kv_heads))
    register_adapter(MyFused, lambda m: AttentionSpec.from_fused(      # rows [H, 3, d]
        m.wqkv.weight, num_heads=m.heads, bias=m.wqkv.bias, layout="per_head"))
"""
from __future__ import annotations

from typing import Callable, Optional, Union

from torch import nn

from .discovery import read_details, structural
from .spec import AttentionSpec, Described

__all__ = ["AttentionAdapter", "register_adapter", "unregister_adapter", "get_adapter", "registered_adapters",
           "describe", "spec_of"]


class AttentionAdapter:
    """Maps one kind of attention module to its :class:`AttentionSpec`.

    Subclass and override :meth:`spec` (and set ``name``), or pass any callable ``module -> AttentionSpec``
    to :func:`register_adapter`, which wraps it in this class. ``spec`` returns None for a module it
    does not handle (the lookup goes on, see :func:`describe`) and raises
    :class:`UnsupportedAttention` for one that must not be conditioned.
    """

    name = "custom"

    def __init__(self, fn: Optional[Callable[[nn.Module], Optional[AttentionSpec]]] = None,
                 name: Optional[str] = None):
        self._fn = fn
        if name is not None:
            self.name = name
        elif fn is not None:
            self.name = getattr(fn, "__name__", "custom")

    def spec(self, module: nn.Module) -> Optional[AttentionSpec]:
        if self._fn is None:
            raise NotImplementedError(f"{type(self).__name__}.spec")
        return self._fn(module)

    def __repr__(self):
        return f"<AttentionAdapter {self.name}>"


_REGISTRY: dict[Union[type, str], AttentionAdapter] = {}


def _key(cls_or_name) -> Union[type, str]:
    if isinstance(cls_or_name, str):
        if "." not in cls_or_name:
            raise ValueError(f"register_adapter: a string key must be 'module.path.ClassName', got {cls_or_name!r}")
        return cls_or_name
    if isinstance(cls_or_name, type) and issubclass(cls_or_name, nn.Module):
        return cls_or_name
    raise TypeError(f"register_adapter: cls must be an nn.Module subclass or a 'module.path.ClassName' "
                    f"string, got {cls_or_name!r}")


def register_adapter(cls: Union[type, str],
                     adapter: Union[AttentionAdapter, Callable[[nn.Module], Optional[AttentionSpec]]],
                     *, name: Optional[str] = None) -> AttentionAdapter:
    """Register ``adapter`` for modules of class ``cls`` (and its subclasses, unless they have their own).

    ``cls``: an ``nn.Module`` subclass or its ``"module.path.QualName"`` (lets you register a class
    without importing its library); ``nn.Module`` itself registers an adapter that sees every
    module no more specific adapter handled. ``adapter``: an :class:`AttentionAdapter`, or a
    callable ``module -> AttentionSpec`` (wrapped; ``name`` labels it in reports) that returns None
    for modules it does not handle. Replaces an earlier registration for the same key. Returns the
    registered adapter.

    Examples:
        >>> register_adapter(MyAttention, lambda m: AttentionSpec.from_linears(
        ...     m.wq, m.wk, m.wv, num_heads=m.n_heads, num_kv_heads=m.n_kv_heads))
        >>> register_adapter("mylib.layers.FusedAttention",             # without importing mylib
        ...                  lambda m: AttentionSpec.from_fused(m.qkv.weight, num_heads=m.heads), name="mylib")
    """
    key = _key(cls)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"register_adapter: name must be a str or None, got {type(name).__name__}")
    if not isinstance(adapter, AttentionAdapter):
        if not callable(adapter):
            raise TypeError(f"register_adapter: adapter must be an AttentionAdapter or a callable "
                            f"module -> AttentionSpec, got {type(adapter).__name__}")
        adapter = AttentionAdapter(adapter, name=name or (key.__name__ if isinstance(key, type) else key.rsplit(".", 1)[1]))
    elif name is not None:
        adapter.name = name
    _REGISTRY[key] = adapter
    return adapter


def unregister_adapter(cls: Union[type, str]) -> None:
    """Remove the adapter registered for ``cls`` (KeyError if there is none)."""
    del _REGISTRY[_key(cls)]


def registered_adapters() -> dict:
    """A copy of the registry: key (class or dotted name) -> adapter."""
    return dict(_REGISTRY)


def _registered_chain(module: nn.Module):
    for klass in type(module).__mro__:
        if klass is object:
            break
        hit = _REGISTRY.get(klass)
        if hit is None:
            hit = _REGISTRY.get(f"{klass.__module__}.{klass.__qualname__}")
        if hit is not None:
            yield hit


def get_adapter(module: nn.Module) -> Optional[AttentionAdapter]:
    """The adapter registered for ``module``'s class or nearest registered base class, or None
    (structural discovery is not consulted: see :func:`describe`)."""
    return next(_registered_chain(module), None)


def describe(module: nn.Module) -> Optional[Described]:
    """How ``module`` keeps its Q/K/V (see the module doc for the order of lookups), or None when it
    is not recognised as an attention module. The spec is bound to ``module`` and carries its
    :class:`~condinit.models.spec.AttentionDetails`.

    Raises :class:`UnsupportedAttention` for an attention module that must not be conditioned
    (with the reason), ValueError when what the module says about its heads contradicts its
    projections.

    Examples:
        >>> describe(torch.nn.MultiheadAttention(64, 4)).spec.num_heads
        4
        >>> describe(torch.nn.Linear(4, 4)) is None
        True
    """
    found = None
    for adapter in _registered_chain(module):
        spec = adapter.spec(module)
        if spec is None:
            continue
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"adapter {adapter.name} returned {type(spec).__name__}, expected AttentionSpec or None")
        found = Described(adapter.name, spec)
        break
    else:
        found = structural(module)
    if found is None:
        return None
    spec = found.spec
    return found._replace(spec=spec.bound_to(module, spec.details or read_details(module, spec.head_dim)))


def spec_of(module: nn.Module) -> AttentionSpec:
    """The :class:`AttentionSpec` of one attention module (:func:`describe`); ValueError naming the
    class when it is not recognised, :class:`UnsupportedAttention` when it is refused.

    Examples:
        >>> spec_of(torch.nn.MultiheadAttention(64, 4)).head_dim
        16
    """
    found = describe(module)
    if found is None:
        raise ValueError(f"{type(module).__module__}.{type(module).__qualname__} is not recognised as attention: no "
                         f"adapter is registered for it and it has none of the projection names condinit reads; "
                         f"register one with condinit.models.register_adapter")
    return found.spec


from . import engines  # noqa: E402,F401  (registers the engines' adapters by dotted class name)
