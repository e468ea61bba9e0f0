"""Loading the optional native extension ``condinit._C``.

The extension registers its kernels under the torch.library namespace ``condinit_C`` when it
is imported. It may be missing (no compiler at install time) or stale (built against another
torch); either way condinit keeps working through Triton / PyTorch and :func:`status` says why.
Loading never initializes CUDA.
"""
from __future__ import annotations

import warnings

from condinit._util import memoized

__all__ = ["load", "status", "has_op"]


@memoized
def _load():
    try:
        import torch  # noqa: F401  (the extension links against libtorch)
        from condinit import _C
    except ImportError as exc:
        msg = str(exc)
        if "No module named" in msg:
            why = ("native extension not built (reinstall with `pip install --no-build-isolation .` "
                   "where a C++ compiler is available)")
        else:
            why = f"native extension failed to load: {msg}"
        return None, why
    except Exception as exc:  # e.g. undefined symbols from a torch version mismatch
        warnings.warn(f"condinit: native extension failed to load ({exc}); using fallbacks")
        return None, f"native extension failed to load: {exc}"
    import torch
    built = _C.build_info.get("torch_version", "unknown")
    if built.split("+")[0] != torch.__version__.split("+")[0]:
        return None, f"native extension built for torch {built}, running torch {torch.__version__}: rebuild it"
    return _C, "loaded"


def load():
    """Return the ``condinit._C`` module, or None when it is unavailable."""
    return _load()[0]


def status() -> tuple[bool, str]:
    mod, why = _load()
    return mod is not None, why


def build_info() -> dict:
    mod = load()
    return dict(mod.build_info) if mod is not None else {}


def has_op(name: str, dispatch_key: str) -> bool:
    """Whether ``condinit_C::name`` has a kernel for ``dispatch_key`` ("CPU" or "CUDA")."""
    if load() is None:
        return False
    import torch
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"condinit_C::{name}", dispatch_key)
    except RuntimeError:
        return False
