// Every device buffer the CUDA backend allocates beside the weights and the KV cache (its step
// scratch), listed without CUDA headers so that two sides read one list: the backend
// (gpu_worker/cuda_backend_upload.cu, cuda_backend.cu) allocates each buffer with the bytes listed
// here, and the coordinator (coordinator/device_reserve.cpp) charges their sum against --vram.
// Before this list the coordinator mirrored the backend by formula, and the copies drifted (session
// 9: the expert path's buffers counted only at >= 64 rows, the split-KV records approximated,
// moe_fused's workspace a flat 16 MiB). tests/cuda/cuda_backend_golden_test checks on the GPU that
// the bytes the backend holds after construction are exactly this list's.
#pragma once
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/formats/tensor_type.h"
#include "common/model/hparams.h"
#include "kernels/cuda/attention_scratch.h"
#include "kernels/cuda/delta_net_shape.h"
#include "kernels/cuda/gemm_prefill_limits.h"
#include "kernels/cuda/moe_fused_workspace.h"

namespace moraine::gpu_worker {

// What the scratch depends on beyond the hyperparameters: the backend's options, the model's
// widest q projection, and which path each layer's resident experts take.
struct CudaStepScratchOptions {
  int64_t max_tokens = 1;           // rows of a step (BackendOptions::max_tokens), or of a long step's window
  int64_t long_step_rows = 0;       // BackendOptions::long_step_rows: the residual and token ids hold this many
  int64_t max_context = 1;          // positions of the KV cache
  int64_t gemm_prefill_rows = 0;    // BackendOptions::gemm_prefill_rows: PrefillGemm when in 1..max_tokens
  int64_t q_rows = 0;               // rows of the widest q projection (gated q: 2 x n_head x head_dim); 0: none
  bool recurrent = false;           // some layer is a Gated DeltaNet layer
  int64_t recurrent_layers = 0;     // how many (their states' snapshot for speculation)
  bool expert_matvec = false;       // some layer's resident experts take the batched matvec path
  std::vector<TensorType> fused_down_types;   // the down format of each layer that goes through moe_fused
  // The hand-off's taken expert (Backend::handoff_take_expert): bytes of the largest arena slot
  // (group::ArenaLayout::slot_bytes; 0: the device takes none) and the down format of each layer
  // it may take one from.
  uint64_t take_expert_bytes = 0;
  std::vector<TensorType> take_down_types;
  // Distinct arena part layouts (ArenaLayout::part_offsets) among those layers: a slot table per
  // (layout, expert) naming only that expert, so a take passes a table instead of writing one.
  int64_t take_layouts = 0;
  // Long steps' staged experts (Backend::stage_experts): BackendOptions::stage_experts slots of
  // the largest arena slot (0: none); listed only with the PrefillGemm, which runs them.
  uint64_t stage_expert_bytes = 0;
  int64_t dense_ff = 0;             // the widest dense FFN layer's hidden width (glm4moe's leading layers; 0: none)
  // Sequence slots (BackendOptions::slots): a position word and a recurrent-state snapshot each.
  int64_t slots = 1;
};

// The workspace of expanded weights the backend gives its PrefillGemm: PrefillGemmLimits'
// default (2 bytes each: 40 MiB).
inline constexpr int64_t kPrefillGemmWeightElems = cuda::PrefillGemmLimits{}.weight_workspace_elems;

struct ScratchBuffer {
  const char* name;
  uint64_t bytes;
};

// The list, in allocation order, with a lookup by name for the allocating side.
struct CudaStepScratch {
  std::vector<ScratchBuffer> buffers;

  void add(const char* name, uint64_t bytes) {
    if (bytes > 0) buffers.push_back({name, bytes});
  }
  bool has(const std::string& name) const {
    return std::any_of(buffers.begin(), buffers.end(), [&](const ScratchBuffer& b) { return name == b.name; });
  }
  // Bytes of buffer `name`; 0 when the list has no such buffer (a model without it).
  uint64_t bytes(const std::string& name) const {
    for (const ScratchBuffer& b : buffers)
      if (name == b.name) return b.bytes;
    return 0;
  }
  // Elements of type T in buffer `name`. Throws std::logic_error when the bytes are not whole elements.
  template <class T>
  size_t count(const std::string& name) const {
    const uint64_t b = bytes(name);
    if (b % sizeof(T) != 0)
      throw std::logic_error("cuda_step_scratch: buffer " + name + " of " + std::to_string(b) + " bytes is not a whole "
                             "number of " + std::to_string(sizeof(T)) + "-byte elements");
    return static_cast<size_t>(b / sizeof(T));
  }
  // The sum with every buffer rounded up to a multiple of `granule` bytes: 16 is what DeviceBuffer
  // asks cudaMalloc for, 2 MiB what the driver backs each cudaMalloc with.
  uint64_t total(uint64_t granule) const {
    uint64_t sum = 0;
    for (const ScratchBuffer& b : buffers) sum += (b.bytes + granule - 1) / granule * granule;
    return sum;
  }
};

inline cuda::AttentionShape attention_shape_of(const model::HParams& hp) {
  cuda::AttentionShape s;
  s.n_head = hp.n_head;
  s.n_head_kv = hp.n_head_kv;
  s.head_dim = hp.head_dim;
  s.kv_stride = hp.n_head_kv * hp.head_dim;
  return s;
}

// The DeltaNet kernels' shape of hp with a layer's layout (qwen35moe's tiled value heads and
// split beta / alpha; the default part is qwen3next's, which sizes every buffer the same).
inline cuda::DeltaNetShape delta_net_shape_of(const model::HParams& hp, const model::DeltaNetPart& part = {}) {
  cuda::DeltaNetShape s;
  s.n_k_heads = hp.ssm_n_k_heads;
  s.n_v_heads = hp.ssm_n_v_heads;
  s.head_k_dim = hp.ssm_head_k_dim;
  s.head_v_dim = hp.ssm_head_v_dim;
  s.conv_kernel = hp.ssm_conv_kernel;
  s.v_heads_tiled = part.v_heads_tiled;
  s.split_ba = part.split_ba;
  return s;
}

// Columns of the widest matrix a step multiplies: the activation staging holds every expert row
// of a step at this width.
inline int64_t cuda_scratch_max_cols(const model::HParams& hp, int64_t dense_ff = 0) {
  return std::max({hp.n_embd, hp.n_head * hp.head_dim, hp.n_ff_exp, hp.n_ff_shexp, hp.ssm_value_dim(), dense_ff});
}

// Whether the backend builds a PrefillGemm (and with it the per-expert path's buffers).
inline bool cuda_scratch_prefill_gemm(const CudaStepScratchOptions& o) {
  return o.gemm_prefill_rows > 0 && o.max_tokens >= o.gemm_prefill_rows;
}

// The limits the backend builds its PrefillGemm with (when cuda_scratch_prefill_gemm): every
// expert slot of a step, the widest matrix, all experts of a layer in one call.
inline cuda::PrefillGemmLimits cuda_scratch_prefill_gemm_limits(const model::HParams& hp,
                                                                const CudaStepScratchOptions& o) {
  cuda::PrefillGemmLimits lim;
  lim.max_tokens = o.max_tokens * hp.n_expert_used;
  lim.max_cols = cuda_scratch_max_cols(hp, o.dense_ff);
  lim.max_experts = static_cast<int>(hp.n_expert);
  lim.weight_workspace_elems = kPrefillGemmWeightElems;
  // A window's dense rows at any width; its expert rows (k per row) at most the experts' width.
  const int64_t expert_cols = std::max(hp.n_embd, hp.n_ff_exp);
  lim.input_elems = std::max(o.max_tokens * lim.max_cols, lim.max_tokens * std::min(expert_cols, lim.max_cols));
  return lim;
}

inline CudaStepScratch cuda_step_scratch(const model::HParams& hp, const CudaStepScratchOptions& o) {
  if (o.max_tokens < 1 || o.max_context < o.max_tokens)
    throw std::invalid_argument("cuda_step_scratch: max_tokens " + std::to_string(o.max_tokens) +
                                " must be at least 1 and at most max_context " + std::to_string(o.max_context));
  constexpr uint64_t f = sizeof(float), i32 = sizeof(int32_t);
  const uint64_t T = static_cast<uint64_t>(o.max_tokens);
  const uint64_t k = static_cast<uint64_t>(hp.n_expert_used), S = T * k;   // expert slots of a step
  const uint64_t d = static_cast<uint64_t>(hp.n_embd), ff = static_cast<uint64_t>(hp.n_ff_exp);
  const uint64_t q_dim = static_cast<uint64_t>(hp.n_head * hp.head_dim);
  const uint64_t kv = static_cast<uint64_t>(hp.n_head_kv * hp.head_dim);
  const uint64_t max_cols = static_cast<uint64_t>(cuda_scratch_max_cols(hp, o.dense_ff));
  // Steps of at most kAttentionAtMaxRows rows take the graph-safe decode kernels; longer ones
  // reuse the same records in passes, and the logits go 16 rows a pass (297 MiB for 512 rows of a
  // 151936-token vocabulary would be VRAM the experts can use).
  const int64_t rows16 = std::min<int64_t>(o.max_tokens, cuda::kAttentionAtMaxRows);
  CudaStepScratch s;
  // cuda_backend_upload.cu, the step scratch
  const uint64_t step_rows = std::max<uint64_t>(T, static_cast<uint64_t>(std::max<int64_t>(o.long_step_rows, 0)));
  s.add("x", step_rows * d * f);   // the residual, of a whole long step
  s.add("h", T * d * f);   // normalised rows
  s.add("y", T * d * f);   // a matmul's output
  // q (+ gate) | k | v rows of the stacked projection
  const int64_t qg_cols = std::max<int64_t>(hp.n_head * hp.head_dim,
                                            o.q_rows > 0 ? o.q_rows + 2 * hp.n_head_kv * hp.head_dim : 0);
  s.add("qg", T * static_cast<uint64_t>(qg_cols) * f);
  s.add("q", T * q_dim * f);
  s.add("k_new", T * kv * f);
  s.add("v_new", T * kv * f);
  s.add("attn", T * q_dim * f);
  const cuda::AttentionShape as = attention_shape_of(hp);
  s.add("attn_scratch", static_cast<uint64_t>(std::max({cuda::attention_scratch_floats(as, rows16, o.max_context),
                                                         cuda::attention_at_scratch_floats(as, rows16, o.max_context),
                                                         cuda::attention_decode_scratch_floats(as, rows16, o.max_context)})) *
                            f);
  // Quantized activations of the matvec path: steps below the PrefillGemm's rows (a quantized
  // row never takes more bytes than its floats). A longer step's matvec (a matrix the GEMM does
  // not take) runs in passes of what fits (CudaBackend::run_matvec); sizing act for a whole
  // window's expert rows cost 512 MiB of experts' VRAM at 4096-row windows of the 30B shape.
  const uint64_t act_rows = cuda_scratch_prefill_gemm(o) ? std::min<uint64_t>(T, static_cast<uint64_t>(o.gemm_prefill_rows - 1)) : T;
  s.add("act", std::max<uint64_t>(act_rows, 1) * k * max_cols * f);
  s.add("router_logits", T * static_cast<uint64_t>(hp.n_expert) * f);
  s.add("route_arrivals", T * sizeof(uint32_t));
  s.add("chosen", static_cast<uint64_t>(hp.n_layer) * S * i32);   // every layer's routing
  s.add("weight", S * f);
  s.add("token_ids", step_rows * i32);
  const uint64_t slots = static_cast<uint64_t>(std::max<int64_t>(o.slots, 1));
  s.add("pos", slots * i32);   // a batched step's first position of each segment
  s.add("dev_slots", S * d * f);   // the device's expert rows
  s.add("cpu_rows", S * d * f);    // the cpu workers' expert rows
  s.add("alt_row", S * i32);
  if (hp.n_ff_shexp > 0) {
    const uint64_t sh = static_cast<uint64_t>(hp.n_ff_shexp);
    s.add("shared_g", T * sh * f);
    s.add("shared_u", T * sh * f);
    s.add("shared_out", T * d * f);
    s.add("shared_logit", T * f);
  }
  if (o.dense_ff > 0) {   // the dense FFN layers' gate and up rows
    s.add("dense_g", T * static_cast<uint64_t>(o.dense_ff) * f);
    s.add("dense_u", T * static_cast<uint64_t>(o.dense_ff) * f);
  }
  s.add("logits", static_cast<uint64_t>(rows16) * static_cast<uint64_t>(hp.n_vocab) * f);
  if (o.recurrent) {
    const cuda::DeltaNetShape ds = delta_net_shape_of(hp);
    s.add("delta_mixed", T * static_cast<uint64_t>(ds.conv_dim()) * f);
    s.add("delta_z", T * static_cast<uint64_t>(ds.value_dim()) * f);
    s.add("delta_ba", T * 2 * static_cast<uint64_t>(ds.n_v_heads) * f);
    s.add("delta_core", T * static_cast<uint64_t>(ds.value_dim()) * f);
    s.add("delta_ws", static_cast<uint64_t>(cuda::delta_net_mix_workspace_floats(ds, o.max_tokens)) * f);
    // Backend::snapshot: every recurrent layer's conv and ssm state, taken before a verify step
    // (80B shape: 36 layers, ~76 MB), for each sequence slot.
    s.add("delta_snapshot",
          slots * static_cast<uint64_t>(o.recurrent_layers * (ds.conv_state_floats() + ds.ssm_state_floats())) * f);
  }
  s.add("handoff_seq", sizeof(uint64_t));
  s.add("handoff_error", i32);
  // cuda_backend.cu's setup_experts: moe_fused's workspace for its largest layer ...
  const auto fused_ws = [&](const std::vector<TensorType>& downs) {
    uint64_t ws = 0;
    for (TensorType down : downs)
      ws = std::max<uint64_t>(ws, cuda::moe_fused_workspace_layout(down, hp.n_embd, hp.n_ff_exp,
                                                                   int64_t{cuda::kMoeMaxTokens} * hp.n_expert_used)
                                      .total);
    return ws;
  };
  s.add("moe_fused_ws", fused_ws(o.fused_down_types));
  // ... the taken expert's copy (one arena slot, 16 bytes more: moe_fused reads whole 16-byte
  // words), its slot table (moe_fused's, an even count of 24-byte entries as the backend's) and a
  // workspace of its own (it runs on its own stream beside moe_fused's) ...
  if (o.take_expert_bytes > 0) {
    s.add("take_expert", o.take_expert_bytes + 16);
    s.add("take_table", static_cast<uint64_t>(o.take_layouts * hp.n_expert * ((hp.n_expert + 1) / 2 * 2)) * 3 * sizeof(void*));
    s.add("take_ws", fused_ws(o.take_down_types));
  }
  // ... the PrefillGemm's (its constructor allocates these, in this order) ...
  const bool gemm = cuda_scratch_prefill_gemm(o);
  if (gemm) {
    const cuda::PrefillGemmBuffers g = cuda::prefill_gemm_buffers(cuda_scratch_prefill_gemm_limits(hp, o));
    s.add("gemm_weights", g.weight_bytes);
    s.add("gemm_inputs", g.input_bytes);
    s.add("gemm_cublas_workspace", g.cublas_bytes);
    s.add("gemm_tile_tables", g.table_bytes());
  }
  // ... the staged experts' slots (after the PrefillGemm's buffers: the backend allocates them
  // after constructing it) ...
  if (gemm && o.stage_expert_bytes > 0) s.add("stage_experts", o.stage_expert_bytes);
  // ... and the per-expert path's gather / scatter rows, for any layer not fused or long steps.
  if (gemm || o.expert_matvec) {
    s.add("expert_in", S * d * f);
    s.add("expert_g", S * ff * f);
    s.add("expert_u", S * ff * f);
    s.add("expert_out", S * d * f);
    s.add("expert_idx", 4 * S * i32);   // token, slab, slot and expert id per row
  }
  return s;
}

}  // namespace moraine::gpu_worker
