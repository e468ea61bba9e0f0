// CUDA kernel of condinit_C::philox_randn: counter-based standard normals, bitwise identical to
// the C++ CPU kernel and the PyTorch reference (math in philox.h: __fmul_rn / __fadd_rn /
// __fsqrt_rn, which nvcc never contracts or approximates, even under --use_fast_math).
//
// Grid: x covers the quads of one block (grid-stride), y covers the blocks (grid-stride), so no
// 64-bit division per element. Each thread runs one Philox4x32-10 and writes its 4 normals with
// one 16-byte store when the block size is a multiple of 4 and out is 16-byte aligned.
#include "random/randn_cuda.h"
#include "random/philox.h"

namespace condinit {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) philox_randn_kernel(uint32_t seed_lo, uint32_t seed_hi, uint32_t stream,
                                                                  const int64_t* __restrict__ block_ids,
                                                                  int64_t n_blocks, int64_t mn, bool vec4,
                                                                  float* __restrict__ out) {
  const int64_t n_quads = (mn + 3) / 4;
  for (int64_t b = blockIdx.y; b < n_blocks; b += gridDim.y) {
    const uint64_t g = (uint64_t)block_ids[b];
    float* blk = out + b * mn;
    for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < n_quads;
         q += (int64_t)gridDim.x * blockDim.x) {
      uint32_t c0 = (uint32_t)q, c1 = stream, c2 = (uint32_t)g, c3 = (uint32_t)(g >> 32);
      philox::philox4x32_10(c0, c1, c2, c3, seed_lo, seed_hi);
      float4 z;
      philox::box_muller(c0, c1, &z.x, &z.y);
      philox::box_muller(c2, c3, &z.z, &z.w);
      const int64_t e = 4 * q;
      if (vec4) {
        *reinterpret_cast<float4*>(blk + e) = z;
      } else {
        blk[e] = z.x;
        if (e + 1 < mn) blk[e + 1] = z.y;
        if (e + 2 < mn) blk[e + 2] = z.z;
        if (e + 3 < mn) blk[e + 3] = z.w;
      }
    }
  }
}

}  // namespace

cudaError_t philox_randn_cuda_launch(uint32_t seed_lo, uint32_t seed_hi, uint32_t stream, const int64_t* block_ids,
                                     int64_t n_blocks, int64_t mn, float* out, cudaStream_t cuda_stream) {
  if (n_blocks <= 0 || mn <= 0) return cudaSuccess;
  const int64_t n_quads = (mn + 3) / 4;
  int device = 0, n_sm = 132;
  if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, device);
  // enough CTAs to fill the GPU a few times over; the rest is grid-stride
  const int64_t want = (int64_t)n_sm * 8;
  int64_t gx = (n_quads + kThreads - 1) / kThreads;
  if (gx > want) gx = want;
  int64_t gy = (want + gx - 1) / gx;
  if (gy > n_blocks) gy = n_blocks;
  if (gy > 65535) gy = 65535;
  // 16-byte stores when every quad of every block starts on a 16-byte boundary
  const bool vec4 = (mn % 4 == 0) && (reinterpret_cast<uintptr_t>(out) % 16 == 0);
  philox_randn_kernel<<<dim3((unsigned)gx, (unsigned)gy), kThreads, 0, cuda_stream>>>(
      seed_lo, seed_hi, stream, block_ids, n_blocks, mn, vec4, out);
  return cudaGetLastError();
}

}  // namespace condinit
