// The CUDA backend of the gpu_worker (backend.h): the dense part of each layer on one GPU.
// Weights are uploaded once at construction in their GGUF formats (quantized ones read in place
// by the matvec kernels; F32/F16/BF16 by matvec_float), the KV cache is sized once for
// max_context positions and the scratch once for max_tokens rows, so a step allocates nothing.
// Activations cross the host/device boundary at each Backend call (the interface takes host
// floats). Every token row goes through the same kernels whether it is decoded alone or inside a
// prefill (matvecs batched over rows, attention split by positions seen), so decode after prefill
// is bit-identical to a fresh prefill.
// Routed experts: every expert of every layer is uploaded (the placement's VRAM tier is not
// consulted yet); K-quant experts run through the fused MoE kernel (kernels/cuda/moe_fused.h),
// others through the batched matvec.
// Families: qwen3moe and qwen3next (Gated DeltaNet layers through kernels/cuda/delta_net.h, gated
// attention, shared expert; its multi-token-prediction layer is not run, as in the reference).
// A DeltaNet prefill of 64 tokens or more takes the chunked recurrence, equal to decode only to
// rounding; below that, decode after prefill is bit-identical as for attention.
#pragma once
#include <cstdint>
#include <memory>

#include "gpu_worker/backend.h"

namespace moraine::gpu_worker {

// Positions the KV cache holds when make_backend("cuda") builds one: the group manifest has no
// context length yet.
constexpr int64_t kDefaultCudaContext = 8192;

// Throws std::runtime_error naming the reason (no device, a weight type without a CUDA kernel,
// an unsupported family, out of device memory).
std::unique_ptr<Backend> make_cuda_backend(const model::Model& m, int device, int max_tokens, int64_t max_context);

}  // namespace moraine::gpu_worker
