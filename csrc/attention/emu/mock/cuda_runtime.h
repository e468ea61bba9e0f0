// Host emulation of the CUDA features the attention kernels use: one CTA at a time, one fiber per CUDA
// thread, barriers for __syncthreads/__syncwarp, per-warp exchange buffers for shuffles and mma.sync
// (mma.h).
#pragma once
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <ucontext.h>
#include <vector>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n)
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
inline dim3 threadIdx, blockIdx, blockDim;  // set by the scheduler before it resumes a thread
struct alignas(16) int4 { int x, y, z, w; };
inline int4 make_int4(int a, int b, int c, int d) { return int4{a, b, c, d}; }
typedef int cudaError_t;
typedef void* cudaStream_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9, cudaErrorNotSupported = 801 };
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97, cudaDevAttrComputeCapabilityMajor = 75 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
inline int cudaGetDevice(int* d) { *d = 0; return 0; }
// EMU_SMEM: the emulated opt-in shared memory per block (default: sm_90's 227 KiB); EMU_ARCH_MAJOR.
inline int cudaDeviceGetAttribute(int* v, cudaDeviceAttr attr, int) {
  const char* e = getenv(attr == cudaDevAttrMaxSharedMemoryPerBlockOptin ? "EMU_SMEM" : "EMU_ARCH_MAJOR");
  *v = e ? atoi(e) : attr == cudaDevAttrMaxSharedMemoryPerBlockOptin ? 232448 : 9;
  return 0;
}
template <class F> int cudaFuncSetAttribute(F, cudaFuncAttribute, int) { return 0; }
inline int cudaGetLastError() { return 0; }
inline const char* cudaGetErrorString(int) { return "emu"; }
using std::isfinite;
inline float __int_as_float(int i) {
  float f;
  memcpy(&f, &i, 4);
  return f;
}
inline void __trap() { fprintf(stderr, "emulated kernel: __trap()\n"); abort(); }

// The threads of a CTA are fibers (ucontext) on the calling thread, switched at barriers only:
// a barrier is where a GPU thread may wait for others, and between barriers the order of threads
// does not matter to a correct kernel. A CTA whose threads all wait with none able to pass (a
// __syncthreads in divergent code) aborts with a message.
struct EmuBarrier {
  unsigned n = 0, count = 0;
  uint64_t gen = 0;
};
// cp.async copies of one thread (cp_async.h).
struct EmuCopy {
  void* dst;
  const void* src;
  int bytes;
};
struct EmuAsync {
  std::vector<EmuCopy> open;                 // issued, not committed
  std::vector<std::vector<EmuCopy>> groups;  // committed, oldest first
};
struct EmuCTA {
  EmuBarrier block;
  std::vector<EmuBarrier> warps;
  std::vector<float> xbuf;       // shuffles: one float per thread
  std::vector<uint32_t> mbuf;    // mma.sync: 6 registers per thread
  std::vector<const void*> pbuf; // ldmatrix: one row address per thread
  std::vector<unsigned char> smem;
  std::vector<EmuAsync> async;
  std::vector<ucontext_t> ctx;
  std::vector<char> done;
  std::vector<uint64_t> block_wait;  // per thread: the block barrier generation it waits for
  ucontext_t sched;
  unsigned current = 0;
  uint64_t progress = 0;
  void (*body)(void*) = nullptr;
  void* arg = nullptr;
};
inline EmuCTA* g_cta = nullptr;
inline unsigned char* emu_dynamic_smem() {  // 128-byte aligned, like __align__(128) dynamic shared memory
  return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(g_cta->smem.data()) + 127) & ~uintptr_t(127));
}
inline void emu_yield() { swapcontext(&g_cta->ctx[g_cta->current], &g_cta->sched); }
inline void emu_arrive(EmuBarrier& b) {
  const uint64_t gen = b.gen;
  ++g_cta->progress;
  if (++b.count == b.n) {
    b.count = 0;
    ++b.gen;
  } else {
    while (b.gen == gen) emu_yield();
  }
}
inline void __syncthreads() {
  g_cta->block_wait[g_cta->current] = g_cta->block.gen + 1;  // blocked until the barrier's next generation
  emu_arrive(g_cta->block);
}
inline void __syncwarp(unsigned = 0xffffffffu) { emu_arrive(g_cta->warps[threadIdx.x / 32]); }
inline float __shfl_xor_sync(unsigned, float x, int o) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* buf = g_cta->xbuf.data() + w * 32;
  buf[lane] = x;
  __syncwarp();
  const float y = buf[lane ^ o];
  __syncwarp();
  return y;
}

inline std::vector<char>& emu_stacks() {  // one stack per thread, shared by every launch
  static std::vector<char> stacks;
  return stacks;
}

inline void emu_fiber_entry() {
  g_cta->body(g_cta->arg);
  const EmuAsync& a = g_cta->async[g_cta->current];
  if (!a.open.empty() || !a.groups.empty()) {  // its data may land after the thread ended
    fprintf(stderr, "cp.async emulation: thread %u ended with copies it never waited for\n", g_cta->current);
    abort();
  }
  g_cta->done[g_cta->current] = 1;
  ++g_cta->progress;
}  // returns to uc_link = the scheduler

// kernel<<<grid, block, smem, stream>>>(p), one CTA after the other. Shared memory starts as 0xFF
// bytes (NaN as floats) so that a read of something never written shows up.
template <class K, class P>
void emu_launch(K kern, dim3 grid, unsigned block, size_t smem, cudaStream_t, const P& p) {
  if (block % 32 || block == 0 || block > 1024) abort();
  constexpr size_t kStack = 128 * 1024;
  std::vector<char>& stacks = emu_stacks();
  if (stacks.size() < block * kStack) stacks.assign(block * kStack, 0);
  struct Call {
    K kern;
    const P* p;
    static void run(void* self) { static_cast<Call*>(self)->kern(*static_cast<Call*>(self)->p); }
  } call{kern, &p};
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        EmuCTA cta;
        cta.block.n = block;
        cta.warps.assign(block / 32, EmuBarrier{});
        for (auto& w : cta.warps) w.n = 32;
        cta.xbuf.assign(block, 0.f);
        cta.mbuf.assign(block * 6, 0u);
        cta.pbuf.assign(block, nullptr);
        cta.smem.assign(smem + 128, 0xFF);
        cta.async.assign(block, EmuAsync{});
        cta.ctx.resize(block);
        cta.done.assign(block, 0);
        cta.block_wait.assign(block, 0);
        cta.body = &Call::run;
        cta.arg = &call;
        g_cta = &cta;
        blockIdx = dim3(x, y, z);
        blockDim = dim3(block, 1, 1);
        for (unsigned t = 0; t < block; ++t) {
          getcontext(&cta.ctx[t]);
          cta.ctx[t].uc_stack.ss_sp = stacks.data() + t * kStack;
          cta.ctx[t].uc_stack.ss_size = kStack;
          cta.ctx[t].uc_link = &cta.sched;
          makecontext(&cta.ctx[t], emu_fiber_entry, 0);
        }
        // Warp by warp: each warp runs until all its threads have ended or wait at __syncthreads, the
        // first warp changing with every block barrier. Warps thus run ahead of each other as far as
        // the block barriers allow (as they may on a GPU): a shared buffer overwritten, or a cp.async
        // issued into it, while another warp still reads it shows up as wrong data.
        unsigned remaining = block;
        const unsigned nwarps = block / 32;
        while (remaining > 0) {
          const uint64_t before = cta.progress;
          const unsigned first = (unsigned)(cta.block.gen % nwarps);
          for (unsigned k = 0; k < nwarps; ++k) {
            const unsigned w = (first + k) % nwarps;
            for (;;) {
              const uint64_t at = cta.progress;
              bool ran = false;
              for (unsigned t = 32 * w; t < 32 * w + 32; ++t) {
                if (cta.done[t] || cta.block_wait[t] > cta.block.gen) continue;
                cta.current = t;
                threadIdx = dim3(t, 0, 0);
                swapcontext(&cta.sched, &cta.ctx[t]);
                remaining -= cta.done[t];
                ran = true;
              }
              if (!ran || cta.progress == at) break;
            }
          }
          if (remaining > 0 && cta.progress == before) {
            fprintf(stderr, "emulated kernel: deadlock (threads wait at barriers no other thread reaches)\n");
            abort();
          }
        }
        g_cta = nullptr;
      }
}
