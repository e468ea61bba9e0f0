// Launchers of the CUDA attention kernels (attention_kernels.cu). Light header: raw pointers only, no
// torch, so the .cu compiles without ATen. attention_cuda.cpp checks the tensors and calls these.
//
// Layouts (all contiguous, element offsets in int64): q, out [B, H, Nq, d]; k, v [B, Hkv, Nk, d];
// tq, tout [P, B, H, Nq, d]; tk, tv [P, B, Hkv, Nk, d]; lse, Dvec [B, H, Nq] float32.
// Every tensor pointer must be 16-byte aligned. d must satisfy head_dim_supported().
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace condinit {
namespace attention_cuda {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct Shape {
  int64_t B, H, Hkv, Nq, Nk, d;
  bool causal;
  float scale;
};

// d in {16, 32, 64, 80, 96, 128, 256}.
bool head_dim_supported(int64_t d);

// out = softmax(s q k^T) v, lse = log rowsum exp(s q k^T) (fp32 math).
cudaError_t fwd(DType dtype, const Shape& s, const void* q, const void* k, const void* v, void* out, float* lse,
                cudaStream_t stream);

// Floats of scratch the JVP needs for P probes (per-probe fp32 accumulators). No initialization needed.
int64_t jvp_workspace_floats(const Shape& s, int64_t P);

// Forward plus the tangents of P probes in one pass (the probes share the primal tiles).
cudaError_t jvp(DType dtype, const Shape& s, int64_t P, const void* q, const void* k, const void* v, const void* tq,
                const void* tk, const void* tv, void* out, void* tout, float* lse, float* workspace,
                cudaStream_t stream);

// Flash backward. Dvec = rowsum(dout o out) in fp32 (computed by the caller). dq_acc: fp32 [B, H, Nq, d],
// zeroed by the caller; receives dq (already multiplied by the scale) through atomic adds.
// dk, dv (input dtype) are fully written, summed over the query heads of each GQA group.
cudaError_t bwd(DType dtype, const Shape& s, const void* dout, const void* q, const void* k, const void* v,
                const float* lse, const float* Dvec, float* dq_acc, void* dk, void* dv, cudaStream_t stream);

}  // namespace attention_cuda
}  // namespace condinit
