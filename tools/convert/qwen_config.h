// The config.json settings the Qwen MoE families share (qwen2moe, qwen3moe, qwen3next, qwen35moe).
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

// The DeltaNet hybrids (qwen3next, qwen35moe): the linear-attention sizes, partial RoPE, the
// layer layout and the multi-token-prediction block (mtp.*, counted from the checkpoint), with
// the keys llama.cpp writes for them (its "ssm.*", attention.recurrent_layers, nextn ones).
void read_qwen_hybrid(const HfConfig& cfg, const Checkpoint& ckpt, HfModel& m);

// The MTP projections are the checkpoint's once (mtp.fc, ...): planned on the first nextn block,
// skipped (true) on the others, left to the table (false) elsewhere.
bool qwen_mtp_once(const Planner& p, const model::TensorSlot& t);

// RMSNorm weights stored as 1 + w (the gated ssm_norm multiplies by w itself), A = -exp(A_log).
ElemOp qwen_hybrid_elem_op(model::TensorRole r);

}  // namespace moraine::convert
