// CUDA registration of condinit_C::philox_randn (schema in randn_cpu.cpp; kernel in randn_kernels.cu).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "random/randn_cuda.h"

namespace {

void philox_randn_cuda(int64_t seed_lo, int64_t seed_hi, int64_t stream, const at::Tensor& block_ids, int64_t m,
                       int64_t n, at::Tensor out) {
  constexpr int64_t kU32 = int64_t(1) << 32;
  TORCH_CHECK(0 <= seed_lo && seed_lo < kU32 && 0 <= seed_hi && seed_hi < kU32,
              "philox_randn: seed_lo and seed_hi must be in [0, 2**32)");
  TORCH_CHECK(0 <= stream && stream < kU32, "philox_randn: stream must be in [0, 2**32)");
  TORCH_CHECK(m >= 1 && n >= 1, "philox_randn: m and n must be positive, got ", m, ", ", n);
  const int64_t mn = m * n;
  TORCH_CHECK((mn + 3) / 4 <= kU32, "philox_randn: a block holds at most 2**34 elements");
  TORCH_CHECK(block_ids.is_cuda() && out.is_cuda() && block_ids.device() == out.device(),
              "philox_randn: block_ids and out must be on the same CUDA device");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.dim() == 1,
              "philox_randn: block_ids must be a 1-D int64 tensor");
  const int64_t B = block_ids.numel();
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 3 && out.size(0) == B &&
                  out.size(1) == m && out.size(2) == n,
              "philox_randn: out must be a contiguous float32 tensor of shape [", B, ", ", m, ", ", n, "]");
  if (B == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const at::Tensor ids = block_ids.contiguous();
  const cudaError_t err = condinit::philox_randn_cuda_launch(
      (uint32_t)seed_lo, (uint32_t)seed_hi, (uint32_t)stream, ids.data_ptr<int64_t>(), B, mn, out.data_ptr<float>(),
      at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "philox_randn: CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace

TORCH_LIBRARY_IMPL(condinit_C, CUDA, m) { m.impl("philox_randn", &philox_randn_cuda); }
