// PDL bench: one decode step's chain of small kernels per layer, as gpu_worker/cuda_backend.cu
// enqueues it for a Qwen3-30B-A3B attention layer at one token (q|k|v stacked, q8_0 weights,
// F32 router), with moe_combine standing in for the MoE part (moe_fused, benched on its own).
// 11 launches per layer, 10 of them right behind another kernel, plus the edge into the next
// layer. Every layer has its own weights and caches at their real sizes (>1 GB in all, far past
// the L2), so the weight reads come from HBM as in decode; the scratch buffers are shared, as the
// backend's are.
//
// Expected gain, stated before measuring: a dependent launch in a graph costs ~1 us of drain and
// launch between two kernels; PDL overlaps the launch with the running kernel's tail, so up to
// ~1 us per edge, ~9-11 us of the layer's time. A third variant lets the two matvecs start their
// weight loads before the wait (MatvecBatch::weights_from_previous_kernel false), which can hide
// their HBM latency behind the quantize kernel before them as well.
// Measured: 33.82 -> 31.81 us per layer at position 0 (31.55 with the weights early), about 0.2 us
// per launch, a fifth of the expectation (H200; why, and position 511: docs/perf-log.md).
#include "tools/kernel_bench/pdl_chain_bench.h"
#include "tools/kernel_bench/cuda_timing.h"
#include "tools/kernel_bench/decode_chain_buffers.h"
#include "tools/kernel_bench/decode_chain_shape.h"
#include "tools/kernel_bench/plain_graph.h"

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cuda/attention_decode.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/matvec_float.h"
#include "kernels/cuda/moe_combine.h"
#include "kernels/cuda/qk_norm_rope_store.h"
#include "kernels/cuda/quantize_activations_llama.h"
#include "kernels/cuda/rms_norm.h"
#include "kernels/cuda/router.h"

namespace moraine::kernel_bench {
namespace {

using cuda::DeviceBuffer;
using cuda::uploaded;

using namespace decode_chain;  // the layer's sizes and weights (decode_chain_shape.h)
constexpr int kLaunchesPerLayer = 11;

struct Layer {
  DeviceBuffer<uint8_t> qkv, o;
  DeviceBuffer<float> k_cache, v_cache;
};

struct Chain : DecodeChainBuffers {
  std::vector<Layer> layers;
  cuda::AttentionShape shape = attention_shape();
  DeviceBuffer<float> norm_w, head_norm_w, router;

  explicit Chain(int32_t position) : DecodeChainBuffers(attention_shape(), kEmbd, kExperts, kTopK, kMaxCtx) {
    std::mt19937 rng(7);
    // One layer's weights quantized on the host, copied to every layer's own buffers (quantizing
    // 48 layers would take the bench's whole time; the bytes' values do not change the speed).
    const std::vector<uint8_t> qkv_host = q8_0(rng, kQkvRows, kEmbd), o_host = q8_0(rng, kEmbd, kQDim);
    const std::vector<float> kv_host = normal(rng, static_cast<size_t>(kMaxCtx * kKvDim), 1.0f);
    for (int64_t il = 0; il < kLayers; ++il) {
      layers.push_back({uploaded(qkv_host), uploaded(o_host), uploaded(kv_host), uploaded(kv_host)});
    }
    norm_w = uploaded(normal(rng, kEmbd, 1.0f));
    head_norm_w = uploaded(normal(rng, kHeadDim, 1.0f));
    router = uploaded(normal(rng, kExperts * kEmbd, 0.05f));
    const std::vector<float> x_host = normal(rng, kEmbd, 1.0f);
    x.upload(x_host.data(), x_host.size());
    const std::vector<float> slots_host = normal(rng, kTopK * kEmbd, 0.01f);
    slots.upload(slots_host.data(), slots_host.size());
    pos.upload(&position, 1);
  }

  // weights_first: the matvecs start their weight loads before waiting on the previous kernel
  // (MatvecBatch::weights_from_previous_kernel false, the default); else they wait first.
  void enqueue(cudaStream_t s, bool weights_first) {
    for (Layer& L : layers) {
      cuda::rms_norm(x.get(), norm_w.get(), h.get(), kEmbd, 1, 1e-6f, s);
      cuda::quantize_activations_llama(TensorType::Q8_0, h.get(), act.get(), kEmbd, 1, s);
      cuda::MatvecBatch b;
      b.out_stride = kQkvRows;
      b.weights_from_previous_kernel = !weights_first;
      cuda::matvec_quantized_batched(TensorType::Q8_0, L.qkv.get(), kQkvRows, kEmbd, act.get(), qkv_out.get(), b, s);
      const cuda::QkNormRopeStoreArgs a =
          decode_chain::qk_args(qkv_out.get(), head_norm_w.get(), pos.get(), q.get(), L.k_cache.get(), L.v_cache.get());
      cuda::qk_norm_rope_store(a, s);
      cuda::attention_decode(shape, q.get(), L.k_cache.get(), L.v_cache.get(), 1, pos.get(), 0, kMaxCtx, nullptr, 0, 0,
                             attn.get(), scratch.get(), scratch_floats, s);
      cuda::quantize_activations_llama(TensorType::Q8_0, attn.get(), act.get(), kQDim, 1, s);
      cuda::MatvecBatch ob;
      ob.out_stride = kEmbd;
      ob.accumulate = true;
      ob.weights_from_previous_kernel = !weights_first;
      cuda::matvec_quantized_batched(TensorType::Q8_0, L.o.get(), kEmbd, kQDim, act.get(), x.get(), ob, s);
      cuda::rms_norm(x.get(), norm_w.get(), h.get(), kEmbd, 1, 1e-6f, s);
      cuda::MatvecBatch rb;
      rb.out_stride = kExperts;
      cuda::matvec_float_batched(TensorType::F32, router.get(), kExperts, kEmbd, h.get(), logits.get(), rb, s);
      cuda::route_softmax_top_k(logits.get(), 1, kExperts, kTopK, true, chosen.get(), weight.get(), s);
      cuda::moe_combine(x.get(), slots.get(), weight.get(), nullptr, nullptr, 1, kTopK, kEmbd, s);
    }
  }
};

// Milliseconds per replay of the whole chain captured as production launches it (pdl) or with
// its programmatic edges made full (plain_graph.h: the graph without PDL).
double graph_ms(Chain& chain, bool pdl, bool weights_first, double min_ms) {
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  chain.enqueue(stream, weights_first);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  if (!pdl) make_edges_full(graph);
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double ms = ms_per_call([&](int) { CUDA_CHECK(cudaGraphLaunch(exec, nullptr)); }, min_ms);
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
  return ms;
}

}  // namespace

void run_pdl_chain_bench(double min_ms, nlohmann::json* json) {
  struct Row {
    int32_t position;
    double off_us, on_us, on_early_us;  // on: every kernel waits first; on_early: matvec weights before the wait
  };
  std::vector<Row> rows;
  for (const int32_t position : {int32_t{0}, int32_t{511}}) {
    Chain chain(position);
    // Off, on, off, on: the better of two each, so a clock ramp or a neighbour does not decide.
    double off = 1e30, on = 1e30, early = 1e30;
    for (int rep = 0; rep < 2; ++rep) {
      off = std::min(off, graph_ms(chain, false, true, min_ms));
      on = std::min(on, graph_ms(chain, true, false, min_ms));
      early = std::min(early, graph_ms(chain, true, true, min_ms));
    }
    rows.push_back({position, off * 1e3 / kLayers, on * 1e3 / kLayers, early * 1e3 / kLayers});
  }
  if (json != nullptr) {
    for (const Row& r : rows)
      (*json)["pdl_chain"].push_back({{"layers", kLayers},
                                      {"launches_per_layer", kLaunchesPerLayer},
                                      {"position", r.position},
                                      {"us_per_layer_pdl_off", r.off_us},
                                      {"us_per_layer_pdl_on_wait_first", r.on_us},
                                      {"us_per_layer_pdl_on_weights_before_wait", r.on_early_us}});
    return;
  }
  std::printf("\ndecode layer chain in one graph (30B-A3B attention layer + router + combine, 1 token, %lld layers, "
              "%d launches per layer; PDL: launch.h)\n",
              static_cast<long long>(kLayers), kLaunchesPerLayer);
  std::printf("%-9s %13s %13s %13s %16s\n", "position", "PDL off us/L", "on, wait 1st", "on, W early",
              "saved/launch us");
  for (const Row& r : rows)
    std::printf("%-9d %13.2f %13.2f %13.2f %16.2f\n", r.position, r.off_us, r.on_us, r.on_early_us,
                (r.off_us - std::min(r.on_us, r.on_early_us)) / kLaunchesPerLayer);
}

}  // namespace moraine::kernel_bench
