// moraine: the command-line client of a running group.
//   moraine generate [--socket-dir DIR] -p TEXT | --tokens IDS [-n N] [--temp T] [--json]
//   moraine stats [--socket-dir DIR] [--json]
// stats asks every process found in the socket directory (coordinator, gpu_worker-*,
// cpu_expert_worker-*) over gRPC and prints one table per process, a row per stage.
#include <CLI/CLI.hpp>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>

#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include "common/tokenizer/token_id_list.h"
#include "coordinator/group_layout.h"
#include "proto/control.grpc.pb.h"
#include "proto/generate.grpc.pb.h"

namespace {

using namespace moraine;
namespace fs = std::filesystem;

int generate_cmd(const std::string& dir, const std::string& prompt, const std::string& tokens, int n,
                 float temp, uint64_t seed, bool json) {
  auto stub = generate::Coordinator::NewStub(
      grpc::CreateChannel(group::control_address(dir, group::kCoordinatorInstance), grpc::InsecureChannelCredentials()));
  generate::GenerateRequest req;
  if (!tokens.empty()) {
    for (int32_t id : tokenizer::parse_token_id_list(tokens)) req.mutable_token_ids()->add_ids(static_cast<uint32_t>(id));
  } else {
    req.set_prompt(prompt);
  }
  req.mutable_sampling()->set_temperature(temp);
  req.mutable_sampling()->set_max_tokens(static_cast<uint32_t>(n));
  req.mutable_sampling()->set_seed(seed);
  grpc::ClientContext ctx;
  auto reader = stub->Generate(&ctx, req);
  generate::GenerateChunk chunk;
  std::vector<uint32_t> ids;
  std::string text, error;
  generate::GenerateTiming timing;
  std::string finish;
  while (reader->Read(&chunk)) {
    for (uint32_t id : chunk.token_ids()) ids.push_back(id);
    text += chunk.text();
    if (!json) std::cout << chunk.text() << std::flush;
    if (!chunk.error().empty()) error = chunk.error();
    if (chunk.finish() != generate::FINISH_REASON_UNSPECIFIED) {
      finish = generate::FinishReason_Name(chunk.finish());
      timing = chunk.timing();
    }
  }
  const grpc::Status st = reader->Finish();
  if (!st.ok()) {
    std::cerr << "moraine generate: " << st.error_message() << "\n";
    return 1;
  }
  if (json) {
    nlohmann::json j;
    j["generated_ids"] = ids;
    j["text"] = text;
    j["finish"] = finish;
    j["prompt_tokens"] = timing.prompt_tokens();
    j["prefill_us"] = timing.prefill_us();
    j["decode_us"] = timing.decode_us();
    std::cout << j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
  } else {
    std::cout << std::endl;
  }
  return error.empty() ? 0 : 1;
}

int stats_cmd(const std::string& dir, bool json) {
  std::vector<std::string> instances;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".sock") instances.push_back(e.path().stem().string());
  }
  std::sort(instances.begin(), instances.end());
  if (instances.empty()) {
    std::cerr << "moraine stats: no process sockets in " << dir << "\n";
    return 1;
  }
  nlohmann::json all = nlohmann::json::array();
  int failures = 0;
  for (const std::string& inst : instances) {
    auto stub = control::Control::NewStub(grpc::CreateChannel(group::control_address(dir, inst), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    control::StatsReply r;
    const grpc::Status st = stub->Stats(&ctx, {}, &r);
    if (!st.ok()) {
      std::cerr << inst << ": " << st.error_message() << "\n";
      ++failures;
      continue;
    }
    nlohmann::json p;
    p["instance"] = r.instance();
    p["role"] = control::Role_Name(r.role());
    p["uptime_us"] = r.uptime_us();
    p["shm_mapped_bytes"] = r.shm_mapped_bytes();
    p["shm_owned_bytes"] = r.shm_owned_bytes();
    for (const auto& [k, v] : r.counters()) p["counters"][k] = v;
    p["stages"] = nlohmann::json::array();
    for (const control::StageStats& s : r.stages()) {
      p["stages"].push_back({{"name", s.name()}, {"tokens", s.tokens()}, {"steps", s.steps()},
                             {"queue_depth", s.queue_depth()}, {"experts_computed", s.experts_computed()},
                             {"bytes_read", s.bytes_read()}, {"p50_us", s.latency().p50_us()},
                             {"p90_us", s.latency().p90_us()}, {"p99_us", s.latency().p99_us()},
                             {"max_us", s.latency().max_us()}});
    }
    all.push_back(p);
  }
  if (json) {
    std::cout << all.dump(1) << std::endl;
  } else {
    for (const auto& p : all) {
      std::cout << p["instance"].get<std::string>() << " (" << p["role"].get<std::string>() << ", shm "
                << p["shm_mapped_bytes"].get<uint64_t>() << " bytes mapped)\n";
      std::cout << "  " << std::left << std::setw(18) << "stage" << std::right << std::setw(10) << "tokens" << std::setw(9)
                << "steps" << std::setw(7) << "queue" << std::setw(10) << "experts" << std::setw(14) << "bytes_read"
                << std::setw(10) << "p50_us" << std::setw(10) << "p90_us" << std::setw(10) << "p99_us" << "\n";
      for (const auto& s : p["stages"]) {
        std::cout << "  " << std::left << std::setw(18) << s["name"].get<std::string>() << std::right << std::setw(10)
                  << s["tokens"].get<uint64_t>() << std::setw(9) << s["steps"].get<uint64_t>() << std::setw(7)
                  << s["queue_depth"].get<uint64_t>() << std::setw(10) << s["experts_computed"].get<uint64_t>()
                  << std::setw(14) << s["bytes_read"].get<uint64_t>() << std::fixed << std::setprecision(1)
                  << std::setw(10) << s["p50_us"].get<double>() << std::setw(10) << s["p90_us"].get<double>()
                  << std::setw(10) << s["p99_us"].get<double>() << "\n";
      }
    }
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moraine: client of a running moraine group"};
  app.require_subcommand(1);
  std::string dir = "/tmp/moraine";
  std::string prompt, tokens;
  int n = 16;
  float temp = 0.0f;
  uint64_t seed = 0;
  bool json = false;
  CLI::App* gen = app.add_subcommand("generate", "generate tokens");
  gen->add_option("--socket-dir", dir, "group socket directory");
  auto* p = gen->add_option("-p,--prompt", prompt, "prompt text");
  auto* t = gen->add_option("--tokens", tokens, "prompt as comma-separated token ids");
  p->excludes(t);
  gen->add_option("-n", n, "tokens to generate");
  gen->add_option("--temp", temp, "temperature (0 = greedy)");
  gen->add_option("--seed", seed, "sampling seed");
  gen->add_flag("--json", json, "print ids and timings as JSON");
  CLI::App* stats = app.add_subcommand("stats", "per-stage counters of every process");
  stats->add_option("--socket-dir", dir, "group socket directory");
  stats->add_flag("--json", json, "print JSON");
  CLI11_PARSE(app, argc, argv);
  try {
    if (gen->parsed()) {
      if (prompt.empty() && tokens.empty()) throw std::invalid_argument("generate: give -p TEXT or --tokens IDS");
      return generate_cmd(dir, prompt, tokens, n, temp, seed, json);
    }
    return stats_cmd(dir, json);
  } catch (const std::exception& e) {
    std::cerr << "moraine: " << e.what() << "\n";
    return 1;
  }
}
