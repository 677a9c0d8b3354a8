// A request's sequence (coordinator/sequence.h): its text leaves special tokens out, unless the
// request asks for them (SamplingParams::render_special: gpt-oss's harmony markers are special
// tokens, and the server parses them). Qwen2's real vocabulary, from the oracle's llama.cpp.
#include <gtest/gtest.h>

#include <filesystem>

#include "common/tokenizer/tokenizer.h"
#include "coordinator/sequence.h"
#include "coordinator/stop_strings.h"

namespace moraine::group {
namespace {

TEST(Sequence, SpecialTokensTextOnlyWhenAsked) {
  const std::filesystem::path vocab =
      std::filesystem::path(MORAINE_SOURCE_DIR) / ".cache/oracle/llama.cpp/models/ggml-vocab-qwen2.gguf";
  ASSERT_TRUE(std::filesystem::exists(vocab)) << "no " << vocab << ": run tests/oracle/setup";
  const tokenizer::Tokenizer tok = tokenizer::Tokenizer::from_gguf_path(vocab.string());
  const auto start = tok.find_token("<|im_start|>");
  ASSERT_TRUE(start.has_value());
  const std::vector<int32_t> hello = tok.encode("Hello", false);
  ASSERT_FALSE(hello.empty());
  for (const bool special : {false, true}) {
    generate::SamplingParams sp;
    sp.set_max_tokens(8);
    sp.set_render_special(special);
    Sequence seq(sp, &tok, {1, 2, 3}, 64);
    std::string text;
    for (const int32_t id : {static_cast<int32_t>(*start), hello[0]}) {
      generate::GenerateChunk chunk;
      ASSERT_FALSE(seq.accept(id, chunk));
      text += chunk.text();
    }
    EXPECT_EQ(text, special ? "<|im_start|>" + tok.decode(std::span<const int32_t>(hello.data(), 1)) :
                              tok.decode(std::span<const int32_t>(hello.data(), 1)));
  }
}

// The stop-string limits hold for a request that comes over gRPC, not only through the server:
// the error names the limit and the value.
TEST(Sequence, StopStringLimits) {
  const std::filesystem::path vocab =
      std::filesystem::path(MORAINE_SOURCE_DIR) / ".cache/oracle/llama.cpp/models/ggml-vocab-qwen2.gguf";
  ASSERT_TRUE(std::filesystem::exists(vocab)) << "no " << vocab << ": run tests/oracle/setup";
  const tokenizer::Tokenizer tok = tokenizer::Tokenizer::from_gguf_path(vocab.string());
  const auto refusal = [&](const std::vector<std::string>& stops) -> std::string {
    generate::SamplingParams sp;
    sp.set_max_tokens(8);
    for (const std::string& s : stops) sp.add_stop(s);
    try {
      Sequence seq(sp, &tok, {1, 2, 3}, 64);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return {};
  };
  EXPECT_EQ(refusal(std::vector<std::string>(kMaxStopStrings, std::string(kMaxStopBytes, 'x'))), "");
  const std::string many = refusal(std::vector<std::string>(kMaxStopStrings + 1, "x"));
  EXPECT_NE(many.find("17 stop strings; at most 16"), std::string::npos) << many;
  const std::string longer = refusal({"a", std::string(kMaxStopBytes + 1, 'x')});
  EXPECT_NE(longer.find("stop string 1 has 513 bytes; at most 512"), std::string::npos) << longer;
}

}  // namespace
}  // namespace moraine::group
