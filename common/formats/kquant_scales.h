// Unpacking of the packed sub-block scales shared by the k-quant reference code and kernels.
#pragma once
#include <cstdint>

namespace moraine::kquant {

// Q4_K / Q5_K: 8 six-bit scales and 8 six-bit mins packed into 12 bytes. Sub-blocks 0..3 keep
// scale and min in the low 6 bits of bytes j and j+4; sub-blocks 4..7 keep the low nibbles in
// byte j+4 and the top 2 bits in the spare top bits of bytes j-4 (scale) and j (min).
inline void unpack_scale_min(const uint8_t* packed, int j, uint8_t& scale, uint8_t& min) {
  if (j < 4) {
    scale = packed[j] & 63;
    min = packed[j + 4] & 63;
  } else {
    scale = static_cast<uint8_t>((packed[j + 4] & 0x0f) | ((packed[j - 4] >> 6) << 4));
    min = static_cast<uint8_t>((packed[j + 4] >> 4) | ((packed[j] >> 6) << 4));
  }
}

inline void pack_scale_min(uint8_t* packed, int j, uint8_t scale, uint8_t min) {
  if (j < 4) {
    packed[j] = static_cast<uint8_t>((packed[j] & 0xc0) | scale);
    packed[j + 4] = static_cast<uint8_t>((packed[j + 4] & 0xc0) | min);
  } else {
    packed[j + 4] = static_cast<uint8_t>((scale & 0x0f) | ((min & 0x0f) << 4));
    packed[j - 4] = static_cast<uint8_t>((packed[j - 4] & 0x3f) | ((scale >> 4) << 6));
    packed[j] = static_cast<uint8_t>((packed[j] & 0x3f) | ((min >> 4) << 6));
  }
}

// Q3_K: sixteen 6-bit scales (stored biased by 32) in 12 bytes; returns scale - 32.
inline int q3k_scale(const uint8_t* packed, int j) {
  const int low = j < 8 ? (packed[j] & 0x0f) : (packed[j - 8] >> 4);
  const int high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
  return (low | (high << 4)) - 32;
}

inline void q3k_set_scale(uint8_t* packed, int j, int biased) {  // biased in 0..63
  if (j < 8) {
    packed[j] = static_cast<uint8_t>((packed[j] & 0xf0) | (biased & 0x0f));
  } else {
    packed[j - 8] = static_cast<uint8_t>((packed[j - 8] & 0x0f) | ((biased & 0x0f) << 4));
  }
  const int shift = 2 * (j / 4);
  uint8_t& hi = packed[8 + j % 4];
  hi = static_cast<uint8_t>((hi & ~(3 << shift)) | (((biased >> 4) & 3) << shift));
}

}  // namespace moraine::kquant
