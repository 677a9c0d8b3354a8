// The reference executor's other float orders (ExecutorOptions::dot_order) and the bound built on
// them (float_order_bound.h), which the CUDA backend and group tests apply to quantized files:
//  - an order's dot differs from the kernel's only by float rounding (bounded per dot on random
//    rows of each format), and some dots do differ (the option is not a no-op);
//  - on F32 golden files (nothing re-quantized) the orders agree to ~1e-6 of max |logit|;
//  - the bound still catches a real error: with one block scale per row of one matrix off by
//    5% (layer 0's token-mixer output, as a kernel reading one block's scale wrongly would be),
//    the 80-row prefill and the 12-token decode are above it on every golden model and weight
//    variant the GPU tests use.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <string>
#include <unistd.h>
#include <vector>

#include "common/formats/block_layouts.h"
#include "common/formats/quant.h"
#include "common/model/model.h"
#include "common/reference/executor.h"
#include "common/reference/matmul.h"
#include "common/sampling/sampler.h"
#include "tests/reference/float_order_bound.h"
#include "tests/support/shell.h"

namespace moraine {
namespace {

namespace fs = std::filesystem;
using reference::DotOrderSeed;
using reference::ReferenceExecutor;
using test_support::logit_gap;
using test_support::run_command;

const fs::path kGolden = fs::path(MORAINE_SOURCE_DIR) / "tests" / "golden";
const fs::path kTools = fs::path(MORAINE_BUILD_DIR) / "tools";

// ---- one dot ----------------------------------------------------------------------------------

// Per weight row: |order(seed) - scalar reference| within (blocks + 16) ulps of the sum of the
// absolute block terms (the bound the SIMD kernels are tested with), and bits different from the
// kernel's own order somewhere.
void check_dot_orders(TensorType wt, int64_t n_cols) {
  std::mt19937 rng(1234 + static_cast<int>(wt));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t rows = 64;
  std::vector<float> wf(rows * n_cols), xf(n_cols);
  for (float& v : wf) v = nd(rng);
  for (float& v : xf) v = nd(rng);
  const size_t rb = row_bytes(wt, n_cols);
  std::vector<uint8_t> w(rows * rb);
  for (int64_t r = 0; r < rows; ++r) quantize_row(wt, wf.data() + r * n_cols, w.data() + r * rb, n_cols);
  const reference::PackedActivations x = reference::pack_activations(wt, xf.data(), 1, n_cols);
  const int64_t elems = type_traits(wt).block_elems > 1 ? type_traits(wt).block_elems : 32;
  const size_t wbb = row_bytes(wt, elems), abb = row_bytes(x.type, elems);
  int differing = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* wr = w.data() + r * rb;
    const float want = vec_dot_reference(wt, n_cols, wr, x.row(0));
    double abs_terms = 0;
    const int64_t nb = (n_cols + elems - 1) / elems;
    for (int64_t b = 0; b < nb; ++b) {
      abs_terms += std::fabs(vec_dot_reference(wt, std::min(elems, n_cols - b * elems), wr + b * wbb,
                                               static_cast<const uint8_t*>(x.row(0)) + b * abb));
    }
    const double tol = double(nb + 16) * std::ldexp(1.0, -24) * abs_terms;
    for (DotOrderSeed s : {1, 2, 3, 77}) {
      const float got = reference::dot_row_in_order(wt, n_cols, wr, x.row(0), s, r, rows);
      EXPECT_LE(std::fabs(double(got) - want), tol) << type_name(wt) << " row " << r << " seed " << s;
      const float own = reference::dot_row(wt, n_cols, wr, x.row(0));
      differing += std::memcmp(&got, &own, sizeof got) != 0;
    }
    EXPECT_EQ(reference::dot_row_in_order(wt, n_cols, wr, x.row(0), 0, r, rows),
              reference::dot_row(wt, n_cols, wr, x.row(0)));
  }
  EXPECT_GT(differing, 0) << type_name(wt) << ": no order changed any dot";
}

TEST(DotOrder, DiffersFromTheKernelOnlyByFloatRounding) {
  check_dot_orders(TensorType::Q8_0, 32 * 24);
  check_dot_orders(TensorType::Q4_K, 256 * 6);
  check_dot_orders(TensorType::Q6_K, 256 * 6);
  check_dot_orders(TensorType::F32, 32 * 24 + 8);   // a last chunk shorter than 32
  check_dot_orders(TensorType::F16, 32 * 24);
}

// ---- golden models ----------------------------------------------------------------------------



// The weight variants of the GPU tests: tests/cuda/cuda_backend_golden_test.cpp ("kmix") and
// tests/group/group_harness.cpp ("kmix_group").
const std::map<std::string, std::string> kQuantArgs = {
    {"q8_0", "--default q8_0"},
    {"kmix", "--map _exps.=q4_k --map attn_v=q6_k --map attn_output=q5_k --map attn_q=q4_k --map ssm_out=q5_k "
             "--default q8_0"},
    {"kmix_group", "--map _exps.=q4_k --map attn_v=q6_k --map attn_output=q4_k --default q8_0"},
};

fs::path golden_gguf(const std::string& model, const std::string& variant) {
  static const fs::path tmp = fs::temp_directory_path() / ("moraine-order-bound-" + std::to_string(getpid()));
  fs::create_directories(tmp);
  const fs::path f32 = tmp / (model + "_f32.gguf");
  if (!fs::exists(f32)) {
    auto [rc, out] = run_command(test_support::quoted(kTools / "moraine-convert") + " " + test_support::quoted(kGolden / model) + " " +
                                 test_support::quoted(f32) + " --outtype f32");
    if (rc != 0) throw std::runtime_error("moraine-convert " + model + " failed:\n" + out);
  }
  if (variant == "f32") return f32;
  const fs::path q = tmp / (model + "_" + variant + ".gguf");
  if (!fs::exists(q)) {
    auto [rc, out] = run_command(test_support::quoted(kTools / "moraine-quantize") + " " + test_support::quoted(f32) + " " + test_support::quoted(q) + " " +
                                 kQuantArgs.at(variant));
    if (rc != 0) throw std::runtime_error("moraine-quantize " + model + " " + variant + " failed:\n" + out);
  }
  return q;
}

std::vector<int32_t> golden_prompt(const std::string& model) {
  std::ifstream f(kGolden / model / "tokens.json");
  if (!f) throw std::runtime_error("cannot read " + (kGolden / model / "tokens.json").string());
  return nlohmann::json::parse(f).at("ids").get<std::vector<int32_t>>();
}

// The LongPrefill test's rows: the prompt repeated to 80.
std::vector<int32_t> long_prefill_tokens(const std::vector<int32_t>& prompt) {
  std::vector<int32_t> t;
  while (t.size() < 80) t.insert(t.end(), prompt.begin(), prompt.end());
  t.resize(80);
  return t;
}

// The group test's rows: the reference's own greedy tokens, and the rows they were sampled from.
std::vector<int32_t> greedy_ids(const model::Model& m, const std::vector<int32_t>& prompt, int n) {
  ReferenceExecutor ex(m);
  std::vector<int32_t> ids;
  std::vector<float> l = ex.forward(prompt, false);
  for (int i = 0; i < n; ++i) {
    ids.push_back(sampling::argmax(std::span<const float>(l)));
    if (i + 1 < n) l = ex.forward(std::span<const int32_t>(&ids.back(), 1), false);
  }
  return ids;
}

// The model of `path` with block 0 of every row of layer 0's token-mixer output projection
// (attn_output or ssm_out) scaled by `factor`: one wrong block scale, as a kernel reading it
// from the wrong place would produce.
model::Model with_wrong_block_scale(const fs::path& path, const model::Model& m, float factor) {
  std::ifstream f(path, std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const model::LayerWeights& L = m.layers[0];
  const model::Matrix& w = L.recurrent ? L.delta.out : L.attn.o;
  const size_t base = m.file.data_offset(w.info->shard) + w.info->offset;
  for (int64_t r = 0; r < w.n_rows; ++r) {
    uint8_t* row = bytes.data() + base + static_cast<size_t>(r) * w.row_bytes;
    auto scale_fp16 = [&](size_t at) {
      uint16_t h;
      std::memcpy(&h, row + at, 2);
      h = fp32_to_fp16(fp16_to_fp32(h) * factor);
      std::memcpy(row + at, &h, 2);
    };
    switch (w.type) {
      case TensorType::Q8_0: scale_fp16(offsetof(BlockQ8_0, d)); break;
      case TensorType::Q4_K: scale_fp16(offsetof(BlockQ4_K, d)); break;
      case TensorType::Q5_K: scale_fp16(offsetof(BlockQ5_K, d)); break;
      case TensorType::Q6_K: scale_fp16(offsetof(BlockQ6_K, d)); break;
      default: throw std::runtime_error("with_wrong_block_scale: no block scale in " + std::string(type_name(w.type)));
    }
  }
  return model::Model::bind(gguf::GgufFile::from_bytes(bytes.data(), bytes.size(), path.string() + " (one block scale wrong)"));
}

struct Case {
  std::string model, variant;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.model << "_" << c.variant; }

class FloatOrderBound : public ::testing::TestWithParam<Case> {};

// On F32 files the orders differ by float rounding only: no activation is re-quantized.
TEST(FloatOrderBoundF32, OrdersAgreeToRoundingOnF32Files) {
  for (const char* name : {"qwen3moe_odd", "qwen3moe_k256", "qwen3next_odd", "qwen3next_k256"}) {
    const model::Model m = model::Model::load(golden_gguf(name, "f32"));
    const std::vector<int32_t> tokens = long_prefill_tokens(golden_prompt(name));
    const std::vector<float> want = ReferenceExecutor(m).forward(tokens, true);
    for (DotOrderSeed s : {1, 2, 3, 4}) {
      const double g = logit_gap(ReferenceExecutor(m, test_support::in_order(s)).forward(tokens, true), want).rel();
      EXPECT_LT(g, 1e-5) << name << " seed " << s;
      EXPECT_GT(g, 0.0) << name << " seed " << s << ": the order changed nothing";
    }
  }
}

TEST_P(FloatOrderBound, AWrongBlockScaleIsAboveTheBound) {
  const Case& c = GetParam();
  const fs::path path = golden_gguf(c.model, c.variant);
  const model::Model m = model::Model::load(path);
  const model::Model bad = with_wrong_block_scale(path, m, 1.05f);
  const std::vector<int32_t> prompt = golden_prompt(c.model);

  const std::vector<int32_t> rows = long_prefill_tokens(prompt);
  const std::vector<float> want = ReferenceExecutor(m).forward(rows, true);
  const test_support::OrderBound pb = test_support::quantized_bound(
      want, [&](DotOrderSeed s) { return ReferenceExecutor(m, test_support::in_order(s)).forward(rows, true); });
  const double pg = logit_gap(ReferenceExecutor(bad).forward(rows, true), want).rel();

  const std::vector<int32_t> ids = greedy_ids(m, prompt, 12);
  const std::vector<float> dwant = test_support::generation_logits(m, 0, prompt, ids);
  const test_support::OrderBound db = test_support::quantized_bound(
      dwant, [&](DotOrderSeed s) { return test_support::generation_logits(m, s, prompt, ids); });
  const double dg = logit_gap(test_support::generation_logits(bad, 0, prompt, ids), dwant).rel();

  std::printf("[ %s %s ] 80-row prefill: wrong block scale %.3g, %s\n", c.model.c_str(), c.variant.c_str(), pg,
              pb.describe().c_str());
  std::printf("[ %s %s ] 12-token decode: wrong block scale %.3g, %s\n", c.model.c_str(), c.variant.c_str(), dg,
              db.describe().c_str());
  EXPECT_GT(pg, pb.bound);
  EXPECT_GT(dg, db.bound);
}

INSTANTIATE_TEST_SUITE_P(Golden, FloatOrderBound,
                         ::testing::Values(Case{"qwen3moe_odd", "q8_0"}, Case{"qwen3moe_k256", "q8_0"},
                                           Case{"qwen3moe_k256", "kmix"}, Case{"qwen3moe_k256", "kmix_group"},
                                           Case{"qwen3next_odd", "q8_0"}, Case{"qwen3next_k256", "q8_0"},
                                           Case{"qwen3next_k256", "kmix"}, Case{"qwen3next_k256", "kmix_group"}),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.model + "_" + i.param.variant; });

}  // namespace
}  // namespace moraine
