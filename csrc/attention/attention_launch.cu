// Launchers of the CUDA attention kernels (attention_cuda.h): fwd and jvp (fwd_kernel.cuh), bwd (the
// dq kernel, then the dk/dv kernel; bwd_kernel.cuh), jvp_bwd_r and jvp_bwd (the r kernel, then the
// query-side and key-side gradient kernels; jvp_bwd_kernel.cuh). Every kernel is compiled in this one
// translation unit: nvcc's inlining and scheduling of the kernels depend on the unit they share.
#include "attention/attention_cuda.h"
#include "attention/cuda/fwd_kernel.cuh"
#include "attention/cuda/bwd_kernel.cuh"
#include "attention/cuda/jvp_bwd_kernel.cuh"
#include "attention/cuda/launch.cuh"

namespace condinit {
namespace attention_cuda {
namespace {

template <typename T>
cudaError_t launch_fwd(DType dt, const Shape& s, int64_t P, const void* q, const void* k, const void* v,
                       const void* tq, const void* tk, const void* tv, void* out, void* tout, float* lse,
                       cudaStream_t stream) {
  const Geometry g = geometry_of(s);
  const bool jvp = P > 0;
  LaunchPlan plan;
  dim3 grid;
  cudaError_t err = plan_launch(jvp ? KernelKind::kJvp : KernelKind::kFwd, dt, s, s.Nq, s.B * s.H, (int64_t)g.nchunks * (jvp ? P : 1), plan, grid);
  if (err != cudaSuccess) return err;
  FwdParams<T> p;
  p.g = g;
  p.q = static_cast<const T*>(q);
  p.k = static_cast<const T*>(k);
  p.v = static_cast<const T*>(v);
  p.tq = static_cast<const T*>(tq);
  p.tk = static_cast<const T*>(tk);
  p.tv = static_cast<const T*>(tv);
  p.out = static_cast<T*>(out);
  p.tout = static_cast<T*>(tout);
  p.lse = lse;
  if (jvp) {
    void (*kernel)(const FwdParams<T>) = attention_fwd_kernel<T, true>;
    if ((err = set_smem(kernel, plan.smem_bytes)) != cudaSuccess) return err;
    CONDINIT_LAUNCH(kernel, grid, 32 * plan.warps, plan.smem_bytes, stream, p);
  } else {
    void (*kernel)(const FwdParams<T>) = attention_fwd_kernel<T, false>;
    if ((err = set_smem(kernel, plan.smem_bytes)) != cudaSuccess) return err;
    CONDINIT_LAUNCH(kernel, grid, 32 * plan.warps, plan.smem_bytes, stream, p);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd(DType dt, const Shape& s, const void* dout, const void* q, const void* k, const void* v,
                       const float* lse, const float* Dvec, void* dq, void* dk, void* dv, cudaStream_t stream) {
  const Geometry g = geometry_of(s);
  BwdParams<T> p;
  p.g = g;
  p.dout = static_cast<const T*>(dout);
  p.q = static_cast<const T*>(q);
  p.k = static_cast<const T*>(k);
  p.v = static_cast<const T*>(v);
  p.lse = lse;
  p.Dvec = Dvec;
  p.dq = static_cast<T*>(dq);
  p.dk = static_cast<T*>(dk);
  p.dv = static_cast<T*>(dv);
  LaunchPlan plan;
  dim3 grid;
  cudaError_t err = plan_launch(KernelKind::kDq, dt, s, s.Nq, s.B * s.H, g.nchunks, plan, grid);
  if (err != cudaSuccess) return err;
  void (*dq_kernel)(const BwdParams<T>) = attention_dq_kernel<T>;
  if ((err = set_smem(dq_kernel, plan.smem_bytes)) != cudaSuccess) return err;
  CONDINIT_LAUNCH(dq_kernel, grid, 32 * plan.warps, plan.smem_bytes, stream, p);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if ((err = plan_launch(KernelKind::kDkdv, dt, s, s.Nk, s.B * s.Hkv, g.nchunks, plan, grid)) != cudaSuccess) return err;
  void (*dkdv_kernel)(const BwdParams<T>) = attention_dkdv_kernel<T>;
  if ((err = set_smem(dkdv_kernel, plan.smem_bytes)) != cudaSuccess) return err;
  CONDINIT_LAUNCH(dkdv_kernel, grid, 32 * plan.warps, plan.smem_bytes, stream, p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_jvp_bwd_r(DType dt, const Shape& s, int64_t P, const void* q, const void* k, const void* tq,
                             const void* tk, const float* lse, float* r, cudaStream_t stream) {
  JvpBwdParams<T> p{};
  p.g = geometry_of(s);
  p.P = P;
  p.q = static_cast<const T*>(q);
  p.k = static_cast<const T*>(k);
  p.tq = static_cast<const T*>(tq);
  p.tk = static_cast<const T*>(tk);
  p.lse = lse;
  p.r_out = r;
  LaunchPlan plan;
  dim3 grid;
  cudaError_t err = plan_launch(KernelKind::kJvpBwdR, dt, s, s.Nq, s.B * s.H, P, plan, grid);
  if (err != cudaSuccess) return err;
  void (*kernel)(const JvpBwdParams<T>) = attention_jvp_r_kernel<T>;
  if ((err = set_smem(kernel, plan.smem_bytes)) != cudaSuccess) return err;
  CONDINIT_LAUNCH(kernel, grid, 32 * plan.warps, plan.smem_bytes, stream, p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_jvp_bwd(DType dt, const Shape& s, int64_t P, const JvpBwdPointers& a, cudaStream_t stream) {
  JvpBwdParams<T> p{};
  p.g = geometry_of(s);
  p.P = P;
  p.gout = static_cast<const T*>(a.gout);
  p.gtout = static_cast<const T*>(a.gtout);
  p.q = static_cast<const T*>(a.q);
  p.k = static_cast<const T*>(a.k);
  p.v = static_cast<const T*>(a.v);
  p.tq = static_cast<const T*>(a.tq);
  p.tk = static_cast<const T*>(a.tk);
  p.tv = static_cast<const T*>(a.tv);
  p.lse = a.lse;
  p.r = a.r;
  p.dprime = a.dprime;
  p.D = a.D;
  p.dq = static_cast<T*>(a.dq);
  p.dk = static_cast<T*>(a.dk);
  p.dv = static_cast<T*>(a.dv);
  p.dtq = static_cast<T*>(a.dtq);
  p.dtk = static_cast<T*>(a.dtk);
  p.dtv = static_cast<T*>(a.dtv);
  LaunchPlan plan;
  dim3 grid;
  cudaError_t err = plan_launch(KernelKind::kJvpBwdQ, dt, s, s.Nq, s.B * s.H, (1 + P) * p.g.nchunks, plan, grid);
  if (err != cudaSuccess) return err;
  void (*q_kernel)(const JvpBwdParams<T>) = attention_jvp_bwd_q_kernel<T>;
  if ((err = set_smem(q_kernel, plan.smem_bytes)) != cudaSuccess) return err;
  CONDINIT_LAUNCH(q_kernel, grid, 32 * plan.warps, plan.smem_bytes, stream, p);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if ((err = plan_launch(KernelKind::kJvpBwdKv, dt, s, s.Nk, s.B * s.Hkv, (1 + P) * p.g.nchunks, plan, grid)) != cudaSuccess) return err;
  void (*kv_kernel)(const JvpBwdParams<T>) = attention_jvp_bwd_kv_kernel<T>;
  if ((err = set_smem(kv_kernel, plan.smem_bytes)) != cudaSuccess) return err;
  CONDINIT_LAUNCH(kv_kernel, grid, 32 * plan.warps, plan.smem_bytes, stream, p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t fwd(DType dtype, const Shape& s, const void* q, const void* k, const void* v, void* out, float* lse,
                cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      return launch_fwd<float>(dtype, s, 0, q, k, v, nullptr, nullptr, nullptr, out, nullptr, lse, stream);
    case DType::kFloat16:
      return launch_fwd<__half>(dtype, s, 0, q, k, v, nullptr, nullptr, nullptr, out, nullptr, lse, stream);
    case DType::kBFloat16:
      return launch_fwd<__nv_bfloat16>(dtype, s, 0, q, k, v, nullptr, nullptr, nullptr, out, nullptr, lse, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t jvp(DType dtype, const Shape& s, int64_t P, const void* q, const void* k, const void* v, const void* tq,
                const void* tk, const void* tv, void* out, void* tout, float* lse, cudaStream_t stream) {
  if (P < 1) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32:
      return launch_fwd<float>(dtype, s, P, q, k, v, tq, tk, tv, out, tout, lse, stream);
    case DType::kFloat16:
      return launch_fwd<__half>(dtype, s, P, q, k, v, tq, tk, tv, out, tout, lse, stream);
    case DType::kBFloat16:
      return launch_fwd<__nv_bfloat16>(dtype, s, P, q, k, v, tq, tk, tv, out, tout, lse, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t bwd(DType dtype, const Shape& s, const void* dout, const void* q, const void* k, const void* v,
                const float* lse, const float* Dvec, void* dq, void* dk, void* dv, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      return launch_bwd<float>(dtype, s, dout, q, k, v, lse, Dvec, dq, dk, dv, stream);
    case DType::kFloat16:
      return launch_bwd<__half>(dtype, s, dout, q, k, v, lse, Dvec, dq, dk, dv, stream);
    case DType::kBFloat16:
      return launch_bwd<__nv_bfloat16>(dtype, s, dout, q, k, v, lse, Dvec, dq, dk, dv, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t jvp_bwd_r(DType dtype, const Shape& s, int64_t P, const void* q, const void* k, const void* tq,
                      const void* tk, const float* lse, float* r, cudaStream_t stream) {
  if (P < 1) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32: return launch_jvp_bwd_r<float>(dtype, s, P, q, k, tq, tk, lse, r, stream);
    case DType::kFloat16: return launch_jvp_bwd_r<__half>(dtype, s, P, q, k, tq, tk, lse, r, stream);
    case DType::kBFloat16: return launch_jvp_bwd_r<__nv_bfloat16>(dtype, s, P, q, k, tq, tk, lse, r, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t jvp_bwd(DType dtype, const Shape& s, int64_t P, const JvpBwdPointers& a, cudaStream_t stream) {
  if (P < 1) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32: return launch_jvp_bwd<float>(dtype, s, P, a, stream);
    case DType::kFloat16: return launch_jvp_bwd<__half>(dtype, s, P, a, stream);
    case DType::kBFloat16: return launch_jvp_bwd<__nv_bfloat16>(dtype, s, P, a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace attention_cuda
}  // namespace condinit
