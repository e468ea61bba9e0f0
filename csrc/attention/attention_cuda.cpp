// CUDA registration of condinit_C::attention_{fwd,bwd,jvp} (schema in attention_cpu.cpp): checks the
// tensors, allocates outputs and fp32 scratch with the caching allocator, and calls the launchers of
// attention_kernels.cu on the current stream (the .cu has another name than this file: both would
// compile to attention_cuda.o).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>  // not ATen/cuda/CUDAContext.h: it needs cusparse.h, absent from slim toolkits
#include <c10/cuda/CUDAGuard.h>

#include "attention_cuda.h"

namespace condinit {
namespace attention_cpu {
// Shared argument checks (attention_cpu.cpp).
void check_fwd_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* op);
void check_jvp_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tq,
                    const at::Tensor& tk, const at::Tensor& tv, const char* op);
void check_bwd_args(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& out, const at::Tensor& lse, const char* op);
}  // namespace attention_cpu

namespace attention_cuda {
namespace {

using at::Tensor;

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
  TORCH_CHECK(head_dim_supported(q.size(3)), op, ": head dim ", q.size(3),
              " is not supported by the CUDA kernels (supported: 16, 32, 64, 80, 96, 128, 256)");
  dtype_of(q, op);
}

// The kernels read 16-byte vectors; a contiguous tensor with an odd storage offset gets copied.
Tensor aligned(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone(at::MemoryFormat::Contiguous);
}

Shape shape_of(const Tensor& q, const Tensor& k, bool causal, double scale) {
  return Shape{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), causal, (float)scale};
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

std::tuple<Tensor, Tensor> attention_fwd_cuda(const Tensor& q_, const Tensor& k_, const Tensor& v_, bool causal,
                                              double scale) {
  const char* op = "attention_fwd";
  attention_cpu::check_fwd_args(q_, k_, v_, op);
  check_cuda(q_, op);
  c10::cuda::CUDAGuard guard(q_.device());
  Tensor q = aligned(q_), k = aligned(k_), v = aligned(v_);
  Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (q.numel() == 0) return {out, lse};
  check_launch(fwd(dtype_of(q, op), shape_of(q, k, causal, scale), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                   out.data_ptr(), lse.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()),
               op);
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_jvp_cuda(const Tensor& q_, const Tensor& k_, const Tensor& v_,
                                                      const Tensor& tq_, const Tensor& tk_, const Tensor& tv_,
                                                      bool causal, double scale) {
  const char* op = "attention_jvp";
  attention_cpu::check_jvp_args(q_, k_, v_, tq_, tk_, tv_, op);
  check_cuda(q_, op);
  c10::cuda::CUDAGuard guard(q_.device());
  Tensor q = aligned(q_), k = aligned(k_), v = aligned(v_);
  Tensor tq = aligned(tq_), tk = aligned(tk_), tv = aligned(tv_);
  const int64_t P = tq.size(0);
  Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  Tensor tout = at::empty_like(tq, at::MemoryFormat::Contiguous);
  Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (q.numel() == 0) return {out, tout, lse};
  const Shape s = shape_of(q, k, causal, scale);
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (P == 0) {
    check_launch(fwd(dtype_of(q, op), s, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                     lse.data_ptr<float>(), stream),
                 op);
    return {out, tout, lse};
  }
  Tensor ws = at::empty({jvp_workspace_floats(s, P)}, q.options().dtype(at::kFloat));
  check_launch(jvp(dtype_of(q, op), s, P, q.data_ptr(), k.data_ptr(), v.data_ptr(), tq.data_ptr(), tk.data_ptr(),
                   tv.data_ptr(), out.data_ptr(), tout.data_ptr(), lse.data_ptr<float>(), ws.data_ptr<float>(),
                   stream),
               op);
  return {out, tout, lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_bwd_cuda(const Tensor& dout_, const Tensor& q_, const Tensor& k_,
                                                      const Tensor& v_, const Tensor& out_, const Tensor& lse_,
                                                      bool causal, double scale) {
  const char* op = "attention_bwd";
  attention_cpu::check_bwd_args(dout_, q_, k_, v_, out_, lse_, op);
  check_cuda(q_, op);
  c10::cuda::CUDAGuard guard(q_.device());
  Tensor dout = aligned(dout_), q = aligned(q_), k = aligned(k_), v = aligned(v_);
  Tensor dq_acc = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
  Tensor dk = at::empty_like(k, at::MemoryFormat::Contiguous), dv = at::empty_like(v, at::MemoryFormat::Contiguous);
  if (q.numel() == 0) return {dq_acc.to(q.scalar_type()), dk, dv};
  Tensor Dvec = (dout.to(at::kFloat) * out_.to(at::kFloat)).sum(-1).contiguous();  // D = rowsum(dO o O)
  Tensor lse = lse_.contiguous();
  check_launch(bwd(dtype_of(q, op), shape_of(q, k, causal, scale), dout.data_ptr(), q.data_ptr(), k.data_ptr(),
                   v.data_ptr(), lse.data_ptr<float>(), Dvec.data_ptr<float>(), dq_acc.data_ptr<float>(),
                   dk.data_ptr(), dv.data_ptr(), c10::cuda::getCurrentCUDAStream()),
               op);
  return {dq_acc.to(q.scalar_type()), dk, dv};
}

}  // namespace
}  // namespace attention_cuda
}  // namespace condinit

TORCH_LIBRARY_IMPL(condinit_C, CUDA, m) {
  m.impl("attention_fwd", &condinit::attention_cuda::attention_fwd_cuda);
  m.impl("attention_bwd", &condinit::attention_cuda::attention_bwd_cuda);
  m.impl("attention_jvp", &condinit::attention_cuda::attention_jvp_cuda);
}
