// fp16 / bf16 conversions: corner cases (inf, NaN, subnormals, ties, overflow) against values
// derived from the IEEE definitions, plus an exhaustive round trip of every binary16 pattern.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "common/formats/quant.h"

namespace moraine {
namespace {

TEST(Fp16, EveryHalfRoundTripsThroughFloat) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = fp16_to_fp32(static_cast<uint16_t>(h));
    const bool is_nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0;
    if (is_nan) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << h;
      EXPECT_TRUE(std::isnan(fp16_to_fp32(fp32_to_fp16(f)))) << std::hex << h;
      EXPECT_EQ(fp32_to_fp16(f) & 0x8000, h & 0x8000) << "NaN keeps its sign, " << std::hex << h;
    } else {
      EXPECT_EQ(fp32_to_fp16(f), h) << std::hex << h;
    }
  }
}

TEST(Fp16, DecodesByDefinition) {
  // value = (-1)^s * 2^(e-15) * (1 + m/1024), or 2^-14 * m/1024 when e == 0.
  for (uint32_t h = 0; h < 0x7c00; h += 7) {
    const int e = static_cast<int>(h >> 10), m = static_cast<int>(h & 0x3ff);
    const double expect = e == 0 ? std::ldexp(m / 1024.0, -14) : std::ldexp(1.0 + m / 1024.0, e - 15);
    EXPECT_EQ(static_cast<double>(fp16_to_fp32(static_cast<uint16_t>(h))), expect) << std::hex << h;
    EXPECT_EQ(static_cast<double>(fp16_to_fp32(static_cast<uint16_t>(h | 0x8000))), -expect) << std::hex << h;
  }
}

TEST(Fp16, CornerCases) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(fp32_to_fp16(inf), 0x7c00);
  EXPECT_EQ(fp32_to_fp16(-inf), 0xfc00);
  EXPECT_EQ(fp32_to_fp16(0.0f), 0x0000);
  EXPECT_EQ(fp32_to_fp16(-0.0f), 0x8000);
  EXPECT_EQ(fp32_to_fp16(65504.0f), 0x7bff);           // largest finite half
  EXPECT_EQ(fp32_to_fp16(65519.99f), 0x7bff);          // below the midpoint to 65536
  EXPECT_EQ(fp32_to_fp16(65520.0f), 0x7c00);           // midpoint ties to even = infinity
  EXPECT_EQ(fp32_to_fp16(1e10f), 0x7c00);
  const uint16_t qnan = fp32_to_fp16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(qnan & 0x7c00, 0x7c00);
  EXPECT_NE(qnan & 0x3ff, 0);
  EXPECT_NE(fp32_to_fp16(std::numeric_limits<float>::signaling_NaN()) & 0x3ff, 0) << "sNaN must not become inf";
  // Subnormals: smallest 2^-24, largest (1023/1024) * 2^-14, smallest normal 2^-14.
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1023.0f, -24)), 0x03ff);
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1.0f, -14)), 0x0400);
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1.0f, -25)), 0x0000);               // tie 0 vs 1 ulp -> even (0)
  EXPECT_EQ(fp32_to_fp16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(fp32_to_fp16(std::ldexp(3.0f, -25)), 0x0002);               // 1.5 ulp ties to 2
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1.0f, -26)), 0x0000);
  EXPECT_EQ(fp32_to_fp16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(fp32_to_fp16(-std::numeric_limits<float>::denorm_min()), 0x8000);
  // Largest subnormal + half an ulp rounds (to even) up into the smallest normal.
  EXPECT_EQ(fp32_to_fp16(std::ldexp(2047.0f, -25)), 0x0400);
  // Normal ties: 1 + 2^-11 is halfway between 1 and 1 + 2^-10 -> even (1.0).
  EXPECT_EQ(fp32_to_fp16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(fp32_to_fp16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // odd -> rounds up
  EXPECT_EQ(fp32_to_fp16(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3c01);
}

// Nearest-even rounding checked against a double-precision model on random floats.
TEST(Fp16, RandomFloatsRoundToNearestEven) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-27, 15);  // covers zero-flush, subnormal and normal halves
  for (int i = 0; i < 200000; ++i) {
    const float f = std::ldexp(mant(rng), expo(rng)) * (i % 2 ? -1.0f : 1.0f);
    const uint16_t h = fp32_to_fp16(f);
    if ((h & 0x7fff) == 0x7c00) {  // overflow: only from the top binade's last half ulp
      ASSERT_GE(std::fabs(f), 65520.0f);
      continue;
    }
    const double back = fp16_to_fp32(h);
    const double err = std::fabs(back - static_cast<double>(f));
    // No other half is closer: compare with the neighbours one code away.
    for (int delta : {-1, 1}) {
      const uint16_t nb = static_cast<uint16_t>(h + delta);
      if ((nb & 0x7fff) >= 0x7c00 || ((h ^ nb) & 0x8000)) continue;
      const double other = std::fabs(static_cast<double>(fp16_to_fp32(nb)) - static_cast<double>(f));
      ASSERT_LE(err, other) << f;
      if (err == other) {
        ASSERT_EQ(h & 1, 0) << "tie must go to even: " << f;
      }
    }
  }
}

TEST(Bf16, CornerCases) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(fp32_to_bf16(inf), 0x7f80);
  EXPECT_EQ(fp32_to_bf16(-inf), 0xff80);
  EXPECT_EQ(fp32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(fp32_to_bf16(1.0f), 0x3f80);
  // Ties: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 -> even.
  EXPECT_EQ(fp32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(fp32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(fp32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to inf
  // A signalling NaN whose payload sits only in the low 16 bits must stay a (quiet) NaN.
  const float snan = std::bit_cast<float>(0x7f800001u);
  const uint16_t b = fp32_to_bf16(snan);
  EXPECT_TRUE(std::isnan(bf16_to_fp32(b)));
  EXPECT_NE(b & 0x40, 0);
  // Float subnormals keep their top bits (bf16 has the same exponent range).
  EXPECT_EQ(fp32_to_bf16(std::bit_cast<float>(0x00010000u)), 0x0001);
  EXPECT_EQ(bf16_to_fp32(0x0001), std::bit_cast<float>(0x00010000u));
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = bf16_to_fp32(static_cast<uint16_t>(h));
    if (!std::isnan(f)) {
      EXPECT_EQ(fp32_to_bf16(f), h) << std::hex << h;
    }
  }
}

}  // namespace
}  // namespace moraine
