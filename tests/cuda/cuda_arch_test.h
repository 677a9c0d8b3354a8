// An architecture on the CUDA backend against the reference executor (issue 28): the checks the
// per-architecture tests (cuda_gpt_oss_test.cpp, cuda_glm4moe_test.cpp) run on their files. The
// backend is driven as the gpu_worker drives it (embed, layer_whole per layer or layer_begin /
// layer_end, advance, logits; decode from a captured graph; the in-graph hand-off).
// Bounds: the golden tests' (tests/cuda/cuda_backend_golden_test.cpp, tests/reference/
// float_order_bound.h): F32 weights 1e-4 of max |logit|; quantized weights (or an F16 cache)
// max(floor, 2 x the reference's own gap over 32 other float orders of its dots on the same rows).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/reference/executor.h"
#include "common/reference/moe_parts.h"
#include "common/sampling/sampler.h"
#include "coordinator/group_layout.h"
#include "gpu_worker/backend.h"
#include "gpu_worker/cuda_backend.h"
#include "kernels/cuda/embed_rows.h"
#include "tests/cuda/cuda_test_support.h"
#include "tests/reference/float_order_bound.h"
#include "tests/reference/tiny_arch_model.h"
#include "tests/synth/synth_run.h"

#include <unistd.h>

namespace moraine::cuda_arch_test {

inline constexpr int kMaxTokens = 112;
inline constexpr int64_t kContext = 256;

// A test's model file, made once per process in a folder of its own (`tag`): moraine-synth's
// `shape` (vocabulary 512, seed 5) with type arguments `synth_args` when shape is given, else
// tests/reference/tiny_arch_model.h's F32 file of `tiny` (an architecture[:variant], seed 7),
// quantized by moraine-quantize with `quantize` when that is given.
inline std::filesystem::path arch_file(const std::string& tag, const std::string& shape, const std::string& synth_args,
                                       const std::string& tiny, const std::string& quantize) {
  namespace fs = std::filesystem;
  static const fs::path root = fs::temp_directory_path() / ("moraine-cuda-arch-" + std::to_string(getpid()));
  const fs::path dir = root / tag;
  fs::create_directories(dir);
  const std::string stem = shape.empty() ? tiny + "|" + quantize : shape + "|" + synth_args;
  fs::path p = dir / (std::to_string(std::hash<std::string>{}(stem)) + ".gguf");
  if (fs::exists(p)) return p;
  if (!shape.empty()) {
    const test::SynthRun r = test::run_synth("--shape " + shape + " --vocab-size 512 --seed 5 " + synth_args + " -o " +
                                             p.string(), dir.string());
    if (r.status != 0) throw std::runtime_error("moraine-synth " + synth_args + " failed:\n" + r.err);
    return p;
  }
  std::vector<std::vector<float>> data;
  const fs::path f32 = quantize.empty() ? p : fs::path(p.string() + ".f32.gguf");
  test::tiny_writer(test::tiny_hparams(tiny), 7, data).write(f32.string());
  if (quantize.empty()) return p;
  const fs::path tool = fs::path(MORAINE_BUILD_DIR) / "tools" / "moraine-quantize";
  const std::string cmd = tool.string() + " " + f32.string() + " " + p.string() + " " + quantize + " > " +
                          (dir / "quantize.log").string() + " 2>&1";
  if (std::system(cmd.c_str()) != 0) throw std::runtime_error("moraine-quantize failed: " + cmd);
  return p;
}

// The slot grouping of group_layout.h's ExpertPlan: by expert in ascending id, slots ascending.
inline group::ExpertPlan plan_of(const std::vector<int32_t>& chosen, int64_t n_expert) {
  group::ExpertPlan p;
  p.start.assign(static_cast<size_t>(n_expert + 1), 0);
  for (int32_t e : chosen) ++p.start[e + 1];
  for (int64_t e = 0; e < n_expert; ++e) p.start[e + 1] += p.start[e];
  p.slot_of.assign(chosen.size(), -1);
  p.row_of.assign(chosen.size(), -1);
  std::vector<int32_t> fill(p.start.begin(), p.start.end() - 1);
  for (size_t s = 0; s < chosen.size(); ++s) {
    const int32_t r = fill[chosen[s]]++;
    p.slot_of[r] = static_cast<int32_t>(s);
    p.row_of[s] = r;
  }
  return p;
}

enum class Drive { kLayers, kGraph, kSplit };

// The experts of layer il not in `here`, by reference::routed_expert (biases, clamped SwiGLU) into
// packed rows in plan order, as the cpu workers compute them.
inline void host_experts(const model::Model& m, int64_t il, const group::ExpertPlan& plan, const float* h,
                         const std::vector<int32_t>& here, float* host_rows) {
  const int64_t d = m.hp.n_embd, k = m.hp.n_expert_used;
  reference::ExpertScratch scratch;
  scratch.reserve(plan.start.back(), m.hp.n_ff_exp);
  reference::ThreadPool pool(1);
  std::vector<float> gathered(static_cast<size_t>(plan.start.back() * d));
  for (int32_t e = 0; e < m.hp.n_expert; ++e) {
    if (plan.count(e) == 0 || std::binary_search(here.begin(), here.end(), e)) continue;
    for (int32_t j = 0; j < plan.count(e); ++j)
      std::copy_n(h + (plan.slot_of[plan.start[e] + j] / k) * d, d, gathered.data() + j * d);
    reference::routed_expert(m.layers[il].moe, e, m.layers[il].recipe.ffn.experts, gathered.data(), plan.count(e),
                             host_rows + int64_t{plan.start[e]} * d, scratch, pool);
  }
}

// One step; logits of every row when all_logits, else the last. kSplit: layer_begin / layer_end
// with the experts not in device_experts[il] computed here by reference::routed_expert (a layer
// the backend runs whole, a dense FFN layer, by layer_whole as the gpu_worker does).
inline std::vector<float> run_step(gpu_worker::Backend& b, const model::Model& m, const std::vector<int32_t>& tokens,
                                   bool all_logits, Drive drive = Drive::kLayers,
                                   const std::vector<std::vector<int32_t>>* device_experts = nullptr) {
  const model::HParams& hp = m.hp;
  const int64_t n = static_cast<int64_t>(tokens.size()), d = hp.n_embd, k = hp.n_expert_used;
  const int64_t rows = all_logits ? n : 1;
  std::vector<float> logits(rows * hp.n_vocab, NAN);
  if (drive == Drive::kGraph) {
    b.step_whole(tokens.data(), n, rows, logits.data(), nullptr, 0);
    return logits;
  }
  b.embed(tokens.data(), n);
  std::vector<float> h(n * d, NAN), weight(n * k, NAN), host_rows(n * k * d, NAN);
  std::vector<int32_t> chosen(n * k, -1);
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    if (drive == Drive::kLayers || b.layer_on_device(il)) {
      b.layer_whole(il, n, chosen.data());
      continue;
    }
    b.layer_begin(il, n, chosen.data(), weight.data(), h.data());
    const group::ExpertPlan plan = plan_of(chosen, hp.n_expert);
    host_experts(m, il, plan, h.data(), device_experts->at(il), host_rows.data());
    b.layer_end(il, n, plan, host_rows.data());
  }
  b.advance(n);
  b.logits(rows, logits.data());
  return logits;
}

inline std::unique_ptr<gpu_worker::Backend> cuda_backend(const model::Model& m, model::KvType kv,
                                                         const std::vector<std::vector<int32_t>>* device_experts = nullptr) {
  gpu_worker::BackendOptions o;
  o.max_tokens = kMaxTokens;
  o.max_context = kContext;
  o.kv_type = kv;
  if (device_experts != nullptr) {
    o.all_experts = false;
    o.device_experts = *device_experts;
  }
  return gpu_worker::make_cuda_backend(m, o);
}

inline std::vector<int32_t> prompt(const model::Model& m, int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(m.hp.n_vocab - 1));
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int32_t& t : p) t = tok(rng);
  return p;
}

// The even experts of every layer (the split tests' device half).
inline std::vector<std::vector<int32_t>> even_experts(const model::HParams& hp) {
  std::vector<std::vector<int32_t>> even(static_cast<size_t>(hp.n_layer));
  for (auto& l : even)
    for (int32_t e = 0; e < hp.n_expert; e += 2) l.push_back(e);
  return even;
}

// Host memory of a hand-off step (backend.h HandoffIo), pinned with the backend (it must outlive it).
struct HandoffBuffers {
  std::vector<int32_t> chosen;
  std::vector<float> weight, h, host_rows;
  HandoffBuffers(const model::HParams& hp, int64_t max_tokens)
      : chosen(max_tokens * hp.n_expert_used), weight(chosen.size()), h(max_tokens * hp.n_embd),
        host_rows(chosen.size() * hp.n_embd) {}
  void pin(gpu_worker::Backend& b) {
    b.pin_host_memory(chosen.data(), chosen.size() * sizeof(int32_t));
    b.pin_host_memory(weight.data(), weight.size() * sizeof(float));
    b.pin_host_memory(h.data(), h.size() * sizeof(float));
    b.pin_host_memory(host_rows.data(), host_rows.size() * sizeof(float));
  }
  gpu_worker::Backend::HandoffIo io() { return {chosen.data(), weight.data(), h.data(), host_rows.data()}; }
};

// Finite logits in every row of `got`, and its argmax the top token of `oracle` (same rows of V)
// wherever the oracle's top two are more than `margin` apart: the cuBLAS prefill (16-bit GEMM
// inputs) against the float-activation reference, which it is not bound to bit for bit.
inline void expect_clear_top_tokens(const std::vector<float>& got, const std::vector<float>& oracle, int64_t V,
                                    double margin) {
  ASSERT_EQ(got.size(), oracle.size());
  for (size_t t = 0; t * V < oracle.size(); ++t) {
    const float* r = oracle.data() + t * V;
    const float* row = got.data() + t * V;
    int64_t best = 0, second = -1;
    for (int64_t v = 1; v < V; ++v) {
      if (r[v] > r[best]) {
        second = best;
        best = v;
      } else if (second < 0 || r[v] > r[second]) {
        second = v;
      }
    }
    for (int64_t v = 0; v < V; ++v) ASSERT_TRUE(std::isfinite(row[v])) << "position " << t << " logit " << v;
    if (r[best] - r[second] > margin) {
      EXPECT_EQ(sampling::argmax(std::span<const float>(row, V)), best) << "cuBLAS prefill, position " << t;
    }
  }
}

// One file's checks: name (printed), quantized weights or not, the KV cache type.
struct ArchChecks {
  const model::Model& m;
  std::string name;
  bool quantized;
  model::KvType kv;

  reference::ExecutorOptions ref_options(reference::DotOrderSeed order = 0) const { return test_support::in_order(order, kv); }
  test_support::OrderBound bound(const std::vector<float>& want,
                                 const std::function<std::vector<float>(reference::DotOrderSeed)>& run) const {
    return test_support::bound_for(quantized, want, run, kv == model::KvType::F16);
  }
  std::vector<float> reference_prefill(const std::vector<int32_t>& tokens, reference::DotOrderSeed order = 0) const {
    return reference::ReferenceExecutor(m, ref_options(order)).forward(tokens, true);
  }

  // Logits of every position of `tokens` through the backend against the reference, within the bound.
  void expect_prefill(gpu_worker::Backend& b, const std::vector<int32_t>& tokens, const char* what) const {
    const std::vector<float> got = run_step(b, m, tokens, true);
    const std::vector<float> want = reference_prefill(tokens);
    ASSERT_EQ(got.size(), want.size());
    const test_support::LogitGap g = test_support::logit_gap(got, want);
    const test_support::OrderBound ob = bound(want, [&](reference::DotOrderSeed s) { return reference_prefill(tokens, s); });
    std::printf("[ %s ] %s, %zu tokens: max |diff| %.3g (%.3g of max) at position %zu, %s\n", name.c_str(), what,
                tokens.size(), g.max_diff, g.rel(), g.worst / m.hp.n_vocab, ob.describe().c_str());
    EXPECT_LE(g.max_diff, ob.bound * g.max_ref) << "worst at position " << g.worst / m.hp.n_vocab;
  }

  // A long prompt through the long-step kernels, as the golden test's LongPrefillMatchesTheReference:
  // the tiled attention (attention_prefill) with the per-row matmuls within the bound at every
  // position (the split-KV kernel on the same rows printed beside it); with the cuBLAS matmuls
  // (BF16 inputs: not the reference's quantized dots, their bound is gemm_prefill_test's per
  // product; the experts' GEMM path) finite logits and the top token of the reference with float
  // activations (kFloatDots: cuBLAS's arithmetic before its 16-bit rounding) wherever that
  // reference's top two are clearly apart.
  void expect_long_prefill(const std::vector<int32_t>& tokens) const {
    const int64_t V = m.hp.n_vocab;
    const std::vector<float> want = reference_prefill(tokens);
    auto with = [&](int64_t tiled_rows, int64_t gemm_rows) {
      gpu_worker::BackendOptions o;
      o.kv_type = kv;
      o.max_tokens = kMaxTokens;
      o.max_context = kContext;
      o.tiled_prefill_rows = tiled_rows;
      o.gemm_prefill_rows = gemm_rows;
      return run_step(*gpu_worker::make_cuda_backend(m, o), m, tokens, true);
    };
    const test_support::LogitGap g = test_support::logit_gap(with(64, 0), want), u = test_support::logit_gap(with(0, 0), want);
    const std::vector<float> fast = with(64, 64);
    const test_support::LogitGap f = test_support::logit_gap(fast, want);
    const test_support::OrderBound ob = bound(want, [&](reference::DotOrderSeed s) { return reference_prefill(tokens, s); });
    const std::vector<float> want_float = reference_prefill(tokens, reference::kFloatDots);
    const test_support::LogitGap ff = test_support::logit_gap(fast, want_float);
    std::printf("[ %s ] %zu-row prefill vs reference: tiled attention %.3g of max, split-KV %.3g, tiled + cuBLAS %.3g "
                "(vs the float-activation reference %.3g); %s\n",
                name.c_str(), tokens.size(), g.rel(), u.rel(), f.rel(), ff.rel(), ob.describe().c_str());
    EXPECT_LE(g.max_diff, ob.bound * g.max_ref) << "worst at position " << g.worst / V;
    EXPECT_LE(u.max_diff, ob.bound * u.max_ref) << "split-KV, worst at position " << u.worst / V;
    expect_clear_top_tokens(fast, want_float, V, std::max(0.01, ob.bound) * g.max_ref);
  }

  // Greedy tokens identical to the reference's (F32; else a parting only at a near tie within the
  // bound, as the golden test allows), then decode after prefill bit-identical to a fresh prefill.
  void expect_greedy_and_decode(gpu_worker::Backend& b, const std::vector<int32_t>& p, int steps) const {
    const int64_t V = m.hp.n_vocab;
    std::vector<int32_t> want;
    {
      reference::ReferenceExecutor ex(m, ref_options());
      std::vector<float> l = ex.forward(p, false);
      for (int i = 0; i < steps; ++i) {
        want.push_back(sampling::argmax(std::span<const float>(l.data(), V)));
        const int32_t one[1] = {want.back()};
        l = ex.forward(one, false);
      }
    }
    std::vector<float> logits = run_step(b, m, p, true);
    std::vector<float> stepwise = logits;
    std::vector<int32_t> got;
    for (size_t i = 0; i < want.size(); ++i) {
      got.push_back(sampling::argmax(std::span<const float>(logits.data() + logits.size() - V, V)));
      logits = run_step(b, m, {got.back()}, false, Drive::kGraph);
      stepwise.insert(stepwise.end(), logits.begin(), logits.end());
    }
    if (!quantized && kv == model::KvType::F32) {
      EXPECT_EQ(got, want);
    } else if (got != want) {   // a parting only at a near tie of the reference's own top two (golden test)
      size_t i = 0;
      while (got[i] == want[i]) ++i;
      const std::vector<float> rows = test_support::generation_logits(m, 0, p, want, kv);
      const test_support::OrderBound ob = bound(rows, [&](reference::DotOrderSeed s) {
        return test_support::generation_logits(m, s, p, want, kv);
      });
      double max_ref = 0;
      for (float x : rows) max_ref = std::max(max_ref, std::fabs(double(x)));
      const double margin = double(rows[i * V + want[i]]) - rows[i * V + got[i]];
      std::printf("[ %s ] greedy parts from the reference at token %zu: margin %.3g of max, %s\n", name.c_str(), i,
                  margin / max_ref, ob.describe().c_str());
      EXPECT_LE(margin, ob.bound * max_ref) << "token " << i << ": engine " << got[i] << ", reference " << want[i];
    }
    std::vector<int32_t> all = p;
    all.insert(all.end(), got.begin(), got.end());
    b.reset();
    const std::vector<float> once = run_step(b, m, all, true);
    ASSERT_EQ(once.size(), stepwise.size());
    const test_support::LogitGap g = test_support::logit_gap(stepwise, once);
    std::printf("[ %s ] greedy %zu tokens %s; decode vs fresh prefill max |diff| %.3g\n", name.c_str(), got.size(),
                got == want ? "identical" : "DIFFERENT", g.max_diff);
    EXPECT_EQ(std::memcmp(once.data(), stepwise.data(), once.size() * 4), 0)
        << "decode after prefill differs from a fresh prefill (max |diff| " << g.max_diff << ")";
  }

  // The even experts on the device, the odd ones from the host (reference::routed_expert), through
  // layer_begin / layer_end; the prompt, then six decode steps.
  void expect_split_experts(const std::vector<int32_t>& p) const {
    const int64_t V = m.hp.n_vocab;
    const std::vector<std::vector<int32_t>> even = even_experts(m.hp);
    auto split = cuda_backend(m, kv, &even);
    reference::ReferenceExecutor ex(m, ref_options());
    std::vector<float> want = ex.forward(p, true);
    std::vector<float> got = run_step(*split, m, p, true, Drive::kSplit, &even);
    std::vector<int32_t> fed;
    for (int i = 0; i < 6; ++i) {
      const int32_t next = sampling::argmax(std::span<const float>(want.data() + want.size() - V, V));
      fed.push_back(next);
      const std::vector<float> w = ex.forward(std::vector<int32_t>{next}, false);
      const std::vector<float> g = run_step(*split, m, {next}, false, Drive::kSplit, &even);
      want.insert(want.end(), w.begin(), w.end());
      got.insert(got.end(), g.begin(), g.end());
    }
    ASSERT_EQ(got.size(), want.size());
    const test_support::LogitGap g = test_support::logit_gap(got, want);
    const test_support::OrderBound ob = bound(want, [&](reference::DotOrderSeed s) {
      reference::ReferenceExecutor other(m, ref_options(s));
      std::vector<float> l = other.forward(p, true);
      for (int32_t t : fed) {
        const std::vector<float> one = other.forward(std::vector<int32_t>{t}, false);
        l.insert(l.end(), one.begin(), one.end());
      }
      return l;
    });
    std::printf("[ %s ] even experts on the device, odd on the host: max |diff| %.3g (%.3g of max), %s\n", name.c_str(),
                g.max_diff, g.rel(), ob.describe().c_str());
    EXPECT_LE(g.max_diff, ob.bound * g.max_ref);
  }

  // The group's decode step (the gpu_worker with cpu workers): one launch with in-graph hand-offs
  // (handoff_begin), the odd experts computed here at each layer the device hands over, gives the
  // layer-by-layer split's logits bit for bit (the golden test's HandoffStepEqualsLayerByLayer).
  // moe_fused (the only expert path of a hand-off step) takes quantized experts, not F32, and the
  // step embeds on the device (embed_rows.h): without both the backend must say it cannot.
  void expect_handoff_equals_layers(const std::vector<int32_t>& p) const {
    const model::HParams& hp = m.hp;
    const int64_t V = hp.n_vocab;
    const std::vector<std::vector<int32_t>> even = even_experts(hp);
    HandoffBuffers io(hp, kMaxTokens);
    auto by_layer = cuda_backend(m, kv, &even);
    auto handoff = cuda_backend(m, kv, &even);
    io.pin(*handoff);
    const bool fused = quantized && cuda::embed_rows_supported(m.tok_embd.type);
    ASSERT_EQ(handoff->handoff_supported(1), fused);
    if (!fused) return;
    std::vector<float> want = run_step(*by_layer, m, p, false, Drive::kSplit, &even);
    const std::vector<float> first = run_step(*handoff, m, p, false, Drive::kSplit, &even);
    ASSERT_EQ(0, std::memcmp(first.data(), want.data(), want.size() * sizeof(float)));
    for (int i = 0; i < 5; ++i) {
      int32_t next = sampling::argmax(std::span<const float>(want.data(), V));
      want = run_step(*by_layer, m, {next}, false, Drive::kSplit, &even);
      std::vector<float> got(V, NAN);
      ASSERT_TRUE(handoff->handoff_begin(&next, 1, 1, io.io())) << "step " << i;
      for (int64_t il = 0; il < hp.n_layer; ++il) {
        if (handoff->layer_on_device(il)) continue;
        handoff->handoff_wait_routed(il);
        const group::ExpertPlan plan =
            plan_of(std::vector<int32_t>(io.chosen.begin(), io.chosen.begin() + hp.n_expert_used), hp.n_expert);
        host_experts(m, il, plan, io.h.data(), even[il], io.host_rows.data());
        handoff->handoff_release(il, plan);
      }
      handoff->handoff_finish(got.data(), nullptr, 0);
      ASSERT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(float))) << "decode step " << i;
    }
  }
};

// The per-architecture tests' fixture over their Case (name, quantized, kv): the case's file,
// model_file(case) (found in the test's own namespace), loaded, and a backend holding every expert.
template <typename Case>
class ArchTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
    model_ = std::make_unique<model::Model>(model::Model::load(model_file(this->GetParam()).string()));
    backend_ = cuda_backend(*model_, this->GetParam().kv);
  }
  ArchChecks checks() const {
    const Case& c = this->GetParam();
    return {*model_, c.name, c.quantized, c.kv};
  }
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<gpu_worker::Backend> backend_;
};

}  // namespace moraine::cuda_arch_test
