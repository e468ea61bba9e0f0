"""condinit's kernel-backed ops, one subpackage per op family: ``attention`` (fused attention with
its JVP, VJP and tangent backward), ``orthogonalize`` (batched orthonormalization) and ``random``
(counter-based Gaussian streams). Each holds its public function, its autograd / torch.library glue
and its PyTorch reference; the Triton kernels are in ``kernels/<family>/`` and the C++/CUDA ones in
``csrc/<family>/``."""
