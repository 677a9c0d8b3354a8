// The CUDA backend (gpu_worker/cuda_backend.h) driven step by step as the gpu_worker drives a
// backend (embed, then per layer mixer, route, routed experts, combine; advance; logits), on the
// golden qwen3moe and qwen3next checkpoints of tests/golden/ converted by moraine-convert, in
// three weight variants: F32, Q8_0 everywhere, and a K-quant mix of the formats the CUDA matvec
// has (its experts Q4_K, so the fused MoE kernel serves them).
//  - F32: logits at every prompt position within the reference's own bound against transformers
//    (max |diff| <= 1e-4 * max |logit|, tests/reference/golden_test.cpp); the 32-token greedy
//    continuation identical to transformers'.
//  - Quantized: logits within 1e-3 * max |logit| of the reference executor (the bound the
//    reference keeps against llama.cpp, tests/reference/llama_oracle_test.cpp); greedy tokens
//    identical to the reference executor's.
//  - Decode after prefill gives bit-identical logits to a fresh prefill of the same tokens.
// The routed experts are run in two calls (even ids, then odd ids) as two devices would.
// GGUFs come from $MORAINE_CUDA_GOLDEN_GGUF/<model>_<variant>.gguf when set (the GPU machine
// gets them ready-made), else they are made here with moraine-convert / moraine-quantize.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <unistd.h>
#include <vector>

#include "common/model/model.h"
#include "common/reference/executor.h"
#include "common/sampling/sampler.h"
#include "coordinator/group_layout.h"
#include "gpu_worker/cuda_backend.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const fs::path kGolden = fs::path(MORAINE_SOURCE_DIR) / "tests" / "golden";
const fs::path kTools = fs::path(MORAINE_BUILD_DIR) / "tools";
constexpr int kMaxTokens = 64;

// The K-quant mix: every K-quant the CUDA matvec runs; rows too short for 256-blocks fall back
// to q8_0 / f16 in moraine-quantize, which exercises the F16 kernel too.
const std::map<std::string, std::string> kQuantArgs = {
    {"q8_0", "--default q8_0"},
    {"kmix", "--map _exps.=q4_k --map attn_v=q6_k --map attn_output=q5_k --map attn_q=q4_k --map ssm_out=q5_k "
             "--default q8_0"},
};

json read_json(const fs::path& p) {
  std::ifstream f(p);
  if (!f) throw std::runtime_error("cannot read " + p.string());
  return json::parse(f);
}

std::pair<int, std::string> run_command(const std::string& cmd) {
  std::string out;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed: " + cmd};
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

std::string sh(const fs::path& p) {
  std::string s = "'";
  s += p.string();
  s += '\'';
  return s;
}

// The GGUF of model/variant: ready-made, or converted (and quantized) once per process.
fs::path golden_gguf(const std::string& model, const std::string& variant) {
  const std::string file = model + "_" + variant + ".gguf";
  if (const char* dir = std::getenv("MORAINE_CUDA_GOLDEN_GGUF")) {
    const fs::path p = fs::path(dir) / file;
    if (!fs::exists(p)) throw std::runtime_error("MORAINE_CUDA_GOLDEN_GGUF is set but " + p.string() + " is missing");
    return p;
  }
  static const fs::path tmp = fs::temp_directory_path() / ("moraine-cuda-golden-" + std::to_string(getpid()));
  fs::create_directories(tmp);
  const fs::path f32 = tmp / (model + "_f32.gguf");
  if (!fs::exists(f32)) {
    auto [rc, out] = run_command(sh(kTools / "moraine-convert") + " " + sh(kGolden / model) + " " + sh(f32) +
                                 " --outtype f32");
    if (rc != 0) throw std::runtime_error("moraine-convert " + model + " failed:\n" + out);
  }
  if (variant == "f32") return f32;
  const fs::path q = tmp / file;
  if (!fs::exists(q)) {
    auto [rc, out] = run_command(sh(kTools / "moraine-quantize") + " " + sh(f32) + " " + sh(q) + " " +
                                 kQuantArgs.at(variant));
    if (rc != 0) throw std::runtime_error("moraine-quantize " + file + " failed:\n" + out);
  }
  return q;
}

// The slot grouping the coordinator computes (group_layout.h ExpertPlan), built here directly:
// slots grouped by expert in ascending id, each expert's rows in ascending slot order.
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

// One step of n tokens through the backend; logits of every row when all_logits, else the last.
std::vector<float> run_step(gpu_worker::Backend& b, const model::Model& m, const std::vector<int32_t>& tokens,
                            bool all_logits) {
  const model::HParams& hp = m.hp;
  const int64_t n = static_cast<int64_t>(tokens.size()), d = hp.n_embd, k = hp.n_expert_used;
  std::vector<float> x(n * d, NAN), h(n * d, NAN), weight(n * k, NAN), expert_out(n * k * d, NAN);
  std::vector<int32_t> chosen(n * k, -1);
  std::vector<const float*> slot_rows(n * k);
  std::vector<int32_t> even, odd;
  for (int32_t e = 0; e < hp.n_expert; ++e) (e % 2 == 0 ? even : odd).push_back(e);
  b.embed(tokens.data(), n, x.data());
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    b.mixer(il, x.data(), n, h.data());
    b.route(il, h.data(), n, chosen.data(), weight.data());
    const group::ExpertPlan plan = plan_of(chosen, hp.n_expert);
    b.routed_experts(il, h.data(), n, plan, even, expert_out.data());
    b.routed_experts(il, h.data(), n, plan, odd, expert_out.data());
    for (int64_t i = 0; i < n * k; ++i) slot_rows[i] = expert_out.data() + int64_t{plan.row_of[i]} * d;
    b.combine(il, h.data(), n, weight.data(), slot_rows.data(), x.data());
  }
  b.advance(n);
  const int64_t rows = all_logits ? n : 1;
  std::vector<float> logits(rows * hp.n_vocab, NAN);
  b.logits(x.data() + (n - rows) * d, rows, logits.data());
  return logits;
}

struct Gap {
  double max_ref = 0, max_diff = 0;
  int64_t worst = 0;
};
Gap gap(const std::vector<float>& got, const std::vector<float>& want) {
  Gap g;
  for (size_t i = 0; i < want.size(); ++i) {
    g.max_ref = std::max(g.max_ref, std::fabs(double(want[i])));
    const double dlt = std::isfinite(got[i]) ? std::fabs(double(got[i]) - want[i]) : INFINITY;
    if (dlt > g.max_diff) g.max_diff = dlt, g.worst = static_cast<int64_t>(i);
  }
  return g;
}

struct Case {
  std::string model, variant;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.model << "_" << c.variant; }

class CudaBackendGolden : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
    const Case& c = GetParam();
    dir_ = kGolden / c.model;
    model_ = std::make_unique<model::Model>(model::Model::load(golden_gguf(c.model, c.variant)));
    prompt_ = read_json(dir_ / "tokens.json").at("ids").get<std::vector<int32_t>>();
    backend_ = gpu_worker::make_cuda_backend(*model_, 0, kMaxTokens, 256);
  }
  fs::path dir_;
  std::unique_ptr<model::Model> model_;
  std::vector<int32_t> prompt_;
  std::unique_ptr<gpu_worker::Backend> backend_;
};

TEST_P(CudaBackendGolden, PrefillLogitsMatchAtEveryPosition) {
  const Case& c = GetParam();
  const int64_t V = model_->hp.n_vocab;
  const std::vector<float> got = run_step(*backend_, *model_, prompt_, true);
  reference::ReferenceExecutor ex(*model_);
  const std::vector<float> ref = ex.forward(prompt_, true);
  ASSERT_EQ(got.size(), ref.size());
  const Gap vs_ref = gap(got, ref);
  std::printf("[ %s %s ] vs reference executor: max |logit| %.4f, max |diff| %.3g (%.3g of max) at position %lld\n",
              c.model.c_str(), c.variant.c_str(), vs_ref.max_ref, vs_ref.max_diff, vs_ref.max_diff / vs_ref.max_ref,
              static_cast<long long>(vs_ref.worst / V));
  if (c.variant == "f32") {
    std::vector<float> hf(got.size());
    std::ifstream f(dir_ / "logits.f32", std::ios::binary);
    ASSERT_TRUE(f.read(reinterpret_cast<char*>(hf.data()), static_cast<std::streamsize>(hf.size() * 4)))
        << "cannot read " << dir_ / "logits.f32";
    const Gap vs_hf = gap(got, hf);
    std::printf("[ %s %s ] vs transformers: max |logit| %.4f, max |diff| %.3g (%.3g of max) at position %lld\n",
                c.model.c_str(), c.variant.c_str(), vs_hf.max_ref, vs_hf.max_diff, vs_hf.max_diff / vs_hf.max_ref,
                static_cast<long long>(vs_hf.worst / V));
    EXPECT_LE(vs_hf.max_diff, 1e-4 * vs_hf.max_ref) << "worst at position " << vs_hf.worst / V;
    EXPECT_LE(vs_ref.max_diff, 1e-4 * vs_ref.max_ref) << "worst at position " << vs_ref.worst / V;
  } else {
    EXPECT_LE(vs_ref.max_diff, 1e-3 * vs_ref.max_ref) << "worst at position " << vs_ref.worst / V;
  }
}

TEST_P(CudaBackendGolden, GreedyTokensAndDecodeEqualsPrefill) {
  const Case& c = GetParam();
  const int64_t V = model_->hp.n_vocab;
  std::vector<int32_t> want;
  if (c.variant == "f32") {
    want = read_json(dir_ / "greedy.json").at("tokens").get<std::vector<int32_t>>();
  } else {  // the reference executor's greedy continuation on the same quantized file
    reference::ReferenceExecutor ex(*model_);
    std::vector<float> l = ex.forward(prompt_, false);
    for (int i = 0; i < 32; ++i) {
      want.push_back(sampling::argmax(std::span<const float>(l.data(), V)));
      const int32_t one[1] = {want.back()};
      l = ex.forward(one, false);
    }
  }
  std::vector<float> logits = run_step(*backend_, *model_, prompt_, true);
  std::vector<float> stepwise = logits;
  std::vector<int32_t> got;
  for (size_t i = 0; i < want.size(); ++i) {
    got.push_back(sampling::argmax(std::span<const float>(logits.data() + logits.size() - V, V)));
    logits = run_step(*backend_, *model_, {got.back()}, false);
    stepwise.insert(stepwise.end(), logits.begin(), logits.end());
  }
  EXPECT_EQ(got, want);

  std::vector<int32_t> all = prompt_;
  all.insert(all.end(), got.begin(), got.end());
  backend_->reset();
  EXPECT_EQ(backend_->n_past(), 0);
  const std::vector<float> once = run_step(*backend_, *model_, all, true);
  ASSERT_EQ(once.size(), stepwise.size());
  const Gap g = gap(stepwise, once);
  std::printf("[ %s %s ] greedy %zu tokens, %s; decode vs fresh prefill max |diff| %.3g\n", c.model.c_str(),
              c.variant.c_str(), got.size(), got == want ? "identical" : "DIFFERENT", g.max_diff);
  EXPECT_EQ(std::memcmp(once.data(), stepwise.data(), once.size() * 4), 0)
      << "decode after prefill differs from a fresh prefill (max |diff| " << g.max_diff << ")";
}

INSTANTIATE_TEST_SUITE_P(Models, CudaBackendGolden,
                         ::testing::Values(Case{"qwen3moe_odd", "f32"}, Case{"qwen3moe_k256", "f32"},
                                           Case{"qwen3moe_odd", "q8_0"}, Case{"qwen3moe_k256", "q8_0"},
                                           Case{"qwen3moe_k256", "kmix"}, Case{"qwen3next_odd", "f32"},
                                           Case{"qwen3next_k256", "f32"}, Case{"qwen3next_odd", "q8_0"},
                                           Case{"qwen3next_k256", "q8_0"}, Case{"qwen3next_k256", "kmix"}),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.model + "_" + i.param.variant; });

TEST(CudaBackend, RejectsBadInputWithoutCrashing) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const model::Model m = model::Model::load(golden_gguf("qwen3moe_odd", "f32"));
  auto b = gpu_worker::make_cuda_backend(m, 0, 4, 8);
  std::vector<float> x(static_cast<size_t>(8 * m.hp.n_embd));
  const int32_t bad[1] = {static_cast<int32_t>(m.hp.n_vocab)};
  EXPECT_THROW(b->embed(bad, 1, x.data()), std::invalid_argument);
  const int32_t ok[1] = {1};
  EXPECT_THROW(b->embed(ok, 5, x.data()), std::invalid_argument);  // more rows than max_tokens
  b->advance(7);  // one position left in the context of 8
  std::vector<float> h(x.size());
  EXPECT_THROW(b->mixer(0, x.data(), 2, h.data()), std::runtime_error);
}

}  // namespace
}  // namespace moraine
