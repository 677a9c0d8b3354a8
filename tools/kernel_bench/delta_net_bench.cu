// Gated DeltaNet bench at Qwen3-Next-80B's linear-attention layer shape (16 key heads, 32 value
// heads, head dims 128, conv kernel 4). Decode cycles through kLayers separate layer states
// (about 2 MB of recurrent state each, 96 MB in all: twice the H200's L2), so every call reads
// and writes its state in HBM as a real decode does; the number is per layer and token.
// Prefill reports tokens/s of one layer for a whole prompt in one call, with the recurrence's
// token loop and chunked form side by side (delta_net_mix takes the chunked one from 64 tokens).
#include "tools/kernel_bench/delta_net_bench.h"
#include "tools/kernel_bench/cuda_timing.h"

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/delta_net.h"
#include "kernels/cuda/device_buffer.h"

namespace moraine::kernel_bench {
namespace {

using cuda::DeviceBuffer;

constexpr int kLayers = 48;

cuda::DeltaNetShape qwen3_next_shape() {
  cuda::DeltaNetShape s;
  s.n_k_heads = 16;
  s.n_v_heads = 32;
  s.head_k_dim = 128;
  s.head_v_dim = 128;
  s.conv_kernel = 4;
  return s;
}

DeviceBuffer<float> random_device(size_t n, float mean, float sd, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(mean, sd);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  DeviceBuffer<float> b(n);
  b.upload(v.data(), n);
  return b;
}

struct Layer {
  DeviceBuffer<float> conv_w, a, dt_bias, norm_w, conv_state, ssm_state;
};

Layer make_layer(const cuda::DeltaNetShape& s, uint32_t seed) {
  Layer l;
  l.conv_w = random_device(static_cast<size_t>(s.conv_dim() * s.conv_kernel), 0.0f, 0.5f, seed);
  l.a = random_device(static_cast<size_t>(s.n_v_heads), -1.0f, 0.1f, seed + 1);
  l.dt_bias = random_device(static_cast<size_t>(s.n_v_heads), 0.0f, 1.0f, seed + 2);
  l.norm_w = random_device(static_cast<size_t>(s.head_v_dim), 1.0f, 0.1f, seed + 3);
  l.conv_state = DeviceBuffer<float>(static_cast<size_t>(s.conv_state_floats()));
  l.ssm_state = DeviceBuffer<float>(static_cast<size_t>(s.ssm_state_floats()));
  l.conv_state.fill_bytes(0);
  l.ssm_state.fill_bytes(0);
  return l;
}

struct Row {
  std::string what;
  int64_t tokens;
  double us_per_call;
};

}  // namespace

void run_delta_net_bench(double min_ms, nlohmann::json* json) {
  const cuda::DeltaNetShape s = qwen3_next_shape();
  const float eps = 1e-6f;
  std::vector<Row> rows;

  // Decode: one token per call, a different layer's state each call.
  {
    std::vector<Layer> layers;
    for (int l = 0; l < kLayers; ++l) layers.push_back(make_layer(s, 100 + static_cast<uint32_t>(l)));
    DeviceBuffer<float> mixed = random_device(static_cast<size_t>(s.conv_dim()), 0.0f, 1.0f, 1);
    DeviceBuffer<float> z = random_device(static_cast<size_t>(s.value_dim()), 0.0f, 1.0f, 2);
    DeviceBuffer<float> ba = random_device(static_cast<size_t>(2 * s.n_v_heads), 0.0f, 1.0f, 3);
    DeviceBuffer<float> ws(static_cast<size_t>(cuda::delta_net_workspace_floats(s, 1)));
    DeviceBuffer<float> out(static_cast<size_t>(s.value_dim()));
    float* conv_out = ws.get();
    float* beta = conv_out + s.conv_dim();
    float* gate = beta + s.n_v_heads;
    auto layer = [&](int i) -> Layer& { return layers[static_cast<size_t>(i % kLayers)]; };
    rows.push_back({"decode: delta_net_mix (all stages)", 1, 1e3 * ms_per_call([&](int i) {
                      Layer& L = layer(i);
                      cuda::delta_net_mix(s, {L.conv_w.get(), L.a.get(), L.dt_bias.get(), L.norm_w.get()},
                                          {L.conv_state.get(), L.ssm_state.get()}, mixed.get(), z.get(), ba.get(), 1,
                                          eps, ws.get(), out.get());
                    }, min_ms)});
    rows.push_back({"decode: conv + SiLU", 1, 1e3 * ms_per_call([&](int i) {
                      Layer& L = layer(i);
                      cuda::delta_net_conv_silu(s, L.conv_w.get(), L.conv_state.get(), mixed.get(), conv_out, 1);
                    }, min_ms)});
    rows.push_back({"decode: L2 norm q, k", 1,
                    1e3 * ms_per_call([&](int) { cuda::delta_net_l2_norm_qk(s, conv_out, 1, eps); }, min_ms)});
    rows.push_back({"decode: gates", 1, 1e3 * ms_per_call([&](int i) {
                      Layer& L = layer(i);
                      cuda::delta_net_gates(s, ba.get(), L.a.get(), L.dt_bias.get(), beta, gate, 1);
                    }, min_ms)});
    rows.push_back({"decode: recurrence (32 columns per CTA)", 1, 1e3 * ms_per_call([&](int i) {
                      cuda::delta_net_recurrence(s, layer(i).ssm_state.get(), conv_out, gate, beta, out.get(), 1);
                    }, min_ms)});
    rows.push_back({"decode: gated RMSNorm", 1, 1e3 * ms_per_call([&](int i) {
                      cuda::delta_net_gated_rms_norm(s, out.get(), z.get(), layer(i).norm_w.get(), 1, eps);
                    }, min_ms)});
  }

  // Prefill: a whole prompt per call (the state keeps evolving across calls; speed does not
  // depend on it).
  for (int64_t n : {int64_t{64}, int64_t{512}, int64_t{8192}}) {
    Layer L = make_layer(s, 7);
    DeviceBuffer<float> mixed = random_device(static_cast<size_t>(n * s.conv_dim()), 0.0f, 1.0f, 4);
    DeviceBuffer<float> z = random_device(static_cast<size_t>(n * s.value_dim()), 0.0f, 1.0f, 5);
    DeviceBuffer<float> ba = random_device(static_cast<size_t>(n * 2 * s.n_v_heads), 0.0f, 1.0f, 6);
    DeviceBuffer<float> ws(static_cast<size_t>(cuda::delta_net_workspace_floats(s, n)));
    DeviceBuffer<float> out(static_cast<size_t>(n * s.value_dim()));
    float* conv_out = ws.get();
    float* beta = conv_out + n * s.conv_dim();
    float* gate = beta + n * s.n_v_heads;
    rows.push_back({"prefill: delta_net_mix (all stages)", n, 1e3 * ms_per_call([&](int) {
                      cuda::delta_net_mix(s, {L.conv_w.get(), L.a.get(), L.dt_bias.get(), L.norm_w.get()},
                                          {L.conv_state.get(), L.ssm_state.get()}, mixed.get(), z.get(), ba.get(), n,
                                          eps, ws.get(), out.get());
                    }, min_ms)});
    rows.push_back({"prefill: conv + SiLU", n, 1e3 * ms_per_call([&](int) {
                      cuda::delta_net_conv_silu(s, L.conv_w.get(), L.conv_state.get(), mixed.get(), conv_out, n);
                    }, min_ms)});
    rows.push_back({"prefill: recurrence, token loop", n, 1e3 * ms_per_call([&](int) {
                      cuda::delta_net_recurrence(s, L.ssm_state.get(), conv_out, gate, beta, out.get(), n);
                    }, min_ms)});
    DeviceBuffer<float> chunk_ws(static_cast<size_t>(cuda::delta_net_chunked_workspace_floats(s, n)));
    rows.push_back({"prefill: recurrence, chunked", n, 1e3 * ms_per_call([&](int) {
                      cuda::delta_net_recurrence_chunked(s, L.ssm_state.get(), conv_out, gate, beta, out.get(), n,
                                                         chunk_ws.get());
                    }, min_ms)});
  }

  if (json != nullptr) {
    nlohmann::json& j = (*json)["delta_net"];
    j["shape"] = {{"n_k_heads", s.n_k_heads}, {"n_v_heads", s.n_v_heads}, {"head_k_dim", s.head_k_dim},
                  {"head_v_dim", s.head_v_dim}, {"conv_kernel", s.conv_kernel}};
    for (const Row& r : rows)
      j["results"].push_back({{"what", r.what}, {"tokens", r.tokens}, {"us_per_call", r.us_per_call},
                              {"tokens_per_s", 1e6 * static_cast<double>(r.tokens) / r.us_per_call}});
    return;
  }
  std::printf("\nGated DeltaNet, Qwen3-Next-80B layer (16 k heads, 32 v heads, dims 128, conv 4); decode cycles %d layer states\n",
              kLayers);
  std::printf("%-44s %7s %12s %14s\n", "stage", "tokens", "us/call", "tokens/s");
  for (const Row& r : rows)
    std::printf("%-44s %7lld %12.2f %14.0f\n", r.what.c_str(), static_cast<long long>(r.tokens), r.us_per_call,
                1e6 * static_cast<double>(r.tokens) / r.us_per_call);
}

}  // namespace moraine::kernel_bench
