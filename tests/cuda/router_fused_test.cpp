// router_fused (kernels/cuda/router_fused.h) against the pair it replaces, matvec_float_batched
// (token batch) then route_softmax_top_k, byte for byte (memcmp of logits, chosen ids and
// weights): F32/F16/BF16 router weights, 128/512/60 experts, k 8 and 10, with and without
// renormalisation, 1/3/16 tokens; repeated calls and a replayed graph (the arrival counters must
// come back to zero), and planted equal rows (exact ties go to the lower id in both).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/matvec_float.h"
#include "kernels/cuda/router.h"
#include "kernels/cuda/router_fused.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

struct Case {
  TensorType type;
  int64_t n_expert, d, n, k;
  bool renorm;
  std::string name() const {
    return std::string(type_name(type)) + " " + std::to_string(n_expert) + " experts x " + std::to_string(d) + ", " +
           std::to_string(n) + " tokens, top-" + std::to_string(k) + (renorm ? " renormalised" : "");
  }
};

struct Routed {
  std::vector<float> logits, weight;
  std::vector<int32_t> chosen;
};

struct RouterInputs {
  Case c;
  cuda::DeviceBuffer<uint8_t> w;
  cuda::DeviceBuffer<float> x;
  RouterInputs(const Case& cs, uint32_t seed, bool tie_rows) : c(cs) {
    std::mt19937 rng(seed);
    std::vector<float> wf = cuda_test::normal_values(rng, static_cast<size_t>(c.n_expert * c.d), 0.05f);
    if (tie_rows)  // expert rows 3 and 40 equal to row 7 and 2: equal logits, so ties the router must break
      for (int64_t i = 0; i < c.d; ++i) wf[3 * c.d + i] = wf[7 * c.d + i], wf[40 * c.d + i] = wf[2 * c.d + i];
    const size_t rb = row_bytes(c.type, c.d);
    std::vector<uint8_t> wb(rb * static_cast<size_t>(c.n_expert));
    for (int64_t r = 0; r < c.n_expert; ++r) quantize_row(c.type, wf.data() + r * c.d, wb.data() + r * rb, c.d);
    w = cuda::DeviceBuffer<uint8_t>(wb.size());
    w.upload(wb.data(), wb.size());
    const std::vector<float> xf = cuda_test::normal_values(rng, static_cast<size_t>(c.n * c.d), 1.0f);
    x = cuda::DeviceBuffer<float>(xf.size());
    x.upload(xf.data(), xf.size());
  }
  struct Out {
    cuda::DeviceBuffer<float> logits, weight;
    cuda::DeviceBuffer<int32_t> chosen;
    explicit Out(const Case& c)
        : logits(static_cast<size_t>(c.n * c.n_expert)), weight(static_cast<size_t>(c.n * c.k)),
          chosen(static_cast<size_t>(c.n * c.k)) {
      logits.fill_bytes(0xff);
      weight.fill_bytes(0xff);
      chosen.fill_bytes(0xff);
    }
    Routed get() const {
      Routed r{std::vector<float>(logits.size()), std::vector<float>(weight.size()), std::vector<int32_t>(chosen.size())};
      logits.download(r.logits.data(), r.logits.size());
      weight.download(r.weight.data(), r.weight.size());
      chosen.download(r.chosen.data(), r.chosen.size());
      return r;
    }
  };
  Routed unfused() const {
    Out o(c);
    cuda::MatvecBatch b;
    b.count = static_cast<int>(c.n);
    b.act_stride_bytes = c.d * static_cast<int64_t>(sizeof(float));
    b.out_stride = c.n_expert;
    cuda::matvec_float_batched(c.type, w.get(), c.n_expert, c.d, x.get(), o.logits.get(), b);
    cuda::route_softmax_top_k(o.logits.get(), c.n, c.n_expert, c.k, c.renorm, o.chosen.get(), o.weight.get());
    return o.get();
  }
  Routed fused(uint32_t* arrivals, cudaStream_t stream = nullptr) const {
    Out o(c);
    cuda::router_fused(c.type, w.get(), c.n_expert, c.d, x.get(), c.n, c.k, c.renorm, o.logits.get(), o.chosen.get(),
                       o.weight.get(), arrivals, stream);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    return o.get();
  }
};

void expect_same(const Routed& got, const Routed& want, const std::string& what) {
  ASSERT_EQ(std::memcmp(got.logits.data(), want.logits.data(), want.logits.size() * 4), 0) << what << ": logits";
  for (size_t i = 0; i < want.chosen.size(); ++i) {
    ASSERT_EQ(got.chosen[i], want.chosen[i]) << what << ": slot " << i;
    ASSERT_EQ(std::memcmp(&got.weight[i], &want.weight[i], 4), 0)
        << what << ": weight of slot " << i << ": fused " << got.weight[i] << ", unfused " << want.weight[i];
  }
}

TEST(CudaRouterFused, BitIdenticalToMatvecThenRoute) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  cuda::DeviceBuffer<uint32_t> arrivals(16);
  arrivals.fill_bytes(0);
  uint32_t seed = 1;
  std::vector<Case> cases;
  for (int64_t n : {1, 3, 16}) {
    cases.push_back({TensorType::F32, 128, 2048, n, 8, true});  // Qwen3-30B-A3B
    cases.push_back({TensorType::F32, 512, 2048, n, 10, true});  // Qwen3-Next
    cases.push_back({TensorType::BF16, 128, 2048, n, 8, false});
    cases.push_back({TensorType::F16, 60, 1000, n, 4, true});   // partial last CTA, odd width
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name());
    const bool ties = seed % 2 == 0;
    const RouterInputs s(c, seed++, ties);
    const Routed want = s.unfused();
    expect_same(s.fused(arrivals.get()), want, c.name());
    expect_same(s.fused(arrivals.get()), want, c.name() + ", second call");  // counters back to zero
  }
  std::vector<uint32_t> left(arrivals.size());
  arrivals.download(left.data(), left.size());
  for (uint32_t v : left) EXPECT_EQ(v, 0u) << "an arrival counter was left non-zero";
}

TEST(CudaRouterFused, GraphReplays) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const Case c{TensorType::F32, 128, 2048, 3, 8, true};
  const RouterInputs s(c, 77, true);
  const Routed want = s.unfused();
  cuda::DeviceBuffer<uint32_t> arrivals(static_cast<size_t>(c.n));
  arrivals.fill_bytes(0);
  RouterInputs::Out o(c);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the fills above run on the legacy stream
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  cuda::router_fused(c.type, s.w.get(), c.n_expert, c.d, s.x.get(), c.n, c.k, c.renorm, o.logits.get(), o.chosen.get(),
                     o.weight.get(), arrivals.get(), stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int rep = 0; rep < 5; ++rep) {
    o.chosen.fill_bytes(0xff);
    o.weight.fill_bytes(0xff);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    expect_same(o.get(), want, "replay " + std::to_string(rep));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Argument checks come before any CUDA call, so this runs without a device too.
TEST(CudaRouterFusedArguments, RejectsBadShapes) {
  float f = 0;
  int32_t i = 0;
  uint32_t a = 0;
  EXPECT_THROW(cuda::router_fused(TensorType::Q8_0, &f, 128, 2048, &f, 1, 8, true, &f, &i, &f, &a), std::invalid_argument);
  EXPECT_THROW(cuda::router_fused(TensorType::F32, &f, 128, 2048, &f, 1, 0, true, &f, &i, &f, &a), std::invalid_argument);
  EXPECT_THROW(cuda::router_fused(TensorType::F32, &f, 8, 2048, &f, 1, 9, true, &f, &i, &f, &a), std::invalid_argument);
  EXPECT_THROW(cuda::router_fused(TensorType::F32, &f, 128, 20000, &f, 1, 8, true, &f, &i, &f, &a), std::invalid_argument);
  EXPECT_THROW(cuda::router_fused(TensorType::F32, &f, 128, 2048, &f, 1, 8, true, &f, &i, &f, nullptr),
               std::invalid_argument);
}

}  // namespace
}  // namespace moraine
