// Argument checks of the attention ops, shared by the CPU and CUDA registrations: layouts, dtypes,
// devices and the mask arguments.
//
// These guard memory safety only: the kernels index raw pointers by these shapes. Argument
// validation for users (with messages naming the argument) happens once, in condinit.attention /
// attention_jvp, before these ops are called.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <utility>

namespace condinit {
namespace attention_checks {

using at::Tensor;

inline void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, const char* op) {
  TORCH_CHECK(q.dim() == 4, op, ": q must be 4-D [B, H, Nq, d], got ", q.dim(), "-D");
  TORCH_CHECK(k.dim() == 4, op, ": k must be 4-D [B, Hkv, Nk, d], got ", k.dim(), "-D");
  TORCH_CHECK(v.dim() == 4, op, ": v must be 4-D [B, Hkv, Nk, d], got ", v.dim(), "-D");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 || dt == at::kDouble, op,
              ": q must be float32, float16, bfloat16 or float64, got ", dt);
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt, op,
              ": q, k, v must have the same dtype, got ", dt, ", ", k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), op,
              ": q, k, v must be on the same device, got ", q.device(), ", ", k.device(), ", ", v.device());
  TORCH_CHECK(k.sizes() == v.sizes(), op, ": k and v must have the same shape, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.size(0) == q.size(0), op, ": batch size of k (", k.size(0), ") != batch size of q (", q.size(0), ")");
  TORCH_CHECK(k.size(3) == q.size(3), op, ": head dim of k (", k.size(3), ") != head dim of q (", q.size(3), ")");
  TORCH_CHECK(k.size(1) >= 1 && q.size(1) % k.size(1) == 0, op, ": the number of kv heads (", k.size(1),
              ") must divide the number of query heads (", q.size(1), ")");
  TORCH_CHECK(q.size(2) >= 1 && k.size(2) >= 1, op, ": sequence lengths must be >= 1, got Nq=", q.size(2),
              ", Nk=", k.size(2));
  TORCH_CHECK(q.size(3) >= 1, op, ": head dim must be >= 1");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), op,
              ": q, k, v must be contiguous (call .contiguous())");
}

inline void check_tangent(const Tensor& t, const Tensor& primal, const char* name, int64_t P, const char* op) {
  TORCH_CHECK(t.dim() == 5, op, ": ", name, " must be 5-D [P, ", (name[1] == 'q' ? "B, H, Nq" : "B, Hkv, Nk"),
              ", d], got ", t.dim(), "-D");
  TORCH_CHECK(t.scalar_type() == primal.scalar_type(), op, ": ", name, " must have dtype ",
              primal.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == primal.device(), op, ": ", name, " must be on ", primal.device(), ", got ", t.device());
  TORCH_CHECK(t.size(0) == P && t.sizes().slice(1) == primal.sizes(), op, ": ", name, " must have shape [",
              P, ", ", primal.sizes(), "], got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (call .contiguous())");
}

// The kernels index rows and keys by the lens: out-of-range values would read out of bounds.
inline void check_lens_values(const std::optional<Tensor>& lens, int64_t n, const char* name, const char* op) {
  if (!lens) return;
  const int32_t* x = lens->data_ptr<int32_t>();
  for (int64_t b = 0; b < lens->numel(); ++b)
    TORCH_CHECK(x[b] >= 0 && x[b] <= n, op, ": ", name, "[", b, "] = ", x[b], " is not in [0, ", n, "]");
}

// q_lens / kv_lens: None or int32 contiguous [B] on q's device (values are checked by the kernels'
// hosts: reading them here would synchronize a GPU).
inline void check_mask_args(const Tensor& q, const std::optional<Tensor>& q_lens, const std::optional<Tensor>& kv_lens,
                     int64_t window_left, int64_t window_right, const char* op) {
  TORCH_CHECK(window_left >= -1 && window_right >= -1, op, ": window_left and window_right must be >= -1, got ",
              window_left, " and ", window_right);
  for (const auto& [name, lens] : {std::pair<const char*, const std::optional<Tensor>&>{"q_lens", q_lens},
                                   {"kv_lens", kv_lens}}) {
    if (!lens) continue;
    TORCH_CHECK(lens->scalar_type() == at::kInt, op, ": ", name, " must be int32, got ", lens->scalar_type());
    TORCH_CHECK(lens->dim() == 1 && lens->size(0) == q.size(0), op, ": ", name, " must have shape [B] = [",
                q.size(0), "], got ", lens->sizes());
    TORCH_CHECK(lens->device() == q.device(), op, ": ", name, " must be on ", q.device(), ", got ", lens->device());
    TORCH_CHECK(lens->is_contiguous(), op, ": ", name, " must be contiguous");
  }
}

inline void check_jvp_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& tq, const Tensor& tk,
                    const Tensor& tv, const char* op) {
  check_qkv(q, k, v, op);
  TORCH_CHECK(tq.dim() == 5, op, ": tq must be 5-D [P, B, H, Nq, d], got ", tq.dim(), "-D");
  const int64_t P = tq.size(0);
  check_tangent(tq, q, "tq", P, op);
  check_tangent(tk, k, "tk", P, op);
  check_tangent(tv, v, "tv", P, op);
}

inline void check_bwd_args(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                    const Tensor& lse, const char* op) {
  check_qkv(q, k, v, op);
  TORCH_CHECK(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(), op,
              ": dout and out must have the dtype of q (", q.scalar_type(), "), got ", dout.scalar_type(),
              " and ", out.scalar_type());
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), op, ": dout and out must have the shape of q ",
              q.sizes(), ", got ", dout.sizes(), " and ", out.sizes());
  // float32, or float64 for float64 inputs (the CPU kernel's and the reference's lse for them)
  TORCH_CHECK(lse.scalar_type() == at::kFloat || (lse.scalar_type() == at::kDouble && q.scalar_type() == at::kDouble),
              op, ": lse must be float32 (or float64 for float64 inputs), got ", lse.scalar_type(), " for ",
              q.scalar_type(), " inputs");
  TORCH_CHECK(lse.dim() == 3 && lse.sizes() == q.sizes().slice(0, 3), op, ": lse must have shape [B, H, Nq] = ",
              q.sizes().slice(0, 3), ", got ", lse.sizes());
  TORCH_CHECK(dout.device() == q.device() && out.device() == q.device() && lse.device() == q.device(), op,
              ": dout, out, lse must be on ", q.device());
  TORCH_CHECK(dout.is_contiguous() && out.is_contiguous() && lse.is_contiguous(), op,
              ": dout, out, lse must be contiguous (call .contiguous())");
}

inline void check_jvp_bwd_args(const Tensor& gout, const Tensor& gtout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& tq, const Tensor& tk, const Tensor& tv, const Tensor& out, const Tensor& tout,
                        const Tensor& lse, const char* op) {
  check_jvp_args(q, k, v, tq, tk, tv, op);
  const int64_t P = tq.size(0);
  for (const auto& [name, t, like] : {std::tuple<const char*, const Tensor&, const Tensor&>{"gout", gout, q},
                                      {"out", out, q}, {"gtout", gtout, tq}, {"tout", tout, tq}}) {
    TORCH_CHECK(t.scalar_type() == q.scalar_type(), op, ": ", name, " must have the dtype of q (", q.scalar_type(),
                "), got ", t.scalar_type());
    TORCH_CHECK(t.sizes() == like.sizes(), op, ": ", name, " must have shape ", like.sizes(), ", got ", t.sizes());
    TORCH_CHECK(t.device() == q.device(), op, ": ", name, " must be on ", q.device(), ", got ", t.device());
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (call .contiguous())");
  }
  TORCH_CHECK(P >= 1, op, ": the probe count must be >= 1");
  TORCH_CHECK(lse.scalar_type() == at::kFloat || lse.scalar_type() == at::kDouble, op,
              ": lse must be float32 or float64, got ", lse.scalar_type());
  TORCH_CHECK(lse.dim() == 3 && lse.sizes() == q.sizes().slice(0, 3), op, ": lse must have shape [B, H, Nq] = ",
              q.sizes().slice(0, 3), ", got ", lse.sizes());
  TORCH_CHECK(lse.device() == q.device() && lse.is_contiguous(), op, ": lse must be contiguous on ", q.device());
}

inline void check_fwd_args(const Tensor& q, const Tensor& k, const Tensor& v, const char* op) { check_qkv(q, k, v, op); }

}  // namespace attention_checks
}  // namespace condinit
