// The device memory a CUDA gpu_worker holds beside the weights and the KV cache: the CUDA context
// and the step's scratch. Placement charges it against --vram, so that the budget bounds what the
// process really uses on the card (what nvidia-smi shows, what llama.cpp's --n-cpu-moe rows are
// held to). Before it was charged, a 30B-A3B group at --vram 12G used 13.5 GiB (H200, session 6;
// docs/perf-log.md#session-6-what-changed).
#pragma once
#include <cstdint>
#include <span>

#include "common/model/model.h"
#include "coordinator/placement.h"
#include "gpu_worker/cuda_step_scratch.h"

namespace moraine::group {

// Context (the runtime, module images, cuBLAS): measured on the H200 with CUDA 13, 526 MiB right
// after the gpu_worker's first CUDA call; rounded up for what cuBLAS and graph instantiation take
// later and for the allocator's rounding of ~1000 buffers.
inline constexpr std::uint64_t kCudaContextReserve = std::uint64_t{640} << 20;

// The CUDA backend's step scratch (gpu_worker/cuda_step_scratch.h: the list the backend
// allocates from) for steps of up to max_tokens rows and a `context`-token cache, each buffer
// rounded to the driver's 2 MiB pages, plus the weights arena's rounding and kCudaContextReserve.
// An upper bound: which layers' experts go through moe_fused is decided on the GPU, so both
// expert paths' buffers are counted (cuda_reserve_scratch_options).
// Long steps (long_step_rows > 0) stage up to stage_slots experts of a layer at once
// (long_step_stage_slots of the placement; at least the default BackendOptions::stage_experts).
// Sequence slots (seq_slots, coordinator --batch-decode) each hold a snapshot of the recurrent
// states in the scratch (their KV caches are in the placement's kv_bytes).
std::uint64_t cuda_device_reserve_bytes(const model::HParams& hp, std::span<const model::LayerWeights> layers,
                                        std::int64_t max_tokens, std::int64_t context, std::int64_t long_step_rows = 0,
                                        std::int64_t stage_slots = 0, std::int64_t seq_slots = 1);
inline std::uint64_t cuda_device_reserve_bytes(const model::Model& m, std::int64_t max_tokens, std::int64_t context,
                                               std::int64_t long_step_rows = 0, std::int64_t stage_slots = 0,
                                               std::int64_t seq_slots = 1) {
  return cuda_device_reserve_bytes(m.hp, m.layers, max_tokens, context, long_step_rows, stage_slots, seq_slots);
}

// The staging slots a long step uses: the most RAM-tier and FILE-tier experts of any layer of the
// placement, so a layer's whole RAM tier and what the file cache holds of its FILE tier are on
// the device at once for all of a long step's windows (gpu_worker --prefill-stage-file: a slot
// short, the layer's staged experts are copied again for every window).
std::int64_t long_step_stage_slots(const PlacementPlan& plan);

// The options cuda_device_reserve_bytes lists the scratch with (tests compare it with the backend's).
gpu_worker::CudaStepScratchOptions cuda_reserve_scratch_options(std::span<const model::LayerWeights> layers,
                                                                std::int64_t max_tokens, std::int64_t context,
                                                                std::int64_t long_step_rows = 0, std::int64_t stage_slots = 0,
                                                                std::int64_t seq_slots = 1);

// Dense bytes a CUDA gpu_worker keeps in pinned host memory rather than on the device: the token
// embedding table (the embed kernel reads one row per token over PCIe, as llama.cpp keeps
// token_embd on the CPU), unless the output head is that same tensor (tied embeddings), which
// the device holds anyway. Placement takes it off the dense bytes charged to --vram.
std::uint64_t cuda_host_resident_bytes(const model::Model& m);

}  // namespace moraine::group
