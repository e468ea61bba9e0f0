"""condinit.apply on real models: every adapter, determinism, deferred (meta) init, bad inputs.

Every model is built from a tiny config (no download). Q/K/V are read back through accessors written
here per family (not through the adapters), so an adapter that maps the wrong rows fails.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import condinit
from condinit.models import AttentionSpec, apply, find_attention, register_adapter, unregister_adapter

ORTHO_ATOL = 1e-5  # fp32: max |W W^T - I| per head


# ------------------------------------------------------------------------------------------------
# families: builder, independent accessor of (q, k, v, q_bias, k_bias, v_bias, H, H_kv, d) per layer, loss

def _mha_fused():
    return nn.ModuleDict({"attn": nn.MultiheadAttention(51, 3, batch_first=True)})


def _mha_fused_qkv(m):
    a = m["attn"]
    w, b = a.in_proj_weight, a.in_proj_bias
    return [(w[:51], w[51:102], w[102:], b[:51], b[51:102], b[102:], 3, 3, 17)]


def _mha_fused_loss(m):
    x = torch.randn(2, 5, 51)
    return m["attn"](x, x, x)[0].square().mean()


def _mha_kdim():
    return nn.ModuleDict({"attn": nn.MultiheadAttention(24, 4, kdim=17, vdim=33, batch_first=True)})


def _mha_kdim_qkv(m):
    a = m["attn"]
    b = a.in_proj_bias
    return [(a.q_proj_weight, a.k_proj_weight, a.v_proj_weight, b[:24], b[24:48], b[48:], 4, 4, 6)]


def _mha_kdim_loss(m):
    return m["attn"](torch.randn(2, 5, 24), torch.randn(2, 7, 17), torch.randn(2, 7, 33))[0].square().mean()


def _torch_encoder():
    layer = nn.TransformerEncoderLayer(d_model=20, nhead=4, dim_feedforward=32, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def _mha_of(a, e, h):
    w, b = a.in_proj_weight, a.in_proj_bias
    return (w[:e], w[e:2 * e], w[2 * e:], b[:e], b[e:2 * e], b[2 * e:], h, h, e // h)


def _torch_encoder_qkv(m):
    return [_mha_of(l.self_attn, 20, 4) for l in m.layers]


def _torch_encoder_loss(m):
    return m(torch.randn(2, 6, 20)).square().mean()


def _torch_decoder():
    return nn.TransformerDecoderLayer(d_model=20, nhead=4, dim_feedforward=32, batch_first=True, dropout=0.0)


def _torch_decoder_qkv(m):
    return [_mha_of(m.self_attn, 20, 4), _mha_of(m.multihead_attn, 20, 4)]


def _torch_decoder_loss(m):
    return m(torch.randn(2, 6, 20), torch.randn(2, 4, 20)).square().mean()


def _hf_causal(kind):
    import transformers

    cfg_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config}[kind]
    cfg = cfg_cls(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _qkv_proj_qkv(layers, h, hkv):
    out = []
    for l in layers:
        a = getattr(l, "self_attn", None) or l.attention
        d = a.q_proj.weight.shape[0] // h
        out.append((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.q_proj.bias, a.k_proj.bias, a.v_proj.bias,
                    h, hkv, d))
    return out


def _causal_loss(m):
    ids = torch.randint(0, 97, (2, 9))
    return m(input_ids=ids, labels=ids).loss


def _gpt2():
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=36, n_layer=2, n_head=3, vocab_size=97,
                                                                n_positions=32))


def _gpt2_qkv(m):
    out = []
    for blk in m.transformer.h:
        w, b = blk.attn.c_attn.weight, blk.attn.c_attn.bias  # Conv1D: [in, 3E], y = x @ w + b
        out.append((w[:, :36].t(), w[:, 36:72].t(), w[:, 72:].t(), b[:36], b[36:72], b[72:], 3, 3, 12))
    return out


def _bert(kind):
    import transformers

    cfg_cls, model_cls = {"bert": (transformers.BertConfig, transformers.BertModel),
                          "roberta": (transformers.RobertaConfig, transformers.RobertaModel)}[kind]
    return model_cls(cfg_cls(hidden_size=36, num_hidden_layers=2, num_attention_heads=3, intermediate_size=48,
                             vocab_size=97, max_position_embeddings=40))


def _bert_qkv(m):
    out = []
    for l in m.encoder.layer:
        s = l.attention.self
        out.append((s.query.weight, s.key.weight, s.value.weight, s.query.bias, s.key.bias, s.value.bias, 3, 3, 12))
    return out


def _bert_loss(m):
    return m(input_ids=torch.randint(3, 97, (2, 9))).last_hidden_state.square().mean()


def _hf_vit():
    import transformers

    return transformers.ViTModel(transformers.ViTConfig(hidden_size=36, num_hidden_layers=2, num_attention_heads=3,
                                                        intermediate_size=48, image_size=16, patch_size=8,
                                                        num_channels=3))


def _hf_vit_qkv(m):
    out = []
    for l in (m.encoder.layer if hasattr(m, "encoder") else m.layers):  # transformers 4 / 5
        a = l.attention.attention if hasattr(l.attention, "attention") else l.attention
        if hasattr(a, "q_proj"):
            out.append((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.q_proj.bias, a.k_proj.bias,
                        a.v_proj.bias, 3, 3, 12))
        else:
            out.append((a.query.weight, a.key.weight, a.value.weight, a.query.bias, a.key.bias, a.value.bias,
                        3, 3, 12))
    return out


def _hf_vit_loss(m):
    return m(pixel_values=torch.randn(2, 3, 16, 16)).last_hidden_state.square().mean()


def _timm_vit():
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=16, patch_size=8, embed_dim=36, depth=2, num_heads=3, num_classes=5,
                             qkv_bias=True)


def _timm_qkv(m):
    out = []
    for blk in m.blocks:
        w, b = blk.attn.qkv.weight, blk.attn.qkv.bias
        out.append((w[:36], w[36:72], w[72:], b[:36], b[36:72], b[72:], 3, 3, 12))
    return out


def _timm_loss(m):
    return m(torch.randn(2, 3, 16, 16)).square().mean()


FAMILIES = {
    "torch-mha-fused": (_mha_fused, _mha_fused_qkv, _mha_fused_loss),
    "torch-mha-kdim-vdim": (_mha_kdim, _mha_kdim_qkv, _mha_kdim_loss),
    "torch-encoder-layer": (_torch_encoder, _torch_encoder_qkv, _torch_encoder_loss),
    "torch-decoder-layer": (_torch_decoder, _torch_decoder_qkv, _torch_decoder_loss),
    "hf-llama": (lambda: _hf_causal("llama"), lambda m: _qkv_proj_qkv(m.model.layers, 6, 2), _causal_loss),
    "hf-mistral": (lambda: _hf_causal("mistral"), lambda m: _qkv_proj_qkv(m.model.layers, 6, 2), _causal_loss),
    "hf-qwen2": (lambda: _hf_causal("qwen2"), lambda m: _qkv_proj_qkv(m.model.layers, 6, 2), _causal_loss),
    "hf-gpt2": (_gpt2, _gpt2_qkv, _causal_loss),
    "hf-bert": (lambda: _bert("bert"), _bert_qkv, _bert_loss),
    "hf-roberta": (lambda: _bert("roberta"), _bert_qkv, _bert_loss),
    "hf-vit": (_hf_vit, _hf_vit_qkv, _hf_vit_loss),
    "timm-vit": (_timm_vit, _timm_qkv, _timm_loss),
}


def _needs(name):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    if name.startswith("timm-"):
        pytest.importorskip("timm")


def _assert_orthonormal_rows(w, heads, d, what):
    blocks = w.detach().float().reshape(heads, d, -1)
    assert blocks.shape[2] >= d, what
    gram = blocks @ blocks.transpose(1, 2)
    err = (gram - torch.eye(d)).abs().max().item()
    assert err <= ORTHO_ATOL, f"{what}: max |W W^T - I| = {err:.3g}"


def _rect_identity(rows, cols, d=None):
    out = torch.zeros(rows, cols)
    r = torch.arange(rows)
    c = r if d is None else r % d
    keep = c < cols
    out[r[keep], c[keep]] = 1
    return out


def _check_conditioned(model, qkv, v_mode="identity"):
    for i, (q, k, v, qb, kb, vb, h, hkv, d) in enumerate(qkv):
        _assert_orthonormal_rows(q, h, d, f"layer {i} Q")
        _assert_orthonormal_rows(k, hkv, d, f"layer {i} K")
        expect_v = _rect_identity(*v.shape, d=None if v_mode == "identity" else d)
        assert torch.equal(v.detach().float(), expect_v), f"layer {i} V is not the rectangular identity"
        for name, b in (("q", qb), ("k", kb), ("v", vb)):
            if b is not None:
                assert torch.count_nonzero(b).item() == 0, f"layer {i} {name} bias not zero"


def _qkv_ids(qkv):
    """data_ptrs of the storages of the Q/K/V weights and biases (to know what apply may change)."""
    return {t.untyped_storage().data_ptr() for row in qkv for t in row[:6] if t is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_adapter_conditions_qkv_and_leaves_the_rest(family):
    _needs(family)
    build, access, loss_fn = FAMILIES[family]
    torch.manual_seed(0)
    model = build()
    qkv = access(model)
    touched = _qkv_ids(qkv)
    before = {n: p.detach().clone() for n, p in model.named_parameters()
              if p.untyped_storage().data_ptr() not in touched}
    before_buffers = {n: b.clone() for n, b in model.named_buffers()}
    rep = apply(model, seed=1234)
    assert len(rep) == len(qkv)
    _check_conditioned(model, access(model))
    for n, p in model.named_parameters():
        if n in before:
            assert torch.equal(p.detach(), before[n]), f"{n} changed"
    for n, b in model.named_buffers():
        assert torch.equal(b, before_buffers[n]), f"buffer {n} changed"
    for l in rep:
        for p in "qkv":
            assert l.before[p] is not None and l.before[p].cond > 1.01   # default init is not conditioned
            assert abs(l.after[p].cond - 1) < 1e-4 and abs(l.after[p].sigma_max - 1) < 1e-4
    model.train()
    loss = loss_fn(model)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_report_table_and_dict():
    build, access, _ = FAMILIES["torch-encoder-layer"]
    torch.manual_seed(0)
    rep = apply(build(), seed=3)
    text = str(rep)
    assert "layers.0.self_attn" in text and "layers.1.self_attn" in text and "torch.MultiheadAttention" in text
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["seed"] == 3 and len(d["layers"]) == 2 and d["layers"][1]["index"] == 1
    assert d["layers"][0]["shapes"]["q"] == [20, 20] and len(d["layers"][0]["after"]["k"]["cond_per_head"]) == 4
    assert rep.launches >= 2  # one group for Q, one for K
    assert rep[0].time_s > 0


# ------------------------------------------------------------------------------------------------
# determinism

def _qkv_snapshot(qkv):
    return [tuple(t.detach().clone() if t is not None else None for t in row[:6]) for row in qkv]


def _assert_same(a, b):
    for ra, rb in zip(a, b):
        for x, y in zip(ra, rb):
            assert (x is None) == (y is None)
            if x is not None:
                assert torch.equal(x, y)


def test_whole_model_equals_layer_by_layer_and_subsets():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    base = _hf_causal("llama")
    access = FAMILIES["hf-llama"][1]
    whole = copy.deepcopy(base)
    apply(whole, seed=9)
    expect = _qkv_snapshot(access(whole))
    pieces = copy.deepcopy(base)
    rep0 = apply(pieces, seed=9, include="*layers.0*")
    rep1 = apply(pieces, seed=9, exclude=["*layers.0*"])
    assert [l.index for l in rep0] == [0] and [l.index for l in rep1] == [1]
    _assert_same(_qkv_snapshot(access(pieces)), expect)
    # a sub-module with layer_offset numbers its layers as in the whole model
    sub = copy.deepcopy(base)
    apply(sub.model.layers[1], seed=9, layer_offset=1)
    _assert_same(_qkv_snapshot(access(sub))[1:], expect[1:])
    # re-chunking (chunks of 3 blocks of 8 x 48: each layer's 6 Q heads split in two, its 2 K heads
    # form one chunk) does not change a bit
    tiny = copy.deepcopy(base)
    rep = apply(tiny, seed=9, memory_budget=3 * 8 * 48 * 4)
    assert rep.launches == 2 * (2 + 1)
    _assert_same(_qkv_snapshot(access(tiny)), expect)
    # another seed gives other weights
    other = copy.deepcopy(base)
    apply(other, seed=10)
    assert not torch.equal(access(other)[0][0], expect[0][0])


@pytest.mark.parametrize("v_mode", ["identity", "identity_per_head"])
def test_v_mode(v_mode):
    torch.manual_seed(0)
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(24, 4, kdim=17, vdim=33, batch_first=True)})
    rep = apply(model, seed=2, v_mode=v_mode)
    _check_conditioned(model, _mha_kdim_qkv(model), v_mode=v_mode)
    assert rep[0].after["v"].sigma_max == 1.0 and rep[0].after["v"].cond == 1.0


def test_seed_default_is_drawn_like_torch_nn_init():
    """seed=None (the default) draws one number from the generator, as torch.nn.init does:
    torch.manual_seed (or a seeded generator) reproduces it, and the default generator advances."""
    build = FAMILIES["torch-mha-fused"][0]
    ws = []
    for _ in range(2):
        torch.manual_seed(77)
        m = build()
        torch.manual_seed(5)
        rep = apply(m)
        ws.append((rep.seed, m["attn"].in_proj_weight.detach().clone()))
    assert ws[0][0] == ws[1][0] and torch.equal(ws[0][1], ws[1][1])
    assert apply(build()).seed != ws[0][0]            # the default generator moved on
    seeds = [apply(build(), generator=torch.Generator().manual_seed(3)).seed for _ in range(2)]
    assert seeds[0] == seeds[1] and seeds[0] != ws[0][0]
    m = build()
    rep = apply(m, seed=seeds[0])                      # the recorded seed reproduces the weights
    m2 = build()
    apply(m2, generator=torch.Generator().manual_seed(3))
    assert torch.equal(m["attn"].in_proj_weight, m2["attn"].in_proj_weight)


def test_bf16_is_fp32_rounded_once():
    build, access, _ = FAMILIES["torch-encoder-layer"]
    torch.manual_seed(0)
    m32 = build()
    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    apply(m32, seed=4)
    rep = apply(m16, seed=4)
    for r32, r16 in zip(access(m32), access(m16)):
        for a, b in zip(r32[:3], r16[:3]):
            assert b.dtype == torch.bfloat16
            assert torch.equal(a.detach().to(torch.bfloat16), b.detach())
    assert abs(rep[0].after["q"].cond - 1) < 2e-2  # rounding to bf16 moves kappa off 1 by ~2^-8


# ------------------------------------------------------------------------------------------------
# deferred (meta) init

@pytest.mark.parametrize("family", ["hf-llama", "hf-gpt2", "torch-encoder-layer", "timm-vit"])
def test_meta_then_materialized_equals_cpu(family):
    _needs(family)
    build, access, loss_fn = FAMILIES[family]
    torch.manual_seed(0)
    cpu = build()
    apply(cpu, seed=31)
    with torch.device("meta"):
        meta = build()
    rep = apply(meta, seed=31)
    assert rep.materialized and all(l.before["q"] is None for l in rep)
    _assert_same(_qkv_snapshot(access(meta)), _qkv_snapshot(access(cpu)))
    # every other tensor got the model's own init: finite, and not all zero where the CPU model isn't
    cpu_params = dict(cpu.named_parameters())
    for n, p in meta.named_parameters():
        assert torch.isfinite(p).all(), n
        if cpu_params[n].abs().sum() > 0:
            assert p.abs().sum() > 0, f"{n} left at zero"
    for n, b in meta.named_buffers():
        assert not b.is_meta and (not b.is_floating_point() or torch.isfinite(b).all()), n
    if family in ("hf-llama", "hf-gpt2"):
        tied_cpu = cpu.get_output_embeddings().weight is cpu.get_input_embeddings().weight
        assert (meta.get_output_embeddings().weight is meta.get_input_embeddings().weight) == tied_cpu
        inv = dict(meta.named_buffers()).get("model.rotary_emb.inv_freq")
        if inv is not None:
            assert torch.equal(inv, dict(cpu.named_buffers())["model.rotary_emb.inv_freq"])
    loss = loss_fn(meta)
    loss.backward()
    assert torch.isfinite(loss)


def test_meta_bf16():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    cpu = _hf_causal("llama")
    apply(cpu, seed=8)
    with torch.device("meta"):
        meta = _hf_causal("llama").to(torch.bfloat16)
    apply(meta, seed=8)
    for r32, r16 in zip(FAMILIES["hf-llama"][1](cpu), FAMILIES["hf-llama"][1](meta)):
        for a, b in zip(r32[:3], r16[:3]):
            assert b.dtype == torch.bfloat16 and torch.equal(a.detach().to(torch.bfloat16), b.detach())
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p).all() for p in meta.parameters())


class _Raw(nn.Module):
    """A module with a bare parameter that no reset_parameters covers."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)
        self.scale = nn.Parameter(torch.ones(8))


def test_meta_uninitialized_parameter_is_reported_and_init_fn_fixes_it():
    with torch.device("meta"):
        m = _Raw()
    with pytest.raises(ValueError, match="scale"):
        apply(m, seed=0)
    with torch.device("meta"):
        m = _Raw()

    def init_fn(model):
        nn.init.ones_(model.scale)
        model.attn._reset_parameters()
        model.attn.out_proj.reset_parameters()  # MHA's _reset_parameters leaves out_proj.weight to Linear

    apply(m, seed=0, init_fn=init_fn)
    assert torch.equal(m.scale.detach(), torch.ones(8))
    _check_conditioned(m, [_mha_of(m.attn, 8, 2)])


# ------------------------------------------------------------------------------------------------
# custom adapters and bad inputs

class ToyAttention(nn.Module):
    """wq / wk / wv, found by structure, but its head count is an attribute no one else uses."""

    def __init__(self, dim=30, heads=5, kv_heads=1):
        super().__init__()
        d = dim // heads
        self.n_q, self.n_kv = heads, kv_heads
        self.wq = nn.Linear(dim, heads * d, bias=False)
        self.wk = nn.Linear(dim, kv_heads * d, bias=False)
        self.wv = nn.Linear(dim, kv_heads * d, bias=False)


def test_register_custom_adapter():
    model = nn.Sequential(ToyAttention(), nn.ReLU(), ToyAttention())
    with pytest.raises(ValueError, match=r"2 x ToyAttention \(0, 2\): cannot find the number of heads"):
        apply(model)
    register_adapter(ToyAttention, lambda m: AttentionSpec.from_linears(m.wq, m.wk, m.wv, num_heads=m.n_q))
    try:
        rep = apply(model, seed=6)
        assert [l.name for l in rep] == ["0", "2"] and rep[0].num_kv_heads == 1 and rep[0].adapter == "ToyAttention"
        for a in (model[0], model[2]):
            _check_conditioned(model, [(a.wq.weight, a.wk.weight, a.wv.weight, None, None, None, 5, 1, 6)])
    finally:
        unregister_adapter(ToyAttention)
    # by dotted name, without importing the class
    register_adapter(f"{ToyAttention.__module__}.ToyAttention",
                     lambda m: AttentionSpec.from_linears(m.wq, m.wk, m.wv, num_heads=m.n_q), name="toy")
    try:
        assert [l.adapter for l in find_attention(model)] == ["toy", "toy"]
    finally:
        unregister_adapter(f"{ToyAttention.__module__}.ToyAttention")


def test_bad_inputs():
    build = FAMILIES["torch-mha-fused"][0]
    with pytest.raises(TypeError, match="nn.Module"):
        apply("model")
    with pytest.raises(ValueError, match="no attention layer found in Sequential"):
        apply(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="matches include"):
        apply(build(), include="nothing*")
    with pytest.raises(ValueError, match="v_mode"):
        apply(build(), v_mode="ones")
    with pytest.raises(ValueError, match="seed"):
        apply(build(), seed=-1)
    with pytest.raises(ValueError, match="memory_budget"):
        apply(build(), memory_budget=0)
    with pytest.raises(TypeError, match="buffer_bytes"):   # the old name is gone
        apply(build(), buffer_bytes=1 << 20)
    with pytest.raises(ValueError, match="seed"):
        apply(build(), seed=2 ** 64)
    with pytest.raises(ValueError, match="either seed or generator"):
        apply(build(), seed=1, generator=torch.Generator())
    with pytest.raises(TypeError, match="generator"):
        apply(build(), generator=5)
    with pytest.raises(TypeError, match="report"):
        apply(build(), report=1)
    with pytest.raises(ValueError, match="layer_offset"):
        apply(build(), layer_offset=-2)
    with pytest.raises(ValueError, match="only used to materialize"):
        apply(build(), device="cpu")
    with pytest.raises(ValueError, match="num_heads"):
        AttentionSpec.from_fused(torch.empty(36, 12), num_heads=0, head_dim=4)
    with pytest.raises(TypeError, match="num_kv_heads"):
        AttentionSpec.from_weights(torch.empty(12, 12), torch.empty(12, 12), torch.empty(12, 12), num_heads=3,
                                   num_kv_heads=True)
    with pytest.raises(ValueError, match="does not split"):
        AttentionSpec.from_fused(torch.empty(35, 12), num_heads=3)
    with torch.device("meta"):
        m = build()
    m.extra = nn.Linear(3, 3)  # real weights next to meta ones: to_empty would wipe them
    with pytest.raises(ValueError, match="partly on the meta device"):
        apply(m)
    with torch.device("meta"):
        m = build()
    with pytest.raises(ValueError, match="real device"):
        apply(m, device="meta")
    with pytest.raises(ValueError, match="method"):
        apply(m, method="gram-schmidt")
    assert all(p.is_meta for p in m.parameters())  # refused before materializing anything
    # nothing was written when apply refused
    m = build()
    w = m["attn"].in_proj_weight.detach().clone()
    with pytest.raises(ValueError):
        apply(m, v_mode="bad")
    assert torch.equal(w, m["attn"].in_proj_weight.detach())


def test_layers_with_different_head_counts_draw_independent_blocks():
    """Block ids put the layer in the counter's high word: a layer with 8 heads of 8 and one with
    4 heads of 16 never share a random stream (with ids L * num_heads + h they would: after
    CholeskyQR a block's first row is its Gaussian's first row, normalized, so shared streams
    show up as identical first rows)."""
    model = torch.nn.Sequential(torch.nn.MultiheadAttention(64, 8), torch.nn.MultiheadAttention(64, 4))
    condinit.apply(model, seed=0, report=False)
    rows = []
    for mha, heads in ((model[0], 8), (model[1], 4)):
        for p in range(2):  # Q and K
            w = mha.in_proj_weight.detach()[p * 64:(p + 1) * 64].view(heads, 64 // heads, 64)
            rows.append(w[:, 0, :])
    rows = torch.cat(rows)
    rows = rows / rows.norm(dim=1, keepdim=True)
    overlap = (rows @ rows.T - torch.eye(len(rows))).abs().max()
    assert overlap < 0.8, overlap
