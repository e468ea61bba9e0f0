// Host emulation of the CUDA features the attention kernels use: one CTA at a time, one std::thread per
// CUDA thread, barriers for __syncthreads/__syncwarp, a per-warp exchange buffer for shuffles.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n)
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
inline thread_local Dim3 threadIdx, blockIdx, blockDim;
struct alignas(16) int4 { int x, y, z, w; };
inline int4 make_int4(int a, int b, int c, int d) { return int4{a, b, c, d}; }
typedef int cudaError_t;
typedef void* cudaStream_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9 };
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
inline int cudaGetDevice(int* d) { *d = 0; return 0; }
inline int cudaDeviceGetAttribute(int* v, cudaDeviceAttr, int) {
  const char* e = getenv("EMU_SMEM"); *v = e ? atoi(e) : 232448; return 0; }
template <class F> int cudaFuncSetAttribute(F, cudaFuncAttribute, int) { return 0; }
inline int cudaGetLastError() { return 0; }
inline const char* cudaGetErrorString(int) { return "emu"; }

struct EmuCTA {
  std::unique_ptr<std::barrier<>> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<float> xbuf;
  std::vector<unsigned char> smem;
};
inline EmuCTA* g_cta = nullptr;
inline unsigned char* mock_smem() {  // 128-byte aligned, like __align__(128) dynamic shared memory
  return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(g_cta->smem.data()) + 127) & ~uintptr_t(127));
}
inline void __syncthreads() { g_cta->block->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { g_cta->warps[threadIdx.x / 32]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float x, int o) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* buf = g_cta->xbuf.data() + w * 32;
  buf[lane] = x;
  __syncwarp();
  const float y = buf[lane ^ o];
  __syncwarp();
  return y;
}
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }

template <class K, class P>
void emu_launch(K kern, unsigned grid, unsigned block, size_t smem, cudaStream_t, const P& p) {
  if (block % 32) abort();
  for (unsigned b = 0; b < grid; ++b) {
    EmuCTA cta;
    cta.block = std::make_unique<std::barrier<>>(block);
    for (unsigned w = 0; w < block / 32; ++w) cta.warps.push_back(std::make_unique<std::barrier<>>(32));
    cta.xbuf.assign(block, 0.f);
    cta.smem.assign(smem + 128, 0xFF);  // garbage-ish (NaN pattern for floats) to catch reads of unwritten smem
    g_cta = &cta;
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < block; ++t)
      ts.emplace_back([&, t] { threadIdx.x = t; blockIdx.x = b; blockDim.x = block; kern(p); });
    for (auto& th : ts) th.join();
  }
}
