// Q4_1, Q5_0, Q5_1, Q8_1, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0 against llama.cpp's own C code (ggml-quants.c
// and the generic dots of ggml-cpu/quants.c, compiled from the oracle cache): the reference
// quantizers write ggml's bytes, decoding is bit-identical, and every dot -- the scalar
// reference and the best CPU kernel -- returns exactly the float ggml's generic C dot returns
// (same integer sums, same float expression and order).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cpu/vec_dot.h"
#include "tests/formats/random_rows.h"

#ifndef MORAINE_GGML_ORACLE_MISSING
extern "C" {
void moraine_ggml_oracle_init(void);
#define MORAINE_GGML_FORMAT(name)                               \
  void quantize_row_##name##_ref(const float*, void*, int64_t); \
  void dequantize_row_##name(const void*, float*, int64_t);
MORAINE_GGML_FORMAT(q4_1)
MORAINE_GGML_FORMAT(q5_0)
MORAINE_GGML_FORMAT(q5_1)
MORAINE_GGML_FORMAT(iq4_nl)
MORAINE_GGML_FORMAT(iq4_xs)
MORAINE_GGML_FORMAT(tq1_0)
MORAINE_GGML_FORMAT(tq2_0)
void quantize_row_q8_1_ref(const float*, void*, int64_t);
#define MORAINE_GGML_DOT(name) void ggml_vec_dot_##name##_generic(int, float*, size_t, const void*, size_t, const void*, size_t, int);
MORAINE_GGML_DOT(q4_1_q8_1)
MORAINE_GGML_DOT(q5_0_q8_0)
MORAINE_GGML_DOT(q5_1_q8_1)
MORAINE_GGML_DOT(iq4_nl_q8_0)
MORAINE_GGML_DOT(iq4_xs_q8_K)
MORAINE_GGML_DOT(tq1_0_q8_K)
MORAINE_GGML_DOT(tq2_0_q8_K)
}
#endif

namespace moraine {
namespace {

#ifdef MORAINE_GGML_ORACLE_MISSING
TEST(FormatsVsGgmlLegacyIq4, OracleCachePresent) {
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
  GgmlDot dot;
};

const Format kFormats[] = {
    {TensorType::Q4_1, quantize_row_q4_1_ref, dequantize_row_q4_1, ggml_vec_dot_q4_1_q8_1_generic},
    {TensorType::Q5_0, quantize_row_q5_0_ref, dequantize_row_q5_0, ggml_vec_dot_q5_0_q8_0_generic},
    {TensorType::Q5_1, quantize_row_q5_1_ref, dequantize_row_q5_1, ggml_vec_dot_q5_1_q8_1_generic},
    {TensorType::IQ4_NL, quantize_row_iq4_nl_ref, dequantize_row_iq4_nl, ggml_vec_dot_iq4_nl_q8_0_generic},
    {TensorType::IQ4_XS, quantize_row_iq4_xs_ref, dequantize_row_iq4_xs, ggml_vec_dot_iq4_xs_q8_K_generic},
    {TensorType::TQ1_0, quantize_row_tq1_0_ref, dequantize_row_tq1_0, ggml_vec_dot_tq1_0_q8_K_generic},
    {TensorType::TQ2_0, quantize_row_tq2_0_ref, dequantize_row_tq2_0, ggml_vec_dot_tq2_0_q8_K_generic},
};

class FormatsVsGgmlLegacyIq4 : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { moraine_ggml_oracle_init(); }
};

std::vector<uint8_t> ggml_quantize(void (*q)(const float*, void*, int64_t), TensorType t, const std::vector<float>& x) {
  std::vector<uint8_t> out(row_bytes(t, static_cast<int64_t>(x.size())));
  q(x.data(), out.data(), static_cast<int64_t>(x.size()));
  return out;
}

std::vector<uint8_t> our_quantize(TensorType t, const std::vector<float>& x) {
  std::vector<uint8_t> out(row_bytes(t, static_cast<int64_t>(x.size())));
  quantize_row(t, x.data(), out.data(), static_cast<int64_t>(x.size()));
  return out;
}

// The test rows: the three random shapes at unit scale, then scaled to the edges of what fp16
// block scales hold (tiny: near the fp16 subnormal range; large: block maxima in the
// thousands, where q8_1's s = d * sum(q) nears fp16's limit), and a ternary-valued row
// (TQ files hold {-1, 0, 1} * scale) with ties at +-0.5.
std::vector<std::pair<std::string, std::vector<float>>> test_rows(int64_t n, uint32_t seed) {
  std::vector<std::pair<std::string, std::vector<float>>> rows;
  for (Dist d : test::kAllDists) rows.emplace_back(test::dist_name(d), test::random_row(d, n, seed + static_cast<uint32_t>(d)));
  for (float scale : {3e-5f, 1e-3f, 40.0f, 400.0f}) {
    std::vector<float> x = test::random_row(Dist::Outliers, n, seed + 7);
    for (float& v : x) v *= scale;
    rows.emplace_back("outliers*" + std::to_string(scale), x);
  }
  std::mt19937 rng(seed + 11);
  std::vector<float> ternary(static_cast<size_t>(n));
  for (size_t i = 0; i < ternary.size(); ++i) {
    const int t = static_cast<int>(rng() % 5);  // -1, -0.5, 0, 0.5, 1
    ternary[i] = 0.25f * static_cast<float>(t - 2) * 0.5f * 4.0f;
  }
  rows.emplace_back("ternary", ternary);
  return rows;
}

TEST_F(FormatsVsGgmlLegacyIq4, QuantizersWriteGgmlBytesAndBlocksDecodeIdentically) {
  std::vector<Format> formats(std::begin(kFormats), std::end(kFormats));
  formats.push_back({TensorType::Q8_1, quantize_row_q8_1_ref, nullptr, nullptr});
  for (const Format& f : formats) {
    for (const auto& [name, x] : test_rows(4096, 4242u + static_cast<uint32_t>(f.type) * 13u)) {
      const int64_t n = static_cast<int64_t>(x.size());
      const std::string what = std::string(type_name(f.type)) + " " + name;
      const std::vector<uint8_t> theirs = ggml_quantize(f.quantize, f.type, x), ours = our_quantize(f.type, x);
      EXPECT_EQ(ours, theirs) << what << ": the reference rule, so the same bytes";
      if (!f.dequantize) continue;
      std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
      dequantize_row(f.type, theirs.data(), a.data(), n);
      f.dequantize(theirs.data(), b.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(a[static_cast<size_t>(i)]), std::bit_cast<uint32_t>(b[static_cast<size_t>(i)]))
            << what << " element " << i;
      }
    }
  }
}

// Random bytes are valid blocks of every one of these formats but for the fp16 scales, which
// are drawn finite here: decoding and the dots must still agree bit for bit.
std::vector<uint8_t> random_blocks(TensorType t, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> q(row_bytes(t, n));
  for (uint8_t& v : q) v = static_cast<uint8_t>(rng());
  const size_t bb = type_traits(t).block_bytes;
  size_t d_off = 0;
  if (t == TensorType::TQ1_0) d_off = 52;
  if (t == TensorType::TQ2_0) d_off = 64;
  const bool has_min = t == TensorType::Q4_1 || t == TensorType::Q5_1;
  for (size_t b = 0; b < q.size(); b += bb) {
    for (size_t off : {d_off, has_min ? size_t{2} : d_off}) {
      const uint16_t h = fp32_to_fp16(std::ldexp(static_cast<float>(rng() % 1000 + 1) / 1000.0f, static_cast<int>(rng() % 20) - 14) *
                                      (rng() % 2 ? 1.0f : -1.0f));
      std::memcpy(q.data() + b + off, &h, 2);
    }
  }
  return q;
}

TEST_F(FormatsVsGgmlLegacyIq4, DotsBitIdenticalToGgmlGeneric) {
  int checked = 0;
  for (const Format& f : kFormats) {
    const TensorType act = dot_activation_type(f.type);
    const cpu::VecDotFn fast = cpu::best_vec_dot_fn(f.type);
    ASSERT_NE(fast, nullptr) << type_name(f.type);
    const int64_t block = type_traits(f.type).block_elems;
    for (int64_t n : {block, 5 * block, 11 * block, int64_t{4096}}) {
      for (const auto& [name, x] : test_rows(n, 777u + static_cast<uint32_t>(f.type) + static_cast<uint32_t>(n))) {
        const std::vector<float> y = test::random_row(Dist::Outliers, n, 778u + static_cast<uint32_t>(f.type) + static_cast<uint32_t>(n));
        const std::vector<uint8_t> aq = our_quantize(act, y);
        for (int src = 0; src < 2; ++src) {
          const std::vector<uint8_t> wq = src == 0 ? ggml_quantize(f.quantize, f.type, x) : random_blocks(f.type, n, static_cast<uint32_t>(n) + 5u);
          const std::string what = std::string(type_name(f.type)) + " n=" + std::to_string(n) + " " + (src == 0 ? name : "random blocks");
          float theirs = 0.0f;
          f.dot(static_cast<int>(n), &theirs, 0, wq.data(), 0, aq.data(), 0, 1);
          const float ours = vec_dot_reference(f.type, n, wq.data(), aq.data());
          ASSERT_EQ(std::bit_cast<uint32_t>(ours), std::bit_cast<uint32_t>(theirs)) << what << ": " << ours << " vs " << theirs;
          const float simd = fast(n, wq.data(), aq.data());
          ASSERT_EQ(std::bit_cast<uint32_t>(simd), std::bit_cast<uint32_t>(theirs))
              << what << " (" << cpu::isa_name(cpu::hardware_cpu_isa()) << " kernel): " << simd << " vs " << theirs;
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 0);
}

#endif  // MORAINE_GGML_ORACLE_MISSING

}  // namespace
}  // namespace moraine
