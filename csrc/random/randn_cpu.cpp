// condinit_C::philox_randn: counter-based standard normals (Philox4x32-10 + Box-Muller), C++ CPU
// kernel. The math (philox.h) is specified in condinit/init/philox.py; output is bitwise identical
// to the PyTorch reference there and to the CUDA kernel.
//
//   philox_randn(int seed_lo, int seed_hi, int stream, Tensor block_ids, int m, int n, Tensor(a!) out) -> ()
//
// writes block g = block_ids[b] into out[b] (float32 contiguous [B, m, n]): element e = i*n + j is
// lane e % 4 of Philox4x32-10(counter = (e / 4, stream, lo32(g), hi32(g)), key = (seed_lo, seed_hi)).
//
// Speed: threads take chunks of (block, quad) work items from a shared counter; each generates
// tiles of kLanes quads: Philox with vpmuludq intrinsics (GCC cannot vectorize a 32x32->64-bit
// mulhi), the Box-Muller math as plain loops over lane arrays that GCC vectorizes. The hot loop is
// compiled three times (AVX-512, AVX2+FMA, baseline x86-64) and the best one the CPU supports is
// picked at run time (like target_clones, but testable), so the extension needs no -march flag;
// CONDINIT_RANDN_ISA=avx512|avx2|default forces one (tests check that all three give the same bits).
// A large fresh output is mostly page faults: see advise_huge_pages.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

// No FMA contraction in anything below (the AVX2 / AVX-512 variants have FMA available): every
// float32 operation must round on its own, as in the reference.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off", "no-math-errno")

#include "random/philox.h"
#include "random/randn_checks.h"

namespace condinit {
namespace {

constexpr int kLanes = 32;  // quads per tile: 128 normals

// A tile: quads q0 .. q0 + kLanes - 1 of one block -> 4 * kLanes normals in element order.
// Philox needs 32x32 -> 64-bit products, which GCC does not vectorize on x86 (there is no
// vector mulhi for 32-bit lanes): the AVX-512 / AVX2 variants write the rounds with vpmuludq
// intrinsics (even and odd lanes), and the square root with vsqrtps. The rest (log, sin/cos, the
// interleaving store) are plain lane loops shared by all variants, which GCC vectorizes for each
// variant's ISA (they are inlined into the target-specific functions).

// pair p = 2 l + w uses words (x_{2w}, x_{2w+1}) of quad l and gives elements 2p, 2p + 1
__attribute__((always_inline)) inline void spread_words(const uint32_t* c0, const uint32_t* c1,
                                                        const uint32_t* c2, const uint32_t* c3,
                                                        uint32_t* __restrict__ xr, uint32_t* __restrict__ xa) {
  for (int l = 0; l < kLanes; ++l) {
    xr[2 * l] = c0[l];
    xa[2 * l] = c1[l];
    xr[2 * l + 1] = c2[l];
    xa[2 * l + 1] = c3[l];
  }
}

__attribute__((always_inline)) inline void minus2log_lanes(const uint32_t* __restrict__ xr, float* __restrict__ r2) {
  for (int p = 0; p < 2 * kLanes; ++p) r2[p] = philox::minus2log_open01(xr[p]);
}

__attribute__((always_inline)) inline void sincos_store_lanes(const uint32_t* __restrict__ xa,
                                                              const float* __restrict__ rr,
                                                              float* __restrict__ tile) {
  float zc[2 * kLanes], zs[2 * kLanes];
  for (int p = 0; p < 2 * kLanes; ++p) philox::sincos_turn(xa[p], &zc[p], &zs[p]);
  for (int p = 0; p < 2 * kLanes; ++p) {
    tile[2 * p] = CI_MUL(rr[p], zc[p]);
    tile[2 * p + 1] = CI_MUL(rr[p], zs[p]);
  }
}

inline void tile_default(uint32_t q0, uint32_t stream, uint32_t g_lo, uint32_t g_hi, uint32_t k0, uint32_t k1,
                         float* __restrict__ tile) {
  uint32_t c0[kLanes], c1[kLanes], c2[kLanes], c3[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    c0[l] = q0 + (uint32_t)l;
    c1[l] = stream;
    c2[l] = g_lo;
    c3[l] = g_hi;
    philox::philox4x32_10(c0[l], c1[l], c2[l], c3[l], k0, k1);
  }
  uint32_t xr[2 * kLanes], xa[2 * kLanes];
  float rr[2 * kLanes];
  spread_words(c0, c1, c2, c3, xr, xa);
  minus2log_lanes(xr, rr);
#if defined(__SSE2__)
  for (int p = 0; p < 2 * kLanes; p += 4) _mm_storeu_ps(rr + p, _mm_sqrt_ps(_mm_loadu_ps(rr + p)));
#else
  for (int p = 0; p < 2 * kLanes; ++p) rr[p] = CI_SQRT(rr[p]);
#endif
  sincos_store_lanes(xa, rr, tile);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define CONDINIT_X86_DISPATCH 1
#define CONDINIT_AVX512 __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,fma")))
#define CONDINIT_AVX2 __attribute__((target("avx2,fma")))

// 64-bit lane shifts and the even-lane 32x32->64 product. (Not _mm512_srli_epi64 / _mm512_mul_epu32:
// in GCC 12 they merge into _mm512_undefined_epi32(), which -Wall reports as uninitialized.)
typedef unsigned long long ci_v8du __attribute__((vector_size(64)));
CONDINIT_AVX512 __attribute__((always_inline)) inline __m512i srl32_512(__m512i x) { return (__m512i)((ci_v8du)x >> 32); }
CONDINIT_AVX512 __attribute__((always_inline)) inline __m512i sll32_512(__m512i x) { return (__m512i)((ci_v8du)x << 32); }
CONDINIT_AVX512 __attribute__((always_inline)) inline __m512i mul_epu32_512(__m512i a, __m512i b) {
  return _mm512_maskz_mul_epu32((__mmask8)0xFF, a, b);
}

CONDINIT_AVX512 __attribute__((always_inline)) inline void tile_avx512(
    uint32_t q0, uint32_t stream, uint32_t g_lo, uint32_t g_hi, uint32_t k0, uint32_t k1, float* __restrict__ tile) {
  constexpr int V = kLanes / 16;  // independent zmm chains per word: hides the multiply latency
  static_assert(kLanes % 16 == 0, "whole zmm registers of quads");
  const __m512i M0 = _mm512_set1_epi32((int)philox::kM0), M1 = _mm512_set1_epi32((int)philox::kM1);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i c0[V], c1[V], c2[V], c3[V];
  for (int v = 0; v < V; ++v) {
    c0[v] = _mm512_add_epi32(_mm512_set1_epi32((int)(q0 + 16u * v)), iota);
    c1[v] = _mm512_set1_epi32((int)stream);
    c2[v] = _mm512_set1_epi32((int)g_lo);
    c3[v] = _mm512_set1_epi32((int)g_hi);
  }
  for (int r = 0; r < philox::kRounds; ++r) {
    const __m512i rk0 = _mm512_set1_epi32((int)(k0 + (uint32_t)r * philox::kW0));
    const __m512i rk1 = _mm512_set1_epi32((int)(k1 + (uint32_t)r * philox::kW1));
    for (int v = 0; v < V; ++v) {
      // 64-bit products of the even lanes, and of the odd lanes shifted down
      const __m512i e0 = mul_epu32_512(c0[v], M0), o0 = mul_epu32_512(srl32_512(c0[v]), M0);
      const __m512i e1 = mul_epu32_512(c2[v], M1), o1 = mul_epu32_512(srl32_512(c2[v]), M1);
      const __m512i hi0 = _mm512_mask_blend_epi32(0xAAAA, srl32_512(e0), o0);
      const __m512i lo0 = _mm512_mask_blend_epi32(0xAAAA, e0, sll32_512(o0));
      const __m512i hi1 = _mm512_mask_blend_epi32(0xAAAA, srl32_512(e1), o1);
      const __m512i lo1 = _mm512_mask_blend_epi32(0xAAAA, e1, sll32_512(o1));
      const __m512i n0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1[v]), rk0);
      const __m512i n2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3[v]), rk1);
      c0[v] = n0;
      c1[v] = lo1;
      c2[v] = n2;
      c3[v] = lo0;
    }
  }
  alignas(64) uint32_t w0[kLanes], w1[kLanes], w2[kLanes], w3[kLanes];
  for (int v = 0; v < V; ++v) {
    _mm512_store_si512(w0 + 16 * v, c0[v]);
    _mm512_store_si512(w1 + 16 * v, c1[v]);
    _mm512_store_si512(w2 + 16 * v, c2[v]);
    _mm512_store_si512(w3 + 16 * v, c3[v]);
  }
  alignas(64) uint32_t xr[2 * kLanes], xa[2 * kLanes];
  alignas(64) float rr[2 * kLanes];
  spread_words(w0, w1, w2, w3, xr, xa);
  minus2log_lanes(xr, rr);
  for (int p = 0; p < 2 * kLanes; p += 16) _mm512_store_ps(rr + p, _mm512_maskz_sqrt_ps((__mmask16)0xFFFF, _mm512_load_ps(rr + p)));
  sincos_store_lanes(xa, rr, tile);
}

CONDINIT_AVX2 __attribute__((always_inline)) inline void tile_avx2(uint32_t q0, uint32_t stream, uint32_t g_lo, uint32_t g_hi, uint32_t k0,
                                    uint32_t k1, float* __restrict__ tile) {
  static_assert(kLanes % 8 == 0, "whole ymm registers of quads");
  const __m256i M0 = _mm256_set1_epi32((int)philox::kM0), M1 = _mm256_set1_epi32((int)philox::kM1);
  alignas(32) uint32_t w0[kLanes], w1[kLanes], w2[kLanes], w3[kLanes];
  for (int h = 0; h < kLanes; h += 8) {
    __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32((int)(q0 + (uint32_t)h)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i c1 = _mm256_set1_epi32((int)stream), c2 = _mm256_set1_epi32((int)g_lo), c3 = _mm256_set1_epi32((int)g_hi);
    for (int r = 0; r < philox::kRounds; ++r) {
      const __m256i rk0 = _mm256_set1_epi32((int)(k0 + (uint32_t)r * philox::kW0));
      const __m256i rk1 = _mm256_set1_epi32((int)(k1 + (uint32_t)r * philox::kW1));
      const __m256i e0 = _mm256_mul_epu32(c0, M0), o0 = _mm256_mul_epu32(_mm256_srli_epi64(c0, 32), M0);
      const __m256i e1 = _mm256_mul_epu32(c2, M1), o1 = _mm256_mul_epu32(_mm256_srli_epi64(c2, 32), M1);
      const __m256i hi0 = _mm256_blend_epi32(_mm256_srli_epi64(e0, 32), o0, 0xAA);
      const __m256i lo0 = _mm256_blend_epi32(e0, _mm256_slli_epi64(o0, 32), 0xAA);
      const __m256i hi1 = _mm256_blend_epi32(_mm256_srli_epi64(e1, 32), o1, 0xAA);
      const __m256i lo1 = _mm256_blend_epi32(e1, _mm256_slli_epi64(o1, 32), 0xAA);
      const __m256i n0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), rk0);
      const __m256i n2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), rk1);
      c0 = n0;
      c1 = lo1;
      c2 = n2;
      c3 = lo0;
    }
    _mm256_store_si256((__m256i*)(w0 + h), c0);
    _mm256_store_si256((__m256i*)(w1 + h), c1);
    _mm256_store_si256((__m256i*)(w2 + h), c2);
    _mm256_store_si256((__m256i*)(w3 + h), c3);
  }
  alignas(32) uint32_t xr[2 * kLanes], xa[2 * kLanes];
  alignas(32) float rr[2 * kLanes];
  spread_words(w0, w1, w2, w3, xr, xa);
  minus2log_lanes(xr, rr);
  for (int p = 0; p < 2 * kLanes; p += 8) _mm256_store_ps(rr + p, _mm256_sqrt_ps(_mm256_load_ps(rr + p)));
  sincos_store_lanes(xa, rr, tile);
}
#endif

// Generate whole tiles straight into `dst` (n_tiles * 4 * kLanes floats), starting at quad q0.
#define CONDINIT_PHILOX_RUN_FN(NAME, TILE, ATTR)                                                    \
  ATTR static void NAME(uint32_t q0, int64_t n_tiles, uint32_t stream, uint32_t g_lo, uint32_t g_hi, \
                        uint32_t k0, uint32_t k1, float* __restrict__ dst) {                        \
    for (int64_t t = 0; t < n_tiles; ++t)                                                            \
      TILE(q0 + (uint32_t)(t * kLanes), stream, g_lo, g_hi, k0, k1, dst + t * 4 * kLanes);           \
  }

#ifdef CONDINIT_X86_DISPATCH
CONDINIT_PHILOX_RUN_FN(run_avx512, tile_avx512, CONDINIT_AVX512)
CONDINIT_PHILOX_RUN_FN(run_avx2, tile_avx2, CONDINIT_AVX2)
#endif
CONDINIT_PHILOX_RUN_FN(run_default, tile_default, )

using RunFn = void (*)(uint32_t, int64_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, float*);
using TileFn = void (*)(uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, float*);

struct Kernels {
  RunFn run;
  TileFn tile;
};

Kernels pick_kernels() {
  std::string isa;
  if (const char* env = std::getenv("CONDINIT_RANDN_ISA")) isa = env;
#ifdef CONDINIT_X86_DISPATCH
  __builtin_cpu_init();
  const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("fma");
  const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == "default") return {run_default, tile_default};
  if (isa == "avx2") {
    TORCH_CHECK(has2, "CONDINIT_RANDN_ISA=avx2 but this CPU lacks AVX2/FMA");
    return {run_avx2, tile_avx2};
  }
  if (isa == "avx512") {
    TORCH_CHECK(has512, "CONDINIT_RANDN_ISA=avx512 but this CPU lacks AVX-512");
    return {run_avx512, tile_avx512};
  }
  TORCH_CHECK(isa.empty() || isa == "auto", "CONDINIT_RANDN_ISA must be avx512, avx2, default or auto, got ", isa);
  if (has512) return {run_avx512, tile_avx512};
  if (has2) return {run_avx2, tile_avx2};
#else
  TORCH_CHECK(isa.empty() || isa == "auto" || isa == "default",
              "CONDINIT_RANDN_ISA=", isa, " is only available on x86-64");
#endif
  return {run_default, tile_default};
}

// A freshly allocated output is mostly first-touch page faults: with transparent huge pages in
// "madvise" mode (a common default) ask for 2 MiB pages over the buffer's aligned interior, which
// makes the faults 512x fewer. Only a hint: errors (e.g. memory that is not anonymous) are ignored,
// and pages already touched stay as they are.
void advise_huge_pages(void* ptr, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (bytes < 4 * kHuge) return;
  const uintptr_t begin = ((uintptr_t)ptr + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = ((uintptr_t)ptr + bytes) & ~(kHuge - 1);
  if (end > begin) (void)madvise((void*)begin, end - begin, MADV_HUGEPAGE);
#else
  (void)ptr;
  (void)bytes;
#endif
}

void philox_randn_cpu(int64_t seed_lo, int64_t seed_hi, int64_t stream, const at::Tensor& block_ids,
                      int64_t m, int64_t n, at::Tensor& out) {
  TORCH_CHECK(block_ids.device().is_cpu() && out.device().is_cpu(), "philox_randn: CPU tensors expected");
  const int64_t B = condinit::check_philox_randn_args(seed_lo, seed_hi, stream, block_ids, m, n, out);
  const int64_t mn = m * n;
  const int64_t Q = (mn + 3) / 4;  // Philox quads per block
  if (B == 0) return;
  const at::Tensor ids = block_ids.contiguous();
  const int64_t* gid = ids.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(gid[b] >= 0, "philox_randn: block_ids must be >= 0");
  float* dst = out.data_ptr<float>();
  advise_huge_pages(dst, out.numel() * sizeof(float));
  const Kernels kern = pick_kernels();
  const uint32_t k0 = (uint32_t)seed_lo, k1 = (uint32_t)seed_hi, s = (uint32_t)stream;

  // Work items: (block, quad) pairs in row-major order, in chunks of whole tiles. Threads take
  // chunks from a shared counter (dynamic scheduling) rather than one static range each: on a
  // machine whose cores are shared, a thread that gets descheduled does not hold up the others.
  const int64_t total = B * Q;
  constexpr int64_t kChunk = int64_t(1) << 14;  // quads (64K normals, 256 KiB of output)
  const int64_t n_chunks = (total + kChunk - 1) / kChunk;
  auto generate = [&](int64_t begin, int64_t end) {
    int64_t b = begin / Q;
    int64_t q = begin - b * Q;
    int64_t pos = begin;
    alignas(64) float tile[4 * kLanes];
    while (pos < end) {
      const uint64_t g = (uint64_t)gid[b];
      const uint32_t g_lo = (uint32_t)g, g_hi = (uint32_t)(g >> 32);
      const int64_t q_end = std::min(Q, q + (end - pos));  // stop at the block's or range's end
      float* blk = dst + b * mn;
      // whole tiles whose 4 * kLanes elements all lie inside the block: straight into out
      const int64_t full_quads = std::min(q_end, mn / 4);  // quads entirely inside the block
      const int64_t n_tiles = full_quads > q ? (full_quads - q) / kLanes : 0;
      if (n_tiles > 0) {
        kern.run((uint32_t)q, n_tiles, s, g_lo, g_hi, k0, k1, blk + 4 * q);
        q += n_tiles * kLanes;
      }
      // the rest (< kLanes quads, or a block tail): through a tile buffer
      while (q < q_end) {
        kern.tile((uint32_t)q, s, g_lo, g_hi, k0, k1, tile);
        const int64_t nq = std::min<int64_t>(kLanes, q_end - q);
        const int64_t n_el = std::min<int64_t>(4 * nq, mn - 4 * q);
        std::memcpy(blk + 4 * q, tile, sizeof(float) * n_el);
        q += nq;
      }
      pos = b * Q + q;
      if (q == Q) {
        ++b;
        q = 0;
      }
    }
  };
  const int64_t n_threads = std::min<int64_t>(at::get_num_threads(), n_chunks);
  if (n_threads <= 1) {
    generate(0, total);
    return;
  }
  std::atomic<int64_t> next_chunk{0};
  at::parallel_for(0, n_threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next_chunk.fetch_add(1); c < n_chunks; c = next_chunk.fetch_add(1))
      generate(c * kChunk, std::min(total, (c + 1) * kChunk));
  });
}

}  // namespace
}  // namespace condinit

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(condinit_C, m) {
  m.def("philox_randn(int seed_lo, int seed_hi, int stream, Tensor block_ids, int m, int n, Tensor(a!) out) -> ()");
}

namespace {
void philox_randn_cpu_op(int64_t seed_lo, int64_t seed_hi, int64_t stream, const at::Tensor& block_ids,
                         int64_t m, int64_t n, at::Tensor out) {
  condinit::philox_randn_cpu(seed_lo, seed_hi, stream, block_ids, m, n, out);
}
}  // namespace

TORCH_LIBRARY_IMPL(condinit_C, CPU, m) { m.impl("philox_randn", &philox_randn_cpu_op); }
