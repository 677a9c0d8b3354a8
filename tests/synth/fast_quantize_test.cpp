// moraine-synth's range quantizers write blocks every reader decodes: dequantized with the
// reference decoder they are within one quantization step of the input, and no worse than
// 1.5x the reference quantizer's error.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "common/formats/quant.h"
#include "tools/synth/fast_quantize.h"

namespace moraine {
namespace {

double rms_error(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(s / static_cast<double>(a.size()));
}

TEST(SynthFastQuantize, RangeQuantizersDecodeCloseToInput) {
  std::mt19937_64 rng(77);
  for (TensorType t : {TensorType::Q4_K, TensorType::Q6_K}) {
    SCOPED_TRACE(std::string(type_name(t)));
    const int64_t n = 256 * 64;
    std::vector<float> x(static_cast<size_t>(n));
    std::uniform_real_distribution<float> u(-0.04f, 0.04f);
    for (float& v : x) v = u(rng);
    x[5] = 0.0f;
    for (int i = 256; i < 512; ++i) x[static_cast<size_t>(i)] = 0.0f;  // an all-zero block
    x[1000] = 0.9f;  // an outlier widens its sub-block's range
    std::vector<uint8_t> fast(row_bytes(t, n)), ref(row_bytes(t, n));
    synth::fast_quantize_row(t, x.data(), fast.data(), n);
    quantize_row(t, x.data(), ref.data(), n);
    std::vector<float> yf(x.size()), yr(x.size());
    dequantize_row(t, fast.data(), yf.data(), n);
    dequantize_row(t, ref.data(), yr.data(), n);
    // One step of a sub-block spanning [-0.04, 0.04] (the widest here but the outlier's).
    const float step = t == TensorType::Q4_K ? 0.08f / 15 : 0.04f / 31;
    for (int64_t i = 0; i < n; ++i) {
      if (i / 32 == 1000 / 32) continue;  // the outlier's sub-block has a larger step
      ASSERT_LE(std::fabs(yf[static_cast<size_t>(i)] - x[static_cast<size_t>(i)]), 1.05f * step) << i;
    }
    for (int i = 256; i < 512; ++i) EXPECT_EQ(yf[static_cast<size_t>(i)], 0.0f) << i;
    EXPECT_NEAR(yf[1000], 0.9f, 0.9f / 15);
    EXPECT_LE(rms_error(x, yf), 1.5 * rms_error(x, yr));
  }
}

}  // namespace
}  // namespace moraine
