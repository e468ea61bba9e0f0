"""Where Q, K and V and their heads sit in a fused weight (:func:`fused_layout`), and the head-count
checks the :class:`~condinit.models.spec.AttentionSpec` constructors share."""
from __future__ import annotations

from typing import Optional

from condinit._validate import check_choice, check_int

__all__ = ["LAYOUTS", "fused_layout", "check_heads", "head_dim_of"]

# Row layouts of a fused Q/K/V weight (see fused_layout).
LAYOUTS = ("contiguous", "per_head", "per_group", "grouped")


def fused_layout(total_rows: int, *, num_heads: int, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, order: str = "qkv", layout: str = "contiguous",
                 groups: Optional[int] = None) -> dict:
    """Where Q, K and V sit in a fused weight of ``total_rows`` output rows.

    The rows form ``n`` equal groups; each holds ``H/n`` query heads, ``H_kv/n`` key heads and
    ``H_kv/n`` value heads, as three runs in ``order`` (head ``h`` of Q is in group ``h // (H/n)``).
    ``layout`` picks ``n``: ``"contiguous"`` 1 (``[Q; K; V]``), ``"per_head"`` ``H`` (``[H, 3, d]``,
    needs ``H_kv == H``), ``"per_group"`` ``H_kv`` (``[H_kv, H/H_kv + 2, d]``), ``"grouped"``
    ``groups`` (e.g. CodeGen's 4 model-parallel groups). ``num_kv_heads`` defaults to ``num_heads``,
    ``head_dim`` to ``total_rows / (H + 2 H_kv)``.

    Returns ``{"q": (start, stop, n, stride), "k": ..., "v": ..., "heads": (H, H_kv, d)}``: the
    first group's rows and the distance between groups, as :class:`Projection` takes them.

    Examples:
        >>> fused_layout(48, num_heads=4, layout="per_head")["k"]
        (4, 8, 4, 12)
        >>> fused_layout(48, num_heads=4)["k"]
        (16, 32, 1, 16)
    """
    check_int("total_rows", total_rows, min=1)
    check_heads(num_heads, num_kv_heads, head_dim)
    check_choice("layout", layout, LAYOUTS)
    check_int("groups", groups, min=1, allow_none=True)
    if not isinstance(order, str) or sorted(order) != ["k", "q", "v"]:
        raise ValueError(f"order must be a permutation of 'qkv', got {order!r}")
    H = num_heads
    Hkv = H if num_kv_heads is None else num_kv_heads
    if H % Hkv:
        raise ValueError(f"num_kv_heads={Hkv} must divide num_heads={H}")
    if (layout == "grouped") != (groups is not None):
        raise ValueError("groups is given exactly when layout='grouped'" if groups is not None
                         else "layout='grouped' needs groups=n")
    if layout == "per_head" and Hkv != H:
        raise ValueError(f"layout='per_head' needs num_kv_heads == num_heads, got {Hkv} and {H}; a [H_kv, H/H_kv "
                         f"+ 2, d] weight is layout='per_group'")
    n = {"contiguous": 1, "per_head": H, "per_group": Hkv, "grouped": groups}[layout]
    if H % n or Hkv % n:
        raise ValueError(f"{n} groups must divide num_heads={H} and num_kv_heads={Hkv}")
    if head_dim is None:
        if total_rows % (H + 2 * Hkv):
            raise ValueError(f"fused weight with {total_rows} output rows does not split into "
                             f"{H} + 2 x {Hkv} heads")
        head_dim = total_rows // (H + 2 * Hkv)
    d = head_dim
    if (H + 2 * Hkv) * d != total_rows:
        raise ValueError(f"fused weight has {total_rows} output rows, expected (num_heads + 2 * num_kv_heads) * "
                         f"head_dim = ({H} + 2 * {Hkv}) * {d} = {(H + 2 * Hkv) * d}")
    sizes = {"q": H // n * d, "k": Hkv // n * d, "v": Hkv // n * d}
    stride = sum(sizes.values())
    out, at = {}, 0
    for name in order:
        out[name] = (at, at + sizes[name], n, stride if n > 1 else 0)
        at += sizes[name]
    out["heads"] = (H, Hkv, d)
    return out


def check_heads(num_heads, num_kv_heads, head_dim) -> None:
    check_int("num_heads", num_heads, min=1)
    check_int("num_kv_heads", num_kv_heads, min=1, allow_none=True)
    check_int("head_dim", head_dim, min=1, allow_none=True)


def head_dim_of(rows: int, num_heads: int, head_dim: Optional[int]) -> int:
    if head_dim is None:
        if rows % num_heads:
            raise ValueError(f"q has {rows} rows, not divisible by num_heads={num_heads}")
        head_dim = rows // num_heads
    return int(head_dim)

