// OpenAI's HTTP API in terms of the coordinator's Generate: a request body (chat completions or
// completions) becomes a GenerateRequest, checked field by field with errors that name the
// field; generated chunks become OpenAI's response objects (whole, or streamed chunk by chunk).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "proto/generate.pb.h"
#include "server/chat_output.h"

namespace moraine::server {

// An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
struct ApiError : std::runtime_error {
  ApiError(int status, const std::string& message, std::string param = {}, std::string type = {}, std::string code = {});
  int status;
  std::string param, type, code;
  int retry_after_s = 0;       // > 0: the response's Retry-After header (a 429 or 503 worth retrying)
  nlohmann::json body() const;
};

enum class Endpoint { kChat, kCompletions };

struct ApiRequest {
  Endpoint endpoint = Endpoint::kChat;
  generate::GenerateRequest generate;
  std::string model;           // as the client named it (the served id when it named none)
  bool stream = false, include_usage = false;
  bool logprobs = false;       // the response carries log-probabilities
  uint32_t top_logprobs = 0;
  bool has_tools = false;      // chat: a non-empty `tools` array
  ChatOutputFormat output;     // chat: how the text splits into content / reasoning / tool calls (set by the server)
};

// model_ids: the names the served model answers to (the first is the one reported).
// Throws ApiError (400 for a malformed body or field, 404 for another model).
ApiRequest parse_request(const std::string& body, Endpoint endpoint, const std::vector<std::string>& model_ids);

// What a finished (or streamed so far) generation adds up to.
struct Generated {
  std::string text;
  std::vector<generate::TokenLogprob> logprobs;
  generate::FinishReason finish = generate::FINISH_REASON_UNSPECIFIED;
  generate::GenerateTiming timing;
};

std::string finish_reason(generate::FinishReason f);   // "stop", "length" (or null for none)
nlohmann::json usage_json(const generate::GenerateTiming& t);
// The whole response of a non-streaming request (chat: the message split by r.output; finish
// "tool_calls" when the model stopped after calling tools).
nlohmann::json response_json(const ApiRequest& r, const std::string& id, int64_t created, const Generated& g);

// A streamed response's chunks, one generated piece at a time: the first chunk carries the
// chat's assistant role, a finish reason ends the choice; chat text that may begin a tool-call
// marker waits for the next piece (r.output).
class ChunkStream {
 public:
  ChunkStream(const ApiRequest& r, std::string id, int64_t created);
  // The chunk for a piece, or null when there is nothing to send yet.
  nlohmann::json chunk(const std::string& text, const std::vector<generate::TokenLogprob>& logprobs,
                       generate::FinishReason finish);

 private:
  const ApiRequest& r_;
  std::string id_;
  int64_t created_;
  bool first_ = true;
  ChatDeltaBuilder deltas_;
};
// The include_usage chunk after the last one: no choices, the usage.
nlohmann::json stream_usage_json(const ApiRequest& r, const std::string& id, int64_t created,
                                 const generate::GenerateTiming& t);

}  // namespace moraine::server
