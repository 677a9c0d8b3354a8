#include "server/openai_api.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <random>

#include "coordinator/stop_strings.h"

namespace moraine::server {
namespace {

using nlohmann::json;

const char* type_for(int status) {
  switch (status) {
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 429: return "rate_limit_error";
    case 500: return "server_error";
    case 503: return "service_unavailable";
    default: return "invalid_request_error";
  }
}

ApiError bad(const std::string& param, const std::string& what) { return ApiError(400, param + ": " + what, param); }

// A field that is absent or null reads as not given.
const json* field(const json& body, const char* name) {
  const auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

std::optional<double> number(const json& body, const char* name, double lo, double hi) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) throw bad(name, "expected a number, got " + std::string(v->type_name()));
  const double x = v->get<double>();
  if (!(x >= lo && x <= hi)) throw bad(name, v->dump() + " is outside [" + json(lo).dump() + ", " + json(hi).dump() + "]");
  return x;
}

std::optional<int64_t> integer(const json& body, const char* name, int64_t lo, int64_t hi) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number_integer() && !(v->is_number_float() && std::floor(v->get<double>()) == v->get<double>()))
    throw bad(name, "expected an integer, got " + std::string(v->type_name()));
  if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(hi))
    throw bad(name, v->dump() + " is above " + std::to_string(hi));
  // A float is checked against the range before it becomes an integer: out of int64's range the
  // conversion is undefined (http_request_fuzz, CI: max_tokens 1.66e47).
  if (v->is_number_float() && !(v->get<double>() >= static_cast<double>(lo) && v->get<double>() <= static_cast<double>(hi)))
    throw bad(name, v->dump() + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  const int64_t x = v->is_number_float() ? static_cast<int64_t>(v->get<double>()) : v->get<int64_t>();
  if (x < lo || x > hi) throw bad(name, std::to_string(x) + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return x;
}

std::optional<bool> boolean(const json& body, const char* name) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) throw bad(name, "expected a boolean, got " + std::string(v->type_name()));
  return v->get<bool>();
}

// A message's content: a string, null (an assistant turn of tool calls) or text parts.
std::string content_text(const json& m, const std::string& where) {
  const json* c = field(m, "content");
  if (!c) return {};
  if (c->is_string()) return c->get<std::string>();
  if (!c->is_array()) throw bad(where + ".content", "expected a string or an array of text parts, got " + std::string(c->type_name()));
  std::string text;
  for (size_t j = 0; j < c->size(); ++j) {
    const json& part = (*c)[j];
    const std::string at = where + ".content[" + std::to_string(j) + "]";
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string()) throw bad(at, "expected an object with a string \"type\"");
    if (part["type"] != "text") throw bad(at, "only text parts are supported, not \"" + part["type"].get<std::string>() + "\"");
    if (!part.contains("text") || !part["text"].is_string()) throw bad(at + ".text", "expected a string");
    text += part["text"].get<std::string>();
  }
  return text;
}

// The conversation the coordinator renders with the model's chat template (chat_json): the
// messages with their content as plain text, tool calls and tools kept as the client sent them.
// The tools a request's tool_choice lets the model see: "auto" (or none given) and "required"
// all of them (required is not enforced: there is no constrained decoding), "none" none, a
// named function only that one. 400 for another value or a name not among the tools.
json offered_tools(const json& tools, const json* choice) {
  if (!choice || choice->is_null()) return tools;
  if (choice->is_string()) {
    const std::string c = choice->get<std::string>();
    if (c == "auto" || c == "required") return tools;
    if (c == "none") return json::array();
    throw bad("tool_choice", "\"" + c + "\" is not one of none, auto, required, or {\"type\": \"function\", ...}");
  }
  const json* fn = choice->is_object() ? field(*choice, "function") : nullptr;
  const json* name = fn && fn->is_object() ? field(*fn, "name") : nullptr;
  if (!name || !name->is_string()) throw bad("tool_choice", "expected a string or {\"type\": \"function\", \"function\": {\"name\": ...}}");
  for (const json& t : tools) {
    const json* tf = t.is_object() ? field(t, "function") : nullptr;
    const json* tn = tf && tf->is_object() ? field(*tf, "name") : nullptr;
    if (tn && *tn == *name) return json::array({t});
  }
  throw bad("tool_choice", "names the function \"" + name->get<std::string>() + "\", which is not among the tools");
}

std::string chat_json_of(const json& body) {
  const json* msgs = field(body, "messages");
  if (!msgs) throw bad("messages", "is required");
  if (!msgs->is_array()) throw bad("messages", "expected an array, got " + std::string(msgs->type_name()));
  if (msgs->empty()) throw bad("messages", "must not be empty");
  json out = json::object();
  out["messages"] = json::array();
  for (size_t i = 0; i < msgs->size(); ++i) {
    const json& m = (*msgs)[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) throw bad(where, "expected an object, got " + std::string(m.type_name()));
    const json* role = field(m, "role");
    if (!role || !role->is_string()) throw bad(where + ".role", "a string is required");
    const std::string r = role->get<std::string>();
    if (r != "system" && r != "user" && r != "assistant" && r != "tool" && r != "developer")
      throw bad(where + ".role", "\"" + r + "\" is not one of system, developer, user, assistant, tool");
    json msg = m;
    msg["role"] = r == "developer" ? "system" : r;
    msg["content"] = content_text(m, where);
    out["messages"].push_back(std::move(msg));
  }
  if (const json* tools = field(body, "tools")) {
    if (!tools->is_array()) throw bad("tools", "expected an array");
    out["tools"] = offered_tools(*tools, field(body, "tool_choice"));
    if (out["tools"].empty()) out.erase("tools");
  }
  if (const json* kw = field(body, "chat_template_kwargs")) out["chat_template_kwargs"] = *kw;
  return out.dump();
}

void set_prompt(const json& body, generate::GenerateRequest& g) {
  const json* p = field(body, "prompt");
  if (!p) throw bad("prompt", "is required");
  if (p->is_string()) {
    g.set_prompt(p->get<std::string>());
    return;
  }
  if (!p->is_array() || p->empty()) throw bad("prompt", "expected a string, a one-string array or an array of token ids");
  if ((*p)[0].is_string()) {
    if (p->size() != 1) throw bad("prompt", "one prompt per request (" + std::to_string(p->size()) + " given)");
    g.set_prompt((*p)[0].get<std::string>());
    return;
  }
  for (size_t i = 0; i < p->size(); ++i) {
    const json& t = (*p)[i];
    if (!t.is_number_unsigned() && !(t.is_number_integer() && t.get<int64_t>() >= 0))
      throw bad("prompt[" + std::to_string(i) + "]", "expected a token id (an integer >= 0)");
    g.mutable_token_ids()->add_ids(static_cast<uint32_t>(t.get<uint64_t>()));
  }
}

void set_sampling(const json& body, ApiRequest& r) {
  generate::SamplingParams& sp = *r.generate.mutable_sampling();
  std::optional<int64_t> max = integer(body, "max_completion_tokens", 1, 1 << 24);
  if (!max) max = integer(body, "max_tokens", 1, 1 << 24);
  if (max) {
    sp.set_max_tokens(static_cast<uint32_t>(*max));
  } else {
    sp.set_max_tokens_to_context(true);   // OpenAI's default: until the context is full
  }
  sp.set_temperature(static_cast<float>(number(body, "temperature", 0, 2).value_or(1.0)));
  sp.set_top_p(static_cast<float>(number(body, "top_p", 0, 1).value_or(1.0)));
  sp.set_top_k(static_cast<uint32_t>(integer(body, "top_k", 0, 1 << 20).value_or(0)));
  sp.set_min_p(static_cast<float>(number(body, "min_p", 0, 1).value_or(0.0)));
  sp.set_presence_penalty(static_cast<float>(number(body, "presence_penalty", -2, 2).value_or(0.0)));
  sp.set_frequency_penalty(static_cast<float>(number(body, "frequency_penalty", -2, 2).value_or(0.0)));
  sp.set_repeat_penalty(static_cast<float>(number(body, "repeat_penalty", 0, 10).value_or(1.0)));
  if (const auto n = integer(body, "repeat_last_n", 0, 1 << 20)) sp.set_repeat_last_n(static_cast<uint32_t>(*n));
  // No seed: a fresh one, so that two requests sample differently (as OpenAI's do).
  if (const json* s = field(body, "seed")) {
    if (!s->is_number_integer()) throw bad("seed", "expected an integer, got " + std::string(s->type_name()));
    sp.set_seed(s->is_number_unsigned() ? s->get<uint64_t>() : static_cast<uint64_t>(s->get<int64_t>()));
  } else {
    sp.set_seed((static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}());
  }
  if (const auto ie = boolean(body, "ignore_eos")) sp.set_ignore_eos(*ie);
  if (const json* stop = field(body, "stop")) {
    std::vector<std::string> stops;
    if (stop->is_string()) {
      stops.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (size_t i = 0; i < stop->size(); ++i) {
        if (!(*stop)[i].is_string()) throw bad("stop[" + std::to_string(i) + "]", "expected a string");
        stops.push_back((*stop)[i].get<std::string>());
      }
    } else {
      throw bad("stop", "expected a string or an array of strings, got " + std::string(stop->type_name()));
    }
    if (const std::string why = group::stop_limit_problem(stops); !why.empty()) throw bad("stop", why);
    for (const std::string& s : stops) sp.add_stop(s);
  }
  if (r.endpoint == Endpoint::kChat) {
    r.logprobs = boolean(body, "logprobs").value_or(false);
    r.top_logprobs = static_cast<uint32_t>(integer(body, "top_logprobs", 0, 20).value_or(0));
    if (r.top_logprobs > 0 && !r.logprobs) throw bad("top_logprobs", "needs \"logprobs\": true");
  } else {
    // Completions: logprobs is the number of alternatives (0-5), present means on.
    if (const auto n = integer(body, "logprobs", 0, 5)) {
      r.logprobs = true;
      r.top_logprobs = static_cast<uint32_t>(*n);
    }
  }
  sp.set_logprobs(r.logprobs);
  sp.set_top_logprobs(r.top_logprobs);
}

json bytes_of(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

json chat_logprobs(const std::vector<generate::TokenLogprob>& lps) {
  json content = json::array();
  for (const generate::TokenLogprob& lp : lps) {
    json top = json::array();
    for (const generate::TopLogprob& t : lp.top())
      top.push_back({{"token", t.text()}, {"logprob", t.logprob()}, {"bytes", bytes_of(t.text())}});
    content.push_back({{"token", lp.text()}, {"logprob", lp.logprob()}, {"bytes", bytes_of(lp.text())}, {"top_logprobs", top}});
  }
  return {{"content", content}, {"refusal", nullptr}};
}

json completion_logprobs(const std::vector<generate::TokenLogprob>& lps, size_t text_offset) {
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(), offsets = json::array();
  for (const generate::TokenLogprob& lp : lps) {
    tokens.push_back(lp.text());
    token_logprobs.push_back(lp.logprob());
    json alts = json::object();
    for (const generate::TopLogprob& t : lp.top()) alts[t.text()] = t.logprob();
    top.push_back(alts);
    offsets.push_back(text_offset);
    text_offset += lp.text().size();
  }
  return {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top}, {"text_offset", offsets}};
}

// A stop after tool calls is OpenAI's "tool_calls"; a cut at max_tokens stays "length".
json finish_json(generate::FinishReason f, bool tool_calls = false) {
  if (tool_calls && f == generate::FINISH_STOP) return "tool_calls";
  const std::string s = finish_reason(f);
  return s.empty() ? json(nullptr) : json(s);
}

bool offers_tools(const json& body) {
  const json* t = field(body, "tools");
  return t && t->is_array() && !offered_tools(*t, field(body, "tool_choice")).empty();
}

}  // namespace

ApiError::ApiError(int s, const std::string& message, std::string p, std::string t, std::string c)
    : std::runtime_error(message), status(s), param(std::move(p)), type(t.empty() ? type_for(s) : std::move(t)), code(std::move(c)) {}

json ApiError::body() const {
  return {{"error",
           {{"message", what()}, {"type", type}, {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}}}};
}

ApiRequest parse_request(const std::string& body, Endpoint endpoint, const std::vector<std::string>& model_ids) {
  // nlohmann's reader stops at a NUL byte as at the end of input, so "{...}\0junk" parsed;
  // JSON text never holds a raw NUL (http_request_fuzz).
  if (const size_t nul = body.find('\0'); nul != std::string::npos)
    throw ApiError(400, "the request body is not valid JSON (a NUL byte at offset " + std::to_string(nul) + ")", {}, {}, "invalid_json");
  const json j = json::parse(body, nullptr, false);
  if (j.is_discarded()) throw ApiError(400, "the request body is not valid JSON", {}, {}, "invalid_json");
  if (!j.is_object()) throw ApiError(400, "the request body must be a JSON object, not " + std::string(j.type_name()));
  ApiRequest r;
  r.endpoint = endpoint;
  r.model = model_ids.front();
  if (const json* m = field(j, "model")) {
    if (!m->is_string()) throw bad("model", "expected a string, got " + std::string(m->type_name()));
    const std::string name = m->get<std::string>();
    if (std::find(model_ids.begin(), model_ids.end(), name) == model_ids.end())
      throw ApiError(404, "The model `" + name + "` does not exist; this server serves `" + model_ids.front() + "`", "model", {},
                     "model_not_found");
    r.model = name;
  }
  if (const auto n = integer(j, "n", 1, 128); n && *n != 1) throw bad("n", "only n = 1 is supported");
  if (endpoint == Endpoint::kChat) {
    r.generate.set_chat_json(chat_json_of(j));
    r.has_tools = offers_tools(j);
  } else {
    set_prompt(j, r.generate);
  }
  set_sampling(j, r);
  r.stream = boolean(j, "stream").value_or(false);
  // llama-server's extension: "cache_prompt": false prefills the whole prompt afresh.
  if (!boolean(j, "cache_prompt").value_or(true)) r.generate.set_no_prompt_cache(true);
  if (const json* so = field(j, "stream_options")) {
    if (!so->is_object()) throw bad("stream_options", "expected an object");
    r.include_usage = boolean(*so, "include_usage").value_or(false);
  }
  return r;
}

std::string finish_reason(generate::FinishReason f) {
  switch (f) {
    case generate::FINISH_STOP: return "stop";
    case generate::FINISH_LENGTH: return "length";
    default: return "";
  }
}

json usage_json(const generate::GenerateTiming& t) {
  return {{"prompt_tokens", t.prompt_tokens()},
          {"completion_tokens", t.generated_tokens()},
          {"total_tokens", t.prompt_tokens() + t.generated_tokens()},
          {"prompt_tokens_details", {{"cached_tokens", t.cached_tokens()}}}};
}

json response_json(const ApiRequest& r, const std::string& id, int64_t created, const Generated& g) {
  json choice = {{"index", 0}};
  if (r.endpoint == Endpoint::kChat) {
    choice["message"] = chat_message_json(r.output, g.text);
    choice["finish_reason"] = finish_json(g.finish, choice["message"].contains("tool_calls"));
    choice["logprobs"] = r.logprobs ? chat_logprobs(g.logprobs) : json(nullptr);
  } else {
    choice["text"] = g.text;
    choice["finish_reason"] = finish_json(g.finish);
    choice["logprobs"] = r.logprobs ? completion_logprobs(g.logprobs, 0) : json(nullptr);
  }
  return {{"id", id},
          {"object", r.endpoint == Endpoint::kChat ? "chat.completion" : "text_completion"},
          {"created", created},
          {"model", r.model},
          {"choices", json::array({choice})},
          {"usage", usage_json(g.timing)}};
}

ChunkStream::ChunkStream(const ApiRequest& r, std::string id, int64_t created)
    : r_(r), id_(std::move(id)), created_(created), deltas_(r.endpoint == Endpoint::kChat ? r.output : ChatOutputFormat{}) {}

json ChunkStream::chunk(const std::string& text, const std::vector<generate::TokenLogprob>& logprobs,
                        generate::FinishReason finish) {
  const bool finished = finish != generate::FINISH_REASON_UNSPECIFIED;
  json choice = {{"index", 0}};
  if (r_.endpoint == Endpoint::kChat) {
    json delta = deltas_.add(text, finished);
    if (delta.empty() && logprobs.empty() && !first_ && !finished) return nullptr;
    if (first_) {
      delta["role"] = "assistant";
      if (!delta.contains("content")) delta["content"] = "";
    }
    choice["delta"] = std::move(delta);
    choice["logprobs"] = r_.logprobs && !logprobs.empty() ? chat_logprobs(logprobs) : json(nullptr);
    choice["finish_reason"] = finish_json(finish, deltas_.any_tool_calls());
  } else {
    if (text.empty() && logprobs.empty() && !first_ && !finished) return nullptr;
    choice["text"] = text;
    choice["logprobs"] = r_.logprobs && !logprobs.empty() ? completion_logprobs(logprobs, 0) : json(nullptr);
    choice["finish_reason"] = finish_json(finish);
  }
  first_ = false;
  json c = {{"id", id_},
            {"object", r_.endpoint == Endpoint::kChat ? "chat.completion.chunk" : "text_completion"},
            {"created", created_},
            {"model", r_.model},
            {"choices", json::array({choice})}};
  if (r_.include_usage) c["usage"] = nullptr;
  return c;
}

json stream_usage_json(const ApiRequest& r, const std::string& id, int64_t created, const generate::GenerateTiming& t) {
  return {{"id", id},
          {"object", r.endpoint == Endpoint::kChat ? "chat.completion.chunk" : "text_completion"},
          {"created", created},
          {"model", r.model},
          {"choices", json::array()},
          {"usage", usage_json(t)}};
}

}  // namespace moraine::server
