#include "common/chat/chat_template.h"

#include <stdexcept>

#include "common/gguf/gguf.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"

namespace moraine::chat {
namespace {

using ojson = nlohmann::ordered_json;

[[noreturn]] void bad(size_t i, const std::string& what) {
  throw std::invalid_argument("messages[" + std::to_string(i) + "]: " + what);
}

// content as a string: text parts joined with "\n" (llama.cpp's concat_content_parts).
ojson flatten_content(const ojson& c, size_t i) {
  if (c.is_string() || c.is_null()) return c;
  if (!c.is_array()) bad(i, "content must be a string, null or an array of parts");
  std::string text;
  for (size_t k = 0; k < c.size(); ++k) {
    const ojson& p = c[k];
    if (!p.is_object() || p.value("type", "") != "text" || !p.contains("text") || !p["text"].is_string())
      bad(i, "content[" + std::to_string(k) + "]: only {\"type\": \"text\", \"text\": ...} parts are supported");
    if (!text.empty()) text += '\n';
    text += p["text"].get<std::string>();
  }
  return text;
}

ojson normalise_tool_calls(const ojson& calls, size_t i, bool object_arguments) {
  if (!calls.is_array()) bad(i, "tool_calls must be an array");
  ojson out = ojson::array();
  for (size_t k = 0; k < calls.size(); ++k) {
    ojson c = calls[k];
    const std::string where = "tool_calls[" + std::to_string(k) + "]";
    if (!c.is_object() || !c.contains("function") || !c["function"].is_object()) bad(i, where + " needs a \"function\" object");
    ojson& f = c["function"];
    if (!f.contains("name") || !f["name"].is_string()) bad(i, where + ".function needs a string \"name\"");
    if (f.contains("arguments")) {
      ojson& a = f["arguments"];
      if (a.is_string() && object_arguments) {
        ojson parsed = ojson::parse(a.get<std::string>(), nullptr, false);
        if (parsed.is_discarded()) bad(i, where + ".function.arguments is not valid JSON");
        a = std::move(parsed);
      } else if (!a.is_string() && !object_arguments) {
        a = a.dump();
      }
    }
    out.push_back(std::move(c));
  }
  return out;
}

ojson normalise_messages(const ojson& chat, bool object_arguments) {
  if (!chat.is_object()) throw std::invalid_argument("the conversation must be a JSON object");
  if (!chat.contains("messages") || !chat["messages"].is_array() || chat["messages"].empty())
    throw std::invalid_argument("the conversation needs a non-empty \"messages\" array");
  ojson out = ojson::array();
  const ojson& msgs = chat["messages"];
  for (size_t i = 0; i < msgs.size(); ++i) {
    ojson m = msgs[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) bad(i, "each message needs a string \"role\"");
    const std::string role = m["role"].get<std::string>();
    if (role != "system" && role != "developer" && role != "user" && role != "assistant" && role != "tool")
      bad(i, "role '" + role + "' is not one of system, developer, user, assistant, tool");
    if (m.contains("content")) m["content"] = flatten_content(m["content"], i);
    if (m.contains("tool_calls")) {
      if (m["tool_calls"].is_null()) m.erase("tool_calls");
      else m["tool_calls"] = normalise_tool_calls(m["tool_calls"], i, object_arguments);
    }
    out.push_back(std::move(m));
  }
  return out;
}

// Whether the template reads tool-call arguments as a mapping: with an object it shows the value,
// and not as Python's repr of a dict (what printing a mapping gives). Otherwise a string when the
// string shows; when neither does (the probe is refused, or arguments are not written), a
// mapping, what Hugging Face templates expect.
bool probe_object_arguments(const jinja::Template& t) {
  const std::string marker = "moraine_probe_value_7f3a";
  ojson ctx = {
      {"messages", ojson::array({
                       {{"role", "user"}, {"content", "Hi"}},
                       {{"role", "assistant"},
                        {"content", ""},
                        {"tool_calls", ojson::array({{{"id", "pr0beCa11"},  // 9 alphanumerics: Mistral's templates insist
                                                      {"type", "function"},
                                                      {"function", {{"name", "probe_tool"}, {"arguments", {{"arg", marker}}}}}}})}},
                   })},
      {"tools", ojson::array({{{"type", "function"},
                               {"function", {{"name", "probe_tool"}, {"description", "probe"},
                                             {"parameters", {{"type", "object"}, {"properties", {{"arg", {{"type", "string"}}}}}}}}}}})},
      {"add_generation_prompt", false},
      {"bos_token", ""},
      {"eos_token", ""},
  };
  auto shows_marker = [&](const ojson& c, bool as_object) {
    try {
      const std::string out = t.render(c);
      return out.find(marker) != std::string::npos && (!as_object || out.find("'arg': '" + marker) == std::string::npos);
    } catch (const std::exception&) {
      return false;
    }
  };
  if (shows_marker(ctx, true)) return true;
  ojson& args = ctx["messages"][1]["tool_calls"][0]["function"]["arguments"];
  args = args.dump();
  return !shows_marker(ctx, false);
}

}  // namespace

ChatTemplate::ChatTemplate(const std::string& source, std::string bos_token, std::string eos_token)
    : source_(source), bos_(std::move(bos_token)), eos_(std::move(eos_token)), tmpl_(source) {
  object_arguments_ = probe_object_arguments(tmpl_);
}

std::optional<ChatTemplate> ChatTemplate::from_gguf(const gguf::GgufFile& file, const tokenizer::Tokenizer& tok,
                                                    std::string* warning) {
  const std::optional<std::string> src = file.get_string("tokenizer.chat_template");
  if (!src || src->empty()) return std::nullopt;
  auto text = [&](std::optional<tokenizer::TokenId> id) { return id ? tok.token_bytes(*id, true) : std::string(); };
  try {
    return ChatTemplate(*src, text(tok.bos()), text(tok.eos()));
  } catch (const jinja::TemplateError& e) {
    if (warning) *warning = std::string("tokenizer.chat_template does not parse: ") + e.what();
    return std::nullopt;
  }
}

ojson ChatTemplate::context(const ojson& chat) const {
  ojson ctx;
  ctx["messages"] = normalise_messages(chat, object_arguments_);
  ctx["tools"] = chat.contains("tools") ? chat["tools"] : ojson(nullptr);
  ctx["add_generation_prompt"] = chat.contains("add_generation_prompt") ? chat["add_generation_prompt"] : ojson(true);
  ctx["bos_token"] = bos_;
  ctx["eos_token"] = eos_;
  if (chat.contains("chat_template_kwargs")) {
    const ojson& kw = chat["chat_template_kwargs"];
    if (!kw.is_object()) throw std::invalid_argument("chat_template_kwargs must be an object");
    for (auto it = kw.begin(); it != kw.end(); ++it) ctx[it.key()] = it.value();
  }
  return ctx;
}

std::string ChatTemplate::render(const ojson& chat, const jinja::RenderOptions& options) const {
  return tmpl_.render(context(chat), options);
}

std::string render_builtin_chatml(const ojson& chat) {
  const ojson msgs = normalise_messages(chat, true);
  std::vector<tokenizer::ChatMessage> conv;
  for (size_t i = 0; i < msgs.size(); ++i) {
    const ojson& m = msgs[i];
    const ojson content = m.value("content", ojson(""));
    if (!content.is_string() && !content.is_null()) bad(i, "content must be text");
    tokenizer::ChatMessage cm{m["role"].get<std::string>(), content.is_string() ? content.get<std::string>() : "", {}};
    if (m.contains("reasoning_content") && m["reasoning_content"].is_string())
      cm.reasoning_content = m["reasoning_content"].get<std::string>();
    conv.push_back(std::move(cm));
  }
  tokenizer::ChatTemplateOptions o;
  o.add_generation_prompt = chat.value("add_generation_prompt", true);
  if (chat.contains("chat_template_kwargs") && chat["chat_template_kwargs"].is_object()) {
    const ojson& kw = chat["chat_template_kwargs"];
    if (kw.contains("enable_thinking") && kw["enable_thinking"].is_boolean()) o.enable_thinking = kw["enable_thinking"].get<bool>();
  }
  try {
    return tokenizer::render_qwen_chatml(conv, o);
  } catch (const std::exception& e) {
    throw std::invalid_argument(e.what());
  }
}

}  // namespace moraine::chat
