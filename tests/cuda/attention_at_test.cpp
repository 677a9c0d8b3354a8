// Graph-safe attention (cuda::attention_at: n_past read from device memory, grid sized for a
// capacity) against cuda::attention with the same inputs: the outputs must be the very same bits
// (same chunk cut, same arithmetic), at positions around the chunk edges (0, 1, 255, 256, 257,
// 3000) and for 1, 5 and 16 rows; through a captured CUDA graph replayed at several positions;
// and all NaN (never a stray read) when the device position is outside the capacity.
// cuda::attention itself is checked against the exact attention in attention_test.cpp.
// The half cache (the CUDA backend's F16 KV): attention_at over a half cache gives the bits of
// attention over a float cache of the same (half-rounded) values, at the same positions and rows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "common/formats/half_float.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/device_buffer.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

// Random q (for kMaxRows rows), gate and a full cache of max_ctx positions on the device.
struct Inputs {
  cuda::AttentionShape s;
  int64_t max_ctx;
  bool gated;
  cuda::DeviceBuffer<float> q, k, v, gate;
  cuda::DeviceBuffer<__half> k16, v16;   // f16: the cache as halves (k, v: the same values as floats)
  Inputs(const cuda::AttentionShape& shape_, int64_t max_ctx_, bool gated_, uint32_t seed, bool f16 = false)
      : s(shape_), max_ctx(max_ctx_), gated(gated_) {
    std::mt19937 rng(seed);
    const int64_t qd = s.n_head * s.head_dim, rows = cuda::kAttentionAtMaxRows;
    const std::vector<float> hq = cuda_test::normal_values(rng, static_cast<size_t>(rows * qd), 1.0f);
    std::vector<float> hk = cuda_test::normal_values(rng, static_cast<size_t>(max_ctx * s.kv_stride), 1.0f);
    std::vector<float> hv = cuda_test::random_values(rng, static_cast<size_t>(max_ctx * s.kv_stride));
    if (f16) {
      for (auto [x, d] : {std::pair{&hk, &k16}, std::pair{&hv, &v16}}) {
        std::vector<uint16_t> h(x->size());
        for (size_t i = 0; i < h.size(); ++i) {
          h[i] = half::fp32_to_fp16((*x)[i]);
          (*x)[i] = half::fp16_to_fp32(h[i]);
        }
        *d = cuda::DeviceBuffer<__half>(h.size());
        d->upload(reinterpret_cast<const __half*>(h.data()), h.size());
      }
    }
    const std::vector<float> hg = cuda_test::normal_values(rng, static_cast<size_t>(rows * 2 * qd), 2.0f);
    q = cuda::DeviceBuffer<float>(hq.size());
    k = cuda::DeviceBuffer<float>(hk.size());
    v = cuda::DeviceBuffer<float>(hv.size());
    gate = cuda::DeviceBuffer<float>(hg.size());
    q.upload(hq.data(), hq.size());
    k.upload(hk.data(), hk.size());
    v.upload(hv.data(), hv.size());
    gate.upload(hg.data(), hg.size());
  }
  const float* g() const { return gated ? gate.get() : nullptr; }
  int64_t qd() const { return s.n_head * s.head_dim; }
};

std::vector<float> run_attention(const Inputs& in, int64_t n, int64_t n_past) {
  const int64_t scratch = cuda::attention_scratch_floats(in.s, n, n_past + n);
  cuda::DeviceBuffer<float> dscratch(static_cast<size_t>(scratch)), dout(static_cast<size_t>(n * in.qd()));
  dout.fill_bytes(0xff);
  cuda::attention(in.s, in.q.get(), in.k.get(), in.v.get(), n, n_past, in.g(), 2 * in.qd(), 2 * in.s.head_dim,
                  dout.get(), dscratch.get(), scratch);
  std::vector<float> out(dout.size());
  dout.download(out.data(), out.size());
  return out;
}

void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_FALSE(std::isnan(want[i])) << what << ": attention left output " << i << " unwritten";
    ASSERT_EQ(std::memcmp(&got[i], &want[i], 4), 0)
        << what << ": output " << i << ": attention_at " << got[i] << ", attention " << want[i];
  }
}

// f16: attention_at over the half cache, attention over the float cache of the same values.
void check_positions(const cuda::AttentionShape& s, bool gated, uint32_t seed, bool f16 = false) {
  const int64_t max_ctx = 3000 + cuda::kAttentionAtMaxRows + 37;  // a capacity past every call's length
  const Inputs in(s, max_ctx, gated, seed, f16);
  const int64_t qd = in.qd();
  for (int64_t n : {int64_t{1}, int64_t{5}, cuda::kAttentionAtMaxRows}) {
    const int64_t scratch = cuda::attention_at_scratch_floats(s, n, max_ctx);
    cuda::DeviceBuffer<float> dscratch(static_cast<size_t>(scratch)), dout(static_cast<size_t>(n * qd));
    cuda::DeviceBuffer<int32_t> dpast(1);
    for (int32_t n_past : {0, 1, 255, 256, 257, 3000}) {
      dpast.upload(&n_past, 1);
      dout.fill_bytes(0xff);
      dscratch.fill_bytes(0xff);
      if (f16)
        cuda::attention_at(s, in.q.get(), in.k16.get(), in.v16.get(), n, dpast.get(), max_ctx, in.g(), 2 * qd,
                           2 * s.head_dim, dout.get(), dscratch.get(), scratch);
      else
        cuda::attention_at(s, in.q.get(), in.k.get(), in.v.get(), n, dpast.get(), max_ctx, in.g(), 2 * qd,
                           2 * s.head_dim, dout.get(), dscratch.get(), scratch);
      std::vector<float> got(dout.size());
      dout.download(got.data(), got.size());
      expect_same_bits(got, run_attention(in, n, n_past), "n=" + std::to_string(n) + " n_past=" + std::to_string(n_past));
    }
  }
}

TEST(CudaAttentionAt, BitIdenticalToAttention) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check_positions(cuda_test::attention_shape(32, 4, 128), false, 1);  // Qwen3-30B
  check_positions(cuda_test::attention_shape(16, 2, 256), true, 2);   // qwen3next, gated
  check_positions(cuda_test::attention_shape(6, 2, 40), true, 3);     // group of 3, odd head_dim
}

TEST(CudaAttentionAtF16, BitIdenticalToAttentionOnAFloatCacheOfTheSameValues) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check_positions(cuda_test::attention_shape(32, 4, 128), false, 101, true);
  check_positions(cuda_test::attention_shape(6, 2, 40), true, 103, true);
  check_positions(cuda_test::attention_shape(6, 3, 16), true, 104, true);   // the golden qwen3moe_odd's heads
}

// One capture, replays at other positions: the captured launch reads the live position.
TEST(CudaAttentionAt, CapturedGraphFollowsDevicePosition) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const cuda::AttentionShape s = cuda_test::attention_shape(32, 4, 128);
  const int64_t max_ctx = 4096, n = 2, qd = s.n_head * s.head_dim;
  const Inputs in(s, max_ctx, false, 4);
  const int64_t scratch = cuda::attention_at_scratch_floats(s, n, max_ctx);
  cuda::DeviceBuffer<float> dscratch(static_cast<size_t>(scratch)), dout(static_cast<size_t>(n * qd));
  cuda::DeviceBuffer<int32_t> dpast(1);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  cuda::attention_at(s, in.q.get(), in.k.get(), in.v.get(), n, dpast.get(), max_ctx, nullptr, 0, 0, dout.get(),
                     dscratch.get(), scratch, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int32_t n_past : {7, 1000, 4094, 256, 0}) {
    dpast.upload(&n_past, 1);
    dout.fill_bytes(0xff);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<float> got(dout.size());
    dout.download(got.data(), got.size());
    expect_same_bits(got, run_attention(in, n, n_past), "graph replay at n_past=" + std::to_string(n_past));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// A device position past the capacity (or negative) cannot throw inside a graph: the output is all
// NaN instead (compute-sanitizer runs this to show no read goes out of bounds).
TEST(CudaAttentionAt, PositionOutsideCapacityGivesNaN) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const cuda::AttentionShape s = cuda_test::attention_shape(8, 2, 64);
  const int64_t max_ctx = 300, n = 3, qd = s.n_head * s.head_dim;
  const Inputs in(s, max_ctx, false, 5);
  const int64_t scratch = cuda::attention_at_scratch_floats(s, n, max_ctx);
  cuda::DeviceBuffer<float> dscratch(static_cast<size_t>(scratch)), dout(static_cast<size_t>(n * qd));
  cuda::DeviceBuffer<int32_t> dpast(1);
  for (int32_t n_past : {298, 1 << 30, -1}) {
    dpast.upload(&n_past, 1);
    dout.fill_bytes(0);
    cuda::attention_at(s, in.q.get(), in.k.get(), in.v.get(), n, dpast.get(), max_ctx, nullptr, 0, 0, dout.get(),
                       dscratch.get(), scratch);
    std::vector<float> got(dout.size());
    dout.download(got.data(), got.size());
    for (size_t i = 0; i < got.size(); ++i) ASSERT_TRUE(std::isnan(got[i])) << "n_past " << n_past << ", output " << i;
  }
}

TEST(CudaAttentionAtArguments, RejectsBadCalls) {
  const float* kNoCache = nullptr;   // picks the float cache's overload
  const cuda::AttentionShape s = cuda_test::attention_shape(4, 2, 64);
  int32_t* fake = reinterpret_cast<int32_t*>(16);  // never dereferenced: the checks come first
  const int64_t need = cuda::attention_at_scratch_floats(s, 1, 512);
  EXPECT_THROW(cuda::attention_at(s, nullptr, kNoCache, kNoCache, 1, nullptr, 512, nullptr, 0, 0, nullptr, nullptr, need),
               std::invalid_argument);  // no position pointer
  EXPECT_THROW(cuda::attention_at(s, nullptr, kNoCache, kNoCache, 17, fake, 512, nullptr, 0, 0, nullptr, nullptr, 1 << 30),
               std::invalid_argument);  // more rows than kAttentionAtMaxRows
  EXPECT_THROW(cuda::attention_at(s, nullptr, kNoCache, kNoCache, 1, fake, 512, nullptr, 0, 0, nullptr, nullptr, need - 1),
               std::invalid_argument);  // scratch one float short
  EXPECT_THROW(cuda::attention_at(cuda_test::attention_shape(4, 3, 64), nullptr, kNoCache, kNoCache, 1, fake, 512, nullptr, 0, 0, nullptr,
                                  nullptr, 1 << 30),
               std::invalid_argument);  // 4 heads over 3 kv heads
}

}  // namespace
}  // namespace moraine
