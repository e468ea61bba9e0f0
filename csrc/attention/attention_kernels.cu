// CUDA kernels of the fused attention op (forward, multi-probe JVP, flash backward); the math is in
// attention_cpu.cpp's header comment and docs/design.md, "Attention".
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
// * fp16 / bf16: mma.sync.m16n8k16 with fp32 accumulation (sm_80+). fp32: the same fragments
//   computed with fp32 FMAs from shared memory (exact fp32, no TF32); P goes through a per-warp
//   shared scratch tile there.
// * Head dim d (1..256) is padded to dpad, a multiple of 16; the output columns are split into
//   chunks of kCols columns (a grid dimension), so accumulators have a fixed size in registers.
// * Masks (attention_cuda.h): a block visits only the key (query) tiles that some row of it may
//   attend; element masks are selects (never arithmetic), so masked entries holding NaN/Inf do not
//   contribute to scores. A NaN in an allowed entry propagates through exp into the row's outputs.
// * JVP: one block per (query tile, head, output chunk, probe): the probe's accumulators stay in
//   registers; the primal (S, exp, m, l) is recomputed per probe and written by the probe-0 blocks.
// * Backward: deterministic; dq in one kernel (blocks over query tiles, loop over key tiles), dk and
//   dv in another (blocks over key tiles, loop over query tiles of every head of the GQA group).
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
template <typename T>
__device__ __forceinline__ uint32_t pair2(const T* lo, const T* hi) {
  return bits16(*lo) | (bits16(*hi) << 16);
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
#if defined(CONDINIT_ATTN_EMU)
  emu_mma_m16n8k16(std::is_same<T, __half>::value, c, a, b);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
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
#else
  __trap();  // the launchers refuse 16-bit dtypes below sm_80
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
    static_assert(KT % 2 == 0, "the key tile must be a multiple of 16");
#pragma unroll
    for (int ks = 0; ks < KT / 2; ++ks) {
      const uint32_t a[4] = {pack2<T>(p[2 * ks][0], p[2 * ks][1]), pack2<T>(p[2 * ks][2], p[2 * ks][3]),
                             pack2<T>(p[2 * ks + 1][0], p[2 * ks + 1][1]),
                             pack2<T>(p[2 * ks + 1][2], p[2 * ks + 1][3])};
      const T* b0 = B + (16 * ks + 2 * t) * ldb + g;
#pragma unroll
      for (int nt = 0; nt < NO; ++nt) {
        if (nt < n_active) {
          const T* col = b0 + nt * 8;
          const uint32_t b[2] = {pair2(col, col + ldb), pair2(col + 8 * ldb, col + 9 * ldb)};
          mma_16816<T>(c[nt], a, b);
        }
      }
    }
  }
}

// dst[r][c] (r < R, c < width, leading dim ld) = src[(row0 + r) * d + c0 + c] where row0 + r < nrows
// and c0 + c < d, else 0. All threads of the block take part.
template <typename T>
__device__ void load_tile(T* dst, int ld, const T* src, int d, int64_t row0, int64_t nrows, int R, int c0,
                          int width) {
  constexpr int kVec = 16 / sizeof(T);
  if (d % kVec == 0 && c0 % kVec == 0) {  // width is a multiple of 16 elements
    const int chunks = width / kVec;
    for (int idx = threadIdx.x; idx < R * chunks; idx += blockDim.x) {
      const int r = idx / chunks, c = (idx - r * chunks) * kVec;
      int4 val = make_int4(0, 0, 0, 0);
      if (row0 + r < nrows && c0 + c < d) val = *reinterpret_cast<const int4*>(src + (row0 + r) * d + c0 + c);
      *reinterpret_cast<int4*>(dst + r * ld + c) = val;
    }
  } else {
    for (int idx = threadIdx.x; idx < R * width; idx += blockDim.x) {
      const int r = idx / width, c = idx - r * width;
      T val = Cvt<T>::from_f(0.0f);
      if (row0 + r < nrows && c0 + c < d) val = src[(row0 + r) * d + c0 + c];
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
  size_t q, tq, k, tk, v, tv, scratch, total;
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
// Grid: x = query tiles, y = B * H, z = nchunks * probes (z = probe * nchunks + chunk).

template <typename T>
struct FwdParams {
  Geometry g;
  const T *q, *k, *v, *tq, *tk, *tv;
  T *out, *tout;
  float* lse;
};

template <typename T, bool JVP>
__global__ void __launch_bounds__(128) attention_fwd_kernel(const FwdParams<T> p) {
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

  const int64_t bh = blockIdx.y, b = bh / g.H, h = bh % g.H, hk = h / (g.H / g.Hkv);
  const int chunk = (int)(blockIdx.z % g.nchunks);
  const int64_t probe = blockIdx.z / g.nchunks;
  const int c0 = chunk * kCols, ncols = min_int(kCols, g.dpad - c0), n_active = ncols / 8;
  const int64_t nqt = (g.Nq + rows - 1) / rows;
  const int64_t i0 = (nqt - 1 - (int64_t)blockIdx.x) * rows;  // the longest causal rows start first
  const Seq s = seq_of(g, b);
  const int64_t ra = i0 + warp * 16 + gq, rb = ra + 8;  // this lane's two rows

  const int64_t q_off = bh * g.Nq * g.d, kv_off = (b * g.Hkv + hk) * g.Nk * g.d;
  load_tile(Qs, L.ldq, p.q + q_off, g.d, i0, s.Lq, rows, 0, g.dpad);
  if constexpr (JVP) {
    const int64_t BH = g.B * g.H, BHk = g.B * g.Hkv;
    load_tile(TQs, L.ldq, p.tq + probe * BH * g.Nq * g.d + q_off, g.d, i0, s.Lq, rows, 0, g.dpad);
    (void)BHk;
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

  int64_t lo, hi;
  key_range(g, s, i0, i0 + rows, lo, hi);
  for (int64_t j0 = lo; j0 < hi; j0 += BN) {
    __syncthreads();  // every warp is done with the previous tiles
    load_tile(Ks, L.ldk, Kg, g.d, j0, hi, BN, 0, g.dpad);
    load_tile(Vs, L.ldv, Vg, g.d, j0, hi, BN, c0, ncols);
    if constexpr (JVP) {
      load_tile(TKs, L.ldk, TKg, g.d, j0, hi, BN, 0, g.dpad);
      load_tile(TVs, L.ldv, TVg, g.d, j0, hi, BN, c0, ncols);
    }
    __syncthreads();

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
  float inv[2], rl[2];
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    inv[x] = l[x] == 0.0f ? 0.0f : 1.0f / l[x];
    rl[x] = r[x] * inv[x];
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
          if (nt < n_active && c0 + c < g.d) orow[c] = Cvt<T>::from_f(o[nt][2 * x + e] * inv[x]);
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
            trow[c] = Cvt<T>::from_f(ot[nt][2 * x + e] * inv[x] - rl[x] * (o[nt][2 * x + e] * inv[x]));
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

// dq: grid x = query tiles, y = B * H, z = nchunks.
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

  const int64_t bh = blockIdx.y, b = bh / g.H, h = bh % g.H, hk = h / (g.H / g.Hkv);
  const int chunk = (int)blockIdx.z;
  const int c0 = chunk * kCols, ncols = min_int(kCols, g.dpad - c0), n_active = ncols / 8;
  const int64_t nqt = (g.Nq + rows - 1) / rows;
  const int64_t i0 = (nqt - 1 - (int64_t)blockIdx.x) * rows;
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

// dk, dv: grid x = key tiles, y = B * Hkv, z = nchunks. Each warp owns 16 keys; the block loops over
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

  const int64_t bhk = blockIdx.y, b = bhk / g.Hkv, hk = bhk % g.Hkv, G = g.H / g.Hkv;
  const int chunk = (int)blockIdx.z;
  const int c0 = chunk * kCols, ncols = min_int(kCols, g.dpad - c0), n_active = ncols / 8;
  const int64_t j0 = (int64_t)blockIdx.x * rows;
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
// Launch helpers

int elem_size(DType dt) { return dt == DType::kFloat32 ? 4 : 2; }

size_t plan_bytes(int kind, int elem, int dpad, int warps) {
  const bool simt = elem == 4;
  switch (kind) {
    case 0: return fwd_layout(0, elem, dpad, 16 * warps, simt ? 32 : 64, simt).total;
    case 1: return fwd_layout(1, elem, dpad, 16 * warps, simt ? 16 : 32, simt).total;
    case 2: return fwd_layout(2, elem, dpad, 16 * warps, simt ? 32 : 64, simt).total;
    default: return dkdv_layout(elem, dpad, 16 * warps, simt).total;
  }
}

int loop_tile(int kind, int elem) {
  const bool simt = elem == 4;
  switch (kind) {
    case 0: return simt ? 32 : 64;
    case 1: return simt ? 16 : 32;
    case 2: return simt ? 32 : 64;
    default: return kDkdvBm;
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
cudaError_t plan_launch(int kind, DType dt, const Shape& s, int64_t rows_total, int64_t zdim, LaunchPlan& plan,
                        dim3& grid) {
  if (!head_dim_supported(s.d)) return cudaErrorInvalidValue;
  const DeviceInfo dev = device_info();
  if (dt != DType::kFloat32 && dev.major < 8) return cudaErrorNotSupported;
  plan = launch_plan(kind, dt, s.d, (size_t)dev.smem_optin);
  if (plan.warps == 0) return cudaErrorInvalidConfiguration;
  const int64_t tiles = (rows_total + 16 * plan.warps - 1) / (16 * plan.warps);
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
  cudaError_t err = plan_launch(jvp ? 1 : 0, dt, s, s.Nq, (int64_t)g.nchunks * (jvp ? P : 1), plan, grid);
  if (err != cudaSuccess) return err;
  if (s.B * s.H > 65535) return cudaErrorInvalidConfiguration;
  grid.y = (unsigned)(s.B * s.H);
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
  cudaError_t err = plan_launch(2, dt, s, s.Nq, g.nchunks, plan, grid);
  if (err != cudaSuccess) return err;
  if (s.B * s.H > 65535) return cudaErrorInvalidConfiguration;
  grid.y = (unsigned)(s.B * s.H);
  void (*dq_kernel)(const BwdParams<T>) = attention_dq_kernel<T>;
  if ((err = set_smem(dq_kernel, plan.smem_bytes)) != cudaSuccess) return err;
  CONDINIT_LAUNCH(dq_kernel, grid, 32 * plan.warps, plan.smem_bytes, stream, p);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if ((err = plan_launch(3, dt, s, s.Nk, g.nchunks, plan, grid)) != cudaSuccess) return err;
  if (s.B * s.Hkv > 65535) return cudaErrorInvalidConfiguration;
  grid.y = (unsigned)(s.B * s.Hkv);
  void (*dkdv_kernel)(const BwdParams<T>) = attention_dkdv_kernel<T>;
  if ((err = set_smem(dkdv_kernel, plan.smem_bytes)) != cudaSuccess) return err;
  CONDINIT_LAUNCH(dkdv_kernel, grid, 32 * plan.warps, plan.smem_bytes, stream, p);
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

}  // namespace attention_cuda
}  // namespace condinit
