// Tokenizer pieces on their own: the byte alphabet, UTF-8 repair, special-token matching order,
// BOS/EOS rules from metadata, the streaming decoder, and the errors for bad ids and vocabularies.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "common/gguf/gguf.h"
#include "common/tokenizer/token_id_list.h"
#include "common/tokenizer/byte_alphabet.h"
#include "common/tokenizer/pre_tokenizer.h"
#include "common/tokenizer/streaming_decoder.h"
#include "common/tokenizer/tokenizer.h"
#include "common/tokenizer/utf8.h"
#include "tests/tokenizer/corpus.h"
#include "tests/tokenizer/oracle_paths.h"

namespace moraine::tokenizer::test {
namespace {

const Tokenizer& vocab(const std::string& name) {
  static std::map<std::string, Tokenizer> cache;
  auto it = cache.find(name);
  if (it == cache.end()) {
    const std::string path = vocab_path(name);
    if (!std::filesystem::exists(path)) throw std::runtime_error(missing_oracle_message(path));
    it = cache.emplace(name, Tokenizer::from_gguf_path(path)).first;
  }
  return it->second;
}

std::string expect_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const TokenizerError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a TokenizerError";
  return {};
}

TEST(TokenizerByteAlphabet, EveryByteRoundTripsAndCodePointsAreDistinct) {
  std::set<uint32_t> seen;
  for (int b = 0; b < 256; ++b) {
    const uint32_t cp = byte_to_code_point(static_cast<uint8_t>(b));
    EXPECT_TRUE(seen.insert(cp).second) << "byte " << b;
    // GPT-2's rule: printable Latin-1 stands for itself, everything else moves to U+0100 and up.
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    if (printable) EXPECT_EQ(cp, static_cast<uint32_t>(b));
    else EXPECT_GE(cp, 0x100u);
  }
  EXPECT_EQ(byte_to_code_point(' '), 0x120u);  // the familiar 'Ġ'
  EXPECT_EQ(byte_to_code_point('\n'), 0x10Au); // 'Ċ'
  std::mt19937 rng(1);
  for (int k = 0; k < 200; ++k) {
    std::string raw(std::uniform_int_distribution<size_t>(0, 64)(rng), '\0');
    for (char& c : raw) c = static_cast<char>(rng());
    const std::string enc = encode_byte_level(raw);
    EXPECT_TRUE(is_valid_utf8(enc));
    EXPECT_EQ(decode_byte_level(enc), raw);
  }
  EXPECT_EQ(decode_byte_level("\xE4\xBD\xA0"), std::nullopt);  // U+4F60 is not in the alphabet
}

TEST(TokenizerUtf8, ReplacementIsPerBadByte) {
  EXPECT_TRUE(is_valid_utf8("a\xC3\xA9\xE4\xBD\xA0\xF0\x9F\xA6\x99"));
  EXPECT_EQ(replace_invalid_utf8("a\xFF" "b"), "a\xEF\xBF\xBD" "b");
  EXPECT_EQ(replace_invalid_utf8("\xE4\xBD"), "\xEF\xBF\xBD\xEF\xBF\xBD");   // truncated
  EXPECT_EQ(replace_invalid_utf8("\xC0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD");   // overlong
  EXPECT_EQ(replace_invalid_utf8("\xED\xA0\x80").size(), 9u);                // surrogate
  EXPECT_EQ(incomplete_utf8_tail("ab\xF0\x9F"), 2u);
  EXPECT_EQ(incomplete_utf8_tail("ab\xF0\x9F\xA6\x99"), 0u);
  EXPECT_EQ(incomplete_utf8_tail("ab\xE4"), 1u);
  EXPECT_EQ(incomplete_utf8_tail("\x80"), 0u);  // a stray continuation byte never completes
}

TEST(TokenizerPreTokenizer, WordsAreNonEmptyAndConcatenateBackToTheText) {
  const std::vector<std::string> corpus = random_corpus(150, 4242);
  for (const std::string scheme : {"qwen2", "qwen35", "gpt-2", "llama-bpe", "default"}) {
    const PreTokenizer pre(scheme);
    size_t words = 0;
    for (const std::string& text : corpus) {
      std::vector<std::string_view> out;
      pre.split(text, out);
      std::string joined;
      for (std::string_view w : out) {
        EXPECT_FALSE(w.empty()) << scheme;
        joined += w;
      }
      EXPECT_EQ(joined, text) << scheme;
      words += out.size();
    }
    EXPECT_GT(words, corpus.size() * 3) << scheme;  // it does split
  }
  const std::string msg = expect_error([] { PreTokenizer p("qwen9"); });
  EXPECT_NE(msg.find("'qwen9'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("qwen2"), std::string::npos) << msg;  // and lists what is supported
}

TEST(Tokenizer, InvalidUtf8IsEncodedAsReplacementCharacters) {
  // llama.cpp turns each ill-formed byte into U+FFFD before splitting; so do we.
  const Tokenizer& tok = vocab("qwen2");
  EXPECT_EQ(tok.encode("ab\xFF\xFE" "cd", false, false),
            tok.encode("ab\xEF\xBF\xBD\xEF\xBF\xBD" "cd", false, false));
}

// A vocabulary of the 256 byte tokens plus the given extra tokens, no merges.
VocabSpec byte_vocab(const std::vector<std::pair<std::string, TokenType>>& extra) {
  VocabSpec spec;
  spec.pre = "gpt-2";
  for (int b = 0; b < 256; ++b) {
    spec.tokens.emplace_back(byte_to_alphabet_text(static_cast<uint8_t>(b)));
    spec.types.push_back(TokenType::Normal);
  }
  for (const auto& [text, type] : extra) {
    spec.tokens.push_back(text);
    spec.types.push_back(type);
  }
  return spec;
}

std::vector<TokenId> bytes_of(std::string_view s) {
  std::vector<TokenId> ids;
  for (char c : s) ids.push_back(static_cast<uint8_t>(c));
  return ids;
}

TEST(TokenizerSpecialTokens, LongestTokenIsMatchedFirstAnywhereInTheText) {
  // "ab" (256) and "bcd" (257) overlap in "abcd": the longer one wins even though "ab" starts
  // earlier (llama.cpp matches tokens longest first over the whole text).
  const Tokenizer tok(byte_vocab({{"ab", TokenType::Control}, {"bcd", TokenType::Control}}));
  std::vector<TokenId> want = bytes_of("a");
  want.push_back(257);
  EXPECT_EQ(tok.encode("abcd", false, true), want);
  // Repeats and adjacency: each occurrence in text not yet claimed.
  EXPECT_EQ(tok.encode("ababbcd", false, true), (std::vector<TokenId>{256, 256, 257}));
  // parse_special off: control tokens are plain text.
  EXPECT_EQ(tok.encode("abcd", false, false), bytes_of("abcd"));
}

TEST(TokenizerSpecialTokens, TokenThatIsAPrefixOfAnotherStillMatchesAlone) {
  const Tokenizer tok(byte_vocab({{"<a>", TokenType::Control}, {"<a><b>", TokenType::Control}}));
  std::vector<TokenId> want = {257, 256};
  const std::vector<TokenId> tail = bytes_of("<a");
  want.insert(want.end(), tail.begin(), tail.end());
  EXPECT_EQ(tok.encode("<a><b><a><a", false, true), want);
}

TEST(TokenizerSpecialTokens, UserDefinedTokensMatchEvenWithoutParseSpecial) {
  const Tokenizer tok(byte_vocab({{"<ctl>", TokenType::Control}, {"<usr>", TokenType::UserDefined}}));
  std::vector<TokenId> want = bytes_of("<ctl>x");
  want.push_back(257);
  EXPECT_EQ(tok.encode("<ctl>x<usr>", false, false), want);
  EXPECT_EQ(tok.encode("<ctl>x<usr>", false, true), (std::vector<TokenId>{256, 'x', 257}));
  // Decoding: control text only when rendering special tokens; user-defined text always.
  EXPECT_EQ(tok.decode(std::vector<TokenId>{256, 'x', 257}, false), "x<usr>");
  EXPECT_EQ(tok.decode(std::vector<TokenId>{256, 'x', 257}, true), "<ctl>x<usr>");
}

TEST(Tokenizer, BosAndEosFollowTheFileMetadata) {
  for (const char* name : kVocabs) {
    const Tokenizer& tok = vocab(name);
    const gguf::GgufFile file = gguf::GgufFile::open(vocab_path(name));
    const std::string text = "Hello, world";
    const std::vector<TokenId> plain = tok.encode(text, false, true);
    std::vector<TokenId> want = plain;
    // Only llama-bpe asks for BOS, and only through its pre-tokenizer default when the key is
    // absent (as in llama.cpp); the key wins when present.
    const bool add_bos = file.get_bool("tokenizer.ggml.add_bos_token")
                             .value_or(file.get_string("tokenizer.ggml.pre") == "llama-bpe");
    const bool add_eos = file.get_bool("tokenizer.ggml.add_eos_token").value_or(false);
    if (add_bos) want.insert(want.begin(), static_cast<TokenId>(*file.get_u64("tokenizer.ggml.bos_token_id")));
    if (add_eos) want.push_back(static_cast<TokenId>(*file.get_u64("tokenizer.ggml.eos_token_id")));
    EXPECT_EQ(tok.encode(text, true, true), want) << name;
    EXPECT_EQ(tok.add_bos(), add_bos) << name;
    if (auto eos = file.get_u64("tokenizer.ggml.eos_token_id")) {
      EXPECT_TRUE(tok.is_end_of_generation(static_cast<TokenId>(*eos))) << name;
    }
  }
  EXPECT_TRUE(vocab("llama-bpe").add_bos());
}

TEST(Tokenizer, ChatTurnMarkersAreSingleTokensAndEndGeneration) {
  const Tokenizer& tok = vocab("qwen2");
  const auto ids = tok.encode("<|im_start|>user\nhi<|im_end|>", false, true);
  ASSERT_GE(ids.size(), 4u);
  EXPECT_EQ(tok.token_text(ids.front()), "<|im_start|>");
  EXPECT_EQ(tok.token_text(ids.back()), "<|im_end|>");
  EXPECT_TRUE(tok.is_end_of_generation(ids.back()));
  EXPECT_FALSE(tok.is_end_of_generation(ids.front()));
  ASSERT_TRUE(tok.eot().has_value());
  EXPECT_EQ(tok.token_text(*tok.eot()), "<|im_end|>");
  EXPECT_EQ(tok.decode(ids, false), "user\nhi");
}

TEST(TokenizerStreamingDecoder, HoldsSplitCharactersAndReassemblesExactly) {
  size_t held_somewhere = 0;
  for (const char* name : kVocabs) {
    const Tokenizer& tok = vocab(name);
    for (const std::string& text : random_corpus(60, 99)) {
      StreamingDecoder dec(tok);
      std::string joined;
      for (TokenId id : tok.encode(text, false, true)) {
        const std::string piece = dec.push(id);
        EXPECT_TRUE(is_valid_utf8(piece)) << name;
        held_somewhere += dec.held_bytes() > 0;
        joined += piece;
      }
      joined += dec.flush();
      EXPECT_EQ(joined, text) << name;
    }
  }
  // The corpus has emoji and CJK that byte-level BPE splits mid-character.
  EXPECT_GT(held_somewhere, 0u);
}

TEST(Tokenizer, UnknownIdsAreClearErrors) {
  const Tokenizer& tok = vocab("gpt-2");
  const auto n = static_cast<TokenId>(tok.n_vocab());
  std::string msg = expect_error([&] { tok.decode(std::vector<TokenId>{15496, n}); });
  EXPECT_NE(msg.find(std::to_string(n)), std::string::npos) << msg;
  msg = expect_error([&] { tok.decode(std::vector<TokenId>{-1}); });
  EXPECT_NE(msg.find("-1"), std::string::npos) << msg;
  StreamingDecoder dec(tok);
  expect_error([&] { dec.push(n + 5); });
}

TEST(Tokenizer, UnsupportedModelOrPreTokenizerNamesTheValue) {
  VocabSpec spec = byte_vocab({});
  spec.pre = "klingon-bpe";
  std::string msg = expect_error([&] { Tokenizer t(spec); });
  EXPECT_NE(msg.find("klingon-bpe"), std::string::npos) << msg;

  // Through a GGUF file, as a model file would arrive.
  const std::string path = std::string(MORAINE_BUILD_DIR) + "/tokenizer_unit_test_bert.gguf";
  gguf::GgufWriter w;
  w.set("tokenizer.ggml.model", gguf::Value::string("bert"));
  w.set("tokenizer.ggml.tokens", gguf::Value::string_array({"a", "b"}));
  w.write(path);
  msg = expect_error([&] { Tokenizer::from_gguf_path(path); });
  EXPECT_NE(msg.find("'bert'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tokenizer.ggml.model"), std::string::npos) << msg;
}

TEST(Tokenizer, BadSpecialTokenIdIsAnError) {
  VocabSpec spec = byte_vocab({});
  spec.eos = 100000;
  const std::string msg = expect_error([&] { Tokenizer t(spec); });
  EXPECT_NE(msg.find("eos_token_id"), std::string::npos) << msg;
}

TEST(Tokenizer, ConcurrentEncodesAgree) {
  const Tokenizer& tok = vocab("qwen2");
  const std::vector<std::string> corpus = random_corpus(100, 5);
  std::vector<std::vector<TokenId>> serial;
  for (const auto& t : corpus) serial.push_back(tok.encode(t));
  std::vector<std::vector<std::vector<TokenId>>> results(4);
  std::vector<std::thread> threads;
  for (size_t k = 0; k < results.size(); ++k) {
    threads.emplace_back([&, k] {
      for (const auto& t : corpus) results[k].push_back(tok.encode(t));
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& r : results) EXPECT_EQ(r, serial);
}

}  // namespace
}  // namespace moraine::tokenizer::test

TEST(TokenIdList, ParsesIdsAndNamesTheBadItem) {
  using moraine::tokenizer::parse_token_id_list;
  EXPECT_EQ(parse_token_id_list("1,22,333"), (std::vector<moraine::tokenizer::TokenId>{1, 22, 333}));
  EXPECT_EQ(parse_token_id_list("0"), (std::vector<moraine::tokenizer::TokenId>{0}));
  for (const char* bad : {"", "1,,2", "1,x", "-3", "4 ", "2147483648", "1.5"}) {
    try {
      parse_token_id_list(bad, "--ids");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind("--ids: ", 0), 0u) << e.what();
    }
  }
}
