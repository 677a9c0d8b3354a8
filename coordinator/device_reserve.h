// The device memory a CUDA gpu_worker holds beside the weights and the KV cache: the CUDA context
// and the step's scratch. Placement charges it against --vram, so that the budget bounds what the
// process really uses on the card (what nvidia-smi shows, what llama.cpp's --n-cpu-moe rows are
// held to). Before it was charged, a 30B-A3B group at --vram 12G used 13.5 GiB (H200, session 6;
// docs/perf-log.md#session-6-what-changed).
#pragma once
#include <cstdint>
#include <span>

#include "common/model/model.h"
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
std::uint64_t cuda_device_reserve_bytes(const model::HParams& hp, std::span<const model::LayerWeights> layers,
                                        std::int64_t max_tokens, std::int64_t context);
inline std::uint64_t cuda_device_reserve_bytes(const model::Model& m, std::int64_t max_tokens, std::int64_t context) {
  return cuda_device_reserve_bytes(m.hp, m.layers, max_tokens, context);
}

// The options cuda_device_reserve_bytes lists the scratch with (tests compare it with the backend's).
gpu_worker::CudaStepScratchOptions cuda_reserve_scratch_options(std::span<const model::LayerWeights> layers,
                                                                std::int64_t max_tokens, std::int64_t context);

// Dense bytes a CUDA gpu_worker keeps in pinned host memory rather than on the device: the token
// embedding table (the embed kernel reads one row per token over PCIe, as llama.cpp keeps
// token_embd on the CPU), unless the output head is that same tensor (tied embeddings), which
// the device holds anyway. Placement takes it off the dense bytes charged to --vram.
std::uint64_t cuda_host_resident_bytes(const model::Model& m);

}  // namespace moraine::group
