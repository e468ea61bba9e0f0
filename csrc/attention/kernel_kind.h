// The kernels of the CUDA attention op, as launch_plan (attention_cuda.h) takes them. The emulator
// (emu/run_emu.py) and tests/test_gpu_resources.py read this enum from this file.
#pragma once

namespace condinit {
namespace attention_cuda {

enum class KernelKind : int {
  kFwd = 0,       // forward (fwd_kernel.cuh)
  kJvp = 1,       // forward + one probe's tangent (fwd_kernel.cuh)
  kDq = 2,        // backward: dq (bwd_kernel.cuh)
  kDkdv = 3,      // backward: dk, dv (bwd_kernel.cuh)
  kJvpBwdR = 4,   // tangent backward: r = rowsum(P o S') per probe (jvp_bwd_kernel.cuh)
  kJvpBwdQ = 5,   // tangent backward: query side (jvp_bwd_kernel.cuh)
  kJvpBwdKv = 6,  // tangent backward: key side (jvp_bwd_kernel.cuh)
};
constexpr int kNumKernelKinds = 7;

}  // namespace attention_cuda
}  // namespace condinit
