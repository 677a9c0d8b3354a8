// The IQ grid formats (IQ2_XXS .. IQ1_M) on the CPU: the scalar reference dot equals the dot of
// the rows it decodes to (up to float rounding), every AVX-512 kernel is bitwise the reference
// over random blocks (random grid indices, signs and scales, activations down to -128) and
// extreme ones, and the formats are read-only: moraine refuses to write them, saying why.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/formats/block_layouts.h"
#include "common/formats/quant.h"
#include "common/formats/type_map.h"
#include "kernels/cpu/vec_dot.h"
#include "tests/formats/random_iq_blocks.h"
#include "tests/formats/random_rows.h"

namespace moraine {
namespace {

using test::kIqGridTypes;
constexpr double kU = 0x1p-24;

std::vector<float> decode(TensorType t, const std::vector<uint8_t>& q, int64_t n) {
  std::vector<float> y(static_cast<size_t>(n));
  dequantize_row(t, q.data(), y.data(), n);
  return y;
}

// Activations two ways: raw random Q8_K blocks, and a gaussian row through the Q8_K quantizer.
std::vector<std::vector<uint8_t>> activation_rows(int64_t n, uint32_t seed) {
  std::vector<uint8_t> quantized(row_bytes(TensorType::Q8_K, n));
  const std::vector<float> x = test::random_row(test::Dist::Outliers, n, seed);
  quantize_row(TensorType::Q8_K, x.data(), quantized.data(), n);
  return {test::random_q8_k_row(n, seed + 1), quantized};
}

// Block counts: one, odd, a 4096-wide row and a long odd one.
constexpr int64_t kLengths[] = {256, 3 * 256, 4096, 43 * 256};

// The reference is the dot of what the blocks decode to: integer sums are exact and each block
// adds a few roundings (scales, the int->float conversion, the running sum; and the decoder's own
// on the other side), so it is within (blocks + 8) * u * sum|w_i a_i| of the exact value, doubled.
TEST(IqVecDotReference, EqualsDotOfDecodedRows) {
  for (TensorType t : kIqGridTypes) {
    for (int64_t n : kLengths) {
      const std::vector<uint8_t> w = test::random_iq_row(t, n, 11u * static_cast<uint32_t>(n) + static_cast<uint32_t>(t));
      const std::vector<float> wd = decode(t, w, n);
      for (const std::vector<uint8_t>& a : activation_rows(n, 7u + static_cast<uint32_t>(n))) {
        const std::vector<float> ad = decode(TensorType::Q8_K, a, n);
        double exact = 0.0, magnitude = 0.0;
        for (size_t i = 0; i < wd.size(); ++i) {
          exact += static_cast<double>(wd[i]) * ad[i];
          magnitude += std::fabs(static_cast<double>(wd[i]) * ad[i]);
        }
        const double tol = 2.0 * (static_cast<double>(n / kQK_K) + 8.0) * kU * magnitude;
        EXPECT_NEAR(vec_dot_reference(t, n, w.data(), a.data()), exact, tol) << type_name(t) << " n=" << n;
        EXPECT_GT(magnitude, 0.0);
      }
    }
  }
}

// Blocks at the edges of each field: all bytes 0x00 or 0xff (first / last grid entries, all
// signs negative, the largest scales), alternating, against activations of -128 or 127.
std::vector<std::vector<uint8_t>> extreme_rows(TensorType t, int64_t n) {
  std::vector<std::vector<uint8_t>> rows;
  for (uint8_t fill : {uint8_t{0x00}, uint8_t{0xff}, uint8_t{0x55}, uint8_t{0xaa}}) {
    std::vector<uint8_t> r = test::random_iq_row(t, n, 99);  // for the scales
    std::vector<uint8_t> filled(r.size(), fill);
    const size_t bb = type_traits(t).block_bytes;
    for (size_t off = 0; off < r.size(); off += bb) {
      if (t == TensorType::IQ1_M) {
        for (int k = 0; k < 4; ++k) filled[off + 48 + 2 * k + 1] = static_cast<uint8_t>((fill & 0x0f) | (r[off + 48 + 2 * k + 1] & 0xf0));
      } else {
        std::memcpy(filled.data() + off, r.data() + off, 2);
      }
    }
    rows.push_back(filled);
  }
  return rows;
}

std::vector<uint8_t> constant_q8_k(int64_t n, int8_t q) {
  std::vector<BlockQ8_K> b(static_cast<size_t>(n / kQK_K));
  for (BlockQ8_K& x : b) {
    x.d = 0.01f;
    std::memset(x.qs, static_cast<uint8_t>(q), sizeof(x.qs));
    for (int16_t& s : x.bsums) s = static_cast<int16_t>(16 * q);
  }
  std::vector<uint8_t> row(b.size() * sizeof(BlockQ8_K));
  std::memcpy(row.data(), b.data(), row.size());
  return row;
}

TEST(IqVecDotAvx512, BitwiseEqualToReference) {
  const cpu::CpuIsa isa = cpu::hardware_cpu_isa();
  if (isa < cpu::CpuIsa::Avx512Vnni) GTEST_SKIP() << "CPU lacks AVX-512 VNNI (" << cpu::isa_name(isa) << ")";
  int checked = 0;
  for (TensorType t : kIqGridTypes) {
    const cpu::VecDotFn fn = cpu::vec_dot_fn(t, cpu::CpuIsa::Avx512Vnni);
    ASSERT_NE(fn, nullptr) << type_name(t);
    for (int64_t n : kLengths) {
      std::vector<std::vector<uint8_t>> weights;
      for (uint32_t s = 0; s < 4; ++s) weights.push_back(test::random_iq_row(t, n, 1000u * s + static_cast<uint32_t>(n) + static_cast<uint32_t>(t)));
      for (const std::vector<uint8_t>& e : extreme_rows(t, n)) weights.push_back(e);
      std::vector<std::vector<uint8_t>> acts = activation_rows(n, 31u * static_cast<uint32_t>(n));
      acts.push_back(constant_q8_k(n, -128));
      acts.push_back(constant_q8_k(n, 127));
      for (size_t wi = 0; wi < weights.size(); ++wi) {
        for (size_t ai = 0; ai < acts.size(); ++ai) {
          const float ref = vec_dot_reference(t, n, weights[wi].data(), acts[ai].data());
          const float got = fn(n, weights[wi].data(), acts[ai].data());
          ASSERT_FALSE(std::isnan(ref)) << type_name(t);
          EXPECT_EQ(got, ref) << type_name(t) << " n=" << n << " weights " << wi << " activations " << ai;
          EXPECT_EQ(cpu::vec_dot(t, n, weights[wi].data(), acts[ai].data()), got) << "vec_dot must pick the best kernel";
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 7 * 4 * 8 * 4);
}

TEST(IqVecDotDispatch, ScalarTierIsTheReferenceAndActivationsAreQ8K) {
  for (TensorType t : kIqGridTypes) {
    EXPECT_TRUE(type_traits(t).computable) << type_name(t);
    EXPECT_EQ(dot_activation_type(t), TensorType::Q8_K) << type_name(t);
    const cpu::VecDotFn fn = cpu::vec_dot_fn(t, cpu::CpuIsa::Scalar);
    ASSERT_NE(fn, nullptr) << type_name(t);
    const std::vector<uint8_t> w = test::random_iq_row(t, 1024, 5), a = test::random_q8_k_row(1024, 6);
    EXPECT_EQ(fn(1024, w.data(), a.data()), vec_dot_reference(t, 1024, w.data(), a.data())) << type_name(t);
    EXPECT_NE(cpu::best_vec_dot_fn(t, cpu::CpuIsa::Avx2), nullptr) << "below VNNI the scalar kernel serves " << type_name(t);
  }
}

TEST(IqFormats, WritingIsRefusedWithTheReason) {
  const std::vector<float> x(256, 0.5f);
  std::vector<uint8_t> out(256);
  for (TensorType t : kIqGridTypes) {
    try {
      quantize_row(t, x.data(), out.data(), 256);
      ADD_FAILURE() << "quantize_row(" << type_name(t) << ") must throw";
    } catch (const std::invalid_argument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(std::string(type_name(t))), std::string::npos) << msg;
      EXPECT_NE(msg.find("llama-quantize"), std::string::npos) << msg;
    }
    EXPECT_FALSE(is_weight_target(t)) << type_name(t) << " is not a type moraine-quantize can write";
    EXPECT_THROW(parse_weight_type(std::string(type_name(t)), "--map"), std::invalid_argument);
  }
  // The file type llama.cpp gives a file of mostly these tensors (its IQ2_S file type stores
  // IQ2_XS tensors; IQ2_S ones are its IQ2_M), from llama-quant.cpp's default-type table.
  EXPECT_EQ(llama_file_type(TensorType::IQ2_XXS), 19u);
  EXPECT_EQ(llama_file_type(TensorType::IQ2_XS), 20u);
  EXPECT_EQ(llama_file_type(TensorType::IQ3_XXS), 23u);
  EXPECT_EQ(llama_file_type(TensorType::IQ1_S), 24u);
  EXPECT_EQ(llama_file_type(TensorType::IQ3_S), 26u);
  EXPECT_EQ(llama_file_type(TensorType::IQ2_S), 29u);
  EXPECT_EQ(llama_file_type(TensorType::IQ1_M), 31u);
  // Rows must still be whole blocks.
  std::vector<float> y(300);
  EXPECT_THROW(dequantize_row(TensorType::IQ2_XXS, out.data(), y.data(), 300), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
