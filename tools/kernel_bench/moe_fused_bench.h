// `moraine-kernel-bench cuda` section for the fused routed-expert kernel (kernels/cuda/moe_fused.h)
// at Qwen3-30B-A3B's and Qwen3-Next's MoE shapes: microseconds per layer and the expert bytes
// read per second beside the card's measured read bandwidth.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moraine::kernel_bench {

// Which rows to time (moraine-kernel-bench cuda --moe-variants / --moe-tokens / --moe-select): the
// GPU runs are batched, so one run should measure every candidate. Empty lists: the defaults.
struct MoeBenchSelection {
  std::vector<std::string> variants;  // "all" or names of the variant table; default best, tiled, units
  std::vector<int> tokens;            // tokens per call; default 1, 8
  std::vector<std::string> only;      // {shape, format}: one of each (e.g. for a profiler run)
  // The experts in mapped pinned host memory instead of device memory: the kernels then read
  // them over PCIe, what a GPU computing RAM-tier experts in place would see (--moe-host-weights).
  bool host_weights = false;
};

// read_gbps: the plain read kernel's bandwidth measured by the caller. Prints a table, or
// (json != null) stores the numbers under (*json)["moe_fused"].
void run_moe_fused_bench(double min_ms, int set_mib, double read_gbps, nlohmann::json* json,
                         const MoeBenchSelection& select = {});

}  // namespace moraine::kernel_bench
