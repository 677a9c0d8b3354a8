// The HTTP front end while its coordinator is gone and once it is back (serve_fault_test's two
// findings, in process with a stand-in coordinator): a request meanwhile is a 503 that names the
// coordinator, with Retry-After; and the front end reconnects within about a second of the
// coordinator's socket coming back, however long it was away (gRPC's default backoff had grown
// to seconds: up to 9 s of 503s after a restart that took 0.5 s).
#include <httplib.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "coordinator/group_layout.h"
#include "proto/generate.grpc.pb.h"
#include "server/http_server.h"
#include "tests/group/group_harness.h"

namespace moraine::server {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// Answers every Generate with one chunk, "back", finished.
class StandIn final : public generate::Coordinator::Service {
  grpc::Status Generate(grpc::ServerContext*, const generate::GenerateRequest*,
                        grpc::ServerWriter<generate::GenerateChunk>* w) override {
    generate::GenerateChunk c;
    c.set_text("back");
    c.add_token_ids(7);
    c.set_finish(generate::FINISH_LENGTH);
    w->Write(c);
    return grpc::Status::OK;
  }
};

TEST(CoordinatorReconnect, GoneIsA503NamingItAndBackIsServedWithinASecond) {
  const std::string dir = group_test::temp_dir("reconnect");
  HttpOptions o;
  o.port = 0;
  o.model_ids = {"m"};
  o.socket_dir = dir;
  HttpServer server(o);
  const int port = server.bind();
  std::thread listener([&] { server.listen(); });
  server.set_ready(true);
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(10, 0);
  const std::string body = json{{"prompt", "x"}, {"max_tokens", 1}}.dump();

  // Gone for 6 s of requests: by then gRPC's default backoff waits ~4 s between attempts.
  const auto gone_until = Clock::now() + 6s;
  int refused = 0;
  while (Clock::now() < gone_until) {
    const auto r = c.Post("/v1/completions", body, "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 503) << r->body;
    const json e = json::parse(r->body)["error"];
    EXPECT_NE(e["message"].get<std::string>().find("the coordinator is not reachable"), std::string::npos) << r->body;
    EXPECT_EQ(e["type"], "service_unavailable");
    EXPECT_EQ(r->get_header_value("Retry-After"), "1");
    ++refused;
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_GT(refused, 10);

  StandIn standin;
  grpc::ServerBuilder b;
  b.AddListeningPort(group::control_address(dir, group::kCoordinatorInstance), grpc::InsecureServerCredentials());
  b.RegisterService(&standin);
  std::unique_ptr<grpc::Server> coordinator = b.BuildAndStart();
  ASSERT_TRUE(coordinator);
  const auto back = Clock::now();
  double served_after = -1;
  while (Clock::now() - back < 15s) {
    const auto r = c.Post("/v1/completions", body, "application/json");
    if (r && r->status == 200) {
      served_after = std::chrono::duration<double>(Clock::now() - back).count();
      EXPECT_EQ(json::parse(r->body)["choices"][0]["text"], "back") << r->body;
      break;
    }
    std::this_thread::sleep_for(20ms);
  }
  std::printf("served %.2f s after the coordinator's socket came back (%d refused while it was gone)\n", served_after, refused);
  EXPECT_GE(served_after, 0) << "not served within 15 s of the coordinator coming back";
  EXPECT_LT(served_after, 1.5) << "the front end waited out a reconnect backoff";
  coordinator->Shutdown();
  server.drain_and_stop(100ms);
  listener.join();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace moraine::server
