// A bench's template weight row of type t from the values f: quantize_row, or for the IQ grid
// types, which moraine does not write, random blocks (any bytes decode: the kernels' speed does
// not depend on the values) with a fixed fp16 block scale.
#pragma once
#include <algorithm>
#include <cstdint>
#include <random>

#include "common/formats/half_float.h"
#include "common/formats/quant.h"
#include "common/formats/quant_iq.h"

namespace moraine::kernel_bench {

inline void template_row(TensorType t, const float* f, int64_t n, uint8_t* row, std::mt19937& rng) {
  if (!formats::is_iq_grid_type(t)) {
    quantize_row(t, f, row, n);
    return;
  }
  const size_t rb = row_bytes(t, n), bb = type_traits(t).block_bytes;
  for (size_t i = 0; i < rb; ++i) row[i] = static_cast<uint8_t>(rng());
  const uint16_t d = half::fp32_to_fp16(1e-3f);
  for (size_t b = 0; b < rb; b += bb) {
    if (t == TensorType::IQ1_M) {  // the fp16 scale in the top nibbles of the four scale halfwords (bytes 48..55)
      for (int k = 0; k < 4; ++k) {
        uint8_t& hi = row[b + 49 + 2 * k];
        hi = static_cast<uint8_t>((hi & 0x0f) | (((d >> (4 * k)) & 0xf) << 4));
      }
    } else {  // the other IQ blocks start with their fp16 d
      row[b] = static_cast<uint8_t>(d & 0xff);
      row[b + 1] = static_cast<uint8_t>(d >> 8);
    }
  }
}

}  // namespace moraine::kernel_bench
