// gpt-oss on the CUDA backend (issue 28): the backend driven as the gpu_worker drives it (embed,
// layer_whole per layer or layer_begin / layer_end, advance, logits; decode from a captured graph)
// against the reference executor (common/reference, which matches llama.cpp on gpt-oss to 6.6e-7:
// tests/reference/arch_llama_test.cpp), on
//  - moraine-synth's gpt-oss-tiny (n_embd 256, 8 heads of 32 over 2 kv heads, window 8 on even
//    layers, YaRN factor 32, 8 experts top-2 of width 256): Q4_K experts with Q8_0 elsewhere (the
//    fused MoE kernel's gpt-oss build serves the experts), MXFP4 experts (as the released files),
//    the Q4_K file with an F16 KV cache, and all F32;
//  - tests/reference/tiny_arch_model.h's F32 gpt-oss (heads of 16, window 4, F32 experts: the
//    per-expert matvec path with swiglu_experts), with YaRN's correction dims rounded (llama.cpp)
//    and fractional (rope.scaling.yarn_truncate false: gpt-oss's own config).
// Bounds: the golden tests' (tests/cuda/cuda_backend_golden_test.cpp, tests/reference/
// float_order_bound.h): F32 weights 1e-4 of max |logit|; quantized weights (or an F16 cache)
// max(floor, 2 x the reference's own gap over 32 other float orders of its dots on the same rows).
// Checked: logits at every position of a 40-token prompt (5x the synth window: sliding layers
// slide), of a 100-token prompt through the tiled attention_prefill (and, as the golden test's long
// prefill, through cuBLAS / the expert GEMMs: finite, the reference's top token at clear margins),
// greedy tokens identical to the reference's (a parting only at a
// near tie within the bound, as the golden test allows), decode after prefill bit-identical to a
// fresh prefill, and the even experts on the device with the odd ones from the host
// (reference::routed_expert, as the cpu workers run them).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
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

namespace moraine {
namespace {

namespace fs = std::filesystem;
constexpr int kMaxTokens = 112;
constexpr int64_t kContext = 256;

struct Case {
  std::string name;     // also the file's
  std::string synth;    // moraine-synth's type arguments; empty: tiny_arch_model's F32 file
  bool quantized;
  model::KvType kv = model::KvType::F32;
  bool yarn_truncate = true;   // the tiny file's rope.scaling.yarn_truncate (false: HF's fractional dims)
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

fs::path model_file(const Case& c) {
  static const fs::path dir = fs::temp_directory_path() / ("moraine-cuda-gpt-oss-" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string stem = c.synth.empty() ? (c.yarn_truncate ? "tiny_f32" : "tiny_f32_fractional") : c.synth;
  fs::path p = dir / (std::to_string(std::hash<std::string>{}(stem)) + ".gguf");
  if (fs::exists(p)) return p;
  if (c.synth.empty()) {
    std::vector<std::vector<float>> data;
    model::HParams hp = test::tiny_hparams("gpt-oss");
    hp.rope_yarn_truncate = c.yarn_truncate;
    for (int64_t il = 0; il < hp.n_layer; ++il) hp.recipes[il] = hp.desc->layer_recipe(hp, il);
    test::tiny_writer(hp, 7, data).write(p.string());
    return p;
  }
  const test::SynthRun r = test::run_synth("--shape gpt-oss-tiny --vocab-size 512 --seed 5 " + c.synth + " -o " + p.string(),
                                           dir.string());
  if (r.status != 0) throw std::runtime_error("moraine-synth " + c.synth + " failed:\n" + r.err);
  return p;
}

reference::ExecutorOptions ref_options(const Case& c, reference::DotOrderSeed order = 0) {
  return test_support::in_order(order, c.kv);
}

// The slot grouping of group_layout.h's ExpertPlan: by expert in ascending id, slots ascending.
group::ExpertPlan plan_of(const std::vector<int32_t>& chosen, int64_t n_expert) {
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
void host_experts(const model::Model& m, int64_t il, const group::ExpertPlan& plan, const float* h,
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
// with the experts not in device_experts[il] computed here by reference::routed_expert.
std::vector<float> run_step(gpu_worker::Backend& b, const model::Model& m, const std::vector<int32_t>& tokens,
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
    if (drive == Drive::kLayers) {
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

std::unique_ptr<gpu_worker::Backend> cuda_backend(const model::Model& m, const Case& c,
                                                  const std::vector<std::vector<int32_t>>* device_experts = nullptr) {
  gpu_worker::BackendOptions o;
  o.max_tokens = kMaxTokens;
  o.max_context = kContext;
  o.kv_type = c.kv;
  if (device_experts != nullptr) {
    o.all_experts = false;
    o.device_experts = *device_experts;
  }
  return gpu_worker::make_cuda_backend(m, o);
}

std::vector<int32_t> prompt(const model::Model& m, int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(m.hp.n_vocab - 1));
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int32_t& t : p) t = tok(rng);
  return p;
}

class CudaGptOss : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
    model_ = std::make_unique<model::Model>(model::Model::load(model_file(GetParam()).string()));
    backend_ = cuda_backend(*model_, GetParam());
  }
  test_support::OrderBound bound(const std::vector<float>& want,
                                 const std::function<std::vector<float>(reference::DotOrderSeed)>& run) const {
    const Case& c = GetParam();
    return test_support::bound_for(c.quantized, want, run, c.kv == model::KvType::F16);
  }
  // Logits of every position of `tokens` through the backend against the reference, within the bound.
  void expect_prefill(const std::vector<int32_t>& tokens, const char* what) {
    const Case& c = GetParam();
    const std::vector<float> got = run_step(*backend_, *model_, tokens, true);
    const std::vector<float> want = reference::ReferenceExecutor(*model_, ref_options(c)).forward(tokens, true);
    ASSERT_EQ(got.size(), want.size());
    const test_support::LogitGap g = test_support::logit_gap(got, want);
    const test_support::OrderBound b = bound(want, [&](reference::DotOrderSeed s) {
      return reference::ReferenceExecutor(*model_, ref_options(c, s)).forward(tokens, true);
    });
    std::printf("[ %s ] %s, %zu tokens: max |diff| %.3g (%.3g of max) at position %zu, %s\n", c.name.c_str(), what,
                tokens.size(), g.max_diff, g.rel(), g.worst / model_->hp.n_vocab, b.describe().c_str());
    EXPECT_LE(g.max_diff, b.bound * g.max_ref) << "worst at position " << g.worst / model_->hp.n_vocab;
  }
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<gpu_worker::Backend> backend_;
};

TEST_P(CudaGptOss, LoadsWithEveryPart) {
  const model::LayerRecipe& r0 = model_->layers[0].recipe;
  EXPECT_GT(r0.mixer.attn.sliding_window, 0);
  EXPECT_EQ(model_->layers[1].recipe.mixer.attn.sliding_window, 0);
  EXPECT_TRUE(r0.mixer.attn.sinks && r0.mixer.attn.qkv_bias && r0.mixer.attn.o_bias);
  EXPECT_EQ(r0.mixer.attn.rope.scaling, model::RopeScaling::Yarn);
  EXPECT_EQ(r0.mixer.attn.rope.yarn_truncate, GetParam().yarn_truncate);
  EXPECT_EQ(r0.ffn.router.kind, model::RouterKind::TopKSoftmax);
  EXPECT_EQ(r0.ffn.experts.act, model::Activation::SwiGluClamped);
  EXPECT_TRUE(r0.ffn.experts.biases);
}

// 40 tokens: at least 5 windows, in one step below the tiled threshold (split-KV or flash-decoding
// attention, the matvecs, moe_fused in 16-token groups).
TEST_P(CudaGptOss, PrefillLogitsMatchAtEveryPosition) {
  expect_prefill(prompt(*model_, 40, 1), "prefill");
}

// 100 tokens through the long-step kernels, as the golden test's LongPrefillMatchesTheReference:
// the tiled attention (attention_prefill with the window and sinks; over the F16 cache too) with the
// per-row matmuls within the bound at every position (the split-KV kernel on the same rows printed
// beside it); with the cuBLAS matmuls (BF16 inputs: not the reference's quantized dots, their bound
// is gemm_prefill_test's per product; the experts' GEMM path with swiglu_experts and the down bias)
// finite logits and the top token of the reference with float activations (kFloatDots: cuBLAS's
// arithmetic before its 16-bit rounding) wherever that reference's top two are clearly apart.
TEST_P(CudaGptOss, LongPromptThroughTiledPrefill) {
  const Case& c = GetParam();
  const int64_t V = model_->hp.n_vocab;
  const std::vector<int32_t> tokens = prompt(*model_, 100, 2);
  const std::vector<float> want = reference::ReferenceExecutor(*model_, ref_options(c)).forward(tokens, true);
  auto with = [&](int64_t tiled_rows, int64_t gemm_rows) {
    gpu_worker::BackendOptions o;
    o.kv_type = c.kv;
    o.max_tokens = kMaxTokens;
    o.max_context = kContext;
    o.tiled_prefill_rows = tiled_rows;
    o.gemm_prefill_rows = gemm_rows;
    return run_step(*gpu_worker::make_cuda_backend(*model_, o), *model_, tokens, true);
  };
  const test_support::LogitGap g = test_support::logit_gap(with(64, 0), want), u = test_support::logit_gap(with(0, 0), want);
  const std::vector<float> fast = with(64, 64);
  const test_support::LogitGap f = test_support::logit_gap(fast, want);
  const test_support::OrderBound b = bound(want, [&](reference::DotOrderSeed s) {
    return reference::ReferenceExecutor(*model_, ref_options(c, s)).forward(tokens, true);
  });
  // The cuBLAS path's oracle: the reference with float activations (kFloatDots), as the golden test.
  const std::vector<float> want_float =
      reference::ReferenceExecutor(*model_, ref_options(c, reference::kFloatDots)).forward(tokens, true);
  const test_support::LogitGap ff = test_support::logit_gap(fast, want_float);
  std::printf("[ %s ] 100-row prefill vs reference: tiled attention %.3g of max, split-KV %.3g, tiled + cuBLAS %.3g "
              "(vs the float-activation reference %.3g); %s\n",
              c.name.c_str(), g.rel(), u.rel(), f.rel(), ff.rel(), b.describe().c_str());
  EXPECT_LE(g.max_diff, b.bound * g.max_ref) << "worst at position " << g.worst / V;
  EXPECT_LE(u.max_diff, b.bound * u.max_ref) << "split-KV, worst at position " << u.worst / V;
  for (size_t t = 0; t < tokens.size(); ++t) {
    const float* r = want_float.data() + t * V;
    const float* got = fast.data() + t * V;
    int64_t best = 0, second = -1;
    for (int64_t v = 1; v < V; ++v) {
      if (r[v] > r[best]) {
        second = best;
        best = v;
      } else if (second < 0 || r[v] > r[second]) {
        second = v;
      }
    }
    for (int64_t v = 0; v < V; ++v) ASSERT_TRUE(std::isfinite(got[v])) << "position " << t << " logit " << v;
    if (r[best] - r[second] > std::max(0.01, b.bound) * g.max_ref) {
      EXPECT_EQ(sampling::argmax(std::span<const float>(got, V)), best) << "cuBLAS prefill, position " << t;
    }
  }
}

TEST_P(CudaGptOss, GreedyTokensAndDecodeEqualsPrefill) {
  const Case& c = GetParam();
  const int64_t V = model_->hp.n_vocab;
  const std::vector<int32_t> p = prompt(*model_, 30, 3);
  std::vector<int32_t> want;
  {
    reference::ReferenceExecutor ex(*model_, ref_options(c));
    std::vector<float> l = ex.forward(p, false);
    for (int i = 0; i < 24; ++i) {
      want.push_back(sampling::argmax(std::span<const float>(l.data(), V)));
      const int32_t one[1] = {want.back()};
      l = ex.forward(one, false);
    }
  }
  std::vector<float> logits = run_step(*backend_, *model_, p, true);
  std::vector<float> stepwise = logits;
  std::vector<int32_t> got;
  for (size_t i = 0; i < want.size(); ++i) {
    got.push_back(sampling::argmax(std::span<const float>(logits.data() + logits.size() - V, V)));
    logits = run_step(*backend_, *model_, {got.back()}, false, Drive::kGraph);
    stepwise.insert(stepwise.end(), logits.begin(), logits.end());
  }
  if (!c.quantized && c.kv == model::KvType::F32) {
    EXPECT_EQ(got, want);
  } else if (got != want) {   // a parting only at a near tie of the reference's own top two (golden test)
    size_t i = 0;
    while (got[i] == want[i]) ++i;
    const std::vector<float> rows = test_support::generation_logits(*model_, 0, p, want, c.kv);
    const test_support::OrderBound b = bound(rows, [&](reference::DotOrderSeed s) {
      return test_support::generation_logits(*model_, s, p, want, c.kv);
    });
    double max_ref = 0;
    for (float x : rows) max_ref = std::max(max_ref, std::fabs(double(x)));
    const double margin = double(rows[i * V + want[i]]) - rows[i * V + got[i]];
    std::printf("[ %s ] greedy parts from the reference at token %zu: margin %.3g of max, %s\n", c.name.c_str(), i,
                margin / max_ref, b.describe().c_str());
    EXPECT_LE(margin, b.bound * max_ref) << "token " << i << ": engine " << got[i] << ", reference " << want[i];
  }
  std::vector<int32_t> all = p;
  all.insert(all.end(), got.begin(), got.end());
  backend_->reset();
  const std::vector<float> once = run_step(*backend_, *model_, all, true);
  ASSERT_EQ(once.size(), stepwise.size());
  const test_support::LogitGap g = test_support::logit_gap(stepwise, once);
  std::printf("[ %s ] greedy %zu tokens %s; decode vs fresh prefill max |diff| %.3g\n", c.name.c_str(), got.size(),
              got == want ? "identical" : "DIFFERENT", g.max_diff);
  EXPECT_EQ(std::memcmp(once.data(), stepwise.data(), once.size() * 4), 0)
      << "decode after prefill differs from a fresh prefill (max |diff| " << g.max_diff << ")";
}

// The even experts on the device, the odd ones from the host (reference::routed_expert: biases
// and clamped SwiGLU there too), through layer_begin / layer_end; prefill then six decode steps.
TEST_P(CudaGptOss, SplitExpertsMatchTheReference) {
  const Case& c = GetParam();
  const model::HParams& hp = model_->hp;
  const int64_t V = hp.n_vocab;
  std::vector<std::vector<int32_t>> even(static_cast<size_t>(hp.n_layer));
  for (auto& l : even)
    for (int32_t e = 0; e < hp.n_expert; e += 2) l.push_back(e);
  auto split = cuda_backend(*model_, c, &even);
  const std::vector<int32_t> p = prompt(*model_, 24, 4);
  reference::ReferenceExecutor ex(*model_, ref_options(c));
  std::vector<float> want = ex.forward(p, true);
  std::vector<float> got = run_step(*split, *model_, p, true, Drive::kSplit, &even);
  std::vector<int32_t> fed;
  for (int i = 0; i < 6; ++i) {
    const int32_t next = sampling::argmax(std::span<const float>(want.data() + want.size() - V, V));
    fed.push_back(next);
    const std::vector<float> w = ex.forward(std::vector<int32_t>{next}, false);
    const std::vector<float> g = run_step(*split, *model_, {next}, false, Drive::kSplit, &even);
    want.insert(want.end(), w.begin(), w.end());
    got.insert(got.end(), g.begin(), g.end());
  }
  ASSERT_EQ(got.size(), want.size());
  const test_support::LogitGap g = test_support::logit_gap(got, want);
  const test_support::OrderBound b = bound(want, [&](reference::DotOrderSeed s) {
    reference::ReferenceExecutor other(*model_, ref_options(c, s));
    std::vector<float> l = other.forward(p, true);
    for (int32_t t : fed) {
      const std::vector<float> one = other.forward(std::vector<int32_t>{t}, false);
      l.insert(l.end(), one.begin(), one.end());
    }
    return l;
  });
  std::printf("[ %s ] even experts on the device, odd on the host: max |diff| %.3g (%.3g of max), %s\n", c.name.c_str(),
              g.max_diff, g.rel(), b.describe().c_str());
  EXPECT_LE(g.max_diff, b.bound * g.max_ref);
}

// Without a device too: every file's recipes use only parts the CUDA backend lists (the load-time
// refusal, model::check_supported, would name the first one it lacks).
TEST(CudaGptOssSupport, BackendListsEveryPartOfTheFiles) {
  for (const Case& c : {Case{"synth_q4k", "--map _exps.=q4_k --default q8_0", true}, Case{"tiny_f32", "", false}}) {
    const model::Model m = model::Model::load(model_file(c).string());
    EXPECT_NO_THROW(model::check_supported(m, gpu_worker::cuda_backend_support())) << c.name;
  }
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

// The group's decode step (the gpu_worker with cpu workers): one launch with in-graph hand-offs
// (handoff_begin), the odd experts computed here at each layer the device hands over, gives the
// layer-by-layer split's logits bit for bit (the golden test's HandoffStepEqualsLayerByLayer).
TEST_P(CudaGptOss, HandoffStepEqualsLayerByLayer) {
  const Case& c = GetParam();
  const model::HParams& hp = model_->hp;
  const int64_t V = hp.n_vocab;
  std::vector<std::vector<int32_t>> even(static_cast<size_t>(hp.n_layer));
  for (auto& l : even)
    for (int32_t e = 0; e < hp.n_expert; e += 2) l.push_back(e);
  HandoffBuffers io(hp, kMaxTokens);
  auto by_layer = cuda_backend(*model_, c, &even);
  auto handoff = cuda_backend(*model_, c, &even);
  io.pin(*handoff);
  // moe_fused (the only expert path of a hand-off step) takes the quantized experts, not F32; the
  // step embeds on the device (embed_rows.h).
  const bool fused = c.quantized && cuda::embed_rows_supported(model_->tok_embd.type);
  ASSERT_EQ(handoff->handoff_supported(1), fused);
  if (!fused) return;
  const std::vector<int32_t> p = prompt(*model_, 20, 5);
  std::vector<float> want = run_step(*by_layer, *model_, p, false, Drive::kSplit, &even);
  const std::vector<float> first = run_step(*handoff, *model_, p, false, Drive::kSplit, &even);
  ASSERT_EQ(0, std::memcmp(first.data(), want.data(), want.size() * sizeof(float)));
  for (int i = 0; i < 5; ++i) {
    int32_t next = sampling::argmax(std::span<const float>(want.data(), V));
    want = run_step(*by_layer, *model_, {next}, false, Drive::kSplit, &even);
    std::vector<float> got(V, NAN);
    ASSERT_TRUE(handoff->handoff_begin(&next, 1, 1, io.io())) << "step " << i;
    for (int64_t il = 0; il < hp.n_layer; ++il) {
      if (handoff->layer_on_device(il)) continue;
      handoff->handoff_wait_routed(il);
      const group::ExpertPlan plan =
          plan_of(std::vector<int32_t>(io.chosen.begin(), io.chosen.begin() + hp.n_expert_used), hp.n_expert);
      host_experts(*model_, il, plan, io.h.data(), even[il], io.host_rows.data());
      handoff->handoff_release(il, plan);
    }
    handoff->handoff_finish(got.data(), nullptr, 0);
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(float))) << "decode step " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Files, CudaGptOss,
    ::testing::Values(Case{"synth_q4k", "--map _exps.=q4_k --default q8_0", true},
                      Case{"synth_mxfp4", "--map _exps.=mxfp4 --default q8_0", true},
                      Case{"synth_q4k_f16kv", "--map _exps.=q4_k --default q8_0", true, model::KvType::F16},
                      Case{"synth_f32", "--map _exps.=f32 --map ffn_gate_inp=f32 --default f32", false},
                      Case{"tiny_f32", "", false},
                      Case{"tiny_f32_fractional", "", false, model::KvType::F32, false}),
    [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

}  // namespace
}  // namespace moraine
