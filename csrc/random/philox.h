// Philox4x32-10 and its Box-Muller transform, shared by the C++ CPU kernel (randn_cpu.cpp) and
// the CUDA kernel (randn_kernels.cu). Light header: only <stdint.h> (and <string.h> on the host).
//
// The math is specified in condinit/ops/random/op.py (module docstring); the PyTorch reference there
// performs exactly the same float32 operations, one IEEE round-to-nearest step at a time, so all
// backends agree bit for bit. For that:
//   * every float operation below goes through CI_MUL / CI_ADD / CI_SUB / CI_SQRT: on the device
//     __fmul_rn / __fadd_rn / __fsqrt_rn, which nvcc never contracts into an FMA and which ignore
//     --use_fast_math's approximate sqrt; on the host plain operators, and the including .cpp must
//     be compiled without FMA contraction (randn_cpu.cpp: #pragma GCC optimize("fp-contract=off"));
//   * no intermediate is ever denormal (so -ftz makes no difference): |u| >= 2^-33, and the
//     smallest nonzero polynomial arguments are ~2^-23 (log) and ~3.7e-7 (sin/cos);
//   * integer-to-float conversions are of values < 2^24 (exact);
//   * range reductions are exact integer / bit operations.
#pragma once

#include <stdint.h>
#ifndef __CUDACC__
#include <string.h>
#endif

#if defined(__CUDACC__)
#define CI_HD __host__ __device__ __forceinline__
#else
#define CI_HD inline __attribute__((always_inline))
#endif

namespace condinit {
namespace philox {

constexpr uint32_t kM0 = 0xD2511F53u;
constexpr uint32_t kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u;
constexpr uint32_t kW1 = 0xBB67AE85u;
constexpr int kRounds = 10;

#if defined(__CUDA_ARCH__)
#define CI_MUL(a, b) __fmul_rn((a), (b))
#define CI_ADD(a, b) __fadd_rn((a), (b))
#define CI_SUB(a, b) __fsub_rn((a), (b))
#define CI_SQRT(a) __fsqrt_rn(a)
CI_HD uint32_t float_bits(float f) { return (uint32_t)__float_as_uint(f); }
CI_HD float bits_float(uint32_t u) { return __uint_as_float(u); }
CI_HD uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  *hi = __umulhi(a, b);
  return a * b;
}
#else
#define CI_MUL(a, b) ((a) * (b))
#define CI_ADD(a, b) ((a) + (b))
#define CI_SUB(a, b) ((a) - (b))
#define CI_SQRT(a) __builtin_sqrtf(a)
CI_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}
CI_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}
CI_HD uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t p = (uint64_t)a * (uint64_t)b;
  *hi = (uint32_t)(p >> 32);
  return (uint32_t)p;
}
#endif

// One Philox4x32 round (Salmon et al. 2011; Random123's philox4x32round).
CI_HD void round4x32(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3, uint32_t k0, uint32_t k1) {
  uint32_t hi0, hi1;
  const uint32_t lo0 = mulhilo(kM0, c0, &hi0);
  const uint32_t lo1 = mulhilo(kM1, c2, &hi1);
  const uint32_t n0 = hi1 ^ c1 ^ k0;
  const uint32_t n2 = hi0 ^ c3 ^ k1;
  c0 = n0;
  c1 = lo1;
  c2 = n2;
  c3 = lo0;
}

// Philox4x32-10 in place on the counter (c0..c3) with key (k0, k1).
CI_HD void philox4x32_10(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3, uint32_t k0, uint32_t k1) {
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int r = 0; r < kRounds; ++r) {
    round4x32(c0, c1, c2, c3, k0, k1);
    k0 += kW0;
    k1 += kW1;
  }
}

// float32 constants (exact values; the same hex floats as condinit/ops/random/op.py)
#define CI_LOG_P0 0x1.204376p-4f
#define CI_LOG_P1 -0x1.d7a37p-4f
#define CI_LOG_P2 0x1.de4a34p-4f
#define CI_LOG_P3 -0x1.fcba9ep-4f
#define CI_LOG_P4 0x1.23d37ep-3f
#define CI_LOG_P5 -0x1.555ca0p-3f
#define CI_LOG_P6 0x1.999d58p-3f
#define CI_LOG_P7 -0x1.fffff8p-3f
#define CI_LOG_P8 0x1.555554p-2f
#define CI_LN2_LO -0x1.bd0106p-13f
#define CI_LN2_HI 0x1.63p-1f
#define CI_SIN_P0 -0x1.9943f2p-13f
#define CI_SIN_P1 0x1.11073cp-7f
#define CI_SIN_P2 -0x1.555546p-3f
#define CI_COS_P0 0x1.99eb9cp-16f
#define CI_COS_P1 -0x1.6c0c34p-10f
#define CI_COS_P2 0x1.55554ap-5f
#define CI_ANGLE_STEP 0x1.921fb6p-22f  // fl(2 pi / 2^24)
#define CI_SQRT2_BITS 0x3FB504F3u      // bits of fl(sqrt 2)

// -2 ln(u), u = RN(x + 1/2) 2^-32 in (0, 1]: Cephes logf (few ulp), e ln 2 in two parts.
CI_HD float minus2log_open01(uint32_t x) {
  const float hi = (float)(int32_t)(x >> 8);
  const float lo = CI_ADD(CI_MUL((float)(int32_t)(x & 255u), 0x1p-8f), 0x1p-9f);
  const float u = CI_MUL(CI_ADD(hi, lo), 0x1p-24f);
  const uint32_t bits = float_bits(u);
  const uint32_t mb = (bits & 0x7FFFFFu) | 0x3F800000u;  // mantissa m in [1, 2)
  // m > sqrt 2: use m / 2 and e + 1. Branch-free (so the lane loops vectorize): f = m * scale - 1
  // with scale 1/2 or 1, both exact (m * 1 = m).
  const uint32_t big = mb > CI_SQRT2_BITS ? 1u : 0u;
  const int32_t e = (int32_t)(bits >> 23) - 127 + (int32_t)big;
  const float m = bits_float(mb);
  const float f = CI_SUB(CI_MUL(m, bits_float(0x3F800000u - (big << 23))), 1.0f);  // exact
  const float fe = (float)e;
  const float z = CI_MUL(f, f);
  float y = CI_MUL(f, CI_LOG_P0);
  y = CI_MUL(CI_ADD(y, CI_LOG_P1), f);
  y = CI_MUL(CI_ADD(y, CI_LOG_P2), f);
  y = CI_MUL(CI_ADD(y, CI_LOG_P3), f);
  y = CI_MUL(CI_ADD(y, CI_LOG_P4), f);
  y = CI_MUL(CI_ADD(y, CI_LOG_P5), f);
  y = CI_MUL(CI_ADD(y, CI_LOG_P6), f);
  y = CI_MUL(CI_ADD(y, CI_LOG_P7), f);
  y = CI_ADD(y, CI_LOG_P8);
  y = CI_MUL(CI_MUL(y, f), z);
  y = CI_ADD(y, CI_MUL(fe, CI_LN2_LO));
  y = CI_SUB(y, CI_MUL(z, 0.5f));
  const float ln = CI_ADD(CI_ADD(f, y), CI_MUL(fe, CI_LN2_HI));
  return CI_MUL(ln, -2.0f);
}

// (cos t, sin t) for t = 2 pi (x >> 8) / 2^24: exact quadrant split, Cephes sinf / cosf on
// [-pi/4, pi/4].
CI_HD void sincos_turn(uint32_t x, float* cos_t, float* sin_t) {
  const uint32_t y = (x >> 8) + (1u << 21);
  const uint32_t k = (y >> 22) & 3u;
  const int32_t rem = (int32_t)(y & ((1u << 22) - 1u)) - (1 << 21);
  const float a = CI_MUL((float)rem, CI_ANGLE_STEP);
  const float z = CI_MUL(a, a);
  float s = CI_MUL(z, CI_SIN_P0);
  s = CI_MUL(CI_ADD(s, CI_SIN_P1), z);
  s = CI_ADD(s, CI_SIN_P2);
  s = CI_ADD(CI_MUL(CI_MUL(s, z), a), a);
  float c = CI_MUL(z, CI_COS_P0);
  c = CI_MUL(CI_ADD(c, CI_COS_P1), z);
  c = CI_ADD(c, CI_COS_P2);
  c = CI_ADD(CI_SUB(CI_MUL(CI_MUL(c, z), z), CI_MUL(z, 0.5f)), 1.0f);
  const bool odd = (k & 1u) != 0;
  float ct = odd ? s : c;
  float st = odd ? c : s;
  ct = ((k + 1u) & 2u) ? -ct : ct;
  st = (k & 2u) ? -st : st;
  *cos_t = ct;
  *sin_t = st;
}

// Box-Muller of one pair of words: (r cos t, r sin t), r = sqrt(-2 ln u(xr)), t = 2 pi v(xa).
CI_HD void box_muller(uint32_t xr, uint32_t xa, float* z0, float* z1) {
  const float r = CI_SQRT(minus2log_open01(xr));
  float c, s;
  sincos_turn(xa, &c, &s);
  *z0 = CI_MUL(r, c);
  *z1 = CI_MUL(r, s);
}

}  // namespace philox
}  // namespace condinit
