"""A MeanFlow-style training step: the loss uses the JVP's tangent, so training differentiates
through forward-mode AD of every attention layer.

MeanFlow and consistency models regress a network's output *and* its directional derivative
``d/dt u(z_t, t)`` (computed with ``torch.func.jvp``) onto targets. With
``F.scaled_dot_product_attention`` that JVP has no fused kernel; inside ``condinit.patch_sdpa()``
timm's attention runs condinit's fused attention, whose forward-mode rule is differentiable
(the tangent backward, O(N) memory).

    python examples/meanflow_step.py
"""
import torch
from timm.models.vision_transformer import VisionTransformer

import condinit


def meanflow_loss(model, z, dz, target_u, target_du):
    """``||u - target_u||^2 + ||du - target_du||^2`` with ``(u, du) = jvp(model, z, dz)``."""
    u, du = torch.func.jvp(model, (z,), (dz,))
    return ((u - target_u) ** 2).mean() + ((du - target_du) ** 2).mean()


def main(steps: int = 3, seed: int = 0) -> list[float]:
    torch.manual_seed(seed)
    # a tiny ViT as the velocity network: image in, 10 numbers out (a stand-in for a DiT)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    z, dz = torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32)
    target_u, target_du = torch.randn(4, 10), torch.randn(4, 10)
    losses = []
    with condinit.patch_sdpa():
        for _ in range(steps):
            opt.zero_grad()
            loss = meanflow_loss(model, z, dz, target_u, target_du)
            loss.backward()          # gradients through the tangent: condinit's tangent backward
            opt.step()
            losses.append(loss.item())
    return losses


if __name__ == "__main__":
    for i, loss in enumerate(main()):
        print(f"step {i}: loss {loss:.6f}")
