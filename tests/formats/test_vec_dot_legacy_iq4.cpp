// Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0 dots: every tier's kernel bitwise equal to the
// scalar reference over random rows of ragged block counts and extreme scales, the reference
// against the dequantized rows it stands for, and the Q8_1 activation quantizers.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/formats/block_layouts.h"
#include "common/formats/quant.h"
#include "kernels/cpu/vec_dot.h"
#include "tests/formats/random_rows.h"

namespace moraine {
namespace {

using test::Dist;
constexpr double kU = 0x1p-24;

const TensorType kTypes[] = {TensorType::Q4_1, TensorType::Q5_0, TensorType::Q5_1, TensorType::IQ4_NL,
                             TensorType::IQ4_XS, TensorType::TQ1_0, TensorType::TQ2_0};
// The AVX2 and AVX-512 VNNI tiers have kernels for these; TQ1_0 / TQ2_0 run the reference on every tier.
bool has_vnni_kernel(TensorType t) { return t != TensorType::TQ1_0 && t != TensorType::TQ2_0; }

std::vector<uint8_t> quantized(TensorType t, const std::vector<float>& x) {
  std::vector<uint8_t> q(row_bytes(t, static_cast<int64_t>(x.size())));
  quantize_row(t, x.data(), q.data(), static_cast<int64_t>(x.size()));
  return q;
}

std::vector<float> scaled(std::vector<float> x, float s) {
  for (float& v : x) v *= s;
  return x;
}

// Rows of 1..17 blocks (every tail of the kernels' 8-block groups and 2-block pairs) and 4096
// elements, the three random shapes, and weight / activation scales from 1e-4 to 300 (fp16
// block scales from subnormal to ~1e3; q8_1's s up to ~1e4).
template <typename F>
void for_each_row_pair(TensorType t, F f) {
  const int64_t block = type_traits(t).block_elems;
  std::vector<int64_t> lengths;
  for (int64_t b = 1; b <= 17; ++b) lengths.push_back(b * block);
  lengths.push_back(4096);
  for (int64_t n : lengths) {
    if (n % block != 0) continue;
    for (Dist d : test::kAllDists) {
      for (const auto& [ws, as] : {std::pair{1.0f, 1.0f}, {1e-4f, 1.0f}, {300.0f, 1.0f}, {1.0f, 1e-3f}, {1.0f, 200.0f}, {300.0f, 200.0f}}) {
        {
          const uint32_t seed = static_cast<uint32_t>(n) * 7u + static_cast<uint32_t>(t) * 131u + static_cast<uint32_t>(d);
          const std::vector<float> w = scaled(test::random_row(d, n, seed), ws);
          const std::vector<float> a = scaled(test::random_row(Dist::Outliers, n, seed + 1), as);
          f(n, quantized(t, w), quantized(dot_activation_type(t), a),
            std::string(type_name(t)) + " " + test::dist_name(d) + " n=" + std::to_string(n) + " w*" + std::to_string(ws) +
                " a*" + std::to_string(as));
        }
      }
    }
  }
}

TEST(VecDotLegacyIq4, EveryTierBitwiseEqualsTheReference) {
  int simd_checked = 0;
  for (TensorType t : kTypes) {
    std::vector<std::pair<cpu::CpuIsa, cpu::VecDotFn>> kernels;
    for (cpu::CpuIsa isa : {cpu::CpuIsa::Scalar, cpu::CpuIsa::Avx2, cpu::CpuIsa::Avx512, cpu::CpuIsa::Avx512Vnni, cpu::CpuIsa::Amx}) {
      if (isa > cpu::hardware_cpu_isa()) continue;
      const cpu::VecDotFn fn = cpu::best_vec_dot_fn(t, isa);
      ASSERT_NE(fn, nullptr) << type_name(t) << " " << cpu::isa_name(isa);
      if ((isa == cpu::CpuIsa::Avx2 || isa >= cpu::CpuIsa::Avx512Vnni) && has_vnni_kernel(t)) {
        ASSERT_EQ(fn, cpu::vec_dot_fn(t, isa == cpu::CpuIsa::Amx ? cpu::CpuIsa::Avx512Vnni : isa)) << type_name(t) << ": the tier's own kernel";
        ASSERT_NE(fn, cpu::vec_dot_fn(t, cpu::CpuIsa::Scalar)) << type_name(t);
      }
      kernels.emplace_back(isa, fn);
    }
    for_each_row_pair(t, [&](int64_t n, const std::vector<uint8_t>& wq, const std::vector<uint8_t>& aq, const std::string& what) {
      const float ref = vec_dot_reference(t, n, wq.data(), aq.data());
      for (const auto& [isa, fn] : kernels) {
        const float got = fn(n, wq.data(), aq.data());
        ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(ref)) << what << " " << cpu::isa_name(isa) << ": " << got << " vs " << ref;
        if (fn != cpu::vec_dot_fn(t, cpu::CpuIsa::Scalar)) ++simd_checked;
      }
    });
  }
  if (cpu::hardware_cpu_isa() >= cpu::CpuIsa::Avx512Vnni) {
    EXPECT_GT(simd_checked, 0);
  } else {
    std::printf("CPU below AVX-512 VNNI (%s): only the reference tier was compared\n", std::string(cpu::isa_name(cpu::hardware_cpu_isa())).c_str());
  }
}

// The reference against sum(w_deq * a_deq) in double: integer block sums are exact, each block
// adds a few float roundings of its terms (2 (blocks + 8) u sum |terms|, as test_vec_dot.cpp),
// and the q8_1 pairings apply the weight's min through s = fp16(d * sum(q)) with the float d,
// where sum(a_deq) = fp16(d) * sum(q): two fp16 roundings apart, so 2 * 2^-11 |m| |s| more per
// block.
TEST(VecDotLegacyIq4, ReferenceEqualsDotOfDequantizedRows) {
  for (TensorType t : kTypes) {
    const TensorType act = dot_activation_type(t);
    for_each_row_pair(t, [&](int64_t n, const std::vector<uint8_t>& wq, const std::vector<uint8_t>& aq, const std::string& what) {
      std::vector<float> wd(static_cast<size_t>(n)), ad(static_cast<size_t>(n));
      dequantize_row(t, wq.data(), wd.data(), n);
      dequantize_row(act, aq.data(), ad.data(), n);
      double exact = 0.0, magnitude = 0.0, s_slack = 0.0;
      for (size_t i = 0; i < wd.size(); ++i) {
        exact += static_cast<double>(wd[i]) * ad[i];
        magnitude += std::fabs(static_cast<double>(wd[i]) * ad[i]);
      }
      if (act == TensorType::Q8_1) {
        const size_t bb = type_traits(t).block_bytes;
        for (int64_t b = 0; b < n / 32; ++b) {
          uint16_t m, s;
          std::memcpy(&m, wq.data() + static_cast<size_t>(b) * bb + 2, 2);
          std::memcpy(&s, aq.data() + static_cast<size_t>(b) * sizeof(BlockQ8_1) + 2, 2);
          const double mm = std::fabs(fp16_to_fp32(m)), ss = std::fabs(fp16_to_fp32(s));
          s_slack += 2.0 * 0x1p-11 * mm * ss;
          magnitude += 32.0 * mm * (ss + 1.0);  // the min part is rounded on its own too
        }
      }
      const double blocks = static_cast<double>(n / type_traits(t).block_elems) * (t == TensorType::IQ4_XS ? 8 : 1);
      const double tol = 2.0 * (blocks + 8.0) * kU * magnitude + s_slack;
      EXPECT_NEAR(vec_dot_reference(t, n, wq.data(), aq.data()), exact, tol) << what;
    });
  }
}

// quantize_activation_row writes quantize_row's q8_1 bytes; the llama.cpp-x86 rule keeps q8_0's
// x86 quants and scale (quantize_activation_row_llama_x86) and adds s = fp16(d * sum(q)).
TEST(QuantizeActivationQ8_1, ReferenceBytesAndTheLlamaX86Rule) {
  std::vector<std::vector<float>> rows;
  for (Dist d : test::kAllDists) rows.push_back(test::random_row(d, 4096, 901 + static_cast<uint32_t>(d)));
  std::vector<float> halves(4096);
  for (size_t i = 0; i < halves.size(); ++i) halves[i] = (i % 32 == 0) ? 127.0f : static_cast<float>(static_cast<int>(i % 253) - 126) + 0.5f;
  rows.push_back(halves);
  rows.push_back(std::vector<float>(4096, 0.0f));
  rows.push_back(scaled(test::random_row(Dist::Gaussian, 4096, 10), 1e-40f));
  int differ = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    std::vector<uint8_t> ref(row_bytes(TensorType::Q8_1, 4096)), fast(ref.size(), 0xAB), llama(ref.size(), 0xCD);
    std::vector<uint8_t> llama_q8_0(row_bytes(TensorType::Q8_0, 4096));
    quantize_row(TensorType::Q8_1, rows[r].data(), ref.data(), 4096);
    cpu::quantize_activation_row(TensorType::Q8_1, rows[r].data(), fast.data(), 4096);
    EXPECT_EQ(fast, ref) << "row " << r;
    cpu::quantize_activation_row_llama_x86(TensorType::Q8_1, rows[r].data(), llama.data(), 4096);
    cpu::quantize_activation_row_llama_x86(TensorType::Q8_0, rows[r].data(), llama_q8_0.data(), 4096);
    for (int64_t b = 0; b < 4096 / 32; ++b) {
      BlockQ8_1 l;
      BlockQ8_0 l0;
      std::memcpy(&l, llama.data() + b * sizeof(BlockQ8_1), sizeof l);
      std::memcpy(&l0, llama_q8_0.data() + b * sizeof(BlockQ8_0), sizeof l0);
      ASSERT_EQ(l.d, l0.d) << "row " << r << " block " << b;
      ASSERT_EQ(std::memcmp(l.qs, l0.qs, 32), 0) << "row " << r << " block " << b;
      int sum = 0;
      for (int8_t q : l.qs) sum += q;
      float amax = 0.0f;
      for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(rows[r][static_cast<size_t>(b * 32 + j)]));
      if (std::isinf(127.0f / amax)) {  // the int32 quants overflow there; s is a zero either way
        ASSERT_EQ(fp16_to_fp32(l.s), 0.0f) << "row " << r << " block " << b;
        continue;
      }
      ASSERT_EQ(l.s, fp32_to_fp16(amax / 127.0f * static_cast<float>(sum))) << "row " << r << " block " << b;
    }
    differ += ref != llama;
  }
  EXPECT_GT(differ, 0) << "the two rules differ on ties (the halves row) and in the scale";
}

// Values beyond what a block's fp16 scale (or Q4_1 / Q5_1's fp16 min) holds: a clear error, not
// blocks that decode to inf; IQ4_XS's two-level scale holds 1e7 (d ~ 1e7 / 113 / 32).
TEST(QuantizeRowLegacyIq4, RefusesBlocksBeyondFp16) {
  std::vector<float> big = test::random_row(Dist::Gaussian, 256, 77);
  big[3] = 1e7f;
  for (TensorType t : {TensorType::Q4_1, TensorType::Q5_0, TensorType::Q5_1, TensorType::IQ4_NL, TensorType::TQ1_0, TensorType::TQ2_0}) {
    std::vector<uint8_t> q(row_bytes(t, 256));
    try {
      quantize_row(t, big.data(), q.data(), 256);
      ADD_FAILURE() << type_name(t) << ": 1e7 must not fit";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("fp16"), std::string::npos) << e.what();
    }
  }
  // A block spanning more than FLT_MAX: the min-based levels must not turn inf * 0 into NaN codes.
  std::vector<float> span(32, 0.0f);
  span[0] = -3e38f, span[1] = 3e38f;
  for (TensorType t : {TensorType::Q4_1, TensorType::Q5_1}) {
    std::vector<uint8_t> q(row_bytes(t, 32));
    EXPECT_THROW(quantize_row(t, span.data(), q.data(), 32), std::invalid_argument) << type_name(t);
  }
  std::vector<uint8_t> q(row_bytes(TensorType::IQ4_XS, 256));
  quantize_row(TensorType::IQ4_XS, big.data(), q.data(), 256);
  std::vector<float> back(256);
  dequantize_row(TensorType::IQ4_XS, q.data(), back.data(), 256);
  EXPECT_NEAR(back[3], 1e7f, 1e6f);
}

}  // namespace
}  // namespace moraine
