// Every CUDA runtime call goes through CUDA_CHECK so a failure names the call, the file and the
// line (the llm.c habit); kernel launches are followed by CUDA_CHECK(cudaGetLastError()).
// Failures throw (rather than exit) so tests and the worker can report them and unwind.
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace moraine::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(err) + " (" +
                           cudaGetErrorString(err) + ") in " + call + " at " + file + ":" +
                           std::to_string(line));
}

}  // namespace moraine::cuda

#define CUDA_CHECK(call)                                                          \
  do {                                                                            \
    const cudaError_t moraine_cuda_err_ = (call);                                 \
    if (moraine_cuda_err_ != cudaSuccess)                                         \
      ::moraine::cuda::throw_cuda_error(moraine_cuda_err_, #call, __FILE__, __LINE__); \
  } while (0)
