// moraine-coordinator's options (its command line) and what the coordinator derives from them
// before it starts: the KV type, the long steps' rows, the placement plan and the step window.
#pragma once
#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>

#include "common/model/kv_type.h"
#include "common/model/model.h"
#include "coordinator/census.h"
#include "coordinator/placement.h"

namespace moraine::group {

struct CoordinatorOptions {
  std::string model, socket_dir, handoff = "doorbell", logits_dump;
  std::string vram = "unlimited", ram = "unlimited", census;   // placement (coordinator/placement.h)
  std::string file_cache = "auto";   // PlacementInput::file_cache_budget ("auto": a quarter of --ram)
  std::string disk_rate = "auto";    // the plan's disk bound: bytes/s, or "auto" (an O_DIRECT probe at start)
  bool no_census = false;   // the gpu_worker records no census (coordinator/census.h)
  int vram_adapt_every = 8;  // GroupManifest::vram_adapt_every
  int64_t ctx = 0;
  // Rows of a step, or of a long step's window; 0: window_rows_for's choice (512, llama.cpp's
  // default ubatch, except for CUDA long steps). 64-row steps (the old default) gave the experts
  // ~4 rows each, and an 8192-token prompt took 128 steps (session 9, H200 kernel trace;
  // docs/perf-log.md#session-9-what-moved).
  int cpu_workers = 2, max_tokens = 0, step_retries = 2;
  // Rows of a long step (GroupManifest::long_step_rows; -1: long_step_rows_for's default).
  int long_step_rows = -1;
  std::string backend = "cpu";   // the gpu_worker's: cuda charges its context and scratch to --vram
  std::string kv_type;           // the KV cache's elements; empty: kv_type_for's default
  std::string step_channel = "doorbell";   // GroupManifest::step_channel
  // The step done doorbell's spin before the coordinator sleeps: none, because a step takes longer
  // (0.1-3 ms) and the coordinator shares its core with the gpu_worker, which the ring has just
  // woken. Dev box, CPU backend, every expert on it, decode p50 minus layer_chain p50: 20-36 us
  // without a spin, 37-49 us spinning 20 us; spinning through the step (both sides): 510 us.
  int step_spin_us = 0;
  bool greedy_on_host = false;   // greedy decode reads the logits and takes their argmax here
  // Speculation, for requests that ask (GenerateRequest::speculate): drafts of at
  // most this many tokens (0: never draft) after a recurring context suffix of at least
  // speculate_min_match tokens (group::SuffixDrafter).
  int speculate_draft = 5, speculate_min_match = 1;
  // ... and where the model has an MTP head (a nextn block) that the backend runs (the CPU one;
  // StepHeader::mtp), drafts of at most this many tokens from it instead, made by the gpu_worker
  // after each step (0: suffix drafts only). 1: on the built-in model deeper drafts along the MTP
  // chain are right 14% / 9% of the time (depth 2 / 3, against 40% at depth 1), and each costs ~280 us
  // beside a 514 us step on the CPU backend (group, --vram unlimited: 1050 tok/s with 1, 950 with 3,
  // 1350 plain; docs/perf-log.md#session-23-mtp-cpu).
  int speculate_mtp = 1;
  // Conversations the gpu_worker keeps saved in its host memory (coordinator/conversation_cache.h);
  // llama-server's --cache-ram default is 8 GiB as well. "0": only the live sequence is reused.
  std::string cache_ram = "8G";
  // Requests that take turns on the gpu_worker (coordinator/turn_queue.h), and the tokens a turn
  // runs before it yields to a waiting one (a switch saves one sequence and loads the other).
  int parallel = 1, turn_tokens = 16;
  // Batched decode (issue 33; coordinator/batch_stepper.h): the --parallel requests each hold a
  // sequence slot of the gpu_worker (its KV cache and state charged to --vram per slot), and one
  // step carries a decode row of every decoding one. Off by default.
  bool batch_decode = false;
  // ... and a new request's prompt goes in chunks of at most this many rows per batched step,
  // beside the decoding requests' rows (0: its prefill is a step of its own, between batched
  // steps).
  // 32: a stream's longest gap beside a 320-token prompt 15-21 ms (whole: 60-149), its first token 83-96 ms (whole: 58-145, 8 rows: 117-253; CPU, group_batch_test MORAINE_CHUNK_SWEEP=1).
  int prefill_chunk = 32;
  // ... and the requests beyond the --parallel slots that wait for one, in arrival order; more
  // are refused (RESOURCE_EXHAUSTED). 64: serve's --queue default.
  int batch_queue = 64;
  bool print_plan = false;   // print the window and the placement, then exit (no group)
};

// Registers every option on the coordinator's command line.
void add_coordinator_options(CLI::App& app, CoordinatorOptions& o);

model::KvType kv_type_for(const CoordinatorOptions& o);
int long_step_rows_for(const CoordinatorOptions& o, const model::Model& m);
group::PlacementPlan plan_for(const CoordinatorOptions& o, const model::Model& m, bool log = true,
                              group::Census* census_out = nullptr);
int window_rows_for(const CoordinatorOptions& o, const model::Model& m);

}  // namespace moraine::group
