"""attn_implementation="condinit" in Hugging Face transformers: tiny models built from configs give
the outputs of "eager", and torch.func.jvp through the whole model matches a float64 reference."""
import ast
import pathlib
import runpy

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import condinit
from condinit.ops.attention import sdpa as sdpa_module

from conftest import F64, assert_close

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = pathlib.Path(__file__).resolve().parents[1]
FP32 = torch.float32
HIDDEN = 32
_SMALL = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              vocab_size=50, max_position_embeddings=64)

# name -> (config class, model class, extra config); the decoders use GQA (2 kv heads for 4)
MODELS = {
    "llama": ("LlamaConfig", "LlamaModel", {"num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", "Qwen2Model", {"num_key_value_heads": 2}),
    "mistral-sliding-window": ("MistralConfig", "MistralModel", {"num_key_value_heads": 2, "sliding_window": 3}),
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
    """Same weights, "condinit" vs "eager": equal hidden states without padding (the decoders'
    causal mask and BERT's full attention take the fused op) and on the real tokens with left
    padding (a bool mask: the dense path; padded query rows that see no key differ by design:
    eager averages them, SDPA and condinit give 0)."""
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
    if "sliding" not in name:      # a window shorter than the sequence is a mask: dense path
        assert fused_calls, "the unmasked model did not run the fused op"


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


def test_llama_example_runs(capsys):
    """examples/jvp_through_llama.py runs as a script (in this process: a fresh interpreter would
    spend most of the time importing transformers again)."""
    runpy.run_path(str(ROOT / "examples" / "jvp_through_llama.py"), run_name="__main__")
    assert "tangent norm" in capsys.readouterr().out
