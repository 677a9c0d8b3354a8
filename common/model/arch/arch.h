// One description per architecture (common/model/arch/<arch>.cpp): the GGUF keys it reads (with
// their defaults, or required), its tensor-name table (GGUF names as llama.cpp spells them, and
// the Hugging Face names the converter maps from), and the recipe of typed parts (parts.h) each
// layer is built from. The registry finds them by general.architecture or by the HF
// "architectures" name; every arch/*.cpp file is registered by the build (CMake globs them), so a
// new architecture that only recombines existing parts is one new file.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/gguf/gguf_value.h"
#include "common/model/arch/parts.h"

namespace moraine::gguf {
class GgufFile;
struct Array;
}  // namespace moraine::gguf

namespace moraine::model {

struct HParams;

// What a tensor is for. The table of each architecture names the ones it has.
enum class TensorRole {
  TokEmbd, OutputNorm, Output,
  AttnNorm, FfnNorm,
  AttnQ, AttnK, AttnV, AttnO, AttnQNorm, AttnKNorm,
  AttnQBias, AttnKBias, AttnVBias, AttnOBias, AttnSinks,
  MlaQA, MlaQANorm, MlaQB, MlaKvAMqa, MlaKvANorm, MlaKvB, MlaKB, MlaVB,
  DnQkv, DnGate, DnQkvzLegacy, DnBa, DnBeta, DnAlpha, DnConv, DnDtBias, DnA, DnNorm, DnOut,
  Router, RouterBias, ScoreBias,
  GateExps, UpExps, DownExps, GateExpsBias, UpExpsBias, DownExpsBias,
  SharedRouter, GateShexp, UpShexp, DownShexp,
  FfnGate, FfnUp, FfnDown,
  NextnEhProj, NextnEnorm, NextnHnorm, NextnEmbedTokens, NextnSharedHeadHead, NextnSharedHeadNorm,
  kCount
};

const char* tensor_role_name(TensorRole r);

// One row of an architecture's tensor table. `gguf` is the name after "blk.N." for layer tensors
// (whole for the global ones); `hf` is the Hugging Face name after "model.layers.N." (whole for
// global ones; "{E}" stands for the expert index, "{M}" for the MTP prefix), empty when the
// converter derives the tensor another way (fused, split, reordered: see tools/convert).
struct TensorName {
  TensorRole role;
  const char* gguf;
  const char* hf;
};

// One GGUF key of an architecture, after "{arch}.". `dflt` is the value used when the key is
// absent (its text, for the table); nullptr: required.
struct KeySpec {
  const char* suffix;
  const char* dflt;
  const char* what;
};

// Reads "{arch}.<suffix>" keys, naming the key in every error. Only keys of the common table or
// the architecture's own may be read (a std::logic_error otherwise), so the table stays true.
class KeyReader {
 public:
  KeyReader(const gguf::GgufFile& f, std::string arch, const std::vector<KeySpec>* arch_keys);

  std::string key(const char* suffix) const { return arch_ + "." + suffix; }
  [[noreturn]] void fail(const std::string& k, const std::string& why) const;

  // A positive integer (or a uniform per-layer array of them); fallback < 0: required.
  int64_t count(const char* suffix, int64_t fallback = -1, bool allow_zero = false) const;
  double real(const char* suffix, double fallback, bool required) const;
  bool flag(const char* suffix, bool fallback) const;
  std::string text(const char* suffix, const std::string& fallback) const;
  const gguf::Array* array(const char* suffix) const;
  bool has(const char* suffix) const;
  // Whether the file holds a tensor of this (whole GGUF) name: for parts only the tensors tell.
  bool has_tensor(const std::string& name) const;

 private:
  void declared(const char* suffix) const;
  const gguf::GgufFile& f_;
  std::string arch_;
  const std::vector<KeySpec>* arch_keys_;
};

using KeyList = std::vector<std::pair<std::string, gguf::Value>>;

struct ArchDesc {
  const char* name;                          // general.architecture
  std::vector<std::string> hf_architectures; // config.json "architectures" names it converts from
  std::vector<KeySpec> keys;                 // its own keys, beyond common_keys()
  std::vector<TensorName> tensors;           // every tensor it may have
  // Reads its own keys into hp (the common ones are read already) and checks them.
  void (*read_keys)(const KeyReader& r, HParams& hp);
  // The recipe of layer il from hp (il >= hp.n_layer: a multi-token-prediction block).
  LayerRecipe (*layer_recipe)(const HParams& hp, int64_t il);
  // Its own keys as a writer (moraine-synth) writes them, between the common ones and
  // rope.dimension_count; prefix is "{arch}.".
  void (*write_keys)(const HParams& hp, const std::string& prefix, KeyList& out);

  const TensorName* find(TensorRole role) const;
  // The GGUF name of role in layer il (il < 0: a global tensor). Throws std::logic_error when
  // the table lacks the role: a recipe asked for a part the table does not name.
  std::string gguf_name(TensorRole role, int64_t il) const;
};

// The keys every architecture reads the same way (block_count, embedding_length, heads, ...).
const std::vector<KeySpec>& common_keys();

// The registry: every arch/*.cpp description, by name.
const std::vector<const ArchDesc*>& all_archs();
const ArchDesc* find_arch(std::string_view gguf_name);           // nullptr when unknown
const ArchDesc* find_arch_by_hf(std::string_view hf_architecture);
std::string known_arch_names();                                  // "gpt-oss, qwen3moe, qwen3next"

}  // namespace moraine::model
