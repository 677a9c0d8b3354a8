// Chat requests through the group: the coordinator renders the conversation with the built-in
// ChatML template and generates exactly what the reference executor generates from that
// rendering's tokens; a conversation the template cannot render is refused with
// INVALID_ARGUMENT naming the message, and the group keeps serving.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "common/chat/chat_template.h"
#include "common/gguf/gguf.h"

#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "coordinator/group_layout.h"
#include "proto/generate.grpc.pb.h"
#include "tests/group/group_harness.h"

namespace moraine::group_test {
namespace {

struct ChatReply {
  std::vector<int32_t> ids;
  uint32_t prompt_tokens = 0;
  grpc::Status status;
};

ChatReply chat(const std::string& socket_dir, const std::vector<std::pair<std::string, std::string>>& conv, int n) {
  auto stub = generate::Coordinator::NewStub(
      grpc::CreateChannel(group::control_address(socket_dir, group::kCoordinatorInstance), grpc::InsecureChannelCredentials()));
  generate::GenerateRequest req;
  for (const auto& [role, content] : conv) {
    generate::ChatMessage* m = req.mutable_messages()->add_messages();
    m->set_role(role);
    m->set_content(content);
  }
  req.mutable_sampling()->set_max_tokens(static_cast<uint32_t>(n));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto reader = stub->Generate(&ctx, req);
  ChatReply r;
  generate::GenerateChunk chunk;
  while (reader->Read(&chunk)) {
    for (uint32_t id : chunk.token_ids()) r.ids.push_back(static_cast<int32_t>(id));
    if (chunk.has_timing()) r.prompt_tokens = chunk.timing().prompt_tokens();
  }
  r.status = reader->Finish();
  return r;
}

TEST(GroupChat, MessagesAreRenderedWithTheChatTemplateAndGenerateAsTheReference) {
  const std::string dir = temp_dir("model");
  const std::string model = convert_golden("qwen3moe_k256", "", dir);
  const std::vector<std::pair<std::string, std::string>> conv = {
      {"system", "You carry stones."}, {"user", "Where does the glacier go?"}};
  std::vector<tokenizer::ChatMessage> messages;
  for (const auto& [role, content] : conv) messages.push_back({role, content, {}});
  const std::string rendered = tokenizer::render_qwen_chatml(messages);
  ASSERT_NE(rendered.find("<|im_start|>assistant\n"), std::string::npos) << rendered;
  const tokenizer::Tokenizer tok = tokenizer::Tokenizer::from_gguf_path(model);
  const std::vector<int32_t> prompt = tok.encode(rendered, false, true);
  // The template's markers must be single control tokens, not spelled out in pieces.
  const std::vector<int32_t> im_start = tok.encode("<|im_start|>", false, true);
  ASSERT_EQ(im_start.size(), 1u);
  EXPECT_EQ(std::count(prompt.begin(), prompt.end(), im_start[0]), 3);
  constexpr int kTokens = 8;
  const ReferenceRun ref = reference_greedy(model, prompt, kTokens);

  GroupOptions o;
  o.model = model;
  Group g(o);
  const ChatReply r = chat(g.socket_dir(), conv, kTokens);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.prompt_tokens, prompt.size());
  EXPECT_EQ(r.ids, ref.ids);

  const ChatReply bad = chat(g.socket_dir(), {{"user", "hi"}, {"narrator", "meanwhile"}}, kTokens);
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad.status.error_message().find("narrator"), std::string::npos) << bad.status.error_message();
  const ChatReply empty = chat(g.socket_dir(), {}, kTokens);
  EXPECT_EQ(empty.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Still serving after the refusals.
  const ChatReply again = chat(g.socket_dir(), conv, kTokens);
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(again.ids, ref.ids);
}

// A tools conversation as chat_json through the GGUF's own template (chat_template.jinja beside the
// golden model, which moraine-convert stores as tokenizer.chat_template): the prompt is that
// template's rendering (chat/chat_template.h, checked against python3-jinja2 in tests/chat).
TEST(GroupChat, ChatJsonIsRenderedWithTheGgufTemplate) {
  const std::string dir = temp_dir("model-template");
  const std::filesystem::path src = std::filesystem::path(MORAINE_SOURCE_DIR) / "tests" / "golden" / "qwen3moe_k256";
  const std::filesystem::path golden = std::filesystem::path(dir) / "golden";
  std::filesystem::create_directories(golden);
  for (const auto& e : std::filesystem::directory_iterator(src)) std::filesystem::copy_file(e.path(), golden / e.path().filename());
  const std::string tmpl =
      "{%- if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
      "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content if m.content is string else '' }}"
      "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
      "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
      "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
  std::ofstream(golden / "chat_template.jinja") << tmpl;
  const std::string model = dir + "/templated.gguf";
  const std::string cmd = std::string(MORAINE_BUILD_DIR) + "/tools/moraine-convert " + golden.string() + " " + model + " --outtype f32";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  ASSERT_EQ(gguf::GgufFile::open(model).get_string("tokenizer.chat_template").value_or(""), tmpl);
  const nlohmann::ordered_json chat = nlohmann::ordered_json::parse(R"({
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
                 {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                   "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "-3C"}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]})");
  const std::string rendered = chat::ChatTemplate(tmpl, "", "").render(chat);
  ASSERT_NE(rendered.find("\"arguments\": {\"city\": \"Oslo\"}}"), std::string::npos) << rendered;
  const tokenizer::Tokenizer tok = tokenizer::Tokenizer::from_gguf_path(model);
  const std::vector<int32_t> prompt = tok.encode(rendered, false, true);
  constexpr int kTokens = 6;
  const ReferenceRun ref = reference_greedy(model, prompt, kTokens);

  GroupOptions o;
  o.model = model;
  Group g(o);
  auto stub = generate::Coordinator::NewStub(grpc::CreateChannel(
      group::control_address(g.socket_dir(), group::kCoordinatorInstance), grpc::InsecureChannelCredentials()));
  generate::GenerateRequest req;
  req.set_chat_json(chat.dump());
  req.mutable_sampling()->set_max_tokens(kTokens);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto reader = stub->Generate(&ctx, req);
  std::vector<int32_t> ids;
  uint32_t prompt_tokens = 0;
  generate::GenerateChunk chunk;
  while (reader->Read(&chunk)) {
    for (uint32_t id : chunk.token_ids()) ids.push_back(static_cast<int32_t>(id));
    if (chunk.has_timing()) prompt_tokens = chunk.timing().prompt_tokens();
  }
  const grpc::Status st = reader->Finish();
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(prompt_tokens, prompt.size());
  EXPECT_EQ(ids, ref.ids);
}

}  // namespace
}  // namespace moraine::group_test
