// Reference executor self-consistency on tiny random models: decode after prefill (and chunked
// prefill) is bit-identical to one fresh prefill; results do not depend on the thread count;
// the legacy fused ssm_in layout computes what the split attn_qkv/attn_gate layout computes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "common/model/model.h"
#include "common/reference/executor.h"
#include "synthetic_model.h"

namespace moraine::testing {
namespace {

using reference::ReferenceExecutor;

struct TempFile {
  std::string path;
  explicit TempFile(const std::string& stem) : path(temp_path(stem)) {}
  ~TempFile() { std::filesystem::remove(path); }
};

std::vector<int32_t> random_tokens(uint64_t seed, int n, int64_t vocab) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return t;
}

// Bitwise equality of two float arrays, reporting the first difference.
::testing::AssertionResult bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], 4) != 0) {
      return ::testing::AssertionFailure() << "index " << i << ": " << a[i] << " vs " << b[i];
    }
  }
  return ::testing::AssertionSuccess();
}

struct Variant {
  const char* name;
  SyntheticSpec spec;
};

std::vector<Variant> variants() {
  std::vector<Variant> v;
  SyntheticSpec moe;
  moe.seed = 101;
  v.push_back({"qwen3moe_f32", moe});
  SyntheticSpec moe_q = moe;
  moe_q.matrix_type = TensorType::Q8_0;
  moe_q.seed = 102;
  v.push_back({"qwen3moe_q8_0", moe_q});
  SyntheticSpec next;
  next.arch = "qwen3next";
  next.n_layer = 4;
  next.n_rot = 4;
  next.seed = 103;
  v.push_back({"qwen3next_f32", next});
  SyntheticSpec next_q = next;
  next_q.n_embd = 256;  // one Q4_K super-block per row
  next_q.matrix_type = TensorType::Q4_K;
  next_q.seed = 104;
  v.push_back({"qwen3next_q4_k", next_q});
  return v;
}

class ExecutorConsistency : public ::testing::TestWithParam<size_t> {};

TEST_P(ExecutorConsistency, DecodeAfterPrefillEqualsFreshPrefill) {
  const Variant var = variants()[GetParam()];
  SCOPED_TRACE(var.name);
  SyntheticModel sm(var.spec);
  TempFile f(var.name);
  sm.write(f.path);
  const model::Model m = model::Model::load(f.path);
  const int n = 13;
  const auto tokens = random_tokens(var.spec.seed, n, m.hp.n_vocab);
  const int64_t V = m.hp.n_vocab;

  ReferenceExecutor fresh(m, {2});
  const std::vector<float> all = fresh.forward(tokens, true);
  ASSERT_EQ(all.size(), static_cast<size_t>(n * V));
  for (float x : all) ASSERT_TRUE(std::isfinite(x));
  // The logits must depend on the input: positions differ.
  EXPECT_FALSE(bit_equal(std::vector<float>(all.begin(), all.begin() + V),
                         std::vector<float>(all.begin() + V, all.begin() + 2 * V)));

  // Prefill 5, then a chunk of 3, then decode one at a time.
  ReferenceExecutor inc(m, {2});
  std::vector<float> got = inc.forward(std::span(tokens).subspan(0, 5), true);
  std::vector<float> chunk = inc.forward(std::span(tokens).subspan(5, 3), true);
  got.insert(got.end(), chunk.begin(), chunk.end());
  for (int i = 8; i < n; ++i) {
    std::vector<float> one = inc.forward(std::span(tokens).subspan(i, 1), false);
    got.insert(got.end(), one.begin(), one.end());
  }
  EXPECT_EQ(inc.n_past(), n);
  EXPECT_TRUE(bit_equal(got, all));

  // Last-position-only logits are the last row of the full set.
  ReferenceExecutor last_only(m, {1});
  EXPECT_TRUE(bit_equal(last_only.forward(tokens, false),
                        std::vector<float>(all.end() - V, all.end())));

  // reset() forgets everything.
  inc.reset();
  EXPECT_TRUE(bit_equal(inc.forward(tokens, true), all));
}

// Speculation's rejected drafts: a window of 4 tokens after a snapshot, then a rewind. Attention
// caches drop positions anywhere: keep 2 of the window, and the next tokens' logits are a fresh
// prefill's of the kept sequence. A model with DeltaNet layers rewinds only to the snapshot (its
// state comes back; anywhere else throws and keeps the state): then the kept tokens go in again.
TEST_P(ExecutorConsistency, RewindDropsRejectedPositions) {
  const Variant var = variants()[GetParam()];
  SCOPED_TRACE(var.name);
  SyntheticModel sm(var.spec);
  TempFile f(var.name);
  sm.write(f.path);
  const model::Model m = model::Model::load(f.path);
  const auto prefix = random_tokens(var.spec.seed + 11, 6, m.hp.n_vocab);
  const auto rejected = random_tokens(var.spec.seed + 12, 4, m.hp.n_vocab);
  const auto next = random_tokens(var.spec.seed + 13, 3, m.hp.n_vocab);
  std::vector<int32_t> kept = prefix;
  kept.insert(kept.end(), rejected.begin(), rejected.begin() + 2);
  kept.insert(kept.end(), next.begin(), next.end());
  ReferenceExecutor fresh(m, {2});
  const std::vector<float> all = fresh.forward(kept, true);
  const int64_t V = m.hp.n_vocab;

  ReferenceExecutor ex(m, {2});
  EXPECT_THROW(ex.rewind(1), std::logic_error);   // nothing cached
  ex.forward(prefix, false);
  ex.snapshot();
  ex.forward(rejected, true);
  ASSERT_EQ(ex.n_past(), 10);
  EXPECT_THROW(ex.rewind(11), std::logic_error);   // more than is cached
  EXPECT_EQ(ex.has_recurrent(), var.spec.arch == "qwen3next");
  std::vector<float> got;
  if (!ex.has_recurrent()) {
    ex.rewind(8);   // prefix + the first 2 window tokens stay
    EXPECT_EQ(ex.n_past(), 8);
    got = ex.forward(next, true);
  } else {
    EXPECT_THROW(ex.rewind(8), std::logic_error);   // not the snapshot's position
    EXPECT_EQ(ex.n_past(), 10);
    ex.rewind(6);
    EXPECT_EQ(ex.n_past(), 6);
    std::vector<float> again = ex.forward(std::span(kept).subspan(6), true);
    got.assign(again.end() - 3 * V, again.end());
  }
  EXPECT_TRUE(bit_equal(got, std::vector<float>(all.end() - 3 * V, all.end())));
}

// The conversation cache: a sequence saved, another one run, the first loaded back: its next
// tokens' logits are those of the sequence never interrupted. A state of another model's shape
// or cut short is refused, and the cached sequence stays as it was.
TEST_P(ExecutorConsistency, SavedSequenceContinuesAsIfNeverLeft) {
  const Variant var = variants()[GetParam()];
  SCOPED_TRACE(var.name);
  SyntheticModel sm(var.spec);
  TempFile f(var.name);
  sm.write(f.path);
  const model::Model m = model::Model::load(f.path);
  const auto first = random_tokens(var.spec.seed + 21, 7, m.hp.n_vocab);
  const auto other = random_tokens(var.spec.seed + 22, 5, m.hp.n_vocab);
  const auto next = random_tokens(var.spec.seed + 23, 3, m.hp.n_vocab);
  ReferenceExecutor straight(m, {2});
  straight.forward(first, false);
  const std::vector<float> want = straight.forward(next, true);

  ReferenceExecutor ex(m, {2});
  ex.forward(first, false);
  std::vector<uint8_t> saved(ex.state_bytes());
  ex.save_state(saved);
  EXPECT_THROW(ex.save_state(std::span<uint8_t>(saved.data(), saved.size() - 1)), std::length_error);
  ex.reset();
  ex.forward(other, false);
  std::vector<uint8_t> cut(saved.begin(), saved.end() - 4);
  EXPECT_THROW(ex.load_state(cut), std::invalid_argument);
  EXPECT_EQ(ex.n_past(), 5) << "a refused state must leave the cached sequence alone";
  ex.load_state(saved);
  EXPECT_EQ(ex.n_past(), 7);
  EXPECT_TRUE(bit_equal(ex.forward(next, true), want));
}

TEST_P(ExecutorConsistency, ThreadCountDoesNotChangeResults) {
  const Variant var = variants()[GetParam()];
  SCOPED_TRACE(var.name);
  SyntheticModel sm(var.spec);
  TempFile f(var.name);
  sm.write(f.path);
  const model::Model m = model::Model::load(f.path);
  const auto tokens = random_tokens(var.spec.seed + 7, 9, m.hp.n_vocab);
  // min_parallel_work 0: every job is split, even on these tiny shapes.
  ReferenceExecutor one(m, {1, 0}), three(m, {3, 0});
  EXPECT_TRUE(bit_equal(one.forward(tokens, true), three.forward(tokens, true)));
}

INSTANTIATE_TEST_SUITE_P(Tiny, ExecutorConsistency, ::testing::Range<size_t>(0, 4),
                         [](const ::testing::TestParamInfo<size_t>& i) {
                           return std::string(variants()[i.param].name);
                         });

TEST(Executor, RejectsOutOfVocabularyTokenAndKeepsState) {
  SyntheticModel sm(SyntheticSpec{});
  TempFile f("oov");
  sm.write(f.path);
  const model::Model m = model::Model::load(f.path);
  ReferenceExecutor ex(m, {1});
  const std::vector<int32_t> ok = {1, 2, 3};
  ex.forward(ok, false);
  const std::vector<int32_t> bad = {4, static_cast<int32_t>(m.hp.n_vocab)};
  try {
    ex.forward(bad, false);
    FAIL() << "no error for token id n_vocab";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("position 4"), std::string::npos) << e.what();
  }
  EXPECT_EQ(ex.n_past(), 3);
}

// Re-packs a split-layout qwen3next file into the legacy fused ssm_in layout (per key head:
// [q | k | v group | z group]) and checks both files give the same logits.
TEST(Executor, LegacySsmInLayoutMatchesSplitLayout) {
  SyntheticSpec s;
  s.arch = "qwen3next";
  s.n_layer = 2;
  s.n_rot = 4;
  s.seed = 105;
  SyntheticModel sm(s);
  TempFile split("split"), legacy("legacy");
  sm.write(split.path);
  const gguf::GgufFile src = gguf::GgufFile::open(split.path);

  gguf::GgufWriter w;
  for (const auto& [k, v] : src.metadata()) {
    if (k.rfind("general.alignment", 0) != 0) w.set(k, v);
  }
  const int64_t E = s.n_embd, dk = s.ssm_head_dim, dv = s.ssm_head_dim;
  const int64_t nk = s.ssm_k_heads, nv = s.ssm_v_heads, r = nv / nk;
  const int64_t key_dim = nk * dk, v_dim = nv * dv;
  std::vector<std::vector<float>> keep;
  for (const gguf::TensorInfo& t : src.tensors()) {
    if (t.name.ends_with("attn_gate.weight")) continue;
    if (t.name.ends_with("attn_qkv.weight")) {
      const std::string layer = t.name.substr(0, t.name.size() - std::string("attn_qkv.weight").size());
      const gguf::TensorInfo* z = src.find_tensor(layer + "attn_gate.weight");
      ASSERT_NE(z, nullptr);
      const float* qkv = reinterpret_cast<const float*>(t.data);
      const float* zz = reinterpret_cast<const float*>(z->data);
      std::vector<float> fused;
      auto rows = [&](const float* base, int64_t first, int64_t count) {
        fused.insert(fused.end(), base + first * E, base + (first + count) * E);
      };
      for (int64_t g = 0; g < nk; ++g) {
        rows(qkv, g * dk, dk);                        // q of group g
        rows(qkv, key_dim + g * dk, dk);              // k of group g
        rows(qkv, 2 * key_dim + g * r * dv, r * dv);  // v heads of group g
        rows(zz, g * r * dv, r * dv);                 // z heads of group g
      }
      keep.push_back(std::move(fused));
      w.add_tensor(layer + "ssm_in.weight", {E, 2 * key_dim + 2 * v_dim}, TensorType::F32,
                   keep.back().data(), keep.back().size() * 4);
      continue;
    }
    w.add_tensor(t.name, t.shape, t.type, t.data, t.n_bytes);
  }
  w.write(legacy.path);

  const model::Model a = model::Model::load(split.path);
  const model::Model b = model::Model::load(legacy.path);
  ASSERT_FALSE(b.layers[0].delta.qkv);
  ASSERT_TRUE(b.layers[0].delta.qkvz);
  const auto tokens = random_tokens(55, 7, a.hp.n_vocab);
  ReferenceExecutor ea(a, {1}), eb(b, {1});
  EXPECT_TRUE(bit_equal(ea.forward(tokens, true), eb.forward(tokens, true)));
}

}  // namespace
}  // namespace moraine::testing
