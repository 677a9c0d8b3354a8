// router_fused (kernels/cuda/router_fused.h) against the pair it replaces, matvec_float_batched
// (token batch) then route_softmax_top_k, byte for byte (memcmp of logits, chosen ids and
// weights): F32/F16/BF16 router weights, 128/512/60 experts, k 8 and 10, with and without
// renormalisation, 1/3/16 tokens; repeated calls and a replayed graph (the arrival counters must
// come back to zero), and planted equal rows (exact ties go to the lower id in both).
// rms_norm_router_fused likewise against rms_norm then that pair (h as well), and its h against
// the CPU reference's rms_norm (common/reference/ops.h) within rms_norm_test.cpp's bound: the
// double sums differ only in order (at most ~n 2^-53 relative), so 4 ulp after the float steps.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cuda/device_buffer.h"
#include "common/reference/ops.h"
#include "kernels/cuda/matvec_float.h"
#include "kernels/cuda/residual_add.h"
#include "kernels/cuda/rms_norm.h"
#include "kernels/cuda/router.h"
#include "kernels/cuda/router_fused.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

// A device buffer's whole contents on the host.
template <typename T>
std::vector<T> downloaded(const cuda::DeviceBuffer<T>& b) {
  std::vector<T> v(b.size());
  b.download(v.data(), v.size());
  return v;
}

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
    Routed get() const { return {downloaded(logits), downloaded(weight), downloaded(chosen)}; }
  };
  // The unfused pair on the activations act ([n][d]): the router matvec, then softmax top-k.
  Routed matvec_then_route(const float* act) const {
    Out o(c);
    cuda::MatvecBatch b;
    b.count = static_cast<int>(c.n);
    b.act_stride_bytes = c.d * static_cast<int64_t>(sizeof(float));
    b.out_stride = c.n_expert;
    cuda::matvec_float_batched(c.type, w.get(), c.n_expert, c.d, act, o.logits.get(), b);
    cuda::route_softmax_top_k(o.logits.get(), c.n, c.n_expert, c.k, c.renorm, o.chosen.get(), o.weight.get());
    return o.get();
  }
  Routed unfused() const { return matvec_then_route(x.get()); }
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

// The models' router shapes, then a test's own `more` (n left 0), at 1, 3 and 16 tokens, token
// count by token count.
std::vector<Case> at_token_counts(std::initializer_list<Case> more) {
  const Case models[] = {
      {TensorType::F32, 128, 2048, 0, 8, true},    // Qwen3-30B-A3B
      {TensorType::F32, 512, 2048, 0, 10, true},   // Qwen3-Next
      {TensorType::BF16, 128, 2048, 0, 8, false},
  };
  std::vector<Case> cases;
  for (int64_t n : {1, 3, 16}) {
    for (Case c : models) cases.push_back({c.type, c.n_expert, c.d, n, c.k, c.renorm});
    for (Case c : more) cases.push_back({c.type, c.n_expert, c.d, n, c.k, c.renorm});
  }
  return cases;
}

// The fused kernels' arrival counters must come back to zero after every call.
void expect_arrivals_back_to_zero(const cuda::DeviceBuffer<uint32_t>& arrivals) {
  for (uint32_t v : downloaded(arrivals)) EXPECT_EQ(v, 0u) << "an arrival counter was left non-zero";
}

// A non-blocking stream and a graph captured on it, destroyed with the holder.
struct CapturedGraph {
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CapturedGraph() = default;
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  ~CapturedGraph() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  // What record(stream) enqueues, captured and instantiated (call under ASSERT_NO_FATAL_FAILURE).
  template <class Record>
  void capture(cudaStreamCaptureMode mode, Record&& record) {
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaStreamBeginCapture(stream, mode), cudaSuccess);
    record(stream);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  }
  // One replay after the legacy stream's fills landed, waited for (call under ASSERT_NO_FATAL_FAILURE).
  void replay() const {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
};

TEST(CudaRouterFused, BitIdenticalToMatvecThenRoute) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  cuda::DeviceBuffer<uint32_t> arrivals(16);
  arrivals.fill_bytes(0);
  uint32_t seed = 1;
  const std::vector<Case> cases = at_token_counts({
      {TensorType::F16, 60, 1000, 0, 4, true},   // partial last CTA, odd width
  });
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name());
    const bool ties = seed % 2 == 0;
    const RouterInputs s(c, seed++, ties);
    const Routed want = s.unfused();
    expect_same(s.fused(arrivals.get()), want, c.name());
    expect_same(s.fused(arrivals.get()), want, c.name() + ", second call");  // counters back to zero
  }
  expect_arrivals_back_to_zero(arrivals);
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
  CapturedGraph g;
  ASSERT_NO_FATAL_FAILURE(g.capture(cudaStreamCaptureModeGlobal, [&](cudaStream_t stream) {
    cuda::router_fused(c.type, s.w.get(), c.n_expert, c.d, s.x.get(), c.n, c.k, c.renorm, o.logits.get(),
                       o.chosen.get(), o.weight.get(), arrivals.get(), stream);
  }));
  for (int rep = 0; rep < 5; ++rep) {
    o.chosen.fill_bytes(0xff);
    o.weight.fill_bytes(0xff);
    ASSERT_NO_FATAL_FAILURE(g.replay());
    expect_same(o.get(), want, "replay " + std::to_string(rep));
  }
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

// ---- rms_norm_router_fused ----

struct NormRouted {
  Routed r;
  std::vector<float> h;
};

// Inputs of the norm in front: x with a wide spread of magnitudes, norm weights (or none).
struct NormRouterInputs : RouterInputs {
  cuda::DeviceBuffer<float> norm_w;
  std::vector<float> x_host, w_host;
  bool weighted;
  static constexpr float kEps = 1e-6f;
  NormRouterInputs(const Case& cs, uint32_t seed, bool ties, bool with_weight)
      : RouterInputs(cs, seed, ties), weighted(with_weight) {
    std::mt19937 rng(seed + 1000);
    x_host = cuda_test::random_values(rng, static_cast<size_t>(c.n * c.d));
    x.upload(x_host.data(), x_host.size());
    w_host = cuda_test::normal_values(rng, static_cast<size_t>(c.d), 1.0f);
    norm_w = cuda::DeviceBuffer<float>(w_host.size());
    norm_w.upload(w_host.data(), w_host.size());
  }
  const float* nw() const { return weighted ? norm_w.get() : nullptr; }
  NormRouted unfused() const {
    cuda::DeviceBuffer<float> h = poisoned_h();
    cuda::rms_norm(x.get(), nw(), h.get(), c.d, c.n, kEps);
    return {matvec_then_route(h.get()), downloaded(h)};
  }
  NormRouted fused(uint32_t* arrivals) const {
    cuda::DeviceBuffer<float> h = poisoned_h();
    Out o(c);
    cuda::rms_norm_router_fused(c.type, w.get(), c.n_expert, c.d, x.get(), nw(), kEps, c.n, h.get(), c.k, c.renorm,
                                o.logits.get(), o.chosen.get(), o.weight.get(), arrivals);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return {o.get(), downloaded(h)};
  }
  // The normalised rows' buffer, all NaN bits until a kernel writes it.
  cuda::DeviceBuffer<float> poisoned_h() const {
    cuda::DeviceBuffer<float> h(static_cast<size_t>(c.n * c.d));
    h.fill_bytes(0xff);
    return h;
  }
  // The CPU reference's normalised rows.
  std::vector<float> reference_h() const {
    std::vector<float> h(x_host.size());
    for (int64_t t = 0; t < c.n; ++t)
      reference::rms_norm(x_host.data() + t * c.d, weighted ? w_host.data() : nullptr, c.d, kEps, h.data() + t * c.d);
    return h;
  }
};

TEST(CudaRmsNormRouterFused, BitIdenticalToNormThenMatvecThenRoute) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  cuda::DeviceBuffer<uint32_t> arrivals(16);
  arrivals.fill_bytes(0);
  uint32_t seed = 101;
  const std::vector<Case> cases = at_token_counts({
      {TensorType::F16, 61, 1000, 0, 4, true},    // odd experts (half-full last CTA), odd width
      {TensorType::F32, 128, 3072, 0, 8, true},   // 12 elements per thread (the 16-wide path)
  });
  for (const Case& c : cases) {
    const bool weighted = seed % 3 != 0;
    SCOPED_TRACE(c.name() + (weighted ? ", norm weight" : ", no norm weight"));
    const NormRouterInputs s(c, seed, seed % 2 == 0, weighted);
    ++seed;
    const NormRouted want = s.unfused();
    const std::vector<float> ref = s.reference_h();
    for (int call = 0; call < 2; ++call) {   // the second call: the counters came back to zero
      const NormRouted got = s.fused(arrivals.get());
      ASSERT_EQ(std::memcmp(got.h.data(), want.h.data(), want.h.size() * 4), 0) << "h differs from rms_norm's";
      for (size_t i = 0; i < ref.size(); ++i) {
        const double tol = 8.0 * std::ldexp(std::fabs(double(ref[i])), -24) + std::numeric_limits<float>::min();
        ASSERT_LE(std::fabs(double(got.h[i]) - ref[i]), tol)
            << "h[" << i << "] = " << got.h[i] << ", the CPU reference's " << ref[i];
      }
      expect_same(got.r, want.r, c.name() + ", call " + std::to_string(call));
    }
  }
  expect_arrivals_back_to_zero(arrivals);
}

// Captured behind a kernel that writes x (PDL edge: the fused kernel must wait for it before
// reading x, though it loads its weights earlier), replayed: each replay sees the new x.
TEST(CudaRmsNormRouterFused, GraphWaitsForTheKernelBefore) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const Case c{TensorType::F32, 128, 2048, 2, 8, true};
  const NormRouterInputs s(c, 303, false, true);
  std::mt19937 rng(304);
  const std::vector<float> delta = cuda_test::normal_values(rng, static_cast<size_t>(c.n * c.d), 0.5f);
  cuda::DeviceBuffer<float> ddelta(delta.size()), h(static_cast<size_t>(c.n * c.d));
  ddelta.upload(delta.data(), delta.size());
  cuda::DeviceBuffer<uint32_t> arrivals(static_cast<size_t>(c.n));
  arrivals.fill_bytes(0);
  RouterInputs::Out o(c);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  CapturedGraph g;
  ASSERT_NO_FATAL_FAILURE(g.capture(cudaStreamCaptureModeThreadLocal, [&](cudaStream_t stream) {
    cuda::residual_add(s.x.get(), ddelta.get(), c.n * c.d, stream);   // x += delta, then the fused kernel reads x
    cuda::rms_norm_router_fused(c.type, s.w.get(), c.n_expert, c.d, s.x.get(), s.norm_w.get(), NormRouterInputs::kEps,
                                c.n, h.get(), c.k, c.renorm, o.logits.get(), o.chosen.get(), o.weight.get(),
                                arrivals.get(), stream);
  }));
  for (int rep = 0; rep < 4; ++rep) {
    h.fill_bytes(0xff);
    o.chosen.fill_bytes(0xff);
    o.weight.fill_bytes(0xff);
    o.logits.fill_bytes(0xff);
    ASSERT_NO_FATAL_FAILURE(g.replay());
    const NormRouted want = s.unfused();   // on x as the replay left it
    const std::vector<float> got_h = downloaded(h);
    ASSERT_EQ(std::memcmp(got_h.data(), want.h.data(), want.h.size() * 4), 0) << "replay " << rep << ": h";
    expect_same(o.get(), want.r, "replay " + std::to_string(rep));
  }
}

TEST(CudaRmsNormRouterFusedArguments, RejectsBadShapes) {
  float f = 0;
  int32_t i = 0;
  uint32_t a = 0;
  EXPECT_FALSE(cuda::rms_norm_router_fused_supported(TensorType::Q8_0, 128, 2048));
  EXPECT_FALSE(cuda::rms_norm_router_fused_supported(TensorType::F32, 128, 8192));   // above 16 per thread
  EXPECT_FALSE(cuda::rms_norm_router_fused_supported(TensorType::F32, 128, 4096));   // 48 KiB: no room for the static
  EXPECT_FALSE(cuda::rms_norm_router_fused_supported(TensorType::F32, 128, 2050));   // rows not whole 16 bytes
  EXPECT_TRUE(cuda::rms_norm_router_fused_supported(TensorType::F32, 128, 2048));
  EXPECT_THROW(cuda::rms_norm_router_fused(TensorType::Q8_0, &f, 128, 2048, &f, &f, 1e-6f, 1, &f, 8, true, &f, &i, &f,
                                           &a),
               std::invalid_argument);
  EXPECT_THROW(cuda::rms_norm_router_fused(TensorType::F32, &f, 128, 2048, &f, &f, 1e-6f, 1, &f, 0, true, &f, &i, &f,
                                           &a),
               std::invalid_argument);
  EXPECT_THROW(cuda::rms_norm_router_fused(TensorType::F32, &f, 128, 2048, &f, &f, 1e-6f, 0, &f, 8, true, &f, &i, &f,
                                           &a),
               std::invalid_argument);
  EXPECT_THROW(cuda::rms_norm_router_fused(TensorType::F32, &f, 128, 2048, &f, &f, 1e-6f, 1, nullptr, 8, true, &f, &i,
                                           &f, &a),
               std::invalid_argument);
}

}  // namespace
}  // namespace moraine
