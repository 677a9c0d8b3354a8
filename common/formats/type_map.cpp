#include "common/formats/type_map.h"

#include <optional>
#include <stdexcept>

#include "common/formats/quant_iq.h"

namespace moraine {

bool is_weight_target(TensorType t) {
  return type_traits(t).computable && t != TensorType::Q8_K && t != TensorType::Q8_1 && !formats::is_iq_grid_type(t);
}

std::string weight_target_names() {
  std::string out;
  for (uint32_t raw = 0; raw < 64; ++raw) {
    const TypeTraits* tr = find_type_traits(raw);
    if (tr && is_weight_target(tr->type)) out += (out.empty() ? "" : ", ") + std::string(tr->name);
  }
  return out;
}

TensorType parse_weight_type(const std::string& name, const std::string& where) {
  const std::optional<TensorType> t = type_from_name(name);
  if (!t || !is_weight_target(*t)) {
    throw std::invalid_argument(where + ": '" + name + "' is not a type moraine writes as a weight (use one of: " +
                                weight_target_names() + ")");
  }
  return *t;
}

TypeRule parse_type_rule(const std::string& text) {
  const size_t eq = text.rfind('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == text.size()) {
    throw std::invalid_argument("--map '" + text + "': expected PATTERN=TYPE, e.g. --map \"_exps.=q4_k\"");
  }
  return {text.substr(0, eq), parse_weight_type(text.substr(eq + 1), "--map '" + text + "'")};
}

int effective_dims(const std::vector<int64_t>& shape) {
  int n = 1;
  for (size_t i = 1; i < shape.size(); ++i) {
    if (shape[i] != 1) n = static_cast<int>(i) + 1;
  }
  return n;
}

bool llama_keeps_unquantized(const std::string& name) {
  // llama.cpp's quantizer (llama-quant.cpp) leaves these alone: names not ending in "weight",
  // norms, MoE routers (a quantized router moves expert choices), and the conv1d of
  // linear-attention/SSM blocks (llama.cpp's ssm_conv reads it as F32 only and aborts on F16).
  if (name.size() < 6 || name.compare(name.size() - 6, 6, "weight") != 0) return true;
  for (const char* keep : {"_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d", "shortconv.conv.weight"}) {
    if (name.find(keep) != std::string::npos) return true;
  }
  return false;
}

TypeChoice choose_weight_type(const std::string& name, const std::vector<int64_t>& shape,
                              const std::vector<TypeRule>& rules, TensorType default_type) {
  TypeChoice c;
  if (effective_dims(shape) == 1) return c;  // norms and biases: tiny, and precision there is cheap to keep
  TensorType want = default_type;
  bool matched = false;
  for (const TypeRule& r : rules) {
    if (name.find(r.pattern) != std::string::npos) {
      want = r.type;
      matched = true;
      break;
    }
  }
  // An explicit rule may still quantize them (to study a quantized router); --default may not.
  if (!matched && llama_keeps_unquantized(name)) return c;
  c.type = want;
  const int64_t row = shape.empty() ? 1 : shape[0];
  const int64_t block = type_traits(want).block_elems;
  if (row % block != 0) {
    c.type = (row % 32 == 0) ? TensorType::Q8_0 : TensorType::F16;
    c.note = name + ": row length " + std::to_string(row) + " is not a multiple of " + std::to_string(block) + " (" +
             std::string(type_name(want)) + "); using " + std::string(type_name(c.type));
  }
  return c;
}

uint32_t llama_file_type(TensorType t) {
  // The table llama.cpp uses to name a file type; a K-quant names its "_M" mix.
  switch (t) {
    case TensorType::F32: return 0;
    case TensorType::F16: return 1;
    case TensorType::Q4_0: return 2;
    case TensorType::Q4_1: return 3;
    case TensorType::Q8_0: return 7;
    case TensorType::Q5_0: return 8;
    case TensorType::Q5_1: return 9;
    case TensorType::Q2_K: return 10;
    case TensorType::Q3_K: return 12;  // Q3_K_M
    case TensorType::Q4_K: return 15;  // Q4_K_M
    case TensorType::Q5_K: return 17;  // Q5_K_M
    case TensorType::Q6_K: return 18;
    case TensorType::IQ2_XXS: return 19;
    case TensorType::IQ2_XS: return 20;
    case TensorType::IQ3_XXS: return 23;
    case TensorType::IQ1_S: return 24;
    case TensorType::IQ4_NL: return 25;
    case TensorType::IQ3_S: return 26;
    case TensorType::IQ2_S: return 29;   // IQ2_M: llama.cpp's IQ2_S file type stores IQ2_XS tensors
    case TensorType::IQ4_XS: return 30;
    case TensorType::IQ1_M: return 31;
    case TensorType::BF16: return 32;
    case TensorType::TQ1_0: return 36;
    case TensorType::TQ2_0: return 37;
    case TensorType::MXFP4: return 38;  // MXFP4_MOE
    default: return 1024;               // LLAMA_FTYPE_GUESSED
  }
}

uint32_t llama_file_type(const std::map<TensorType, int64_t>& elements_by_type) {
  TensorType dominant = TensorType::F32;
  int64_t most = -1;
  for (const auto& [type, n] : elements_by_type) {
    if (n > most) {
      most = n;
      dominant = type;
    }
  }
  return llama_file_type(dominant);
}

}  // namespace moraine
