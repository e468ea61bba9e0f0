// The C++ CPU kernels of condinit_C::attention_{fwd,bwd,jvp,jvp_bwd} (schema: attention.cpp; math:
// docs/design.md, "Attention").
//
// Per head, S = s Q K^T (+ causal mask), P = softmax(S), O = P V, lse = log rowsum exp(S).
//   fwd: online softmax over key tiles (flash attention), O(N) memory.
//   jvp: one fused pass; with P~ = exp(S - m) it carries acc = P~ V, l = rowsum P~ and per probe
//        accT_p = P~ V'_p + (P~ o S'_p) V, r_p = rowsum(P~ o S'_p), S'_p = s (Q'_p K^T + Q K'_p^T),
//        all rescaled by alpha = exp(m_old - m_new); then O = acc / l, O'_p = accT_p / l - (r_p / l) O.
//        The probes share the primal tiles (S, exp, m, l are computed once per tile).
//   bwd: flash backward from the saved lse: D = rowsum(dO o O), P = exp(S - lse), dP = dO V^T,
//        dS = P o (dP - D), dQ = s dS K, dK = s dS^T Q, dV = P^T dO.
//   jvp_bwd: gradients of a loss on (O, O'_p) w.r.t. (Q, K, V, Q'_p, K'_p, V'_p) from the saved
//        O, O'_p, lse: r_p = rowsum(P o S'_p) (recomputed: not an output of jvp), d'_p = rowsum(gO'_p o O),
//        D = rowsum(gO o O) + sum_p (rowsum(gO'_p o O'_p) - r_p d'_p), gS'_p = P o (gO'_p V^T - d'_p),
//        gP = gO V^T + sum_p (gO'_p V'_p^T + dP'_p o (S'_p - r_p) - S'_p d'_p), gS = P o (gP - D).
// Layouts: q [B, H, Nq, d]; k, v [B, Hkv, Nk, d] with Hkv | H (q head h reads kv head h / (H / Hkv));
// tangents carry a leading probe dimension [P, ...]. Masks: docs/design.md, "Attention", "Masks".
//
// CPU strategy: parallel over (batch, head, query tile) with a shared work counter (causal tiles
// differ in cost, so threads pull the most expensive tiles first); every tile matrix product is
// one call, the primal and probe operands stacked where they share a factor (see gemm for which
// library runs it); the exponentials use a polynomial exp that GCC vectorizes (target_clones picks
// AVX-512/AVX2 at run time, no -march needed). fp16/bf16 inputs are computed in fp32, fp64 in fp64.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "attention/attention_checks.h"
#include "attention/cpu/tile_ops.h"

namespace condinit {
namespace attention_cpu {
namespace {

// Forward (P == 0) or forward + JVP for P probes. out/tout/lse written for every row.
// lse is written in the compute type (fp64 for fp64 inputs, so that the fp64 backward is exact)
// and returned in it.
// The primal and the probes are stacked row-wise so that shared operands go through one product:
// [S; Q'_p K^T] = s [Q; Q'_p] K^T, then S'_p += s Q K'_p^T, and [acc; accT_p] += [P~; P~ o S'_p] V,
// then accT_p += P~ V'_p: 2 + 2P products per tile instead of 2 + 4P. The keys come transposed
// in blocks of kFwdN (kt, tkt: see blocked_transpose) and the stacked queries scaled by s, so that
// every product is a plain C (+)= A B (see gemm); key tiles start at multiples of kFwdN.
template <typename T>
void fwd_jvp_kernel(const Dims& D, T scale, const T* q, const T* kt, const T* v, const T* tq,
                    const T* tkt, const T* tv, T* out, T* tout, T* lse) {
  const int64_t B = D.B, H = D.H, Hkv = D.Hkv, Nq = D.Nq, Nk = D.Nk, d = D.d, P = D.P;
  const int64_t G = H / Hkv, R = 1 + P;  // R stacked row groups: the primal, then each probe
  // Query rows per tile: kFwdM for the forward and one probe; with more probes fewer, so that the
  // R stacked score tiles (all live at once) stay about the size of two (cache-resident).
  constexpr int64_t BN = kFwdN;
  const int64_t BM = std::clamp<int64_t>(2 * kFwdM / R / 16 * 16, 16, kFwdM);
  const int64_t nqt = (Nq + BM - 1) / BM;
  const int64_t BH = B * H, kblocks = (Nk + BN - 1) / BN;
  const T ninf = -std::numeric_limits<T>::infinity();
  run_tasks(BH * nqt, [&](int64_t t, int64_t) {
    // Per-task buffers: O(tile) memory.
    thread_local std::vector<T> buf;
    const int64_t need = R * BM * BN + 2 * R * BM * d + BM * (3 + P);
    if ((int64_t)buf.size() < need) buf.resize(need);

    const int64_t qt = nqt - 1 - t / BH;  // last (most expensive under causal) tiles first
    const int64_t bh = t % BH, b = bh / H, h = bh % H, hk = h / G;
    const int64_t i0 = qt * BM, m = std::min(BM, Nq - i0);
    const T* Q = q + (bh * Nq + i0) * d;
    const T* KT = kt + (b * Hkv + hk) * kblocks * d * BN;  // [kblocks, d, BN]
    const T* V = v + (b * Hkv + hk) * Nk * d;
    const SeqMask sm = seq_mask(D.mask, b, Nq, Nk);
    const int64_t mv = std::clamp<int64_t>(sm.Lq - i0, 0, m);  // valid query rows of the tile
    // Keys [jbegin, jend) can be attended by the tile's valid rows (jbegin rounded down to a block).
    const int64_t jbegin = mv > 0 ? sm.lo(i0) / BN * BN : 0, jend = mv > 0 ? sm.hi(i0 + mv - 1) : 0;
    TileMask tm;

    T* SS = buf.data();                   // [R mv, BN]: S then P~; group 1 + p: S'_p then P~ o S'_p
    T* QS = SS + R * BM * BN;             // [R mv, d]: Q, then Q'_p
    T* AC = QS + R * BM * d;              // [R mv, d]: acc = P~ V, then accT_p
    T* mrow = AC + R * BM * d;            // [BM]
    T* lrow = mrow + BM;                  // [BM]
    T* alpha = lrow + BM;                 // [BM]
    T* rrow = alpha + BM;                 // [P, BM]
    auto group = [&](T* base, int64_t g, int64_t ld) { return base + g * mv * ld; };
    for (int64_t c = 0; c < mv * d; ++c) QS[c] = scale * Q[c];  // s Q, s Q'_p
    for (int64_t p = 0; p < P; ++p) {
      const T* TQ = tq + ((p * B + b) * H + h) * Nq * d + i0 * d;
      T* dst = group(QS, 1 + p, d);
      for (int64_t c = 0; c < mv * d; ++c) dst[c] = scale * TQ[c];
    }
    std::fill(AC, AC + R * mv * d, T(0));
    std::fill(mrow, mrow + m, ninf);
    std::fill(lrow, lrow + m, T(0));
    std::fill(rrow, rrow + P * BM, T(0));

    for (int64_t j0 = jbegin; j0 < jend; j0 += BN) {
      const int64_t n = std::min(BN, jend - j0);
      tm.build(sm, i0, mv, mv, j0, n);
      const int64_t blk = (j0 / BN) * d * BN;
      gemm(false, false, R * mv, n, d, T(1), QS, d, KT + blk, BN, T(0), SS, BN);       // S; s Q'_p K^T
      for (int64_t p = 0; p < P; ++p) {
        const T* TKT = tkt + ((p * B + b) * Hkv + hk) * kblocks * d * BN + blk;
        gemm(false, false, mv, n, d, T(1), QS, d, TKT, BN, T(1), group(SS, 1 + p, BN), BN);  // S'_p
        tm.fill_outside(group(SS, 1 + p, BN), BN, T(0));  // masked K / K' may hold NaN
      }
      tm.fill_outside(SS, BN, ninf);
      for (int64_t i = 0; i < mv; ++i) {
        T* row = SS + i * BN;
        const T mnew = std::max(mrow[i], row_max(row, n));
        const T a = mnew == ninf ? T(1) : std::exp(mrow[i] - mnew);
        const T mu = mnew == ninf ? T(0) : mnew;  // a row with nothing visible yet: P~ = 0
        lrow[i] = a * lrow[i] + exp_shift_sum(row, n, mu);
        mrow[i] = mnew;
        alpha[i] = a;
      }
      for (int64_t p = 0; p < P; ++p) {
        T* r = rrow + p * BM;
        T* SPp = group(SS, 1 + p, BN);
        for (int64_t i = 0; i < mv; ++i) r[i] = alpha[i] * r[i] + mul_rowsum(SS + i * BN, SPp + i * BN, n);
      }
      for (int64_t g = 0; g < R; ++g)
        for (int64_t i = 0; i < mv; ++i)
          if (alpha[i] != T(1)) scale_row(group(AC, g, d) + i * d, d, alpha[i]);
      mm_keys(tm, d, T(1), SS, BN, V + j0 * d, d, AC, d, R);                          // [acc; accT_p] += [P~; P~ o S'_p] V
      for (int64_t p = 0; p < P; ++p) {
        const T* TV = tv + ((p * B + b) * Hkv + hk) * Nk * d + j0 * d;
        mm_keys(tm, d, T(1), SS, BN, TV, d, group(AC, 1 + p, d), d);                 // accT_p += P~ V'_p
      }
    }

    // Finalize: O = acc / l, lse = m + log l, O'_p = accT_p / l - (r_p / l) O.
    for (int64_t i = 0; i < m; ++i) {
      const int64_t row = bh * Nq + i0 + i;
      T* o = out + row * d;
      const T l = lrow[i];
      if (l == T(0)) {  // nothing visible (a NaN l is not: NaN inputs must come out as NaN)
        std::fill(o, o + d, T(0));
        lse[row] = ninf;
        for (int64_t p = 0; p < P; ++p) {
          T* to = tout + (p * BH * Nq + row) * d;
          std::fill(to, to + d, T(0));
        }
        continue;
      }
      const T inv = T(1) / l;
      const T* acc = AC + i * d;
      for (int64_t c = 0; c < d; ++c) o[c] = acc[c] * inv;
      lse[row] = mrow[i] + std::log(l);
      for (int64_t p = 0; p < P; ++p) {
        T* to = tout + (p * BH * Nq + row) * d;
        const T* at = group(AC, 1 + p, d) + i * d;
        const T rl = rrow[p * BM + i] * inv;
        for (int64_t c = 0; c < d; ++c) to[c] = at[c] * inv - rl * o[c];
      }
    }
  });
}

// Backward. Parallel over (batch, kv head, key tile): each task owns its dK/dV rows (summed over
// the query heads of the GQA group) and adds its dQ contributions into a per-worker buffer
// dq_parts[worker] (summed by the caller), so no two workers write the same memory.
template <typename T>
void bwd_kernel(const Dims& D, T scale, const T* dout, const T* q, const T* k, const T* v,
                const T* lse, const T* Dvec, T* dq_parts, T* dk, T* dv) {
  const int64_t B = D.B, H = D.H, Hkv = D.Hkv, Nq = D.Nq, Nk = D.Nk, d = D.d;
  const int64_t G = H / Hkv;
  const int64_t nkt = (Nk + kBlockN - 1) / kBlockN;
  const int64_t BHk = B * Hkv;
  run_tasks(BHk * nkt, [&](int64_t t, int64_t worker) {
    thread_local std::vector<T> buf;
    const int64_t need = 2 * kBlockM * kBlockN + 2 * kBlockN * d;
    if ((int64_t)buf.size() < need) buf.resize(need);
    T* S = buf.data();                // [BM, BN] scores, then P
    T* dP = S + kBlockM * kBlockN;    // [BM, BN] dP, then dS
    T* dK = dP + kBlockM * kBlockN;   // [BN, d]
    T* dV = dK + kBlockN * d;         // [BN, d]

    const int64_t kt = t / BHk;  // first key tiles are seen by the most queries under causal
    const int64_t bhk = t % BHk, b = bhk / Hkv, hk = bhk % Hkv;
    const int64_t j0 = kt * kBlockN, n = std::min(kBlockN, Nk - j0);
    const T* K = k + (bhk * Nk + j0) * d;
    const T* V = v + (bhk * Nk + j0) * d;
    std::fill(dK, dK + n * d, T(0));
    std::fill(dV, dV + n * d, T(0));
    T* dqw = dq_parts + worker * (B * H * Nq * d);
    const SeqMask sm = seq_mask(D.mask, b, Nq, Nk);
    const int64_t nv = std::clamp<int64_t>(sm.Lk - j0, 0, n);  // keys of the tile before Lk
    // Queries [qstart, qend) attend some key of the tile (padded keys get dK = dV = 0).
    const int64_t qstart = nv > 0 ? sm.qfirst(j0) : 0, qend = nv > 0 ? sm.qend(j0 + nv) : 0;
    TileMask tm;
    for (int64_t g = 0; g < G && qstart < qend; ++g) {
      const int64_t h = hk * G + g, bh = b * H + h;
      for (int64_t i0 = (qstart / kBlockM) * kBlockM; i0 < qend; i0 += kBlockM) {
        const int64_t m = std::min(kBlockM, qend - i0);
        const T* Q = q + (bh * Nq + i0) * d;
        const T* dO = dout + (bh * Nq + i0) * d;
        const T* L = lse + bh * Nq + i0;
        const T* Dv = Dvec + bh * Nq + i0;
        tm.build(sm, i0, m, m, j0, nv);
        gemm(false, true, m, nv, d, scale, Q, d, K, d, T(0), S, kBlockN);
        probs_from_scores(S, L, tm);
        mm_queries(tm, d, T(1), S, kBlockN, dO, d, dV, d);                       // dV += P^T dO
        gemm(false, true, m, nv, d, T(1), dO, d, V, d, T(0), dP, kBlockN);       // dP = dO V^T
        for (int64_t i = 0; i < m; ++i) ds_row(S + i * kBlockN, dP + i * kBlockN, nv, Dv[i]);
        tm.fill_outside(dP, kBlockN, T(0));
        mm_queries(tm, d, scale, dP, kBlockN, Q, d, dK, d);                      // dK += s dS^T Q
        mm_keys(tm, d, scale, dP, kBlockN, K, d, dqw + (bh * Nq + i0) * d, d);   // dQ += s dS K
      }
    }
    std::copy(dK, dK + n * d, dk + (bhk * Nk + j0) * d);
    std::copy(dV, dV + n * d, dv + (bhk * Nk + j0) * d);
  });
}

// ------------------------------------------------------------------------------------------------
// Tangent backward (the backward of the JVP; docs/design.md, "Attention"). Two passes:
//   pass 1, per (batch, head, query tile): sweep the keys for r_p (needs every key of the row
//           before any gradient can use it), store r_p and finish D;
//   pass 2, per (batch, head): for each key tile, walk the query tiles that attend it, form the
//           tiles P, S'_p, gP, gS'_p, P'_p once and take all six gradients from them: dK, dV, dK'_p,
//           dV'_p accumulate in the key tile's registers-sized buffers, dQ and dQ'_p in the
//           head's rows of the output (the task owns them).
// One probe costs 3 tile products in pass 1 and 15 in pass 2 (the formulas' minimum is 15); the
// exponentials of a tile are computed twice. Each task owns every row it writes and sums in a
// fixed order, so the result does not depend on the thread count or schedule. With GQA the
// key-side gradients are kept per query head and summed over the group afterwards, in order.
// Memory: four [BM x BN] tiles and one key tile's accumulators per worker, O(N) row statistics,
// and with GQA the per-head key-side gradients (the size of 2 + 2P copies of q).

template <typename T>
struct JvpBwdArgs {
  T scale;
  const T *gout, *gtout, *q, *k, *v, *tq, *tk, *tv, *lse;
  const T *kts, *tkts;  // s K^T, s K'_p^T by blocks of kBlockN keys (blocked_transpose)
  const T *vt, *tvt;    // V^T, V'_p^T: the same layouts
  const T* dlt;  // d'_p = rowsum(gO'_p o O)                 [P, B, H, Nq]
  T* rvec;       // r_p = rowsum(P o S'_p), written by pass 1   [P, B, H, Nq]
  T* Dvec;       // rowsum(gO o O) + sum_p rowsum(gO'_p o O'_p) on entry; D after pass 1  [B, H, Nq]
  T *dq, *dtq;   // [B, H, Nq, d], [P, B, H, Nq, d]
  T *dk, *dv;    // per query head: [B, H, Nk, d] (the outputs when H == Hkv, else summed over the group)
  T *dtk, *dtv;  // per query head: [P, B, H, Nk, d]
};

// With S'_p, dP'_p = gO'_p V^T and gP of one row: gP += dP' o (S' - r) - S' d', S' <- P o (S' - r)
// (= P'_p), dP' <- c P o (dP' - d') (= c gS'_p).
template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default")))
void tangent_row(const T* __restrict p, T* __restrict sp, T* __restrict dpt, T* __restrict gp, int64_t n,
                 T r, T dl, T c) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const T s = sp[j], t = dpt[j];
    gp[j] += t * (s - r) - s * dl;
    sp[j] = p[j] * (s - r);
    dpt[j] = c * (p[j] * (t - dl));
  }
}

// SS <- [P; S'_1; ...; S'_P] of an [m x n] tile from the stacked query rows QS = [Q; Q'_1; ...]
// ([(1 + P) m x d]) and the tile's scaled, transposed keys KTs = s K^T, TKTs[p] = s K'_p^T
// (leading dimension ldk): one product QS KTs gives the scores and every s Q'_p K^T, then
// S'_p += Q TKTs[p].
// S'_p is 0 at masked pairs (masked K, K' may hold NaN).
template <typename T>
void scores_tile(T* SS, const T* QS, const T* KTs, const T* const* TKTs, int64_t ldk, const T* L,
                 const TileMask& tm, int64_t d, int64_t P) {
  const int64_t m = tm.m, n = tm.n;
  gemm(false, false, (1 + P) * m, n, d, T(1), QS, d, KTs, ldk, T(0), SS, kBlockN);
  for (int64_t p = 0; p < P; ++p) {
    T* SP = SS + (1 + p) * m * kBlockN;
    gemm(false, false, m, n, d, T(1), QS, d, TKTs[p], ldk, T(1), SP, kBlockN);
    tm.fill_outside(SP, kBlockN, T(0));
  }
  probs_from_scores(SS, L, tm);
}

// Rows [i0, i0 + m) of x (row length d) and of each probe's xt_p, stacked: [x; xt_1; ...; xt_P].
template <typename T>
void stack_rows(T* dst, const T* x, const T* xt, int64_t probe_stride, int64_t P, int64_t m, int64_t d) {
  std::copy(x, x + m * d, dst);
  for (int64_t p = 0; p < P; ++p) std::copy(xt + p * probe_stride, xt + p * probe_stride + m * d, dst + (1 + p) * m * d);
}

template <typename T>
void jvp_bwd_r_pass(const Dims& D, const JvpBwdArgs<T>& a) {
  const int64_t B = D.B, H = D.H, Hkv = D.Hkv, Nq = D.Nq, Nk = D.Nk, d = D.d, P = D.P;
  const int64_t G = H / Hkv, BH = B * H, BHk = B * Hkv, R = 1 + P;
  const int64_t nqt = (Nq + kBlockM - 1) / kBlockM;
  run_tasks(BH * nqt, [&](int64_t t, int64_t) {
    thread_local std::vector<T> buf;
    thread_local std::vector<const T*> tkt;
    const int64_t need = R * kBlockM * kBlockN + R * kBlockM * d + kBlockM * P;
    if ((int64_t)buf.size() < need) buf.resize(need);
    tkt.resize(P);
    T* SS = buf.data();                  // [R BM, BN] P, S'_p
    T* QS = SS + R * kBlockM * kBlockN;  // [R m, d] Q, Q'_p
    T* r = QS + R * kBlockM * d;         // [P, BM]

    const int64_t qt = nqt - 1 - t / BH;  // last (most expensive under causal) tiles first
    const int64_t bh = t % BH, b = bh / H, h = bh % H, hk = h / G, bhk = b * Hkv + hk;
    const int64_t i0 = qt * kBlockM, m = std::min(kBlockM, Nq - i0);
    const int64_t kblocks = (Nk + kBlockN - 1) / kBlockN;
    const T* KTs = a.kts + bhk * kblocks * d * kBlockN;
    const T* L = a.lse + bh * Nq + i0;
    const SeqMask sm = seq_mask(D.mask, b, Nq, Nk);
    const int64_t mv = std::clamp<int64_t>(sm.Lq - i0, 0, m);  // valid query rows of the tile
    const int64_t jbegin = mv > 0 ? sm.lo(i0) / kBlockN * kBlockN : 0, jend = mv > 0 ? sm.hi(i0 + mv - 1) : 0;
    TileMask tm;
    stack_rows(QS, a.q + (bh * Nq + i0) * d, a.tq + (bh * Nq + i0) * d, BH * Nq * d, P, mv, d);

    std::fill(r, r + P * kBlockM, T(0));
    for (int64_t j0 = jbegin; j0 < jend; j0 += kBlockN) {
      const int64_t n = std::min(kBlockN, jend - j0);
      tm.build(sm, i0, mv, mv, j0, n);
      const int64_t blk = (j0 / kBlockN) * d * kBlockN;
      for (int64_t p = 0; p < P; ++p) tkt[p] = a.tkts + (p * BHk + bhk) * kblocks * d * kBlockN + blk;
      scores_tile(SS, QS, KTs + blk, tkt.data(), kBlockN, L, tm, d, P);
      for (int64_t p = 0; p < P; ++p) {
        T* SP = SS + (1 + p) * mv * kBlockN;
        for (int64_t i = 0; i < mv; ++i) r[p * kBlockM + i] += mul_rowsum(SS + i * kBlockN, SP + i * kBlockN, n);
      }
    }
    // D = (saved part) - sum_p r_p d'_p
    T* Drow = a.Dvec + bh * Nq + i0;
    for (int64_t p = 0; p < P; ++p) {
      const T* dl = a.dlt + (p * BH + bh) * Nq + i0;
      T* rout = a.rvec + (p * BH + bh) * Nq + i0;
      for (int64_t i = 0; i < m; ++i) {
        rout[i] = r[p * kBlockM + i];
        Drow[i] -= r[p * kBlockM + i] * dl[i];
      }
    }
  });
}

template <typename T>
void jvp_bwd_grad_pass(const Dims& D, const JvpBwdArgs<T>& a) {
  const int64_t B = D.B, H = D.H, Hkv = D.Hkv, Nq = D.Nq, Nk = D.Nk, d = D.d, P = D.P;
  const int64_t G = H / Hkv, BH = B * H, BHk = B * Hkv, R = 1 + P;
  const T scale = a.scale;
  run_tasks(BH, [&](int64_t t, int64_t) {
    thread_local std::vector<T> buf;
    thread_local std::vector<const T*> tk, tkt;
    const int64_t need = 2 * R * kBlockM * kBlockN + 2 * kBlockN * d * R;
    if ((int64_t)buf.size() < need) buf.resize(need);
    tk.resize(P);
    tkt.resize(P);
    // The head's stacked query-side operands: O(Nq d), for this task only (not kept per thread).
    std::unique_ptr<T[]> heads(new T[4 * R * Nq * d]);
    T* SS = buf.data();                  // [R BM, BN] P, then S'_p -> P'_p
    T* GG = SS + R * kBlockM * kBlockN;  // [R BM, BN] gP -> gS, then dP'_p -> gS'_p
    // The key tile's gradients, transposed (see mm_queries_t): [d, BN] each.
    T* dKT = GG + R * kBlockM * kBlockN;
    T* dVT = dKT + kBlockN * d;
    T* dtKT = dVT + kBlockN * d;         // [P, d, BN]
    T* dtVT = dtKT + P * kBlockN * d;    // [P, d, BN]
    T* QS = heads.get();                 // per query tile: [R m, d] Q, Q'_p
    T* GO = QS + R * Nq * d;             // per query tile: [R m, d] gO, gO'_p
    T* QST = GO + R * Nq * d;            // per query tile: the same transposed, [d, R m]
    T* GOT = QST + R * Nq * d;

    const int64_t bh = t, b = bh / H, h = bh % H, hk = h / G, bhk = b * Hkv + hk;
    const SeqMask sm = seq_mask(D.mask, b, Nq, Nk);
    // The head's query-side operands stacked per query tile, once: [Q; Q'_p] and [gO; gO'_p].
    for (int64_t i0 = 0; i0 < Nq; i0 += kBlockM) {
      const int64_t m = std::min(kBlockM, Nq - i0);
      stack_rows(QS + R * i0 * d, a.q + (bh * Nq + i0) * d, a.tq + (bh * Nq + i0) * d, BH * Nq * d, P, m, d);
      stack_rows(GO + R * i0 * d, a.gout + (bh * Nq + i0) * d, a.gtout + (bh * Nq + i0) * d, BH * Nq * d, P, m, d);
      for (int64_t r = 0; r < R * m; ++r)
        for (int64_t c = 0; c < d; ++c) {
          QST[R * i0 * d + c * R * m + r] = QS[R * i0 * d + r * d + c];
          GOT[R * i0 * d + c * R * m + r] = GO[R * i0 * d + r * d + c];
        }
    }
    T* dQ = a.dq + bh * Nq * d;
    std::fill(dQ, dQ + Nq * d, T(0));
    for (int64_t p = 0; p < P; ++p) {
      T* dtQ = a.dtq + (p * BH + bh) * Nq * d;
      std::fill(dtQ, dtQ + Nq * d, T(0));
    }
    TileMask tm;
    for (int64_t j0 = 0; j0 < Nk; j0 += kBlockN) {
      const int64_t n = std::min(kBlockN, Nk - j0);
      const T* K = a.k + (bhk * Nk + j0) * d;
      const int64_t kblocks = (Nk + kBlockN - 1) / kBlockN, blk = (j0 / kBlockN) * d * kBlockN;
      const T* KTs = a.kts + bhk * kblocks * d * kBlockN + blk;
      const T* VT = a.vt + bhk * kblocks * d * kBlockN + blk;
      for (int64_t p = 0; p < P; ++p) {
        tk[p] = a.tk + ((p * BHk + bhk) * Nk + j0) * d;
        tkt[p] = a.tkts + (p * BHk + bhk) * kblocks * d * kBlockN + blk;
      }
      auto TVT = [&](int64_t p) { return a.tvt + (p * BHk + bhk) * kblocks * d * kBlockN + blk; };
      std::fill(dKT, dKT + 2 * R * kBlockN * d, T(0));  // dKT, dVT, dtKT, dtVT
      const int64_t nv = std::clamp<int64_t>(sm.Lk - j0, 0, n);  // keys of the tile before Lk
      // Queries [qstart, qend) attend some key of the tile (padded keys get zero gradients).
      const int64_t qstart = nv > 0 ? sm.qfirst(j0) : 0, qend = nv > 0 ? sm.qend(j0 + nv) : 0;
      for (int64_t i0 = (qstart / kBlockM) * kBlockM; i0 < qend; i0 += kBlockM) {
        // Whole tiles (rows past qend attend none of these keys: masked, exact zeros), so that the
        // stacked operands of the tile line up.
        const int64_t m = std::min(kBlockM, Nq - i0);
        const T* QSi = QS + R * i0 * d;
        const T* GOi = GO + R * i0 * d;
        const T* QSTi = QST + R * i0 * d;  // [d, R m]
        const T* GOTi = GOT + R * i0 * d;
        const T* L = a.lse + bh * Nq + i0;
        const T* Drow = a.Dvec + bh * Nq + i0;
        T* dQi = dQ + i0 * d;
        auto group = [&](T* base, int64_t g) { return base + g * m * kBlockN; };
        tm.build(sm, i0, m, std::clamp<int64_t>(sm.Lq - i0, 0, m), j0, nv);
        scores_tile(SS, QSi, KTs, tkt.data(), kBlockN, L, tm, d, P);                        // P, S'_p
        gemm(false, false, R * m, nv, d, T(1), GOi, d, VT, kBlockN, T(0), GG, kBlockN);     // gO V^T, dP'_p
        for (int64_t p = 0; p < P; ++p)
          gemm(false, false, m, nv, d, T(1), GOi + (1 + p) * m * d, d, TVT(p), kBlockN, T(1), GG, kBlockN);  // gO'_p V'_p^T
        tm.fill_outside(GG, kBlockN, T(0));  // masked V, V' may hold NaN
        for (int64_t p = 0; p < P; ++p) {
          const T* r = a.rvec + (p * BH + bh) * Nq + i0;
          const T* dl = a.dlt + (p * BH + bh) * Nq + i0;
          T* SP = group(SS, 1 + p);
          T* dPt = group(GG, 1 + p);
          tm.fill_outside(dPt, kBlockN, T(0));
          for (int64_t i = 0; i < m; ++i)
            tangent_row(SS + i * kBlockN, SP + i * kBlockN, dPt + i * kBlockN, GG + i * kBlockN, nv, r[i], dl[i],
                        scale);
          tm.fill_outside(SP, kBlockN, T(0));   // P', gS': a NaN row statistic stays in its row
          tm.fill_outside(dPt, kBlockN, T(0));
          // dPt now holds s gS'_p (and GG below s gS): the products need no alpha (see gemm)
          mm_queries_t(tm, d, GOTi, R * m, (1 + p) * m, SS, kBlockN, dtVT + p * kBlockN * d, kBlockN);  // dV' += P^T gO'
          mm_queries_t(tm, d, QSTi, R * m, 0, dPt, kBlockN, dtKT + p * kBlockN * d, kBlockN);  // dK' += s gS'^T Q
          mm_keys(tm, d, T(1), dPt, kBlockN, K, d, a.dtq + ((p * BH + bh) * Nq + i0) * d, d);  // dQ' += s gS' K
          mm_keys(tm, d, T(1), dPt, kBlockN, tk[p], d, dQi, d);                           // dQ += s gS' K'
        }
        mm_queries_t(tm, d, GOTi, R * m, 0, SS, kBlockN, dVT, kBlockN, R);                  // dV += [P; P'_p]^T [gO; gO'_p]
        for (int64_t i = 0; i < m; ++i) ds_row(SS + i * kBlockN, GG + i * kBlockN, nv, Drow[i], scale);  // s gS
        tm.fill_outside(GG, kBlockN, T(0));
        mm_queries_t(tm, d, QSTi, R * m, 0, GG, kBlockN, dKT, kBlockN, R);                  // dK += s [gS; gS'_p]^T [Q; Q'_p]
        mm_keys(tm, d, T(1), GG, kBlockN, K, d, dQi, d);                                   // dQ += s gS K
      }
      auto store = [&](const T* CT, T* dst) {  // [d, BN] -> rows [n, d]
        for (int64_t j = 0; j < n; ++j)
          for (int64_t c = 0; c < d; ++c) dst[j * d + c] = CT[c * kBlockN + j];
      };
      store(dKT, a.dk + (bh * Nk + j0) * d);
      store(dVT, a.dv + (bh * Nk + j0) * d);
      for (int64_t p = 0; p < P; ++p) {
        store(dtKT + p * kBlockN * d, a.dtk + ((p * BH + bh) * Nk + j0) * d);
        store(dtVT + p * kBlockN * d, a.dtv + ((p * BH + bh) * Nk + j0) * d);
      }
    }
  });
}

// out[(c, b, hk)] = sum_g parts[(c, b, hk * G + g)] over rows of `row` elements, g in order: the
// per-query-head key-side gradients of a GQA group summed deterministically.
template <typename T>
void sum_groups(const T* parts, T* out, int64_t outer, int64_t Hkv, int64_t G, int64_t row) {
  at::parallel_for(0, outer * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const T* src = parts + o * G * row;
      T* dst = out + o * row;
      std::copy(src, src + row, dst);
      for (int64_t g = 1; g < G; ++g)
        for (int64_t c = 0; c < row; ++c) dst[c] += src[g * row + c];
    }
  });
}

Dims dims_of(const Tensor& q, const Tensor& k, const MaskArgs& mask, int64_t P) {
  return Dims{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), P, mask};
}

// The mask arguments as the kernels read them; the lens must outlive the returned struct.
MaskArgs mask_args(bool causal, int64_t window_left, int64_t window_right, const std::optional<Tensor>& q_lens,
                   const std::optional<Tensor>& kv_lens) {
  return MaskArgs{causal, window_left, window_right, q_lens ? q_lens->data_ptr<int32_t>() : nullptr,
                  kv_lens ? kv_lens->data_ptr<int32_t>() : nullptr};
}

at::ScalarType compute_type(at::ScalarType dt) { return dt == at::kDouble ? at::kDouble : at::kFloat; }

std::tuple<Tensor, Tensor, Tensor> fwd_jvp_cpu(const Tensor& q_, const Tensor& k_, const Tensor& v_,
                                               const Tensor* tq_, const Tensor* tk_, const Tensor* tv_,
                                               int64_t P, const MaskArgs& mask, double scale) {
  const auto dt = q_.scalar_type(), ct = compute_type(dt);
  const Dims D = dims_of(q_, k_, mask, P);
  // Keys transposed by blocks (one O(N d) copy; see fwd_jvp_kernel).
  auto transposed = [&](const Tensor& x) { return blocked_transpose(x.to(ct), kFwdN, 1.0); };
  Tensor q = q_.to(ct).contiguous(), kt = transposed(k_), v = v_.to(ct).contiguous();
  Tensor tq, tkt, tv;
  if (P > 0) {
    tq = tq_->to(ct).contiguous();
    tkt = transposed(*tk_);
    tv = tv_->to(ct).contiguous();
  }
  Tensor out = at::empty(q.sizes(), q.options());
  Tensor tout = at::empty({P, D.B, D.H, D.Nq, D.d}, q.options());
  Tensor lse = at::empty({D.B, D.H, D.Nq}, q.options());
  if (D.B * D.H > 0) {
    AT_DISPATCH_FLOATING_TYPES(ct, "condinit_attention_fwd_cpu", [&] {
      const scalar_t* nul = nullptr;
      fwd_jvp_kernel<scalar_t>(D, (scalar_t)scale, q.data_ptr<scalar_t>(), kt.data_ptr<scalar_t>(),
                               v.data_ptr<scalar_t>(), P ? tq.data_ptr<scalar_t>() : nul,
                               P ? tkt.data_ptr<scalar_t>() : nul, P ? tv.data_ptr<scalar_t>() : nul,
                               out.data_ptr<scalar_t>(), P ? tout.data_ptr<scalar_t>() : nullptr,
                               lse.data_ptr<scalar_t>());
    });
  }
  return {out.to(dt), tout.to(dt), lse};  // lse in the compute type: float32, or float64 for float64
}

// Checks of the mask arguments, values included (the CPU kernels read the lens on the host).
MaskArgs checked_mask(const Tensor& q, const Tensor& k, bool causal, int64_t window_left, int64_t window_right,
                      const std::optional<Tensor>& q_lens, const std::optional<Tensor>& kv_lens, const char* op) {
  attention_checks::check_mask_args(q, q_lens, kv_lens, window_left, window_right, op);
  attention_checks::check_lens_values(q_lens, q.size(2), "q_lens", op);
  attention_checks::check_lens_values(kv_lens, k.size(2), "kv_lens", op);
  return mask_args(causal, window_left, window_right, q_lens, kv_lens);
}

std::tuple<Tensor, Tensor> attention_fwd_cpu(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                             double scale, int64_t window_left, int64_t window_right,
                                             const std::optional<Tensor>& q_lens,
                                             const std::optional<Tensor>& kv_lens) {
  attention_checks::check_fwd_args(q, k, v, "attention_fwd");
  const MaskArgs M = checked_mask(q, k, causal, window_left, window_right, q_lens, kv_lens, "attention_fwd");
  auto r = fwd_jvp_cpu(q, k, v, nullptr, nullptr, nullptr, 0, M, scale);
  return {std::get<0>(r), std::get<2>(r)};
}

std::tuple<Tensor, Tensor, Tensor> attention_jvp_cpu(const Tensor& q, const Tensor& k, const Tensor& v,
                                                     const Tensor& tq, const Tensor& tk, const Tensor& tv,
                                                     bool causal, double scale, int64_t window_left,
                                                     int64_t window_right, const std::optional<Tensor>& q_lens,
                                                     const std::optional<Tensor>& kv_lens) {
  attention_checks::check_jvp_args(q, k, v, tq, tk, tv, "attention_jvp");
  const MaskArgs M = checked_mask(q, k, causal, window_left, window_right, q_lens, kv_lens, "attention_jvp");
  return fwd_jvp_cpu(q, k, v, &tq, &tk, &tv, tq.size(0), M, scale);
}

std::tuple<Tensor, Tensor, Tensor> attention_bwd_cpu(const Tensor& dout_, const Tensor& q_, const Tensor& k_,
                                                     const Tensor& v_, const Tensor& out_, const Tensor& lse_,
                                                     bool causal, double scale, int64_t window_left,
                                                     int64_t window_right, const std::optional<Tensor>& q_lens,
                                                     const std::optional<Tensor>& kv_lens) {
  attention_checks::check_bwd_args(dout_, q_, k_, v_, out_, lse_, "attention_bwd");
  const MaskArgs M = checked_mask(q_, k_, causal, window_left, window_right, q_lens, kv_lens, "attention_bwd");
  const auto dt = q_.scalar_type(), ct = compute_type(dt);
  const Dims D = dims_of(q_, k_, M, 0);
  Tensor q = q_.to(ct).contiguous(), k = k_.to(ct).contiguous(), v = v_.to(ct).contiguous();
  Tensor dout = dout_.to(ct).contiguous();
  Tensor Dvec = (dout * out_.to(ct)).sum(-1).contiguous();  // D = rowsum(dO o O)
  // fp64 with an fp32 lse (saved by another backend) recomputes it in fp64 (one more pass, S and exp
  // only): an fp32 lse would cap the fp64 gradients at ~1e-7 relative accuracy.
  const bool recompute_lse = ct == at::kDouble && lse_.scalar_type() != at::kDouble;
  Tensor lse = recompute_lse ? std::get<2>(fwd_jvp_cpu(q, k, v, nullptr, nullptr, nullptr, 0, M, scale))
                             : lse_.contiguous();
  const int64_t nworkers = std::max<int64_t>(1, at::get_num_threads());
  Tensor dq_parts = at::zeros({nworkers, D.B, D.H, D.Nq, D.d}, q.options());
  Tensor dk = at::empty(k.sizes(), k.options()), dv = at::empty(v.sizes(), v.options());
  if (D.B * D.H > 0) {
    AT_DISPATCH_FLOATING_TYPES(ct, "condinit_attention_bwd_cpu", [&] {
      bwd_kernel<scalar_t>(D, (scalar_t)scale, dout.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                           k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(),
                           Dvec.data_ptr<scalar_t>(), dq_parts.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                           dv.data_ptr<scalar_t>());
    });
  }
  Tensor dq = nworkers == 1 ? dq_parts[0] : dq_parts.sum(0);
  return {dq.to(dt), dk.to(dt), dv.to(dt)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> attention_jvp_bwd_cpu(
    const Tensor& gout_, const Tensor& gtout_, const Tensor& q_, const Tensor& k_, const Tensor& v_,
    const Tensor& tq_, const Tensor& tk_, const Tensor& tv_, const Tensor& out_, const Tensor& tout_,
    const Tensor& lse_, bool causal, double scale, int64_t window_left, int64_t window_right,
    const std::optional<Tensor>& q_lens, const std::optional<Tensor>& kv_lens) {
  attention_checks::check_jvp_bwd_args(gout_, gtout_, q_, k_, v_, tq_, tk_, tv_, out_, tout_, lse_, "attention_jvp_bwd");
  const MaskArgs M = checked_mask(q_, k_, causal, window_left, window_right, q_lens, kv_lens, "attention_jvp_bwd");
  const auto dt = q_.scalar_type(), ct = compute_type(dt);
  const int64_t P = tq_.size(0);
  const Dims D = dims_of(q_, k_, M, P);
  auto c = [&](const Tensor& x) { return x.to(ct).contiguous(); };
  Tensor q = c(q_), k = c(k_), v = c(v_), tq = c(tq_), tk = c(tk_), tv = c(tv_);
  Tensor gout = c(gout_), gtout = c(gtout_), out = c(out_);
  // Copies transposed by blocks (the keys scaled by s) for plain products (see gemm): O(N d).
  Tensor kts = blocked_transpose(k, kBlockN, scale), tkts = blocked_transpose(tk, kBlockN, scale);
  Tensor vt = blocked_transpose(v, kBlockN, 1.0), tvt = blocked_transpose(tv, kBlockN, 1.0);
  // Row statistics from the saved outputs (O(N)): d'_p = rowsum(gO'_p o O) and the part of D that
  // does not need r; pass 1 subtracts sum_p r_p d'_p.
  Tensor dlt = (gtout * out.unsqueeze(0)).sum(-1).contiguous();
  Tensor Dvec = ((gout * out).sum(-1) + (gtout * c(tout_)).sum(-1).sum(0)).contiguous();
  // fp64 with an fp32 lse recomputes it in fp64 (an fp32 lse would cap the accuracy at ~1e-7).
  const bool recompute_lse = ct == at::kDouble && lse_.scalar_type() != at::kDouble;
  Tensor lse = recompute_lse ? std::get<2>(fwd_jvp_cpu(q, k, v, nullptr, nullptr, nullptr, 0, M, scale)) : c(lse_);
  Tensor rvec = at::empty({P, D.B, D.H, D.Nq}, q.options());
  Tensor dq = at::empty(q.sizes(), q.options()), dtq = at::empty(tq.sizes(), tq.options());
  // Key-side gradients per query head (the outputs themselves without GQA), summed over the group.
  const int64_t G = D.H / D.Hkv;
  auto per_head = [&](const Tensor& x) {
    auto sizes = x.sizes().vec();
    sizes[sizes.size() - 3] = D.H;
    return at::empty(sizes, x.options());
  };
  Tensor dk_h = per_head(k), dv_h = per_head(v), dtk_h = per_head(tk), dtv_h = per_head(tv);
  AT_DISPATCH_FLOATING_TYPES(ct, "condinit_attention_jvp_bwd_cpu", [&] {
    JvpBwdArgs<scalar_t> a{(scalar_t)scale,
                           gout.data_ptr<scalar_t>(), gtout.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                           k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), tq.data_ptr<scalar_t>(),
                           tk.data_ptr<scalar_t>(), tv.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(),
                           kts.data_ptr<scalar_t>(), tkts.data_ptr<scalar_t>(), vt.data_ptr<scalar_t>(),
                           tvt.data_ptr<scalar_t>(),
                           dlt.data_ptr<scalar_t>(), rvec.data_ptr<scalar_t>(), Dvec.data_ptr<scalar_t>(),
                           dq.data_ptr<scalar_t>(), dtq.data_ptr<scalar_t>(),
                           dk_h.data_ptr<scalar_t>(), dv_h.data_ptr<scalar_t>(),
                           dtk_h.data_ptr<scalar_t>(), dtv_h.data_ptr<scalar_t>()};
    jvp_bwd_r_pass<scalar_t>(D, a);  // r and D are complete before pass 2 reads them
    jvp_bwd_grad_pass<scalar_t>(D, a);
  });
  auto grouped = [&](const Tensor& parts, const Tensor& like) {
    if (G == 1) return parts;
    Tensor out = at::empty(like.sizes(), like.options());
    if (out.numel() == 0) return out;
    AT_DISPATCH_FLOATING_TYPES(ct, "condinit_attention_jvp_bwd_sum_groups", [&] {
      sum_groups<scalar_t>(parts.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), parts.numel() / (D.H * D.Nk * D.d),
                           D.Hkv, G, D.Nk * D.d);
    });
    return out;
  };
  Tensor dk = grouped(dk_h, k), dv = grouped(dv_h, v), dtk = grouped(dtk_h, tk), dtv = grouped(dtv_h, tv);
  return {dq.to(dt), dk.to(dt), dv.to(dt), dtq.to(dt), dtk.to(dt), dtv.to(dt)};
}

}  // namespace
}  // namespace attention_cpu
}  // namespace condinit

TORCH_LIBRARY_IMPL(condinit_C, CPU, m) {
  m.impl("attention_fwd", &condinit::attention_cpu::attention_fwd_cpu);
  m.impl("attention_bwd", &condinit::attention_cpu::attention_bwd_cpu);
  m.impl("attention_jvp", &condinit::attention_cpu::attention_jvp_cpu);
  m.impl("attention_jvp_bwd", &condinit::attention_cpu::attention_jvp_bwd_cpu);
}
