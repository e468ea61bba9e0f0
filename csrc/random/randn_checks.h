// Argument checks of the condinit_C random ops (philox_randn: shared by its CPU and CUDA
// registrations; the device checks stay with each). check_philox_randn_args returns the number of blocks.
#pragma once
#include <ATen/ATen.h>

namespace condinit {

// The Philox stream arguments every random op takes: seed words, stream, block ids, block shape.
inline void check_philox_stream_args(const char* op, int64_t seed_lo, int64_t seed_hi, int64_t stream,
                                     const at::Tensor& block_ids, int64_t m, int64_t n) {
  constexpr int64_t kU32 = int64_t(1) << 32;
  TORCH_CHECK(0 <= seed_lo && seed_lo < kU32 && 0 <= seed_hi && seed_hi < kU32,
              op, ": seed_lo and seed_hi must be in [0, 2**32)");
  TORCH_CHECK(0 <= stream && stream < kU32, op, ": stream must be in [0, 2**32)");
  TORCH_CHECK(m >= 1 && n >= 1, op, ": m and n must be positive, got ", m, ", ", n);
  TORCH_CHECK((m * n + 3) / 4 <= kU32, op, ": a block holds at most 2**34 elements");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.dim() == 1,
              op, ": block_ids must be a 1-D int64 tensor");
}

inline int64_t check_philox_randn_args(int64_t seed_lo, int64_t seed_hi, int64_t stream,
                                       const at::Tensor& block_ids, int64_t m, int64_t n,
                                       const at::Tensor& out) {
  check_philox_stream_args("philox_randn", seed_lo, seed_hi, stream, block_ids, m, n);
  const int64_t B = block_ids.numel();
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 3 &&
                  out.size(0) == B && out.size(1) == m && out.size(2) == n,
              "philox_randn: out must be a contiguous float32 tensor of shape [", B, ", ", m, ", ", n, "]");
  return B;
}

}  // namespace condinit
