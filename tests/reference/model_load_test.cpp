// Loading binds every tensor with the shape the metadata implies, and refuses files whose
// metadata and tensors disagree, naming the tensor (and both shapes where there are two).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "common/model/model.h"
#include "common/model/model_error.h"
#include "synthetic_model.h"

namespace moraine::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using model::Model;
using model::ModelError;

struct TempFile {
  std::string path;
  explicit TempFile(const std::string& stem) : path(temp_path(stem)) {}
  ~TempFile() { std::filesystem::remove(path); }
};

std::string load_error(SyntheticModel& sm) {
  TempFile f("bad");
  sm.write(f.path);
  try {
    Model::load(f.path);
  } catch (const ModelError& e) {
    return e.what();
  }
  return "(loaded without error)";
}

TEST(ModelLoad, Qwen3MoeHyperParametersAndBinding) {
  SyntheticSpec s;
  s.n_layer = 3;
  SyntheticModel sm(s);
  TempFile f("moe");
  sm.write(f.path);
  Model m = Model::load(f.path);
  EXPECT_EQ(m.hp.arch, model::Arch::Qwen3Moe);
  EXPECT_EQ(m.hp.n_layer, 3);
  EXPECT_EQ(m.hp.n_vocab, s.n_vocab);
  EXPECT_EQ(m.hp.head_dim, s.head_dim);
  EXPECT_EQ(m.hp.n_expert, s.n_expert);
  EXPECT_TRUE(m.hp.norm_topk_prob);
  ASSERT_EQ(m.layers.size(), 3u);
  EXPECT_EQ(m.layers[2].moe.down.expert(5).n_rows, s.n_embd);
  EXPECT_EQ(m.layers[2].moe.down.expert(5).data,
            m.layers[2].moe.down.all.data + 5 * s.n_embd * s.n_ff_exp * 4);
  EXPECT_FALSE(m.layers[0].attn.q_has_gate);
}

TEST(ModelLoad, Qwen3NextLayerPatternAndNextn) {
  SyntheticSpec s;
  s.arch = "qwen3next";
  s.n_layer = 4;
  s.n_rot = 4;
  s.n_nextn = 1;
  SyntheticModel sm(s);
  TempFile f("next");
  sm.write(f.path);
  Model m = Model::load(f.path);
  EXPECT_EQ(m.hp.n_layer, 4);
  EXPECT_EQ(m.hp.n_nextn, 1);
  ASSERT_EQ(m.layers.size(), 4u);
  EXPECT_TRUE(m.layers[0].recurrent);
  EXPECT_FALSE(m.layers[1].recurrent);
  EXPECT_TRUE(m.layers[2].recurrent);
  EXPECT_FALSE(m.layers[3].recurrent);
  EXPECT_TRUE(m.layers[1].attn.q_has_gate);
  EXPECT_EQ(m.hp.ssm_conv_dim(), 2 * 2 * 16 + 4 * 16);
  ASSERT_EQ(m.nextn.size(), 1u);
  EXPECT_EQ(m.nextn[0].eh_proj.n_cols, 2 * s.n_embd);
  EXPECT_EQ(m.nextn[0].shared_head_norm.size(), static_cast<size_t>(s.n_embd));
  EXPECT_FALSE(m.nextn[0].embed_tokens);
}

TEST(ModelLoad, RefusesMissingTensor) {
  SyntheticModel sm(SyntheticSpec{});
  sm.drop("blk.1.attn_k.weight");
  EXPECT_THAT(load_error(sm), AllOf(HasSubstr("blk.1.attn_k.weight"), HasSubstr("missing"),
                                    HasSubstr("[64, 32]")));
}

TEST(ModelLoad, RefusesWrongShapeNamingBothShapes) {
  SyntheticModel sm(SyntheticSpec{});
  sm.reshape("blk.0.attn_q.weight", {64, 80});
  EXPECT_THAT(load_error(sm), AllOf(HasSubstr("blk.0.attn_q.weight"), HasSubstr("[64, 80]"),
                                    HasSubstr("[64, 64]")));
}

TEST(ModelLoad, RefusesExpertCountMismatch) {
  SyntheticModel sm(SyntheticSpec{});
  sm.meta.set("qwen3moe.expert_count", gguf::Value::u32(8));
  EXPECT_THAT(load_error(sm), AllOf(HasSubstr("blk.0.ffn_gate_inp.weight"), HasSubstr("[64, 6]"),
                                    HasSubstr("[64, 8]")));
}

TEST(ModelLoad, RefusesUnknownArchitecture) {
  SyntheticModel sm(SyntheticSpec{});
  sm.meta.set("general.architecture", gguf::Value::string("llama"));
  EXPECT_THAT(load_error(sm), AllOf(HasSubstr("unknown architecture"), HasSubstr("llama")));
}

TEST(ModelLoad, RefusesTensorsTheMetadataDoesNotCover) {
  SyntheticModel sm(SyntheticSpec{});
  sm.add("blk.2.attn_norm.weight", {64});  // a third block while block_count says two
  EXPECT_THAT(load_error(sm), AllOf(HasSubstr("blk.2.attn_norm.weight"), HasSubstr("block_count")));
}

TEST(ModelLoad, RefusesMissingRequiredKey) {
  SyntheticSpec s;
  s.arch = "qwen3next";
  s.n_rot = 4;
  SyntheticModel sm(s);
  sm.meta.remove("qwen3next.ssm.conv_kernel");
  EXPECT_THAT(load_error(sm), HasSubstr("qwen3next.ssm.conv_kernel"));
}

TEST(ModelLoad, RefusesBadDeltaNetTensorShape) {
  SyntheticSpec s;
  s.arch = "qwen3next";
  s.n_rot = 4;
  SyntheticModel sm(s);
  sm.reshape("blk.0.ssm_conv1d.weight", {3, 128});
  EXPECT_THAT(load_error(sm), AllOf(HasSubstr("blk.0.ssm_conv1d.weight"), HasSubstr("[3, 128]"),
                                    HasSubstr("[4, 128]")));
}

}  // namespace
}  // namespace moraine::testing

namespace moraine::testing {
namespace {

// ggml shapes carry trailing ones implicitly; llama.cpp's converter writes the shared-expert
// gate (a 1 x n_embd matrix in HF) as [n_embd, 1], and the loader must take it for [n_embd].
TEST(ModelLoad, AcceptsTrailingUnitDimension) {
  SyntheticSpec s;
  s.arch = "qwen3next";
  s.n_rot = 4;
  SyntheticModel sm(s);
  sm.reshape("blk.0.ffn_gate_inp_shexp.weight", {64, 1});
  TempFile f("unit");
  sm.write(f.path);
  model::Model m = model::Model::load(f.path);
  EXPECT_EQ(m.layers[0].moe.shared_router.size(), 64u);
  // A non-unit extra dimension is still refused.
  SyntheticModel bad(s);
  bad.reshape("blk.0.ffn_gate_inp_shexp.weight", {64, 2});
  EXPECT_THAT(load_error(bad), AllOf(HasSubstr("[64, 2]"), HasSubstr("[64]")));
}

}  // namespace
}  // namespace moraine::testing
