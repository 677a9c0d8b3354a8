// Byte-level BPE on one pre-tokenized word: start from one symbol per byte, then repeatedly merge
// the adjacent pair with the best (lowest) merge rank, leftmost first on ties, until no adjacent
// pair has a merge. Pairs are keyed by token ids so no strings are built while merging.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/tokenizer/vocab.h"

namespace moraine::tokenizer {

class BpeMerges {
 public:
  // token_to_id maps each vocabulary text (byte-level alphabet form) to its id. Merges whose
  // parts or result are not tokens can never apply to ids and are counted in skipped_merges().
  BpeMerges(const StringMap& token_to_id,
            const std::vector<std::string>& merges);

  // Scratch space reused across words so merging allocates nothing in steady state.
  struct Workspace {
    struct Pair {
      int32_t rank;
      int32_t left;
      int32_t right;
      TokenId left_id;
      TokenId right_id;
      TokenId result;
    };
    std::vector<TokenId> id;
    std::vector<int32_t> prev, next;
    std::vector<Pair> heap;
  };

  // Appends the ids of `raw` (the word's raw bytes). A byte whose alphabet character is not a
  // token is dropped, as llama.cpp does; missing_byte_tokens() says whether that can happen.
  void encode_word(std::string_view raw, std::vector<TokenId>& out, Workspace& ws) const;

  size_t skipped_merges() const { return skipped_merges_; }
  int missing_byte_tokens() const { return missing_byte_tokens_; }

 private:
  // Open-addressing table keyed by the (left, right) id pair. Merge look-ups are the hot loop of
  // BPE: with std::unordered_map they were 29% of encode time (perf, 1 MB of llama.cpp source,
  // qwen2 vocab); this table took that encode from 41 ms to 22 ms.
  struct Slot {
    uint64_t key = kEmpty;
    int32_t rank = 0;
    TokenId result = 0;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  static uint64_t key(TokenId a, TokenId b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  size_t home(uint64_t k) const { return static_cast<size_t>((k * 0x9E3779B97F4A7C15ull) >> shift_); }
  const Slot* find(TokenId a, TokenId b) const;
  void push_pair(Workspace& ws, int32_t left, int32_t right) const;

  std::array<TokenId, 256> byte_token_{};
  std::vector<Slot> slots_;
  int shift_ = 64;
  size_t skipped_merges_ = 0;
  int missing_byte_tokens_ = 0;
};

}  // namespace moraine::tokenizer
