// The byte-level alphabet of GPT-2 style BPE vocabularies: each of the 256 byte values is written
// as one printable code point (printable Latin-1 bytes as themselves, the rest as U+0100 upward),
// so every vocabulary entry is a string of these code points.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace moraine::tokenizer {

// The code point that stands for byte b.
uint32_t byte_to_code_point(uint8_t b);

// The UTF-8 text of that code point (1 or 2 bytes).
std::string_view byte_to_alphabet_text(uint8_t b);

// Raw bytes -> alphabet text.
std::string encode_byte_level(std::string_view raw);

// Alphabet text -> raw bytes; nullopt when the text holds a code point outside the alphabet or
// is not valid UTF-8.
std::optional<std::string> decode_byte_level(std::string_view text);

}  // namespace moraine::tokenizer
