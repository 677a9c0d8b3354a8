// The generated gRPC code links and works: a tiny in-process Control server on a Unix socket
// answers Health and Stats; an RPC it does not implement answers UNIMPLEMENTED.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "proto/control.grpc.pb.h"

namespace {

namespace control = moraine::control;
using namespace std::chrono_literals;

// Nearest-rank percentile of sorted samples.
double percentile(const std::vector<double>& sorted, double p) {
  const std::size_t rank = static_cast<std::size_t>(std::ceil(p / 100.0 * double(sorted.size())));
  return sorted[std::max<std::size_t>(rank, 1) - 1];
}

class TestControl final : public control::Control::Service {
 public:
  explicit TestControl(std::vector<double> latencies_us) : latencies_(std::move(latencies_us)) {
    std::sort(latencies_.begin(), latencies_.end());
  }

  grpc::Status Health(grpc::ServerContext*, const control::HealthRequest*, control::HealthReply* reply) override {
    reply->set_state(control::SERVING);
    reply->set_role(control::ROLE_CPU_EXPERT_WORKER);
    reply->set_pid(static_cast<std::uint32_t>(getpid()));
    reply->set_instance("cpu_expert_worker/node0");
    return grpc::Status::OK;
  }

  grpc::Status Stats(grpc::ServerContext*, const control::StatsRequest*, control::StatsReply* reply) override {
    reply->set_role(control::ROLE_CPU_EXPERT_WORKER);
    auto* stage = reply->add_stages();
    stage->set_name("expert_cpu");
    stage->set_tokens(latencies_.size());
    stage->set_experts_computed(latencies_.size() * 8);
    stage->set_bytes_read(latencies_.size() * 8 * 2654208ull);
    auto* h = stage->mutable_latency();
    const std::vector<double> bounds = {10, 20, 50, 100, 200, 500, 1000, INFINITY};
    for (double b : bounds) {
      h->add_upper_bounds_us(b);
      h->add_counts(0);
    }
    for (double v : latencies_) {
      const auto bucket = std::lower_bound(bounds.begin(), bounds.end(), v) - bounds.begin();
      h->set_counts(static_cast<int>(bucket), h->counts(static_cast<int>(bucket)) + 1);
      h->set_sum_us(h->sum_us() + v);
    }
    h->set_samples(latencies_.size());
    h->set_p50_us(percentile(latencies_, 50));
    h->set_p99_us(percentile(latencies_, 99));
    h->set_max_us(latencies_.back());
    (*reply->mutable_counters())["vram_hits"] = 1234;
    reply->set_shm_mapped_bytes(1ull << 30);
    return grpc::Status::OK;
  }

 private:
  std::vector<double> latencies_;
};

TEST(ControlService, HealthAndStatsOverUnixSocket) {
  std::mt19937_64 rng(2026);
  std::lognormal_distribution<double> latency(4.0, 0.8);  // ~55 us median, long tail
  std::vector<double> samples(5000);
  for (double& s : samples) s = latency(rng);

  const std::string socket_path = "/tmp/moraine-test-control-" + std::to_string(getpid()) + ".sock";
  TestControl service(samples);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + socket_path, grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr) << "could not listen on unix:" << socket_path;

  auto channel = grpc::CreateChannel("unix:" + socket_path, grpc::InsecureChannelCredentials());
  auto stub = control::Control::NewStub(channel);

  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 10s);
    control::HealthReply health;
    const grpc::Status status = stub->Health(&context, control::HealthRequest(), &health);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(health.state(), control::SERVING);
    EXPECT_EQ(health.pid(), static_cast<std::uint32_t>(getpid()));
    EXPECT_EQ(health.instance(), "cpu_expert_worker/node0");
  }
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 10s);
    control::StatsReply stats;
    const grpc::Status status = stub->Stats(&context, control::StatsRequest(), &stats);
    ASSERT_TRUE(status.ok()) << status.error_message();
    ASSERT_EQ(stats.stages_size(), 1);
    const auto& h = stats.stages(0).latency();
    ASSERT_EQ(h.counts_size(), h.upper_bounds_us_size());
    std::uint64_t total = 0;
    for (auto c : h.counts()) total += c;
    EXPECT_EQ(total, samples.size());
    EXPECT_EQ(h.samples(), samples.size());
    // Recompute independently on this side of the wire.
    std::vector<double> sorted = samples;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(h.p50_us(), sorted[2499]);
    EXPECT_EQ(h.p99_us(), sorted[4949]);
    EXPECT_EQ(h.max_us(), sorted.back());
    EXPECT_TRUE(std::isinf(h.upper_bounds_us(h.upper_bounds_us_size() - 1)));
    const auto below_50 = std::count_if(samples.begin(), samples.end(), [](double v) { return v <= 50; });
    EXPECT_EQ(h.counts(0) + h.counts(1) + h.counts(2), static_cast<std::uint64_t>(below_50));
    EXPECT_EQ(stats.counters().at("vram_hits"), 1234u);
  }
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 10s);
    control::DrainReply drain;
    const grpc::Status status = stub->Drain(&context, control::DrainRequest(), &drain);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  }
  server->Shutdown(std::chrono::system_clock::now() + 5s);
  ::unlink(socket_path.c_str());
}

TEST(ControlService, NoServerIsADeadlineNotAHang) {
  const std::string socket_path = "/tmp/moraine-test-control-absent-" + std::to_string(getpid()) + ".sock";
  auto stub = control::Control::NewStub(grpc::CreateChannel("unix:" + socket_path, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 300ms);
  control::HealthReply health;
  const auto start = std::chrono::steady_clock::now();
  const grpc::Status status = stub->Health(&context, control::HealthRequest(), &health);
  EXPECT_FALSE(status.ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

}  // namespace
