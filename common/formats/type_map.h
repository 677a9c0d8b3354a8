// Choosing the stored type of each weight tensor by name rules, as moraine-quantize and
// moraine-synth take them on the command line:
//
//   --map "_exps.=q4_k" --map "attn_v=q6_k" --default q8_0
//
// The first rule whose PATTERN is a substring of the tensor name wins, else the default.
// 1-D tensors (norms, biases) are always F32; the 2-D+ ones llama.cpp never quantizes
// (llama_keeps_unquantized) are F32 unless a rule names them. A row length that is not a
// multiple of the chosen type's block falls back to q8_0, or to f16 when it is not a multiple of
// 32 either.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/formats/tensor_type.h"

namespace moraine {

struct TypeRule {
  std::string pattern;
  TensorType type;
};

// Types moraine writes as weights: computable ones, except Q8_K, which ggml uses only for
// activations (no llama.cpp matmul takes a Q8_K weight), and the IQ grid types (IQ2_XXS..IQ1_M:
// read, not written; they need an importance matrix and ggml's codebook search).
bool is_weight_target(TensorType t);
std::string weight_target_names();  // comma-separated, for error messages

// Parse errors throw std::invalid_argument whose message starts with `where`.
TensorType parse_weight_type(const std::string& name, const std::string& where);
TypeRule parse_type_rule(const std::string& text);  // "PATTERN=TYPE" (the last '=' splits)

// Dimensions as ggml counts them: trailing 1s do not count, so a [n, 1] tensor is 1-D.
int effective_dims(const std::vector<int64_t>& shape);

// True for the tensors llama.cpp's quantizer keeps unquantized: names not ending in "weight",
// norms, MoE routers (ffn_gate_inp) and SSM / short-conv conv1d taps.
bool llama_keeps_unquantized(const std::string& name);

struct TypeChoice {
  TensorType type = TensorType::F32;
  std::string note;  // non-empty when the wanted type did not fit the row length: says why
};

// The stored type of a tensor of `shape` (ggml order) named `name`, for a computable source.
TypeChoice choose_weight_type(const std::string& name, const std::vector<int64_t>& shape,
                              const std::vector<TypeRule>& rules, TensorType default_type);

// llama.cpp's LLAMA_FTYPE number naming a file whose most common weight type is `t`
// (1024 = "guessed" when no file type names it).
uint32_t llama_file_type(TensorType t);

// general.file_type for a file whose 2-D+ weights hold elements_by_type[t] elements of type t:
// the type holding the most elements names the file (F32 when there are none).
uint32_t llama_file_type(const std::map<TensorType, int64_t>& elements_by_type);

}  // namespace moraine
