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

// Extra error of the Q8_1 pairings (Q4_1, Q5_1; 0 for every other type): the weight's min is
// applied as m * s with s = fp16(d * sum(q)) and the float d, where the dequantized activations
// sum to fp16(d) * sum(q): two fp16 roundings apart, 2 * 2^-11 |m| |s| per block, and
// |s| <= (1 + 2^-10) sum |a| over the block (a_mag: the activations' magnitudes, or bounds on them).
inline double q8_1_min_slack(TensorType type, const uint8_t* wq, const std::vector<float>& a_mag) {
  if (type != TensorType::Q4_1 && type != TensorType::Q5_1) return 0.0;
  const size_t bb = type_traits(type).block_bytes;
  double slack = 0.0;
  for (size_t b = 0; b < a_mag.size() / 32; ++b) {
    uint16_t m;
    std::memcpy(&m, wq + b * bb + 2, 2);  // the min follows d in both layouts
    double sum = 0.0;
    for (size_t j = 0; j < 32; ++j) sum += std::fabs(static_cast<double>(a_mag[32 * b + j]));
    slack += 2.0 * 0x1p-11 * std::fabs(static_cast<double>(fp16_to_fp32(m))) * (1.0 + 0x1p-10) * sum;
  }
  return slack;
}

// The Q8_1 pairings' dot, exactly: the min enters as m * s, not m * sum(a_deq). Returns the sum
// over blocks of m * (s - sum(a_deq)), what to add to sum(w_deq * a_deq) to get the value the
// format's dot stands for (0 for other types); *mag gets sum |m| |s|, the magnitude of the min
// terms the reference rounds on their own.
inline double q8_1_min_correction(TensorType type, const uint8_t* wq, const uint8_t* aq, const std::vector<float>& a_deq, double* mag) {
  *mag = 0.0;
  if (type != TensorType::Q4_1 && type != TensorType::Q5_1) return 0.0;
  const size_t bb = type_traits(type).block_bytes;
  double corr = 0.0;
  for (size_t b = 0; b < a_deq.size() / 32; ++b) {
    uint16_t m, s;
    std::memcpy(&m, wq + b * bb + 2, 2);
    std::memcpy(&s, aq + b * sizeof(BlockQ8_1) + 2, 2);
    double sum = 0.0;
    for (size_t j = 0; j < 32; ++j) sum += a_deq[32 * b + j];
    const double mm = fp16_to_fp32(m), ss = fp16_to_fp32(s);
    corr += mm * (ss - sum);
    *mag += std::fabs(mm * ss);
  }
  return corr;
}

}  // namespace moraine::test
