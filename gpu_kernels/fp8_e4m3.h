// float32 -> OCP FP8 E4M3 (torch.float8_e4m3fn) in integer arithmetic, for host and device code alike.
//
// E4M3 byte: [7] sign | [6:3] exponent, bias 7 | [2:0] mantissa. No infinity; S.1111.111 is NaN, so the largest
// finite value is S.1111.110 = 448. Exponent 0 holds subnormals m * 2^-9.
//
// Rounds to nearest, ties to even, and saturates finite values and infinities to +-448; NaN becomes 0x7f. That is
// what CUDA's __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3) does, and below 448 also torch's conversion.
// AMD kernels use it: the FP8 conversion instructions of gfx940/941/942 (MI300) produce the FNUZ variant (bias 8,
// largest 240), a different format.
#pragma once

#include <stdint.h>
#include <string.h>

#include "gpu_kernels/host_device.h"

namespace portep {

PORTEP_HOST_DEVICE uint8_t e4m3_from_float(float v) {
  uint32_t bits;
  memcpy(&bits, &v, 4);
  const uint32_t mag = bits & 0x7fffffffu;
  const uint8_t sign = uint8_t(bits >> 24) & 0x80;
  if (mag > 0x7f800000u) return 0x7f;          // NaN, as CUDA's conversion gives it
  if (mag >= 0x43e00000u) return sign | 0x7e;  // >= 448, infinity included
  if (mag < 0x3c800000u) {         // below 2^-6, the smallest normal: a subnormal m * 2^-9 (m = 8 rounds up to 2^-6)
    const uint32_t e = mag >> 23;  // |v| = sig * 2^(e - 150), so m = sig * 2^(e - 141), rounded
    if (e < 116) return sign;      // |v| < 2^-11, below a quarter of 2^-9 (float subnormals too)
    const uint32_t sig = (mag & 0x7fffffu) | 0x800000u, s = 141 - e;  // s in 21..25
    const uint32_t half = 1u << (s - 1), rest = sig & ((1u << s) - 1), m = sig >> s;
    return sign | uint8_t(m + (rest > half || (rest == half && (m & 1))));
  }
  // 8 exponent + 3 mantissa bits of the float, rounded to nearest even; a carry rounds into the exponent.
  const uint32_t r = (mag + 0x7ffffu + ((mag >> 20) & 1)) >> 20;
  return sign | uint8_t(r - (120u << 3));  // float bias 127 -> E4M3 bias 7
}

}  // namespace portep
