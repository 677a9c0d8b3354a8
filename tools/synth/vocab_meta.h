// The tokenizer.* metadata of a synthetic model: copied from a vocabulary GGUF, imported from a
// Hugging Face tokenizer.json (moraine-convert's importer), or a minimal byte-level BPE vocab.
// llama.cpp requires the token list to be exactly as long as the embedding, so the list is
// padded with unused "[PAD<id>]" tokens up to the model's vocab size.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/gguf/gguf_value.h"

namespace moraine::synth {

struct VocabMeta {
  std::vector<std::pair<std::string, gguf::Value>> keys;  // tokenizer.* in write order
  int64_t n_vocab = 0;   // token count after padding: the embedding's row count
  std::string note;      // what was padded or enlarged, for the user
};

// `shape_vocab` is the shape's vocab size; `explicit_size` is --vocab-size. Without an explicit
// size a vocabulary with more tokens than the shape enlarges the model to fit it; with one, a
// vocabulary that does not fit is an error. All errors throw std::invalid_argument naming the file.
VocabMeta vocab_from_gguf(const std::string& path, int64_t shape_vocab, std::optional<int64_t> explicit_size);
VocabMeta vocab_from_tokenizer_json(const std::string& path, int64_t shape_vocab, std::optional<int64_t> explicit_size);
VocabMeta byte_level_vocab(int64_t shape_vocab, std::optional<int64_t> explicit_size);

}  // namespace moraine::synth
