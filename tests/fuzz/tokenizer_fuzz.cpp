// libFuzzer target: the tokenizer on arbitrary bytes (invalid UTF-8, long runs of one class,
// control-token look-alikes). The first byte picks the vocabulary and the flags; the rest is the
// text. Checked: every id is in the vocabulary; with no special handling, decoding gives back
// the text (bad UTF-8 bytes as U+FFFD, as encode documents); the streaming decoder, fed the ids
// one by one, gives the same bytes as decode. Bytes read as ids decode or throw TokenizerError.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "common/tokenizer/streaming_decoder.h"
#include "common/tokenizer/tokenizer.h"
#include "common/tokenizer/utf8.h"

namespace {

using moraine::tokenizer::StreamingDecoder;
using moraine::tokenizer::TokenId;
using moraine::tokenizer::Tokenizer;
using moraine::tokenizer::TokenizerError;

[[noreturn]] void fail(const char* what, const std::string& detail = {}) {
  std::fprintf(stderr, "tokenizer_fuzz: %s %s\n", what, detail.c_str());
  std::abort();
}

// The built-in model's vocabulary, then every vocabulary in MORAINE_FUZZ_VOCAB_DIR (the oracle's
// ggml-vocab-*.gguf) that is byte-level BPE: each brings its own pre-tokenizer.
std::vector<Tokenizer> load_vocabs() {
  std::vector<Tokenizer> v;
  v.push_back(Tokenizer::from_gguf_path(std::string(MORAINE_SOURCE_DIR) + "/models/moraine-tiny-qwen3next.gguf"));
  if (const char* dir = std::getenv("MORAINE_FUZZ_VOCAB_DIR")) {
    std::vector<std::string> paths;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("ggml-vocab-", 0) == 0 && e.path().extension() == ".gguf") paths.push_back(e.path().string());
    }
    std::sort(paths.begin(), paths.end());
    for (const std::string& p : paths) {
      try {
        v.push_back(Tokenizer::from_gguf_path(p));
      } catch (const std::exception&) {
        // Not byte-level BPE (SPM, WPM, ...): moraine refuses those with a message.
      }
    }
  }
  std::fprintf(stderr, "tokenizer_fuzz: %zu vocabularies\n", v.size());
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::vector<Tokenizer> vocabs = load_vocabs();
  if (size == 0) return 0;
  const Tokenizer& tok = vocabs[data[0] % vocabs.size()];
  const bool add_special = data[0] & 0x40, parse_special = data[0] & 0x80;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);

  const std::vector<TokenId> ids = tok.encode(text, add_special, parse_special);
  for (TokenId id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= tok.n_vocab()) fail("id outside the vocabulary", std::to_string(id));
  }
  const std::string decoded = tok.decode(ids);
  if (!add_special && !parse_special) {
    const std::string want = moraine::tokenizer::replace_invalid_utf8(text);
    if (decoded != want) fail("decode(encode(text)) differs from the text", std::to_string(decoded.size()) + " vs " + std::to_string(want.size()) + " bytes");
  }
  StreamingDecoder stream(tok);
  std::string streamed;
  for (TokenId id : ids) streamed += stream.push(id);
  streamed += stream.flush();
  if (streamed != decoded) fail("streamed text differs from decode");

  // The bytes as ids (some out of range): decode, or a TokenizerError, nothing else.
  std::vector<TokenId> raw(std::min<size_t>(text.size() / 4, 256));
  if (!raw.empty()) std::memcpy(raw.data(), text.data(), raw.size() * sizeof(TokenId));   // data() may be null when empty
  for (TokenId& id : raw) id = static_cast<TokenId>(static_cast<uint32_t>(id) % (tok.n_vocab() + 8));
  try {
    const std::string s = tok.decode(raw, data[0] & 1);
    StreamingDecoder d(tok, data[0] & 1);
    std::string t;
    for (TokenId id : raw) t += d.push(id);
    if (t + d.flush() != s) fail("streamed raw ids differ from decode");
  } catch (const TokenizerError&) {
  }
  return 0;
}
