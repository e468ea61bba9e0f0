"""Small Transformers for ``condinit demo``, built on ``torch.nn.MultiheadAttention``.

``nn.MultiheadAttention`` is the attention module every init in :mod:`condinit.demo.inits` can
address (``condinit.apply`` has a built-in adapter for it; its fused ``in_proj_weight`` holds
``[W_Q; W_K; W_V]`` in ``nn.Linear``'s ``[out, in]`` layout). Blocks are pre-LayerNorm
(``x + attn(LN(x))``, ``x + mlp(LN(x))``) as in ViT / GPT-2, so every attention layer sees a
LayerNorm'd input ``X`` and the Jacobian probe in :mod:`condinit.demo.train` can capture it.

* :class:`TinyViT`: 8x8 images cut into 2x2 patches (16 tokens) plus a class token.
* :class:`TinyLM`: token + learned position embeddings, per-position logits; with ``causal=True``
  (the default) a causal mask (next-token prediction), else bidirectional attention (masked-token
  prediction, BERT-style).
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["Block", "TinyViT", "TinyLM", "TinyCausalLM", "attention_modules"]


class Block(nn.Module):
    """Pre-LN Transformer block: ``x + W_O A(LN(x))`` then ``x + MLP(LN(x))``."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: int = 2, causal: bool = False):
        super().__init__()
        self.causal = causal
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, num_heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        mask = None
        if self.causal:
            n = x.shape[1]
            mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu_(1)  # True = not allowed
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """A ViT for 8x8 single-channel images: 2x2 patches -> 16 tokens + [CLS], ``depth`` blocks."""

    def __init__(self, *, image_size: int = 8, patch_size: int = 2, in_chans: int = 1, num_classes: int = 10,
                 dim: int = 32, depth: int = 2, num_heads: int = 2, mlp_ratio: int = 2):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"patch_size ({patch_size}) must divide image_size ({image_size})")
        self.patch_size = patch_size
        n_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Linear(in_chans * patch_size * patch_size, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, n_patches + 1, dim))
        self.blocks = nn.ModuleList(Block(dim, num_heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, images):
        b, c, hgt, wid = images.shape
        p = self.patch_size
        patches = images.unfold(2, p, p).unfold(3, p, p)               # b, c, h/p, w/p, p, p
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(b, (hgt // p) * (wid // p), c * p * p)
        x = torch.cat([self.cls_token.expand(b, -1, -1), self.patch_embed(patches)], dim=1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x[:, 0]))


class TinyLM(nn.Module):
    """Token + learned position embeddings, ``depth`` blocks, untied LM head: a GPT-style decoder
    (``causal=True``) or a BERT-style encoder (``causal=False``)."""

    def __init__(self, *, vocab_size: int, max_len: int, dim: int = 64, depth: int = 2, num_heads: int = 2,
                 mlp_ratio: int = 2, causal: bool = True):
        super().__init__()
        self.causal = causal
        self.tok_embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, max_len, dim))
        self.blocks = nn.ModuleList(Block(dim, num_heads, mlp_ratio, causal=causal) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens):
        x = self.tok_embed(tokens) + self.pos_embed[:, : tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


TinyCausalLM = TinyLM


def attention_modules(model: nn.Module) -> list[nn.MultiheadAttention]:
    """The model's attention modules in layer order (the order ``condinit.apply`` numbers them)."""
    return [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
