#include "common/tokenizer/byte_alphabet.h"

#include <array>

#include "common/tokenizer/utf8.h"

namespace moraine::tokenizer {
namespace {

struct Alphabet {
  std::array<uint32_t, 256> code_point{};
  std::array<std::string, 256> text;
  std::array<int16_t, 324> byte_of{};  // code point -> byte, -1 when not in the alphabet

  Alphabet() {
    byte_of.fill(-1);
    uint32_t next_extra = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      code_point[b] = printable ? b : next_extra++;
      append_utf8(text[b], code_point[b]);
      byte_of[code_point[b]] = static_cast<int16_t>(b);
    }
  }
};

const Alphabet& alphabet() {
  static const Alphabet a;
  return a;
}

}  // namespace

uint32_t byte_to_code_point(uint8_t b) { return alphabet().code_point[b]; }

std::string_view byte_to_alphabet_text(uint8_t b) { return alphabet().text[b]; }

std::string encode_byte_level(std::string_view raw) {
  const Alphabet& a = alphabet();
  std::string out;
  out.reserve(raw.size() * 2);
  for (char c : raw) out += a.text[static_cast<uint8_t>(c)];
  return out;
}

std::optional<std::string> decode_byte_level(std::string_view text) {
  const Alphabet& a = alphabet();
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const auto b0 = static_cast<uint8_t>(text[i]);
    uint32_t cp;
    if (b0 < 0x80) {
      cp = b0;
      i += 1;
    } else if ((b0 & 0xE0) == 0xC0 && i + 1 < text.size() &&
               (static_cast<uint8_t>(text[i + 1]) & 0xC0) == 0x80) {
      cp = (static_cast<uint32_t>(b0 & 0x1F) << 6) | (static_cast<uint8_t>(text[i + 1]) & 0x3F);
      i += 2;
    } else {
      return std::nullopt;  // 3- and 4-byte code points are all outside the alphabet
    }
    if (cp >= a.byte_of.size() || a.byte_of[cp] < 0) return std::nullopt;
    out += static_cast<char>(a.byte_of[cp]);
  }
  return out;
}

}  // namespace moraine::tokenizer
