// The reference executor's MTP head (executor.h, mtp_forward) against tools/train/model.py, our torch
// Qwen3-Next whose trunk matches transformers: tests/reference/data/qwen3next_mtp is a tiny random
// model with one MTP layer and model.py's float32 logits and MTP logits of a prompt
// (tools/train/mtp_oracle.py). Converted by moraine-convert to F32, the trunk's and the MTP head's
// logits match within 1e-4 of max |logit| (the golden tests' bound), and the MTP cache behaves as
// the trunk's: slot by slot is bit-identical to one batch, a rewind then the same slots again too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/reference/executor.h"
#include "synthetic_model.h"
#include "tests/support/shell.h"

namespace moraine::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using reference::ReferenceExecutor;

const fs::path kDir = fs::path(MORAINE_SOURCE_DIR) / "tests" / "reference" / "data" / "qwen3next_mtp";
const fs::path kConvert = fs::path(MORAINE_BUILD_DIR) / "tools" / "moraine-convert";

std::vector<float> read_f32(const fs::path& p, size_t n) {
  std::vector<float> v(n);
  std::ifstream f(p, std::ios::binary);
  if (!f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(float))))
    throw std::runtime_error("cannot read " + std::to_string(n) + " floats from " + p.string());
  return v;
}

// max |got - want| / max |want|
double relative_gap(const std::vector<float>& got, const std::vector<float>& want) {
  double max_ref = 0, max_diff = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    max_ref = std::max(max_ref, std::fabs(double(want[i])));
    max_diff = std::max(max_diff, std::fabs(double(got[i]) - want[i]));
  }
  return max_diff / max_ref;
}

class Mtp : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs::exists(kConvert)) << "build moraine-convert first: " << kConvert;
    gguf_ = temp_path("mtp-oracle");
    auto [rc, out] = test_support::run_command(test_support::quoted(kConvert) + " " + test_support::quoted(kDir) + " " +
                                               test_support::quoted(gguf_) + " --outtype f32");
    ASSERT_EQ(rc, 0) << "moraine-convert failed on " << kDir << ":\n" << out;
    model_ = std::make_unique<model::Model>(model::Model::load(gguf_));
    std::ifstream f(kDir / "oracle.json");
    meta_ = json::parse(f);
    tokens_ = meta_.at("tokens").get<std::vector<int32_t>>();
  }
  void TearDown() override {
    model_.reset();
    if (!gguf_.empty()) fs::remove(gguf_);
  }
  std::string gguf_;
  std::unique_ptr<model::Model> model_;
  json meta_;
  std::vector<int32_t> tokens_;
};

TEST_F(Mtp, LogitsMatchTorchAtEverySlot) {
  ASSERT_EQ(model_->hp.n_nextn, 1);
  ASSERT_EQ(model_->nextn.size(), 1u);
  const int64_t T = static_cast<int64_t>(tokens_.size()), V = model_->hp.n_vocab, d = model_->hp.n_embd;
  ASSERT_EQ(meta_.at("mtp_logits_shape")[0].get<int64_t>(), T - 1);
  ASSERT_EQ(meta_.at("mtp_logits_shape")[1].get<int64_t>(), V);
  ReferenceExecutor ex(*model_);
  ASSERT_TRUE(ex.has_mtp());
  std::vector<float> hidden;
  const std::vector<float> logits = ex.forward(tokens_, true, &hidden);
  ASSERT_EQ(hidden.size(), static_cast<size_t>(T * d));
  const double trunk_gap = relative_gap(logits, read_f32(kDir / "logits.f32", static_cast<size_t>(T * V)));
  // Slot i: the hidden row of position i and token i + 1.
  std::vector<float> mtp(static_cast<size_t>((T - 1) * V));
  ex.mtp_forward(hidden.data(), std::span<const int32_t>(tokens_).subspan(1), T - 1, mtp.data(), nullptr);
  EXPECT_EQ(ex.mtp_n_past(), T - 1);
  const std::vector<float> want = read_f32(kDir / "mtp_logits.f32", static_cast<size_t>((T - 1) * V));
  const double mtp_gap = relative_gap(mtp, want);
  std::printf("[ mtp ] trunk logits %.3g of max |logit|, MTP logits %.3g of max |logit| (%.4f)\n", trunk_gap, mtp_gap,
              meta_.at("mtp_logits_max_abs").get<double>());
  EXPECT_LE(trunk_gap, 1e-4);
  EXPECT_LE(mtp_gap, 1e-4);
  const std::vector<int64_t> argmax = meta_.at("mtp_argmax").get<std::vector<int64_t>>();
  for (int64_t i = 0; i < T - 1; ++i) {
    const float* row = mtp.data() + i * V;
    EXPECT_EQ(std::max_element(row, row + V) - row, argmax[static_cast<size_t>(i)]) << "slot " << i;
  }
}

TEST_F(Mtp, SlotBySlotEqualsOneBatchAndRewindRepeats) {
  const int64_t T = static_cast<int64_t>(tokens_.size()), V = model_->hp.n_vocab, d = model_->hp.n_embd;
  ReferenceExecutor ex(*model_);
  std::vector<float> hidden;
  ex.forward(tokens_, true, &hidden);
  std::vector<float> batch(static_cast<size_t>((T - 1) * V));
  ex.mtp_forward(hidden.data(), std::span<const int32_t>(tokens_).subspan(1), T - 1, batch.data(), nullptr);
  ex.mtp_rewind(0);
  std::vector<float> one(static_cast<size_t>(V)), out_h(static_cast<size_t>(d));
  const int64_t keep = T / 2;
  for (int pass = 0; pass < 2; ++pass) {   // the second pass after rewinding to `keep` slots
    for (int64_t i = pass == 0 ? 0 : keep; i < T - 1; ++i) {
      ex.mtp_forward(hidden.data() + i * d, std::span<const int32_t>(tokens_).subspan(static_cast<size_t>(i + 1), 1), 1,
                     one.data(), out_h.data());
      ASSERT_EQ(std::memcmp(one.data(), batch.data() + i * V, V * sizeof(float)), 0) << "pass " << pass << " slot " << i;
    }
    ex.mtp_rewind(keep);
  }
  EXPECT_THROW(ex.mtp_rewind(keep + 1), std::logic_error);
  const int32_t bad = static_cast<int32_t>(V);
  EXPECT_THROW(ex.mtp_forward(hidden.data(), std::span<const int32_t>(&bad, 1), 1, one.data(), nullptr), std::invalid_argument);
}

TEST(MtpMissing, ModelWithoutNextnRefuses) {
  const std::string path = temp_path("mtp-none");
  SyntheticModel({.arch = "qwen3next"}).write(path);
  {
    const model::Model m = model::Model::load(path);
    ReferenceExecutor ex(m);
    EXPECT_FALSE(ex.has_mtp());
    std::vector<float> h(static_cast<size_t>(m.hp.n_embd)), l(static_cast<size_t>(m.hp.n_vocab));
    const int32_t t = 1;
    EXPECT_THROW(ex.mtp_forward(h.data(), std::span<const int32_t>(&t, 1), 1, l.data(), nullptr), std::logic_error);
  }
  fs::remove(path);
}

}  // namespace
}  // namespace moraine::testing
