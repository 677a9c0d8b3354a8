// Quantizer interop: files written by llama.cpp's OWN quantizer (llama_model_quantize in the
// libllama node-llama-cpp ships, through moraine-test-llama-quantize) for every hub block type,
// run by moraine's reference executor and by llama.cpp (node-llama-cpp, CPU): the greedy tokens
// must be identical and the logits agree at every position.
//
// Source models: the golden qwen3moe_k256 and qwen3next_k256 checkpoints (rows of 256, so every
// block type applies) converted to F32 by moraine-convert. llama.cpp picks its usual per-tensor
// mix for the file type (output.weight Q6_K or so, fallbacks where rows do not fit): the test
// checks the type under test is really in the file.
//
// Tolerance, per position max |diff| / max |logit|: both engines quantize activations bit for bit
// alike (cpu::quantize_activation_row_llama_x86, checked against node-llama-cpp's own
// quantizers in tests/reference/llama_oracle_test.cpp; q8_1 is q8_0's x86 rule plus the sum) and
// compute the same integer block sums; they differ only in the float order of the block terms
// (llama.cpp's AVX2/AVX-512 dots: 8 float lanes with FMA, IQ4_XS's sub-block scales applied in
// integers, TQ's -1 offset through the activation block sums in int16 lanes; moraine's reference:
// ggml's generic C order). Measured: every position agrees to <= 2e-6 (float rounding) until, at
// one position, a re-quantized activation sits on a rounding edge and the two orders pick
// neighbouring int8 codes; from there the tiny random MoE models (chaotic, see
// tests/reference/llama_oracle_test.cpp) differ by ~1e-2 at later positions (qwen3moe_k256 iq4_xs:
// 2e-7 up to position 19, 1.3e-2 at 20). The reference meets such edges itself under its other
// valid float orders (ExecutorOptions::dot_order), so the bound is float_order_bound.h's,
// max(1e-3, 2 x the reference's own largest gap over 32 orders), with that gap taken over all of
// the model's quantized files in this test: rows of one 256-block (IQ4_XS, TQ on these models)
// leave the reference no block order to vary, and a flip moves a model's logits alike whatever
// the weight type. Greedy margins on these models are >= 0.035 of max |logit| ~ 8 (tests/golden/
// manifest.json): greedy tokens must be identical; a miss is reported with the margin.
//
// Add a type: one row in kQuantCases (name, whether llama.cpp needs an importance matrix).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <unistd.h>
#include <vector>

#include "common/formats/tensor_type.h"
#include "common/gguf/gguf.h"
#include "common/model/model.h"
#include "common/reference/executor.h"
#include "tests/reference/float_order_bound.h"
#include "tests/support/shell.h"

namespace moraine::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test_support::quoted;
using test_support::run_command;

const fs::path kSource = MORAINE_SOURCE_DIR;
const fs::path kOracle = kSource / ".cache" / "oracle";
const fs::path kBuild = MORAINE_BUILD_DIR;
const char* const kModels[] = {"qwen3moe_k256", "qwen3next_k256"};
constexpr int kGreedy = 12;

struct QuantCase {
  const char* type;   // moraine type name; llama.cpp's file type for it (type_map.h)
  bool imatrix;       // llama.cpp refuses the type without an importance matrix
};

// The grid types need an importance matrix in llama.cpp (tensor_requires_imatrix in
// llama-quant.cpp: IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M; not IQ3_S). iq2_s is written
// as llama.cpp's IQ2_M file type (its IQ2_S file type stores IQ2_XS tensors; type_map.cpp).
const QuantCase kQuantCases[] = {
    {"q4_1", false},    {"q5_0", false},   {"q5_1", false},   {"iq4_nl", false}, {"iq4_xs", false},
    {"tq1_0", false},   {"tq2_0", false},  {"iq2_xxs", true}, {"iq2_xs", true},  {"iq2_s", true},
    {"iq3_xxs", true},  {"iq3_s", false},  {"iq1_s", true},   {"iq1_m", true},
};

struct Case {
  std::string model, type;
  bool imatrix = false;
  std::string key() const { return model + "_" + type; }
};

std::vector<Case> cases() {
  std::vector<Case> v;
  for (const char* m : kModels) {
    for (const QuantCase& q : kQuantCases) v.push_back({m, q.type, q.imatrix});
  }
  return v;
}

int argmax(const float* row, int64_t n) { return static_cast<int>(std::max_element(row, row + n) - row); }

// max over positions of max |a - b| / max |b| at that position.
double worst_position_gap(const std::vector<float>& a, const std::vector<float>& b, int64_t V) {
  double worst = 0;
  for (size_t t = 0; t * static_cast<size_t>(V) < b.size(); ++t) {
    double diff = 0, ref = 0;
    for (size_t v = t * static_cast<size_t>(V); v < (t + 1) * static_cast<size_t>(V); ++v) {
      diff = std::max(diff, std::fabs(double(a[v]) - b[v]));
      ref = std::max(ref, std::fabs(double(b[v])));
    }
    worst = std::max(worst, diff / ref);
  }
  return worst;
}

// Per case: the file, moraine's greedy continuation and its logits over prompt + continuation,
// and llama.cpp's logits over the same tokens (one node process for all files).
struct Runs {
  std::string error;
  std::map<std::string, std::string> file, case_error;
  std::map<std::string, std::vector<int32_t>> tokens;  // prompt + greedy continuation
  std::map<std::string, int64_t> n_prompt;
  std::map<std::string, std::vector<float>> ours, llama;
  std::vector<fs::path> temp;

  ~Runs() {
    for (const auto& p : temp) fs::remove(p);
  }

  fs::path tmp(const std::string& stem) {
    temp.push_back(fs::temp_directory_path() / ("moraine-qinterop-" + std::to_string(::getpid()) + "-" + stem + ".gguf"));
    return temp.back();
  }

  void run() {
    if (!fs::exists(kOracle / "node_modules" / "node-llama-cpp")) {
      error = "llama.cpp oracle missing: run tests/oracle/setup (expected " + kOracle.string() + ")";
      return;
    }
    const fs::path quantizer = kBuild / "tests" / "interop" / "moraine-test-llama-quantize";
    if (!fs::exists(quantizer)) {
      error = "moraine-test-llama-quantize was not built (llama.cpp headers missing under .cache/oracle/llama.cpp when configured: run tests/oracle/setup and re-run cmake)";
      return;
    }
    json jobs = json::array();
    std::vector<std::string> order;
    for (const char* m : kModels) {
      const fs::path dir = kSource / "tests" / "golden" / m;
      const std::vector<int32_t> prompt = json::parse(std::ifstream(dir / "tokens.json")).at("ids").get<std::vector<int32_t>>();
      const fs::path f32 = tmp(std::string(m) + "-f32");
      auto [rc, out] = run_command(quoted(kBuild / "tools" / "moraine-convert") + " " + quoted(dir) + " " + quoted(f32) + " --outtype f32");
      if (rc != 0) {
        error = "moraine-convert " + dir.string() + ":\n" + out;
        return;
      }
      for (const Case& c : cases()) {
        if (c.model != m) continue;
        const fs::path q = tmp(c.key());
        std::tie(rc, out) = run_command(quoted(quantizer) + " " + quoted(f32) + " " + quoted(q) + " " + c.type + (c.imatrix ? " --imatrix uniform" : ""));
        if (rc != 0) {
          case_error[c.key()] = "llama.cpp's quantizer (" + c.type + ") failed:\n" + out.substr(out.size() > 3000 ? out.size() - 3000 : 0);
          continue;
        }
        file[c.key()] = q.string();
        try {
          const model::Model model = model::Model::load(q.string());
          reference::ReferenceExecutor ex(model);
          std::vector<int32_t> seq = prompt;
          std::vector<float> last = ex.forward(prompt, false);
          for (int g = 0; g < kGreedy; ++g) {
            const int32_t next = argmax(last.data(), model.hp.n_vocab);
            seq.push_back(next);
            if (g + 1 < kGreedy) last = ex.forward(std::vector<int32_t>{next}, false);
          }
          // Logits at every position of prompt + all but the last greedy token, in one forward.
          reference::ReferenceExecutor all(model);
          ours[c.key()] = all.forward(std::vector<int32_t>(seq.begin(), seq.end() - 1), true);
          tokens[c.key()] = seq;
          n_prompt[c.key()] = static_cast<int64_t>(prompt.size());
        } catch (const std::exception& e) {
          case_error[c.key()] = std::string("moraine cannot run llama.cpp's ") + c.type + " file: " + e.what();
          continue;
        }
        std::vector<int32_t> fed(tokens[c.key()].begin(), tokens[c.key()].end() - 1);
        jobs.push_back({{"path", q.string()}, {"ids", fed}});
        order.push_back(c.key());
      }
    }
    const fs::path job_file = tmp("jobs");
    std::ofstream(job_file) << jobs.dump();
    auto [rc, out] = run_command("cd " + quoted(kOracle) + " && node " + quoted(kSource / "tests" / "reference" / "llama_logits.mjs") + " " +
                                     quoted(job_file),
                                 /*merge_stderr=*/false);
    if (rc != 0) {
      error = "node-llama-cpp failed (exit " + std::to_string(rc) + "):\n" + out;
      return;
    }
    try {
      const json results = json::parse(out).at("results");
      for (size_t j = 0; j < order.size(); ++j) {
        const json& r = results.at(j);
        if (r.contains("error")) {
          case_error[order[j]] = "llama.cpp: " + r.at("error").get<std::string>();
          continue;
        }
        std::vector<float>& v = llama[order[j]];
        for (const json& row : r.at("rows")) {
          for (const json& x : row) v.push_back(x.is_number() ? x.get<float>() : NAN);
        }
      }
    } catch (const std::exception& e) {
      error = std::string("cannot read llama_logits.mjs output (") + e.what() + "):\n" + out.substr(0, 2000);
    }
  }
};

const Runs& runs() {
  static Runs r;
  static const bool done = (r.run(), true);
  (void)done;
  return r;
}

// The reference's largest gap to itself over 32 float orders, over every file of `model_name`
// this test has (computed once per model).
double model_self_gap(const std::string& model_name) {
  static std::map<std::string, double> cache;
  if (auto it = cache.find(model_name); it != cache.end()) return it->second;
  const Runs& r = runs();
  double g = 0;
  for (const Case& c : cases()) {
    if (c.model != model_name || !r.ours.count(c.key())) continue;
    const model::Model m = model::Model::load(r.file.at(c.key()));
    const std::vector<int32_t> fed(r.tokens.at(c.key()).begin(), r.tokens.at(c.key()).end() - 1);
    const std::vector<float>& ours = r.ours.at(c.key());
    const test_support::OrderBound self = test_support::quantized_bound([&](reference::DotOrderSeed s) {
      reference::ReferenceExecutor other(m, test_support::in_order(s));
      return worst_position_gap(other.forward(fed, true), ours, m.hp.n_vocab);
    });
    std::printf("[ %-22s ] the reference's own gap over %d float orders: %.3g\n", c.key().c_str(), self.orders, self.self_gap);
    g = std::max(g, self.self_gap);
  }
  return cache[model_name] = g;
}

class QuantizerInterop : public ::testing::TestWithParam<Case> {};

TEST_P(QuantizerInterop, GreedyTokensAndLogitsMatchLlamaCpp) {
  const Case c = GetParam();
  const Runs& r = runs();
  ASSERT_TRUE(r.error.empty()) << r.error;
  ASSERT_EQ(r.case_error.count(c.key()), 0u) << r.case_error.at(c.key());

  // The type under test is in the file (llama.cpp may keep some tensors in other types).
  const auto file = gguf::GgufFile::open(r.file.at(c.key()));
  const TensorType want = *type_from_name(c.type);
  std::map<std::string, int> by_type;
  for (const auto& t : file.tensors()) ++by_type[std::string(type_name(t.type))];
  std::string mix;
  for (const auto& [name, n] : by_type) mix += " " + name + "x" + std::to_string(n);
  ASSERT_GT(by_type[std::string(type_name(want))], 0) << "llama.cpp wrote no " << c.type << " tensor; types:" << mix;

  const model::Model m = model::Model::load(r.file.at(c.key()));
  const int64_t V = m.hp.n_vocab, P = r.n_prompt.at(c.key());
  const std::vector<int32_t>& seq = r.tokens.at(c.key());
  const std::vector<float>& ours = r.ours.at(c.key());
  const std::vector<float>& theirs = r.llama.at(c.key());
  const int64_t rows = static_cast<int64_t>(seq.size()) - 1;
  ASSERT_EQ(ours.size(), static_cast<size_t>(rows * V));
  ASSERT_EQ(theirs.size(), ours.size()) << "llama.cpp returned " << theirs.size() << " logits";
  for (float x : theirs) ASSERT_TRUE(std::isfinite(x)) << "llama.cpp returned a non-finite logit";

  auto gap = [&](const std::vector<float>& a, const std::vector<float>& b, int64_t t) {
    double diff = 0, ref = 0;
    for (int64_t v = 0; v < V; ++v) {
      diff = std::max(diff, std::fabs(double(a[t * V + v]) - b[t * V + v]));
      ref = std::max(ref, std::fabs(double(b[t * V + v])));
    }
    return diff / ref;
  };
  double worst = 0;
  int64_t worst_pos = 0;
  for (int64_t t = 0; t < rows; ++t) {
    const double g = gap(ours, theirs, t);
    if (g > worst) worst = g, worst_pos = t;
  }
  int64_t first_edge = -1;  // the first position past float rounding (1e-5)
  for (int64_t t = 0; t < rows && first_edge < 0; ++t) {
    if (gap(ours, theirs, t) > 1e-5) first_edge = t;
  }
  double bound = test_support::kQuantizedFloor;
  if (worst > bound) bound = std::max(bound, test_support::kOrderFactor * model_self_gap(c.model));
  for (int64_t t = 0; t < rows; ++t) EXPECT_LE(gap(ours, theirs, t), bound) << "position " << t;

  // Greedy: llama.cpp's argmax after each prefix is the token moraine chose (teacher-forced, so
  // llama.cpp's own greedy run would produce the same continuation).
  int64_t agree = 0;
  for (int64_t t = P - 1; t < rows; ++t) {
    const int32_t mine = seq[static_cast<size_t>(t + 1)];
    const int32_t theirs_tok = argmax(theirs.data() + t * V, V);
    std::vector<float> row(ours.begin() + t * V, ours.begin() + (t + 1) * V);
    std::nth_element(row.begin(), row.begin() + 1, row.end(), std::greater<float>());
    EXPECT_EQ(theirs_tok, mine) << "greedy step " << (t - P + 1) << ": moraine's top-2 margin " << row[0] - row[1];
    agree += theirs_tok == mine;
  }
  std::printf("[ %-22s ] types:%s | max rel logit gap %.2e (position %lld, bound %.2g; float rounding only up to position %lld) | greedy %lld/%lld\n",
              c.key().c_str(), mix.c_str(), worst, static_cast<long long>(worst_pos), bound,
              static_cast<long long>(first_edge < 0 ? rows : first_edge) - 1, static_cast<long long>(agree), static_cast<long long>(rows - P + 1));
}

INSTANTIATE_TEST_SUITE_P(LlamaQuantize, QuantizerInterop, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.key(); });

}  // namespace
}  // namespace moraine::testing
