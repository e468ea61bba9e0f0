// CUDA kernels of the fused attention op (forward, multi-probe JVP, flash backward); the math is in
// attention_cpu.cpp's header comment and docs/design.md, "Attention".
//
// Design (correctness first, then tensor cores):
// * One CTA per (batch, head, tile of BM queries) for fwd/jvp, per (batch, kv head, tile of BN keys)
//   for bwd. Each warp owns 16 rows of the tile (query rows in fwd/jvp, key rows in bwd) for every
//   phase, so row-wise softmax work needs only __syncwarp; __syncthreads guards the shared K/V (fwd,
//   jvp) or Q/dO (bwd) tiles, staged through shared memory with 16-byte loads, zero-filled past the end.
// * Tile products are warp-level: fp16/bf16 use WMMA 16x16x16 fragments with fp32 accumulation
//   (sm_80+); fp32 uses plain fp32 FMA loops (exact fp32, no TF32). Scores, probabilities and
//   accumulators live in fp32 shared memory; only the operands of products are in the input dtype.
// * The JVP keeps the primal accumulator O in shared memory and the per-probe accumulators
//   (accT_p = P~ V'_p + (P~ o S'_p) V, r_p) in a global fp32 workspace that the CTA owns row-wise, so
//   any number of probes shares one S / exp / m / l computation per tile.
// * bwd: dK and dV accumulate in shared memory over all query tiles and all query heads of the
//   GQA group; dQ contributions are added with fp32 atomics into dq_acc.
// * Tile sizes are picked at launch from the largest that fits the device's shared memory.
#include "attention_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>
#include <type_traits>

namespace condinit {
namespace attention_cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -__builtin_huge_valf();

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
constexpr bool kUseWmma = !std::is_same<T, float>::value;

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// ------------------------------------------------------------------------------------------------
// Warp-level tile products. C is fp32 (shared or global memory, row-major, ldc); A and B are in T.
// All leading dimensions are multiples of 8 elements (16 bytes) and every fragment pointer is
// 32-byte aligned (tile offsets are multiples of 16 rows/columns), as WMMA requires.
// Each function ends with __syncwarp() so that the lanes may read C elementwise afterwards.

// C[16 x n] = (accumulate ? C : 0) + A[16 x k] B^T, B stored [n x k] row-major.
template <typename T>
__device__ void warp_mm_nt(float* C, int ldc, const T* A, int lda, const T* B, int ldb, int n, int k,
                           bool accumulate) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kUseWmma<T>) {
    using namespace nvcuda;
    for (int j = 0; j < n; j += 16) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
      if (accumulate) wmma::load_matrix_sync(c, C + j, ldc, wmma::mem_row_major);
      else wmma::fill_fragment(c, 0.0f);
      for (int kk = 0; kk < k; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;  // B^T: (kk, j) at B[j * ldb + kk]
        wmma::load_matrix_sync(a, A + kk, lda);
        wmma::load_matrix_sync(b, B + (int64_t)j * ldb + kk, ldb);
        wmma::mma_sync(c, a, b, c);
      }
      wmma::store_matrix_sync(C + j, c, ldc, wmma::mem_row_major);
    }
    __syncwarp();
    return;
  }
#endif
  const int lane = threadIdx.x & 31;
  for (int idx = lane; idx < 16 * n; idx += 32) {
    const int i = idx / n, j = idx - i * n;
    float s = accumulate ? C[(int64_t)i * ldc + j] : 0.0f;
    const T* a = A + (int64_t)i * lda;
    const T* b = B + (int64_t)j * ldb;
    for (int kk = 0; kk < k; ++kk) s = fmaf(Cvt<T>::to_f(a[kk]), Cvt<T>::to_f(b[kk]), s);
    C[(int64_t)i * ldc + j] = s;
  }
  __syncwarp();
}

// C[16 x n] += A[16 x k] B, B stored [k x n] row-major.
template <typename T>
__device__ void warp_mm_nn(float* C, int ldc, const T* A, int lda, const T* B, int ldb, int n, int k) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kUseWmma<T>) {
    using namespace nvcuda;
    for (int j = 0; j < n; j += 16) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
      wmma::load_matrix_sync(c, C + j, ldc, wmma::mem_row_major);
      for (int kk = 0; kk < k; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
        wmma::load_matrix_sync(a, A + kk, lda);
        wmma::load_matrix_sync(b, B + (int64_t)kk * ldb + j, ldb);
        wmma::mma_sync(c, a, b, c);
      }
      wmma::store_matrix_sync(C + j, c, ldc, wmma::mem_row_major);
    }
    __syncwarp();
    return;
  }
#endif
  const int lane = threadIdx.x & 31;
  for (int idx = lane; idx < 16 * n; idx += 32) {
    const int i = idx / n, j = idx - i * n;
    float s = C[(int64_t)i * ldc + j];
    const T* a = A + (int64_t)i * lda;
    for (int kk = 0; kk < k; ++kk) s = fmaf(Cvt<T>::to_f(a[kk]), Cvt<T>::to_f(B[(int64_t)kk * ldb + j]), s);
    C[(int64_t)i * ldc + j] = s;
  }
  __syncwarp();
}

// C[16 x n] = A^T B where A is stored [k x 16] (row-major, lda: A^T(i, kk) = A[kk * lda + i]) and
// B [k x n] row-major.
template <typename T>
__device__ void warp_mm_tn(float* C, int ldc, const T* A, int lda, const T* B, int ldb, int n, int k) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kUseWmma<T>) {
    using namespace nvcuda;
    for (int j = 0; j < n; j += 16) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
      wmma::fill_fragment(c, 0.0f);
      for (int kk = 0; kk < k; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> a;  // (i, kk) at A[kk * lda + i]
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
        wmma::load_matrix_sync(a, A + (int64_t)kk * lda, lda);
        wmma::load_matrix_sync(b, B + (int64_t)kk * ldb + j, ldb);
        wmma::mma_sync(c, a, b, c);
      }
      wmma::store_matrix_sync(C + j, c, ldc, wmma::mem_row_major);
    }
    __syncwarp();
    return;
  }
#endif
  const int lane = threadIdx.x & 31;
  for (int idx = lane; idx < 16 * n; idx += 32) {
    const int i = idx / n, j = idx - i * n;
    float s = 0.0f;
    for (int kk = 0; kk < k; ++kk)
      s = fmaf(Cvt<T>::to_f(A[(int64_t)kk * lda + i]), Cvt<T>::to_f(B[(int64_t)kk * ldb + j]), s);
    C[(int64_t)i * ldc + j] = s;
  }
  __syncwarp();
}

// Copies rows [row0, row0 + R) of a [nrows, d] row-major matrix into dst[R][ld], zero rows past nrows
// (so that products over padded rows/keys add exact zeros, never stale NaNs). 16-byte vectors: d * sizeof(T)
// is a multiple of 32 and ld * sizeof(T) a multiple of 16.
template <typename T>
__device__ void load_tile(T* dst, int ld, const T* src, int64_t row0, int64_t nrows, int R, int d) {
  constexpr int kVec = 16 / sizeof(T);
  const int chunks = d / kVec;
  for (int idx = threadIdx.x; idx < R * chunks; idx += blockDim.x) {
    const int r = idx / chunks, c = (idx - r * chunks) * kVec;
    int4 val = make_int4(0, 0, 0, 0);
    if (row0 + r < nrows) val = *reinterpret_cast<const int4*>(src + (row0 + r) * d + c);
    *reinterpret_cast<int4*>(dst + (int64_t)r * ld + c) = val;
  }
}

// ------------------------------------------------------------------------------------------------
// Shared-memory layouts (computed identically on host and device).

__host__ __device__ inline size_t align128(size_t x) { return (x + 127) & ~size_t(127); }

struct FwdLayout {
  int ldT, ldS, ldP, ldO;  // leading dims: T tiles [.., d], fp32 scores [.., BN], T scores, fp32 acc [.., d]
  size_t q, k, v, tq, tk, tv, s, p, sp, w, o, m, l, a, total;
};

__host__ __device__ inline FwdLayout fwd_layout(int BM, int BN, int d, int sz, bool jvp) {
  FwdLayout L;
  L.ldT = d + 16 / sz;
  L.ldS = BN + 4;
  L.ldP = BN + 16 / sz;
  L.ldO = d + 4;
  size_t off = 0;
  const size_t tq_bytes = align128((size_t)BM * L.ldT * sz), tk_bytes = align128((size_t)BN * L.ldT * sz);
  const size_t s_bytes = align128((size_t)BM * L.ldS * 4), p_bytes = align128((size_t)BM * L.ldP * sz);
  L.q = off; off += tq_bytes;
  L.k = off; off += tk_bytes;
  L.v = off; off += tk_bytes;
  L.tq = off; off += jvp ? tq_bytes : 0;
  L.tk = off; off += jvp ? tk_bytes : 0;
  L.tv = off; off += jvp ? tk_bytes : 0;
  L.s = off; off += s_bytes;
  L.p = off; off += p_bytes;
  L.sp = off; off += jvp ? s_bytes : 0;
  L.w = off; off += jvp ? p_bytes : 0;
  L.o = off; off += align128((size_t)BM * L.ldO * 4);
  L.m = off; off += align128((size_t)BM * 4);
  L.l = off; off += align128((size_t)BM * 4);
  L.a = off; off += align128((size_t)BM * 4);
  L.total = off;
  return L;
}

struct BwdLayout {
  int ldT, ldS, ldP, ldO;  // T tiles [.., d], fp32 transposed scores [BN][BM], T scores, fp32 acc [.., d]
  size_t k, v, q, dout, lse, D, st, pt, dpt, dst, dk, dv, dq, total;
};

__host__ __device__ inline BwdLayout bwd_layout(int BM, int BN, int d, int sz) {
  BwdLayout L;
  L.ldT = d + 16 / sz;
  L.ldS = BM + 4;
  L.ldP = BM + 16 / sz;
  L.ldO = d + 4;
  size_t off = 0;
  const size_t kb = align128((size_t)BN * L.ldT * sz), qb = align128((size_t)BM * L.ldT * sz);
  const size_t sb = align128((size_t)BN * L.ldS * 4), pb = align128((size_t)BN * L.ldP * sz);
  const size_t accb = align128((size_t)BN * L.ldO * 4);
  L.k = off; off += kb;
  L.v = off; off += kb;
  L.q = off; off += qb;
  L.dout = off; off += qb;
  L.lse = off; off += align128((size_t)BM * 4);
  L.D = off; off += align128((size_t)BM * 4);
  L.st = off; off += sb;
  L.pt = off; off += pb;
  L.dpt = off; off += sb;
  L.dst = off; off += pb;
  L.dk = off; off += accb;
  L.dv = off; off += accb;
  L.dq = off; off += align128((size_t)BM * L.ldO * 4);
  L.total = off;
  return L;
}

// ------------------------------------------------------------------------------------------------
// Forward (P == 0) and forward + JVP (P >= 1).

template <typename T>
struct FwdParams {
  const T *q, *k, *v, *tq, *tk, *tv;
  T *out, *tout;
  float* lse;
  float* ws_acc;  // [P, B*H, Nq_pad, d]: accT_p
  float* ws_r;    // [P, B*H, Nq_pad]: r_p
  int64_t B, H, Hkv, Nq, Nk, P, Nq_pad;
  int d, BM, BN;
  bool causal;
  float scale;
};

template <typename T>
__global__ void __launch_bounds__(128) attention_fwd_jvp_kernel(const FwdParams<T> p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int d = p.d, BM = p.BM, BN = p.BN;
  const bool jvp = p.P > 0;
  const FwdLayout L = fwd_layout(BM, BN, d, (int)sizeof(T), jvp);
  T* Qs = reinterpret_cast<T*>(smem + L.q);
  T* Ks = reinterpret_cast<T*>(smem + L.k);
  T* Vs = reinterpret_cast<T*>(smem + L.v);
  T* TQs = reinterpret_cast<T*>(smem + L.tq);
  T* TKs = reinterpret_cast<T*>(smem + L.tk);
  T* TVs = reinterpret_cast<T*>(smem + L.tv);
  float* Ss = reinterpret_cast<float*>(smem + L.s);   // scores, then P~ (fp32)
  T* Ps = reinterpret_cast<T*>(smem + L.p);           // P~ as a product operand
  float* SPs = reinterpret_cast<float*>(smem + L.sp); // q' k^T + q k'^T (unscaled)
  T* Ws = reinterpret_cast<T*>(smem + L.w);           // P~ o S'_p as a product operand
  float* Os = reinterpret_cast<float*>(smem + L.o);
  float* m_s = reinterpret_cast<float*>(smem + L.m);
  float* l_s = reinterpret_cast<float*>(smem + L.l);
  float* a_s = reinterpret_cast<float*>(smem + L.a);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r0 = warp * 16;  // this warp's rows in the tile
  const int64_t nqt = (p.Nq + BM - 1) / BM;
  const int64_t qt = nqt - 1 - (int64_t)blockIdx.x % nqt;  // the longest causal rows start first
  const int64_t bh = (int64_t)blockIdx.x / nqt;
  const int64_t b = bh / p.H, h = bh % p.H, hk = h / (p.H / p.Hkv);
  const int64_t BH = p.B * p.H;
  const int64_t i0 = qt * BM;
  const int64_t off = p.Nk - p.Nq;
  const T* Kg = p.k + (b * p.Hkv + hk) * p.Nk * d;
  const T* Vg = p.v + (b * p.Hkv + hk) * p.Nk * d;
  const int64_t i_last = (i0 + BM < p.Nq ? i0 + BM : p.Nq) - 1;
  int64_t jend = p.causal ? i_last + off + 1 : p.Nk;  // keys >= jend are hidden from every row of the tile
  if (jend > p.Nk) jend = p.Nk;

  load_tile(Qs, L.ldT, p.q + bh * p.Nq * d, i0, p.Nq, BM, d);
  for (int idx = lane; idx < 16 * d; idx += 32) Os[(r0 + idx / d) * L.ldO + idx % d] = 0.0f;
  if (lane < 16) {
    m_s[r0 + lane] = kNegInf;
    l_s[r0 + lane] = 0.0f;
    a_s[r0 + lane] = 1.0f;
  }
  for (int64_t pr = 0; pr < p.P; ++pr) {
    float* A2 = p.ws_acc + ((pr * BH + bh) * p.Nq_pad + i0 + r0) * d;
    for (int idx = lane; idx < 16 * d; idx += 32) A2[idx] = 0.0f;
    if (lane < 16) p.ws_r[(pr * BH + bh) * p.Nq_pad + i0 + r0 + lane] = 0.0f;
  }
  __syncwarp();

  for (int64_t j0 = 0; j0 < jend; j0 += BN) {
    __syncthreads();  // every warp is done with the previous K/V tiles (and Q, first time)
    load_tile(Ks, L.ldT, Kg, j0, p.Nk, BN, d);
    load_tile(Vs, L.ldT, Vg, j0, p.Nk, BN, d);
    __syncthreads();

    // S = Q K^T for this warp's 16 rows, then the online-softmax update, row by row.
    warp_mm_nt(Ss + r0 * L.ldS, L.ldS, Qs + r0 * L.ldT, L.ldT, Ks, L.ldT, BN, d, false);
    for (int r = 0; r < 16; ++r) {
      const int64_t i = i0 + r0 + r;
      float* srow = Ss + (r0 + r) * L.ldS;
      float mx = kNegInf;
      for (int c = lane; c < BN; c += 32) {
        const int64_t j = j0 + c;
        const bool visible = i < p.Nq && j < p.Nk && (!p.causal || j <= i + off);
        const float x = visible ? srow[c] * p.scale : kNegInf;
        srow[c] = x;
        mx = fmaxf(mx, x);
      }
      mx = warp_max(mx);
      const float m_old = m_s[r0 + r];
      const float m_new = fmaxf(m_old, mx);
      const float mu = m_new == kNegInf ? 0.0f : m_new;  // nothing visible yet: P~ = exp(-inf) = 0
      const float alpha = m_new == kNegInf ? 1.0f : exp2f((m_old - m_new) * kLog2e);
      float sum = 0.0f;
      for (int c = lane; c < BN; c += 32) {
        const float e = exp2f((srow[c] - mu) * kLog2e);
        srow[c] = e;
        Ps[(r0 + r) * L.ldP + c] = Cvt<T>::from_f(e);
        sum += e;
      }
      sum = warp_sum(sum);
      __syncwarp();  // every lane has read m_s / a_s of this row before lane 0 updates them
      if (lane == 0) {
        l_s[r0 + r] = alpha * l_s[r0 + r] + sum;
        m_s[r0 + r] = m_new;
        a_s[r0 + r] = alpha;
      }
    }
    __syncwarp();
    for (int idx = lane; idx < 16 * d; idx += 32) Os[(r0 + idx / d) * L.ldO + idx % d] *= a_s[r0 + idx / d];
    __syncwarp();
    warp_mm_nn(Os + r0 * L.ldO, L.ldO, Ps + r0 * L.ldP, L.ldP, Vs, L.ldT, d, BN);

    // Tangents: S'_p = s (Q'_p K^T + Q K'_p^T), W = P~ o S'_p, r_p = a r_p + rowsum W,
    // accT_p = a accT_p + P~ V'_p + W V.
    for (int64_t pr = 0; pr < p.P; ++pr) {
      __syncthreads();  // every warp is done with the previous tangent tiles
      load_tile(TQs, L.ldT, p.tq + (pr * BH + bh) * p.Nq * d, i0, p.Nq, BM, d);
      load_tile(TKs, L.ldT, p.tk + ((pr * p.B + b) * p.Hkv + hk) * p.Nk * d, j0, p.Nk, BN, d);
      load_tile(TVs, L.ldT, p.tv + ((pr * p.B + b) * p.Hkv + hk) * p.Nk * d, j0, p.Nk, BN, d);
      __syncthreads();
      warp_mm_nt(SPs + r0 * L.ldS, L.ldS, TQs + r0 * L.ldT, L.ldT, Ks, L.ldT, BN, d, false);
      warp_mm_nt(SPs + r0 * L.ldS, L.ldS, Qs + r0 * L.ldT, L.ldT, TKs, L.ldT, BN, d, true);
      float* rvec = p.ws_r + (pr * BH + bh) * p.Nq_pad + i0 + r0;
      for (int r = 0; r < 16; ++r) {
        float sum = 0.0f;
        for (int c = lane; c < BN; c += 32) {
          // Hidden entries have P~ = 0 and a finite S' (zero-filled padding), so W = 0 there.
          // r_p sums the same rounded W that multiplies V, so accB_p - r_p O stays centered.
          const T w = Cvt<T>::from_f(Ss[(r0 + r) * L.ldS + c] * (p.scale * SPs[(r0 + r) * L.ldS + c]));
          Ws[(r0 + r) * L.ldP + c] = w;
          sum += Cvt<T>::to_f(w);
        }
        sum = warp_sum(sum);
        if (lane == 0) rvec[r] = a_s[r0 + r] * rvec[r] + sum;
      }
      float* A2 = p.ws_acc + ((pr * BH + bh) * p.Nq_pad + i0 + r0) * d;
      for (int idx = lane; idx < 16 * d; idx += 32) A2[idx] *= a_s[r0 + idx / d];
      __syncwarp();
      warp_mm_nn(A2, d, Ps + r0 * L.ldP, L.ldP, TVs, L.ldT, d, BN);
      warp_mm_nn(A2, d, Ws + r0 * L.ldP, L.ldP, Vs, L.ldT, d, BN);
    }
  }

  // O = acc / l, lse = m + log l; O'_p = accT_p / l - (r_p / l) O. Rows that saw nothing: 0, -inf, 0.
  __syncwarp();
  for (int r = 0; r < 16; ++r) {
    const int64_t i = i0 + r0 + r;
    if (i >= p.Nq) break;
    const float l = l_s[r0 + r];
    const bool any = l > 0.0f;
    const float inv = any ? 1.0f / l : 0.0f;
    T* orow = p.out + (bh * p.Nq + i) * d;
    for (int c = lane; c < d; c += 32) orow[c] = Cvt<T>::from_f(Os[(r0 + r) * L.ldO + c] * inv);
    if (lane == 0) p.lse[bh * p.Nq + i] = any ? m_s[r0 + r] + logf(l) : kNegInf;
    for (int64_t pr = 0; pr < p.P; ++pr) {
      const float* A2 = p.ws_acc + ((pr * BH + bh) * p.Nq_pad + i) * d;
      const float rl = p.ws_r[(pr * BH + bh) * p.Nq_pad + i] * inv;
      T* trow = p.tout + ((pr * BH + bh) * p.Nq + i) * d;
      for (int c = lane; c < d; c += 32) {
        const float o = Os[(r0 + r) * L.ldO + c] * inv;
        trow[c] = Cvt<T>::from_f(A2[c] * inv - rl * o);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Backward: one CTA per (batch, kv head, tile of BN keys); warps own 16 key rows each.

template <typename T>
struct BwdParams {
  const T *dout, *q, *k, *v;
  const float *lse, *Dvec;
  float* dq_acc;
  T *dk, *dv;
  int64_t B, H, Hkv, Nq, Nk;
  int d, BM, BN;
  bool causal;
  float scale;
};

template <typename T>
__global__ void __launch_bounds__(128) attention_bwd_kernel(const BwdParams<T> p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int d = p.d, BM = p.BM, BN = p.BN;
  const BwdLayout L = bwd_layout(BM, BN, d, (int)sizeof(T));
  T* Ks = reinterpret_cast<T*>(smem + L.k);
  T* Vs = reinterpret_cast<T*>(smem + L.v);
  T* Qs = reinterpret_cast<T*>(smem + L.q);
  T* dOs = reinterpret_cast<T*>(smem + L.dout);
  float* lse_s = reinterpret_cast<float*>(smem + L.lse);
  float* D_s = reinterpret_cast<float*>(smem + L.D);
  float* St = reinterpret_cast<float*>(smem + L.st);    // [BN][BM] P^T (fp32)
  T* Pt = reinterpret_cast<T*>(smem + L.pt);            // P^T as a product operand
  float* dPt = reinterpret_cast<float*>(smem + L.dpt);  // [BN][BM] dP^T
  T* dSt = reinterpret_cast<T*>(smem + L.dst);          // dS^T as a product operand
  float* dKs = reinterpret_cast<float*>(smem + L.dk);
  float* dVs = reinterpret_cast<float*>(smem + L.dv);
  float* dQs = reinterpret_cast<float*>(smem + L.dq);   // [BM][d] this tile's dS K

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  const int kr0 = warp * 16;  // this warp's key rows in the tile
  const int64_t nkt = (p.Nk + BN - 1) / BN;
  const int64_t kt = (int64_t)blockIdx.x % nkt;  // low key tiles (most work under causal) first
  const int64_t bhk = (int64_t)blockIdx.x / nkt;
  const int64_t b = bhk / p.Hkv, hk = bhk % p.Hkv, G = p.H / p.Hkv;
  const int64_t j0 = kt * BN;
  const int64_t off = p.Nk - p.Nq;

  load_tile(Ks, L.ldT, p.k + bhk * p.Nk * d, j0, p.Nk, BN, d);
  load_tile(Vs, L.ldT, p.v + bhk * p.Nk * d, j0, p.Nk, BN, d);
  for (int idx = lane; idx < 16 * d; idx += 32) {
    dKs[(kr0 + idx / d) * L.ldO + idx % d] = 0.0f;
    dVs[(kr0 + idx / d) * L.ldO + idx % d] = 0.0f;
  }
  int64_t qstart = p.causal ? j0 - off : 0;  // first query that sees key j0
  if (qstart < 0) qstart = 0;

  for (int64_t g = 0; g < G; ++g) {
    const int64_t bh = b * p.H + hk * G + g;
    for (int64_t i0 = (qstart / BM) * BM; i0 < p.Nq; i0 += BM) {
      __syncthreads();  // every warp is done with the previous Q / dO / dS^T tiles
      load_tile(Qs, L.ldT, p.q + bh * p.Nq * d, i0, p.Nq, BM, d);
      load_tile(dOs, L.ldT, p.dout + bh * p.Nq * d, i0, p.Nq, BM, d);
      for (int c = threadIdx.x; c < BM; c += blockDim.x) {
        const bool in = i0 + c < p.Nq;
        lse_s[c] = in ? p.lse[bh * p.Nq + i0 + c] : kNegInf;
        D_s[c] = in ? p.Dvec[bh * p.Nq + i0 + c] : 0.0f;
      }
      __syncthreads();

      // P^T = exp(s K Q^T - lse) on visible entries (0 elsewhere and on rows with lse = -inf).
      warp_mm_nt(St + kr0 * L.ldS, L.ldS, Ks + kr0 * L.ldT, L.ldT, Qs, L.ldT, BM, d, false);
      for (int r = 0; r < 16; ++r) {
        const int64_t j = j0 + kr0 + r;
        for (int c = lane; c < BM; c += 32) {
          const int64_t i = i0 + c;
          const float lse = lse_s[c];
          const bool visible = j < p.Nk && i < p.Nq && (!p.causal || j <= i + off) && lse != kNegInf;
          const float e = visible ? exp2f((St[(kr0 + r) * L.ldS + c] * p.scale - lse) * kLog2e) : 0.0f;
          St[(kr0 + r) * L.ldS + c] = e;
          Pt[(kr0 + r) * L.ldP + c] = Cvt<T>::from_f(e);
        }
      }
      __syncwarp();
      warp_mm_nn(dVs + kr0 * L.ldO, L.ldO, Pt + kr0 * L.ldP, L.ldP, dOs, L.ldT, d, BM);  // dV += P^T dO
      warp_mm_nt(dPt + kr0 * L.ldS, L.ldS, Vs + kr0 * L.ldT, L.ldT, dOs, L.ldT, BM, d, false);  // dP^T = V dO^T
      for (int r = 0; r < 16; ++r) {
        for (int c = lane; c < BM; c += 32) {
          const float ds = St[(kr0 + r) * L.ldS + c] * (dPt[(kr0 + r) * L.ldS + c] - D_s[c]);
          dSt[(kr0 + r) * L.ldP + c] = Cvt<T>::from_f(ds);
        }
      }
      __syncwarp();
      warp_mm_nn(dKs + kr0 * L.ldO, L.ldO, dSt + kr0 * L.ldP, L.ldP, Qs, L.ldT, d, BM);  // dK += dS^T Q
      __syncthreads();  // dS^T complete from every warp
      // dQ[i0 + rb*16 .., :] += s dS K = s (dS^T)^T K, summed over this tile's BN keys.
      for (int rb = warp; rb < BM / 16; rb += nwarps) {
        warp_mm_tn(dQs + rb * 16 * L.ldO, L.ldO, dSt + rb * 16, L.ldP, Ks, L.ldT, d, BN);
        for (int idx = lane; idx < 16 * d; idx += 32) {
          const int r = idx / d, c = idx - r * d;
          const int64_t i = i0 + rb * 16 + r;
          if (i < p.Nq) atomicAdd(p.dq_acc + (bh * p.Nq + i) * d + c, p.scale * dQs[(rb * 16 + r) * L.ldO + c]);
        }
      }
    }
  }

  __syncwarp();
  for (int r = 0; r < 16; ++r) {
    const int64_t j = j0 + kr0 + r;
    if (j >= p.Nk) break;
    T* dkrow = p.dk + (bhk * p.Nk + j) * d;
    T* dvrow = p.dv + (bhk * p.Nk + j) * d;
    for (int c = lane; c < d; c += 32) {
      dkrow[c] = Cvt<T>::from_f(p.scale * dKs[(kr0 + r) * L.ldO + c]);
      dvrow[c] = Cvt<T>::from_f(dVs[(kr0 + r) * L.ldO + c]);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Launch helpers

int max_smem_optin() {
  int dev = 0, v = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 48 * 1024;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) return 48 * 1024;
  return v;
}

constexpr int kTiles[][2] = {{64, 64}, {64, 32}, {32, 32}, {16, 32}, {16, 16}};

template <typename T>
cudaError_t launch_fwd_jvp(const Shape& s, int64_t P, const void* q, const void* k, const void* v, const void* tq,
                           const void* tk, const void* tv, void* out, void* tout, float* lse, float* ws,
                           cudaStream_t stream) {
  const int d = (int)s.d, limit = max_smem_optin();
  int BM = 0, BN = 0;
  size_t smem = 0;
  for (const auto& t : kTiles) {  // {BM, BN}
    const size_t need = fwd_layout(t[0], t[1], d, (int)sizeof(T), P > 0).total;
    if (need <= (size_t)limit) {
      BM = t[0];
      BN = t[1];
      smem = need;
      break;
    }
  }
  if (BM == 0) return cudaErrorInvalidConfiguration;
  FwdParams<T> p;
  p.q = static_cast<const T*>(q);
  p.k = static_cast<const T*>(k);
  p.v = static_cast<const T*>(v);
  p.tq = static_cast<const T*>(tq);
  p.tk = static_cast<const T*>(tk);
  p.tv = static_cast<const T*>(tv);
  p.out = static_cast<T*>(out);
  p.tout = static_cast<T*>(tout);
  p.lse = lse;
  const int64_t Nq_pad = (s.Nq + 63) / 64 * 64;  // BM divides 64: the workspace covers padded rows
  p.ws_acc = ws;
  p.ws_r = ws != nullptr ? ws + P * s.B * s.H * Nq_pad * s.d : nullptr;
  p.B = s.B;
  p.H = s.H;
  p.Hkv = s.Hkv;
  p.Nq = s.Nq;
  p.Nk = s.Nk;
  p.P = P;
  p.Nq_pad = Nq_pad;
  p.d = d;
  p.BM = BM;
  p.BN = BN;
  p.causal = s.causal;
  p.scale = s.scale;
  const int64_t blocks = s.B * s.H * ((s.Nq + BM - 1) / BM);
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  cudaError_t err = cudaFuncSetAttribute(attention_fwd_jvp_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem);
  if (err != cudaSuccess) return err;
  attention_fwd_jvp_kernel<T><<<(unsigned)blocks, 32 * (BM / 16), smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd(const Shape& s, const void* dout, const void* q, const void* k, const void* v,
                       const float* lse, const float* Dvec, float* dq_acc, void* dk, void* dv, cudaStream_t stream) {
  const int d = (int)s.d, limit = max_smem_optin();
  int BM = 0, BN = 0;
  size_t smem = 0;
  for (const auto& t : kTiles) {  // {BN, BM}: key rows per CTA first
    const size_t need = bwd_layout(t[1], t[0], d, (int)sizeof(T)).total;
    if (need <= (size_t)limit) {
      BN = t[0];
      BM = t[1];
      smem = need;
      break;
    }
  }
  if (BN == 0) return cudaErrorInvalidConfiguration;
  BwdParams<T> p;
  p.dout = static_cast<const T*>(dout);
  p.q = static_cast<const T*>(q);
  p.k = static_cast<const T*>(k);
  p.v = static_cast<const T*>(v);
  p.lse = lse;
  p.Dvec = Dvec;
  p.dq_acc = dq_acc;
  p.dk = static_cast<T*>(dk);
  p.dv = static_cast<T*>(dv);
  p.B = s.B;
  p.H = s.H;
  p.Hkv = s.Hkv;
  p.Nq = s.Nq;
  p.Nk = s.Nk;
  p.d = d;
  p.BM = BM;
  p.BN = BN;
  p.causal = s.causal;
  p.scale = s.scale;
  const int64_t blocks = s.B * s.Hkv * ((s.Nk + BN - 1) / BN);
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  cudaError_t err =
      cudaFuncSetAttribute(attention_bwd_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return err;
  attention_bwd_kernel<T><<<(unsigned)blocks, 32 * (BN / 16), smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

bool head_dim_supported(int64_t d) {
  return d == 16 || d == 32 || d == 64 || d == 80 || d == 96 || d == 128 || d == 256;
}

int64_t jvp_workspace_floats(const Shape& s, int64_t P) {
  const int64_t Nq_pad = (s.Nq + 63) / 64 * 64;
  return P * s.B * s.H * Nq_pad * (s.d + 1);
}

cudaError_t fwd(DType dtype, const Shape& s, const void* q, const void* k, const void* v, void* out, float* lse,
                cudaStream_t stream) {
  if (!head_dim_supported(s.d)) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32:
      return launch_fwd_jvp<float>(s, 0, q, k, v, nullptr, nullptr, nullptr, out, nullptr, lse, nullptr, stream);
    case DType::kFloat16:
      return launch_fwd_jvp<__half>(s, 0, q, k, v, nullptr, nullptr, nullptr, out, nullptr, lse, nullptr, stream);
    case DType::kBFloat16:
      return launch_fwd_jvp<__nv_bfloat16>(s, 0, q, k, v, nullptr, nullptr, nullptr, out, nullptr, lse, nullptr,
                                           stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t jvp(DType dtype, const Shape& s, int64_t P, const void* q, const void* k, const void* v, const void* tq,
                const void* tk, const void* tv, void* out, void* tout, float* lse, float* workspace,
                cudaStream_t stream) {
  if (!head_dim_supported(s.d)) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32:
      return launch_fwd_jvp<float>(s, P, q, k, v, tq, tk, tv, out, tout, lse, workspace, stream);
    case DType::kFloat16:
      return launch_fwd_jvp<__half>(s, P, q, k, v, tq, tk, tv, out, tout, lse, workspace, stream);
    case DType::kBFloat16:
      return launch_fwd_jvp<__nv_bfloat16>(s, P, q, k, v, tq, tk, tv, out, tout, lse, workspace, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t bwd(DType dtype, const Shape& s, const void* dout, const void* q, const void* k, const void* v,
                const float* lse, const float* Dvec, float* dq_acc, void* dk, void* dv, cudaStream_t stream) {
  if (!head_dim_supported(s.d)) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32:
      return launch_bwd<float>(s, dout, q, k, v, lse, Dvec, dq_acc, dk, dv, stream);
    case DType::kFloat16:
      return launch_bwd<__half>(s, dout, q, k, v, lse, Dvec, dq_acc, dk, dv, stream);
    case DType::kBFloat16:
      return launch_bwd<__nv_bfloat16>(s, dout, q, k, v, lse, Dvec, dq_acc, dk, dv, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace attention_cuda
}  // namespace condinit
