// Qwen2MoeForCausalLM -> qwen2moe: q/k/v biases, a softmax router whose top-k weights are used
// as they are (llama.cpp never renormalises for this family), a gated shared expert whose gate
// (mlp.shared_expert_gate, [1, n_embd]) the planner writes as llama.cpp does, [n_embd, 1].
#include "tools/convert/qwen_config.h"

namespace moraine::convert {

namespace {

void read_config(const HfConfig& cfg, const Checkpoint&, HfModel& m) {
  require_default_rope(cfg);
  read_qwen_moe(cfg, m);
  require_norm_topk_prob(cfg, false, false);
  // The q/k/v biases are always there in llama.cpp's qwen2moe (transformers: qkv_bias).
  if (!cfg.flag("qkv_bias", true)) cfg.fail("qkv_bias", "= false is not supported: the GGUF architecture has q/k/v biases");
  if (cfg.flag("attention_bias", false)) cfg.fail("attention_bias", "= true (an output bias) is not supported by the GGUF architecture");
  m.hp.norm_topk_prob = false;
  m.hp.n_ff_shexp = cfg.integer("shared_expert_intermediate_size");
  m.put_u32("expert_shared_feed_forward_length", m.hp.n_ff_shexp);
}

}  // namespace

const ArchConverter& converter_qwen2moe() {
  static const ArchConverter c{"qwen2moe", {"qwen2_moe"}, read_config, nullptr, nullptr};
  return c;
}

}  // namespace moraine::convert
