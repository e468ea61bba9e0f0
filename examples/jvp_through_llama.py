"""Forward-mode AD through a Hugging Face Llama with attn_implementation="condinit".

``torch.func.jvp`` of the last hidden state with respect to the input embeddings: the
directional derivative of the whole model along one input direction, in one forward pass, with
condinit's fused attention JVP in every layer (O(N) memory in the attention).

    python examples/jvp_through_llama.py
"""
import torch
from transformers import LlamaConfig, LlamaModel

import condinit

condinit.register_hf_attention()     # makes attn_implementation="condinit" available
torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                     max_position_embeddings=128)
config._attn_implementation = "condinit"
model = LlamaModel(config).eval()

embeds = torch.randn(2, 16, config.hidden_size)
direction = torch.randn_like(embeds)

hidden, tangent = torch.func.jvp(lambda e: model(inputs_embeds=e).last_hidden_state,
                                 (embeds,), (direction,))
print(f"hidden {tuple(hidden.shape)}, tangent norm {tangent.norm():.6f}")
