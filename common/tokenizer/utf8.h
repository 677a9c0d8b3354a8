// UTF-8 helpers the tokenizer needs: validation with replacement, code point encoding, and the
// length of an incomplete trailing sequence (for streaming output).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moraine::tokenizer {

// Bytes in the sequence a lead byte starts: 1-4, or 0 for a continuation byte or a byte that can
// never start a sequence (0xC0, 0xC1, 0xF5-0xFF).
int utf8_sequence_length(uint8_t lead);

// Length of the well-formed sequence starting at s[i] (RFC 3629: no overlongs, no surrogates,
// nothing above U+10FFFF), or 0 when the bytes there are not one.
size_t utf8_valid_sequence_at(std::string_view s, size_t i);

bool is_valid_utf8(std::string_view s);

// Replaces every byte that is not part of a well-formed sequence with U+FFFD, one replacement per
// byte. This is what llama.cpp's tokenizer does to ill-formed input (a truncated 3-byte sequence
// becomes two U+FFFD), so token ids match it on such text too.
std::string replace_invalid_utf8(std::string_view s);

void append_utf8(std::string& out, uint32_t code_point);

// Number of bytes at the end of s that form the start of a sequence still missing continuation
// bytes (0 when s ends on a boundary or the tail can never be completed).
size_t incomplete_utf8_tail(std::string_view s);

}  // namespace moraine::tokenizer
