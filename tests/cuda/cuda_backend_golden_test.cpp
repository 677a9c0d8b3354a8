// The CUDA backend (gpu_worker/cuda_backend.h) driven step by step as the gpu_worker drives a
// backend (embed, then per layer layer_whole or layer_begin / layer_end; advance; logits), on the
// golden qwen3moe, qwen3next and qwen35moe checkpoints of tests/golden/ converted by
// moraine-convert, in three weight variants: F32, Q8_0 everywhere, and a K-quant mix of the
// formats the CUDA matvec has (its experts Q4_K, so the fused MoE kernel serves them).
//  - F32: logits at every prompt position within the reference's own bound against transformers
//    (max |diff| <= 1e-4 * max |logit|, tests/reference/golden_test.cpp); the 32-token greedy
//    continuation identical to transformers'.
//  - Quantized: logits within the reference executor's float-order bound (tests/reference/
//    float_order_bound.h: max(1e-3, 2 x the reference's gap to itself over 32 other float orders
//    of its dots, on the same tokens): re-quantized activations and near-tied router choices turn
//    an ulp of order into a discrete step, and the reference shows how large on each case);
//    greedy tokens identical to the reference executor's.
//  - Decode after prefill (decode steps replayed from a captured graph) gives bit-identical logits
//    to a fresh prefill of the same tokens (both shorter than the tiled prefill's 64 rows).
//  - With only the even experts on the device and the odd ones computed on the host (the group's
//    cpu workers), the same bounds; an 80-row prefill (tiled attention) likewise.
//  - Every case again with an F16 KV cache (BackendOptions::kv_type; suite ModelsF16Kv), against
//    the reference executor with the same F16 cache (ExecutorOptions::kv_type) and its greedy
//    tokens. Rounding K and V to half is a discrete step like a re-quantized activation: an ulp
//    of float order before it can land a stored element on the other half, so every F16 case takes
//    the float-order bound of tests/reference/float_order_bound.h computed with the F16 reference
//    (quantized weights: max(1e-3, 2 G) as before; F32 weights: max(1e-4, 2 G), the F32 cases'
//    1e-4 unless the reference itself crosses such an edge: qwen3moe_odd's F16 reference over 32
//    orders reached G = 2.05e-4, the F32 one 6.7e-7). Transformers' logits (an F32 cache) are not
//    compared there (the F16 cache moves the reference 0.8e-4 .. 3.9e-4 of max from them,
//    tests/reference/kv_f16_test.cpp).
// GGUFs come from $MORAINE_CUDA_GOLDEN_GGUF/<model>_<variant>.gguf when set (the GPU machine
// gets them ready-made), else they are made here with moraine-convert / moraine-quantize.
// Suite IqModels: the k256 models in each importance-matrix grid type (variant iq2_xxs .. iq1_m),
// written by llama.cpp's own quantizer (moraine writes no IQ type) with its per-tensor mix for the
// file type (attention and experts in the IQ type, a few K-quants), so the IQ matvec, moe_fused
// and prefill dequantizers run inside the backend; the same bounds as the other quantized files.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <span>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <unistd.h>
#include <utility>
#include <vector>

#include "common/formats/quant_iq.h"
#include "common/model/model.h"
#include "common/reference/executor.h"
#include "common/reference/moe_parts.h"
#include "common/sampling/sampler.h"
#include "coordinator/device_reserve.h"
#include "coordinator/group_layout.h"
#include "gpu_worker/cuda_backend.h"
#include "gpu_worker/cuda_backend_impl.h"
#include "kernels/cuda/embed_rows.h"
#include "tests/cuda/cuda_arch_test.h"
#include "tests/cuda/cuda_test_support.h"
#include "tests/reference/float_order_bound.h"
#include "tests/support/shell.h"

namespace moraine {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test_support::run_command;

const fs::path kGolden = fs::path(MORAINE_SOURCE_DIR) / "tests" / "golden";
const fs::path kTools = fs::path(MORAINE_BUILD_DIR) / "tools";
constexpr int kMaxTokens = 96;

// The K-quant mix: every K-quant the CUDA matvec runs; rows too short for 256-blocks fall back
// to q8_0 / f16 in moraine-quantize, which exercises the F16 kernel too.
const std::map<std::string, std::string> kQuantArgs = {
    {"q8_0", "--default q8_0"},
    {"kmix", "--map _exps.=q4_k --map attn_v=q6_k --map attn_output=q5_k --map attn_q=q4_k --map ssm_out=q5_k "
             "--default q8_0"},
    // Issue 26's CUDA formats (matvec_formats_legacy.cuh), as tests/group/group_harness.cpp's variants.
    {"hub", "--map ffn_gate_exps=q4_1 --map ffn_up_exps=q5_1 --map ffn_down_exps=iq4_xs --map attn_q=q5_0 "
            "--map attn_output=iq4_nl --default q8_0"},
    {"hub_tq", "--map ffn_gate_exps=q4_0 --map ffn_up_exps=tq1_0 --map ffn_down_exps=tq2_0 --map attn_q=iq4_nl "
               "--map attn_output=q4_0 --default q8_0"},
};

json read_json(const fs::path& p) {
  std::ifstream f(p);
  if (!f) throw std::runtime_error("cannot read " + p.string());
  return json::parse(f);
}



// Whether variant names an importance-matrix grid type (iq2_xxs .. iq1_m).
bool is_iq_variant(const std::string& variant) {
  const std::optional<TensorType> t = type_from_name(variant);
  return t && formats::is_iq_grid_type(*t);
}

// The GGUF of model/variant: ready-made, or converted (and quantized) once per process.
fs::path golden_gguf(const std::string& model, const std::string& variant) {
  const std::string file = model + "_" + variant + ".gguf";
  if (const char* dir = std::getenv("MORAINE_CUDA_GOLDEN_GGUF")) {
    const fs::path p = fs::path(dir) / file;
    if (!fs::exists(p)) throw std::runtime_error("MORAINE_CUDA_GOLDEN_GGUF is set but " + p.string() + " is missing");
    return p;
  }
  static const fs::path tmp = fs::temp_directory_path() / ("moraine-cuda-golden-" + std::to_string(getpid()));
  fs::create_directories(tmp);
  const fs::path f32 = tmp / (model + "_f32.gguf");
  if (!fs::exists(f32)) {
    auto [rc, out] = run_command(test_support::quoted(kTools / "moraine-convert") + " " + test_support::quoted(kGolden / model) + " " + test_support::quoted(f32) +
                                 " --outtype f32");
    if (rc != 0) throw std::runtime_error("moraine-convert " + model + " failed:\n" + out);
  }
  if (variant == "f32") return f32;
  const fs::path q = tmp / file;
  if (!fs::exists(q) && is_iq_variant(variant)) {
    const fs::path quantizer = fs::path(MORAINE_BUILD_DIR) / "tests" / "interop" / "moraine-test-llama-quantize";
    if (!fs::exists(quantizer))
      throw std::runtime_error(file + ": IQ files come from llama.cpp's quantizer, and " + quantizer.string() +
                               " is not built (tests/oracle/setup, then re-run cmake); or set MORAINE_CUDA_GOLDEN_GGUF "
                               "to a directory holding " + file);
    // llama.cpp refuses these types without an importance matrix (IQ3_S aside): a uniform one.
    auto [rc, out] = run_command(test_support::quoted(quantizer) + " " + test_support::quoted(f32) + " " +
                                 test_support::quoted(q) + " " + variant + (variant == "iq3_s" ? "" : " --imatrix uniform"));
    if (rc != 0) throw std::runtime_error("moraine-test-llama-quantize " + file + " failed:\n" + out);
  }
  if (!fs::exists(q)) {
    auto [rc, out] = run_command(test_support::quoted(kTools / "moraine-quantize") + " " + test_support::quoted(f32) + " " + test_support::quoted(q) + " " +
                                 kQuantArgs.at(variant));
    if (rc != 0) throw std::runtime_error("moraine-quantize " + file + " failed:\n" + out);
  }
  return q;
}

// The slot grouping (group_layout.h ExpertPlan), the experts the device lacks computed by the
// reference kernel as the cpu workers do, a hand-off step's pinned host memory: cuda_arch_test.h's.
using cuda_arch_test::HandoffBuffers;
using cuda_arch_test::host_experts;
using cuda_arch_test::plan_of;

// How a test drives a step through the backend (backend.h).
enum class Drive {
  kLayers,  // embed, layer_whole per layer, advance, logits: every expert on the device
  kGraph,   // step_whole: a captured graph for steps of up to 16 rows
  kSplit,   // layer_begin / layer_end, the experts the device lacks computed here by the
            // reference kernel into packed rows, as the cpu workers do
};

// One step of n tokens; logits of every row when all_logits, else the last. kSplit passes the
// host buffers of `pinned_io` to the backend when given (then it may capture layer_begin).
std::vector<float> run_step(gpu_worker::Backend& b, const model::Model& m, const std::vector<int32_t>& tokens,
                            bool all_logits, Drive drive = Drive::kLayers,
                            const std::vector<std::vector<int32_t>>* device_experts = nullptr,
                            HandoffBuffers* pinned_io = nullptr) {
  const model::HParams& hp = m.hp;
  const int64_t n = static_cast<int64_t>(tokens.size()), d = hp.n_embd, k = hp.n_expert_used;
  const int64_t rows = all_logits ? n : 1;
  std::vector<float> logits(rows * hp.n_vocab, NAN);
  if (drive == Drive::kGraph) {
    b.step_whole(tokens.data(), n, rows, logits.data(), nullptr, 0);
    return logits;
  }
  b.embed(tokens.data(), n);
  std::vector<float> h_own(n * d, NAN), weight_own(n * k, NAN), rows_own(n * k * d, NAN);
  std::vector<int32_t> chosen_own(n * k, -1);
  float* h = pinned_io != nullptr ? pinned_io->h.data() : h_own.data();
  float* weight = pinned_io != nullptr ? pinned_io->weight.data() : weight_own.data();
  float* host_rows = pinned_io != nullptr ? pinned_io->host_rows.data() : rows_own.data();
  int32_t* chosen_ptr = pinned_io != nullptr ? pinned_io->chosen.data() : chosen_own.data();
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    if (drive == Drive::kLayers) {
      b.layer_whole(il, n, chosen_ptr);
      continue;
    }
    b.layer_begin(il, n, chosen_ptr, weight, h);
    const group::ExpertPlan plan = plan_of(std::vector<int32_t>(chosen_ptr, chosen_ptr + n * k), hp.n_expert);
    host_experts(m, il, plan, h, device_experts->at(il), host_rows);
    b.layer_end(il, n, plan, host_rows);
  }
  b.advance(n);
  b.logits(rows, logits.data());
  return logits;
}

std::unique_ptr<gpu_worker::Backend> cuda_backend(const model::Model& m, int max_tokens, int64_t context,
                                                  const std::vector<std::vector<int32_t>>* device_experts = nullptr,
                                                  model::KvType kv = model::KvType::F32) {
  gpu_worker::BackendOptions o;
  o.max_tokens = max_tokens;
  o.max_context = context;
  o.kv_type = kv;
  if (device_experts != nullptr) {
    o.all_experts = false;
    o.device_experts = *device_experts;
  }
  return gpu_worker::make_cuda_backend(m, o);
}

struct Gap {
  double max_ref = 0, max_diff = 0;
  int64_t worst = 0;
};
Gap gap(const std::vector<float>& got, const std::vector<float>& want) {
  Gap g;
  for (size_t i = 0; i < want.size(); ++i) {
    g.max_ref = std::max(g.max_ref, std::fabs(double(want[i])));
    const double dlt = std::isfinite(got[i]) ? std::fabs(double(got[i]) - want[i]) : INFINITY;
    if (dlt > g.max_diff) g.max_diff = dlt, g.worst = static_cast<int64_t>(i);
  }
  return g;
}

struct Case {
  std::string model, variant;
  model::KvType kv = model::KvType::F32;
  std::string name() const { return model + "_" + variant + (kv == model::KvType::F16 ? "_f16kv" : ""); }
  bool exact_reference() const { return variant == "f32" && kv == model::KvType::F32; }
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name(); }

// The reference executor as the case's backend holds its cache, in float order `order`.
reference::ExecutorOptions reference_options(const Case& c, reference::DotOrderSeed order = 0) {
  return test_support::in_order(order, c.kv);
}

// The bound on max |engine - reference| / max |reference| for case c (see the header comment):
// float_order_bound.h's, an F16 cache counted as a rounding edge even for F32 weights.
test_support::OrderBound case_bound(const Case& c, const std::vector<float>& want,
                                    const std::function<std::vector<float>(reference::DotOrderSeed)>& run) {
  return test_support::bound_for(c.variant != "f32", want, run, c.kv == model::KvType::F16);
}

class CudaBackendGolden : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
    const Case& c = GetParam();
    dir_ = kGolden / c.model;
    model_ = std::make_unique<model::Model>(model::Model::load(golden_gguf(c.model, c.variant)));
    prompt_ = read_json(dir_ / "tokens.json").at("ids").get<std::vector<int32_t>>();
    backend_ = cuda_backend(*model_, kMaxTokens, 256, nullptr, c.kv);
  }
  fs::path dir_;
  std::unique_ptr<model::Model> model_;
  std::vector<int32_t> prompt_;
  std::unique_ptr<gpu_worker::Backend> backend_;
};

TEST_P(CudaBackendGolden, PrefillLogitsMatchAtEveryPosition) {
  const Case& c = GetParam();
  const int64_t V = model_->hp.n_vocab;
  const std::vector<float> got = run_step(*backend_, *model_, prompt_, true);
  reference::ReferenceExecutor ex(*model_, reference_options(c));
  const std::vector<float> ref = ex.forward(prompt_, true);
  ASSERT_EQ(got.size(), ref.size());
  const Gap vs_ref = gap(got, ref);
  std::printf("[ %s ] vs reference executor: max |logit| %.4f, max |diff| %.3g (%.3g of max) at position %lld\n",
              c.name().c_str(), vs_ref.max_ref, vs_ref.max_diff, vs_ref.max_diff / vs_ref.max_ref,
              static_cast<long long>(vs_ref.worst / V));
  if (c.exact_reference()) {
    std::vector<float> hf(got.size());
    std::ifstream f(dir_ / "logits.f32", std::ios::binary);
    ASSERT_TRUE(f.read(reinterpret_cast<char*>(hf.data()), static_cast<std::streamsize>(hf.size() * 4)))
        << "cannot read " << dir_ / "logits.f32";
    const Gap vs_hf = gap(got, hf);
    std::printf("[ %s %s ] vs transformers: max |logit| %.4f, max |diff| %.3g (%.3g of max) at position %lld\n",
                c.model.c_str(), c.variant.c_str(), vs_hf.max_ref, vs_hf.max_diff, vs_hf.max_diff / vs_hf.max_ref,
                static_cast<long long>(vs_hf.worst / V));
    EXPECT_LE(vs_hf.max_diff, 1e-4 * vs_hf.max_ref) << "worst at position " << vs_hf.worst / V;
    EXPECT_LE(vs_ref.max_diff, 1e-4 * vs_ref.max_ref) << "worst at position " << vs_ref.worst / V;
  } else {
    const test_support::OrderBound b = case_bound(c, ref, [&](reference::DotOrderSeed s) {
      return reference::ReferenceExecutor(*model_, reference_options(c, s)).forward(prompt_, true);
    });
    std::printf("[ %s ] %s\n", c.name().c_str(), b.describe().c_str());
    EXPECT_LE(vs_ref.max_diff, b.bound * vs_ref.max_ref) << "worst at position " << vs_ref.worst / V;
  }
}

TEST_P(CudaBackendGolden, GreedyTokensAndDecodeEqualsPrefill) {
  const Case& c = GetParam();
  const int64_t V = model_->hp.n_vocab;
  std::vector<int32_t> want;
  if (c.exact_reference()) {
    want = read_json(dir_ / "greedy.json").at("tokens").get<std::vector<int32_t>>();
  } else {  // the reference executor's greedy continuation on the same file (and cache type)
    reference::ReferenceExecutor ex(*model_, reference_options(c));
    std::vector<float> l = ex.forward(prompt_, false);
    for (int i = 0; i < 32; ++i) {
      want.push_back(sampling::argmax(std::span<const float>(l.data(), V)));
      const int32_t one[1] = {want.back()};
      l = ex.forward(one, false);
    }
  }
  std::vector<float> logits = run_step(*backend_, *model_, prompt_, true);
  std::vector<float> stepwise = logits;
  std::vector<int32_t> got;
  for (size_t i = 0; i < want.size(); ++i) {
    got.push_back(sampling::argmax(std::span<const float>(logits.data() + logits.size() - V, V)));
    logits = run_step(*backend_, *model_, {got.back()}, false, Drive::kGraph);
    stepwise.insert(stepwise.end(), logits.begin(), logits.end());
  }
  if (c.exact_reference() || got == want) {
    EXPECT_EQ(got, want);
  } else {
    // A quantized file or an F16 cache: the engine may part from the reference's greedy path
    // where the reference's own top two are closer than the reference moves under other valid
    // float orders (and, with F16, roundings) — a near tie, not an error. The first differing
    // token must be such a tie; after it the two paths are no longer comparable.
    size_t i = 0;
    while (got[i] == want[i]) ++i;
    const std::vector<float> rows = test_support::generation_logits(*model_, 0, prompt_, want, c.kv);
    const test_support::OrderBound b = case_bound(c, rows, [&](reference::DotOrderSeed s) {
      return test_support::generation_logits(*model_, s, prompt_, want, c.kv);
    });
    double max_ref = 0;
    for (float x : rows) max_ref = std::max(max_ref, std::fabs(double(x)));
    const float* row = rows.data() + i * V;
    const double margin = double(row[want[i]]) - row[got[i]];
    std::printf("[ %s ] greedy parts from the reference at token %zu: reference margin %.3g of max, %s\n",
                c.name().c_str(), i, margin / max_ref, b.describe().c_str());
    EXPECT_LE(margin, b.bound * max_ref) << "token " << i << ": engine " << got[i] << ", reference " << want[i];
  }

  std::vector<int32_t> all = prompt_;
  all.insert(all.end(), got.begin(), got.end());
  backend_->reset();
  EXPECT_EQ(backend_->n_past(), 0);
  const std::vector<float> once = run_step(*backend_, *model_, all, true);
  ASSERT_EQ(once.size(), stepwise.size());
  const Gap g = gap(stepwise, once);
  std::printf("[ %s ] greedy %zu tokens, %s; decode vs fresh prefill max |diff| %.3g\n", c.name().c_str(),
              got.size(), got == want ? "identical" : "DIFFERENT", g.max_diff);
  EXPECT_EQ(std::memcmp(once.data(), stepwise.data(), once.size() * 4), 0)
      << "decode after prefill differs from a fresh prefill (max |diff| " << g.max_diff << ")";
}

std::vector<Case> golden_cases(model::KvType kv) {
  std::vector<Case> cases;
  for (const auto& [m, v] : std::vector<std::pair<std::string, std::string>>{
           {"qwen3moe_odd", "f32"}, {"qwen3moe_k256", "f32"}, {"qwen3moe_odd", "q8_0"}, {"qwen3moe_k256", "q8_0"},
           {"qwen3moe_k256", "kmix"}, {"qwen3next_odd", "f32"}, {"qwen3next_k256", "f32"}, {"qwen3next_odd", "q8_0"},
           {"qwen3next_k256", "q8_0"}, {"qwen3next_k256", "kmix"},
           // The real head sizes (128; 256 gated): the tensor-core prefill attention takes only these.
           {"qwen3moe_hd128", "f32"}, {"qwen3moe_hd128", "kmix"}, {"qwen3next_hd256", "f32"},
           {"qwen3next_hd256", "kmix"},
           {"qwen3moe_k256", "hub"}, {"qwen3next_k256", "hub"}, {"qwen3moe_k256", "hub_tq"}, {"qwen3next_k256", "hub_tq"},
           // Qwen3.5-MoE: qwen3next's hybrid with tiled value heads and split beta / alpha.
           {"qwen35moe_odd", "f32"}, {"qwen35moe_odd", "q8_0"}})
    cases.push_back({m, v, kv});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Models, CudaBackendGolden, ::testing::ValuesIn(golden_cases(model::KvType::F32)),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name(); });
INSTANTIATE_TEST_SUITE_P(ModelsF16Kv, CudaBackendGolden, ::testing::ValuesIn(golden_cases(model::KvType::F16)),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name(); });

// The k256 models (rows of 256: every IQ block applies) in each IQ grid type, with the backend's
// default F16 cache. llama.cpp keeps qwen3next's ssm_out in IQ4_NL in all of them, so those
// cases also run the CUDA IQ4_NL matvec (matvec_formats_legacy.cuh).
std::vector<Case> iq_cases() {
  std::vector<Case> cases;
  for (const char* m : {"qwen3moe_k256", "qwen3next_k256"})
    for (const char* v : {"iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"})
      cases.push_back({m, v, model::KvType::F16});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(IqModels, CudaBackendGolden, ::testing::ValuesIn(iq_cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name(); });

// The cpu workers' share: the device holds the even experts only and the odd ones come from
// the host, computed by the reference kernel (as the cpu_expert_workers do) - the mixed path of
// the group (layer_begin / layer_end). Logits against the reference executor within the same
// bounds as everything on the device, greedy tokens identical.
// qwen3moe_odd q8_0 was 0.0031 of max on the H200 against the old flat 1e-3: the reference's own
// gap over other float orders of these rows is 0.045 there (a Q8_0 code and then a top-k choice
// with a router margin of 0.006 flip at decode step 1; moraine-float-order-gap --detail).
TEST_P(CudaBackendGolden, SplitExpertsMatchTheReference) {
  const Case& c = GetParam();
  const model::HParams& hp = model_->hp;
  const int64_t V = hp.n_vocab;
  std::vector<std::vector<int32_t>> even(static_cast<size_t>(hp.n_layer));
  for (auto& l : even)
    for (int32_t e = 0; e < hp.n_expert; e += 2) l.push_back(e);
  auto split = cuda_backend(*model_, kMaxTokens, 256, &even, c.kv);
  for (int64_t il = 0; il < hp.n_layer; ++il) EXPECT_FALSE(split->layer_on_device(il));
  reference::ReferenceExecutor ex(*model_, reference_options(c));
  std::vector<float> want = ex.forward(prompt_, true);
  std::vector<float> got = run_step(*split, *model_, prompt_, true, Drive::kSplit, &even);
  std::vector<int32_t> fed;
  for (int i = 0; i < 6; ++i) {
    const int32_t next = sampling::argmax(std::span<const float>(want.data() + want.size() - V, V));
    fed.push_back(next);
    EXPECT_EQ(sampling::argmax(std::span<const float>(got.data() + got.size() - V, V)), next) << "step " << i;
    const std::vector<float> w = ex.forward(std::vector<int32_t>{next}, false);
    const std::vector<float> g = run_step(*split, *model_, {next}, false, Drive::kSplit, &even);
    want.insert(want.end(), w.begin(), w.end());
    got.insert(got.end(), g.begin(), g.end());
  }
  ASSERT_EQ(got.size(), want.size());
  const Gap g = gap(got, want);
  // The same rows in other float orders: the prompt, then the same six tokens.
  const test_support::OrderBound b = case_bound(c, want, [&](reference::DotOrderSeed s) {
    reference::ReferenceExecutor other(*model_, reference_options(c, s));
    std::vector<float> l = other.forward(prompt_, true);
    for (int32_t t : fed) {
      const std::vector<float> one = other.forward(std::vector<int32_t>{t}, false);
      l.insert(l.end(), one.begin(), one.end());
    }
    return l;
  });
  std::printf("[ %s ] even experts on the device, odd on the host: max |diff| %.3g (%.3g of max), %s\n",
              c.name().c_str(), g.max_diff, g.max_diff / g.max_ref, b.describe().c_str());
  EXPECT_LE(g.max_diff, b.bound * g.max_ref);
}

// A decode step launched whole (handoff_begin), this thread computing the off-device experts at
// each layer the device hands over, as the gpu_worker does with its cpu workers.
std::vector<float> run_handoff_step(gpu_worker::Backend& b, const model::Model& m, int32_t token,
                                    HandoffBuffers& io, const std::vector<std::vector<int32_t>>& device_experts) {
  std::vector<float> logits(m.hp.n_vocab, NAN);
  if (!b.handoff_begin(&token, 1, 1, io.io())) {
    ADD_FAILURE() << "handoff_begin did not start the step";
    return logits;
  }
  for (int64_t il = 0; il < m.hp.n_layer; ++il) {
    if (b.layer_on_device(il)) continue;
    b.handoff_wait_routed(il);
    const group::ExpertPlan plan = plan_of(std::vector<int32_t>(io.chosen.begin(), io.chosen.begin() + m.hp.n_expert_used),
                                           m.hp.n_expert);
    host_experts(m, il, plan, io.h.data(), device_experts[il], io.host_rows.data());
    b.handoff_release(il, plan);
  }
  b.handoff_finish(logits.data(), nullptr, 0);
  return logits;
}

// The hand-off inside one launch gives the layer-by-layer split's logits bit for bit (the same
// kernels in the same order; only who waits for whom changes), with the routing and the host's
// rows moved by the device itself (zero copy), and a hand-off the host abandons (a cpu worker
// died) ends without a hang; after a reset the backend works again.
TEST_P(CudaBackendGolden, HandoffStepEqualsLayerByLayer) {
  const model::HParams& hp = model_->hp;
  const int64_t V = hp.n_vocab;
  std::vector<std::vector<int32_t>> even(static_cast<size_t>(hp.n_layer));
  for (auto& l : even)
    for (int32_t e = 0; e < hp.n_expert; e += 2) l.push_back(e);
  HandoffBuffers io(hp, kMaxTokens);
  auto by_layer = cuda_backend(*model_, kMaxTokens, 256, &even, GetParam().kv);
  auto handoff = cuda_backend(*model_, kMaxTokens, 256, &even, GetParam().kv);
  io.pin(*handoff);
  // The hand-off step computes the device's experts with moe_fused, which takes the quantized
  // formats whose blocks divide the expert shapes: F32 experts and the odd models' (FFN 40 of
  // hidden 96) go layer by layer.
  // It also embeds on the device (embed_rows.h): llama.cpp's IQ files keep token_embd in a K-quant.
  const bool fused = GetParam().variant != "f32" && GetParam().model.find("_odd") == std::string::npos &&
                     cuda::embed_rows_supported(model_->tok_embd.type);
  ASSERT_EQ(handoff->handoff_supported(1), fused);
  if (!fused) return;
  HandoffBuffers unpinned(hp, kMaxTokens);
  const int32_t first_token = prompt_[0];
  EXPECT_THROW(by_layer->handoff_begin(&first_token, 1, 1, unpinned.io()), std::invalid_argument)
      << "host buffers the backend did not pin";
  std::vector<float> want = run_step(*by_layer, *model_, prompt_, false, Drive::kSplit, &even);
  // The prompt layer by layer, with layer_begin captured (pinned buffers) on this side only.
  const std::vector<float> first = run_step(*handoff, *model_, prompt_, false, Drive::kSplit, &even, &io);
  ASSERT_EQ(0, std::memcmp(first.data(), want.data(), want.size() * sizeof(float)));
  for (int i = 0; i < 5; ++i) {
    const int32_t next = sampling::argmax(std::span<const float>(want.data(), V));
    want = run_step(*by_layer, *model_, {next}, false, Drive::kSplit, &even);
    const std::vector<float> got = run_handoff_step(*handoff, *model_, next, io, even);
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(float))) << "decode step " << i;
  }
  for (int i = 0; i < 2; ++i) {   // layer by layer again, layer_begin captured on one side only
    const int32_t next = sampling::argmax(std::span<const float>(want.data(), V));
    want = run_step(*by_layer, *model_, {next}, false, Drive::kSplit, &even);
    const std::vector<float> got = run_step(*handoff, *model_, {next}, false, Drive::kSplit, &even, &io);
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(float))) << "captured layer_begin, step " << i;
  }
  const int64_t past = handoff->n_past();
  const int32_t token = prompt_[0];
  ASSERT_TRUE(handoff->handoff_begin(&token, 1, 1, io.io()));
  handoff->handoff_abort();   // no layer released: the device must still finish
  EXPECT_EQ(handoff->n_past(), past);
  handoff->reset();
  by_layer->reset();
  EXPECT_EQ(0, std::memcmp(run_step(*handoff, *model_, prompt_, false, Drive::kSplit, &even, &io).data(),
                           run_step(*by_layer, *model_, prompt_, false, Drive::kSplit, &even).data(),
                           V * sizeof(float)));
}

// A prefill of 64 rows or more takes the tiled attention (attention_prefill.h; over an F16 cache the
// tensor-core attention_prefill_tc.h where it takes the shape): within the same
// bounds of the reference executor (its per-row kernels) at every position, with the exact
// matmuls; the split-KV kernel on the same rows is printed beside it. The cuBLAS path
// (gemm_prefill_rows, BF16 inputs) is not equal to the reference's quantized dots: its own bound
// is tested per product in gemm_prefill_test; here it must give finite logits and the top token
// of the reference with float activations (kFloatDots, the arithmetic cuBLAS does before its
// 16-bit rounding) wherever that reference's top two are more than 1% of max |logit| apart.
// On the H200 q8_0 of qwen3moe_odd, qwen3moe_k256, qwen3next_k256 were 0.0016 / 0.0082 / 0.0073
// of max (tiled and split-KV alike), above the old flat 1e-3: the reference against itself in
// other float orders of its dots on these 80 rows reaches 0.0097 / 0.0082 / 0.0073, and those very
// values are among its gaps (moraine-float-order-gap; tests/reference/float_order_bound.h).
TEST_P(CudaBackendGolden, LongPrefillMatchesTheReference) {
  const Case& c = GetParam();
  const int64_t V = model_->hp.n_vocab;
  std::vector<int32_t> tokens;
  while (tokens.size() < 80) tokens.insert(tokens.end(), prompt_.begin(), prompt_.end());
  tokens.resize(80);
  // The reference with its per-row kernels (it never takes matvec_tokens' AMX tiles, so `amx`
  // is the reference against itself).
  const std::vector<float> want = reference::ReferenceExecutor(*model_, reference_options(c)).forward(tokens, true);
  const Gap amx = gap(reference::ReferenceExecutor(*model_, reference_options(c)).forward(tokens, true), want);
  auto with = [&](int64_t tiled_rows, int64_t gemm_rows, bool f16 = false) {
    gpu_worker::BackendOptions o;
    o.kv_type = c.kv;
    o.max_tokens = kMaxTokens;
    o.max_context = 256;
    o.tiled_prefill_rows = tiled_rows;
    o.gemm_prefill_rows = gemm_rows;
    o.prefill_gemm_f16 = f16;
    return run_step(*gpu_worker::make_cuda_backend(*model_, o), *model_, tokens, true);
  };
  // Over an F16 cache the tiled steps take the tensor-core kernel (attention_prefill_tc.h) where it
  // takes the head size (the hd128 / hd256 models), else the F32 tiled kernel.
  const Gap g = gap(with(64, 0), want), u = gap(with(0, 0), want);
  const std::vector<float> fast = with(64, 64);
  const Gap f = gap(fast, want);
  const test_support::OrderBound b = case_bound(c, want, [&](reference::DotOrderSeed s) {
    return reference::ReferenceExecutor(*model_, reference_options(c, s)).forward(tokens, true);
  });
  // The same through F16 inputs (8x finer rounding than BF16): how much of the cuBLAS gap is the
  // 16-bit rounding of the GEMM's inputs alone. And the cuBLAS path's own oracle, the reference
  // with float activations (kFloatDots: no 8-bit activations), against which it is checked.
  const Gap f16 = gap(with(64, 64, true), want);
  const std::vector<float> want_float =
      reference::ReferenceExecutor(*model_, reference_options(c, reference::kFloatDots)).forward(tokens, true);
  const Gap ff = gap(fast, want_float);
  std::printf("[ %s ] 80-row prefill vs reference: tiled attention %.3g of max, split-KV %.3g, tiled + cuBLAS "
              "%.3g (F16 inputs %.3g; vs the float-activation reference %.3g); reference with AMX vs without %.3g; %s\n",
              c.name().c_str(), g.max_diff / g.max_ref, u.max_diff / u.max_ref, f.max_diff / f.max_ref,
              f16.max_diff / f16.max_ref, ff.max_diff / ff.max_ref, amx.max_diff / amx.max_ref, b.describe().c_str());
  EXPECT_LE(g.max_diff, b.bound * g.max_ref);
  // A clear choice: a margin above 1% of max and above what the reference moves by itself.
  cuda_arch_test::expect_clear_top_tokens(fast, want_float, V, std::max(0.01, b.bound) * g.max_ref);
}

// Long steps' staged experts (Backend::stage_experts): a backend holding the even experts of
// each layer computes the odd ones of an 80-row prefill from host memory (the model's mapping,
// copied in a few at a time) through the same GEMM as its resident ones, so its logits are the
// bits of a backend holding every expert (whose long steps take that GEMM for all of them). Short
// steps are not staged, and a resident or twice-named expert is refused.
TEST_P(CudaBackendGolden, LongStepStagedExpertsGiveTheDevicesBits) {
  const Case& c = GetParam();
  const model::HParams& hp = model_->hp;
  const int64_t n = 80, k = hp.n_expert_used;
  std::vector<int32_t> tokens;
  while (tokens.size() < static_cast<size_t>(n)) tokens.insert(tokens.end(), prompt_.begin(), prompt_.end());
  tokens.resize(static_cast<size_t>(n));
  std::vector<std::vector<int32_t>> even(static_cast<size_t>(hp.n_layer));
  for (auto& l : even)
    for (int32_t e = 0; e < hp.n_expert; e += 2) l.push_back(e);
  gpu_worker::BackendOptions o;
  o.kv_type = c.kv;
  o.max_tokens = kMaxTokens;
  o.max_context = 256;
  o.stage_experts = 3;   // rounds of 3: several per layer
  auto all = gpu_worker::make_cuda_backend(*model_, o);
  o.all_experts = false;
  o.device_experts = even;
  auto half = gpu_worker::make_cuda_backend(*model_, o);
  // Only experts the PrefillGemm takes are staged (quantized types with rows of whole 32-column
  // blocks: F32 experts and the odd shapes' stay with the cpu workers).
  bool gemm_experts = true;
  for (const model::ExpertTensor* t : {&model_->layers[0].moe.gate, &model_->layers[0].moe.up, &model_->layers[0].moe.down})
    gemm_experts = gemm_experts && cuda::matvec_supported(t->all.type) && cuda::prefill_gemm_supported(t->all.type) &&
                   t->all.n_cols % 32 == 0;
  half->embed(tokens.data(), n);
  if (!gemm_experts) {
    EXPECT_FALSE(half->stage_supported(0, n));
    return;
  }
  const std::vector<float> want = run_step(*all, *model_, tokens, true);
  std::vector<int32_t> chosen(static_cast<size_t>(n * k));
  std::vector<float> weight(static_cast<size_t>(n * k)), h(static_cast<size_t>(n * hp.n_embd));
  size_t staged_total = 0;
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    EXPECT_FALSE(half->stage_supported(il, 1)) << "a one-row step is not staged";
    ASSERT_TRUE(half->stage_supported(il, n)) << "layer " << il;
    half->layer_begin(il, n, chosen.data(), weight.data(), h.data());
    const group::ExpertPlan plan = plan_of(chosen, hp.n_expert);
    std::vector<gpu_worker::StagedExpert> staged;
    const model::MoeWeights& W = model_->layers[static_cast<size_t>(il)].moe;
    for (int32_t e = 1; e < hp.n_expert; e += 2)
      if (plan.count(e) > 0) staged.push_back({e, {W.gate.expert(e), W.up.expert(e), W.down.expert(e)}});
    ASSERT_FALSE(staged.empty()) << "layer " << il << " routed no row to an odd expert";
    const gpu_worker::StagedExpert resident{0, {W.gate.expert(0), W.up.expert(0), W.down.expert(0)}};
    EXPECT_THROW(half->stage_experts(il, std::span(&resident, 1)), std::logic_error);
    // Named in two calls (the list grows), then one of them again: refused.
    half->stage_experts(il, std::span(staged).first(1));
    half->stage_experts(il, std::span(staged).subspan(1));
    EXPECT_THROW(half->stage_experts(il, std::span(staged).first(1)), std::logic_error);
    staged_total += staged.size();
    half->layer_end(il, n, plan, nullptr);   // no host rows: every slot is the device's
  }
  half->advance(n);
  std::vector<float> got(want.size(), NAN);
  half->logits(n, got.data());
  const Gap g = gap(got, want);
  std::printf("[ %s ] %zu staged experts over %lld layers; 80-row prefill vs every expert on the device: %.3g of max\n",
              c.name().c_str(), staged_total, static_cast<long long>(hp.n_layer), g.max_diff / g.max_ref);
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
}

// A captured step replays the same kernels: step_whole (graph) and layer by layer give the same
// bits, step after step (positions come from device memory, so one graph serves them all).
TEST_P(CudaBackendGolden, GraphStepEqualsLayerByLayer) {
  std::vector<float> a = run_step(*backend_, *model_, prompt_, false);
  auto other = cuda_backend(*model_, kMaxTokens, 256, nullptr, GetParam().kv);
  std::vector<float> b = run_step(*other, *model_, prompt_, false);
  ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0);
  const int64_t V = model_->hp.n_vocab;
  for (int i = 0; i < 8; ++i) {
    const int32_t next = sampling::argmax(std::span<const float>(a.data(), V));
    a = run_step(*backend_, *model_, {next}, false, Drive::kGraph);
    b = run_step(*other, *model_, {next}, false, Drive::kLayers);
    ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << "decode step " << i;
  }
}

// The conversation cache (Backend::save_state / load_state): the prompt's sequence saved, the
// backend reset and run on another sequence, the saved one loaded back: its decode steps give
// the bits of a backend that never left it, through the captured graph and layer by layer.
TEST_P(CudaBackendGolden, SavedSequenceContinuesAsIfNeverLeft) {
  ASSERT_TRUE(backend_->can_save_state());
  auto straight = cuda_backend(*model_, kMaxTokens, 256, nullptr, GetParam().kv);
  std::vector<float> a = run_step(*straight, *model_, prompt_, false);
  run_step(*backend_, *model_, prompt_, false);
  gpu_worker::Backend::HostBuffer buf = backend_->host_buffer(backend_->state_bytes());
  const std::span<uint8_t> saved(buf.data.get(), backend_->state_bytes());
  backend_->save_state(saved);
  backend_->reset();
  std::vector<int32_t> other(prompt_.rbegin(), prompt_.rend());
  run_step(*backend_, *model_, other, false);
  EXPECT_THROW(backend_->load_state(std::span<const uint8_t>(saved.data(), saved.size() - 2)), std::invalid_argument);
  EXPECT_EQ(backend_->n_past(), static_cast<int64_t>(other.size()));
  backend_->load_state(saved);
  EXPECT_EQ(backend_->n_past(), static_cast<int64_t>(prompt_.size()));
  const int64_t V = model_->hp.n_vocab;
  for (int i = 0; i < 6; ++i) {
    const int32_t next = sampling::argmax(std::span<const float>(a.data(), V));
    const Drive drive = i % 2 == 0 ? Drive::kGraph : Drive::kLayers;
    a = run_step(*straight, *model_, {next}, false, drive);
    const std::vector<float> b = run_step(*backend_, *model_, {next}, false, drive);
    ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << "decode step " << i << " after the load";
  }
}

// Greedy decode's token (Backend::set_token_output): the device's argmax of the last logits row
// (kernels/cuda/argmax.cu, the id written into pinned host memory, no logits copied) is the
// sampler's argmax of the row another backend copies out, step after step, through the captured
// graph and layer by layer; its non-finite report (StepHeader::check_finite) says -1 for these
// finite rows (argmax_test plants NaNs and infinities).
TEST_P(CudaBackendGolden, GreedyTokenIsTheArgmaxOfTheLogits) {
  auto other = cuda_backend(*model_, kMaxTokens, 256, nullptr, GetParam().kv);
  int32_t token = -1, nonfinite = -2;
  other->set_token_output(&token, &nonfinite);
  std::vector<float> a = run_step(*backend_, *model_, prompt_, false);
  run_step(*other, *model_, prompt_, false);
  const int64_t V = model_->hp.n_vocab;
  for (int i = 0; i < 8; ++i) {
    const int32_t want = sampling::argmax(std::span<const float>(a.data(), V));
    ASSERT_EQ(token, want) << "step " << i;
    ASSERT_EQ(nonfinite, -1) << "step " << i;
    token = -1;
    nonfinite = -2;
    const Drive drive = i % 2 == 0 ? Drive::kGraph : Drive::kLayers;
    a = run_step(*backend_, *model_, {want}, false, drive);
    run_step(*other, *model_, {want}, false, drive);
  }
  EXPECT_EQ(token, sampling::argmax(std::span<const float>(a.data(), V)));
}

TEST(CudaBackend, RejectsBadInputWithoutCrashing) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const model::Model m = model::Model::load(golden_gguf("qwen3moe_odd", "f32"));
  auto b = cuda_backend(m, 4, 8);
  const int32_t bad[1] = {static_cast<int32_t>(m.hp.n_vocab)};
  EXPECT_THROW(b->embed(bad, 1), std::invalid_argument);
  const int32_t ok[5] = {1, 1, 1, 1, 1};
  EXPECT_THROW(b->embed(ok, 5), std::invalid_argument);  // more rows than max_tokens
  std::vector<int32_t> chosen(64);
  EXPECT_THROW(b->layer_whole(0, 1, chosen.data()), std::invalid_argument);  // no step started
  b->advance(7);  // one position left in the context of 8
  EXPECT_THROW(b->embed(ok, 2), std::runtime_error);
  std::vector<float> logits(2 * m.hp.n_vocab);
  EXPECT_THROW(b->step_whole(ok, 2, 1, logits.data(), nullptr, 0), std::runtime_error);
  std::vector<std::vector<int32_t>> bad_ids(static_cast<size_t>(m.hp.n_layer), std::vector<int32_t>{3, 1});
  EXPECT_THROW(cuda_backend(m, 4, 8, &bad_ids), std::invalid_argument);  // not ascending
}

// The backend allocates its step scratch from gpu_worker/cuda_step_scratch.h's list, which the
// coordinator charges against --vram: the device-buffer bytes the backend's construction added
// beyond the weights are exactly the list's (16-byte rounded as DeviceBuffer asks cudaMalloc),
// and the coordinator's list (coordinator/device_reserve.h) has every one of its buffers at least
// as large. Both expert paths: F32 experts take the batched matvec path at any step length
// (moe_fused takes quantized experts), kmix's Q4_K experts moe_fused; 80-row steps add the
// PrefillGemm; all experts on the device or the even ones only; short and odd contexts.
TEST(CudaBackend, ScratchIsTheListedBuffers) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  for (const char* name : {"qwen3moe_k256", "qwen3next_k256"}) {
    for (const char* variant : {"f32", "kmix"}) {
      const model::Model m = model::Model::load(golden_gguf(name, variant));
      std::vector<std::vector<int32_t>> even(static_cast<size_t>(m.hp.n_layer));
      for (auto& ids : even)
        for (int32_t e = 0; e < m.hp.n_expert; e += 2) ids.push_back(e);
      for (int T : {1, 16, 80}) {
        for (int64_t ctx : {int64_t{96}, int64_t{1000}}) {
          for (bool split : {false, true}) {
            SCOPED_TRACE(std::string(name) + "_" + variant + " max_tokens " + std::to_string(T) + " context " +
                         std::to_string(ctx) + (split ? " even experts" : " all experts"));
            auto b = cuda_backend(m, T, ctx, split ? &even : nullptr);
            const auto* cb = dynamic_cast<const gpu_worker::cuda_impl::CudaBackend*>(b.get());
            ASSERT_NE(cb, nullptr);
            const gpu_worker::CudaStepScratch& s = cb->step_scratch();
            EXPECT_EQ(cb->step_scratch_allocated_bytes(), s.total(16));
            EXPECT_EQ(s.has("expert_in"), std::string(variant) == "f32" || T >= 64);
            EXPECT_EQ(s.has("moe_fused_ws"), std::string(variant) == "kmix");
            EXPECT_EQ(s.has("gemm_weights"), T >= 64);
            const gpu_worker::CudaStepScratch reserve =
                gpu_worker::cuda_step_scratch(m.hp, group::cuda_reserve_scratch_options(m.layers, T, ctx));
            for (const gpu_worker::ScratchBuffer& buf : s.buffers)
              EXPECT_GE(reserve.bytes(buf.name), buf.bytes) << buf.name;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace moraine
