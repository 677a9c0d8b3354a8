// The GPU half of the probes: the bandwidths (plain cudart calls) and the prefill GEMM rate (the
// engine's PrefillGemm, host calls of the kernels library, so no .cu file is needed). Compiled
// with MORAINE_BENCH_CUDA only in CUDA builds; otherwise the probes say "n/a".
#include "tools/bench/bandwidth_probe.h"
#include "tools/bench/prefill_bound.h"

#ifdef MORAINE_BENCH_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda/gemm_prefill.h"
#include "tools/kernel_bench/gemm_bench_inputs.h"
#endif

namespace moraine::bench {

#ifdef MORAINE_BENCH_CUDA
namespace {

bool gpu_present(std::string& why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    why = std::string("n/a: no GPU (") + (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices") + ")";
    return false;
  }
  return true;
}

// Seconds of the best of `reps` copies, timed with events on the default stream.
template <typename Copy>
double best_copy_seconds(Copy copy, int reps) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  copy();  // warm-up: first-touch and clocks
  float best_ms = 1e30f;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a);
    copy();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    best_ms = std::min(best_ms, ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return best_ms / 1e3;
}

std::string fmt_ms(double ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f ms", ms);
  return buf;
}

}  // namespace

Measured measure_pinned_h2d(size_t bytes) {
  std::string why;
  if (!gpu_present(why)) return {std::nullopt, why};
  void* host = nullptr;
  void* dev = nullptr;
  if (cudaMallocHost(&host, bytes) != cudaSuccess || cudaMalloc(&dev, bytes) != cudaSuccess) {
    cudaFreeHost(host);
    return {std::nullopt, "n/a: could not allocate " + std::to_string(bytes >> 20) + " MiB pinned + device"};
  }
  const double s = best_copy_seconds([&] { cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice); }, 5);
  cudaFree(dev);
  cudaFreeHost(host);
  return {static_cast<double>(bytes) / s, "cudaMemcpy pinned host->device, " + std::to_string(bytes >> 20) + " MiB, best of 5"};
}

Measured measure_device_memory(size_t bytes) {
  std::string why;
  if (!gpu_present(why)) return {std::nullopt, why};
  void* a = nullptr;
  void* b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) {
    cudaFree(a);
    return {std::nullopt, "n/a: could not allocate 2 x " + std::to_string(bytes >> 20) + " MiB on the device"};
  }
  cudaMemset(a, 1, bytes);
  const double s = best_copy_seconds([&] { cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice); }, 5);
  cudaFree(a);
  cudaFree(b);
  // A device-to-device copy reads and writes every byte: 2x the traffic.
  return {2.0 * static_cast<double>(bytes) / s,
          "cudaMemcpy device->device, " + std::to_string(bytes >> 20) + " MiB (read + write counted), best of 5"};
}

std::pair<Measured, Measured> measure_dram_beside_h2d(size_t dram_bytes, size_t h2d_bytes) {
  std::string why;
  if (!gpu_present(why)) return {{std::nullopt, why}, {std::nullopt, why}};
  void* host = nullptr;
  void* dev = nullptr;
  if (cudaMallocHost(&host, h2d_bytes) != cudaSuccess || cudaMalloc(&dev, h2d_bytes) != cudaSuccess) {
    cudaFreeHost(host);
    const std::string no = "n/a: could not allocate " + std::to_string(h2d_bytes >> 20) + " MiB pinned + device";
    return {{std::nullopt, no}, {std::nullopt, no}};
  }
  int device = 0;
  cudaGetDevice(&device);
  cudaMemcpy(dev, host, h2d_bytes, cudaMemcpyHostToDevice);   // first touch
  std::atomic<bool> stop{false};
  uint64_t copies = 0;
  double seconds = 0;
  std::thread copier;
  const Measured dram = measure_dram_read(dram_bytes, [&](bool start) {
    if (!start) {
      stop = true;
      copier.join();
      return;
    }
    copier = std::thread([&] {
      cudaSetDevice(device);
      const auto t0 = std::chrono::steady_clock::now();
      while (!stop.load(std::memory_order_relaxed)) {
        if (cudaMemcpy(dev, host, h2d_bytes, cudaMemcpyHostToDevice) != cudaSuccess) break;
        ++copies;
      }
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
  });
  cudaFree(dev);
  cudaFreeHost(host);
  Measured pcie{std::nullopt, "cudaMemcpy pinned host->device of " + std::to_string(h2d_bytes >> 20) +
                                  " MiB back to back during the DRAM read's passes"};
  if (copies > 0 && seconds > 0) pcie.bytes_per_s = static_cast<double>(copies * h2d_bytes) / seconds;
  Measured ram = dram;
  ram.note += ", while the bus copies";
  return {ram, pcie};
}
namespace {

// Seconds of one MoE layer's expert GEMMs as the CUDA backend enqueues them on a long step's
// window (cuda_backend_enqueue.cu): gate, then up on the same 16-bit X, then down, every expert
// with rows_per_expert rows; the SwiGLU between them is not a GEMM and is left out.
double expert_layer_seconds(const PrefillModel& pm, int64_t rows_per_expert, double min_ms) {
  const int64_t E = pm.n_expert, d = pm.n_embd, ff = pm.n_ff, rows = E * rows_per_expert;
  const size_t gate_mat = row_bytes(pm.gate_type, d) * static_cast<size_t>(ff);
  const size_t down_mat = row_bytes(pm.down_type, ff) * static_cast<size_t>(d);
  cuda::DeviceBuffer<uint8_t> gate = kernel_bench::make_matrices(pm.gate_type, ff, d, static_cast<size_t>(E));
  cuda::DeviceBuffer<uint8_t> up = kernel_bench::make_matrices(pm.gate_type, ff, d, static_cast<size_t>(E));
  cuda::DeviceBuffer<uint8_t> down = kernel_bench::make_matrices(pm.down_type, d, ff, static_cast<size_t>(E));
  cuda::DeviceBuffer<float> x = kernel_bench::random_input(static_cast<size_t>(rows * d));
  cuda::DeviceBuffer<float> g(static_cast<size_t>(rows * ff)), u(static_cast<size_t>(rows * ff)), y(static_cast<size_t>(rows * d));
  // As cuda_scratch_prefill_gemm_limits sizes the backend's: every row of the call, all experts at once.
  cuda::PrefillGemmLimits lim;
  lim.max_tokens = rows;
  lim.max_cols = std::max(d, ff);
  lim.max_experts = static_cast<int>(E);
  cuda::PrefillGemm gemm(nullptr, lim);
  std::vector<cuda::ExpertRows> gate_g, up_g, down_g;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t first = e * rows_per_expert;
    gate_g.push_back({gate.get() + static_cast<size_t>(e) * gate_mat, first, rows_per_expert});
    up_g.push_back({up.get() + static_cast<size_t>(e) * gate_mat, first, rows_per_expert});
    down_g.push_back({down.get() + static_cast<size_t>(e) * down_mat, first, rows_per_expert});
  }
  const double ms = kernel_bench::ms_per_call(
      [&](int) {
        gemm.matmul_experts(pm.gate_type, gate_g, ff, d, x.get(), g.get());
        gemm.matmul_experts(pm.gate_type, up_g, ff, d, x.get(), u.get(), 1, 0, true);
        gemm.matmul_experts(pm.down_type, down_g, d, ff, g.get(), y.get());
      },
      min_ms);
  return ms / 1e3;
}

}  // namespace

GemmRates measure_prefill_gemm(const PrefillModel& pm, int64_t rows_per_expert, bool with_cublas, double min_ms) {
  GemmRates r;
  r.rows_per_expert = rows_per_expert;
  std::string why;
  if (!gpu_present(why)) {
    r.engine_note = r.cublas_note = why;
    return r;
  }
  if (pm.n_expert <= 0 || pm.n_ff <= 0 || rows_per_expert <= 0) {
    r.engine_note = "n/a: the model has no routed experts to time";
  } else if (!cuda::prefill_gemm_supported(pm.gate_type) || !cuda::prefill_gemm_supported(pm.down_type)) {
    r.engine_note = "n/a: the prefill GEMM does not take " + std::string(type_name(pm.gate_type)) + " / " +
                    std::string(type_name(pm.down_type));
  } else {
    try {
      const double s = expert_layer_seconds(pm, rows_per_expert, min_ms);
      const double flop = 2.0 * 3.0 * static_cast<double>(pm.n_expert * rows_per_expert) * static_cast<double>(pm.n_embd) *
                          static_cast<double>(pm.n_ff);
      r.engine_flops_s = flop / s;
      r.engine_note = "PrefillGemm::matmul_experts gate + up (reused X) + down, " + std::to_string(pm.n_expert) + " x (" +
                      std::to_string(pm.n_ff) + " x " + std::to_string(pm.n_embd) + ") " +
                      std::string(type_name(pm.gate_type)) + " / " + std::string(type_name(pm.down_type)) + ", " +
                      std::to_string(rows_per_expert) + " rows per expert (" + fmt_ms(1e3 * s) + " a layer)";
    } catch (const std::exception& e) {
      r.engine_note = std::string("n/a: ") + e.what();
    }
  }
  if (!with_cublas) {
    r.cublas_note = "not measured with this shape";
    return r;
  }
  try {
    cublasHandle_t h = nullptr;
    kernel_bench::cublas_check(cublasCreate(&h), "cublasCreate");
    try {
      r.cublas_bf16_flops_s = 1e12 * kernel_bench::peak_bf16_tflops(h, min_ms);
    } catch (...) {
      cublasDestroy(h);
      throw;
    }
    cublasDestroy(h);
    r.cublas_note = "cublasGemmEx BF16 x BF16 -> F32, 8192 x 8192 x 8192";
  } catch (const std::exception& e) {
    r.cublas_note = std::string("n/a: ") + e.what();
  }
  return r;
}
#else
GemmRates measure_prefill_gemm(const PrefillModel&, int64_t rows_per_expert, bool, double) {
  GemmRates r;
  r.rows_per_expert = rows_per_expert;
  r.engine_note = r.cublas_note = "n/a: built without CUDA";
  return r;
}
Measured measure_pinned_h2d(size_t) { return {std::nullopt, "n/a: built without CUDA"}; }
Measured measure_device_memory(size_t) { return {std::nullopt, "n/a: built without CUDA"}; }
std::pair<Measured, Measured> measure_dram_beside_h2d(size_t, size_t) {
  return {{std::nullopt, "n/a: built without CUDA"}, {std::nullopt, "n/a: built without CUDA"}};
}
#endif

}  // namespace moraine::bench
