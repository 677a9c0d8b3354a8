// libFuzzer target: chat templates and conversations. The input is a template source, then a
// NUL byte, then a conversation as JSON (the body of a chat request: messages, tools,
// chat_template_kwargs); with no NUL the whole input is the template and a fixed conversation
// is rendered. The Jinja engine documents that bad templates and bad input give a TemplateError
// (and ChatTemplate an invalid_argument for a malformed conversation), never a crash: any other
// exception aborts here. The conversation also goes through the built-in ChatML.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include <nlohmann/json.hpp>

#include "common/chat/chat_template.h"
#include "common/jinja/template.h"

namespace {

using moraine::chat::ChatTemplate;
using moraine::jinja::TemplateError;
using nlohmann::ordered_json;

const char* kConversation = R"({"messages": [
  {"role": "system", "content": "Be brief."},
  {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
  {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "id": "c0",
    "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 2}"}}]},
  {"role": "tool", "tool_call_id": "c0", "content": "4"}],
 "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object",
   "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}],
 "chat_template_kwargs": {"enable_thinking": false}, "add_generation_prompt": true})";

[[noreturn]] void unexpected(const char* where, const char* what) {
  std::fprintf(stderr, "chat_template_fuzz: %s threw something other than TemplateError / invalid_argument: %s\n", where, what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string source = input.substr(0, nul);
  ordered_json chat = ordered_json::parse(kConversation);
  if (nul != std::string::npos) {
    chat = ordered_json::parse(input.substr(nul + 1), nullptr, false);
    if (chat.is_discarded()) return 0;   // not JSON: the server refuses it before any template
  }
  const moraine::jinja::RenderOptions at_a_fixed_time{std::time_t{1700000000}};
  try {
    const ChatTemplate t(source, "<s>", "</s>");
    const std::string prompt = t.render(chat, at_a_fixed_time);
    if (prompt.size() == 0x5eed) std::fputc(' ', stderr);
  } catch (const TemplateError&) {
  } catch (const std::invalid_argument&) {
  } catch (const std::exception& e) {
    unexpected("ChatTemplate", e.what());
  }
  try {
    (void)moraine::chat::render_builtin_chatml(chat);
  } catch (const std::invalid_argument&) {
  } catch (const std::exception& e) {
    unexpected("render_builtin_chatml", e.what());
  }
  return 0;
}
