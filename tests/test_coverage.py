"""Acceptance test of :func:`condinit.apply`'s coverage: every architecture the installed
transformers can build from a default config, timm's main ViT families and torch.nn's attention
modules are conditioned as the method says, or are listed with the reason: in :data:`REFUSED`
(the method or the model has no direct reading: latent attention, attention that is not softmax
attention, a default config transformers cannot build) or in :data:`NOT_CHECKED` (this sweep cannot
run or read the model: an input it does not build, attention it does not intercept).

``CONDINIT_COVERAGE=all`` sweeps every architecture (about ten minutes on two CPU cores); the default
sweeps a fixed sample (the main families plus every ``SAMPLE_STRIDE``-th architecture) to keep the
suite fast.

The check does not use condinit's discovery, adapters or report: ``tests/coverage_models.py`` finds
the attention layers by intercepting where attention is computed and reads each layer's Q/K/V rows
and head split from gradients (see its docstring). A model passes when every attention layer found
has orthonormal Q and K rows per head, V equal to the rectangular identity in the order the
attention reads it, zero Q/K/V biases, and every other parameter and buffer unchanged bit for bit;
or, for a model with no attention at all, when ``condinit.apply`` refuses it with "no attention".

``python tools/coverage_table.py`` runs the same sweep and writes the README's "Which models" table.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch

import condinit
from coverage_models import architectures, build_hf, check_conditioned, hf_run, read_model, state_snapshot, verify

# Architectures that are not conditioned, and why. A reason names what the method or the model
# lacks; "cannot be built" entries are models transformers cannot build on CPU from their default
# config (plus the shrinking the sweep applies), with transformers' own error.
REFUSED = {
}

# Architectures this sweep cannot run or read, and why (its limits, not condinit's).
NOT_CHECKED = {
}

# Always in the default sample: the families most models are built from.
MAIN_FAMILIES = tuple(f"transformers:{t}" for t in (
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "phi", "phi3",
    "olmo2", "cohere", "starcoder2", "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "falcon", "bloom", "mpt", "opt",
    "bert", "roberta", "deberta-v2", "electra", "albert", "distilbert", "t5", "bart", "mbart", "whisper", "wav2vec2",
    "clip", "siglip", "vit", "deit", "beit", "swin", "dinov2", "llava", "qwen2_vl", "detr", "mamba",
)) + tuple(f"timm:{t}" for t in ("vit", "vit (global_pool='map')", "deit (distilled)", "swin", "eva02", "beit")) + \
    tuple(f"torch.nn:{t}" for t in ("MultiheadAttention", "MultiheadAttention (kdim, vdim)", "TransformerEncoderLayer",
                                    "TransformerDecoderLayer", "Transformer"))
SAMPLE_STRIDE = 12


def apply_condinit(model):
    return condinit.apply(model, seed=0)


@functools.lru_cache(maxsize=1)
def _archs():
    return {a.name: a for a in architectures()}


def _arch_ids():
    names = [n for n in _archs() if n not in REFUSED and n not in NOT_CHECKED]
    if os.environ.get("CONDINIT_COVERAGE", "sample") == "all":
        return names
    main = [n for n in MAIN_FAMILIES if n in names]
    return main + [n for n in names[::SAMPLE_STRIDE] if n not in main]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", _arch_ids())
def test_architecture(name):
    out = verify(_archs()[name], apply_condinit)
    assert out.status in ("conditioned", "no attention"), f"{name}: " + "\n  ".join(out.details)


def test_lists_name_real_architectures_with_reasons():
    for listed in (REFUSED, NOT_CHECKED):
        unknown = sorted(set(listed) - set(_archs()))
        assert not unknown, f"listed architectures the sweep does not have: {unknown}"
        assert all(isinstance(r, str) and len(r) > 10 for r in listed.values())
    assert not set(REFUSED) & set(NOT_CHECKED)
    missing = [n for n in MAIN_FAMILIES if n not in _archs()]
    assert not missing, f"main families the installed libraries do not have: {missing}"


# ------------------------------------------------------------------------------------------------
# the reading itself, on layouts known by hand (it must not depend on condinit to be right)

def _read(model_type):
    model = build_hf(model_type)
    errors = []
    reading = read_model(model, lambda m: errors.extend(hf_run(m)))
    assert not errors and not reading.problems(), errors + reading.problems()
    return model, reading


def test_reading_finds_gpt2_fused_transposed_layout():
    model, reading = _read("gpt2")
    [r] = reading.attention
    E, d = model.config.n_embd, model.config.n_embd // model.config.n_head
    assert (r.q.weight, r.k.weight, r.v.weight) == ("h.0.attn.c_attn.weight",) * 3
    assert r.q.transposed and r.k.transposed and r.v.transposed          # Conv1D: [in, out]
    assert r.q.heads == [list(range(h * d, (h + 1) * d)) for h in range(model.config.n_head)]
    assert r.k.rows == list(range(E, 2 * E)) and r.v.rows == list(range(2 * E, 3 * E))
    assert [b for b, _ in r.q.biases] == ["h.0.attn.c_attn.bias"]


def test_reading_finds_gpt_neox_interleaved_heads():
    model, reading = _read("gpt_neox")
    [r] = reading.attention
    H = model.config.num_attention_heads
    d = model.config.hidden_size // H
    # query_key_value rows are [head 0: q k v | head 1: q k v | ...]
    assert r.q.heads == [list(range(3 * d * h, 3 * d * h + d)) for h in range(H)]
    assert r.k.heads == [list(range(3 * d * h + d, 3 * d * h + 2 * d)) for h in range(H)]
    assert r.v.heads == [list(range(3 * d * h + 2 * d, 3 * d * h + 3 * d)) for h in range(H)]
    assert not r.q.transposed


def test_reading_finds_grouped_kv_heads_and_mha_in_proj():
    model, reading = _read("llama")
    [r] = reading.attention
    cfg = model.config
    assert len(r.q.heads) == cfg.num_attention_heads and len(r.k.heads) == cfg.num_key_value_heads
    mha = torch.nn.MultiheadAttention(24, 3, batch_first=True)
    x = torch.randn(1, 5, 24)
    [m] = read_model(mha, lambda m: m(x, x, x)).attention
    assert m.q.weight == m.k.weight == m.v.weight == "in_proj_weight"
    assert (m.q.rows, m.k.rows, m.v.rows) == (list(range(24)), list(range(24, 48)), list(range(48, 72)))
    assert len(m.q.heads) == 3


# ------------------------------------------------------------------------------------------------
# negative controls: the check must fail where the method was not applied

def test_check_fails_on_default_init():
    for model_type in ("llama", "gpt2", "gpt_neox"):
        model, reading = _read(model_type)
        failures = check_conditioned(model, reading, state_snapshot(model))
        assert any(" Q head " in f for f in failures), (model_type, failures)
        assert any(" K head " in f for f in failures), (model_type, failures)
        assert any(": V " in f for f in failures), (model_type, failures)


def test_check_fails_after_one_change_to_a_conditioned_model():
    model, reading = _read("bert")
    before = state_snapshot(model)
    apply_condinit(model)
    assert check_conditioned(model, reading, before) == []
    conditioned = state_snapshot(model)
    [r] = reading.attention
    params = dict(model.named_parameters())

    def fails_after(name, index, what):
        with torch.no_grad():
            params[name][index] += 1e-3
        failures = check_conditioned(model, reading, before)
        with torch.no_grad():
            params[name].copy_(conditioned[name])
        assert any(what in f for f in failures), (name, failures)

    q_row = r.q.heads[1][0]
    fails_after(r.q.weight, (q_row, 0), " Q head 1 ")
    fails_after(r.k.weight, (r.k.heads[0][3], 5), " K head 0 ")
    fails_after(r.v.weight, (r.v.heads[1][2], 7), ": V ")
    fails_after(r.q.biases[0][0], r.q.biases[0][1][0], " Q bias ")
    mlp = next(n for n in params if "intermediate" in n and n.endswith("weight"))
    fails_after(mlp, (0, 0), f"{mlp}: changed")
    assert check_conditioned(model, reading, before) == []
