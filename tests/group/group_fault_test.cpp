// The group under faults and bad input: malformed job descriptors and gRPC requests get error
// replies and the group keeps serving; `moraine stats` counts every stage; a cpu_expert_worker
// SIGKILLed in the middle of a step is restarted and the generation completes with the reference
// tokens, and so does a SIGKILLed gpu_worker (the coordinator's step doorbell wait notices); a
// SIGKILLed coordinator makes the workers exit and its shared memory is reclaimed by
// the next start.
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <thread>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include "common/messaging/job_channel.h"
#include "common/gguf/gguf.h"
#include "common/model/model.h"
#include "common/shm/doorbell.h"
#include "common/shm/shm_segment.h"
#include "coordinator/group_layout.h"
#include "proto/control.grpc.pb.h"
#include "proto/generate.grpc.pb.h"
#include "tests/group/group_harness.h"

namespace moraine::group_test {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

GroupOptions options(const std::string& model, const std::string& socket_dir = "", std::vector<std::string> extra = {}) {
  GroupOptions o;
  o.model = model;
  o.socket_dir = socket_dir;
  o.extra_args = std::move(extra);
  return o;
}

bool process_gone(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  const size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'Z';   // zombie: exited
}

bool wait_gone(pid_t pid, std::chrono::seconds deadline) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  while (!process_gone(pid)) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

class GroupFaults : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(temp_dir("faults"));
    model_ = new std::string(convert_golden("qwen3next_odd", "", *dir_));
    prompt_ = new std::vector<int32_t>(golden_prompt("qwen3next_odd"));
    ref_ = new ReferenceRun(reference_greedy(*model_, *prompt_, kTokens));
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
    delete model_;
    delete prompt_;
    delete ref_;
  }
  static constexpr int kTokens = 10;
  static std::string* dir_;
  static std::string* model_;
  static std::vector<int32_t>* prompt_;
  static ReferenceRun* ref_;
};
std::string* GroupFaults::dir_ = nullptr;
std::string* GroupFaults::model_ = nullptr;
std::vector<int32_t>* GroupFaults::prompt_ = nullptr;
ReferenceRun* GroupFaults::ref_ = nullptr;

TEST_F(GroupFaults, MalformedJobsAndRequestsGetErrorReplies) {
  Group g(options(*model_));
  zmq::context_t ctx(1);
  for (const std::string& inst : {std::string(group::kGpuWorkerInstance), group::cpu_worker_instance(1)}) {
    messaging::JobClient client(ctx, group::jobs_endpoint(g.socket_dir(), inst));
    jobs::JobReply reply;
    const std::byte garbage[] = {std::byte{0xff}, std::byte{0x13}, std::byte{0x07}, std::byte{0x80}};
    ASSERT_EQ(client.call_raw(garbage, reply, 10s), "") << inst;
    EXPECT_EQ(reply.status(), jobs::JOB_BAD_REQUEST) << inst;
    EXPECT_FALSE(reply.error().empty()) << inst;

    // Well-formed, but pointing outside the exchange segment.
    jobs::JobEnvelope env;
    env.set_version(messaging::kJobProtocolVersion);
    env.set_seq(7);
    jobs::ExpertJobList& list = *env.mutable_expert_jobs();
    list.set_layer(0);
    list.set_n_tokens(1);
    list.set_row_bytes(96 * 4);
    for (jobs::ShmRef* r : {list.mutable_activations(), list.mutable_routing(), list.mutable_outputs()}) {
      r->set_segment_id(group::kExchangeSegmentId);
      r->set_offset(uint64_t{1} << 40);
      r->set_length(96 * 4);
    }
    list.add_jobs()->set_expert_id(1);
    list.mutable_jobs(0)->add_token_rows(0);
    ASSERT_EQ(client.call(env, reply, 10s), "") << inst;
    EXPECT_EQ(reply.status(), jobs::JOB_BAD_REQUEST) << inst;
    EXPECT_NE(reply.error().find("outside segment"), std::string::npos) << inst << ": " << reply.error();
  }
  // A valid-looking step that disagrees with the step header in shared memory: refused, not run.
  {
    messaging::JobClient client(ctx, group::jobs_endpoint(g.socket_dir(), group::kGpuWorkerInstance));
    jobs::JobEnvelope env;
    env.set_version(messaging::kJobProtocolVersion);
    env.set_seq(1);
    jobs::LayerStep& s = *env.mutable_layer_step();
    s.set_step_seq(424242);
    s.set_n_tokens(1);
    s.set_row_bytes(96 * 4);
    for (jobs::ShmRef* r : {s.mutable_activations(), s.mutable_output()}) {
      r->set_segment_id(group::kExchangeSegmentId);
      r->set_offset(4096);
      r->set_length(96 * 4);
    }
    jobs::JobReply reply;
    ASSERT_EQ(client.call(env, reply, 10s), "");
    EXPECT_EQ(reply.status(), jobs::JOB_FAILED);
    EXPECT_NE(reply.error().find("step header"), std::string::npos) << reply.error();
  }
  // gRPC: token outside the vocabulary, and no input at all.
  Generation bad = generate(g.socket_dir(), {5, 1000000}, 3);
  EXPECT_EQ(bad.status_code, grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad.error.find("outside the vocabulary"), std::string::npos) << bad.error;
  Generation empty = generate(g.socket_dir(), {}, 3);
  EXPECT_EQ(empty.status_code, grpc::StatusCode::INVALID_ARGUMENT) << empty.error;
  // Raw bytes that are not a GenerateRequest, through the generic stub.
  {
    auto channel = grpc::CreateChannel(group::control_address(g.socket_dir(), group::kCoordinatorInstance),
                                       grpc::InsecureChannelCredentials());
    grpc::GenericStub stub(channel);
    const char junk[] = "\xff\xff\xff\xff\x0f not a protobuf";
    grpc::Slice slice(junk, sizeof junk - 1);
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::ClientContext call_ctx;
    call_ctx.set_deadline(std::chrono::system_clock::now() + 10s);
    grpc::CompletionQueue cq;
    auto call = stub.PrepareUnaryCall(&call_ctx, "/moraine.control.Control/Stats", request, &cq);
    call->StartCall();
    grpc::Status st;
    call->Finish(&response, &st, reinterpret_cast<void*>(1));
    void* tag = nullptr;
    bool ok = false;
    ASSERT_TRUE(cq.Next(&tag, &ok));
    EXPECT_FALSE(st.ok()) << "garbage Stats request was accepted";
  }
  // Still serving, and still right.
  EXPECT_EQ(g.wait_all_serving(10s), "");
  const Generation gen = generate(g.socket_dir(), *prompt_, kTokens);
  ASSERT_TRUE(gen.error.empty()) << gen.error;
  EXPECT_EQ(gen.ids, ref_->ids);
}

TEST_F(GroupFaults, StatsCountEveryStage) {
  Group g(options(*model_));
  ASSERT_TRUE(generate(g.socket_dir(), *prompt_, kTokens).error.empty());
  const fs::path cli = fs::path(MORAINE_BUILD_DIR) / "coordinator" / "moraine";
  auto [rc, out] = run_command(shell_quote(cli.string()) + " stats --json --socket-dir " + shell_quote(g.socket_dir()));
  ASSERT_EQ(rc, 0) << out;
  const nlohmann::json all = nlohmann::json::parse(out);
  ASSERT_EQ(all.size(), 6u) << out;   // supervisor, coordinator, gpu_worker, two cpu workers, io_worker
  for (const auto& p : all) {
    ASSERT_FALSE(p["stages"].empty()) << p.dump();
    if (p["role"] == "ROLE_SUPERVISOR") {   // it runs no tokens: it counts process starts
      EXPECT_EQ(p["stages"][0]["steps"].get<uint64_t>(), 5u) << p.dump();
      continue;
    }
    EXPECT_GT(p["shm_mapped_bytes"].get<uint64_t>(), 0u) << p["instance"];
    // All experts are RAM-resident in this group: the io_worker has read nothing (tests/io).
    if (p["role"] == "ROLE_IO_WORKER") continue;
    for (const auto& s : p["stages"]) {
      EXPECT_GT(s["tokens"].get<uint64_t>(), 0u) << p["instance"] << " " << s.dump();
      EXPECT_GT(s["steps"].get<uint64_t>(), 0u) << p["instance"] << " " << s.dump();
      EXPECT_GT(s["p50_us"].get<double>(), 0.0) << p["instance"] << " " << s.dump();
      if (p["role"] == "ROLE_CPU_EXPERT_WORKER") {
        EXPECT_GT(s["experts_computed"].get<uint64_t>(), 0u) << s.dump();
        EXPECT_GT(s["bytes_read"].get<uint64_t>(), 0u) << s.dump();
      }
    }
  }
  // The table form names every process.
  std::tie(rc, out) = run_command(shell_quote(cli.string()) + " stats --socket-dir " + shell_quote(g.socket_dir()));
  ASSERT_EQ(rc, 0) << out;
  for (const char* inst : {"supervisor", "coordinator", "gpu_worker-0", "cpu_expert_worker-0", "cpu_expert_worker-1",
                           "io_worker-0"}) {
    EXPECT_NE(out.find(inst), std::string::npos) << out;
  }
}

// Drain: the process stops taking new work, answers once what it has is done, and says so in
// Health; Configure/Load answer UNIMPLEMENTED with the reason (configuration is by flags).
// A client that goes away in the middle of a long generation (its stream written by the
// coordinator's writer thread, chunk_streamer.h): the coordinator stops that request within a few
// tokens and frees the session, so the next request runs and gives the reference's tokens.
TEST_F(GroupFaults, AClientLeavingMidStreamEndsItsRequest) {
  Group g(options(*model_));
  auto stub = generate::Coordinator::NewStub(grpc::CreateChannel(
      group::control_address(g.socket_dir(), group::kCoordinatorInstance), grpc::InsecureChannelCredentials()));
  generate::GenerateRequest req;
  for (int32_t id : *prompt_) req.mutable_token_ids()->add_ids(static_cast<uint32_t>(id));
  req.mutable_sampling()->set_ignore_eos(true);
  {   // more than the context holds: refused with the numbers
    req.mutable_sampling()->set_max_tokens(100000);
    grpc::ClientContext ctx;
    auto reader = stub->Generate(&ctx, req);
    generate::GenerateChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    const grpc::Status st = reader->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::OUT_OF_RANGE);
    EXPECT_NE(st.error_message().find("100000"), std::string::npos) << st.error_message();
  }
  // The whole context: only leaving ends it early.
  const uint64_t context = coordinator_counter(g.socket_dir(), "context_tokens");
  ASSERT_GT(context, prompt_->size() + 100);
  req.mutable_sampling()->set_max_tokens(static_cast<uint32_t>(context - prompt_->size()));
  {
    grpc::ClientContext ctx;
    auto reader = stub->Generate(&ctx, req);
    generate::GenerateChunk chunk;
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(reader->Read(&chunk)) << "chunk " << i;
    ctx.TryCancel();
    while (reader->Read(&chunk)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  const auto t0 = std::chrono::steady_clock::now();
  const Generation after = generate(g.socket_dir(), *prompt_, kTokens);
  EXPECT_TRUE(after.error.empty()) << after.error;
  EXPECT_EQ(after.ids, ref_->ids);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 30s) << "the session stayed taken after the client left";
}

// A non-finite logit with SamplingParams::check_logits (what moraine-bench asks for): the request
// fails naming the logit and the position, instead of sampling from it. The model's output row 5 is
// made NaN in a copy of the file (F32 weights), so logit 5 is NaN at every position. Greedy, the
// gpu_worker finds it (StepHeader::check_finite: the logits do not cross); with a temperature the
// coordinator scans the logits it samples from: the same message both ways.
TEST_F(GroupFaults, CheckLogitsNamesANonFiniteLogit) {
  const std::string bad = *dir_ + "/nan_logit.gguf";
  fs::copy_file(*model_, bad, fs::copy_options::overwrite_existing);
  uint64_t at = 0;
  {
    const auto f = gguf::GgufFile::open(bad);
    for (const auto& t : f.tensors()) {
      if (t.name != "output.weight") continue;
      ASSERT_EQ(t.type, TensorType::F32);
      at = f.data_offset(t.shard) + t.offset + 5 * static_cast<uint64_t>(t.shape[0]) * sizeof(float);
    }
  }
  ASSERT_GT(at, 0u) << "no F32 output.weight in " << bad;
  {
    std::fstream io(bad, std::ios::in | std::ios::out | std::ios::binary);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    io.seekp(static_cast<std::streamoff>(at));
    io.write(reinterpret_cast<const char*>(&nan), sizeof nan);
    ASSERT_TRUE(io.good());
  }
  Group g(options(bad));
  auto stub = generate::Coordinator::NewStub(grpc::CreateChannel(
      group::control_address(g.socket_dir(), group::kCoordinatorInstance), grpc::InsecureChannelCredentials()));
  for (const float temperature : {0.0f, 0.7f}) {
    generate::GenerateRequest req;
    for (int32_t id : *prompt_) req.mutable_token_ids()->add_ids(static_cast<uint32_t>(id));
    req.mutable_sampling()->set_max_tokens(4);
    req.mutable_sampling()->set_temperature(temperature);
    req.mutable_sampling()->set_check_logits(true);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto reader = stub->Generate(&ctx, req);
    generate::GenerateChunk chunk;
    std::string error;
    while (reader->Read(&chunk)) {
      if (!chunk.error().empty()) error = chunk.error();
    }
    EXPECT_FALSE(reader->Finish().ok()) << "temperature " << temperature;
    EXPECT_NE(error.find("logit 5 of position " + std::to_string(prompt_->size()) + " is NaN"), std::string::npos)
        << "temperature " << temperature << ": " << error;
  }
}

TEST_F(GroupFaults, DrainStopsNewRequestsAndReportsDrained) {
  Group g(options(*model_));
  ASSERT_TRUE(generate(g.socket_dir(), *prompt_, kTokens).error.empty());
  auto stub_of = [&](const std::string& inst) {
    return control::Control::NewStub(
        grpc::CreateChannel(group::control_address(g.socket_dir(), inst), grpc::InsecureChannelCredentials()));
  };
  auto drain = [&](const std::string& inst) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    control::DrainRequest req;
    req.set_deadline_ms(20000);
    control::DrainReply reply;
    const grpc::Status st = stub_of(inst)->Drain(&ctx, req, &reply);
    EXPECT_TRUE(st.ok()) << inst << ": " << st.error_message();
    return reply;
  };
  auto state = [&](const std::string& inst) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    control::HealthReply reply;
    EXPECT_TRUE(stub_of(inst)->Health(&ctx, {}, &reply).ok());
    return reply.state();
  };
  // A generation racing the drain: admitted before it (then it completes and the drain answers
  // after it) or refused as draining; never cut off halfway.
  Generation during;
  std::thread client([&] { during = generate(g.socket_dir(), *prompt_, kTokens); });
  const control::DrainReply d = drain(group::kCoordinatorInstance);
  client.join();
  EXPECT_TRUE(d.drained());
  EXPECT_EQ(d.jobs_in_flight(), 0u);
  if (during.error.empty()) {
    EXPECT_EQ(during.ids, ref_->ids);
  } else {
    EXPECT_EQ(during.status_code, grpc::StatusCode::UNAVAILABLE) << during.error;
  }
  EXPECT_EQ(state(group::kCoordinatorInstance), control::STOPPED);
  const Generation after = generate(g.socket_dir(), *prompt_, kTokens);
  EXPECT_EQ(after.status_code, grpc::StatusCode::UNAVAILABLE) << after.error;
  EXPECT_NE(after.error.find("draining"), std::string::npos) << after.error;
  EXPECT_TRUE(drain(group::cpu_worker_instance(0)).drained());
  EXPECT_EQ(state(group::cpu_worker_instance(0)), control::STOPPED);

  grpc::ClientContext ctx;
  control::ConfigureReply cr;
  const grpc::Status st = stub_of(group::kGpuWorkerInstance)->Configure(&ctx, {}, &cr);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(st.error_message().find("flags"), std::string::npos) << st.error_message();
}

TEST_F(GroupFaults, KilledCpuWorkerMidStepIsRestartedAndTokensMatch) {
  // The test freezes and kills by hand: no Health watch racing it (group_health_test has that).
  Group g(options(*model_, "", {"--health-interval", "0"}));
  const pid_t victim = g.instance_pid(group::cpu_worker_instance(1));
  // Freeze the worker, start generating, and wait until the gpu_worker has rung it for a layer
  // it has not answered: the step is in flight and needs this worker. Then kill it.
  ASSERT_EQ(kill(victim, SIGSTOP), 0);
  Generation gen;
  std::thread client([&] { gen = generate(g.socket_dir(), *prompt_, kTokens); });
  const group::GroupManifest man = group::GroupManifest::read(group::manifest_path(g.socket_dir()));
  const model::Model m = model::Model::load(*model_);
  shm::ShmSegment exchange = shm::ShmSegment::open(man.exchange_locator);
  const group::ExchangeLayout xl = group::ExchangeLayout::build(m.hp, man.max_tokens, man.n_cpu_workers, man.long_step_rows);
  auto bell = [&](size_t i) {
    return shm::Doorbell::at(exchange.data() + xl.region("bells").offset + i * sizeof(shm::Doorbell));
  };
  const auto until = std::chrono::steady_clock::now() + 60s;
  bool in_flight = false;
  while (std::chrono::steady_clock::now() < until) {
    if (bell(group::ExchangeLayout::request_bell(1))->load() > bell(group::ExchangeLayout::done_bell(1))->load()) {
      in_flight = true;
      break;
    }
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_TRUE(in_flight) << "the gpu_worker never handed a layer to the frozen worker";
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  client.join();
  ASSERT_TRUE(gen.error.empty()) << gen.error;
  EXPECT_EQ(gen.ids, ref_->ids);
  EXPECT_EQ(g.wait_all_serving(30s), "");
  EXPECT_NE(g.instance_pid(group::cpu_worker_instance(1)), victim) << "the worker was not restarted";
  std::ifstream log(g.socket_dir() + "/supervisor.log");
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("cpu_expert_worker-1 (pid " + std::to_string(victim) + ") died"), std::string::npos) << text;
}

// The gpu_worker SIGKILLed in the middle of a step (held there by a frozen cpu worker): the
// coordinator, waiting on the step doorbell, sees the process gone and says so, the supervisor
// restarts it, the new one answers the orphaned step with an error before it registers, and the
// coordinator's re-issue from a reset completes with the reference's tokens.
TEST_F(GroupFaults, KilledGpuWorkerMidStepIsDetectedAndTheStepReissued) {
  // The test freezes and kills by hand: no Health watch racing it (group_health_test has that).
  Group g(options(*model_, "", {"--health-interval", "0"}));
  const pid_t victim = g.instance_pid(group::kGpuWorkerInstance);
  const pid_t holder = g.instance_pid(group::cpu_worker_instance(1));
  ASSERT_EQ(kill(holder, SIGSTOP), 0);
  Generation gen;
  std::thread client([&] { gen = generate(g.socket_dir(), *prompt_, kTokens); });
  const group::GroupManifest man = group::GroupManifest::read(group::manifest_path(g.socket_dir()));
  ASSERT_EQ(man.step_channel, "doorbell");
  const model::Model m = model::Model::load(*model_);
  shm::ShmSegment exchange = shm::ShmSegment::open(man.exchange_locator);
  const group::ExchangeLayout xl = group::ExchangeLayout::build(m.hp, man.max_tokens, man.n_cpu_workers, man.long_step_rows);
  auto bell = [&](const char* region, size_t i) {
    return shm::Doorbell::at(exchange.data() + xl.region(region).offset + i * sizeof(shm::Doorbell));
  };
  const auto until = std::chrono::steady_clock::now() + 60s;
  bool in_flight = false;
  while (std::chrono::steady_clock::now() < until) {
    if (bell("bells", group::ExchangeLayout::request_bell(1))->load() > bell("bells", group::ExchangeLayout::done_bell(1))->load() &&
        bell("step_bells", 0)->load() > bell("step_bells", 1)->load()) {
      in_flight = true;
      break;
    }
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_TRUE(in_flight) << "no step reached the frozen worker";
  const uint64_t lost_step = bell("step_bells", 0)->load();
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  ASSERT_EQ(kill(holder, SIGCONT), 0);
  client.join();
  ASSERT_TRUE(gen.error.empty()) << gen.error;
  EXPECT_EQ(gen.ids, ref_->ids);
  EXPECT_EQ(g.wait_all_serving(30s), "");
  EXPECT_NE(g.instance_pid(group::kGpuWorkerInstance), victim) << "the gpu_worker was not restarted";
  std::ifstream log(g.socket_dir() + "/coordinator.log");
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  const std::string died = "gpu_worker-0 (pid " + std::to_string(victim) + ") died during step " + std::to_string(lost_step);
  const std::string orphan = "gpu_worker-0 restarted during step " + std::to_string(lost_step);
  EXPECT_TRUE(text.find(died) != std::string::npos || text.find(orphan) != std::string::npos) << text;
  EXPECT_NE(text.find("re-issuing from a reset"), std::string::npos) << text;
  // And the group goes on serving.
  const Generation again = generate(g.socket_dir(), *prompt_, kTokens);
  ASSERT_TRUE(again.error.empty()) << again.error;
  EXPECT_EQ(again.ids, ref_->ids);
}

TEST_F(GroupFaults, KilledCoordinatorMakesWorkersExitAndShmIsReclaimed) {
  const std::string sock = temp_dir("coordkill");
  const std::string prefix = group::group_prefix_for(sock);
  {
    Group g(options(*model_, sock));
    const pid_t coord = g.instance_pid(group::kCoordinatorInstance);
    const std::vector<pid_t> workers = {g.instance_pid(group::kGpuWorkerInstance),
                                        g.instance_pid(group::cpu_worker_instance(0)),
                                        g.instance_pid(group::cpu_worker_instance(1))};
    // Without its supervisor, so the workers must notice on their own.
    ASSERT_EQ(kill(g.supervisor_pid(), SIGKILL), 0);
    ASSERT_EQ(kill(coord, SIGKILL), 0);
    for (pid_t w : workers) EXPECT_TRUE(wait_gone(w, 30s)) << "worker " << w << " outlived its coordinator";
    EXPECT_FALSE(shm_files(prefix).empty()) << "a killed coordinator cannot have removed its segments";
  }
  {
    Group g(options(*model_, sock));
    std::ifstream log(sock + "/coordinator.log");
    const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("reclaimed /dev/shm/" + prefix), std::string::npos) << text;
    const Generation gen = generate(g.socket_dir(), *prompt_, kTokens);
    ASSERT_TRUE(gen.error.empty()) << gen.error;
    EXPECT_EQ(gen.ids, ref_->ids);
    g.stop();
  }
  EXPECT_TRUE(shm_files(prefix).empty()) << "shared memory left after stop";
  fs::remove_all(sock);
}

TEST_F(GroupFaults, StopLeavesNoProcessAndNoSharedMemory) {
  Group g(options(*model_));
  std::vector<pid_t> pids;
  for (const std::string& inst : {std::string(group::kCoordinatorInstance), std::string(group::kGpuWorkerInstance),
                                 group::cpu_worker_instance(0), group::cpu_worker_instance(1)}) {
    pids.push_back(g.instance_pid(inst));
  }
  const pid_t sup = g.supervisor_pid();
  const std::string prefix = group::group_prefix_for(g.socket_dir());
  EXPECT_FALSE(shm_files(prefix).empty());
  g.stop();
  for (pid_t p : pids) EXPECT_TRUE(wait_gone(p, 30s)) << p;
  EXPECT_TRUE(process_gone(sup));
  EXPECT_TRUE(shm_files(prefix).empty());
}

}  // namespace
}  // namespace moraine::group_test
