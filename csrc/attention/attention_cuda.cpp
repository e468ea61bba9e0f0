// CUDA registration of condinit_C::attention_{fwd,bwd,jvp,jvp_bwd} (schema: attention.cpp): checks
// the tensors, allocates the outputs with the caching allocator, and calls the launchers of
// attention_cuda.h on the current stream.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>  // not ATen/cuda/CUDAContext.h: it needs cusparse.h, absent from slim toolkits
#include <c10/cuda/CUDAGuard.h>

#include <optional>

#include "attention/attention_checks.h"
#include "attention/attention_cuda.h"

namespace condinit {
namespace attention_cuda {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

DType dtype_of(const Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, op, ": the CUDA kernels take float32, float16 or bfloat16, got ", t.scalar_type());
  }
  return DType::kFloat32;
}

void check_cuda(const Tensor& q, const char* op) {
  TORCH_CHECK(q.is_cuda(), op, ": expected CUDA tensors, got ", q.device());
  TORCH_CHECK(head_dim_supported(q.size(3)), op, ": head dim ", q.size(3), " is not supported by the CUDA kernels (1..",
              kMaxHeadDim, ")");
  dtype_of(q, op);
}

// The kernels read 16-byte vectors; a contiguous tensor with an odd storage offset gets copied.
Tensor aligned(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone(at::MemoryFormat::Contiguous);
}

// The lens' values are not read here (that would synchronize): the public function validates them,
// and the kernels clamp them to [0, N].
Shape shape_of(const Tensor& q, const Tensor& k, bool causal, double scale, int64_t window_left,
               int64_t window_right, const OptTensor& q_lens, const OptTensor& kv_lens) {
  Shape s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), causal, (float)scale};
  s.window_left = window_left;
  s.window_right = window_right;
  s.q_lens = q_lens ? q_lens->data_ptr<int32_t>() : nullptr;
  s.kv_lens = kv_lens ? kv_lens->data_ptr<int32_t>() : nullptr;
  return s;
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err != cudaErrorNotSupported, op,
              ": the CUDA kernels need sm_80 or newer for float16 / bfloat16 (mma.sync); use float32 or "
              "another backend");
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

std::tuple<Tensor, Tensor> attention_fwd_cuda(const Tensor& q_, const Tensor& k_, const Tensor& v_, bool causal,
                                              double scale, int64_t window_left, int64_t window_right,
                                              const OptTensor& q_lens, const OptTensor& kv_lens) {
  const char* op = "attention_fwd";
  attention_checks::check_fwd_args(q_, k_, v_, op);
  attention_checks::check_mask_args(q_, q_lens, kv_lens, window_left, window_right, op);
  check_cuda(q_, op);
  c10::cuda::CUDAGuard guard(q_.device());
  Tensor q = aligned(q_), k = aligned(k_), v = aligned(v_);
  Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (q.numel() == 0) return {out, lse};
  check_launch(fwd(dtype_of(q, op), shape_of(q, k, causal, scale, window_left, window_right, q_lens, kv_lens),
                   q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr<float>(),
                   c10::cuda::getCurrentCUDAStream()),
               op);
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_jvp_cuda(const Tensor& q_, const Tensor& k_, const Tensor& v_,
                                                      const Tensor& tq_, const Tensor& tk_, const Tensor& tv_,
                                                      bool causal, double scale, int64_t window_left,
                                                      int64_t window_right, const OptTensor& q_lens,
                                                      const OptTensor& kv_lens) {
  const char* op = "attention_jvp";
  attention_checks::check_jvp_args(q_, k_, v_, tq_, tk_, tv_, op);
  attention_checks::check_mask_args(q_, q_lens, kv_lens, window_left, window_right, op);
  check_cuda(q_, op);
  c10::cuda::CUDAGuard guard(q_.device());
  Tensor q = aligned(q_), k = aligned(k_), v = aligned(v_);
  Tensor tq = aligned(tq_), tk = aligned(tk_), tv = aligned(tv_);
  const int64_t P = tq.size(0);
  Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  Tensor tout = at::empty_like(tq, at::MemoryFormat::Contiguous);
  Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (q.numel() == 0) return {out, tout, lse};
  const Shape s = shape_of(q, k, causal, scale, window_left, window_right, q_lens, kv_lens);
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (P == 0) {
    check_launch(fwd(dtype_of(q, op), s, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                     lse.data_ptr<float>(), stream),
                 op);
    return {out, tout, lse};
  }
  check_launch(jvp(dtype_of(q, op), s, P, q.data_ptr(), k.data_ptr(), v.data_ptr(), tq.data_ptr(), tk.data_ptr(),
                   tv.data_ptr(), out.data_ptr(), tout.data_ptr(), lse.data_ptr<float>(), stream),
               op);
  return {out, tout, lse};
}

// Deterministic: dq, dk, dv are each written by one block per tile, no atomics.
std::tuple<Tensor, Tensor, Tensor> attention_bwd_cuda(const Tensor& dout_, const Tensor& q_, const Tensor& k_,
                                                      const Tensor& v_, const Tensor& out_, const Tensor& lse_,
                                                      bool causal, double scale, int64_t window_left,
                                                      int64_t window_right, const OptTensor& q_lens,
                                                      const OptTensor& kv_lens) {
  const char* op = "attention_bwd";
  attention_checks::check_bwd_args(dout_, q_, k_, v_, out_, lse_, op);
  attention_checks::check_mask_args(q_, q_lens, kv_lens, window_left, window_right, op);
  check_cuda(q_, op);
  c10::cuda::CUDAGuard guard(q_.device());
  Tensor dout = aligned(dout_), q = aligned(q_), k = aligned(k_), v = aligned(v_);
  Tensor dq = at::empty_like(q, at::MemoryFormat::Contiguous);
  Tensor dk = at::empty_like(k, at::MemoryFormat::Contiguous), dv = at::empty_like(v, at::MemoryFormat::Contiguous);
  if (q.numel() == 0) return {dq, dk, dv};
  Tensor Dvec = (dout.to(at::kFloat) * out_.to(at::kFloat)).sum(-1).contiguous();  // D = rowsum(dO o O)
  Tensor lse = lse_.contiguous();
  check_launch(bwd(dtype_of(q, op), shape_of(q, k, causal, scale, window_left, window_right, q_lens, kv_lens),
                   dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), lse.data_ptr<float>(),
                   Dvec.data_ptr<float>(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                   c10::cuda::getCurrentCUDAStream()),
               op);
  return {dq, dk, dv};
}

// Gradients of a loss on (out, tout) w.r.t. q, k, v and the tangents (attention_cuda.h, jvp_bwd):
// r from a kernel, the row statistics D and d' here, then the two gradient kernels. Deterministic.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> attention_jvp_bwd_cuda(
    const Tensor& gout_, const Tensor& gtout_, const Tensor& q_, const Tensor& k_, const Tensor& v_,
    const Tensor& tq_, const Tensor& tk_, const Tensor& tv_, const Tensor& out_, const Tensor& tout_,
    const Tensor& lse_, bool causal, double scale, int64_t window_left, int64_t window_right,
    const OptTensor& q_lens, const OptTensor& kv_lens) {
  const char* op = "attention_jvp_bwd";
  attention_checks::check_jvp_bwd_args(gout_, gtout_, q_, k_, v_, tq_, tk_, tv_, out_, tout_, lse_, op);
  attention_checks::check_mask_args(q_, q_lens, kv_lens, window_left, window_right, op);
  check_cuda(q_, op);
  TORCH_CHECK(lse_.scalar_type() == at::kFloat, op, ": lse must be float32 for the CUDA kernels, got ",
              lse_.scalar_type());
  c10::cuda::CUDAGuard guard(q_.device());
  Tensor gout = aligned(gout_), gtout = aligned(gtout_), q = aligned(q_), k = aligned(k_), v = aligned(v_);
  Tensor tq = aligned(tq_), tk = aligned(tk_), tv = aligned(tv_);
  const int64_t P = tq.size(0);
  Tensor dq = at::empty_like(q, at::MemoryFormat::Contiguous), dk = at::empty_like(k, at::MemoryFormat::Contiguous);
  Tensor dv = at::empty_like(v, at::MemoryFormat::Contiguous);
  Tensor dtq = at::empty_like(tq, at::MemoryFormat::Contiguous), dtk = at::empty_like(tk, at::MemoryFormat::Contiguous);
  Tensor dtv = at::empty_like(tv, at::MemoryFormat::Contiguous);
  if (q.numel() == 0) return {dq, dk, dv, dtq, dtk, dtv};
  const Shape s = shape_of(q, k, causal, scale, window_left, window_right, q_lens, kv_lens);
  const DType dt = dtype_of(q, op);
  auto stream = c10::cuda::getCurrentCUDAStream();
  Tensor lse = lse_.contiguous();
  Tensor r = at::empty({P, q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  check_launch(jvp_bwd_r(dt, s, P, q.data_ptr(), k.data_ptr(), tq.data_ptr(), tk.data_ptr(), lse.data_ptr<float>(),
                         r.data_ptr<float>(), stream),
               op);
  // d'_p = rowsum(gO'_p o O), D = rowsum(gO o O) + sum_p (rowsum(gO'_p o O'_p) - r_p d'_p).
  const Tensor out = out_.to(at::kFloat), gtout_f = gtout.to(at::kFloat);
  Tensor dprime = (gtout_f * out.unsqueeze(0)).sum(-1).contiguous();
  Tensor D = ((gout.to(at::kFloat) * out).sum(-1) + ((gtout_f * tout_.to(at::kFloat)).sum(-1) - r * dprime).sum(0))
                 .contiguous();
  const JvpBwdPointers a{gout.data_ptr(), gtout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                         tq.data_ptr(), tk.data_ptr(), tv.data_ptr(), lse.data_ptr<float>(), r.data_ptr<float>(),
                         dprime.data_ptr<float>(), D.data_ptr<float>(), dq.data_ptr(), dk.data_ptr(),
                         dv.data_ptr(), dtq.data_ptr(), dtk.data_ptr(), dtv.data_ptr()};
  check_launch(jvp_bwd(dt, s, P, a, stream), op);
  return {dq, dk, dv, dtq, dtk, dtv};
}

}  // namespace
}  // namespace attention_cuda
}  // namespace condinit

TORCH_LIBRARY_IMPL(condinit_C, CUDA, m) {
  m.impl("attention_fwd", &condinit::attention_cuda::attention_fwd_cuda);
  m.impl("attention_bwd", &condinit::attention_cuda::attention_bwd_cuda);
  m.impl("attention_jvp", &condinit::attention_cuda::attention_jvp_cuda);
  m.impl("attention_jvp_bwd", &condinit::attention_cuda::attention_jvp_bwd_cuda);
}
