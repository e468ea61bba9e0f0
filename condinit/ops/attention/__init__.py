"""Fused attention with forward- and reverse-mode AD (the math: docs/design.md, "Attention").

* :func:`attention` — ``softmax(scale Q K^T) V`` as a differentiable op: reverse mode through the
  flash VJP from the saved log-sum-exp, forward mode through the fused JVP kernel; works under
  ``torch.func`` (jvp, vjp, jacfwd, jacrev, vmap) and ``torch.compile``.
* :func:`attention_jvp` — the single-pass fused JVP with several probes at once, differentiable
  in all six inputs.
* :func:`attention_varlen`, :func:`attention_jvp_varlen` — the same on packed variable-length
  sequences (FlashAttention's ``cu_seqlens`` layout).

Backends (``python -m condinit info``): cuda, triton, cpp-cpu, and the tiled PyTorch reference
(:mod:`condinit.ops.attention.reference`).
"""
from condinit.ops.attention.op import attention, attention_jvp
from condinit.ops.attention.varlen import attention_jvp_varlen, attention_varlen

__all__ = ["attention", "attention_jvp", "attention_varlen", "attention_jvp_varlen"]

