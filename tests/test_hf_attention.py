"""attn_implementation="condinit" in Hugging Face transformers: tiny models built from configs give
the outputs of "eager", torch.func.jvp through the whole model matches a float64 reference, and
gradients of a loss on the tangent match; causal, sliding-window (Qwen2) and padding (BERT,
decoders) masks run on the fused op with O(N) attention memory."""
import ast
import pathlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import condinit
from condinit.ops.attention import sdpa as sdpa_module

from conftest import F64, assert_close, peak_extra_bytes

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

FP32 = torch.float32
HIDDEN = 32
_SMALL = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              vocab_size=50, max_position_embeddings=64)

# name -> (config class, model class, extra config); the decoders use GQA (2 kv heads for 4)
MODELS = {
    "llama": ("LlamaConfig", "LlamaModel", {"num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", "Qwen2Model", {"num_key_value_heads": 2}),
    "mistral-sliding-window": ("MistralConfig", "MistralModel", {"num_key_value_heads": 2, "sliding_window": 3}),
    "qwen2-sliding-window": ("Qwen2Config", "Qwen2Model", {"num_key_value_heads": 2, "use_sliding_window": True,
                                                           "sliding_window": 3, "max_window_layers": 0}),
    "bert": ("BertConfig", "BertModel", {}),
}


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert condinit.register_hf_attention() == "condinit"


def tiny(name, seed):
    """A tiny model of ``name`` with random weights from ``seed``, attention "condinit", eval mode."""
    config_cls, model_cls, extra = MODELS[name]
    config = getattr(transformers, config_cls)(**_SMALL, **extra)
    config._attn_implementation = "condinit"
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config).eval()


def hidden(model, embeds, mask=None):
    return model(inputs_embeds=embeds, attention_mask=mask).last_hidden_state


def padding(batch, n):
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[0, :2] = 0          # left padding in the first sequence
    return mask


def test_registration_is_idempotent_and_import_stays_lazy():
    """Registering twice is harmless; the modules that import condinit's integrations import no
    third-party library at module level (``import condinit`` and resolving every public name must
    not import transformers: those modules are all it loads)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from condinit.integrations import hf
    assert condinit.register_hf_attention() == "condinit"
    assert AttentionInterface._global_mapping["condinit"] is hf.hf_attention_forward
    assert AttentionMaskInterface._global_mapping["condinit"] is sdpa_mask
    for module in (hf, sdpa_module):
        tree = ast.parse(pathlib.Path(module.__file__).read_text())
        top = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import)
               for alias in node.names}
        top |= {node.module.split(".")[0] for node in tree.body
                if isinstance(node, ast.ImportFrom) and node.module}
        assert top <= {"__future__", "contextlib", "math", "threading", "typing", "torch",
                       "condinit"}, (module.__name__, top)


@pytest.mark.parametrize("name", list(MODELS))
def test_outputs_equal_eager(name, seed, monkeypatch):
    """Same weights, "condinit" vs "eager": equal hidden states without padding and on the real
    tokens with left padding (padded query rows that see no key differ by design: eager
    averages them, SDPA and condinit give 0). Causal masks, sliding windows and padding all run
    on the fused op."""
    model = tiny(name, seed)
    embeds = torch.randn(2, 8, HIDDEN, generator=torch.Generator().manual_seed(seed))
    fused_calls = []
    fused = sdpa_module.attention
    monkeypatch.setattr(sdpa_module, "attention", lambda *a, **kw: fused_calls.append(1) or fused(*a, **kw))
    with torch.no_grad():
        out = hidden(model, embeds)
        padded = hidden(model, embeds, padding(2, 8))
        model.set_attn_implementation("eager")
        out_eager = hidden(model, embeds)
        padded_eager = hidden(model, embeds, padding(2, 8))
    assert_close(out, out_eager, FP32, "no padding", factor=10)
    real = padding(2, 8).bool()
    assert_close(padded[real], padded_eager[real], FP32, "left padding", factor=10)
    assert fused_calls, "the model did not run the fused op"


@pytest.mark.parametrize("name,padded", [("llama", False), ("qwen2", False), ("bert", False),
                                         ("llama", True)])
def test_jvp_through_the_model_matches_float64(name, padded, seed):
    """torch.func.jvp of the last hidden state w.r.t. inputs_embeds in float32 against the same
    model in float64 on SDPA's MATH backend (PyTorch's only SDPA with forward AD)."""
    model = tiny(name, seed)
    gen = torch.Generator().manual_seed(seed)
    embeds, direction = torch.randn(2, 8, HIDDEN, generator=gen), torch.randn(2, 8, HIDDEN, generator=gen)
    mask = padding(2, 8) if padded else None
    out, tangent = torch.func.jvp(lambda e: hidden(model, e, mask), (embeds,), (direction,))
    model.double().set_attn_implementation("sdpa")
    with sdpa_kernel(SDPBackend.MATH):
        out_ref, tangent_ref = torch.func.jvp(lambda e: hidden(model, e, mask),
                                              (embeds.double(),), (direction.double(),))
    assert out_ref.dtype == F64
    assert_close(out, out_ref, FP32, "hidden", factor=10)
    assert_close(tangent, tangent_ref, FP32, "tangent", factor=10)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"softcap": 50.0}, ValueError, "softcap"),
    ({"s_aux": torch.zeros(4)}, ValueError, "s_aux"),
    ({"output_attentions": True}, ValueError, "output_attentions"),
    ({"dropout": 0.1}, NotImplementedError, "dropout_p"),
])
def test_unsupported_arguments_raise(kwargs, error, match):
    from condinit.integrations.hf import hf_attention_forward
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    module = torch.nn.Module()
    with pytest.raises(error, match=match):
        hf_attention_forward(module, q, k, v, None, **kwargs)
    out, weights = hf_attention_forward(module, q, k, v, None, softcap=None, sliding_window=None)
    assert out.shape == (1, 5, 4, 8) and weights is None


# ------------------------------------------------------------------------------------------------
# float64: forward, torch.func.jvp and gradients of a tangent loss to 1e-10
# ------------------------------------------------------------------------------------------------

def reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        is_causal=None, **kwargs):
    """A plain attention for transformers (registered as "reference"): the masks "sdpa" gets (a
    bool mask, or None with the module's causality), softmax in the input dtype, rows with no
    visible key 0 (so float64 stays float64, and fully masked rows give 0 and zero gradients;
    eager computes its softmax in float32, SDPA MATH's gradients there are NaN)."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    nq, nk = query.shape[2], key.shape[2]
    scores = (scaling if scaling is not None else query.shape[-1] ** -0.5) * query @ key.transpose(-1, -2)
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        attention_mask = (torch.arange(nk) <= torch.arange(nq)[:, None]) if causal and nq > 1 else \
            torch.ones(nq, nk, dtype=torch.bool)
    seen = attention_mask.any(-1, keepdim=True)
    scores = torch.where(attention_mask, scores, float("-inf"))
    weights = torch.softmax(torch.where(seen, scores, 0.0), -1) * seen
    return (weights @ value).transpose(1, 2).contiguous(), None


def right_padding(batch, n):
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[1, n - 3:] = 0
    return mask


F64_CASES = [("llama", None), ("qwen2-sliding-window", None), ("qwen2-sliding-window", "left"),
             ("bert", "right"), ("bert", "left")]


@pytest.mark.parametrize("name,pad", F64_CASES, ids=[f"{n}-{p or 'nopad'}" for n, p in F64_CASES])
def test_float64_forward_jvp_and_tangent_gradients_equal_eager(name, pad, seed, monkeypatch):
    """In float64, "condinit" against :func:`reference_attention` (plain float64 ops, the N x N
    mask) on the same weights: the hidden states, the torch.func.jvp tangent of the whole model
    w.r.t. inputs_embeds, and the gradient of ||tangent||^2 w.r.t. the embeddings and every
    weight (torch.func.grad over torch.func.jvp) agree to 1e-10 on the real tokens; no call took
    the dense path. Against "eager" to 1e-6 only: transformers' eager attention computes its
    softmax in float32 even for a float64 model (and with left padding and a sliding window its
    output is NaN, so that case is not compared with it)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register("reference", reference_attention)
    AttentionMaskInterface.register("reference", sdpa_mask)
    model = tiny(name, seed).double()
    gen = torch.Generator().manual_seed(seed)
    n = 12
    embeds = torch.randn(2, n, HIDDEN, generator=gen, dtype=F64)
    direction = torch.randn(2, n, HIDDEN, generator=gen, dtype=F64)
    mask = {None: None, "left": padding(2, n), "right": right_padding(2, n)}[pad]
    real = mask.bool() if mask is not None else torch.ones(2, n, dtype=torch.bool)
    params = dict(model.named_parameters())

    def tangent_loss(params, e):
        f = lambda x: torch.func.functional_call(model, params, (), {"inputs_embeds": x,  # noqa: E731
                                                                       "attention_mask": mask}).last_hidden_state
        out, tangent = torch.func.jvp(f, (e,), (direction,))
        return (tangent[real] ** 2).sum(), (out, tangent)

    dense_calls = []
    dense = sdpa_module._attention_dense
    monkeypatch.setattr(sdpa_module, "_attention_dense", lambda *a, **kw: dense_calls.append(1) or dense(*a, **kw))
    grads, (out, tangent) = torch.func.grad(tangent_loss, argnums=(0, 1), has_aux=True)(params, embeds)
    assert not dense_calls, "a mask took the dense path"
    model.set_attn_implementation("reference")
    grads_ref, (out_ref, tangent_ref) = torch.func.grad(tangent_loss, argnums=(0, 1), has_aux=True)(params, embeds)
    if not (pad == "left" and "sliding" in name):   # eager gives NaN there (its own mask handling)
        model.set_attn_implementation("eager")
        _, (out_eager, tangent_eager) = tangent_loss(params, embeds)
        assert_close(out[real], out_eager[real], F64, "hidden vs eager", factor=1e4)
        assert_close(tangent[real], tangent_eager[real], F64, "tangent vs eager", factor=1e4)
    assert_close(out[real], out_ref[real], F64, "hidden")
    assert_close(tangent[real], tangent_ref[real], F64, "tangent")
    assert_close(grads[1], grads_ref[1], F64, "d loss / d embeds")
    # A weight whose exact gradient is 0 (a key bias: softmax ignores a shift shared by a row)
    # gets rounding noise: errors are measured against the model's largest weight gradient.
    floor = max(g.abs().max().item() for g in grads_ref[0].values())
    for key in grads[0]:
        assert_close(grads[0][key], grads_ref[0][key], F64, f"d loss / d {key}", floor)


# ------------------------------------------------------------------------------------------------
# memory: torch.func.jvp through a tiny Llama holds O(N) attention memory
# ------------------------------------------------------------------------------------------------

def _jvp_peak_bytes(model, N, seed):
    gen = torch.Generator().manual_seed(seed)
    embeds, direction = torch.randn(1, N, HIDDEN, generator=gen), torch.randn(1, N, HIDDEN, generator=gen)
    with torch.no_grad():
        return peak_extra_bytes(lambda: torch.func.jvp(lambda e: hidden(model, e), (embeds,), (direction,)))


@pytest.mark.slow
def test_jvp_through_llama_holds_linear_attention_memory(seed):
    """torch.func.jvp through a tiny Llama: with "condinit" the peak memory grows about 2x from
    N = 1024 to 2048 (linear) and N = 4096 runs; with "eager" (the only other route with forward
    AD, the N x N attention materialized) it grows about 4x and is many times larger."""
    model = tiny("llama", seed)
    small, big = _jvp_peak_bytes(model, 1024, seed), _jvp_peak_bytes(model, 2048, seed)
    largest = _jvp_peak_bytes(model, 4096, seed)
    model.set_attn_implementation("eager")
    eager_small, eager_big = _jvp_peak_bytes(model, 1024, seed), _jvp_peak_bytes(model, 2048, seed)
    assert big / small < 2.6, f"condinit: {small} B at N=1024, {big} B at N=2048"
    assert largest / big < 2.6, f"condinit: {big} B at N=2048, {largest} B at N=4096"
    assert eager_big / eager_small > 3.2, f"eager: {eager_small} B at N=1024, {eager_big} B at N=2048"
    assert eager_big > 10 * big, f"eager {eager_big} B vs condinit {big} B at N=2048"


def test_packed_sequences_from_flattening_kwargs(seed):
    """Packed sequences as transformers' flattening collators pass them (batch 1, cu_seq_lens_q/k,
    max_length_q/k, no mask) run attention_varlen: each sequence attends only itself, causally,
    with the sliding window when given."""
    from condinit.integrations.hf import hf_attention_forward
    gen = torch.Generator().manual_seed(seed)
    lens = [1, 5, 9]
    cu = torch.tensor([0, 1, 6, 15], dtype=torch.int32)
    q = torch.randn(1, 4, 15, 8, generator=gen, dtype=F64)
    k, v = (torch.randn(1, 2, 15, 8, generator=gen, dtype=F64) for _ in range(2))
    module = torch.nn.Module()
    for window in (None, 3):
        out, _ = hf_attention_forward(module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                      max_length_q=9, max_length_k=9, sliding_window=window)
        assert out.shape == (1, 15, 4, 8)
        for s, n in enumerate(lens):
            a, b = int(cu[s]), int(cu[s + 1])
            i, j = torch.arange(n)[:, None], torch.arange(n)
            mask = (j <= i) & ((j > i - window) if window else True)
            kk, vv = k[:, :, a:b].repeat_interleave(2, 1), v[:, :, a:b].repeat_interleave(2, 1)
            scores = (0.3 * q[:, :, a:b] @ kk.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
            ref = (torch.softmax(scores, -1) @ vv).transpose(1, 2)
            assert_close(out[:, a:b], ref, F64, f"sequence {s}, window {window}")
