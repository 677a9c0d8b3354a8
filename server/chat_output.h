// The assistant's turn of a chat request in OpenAI's shape when the request offers `tools`: the
// generated text split by the model's tool-call format (common/chat/tool_call_parser.h) into
// content, reasoning_content and tool_calls, whole (message) or streamed (delta per chunk).
// Without a format (kNone, or no tools) the text is content, as before.
#pragma once
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "common/chat/tool_call_parser.h"

namespace moraine::chat {
class ChatTemplate;
}

namespace moraine::server {

// How a chat request's output is read; set per request by the server.
struct ChatOutputFormat {
  chat::ToolCallFormat format = chat::ToolCallFormat::kNone;
  bool reasoning_open = false;   // the rendered prompt ends inside <think>
  std::string id_prefix = "call_";   // tool call ids are id_prefix + index: unique per request
};

// The format for a request: kHarmony for a harmony template (gpt-oss: its channels are split with
// or without tools; the request must then ask for render_special), kQwen for a Qwen template
// when the request offers tools, else kNone.
// `chat_json` (GenerateRequest.chat_json) is rendered with the template to see whether the
// prompt opens a think block; a conversation the template refuses leaves reasoning closed (the
// coordinator then refuses it).
ChatOutputFormat chat_output_format(const chat::ChatTemplate* tmpl, bool has_tools, const std::string& chat_json,
                                    std::string id_prefix);

// The whole message: {"role","content","reasoning_content"?,"tool_calls"?}; content is the text
// when the format is kNone.
nlohmann::json chat_message_json(const ChatOutputFormat& f, const std::string& text);

// A streamed choice's deltas, one parser per request.
class ChatDeltaBuilder {
 public:
  explicit ChatDeltaBuilder(ChatOutputFormat f);
  // The delta members for a generated piece (final: the generation ended, held text is
  // flushed): "content", "reasoning_content", "tool_calls" [{index, id, type, function}] where
  // there are any. Text that may begin a marker is held back.
  nlohmann::json add(const std::string& text, bool final);
  bool any_tool_calls() const { return tool_calls_ > 0; }

 private:
  ChatOutputFormat f_;
  std::unique_ptr<chat::ToolCallParser> parser_;   // null for kNone
  size_t tool_calls_ = 0;
};

}  // namespace moraine::server
