"""Backend registry: which implementation runs each op.

Every op (``"attention_fwd"``, ``"randn"``, ...) registers one implementation per backend:

=========  ===========================================================  ==============
backend    what it is                                                    devices
=========  ===========================================================  ==============
cuda       CUDA C++ kernels in the native extension ``condinit._C``       cuda
triton     Triton kernels (``condinit.kernels``)                          cuda; cpu only
                                                                          under
                                                                          TRITON_INTERPRET=1
cpp-cpu    C++ CPU kernels in ``condinit._C`` (OpenMP)                    cpu
torch      the PyTorch reference implementation                          any
=========  ===========================================================  ==============

Automatic choice walks :data:`PREFERENCE` for the tensor's device and takes the first backend
that is available and supports the call; if it raises, the next one runs and :func:`report`
records why (an automatic choice falls back quietly). ``CONDINIT_BACKEND=name`` (all ops) or
``CONDINIT_BACKEND=op=name,op2=name`` forces a backend, as does the ``backend=`` argument of the
public functions; a forced backend that cannot run raises :class:`BackendUnavailableError`.

Nothing here imports triton, loads the extension or touches CUDA until an op is called or
:func:`report` is asked for.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import threading
import warnings
from typing import Callable, Optional

import torch

__all__ = ["BACKENDS", "ENV_VAR", "BackendUnavailableError", "register", "select", "dispatch",
           "backend_status", "report", "ops"]

BACKENDS = ("cuda", "triton", "cpp-cpu", "torch")
ENV_VAR = "CONDINIT_BACKEND"
# Automatic order per device type. Triton on the CPU (the interpreter) is slow: only on request.
PREFERENCE = {"cuda": ("cuda", "triton", "torch"), "cpu": ("cpp-cpu", "torch")}


class BackendUnavailableError(RuntimeError):
    """A backend was forced (argument or CONDINIT_BACKEND) but cannot run this call."""


@dataclasses.dataclass
class Impl:
    op: str
    backend: str
    fn: Callable
    native_op: Optional[str] = None  # condinit_C op that must exist (cuda / cpp-cpu backends)
    supports: Optional[Callable[..., Optional[str]]] = None  # (**call_info) -> None or why not


_REGISTRY: dict[str, dict[str, Impl]] = {}
_FALLBACKS: dict[tuple[str, str], str] = {}
_LOCK = threading.Lock()


def register(op: str, backend: str, *, native_op: str | None = None,
             supports: Callable[..., Optional[str]] | None = None):
    """Decorator: register ``fn`` as ``op``'s implementation on ``backend``.

    ``supports(**call_info)`` returns None when the implementation handles the call, else a short
    reason (e.g. ``"head_dim 512 > 256"``); ``call_info`` is what the op passes to :func:`select`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    def deco(fn):
        _REGISTRY.setdefault(op, {})[backend] = Impl(op, backend, fn, native_op, supports)
        return fn

    return deco


def ops() -> list[str]:
    return sorted(_REGISTRY)


@functools.lru_cache(maxsize=None)
def _triton_import() -> tuple[bool, str]:
    try:
        import triton
    except Exception as exc:  # missing, or a broken install: either way not usable
        return False, f"triton is not importable ({type(exc).__name__}: {exc})"
    return True, f"triton {triton.__version__}"


def _triton_status(device_type: str) -> tuple[bool, str]:
    if device_type not in ("cpu", "cuda"):
        return False, f"no Triton support for device type {device_type!r}"
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return False, "on CPU only under TRITON_INTERPRET=1 (set before triton is imported)"
    ok, why = _triton_import()
    if not ok:
        return False, why
    return True, "available (interpreter)" if device_type == "cpu" else "available"


def backend_status(backend: str, device_type: str, op: str | None = None) -> tuple[bool, str]:
    """(available, reason) for ``backend`` on ``device_type`` (and ``op``, when given)."""
    impl = _REGISTRY.get(op, {}).get(backend) if op else None
    if op is not None and impl is None:
        return False, "not implemented for this op"
    if backend == "torch":
        return True, "available"
    if backend == "triton":
        return _triton_status(device_type)
    # native backends
    want = {"cuda": "cuda", "cpp-cpu": "cpu"}[backend]
    if device_type != want:
        return False, f"runs on {want} tensors only"
    from condinit import _ext
    ok, why = _ext.status()
    if not ok:
        return False, why
    if backend == "cuda" and not _ext.build_info().get("with_cuda", False):
        return False, "extension built without CUDA (nvcc not found at install time)"
    if impl is not None and impl.native_op is not None:
        key = "CUDA" if backend == "cuda" else "CPU"
        if not _ext.has_op(impl.native_op, key):
            return False, f"condinit_C::{impl.native_op} has no {key} kernel in this build"
    return True, "available"


def _forced(op: str, backend: str | None) -> str | None:
    if backend is not None:
        return backend
    env = os.environ.get(ENV_VAR, "").strip()
    if not env or env == "auto":
        return None
    if "=" not in env:
        return env
    for item in env.split(","):
        name, _, value = item.partition("=")
        if name.strip() == op:
            return value.strip()
    return None


def select(op: str, device: torch.device | str, *, backend: str | None = None, **call_info) -> list[Impl]:
    """Implementations to try for this call, best first (one entry when a backend is forced)."""
    device = torch.device(device)
    impls = _REGISTRY.get(op)
    if not impls:
        raise KeyError(f"unknown op {op!r}")
    forced = _forced(op, backend)
    if forced is not None:
        if forced not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or 'auto', got {forced!r}")
        ok, why = backend_status(forced, device.type, op)
        if ok and impls[forced].supports is not None:
            reason = impls[forced].supports(**call_info)
            ok, why = reason is None, reason
        if not ok:
            raise BackendUnavailableError(f"{op}: backend {forced!r} cannot run on {device.type}: {why}")
        return [impls[forced]]
    chosen = []
    for name in PREFERENCE.get(device.type, ("torch",)):
        impl = impls.get(name)
        if impl is None or not backend_status(name, device.type, op)[0]:
            continue
        if impl.supports is not None and impl.supports(**call_info) is not None:
            continue
        chosen.append(impl)
    if not chosen:
        raise BackendUnavailableError(f"{op}: no backend can run on {device.type} for {call_info}")
    return chosen


def dispatch(op: str, device, args: tuple, *, backend: str | None = None, call_info: dict | None = None):
    """Run ``op`` on the best backend; an automatic choice that raises falls back to the next."""
    impls = select(op, device, backend=backend, **(call_info or {}))
    for i, impl in enumerate(impls):
        if i == len(impls) - 1:
            return impl.fn(*args)
        try:
            return impl.fn(*args)
        except Exception as exc:  # automatic choice: fall back, remember why
            with _LOCK:
                first = (op, impl.backend) not in _FALLBACKS
                _FALLBACKS[(op, impl.backend)] = f"{type(exc).__name__}: {exc}"
            if first:
                warnings.warn(f"condinit: {op} on backend {impl.backend!r} failed ({exc}); "
                              f"falling back to {impls[i + 1].backend!r}")


def report(device_types=("cpu", "cuda")) -> list[dict]:
    """One row per (op, backend, device type): available?, why, and fallbacks seen so far."""
    rows = []
    for op in ops():
        for backend in BACKENDS:
            for dt in device_types:
                if backend not in _REGISTRY[op]:
                    ok, why = False, "not implemented for this op"
                else:
                    ok, why = backend_status(backend, dt, op)
                if backend in ("cuda",) and dt == "cpu" or backend == "cpp-cpu" and dt == "cuda":
                    continue
                if (op, backend) in _FALLBACKS:
                    why += f"; fell back at run time: {_FALLBACKS[(op, backend)]}"
                rows.append({"op": op, "backend": backend, "device": dt, "available": ok, "reason": why})
    return rows
