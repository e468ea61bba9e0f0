"""Whether a forward the monitor's hooks see can be measured: the torch.func transform or the
torch.compile trace it runs under, told apart before any tensor is read.

Under a :mod:`torch.func` transform (``vmap``, ``grad``, ``jvp``, ``functionalize``, and the
``vjp`` / ``jacrev`` / ``jacfwd`` built on them) the hook's tensors are transform wrappers: reading
their values (a finiteness check, a copy kept for later) is not defined on them, so that forward is
not measured. Under ``torch.compile`` the hooks are traced into the graph, and the graph that runs
later does not call them, so nothing is captured either. ``torch.func.functional_call``, autocast,
``no_grad`` and ``inference_mode`` give plain tensors: those forwards are measured.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["functorch_transform", "compiling"]

# torch's functorch TransformType names, as the torch.func transform a user calls
_TRANSFORM_NAMES = {"Vmap": "vmap", "Grad": "grad", "Jvp": "jvp", "Functionalize": "functionalize"}


def functorch_transform() -> Optional[str]:
    """The innermost :mod:`torch.func` transform in effect (``"vmap"``, ``"grad"``, ``"jvp"``,
    ``"functionalize"``), or None outside any."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    if peek is None:
        return None
    interpreter = peek()
    if interpreter is None:
        return None
    name = interpreter.key().name
    return _TRANSFORM_NAMES.get(name, name.lower())


def compiling() -> bool:
    """Whether the code runs inside a ``torch.compile`` trace."""
    return torch.compiler.is_compiling()
