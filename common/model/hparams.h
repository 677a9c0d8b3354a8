// Hyper-parameters of a model, read from GGUF metadata under the keys llama.cpp writes
// ("{arch}.block_count", "{arch}.attention.head_count", ...). The common keys are read here; the
// architecture's own keys and its per-layer recipe come from its description
// (common/model/arch/<arch>.cpp). Fields an architecture does not use stay zero.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/model/arch/parts.h"

namespace moraine::gguf {
class GgufFile;
}

namespace moraine::model {

struct ArchDesc;

// The two architectures moraine ran before the descriptions; kept for the callers that compare
// against them. Code that behaves per architecture reads hp.desc and hp.recipes instead.
enum class Arch { Qwen3Moe, Qwen3Next, Other };

const char* arch_name(Arch a);  // the GGUF general.architecture string ("?" for Other)

struct HParams {
  Arch arch = Arch::Qwen3Moe;
  const ArchDesc* desc = nullptr;   // the architecture's description (null: built by hand, tests)
  // Per layer, trunk then nextn blocks: the parts it is built from (desc->layer_recipe).
  std::vector<LayerRecipe> recipes;
  int64_t n_layer = 0;          // trunk layers (block_count minus nextn layers)
  int64_t n_nextn = 0;          // multi-token-prediction layers stored after the trunk
  int64_t n_embd = 0;
  int64_t n_vocab = 0;          // rows of token_embd
  int64_t n_head = 0;
  int64_t n_head_kv = 0;
  int64_t head_dim = 0;         // key_length == value_length for both families
  int64_t n_rot = 0;            // rotary dimensions (NEOX); < head_dim means partial rotary
  double rope_freq_base = 10000.0;
  double rms_eps = 1e-6;

  int64_t n_expert = 0;
  int64_t n_expert_used = 0;
  int64_t n_ff_exp = 0;          // expert hidden width
  int64_t n_ff_shexp = 0;        // shared-expert hidden width (qwen3next)
  bool norm_topk_prob = true;    // renormalise the top-k router weights to sum to one

  // Gated DeltaNet (qwen3next).
  int64_t ssm_conv_kernel = 0;   // causal conv1d width
  int64_t ssm_head_k_dim = 0;    // ssm.state_size: key (and value) head dim
  int64_t ssm_n_k_heads = 0;     // ssm.group_count
  int64_t ssm_n_v_heads = 0;     // ssm.time_step_rank
  int64_t ssm_head_v_dim = 0;    // ssm.inner_size / n_v_heads
  int64_t full_attention_interval = 0;
  std::vector<bool> recurrent;   // per trunk layer: true = DeltaNet, false = full attention

  // Options of parts other architectures use (their descriptions read the keys).
  int64_t sliding_window = 0;       // attention.sliding_window: the window of the layers that slide
  std::vector<bool> swa_layers;     // per trunk layer: true = sliding-window attention
  RopeScaling rope_scaling = RopeScaling::None;
  double rope_scaling_factor = 1.0;
  int64_t rope_orig_ctx = 0;        // rope.scaling.original_context_length
  bool rope_yarn_truncate = true;   // rope.scaling.yarn_truncate (moraine's key; llama.cpp always rounds)
  double expert_weights_scale = 1.0;  // routed output's factor
  int64_t n_expert_groups = 1;      // expert_group_count: group-limited routing (1: no groups)
  int64_t n_group_used = 1;         // expert_group_used_count: the groups a token's top-k comes from
  bool attn_qk_norm = false;        // q/k norm tensors present (glm4moe: GLM-4.5 has them, Air not)
  int64_t n_ff = 0;                 // feed_forward_length (dense layers)
  int64_t n_dense_lead = 0;         // leading_dense_block_count

  // Multi-head latent attention (deepseek2; its description reads the keys).
  int64_t head_dim_v = 0;           // attention.value_length: head_dim, except under MLA (kv_lora_rank)
  int64_t q_lora_rank = 0;          // 0: q projected directly
  int64_t kv_lora_rank = 0;         // > 0: the model's mixers are MLA
  int64_t mla_head_k = 0;           // per-head q.k dims once decompressed (nope + rope)
  int64_t mla_head_v = 0;           // per-head value dims once decompressed
  bool mla_split_kv_b = false;      // attention.key_length_mla present: attn_k_b / attn_v_b, else attn_kv_b
  double rope_yarn_log_mul = 0.0;   // DeepSeek's mscale_all_dim (the key holds 0.1 times it)
  double rope_attn_factor = 1.0;    // rope.scaling.attn_factor
  bool sigmoid_gating = false;      // deepseek2's expert_gating_func 2: the sigmoid router
  bool expert_score_bias = false;   // deepseek2: exp_probs_b present (llama.cpp takes it when there)

  const char* arch_string() const;  // general.architecture of desc (or of arch when desc is null)
  // The recipe of layer il; a hand-built HParams without recipes gets the one its flat fields
  // imply (attention or DeltaNet, softmax-then-top-k, a gated shared expert when n_ff_shexp > 0).
  LayerRecipe recipe(int64_t il) const;

  int64_t ssm_key_dim() const { return ssm_head_k_dim * ssm_n_k_heads; }
  int64_t ssm_value_dim() const { return ssm_head_v_dim * ssm_n_v_heads; }
  int64_t ssm_conv_dim() const { return 2 * ssm_key_dim() + ssm_value_dim(); }
  bool is_recurrent(int64_t layer) const {
    return layer < static_cast<int64_t>(recurrent.size()) && recurrent[layer];
  }
};

// Reads and validates the hyper-parameters. Throws ModelError naming the missing or bad key.
// n_vocab is filled by the loader from token_embd (it is not a required metadata key).
HParams read_hparams(const gguf::GgufFile& file);

}  // namespace moraine::model
