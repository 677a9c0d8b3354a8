// The tokenizer test corpus: hand-picked hard cases plus random mixes drawn with a fixed seed.
// Every string is valid UTF-8 (the oracle receives it as a JavaScript string).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moraine::tokenizer::test {

// Hand-picked cases: code, CJK, emoji (ZWJ sequences, flags, skin tones), whitespace runs,
// tab/newline mixes, control characters, lone combining marks, special-token text embedded in
// prose, very long words.
std::vector<std::string> handpicked_corpus();

// n strings, each a concatenation of 1..max_pieces random pieces: hand-picked cases cut at code points and
// random code points from assigned ranges of many scripts and symbol blocks.
std::vector<std::string> random_corpus(size_t n, uint32_t seed, size_t max_pieces = 12);

}  // namespace moraine::tokenizer::test
