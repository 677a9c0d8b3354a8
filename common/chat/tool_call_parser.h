// Parses a model's generated text into an OpenAI assistant message: content, reasoning_content
// and tool_calls, for two output formats:
//   kQwen     (Qwen3, Hermes style):  <think>...</think> reasoning, then content with
//             <tool_call>\n{"name": "...", "arguments": {...}}\n</tool_call> blocks.
//   kHarmony  (gpt-oss):  <|channel|>analysis<|message|>...<|end|>  -> reasoning_content,
//             <|channel|>final<|message|>...<|return|>           -> content,
//             <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
//             -> a tool call (the recipient may also stand before <|channel|>).
// The text must carry the special tokens as text (decode with render_special on).
//
// Streaming: feed() each decoded text delta; it returns what became certain: content and
// reasoning deltas, and each tool call once it is complete (id, name and arguments together, a
// valid OpenAI streaming chunk). Text that may be the start of a marker is held back until the
// next feed() decides it; finish() at the end of generation flushes it (an unterminated tool call
// whose JSON is complete still counts; otherwise its text is returned as content). Feeding a text
// in any split gives the same final message as parse_generated_text on the whole.
//
//   ToolCallParser p(ToolCallFormat::kQwen);
//   for (delta : decoded) { ChatDelta d = p.feed(delta); send(d); }
//   send(p.finish());  nlohmann::json msg = p.message().to_json();
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace moraine::chat {

enum class ToolCallFormat { kNone, kQwen, kHarmony };

// The format a chat template's model writes: kHarmony when it uses <|channel|>, kQwen when it
// uses <tool_call> or <think>, else kNone (everything is content).
ToolCallFormat detect_tool_call_format(const std::string& template_source);

struct ToolCall {
  std::string id;         // "call_<index>" unless the caller's prefix says otherwise
  std::string name;
  std::string arguments;  // a JSON text (OpenAI's function.arguments)
};

struct ChatDelta {
  std::string content, reasoning_content;
  std::vector<ToolCall> tool_calls;
  size_t first_tool_index = 0;  // OpenAI's tool_calls[].index of tool_calls[0]
  bool empty() const { return content.empty() && reasoning_content.empty() && tool_calls.empty(); }
};

struct ParsedMessage {
  std::string content, reasoning_content;
  std::vector<ToolCall> tool_calls;
  // {"role": "assistant", "content": ... (null when empty and there are tool calls),
  //  "reasoning_content": ... (when any), "tool_calls": [{"id", "type": "function", "function": {"name", "arguments"}}]}
  nlohmann::ordered_json to_json() const;
};

class ToolCallParser {
 public:
  // reasoning_open: the prompt ended inside a think block (Qwen3's generation prompt with
  // thinking on may end with "<think>\n"), so the text starts as reasoning.
  explicit ToolCallParser(ToolCallFormat format, std::string id_prefix = "call_", bool reasoning_open = false);
  ChatDelta feed(std::string_view text);
  ChatDelta finish();
  const ParsedMessage& message() const { return msg_; }

 private:
  enum class State { kContent, kThink, kToolCall, kHeader, kBody };
  void step(ChatDelta& d, bool final);
  bool step_qwen(ChatDelta& d, bool final);
  bool step_harmony(ChatDelta& d, bool final);
  void emit_content(ChatDelta& d, std::string_view s);
  void emit_reasoning(ChatDelta& d, std::string_view s);
  void emit_tool(ChatDelta& d, std::string name, std::string arguments);
  bool qwen_tool_call(ChatDelta& d, const std::string& body);

  ToolCallFormat format_;
  std::string id_prefix_;
  State state_;
  std::string buf_;
  bool trim_leading_ = false;  // drop whitespace before the next content (after </think> or a tool call)
  std::string channel_, recipient_;  // harmony: the current message's
  ParsedMessage msg_;
};

ParsedMessage parse_generated_text(ToolCallFormat format, std::string_view text, bool reasoning_open = false);

// Whether a rendered prompt leaves the model inside a think block ("<think>" and only whitespace
// after it at the end, as Qwen3.5's generation prompt with thinking on): ToolCallParser's
// reasoning_open.
bool prompt_opens_reasoning(std::string_view rendered_prompt);

}  // namespace moraine::chat
