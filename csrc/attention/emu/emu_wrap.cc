// C entry points of the emulated launchers (see run_emu.py). Not part of the extension build (.cc).
#include "attention_cuda.h"
using namespace condinit::attention_cuda;
extern "C" {
int emu_fwd(int dt, int64_t B, int64_t H, int64_t Hkv, int64_t Nq, int64_t Nk, int64_t d, int causal, float scale,
            const void* q, const void* k, const void* v, void* out, float* lse) {
  Shape s{B, H, Hkv, Nq, Nk, d, causal != 0, scale};
  return fwd((DType)dt, s, q, k, v, out, lse, nullptr);
}
int64_t emu_ws(int64_t B, int64_t H, int64_t Hkv, int64_t Nq, int64_t Nk, int64_t d, int64_t P) {
  Shape s{B, H, Hkv, Nq, Nk, d, false, 1.f};
  return jvp_workspace_floats(s, P);
}
int emu_jvp(int dt, int64_t B, int64_t H, int64_t Hkv, int64_t Nq, int64_t Nk, int64_t d, int causal, float scale,
            int64_t P, const void* q, const void* k, const void* v, const void* tq, const void* tk, const void* tv,
            void* out, void* tout, float* lse, float* ws) {
  Shape s{B, H, Hkv, Nq, Nk, d, causal != 0, scale};
  return jvp((DType)dt, s, P, q, k, v, tq, tk, tv, out, tout, lse, ws, nullptr);
}
int emu_bwd(int dt, int64_t B, int64_t H, int64_t Hkv, int64_t Nq, int64_t Nk, int64_t d, int causal, float scale,
            const void* dout, const void* q, const void* k, const void* v, const float* lse, const float* D,
            float* dq_acc, void* dk, void* dv) {
  Shape s{B, H, Hkv, Nq, Nk, d, causal != 0, scale};
  return bwd((DType)dt, s, dout, q, k, v, lse, D, dq_acc, dk, dv, nullptr);
}
}
