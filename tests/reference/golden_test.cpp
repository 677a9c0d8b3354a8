// The reference executor against Hugging Face transformers on the tiny random checkpoints of
// tests/golden/: each is converted by moraine-convert to an F32 GGUF, then
//  - logits at every prompt position match transformers' (max |diff| <= 1e-4 * max |logit|),
//  - the 32-token greedy continuation is identical,
//  - decoding token by token gives bit-identical logits to one prefill of the same tokens,
//  - moraine-run (--tokens --logits-out --json) writes exactly the executor's numbers.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/reference/executor.h"
#include "common/reference/npy.h"
#include "common/sampling/sampler.h"
#include "synthetic_model.h"
#include "tests/support/shell.h"

namespace moraine::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using reference::ReferenceExecutor;
using test_support::run_command;

const fs::path kGolden = fs::path(MORAINE_SOURCE_DIR) / "tests" / "golden";
const fs::path kConvert = fs::path(MORAINE_BUILD_DIR) / "tools" / "moraine-convert";
const fs::path kRun = fs::path(MORAINE_BUILD_DIR) / "tools" / "moraine-run";

json read_json(const fs::path& p) {
  std::ifstream f(p);
  if (!f) throw std::runtime_error("cannot read " + p.string());
  return json::parse(f);
}

std::vector<std::string> golden_models() {
  try {
    std::vector<std::string> names;
    const json manifest = read_json(kGolden / "manifest.json");  // must outlive the loop
    for (const auto& item : manifest.at("models").items()) names.push_back(item.key());
    return names;
  } catch (const std::exception&) {
    return {"manifest_missing"};  // the test then fails and says why
  }
}



class Golden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = kGolden / GetParam();
    ASSERT_TRUE(fs::exists(kGolden / "manifest.json"))
        << "golden fixtures missing: " << kGolden << " (made by tests/golden/make_golden.py)";
    ASSERT_TRUE(fs::exists(kConvert)) << "build moraine-convert first: " << kConvert;
    gguf_ = temp_path("golden-" + GetParam());
    auto [rc, out] = run_command(test_support::quoted(kConvert) + " " + test_support::quoted(dir_) + " " + test_support::quoted(gguf_) + " --outtype f32");
    ASSERT_EQ(rc, 0) << "moraine-convert failed on " << dir_ << ":\n" << out;
    model_ = std::make_unique<model::Model>(model::Model::load(gguf_));
    prompt_ = read_json(dir_ / "tokens.json").at("ids").get<std::vector<int32_t>>();
  }
  void TearDown() override {
    model_.reset();
    if (!gguf_.empty()) fs::remove(gguf_);
  }

  fs::path dir_;
  std::string gguf_;
  std::unique_ptr<model::Model> model_;
  std::vector<int32_t> prompt_;
};

TEST_P(Golden, LogitsMatchTransformersAtEveryPosition) {
  const json meta = read_json(dir_ / "logits.json");
  const int64_t P = meta.at("shape")[0], V = meta.at("shape")[1];
  ASSERT_EQ(P, static_cast<int64_t>(prompt_.size()));
  ASSERT_EQ(V, model_->hp.n_vocab);
  std::vector<float> want(P * V);
  std::ifstream f(dir_ / "logits.f32", std::ios::binary);
  ASSERT_TRUE(f.read(reinterpret_cast<char*>(want.data()), static_cast<std::streamsize>(want.size() * 4)));

  ReferenceExecutor ex(*model_);
  const std::vector<float> got = ex.forward(prompt_, true);
  ASSERT_EQ(got.size(), want.size());
  double max_ref = 0, max_diff = 0;
  int64_t worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    max_ref = std::max(max_ref, std::fabs(double(want[i])));
    const double d = std::fabs(double(got[i]) - want[i]);
    if (d > max_diff) max_diff = d, worst = static_cast<int64_t>(i);
  }
  RecordProperty("max_abs_diff", std::to_string(max_diff));
  std::printf("[ %s ] max |logit| %.4f, max |diff| %.3g (%.3g of max), at position %lld\n",
              GetParam().c_str(), max_ref, max_diff, max_diff / max_ref,
              static_cast<long long>(worst / V));
  EXPECT_LE(max_diff, 1e-4 * max_ref) << "worst at position " << worst / V << " token " << worst % V;
}

TEST_P(Golden, GreedyContinuationIdenticalAndDecodeEqualsPrefill) {
  const std::vector<int32_t> want = read_json(dir_ / "greedy.json").at("tokens").get<std::vector<int32_t>>();
  ReferenceExecutor ex(*model_);
  const int64_t V = model_->hp.n_vocab;
  std::vector<float> logits = ex.forward(prompt_, true);
  std::vector<float> stepwise = logits;
  std::vector<int32_t> got;
  for (size_t i = 0; i < want.size(); ++i) {
    got.push_back(sampling::argmax(std::span<const float>(logits.data() + logits.size() - V, V)));
    const int32_t one[1] = {got.back()};
    logits = ex.forward(one, false);
    stepwise.insert(stepwise.end(), logits.begin(), logits.end());
  }
  EXPECT_EQ(got, want);

  // Decode after prefill == one fresh prefill of the whole sequence, bit for bit.
  std::vector<int32_t> all = prompt_;
  all.insert(all.end(), got.begin(), got.end());
  ReferenceExecutor fresh(*model_);
  const std::vector<float> once = fresh.forward(all, true);
  ASSERT_EQ(once.size(), stepwise.size());
  EXPECT_EQ(std::memcmp(once.data(), stepwise.data(), once.size() * 4), 0)
      << "decode after prefill differs from a fresh prefill";
}

TEST_P(Golden, RunToolWritesTheExecutorsLogits) {
  ASSERT_TRUE(fs::exists(kRun)) << "build moraine-run first: " << kRun;
  const std::string npy = temp_path("golden-logits") + ".npy";
  std::string ids;
  for (int32_t t : prompt_) {
    if (!ids.empty()) ids += ',';
    ids += std::to_string(t);
  }
  auto [rc, out] = run_command(test_support::quoted(kRun) + " -m " + test_support::quoted(gguf_) + " --tokens " + ids +
                               " -n 5 --ignore-eos --json --threads 2 --logits-out " + test_support::quoted(npy));
  ASSERT_EQ(rc, 0) << out;
  const json j = json::parse(out.substr(out.find('{')));
  const auto gen = j.at("generated_ids").get<std::vector<int32_t>>();
  ASSERT_EQ(gen.size(), 5u);
  EXPECT_GT(j.at("prefill_tok_s").get<double>(), 0.0);
  EXPECT_GT(j.at("decode_tok_s").get<double>(), 0.0);

  const reference::NpyF32 arr = reference::read_npy_f32(npy);
  fs::remove(npy);
  std::vector<int32_t> all = prompt_;
  all.insert(all.end(), gen.begin(), gen.end());
  ReferenceExecutor ex(*model_);
  const std::vector<float> want = ex.forward(all, true);
  ASSERT_EQ(arr.rows, static_cast<int64_t>(all.size()));
  ASSERT_EQ(arr.cols, model_->hp.n_vocab);
  EXPECT_EQ(std::memcmp(arr.data.data(), want.data(), want.size() * 4), 0);
}

INSTANTIATE_TEST_SUITE_P(Models, Golden, ::testing::ValuesIn(golden_models()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace moraine::testing
