"""Argument checks shared by every public function.

Each public function validates its arguments once, with these helpers, before it reads or writes
any tensor; kernels keep only the checks that guard memory safety. Every error names the argument
and says what was expected, e.g. ``seed must be an int in [0, 2**64), got -1``.

``bool`` is never accepted where a number is expected (``True`` is an ``int`` in Python, but
``num_heads=True`` is a bug, not a request for one head).
"""
from __future__ import annotations

import math
import numbers
from typing import Iterable, Optional

import torch

__all__ = ["SEED_MAX", "check_int", "check_real", "check_bool", "check_seed", "check_choice",
           "check_tensor"]

# Seeds key a 64-bit counter-based generator: every seed in [0, 2**64) is valid everywhere.
SEED_MAX = 2 ** 64


def _bounds(lo, hi, lo_open=False, hi_open=True) -> str:
    left = "(" if lo_open else "["
    right = ")" if hi_open else "]"
    return f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"


def check_int(name: str, value, *, min: Optional[int] = None, max: Optional[int] = None,
              allow_none: bool = False) -> Optional[int]:
    """``value`` as an ``int`` in ``[min, max]`` (both inclusive; None: unbounded)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        what = "an int" + (" or None" if allow_none else "")
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    value = int(value)
    if (min is not None and value < min) or (max is not None and value > max):
        raise ValueError(f"{name} must be an int in {_bounds(min, max, hi_open=False)}, got {value}")
    return value


def check_real(name: str, value, *, min: Optional[float] = None, max: Optional[float] = None,
               min_open: bool = False, allow_none: bool = False) -> Optional[float]:
    """``value`` as a finite ``float`` in ``[min, max]`` (``(min, max]`` with ``min_open``)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        what = "a real number" + (" or None" if allow_none else "")
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if (min is not None and (value < min or (min_open and value == min))) or (
            max is not None and value > max):
        raise ValueError(f"{name} must be in {_bounds(min, max, min_open, hi_open=False)}, got {value}")
    return value


def check_bool(name: str, value, *, allow_none: bool = False) -> Optional[bool]:
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        what = "a bool" + (" or None" if allow_none else "")
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    return value


def check_seed(name: str, value, *, allow_none: bool = False) -> Optional[int]:
    """A seed: an int in ``[0, 2**64)``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        what = "an int" + (" or None" if allow_none else "")
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    if not 0 <= int(value) < SEED_MAX:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {int(value)}")
    return int(value)


def check_choice(name: str, value, choices: Iterable, *, allow_none: bool = False):
    choices = tuple(choices)
    if value is None and allow_none:
        return None
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}" + (" or None" if allow_none else "")
                         + f", got {value!r}")
    return value


def check_tensor(name: str, value, *, floating: bool = False, dim: Optional[int] = None,
                 min_dim: Optional[int] = None, allow_none: bool = False) -> Optional[torch.Tensor]:
    """``value`` is a tensor (floating point, with ``dim`` or at least ``min_dim`` dimensions)."""
    if value is None and allow_none:
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (float32, float16, bfloat16 or "
                        f"float64), got {value.dtype}")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(value.shape)}")
    if min_dim is not None and value.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimensions, got shape {tuple(value.shape)}")
    return value
