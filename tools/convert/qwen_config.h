// The config.json settings the Qwen MoE families share (qwen2moe, qwen3moe, qwen3next).
#pragma once
#include "tools/convert/arch_converter.h"

namespace moraine::convert {

// Refuses RoPE scaling (rope_type / type other than "default"): these GGUF architectures have none.
void require_default_rope(const HfConfig& cfg);

// moe_intermediate_size; refuses dense layers between MoE layers (decoder_sparse_step,
// mlp_only_layers) and sliding-window attention.
void read_qwen_moe(const HfConfig& cfg, HfModel& m);

// norm_topk_prob (default `dflt`) must be `required`: the GGUF graph renormalises the chosen
// experts' weights always (qwen3moe, qwen3next) or never (qwen2moe).
void require_norm_topk_prob(const HfConfig& cfg, bool dflt, bool required);

}  // namespace moraine::convert
