// A model's chat template (the GGUF's tokenizer.chat_template, a Jinja2 template) applied to an
// OpenAI-style conversation, rendered as Hugging Face's apply_chat_template renders it.
//
// The conversation is a JSON object:
//   {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...}, ...],
//    "tools": [{"type": "function", "function": {...}}, ...],          (optional)
//    "chat_template_kwargs": {"enable_thinking": false, ...},           (optional)
//    "add_generation_prompt": true}                                     (optional, default true)
// content: a string, null, or an array of {"type": "text", "text": ...} parts (joined with "\n",
// as llama.cpp does for string-content templates). An assistant's tool_calls carry
// function.arguments as a JSON string (OpenAI) or an object; the template gets them in the form it
// uses: an object when a probe render shows it reads them as a mapping (llama.cpp's
// supports_object_arguments), else the JSON string. Other message members (reasoning_content,
// tool_call_id, name) pass through. The template also sees bos_token, eos_token, tools (null when
// absent, as transformers passes it) and each chat_template_kwargs member as a variable.
// Parse requests with nlohmann::ordered_json: the order of an object's keys (tools' schemas)
// shows in the prompt, as Python dicts keep it.
#pragma once
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "common/jinja/template.h"

namespace moraine::gguf {
class GgufFile;
}
namespace moraine::tokenizer {
class Tokenizer;
}

namespace moraine::chat {

class ChatTemplate {
 public:
  // Parses the template; throws jinja::TemplateError (naming the line) when it does not parse.
  ChatTemplate(const std::string& source, std::string bos_token, std::string eos_token);

  // The GGUF's tokenizer.chat_template with the vocabulary's BOS/EOS texts. nullopt when the file
  // has none, or when it does not parse (then *warning says why); the caller falls back to the
  // built-in ChatML (render_builtin_chatml).
  static std::optional<ChatTemplate> from_gguf(const gguf::GgufFile& file, const tokenizer::Tokenizer& tok,
                                               std::string* warning);

  // Throws std::invalid_argument for a malformed conversation (naming the message and member) and
  // jinja::TemplateError when the template fails (e.g. raise_exception), naming its line.
  std::string render(const nlohmann::ordered_json& chat, const jinja::RenderOptions& options = {}) const;
  // The variables the template is rendered with.
  nlohmann::ordered_json context(const nlohmann::ordered_json& chat) const;

  bool object_arguments() const { return object_arguments_; }
  const std::string& source() const { return source_; }

 private:
  std::string source_, bos_, eos_;
  jinja::Template tmpl_;
  bool object_arguments_ = true;
};

// The built-in Qwen3 ChatML (tokenizer/chat_template.h) for the same conversation JSON: system,
// user and assistant messages with string (or text-part) content only. Throws std::invalid_argument.
std::string render_builtin_chatml(const nlohmann::ordered_json& chat);

}  // namespace moraine::chat
