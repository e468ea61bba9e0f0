// condinit_C::philox_randn: counter-based standard normals (Philox4x32-10 + Box-Muller), C++ CPU
// kernel. The math (philox.h) is specified in condinit/ops/random/op.py; output is bitwise identical
// to the PyTorch reference there and to the CUDA kernel.
//
//   philox_randn(int seed_lo, int seed_hi, int stream, Tensor block_ids, int m, int n, Tensor(a!) out) -> ()
//
// writes block g = block_ids[b] into out[b] (float32 contiguous [B, m, n]): element e = i*n + j is
// lane e % 4 of Philox4x32-10(counter = (e / 4, stream, lo32(g), hi32(g)), key = (seed_lo, seed_hi)).
// condinit_C::philox_normal (below) writes mean + std * z of the same normals straight into a
// float32 / float64 / bfloat16 / float16 tensor.
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
#include "random/philox_cpu.h"
#include "random/randn_checks.h"

namespace condinit {
namespace {

constexpr int kLanes = 32;  // quads per tile: 128 normals

// A tile: quads q0 .. q0 + kLanes - 1 of one block -> 4 * kLanes normals in element order.
// Philox needs 32x32 -> 64-bit products, which GCC does not vectorize on x86 (there is no
// vector mulhi for 32-bit lanes): the AVX-512 / AVX2 variants write the rounds with vpmuludq
// intrinsics (AVX2: even and odd lanes; AVX-512: one quad per 64-bit lane), and the square root
// with vsqrtps. The rest (log, sin/cos, the interleaving store) are plain lane loops shared by all
// variants, which GCC vectorizes for each variant's ISA (they are inlined into the target-specific
// functions).

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
CONDINIT_AVX512 __attribute__((always_inline)) inline __m512i mul_epu32_512(__m512i a, __m512i b) {
  return _mm512_maskz_mul_epu32((__mmask8)0xFF, a, b);
}

CONDINIT_AVX512 __attribute__((always_inline)) inline void tile_avx512(
    uint32_t q0, uint32_t stream, uint32_t g_lo, uint32_t g_hi, uint32_t k0, uint32_t k1, float* __restrict__ tile) {
  // Each 64-bit lane carries one quad's counter word in its low half; the high half is don't-care
  // (vpmuludq reads only low halves, and XOR keeps the halves apart). Then a product's low half is
  // already in place and its high half one shift away: a round is two vpmuludq, two shifts and two
  // XORs per 8 quads, with no blends; the low halves are packed into 32-bit lanes once at the end.
  constexpr int V = kLanes / 8;  // independent zmm chains per word: hides the multiply latency
  static_assert(kLanes % 16 == 0, "whole zmm registers of quads");
  const __m512i M0 = _mm512_set1_epi64(philox::kM0), M1 = _mm512_set1_epi64(philox::kM1);
  const __m512i iota = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  __m512i c0[V], c1[V], c2[V], c3[V];
  for (int v = 0; v < V; ++v) {
    c0[v] = _mm512_add_epi64(_mm512_set1_epi64((uint32_t)(q0 + 8u * v)), iota);  // low half: q mod 2^32
    c1[v] = _mm512_set1_epi64(stream);
    c2[v] = _mm512_set1_epi64(g_lo);
    c3[v] = _mm512_set1_epi64(g_hi);
  }
  for (int r = 0; r < philox::kRounds; ++r) {
    const __m512i rk0 = _mm512_set1_epi64((uint32_t)(k0 + (uint32_t)r * philox::kW0));
    const __m512i rk1 = _mm512_set1_epi64((uint32_t)(k1 + (uint32_t)r * philox::kW1));
    for (int v = 0; v < V; ++v) {
      const __m512i p0 = mul_epu32_512(c0[v], M0);  // hi0 : lo0
      const __m512i p1 = mul_epu32_512(c2[v], M1);  // hi1 : lo1
      c0[v] = _mm512_ternarylogic_epi64(srl32_512(p1), c1[v], rk0, 0x96);  // hi1 ^ c1 ^ k0
      c2[v] = _mm512_ternarylogic_epi64(srl32_512(p0), c3[v], rk1, 0x96);  // hi0 ^ c3 ^ k1
      c1[v] = p1;
      c3[v] = p0;
    }
  }
  // low halves of two registers of 8 quads -> 16 consecutive 32-bit lanes
  const __m512i low_halves = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  alignas(64) uint32_t w0[kLanes], w1[kLanes], w2[kLanes], w3[kLanes];
  for (int v = 0; v < V; v += 2) {
    _mm512_store_si512(w0 + 8 * v, _mm512_permutex2var_epi32(c0[v], low_halves, c0[v + 1]));
    _mm512_store_si512(w1 + 8 * v, _mm512_permutex2var_epi32(c1[v], low_halves, c1[v + 1]));
    _mm512_store_si512(w2 + 8 * v, _mm512_permutex2var_epi32(c2[v], low_halves, c2[v + 1]));
    _mm512_store_si512(w3 + 8 * v, _mm512_permutex2var_epi32(c3[v], low_halves, c3[v + 1]));
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

// Work items: (block, quad) pairs in row-major order, in chunks of whole tiles. Threads take
// chunks from a shared counter (dynamic scheduling) rather than one static range each: on a
// machine whose cores are shared, a thread that gets descheduled does not hold up the others.
// body(b, q, q_end) generates quads [q, q_end) of block b (Q quads per block; the last block may
// have fewer, total counts them all).
template <typename Body>
void for_quad_chunks(int64_t total, int64_t Q, const Body& body) {
  constexpr int64_t kChunk = int64_t(1) << 14;  // quads (64K normals, 256 KiB of float32 output)
  const int64_t n_chunks = (total + kChunk - 1) / kChunk;
  auto run = [&](int64_t begin, int64_t end) {
    int64_t b = begin / Q, q = begin - b * Q;
    for (int64_t pos = begin; pos < end;) {
      const int64_t q_end = std::min(Q, q + (end - pos));
      body(b, q, q_end);
      pos += q_end - q;
      q = q_end;
      if (q == Q) {
        ++b;
        q = 0;
      }
    }
  };
  const int64_t n_threads = std::min<int64_t>(at::get_num_threads(), n_chunks);
  if (n_threads <= 1) {
    run(0, total);
    return;
  }
  std::atomic<int64_t> next_chunk{0};
  at::parallel_for(0, n_threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next_chunk.fetch_add(1); c < n_chunks; c = next_chunk.fetch_add(1))
      run(c * kChunk, std::min(total, (c + 1) * kChunk));
  });
}

// Quads [q, q_end) of block g (mn normals at blk): whole tiles straight into blk, the rest (fewer
// than kLanes quads, or the block's tail) through a tile buffer.
void fill_quads(const Kernels& kern, uint32_t k0, uint32_t k1, uint32_t s, uint64_t g, int64_t mn, int64_t q,
                int64_t q_end, float* blk) {
  const uint32_t g_lo = (uint32_t)g, g_hi = (uint32_t)(g >> 32);
  const int64_t full_quads = std::min(q_end, mn / 4);  // quads entirely inside the block
  const int64_t n_tiles = full_quads > q ? (full_quads - q) / kLanes : 0;
  if (n_tiles > 0) {
    kern.run((uint32_t)q, n_tiles, s, g_lo, g_hi, k0, k1, blk + 4 * q);
    q += n_tiles * kLanes;
  }
  alignas(64) float tile[4 * kLanes];
  while (q < q_end) {
    kern.tile((uint32_t)q, s, g_lo, g_hi, k0, k1, tile);
    const int64_t nq = std::min<int64_t>(kLanes, q_end - q);
    const int64_t n_el = std::min<int64_t>(4 * nq, mn - 4 * q);
    std::memcpy(blk + 4 * q, tile, sizeof(float) * n_el);
    q += nq;
  }
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

  for_quad_chunks(B * Q, Q, [&](int64_t b, int64_t q, int64_t q_end) {
    fill_quads(kern, k0, k1, s, (uint64_t)gid[b], mn, q, q_end, dst + b * mn);
  });
}


// ---------------------------------------------------------------------------------------------------
// condinit_C::philox_normal: mean + std * z written straight into the destination dtype.
//
//   philox_normal(int seed_lo, int seed_hi, int stream, Tensor block_ids, int m, int n, float mean,
//                 float std, Tensor(a!) out) -> ()
//
// out: contiguous float32 / float64 / bfloat16 / float16 with (B - 1) m n < numel <= B m n elements
// (B = len(block_ids)); element k of out is element k % (m n) of block block_ids[k / (m n)] (a
// last block may be cut short). The value is what the composite `z * (float)std`, then
// `+ (float)mean` when mean != 0, then `.to(dtype)` gives in torch, bit for bit: z the float32
// normals of philox_randn, the affine step in float32 (no FMA: this file is fp-contract=off), then
// one rounding to the destination dtype as torch's CPU conversion does it (round to nearest even;
// a NaN becomes 0xFFFF in bfloat16 as torch's vectorized conversion writes it, and is quieted with
// its sign kept in float16). Each tile of 4 * kLanes normals is generated into a stack array and
// converted from there (one pass over the destination, instead of a float32 buffer written, scaled
// and copied).

// affine step in place on one tile (always inlined: vectorized for the caller's ISA)
template <bool kMean>
__attribute__((always_inline)) inline void affine_tile(float* __restrict__ tile, float scale, float shift) {
  for (int i = 0; i < 4 * kLanes; ++i) {
    float y = tile[i] * scale;
    if (kMean) y = y + shift;
    tile[i] = y;
  }
}

__attribute__((always_inline)) inline void store_tile_f32(const float* __restrict__ y, float* __restrict__ dst) {
  for (int i = 0; i < 4 * kLanes; ++i) dst[i] = y[i];
}

__attribute__((always_inline)) inline void store_tile_f64(const float* __restrict__ y, double* __restrict__ dst) {
  for (int i = 0; i < 4 * kLanes; ++i) dst[i] = (double)y[i];
}

// round to nearest even on the bits (ATen's cvtfp32_bf16); NaN -> 0xFFFF like ATen's vector path
__attribute__((always_inline)) inline void store_tile_bf16(const float* __restrict__ y, uint16_t* __restrict__ dst) {
  for (int i = 0; i < 4 * kLanes; ++i) {
    const uint32_t u = philox::float_bits(y[i]);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    dst[i] = (uint16_t)(y[i] != y[i] ? 0xFFFFu : r);
  }
}

// c10::Half's software conversion (round to nearest even), what torch uses without F16C
__attribute__((always_inline)) inline void store_tile_f16_soft(const float* __restrict__ y, uint16_t* __restrict__ dst) {
  for (int i = 0; i < 4 * kLanes; ++i) dst[i] = c10::detail::fp16_ieee_from_fp32_value(y[i]);
}

#ifdef CONDINIT_X86_DISPATCH
#define CONDINIT_AVX2_F16C __attribute__((target("avx2,fma,f16c")))
CONDINIT_AVX512 __attribute__((always_inline)) inline void store_tile_f16_avx512(const float* __restrict__ y,
                                                                                 uint16_t* __restrict__ dst) {
  for (int i = 0; i < 4 * kLanes; i += 16)
    // (maskz: the plain intrinsic merges into an undefined register, which GCC 12 -Wall reports)
    _mm256_storeu_si256((__m256i*)(dst + i), _mm512_maskz_cvtps_ph((__mmask16)0xFFFF, _mm512_loadu_ps(y + i),
                                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
CONDINIT_AVX2_F16C __attribute__((always_inline)) inline void store_tile_f16_f16c(const float* __restrict__ y,
                                                                                  uint16_t* __restrict__ dst) {
  for (int i = 0; i < 4 * kLanes; i += 8)
    _mm_storeu_si128((__m128i*)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(y + i),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// n_el elements from quad q0 of one block into dst (whole tiles, the last one cut to n_el).
#define CONDINIT_NORMAL_RUN_FN(NAME, TILE, STORE, ATTR, T, MEAN)                                       \
  ATTR static void NAME(uint32_t q0, int64_t n_el, uint32_t stream, uint32_t g_lo, uint32_t g_hi,       \
                        uint32_t k0, uint32_t k1, float scale, float shift, void* out) {                \
    T* dst = (T*)out;                                                                                  \
    alignas(64) float tile[4 * kLanes];                                                                \
    for (int64_t t = 0; n_el > 0; ++t, dst += 4 * kLanes, n_el -= 4 * kLanes) {                        \
      TILE(q0 + (uint32_t)(t * kLanes), stream, g_lo, g_hi, k0, k1, tile);                             \
      affine_tile<MEAN>(tile, scale, shift);                                                           \
      if (n_el >= 4 * kLanes) {                                                                        \
        STORE(tile, dst);                                                                              \
      } else {                                                                                         \
        alignas(64) T part[4 * kLanes];                                                                \
        STORE(tile, part);                                                                             \
        std::memcpy(dst, part, sizeof(T) * n_el);                                                      \
      }                                                                                                \
    }                                                                                                  \
  }

// the 8 functions (destination dtype x mean or not) of one ISA, in the order of NormalKernels::fn
#define CONDINIT_NORMAL_ISA(ISA, TILE, ATTR, STORE_F16)                                         \
  CONDINIT_NORMAL_RUN_FN(normal_##ISA##_f32_0, TILE, store_tile_f32, ATTR, float, false)        \
  CONDINIT_NORMAL_RUN_FN(normal_##ISA##_f32_1, TILE, store_tile_f32, ATTR, float, true)         \
  CONDINIT_NORMAL_RUN_FN(normal_##ISA##_f64_0, TILE, store_tile_f64, ATTR, double, false)       \
  CONDINIT_NORMAL_RUN_FN(normal_##ISA##_f64_1, TILE, store_tile_f64, ATTR, double, true)        \
  CONDINIT_NORMAL_RUN_FN(normal_##ISA##_bf16_0, TILE, store_tile_bf16, ATTR, uint16_t, false)   \
  CONDINIT_NORMAL_RUN_FN(normal_##ISA##_bf16_1, TILE, store_tile_bf16, ATTR, uint16_t, true)    \
  CONDINIT_NORMAL_RUN_FN(normal_##ISA##_f16_0, TILE, STORE_F16, ATTR, uint16_t, false)          \
  CONDINIT_NORMAL_RUN_FN(normal_##ISA##_f16_1, TILE, STORE_F16, ATTR, uint16_t, true)

#ifdef CONDINIT_X86_DISPATCH
CONDINIT_NORMAL_ISA(avx512, tile_avx512, CONDINIT_AVX512, store_tile_f16_avx512)
CONDINIT_NORMAL_ISA(avx2, tile_avx2, CONDINIT_AVX2_F16C, store_tile_f16_f16c)
#endif
CONDINIT_NORMAL_ISA(default, tile_default, , store_tile_f16_soft)

using NormalFn = void (*)(uint32_t, int64_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, float, float, void*);

#define CONDINIT_NORMAL_TABLE(ISA)                                                                    \
  {                                                                                                 \
    normal_##ISA##_f32_0, normal_##ISA##_f32_1, normal_##ISA##_f64_0, normal_##ISA##_f64_1,          \
        normal_##ISA##_bf16_0, normal_##ISA##_bf16_1, normal_##ISA##_f16_0, normal_##ISA##_f16_1     \
  }

// The kernel for a destination dtype, from the variant pick_kernels chose (the AVX2 one also needs
// F16C, which every AVX2 CPU has).
NormalFn pick_normal_kernel(at::ScalarType dtype, bool with_mean) {
  int slot;
  switch (dtype) {
    case at::kFloat: slot = 0; break;
    case at::kDouble: slot = 2; break;
    case at::kBFloat16: slot = 4; break;
    case at::kHalf: slot = 6; break;
    default: TORCH_CHECK(false, "philox_normal: out must be float32, float64, bfloat16 or float16, got ", dtype);
  }
  slot += with_mean ? 1 : 0;
  static const NormalFn fallback[8] = CONDINIT_NORMAL_TABLE(default);
  const Kernels kern = pick_kernels();
#ifdef CONDINIT_X86_DISPATCH
  static const NormalFn k512[8] = CONDINIT_NORMAL_TABLE(avx512);
  static const NormalFn k2[8] = CONDINIT_NORMAL_TABLE(avx2);
  if (kern.run == run_avx512) return k512[slot];
  if (kern.run == run_avx2) {
    TORCH_CHECK(__builtin_cpu_supports("f16c"), "philox_normal: the AVX2 kernel needs F16C, which this CPU lacks");
    return k2[slot];
  }
#endif
  (void)kern;
  return fallback[slot];
}

void philox_normal_cpu(int64_t seed_lo, int64_t seed_hi, int64_t stream, const at::Tensor& block_ids, int64_t m,
                       int64_t n, double mean, double std, at::Tensor& out) {
  TORCH_CHECK(block_ids.device().is_cpu() && out.device().is_cpu(), "philox_normal: CPU tensors expected");
  check_philox_stream_args("philox_normal", seed_lo, seed_hi, stream, block_ids, m, n);
  const int64_t B = block_ids.numel();
  const int64_t mn = m * n;
  const int64_t numel = out.numel();
  TORCH_CHECK(out.is_contiguous(), "philox_normal: out must be contiguous");
  TORCH_CHECK(numel <= B * mn && (B == 0 || numel > (B - 1) * mn), "philox_normal: out has ", numel,
              " elements; ", B, " blocks of ", mn, " need more than ", (B - 1) * mn, " and at most ", B * mn);
  const NormalFn fn = pick_normal_kernel(out.scalar_type(), mean != 0.0);
  if (numel == 0) return;
  const at::Tensor ids = block_ids.contiguous();
  const int64_t* gid = ids.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(gid[b] >= 0, "philox_normal: block_ids must be >= 0");
  char* dst = (char*)out.data_ptr();
  const int64_t el_size = out.element_size();
  // No advise_huge_pages here: out is usually a tensor of the model, used once. On a VM, 2 MiB pages
  // tend to come from guest memory the host has not backed yet, and their first touch measured 3x
  // slower than 4 KiB faults (recycled pages) for a fresh 525 MB embedding.
  // torch's scalar arguments of mul_ / add_ on a float32 tensor: the doubles rounded to float32
  const float scale = (float)std, shift = (float)mean;
  const uint32_t k0 = (uint32_t)seed_lo, k1 = (uint32_t)seed_hi, s = (uint32_t)stream;
  const int64_t Q = (mn + 3) / 4;
  const int64_t last_el = numel - (B - 1) * mn;  // elements of the last block
  const int64_t total = (B - 1) * Q + (last_el + 3) / 4;
  for_quad_chunks(total, Q, [&](int64_t b, int64_t q, int64_t q_end) {
    const uint64_t g = (uint64_t)gid[b];
    const int64_t block_el = b == B - 1 ? last_el : mn;
    const int64_t n_el = std::min(4 * q_end, block_el) - 4 * q;
    fn((uint32_t)q, n_el, s, (uint32_t)g, (uint32_t)(g >> 32), k0, k1, scale, shift,
       dst + (b * mn + 4 * q) * el_size);
  });
}

}  // namespace

void philox_randn_block(int64_t seed_lo, int64_t seed_hi, int64_t stream, int64_t block_id, int64_t mn,
                        float* dst) {
  fill_quads(pick_kernels(), (uint32_t)seed_lo, (uint32_t)seed_hi, (uint32_t)stream, (uint64_t)block_id, mn, 0,
             (mn + 3) / 4, dst);
}

}  // namespace condinit

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(condinit_C, m) {
  m.def("philox_randn(int seed_lo, int seed_hi, int stream, Tensor block_ids, int m, int n, Tensor(a!) out) -> ()");
  m.def("philox_normal(int seed_lo, int seed_hi, int stream, Tensor block_ids, int m, int n, float mean, float std, "
        "Tensor(a!) out) -> ()");
}

namespace {
void philox_randn_cpu_op(int64_t seed_lo, int64_t seed_hi, int64_t stream, const at::Tensor& block_ids,
                         int64_t m, int64_t n, at::Tensor out) {
  condinit::philox_randn_cpu(seed_lo, seed_hi, stream, block_ids, m, n, out);
}
void philox_normal_cpu_op(int64_t seed_lo, int64_t seed_hi, int64_t stream, const at::Tensor& block_ids,
                          int64_t m, int64_t n, double mean, double std, at::Tensor out) {
  condinit::philox_normal_cpu(seed_lo, seed_hi, stream, block_ids, m, n, mean, std, out);
}
}  // namespace

TORCH_LIBRARY_IMPL(condinit_C, CPU, m) {
  m.impl("philox_randn", &philox_randn_cpu_op);
  m.impl("philox_normal", &philox_normal_cpu_op);
}
