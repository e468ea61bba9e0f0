"""Small helpers shared across condinit: the bytes of a tensor, and byte counts as people read them."""
from __future__ import annotations

import torch

__all__ = ["format_bytes", "tensor_bytes"]


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
