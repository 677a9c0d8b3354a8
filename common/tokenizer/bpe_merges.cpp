#include "common/tokenizer/bpe_merges.h"

#include <algorithm>
#include <bit>

#include "common/tokenizer/byte_alphabet.h"
#include "common/tokenizer/tokenizer_error.h"

namespace moraine::tokenizer {

BpeMerges::BpeMerges(const StringMap& token_to_id,
                     const std::vector<std::string>& merges) {
  for (int b = 0; b < 256; ++b) {
    const auto it = token_to_id.find(std::string(byte_to_alphabet_text(static_cast<uint8_t>(b))));
    byte_token_[static_cast<size_t>(b)] = it == token_to_id.end() ? -1 : it->second;
    if (it == token_to_id.end()) ++missing_byte_tokens_;
  }
  size_t capacity = 16;
  while (capacity < merges.size() * 2) capacity *= 2;  // load factor <= 0.5
  slots_.assign(capacity, Slot{});
  shift_ = 64 - std::countr_zero(capacity);
  std::string joined;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string& m = merges[rank];
    // The separator is the first space after the first character: parts never hold a space
    // (the alphabet writes it as U+0120), so this only matters for malformed lines.
    const size_t sep = m.find(' ', 1);
    if (sep == std::string::npos) {
      throw TokenizerError("tokenizer.ggml.merges[" + std::to_string(rank) + "]: '" + m +
                           "' is not two tokens separated by a space");
    }
    const std::string left = m.substr(0, sep), right = m.substr(sep + 1);
    joined = left + right;
    const auto l = token_to_id.find(left), r = token_to_id.find(right), j = token_to_id.find(joined);
    if (l == token_to_id.end() || r == token_to_id.end() || j == token_to_id.end()) {
      ++skipped_merges_;
      continue;
    }
    const uint64_t k = key(l->second, r->second);
    size_t i = home(k);
    while (slots_[i].key != kEmpty && slots_[i].key != k) i = (i + 1) & (slots_.size() - 1);
    // A repeated pair keeps its first (best) rank.
    if (slots_[i].key == kEmpty) slots_[i] = Slot{k, static_cast<int32_t>(rank), j->second};
  }
}

const BpeMerges::Slot* BpeMerges::find(TokenId a, TokenId b) const {
  const uint64_t k = key(a, b);
  for (size_t i = home(k);; i = (i + 1) & (slots_.size() - 1)) {
    if (slots_[i].key == k) return &slots_[i];
    if (slots_[i].key == kEmpty) return nullptr;
  }
}

namespace {
// Heap order: the smallest rank on top, then the leftmost pair.
bool worse(const BpeMerges::Workspace::Pair& a, const BpeMerges::Workspace::Pair& b) {
  return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
}
}  // namespace

void BpeMerges::push_pair(Workspace& ws, int32_t left, int32_t right) const {
  if (left < 0 || right < 0) return;
  const TokenId a = ws.id[static_cast<size_t>(left)], b = ws.id[static_cast<size_t>(right)];
  if (a < 0 || b < 0) return;
  const Slot* m = find(a, b);
  if (m == nullptr) return;
  ws.heap.push_back({m->rank, left, right, a, b, m->result});
  std::push_heap(ws.heap.begin(), ws.heap.end(), worse);
}

void BpeMerges::encode_word(std::string_view raw, std::vector<TokenId>& out, Workspace& ws) const {
  const auto n = static_cast<int32_t>(raw.size());
  if (n == 0) return;
  if (n == 1) {
    const TokenId t = byte_token_[static_cast<uint8_t>(raw[0])];
    if (t >= 0) out.push_back(t);
    return;
  }
  ws.id.resize(static_cast<size_t>(n));
  ws.prev.resize(static_cast<size_t>(n));
  ws.next.resize(static_cast<size_t>(n));
  ws.heap.clear();
  for (int32_t i = 0; i < n; ++i) {
    ws.id[static_cast<size_t>(i)] = byte_token_[static_cast<uint8_t>(raw[static_cast<size_t>(i)])];
    ws.prev[static_cast<size_t>(i)] = i - 1;
    ws.next[static_cast<size_t>(i)] = i + 1 < n ? i + 1 : -1;
  }
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(ws, i, i + 1);

  while (!ws.heap.empty()) {
    std::pop_heap(ws.heap.begin(), ws.heap.end(), worse);
    const Workspace::Pair p = ws.heap.back();
    ws.heap.pop_back();
    const auto l = static_cast<size_t>(p.left), r = static_cast<size_t>(p.right);
    // Stale when either side has merged since the pair was queued: the right symbol is gone
    // (id -2) or grew (new id), or the left one grew (its next is no longer `right`).
    if (ws.next[l] != p.right || ws.id[l] != p.left_id || ws.id[r] != p.right_id) continue;
    ws.id[l] = p.result;
    ws.id[r] = -2;
    ws.next[l] = ws.next[r];
    if (ws.next[r] >= 0) ws.prev[static_cast<size_t>(ws.next[r])] = p.left;
    ws.next[r] = -1;
    push_pair(ws, ws.prev[l], p.left);
    push_pair(ws, p.left, ws.next[l]);
  }
  for (int32_t i = 0; i >= 0; i = ws.next[static_cast<size_t>(i)]) {
    if (ws.id[static_cast<size_t>(i)] >= 0) out.push_back(ws.id[static_cast<size_t>(i)]);
  }
}

}  // namespace moraine::tokenizer
