// `moraine-kernel-bench cuda --mixer-only`, last table: a decode layer's chain of small kernels
// (Qwen3-30B-A3B attention layer at one token: q|k|v stacked, q8_0 weights, F32 router; the MoE
// part stood in for by moe_combine, benched on its own) captured for 48 layers in one graph and
// replayed, with the fused kernels of the CUDA backend switched on one at a time:
//   norm_q    rms_norm_quantize instead of rms_norm then quantize_activations_llama (attention input)
//   attn_q    attention_decode_quantized: the merge writes the o projection's q8_0 rows (no quantize)
//   ffn_route rms_norm_router_fused instead of rms_norm, matvec_float_batched, route_softmax_top_k
//   qk_attn   attention_decode_fused_qk: the split kernel does qk_norm_rope_store's work itself
// Every layer has its own weights, router and caches at their real sizes (>1 GB in all, past the
// 60 MB L2), so weight reads come from HBM as in decode; scratch buffers are shared, as the
// backend's are. All launches with PDL (launch.h), as the backend's. Each variant's x and
// routing after one replay are compared with the unfused chain's (the fusions are bit-identical).
// The dup_* rows launch one step of the layer twice (the attention input's norm, the attention
// from q | k | v to its output, the FFN norm and routing; the second launch rewrites the same
// values): their difference to the row without is that step's cost in the chain, launch edges
// and waits included, which a kernel's own duration does not show under PDL.
// All fused: 28.45 -> 22.26 us per layer at position 0 on the H200 (the rows: docs/perf-log.md).
#include "tools/kernel_bench/mixer_bench.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
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
#include "kernels/cuda/rms_norm_quantize.h"
#include "kernels/cuda/router.h"
#include "kernels/cuda/router_fused.h"
#include "tools/kernel_bench/cuda_timing.h"
#include "tools/kernel_bench/decode_chain_buffers.h"
#include "tools/kernel_bench/decode_chain_shape.h"

namespace moraine::kernel_bench {
namespace {

using cuda::DeviceBuffer;
using cuda::uploaded;

using namespace decode_chain;  // the layer's sizes and weights (decode_chain_shape.h)

enum Fusion : unsigned {
  kNone = 0, kNormQ = 1, kAttnQ = 2, kFfnRoute = 4, kQkAttn = 8, kAll = 15,
  kDupNorm = 16, kDupAttn = 32, kDupRoute = 64   // diagnostics: the step launched twice
};

struct Layer {
  DeviceBuffer<uint8_t> qkv, o;
  DeviceBuffer<float> router, k_cache, v_cache;
};

struct Chain : DecodeChainBuffers {
  std::vector<Layer> layers;
  cuda::AttentionShape shape = attention_shape();
  std::vector<float> x_host;
  DeviceBuffer<float> norm_w, head_norm_w;
  DeviceBuffer<uint32_t> arrivals;

  // Every layer's routing is kept (chosen_rows = kLayers): the variants' routings are compared.
  explicit Chain(int32_t position) : DecodeChainBuffers(attention_shape(), kEmbd, kExperts, kTopK, kMaxCtx, kLayers) {
    std::mt19937 rng(7);
    // One layer's weights made on the host, copied to every layer's own buffers (the values do
    // not change the speed).
    const std::vector<uint8_t> qkv_host = q8_0(rng, kQkvRows, kEmbd), o_host = q8_0(rng, kEmbd, kQDim);
    const std::vector<float> router_host = normal(rng, static_cast<size_t>(kExperts * kEmbd), 0.05f);
    const std::vector<float> kv_host = normal(rng, static_cast<size_t>(kMaxCtx * kKvDim), 1.0f);
    for (int64_t il = 0; il < kLayers; ++il)
      layers.push_back({uploaded(qkv_host), uploaded(o_host), uploaded(router_host), uploaded(kv_host), uploaded(kv_host)});
    norm_w = uploaded(normal(rng, kEmbd, 1.0f));
    head_norm_w = uploaded(normal(rng, kHeadDim, 1.0f));
    x_host = normal(rng, kEmbd, 1.0f);
    x.upload(x_host.data(), x_host.size());
    const std::vector<float> slots_host = normal(rng, kTopK * kEmbd, 0.01f);
    slots.upload(slots_host.data(), slots_host.size());
    pos.upload(&position, 1);
    arrivals = DeviceBuffer<uint32_t>(1);
    arrivals.fill_bytes(0);
  }

  void enqueue(cudaStream_t s, unsigned fused) {
    for (int64_t il = 0; il < kLayers; ++il) {
      Layer& L = layers[static_cast<size_t>(il)];
      const auto norm_step = [&] {
        if (fused & kNormQ) {
          cuda::rms_norm_quantize(x.get(), norm_w.get(), h.get(), TensorType::Q8_0, act.get(), kEmbd, 1, 1e-6f, s);
        } else {
          cuda::rms_norm(x.get(), norm_w.get(), h.get(), kEmbd, 1, 1e-6f, s);
          cuda::quantize_activations_llama(TensorType::Q8_0, h.get(), act.get(), kEmbd, 1, s);
        }
      };
      norm_step();
      if (fused & kDupNorm) norm_step();
      cuda::MatvecBatch b;
      b.out_stride = kQkvRows;
      cuda::matvec_quantized_batched(TensorType::Q8_0, L.qkv.get(), kQkvRows, kEmbd, act.get(), qkv_out.get(), b, s);
      const cuda::QkNormRopeStoreArgs a =
          decode_chain::qk_args(qkv_out.get(), head_norm_w.get(), pos.get(), q.get(), L.k_cache.get(), L.v_cache.get());
      const auto attn_step = [&] {
        if (fused & kQkAttn) {
          cuda::attention_decode_fused_qk(a, shape, nullptr, 0, 0, attn.get(), (fused & kAttnQ) ? act.get() : nullptr,
                                          scratch.get(), scratch_floats, s);
          if (!(fused & kAttnQ)) cuda::quantize_activations_llama(TensorType::Q8_0, attn.get(), act.get(), kQDim, 1, s);
          return;
        }
        cuda::qk_norm_rope_store(a, s);
        if (fused & kAttnQ) {
          cuda::attention_decode_quantized(shape, q.get(), L.k_cache.get(), L.v_cache.get(), 1, pos.get(), 0, kMaxCtx,
                                           nullptr, 0, 0, attn.get(), act.get(), scratch.get(), scratch_floats, s);
        } else {
          cuda::attention_decode(shape, q.get(), L.k_cache.get(), L.v_cache.get(), 1, pos.get(), 0, kMaxCtx, nullptr,
                                 0, 0, attn.get(), scratch.get(), scratch_floats, s);
          cuda::quantize_activations_llama(TensorType::Q8_0, attn.get(), act.get(), kQDim, 1, s);
        }
      };
      attn_step();
      if (fused & kDupAttn) attn_step();
      cuda::MatvecBatch ob;
      ob.out_stride = kEmbd;
      ob.accumulate = true;
      cuda::matvec_quantized_batched(TensorType::Q8_0, L.o.get(), kEmbd, kQDim, act.get(), x.get(), ob, s);
      int32_t* ch = chosen.get() + il * kTopK;
      const auto route_step = [&] {
        if (fused & kFfnRoute) {
          cuda::rms_norm_router_fused(TensorType::F32, L.router.get(), kExperts, kEmbd, x.get(), norm_w.get(), 1e-6f, 1,
                                      h.get(), kTopK, true, logits.get(), ch, weight.get(), arrivals.get(), s);
        } else {
          cuda::rms_norm(x.get(), norm_w.get(), h.get(), kEmbd, 1, 1e-6f, s);
          cuda::MatvecBatch rb;
          rb.out_stride = kExperts;
          cuda::matvec_float_batched(TensorType::F32, L.router.get(), kExperts, kEmbd, h.get(), logits.get(), rb, s);
          cuda::route_softmax_top_k(logits.get(), 1, kExperts, kTopK, true, ch, weight.get(), s);
        }
      };
      route_step();
      if (fused & kDupRoute) route_step();
      cuda::moe_combine(x.get(), slots.get(), weight.get(), nullptr, nullptr, 1, kTopK, kEmbd, s);
    }
  }
};

struct Graph {
  cudaGraphExec_t exec = nullptr;
  Graph(Chain& chain, unsigned fused) {
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    chain.enqueue(stream, fused);
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_CHECK(cudaGraphDestroy(graph));
    CUDA_CHECK(cudaStreamDestroy(stream));
  }
  ~Graph() { cudaGraphExecDestroy(exec); }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
};

// x and the routing after one replay from the chain's starting x.
std::pair<std::vector<float>, std::vector<int32_t>> one_replay(Chain& chain, const Graph& g) {
  chain.x.upload(chain.x_host.data(), chain.x_host.size());
  CUDA_CHECK(cudaGraphLaunch(g.exec, nullptr));
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> x(static_cast<size_t>(kEmbd));
  std::vector<int32_t> c(static_cast<size_t>(kLayers * kTopK));
  chain.x.download(x.data(), x.size());
  chain.chosen.download(c.data(), c.size());
  return {x, c};
}

std::string fusion_name(unsigned f) {
  std::string s;
  if ((f & kAll) == kNone) {
    s = "unfused";
  } else if ((f & kAll) == kAll) {
    s = "all fused";
  } else {
    if (f & kNormQ) s += "+norm_q";
    if (f & kAttnQ) s += "+attn_q";
    if (f & kFfnRoute) s += "+ffn_route";
    if (f & kQkAttn) s += "+qk_attn";
  }
  if (f & kDupNorm) s += ", dup_norm";
  if (f & kDupAttn) s += ", dup_attn";
  if (f & kDupRoute) s += ", dup_route";
  return s;
}

}  // namespace

void run_mixer_chain_bench(double min_ms, nlohmann::json* json) {
  const unsigned variants[] = {kNone,           kNormQ,          kAttnQ,         kFfnRoute,
                               kQkAttn,         kAll,            kDupNorm,       kDupAttn,
                               kDupRoute,       kAll | kDupNorm, kAll | kDupAttn, kAll | kDupRoute};
  if (json == nullptr)
    std::printf("\ndecode layer chain, 48 layers in one graph, 1 token (us per layer; best of 3 replays of >= %.0f ms)\n",
                min_ms);
  for (const int32_t position : {int32_t{0}, int32_t{600}}) {
    Chain chain(position);
    std::vector<Graph*> graphs;
    for (unsigned f : variants) graphs.push_back(new Graph(chain, f));
    const auto want = one_replay(chain, *graphs[0]);
    std::vector<double> best(graphs.size(), 1e30);
    for (int rep = 0; rep < 3; ++rep) {   // interleaved, so a clock ramp does not decide
      for (size_t v = 0; v < graphs.size(); ++v) {
        const cudaGraphExec_t e = graphs[v]->exec;
        best[v] = std::min(best[v], ms_per_call([&](int) { CUDA_CHECK(cudaGraphLaunch(e, nullptr)); }, min_ms));
      }
    }
    for (size_t v = 0; v < graphs.size(); ++v) {
      const auto got = one_replay(chain, *graphs[v]);
      const bool same = std::memcmp(got.first.data(), want.first.data(), want.first.size() * 4) == 0 &&
                        got.second == want.second;
      const double us = best[v] * 1e3 / kLayers, base = best[0] * 1e3 / kLayers;
      if (json != nullptr) {
        (*json)["mixer_chain"].push_back({{"position", position},
                                          {"variant", fusion_name(variants[v])},
                                          {"us_per_layer", us},
                                          {"bits_same_as_unfused", same}});
      } else {
        std::printf("pos %4d  %-44s %8.2f us/layer  %+6.2f vs unfused  %s\n", position,
                    fusion_name(variants[v]).c_str(), us, us - base,
                    same ? "x and routing bits same" : "X OR ROUTING DIFFER");
      }
    }
    for (Graph* g : graphs) delete g;
  }
}

}  // namespace moraine::kernel_bench
