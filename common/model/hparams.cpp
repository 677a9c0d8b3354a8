#include "common/model/hparams.h"

#include <string>

#include "common/gguf/gguf.h"
#include "common/model/model_error.h"

namespace moraine::model {

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::Qwen3Moe: return "qwen3moe";
    case Arch::Qwen3Next: return "qwen3next";
  }
  return "?";
}

namespace {

class KeyReader {
 public:
  KeyReader(const gguf::GgufFile& f, std::string arch) : f_(f), arch_(std::move(arch)) {}

  std::string key(const char* suffix) const { return arch_ + "." + suffix; }

  [[noreturn]] void fail(const std::string& k, const std::string& why) const {
    throw ModelError(f_.paths().empty() ? k + ": " + why : f_.paths()[0] + ": metadata " + k + ": " + why);
  }

  // A positive integer; `fallback` < 0 means the key is required.
  int64_t count(const char* suffix, int64_t fallback = -1, bool allow_zero = false) const {
    const std::string k = key(suffix);
    const gguf::Value* v = f_.find(k);
    if (v == nullptr) {
      if (fallback < 0) fail(k, "required key is missing");
      return fallback;
    }
    std::optional<int64_t> x = v->as_i64();
    if (!x) {
      // llama.cpp allows some counts to be per-layer arrays; we accept one only if uniform.
      if (const gguf::Array* a = v->as_array(); a != nullptr && !a->items.empty()) {
        std::optional<int64_t> first = a->items[0].as_i64();
        for (const gguf::Value& it : a->items) {
          if (!first || it.as_i64() != first) fail(k, "per-layer values that differ are not supported");
        }
        x = first;
      } else {
        fail(k, "expected an integer, found " + std::string(gguf::value_type_name(v->type())));
      }
    }
    if (*x < 0 || (*x == 0 && !allow_zero)) fail(k, "must be positive, is " + std::to_string(*x));
    if (*x > (int64_t{1} << 32)) fail(k, "implausibly large: " + std::to_string(*x));
    return *x;
  }

  double real(const char* suffix, double fallback, bool required) const {
    const std::string k = key(suffix);
    const gguf::Value* v = f_.find(k);
    if (v == nullptr) {
      if (required) fail(k, "required key is missing");
      return fallback;
    }
    std::optional<double> x = v->as_f64();
    if (!x) fail(k, "expected a number");
    if (!(*x > 0.0)) fail(k, "must be positive, is " + std::to_string(*x));
    return *x;
  }

  bool flag(const char* suffix, bool fallback) const {
    const gguf::Value* v = f_.find(key(suffix));
    if (v == nullptr) return fallback;
    std::optional<bool> b = v->as_bool();
    if (!b) fail(key(suffix), "expected a bool");
    return *b;
  }

  const gguf::Array* array(const char* suffix) const { return f_.get_array(key(suffix)); }

 private:
  const gguf::GgufFile& f_;
  std::string arch_;
};

}  // namespace

HParams read_hparams(const gguf::GgufFile& file) {
  std::optional<std::string> arch = file.get_string("general.architecture");
  const std::string where = file.paths().empty() ? std::string("model") : file.paths()[0];
  if (!arch) throw ModelError(where + ": metadata general.architecture is missing");
  HParams hp;
  if (*arch == "qwen3moe") {
    hp.arch = Arch::Qwen3Moe;
  } else if (*arch == "qwen3next") {
    hp.arch = Arch::Qwen3Next;
  } else {
    throw ModelError(where + ": unknown architecture '" + *arch +
                     "' (moraine runs qwen3moe and qwen3next)");
  }
  KeyReader r(file, *arch);

  const int64_t block_count = r.count("block_count");
  hp.n_nextn = r.count("nextn_predict_layers", 0, /*allow_zero=*/true);
  if (hp.n_nextn >= block_count) r.fail(r.key("nextn_predict_layers"), "not smaller than block_count");
  hp.n_layer = block_count - hp.n_nextn;
  hp.n_embd = r.count("embedding_length");
  hp.n_head = r.count("attention.head_count");
  hp.n_head_kv = r.count("attention.head_count_kv", hp.n_head);
  if (hp.n_head % hp.n_head_kv != 0) {
    r.fail(r.key("attention.head_count_kv"), "head_count " + std::to_string(hp.n_head) +
                                                 " is not a multiple of head_count_kv " +
                                                 std::to_string(hp.n_head_kv));
  }
  hp.head_dim = r.count("attention.key_length", hp.n_embd / hp.n_head);
  const int64_t v_len = r.count("attention.value_length", hp.head_dim);
  if (v_len != hp.head_dim) {
    r.fail(r.key("attention.value_length"), "differs from key_length (" + std::to_string(v_len) +
                                                " vs " + std::to_string(hp.head_dim) + ")");
  }
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
  // llama.cpp always renormalises for these families; a converter that knows the HF config's
  // norm_topk_prob writes expert_weights_norm so a model trained without it runs right too.
  hp.norm_topk_prob = r.flag("expert_weights_norm", true);

  if (hp.arch == Arch::Qwen3Next) {
    hp.n_ff_shexp = r.count("expert_shared_feed_forward_length", hp.n_ff_exp);
    hp.ssm_conv_kernel = r.count("ssm.conv_kernel");
    hp.ssm_head_k_dim = r.count("ssm.state_size");
    hp.ssm_n_k_heads = r.count("ssm.group_count");
    hp.ssm_n_v_heads = r.count("ssm.time_step_rank");
    const int64_t inner = r.count("ssm.inner_size");
    if (inner % hp.ssm_n_v_heads != 0) {
      r.fail(r.key("ssm.inner_size"), "not a multiple of ssm.time_step_rank");
    }
    hp.ssm_head_v_dim = inner / hp.ssm_n_v_heads;
    if (hp.ssm_n_v_heads % hp.ssm_n_k_heads != 0) {
      r.fail(r.key("ssm.time_step_rank"), "value heads " + std::to_string(hp.ssm_n_v_heads) +
                                              " not a multiple of key heads (ssm.group_count) " +
                                              std::to_string(hp.ssm_n_k_heads));
    }
    if (hp.ssm_head_v_dim != hp.ssm_head_k_dim) {
      r.fail(r.key("ssm.inner_size"), "value head dim " + std::to_string(hp.ssm_head_v_dim) +
                                          " differs from key head dim (ssm.state_size) " +
                                          std::to_string(hp.ssm_head_k_dim));
    }
    hp.recurrent.assign(hp.n_layer, false);
    if (const gguf::Array* a = r.array("attention.recurrent_layers"); a != nullptr) {
      if (static_cast<int64_t>(a->items.size()) < hp.n_layer) {
        r.fail(r.key("attention.recurrent_layers"), "has " + std::to_string(a->items.size()) +
                                                        " entries for " + std::to_string(hp.n_layer) +
                                                        " layers");
      }
      for (int64_t i = 0; i < hp.n_layer; ++i) {
        std::optional<bool> b = a->items[i].as_bool();
        if (!b) {
          if (std::optional<int64_t> x = a->items[i].as_i64()) b = *x != 0;
        }
        if (!b) r.fail(r.key("attention.recurrent_layers"), "entries must be bools");
        hp.recurrent[i] = *b;
      }
      hp.full_attention_interval = r.count("full_attention_interval", 0, true);
    } else {
      hp.full_attention_interval = r.count("full_attention_interval", 4);
      for (int64_t i = 0; i < hp.n_layer; ++i) {
        hp.recurrent[i] = (i + 1) % hp.full_attention_interval != 0;
      }
    }
  } else {
    hp.recurrent.assign(hp.n_layer, false);
  }
  return hp;
}

}  // namespace moraine::model
