#include "tests/group/group_harness.h"

#include <signal.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/model/model.h"
#include "tests/reference/tiny_arch_model.h"
#include "common/reference/executor.h"
#include "common/sampling/sampler.h"
#include "common/tokenizer/tokenizer.h"
#include "coordinator/control_server.h"
#include "coordinator/group_layout.h"
#include "coordinator/placement.h"
#include "proto/control.grpc.pb.h"
#include "proto/generate.grpc.pb.h"

namespace moraine::group_test {

namespace fs = std::filesystem;
const fs::path kBuild = MORAINE_BUILD_DIR;
const fs::path kSource = MORAINE_SOURCE_DIR;

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string temp_dir(const std::string& tag) {
  static std::atomic<int> counter{0};
  const fs::path d = fs::temp_directory_path() /
                     ("moraine-group-" + tag + "-" + std::to_string(getpid()) + "-" + std::to_string(counter++));
  fs::remove_all(d);
  fs::create_directories(d);
  fs::permissions(d, fs::perms::owner_all, fs::perm_options::replace);   // a group refuses a socket directory others may enter
  return d.string();
}

std::string convert_golden(const std::string& name, const std::string& quant_args, const std::string& dir) {
  const std::string f32 = dir + "/" + name + "-f32.gguf";
  auto [rc, out] = run_command(shell_quote((kBuild / "tools" / "moraine-convert").string()) + " " +
                               shell_quote((kSource / "tests" / "golden" / name).string()) + " " + shell_quote(f32) +
                               " --outtype f32");
  if (rc != 0) throw std::runtime_error("moraine-convert " + name + ":\n" + out);
  if (quant_args.empty()) return f32;
  const std::string q = dir + "/" + name + "-q.gguf";
  std::tie(rc, out) = run_command(shell_quote((kBuild / "tools" / "moraine-quantize").string()) + " " + shell_quote(f32) +
                                  " " + shell_quote(q) + " " + quant_args);
  if (rc != 0) throw std::runtime_error("moraine-quantize " + name + ":\n" + out);
  return q;
}

std::string golden_quant_args(const std::string& weights) {
  if (weights == "f32") return "";
  if (weights == "q8_0") return "--default q8_0";
  // The hub types moraine reads from llama.cpp files: Q8_1 pairings (q4_1, q5_1) in the experts'
  // gate/up, IQ4_XS down, Q5_0 / IQ4_NL attention.
  if (weights == "hub")
    return "--map ffn_gate_exps=q4_1 --map ffn_up_exps=q5_1 --map ffn_down_exps=iq4_xs --map attn_q=q5_0 --map attn_output=iq4_nl --default q8_0";
  // The rest of issue 26's CUDA formats: Q4_0 / ternary experts, IQ4_NL / Q4_0 attention.
  if (weights == "hub_tq")
    return "--map ffn_gate_exps=q4_0 --map ffn_up_exps=tq1_0 --map ffn_down_exps=tq2_0 --map attn_q=iq4_nl --map attn_output=q4_0 --default q8_0";
  return "--map _exps.=q4_k --map attn_v=q6_k --map attn_output=q4_k --default q8_0";
}

std::vector<float> read_logits_dump(const std::string& path, size_t n) {
  std::ifstream in(path, std::ios::binary);
  std::vector<float> got(n);
  in.read(reinterpret_cast<char*>(got.data()), static_cast<std::streamsize>(n * sizeof(float)));
  EXPECT_EQ(static_cast<size_t>(in.gcount()), n * sizeof(float)) << "logits dump " << path << " too short";
  return got;
}

size_t first_bit_difference(const std::vector<float>& a, const std::vector<float>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (i >= b.size() || std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return i;
  }
  return a.size();
}

std::vector<int32_t> golden_prompt(const std::string& name) {
  std::ifstream in(kSource / "tests" / "golden" / name / "tokens.json");
  return nlohmann::json::parse(in).at("ids").get<std::vector<int32_t>>();
}

Group::Group(GroupOptions o) : o_(std::move(o)), dir_(o_.socket_dir.empty() ? temp_dir("sock") : o_.socket_dir) {
  group::LaunchOptions lo;
  lo.supervisor = (kSource / "deploy" / "moraine-supervisor").string();
  lo.socket_dir = dir_;
  lo.log_path = dir_ + "/supervisor.log";
  // The wrapper script must run this build's supervisor, not one from another build dir.
  lo.env = {{"MORAINE_BIN_DIR", (kBuild / "coordinator").string()}};
  lo.start_args = {"-m", o_.model, "--cpu-workers", std::to_string(o_.cpu_workers), "--handoff", o_.handoff,
                   "--gpu-threads", "1", "--bin-dir", (kBuild / "coordinator").string(),
                   "--vram", o_.vram.empty() ? "dense" : o_.vram, "--ram", o_.ram, "--backend", o_.backend,
                   "--max-tokens", std::to_string(o_.max_tokens)};
  if (o_.supervisor_defaults) {
    lo.start_args = {"-m", o_.model, "--cpu-workers", std::to_string(o_.cpu_workers), "--bin-dir", (kBuild / "coordinator").string()};
  } else {
    if (!o_.census.empty()) lo.start_args.insert(lo.start_args.end(), {"--census", o_.census});
    if (!o_.write_census) lo.start_args.push_back("--no-census");
    if (!o_.logits_dump.empty()) lo.start_args.insert(lo.start_args.end(), {"--logits-dump", o_.logits_dump});
  }
  lo.start_args.insert(lo.start_args.end(), o_.extra_args.begin(), o_.extra_args.end());
  try {
    launched_ = std::make_unique<group::LaunchedGroup>(lo);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("group did not come up: ") + e.what());
  }
  const std::string error = wait_all_serving(std::chrono::seconds(120));
  if (!error.empty()) {
    stop();
    throw std::runtime_error("group did not come up: " + error);
  }
}

std::string Group::wait_all_serving(std::chrono::milliseconds deadline) const {
  // The supervisor serves once it has seen every process serve; then each process itself.
  std::vector<std::string> instances = {group::kSupervisorInstance, group::kCoordinatorInstance, group::kGpuWorkerInstance};
  for (int i = 0; i < o_.cpu_workers; ++i) instances.push_back(group::cpu_worker_instance(i));
  for (const std::string& inst : instances) {
    // A supervisor that gave up (a process failed to start) exits: stop waiting then.
    const std::string e = group::wait_serving(group::control_address(dir_, inst), deadline,
                                              inst == group::kSupervisorInstance ? supervisor_pid() : -1);
    if (!e.empty()) return e;
  }
  return {};
}

pid_t Group::instance_pid(const std::string& instance) const {
  auto stub = control::Control::NewStub(grpc::CreateChannel(group::control_address(dir_, instance), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  control::HealthReply reply;
  const grpc::Status st = stub->Health(&ctx, {}, &reply);
  if (!st.ok()) throw std::runtime_error(instance + ": Health failed: " + st.error_message());
  return static_cast<pid_t>(reply.pid());
}

void Group::stop() { launched_.reset(); }

Group::~Group() {
  stop();
  // Keep the processes' logs of a failed test for whoever reads the failure.
  if (o_.socket_dir.empty() && !::testing::Test::HasFailure()) fs::remove_all(dir_);
}

Generation generate(const std::string& socket_dir, const std::vector<int32_t>& prompt, int n, bool check_logits,
                    bool speculate) {
  generate::SamplingParams sp;
  sp.set_max_tokens(static_cast<uint32_t>(n));
  sp.set_check_logits(check_logits);
  return generate_sampled(socket_dir, prompt, sp, speculate);
}

Generation generate_sampled(const std::string& socket_dir, const std::vector<int32_t>& prompt,
                            const generate::SamplingParams& sp, bool speculate) {
  auto stub = generate::Coordinator::NewStub(
      grpc::CreateChannel(group::control_address(socket_dir, group::kCoordinatorInstance), grpc::InsecureChannelCredentials()));
  generate::GenerateRequest req;
  for (int32_t id : prompt) req.mutable_token_ids()->add_ids(static_cast<uint32_t>(id));
  *req.mutable_sampling() = sp;
  req.set_speculate(speculate);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(180));
  auto reader = stub->Generate(&ctx, req);
  Generation g;
  generate::GenerateChunk chunk;
  while (reader->Read(&chunk)) {
    for (uint32_t id : chunk.token_ids()) g.ids.push_back(static_cast<int32_t>(id));
    if (!chunk.error().empty()) g.error = chunk.error();
    if (chunk.has_timing()) g.cached_tokens = chunk.timing().cached_tokens();
  }
  const grpc::Status st = reader->Finish();
  g.status_code = st.error_code();
  if (!st.ok() && g.error.empty()) g.error = st.error_message();
  return g;
}

std::string synth_model(const std::string& shape, const std::string& weights, const std::string& dir) {
  const std::string out = dir + "/" + shape + "-" + weights + ".gguf";
  // kmix: moraine-synth's own types (Q4_K experts, F32 biases and routers, Q8_0 the rest).
  const std::string types = weights == "f32" ? " --default f32 --map _exps.=f32" : weights == "kmix" ? "" : "?";
  if (types == "?") throw std::invalid_argument("synth_model: weights " + weights + ", expected f32 or kmix");
  auto [rc, out_text] = run_command(shell_quote((kBuild / "tools" / "synth" / "moraine-synth").string()) + " --shape " +
                                    shell_quote(shape) + " --vocab-size " + std::to_string(kSynthVocab) + types +
                                    " --seed 7 --threads 2 -o " + shell_quote(out));
  if (rc != 0) throw std::runtime_error("moraine-synth " + shape + ":\n" + out_text);
  return out;
}

std::string param_name(std::string s) {
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return s;
}

GoldenCase golden_case(const std::string& name, const std::string& weights, const std::string& tag, int n,
                       model::KvType kv) {
  GoldenCase g;
  g.dir = temp_dir(tag);
  if (name.rfind(kSynthPrefix, 0) == 0) {
    g.model = synth_model(name.substr(std::string(kSynthPrefix).size()), weights, g.dir);
    for (int i = 0; i < 24; ++i) g.prompt.push_back((37 + 101 * i) % kSynthVocab);
  } else if (name.rfind(kTinyPrefix, 0) == 0) {
    if (weights != "f32") throw std::invalid_argument("golden_case: tiny files are F32, not " + weights);
    const model::HParams spec = test::tiny_hparams(name.substr(std::string(kTinyPrefix).size()));
    std::vector<std::vector<float>> data;
    g.model = g.dir + "/tiny.gguf";
    test::tiny_writer(spec, 11, data).write(g.model);
    for (int i = 0; i < 24; ++i) g.prompt.push_back(static_cast<int32_t>((37 + 101 * i) % spec.n_vocab));
  } else {
    g.model = convert_golden(name, golden_quant_args(weights), g.dir);
    g.prompt = golden_prompt(name);
  }
  g.ref = reference_greedy(g.model, g.prompt, n, kv);
  return g;
}

ReferenceRun reference_greedy(const std::string& model_path, const std::vector<int32_t>& prompt, int n,
                              model::KvType kv, bool ignore_eos) {
  const model::Model m = model::Model::load(model_path);
  reference::ExecutorOptions opt{1};
  opt.kv_type = kv;
  reference::ReferenceExecutor exec(m, opt);
  std::unique_ptr<tokenizer::Tokenizer> tok;
  try {
    tok = std::make_unique<tokenizer::Tokenizer>(tokenizer::Tokenizer::from_gguf(m.file));
  } catch (const std::exception&) {
    // no tokenizer: the coordinator has no end-of-generation tokens either
  }
  ReferenceRun r;
  std::vector<float> logits = exec.forward(prompt, false);
  for (int i = 0; i < n; ++i) {
    r.logits.insert(r.logits.end(), logits.begin(), logits.end());
    const int32_t id = sampling::argmax(logits);
    r.ids.push_back(id);
    if (i + 1 == n || (!ignore_eos && tok && tok->is_end_of_generation(id))) break;   // as the coordinator stops
    const int32_t one[1] = {id};
    logits = exec.forward(one, false);
  }
  return r;
}

std::vector<std::string> shm_files(const std::string& prefix) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator("/dev/shm")) {
    if (e.path().filename().string().rfind(prefix, 0) == 0) out.push_back(e.path().string());
  }
  return out;
}

uint64_t coordinator_counter(const std::string& socket_dir, const std::string& name) {
  return instance_counter(socket_dir, group::kCoordinatorInstance, name);
}

uint64_t instance_counter(const std::string& socket_dir, const std::string& instance, const std::string& name) {
  auto stub = control::Control::NewStub(
      grpc::CreateChannel(group::control_address(socket_dir, instance), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  control::StatsReply reply;
  const grpc::Status st = stub->Stats(&ctx, control::StatsRequest(), &reply);
  EXPECT_TRUE(st.ok()) << instance << " Stats: " << st.error_message();
  const auto it = reply.counters().find(name);
  return it == reply.counters().end() ? 0 : it->second;
}

}  // namespace moraine::group_test
