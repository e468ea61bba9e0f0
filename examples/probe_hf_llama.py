"""The conditioning of a Hugging Face Llama's attention Jacobians, layer by layer.

Each layer's input (and the rotary embeddings it is called with) is captured during one forward
pass; ``condinit.JacobianOperator`` is then the Jacobian of the attention that layer computes
(RoPE, GQA, its scale and causal mask), applied by condinit's fused JVP / VJP kernels, and
Golub-Kahan-Lanczos estimates its extreme singular values.

    python examples/probe_hf_llama.py
"""
import torch
from transformers import LlamaConfig, LlamaModel

import condinit
from condinit.probe import InputCapture
from condinit.probe.capture import layer_position_embeddings


def probe(model, input_ids, steps: int = 20, seed: int = 0):
    """``[(layer name, estimate)]`` for every attention layer of ``model`` on ``input_ids``."""
    layers = condinit.models.find_attention(model)
    seen = {}

    def keep(i, module, x, call):
        if i not in seen and x is not None:
            seen[i] = (x.clone(), layer_position_embeddings(module, *call))

    with InputCapture([l.module for l in layers], on_input=keep, call_info=True), torch.no_grad():
        model(input_ids=input_ids)
    out = []
    for i, layer in enumerate(layers):
        x, pe = seen[i]
        op = condinit.JacobianOperator(layer.module, x, wrt="weights", causal=True, position_embeddings=pe)
        out.append((layer.name, condinit.condition_number(op, steps=steps, seed=seed)))
    return out


if __name__ == "__main__":
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, max_position_embeddings=128)
    model = LlamaModel(config).eval()
    condinit.apply(model, seed=0, report=False)          # the conditioned init, for comparison
    ids = torch.randint(0, config.vocab_size, (2, 32))
    for name, est in probe(model, ids):
        print(f"{name}: sigma_max {est.sigma_max:.4e}  sigma_min {est.sigma_min:.4e}  kappa {est.kappa:.4e}")
