// The launch plan of the CUDA attention kernels: warps per block and dynamic shared memory of each
// KernelKind at a shared-memory limit (what the launchers run; also read by the emulator and by
// tests/test_gpu_resources.py).
#include "attention/attention_cuda.h"
#include "attention/cuda/launch.cuh"
#include "attention/cuda/tiles.cuh"

namespace condinit {
namespace attention_cuda {
namespace {

size_t plan_bytes(KernelKind kind, int elem, int dpad, int warps) {
  const bool simt = elem == 4;
  switch (kind) {
    case KernelKind::kFwd: return fwd_layout(KernelKind::kFwd, elem, dpad, 16 * warps, simt ? 32 : 64, simt).total;
    case KernelKind::kJvp: return fwd_layout(KernelKind::kJvp, elem, dpad, 16 * warps, simt ? 16 : 32, simt).total;
    case KernelKind::kDq: return fwd_layout(KernelKind::kDq, elem, dpad, 16 * warps, simt ? 32 : 64, simt).total;
    case KernelKind::kDkdv: return dkdv_layout(elem, dpad, 16 * warps, simt).total;
    case KernelKind::kJvpBwdR: return gen_layout(elem, dpad, 16 * warps, 2, simt ? 32 : 64, 2, 0, simt).total;
    case KernelKind::kJvpBwdQ: return gen_layout(elem, dpad, 16 * warps, 4, simt ? 16 : 32, 4, 0, simt).total;
    case KernelKind::kJvpBwdKv: return gen_layout(elem, dpad, 16 * warps, 4, kJbKvBm, 4, 4, simt).total;
  }
  return 0;
}

int loop_tile(KernelKind kind, int elem) {
  const bool simt = elem == 4;
  switch (kind) {
    case KernelKind::kFwd: return simt ? 32 : 64;
    case KernelKind::kJvp: return simt ? 16 : 32;
    case KernelKind::kDq: return simt ? 32 : 64;
    case KernelKind::kDkdv: return kDkdvBm;
    case KernelKind::kJvpBwdR: return simt ? 32 : 64;
    case KernelKind::kJvpBwdQ: return simt ? 16 : 32;
    case KernelKind::kJvpBwdKv: return kJbKvBm;
  }
  return 0;
}

}  // namespace

bool head_dim_supported(int64_t d) { return d >= 1 && d <= kMaxHeadDim; }

LaunchPlan launch_plan(KernelKind kind, DType dtype, int64_t d, size_t smem_limit) {
  const int elem = elem_size(dtype), dpad = pad16(d);
  LaunchPlan plan{0, 0, dpad, min_int(kCols, dpad), loop_tile(kind, elem)};
  for (int warps = kMaxWarps; warps >= 1; warps /= 2) {
    const size_t need = plan_bytes(kind, elem, dpad, warps);
    if (need <= smem_limit) {
      plan.warps = warps;
      plan.smem_bytes = need;
      break;
    }
  }
  return plan;
}

}  // namespace attention_cuda
}  // namespace condinit
