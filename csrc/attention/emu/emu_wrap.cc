// C entry points of the emulated launchers (see run_emu.py). Not part of the extension build (.cc).
// dims = {B, H, Hkv, Nq, Nk, d, causal, window_left, window_right}; q_lens / kv_lens int32 [B] or null.
#include "attention/attention_cuda.h"
#include "attention/cuda/launch.cuh"
using namespace condinit::attention_cuda;

static Shape shape_of(const int64_t* dims, float scale, const int* q_lens, const int* kv_lens) {
  Shape s{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6] != 0, scale};
  s.window_left = dims[7];
  s.window_right = dims[8];
  s.q_lens = q_lens;
  s.kv_lens = kv_lens;
  return s;
}

extern "C" {
int emu_fwd(int dt, const int64_t* dims, float scale, const int* q_lens, const int* kv_lens, const void* q,
            const void* k, const void* v, void* out, float* lse) {
  return fwd((DType)dt, shape_of(dims, scale, q_lens, kv_lens), q, k, v, out, lse, nullptr);
}
int emu_jvp(int dt, const int64_t* dims, float scale, const int* q_lens, const int* kv_lens, int64_t P,
            const void* q, const void* k, const void* v, const void* tq, const void* tk, const void* tv, void* out,
            void* tout, float* lse) {
  return jvp((DType)dt, shape_of(dims, scale, q_lens, kv_lens), P, q, k, v, tq, tk, tv, out, tout, lse, nullptr);
}
int emu_bwd(int dt, const int64_t* dims, float scale, const int* q_lens, const int* kv_lens, const void* dout,
            const void* q, const void* k, const void* v, const float* lse, const float* D, void* dq, void* dk,
            void* dv) {
  return bwd((DType)dt, shape_of(dims, scale, q_lens, kv_lens), dout, q, k, v, lse, D, dq, dk, dv, nullptr);
}
int emu_jvp_bwd_r(int dt, const int64_t* dims, float scale, const int* q_lens, const int* kv_lens, int64_t P,
                  const void* q, const void* k, const void* tq, const void* tk, const float* lse, float* r) {
  return jvp_bwd_r((DType)dt, shape_of(dims, scale, q_lens, kv_lens), P, q, k, tq, tk, lse, r, nullptr);
}
// ptrs: gout, gtout, q, k, v, tq, tk, tv, lse, r, dprime, D, dq, dk, dv, dtq, dtk, dtv
int emu_jvp_bwd(int dt, const int64_t* dims, float scale, const int* q_lens, const int* kv_lens, int64_t P,
                void** ptrs) {
  JvpBwdPointers a{ptrs[0], ptrs[1], ptrs[2], ptrs[3], ptrs[4], ptrs[5], ptrs[6], ptrs[7],
                   (const float*)ptrs[8], (const float*)ptrs[9], (const float*)ptrs[10], (const float*)ptrs[11],
                   ptrs[12], ptrs[13], ptrs[14], ptrs[15], ptrs[16], ptrs[17]};
  return jvp_bwd((DType)dt, shape_of(dims, scale, q_lens, kv_lens), P, a, nullptr);
}
// The mask of the tile at (query q0, key k0) of batch entry b (mask.cuh's tile_mask): ok[qi * nk + kj]
// its element test, the return value whether it calls the [nq x nk] tile full.
int emu_tile_mask(const int64_t* dims, const int* q_lens, const int* kv_lens, int64_t b, int64_t q0, int64_t k0,
                  int nq, int nk, unsigned char* ok) {
  const Geometry g = geometry_of(shape_of(dims, 1.0f, q_lens, kv_lens));
  const TileMask m = tile_mask(g, seq_of(g, b), q0, k0);
  for (int qi = 0; qi < nq; ++qi)
    for (int kj = 0; kj < nk; ++kj) ok[qi * nk + kj] = m.ok(qi, kj);
  return m.full(nq, nk);
}
// kind: a KernelKind (kernel_kind.h); out = {warps, smem_bytes, dpad, cols_per_block, loop_tile}
void emu_plan(int kind, int dt, int64_t d, int64_t smem_limit, int64_t* out) {
  const LaunchPlan p = launch_plan((KernelKind)kind, (DType)dt, d, (size_t)smem_limit);
  out[0] = p.warps;
  out[1] = (int64_t)p.smem_bytes;
  out[2] = p.dpad;
  out[3] = p.cols_per_block;
  out[4] = p.loop_tile;
}
}
