// Embedding rows on the GPU (kernels/cuda/embed_rows.h) against moraine::dequantize_row of the
// same table rows: bit-identical for every format the GPU decodes (the block decoders use the
// scalar dequantizer's float expressions). Repeated ids and the last row included.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/embed_rows.h"
#include "tests/cuda/cuda_test_support.h"
#include "tests/cuda/iq_test_blocks.h"

namespace moraine {
namespace {

bool is_iq_grid(TensorType t) {
  for (TensorType g : cuda_test::kIqGridTypes)
    if (g == t) return true;
  return false;
}

void check(TensorType t, int64_t n_vocab, int64_t d, uint32_t seed) {
  std::mt19937 rng(seed);
  const std::vector<float> values = cuda_test::random_values(rng, static_cast<size_t>(n_vocab * d));
  const size_t rb = row_bytes(t, d);
  std::vector<uint8_t> table(rb * static_cast<size_t>(n_vocab));
  if (is_iq_grid(t)) {   // moraine does not quantize to these: random valid blocks
    cuda_test::random_iq_blocks(t, table.data(), n_vocab * d / type_traits(t).block_elems, rng, 1e-3f, 1e-1f);
  } else {
    for (int64_t r = 0; r < n_vocab; ++r) quantize_row(t, values.data() + r * d, table.data() + r * rb, d);
  }
  const std::vector<int32_t> ids = {0, static_cast<int32_t>(n_vocab - 1), 3, 3, 7};
  const int64_t n = static_cast<int64_t>(ids.size());
  std::vector<float> want(static_cast<size_t>(n * d));
  for (int64_t i = 0; i < n; ++i) dequantize_row(t, table.data() + ids[i] * rb, want.data() + i * d, d);
  cuda::DeviceBuffer<uint8_t> dt(table.size());
  dt.upload(table.data(), table.size());
  cuda::DeviceBuffer<int32_t> did(ids.size());
  did.upload(ids.data(), ids.size());
  cuda::DeviceBuffer<float> dout(want.size());
  dout.fill_bytes(0xff);
  cuda::embed_rows(t, dt.get(), rb, d, did.get(), n, dout.get());
  std::vector<float> got(want.size());
  dout.download(got.data(), got.size());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0) << type_name(t);
}

TEST(CudaEmbedRows, BitIdenticalToDequantizeRow) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check(TensorType::F32, 11, 96, 1);
  check(TensorType::F16, 11, 130, 2);
  check(TensorType::BF16, 11, 130, 3);
  check(TensorType::Q8_0, 11, 2048, 4);
  // What hub files leave token_embd in besides: the k-quants, the legacy and IQ types (2-byte
  // aligned blocks of odd sizes: Q5_0's 22, IQ4_NL's 18, MXFP4's 17 bytes per row block).
  uint32_t seed = 5;
  for (TensorType t : {TensorType::Q2_K, TensorType::Q3_K, TensorType::Q4_K, TensorType::Q5_K, TensorType::Q6_K,
                       TensorType::Q4_0, TensorType::Q4_1, TensorType::Q5_0, TensorType::Q5_1, TensorType::IQ4_NL,
                       TensorType::IQ4_XS, TensorType::TQ1_0, TensorType::TQ2_0, TensorType::MXFP4})
    check(t, 13, 512, seed++);
  for (TensorType t : cuda_test::kIqGridTypes) check(t, 13, 512, seed++);
}

TEST(CudaEmbedRowsArguments, RejectsUnsupportedTypeAndShape) {
  EXPECT_THROW(cuda::embed_rows(TensorType::Q8_1, nullptr, 36, 256, nullptr, 1, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::embed_rows(TensorType::I32, nullptr, 1024, 256, nullptr, 1, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::embed_rows(TensorType::Q8_0, nullptr, 34, 33, nullptr, 1, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::embed_rows(TensorType::Q4_K, nullptr, 144, 128, nullptr, 1, nullptr), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
