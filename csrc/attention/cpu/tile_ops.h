// Tile operations of the C++ CPU attention kernels: the GEMM on raw tiles, vectorized row
// operations, the masks of a tile, masked tile products and the task pool (attention_cpu.cpp).
#pragma once

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

// MKL/OpenBLAS Fortran GEMM exported by libtorch_cpu (LP64). Weak: a torch build without them
// falls back to at::addmm_ on from_blob views (slower per call, same math).
extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc) __attribute__((weak));
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b, const int* ldb,
            const double* beta, double* c, const int* ldc) __attribute__((weak));
}

namespace condinit {
namespace attention_cpu {
namespace {

using at::Tensor;

// Tiles: the backward kernels work on [kBlockM x kBlockN] tiles (four live at once per worker),
// the forward / JVP on [kFwdM x kFwdN] ones (fewer, larger products: MKL's per-call packing is a
// visible share of the time at 64 x 128). Measured on a 2-core AVX-512 machine: larger backward
// tiles gave no gain, larger forward tiles 10-20 %.
constexpr int64_t kBlockM = 64;    // queries per backward tile
constexpr int64_t kBlockN = 128;   // keys per backward tile
constexpr int64_t kFwdM = 128;     // queries per forward tile
constexpr int64_t kFwdN = 256;     // keys per forward tile
constexpr int64_t kMaxM = kFwdM > kBlockM ? kFwdM : kBlockM;

// ------------------------------------------------------------------------------------------------
// Row-major GEMM on raw tiles: C[M x N] = alpha op(A)[M x K] op(B)[K x N] + beta C.
// (A row-major product is the column-major product of the transposes with the operands swapped.)
template <typename T>
void gemm_aten(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda,
               const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  auto opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  Tensor a = ta ? at::from_blob(const_cast<T*>(A), {K, M}, {lda, 1}, opts).t()
                : at::from_blob(const_cast<T*>(A), {M, K}, {lda, 1}, opts);
  Tensor b = tb ? at::from_blob(const_cast<T*>(B), {N, K}, {ldb, 1}, opts).t()
                : at::from_blob(const_cast<T*>(B), {K, N}, {ldb, 1}, opts);
  Tensor c = at::from_blob(C, {M, N}, {ldc, 1}, opts);
  c.addmm_(a, b, beta, alpha);  // beta == 0 ignores C (no NaN propagation from stale buffers)
}

// fp32 plain products C (+)= A B of at least a few rows go to oneDNN's brgemm micro-kernel through
// ATen (JIT-compiled per shape for the machine's vector ISA, no operand packing: 10-20 % faster
// than MKL's sgemm on these tile shapes on an AVX-512 machine); the rest to BLAS.
inline void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                 int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
#ifdef CPUBLAS_BRGEMM_F32F32F32
  if (!ta && !tb && alpha == 1.0f && (beta == 0.0f || beta == 1.0f) && M >= 8 && N >= 8 && K >= 8) {
    at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, beta == 1.0f, A, B, C, /*is_vnni=*/false);
    return;
  }
#endif
  if (sgemm_ == nullptr) return gemm_aten<float>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  const char tA = tb ? 'T' : 'N', tB = ta ? 'T' : 'N';
  const int m = (int)N, n = (int)M, k = (int)K, la = (int)ldb, lb = (int)lda, lc = (int)ldc;
  sgemm_(&tA, &tB, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
}

inline void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A,
                 int64_t lda, const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  if (dgemm_ == nullptr) return gemm_aten<double>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  const char tA = tb ? 'T' : 'N', tB = ta ? 'T' : 'N';
  const int m = (int)N, n = (int)M, k = (int)K, la = (int)ldb, lb = (int)lda, lc = (int)ldc;
  dgemm_(&tA, &tB, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
}

// ------------------------------------------------------------------------------------------------
// x[j] <- exp(x[j] - mu) for j < n, returns the sum. mu is finite; x may hold -inf (masked).
// fp32: Cephes-style exp (range reduction by ln 2, degree-6 polynomial, ~1 ulp), written so that
// GCC vectorizes it; the clones are chosen at load time from the CPU's features.
__attribute__((target_clones("avx512f", "avx2", "default")))
float exp_shift_sum(float* __restrict x, int64_t n, float mu) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    float t = x[j] - mu;
    t = t < -87.0f ? -87.0f : t;  // also maps masked -inf entries into range
    // round(t / ln 2) by the 1.5 * 2^23 trick (floorf would keep GCC from vectorizing the clones)
    const float fn = (t * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = t - fn * 0.693359375f;
    r = r + fn * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const float two_n = __builtin_bit_cast(float, ((int32_t)fn + 127) << 23);
    const float e = fn <= -126.f ? 0.f : p * two_n;  // below ~1.7e-38 (and masked): exactly 0
    x[j] = e;
    sum += e;
  }
  return sum;
}

// fp64: Cephes' exp (range reduction by ln 2 in two parts, a degree-(2, 3) Pade form; within
// 1.5 ulp of std::exp over [-708, 0]), vectorized the same way; below exp(-707) (and masked): 0,
// an absolute error under 1e-307 next to a row sum >= 1.
__attribute__((target_clones("avx512f", "avx2", "default")))
double exp_shift_sum(double* __restrict x, int64_t n, double mu) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    double t = x[j] - mu;
    t = t < -708.0 ? -708.0 : t;
    const double fn = (t * 1.4426950408889634074 + 6755399441055744.0) - 6755399441055744.0;  // round(t / ln 2)
    double r = t - fn * 6.93145751953125e-1;
    r = r - fn * 1.42860682030941723212e-6;
    const double rr = r * r;
    const double px = r * ((1.26177193074810590878e-4 * rr + 3.02994407707441961300e-2) * rr + 9.99999999999999999910e-1);
    const double qx = ((3.00198505138664455042e-6 * rr + 2.52448340349684104192e-3) * rr + 2.27265548208155028766e-1) * rr
                      + 2.0;
    const double two_n = __builtin_bit_cast(double, ((int64_t)fn + 1023) << 52);
    const double e = fn <= -1021.0 ? 0.0 : (1.0 + 2.0 * (px / (qx - px))) * two_n;
    x[j] = e;
    sum += e;
  }
  return sum;
}

// W <- P o W (in place), returns rowsum(W).
template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default")))
T mul_rowsum(const T* __restrict p, T* __restrict w, int64_t n) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const T e = p[j] * w[j];
    w[j] = e;
    sum += e;
  }
  return sum;
}

// dS <- c P o (dP - D) (in place in dp).
template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default")))
void ds_row(const T* __restrict p, T* __restrict dp, int64_t n, T D, T c = T(1)) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dp[j] = c * (p[j] * (dp[j] - D));
}

template <typename T>
inline void scale_row(T* __restrict x, int64_t n, T a) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] *= a;
}

// The row maximum; NaN if the row holds a NaN (a NaN input must come out as NaN, not be dropped
// by the comparison).
template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default")))
T row_max(const T* __restrict x, int64_t n) {
  T mx = -std::numeric_limits<T>::infinity();
  int nans = 0;  // counted beside the max (a vectorized max reduction drops NaN)
#pragma omp simd reduction(max : mx) reduction(+ : nans)
  for (int64_t j = 0; j < n; ++j) {
    mx = x[j] > mx ? x[j] : mx;
    nans += x[j] != x[j];
  }
  return nans ? std::numeric_limits<T>::quiet_NaN() : mx;
}

// Whether x[0..count) holds no NaN / Inf (x * 0 is NaN exactly for those).
template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default")))
bool all_finite(const T* __restrict x, int64_t count) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < count; ++j) s += x[j] * T(0);
  return s == T(0);
}

// ------------------------------------------------------------------------------------------------
// Masks (docs/design.md, "Attention", "Masks"): query i of batch entry b attends the keys
// lo(i) <= j < hi(i). Each constraint is an interval, so lo and hi grow with i: a query tile
// attends the keys [lo(first row), hi(last valid row)) and a key tile is attended by one range of
// queries.

struct MaskArgs {
  bool causal;
  int64_t window_left, window_right;
  const int32_t* q_lens;   // [B] or nullptr (= Nq)
  const int32_t* kv_lens;  // [B] or nullptr (= Nk)
};

struct SeqMask {
  int64_t Lq, Lk, off, wl, wr;
  bool causal;
  int64_t lo(int64_t i) const {
    int64_t x = wl >= 0 ? i + off - wl : 0;
    x = x < 0 ? 0 : x;
    return x < Lk ? x : Lk;
  }
  int64_t hi(int64_t i) const {
    int64_t x = Lk;
    if (causal) x = std::min<int64_t>(x, i + off + 1);
    if (wr >= 0) x = std::min<int64_t>(x, i + off + wr + 1);
    return std::max<int64_t>(x, lo(i));  // hi <= lo: the row attends nothing
  }
  // Queries [qfirst, qend) of [0, Lq) attend some key of [j0, j1) (empty when qfirst >= qend).
  int64_t qfirst(int64_t j0) const {  // first i with hi(i) > j0
    int64_t a = 0, b = Lq;
    while (a < b) { const int64_t c = (a + b) / 2; if (hi(c) > j0) b = c; else a = c + 1; }
    return a;
  }
  int64_t qend(int64_t j1) const {  // first i with lo(i) >= j1
    int64_t a = 0, b = Lq;
    while (a < b) { const int64_t c = (a + b) / 2; if (lo(c) >= j1) b = c; else a = c + 1; }
    return a;
  }
};

inline SeqMask seq_mask(const MaskArgs& M, int64_t b, int64_t Nq, int64_t Nk) {
  const int64_t Lq = M.q_lens ? M.q_lens[b] : Nq, Lk = M.kv_lens ? M.kv_lens[b] : Nk;
  return SeqMask{Lq, Lk, Lk - Lq, M.window_left, M.window_right, M.causal};
}

// The allowed columns [lo[i], hi[i]) of each row of an [m x n] tile at query i0 and key j0
// (tile-local, clipped to [0, n]); full when every pair is allowed.
struct TileMask {
  bool full;
  int64_t m, n;
  int64_t lo[kMaxM], hi[kMaxM];

  // Rows i >= mv of the tile are not valid queries (all masked).
  void build(const SeqMask& sm, int64_t i0, int64_t m_, int64_t mv, int64_t j0, int64_t n_) {
    m = m_;
    n = n_;
    full = mv == m && sm.lo(i0 + m - 1) <= j0 && sm.hi(i0) >= j0 + n;
    if (full) return;
    for (int64_t i = 0; i < m; ++i) {
      if (i >= mv) { lo[i] = hi[i] = 0; continue; }
      const int64_t a = std::clamp<int64_t>(sm.lo(i0 + i) - j0, 0, n);
      const int64_t b = std::clamp<int64_t>(sm.hi(i0 + i) - j0, 0, n);
      lo[i] = a;
      hi[i] = b > a ? b : a;
    }
  }
  // W[i, c] <- value outside the allowed columns.
  template <typename T>
  void fill_outside(T* W, int64_t ldW, T value) const {
    if (full) return;
    for (int64_t i = 0; i < m; ++i) {
      T* row = W + i * ldW;
      std::fill(row, row + lo[i], value);
      std::fill(row + hi[i], row + n, value);
    }
  }
};

// C[g m x d] += alpha A[g m x n] X[n x d] (contraction over the tile's keys; A is 0 outside the
// mask), A and C holding `groups` stacked [m x .] blocks that share the tile's mask row for row.
// A plain product would let a NaN / Inf in a row of X that only masked pairs touch through
// (0 * NaN = NaN); then each query row takes its allowed keys only.
template <typename T>
void mm_keys(const TileMask& tm, int64_t d, T alpha, const T* A, int64_t lda, const T* X, int64_t ldx,
             T* C, int64_t ldc, int64_t groups = 1) {
  if (tm.full || all_finite(X, tm.n * ldx)) {
    gemm(false, false, groups * tm.m, d, tm.n, alpha, A, lda, X, ldx, T(1), C, ldc);
    return;
  }
  for (int64_t r = 0; r < groups * tm.m; ++r) {
    const int64_t i = r % tm.m;
    if (tm.hi[i] > tm.lo[i])
      gemm(false, false, 1, d, tm.hi[i] - tm.lo[i], alpha, A + r * lda + tm.lo[i], lda,
           X + tm.lo[i] * ldx, ldx, T(1), C + r * ldc, ldc);
  }
}

// S <- P = exp(S - lse) of an [m x n] tile of scores (0 where masked and on rows that see no key).
template <typename T>
void probs_from_scores(T* S, const T* L, const TileMask& tm) {
  tm.fill_outside(S, kBlockN, -std::numeric_limits<T>::infinity());
  for (int64_t i = 0; i < tm.m; ++i) {
    T* row = S + i * kBlockN;
    if (std::isinf(L[i]) && L[i] < 0) std::fill(row, row + tm.n, T(0));  // nothing visible
    else exp_shift_sum(row, tm.n, L[i]);
  }
  tm.fill_outside(S, kBlockN, T(0));  // exp(-inf - NaN) of a NaN row must not reach masked keys
}

// C[n x d] += alpha A[m x n]^T Y[m x d] (contraction over the tile's queries), exact in the same
// way: each query row adds to its allowed keys only when Y holds non-finite values.
template <typename T>
void mm_queries(const TileMask& tm, int64_t d, T alpha, const T* A, int64_t lda, const T* Y, int64_t ldy,
                T* C, int64_t ldc) {
  if (tm.full || all_finite(Y, tm.m * ldy)) {
    gemm(true, false, tm.n, d, tm.m, alpha, A, lda, Y, ldy, T(1), C, ldc);
    return;
  }
  for (int64_t i = 0; i < tm.m; ++i) {
    if (tm.hi[i] > tm.lo[i])
      gemm(true, false, tm.hi[i] - tm.lo[i], d, 1, alpha, A + i * lda + tm.lo[i], lda, Y + i * ldy, ldy,
           T(1), C + tm.lo[i] * ldc, ldc);
  }
}

// C^T[d x n] += A^T[d x g m] X[g m x n]: the key-side gradient of mm_queries accumulated
// transposed, from the query-side operand transposed (columns col0.. of the block AT [d x lda]:
// its column col0 + r is row r of the stacked operand), so that the product is a plain C += A B
// (see gemm). Exact in the same way as mm_queries: each query row adds to its allowed keys only
// when the block holds non-finite values.
template <typename T>
void mm_queries_t(const TileMask& tm, int64_t d, const T* AT, int64_t lda, int64_t col0, const T* X, int64_t ldx,
                  T* CT, int64_t ldc, int64_t groups = 1) {
  if (tm.full || all_finite(AT, d * lda)) {
    gemm(false, false, d, tm.n, groups * tm.m, T(1), AT + col0, lda, X, ldx, T(1), CT, ldc);
    return;
  }
  for (int64_t r = 0; r < groups * tm.m; ++r) {
    const int64_t i = r % tm.m, lo = tm.lo[i], hi = tm.hi[i];
    for (int64_t c = 0; c < d && hi > lo; ++c) {
      const T a = AT[c * lda + col0 + r];
      T* crow = CT + c * ldc;
      const T* xrow = X + r * ldx;
      for (int64_t j = lo; j < hi; ++j) crow[j] += a * xrow[j];
    }
  }
}

// Runs body(task, worker) for task in [0, ntask) on at::get_num_threads() workers pulling tasks
// from a shared counter (tasks are ordered most expensive first by the callers).
template <typename F>
void run_tasks(int64_t ntask, const F& body) {
  if (ntask <= 0) return;
  const int64_t nworkers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ntask));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nworkers, 1, [&](int64_t w0, int64_t /*w1*/) {
    for (;;) {
      const int64_t t = next.fetch_add(1, std::memory_order_relaxed);
      if (t >= ntask) break;
      body(t, w0);
    }
  });
}

struct Dims {
  int64_t B, H, Hkv, Nq, Nk, d, P;
  MaskArgs mask;
};

// x [..., N, d] -> f x as [..., ceil(N / block), d, block]: each block of `block` rows transposed
// (zero-padded to a whole block). A tile of keys starting at a multiple of `block` then reads its
// K^T / V^T with leading dimension `block` whatever N is, so the tile products see a few fixed
// shapes (brgemm compiles a kernel per shape) and one O(N d) copy serves every query tile.
Tensor blocked_transpose(const Tensor& x, int64_t block, double f) {
  const int64_t N = x.size(-2), d = x.size(-1), nb = (N + block - 1) / block;
  Tensor y = f == 1.0 ? x : x * f;
  if (nb * block != N) y = at::constant_pad_nd(y, {0, 0, 0, nb * block - N});
  auto sizes = y.sizes().vec();
  sizes.resize(sizes.size() - 2);
  sizes.insert(sizes.end(), {nb, block, d});
  return y.reshape(sizes).transpose(-1, -2).contiguous();
}

}  // namespace
}  // namespace attention_cpu
}  // namespace condinit
