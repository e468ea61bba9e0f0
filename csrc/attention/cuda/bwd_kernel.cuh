// The flash backward kernels of the CUDA attention op: dq, and dk with dv. Deterministic: dq in one
// kernel (blocks over query tiles, loop over key tiles), dk and dv in another (blocks over key
// tiles, loop over the query tiles of every head of the GQA group); no atomics.
//
// Unlike the forward, these do not flag non-finite masked entries: a NaN / Inf inside the lengths
// but hidden by the causal mask or the window can reach dq, dk, dv of rows that do not attend it, as
// in SDPA's math backward.
#pragma once

#include "attention/cuda/mask.cuh"
#include "attention/cuda/tiles.cuh"

namespace condinit {
namespace attention_cuda {
namespace {

// Backward. dS = P o (dP - D), P = exp(s q k^T - lse), dP = dO V^T; dq = s dS K, dk = s dS^T Q,
// dv = P^T dO.

template <typename T>
struct BwdParams {
  Geometry g;
  const T *dout, *q, *k, *v;
  const float *lse, *Dvec;
  T *dq, *dk, *dv;
};

// dq: grid x = query tiles * B * H, z = nchunks.
template <typename T>
__global__ void __launch_bounds__(128) attention_dq_kernel(const BwdParams<T> p) {
  CONDINIT_DYNAMIC_SMEM(smem);
  constexpr int BN = dq_bn<T>(), KT = BN / 8, NO = kCols / 8;
  const Geometry& g = p.g;
  const int nwarps = blockDim.x >> 5, rows = 16 * nwarps;
  const FwdLayout L = fwd_layout(KernelKind::kDq, (int)sizeof(T), g.dpad, rows, BN, kSimt<T>);
  T* Qs = reinterpret_cast<T*>(smem + L.q);
  T* dOs = reinterpret_cast<T*>(smem + L.tq);
  T* Ks = reinterpret_cast<T*>(smem + L.k);
  T* Vs = reinterpret_cast<T*>(smem + L.v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq4 = lane & 3;
  float* scratch = reinterpret_cast<float*>(smem + L.scratch) + warp * 16 * L.lds;

  const int64_t nqt = (g.Nq + rows - 1) / rows;
  const int64_t bh = (int64_t)blockIdx.x / nqt, b = bh / g.H, h = bh % g.H, hk = h / (g.H / g.Hkv);
  const int64_t i0 = (nqt - 1 - (int64_t)blockIdx.x % nqt) * rows;
  const int chunk = (int)blockIdx.z;
  const int c0 = chunk * kCols, ncols = min_int(kCols, g.dpad - c0), n_active = ncols / 8;
  const Seq s = seq_of(g, b);
  const int64_t ra = i0 + warp * 16 + gq, rb = ra + 8;

  const int64_t q_off = bh * g.Nq * g.d, kv_off = (b * g.Hkv + hk) * g.Nk * g.d;
  const TileWalk wd = tile_walk<T>(g.d, 0, g.dpad);
  copy_tile(Qs, L.ldq, p.q + q_off, g.d, i0, s.Lq, rows, 0, wd);
  copy_tile(dOs, L.ldq, p.dout + q_off, g.d, i0, s.Lq, rows, 0, wd);
  cp_async_wait_all();
  float lse[2], D[2];
  bool live[2];  // a row with an allowed key (lse > -inf)
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int64_t i = x == 0 ? ra : rb;
    lse[x] = i < s.Lq ? p.lse[bh * g.Nq + i] : kNegInf;
    D[x] = i < s.Lq ? p.Dvec[bh * g.Nq + i] : 0.0f;
    live[x] = lse[x] != kNegInf;
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
    copy_tile(Ks, L.ldk, p.k + kv_off, g.d, j0, hi, BN, 0, wd);
    copy_tile(Vs, L.ldv, p.v + kv_off, g.d, j0, hi, BN, 0, wd);
    cp_async_wait_all();
    __syncthreads();
    float sc[KT][4], dp[KT][4];
#pragma unroll
    for (int nt = 0; nt < KT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[nt][e] = dp[nt][e] = 0.0f;
    mma_abt<T, KT>(sc, Qs + warp * 16 * L.ldq, L.ldq, Ks, L.ldk, g.dpad);
    mma_abt<T, KT>(dp, dOs + warp * 16 * L.ldq, L.ldq, Vs, L.ldv, g.dpad);
    const TileMask tm = tile_mask(g, s, i0 + warp * 16, j0);
    by_tile(tm.full(16, BN), [&](auto full) {
#pragma unroll
      for (int nt = 0; nt < KT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int x = e >> 1;
          const bool ok = (decltype(full)::value || tm.ok(gq + 8 * x, nt * 8 + 2 * tq4 + (e & 1))) && live[x];
          const float pr = exp2f((sc[nt][e] * g.scale - lse[x]) * kLog2e);
          sc[nt][e] = ok ? pr * (dp[nt][e] - D[x]) : 0.0f;  // dS
        }
    });
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

// dk, dv: grid x = key tiles * B * Hkv, z = nchunks. Each warp owns 16 keys; the block loops over
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

  const int64_t nkt = (g.Nk + rows - 1) / rows;
  const int64_t bhk = (int64_t)blockIdx.x / nkt, b = bhk / g.Hkv, hk = bhk % g.Hkv, G = g.H / g.Hkv;
  const int64_t j0 = ((int64_t)blockIdx.x % nkt) * rows;
  const int chunk = (int)blockIdx.z;
  const int c0 = chunk * kCols, ncols = min_int(kCols, g.dpad - c0), n_active = ncols / 8;
  const Seq s = seq_of(g, b);
  const int64_t ka = j0 + warp * 16 + gq, kb = ka + 8;  // this lane's two keys

  const int64_t kv_off = bhk * g.Nk * g.d;
  const TileWalk wd = tile_walk<T>(g.d, 0, g.dpad);
  copy_tile(Ks, L.ldk, p.k + kv_off, g.d, j0, s.Lk, rows, 0, wd);
  copy_tile(Vs, L.ldk, p.v + kv_off, g.d, j0, s.Lk, rows, 0, wd);
  cp_async_wait_all();
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
      copy_tile(Qs, L.ldq, p.q + q_off, g.d, i0, hi, BM, 0, wd);
      copy_tile(dOs, L.ldq, p.dout + q_off, g.d, i0, hi, BM, 0, wd);
      for (int c = threadIdx.x; c < BM; c += blockDim.x) {
        const bool in = i0 + c < hi;
        lse_s[c] = in ? p.lse[bh * g.Nq + i0 + c] : kNegInf;
        D_s[c] = in ? p.Dvec[bh * g.Nq + i0 + c] : 0.0f;
      }
      cp_async_wait_all();
      __syncthreads();
      float st[KT][4], dpt[KT][4];
#pragma unroll
      for (int nt = 0; nt < KT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.0f;
      mma_abt<T, KT>(st, Ks + warp * 16 * L.ldk, L.ldk, Qs, L.ldq, g.dpad);    // S^T = K Q^T
      mma_abt<T, KT>(dpt, Vs + warp * 16 * L.ldk, L.ldk, dOs, L.ldq, g.dpad);  // dP^T = V dO^T
      const TileMask tm = tile_mask(g, s, i0, j0 + warp * 16);  // C rows are keys, columns queries
      by_tile(tm.full(BM, 16), [&](auto full) {
#pragma unroll
        for (int nt = 0; nt < KT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = nt * 8 + 2 * tq4 + (e & 1);
            const float lse = lse_s[c];
            const bool ok = (decltype(full)::value || tm.ok(c, gq + 8 * (e >> 1))) && lse != kNegInf;
            const float pr = ok ? exp2f((st[nt][e] * g.scale - lse) * kLog2e) : 0.0f;
            dpt[nt][e] = ok ? pr * (dpt[nt][e] - D_s[c]) : 0.0f;  // dS^T
            st[nt][e] = pr;                                        // P^T
          }
      });
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

}  // namespace
}  // namespace attention_cuda
}  // namespace condinit
