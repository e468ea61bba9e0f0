// Tiles of the CUDA attention kernels: warp-level tile products on mma.sync fragments, tile loads
// into shared memory, the tile sizes and the shared-memory layouts (identical on host and device).
//
// A block is 1-4 warps; each warp owns 16 rows for the whole kernel and keeps its accumulators and
// the row statistics in registers, as mma.sync C fragments. Scores never leave registers: the C
// fragment of S = Q K^T is, element for element, the A fragment of P V (FlashAttention-2's register
// reuse), so fp16/bf16 need no shared memory for P; fp32 passes P through a per-warp shared scratch
// tile. Row reductions are two quad shuffles. Every A and B fragment of a shared tile is an
// ldmatrix.x4: plain where the reduced dim is contiguous (Q, K of S = Q K^T, ...), .trans where it
// is not (the B operand of P V, P^T dO, dS K, ...). The head dim d (1..256) is padded to dpad, a multiple of 16, and rows outside
// the sequence lengths and the padded columns are zero-filled, so products over padding add exact
// zeros; the output columns are split into chunks of kCols columns (a grid dimension), so
// accumulators have a fixed size in registers.
#pragma once

#include "attention/kernel_kind.h"
#include "attention/cuda/primitives.cuh"

namespace condinit {
namespace attention_cuda {
namespace {

// ------------------------------------------------------------------------------------------------
// Warp-level tile products. Fragment coordinates: lane = 4 g + t; C element e of n-tile nt is at
// row g + 8 (e >> 1), column 8 nt + 2 t + (e & 1).

// C[16 x 8 NT] += A[16 x K] B^T: A [16 rows][K] and B [8 NT rows][K] row-major in shared memory
// (leading dims lda, ldb), K a multiple of 16 (zero-padded).
template <typename T, int NT>
__device__ __forceinline__ void mma_abt(float (&c)[NT][4], const T* A, int lda, const T* B, int ldb, int K) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if constexpr (kSimt<T>) {
    const float* a0 = A + g * lda;
    const float* a1 = A + (g + 8) * lda;
    for (int k = 0; k < K; ++k) {
      const float x0 = a0[k], x1 = a1[k];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float y0 = B[(nt * 8 + 2 * t) * ldb + k], y1 = B[(nt * 8 + 2 * t + 1) * ldb + k];
        c[nt][0] = fmaf(x0, y0, c[nt][0]);
        c[nt][1] = fmaf(x0, y1, c[nt][1]);
        c[nt][2] = fmaf(x1, y0, c[nt][2]);
        c[nt][3] = fmaf(x1, y1, c[nt][3]);
      }
    }
  } else {
    static_assert(NT % 2 == 0, "n-tiles come in pairs (one ldmatrix.x4 of B)");
    // ldmatrix rows: lane 8 m + j reads A row j + 8 (m & 1), columns k0 + 8 (m >> 1) (the A fragment
    // a0..a3), and B row 8 (m >> 1) + j, columns k0 + 8 (m & 1) of an n-tile pair (b0, b1 of each).
    const int m = lane >> 3, j = lane & 7;
    const T* arow = A + (j + 8 * (m & 1)) * lda + 8 * (m >> 1);
    const T* brow = B + (j + 8 * (m >> 1)) * ldb + 8 * (m & 1);
    for (int k0 = 0; k0 < K; k0 += 16) {
      uint32_t a[4];
      ldsm_x4(a, arow + k0);
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {
        uint32_t r[4];
        ldsm_x4(r, brow + nt * 8 * ldb + k0);
        const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
        mma_16816<T>(c[nt], a, b0);
        mma_16816<T>(c[nt + 1], a, b1);
      }
    }
  }
}

// C[16 x 8 NO] += P[16 x 8 KT] B: P in registers as C fragments (fp32), B [8 KT rows][>= 8 NO cols]
// row-major in shared memory (ldb). Only n-tiles below n_active are computed (the rest is padding).
// fp16/bf16: P is rounded to T (its C fragment pairs are the A fragment of m16n8k16). fp32: P goes
// through the warp's scratch tile [16][8 KT + 4].
template <typename T, int KT, int NO>
__device__ __forceinline__ void mma_pb(float (&c)[NO][4], const float (&p)[KT][4], const T* B, int ldb, int n_active,
                                       float* scratch) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if constexpr (kSimt<T>) {
    constexpr int lds = 8 * KT + 4;
#pragma unroll
    for (int nt = 0; nt < KT; ++nt) {
      scratch[g * lds + nt * 8 + 2 * t] = p[nt][0];
      scratch[g * lds + nt * 8 + 2 * t + 1] = p[nt][1];
      scratch[(g + 8) * lds + nt * 8 + 2 * t] = p[nt][2];
      scratch[(g + 8) * lds + nt * 8 + 2 * t + 1] = p[nt][3];
    }
    __syncwarp();
    for (int kk = 0; kk < 8 * KT; ++kk) {
      const float x0 = scratch[g * lds + kk], x1 = scratch[(g + 8) * lds + kk];
      const float* brow = B + kk * ldb + 2 * t;
#pragma unroll
      for (int nt = 0; nt < NO; ++nt) {
        if (nt < n_active) {
          const float y0 = brow[nt * 8], y1 = brow[nt * 8 + 1];
          c[nt][0] = fmaf(x0, y0, c[nt][0]);
          c[nt][1] = fmaf(x0, y1, c[nt][1]);
          c[nt][2] = fmaf(x1, y0, c[nt][2]);
          c[nt][3] = fmaf(x1, y1, c[nt][3]);
        }
      }
    }
    __syncwarp();  // every lane has read the scratch before it is rewritten
  } else {
    static_assert(KT % 2 == 0 && NO % 2 == 0, "key tiles and column chunks come in multiples of 16");
#pragma unroll
    for (int ks = 0; ks < KT / 2; ++ks) {
      const uint32_t a[4] = {pack2<T>(p[2 * ks][0], p[2 * ks][1]), pack2<T>(p[2 * ks][2], p[2 * ks][3]),
                             pack2<T>(p[2 * ks + 1][0], p[2 * ks + 1][1]),
                             pack2<T>(p[2 * ks + 1][2], p[2 * ks + 1][3])};
      // ldmatrix rows: lane 8 m + j reads key 16 ks + j + 8 (m & 1), columns from 8 (m >> 1): the B
      // fragments (b0, b1) of n-tiles nt and nt + 1 (n_active is even: columns come in 16s).
      const T* rows = B + (16 * ks + (lane & 7) + 8 * ((lane >> 3) & 1)) * ldb + 8 * (lane >> 4);
#pragma unroll
      for (int nt = 0; nt < NO; nt += 2) {
        if (nt < n_active) {
          uint32_t r[4];
          ldsm_x4_trans(r, rows + nt * 8);
          const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
          mma_16816<T>(c[nt], a, b0);
          mma_16816<T>(c[nt + 1], a, b1);
        }
      }
    }
  }
}

// Whether a 32-bit word holding one fp32 or two 16-bit values holds a non-finite one (all exponent bits set).
template <typename T>
__device__ __forceinline__ bool has_nonfinite(uint32_t w) {
  if constexpr (kSimt<T>) {
    return (w & 0x7f800000u) == 0x7f800000u;
  } else {
    constexpr uint32_t e = std::is_same<T, __half>::value ? 0x7c00u : 0x7f80u;
    return (w & e) == e || ((w >> 16) & e) == e;
  }
}

// Clears the non-finite (NaN / Inf) values of a 32-bit word holding one fp32 or two 16-bit values to 0.
template <typename T>
__device__ __forceinline__ void clear_nonfinite(uint32_t& w) {
  if constexpr (kSimt<T>) {
    if (has_nonfinite<T>(w)) w = 0;
  } else {
    if (has_nonfinite<T>(w & 0xffffu)) w &= 0xffff0000u;
    if (has_nonfinite<T>(w >> 16)) w &= 0x0000ffffu;
  }
}

// How the threads of a block walk a [R][width] tile in copies of `vec` elements (16 bytes, or one
// element where rows are not 16-byte aligned: d not a multiple of 16 / sizeof(T)): thread t takes
// copies t, t + blockDim.x, ... in row-major order. The first copy and the step are divided out once
// per kernel, so that the tile loops hold no integer divide.
struct TileWalk {
  int vec, chunks, r, c, dr, dc;
};
template <typename T>
__device__ __forceinline__ TileWalk tile_walk(int d, int c0, int width) {
  constexpr int kVec = 16 / sizeof(T);
  const int vec = d % kVec == 0 && c0 % kVec == 0 ? kVec : 1, chunks = width / vec;
  const int t = (int)threadIdx.x, n = (int)blockDim.x;
  return TileWalk{vec, chunks, t / chunks, t - t / chunks * chunks, n / chunks, n - n / chunks * chunks};
}

// The thread's next copy: blockDim.x copies further.
__device__ __forceinline__ void walk_step(const TileWalk& w, int& r, int& cv) {
  cv += w.dc;
  r += w.dr;
  if (cv >= w.chunks) {
    cv -= w.chunks;
    ++r;
  }
}

// Issues the copy of a tile: dst[r][c] (r < R, c < width of the walk, leading dim ld) =
// src[(row0 + r) * d + c0 + c] where row0 + r < nrows and c0 + c < d, else 0. All threads of the
// block take part. 16-byte chunks go by cp.async, with zero fill outside the sequence: they land at
// the thread's cp_async_wait covering them and are visible to the block after a barrier that follows
// every thread's wait. Unaligned rows (a walk of single elements) are copied at once.
template <typename T>
__device__ void copy_tile(T* dst, int ld, const T* src, int d, int64_t row0, int64_t nrows, int R, int c0,
                          const TileWalk& w) {
  // 32-bit offsets from the tile's first element in the loops (r * d < 2^16: R, d <= 256).
  const int rows_in = (int)(nrows - row0 < 0 ? 0 : nrows - row0 < R ? nrows - row0 : R), cols_in = d - c0;
  const T* from = src + row0 * d + c0;
  if (w.vec > 1) {
    for (int r = w.r, cv = w.c; r < R; walk_step(w, r, cv)) {
      const int c = cv * w.vec;
      const bool in = r < rows_in && c < cols_in;
      cp_async16(dst + r * ld + c, in ? from + r * d + c : src, in ? 16 : 0);
    }
  } else {
    for (int r = w.r, c = w.c; r < R; walk_step(w, r, c))
      dst[r * ld + c] = r < rows_in && c < cols_in ? from[r * d + c] : Cvt<T>::from_f(0.0f);
  }
}

// For a product operand that masked entries multiply by an exact 0 (V, V'), after the thread's wait
// for its copy_tile of the same walk: non-finite values of the chunks this thread copied are stored
// as 0 and their rows flagged, bad_rows[r] = 1 and *bad_any = 1 (plain stores of 1, zeroed by the
// caller beforehand). The kernel then makes the rows that attend a flagged key NaN, so masked
// entries never contribute.
template <typename T>
__device__ void clear_nonfinite_tile(T* dst, int ld, int R, const TileWalk& w, unsigned char* bad_rows, int* bad_any) {
  for (int r = w.r, cv = w.c; r < R;) {
    T* at = dst + r * ld + cv * w.vec;
    if (w.vec > 1) {
      int4 val = *reinterpret_cast<const int4*>(at);
      uint32_t x[4] = {(uint32_t)val.x, (uint32_t)val.y, (uint32_t)val.z, (uint32_t)val.w};
      if (has_nonfinite<T>(x[0]) || has_nonfinite<T>(x[1]) || has_nonfinite<T>(x[2]) || has_nonfinite<T>(x[3])) {
#pragma unroll
        for (int i = 0; i < 4; ++i) clear_nonfinite<T>(x[i]);
        *reinterpret_cast<int4*>(at) = make_int4((int)x[0], (int)x[1], (int)x[2], (int)x[3]);
        bad_rows[r] = 1;
        *bad_any = 1;
      }
    } else if (!isfinite(Cvt<T>::to_f(*at))) {
      *at = Cvt<T>::from_f(0.0f);
      bad_rows[r] = 1;
      *bad_any = 1;
    }
    walk_step(w, r, cv);
  }
}

template <typename T, int NT>
__device__ __forceinline__ void zero(float (&c)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[nt][e] = 0.0f;
}

// ------------------------------------------------------------------------------------------------
// Tile sizes and shared-memory layouts

// Keys per streamed tile in fwd / jvp / dq, queries per streamed tile in dk/dv.
template <typename T>
constexpr int fwd_bn() { return kSimt<T> ? 32 : 64; }
template <typename T>
constexpr int jvp_bn() { return kSimt<T> ? 16 : 32; }
template <typename T>
constexpr int dq_bn() { return kSimt<T> ? 32 : 64; }
constexpr int kDkdvBm = 32;

__host__ __device__ inline int pad16(int64_t d) { return (int)((d + 15) / 16 * 16); }
__host__ __device__ inline size_t align128(size_t x) { return (x + 127) & ~size_t(127); }
__host__ __device__ inline int min_int(int a, int b) { return a < b ? a : b; }

// A [rows][width] tile of `elem`-byte elements, rows padded by 16 bytes (conflict-free fragment loads).
struct TileDim {
  int ld;
  size_t bytes;
};
__host__ __device__ inline TileDim tile_dim(int rows, int width, int elem) {
  const int ld = width + 16 / elem;
  return TileDim{ld, align128((size_t)rows * ld * elem)};
}

// Offsets (bytes) into dynamic shared memory.
struct FwdLayout {
  int ldq, ldk, ldv, lds;
  size_t q, tq, k, tk, v, tv, scratch, flags, total;
};
// kind: kFwd, kJvp or kDq; rows = 16 * warps.
__host__ __device__ inline FwdLayout fwd_layout(KernelKind kind, int elem, int dpad, int rows, int bn, bool simt) {
  FwdLayout L{};
  const int vcols = min_int(kCols, dpad);
  const TileDim qd = tile_dim(rows, dpad, elem), kd = tile_dim(bn, dpad, elem),
                vd = tile_dim(bn, kind == KernelKind::kDq ? dpad : vcols, elem);
  L.ldq = qd.ld;
  L.ldk = kd.ld;
  L.ldv = vd.ld;
  L.lds = 8 * (bn / 8) + 4;
  size_t off = 0;
  L.q = off; off += qd.bytes;                        // Q (fwd, jvp, dq)
  L.tq = off; off += kind != KernelKind::kFwd ? qd.bytes : 0;       // tangent Q (jvp) or dO (dq)
  L.k = off; off += kd.bytes;                        // K
  L.tk = off; off += kind == KernelKind::kJvp ? kd.bytes : 0;       // tangent K (jvp)
  L.v = off; off += vd.bytes;                        // V (its output chunk; all of it in dq)
  L.tv = off; off += kind == KernelKind::kJvp ? vd.bytes : 0;       // tangent V (jvp)
  L.scratch = off; off += simt ? align128((size_t)(rows / 16) * 16 * L.lds * 4) : 0;
  // fwd / jvp: non-finite V / V' rows, [2 buffers][V, V'][bn] bytes, then [2][2] ints "any".
  L.flags = off; off += kind != KernelKind::kDq ? align128((size_t)4 * bn + 16) : 0;
  L.total = off;
  return L;
}

struct DkdvLayout {
  int ldk, ldq, lds;
  size_t k, v, q, dout, lse, D, scratch, total;
};
__host__ __device__ inline DkdvLayout dkdv_layout(int elem, int dpad, int rows, bool simt) {
  DkdvLayout L{};
  const TileDim kd = tile_dim(rows, dpad, elem), qd = tile_dim(kDkdvBm, dpad, elem);
  L.ldk = kd.ld;
  L.ldq = qd.ld;
  L.lds = kDkdvBm + 4;
  size_t off = 0;
  L.k = off; off += kd.bytes;
  L.v = off; off += kd.bytes;
  L.q = off; off += qd.bytes;
  L.dout = off; off += qd.bytes;
  L.lse = off; off += align128(kDkdvBm * 4);
  L.D = off; off += align128(kDkdvBm * 4);
  L.scratch = off; off += simt ? align128((size_t)(rows / 16) * 16 * L.lds * 4) : 0;
  L.total = off;
  return L;
}

// nrow tiles [rows][dpad] (the block's own rows), nloop tiles [bn][dpad] (streamed), nstats float
// vectors [bn], and the fp32 path's per-warp scratch [16][bn + 4].
struct GenLayout {
  int ldr, ldt, lds;
  size_t row[4], loop[4], stats[4], scratch, total;
};
__host__ __device__ inline GenLayout gen_layout(int elem, int dpad, int rows, int nrow, int bn, int nloop,
                                                int nstats, bool simt) {
  GenLayout L{};
  const TileDim rd = tile_dim(rows, dpad, elem), td = tile_dim(bn, dpad, elem);
  L.ldr = rd.ld;
  L.ldt = td.ld;
  L.lds = bn + 4;
  size_t off = 0;
  for (int i = 0; i < 4; ++i) { L.row[i] = off; off += i < nrow ? rd.bytes : 0; }
  for (int i = 0; i < 4; ++i) { L.loop[i] = off; off += i < nloop ? td.bytes : 0; }
  for (int i = 0; i < 4; ++i) { L.stats[i] = off; off += i < nstats ? align128((size_t)bn * 4) : 0; }
  L.scratch = off; off += simt ? align128((size_t)(rows / 16) * 16 * L.lds * 4) : 0;
  L.total = off;
  return L;
}

template <typename T>
constexpr int jb_bn() { return kSimt<T> ? 16 : 32; }  // keys per tile, query side
constexpr int kJbKvBm = 16;                           // queries per tile, key side

}  // namespace
}  // namespace attention_cuda
}  // namespace condinit
