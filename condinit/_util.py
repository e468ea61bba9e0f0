"""Small helpers shared across condinit: the bytes of a tensor, byte counts as people read them,
handing freed memory back to the system between the steps of a long command, and a memo that
torch.compile traces quietly."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import sys

import torch

__all__ = ["format_bytes", "memoized", "release_memory", "tensor_bytes"]


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (``numel * element_size``; any device, meta included)."""
    return t.numel() * t.element_size()


def format_bytes(n: float) -> str:
    """``n`` bytes in powers of 10 with two decimals (``"1.50 GB"``, ``"12.00 kB"``), or whole bytes below 1 kB.

    Examples:
        >>> format_bytes(1_500_000_000), format_bytes(999)
        ('1.50 GB', '999 B')
    """
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


_LIBC = None


def release_memory() -> None:
    """Collect garbage and, with glibc, return the heap's free pages to the system (``malloc_trim``).

    glibc keeps the pages of freed large blocks in its arenas (their size grows the ``mmap``
    threshold), so a loop whose every pass allocates and frees a few hundred MB (one layer's probe)
    climbs in resident memory although nothing stays referenced. Called between such passes; a no-op
    where the C library has no ``malloc_trim``.
    """
    global _LIBC
    gc.collect()
    if not sys.platform.startswith("linux"):
        return
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            _LIBC = False
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC else None
    if trim is not None:
        trim(0)


def memoized(fn):
    """``fn`` (positional, hashable arguments) computed once per arguments, with ``cache_clear()``: what
    ``functools.lru_cache(maxsize=None)`` does, as a plain dict. The backend choice runs inside
    ``torch.compile`` traces, where Dynamo ignores an lru_cache wrapper and warns each time."""
    cache: dict = {}

    @functools.wraps(fn)
    def wrapper(*args):
        if args not in cache:
            cache[args] = fn(*args)
        return cache[args]

    wrapper.cache_clear = cache.clear
    return wrapper
