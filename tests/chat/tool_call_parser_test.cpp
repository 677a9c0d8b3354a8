// Tool-call parsing of generated text (Qwen3 and gpt-oss harmony), whole and streamed: every
// split of the text, and byte-by-byte feeding, must give the same message, and the deltas must
// add up to it.
#include <gtest/gtest.h>

#include "common/chat/tool_call_parser.h"

namespace {

using namespace moraine::chat;
using ojson = nlohmann::ordered_json;

// Feeds the text in the given pieces; checks that the deltas add up to the final message.
ojson streamed(ToolCallFormat f, const std::vector<std::string>& pieces, bool reasoning_open = false) {
  ToolCallParser p(f, "call_", reasoning_open);
  std::string content, reasoning;
  std::vector<ToolCall> calls;
  auto take = [&](const ChatDelta& d) {
    content += d.content;
    reasoning += d.reasoning_content;
    EXPECT_EQ(d.first_tool_index, calls.size());
    calls.insert(calls.end(), d.tool_calls.begin(), d.tool_calls.end());
  };
  for (const std::string& s : pieces) take(p.feed(s));
  take(p.finish());
  EXPECT_EQ(content, p.message().content);
  EXPECT_EQ(reasoning, p.message().reasoning_content);
  EXPECT_EQ(calls.size(), p.message().tool_calls.size());
  return p.message().to_json();
}

// The message from every two-piece split and from byte-by-byte feeding equals the whole's.
void expect_split_invariant(ToolCallFormat f, const std::string& text, const ojson& expected, bool reasoning_open = false) {
  EXPECT_EQ(parse_generated_text(f, text, reasoning_open).to_json(), expected) << text;
  for (size_t i = 0; i <= text.size(); ++i)
    ASSERT_EQ(streamed(f, {text.substr(0, i), text.substr(i)}, reasoning_open), expected) << "split at " << i;
  std::vector<std::string> bytes;
  for (char c : text) bytes.emplace_back(1, c);
  EXPECT_EQ(streamed(f, bytes, reasoning_open), expected);
}

TEST(ToolCallParser, QwenThinkContentAndTwoToolCalls) {
  const std::string text =
      "<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n"
      "{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\", \"days\": 2}}\n</tool_call>\n"
      "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
  const ojson expected = ojson::parse(R"({"role": "assistant", "content": "Let me check.\n",
      "reasoning_content": "The user wants weather.",
      "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": "{\"location\":\"Paris\",\"days\":2}"}},
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]})");
  expect_split_invariant(ToolCallFormat::kQwen, text, expected);
}

TEST(ToolCallParser, QwenPlainContentWithAngleBrackets) {
  const std::string text = "a < b and <tool> is not a marker; x<tool_cal";
  expect_split_invariant(ToolCallFormat::kQwen, text, {{"role", "assistant"}, {"content", text}});
}

TEST(ToolCallParser, QwenReasoningOpenFromThePrompt) {
  expect_split_invariant(ToolCallFormat::kQwen, "step 1\nstep 2\n</think>\n\nDone.",
                         {{"role", "assistant"}, {"content", "Done."}, {"reasoning_content", "step 1\nstep 2"}}, true);
}

TEST(ToolCallParser, ReasoningOpenFromTheRenderedPrompt) {
  EXPECT_TRUE(prompt_opens_reasoning("<|im_start|>assistant\n<think>\n"));
  EXPECT_FALSE(prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
  EXPECT_FALSE(prompt_opens_reasoning("<|im_start|>assistant\n"));
}

TEST(ToolCallParser, QwenBadOrUnterminatedToolCalls) {
  // Not JSON: the block stays content.
  expect_split_invariant(ToolCallFormat::kQwen, "x<tool_call>\nnot json\n</tool_call>",
                         {{"role", "assistant"}, {"content", "x<tool_call>\nnot json\n</tool_call>"}});
  // The model stopped before </tool_call> with complete JSON: still a call.
  expect_split_invariant(ToolCallFormat::kQwen, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1]}}",
                         ojson::parse(R"({"role": "assistant", "content": null, "tool_calls": [
                           {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{\"a\":[1]}"}}]})"));
  // Cut inside the JSON: content.
  expect_split_invariant(ToolCallFormat::kQwen, "<tool_call>\n{\"name\": \"f\", \"argu",
                         {{"role", "assistant"}, {"content", "<tool_call>\n{\"name\": \"f\", \"argu"}});
}

TEST(ToolCallParser, HarmonyAnalysisThenToolCall) {
  const std::string text =
      "<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant<|channel|>commentary "
      "to=functions.get_weather <|constrain|>json<|message|>{\"location\":\"Paris\"}<|call|>";
  const ojson expected = ojson::parse(R"({"role": "assistant", "content": null,
      "reasoning_content": "Need the weather tool.",
      "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": "{\"location\":\"Paris\"}"}}]})");
  expect_split_invariant(ToolCallFormat::kHarmony, text, expected);
}

TEST(ToolCallParser, HarmonyFinalAnswerAndRecipientBeforeChannel) {
  expect_split_invariant(ToolCallFormat::kHarmony,
                         "<|channel|>analysis<|message|>2+2=4<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>",
                         {{"role", "assistant"}, {"content", "It is 4."}, {"reasoning_content", "2+2=4"}});
  expect_split_invariant(ToolCallFormat::kHarmony,
                         "<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{\"q\": 1}<|call|>",
                         ojson::parse(R"({"role": "assistant", "content": null, "tool_calls": [
                           {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": 1}"}}]})"));
  // Generation cut inside the final message: what came is content.
  expect_split_invariant(ToolCallFormat::kHarmony, "<|channel|>final<|message|>partial <|en",
                         {{"role", "assistant"}, {"content", "partial <|en"}});
}

TEST(ToolCallParser, FormatFromTheTemplate) {
  EXPECT_EQ(detect_tool_call_format("{{ '<|start|>assistant<|channel|>final' }}"), ToolCallFormat::kHarmony);
  EXPECT_EQ(detect_tool_call_format("{{- '<tool_call>\\n' }}"), ToolCallFormat::kQwen);
  EXPECT_EQ(detect_tool_call_format("{{ '[INST]' }}"), ToolCallFormat::kNone);
  expect_split_invariant(ToolCallFormat::kNone, "<tool_call>{}</tool_call>", {{"role", "assistant"}, {"content", "<tool_call>{}</tool_call>"}});
}

}  // namespace
