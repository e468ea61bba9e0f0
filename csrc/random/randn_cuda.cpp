// CUDA registration of condinit_C::philox_randn (schema in randn_cpu.cpp; kernel in randn_kernels.cu).
// Light headers only (c10 stream and guard): no CUDAContext.h, whose cuBLAS / cuSPARSE / cuSOLVER
// headers a minimal CUDA toolkit may lack.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "random/randn_checks.h"
#include "random/randn_cuda.h"

namespace {

void philox_randn_cuda(int64_t seed_lo, int64_t seed_hi, int64_t stream, const at::Tensor& block_ids, int64_t m,
                       int64_t n, at::Tensor out) {
  TORCH_CHECK(block_ids.is_cuda() && out.is_cuda() && block_ids.device() == out.device(),
              "philox_randn: block_ids and out must be on the same CUDA device");
  const int64_t B = condinit::check_philox_randn_args(seed_lo, seed_hi, stream, block_ids, m, n, out);
  const int64_t mn = m * n;
  if (B == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const at::Tensor ids = block_ids.contiguous();
  const cudaError_t err = condinit::philox_randn_cuda_launch(
      (uint32_t)seed_lo, (uint32_t)seed_hi, (uint32_t)stream, ids.data_ptr<int64_t>(), B, mn, out.data_ptr<float>(),
      c10::cuda::getCurrentCUDAStream(out.device().index()).stream());
  TORCH_CHECK(err == cudaSuccess, "philox_randn: CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace

TORCH_LIBRARY_IMPL(condinit_C, CUDA, m) { m.impl("philox_randn", &philox_randn_cuda); }
