// Parses one GGUF v3 file image (one shard) held in memory; every read is bounds-checked and
// every inconsistency is a GgufError naming the file, the field and the byte offset.
// Internal to moraine_gguf: GgufFile (gguf_reader.cpp) maps files and joins shards.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/gguf/gguf.h"

namespace moraine::gguf::detail {

inline constexpr uint64_t kDefaultAlignment = 32;
inline constexpr uint32_t kMaxDims = 4;          // ggml tensors have at most four dimensions
inline constexpr int kMaxArrayNesting = 64;      // bounds recursion on hostile input

struct ParsedShard {
  uint32_t version = 0;
  uint64_t alignment = kDefaultAlignment;
  uint64_t data_offset = 0;  // start of the data section (after padding); may equal EOF
  std::vector<std::pair<std::string, Value>> metadata;
  std::vector<TensorInfo> tensors;  // data points into `bytes`; shard index left 0
};

// `name` is only used in error messages.
ParsedShard parse_shard(const uint8_t* bytes, size_t size, const std::string& name);

}  // namespace moraine::gguf::detail
