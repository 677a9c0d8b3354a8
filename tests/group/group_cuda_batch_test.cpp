// Batched decode through the process group on the CUDA backend (coordinator --batch-decode,
// issue 33; group_batch_test.cpp runs the CPU backend): four greedy requests arriving staggered at
// --parallel 4 each hold a sequence slot of the CUDA gpu_worker and their decode rows share steps,
// plus one cancelled after a few tokens; each request's tokens must be those it gets from the
// same group without batching (its decode rows then run as plain one-row steps), the cancelled
// one a prefix of its own. With every expert in VRAM (the batched step replays a captured graph
// per segment layout) and with every expert on the cpu workers (the in-graph hand-off over the
// batched rows). Skips without a CUDA device.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "coordinator/group_layout.h"
#include "kernels/cuda/device.h"
#include "proto/generate.grpc.pb.h"
#include "tests/group/group_harness.h"

namespace moraine::group_test {
namespace {

using namespace std::chrono_literals;

struct Request {
  std::vector<int32_t> prompt;
  int n = 24;
  int cancel_after = 0;   // > 0: the client cancels after this many chunks
};

Generation run(const std::string& socket_dir, const Request& r) {
  auto stub = generate::Coordinator::NewStub(
      grpc::CreateChannel(group::control_address(socket_dir, group::kCoordinatorInstance), grpc::InsecureChannelCredentials()));
  generate::GenerateRequest req;
  for (int32_t id : r.prompt) req.mutable_token_ids()->add_ids(static_cast<uint32_t>(id));
  req.mutable_sampling()->set_max_tokens(static_cast<uint32_t>(r.n));
  req.mutable_sampling()->set_ignore_eos(true);
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

struct Case {
  const char* model;
  bool vram_experts;   // every expert in VRAM, else every expert on the cpu workers (--vram dense)
};

class CudaBatch : public ::testing::TestWithParam<Case> {};

TEST_P(CudaBatch, ConcurrentGreedyRequestsGiveTheirSoloTokens) {
  std::string why;
  if (!cuda::device_available(&why)) GTEST_SKIP() << "no CUDA device: " << why;
  const Case& c = GetParam();
  const std::string name = std::string(c.model) + (c.vram_experts ? "_vram" : "_cpu_experts");
  const std::string dir = temp_dir("cuda-batch-" + name);
  GroupOptions o;
  o.backend = "cuda";
  o.model = convert_golden(c.model, golden_quant_args("kmix"), dir);
  if (c.vram_experts) o.vram = "1099511627776";   // 1 TiB: every expert fits
  const std::vector<int32_t> base = golden_prompt(c.model);
  std::vector<Request> rs(4);
  for (size_t r = 0; r < rs.size(); ++r) {
    for (size_t i = 0; i + 2 * r < base.size(); ++i) rs[r].prompt.push_back(5 + (base[i] * (static_cast<int>(r) + 3) + static_cast<int>(r)) % 90);
    rs[r].n = 20 + 4 * static_cast<int>(r);
  }
  Request cancelled = rs[2];
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
  o.extra_args = {"--parallel", "4", "--coordinator-arg=--batch-decode"};
  Group g(o);
  const std::vector<Request> first = {rs[0], rs[1], cancelled, rs[3]};
  const std::vector<Generation> got = run_all(g.socket_dir(), first, 10ms);
  const std::vector<int> solo_of = {0, 1, 4, 3};
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
  // The cancelled request's slot is free again: four at once all complete with their solo tokens.
  const std::vector<Generation> again = run_all(g.socket_dir(), rs, 3ms);
  for (size_t i = 0; i < rs.size(); ++i) {
    ASSERT_TRUE(again[i].error.empty()) << "request " << i << ": " << again[i].error;
    EXPECT_EQ(again[i].ids, solo[i].ids) << "second round, request " << i;
  }
  const uint64_t steps = coordinator_counter(g.socket_dir(), "batched_steps");
  const uint64_t rows = coordinator_counter(g.socket_dir(), "batched_rows");
  std::printf("%s: %llu batched steps carried %llu rows\n", name.c_str(), static_cast<unsigned long long>(steps),
              static_cast<unsigned long long>(rows));
  EXPECT_GT(rows, steps) << "no step carried rows of more than one request";
  g.stop();
}

INSTANTIATE_TEST_SUITE_P(Models, CudaBatch,
                         ::testing::Values(Case{"qwen3moe_k256", true}, Case{"qwen3next_k256", true},
                                           Case{"qwen3moe_k256", false}, Case{"qwen3next_k256", false}),
                         [](const auto& param_info) {
                           return std::string(param_info.param.model) + (param_info.param.vram_experts ? "_vram" : "_cpu_experts");
                         });

}  // namespace
}  // namespace moraine::group_test
