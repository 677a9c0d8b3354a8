// The IQ grid formats against llama.cpp's own C code (ggml-quants.c and the generic dots of
// ggml-cpu/quants.c, built from the oracle cache): decoding and the dot with Q8_K activations
// are bit-identical, on random blocks (every grid entry drawn, random signs and scales) and on
// blocks ggml's own importance-matrix quantizer wrote.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "tests/formats/random_iq_blocks.h"
#include "tests/formats/random_rows.h"

#ifndef MORAINE_GGML_ORACLE_MISSING
extern "C" {
void moraine_ggml_oracle_init(void);
// ggml-quants.h (enum ggml_type passed as its integer id; ggml's quantizer tables for the type).
void iq2xs_init_impl(int type);
void iq3xs_init_impl(int grid_size);
#define MORAINE_GGML_IQ(name)                                                                        \
  void dequantize_row_##name(const void*, float*, int64_t);                                           \
  size_t quantize_##name(const float*, void*, int64_t nrow, int64_t n_per_row, const float* imatrix); \
  void ggml_vec_dot_##name##_q8_K_generic(int, float*, size_t, const void*, size_t, const void*, size_t, int);
MORAINE_GGML_IQ(iq2_xxs)
MORAINE_GGML_IQ(iq2_xs)
MORAINE_GGML_IQ(iq2_s)
MORAINE_GGML_IQ(iq3_xxs)
MORAINE_GGML_IQ(iq3_s)
MORAINE_GGML_IQ(iq1_s)
MORAINE_GGML_IQ(iq1_m)
}
#endif

namespace moraine {
namespace {

#ifdef MORAINE_GGML_ORACLE_MISSING
TEST(IqVsGgml, OracleCachePresent) {
  FAIL() << "llama.cpp sources not found under " MORAINE_SOURCE_DIR "/.cache/oracle/llama.cpp when this test was "
            "configured; run tests/oracle/setup and re-run cmake";
}
#else

using GgmlDot = void (*)(int, float*, size_t, const void*, size_t, const void*, size_t, int);
struct IqFormat {
  TensorType type;
  void (*dequantize)(const void*, float*, int64_t);
  size_t (*quantize)(const float*, void*, int64_t, int64_t, const float*);
  GgmlDot dot;
};

#define MORAINE_IQ_ROW(T, name) {TensorType::T, dequantize_row_##name, quantize_##name, ggml_vec_dot_##name##_q8_K_generic}
const IqFormat kFormats[] = {MORAINE_IQ_ROW(IQ2_XXS, iq2_xxs), MORAINE_IQ_ROW(IQ2_XS, iq2_xs), MORAINE_IQ_ROW(IQ2_S, iq2_s),
                             MORAINE_IQ_ROW(IQ3_XXS, iq3_xxs), MORAINE_IQ_ROW(IQ3_S, iq3_s),   MORAINE_IQ_ROW(IQ1_S, iq1_s),
                             MORAINE_IQ_ROW(IQ1_M, iq1_m)};

class IqVsGgml : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { moraine_ggml_oracle_init(); }
};

// Whether the test runs ggml's quantizer for `t`, initializing its search tables. Their set-up
// takes 2.6 s (IQ2_XXS), 0.4 / 0.8 s (IQ3_XXS / IQ3_S), but 7, 15 and 39 s for IQ2_XS, IQ2_S and
// IQ1_S / IQ1_M (measured on the 2-core box): those get random blocks only, which cover every
// bit pattern a quantizer can write (decoding depends on the bytes alone).
bool ggml_quantizer_ready(TensorType t) {
  switch (t) {
    case TensorType::IQ2_XXS: iq2xs_init_impl(static_cast<int>(t)); return true;
    case TensorType::IQ3_XXS: iq3xs_init_impl(256); return true;
    case TensorType::IQ3_S: iq3xs_init_impl(512); return true;
    default: return false;
  }
}

// ggml's quantizer on a row, with an importance matrix of x^2 + mean (the shape llama-imatrix
// gives: larger weight where activations are larger).
std::vector<uint8_t> ggml_quantize(const IqFormat& f, const std::vector<float>& x) {
  const auto n = static_cast<int64_t>(x.size());
  std::vector<float> imatrix(x.size());
  for (size_t i = 0; i < x.size(); ++i) imatrix[i] = 0.5f + x[i] * x[i];
  std::vector<uint8_t> q(row_bytes(f.type, n));
  EXPECT_EQ(f.quantize(x.data(), q.data(), 1, n, imatrix.data()), q.size());
  return q;
}

void expect_same_decoding(const IqFormat& f, const std::vector<uint8_t>& q, const std::string& what) {
  const auto n = static_cast<int64_t>(q.size() / type_traits(f.type).block_bytes) * kQK_K;
  std::vector<float> ours(static_cast<size_t>(n)), theirs(static_cast<size_t>(n));
  dequantize_row(f.type, q.data(), ours.data(), n);
  f.dequantize(q.data(), theirs.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(ours[static_cast<size_t>(i)]), std::bit_cast<uint32_t>(theirs[static_cast<size_t>(i)]))
        << type_name(f.type) << " " << what << " element " << i << ": " << ours[static_cast<size_t>(i)] << " vs "
        << theirs[static_cast<size_t>(i)];
  }
}

void expect_same_dot(const IqFormat& f, const std::vector<uint8_t>& w, const std::vector<uint8_t>& a, const std::string& what) {
  const auto n = static_cast<int64_t>(w.size() / type_traits(f.type).block_bytes) * kQK_K;
  float theirs = 0.0f;
  f.dot(static_cast<int>(n), &theirs, 0, w.data(), 0, a.data(), 0, 1);
  const float ours = vec_dot_reference(f.type, n, w.data(), a.data());
  ASSERT_FALSE(std::isnan(theirs)) << what;
  EXPECT_EQ(std::bit_cast<uint32_t>(ours), std::bit_cast<uint32_t>(theirs)) << type_name(f.type) << " " << what << ": " << ours << " vs " << theirs;
}

// 2048 random blocks hold 65536 grid indices: each entry of the largest codebook (IQ1's 2048) is
// drawn with probability 1 - e^-32, so a wrong table entry would show.
TEST_F(IqVsGgml, RandomBlocksDecodeIdentically) {
  for (const IqFormat& f : kFormats) expect_same_decoding(f, test::random_iq_row(f.type, 2048 * kQK_K, 17u + static_cast<uint32_t>(f.type)), "random blocks");
}

TEST_F(IqVsGgml, GgmlQuantizedBlocksDecodeAndDotIdentically) {
  int quantized = 0;
  for (const IqFormat& f : kFormats) {
    if (!ggml_quantizer_ready(f.type)) continue;
    ++quantized;
    for (test::Dist d : test::kAllDists) {
      const std::vector<float> x = test::random_row(d, 4096, 300u + static_cast<uint32_t>(f.type) * 7u + static_cast<uint32_t>(d));
      const std::vector<uint8_t> q = ggml_quantize(f, x);
      expect_same_decoding(f, q, "ggml-quantized " + test::dist_name(d));
      std::vector<uint8_t> act(row_bytes(TensorType::Q8_K, 4096));
      const std::vector<float> y = test::random_row(test::Dist::Gaussian, 4096, 301u + static_cast<uint32_t>(d));
      quantize_row(TensorType::Q8_K, y.data(), act.data(), 4096);
      expect_same_dot(f, q, act, "ggml-quantized " + test::dist_name(d));
    }
  }
  EXPECT_EQ(quantized, 3);
}

TEST_F(IqVsGgml, DotsBitIdentical) {
  for (const IqFormat& f : kFormats) {
    for (int64_t n : {int64_t{256}, int64_t{7 * 256}, int64_t{4096}}) {
      const auto seed = static_cast<uint32_t>(n) + 13u * static_cast<uint32_t>(f.type);
      std::vector<uint8_t> quantized_act(row_bytes(TensorType::Q8_K, n));
      const std::vector<float> y = test::random_row(test::Dist::Gaussian, n, seed + 1);
      quantize_row(TensorType::Q8_K, y.data(), quantized_act.data(), n);
      const std::vector<uint8_t> random_act = test::random_q8_k_row(n, seed + 2);
      const std::vector<uint8_t> random_w = test::random_iq_row(f.type, n, seed + 3);
      const std::string len = " n=" + std::to_string(n);
      expect_same_dot(f, random_w, random_act, "random weights, random activations" + len);
      expect_same_dot(f, random_w, quantized_act, "random weights, quantized activations" + len);
    }
  }
}

#endif  // MORAINE_GGML_ORACLE_MISSING

}  // namespace
}  // namespace moraine
