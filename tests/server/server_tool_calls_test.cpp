// The chat response of a request with `tools`, built by the functions the HTTP handler uses
// (server/openai_api.h, server/chat_output.h): generated text with Qwen3's <tool_call> markup
// becomes message.tool_calls (whole) or delta.tool_calls (streamed, split at every byte), with
// content free of markup and finish_reason "tool_calls". The model's output is given here: the
// test models write random text, so a tool call in it would not be deterministic.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <iterator>

#include <fstream>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/chat/chat_template.h"
#include "server/chat_output.h"
#include "server/openai_api.h"

namespace moraine::server {
namespace {

using nlohmann::json;

const std::string kToolCall = R"(<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>)";

ApiRequest tools_request(bool stream) {
  const json body = {{"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}},
                     {"tools", {{{"type", "function"},
                                 {"function", {{"name", "get_weather"}, {"parameters", {{"type", "object"}}}}}}}},
                     {"stream", stream}};
  ApiRequest r = parse_request(body.dump(), Endpoint::kChat, {"m"});
  EXPECT_TRUE(r.has_tools);
  r.output.format = chat::ToolCallFormat::kQwen;
  r.output.id_prefix = "call_req1_";
  return r;
}

Generated generated(const std::string& text, generate::FinishReason f = generate::FINISH_STOP) {
  Generated g;
  g.text = text;
  g.finish = f;
  return g;
}

// What an OpenAI client assembles from a stream: content, reasoning, tool calls by index
// (arguments concatenated), the finish reason; checks each chunk's shape on the way.
struct Assembled {
  std::string content, reasoning;
  json tool_calls = json::array();
  json finish;
  size_t chunks = 0;
};

void add_chunk(Assembled& a, const json& c) {
  ASSERT_EQ(c["object"], "chat.completion.chunk");
  ASSERT_EQ(c["choices"].size(), 1u);
  const json& ch = c["choices"][0];
  const json& d = ch["delta"];
  if (a.chunks++ == 0) {
    EXPECT_EQ(d.value("role", ""), "assistant") << c.dump();
  }
  if (d.contains("content")) a.content += d["content"].get<std::string>();
  if (d.contains("reasoning_content")) a.reasoning += d["reasoning_content"].get<std::string>();
  for (const json& t : d.value("tool_calls", json::array())) {
    const size_t i = t["index"].get<size_t>();
    if (i == a.tool_calls.size()) {   // a new call: its first delta names it
      ASSERT_TRUE(t["id"].is_string() && t["type"] == "function" && t["function"]["name"].is_string()) << t.dump();
      a.tool_calls.push_back({{"id", t["id"]}, {"type", "function"},
                              {"function", {{"name", t["function"]["name"]}, {"arguments", ""}}}});
    }
    ASSERT_LT(i, a.tool_calls.size()) << t.dump();
    a.tool_calls[i]["function"]["arguments"] =
        a.tool_calls[i]["function"]["arguments"].get<std::string>() + t["function"].value("arguments", "");
  }
  if (!ch["finish_reason"].is_null()) {
    EXPECT_TRUE(a.finish.is_null()) << "two finish reasons";
    a.finish = ch["finish_reason"];
  }
}

Assembled stream_pieces(const ApiRequest& r, const std::vector<std::string>& pieces, generate::FinishReason f) {
  ChunkStream s(r, "chatcmpl-1", 7);
  Assembled a;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const json c = s.chunk(pieces[i], {}, i + 1 == pieces.size() ? f : generate::FINISH_REASON_UNSPECIFIED);
    if (!c.is_null()) add_chunk(a, c);
    // No markup reaches the client, however the text is split.
    EXPECT_EQ(a.content.find('<'), std::string::npos) << "piece " << i << ": " << a.content;
  }
  return a;
}

// The whole response and every streamed split of `text` agree with `expected` (message).
void expect_whole_and_streamed(const std::string& text, const json& expected_message, const std::string& finish) {
  const ApiRequest whole = tools_request(false);
  const json resp = response_json(whole, "chatcmpl-1", 7, generated(text));
  const json& choice = resp["choices"][0];
  EXPECT_EQ(choice["message"], expected_message) << resp.dump(1);
  EXPECT_EQ(choice["finish_reason"], finish);

  const ApiRequest streamed = tools_request(true);
  const json& m = expected_message;
  const auto check = [&](const Assembled& a, const std::string& how) {
    EXPECT_EQ(a.content, m["content"].is_null() ? "" : m["content"].get<std::string>()) << how;
    EXPECT_EQ(a.reasoning, m.value("reasoning_content", "")) << how;
    EXPECT_EQ(a.tool_calls, m.value("tool_calls", json::array())) << how;
    EXPECT_EQ(a.finish, finish) << how;
  };
  for (size_t cut = 0; cut <= text.size(); ++cut)
    check(stream_pieces(streamed, {text.substr(0, cut), text.substr(cut)}, generate::FINISH_STOP), "cut at " + std::to_string(cut));
  std::vector<std::string> bytes;
  for (char c : text) bytes.emplace_back(1, c);
  bytes.emplace_back();   // the finish chunk comes with no text
  check(stream_pieces(streamed, bytes, generate::FINISH_STOP), "byte by byte");
}

json call(const std::string& id, const std::string& name, const json& args) {
  return {{"id", id}, {"type", "function"}, {"function", {{"name", name}, {"arguments", args.dump()}}}};
}

TEST(ServerToolCalls, OnlyAToolCall) {
  const json m = {{"role", "assistant"}, {"content", nullptr},
                  {"tool_calls", {call("call_req1_0", "get_weather", {{"city", "Paris"}})}}};
  expect_whole_and_streamed(kToolCall, m, "tool_calls");
  // The arguments are a JSON text of the model's object.
  const json resp = response_json(tools_request(false), "x", 0, generated(kToolCall));
  EXPECT_EQ(json::parse(resp["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            json({{"city", "Paris"}}));
}

TEST(ServerToolCalls, TextReasoningAndTwoCalls) {
  const std::string text = "<think>\nThe user wants weather.\n</think>\n\nLet me look.\n" + kToolCall +
                           "\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}\n</tool_call>";
  const json m = {{"role", "assistant"}, {"content", "Let me look.\n"}, {"reasoning_content", "The user wants weather."},
                  {"tool_calls", {call("call_req1_0", "get_weather", {{"city", "Paris"}}),
                                  call("call_req1_1", "get_time", {{"tz", "CET"}})}}};
  expect_whole_and_streamed(text, m, "tool_calls");
}

TEST(ServerToolCalls, PlainTextAndBrokenCallStayContent) {
  expect_whole_and_streamed("It is sunny in Paris.", {{"role", "assistant"}, {"content", "It is sunny in Paris."}}, "stop");
  // Not JSON inside the markers: the model's text, not a call.
  const ApiRequest r = tools_request(false);
  const json resp = response_json(r, "x", 0, generated("<tool_call>not json</tool_call>"));
  EXPECT_FALSE(resp["choices"][0]["message"].contains("tool_calls")) << resp.dump();
  EXPECT_EQ(resp["choices"][0]["finish_reason"], "stop");
}

TEST(ServerToolCalls, CutByMaxTokensIsLength) {
  const json resp = response_json(tools_request(false), "x", 0, generated(kToolCall, generate::FINISH_LENGTH));
  EXPECT_EQ(resp["choices"][0]["finish_reason"], "length");
}

TEST(ServerToolCalls, WithoutToolsTheTextIsContentVerbatim) {
  const json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  const ApiRequest r = parse_request(body.dump(), Endpoint::kChat, {"m"});
  EXPECT_FALSE(r.has_tools);
  const json resp = response_json(r, "x", 0, generated(kToolCall));
  EXPECT_EQ(resp["choices"][0]["message"], json({{"role", "assistant"}, {"content", kToolCall}}));
  EXPECT_EQ(resp["choices"][0]["finish_reason"], "stop");
  ChunkStream s(r, "x", 0);
  const json c = s.chunk(kToolCall.substr(0, 5), {}, generate::FINISH_REASON_UNSPECIFIED);
  EXPECT_EQ(c["choices"][0]["delta"]["content"], kToolCall.substr(0, 5));   // nothing held back
}

// The format comes from the template's source; the generation prompt decides reasoning_open.
TEST(ServerToolCalls, FormatOfTheTemplate) {
  const std::string chat = R"({"messages":[{"role":"user","content":"hi"}],"tools":[]})";
  const chat::ChatTemplate qwen(
      "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
      "{% if tools %}<tool_call>{% endif %}<|im_start|>assistant\n{% if think %}<think>\n{% endif %}", "", "");
  ChatOutputFormat f = chat_output_format(&qwen, true, chat, "call_a_");
  EXPECT_EQ(f.format, chat::ToolCallFormat::kQwen);
  EXPECT_FALSE(f.reasoning_open);
  EXPECT_EQ(f.id_prefix, "call_a_");
  f = chat_output_format(&qwen, true, R"({"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"think":true}})", "c");
  EXPECT_TRUE(f.reasoning_open);
  EXPECT_EQ(chat_output_format(&qwen, false, chat, "c").format, chat::ToolCallFormat::kNone);
  EXPECT_EQ(chat_output_format(nullptr, true, chat, "c").format, chat::ToolCallFormat::kNone);
  const chat::ChatTemplate plain("{% for m in messages %}{{ m.content }}{% endfor %}", "", "");
  EXPECT_EQ(chat_output_format(&plain, true, chat, "c").format, chat::ToolCallFormat::kNone);

  // reasoning_open: the text starts as reasoning, then the call.
  ApiRequest r = tools_request(false);
  r.output.reasoning_open = true;
  const json m = response_json(r, "x", 0, generated("weather needed\n</think>\n\n" + kToolCall))["choices"][0]["message"];
  EXPECT_EQ(m["reasoning_content"], "weather needed");
  EXPECT_TRUE(m["content"].is_null());
  EXPECT_EQ(m["tool_calls"].size(), 1u);
}

// tool_choice: "none" offers the model no tools, a named function only that one, "required" all
// (not enforced); anything else is a 400 naming the field.
TEST(ServerToolCalls, ToolChoiceDecidesTheToolsOffered) {
  const auto fn = [](const char* name) {
    return json{{"type", "function"}, {"function", {{"name", name}, {"parameters", {{"type", "object"}}}}}};
  };
  json body = {{"messages", {{{"role", "user"}, {"content", "Weather?"}}}}, {"tools", {fn("a"), fn("b")}}};
  const auto tools_of = [](const ApiRequest& r) {
    const json c = json::parse(r.generate.chat_json());
    std::vector<std::string> names;
    if (c.contains("tools"))
      for (const json& t : c["tools"]) names.push_back(t["function"]["name"]);
    return names;
  };
  ApiRequest r = parse_request(body.dump(), Endpoint::kChat, {"m"});
  EXPECT_EQ(tools_of(r), (std::vector<std::string>{"a", "b"}));
  body["tool_choice"] = "none";
  r = parse_request(body.dump(), Endpoint::kChat, {"m"});
  EXPECT_FALSE(r.has_tools);
  EXPECT_TRUE(tools_of(r).empty());
  body["tool_choice"] = "required";
  EXPECT_EQ(tools_of(parse_request(body.dump(), Endpoint::kChat, {"m"})).size(), 2u);
  body["tool_choice"] = {{"type", "function"}, {"function", {{"name", "b"}}}};
  r = parse_request(body.dump(), Endpoint::kChat, {"m"});
  EXPECT_TRUE(r.has_tools);
  EXPECT_EQ(tools_of(r), (std::vector<std::string>{"b"}));
  for (const json& badc : {json("sometimes"), json({{"type", "function"}, {"function", {{"name", "c"}}}}), json(3)}) {
    body["tool_choice"] = badc;
    try {
      parse_request(body.dump(), Endpoint::kChat, {"m"});
      ADD_FAILURE() << "tool_choice " << badc.dump() << " was accepted";
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400);
      EXPECT_EQ(e.param, "tool_choice");
    }
  }
}

// llama-server's "cache_prompt": false asks the coordinator for a prefill from a reset.
TEST(ServerRequest, CachePromptFalseAsksForAFreshPrefill) {
  json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  EXPECT_FALSE(parse_request(body.dump(), Endpoint::kChat, {"m"}).generate.no_prompt_cache());
  body["cache_prompt"] = false;
  EXPECT_TRUE(parse_request(body.dump(), Endpoint::kChat, {"m"}).generate.no_prompt_cache());
}

// gpt-oss's template (the real one, from the oracle's llama.cpp source): harmony with tools or
// without, since its analysis channel is reasoning and its final channel the content; the
// server then asks for the special tokens' text (http_server.cpp), which the parser reads.
TEST(ServerToolCalls, HarmonyTemplateSplitsChannelsWithoutTools) {
  const std::filesystem::path path =
      std::filesystem::path(MORAINE_SOURCE_DIR) / ".cache/oracle/llama.cpp/models/templates/openai-gpt-oss-120b.jinja";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "no " << path << ": run tests/oracle/setup";
  const std::string source((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const chat::ChatTemplate oss(source, "<|startoftext|>", "<|return|>");
  const std::string chat = R"({"messages":[{"role":"user","content":"hi"}]})";
  EXPECT_EQ(chat_output_format(&oss, false, chat, "c").format, chat::ToolCallFormat::kHarmony);
  EXPECT_EQ(chat_output_format(&oss, true, chat, "c").format, chat::ToolCallFormat::kHarmony);
  ApiRequest r = parse_request(json({{"messages", {{{"role", "user"}, {"content", "hi"}}}}}).dump(), Endpoint::kChat, {"m"});
  r.output = chat_output_format(&oss, false, chat, "c");
  const json m = response_json(r, "x", 0,
                               generated("<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant"
                                         "<|channel|>final<|message|>Hello!"))["choices"][0]["message"];
  EXPECT_EQ(m["reasoning_content"], "The user greets.");
  EXPECT_EQ(m["content"], "Hello!");
}

}  // namespace
}  // namespace moraine::server
