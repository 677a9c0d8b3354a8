// ZeroMQ job request/reply across processes: descriptors point into a shared segment the worker
// computes from; malformed, truncated, oversized and out-of-range requests get error replies and
// the worker carries on; a dead worker is a bounded timeout, never a hang.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <zmq.hpp>

#include "common/messaging/job_channel.h"
#include "common/shm/shm_segment.h"
#include "tests/messaging/job_fixture.h"
#include "tests/shm/child_process.h"

namespace {

using moraine::jobs::JobEnvelope;
using moraine::jobs::JobReply;
using moraine::messaging::JobClient;
using moraine::messaging::JobServer;
using moraine::messaging::ServeResult;
using moraine::shm::ShmSegment;
using namespace moraine::test;
using namespace std::chrono_literals;

constexpr std::uint64_t kStopSeq = UINT64_MAX;

// The socket file of an ipc:// endpoint, removed when the test ends (a killed worker leaves it).
struct IpcEndpoint {
  std::string path;
  std::string endpoint;
  explicit IpcEndpoint(const char* tag)
      : path("/tmp/moraine-test-" + std::string(tag) + "-" + std::to_string(getpid()) + ".sock"),
        endpoint("ipc://" + path) {}
  ~IpcEndpoint() { ::unlink(path.c_str()); }
};

// What the worker computes for expert e on activation row x, k-th row of its job: something that
// depends on every input so a wrong row, expert or offset shows up.
float expert_value(float x, std::uint32_t expert, std::size_t k) { return x * float(expert + 1) + float(k); }

// Worker: serves until a ping with seq kStopSeq or 10 s idle. For expert jobs it reads activation
// rows from the segment and writes each job's output rows at its offset.
int run_worker(const std::string& endpoint, const std::string& locator, std::size_t max_bytes) {
  ShmSegment segment = ShmSegment::open(locator);
  const auto layout = exchange_layout();
  zmq::context_t context(1);
  JobServer server(context, endpoint, exchange_limits(layout), max_bytes);
  bool stop = false;
  auto handler = [&](const JobEnvelope& job, JobReply& reply) {
    if (job.has_ping()) {
      stop = job.seq() == kStopSeq;
      return;
    }
    const auto& list = job.expert_jobs();
    const auto* act = reinterpret_cast<const float*>(segment.data() + list.activations().offset());
    std::byte* out_base = segment.data() + list.outputs().offset();
    for (const auto& ej : list.jobs()) {
      for (int k = 0; k < ej.token_rows_size(); ++k) {
        auto* out = reinterpret_cast<float*>(out_base + ej.output_offset() + std::size_t(k) * list.row_bytes());
        const float* in = act + std::size_t(ej.token_rows(k)) * kHidden;
        for (std::uint32_t h = 0; h < kHidden; ++h) out[h] = expert_value(in[h], ej.expert_id(), k);
      }
    }
    reply.set_done_seq(list.done_seq());
  };
  while (!stop) {
    if (server.serve_one(handler, 10s) == ServeResult::kIdle) return 5;
  }
  return 0;
}

JobEnvelope ping(std::uint64_t seq) {
  JobEnvelope job;
  job.set_version(moraine::messaging::kJobProtocolVersion);
  job.set_seq(seq);
  job.mutable_ping()->set_sent_ns(seq);
  return job;
}

TEST(JobChannel, ExpertJobsRoundTripThroughSharedMemory) {
  const auto layout = exchange_layout();
  ShmSegment segment = ShmSegment::create({test_group_prefix("jobs"), "exchange", layout.total_bytes(), false, false});
  const IpcEndpoint ipc("jobs");
  const std::string& endpoint = ipc.endpoint;
  Child worker([&] { return run_worker(endpoint, segment.locator(), moraine::messaging::kDefaultMaxJobBytes); });

  zmq::context_t context(1);
  JobClient client(context, endpoint);
  std::mt19937_64 rng(31337);
  std::uniform_real_distribution<float> value(-4.0f, 4.0f);
  auto* act = layout.region("activations").at<float>(segment.data());
  const auto* out = layout.region("outputs").at<std::byte>(segment.data());
  for (std::uint64_t seq = 1; seq <= 200; ++seq) {
    const JobEnvelope job = random_expert_jobs(rng, layout, seq);
    const auto& list = job.expert_jobs();
    for (std::size_t i = 0; i < std::size_t(list.n_tokens()) * kHidden; ++i) act[i] = value(rng);
    JobReply reply;
    // The first call may wait for the worker to bind: the request queues until it does.
    ASSERT_EQ(client.call(job, reply, 10s), "") << "seq " << seq;
    ASSERT_EQ(reply.status(), moraine::jobs::JOB_OK) << reply.error();
    ASSERT_EQ(reply.seq(), seq);
    ASSERT_EQ(reply.done_seq(), seq);
    for (const auto& ej : list.jobs()) {
      for (int k = 0; k < ej.token_rows_size(); ++k) {
        const auto* row = reinterpret_cast<const float*>(out + ej.output_offset() + std::size_t(k) * kRowBytes);
        const float* in = act + std::size_t(ej.token_rows(k)) * kHidden;
        for (std::uint32_t h = 0; h < kHidden; ++h) {
          ASSERT_EQ(row[h], expert_value(in[h], ej.expert_id(), k)) << "seq " << seq << " expert " << ej.expert_id();
        }
      }
    }
  }
  JobReply reply;
  ASSERT_EQ(client.call(ping(kStopSeq), reply, 10s), "");
  EXPECT_EQ(worker.wait(10s), 0);
}

TEST(JobChannel, BadRequestsGetErrorRepliesAndTheWorkerCarriesOn) {
  const auto layout = exchange_layout();
  ShmSegment segment = ShmSegment::create({test_group_prefix("bad"), "exchange", layout.total_bytes(), false, false});
  const IpcEndpoint ipc("bad");
  const std::string& endpoint = ipc.endpoint;
  constexpr std::size_t kMaxBytes = 4096;
  Child worker([&] { return run_worker(endpoint, segment.locator(), kMaxBytes); });

  zmq::context_t context(1);
  JobClient client(context, endpoint);
  JobReply reply;
  ASSERT_EQ(client.call(ping(1), reply, 10s), "");
  ASSERT_EQ(reply.status(), moraine::jobs::JOB_OK);

  auto expect_bad = [&](std::span<const std::byte> frame, const std::string& expect, const std::string& what) {
    JobReply bad;
    const std::string error = client.call_raw(frame, bad, 5s);
    ASSERT_EQ(error, "") << what;
    EXPECT_EQ(bad.status(), moraine::jobs::JOB_BAD_REQUEST) << what;
    EXPECT_NE(bad.error().find(expect), std::string::npos) << what << ": got '" << bad.error() << "'";
  };
  auto bytes_of = [](const std::string& s) { return std::as_bytes(std::span(s.data(), s.size())); };

  std::mt19937_64 rng(555);
  // Every strict prefix of a valid descriptor is refused (the body is serialised last, and a cut
  // inside a length-delimited field fails the parse).
  const std::string valid = random_expert_jobs(rng, layout, 42).SerializeAsString();
  ASSERT_LT(valid.size(), kMaxBytes);
  for (std::size_t cut = 0; cut < valid.size(); ++cut) {
    expect_bad(bytes_of(valid.substr(0, cut)), cut == 0 ? "empty" : "", "prefix of " + std::to_string(cut) + " bytes");
  }
  // Random garbage.
  for (int i = 0; i < 300; ++i) {
    std::string junk(1 + rng() % 600, '\0');
    for (char& c : junk) c = static_cast<char>(rng());
    expect_bad(bytes_of(junk), "", "random frame " + std::to_string(i));
  }
  // Oversized.
  expect_bad(bytes_of(std::string(kMaxBytes + 100, 'x')), "exceeds the limit of 4096 bytes", "oversized");
  // Wrong version.
  JobEnvelope versioned = ping(3);
  versioned.set_version(99);
  expect_bad(bytes_of(versioned.SerializeAsString()), "version 99", "version");
  // Out-of-range offset and expert id in an otherwise valid list.
  JobEnvelope far = random_expert_jobs(rng, layout, 4);
  far.mutable_expert_jobs()->mutable_outputs()->set_offset(layout.total_bytes());
  expect_bad(bytes_of(far.SerializeAsString()), "expert_jobs.outputs: range", "offset");
  JobReply far_reply;
  ASSERT_EQ(client.call(far, far_reply, 5s), "");
  EXPECT_EQ(far_reply.seq(), 4u) << "the error reply names the request it refuses";
  JobEnvelope alien = random_expert_jobs(rng, layout, 5);
  alien.mutable_expert_jobs()->mutable_jobs(0)->set_expert_id(1u << 30);
  expect_bad(bytes_of(alien.SerializeAsString()), ".expert_id 1073741824", "expert id");

  // Two frames in one request (not something JobClient sends: use a raw REQ socket).
  {
    zmq::socket_t raw(context, zmq::socket_type::req);
    raw.set(zmq::sockopt::linger, 0);
    raw.set(zmq::sockopt::rcvtimeo, 5000);
    raw.connect(endpoint);
    const std::string part = ping(6).SerializeAsString();
    ASSERT_TRUE(raw.send(zmq::buffer(part), zmq::send_flags::sndmore));
    ASSERT_TRUE(raw.send(zmq::buffer(part), zmq::send_flags::none));
    zmq::message_t answer;
    ASSERT_TRUE(raw.recv(answer));
    JobReply two;
    ASSERT_TRUE(two.ParseFromArray(answer.data(), static_cast<int>(answer.size())));
    EXPECT_EQ(two.status(), moraine::jobs::JOB_BAD_REQUEST);
    EXPECT_NE(two.error().find("2 frames"), std::string::npos) << two.error();
  }

  // Still serving: a valid job after all that.
  const JobEnvelope good = random_expert_jobs(rng, layout, 7);
  ASSERT_EQ(client.call(good, reply, 5s), "");
  EXPECT_EQ(reply.status(), moraine::jobs::JOB_OK) << reply.error();
  ASSERT_EQ(client.call(ping(kStopSeq), reply, 5s), "");
  EXPECT_EQ(worker.wait(10s), 0);
}

TEST(JobChannel, DeadWorkerIsATimeoutNotAHang) {
  const auto layout = exchange_layout();
  ShmSegment segment = ShmSegment::create({test_group_prefix("dead"), "exchange", layout.total_bytes(), false, false});
  const IpcEndpoint ipc("dead");
  const std::string& endpoint = ipc.endpoint;
  Child worker([&] { return run_worker(endpoint, segment.locator(), moraine::messaging::kDefaultMaxJobBytes); });
  zmq::context_t context(1);
  JobClient client(context, endpoint);
  JobReply reply;
  ASSERT_EQ(client.call(ping(1), reply, 10s), "");  // it is up

  worker.kill_now();
  EXPECT_EQ(worker.wait(10s), 128 + SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  const std::string error = client.call(ping(2), reply, 300ms);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_NE(error.find("no reply from " + endpoint + " within 300 ms"), std::string::npos) << error;
  EXPECT_GE(elapsed, 300ms);
  EXPECT_LT(elapsed, 3s);

  // The same client can go on once a worker is back (REQ relaxed): a new worker on the endpoint.
  ::unlink(ipc.path.c_str());
  Child again([&] { return run_worker(endpoint, segment.locator(), moraine::messaging::kDefaultMaxJobBytes); });
  ASSERT_EQ(client.call(ping(3), reply, 10s), "");
  EXPECT_EQ(reply.seq(), 3u);
  ASSERT_EQ(client.call(ping(kStopSeq), reply, 10s), "");
  EXPECT_EQ(again.wait(10s), 0);
}

TEST(JobChannel, NobodyListeningIsATimeout) {
  zmq::context_t context(1);
  const IpcEndpoint ipc("nobody");
  JobClient client(context, ipc.endpoint);
  JobReply reply;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_NE(client.call(ping(1), reply, 200ms).find("peer dead or stuck"), std::string::npos);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
}

}  // namespace
