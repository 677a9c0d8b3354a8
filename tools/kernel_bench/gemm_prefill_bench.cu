// Prefill GEMM bench. Weights are quantized template rows replicated on the device (speed does
// not depend on the values); dense matrices are cycled over copies filling >= 256 MiB, so the
// expansion reads its quantized bytes from HBM as a real layer sweep does (the expanded matrix
// it writes is then read by the GEMM from wherever it sits, as in the real call).
#include "tools/kernel_bench/gemm_prefill_bench.h"
#include "tools/kernel_bench/gemm_bench_inputs.h"
#include "tools/kernel_bench/cuda_timing.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/dequantize_weights.h"
#include "kernels/cuda/expert_gemm.h"
#include "kernels/cuda/gemm_prefill.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/quantize_activations.h"

namespace moraine::kernel_bench {
namespace {

using cuda::DeviceBuffer;

struct DensePoint {
  std::string shape, format;
  int64_t rows, cols, n;
  double call_us, call_tflops, gemm_us, gemm_tflops, dequant_us, dequant_gbps;
};

struct DenseShape {
  const char* name;
  int64_t rows, cols;
};

std::vector<DensePoint> bench_dense(cublasHandle_t h, double min_ms) {
  // Qwen3-30B-A3B: attention q (32 heads x 128), k / v (4 x 128), o, one expert's gate/up and
  // down, the output head.
  const DenseShape shapes[] = {{"attn_q", 4096, 2048},  {"attn_k/v", 512, 2048}, {"attn_o", 2048, 4096},
                               {"ffn_gate/up", 768, 2048}, {"ffn_down", 2048, 768}, {"output", 151936, 2048}};
  const TensorType formats[] = {TensorType::Q4_K, TensorType::Q6_K, TensorType::Q8_0};
  const int64_t ns[] = {512, 8192};
  cuda::PrefillGemmLimits lim;  // the defaults: max_tokens 8192, max_cols 4096, 20 Mi-element workspace
  cuda::PrefillGemm gemm(nullptr, lim);
  std::vector<DensePoint> out;
  const size_t x_elems = size_t{8192} * 4096;
  DeviceBuffer<float> dx = random_input(x_elems);
  DeviceBuffer<uint16_t> xb(x_elems);
  cuda::convert_gemm_input(dx.get(), static_cast<int64_t>(x_elems), cuda::GemmInput::BF16, xb.get());
  for (const DenseShape& s : shapes) {
    const size_t elems = static_cast<size_t>(s.rows * s.cols);
    DeviceBuffer<uint16_t> expanded(elems);
    DeviceBuffer<float> y(static_cast<size_t>(8192 * s.rows));
    for (TensorType t : formats) {
      const size_t mat = row_bytes(t, s.cols) * static_cast<size_t>(s.rows);
      const size_t copies = std::max<size_t>(1, (size_t{256} << 20) / mat);
      DeviceBuffer<uint8_t> pool = make_matrices(t, s.rows, s.cols, copies);
      auto weight = [&](int i) { return static_cast<const void*>(pool.get() + (static_cast<size_t>(i) % copies) * mat); };
      const double dq_ms = ms_per_call(
          [&](int i) {
            const void* w = weight(i);
            cuda::dequantize_weights(t, &w, 1, static_cast<int64_t>(elems), cuda::GemmInput::BF16, expanded.get());
          },
          min_ms);
      for (int64_t n : ns) {
        const double call_ms = ms_per_call(
            [&](int i) { gemm.matmul(t, weight(i), s.rows, s.cols, dx.get(), n, y.get()); }, min_ms);
        const float alpha = 1.0f, beta = 0.0f;
        const double gemm_ms = ms_per_call(
            [&](int) {
              cublas_check(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(s.rows), static_cast<int>(n),
                                        static_cast<int>(s.cols), &alpha, expanded.get(), CUDA_R_16BF,
                                        static_cast<int>(s.cols), xb.get(), CUDA_R_16BF, static_cast<int>(s.cols), &beta,
                                        y.get(), CUDA_R_32F, static_cast<int>(s.rows), CUBLAS_COMPUTE_32F,
                                        CUBLAS_GEMM_DEFAULT),
                           "dense gemm");
            },
            min_ms);
        const double flop = 2.0 * static_cast<double>(n) * static_cast<double>(elems);
        out.push_back({s.name, std::string(type_name(t)), s.rows, s.cols, n, call_ms * 1e3, flop / call_ms / 1e9,
                       gemm_ms * 1e3, flop / gemm_ms / 1e9, dq_ms * 1e3,
                       static_cast<double>(mat + 2 * elems) / dq_ms / 1e6});
      }
    }
  }
  return out;
}

// Token counts of 128 experts for n tokens routed top-8 (8n rows, at most n per expert):
// uniform, or Zipf-skewed (expert of rank e gets a share ~ 1 / (e + 1), capped at n, the excess
// spread over the others), shuffled so the big groups are not all in the first chunk.
std::vector<int64_t> expert_counts(int experts, int64_t n, bool zipf) {
  const int64_t total = 8 * n;
  std::vector<int64_t> c(static_cast<size_t>(experts), 0);
  std::vector<double> share(static_cast<size_t>(experts));
  for (int e = 0; e < experts; ++e) share[static_cast<size_t>(e)] = zipf ? 1.0 / (e + 1) : 1.0;
  int64_t left = total;
  while (left > 0) {
    double open = 0.0;
    for (int e = 0; e < experts; ++e)
      if (c[static_cast<size_t>(e)] < n) open += share[static_cast<size_t>(e)];
    int64_t given = 0;
    for (int e = 0; e < experts && open > 0.0; ++e) {
      int64_t& ce = c[static_cast<size_t>(e)];
      if (ce >= n) continue;
      const auto add = std::min<int64_t>(n - ce, static_cast<int64_t>(static_cast<double>(left) * share[static_cast<size_t>(e)] / open));
      ce += add;
      given += add;
    }
    if (given == 0)  // rounding left a few rows: one each to the open experts, in rank order
      for (int e = 0; e < experts && given < left; ++e)
        if (c[static_cast<size_t>(e)] < n) ++c[static_cast<size_t>(e)], ++given;
    left -= given;
  }
  std::shuffle(c.begin(), c.end(), std::mt19937(5));
  return c;
}

struct LayerPoint {
  std::string shape, split;
  int64_t n;          // tokens of the step (8n expert rows)
  int64_t min_count, max_count;
  double loop_us = 0, kernel_us = 0, large_us = 0, small_us = 0, whole_us = 0, gemm_only_us = 0;
  double fused_us = 0, fused_large_us = 0, fused_small_us = 0, wide_us = 0, fused_wide_us = 0, auto_us = 0;
  double tall_us = 0, fused_tall_us = 0;
  // gate + up as the backend runs them (two auto calls on the same X): X rounded by each call,
  // or by the first only (reuse_input); NaN for the down shapes.
  double pair_us = std::nan(""), pair_reuse_us = std::nan("");
  std::string chosen = {};  // tile shape the kernel path chose
  double flop = 0;
};

struct ExpertPoint {
  std::string shape;
  int64_t rows_per_expert;
  double kernel_us, fused_us, loop_us, matvec_us;  // matvec_us < 0: not measured
  std::string tiles;  // the shape chosen
  double kernel_tflops;
};

struct ExpertBench {
  std::vector<LayerPoint> layers;
  std::vector<ExpertPoint> per_expert;
  std::vector<std::string> failures;  // calls that threw (their time is NaN); reported after the tables
};

ExpertBench bench_experts(double min_ms) {
  constexpr int kExperts = 128;
  struct ExpertShape {
    const char* name;
    int64_t rows, cols;
    TensorType type;
  };
  // q4_k gate/up and down; and q6_k down, which Q4_K_M models use for some layers' ffn_down
  // (fused since session 11; before, expanded or the cuBLAS loop).
  const ExpertShape shapes[] = {{"128x(768x2048)", 768, 2048, TensorType::Q4_K},
                                {"128x(2048x768)", 2048, 768, TensorType::Q4_K},
                                {"q6k:128x(2048x768)", 2048, 768, TensorType::Q6_K}};
  const int64_t per_expert[] = {1, 4, 16, 32, 64, 512};  // 32: pp512 with 8 of 128 experts, 512: pp8192
  using Path = cuda::PrefillGemm::ExpertPath;
  ExpertBench out;
  for (const ExpertShape& s : shapes) {
    const TensorType kType = s.type;
    const size_t mat = row_bytes(kType, s.cols) * static_cast<size_t>(s.rows);
    const int64_t elems = s.rows * s.cols;
    DeviceBuffer<uint8_t> pool = make_matrices(kType, s.rows, s.cols, kExperts);
    const int64_t max_rows = kExperts * 512;
    // As the CUDA backend configures it (default workspace: 13 matrices of 768 x 2048 a chunk),
    // and with a workspace holding the whole layer (one chunk, one launch of each kernel).
    cuda::PrefillGemmLimits lim;
    lim.max_tokens = max_rows;
    lim.max_cols = 2048;
    lim.max_experts = kExperts;
    cuda::PrefillGemm gemm(nullptr, lim);
    cuda::PrefillGemmLimits whole_lim = lim;
    whole_lim.weight_workspace_elems = int64_t{kExperts} * elems;
    cuda::PrefillGemm whole(nullptr, whole_lim);
    DeviceBuffer<float> dx = random_input(static_cast<size_t>(max_rows * s.cols));
    DeviceBuffer<float> y(static_cast<size_t>(max_rows * s.rows));
    // The GEMM alone: the whole layer expanded once, X rounded once.
    DeviceBuffer<uint16_t> expanded(static_cast<size_t>(kExperts * elems)), xb(static_cast<size_t>(max_rows * s.cols));
    {
      std::vector<const void*> ptrs;
      for (int e = 0; e < kExperts; ++e) ptrs.push_back(pool.get() + static_cast<size_t>(e) * mat);
      cuda::dequantize_weights(kType, ptrs.data(), kExperts, elems, cuda::GemmInput::BF16, expanded.get());
      cuda::convert_gemm_input(dx.get(), max_rows * s.cols, cuda::GemmInput::BF16, xb.get());
    }
    const auto groups_of = [&](const std::vector<int64_t>& counts) {
      std::vector<cuda::ExpertRows> g;
      int64_t at = 0;
      for (int e = 0; e < kExperts; ++e) {
        g.push_back({pool.get() + static_cast<size_t>(e) * mat, at, counts[static_cast<size_t>(e)]});
        at += counts[static_cast<size_t>(e)];
      }
      return g;
    };
    // A call that throws (a launch refused for one tile shape, say) costs its column, not the
    // whole table: the error is kept and raised once every table is printed.
    const auto time_call = [&](cuda::PrefillGemm& g, Path path, std::optional<cuda::ExpertTiles> tiles,
                               const std::vector<cuda::ExpertRows>& groups) {
      g.set_expert_path(path);
      g.force_expert_tiles(tiles);
      try {
        return 1e3 * ms_per_call([&](int) { g.matmul_experts(kType, groups, s.rows, s.cols, dx.get(), y.get()); },
                                 min_ms);
      } catch (const std::exception& e) {
        out.failures.push_back(std::string(s.name) + " tiles " + (tiles ? cuda::expert_tiles_name(*tiles) : "chosen") +
                               ": " + e.what());
        return std::nan("");
      }
    };
    for (int64_t n : {int64_t{512}, int64_t{4096}, int64_t{8192}})
      for (bool zipf : {false, true}) {
        const std::vector<int64_t> counts = expert_counts(kExperts, n, zipf);
        const std::vector<cuda::ExpertRows> groups = groups_of(counts);
        LayerPoint p{s.name, zipf ? "zipf" : "uniform", n, *std::min_element(counts.begin(), counts.end()),
                     *std::max_element(counts.begin(), counts.end())};
        p.loop_us = time_call(gemm, Path::CublasLoop, std::nullopt, groups);
        p.kernel_us = time_call(gemm, Path::Expanded, std::nullopt, groups);
        p.chosen = cuda::expert_tiles_name(gemm.last_expert_tiles());
        p.large_us = time_call(gemm, Path::Expanded, cuda::ExpertTiles::Large, groups);
        p.small_us = time_call(gemm, Path::Expanded, cuda::ExpertTiles::Small, groups);
        p.wide_us = time_call(gemm, Path::Expanded, cuda::ExpertTiles::Wide, groups);
        p.tall_us = time_call(gemm, Path::Expanded, cuda::ExpertTiles::Tall, groups);
        p.whole_us = time_call(whole, Path::Expanded, std::nullopt, groups);
        p.fused_us = time_call(gemm, Path::Fused, std::nullopt, groups);
        if (gemm.last_call_fused() != cuda::expert_gemm_fused_supported(kType))
          throw std::logic_error("gemm_prefill bench: the fused path did not run where it applies");
        p.fused_large_us = time_call(gemm, Path::Fused, cuda::ExpertTiles::Large, groups);
        p.fused_small_us = time_call(gemm, Path::Fused, cuda::ExpertTiles::Small, groups);
        p.fused_wide_us = time_call(gemm, Path::Fused, cuda::ExpertTiles::Wide, groups);
        p.fused_tall_us = time_call(gemm, Path::Fused, cuda::ExpertTiles::Tall, groups);
        p.auto_us = time_call(gemm, Path::Auto, std::nullopt, groups);
        if (s.rows < s.cols) {  // a gate/up shape: the pair on one X (the same weights twice)
          gemm.set_expert_path(Path::Auto);
          gemm.force_expert_tiles(std::nullopt);
          for (bool reuse : {false, true})
            (reuse ? p.pair_reuse_us : p.pair_us) = 1e3 * ms_per_call(
                [&](int) {
                  gemm.matmul_experts(kType, groups, s.rows, s.cols, dx.get(), y.get());
                  gemm.matmul_experts(kType, groups, s.rows, s.cols, dx.get(), y.get(), 1, 0, reuse);
                },
                min_ms);
        }
        std::vector<cuda::ExpertGemmTile> tiles;
        const cuda::ExpertTiles shape = whole.last_expert_tiles();
        for (int e = 0; e < kExperts; ++e)
          cuda::expert_gemm_tiles(shape, e, groups[static_cast<size_t>(e)].first_row, groups[static_cast<size_t>(e)].count,
                                  tiles);
        DeviceBuffer<cuda::ExpertGemmTile> dt = cuda::uploaded(tiles);
        try {
          p.gemm_only_us = 1e3 * ms_per_call(
                                     [&](int) {
                                       cuda::expert_gemm(cuda::GemmInput::BF16, shape, expanded.get(), elems, s.rows,
                                                         s.cols, xb.get(), dt.get(), static_cast<int>(tiles.size()),
                                                         y.get(), s.rows);
                                     },
                                     min_ms);
        } catch (const std::exception& e) {
          out.failures.push_back(std::string(s.name) + " expert_gemm alone, " + cuda::expert_tiles_name(shape) +
                                 " tiles: " + e.what());
          p.gemm_only_us = std::nan("");
        }
        p.flop = 2.0 * 8 * static_cast<double>(n) * static_cast<double>(elems);
        out.layers.push_back(p);
      }
    const TensorType at = dot_activation_type(kType);
    DeviceBuffer<uint8_t> act(row_bytes(at, s.cols) * static_cast<size_t>(max_rows));
    cuda::quantize_activations(at, dx.get(), act.get(), s.cols, max_rows);
    for (int64_t r : per_expert) {
      const std::vector<cuda::ExpertRows> groups = groups_of(std::vector<int64_t>(kExperts, r));
      std::vector<int32_t> ids;
      for (int e = 0; e < kExperts; ++e)
        for (int64_t i = 0; i < r; ++i) ids.push_back(e);
      const double kernel_us = time_call(gemm, Path::Expanded, std::nullopt, groups);
      const double fused_us = time_call(gemm, Path::Fused, std::nullopt, groups);
      const std::string tiles = cuda::expert_tiles_name(gemm.last_expert_tiles());
      const double loop_us = time_call(gemm, Path::CublasLoop, std::nullopt, groups);
      double mv_us = -1.0;
      if (kExperts * r <= 65535) {  // one launch: matrix id per activation row
        DeviceBuffer<int32_t> dids(ids.size());
        dids.upload(ids.data(), ids.size());
        cuda::MatvecBatch batch;
        batch.count = static_cast<int>(kExperts * r);
        batch.weight_stride_bytes = static_cast<int64_t>(mat);
        batch.act_stride_bytes = static_cast<int64_t>(row_bytes(at, s.cols));
        batch.out_stride = s.rows;
        batch.expert_ids = dids.get();
        mv_us = 1e3 * ms_per_call(
                          [&](int) { cuda::matvec_quantized_batched(kType, pool.get(), s.rows, s.cols, act.get(), y.get(), batch); },
                          min_ms);
      }
      const double flop = 2.0 * kExperts * static_cast<double>(r) * static_cast<double>(elems);
      out.per_expert.push_back(
          {s.name, r, kernel_us, fused_us, loop_us, mv_us, tiles, flop / kernel_us / 1e6});
    }
  }
  return out;
}

// A profiler's run (--gemm-profile N, e.g. under ncu -k regex:expert_gemm_q4k):
// only matmul_experts' default path on 128 x (768 x 2048) q4_k at n tokens, uniform split, one
// line printed; the whole bench would keep a profiler attached for minutes.
void profile_fused(int64_t n, double min_ms) {
  constexpr int kExperts = 128;
  constexpr int64_t kRows = 768, kCols = 2048;
  const size_t mat = row_bytes(TensorType::Q4_K, kCols) * static_cast<size_t>(kRows);
  DeviceBuffer<uint8_t> pool = make_matrices(TensorType::Q4_K, kRows, kCols, kExperts);
  cuda::PrefillGemmLimits lim;
  lim.max_tokens = 8 * n;
  lim.max_cols = kCols;
  lim.max_experts = kExperts;
  cuda::PrefillGemm gemm(nullptr, lim);
  DeviceBuffer<float> dx = random_input(static_cast<size_t>(8 * n * kCols));
  DeviceBuffer<float> y(static_cast<size_t>(8 * n * kRows));
  const std::vector<int64_t> counts = expert_counts(kExperts, n, false);
  std::vector<cuda::ExpertRows> groups;
  int64_t at = 0;
  for (int e = 0; e < kExperts; ++e) {
    groups.push_back({pool.get() + static_cast<size_t>(e) * mat, at, counts[static_cast<size_t>(e)]});
    at += counts[static_cast<size_t>(e)];
  }
  const double us = 1e3 * ms_per_call([&](int) { gemm.matmul_experts(TensorType::Q4_K, groups, kRows, kCols, dx.get(), y.get()); },
                                      min_ms);
  std::printf("profile: 128x(768x2048) q4_k pp%lld uniform, %s, %s tiles: %.1f us per call\n",
              static_cast<long long>(n), gemm.last_call_fused() ? "fused" : "not fused",
              cuda::expert_tiles_name(gemm.last_expert_tiles()), us);
}

void throw_failures(const ExpertBench& experts) {
  if (experts.failures.empty()) return;
  std::string all;
  for (const std::string& f : experts.failures) all += "\n  " + f;
  throw std::runtime_error("gemm_prefill bench: " + std::to_string(experts.failures.size()) + " calls failed:" + all);
}

}  // namespace

void run_gemm_prefill_bench(double min_ms, const GemmBenchSelection& sel, nlohmann::json* json) {
  if (sel.profile_tokens > 0) {
    profile_fused(sel.profile_tokens, min_ms);
    return;
  }
  cublasHandle_t h = nullptr;
  cublas_check(cublasCreate(&h), "cublasCreate");
  double peak = 0.0;
  std::vector<DensePoint> dense;
  try {
    peak = peak_bf16_tflops(h, min_ms);
    if (!sel.experts_only) dense = bench_dense(h, min_ms);
  } catch (...) {
    cublasDestroy(h);
    throw;
  }
  cublasDestroy(h);
  const ExpertBench experts = bench_experts(min_ms);
  if (json != nullptr) {
    nlohmann::json& j = (*json)["gemm_prefill"];
    j["bf16_peak_tflops"] = peak;
    for (const DensePoint& p : dense)
      j["dense"].push_back({{"shape", p.shape}, {"format", p.format}, {"rows", p.rows}, {"cols", p.cols}, {"n", p.n},
                            {"call_us", p.call_us}, {"call_tflops", p.call_tflops}, {"gemm_us", p.gemm_us},
                            {"gemm_tflops", p.gemm_tflops}, {"dequant_us", p.dequant_us},
                            {"dequant_gbps", p.dequant_gbps}});
    for (const LayerPoint& p : experts.layers)
      j["expert_layers_q4_k"].push_back({{"shape", p.shape}, {"split", p.split}, {"n", p.n}, {"loop_us", p.loop_us},
                                         {"kernel_us", p.kernel_us}, {"tiles", p.chosen}, {"large_us", p.large_us},
                                         {"small_us", p.small_us}, {"whole_layer_us", p.whole_us},
                                         {"gemm_only_us", p.gemm_only_us}, {"fused_us", p.fused_us},
                                         {"fused_large_us", p.fused_large_us}, {"fused_small_us", p.fused_small_us},
                                         {"wide_us", p.wide_us}, {"fused_wide_us", p.fused_wide_us},
                                         {"auto_us", p.auto_us}, {"tall_us", p.tall_us},
                                         {"fused_tall_us", p.fused_tall_us},
                                         {"pair_us", p.pair_us}, {"pair_reuse_us", p.pair_reuse_us},
                                         {"flop", p.flop}});
    for (const ExpertPoint& p : experts.per_expert)
      j["experts_q4_k"].push_back({{"shape", p.shape}, {"rows_per_expert", p.rows_per_expert},
                                   {"kernel_us", p.kernel_us}, {"fused_us", p.fused_us},
                                   {"tiles", p.tiles},
                                   {"loop_us", p.loop_us},
                                   {"matvec_us", p.matvec_us},
                                   {"kernel_tflops", p.kernel_tflops}});
    throw_failures(experts);
    return;
  }
  std::printf("\nprefill GEMM (gemm_prefill: expand to bf16 + cublasGemmEx, f32 accumulate); plain cublasGemmEx "
              "bf16 8192^3: %.0f TFLOP/s\n", peak);
  std::printf("(call: the whole matmul incl. rounding X and expanding W; gemm: cuBLAS alone on the expanded W; "
              "dequant: expanding the whole matrix alone, GB/s of quantized read + bf16 written)\n");
  std::printf("%-12s %-6s %6s %6s %5s %10s %8s %6s %10s %8s %10s %8s\n", "shape", "format", "rows", "cols", "n",
              "call us", "TFLOP/s", "of pk", "gemm us", "TFLOP/s", "dequant us", "GB/s");
  for (const DensePoint& p : dense)
    std::printf("%-12s %-6s %6lld %6lld %5lld %10.1f %8.1f %5.0f%% %10.1f %8.1f %10.1f %8.0f\n", p.shape.c_str(),
                p.format.c_str(), static_cast<long long>(p.rows), static_cast<long long>(p.cols),
                static_cast<long long>(p.n), p.call_us, p.call_tflops, 100.0 * p.call_tflops / peak, p.gemm_us,
                p.gemm_tflops, p.dequant_us, p.dequant_gbps);
  std::printf("\nexpert layer, q4_k (q6k: q6_k), 128 experts, n tokens top-8 (8n rows; uniform or zipf 1/rank, capped at n): "
              "matmul_experts us per matrix set\n(loop: expand + one cublasGemmEx per expert [the old path]; kernel: "
              "expand + one expert_gemm per workspace chunk, tiles chosen, then forced large / small / wide / tall; "
              "whole: workspace of the whole layer; gemm: expert_gemm alone on expanded weights; fused: q4_k / q6_k decoded in "
              "the kernel, tiles chosen, then forced L / S / W / T)\n");
  std::printf("%-18s %-7s %5s %8s %7s %7s %5s %7s %7s %7s %7s %7s %7s %7s %7s %7s %7s %7s %7s %7s %7s %5s\n",
              "shape", "split", "n", "counts", "loop", "kernel", "tiles", "large", "small", "wide", "tall", "whole",
              "gemm", "fused", "fusedL", "fusedS", "fusedW", "fusedT", "auto", "speedup", "TFLOP/s", "gemm%");
  for (const LayerPoint& p : experts.layers) {
    const std::string range = std::to_string(p.min_count) + "-" + std::to_string(p.max_count);
    std::printf("%-18s %-7s %5lld %8s %7.1f %7.1f %5s %7.1f %7.1f %7.1f %7.1f %7.1f %7.1f %7.1f %7.1f %7.1f %7.1f %7.1f "
                "%7.1f %6.2fx %7.1f %4.0f%%\n",
                p.shape.c_str(), p.split.c_str(), static_cast<long long>(p.n), range.c_str(), p.loop_us, p.kernel_us,
                p.chosen.c_str(), p.large_us, p.small_us, p.wide_us, p.tall_us, p.whole_us, p.gemm_only_us, p.fused_us,
                p.fused_large_us, p.fused_small_us, p.fused_wide_us, p.fused_tall_us, p.auto_us, p.loop_us / p.auto_us,
                p.flop / p.auto_us / 1e6, 100.0 * p.flop / p.gemm_only_us / 1e6 / peak);
  }
  std::printf("(us per call; auto: the default path, what the CUDA backend runs; speedup and TFLOP/s: auto vs loop; "
              "gemm%%: expert_gemm alone as a share of the bf16 peak)\n");
  std::printf("per layer (2 x gate/up + down), us: ");
  for (const LayerPoint& gu : experts.layers) {
    if (gu.shape != experts.layers.front().shape) continue;  // gate/up rows; down found below
    const LayerPoint* dn = nullptr;
    for (const LayerPoint& q : experts.layers)
      if (q.shape == "128x(2048x768)" && q.split == gu.split && q.n == gu.n) dn = &q;
    if (dn == nullptr) continue;
    std::printf("%s pp%lld: loop %.0f, kernel %.0f, fused %.0f, auto %.0f;  ", gu.split.c_str(),
                static_cast<long long>(gu.n), 2 * gu.loop_us + dn->loop_us, 2 * gu.kernel_us + dn->kernel_us,
                2 * gu.fused_us + dn->fused_us, 2 * gu.auto_us + dn->auto_us);
  }
  std::printf("\n");
  std::printf("gate + up pair (two auto calls on one X), us: X rounded twice -> once (reuse_input):");
  for (const LayerPoint& p : experts.layers)
    if (!std::isnan(p.pair_us))
      std::printf("  %s %s pp%lld %.1f -> %.1f;", p.shape.c_str(), p.split.c_str(), static_cast<long long>(p.n),
                  p.pair_us, p.pair_reuse_us);
  std::printf("\n");
  std::printf("\nexpert layer, q4_k (q6k: q6_k), 128 experts x R rows each (matmul_experts kernel path vs cuBLAS loop; matvec: "
              "the decode kernel, one launch over all 128R rows)\n");
  std::printf("%-18s %6s %6s %12s %12s %12s %12s %10s\n", "shape", "R", "tiles", "kernel us", "fused us", "loop us",
              "matvec us", "TFLOP/s");
  for (const ExpertPoint& p : experts.per_expert)
    std::printf("%-18s %6lld %6s %12.1f %12.1f %12.1f %12.1f %10.1f\n", p.shape.c_str(),
                static_cast<long long>(p.rows_per_expert), p.tiles.c_str(), p.kernel_us, p.fused_us, p.loop_us,
                p.matvec_us, p.kernel_tflops);
  throw_failures(experts);
}

}  // namespace moraine::kernel_bench
