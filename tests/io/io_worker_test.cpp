// moraine-io-worker as a process: started with a test manifest (a golden model converted to
// GGUF, an arena segment this test creates), waited on through Health. ReadJobList fills the
// arena with the file's bytes (random ranges, and experts into 4 KiB-aligned slots), malformed
// jobs get JOB_BAD_REQUEST and the worker keeps serving, Stats counts the bytes, and the worker
// exits when the coordinator named in the manifest is gone.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "common/messaging/job_channel.h"
#include "common/model/model.h"
#include "common/shm/shm_segment.h"
#include "coordinator/control_server.h"
#include "coordinator/group_layout.h"
#include "proto/control.grpc.pb.h"
#include "tests/group/group_harness.h"

namespace {

using namespace moraine;
using namespace std::chrono_literals;
namespace fs = std::filesystem;
constexpr const char* kInstance = "io_worker-0";
constexpr const char* kExpertTensors[3] = {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight",
                                           "blk.0.ffn_down_exps.weight"};

// Returns true when pid exited within the deadline (status in *status).
bool wait_exit(pid_t pid, std::chrono::milliseconds deadline, int* status) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  while (std::chrono::steady_clock::now() < until) {
    if (waitpid(pid, status, WNOHANG) == pid) return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

class IoWorkerProcess : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_dir_ = new std::string(group_test::temp_dir("io-model"));
    model_path_ = new std::string(group_test::convert_golden("qwen3moe_odd", "", *model_dir_));
  }
  static void TearDownTestSuite() {
    fs::remove_all(*model_dir_);
    delete model_dir_;
    delete model_path_;
  }

  // Creates the arena and the manifest, starts the worker and waits for its Health.
  void start(pid_t coordinator) {
    dir_ = group_test::temp_dir("io");
    model_ = std::make_unique<model::Model>(model::Model::load(*model_path_));
    // Layer 0's experts, each part on a 4 KiB boundary as arena slots are, then spare room.
    const std::int64_t n_expert = model_->hp.n_expert;
    std::uint64_t at = 0;
    for (int w = 0; w < 3; ++w) {
      const gguf::TensorInfo* t = model_->file.find_tensor(kExpertTensors[w]);
      ASSERT_NE(t, nullptr) << kExpertTensors[w];
      const std::uint64_t per = t->n_bytes / static_cast<std::uint64_t>(n_expert);
      for (std::int64_t e = 0; e < n_expert; ++e) {
        slots_[w].push_back(at);
        at += (per + 4095) / 4096 * 4096;
      }
    }
    experts_bytes_ = at;
    arena_ = std::make_unique<shm::ShmSegment>(shm::ShmSegment::create(
        {"moraine-iotest-" + std::to_string(getpid()), "arena", at + (8 << 20) + 4321, false, false}));
    group::GroupManifest man;
    man.model_path = *model_path_;
    man.group_prefix = "moraine-iotest-" + std::to_string(getpid());
    man.exchange_locator = arena_->locator();   // the io_worker maps the arena only
    man.arena_locator = arena_->locator();
    man.coordinator_pid = static_cast<std::uint32_t>(coordinator);
    man.coordinator_start_ticks = shm::process_start_ticks(man.coordinator_pid);
    man.n_cpu_workers = 1;
    man.max_tokens = 8;
    man.write(group::manifest_path(dir_));

    const std::string bin = (fs::path(MORAINE_BUILD_DIR) / "io_worker" / "moraine-io-worker").string();
    const std::string log = dir_ + "/io_worker.log";
    worker_ = fork();
    if (worker_ == 0) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
      }
      execl(bin.c_str(), bin.c_str(), "--socket-dir", dir_.c_str(), "--queue-depth", "8", "--chunk-kib", "64",
            static_cast<char*>(nullptr));
      _exit(127);
    }
    const std::string e = group::wait_serving(group::control_address(dir_, kInstance), 60s);
    ASSERT_EQ(e, "") << "io_worker did not come up: " << log_text();
  }

  void TearDown() override {
    if (worker_ > 0) {
      kill(worker_, SIGTERM);
      int status = 0;
      if (!wait_exit(worker_, 20s, &status)) {
        ADD_FAILURE() << "io_worker ignored SIGTERM";
        kill(worker_, SIGKILL);
        waitpid(worker_, &status, 0);
      }
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "io_worker stopped with status " << status;
    }
    arena_.reset();
    if (!HasFailure()) fs::remove_all(dir_);
  }

  std::string log_text() const {
    std::ifstream in(dir_ + "/io_worker.log");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  jobs::JobReply call(const jobs::JobEnvelope& job) {
    zmq::context_t ctx(1);
    messaging::JobClient client(ctx, group::jobs_endpoint(dir_, kInstance));
    jobs::JobReply reply;
    EXPECT_EQ(client.call(job, reply, 30s), "");
    return reply;
  }

  control::StatsReply stats() {
    auto stub = control::Control::NewStub(
        grpc::CreateChannel(group::control_address(dir_, kInstance), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 10s);
    control::StatsReply reply;
    EXPECT_TRUE(stub->Stats(&ctx, {}, &reply).ok());
    return reply;
  }

  static std::vector<std::byte> file_bytes(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::vector<char> v((std::istreambuf_iterator<char>(in)), {});
    std::vector<std::byte> out(v.size());
    std::memcpy(out.data(), v.data(), v.size());
    return out;
  }

  static jobs::ReadRange* add_range(jobs::ReadJobList& list, std::uint32_t file, std::uint64_t offset, std::uint64_t dest,
                                    std::uint64_t length, std::uint32_t segment = group::kArenaSegmentId) {
    jobs::ReadRange* r = list.add_ranges();
    r->set_file_index(file);
    r->set_file_offset(offset);
    r->mutable_dest()->set_segment_id(segment);
    r->mutable_dest()->set_offset(dest);
    r->mutable_dest()->set_length(length);
    return r;
  }

  static std::string* model_dir_;
  static std::string* model_path_;
  std::string dir_;
  std::unique_ptr<model::Model> model_;
  std::array<std::vector<std::uint64_t>, 3> slots_;   // [part][expert]: arena offset
  std::uint64_t experts_bytes_ = 0;
  std::unique_ptr<shm::ShmSegment> arena_;
  pid_t worker_ = -1;
};
std::string* IoWorkerProcess::model_dir_ = nullptr;
std::string* IoWorkerProcess::model_path_ = nullptr;

TEST_F(IoWorkerProcess, ReadJobListFillsTheArenaAndStatsCountIt) {
  ASSERT_NO_FATAL_FAILURE(start(getpid()));
  const std::vector<std::byte> file = file_bytes(*model_path_);
  ASSERT_GT(file.size(), 1u << 16);
  std::byte* arena = arena_->data();
  std::memset(arena, 0x5A, arena_->data_bytes());
  std::mt19937_64 rng(2026);

  // Random ranges: any offset, 1 byte to 1/8 of the file, destinations of any phase, disjoint.
  std::uint64_t total = 0, n_ranges = 0;
  for (int job = 0; job < 4; ++job) {
    jobs::JobEnvelope env;
    env.set_version(messaging::kJobProtocolVersion);
    env.set_seq(static_cast<std::uint64_t>(job + 1));
    jobs::ReadJobList& list = *env.mutable_read_jobs();
    list.set_step_seq(static_cast<std::uint64_t>(job));
    list.set_layer(0);
    const std::uint64_t region = arena_->data_bytes() / 4, base = region * static_cast<std::uint64_t>(job);
    std::uint64_t cursor = base, job_bytes = 0;
    std::vector<std::tuple<std::uint64_t, std::uint64_t, std::uint64_t>> want;   // dest, file offset, length
    for (int i = 0; i < 24; ++i) {
      const std::uint64_t len = 1 + rng() % std::min<std::uint64_t>(file.size() / 8, region / 32);
      const std::uint64_t off = rng() % 3 == 0 ? file.size() - len : rng() % (file.size() - len + 1);
      // Half share the file offset's 4 KiB phase: their aligned body goes by O_DIRECT straight
      // into the shared-memory arena; the rest go through the bounce buffer.
      const std::uint64_t dest = rng() % 2 ? (cursor + 4095) / 4096 * 4096 + off % 4096 : cursor + rng() % 5000;
      if (dest + len > base + region) break;
      add_range(list, 0, off, dest, len);
      want.emplace_back(dest, off, len);
      cursor = dest + len;
      job_bytes += len;
    }
    const jobs::JobReply reply = call(env);
    ASSERT_EQ(reply.status(), jobs::JOB_OK) << reply.error();
    EXPECT_EQ(reply.seq(), env.seq());
    EXPECT_EQ(reply.bytes_read(), job_bytes);
    EXPECT_GT(reply.worker_us(), 0u);
    for (const auto& [dest, off, len] : want) {
      ASSERT_EQ(std::memcmp(arena + dest, file.data() + off, len), 0) << "dest " << dest << " file [" << off << ", +" << len << ")";
    }
    total += job_bytes;
    n_ranges += want.size();
  }

  // The use it is for: layer 0's experts (gate, up, down) from the file into their arena slots.
  const std::int64_t n_expert = model_->hp.n_expert;
  const auto& names = kExpertTensors;
  jobs::JobEnvelope env;
  env.set_version(messaging::kJobProtocolVersion);
  env.set_seq(99);
  env.mutable_read_jobs()->set_layer(0);
  std::uint64_t expert_total = 0;
  std::memset(arena, 0, experts_bytes_);
  for (int w = 0; w < 3; ++w) {
    const gguf::TensorInfo* t = model_->file.find_tensor(names[w]);
    ASSERT_NE(t, nullptr) << names[w];
    const std::uint64_t per = t->n_bytes / static_cast<std::uint64_t>(n_expert);
    for (std::int64_t e = 0; e < n_expert; e += 2) {   // every other expert: the rest must stay zero
      add_range(*env.mutable_read_jobs(), t->shard, model_->file.data_offset(t->shard) + t->offset + per * e,
                slots_[w][static_cast<std::size_t>(e)], per);
      expert_total += per;
    }
  }
  const jobs::JobReply reply = call(env);
  ASSERT_EQ(reply.status(), jobs::JOB_OK) << reply.error();
  EXPECT_EQ(reply.bytes_read(), expert_total);
  for (int w = 0; w < 3; ++w) {
    const gguf::TensorInfo* t = model_->file.find_tensor(names[w]);
    const std::uint64_t per = t->n_bytes / static_cast<std::uint64_t>(n_expert);
    const std::vector<std::byte> zero(per, std::byte{0});
    for (std::int64_t e = 0; e < n_expert; ++e) {
      const std::byte* got = arena + slots_[w][static_cast<std::size_t>(e)];
      if (e % 2 == 0) {
        EXPECT_EQ(std::memcmp(got, t->data + per * e, per), 0) << names[w] << " expert " << e;
      } else {
        EXPECT_EQ(std::memcmp(got, zero.data(), per), 0) << names[w] << " expert " << e << " was not asked for";
      }
    }
  }
  total += expert_total;
  n_ranges += static_cast<std::uint64_t>(env.read_jobs().ranges_size());

  const control::StatsReply s = stats();
  EXPECT_EQ(s.role(), control::ROLE_IO_WORKER);
  EXPECT_EQ(s.instance(), kInstance);
  ASSERT_EQ(s.stages_size(), 1);
  EXPECT_EQ(s.stages(0).name(), "io");
  EXPECT_EQ(s.stages(0).bytes_read(), total);
  EXPECT_EQ(s.stages(0).steps(), n_ranges);
  EXPECT_EQ(s.stages(0).latency().samples(), n_ranges);
  EXPECT_GT(s.stages(0).latency().p50_us(), 0.0);
  EXPECT_EQ(s.counters().at("jobs"), 5u);
  EXPECT_GE(s.counters().at("reads"), n_ranges);
  EXPECT_EQ(s.shm_mapped_bytes(), arena_->data_bytes());
  // The model sits on the build disk, which allows O_DIRECT (uring_reader_test checks that):
  // unaligned ranges were bounced, the aligned bodies of same-phase ones were not.
  EXPECT_EQ(s.counters().at("o_direct"), 1u) << log_text();
  EXPECT_GT(s.counters().at("bounce_bytes"), 0u);
  EXPECT_LT(s.counters().at("bounce_bytes"), total);
}

TEST_F(IoWorkerProcess, MalformedJobsGetBadRequestAndTheWorkerKeepsServing) {
  ASSERT_NO_FATAL_FAILURE(start(getpid()));
  const std::uint64_t fsize = fs::file_size(*model_path_), abytes = arena_->data_bytes();
  std::mt19937_64 rng(77);
  struct Bad {
    const char* what;
    std::uint32_t file, segment;
    std::uint64_t offset, dest, length;
    const char* expect;
  };
  const std::uint64_t off = rng() % 1000, dst = rng() % 1000;
  const Bad bad[] = {
      {"exchange segment", 0, group::kExchangeSegmentId, off, dst, 100, "unknown segment id 1"},
      {"dest past the arena", 0, group::kArenaSegmentId, off, abytes - 50, 100, "outside segment 2"},
      {"second shard", 1, group::kArenaSegmentId, off, dst, 100, "file_index 1 is not below the file count 1"},
      {"past the file", 0, group::kArenaSegmentId, fsize - 10, dst, 11, "runs past the end of file 0"},
      {"offset wraps", 0, group::kArenaSegmentId, ~std::uint64_t{0} - 3, dst, 8, "runs past the end of file 0"},
      {"zero length", 0, group::kArenaSegmentId, off, dst, 0, "less than the 1 bytes"},
  };
  zmq::context_t ctx(1);
  messaging::JobClient client(ctx, group::jobs_endpoint(dir_, kInstance));
  for (const Bad& b : bad) {
    jobs::JobEnvelope env;
    env.set_version(messaging::kJobProtocolVersion);
    env.set_seq(7);
    add_range(*env.mutable_read_jobs(), 0, 0, 0, 16);   // a good range first: nothing is read when one is bad
    add_range(*env.mutable_read_jobs(), b.file, b.offset, b.dest, b.length, b.segment);
    jobs::JobReply reply;
    ASSERT_EQ(client.call(env, reply, 10s), "") << b.what;
    EXPECT_EQ(reply.status(), jobs::JOB_BAD_REQUEST) << b.what;
    EXPECT_NE(reply.error().find(b.expect), std::string::npos) << b.what << ": " << reply.error();
    EXPECT_NE(reply.error().find("read_jobs.ranges[1]"), std::string::npos) << b.what << ": " << reply.error();
  }
  {
    jobs::JobEnvelope env;
    env.set_version(messaging::kJobProtocolVersion);
    env.mutable_read_jobs()->set_layer(static_cast<std::uint32_t>(model_->hp.n_layer));
    add_range(*env.mutable_read_jobs(), 0, 0, 0, 16);
    jobs::JobReply reply;
    ASSERT_EQ(client.call(env, reply, 10s), "");
    EXPECT_EQ(reply.status(), jobs::JOB_BAD_REQUEST);
    EXPECT_NE(reply.error().find("read_jobs.layer"), std::string::npos) << reply.error();
    env.mutable_read_jobs()->set_layer(0);
    env.mutable_read_jobs()->clear_ranges();
    ASSERT_EQ(client.call(env, reply, 10s), "");
    EXPECT_EQ(reply.status(), jobs::JOB_BAD_REQUEST);
    EXPECT_NE(reply.error().find("no ranges"), std::string::npos) << reply.error();
  }
  std::vector<std::byte> garbage(64);
  for (auto& g : garbage) g = static_cast<std::byte>(rng());
  jobs::JobReply reply;
  ASSERT_EQ(client.call_raw(garbage, reply, 10s), "");
  EXPECT_EQ(reply.status(), jobs::JOB_BAD_REQUEST);
  // A ping on the same socket is answered.
  {
    jobs::JobEnvelope env;
    env.set_version(messaging::kJobProtocolVersion);
    env.mutable_ping();
    ASSERT_EQ(client.call(env, reply, 10s), "");
    EXPECT_EQ(reply.status(), jobs::JOB_OK) << reply.error();
  }
  // Still serving, and nothing was read for the rejected jobs.
  std::memset(arena_->data(), 0, 4096);
  jobs::JobEnvelope env;
  env.set_version(messaging::kJobProtocolVersion);
  const std::uint64_t good_off = rng() % (fsize - 4000);
  add_range(*env.mutable_read_jobs(), 0, good_off, 123, 3000);
  ASSERT_EQ(client.call(env, reply, 10s), "");
  ASSERT_EQ(reply.status(), jobs::JOB_OK) << reply.error();
  EXPECT_EQ(reply.bytes_read(), 3000u);
  const std::vector<std::byte> file = file_bytes(*model_path_);
  EXPECT_EQ(std::memcmp(arena_->data() + 123, file.data() + good_off, 3000), 0);
  EXPECT_EQ(stats().stages(0).bytes_read(), 3000u);
  int status = 0;
  EXPECT_EQ(waitpid(worker_, &status, WNOHANG), 0) << "the worker exited: " << log_text();
}

// Several cpu_expert_workers ask at once, each on its own REQ socket: every job is answered
// with its own bytes.
TEST_F(IoWorkerProcess, ConcurrentClientsAreAllServed) {
  ASSERT_NO_FATAL_FAILURE(start(getpid()));
  const std::vector<std::byte> file = file_bytes(*model_path_);
  constexpr int kClients = 4, kJobs = 12;
  const std::uint64_t region = arena_->data_bytes() / kClients;
  std::vector<std::string> errors(kClients);
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937_64 rng(500 + static_cast<std::uint64_t>(c));
      zmq::context_t ctx(1);
      messaging::JobClient client(ctx, group::jobs_endpoint(dir_, kInstance));
      for (int j = 0; j < kJobs && errors[c].empty(); ++j) {
        jobs::JobEnvelope env;
        env.set_version(messaging::kJobProtocolVersion);
        env.set_seq(static_cast<std::uint64_t>(j + 1));
        const std::uint64_t len = 1 + rng() % std::min<std::uint64_t>(region, file.size() / 4);
        const std::uint64_t off = rng() % (file.size() - len + 1);
        const std::uint64_t dest = region * static_cast<std::uint64_t>(c) + rng() % (region - len + 1);
        add_range(*env.mutable_read_jobs(), 0, off, dest, len);
        jobs::JobReply reply;
        if (std::string e = client.call(env, reply, 30s); !e.empty()) {
          errors[c] = e;
        } else if (reply.status() != jobs::JOB_OK || reply.bytes_read() != len || reply.seq() != env.seq()) {
          errors[c] = "job " + std::to_string(j) + ": status " + std::to_string(reply.status()) + " " + reply.error();
        } else if (std::memcmp(arena_->data() + dest, file.data() + off, len) != 0) {
          errors[c] = "job " + std::to_string(j) + ": arena [" + std::to_string(dest) + ", +" + std::to_string(len) +
                      ") differs from file offset " + std::to_string(off);
        }
      }
    });
  }
  for (std::thread& t : clients) t.join();
  for (int c = 0; c < kClients; ++c) EXPECT_EQ(errors[c], "") << "client " << c;
  EXPECT_EQ(stats().counters().at("jobs"), static_cast<std::uint64_t>(kClients * kJobs));
}

TEST_F(IoWorkerProcess, ExitsWhenTheCoordinatorIsGone) {
  const pid_t coordinator = fork();
  if (coordinator == 0) {
    pause();
    _exit(0);
  }
  ASSERT_NO_FATAL_FAILURE(start(coordinator));
  kill(coordinator, SIGKILL);
  int status = 0;
  waitpid(coordinator, &status, 0);
  ASSERT_TRUE(wait_exit(worker_, 20s, &status)) << "io_worker outlived its coordinator: " << log_text();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << log_text();
  EXPECT_NE(log_text().find("coordinator"), std::string::npos);
  worker_ = -1;
}

}  // namespace
