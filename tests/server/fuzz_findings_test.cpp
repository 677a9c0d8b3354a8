// What the libFuzzer targets found (tests/fuzz), each replayed as a plain test so that it stays
// fixed without a clang build: the input that failed and what must happen instead.
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "server/chat_output.h"
#include "server/openai_api.h"

namespace moraine::server {
namespace {

using nlohmann::json;

// http_request_fuzz: generated text that is not UTF-8 (a model's byte tokens) made the whole
// response of a tool-call-format request throw json type_error 316 (a strict dump()); the
// server's own serialisation replaces such bytes, so must this.
TEST(FuzzFindings, ResponseWithInvalidUtf8TextInEveryFormat) {
  ApiRequest r = parse_request(R"({"messages": [{"role": "user", "content": "hi"}]})", Endpoint::kChat, {"m"});
  const std::string text = "<|channel|>final<|message|>ok \xfc\x80 <tool_call>{\"name\": \"f\xfc\"}</tool_call> \xc3";
  for (chat::ToolCallFormat f : {chat::ToolCallFormat::kNone, chat::ToolCallFormat::kQwen, chat::ToolCallFormat::kHarmony}) {
    r.output.format = f;
    Generated g;
    g.text = text;
    g.finish = generate::FINISH_STOP;
    json j;
    ASSERT_NO_THROW(j = response_json(r, "id", 1, g)) << "format " << static_cast<int>(f);
    const std::string out = j.dump(-1, ' ', false, json::error_handler_t::replace);
    EXPECT_NE(out.find("ok"), std::string::npos) << out;
    ChunkStream stream(r, "id", 1);
    for (char c : text) ASSERT_NO_THROW((void)stream.chunk(std::string(1, c), {}, generate::FINISH_REASON_UNSPECIFIED));
    ASSERT_NO_THROW((void)stream.chunk("", {}, generate::FINISH_STOP));
  }
}

// http_request_fuzz: nlohmann's reader takes a NUL byte for the end of input, so a body with
// anything after one was accepted as the JSON before it.
TEST(FuzzFindings, BodyWithANulByteIsRefused) {
  const std::string body = std::string(R"({"messages": [{"role": "user", "content": "hi"}]})") + '\0' + "{\"junk\": [";
  try {
    (void)parse_request(body, Endpoint::kChat, {"m"});
    FAIL() << "accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_NE(std::string(e.what()).find("NUL byte at offset 49"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)parse_request(std::string("{}\0", 3), Endpoint::kCompletions, {"m"}), ApiError);
}

}  // namespace
}  // namespace moraine::server
