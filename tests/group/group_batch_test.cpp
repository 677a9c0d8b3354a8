// Batched decode through the process group (coordinator --batch-decode, issue 33) on the CPU
// backend: requests arriving staggered at --parallel 3 each hold a sequence slot, their prompts go
// in chunks of the batched steps (--prefill-chunk) and their decode rows share steps. Each request's greedy tokens must be
// those it gets alone (a group without batching); the steps really carried several rows
// (batched_rows > batched_steps); a request cancelled after a few tokens got a prefix of its solo
// tokens and its slot is free again (a full set of requests after it completes). Also one request
// sampling with a temperature (the logits rows cross instead of the greedy tokens) beside the
// greedy ones: seeded, so its tokens too are those it gets alone. And a long prompt arriving
// while a request streams: in chunks the stream's longest inter-token gap is shorter than with the
// prompt's prefill whole (--prefill-chunk 0), the tokens the same.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "coordinator/group_layout.h"
#include "proto/generate.grpc.pb.h"
#include "tests/group/group_harness.h"

namespace moraine::group_test {
namespace {

using namespace std::chrono_literals;

struct Request {
  std::vector<int32_t> prompt;
  int n = 24;
  float temperature = 0.0f;   // > 0: seeded sampling (the logits rows cross)
  int cancel_after = 0;       // > 0: the client cancels after this many chunks
  std::vector<double>* arrivals = nullptr;      // each chunk's arrival (ms since the call)
  std::function<void(int chunks)> on_chunk;     // after each chunk read
  int deadline_ms = 180000;                     // the client gives up after this long
};

Generation run(const std::string& socket_dir, const Request& r) {
  auto stub = generate::Coordinator::NewStub(
      grpc::CreateChannel(group::control_address(socket_dir, group::kCoordinatorInstance), grpc::InsecureChannelCredentials()));
  generate::GenerateRequest req;
  for (int32_t id : r.prompt) req.mutable_token_ids()->add_ids(static_cast<uint32_t>(id));
  req.mutable_sampling()->set_max_tokens(static_cast<uint32_t>(r.n));
  req.mutable_sampling()->set_ignore_eos(true);
  if (r.temperature > 0) {
    req.mutable_sampling()->set_temperature(r.temperature);
    req.mutable_sampling()->set_seed(11);
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(r.deadline_ms));
  auto reader = stub->Generate(&ctx, req);
  Generation g;
  generate::GenerateChunk chunk;
  int chunks = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (reader->Read(&chunk)) {
    if (r.arrivals != nullptr)
      r.arrivals->push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    for (uint32_t id : chunk.token_ids()) g.ids.push_back(static_cast<int32_t>(id));
    if (!chunk.error().empty()) g.error = chunk.error();
    ++chunks;
    if (r.cancel_after > 0 && chunks == r.cancel_after) ctx.TryCancel();
    if (r.on_chunk) r.on_chunk(chunks);
  }
  const grpc::Status st = reader->Finish();
  g.status_code = st.error_code();
  if (!st.ok() && g.error.empty()) g.error = st.error_message();
  return g;
}

// Runs the requests concurrently, request i starting i * stagger after the first.
std::vector<Generation> run_all(const std::string& dir, const std::vector<Request>& rs, std::chrono::milliseconds stagger) {
  std::vector<Generation> got(rs.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < rs.size(); ++i)
    clients.emplace_back([&, i] {
      std::this_thread::sleep_for(stagger * static_cast<int>(i));
      got[i] = run(dir, rs[i]);
    });
  for (auto& t : clients) t.join();
  return got;
}

class Batch : public ::testing::TestWithParam<const char*> {};

void solo_check(const Generation& got, const Generation& want, const std::string& what) {
  EXPECT_TRUE(got.error.empty()) << what << ": " << got.error;
  EXPECT_EQ(got.ids, want.ids) << what << " differs from its tokens alone";
}
constexpr int kLongPrompt = 480;   // eight 64-row steps alone, fifteen 32-row chunks (the context holds 512)

TEST_P(Batch, StaggeredRequestsGiveTheirSoloTokens) {
  const std::string name = GetParam();
  const std::string dir = temp_dir("batch-" + name);
  GroupOptions o;
  o.model = convert_golden(name, golden_quant_args("kmix"), dir);
  const std::vector<int32_t> base = golden_prompt(name);
  std::vector<Request> rs(5);
  for (size_t r = 0; r < rs.size(); ++r) {
    for (size_t i = 0; i + 2 * r < base.size(); ++i) rs[r].prompt.push_back(5 + (base[i] * (static_cast<int>(r) + 3) + static_cast<int>(r)) % 90);
    rs[r].n = 20 + 4 * static_cast<int>(r);
  }
  rs[1].temperature = 0.8f;
  Request cancelled = rs[3];
  cancelled.n = 200;
  cancelled.cancel_after = 4;
  std::vector<Generation> solo;
  {
    Group g(o);
    for (const Request& r : rs) solo.push_back(run(g.socket_dir(), r));
    Request whole = cancelled;
    whole.cancel_after = 0;
    solo.push_back(run(g.socket_dir(), whole));
    g.stop();
  }
  o.extra_args = {"--parallel", "3", "--coordinator-arg=--batch-decode"};
  Group g(o);
  std::vector<Request> first = {rs[0], rs[1], cancelled, rs[2]};   // four at --parallel 3: one waits for a slot
  const std::vector<Generation> got = run_all(g.socket_dir(), first, 15ms);
  const std::vector<int> solo_of = {0, 1, 5, 2};
  for (size_t i = 0; i < first.size(); ++i) {
    const Generation& want = solo[static_cast<size_t>(solo_of[i])];
    ASSERT_TRUE(want.error.empty()) << want.error;
    if (first[i].cancel_after > 0) {
      EXPECT_EQ(got[i].status_code, grpc::StatusCode::CANCELLED) << got[i].error;
      ASSERT_LE(got[i].ids.size(), want.ids.size());
      EXPECT_GE(got[i].ids.size(), 3u);
      EXPECT_TRUE(std::equal(got[i].ids.begin(), got[i].ids.end(), want.ids.begin())) << "the cancelled request's tokens";
      continue;
    }
    ASSERT_TRUE(got[i].error.empty()) << "request " << i << ": " << got[i].error;
    EXPECT_EQ(got[i].ids, want.ids) << "request " << i << " differs from its tokens alone";
  }
  // The cancelled request's slot is free: three more at once all complete.
  const std::vector<Request> second = {rs[3], rs[4], rs[0]};
  const std::vector<Generation> again = run_all(g.socket_dir(), second, 5ms);
  const std::vector<int> solo_of2 = {3, 4, 0};
  for (size_t i = 0; i < second.size(); ++i) {
    ASSERT_TRUE(again[i].error.empty()) << "request " << i << ": " << again[i].error;
    EXPECT_EQ(again[i].ids, solo[static_cast<size_t>(solo_of2[i])].ids) << "second round, request " << i;
  }
  const uint64_t steps = coordinator_counter(g.socket_dir(), "batched_steps");
  const uint64_t rows = coordinator_counter(g.socket_dir(), "batched_rows");
  std::printf("%s: %llu batched steps carried %llu rows\n", name.c_str(), static_cast<unsigned long long>(steps),
              static_cast<unsigned long long>(rows));
  EXPECT_GT(rows, steps) << "no step carried rows of more than one request";
  g.stop();
}

// A long prompt arriving while a request streams: with --prefill-chunk 0 its prefill is one run of
// steps between two of the stream's tokens; in chunks of the batched steps the stream keeps going
// (its longest inter-token gap is shorter), and both requests still get their solo tokens.
struct Gaps {
  double longest_ms = 0;
  double first_token_ms = 0;   // the arriving request's first token, after its call
  uint64_t mixed_steps = 0, prompt_rows = 0;
};

Gaps stream_beside_long_prompt(GroupOptions o, const std::string& chunk, const Request& running, const Request& arriving,
                               const std::vector<Generation>& solo) {
  o.extra_args = {"--parallel", "2", "--coordinator-arg=--batch-decode", "--coordinator-arg=--prefill-chunk=" + chunk};
  Group g(o);
  std::vector<double> arrivals, arrivals_b;
  Request a = running, b = arriving;
  a.arrivals = &arrivals;
  b.arrivals = &arrivals_b;
  std::thread late;
  a.on_chunk = [&](int chunks) {   // the long prompt arrives once the stream runs
    if (chunks == 4) late = std::thread([&] { solo_check(run(g.socket_dir(), b), solo[1], "the arriving request, chunk " + chunk); });
  };
  const Generation got = run(g.socket_dir(), a);
  if (late.joinable()) late.join();
  solo_check(got, solo[0], "the running request, chunk " + chunk);
  Gaps gaps;
  gaps.first_token_ms = arrivals_b.empty() ? 0 : arrivals_b[0];
  for (size_t i = 4; i < arrivals.size(); ++i) gaps.longest_ms = std::max(gaps.longest_ms, arrivals[i] - arrivals[i - 1]);
  gaps.mixed_steps = coordinator_counter(g.socket_dir(), "batched_mixed_steps");
  gaps.prompt_rows = coordinator_counter(g.socket_dir(), "batched_prompt_rows");
  g.stop();
  return gaps;
}

TEST_P(Batch, PromptChunksKeepARunningStreamGoing) {
  const std::string name = GetParam();
  const std::string dir = temp_dir("batch-gap-" + name);
  GroupOptions o;
  o.model = convert_golden(name, golden_quant_args("kmix"), dir);
  const std::vector<int32_t> base = golden_prompt(name);
  Request running, arriving;
  running.prompt = base;
  running.n = 48;
  for (int i = 0; i < kLongPrompt; ++i) arriving.prompt.push_back(5 + (base[static_cast<size_t>(i) % base.size()] * 7 + i) % 90);
  arriving.n = 8;
  std::vector<Generation> solo;
  {
    Group g(o);
    solo.push_back(run(g.socket_dir(), running));
    solo.push_back(run(g.socket_dir(), arriving));
    g.stop();
  }
  for (const Generation& s : solo) ASSERT_TRUE(s.error.empty()) << s.error;
  const Gaps whole = stream_beside_long_prompt(o, "0", running, arriving, solo);
  const Gaps chunked = stream_beside_long_prompt(o, "32", running, arriving, solo);
  if (std::getenv("MORAINE_CHUNK_SWEEP") != nullptr)   // measuring --prefill-chunk's default
    for (const char* c : {"8", "16", "32", "62", "0"}) {
      const Gaps s = stream_beside_long_prompt(o, c, running, arriving, solo);
      std::printf("%s sweep: chunk %s: longest gap %.2f ms, the long prompt's first token %.2f ms\n", name.c_str(), c,
                  s.longest_ms, s.first_token_ms);
    }
  std::printf("%s: the stream's longest inter-token gap beside a %d-token prompt: %.2f ms with its prefill whole, "
              "%.2f ms in 32-row chunks (%llu steps carried chunks beside decode rows)\n",
              name.c_str(), kLongPrompt, whole.longest_ms, chunked.longest_ms, static_cast<unsigned long long>(chunked.mixed_steps));
  EXPECT_EQ(whole.prompt_rows, 0u) << "--prefill-chunk 0 fed a prompt in batched steps";
  EXPECT_EQ(chunked.prompt_rows, static_cast<uint64_t>(kLongPrompt) + base.size()) << "both prompts' rows in batched steps";
  EXPECT_GT(chunked.mixed_steps, 0u) << "no step carried a prompt chunk beside the stream's row";
  EXPECT_LT(chunked.longest_ms, whole.longest_ms);
}

// More requests than slots (--parallel 2, --batch-queue 3), arriving 10 ms apart while the first
// two decode 150 and 90 tokens: three wait, one of them gives up (its deadline) while waiting, a sixth is
// refused at once (RESOURCE_EXHAUSTED, naming the flags); the two left waiting take the slots in
// arrival order (the earlier one's first token first) and every served request gets its solo tokens.
TEST_P(Batch, RequestsBeyondTheSlotsWaitInArrivalOrder) {
  const std::string name = GetParam();
  const std::string dir = temp_dir("batch-queue-" + name);
  GroupOptions o;
  o.model = convert_golden(name, golden_quant_args("kmix"), dir);
  const std::vector<int32_t> base = golden_prompt(name);
  std::vector<Request> rs(6);
  for (size_t r = 0; r < rs.size(); ++r) {
    for (size_t i = 0; i < base.size(); ++i) rs[r].prompt.push_back(5 + (base[i] * (static_cast<int>(r) + 2) + static_cast<int>(r)) % 90);
    rs[r].n = r == 0 ? 150 : r == 1 ? 90 : 12;   // the second slot frees well before the first
  }
  std::vector<Generation> solo;
  {
    Group g(o);
    for (const Request& r : rs) solo.push_back(run(g.socket_dir(), r));
    g.stop();
  }
  o.extra_args = {"--parallel", "2", "--coordinator-arg=--batch-decode", "--coordinator-arg=--batch-queue=3"};
  Group g(o);
  std::vector<std::vector<double>> arrivals(rs.size());
  std::vector<Request> sent = rs;
  for (size_t i = 0; i < sent.size(); ++i) sent[i].arrivals = &arrivals[i];
  sent[3].deadline_ms = 40;   // arrives at 30 ms, gives up at 70 ms while the first two still decode
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<double> started(rs.size());
  std::vector<Generation> got(rs.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < sent.size(); ++i)
    clients.emplace_back([&, i] {
      std::this_thread::sleep_for(10ms * static_cast<int>(i));
      started[i] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      got[i] = run(g.socket_dir(), sent[i]);
    });
  for (auto& t : clients) t.join();
  for (size_t i : {0u, 1u, 2u, 4u}) solo_check(got[i], solo[i], "request " + std::to_string(i));
  EXPECT_EQ(got[3].status_code, grpc::StatusCode::DEADLINE_EXCEEDED) << got[3].error;
  EXPECT_TRUE(got[3].ids.empty()) << "the request that gave up while waiting got tokens";
  EXPECT_EQ(got[5].status_code, grpc::StatusCode::RESOURCE_EXHAUSTED) << got[5].error;
  EXPECT_NE(got[5].error.find("--batch-queue"), std::string::npos) << got[5].error;
  ASSERT_FALSE(arrivals[2].empty());
  ASSERT_FALSE(arrivals[4].empty());
  const double first2 = started[2] + arrivals[2][0], first4 = started[4] + arrivals[4][0];
  std::printf("%s: the waiting requests' first tokens at %.1f ms (arrived 20 ms) and %.1f ms (arrived 40 ms)\n", name.c_str(),
              first2, first4);
  EXPECT_LT(first2, first4) << "the later arrival was served first";
  EXPECT_EQ(coordinator_counter(g.socket_dir(), "batched_waiting"), 0u);
  g.stop();
}

INSTANTIATE_TEST_SUITE_P(Models, Batch, ::testing::Values("qwen3moe_k256", "qwen3next_k256"),
                         [](const auto& param_info) { return std::string(param_info.param); });

}  // namespace
}  // namespace moraine::group_test
