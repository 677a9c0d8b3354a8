// moraine: the command-line client of a running group.
//   moraine generate [--socket-dir DIR] -p TEXT [--chat [--system TEXT]] | --tokens IDS [-n N]
//                    [--temp T --top-k K --top-p P --seed S] [--json]
//   moraine stats [--socket-dir DIR] [--json]
//   moraine serve -m MODEL [--host H] [--port P] [--parallel N] [--batch-decode] [--api-key KEY] [--config FILE] [group options]
//   moraine chat (-m MODEL [group options] | --url http://HOST:PORT) [--system TEXT]
// stats asks every process found in the socket directory (coordinator, gpu_worker-*,
// cpu_expert_worker-*) over gRPC and prints one table per process, a row per stage.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>

#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include "common/tokenizer/token_id_list.h"
#include "coordinator/group_layout.h"
#include "server/chat_client.h"
#include "server/serve.h"
#include "proto/control.grpc.pb.h"
#include "proto/generate.grpc.pb.h"

namespace {

using namespace moraine;
namespace fs = std::filesystem;

struct GenerateArgs {
  std::string prompt, tokens, system;
  bool chat = false;  // send the prompt as a user message: the coordinator applies the chat template
  int n = 16;
  float temp = 0.0f, top_p = 1.0f;
  uint32_t top_k = 0;
  uint64_t seed = 0;
  bool speculate = false;   // suffix drafts from the context, verified: the same tokens as greedy (temp 0)
  bool ignore_eos = false;  // generate all n tokens, past end-of-generation tokens too
  std::vector<std::string> stop;   // stop strings (the text ends before the first)
};

int generate_cmd(const std::string& dir, const GenerateArgs& a, bool json) {
  auto stub = generate::Coordinator::NewStub(
      grpc::CreateChannel(group::control_address(dir, group::kCoordinatorInstance), grpc::InsecureChannelCredentials()));
  generate::GenerateRequest req;
  if (!a.tokens.empty()) {
    for (int32_t id : tokenizer::parse_token_id_list(a.tokens)) req.mutable_token_ids()->add_ids(static_cast<uint32_t>(id));
  } else if (a.chat) {
    auto* conv = req.mutable_messages();
    if (!a.system.empty()) {
      auto* m = conv->add_messages();
      m->set_role("system");
      m->set_content(a.system);
    }
    auto* m = conv->add_messages();
    m->set_role("user");
    m->set_content(a.prompt);
  } else {
    req.set_prompt(a.prompt);
  }
  req.mutable_sampling()->set_temperature(a.temp);
  req.mutable_sampling()->set_top_k(a.top_k);
  req.mutable_sampling()->set_top_p(a.top_p);
  req.mutable_sampling()->set_max_tokens(static_cast<uint32_t>(a.n));
  req.mutable_sampling()->set_seed(a.seed);
  req.mutable_sampling()->set_ignore_eos(a.ignore_eos);
  for (const std::string& s : a.stop) req.mutable_sampling()->add_stop(s);
  req.set_speculate(a.speculate);
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
    j["cached_tokens"] = timing.cached_tokens();
    j["prefill_us"] = timing.prefill_us();
    j["decode_us"] = timing.decode_us();
    j["drafted_tokens"] = timing.drafted_tokens();
    j["accepted_draft_tokens"] = timing.accepted_draft_tokens();
    std::cout << j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
  } else {
    std::cout << std::endl;
    // The timings on stderr, as llama.cpp's tools print theirs: stdout stays the text.
    const double prefill_s = static_cast<double>(timing.prefill_us()) * 1e-6, decode_s = static_cast<double>(timing.decode_us()) * 1e-6;
    const size_t decoded = ids.empty() ? 0 : ids.size() - 1;   // the first token comes with the prefill
    std::fprintf(stderr, "moraine generate: prompt %u tokens at %.1f tok/s, %zu generated at %.1f tok/s (%s)\n",
                 timing.prompt_tokens(), prefill_s > 0 ? timing.prompt_tokens() / prefill_s : 0.0, ids.size(),
                 decode_s > 0 ? static_cast<double>(decoded) / decode_s : 0.0, finish.c_str());
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
      if (!p.contains("counters")) continue;
      const auto& c = p["counters"];
      // The coordinator's placement (coordinator/placement.h), as it logged it at start.
      if (c.contains("placement_vram_experts")) {
        std::cout << "  " << std::left << std::setw(6) << "tier" << std::right << std::setw(9) << "experts" << std::setw(16)
                  << "bytes" << "\n";
        for (const char* t : {"vram", "ram", "file"}) {
          std::string upper(t);
          for (char& ch : upper) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
          std::cout << "  " << std::left << std::setw(6) << upper << std::right << std::setw(9)
                    << c["placement_" + std::string(t) + "_experts"].get<uint64_t>() << std::setw(16)
                    << c["placement_" + std::string(t) + "_bytes"].get<uint64_t>() << "\n";
        }
        std::cout << "  VRAM also holds dense " << c["placement_dense_bytes"].get<uint64_t>() << " + KV/state "
                  << c["placement_kv_bytes"].get<uint64_t>() << " bytes; RAM also the file cache "
                  << c.value("placement_file_cache_bytes", uint64_t{0}) << " bytes ("
                  << c.value("placement_file_cache_slots", uint64_t{0}) << " slots)\n";
      }
      std::cout << "  counters:";
      for (const auto& [k, v] : c.items()) {
        if (k.rfind("placement_", 0) != 0 && k.rfind("layer_", 0) != 0) std::cout << " " << k << "=" << v.get<uint64_t>();
      }
      std::cout << "\n";
      // The gpu_worker's per-layer counters as one line of VRAM hit rates (layer_NNN_vram_slots
      // of layer_NNN_slots).
      std::string rates;
      for (int il = 0;; ++il) {
        char slots[40], vram[40];
        std::snprintf(slots, sizeof slots, "layer_%03d_slots", il);
        std::snprintf(vram, sizeof vram, "layer_%03d_vram_slots", il);
        if (!c.contains(slots) || !c.contains(vram)) break;
        const uint64_t n = c[slots].get<uint64_t>();
        char cell[24];
        std::snprintf(cell, sizeof cell, " %d:%.0f%%", il, n == 0 ? 0.0 : 100.0 * c[vram].get<uint64_t>() / n);
        rates += cell;
      }
      if (!rates.empty()) std::cout << "  VRAM hit rate per layer:" << rates << "\n";
    }
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace

// The group options `moraine serve` and `moraine chat -m` pass on to moraine-supervisor start.
void add_group_options(CLI::App* c, server::GroupStartOptions& g) {
  c->add_option("-m,--model", g.model, "GGUF model file");
  c->add_option("--vram", g.vram, "GPU memory budget (12G, 512M, unlimited, dense; the supervisor's default)");
  c->add_option("--ram", g.ram, "RAM budget of the expert arena (unlimited)");
  c->add_option("--backend", g.backend, "the gpu_worker's backend")->check(CLI::IsMember({"cpu", "cuda"}));
  c->add_option("--cpu-workers", g.cpu_workers, "cpu_expert_workers to run (2)");
  c->add_option("--ctx", g.ctx, "context to plan the KV cache for (0: min(4096, the model's))");
  c->add_option("--kv-type", g.kv_type, "KV cache element type (f16 with cuda, f32 with cpu)");
  c->add_option("--cache-ram", g.cache_ram,
                "host memory for earlier conversations' saved KV cache and state (8G; 0: only the last is reused)");
  c->add_option("--max-tokens", g.max_tokens, "rows of one step (prefill chunk, or a long step's window; default: the coordinator's choice)");
  c->add_option("--socket-dir", g.socket_dir, "the group's socket directory (default: a fresh one, removed at exit)");
  c->add_option("--supervisor-arg", g.supervisor_args,
                "an extra argument for moraine-supervisor start (repeat; e.g. --supervisor-arg=--gpu-threads=1)")
      ->allow_extra_args(false);
  c->add_option("--ready-timeout", g.ready_timeout_s, "seconds to wait for the group to serve (600)");
}

int main(int argc, char** argv) {
  CLI::App app{"moraine: run a model group behind an OpenAI-compatible server, chat with it, or query a group"};
  app.require_subcommand(1);
  // As the supervisor's: `serve --config FILE` reads a [serve] section for serve's options
  // (port = 8080); the same file goes to the supervisor, whose [start] section it reads.
  app.set_config("--config", "", "TOML/INI file: [serve] for serve's options, [start] for the group's (the supervisor's)");
  server::ServeOptions so;
  CLI::App* serve = app.add_subcommand("serve", "start a group and serve OpenAI's API over HTTP (foreground)");
  serve->fallthrough();
  add_group_options(serve, so.group);
  serve->add_option("--host", so.http.host, "address to listen on (127.0.0.1)");
  serve->add_option("--port", so.http.port, "port to listen on (8080; 0: any free one)");
  serve->add_option("--parallel", so.http.parallel,
                    "requests admitted at once, taking turns on the GPU (1); the group runs as many")
      ->check(CLI::PositiveNumber);
  serve->add_option("--queue", so.http.queue, "requests waiting beyond --parallel before 429 (64)")->check(CLI::NonNegativeNumber);
  bool batch_decode = false;
  serve->add_flag("--batch-decode", batch_decode,
                  "the --parallel requests decode together: one row each per step, every chosen expert read once for all "
                  "(--backend cpu so far; no speculation or prompt cache for them yet)");
  serve->add_option("--api-key", so.http.api_key, "require Authorization: Bearer KEY on every endpoint but /health");
  serve->add_option("--max-body", so.http.max_body_bytes, "largest request body in bytes (8 MiB); larger: 413")
      ->check(CLI::PositiveNumber);
  serve->add_option("--max-connections", so.http.max_connections,
                    "connections served at once; a request on one beyond them gets 429 with Retry-After "
                    "(default --parallel + --queue + 8)")
      ->check(CLI::NonNegativeNumber);
  serve->add_option("--log", so.group.log_path, "the group's log (default SOCKET_DIR/supervisor.log)");
  server::ChatOptions co;
  server::ServeOptions chat_serve;
  CLI::App* chat = app.add_subcommand("chat", "interactive chat, streaming (Ctrl-C stops an answer)");
  add_group_options(chat, chat_serve.group);
  chat->add_option("--url", co.url, "an OpenAI-compatible server (http://HOST:PORT) instead of -m MODEL");
  chat->add_option("--api-key", co.api_key, "Authorization: Bearer KEY for --url");
  chat->add_option("--system", co.system, "system message");
  chat->add_option("-n,--max-tokens-per-answer", co.max_tokens, "tokens per answer at most (0: the server's default)");
  chat->add_option("--temp", co.temperature, "temperature (0.7)");
  std::string dir = "/tmp/moraine";
  GenerateArgs ga;
  bool json = false;
  CLI::App* gen = app.add_subcommand("generate", "generate tokens");
  gen->add_option("--socket-dir", dir, "group socket directory");
  auto* p = gen->add_option("-p,--prompt", ga.prompt, "prompt text");
  auto* t = gen->add_option("--tokens", ga.tokens, "prompt as comma-separated token ids");
  p->excludes(t);
  auto* c = gen->add_flag("--chat", ga.chat, "send the prompt as a user message (the model's chat template applies)");
  c->excludes(t);
  gen->add_option("--system", ga.system, "system message (with --chat)")->needs(c);
  gen->add_option("-n", ga.n, "tokens to generate");
  gen->add_option("--temp", ga.temp, "temperature (0 = greedy)");
  gen->add_option("--top-k", ga.top_k, "keep the k most likely tokens (0 = off)");
  gen->add_option("--top-p", ga.top_p, "keep the smallest set of tokens with this much probability (1 = off)");
  gen->add_option("--seed", ga.seed, "sampling seed");
  gen->add_flag("--ignore-eos", ga.ignore_eos, "generate all -n tokens, past end-of-generation tokens too");
  gen->add_flag("--speculate", ga.speculate,
                "draft tokens (the model's MTP head, else the context's suffix automaton) and verify several per step; greedy: the same output, sampled: the same distribution (not the same tokens for a seed)");
  gen->add_flag("--json", json, "print ids and timings as JSON");
  gen->add_option("--stop", ga.stop, "stop string (repeat): the text ends before the first one")->allow_extra_args(false);
  CLI::App* stats = app.add_subcommand("stats", "per-stage counters of every process");
  stats->add_option("--socket-dir", dir, "group socket directory");
  stats->add_flag("--json", json, "print JSON");
  CLI11_PARSE(app, argc, argv);
  try {
    if (serve->parsed()) {
      if (app.get_option("--config")->count() > 0) so.group.config = app.get_option("--config")->as<std::string>();
      so.group.parallel = so.http.parallel;   // the coordinator runs as many as the server admits
      if (batch_decode) so.group.supervisor_args.push_back("--coordinator-arg=--batch-decode");
      return server::run_serve(so);
    }
    if (chat->parsed()) {
      if (co.url.empty() == chat_serve.group.model.empty()) throw std::invalid_argument("chat: give either --url URL or -m MODEL");
      if (!co.url.empty()) return server::run_chat(co, std::cin, std::cout);
      chat_serve.group.log_path = "";
      co.serve = chat_serve;
      return server::run_chat(co, std::cin, std::cout);
    }
    if (gen->parsed()) {
      if (ga.prompt.empty() && ga.tokens.empty()) throw std::invalid_argument("generate: give -p TEXT or --tokens IDS");
      return generate_cmd(dir, ga, json);
    }
    return stats_cmd(dir, json);
  } catch (const std::exception& e) {
    std::cerr << "moraine: " << e.what() << "\n";
    return 1;
  }
}
