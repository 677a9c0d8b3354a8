// Dot products: the scalar reference against the dequantized values it stands for, against the
// original floats (Cauchy-Schwarz bound from the measured quantization errors), and every
// AVX-512 kernel and activation quantizer against the scalar reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/formats/block_layouts.h"
#include "common/formats/quant.h"
#include "kernels/cpu/vec_dot.h"
#include "tests/formats/dot_bounds.h"
#include "tests/formats/random_rows.h"

namespace moraine {
namespace {

using test::Dist;
using test::dot_magnitude;
constexpr double kU = 0x1p-24;  // unit roundoff of float

const TensorType kWeightTypes[] = {TensorType::F32,  TensorType::F16,  TensorType::BF16, TensorType::Q8_0,
                                   TensorType::Q4_0, TensorType::MXFP4, TensorType::Q2_K, TensorType::Q3_K,
                                   TensorType::Q4_K, TensorType::Q5_K, TensorType::Q6_K};

bool is_kquant(TensorType t) { return type_traits(t).block_elems == 256; }

struct Case {
  TensorType type;
  Dist dist;
  int64_t n;
  std::vector<float> w, a;            // original floats
  std::vector<uint8_t> wq, aq;        // quantized rows
  std::vector<float> w_deq, a_deq;    // what the quantized rows stand for
};

Case make_case(TensorType t, Dist d, int64_t n, uint32_t seed) {
  Case c{t, d, n, test::random_row(d, n, seed), test::random_row(Dist::Gaussian, n, seed + 1), {}, {}, {}, {}};
  const TensorType act = dot_activation_type(t);
  c.wq.resize(row_bytes(t, n));
  c.aq.resize(row_bytes(act, n));
  quantize_row(t, c.w.data(), c.wq.data(), n);
  quantize_row(act, c.a.data(), c.aq.data(), n);
  c.w_deq.resize(static_cast<size_t>(n));
  c.a_deq.resize(static_cast<size_t>(n));
  dequantize_row(t, c.wq.data(), c.w_deq.data(), n);
  dequantize_row(act, c.aq.data(), c.a_deq.data(), n);
  return c;
}

std::vector<int64_t> lengths_for(TensorType t) {
  if (is_kquant(t)) return {3 * 256, 4096};
  if (type_traits(t).block_elems == 1) return {11 * 32, 1007, 4096};  // 1007: masked SIMD tail
  return {11 * 32, 3 * 256, 4096};                                     // 11 blocks: odd pair tail
}

double exact_dot(const std::vector<float>& w, const std::vector<float>& a) {
  double s = 0.0;
  for (size_t i = 0; i < w.size(); ++i) s += static_cast<double>(w[i]) * a[i];
  return s;
}

double norm(const std::vector<float>& x) { return std::sqrt(exact_dot(x, x)); }

template <typename F>
void for_each_case(F f) {
  for (TensorType t : kWeightTypes) {
    for (Dist d : test::kAllDists) {
      for (int64_t n : lengths_for(t)) {
        f(make_case(t, d, n, static_cast<uint32_t>(n) * 31u + static_cast<uint32_t>(t) * 1009u + static_cast<uint32_t>(d)));
      }
    }
  }
}

std::string label(const Case& c) {
  return std::string(type_name(c.type)) + " " + test::dist_name(c.dist) + " n=" + std::to_string(c.n);
}

// The reference computes exactly sum(w_deq * a_deq) up to float rounding: integer sums are
// exact, and each block adds at most ~8 roundings of magnitude <= u * its part of `magnitude`
// (scale products, int->float, the products, the subtraction, and dequantization's own
// roundings on the other side), plus one rounding of the running sum per block. Bound:
// (blocks + 8) * u * magnitude, doubled for the second-order terms.
TEST(VecDotReference, EqualsDotOfDequantizedRows) {
  for_each_case([](const Case& c) {
    const double ref = vec_dot_reference(c.type, c.n, c.wq.data(), c.aq.data());
    const double blocks = static_cast<double>(c.n / type_traits(c.type).block_elems);
    const double tol = 2.0 * (blocks + 8.0) * kU * dot_magnitude(c.type, c.wq, c.w_deq, c.a_deq);
    EXPECT_NEAR(ref, exact_dot(c.w_deq, c.a_deq), tol) << label(c);
  });
}

// Against the unquantized floats: |<w',a'> - <w,a>| <= |w'-w| |a'| + |w| |a'-a| (Cauchy-Schwarz),
// with the norms measured on this row; plus the float slack of the test above.
TEST(VecDotReference, WithinQuantizationErrorOfFloatDot) {
  for_each_case([](const Case& c) {
    std::vector<float> dw(c.w.size()), da(c.a.size());
    for (size_t i = 0; i < dw.size(); ++i) {
      dw[i] = c.w_deq[i] - c.w[i];
      da[i] = c.a_deq[i] - c.a[i];
    }
    const double bound = norm(dw) * norm(c.a_deq) + norm(c.w) * norm(da);
    const double blocks = static_cast<double>(c.n / type_traits(c.type).block_elems);
    const double slack = 2.0 * (blocks + 8.0) * kU * dot_magnitude(c.type, c.wq, c.w_deq, c.a_deq) + 1e-6 * bound;
    const double ref = vec_dot_reference(c.type, c.n, c.wq.data(), c.aq.data());
    EXPECT_NEAR(ref, exact_dot(c.w, c.a), bound + slack) << label(c);
  });
}

// AVX-512 against the scalar reference. K-quant kernels keep exact integer sums and the
// reference's per-block float order: bitwise equal. The others accumulate per lane in float
// (with FMA) instead of one running sum in block order; both are within the recursive-sum bound
// (count of additions) * u * magnitude of the exact value, so they differ by at most twice that.
TEST(VecDotAvx512, MatchesScalarReference) {
  const cpu::CpuIsa isa = cpu::hardware_cpu_isa();
  if (isa < cpu::CpuIsa::Avx512) GTEST_SKIP() << "CPU lacks AVX-512 (" << cpu::isa_name(isa) << ")";
  int checked = 0;
  for_each_case([&](const Case& c) {
    cpu::VecDotFn fn = cpu::vec_dot_fn(c.type, isa);
    if (!fn) {
      EXPECT_EQ(isa, cpu::CpuIsa::Avx512) << "the VNNI tier has a kernel for every format: " << label(c);
      return;
    }
    ++checked;
    const float ref = vec_dot_reference(c.type, c.n, c.wq.data(), c.aq.data());
    const float got = fn(c.n, c.wq.data(), c.aq.data());
    if (is_kquant(c.type)) {
      EXPECT_EQ(got, ref) << label(c);
    } else {
      const double adds = static_cast<double>(c.n / type_traits(c.type).block_elems) + 16.0;
      EXPECT_NEAR(got, ref, 2.0 * (adds + 4.0) * kU * dot_magnitude(c.type, c.wq, c.w_deq, c.a_deq)) << label(c);
    }
    EXPECT_EQ(cpu::vec_dot(c.type, c.n, c.wq.data(), c.aq.data()), got) << "vec_dot must pick the best kernel";
  });
  EXPECT_GT(checked, 0);
}

TEST(VecDotDispatch, NoKernelForUnsupportedTypesOrUnavailableTiers) {
  EXPECT_EQ(cpu::vec_dot_fn(TensorType::I32, cpu::CpuIsa::Scalar), nullptr);
  EXPECT_EQ(cpu::vec_dot_fn(TensorType::Q8_K, cpu::CpuIsa::Scalar), nullptr) << "Q8_K is an activation type";
  EXPECT_EQ(cpu::vec_dot_fn(TensorType::Q6_K, cpu::CpuIsa::Avx2), nullptr) << "the AVX2 tier has only Q4_K, Q8_0, MXFP4";
  if (cpu::hardware_cpu_isa() < cpu::CpuIsa::Avx512Vnni) {
    EXPECT_EQ(cpu::vec_dot_fn(TensorType::Q4_K, cpu::CpuIsa::Avx512Vnni), nullptr) << "tier above the CPU's";
  }
  EXPECT_THROW(cpu::vec_dot(TensorType::I32, 32, nullptr, nullptr), std::invalid_argument);
}

// The scalar tier is the reference itself, for every type.
TEST(VecDotDispatch, ScalarTierIsTheReference) {
  for_each_case([](const Case& c) {
    cpu::VecDotFn fn = cpu::vec_dot_fn(c.type, cpu::CpuIsa::Scalar);
    ASSERT_NE(fn, nullptr) << label(c);
    EXPECT_EQ(fn(c.n, c.wq.data(), c.aq.data()), vec_dot_reference(c.type, c.n, c.wq.data(), c.aq.data())) << label(c);
  });
}

// The fast activation quantizers write exactly the reference's bytes, including halfway cases
// (Q8_0 rounds them away from zero, Q8_K to even) and ties for the block maximum.
TEST(QuantizeActivation, BitIdenticalToReference) {
  std::vector<std::vector<float>> rows;
  for (Dist d : test::kAllDists) rows.push_back(test::random_row(d, 4096, 555 + static_cast<uint32_t>(d)));
  // Halfway values: with amax 127 the Q8_0 scale is 1, so x*id hits exact .5 fractions.
  std::vector<float> halves(4096);
  for (size_t i = 0; i < halves.size(); ++i) halves[i] = (i % 32 == 0) ? 127.0f : static_cast<float>(static_cast<int>(i % 253) - 126) + 0.5f;
  rows.push_back(halves);
  // Ties for the maximum magnitude with opposite signs (Q8_K keeps the first one's sign).
  std::vector<float> ties = test::random_row(Dist::Gaussian, 4096, 9);
  for (size_t b = 0; b < ties.size(); b += 256) {
    ties[b + 17] = 9.0f;
    ties[b + 200] = -9.0f;
  }
  rows.push_back(ties);
  rows.push_back(std::vector<float>(4096, 0.0f));
  // Subnormal magnitudes, where 1/scale overflows: both must fall back to zero blocks alike.
  std::vector<float> tiny = test::random_row(Dist::Gaussian, 4096, 10);
  for (float& v : tiny) v *= 1e-40f;
  rows.push_back(tiny);
  for (TensorType act : {TensorType::Q8_0, TensorType::Q8_K}) {
    for (size_t r = 0; r < rows.size(); ++r) {
      std::vector<uint8_t> ref(row_bytes(act, 4096)), fast(row_bytes(act, 4096), 0xAB);
      quantize_row(act, rows[r].data(), ref.data(), 4096);
      cpu::quantize_activation_row(act, rows[r].data(), fast.data(), 4096);
      EXPECT_EQ(fast, ref) << type_name(act) << " row " << r;
    }
  }
  EXPECT_THROW(cpu::quantize_activation_row(TensorType::Q4_K, rows[0].data(), nullptr, 4096), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
