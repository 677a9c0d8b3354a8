// `moraine-kernel-bench cuda` section for programmatic dependent launch (kernels/cuda/launch.h):
// the decode step's per-layer chain of small kernels (norm, quantize, q|k|v matvec,
// qk_norm_rope_store, attention_decode, quantize, o matvec into the residual, norm, router,
// top-k, combine) at Qwen3-30B-A3B shapes, 48 layers captured in one CUDA graph and replayed,
// with PDL and with the graph's programmatic edges made full (plain_graph.h): microseconds per
// layer.
#pragma once
#include <nlohmann/json.hpp>

namespace moraine::kernel_bench {

// Prints a table, or (json != null) stores the numbers under (*json)["pdl_chain"].
void run_pdl_chain_bench(double min_ms, nlohmann::json* json);

}  // namespace moraine::kernel_bench
