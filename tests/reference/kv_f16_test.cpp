// The reference executor's F16 KV cache (ExecutorOptions::kv_type, common/model/kv_type.h) on the
// golden checkpoints of tests/golden/ (converted to F32 GGUFs by moraine-convert):
//  - the option acts: the logits at every prompt position differ from the F32 cache's;
//  - they stay close, within a bound derived from the model itself: the F16 rounding changes each
//    K and V element by at most 2^-11 of itself (normal halves; below 6.1e-5 by at most 2^-25
//    absolute), so the logits' response to the cache changed by exactly +-2^-11 of every element
//    (random signs, ExecutorOptions::kv_perturb_seed) bounds the response to the rounding, whose
//    changes are as large only at a rounding's worst case and 1/4 as large on average. G = the
//    largest gap max |a - b| / max |b| over kProbes such sign draws; the F16 gap must be at most
//    kProbeFactor * G (2, as tests/reference/float_order_bound.h: the rounding is one more draw,
//    and the probes sample signs, they do not take the worst);
//  - decoding token by token gives bit-identical logits to one prefill of the same tokens with the
//    F16 cache too (each element is rounded the same way whichever step stores it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/reference/executor.h"
#include "common/sampling/sampler.h"
#include "synthetic_model.h"
#include "tests/support/shell.h"

namespace moraine::testing {
namespace {

namespace fs = std::filesystem;
using reference::ExecutorOptions;
using reference::ReferenceExecutor;

const fs::path kGolden = fs::path(MORAINE_SOURCE_DIR) / "tests" / "golden";
const fs::path kConvert = fs::path(MORAINE_BUILD_DIR) / "tools" / "moraine-convert";
constexpr int kProbes = 8;
constexpr double kProbeFactor = 2.0;

nlohmann::json read_json(const fs::path& p) {
  std::ifstream f(p);
  if (!f) throw std::runtime_error("cannot read " + p.string());
  return nlohmann::json::parse(f);
}

std::vector<std::string> golden_models() {
  try {
    std::vector<std::string> names;
    const nlohmann::json manifest = read_json(kGolden / "manifest.json");
    for (const auto& item : manifest.at("models").items()) names.push_back(item.key());
    return names;
  } catch (const std::exception&) {
    return {"manifest_missing"};  // the test then fails and says why
  }
}

// max |got - want| / max |want|
double rel_gap(const std::vector<float>& got, const std::vector<float>& want) {
  double max_ref = 0, max_diff = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    max_ref = std::max(max_ref, std::fabs(double(want[i])));
    max_diff = std::max(max_diff, std::isfinite(got[i]) ? std::fabs(double(got[i]) - want[i]) : INFINITY);
  }
  return max_diff / max_ref;
}

class KvF16 : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const fs::path dir = kGolden / GetParam();
    ASSERT_TRUE(fs::exists(kGolden / "manifest.json"))
        << "golden fixtures missing: " << kGolden << " (made by tests/golden/make_golden.py)";
    ASSERT_TRUE(fs::exists(kConvert)) << "build moraine-convert first: " << kConvert;
    gguf_ = temp_path("kv-f16-" + GetParam());
    auto [rc, out] = test_support::run_command(test_support::quoted(kConvert) + " " + test_support::quoted(dir) + " " +
                                               test_support::quoted(gguf_) + " --outtype f32");
    ASSERT_EQ(rc, 0) << "moraine-convert failed on " << dir << ":\n" << out;
    model_ = std::make_unique<model::Model>(model::Model::load(gguf_));
    prompt_ = read_json(dir / "tokens.json").at("ids").get<std::vector<int32_t>>();
  }
  void TearDown() override {
    model_.reset();
    if (!gguf_.empty()) fs::remove(gguf_);
  }
  std::vector<float> prefill(const ExecutorOptions& o) { return ReferenceExecutor(*model_, o).forward(prompt_, true); }

  std::string gguf_;
  std::unique_ptr<model::Model> model_;
  std::vector<int32_t> prompt_;
};

TEST_P(KvF16, LogitsDifferFromF32WithinTheCacheChangeBound) {
  const std::vector<float> f32 = prefill({});
  ExecutorOptions half_cache;
  half_cache.kv_type = model::KvType::F16;
  const std::vector<float> f16 = prefill(half_cache);
  EXPECT_GT(rel_gap(f16, f32), 0.0) << "the F16 cache gave the F32 cache's logits: the option did nothing";
  double probe_gap = 0;
  for (int s = 1; s <= kProbes; ++s) {
    ExecutorOptions probe;
    probe.kv_perturb_seed = static_cast<uint64_t>(s);
    probe_gap = std::max(probe_gap, rel_gap(prefill(probe), f32));
  }
  const double gap = rel_gap(f16, f32);
  std::printf("[ %s ] F16 KV vs F32 KV: %.3g of max |logit|; +-2^-11 cache probes: largest %.3g (bound %.3g)\n",
              GetParam().c_str(), gap, probe_gap, kProbeFactor * probe_gap);
  EXPECT_LE(gap, kProbeFactor * probe_gap);
}

TEST_P(KvF16, DecodeEqualsPrefill) {
  ExecutorOptions o;
  o.kv_type = model::KvType::F16;
  ReferenceExecutor step(*model_, o);
  const int64_t V = model_->hp.n_vocab;
  std::vector<float> l = step.forward(prompt_, true);
  std::vector<float> stepwise = l;
  std::vector<int32_t> all = prompt_;
  for (int i = 0; i < 8; ++i) {
    all.push_back(sampling::argmax(std::span<const float>(l.data() + l.size() - V, V)));
    l = step.forward(std::span<const int32_t>(&all.back(), 1), false);
    stepwise.insert(stepwise.end(), l.begin(), l.end());
  }
  const std::vector<float> once = ReferenceExecutor(*model_, o).forward(all, true);
  ASSERT_EQ(once.size(), stepwise.size());
  EXPECT_EQ(std::memcmp(once.data(), stepwise.data(), once.size() * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(Models, KvF16, ::testing::ValuesIn(golden_models()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace moraine::testing
