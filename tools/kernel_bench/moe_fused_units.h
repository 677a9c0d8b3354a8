// The warp-unit form of the fused MoE (kernel bench only): the tiled kernels' dots, staging, h
// expression, counters and top-k-order sums (kernels/cuda/moe_fused.cu), but each kernel's grid is
// one wave of CTAs and the work is cut into units of (expert, one dot_rows call's rows) dealt
// round-robin over the CTAs first, then their warps; every warp stages, dots and counts its own
// units with no CTA barrier after the start. Same bits as moe_fused (tests/cuda/moe_fused_test).
// Measured 1-10% faster than the tiled kernels (H200, graph, us per layer at 1 / 8 tokens:
// 30B-A3B Q4_K 23.5 -> 22.1 / 108.6 -> 106.0, Q8_0 with tiled down 37.9 -> 37.6 / 221.6 ->
// 206.6; docs/perf-log.md), never made the default; the staged form beat both where it runs.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/cuda/moe_fused.h"

namespace moraine::kernel_bench {

// Which kernels ran as warp units: each only where two CTAs of its buffers fit on an SM (30B-A3B
// Q8_0's down units need 128 KB per CTA), else the tiled kernel ran.
struct MoeUnitsRan {
  bool gate_up = false, down = false;
};

// moe_fused's contract (arguments, workspace, outputs, exceptions), w.form ignored (never the
// staged form); w.programmatic_launch applies to the down kernel.
MoeUnitsRan moe_fused_units(const cuda::MoeLayerWeights& w, const float* x, const cuda::MoeRouting& routing,
                            const cuda::MoeOutputs& out, void* workspace, size_t workspace_bytes,
                            cudaStream_t stream = nullptr);

}  // namespace moraine::kernel_bench
