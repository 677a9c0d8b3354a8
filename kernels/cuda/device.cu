#include "kernels/cuda/device.h"

#include <cuda_runtime.h>

namespace moraine::cuda {

bool device_available(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why != nullptr) *why = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(err);
    (void)cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return false;
  }
  if (count == 0) {
    if (why != nullptr) *why = "cudaGetDeviceCount returned 0 devices";
    return false;
  }
  return true;
}

}  // namespace moraine::cuda
