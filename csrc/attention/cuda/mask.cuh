// The masks of the CUDA attention kernels (docs/design.md, "Attention", "Masks"): the launch
// geometry, a batch entry's sequence lengths, the allowed test and the tile ranges a block visits.
//
// A block visits only the key (query) tiles that some row of it may attend, and rows past the
// sequence lengths are zero-filled; element masks are selects (never arithmetic), so masked entries
// holding NaN/Inf do not reach scores. A NaN in an allowed entry propagates through exp into the
// row's outputs.
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

}  // namespace
}  // namespace attention_cuda
}  // namespace condinit
