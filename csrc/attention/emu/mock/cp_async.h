// Emulated cp.async of sm_80 (PTX ISA, "cp.async", "cp.async.commit_group", "cp.async.wait_group"):
// a 16-byte global-to-shared copy that may complete at any time between its issue and the
// wait_group that covers its group. The emulation makes the chunk undefined at issue (0xFF bytes:
// NaN as fp32, fp16 and bf16) and writes the data at that wait_group, so a read before the wait (a
// missing wait) or a copy issued into a buffer other warps still read (a missing barrier) gives NaN.
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>

#include "cuda_runtime.h"

// cp.async.cg.shared.global [dst], [src], 16, src_bytes: src_bytes (0..16) read, the rest zero-filled.
inline void emu_cp_async16(void* dst, const void* src, int src_bytes) {
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || (src_bytes > 0 && reinterpret_cast<uintptr_t>(src) % 16 != 0) ||
      src_bytes < 0 || src_bytes > 16) {
    fprintf(stderr, "cp.async emulation: misaligned copy %p <- %p (%d bytes)\n", dst, src, src_bytes);
    abort();
  }
  memset(dst, 0xFF, 16);
  g_cta->async[threadIdx.x].open.push_back(EmuCopy{dst, src, src_bytes});
}
inline void emu_cp_async_commit() {
  EmuAsync& a = g_cta->async[threadIdx.x];
  a.groups.push_back(std::move(a.open));
  a.open.clear();
}
// cp.async.wait_group n: every committed group but the newest n has landed.
inline void emu_cp_async_wait(int n) {
  EmuAsync& a = g_cta->async[threadIdx.x];
  while (a.groups.size() > (size_t)n) {
    for (const EmuCopy& c : a.groups.front()) {
      if (c.bytes > 0) memcpy(c.dst, c.src, c.bytes);
      memset(static_cast<char*>(c.dst) + c.bytes, 0, 16 - c.bytes);
    }
    a.groups.erase(a.groups.begin());
  }
}
