// llama.cpp (node-llama-cpp on CPU) loads small synthetic files of both architectures, with a
// copied real vocabulary and with the built-in byte-level one, and evaluates tokens to finite
// logits of O(1) size.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "synth_run.h"
#include "tests/interop/llama_oracle.h"

namespace moraine::test {
namespace {

TEST(SynthLlama, LoadsAndEvaluatesBothArchitectures) {
  llama_oracle_dir();  // fails loudly, naming tests/oracle/setup, when the oracle is missing
  ScratchDir dir("synth-llama");
  struct File {
    std::string name, args, arch;
    int64_t n_vocab;  // expected
    int64_t hidden;
  };
  const std::vector<File> files = {
      {"moe-qwen2vocab.gguf", "--shape qwen3moe-tiny --vocab-from " + qwen2_vocab_gguf(), "qwen3moe", 151936, 256},
      {"next-qwen2vocab.gguf", "--shape qwen3next-tiny --vocab-from " + qwen2_vocab_gguf(), "qwen3next", 151936, 256},
      {"moe-bytes.gguf", "--shape qwen3moe-tiny --layers 8 --vocab-size 3000", "qwen3moe", 3000, 256},
      {"moe-30b.gguf", "--shape qwen3moe-30b-a3b --layers 2 --experts 16 --vocab-size 2048", "qwen3moe", 2048, 2048},
      // The real 80B layer structure: 3 DeltaNet layers and one attention layer of full size.
      {"next-80b.gguf", "--shape qwen3next-80b-a3b --layers 4 --experts 16 --vocab-size 2048", "qwen3next", 2048, 2048},
  };
  std::vector<std::string> paths;
  for (const File& f : files) {
    const SynthRun r = run_synth(f.args + " --seed 9 -o " + dir.file(f.name), dir.path());
    ASSERT_EQ(r.status, 0) << f.name << ": " << r.err;
    paths.push_back(dir.file(f.name));
  }
  constexpr int kTokens = 6;
  const auto reports = run_llama_oracle(paths, kTokens, dir.path());
  for (size_t i = 0; i < files.size(); ++i) {
    SCOPED_TRACE(files[i].name);
    const LlamaReport& rep = reports.at(paths[i]);
    ASSERT_TRUE(rep.loaded) << rep.error;
    EXPECT_NE(rep.type_description.find(files[i].arch), std::string::npos) << rep.type_description;
    ASSERT_EQ(rep.n_vocab, files[i].n_vocab);
    ASSERT_EQ(rep.logits.size(), static_cast<size_t>(kTokens * rep.n_vocab));
    for (int t = 0; t < kTokens; ++t) {
      const float* row = rep.logits.data() + static_cast<size_t>(t) * static_cast<size_t>(rep.n_vocab);
      double sum = 0, sum2 = 0;
      for (int64_t v = 0; v < rep.n_vocab; ++v) {
        ASSERT_TRUE(std::isfinite(row[v])) << "token " << t << " logit " << v;
        sum += row[v];
        sum2 += static_cast<double>(row[v]) * row[v];
      }
      const double mean = sum / static_cast<double>(rep.n_vocab);
      const double var = sum2 / static_cast<double>(rep.n_vocab) - mean * mean;
      // The LM head has std 1/sqrt(hidden) and ignores the massive coordinate, so the logit
      // variance is (token-dependent part of the final residual) / (its whole RMS^2):
      // v / (1 + v) with v the final off-axis variance, 1 at the embedding. Invert for v: the
      // router-input model of synth_zipf_test assumes v grows from 1 to about 1.2.
      const double H = static_cast<double>(files[i].hidden);
      const double q = var * H / (H - 1);
      const double v_final = q / (1 - q * (H - 1) / H);
      std::printf("%s token %d: logit std %.3f -> final off-axis variance %.3f\n", files[i].name.c_str(), t,
                  std::sqrt(var), v_final);
      EXPECT_GT(v_final, 0.85);
      EXPECT_LT(v_final, 1.6);
    }
  }
}

// The real layer structure of GLM-4.5-Air (layer 0 dense, then MoE with exp_probs_b and a shared
// expert) and of Qwen3.5-35B-A3B (3 DeltaNet layers with ssm_beta/ssm_alpha, then gated
// attention with M-RoPE sections), cut to a few layers and experts: llama.cpp loads them and
// evaluates to finite logits. (Their agreement with the reference: arch_llama_test's tiny shapes.)
TEST(SynthLlama, LoadsGlmAirAndQwen35Layouts) {
  llama_oracle_dir();
  ScratchDir dir("synth-llama-glm-q35");
  const std::vector<std::pair<std::string, std::string>> files = {
      {"glm4moe", "--shape glm4.5-air --layers 2 --experts 16 --vocab-size 1024"},
      {"qwen35moe", "--shape qwen35moe-35b-a3b --layers 4 --experts 16 --vocab-size 1024"},
  };
  std::vector<std::string> paths;
  for (const auto& [arch, args] : files) {
    paths.push_back(dir.file(arch + ".gguf"));
    const SynthRun r = run_synth(args + " --seed 9 -o " + paths.back(), dir.path());
    ASSERT_EQ(r.status, 0) << arch << ": " << r.err;
  }
  constexpr int kTokens = 4;
  const auto reports = run_llama_oracle(paths, kTokens, dir.path());
  for (size_t i = 0; i < files.size(); ++i) {
    SCOPED_TRACE(files[i].first);
    const LlamaReport& rep = reports.at(paths[i]);
    ASSERT_TRUE(rep.loaded) << rep.error;
    EXPECT_NE(rep.type_description.find(files[i].first), std::string::npos) << rep.type_description;
    ASSERT_EQ(rep.n_vocab, 1024);
    ASSERT_EQ(rep.logits.size(), static_cast<size_t>(kTokens * rep.n_vocab));
    double mx = 0;
    for (float x : rep.logits) {
      ASSERT_TRUE(std::isfinite(x));
      mx = std::max(mx, std::fabs(static_cast<double>(x)));
    }
    EXPECT_GT(mx, 0.1) << "flat logits";
  }
}

}  // namespace
}  // namespace moraine::test
