// Float error budgets for comparing dot products (shared by the dot tests).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/formats/block_layouts.h"
#include "common/formats/quant.h"

namespace moraine::test {

// sum |w_i| * |a_i| over the dequantized values, counting the affine formats' scale and min
// parts separately (|d*sc*q| + |dmin*m|), since the reference rounds each part on its own.
// The parts come from decoding copies of the row with dmin zeroed (scale part) and d zeroed
// (min part).
inline double dot_magnitude(TensorType type, const std::vector<uint8_t>& wq, const std::vector<float>& w_deq,
                            const std::vector<float>& a_deq) {
  std::vector<float> scale_part = w_deq, min_part(w_deq.size(), 0.0f);
  const bool affine = type == TensorType::Q2_K || type == TensorType::Q4_K || type == TensorType::Q5_K;
  if (affine) {
    const size_t bb = type_traits(type).block_bytes;
    const size_t d_off = type == TensorType::Q2_K ? offsetof(BlockQ2_K, d) : 0;
    std::vector<uint8_t> no_min = wq, no_scale = wq;
    for (size_t b = 0; b < wq.size(); b += bb) {
      std::memset(no_min.data() + b + d_off + 2, 0, 2);   // dmin follows d in all three layouts
      std::memset(no_scale.data() + b + d_off, 0, 2);
    }
    dequantize_row(type, no_min.data(), scale_part.data(), static_cast<int64_t>(w_deq.size()));
    dequantize_row(type, no_scale.data(), min_part.data(), static_cast<int64_t>(w_deq.size()));
  }
  double m = 0.0;
  for (size_t i = 0; i < w_deq.size(); ++i) {
    m += (std::fabs(static_cast<double>(scale_part[i])) + std::fabs(static_cast<double>(min_part[i]))) * std::fabs(static_cast<double>(a_deq[i]));
  }
  return m;
}

}  // namespace moraine::test
