// Qwen3MoeForCausalLM -> qwen3moe: every tensor maps by the description's table (per-expert or
// transformers v5 fused experts are the planner's); no keys beyond the common ones.
#include "tools/convert/qwen_config.h"

namespace moraine::convert {

namespace {

void read_config(const HfConfig& cfg, const Checkpoint&, HfModel& m) {
  require_default_rope(cfg);
  read_qwen_moe(cfg, m);
  // llama.cpp's qwen3moe graph always renormalises the top-k router weights.
  require_norm_topk_prob(cfg, false, true);
  if (cfg.flag("attention_bias", false)) {
    throw ConvertError("config.json: attention_bias = true is not supported by the GGUF architecture");
  }
  m.hp.norm_topk_prob = true;
}

}  // namespace

const ArchConverter& converter_qwen3moe() {
  static const ArchConverter c{"qwen3moe", {"qwen3_moe"}, read_config, nullptr, nullptr};
  return c;
}

}  // namespace moraine::convert
