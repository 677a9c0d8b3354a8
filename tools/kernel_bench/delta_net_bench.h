// `moraine-kernel-bench cuda` section for the Gated DeltaNet mixer (kernels/cuda/delta_net.h)
// at Qwen3-Next-80B's layer shape: microseconds per decode token, tokens/s of prefill.
#pragma once
#include <nlohmann/json.hpp>

namespace moraine::kernel_bench {

// Prints a table, or (json != null) stores the numbers under (*json)["delta_net"].
void run_delta_net_bench(double min_ms, nlohmann::json* json);

}  // namespace moraine::kernel_bench
