// moraine-inspect --json: parses as JSON and reports the counts the files really hold.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "tests/gguf/gguf_test_util.h"

namespace moraine::gguf {
namespace {

using ::testing::HasSubstr;
using testing::ScratchDir;

struct InspectRun {
  int exit_code;
  std::string out;
};

InspectRun inspect(const std::string& args) {
  const std::string cmd = std::string(MORAINE_INSPECT_PATH) + " " + args + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return {-1, ""};
  std::string out;
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

TEST(MoraineInspect, JsonOnAVocabFileHasTheHeaderCounts) {
  const std::string path = testing::vocab_path("qwen2");
  const InspectRun r = inspect("--json " + path);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  const std::vector<uint8_t> raw = testing::read_bytes(path);
  uint64_t n_tensors = 0, n_kv = 0;
  std::memcpy(&n_tensors, raw.data() + 8, 8);
  std::memcpy(&n_kv, raw.data() + 16, 8);
  EXPECT_EQ(j.at("metadata_count").get<uint64_t>(), n_kv);
  EXPECT_EQ(j.at("metadata").size(), n_kv);
  EXPECT_EQ(j.at("tensor_count").get<uint64_t>(), n_tensors);
  EXPECT_EQ(j.at("version").get<int>(), 3);
  EXPECT_EQ(j.at("file_bytes").get<uint64_t>(), raw.size());
  const nlohmann::json& tokens = j.at("metadata").at("tokenizer.ggml.tokens");
  EXPECT_EQ(tokens.at("count").get<size_t>(), 151936u);
  EXPECT_EQ(tokens.at("first").size(), 8u) << "long arrays are summarised";
  EXPECT_EQ(j.at("architecture").at("architecture"), "qwen2");
  EXPECT_EQ(j.at("architecture").at("vocab_tokens").get<size_t>(), 151936u);
}

TEST(MoraineInspect, TensorTotalsByTypeAndLayer) {
  ScratchDir dir;
  std::mt19937_64 rng(77);
  GgufWriter w;
  w.set("general.architecture", Value::string("toy"));
  w.set("toy.block_count", Value::u32(3));
  std::vector<std::vector<uint8_t>> keep;
  struct Want {
    uint64_t count = 0, bytes = 0, elements = 0;
  };
  std::map<std::string, Want> by_type;
  std::map<int, Want> by_layer;
  Want total;
  auto add = [&](const std::string& name, int layer, std::vector<int64_t> shape, TensorType type) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const TypeTraits& tr = type_traits(type);
    keep.emplace_back(static_cast<size_t>(n / tr.block_elems) * tr.block_bytes);
    for (uint8_t& b : keep.back()) b = static_cast<uint8_t>(rng());
    w.add_tensor(name, shape, type, keep.back().data(), keep.back().size());
    for (Want* x : {&by_type[std::string(tr.name)], &total}) {
      x->count++;
      x->bytes += keep.back().size();
      x->elements += static_cast<uint64_t>(n);
    }
    if (layer >= 0) {
      by_layer[layer].count++;
      by_layer[layer].bytes += keep.back().size();
    }
  };
  add("token_embd.weight", -1, {64, 10}, TensorType::Q8_0);
  for (int l = 0; l < 3; ++l) {
    add("blk." + std::to_string(l) + ".attn_q.weight", l, {256, 1 + static_cast<int64_t>(rng() % 4)}, TensorType::Q4_K);
    add("blk." + std::to_string(l) + ".ffn_up_exps.weight", l, {256, 2, 2}, TensorType::Q6_K);
    add("blk." + std::to_string(l) + ".attn_norm.weight", l, {256}, TensorType::F32);
  }
  const std::string path = dir.file("toy.gguf");
  w.write(path);

  const InspectRun r = inspect("--json --tensors " + path);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("tensor_count").get<uint64_t>(), total.count);
  EXPECT_EQ(j.at("tensors").size(), total.count);
  EXPECT_EQ(j.at("total").at("bytes").get<uint64_t>(), total.bytes);
  EXPECT_DOUBLE_EQ(j.at("total").at("bits_per_weight").get<double>(),
                   8.0 * static_cast<double>(total.bytes) / static_cast<double>(total.elements));
  ASSERT_EQ(j.at("tensors_by_type").size(), by_type.size());
  for (const auto& [type, want] : by_type) {
    EXPECT_EQ(j.at("tensors_by_type").at(type).at("count").get<uint64_t>(), want.count) << type;
    EXPECT_EQ(j.at("tensors_by_type").at(type).at("bytes").get<uint64_t>(), want.bytes) << type;
  }
  ASSERT_EQ(j.at("layers").size(), 3u);
  for (const nlohmann::json& l : j.at("layers")) {
    const Want& want = by_layer.at(l.at("layer").get<int>());
    EXPECT_EQ(l.at("count").get<uint64_t>(), want.count);
    EXPECT_EQ(l.at("bytes").get<uint64_t>(), want.bytes);
  }
  EXPECT_EQ(j.at("non_layer").at("count").get<uint64_t>(), 1u);
  EXPECT_EQ(j.at("tensors")[1].at("name"), "blk.0.attn_q.weight");
  EXPECT_EQ(j.at("tensors")[1].at("type"), "q4_k");

  // The text form shows the same totals.
  const InspectRun text = inspect("--tensors " + path);
  ASSERT_EQ(text.exit_code, 0) << text.out;
  EXPECT_THAT(text.out, HasSubstr("blk.2.ffn_up_exps.weight"));
  EXPECT_THAT(text.out, HasSubstr("tensors: " + std::to_string(total.count)));
}

TEST(MoraineInspect, MalformedFileIsAMessageAndExitOne) {
  ScratchDir dir;
  testing::RawGguf raw;
  raw.header(0, 0, 2);
  testing::write_bytes(dir.file("old.gguf"), raw.bytes());
  const InspectRun r = inspect(dir.file("old.gguf"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("old.gguf: header version: GGUF version 2 is not supported; v3 is required"));
  EXPECT_EQ(inspect(dir.file("missing.gguf")).exit_code, 1);
}

}  // namespace
}  // namespace moraine::gguf
