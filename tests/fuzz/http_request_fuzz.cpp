// libFuzzer target: the server's request parsing, a chat/completions or completions body to the
// coordinator's GenerateRequest (server/openai_api.h), without a group. The first byte picks the
// endpoint and the tool-call format of the reply; the rest is the body. A body is accepted or
// refused with an ApiError (400 or 404, an OpenAI error object with a message); anything else
// thrown aborts. An accepted chat body's conversation must be JSON again. The body's bytes then
// stand in for generated text: the whole response and the streamed chunks are built (the tool-call
// and reasoning parsers) and serialised as the server does.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/openai_api.h"

namespace {

using moraine::server::ApiError;
using moraine::server::ApiRequest;
using moraine::server::Endpoint;
using nlohmann::json;

[[noreturn]] void fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "http_request_fuzz: %s: %s\n", what, detail.c_str());
  std::abort();
}

std::string serialise(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void respond(const ApiRequest& r, const std::string& text) {
  moraine::server::Generated g;
  g.text = text;
  g.finish = moraine::generate::FINISH_STOP;
  (void)serialise(moraine::server::response_json(r, "id", 1, g));
  moraine::server::ChunkStream stream(r, "id", 1);
  // Pieces of 1..7 bytes, as tokens arrive: markers and UTF-8 characters split across pieces.
  for (size_t at = 0; at < text.size();) {
    const size_t n = std::min<size_t>(1 + (static_cast<unsigned char>(text[at]) % 7), text.size() - at);
    const json c = stream.chunk(text.substr(at, n), {}, moraine::generate::FINISH_REASON_UNSPECIFIED);
    if (!c.is_null()) (void)serialise(c);
    at += n;
  }
  (void)serialise(stream.chunk("", {}, moraine::generate::FINISH_STOP));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const Endpoint endpoint = data[0] & 1 ? Endpoint::kCompletions : Endpoint::kChat;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  ApiRequest r;
  try {
    r = moraine::server::parse_request(body, endpoint, {"moraine", "other-name"});
  } catch (const ApiError& e) {
    if (e.status != 400 && e.status != 404) fail("unexpected status", std::to_string(e.status));
    const json b = e.body();
    if (!b.contains("error") || !b["error"]["message"].is_string() || b["error"]["message"].get<std::string>().empty())
      fail("error body without a message", serialise(b));
    return 0;
  } catch (const std::exception& e) {
    fail("parse_request threw something other than ApiError", e.what());
  }
  if (endpoint == Endpoint::kChat && json::parse(r.generate.chat_json(), nullptr, false).is_discarded())
    fail("chat_json is not JSON", r.generate.chat_json());
  static const moraine::chat::ToolCallFormat kFormats[] = {moraine::chat::ToolCallFormat::kNone, moraine::chat::ToolCallFormat::kQwen,
                                                           moraine::chat::ToolCallFormat::kHarmony};
  r.output.format = kFormats[(data[0] >> 1) % 3];
  r.output.reasoning_open = data[0] & 0x08;
  try {
    respond(r, body);
  } catch (const std::exception& e) {
    fail("building the response threw", e.what());
  }
  return 0;
}
