// Fused MoE bench. Every call runs one layer's routed experts for n tokens with a fresh random
// routing (k distinct experts per token, uniform over the layer), cycling over enough layer
// copies that the weight set exceeds --set-mib, so expert rows come from HBM as in decode.
// Weights are a few quantized template rows replicated on the device (the kernel's speed does
// not depend on the values). Bytes per call count each distinct expert chosen in the step once
// (gate + up + down), which is what the kernel reads.
// Variants are timed on the same weights and routings: by default the form moe_fused picks
// (best, what the CUDA backend runs), the tiled kernels (its fallback) and the bench's warp-unit
// form (moe_fused_units.h); "sform" is the staged form wherever it fits (moe_staged.cu).
// Which variants, token counts and shape: MoeBenchSelection (moraine-kernel-bench cuda
// --moe-variants all|NAME,... --moe-tokens 1,4,8 --moe-select SHAPE,FORMAT); --moe-host-weights
// puts the experts in mapped pinned host memory (read over PCIe).
#include "tools/kernel_bench/moe_fused_bench.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "common/formats/quant.h"
#include "common/formats/quant_iq.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/moe_fused.h"
#include "tools/kernel_bench/moe_fused_units.h"
#include "tools/kernel_bench/template_rows.h"

namespace moraine::kernel_bench {
namespace {

using cuda::DeviceBuffer;

struct MoeShape {
  const char* name;
  int64_t n_embd, n_ff, n_expert;
  int k;
};

struct Variant {
  const char* name;
  cuda::MoeLayerWeights::Form form;
  bool units = false;  // the bench's warp-unit form (moe_fused_units.h) instead of moe_fused
};

using Form = cuda::MoeLayerWeights::Form;
const Variant kVariants[] = {
    {"best", Form::kBest},      // what the CUDA backend runs
    {"tiled", Form::kTiled},    // its fallback (Q8_0 experts, more than 4 tokens)
    {"sform", Form::kStaged},   // the staged form wherever it fits; rows where it falls back are marked
    {"units", Form::kTiled, true},
};

// Case-insensitive name match (formats print as q4_k, people type Q4_K).
bool same_name(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

struct MoePoint {
  std::string shape, format;
  int n_tokens;
  double us_per_layer, bytes_per_call, gbps;
  double graph_us_per_layer, graph_gbps;  // the same calls replayed from a CUDA graph
};

// One matrix of rows x cols made of quantized template rows (template_rows.h), uploaded to dst.
void upload_matrix(TensorType t, int64_t rows, int64_t cols, uint8_t* dst, std::mt19937& rng) {
  constexpr int kTemplateRows = 32;
  std::normal_distribution<float> dist(0.0f, 0.05f);
  const size_t rb = row_bytes(t, cols);
  std::vector<uint8_t> templ(rb * kTemplateRows);
  std::vector<float> f(static_cast<size_t>(cols));
  for (int r = 0; r < kTemplateRows; ++r) {
    for (float& v : f) v = dist(rng);
    template_row(t, f.data(), cols, templ.data() + static_cast<size_t>(r) * rb, rng);
  }
  std::vector<uint8_t> m(rb * static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(templ.data() + static_cast<size_t>(r % kTemplateRows) * rb, rb, m.data() + static_cast<size_t>(r) * rb);
  CUDA_CHECK(cudaMemcpy(dst, m.data(), m.size(), cudaMemcpyDefault));
}

size_t round256(size_t v) { return (v + 255) / 256 * 256; }

// emit(point) as each variant is measured (the table prints it at once: a variant that fails
// still leaves the earlier rows).
// The experts' memory: device memory, or mapped pinned host memory the device reads in place.
class WeightPool {
 public:
  WeightPool(size_t bytes, bool host) {
    if (!host) {
      device_ = DeviceBuffer<uint8_t>(bytes);
      ptr_ = device_.get();
      return;
    }
    CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_), bytes, cudaHostAllocMapped | cudaHostAllocPortable));
    CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ptr_), host_, 0));
  }
  ~WeightPool() {
    if (host_ != nullptr) cudaFreeHost(host_);
  }
  WeightPool(const WeightPool&) = delete;
  WeightPool& operator=(const WeightPool&) = delete;
  uint8_t* get() const { return ptr_; }

 private:
  DeviceBuffer<uint8_t> device_;
  uint8_t* host_ = nullptr;
  uint8_t* ptr_ = nullptr;
};

// Milliseconds per call of call(i, stream) for i = 0 .. 63 captured in one CUDA graph, replayed
// until min_ms of device time (start / stop: events to time with).
double graph_ms_per_moe_call(const std::function<void(int, cudaStream_t)>& call, double min_ms, cudaEvent_t start,
                             cudaEvent_t stop) {
  constexpr int kGraphCalls = 64;
  cudaStream_t gs = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&gs, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(gs, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kGraphCalls; ++i) call(i, gs);
  CUDA_CHECK(cudaStreamEndCapture(gs, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_CHECK(cudaGraphLaunch(exec, gs));
  CUDA_CHECK(cudaStreamSynchronize(gs));
  int reps = 4;
  double graph_ms = 0.0;
  for (;;) {
    CUDA_CHECK(cudaEventRecord(start, gs));
    for (int i = 0; i < reps; ++i) CUDA_CHECK(cudaGraphLaunch(exec, gs));
    CUDA_CHECK(cudaEventRecord(stop, gs));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float f = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&f, start, stop));
    graph_ms = f;
    if (graph_ms >= min_ms || reps >= (1 << 16)) break;
    reps = static_cast<int>(std::min<double>(1 << 16, reps * std::max(2.0, 1.2 * min_ms / std::max(graph_ms, 1e-3))));
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(gs));
  return graph_ms / (static_cast<double>(reps) * kGraphCalls);
}

void bench_moe(const MoeShape& s, TensorType t, int n, double min_ms, int set_mib, bool host_weights,
               const std::vector<const Variant*>& variants, const std::function<void(const MoePoint&)>& emit) {
  std::mt19937 rng(5);
  const size_t gate_bytes = row_bytes(t, s.n_embd) * static_cast<size_t>(s.n_ff);  // one expert
  const size_t down_bytes = row_bytes(t, s.n_ff) * static_cast<size_t>(s.n_embd);
  const size_t expert_bytes = 2 * gate_bytes + down_bytes;
  const size_t kind_bytes[3] = {round256(gate_bytes * s.n_expert), round256(gate_bytes * s.n_expert),
                                round256(down_bytes * s.n_expert)};
  const size_t layer_bytes = kind_bytes[0] + kind_bytes[1] + kind_bytes[2];
  const size_t layers = std::max<size_t>(1, ((static_cast<size_t>(set_mib) << 20) + layer_bytes - 1) / layer_bytes);
  const WeightPool pool(layer_bytes * layers, host_weights);
  // Expert 0 of layer 0 from templates, then doubling device copies fill each tensor and layer.
  for (int kind = 0; kind < 3; ++kind) {
    uint8_t* base = pool.get() + (kind == 0 ? 0 : kind == 1 ? kind_bytes[0] : kind_bytes[0] + kind_bytes[1]);
    const size_t one = kind == 2 ? down_bytes : gate_bytes;
    upload_matrix(t, kind == 2 ? s.n_embd : s.n_ff, kind == 2 ? s.n_ff : s.n_embd, base, rng);
    for (size_t have = 1; have < static_cast<size_t>(s.n_expert); have *= 2) {
      const size_t copy = std::min(have, static_cast<size_t>(s.n_expert) - have);
      CUDA_CHECK(cudaMemcpy(base + have * one, base, copy * one, cudaMemcpyDefault));
    }
  }
  for (size_t l = 1; l < layers; ++l)
    CUDA_CHECK(cudaMemcpy(pool.get() + l * layer_bytes, pool.get(), layer_bytes, cudaMemcpyDefault));

  // Routings for many calls, and the distinct experts each reads.
  constexpr int kRoutings = 512;
  const int slots = n * s.k;
  std::vector<int32_t> chosen(static_cast<size_t>(kRoutings * slots));
  std::vector<float> weight(chosen.size(), 1.0f / static_cast<float>(s.k));
  std::vector<int32_t> ids(static_cast<size_t>(s.n_expert));
  std::iota(ids.begin(), ids.end(), 0);
  double distinct_total = 0.0;
  for (int c = 0; c < kRoutings; ++c) {
    std::set<int32_t> used;
    for (int tok = 0; tok < n; ++tok) {
      std::shuffle(ids.begin(), ids.end(), rng);
      for (int j = 0; j < s.k; ++j) {
        chosen[static_cast<size_t>(c * slots + tok * s.k + j)] = ids[static_cast<size_t>(j)];
        used.insert(ids[static_cast<size_t>(j)]);
      }
    }
    distinct_total += static_cast<double>(used.size());
  }
  DeviceBuffer<int32_t> dchosen(chosen.size());
  DeviceBuffer<float> dweight(weight.size());
  dchosen.upload(chosen.data(), chosen.size());
  dweight.upload(weight.data(), weight.size());
  std::normal_distribution<float> xd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n * s.n_embd));
  for (float& v : x) v = xd(rng);
  DeviceBuffer<float> dx(x.size()), dsum(x.size());
  dx.upload(x.data(), x.size());

  cuda::MoeLayerWeights w;
  w.gate_type = w.up_type = w.down_type = t;
  w.n_embd = s.n_embd;
  w.n_ff = s.n_ff;
  w.n_expert = s.n_expert;
  w.gate = pool.get();
  w.up = pool.get() + kind_bytes[0];
  w.down = pool.get() + kind_bytes[0] + kind_bytes[1];
  const size_t ws_bytes = cuda::moe_fused_workspace_bytes(w, n, s.k);
  DeviceBuffer<uint8_t> ws(ws_bytes);
  cuda::moe_fused_workspace_init(ws.get(), ws_bytes);
  cuda::MoeOutputs out;
  out.sum = dsum.get();
  cuda::MoeRouting routing;
  routing.n_tokens = n;
  routing.k = s.k;

  bool units = false;
  MoeUnitsRan units_ran;
  auto call = [&](int i, cudaStream_t stream) {
    const uint8_t* layer = pool.get() + static_cast<size_t>(i % static_cast<int>(layers)) * layer_bytes;
    w.gate = layer;
    w.up = layer + kind_bytes[0];
    w.down = layer + kind_bytes[0] + kind_bytes[1];
    routing.chosen = dchosen.get() + static_cast<size_t>(i % kRoutings) * slots;
    routing.weight = dweight.get() + static_cast<size_t>(i % kRoutings) * slots;
    if (units) {
      units_ran = moe_fused_units(w, dx.get(), routing, out, ws.get(), ws_bytes, stream);
    } else {
      cuda::moe_fused(w, dx.get(), routing, out, ws.get(), ws_bytes, stream);
    }
  };
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  // Distinct experts per call, averaged over the routings (the timed calls cycle through them).
  const double distinct = distinct_total / kRoutings;
  const double bytes = distinct * static_cast<double>(expert_bytes);
  for (const Variant* v : variants) {
    w.form = v->form;
    units = v->units;
    for (int i = 0; i < 5; ++i) call(i, nullptr);
    int calls = 16;
    double ms = 0.0;
    for (;;) {
      CUDA_CHECK(cudaEventRecord(start));
      for (int i = 0; i < calls; ++i) call(i, nullptr);
      CUDA_CHECK(cudaEventRecord(stop));
      CUDA_CHECK(cudaEventSynchronize(stop));
      float f = 0.0f;
      CUDA_CHECK(cudaEventElapsedTime(&f, start, stop));
      ms = f;
      if (ms >= min_ms || calls >= (1 << 20)) break;
      calls = static_cast<int>(std::min<double>(1 << 20, calls * std::max(2.0, 1.2 * min_ms / std::max(ms, 1e-3))));
    }
    const double ms_per_call = ms / calls;

    // The same calls captured in a CUDA graph, as the backend runs them: no host launch cost, so
    // this is the kernels' own time per layer.
    const double graph_ms_per_call = graph_ms_per_moe_call(call, min_ms, start, stop);
    const bool falls_back = v->form != Form::kTiled && !cuda::moe_fused_staged_applies(w, n, s.k);
    const char* mark = units ? (units_ran.gate_up && units_ran.down ? ""
                                : units_ran.gate_up                  ? "(tiled down)"
                                : units_ran.down                     ? "(tiled k1)"
                                                                     : "(=tiled)")
                             : falls_back && v->form == Form::kStaged ? "(=tiled)"
                                                                      : "";
    emit({s.name + std::string(" ") + v->name + mark + (host_weights ? " host" : ""), std::string(type_name(t)), n,
          ms_per_call * 1e3, bytes,
                      bytes / ms_per_call / 1e6, graph_ms_per_call * 1e3, bytes / graph_ms_per_call / 1e6});
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

}  // namespace

void run_moe_fused_bench(double min_ms, int set_mib, double read_gbps, nlohmann::json* json,
                         const MoeBenchSelection& select) {
  const MoeShape shapes[] = {{"qwen3-30b-a3b", 2048, 768, 128, 8}, {"qwen3-next", 2048, 512, 512, 10}};
  // The IQ grid formats only where --moe-select names one (the default run stays Q4_K, Q8_0).
  const TensorType formats[] = {TensorType::Q4_K,    TensorType::Q8_0,   TensorType::IQ2_XXS, TensorType::IQ2_XS,
                                TensorType::IQ2_S,   TensorType::IQ3_XXS, TensorType::IQ3_S,  TensorType::IQ1_S,
                                TensorType::IQ1_M};
  std::vector<const Variant*> variants;
  const std::vector<std::string>& names = select.variants;
  for (const Variant& v : kVariants) {
    const bool wanted = names.empty() ? v.name == std::string("best") || v.name == std::string("tiled") ||
                                            v.name == std::string("units")
                                      : std::find(names.begin(), names.end(), "all") != names.end() ||
                                            std::find(names.begin(), names.end(), v.name) != names.end();
    if (wanted) variants.push_back(&v);
  }
  std::vector<int> tokens = select.tokens;
  if (tokens.empty()) tokens = {1, 8};
  const std::vector<std::string>& only = select.only;
  if (json == nullptr) {
    std::printf("\nfused MoE layer (moe_fused: gate+up+SwiGLU, down, weighted sum), read kernel %.0f GB/s\n", read_gbps);
    std::printf("(stream: back-to-back calls from the host; graph: the same calls replayed from a CUDA graph)\n");
    std::printf("(best: the form moe_fused picks, as the backend runs it; tiled: the tiled kernels, its fallback;\n"
                " sform: the staged form (moe_staged.cu) wherever it fits, (=tiled) where it does not;\n"
                " units: the bench's warp-unit kernels (moe_fused_units.h), (tiled k1) / (tiled down) where one\n"
                " kernel's units do not fit two CTAs per SM)\n");
    std::printf("%-28s %-6s %6s %14s %14s %12s %10s %8s\n", "shape", "format", "tokens", "stream us/layer",
                "expert B/call", "graph us/layer", "graph GB/s", "of read");
    std::fflush(stdout);
  }
  auto emit = [&](const MoePoint& p) {
    if (json != nullptr) {
      (*json)["moe_fused"].push_back({{"shape", p.shape}, {"format", p.format}, {"tokens", p.n_tokens},
                                      {"us_per_layer", p.us_per_layer}, {"expert_bytes_per_call", p.bytes_per_call},
                                      {"gbps", p.gbps}, {"share_of_read", p.gbps / read_gbps},
                                      {"graph_us_per_layer", p.graph_us_per_layer}, {"graph_gbps", p.graph_gbps},
                                      {"graph_share_of_read", p.graph_gbps / read_gbps}});
      return;
    }
    std::printf("%-28s %-6s %6d %14.2f %14.0f %14.2f %10.0f %7.0f%%\n", p.shape.c_str(), p.format.c_str(), p.n_tokens,
                p.us_per_layer, p.bytes_per_call, p.graph_us_per_layer, p.graph_gbps, 100.0 * p.graph_gbps / read_gbps);
    std::fflush(stdout);
  };
  for (const MoeShape& s : shapes)
    for (TensorType t : formats) {
      if (only.size() == 2 && (!same_name(only[0], s.name) || !same_name(only[1], type_name(t)))) continue;
      if (only.size() != 2 && formats::is_iq_grid_type(t)) continue;
      for (int n : tokens)
        if (n >= 1 && n <= cuda::kMoeMaxTokens) bench_moe(s, t, n, min_ms, set_mib, select.host_weights, variants, emit);
    }
}

}  // namespace moraine::kernel_bench
