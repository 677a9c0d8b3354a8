// The reference executor against llama.cpp (node-llama-cpp on the CPU, F32 KV cache) on the
// golden checkpoints, converted by moraine-convert: logits at every prompt position, for F32
// weights and for quantized ones (Q8_0, and a K-quant mix made by moraine-quantize). This checks
// the GGUF conventions and, for quantized files, that activations are quantized the way
// llama.cpp does (q8_0 / q8_K): then the two engines agree to ~1e-6.
//
// Quantized activations make these tiny random models chaotic: rounding an activation to int8
// turns a last-bit difference into a whole quantization step, and router near-ties turn that
// into another expert. Measured: multiplying the elements of blk.0.attn_norm by 1 +- 1e-6
// (random signs) moves our own Q8_0 logits by 0.12 (qwen3moe_odd), 0.11 (qwen3next_k256), 0.54
// (qwen3moe_odd with a q8_0 router). A uniform 1 + 1e-6 shows nothing: the fp16 block scale
// absorbs it. The engines still agree to ~1e-6 on most quantized files (same activation
// rounding), but where they part, the gap is of that size. So each quantized comparison first
// measures our own sensitivity s to such noise on two norms and accepts a difference within
// max(1e-4 * max|logit|, 2 s); a wrong block layout or activation type moves logits by whole
// units, far beyond either bound.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/gguf/gguf.h"
#include "common/model/model.h"
#include "common/reference/executor.h"
#include "synthetic_model.h"

namespace moraine::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const fs::path kSource = MORAINE_SOURCE_DIR;
const fs::path kGolden = kSource / "tests" / "golden";
const fs::path kOracle = kSource / ".cache" / "oracle";
const fs::path kTools = fs::path(MORAINE_BUILD_DIR) / "tools";

std::string sh(const fs::path& p) { return "'" + p.string() + "'"; }

std::pair<int, std::string> run_command(const std::string& cmd, bool merge_stderr = true) {
  std::string out;
  FILE* p = popen((cmd + (merge_stderr ? " 2>&1" : " 2>/dev/null")).c_str(), "r");
  if (p == nullptr) return {-1, "popen failed: " + cmd};
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

std::vector<float> our_logits(const std::string& gguf, const std::vector<int32_t>& ids) {
  const model::Model m = model::Model::load(gguf);
  reference::ReferenceExecutor ex(m);
  return ex.forward(ids, true);
}

// Copies a GGUF with the elements of one F32 tensor scaled by 1 + rel or 1 - rel (fixed
// pseudo-random signs).
void write_perturbed(const std::string& in, const std::string& out, const std::string& name, double rel) {
  const gguf::GgufFile f = gguf::GgufFile::open(in);
  gguf::GgufWriter w;
  for (const auto& [k, v] : f.metadata()) w.set(k, v);
  std::vector<float> scaled;
  for (const gguf::TensorInfo& t : f.tensors()) {
    if (t.name == name) {
      if (t.type != TensorType::F32) throw std::runtime_error(name + " is not F32");
      scaled.resize(t.n_bytes / 4);
      std::memcpy(scaled.data(), t.data, t.n_bytes);
      for (size_t i = 0; i < scaled.size(); ++i) {
        const bool up = ((i * 2654435761u) >> 7) & 1;
        scaled[i] = static_cast<float>(scaled[i] * (1.0 + (up ? rel : -rel)));
      }
      w.add_tensor(t.name, t.shape, t.type, scaled.data(), t.n_bytes);
    } else {
      w.add_tensor(t.name, t.shape, t.type, t.data, t.n_bytes);
    }
  }
  w.write(out);
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::fabs(double(a[i]) - b[i]));
  return d;
}

struct Case {
  std::string model;
  std::string weights;  // "f32", "q8_0", "kmix"
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.model << " " << c.weights; }

class LlamaOracle : public ::testing::TestWithParam<Case> {};

TEST_P(LlamaOracle, LogitsAgreeAtEveryPosition) {
  const Case c = GetParam();
  ASSERT_TRUE(fs::exists(kOracle / "node_modules" / "node-llama-cpp"))
      << "llama.cpp oracle missing: run tests/oracle/setup (expected " << kOracle << ")";
  const fs::path dir = kGolden / c.model;
  ASSERT_TRUE(fs::exists(dir / "tokens.json")) << "golden fixture missing: " << dir;
  const std::vector<int32_t> ids =
      json::parse(std::ifstream(dir / "tokens.json")).at("ids").get<std::vector<int32_t>>();

  const std::string f32 = temp_path("oracle-f32"), file = temp_path("oracle-" + c.weights);
  const std::string nudged = temp_path("oracle-nudged");
  struct Cleanup {
    std::vector<std::string> paths;
    ~Cleanup() {
      for (auto& p : paths) fs::remove(p);
    }
  } cleanup{{f32, file, nudged}};

  auto [rc, out] = run_command(sh(kTools / "moraine-convert") + " " + sh(dir) + " " + sh(f32) + " --outtype f32");
  ASSERT_EQ(rc, 0) << out;
  std::string gguf = f32;
  if (c.weights == "q8_0") {
    std::tie(rc, out) = run_command(sh(kTools / "moraine-quantize") + " " + sh(f32) + " " + sh(file) +
                                    " --map ssm_conv1d=f32 --default q8_0");
    ASSERT_EQ(rc, 0) << out;
    gguf = file;
  } else if (c.weights == "kmix") {
    // Every K-quant the design lists; rows too short for 256-blocks fall back to q8_0 / f16.
    std::tie(rc, out) = run_command(sh(kTools / "moraine-quantize") + " " + sh(f32) + " " + sh(file) +
                                    " --map ssm_conv1d=f32 --map _exps.=q4_k --map attn_v=q6_k"
                                    " --map ssm_out=q5_k --map attn_output=q2_k --map attn_q=q3_k"
                                    " --default q8_0");
    ASSERT_EQ(rc, 0) << out;
    gguf = file;
  }

  std::string csv;
  for (int32_t t : ids) csv += (csv.empty() ? "" : ",") + std::to_string(t);
  std::tie(rc, out) = run_command("cd " + sh(kOracle) + " && node " +
                                  sh(kSource / "tests" / "reference" / "llama_logits.mjs") + " " + sh(gguf) +
                                  " " + csv, /*merge_stderr=*/false);
  ASSERT_EQ(rc, 0) << "node-llama-cpp failed on " << gguf << ":\n" << out;
  const json rows = json::parse(out).at("rows");
  ASSERT_EQ(rows.size(), ids.size());

  const std::vector<float> ours = our_logits(gguf, ids);
  const int64_t V = static_cast<int64_t>(ours.size() / ids.size());
  std::vector<float> theirs(ours.size(), NAN);
  for (size_t p = 0; p < rows.size(); ++p) {
    for (const auto& kv : rows[p]) theirs[p * V + kv[0].get<int64_t>()] = kv[1].get<float>();
  }
  double max_ref = 0;
  for (float x : theirs) {
    ASSERT_TRUE(std::isfinite(x)) << "llama.cpp returned fewer logits than the vocabulary";
    max_ref = std::max(max_ref, std::fabs(double(x)));
  }
  const double diff = max_abs_diff(ours, theirs);
  double bound = 1e-4 * max_ref;
  double sensitivity = 0;
  if (c.weights != "f32") {
    const bool next = c.model.rfind("qwen3next", 0) == 0;
    for (const char* probe : {"blk.0.attn_norm.weight",
                              next ? "blk.0.post_attention_norm.weight" : "blk.0.ffn_norm.weight"}) {
      write_perturbed(gguf, nudged, probe, 1e-6);
      sensitivity = std::max(sensitivity, max_abs_diff(ours, our_logits(nudged, ids)));
    }
    bound = std::max(bound, 2 * sensitivity);
  }
  std::printf("[ %s %s ] max |logit| %.3f, max |ours - llama.cpp| %.3g, self-sensitivity %.3g\n",
              c.model.c_str(), c.weights.c_str(), max_ref, diff, sensitivity);
  EXPECT_LE(diff, bound);
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (const char* m : {"qwen3moe_odd", "qwen3moe_k256", "qwen3next_odd", "qwen3next_k256"}) {
    v.push_back({m, "f32"});
    v.push_back({m, "q8_0"});
    // K-quant blocks are 256 wide: only the *_k256 models have rows that take them.
    if (std::string(m).ends_with("k256")) v.push_back({m, "kmix"});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Golden, LlamaOracle, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return i.param.model + "_" + i.param.weights;
                         });

}  // namespace
}  // namespace moraine::testing
