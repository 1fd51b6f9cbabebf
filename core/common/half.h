// fp16 (IEEE binary16) and bf16 (bfloat16) ⇄ fp32, round-to-nearest-even.
// Header-only so that kernels inline them, and host/device (common/host_device.h): the CPU
// kernels and the CUDA ones convert with these same functions. NaN stays NaN (quiet, sign
// kept), ±Inf stays ±Inf, subnormals are exact both ways, and overflow rounds to ±Inf as
// IEEE requires.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/common/host_device.h"

namespace hps {

// A float's bits and back (std::bit_cast, which device code cannot call).
HPS_HOST_DEVICE uint32_t float_to_bits(float f) {
  uint32_t u = 0;
  memcpy(&u, &f, sizeof u);
  return u;
}
HPS_HOST_DEVICE float bits_to_float(uint32_t u) {
  float f = 0;
  memcpy(&f, &u, sizeof f);
  return f;
}

HPS_HOST_DEVICE float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) {  // Inf or NaN: widen the payload
    return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  }
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in fp32
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return bits_to_float(sign | float_to_bits(magnitude));
  }
  return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

HPS_HOST_DEVICE uint16_t float_to_half_bits(float f) {
  const uint32_t x = float_to_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t magnitude = x & 0x7fffffffu;
  if (magnitude > 0x7f800000u) {  // NaN: quiet it, keep the top payload bits
    return static_cast<uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
  }
  if (magnitude >= 0x477ff000u) {  // ≥ 65520 (half-way past 65504) and Inf → Inf
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (magnitude < 0x38800000u) {  // below 2^-14: a half subnormal or zero
    // Adding 0.5 puts the fp16 subnormal ulp (2^-24) at the fp32 ulp of 0.5, so the
    // FPU's own round-to-nearest-even does the rounding.
    const float shifted = bits_to_float(magnitude) + 0.5f;
    return static_cast<uint16_t>(sign | (float_to_bits(shifted) - 0x3f000000u));
  }
  const uint32_t mantissa_odd = (magnitude >> 13) & 1u;
  magnitude += 0xc8000fffu + mantissa_odd;  // rebias exponent (127→15) and round half to even
  return static_cast<uint16_t>(sign | (magnitude >> 13));
}

HPS_HOST_DEVICE float bf16_bits_to_float(uint16_t b) {
  return bits_to_float(static_cast<uint32_t>(b) << 16);
}

HPS_HOST_DEVICE uint16_t float_to_bf16_bits(float f) {
  const uint32_t x = float_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {  // NaN: quiet it, keep sign and top payload
    return static_cast<uint16_t>((x >> 16) | 0x0040u);
  }
  const uint32_t lsb = (x >> 16) & 1u;
  return static_cast<uint16_t>((x + 0x7fffu + lsb) >> 16);
}

}  // namespace hps
