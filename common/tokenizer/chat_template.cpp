#include "common/tokenizer/chat_template.h"

#include <string_view>

#include "common/tokenizer/tokenizer_error.h"

namespace moraine::tokenizer {
namespace {

constexpr std::string_view kStart = "<|im_start|>";
constexpr std::string_view kEnd = "<|im_end|>\n";

// Python's str.lstrip / rstrip / strip with the character '\n'.
std::string_view lstrip_newlines(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return s;
}
std::string_view rstrip_newlines(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}
std::string_view strip_newlines(std::string_view s) { return rstrip_newlines(lstrip_newlines(s)); }

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
bool ends_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

// A user message that only carries a tool result does not count as the user's query.
bool is_tool_response(const ChatMessage& m) {
  return starts_with(m.content, "<tool_response>") && ends_with(m.content, "</tool_response>");
}

}  // namespace

std::string render_qwen_chatml(const std::vector<ChatMessage>& messages,
                               const ChatTemplateOptions& options) {
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& r = messages[i].role;
    if (r != "system" && r != "user" && r != "assistant") {
      throw TokenizerError("chat template: message " + std::to_string(i) + " has role '" + r +
                           "'; only system, user and assistant are supported");
    }
  }
  std::string out;
  if (!messages.empty() && messages[0].role == "system") {
    out.append(kStart).append("system\n").append(messages[0].content).append(kEnd);
  }
  // The last real user query: assistant turns after it are the current turn, whose reasoning
  // is kept; earlier assistant turns are rendered without it.
  size_t last_query = messages.empty() ? 0 : messages.size() - 1;
  for (size_t k = messages.size(); k-- > 0;) {
    if (messages[k].role == "user" && !is_tool_response(messages[k])) {
      last_query = k;
      break;
    }
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "user" || (m.role == "system" && i != 0)) {
      out.append(kStart).append(m.role).append("\n").append(m.content).append(kEnd);
      continue;
    }
    if (m.role != "assistant") continue;  // the leading system message, already written
    std::string_view content = m.content;
    std::string_view reasoning;
    if (m.reasoning_content) {
      reasoning = *m.reasoning_content;
    } else if (const size_t close = content.find("</think>"); close != std::string_view::npos) {
      const std::string_view all = content;
      content = lstrip_newlines(all.substr(all.rfind("</think>") + 8));
      std::string_view before = rstrip_newlines(all.substr(0, close));
      const size_t open = before.rfind("<think>");
      if (open != std::string_view::npos) before = before.substr(open + 7);
      reasoning = lstrip_newlines(before);
    }
    const bool is_last = i + 1 == messages.size();
    out.append(kStart).append("assistant\n");
    if (i > last_query && (is_last || !reasoning.empty())) {
      out.append("<think>\n").append(strip_newlines(reasoning)).append("\n</think>\n\n");
      out.append(lstrip_newlines(content));
    } else {
      out.append(content);
    }
    out.append(kEnd);
  }
  if (options.add_generation_prompt) {
    out.append(kStart).append("assistant\n");
    if (options.enable_thinking == false) out.append("<think>\n\n</think>\n\n");
  }
  return out;
}

}  // namespace moraine::tokenizer
