// The registry of architecture descriptions (arch/*.cpp, listed by the build into arch_list.inc),
// the GGUF key reader they share, and the tensor tables' lookup.
#include <algorithm>
#include <optional>
#include <stdexcept>

#include "common/gguf/gguf.h"
#include "common/model/arch/arch.h"
#include "common/model/model_error.h"

namespace moraine::model {

#define MORAINE_ARCH(stem) const ArchDesc& arch_##stem();
#include "arch_list.inc"
#undef MORAINE_ARCH

const std::vector<const ArchDesc*>& all_archs() {
  static const std::vector<const ArchDesc*> archs = [] {
    std::vector<const ArchDesc*> v = {
#define MORAINE_ARCH(stem) &arch_##stem(),
#include "arch_list.inc"
#undef MORAINE_ARCH
    };
    std::sort(v.begin(), v.end(), [](const ArchDesc* a, const ArchDesc* b) { return std::string(a->name) < b->name; });
    return v;
  }();
  return archs;
}

const ArchDesc* find_arch(std::string_view name) {
  for (const ArchDesc* a : all_archs())
    if (name == a->name) return a;
  return nullptr;
}

const ArchDesc* find_arch_by_hf(std::string_view hf) {
  for (const ArchDesc* a : all_archs())
    for (const std::string& h : a->hf_architectures)
      if (hf == h) return a;
  return nullptr;
}

std::string known_arch_names() {
  std::string s;
  for (const ArchDesc* a : all_archs()) s += (s.empty() ? "" : ", ") + std::string(a->name);
  return s;
}

const std::vector<KeySpec>& common_keys() {
  static const std::vector<KeySpec> keys = {
      {"block_count", nullptr, "layers, nextn blocks included"},
      {"nextn_predict_layers", "0", "multi-token-prediction blocks after the trunk"},
      {"context_length", "(none)", "trained context; caps --ctx"},
      {"embedding_length", nullptr, "n_embd"},
      {"feed_forward_length", "0", "dense FFN width"},
      {"attention.head_count", nullptr, "query heads"},
      {"attention.head_count_kv", "head_count", "key/value heads (GQA)"},
      {"attention.key_length", "n_embd / head_count", "head dim"},
      {"attention.value_length", "key_length", "must equal key_length (MLA: kv_lora_rank)"},
      {"rope.dimension_count", "key_length", "rotary dims (even, <= head dim)"},
      {"rope.freq_base", "10000", "RoPE theta"},
      {"attention.layer_norm_rms_epsilon", nullptr, "RMSNorm epsilon"},
      {"expert_count", nullptr, "routed experts"},
      {"expert_used_count", nullptr, "experts per token"},
      {"expert_feed_forward_length", nullptr, "expert hidden width"},
  };
  return keys;
}

const TensorName* ArchDesc::find(TensorRole role) const {
  for (const TensorName& t : tensors)
    if (t.role == role) return &t;
  return nullptr;
}

std::string ArchDesc::gguf_name(TensorRole role, int64_t il) const {
  const TensorName* t = find(role);
  if (t == nullptr)
    throw std::logic_error(std::string(name) + ": the tensor table has no " + tensor_role_name(role) +
                           " (a recipe asks for a part the table does not name)");
  return il < 0 ? std::string(t->gguf) : "blk." + std::to_string(il) + "." + t->gguf;
}

const char* tensor_role_name(TensorRole r) {
  static const char* const names[] = {
      "TokEmbd", "OutputNorm", "Output", "AttnNorm", "FfnNorm", "AttnQ", "AttnK", "AttnV", "AttnO",
      "AttnQNorm", "AttnKNorm", "AttnQBias", "AttnKBias", "AttnVBias", "AttnOBias", "AttnSinks",
      "MlaQA", "MlaQANorm", "MlaQB", "MlaKvAMqa", "MlaKvANorm", "MlaKvB", "MlaKB", "MlaVB", "DnQkv",
      "DnGate", "DnQkvzLegacy", "DnBa", "DnBeta", "DnAlpha", "DnConv", "DnDtBias", "DnA", "DnNorm", "DnOut", "Router",
      "RouterBias", "ScoreBias", "GateExps", "UpExps", "DownExps", "GateExpsBias", "UpExpsBias",
      "DownExpsBias", "SharedRouter", "GateShexp", "UpShexp", "DownShexp", "FfnGate", "FfnUp", "FfnDown",
      "NextnEhProj", "NextnEnorm", "NextnHnorm", "NextnEmbedTokens", "NextnSharedHeadHead",
      "NextnSharedHeadNorm"};
  static_assert(sizeof(names) / sizeof(names[0]) == static_cast<size_t>(TensorRole::kCount));
  return names[static_cast<int>(r)];
}

// ---- KeyReader ----

KeyReader::KeyReader(const gguf::GgufFile& f, std::string arch, const std::vector<KeySpec>* arch_keys)
    : f_(f), arch_(std::move(arch)), arch_keys_(arch_keys) {}

void KeyReader::declared(const char* suffix) const {
  const auto in = [&](const std::vector<KeySpec>& v) {
    return std::any_of(v.begin(), v.end(), [&](const KeySpec& k) { return std::string_view(k.suffix) == suffix; });
  };
  if (!in(common_keys()) && (arch_keys_ == nullptr || !in(*arch_keys_)))
    throw std::logic_error(arch_ + ": key " + suffix + " is read but not in the description's key table");
}

void KeyReader::fail(const std::string& k, const std::string& why) const {
  throw ModelError(f_.paths().empty() ? k + ": " + why : f_.paths()[0] + ": metadata " + k + ": " + why);
}

bool KeyReader::has(const char* suffix) const {
  declared(suffix);
  return f_.find(key(suffix)) != nullptr;
}

bool KeyReader::has_tensor(const std::string& name) const { return f_.find_tensor(name) != nullptr; }

int64_t KeyReader::count(const char* suffix, int64_t fallback, bool allow_zero) const {
  declared(suffix);
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

double KeyReader::real(const char* suffix, double fallback, bool required) const {
  declared(suffix);
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

bool KeyReader::flag(const char* suffix, bool fallback) const {
  declared(suffix);
  const gguf::Value* v = f_.find(key(suffix));
  if (v == nullptr) return fallback;
  std::optional<bool> b = v->as_bool();
  if (!b) fail(key(suffix), "expected a bool");
  return *b;
}

std::string KeyReader::text(const char* suffix, const std::string& fallback) const {
  declared(suffix);
  const gguf::Value* v = f_.find(key(suffix));
  if (v == nullptr) return fallback;
  std::optional<std::string> s = f_.get_string(key(suffix));
  if (!s) fail(key(suffix), "expected a string");
  return *s;
}

const gguf::Array* KeyReader::array(const char* suffix) const {
  declared(suffix);
  return f_.get_array(key(suffix));
}

}  // namespace moraine::model
