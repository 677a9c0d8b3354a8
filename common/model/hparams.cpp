#include "common/model/hparams.h"

#include <string>

#include "common/gguf/gguf.h"
#include "common/model/arch/arch.h"
#include "common/model/model_error.h"

namespace moraine::model {

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::Qwen3Moe: return "qwen3moe";
    case Arch::Qwen3Next: return "qwen3next";
    case Arch::Other: return "?";
  }
  return "?";
}

const char* HParams::arch_string() const { return desc != nullptr ? desc->name : arch_name(arch); }

LayerRecipe HParams::recipe(int64_t il) const {
  if (il >= 0 && il < static_cast<int64_t>(recipes.size())) return recipes[static_cast<size_t>(il)];
  LayerRecipe r;
  r.mixer.kind = is_recurrent(il) ? MixerKind::GatedDeltaNet : MixerKind::Attention;
  r.mixer.attn.qk_norm = true;
  r.mixer.attn.output_gate = arch == Arch::Qwen3Next;
  r.mixer.attn.rope.n_rot = n_rot;
  r.mixer.attn.rope.freq_base = rope_freq_base;
  r.ffn.router.renormalize = norm_topk_prob;
  r.ffn.experts.n_ff = n_ff_exp;
  r.ffn.shared = {n_ff_shexp > 0, n_ff_shexp > 0, n_ff_shexp};
  return r;
}

namespace {

// The keys every architecture shares; the description reads the rest.
void read_common(const KeyReader& r, HParams& hp) {
  const int64_t block_count = r.count("block_count");
  hp.n_nextn = r.count("nextn_predict_layers", 0, /*allow_zero=*/true);
  if (hp.n_nextn >= block_count) r.fail(r.key("nextn_predict_layers"), "not smaller than block_count");
  hp.n_layer = block_count - hp.n_nextn;
  hp.n_embd = r.count("embedding_length");
  hp.n_ff = r.count("feed_forward_length", 0, /*allow_zero=*/true);
  hp.n_head = r.count("attention.head_count");
  hp.n_head_kv = r.count("attention.head_count_kv", hp.n_head);
  if (hp.n_head % hp.n_head_kv != 0) {
    r.fail(r.key("attention.head_count_kv"), "head_count " + std::to_string(hp.n_head) +
                                                 " is not a multiple of head_count_kv " +
                                                 std::to_string(hp.n_head_kv));
  }
  hp.head_dim = r.count("attention.key_length", hp.n_embd / hp.n_head);
  hp.head_dim_v = r.count("attention.value_length", hp.head_dim);
  hp.n_rot = r.count("rope.dimension_count", hp.head_dim);
  if (hp.n_rot > hp.head_dim || hp.n_rot % 2 != 0) {
    r.fail(r.key("rope.dimension_count"), "must be even and at most the head dim " +
                                              std::to_string(hp.head_dim));
  }
  hp.rope_freq_base = r.real("rope.freq_base", 10000.0, false);
  hp.rms_eps = r.real("attention.layer_norm_rms_epsilon", 0.0, true);

  hp.n_expert = r.count("expert_count");
  hp.n_expert_used = r.count("expert_used_count");
  if (hp.n_expert_used > hp.n_expert) {
    r.fail(r.key("expert_used_count"), std::to_string(hp.n_expert_used) + " exceeds expert_count " +
                                           std::to_string(hp.n_expert));
  }
  hp.n_ff_exp = r.count("expert_feed_forward_length");
}

}  // namespace

HParams read_hparams(const gguf::GgufFile& file) {
  std::optional<std::string> arch = file.get_string("general.architecture");
  const std::string where = file.paths().empty() ? std::string("model") : file.paths()[0];
  if (!arch) throw ModelError(where + ": metadata general.architecture is missing");
  const ArchDesc* desc = find_arch(*arch);
  if (desc == nullptr) {
    throw ModelError(where + ": unknown architecture '" + *arch + "' (moraine runs " + known_arch_names() + ")");
  }
  HParams hp;
  hp.desc = desc;
  hp.arch = *arch == "qwen3moe" ? Arch::Qwen3Moe : *arch == "qwen3next" ? Arch::Qwen3Next : Arch::Other;
  KeyReader r(file, *arch, &desc->keys);
  read_common(r, hp);
  desc->read_keys(r, hp);
  // Only MLA (its latent is the value) has values of another width than the keys.
  if (hp.kv_lora_rank == 0 && hp.head_dim_v != hp.head_dim) {
    r.fail(r.key("attention.value_length"), "differs from key_length (" + std::to_string(hp.head_dim_v) +
                                                " vs " + std::to_string(hp.head_dim) + ")");
  }
  if (hp.recurrent.empty()) hp.recurrent.assign(static_cast<size_t>(hp.n_layer), false);
  for (int64_t il = 0; il < hp.n_layer + hp.n_nextn; ++il) hp.recipes.push_back(desc->layer_recipe(hp, il));
  return hp;
}

}  // namespace moraine::model
