// Host helpers of the CUDA attention launchers: the device's limits, the kernels' geometry from a
// Shape, the checked launch plan and grid of one kernel, and the dynamic shared-memory opt-in.
#pragma once

#include "attention/attention_cuda.h"
#include "attention/cuda/mask.cuh"
#include "attention/cuda/tiles.cuh"

namespace condinit {
namespace attention_cuda {
namespace {

int elem_size(DType dt) { return dt == DType::kFloat32 ? 4 : 2; }

struct DeviceInfo {
  int smem_optin, major;
};
DeviceInfo device_info() {
  int dev = 0, smem = 48 * 1024, major = 0;
  if (cudaGetDevice(&dev) == cudaSuccess) {
    if (cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) smem = 48 * 1024;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) major = 0;
  }
  return DeviceInfo{smem, major};
}

Geometry geometry_of(const Shape& s) {
  Geometry g;
  g.B = s.B;
  g.H = s.H;
  g.Hkv = s.Hkv;
  g.Nq = s.Nq;
  g.Nk = s.Nk;
  g.d = (int)s.d;
  g.dpad = pad16(s.d);
  g.nchunks = (g.dpad + kCols - 1) / kCols;
  g.window_left = s.window_left;
  g.window_right = s.window_right;
  g.causal = s.causal;
  g.scale = s.scale;
  g.q_lens = s.q_lens;
  g.kv_lens = s.kv_lens;
  return g;
}

// The plan for one launch on the current device, or an error: unsupported head dim, a 16-bit dtype
// below sm_80 (no bf16/fp16 mma.sync), nothing fits the shared memory, a grid too large.
cudaError_t plan_launch(KernelKind kind, DType dt, const Shape& s, int64_t rows_total, int64_t heads, int64_t zdim,
                        LaunchPlan& plan, dim3& grid) {
  if (!head_dim_supported(s.d)) return cudaErrorInvalidValue;
  const DeviceInfo dev = device_info();
  if (dt != DType::kFloat32 && dev.major < 8) return cudaErrorNotSupported;
  plan = launch_plan(kind, dt, s.d, (size_t)dev.smem_optin);
  if (plan.warps == 0) return cudaErrorInvalidConfiguration;
  const int64_t tiles = (rows_total + 16 * plan.warps - 1) / (16 * plan.warps) * heads;
  if (tiles > 0x7fffffff || zdim > 65535) return cudaErrorInvalidConfiguration;
  grid = dim3((unsigned)tiles, 1, (unsigned)zdim);
  return cudaSuccess;
}

template <typename K>
cudaError_t set_smem(K kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

}  // namespace
}  // namespace attention_cuda
}  // namespace condinit
