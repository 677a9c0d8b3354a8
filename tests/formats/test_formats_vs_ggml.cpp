// Cross-check against llama.cpp's own C reference (ggml-quants.c and the generic dots of
// ggml-cpu/quants.c, compiled from the oracle cache): decoding is bit-identical on blocks from
// either quantizer, the formats whose quantizer is a fixed rule write identical bytes, our
// k-quant search is no worse than ggml's reference quantizer, and the dots agree to float
// rounding.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "tests/formats/dot_bounds.h"
#include "tests/formats/random_rows.h"

#ifndef MORAINE_GGML_ORACLE_MISSING
extern "C" {
void moraine_ggml_oracle_init(void);
uint16_t moraine_ggml_fp32_to_fp16(float);
float moraine_ggml_fp16_to_fp32(uint16_t);
uint16_t moraine_ggml_fp32_to_bf16(float);
#define MORAINE_GGML_FORMAT(name)                                     \
  void quantize_row_##name##_ref(const float*, void*, int64_t); \
  void dequantize_row_##name(const void*, float*, int64_t);
MORAINE_GGML_FORMAT(q4_0)
MORAINE_GGML_FORMAT(q8_0)
MORAINE_GGML_FORMAT(mxfp4)
MORAINE_GGML_FORMAT(q2_K)
MORAINE_GGML_FORMAT(q3_K)
MORAINE_GGML_FORMAT(q4_K)
MORAINE_GGML_FORMAT(q5_K)
MORAINE_GGML_FORMAT(q6_K)
MORAINE_GGML_FORMAT(q8_K)
#define MORAINE_GGML_DOT(name) void ggml_vec_dot_##name##_generic(int, float*, size_t, const void*, size_t, const void*, size_t, int);
MORAINE_GGML_DOT(q4_0_q8_0)
MORAINE_GGML_DOT(q8_0_q8_0)
MORAINE_GGML_DOT(mxfp4_q8_0)
MORAINE_GGML_DOT(q2_K_q8_K)
MORAINE_GGML_DOT(q3_K_q8_K)
MORAINE_GGML_DOT(q4_K_q8_K)
MORAINE_GGML_DOT(q5_K_q8_K)
MORAINE_GGML_DOT(q6_K_q8_K)
}
#endif

namespace moraine {
namespace {

#ifdef MORAINE_GGML_ORACLE_MISSING
TEST(FormatsVsGgml, OracleCachePresent) {
  FAIL() << "llama.cpp sources not found under " MORAINE_SOURCE_DIR "/.cache/oracle/llama.cpp when this test was "
            "configured; run tests/oracle/setup and re-run cmake";
}
#else

using test::Dist;
using GgmlDot = void (*)(int, float*, size_t, const void*, size_t, const void*, size_t, int);

struct Format {
  TensorType type;
  void (*quantize)(const float*, void*, int64_t);
  void (*dequantize)(const void*, float*, int64_t);
  GgmlDot dot;                 // nullptr for the activation-only Q8_K
  bool same_quantizer_rule;    // ggml's reference quantizer is a fixed formula we follow exactly
};

const Format kFormats[] = {
    {TensorType::Q4_0, quantize_row_q4_0_ref, dequantize_row_q4_0, ggml_vec_dot_q4_0_q8_0_generic, true},
    {TensorType::Q8_0, quantize_row_q8_0_ref, dequantize_row_q8_0, ggml_vec_dot_q8_0_q8_0_generic, true},
    {TensorType::MXFP4, quantize_row_mxfp4_ref, dequantize_row_mxfp4, ggml_vec_dot_mxfp4_q8_0_generic, true},
    {TensorType::Q2_K, quantize_row_q2_K_ref, dequantize_row_q2_K, ggml_vec_dot_q2_K_q8_K_generic, false},
    {TensorType::Q3_K, quantize_row_q3_K_ref, dequantize_row_q3_K, ggml_vec_dot_q3_K_q8_K_generic, false},
    {TensorType::Q4_K, quantize_row_q4_K_ref, dequantize_row_q4_K, ggml_vec_dot_q4_K_q8_K_generic, false},
    {TensorType::Q5_K, quantize_row_q5_K_ref, dequantize_row_q5_K, ggml_vec_dot_q5_K_q8_K_generic, false},
    {TensorType::Q6_K, quantize_row_q6_K_ref, dequantize_row_q6_K, ggml_vec_dot_q6_K_q8_K_generic, false},
    {TensorType::Q8_K, quantize_row_q8_K_ref, dequantize_row_q8_K, nullptr, true},
};

class FormatsVsGgml : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { moraine_ggml_oracle_init(); }
};

std::vector<uint8_t> ggml_quantize(const Format& f, const std::vector<float>& x) {
  std::vector<uint8_t> q(row_bytes(f.type, static_cast<int64_t>(x.size())));
  f.quantize(x.data(), q.data(), static_cast<int64_t>(x.size()));
  return q;
}

std::vector<uint8_t> our_quantize(TensorType t, const std::vector<float>& x) {
  std::vector<uint8_t> q(row_bytes(t, static_cast<int64_t>(x.size())));
  quantize_row(t, x.data(), q.data(), static_cast<int64_t>(x.size()));
  return q;
}

double rel_rmse(const std::vector<float>& y, const std::vector<float>& x) {
  double se = 0.0, ss = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    se += (static_cast<double>(y[i]) - x[i]) * (static_cast<double>(y[i]) - x[i]);
    ss += static_cast<double>(x[i]) * x[i];
  }
  return std::sqrt(se / ss);
}

TEST_F(FormatsVsGgml, HalfConversionsMatch) {
  std::mt19937 rng(3);
  for (int i = 0; i < 1000000; ++i) {
    const float f = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    if (std::isnan(f)) continue;  // NaN payloads may differ; both stay NaN (test_half_float)
    ASSERT_EQ(fp32_to_fp16(f), moraine_ggml_fp32_to_fp16(f)) << f;
    ASSERT_EQ(fp32_to_bf16(f), moraine_ggml_fp32_to_bf16(f)) << f;
  }
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float a = fp16_to_fp32(static_cast<uint16_t>(h)), g = moraine_ggml_fp16_to_fp32(static_cast<uint16_t>(h));
    if (!std::isnan(g)) {
      ASSERT_EQ(std::bit_cast<uint32_t>(a), std::bit_cast<uint32_t>(g)) << std::hex << h;
    }
  }
}

TEST_F(FormatsVsGgml, BlocksDecodeIdenticallyAndQuantizersAgree) {
  for (const Format& f : kFormats) {
    for (Dist d : test::kAllDists) {
      const int64_t n = 4096;
      const std::vector<float> x = test::random_row(d, n, 4242u + static_cast<uint32_t>(f.type) * 13u + static_cast<uint32_t>(d));
      const std::string what = std::string(type_name(f.type)) + " " + test::dist_name(d);
      const std::vector<uint8_t> theirs = ggml_quantize(f, x), ours = our_quantize(f.type, x);
      std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
      for (const std::vector<uint8_t>* q : {&theirs, &ours}) {
        dequantize_row(f.type, q->data(), a.data(), n);
        f.dequantize(q->data(), b.data(), n);
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(std::bit_cast<uint32_t>(a[static_cast<size_t>(i)]), std::bit_cast<uint32_t>(b[static_cast<size_t>(i)]))
              << what << " element " << i << (q == &theirs ? " (ggml's blocks)" : " (our blocks)");
        }
      }
      if (f.same_quantizer_rule) {
        EXPECT_EQ(ours, theirs) << what << ": same rule, must be the same bytes";
      } else {
        // Our k-quant search differs from ggml's; demand comparable quality: at most 5% more
        // RMSE (0.4 dB) than llama.cpp's reference quantizer on the same row.
        dequantize_row(f.type, ours.data(), a.data(), n);
        f.dequantize(theirs.data(), b.data(), n);
        EXPECT_LE(rel_rmse(a, x), 1.05 * rel_rmse(b, x)) << what;
      }
    }
  }
}

// The dots agree to float rounding: both sum blocks exactly in integers and differ only in
// how the float terms are accumulated (ggml's k-quant dots use 8 float lanes), so each is within
// (blocks + 8) * u * magnitude of the exact value (see test_vec_dot.cpp).
TEST_F(FormatsVsGgml, DotsAgree) {
  for (const Format& f : kFormats) {
    if (!f.dot) continue;
    for (Dist d : test::kAllDists) {
      const int64_t n = 4096;
      const std::vector<float> x = test::random_row(d, n, 777u + static_cast<uint32_t>(f.type) + static_cast<uint32_t>(d));
      const std::vector<float> y = test::random_row(Dist::Gaussian, n, 778u + static_cast<uint32_t>(f.type));
      const TensorType act = dot_activation_type(f.type);
      const std::vector<uint8_t> wq = ggml_quantize(f, x), aq = our_quantize(act, y);
      std::vector<float> w_deq(static_cast<size_t>(n)), a_deq(static_cast<size_t>(n));
      dequantize_row(f.type, wq.data(), w_deq.data(), n);
      dequantize_row(act, aq.data(), a_deq.data(), n);
      float theirs = 0.0f;
      f.dot(static_cast<int>(n), &theirs, 0, wq.data(), 0, aq.data(), 0, 1);
      const float ours = vec_dot_reference(f.type, n, wq.data(), aq.data());
      const double blocks = static_cast<double>(n / type_traits(f.type).block_elems);
      EXPECT_NEAR(ours, theirs, 2.0 * 2.0 * (blocks + 8.0) * 0x1p-24 * test::dot_magnitude(f.type, wq, w_deq, a_deq))
          << type_name(f.type) << " " << test::dist_name(d);
    }
  }
}

#endif  // MORAINE_GGML_ORACLE_MISSING

}  // namespace
}  // namespace moraine
