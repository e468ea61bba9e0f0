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
# function: `condinit.attention(q, k, v)` would fail, and torch.compile cannot call a module.
# So `condinit.attention` (and `from condinit.attention import attention`) is one
# `_AttentionEntry`: it calls the function in condinit.attention.op (torch.compile traces it)
# and forwards attribute access to this module, so `condinit.attention.attention_jvp` and
# `import condinit.attention.reference as ref` keep working. The module itself stays in
# sys.modules (what `from condinit.attention import x` reads), and is callable too.
import inspect as _inspect
import sys as _sys
import types as _types

import condinit as _condinit

_attention = attention  # the function, under a name the `attention` property does not shadow


class _AttentionEntry:
    __doc__ = _attention.__doc__
    __wrapped__ = _attention                     # inspect.signature / help show attention's
    __signature__ = _inspect.signature(_attention)

    def __call__(self, *args, **kwargs):
        return _attention(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(_sys.modules[__name__], name)

    def __dir__(self):
        return dir(_sys.modules[__name__])

    def __repr__(self):
        return f"<function condinit.attention, also the module {__name__!r}>"


class _CallableModule(_types.ModuleType):
    def __call__(self, *args, **kwargs):
        return _attention(*args, **kwargs)

    # `from condinit.attention import attention` and condinit's lazy re-export both read this:
    # the same entry object everywhere (a data descriptor wins over the module's __dict__).
    attention = property(lambda self: _ENTRY)


class _PackageKeepingAttention(type(_condinit)):
    def __setattr__(self, name, value):
        if name == "attention" and isinstance(value, _types.ModuleType):
            return  # the import system binding this subpackage: keep the entry point
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _CallableModule
if type(_condinit) is _types.ModuleType:
    _condinit.__class__ = _PackageKeepingAttention
_ENTRY = _AttentionEntry()
_condinit.__dict__["attention"] = _ENTRY
_condinit.__dict__["attention_jvp"] = attention_jvp
