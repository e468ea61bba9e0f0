// CUDA kernels of the fused attention op (forward, multi-probe JVP, flash backward, tangent backward); the
// math is in attention_cpu.cpp's header comment and docs/design.md, "Attention".
//
// Design (FlashAttention-2 style):
// * A block is 1-4 warps; each warp owns 16 rows for the whole kernel (query rows in fwd / jvp / dq,
//   key rows in dk/dv) and keeps its accumulators (O, the probe's O', dQ, dK, dV) and the row
//   statistics of the online softmax (m, l, and the probe's r) in registers, as mma.sync C
//   fragments. Scores never leave registers: the C fragment of S = Q K^T is, element for element,
//   the A fragment of P V (FlashAttention-2's register reuse), so fp16/bf16 need no shared memory
//   for P. Row reductions are two quad shuffles.
// * The block's own tile (Q and the probe's tangent Q in fwd / jvp / dq, K and V in dk/dv) is loaded
//   into shared memory once; the looped tiles (K, V and the tangents, or Q and dO) are streamed
//   through shared memory. Rows outside the sequence lengths and the padded head-dim columns are
//   zero-filled, so products over padding add exact zeros.
// * fp16 / bf16: mma.sync.m16n8k16 with fp32 accumulation (sm_80+); A and B fragments of shared
//   tiles are 32-bit loads where the reduced dim is contiguous, ldmatrix.trans where it is not (the
//   B operand of P V, P^T dO, dS K, ...). fp32: the same fragments
//   computed with fp32 FMAs from shared memory (exact fp32, no TF32); P goes through a per-warp
//   shared scratch tile there.
// * Head dim d (1..256) is padded to dpad, a multiple of 16; the output columns are split into
//   chunks of kCols columns (a grid dimension), so accumulators have a fixed size in registers.
// * Masks (attention_cuda.h): a block visits only the key (query) tiles that some row of it may
//   attend, and rows past the sequence lengths are zero-filled; element masks are selects (never
//   arithmetic), so masked entries holding NaN/Inf do not reach scores. A NaN in an allowed entry
//   propagates through exp into the row's outputs. The products P V and P V' would turn a non-finite
//   value at a masked key into NaN (0 x NaN) for rows of the same tile that do not attend it: the
//   forward / JVP store such V / V' values as 0, flag their keys, and make exactly the rows that
//   attend a flagged key NaN. The backward kernels do not (a NaN / Inf inside the lengths but
//   hidden by the causal mask or the window can reach dq, dk, dv of rows that do not attend it, as
//   in SDPA's math backward).
// * JVP: one block per (query tile, head, output chunk, probe): the probe's accumulators stay in
//   registers; the primal (S, exp, m, l) is recomputed per probe and written by the probe-0 blocks.
// * Backward: deterministic; dq in one kernel (blocks over query tiles, loop over key tiles), dk and
//   dv in another (blocks over key tiles, loop over query tiles of every head of the GQA group).
// * Tangent backward: the same two-sided structure, one output (primal or one probe's) per block,
//   after a kernel that recomputes r = rowsum(P o S') per probe (see its section below).
#include "attention_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef CONDINIT_ATTN_EMU
// The CPU emulator (csrc/attention/emu): mock mma.sync and launch.
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
__device__ __forceinline__ uint32_t ld32(const void* p) { return *reinterpret_cast<const uint32_t*>(p); }

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

// Four 8 x 8 matrices of 16-bit values from shared memory, transposed (ldmatrix .trans): lane 8 i + j
// gives the address of row j of matrix i (16-byte aligned); register i of lane 4 g + t receives
// elements (2 t, g) and (2 t + 1, g) of matrix i: an m16n8k16 B fragment of a row-major [k][n] tile.
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#ifdef CONDINIT_ATTN_EMU
  emu_ldmatrix_x4_trans(r, row);
#else
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
#else
  __trap();
#endif
}

// ------------------------------------------------------------------------------------------------
// Warp-level tile products. Fragment coordinates: lane = 4 g + t; C element e of n-tile nt is at
// row g + 8 (e >> 1), column 8 nt + 2 t + (e & 1).

// C[16 x 8 NT] += A[16 x K] B^T: A [16 rows][K] and B [8 NT rows][K] row-major in shared memory
// (leading dims lda, ldb), K a multiple of 16 (zero-padded).
template <typename T, int NT>
__device__ __forceinline__ void mma_abt(float (&c)[NT][4], const T* A, int lda, const T* B, int ldb, int K) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if constexpr (kSimt<T>) {
    const float* a0 = A + g * lda;
    const float* a1 = A + (g + 8) * lda;
    for (int k = 0; k < K; ++k) {
      const float x0 = a0[k], x1 = a1[k];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float y0 = B[(nt * 8 + 2 * t) * ldb + k], y1 = B[(nt * 8 + 2 * t + 1) * ldb + k];
        c[nt][0] = fmaf(x0, y0, c[nt][0]);
        c[nt][1] = fmaf(x0, y1, c[nt][1]);
        c[nt][2] = fmaf(x1, y0, c[nt][2]);
        c[nt][3] = fmaf(x1, y1, c[nt][3]);
      }
    }
  } else {
    for (int k0 = 0; k0 < K; k0 += 16) {
      const uint32_t a[4] = {ld32(A + g * lda + k0 + 2 * t), ld32(A + (g + 8) * lda + k0 + 2 * t),
                             ld32(A + g * lda + k0 + 8 + 2 * t), ld32(A + (g + 8) * lda + k0 + 8 + 2 * t)};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const T* brow = B + (nt * 8 + g) * ldb + k0 + 2 * t;
        const uint32_t b[2] = {ld32(brow), ld32(brow + 8)};
        mma_16816<T>(c[nt], a, b);
      }
    }
  }
}

// C[16 x 8 NO] += P[16 x 8 KT] B: P in registers as C fragments (fp32), B [8 KT rows][>= 8 NO cols]
// row-major in shared memory (ldb). Only n-tiles below n_active are computed (the rest is padding).
// fp16/bf16: P is rounded to T (its C fragment pairs are the A fragment of m16n8k16). fp32: P goes
// through the warp's scratch tile [16][8 KT + 4].
template <typename T, int KT, int NO>
__device__ __forceinline__ void mma_pb(float (&c)[NO][4], const float (&p)[KT][4], const T* B, int ldb, int n_active,
                                       float* scratch) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if constexpr (kSimt<T>) {
    constexpr int lds = 8 * KT + 4;
#pragma unroll
    for (int nt = 0; nt < KT; ++nt) {
      scratch[g * lds + nt * 8 + 2 * t] = p[nt][0];
      scratch[g * lds + nt * 8 + 2 * t + 1] = p[nt][1];
      scratch[(g + 8) * lds + nt * 8 + 2 * t] = p[nt][2];
      scratch[(g + 8) * lds + nt * 8 + 2 * t + 1] = p[nt][3];
    }
    __syncwarp();
    for (int kk = 0; kk < 8 * KT; ++kk) {
      const float x0 = scratch[g * lds + kk], x1 = scratch[(g + 8) * lds + kk];
      const float* brow = B + kk * ldb + 2 * t;
#pragma unroll
      for (int nt = 0; nt < NO; ++nt) {
        if (nt < n_active) {
          const float y0 = brow[nt * 8], y1 = brow[nt * 8 + 1];
          c[nt][0] = fmaf(x0, y0, c[nt][0]);
          c[nt][1] = fmaf(x0, y1, c[nt][1]);
          c[nt][2] = fmaf(x1, y0, c[nt][2]);
          c[nt][3] = fmaf(x1, y1, c[nt][3]);
        }
      }
    }
    __syncwarp();  // every lane has read the scratch before it is rewritten
  } else {
    static_assert(KT % 2 == 0 && NO % 2 == 0, "key tiles and column chunks come in multiples of 16");
#pragma unroll
    for (int ks = 0; ks < KT / 2; ++ks) {
      const uint32_t a[4] = {pack2<T>(p[2 * ks][0], p[2 * ks][1]), pack2<T>(p[2 * ks][2], p[2 * ks][3]),
                             pack2<T>(p[2 * ks + 1][0], p[2 * ks + 1][1]),
                             pack2<T>(p[2 * ks + 1][2], p[2 * ks + 1][3])};
      // ldmatrix rows: lane 8 m + j reads key 16 ks + j + 8 (m & 1), columns from 8 (m >> 1): the B
      // fragments (b0, b1) of n-tiles nt and nt + 1 (n_active is even: columns come in 16s).
      const T* rows = B + (16 * ks + (lane & 7) + 8 * ((lane >> 3) & 1)) * ldb + 8 * (lane >> 4);
#pragma unroll
      for (int nt = 0; nt < NO; nt += 2) {
        if (nt < n_active) {
          uint32_t r[4];
          ldsm_x4_trans(r, rows + nt * 8);
          const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
          mma_16816<T>(c[nt], a, b0);
          mma_16816<T>(c[nt + 1], a, b1);
        }
      }
    }
  }
}

// Non-finite (NaN / Inf) test on the raw bits of a 32-bit word holding one fp32 or two 16-bit values;
// clears those values to 0 and says whether there was one.
template <typename T>
__device__ __forceinline__ bool clear_nonfinite(uint32_t& w) {
  if constexpr (kSimt<T>) {
    if ((w & 0x7f800000u) != 0x7f800000u) return false;
    w = 0;
    return true;
  } else {
    constexpr uint32_t e = std::is_same<T, __half>::value ? 0x7c00u : 0x7f80u;
    bool bad = false;
    if ((w & e) == e) { w &= 0xffff0000u; bad = true; }
    if (((w >> 16) & e) == e) { w &= 0x0000ffffu; bad = true; }
    return bad;
  }
}

// dst[r][c] (r < R, c < width, leading dim ld) = src[(row0 + r) * d + c0 + c] where row0 + r < nrows
// and c0 + c < d, else 0. All threads of the block take part. With bad_rows (a product operand that
// masked entries multiply by an exact 0), non-finite values are stored as 0 and their rows flagged:
// bad_rows[r] = 1 and *bad_any = 1 (plain stores of 1, zeroed by the caller beforehand); the kernel
// then makes the rows that attend a flagged key NaN, so masked entries never contribute.
template <typename T>
__device__ void load_tile(T* dst, int ld, const T* src, int d, int64_t row0, int64_t nrows, int R, int c0,
                          int width, unsigned char* bad_rows = nullptr, int* bad_any = nullptr) {
  constexpr int kVec = 16 / sizeof(T);
  if (d % kVec == 0 && c0 % kVec == 0) {  // width is a multiple of 16 elements
    const int chunks = width / kVec;
    for (int idx = threadIdx.x; idx < R * chunks; idx += blockDim.x) {
      const int r = idx / chunks, c = (idx - r * chunks) * kVec;
      int4 val = make_int4(0, 0, 0, 0);
      if (row0 + r < nrows && c0 + c < d) val = *reinterpret_cast<const int4*>(src + (row0 + r) * d + c0 + c);
      if (bad_rows != nullptr) {
        uint32_t w[4] = {(uint32_t)val.x, (uint32_t)val.y, (uint32_t)val.z, (uint32_t)val.w};
        bool bad = false;
#pragma unroll
        for (int i = 0; i < 4; ++i) bad |= clear_nonfinite<T>(w[i]);
        if (bad) {
          val = make_int4((int)w[0], (int)w[1], (int)w[2], (int)w[3]);
          bad_rows[r] = 1;
          *bad_any = 1;
        }
      }
      *reinterpret_cast<int4*>(dst + r * ld + c) = val;
    }
  } else {
    for (int idx = threadIdx.x; idx < R * width; idx += blockDim.x) {
      const int r = idx / width, c = idx - r * width;
      T val = Cvt<T>::from_f(0.0f);
      if (row0 + r < nrows && c0 + c < d) val = src[(row0 + r) * d + c0 + c];
      if (bad_rows != nullptr && !isfinite(Cvt<T>::to_f(val))) {
        val = Cvt<T>::from_f(0.0f);
        bad_rows[r] = 1;
        *bad_any = 1;
      }
      dst[r * ld + c] = val;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Geometry and masks

struct Geometry {
  int64_t B, H, Hkv, Nq, Nk;
  int d, dpad, nchunks;
  int64_t window_left, window_right;
  bool causal;
  float scale;
  const int* q_lens;
  const int* kv_lens;
};

struct Seq {
  int64_t Lq, Lk, off;
};

__device__ __forceinline__ Seq seq_of(const Geometry& g, int64_t b) {
  int64_t Lq = g.q_lens != nullptr ? g.q_lens[b] : g.Nq, Lk = g.kv_lens != nullptr ? g.kv_lens[b] : g.Nk;
  Lq = Lq < 0 ? 0 : Lq > g.Nq ? g.Nq : Lq;
  Lk = Lk < 0 ? 0 : Lk > g.Nk ? g.Nk : Lk;
  return Seq{Lq, Lk, Lk - Lq};
}

__device__ __forceinline__ bool allowed(const Geometry& g, const Seq& s, int64_t i, int64_t j) {
  const int64_t c = i + s.off;
  return i < s.Lq && j < s.Lk && (!g.causal || j <= c) && (g.window_left < 0 || j >= c - g.window_left) &&
         (g.window_right < 0 || j <= c + g.window_right);
}

// Keys [lo, hi) that some valid row of [i0, i1) may attend (lo >= hi: none).
__device__ __forceinline__ void key_range(const Geometry& g, const Seq& s, int64_t i0, int64_t i1, int64_t& lo,
                                          int64_t& hi) {
  if (i1 > s.Lq) i1 = s.Lq;
  lo = 0;
  hi = i0 < i1 ? s.Lk : 0;
  if (g.causal && hi > i1 - 1 + s.off + 1) hi = i1 + s.off;
  if (g.window_right >= 0 && hi > i1 + s.off + g.window_right) hi = i1 + s.off + g.window_right;
  if (g.window_left >= 0 && lo < i0 + s.off - g.window_left) lo = i0 + s.off - g.window_left;
}

// Valid query rows [lo, hi) that may attend some key of [j0, j1) (lo >= hi: none).
__device__ __forceinline__ void query_range(const Geometry& g, const Seq& s, int64_t j0, int64_t j1, int64_t& lo,
                                            int64_t& hi) {
  if (j1 > s.Lk) j1 = s.Lk;
  lo = 0;
  hi = j0 < j1 ? s.Lq : 0;
  if (g.causal && lo < j0 - s.off) lo = j0 - s.off;
  if (g.window_right >= 0 && lo < j0 - s.off - g.window_right) lo = j0 - s.off - g.window_right;
  if (g.window_left >= 0 && hi > j1 - 1 + g.window_left - s.off + 1) hi = j1 + g.window_left - s.off;
}

// ------------------------------------------------------------------------------------------------
// Tiles and shared-memory layouts (identical on host and device).

// Keys per streamed tile in fwd / jvp / dq, queries per streamed tile in dk/dv.
template <typename T>
constexpr int fwd_bn() { return kSimt<T> ? 32 : 64; }
template <typename T>
constexpr int jvp_bn() { return kSimt<T> ? 16 : 32; }
template <typename T>
constexpr int dq_bn() { return kSimt<T> ? 32 : 64; }
constexpr int kDkdvBm = 32;

__host__ __device__ inline int pad16(int64_t d) { return (int)((d + 15) / 16 * 16); }
__host__ __device__ inline size_t align128(size_t x) { return (x + 127) & ~size_t(127); }
__host__ __device__ inline int min_int(int a, int b) { return a < b ? a : b; }

// A [rows][width] tile of `elem`-byte elements, rows padded by 16 bytes (conflict-free fragment loads).
struct TileDim {
  int ld;
  size_t bytes;
};
__host__ __device__ inline TileDim tile_dim(int rows, int width, int elem) {
  const int ld = width + 16 / elem;
  return TileDim{ld, align128((size_t)rows * ld * elem)};
}

// Offsets (bytes) into dynamic shared memory.
struct FwdLayout {
  int ldq, ldk, ldv, lds;
  size_t q, tq, k, tk, v, tv, scratch, flags, total;
};
// kind 0 fwd, 1 jvp, 2 dq; rows = 16 * warps.
__host__ __device__ inline FwdLayout fwd_layout(int kind, int elem, int dpad, int rows, int bn, bool simt) {
  FwdLayout L{};
  const int vcols = min_int(kCols, dpad);
  const TileDim qd = tile_dim(rows, dpad, elem), kd = tile_dim(bn, dpad, elem),
                vd = tile_dim(bn, kind == 2 ? dpad : vcols, elem);
  L.ldq = qd.ld;
  L.ldk = kd.ld;
  L.ldv = vd.ld;
  L.lds = 8 * (bn / 8) + 4;
  size_t off = 0;
  L.q = off; off += qd.bytes;                        // Q (fwd, jvp, dq)
  L.tq = off; off += kind != 0 ? qd.bytes : 0;       // tangent Q (jvp) or dO (dq)
  L.k = off; off += kd.bytes;                        // K
  L.tk = off; off += kind == 1 ? kd.bytes : 0;       // tangent K (jvp)
  L.v = off; off += vd.bytes;                        // V (its output chunk; all of it in dq)
  L.tv = off; off += kind == 1 ? vd.bytes : 0;       // tangent V (jvp)
  L.scratch = off; off += simt ? align128((size_t)(rows / 16) * 16 * L.lds * 4) : 0;
  // fwd / jvp: non-finite V / V' rows, [2 buffers][V, V'][bn] bytes, then [2][2] ints "any".
  L.flags = off; off += kind != 2 ? align128((size_t)4 * bn + 16) : 0;
  L.total = off;
  return L;
}

struct DkdvLayout {
  int ldk, ldq, lds;
  size_t k, v, q, dout, lse, D, scratch, total;
};
__host__ __device__ inline DkdvLayout dkdv_layout(int elem, int dpad, int rows, bool simt) {
  DkdvLayout L{};
  const TileDim kd = tile_dim(rows, dpad, elem), qd = tile_dim(kDkdvBm, dpad, elem);
  L.ldk = kd.ld;
  L.ldq = qd.ld;
  L.lds = kDkdvBm + 4;
  size_t off = 0;
  L.k = off; off += kd.bytes;
  L.v = off; off += kd.bytes;
  L.q = off; off += qd.bytes;
  L.dout = off; off += qd.bytes;
  L.lse = off; off += align128(kDkdvBm * 4);
  L.D = off; off += align128(kDkdvBm * 4);
  L.scratch = off; off += simt ? align128((size_t)(rows / 16) * 16 * L.lds * 4) : 0;
  L.total = off;
  return L;
}

// ------------------------------------------------------------------------------------------------
// Forward (JVP = false) and forward + one probe's tangent (JVP = true).
// Grid: x = query tiles * B * H (x = bh * tiles + tile), z = nchunks * probes (z = probe * nchunks + chunk).

template <typename T>
struct FwdParams {
  Geometry g;
  const T *q, *k, *v, *tq, *tk, *tv;
  T *out, *tout;
  float* lse;
};

template <typename T, bool JVP>
__global__ void __launch_bounds__(128, JVP ? 2 : 3) attention_fwd_kernel(const FwdParams<T> p) {
  CONDINIT_DYNAMIC_SMEM(smem);
  constexpr int BN = JVP ? jvp_bn<T>() : fwd_bn<T>(), KT = BN / 8, NO = kCols / 8;
  const Geometry& g = p.g;
  const int nwarps = blockDim.x >> 5, rows = 16 * nwarps;
  const FwdLayout L = fwd_layout(JVP ? 1 : 0, (int)sizeof(T), g.dpad, rows, BN, kSimt<T>);
  T* Qs = reinterpret_cast<T*>(smem + L.q);
  T* TQs = reinterpret_cast<T*>(smem + L.tq);
  T* Ks = reinterpret_cast<T*>(smem + L.k);
  T* TKs = reinterpret_cast<T*>(smem + L.tk);
  T* Vs = reinterpret_cast<T*>(smem + L.v);
  T* TVs = reinterpret_cast<T*>(smem + L.tv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq4 = lane & 3;
  float* scratch = reinterpret_cast<float*>(smem + L.scratch) + warp * 16 * L.lds;

  const int64_t nqt = (g.Nq + rows - 1) / rows;
  const int64_t bh = (int64_t)blockIdx.x / nqt, b = bh / g.H, h = bh % g.H, hk = h / (g.H / g.Hkv);
  const int64_t i0 = (nqt - 1 - (int64_t)blockIdx.x % nqt) * rows;  // the longest causal rows start first
  const int chunk = (int)(blockIdx.z % g.nchunks);
  const int64_t probe = blockIdx.z / g.nchunks;
  const int c0 = chunk * kCols, ncols = min_int(kCols, g.dpad - c0), n_active = ncols / 8;
  const Seq s = seq_of(g, b);
  const int64_t ra = i0 + warp * 16 + gq, rb = ra + 8;  // this lane's two rows

  const int64_t q_off = bh * g.Nq * g.d, kv_off = (b * g.Hkv + hk) * g.Nk * g.d;
  load_tile(Qs, L.ldq, p.q + q_off, g.d, i0, s.Lq, rows, 0, g.dpad);
  if constexpr (JVP) {
    const int64_t BH = g.B * g.H;
    load_tile(TQs, L.ldq, p.tq + probe * BH * g.Nq * g.d + q_off, g.d, i0, s.Lq, rows, 0, g.dpad);
  }
  const T* Kg = p.k + kv_off;
  const T* Vg = p.v + kv_off;
  const T* TKg = JVP ? p.tk + probe * g.B * g.Hkv * g.Nk * g.d + kv_off : nullptr;
  const T* TVg = JVP ? p.tv + probe * g.B * g.Hkv * g.Nk * g.d + kv_off : nullptr;

  float o[NO][4], ot[JVP ? NO : 1][4];
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f}, r[2] = {0.0f, 0.0f};
#pragma unroll
  for (int nt = 0; nt < NO; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      o[nt][e] = 0.0f;
      if constexpr (JVP) ot[nt][e] = 0.0f;
    }

  // Keys whose V (V') row holds a NaN / Inf: stored as 0, and the rows that attend them come out NaN
  // (out and tout, or tout only). Two buffers, so that one is zeroed while the other is in use.
  unsigned char* bad_rows = smem + L.flags;                        // [buffer][V, V'][BN]
  int* bad_any = reinterpret_cast<int*>(smem + L.flags + 4 * BN);  // [buffer][V, V']
  for (int i = threadIdx.x; i < 4 * BN; i += blockDim.x) bad_rows[i] = 0;
  if (threadIdx.x < 4) bad_any[threadIdx.x] = 0;
  bool poison_o[2] = {false, false}, poison_t[2] = {false, false};

  int64_t lo, hi;
  key_range(g, s, i0, i0 + rows, lo, hi);
  for (int64_t j0 = lo, it = 0; j0 < hi; j0 += BN, ++it) {
    const int buf = (int)(it & 1);
    __syncthreads();  // every warp is done with the previous tiles (and flags of buffer 1 - buf)
    for (int i = threadIdx.x; i < 2 * BN; i += blockDim.x) bad_rows[(1 - buf) * 2 * BN + i] = 0;
    if (threadIdx.x < 2) bad_any[(1 - buf) * 2 + threadIdx.x] = 0;
    unsigned char* vbad = bad_rows + buf * 2 * BN;
    load_tile(Ks, L.ldk, Kg, g.d, j0, hi, BN, 0, g.dpad);
    load_tile(Vs, L.ldv, Vg, g.d, j0, hi, BN, c0, ncols, vbad, bad_any + buf * 2);
    if constexpr (JVP) {
      load_tile(TKs, L.ldk, TKg, g.d, j0, hi, BN, 0, g.dpad);
      load_tile(TVs, L.ldv, TVg, g.d, j0, hi, BN, c0, ncols, vbad + BN, bad_any + buf * 2 + 1);
    }
    __syncthreads();
    const bool any_bad = (bad_any[buf * 2] | bad_any[buf * 2 + 1]) != 0;

    float sc[KT][4], sp[JVP ? KT : 1][4];
#pragma unroll
    for (int nt = 0; nt < KT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc[nt][e] = 0.0f;
        if constexpr (JVP) sp[nt][e] = 0.0f;
      }
    mma_abt<T, KT>(sc, Qs + warp * 16 * L.ldq, L.ldq, Ks, L.ldk, g.dpad);
    if constexpr (JVP) {  // S' = Q' K^T + Q K'^T
      mma_abt<T, KT>(sp, TQs + warp * 16 * L.ldq, L.ldq, Ks, L.ldk, g.dpad);
      mma_abt<T, KT>(sp, Qs + warp * 16 * L.ldq, L.ldq, TKs, L.ldk, g.dpad);
    }

    // Mask and scale (selects: a masked NaN never enters), then the online-softmax update.
    float mx[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int nt = 0; nt < KT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t j = j0 + nt * 8 + 2 * tq4 + (e & 1);
        const bool ok = allowed(g, s, e < 2 ? ra : rb, j);
        sc[nt][e] = ok ? sc[nt][e] * g.scale : kNegInf;
        if constexpr (JVP) sp[nt][e] = ok ? sp[nt][e] * g.scale : 0.0f;
        mx[e >> 1] = fmaxf(mx[e >> 1], sc[nt][e]);
        if (any_bad && ok) {
          const int c = nt * 8 + 2 * tq4 + (e & 1);
          poison_o[e >> 1] |= vbad[c] != 0;
          poison_t[e >> 1] |= (vbad[c] | vbad[BN + c]) != 0;
        }
      }
    float alpha[2], mu[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const float m_new = fmaxf(m[x], quad_max(mx[x]));
      alpha[x] = m_new == kNegInf ? 1.0f : exp2f((m[x] - m_new) * kLog2e);
      mu[x] = m_new == kNegInf ? 0.0f : m_new;  // nothing allowed yet: P~ = exp(-inf) = 0
      m[x] = m_new;
    }
#pragma unroll
    for (int nt = 0; nt < KT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc[nt][e] = exp2f((sc[nt][e] - mu[e >> 1]) * kLog2e);  // P~, in place
        sum[e >> 1] += sc[nt][e];
      }
#pragma unroll
    for (int x = 0; x < 2; ++x) l[x] = alpha[x] * l[x] + quad_sum(sum[x]);
#pragma unroll
    for (int nt = 0; nt < NO; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[nt][e] *= alpha[e >> 1];
    mma_pb<T, KT, NO>(o, sc, Vs, L.ldv, n_active, scratch);

    if constexpr (JVP) {
      // W = P~ o S' (rounded as the product operand, so that r sums what multiplies V),
      // r = alpha r + rowsum W, O' acc = alpha O' acc + P~ V' + W V.
      float rs[2] = {0.0f, 0.0f};
#pragma unroll
      for (int nt = 0; nt < KT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float w = kSimt<T> ? sc[nt][e] * sp[nt][e] : round_to<T>(sc[nt][e] * sp[nt][e]);
          sp[nt][e] = w;
          rs[e >> 1] += w;
        }
#pragma unroll
      for (int x = 0; x < 2; ++x) r[x] = alpha[x] * r[x] + quad_sum(rs[x]);
#pragma unroll
      for (int nt = 0; nt < NO; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ot[nt][e] *= alpha[e >> 1];
      mma_pb<T, KT, NO>(ot, sc, TVs, L.ldv, n_active, scratch);
      mma_pb<T, KT, NO>(ot, sp, Vs, L.ldv, n_active, scratch);
    }
  }

  // O = acc / l, lse = m + log l, O' = acc' / l - (r / l) O. l == 0 only when no key is allowed
  // (the row maximum contributes exp(0) = 1): out 0, lse -inf, O' 0. A NaN l gives NaN outputs.
  float inv[2], rl[2], nan_o[2], nan_t[2];
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    inv[x] = l[x] == 0.0f ? 0.0f : 1.0f / l[x];
    rl[x] = r[x] * inv[x];
    // A row attending a non-finite V (V') entry: NaN, added to its outputs (the quad agrees).
    nan_o[x] = quad_max(poison_o[x] ? 1.0f : 0.0f) != 0.0f ? __int_as_float(0x7fc00000) : 0.0f;
    nan_t[x] = quad_max(poison_t[x] ? 1.0f : 0.0f) != 0.0f ? __int_as_float(0x7fc00000) : 0.0f;
  }
  const int64_t BH = g.B * g.H;
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int64_t i = x == 0 ? ra : rb;
    if (i >= g.Nq) continue;
    if (probe == 0) {
      T* orow = p.out + (bh * g.Nq + i) * g.d + c0;
#pragma unroll
      for (int nt = 0; nt < NO; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = nt * 8 + 2 * tq4 + e;
          if (nt < n_active && c0 + c < g.d) orow[c] = Cvt<T>::from_f(o[nt][2 * x + e] * inv[x] + nan_o[x]);
        }
      if (chunk == 0 && tq4 == 0) p.lse[bh * g.Nq + i] = l[x] == 0.0f ? kNegInf : m[x] + logf(l[x]);
    }
    if constexpr (JVP) {
      T* trow = p.tout + ((probe * BH + bh) * g.Nq + i) * g.d + c0;
#pragma unroll
      for (int nt = 0; nt < NO; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = nt * 8 + 2 * tq4 + e;
          if (nt < n_active && c0 + c < g.d)
            trow[c] = Cvt<T>::from_f(ot[nt][2 * x + e] * inv[x] - rl[x] * (o[nt][2 * x + e] * inv[x]) + nan_t[x]);
        }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Backward. dS = P o (dP - D), P = exp(s q k^T - lse), dP = dO V^T; dq = s dS K, dk = s dS^T Q,
// dv = P^T dO.

template <typename T>
struct BwdParams {
  Geometry g;
  const T *dout, *q, *k, *v;
  const float *lse, *Dvec;
  T *dq, *dk, *dv;
};

// dq: grid x = query tiles * B * H, z = nchunks.
template <typename T>
__global__ void __launch_bounds__(128) attention_dq_kernel(const BwdParams<T> p) {
  CONDINIT_DYNAMIC_SMEM(smem);
  constexpr int BN = dq_bn<T>(), KT = BN / 8, NO = kCols / 8;
  const Geometry& g = p.g;
  const int nwarps = blockDim.x >> 5, rows = 16 * nwarps;
  const FwdLayout L = fwd_layout(2, (int)sizeof(T), g.dpad, rows, BN, kSimt<T>);
  T* Qs = reinterpret_cast<T*>(smem + L.q);
  T* dOs = reinterpret_cast<T*>(smem + L.tq);
  T* Ks = reinterpret_cast<T*>(smem + L.k);
  T* Vs = reinterpret_cast<T*>(smem + L.v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq4 = lane & 3;
  float* scratch = reinterpret_cast<float*>(smem + L.scratch) + warp * 16 * L.lds;

  const int64_t nqt = (g.Nq + rows - 1) / rows;
  const int64_t bh = (int64_t)blockIdx.x / nqt, b = bh / g.H, h = bh % g.H, hk = h / (g.H / g.Hkv);
  const int64_t i0 = (nqt - 1 - (int64_t)blockIdx.x % nqt) * rows;
  const int chunk = (int)blockIdx.z;
  const int c0 = chunk * kCols, ncols = min_int(kCols, g.dpad - c0), n_active = ncols / 8;
  const Seq s = seq_of(g, b);
  const int64_t ra = i0 + warp * 16 + gq, rb = ra + 8;

  const int64_t q_off = bh * g.Nq * g.d, kv_off = (b * g.Hkv + hk) * g.Nk * g.d;
  load_tile(Qs, L.ldq, p.q + q_off, g.d, i0, s.Lq, rows, 0, g.dpad);
  load_tile(dOs, L.ldq, p.dout + q_off, g.d, i0, s.Lq, rows, 0, g.dpad);
  float lse[2], D[2];
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int64_t i = x == 0 ? ra : rb;
    lse[x] = i < s.Lq ? p.lse[bh * g.Nq + i] : kNegInf;
    D[x] = i < s.Lq ? p.Dvec[bh * g.Nq + i] : 0.0f;
  }
  float acc[NO][4];
#pragma unroll
  for (int nt = 0; nt < NO; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;

  int64_t lo, hi;
  key_range(g, s, i0, i0 + rows, lo, hi);
  for (int64_t j0 = lo; j0 < hi; j0 += BN) {
    __syncthreads();
    load_tile(Ks, L.ldk, p.k + kv_off, g.d, j0, hi, BN, 0, g.dpad);
    load_tile(Vs, L.ldv, p.v + kv_off, g.d, j0, hi, BN, 0, g.dpad);
    __syncthreads();
    float sc[KT][4], dp[KT][4];
#pragma unroll
    for (int nt = 0; nt < KT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[nt][e] = dp[nt][e] = 0.0f;
    mma_abt<T, KT>(sc, Qs + warp * 16 * L.ldq, L.ldq, Ks, L.ldk, g.dpad);
    mma_abt<T, KT>(dp, dOs + warp * 16 * L.ldq, L.ldq, Vs, L.ldv, g.dpad);
#pragma unroll
    for (int nt = 0; nt < KT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int x = e >> 1;
        const int64_t j = j0 + nt * 8 + 2 * tq4 + (e & 1);
        const bool ok = allowed(g, s, x == 0 ? ra : rb, j) && lse[x] != kNegInf;
        const float pr = exp2f((sc[nt][e] * g.scale - lse[x]) * kLog2e);
        sc[nt][e] = ok ? pr * (dp[nt][e] - D[x]) : 0.0f;  // dS
      }
    mma_pb<T, KT, NO>(acc, sc, Ks + c0, L.ldk, n_active, scratch);
  }
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int64_t i = x == 0 ? ra : rb;
    if (i >= g.Nq) continue;
    T* row = p.dq + (bh * g.Nq + i) * g.d + c0;
#pragma unroll
    for (int nt = 0; nt < NO; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = nt * 8 + 2 * tq4 + e;
        if (nt < n_active && c0 + c < g.d) row[c] = Cvt<T>::from_f(g.scale * acc[nt][2 * x + e]);
      }
  }
}

// dk, dv: grid x = key tiles * B * Hkv, z = nchunks. Each warp owns 16 keys; the block loops over
// the query tiles of every query head of its GQA group (dk, dv summed over the group in registers).
template <typename T>
__global__ void __launch_bounds__(128) attention_dkdv_kernel(const BwdParams<T> p) {
  CONDINIT_DYNAMIC_SMEM(smem);
  constexpr int BM = kDkdvBm, KT = BM / 8, NO = kCols / 8;
  const Geometry& g = p.g;
  const int nwarps = blockDim.x >> 5, rows = 16 * nwarps;
  const DkdvLayout L = dkdv_layout((int)sizeof(T), g.dpad, rows, kSimt<T>);
  T* Ks = reinterpret_cast<T*>(smem + L.k);
  T* Vs = reinterpret_cast<T*>(smem + L.v);
  T* Qs = reinterpret_cast<T*>(smem + L.q);
  T* dOs = reinterpret_cast<T*>(smem + L.dout);
  float* lse_s = reinterpret_cast<float*>(smem + L.lse);
  float* D_s = reinterpret_cast<float*>(smem + L.D);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq4 = lane & 3;
  float* scratch = reinterpret_cast<float*>(smem + L.scratch) + warp * 16 * L.lds;

  const int64_t nkt = (g.Nk + rows - 1) / rows;
  const int64_t bhk = (int64_t)blockIdx.x / nkt, b = bhk / g.Hkv, hk = bhk % g.Hkv, G = g.H / g.Hkv;
  const int64_t j0 = ((int64_t)blockIdx.x % nkt) * rows;
  const int chunk = (int)blockIdx.z;
  const int c0 = chunk * kCols, ncols = min_int(kCols, g.dpad - c0), n_active = ncols / 8;
  const Seq s = seq_of(g, b);
  const int64_t ka = j0 + warp * 16 + gq, kb = ka + 8;  // this lane's two keys

  const int64_t kv_off = bhk * g.Nk * g.d;
  load_tile(Ks, L.ldk, p.k + kv_off, g.d, j0, s.Lk, rows, 0, g.dpad);
  load_tile(Vs, L.ldk, p.v + kv_off, g.d, j0, s.Lk, rows, 0, g.dpad);
  float dk[NO][4], dv[NO][4];
#pragma unroll
  for (int nt = 0; nt < NO; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[nt][e] = dv[nt][e] = 0.0f;

  int64_t lo, hi;
  query_range(g, s, j0, j0 + rows, lo, hi);
  for (int64_t gh = 0; gh < G; ++gh) {
    const int64_t bh = b * g.H + hk * G + gh, q_off = bh * g.Nq * g.d;
    for (int64_t i0 = lo; i0 < hi; i0 += BM) {
      __syncthreads();  // every warp is done with the previous Q / dO tiles (and K / V are loaded)
      load_tile(Qs, L.ldq, p.q + q_off, g.d, i0, hi, BM, 0, g.dpad);
      load_tile(dOs, L.ldq, p.dout + q_off, g.d, i0, hi, BM, 0, g.dpad);
      for (int c = threadIdx.x; c < BM; c += blockDim.x) {
        const bool in = i0 + c < hi;
        lse_s[c] = in ? p.lse[bh * g.Nq + i0 + c] : kNegInf;
        D_s[c] = in ? p.Dvec[bh * g.Nq + i0 + c] : 0.0f;
      }
      __syncthreads();
      float st[KT][4], dpt[KT][4];
#pragma unroll
      for (int nt = 0; nt < KT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.0f;
      mma_abt<T, KT>(st, Ks + warp * 16 * L.ldk, L.ldk, Qs, L.ldq, g.dpad);    // S^T = K Q^T
      mma_abt<T, KT>(dpt, Vs + warp * 16 * L.ldk, L.ldk, dOs, L.ldq, g.dpad);  // dP^T = V dO^T
#pragma unroll
      for (int nt = 0; nt < KT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = nt * 8 + 2 * tq4 + (e & 1);
          const float lse = lse_s[c];
          const bool ok = allowed(g, s, i0 + c, e < 2 ? ka : kb) && lse != kNegInf;
          const float pr = ok ? exp2f((st[nt][e] * g.scale - lse) * kLog2e) : 0.0f;
          dpt[nt][e] = ok ? pr * (dpt[nt][e] - D_s[c]) : 0.0f;  // dS^T
          st[nt][e] = pr;                                        // P^T
        }
      mma_pb<T, KT, NO>(dv, st, dOs + c0, L.ldq, n_active, scratch);   // dV += P^T dO
      mma_pb<T, KT, NO>(dk, dpt, Qs + c0, L.ldq, n_active, scratch);   // dK += dS^T Q
    }
  }
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int64_t j = x == 0 ? ka : kb;
    if (j >= g.Nk) continue;
    T* dkrow = p.dk + (bhk * g.Nk + j) * g.d + c0;
    T* dvrow = p.dv + (bhk * g.Nk + j) * g.d + c0;
#pragma unroll
    for (int nt = 0; nt < NO; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = nt * 8 + 2 * tq4 + e;
        if (nt < n_active && c0 + c < g.d) {
          dkrow[c] = Cvt<T>::from_f(g.scale * dk[nt][2 * x + e]);
          dvrow[c] = Cvt<T>::from_f(dv[nt][2 * x + e]);
        }
      }
  }
}

// ------------------------------------------------------------------------------------------------
// Tangent backward (attention_jvp_bwd): gradients of a loss on (out, tout) w.r.t. q, k, v and the
// tangents, from (out, tout, lse); the formulas of docs/design.md, "Attention" ("Backward through
// the tangent output"), summed over the P probes:
//   r_p = rowsum(P o S'_p), d'_p = rowsum(gO'_p o O), D = rowsum(gO o O) + sum_p (rowsum(gO'_p o O'_p) - r_p d'_p)
//   dP'_p = gO'_p V^T, gS'_p = P o (dP'_p - d'_p), P'_p = P o (S'_p - r_p)
//   gP = gO V^T + sum_p [gO'_p V'_p^T + dP'_p o (S'_p - r_p) - S'_p d'_p], gS = P o (gP - D)
//   gQ = s (gS K + sum_p gS'_p K'_p), gK = s (gS^T Q + sum_p gS'_p^T Q'_p), gV = P^T gO + sum_p P'_p^T gO'_p
//   gQ'_p = s gS'_p K, gK'_p = s gS'_p^T Q, gV'_p = P^T gO'_p
// Three kernels, deterministic (each output row written by one block): r (per query tile and probe),
// then the query side (gQ, gQ'_p) and the key side (gK, gV, gK'_p, gV'_p); D and d'_p are computed
// by the caller between them. A block computes one output ("target" 0: the primal gradient, 1 + p:
// probe p's), so its accumulators stay in registers.

template <typename T>
struct JvpBwdParams {
  Geometry g;
  int64_t P;
  const T *gout, *gtout, *q, *k, *v, *tq, *tk, *tv;
  const float *lse, *r, *dprime, *D;  // r, dprime [P, B * H, Nq]; D [B * H, Nq]
  float* r_out;
  T *dq, *dk, *dv, *dtq, *dtk, *dtv;
};

// nrow tiles [rows][dpad] (the block's own rows), nloop tiles [bn][dpad] (streamed), nstats float
// vectors [bn], and the fp32 path's per-warp scratch [16][bn + 4].
struct GenLayout {
  int ldr, ldt, lds;
  size_t row[4], loop[4], stats[4], scratch, total;
};
__host__ __device__ inline GenLayout gen_layout(int elem, int dpad, int rows, int nrow, int bn, int nloop,
                                                int nstats, bool simt) {
  GenLayout L{};
  const TileDim rd = tile_dim(rows, dpad, elem), td = tile_dim(bn, dpad, elem);
  L.ldr = rd.ld;
  L.ldt = td.ld;
  L.lds = bn + 4;
  size_t off = 0;
  for (int i = 0; i < 4; ++i) { L.row[i] = off; off += i < nrow ? rd.bytes : 0; }
  for (int i = 0; i < 4; ++i) { L.loop[i] = off; off += i < nloop ? td.bytes : 0; }
  for (int i = 0; i < 4; ++i) { L.stats[i] = off; off += i < nstats ? align128((size_t)bn * 4) : 0; }
  L.scratch = off; off += simt ? align128((size_t)(rows / 16) * 16 * L.lds * 4) : 0;
  L.total = off;
  return L;
}

template <typename T>
constexpr int jb_bn() { return kSimt<T> ? 16 : 32; }  // keys per tile, query side
constexpr int kJbKvBm = 16;                           // queries per tile, key side

template <typename T, int NT>
__device__ __forceinline__ void zero(float (&c)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[nt][e] = 0.0f;
}

// r_p: grid x = query tiles * B * H, z = P.
template <typename T>
__global__ void __launch_bounds__(128) attention_jvp_r_kernel(const JvpBwdParams<T> p) {
  CONDINIT_DYNAMIC_SMEM(smem);
  constexpr int BN = fwd_bn<T>(), KT = BN / 8;
  const Geometry& g = p.g;
  const int nwarps = blockDim.x >> 5, rows = 16 * nwarps;
  const GenLayout L = gen_layout((int)sizeof(T), g.dpad, rows, 2, BN, 2, 0, kSimt<T>);
  T* Qs = reinterpret_cast<T*>(smem + L.row[0]);
  T* TQs = reinterpret_cast<T*>(smem + L.row[1]);
  T* Ks = reinterpret_cast<T*>(smem + L.loop[0]);
  T* TKs = reinterpret_cast<T*>(smem + L.loop[1]);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq4 = lane & 3;
  const int64_t nqt = (g.Nq + rows - 1) / rows;
  const int64_t bh = (int64_t)blockIdx.x / nqt, b = bh / g.H, h = bh % g.H, hk = h / (g.H / g.Hkv);
  const int64_t i0 = (nqt - 1 - (int64_t)blockIdx.x % nqt) * rows, probe = blockIdx.z, BH = g.B * g.H;
  const Seq s = seq_of(g, b);
  const int64_t ra = i0 + warp * 16 + gq, rb = ra + 8;
  const int64_t q_off = bh * g.Nq * g.d, kv_off = (b * g.Hkv + hk) * g.Nk * g.d;
  load_tile(Qs, L.ldr, p.q + q_off, g.d, i0, s.Lq, rows, 0, g.dpad);
  load_tile(TQs, L.ldr, p.tq + probe * BH * g.Nq * g.d + q_off, g.d, i0, s.Lq, rows, 0, g.dpad);
  const T* TKg = p.tk + probe * g.B * g.Hkv * g.Nk * g.d + kv_off;
  float lse[2], rsum[2] = {0.0f, 0.0f};
  for (int x = 0; x < 2; ++x) {
    const int64_t i = x == 0 ? ra : rb;
    lse[x] = i < s.Lq ? p.lse[bh * g.Nq + i] : kNegInf;
  }
  int64_t lo, hi;
  key_range(g, s, i0, i0 + rows, lo, hi);
  for (int64_t j0 = lo; j0 < hi; j0 += BN) {
    __syncthreads();
    load_tile(Ks, L.ldt, p.k + kv_off, g.d, j0, hi, BN, 0, g.dpad);
    load_tile(TKs, L.ldt, TKg, g.d, j0, hi, BN, 0, g.dpad);
    __syncthreads();
    float sc[KT][4], sp[KT][4];
    zero<T, KT>(sc);
    zero<T, KT>(sp);
    mma_abt<T, KT>(sc, Qs + warp * 16 * L.ldr, L.ldr, Ks, L.ldt, g.dpad);
    mma_abt<T, KT>(sp, TQs + warp * 16 * L.ldr, L.ldr, Ks, L.ldt, g.dpad);
    mma_abt<T, KT>(sp, Qs + warp * 16 * L.ldr, L.ldr, TKs, L.ldt, g.dpad);
#pragma unroll
    for (int nt = 0; nt < KT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int x = e >> 1;
        const int64_t j = j0 + nt * 8 + 2 * tq4 + (e & 1);
        const bool ok = allowed(g, s, x == 0 ? ra : rb, j) && lse[x] != kNegInf;
        rsum[x] += ok ? exp2f((sc[nt][e] * g.scale - lse[x]) * kLog2e) * (sp[nt][e] * g.scale) : 0.0f;
      }
  }
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const float total = quad_sum(rsum[x]);
    const int64_t i = x == 0 ? ra : rb;
    if (i < g.Nq && tq4 == 0) p.r_out[(probe * BH + bh) * g.Nq + i] = total;
  }
}

// Query side: grid x = query tiles * B * H, z = (1 + P) * nchunks (z = target * nchunks + chunk).
template <typename T>
__global__ void __launch_bounds__(128) attention_jvp_bwd_q_kernel(const JvpBwdParams<T> p) {
  CONDINIT_DYNAMIC_SMEM(smem);
  constexpr int BN = jb_bn<T>(), KT = BN / 8, NO = kCols / 8;
  const Geometry& g = p.g;
  const int nwarps = blockDim.x >> 5, rows = 16 * nwarps;
  const GenLayout L = gen_layout((int)sizeof(T), g.dpad, rows, 4, BN, 4, 0, kSimt<T>);
  T* Qs = reinterpret_cast<T*>(smem + L.row[0]);
  T* gOs = reinterpret_cast<T*>(smem + L.row[1]);
  T* TQs = reinterpret_cast<T*>(smem + L.row[2]);
  T* gOTs = reinterpret_cast<T*>(smem + L.row[3]);
  T* Ks = reinterpret_cast<T*>(smem + L.loop[0]);
  T* Vs = reinterpret_cast<T*>(smem + L.loop[1]);
  T* TKs = reinterpret_cast<T*>(smem + L.loop[2]);
  T* TVs = reinterpret_cast<T*>(smem + L.loop[3]);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq4 = lane & 3;
  float* scratch = reinterpret_cast<float*>(smem + L.scratch) + warp * 16 * L.lds;

  const int64_t nqt = (g.Nq + rows - 1) / rows;
  const int64_t bh = (int64_t)blockIdx.x / nqt, b = bh / g.H, h = bh % g.H, hk = h / (g.H / g.Hkv);
  const int64_t i0 = (nqt - 1 - (int64_t)blockIdx.x % nqt) * rows;
  const int chunk = (int)(blockIdx.z % g.nchunks);
  const int64_t target = blockIdx.z / g.nchunks, P = p.P, BH = g.B * g.H;
  const int c0 = chunk * kCols, ncols = min_int(kCols, g.dpad - c0), n_active = ncols / 8;
  const Seq s = seq_of(g, b);
  const int64_t ra = i0 + warp * 16 + gq, rb = ra + 8;
  const int64_t q_off = bh * g.Nq * g.d, kv_off = (b * g.Hkv + hk) * g.Nk * g.d;
  const int64_t q_stride = BH * g.Nq * g.d, kv_stride = g.B * g.Hkv * g.Nk * g.d;

  load_tile(Qs, L.ldr, p.q + q_off, g.d, i0, s.Lq, rows, 0, g.dpad);
  load_tile(gOs, L.ldr, p.gout + q_off, g.d, i0, s.Lq, rows, 0, g.dpad);
  // The probe's own rows: loaded once when one probe is needed, per probe and key tile otherwise.
  const bool per_probe = target == 0 && P > 1;
  const int64_t first = target == 0 ? 0 : target - 1;
  if (!per_probe) {
    load_tile(TQs, L.ldr, p.tq + first * q_stride + q_off, g.d, i0, s.Lq, rows, 0, g.dpad);
    load_tile(gOTs, L.ldr, p.gtout + first * q_stride + q_off, g.d, i0, s.Lq, rows, 0, g.dpad);
  }
  float lse[2], D[2];
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int64_t i = x == 0 ? ra : rb;
    lse[x] = i < s.Lq ? p.lse[bh * g.Nq + i] : kNegInf;
    D[x] = i < s.Lq ? p.D[bh * g.Nq + i] : 0.0f;
  }
  float acc[NO][4];
  zero<T, NO>(acc);

  int64_t lo, hi;
  key_range(g, s, i0, i0 + rows, lo, hi);
  for (int64_t j0 = lo; j0 < hi; j0 += BN) {
    __syncthreads();
    load_tile(Ks, L.ldt, p.k + kv_off, g.d, j0, hi, BN, 0, g.dpad);
    load_tile(Vs, L.ldt, p.v + kv_off, g.d, j0, hi, BN, 0, g.dpad);
    if (target == 0 && !per_probe) {
      load_tile(TKs, L.ldt, p.tk + kv_off, g.d, j0, hi, BN, 0, g.dpad);
      load_tile(TVs, L.ldt, p.tv + kv_off, g.d, j0, hi, BN, 0, g.dpad);
    }
    __syncthreads();
    float pr[KT][4], gp[KT][4];
    zero<T, KT>(pr);
    zero<T, KT>(gp);
    mma_abt<T, KT>(pr, Qs + warp * 16 * L.ldr, L.ldr, Ks, L.ldt, g.dpad);
    bool ok[KT][4];
#pragma unroll
    for (int nt = 0; nt < KT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int x = e >> 1;
        const int64_t j = j0 + nt * 8 + 2 * tq4 + (e & 1);
        ok[nt][e] = allowed(g, s, x == 0 ? ra : rb, j) && lse[x] != kNegInf;
        pr[nt][e] = ok[nt][e] ? exp2f((pr[nt][e] * g.scale - lse[x]) * kLog2e) : 0.0f;  // P
      }
    if (target == 0) {
      mma_abt<T, KT>(gp, gOs + warp * 16 * L.ldr, L.ldr, Vs, L.ldt, g.dpad);  // gO V^T
      for (int64_t pi = 0; pi < P; ++pi) {
        if (per_probe) {
          __syncthreads();
          load_tile(TQs, L.ldr, p.tq + pi * q_stride + q_off, g.d, i0, s.Lq, rows, 0, g.dpad);
          load_tile(gOTs, L.ldr, p.gtout + pi * q_stride + q_off, g.d, i0, s.Lq, rows, 0, g.dpad);
          load_tile(TKs, L.ldt, p.tk + pi * kv_stride + kv_off, g.d, j0, hi, BN, 0, g.dpad);
          load_tile(TVs, L.ldt, p.tv + pi * kv_stride + kv_off, g.d, j0, hi, BN, 0, g.dpad);
          __syncthreads();
        }
        float sp[KT][4], dpp[KT][4], xv[KT][4];
        zero<T, KT>(sp);
        zero<T, KT>(dpp);
        zero<T, KT>(xv);
        mma_abt<T, KT>(sp, TQs + warp * 16 * L.ldr, L.ldr, Ks, L.ldt, g.dpad);
        mma_abt<T, KT>(sp, Qs + warp * 16 * L.ldr, L.ldr, TKs, L.ldt, g.dpad);
        mma_abt<T, KT>(dpp, gOTs + warp * 16 * L.ldr, L.ldr, Vs, L.ldt, g.dpad);   // dP' = gO' V^T
        mma_abt<T, KT>(xv, gOTs + warp * 16 * L.ldr, L.ldr, TVs, L.ldt, g.dpad);   // gO' V'^T
        float rp[2], dl[2];
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const int64_t i = x == 0 ? ra : rb;
          rp[x] = i < s.Lq ? p.r[(pi * BH + bh) * g.Nq + i] : 0.0f;
          dl[x] = i < s.Lq ? p.dprime[(pi * BH + bh) * g.Nq + i] : 0.0f;
        }
#pragma unroll
        for (int nt = 0; nt < KT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int x = e >> 1;
            const float spv = sp[nt][e] * g.scale;
            gp[nt][e] += xv[nt][e] + dpp[nt][e] * (spv - rp[x]) - spv * dl[x];
            dpp[nt][e] = ok[nt][e] ? pr[nt][e] * (dpp[nt][e] - dl[x]) : 0.0f;  // gS'_p
          }
        mma_pb<T, KT, NO>(acc, dpp, TKs + c0, L.ldt, n_active, scratch);  // += gS'_p K'_p
      }
#pragma unroll
      for (int nt = 0; nt < KT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) gp[nt][e] = ok[nt][e] ? pr[nt][e] * (gp[nt][e] - D[e >> 1]) : 0.0f;  // gS
      mma_pb<T, KT, NO>(acc, gp, Ks + c0, L.ldt, n_active, scratch);  // += gS K
    } else {
      mma_abt<T, KT>(gp, gOTs + warp * 16 * L.ldr, L.ldr, Vs, L.ldt, g.dpad);  // dP'_p
      float dl[2];
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const int64_t i = x == 0 ? ra : rb;
        dl[x] = i < s.Lq ? p.dprime[(first * BH + bh) * g.Nq + i] : 0.0f;
      }
#pragma unroll
      for (int nt = 0; nt < KT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) gp[nt][e] = ok[nt][e] ? pr[nt][e] * (gp[nt][e] - dl[e >> 1]) : 0.0f;
      mma_pb<T, KT, NO>(acc, gp, Ks + c0, L.ldt, n_active, scratch);  // gQ'_p += gS'_p K
    }
  }
  T* out = target == 0 ? p.dq : p.dtq + first * q_stride;
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int64_t i = x == 0 ? ra : rb;
    if (i >= g.Nq) continue;
    T* row = out + (bh * g.Nq + i) * g.d + c0;
#pragma unroll
    for (int nt = 0; nt < NO; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = nt * 8 + 2 * tq4 + e;
        if (nt < n_active && c0 + c < g.d) row[c] = Cvt<T>::from_f(g.scale * acc[nt][2 * x + e]);
      }
  }
}

// Key side: grid x = key tiles * B * Hkv, z = (1 + P) * nchunks. Each warp owns 16 keys; the block
// loops over the query tiles of every query head of its GQA group.
template <typename T>
__global__ void __launch_bounds__(128) attention_jvp_bwd_kv_kernel(const JvpBwdParams<T> p) {
  CONDINIT_DYNAMIC_SMEM(smem);
  constexpr int BM = kJbKvBm, KT = BM / 8, NO = kCols / 8;
  const Geometry& g = p.g;
  const int nwarps = blockDim.x >> 5, rows = 16 * nwarps;
  const GenLayout L = gen_layout((int)sizeof(T), g.dpad, rows, 4, BM, 4, 4, kSimt<T>);
  T* Ks = reinterpret_cast<T*>(smem + L.row[0]);
  T* Vs = reinterpret_cast<T*>(smem + L.row[1]);
  T* TKs = reinterpret_cast<T*>(smem + L.row[2]);
  T* TVs = reinterpret_cast<T*>(smem + L.row[3]);
  T* Qs = reinterpret_cast<T*>(smem + L.loop[0]);
  T* gOs = reinterpret_cast<T*>(smem + L.loop[1]);
  T* TQs = reinterpret_cast<T*>(smem + L.loop[2]);
  T* gOTs = reinterpret_cast<T*>(smem + L.loop[3]);
  float* lse_s = reinterpret_cast<float*>(smem + L.stats[0]);
  float* D_s = reinterpret_cast<float*>(smem + L.stats[1]);
  float* r_s = reinterpret_cast<float*>(smem + L.stats[2]);
  float* dl_s = reinterpret_cast<float*>(smem + L.stats[3]);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq4 = lane & 3;
  float* scratch = reinterpret_cast<float*>(smem + L.scratch) + warp * 16 * L.lds;

  const int64_t nkt = (g.Nk + rows - 1) / rows;
  const int64_t bhk = (int64_t)blockIdx.x / nkt, b = bhk / g.Hkv, hk = bhk % g.Hkv, G = g.H / g.Hkv;
  const int64_t j0 = ((int64_t)blockIdx.x % nkt) * rows;
  const int chunk = (int)(blockIdx.z % g.nchunks);
  const int64_t target = blockIdx.z / g.nchunks, P = p.P, BH = g.B * g.H;
  const int c0 = chunk * kCols, ncols = min_int(kCols, g.dpad - c0), n_active = ncols / 8;
  const Seq s = seq_of(g, b);
  const int64_t ka = j0 + warp * 16 + gq, kb = ka + 8;
  const int64_t kv_off = bhk * g.Nk * g.d, q_stride = BH * g.Nq * g.d, kv_stride = g.B * g.Hkv * g.Nk * g.d;
  const bool per_probe = target == 0 && P > 1;
  const int64_t first = target == 0 ? 0 : target - 1;

  load_tile(Ks, L.ldr, p.k + kv_off, g.d, j0, s.Lk, rows, 0, g.dpad);
  load_tile(Vs, L.ldr, p.v + kv_off, g.d, j0, s.Lk, rows, 0, g.dpad);
  if (target == 0 && !per_probe) {
    load_tile(TKs, L.ldr, p.tk + kv_off, g.d, j0, s.Lk, rows, 0, g.dpad);
    load_tile(TVs, L.ldr, p.tv + kv_off, g.d, j0, s.Lk, rows, 0, g.dpad);
  }
  float acc_k[NO][4], acc_v[NO][4];
  zero<T, NO>(acc_k);
  zero<T, NO>(acc_v);

  int64_t lo, hi;
  query_range(g, s, j0, j0 + rows, lo, hi);
  for (int64_t gh = 0; gh < G; ++gh) {
    const int64_t bh = b * g.H + hk * G + gh, q_off = bh * g.Nq * g.d;
    for (int64_t i0 = lo; i0 < hi; i0 += BM) {
      __syncthreads();
      load_tile(Qs, L.ldt, p.q + q_off, g.d, i0, hi, BM, 0, g.dpad);
      if (target == 0) load_tile(gOs, L.ldt, p.gout + q_off, g.d, i0, hi, BM, 0, g.dpad);
      if (!per_probe) {
        if (target == 0) load_tile(TQs, L.ldt, p.tq + q_off, g.d, i0, hi, BM, 0, g.dpad);
        load_tile(gOTs, L.ldt, p.gtout + first * q_stride + q_off, g.d, i0, hi, BM, 0, g.dpad);
      }
      for (int c = threadIdx.x; c < BM; c += blockDim.x) {
        const int64_t i = i0 + c;
        const bool in = i < hi;
        lse_s[c] = in ? p.lse[bh * g.Nq + i] : kNegInf;
        D_s[c] = in ? p.D[bh * g.Nq + i] : 0.0f;
        r_s[c] = in ? p.r[(first * BH + bh) * g.Nq + i] : 0.0f;
        dl_s[c] = in ? p.dprime[(first * BH + bh) * g.Nq + i] : 0.0f;
      }
      __syncthreads();
      float pt[KT][4], gpt[KT][4];
      zero<T, KT>(pt);
      zero<T, KT>(gpt);
      mma_abt<T, KT>(pt, Ks + warp * 16 * L.ldr, L.ldr, Qs, L.ldt, g.dpad);  // S^T
      bool ok[KT][4];
#pragma unroll
      for (int nt = 0; nt < KT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = nt * 8 + 2 * tq4 + (e & 1);
          const float lse = lse_s[c];
          ok[nt][e] = allowed(g, s, i0 + c, e < 2 ? ka : kb) && lse != kNegInf;
          pt[nt][e] = ok[nt][e] ? exp2f((pt[nt][e] * g.scale - lse) * kLog2e) : 0.0f;  // P^T
        }
      if (target == 0) {
        mma_abt<T, KT>(gpt, Vs + warp * 16 * L.ldr, L.ldr, gOs, L.ldt, g.dpad);  // (gO V^T)^T
        for (int64_t pi = 0; pi < P; ++pi) {
          if (per_probe) {
            __syncthreads();
            load_tile(TKs, L.ldr, p.tk + pi * kv_stride + kv_off, g.d, j0, s.Lk, rows, 0, g.dpad);
            load_tile(TVs, L.ldr, p.tv + pi * kv_stride + kv_off, g.d, j0, s.Lk, rows, 0, g.dpad);
            load_tile(TQs, L.ldt, p.tq + pi * q_stride + q_off, g.d, i0, hi, BM, 0, g.dpad);
            load_tile(gOTs, L.ldt, p.gtout + pi * q_stride + q_off, g.d, i0, hi, BM, 0, g.dpad);
            for (int c = threadIdx.x; c < BM; c += blockDim.x) {
              const int64_t i = i0 + c;
              r_s[c] = i < hi ? p.r[(pi * BH + bh) * g.Nq + i] : 0.0f;
              dl_s[c] = i < hi ? p.dprime[(pi * BH + bh) * g.Nq + i] : 0.0f;
            }
            __syncthreads();
          }
          float spt[KT][4], dppt[KT][4], xt[KT][4];
          zero<T, KT>(spt);
          zero<T, KT>(dppt);
          zero<T, KT>(xt);
          mma_abt<T, KT>(spt, Ks + warp * 16 * L.ldr, L.ldr, TQs, L.ldt, g.dpad);   // (Q' K^T)^T
          mma_abt<T, KT>(spt, TKs + warp * 16 * L.ldr, L.ldr, Qs, L.ldt, g.dpad);   // (Q K'^T)^T
          mma_abt<T, KT>(dppt, Vs + warp * 16 * L.ldr, L.ldr, gOTs, L.ldt, g.dpad); // dP'^T
          mma_abt<T, KT>(xt, TVs + warp * 16 * L.ldr, L.ldr, gOTs, L.ldt, g.dpad);  // (gO' V'^T)^T
#pragma unroll
          for (int nt = 0; nt < KT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int c = nt * 8 + 2 * tq4 + (e & 1);
              const float spv = spt[nt][e] * g.scale, rr = r_s[c], dl = dl_s[c];
              gpt[nt][e] += xt[nt][e] + dppt[nt][e] * (spv - rr) - spv * dl;
              dppt[nt][e] = ok[nt][e] ? pt[nt][e] * (dppt[nt][e] - dl) : 0.0f;  // gS'^T
              spt[nt][e] = ok[nt][e] ? pt[nt][e] * (spv - rr) : 0.0f;           // P'^T
            }
          mma_pb<T, KT, NO>(acc_k, dppt, TQs + c0, L.ldt, n_active, scratch);  // += gS'^T Q'
          mma_pb<T, KT, NO>(acc_v, spt, gOTs + c0, L.ldt, n_active, scratch);  // += P'^T gO'
        }
#pragma unroll
        for (int nt = 0; nt < KT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = nt * 8 + 2 * tq4 + (e & 1);
            gpt[nt][e] = ok[nt][e] ? pt[nt][e] * (gpt[nt][e] - D_s[c]) : 0.0f;  // gS^T
          }
        mma_pb<T, KT, NO>(acc_k, gpt, Qs + c0, L.ldt, n_active, scratch);  // += gS^T Q
        mma_pb<T, KT, NO>(acc_v, pt, gOs + c0, L.ldt, n_active, scratch);  // += P^T gO
      } else {
        mma_abt<T, KT>(gpt, Vs + warp * 16 * L.ldr, L.ldr, gOTs, L.ldt, g.dpad);  // dP'^T_p
#pragma unroll
        for (int nt = 0; nt < KT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = nt * 8 + 2 * tq4 + (e & 1);
            gpt[nt][e] = ok[nt][e] ? pt[nt][e] * (gpt[nt][e] - dl_s[c]) : 0.0f;  // gS'^T_p
          }
        mma_pb<T, KT, NO>(acc_k, gpt, Qs + c0, L.ldt, n_active, scratch);   // gK'_p += gS'^T_p Q
        mma_pb<T, KT, NO>(acc_v, pt, gOTs + c0, L.ldt, n_active, scratch);  // gV'_p += P^T gO'_p
      }
    }
  }
  T* out_k = target == 0 ? p.dk : p.dtk + first * kv_stride;
  T* out_v = target == 0 ? p.dv : p.dtv + first * kv_stride;
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int64_t j = x == 0 ? ka : kb;
    if (j >= g.Nk) continue;
    T* krow = out_k + (bhk * g.Nk + j) * g.d + c0;
    T* vrow = out_v + (bhk * g.Nk + j) * g.d + c0;
#pragma unroll
    for (int nt = 0; nt < NO; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = nt * 8 + 2 * tq4 + e;
        if (nt < n_active && c0 + c < g.d) {
          krow[c] = Cvt<T>::from_f(g.scale * acc_k[nt][2 * x + e]);
          vrow[c] = Cvt<T>::from_f(acc_v[nt][2 * x + e]);
        }
      }
  }
}

// ------------------------------------------------------------------------------------------------
// Launch helpers

int elem_size(DType dt) { return dt == DType::kFloat32 ? 4 : 2; }

size_t plan_bytes(int kind, int elem, int dpad, int warps) {
  const bool simt = elem == 4;
  switch (kind) {
    case 0: return fwd_layout(0, elem, dpad, 16 * warps, simt ? 32 : 64, simt).total;
    case 1: return fwd_layout(1, elem, dpad, 16 * warps, simt ? 16 : 32, simt).total;
    case 2: return fwd_layout(2, elem, dpad, 16 * warps, simt ? 32 : 64, simt).total;
    case 3: return dkdv_layout(elem, dpad, 16 * warps, simt).total;
    case 4: return gen_layout(elem, dpad, 16 * warps, 2, simt ? 32 : 64, 2, 0, simt).total;
    case 5: return gen_layout(elem, dpad, 16 * warps, 4, simt ? 16 : 32, 4, 0, simt).total;
    default: return gen_layout(elem, dpad, 16 * warps, 4, kJbKvBm, 4, 4, simt).total;
  }
}

int loop_tile(int kind, int elem) {
  const bool simt = elem == 4;
  switch (kind) {
    case 0: return simt ? 32 : 64;
    case 1: return simt ? 16 : 32;
    case 2: return simt ? 32 : 64;
    case 3: return kDkdvBm;
    case 4: return simt ? 32 : 64;
    case 5: return simt ? 16 : 32;
    default: return kJbKvBm;
  }
}

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
cudaError_t plan_launch(int kind, DType dt, const Shape& s, int64_t rows_total, int64_t heads, int64_t zdim,
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

template <typename T>
cudaError_t launch_fwd(DType dt, const Shape& s, int64_t P, const void* q, const void* k, const void* v,
                       const void* tq, const void* tk, const void* tv, void* out, void* tout, float* lse,
                       cudaStream_t stream) {
  const Geometry g = geometry_of(s);
  const bool jvp = P > 0;
  LaunchPlan plan;
  dim3 grid;
  cudaError_t err = plan_launch(jvp ? 1 : 0, dt, s, s.Nq, s.B * s.H, (int64_t)g.nchunks * (jvp ? P : 1), plan, grid);
  if (err != cudaSuccess) return err;
  FwdParams<T> p;
  p.g = g;
  p.q = static_cast<const T*>(q);
  p.k = static_cast<const T*>(k);
  p.v = static_cast<const T*>(v);
  p.tq = static_cast<const T*>(tq);
  p.tk = static_cast<const T*>(tk);
  p.tv = static_cast<const T*>(tv);
  p.out = static_cast<T*>(out);
  p.tout = static_cast<T*>(tout);
  p.lse = lse;
  if (jvp) {
    void (*kernel)(const FwdParams<T>) = attention_fwd_kernel<T, true>;
    if ((err = set_smem(kernel, plan.smem_bytes)) != cudaSuccess) return err;
    CONDINIT_LAUNCH(kernel, grid, 32 * plan.warps, plan.smem_bytes, stream, p);
  } else {
    void (*kernel)(const FwdParams<T>) = attention_fwd_kernel<T, false>;
    if ((err = set_smem(kernel, plan.smem_bytes)) != cudaSuccess) return err;
    CONDINIT_LAUNCH(kernel, grid, 32 * plan.warps, plan.smem_bytes, stream, p);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd(DType dt, const Shape& s, const void* dout, const void* q, const void* k, const void* v,
                       const float* lse, const float* Dvec, void* dq, void* dk, void* dv, cudaStream_t stream) {
  const Geometry g = geometry_of(s);
  BwdParams<T> p;
  p.g = g;
  p.dout = static_cast<const T*>(dout);
  p.q = static_cast<const T*>(q);
  p.k = static_cast<const T*>(k);
  p.v = static_cast<const T*>(v);
  p.lse = lse;
  p.Dvec = Dvec;
  p.dq = static_cast<T*>(dq);
  p.dk = static_cast<T*>(dk);
  p.dv = static_cast<T*>(dv);
  LaunchPlan plan;
  dim3 grid;
  cudaError_t err = plan_launch(2, dt, s, s.Nq, s.B * s.H, g.nchunks, plan, grid);
  if (err != cudaSuccess) return err;
  void (*dq_kernel)(const BwdParams<T>) = attention_dq_kernel<T>;
  if ((err = set_smem(dq_kernel, plan.smem_bytes)) != cudaSuccess) return err;
  CONDINIT_LAUNCH(dq_kernel, grid, 32 * plan.warps, plan.smem_bytes, stream, p);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if ((err = plan_launch(3, dt, s, s.Nk, s.B * s.Hkv, g.nchunks, plan, grid)) != cudaSuccess) return err;
  void (*dkdv_kernel)(const BwdParams<T>) = attention_dkdv_kernel<T>;
  if ((err = set_smem(dkdv_kernel, plan.smem_bytes)) != cudaSuccess) return err;
  CONDINIT_LAUNCH(dkdv_kernel, grid, 32 * plan.warps, plan.smem_bytes, stream, p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_jvp_bwd_r(DType dt, const Shape& s, int64_t P, const void* q, const void* k, const void* tq,
                             const void* tk, const float* lse, float* r, cudaStream_t stream) {
  JvpBwdParams<T> p{};
  p.g = geometry_of(s);
  p.P = P;
  p.q = static_cast<const T*>(q);
  p.k = static_cast<const T*>(k);
  p.tq = static_cast<const T*>(tq);
  p.tk = static_cast<const T*>(tk);
  p.lse = lse;
  p.r_out = r;
  LaunchPlan plan;
  dim3 grid;
  cudaError_t err = plan_launch(4, dt, s, s.Nq, s.B * s.H, P, plan, grid);
  if (err != cudaSuccess) return err;
  void (*kernel)(const JvpBwdParams<T>) = attention_jvp_r_kernel<T>;
  if ((err = set_smem(kernel, plan.smem_bytes)) != cudaSuccess) return err;
  CONDINIT_LAUNCH(kernel, grid, 32 * plan.warps, plan.smem_bytes, stream, p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_jvp_bwd(DType dt, const Shape& s, int64_t P, const JvpBwdPointers& a, cudaStream_t stream) {
  JvpBwdParams<T> p{};
  p.g = geometry_of(s);
  p.P = P;
  p.gout = static_cast<const T*>(a.gout);
  p.gtout = static_cast<const T*>(a.gtout);
  p.q = static_cast<const T*>(a.q);
  p.k = static_cast<const T*>(a.k);
  p.v = static_cast<const T*>(a.v);
  p.tq = static_cast<const T*>(a.tq);
  p.tk = static_cast<const T*>(a.tk);
  p.tv = static_cast<const T*>(a.tv);
  p.lse = a.lse;
  p.r = a.r;
  p.dprime = a.dprime;
  p.D = a.D;
  p.dq = static_cast<T*>(a.dq);
  p.dk = static_cast<T*>(a.dk);
  p.dv = static_cast<T*>(a.dv);
  p.dtq = static_cast<T*>(a.dtq);
  p.dtk = static_cast<T*>(a.dtk);
  p.dtv = static_cast<T*>(a.dtv);
  LaunchPlan plan;
  dim3 grid;
  cudaError_t err = plan_launch(5, dt, s, s.Nq, s.B * s.H, (1 + P) * p.g.nchunks, plan, grid);
  if (err != cudaSuccess) return err;
  void (*q_kernel)(const JvpBwdParams<T>) = attention_jvp_bwd_q_kernel<T>;
  if ((err = set_smem(q_kernel, plan.smem_bytes)) != cudaSuccess) return err;
  CONDINIT_LAUNCH(q_kernel, grid, 32 * plan.warps, plan.smem_bytes, stream, p);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if ((err = plan_launch(6, dt, s, s.Nk, s.B * s.Hkv, (1 + P) * p.g.nchunks, plan, grid)) != cudaSuccess) return err;
  void (*kv_kernel)(const JvpBwdParams<T>) = attention_jvp_bwd_kv_kernel<T>;
  if ((err = set_smem(kv_kernel, plan.smem_bytes)) != cudaSuccess) return err;
  CONDINIT_LAUNCH(kv_kernel, grid, 32 * plan.warps, plan.smem_bytes, stream, p);
  return cudaGetLastError();
}

}  // namespace

bool head_dim_supported(int64_t d) { return d >= 1 && d <= kMaxHeadDim; }

LaunchPlan launch_plan(int kind, DType dtype, int64_t d, size_t smem_limit) {
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

cudaError_t fwd(DType dtype, const Shape& s, const void* q, const void* k, const void* v, void* out, float* lse,
                cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      return launch_fwd<float>(dtype, s, 0, q, k, v, nullptr, nullptr, nullptr, out, nullptr, lse, stream);
    case DType::kFloat16:
      return launch_fwd<__half>(dtype, s, 0, q, k, v, nullptr, nullptr, nullptr, out, nullptr, lse, stream);
    case DType::kBFloat16:
      return launch_fwd<__nv_bfloat16>(dtype, s, 0, q, k, v, nullptr, nullptr, nullptr, out, nullptr, lse, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t jvp(DType dtype, const Shape& s, int64_t P, const void* q, const void* k, const void* v, const void* tq,
                const void* tk, const void* tv, void* out, void* tout, float* lse, cudaStream_t stream) {
  if (P < 1) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32:
      return launch_fwd<float>(dtype, s, P, q, k, v, tq, tk, tv, out, tout, lse, stream);
    case DType::kFloat16:
      return launch_fwd<__half>(dtype, s, P, q, k, v, tq, tk, tv, out, tout, lse, stream);
    case DType::kBFloat16:
      return launch_fwd<__nv_bfloat16>(dtype, s, P, q, k, v, tq, tk, tv, out, tout, lse, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t bwd(DType dtype, const Shape& s, const void* dout, const void* q, const void* k, const void* v,
                const float* lse, const float* Dvec, void* dq, void* dk, void* dv, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      return launch_bwd<float>(dtype, s, dout, q, k, v, lse, Dvec, dq, dk, dv, stream);
    case DType::kFloat16:
      return launch_bwd<__half>(dtype, s, dout, q, k, v, lse, Dvec, dq, dk, dv, stream);
    case DType::kBFloat16:
      return launch_bwd<__nv_bfloat16>(dtype, s, dout, q, k, v, lse, Dvec, dq, dk, dv, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t jvp_bwd_r(DType dtype, const Shape& s, int64_t P, const void* q, const void* k, const void* tq,
                      const void* tk, const float* lse, float* r, cudaStream_t stream) {
  if (P < 1) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32: return launch_jvp_bwd_r<float>(dtype, s, P, q, k, tq, tk, lse, r, stream);
    case DType::kFloat16: return launch_jvp_bwd_r<__half>(dtype, s, P, q, k, tq, tk, lse, r, stream);
    case DType::kBFloat16: return launch_jvp_bwd_r<__nv_bfloat16>(dtype, s, P, q, k, tq, tk, lse, r, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t jvp_bwd(DType dtype, const Shape& s, int64_t P, const JvpBwdPointers& a, cudaStream_t stream) {
  if (P < 1) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32: return launch_jvp_bwd<float>(dtype, s, P, a, stream);
    case DType::kFloat16: return launch_jvp_bwd<__half>(dtype, s, P, a, stream);
    case DType::kBFloat16: return launch_jvp_bwd<__nv_bfloat16>(dtype, s, P, a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace attention_cuda
}  // namespace condinit
