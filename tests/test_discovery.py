"""Discovery by structure: the attention layers of every family people train, read back the way
each model's own code reads them, and nothing left out silently.

Every model is built from a tiny config (no download). Q/K/V are read back through oracles written
here from each model's ``forward`` (``view(..., H, 3, d)`` for GPT-NeoX, Falcon's groups, CodeGen's
four ``[Q; V; K]`` groups, ...), never through condinit's adapters, so a wrong layout fails. The
fused layouts are also checked through the model's own forward: the attention inputs it computes
from a probe of unit vectors are the columns of its effective per-head W_Q, W_K, W_V.
"""
from __future__ import annotations

import contextlib
import copy
import json
import warnings

import pytest
import torch
from torch import nn

from condinit.models import (AttentionSpec, Projection, UncoveredAttentionError, UncoveredAttentionWarning,
                             UnsupportedAttention, apply, discover, fused_layout, register_adapter,
                             unregister_adapter)
from helpers import assert_orthonormal_rows

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=99,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SEQ2SEQ = dict(vocab_size=99, pad_token_id=0, bos_token_id=1, eos_token_id=2, d_model=32, encoder_layers=1,
               decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
               decoder_ffn_dim=32, max_position_embeddings=64)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
              patch_size=8)


def _tiny(model_type, base=BASE, **kw):
    """A tiny randomly initialized transformers model; the model class chosen as ``condinit init`` does."""
    from condinit.models.presets import model_class_for

    cfg = transformers.AutoConfig.for_model(model_type, **{**base, **kw})
    cls = getattr(transformers, model_class_for(model_type, cfg))
    return cls.from_config(cfg)


# ------------------------------------------------------------------------------------------------
# oracles: per attention module, views of its per-head Q, K, V blocks ([d, in] each, in head order)
# and of its Q/K/V bias entries, read as the model's forward reads them

def _heads(t, n):
    return list(t.unflatten(0, (n, -1)).unbind(0))


def _separate(qn, kn, vn, H, Hkv):
    def read(m):
        q, k, v = (getattr(m, n) for n in (qn, kn, vn))
        return {"q": _heads(q.weight, H), "k": _heads(k.weight, Hkv), "v": _heads(v.weight, Hkv),
                "bias": [b for b in (q.bias, k.bias, v.bias) if b is not None]}
    return read


def _per_head(attr, H):
    """``fused.view(..., H, 3, d)``: GPT-NeoX (``view(-1, 3 * head_size).chunk(3)``), BLOOM, Persimmon,
    Falcon-RW, GPTBigCode multi-head (``view(H, 3 * head_dim).split(head_dim)``)."""
    def read(m):
        lin = getattr(m, attr)
        w = lin.weight.unflatten(0, (H, 3, -1))
        out = {p: list(w[:, i].unbind(0)) for i, p in enumerate("qkv")}
        out["bias"] = [] if lin.bias is None else [lin.bias]
        return out
    return read


def _contiguous(attr, H, Hkv, transposed=False):
    """``[Q; K; V]`` along the output: ``split((H d, Hkv d, Hkv d))`` (Phi-3, MPT ``chunk(3)``,
    GPT-2's Conv1D ``[in, 3E]``, GPTBigCode and Falcon multi-query)."""
    def read(m):
        lin = getattr(m, attr)
        w = lin.weight.t() if transposed else lin.weight
        d = w.shape[0] // (H + 2 * Hkv)
        q, k, v = w.split((H * d, Hkv * d, Hkv * d))
        return {"q": _heads(q, H), "k": _heads(k, Hkv), "v": _heads(v, Hkv),
                "bias": [] if lin.bias is None else [lin.bias]}
    return read


def _falcon_new(H, Hkv):
    """Falcon's new decoder architecture: ``view(..., -1, H // Hkv + 2, d)``, queries then key, value."""
    def read(m):
        g = H // Hkv
        w = m.query_key_value.weight.unflatten(0, (Hkv, g + 2, -1))
        return {"q": [w[i, j] for i in range(Hkv) for j in range(g)], "k": list(w[:, g].unbind(0)),
                "v": list(w[:, g + 1].unbind(0)), "bias": []}
    return read


def _codegen(H):
    """CodeGen: ``view(..., mp_num=4, 3 * local_dim).split(local_dim)`` assigned to query, value, key."""
    def read(m):
        w = m.qkv_proj.weight.unflatten(0, (4, 3, H // 4, -1))
        return {p: [w[g, i, j] for g in range(4) for j in range(H // 4)] for i, p in ((0, "q"), (2, "k"), (1, "v"))} \
            | {"bias": []}
    return read


def _deberta(H):
    """DeBERTa ``in_proj``: ``transpose_for_scores(qp).chunk(3, dim=-1)`` (the model's own
    ``in_proj.weight.chunk(H * 3)`` path reads head ``i``'s Q as chunk ``3 i``); biases ``q_bias`` /
    ``v_bias``."""
    def read(m):
        ws = m.in_proj.weight.chunk(H * 3, dim=0)
        return {"q": list(ws[0::3]), "k": list(ws[1::3]), "v": list(ws[2::3]), "bias": [m.q_bias, m.v_bias]}
    return read


def _modernbert(H):
    """ModernBERT ``Wqkv``: ``view(..., 3, -1, head_dim).unbind(dim=-3)``."""
    def read(m):
        w = m.Wqkv.weight.unflatten(0, (3, H, -1))
        return {p: list(w[i].unbind(0)) for i, p in enumerate("qkv")} | {"bias": []}
    return read


def _gated_query(H, Hkv):
    """Qwen3-Next: ``chunk(q_proj(x).view(..., -1, 2 * head_dim), 2, dim=-1)``: query, then gate."""
    def read(m):
        q = m.q_proj.weight.unflatten(0, (H, 2, -1))
        return {"q": list(q[:, 0].unbind(0)), "k": _heads(m.k_proj.weight, Hkv), "v": _heads(m.v_proj.weight, Hkv),
                "bias": []}
    return read


def _xlnet(H):
    """XLNet: ``einsum("ibh,hnd->ibnd", x, W)`` with ``W`` ``[D, H, d]``: head ``h``'s ``W_Q`` is
    ``W[:, h, :]^T``; no biases (``r_w_bias`` and its kin belong to the relative terms)."""
    def read(m):
        return {p: [getattr(m, p)[:, h, :].T for h in range(H)] for p in "qkv"} | {"bias": []}
    return read


def _jetmoe(E, Hkv):
    """JetMoE: expert ``e`` of ``experts.input_linear`` (``F.linear(x, weight[e])``, ``[E, Hkv d, D]``)
    projects ``Hkv`` query heads; ``kv_proj(x).chunk(2)`` gives K and V."""
    def read(m):
        w = m.experts.input_linear.weight
        k, v = m.kv_proj.weight.chunk(2)
        return {"q": [h for e in range(E) for h in _heads(w[e], Hkv)], "k": _heads(k, Hkv), "v": _heads(v, Hkv),
                "bias": []}
    return read


def _aimv2(H):
    """AIMv2: encoder layers ``q_proj/k_proj/v_proj``; the pooling head's query is its learned
    ``cls_token`` (no projection: it must stay as it is), keys and values ``k_proj`` / ``v_proj``."""
    def read(m):
        if type(m).__name__ == "Aimv2AttentionPoolingHead":
            return {"q": [], "k": _heads(m.k_proj.weight, H), "v": _heads(m.v_proj.weight, H),
                    "bias": [b for b in (m.k_proj.bias, m.v_proj.bias) if b is not None]}
        return _separate(*QKV_PROJ, H, H)(m)
    return read


QKV_PROJ = ("q_proj", "k_proj", "v_proj")
# name: (build, attention class names, oracle, number of attention modules)
ARCHS = {
    "llama": (lambda: _tiny("llama", num_key_value_heads=2), {"LlamaAttention"}, _separate(*QKV_PROJ, 4, 2)),
    "mixtral": (lambda: _tiny("mixtral", num_key_value_heads=2, num_local_experts=2), {"MixtralAttention"},
                _separate(*QKV_PROJ, 4, 2)),
    "qwen3": (lambda: _tiny("qwen3", num_key_value_heads=2, head_dim=8), {"Qwen3Attention"},
              _separate(*QKV_PROJ, 4, 2)),
    "qwen2_moe": (lambda: _tiny("qwen2_moe", num_key_value_heads=2, num_experts=2, moe_intermediate_size=16,
                                shared_expert_intermediate_size=16), {"Qwen2MoeAttention"}, _separate(*QKV_PROJ, 4, 2)),
    "qwen3_moe": (lambda: _tiny("qwen3_moe", num_key_value_heads=2, head_dim=8, num_experts=2, moe_intermediate_size=16),
                  {"Qwen3MoeAttention"}, _separate(*QKV_PROJ, 4, 2)),
    "gemma": (lambda: _tiny("gemma", num_key_value_heads=1, head_dim=8), {"GemmaAttention"}, _separate(*QKV_PROJ, 4, 1)),
    "gemma2": (lambda: _tiny("gemma2", num_key_value_heads=2, head_dim=16), {"Gemma2Attention"},
               _separate(*QKV_PROJ, 4, 2)),
    "gemma3": (lambda: _tiny("gemma3_text", num_key_value_heads=2, head_dim=8), {"Gemma3Attention"},
               _separate(*QKV_PROJ, 4, 2)),
    "phi": (lambda: _tiny("phi", num_key_value_heads=2), {"PhiAttention"}, _separate(*QKV_PROJ, 4, 2)),
    "phi3": (lambda: _tiny("phi3", num_key_value_heads=2), {"Phi3Attention"}, _contiguous("qkv_proj", 4, 2)),
    "gptj": (lambda: _tiny("gptj", rotary_dim=4), {"GPTJAttention"}, _separate(*QKV_PROJ, 4, 4)),
    "gpt_neox": (lambda: _tiny("gpt_neox"), {"GPTNeoXAttention"}, _per_head("query_key_value", 4)),
    "bloom": (lambda: _tiny("bloom"), {"BloomAttention"}, _per_head("query_key_value", 4)),
    "persimmon": (lambda: _tiny("persimmon"), {"PersimmonAttention"}, _per_head("query_key_value", 4)),
    "falcon_rw": (lambda: _tiny("falcon", new_decoder_architecture=False, multi_query=False, alibi=True),
                  {"FalconAttention"}, _per_head("query_key_value", 4)),
    "falcon_mq": (lambda: _tiny("falcon", new_decoder_architecture=False, multi_query=True), {"FalconAttention"},
                  _contiguous("query_key_value", 4, 1)),
    "falcon_new": (lambda: _tiny("falcon", new_decoder_architecture=True, num_kv_heads=2), {"FalconAttention"},
                   _falcon_new(4, 2)),
    "gpt_bigcode_mq": (lambda: _tiny("gpt_bigcode", multi_query=True), {"GPTBigCodeAttention"},
                       _contiguous("c_attn", 4, 1)),
    "gpt_bigcode_mha": (lambda: _tiny("gpt_bigcode", multi_query=False), {"GPTBigCodeAttention"},
                        _per_head("c_attn", 4)),
    "gpt2": (lambda: _tiny("gpt2"), {"GPT2Attention"}, _contiguous("c_attn", 4, 4, transposed=True)),
    "codegen": (lambda: _tiny("codegen", num_attention_heads=8, rotary_dim=2), {"CodeGenAttention"}, _codegen(8)),
    "mpt": (lambda: _tiny("mpt"), {"MptAttention"}, _contiguous("Wqkv", 4, 4)),
    "opt": (lambda: _tiny("opt", ffn_dim=64, word_embed_proj_dim=32), {"OPTAttention"}, _separate(*QKV_PROJ, 4, 4)),
    "cohere": (lambda: _tiny("cohere", num_key_value_heads=2), {"CohereAttention"}, _separate(*QKV_PROJ, 4, 2)),
    "olmo2": (lambda: _tiny("olmo2", num_key_value_heads=2), {"Olmo2Attention"}, _separate(*QKV_PROJ, 4, 2)),
    "stablelm": (lambda: _tiny("stablelm", num_key_value_heads=2), {"StableLmAttention"}, _separate(*QKV_PROJ, 4, 2)),
    "starcoder2": (lambda: _tiny("starcoder2", num_key_value_heads=2), {"Starcoder2Attention"},
                   _separate(*QKV_PROJ, 4, 2)),
    "qwen3_next": (lambda: _tiny("qwen3_next", num_key_value_heads=2, head_dim=8, num_experts=2,
                                 moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                 layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                                 linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8),
                   {"Qwen3NextAttention"}, _gated_query(4, 2)),
    "bert": (lambda: _tiny("bert"), {"BertSelfAttention"}, _separate("query", "key", "value", 4, 4)),
    "distilbert": (lambda: _tiny("distilbert"), {"DistilBertSelfAttention"}, _separate("q_lin", "k_lin", "v_lin", 4, 4)),
    "albert": (lambda: _tiny("albert", embedding_size=16), {"AlbertAttention"}, _separate("query", "key", "value", 4, 4)),
    "electra": (lambda: _tiny("electra", embedding_size=16), {"ElectraSelfAttention"},
                _separate("query", "key", "value", 4, 4)),
    "deberta": (lambda: _tiny("deberta"), {"DisentangledSelfAttention"}, _deberta(4)),
    "deberta_v2": (lambda: _tiny("deberta-v2"), {"DisentangledSelfAttention"},
                   _separate("query_proj", "key_proj", "value_proj", 4, 4)),
    "modernbert": (lambda: _tiny("modernbert", global_attn_every_n_layers=1, sep_token_id=3, cls_token_id=4),
                   {"ModernBertAttention"}, _modernbert(4)),
    "t5": (lambda: _tiny("t5", base={}, vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
           {"T5Attention"}, _separate("q", "k", "v", 4, 4)),
    "bart": (lambda: _tiny("bart", base=SEQ2SEQ), {"BartAttention"}, _separate(*QKV_PROJ, 4, 4)),
    "mbart": (lambda: _tiny("mbart", base=SEQ2SEQ), {"MBartAttention"}, _separate(*QKV_PROJ, 4, 4)),
    "whisper": (lambda: _tiny("whisper", base=SEQ2SEQ, num_mel_bins=16, max_source_positions=16,
                              max_target_positions=16, decoder_start_token_id=1), {"WhisperAttention"},
                _separate(*QKV_PROJ, 4, 4)),
    "vit": (lambda: _tiny("vit", base=VISION), {"ViTAttention"}, _separate(*QKV_PROJ, 4, 4)),
    "deit": (lambda: _tiny("deit", base=VISION), {"DeiTAttention"}, _separate(*QKV_PROJ, 4, 4)),
    "beit": (lambda: _tiny("beit", base=VISION), {"BeitAttention"}, _separate(*QKV_PROJ, 4, 4)),
    "clip_vision": (lambda: _tiny("clip_vision_model", base=VISION), {"CLIPAttention"}, _separate(*QKV_PROJ, 4, 4)),
    "swin": (lambda: _tiny("swin", base={}, image_size=16, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                           window_size=2), {"SwinSelfAttention", "SwinAttention"}, _separate(*QKV_PROJ, 2, 2)),
    "xlnet": (lambda: _tiny("xlnet", base={}, vocab_size=99, d_model=32, n_head=4, d_inner=64, n_layer=2),
              {"XLNetRelativeAttention"}, _xlnet(4)),
    "jetmoe": (lambda: _tiny("jetmoe", num_key_value_heads=2, kv_channels=8, num_local_experts=4,
                             num_experts_per_tok=2), {"JetMoeAttention"}, _jetmoe(4, 2)),
    "aimv2": (lambda: _tiny("aimv2_vision_model", base=VISION, use_head=True),
              {"Aimv2Attention", "Aimv2AttentionPoolingHead"}, _aimv2(4)),
}


def _attention_modules(model, classes):
    return [m for m in model.modules() if type(m).__name__ in classes and
            any(n in dict(m.named_children()) or hasattr(m, n) for n in ("q_proj", "query", "q", "q_lin", "query_proj",
                                                                        "query_key_value", "c_attn", "qkv_proj", "Wqkv",
                                                                        "in_proj", "kv_proj", "k_proj"))]


def _assert_conditioned(read, what):
    for i, w in enumerate(read["q"]):
        assert_orthonormal_rows(w, f"{what} Q head {i}")
    for i, w in enumerate(read["k"]):
        assert_orthonormal_rows(w, f"{what} K head {i}")
    v = torch.cat([w.detach().float() for w in read["v"]])
    assert torch.equal(v, torch.eye(*v.shape)), f"{what}: V is not the rectangular identity in the model's head order"
    for b in read["bias"]:
        assert torch.count_nonzero(b).item() == 0, f"{what}: a Q/K/V bias is not zero"


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHS))
def test_architecture_conditioned_as_its_forward_reads_it(arch):
    build, classes, oracle = ARCHS[arch]
    torch.manual_seed(0)
    model = build()
    mods = _attention_modules(model, classes)
    assert mods, f"no {classes} module in the built model"
    # the oracle's views of the unconditioned copy are set to NaN: what is left must not change
    untouched = copy.deepcopy(model)
    for m in _attention_modules(untouched, classes):
        with torch.no_grad():
            read = oracle(m)
            for t in read["q"] + read["k"] + read["v"] + read["bias"]:
                t.fill_(float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncoveredAttentionWarning)
        rep = apply(model, seed=11, strict=True)
    assert len(rep) == len(mods) and rep.uncovered == []
    for i, m in enumerate(mods):
        _assert_conditioned(oracle(m), f"{arch} layer {i}")
    for (n, p), p0 in zip(model.named_parameters(), untouched.parameters()):
        keep = ~torch.isnan(p0)
        assert torch.equal(p.detach()[keep], p0.detach()[keep]), f"{arch}: {n} changed outside Q/K/V"
    for (n, b), b0 in zip(model.named_buffers(), untouched.buffers()):
        assert torch.equal(b, b0), f"{arch}: buffer {n} changed"
    for l in rep:
        for p in "qk":
            if l.after[p] is None:     # a learned query, left as it is: nothing was written
                assert p == "q" and l.adapter == "hf.Aimv2AttentionPoolingHead", l.adapter
                continue
            assert abs(l.after[p].cond - 1) < 1e-4 and abs(l.after[p].sigma_min - 1) < 1e-4


def test_cross_attention_reads_decoder_and_encoder_widths():
    """Encoder-decoder: Q of a cross-attention layer reads the decoder states and K, V the encoder's
    (same rule per projection); the report marks the layer as cross-attention."""
    torch.manual_seed(0)
    model = ARCHS["t5"][0]()
    rep = apply(model, seed=5)
    cross = [l for l in rep if l.cross]
    assert [l.name for l in cross] == [f"decoder.block.{i}.layer.1.EncDecAttention" for i in range(2)]
    assert all("EncDecAttention" not in l.name for l in rep if not l.cross)
    # nn.MultiheadAttention with kdim/vdim: K and V are [H d, D_enc], their own input width
    mha = nn.ModuleDict({"multihead_attn": nn.MultiheadAttention(24, 4, kdim=40, vdim=16, batch_first=True)})
    rep = apply(mha, seed=5)
    assert rep[0].cross and rep[0].shapes == {"q": (24, 24), "k": (24, 40), "v": (24, 16)}
    a = mha["multihead_attn"]
    for w, name in ((a.q_proj_weight, "q"), (a.k_proj_weight, "k")):
        for h in range(4):
            assert_orthonormal_rows(w[h * 6:(h + 1) * 6], f"{name} head {h}")
    assert torch.equal(a.v_proj_weight.detach(), torch.eye(24, 16))
    assert "(cross)" in str(rep)


# ------------------------------------------------------------------------------------------------
# the model's own forward: attention inputs computed from unit-vector probes

@contextlib.contextmanager
def _probed_attention(model, names):
    """Feed every attention module ``names`` a probe (batch ``i``, position 0 = unit vector ``e_i``,
    batch ``D`` = 0) and record the (q, k, v) its forward hands to scaled_dot_product_attention."""
    import torch.nn.functional as F

    records, current, hooks = {}, [None], []
    mods = dict(model.named_modules())
    orig = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        if current[0] is not None:
            records[current[0]] = (q.detach().clone(), k.detach().clone(), v.detach().clone())
        return orig(q, k, v, *args, **kwargs)

    for n in names:
        def pre(mod, args, kwargs, n=n):
            current[0] = n
            positional = bool(args) and isinstance(args[0], torch.Tensor)
            x = args[0] if positional else kwargs["hidden_states"]
            D = x.shape[-1]
            probe = torch.randn_like(x)
            probe[:, 0] = 0
            probe[:D, 0, :] = torch.eye(D, dtype=x.dtype)
            return ((probe,) + tuple(args[1:]), kwargs) if positional else (args, dict(kwargs, hidden_states=probe))

        hooks.append(mods[n].register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(mods[n].register_forward_hook(lambda *_: current.__setitem__(0, None)))
    F.scaled_dot_product_attention = spy
    try:
        yield records
    finally:
        F.scaled_dot_product_attention = orig
        for h in hooks:
            h.remove()


def _effective(t, D):
    """Per-head ``[H, d, D]`` effective weights and ``[H, d]`` biases from a probe's attention input
    ``t`` ``[B, H, N, d]`` (position 0 is unrotated)."""
    cols = t[:D, :, 0, :] - t[D:D + 1, :, 0, :]
    return cols.permute(1, 2, 0), t[D, :, 0, :]


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "falcon_rw", "falcon_mq", "falcon_new", "gpt_bigcode_mq",
                                  "gpt_bigcode_mha", "codegen", "phi3", "gpt2"])
def test_fused_layouts_through_the_models_own_forward(arch):
    torch.manual_seed(0)
    model = ARCHS[arch][0]()
    model.config._attn_implementation = "sdpa"
    rep = apply(model, seed=3)
    D = rep[0].shapes["q"][1]
    with _probed_attention(model, [l.name for l in rep]) as records, torch.no_grad():
        model.eval()
        model(input_ids=torch.randint(3, 90, (D + 1, 2)))
    assert set(records) == {l.name for l in rep}
    for l in rep:
        q, k, v = (_effective(t, D) for t in records[l.name])
        for name, (w, b) in (("q", q), ("k", k)):
            for h in range(w.shape[0]):
                assert_orthonormal_rows(w[h], f"{arch} {l.name} effective {name} head {h}")
            assert b.abs().max() == 0
        wv, bv = v
        # the forward may repeat K/V heads for GQA: attention head h reads KV head h // (H / H_kv)
        rep_kv = wv.shape[0] // l.num_kv_heads
        d = l.head_dim
        for h in range(wv.shape[0]):
            g = h // rep_kv
            assert torch.equal(wv[h], torch.eye(l.num_kv_heads * d, D)[g * d:(g + 1) * d]), f"{arch} V head {h}"
        assert bv.abs().max() == 0


# ------------------------------------------------------------------------------------------------
# grouped convolutions (SqueezeBERT) and parameters read as matrices

def _conv_matrix(conv):
    """The ``[out, in]`` matrix a kernel-size-1 ``Conv1d`` applies, read through the conv itself:
    column ``j`` is its output at position ``j`` of an identity input, minus the bias."""
    c = conv.in_channels
    with torch.no_grad():
        out = conv(torch.eye(c)[None])[0]
    return out - (conv.bias[:, None] if conv.bias is not None else 0)


def test_squeezebert_grouped_convolutions_are_conditioned_per_head_and_block():
    torch.manual_seed(0)
    model = _tiny("squeezebert", num_attention_heads=8, embedding_size=32)    # 4 groups of 8 channels, heads of 4
    before = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncoveredAttentionWarning)
        rep = apply(model, seed=5, strict=True)
    mods = [m for m in model.modules() if type(m).__name__ == "SqueezeBertSelfAttention"]
    assert len(rep) == len(mods) == 2 and {l.shapes["q"] for l in rep} == {(32, 32)}
    for m in mods:
        for name in ("query", "key"):
            w = _conv_matrix(getattr(m, name))
            for h in range(8):
                # a head reads the 8 input channels of its group only, and is semi-orthogonal there
                assert_orthonormal_rows(w[h * 4:(h + 1) * 4], f"{name} head {h}")
        assert torch.equal(_conv_matrix(m.value), torch.eye(32))     # the identity, block by block
        assert all(torch.count_nonzero(getattr(m, n).bias) == 0 for n in ("query", "key", "value"))
    qkv = {id(getattr(m, n).weight) for m in mods for n in ("query", "key", "value")} | \
          {id(getattr(m, n).bias) for m in mods for n in ("query", "key", "value")}
    for (n, p), p0 in zip(model.named_parameters(), before.parameters()):
        if id(p) not in qkv:
            assert torch.equal(p, p0), n
    # the reduced [32, 8] matrix's own rectangular identity would be only the first group's block
    bad = copy.deepcopy(model)
    with torch.no_grad():
        for m in bad.modules():
            if type(m).__name__ == "SqueezeBertSelfAttention":
                m.value.weight[:, :, 0] = torch.eye(32, 8)
    assert not torch.equal(_conv_matrix(bad.encoder.layers[0].attention.value), torch.eye(32))


def test_squeezebert_heads_across_groups_and_per_head_identity_are_refused():
    torch.manual_seed(0)
    model = _tiny("squeezebert", num_attention_heads=2, embedding_size=32)    # heads of 16 over groups of 8
    found = discover(model)
    assert not found.layers and len(found.uncovered) == 2
    assert all("span several groups" in u.reason for u in found.uncovered), found.uncovered
    with pytest.raises(UncoveredAttentionError):
        apply(model, seed=0)
    model = _tiny("squeezebert", num_attention_heads=8, embedding_size=32)
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="identity_per_head.*outside the input channels"):
        apply(model, seed=0, v_mode="identity_per_head")
    assert all(torch.equal(t, state[k]) for k, t in model.state_dict().items())


def test_streamed_writer_refuses_an_unwritable_v_before_the_first_file(tmp_path):
    """The same refusal from write_pretrained, before any shard is written."""
    from condinit.models.stream import write_pretrained
    cfg = transformers.AutoConfig.for_model("squeezebert", **{**BASE, "num_attention_heads": 8, "embedding_size": 32})
    out = tmp_path / "ckpt"
    with pytest.raises(ValueError, match="identity_per_head.*outside the input channels"):
        write_pretrained(cfg, out, seed=0, v_mode="identity_per_head", max_shard_size="20KB")
    assert not out.exists() or not any(out.iterdir())


def test_projection_reshape_and_groups_are_validated():
    w3 = nn.Parameter(torch.randn(8, 2, 4))
    with pytest.raises(TypeError, match="matrix_shape"):
        Projection(w3, 0, 8)
    with pytest.raises(ValueError, match="does not hold"):
        Projection(w3, 0, 8, matrix_shape=(8, 7))
    with pytest.raises(ValueError, match="cannot be viewed"):
        Projection(w3.detach().transpose(0, 2), 0, 4, matrix_shape=(4, 16))
    p = Projection(w3, 0, 8, transposed=True, matrix_shape=(8, 8))
    assert p.shape == (8, 8) and torch.equal(p.view(), w3.detach().reshape(8, 8).T)
    conv = nn.Conv1d(12, 12, 1, groups=3)
    with pytest.raises(ValueError, match="transposed"):
        Projection(conv.weight, 0, 12, transposed=True, matrix_shape=(12, 4), in_groups=3)
    with pytest.raises(ValueError, match="equal blocks"):
        Projection(conv.weight, 0, 12, matrix_shape=(12, 4), in_groups=5)
    g = Projection(conv.weight, 0, 12, matrix_shape=(12, 4), in_groups=3)
    assert g.shape == (12, 12) and torch.equal(g.view(), _conv_matrix(conv).detach())
    with pytest.raises(ValueError, match="no bias"):
        Projection(w3, 0, 8, matrix_shape=(8, 8), fixed=True, bias=torch.zeros(8))
    lin = nn.Linear(8, 8)
    with pytest.raises(ValueError, match="only q"):
        AttentionSpec(Projection(lin.weight, 0, 8), Projection(w3, 0, 8, matrix_shape=(8, 8), fixed=True),
                      Projection(lin.weight, 0, 8), num_heads=2, num_kv_heads=2, head_dim=4)


def test_reshaped_weights_round_trip_through_checkpoint_metadata(tmp_path):
    pytest.importorskip("safetensors")
    from condinit.commands.inspect import analyze
    from condinit.models.checkpoint import METADATA_KEY, condinit_metadata, save_model_atomic

    torch.manual_seed(0)
    model = _tiny("xlnet", base={}, vocab_size=99, d_model=32, n_head=4, d_inner=64, n_layer=1)
    rep = apply(model, seed=1)
    path = tmp_path / "xlnet.safetensors"
    save_model_atomic(model, str(path), {METADATA_KEY: condinit_metadata(model, discover(model).layers, rep, "xlnet")})
    meta, rows = analyze(str(path))
    assert meta["layers"][0]["q"]["matrix_shape"] == [32, 32] and meta["layers"][0]["q"]["transposed"] is True
    [row] = rows
    for p in "qkv":
        assert max(abs(c - 1) for c in row[p]["cond_per_head"]) < 1e-4, p
    # the per-head blocks read from the file are the model's own heads: give head h of Q kappa h + 2
    with torch.no_grad():
        q = model.transformer.layer[0].rel_attn.q
        for h in range(4):
            q[:, h, :] = q[:, h, :] * torch.linspace(1.0, h + 2.0, 8)[None, :]
    save_model_atomic(model, str(path), {METADATA_KEY: condinit_metadata(model, discover(model).layers, rep, "xlnet")})
    _, [row] = analyze(str(path))
    assert row["q"]["cond_per_head"] == pytest.approx([2.0, 3.0, 4.0, 5.0], rel=1e-5)


# ------------------------------------------------------------------------------------------------
# composite models and pooling heads: every attention layer

def test_siglip_encoders_and_pooling_head():
    torch.manual_seed(0)
    text = dict(BASE, max_position_embeddings=16)
    model = _tiny("siglip", base={}, text_config=text, vision_config=VISION)
    rep = apply(model, seed=2, strict=True)
    names = [l.name for l in rep]
    assert sum(n.startswith("text_model.encoder.layers.") for n in names) == 2
    assert sum(n.startswith("vision_model.encoder.layers.") for n in names) == 2
    assert "vision_model.head.attention" in names      # the attention pool's nn.MultiheadAttention
    head = model.vision_model.head.attention
    w = head.in_proj_weight.detach()
    for h in range(4):
        for part in range(2):
            assert_orthonormal_rows(w[part * 32 + h * 8:part * 32 + (h + 1) * 8], f"head Q/K {part} {h}")
    assert torch.equal(w[64:], torch.eye(32)) and torch.count_nonzero(head.in_proj_bias) == 0


def test_llava_style_composite_gets_vision_tower_and_language_model():
    torch.manual_seed(0)
    vision = dict(VISION, model_type="clip_vision_model", projection_dim=32)
    text = dict(BASE, model_type="llama", num_key_value_heads=2, max_position_embeddings=16)
    model = _tiny("llava", base={}, vision_config=vision, text_config=text, image_token_index=98)
    rep = apply(model, seed=2, strict=True)
    names = [l.name for l in rep]
    assert sum(".vision_tower." in f".{n}" for n in names) == 2 and sum("language_model." in n for n in names) == 2
    assert {l.num_kv_heads for l in rep if "language_model" in l.name} == {2}
    for l in model.language_model.layers:
        _assert_conditioned(_separate(*QKV_PROJ, 4, 2)(l.self_attn), "llava language model")
    tower = [m for m in model.vision_tower.modules() if type(m).__name__ == "CLIPAttention"]
    assert len(tower) == 2
    for m in tower:
        _assert_conditioned(_separate(*QKV_PROJ, 4, 4)(m), "llava vision tower")


def test_timm_vit_map_pool_and_swin_eva_beit():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8, embed_dim=32, depth=2,
                            num_heads=4, global_pool="map", num_classes=3)
    latent = vit.attn_pool.latent.detach().clone()
    rep = apply(vit, seed=4, strict=True)
    assert [l.name for l in rep] == ["blocks.0.attn", "blocks.1.attn", "attn_pool"]
    pool = vit.attn_pool
    for h in range(4):
        assert_orthonormal_rows(pool.q.weight[h * 8:(h + 1) * 8], f"attn_pool Q head {h}")
        assert_orthonormal_rows(pool.kv.weight[h * 8:(h + 1) * 8], f"attn_pool K head {h}")   # kv = [K; V]
    assert torch.equal(pool.kv.weight[32:].detach(), torch.eye(32)) and torch.equal(pool.latent, latent)
    for name, kw in (("swin_tiny_patch4_window7_224", dict(img_size=32, patch_size=4, embed_dim=16, depths=(1, 1),
                                                            num_heads=(2, 4), window_size=4)),
                     ("swinv2_tiny_window8_256", dict(img_size=32, patch_size=4, embed_dim=16, depths=(1, 1),
                                                      num_heads=(2, 4), window_size=4)),
                     ("eva02_tiny_patch14_224", dict(img_size=28, patch_size=14, embed_dim=32, depth=2, num_heads=4)),
                     ("beit_base_patch16_224", dict(img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=4))):
        model = timm.create_model(name, pretrained=False, num_classes=3, **kw)
        rep = apply(model, seed=4, strict=True)
        attns = [m for m in model.modules() if hasattr(m, "qkv") and isinstance(m.qkv, nn.Linear)]
        assert len(rep) == len(attns) >= 2, name
        for m in attns:   # timm: qkv(x).reshape(B, N, 3, num_heads, head_dim)
            w = m.qkv.weight.unflatten(0, (3, m.num_heads, -1))
            _assert_conditioned({"q": list(w[0]), "k": list(w[1]), "v": list(w[2]),
                                 "bias": [b for b in (m.qkv.bias, getattr(m, "q_bias", None),
                                                      getattr(m, "v_bias", None)) if isinstance(b, torch.Tensor)]},
                                name)


# ------------------------------------------------------------------------------------------------
# refusals and uncovered modules: listed, warned, an error under strict

class NoHeadsAttention(nn.Module):
    """q_proj / k_proj / v_proj and nothing that says how many heads."""

    def __init__(self, dim=16):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim) for _ in range(3))


class GlobalLocalAttention(nn.Module):
    """Longformer-like: a second set of projections for global attention."""

    def __init__(self, dim=16):
        super().__init__()
        self.num_heads = 2
        for n in ("query", "key", "value", "query_global", "key_global", "value_global"):
            setattr(self, n, nn.Linear(dim, dim))


def test_custom_module_without_adapter_is_warned_listed_and_refused_by_strict():
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), NoHeadsAttention())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(UncoveredAttentionError, match=r"1 \(NoHeadsAttention\): cannot find the number of heads"):
        apply(model, seed=1, strict=True)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())   # nothing written
    with pytest.warns(UncoveredAttentionWarning, match="NoHeadsAttention"):
        rep = apply(model, seed=1)
    assert [l.name for l in rep] == ["0.self_attn"]
    assert [(u.name, u.cls) for u in rep.uncovered] == [("1", "NoHeadsAttention")]
    assert "NoHeadsAttention" in str(rep) and "not conditioned" in str(rep)
    assert json.loads(json.dumps(rep.to_dict()))["uncovered"][0]["class"] == "NoHeadsAttention"
    assert torch.equal(model[1].q_proj.weight, before["1.q_proj.weight"])
    # exclude acknowledges it; an adapter covers it
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncoveredAttentionWarning)
        assert apply(model, seed=1, exclude="1").uncovered == []
    register_adapter(NoHeadsAttention, lambda m: AttentionSpec.from_linears(m.q_proj, m.k_proj, m.v_proj, num_heads=4))
    try:
        rep = apply(model, seed=1, strict=True)
        assert [l.adapter for l in rep] == ["torch.MultiheadAttention", "NoHeadsAttention"] and rep[1].num_heads == 4
    finally:
        unregister_adapter(NoHeadsAttention)


def test_refusals_read_one_line_per_distinct_reason():
    torch.manual_seed(0)
    n_bad = int(torch.randint(5, 30, ()))
    model = nn.ModuleDict({"ok": nn.TransformerEncoderLayer(16, 2, 32, batch_first=True),
                           "bad": nn.ModuleList(NoHeadsAttention() for _ in range(n_bad)),
                           "mix": GlobalLocalAttention()})
    found = discover(model)
    assert len(found.uncovered) == n_bad + 1
    no_heads = found.uncovered[0].reason
    with pytest.raises(UncoveredAttentionError) as err:
        apply(model, seed=1, strict=True)
    lines = str(err.value).split("\n")
    assert len(lines) == 3 and lines[0].startswith(f"strict: {n_bad + 1} attention-like module(s)")
    assert lines[1] == f"  {n_bad} x NoHeadsAttention (bad.0, bad.1, bad.2, ...): {no_heads}"
    assert lines[2].startswith("  mix (GlobalLocalAttention): also holds query_global")
    with pytest.warns(UncoveredAttentionWarning) as seen:
        rep = apply(model, seed=1)
    (msg,) = [str(w.message) for w in seen if issubclass(w.category, UncoveredAttentionWarning)]
    assert msg.count(no_heads) == 1 and len(msg.split("\n")) == 3
    table = rep.uncovered_table()
    assert table.row_count == 2 and [c._cells for c in table.columns][0] == [str(n_bad), "1"]
    # one reason: the listing stays on one line
    one = discover(model["bad"])
    with pytest.raises(UncoveredAttentionError) as err:
        apply(model["bad"], seed=1)
    assert "\n" not in str(err.value) and str(err.value).endswith(f"{n_bad} x NoHeadsAttention (0, 1, 2, ...): {no_heads}")
    assert len(one.uncovered) == n_bad


def test_second_projection_set_and_attention_named_modules_are_listed():
    class SpatialAttention(nn.Module):     # CBAM-style spatial gating: named attention, no Q/K/V
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 1, 7)

    class MysteryAttention(nn.Module):     # named attention, projections under no known name
        def __init__(self):
            super().__init__()
            self.mix = nn.Linear(8, 24)

    class TokenMixer(nn.Module):           # not named attention, but holds a fused qkv condinit cannot read
        def __init__(self):
            super().__init__()
            self.wqkv_conv = nn.Conv1d(8, 24, 1)

    model = nn.ModuleDict({"mix": GlobalLocalAttention(), "gate": SpatialAttention(), "odd": MysteryAttention(),
                           "conv": TokenMixer()})
    found = discover(model)
    assert [l.name for l in found.layers] == ["mix"]
    reasons = {u.name: u.reason for u in found.uncovered}
    assert set(reasons) == {"mix", "odd", "conv"}
    assert "query_global/key_global/value_global" in reasons["mix"]
    assert "class name says attention" in reasons["odd"] and "mix: Linear" in reasons["odd"]
    assert "wqkv_conv (Conv1d) are not linear projections" in reasons["conv"]
    with pytest.raises(UncoveredAttentionError):
        apply(model, strict=True)


def test_mla_is_refused_with_a_reason_naming_the_layer():
    torch.manual_seed(0)
    model = _tiny("deepseek_v3", num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                  qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=2, moe_intermediate_size=16)
    found = discover(model)
    assert found.layers == [] and [u.name for u in found.uncovered] == [f"model.layers.{i}.self_attn" for i in range(2)]
    assert all("multi-head latent attention" in u.reason and "does not guess" in u.reason for u in found.uncovered)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UncoveredAttentionError, match=r"2 x DeepseekV3Attention \(model\.layers\.0\.self_attn, "
                                                      r"model\.layers\.1\.self_attn\): multi-head latent attention") as err:
        apply(model, seed=0)
    assert str(err.value).count("multi-head latent attention") == 1     # the reason once, not once per layer
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


class FusedAttention(nn.Module):
    """A fused qkv whose forward reads it per head (rows [H, 3, d]), or as [Q; K; V] thirds."""

    def __init__(self, dim=24, heads=3, per_head=True):
        super().__init__()
        self.num_heads, self.head_dim, self.per_head = heads, dim // heads, per_head
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        B, N, C = x.shape
        if self.per_head:
            q, k, v = self.qkv(x).view(B, N, self.num_heads, 3, self.head_dim).unbind(3)
        else:
            q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).unbind(2)
        return torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))


class ThirdsAttention(FusedAttention):
    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def test_fused_layout_read_from_the_source_never_guessed():
    found = discover(nn.ModuleDict({"a": FusedAttention(), "b": ThirdsAttention()}))
    assert [l.name for l in found.layers] == ["b"] and found.layers[0].spec.layout == "contiguous"
    assert [u.name for u in found.uncovered] == ["a"] and "layout=" in found.uncovered[0].reason


def test_user_interleaved_adapter_matches_the_forward_and_contiguous_does_not():
    """The natural contiguous reading of a [H, 3, d] fused weight mixes the heads' Q, K and V rows."""
    torch.manual_seed(0)
    m = FusedAttention()
    register_adapter(FusedAttention, lambda m: AttentionSpec.from_fused(m.qkv.weight, num_heads=m.num_heads,
                                                                        bias=m.qkv.bias, layout="per_head"))
    try:
        rep = apply(m, seed=0, strict=True)
    finally:
        unregister_adapter(FusedAttention)
    assert rep[0].layout == "per_head"
    read = _per_head("qkv", 3)(m)
    _assert_conditioned(read, "per_head adapter")
    # head h of Q is block h of the "q" stream, wherever its rows are stored (layer 0)
    from condinit.init import conditioned_blocks

    for p in "qk":
        expect = conditioned_blocks(rep.seed, p, range(3), (8, 24))
        for h in range(3):
            assert torch.equal(read[p][h].detach(), expect[h]), (p, h)
    # a contiguous description of the same weight takes head 0's key for "Q head 1" and head 2's
    # query and key for "V": writing through it would break every head
    wrong = AttentionSpec.from_fused(m.qkv.weight, num_heads=3)
    assert torch.equal(wrong.q.view()[8:16], _per_head("qkv", 3)(m)["k"][0])
    assert not torch.equal(wrong.v.view(), torch.eye(24))
    # the layout helper and the Projection it describes
    parts = fused_layout(72, num_heads=3, layout="per_head")
    assert parts["q"] == (0, 8, 3, 24) and parts["v"] == (16, 24, 3, 24) and parts["heads"] == (3, 3, 8)
    grouped = fused_layout(8 * (4 + 2 * 2), num_heads=4, num_kv_heads=2, layout="per_group")
    assert grouped["q"] == (0, 16, 2, 32) and grouped["k"] == (16, 24, 2, 32) and grouped["v"] == (24, 32, 2, 32)


def test_head_counts_are_validated_before_anything_is_written():
    w = torch.empty(36, 12)
    with pytest.raises(ValueError, match="num_kv_heads=2 must divide num_heads=3"):
        AttentionSpec.from_fused(w, num_heads=3, num_kv_heads=2, head_dim=3)
    with pytest.raises(ValueError, match="must divide num_heads"):
        AttentionSpec(Projection(w, 0, 12), Projection(w, 12, 20), Projection(w, 20, 28), 3, 2, 4)
    with pytest.raises(ValueError, match="q has 12 rows, expected num_heads \\* head_dim"):
        AttentionSpec(Projection(w, 0, 12), Projection(w, 12, 24), Projection(w, 24, 36), 4, 4, 4)
    with pytest.raises(ValueError, match="share rows"):
        AttentionSpec(Projection(w, 0, 12), Projection(w, 8, 20), Projection(w, 24, 36), 3, 3, 4)
    with pytest.raises(ValueError, match="rows up to 40"):
        Projection(w, 4, 8, groups=3, stride=16)
    with pytest.raises(ValueError, match="layout='grouped' needs groups"):
        fused_layout(36, num_heads=3, layout="grouped")
    with pytest.raises(ValueError, match="per_group"):
        fused_layout(48, num_heads=4, num_kv_heads=2, layout="per_head")

    class Lying(nn.Module):     # says 5 heads of 4 over 16 query rows
        def __init__(self):
            super().__init__()
            self.num_heads, self.head_dim = 5, 4
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(16, 16) for _ in range(3))

    class BadGroups(nn.Module):     # 4 heads, 3 key/value heads
        def __init__(self):
            super().__init__()
            self.num_heads, self.num_key_value_heads = 4, 3
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(16, 16), nn.Linear(16, 12), nn.Linear(16, 12)

    for bad, msg in ((Lying(), r"blocks\.1 \(Lying\): q has 16 rows, but 5 heads \(attribute num_heads\)"),
                     (BadGroups(), r"blocks\.1 \(BadGroups\): 3 key/value heads .* do not divide 4 heads")):
        model = nn.ModuleDict({"blocks": nn.ModuleList([nn.MultiheadAttention(16, 2), bad])})
        w0 = model["blocks"][0].in_proj_weight.detach().clone()
        with pytest.raises(ValueError, match=msg):
            apply(model, seed=0)
        assert torch.equal(model["blocks"][0].in_proj_weight, w0)
        assert [l.name for l in apply(model, seed=0, exclude="blocks.1")] == ["blocks.0"]


def test_unsupported_from_an_adapter_is_listed():
    class Refused(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(4, 4)

    def refuse(m):
        raise UnsupportedAttention("experimental layout, not described yet")

    register_adapter(Refused, refuse)
    try:
        found = discover(nn.Sequential(nn.MultiheadAttention(8, 2), Refused()))
    finally:
        unregister_adapter(Refused)
    assert [str(u) for u in found.uncovered] == ["1 (Refused): experimental layout, not described yet"]


# ------------------------------------------------------------------------------------------------
# meta device and storage dtypes

def test_meta_mha_gets_its_own_init_everywhere():
    """nn.MultiheadAttention's own init zeroes out_proj.bias after nn.Linear drew it: the meta path
    runs every reset, so the materialized model equals the one built on the CPU, bit for bit."""
    def build():   # two layers built one after the other (no deep-copied clones)
        return nn.Sequential(*(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True) for _ in range(2)))

    torch.manual_seed(7)
    cpu = build()
    with torch.device("meta"):
        meta = build()
    torch.manual_seed(7)
    apply(meta, seed=1)
    apply(cpu, seed=1)
    for l in meta:
        assert torch.count_nonzero(l.self_attn.out_proj.bias) == 0
    for (n, a), b in zip(meta.named_parameters(), cpu.parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("arch", ["jetmoe", "aimv2"])
def test_meta_path_with_reshaped_weights_and_a_learned_query(arch):
    """On meta, the Q/K/V that are written whole (an expert stack read through matrix_shape) are
    skipped by the own init and then conditioned as on the CPU; a learned query is not written, so
    the model's own init fills it."""
    build, classes, oracle = ARCHS[arch]
    torch.manual_seed(0)
    cpu = build()
    apply(cpu, seed=4)
    with torch.device("meta"):
        meta = build()
    apply(meta, seed=4, device="cpu")
    for m, m0 in zip(_attention_modules(meta, classes), _attention_modules(cpu, classes)):
        got, want = oracle(m), oracle(m0)
        for p in "qkv":
            assert all(torch.equal(a, b) for a, b in zip(got[p], want[p])), f"{arch} {p}"
    for n, t in meta.named_parameters():
        assert not t.is_meta and bool(torch.isfinite(t).all()), n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["gpt_neox", "falcon_new", "qwen3_next", "llama", "xlnet", "jetmoe"])
def test_low_precision_is_the_fp32_result_rounded_once(arch, dtype):
    torch.manual_seed(0)
    m32 = ARCHS[arch][0]()
    m16 = copy.deepcopy(m32).to(dtype)
    others = {n: p.detach().clone() for n, p in m16.named_parameters()}
    apply(m32, seed=21)
    apply(m16, seed=21)
    classes, oracle = ARCHS[arch][1], ARCHS[arch][2]
    for a, b in zip(_attention_modules(m32, classes), _attention_modules(m16, classes)):
        ra, rb = oracle(a), oracle(b)
        for part in ("q", "k", "v"):
            for x, y in zip(ra[part], rb[part]):
                assert y.dtype == dtype and torch.equal(x.detach().to(dtype), y.detach())
    assert all(p.dtype == dtype for p in m16.parameters())
    if arch == "qwen3_next":     # the gate rows of q_proj keep their values
        for m in _attention_modules(m16, classes):
            gate = m.q_proj.weight.unflatten(0, (4, 2, -1))[:, 1]
            name = next(n for n, p in m16.named_parameters() if p is m.q_proj.weight)
            assert torch.equal(gate, others[name].unflatten(0, (4, 2, -1))[:, 1])
