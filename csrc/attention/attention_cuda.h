// Launchers of the CUDA attention kernels: raw pointers only, no torch, so the .cu files compile
// without ATen (and as host C++ in the emulator, csrc/attention/emu). attention_cuda.cpp checks the
// tensors and calls these.
//
// Sources (FlashAttention-2 style): cuda/primitives.cuh (dtype helpers, PTX wrappers), cuda/tiles.cuh
// (warp tile products, tile loads, shared-memory layouts), cuda/mask.cuh (geometry and masks),
// cuda/{fwd,bwd,jvp_bwd}_kernel.cuh (the kernels), cuda/launch.cuh (host launch helpers), and the
// translation units attention_fwd.cu, attention_bwd.cu, attention_jvp_bwd.cu (launchers) and
// launch_plan.cu (launch_plan; the kernels are named by KernelKind, kernel_kind.h).
//
// Layouts (all contiguous, element offsets in int64): q, out [B, H, Nq, d]; k, v [B, Hkv, Nk, d];
// tq, tout [P, B, H, Nq, d]; tk, tv [P, B, Hkv, Nk, d]; lse, Dvec [B, H, Nq] float32; q_lens, kv_lens
// int32 [B] in device memory, or null. Any head dim 1..256 (padded to a multiple of 16 inside the
// kernels). Tensor pointers must be 16-byte aligned when d * sizeof(element) is a multiple of 16
// (the kernels then read 16-byte vectors; otherwise element by element).
//
// Masks: causal, window_left / window_right and the lens of Shape, as docs/design.md ("Attention",
// "Masks") states them.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "attention/kernel_kind.h"

namespace condinit {
namespace attention_cuda {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct Shape {
  int64_t B, H, Hkv, Nq, Nk, d;
  bool causal;
  float scale;
  int64_t window_left = -1, window_right = -1;  // -1: unbounded
  const int* q_lens = nullptr;                  // device int32 [B] or null
  const int* kv_lens = nullptr;
};

constexpr int64_t kMaxHeadDim = 256;

// 1 <= d <= kMaxHeadDim.
bool head_dim_supported(int64_t d);

// What a launcher runs for one kernel at a per-block shared-memory limit: warps per block (0:
// nothing fits), dynamic shared memory, the padded head dim, output columns per block and the tile
// along the looped sequence. Exposed for the offline resource checks (tests/test_gpu_resources.py)
// and the static model in BENCHMARKS.md.
struct LaunchPlan {
  int warps;
  size_t smem_bytes;
  int dpad, cols_per_block, loop_tile;
};
LaunchPlan launch_plan(KernelKind kind, DType dtype, int64_t d, size_t smem_limit);

// out = softmax(s q k^T + mask) v, lse = log rowsum exp(s q k^T + mask) (fp32 math).
cudaError_t fwd(DType dtype, const Shape& s, const void* q, const void* k, const void* v, void* out, float* lse,
                cudaStream_t stream);

// Forward plus the tangents of P >= 1 probes. Each probe runs in its own blocks (its accumulators
// stay in registers); the primal outputs come from the probe-0 blocks.
cudaError_t jvp(DType dtype, const Shape& s, int64_t P, const void* q, const void* k, const void* v, const void* tq,
                const void* tk, const void* tv, void* out, void* tout, float* lse, cudaStream_t stream);

// Flash backward, deterministic (no atomics): one kernel writes dq (one block per query tile,
// looping over keys), another dk, dv (one block per key tile, looping over the queries of every
// head of its GQA group). Dvec = rowsum(dout o out) in fp32 (computed by the caller). All outputs
// (input dtype) are fully written.
cudaError_t bwd(DType dtype, const Shape& s, const void* dout, const void* q, const void* k, const void* v,
                const float* lse, const float* Dvec, void* dq, void* dk, void* dv, cudaStream_t stream);

// Tangent backward (attention_jvp_bwd), in two steps with the caller in between:
// 1. jvp_bwd_r: r [P, B, H, Nq] fp32, r_p = rowsum(P o S'_p) (P = exp(s q k^T - lse), S'_p the
//    probe's score tangent), one block per query tile and probe.
// 2. the caller computes dprime_p = rowsum(gtout_p o out) [P, B, H, Nq] and
//    D = rowsum(gout o out) + sum_p (rowsum(gtout_p o tout_p) - r_p dprime_p) [B, H, Nq] (fp32),
//    then jvp_bwd writes dq, dk, dv, dtq, dtk, dtv (input dtype, fully), deterministically: one block
//    per (query tile | key tile, output: the primal gradient or one probe's, output-column chunk).
struct JvpBwdPointers {
  const void *gout, *gtout, *q, *k, *v, *tq, *tk, *tv;
  const float *lse, *r, *dprime, *D;
  void *dq, *dk, *dv, *dtq, *dtk, *dtv;
};
cudaError_t jvp_bwd_r(DType dtype, const Shape& s, int64_t P, const void* q, const void* k, const void* tq,
                      const void* tk, const float* lse, float* r, cudaStream_t stream);
cudaError_t jvp_bwd(DType dtype, const Shape& s, int64_t P, const JvpBwdPointers& a, cudaStream_t stream);

}  // namespace attention_cuda
}  // namespace condinit
