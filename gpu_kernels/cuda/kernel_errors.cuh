// Device side of kernel_errors.h: reporting failures and notices (every kernel that reports includes this).
#pragma once

#include <stdint.h>

#include "gpu_kernels/cuda/kernel_errors.h"
#include "gpu_kernels/portability.cuh"

namespace portep::cuda {

// Word failed[w] (device memory, which kernels test: reads of the host-mapped record are served one at a time
// across PCIe, about 0.6 us each GPU-wide) takes the code if it held none; the winner fills record error[w] and
// publishes its code last. w: 1 for a notice, 0 for a failure.
PORTEP_DEVICE void report_to(uint32_t* failed, KernelError* error, uint32_t code, uint32_t rank, uint32_t src,
                             uint32_t index, int64_t value = 0) {
  const int w = is_notice(code) ? 1 : 0;
  if (atomic_cas_relaxed_gpu_u32(failed + w, 0, code) != 0) return;
  KernelError* e = error + w;
  e->rank = rank;
  e->src = src;
  e->index = index;
  e->value = value;
  st_release_sys_u32(&e->code, code);
}

// c: an LLCommon or HTCommon.
template <class Common>
PORTEP_DEVICE void report_error(const Common& c, uint32_t code, uint32_t rank, uint32_t src, uint32_t index,
                                int64_t value = 0) {
  report_to(c.failed, c.error, code, rank, src, index, value);
}
// The code of the first failure reported so far (0: none; notices are not failures).
template <class Common>
PORTEP_DEVICE uint32_t reported_error(const Common& c) {
  return *reinterpret_cast<volatile uint32_t*>(c.failed);
}

}  // namespace portep::cuda
