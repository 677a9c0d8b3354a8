// GPU matrix-vector products on quantized weights (kernels/cuda/matvec.cu) against the scalar
// reference vec_dot_reference (common/formats/quant.h), on the same weight and activation bytes.
//
// Tolerance, derived rather than tuned: the kernel adds the same per-block float terms t_i as
// the reference, bit for bit (term() uses the reference's expression with _rn intrinsics), in
// another order. Each ordering of a float sum of k terms is within gamma(k) * sum|t_i| of the
// exact sum (gamma(k) = k*u / (1 - k*u), u = 2^-24), so the two results differ by at most
// 2 * gamma(k) * sum|t_i|; t_i is vec_dot_reference on block i alone (IQ4_XS: on sub-block i,
// tests/cuda/dot_terms.h). A row of one block has one term: there the kernel must give the
// reference's bits exactly (OneBlockRowsEqualReferenceBitForBit).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/matvec.h"
#include "tests/cuda/cuda_test_support.h"
#include "tests/cuda/dot_terms.h"
#include "tests/cuda/iq_test_blocks.h"

namespace moraine {
namespace {

struct Quantized {
  std::vector<uint8_t> bytes;
  size_t row_bytes;
};

Quantized quantize_rows(TensorType type, const std::vector<float>& x, int64_t rows, int64_t n) {
  Quantized q{std::vector<uint8_t>(row_bytes(type, n) * static_cast<size_t>(rows)), row_bytes(type, n)};
  for (int64_t r = 0; r < rows; ++r) quantize_row(type, x.data() + r * n, q.bytes.data() + r * q.row_bytes, n);
  return q;
}

double gamma(int64_t k) {
  const double u = std::ldexp(1.0, -24);
  return static_cast<double>(k) * u / (1.0 - static_cast<double>(k) * u);
}

// The reference value of one row and the bound on |kernel - reference| for it.
struct Expected {
  float value;
  double tolerance;
};

Expected reference_row(TensorType w_type, const uint8_t* w_row, const uint8_t* act_row, int64_t n) {
  const cuda_test::DotTerms t = cuda_test::dot_terms(w_type, w_row, act_row, n);
  return {vec_dot_reference(w_type, n, w_row, act_row), 2.0 * gamma(t.count) * t.abs_sum};
}

// `experts` matrices of rows x n; matrix e reads activation row e % act_rows and selection ids
// pick matrices out of order (as a MoE layer's router does). exact: the reference's bits (rows of
// one block), else within the reordering bound.
void check_matvec(TensorType w_type, int64_t rows, int64_t n, int experts, uint32_t seed, bool exact = false) {
  std::mt19937 rng(seed);
  const TensorType a_type = dot_activation_type(w_type);
  const int pool = experts == 1 ? 1 : experts + 3;  // ids choose among more matrices than used
  // The IQ types get random blocks (iq_test_blocks.h), drawn after the values the others quantize.
  const std::vector<float> wx = cuda_test::random_values(rng, static_cast<size_t>(pool * rows * n));
  const Quantized w{cuda_test::weight_rows(w_type, wx, pool * rows, n, rng), row_bytes(w_type, n)};
  const Quantized a = quantize_rows(a_type, cuda_test::random_values(rng, static_cast<size_t>(experts * n)), experts, n);
  std::vector<int32_t> ids(static_cast<size_t>(experts));
  for (int e = 0; e < experts; ++e) ids[static_cast<size_t>(e)] = experts == 1 ? 0 : (e * 5 + 2) % pool;

  cuda::DeviceBuffer<uint8_t> dw(w.bytes.size()), da(a.bytes.size());
  dw.upload(w.bytes.data(), w.bytes.size());
  da.upload(a.bytes.data(), a.bytes.size());
  cuda::DeviceBuffer<int32_t> dids(ids.size());
  dids.upload(ids.data(), ids.size());
  cuda::DeviceBuffer<float> dy(static_cast<size_t>(experts * rows));
  dy.fill_bytes(0xff);  // NaN: a row the kernel never writes fails the comparison

  cuda::MatvecBatch batch;
  batch.count = experts;
  batch.weight_stride_bytes = static_cast<int64_t>(w.row_bytes) * rows;
  batch.act_stride_bytes = static_cast<int64_t>(a.row_bytes);
  batch.out_stride = rows;
  batch.expert_ids = experts == 1 ? nullptr : dids.get();
  cuda::matvec_quantized_batched(w_type, dw.get(), rows, n, da.get(), dy.get(), batch);
  std::vector<float> y(static_cast<size_t>(experts * rows));
  dy.download(y.data(), y.size());

  for (int e = 0; e < experts; ++e) {
    const int64_t m = ids[static_cast<size_t>(e)];
    for (int64_t r = 0; r < rows; ++r) {
      const Expected want = reference_row(w_type, w.bytes.data() + (m * rows + r) * w.row_bytes,
                                          a.bytes.data() + e * a.row_bytes, n);
      const float got = y[static_cast<size_t>(e * rows + r)];
      if (exact) {
        ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want.value))
            << type_name(w_type) << " n=" << n << " matrix " << e << " row " << r << ": got " << got << ", reference "
            << want.value;
        continue;
      }
      ASSERT_TRUE(std::fabs(static_cast<double>(got) - want.value) <= want.tolerance)
          << type_name(w_type) << " rows=" << rows << " n=" << n << " matrix " << e << " row " << r
          << ": got " << got << ", reference " << want.value << ", tolerance " << want.tolerance;
    }
  }
}

class CudaMatvec : public ::testing::TestWithParam<TensorType> {};

TEST_P(CudaMatvec, OddRowCountsMatchReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const TensorType t = GetParam();
  check_matvec(t, 37, 768, 1, 101);
  check_matvec(t, 1027, 4096, 1, 102);
  check_matvec(t, 5, 256, 1, 103);
  if (type_traits(t).block_elems == 32) check_matvec(t, 13, 96, 1, 104);  // rows of 3 blocks (odd byte counts)
}

// One block per row: the kernel's value is the block's term (IQ4_XS: its sub-block terms added
// in order from 0, as the reference adds them), the reference's bits; every row a fresh block.
TEST_P(CudaMatvec, OneBlockRowsEqualReferenceBitForBit) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const TensorType t = GetParam();
  check_matvec(t, 1001, type_traits(t).block_elems, 1, 105, true);
  check_matvec(t, 301, type_traits(t).block_elems, 4, 106, true);
}

TEST_P(CudaMatvec, SelectedExpertsInOneLaunchMatchReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check_matvec(GetParam(), 97, 2048, 8, 201);
}

// Q8_0 rows with 4-byte aligned weights and activations and an even block count take the
// block-pair path (matvec_formats.cuh q8_0_dot_pairs); activations 2 bytes off that alignment
// take the per-block path. Both must add the same terms in the same order: equal bits, for row
// lengths of one run of 64 blocks or less (the golden models' 256 columns) and several.
TEST(CudaMatvecQ8_0, BlockPairPathEqualsPerBlockPathBitForBit) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  for (const int64_t n : {int64_t{64}, int64_t{256}, int64_t{2048}, int64_t{4096}, int64_t{6144}}) {
    std::mt19937 rng(static_cast<uint32_t>(300 + n));
    const int64_t rows = 37, tokens = 3;
    const Quantized w = quantize_rows(TensorType::Q8_0, cuda_test::random_values(rng, static_cast<size_t>(rows * n)), rows, n);
    const Quantized a = quantize_rows(TensorType::Q8_0, cuda_test::random_values(rng, static_cast<size_t>(tokens * n)), tokens, n);
    ASSERT_EQ(a.row_bytes % 4, 0u);  // n is a multiple of 64: aligned rows stay aligned
    cuda::DeviceBuffer<uint8_t> dw(w.bytes.size()), da(a.bytes.size() + 4);
    dw.upload(w.bytes.data(), w.bytes.size());
    std::vector<float> y[2];
    for (int shifted = 0; shifted < 2; ++shifted) {
      const size_t off = shifted ? 2 : 0;
      CUDA_CHECK(cudaMemcpy(da.get() + off, a.bytes.data(), a.bytes.size(), cudaMemcpyHostToDevice));
      cuda::DeviceBuffer<float> dy(static_cast<size_t>(tokens * rows));
      dy.fill_bytes(0xff);
      cuda::MatvecBatch batch;
      batch.count = static_cast<int>(tokens);
      batch.act_stride_bytes = static_cast<int64_t>(a.row_bytes);
      batch.out_stride = rows;
      cuda::matvec_quantized_batched(TensorType::Q8_0, dw.get(), rows, n, da.get() + off, dy.get(), batch);
      y[shifted].resize(static_cast<size_t>(tokens * rows));
      dy.download(y[shifted].data(), y[shifted].size());
    }
    for (size_t i = 0; i < y[0].size(); ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(y[0][i]), std::bit_cast<uint32_t>(y[1][i]))
          << "n=" << n << " output " << i << ": pairs " << y[0][i] << ", per block " << y[1][i];
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, CudaMatvec,
                         ::testing::Values(TensorType::Q8_0, TensorType::Q2_K, TensorType::Q3_K, TensorType::Q4_K,
                                           TensorType::Q5_K, TensorType::Q6_K,
                                           TensorType::MXFP4,
                                           // issue 26 (matvec_formats_legacy.cuh)
                                           TensorType::Q4_0, TensorType::Q4_1, TensorType::Q5_0, TensorType::Q5_1,
                                           TensorType::IQ4_NL, TensorType::IQ4_XS, TensorType::TQ1_0,
                                           TensorType::TQ2_0),
                         [](const auto& p) { return std::string(type_name(p.param)); });

// The importance-matrix grid formats (matvec_formats_iq.cuh) on random blocks.
INSTANTIATE_TEST_SUITE_P(IqFormats, CudaMatvec, ::testing::ValuesIn(cuda_test::kIqGridTypes),
                         [](const auto& p) { return std::string(type_name(p.param)); });

// A row of one block is one term on both sides (the reference's 0.125 / 0.25 factor of the sum
// is exact on one term), so the kernel's result must equal vec_dot_reference bit for bit: this
// pins each IQ format's integer sums and float expression exactly, where the multi-block rows
// above allow the reordering bound.
class CudaMatvecIq : public ::testing::TestWithParam<TensorType> {};

TEST_P(CudaMatvecIq, OneBlockRowsEqualReferenceBitForBit) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const TensorType t = GetParam();
  std::mt19937 rng(400 + static_cast<uint32_t>(t));
  constexpr int64_t kRows = 301, kN = 256, kTokens = 5;
  const size_t wrb = row_bytes(t, kN), arb = row_bytes(TensorType::Q8_K, kN);
  std::vector<uint8_t> w = cuda_test::weight_rows(t, {}, kRows, kN, rng, 1e-4f, 1e1f);
  const Quantized a = quantize_rows(TensorType::Q8_K, cuda_test::random_values(rng, static_cast<size_t>(kTokens * kN)),
                                    kTokens, kN);
  cuda::DeviceBuffer<uint8_t> dw(w.size()), da(a.bytes.size());
  dw.upload(w.data(), w.size());
  da.upload(a.bytes.data(), a.bytes.size());
  cuda::DeviceBuffer<float> dy(static_cast<size_t>(kTokens * kRows));
  dy.fill_bytes(0xff);
  cuda::MatvecBatch batch;  // every token against the same matrix
  batch.count = static_cast<int>(kTokens);
  batch.act_stride_bytes = static_cast<int64_t>(arb);
  batch.out_stride = kRows;
  cuda::matvec_quantized_batched(t, dw.get(), kRows, kN, da.get(), dy.get(), batch);
  std::vector<float> y(static_cast<size_t>(kTokens * kRows));
  dy.download(y.data(), y.size());
  for (int64_t i = 0; i < kTokens; ++i)
    for (int64_t r = 0; r < kRows; ++r) {
      const float want = vec_dot_reference(t, kN, w.data() + r * wrb, a.bytes.data() + i * arb);
      const float got = y[static_cast<size_t>(i * kRows + r)];
      ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want))
          << type_name(t) << " token " << i << " row " << r << ": got " << got << ", reference " << want;
    }
}

INSTANTIATE_TEST_SUITE_P(IqFormats, CudaMatvecIq, ::testing::ValuesIn(cuda_test::kIqGridTypes),
                         [](const auto& p) { return std::string(type_name(p.param)); });

// Argument checks come before any CUDA call, so these run without a device too.
TEST(CudaMatvecIqArguments, SupportsTheGridFormatsAndChecksTheirShapes) {
  for (const TensorType t : cuda_test::kIqGridTypes) EXPECT_TRUE(cuda::matvec_supported(t)) << type_name(t);
  EXPECT_THROW(cuda::matvec_quantized(TensorType::IQ2_XXS, nullptr, 4, 128, nullptr, nullptr), std::invalid_argument);
  const auto act_2 = reinterpret_cast<const void*>(uintptr_t{2});  // Q8_K blocks want 4 bytes
  EXPECT_THROW(cuda::matvec_quantized(TensorType::IQ1_M, nullptr, 4, 256, act_2, nullptr), std::invalid_argument);
  cuda::MatvecBatch odd_stride;
  odd_stride.count = 2;
  odd_stride.weight_stride_bytes = 64;  // not a whole number of 66-byte blocks
  EXPECT_THROW(cuda::matvec_quantized_batched(TensorType::IQ2_XXS, nullptr, 4, 256, nullptr, nullptr, odd_stride),
               std::invalid_argument);
}

// Argument checks come before any CUDA call, so this runs without a device too.
TEST(CudaMatvecArguments, RejectsUnsupportedTypesAndShapes) {
  EXPECT_FALSE(cuda::matvec_supported(TensorType::Q8_K));  // an activation format, never a weight
  EXPECT_THROW(cuda::matvec_quantized(TensorType::Q8_K, nullptr, 4, 256, nullptr, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::matvec_quantized(TensorType::Q4_K, nullptr, 4, 100, nullptr, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::matvec_quantized(TensorType::Q8_0, nullptr, 0, 64, nullptr, nullptr), std::invalid_argument);
  const auto misaligned = reinterpret_cast<const void*>(uintptr_t{8});
  EXPECT_THROW(cuda::matvec_quantized(TensorType::Q8_0, misaligned, 4, 64, nullptr, nullptr), std::invalid_argument);
  // Q8_K activation blocks start with a float: a 2-byte aligned activation row is refused.
  const auto act_2 = reinterpret_cast<const void*>(uintptr_t{2});
  EXPECT_THROW(cuda::matvec_quantized(TensorType::Q4_K, nullptr, 4, 256, act_2, nullptr), std::invalid_argument);
  cuda::MatvecBatch odd_stride;
  odd_stride.count = 2;
  odd_stride.weight_stride_bytes = 100;  // not a whole number of 144-byte blocks
  EXPECT_THROW(cuda::matvec_quantized_batched(TensorType::Q4_K, nullptr, 4, 256, nullptr, nullptr, odd_stride),
               std::invalid_argument);
}

}  // namespace
}  // namespace moraine
