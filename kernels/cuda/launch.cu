#include "kernels/cuda/launch.h"

#include <atomic>
#include <cstdint>

namespace moraine::cuda {
namespace {

// Per device ordinal: 0 not asked yet, 1 no PDL, 2 PDL. Devices past the table are asked on every
// launch (no machine we know has 64 GPUs).
constexpr int kMaxDevices = 64;
std::atomic<int8_t> capability_cache[kMaxDevices];

bool ask_device(int device) {
  int major = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major >= 9;
}

}  // namespace

bool programmatic_launch_supported() {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices) return ask_device(device);
  int8_t c = capability_cache[device].load(std::memory_order_relaxed);
  if (c == 0) {
    c = ask_device(device) ? 2 : 1;
    capability_cache[device].store(c, std::memory_order_relaxed);
  }
  return c == 2;
}

}  // namespace moraine::cuda
