// Prefill GEMMs through cuBLAS (kernels/cuda/gemm_prefill.h) and the weight expansion under them
// (kernels/cuda/dequantize_weights.h), against the scalar reference on fresh random data.
//
// Tolerance, derived rather than tuned. The GEMM multiplies x~ = round(x) and w~ = round(w),
// each rounded to nearest in the 16-bit input type: |x~ - x| <= u|x| + eta, u = 2^-8 for BF16
// (8 significant bits), 2^-11 for F16, eta = 0 for BF16 (float's exponent range, no test value
// is near float underflow) and 2^-25 for F16 (half its subnormal spacing; small test values do
// go subnormal in F16). So per product
//   |x~w~ - xw| <= (2u + u^2)|xw| + eta(1 + u)(|x| + |w|) + eta^2.
// The products of 16-bit values are exact in float; the tensor cores add them in float, and
// we allow each addition an error of 2 units in float's last place (u_acc = 2^-22: covers round
// to nearest, truncation, and the alignment of a block of products to its largest addend that
// measurements of NVIDIA tensor cores found, Fasi et al. 2021), over at most cols + 32 additions
// on any path (cuBLAS may split K in up to 32 partial sums): gamma(cols + 32) * sum |x~w~|.
// The reference is sum_k x_k w_k in double, w = dequantize_row's floats.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <stdexcept>
#include <utility>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/dequantize_weights.h"
#include "kernels/cuda/gemm_prefill.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/matvec_float.h"
#include "tests/cuda/cuda_test_support.h"
#include "tests/cuda/dot_terms.h"
#include "tests/cuda/iq_test_blocks.h"

namespace moraine {
namespace {

using cuda::GemmInput;

double gamma_u(int64_t k, double u) { return static_cast<double>(k) * u / (1.0 - static_cast<double>(k) * u); }

struct InputRounding {
  double u, eta;
};
InputRounding rounding_of(GemmInput t) {
  return t == GemmInput::BF16 ? InputRounding{std::ldexp(1.0, -8), 0.0}
                              : InputRounding{std::ldexp(1.0, -11), std::ldexp(1.0, -25)};
}
float round_to(GemmInput t, float v) {
  return t == GemmInput::BF16 ? bf16_to_fp32(fp32_to_bf16(v)) : fp16_to_fp32(fp32_to_fp16(v));
}
uint16_t bits_of(GemmInput t, float v) { return t == GemmInput::BF16 ? fp32_to_bf16(v) : fp32_to_fp16(v); }
const char* name_of(GemmInput t) { return t == GemmInput::BF16 ? "bf16" : "f16"; }

// A quantized matrix and its dequantize_row floats.
struct Matrix {
  std::vector<uint8_t> bytes;
  std::vector<float> values;
  size_t row_bytes;
};

Matrix random_matrix(TensorType t, int64_t rows, int64_t cols, std::mt19937& rng) {
  const std::vector<float> src = cuda_test::random_values(rng, static_cast<size_t>(rows * cols));
  // The IQ types: random blocks (iq_test_blocks.h), drawn after src as the others quantize it.
  Matrix m{cuda_test::weight_rows(t, src, rows, cols, rng), std::vector<float>(static_cast<size_t>(rows * cols)),
           row_bytes(t, cols)};
  for (int64_t r = 0; r < rows; ++r)
    dequantize_row(t, m.bytes.data() + static_cast<size_t>(r) * m.row_bytes, m.values.data() + r * cols, cols);
  return m;
}

std::vector<float> rounded(GemmInput t, const std::vector<float>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = round_to(t, v[i]);
  return r;
}

// The bound of the header comment on |GEMM - sum_k x_k w_k| for one output; xr and wr are x and
// w rounded to the input type t.
struct Expected {
  double value, tolerance;
};
Expected expected(const float* x, const float* w, const float* xr, const float* wr, int64_t cols, GemmInput t) {
  const InputRounding r = rounding_of(t);
  double exact = 0.0, abs_xw = 0.0, abs_x_plus_w = 0.0, abs_rounded = 0.0;
  for (int64_t k = 0; k < cols; ++k) {
    exact += static_cast<double>(x[k]) * w[k];
    abs_xw += std::fabs(static_cast<double>(x[k]) * w[k]);
    abs_x_plus_w += std::fabs(static_cast<double>(x[k])) + std::fabs(static_cast<double>(w[k]));
    abs_rounded += std::fabs(static_cast<double>(xr[k]) * wr[k]);
  }
  const double input = (2 * r.u + r.u * r.u) * abs_xw + r.eta * (1 + r.u) * abs_x_plus_w +
                       static_cast<double>(cols) * r.eta * r.eta;
  return {exact, input + gamma_u(cols + 32, std::ldexp(1.0, -22)) * abs_rounded};
}

const TensorType kAllFormats[] = {TensorType::Q8_0, TensorType::Q2_K, TensorType::Q3_K, TensorType::Q4_K,
                                  TensorType::Q5_K, TensorType::Q6_K, TensorType::MXFP4, TensorType::F16,
                                  TensorType::BF16, TensorType::F32,
                                  // issue 26
                                  TensorType::Q4_0, TensorType::Q4_1, TensorType::Q5_0, TensorType::Q5_1,
                                  TensorType::IQ4_NL, TensorType::IQ4_XS, TensorType::TQ1_0, TensorType::TQ2_0};

// Q4_1 / Q5_1 against Q8_1: the reference's term applies the weight's min m to the activation's
// s = fp16(d * sum q) (d the float scale), not to the dequantized activations' sum fp16(d) * sum q;
// per block that moves it off sum x w by |m| * |s - fp16(d) * sum q| exactly, and the term's two
// parts round separately (gamma_24(8) * |m| * sum |x| for the min part and its share of the
// other). Other formats: 0.
double q8_1_min_gap(TensorType t, const uint8_t* w_row, const uint8_t* act_row, const float* x, int64_t cols) {
  if (t != TensorType::Q4_1 && t != TensorType::Q5_1) return 0.0;
  const double g8 = 8 * std::ldexp(1.0, -24) / (1 - 8 * std::ldexp(1.0, -24));
  const size_t wb = type_traits(t).block_bytes;
  double gap = 0.0;
  for (int64_t b = 0; b < cols / kQK; ++b) {
    uint16_t m_bits;
    std::memcpy(&m_bits, w_row + static_cast<size_t>(b) * wb + 2, 2);  // d, then m, in both blocks
    BlockQ8_1 a;
    std::memcpy(&a, act_row + static_cast<size_t>(b) * sizeof(BlockQ8_1), sizeof(a));
    int64_t sum_q = 0;
    double abs_x = 0.0;
    for (int j = 0; j < kQK; ++j) {
      sum_q += a.qs[j];
      abs_x += std::fabs(static_cast<double>(x[b * kQK + j]));
    }
    const double m = std::fabs(static_cast<double>(fp16_to_fp32(m_bits)));
    gap += m * (std::fabs(static_cast<double>(fp16_to_fp32(a.s)) - static_cast<double>(fp16_to_fp32(a.d)) * sum_q) +
                2 * g8 * abs_x);
  }
  return gap;
}

class GemmPrefill : public ::testing::TestWithParam<TensorType> {};

// The expansion is the reference's float value rounded to nearest: compared bit for bit, for
// three matrices in one call (each read through its own pointer, written back to back).
TEST_P(GemmPrefill, DequantizeIsReferenceRoundedBitForBit) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const TensorType t = GetParam();
  std::mt19937 rng(11 + static_cast<uint32_t>(t));
  constexpr int64_t kRows = 37, kCols = 768;
  constexpr int kMatrices = 3;
  std::vector<Matrix> ms;
  for (int i = 0; i < kMatrices; ++i) ms.push_back(random_matrix(t, kRows, kCols, rng));
  std::vector<cuda::DeviceBuffer<uint8_t>> dw;
  std::vector<const void*> ptrs;
  for (const Matrix& m : ms) {
    dw.emplace_back(m.bytes.size());
    dw.back().upload(m.bytes.data(), m.bytes.size());
    ptrs.push_back(dw.back().get());
  }
  const size_t elems = static_cast<size_t>(kRows * kCols);
  for (GemmInput out : {GemmInput::BF16, GemmInput::F16}) {
    cuda::DeviceBuffer<uint16_t> dout(elems * kMatrices);
    dout.fill_bytes(0x5a);
    cuda::dequantize_weights(t, ptrs.data(), kMatrices, static_cast<int64_t>(elems), out, dout.get());
    std::vector<uint16_t> got(elems * kMatrices);
    dout.download(got.data(), got.size());
    for (int i = 0; i < kMatrices; ++i)
      for (size_t e = 0; e < elems; ++e)
        ASSERT_EQ(got[i * elems + e], bits_of(out, ms[static_cast<size_t>(i)].values[e]))
            << type_name(t) << " to " << name_of(out) << ": matrix " << i << " element " << e << " (reference "
            << ms[static_cast<size_t>(i)].values[e] << ")";
  }
}

// Y = X W^T for n = 1, 7, 64, 300 against the double reference, rows odd; with a workspace of 128
// rows the 333-row matrix runs in three slabs (the last one partial).
TEST_P(GemmPrefill, MatmulMatchesReferenceWithinInputRoundingBound) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const TensorType t = GetParam();
  std::mt19937 rng(101 + static_cast<uint32_t>(t));
  constexpr int64_t kCols = 512;
  for (GemmInput in : {GemmInput::BF16, GemmInput::F16}) {
    cuda::PrefillGemmLimits lim;
    lim.max_tokens = 300;
    lim.max_cols = kCols;
    lim.weight_workspace_elems = 128 * kCols;
    cuda::PrefillGemm gemm(nullptr, lim, in);
    // (rows, n): every n on 97 rows; the 333-row matrix (three slabs) at two of them.
    const std::pair<int64_t, int64_t> cases[] = {{97, 1}, {97, 7}, {97, 64}, {97, 300}, {333, 7}, {333, 64}};
    for (const auto& [rows, n] : cases) {
      const Matrix w = random_matrix(t, rows, kCols, rng);
      const std::vector<float> wr = rounded(in, w.values);
      cuda::DeviceBuffer<uint8_t> dw(w.bytes.size());
      dw.upload(w.bytes.data(), w.bytes.size());
      const std::vector<float> x = cuda_test::random_values(rng, static_cast<size_t>(n * kCols));
      const std::vector<float> xr = rounded(in, x);
      cuda::DeviceBuffer<float> dx(x.size()), dy(static_cast<size_t>(n * rows));
      dx.upload(x.data(), x.size());
      dy.fill_bytes(0xff);  // NaN: an output never written fails
      gemm.matmul(t, dw.get(), rows, kCols, dx.get(), n, dy.get());
      std::vector<float> y(static_cast<size_t>(n * rows));
      dy.download(y.data(), y.size());
      for (int64_t i = 0; i < n; ++i)
        for (int64_t r = 0; r < rows; ++r) {
          const Expected want = expected(x.data() + i * kCols, w.values.data() + r * kCols, xr.data() + i * kCols,
                                         wr.data() + r * kCols, kCols, in);
          const float got = y[static_cast<size_t>(i * rows + r)];
          ASSERT_LE(std::fabs(got - want.value), want.tolerance)
              << type_name(t) << " via " << name_of(in) << " rows=" << rows << " n=" << n << " at [" << i << "][" << r
              << "]: got " << got << ", reference " << want.value;
        }
    }
  }
}

// The GEMM against the decode path on the same weights. The quantized matvec dots Q8_0/Q8_K
// activations, so the GEMM gets those activations' dequantized floats as X; then both approximate
// S = sum_k x_k w_k: the GEMM within the bound above, the matvec within 2 gamma_24(blocks) * sum
// |t_b| of vec_dot_reference (tests/cuda/matvec_test.cpp; t_b the reference's block terms), and
// vec_dot_reference differs from S only by the float roundings of its block terms and of
// dequantize_row's values: at most 8 per term or element, gamma_24(8) * (sum |t_b| + sum |x w|),
// plus for Q4_1 / Q5_1 the gap of their min term (q8_1_min_gap).
// The float weights' matvec (matvec_float.h) rounds x to the weight type and sums float products:
// within gamma_24(cols) * sum |x' w| of S on x' = that rounding.
TEST_P(GemmPrefill, MatmulAgreesWithMatvecPath) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const TensorType t = GetParam();
  std::mt19937 rng(301 + static_cast<uint32_t>(t));
  constexpr int64_t kRows = 77, kCols = 1024, kN = 9;
  const double u24 = std::ldexp(1.0, -24);
  const Matrix w = random_matrix(t, kRows, kCols, rng);
  cuda::DeviceBuffer<uint8_t> dw(w.bytes.size());
  dw.upload(w.bytes.data(), w.bytes.size());
  const bool quantized = cuda::matvec_supported(t);
  const TensorType at = quantized ? dot_activation_type(t) : t;
  std::vector<float> raw = cuda_test::random_values(rng, static_cast<size_t>(kN * kCols));
  // x: what the matvec path effectively multiplies; act: its activation bytes (quantized only).
  std::vector<float> x(raw.size());
  std::vector<uint8_t> act(row_bytes(at, kCols) * kN);
  for (int64_t i = 0; i < kN; ++i) {
    uint8_t* a = act.data() + static_cast<size_t>(i) * row_bytes(at, kCols);
    quantize_row(at, raw.data() + i * kCols, a, kCols);
    dequantize_row(at, a, x.data() + i * kCols, kCols);  // float weights: x rounded to their type
  }
  cuda::DeviceBuffer<float> dx(x.size()), draw(raw.size()), dy_gemm(static_cast<size_t>(kN * kRows)),
      dy_mv(static_cast<size_t>(kN * kRows));
  cuda::DeviceBuffer<uint8_t> dact(act.size());
  dx.upload(x.data(), x.size());
  draw.upload(raw.data(), raw.size());
  dact.upload(act.data(), act.size());
  dy_gemm.fill_bytes(0xff);
  dy_mv.fill_bytes(0xff);
  cuda::MatvecBatch rows_batch;  // one launch: the same matrix (stride 0) against kN activation rows
  rows_batch.count = static_cast<int>(kN);
  rows_batch.out_stride = kRows;
  if (quantized) {
    rows_batch.act_stride_bytes = static_cast<int64_t>(row_bytes(at, kCols));
    cuda::matvec_quantized_batched(t, dw.get(), kRows, kCols, dact.get(), dy_mv.get(), rows_batch);
  } else {
    rows_batch.act_stride_bytes = kCols * static_cast<int64_t>(sizeof(float));
    cuda::matvec_float_batched(t, dw.get(), kRows, kCols, draw.get(), dy_mv.get(), rows_batch);
  }
  cuda::PrefillGemmLimits lim;
  lim.max_tokens = kN;
  lim.max_cols = kCols;
  cuda::PrefillGemm gemm(nullptr, lim);
  gemm.matmul(t, dw.get(), kRows, kCols, dx.get(), kN, dy_gemm.get());
  std::vector<float> y_gemm(static_cast<size_t>(kN * kRows)), y_mv(y_gemm.size());
  dy_gemm.download(y_gemm.data(), y_gemm.size());
  dy_mv.download(y_mv.data(), y_mv.size());

  const std::vector<float> xr = rounded(GemmInput::BF16, x), wr = rounded(GemmInput::BF16, w.values);
  for (int64_t i = 0; i < kN; ++i) {
    const uint8_t* a = act.data() + static_cast<size_t>(i) * row_bytes(at, kCols);
    for (int64_t r = 0; r < kRows; ++r) {
      const uint8_t* w_row = w.bytes.data() + static_cast<size_t>(r) * w.row_bytes;
      const Expected g = expected(x.data() + i * kCols, w.values.data() + r * kCols, xr.data() + i * kCols,
                                  wr.data() + r * kCols, kCols, GemmInput::BF16);
      double abs_xw = 0.0;
      for (int64_t k = 0; k < kCols; ++k) abs_xw += std::fabs(static_cast<double>(x[i * kCols + k]) * w.values[r * kCols + k]);
      double matvec_bound = 0.0;
      if (quantized) {
        const cuda_test::DotTerms terms = cuda_test::dot_terms(t, w_row, a, kCols);
        const double abs_terms = terms.abs_sum;
        matvec_bound = 2 * gamma_u(terms.count, u24) * abs_terms + gamma_u(8, u24) * (abs_terms + abs_xw) +
                       q8_1_min_gap(t, w_row, a, x.data() + i * kCols, kCols);
      } else {
        matvec_bound = gamma_u(kCols, u24) * abs_xw;
      }
      const float got = y_gemm[static_cast<size_t>(i * kRows + r)], mv = y_mv[static_cast<size_t>(i * kRows + r)];
      ASSERT_LE(std::fabs(static_cast<double>(got) - mv), g.tolerance + matvec_bound)
          << type_name(t) << " row " << r << " token " << i << ": gemm " << got << ", matvec " << mv
          << ", reference " << g.value;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, GemmPrefill, ::testing::ValuesIn(kAllFormats),
                         [](const auto& p) { return std::string(type_name(p.param)); });

// The importance-matrix grid formats (dequantize_weights_iq.cuh) on random blocks.
INSTANTIATE_TEST_SUITE_P(IqFormats, GemmPrefill, ::testing::ValuesIn(cuda_test::kIqGridTypes),
                         [](const auto& p) { return std::string(type_name(p.param)); });

// One MoE layer: ten experts over contiguous row groups of uneven sizes (one empty, two below
// min_rows = 4, up to 512 rows), two expert matrices per workspace chunk, ldy wider than rows,
// through the grouped kernel (tile shape chosen or forced), expanded and fused, the per-expert
// cuBLAS loop, for both 16-bit input types. Groups below the threshold and the ldy gap keep
// their NaN poison; the others match the reference.
void check_groups_at_or_above_threshold(TensorType t) {
  constexpr int64_t kRows = 96, kCols = 256, kLdy = 101;
  const int64_t counts[] = {0, 3, 17, 1, 40, 9, 64, 130, 512, 33};
  constexpr int kExperts = 10;
  constexpr int64_t kMinRows = 4;
  std::mt19937 rng(401);
  std::vector<Matrix> ms;
  std::vector<cuda::DeviceBuffer<uint8_t>> dw;
  std::vector<cuda::ExpertRows> groups;
  int64_t total = 0, expected_rows = 0;
  for (int e = 0; e < kExperts; ++e) {
    ms.push_back(random_matrix(t, kRows, kCols, rng));
    dw.emplace_back(ms.back().bytes.size());
    dw.back().upload(ms.back().bytes.data(), ms.back().bytes.size());
    groups.push_back({dw.back().get(), total, counts[e]});
    total += counts[e];
    if (counts[e] >= kMinRows) expected_rows += counts[e];
  }
  const std::vector<float> x = cuda_test::random_values(rng, static_cast<size_t>(total * kCols));
  cuda::DeviceBuffer<float> dx(x.size()), dy(static_cast<size_t>(total * kLdy));
  dx.upload(x.data(), x.size());
  cuda::PrefillGemmLimits lim;
  lim.max_tokens = total;
  lim.max_cols = kCols;
  lim.weight_workspace_elems = 2 * kRows * kCols + 1000;  // two matrices per chunk
  lim.max_experts = kExperts;
  using Path = cuda::PrefillGemm::ExpertPath;
  struct Variant {
    const char* name;
    Path path;
    std::optional<cuda::ExpertTiles> tiles;
  };
  // Expanded [0, 5) and fused [5, 10) with the same tiles, in the same order: compared bit for bit.
  constexpr size_t kPaired = 5;
  const Variant variants[] = {{"kernel (tiles chosen)", Path::Expanded, std::nullopt},
                              {"kernel large tiles", Path::Expanded, cuda::ExpertTiles::Large},
                              {"kernel small tiles", Path::Expanded, cuda::ExpertTiles::Small},
                              {"kernel wide tiles", Path::Expanded, cuda::ExpertTiles::Wide},
                              {"kernel tall tiles", Path::Expanded, cuda::ExpertTiles::Tall},
                              {"fused (tiles chosen)", Path::Fused, std::nullopt},
                              {"fused large tiles", Path::Fused, cuda::ExpertTiles::Large},
                              {"fused small tiles", Path::Fused, cuda::ExpertTiles::Small},
                              {"fused wide tiles", Path::Fused, cuda::ExpertTiles::Wide},
                              {"fused tall tiles", Path::Fused, cuda::ExpertTiles::Tall},
                              {"cublas loop", Path::CublasLoop, std::nullopt},
                              {"default (auto)", Path::Auto, std::nullopt}};
  for (GemmInput in : {GemmInput::BF16, GemmInput::F16}) {
    const std::vector<float> xr = rounded(in, x);
    std::vector<std::vector<float>> wrs;
    for (const Matrix& m : ms) wrs.push_back(rounded(in, m.values));
    std::vector<std::vector<float>> outputs;
    for (const Variant& v : variants) {
      cuda::PrefillGemm gemm(nullptr, lim, in);
      gemm.set_expert_path(v.path);
      gemm.force_expert_tiles(v.tiles);
      dy.fill_bytes(0xff);
      EXPECT_EQ(gemm.matmul_experts(t, groups, kRows, kCols, dx.get(), dy.get(), kMinRows, kLdy), expected_rows);
      if (v.path != Path::Auto) {
        EXPECT_EQ(gemm.last_call_fused(), v.path == Path::Fused) << v.name;
      }
      std::vector<float>& y = outputs.emplace_back(static_cast<size_t>(total * kLdy));
      dy.download(y.data(), y.size());
      for (int e = 0; e < kExperts; ++e) {
        const cuda::ExpertRows& g = groups[static_cast<size_t>(e)];
        for (int64_t i = g.first_row; i < g.first_row + g.count; ++i)
          for (int64_t r = 0; r < kLdy; ++r) {
            const float got = y[static_cast<size_t>(i * kLdy + r)];
            if (g.count < kMinRows || r >= kRows) {
              ASSERT_TRUE(std::isnan(got)) << v.name << " via " << name_of(in) << ": expert " << e << " row " << i
                                           << " out " << r << " (below the threshold or in the ldy gap) was written";
              continue;
            }
            const Expected want = expected(x.data() + i * kCols, ms[static_cast<size_t>(e)].values.data() + r * kCols,
                                           xr.data() + i * kCols, wrs[static_cast<size_t>(e)].data() + r * kCols, kCols,
                                           in);
            ASSERT_LE(std::fabs(got - want.value), want.tolerance)
                << v.name << " via " << name_of(in) << ": expert " << e << " row " << i << " out " << r << ": got "
                << got << ", reference " << want.value;
          }
      }
      if (v.path != Path::CublasLoop)
        std::printf("experts via %s, %s: %s, %s tiles\n", name_of(in), v.name,
                    gemm.last_call_fused() ? "fused" : "expanded",
                    cuda::expert_tiles_name(gemm.last_expert_tiles()));
    }
    // Decoding in the kernel gives the expanded path's bits (same 16-bit operands, same mma order).
    for (size_t v = 0; v < kPaired; ++v)
      for (size_t i = 0; i < outputs[v].size(); ++i)
        if (!std::isnan(outputs[v][i])) {
          ASSERT_EQ(outputs[v][i], outputs[v + kPaired][i]) << variants[v].name << " vs " << variants[v + kPaired].name
                                                            << " via " << name_of(in) << " at flat index " << i;
        }
  }
}

TEST(GemmPrefillExperts, GroupsAtOrAboveThresholdMatchReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check_groups_at_or_above_threshold(TensorType::Q4_K);
}

// Q6_K (fused since session 11): 256 columns make 210-byte rows, at every even offset mod 16.
TEST(GemmPrefillExperts, Q6KGroupsAtOrAboveThresholdMatchReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check_groups_at_or_above_threshold(TensorType::Q6_K);
}

// The groups' rows must fit the tile table sized for max_tokens: overlapping groups that sum to
// more are refused with a clear error rather than overrunning it.
TEST(GemmPrefillExperts, RefusesGroupsSummingPastMaxTokens) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  constexpr TensorType t = TensorType::Q8_0;
  constexpr int64_t kRows = 64, kCols = 64, kTokens = 64;
  std::mt19937 rng(451);
  const Matrix m = random_matrix(t, kRows, kCols, rng);
  cuda::DeviceBuffer<uint8_t> dw(m.bytes.size());
  dw.upload(m.bytes.data(), m.bytes.size());
  cuda::DeviceBuffer<float> dx(static_cast<size_t>(kTokens * kCols)), dy(static_cast<size_t>(kTokens * kRows));
  cuda::PrefillGemmLimits lim;
  lim.max_tokens = kTokens;
  lim.max_cols = kCols;
  lim.max_experts = 8;
  cuda::PrefillGemm gemm(nullptr, lim);
  const std::vector<cuda::ExpertRows> groups(8, cuda::ExpertRows{dw.get(), 0, kTokens});  // all the same rows
  EXPECT_THROW(gemm.matmul_experts(t, groups, kRows, kCols, dx.get(), dy.get()), std::invalid_argument);
}

// reuse_input (the gate/up pair of a MoE layer): the second call on the same X with the first
// call's 16-bit X gives the bits of a call that rounds X itself, on every path; a reuse the
// object cannot honour (another x, wider rows, other cols, after matmul) is refused.
TEST(GemmPrefillExperts, ReusedInputGivesTheBitsOfRoundingAgain) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  constexpr TensorType t = TensorType::Q4_K;
  constexpr int64_t kRows = 128, kCols = 512;
  const int64_t counts[] = {5, 0, 37, 64, 2, 90};
  std::mt19937 rng(421);
  std::vector<cuda::DeviceBuffer<uint8_t>> gate_w, up_w;
  std::vector<cuda::ExpertRows> gate, up;
  int64_t total = 0;
  for (int64_t c : counts) {
    for (auto* ws : {&gate_w, &up_w}) {
      const Matrix m = random_matrix(t, kRows, kCols, rng);
      ws->emplace_back(m.bytes.size());
      ws->back().upload(m.bytes.data(), m.bytes.size());
    }
    gate.push_back({gate_w.back().get(), total, c});
    up.push_back({up_w.back().get(), total, c});
    total += c;
  }
  const std::vector<float> x = cuda_test::random_values(rng, static_cast<size_t>(total * kCols));
  cuda::DeviceBuffer<float> dx(x.size()), dother(x.size()), dy(static_cast<size_t>(total * kRows));
  dx.upload(x.data(), x.size());
  dother.upload(x.data(), x.size());
  cuda::PrefillGemmLimits lim;
  lim.max_tokens = total;
  lim.max_cols = kCols;
  lim.max_experts = 8;
  lim.weight_workspace_elems = 3 * kRows * kCols;
  using Path = cuda::PrefillGemm::ExpertPath;
  for (Path path : {Path::Auto, Path::Expanded, Path::CublasLoop}) {
    cuda::PrefillGemm gemm(nullptr, lim);
    gemm.set_expert_path(path);
    const auto run = [&](const std::vector<cuda::ExpertRows>& g, bool reuse) {
      dy.fill_bytes(0xff);
      gemm.matmul_experts(t, g, kRows, kCols, dx.get(), dy.get(), 1, 0, reuse);
      std::vector<float> y(static_cast<size_t>(total * kRows));
      dy.download(y.data(), y.size());
      return y;
    };
    const std::vector<float> up_fresh = run(up, false);
    run(gate, false);
    const std::vector<float> up_reused = run(up, true);
    for (size_t i = 0; i < up_fresh.size(); ++i)
      ASSERT_EQ(std::memcmp(&up_fresh[i], &up_reused[i], sizeof(float)), 0)
          << "path " << static_cast<int>(path) << ": up with gate's rounded X differs at flat index " << i << ": "
          << up_reused[i] << " vs " << up_fresh[i];
    // A later call over fewer rows may reuse too (rows 0..end of the first call cover it).
    const std::vector<cuda::ExpertRows> first_two(up.begin(), up.begin() + 2);
    EXPECT_NO_THROW(gemm.matmul_experts(t, first_two, kRows, kCols, dx.get(), dy.get(), 1, 0, true));
    EXPECT_THROW(gemm.matmul_experts(t, up, kRows, kCols, dother.get(), dy.get(), 1, 0, true), std::invalid_argument);
    gemm.matmul_experts(t, first_two, kRows, kCols, dx.get(), dy.get());  // rounds only rows 0..5
    EXPECT_THROW(gemm.matmul_experts(t, up, kRows, kCols, dx.get(), dy.get(), 1, 0, true), std::invalid_argument);
    gemm.matmul_experts(t, up, kRows, kCols, dx.get(), dy.get());
    EXPECT_THROW(gemm.matmul_experts(t, up, kRows, kCols - 256, dx.get(), dy.get(), 1, 0, true),
                 std::invalid_argument);
    gemm.matmul(t, gate_w[0].get(), kRows, kCols, dx.get(), total, dy.get());
    EXPECT_THROW(gemm.matmul_experts(t, up, kRows, kCols, dx.get(), dy.get(), 1, 0, true), std::invalid_argument);
  }
}

// accumulate: Y += X W^T onto values already there; ldy wider than rows leaves the gap alone.
TEST(GemmPrefillAccumulate, AddsOntoExistingOutputWithRowStride) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  constexpr TensorType t = TensorType::Q6_K;
  constexpr int64_t kRows = 45, kCols = 512, kN = 5, kLdy = 50;
  std::mt19937 rng(501);
  const Matrix w = random_matrix(t, kRows, kCols, rng);
  const std::vector<float> x = cuda_test::random_values(rng, static_cast<size_t>(kN * kCols));
  const std::vector<float> y0 = cuda_test::random_values(rng, static_cast<size_t>(kN * kLdy));
  cuda::DeviceBuffer<uint8_t> dw(w.bytes.size());
  cuda::DeviceBuffer<float> dx(x.size()), dy(y0.size());
  dw.upload(w.bytes.data(), w.bytes.size());
  dx.upload(x.data(), x.size());
  dy.upload(y0.data(), y0.size());
  cuda::PrefillGemmLimits lim;
  lim.max_tokens = kN;
  lim.max_cols = kCols;
  cuda::PrefillGemm gemm(nullptr, lim);
  gemm.matmul(t, dw.get(), kRows, kCols, dx.get(), kN, dy.get(), kLdy, /*accumulate=*/true);
  std::vector<float> y(y0.size());
  dy.download(y.data(), y.size());
  const std::vector<float> xr = rounded(GemmInput::BF16, x), wr = rounded(GemmInput::BF16, w.values);
  for (int64_t i = 0; i < kN; ++i)
    for (int64_t r = 0; r < kLdy; ++r) {
      const size_t at = static_cast<size_t>(i * kLdy + r);
      if (r >= kRows) {
        ASSERT_EQ(y[at], y0[at]) << "gap column " << r << " of row " << i << " changed";
        continue;
      }
      const Expected want = expected(x.data() + i * kCols, w.values.data() + r * kCols, xr.data() + i * kCols,
                                     wr.data() + r * kCols, kCols, GemmInput::BF16);
      // One more float addition, of y0: 2^-22 relative to the larger of the two (generous).
      const double tol = want.tolerance + std::ldexp(1.0, -22) * (std::fabs(y0[at]) + std::fabs(want.value) + want.tolerance);
      ASSERT_LE(std::fabs(static_cast<double>(y[at]) - (y0[at] + want.value)), tol) << "row " << i << " out " << r;
    }
}

// Argument checks come before any CUDA call, so these run without a device too.
TEST(GemmPrefillArguments, DequantizeRejectsBadTypesShapesAndPointers) {
  const void* one = reinterpret_cast<const void*>(uintptr_t{256});
  void* out = reinterpret_cast<void*>(uintptr_t{4096});
  EXPECT_FALSE(cuda::dequantize_weights_supported(TensorType::Q8_K));  // an activation format
  EXPECT_TRUE(cuda::prefill_gemm_supported(TensorType::MXFP4));
  for (const TensorType t : cuda_test::kIqGridTypes) EXPECT_TRUE(cuda::prefill_gemm_supported(t)) << type_name(t);
  EXPECT_TRUE(cuda::prefill_gemm_supported(TensorType::IQ4_XS));
  EXPECT_THROW(cuda::dequantize_weights(TensorType::IQ3_S, &one, 1, 128, GemmInput::BF16, out), std::invalid_argument);
  EXPECT_THROW(cuda::dequantize_weights(TensorType::Q8_K, &one, 1, 256, GemmInput::BF16, out), std::invalid_argument);
  EXPECT_THROW(cuda::dequantize_weights(TensorType::Q4_K, &one, 1, 128, GemmInput::BF16, out), std::invalid_argument);
  EXPECT_THROW(cuda::dequantize_weights(TensorType::F16, &one, 1, 48, GemmInput::BF16, out), std::invalid_argument);
  const void* odd = reinterpret_cast<const void*>(uintptr_t{257});
  EXPECT_THROW(cuda::dequantize_weights(TensorType::Q8_0, &odd, 1, 256, GemmInput::BF16, out), std::invalid_argument);
  const void* two = reinterpret_cast<const void*>(uintptr_t{258});
  EXPECT_THROW(cuda::dequantize_weights(TensorType::F32, &two, 1, 256, GemmInput::BF16, out), std::invalid_argument);
  EXPECT_THROW(cuda::dequantize_weights(TensorType::Q8_0, &one, 1, 256, GemmInput::BF16,
                                        reinterpret_cast<void*>(uintptr_t{4098})),
               std::invalid_argument);
  EXPECT_THROW(cuda::convert_gemm_input(reinterpret_cast<const float*>(uintptr_t{4096}), 6, GemmInput::BF16, out),
               std::invalid_argument);
}

}  // namespace
}  // namespace moraine
