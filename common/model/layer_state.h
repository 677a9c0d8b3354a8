// What one layer keeps per sequence, from its recipe: an attention layer's K and V for every
// cached position, a Gated DeltaNet layer's conv and recurrent state (float32, any context).
// Placement (coordinator/placement.cpp) sums these for the KV/state budget.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/model/hparams.h"
#include "common/model/kv_type.h"

namespace moraine::model {

inline uint64_t layer_state_bytes(const HParams& hp, int64_t il, int64_t context, KvType kv_type) {
  const LayerRecipe r = hp.recipe(il);
  const auto ctx = static_cast<uint64_t>(context);
  switch (r.mixer.kind) {
    case MixerKind::GatedDeltaNet:
      return static_cast<uint64_t>((hp.ssm_conv_kernel - 1) * hp.ssm_conv_dim() +
                                   hp.ssm_n_v_heads * hp.ssm_head_k_dim * hp.ssm_head_v_dim) * sizeof(float);
    case MixerKind::Attention:
      // A sliding layer still keeps every position: no backend holds a window-sized ring yet.
      return 2 * ctx * static_cast<uint64_t>(hp.n_head_kv * hp.head_dim) * kv_type_bytes(kv_type);
    case MixerKind::Mla:
      // The compressed latent and the rotary key per position (deepseek2), as the reference caches them.
      return ctx * static_cast<uint64_t>(r.mixer.mla.kv_lora_rank + r.mixer.mla.rope_dim) * kv_type_bytes(kv_type);
  }
  throw std::logic_error("layer_state_bytes: layer " + std::to_string(il) + " has an unknown mixer");
}

}  // namespace moraine::model
