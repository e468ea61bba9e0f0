"""Attention adapters: where a module keeps its Q/K/V projections, in one declarative description.

An adapter turns an attention module into an :class:`AttentionSpec`: head counts and, for each of
Q, K and V, a :class:`Projection` saying which parameter holds it, which rows of the ``nn.Linear``
layout ``[out, in]`` matrix it occupies (fused ``[3E, E]`` weights hold three projections), and
whether the parameter is stored transposed (``[in, out]``, GPT-2's ``Conv1D``). From that
description :func:`condinit.apply` reads ``[rows, in]`` views and writes conditioned values back in
place, also into a shard of a DTensor (it only has to intersect row/column ranges), so an adapter
never copies or re-registers a parameter.

Lookup: by class, walking the module's MRO, so a subclass of a supported class is supported.
Registry keys are classes or ``"module.path.QualName"`` strings; built-in adapters for third-party
libraries are keyed by string so that neither transformers nor timm is imported by condinit.

Add your own in a few lines::

    from condinit.models import register_adapter, AttentionSpec

    register_adapter(MyAttention, lambda m: AttentionSpec.from_linears(
        m.wq, m.wk, m.wv, num_heads=m.n_heads, num_kv_heads=m.n_kv_heads))

Built in: ``torch.nn.MultiheadAttention`` (fused ``in_proj_weight``, or separate
``q/k/v_proj_weight`` when ``kdim``/``vdim`` differ; ``nn.TransformerEncoderLayer`` /
``DecoderLayer`` / ``nn.Transformer`` are covered through the MHA modules they hold), Hugging Face
transformers Llama / Mistral / Qwen2 / ViT (``q_proj``/``k_proj``/``v_proj``, GQA from the row
counts), BERT / RoBERTa self- and cross-attention (``query``/``key``/``value``), GPT-2
(``Conv1D c_attn``, fused and stored transposed; cross-attention ``q_attn`` + ``c_attn``), timm
``Attention`` (fused ``qkv``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import nn

from condinit._validate import check_bool, check_int, check_tensor

__all__ = ["Projection", "AttentionSpec", "AttentionAdapter", "register_adapter", "unregister_adapter",
           "get_adapter", "registered_adapters"]


@dataclass(frozen=True)
class Projection:
    """One of Q, K, V: rows ``start:stop`` of the nn.Linear-layout matrix held by ``weight``.

    ``weight`` is the parameter (``[out_total, in]``, or ``[in, out_total]`` when ``transposed``);
    ``bias`` (optional) holds this projection's rows at ``bias_start:bias_start + rows`` of a 1-D
    bias (``bias_start`` defaults to ``start``). ``start:stop`` is the whole
    first dimension for an unfused projection. The projection's logical matrix is
    ``W = weight[start:stop]`` (or ``weight[:, start:stop].T``), shape ``[rows, in_features]``.
    """

    weight: torch.Tensor
    start: int
    stop: int
    transposed: bool = False
    bias: Optional[torch.Tensor] = None
    bias_start: Optional[int] = None   # where this projection's rows start in ``bias`` (default ``start``)

    @property
    def bias_offset(self) -> int:
        return self.start if self.bias_start is None else self.bias_start

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def in_features(self) -> int:
        return self.weight.shape[0] if self.transposed else self.weight.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        """Logical ``[rows, in_features]`` (nn.Linear layout)."""
        return (self.rows, self.in_features)


    def view(self, t: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[rows, in]`` view of the (plain, non-DTensor) weight in nn.Linear layout; writes go through."""
        w = self.weight if t is None else t
        w = w.detach()
        return w[:, self.start:self.stop].t() if self.transposed else w[self.start:self.stop]


@dataclass(frozen=True)
class AttentionSpec:
    """What :func:`condinit.apply` needs to know about one attention module.

    ``q`` has ``num_heads * head_dim`` rows, ``k`` and ``v`` ``num_kv_heads * head_dim`` (GQA/MQA when
    ``num_kv_heads < num_heads``). Head ``h`` of Q is rows ``h*head_dim:(h+1)*head_dim``.

    Examples:
        >>> w = torch.nn.MultiheadAttention(64, 4).in_proj_weight          # fused [3 * 64, 64]
        >>> AttentionSpec(Projection(w, 0, 64), Projection(w, 64, 128), Projection(w, 128, 192),
        ...               num_heads=4, num_kv_heads=4, head_dim=16)
        >>> AttentionSpec.from_fused(w, num_heads=4)                       # the same, in one call
    """

    q: Projection
    k: Projection
    v: Projection
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self):
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            check_int(name, getattr(self, name), min=1)
        if self.q.rows != self.num_heads * self.head_dim:
            raise ValueError(f"AttentionSpec: q has {self.q.rows} rows, expected num_heads * head_dim = "
                             f"{self.num_heads} * {self.head_dim}")
        for name, p in (("k", self.k), ("v", self.v)):
            if p.rows != self.num_kv_heads * self.head_dim:
                raise ValueError(f"AttentionSpec: {name} has {p.rows} rows, expected num_kv_heads * head_dim"
                                 f" = {self.num_kv_heads} * {self.head_dim}")

    def projections(self):
        return (("q", self.q), ("k", self.k), ("v", self.v))

    @classmethod
    def from_linears(cls, q: nn.Module, k: nn.Module, v: nn.Module, *, num_heads: int,
                     num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None) -> "AttentionSpec":
        """Spec for three separate ``nn.Linear``-like modules (``.weight`` ``[out, in]``, ``.bias``).

        ``head_dim`` defaults to ``q.out_features / num_heads``; ``num_kv_heads`` to ``k``'s row count
        divided by ``head_dim`` (so GQA needs no extra argument).

        Examples:
            >>> register_adapter(MyAttention, lambda m: AttentionSpec.from_linears(
            ...     m.wq, m.wk, m.wv, num_heads=m.n_heads))                # GQA read from wk's rows
        """
        return cls.from_weights(q.weight, k.weight, v.weight, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                head_dim=head_dim, q_bias=getattr(q, "bias", None),
                                k_bias=getattr(k, "bias", None), v_bias=getattr(v, "bias", None))

    @classmethod
    def from_weights(cls, q_weight, k_weight, v_weight, *, num_heads: int, num_kv_heads: Optional[int] = None,
                     head_dim: Optional[int] = None, q_bias=None, k_bias=None, v_bias=None) -> "AttentionSpec":
        """Spec for three separate ``[out, in]`` weight tensors (and optional biases).

        Examples:
            >>> m = torch.nn.MultiheadAttention(24, 4, kdim=17, vdim=33)
            >>> AttentionSpec.from_weights(m.q_proj_weight, m.k_proj_weight, m.v_proj_weight, num_heads=4)
        """
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight), ("v_weight", v_weight)):
            check_tensor(name, w, dim=2)
        _check_heads(num_heads, num_kv_heads, head_dim)
        head_dim = _head_dim(q_weight.shape[0], num_heads, head_dim)
        if num_kv_heads is None:
            if k_weight.shape[0] % head_dim:
                raise ValueError(f"k has {k_weight.shape[0]} rows, not a multiple of head_dim {head_dim}")
            num_kv_heads = k_weight.shape[0] // head_dim
        return cls(Projection(q_weight, 0, q_weight.shape[0], bias=q_bias),
                   Projection(k_weight, 0, k_weight.shape[0], bias=k_bias),
                   Projection(v_weight, 0, v_weight.shape[0], bias=v_bias),
                   num_heads, int(num_kv_heads), head_dim)

    @classmethod
    def from_fused(cls, weight, *, num_heads: int, num_kv_heads: Optional[int] = None,
                   head_dim: Optional[int] = None, bias=None, transposed: bool = False,
                   order: str = "qkv") -> "AttentionSpec":
        """Spec for one fused weight holding Q, K, V stacked along the output dimension (in ``order``).

        ``weight`` is ``[(H + 2 H_kv) d, in]`` (``[in, ...]`` when ``transposed``).

        Examples:
            >>> AttentionSpec.from_fused(timm_attn.qkv.weight, num_heads=12, bias=timm_attn.qkv.bias)
            >>> AttentionSpec.from_fused(gpt2_attn.c_attn.weight, num_heads=12, transposed=True)  # Conv1D
        """
        check_tensor("weight", weight, dim=2)
        _check_heads(num_heads, num_kv_heads, head_dim)
        transposed = check_bool("transposed", transposed)
        if not isinstance(order, str) or sorted(order) != ["k", "q", "v"]:
            raise ValueError(f"order must be a permutation of 'qkv', got {order!r}")
        total = weight.shape[1] if transposed else weight.shape[0]
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if head_dim is None:
            if total % (num_heads + 2 * num_kv_heads):
                raise ValueError(f"fused weight with {total} output rows does not split into "
                                 f"{num_heads} + 2 x {num_kv_heads} heads")
            head_dim = total // (num_heads + 2 * num_kv_heads)
        sizes = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        if sum(sizes.values()) != total:
            raise ValueError(f"fused weight has {total} output rows, expected {sum(sizes.values())}")
        projs, at = {}, 0
        for name in order:
            projs[name] = Projection(weight, at, at + sizes[name], transposed, bias)
            at += sizes[name]
        return cls(projs["q"], projs["k"], projs["v"], num_heads, num_kv_heads, head_dim)


def _check_heads(num_heads, num_kv_heads, head_dim) -> None:
    check_int("num_heads", num_heads, min=1)
    check_int("num_kv_heads", num_kv_heads, min=1, allow_none=True)
    check_int("head_dim", head_dim, min=1, allow_none=True)


def _head_dim(rows: int, num_heads: int, head_dim: Optional[int]) -> int:
    if head_dim is None:
        if rows % num_heads:
            raise ValueError(f"q has {rows} rows, not divisible by num_heads={num_heads}")
        head_dim = rows // num_heads
    return int(head_dim)


class AttentionAdapter:
    """Maps one kind of attention module to its :class:`AttentionSpec`.

    Subclass and override :meth:`spec` (and set ``name``), or pass any callable ``module -> AttentionSpec``
    to :func:`register_adapter`, which wraps it in this class.
    """

    name = "custom"

    def __init__(self, fn: Optional[Callable[[nn.Module], AttentionSpec]] = None, name: Optional[str] = None):
        self._fn = fn
        if name is not None:
            self.name = name
        elif fn is not None:
            self.name = getattr(fn, "__name__", "custom")

    def spec(self, module: nn.Module) -> AttentionSpec:
        if self._fn is None:
            raise NotImplementedError(f"{type(self).__name__}.spec")
        return self._fn(module)

    def __repr__(self):
        return f"<AttentionAdapter {self.name}>"


# ------------------------------------------------------------------------------------------------
# built-in adapters

def _mha_spec(m: nn.MultiheadAttention) -> AttentionSpec:
    if m._qkv_same_embed_dim:
        return AttentionSpec.from_fused(m.in_proj_weight, num_heads=m.num_heads, bias=m.in_proj_bias)
    e = m.embed_dim
    b = m.in_proj_bias
    # Separate weights (kdim/vdim differ from embed_dim) still share one [3E] in_proj_bias.
    return AttentionSpec(Projection(m.q_proj_weight, 0, e, bias=b, bias_start=0),
                         Projection(m.k_proj_weight, 0, e, bias=b, bias_start=e),
                         Projection(m.v_proj_weight, 0, e, bias=b, bias_start=2 * e),
                         m.num_heads, m.num_heads, m.head_dim)


def _config_heads(m: nn.Module) -> int:
    for attr in ("num_heads", "num_attention_heads"):
        val = getattr(m, attr, None)
        if isinstance(val, int):
            return val
    cfg = getattr(m, "config", None)
    val = getattr(cfg, "num_attention_heads", None)
    if isinstance(val, int):
        return val
    raise ValueError(f"{type(m).__name__}: cannot find the number of attention heads "
                     f"(no num_heads / num_attention_heads attribute or config.num_attention_heads)")


def _hf_qkv_proj(m: nn.Module) -> AttentionSpec:
    """HF Llama / Mistral / Qwen2 / ViT (transformers >= 5): q_proj, k_proj, v_proj; GQA from row counts."""
    head_dim = getattr(m, "head_dim", None)
    return AttentionSpec.from_linears(m.q_proj, m.k_proj, m.v_proj, num_heads=_config_heads(m),
                                      head_dim=head_dim if isinstance(head_dim, int) else None)


def _hf_query_key_value(m: nn.Module) -> AttentionSpec:
    """HF BERT / RoBERTa / ViT (transformers < 5): query, key, value."""
    head_dim = getattr(m, "attention_head_size", None)
    return AttentionSpec.from_linears(m.query, m.key, m.value, num_heads=_config_heads(m),
                                      head_dim=head_dim if isinstance(head_dim, int) else None)


def _hf_gpt2(m: nn.Module) -> AttentionSpec:
    """HF GPT-2: Conv1D stores ``weight`` as ``[in, out]`` (x @ W + b); c_attn fuses Q, K, V (or K, V
    for cross-attention, whose Q is ``q_attn``)."""
    h = m.num_heads
    if getattr(m, "is_cross_attention", False):
        e = m.c_attn.weight.shape[1] // 2
        d = e // h
        return AttentionSpec(Projection(m.q_attn.weight, 0, e, True, m.q_attn.bias),
                             Projection(m.c_attn.weight, 0, e, True, m.c_attn.bias),
                             Projection(m.c_attn.weight, e, 2 * e, True, m.c_attn.bias), h, h, d)
    return AttentionSpec.from_fused(m.c_attn.weight, num_heads=h, bias=m.c_attn.bias, transposed=True)


def _timm_attention(m: nn.Module) -> AttentionSpec:
    """timm ``Attention``: fused ``qkv`` Linear ``[3 H d, D]`` in q, k, v order."""
    return AttentionSpec.from_fused(m.qkv.weight, num_heads=m.num_heads, head_dim=m.head_dim, bias=m.qkv.bias)


_REGISTRY: dict[Union[type, str], AttentionAdapter] = {}


def _key(cls_or_name) -> Union[type, str]:
    if isinstance(cls_or_name, str):
        if "." not in cls_or_name:
            raise ValueError(f"register_adapter: a string key must be 'module.path.ClassName', got {cls_or_name!r}")
        return cls_or_name
    if isinstance(cls_or_name, type) and issubclass(cls_or_name, nn.Module):
        return cls_or_name
    raise TypeError(f"register_adapter: cls must be an nn.Module subclass or a 'module.path.ClassName' "
                    f"string, got {cls_or_name!r}")


def register_adapter(cls: Union[type, str], adapter: Union[AttentionAdapter, Callable[[nn.Module], AttentionSpec]],
                     *, name: Optional[str] = None) -> AttentionAdapter:
    """Register ``adapter`` for modules of class ``cls`` (and its subclasses, unless they have their own).

    ``cls``: an ``nn.Module`` subclass or its ``"module.path.QualName"`` (lets you register a class
    without importing its library). ``adapter``: an :class:`AttentionAdapter`, or a callable
    ``module -> AttentionSpec`` (wrapped; ``name`` labels it in reports). Replaces an earlier
    registration for the same key. Returns the registered adapter.

    Examples:
        >>> register_adapter(MyAttention, lambda m: AttentionSpec.from_linears(
        ...     m.wq, m.wk, m.wv, num_heads=m.n_heads, num_kv_heads=m.n_kv_heads))
        >>> register_adapter("mylib.layers.FusedAttention",             # without importing mylib
        ...                  lambda m: AttentionSpec.from_fused(m.qkv.weight, num_heads=m.heads), name="mylib")
    """
    key = _key(cls)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"register_adapter: name must be a str or None, got {type(name).__name__}")
    if not isinstance(adapter, AttentionAdapter):
        if not callable(adapter):
            raise TypeError(f"register_adapter: adapter must be an AttentionAdapter or a callable "
                            f"module -> AttentionSpec, got {type(adapter).__name__}")
        adapter = AttentionAdapter(adapter, name=name or (key.__name__ if isinstance(key, type) else key.rsplit(".", 1)[1]))
    elif name is not None:
        adapter.name = name
    _REGISTRY[key] = adapter
    return adapter


def unregister_adapter(cls: Union[type, str]) -> None:
    """Remove the adapter registered for ``cls`` (KeyError if there is none)."""
    del _REGISTRY[_key(cls)]


def registered_adapters() -> dict:
    """A copy of the registry: key (class or dotted name) -> adapter."""
    return dict(_REGISTRY)


def get_adapter(module: nn.Module) -> Optional[AttentionAdapter]:
    """The adapter for ``module``'s class or nearest registered base class, or None."""
    for klass in type(module).__mro__:
        if klass is nn.Module or klass is object:
            break
        hit = _REGISTRY.get(klass)
        if hit is None:
            hit = _REGISTRY.get(f"{klass.__module__}.{klass.__qualname__}")
        if hit is not None:
            return hit
    return None


def _register_builtins():
    register_adapter(nn.MultiheadAttention, _mha_spec, name="torch.MultiheadAttention")
    tf = "transformers.models"
    for fam, cls in (("llama", "LlamaAttention"), ("mistral", "MistralAttention"), ("qwen2", "Qwen2Attention"),
                     ("vit", "ViTAttention")):
        register_adapter(f"{tf}.{fam}.modeling_{fam}.{cls}", _hf_qkv_proj, name=f"hf.{cls}")
    for fam, cls in (("bert", "BertSelfAttention"), ("bert", "BertCrossAttention"),
                     ("roberta", "RobertaSelfAttention"), ("roberta", "RobertaCrossAttention"),
                     ("vit", "ViTSelfAttention")):
        register_adapter(f"{tf}.{fam}.modeling_{fam}.{cls}", _hf_query_key_value, name=f"hf.{cls}")
    register_adapter(f"{tf}.gpt2.modeling_gpt2.GPT2Attention", _hf_gpt2, name="hf.GPT2Attention")
    register_adapter("timm.layers.attention.Attention", _timm_attention, name="timm.Attention")


_register_builtins()
