// Prefill GEMM bench. Weights are quantized template rows replicated on the device (speed does
// not depend on the values); dense matrices are cycled over copies filling >= 256 MiB, so the
// expansion reads its quantized bytes from HBM as a real layer sweep does (the expanded matrix
// it writes is then read by the GEMM from wherever it sits, as in the real call).
#include "tools/kernel_bench/gemm_prefill_bench.h"
#include "tools/kernel_bench/cuda_timing.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/dequantize_weights.h"
#include "kernels/cuda/gemm_prefill.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/quantize_activations.h"

namespace moraine::kernel_bench {
namespace {

using cuda::DeviceBuffer;

void cublas_check(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string("cuBLAS ") + cublasGetStatusName(st) + " in " + what);
}

// `copies` matrices of rows x cols, back to back, made of quantized template rows.
DeviceBuffer<uint8_t> make_matrices(TensorType t, int64_t rows, int64_t cols, size_t copies) {
  constexpr int kTemplateRows = 32;
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  const size_t rb = row_bytes(t, cols);
  std::vector<uint8_t> templ(rb * kTemplateRows);
  std::vector<float> f(static_cast<size_t>(cols));
  for (int r = 0; r < kTemplateRows; ++r) {
    for (float& v : f) v = dist(rng);
    quantize_row(t, f.data(), templ.data() + static_cast<size_t>(r) * rb, cols);
  }
  const size_t mat = rb * static_cast<size_t>(rows);
  DeviceBuffer<uint8_t> pool(mat * copies);
  // The template block once, then doubling device copies.
  CUDA_CHECK(cudaMemcpy(pool.get(), templ.data(), std::min(templ.size(), mat), cudaMemcpyHostToDevice));
  for (size_t have = std::min(templ.size(), mat); have < mat * copies; have *= 2)
    CUDA_CHECK(cudaMemcpy(pool.get() + have, pool.get(), std::min(have, mat * copies - have), cudaMemcpyDeviceToDevice));
  return pool;
}

// n normal floats on the device: 64 Ki drawn, then repeated (drawing hundreds of millions on the
// host would take seconds; the GEMM's speed does not depend on the values).
DeviceBuffer<float> random_input(size_t n) {
  std::mt19937 rng(9);
  std::normal_distribution<float> xd(0.0f, 1.0f);
  std::vector<float> x(n);
  const size_t drawn = std::min<size_t>(n, size_t{1} << 16);
  for (size_t i = 0; i < drawn; ++i) x[i] = xd(rng);
  for (size_t i = drawn; i < n; ++i) x[i] = x[i % drawn];
  DeviceBuffer<float> d(n);
  d.upload(x.data(), n);
  return d;
}

double peak_bf16_tflops(cublasHandle_t h, double min_ms) {
  constexpr int kDim = 8192;
  const size_t elems = size_t{kDim} * kDim;
  DeviceBuffer<uint16_t> a(elems), b(elems);
  DeviceBuffer<float> c(elems);
  CUDA_CHECK(cudaMemset(a.get(), 0x3c, elems * 2));  // bf16 0x3c3c, about 0.0115
  CUDA_CHECK(cudaMemset(b.get(), 0x3c, elems * 2));
  const float alpha = 1.0f, beta = 0.0f;
  const double ms = ms_per_call(
      [&](int) {
        cublas_check(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, kDim, kDim, kDim, &alpha, a.get(), CUDA_R_16BF, kDim,
                                  b.get(), CUDA_R_16BF, kDim, &beta, c.get(), CUDA_R_32F, kDim, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT),
                     "peak gemm");
      },
      min_ms);
  return 2.0 * kDim * kDim * static_cast<double>(kDim) / ms / 1e9;
}

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

struct ExpertPoint {
  std::string shape;
  int64_t rows_per_expert;
  double grouped_us, loop_us, matvec_us;  // matvec_us < 0: not measured
  double grouped_tflops;
};

std::vector<ExpertPoint> bench_experts(double min_ms) {
  constexpr int kExperts = 128;
  constexpr TensorType kType = TensorType::Q4_K;
  const DenseShape shapes[] = {{"128x(768x2048)", 768, 2048}, {"128x(2048x768)", 2048, 768}};
  const int64_t per_expert[] = {1, 4, 16, 32, 64, 512};  // 32: pp512 with 8 of 128 experts, 512: pp8192
  std::vector<ExpertPoint> out;
  for (const DenseShape& s : shapes) {
    const size_t mat = row_bytes(kType, s.cols) * static_cast<size_t>(s.rows);
    DeviceBuffer<uint8_t> pool = make_matrices(kType, s.rows, s.cols, kExperts);
    const int64_t max_rows = kExperts * 512;
    cuda::PrefillGemmLimits lim;
    lim.max_tokens = max_rows;
    lim.max_cols = 2048;
    lim.max_experts = kExperts;
    lim.weight_workspace_elems = int64_t{kExperts} * s.rows * s.cols;  // a whole layer in one chunk
    cuda::PrefillGemm gemm(nullptr, lim);
    DeviceBuffer<float> dx = random_input(static_cast<size_t>(max_rows * s.cols));
    DeviceBuffer<float> y(static_cast<size_t>(max_rows * s.rows));
    const TensorType at = dot_activation_type(kType);
    DeviceBuffer<uint8_t> act(row_bytes(at, s.cols) * static_cast<size_t>(max_rows));
    cuda::quantize_activations(at, dx.get(), act.get(), s.cols, max_rows);
    for (int64_t r : per_expert) {
      std::vector<cuda::ExpertRows> groups;
      std::vector<int32_t> ids;
      for (int e = 0; e < kExperts; ++e) {
        groups.push_back({pool.get() + static_cast<size_t>(e) * mat, e * r, r});
        for (int64_t i = 0; i < r; ++i) ids.push_back(e);
      }
      double us[2];
      for (int mode = 0; mode < 2; ++mode) {
        gemm.set_grouped(mode == 0);
        us[mode] = 1e3 * ms_per_call([&](int) { gemm.matmul_experts(kType, groups, s.rows, s.cols, dx.get(), y.get()); },
                                 min_ms);
        if (mode == 0 && !gemm.grouped())
          std::printf("note: grouped cuBLAS call refused (%s), the loop ran\n", gemm.grouped_off_reason().c_str());
      }
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
      const double flop = 2.0 * kExperts * static_cast<double>(r) * static_cast<double>(s.rows * s.cols);
      out.push_back({s.name, r, us[0], us[1], mv_us, flop / us[0] / 1e6});
    }
  }
  return out;
}

}  // namespace

void run_gemm_prefill_bench(double min_ms, nlohmann::json* json) {
  cublasHandle_t h = nullptr;
  cublas_check(cublasCreate(&h), "cublasCreate");
  double peak = 0.0;
  std::vector<DensePoint> dense;
  try {
    peak = peak_bf16_tflops(h, min_ms);
    dense = bench_dense(h, min_ms);
  } catch (...) {
    cublasDestroy(h);
    throw;
  }
  cublasDestroy(h);
  const std::vector<ExpertPoint> experts = bench_experts(min_ms);
  if (json != nullptr) {
    nlohmann::json& j = (*json)["gemm_prefill"];
    j["bf16_peak_tflops"] = peak;
    for (const DensePoint& p : dense)
      j["dense"].push_back({{"shape", p.shape}, {"format", p.format}, {"rows", p.rows}, {"cols", p.cols}, {"n", p.n},
                            {"call_us", p.call_us}, {"call_tflops", p.call_tflops}, {"gemm_us", p.gemm_us},
                            {"gemm_tflops", p.gemm_tflops}, {"dequant_us", p.dequant_us},
                            {"dequant_gbps", p.dequant_gbps}});
    for (const ExpertPoint& p : experts)
      j["experts_q4_k"].push_back({{"shape", p.shape}, {"rows_per_expert", p.rows_per_expert},
                                   {"grouped_us", p.grouped_us}, {"loop_us", p.loop_us}, {"matvec_us", p.matvec_us},
                                   {"grouped_tflops", p.grouped_tflops}});
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
  std::printf("\nexpert layer, q4_k, 128 experts x R rows each (matmul_experts; matvec: the decode kernel, one "
              "launch over all 128R rows)\n");
  std::printf("%-16s %6s %12s %12s %12s %10s\n", "shape", "R", "grouped us", "loop us", "matvec us", "TFLOP/s");
  for (const ExpertPoint& p : experts)
    std::printf("%-16s %6lld %12.1f %12.1f %12.1f %10.1f\n", p.shape.c_str(), static_cast<long long>(p.rows_per_expert),
                p.grouped_us, p.loop_us, p.matvec_us, p.grouped_tflops);
}

}  // namespace moraine::kernel_bench
