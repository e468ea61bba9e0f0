"""The gains of the conditioned init: ``qk_gain`` (every Q/K head block's singular values) and
``v_gain`` (``W_V = v_gain * I``), through ``conditioned_init_``, ``conditioned_init_layers_``,
``condinit.apply`` and ``condinit init``; bad gains refused before anything is written; the gains
recorded in the report and in the checkpoint metadata.

Singular values are checked with ``torch.linalg.svdvals`` in float64 and V against ``torch.eye``,
independently of condinit's own spectrum code.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from condinit.init import conditioned_blocks, conditioned_init_, conditioned_init_layers_

F32_REL = 1e-5   # fp32 singular values of an orthonormalized block times the gain, relative to the gain
BAD_GAINS = [0, 0.0, -1, float("nan"), float("inf"), -float("inf"), True, "a", None]


def _svd_rel_err(w: torch.Tensor, heads: int, gain: float) -> float:
    """max |sigma / gain - 1| over every head block of ``w`` ``[heads * d, D]``, in float64."""
    blocks = w.detach().double().reshape(heads, w.shape[0] // heads, w.shape[1])
    s = torch.linalg.svdvals(blocks)
    return float((s / gain - 1).abs().max())


def _expected_v(rows: int, cols: int, gain: float, dtype, head_dim=None) -> torch.Tensor:
    """``gain * I`` (rectangular, or per head block), the gain rounded once into ``dtype``."""
    eye = torch.eye(rows, cols, dtype=dtype) if head_dim is None else \
        torch.eye(head_dim, cols, dtype=dtype).repeat(rows // head_dim, 1)
    return eye * torch.tensor(gain, dtype=dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (NaN-safe equality)."""
    return t.detach().contiguous().view(torch.uint8).clone()


def _random_layer(rng, H, Hkv, d, D, dtype=torch.float32):
    q = torch.randn(H * d, D, generator=rng).to(dtype)
    k = torch.randn(Hkv * d, D, generator=rng).to(dtype)
    v = torch.randn(Hkv * d, D, generator=rng).to(dtype)
    return q, k, v


# ---------------------------------------------------------------------------------------------------
# conditioned_init_ / conditioned_init_layers_

@pytest.mark.parametrize("v_mode", ["identity", "identity_per_head"])
@pytest.mark.parametrize("qk_gain,v_gain", [(0.5, 0.1), (3.0, 2.5), (1e-3, 7.0)])
@pytest.mark.parametrize("shape", [(4, 2, 16, 64), (2, 1, 16, 8)], ids=["wide", "tall"])   # (H, Hkv, d, D)
def test_conditioned_init_gains_exact(rng, seed, shape, qk_gain, v_gain, v_mode):
    H, Hkv, d, D = shape
    q, k, v = _random_layer(rng, H, Hkv, d, D)
    qb, kb, vb = (torch.randn(t.shape[0], generator=rng) for t in (q, k, v))
    conditioned_init_(q, k, v, num_heads=H, num_kv_heads=Hkv, q_bias=qb, k_bias=kb, v_bias=vb, seed=seed,
                      layer_index=1, v_mode=v_mode, qk_gain=qk_gain, v_gain=v_gain)
    assert _svd_rel_err(q, H, qk_gain) <= F32_REL, "Q singular values != qk_gain"
    assert _svd_rel_err(k, Hkv, qk_gain) <= F32_REL, "K singular values != qk_gain"
    expected = _expected_v(*v.shape, v_gain, torch.float32, d if v_mode == "identity_per_head" else None)
    assert torch.equal(v, expected), "V != v_gain * I"
    for b in (qb, kb, vb):
        assert torch.equal(b, torch.zeros_like(b))


def test_gain_scales_the_same_random_blocks(seed):
    """The gains change the scale only: Q/K are the gain-1 blocks times fp32(gain), bit for bit, and
    the default call is the paper's method (the blocks of ``conditioned_blocks``, V = I)."""
    H, Hkv, d, D = 4, 2, 8, 32
    base = [torch.empty(H * d, D), torch.empty(Hkv * d, D), torch.empty(Hkv * d, D)]
    conditioned_init_(*base, num_heads=H, num_kv_heads=Hkv, seed=seed, layer_index=2)
    q_ref = conditioned_blocks(seed, "q", range(2 << 32, (2 << 32) + H), (d, D)).reshape(H * d, D)
    k_ref = conditioned_blocks(seed, "k", range(2 << 32, (2 << 32) + Hkv), (d, D)).reshape(Hkv * d, D)
    assert torch.equal(base[0], q_ref) and torch.equal(base[1], k_ref)
    assert torch.equal(base[2], torch.eye(Hkv * d, D))
    explicit = [torch.empty_like(t) for t in base]
    conditioned_init_(*explicit, num_heads=H, num_kv_heads=Hkv, seed=seed, layer_index=2, qk_gain=1.0, v_gain=1)
    assert all(torch.equal(a, b) for a, b in zip(base, explicit))
    g = 0.3
    scaled = [torch.empty_like(t) for t in base]
    conditioned_init_(*scaled, num_heads=H, num_kv_heads=Hkv, seed=seed, layer_index=2, qk_gain=g, v_gain=g)
    g32 = torch.tensor(g, dtype=torch.float32)
    assert torch.equal(scaled[0], base[0] * g32) and torch.equal(scaled[1], base[1] * g32)
    assert torch.equal(scaled[2], torch.eye(Hkv * d, D) * g32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_gains_in_other_dtypes(seed, dtype):
    """V's diagonal is the gain rounded once into the dtype; Q/K are the fp32 product rounded once."""
    H, d, D = 2, 8, 32
    g_qk, g_v = 0.7, 0.1
    q, k, v = (torch.empty(H * d, D, dtype=dtype) for _ in range(3))
    conditioned_init_(q, k, v, num_heads=H, seed=seed, qk_gain=g_qk, v_gain=g_v)
    assert torch.equal(v, _expected_v(H * d, D, g_v, dtype))
    ref = [torch.empty(H * d, D) for _ in range(3)]
    conditioned_init_(*ref, num_heads=H, seed=seed)
    g32 = torch.tensor(g_qk, dtype=torch.float32)
    assert torch.equal(q, (ref[0] * g32).to(dtype)) and torch.equal(k, (ref[1] * g32).to(dtype))


def test_conditioned_init_layers_gains(seed):
    H, Hkv, d, D = 4, 2, 8, 32
    g_qk, g_v = 0.25, 0.1
    layers = [{"q": torch.empty(H * d, D), "k": torch.empty(Hkv * d, D), "v": torch.empty(Hkv * d, D),
               "v_bias": torch.ones(Hkv * d)} for _ in range(3)]
    conditioned_init_layers_(layers, num_heads=H, num_kv_heads=Hkv, seed=seed, qk_gain=g_qk, v_gain=g_v)
    for L, layer in enumerate(layers):
        assert _svd_rel_err(layer["q"], H, g_qk) <= F32_REL, f"layer {L} Q"
        assert _svd_rel_err(layer["k"], Hkv, g_qk) <= F32_REL, f"layer {L} K"
        assert torch.equal(layer["v"], _expected_v(Hkv * d, D, g_v, torch.float32)), f"layer {L} V"
        assert torch.equal(layer["v_bias"], torch.zeros(Hkv * d))
    # per layer, with its index: the same bits
    for L, layer in enumerate(layers):
        one = [torch.empty_like(layer[key]) for key in "qkv"]
        conditioned_init_(*one, num_heads=H, num_kv_heads=Hkv, seed=seed, layer_index=L, qk_gain=g_qk, v_gain=g_v)
        assert all(torch.equal(a, layer[key]) for a, key in zip(one, "qkv")), f"layer {L}"


@pytest.mark.parametrize("which", ["v_gain", "qk_gain"])
@pytest.mark.parametrize("bad", BAD_GAINS, ids=repr)
def test_bad_gain_refused_before_writing(rng, which, bad):
    q, k, v = _random_layer(rng, 2, 2, 8, 16)
    vb = torch.randn(16, generator=rng)
    before = [_bits(t) for t in (q, k, v, vb)]
    with pytest.raises((TypeError, ValueError), match=which):
        conditioned_init_(q, k, v, num_heads=2, v_bias=vb, seed=0, **{which: bad})
    layers = [(q, k, v), (q.clone(), k.clone(), v.clone())]
    with pytest.raises((TypeError, ValueError), match=which):
        conditioned_init_layers_(layers, num_heads=2, seed=0, **{which: bad})
    assert all(torch.equal(_bits(t), b) for t, b in zip((q, k, v, vb), before)), "a refused call wrote"


@pytest.mark.parametrize("which", ["v_gain", "qk_gain"])
def test_gain_too_large_for_the_dtype_refused(rng, which):
    """Entries up to the gain must stay finite in the weight's dtype (fp16: 65504)."""
    q, k, v = _random_layer(rng, 2, 2, 8, 16, torch.float16)
    before = [_bits(t) for t in (q, k, v)]
    with pytest.raises(ValueError, match=which):
        conditioned_init_(q, k, v, num_heads=2, seed=0, **{which: 1e5})
    assert all(torch.equal(_bits(t), b) for t, b in zip((q, k, v), before))
    conditioned_init_(q, k, v, num_heads=2, seed=0, **{which: 3e4})   # below half of 65504: fine
    assert torch.isfinite(q).all() and torch.isfinite(k).all() and torch.isfinite(v).all()


# ---------------------------------------------------------------------------------------------------
# condinit.apply on a Hugging Face Llama

H, HKV, D = 6, 2, 48   # head_dim 8


def _tiny_llama(meta: bool = False):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=H,
                                   num_key_value_heads=HKV, vocab_size=97, max_position_embeddings=64)
    if meta:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(cfg)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _check_llama(model, g_qk, g_v):
    for L, layer in enumerate(model.model.layers):
        a = layer.self_attn
        assert _svd_rel_err(a.q_proj.weight, H, g_qk) <= F32_REL, f"layer {L} q_proj"
        assert _svd_rel_err(a.k_proj.weight, HKV, g_qk) <= F32_REL, f"layer {L} k_proj"
        assert torch.equal(a.v_proj.weight.detach(), _expected_v(HKV * 8, D, g_v, torch.float32)), f"layer {L} v_proj"


def test_apply_gains_on_hf_llama(seed):
    import condinit

    g_qk, g_v = 0.5, 0.1
    model = _tiny_llama()
    o_proj = model.model.layers[0].self_attn.o_proj.weight.detach().clone()
    report = condinit.apply(model, seed=seed, qk_gain=g_qk, v_gain=g_v)
    _check_llama(model, g_qk, g_v)
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight, o_proj)
    assert report.qk_gain == g_qk and report.v_gain == g_v
    d = report.to_dict()
    assert d["qk_gain"] == g_qk and d["v_gain"] == g_v
    assert json.loads(json.dumps(d))["v_gain"] == g_v
    g32 = float(torch.tensor(g_v, dtype=torch.float32))
    for rep in report.layers:
        assert math.isclose(rep.after["q"].sigma_max, g_qk, rel_tol=F32_REL)
        assert math.isclose(rep.after["k"].sigma_min, g_qk, rel_tol=F32_REL)
        assert rep.after["v"].sigma_max == g32 and rep.after["v"].sigma_min == g32
    assert "gains Q/K 0.5 V 0.1" in str(report)
    # default gains: the paper's method, recorded as 1
    default = condinit.apply(_tiny_llama(), seed=seed)
    assert default.qk_gain == 1.0 and default.v_gain == 1.0


def test_apply_gains_on_meta_llama(seed):
    import condinit

    model = _tiny_llama(meta=True)
    with pytest.raises(ValueError, match="v_gain"):
        condinit.apply(model, seed=seed, v_gain=float("nan"), device="cpu")
    assert all(p.is_meta for p in model.parameters()), "a refused call materialized the model"
    condinit.apply(model, seed=seed, qk_gain=2.0, v_gain=0.25, device="cpu")
    _check_llama(model, 2.0, 0.25)


@pytest.mark.parametrize("which", ["v_gain", "qk_gain"])
@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "a"], ids=repr)
def test_apply_bad_gain_refused_before_writing(which, bad):
    import condinit

    model = _tiny_llama()
    before = {n: _bits(p) for n, p in model.state_dict().items()}
    with pytest.raises((TypeError, ValueError), match=which):
        condinit.apply(model, seed=0, **{which: bad})
    after = model.state_dict()
    assert all(torch.equal(_bits(after[n]), b) for n, b in before.items()), "a refused call wrote"


# ---------------------------------------------------------------------------------------------------
# checkpoint metadata and the CLI

def test_metadata_round_trip(tmp_path, seed):
    import condinit
    from condinit.models.checkpoint import (METADATA_KEY, condinit_metadata, open_checkpoint, read_metadata,
                                            save_model_atomic)

    model = _tiny_llama()
    report = condinit.apply(model, seed=seed, qk_gain=0.75, v_gain=0.125)
    meta = condinit_metadata(model, condinit.find_attention(model), report, "llama")
    out = save_model_atomic(model, tmp_path / "m.safetensors", {METADATA_KEY: meta})
    with open_checkpoint(out) as fh:
        meta = read_metadata(fh)
    assert meta["qk_gain"] == 0.75 and meta["v_gain"] == 0.125 and meta["seed"] == seed


@pytest.mark.parametrize("field,value", [("v_gain", -1), ("qk_gain", 0), ("v_gain", "0.1"), ("qk_gain", True)])
def test_metadata_bad_gain_field_refused(tmp_path, field, value):
    from safetensors.torch import save_file

    from condinit.models.checkpoint import open_checkpoint, read_metadata

    meta = {"format": 1, "family": "llama", "seed": 0, "method": "auto", "v_mode": "identity", field: value}
    path = tmp_path / "bad.safetensors"
    save_file({"w": torch.zeros(2, 2)}, str(path), metadata={"condinit": json.dumps(meta)})
    with open_checkpoint(path) as fh, pytest.raises(ValueError, match=f"field {field} must be a finite number > 0"):
        read_metadata(fh)


def test_cli_init_gains(tmp_path, capsys):
    pytest.importorskip("transformers")
    from safetensors import safe_open
    from safetensors.torch import load_file

    from condinit.cli import main

    out = tmp_path / "f.safetensors"
    assert main(["init", "--preset", "tiny-llama", "--seed", "5", "--out", str(out), "--v-gain", "0.1",
                 "--qk-gain", "0.5", "--quiet"]) == 0
    capsys.readouterr()
    sd = load_file(str(out))
    with safe_open(str(out), "pt") as fh:
        meta = json.loads(fh.metadata()["condinit"])
    assert meta["v_gain"] == 0.1 and meta["qk_gain"] == 0.5 and meta["seed"] == 5
    H_, Hkv_, d_ = meta["num_heads"], meta["num_kv_heads"], meta["head_dim"]
    D_ = sd["model.layers.0.self_attn.q_proj.weight"].shape[1]
    for L in range(len(meta["layers"])):
        pre = f"model.layers.{L}.self_attn."
        assert _svd_rel_err(sd[pre + "q_proj.weight"], H_, 0.5) <= F32_REL
        assert _svd_rel_err(sd[pre + "k_proj.weight"], Hkv_, 0.5) <= F32_REL
        assert torch.equal(sd[pre + "v_proj.weight"], _expected_v(Hkv_ * d_, D_, 0.1, torch.float32))


@pytest.mark.parametrize("flag,value", [("--v-gain", "0"), ("--v-gain", "-1"), ("--qk-gain", "nan"),
                                        ("--qk-gain", "inf")])
def test_cli_bad_gain_writes_nothing(tmp_path, capsys, flag, value):
    pytest.importorskip("transformers")
    from condinit.cli import main

    out = tmp_path / "f.safetensors"
    assert main(["init", "--preset", "tiny-llama", "--out", str(out), flag, value, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert flag in err, err                          # the flag as typed
    assert os.listdir(tmp_path) == []


def test_cli_gain_not_a_number_and_directory_refused(tmp_path, capsys):
    pytest.importorskip("transformers")
    from condinit.cli import main

    with pytest.raises(SystemExit):
        main(["init", "--preset", "tiny-llama", "--out", str(tmp_path / "f.safetensors"), "--v-gain", "a"])
    assert "--v-gain" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
    # the streamed directory writer writes the gains too
    out_dir = tmp_path / "d"
    assert main(["init", "--preset", "tiny-llama", "--out", str(out_dir) + "/", "--v-gain", "0.1", "--quiet"]) == 0
    from condinit.models.checkpoint import open_checkpoint, read_metadata
    with open_checkpoint(out_dir) as fh:
        assert read_metadata(fh)["v_gain"] == 0.1
