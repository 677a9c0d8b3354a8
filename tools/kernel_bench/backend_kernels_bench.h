// `moraine-kernel-bench cuda` section for the CUDA backend's own kernels (gpu_worker/cuda_backend.cu):
// F32/F16/BF16 matvec, q8_0 activation quantization (llama.cpp's rule), RoPE, per-head RMSNorm,
// attention decode (split-KV) and prefill, the softmax top-k router, SwiGLU, residual add, MoE
// combine and embedding rows, at Qwen3-30B-A3B shapes: microseconds per call and the bytes each
// kernel must move per second (TFLOP/s for prefill attention), beside the measured read bandwidth.
#pragma once
#include <nlohmann/json.hpp>

namespace moraine::kernel_bench {

// read_gbps: the plain read kernel's bandwidth measured by the caller. Prints a table, or
// (json != null) stores the numbers under (*json)["backend_kernels"].
void run_backend_kernels_bench(double min_ms, double read_gbps, nlohmann::json* json);

}  // namespace moraine::kernel_bench
