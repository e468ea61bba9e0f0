"""Fused attention with forward- and reverse-mode AD (issue 4; math in DESIGN.md section 3).

* :func:`attention` — ``softmax(scale Q K^T) V`` as a differentiable op: reverse mode through the
  flash VJP from the saved log-sum-exp, forward mode through the fused JVP kernel; works under
  ``torch.func`` (jvp, vjp, jacfwd, jacrev, vmap) and ``torch.compile``.
* :func:`attention_jvp` — the single-pass fused JVP with several probes at once, differentiable
  in all six inputs.

Backends (``python -m condinit info``): cuda, triton, cpp-cpu, and the tiled PyTorch reference
(:mod:`condinit.attention.reference`).
"""
from condinit.attention.op import attention, attention_jvp

__all__ = ["attention", "attention_jvp"]



# `condinit.attention` names both this subpackage and the function. When the subpackage is
# imported (`from condinit.attention import ...`), Python binds the module as the attribute
# `condinit.attention` after running this file, shadowing condinit's lazy re-export of the
# function; then `condinit.attention(q, k, v)` would fail, and torch.compile cannot call a
# module. So the package keeps the function under that name (the module stays in sys.modules,
# which is what `from condinit.attention import x` reads), and this module is callable too, for
# code that holds it (`import condinit.attention as m; m(q, k, v)`).
import sys as _sys
import types as _types

import condinit as _condinit


class _CallableModule(_types.ModuleType):
    def __call__(self, *args, **kwargs):
        return attention(*args, **kwargs)

    def __getattr__(self, name):
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")


class _PackageKeepingAttention(type(_condinit)):
    def __setattr__(self, name, value):
        if name == "attention" and isinstance(value, _types.ModuleType):
            return  # the import system binding this subpackage: keep the function
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _CallableModule
if type(_condinit) is _types.ModuleType:
    _condinit.__class__ = _PackageKeepingAttention
_condinit.__dict__["attention"] = attention
_condinit.__dict__["attention_jvp"] = attention_jvp
