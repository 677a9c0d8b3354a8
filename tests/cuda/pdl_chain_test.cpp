// Programmatic dependent launch (kernels/cuda/launch.h) on a chain of the decode step's real
// kernels, as gpu_worker/cuda_backend.cu enqueues a layer: rms_norm -> quantize -> q|k|v matvec ->
// qk_norm_rope_store -> attention_decode (split + merge) -> quantize -> o matvec into the residual
// -> rms_norm -> router matvec -> top-k -> expert rows (half the layers through a device-to-host
// copy, a host function and a host-to-device copy, as the hand-off does; the others gathered on
// the device) -> moe_combine, then the lm head. Every layer reuses the same scratch buffers, so a
// kernel that touched its inputs before its predecessor finished, or overwrote a buffer its
// predecessor still read, would change the bits.
//
// The same work runs four ways from the same start: kernel by kernel with a stream
// synchronisation after each (no overlap possible: the per-kernel results the kernels' own tests
// check against their host references), on the stream with PDL, and as a captured graph replayed
// with PDL and with its programmatic edges made full (tools/kernel_bench/plain_graph.h: the graph
// without PDL). All four must agree bit for bit, step after step: first with the position
// advancing (synchronised steps, the attention reading a growing cache), then with back-to-back
// replays at one position (no host synchronisation between graphs).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cuda/attention_decode.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/embed_rows.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/matvec_float.h"
#include "kernels/cuda/moe_combine.h"
#include "kernels/cuda/qk_norm_rope_store.h"
#include "kernels/cuda/quantize_activations_llama.h"
#include "kernels/cuda/residual_add.h"
#include "kernels/cuda/rms_norm.h"
#include "kernels/cuda/router.h"
#include "kernels/cuda/row_gather.h"
#include "tests/cuda/cuda_test_support.h"
#include "tools/kernel_bench/decode_chain_buffers.h"
#include "tools/kernel_bench/plain_graph.h"

namespace moraine {
namespace {

using cuda::DeviceBuffer;
using cuda::uploaded;
using cuda::PinnedBuffer;

// A small model of the decode step's proportions (head_dim 64 is one attention_decode form).
constexpr int64_t kEmbd = 512, kHeads = 8, kKvHeads = 2, kHeadDim = 64, kExperts = 32, kTopK = 4;
constexpr int64_t kLayers = 4, kVocab = 1000, kMaxCtx = 96;
constexpr int64_t kQDim = kHeads * kHeadDim, kKvDim = kKvHeads * kHeadDim, kQkvRows = kQDim + 2 * kKvDim;
constexpr float kEps = 1e-6f;

std::vector<uint8_t> quantized(std::mt19937& rng, TensorType t, int64_t rows, int64_t n, float sd) {
  const std::vector<float> w = cuda_test::normal_values(rng, static_cast<size_t>(rows * n), sd);
  const size_t rb = row_bytes(t, n);
  std::vector<uint8_t> q(rb * static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) quantize_row(t, w.data() + r * n, q.data() + r * rb, n);
  return q;
}

struct Layer {
  DeviceBuffer<uint8_t> qkv, o;  // q8_0
  DeviceBuffer<float> attn_norm, ffn_norm, q_norm, k_norm, router, experts;  // router [kExperts][kEmbd] f32
  std::vector<float> experts_host;                                          // [kExperts][kEmbd]: the "expert outputs"
  DeviceBuffer<float> k_cache, v_cache;
};

// Everything the step touches on the device: weights and the scratch every layer reuses.
// The scratch every layer reuses is kernel_bench::DecodeChainBuffers (x, h, qkv_out, q, attn,
// scratch, logits, weight, slots, act, chosen, pos), the chain benches' set.
class DecodeChain : kernel_bench::DecodeChainBuffers {
 public:
  DecodeChain(const DecodeChain&) = delete;  // the host functions hold its address
  DecodeChain& operator=(const DecodeChain&) = delete;
  explicit DecodeChain(uint32_t seed)
      : DecodeChainBuffers(cuda_test::attention_shape(kHeads, kKvHeads, kHeadDim), kEmbd, kExperts, kTopK, kMaxCtx),
        shape_(cuda_test::attention_shape(kHeads, kKvHeads, kHeadDim)) {
    std::mt19937 rng(seed);
    for (int64_t il = 0; il < kLayers; ++il) {
      Layer L;
      L.qkv = uploaded(quantized(rng, TensorType::Q8_0, kQkvRows, kEmbd, 0.08f));
      L.o = uploaded(quantized(rng, TensorType::Q8_0, kEmbd, kQDim, 0.05f));
      L.attn_norm = uploaded(cuda_test::normal_values(rng, kEmbd, 1.0f));
      L.ffn_norm = uploaded(cuda_test::normal_values(rng, kEmbd, 1.0f));
      L.q_norm = uploaded(cuda_test::normal_values(rng, kHeadDim, 1.0f));
      L.k_norm = uploaded(cuda_test::normal_values(rng, kHeadDim, 1.0f));
      L.router = uploaded(cuda_test::normal_values(rng, kExperts * kEmbd, 0.1f));
      L.experts_host = cuda_test::normal_values(rng, kExperts * kEmbd, 0.3f);
      L.experts = uploaded(L.experts_host);
      L.k_cache = DeviceBuffer<float>(kMaxCtx * kKvDim);
      L.v_cache = DeviceBuffer<float>(kMaxCtx * kKvDim);
      layers_.push_back(std::move(L));
    }
    tok_embd_ = uploaded(quantized(rng, TensorType::Q8_0, kVocab, kEmbd, 0.5f));
    out_norm_ = uploaded(cuda_test::normal_values(rng, kEmbd, 1.0f));
    lm_head_ = uploaded(quantized(rng, TensorType::Q8_0, kVocab, kEmbd, 0.05f));
    e_ = DeviceBuffer<float>(kEmbd);
    out_ = DeviceBuffer<float>(kVocab);
    token_dev_ = DeviceBuffer<int32_t>(1);
    pos_pinned_ = PinnedBuffer<int32_t>(1);
    token_pinned_ = PinnedBuffer<int32_t>(1);
    chosen_pinned_ = PinnedBuffer<int32_t>(kTopK);
    rows_pinned_ = PinnedBuffer<float>(kTopK * kEmbd);
    for (const Layer& L : layers_) host_tasks_.push_back({this, &L});
    reset();
  }

  // The state every run starts from: x and the caches zero.
  void reset() {
    x.fill_bytes(0);
    for (Layer& L : layers_) {
      L.k_cache.fill_bytes(0);
      L.v_cache.fill_bytes(0);
    }
    CUDA_CHECK(cudaDeviceSynchronize());
  }

  void set_step(int32_t position, int32_t token) {
    pos_pinned_.get()[0] = position;
    token_pinned_.get()[0] = token;
  }

  // One decode step on `stream`; after() runs after every enqueued operation.
  template <class After>
  void enqueue(cudaStream_t s, const After& after) {
    CUDA_CHECK(cudaMemcpyAsync(pos.get(), pos_pinned_.get(), sizeof(int32_t), cudaMemcpyHostToDevice, s));
    after();
    CUDA_CHECK(cudaMemcpyAsync(token_dev_.get(), token_pinned_.get(), sizeof(int32_t), cudaMemcpyHostToDevice, s));
    after();
    cuda::embed_rows(TensorType::Q8_0, tok_embd_.get(), row_bytes(TensorType::Q8_0, kEmbd), kEmbd, token_dev_.get(), 1,
                     e_.get(), s);
    after();
    cuda::residual_add(x.get(), e_.get(), kEmbd, s);  // x carries over from step to step
    after();
    for (int64_t il = 0; il < kLayers; ++il) {
      Layer& L = layers_[il];
      cuda::rms_norm(x.get(), L.attn_norm.get(), h.get(), kEmbd, 1, kEps, s);
      after();
      cuda::quantize_activations_llama(TensorType::Q8_0, h.get(), act.get(), kEmbd, 1, s);
      after();
      cuda::MatvecBatch b;
      b.out_stride = kQkvRows;
      cuda::matvec_quantized_batched(TensorType::Q8_0, L.qkv.get(), kQkvRows, kEmbd, act.get(), qkv_out.get(), b, s);
      after();
      cuda::QkNormRopeStoreArgs a;
      a.q = qkv_out.get();
      a.q_row_stride = kQkvRows;
      a.q_head_stride = kHeadDim;
      a.k = qkv_out.get() + kQDim;
      a.k_row_stride = kQkvRows;
      a.v = a.k + kKvDim;
      a.v_row_stride = kQkvRows;
      a.q_norm = L.q_norm.get();
      a.k_norm = L.k_norm.get();
      a.rows = 1;
      a.n_head = kHeads;
      a.n_head_kv = kKvHeads;
      a.head_dim = kHeadDim;
      a.n_rot = kHeadDim;
      a.pos0_dev = pos.get();
      a.freq_base = 10000.0;
      a.eps = kEps;
      a.max_pos = kMaxCtx;
      a.q_out = q.get();
      a.k_cache = L.k_cache.get();
      a.v_cache = L.v_cache.get();
      cuda::qk_norm_rope_store(a, s);
      after();
      cuda::attention_decode(shape_, q.get(), L.k_cache.get(), L.v_cache.get(), 1, pos.get(), 0, kMaxCtx, nullptr,
                             0, 0, attn.get(), scratch.get(), scratch_floats, s);
      after();
      cuda::quantize_activations_llama(TensorType::Q8_0, attn.get(), act.get(), kQDim, 1, s);
      after();
      cuda::MatvecBatch ob;
      ob.out_stride = kEmbd;
      ob.accumulate = true;
      ob.weights_from_previous_kernel = il % 2 == 1;  // both matvec paths: weights before / after the wait
      cuda::matvec_quantized_batched(TensorType::Q8_0, L.o.get(), kEmbd, kQDim, act.get(), x.get(), ob, s);
      after();
      cuda::rms_norm(x.get(), L.ffn_norm.get(), h.get(), kEmbd, 1, kEps, s);
      after();
      cuda::MatvecBatch rb;
      rb.out_stride = kExperts;
      cuda::matvec_float_batched(TensorType::F32, L.router.get(), kExperts, kEmbd, h.get(), logits.get(), rb, s);
      after();
      cuda::route_softmax_top_k(logits.get(), 1, kExperts, kTopK, true, chosen.get(), weight.get(), s);
      after();
      if (il % 2 == 0) {  // the hand-off's shape: routing to the host, rows back from it
        CUDA_CHECK(cudaMemcpyAsync(chosen_pinned_.get(), chosen.get(), kTopK * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
        after();
        CUDA_CHECK(cudaLaunchHostFunc(s, &DecodeChain::host_rows, &host_tasks_[il]));
        after();
        CUDA_CHECK(cudaMemcpyAsync(slots.get(), rows_pinned_.get(), kTopK * kEmbd * sizeof(float),
                                   cudaMemcpyHostToDevice, s));
        after();
      } else {
        cuda::gather_rows(L.experts.get(), chosen.get(), slots.get(), kTopK, kEmbd, s);
        after();
      }
      cuda::moe_combine(x.get(), slots.get(), weight.get(), nullptr, nullptr, 1, kTopK, kEmbd, s);
      after();
    }
    cuda::rms_norm(x.get(), out_norm_.get(), h.get(), kEmbd, 1, kEps, s);
    after();
    cuda::quantize_activations_llama(TensorType::Q8_0, h.get(), act.get(), kEmbd, 1, s);
    after();
    cuda::MatvecBatch lb;
    lb.out_stride = kVocab;
    cuda::matvec_quantized_batched(TensorType::Q8_0, lm_head_.get(), kVocab, kEmbd, act.get(), out_.get(), lb, s);
    after();
  }

  // What a step leaves behind: x, the logits and every layer's caches, as bytes.
  std::vector<float> state() const {
    std::vector<float> v(static_cast<size_t>(kEmbd + kVocab + kLayers * 2 * kMaxCtx * kKvDim));
    float* p = v.data();
    x.download(p, kEmbd);
    out_.download(p + kEmbd, kVocab);
    p += kEmbd + kVocab;
    for (const Layer& L : layers_) {
      L.k_cache.download(p, kMaxCtx * kKvDim);
      L.v_cache.download(p + kMaxCtx * kKvDim, kMaxCtx * kKvDim);
      p += 2 * kMaxCtx * kKvDim;
    }
    return v;
  }

 private:
  // The host's part of a hand-off layer (a host-function node in the graph): the chosen experts'
  // rows into pinned memory, which a copy then takes to the device.
  struct HostTask {
    DecodeChain* chain;
    const Layer* layer;
  };
  static void CUDART_CB host_rows(void* task) {
    const auto* t = static_cast<const HostTask*>(task);
    DecodeChain* c = t->chain;
    for (int64_t s = 0; s < kTopK; ++s) {
      const int32_t e = c->chosen_pinned_.get()[s];
      float* dst = c->rows_pinned_.get() + s * kEmbd;
      if (e < 0 || e >= kExperts) {  // a corrupt routing must show in the result, not crash
        for (int64_t i = 0; i < kEmbd; ++i) dst[i] = -1e30f;
        continue;
      }
      std::memcpy(dst, t->layer->experts_host.data() + e * kEmbd, kEmbd * sizeof(float));
    }
  }

  cuda::AttentionShape shape_;
  std::vector<Layer> layers_;
  std::vector<HostTask> host_tasks_;  // per layer, for the host function (its address is captured)
  DeviceBuffer<uint8_t> tok_embd_, lm_head_;
  DeviceBuffer<float> out_norm_, e_, out_;
  DeviceBuffer<int32_t> token_dev_;
  PinnedBuffer<int32_t> pos_pinned_, token_pinned_, chosen_pinned_;
  PinnedBuffer<float> rows_pinned_;
};

// kGraphWithoutPdl: the graph of kGraph with its programmatic edges made full.
enum class Mode { kKernelByKernel, kStream, kGraph, kGraphWithoutPdl };

struct RunResult {
  std::vector<std::vector<float>> states;  // after each synchronised step, then after the back-to-back replays
  int64_t programmatic_edges = 0;           // in the captured graph
  int64_t programmatic_edges_off_kernels = 0;  // of those, any touching a copy or host node (must be none)
};

constexpr int kAdvancingSteps = 40;  // positions 0..39: the attention reads 1..40 cached positions
constexpr int kBackToBack = 30;     // replays at position 40 with no synchronisation between them

int64_t count_programmatic_edges(cudaGraph_t graph, int64_t* off_kernels) {
  size_t n = 0;
  CUDA_CHECK(cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &n));
  std::vector<cudaGraphNode_t> from(n), to(n);
  std::vector<cudaGraphEdgeData> data(n);
  CUDA_CHECK(cudaGraphGetEdges(graph, from.data(), to.data(), data.data(), &n));
  int64_t count = 0;
  *off_kernels = 0;
  for (size_t i = 0; i < n; ++i) {
    if (data[i].type != cudaGraphDependencyTypeProgrammatic) continue;
    ++count;
    cudaGraphNodeType a, b;
    CUDA_CHECK(cudaGraphNodeGetType(from[i], &a));
    CUDA_CHECK(cudaGraphNodeGetType(to[i], &b));
    if (a != cudaGraphNodeTypeKernel || b != cudaGraphNodeTypeKernel) ++*off_kernels;
  }
  return count;
}

RunResult run_chain(Mode mode, uint32_t seed) {
  DecodeChain chain(seed);
  std::mt19937 rng(seed + 1);
  std::uniform_int_distribution<int32_t> token(0, kVocab - 1);
  std::vector<int32_t> tokens(kAdvancingSteps + 1);
  for (int32_t& t : tokens) t = token(rng);
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  RunResult out;
  cudaGraphExec_t exec = nullptr;
  const bool graph_mode = mode == Mode::kGraph || mode == Mode::kGraphWithoutPdl;
  if (graph_mode) {
    cudaGraph_t graph;
    CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    chain.enqueue(s, [] {});
    CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    if (mode == Mode::kGraphWithoutPdl) kernel_bench::make_edges_full(graph);
    out.programmatic_edges = count_programmatic_edges(graph, &out.programmatic_edges_off_kernels);
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_CHECK(cudaGraphDestroy(graph));
  }
  auto step = [&] {
    if (graph_mode) {
      CUDA_CHECK(cudaGraphLaunch(exec, s));
    } else if (mode == Mode::kKernelByKernel) {
      chain.enqueue(s, [&] { CUDA_CHECK(cudaStreamSynchronize(s)); });
    } else {
      chain.enqueue(s, [] {});
    }
  };
  for (int t = 0; t < kAdvancingSteps; ++t) {
    chain.set_step(t, tokens[t]);
    step();
    CUDA_CHECK(cudaStreamSynchronize(s));
    out.states.push_back(chain.state());
  }
  chain.set_step(kAdvancingSteps, tokens[kAdvancingSteps]);
  for (int r = 0; r < kBackToBack; ++r) step();
  CUDA_CHECK(cudaStreamSynchronize(s));
  out.states.push_back(chain.state());
  if (exec != nullptr) CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaStreamDestroy(s));
  return out;
}

// Bitwise equality (NaN-safe), naming the first step and element that differ.
void expect_same_states(const RunResult& want, const RunResult& got, const std::string& what) {
  ASSERT_EQ(want.states.size(), got.states.size());
  for (size_t st = 0; st < want.states.size(); ++st) {
    const std::vector<float>& a = want.states[st];
    const std::vector<float>& b = got.states[st];
    ASSERT_EQ(a.size(), b.size());
    if (std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0) continue;
    size_t i = 0;
    while (std::memcmp(&a[i], &b[i], sizeof(float)) == 0) ++i;
    FAIL() << what << ": step " << st << " (of " << want.states.size() << ") differs first at element " << i
           << " (x: 0.." << kEmbd << ", logits: .." << kEmbd + kVocab << ", then the caches): " << a[i] << " vs "
           << b[i];
  }
}

bool device_has_pdl() {
  int device = 0, major = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major >= 9;
}

TEST(CudaPdlChain, GraphsAndStreamWithAndWithoutPdlEqualKernelByKernel) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  constexpr uint32_t kSeed = 20261130;
  const RunResult ref = run_chain(Mode::kKernelByKernel, kSeed);

  // The reference does something: finite, nonzero x and logits that change from step to step.
  const std::vector<float>& last = ref.states[kAdvancingSteps - 1];
  double x_abs = 0.0;
  for (int64_t i = 0; i < kEmbd + kVocab; ++i) {
    ASSERT_TRUE(std::isfinite(last[i])) << "element " << i;
    x_abs += std::fabs(last[i]);
  }
  EXPECT_GT(x_abs, 0.0);
  EXPECT_NE(std::memcmp(ref.states[0].data(), ref.states[1].data(), (kEmbd + kVocab) * sizeof(float)), 0);

  const RunResult stream_pdl = run_chain(Mode::kStream, kSeed);
  const RunResult graph_plain = run_chain(Mode::kGraphWithoutPdl, kSeed);
  const RunResult graph_pdl = run_chain(Mode::kGraph, kSeed);
  expect_same_states(ref, stream_pdl, "stream with PDL");
  expect_same_states(ref, graph_plain, "graph without PDL");
  expect_same_states(ref, graph_pdl, "graph with PDL");

  // The attribute reached the graph as kernel-to-kernel programmatic edges (and only there), and
  // the plain graph really has none.
  EXPECT_EQ(graph_plain.programmatic_edges, 0);
  if (device_has_pdl()) {
    EXPECT_GT(graph_pdl.programmatic_edges, kLayers * 8) << "the PDL graph has few programmatic edges";
  } else {
    EXPECT_EQ(graph_pdl.programmatic_edges, 0) << "PDL edges on a device below compute capability 9.0";
  }
  EXPECT_EQ(graph_pdl.programmatic_edges_off_kernels, 0);
  std::printf("programmatic edges in the captured step: %lld\n", static_cast<long long>(graph_pdl.programmatic_edges));
}

}  // namespace
}  // namespace moraine
