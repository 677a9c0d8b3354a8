// Random rows of the IQ grid formats and of Q8_K activations for the format tests: every byte
// random (any grid index, sign pattern and scale is a valid block), then the fp16 block scale
// set to a finite value, so the dots exercise all of each layout and not only what a quantizer
// happens to write.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/formats/block_layouts.h"
#include "common/formats/block_layouts_iq.h"
#include "common/formats/quant.h"

namespace moraine::test {

inline constexpr TensorType kIqGridTypes[] = {TensorType::IQ2_XXS, TensorType::IQ2_XS, TensorType::IQ2_S, TensorType::IQ3_XXS,
                                              TensorType::IQ3_S,   TensorType::IQ1_S,  TensorType::IQ1_M};

// A finite fp16 scale of random sign and magnitude 2^log2_lo .. 2^log2_hi.
inline uint16_t random_fp16_scale(std::mt19937& rng, float log2_lo = -16.0f, float log2_hi = -2.0f) {
  std::uniform_real_distribution<float> e(log2_lo, log2_hi);
  const float v = std::exp2(e(rng)) * ((rng() & 1) ? -1.0f : 1.0f);
  return fp32_to_fp16(v);
}

inline std::vector<uint8_t> random_iq_row(TensorType t, int64_t n, uint32_t seed, float log2_lo = -16.0f, float log2_hi = -2.0f) {
  std::mt19937 rng(seed);
  const size_t bb = type_traits(t).block_bytes;
  std::vector<uint8_t> row(row_bytes(t, n));
  for (uint8_t& b : row) b = static_cast<uint8_t>(rng());
  for (size_t off = 0; off < row.size(); off += bb) {
    const uint16_t d = random_fp16_scale(rng, log2_lo, log2_hi);
    if (t == TensorType::IQ1_M) {
      // The fp16 scale lives in the top nibbles of the four scale words (word 0 the lowest).
      uint16_t sc[4];
      std::memcpy(sc, row.data() + off + offsetof(BlockIQ1_M, scales), 8);
      for (int k = 0; k < 4; ++k) sc[k] = static_cast<uint16_t>((sc[k] & 0x0fff) | (((d >> (4 * k)) & 0xf) << 12));
      std::memcpy(row.data() + off + offsetof(BlockIQ1_M, scales), sc, 8);
    } else {
      std::memcpy(row.data() + off, &d, 2);  // every other IQ block starts with its fp16 d
    }
  }
  return row;
}

// Q8_K activations with every quant in -128..127 (-128 included, which no quantizer writes but
// the format holds), consistent bsums and a random positive scale.
inline std::vector<uint8_t> random_q8_k_row(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> scale(1e-3f, 0.1f);
  std::vector<BlockQ8_K> blocks(static_cast<size_t>(n / kQK_K));
  for (BlockQ8_K& b : blocks) {
    b.d = scale(rng);
    for (int8_t& q : b.qs) q = static_cast<int8_t>(rng());
    for (int j = 0; j < kQK_K / 16; ++j) {
      int s = 0;
      for (int i = 0; i < 16; ++i) s += b.qs[16 * j + i];
      b.bsums[j] = static_cast<int16_t>(s);
    }
  }
  std::vector<uint8_t> row(blocks.size() * sizeof(BlockQ8_K));
  std::memcpy(row.data(), blocks.data(), row.size());
  return row;
}

}  // namespace moraine::test
