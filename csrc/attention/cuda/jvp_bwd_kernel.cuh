// The tangent backward kernels of the CUDA attention op (attention_jvp_bwd): r per probe, then the
// query-side and key-side gradients of a loss on (out, tout).
#pragma once

#include "attention/cuda/mask.cuh"
#include "attention/cuda/tiles.cuh"

namespace condinit {
namespace attention_cuda {
namespace {

// Tangent backward (attention_jvp_bwd): gradients of a loss on (out, tout) w.r.t. q, k, v and the
// tangents, from (out, tout, lse); the formulas of docs/design.md, "Attention" ("Backward through
// the tangent output"), summed over the P probes:
//   r_p = rowsum(P o S'_p), d'_p = rowsum(gO'_p o O), D = rowsum(gO o O) + sum_p (rowsum(gO'_p o O'_p) - r_p d'_p)
//   dP'_p = gO'_p V^T, gS'_p = P o (dP'_p - d'_p), P'_p = P o (S'_p - r_p)
//   gP = gO V^T + sum_p [gO'_p V'_p^T + dP'_p o (S'_p - r_p) - S'_p d'_p], gS = P o (gP - D)
//   gQ = s (gS K + sum_p gS'_p K'_p), gK = s (gS^T Q + sum_p gS'_p^T Q'_p), gV = P^T gO + sum_p P'_p^T gO'_p
//   gQ'_p = s gS'_p K, gK'_p = s gS'_p^T Q, gV'_p = P^T gO'_p
// Three kernels, deterministic (each output row written by one block): r (per query tile and probe),
// then the query side (gQ, gQ'_p) and the key side (gK, gV, gK'_p, gV'_p); D and d'_p are computed
// by the caller between them. A block computes one output ("target" 0: the primal gradient, 1 + p:
// probe p's), so its accumulators stay in registers.

template <typename T>
struct JvpBwdParams {
  Geometry g;
  int64_t P;
  const T *gout, *gtout, *q, *k, *v, *tq, *tk, *tv;
  const float *lse, *r, *dprime, *D;  // r, dprime [P, B * H, Nq]; D [B * H, Nq]
  float* r_out;
  T *dq, *dk, *dv, *dtq, *dtk, *dtv;
};

// r_p: grid x = query tiles * B * H, z = P.
template <typename T>
__global__ void __launch_bounds__(128) attention_jvp_r_kernel(const JvpBwdParams<T> p) {
  CONDINIT_DYNAMIC_SMEM(smem);
  constexpr int BN = fwd_bn<T>(), KT = BN / 8;
  const Geometry& g = p.g;
  const int nwarps = blockDim.x >> 5, rows = 16 * nwarps;
  const GenLayout L = gen_layout((int)sizeof(T), g.dpad, rows, 2, BN, 2, 0, kSimt<T>);
  T* Qs = reinterpret_cast<T*>(smem + L.row[0]);
  T* TQs = reinterpret_cast<T*>(smem + L.row[1]);
  T* Ks = reinterpret_cast<T*>(smem + L.loop[0]);
  T* TKs = reinterpret_cast<T*>(smem + L.loop[1]);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq4 = lane & 3;
  const int64_t nqt = (g.Nq + rows - 1) / rows;
  const int64_t bh = (int64_t)blockIdx.x / nqt, b = bh / g.H, h = bh % g.H, hk = h / (g.H / g.Hkv);
  const int64_t i0 = (nqt - 1 - (int64_t)blockIdx.x % nqt) * rows, probe = blockIdx.z, BH = g.B * g.H;
  const Seq s = seq_of(g, b);
  const int64_t ra = i0 + warp * 16 + gq, rb = ra + 8;
  const int64_t q_off = bh * g.Nq * g.d, kv_off = (b * g.Hkv + hk) * g.Nk * g.d;
  const TileWalk wd = tile_walk<T>(g.d, 0, g.dpad);
  copy_tile(Qs, L.ldr, p.q + q_off, g.d, i0, s.Lq, rows, 0, wd);
  copy_tile(TQs, L.ldr, p.tq + probe * BH * g.Nq * g.d + q_off, g.d, i0, s.Lq, rows, 0, wd);
  cp_async_wait_all();
  const T* TKg = p.tk + probe * g.B * g.Hkv * g.Nk * g.d + kv_off;
  float lse[2], rsum[2] = {0.0f, 0.0f};
  bool live[2];  // a row with an allowed key (lse > -inf)
  for (int x = 0; x < 2; ++x) {
    const int64_t i = x == 0 ? ra : rb;
    lse[x] = i < s.Lq ? p.lse[bh * g.Nq + i] : kNegInf;
    live[x] = lse[x] != kNegInf;
  }
  int64_t lo, hi;
  key_range(g, s, i0, i0 + rows, lo, hi);
  for (int64_t j0 = lo; j0 < hi; j0 += BN) {
    __syncthreads();
    copy_tile(Ks, L.ldt, p.k + kv_off, g.d, j0, hi, BN, 0, wd);
    copy_tile(TKs, L.ldt, TKg, g.d, j0, hi, BN, 0, wd);
    cp_async_wait_all();
    __syncthreads();
    float sc[KT][4], sp[KT][4];
    zero<T, KT>(sc);
    zero<T, KT>(sp);
    mma_abt<T, KT>(sc, Qs + warp * 16 * L.ldr, L.ldr, Ks, L.ldt, g.dpad);
    mma_abt<T, KT>(sp, TQs + warp * 16 * L.ldr, L.ldr, Ks, L.ldt, g.dpad);
    mma_abt<T, KT>(sp, Qs + warp * 16 * L.ldr, L.ldr, TKs, L.ldt, g.dpad);
    const TileMask tm = tile_mask(g, s, i0 + warp * 16, j0);
    by_tile(tm.full(16, BN), [&](auto full) {
#pragma unroll
      for (int nt = 0; nt < KT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int x = e >> 1;
          const bool ok = (decltype(full)::value || tm.ok(gq + 8 * x, nt * 8 + 2 * tq4 + (e & 1))) && live[x];
          rsum[x] += ok ? exp2f((sc[nt][e] * g.scale - lse[x]) * kLog2e) * (sp[nt][e] * g.scale) : 0.0f;
        }
    });
  }
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const float total = quad_sum(rsum[x]);
    const int64_t i = x == 0 ? ra : rb;
    if (i < g.Nq && tq4 == 0) p.r_out[(probe * BH + bh) * g.Nq + i] = total;
  }
}

// Query side: grid x = query tiles * B * H, z = (1 + P) * nchunks (z = target * nchunks + chunk).
template <typename T>
__global__ void __launch_bounds__(128) attention_jvp_bwd_q_kernel(const JvpBwdParams<T> p) {
  CONDINIT_DYNAMIC_SMEM(smem);
  constexpr int BN = jb_bn<T>(), KT = BN / 8, NO = kCols / 8;
  const Geometry& g = p.g;
  const int nwarps = blockDim.x >> 5, rows = 16 * nwarps;
  const GenLayout L = gen_layout((int)sizeof(T), g.dpad, rows, 4, BN, 4, 0, kSimt<T>);
  T* Qs = reinterpret_cast<T*>(smem + L.row[0]);
  T* gOs = reinterpret_cast<T*>(smem + L.row[1]);
  T* TQs = reinterpret_cast<T*>(smem + L.row[2]);
  T* gOTs = reinterpret_cast<T*>(smem + L.row[3]);
  T* Ks = reinterpret_cast<T*>(smem + L.loop[0]);
  T* Vs = reinterpret_cast<T*>(smem + L.loop[1]);
  T* TKs = reinterpret_cast<T*>(smem + L.loop[2]);
  T* TVs = reinterpret_cast<T*>(smem + L.loop[3]);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq4 = lane & 3;
  float* scratch = reinterpret_cast<float*>(smem + L.scratch) + warp * 16 * L.lds;

  const int64_t nqt = (g.Nq + rows - 1) / rows;
  const int64_t bh = (int64_t)blockIdx.x / nqt, b = bh / g.H, h = bh % g.H, hk = h / (g.H / g.Hkv);
  const int64_t i0 = (nqt - 1 - (int64_t)blockIdx.x % nqt) * rows;
  const int chunk = (int)(blockIdx.z % g.nchunks);
  const int64_t target = blockIdx.z / g.nchunks, P = p.P, BH = g.B * g.H;
  const int c0 = chunk * kCols, ncols = min_int(kCols, g.dpad - c0), n_active = ncols / 8;
  const Seq s = seq_of(g, b);
  const int64_t ra = i0 + warp * 16 + gq, rb = ra + 8;
  const int64_t q_off = bh * g.Nq * g.d, kv_off = (b * g.Hkv + hk) * g.Nk * g.d;
  const int64_t q_stride = BH * g.Nq * g.d, kv_stride = g.B * g.Hkv * g.Nk * g.d;
  const TileWalk wd = tile_walk<T>(g.d, 0, g.dpad);

  copy_tile(Qs, L.ldr, p.q + q_off, g.d, i0, s.Lq, rows, 0, wd);
  copy_tile(gOs, L.ldr, p.gout + q_off, g.d, i0, s.Lq, rows, 0, wd);
  // The probe's own rows: loaded once when one probe is needed, per probe and key tile otherwise.
  const bool per_probe = target == 0 && P > 1;
  const int64_t first = target == 0 ? 0 : target - 1;
  if (!per_probe) {
    copy_tile(TQs, L.ldr, p.tq + first * q_stride + q_off, g.d, i0, s.Lq, rows, 0, wd);
    copy_tile(gOTs, L.ldr, p.gtout + first * q_stride + q_off, g.d, i0, s.Lq, rows, 0, wd);
  }
  cp_async_wait_all();
  float lse[2], D[2];
  bool live[2];  // a row with an allowed key (lse > -inf)
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int64_t i = x == 0 ? ra : rb;
    lse[x] = i < s.Lq ? p.lse[bh * g.Nq + i] : kNegInf;
    D[x] = i < s.Lq ? p.D[bh * g.Nq + i] : 0.0f;
    live[x] = lse[x] != kNegInf;
  }
  float acc[NO][4];
  zero<T, NO>(acc);

  int64_t lo, hi;
  key_range(g, s, i0, i0 + rows, lo, hi);
  for (int64_t j0 = lo; j0 < hi; j0 += BN) {
    __syncthreads();
    copy_tile(Ks, L.ldt, p.k + kv_off, g.d, j0, hi, BN, 0, wd);
    copy_tile(Vs, L.ldt, p.v + kv_off, g.d, j0, hi, BN, 0, wd);
    if (target == 0 && !per_probe) {
      copy_tile(TKs, L.ldt, p.tk + kv_off, g.d, j0, hi, BN, 0, wd);
      copy_tile(TVs, L.ldt, p.tv + kv_off, g.d, j0, hi, BN, 0, wd);
    }
    cp_async_wait_all();
    __syncthreads();
    float pr[KT][4], gp[KT][4];
    zero<T, KT>(pr);
    zero<T, KT>(gp);
    mma_abt<T, KT>(pr, Qs + warp * 16 * L.ldr, L.ldr, Ks, L.ldt, g.dpad);
    bool ok[KT][4];
    const TileMask tm = tile_mask(g, s, i0 + warp * 16, j0);
    by_tile(tm.full(16, BN), [&](auto full) {
#pragma unroll
      for (int nt = 0; nt < KT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int x = e >> 1;
          ok[nt][e] = (decltype(full)::value || tm.ok(gq + 8 * x, nt * 8 + 2 * tq4 + (e & 1))) && live[x];
          pr[nt][e] = ok[nt][e] ? exp2f((pr[nt][e] * g.scale - lse[x]) * kLog2e) : 0.0f;  // P
        }
    });
    if (target == 0) {
      mma_abt<T, KT>(gp, gOs + warp * 16 * L.ldr, L.ldr, Vs, L.ldt, g.dpad);  // gO V^T
      for (int64_t pi = 0; pi < P; ++pi) {
        if (per_probe) {
          __syncthreads();
          copy_tile(TQs, L.ldr, p.tq + pi * q_stride + q_off, g.d, i0, s.Lq, rows, 0, wd);
          copy_tile(gOTs, L.ldr, p.gtout + pi * q_stride + q_off, g.d, i0, s.Lq, rows, 0, wd);
          copy_tile(TKs, L.ldt, p.tk + pi * kv_stride + kv_off, g.d, j0, hi, BN, 0, wd);
          copy_tile(TVs, L.ldt, p.tv + pi * kv_stride + kv_off, g.d, j0, hi, BN, 0, wd);
          cp_async_wait_all();
          __syncthreads();
        }
        float sp[KT][4], dpp[KT][4], xv[KT][4];
        zero<T, KT>(sp);
        zero<T, KT>(dpp);
        zero<T, KT>(xv);
        mma_abt<T, KT>(sp, TQs + warp * 16 * L.ldr, L.ldr, Ks, L.ldt, g.dpad);
        mma_abt<T, KT>(sp, Qs + warp * 16 * L.ldr, L.ldr, TKs, L.ldt, g.dpad);
        mma_abt<T, KT>(dpp, gOTs + warp * 16 * L.ldr, L.ldr, Vs, L.ldt, g.dpad);   // dP' = gO' V^T
        mma_abt<T, KT>(xv, gOTs + warp * 16 * L.ldr, L.ldr, TVs, L.ldt, g.dpad);   // gO' V'^T
        float rp[2], dl[2];
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const int64_t i = x == 0 ? ra : rb;
          rp[x] = i < s.Lq ? p.r[(pi * BH + bh) * g.Nq + i] : 0.0f;
          dl[x] = i < s.Lq ? p.dprime[(pi * BH + bh) * g.Nq + i] : 0.0f;
        }
#pragma unroll
        for (int nt = 0; nt < KT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int x = e >> 1;
            const float spv = sp[nt][e] * g.scale;
            gp[nt][e] += xv[nt][e] + dpp[nt][e] * (spv - rp[x]) - spv * dl[x];
            dpp[nt][e] = ok[nt][e] ? pr[nt][e] * (dpp[nt][e] - dl[x]) : 0.0f;  // gS'_p
          }
        mma_pb<T, KT, NO>(acc, dpp, TKs + c0, L.ldt, n_active, scratch);  // += gS'_p K'_p
      }
#pragma unroll
      for (int nt = 0; nt < KT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) gp[nt][e] = ok[nt][e] ? pr[nt][e] * (gp[nt][e] - D[e >> 1]) : 0.0f;  // gS
      mma_pb<T, KT, NO>(acc, gp, Ks + c0, L.ldt, n_active, scratch);  // += gS K
    } else {
      mma_abt<T, KT>(gp, gOTs + warp * 16 * L.ldr, L.ldr, Vs, L.ldt, g.dpad);  // dP'_p
      float dl[2];
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const int64_t i = x == 0 ? ra : rb;
        dl[x] = i < s.Lq ? p.dprime[(first * BH + bh) * g.Nq + i] : 0.0f;
      }
#pragma unroll
      for (int nt = 0; nt < KT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) gp[nt][e] = ok[nt][e] ? pr[nt][e] * (gp[nt][e] - dl[e >> 1]) : 0.0f;
      mma_pb<T, KT, NO>(acc, gp, Ks + c0, L.ldt, n_active, scratch);  // gQ'_p += gS'_p K
    }
  }
  T* out = target == 0 ? p.dq : p.dtq + first * q_stride;
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int64_t i = x == 0 ? ra : rb;
    if (i >= g.Nq) continue;
    T* row = out + (bh * g.Nq + i) * g.d + c0;
#pragma unroll
    for (int nt = 0; nt < NO; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = nt * 8 + 2 * tq4 + e;
        if (nt < n_active && c0 + c < g.d) row[c] = Cvt<T>::from_f(g.scale * acc[nt][2 * x + e]);
      }
  }
}

// Key side: grid x = key tiles * B * Hkv, z = (1 + P) * nchunks. Each warp owns 16 keys; the block
// loops over the query tiles of every query head of its GQA group.
template <typename T>
__global__ void __launch_bounds__(128) attention_jvp_bwd_kv_kernel(const JvpBwdParams<T> p) {
  CONDINIT_DYNAMIC_SMEM(smem);
  constexpr int BM = kJbKvBm, KT = BM / 8, NO = kCols / 8;
  const Geometry& g = p.g;
  const int nwarps = blockDim.x >> 5, rows = 16 * nwarps;
  const GenLayout L = gen_layout((int)sizeof(T), g.dpad, rows, 4, BM, 4, 4, kSimt<T>);
  T* Ks = reinterpret_cast<T*>(smem + L.row[0]);
  T* Vs = reinterpret_cast<T*>(smem + L.row[1]);
  T* TKs = reinterpret_cast<T*>(smem + L.row[2]);
  T* TVs = reinterpret_cast<T*>(smem + L.row[3]);
  T* Qs = reinterpret_cast<T*>(smem + L.loop[0]);
  T* gOs = reinterpret_cast<T*>(smem + L.loop[1]);
  T* TQs = reinterpret_cast<T*>(smem + L.loop[2]);
  T* gOTs = reinterpret_cast<T*>(smem + L.loop[3]);
  float* lse_s = reinterpret_cast<float*>(smem + L.stats[0]);
  float* D_s = reinterpret_cast<float*>(smem + L.stats[1]);
  float* r_s = reinterpret_cast<float*>(smem + L.stats[2]);
  float* dl_s = reinterpret_cast<float*>(smem + L.stats[3]);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq4 = lane & 3;
  float* scratch = reinterpret_cast<float*>(smem + L.scratch) + warp * 16 * L.lds;

  const int64_t nkt = (g.Nk + rows - 1) / rows;
  const int64_t bhk = (int64_t)blockIdx.x / nkt, b = bhk / g.Hkv, hk = bhk % g.Hkv, G = g.H / g.Hkv;
  const int64_t j0 = ((int64_t)blockIdx.x % nkt) * rows;
  const int chunk = (int)(blockIdx.z % g.nchunks);
  const int64_t target = blockIdx.z / g.nchunks, P = p.P, BH = g.B * g.H;
  const int c0 = chunk * kCols, ncols = min_int(kCols, g.dpad - c0), n_active = ncols / 8;
  const Seq s = seq_of(g, b);
  const int64_t ka = j0 + warp * 16 + gq, kb = ka + 8;
  const int64_t kv_off = bhk * g.Nk * g.d, q_stride = BH * g.Nq * g.d, kv_stride = g.B * g.Hkv * g.Nk * g.d;
  const bool per_probe = target == 0 && P > 1;
  const int64_t first = target == 0 ? 0 : target - 1;
  const TileWalk wd = tile_walk<T>(g.d, 0, g.dpad);

  copy_tile(Ks, L.ldr, p.k + kv_off, g.d, j0, s.Lk, rows, 0, wd);
  copy_tile(Vs, L.ldr, p.v + kv_off, g.d, j0, s.Lk, rows, 0, wd);
  if (target == 0 && !per_probe) {
    copy_tile(TKs, L.ldr, p.tk + kv_off, g.d, j0, s.Lk, rows, 0, wd);
    copy_tile(TVs, L.ldr, p.tv + kv_off, g.d, j0, s.Lk, rows, 0, wd);
  }
  cp_async_wait_all();
  float acc_k[NO][4], acc_v[NO][4];
  zero<T, NO>(acc_k);
  zero<T, NO>(acc_v);

  int64_t lo, hi;
  query_range(g, s, j0, j0 + rows, lo, hi);
  for (int64_t gh = 0; gh < G; ++gh) {
    const int64_t bh = b * g.H + hk * G + gh, q_off = bh * g.Nq * g.d;
    for (int64_t i0 = lo; i0 < hi; i0 += BM) {
      __syncthreads();
      copy_tile(Qs, L.ldt, p.q + q_off, g.d, i0, hi, BM, 0, wd);
      if (target == 0) copy_tile(gOs, L.ldt, p.gout + q_off, g.d, i0, hi, BM, 0, wd);
      if (!per_probe) {
        if (target == 0) copy_tile(TQs, L.ldt, p.tq + q_off, g.d, i0, hi, BM, 0, wd);
        copy_tile(gOTs, L.ldt, p.gtout + first * q_stride + q_off, g.d, i0, hi, BM, 0, wd);
      }
      for (int c = threadIdx.x; c < BM; c += blockDim.x) {
        const int64_t i = i0 + c;
        const bool in = i < hi;
        lse_s[c] = in ? p.lse[bh * g.Nq + i] : kNegInf;
        D_s[c] = in ? p.D[bh * g.Nq + i] : 0.0f;
        r_s[c] = in ? p.r[(first * BH + bh) * g.Nq + i] : 0.0f;
        dl_s[c] = in ? p.dprime[(first * BH + bh) * g.Nq + i] : 0.0f;
      }
      cp_async_wait_all();
      __syncthreads();
      float pt[KT][4], gpt[KT][4];
      zero<T, KT>(pt);
      zero<T, KT>(gpt);
      mma_abt<T, KT>(pt, Ks + warp * 16 * L.ldr, L.ldr, Qs, L.ldt, g.dpad);  // S^T
      bool ok[KT][4];
      const TileMask tm = tile_mask(g, s, i0, j0 + warp * 16);  // C rows are keys, columns queries
      by_tile(tm.full(BM, 16), [&](auto full) {
#pragma unroll
        for (int nt = 0; nt < KT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = nt * 8 + 2 * tq4 + (e & 1);
            const float lse = lse_s[c];
            ok[nt][e] = (decltype(full)::value || tm.ok(c, gq + 8 * (e >> 1))) && lse != kNegInf;
            pt[nt][e] = ok[nt][e] ? exp2f((pt[nt][e] * g.scale - lse) * kLog2e) : 0.0f;  // P^T
          }
      });
      if (target == 0) {
        mma_abt<T, KT>(gpt, Vs + warp * 16 * L.ldr, L.ldr, gOs, L.ldt, g.dpad);  // (gO V^T)^T
        for (int64_t pi = 0; pi < P; ++pi) {
          if (per_probe) {
            __syncthreads();
            copy_tile(TKs, L.ldr, p.tk + pi * kv_stride + kv_off, g.d, j0, s.Lk, rows, 0, wd);
            copy_tile(TVs, L.ldr, p.tv + pi * kv_stride + kv_off, g.d, j0, s.Lk, rows, 0, wd);
            copy_tile(TQs, L.ldt, p.tq + pi * q_stride + q_off, g.d, i0, hi, BM, 0, wd);
            copy_tile(gOTs, L.ldt, p.gtout + pi * q_stride + q_off, g.d, i0, hi, BM, 0, wd);
            for (int c = threadIdx.x; c < BM; c += blockDim.x) {
              const int64_t i = i0 + c;
              r_s[c] = i < hi ? p.r[(pi * BH + bh) * g.Nq + i] : 0.0f;
              dl_s[c] = i < hi ? p.dprime[(pi * BH + bh) * g.Nq + i] : 0.0f;
            }
            cp_async_wait_all();
            __syncthreads();
          }
          float spt[KT][4], dppt[KT][4], xt[KT][4];
          zero<T, KT>(spt);
          zero<T, KT>(dppt);
          zero<T, KT>(xt);
          mma_abt<T, KT>(spt, Ks + warp * 16 * L.ldr, L.ldr, TQs, L.ldt, g.dpad);   // (Q' K^T)^T
          mma_abt<T, KT>(spt, TKs + warp * 16 * L.ldr, L.ldr, Qs, L.ldt, g.dpad);   // (Q K'^T)^T
          mma_abt<T, KT>(dppt, Vs + warp * 16 * L.ldr, L.ldr, gOTs, L.ldt, g.dpad); // dP'^T
          mma_abt<T, KT>(xt, TVs + warp * 16 * L.ldr, L.ldr, gOTs, L.ldt, g.dpad);  // (gO' V'^T)^T
#pragma unroll
          for (int nt = 0; nt < KT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int c = nt * 8 + 2 * tq4 + (e & 1);
              const float spv = spt[nt][e] * g.scale, rr = r_s[c], dl = dl_s[c];
              gpt[nt][e] += xt[nt][e] + dppt[nt][e] * (spv - rr) - spv * dl;
              dppt[nt][e] = ok[nt][e] ? pt[nt][e] * (dppt[nt][e] - dl) : 0.0f;  // gS'^T
              spt[nt][e] = ok[nt][e] ? pt[nt][e] * (spv - rr) : 0.0f;           // P'^T
            }
          mma_pb<T, KT, NO>(acc_k, dppt, TQs + c0, L.ldt, n_active, scratch);  // += gS'^T Q'
          mma_pb<T, KT, NO>(acc_v, spt, gOTs + c0, L.ldt, n_active, scratch);  // += P'^T gO'
        }
#pragma unroll
        for (int nt = 0; nt < KT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = nt * 8 + 2 * tq4 + (e & 1);
            gpt[nt][e] = ok[nt][e] ? pt[nt][e] * (gpt[nt][e] - D_s[c]) : 0.0f;  // gS^T
          }
        mma_pb<T, KT, NO>(acc_k, gpt, Qs + c0, L.ldt, n_active, scratch);  // += gS^T Q
        mma_pb<T, KT, NO>(acc_v, pt, gOs + c0, L.ldt, n_active, scratch);  // += P^T gO
      } else {
        mma_abt<T, KT>(gpt, Vs + warp * 16 * L.ldr, L.ldr, gOTs, L.ldt, g.dpad);  // dP'^T_p
#pragma unroll
        for (int nt = 0; nt < KT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = nt * 8 + 2 * tq4 + (e & 1);
            gpt[nt][e] = ok[nt][e] ? pt[nt][e] * (gpt[nt][e] - dl_s[c]) : 0.0f;  // gS'^T_p
          }
        mma_pb<T, KT, NO>(acc_k, gpt, Qs + c0, L.ldt, n_active, scratch);   // gK'_p += gS'^T_p Q
        mma_pb<T, KT, NO>(acc_v, pt, gOTs + c0, L.ldt, n_active, scratch);  // gV'_p += P^T gO'_p
      }
    }
  }
  T* out_k = target == 0 ? p.dk : p.dtk + first * kv_stride;
  T* out_v = target == 0 ? p.dv : p.dtv + first * kv_stride;
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int64_t j = x == 0 ? ka : kb;
    if (j >= g.Nk) continue;
    T* krow = out_k + (bhk * g.Nk + j) * g.d + c0;
    T* vrow = out_v + (bhk * g.Nk + j) * g.d + c0;
#pragma unroll
    for (int nt = 0; nt < NO; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = nt * 8 + 2 * tq4 + e;
        if (nt < n_active && c0 + c < g.d) {
          krow[c] = Cvt<T>::from_f(g.scale * acc_k[nt][2 * x + e]);
          vrow[c] = Cvt<T>::from_f(acc_v[nt][2 * x + e]);
        }
      }
  }
}

}  // namespace
}  // namespace attention_cuda
}  // namespace condinit
