"""Adapters for Hugging Face transformers attention classes whose layouts structure cannot read.

Each layout was read from the model's own ``forward`` (docstrings quote it); keyed by the classes'
dotted names, so transformers is never imported by condinit.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from condinit.models.discovery import (HEAD_ATTRS, HEAD_CFG, HEAD_DIM_ATTRS, heads_of, int_attr, linear_projection,
                                       own_config)
from condinit.models.registry import register_adapter
from condinit.models.spec import AttentionSpec, Projection, UnsupportedAttention


def _hf_gpt2(m: nn.Module) -> AttentionSpec:
    """HF GPT-2 and its copies: Conv1D stores ``weight`` as ``[in, out]`` (x @ W + b); ``c_attn``
    fuses Q, K, V, split with ``.split(split_size, dim=2)`` (K, V for cross-attention, whose Q is
    ``q_attn``)."""
    cross = getattr(m, "is_cross_attention", False) is True
    e = m.c_attn.weight.shape[1] // (2 if cross else 3)
    H, _, d = heads_of(m, e, e)
    if cross:
        e = H * d
        return AttentionSpec(Projection(m.q_attn.weight, 0, e, True, m.q_attn.bias),
                             Projection(m.c_attn.weight, 0, e, True, m.c_attn.bias),
                             Projection(m.c_attn.weight, e, 2 * e, True, m.c_attn.bias), H, H, d)
    return AttentionSpec.from_fused(m.c_attn.weight, num_heads=H, head_dim=d, bias=m.c_attn.bias, transposed=True)


def _fused_linear(m: nn.Module, attr: str, layout: str, *, num_heads=None, num_kv_heads=None, head_dim=None,
                  order: str = "qkv", groups: Optional[int] = None) -> AttentionSpec:
    lin = getattr(m, attr)
    total = lin.weight.shape[0]
    if num_heads is None:
        num_heads, _ = int_attr(m, HEAD_ATTRS)
        if num_heads is None and own_config(m) is not None:
            num_heads, _ = int_attr(own_config(m), HEAD_CFG)
        if num_heads is None:
            raise UnsupportedAttention("cannot find the number of heads")
    if head_dim is None:
        head_dim, _ = int_attr(m, HEAD_DIM_ATTRS)
    return AttentionSpec.from_fused(lin.weight, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                    bias=lin.bias, order=order, layout=layout, groups=groups)


def _hf_per_head(attr: str):
    """``[H, 3, d]`` rows: GPT-NeoX (``view(..., -1, 3 * head_size).chunk(3)``), GPT-NeoX-Japanese,
    BLOOM and Persimmon (``view(..., num_heads, 3, head_dim)``)."""
    def spec(m):
        return _fused_linear(m, attr, "per_head")
    spec.__name__ = f"per_head_{attr}"
    return spec


def _hf_falcon(m: nn.Module) -> AttentionSpec:
    """Falcon's ``_split_heads``: the new decoder architecture views ``query_key_value`` as
    ``[H_kv, H/H_kv + 2, d]`` (a group's query heads, its key, its value); multi-query as ``[H + 2,
    d]`` (``[Q; K; V]`` with one K/V head); otherwise ``[H, 3, d]`` (Falcon-RW)."""
    H, d = m.num_heads, m.head_dim
    if m.new_decoder_architecture:
        return _fused_linear(m, "query_key_value", "per_group", num_heads=H, num_kv_heads=m.num_kv_heads, head_dim=d)
    if m.multi_query:
        return _fused_linear(m, "query_key_value", "contiguous", num_heads=H, num_kv_heads=1, head_dim=d)
    return _fused_linear(m, "query_key_value", "per_head", num_heads=H, head_dim=d)


def _hf_gpt_bigcode(m: nn.Module) -> AttentionSpec:
    """GPTBigCode: multi-query ``c_attn(x).split((embed_dim, kv_dim, kv_dim))`` is ``[Q; K; V]``
    with one K/V head; multi-head ``view(..., num_heads, 3 * head_dim).split(head_dim)`` is per
    head. Its cross-attention splits ``c_attn`` into ``(head_dim, head_dim)``, which fits no
    multi-head layout: refused."""
    if getattr(m, "is_cross_attention", False):
        raise UnsupportedAttention("GPTBigCode cross-attention: its forward splits c_attn(encoder states) into "
                                   "(head_dim, head_dim), which holds K and V only for a single head")
    if m.multi_query:
        return _fused_linear(m, "c_attn", "contiguous", num_heads=m.num_heads, num_kv_heads=1, head_dim=m.head_dim)
    return _fused_linear(m, "c_attn", "per_head", num_heads=m.num_heads, head_dim=m.head_dim)


def _hf_phi3(m: nn.Module) -> AttentionSpec:
    """Phi-3 (and Phi-4-multimodal, Ergo) ``qkv_proj``: ``qkv[..., :H d]``, then ``H_kv d`` key rows, then
    the values (Ergo: ``view(..., -1, head_dim).split((H, H_kv, H_kv), dim=-2)``, the same rows)."""
    H, _ = int_attr(m.config, ("num_attention_heads",))
    Hkv, _ = int_attr(m.config, ("num_key_value_heads",))
    return _fused_linear(m, "qkv_proj", "contiguous", num_heads=H, num_kv_heads=Hkv, head_dim=m.head_dim)


def _hf_minicpm5(m: nn.Module) -> AttentionSpec:
    """MiniCPM5-MoE ``q_gate_proj``: ``view(..., -1, 2 * head_dim).chunk(2, dim=-1)``, so rows
    ``[H, 2, d]``, each head's query then its output gate (left as it is); ``k_proj``, ``v_proj``
    separate."""
    H, _ = int_attr(m.config, ("num_attention_heads",))
    Hkv, _ = int_attr(m.config, ("num_key_value_heads",))
    d = m.head_dim
    lin = m.q_gate_proj
    q = Projection(lin.weight, 0, d, False, lin.bias, groups=H, stride=2 * d)
    return AttentionSpec(q, linear_projection(m.k_proj), linear_projection(m.v_proj), H, Hkv, d)


def _hf_deberta(m: nn.Module) -> AttentionSpec:
    """DeBERTa (v1) ``DisentangledSelfAttention``: ``in_proj`` (no bias) read through
    ``view(..., H, -1).chunk(3, dim=-1)``, so rows ``[H, 3, d]``; Q and V biases are separate
    ``[H d]`` parameters ``q_bias`` / ``v_bias`` (K has none)."""
    H, d = m.num_attention_heads, m.attention_head_size
    w = m.in_proj.weight
    if m.in_proj.bias is not None:
        raise UnsupportedAttention("DeBERTa in_proj with its own bias: not the layout of transformers' "
                                   "DisentangledSelfAttention")
    return AttentionSpec(Projection(w, 0, d, groups=H, stride=3 * d, bias=m.q_bias, bias_start=0, bias_stride=d),
                         Projection(w, d, 2 * d, groups=H, stride=3 * d),
                         Projection(w, 2 * d, 3 * d, groups=H, stride=3 * d, bias=m.v_bias, bias_start=0,
                                    bias_stride=d), H, H, d)


def _hf_codegen(m: nn.Module) -> AttentionSpec:
    """CodeGen ``qkv_proj``: ``view(..., mp_num, 3 * local_dim).split(local_dim)`` assigned to
    query, value, key: ``mp_num`` (4) groups of ``[Q; V; K]``."""
    return _fused_linear(m, "qkv_proj", "grouped", num_heads=m.num_attention_heads, head_dim=m.head_dim,
                         order="qvk", groups=m.mp_num)


def _hf_xlnet(m: nn.Module) -> AttentionSpec:
    """XLNet ``XLNetRelativeAttention``: parameters ``q``, ``k``, ``v`` of shape ``[D, H, d]`` used as
    ``einsum("ibh,hnd->ibnd", x, W)``, i.e. ``x @ W.reshape(D, H * d)``: an ``[in, out]`` matrix
    (transposed) whose column ``h*d + i`` is channel ``i`` of head ``h``. The projections have no
    biases; ``r_w_bias``, ``r_r_bias`` and ``r_s_bias`` are the per-head vectors of the relative
    attention's content, position and segment terms (Transformer-XL's ``u``, ``v``), left as the
    model made them with ``r`` and ``seg_embed``, like every relative-position parameter."""
    H, d = m.n_head, m.d_head
    projs = []
    for name in ("q", "k", "v"):
        w = getattr(m, name)
        if tuple(w.shape) != (m.d_model, H, d):
            raise UnsupportedAttention(f"XLNet {name} has shape {tuple(w.shape)}, not (d_model, n_head, d_head) = "
                                       f"({m.d_model}, {H}, {d}): not the layout of transformers' "
                                       f"XLNetRelativeAttention")
        projs.append(Projection(w, 0, H * d, transposed=True, matrix_shape=(m.d_model, H * d)))
    return AttentionSpec(*projs, H, H, d)


def _hf_jetmoe(m: nn.Module) -> AttentionSpec:
    """JetMoE's mixture of attention heads (``JetMoeAttention``): expert ``e`` of
    ``experts.input_linear`` (``[E, H_kv d, D]``, ``F.linear(x, weight[e])``) projects the query of
    ``H_kv`` heads; a token's ``top_k`` experts give its ``top_k * H_kv`` query heads
    (``view(..., -1, head_dim)``), and query head ``s * H_kv + j`` attends to key/value head ``j``
    of ``kv_proj`` (``chunk(2)``: ``[K; V]``, then ``repeat(1, top_k, 1, 1)``). Q is every
    expert's heads, ``E * H_kv`` of them (expert ``e``'s head ``j`` is head ``e * H_kv + j``), each
    semi-orthogonal; the router, the output experts and the layer's bias are not Q/K/V."""
    Hkv, d = m.num_key_value_heads, m.head_dim
    w = m.experts.input_linear.weight
    kv = m.kv_proj
    E, rows, D = w.shape
    if rows != Hkv * d or kv.weight.shape[0] != 2 * Hkv * d:
        raise UnsupportedAttention(f"JetMoE query experts of {rows} rows and kv_proj of {kv.weight.shape[0]} rows "
                                   f"do not hold {Hkv} heads of head_dim {d} (and twice that): not the layout of "
                                   f"transformers' JetMoeAttention")
    q = Projection(w, 0, E * rows, matrix_shape=(E * rows, D))
    k = Projection(kv.weight, 0, Hkv * d, bias=kv.bias)
    v = Projection(kv.weight, Hkv * d, 2 * Hkv * d, bias=kv.bias)
    return AttentionSpec(q, k, v, E * Hkv, Hkv, d)


def _hf_aimv2_pooling(m: nn.Module) -> AttentionSpec:
    """AIMv2's attention-pooling head (``Aimv2AttentionPoolingHead``): the query is the learned
    ``cls_token`` (``[1, 1, D]`` reshaped to ``(1, H, D / H)``), the keys and values ``k_proj`` /
    ``v_proj`` of the tokens, ``F.scaled_dot_product_attention`` per head. The query is no
    projection (``fixed``: left as the model made it); K and V are conditioned."""
    H, D = m.num_heads, m.hidden_size
    if D % H or m.cls_token.numel() != D:
        raise UnsupportedAttention(f"AIMv2 pooling head with hidden_size {D}, {H} heads and a cls_token of "
                                   f"{m.cls_token.numel()} entries: not the layout of transformers' "
                                   f"Aimv2AttentionPoolingHead")
    q = Projection(m.cls_token, 0, D, matrix_shape=(D, 1), fixed=True)
    return AttentionSpec(q, linear_projection(m.k_proj), linear_projection(m.v_proj), H, H, D // H)


def _hf_squeezebert(m: nn.Module) -> AttentionSpec:
    """SqueezeBERT ``SqueezeBertSelfAttention``: ``query``, ``key``, ``value`` are ``nn.Conv1d(C, C,
    kernel_size=1, groups=g)`` on ``[N, C, W]`` (weight ``[C, C/g, 1]``: a block-diagonal ``[C, C]``
    matrix, ``in_groups=g``), read per head through ``view(N, H, d, W)``. A head is conditioned in
    the ``C/g`` input channels its group reads; a head whose rows span two groups is refused, and
    so is a V whose identity would need entries outside its groups (see :class:`Projection`)."""
    H, d = m.num_attention_heads, m.attention_head_size
    projs = []
    for name in ("query", "key", "value"):
        conv = getattr(m, name)
        if not (isinstance(conv, nn.Conv1d) and conv.kernel_size == (1,) and conv.stride == (1,)
                and conv.padding in ((0,), "valid") and conv.dilation == (1,)):
            raise UnsupportedAttention(f"SqueezeBERT {name} is not a Conv1d with kernel size 1, stride 1 and no "
                                       f"padding ({conv!r}): it is no per-position projection")
        out, cin, _ = conv.weight.shape
        projs.append(Projection(conv.weight, 0, out, bias=conv.bias, matrix_shape=(out, cin), in_groups=conv.groups))
    return AttentionSpec(*projs, H, H, d)


def _register():
    tf = "transformers.models"
    for path in ("gpt2.modeling_gpt2.GPT2Attention", "imagegpt.modeling_imagegpt.ImageGPTAttention",
                 "openai.modeling_openai.Attention",
                 "decision_transformer.modeling_decision_transformer.DecisionTransformerGPT2Attention"):
        register_adapter(f"{tf}.{path}", _hf_gpt2, name=f"hf.{path.rsplit('.', 1)[1]}")
    for path, attr in (("gpt_neox.modeling_gpt_neox.GPTNeoXAttention", "query_key_value"),
                       ("gpt_neox_japanese.modeling_gpt_neox_japanese.GPTNeoXJapaneseAttention", "query_key_value"),
                       ("bloom.modeling_bloom.BloomAttention", "query_key_value"),
                       ("persimmon.modeling_persimmon.PersimmonAttention", "query_key_value")):
        register_adapter(f"{tf}.{path}", _hf_per_head(attr), name=f"hf.{path.rsplit('.', 1)[1]}")
    for path, fn in (("falcon.modeling_falcon.FalconAttention", _hf_falcon),
                     ("gpt_bigcode.modeling_gpt_bigcode.GPTBigCodeAttention", _hf_gpt_bigcode),
                     ("phi3.modeling_phi3.Phi3Attention", _hf_phi3),
                     ("phi4_multimodal.modeling_phi4_multimodal.Phi4MultimodalAttention", _hf_phi3),
                     ("ergo.modeling_ergo.ErgoAttention", _hf_phi3),
                     ("minicpm5_moe.modeling_minicpm5_moe.MiniCPM5MoeAttention", _hf_minicpm5),
                     ("deberta.modeling_deberta.DisentangledSelfAttention", _hf_deberta),
                     ("codegen.modeling_codegen.CodeGenAttention", _hf_codegen),
                     ("xlnet.modeling_xlnet.XLNetRelativeAttention", _hf_xlnet),
                     ("jetmoe.modeling_jetmoe.JetMoeAttention", _hf_jetmoe),
                     ("squeezebert.modeling_squeezebert.SqueezeBertSelfAttention", _hf_squeezebert),
                     ("aimv2.modeling_aimv2.Aimv2AttentionPoolingHead", _hf_aimv2_pooling)):
        register_adapter(f"{tf}.{path}", fn, name=f"hf.{path.rsplit('.', 1)[1]}")


_register()
