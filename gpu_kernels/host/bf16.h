// BF16 <-> FP32 as the host row kernels, the LogFMT rows and the slot sums (host and kernel: gpu_kernels/slot_sums.h)
// read and write them (the LL and HT kernels have their own in gpu_kernels/cuda/ll_common.cuh, rounding the same way).
#pragma once

#include <stdint.h>
#include <string.h>

#include "gpu_kernels/host_device.h"

namespace portep {

PORTEP_HOST_DEVICE float bf16_to_f32(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

PORTEP_HOST_DEVICE uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

}  // namespace portep
