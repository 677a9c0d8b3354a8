// The ChatML chat template of Qwen3 (its tokenizer_config.json chat_template), built in for plain
// conversations: system / user / assistant messages, no tools. The output is byte-for-byte what
// the Jinja template renders for the same messages.
#pragma once
#include <optional>
#include <string>
#include <vector>

namespace moraine::tokenizer {

struct ChatMessage {
  std::string role;     // "system", "user" or "assistant"
  std::string content;
  // Assistant reasoning given separately; when absent, a "<think>...</think>" prefix inside
  // content is taken as the reasoning, as the template does.
  std::optional<std::string> reasoning_content;
};

struct ChatTemplateOptions {
  bool add_generation_prompt = true;  // end with the header of the assistant's reply
  // false: the generation prompt carries an empty think block, which turns reasoning off.
  std::optional<bool> enable_thinking;
};

// Throws TokenizerError for a role other than system/user/assistant (tool messages are not
// supported yet), naming the message index and role.
std::string render_qwen_chatml(const std::vector<ChatMessage>& messages,
                               const ChatTemplateOptions& options = {});

}  // namespace moraine::tokenizer
