// Emulated warp-collective matrix instructions of sm_80: ldmatrix and mma.sync.
//
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32: a warp-collective
// operation on per-lane registers, with the fragment layouts of the PTX ISA ("Matrix Fragments for
// mma.m16n8k16 with floating point type"). lane = 4 * groupID + threadID_in_group (g, t):
//   A (16 x 16, row): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16 x 8, col):  b0 = (k = 2t..2t+1, n = g), b1 = (k = 2t+8..2t+9, n = g)
//   C/D (16 x 8):     c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, 2t..2t+1)
// each 32-bit register holding two 16-bit values, the lower index in the lower half. Every lane
// publishes its registers, then computes its own four outputs from the whole warp's: a kernel that
// puts a value in the wrong register gets a wrong product here, as on a GPU.
#pragma once
#include <cstdint>

#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "cuda_runtime.h"

inline float emu_half_bits(bool f16, uint32_t bits) {
  if (f16) {
    _Float16 h;
    const uint16_t u = (uint16_t)bits;
    memcpy(&h, &u, 2);
    return (float)h;
  }
  const uint32_t u = bits << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline void emu_mma_m16n8k16(bool f16, float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  uint32_t* buf = g_cta->mbuf.data() + w * 32 * 6;
  for (int i = 0; i < 4; ++i) buf[lane * 6 + i] = a[i];
  buf[lane * 6 + 4] = b[0];
  buf[lane * 6 + 5] = b[1];
  __syncwarp();
  auto elem = [&](uint32_t reg, int k) { return emu_half_bits(f16, k % 2 ? reg >> 16 : reg & 0xffffu); };
  auto A = [&](int row, int k) { return elem(buf[((row % 8) * 4 + (k % 8) / 2) * 6 + row / 8 + 2 * (k / 8)], k); };
  auto B = [&](int k, int n) { return elem(buf[(n * 4 + (k % 8) / 2) * 6 + 4 + k / 8], k); };
  float d[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * t + e % 2;
    float s = c[e];
    for (int k = 0; k < 16; ++k) s += A(row, k) * B(k, col);  // products of 16-bit values are exact in fp32
    d[e] = s;
  }
  __syncwarp();  // every lane has read the registers before the next mma overwrites them
  for (int e = 0; e < 4; ++e) c[e] = d[e];
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 (PTX ISA, "ldmatrix"): lane 8 i + j gives the
// address of row j of 8 x 8 matrix i (16-byte aligned); register i of lane 4 g + t holds elements
// (row g, columns 2 t and 2 t + 1) of matrix i, or with .trans (rows 2 t and 2 t + 1, column g), the
// lower index in the lower half.
inline void emu_ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  if (reinterpret_cast<uintptr_t>(row) % 16 != 0) {
    fprintf(stderr, "ldmatrix emulation: row address %p is not 16-byte aligned\n", row);
    abort();
  }
  const void** buf = g_cta->pbuf.data() + w * 32;
  buf[lane] = row;
  __syncwarp();
  for (int i = 0; i < 4; ++i) {
    if (trans) {
      const uint16_t* lo = static_cast<const uint16_t*>(buf[8 * i + 2 * t]);
      const uint16_t* hi = static_cast<const uint16_t*>(buf[8 * i + 2 * t + 1]);
      r[i] = (uint32_t)lo[g] | ((uint32_t)hi[g] << 16);
    } else {
      const uint16_t* at = static_cast<const uint16_t*>(buf[8 * i + g]);
      r[i] = (uint32_t)at[2 * t] | ((uint32_t)at[2 * t + 1] << 16);
    }
  }
  __syncwarp();
}
