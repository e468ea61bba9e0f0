// The torch.library schema of condinit_C::attention_{fwd,bwd,jvp,jvp_bwd} and their Meta kernels
// (shapes only); the CPU kernels are in attention_cpu.cpp, the CUDA ones behind attention_cuda.cpp.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "attention/attention_checks.h"

namespace condinit {
namespace attention {
namespace {

using at::Tensor;

// Shapes only, for torch.compile / FakeTensor tracing.
using OptT = std::optional<Tensor>;

// The lse the kernels return: float32, float64 for float64 inputs (the CPU kernel computes those in
// float64; the CUDA kernels refuse them).
Tensor lse_like(const Tensor& q) {
  return at::empty({q.size(0), q.size(1), q.size(2)},
                   q.options().dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
}

std::tuple<Tensor, Tensor> attention_fwd_meta(const Tensor& q, const Tensor& k, const Tensor& v, bool, double,
                                              int64_t wl, int64_t wr, const OptT& ql, const OptT& kl) {
  attention_checks::check_fwd_args(q, k, v, "attention_fwd");
  attention_checks::check_mask_args(q, ql, kl, wl, wr, "attention_fwd");
  return {at::empty_like(q), lse_like(q)};
}

std::tuple<Tensor, Tensor, Tensor> attention_jvp_meta(const Tensor& q, const Tensor& k, const Tensor& v,
                                                      const Tensor& tq, const Tensor& tk, const Tensor& tv, bool,
                                                      double, int64_t wl, int64_t wr, const OptT& ql,
                                                      const OptT& kl) {
  attention_checks::check_jvp_args(q, k, v, tq, tk, tv, "attention_jvp");
  attention_checks::check_mask_args(q, ql, kl, wl, wr, "attention_jvp");
  return {at::empty_like(q), at::empty_like(tq), lse_like(q)};
}

std::tuple<Tensor, Tensor, Tensor> attention_bwd_meta(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                      const Tensor& v, const Tensor& out, const Tensor& lse, bool,
                                                      double, int64_t wl, int64_t wr, const OptT& ql,
                                                      const OptT& kl) {
  attention_checks::check_bwd_args(dout, q, k, v, out, lse, "attention_bwd");
  attention_checks::check_mask_args(q, ql, kl, wl, wr, "attention_bwd");
  return {at::empty_like(q), at::empty_like(k), at::empty_like(v)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> attention_jvp_bwd_meta(
    const Tensor& gout, const Tensor& gtout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& tq,
    const Tensor& tk, const Tensor& tv, const Tensor& out, const Tensor& tout, const Tensor& lse, bool, double,
    int64_t wl, int64_t wr, const OptT& ql, const OptT& kl) {
  attention_checks::check_jvp_bwd_args(gout, gtout, q, k, v, tq, tk, tv, out, tout, lse, "attention_jvp_bwd");
  attention_checks::check_mask_args(q, ql, kl, wl, wr, "attention_jvp_bwd");
  return {at::empty_like(q), at::empty_like(k), at::empty_like(v),
          at::empty_like(tq), at::empty_like(tk), at::empty_like(tv)};
}

}  // namespace
}  // namespace attention
}  // namespace condinit

TORCH_LIBRARY_FRAGMENT(condinit_C, m) {
  // The mask arguments (docs/design.md, "Attention") follow causal, scale in every op.
  m.def("attention_fwd(Tensor q, Tensor k, Tensor v, bool causal, float scale, int window_left, "
        "int window_right, Tensor? q_lens, Tensor? kv_lens) -> (Tensor, Tensor)");
  m.def("attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
        "float scale, int window_left, int window_right, Tensor? q_lens, Tensor? kv_lens) -> (Tensor, Tensor, Tensor)");
  m.def("attention_jvp(Tensor q, Tensor k, Tensor v, Tensor tq, Tensor tk, Tensor tv, bool causal, "
        "float scale, int window_left, int window_right, Tensor? q_lens, Tensor? kv_lens) -> (Tensor, Tensor, Tensor)");
  m.def("attention_jvp_bwd(Tensor gout, Tensor gtout, Tensor q, Tensor k, Tensor v, Tensor tq, Tensor tk, "
        "Tensor tv, Tensor out, Tensor tout, Tensor lse, bool causal, float scale, int window_left, "
        "int window_right, Tensor? q_lens, Tensor? kv_lens) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(condinit_C, Meta, m) {
  m.impl("attention_fwd", &condinit::attention::attention_fwd_meta);
  m.impl("attention_bwd", &condinit::attention::attention_bwd_meta);
  m.impl("attention_jvp", &condinit::attention::attention_jvp_meta);
  m.impl("attention_jvp_bwd", &condinit::attention::attention_jvp_bwd_meta);
}
