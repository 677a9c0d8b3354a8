// The device memory a CUDA gpu_worker holds beside the weights and the KV cache: the CUDA context
// and the step's scratch. Placement charges it against --vram, so that the budget bounds what the
// process really uses on the card (what nvidia-smi shows, what llama.cpp's --n-cpu-moe rows are
// held to). Before it was charged, a 30B-A3B group at --vram 12G used 13.5 GiB (H200, session 6).
#pragma once
#include <cstdint>

#include "common/model/model.h"

namespace moraine::group {

// Context (the runtime, module images, cuBLAS): measured on the H200 with CUDA 13, 526 MiB right
// after the gpu_worker's first CUDA call; rounded up for what cuBLAS and graph instantiation take
// later and for the allocator's rounding of ~1000 buffers.
inline constexpr std::uint64_t kCudaContextReserve = std::uint64_t{640} << 20;

// The CUDA backend's scratch for steps of up to max_tokens rows and a `context`-token cache
// (gpu_worker/cuda_backend_upload.cu and cuda_backend.cu allocate these), plus kCudaContextReserve.
// An upper bound: buffers only some models have (gated q, shared expert, Gated DeltaNet) are
// counted when the model has them, prefill GEMM scratch whenever max_tokens reaches the
// backend's default GEMM threshold (64 rows).
std::uint64_t cuda_device_reserve_bytes(const model::Model& m, std::int64_t max_tokens, std::int64_t context);

// Dense bytes a CUDA gpu_worker keeps in pinned host memory rather than on the device: the token
// embedding table (the embed kernel reads one row per token over PCIe, as llama.cpp keeps
// token_embd on the CPU), unless the output head is that same tensor (tied embeddings), which
// the device holds anyway. Placement takes it off the dense bytes charged to --vram.
std::uint64_t cuda_host_resident_bytes(const model::Model& m);

}  // namespace moraine::group
