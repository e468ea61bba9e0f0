// Emulated nvcuda::wmma (16x16x16, fp32 accumulation). Every lane computes the whole tile on its own;
// stores are done by lane 0 between two warp barriers. Loads and stores check the alignment and leading
// dimension rules of the real API (256-bit aligned pointers, ldm a multiple of 16 bytes) and abort otherwise.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "cuda_runtime.h"

namespace nvcuda {
namespace wmma {
struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  float x[256];  // logical (row, col) at x[row * 16 + col]
};

inline float emu_f(float v) { return v; }
inline float emu_f(__half v) { return __half2float(v); }
inline float emu_f(__nv_bfloat16 v) { return __bfloat162float(v); }

inline void emu_check(const void* p, unsigned ldm, unsigned elem) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0 || (ldm * elem) % 16 != 0) {
    fprintf(stderr, "wmma emulation: misaligned fragment pointer %p or ldm %u\n", p, ldm);
    abort();
  }
}

template <class Use, class T, class Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
  emu_check(p, ldm, sizeof(T));
  const bool rm = std::is_same<Layout, row_major>::value;
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) f.x[r * 16 + c] = emu_f(rm ? p[r * ldm + c] : p[r + c * ldm]);
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm, layout_t l) {
  emu_check(p, ldm, 4);
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) f.x[r * 16 + c] = l == mem_row_major ? p[r * ldm + c] : p[r + c * ldm];
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t l) {
  emu_check(p, ldm, 4);
  __syncwarp();  // every lane has loaded what this store may overwrite
  if (threadIdx.x % 32 == 0)
    for (int r = 0; r < 16; ++r)
      for (int c = 0; c < 16; ++c) (l == mem_row_major ? p[r * ldm + c] : p[r + c * ldm]) = f.x[r * 16 + c];
  __syncwarp();
}

inline void fill_fragment(fragment<accumulator, 16, 16, 16, float>& f, float v) {
  for (float& x : f.x) x = v;
}

template <class T, class LA, class LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, LA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LB>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
  float t[256];
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      float s = c.x[i * 16 + j];
      for (int k = 0; k < 16; ++k) s += a.x[i * 16 + k] * b.x[k * 16 + j];
      t[i * 16 + j] = s;
    }
  for (int i = 0; i < 256; ++i) d.x[i] = t[i];
}
}  // namespace wmma
}  // namespace nvcuda
