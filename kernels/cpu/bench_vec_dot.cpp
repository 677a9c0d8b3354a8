// moraine-vec-dot-bench: weight-row throughput of every CPU dot kernel, scalar vs AVX2 vs
// AVX-512, up to the tier --isa allows.
// One "iteration" dots a 1024 x 4096 weight matrix (random gaussian, quantized once) with one
// activation row, the shape of one expert projection; GB/s counts weight bytes (1e9 base).
#include <benchmark/benchmark.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "common/formats/quant_iq.h"
#include "kernels/cpu/vec_dot.h"

namespace {

using moraine::TensorType;
constexpr int64_t kCols = 4096;
constexpr int64_t kRows = 1024;

struct Matrix {
  std::vector<uint8_t> weights;
  std::vector<uint8_t> act;
  size_t row_bytes = 0;
};

Matrix make_matrix(TensorType t) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> row(kCols);
  Matrix m;
  m.row_bytes = moraine::row_bytes(t, kCols);
  m.weights.resize(m.row_bytes * kRows);
  if (moraine::formats::is_iq_grid_type(t)) {
    // moraine does not write IQ types: random blocks (any byte is a valid index, sign or scale)
    // with a small finite fp16 scale: the high byte of d (IQ1_M: of scale word 3, whose top
    // nibble is the fp16's sign and top exponent bits).
    for (uint8_t& b : m.weights) b = static_cast<uint8_t>(rng());
    const size_t bb = moraine::type_traits(t).block_bytes, high = t == TensorType::IQ1_M ? 55 : 1;
    for (size_t off = 0; off < m.weights.size(); off += bb) m.weights[off + high] = t == TensorType::IQ1_M ? 0x10 : 0x20;
  } else {
    for (int64_t r = 0; r < kRows; ++r) {
      for (float& v : row) v = dist(rng);
      moraine::quantize_row(t, row.data(), m.weights.data() + r * m.row_bytes, kCols);
    }
  }
  for (float& v : row) v = dist(rng);
  const TensorType act = moraine::dot_activation_type(t);
  m.act.resize(moraine::row_bytes(act, kCols));
  moraine::cpu::quantize_activation_row(act, row.data(), m.act.data(), kCols);
  return m;
}

void run(benchmark::State& state, TensorType t, moraine::cpu::VecDotFn fn) {
  const Matrix m = make_matrix(t);
  float sink = 0.0f;
  for (auto _ : state) {
    for (int64_t r = 0; r < kRows; ++r) sink += fn(kCols, m.weights.data() + r * m.row_bytes, m.act.data());
    benchmark::DoNotOptimize(sink);
  }
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(m.row_bytes * kRows),
                                              benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}

}  // namespace

int main(int argc, char** argv) {
  using moraine::cpu::CpuIsa;
  CpuIsa cap = CpuIsa::Amx;
  // --isa NAME caps the tiers registered (the rest of argv goes to Google Benchmark).
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    std::string value;
    if (arg == "--isa" && i + 1 < argc) value = argv[i + 1];
    else if (arg.rfind("--isa=", 0) == 0) value = arg.substr(6);
    else continue;
    const auto isa = moraine::cpu::parse_isa(value);
    if (!isa) {
      std::fprintf(stderr, "moraine-vec-dot-bench: --isa %s: expected scalar, avx2, avx512, avx512vnni or amx\n", value.c_str());
      return 2;
    }
    cap = *isa;
    const int consumed = arg == "--isa" ? 2 : 1;
    for (int j = i; j + consumed < argc; ++j) argv[j] = argv[j + consumed];
    argc -= consumed;
    --i;
  }
  const TensorType types[] = {TensorType::F32,  TensorType::F16,  TensorType::BF16, TensorType::Q8_0,
                              TensorType::Q4_0, TensorType::MXFP4, TensorType::Q2_K, TensorType::Q3_K,
                              TensorType::Q4_K, TensorType::Q5_K, TensorType::Q6_K,
                              TensorType::Q4_1, TensorType::Q5_0, TensorType::Q5_1, TensorType::IQ4_NL, TensorType::IQ4_XS,
                              TensorType::TQ1_0, TensorType::TQ2_0,
                              TensorType::IQ2_XXS, TensorType::IQ2_XS, TensorType::IQ2_S, TensorType::IQ3_XXS,
                              TensorType::IQ3_S, TensorType::IQ1_S, TensorType::IQ1_M};
  for (TensorType t : types) {
    for (CpuIsa isa : {CpuIsa::Scalar, CpuIsa::Avx2, CpuIsa::Avx512, CpuIsa::Avx512Vnni}) {
      if (static_cast<int>(isa) > static_cast<int>(cap)) continue;
      moraine::cpu::VecDotFn fn = moraine::cpu::vec_dot_fn(t, isa);
      // Float kernels are registered under Avx512 only; the VNNI tier returns the same ones.
      if (!fn || (isa == CpuIsa::Avx512Vnni && fn == moraine::cpu::vec_dot_fn(t, CpuIsa::Avx512))) continue;
      const std::string name = std::string(moraine::type_name(t)) + "/" + std::string(moraine::cpu::isa_name(isa));
      benchmark::RegisterBenchmark(name.c_str(), run, t, fn)->Unit(benchmark::kMillisecond);
    }
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
