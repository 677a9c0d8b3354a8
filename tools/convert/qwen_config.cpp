#include "tools/convert/qwen_config.h"

namespace moraine::convert {

using nlohmann::json;

void require_default_rope(const HfConfig& cfg) {
  const HfConfig rope = cfg.rope();
  if (const json* t = rope.find("rope_type"); t && *t != "default") {
    throw ConvertError("config.json: rope type " + t->dump() + " is not supported (only default RoPE is)");
  }
  if (const json* t = rope.find("type"); t && *t != "default") {
    throw ConvertError("config.json: rope_scaling type " + t->dump() + " is not supported (only default RoPE is)");
  }
}

void read_qwen_moe(const HfConfig& cfg, HfModel& m) {
  m.hp.n_ff_exp = cfg.integer("moe_intermediate_size");
  if (cfg.opt_integer({"decoder_sparse_step"}).value_or(1) != 1) {
    throw ConvertError("config.json: decoder_sparse_step != 1 (dense layers between MoE layers) is not supported");
  }
  if (const json* mo = cfg.find("mlp_only_layers"); mo && !(mo->is_array() && mo->empty())) {
    throw ConvertError("config.json: mlp_only_layers " + mo->dump() + " (dense layers) is not supported");
  }
  if (cfg.flag("use_sliding_window", false)) {
    throw ConvertError("config.json: use_sliding_window = true is not supported");
  }
}

void require_norm_topk_prob(const HfConfig& cfg, bool dflt, bool required) {
  if (cfg.flag("norm_topk_prob", dflt) == required) return;
  if (required) {
    throw ConvertError("config.json: norm_topk_prob = false is not supported: the GGUF architecture always "
                       "renormalises the chosen experts' weights");
  }
  throw ConvertError("config.json: norm_topk_prob = true is not supported: the GGUF architecture never "
                     "renormalises the chosen experts' weights");
}

}  // namespace moraine::convert
