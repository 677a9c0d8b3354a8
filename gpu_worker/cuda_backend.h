// The CUDA backend of the gpu_worker (backend.h): the dense part of each layer and the VRAM-tier
// experts on one GPU, everything on one stream of its own.
//
// Residency: weights are uploaded once at construction in their GGUF formats; routed experts
// only for the VRAM tier (BackendOptions::device_experts), each layer's resident experts packed
// in slabs with a (layer, expert) -> slab table the fused MoE kernel reads (null = not here).
// The residual x, h, routing and expert rows stay on the device: per layer the host sees the
// routing (and h) only when cpu workers take part (layer_begin / layer_end), and a layer whose
// experts are all resident runs without a host round trip (layer_whole). The KV cache holds
// max_context positions, the scratch max_tokens rows: a step allocates nothing.
// Short steps (<= 16 tokens) with every layer resident replay a CUDA graph captured once per
// token count (step_whole): positions live in device memory, so the graph serves every step.
//
// Numbers: every token row goes through the same kernels whether it is decoded alone or in a
// step of up to 16; decode after such a prefill is bit-identical to a fresh prefill. Prefills of
// 64 rows and more take the tiled attention (attention_prefill.h) and the chunked DeltaNet:
// equal to decode to rounding only.
// Families: qwen3moe and qwen3next (Gated DeltaNet layers, gated attention, shared expert; the
// multi-token-prediction layer is not run, as in the reference).
#pragma once
#include <memory>

#include "gpu_worker/backend.h"

namespace moraine::gpu_worker {

// Throws std::runtime_error naming the reason (no device, a weight type without a CUDA kernel,
// an unsupported family, out of device memory).
std::unique_ptr<Backend> make_cuda_backend(const model::Model& m, const BackendOptions& o);

}  // namespace moraine::gpu_worker
