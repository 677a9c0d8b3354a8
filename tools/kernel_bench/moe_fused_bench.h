// `moraine-kernel-bench cuda` section for the fused routed-expert kernel (kernels/cuda/moe_fused.h)
// at Qwen3-30B-A3B's and Qwen3-Next's MoE shapes: microseconds per layer and the expert bytes
// read per second beside the card's measured read bandwidth.
#pragma once
#include <nlohmann/json.hpp>

namespace moraine::kernel_bench {

// read_gbps: the plain read kernel's bandwidth measured by the caller. Prints a table, or
// (json != null) stores the numbers under (*json)["moe_fused"].
void run_moe_fused_bench(double min_ms, int set_mib, double read_gbps, nlohmann::json* json);

}  // namespace moraine::kernel_bench
