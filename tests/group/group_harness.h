// Test harness for the process group: converts a golden model, starts the group with
// deploy/moraine-supervisor, waits on every process's Health (never a fixed sleep), generates
// over gRPC and stops the group. Shared by the group tests.
#pragma once
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <memory>
#include <vector>

#include "common/model/kv_type.h"
#include "coordinator/group_launcher.h"
#include "proto/generate.pb.h"
#include "tests/support/shell.h"

namespace moraine::group_test {

using test_support::run_command;
std::string shell_quote(const std::string& s);
std::string temp_dir(const std::string& tag);   // fresh, unique per call

// F32 GGUF of tests/golden/<name>, optionally quantized by moraine-quantize with `quant_args`.
// Throws with the tool's output when a tool fails.
std::string convert_golden(const std::string& name, const std::string& quant_args, const std::string& dir);
std::vector<int32_t> golden_prompt(const std::string& name);
// moraine-quantize arguments of the golden weight variants: "f32" (none), "q8_0", "kmix"
// (Q4_K experts, Q6_K attn_v, Q4_K attn_output, Q8_0 rest), "hub" and "hub_tq" (issue 26's types).
std::string golden_quant_args(const std::string& weights);

// The coordinator's --logits-dump: n floats (fails the current test when shorter).
std::vector<float> read_logits_dump(const std::string& path, size_t n);
// Index of the first element whose bits differ; a.size() when a and b are bit-identical.
size_t first_bit_difference(const std::vector<float>& a, const std::vector<float>& b);

struct GroupOptions {
  std::string model;
  int cpu_workers = 2;
  std::string handoff = "doorbell";
  std::string logits_dump;   // empty: none
  std::string socket_dir;    // empty: a fresh one
  // Placement budgets (--vram / --ram). Empty vram: "dense", exactly the dense weights + KV, so
  // every expert is computed by the cpu workers from RAM (what the tests that predate tiers check).
  std::string vram, ram = "unlimited";
  std::string census;        // empty: none (uniform popularity)
  // The gpu_worker merges its routing counts into the census (--census, else MODEL.census.json).
  // Off by default (--no-census): a test that starts a group twice on one model would otherwise
  // place the second by the first's routing.
  bool write_census = false;
  std::string backend = "cpu";  // the gpu_worker's --backend: cpu or cuda
  // --max-tokens: 64-row steps (the default is 512), so the golden prompts (up to 80 tokens)
  // prefill in two steps and the group tests cover a prefill split across steps.
  int max_tokens = 64;
  std::vector<std::string> extra_args;  // appended to `moraine-supervisor start`
  // Start the group as deploy/demo and the README do: `start -m MODEL --cpu-workers N
  // --socket-dir DIR --bin-dir BIN` and nothing else (every other field above is then ignored
  // but extra_args), so every option is the supervisor's own default.
  bool supervisor_defaults = false;
};

class Group {
 public:
  explicit Group(GroupOptions o);   // starts the supervisor and waits for every Health
  ~Group();                         // stops it (idempotent)
  void stop();                      // `moraine-supervisor stop`, waits for the supervisor to exit
  const std::string& socket_dir() const { return dir_; }
  pid_t supervisor_pid() const { return launched_ ? launched_->supervisor_pid() : -1; }
  pid_t instance_pid(const std::string& instance) const;   // via Health
  std::string wait_all_serving(std::chrono::milliseconds deadline) const;  // empty when all serve
  const GroupOptions& options() const { return o_; }

 private:
  GroupOptions o_;
  std::string dir_;
  std::unique_ptr<group::LaunchedGroup> launched_;
};

struct Generation {
  std::vector<int32_t> ids;
  std::string error;       // gRPC status message or chunk error; empty on success
  int status_code = 0;     // grpc::StatusCode
  uint32_t cached_tokens = 0;   // GenerateTiming::cached_tokens: prompt positions the prefix cache reused
};
// Greedy (temperature 0); check_logits: SamplingParams::check_logits (the coordinator then reads
// every sampled row's logits instead of taking the gpu_worker's token); speculate:
// GenerateRequest::speculate (suffix drafts verified by the gpu_worker's greedy tokens).
Generation generate(const std::string& socket_dir, const std::vector<int32_t>& prompt, int n, bool check_logits = false,
                    bool speculate = false);
// Any request's sampling (temperature, top-k, seed, max_tokens ...): generate()'s, with `sp`.
Generation generate_sampled(const std::string& socket_dir, const std::vector<int32_t>& prompt,
                            const generate::SamplingParams& sp, bool speculate = false);

// Greedy tokens and each sampled row's logits from the in-process reference executor.
struct ReferenceRun {
  std::vector<int32_t> ids;
  std::vector<float> logits;   // [n][n_vocab]
};
// kv: the reference's KV cache type (the CUDA backend's default is F16).
// ignore_eos: all n tokens, as GenerateRequest's ignore_eos (else it stops where the coordinator does).
ReferenceRun reference_greedy(const std::string& model, const std::vector<int32_t>& prompt, int n,
                              model::KvType kv = model::KvType::F32, bool ignore_eos = false);

// A golden model converted with golden_quant_args(weights) into a fresh temp_dir(tag), its
// prompt, and the reference's greedy run of n tokens on it: what every group-vs-reference test
// starts from.
struct GoldenCase {
  std::string dir, model;
  std::vector<int32_t> prompt;
  ReferenceRun ref;
};
// name "synth:SHAPE": a moraine-synth file of that shape instead (weights f32 or kmix, a vocabulary
// of kSynthVocab rows), for architectures with no transformers golden here (gpt-oss), and a
// fixed prompt of 24 tokens.
GoldenCase golden_case(const std::string& name, const std::string& weights, const std::string& tag, int n,
                       model::KvType kv = model::KvType::F32);
inline constexpr const char* kSynthPrefix = "synth:";
// name "tiny:ARCH[:VARIANT]": tests/reference/tiny_arch_model.h's F32 file of that architecture
// (every part of its description, the one llama.cpp checks the reference on).
inline constexpr const char* kTinyPrefix = "tiny:";
inline constexpr int kSynthVocab = 512;
std::string synth_model(const std::string& shape, const std::string& weights, const std::string& dir);
// A test-parameter name from a case's text (gtest takes only letters, digits and '_').
std::string param_name(std::string s);

std::vector<std::string> shm_files(const std::string& prefix);   // /dev/shm entries with prefix

// A counter of the coordinator's Stats (`moraine stats --json`); 0 when it has none by that name.
uint64_t coordinator_counter(const std::string& socket_dir, const std::string& name);
// A counter of any instance's Stats (group::kGpuWorkerInstance, ...); 0 when it has none.
uint64_t instance_counter(const std::string& socket_dir, const std::string& instance, const std::string& name);

}  // namespace moraine::group_test
