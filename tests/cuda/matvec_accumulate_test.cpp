// MatvecBatch::accumulate (kernels/cuda/matvec.h): the quantized and float batched matvecs adding
// into y are byte for byte the plain matvec followed by residual_add(y, out), for every weight
// format, as a token batch against one matrix (the backend's o projection into the residual
// stream: 1, 3 and 16 tokens) and as selected experts by id. Fresh random weights, activations
// and residual rows; the unfused product goes into a poisoned buffer.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/matvec_float.h"
#include "kernels/cuda/quantize_activations_llama.h"
#include "kernels/cuda/residual_add.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

// `count` products of a rows x n matrix (token batch: one matrix; experts: matrix ids[e] of a
// pool) added into a random residual y of count x rows floats.
void check(TensorType w_type, int64_t rows, int64_t n, int count, bool experts, uint32_t seed) {
  SCOPED_TRACE(std::string(type_name(w_type)) + " rows=" + std::to_string(rows) + " n=" + std::to_string(n) +
               " count=" + std::to_string(count) + (experts ? " experts" : " tokens"));
  std::mt19937 rng(seed);
  const int pool = experts ? count + 3 : 1;
  const size_t rb = row_bytes(w_type, n);
  std::vector<uint8_t> w(rb * static_cast<size_t>(pool * rows));
  {
    const std::vector<float> wf = cuda_test::random_values(rng, static_cast<size_t>(pool * rows * n));
    for (int64_t r = 0; r < pool * rows; ++r) quantize_row(w_type, wf.data() + r * n, w.data() + r * rb, n);
  }
  const std::vector<float> x = cuda_test::random_values(rng, static_cast<size_t>(count * n));
  const std::vector<float> resid = cuda_test::random_values(rng, static_cast<size_t>(count * rows));
  std::vector<int32_t> ids(static_cast<size_t>(count));
  for (int e = 0; e < count; ++e) ids[static_cast<size_t>(e)] = (e * 5 + 2) % pool;

  cuda::DeviceBuffer<uint8_t> dw(w.size());
  dw.upload(w.data(), w.size());
  cuda::DeviceBuffer<float> dx(x.size()), dy(resid.size()), dr_want(resid.size()), dr_got(resid.size());
  dx.upload(x.data(), x.size());
  cuda::DeviceBuffer<int32_t> dids(ids.size());
  dids.upload(ids.data(), ids.size());

  cuda::MatvecBatch b;
  b.count = count;
  b.out_stride = rows;
  if (experts) {
    b.weight_stride_bytes = static_cast<int64_t>(rb) * rows;
    b.expert_ids = dids.get();
  }
  const bool is_float = cuda::matvec_float_supported(w_type);
  const TensorType at = is_float ? w_type : dot_activation_type(w_type);
  const size_t arb = is_float ? 0 : row_bytes(at, n);
  cuda::DeviceBuffer<uint8_t> act(is_float ? 1 : arb * static_cast<size_t>(count));
  const auto run = [&](float* y) {  // as the backend's run_matvec
    if (is_float) {
      b.act_stride_bytes = n * static_cast<int64_t>(sizeof(float));
      cuda::matvec_float_batched(w_type, dw.get(), rows, n, dx.get(), y, b);
    } else {
      cuda::quantize_activations_llama(at, dx.get(), act.get(), n, count);
      b.act_stride_bytes = static_cast<int64_t>(arb);
      cuda::matvec_quantized_batched(w_type, dw.get(), rows, n, act.get(), y, b);
    }
  };

  dy.fill_bytes(0xff);  // a row the matvec never writes turns the residual NaN
  dr_want.upload(resid.data(), resid.size());
  b.accumulate = false;
  run(dy.get());
  cuda::residual_add(dr_want.get(), dy.get(), static_cast<int64_t>(resid.size()));

  dr_got.upload(resid.data(), resid.size());
  b.accumulate = true;
  run(dr_got.get());

  std::vector<float> want(resid.size()), got(resid.size());
  dr_want.download(want.data(), want.size());
  dr_got.download(got.data(), got.size());
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_EQ(std::memcmp(&got[i], &want[i], 4), 0) << "y[" << i << "]: accumulated " << got[i] << ", matvec + residual_add "
                                                    << want[i];
}

class CudaMatvecAccumulate : public ::testing::TestWithParam<TensorType> {};

TEST_P(CudaMatvecAccumulate, BitIdenticalToMatvecThenResidualAdd) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const TensorType t = GetParam();
  uint32_t seed = 1;
  for (int count : {1, 3, 16}) check(t, 256, 4096, count, false, seed++);  // the o projection's row length
  check(t, 37, 768, 5, false, seed++);                                       // rows not a multiple of the CTA's
  check(t, 97, 2048, 8, true, seed++);                                       // selected experts
}

INSTANTIATE_TEST_SUITE_P(Formats, CudaMatvecAccumulate,
                         ::testing::Values(TensorType::Q8_0, TensorType::Q2_K, TensorType::Q3_K, TensorType::Q4_K,
                                           TensorType::Q5_K, TensorType::Q6_K, TensorType::MXFP4, TensorType::F32,
                                           TensorType::F16, TensorType::BF16),
                         [](const auto& p) { return std::string(type_name(p.param)); });

}  // namespace
}  // namespace moraine
