// moraine-quantize end to end: a tiny qwen3moe model written by moraine (random weights, some
// already F16/BF16/Q8_0) is quantized with a rule map; the output must have the types the rules
// and fallbacks call for, keep every metadata key, hold exactly what quantize_row makes of the
// source values, stay within each format's error bound, and load in llama.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "common/formats/tensor_type.h"
#include "common/gguf/gguf.h"
#include "tests/interop/llama_oracle.h"

namespace moraine::test {
namespace {

using gguf::GgufFile;
using gguf::GgufWriter;
using gguf::Value;

constexpr int64_t kEmbd = 256, kVocab = 300, kHeads = 3, kHeadDim = 64, kExperts = 4, kFfExp = 80;

struct SourceTensor {
  std::string name;
  std::vector<int64_t> shape;
  TensorType type;           // as stored in the source file
  std::vector<uint8_t> bytes;
};

// A qwen3moe model llama.cpp accepts, shaped so the rules below meet both fallbacks:
// attn_output rows are kHeads * kHeadDim = 192 long (a multiple of 32, not of 256) and
// ffn_down_exps rows are kFfExp = 80 long (not a multiple of 32).
std::vector<SourceTensor> make_source_tensors(std::mt19937_64& rng) {
  struct Spec {
    const char* name;
    std::vector<int64_t> shape;
    TensorType type;
  };
  const std::vector<Spec> specs = {
      {"token_embd.weight", {kEmbd, kVocab}, TensorType::Q8_0},  // requantized from Q8_0
      {"output_norm.weight", {kEmbd}, TensorType::F32},
      {"output.weight", {kEmbd, kVocab}, TensorType::F32},
      {"blk.0.attn_norm.weight", {kEmbd}, TensorType::F32},
      {"blk.0.attn_q.weight", {kEmbd, kHeads * kHeadDim}, TensorType::F32},
      {"blk.0.attn_k.weight", {kEmbd, kHeadDim}, TensorType::F32},
      {"blk.0.attn_v.weight", {kEmbd, kHeadDim}, TensorType::F16},
      {"blk.0.attn_output.weight", {kHeads * kHeadDim, kEmbd}, TensorType::F32},
      {"blk.0.attn_q_norm.weight", {kHeadDim}, TensorType::F16},   // 1-D: becomes F32
      {"blk.0.attn_k_norm.weight", {kHeadDim}, TensorType::BF16},  // 1-D: becomes F32
      {"blk.0.ffn_norm.weight", {kEmbd}, TensorType::F32},
      {"blk.0.ffn_gate_inp.weight", {kEmbd, kExperts}, TensorType::BF16},
      {"blk.0.ffn_gate_exps.weight", {kEmbd, kFfExp, kExperts}, TensorType::F32},
      {"blk.0.ffn_up_exps.weight", {kEmbd, kFfExp, kExperts}, TensorType::F32},
      {"blk.0.ffn_down_exps.weight", {kFfExp, kEmbd, kExperts}, TensorType::F32},
  };
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<SourceTensor> out;
  for (const Spec& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    std::vector<float> values(static_cast<size_t>(n));
    const bool is_norm = s.shape.size() == 1;
    for (float& x : values) x = is_norm ? 1.0f + 0.1f * normal(rng) : 0.05f * normal(rng);
    SourceTensor t{s.name, s.shape, s.type, std::vector<uint8_t>(row_bytes(s.type, s.shape[0]) * (n / s.shape[0]))};
    for (int64_t r = 0; r < n / s.shape[0]; ++r) {
      quantize_row(s.type, &values[r * s.shape[0]], &t.bytes[r * row_bytes(s.type, s.shape[0])], s.shape[0]);
    }
    out.push_back(std::move(t));
  }
  return out;
}

void write_source_model(const std::string& path, const std::vector<SourceTensor>& tensors) {
  GgufWriter w;
  w.set("general.architecture", Value::string("qwen3moe"));
  w.set("general.name", Value::string("moraine quantize test"));
  w.set("general.file_type", Value::u32(0));  // all F32: must be replaced
  w.set("moraine.test.marker", Value::array(gguf::ValueType::INT16, {Value::i16(-3), Value::i16(7)}));
  w.set("qwen3moe.context_length", Value::u32(256));
  w.set("qwen3moe.embedding_length", Value::u32(kEmbd));
  w.set("qwen3moe.block_count", Value::u32(1));
  w.set("qwen3moe.feed_forward_length", Value::u32(kFfExp * 2));
  w.set("qwen3moe.expert_feed_forward_length", Value::u32(kFfExp));
  w.set("qwen3moe.expert_count", Value::u32(kExperts));
  w.set("qwen3moe.expert_used_count", Value::u32(2));
  w.set("qwen3moe.attention.head_count", Value::u32(kHeads));
  w.set("qwen3moe.attention.head_count_kv", Value::u32(1));
  w.set("qwen3moe.attention.key_length", Value::u32(kHeadDim));
  w.set("qwen3moe.attention.value_length", Value::u32(kHeadDim));
  w.set("qwen3moe.attention.layer_norm_rms_epsilon", Value::f32(1e-6f));
  w.set("qwen3moe.rope.freq_base", Value::f32(1e6f));
  add_minimal_llama_vocab(w, kVocab);
  for (const SourceTensor& t : tensors) w.add_tensor(t.name, t.shape, t.type, t.bytes.data(), t.bytes.size());
  w.write(path);
}

// The rules under test. "attn_output" precedes "output.weight", which also matches it: the first
// match must win.
const char* const kRuleArgs =
    "--map '_exps.=q4_k' --map 'attn_output=q5_k' --map 'attn_v=q6_k' --map 'attn_q.=q3_k' "
    "--map 'attn_k.=mxfp4' --map 'token_embd=q2_k' --map 'output.weight=bf16' --default q4_0";

// What those rules call for, per tensor.
const std::map<std::string, TensorType> kExpectedTypes = {
    {"token_embd.weight", TensorType::Q2_K},
    {"output_norm.weight", TensorType::F32},
    {"output.weight", TensorType::BF16},
    {"blk.0.attn_norm.weight", TensorType::F32},
    {"blk.0.attn_q.weight", TensorType::Q3_K},
    {"blk.0.attn_k.weight", TensorType::MXFP4},
    {"blk.0.attn_v.weight", TensorType::Q6_K},
    {"blk.0.attn_output.weight", TensorType::Q8_0},  // q5_k wanted; 192 is not a multiple of 256
    {"blk.0.attn_q_norm.weight", TensorType::F32},
    {"blk.0.attn_k_norm.weight", TensorType::F32},
    {"blk.0.ffn_norm.weight", TensorType::F32},
    {"blk.0.ffn_gate_inp.weight", TensorType::F32},  // no rule names it: a router stays F32, as llama.cpp keeps it
    {"blk.0.ffn_gate_exps.weight", TensorType::Q4_K},
    {"blk.0.ffn_up_exps.weight", TensorType::Q4_K},
    {"blk.0.ffn_down_exps.weight", TensorType::F16},  // q4_k wanted; 80 is not a multiple of 32
};

// Largest error a format may make on an element, as a fraction of the largest magnitude M in
// the element's block (the block-scaled formats), or of the element itself (F16, BF16).
// One quantization step is at most: Q8_0 M/127; Q4_0 M/8 (scale max/-8: +M clamps from 8 to 7);
// Q6_K M/32 and Q3_K M/4 (symmetric 6-/3-bit); Q5_K 2M/31, Q4_K 2M/15, Q2_K 2M/3 (with a block
// minimum the range is at most 2M); MXFP4 M/2 (shared exponent puts M in [4, 8) units; the top
// code is 6). ggml's scale searches may clip an extreme value by up to two steps in exchange for a
// finer step elsewhere, and the 4-/6-bit sub-block scales add at most half a step, so the bound is
// three steps for the searched K-formats and one step for the others. F16/BF16: round to nearest,
// half an ulp: 2^-11 / 2^-8 relative, and for F16 below 2^-14 (subnormal) half its fixed spacing
// of 2^-24.
double error_bound(TensorType t, double block_max, double value) {
  switch (t) {
    case TensorType::F32: return 0.0;
    case TensorType::F16: return std::max(std::ldexp(std::fabs(value), -11), std::ldexp(1.0, -25));
    case TensorType::BF16: return std::ldexp(std::fabs(value), -8);
    case TensorType::Q8_0: return block_max / 127.0;
    case TensorType::Q4_0: return block_max / 8.0;
    case TensorType::MXFP4: return block_max / 2.0;
    case TensorType::Q6_K: return 3.0 * block_max / 32.0;
    case TensorType::Q5_K: return 3.0 * 2.0 * block_max / 31.0;
    case TensorType::Q4_K: return 3.0 * 2.0 * block_max / 15.0;
    case TensorType::Q3_K: return 3.0 * block_max / 4.0;
    case TensorType::Q2_K: return 3.0 * 2.0 * block_max / 3.0;
    default: return -1.0;
  }
}

std::vector<float> dequantize_all(TensorType t, const uint8_t* bytes, int64_t row, int64_t n_rows) {
  std::vector<float> out(static_cast<size_t>(row * n_rows));
  for (int64_t r = 0; r < n_rows; ++r) dequantize_row(t, bytes + r * row_bytes(t, row), &out[r * row], row);
  return out;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct RunResult {
  int status;
  std::string err;
};

RunResult run_quantize(const std::string& args, const std::string& scratch) {
  const std::string tool = std::string(MORAINE_BUILD_DIR) + "/tools/moraine-quantize";
  const std::string err_path = scratch + "/quantize.stderr";
  const int rc = std::system((tool + " " + args + " 2>" + err_path).c_str());
  return {rc, read_text(err_path)};
}

std::string display(const Value& v) {
  return std::string(gguf::value_type_name(v.type())) + ":" + v.to_display(1u << 20);
}

TEST(Quantize, RulesFallbacksMetadataValuesAndLlamaCppLoad) {
  ScratchDir dir("quantize");
  std::mt19937_64 rng(20261129);
  const auto source = make_source_tensors(rng);
  const std::string in_path = dir.file("source-f32.gguf");
  const std::string out_path = dir.file("quantized.gguf");
  write_source_model(in_path, source);

  const RunResult run = run_quantize(in_path + " " + out_path + " " + kRuleArgs + " --threads 2", dir.path());
  ASSERT_EQ(run.status, 0) << run.err;
  // Both fallbacks are announced on stderr, naming the tensor and the type used.
  EXPECT_NE(run.err.find("blk.0.attn_output.weight: row length 192 is not a multiple of 256 (q5_k); using q8_0"),
            std::string::npos) << run.err;
  EXPECT_NE(run.err.find("blk.0.ffn_down_exps.weight: row length 80 is not a multiple of 256 (q4_k); using f16"),
            std::string::npos) << run.err;

  const GgufFile in = GgufFile::open(in_path);
  const GgufFile out = GgufFile::open(out_path);

  // Metadata: every key kept with its value and width, except the file type, which names the
  // most common weight type (Q4_K by elements: two of the three expert tensors) as llama.cpp
  // numbers it (LLAMA_FTYPE_MOSTLY_Q4_K_M = 15).
  for (const auto& [key, value] : in.metadata()) {
    if (key == "general.file_type") continue;
    const Value* got = out.find(key);
    ASSERT_NE(got, nullptr) << "metadata key lost: " << key;
    EXPECT_EQ(display(*got), display(value)) << key;
  }
  EXPECT_EQ(out.get_u64("general.file_type"), std::optional<uint64_t>(15));
  EXPECT_EQ(out.get_u64("general.quantization_version"), std::optional<uint64_t>(2));

  ASSERT_EQ(out.tensors().size(), source.size());
  for (const SourceTensor& s : source) {
    SCOPED_TRACE(s.name);
    const gguf::TensorInfo* t = out.find_tensor(s.name);
    ASSERT_NE(t, nullptr);
    ASSERT_EQ(kExpectedTypes.count(s.name), 1u);
    const TensorType want = kExpectedTypes.at(s.name);
    ASSERT_EQ(t->type, want) << "got " << type_name(t->type) << ", want " << type_name(want);
    EXPECT_EQ(t->shape, s.shape);

    const int64_t row = s.shape[0];
    const int64_t n_rows = t->n_rows();
    const std::vector<float> src = dequantize_all(s.type, s.bytes.data(), row, n_rows);
    // Exactly what quantize_row makes of the source values: rows land where they belong
    // whatever thread converted them.
    std::vector<uint8_t> expect(row_bytes(want, row) * n_rows);
    for (int64_t r = 0; r < n_rows; ++r) quantize_row(want, &src[r * row], &expect[r * row_bytes(want, row)], row);
    ASSERT_EQ(t->n_bytes, expect.size());
    EXPECT_TRUE(std::equal(expect.begin(), expect.end(), t->data)) << "bytes differ from quantize_row";

    // Close to the source within the format's bound.
    const std::vector<float> got = dequantize_all(want, t->data, row, n_rows);
    const int64_t block = type_traits(want).block_elems;
    int64_t bad = 0;
    double worst = 0.0;  // error / bound
    for (int64_t b = 0; b < static_cast<int64_t>(src.size()); b += block) {
      double m = 0.0;
      for (int64_t j = 0; j < block; ++j) m = std::max(m, std::fabs(double(src[b + j])));
      for (int64_t j = b; j < b + block; ++j) {
        const double err = std::fabs(double(got[j]) - double(src[j]));
        const double bound = error_bound(want, m, src[j]);
        ASSERT_GE(bound, 0.0) << "no bound for " << type_name(want);
        if (bound > 0) worst = std::max(worst, err / bound);
        if (!(err <= bound) && bad++ < 3) {
          ADD_FAILURE() << "element " << j << ": source " << src[j] << ", " << type_name(want) << " " << got[j]
                        << " (bound " << bound << ")";
        }
      }
    }
    EXPECT_EQ(bad, 0);
    std::printf("%-28s %-5s -> %-5s worst error %.2f of bound\n", s.name.c_str(),
                std::string(type_name(s.type)).c_str(), std::string(type_name(want)).c_str(), worst);
  }

  // llama.cpp loads the output, sees the same types, names the file type, and evaluates it.
  const auto reports = run_llama_oracle({out_path}, 4, dir.path());
  const LlamaReport& r = reports.at(out_path);
  ASSERT_TRUE(r.loaded) << r.error;
  EXPECT_NE(r.type_description.find("Q4_K - Medium"), std::string::npos) << r.type_description;
  for (const auto& t : out.tensors()) {
    ASSERT_EQ(r.tensor_types.count(t.name), 1u) << t.name;
    EXPECT_EQ(r.tensor_types.at(t.name), static_cast<uint32_t>(t.type)) << t.name;
  }
  EXPECT_EQ(r.n_vocab, kVocab);
  for (float x : r.logits) ASSERT_TRUE(std::isfinite(x));
}

TEST(Quantize, ThreadCountDoesNotChangeTheOutput) {
  ScratchDir dir("quantize-threads");
  std::mt19937_64 rng(99);
  write_source_model(dir.file("in.gguf"), make_source_tensors(rng));
  for (const char* threads : {"1", "3"}) {
    const RunResult run = run_quantize(dir.file("in.gguf") + " " + dir.file(std::string("out") + threads + ".gguf") +
                                           " " + kRuleArgs + " --threads " + threads,
                                       dir.path());
    ASSERT_EQ(run.status, 0) << run.err;
  }
  EXPECT_EQ(read_text(dir.file("out1.gguf")), read_text(dir.file("out3.gguf")));
}

TEST(Quantize, BadInputsGiveClearErrorsAndNoOutput) {
  ScratchDir dir("quantize-errors");
  std::mt19937_64 rng(5);
  write_source_model(dir.file("in.gguf"), make_source_tensors(rng));
  const std::string out = dir.file("out.gguf");

  RunResult r = run_quantize(dir.file("in.gguf") + " " + out + " --map 'attn_v=q7_k'", dir.path());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("'q7_k' is not a type"), std::string::npos) << r.err;

  r = run_quantize(dir.file("in.gguf") + " " + out + " --default q8_k", dir.path());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("--default: 'q8_k' is not a type"), std::string::npos) << r.err;

  r = run_quantize(dir.file("in.gguf") + " " + out + " --map attn_v", dir.path());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("expected PATTERN=TYPE"), std::string::npos) << r.err;

  r = run_quantize(dir.file("missing.gguf") + " " + out, dir.path());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("cannot read " + dir.file("missing.gguf")), std::string::npos) << r.err;

  {
    std::ofstream junk(dir.file("junk.gguf"));
    junk << "this is not a model";
  }
  r = run_quantize(dir.file("junk.gguf") + " " + out, dir.path());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("cannot read " + dir.file("junk.gguf")), std::string::npos) << r.err;

  EXPECT_FALSE(std::filesystem::exists(out));
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {   // no temp file (OUT.tmp.PID.N) left
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
  }
}

}  // namespace
}  // namespace moraine::test
