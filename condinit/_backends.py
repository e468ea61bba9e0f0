"""Backend tables: which implementation runs each op, and what each one supports.

Every op (``attention_fwd``, ``randn``, ``orthogonalize``, ...) is an :class:`Op` with one row per
backend, declared once next to the op's public function:

=========  ===========================================================  ==================
backend    what it is                                                    devices
=========  ===========================================================  ==================
cuda       CUDA C++ kernels in the native extension ``condinit._C``       cuda
triton     Triton kernels (``condinit.kernels``)                          cuda; cpu only under
                                                                          TRITON_INTERPRET=1
cpp-cpu    C++ CPU kernels in ``condinit._C`` (OpenMP)                    cpu
torch      the PyTorch reference implementation                          any
=========  ===========================================================  ==================

A row states the devices, the limits on the call (``dtype``, ``head_dim``, ``method``, ...) and
whether the implementation is deterministic. A limit is the tuple of values the row accepts; a
call gives one value per key, or a tuple of features it needs (``masks=("causal", "lens")``),
every one of which must be in the row's tuple. The public function of an op validates its
arguments, then calls :meth:`Op.choose` once: the first backend of the device's preference order
that is available (built, importable), accepts the call and is deterministic. The chosen name is
what the kernel call runs; there is no fallback at run time: an exception raised inside a kernel
reaches the caller. ``condinit info`` prints the same tables.

Forcing: the ``backend=`` argument of the public functions, or the environment variable
``CONDINIT_BACKEND`` (``CONDINIT_BACKEND=triton`` for every op, or
``CONDINIT_BACKEND=attention_jvp=torch,randn=cpp-cpu``), read once at the first op call
(:func:`reset` re-reads it). A forced backend that cannot run the call raises
:class:`BackendUnavailableError` with the reason; a forced backend may be non-deterministic.

Nothing here imports triton, loads the extension or touches CUDA until a backend's availability
is first asked for.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import torch

from condinit._util import memoized

__all__ = ["BACKENDS", "ENV_VAR", "BackendUnavailableError", "Op", "ops", "available", "reset",
           "report"]

BACKENDS = ("cuda", "triton", "cpp-cpu", "torch")
ENV_VAR = "CONDINIT_BACKEND"
ANY_DEVICE = "any"
# Automatic order per device type. Triton goes before the CUDA C++ kernels on GPUs until a
# measurement shows the CUDA kernel faster; Triton on the CPU (the interpreter) is slow, so it
# runs there only when forced.
PREFERENCE = {"cuda": ("triton", "cuda", "torch"), "cpu": ("cpp-cpu", "torch")}


class BackendUnavailableError(RuntimeError):
    """No backend can run this call, or the forced one cannot."""


def _shown(allowed) -> str:
    """A row's allowed values as `condinit info` and refusals print them."""
    if isinstance(allowed, range):
        return f"{allowed.start}..{allowed.stop - 1}"
    return ", ".join(str(a).replace("torch.", "") for a in allowed)


@dataclasses.dataclass(frozen=True)
class Impl:
    """One row of an op's table."""
    backend: str
    fn: Callable
    devices: tuple[str, ...]
    limits: tuple[tuple[str, tuple], ...] = ()   # (call key, allowed values: a tuple or a range)
    deterministic: bool = True
    native_op: Optional[str] = None              # condinit_C op that must have a kernel
    native_fn: Optional[str] = None              # condinit._C function that must exist

    def not_supported(self, device_type: str, call: dict) -> Optional[str]:
        """None when this row accepts the call, else why not."""
        if ANY_DEVICE not in self.devices and device_type not in self.devices:
            return f"runs on {'/'.join(self.devices)} tensors only"
        for key, allowed in self.limits:
            if key not in call:
                continue
            value = call[key]
            shown = _shown(allowed)
            if isinstance(value, tuple):   # a set of features the call needs: all must be allowed
                missing = tuple(x for x in value if x not in allowed)
                if missing:
                    return f"{key} {', '.join(map(str, missing))} not in ({shown})"
            elif value not in allowed:
                return f"{key} {str(value).replace('torch.', '')} not in ({shown})"
        return None

    def describe(self) -> str:
        parts = [f"{k}: {_shown(allowed)}" for k, allowed in self.limits]
        if not self.deterministic:
            parts.append("not deterministic (only when forced)")
        return "; ".join(parts) or "any"


_OPS: dict[str, "Op"] = {}


class Op:
    """The backend table of one op."""

    def __init__(self, name: str):
        if name in _OPS:
            raise ValueError(f"op {name!r} is already defined")
        self.name = name
        self.impls: dict[str, Impl] = {}
        _OPS[name] = self

    def register(self, backend: str, *, devices: tuple[str, ...], limits: Optional[dict] = None,
                 deterministic: bool = True, native_op: Optional[str] = None,
                 native_fn: Optional[str] = None):
        """Decorator: ``fn`` is this op's implementation on ``backend``."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

        def deco(fn):
            self.impls[backend] = Impl(backend, fn, tuple(devices),
                                       tuple((k, v if isinstance(v, range) else tuple(v))
                                             for k, v in (limits or {}).items()),
                                       deterministic, native_op, native_fn)
            return fn

        return deco

    def __call__(self, backend: str, *args):
        """Run the implementation ``backend`` (a name :meth:`choose` returned)."""
        return self.impls[backend].fn(*args)

    def why_not(self, backend: str, device_type: str, call: dict) -> Optional[str]:
        impl = self.impls.get(backend)
        if impl is None:
            return "not implemented for this op"
        reason = impl.not_supported(device_type, call)
        if reason is None:
            ok, why = available(backend, device_type, impl.native_op, impl.native_fn)
            reason = None if ok else why
        return reason

    def choose(self, device, backend: Optional[str] = None, **call) -> str:
        """The backend that runs this call: ``backend`` (or the environment's) when forced, else
        the first available, supporting, deterministic one in the device's preference order."""
        device_type = torch.device(device).type
        forced = backend if backend is not None else forced_from_env().get(self.name)
        if forced is not None and forced != "auto":
            if forced not in BACKENDS:
                raise ValueError(f"backend must be one of {BACKENDS} or 'auto', got {forced!r}")
            why = self.why_not(forced, device_type, call)
            if why is not None:
                raise BackendUnavailableError(
                    f"{self.name}: backend {forced!r} cannot run this call on {device_type}: {why}")
            return forced
        reasons = []
        for name in PREFERENCE.get(device_type, ("torch",)):
            why = self.why_not(name, device_type, call)
            if why is None and not self.impls[name].deterministic:
                why = "not deterministic (force it to use it)"
            if why is None:
                return name
            reasons.append(f"{name}: {why}")
        raise BackendUnavailableError(f"{self.name}: no backend can run this call on {device_type} "
                                      f"({'; '.join(reasons)})")


def ops() -> list[str]:
    return sorted(_OPS)


def get(name: str) -> Op:
    return _OPS[name]


@memoized
def forced_from_env() -> dict:
    """``CONDINIT_BACKEND`` parsed: op name -> forced backend."""
    env = os.environ.get(ENV_VAR, "").strip()
    if not env or env == "auto":
        return {}
    if "=" not in env:
        return _AllOps(env)
    out = {}
    for item in env.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ValueError(f"{ENV_VAR} must be a backend name or 'op=backend,op=backend', got {env!r}")
        out[name.strip()] = value.strip()
    return out


class _AllOps(dict):
    """``CONDINIT_BACKEND=name``: the same backend for every op."""

    def __init__(self, backend: str):
        super().__init__()
        self.backend = backend

    def get(self, key, default=None):
        return self.backend


@memoized
def _triton_import() -> tuple[bool, str]:
    try:
        import triton
    except Exception as exc:  # missing, or a broken install: either way not usable
        return False, f"triton is not importable ({type(exc).__name__}: {exc})"
    return True, f"triton {triton.__version__}"


@memoized
def available(backend: str, device_type: str, native_op: Optional[str] = None,
              native_fn: Optional[str] = None) -> tuple[bool, str]:
    """(available, reason) for ``backend`` on ``device_type``; cached (see :func:`reset`)."""
    if backend == "torch":
        return True, "available"
    if backend == "triton":
        if device_type not in ("cpu", "cuda"):
            return False, f"no Triton support for device type {device_type!r}"
        if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return False, "on CPU only under TRITON_INTERPRET=1 (set before triton is imported)"
        ok, why = _triton_import()
        if not ok:
            return False, why
        return True, "available (interpreter)" if device_type == "cpu" else "available"
    want = {"cuda": "cuda", "cpp-cpu": "cpu"}[backend]
    if device_type != want:
        return False, f"runs on {want} tensors only"
    from condinit import _ext
    ok, why = _ext.status()
    if not ok:
        return False, why
    if backend == "cuda" and not _ext.build_info().get("with_cuda", False):
        return False, "extension built without CUDA (nvcc not found at install time)"
    if native_op is not None:
        key = "CUDA" if backend == "cuda" else "CPU"
        if not _ext.has_op(native_op, key):
            return False, f"condinit_C::{native_op} has no {key} kernel in this build"
    if native_fn is not None and not hasattr(_ext.load(), native_fn):
        return False, f"condinit._C has no {native_fn} in this build (rebuild the extension)"
    return True, "available"


def reset() -> None:
    """Forget cached availability and re-read ``CONDINIT_BACKEND``."""
    forced_from_env.cache_clear()
    available.cache_clear()


def report(device_types=("cpu", "cuda")) -> list[dict]:
    """One row per (op, backend, device type): available?, why not, and what it supports."""
    rows = []
    for name in ops():
        op = _OPS[name]
        for dt in device_types:
            auto = PREFERENCE.get(dt, ("torch",))
            forced_only = [b for b, impl in op.impls.items() if b not in auto
                           and (dt in impl.devices or ANY_DEVICE in impl.devices)]
            for backend in (*auto, *forced_only):
                impl = op.impls.get(backend)
                if impl is None:
                    continue
                why = op.why_not(backend, dt, {})
                supports = impl.describe() + ("; only when forced" if backend in forced_only else "")
                rows.append({"op": name, "device": dt, "backend": backend, "available": why is None,
                             "reason": why or "available", "supports": supports,
                             "automatic": backend not in forced_only and impl.deterministic,
                             "deterministic": impl.deterministic})
    return rows
