"""Triton kernels of condinit's fused attention: forward, multi-probe JVP, flash backward (VJP),
and the backward through the JVP's tangent output.

Per head (the math: docs/design.md, "Attention"), with ``s`` the softmax scale::

    S = s Q K^T (+ mask),  P = softmax(S),  O = P V,  lse = log rowsum(exp(S))

Conventions: q ``[B, H, Nq, d]``, k/v ``[B, Hkv, Nk, d]``, query head ``h`` reads KV head
``h // (H // Hkv)``; the masks are those of docs/design.md ("Attention", "Masks"). A query
row that sees no key gets ``O = 0``, ``O' = 0``, ``lse = -inf`` and zero gradients. Any head dim 1-256: tiles
are padded to ``BLOCK_D``, the next power of two (at least 16), with masked loads and stores.
Exponentials run in base 2 (``exp2``, the scale folded with ``log2 e``), ``lse`` is returned in
natural log. Loads are upcast to fp32 for elementwise math;
matrix products take fp16/bf16 operands with fp32 accumulators (``P~`` and ``P~ o S'`` rounded to
the input dtype before the product with V, as flash attention does; ``P~ o S'`` is formed from the
rounded ``P~``, which frees the fp32 ``P~`` registers early); fp32 inputs use IEEE fp32
products (no TF32). Under ``TRITON_INTERPRET=1`` the operands are rounded to the input dtype and
then upcast to fp32 (the interpreter has no bf16 arithmetic), so results match the GPU rounding.

Modules: :mod:`.tiles` (shared ``@triton.jit`` helpers and the masks of a tile), :mod:`.fwd`
(forward and JVP), :mod:`.bwd` (flash backward), :mod:`.jvp_bwd` (tangent backward),
:mod:`.configs` (launch configurations, autotuning, :func:`~.configs.launch`) and :mod:`.host`
(the host functions below, which check layouts and launch).
"""
from condinit.kernels.attention.host import attention_bwd, attention_fwd, attention_jvp, attention_jvp_bwd

__all__ = ["attention_fwd", "attention_bwd", "attention_jvp", "attention_jvp_bwd"]
