// Hyper-parameters of a model, read from GGUF metadata under the keys llama.cpp writes
// ("{arch}.block_count", "{arch}.attention.head_count", ...). One struct for every family
// moraine runs; fields a family does not use stay zero.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moraine::gguf {
class GgufFile;
}

namespace moraine::model {

enum class Arch { Qwen3Moe, Qwen3Next };

const char* arch_name(Arch a);  // the GGUF general.architecture string

struct HParams {
  Arch arch = Arch::Qwen3Moe;
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
