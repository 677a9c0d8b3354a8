// The chat template API: the GGUF's tokenizer.chat_template loaded with the vocabulary's BOS/EOS,
// the OpenAI conversation normalised for the template, the ChatML fallback, and clear errors.
// Reads the oracle vocabulary (ggml-vocab-qwen2.gguf, tests/oracle/setup) and writes a copy of it
// with a chat template.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/chat/chat_template.h"
#include "common/gguf/gguf.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"

namespace {

using namespace moraine;
using ojson = nlohmann::ordered_json;

const std::string kSource = MORAINE_SOURCE_DIR;
const std::string kVocab = kSource + "/.cache/oracle/llama.cpp/models/ggml-vocab-qwen2.gguf";

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// The oracle vocabulary with tokenizer.chat_template set (or removed when template_source is empty).
std::string vocab_with_template(const std::string& template_source, const std::string& tag) {
  const gguf::GgufFile src = gguf::GgufFile::open(kVocab);
  gguf::GgufWriter w;
  for (const auto& [k, v] : src.metadata()) w.set(k, v);
  if (template_source.empty()) w.remove("tokenizer.chat_template");
  else w.set("tokenizer.chat_template", gguf::Value::string(template_source));
  const std::string path = std::string(MORAINE_BUILD_DIR) + "/tests/chat/vocab-" + tag + ".gguf";
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  w.write(path);
  return path;
}

TEST(ChatApi, LoadsTheGgufTemplateWithTheVocabularysTokens) {
  ASSERT_TRUE(std::filesystem::exists(kVocab)) << kVocab << " missing (run tests/oracle/setup)";
  const std::string path = vocab_with_template("{{ bos_token }}|{{ eos_token }}|{{ messages[0].content }}", "tokens");
  const gguf::GgufFile f = gguf::GgufFile::open(path);
  const tokenizer::Tokenizer tok = tokenizer::Tokenizer::from_gguf(f);
  std::string warning;
  const std::optional<chat::ChatTemplate> t = chat::ChatTemplate::from_gguf(f, tok, &warning);
  ASSERT_TRUE(t.has_value()) << warning;
  const std::string eos = tok.eos() ? tok.token_bytes(*tok.eos(), true) : "";
  ASSERT_FALSE(eos.empty());
  const std::string bos = tok.bos() ? tok.token_bytes(*tok.bos(), true) : "";
  EXPECT_EQ(t->render({{"messages", ojson::array({{{"role", "user"}, {"content", "hi"}}})}}), bos + "|" + eos + "|hi");
}

TEST(ChatApi, NoTemplateOrABrokenOneFallsBack) {
  ASSERT_TRUE(std::filesystem::exists(kVocab)) << kVocab << " missing (run tests/oracle/setup)";
  {
    const gguf::GgufFile f = gguf::GgufFile::open(vocab_with_template("", "none"));
    std::string warning;
    EXPECT_FALSE(chat::ChatTemplate::from_gguf(f, tokenizer::Tokenizer::from_gguf(f), &warning).has_value());
    EXPECT_TRUE(warning.empty());
  }
  const gguf::GgufFile f = gguf::GgufFile::open(vocab_with_template("ok\n{% for m in messages %}", "broken"));
  std::string warning;
  EXPECT_FALSE(chat::ChatTemplate::from_gguf(f, tokenizer::Tokenizer::from_gguf(f), &warning).has_value());
  EXPECT_NE(warning.find("template line 2"), std::string::npos) << warning;
  // The fallback: the built-in ChatML on the same conversation JSON.
  const ojson chat = {{"messages", ojson::array({{{"role", "system"}, {"content", "s"}},
                                                 {{"role", "user"}, {"content", ojson::array({{{"type", "text"}, {"text", "a"}},
                                                                                              {{"type", "text"}, {"text", "b"}}})}}})},
                      {"chat_template_kwargs", {{"enable_thinking", false}}}};
  tokenizer::ChatTemplateOptions o;
  o.enable_thinking = false;
  EXPECT_EQ(chat::render_builtin_chatml(chat), tokenizer::render_qwen_chatml({{"system", "s", {}}, {"user", "a\nb", {}}}, o));
  EXPECT_THROW(chat::render_builtin_chatml({{"messages", ojson::array({{{"role", "tool"}, {"content", "x"}}})}}),
               std::invalid_argument);
}

TEST(ChatApi, ConversationIsNormalisedForTheTemplate) {
  const chat::ChatTemplate t("{% for m in messages %}{{ m.tool_calls[0].function.arguments.city if m.tool_calls }}{% endfor %}", "<s>", "</s>");
  EXPECT_TRUE(t.object_arguments());
  const ojson chat = ojson::parse(R"({"messages": [
      {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function",
        "function": {"name": "f", "arguments": "{\"city\": \"Oslo\", \"n\": 1}"}}]}],
      "chat_template_kwargs": {"enable_thinking": false, "custom": [1]}})");
  const ojson ctx = t.context(chat);
  EXPECT_EQ(ctx["messages"][0]["content"], "x\ny");
  EXPECT_EQ(ctx["messages"][1]["tool_calls"][0]["function"]["arguments"], ojson::parse(R"({"city": "Oslo", "n": 1})"));
  EXPECT_TRUE(ctx["tools"].is_null());
  EXPECT_EQ(ctx["add_generation_prompt"], true);
  EXPECT_EQ(ctx["enable_thinking"], false);
  EXPECT_EQ(ctx["custom"], ojson::array({1}));
  EXPECT_EQ(ctx["bos_token"], "<s>");
  EXPECT_EQ(t.render(chat), "Oslo");
  // A template that concatenates arguments as text gets the JSON string.
  const chat::ChatTemplate s("{% for m in messages %}{% for c in m.tool_calls or [] %}{{ '<' + c.function.arguments + '>' }}{% endfor %}{% endfor %}", "", "");
  EXPECT_FALSE(s.object_arguments());
  EXPECT_EQ(s.render(chat), "<{\"city\": \"Oslo\", \"n\": 1}>");
}

TEST(ChatApi, MalformedConversationsNameTheMessage) {
  const chat::ChatTemplate t("{{ messages|length }}", "", "");
  auto error_of = [&](const char* json) {
    try {
      t.render(ojson::parse(json));
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error_of(R"({"messages": []})").find("non-empty"), std::string::npos);
  EXPECT_NE(error_of(R"({"messages": [{"content": "x"}]})").find("messages[0]"), std::string::npos);
  EXPECT_NE(error_of(R"({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url"}]}]})")
                .find("messages[1]: content[0]"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]})")
                .find("not valid JSON"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 3})").find("chat_template_kwargs"),
            std::string::npos);
}

}  // namespace
