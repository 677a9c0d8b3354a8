// The GPU half of the bandwidth probes: plain cudart calls, so no .cu file is needed. Compiled
// with MORAINE_BENCH_CUDA only in CUDA builds; otherwise the probes say "n/a".
#include "tools/bench/bandwidth_probe.h"

#ifdef MORAINE_BENCH_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
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
#else
Measured measure_pinned_h2d(size_t) { return {std::nullopt, "n/a: built without CUDA"}; }
Measured measure_device_memory(size_t) { return {std::nullopt, "n/a: built without CUDA"}; }
std::pair<Measured, Measured> measure_dram_beside_h2d(size_t, size_t) {
  return {{std::nullopt, "n/a: built without CUDA"}, {std::nullopt, "n/a: built without CUDA"}};
}
#endif

}  // namespace moraine::bench
