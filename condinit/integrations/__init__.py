"""Hooks that let other libraries run condinit's attention (nothing here imports them until asked).

* :mod:`condinit.integrations.hf` -- :func:`condinit.register_hf_attention`: Hugging Face
  ``attn_implementation="condinit"``.

``torch.nn.functional.scaled_dot_product_attention`` itself is routed by
:func:`condinit.patch_sdpa` (:mod:`condinit.ops.attention.sdpa`).
"""
