"""What an attention class's own source says about its projections: the split of a fused one.

Separate projections have one reading. A fused projection does not: ``[Q; K; V]`` thirds and
per-head interleaved ``[H, 3, d]`` rows have the same shape. Structural discovery
(:mod:`condinit.models.discovery`) accepts a fused projection only when the class's own source
(``inspect.getsource``, with whitespace and comments removed) splits it as contiguous parts: a
reshape to ``(..., 3, num_heads, head_dim)``, or a ``split`` / ``chunk`` of the projection's raw
output, assigned to query, key, value in that order. It also reads a query projection whose rows
alternate each head's query and output gate (Qwen3-Next, Qwen3.5).
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Optional

from torch import nn

__all__ = ["class_source", "ROLE_WORDS", "role_of", "says_gated_query", "says_contiguous"]

# The fused projection's split, read from the class's source with whitespace and comments removed.
_HEADS_RE = r"(?:self\.)?(?:num_heads|num_attention_heads|n_heads|n_head|heads|num_head|nh)"
_SPLITS = r"(?:split|chunk|tensor_split)"
_SHAPE_OPS = r"(?:view|reshape|unflatten|transpose|permute)"


@functools.lru_cache(maxsize=None)
def class_source(cls) -> Optional[str]:
    """The source of the methods ``cls`` uses (each name's effective definition along the MRO up to
    ``nn.Module``: an overridden base method does not count), or None when any is unavailable;
    read once per class."""
    texts, seen = [], set()
    for klass in cls.__mro__:
        if klass is nn.Module or klass is object or klass.__module__.startswith("torch."):
            break
        for name, obj in vars(klass).items():
            fn = obj.fget if isinstance(obj, property) else getattr(obj, "__func__", obj)
            if name in seen or not inspect.isfunction(fn):
                continue
            seen.add(name)
            try:
                texts.append(inspect.getsource(fn))
            except (OSError, TypeError):     # defined in a REPL, source not shipped
                return None
    return "\n".join(texts) if texts else None


ROLE_WORDS = {"q": "q", "query": "q", "queries": "q", "xq": "q", "k": "k", "key": "k", "keys": "k", "xk": "k",
               "v": "v", "value": "v", "values": "v", "xv": "v"}


def role_of(name: str) -> Optional[str]:
    """``"q"``, ``"k"`` or ``"v"`` for a variable named like a query, key or value (``query_states``,
    ``k``, ``values``), else None."""
    return ROLE_WORDS.get(name.lstrip("_").lower().split("_", 1)[0])


def says_gated_query(cls, name: str) -> bool:
    """Whether ``cls`` reads its query projection ``name`` as ``[H, 2, d]``: each head's query, then
    an output gate (Qwen3-Next, Qwen3.5: ``query, gate = torch.chunk(q_proj(x).view(..., -1,
    head_dim * 2), 2, dim=-1)``)."""
    raw = class_source(cls)
    if raw is None:
        return False
    src = re.sub(r"\s+", "", re.sub(r"#[^\n]*", "", raw))
    m = re.search(rf"\(?(\w+),(\w+)\)?=torch\.chunk\(self\.{name}\([^()]*\)\.view\([^()]*,-1,self\.head_dim\*2\),2,"
                  rf"dim=-1\)", src)
    return m is not None and role_of(m[1]) == "q" and role_of(m[2]) is None


def says_contiguous(cls, name: str, parts: int, roles: Optional[tuple] = None) -> bool:
    """Whether ``cls``'s source splits the output of its fused projection ``name`` into ``parts``
    contiguous runs holding ``roles`` in that order (default Q, K, V for 3 parts, K, V for 2): a
    reshape to ``(..., parts, num_heads, ...)``,
    an einops ``(3 h d)``, or a split/chunk of the raw output, and nothing that views it per head
    first (``(num_heads, 3, d)``, ``(num_heads, 3 * d)``)."""
    raw = class_source(cls)
    if raw is None or name not in raw:
        return False
    if name == "in_proj_weight" and "multi_head_attention_forward(" in raw:
        return True          # torch's own function: in_proj_weight is [Q; K; V] (_in_projection_packed)
    einops_thirds = re.search(rf"\(\s*(?:three|{parts}|qkv|kv)\s+h\s+d\s*\)", raw) is not None
    einops_interleaved = re.search(rf"\(\s*h\s+(?:three|{parts}|qkv|kv)\s+d\s*\)", raw) is not None
    code = re.sub(r"#[^\n]*", "", raw)
    src = re.sub(r"\s+", "", code)
    call = rf"(?:self\.{name}\([^()]*\)|F\.linear\([^()]*self\.{name}(?:\.weight)?\b[^()]*\))"
    thirds = re.search(rf"\.(?:reshape|view)\([^()]*?,{parts},(?:-1|{_HEADS_RE})[,)]", src) is not None \
        or re.search(rf"unflatten\(-?\d,\({parts},", src) is not None or einops_thirds
    split_raw = re.search(rf"{call}\.{_SPLITS}\(", src) is not None
    for var in re.findall(rf"(\w+)={call}(?![.\[(*+@-])", src):
        reshaped = re.search(rf"\b{var}={var}\.{_SHAPE_OPS}\(", src) is not None
        if not reshaped and (re.search(rf"\b{var}\.{_SPLITS}\(", src) or re.search(rf"torch\.{_SPLITS}\({var},", src)):
            split_raw = True
    head_dim = r"(?:self\.)?(?:head_dim|head_size|dim_head|d_head|local_dim|attention_head_size)\b"
    interleaved = (re.search(rf"{_HEADS_RE},{parts}[,*)]", src) is not None              # (..., H, 3, d), (H, 3 * d)
                   or re.search(rf"(?:{_HEADS_RE}|-1),{parts}\*", src) is not None           # (..., -1, 3 * d)
                   or re.search(rf"(?:{_HEADS_RE}|-1),{head_dim}\*{parts}\b", src) is not None  # (H, d * 3)
                   or re.search(rf"{_HEADS_RE},-1\)\.(?:split|chunk)", src) is not None     # (H, -1).split
                   or einops_interleaved)
    if interleaved or not (thirds or split_raw):
        return False
    # the parts are assigned to query, key, value (key, value) in that order, and never in another
    want = tuple(roles) if roles is not None else ("q", "k", "v")[3 - parts:]
    lhs = r"(?<![\w.])\(?" + r"\s*,\s*".join([r"(\w+)"] * parts) + r"\s*\)?\s*=(?!=)"
    orders = {tuple(role_of(n) for n in names) for names in re.findall(lhs, code)}
    return {o for o in orders if set(o) == set(want) and len(o) == parts} == {want}
