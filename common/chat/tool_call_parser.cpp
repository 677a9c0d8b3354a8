#include "common/chat/tool_call_parser.h"

#include <initializer_list>

namespace moraine::chat {
namespace {

constexpr std::string_view kToolOpen = "<tool_call>", kToolClose = "</tool_call>";
constexpr std::string_view kThinkOpen = "<think>", kThinkClose = "</think>";
constexpr std::string_view kMessage = "<|message|>", kChannel = "<|channel|>";
constexpr std::string_view kEnds[] = {"<|end|>", "<|call|>", "<|return|>"};

bool is_ws(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

// The longest suffix of s that is a proper prefix of a marker: text that may still become one.
size_t held_prefix(std::string_view s, std::initializer_list<std::string_view> markers) {
  size_t best = 0;
  for (std::string_view m : markers) {
    for (size_t n = std::min(s.size(), m.size() - 1); n > best; --n) {
      if (s.substr(s.size() - n) == m.substr(0, n)) {
        best = n;
        break;
      }
    }
  }
  return best;
}

std::string trim(std::string_view s) {
  while (!s.empty() && is_ws(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_ws(s.back())) s.remove_suffix(1);
  return std::string(s);
}

// The earliest of the markers in s: {position, marker length}; npos when none.
std::pair<size_t, size_t> find_first(std::string_view s, std::initializer_list<std::string_view> markers) {
  std::pair<size_t, size_t> best{std::string_view::npos, 0};
  for (std::string_view m : markers) {
    const size_t p = s.find(m);
    if (p < best.first) best = {p, m.size()};
  }
  return best;
}

// A word after `key` in a harmony header, up to whitespace or the next "<|".
std::string header_word(const std::string& header, std::string_view key) {
  const size_t p = header.find(key);
  if (p == std::string::npos) return "";
  size_t e = p + key.size();
  while (e < header.size() && !is_ws(header[e]) && header.compare(e, 2, "<|") != 0) ++e;
  return header.substr(p + key.size(), e - p - key.size());
}

}  // namespace

ToolCallFormat detect_tool_call_format(const std::string& src) {
  if (src.find("<|channel|>") != std::string::npos) return ToolCallFormat::kHarmony;
  if (src.find("<tool_call>") != std::string::npos || src.find("<think>") != std::string::npos) return ToolCallFormat::kQwen;
  return ToolCallFormat::kNone;
}

nlohmann::ordered_json ParsedMessage::to_json() const {
  nlohmann::ordered_json m = {{"role", "assistant"}};
  m["content"] = content.empty() && !tool_calls.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(content);
  if (!reasoning_content.empty()) m["reasoning_content"] = reasoning_content;
  if (!tool_calls.empty()) {
    nlohmann::ordered_json calls = nlohmann::ordered_json::array();
    for (const ToolCall& c : tool_calls)
      calls.push_back({{"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
    m["tool_calls"] = std::move(calls);
  }
  return m;
}

ToolCallParser::ToolCallParser(ToolCallFormat format, std::string id_prefix, bool reasoning_open)
    : format_(format), id_prefix_(std::move(id_prefix)) {
  state_ = format == ToolCallFormat::kHarmony ? State::kHeader : reasoning_open ? State::kThink : State::kContent;
  trim_leading_ = reasoning_open;
}

ChatDelta ToolCallParser::feed(std::string_view text) {
  ChatDelta d;
  d.first_tool_index = msg_.tool_calls.size();
  buf_.append(text);
  step(d, false);
  return d;
}

ChatDelta ToolCallParser::finish() {
  ChatDelta d;
  d.first_tool_index = msg_.tool_calls.size();
  step(d, true);
  return d;
}

void ToolCallParser::step(ChatDelta& d, bool final) {
  if (format_ == ToolCallFormat::kNone) {
    emit_content(d, buf_);
    buf_.clear();
    return;
  }
  while (format_ == ToolCallFormat::kQwen ? step_qwen(d, final) : step_harmony(d, final)) {
  }
}

void ToolCallParser::emit_content(ChatDelta& d, std::string_view s) {
  if (trim_leading_) {
    while (!s.empty() && is_ws(s.front())) s.remove_prefix(1);
    if (s.empty()) return;
    trim_leading_ = false;
  }
  d.content.append(s);
  msg_.content.append(s);
}

void ToolCallParser::emit_reasoning(ChatDelta& d, std::string_view s) {
  if (trim_leading_) {
    while (!s.empty() && is_ws(s.front())) s.remove_prefix(1);
    if (s.empty()) return;
    trim_leading_ = false;
  }
  d.reasoning_content.append(s);
  msg_.reasoning_content.append(s);
}

void ToolCallParser::emit_tool(ChatDelta& d, std::string name, std::string arguments) {
  ToolCall c{id_prefix_ + std::to_string(msg_.tool_calls.size()), std::move(name), std::move(arguments)};
  d.tool_calls.push_back(c);
  msg_.tool_calls.push_back(std::move(c));
}

// {"name": ..., "arguments": {...} or "..."}; false when the body is not such an object.
bool ToolCallParser::qwen_tool_call(ChatDelta& d, const std::string& body) {
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(trim(body), nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("name") || !j["name"].is_string()) return false;
  std::string args = "{}";
  if (j.contains("arguments")) args = j["arguments"].is_string() ? j["arguments"].get<std::string>() : j["arguments"].dump();
  emit_tool(d, j["name"].get<std::string>(), std::move(args));
  return true;
}

bool ToolCallParser::step_qwen(ChatDelta& d, bool final) {
  if (state_ == State::kContent) {
    const auto [p, n] = find_first(buf_, {kToolOpen, kThinkOpen});
    if (p != std::string::npos) {
      emit_content(d, std::string_view(buf_).substr(0, p));
      state_ = buf_.compare(p, n, kToolOpen) == 0 ? State::kToolCall : State::kThink;
      trim_leading_ = state_ == State::kThink;
      buf_.erase(0, p + n);
      return true;
    }
    const size_t keep = final ? 0 : held_prefix(buf_, {kToolOpen, kThinkOpen});
    emit_content(d, std::string_view(buf_).substr(0, buf_.size() - keep));
    buf_.erase(0, buf_.size() - keep);
    return false;
  }
  if (state_ == State::kThink) {
    const size_t p = buf_.find(kThinkClose);
    if (p != std::string::npos) {
      size_t e = p;
      while (e > 0 && is_ws(buf_[e - 1])) --e;  // reasoning without its trailing whitespace
      emit_reasoning(d, std::string_view(buf_).substr(0, e));
      buf_.erase(0, p + kThinkClose.size());
      state_ = State::kContent;
      trim_leading_ = true;
      return true;
    }
    size_t e = buf_.size() - (final ? 0 : held_prefix(buf_, {kThinkClose}));
    while (e > 0 && is_ws(buf_[e - 1])) --e;  // held until text follows it
    emit_reasoning(d, std::string_view(buf_).substr(0, e));
    buf_.erase(0, final ? buf_.size() : e);
    return false;
  }
  // kToolCall
  const size_t p = buf_.find(kToolClose);
  if (p == std::string::npos && !final) return false;
  const std::string body = buf_.substr(0, p);
  state_ = State::kContent;
  if (!qwen_tool_call(d, body)) {
    trim_leading_ = false;
    emit_content(d, std::string(kToolOpen) + body + (p == std::string::npos ? "" : std::string(kToolClose)));
  } else {
    trim_leading_ = true;
  }
  buf_.erase(0, p == std::string::npos ? buf_.size() : p + kToolClose.size());
  return p != std::string::npos;
}

bool ToolCallParser::step_harmony(ChatDelta& d, bool final) {
  if (state_ == State::kHeader) {
    const size_t p = buf_.find(kMessage);
    if (p == std::string::npos) {
      if (final) {  // not harmony after all: what is left is content
        const std::string rest = trim(buf_);
        if (!rest.empty()) emit_content(d, rest);
        buf_.clear();
      }
      return false;
    }
    const std::string header = buf_.substr(0, p);
    channel_ = header_word(header, kChannel);
    recipient_ = header_word(header, "to=");
    if (recipient_.rfind("functions.", 0) == 0) recipient_.erase(0, 10);
    buf_.erase(0, p + kMessage.size());
    state_ = State::kBody;
    return true;
  }
  // kBody
  const auto [p, n] = find_first(buf_, {kEnds[0], kEnds[1], kEnds[2]});
  const bool tool = !recipient_.empty();
  if (p == std::string::npos && !final) {
    if (tool) return false;  // a tool call's arguments come whole
    const size_t keep = held_prefix(buf_, {kEnds[0], kEnds[1], kEnds[2]});
    const std::string_view piece = std::string_view(buf_).substr(0, buf_.size() - keep);
    if (channel_ == "analysis") emit_reasoning(d, piece);
    else emit_content(d, piece);
    buf_.erase(0, buf_.size() - keep);
    return false;
  }
  const std::string piece = buf_.substr(0, p);
  if (tool) emit_tool(d, recipient_, trim(piece));
  else if (channel_ == "analysis") emit_reasoning(d, piece);
  else emit_content(d, piece);
  buf_.erase(0, p == std::string::npos ? buf_.size() : p + n);
  state_ = State::kHeader;
  channel_.clear();
  recipient_.clear();
  return p != std::string::npos;
}

ParsedMessage parse_generated_text(ToolCallFormat format, std::string_view text, bool reasoning_open) {
  ToolCallParser p(format, "call_", reasoning_open);
  p.feed(text);
  p.finish();
  return p.message();
}

bool prompt_opens_reasoning(std::string_view p) {
  while (!p.empty() && is_ws(p.back())) p.remove_suffix(1);
  return p.size() >= kThinkOpen.size() && p.substr(p.size() - kThinkOpen.size()) == kThinkOpen;
}

}  // namespace moraine::chat
