// `moraine serve` end to end on a small test model (CPU backend): the official openai npm client
// (openai_client_test.cjs), malformed requests answered with the right status and OpenAI's error
// JSON, a client that disconnects cancelling its request, and SIGTERM stopping every process and
// removing the shared memory. One server for the suite. (Load: serve_load_test; faults of every
// process: serve_fault_test.)
#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <grpcpp/grpcpp.h>

#include "coordinator/group_layout.h"
#include "coordinator/process_util.h"
#include "proto/control.grpc.pb.h"
#include "tests/group/group_harness.h"
#include "tests/server/serve_process.h"

namespace moraine::server_test {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using group_test::shell_quote;
using serve_test::launch_serve;
using serve_test::ServeProcess;
const fs::path kBuild = MORAINE_BUILD_DIR;
const fs::path kSource = MORAINE_SOURCE_DIR;
const std::string kKey = "test-key-123";

ServeProcess* g_serve = nullptr;

httplib::Client client() {
  httplib::Client c("127.0.0.1", g_serve->port);
  c.set_read_timeout(120, 0);
  c.set_default_headers({{"Authorization", "Bearer " + kKey}});
  return c;
}

struct Answer {
  int status = -1;
  json body;
};
Answer post(const std::string& path, const std::string& body, httplib::Client& c) {
  const auto r = c.Post(path.c_str(), body, "application/json");
  if (!r) return {};
  return {r->status, json::parse(r->body, nullptr, false)};
}
Answer post(const std::string& path, const json& body) {
  httplib::Client c = client();
  return post(path, body.dump(), c);
}

json chat(const std::string& content, int max_tokens = 4) {
  return {{"messages", {{{"role", "user"}, {"content", content}}}}, {"max_tokens", max_tokens}, {"temperature", 0},
          {"ignore_eos", true}};
}

// The error's shape: {"error": {"message", "type", "param", "code"}}; param as given (or null).
void expect_error(const Answer& a, int status, const std::string& param, const std::string& message_part) {
  EXPECT_EQ(a.status, status) << a.body.dump();
  ASSERT_TRUE(a.body.is_object() && a.body.contains("error")) << a.body.dump();
  const json& e = a.body["error"];
  EXPECT_TRUE(e["message"].is_string());
  EXPECT_TRUE(e["type"].is_string());
  EXPECT_TRUE(e.contains("code"));
  if (param.empty()) {
    EXPECT_TRUE(e["param"].is_null()) << a.body.dump();
  } else {
    EXPECT_EQ(e["param"], param) << a.body.dump();
  }
  EXPECT_NE(e["message"].get<std::string>().find(message_part), std::string::npos) << a.body.dump();
}

constexpr int kParallel = 4;   // the suite's serve --parallel

// Starts `moraine serve` on `model` (the suite's options) and waits for "listening on".
void start_serve(ServeProcess& s, const std::string& dir, const std::string& model, int ctx = 256,
                 const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {
      "--api-key", kKey, "--ctx", std::to_string(ctx), "--max-tokens", "64", "--cpu-workers", "2", "--max-body", "262144",
      // kParallel running (taking turns on the gpu_worker) + 20 queued: the client's 16
      // concurrent requests fit.
      "--parallel", std::to_string(kParallel), "--queue", "20",
      "--supervisor-arg=--gpu-threads=1", "--supervisor-arg=--no-census"};
  args.insert(args.end(), extra.begin(), extra.end());
  launch_serve(s, dir, model, args);
}

class ServeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    g_serve = new ServeProcess;
    const std::string dir = group_test::temp_dir("serve");
    start_serve(*g_serve, dir, group_test::convert_golden("qwen3moe_k256", group_test::golden_quant_args("kmix"), dir));
  }
  // SIGTERM, as a user stops it, so the group goes too (a SIGKILLed serve leaves its supervisor,
  // which runs in its own process group, and every worker behind); SIGKILL to both only after 60 s.
  static void TearDownTestSuite() {
    if (g_serve && g_serve->pid > 0) {
      pid_t supervisor = 0;
      std::ifstream(g_serve->socket_dir + "/supervisor.pid") >> supervisor;
      kill(g_serve->pid, SIGTERM);
      pid_t done = 0;
      for (int i = 0; i < 600 && done == 0; ++i) {
        done = waitpid(g_serve->pid, nullptr, WNOHANG);
        if (done == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      if (done == 0) {
        kill(g_serve->pid, SIGKILL);
        waitpid(g_serve->pid, nullptr, 0);
        if (supervisor > 0) kill(supervisor, SIGKILL);
      }
    }
    delete g_serve;
    g_serve = nullptr;
  }
  void SetUp() override {
    std::ifstream in(g_serve->log);
    const std::string log((std::istreambuf_iterator<char>(in)), {});
    ASSERT_GT(g_serve->port, 0) << "moraine serve did not log 'listening on':\n" << log;
  }
};

TEST_F(ServeTest, HealthIs503WhileLoading) {
  ASSERT_FALSE(g_serve->health_while_loading.empty()) << "the group came up before /health could be asked";
  for (int st : g_serve->health_while_loading) EXPECT_EQ(st, 503);
}

TEST_F(ServeTest, HealthModelsAndMetrics) {
  httplib::Client open("127.0.0.1", g_serve->port);   // no key: /health only
  auto h = open.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  EXPECT_EQ(json::parse(h->body)["status"], "ok");
  EXPECT_EQ(open.Get("/metrics")->status, 401);
  httplib::Client c = client();
  auto m = c.Get("/v1/models");
  ASSERT_TRUE(m);
  EXPECT_EQ(json::parse(m->body)["data"][0]["id"], g_serve->model_id);
  ASSERT_EQ(post("/v1/chat/completions", chat("hello")).status, 200);
  auto met = c.Get("/metrics");
  ASSERT_TRUE(met);
  for (const char* want : {"moraine_time_to_first_token_seconds_bucket", "moraine_inter_token_latency_seconds_count",
                           "moraine_queue_depth", "moraine_prompt_tokens_total", "moraine_completion_tokens_total",
                           "moraine_prefix_cache_hits_total", "name=\"prefix_cache_hits\"", "moraine_expert_slots_total"})
    EXPECT_NE(met->body.find(want), std::string::npos) << want << " missing from\n" << met->body;
}

TEST_F(ServeTest, OfficialOpenAiClient) {
  const fs::path oracle = kSource / ".cache" / "oracle";
  ASSERT_TRUE(fs::exists(oracle / "node_modules" / "openai")) << "the openai npm client is missing: run tests/oracle/setup";
  const auto [rc, out] = group_test::run_command(
      "node " + shell_quote((kSource / "tests" / "server" / "openai_client_test.cjs").string()) + " " +
      shell_quote(oracle.string()) + " http://127.0.0.1:" + std::to_string(g_serve->port) + " " +
      shell_quote(g_serve->model_id) + " " + kKey);
  std::printf("%s", out.c_str());
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("{\"passed\":10}"), std::string::npos) << out;
}

TEST_F(ServeTest, MalformedRequestsGetOpenAiErrors) {
  httplib::Client c = client();
  expect_error(post("/v1/chat/completions", std::string("{\"messages\": ["), c), 400, "", "JSON");
  expect_error(post("/v1/chat/completions", std::string("[1, 2]"), c), 400, "", "object");
  expect_error(post("/v1/chat/completions", json::object()), 400, "messages", "required");
  expect_error(post("/v1/chat/completions", json{{"messages", "hi"}}), 400, "messages", "array");
  expect_error(post("/v1/chat/completions", json{{"messages", json::array()}}), 400, "messages", "empty");
  expect_error(post("/v1/chat/completions", json{{"messages", {{{"role", "user"}, {"content", 5}}}}}), 400,
               "messages[0].content", "string");
  expect_error(post("/v1/chat/completions", json{{"messages", {{{"role", "wizard"}, {"content", "x"}}}}}), 400,
               "messages[0].role", "wizard");
  json j = chat("x");
  j["temperature"] = "hot";
  expect_error(post("/v1/chat/completions", j), 400, "temperature", "number");
  j = chat("x");
  j["max_tokens"] = -1;
  expect_error(post("/v1/chat/completions", j), 400, "max_tokens", "outside");
  j = chat("x");
  j["stop"] = 5;
  expect_error(post("/v1/chat/completions", j), 400, "stop", "string");
  j = chat("x");
  j["n"] = 3;
  expect_error(post("/v1/chat/completions", j), 400, "n", "n = 1");
  expect_error(post("/v1/completions", json{{"max_tokens", 2}}), 400, "prompt", "required");
  j = chat("x");
  j["model"] = "gpt-unknown";
  const Answer unknown = post("/v1/chat/completions", j);
  expect_error(unknown, 404, "model", "gpt-unknown");
  EXPECT_EQ(unknown.body["error"]["code"], "model_not_found");
  // Over the context (--ctx 256): max_tokens, then the prompt itself; the message has the numbers.
  j = chat("x", 1000);
  const Answer over = post("/v1/chat/completions", j);
  expect_error(over, 400, "messages", "256");
  EXPECT_NE(over.body["error"]["message"].get<std::string>().find("1000"), std::string::npos);
  EXPECT_EQ(over.body["error"]["code"], "context_length_exceeded");
  // A text prompt over it, counted in tokens after the template.
  std::string words;
  for (int i = 0; i < 400; ++i) words += "word" + std::to_string(i) + " ";
  const Answer long_text = post("/v1/chat/completions", chat(words, 1));
  expect_error(long_text, 400, "messages", "tokens, but the context holds 256");
  EXPECT_EQ(long_text.body["error"]["code"], "context_length_exceeded");
  std::vector<int> ids(300, 5);
  const Answer long_prompt = post("/v1/completions", json{{"prompt", ids}, {"max_tokens", 1}});
  expect_error(long_prompt, 400, "prompt", "300");
  // The same over-context request streamed: still a 400 before any event.
  j = chat("x", 1000);
  j["stream"] = true;
  expect_error(post("/v1/chat/completions", j), 400, "messages", "256");
  // A body over --max-body (256 KiB).
  const std::string huge = json{{"messages", {{{"role", "user"}, {"content", std::string(300 * 1024, 'a')}}}}}.dump();
  expect_error(post("/v1/chat/completions", huge, c), 413, "", "--max-body 262144 bytes");
  // Stop strings over their limits (16, of at most 512 bytes).
  j = chat("x");
  j["stop"] = std::vector<std::string>(17, "s");
  expect_error(post("/v1/chat/completions", j), 400, "stop", "at most 16");
  j["stop"] = std::string(513, 's');
  expect_error(post("/v1/chat/completions", j), 400, "stop", "at most 512");
  // Authentication.
  httplib::Client none("127.0.0.1", g_serve->port);
  const auto r1 = none.Post("/v1/chat/completions", chat("x").dump(), "application/json");
  ASSERT_TRUE(r1);
  expect_error({r1->status, json::parse(r1->body, nullptr, false)}, 401, "", "API key");
  httplib::Client wrong("127.0.0.1", g_serve->port);
  wrong.set_default_headers({{"Authorization", "Bearer nope"}});
  const auto r2 = wrong.Get("/v1/models");
  ASSERT_TRUE(r2);
  EXPECT_EQ(r2->status, 401);
  const auto r3 = c.Get("/v1/no-such-endpoint");
  ASSERT_TRUE(r3);
  expect_error({r3->status, json::parse(r3->body, nullptr, false)}, 404, "", "no such endpoint");
  // Still serving.
  EXPECT_EQ(post("/v1/chat/completions", chat("still there?")).status, 200);
}

pid_t instance_pid(const std::string& instance) {
  auto stub = control::Control::NewStub(grpc::CreateChannel(group::control_address(g_serve->socket_dir, instance),
                                                            grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  control::HealthReply reply;
  return stub->Health(&ctx, {}, &reply).ok() ? static_cast<pid_t>(reply.pid()) : -1;
}

uint64_t metric(const std::string& text, const std::string& name) {
  const size_t at = text.find(name + " ");
  return at == std::string::npos ? 0 : std::stoull(text.substr(at + name.size() + 1));
}

TEST_F(ServeTest, DisconnectCancelsTheRequest) {
  httplib::Client open = client();   // /metrics needs the key
  const std::string counter = "moraine_group_counter{instance=\"coordinator\",name=\"cancelled_requests\"}";
  const uint64_t before = metric(open.Get("/metrics")->body, counter);
  json j = chat("a long answer please", 200);
  j["stream"] = true;
  httplib::Client c = client();
  int events = 0;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";
  req.headers = {{"Authorization", "Bearer " + kKey}, {"Content-Type", "application/json"}};
  req.body = j.dump();
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++events < 3; };   // hang up early
  c.send(req);
  EXPECT_GE(events, 3);
  uint64_t after = before;
  for (int i = 0; i < 100 && after == before; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    after = metric(open.Get("/metrics")->body, counter);
  }
  EXPECT_EQ(after, before + 1) << "the coordinator did not see the request cancelled";
  EXPECT_EQ(post("/v1/chat/completions", chat("next")).status, 200);
}

TEST_F(ServeTest, DisconnectCancelsANonStreamingRequest) {
  httplib::Client open = client();   // /metrics needs the key
  const std::string counter = "moraine_group_counter{instance=\"coordinator\",name=\"cancelled_requests\"}";
  const uint64_t before = metric(open.Get("/metrics")->body, counter);
  // A frozen cpu worker holds the request's first step while the client gives up (0.3 s) and
  // closes its socket; thawed, the request would run on to 200 tokens unless it is cancelled.
  const pid_t worker = instance_pid(group::cpu_worker_instance(1));
  ASSERT_GT(worker, 0);
  ASSERT_EQ(kill(worker, SIGSTOP), 0);
  httplib::Client c = client();
  c.set_read_timeout(0, 300000);
  const auto r = c.Post("/v1/chat/completions", chat("a long answer please", 200).dump(), "application/json");
  kill(worker, SIGCONT);
  EXPECT_FALSE(r) << "an answer came while a worker was frozen";
  uint64_t after = before;
  for (int i = 0; i < 100 && after == before; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    after = metric(open.Get("/metrics")->body, counter);
  }
  EXPECT_EQ(after, before + 1) << "the coordinator did not see the request cancelled";
  EXPECT_EQ(post("/v1/chat/completions", chat("next")).status, 200);
}

// A client that gives up while its request waits in the queue leaves the queue (499, counted),
// without ever reaching the coordinator.
TEST_F(ServeTest, AQueuedClientThatLeavesLeavesTheQueue) {
  httplib::Client open = client();
  const std::string gone = "moraine_http_requests_total{endpoint=\"/v1/chat/completions\",status=\"499\"}";
  const uint64_t gone_before = metric(open.Get("/metrics")->body, gone);
  const pid_t worker = instance_pid(group::cpu_worker_instance(1));
  ASSERT_GT(worker, 0);
  ASSERT_EQ(kill(worker, SIGSTOP), 0);   // the running requests wait on it (one in its turn, the others for theirs)
  std::vector<Answer> first(kParallel);
  std::vector<std::thread> running;
  for (int i = 0; i < kParallel; ++i)
    running.emplace_back([&, i] { first[i] = post("/v1/chat/completions", chat("first in line " + std::to_string(i))); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  httplib::Client c = client();
  c.set_read_timeout(0, 300000);
  const auto r = c.Post("/v1/chat/completions", chat("second in line").dump(), "application/json");
  EXPECT_FALSE(r);
  uint64_t gone_after = gone_before;
  for (int i = 0; i < 40 && gone_after == gone_before; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    gone_after = metric(open.Get("/metrics")->body, gone);
  }
  const std::string met = open.Get("/metrics")->body;
  EXPECT_NE(met.find("moraine_queue_depth 0"), std::string::npos) << met;
  kill(worker, SIGCONT);
  for (std::thread& t : running) t.join();
  for (const Answer& a : first) EXPECT_EQ(a.status, 200) << a.body.dump();
  EXPECT_EQ(gone_after, gone_before + 1) << "the queued request was not dropped when its client left";
}

// A cpu_expert_worker killed while a request decodes: the supervisor restarts it, the
// coordinator replays the sequence, and the request completes with all its tokens (or, if the
// worker were not back in time, a 503 that says so); the server keeps serving.
TEST_F(ServeTest, WorkerLostMidRequest) {
  const pid_t victim = instance_pid(group::cpu_worker_instance(0));
  ASSERT_GT(victim, 0);
  // Frozen first, so that the request's first step waits on it: then it is lost mid-request.
  ASSERT_EQ(kill(victim, SIGSTOP), 0);
  Answer a;
  std::thread req([&] { a = post("/v1/chat/completions", chat("a long answer", 20)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  req.join();
  if (a.status == 200) {
    EXPECT_EQ(a.body["usage"]["completion_tokens"], 20) << a.body.dump();
  } else {
    expect_error(a, 503, "", "failed during the request");
  }
  std::printf("worker lost mid-request: status %d\n", a.status);
  for (int i = 0; i < 100 && instance_pid(group::cpu_worker_instance(0)) <= 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(post("/v1/chat/completions", chat("after the restart")).status, 200);
}

// Last: SIGTERM drains, stops every process of the group and removes its shared memory.
// What a streamed chat answer adds up to: content, reasoning, tool calls (whole in one delta).
struct StreamedChat {
  std::string content, reasoning, finish;
  json tool_calls = json::array();
  bool role = false, done = false;
};
StreamedChat read_stream(const std::string& sse) {
  StreamedChat s;
  std::istringstream in(sse);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("data: ", 0) != 0) continue;
    if (line == "data: [DONE]") {
      s.done = true;
      continue;
    }
    const json c = json::parse(line.substr(6));
    if (c["choices"].empty()) continue;
    const json& ch = c["choices"][0];
    const json& d = ch["delta"];
    if (d.value("role", "") == "assistant") s.role = true;
    s.content += d.value("content", "");
    s.reasoning += d.value("reasoning_content", "");
    for (const json& t : d.value("tool_calls", json::array()))
      s.tool_calls.push_back({{"id", t["id"]}, {"type", t["type"]}, {"function", t["function"]}});
    if (ch["finish_reason"].is_string()) s.finish = ch["finish_reason"];
  }
  return s;
}

// A model whose GGUF carries Qwen3's chat template: the server finds its tool-call format in the
// file and parses answers to requests with tools. The test model writes random text, so the
// answer's tool calls are not known here (server_tool_calls_test checks given text); this checks
// that such a request is answered in OpenAI's shape, streamed as whole.
TEST(ServeTools, QwenTemplateModelAnswersToolRequests) {
  const fs::path tmpl = kSource / ".cache" / "oracle" / "llama.cpp" / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja";
  ASSERT_TRUE(fs::exists(tmpl)) << "the oracle cache is missing: run tests/oracle/setup";
  const std::string dir = group_test::temp_dir("serve-tools");
  const fs::path golden = fs::path(dir) / "golden";
  fs::create_directories(golden);
  for (const auto& e : fs::directory_iterator(kSource / "tests" / "golden" / "qwen3moe_k256"))
    fs::copy_file(e.path(), golden / e.path().filename());
  fs::copy_file(tmpl, golden / "chat_template.jinja");
  const std::string model = dir + "/qwen3-templated.gguf";
  const auto [crc, cout] = group_test::run_command(shell_quote((kBuild / "tools" / "moraine-convert").string()) + " " +
                                                   shell_quote(golden.string()) + " " + shell_quote(model) + " --outtype f32");
  ASSERT_EQ(crc, 0) << cout;
  ServeProcess s;
  start_serve(s, dir, model, 1024);   // Qwen3's tools prompt is ~300 tokens in the test vocabulary
  std::ifstream in(s.log);
  const std::string log((std::istreambuf_iterator<char>(in)), {});
  ASSERT_GT(s.port, 0) << log;
  EXPECT_NE(log.find("tool calls of requests with tools: Qwen3 <tool_call> markup"), std::string::npos) << log;

  const json tools = {{{"type", "function"},
                       {"function", {{"name", "get_weather"},
                                     {"parameters", {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}}};
  json body = chat("What is the weather in Paris?", 16);
  body["tools"] = tools;
  httplib::Client c("127.0.0.1", s.port);
  c.set_read_timeout(120, 0);
  c.set_default_headers({{"Authorization", "Bearer " + kKey}});
  const Answer whole = post("/v1/chat/completions", body.dump(), c);
  ASSERT_EQ(whole.status, 200) << whole.body.dump();
  std::printf("tools answer: %s\n", whole.body.dump().c_str());
  const json& choice = whole.body["choices"][0];
  const json& m = choice["message"];
  EXPECT_EQ(m["role"], "assistant");
  const json calls = m.value("tool_calls", json::array());
  EXPECT_TRUE(m["content"].is_string() || (m["content"].is_null() && !calls.empty())) << m.dump();
  for (const json& t : calls) {
    EXPECT_TRUE(t["id"].is_string() && t["type"] == "function" && t["function"]["name"].is_string()) << t.dump();
    EXPECT_FALSE(json::parse(t["function"]["arguments"].get<std::string>(), nullptr, false).is_discarded()) << t.dump();
  }
  EXPECT_EQ(choice["finish_reason"], calls.empty() ? "length" : "tool_calls") << whole.body.dump();
  EXPECT_EQ(whole.body["usage"]["completion_tokens"], 16);

  body["stream"] = true;
  const auto r = c.Post("/v1/chat/completions", body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const StreamedChat st = read_stream(r->body);
  EXPECT_TRUE(st.role && st.done) << r->body;
  EXPECT_EQ(st.content, m["content"].is_null() ? "" : m["content"].get<std::string>()) << r->body;
  EXPECT_EQ(st.reasoning, m.value("reasoning_content", "")) << r->body;
  EXPECT_EQ(st.tool_calls.size(), calls.size()) << r->body;
  EXPECT_EQ(st.finish, choice["finish_reason"]) << r->body;
  kill(s.pid, SIGTERM);
  int status = 0;
  waitpid(s.pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

// serve --batch-decode: concurrent greedy requests share steps (the coordinator's batched_rows
// exceed its batched_steps) and each answers what it answers alone.
TEST(ServeFlags, BatchDecodeGivesEachRequestItsSoloAnswer) {
  const std::string dir = group_test::temp_dir("serve-batch");
  const std::string model = group_test::convert_golden("qwen3moe_k256", group_test::golden_quant_args("kmix"), dir);
  ServeProcess s;
  start_serve(s, dir, model, 256, {"--batch-decode"});
  ASSERT_GT(s.port, 0) << "serve --batch-decode did not start; see " << s.log;
  const auto ask = [&](const std::string& prompt) {
    httplib::Client c("127.0.0.1", s.port);
    c.set_read_timeout(120, 0);
    c.set_default_headers({{"Authorization", "Bearer " + kKey}});
    const json body = {{"prompt", prompt}, {"max_tokens", 24}, {"temperature", 0}, {"ignore_eos", true}};
    const Answer a = post("/v1/completions", body.dump(), c);
    EXPECT_EQ(a.status, 200) << a.body.dump();
    return a.status == 200 ? a.body["choices"][0]["text"].get<std::string>() : std::string();
  };
  const std::vector<std::string> prompts = {"The river", "A list is a mutable sequence", "Once upon a time there"};
  std::vector<std::string> together(prompts.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < prompts.size(); ++i) clients.emplace_back([&, i] { together[i] = ask(prompts[i]); });
  for (std::thread& t : clients) t.join();
  const uint64_t steps = group_test::coordinator_counter(s.socket_dir, "batched_steps");
  const uint64_t rows = group_test::coordinator_counter(s.socket_dir, "batched_rows");
  std::printf("batched steps %llu, rows %llu\n", static_cast<unsigned long long>(steps), static_cast<unsigned long long>(rows));
  EXPECT_GT(rows, steps) << "no step carried more than one request's row";
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(ask(prompts[i]), together[i]) << prompts[i];
  kill(s.pid, SIGTERM);
  int status = 0;
  waitpid(s.pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

// --max-connections reaches the server, which refuses one that leaves the queue no room, before
// the group starts (the model file is not read for it).
TEST(ServeFlags, MaxConnectionsBelowTheQueueIsRefused) {
  const std::string dir = group_test::temp_dir("serve-flags");
  std::ofstream(dir + "/model.gguf") << "not read";
  const auto [rc, out] = group_test::run_command(
      shell_quote((kBuild / "coordinator" / "moraine").string()) + " serve --port 0 -m " + shell_quote(dir + "/model.gguf") +
      " --socket-dir " + shell_quote(dir + "/sock") + " --parallel 2 --queue 8 --max-connections 10 2>&1");
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(out.find("--max-connections 10 must be above --parallel + --queue (10)"), std::string::npos) << out;
  fs::remove_all(dir);
}

// A serve killed with SIGKILL cannot stop its group: the supervisor sees its pid gone
// (--exit-with) and stops every process, and the shared memory goes with them.
TEST_F(ServeTest, SigkillOfServeStopsItsGroupToo) {
  ServeProcess s;
  fs::create_directories(g_serve->dir + "/killed");
  start_serve(s, g_serve->dir + "/killed", g_serve->model);
  ASSERT_GT(s.port, 0);
  const std::string prefix = group::group_prefix_for(s.socket_dir);
  ASSERT_FALSE(group_test::shm_files(prefix).empty());
  std::ifstream pid_in(s.socket_dir + "/supervisor.pid");
  pid_t supervisor = 0;
  pid_in >> supervisor;
  ASSERT_GT(supervisor, 0);
  ASSERT_EQ(kill(s.pid, SIGKILL), 0);
  ASSERT_EQ(waitpid(s.pid, nullptr, 0), s.pid);
  bool gone = false;
  for (int i = 0; i < 300 && !gone; ++i) {
    gone = !group::process_running(supervisor) && group_test::shm_files(prefix).empty();
    if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(gone) << "30 s after serve's SIGKILL: supervisor " << (group::process_running(supervisor) ? "running" : "gone")
                    << ", " << group_test::shm_files(prefix).size() << " shared-memory files left";
}

TEST_F(ServeTest, ZzSigtermStopsTheGroupAndRemovesSharedMemory) {
  const std::string prefix = group::group_prefix_for(g_serve->socket_dir);
  ASSERT_FALSE(group_test::shm_files(prefix).empty()) << "no shared memory of the group to begin with";
  std::ifstream pid_in(g_serve->socket_dir + "/supervisor.pid");
  pid_t supervisor = 0;
  pid_in >> supervisor;
  ASSERT_GT(supervisor, 0);
  ASSERT_EQ(kill(g_serve->pid, SIGTERM), 0);
  int status = 0;
  pid_t done = 0;
  for (int i = 0; i < 600 && done == 0; ++i) {
    done = waitpid(g_serve->pid, &status, WNOHANG);
    if (done == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_EQ(done, g_serve->pid) << "moraine serve did not stop within 60 s of SIGTERM";
  g_serve->pid = -1;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_TRUE(group_test::shm_files(prefix).empty());
  EXPECT_NE(kill(supervisor, 0), 0) << "the supervisor still runs";
  std::ifstream in(g_serve->log);
  const std::string log((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(log.find("moraine serve: stopped"), std::string::npos) << log;
}

}  // namespace
}  // namespace moraine::server_test
