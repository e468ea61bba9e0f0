// The masks of the CUDA attention kernels (docs/design.md, "Attention", "Masks"): the launch
// geometry, a batch entry's sequence lengths, the mask of a tile and the tile ranges a block visits.
//
// A block visits only the key (query) tiles that some row of it may attend, and rows past the
// sequence lengths are zero-filled. A warp's tile entirely inside the mask (no causal diagonal,
// window edge or sequence end crossing it) takes no element mask; on a boundary tile the element
// test is four 32-bit compares of offsets from the tile's corner. Element masks are selects (never
// arithmetic), so masked entries holding NaN/Inf do not reach scores. A NaN in an allowed entry
// propagates through exp into the row's outputs.
#pragma once

#include "attention/cuda/primitives.cuh"

namespace condinit {
namespace attention_cuda {
namespace {

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

// The mask of one tile in 32-bit offsets from its corner (query q0, key k0): (q0 + qi, k0 + kj) is
// allowed iff qi < qn, kj < kn and lo <= kj - qi <= up (the causal diagonal and the window are bands
// of kj - qi). Offsets are clamped to +-kMaskClamp, beyond any tile, so the test is exact in 32 bits.
constexpr int64_t kMaskClamp = 1 << 20;
struct TileMask {
  int qn, kn, lo, up;
  __device__ __forceinline__ bool ok(int qi, int kj) const {
    const int diag = kj - qi;
    return qi < qn && kj < kn && diag >= lo && diag <= up;
  }
  // Every (qi, kj) of [0, nq) x [0, nk) allowed: the tile needs no element mask.
  __device__ __forceinline__ bool full(int nq, int nk) const {
    return qn >= nq && kn >= nk && lo <= 1 - nq && up >= nk - 1;
  }
};

__device__ __forceinline__ int clamp_offset(int64_t x) {
  return (int)(x < -kMaskClamp ? -kMaskClamp : x > kMaskClamp ? kMaskClamp : x);
}

__device__ __forceinline__ TileMask tile_mask(const Geometry& g, const Seq& s, int64_t q0, int64_t k0) {
  const int64_t diag = q0 + s.off - k0;  // j <= i + off  <=>  kj - qi <= diag
  int64_t lo = -kMaskClamp, up = kMaskClamp;
  if (g.causal) up = diag;
  if (g.window_right >= 0 && diag + g.window_right < up) up = diag + g.window_right;
  if (g.window_left >= 0) lo = diag - g.window_left;
  return TileMask{clamp_offset(s.Lq - q0), clamp_offset(s.Lk - k0), clamp_offset(lo), clamp_offset(up)};
}

// Runs f(std::true_type{}) on a tile entirely inside the mask and f(std::false_type{}) on a boundary
// tile, so that the element test is compiled out of the full-tile path.
template <class F>
__device__ __forceinline__ void by_tile(bool full, F&& f) {
  if (full)
    f(std::true_type{});
  else
    f(std::false_type{});
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

}  // namespace
}  // namespace attention_cuda
}  // namespace condinit
