// IEEE binary16 and bfloat16 <-> float conversions, inline so kernels can use them per element.
// Both narrowings round to nearest, ties to even (what F16C's vcvtps2ph and ggml do); NaN stays
// NaN (quiet, sign kept), overflow becomes infinity, binary16 subnormals are produced and read.
#pragma once
#include <bit>
#include <cstdint>

namespace moraine::half {

inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24 is exact in float.
    const float mag = static_cast<float>(mant) * 0x1p-24f;
    return sign ? -mag : mag;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t fp32_to_fp16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t mag = x & 0x7fffffffu;
  if (mag > 0x7f800000u) return sign | 0x7e00u;   // NaN -> quiet NaN
  if (mag == 0x7f800000u) return sign | 0x7c00u;  // infinity
  const int exp = static_cast<int>(mag >> 23) - 127;
  if (exp > 15) return sign | 0x7c00u;            // too large for binary16
  if (exp >= -14) {
    // Normal half. A rounding carry out of the mantissa bumps the exponent, up to infinity.
    uint32_t h = (static_cast<uint32_t>(exp + 15) << 10) | ((mag >> 13) & 0x3ffu);
    const uint32_t rest = mag & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  // Subnormal half: value / 2^-24 = m24 * 2^(exp + 1), so shift the 24-bit significand right.
  const int shift = -exp - 1;  // >= 14
  if (shift > 25) return sign;  // below half the smallest subnormal (float subnormals too)
  const uint32_t m24 = (mag & 0x7fffffu) | 0x800000u;
  uint32_t h = m24 >> shift;
  const uint32_t rest = m24 & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1);
  if (rest > halfway || (rest == halfway && (h & 1u))) ++h;  // may carry into the smallest normal
  return static_cast<uint16_t>(sign | h);
}

inline float bf16_to_fp32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

inline uint16_t fp32_to_bf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// E8M0 exponent -> 2^(e - 128): half the MXFP4 scale, because ggml's E2M1 table is doubled.
// e = 0 and 1 give float subnormals 2^-128 and 2^-127.
inline float e8m0_to_fp32_half(uint8_t e) {
  if (e < 2) return std::bit_cast<float>(0x00200000u << e);
  return std::bit_cast<float>(static_cast<uint32_t>(e - 1) << 23);
}

}  // namespace moraine::half
