#include "coordinator/device_reserve.h"

#include <algorithm>

#include "gpu_worker/backend.h"
#include "gpu_worker/cuda_step_scratch.h"

namespace moraine::group {

gpu_worker::CudaStepScratchOptions cuda_reserve_scratch_options(std::span<const model::LayerWeights> layers,
                                                                std::int64_t max_tokens, std::int64_t context,
                                                                std::int64_t long_step_rows, std::int64_t stage_slots,
                                                                std::int64_t seq_slots) {
  gpu_worker::CudaStepScratchOptions o;
  o.long_step_rows = long_step_rows;
  o.slots = std::max<std::int64_t>(seq_slots, 1);
  // Long steps: a layer's whole RAM tier, twice with the default prefetch (BackendOptions::stage_prefetch).
  const gpu_worker::BackendOptions defaults;
  const std::int64_t slots = std::max<std::int64_t>(defaults.stage_experts, long_step_rows > 0 ? stage_slots : 0) *
                             (long_step_rows > 0 && defaults.stage_prefetch ? 2 : 1);
  std::vector<std::array<std::size_t, 3>> take_layouts;
  o.max_tokens = std::max<std::int64_t>(max_tokens, 1);
  o.max_context = std::max<std::int64_t>(context, o.max_tokens);   // as gpu_worker.cpp sizes the cache
  o.gemm_prefill_rows = gpu_worker::BackendOptions{}.gemm_prefill_rows;   // the gpu_worker runs the default
  for (const model::LayerWeights& L : layers) {
    if (L.recurrent) {
      o.recurrent = true;
      ++o.recurrent_layers;
    } else
      o.q_rows = std::max(o.q_rows, L.attn.q.n_rows);
    if (L.dense.gate) o.dense_ff = std::max(o.dense_ff, L.dense.gate.n_rows);
    // Which layers moe_fused takes (formats and shapes its kernels accept, kernels/cuda) and which
    // of them hold experts on the device (placement, decided after this reserve) are not known
    // here: count both paths' buffers for every layer with experts. The batched matvec path's rows
    // cost 2.9 MB at 16-row steps of the 30B shape; from 64 rows the PrefillGemm needs them anyway.
    if (L.moe.down) {
      o.fused_down_types.push_back(L.moe.down.all.type);
      o.expert_matvec = true;
      // Long steps' staged experts when the gpu_worker's default stages (BackendOptions::stage_experts),
      // whenever some expert may be off the device, as the taken expert below.
      o.stage_expert_bytes = std::max<std::uint64_t>(
          o.stage_expert_bytes, static_cast<std::uint64_t>(std::max<std::int64_t>(0, slots)) * ArenaLayout::slot_bytes(L.moe));
      // The taken expert's buffers when the gpu_worker's default takes experts
      // (BackendOptions::take_expert_from; off by default: `--device-takes-from N` then holds
      // ~3 MB beyond this reserve for the 30B shape, which its over-budget line reports), whenever
      // some expert may be off the device: the placement is not known here either.
      if (gpu_worker::BackendOptions{}.take_expert_from > 0) {
        o.take_expert_bytes = std::max<std::uint64_t>(o.take_expert_bytes, ArenaLayout::slot_bytes(L.moe));
        o.take_down_types.push_back(L.moe.down.all.type);
        const auto offsets = ArenaLayout::part_offsets(L.moe);
        if (std::find(take_layouts.begin(), take_layouts.end(), offsets) == take_layouts.end()) take_layouts.push_back(offsets);
      }
    }
  }
  o.take_layouts = static_cast<std::int64_t>(take_layouts.size());
  return o;
}

std::int64_t long_step_stage_slots(const PlacementPlan& plan) {
  std::int64_t most = 0;
  for (std::int64_t il = 0; il < plan.n_layer; ++il)
    most = std::max<std::int64_t>(most, static_cast<std::int64_t>(plan.experts_in(il, Tier::kRam).size() +
                                                                  plan.experts_in(il, Tier::kFile).size()));
  return most;
}

std::uint64_t cuda_device_reserve_bytes(const model::HParams& hp, std::span<const model::LayerWeights> layers,
                                        std::int64_t max_tokens, std::int64_t context, std::int64_t long_step_rows,
                                        std::int64_t stage_slots, std::int64_t seq_slots) {
  const gpu_worker::CudaStepScratch s = gpu_worker::cuda_step_scratch(
      hp, cuda_reserve_scratch_options(layers, max_tokens, context, long_step_rows, stage_slots, seq_slots));
  // The driver backs every cudaMalloc with whole 2 MiB pages: each scratch buffer, the weights
  // arena's own allocations (a layer's expert slabs, the largest tensors; kernels/cuda/device_buffer.h)
  // and the arena's last, partly used 64 MiB chunk.
  constexpr std::uint64_t kPage = std::uint64_t{2} << 20;
  return kCudaContextReserve + s.total(kPage) + static_cast<std::uint64_t>(hp.n_layer) * kPage +
         (std::uint64_t{64} << 20);
}

std::uint64_t cuda_host_resident_bytes(const model::Model& m) {
  if (!m.tok_embd || m.output.data == m.tok_embd.data) return 0;
  return m.tok_embd.row_bytes * static_cast<std::uint64_t>(m.tok_embd.n_rows);
}

}  // namespace moraine::group
