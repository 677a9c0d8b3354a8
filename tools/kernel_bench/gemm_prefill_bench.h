// `moraine-kernel-bench cuda` section for the prefill GEMMs (kernels/cuda/gemm_prefill.h) at
// Qwen3-30B-A3B's shapes and n = 512 / 8192 tokens: TFLOP/s of the whole call (X rounding,
// weight expansion, cuBLAS) beside the card's BF16 peak measured with a plain cublasGemmEx, the
// GEMM alone on an already expanded matrix, and the expansion (dequantize_weights) alone. Then
// one MoE layer's 128 experts (q4_k) at pp512 / pp8192 with uniform and Zipf-skewed token counts:
// the grouped kernel path (expert_gemm.h) vs the previous one-cublasGemmEx-per-expert loop; and
// 128 experts with R rows each, kernel path vs loop vs the decode matvec on the same rows, which
// is where the expert threshold comes from.
#pragma once
#include <nlohmann/json.hpp>

namespace moraine::kernel_bench {

struct GemmBenchSelection {
  bool experts_only = false;  // skip the dense shapes (--gemm-experts-only)
  // > 0: only matmul_experts' default path on 128 x (768 x 2048) q4_k at this many tokens, one
  // line (--gemm-profile N: a profiler run, e.g. under ncu -k regex:expert_gemm_q4k).
  long long profile_tokens = 0;
};

// Prints tables, or (json != null) stores the numbers under (*json)["gemm_prefill"].
void run_gemm_prefill_bench(double min_ms, const GemmBenchSelection& sel, nlohmann::json* json);

}  // namespace moraine::kernel_bench
