// CUDA primitives of the attention kernels: dtype conversions, packed 16-bit operands, quad shuffles
// and the PTX wrappers (mma.sync.m16n8k16, ldmatrix, cp.async), with the emulator's replacements.
//
// fp16 / bf16 products are mma.sync.m16n8k16 with fp32 accumulation (sm_80+); fp32 products are
// fp32 FMAs (exact fp32, no TF32). Under CONDINIT_ATTN_EMU (csrc/attention/emu) the launch, the
// dynamic shared memory, mma.sync, ldmatrix and cp.async go through the mock headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef CONDINIT_ATTN_EMU
// The CPU emulator (csrc/attention/emu): mock mma.sync and launch.
#include "cp_async.h"
#include "mma.h"
#define CONDINIT_DYNAMIC_SMEM(name) unsigned char* name = emu_dynamic_smem()
#define CONDINIT_LAUNCH(kernel, grid, block, smem, stream, params) emu_launch(kernel, grid, block, smem, stream, params)
#else
#define CONDINIT_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#define CONDINIT_LAUNCH(kernel, grid, block, smem, stream, params) kernel<<<grid, block, smem, stream>>>(params)
#endif

namespace condinit {
namespace attention_cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -__builtin_huge_valf();
constexpr int kCols = 128;     // output columns per block (accumulator width in registers)
constexpr int kMaxWarps = 4;   // rows per block: 16 per warp

// ------------------------------------------------------------------------------------------------
// dtype helpers

template <typename T>
struct Cvt;
template <>
struct Cvt<float> {
  static __device__ __forceinline__ float to_f(float x) { return x; }
  static __device__ __forceinline__ float from_f(float x) { return x; }
};
template <>
struct Cvt<__half> {
  static __device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_f(float x) { return __float2half_rn(x); }
};
template <>
struct Cvt<__nv_bfloat16> {
  static __device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_f(float x) { return __float2bfloat16_rn(x); }
};

template <typename T>
constexpr bool kSimt = std::is_same<T, float>::value;  // fp32: FMA products, no tensor cores

// x rounded to T and back (what a 16-bit product operand holds).
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return Cvt<T>::to_f(Cvt<T>::from_f(x));
}

template <typename T>
__device__ __forceinline__ uint32_t bits16(T x) {
  uint16_t u;
  memcpy(&u, &x, 2);
  return u;
}
// Two values packed as a 32-bit mma operand register: the lower index in the lower half.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return bits16(Cvt<T>::from_f(lo)) | (bits16(Cvt<T>::from_f(hi)) << 16);
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// D = A B + D for one m16n8k16 tile, A row-major (4 registers), B column-major (2 registers), fp32
// accumulators; register layouts as in the PTX ISA ("Matrix Fragments for mma.m16n8k16").
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#ifdef CONDINIT_ATTN_EMU
  emu_mma_m16n8k16(std::is_same<T, __half>::value, c, a, b);
#else
  if constexpr (std::is_same<T, __half>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#endif
#else
  __trap();  // the launchers refuse 16-bit dtypes below sm_80
#endif
}

// Four 8 x 8 matrices of 16-bit values from shared memory (ldmatrix): lane 8 i + j gives the address
// of row j of matrix i (16-byte aligned). Plain (kTrans false): register i of lane 4 g + t receives
// elements (g, 2 t) and (g, 2 t + 1) of matrix i: an m16n8k16 A fragment of a row-major [m][k]
// tile, or B fragments of a row-major [n][k] one. Transposed (.trans): elements (2 t, g) and
// (2 t + 1, g): an m16n8k16 B fragment of a row-major [k][n] tile.
template <bool kTrans>
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#ifdef CONDINIT_ATTN_EMU
  emu_ldmatrix_x4(r, row, kTrans);
#else
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
#endif
#else
  __trap();
#endif
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* row) { ldsm_x4_t<false>(r, row); }
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* row) { ldsm_x4_t<true>(r, row); }

// 16 bytes from global to shared memory without a register (cp.async.cg, sm_80+): src_bytes (16 or 0)
// of them read from src, the rest zero-filled (0: a zero chunk, src not read). The copy completes at
// the cp_async_wait that covers its group (cp_async_commit closes a group). Below sm_80 (where only
// the fp32 kernels run) it is a plain 16-byte load and store, complete at once.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
#ifdef CONDINIT_ATTN_EMU
  emu_cp_async16(dst, src, src_bytes);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src), "r"(src_bytes) : "memory");
#else
  int4 v = make_int4(0, 0, 0, 0);
  if (src_bytes > 0) v = *static_cast<const int4*>(src);
  *static_cast<int4*>(dst) = v;
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef CONDINIT_ATTN_EMU
  emu_cp_async_commit();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Every committed group but the newest N has landed (for this thread: other threads' copies are
// visible after a barrier that follows their wait).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef CONDINIT_ATTN_EMU
  emu_cp_async_wait(N);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
// Closes the open group and waits for all of this thread's copies.
__device__ __forceinline__ void cp_async_wait_all() {
  cp_async_commit();
  cp_async_wait<0>();
}

}  // namespace
}  // namespace attention_cuda
}  // namespace condinit
