// The forward kernel of the CUDA attention op, and the forward plus one probe's tangent (the JVP).
//
// The block's query tile (and the probe's tangent Q) is loaded into shared memory once; K, V and
// the tangents are streamed through one buffer each by cp.async (V of a tile lands while S is
// computed, K of the next tile while P V is), with the online softmax (m, l, and the probe's r) in
// registers. The products P V and P V' would turn a non-finite value at a masked key into NaN
// (0 x NaN) for rows of the same tile that do not attend it: on a tile that some row of the block
// may not attend entirely, the kernel stores such V / V' values as 0, flags their keys, and makes
// exactly the rows that attend a flagged key NaN; a tile every row attends keeps them (they reach
// the rows' outputs through P V, in their own columns).
// JVP: one block per (query tile, head, output chunk, probe): the probe's accumulators stay in
// registers; the primal (S, exp, m, l) is recomputed per probe and written by the probe-0 blocks.
#pragma once

#include "attention/cuda/mask.cuh"
#include "attention/cuda/tiles.cuh"

namespace condinit {
namespace attention_cuda {
namespace {

// Forward (JVP = false) and forward + one probe's tangent (JVP = true).
// Grid: x = query tiles * B * H (x = bh * tiles + tile), z = nchunks * probes (z = probe * nchunks + chunk).

template <typename T>
struct FwdParams {
  Geometry g;
  const T *q, *k, *v, *tq, *tk, *tv;
  T *out, *tout;
  float* lse;
};

template <typename T, bool JVP>
__global__ void __launch_bounds__(128, JVP ? 2 : 3) attention_fwd_kernel(const FwdParams<T> p) {
  CONDINIT_DYNAMIC_SMEM(smem);
  constexpr int BN = JVP ? jvp_bn<T>() : fwd_bn<T>(), KT = BN / 8, NO = kCols / 8;
  const Geometry& g = p.g;
  const int nwarps = blockDim.x >> 5, rows = 16 * nwarps;
  const FwdLayout L = fwd_layout(JVP ? KernelKind::kJvp : KernelKind::kFwd, (int)sizeof(T), g.dpad, rows, BN, kSimt<T>);
  T* Qs = reinterpret_cast<T*>(smem + L.q);
  T* TQs = reinterpret_cast<T*>(smem + L.tq);
  T* Ks = reinterpret_cast<T*>(smem + L.k);
  T* TKs = reinterpret_cast<T*>(smem + L.tk);
  T* Vs = reinterpret_cast<T*>(smem + L.v);
  T* TVs = reinterpret_cast<T*>(smem + L.tv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq4 = lane & 3;
  float* scratch = reinterpret_cast<float*>(smem + L.scratch) + warp * 16 * L.lds;

  const int64_t nqt = (g.Nq + rows - 1) / rows;
  const int64_t bh = (int64_t)blockIdx.x / nqt, b = bh / g.H, h = bh % g.H, hk = h / (g.H / g.Hkv);
  const int64_t i0 = (nqt - 1 - (int64_t)blockIdx.x % nqt) * rows;  // the longest causal rows start first
  const int chunk = (int)(blockIdx.z % g.nchunks);
  const int64_t probe = blockIdx.z / g.nchunks;
  const int c0 = chunk * kCols, ncols = min_int(kCols, g.dpad - c0), n_active = ncols / 8;
  const Seq s = seq_of(g, b);
  const int64_t ra = i0 + warp * 16 + gq, rb = ra + 8;  // this lane's two rows

  const int64_t q_off = bh * g.Nq * g.d, kv_off = (b * g.Hkv + hk) * g.Nk * g.d;
  const TileWalk wq = tile_walk<T>(g.d, 0, g.dpad), wv = tile_walk<T>(g.d, c0, ncols);
  const T* Kg = p.k + kv_off;
  const T* Vg = p.v + kv_off;
  const T* TKg = JVP ? p.tk + probe * g.B * g.Hkv * g.Nk * g.d + kv_off : nullptr;
  const T* TVg = JVP ? p.tv + probe * g.B * g.Hkv * g.Nk * g.d + kv_off : nullptr;
  // K (K') and V (V') tiles alternate through their buffers by cp.async: V of tile j is copied while
  // the warps compute S of tile j from K, and K of tile j + 1 while they compute P V of tile j.
  auto copy_k = [&](int64_t j0, int64_t hi) {
    copy_tile(Ks, L.ldk, Kg, g.d, j0, hi, BN, 0, wq);
    if constexpr (JVP) copy_tile(TKs, L.ldk, TKg, g.d, j0, hi, BN, 0, wq);
    cp_async_commit();
  };
  copy_tile(Qs, L.ldq, p.q + q_off, g.d, i0, s.Lq, rows, 0, wq);
  if constexpr (JVP) {
    const int64_t BH = g.B * g.H;
    copy_tile(TQs, L.ldq, p.tq + probe * BH * g.Nq * g.d + q_off, g.d, i0, s.Lq, rows, 0, wq);
  }
  int64_t lo, hi;
  key_range(g, s, i0, i0 + rows, lo, hi);
  if (lo < hi) copy_k(lo, hi);  // with Q, one group

  float o[NO][4], ot[JVP ? NO : 1][4];
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f}, r[2] = {0.0f, 0.0f};
#pragma unroll
  for (int nt = 0; nt < NO; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      o[nt][e] = 0.0f;
      if constexpr (JVP) ot[nt][e] = 0.0f;
    }

  // Keys whose V (V') row holds a NaN / Inf: stored as 0, and the rows that attend them come out NaN
  // (out and tout, or tout only). Two buffers, so that one is zeroed while the other is in use.
  unsigned char* bad_rows = smem + L.flags;                        // [buffer][V, V'][BN]
  int* bad_any = reinterpret_cast<int*>(smem + L.flags + 4 * BN);  // [buffer][V, V']
  for (int i = threadIdx.x; i < 4 * BN; i += blockDim.x) bad_rows[i] = 0;
  if (threadIdx.x < 4) bad_any[threadIdx.x] = 0;
  bool poison_o[2] = {false, false}, poison_t[2] = {false, false};

  for (int64_t j0 = lo, it = 0; j0 < hi; j0 += BN, ++it) {
    const int buf = (int)(it & 1);
    cp_async_wait<0>();
    __syncthreads();  // K (and Q) have landed; every warp is done with V and the flags of buffer 1 - buf
    for (int i = threadIdx.x; i < 2 * BN; i += blockDim.x) bad_rows[(1 - buf) * 2 * BN + i] = 0;
    if (threadIdx.x < 2) bad_any[(1 - buf) * 2 + threadIdx.x] = 0;
    unsigned char* vbad = bad_rows + buf * 2 * BN;
    copy_tile(Vs, L.ldv, Vg, g.d, j0, hi, BN, c0, wv);
    if constexpr (JVP) copy_tile(TVs, L.ldv, TVg, g.d, j0, hi, BN, c0, wv);
    cp_async_commit();

    float sc[KT][4], sp[JVP ? KT : 1][4];
#pragma unroll
    for (int nt = 0; nt < KT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc[nt][e] = 0.0f;
        if constexpr (JVP) sp[nt][e] = 0.0f;
      }
    mma_abt<T, KT>(sc, Qs + warp * 16 * L.ldq, L.ldq, Ks, L.ldk, g.dpad);
    if constexpr (JVP) {  // S' = Q' K^T + Q K'^T
      mma_abt<T, KT>(sp, TQs + warp * 16 * L.ldq, L.ldq, Ks, L.ldk, g.dpad);
      mma_abt<T, KT>(sp, Qs + warp * 16 * L.ldq, L.ldq, TKs, L.ldk, g.dpad);
    }

    // Mask and scale (selects: a masked NaN never enters; none on a tile inside the mask), then the
    // online-softmax update.
    float mx[2] = {kNegInf, kNegInf};
    static_assert(KT * 4 <= 32, "one bit per C element of the tile");
    uint32_t ok_bits = ~0u;  // bit 4 nt + e: element e of n-tile nt allowed (for the flag test below)
    const TileMask tm = tile_mask(g, s, i0 + warp * 16, j0);
    by_tile(tm.full(16, BN), [&](auto full) {
#pragma unroll
      for (int nt = 0; nt < KT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool ok = decltype(full)::value || tm.ok(gq + 8 * (e >> 1), nt * 8 + 2 * tq4 + (e & 1));
          if constexpr (!decltype(full)::value) ok_bits &= ~((ok ? 0u : 1u) << (4 * nt + e));
          sc[nt][e] = ok ? sc[nt][e] * g.scale : kNegInf;
          if constexpr (JVP) sp[nt][e] = ok ? sp[nt][e] * g.scale : 0.0f;
          mx[e >> 1] = fmaxf(mx[e >> 1], sc[nt][e]);
        }
    });
    float alpha[2], mu[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const float m_new = fmaxf(m[x], quad_max(mx[x]));
      alpha[x] = m_new == kNegInf ? 1.0f : exp2f((m[x] - m_new) * kLog2e);
      mu[x] = m_new == kNegInf ? 0.0f : m_new;  // nothing allowed yet: P~ = exp(-inf) = 0
      m[x] = m_new;
    }
#pragma unroll
    for (int nt = 0; nt < KT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc[nt][e] = exp2f((sc[nt][e] - mu[e >> 1]) * kLog2e);  // P~, in place
        sum[e >> 1] += sc[nt][e];
      }
#pragma unroll
    for (int x = 0; x < 2; ++x) l[x] = alpha[x] * l[x] + quad_sum(sum[x]);
#pragma unroll
    for (int nt = 0; nt < NO; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[nt][e] *= alpha[e >> 1];

    // V (V') of this tile. Where some row of the block may not attend some key of it, non-finite
    // values are cleared and flagged; a tile every row attends keeps them (they reach exactly the rows
    // that attend them through P V).
    cp_async_wait<0>();
    if (!tile_mask(g, s, i0, j0).full(rows, BN)) {
      clear_nonfinite_tile(Vs, L.ldv, BN, wv, vbad, bad_any + buf * 2);
      if constexpr (JVP) clear_nonfinite_tile(TVs, L.ldv, BN, wv, vbad + BN, bad_any + buf * 2 + 1);
    }
    __syncthreads();  // V and its flags visible; every warp is done with K
    if (j0 + BN < hi) copy_k(j0 + BN, hi);
    if ((bad_any[buf * 2] | bad_any[buf * 2 + 1]) != 0) {
#pragma unroll
      for (int nt = 0; nt < KT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = nt * 8 + 2 * tq4 + (e & 1);
          if ((ok_bits >> (4 * nt + e)) & 1u) {
            poison_o[e >> 1] |= vbad[c] != 0;
            poison_t[e >> 1] |= (vbad[c] | vbad[BN + c]) != 0;
          }
        }
    }
    mma_pb<T, KT, NO>(o, sc, Vs, L.ldv, n_active, scratch);

    if constexpr (JVP) {
      // W = P~ o S' (rounded as the product operand, so that r sums what multiplies V),
      // r = alpha r + rowsum W, O' acc = alpha O' acc + P~ V' + W V.
      float rs[2] = {0.0f, 0.0f};
#pragma unroll
      for (int nt = 0; nt < KT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float w = kSimt<T> ? sc[nt][e] * sp[nt][e] : round_to<T>(sc[nt][e] * sp[nt][e]);
          sp[nt][e] = w;
          rs[e >> 1] += w;
        }
#pragma unroll
      for (int x = 0; x < 2; ++x) r[x] = alpha[x] * r[x] + quad_sum(rs[x]);
#pragma unroll
      for (int nt = 0; nt < NO; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ot[nt][e] *= alpha[e >> 1];
      mma_pb<T, KT, NO>(ot, sc, TVs, L.ldv, n_active, scratch);
      mma_pb<T, KT, NO>(ot, sp, Vs, L.ldv, n_active, scratch);
    }
  }
  cp_async_wait_all();  // nothing in flight at exit (Q of a block without a key tile)

  // O = acc / l, lse = m + log l, O' = acc' / l - (r / l) O. l == 0 only when no key is allowed
  // (the row maximum contributes exp(0) = 1): out 0, lse -inf, O' 0. A NaN l gives NaN outputs.
  float inv[2], rl[2], nan_o[2], nan_t[2];
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    inv[x] = l[x] == 0.0f ? 0.0f : 1.0f / l[x];
    rl[x] = r[x] * inv[x];
    // A row attending a non-finite V (V') entry: NaN, added to its outputs (the quad agrees).
    nan_o[x] = quad_max(poison_o[x] ? 1.0f : 0.0f) != 0.0f ? __int_as_float(0x7fc00000) : 0.0f;
    nan_t[x] = quad_max(poison_t[x] ? 1.0f : 0.0f) != 0.0f ? __int_as_float(0x7fc00000) : 0.0f;
  }
  const int64_t BH = g.B * g.H;
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int64_t i = x == 0 ? ra : rb;
    if (i >= g.Nq) continue;
    if (probe == 0) {
      T* orow = p.out + (bh * g.Nq + i) * g.d + c0;
#pragma unroll
      for (int nt = 0; nt < NO; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = nt * 8 + 2 * tq4 + e;
          if (nt < n_active && c0 + c < g.d) orow[c] = Cvt<T>::from_f(o[nt][2 * x + e] * inv[x] + nan_o[x]);
        }
      if (chunk == 0 && tq4 == 0) p.lse[bh * g.Nq + i] = l[x] == 0.0f ? kNegInf : m[x] + logf(l[x]);
    }
    if constexpr (JVP) {
      T* trow = p.tout + ((probe * BH + bh) * g.Nq + i) * g.d + c0;
#pragma unroll
      for (int nt = 0; nt < NO; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = nt * 8 + 2 * tq4 + e;
          if (nt < n_active && c0 + c < g.d)
            trow[c] = Cvt<T>::from_f(ot[nt][2 * x + e] * inv[x] - rl[x] * (o[nt][2 * x + e] * inv[x]) + nan_t[x]);
        }
    }
  }
}

}  // namespace
}  // namespace attention_cuda
}  // namespace condinit
