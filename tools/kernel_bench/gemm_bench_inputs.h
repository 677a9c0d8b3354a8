// What the prefill GEMM benches feed the kernels: weight matrices of quantized template rows
// replicated on the device, random inputs, and cuBLAS's dense BF16 rate (8192^3, F32
// accumulation) as the peak to compare against. Shared by moraine-kernel-bench and
// moraine-bench's GEMM probe (tools/bench/cuda_probe.cpp).
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "tools/kernel_bench/cuda_timing.h"
#include "tools/kernel_bench/template_rows.h"

namespace moraine::kernel_bench {

inline void cublas_check(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string("cuBLAS ") + cublasGetStatusName(st) + " in " + what);
}

// `copies` matrices of rows x cols, back to back, made of quantized template rows (the speed of
// the kernels does not depend on the values).
inline cuda::DeviceBuffer<uint8_t> make_matrices(TensorType t, int64_t rows, int64_t cols, size_t copies) {
  constexpr int kTemplateRows = 32;
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  const size_t rb = row_bytes(t, cols);
  std::vector<uint8_t> templ(rb * kTemplateRows);
  std::vector<float> f(static_cast<size_t>(cols));
  for (int r = 0; r < kTemplateRows; ++r) {
    for (float& v : f) v = dist(rng);
    template_row(t, f.data(), cols, templ.data() + static_cast<size_t>(r) * rb, rng);
  }
  const size_t mat = rb * static_cast<size_t>(rows);
  cuda::DeviceBuffer<uint8_t> pool(mat * copies);
  // The template block once, then doubling device copies.
  CUDA_CHECK(cudaMemcpy(pool.get(), templ.data(), std::min(templ.size(), mat), cudaMemcpyHostToDevice));
  for (size_t have = std::min(templ.size(), mat); have < mat * copies; have *= 2)
    CUDA_CHECK(cudaMemcpy(pool.get() + have, pool.get(), std::min(have, mat * copies - have), cudaMemcpyDeviceToDevice));
  return pool;
}

// n normal floats on the device: 64 Ki drawn, then repeated (drawing hundreds of millions on the
// host would take seconds; the GEMM's speed does not depend on the values).
inline cuda::DeviceBuffer<float> random_input(size_t n) {
  std::mt19937 rng(9);
  std::normal_distribution<float> xd(0.0f, 1.0f);
  std::vector<float> x(n);
  const size_t drawn = std::min<size_t>(n, size_t{1} << 16);
  for (size_t i = 0; i < drawn; ++i) x[i] = xd(rng);
  for (size_t i = drawn; i < n; ++i) x[i] = x[i % drawn];
  cuda::DeviceBuffer<float> d(n);
  d.upload(x.data(), n);
  return d;
}

// TFLOP/s of an 8192 x 8192 x 8192 BF16 GEMM on handle h (its stream), timed over >= min_ms.
inline double peak_bf16_tflops(cublasHandle_t h, double min_ms) {
  constexpr int kDim = 8192;
  const size_t elems = size_t{kDim} * kDim;
  cuda::DeviceBuffer<uint16_t> a(elems), b(elems);
  cuda::DeviceBuffer<float> c(elems);
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

}  // namespace moraine::kernel_bench
