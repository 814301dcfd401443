// BF16 <-> FP32 on the host, as the host row kernels and the LogFMT rows read and write them (the kernels have
// their own in gpu_kernels/cuda/ll_common.cuh, rounding the same way).
#pragma once

#include <stdint.h>
#include <string.h>

namespace portep {

inline float bf16_to_f32(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

}  // namespace portep
