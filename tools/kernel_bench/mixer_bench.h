// `moraine-kernel-bench cuda --mixer-only` (mixer_bench.cu): a decode layer's small attention and
// router kernels (Q8_0 q|k|v and o matvecs, F32 router matvec, softmax top-k, qk_norm_rope_store)
// at Qwen3-30B-A3B shapes, the versions before issue #5's changes against the current ones.
#pragma once
#include <nlohmann/json.hpp>

namespace moraine::kernel_bench {

// Prints a table, or (json != null) stores the numbers under (*json)["mixer"]. ncu_mode: only a
// few plain launches of each kernel, to be timed by ncu.
void run_mixer_bench(double min_ms, bool ncu_mode, nlohmann::json* json);

// The decode layer's chain of these kernels, 48 layers in one graph, unfused against each fusion
// of the CUDA backend (mixer_bench_chain.cu); run_mixer_bench ends with it (not in ncu_mode).
void run_mixer_chain_bench(double min_ms, nlohmann::json* json);

}  // namespace moraine::kernel_bench
