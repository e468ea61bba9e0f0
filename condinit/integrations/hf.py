"""Hugging Face ``transformers``: ``attn_implementation="condinit"``.

:func:`register_hf_attention` registers :func:`hf_attention_forward` with
``transformers.AttentionInterface`` and ``transformers``' SDPA mask builder under the name
``"condinit"``. Models then build the masks they build for ``"sdpa"`` (None for a plain causal or
bidirectional mask, a 4-D bool mask otherwise) and call :func:`condinit.sdpa`, so
``torch.func.jvp`` works through the whole model. ``transformers`` is imported only when
:func:`register_hf_attention` is called, never by ``import condinit``.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch
from torch import Tensor

from condinit.ops.attention.sdpa import sdpa

__all__ = ["register_hf_attention", "hf_attention_forward", "HF_ATTENTION_NAME"]

HF_ATTENTION_NAME = "condinit"

# Keyword arguments that change the attention function and that condinit's op cannot apply: an
# error names them instead of returning a different function.
_UNSUPPORTED = {
    "softcap": "logit soft-capping (Gemma-2 style)",
    "s_aux": "attention sinks",
}

_REGISTER_LOCK = threading.Lock()
_registered = False


def hf_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                         attention_mask: Optional[Tensor], dropout: float = 0.0,
                         scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                         position_bias: Optional[Tensor] = None, **kwargs) -> tuple[Tensor, None]:
    """The ``"condinit"`` attention function: ``transformers``' ``sdpa_attention_forward``
    computed by :func:`condinit.sdpa`.

    ``query`` ``[B, H, Nq, d]``, ``key`` / ``value`` ``[B, Hkv, Nk, d]`` (``Hkv`` divides ``H``:
    grouped-query attention without repeating key/value), ``attention_mask`` a 4-D bool or
    additive mask or None. Returns ``(out [B, Nq, H, d], None)``.

    As in ``sdpa_attention_forward``: ``is_causal`` (else ``module.is_causal``, default True)
    applies only without a mask and with more than one query; sliding windows and padding arrive
    inside ``attention_mask`` (the ``sliding_window`` keyword is already encoded there);
    ``position_bias`` (T5-style) is folded into an additive mask. :func:`condinit.sdpa`
    recognises causal masks, sliding windows and key padding (left or right) in that mask and
    runs them through the fused op's kernel masks (O(N) memory); other masks take its dense
    path. Packed sequences given as ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (with ``max_length_q``
    / ``max_length_k``, batch 1, no ``attention_mask``: what ``transformers``' flattening
    collators pass) run :func:`condinit.attention_varlen`, with the ``sliding_window`` keyword
    as its window.

    Raises ``ValueError`` for what it cannot compute: ``softcap`` (logit soft-capping), ``s_aux``
    (attention sinks), ``output_attentions=True`` (no attention weights are formed);
    ``NotImplementedError`` for ``dropout > 0`` (call ``model.eval()``).

    Examples:
        >>> condinit.register_hf_attention()
        >>> model = transformers.LlamaForCausalLM(config)      # config._attn_implementation = "condinit"
        >>> out, tangent = torch.func.jvp(lambda e: model(inputs_embeds=e).logits, (embeds,), (direction,))
    """
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"attn_implementation='condinit' does not support {name} ({what}); "
                             f"use attn_implementation='eager' for this model")
    if kwargs.get("output_attentions", False):
        raise ValueError("attn_implementation='condinit' does not support output_attentions=True "
                         "(no attention weights are formed); use attn_implementation='eager'")
    q_length = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if kwargs.get("cu_seq_lens_q") is not None and attention_mask is None and position_bias is None:
        return _packed_attention(query, key, value, bool(is_causal), scaling, kwargs), None
    is_causal = bool(q_length > 1 and attention_mask is None and is_causal)
    if position_bias is not None:
        from transformers.integrations.sdpa_attention import create_position_bias_mask
        attention_mask = create_position_bias_mask(position_bias, attention_mask, is_causal, query, key)
        is_causal = False
    out = sdpa(query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal,
               scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _packed_attention(query: Tensor, key: Tensor, value: Tensor, is_causal: bool,
                      scaling: Optional[float], kwargs: dict) -> Tensor:
    """Packed sequences ``[1, H, T, d]`` with ``cu_seq_lens_q/k``: :func:`condinit.attention_varlen`;
    returns ``[1, T, H, d]``."""
    from condinit.ops.attention.varlen import attention_varlen
    if query.shape[0] != 1:
        raise ValueError(f"cu_seq_lens_q describes packed sequences in a batch of 1, got a query of "
                         f"shape {tuple(query.shape)}")
    cu_q = kwargs["cu_seq_lens_q"]
    cu_k = kwargs.get("cu_seq_lens_k")
    cu_k = cu_q if cu_k is None else cu_k
    lens_q, lens_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    max_q = kwargs.get("max_length_q") or int(lens_q.max())
    max_k = kwargs.get("max_length_k") or int(lens_k.max())
    sliding = kwargs.get("sliding_window")
    window = (int(sliding) - 1, -1) if sliding is not None and is_causal else None
    out = attention_varlen(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                           cu_q, cu_k, int(max_q), int(max_k), causal=is_causal, window=window,
                           scale=scaling)
    return out.unsqueeze(0)


def register_hf_attention() -> str:
    """Make ``attn_implementation="condinit"`` available in Hugging Face ``transformers``;
    returns ``"condinit"``. Idempotent; imports ``transformers``.

    Registers :func:`hf_attention_forward` with ``transformers.AttentionInterface`` and
    ``transformers``' SDPA mask builder with ``AttentionMaskInterface`` (so padding and sliding
    windows reach the attention as a mask, exactly as for ``"sdpa"``). Use it with
    ``from_pretrained(..., attn_implementation="condinit")``, ``from_config(config,
    attn_implementation="condinit")`` or ``model.set_attn_implementation("condinit")``; then
    ``torch.func.jvp`` / ``torch.autograd.forward_ad`` work through the model
    (:func:`hf_attention_forward` says what it supports).

    Examples:
        >>> condinit.register_hf_attention()
        'condinit'
        >>> model = AutoModelForCausalLM.from_config(config, attn_implementation="condinit").eval()
    """
    global _registered
    with _REGISTER_LOCK:
        if not _registered:
            try:
                from transformers import AttentionInterface
                from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
            except ImportError as exc:
                raise ImportError(f"attn_implementation=\"condinit\" needs transformers: pip install 'condinit[hf]' "
                                  f"({exc})") from exc
            AttentionInterface.register(HF_ATTENTION_NAME, hf_attention_forward)
            AttentionMaskInterface.register(HF_ATTENTION_NAME, sdpa_mask)
            _registered = True
    return HF_ATTENTION_NAME
