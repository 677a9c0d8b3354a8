// For every format moraine writes, a GGUF file written by moraine is read by llama.cpp
// (node-llama-cpp on CPU) with the same values: the probe model's logits expose output.weight
// column by column (see probe_model.h), and compare with moraine's dequantize_row, with
// moraine's vec_dot_reference against the activation quantized the way ggml pairs it, and with
// every CPU kernel tier (kernels/cpu) this machine can run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "common/formats/tensor_type.h"
#include "common/gguf/gguf.h"
#include "kernels/cpu/vec_dot.h"
#include "tests/interop/llama_oracle.h"
#include "tests/interop/probe_model.h"

namespace moraine::test {
namespace {

constexpr int64_t N = ProbeModel::kEmbd;
constexpr int64_t V = ProbeModel::kVocab;
constexpr double kUnitRoundoff = 1.0 / (1 << 24);  // float32: half an ulp of 1

const TensorType kFormats[] = {TensorType::F32,  TensorType::F16,  TensorType::BF16, TensorType::Q8_0,
                               TensorType::Q4_0, TensorType::Q4_K, TensorType::Q5_K, TensorType::Q6_K,
                               TensorType::Q2_K, TensorType::Q3_K, TensorType::MXFP4,
                               TensorType::Q4_1, TensorType::Q5_0, TensorType::Q5_1, TensorType::IQ4_NL, TensorType::IQ4_XS,
                               TensorType::TQ1_0, TensorType::TQ2_0};

struct FormatCase {
  TensorType type;
  std::string path;
  std::vector<uint8_t> bytes;  // [V rows] of row_bytes(type, N)
  std::vector<float> deq;      // [V][N], moraine's dequantize_row of `bytes`
  std::vector<float> block_max;  // [V][N]: largest |deq| in the block holding the element
};

// Random rows like real weights: per-row scale and a small per-row offset, so formats with a
// block minimum (Q2_K, Q4_K, Q5_K) see blocks that are not centred on zero.
FormatCase make_case(TensorType type, std::mt19937_64& rng, const std::string& dir) {
  FormatCase c;
  c.type = type;
  c.path = dir + "/probe-" + std::string(type_name(type)) + ".gguf";
  const size_t rb = row_bytes(type, N);
  c.bytes.resize(rb * V);
  c.deq.resize(V * N);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> scale_dist(0.005f, 0.1f), offset_dist(-0.5f, 0.5f);
  std::vector<float> row(N);
  for (int64_t v = 0; v < V; ++v) {
    const float scale = scale_dist(rng), offset = offset_dist(rng) * scale;
    for (float& x : row) x = offset + scale * normal(rng);
    quantize_row(type, row.data(), &c.bytes[v * rb], N);
    dequantize_row(type, &c.bytes[v * rb], &c.deq[v * N], N);
  }
  const int64_t block = type_traits(type).block_elems;
  c.block_max.resize(V * N);
  for (int64_t i = 0; i < V * N; i += block) {
    float m = 0.0f;
    for (int64_t j = 0; j < block; ++j) m = std::max(m, std::fabs(c.deq[i + j]));
    std::fill(&c.block_max[i], &c.block_max[i] + block, m);
  }
  return c;
}

TEST(LlamaInterop, EveryFormatIsReadByLlamaCppWithTheSameValues) {
  ScratchDir dir("interop");
  const ProbeModel probe(/*seed=*/20261129);
  std::mt19937_64 rng(7);
  std::vector<FormatCase> cases;
  std::vector<std::string> paths;
  for (TensorType t : kFormats) {
    cases.push_back(make_case(t, rng, dir.path()));
    probe.write(cases.back().path, t, cases.back().bytes);
    paths.push_back(cases.back().path);
  }
  const auto reports = run_llama_oracle(paths, static_cast<int>(V), dir.path());

  for (const FormatCase& c : cases) {
    const std::string name(type_name(c.type));
    SCOPED_TRACE(name);
    const LlamaReport& r = reports.at(c.path);
    ASSERT_TRUE(r.loaded) << "llama.cpp refused " << c.path << ": " << r.error;
    ASSERT_EQ(r.n_vocab, V);

    // The tensor types llama.cpp's side reports are the ones moraine wrote and reads back.
    const auto file = gguf::GgufFile::open(c.path);
    ASSERT_EQ(r.tensor_types.size(), file.tensors().size());
    for (const auto& ti : file.tensors()) {
      ASSERT_TRUE(r.tensor_types.count(ti.name)) << ti.name;
      EXPECT_EQ(r.tensor_types.at(ti.name), static_cast<uint32_t>(ti.type)) << ti.name;
    }
    EXPECT_EQ(r.tensor_types.at("output.weight"), static_cast<uint32_t>(c.type));

    // 1. One-hot tokens: logit[t][v] = c_t * W[v][t]. ggml applies a block's scale and its
    // minimum as separately rounded float products, moraine as d*sc*q - dmin*m then * c_t; each
    // term is at most 2*M_b (M_b = largest |value| in the block: a quantizer keeps 0 inside a
    // block's range, so the minimum term never exceeds M_b), and the two sides round at most four
    // times between them: |diff| <= 4 * u * 2 * M_b * c_t.
    int64_t onehot_bad = 0, onehot_exact = 0;
    double onehot_worst = 0.0;  // in units of u * c_t * M_b
    for (int64_t t = 0; t < N; ++t) {
      const float ct = probe.one_hot_value(t);
      for (int64_t v = 0; v < V; ++v) {
        const float expected = c.deq[v * N + t] * ct;
        const float got = r.logits[t * V + v];
        const double diff = std::fabs(double(got) - double(expected));
        const double unit = kUnitRoundoff * ct * c.block_max[v * N + t];
        onehot_exact += diff == 0.0;
        if (unit > 0) onehot_worst = std::max(onehot_worst, diff / unit);
        if (!(diff <= 8.0 * unit)) {
          if (onehot_bad++ < 5) {
            ADD_FAILURE() << "one-hot token " << t << ", row " << v << ": llama.cpp " << got
                          << ", moraine dequantize_row x " << ct << " = " << expected;
          }
        }
      }
    }
    EXPECT_EQ(onehot_bad, 0) << "of " << N * V << " weights";

    // 2. All tokens: logit[t][v] = dot(W[v], act_t), act_t = hidden quantized to
    // dot_activation_type (exact by construction). Both sides sum the same partial products in
    // different orders, so each is within gamma_(N+1) * sum|terms| of the exact sum (Higham,
    // Accuracy and Stability, eq. 3.5); terms are bounded by 2 * M_b * |a_k| as above.
    // The same holds for each CPU kernel tier, fed by the kernels' own activation quantizer
    // (which must match quantize_row byte for byte).
    struct Dot {
      std::string label;
      cpu::VecDotFn fn;  // nullptr: vec_dot_reference
      int64_t bad = 0;
      double worst = 0.0;  // |diff| / sum|terms|
    };
    std::vector<Dot> dots = {{"vec_dot_reference", nullptr}};
    for (cpu::CpuIsa isa : {cpu::CpuIsa::Scalar, cpu::CpuIsa::Avx2, cpu::CpuIsa::Avx512, cpu::CpuIsa::Avx512Vnni}) {
      if (cpu::VecDotFn fn = cpu::vec_dot_fn(c.type, isa)) dots.push_back({"cpu " + std::string(cpu::isa_name(isa)), fn});
    }
    const TensorType act_type = dot_activation_type(c.type);
    const int64_t block = type_traits(c.type).block_elems;
    const size_t wrb = row_bytes(c.type, N);
    std::vector<uint8_t> act(row_bytes(act_type, N)), act_kernel(act.size());
    std::vector<float> act_deq(N);
    for (int64_t t = 0; t < V; ++t) {
      const std::vector<float> h = probe.hidden(t);
      quantize_row(act_type, h.data(), act.data(), N);
      cpu::quantize_activation_row(act_type, h.data(), act_kernel.data(), N);
      ASSERT_EQ(act, act_kernel) << "cpu::quantize_activation_row differs from quantize_row, token " << t;
      dequantize_row(act_type, act.data(), act_deq.data(), N);
      std::vector<double> act_abs_per_block(N / block, 0.0);
      for (int64_t k = 0; k < N; ++k) act_abs_per_block[k / block] += std::fabs(act_deq[k]);
      for (int64_t v = 0; v < V; ++v) {
        double terms = 0.0;  // sum over k of 2 * M_b(v, k) * |a_k|
        for (int64_t b = 0; b < N / block; ++b) terms += 2.0 * c.block_max[v * N + b * block] * act_abs_per_block[b];
        const float got = r.logits[t * V + v];
        for (Dot& d : dots) {
          const float ours = d.fn ? d.fn(N, &c.bytes[v * wrb], act.data())
                                  : vec_dot_reference(c.type, N, &c.bytes[v * wrb], act.data());
          const double diff = std::fabs(double(got) - double(ours));
          if (terms > 0) d.worst = std::max(d.worst, diff / terms);
          if (!(diff <= 2.0 * (N + 2) * kUnitRoundoff * terms) && d.bad++ < 5) {
            ADD_FAILURE() << "token " << t << ", row " << v << ": llama.cpp " << got << ", moraine "
                          << d.label << " " << ours << " (sum|terms| " << terms << ")";
          }
        }
      }
    }
    std::printf("%-6s one-hot: %5.1f%% bit-exact, worst %.2f u*c*M_b (bound 8); worst |diff|/sum|terms| "
                "(bound %.3g):", name.c_str(), 100.0 * onehot_exact / (N * V), onehot_worst,
                2.0 * (N + 2) * kUnitRoundoff);
    for (const Dot& d : dots) {
      EXPECT_EQ(d.bad, 0) << d.label << ": of " << V * V << " dot products";
      std::printf(" %s %.3g;", d.label.c_str(), d.worst);
    }
    std::printf("\n");
  }
}

}  // namespace
}  // namespace moraine::test
