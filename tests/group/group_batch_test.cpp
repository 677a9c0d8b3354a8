// Batched decode through the process group (coordinator --batch-decode, issue 33) on the CPU
// backend: requests arriving staggered at --parallel 3 each hold a sequence slot, their prefills run
// as steps of their own and their decode rows share steps. Each request's greedy tokens must be
// those it gets alone (a group without batching); the steps really carried several rows
// (batched_rows > batched_steps); a request cancelled after a few tokens got a prefix of its solo
// tokens and its slot is free again (a full set of requests after it completes). Also one request
// sampling with a temperature (the logits rows cross instead of the greedy tokens) beside the
// greedy ones: seeded, so its tokens too are those it gets alone.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
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
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(180));
  auto reader = stub->Generate(&ctx, req);
  Generation g;
  generate::GenerateChunk chunk;
  int chunks = 0;
  while (reader->Read(&chunk)) {
    for (uint32_t id : chunk.token_ids()) g.ids.push_back(static_cast<int32_t>(id));
    if (!chunk.error().empty()) g.error = chunk.error();
    if (r.cancel_after > 0 && ++chunks == r.cancel_after) ctx.TryCancel();
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

INSTANTIATE_TEST_SUITE_P(Models, Batch, ::testing::Values("qwen3moe_k256", "qwen3next_k256"),
                         [](const auto& param_info) { return std::string(param_info.param); });

}  // namespace
}  // namespace moraine::group_test
