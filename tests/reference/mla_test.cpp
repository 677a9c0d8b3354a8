// The reference's multi-head latent attention (deepseek2) on the tiny seeded files of
// tiny_arch_model.h, in both its forms: decode after prefill (and a chunk between) is
// bit-identical to one prefill; the cache is the latent and the rotary key per position, and
// rewind, save_state / load_state carry it (a saved sequence continues as if never left); the
// absorbed and the expanded form agree within float order. Agreement with llama.cpp itself is
// arch_llama_test's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "common/model/layer_state.h"
#include "common/model/model.h"
#include "common/model/sequence_state.h"
#include "common/reference/executor.h"
#include "tests/reference/tiny_arch_model.h"

namespace moraine::test {
namespace {

using reference::ExecutorOptions;
using reference::MlaForm;
using reference::ReferenceExecutor;

struct TinyFile {
  std::string path;
  model::Model m;
  explicit TinyFile(const std::string& variant) : path(write(variant)), m(model::Model::load(path)) {}
  ~TinyFile() { std::filesystem::remove(path); }
  static std::string write(const std::string& variant) {
    std::vector<std::vector<float>> data;
    const std::string p = (std::filesystem::temp_directory_path() / ("mla_test_" + variant + ".gguf")).string();
    tiny_writer(tiny_hparams("deepseek2:" + variant), 11, data).write(p);
    return p;
  }
};

std::vector<int32_t> tokens_from(int first, int n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) t[static_cast<size_t>(i)] = (first + 37 * i) % 320;
  return t;
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

ExecutorOptions with_form(MlaForm f) {
  ExecutorOptions o{2};
  o.mla_form = f;
  return o;
}

// (variant, form)
class Mla : public ::testing::TestWithParam<std::tuple<std::string, MlaForm>> {};

TEST_P(Mla, DecodeAfterPrefillEqualsFreshPrefill) {
  const auto [variant, form] = GetParam();
  TinyFile f(variant);
  ASSERT_EQ(f.m.layers[0].recipe.mixer.kind, model::MixerKind::Mla);
  const std::vector<int32_t> tokens = tokens_from(3, 13);
  ReferenceExecutor fresh(f.m, with_form(form));
  const std::vector<float> all = fresh.forward(tokens, true);
  ReferenceExecutor inc(f.m, with_form(form));
  std::vector<float> got = inc.forward(std::span(tokens).subspan(0, 5), true);
  const std::vector<float> chunk = inc.forward(std::span(tokens).subspan(5, 3), true);
  got.insert(got.end(), chunk.begin(), chunk.end());
  for (size_t i = 8; i < tokens.size(); ++i) {
    const std::vector<float> one = inc.forward(std::span(tokens).subspan(i, 1), false);
    got.insert(got.end(), one.begin(), one.end());
  }
  EXPECT_TRUE(bit_equal(got, all));
  // One kv row per position: [latent | rotary key], nothing per head.
  const model::MlaPart& p = f.m.layers[1].recipe.mixer.mla;
  const size_t per_layer = static_cast<size_t>(13 * (p.kv_lora_rank + p.rope_dim)) * sizeof(float);
  EXPECT_EQ(inc.state_bytes(), model::sequence_state_bytes(4 * f.m.hp.n_layer, f.m.hp.n_layer * per_layer));
  EXPECT_EQ(model::layer_state_bytes(f.m.hp, 1, 13, model::KvType::F32), per_layer);
}

TEST_P(Mla, RewindAndSavedStateCarryTheLatentCache) {
  const auto [variant, form] = GetParam();
  TinyFile f(variant);
  const std::vector<int32_t> prefix = tokens_from(5, 6), rejected = tokens_from(9, 4), next = tokens_from(1, 3);
  std::vector<int32_t> kept = prefix;
  kept.insert(kept.end(), rejected.begin(), rejected.begin() + 2);
  kept.insert(kept.end(), next.begin(), next.end());
  const int64_t V = f.m.hp.n_vocab;
  ReferenceExecutor fresh(f.m, with_form(form));
  const std::vector<float> all = fresh.forward(kept, true);
  const std::vector<float> want(all.end() - 3 * V, all.end());

  ReferenceExecutor ex(f.m, with_form(form));
  ex.forward(prefix, false);
  ex.snapshot();
  ex.forward(rejected, true);
  EXPECT_FALSE(ex.has_recurrent());
  ex.rewind(8);   // the prefix and the first 2 of the window stay
  // Saved here, another sequence run, loaded back: it goes on as the one never left.
  std::vector<uint8_t> saved(ex.state_bytes());
  ex.save_state(saved);
  ex.reset();
  ex.forward(tokens_from(2, 5), false);
  ex.load_state(saved);
  EXPECT_EQ(ex.n_past(), 8);
  EXPECT_TRUE(bit_equal(ex.forward(next, true), want));
  // A state cut short is refused.
  std::vector<uint8_t> cut(saved.begin(), saved.end() - 4);
  EXPECT_THROW(ex.load_state(cut), std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(Tiny, Mla,
                         ::testing::Combine(::testing::Values("lite", "kv_b", "v3"),
                                            ::testing::Values(MlaForm::Absorbed, MlaForm::Expanded)),
                         [](const ::testing::TestParamInfo<Mla::ParamType>& i) {
                           return std::get<0>(i.param) + (std::get<1>(i.param) == MlaForm::Absorbed ? "_absorbed" : "_expanded");
                         });

// The two forms compute the same attention: their logits differ by float order only (the bound
// of arch_llama_test's F32 agreement), and not at all between Auto and the layout's own form.
TEST(MlaForms, AbsorbedAndExpandedAgree) {
  for (const char* variant : {"lite", "kv_b", "v3"}) {
    SCOPED_TRACE(variant);
    TinyFile f(variant);
    const std::vector<int32_t> tokens = tokens_from(7, 12);
    ReferenceExecutor a(f.m, with_form(MlaForm::Absorbed)), e(f.m, with_form(MlaForm::Expanded)),
        aut(f.m, with_form(MlaForm::Auto));
    const std::vector<float> la = a.forward(tokens, true), le = e.forward(tokens, true), lu = aut.forward(tokens, true);
    EXPECT_TRUE(bit_equal(lu, f.m.layers[0].recipe.mixer.mla.split_kv_b ? la : le));
    double gap = 0, mx = 0;
    for (size_t i = 0; i < la.size(); ++i) {
      gap = std::max(gap, std::fabs(static_cast<double>(la[i]) - le[i]));
      mx = std::max(mx, std::fabs(static_cast<double>(le[i])));
    }
    std::printf("deepseek2:%s absorbed vs expanded: max|diff|/max|logit| %.3g\n", variant, gap / mx);
    EXPECT_GT(mx, 0.5);
    EXPECT_LE(gap / mx, 1e-4);
    EXPECT_FALSE(bit_equal(la, le)) << "the two forms ran the same arithmetic: one of them is not exercised";
  }
}

// An F16 cache rounds the latent and the rotary key as stored: the logits move, and decode after
// prefill still equals one prefill.
TEST(MlaF16Cache, RoundsTheLatentAndKeepsDecodeEqualToPrefill) {
  TinyFile f("v3");
  const std::vector<int32_t> tokens = tokens_from(4, 9);
  ExecutorOptions o{2};
  o.kv_type = model::KvType::F16;
  ReferenceExecutor half(f.m, o), full(f.m, {2}), inc(f.m, o);
  const std::vector<float> lh = half.forward(tokens, true);
  EXPECT_FALSE(bit_equal(lh, full.forward(tokens, true)));
  std::vector<float> got = inc.forward(std::span(tokens).subspan(0, 4), true);
  for (size_t i = 4; i < tokens.size(); ++i) {
    const std::vector<float> one = inc.forward(std::span(tokens).subspan(i, 1), false);
    got.insert(got.end(), one.begin(), one.end());
  }
  EXPECT_TRUE(bit_equal(got, lh));
}

}  // namespace
}  // namespace moraine::test
