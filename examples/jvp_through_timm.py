"""Forward-mode AD through a timm Vision Transformer with condinit.patch_sdpa.

timm's attention calls ``F.scaled_dot_product_attention``, whose fused kernels have no
forward-mode rule: ``torch.func.jvp`` through the model raises on the CPU. Inside
``condinit.patch_sdpa()`` the same call runs condinit's fused attention, which has one.

    python examples/jvp_through_timm.py
"""
import torch
from timm.models.vision_transformer import VisionTransformer

import condinit

torch.manual_seed(0)
model = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4,
                          num_classes=10).eval()
images = torch.randn(2, 3, 32, 32)
direction = torch.randn_like(images)       # the input perturbation to differentiate along

with condinit.patch_sdpa():
    logits, tangent = torch.func.jvp(model, (images,), (direction,))

print(f"logits {tuple(logits.shape)}, tangent norm {tangent.norm():.6f}")
