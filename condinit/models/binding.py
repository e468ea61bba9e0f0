"""Binding a description to its module: a :class:`Ref` names the attribute that holds a tensor, read
at each use, so a description outlives materializing, swapping or unsharding the tensors."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from torch import nn

__all__ = ["Ref", "resolve", "tensor_places"]


@dataclass(frozen=True, eq=False)
class Ref:
    """Attribute ``name`` of module ``owner`` (a parameter, a buffer or a submodule), read at each
    use (:meth:`get`): what a bound description holds instead of the tensors themselves."""

    owner: nn.Module
    name: str

    def get(self):
        return getattr(self.owner, self.name)

    def __repr__(self):
        return f"Ref({type(self.owner).__name__}.{self.name})"


def resolve(source):
    """The object a :class:`Ref` points to now, or ``source`` itself when it is no Ref."""
    return source.get() if isinstance(source, Ref) else source


def tensor_places(module: nn.Module) -> dict:
    """``id(tensor) -> Ref`` for every parameter and buffer of ``module`` and of its submodules
    (the first name of a tensor held under several)."""
    places: dict = {}
    for owner in module.modules():
        for name, t in itertools.chain(owner.named_parameters(recurse=False), owner.named_buffers(recurse=False)):
            places.setdefault(id(t), Ref(owner, name))
    return places
