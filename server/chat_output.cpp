#include "server/chat_output.h"

#include <stdexcept>

#include "common/chat/chat_template.h"
#include "common/chat/tool_call_parser.h"

namespace moraine::server {

using nlohmann::json;

ChatOutputFormat chat_output_format(const chat::ChatTemplate* tmpl, bool has_tools, const std::string& chat_json,
                                    std::string id_prefix) {
  ChatOutputFormat f;
  f.id_prefix = std::move(id_prefix);
  if (!tmpl) return f;
  // Harmony's channels are split with tools or without (its analysis channel is reasoning, not
  // content); Qwen's format only when tools are offered, as before.
  f.format = chat::detect_tool_call_format(tmpl->source());
  if (f.format == chat::ToolCallFormat::kHarmony) return f;
  if (!has_tools) f.format = chat::ToolCallFormat::kNone;
  if (f.format != chat::ToolCallFormat::kQwen) return f;
  try {
    const nlohmann::ordered_json chat = nlohmann::ordered_json::parse(chat_json);
    f.reasoning_open = chat::prompt_opens_reasoning(tmpl->render(chat));
  } catch (const std::exception&) {
    // The coordinator renders the same conversation and answers the error.
  }
  return f;
}

json chat_message_json(const ChatOutputFormat& f, const std::string& text) {
  if (f.format == chat::ToolCallFormat::kNone) return {{"role", "assistant"}, {"content", text}};
  chat::ToolCallParser p(f.format, f.id_prefix, f.reasoning_open);
  p.feed(text);
  p.finish();
  // ordered -> the response's json type. A model may write bytes that are not UTF-8 (byte
  // tokens); strict dump() threw on them (http_request_fuzz), the server's own dump replaces them.
  return json::parse(p.message().to_json().dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace));
}

ChatDeltaBuilder::ChatDeltaBuilder(ChatOutputFormat f) : f_(std::move(f)) {
  if (f_.format != chat::ToolCallFormat::kNone)
    parser_ = std::make_unique<chat::ToolCallParser>(f_.format, f_.id_prefix, f_.reasoning_open);
}

json ChatDeltaBuilder::add(const std::string& text, bool final) {
  json delta = json::object();
  if (!parser_) {
    if (!text.empty()) delta["content"] = text;
    return delta;
  }
  chat::ChatDelta d = parser_->feed(text);
  if (final) {
    chat::ChatDelta rest = parser_->finish();
    d.content += rest.content;
    d.reasoning_content += rest.reasoning_content;
    if (d.tool_calls.empty()) d.first_tool_index = rest.first_tool_index;
    for (chat::ToolCall& c : rest.tool_calls) d.tool_calls.push_back(std::move(c));
  }
  if (!d.content.empty()) delta["content"] = d.content;
  if (!d.reasoning_content.empty()) delta["reasoning_content"] = d.reasoning_content;
  if (!d.tool_calls.empty()) {
    json calls = json::array();
    for (size_t i = 0; i < d.tool_calls.size(); ++i) {
      const chat::ToolCall& c = d.tool_calls[i];
      calls.push_back({{"index", d.first_tool_index + i},
                       {"id", c.id},
                       {"type", "function"},
                       {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
    }
    delta["tool_calls"] = std::move(calls);
    tool_calls_ += d.tool_calls.size();
  }
  return delta;
}

}  // namespace moraine::server
