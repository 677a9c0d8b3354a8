// Every chat template under .cache/oracle/llama.cpp/models/templates rendered by moraine's Jinja
// engine and by python3-jinja2 in Hugging Face's environment (render_oracle.py, run here) on the
// conversations of conversations.json: the texts must be identical; where python3-jinja2 fails
// (a template refusing a conversation), moraine must fail too, with raise_exception's message.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "common/chat/chat_template.h"
#include "common/gguf/gguf.h"
#include "common/tokenizer/tokenizer.h"
#include "common/jinja/template.h"

namespace {

using ojson = nlohmann::ordered_json;
namespace fs = std::filesystem;

constexpr std::time_t kNow = 1767225600;  // 2026-01-01: strftime_now in both engines

const std::string kSource = MORAINE_SOURCE_DIR;
const std::string kTemplates = kSource + "/.cache/oracle/llama.cpp/models/templates";

// The templates the engine must render (issue 27): the models moraine serves first.
const char* const kRequired[] = {
    "Qwen-Qwen3-0.6B", "Qwen3-Coder", "Qwen3.5-4B", "Qwen-Qwen2.5-7B-Instruct", "Qwen-QwQ-32B",
    "openai-gpt-oss-120b", "GLM-4.6", "GLM-4.7-Flash", "deepseek-ai-DeepSeek-V3.1",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "llama-cpp-deepseek-r1", "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct", "meta-llama-Llama-3.3-70B-Instruct", "Mistral-Small-3.2-24B-Instruct-2506",
    "mistralai-Mistral-Nemo-Instruct-2407"};

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Runs render_oracle.py on the cases; returns one expected string per case.
std::vector<std::string> python_render(const ojson& cases, const std::string& tag) {
  const std::string dir = std::string(MORAINE_BUILD_DIR) + "/tests/chat/oracle-" + tag;
  fs::create_directories(dir);
  const std::string in = dir + "/cases.json", out = dir + "/expected.json";
  std::ofstream(in) << cases.dump();
  fs::remove(out);
  const std::string cmd = "python3 " + kSource + "/tests/chat/render_oracle.py " + in + " " + out;
  const int status = std::system(cmd.c_str());
  EXPECT_EQ(status, 0) << cmd << " failed: is python3-jinja2 installed (deploy/setup --for test)?";
  const ojson exp = ojson::parse(read_file(out), nullptr, false);
  if (!exp.is_array() || exp.size() != cases.size()) {
    ADD_FAILURE() << "render_oracle.py gave no usable output in " << out;
    return {};
  }
  std::vector<std::string> v;
  for (const ojson& e : exp) v.push_back(e.get<std::string>());
  return v;
}

ojson conversations() {
  ojson all = ojson::parse(read_file(kSource + "/tests/chat/conversations.json"));
  all.erase("_comment");
  return all;
}

// Compares one case; python's failures must be ours too. True when it matched.
bool expect_same(const std::string& expected, const std::function<std::string()>& render, const std::string& what) {
  std::string got, error;
  try {
    got = render();
  } catch (const moraine::jinja::TemplateError& e) {
    error = e.what();
  }
  const std::string raised = "ERROR: TemplateError: ";
  if (expected.rfind("ERROR: ", 0) == 0) {
    bool ok = !error.empty() && error.find("template line ") != std::string::npos;
    if (expected.rfind(raised, 0) == 0) ok = ok && error.find(expected.substr(raised.size())) != std::string::npos;
    EXPECT_TRUE(ok) << what << ": python3-jinja2 failed (" << expected << "); moraine: "
                    << (error.empty() ? "rendered\n" + got : error);
    return ok;
  }
  if (!error.empty()) {
    ADD_FAILURE() << what << ": " << error;
    return false;
  }
  if (got == expected) return true;
  size_t i = 0;
  while (i < got.size() && i < expected.size() && got[i] == expected[i]) ++i;
  ADD_FAILURE() << what << ": differs at byte " << i << "\nexpected: " << expected.substr(i > 80 ? i - 80 : 0, 200)
                << "\n     got: " << got.substr(i > 80 ? i - 80 : 0, 200);
  return false;
}

TEST(ChatTemplateOracle, EveryTemplateRendersLikePythonJinja2) {
  ASSERT_TRUE(fs::is_directory(kTemplates)) << kTemplates << " missing (run tests/oracle/setup)";
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(kTemplates))
    if (e.path().extension() == ".jinja") names.insert(e.path().stem().string());
  for (const char* r : kRequired) EXPECT_TRUE(names.count(r)) << r << ".jinja missing";
  ASSERT_GE(names.size(), 16u);
  const ojson convs = conversations();
  ojson cases = ojson::array();
  std::vector<std::string> labels;
  for (const std::string& n : names) {
    for (auto it = convs.begin(); it != convs.end(); ++it) {
      cases.push_back({{"template", kTemplates + "/" + n + ".jinja"}, {"context", it.value()}, {"now", kNow}});
      labels.push_back(n + " / " + it.key());
    }
  }
  const std::vector<std::string> expected = python_render(cases, "templates");
  ASSERT_EQ(expected.size(), cases.size());
  moraine::jinja::RenderOptions opt;
  opt.now = kNow;
  size_t ok = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string src = read_file(cases[i]["template"].get<std::string>());
    const ojson& ctx = cases[i]["context"];
    ok += expect_same(expected[i], [&] { return moraine::jinja::Template(src).render(ctx, opt); }, labels[i]);
  }
  std::cout << ok << " of " << cases.size() << " template renders match python3-jinja2 (" << names.size()
            << " templates)\n";
}

// The chat API on an OpenAI request (arguments as a JSON string, content as text parts) gives what
// python3-jinja2 renders from the equivalent context (arguments as a mapping, content a string).
TEST(ChatTemplateOracle, OpenAiConversationRendersLikeHuggingFace) {
  const ojson convs = conversations();
  const char* names[] = {"Qwen-Qwen3-0.6B", "openai-gpt-oss-120b", "meta-llama-Llama-3.1-8B-Instruct",
                         "mistralai-Mistral-Nemo-Instruct-2407", "Qwen3-Coder", "GLM-4.6"};
  ojson cases = ojson::array();
  std::vector<ojson> requests;
  for (const char* n : names) {
    for (const char* conv : {"tool_call", "reasoning", "thinking_off"}) {
      const ojson ctx = convs[conv];
      cases.push_back({{"template", kTemplates + "/" + n + ".jinja"}, {"context", ctx}, {"now", kNow}});
      ojson req = {{"messages", ojson::array()}, {"add_generation_prompt", ctx["add_generation_prompt"]}};
      if (!ctx["tools"].is_null()) req["tools"] = ctx["tools"];
      if (ctx.contains("enable_thinking")) req["chat_template_kwargs"] = {{"enable_thinking", ctx["enable_thinking"]}};
      for (ojson m : ctx["messages"]) {
        if (m.contains("tool_calls"))
          for (ojson& c : m["tool_calls"]) c["function"]["arguments"] = c["function"]["arguments"].dump();
        if (m["role"] == "user") {  // two text parts joined with "\n" give the original
          const std::string t = m["content"].get<std::string>();
          const size_t cut = t.find(' ');
          if (cut != std::string::npos)
            m["content"] = ojson::array({{{"type", "text"}, {"text", t.substr(0, cut)}}, {{"type", "text"}, {"text", t.substr(cut + 1)}}});
        }
        req["messages"].push_back(m);
      }
      requests.push_back(req);
    }
  }
  // A part boundary becomes "\n" where the original had " ": the expected context says so too.
  for (ojson& c : cases) {
    for (ojson& m : c["context"]["messages"]) {
      if (m["role"] != "user") continue;
      std::string t = m["content"].get<std::string>();
      const size_t cut = t.find(' ');
      if (cut != std::string::npos) t[cut] = '\n';
      m["content"] = t;
    }
  }
  const std::vector<std::string> expected = python_render(cases, "api");
  ASSERT_EQ(expected.size(), cases.size());
  moraine::jinja::RenderOptions opt;
  opt.now = kNow;
  for (size_t i = 0; i < cases.size(); ++i) {
    const moraine::chat::ChatTemplate t(read_file(cases[i]["template"].get<std::string>()), "<s>", "</s>");
    EXPECT_TRUE(t.object_arguments()) << cases[i]["template"];
    expect_same(expected[i], [&] { return t.render(requests[i], opt); }, cases[i]["template"].get<std::string>());
  }
}

// The real templates inside GGUF files (the oracle's Qwen2.5 and Qwen3.5 vocabularies): loaded
// with from_gguf, BOS/EOS from the vocabulary, every conversation as python3-jinja2 renders it.
TEST(ChatTemplateOracle, GgufTemplatesRenderLikePythonJinja2) {
  const ojson convs = conversations();
  ojson cases = ojson::array();
  std::vector<std::pair<std::shared_ptr<moraine::chat::ChatTemplate>, ojson>> ours;
  for (const char* vocab : {"qwen2", "qwen35"}) {
    const std::string path = kSource + "/.cache/oracle/llama.cpp/models/ggml-vocab-" + std::string(vocab) + ".gguf";
    ASSERT_TRUE(fs::exists(path)) << path << " missing (run tests/oracle/setup)";
    const moraine::gguf::GgufFile f = moraine::gguf::GgufFile::open(path);
    const moraine::tokenizer::Tokenizer tok = moraine::tokenizer::Tokenizer::from_gguf(f);
    std::string warning;
    std::optional<moraine::chat::ChatTemplate> t = moraine::chat::ChatTemplate::from_gguf(f, tok, &warning);
    ASSERT_TRUE(t.has_value()) << path << ": " << warning;
    auto shared = std::make_shared<moraine::chat::ChatTemplate>(std::move(*t));
    const std::string src = std::string(MORAINE_BUILD_DIR) + "/tests/chat/gguf-template-" + vocab + ".jinja";
    std::ofstream(src, std::ios::binary) << shared->source();
    const std::string bos = tok.bos() ? tok.token_bytes(*tok.bos(), true) : "";
    const std::string eos = tok.eos() ? tok.token_bytes(*tok.eos(), true) : "";
    for (auto it = convs.begin(); it != convs.end(); ++it) {
      ojson ctx = it.value();
      ctx["bos_token"] = bos;
      ctx["eos_token"] = eos;
      cases.push_back({{"template", src}, {"context", ctx}, {"now", kNow}});
      ojson req = {{"messages", ctx["messages"]}, {"tools", ctx["tools"]}, {"add_generation_prompt", ctx["add_generation_prompt"]}};
      if (ctx.contains("enable_thinking")) req["chat_template_kwargs"] = {{"enable_thinking", ctx["enable_thinking"]}};
      ours.emplace_back(shared, req);
    }
  }
  const std::vector<std::string> expected = python_render(cases, "gguf");
  ASSERT_EQ(expected.size(), cases.size());
  moraine::jinja::RenderOptions opt;
  opt.now = kNow;
  for (size_t i = 0; i < cases.size(); ++i)
    expect_same(expected[i], [&] { return ours[i].first->render(ours[i].second, opt); }, cases[i]["template"].get<std::string>());
}

}  // namespace
