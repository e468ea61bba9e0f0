// Launcher of the CUDA kernel of condinit_C::philox_randn (randn_kernels.cu); light header, no torch.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace condinit {

// out[b, e] for b < n_blocks, e < mn: lane e % 4 of Philox4x32-10(counter = (e / 4, stream, lo32(g),
// hi32(g)), key = (seed_lo, seed_hi)), g = block_ids[b], through the Box-Muller transform of
// philox.h. block_ids and out are device pointers; out is contiguous [n_blocks, mn] float32.
// Returns the launch's error code.
cudaError_t philox_randn_cuda_launch(uint32_t seed_lo, uint32_t seed_hi, uint32_t stream, const int64_t* block_ids,
                                     int64_t n_blocks, int64_t mn, float* out, cudaStream_t cuda_stream);

}  // namespace condinit
