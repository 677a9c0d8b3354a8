#include "common/tokenizer/utf8.h"

namespace moraine::tokenizer {

int utf8_sequence_length(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead < 0xC2) return 0;  // continuation byte, or the overlong leads 0xC0/0xC1
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  if (lead < 0xF5) return 4;
  return 0;
}

size_t utf8_valid_sequence_at(std::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t b0 = byte(i);
  const int n = utf8_sequence_length(b0);
  if (n <= 1 || i + static_cast<size_t>(n) > s.size()) return n == 1 ? 1 : 0;
  // The second byte's allowed range depends on the lead (excludes overlongs, surrogates, >10FFFF).
  const uint8_t b1 = byte(i + 1);
  uint8_t lo = 0x80, hi = 0xBF;
  if (b0 == 0xE0) lo = 0xA0;
  if (b0 == 0xED) hi = 0x9F;
  if (b0 == 0xF0) lo = 0x90;
  if (b0 == 0xF4) hi = 0x8F;
  if (b1 < lo || b1 > hi) return 0;
  for (int k = 2; k < n; ++k) {
    if ((byte(i + static_cast<size_t>(k)) & 0xC0) != 0x80) return 0;
  }
  return static_cast<size_t>(n);
}

bool is_valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    // ASCII fast path: most text is mostly ASCII.
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = utf8_valid_sequence_at(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string replace_invalid_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  size_t i = 0;
  while (i < s.size()) {
    const size_t n = utf8_valid_sequence_at(s, i);
    if (n == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

size_t incomplete_utf8_tail(std::string_view s) {
  // Walk back over at most 3 continuation bytes to the lead byte of the last sequence.
  size_t k = 0;
  while (k < s.size() && k < 3 && (static_cast<uint8_t>(s[s.size() - 1 - k]) & 0xC0) == 0x80) ++k;
  if (k == s.size()) return 0;
  const int need = utf8_sequence_length(static_cast<uint8_t>(s[s.size() - 1 - k]));
  const size_t have = k + 1;
  if (need <= 1 || static_cast<size_t>(need) <= have) return 0;
  return have;
}

}  // namespace moraine::tokenizer
