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
           "check_tensor", "check_dtype", "check_finite", "NonFiniteError", "check_no_internal_overlap",
           "check_disjoint", "overlaps"]

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


def check_dtype(name: str, dtype, *, allow_none: bool = True) -> Optional[torch.dtype]:
    """``dtype`` is a floating-point ``torch.dtype`` (or None)."""
    if dtype is None and allow_none:
        return None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        what = "a floating-point torch.dtype" + (" or None" if allow_none else "")
        raise TypeError(f"{name} must be {what}, got {dtype!r}")
    return dtype


class NonFiniteError(ValueError):
    """A probe's input (``x``, ``q, k, v``, or a layer's weights) holds NaN or Inf."""


def check_finite(what: str, t: torch.Tensor) -> None:
    """Every entry of ``t`` is finite, else :class:`NonFiniteError` naming ``what``."""
    # max and min propagate NaN and are finite only when every entry is: two reductions, no mask
    if t.numel() and not bool(torch.isfinite(torch.stack([t.max(), t.min()])).all()):
        raise NonFiniteError(f"{what} must be finite, got NaN or Inf (in {t.dtype})")


# ---------------------------------------------------------------------------------------------------
# destinations: a tensor written in place must not alias itself or another destination of the call

def _strides_nest(sizes_strides) -> bool:
    """True when the (size, stride) dims (sizes > 1) address distinct elements: sorted by stride,
    every stride exceeds the span of the smaller ones (transposed, sliced, permuted views)."""
    span = 0
    for size, stride in sorted(sizes_strides, key=lambda d: d[1]):
        if stride <= span:
            return False
        span += (size - 1) * stride
    return True


def check_no_internal_overlap(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` (to be written in place) has no two elements at the same memory location: no
    expanded (stride 0) dims. Conservative for exotic ``as_strided`` views that torch cannot
    decide: refused unless their strides nest (:func:`_strides_nest`)."""
    if t.numel() <= 1 or t.device.type == "meta":
        return t
    verdict = torch._debug_has_internal_overlap(t)   # 0: no, 1: yes, 2: too hard to tell
    dims = [(s, st) for s, st in zip(t.shape, t.stride()) if s > 1]
    if verdict == 1 or (verdict == 2 and not _strides_nest(dims)):
        raise ValueError(f"{name} is written in place but several of its elements share memory "
                         f"(shape {tuple(t.shape)}, strides {tuple(t.stride())}, e.g. an expanded "
                         f"tensor); pass a tensor with its own memory (.clone() or .contiguous())")
    return t


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    item = t.element_size()
    start = t.untyped_storage().data_ptr() + t.storage_offset() * item
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return start, start + (extent + 1) * item


def _digit_box(t: torch.Tensor, levels: list[int], base: int):
    """Per stride level (descending, ending with 1), the [lo, hi] range of ``t``'s index digit,
    with ``t``'s element offsets taken from ``base``; None when some offset of ``t`` carries
    into a higher level (digits then do not identify elements uniquely)."""
    size_at = {st: s for s, st in zip(t.shape, t.stride()) if s > 1}
    rest = (t.untyped_storage().data_ptr() - base) // t.element_size() + t.storage_offset()
    box = []
    for stride in levels:
        lo = rest // stride
        rest -= lo * stride
        box.append((lo, lo + size_at.get(stride, 1) - 1))
    # no carry: at every level the largest reachable remainder stays below the level above
    top = 0
    for i in range(len(levels) - 1, 0, -1):
        top += box[i][1] * levels[i]
        if top >= levels[i - 1]:
            return None
    return box


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share an element of memory. Exact for views of one tensor with the
    same element size whose strides nest (slices, transposes: e.g. the column blocks of a fused
    ``[D, 3D]`` weight); otherwise (other dtypes, exotic strides) True as soon as their byte
    ranges intersect."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _byte_range(a), _byte_range(b)
    if a1 <= b0 or b1 <= a0:
        return False
    if a.element_size() != b.element_size():
        return True
    levels = sorted({st for t in (a, b) for s, st in zip(t.shape, t.stride()) if s > 1} | {1},
                    reverse=True)
    base = a.untyped_storage().data_ptr()
    boxes = [_digit_box(t, levels, base) for t in (a, b)]
    if boxes[0] is None or boxes[1] is None:
        return True
    return all(lo_a <= hi_b and lo_b <= hi_a for (lo_a, hi_a), (lo_b, hi_b) in zip(*boxes))


def check_disjoint(named: Iterable[tuple[str, Optional[torch.Tensor]]]) -> None:
    """The tensors of ``named`` (``(argument name, tensor or None)``), all written in place by one
    call, have no internal overlap and share no memory with each other: otherwise the last write
    would silently win. Raises ``ValueError`` naming the arguments."""
    items = [(n, t) for n, t in named if t is not None]
    for n, t in items:
        check_no_internal_overlap(n, t)
    live = sorted(((_byte_range(t), n, t) for n, t in items if t.numel() and t.device.type != "meta"),
                  key=lambda e: e[0][0])
    for i, ((lo, hi), n, t) in enumerate(live):
        for (lo2, _), n2, t2 in live[i + 1:]:
            if lo2 >= hi:
                break
            if overlaps(t, t2):
                same = t2 is t or (t.data_ptr() == t2.data_ptr() and t.shape == t2.shape)
                raise ValueError(f"{n} and {n2} {'are the same memory' if same else 'overlap in memory'}:"
                                 f" each destination must have its own memory, or the last write wins")
