"""One own-init engine: ``condinit.apply`` on a meta-device model gives, for every tensor, the bytes
that the streamed writer (``condinit init --out``, ``write_pretrained``) writes with the same seed."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

import condinit  # noqa: E402
from condinit.models.stream import write_pretrained  # noqa: E402

# tiny configs, each with tied or untied heads, biases, norms and position tables of its family
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, vocab_size=300, tie_word_embeddings=False),
    "gpt2": lambda: transformers.GPT2Config(n_embd=48, n_layer=2, n_head=4, vocab_size=301, n_positions=32),
    "bert": lambda: transformers.BertConfig(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=300,
        max_position_embeddings=40),
    "t5": lambda: transformers.T5Config(
        d_model=48, d_kv=12, d_ff=96, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=300),
    "vit": lambda: transformers.ViTConfig(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, image_size=32,
        patch_size=8),
}
CLASSES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "bert": "BertForMaskedLM",
           "t5": "T5ForConditionalGeneration", "vit": "ViTModel"}


def _written(tmp_path, cfg, cls, seed) -> dict:
    rep = write_pretrained(cfg, tmp_path / "out", seed=seed, model_class=cls, max_shard_size="40KB")
    assert len(rep.files) > 1
    tensors = {}
    for path in rep.files:
        tensors.update(load_file(path))
    return tensors


def _on_meta(cfg, cls):
    with torch.device("meta"):
        return cls._from_config(cfg)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_apply_on_meta_gives_the_bytes_condinit_init_writes(tmp_path, family, seed):
    cfg, cls = CONFIGS[family](), getattr(transformers, CLASSES[family])
    written = _written(tmp_path, cfg, cls, seed)
    model = _on_meta(cfg, cls)
    assert condinit.apply(model, seed=seed, report=False).materialized
    sd = model.state_dict()
    assert set(written) <= set(sd)
    for k, t in written.items():
        assert sd[k].dtype == t.dtype and torch.equal(sd[k], t), k
    # a name the checkpoint leaves out is a tied copy of one it holds
    for k in set(sd) - set(written):
        assert any(sd[k].data_ptr() == sd[w].data_ptr() for w in written), k
    assert all(not t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def test_seed_drawn_from_torch_and_device_arguments(tmp_path):
    cfg, cls = CONFIGS["llama"](), transformers.LlamaForCausalLM
    torch.manual_seed(123)
    a = _on_meta(cfg, cls)
    drawn = condinit.apply(a, report=False).seed             # one draw from torch's generator
    torch.manual_seed(123)
    b = _on_meta(cfg, cls)
    assert condinit.apply(b, report=False, device="cpu").seed == drawn
    written = _written(tmp_path, cfg, cls, drawn)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], t) and torch.equal(sb[k], t) for k, t in written.items())
    other = _on_meta(cfg, cls)
    condinit.apply(other, seed=drawn + 1, report=False)
    k = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(other.state_dict()[k], sa[k])


def test_a_tensor_the_own_init_leaves_is_reported(monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel, LlamaRMSNorm

    real = LlamaPreTrainedModel._init_weights

    def forgets_norms(self, module):
        if not isinstance(module, LlamaRMSNorm):
            real(self, module)

    monkeypatch.setattr(LlamaPreTrainedModel, "_init_weights", forgets_norms)
    cfg, cls = CONFIGS["llama"](), transformers.LlamaForCausalLM
    with pytest.raises(ValueError, match=r"materialize: 5 tensor\(s\) .* not initialized .*input_layernorm.weight"):
        condinit.apply(_on_meta(cfg, cls), seed=0, report=False)
    model = _on_meta(cfg, cls)                         # unchecked: the norms are whatever memory held
    condinit.apply(model, seed=0, report=False, check_init=False)
    assert not model.model.norm.weight.is_meta
