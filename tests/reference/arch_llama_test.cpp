// The reference executor against llama.cpp (node-llama-cpp on the CPU, F32 weights and KV cache,
// flash attention off) on a tiny seeded file of each architecture description, written from the
// description's own key and tensor lists (tests/reference/tiny_arch_model.h): 12 positions.
// gpt-oss: attention biases and sinks, sliding-window (4 positions) and full layers alternating,
// YaRN, the top-k-then-softmax router with its bias, biased clamped-SwiGLU experts. qwen2moe: an
// architecture made only of existing parts (q/k/v biases, softmax router without
// renormalisation, gated shared expert), one file in common/model/arch. glm4moe: a dense
// leading layer, partial RoPE, q/k/v biases, the sigmoid router with its score bias, routed
// scaling and an ungated shared expert, a nextn block bound but not run; its variant adds q/k
// norm and group-limited routing. qwen35moe / qwen3next: the DeltaNet hybrids, value heads
// tiled and grouped over the key heads. Mutation checks show each such part moves the logits far
// past the bound. deepseek2 (V2-Lite-like with attn_k_b / attn_v_b and with the older
// attn_kv_b, V3-like): multi-head latent attention in both its forms, DeepSeek's YaRN.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "common/model/model.h"
#include "common/reference/executor.h"
#include "tests/interop/llama_oracle.h"
#include "tests/reference/tiny_arch_model.h"
#include "tests/synth/synth_run.h"

namespace moraine::test {
namespace {

constexpr int kTokens = 12;

// max over positions of max |ours - llama| / max |llama|; greedy agreement where not a near tie.
double worst_gap(const std::vector<float>& ours, const std::vector<float>& llama, int64_t n_vocab, int n_tokens) {
  double worst = 0;
  for (int t = 0; t < n_tokens; ++t) {
    const float* a = ours.data() + static_cast<size_t>(t) * n_vocab;
    const float* b = llama.data() + static_cast<size_t>(t) * n_vocab;
    double mx = 0, gap = 0;
    for (int64_t v = 0; v < n_vocab; ++v) {
      EXPECT_TRUE(std::isfinite(a[v])) << "position " << t << " logit " << v;
      mx = std::max(mx, std::fabs(static_cast<double>(b[v])));
      gap = std::max(gap, std::fabs(static_cast<double>(a[v]) - b[v]));
    }
    EXPECT_GT(mx, 0.5) << "position " << t << ": llama.cpp's logits are flat";
    worst = std::max(worst, gap / mx);
    std::vector<int64_t> order(static_cast<size_t>(n_vocab));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + 2, order.end(), [&](int64_t x, int64_t y) { return b[x] > b[y]; });
    if (b[order[0]] - b[order[1]] > 1e-3 * mx) {
      EXPECT_EQ(std::max_element(a, a + n_vocab) - a, order[0]) << "position " << t;
    }
  }
  return worst;
}

// A change of the model the reference would compute wrongly; keep holds replaced weight bytes.
using Keep = std::vector<std::vector<uint8_t>>;
struct Mutation {
  const char* what;
  void (*apply)(model::Model&, Keep&);
};

// Rows [first, first + n) of every layer's matrix (picked by field) replaced by zeros.
template <class Field>
void zero_rows(model::Model& mm, Keep& keep, Field field, int64_t first, int64_t n) {
  for (auto& L : mm.layers) {
    model::Matrix& w = field(L);
    keep.emplace_back(w.data, w.data + static_cast<size_t>(w.n_rows) * w.row_bytes);
    std::fill_n(keep.back().data() + static_cast<size_t>(first) * w.row_bytes, static_cast<size_t>(n) * w.row_bytes, 0);
    w.data = keep.back().data();
  }
}

// Each part of the architecture matters in its tiny file: the reference with one of these
// leaves llama.cpp by far more than the bound, so the agreement checks the part. `arch` is the
// test's parameter (with its variant).
std::vector<Mutation> mutations_of(const std::string& arch) {
  if (arch == "gpt-oss") return {
      {"no sliding window", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.recipe.mixer.attn.sliding_window = 0; }},
      {"no sinks", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.attn.sinks.clear(); }},
      {"no YaRN", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.recipe.mixer.attn.rope.scaling = model::RopeScaling::None; }},
      {"no attention biases", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.attn.q_bias.clear(), L.attn.k_bias.clear(), L.attn.o_bias.clear(); }},
      {"softmax over all experts", [](model::Model& mm, Keep&) {
         for (auto& L : mm.layers) L.recipe.ffn.router.kind = model::RouterKind::SoftmaxTopK;
         mm.hp.norm_topk_prob = false;
       }},
      {"no router bias", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.moe.router_bias.clear(); }},
      {"plain SwiGLU", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.recipe.ffn.experts.act = model::Activation::SwiGlu; }},
      {"no expert biases", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.recipe.ffn.experts.biases = false; }},
  };
  if (arch == "glm4moe") return {
      {"softmax router", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.recipe.ffn.router.kind = model::RouterKind::SoftmaxTopK; }},
      {"no score bias", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.moe.score_bias.clear(); }},
      {"no routed scaling", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.recipe.ffn.router.routed_scale = 1.0; }},
      {"shared expert gated (x0.5)", [](model::Model& mm, Keep&) {
         for (auto& L : mm.layers)
           if (L.moe.shared_up) L.moe.shared_router.assign(static_cast<size_t>(mm.hp.n_embd), 0.0f);
       }},
      {"dense FFN gate/up swapped", [](model::Model& mm, Keep&) { std::swap(mm.layers[0].dense.gate, mm.layers[0].dense.up); }},
      {"no q/k/v biases", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.attn.q_bias.clear(), L.attn.k_bias.clear(), L.attn.v_bias.clear(); }},
      {"full-head RoPE", [](model::Model& mm, Keep&) { mm.hp.n_rot = mm.hp.head_dim; }},
  };
  if (arch == "glm4moe:qknorm_groups") return {
      {"no group limit", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.recipe.ffn.router.n_group = 1; }},
      {"renormalised weights", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.recipe.ffn.router.renormalize = true; }},
      {"no q/k norm", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.attn.q_norm.clear(), L.attn.k_norm.clear(); }},
      {"no score bias", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.moe.score_bias.clear(); }},
  };
  if (arch == "qwen35moe") return {
      {"value heads grouped (qwen3next)", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.recipe.mixer.delta.v_heads_tiled = false; }},
      {"beta and alpha swapped", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) std::swap(L.delta.beta, L.delta.alpha); }},
  };
  if (arch == "qwen3next") return {
      {"value heads tiled (qwen35moe)", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.recipe.mixer.delta.v_heads_tiled = true; }},
  };
  if (arch.rfind("deepseek2", 0) != 0) return {};
  std::vector<Mutation> m = {
      {"k without its rope part", [](model::Model& mm, Keep& keep) {
         const model::MlaPart& p = mm.layers[0].recipe.mixer.mla;
         zero_rows(mm, keep, [](model::LayerWeights& L) -> model::Matrix& { return L.mla.kv_a_mqa; }, p.kv_lora_rank, p.rope_dim);
       }},
      {"kv_a_norm weight all ones", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.mla.kv_a_norm.assign(L.mla.kv_a_norm.size(), 1.0f); }},
      {"scale without YaRN's mscale^2", [](model::Model& mm, Keep&) {
         for (auto& L : mm.layers) L.recipe.mixer.mla.kq_scale = 1.0 / std::sqrt(static_cast<double>(mm.hp.mla_head_k));
       }},
      {"no YaRN", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.recipe.mixer.attn.rope.scaling = model::RopeScaling::None; }},
  };
  if (arch == "deepseek2:lite") {
    m.push_back({"renormalised top-k", [](model::Model& mm, Keep&) {
      mm.hp.norm_topk_prob = true;   // what the softmax router reads
      for (auto& L : mm.layers) L.recipe.ffn.router.renormalize = true;
    }});
  }
  if (arch == "deepseek2:v3") {
    m.push_back({"q_a_norm weight all ones", [](model::Model& mm, Keep&) {
      for (auto& L : mm.layers) L.mla.q_a_norm.assign(L.mla.q_a_norm.size(), 1.0f);
    }});
    m.push_back({"no group limit", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.recipe.ffn.router.n_group = L.recipe.ffn.router.topk_group = 1; }});
    m.push_back({"no choice bias", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.moe.score_bias.clear(); }});
    m.push_back({"no routed scale", [](model::Model& mm, Keep&) { for (auto& L : mm.layers) L.recipe.ffn.router.routed_scale = 1.0; }});
  }
  return m;
}

class ArchLlama : public ::testing::TestWithParam<std::string> {};

TEST_P(ArchLlama, ReferenceLogitsMatchLlamaCppAtEveryPosition) {
  llama_oracle_dir();  // fails loudly, naming tests/oracle/setup, when the oracle is missing
  const std::string name = GetParam();   // an architecture, or one and a variant after ':'
  const std::string arch = name.substr(0, name.find(':'));
  std::string stem = name;
  for (char& c : stem) c = c == ':' ? '-' : c;
  ScratchDir dir("arch-llama-" + stem);
  const model::HParams spec = tiny_hparams(name);
  std::vector<std::vector<float>> data;
  gguf::GgufWriter w = tiny_writer(spec, 7, data);
  add_minimal_llama_vocab(w, spec.n_vocab);
  const std::string path = dir.file("tiny-" + stem + ".gguf");
  w.write(path);

  const auto reports = run_llama_oracle({path}, kTokens, dir.path());
  const LlamaReport& rep = reports.at(path);
  ASSERT_TRUE(rep.loaded) << rep.error;
  EXPECT_NE(rep.type_description.find(spec.desc->name), std::string::npos) << rep.type_description;
  ASSERT_EQ(rep.n_vocab, spec.n_vocab);
  ASSERT_EQ(rep.logits.size(), static_cast<size_t>(kTokens * spec.n_vocab));

  const model::Model m = model::Model::load(path);
  reference::ReferenceExecutor ex(m, {2});
  std::vector<int32_t> tokens(kTokens);
  std::iota(tokens.begin(), tokens.end(), 0);
  const std::vector<float> ours = ex.forward(tokens, true);
  ASSERT_EQ(ours.size(), rep.logits.size());
  // F32 weights and cache: float order only (the qwen goldens agree to 1.5e-6 on this path).
  const double worst = worst_gap(ours, rep.logits, spec.n_vocab, kTokens);
  std::printf("%s reference vs llama.cpp: worst max|diff|/max|logit| %.3g\n", name.c_str(), worst);
  EXPECT_LE(worst, 1e-4);

  // Decode after prefill is bit-identical to the one prefill (the sliding layers' window moves
  // with each decoded position).
  {
    reference::ReferenceExecutor dec(m, {2});
    std::vector<float> stepped = dec.forward(std::span<const int32_t>(tokens.data(), 5), true);
    for (int t = 5; t < kTokens; ++t) {
      const std::vector<float> row = dec.forward(std::span<const int32_t>(tokens.data() + t, 1), false);
      stepped.insert(stepped.end(), row.begin(), row.end());
    }
    ASSERT_EQ(stepped.size(), ours.size());
    EXPECT_EQ(0, std::memcmp(stepped.data(), ours.data(), ours.size() * sizeof(float)));
  }

  if (spec.kv_lora_rank > 0) {
    // MLA's other form (expanded for attn_k_b / attn_v_b, absorbed for attn_kv_b) agrees too.
    reference::ExecutorOptions o{2};
    o.mla_form = spec.mla_split_kv_b ? reference::MlaForm::Expanded : reference::MlaForm::Absorbed;
    reference::ReferenceExecutor other(m, o);
    const std::vector<float> theirs = other.forward(tokens, true);
    const double gap = worst_gap(theirs, rep.logits, spec.n_vocab, kTokens);
    std::printf("%s the other MLA form vs llama.cpp: worst max|diff|/max|logit| %.3g\n", name.c_str(), gap);
    EXPECT_LE(gap, 1e-4);
  }

  // Each part matters here: the reference with one part dropped (or swapped for its qwen
  // counterpart) leaves llama.cpp by far more than the bound, so the agreement above checks it.
  for (const Mutation& mu : mutations_of(name)) {
    model::Model mm = model::Model::load(path);
    std::vector<std::vector<uint8_t>> keep;
    mu.apply(mm, keep);
    reference::ReferenceExecutor mex(mm, {2});
    const std::vector<float> moved = mex.forward(tokens, true);
    double gap = 0, mx = 0;
    for (size_t i = 0; i < moved.size(); ++i) {
      gap = std::max(gap, std::fabs(static_cast<double>(moved[i]) - rep.logits[i]));
      mx = std::max(mx, std::fabs(static_cast<double>(rep.logits[i])));
    }
    std::printf("  %-30s max|diff|/max|logit| %.3g\n", mu.what, gap / mx);
    EXPECT_GT(gap / mx, 1e-2) << mu.what << " does not move the logits: the test would not see it wrong";
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, ArchLlama,
                         ::testing::Values("deepseek2:lite", "deepseek2:kv_b", "deepseek2:v3", "deepseek2:v3_nobias", "glm4moe",
                                           "glm4moe:qknorm_groups", "gpt-oss", "qwen2moe", "qwen35moe", "qwen3moe",
                                           "qwen3next"),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           for (char& c : n) c = c == '-' || c == ':' ? '_' : c;
                           return n;
                         });

// A moraine-synth shape (its tensor list is the description's) read by llama.cpp and by the
// reference, F32 throughout so only float order separates them.
void synth_agrees_with_llama(const std::string& shape, const std::string& arch, int n_tokens) {
  llama_oracle_dir();
  ScratchDir dir(shape + "-synth");
  const std::string path = dir.file(shape + ".gguf");
  const SynthRun r = run_synth("--shape " + shape + " --vocab-size 512 --seed 5 --map _exps.=f32 --map ffn_gate_inp=f32 "
                               "--default f32 -o " + path, dir.path());
  ASSERT_EQ(r.status, 0) << r.err;
  const auto reports = run_llama_oracle({path}, n_tokens, dir.path());
  const LlamaReport& rep = reports.at(path);
  ASSERT_TRUE(rep.loaded) << rep.error;
  EXPECT_NE(rep.type_description.find(arch), std::string::npos) << rep.type_description;
  const model::Model m = model::Model::load(path);
  ASSERT_EQ(rep.n_vocab, m.hp.n_vocab);
  reference::ReferenceExecutor ex(m, {2});
  std::vector<int32_t> tokens(static_cast<size_t>(n_tokens));
  std::iota(tokens.begin(), tokens.end(), 0);
  const std::vector<float> ours = ex.forward(tokens, true);
  ASSERT_EQ(ours.size(), rep.logits.size());
  double worst = 0;
  for (int t = 0; t < n_tokens; ++t) {
    double mx = 0, gap = 0;
    for (int64_t v = 0; v < m.hp.n_vocab; ++v) {
      const size_t i = static_cast<size_t>(t * m.hp.n_vocab + v);
      ASSERT_TRUE(std::isfinite(ours[i]));
      mx = std::max(mx, std::fabs(static_cast<double>(rep.logits[i])));
      gap = std::max(gap, std::fabs(static_cast<double>(ours[i]) - rep.logits[i]));
    }
    ASSERT_GT(mx, 0.0) << "position " << t;
    worst = std::max(worst, gap / mx);
  }
  std::printf("synth %s reference vs llama.cpp: worst max|diff|/max|logit| %.3g\n", shape.c_str(), worst);
  EXPECT_LE(worst, 1e-4);
}

TEST(ArchLlamaSynth, GptOssTinyAgreesWithLlamaCpp) {
  synth_agrees_with_llama("gpt-oss-tiny", "gpt-oss", 20);   // past the shape's window of 8
}

TEST(ArchLlamaSynth, DeepseekV3TinyAgreesWithLlamaCpp) {
  synth_agrees_with_llama("deepseek-v3-tiny", "deepseek2", 20);
}

TEST(ArchLlamaSynth, Glm4MoeTinyAgreesWithLlamaCpp) {
  synth_agrees_with_llama("glm4moe-tiny", "glm4moe", 20);
}

TEST(ArchLlamaSynth, Qwen35MoeTinyAgreesWithLlamaCpp) {
  synth_agrees_with_llama("qwen35moe-tiny", "qwen35moe", 20);
}

}  // namespace
}  // namespace moraine::test
