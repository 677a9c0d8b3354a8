// Round trips of every format on fresh random rows: error against a model derived from the
// format's bit count, block validity, idempotence where it holds, and bad-input errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/formats/block_layouts.h"
#include "common/formats/kquant_scales.h"
#include "common/formats/quant.h"
#include "tests/formats/random_rows.h"

namespace moraine {
namespace {

using test::Dist;

std::vector<uint8_t> quantize(TensorType t, const std::vector<float>& x) {
  std::vector<uint8_t> q(row_bytes(t, static_cast<int64_t>(x.size())));
  quantize_row(t, x.data(), q.data(), static_cast<int64_t>(x.size()));
  return q;
}

std::vector<float> dequantize(TensorType t, const std::vector<uint8_t>& q, int64_t n) {
  std::vector<float> y(static_cast<size_t>(n));
  dequantize_row(t, q.data(), y.data(), n);
  return y;
}

// Uniform-noise model of the round-trip error: a quantizer with step D adds error uniform on
// [-D/2, D/2], i.e. variance D^2/12. D follows from the bit count and the group's range:
// symmetric b-bit formats map the group's |max| to the extreme level (D = amax / 2^(b-1), or
// amax/127 for the 8-bit ones), affine b-bit formats spread [min(min,0), max] over 2^b - 1
// steps. MXFP4's E2M1 grid has gaps of 1, 2, 4 units below 4, 8, 12 units of 2^(e-128), and
// clips above 12 units; F16 / BF16 have one ulp (2^-10 / 2^-7 relative) per binade.
// Returns the model's mean squared error over the row.
double model_mse(TensorType t, const std::vector<float>& x) {
  auto groups = [&](int g, auto step_of_group) {
    double sum = 0.0;
    for (size_t b = 0; b < x.size(); b += static_cast<size_t>(g)) {
      float lo = x[b], hi = x[b], amax = 0.0f;
      for (size_t i = b; i < b + static_cast<size_t>(g); ++i) {
        lo = std::min(lo, x[i]);
        hi = std::max(hi, x[i]);
        amax = std::max(amax, std::fabs(x[i]));
      }
      const double step = step_of_group(static_cast<double>(amax), static_cast<double>(hi) - std::min(0.0, static_cast<double>(lo)));
      sum += g * step * step / 12.0;
    }
    return sum / static_cast<double>(x.size());
  };
  auto sym = [](double levels) { return [levels](double amax, double) { return amax / levels; }; };
  auto affine = [](double steps) { return [steps](double, double range) { return range / steps; }; };
  switch (t) {
    case TensorType::Q8_0: return groups(32, sym(127));
    case TensorType::Q8_K: return groups(256, sym(127));
    case TensorType::Q4_0: return groups(32, sym(8));
    case TensorType::Q6_K: return groups(16, sym(32));
    case TensorType::Q3_K: return groups(16, sym(4));
    case TensorType::Q2_K: return groups(16, affine(3));
    case TensorType::Q4_K: return groups(32, affine(15));
    case TensorType::Q5_K: return groups(32, affine(31));
    case TensorType::MXFP4: {
      double sum = 0.0;
      for (size_t b = 0; b < x.size(); b += 32) {
        float amax = 0.0f;
        for (size_t i = b; i < b + 32; ++i) amax = std::max(amax, std::fabs(x[i]));
        const double unit = std::ldexp(1.0, static_cast<int>(std::floor(std::log2(amax))) - 3);
        for (size_t i = b; i < b + 32; ++i) {
          const double u = std::fabs(x[i]) / unit;
          if (u >= 12.0) {
            sum += (u - 12.0) * (u - 12.0) * unit * unit;
          } else {
            const double gap = u < 4.0 ? 1.0 : (u < 8.0 ? 2.0 : 4.0);
            sum += gap * gap * unit * unit / 12.0;
          }
        }
      }
      return sum / static_cast<double>(x.size());
    }
    case TensorType::F16:
    case TensorType::BF16: {
      const int mant = t == TensorType::F16 ? 10 : 7;
      double sum = 0.0;
      for (float v : x) {
        if (v == 0.0f) continue;
        const int e = std::max(static_cast<int>(std::floor(std::log2(std::fabs(v)))), t == TensorType::F16 ? -14 : -126);
        const double ulp = std::ldexp(1.0, e - mant);
        sum += ulp * ulp / 12.0;
      }
      return sum / static_cast<double>(x.size());
    }
    default: break;
  }
  return 0.0;
}

double rms(const std::vector<float>& x) {
  double s = 0.0;
  for (float v : x) s += static_cast<double>(v) * v;
  return std::sqrt(s / static_cast<double>(x.size()));
}

const TensorType kFormats[] = {TensorType::F16,  TensorType::BF16, TensorType::Q8_0, TensorType::Q4_0,
                               TensorType::MXFP4, TensorType::Q2_K, TensorType::Q3_K, TensorType::Q4_K,
                               TensorType::Q5_K, TensorType::Q6_K, TensorType::Q8_K};

std::vector<int64_t> lengths_for(TensorType t) {
  if (type_traits(t).block_elems == 256) return {3 * 256, 4096};
  return {11 * 32, 3 * 256, 4096};
}

uint32_t seed_of(TensorType t, Dist d, int64_t n) {
  return static_cast<uint32_t>(static_cast<uint32_t>(t) * 7919u + static_cast<uint32_t>(d) * 104729u + static_cast<uint32_t>(n));
}

// Measured relative RMSE (error rms / data rms) of this implementation, gaussian rows of 4096
// (the full table over all distributions and lengths prints when the test runs):
//   f16 0.00021  bf16 0.0017  q8_0 0.0054  q4_0 0.087  mxfp4 0.115  q2_k 0.29  q3_k 0.15
//   q4_k 0.071  q5_k 0.037  q6_k 0.018  q8_k 0.0071
// measured/model ratios: 0.8 .. 1.05 on gaussian and uniform rows; with outliers 0.46 .. 1.4
// (the searching k-quants clip outliers better than the model assumes; few-element rows scatter).
// Bounds:
// - rows of 4096: measured <= 1.25 x model. The 25% covers what the uniform-noise model leaves
//   out (fp16 rounding of the super-block scales, the 4/6/8-bit sub-block scales: up to half a
//   scale step) and sampling noise: in the outlier rows ~40 elements dominate the error, so
//   the measured rmse has a relative sd of about 0.9 / (2 sqrt(40)) = 7%; 1.25 is > 3 sd.
// - shorter rows, where a handful of outliers dominate and the model's expectation says
//   little about one sample: measured <= sqrt(3) x model, the worst case of round-to-nearest
//   (every error at half a step). MaxErrorWithinHalfStep checks that worst case per element.
TEST(QuantRoundTrip, ErrorWithinBitCountModel) {
  std::printf("%-6s %-9s %5s %10s %10s %6s\n", "format", "dist", "n", "rel_rmse", "model", "ratio");
  for (TensorType t : kFormats) {
    for (Dist d : test::kAllDists) {
      for (int64_t n : lengths_for(t)) {
        const std::vector<float> x = test::random_row(d, n, seed_of(t, d, n));
        const std::vector<float> y = dequantize(t, quantize(t, x), n);
        double se = 0.0;
        for (size_t i = 0; i < x.size(); ++i) se += (static_cast<double>(y[i]) - x[i]) * (static_cast<double>(y[i]) - x[i]);
        const double measured = std::sqrt(se / static_cast<double>(n)) / rms(x);
        const double model = std::sqrt(model_mse(t, x)) / rms(x);
        std::printf("%-6s %-9s %5lld %10.5f %10.5f %6.2f\n", std::string(type_name(t)).c_str(), test::dist_name(d).c_str(),
                    static_cast<long long>(n), measured, model, measured / model);
        const double factor = n >= 4096 ? 1.25 : std::sqrt(3.0);
        EXPECT_LE(measured, factor * model) << type_name(t) << " " << test::dist_name(d) << " n=" << n;
      }
    }
  }
}

// Pure round-to-nearest formats: every element within half a step of its value (Q4_0: except
// the clipped top of the side opposite the block extreme). For Q8_0 and
// Q4_0 the levels are chosen with the unrounded scale d and decoded with fp16(d), which moves
// level q by |q| * |fp16(d) - d| <= |q| * d * 2^-11: at most 127/2048 (q8_0) or 8/2048 (q4_0) of
// a step. F16/BF16 steps are one ulp of the element's binade.
TEST(QuantRoundTrip, MaxErrorWithinHalfStep) {
  for (Dist d : test::kAllDists) {
    const int64_t n = 4096;
    const std::vector<float> x = test::random_row(d, n, seed_of(TensorType::Q8_0, d, 12345));
    for (TensorType t : {TensorType::F16, TensorType::BF16, TensorType::Q8_0, TensorType::Q4_0, TensorType::Q8_K}) {
      const std::vector<float> y = dequantize(t, quantize(t, x), n);
      const int64_t g = t == TensorType::Q8_K ? 256 : 32;
      for (int64_t b = 0; b < n; b += g) {
        float amax = 0.0f, extreme = 0.0f;
        for (int64_t i = b; i < b + g; ++i) {
          if (std::fabs(x[static_cast<size_t>(i)]) > amax) {
            amax = std::fabs(x[static_cast<size_t>(i)]);
            extreme = x[static_cast<size_t>(i)];
          }
        }
        for (int64_t i = b; i < b + g; ++i) {
          const double xi = x[static_cast<size_t>(i)], err = std::fabs(static_cast<double>(y[static_cast<size_t>(i)]) - xi);
          double limit = 0.0;
          switch (t) {
            case TensorType::F16: limit = 0.5 * std::ldexp(1.0, std::max(static_cast<int>(std::floor(std::log2(std::fabs(xi)))), -14) - 10); break;
            case TensorType::BF16: limit = 0.5 * std::ldexp(1.0, static_cast<int>(std::floor(std::log2(std::fabs(xi)))) - 7); break;
            case TensorType::Q8_0: limit = (0.5 + 127.0 / 2048) * amax / 127.0; break;
            case TensorType::Q4_0: {
              // Levels -8..7 with the extreme at -8: the opposite side stops at 7 steps, so
              // values beyond 7.5 steps there clip (error up to one step).
              const double step = amax / 8.0;
              const bool clipped = xi * extreme < 0 && std::fabs(xi) > 7.5 * step;
              limit = (clipped ? std::fabs(xi) - 7.0 * step : 0.5 * step) + 8.0 / 2048 * step;
              break;
            }
            default: limit = (0.5 + 1e-5) * amax / 127.0; break;  // Q8_K keeps d in float
          }
          ASSERT_LE(err, limit) << type_name(t) << " element " << i << " x=" << xi;
        }
      }
    }
  }
}

float f16(uint16_t h) { return fp16_to_fp32(h); }

// Structural checks on the blocks the quantizers write.
TEST(QuantRoundTrip, BlocksAreValid) {
  for (Dist d : test::kAllDists) {
    const int64_t n = 4096;
    const std::vector<float> x = test::random_row(d, n, seed_of(TensorType::Q4_K, d, 99));
    {
      const auto q = quantize(TensorType::Q8_0, x);
      const auto* b = reinterpret_cast<const BlockQ8_0*>(q.data());
      for (int64_t i = 0; i < n / 32; ++i) {
        ASSERT_TRUE(std::isfinite(f16(b[i].d)) && f16(b[i].d) > 0.0f);
        int qmax = 0;
        for (int8_t v : b[i].qs) {
          ASSERT_GE(v, -127);
          qmax = std::max(qmax, std::abs(static_cast<int>(v)));
        }
        EXPECT_EQ(qmax, 127) << "block max must use the full range";
      }
    }
    {
      const auto q = quantize(TensorType::Q4_0, x);
      const auto* b = reinterpret_cast<const BlockQ4_0*>(q.data());
      for (int64_t i = 0; i < n / 32; ++i) {
        ASSERT_TRUE(std::isfinite(f16(b[i].d)));
        bool has_minus8 = false;
        for (uint8_t v : b[i].qs) has_minus8 |= (v & 0x0f) == 0 || (v >> 4) == 0;
        EXPECT_TRUE(has_minus8) << "the block extreme maps to level -8";
      }
    }
    {
      const auto q = quantize(TensorType::MXFP4, x);
      const auto* b = reinterpret_cast<const BlockMXFP4*>(q.data());
      for (int64_t i = 0; i < n / 32; ++i) {
        ASSERT_LT(b[i].e, 255) << "E8M0 0xff is NaN";
        float amax = 0.0f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[static_cast<size_t>(32 * i + j)]));
        // Shared exponent puts amax in [8, 16) units of 2^(e-128).
        const float unit = std::ldexp(1.0f, b[i].e - 128);
        EXPECT_GE(amax / unit, 8.0f);
        EXPECT_LT(amax / unit, 16.0f);
      }
    }
    for (TensorType t : {TensorType::Q2_K, TensorType::Q4_K, TensorType::Q5_K}) {
      const auto q = quantize(t, x);
      for (int64_t i = 0; i < n / 256; ++i) {
        const uint8_t* blk = q.data() + i * type_traits(t).block_bytes;
        uint16_t dh, dminh;
        int max_scale = 0, max_min = 0;
        if (t == TensorType::Q2_K) {
          const auto* b = reinterpret_cast<const BlockQ2_K*>(blk);
          dh = b->d;
          dminh = b->dmin;
          for (uint8_t s : b->scales) {
            max_scale = std::max(max_scale, s & 15);
            max_min = std::max(max_min, s >> 4);
          }
          EXPECT_EQ(max_scale, 15) << "largest sub-block scale uses all 4 bits";
        } else {
          const uint8_t* packed = t == TensorType::Q4_K ? reinterpret_cast<const BlockQ4_K*>(blk)->scales
                                                        : reinterpret_cast<const BlockQ5_K*>(blk)->scales;
          std::memcpy(&dh, blk, 2);
          std::memcpy(&dminh, blk + 2, 2);
          for (int j = 0; j < 8; ++j) {
            uint8_t sc, m;
            kquant::unpack_scale_min(packed, j, sc, m);
            ASSERT_LE(sc, 63);
            ASSERT_LE(m, 63);
            max_scale = std::max<int>(max_scale, sc);
            max_min = std::max<int>(max_min, m);
          }
          EXPECT_EQ(max_scale, 63) << "largest sub-block scale uses all 6 bits";
        }
        EXPECT_TRUE(std::isfinite(f16(dh)) && f16(dh) > 0.0f) << type_name(t);
        EXPECT_TRUE(std::isfinite(f16(dminh)) && f16(dminh) >= 0.0f) << type_name(t);
        if (f16(dminh) > 0.0f) {
          EXPECT_EQ(max_min, t == TensorType::Q2_K ? 15 : 63);
        }
      }
    }
    {
      const auto q = quantize(TensorType::Q3_K, x);
      const auto* b = reinterpret_cast<const BlockQ3_K*>(q.data());
      for (int64_t i = 0; i < n / 256; ++i) {
        ASSERT_TRUE(std::isfinite(f16(b[i].d)));
        int extreme = 0;
        for (int j = 0; j < 16; ++j) {
          const int s = kquant::q3k_scale(b[i].scales, j);
          ASSERT_GE(s, -32);
          ASSERT_LE(s, 31);
          if (std::abs(s) > std::abs(extreme)) extreme = s;
        }
        EXPECT_EQ(extreme, -32) << "largest |scale| maps to -32, the level without a positive twin";
      }
    }
    {
      const auto q = quantize(TensorType::Q6_K, x);
      const auto* b = reinterpret_cast<const BlockQ6_K*>(q.data());
      for (int64_t i = 0; i < n / 256; ++i) {
        ASSERT_TRUE(std::isfinite(f16(b[i].d)));
        int extreme = 0;
        for (int8_t s : b[i].scales) extreme = std::max(extreme, std::abs(static_cast<int>(s)));
        EXPECT_GE(extreme, 127) << "largest |scale| uses the full int8 range";
      }
    }
    {
      const auto q = quantize(TensorType::Q8_K, x);
      const auto* b = reinterpret_cast<const BlockQ8_K*>(q.data());
      for (int64_t i = 0; i < n / 256; ++i) {
        ASSERT_TRUE(std::isfinite(b[i].d));
        for (int g = 0; g < 16; ++g) {
          int sum = 0;
          for (int j = 0; j < 16; ++j) {
            ASSERT_GE(b[i].qs[16 * g + j], -127);
            sum += b[i].qs[16 * g + j];
          }
          ASSERT_EQ(b[i].bsums[g], sum) << "bsums must be the sums of each 16 quants";
        }
      }
    }
  }
}

// All-zero rows must encode to blocks that decode to exact zeros (no NaN from 0/0).
TEST(QuantRoundTrip, ZeroRowDecodesToZero) {
  const std::vector<float> zeros(512, 0.0f);
  for (TensorType t : kFormats) {
    const std::vector<float> y = dequantize(t, quantize(t, zeros), 512);
    for (float v : y) ASSERT_EQ(v, 0.0f) << type_name(t);
  }
}

// Re-quantizing a dequantized row reproduces the same bytes for the formats whose scale is a
// pure function of the block max (the max element decodes to the top level exactly).
TEST(QuantRoundTrip, IdempotentWhereScaleFollowsMax) {
  for (TensorType t : {TensorType::F16, TensorType::BF16, TensorType::Q8_0, TensorType::Q4_0, TensorType::MXFP4}) {
    for (Dist d : test::kAllDists) {
      const std::vector<float> x = test::random_row(d, 3 * 256, seed_of(t, d, 7));
      const auto q1 = quantize(t, x);
      const auto q2 = quantize(t, dequantize(t, q1, 3 * 256));
      EXPECT_EQ(q1, q2) << type_name(t) << " " << test::dist_name(d);
    }
  }
}

// Rows far below normal magnitudes (down to float subnormals, where 1/scale overflows) still
// encode to blocks that decode to finite values within the row's own magnitude.
TEST(QuantRoundTrip, TinyRowsStayFinite) {
  for (float scale : {1e-20f, 1e-36f, 1e-39f, 1e-43f}) {
    std::vector<float> x = test::random_row(Dist::Gaussian, 512, 31);
    float amax = 0.0f;
    for (float& v : x) {
      v *= scale;
      amax = std::max(amax, std::fabs(v));
    }
    for (TensorType t : kFormats) {
      const std::vector<float> y = dequantize(t, quantize(t, x), 512);
      for (size_t i = 0; i < y.size(); ++i) {
        ASSERT_TRUE(std::isfinite(y[i])) << type_name(t) << " scale " << scale;
        ASSERT_LE(std::fabs(y[i] - x[i]), 2.0f * amax) << type_name(t) << " scale " << scale << " element " << i;
      }
    }
  }
}

// Values whose block scale cannot be held in fp16 are refused, naming the block; formats with
// a float (Q8_K) or exponent (MXFP4) scale take them.
TEST(QuantErrors, ValuesBeyondFp16ScalesAreRefused) {
  std::vector<float> x = test::random_row(Dist::Gaussian, 512, 5);
  x[300] = 1e12f;  // block 1 of the 256-blocks, block 9 of the 32-blocks
  std::vector<uint8_t> out(row_bytes(TensorType::Q8_K, 512));
  for (TensorType t : {TensorType::Q8_0, TensorType::Q4_0, TensorType::Q2_K, TensorType::Q3_K, TensorType::Q4_K,
                       TensorType::Q5_K, TensorType::Q6_K}) {
    const std::string block = "block " + std::to_string(300 / type_traits(t).block_elems) + " ";
    try {
      quantize_row(t, x.data(), out.data(), 512);
      ADD_FAILURE() << type_name(t) << ": 1e12 must be refused";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(block), std::string::npos) << e.what();
    }
  }
  for (TensorType t : {TensorType::MXFP4, TensorType::Q8_K}) {
    const std::vector<float> y = dequantize(t, quantize(t, x), 512);
    EXPECT_NEAR(y[300], 1e12f, 0.5e12f) << type_name(t);
  }
}

TEST(QuantErrors, BadInputsThrowNamingTheProblem) {
  std::vector<float> x(256, 1.0f);
  std::vector<uint8_t> out(4096);
  x[37] = std::nanf("");
  try {
    quantize_row(TensorType::Q4_K, x.data(), out.data(), 256);
    FAIL() << "NaN input must be rejected";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("element 37"), std::string::npos) << e.what();
  }
  x[37] = 1.0f;
  EXPECT_THROW(quantize_row(TensorType::Q4_K, x.data(), out.data(), 100), std::invalid_argument);
  EXPECT_THROW(dequantize_row(TensorType::I32, out.data(), x.data(), 32), std::invalid_argument);
  EXPECT_THROW(dot_activation_type(TensorType::Q8_K), std::invalid_argument);
  EXPECT_THROW(vec_dot_reference(TensorType::Q8_0, 33, out.data(), out.data()), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
