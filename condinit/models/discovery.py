"""Structural discovery: an attention module recognised by its projections' names and head counts.

What :func:`condinit.models.describe` falls back to when no adapter is registered for a class:
three separate projections under one of the naming families of :data:`SEPARATE_NAMES`
(``q_proj/k_proj/v_proj``, ``query/key/value``, T5's ``q/k/v``, ...), a ``q`` projection with a
fused ``kv`` (:data:`Q_KV_NAMES`), a fused ``qk`` with a ``v`` (:data:`QK_V_NAMES`), or one fused
projection (:data:`FUSED_NAMES`: ``qkv``, ``Wqkv``, ``qkv_proj``, ``c_attn``, ``in_proj_weight``,
...) whose contiguous split the class's source confirms (:mod:`condinit.models.source`). Head
counts come from the module's attributes (``num_heads``, ``num_attention_heads``, ``n_heads``,
``num_key_value_heads``, ``head_dim``, ...) or its own ``config`` (``num_attention_heads``,
``num_key_value_heads``, ``head_dim``), and must agree with the projections' row counts. A
projection may be an ``nn.Linear`` (or transformers' ``Conv1D``) or a wrapper holding exactly one
(a clipping linear). A query projection whose rows alternate each head's query and output gate
(Qwen3-Next, Qwen3.5) has its query rows conditioned and its gate rows left alone.

Refused with a reason (:class:`UnsupportedAttention`): multi-head latent attention
(DeepSeek-V2/V3 and others: ``q_a_proj/q_b_proj``, ``kv_a_proj_with_mqa/kv_b_proj``), linear
attention (MiniMax lightning attention, gated delta nets, retention: no softmax), Reformer's shared
``query_key``, deformable attention (no query or key projections), a fused projection whose split
the source does not confirm. :func:`looks_like_attention` says which unrecognised modules
:func:`condinit.apply` must report instead of skipping them, :func:`why_not_recognised` why.

:func:`read_details` reads what the module computes around its projections (Hugging Face, timm
and torch naming: ``scaling`` / ``scale``, ``o_proj`` / ``out_proj`` / ``c_proj`` / ``proj``,
``q_norm`` / ``k_norm``, ``position_embeddings``, ``sliding_window``, ``attn_logit_softcapping``).
"""
from __future__ import annotations

import inspect
import math
import re
from typing import Optional

import torch
from torch import nn

from .source import ROLE_WORDS, says_contiguous, says_gated_query
from .spec import (AttentionDetails, AttentionSpec, Described, OutputProjection, Projection, Ref,
                   UnsupportedAttention, fused_layout)

__all__ = ["SEPARATE_NAMES", "Q_KV_NAMES", "QK_V_NAMES", "FUSED_NAMES", "HEAD_ATTRS", "KV_HEAD_ATTRS",
           "HEAD_DIM_ATTRS", "HEAD_CFG", "KV_HEAD_CFG", "HEAD_DIM_CFG", "int_attr", "own_config", "heads_of",
           "is_conv1d", "linear_projection", "looks_like_attention", "why_not_recognised", "structural",
           "read_details", "position_embeddings_arg"]

# ------------------------------------------------------------------------------------------------
# naming families

# Naming families of three separate projections (child modules with a 2-D weight).
SEPARATE_NAMES = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"),
                  ("q_lin", "k_lin", "v_lin"), ("query_proj", "key_proj", "value_proj"), ("wq", "wk", "wv"),
                  ("Wq", "Wk", "Wv"), ("W_q", "W_k", "W_v"), ("to_q", "to_k", "to_v"),
                  ("linear_q", "linear_k", "linear_v"), ("q_linear", "k_linear", "v_linear"),
                  ("project_q", "project_k", "project_v"), ("q_head", "k_head", "v_head"),
                  ("projection_query", "projection_key", "projection_value"))
# A query projection and a fused [K; V] projection.
Q_KV_NAMES = (("q", "kv"), ("q_proj", "kv_proj"), ("to_q", "to_kv"), ("query", "key_value"))
# A fused [Q; K] projection and a value projection (timm ConViT's GPSA, TNT).
QK_V_NAMES = (("qk", "v"), ("qk_proj", "v_proj"))
# One fused [Q; K; V] projection (a child module, or a parameter for in_proj_weight).
FUSED_NAMES = ("qkv", "Wqkv", "qkv_proj", "c_attn", "query_key_value", "to_qkv", "W_pack", "qkv_linear", "att_proj",
               "in_proj")
_AMBIGUOUS_FUSED = {"in_proj"}   # also the input projection of Mamba-style mixers: needs an attention class name

_MLA_REASON = ("multi-head latent attention (q_a_proj/q_b_proj, kv_a_proj_with_mqa/kv_b_proj): Q, K and V are "
               "products of low-rank factors behind a latent RMSNorm, so condinit does not guess per-head W_Q, W_K, "
               "W_V; for DeepseekV2/V3Attention opt in to conditioning the factors with mla=\"factors\" "
               "(condinit init --mla factors)")

_ATTENTION_NAME = re.compile(r"attention|attn", re.I)
# attention without a softmax over scores: the method conditions softmax attention
_LINEAR_ATTENTION_NAME = re.compile(r"Lightning(Attention|Attn)|DeltaNet|Delta(Rule)?(Attention|Attn)|"
                                    r"Linear(Self)?(Attention|Attn)|Retention")
_LINEAR_REASON = ("linear attention (no softmax over the scores: lightning attention, a gated delta rule, retention): "
                  "the method conditions softmax attention, so this layer is left as the model made it")
# "attention" in the sense of channel / spatial gating (squeeze-excite and its kin): no queries and keys
_GATING_NAME = re.compile(r"(Channel|Spatial|Split|SelectiveKernel|Coord|Triplet|Gather|Efficient[Cc]hannel)"
                          r"(Attn|Attention)\w*$|Cbam|^Eca|^Ceca|SqueezeExcite")
# names that say attention but are parts of an attention block, not the attention itself
_PART_NAME = re.compile(r"(Output|Dropout|Norm|Mask|Embeddings?|Rotary\w*|Bias|Scaling|MLP|FeedForward|FFN)$")


# ------------------------------------------------------------------------------------------------
# head counts, from the module's attributes or its own config

HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "heads", "num_head", "num_attn_heads")
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads", "n_kv_head")
HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim", "d_head", "dim_head")
HEAD_CFG = ("num_attention_heads", "n_head", "n_heads", "num_heads")
KV_HEAD_CFG = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
HEAD_DIM_CFG = ("head_dim", "d_kv", "kv_channels")


def int_attr(obj, names) -> tuple[Optional[int], Optional[str]]:
    """The first attribute of ``names`` on ``obj`` that is an int >= 1, and its name."""
    for n in names:
        try:
            v = getattr(obj, n, None)
        except (AttributeError, KeyError, NotImplementedError):  # a config property without a value
            v = None
        if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
            return v, n
    return None, None


def own_config(m: nn.Module):
    cfg = getattr(m, "config", None)
    return None if cfg is None or isinstance(cfg, (nn.Module, dict, torch.Tensor)) else cfg


def heads_of(m: nn.Module, q_rows: int, k_rows: int, *, num_heads: Optional[int] = None,
             num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None) -> tuple[int, int, int]:
    """``(num_heads, num_kv_heads, head_dim)`` of attention module ``m`` with ``q_rows`` query rows and
    ``k_rows`` key rows: given values first, then ``m``'s attributes, then ``m.config``; missing ones
    derived from the row counts. Raises :class:`UnsupportedAttention` when the number of heads is
    nowhere to be found, ValueError when what was found contradicts the rows."""
    cfg = own_config(m)
    src_h = "given"
    if num_heads is None:
        num_heads, src_h = int_attr(m, HEAD_ATTRS)
        src_h = f"attribute {src_h}" if num_heads is not None else None
    if num_heads is None and cfg is not None:
        num_heads, src_h = int_attr(cfg, HEAD_CFG)
        src_h = f"config.{src_h}" if num_heads is not None else None
    if num_heads is None:
        raise UnsupportedAttention(f"cannot find the number of heads (no attribute {', '.join(HEAD_ATTRS)}, and no "
                                   f"config.num_attention_heads)")
    H = num_heads
    src_d = "given"
    if head_dim is None:
        head_dim, src_d = int_attr(m, HEAD_DIM_ATTRS)
        src_d = f"attribute {src_d}" if head_dim is not None else None
    if head_dim is None and cfg is not None:
        cd, name = int_attr(cfg, HEAD_DIM_CFG)
        if cd is not None and cd * H == q_rows:   # a config value is used only where it fits the rows
            head_dim, src_d = cd, f"config.{name}"
    if head_dim is None:
        if q_rows % H:
            raise ValueError(f"q has {q_rows} rows, not divisible by {H} heads ({src_h})")
        head_dim = q_rows // H
    d = head_dim
    if H * d != q_rows:
        raise ValueError(f"q has {q_rows} rows, but {H} heads ({src_h}) of head_dim {d} ({src_d}) need {H * d}")
    src_kv = "given"
    if num_kv_heads is None:
        num_kv_heads, src_kv = int_attr(m, KV_HEAD_ATTRS)
        src_kv = f"attribute {src_kv}" if num_kv_heads is not None else None
        groups, _ = int_attr(m, ("num_key_value_groups",))
        if num_kv_heads is None and groups is not None and H % groups == 0:
            num_kv_heads, src_kv = H // groups, "num_heads / attribute num_key_value_groups"
    if num_kv_heads is None and cfg is not None:
        ckv, name = int_attr(cfg, KV_HEAD_CFG)
        if ckv is not None and ckv * d == k_rows:
            num_kv_heads, src_kv = ckv, f"config.{name}"
    if num_kv_heads is None:
        if k_rows % d:
            raise ValueError(f"k has {k_rows} rows, not a multiple of head_dim {d}")
        num_kv_heads, src_kv = k_rows // d, "k rows / head_dim"
    Hkv = num_kv_heads
    if Hkv * d != k_rows:
        raise ValueError(f"k has {k_rows} rows, but {Hkv} key/value heads ({src_kv}) of head_dim {d} need {Hkv * d}")
    if H % Hkv:
        raise ValueError(f"{Hkv} key/value heads ({src_kv}) do not divide {H} heads ({src_h})")
    return H, Hkv, d


# ------------------------------------------------------------------------------------------------
# projections, by their names

def _is_linear_like(mod) -> bool:
    w = getattr(mod, "weight", None) if isinstance(mod, nn.Module) else None
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return False
    b = getattr(mod, "bias", None)
    return b is None or (isinstance(b, torch.Tensor) and b.dim() == 1)


def is_conv1d(mod) -> bool:
    """transformers' ``Conv1D``: an nn.Linear stored ``[in, out]``, computing ``x @ W + b``."""
    return type(mod).__name__ == "Conv1D" and isinstance(getattr(mod, "nf", None), int)


_FUSED_ROLES = {"qkv": "qkv", "wqkv": "qkv", "qk": "qk", "kv": "kv"}


def _projection_roles(m: nn.Module) -> dict:
    """``role -> [child names]`` of ``m``'s children that hold a matrix (2-D or more) and are named
    like a query, key or value projection (``q_proj``, ``to_key``, ``value``) or a fused one
    (``qkv``, ``qk``, ``kv``, ``query_key_value``)."""
    roles: dict[str, list] = {}
    for n, c in m.named_children():
        if not any(t.dim() >= 2 for t in c.parameters()):   # norms, dropouts, rotary tables
            continue
        low = n.lower()
        role = "qkv" if low in ("query_key_value", "w_pack") else None
        for t in low.split("_"):
            role = role or ROLE_WORDS.get(t) or _FUSED_ROLES.get(t)
        if role is not None:
            roles.setdefault(role, []).append(n)
    return roles


def looks_like_attention(module: nn.Module) -> bool:
    """Whether ``module`` looks like attention: it holds projections named for two of query, key
    and value (``qk`` + ``v``, ``q_proj`` + ``k_proj``, ...), or its class name says attention
    (``Attention`` / ``Attn``), is not a part of one (``...Output``, ``...Dropout``, ...) nor
    channel/spatial gating (squeeze-excite, CBAM), and it holds parameters."""
    name = type(module).__name__
    if _GATING_NAME.search(name) or _PART_NAME.search(name):
        return False
    covered = {r for role in _projection_roles(module) for r in role}
    if len(covered & {"q", "k", "v"}) >= 2:
        return True
    return _ATTENTION_NAME.search(name) is not None and next(module.parameters(), None) is not None


def why_not_recognised(m: nn.Module) -> str:
    """Why an attention-like module is not recognised: what it holds."""
    children = dict(m.named_children())
    roles = _projection_roles(m)
    if roles:
        named = [n for ns in roles.values() for n in ns]
        unreadable = [n for n in named if _projection_module(children[n]) is None]
        if unreadable:
            return (f"its {', '.join(unreadable)} ({', '.join(sorted({type(children[n]).__name__ for n in unreadable}))}) "
                    f"are not linear projections with a 2-D weight condinit can read")
        present = {r for role in roles for r in role}
        missing = [r for r in ("q", "k", "v") if r not in present]
        if missing:
            what = {"q": "query", "k": "key", "v": "value"}
            return (f"it holds {', '.join(named)} but no {' or '.join(what[r] for r in missing)} projection (a learned "
                    f"query, keys and values taken from another layer, or no such role)")
        kinds = sorted({type(children[n]).__name__ for n in named})
        return f"its projections {', '.join(named)} ({', '.join(kinds)}) follow no naming family condinit reads"
    held = [f"{n}: {type(c).__name__}" for n, c in children.items()] + [n for n, _ in m.named_parameters(recurse=False)]
    return f"its class name says attention, but it holds no projections condinit can read ({', '.join(held) or 'nothing'})"


def _projection_module(mod) -> Optional[nn.Module]:
    """``mod`` when it is linear-like; the one linear-like module inside a wrapper that holds nothing
    else (a clipping or casting wrapper around an nn.Linear); else None."""
    if _is_linear_like(mod):
        return mod
    if not isinstance(mod, nn.Module) or next(mod.parameters(recurse=False), None) is not None:
        return None
    inner = [c for c in mod.modules() if c is not mod and next(c.parameters(recurse=False), None) is not None]
    if len(inner) == 1 and _is_linear_like(inner[0]):
        return inner[0]
    return None


def structural(m: nn.Module) -> Optional[Described]:
    """How ``m`` keeps its Q/K/V, read from its structure alone (see the module doc), or None."""
    children = dict(m.named_children())
    linear = {n: p for n, p in ((n, _projection_module(c)) for n, c in children.items()) if p is not None}
    if ("kv_a_proj_with_mqa" in linear or "kv_b_proj" in linear
            or ("q_a_proj" in linear and "q_b_proj" in linear)):
        raise UnsupportedAttention(_MLA_REASON)
    if "query_key" in linear and "value" in linear:
        raise UnsupportedAttention("shared query_key projection (Reformer LSH attention): Q and K are one matrix, "
                                   "so they cannot be two independent semi-orthogonal matrices")
    if _LINEAR_ATTENTION_NAME.search(type(m).__name__) and _projection_roles(m):
        raise UnsupportedAttention(_LINEAR_REASON)
    if "sampling_offsets" in linear and "attention_weights" in linear:
        raise UnsupportedAttention("deformable attention: it has no query or key projections (sampling offsets and "
                                   "attention weights are predicted from the query), so there is no W_Q, W_K to "
                                   "condition")
    for names in SEPARATE_NAMES:
        if all(n in linear for n in names):
            return _separate(m, names, linear)
    for qn, kvn in Q_KV_NAMES:
        if qn in linear and kvn in linear:
            return _q_kv(m, qn, kvn, linear)
    for qkn, vn in QK_V_NAMES:
        if qkn in linear and vn in linear:
            return _qk_v(m, qkn, vn, linear)
    for fn in FUSED_NAMES:
        if fn in linear:
            if fn in _AMBIGUOUS_FUSED and not looks_like_attention(m):
                return None
            return _fused(m, fn, linear[fn])
    w = getattr(m, "in_proj_weight", None)
    if isinstance(w, nn.Parameter) and w.dim() == 2:
        return _fused(m, "in_proj_weight", None)
    return None


def linear_projection(lin, start=0, stop=None) -> Projection:
    """Rows ``start:stop`` (default: all) of an ``nn.Linear`` or a transformers ``Conv1D``, with its bias."""
    transposed = is_conv1d(lin)
    rows = lin.weight.shape[1 if transposed else 0]
    return Projection(lin.weight, start, rows if stop is None else stop, transposed, getattr(lin, "bias", None))


def _separate(m, names, linear) -> Described:
    qn, kn, vn = names
    q, k, v = (linear_projection(linear[n]) for n in names)
    gated = q.rows % 2 == 0 and says_gated_query(type(m), qn)
    H, Hkv, d = heads_of(m, q.rows // 2 if gated else q.rows, k.rows)
    if gated:   # rows [H, 2, d]: each head's query, then its output gate (left as it is)
        q = Projection(q.weight, 0, d, q.transposed, q.bias, groups=H, stride=2 * d)
    if v.rows != Hkv * d:
        raise UnsupportedAttention(f"{vn} has {v.rows} rows, not {Hkv} key/value heads of head_dim {d} (a value head "
                                   f"size different from the key's)")
    partial = None
    # a second complete set of projections (Longformer's query_global/..., LiLT's layout_query/...)
    for other in linear:
        for pre, post in ([other.split(qn, 1)] if qn in other and other != qn else []):
            if f"{pre}{kn}{post}" in linear and f"{pre}{vn}{post}" in linear:
                partial = (f"also holds {pre}{qn}{post}/{pre}{kn}{post}/{pre}{vn}{post}, a second set of query/key/"
                           f"value projections that is not conditioned")
    label = f"auto({qn}/{kn}/{vn}{', gated query' if gated else ''})"
    return Described(label, AttentionSpec(q, k, v, H, Hkv, d), partial)


def _qk_v(m, qkn, vn, linear) -> Described:
    qk_lin = linear[qkn]
    if not says_contiguous(type(m), qkn, 2, ("q", "k")):
        raise UnsupportedAttention(_unconfirmed(type(m), qkn, "[Q; K]"))
    v = linear_projection(linear[vn])
    qk_rows = qk_lin.weight.shape[1 if is_conv1d(qk_lin) else 0]
    if qk_rows % 2:
        raise ValueError(f"{qkn} has {qk_rows} rows, not two equal halves Q and K")
    H, Hkv, d = heads_of(m, qk_rows // 2, qk_rows // 2)
    half = H * d
    q, k = linear_projection(qk_lin, 0, half), linear_projection(qk_lin, half, 2 * half)
    if v.rows != Hkv * d:
        raise UnsupportedAttention(f"{vn} has {v.rows} rows, not {Hkv} value heads of head_dim {d}")
    return Described(f"auto({qkn}+{vn})", AttentionSpec(q, k, v, H, Hkv, d))


def _q_kv(m, qn, kvn, linear) -> Described:
    kv_lin = linear[kvn]
    if not says_contiguous(type(m), kvn, 2):
        raise UnsupportedAttention(_unconfirmed(type(m), kvn, "[K; V]"))
    q = linear_projection(linear[qn])
    kv_rows = kv_lin.weight.shape[1 if is_conv1d(kv_lin) else 0]
    if kv_rows % 2:
        raise ValueError(f"{kvn} has {kv_rows} rows, not two equal halves K and V")
    H, Hkv, d = heads_of(m, q.rows, kv_rows // 2)
    half = Hkv * d
    k, v = linear_projection(kv_lin, 0, half), linear_projection(kv_lin, half, 2 * half)
    return Described(f"auto({qn}+{kvn})", AttentionSpec(q, k, v, H, Hkv, d))


def _fused(m, name, lin) -> Described:
    if not says_contiguous(type(m), name, 3):
        raise UnsupportedAttention(_unconfirmed(type(m), name, "[Q; K; V]"))
    if lin is None:                     # an in_proj_weight parameter, with in_proj_bias
        weight, bias, transposed = m.in_proj_weight, getattr(m, "in_proj_bias", None), False
    else:
        weight, bias, transposed = lin.weight, getattr(lin, "bias", None), is_conv1d(lin)
    total = weight.shape[1 if transposed else 0]
    H, Hkv, d = _fused_heads(m, total)
    parts = fused_layout(total, num_heads=H, num_kv_heads=Hkv, head_dim=d)
    separate_bias = bias is None and any(isinstance(getattr(m, f"{p}_bias", None), torch.Tensor) for p in "qkv")
    projs = {}
    for p in "qkv":
        start, stop, _, _ = parts[p]
        if separate_bias:   # BEiT / EVA / Swin-v2: q_bias and v_bias parameters, k_bias a zero buffer or none
            b = getattr(m, f"{p}_bias", None)
            b = b if isinstance(b, nn.Parameter) else None
            projs[p] = Projection(weight, start, stop, transposed, b, bias_start=0 if b is not None else None)
        else:
            projs[p] = Projection(weight, start, stop, transposed, bias)
    return Described(f"auto({name})", AttentionSpec(projs["q"], projs["k"], projs["v"], H, Hkv, d))


def _fused_heads(m, total: int) -> tuple[int, int, int]:
    """Head counts of a contiguous fused projection of ``total`` rows: ``H`` from the module (or its
    config), ``d`` and ``H_kv`` from attributes or the rows (``H_kv = H`` when neither says)."""
    cfg = own_config(m)
    H, _ = int_attr(m, HEAD_ATTRS)
    if H is None and cfg is not None:
        H, _ = int_attr(cfg, HEAD_CFG)
    if H is None:
        raise UnsupportedAttention("cannot find the number of heads (no attribute num_heads / num_attention_heads / "
                                   "n_heads, and no config.num_attention_heads)")
    d, _ = int_attr(m, HEAD_DIM_ATTRS)
    Hkv, _ = int_attr(m, KV_HEAD_ATTRS)
    if Hkv is None and cfg is not None:
        Hkv, _ = int_attr(cfg, KV_HEAD_CFG)
    if d is None and Hkv is not None:
        if total % (H + 2 * Hkv):
            raise ValueError(f"fused projection of {total} rows does not split into {H} + 2 x {Hkv} heads")
        d = total // (H + 2 * Hkv)
    if d is None:
        Hkv = H
        if total % (3 * H):
            raise ValueError(f"fused projection of {total} rows does not split into 3 x {H} heads")
        d = total // (3 * H)
    if Hkv is None:
        rest = total - H * d
        if rest <= 0 or rest % (2 * d):
            raise ValueError(f"fused projection of {total} rows does not hold {H} query heads of head_dim {d} and "
                             f"equal K and V parts")
        Hkv = rest // (2 * d)
    return H, Hkv, d


def _unconfirmed(cls, name, what) -> str:
    return (f"fused projection {name}: its source does not show it split as contiguous {what} parts in that "
            f"order (per-head interleaved layouts have the same shape); register an adapter with "
            f"AttentionSpec.from_fused(..., layout=...) read from {cls.__qualname__}.forward")


# ------------------------------------------------------------------------------------------------
# what the module computes around its projections (for the probes)

def read_details(module: nn.Module, head_dim: int) -> AttentionDetails:
    """The :class:`AttentionDetails` of attention module ``module`` with heads of ``head_dim``,
    read from its attributes (see the module doc); never raises."""
    q_norm = k_norm = None
    for qn, kn in (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm")):
        if isinstance(getattr(module, qn, None), nn.Module):
            q_norm = Ref(module, qn)
        if isinstance(getattr(module, kn, None), nn.Module):
            k_norm = Ref(module, kn)
    cap = getattr(module, "attn_logit_softcapping", None)
    dropout = getattr(module, "attention_dropout", getattr(module, "dropout", 0.0))
    return AttentionDetails(
        scale=_layer_scale(module, head_dim), output=_output_projection(module), q_norm=q_norm, k_norm=k_norm,
        position_embeddings_arg=position_embeddings_arg(module), sliding_window=_sliding_window(module),
        softcap=float(cap) if _positive_number(cap) else None,
        dropout=float(dropout) if isinstance(dropout, (int, float)) and dropout > 0 else 0.0,
        causal=bool(getattr(module, "is_causal", False)))


def _positive_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def _layer_scale(module: nn.Module, head_dim: int) -> float:
    """The score scale the module itself uses (HF ``scaling``, timm ``scale``, GPT-2's flags)."""
    for attr in ("scaling", "scale"):
        val = getattr(module, attr, None)
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            return float(val)
    if hasattr(module, "scale_attn_weights"):   # HF GPT-2
        s = 1.0 / math.sqrt(head_dim) if module.scale_attn_weights else 1.0
        if getattr(module, "scale_attn_by_inverse_layer_idx", False):
            s /= float(getattr(module, "layer_idx", 0) or 0) + 1.0
        return s
    return 1.0 / math.sqrt(head_dim)


def _output_projection(module: nn.Module) -> Optional[OutputProjection]:
    """W_O, or None when the module holds no output projection."""
    for attr in ("out_proj", "o_proj", "c_proj", "proj"):
        sub = getattr(module, attr, None)
        w = getattr(sub, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2:
            # GPT-2's Conv1D stores [in, out] and computes x @ W
            return OutputProjection(Ref(sub, "weight"), transposed=type(sub).__name__ == "Conv1D")
    return None


def position_embeddings_arg(module: nn.Module) -> Optional[int]:
    """The position of ``position_embeddings`` among the parameters of ``module.forward`` (Hugging
    Face attention modules receive the rotary ``(cos, sin)`` under that name), or None."""
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("position_embeddings") if "position_embeddings" in params else None


def _sliding_window(module: nn.Module) -> Optional[int]:
    """The module's ``sliding_window`` (keys per query), or its config's for the layers the config
    says slide (Mistral-style modules pass ``config.sliding_window`` to the attention call, for every
    layer or for the ``"sliding_attention"`` entries of ``layer_types``); None without one."""
    window = getattr(module, "sliding_window", None)
    config = getattr(module, "config", None)
    if not hasattr(module, "sliding_window") and config is not None:
        window = getattr(config, "sliding_window", None)
        types_ = getattr(config, "layer_types", None)
        idx = getattr(module, "layer_idx", None)
        if types_ is not None and isinstance(idx, int) and idx < len(types_) \
                and types_[idx] != "sliding_attention":
            window = None
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None
