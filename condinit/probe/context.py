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

# torch's functorch TransformType names, as the torch.func transforms a user calls that run under
# each: the interpreter stack says only which kind (``jacrev`` and ``vjp`` run as ``grad`` does,
# ``jacfwd`` as ``jvp`` inside ``vmap``), so every transform of the kind is named
_TRANSFORM_NAMES = {"Vmap": "vmap", "Grad": "grad, vjp or jacrev", "Jvp": "jvp or jacfwd",
                    "Functionalize": "functionalize"}


def functorch_transform() -> Optional[str]:
    """The innermost :mod:`torch.func` transform in effect, as the transforms of its kind
    (``"vmap"``, ``"grad, vjp or jacrev"``, ``"jvp or jacfwd"``, ``"functionalize"``), or None
    outside any."""
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
