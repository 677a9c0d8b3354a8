// moraine-cpu-expert-worker: computes the routed experts it owns (expert_owner() in
// coordinator/group_layout.h) that the placement plan did not put in VRAM, into the exchange
// segment's expert_out rows: RAM-tier ones from their arena slots, FILE-tier ones from this
// worker's file-cache slots (expert_cache.h), which the io_worker fills from the model file on a
// miss or ahead of the layer (file_fetch.h).
// Two ways in, both always served: the request doorbell (default hand-off: the gpu_worker writes
// ExpertRequest and rings; this process derives the same ExpertPlan from the published routing)
// and ZeroMQ ExpertJobList descriptors (the reference path, --handoff zmq on the coordinator).
// A restarted worker finds a request rung but not answered (request bell > done bell) and
// computes it: the inputs are still in shared memory, so the step its predecessor died in
// completes with the same numbers.
#include <sched.h>
#include <numa.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <thread>

#include "common/messaging/job_channel.h"
#include "common/model/model.h"
#include "common/reference/moe_parts.h"
#include "kernels/cpu/cpu_kernel_tuning.h"
#include "kernels/cpu/expert_ffn.h"
#include "kernels/cpu/thread_pool.h"
#include "common/shm/doorbell.h"
#include "common/shm/shm_segment.h"
#include "coordinator/control_server.h"
#include "coordinator/group_layout.h"
#include "coordinator/process_util.h"
#include "cpu_expert_worker/expert_cache.h"
#include "cpu_expert_worker/file_fetch.h"
#include "cpu_expert_worker/next_layer_guess.h"

namespace {

using namespace moraine;
using Clock = std::chrono::steady_clock;

class ExpertWorker {
 public:
  ExpertWorker(const std::string& socket_dir, const group::GroupManifest& man, int index, int threads,
               const std::vector<int>& cpus, int spin_us, bool exclusive_cpus, bool prefetch, bool read_ahead,
               const cpu::CpuKernelTuning& tuning)
      : man_(man), index_(index), prefetch_(prefetch), read_ahead_(read_ahead), model_(model::Model::load(man.model_path)),
        exchange_(shm::ShmSegment::open(man.exchange_locator)),
        arena_(shm::ShmSegment::open(man.arena_locator)),
        xl_(group::ExchangeLayout::build(model_.hp, man.max_tokens, man.n_cpu_workers, man.long_step_rows)),
        plan_(group::PlacementPlan::read(man.placement_path, group::model_sizes(model_, 0))),
        al_(group::ArenaLayout::build(model_, plan_)), pool_(threads), fast_pool_(cpus, {spin_us, true, !exclusive_cpus}),
        spin_(std::chrono::microseconds(std::max(0, spin_us))), watch_sharing_(!exclusive_cpus), ffn_(tuning),
        io_endpoint_(group::jobs_endpoint(socket_dir, group::kIoWorkerInstance)) {
    const model::HParams& hp = model_.hp;
    if (index_ < 0 || index_ >= man.n_cpu_workers) {
      throw std::runtime_error("--index " + std::to_string(index_) + " is outside the group's " +
                               std::to_string(man.n_cpu_workers) + " cpu workers");
    }
    if (plan_.n_cpu_workers != man.n_cpu_workers) {
      throw std::runtime_error("placement plan " + man.placement_path + " is for " + std::to_string(plan_.n_cpu_workers) +
                               " cpu workers, the manifest says " + std::to_string(man.n_cpu_workers));
    }
    if (exchange_.data_bytes() < xl_.layout.total_bytes() || arena_.data_bytes() < al_.total_bytes) {
      throw std::runtime_error("exchange or arena segment is smaller than this model's layout");
    }
    const int64_t max_slots = int64_t{man.max_tokens} * hp.n_expert_used;
    plan_exp_.reserve(hp.n_expert, max_slots);
    // Gathered input rows of one float expert (the reference kernel takes contiguous rows).
    xg_.resize(static_cast<size_t>(max_slots * hp.n_embd));
    ffn_.reserve(static_cast<int>(max_slots), hp.n_embd, hp.n_ff_exp, static_cast<int>(hp.n_expert));
    fast_weights_.reserve(static_cast<size_t>(hp.n_expert));
    fast_ids_.reserve(static_cast<size_t>(hp.n_expert));
    fast_jobs_.reserve(static_cast<size_t>(hp.n_expert));
    if (prefetch_) {
      last_fast_.resize(static_cast<size_t>(hp.n_layer));
      for (auto& v : last_fast_) v.reserve(static_cast<size_t>(hp.n_expert));
      last_experts_.resize(static_cast<size_t>(hp.n_layer));
      for (auto& v : last_experts_) v.reserve(static_cast<size_t>(hp.n_expert));
      prefetch_ptrs_.reserve(static_cast<size_t>(hp.n_expert));
      guessed_weights_.reserve(static_cast<size_t>(hp.n_expert));
      guessed_.reserve(static_cast<size_t>(hp.n_expert));
      guess_experts_.reserve(static_cast<size_t>(hp.n_expert));
    }
    if ((prefetch_ || read_ahead_) && hp.n_layer > 1) {
      // A model the fold does not fit (a layer without a router of n_expert rows) keeps the
      // last-token guess rather than losing the worker.
      try {
        guess_ = std::make_unique<cpu_worker::NextLayerGuess>(model_);
      } catch (const std::exception& e) {
        std::cerr << "cpu_expert_worker " << index_ << ": " << e.what() << "; prefetching the last token's experts instead\n";
      }
    }
    scratch_.reserve(man.max_tokens, hp.n_ff_exp);
    rows_.reserve(static_cast<size_t>(max_slots));
    work_.reserve(static_cast<size_t>(hp.n_expert));
    const group::ModelSizes sizes = group::model_sizes(model_, 0);
    expert_bytes_ = sizes.expert_bytes;
    if (al_.cache_slots > 0) open_file_cache();
  }

  messaging::JobLimits limits() const {
    return {{{group::kExchangeSegmentId, exchange_.data_bytes()}},
            static_cast<uint32_t>(model_.hp.n_layer), static_cast<uint32_t>(model_.hp.n_expert),
            static_cast<uint32_t>(man_.max_tokens), static_cast<uint32_t>(model_.hp.n_embd * sizeof(float)), {}};
  }

  // The doorbell thread computes the layers: it runs the pool's worker 0 on the first CPU. (The
  // ZeroMQ path's thread, the reference hand-off, joins unpinned: correct, a little slower.)
  void pin_doorbell_thread() const {
    try {
      fast_pool_.pin_caller();
    } catch (const std::exception& e) {
      std::cerr << "cpu_expert_worker " << index_ << ": " << e.what() << "; the doorbell thread runs unpinned\n";
    }
  }

  // Doorbell path: returns false when it gave up waiting (caller checks liveness and shutdown).
  // Within --spin-us of the last answer the bell is polled (cpu::spin_poll: the next layer's
  // request comes 0.15-0.5 ms later while tokens are generated, and a futex wake costs tens of
  // us in a VM), then slept on.
  bool serve_doorbell(std::chrono::milliseconds wait, group::StageRecorder& stage) {
    shm::Doorbell* req = bell(group::ExchangeLayout::request_bell(index_));
    shm::Doorbell* done = bell(group::ExchangeLayout::done_bell(index_));
    const uint64_t answered = done->load();
    const auto spin_left = std::chrono::duration_cast<std::chrono::microseconds>(last_answer_ + spin_ - Clock::now()).count();
    if (!(spin_left > 0 && cpu::spin_poll([&] { return req->load() > answered; }, static_cast<int>(spin_left), watch_sharing_))) {
      shm::WaitStats ws;
      if (req->wait_for(answered + 1, wait, std::chrono::microseconds(20), &ws) != shm::WaitResult::kReady) return false;
      if (ws.slept) ++bell_sleeps_;
    }
    const uint64_t seq = req->load();
    const auto* r = xl_.region("expert_req").at<const group::ExpertRequest>(exchange_.data());
    const auto t0 = Clock::now();
    std::lock_guard lock(compute_mu_);
    if (r->layer >= model_.hp.n_layer || r->n_tokens == 0 || r->n_tokens > static_cast<uint32_t>(man_.max_tokens)) {
      // A corrupt request must not take the worker down; the gpu_worker sees no answer and fails
      // the step with a timeout naming this worker.
      std::cerr << "cpu_expert_worker " << index_ << ": bad expert request (layer " << r->layer
                << ", " << r->n_tokens << " tokens); ignored\n";
      done->ring(seq);
      return true;
    }
    const int64_t il = r->layer;  // (the request region may change once the answer is rung)
    const int64_t k = model_.hp.n_expert_used;
    const int64_t d = model_.hp.n_embd;
    plan_exp_.build(xl_.region("chosen").at<const int32_t>(exchange_.data()), r->n_tokens * k, model_.hp.n_expert);
    float* out = xl_.region("expert_out").at<float>(exchange_.data());
    work_.clear();
    rows_.clear();
    const int32_t device_expert = r->device_expert;
    const uint32_t mode = r->mode;
    if (mode == group::kFillRequest) {
      // A long step's layer whose FILE-tier experts the device stages from the file cache: read
      // the marked ones of this worker into it, compute nothing (the gpu_worker then looks).
      const uint32_t n_fill = r->n_tokens;
      try {
        fill_marked(il, *r, seq);
      } catch (const cpu_worker::FetchError& e) {
        report_fetch_error(il, e, seq);
        done->ring(seq);
        return true;
      } catch (const std::exception& e) {
        std::cerr << "cpu_expert_worker " << index_ << ": filling layer " << il << ": " << e.what() << "\n";
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        return true;
      }
      done->ring(seq);
      last_answer_ = Clock::now();
      prefetch_next_layer(il, n_fill, req, seq);
      return true;
    }
    for (int64_t e = 0; e < model_.hp.n_expert; ++e) {
      if (group::expert_owner(e, man_.n_cpu_workers) != index_ || plan_exp_.count(e) == 0) continue;
      // A redo names the experts whose cache slot was refilled under the device's copy: only those.
      if (mode == group::kRedoRequest) {
        if (!group::expert_marked(*r, e)) continue;
      } else if (resident(r->layer, e) || e == device_expert ||
                 group::device_stages(r->device_stages_from_rows, plan_.at(il, e), plan_exp_.count(e)) ||
                 (plan_.at(il, e) == group::Tier::kFile && group::expert_marked(*r, e))) {
        // Experts on the device now are the gpu_worker's (its VRAM tier, which adapts while
        // running), and so is the one it took over for this request (ExpertRequest::device_expert),
        // every RAM-tier one with enough rows when it stages them (a long step:
        // ExpertRequest::device_stages_from_rows) and the marked FILE-tier ones it stages from the cache.
        continue;
      }
      const int32_t m = plan_exp_.count(e);
      work_.push_back({static_cast<int32_t>(e), static_cast<int32_t>(rows_.size()), m, out + int64_t{plan_exp_.start[e]} * d});
      for (int32_t j = 0; j < m; ++j) rows_.push_back(static_cast<int32_t>(plan_exp_.slot_of[plan_exp_.start[e] + j] / k));
    }
    score_prefetch(il);
    const uint32_t n_tokens = r->n_tokens;
    try {
      run_work(r->layer, xl_.region("hidden").at<const float>(exchange_.data()), seq);
    } catch (const cpu_worker::FetchError& e) {
      // The io_worker could not read an expert (a read error, a truncated shard): retrying
      // cannot help, so the answer carries the error and the gpu_worker fails the step with it.
      report_fetch_error(il, e, seq);
      done->ring(seq);
      return true;
    } catch (const std::exception& e) {
      // Not answered: the gpu_worker times out and the coordinator re-issues the step; until
      // then the request is retried here (a restarted io_worker may serve it).
      std::cerr << "cpu_expert_worker " << index_ << ": layer " << r->layer << ": " << e.what() << "\n";
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      return true;
    }
    done->ring(seq);
    last_answer_ = Clock::now();
    stage.record(r->n_tokens, work_.size(), work_bytes(il), us_since(t0));
    prefetch_next_layer(il, n_tokens, req, seq);
    return true;
  }

  void report_fetch_error(int64_t il, const cpu_worker::FetchError& e, uint64_t seq) {
    const std::string text = group::cpu_worker_instance(index_) + ": layer " + std::to_string(il) + ": " + e.what();
    std::cerr << text << "\n";
    auto* err = xl_.region("worker_errors").at<group::WorkerError>(exchange_.data()) + index_;
    err->bytes = static_cast<uint32_t>(std::min(text.size(), group::kStepErrorBytes));
    std::memcpy(err->text, text.data(), err->bytes);
    std::atomic_ref<uint64_t>(err->seq).store(seq, std::memory_order_release);
  }

  // ExpertRequest kFillRequest: the read-ahead in flight lands, then this worker's marked
  // FILE-tier experts that its cache lacks are read into the coldest slots (those that do not
  // fit stay in the file: the workers compute them). Every marked one counts as a use, and the
  // layer's cached ones stay pinned until the next request, so that the read-ahead this answer
  // starts for the next layer does not evict them while the device copies them.
  void fill_marked(int64_t il, const group::ExpertRequest& r, uint64_t step_seq) {
    ++fill_requests_;
    if (!cache_) return;
    finish_read_ahead();
    cache_->unpin_all();
    fills_.clear();
    misses_fill_.clear();
    for (int64_t e = index_; e < model_.hp.n_expert; e += man_.n_cpu_workers) {
      if (!group::expert_marked(r, e) || plan_.at(il, e) != group::Tier::kFile || resident(il, e)) continue;
      cache_->touch(il, e);
      ++fill_device_experts_;
      const cpu_worker::ExpertCache::Found f = cache_->find(il, e);
      if (f.slot >= 0) {
        cache_->pin(f.slot);
        if (cache_->take_read_ahead(f.slot)) ++read_ahead_used_;
      } else {
        misses_fill_.push_back(static_cast<int32_t>(e));
      }
    }
    for (const int32_t e : misses_fill_) {
      const int64_t slot = cache_->victim(il, e, false);
      if (slot < 0) break;   // every other slot holds one of this layer's
      if (cache_->holds_expert(slot)) ++cache_evictions_;
      cache_->begin_fill(slot, il, e);
      fills_.push_back({e, slot});
    }
    if (!fills_.empty()) {
      fetch_now(il, step_seq);
      fill_reads_ += fills_.size();
    }
    cache_filled_ = static_cast<uint64_t>(cache_->filled());
  }

  // Reads ahead into the file cache the FILE-tier experts of layer `next` that this worker will
  // likely compute: the router guess's (decode), or at a step whose rows route to about every
  // expert (prefill) all it owns of that layer, hottest first. The reads overlap the GPU's part
  // and the other workers; run_file_work waits for them before it looks anything up.
  void read_ahead(int64_t next, const std::vector<int32_t>& candidates, uint64_t step_seq) {
    if (!ahead_.empty()) {   // still in flight (run_file_work leaves another layer's): one request at a time
      if (ahead_layer_ == next) return;
      finish_read_ahead();
    }
    ahead_.clear();
    for (const int32_t e : candidates) {
      if (group::expert_owner(e, man_.n_cpu_workers) != index_ || plan_.at(next, e) != group::Tier::kFile ||
          resident(next, e) || cache_->find(next, e).slot >= 0) {
        continue;
      }
      const int64_t slot = cache_->victim(next, e, true);
      if (slot < 0) continue;   // every free slot holds a hotter expert
      if (cache_->holds_expert(slot)) ++cache_evictions_;
      cache_->begin_fill(slot, next, e);
      cache_->mark_read_ahead(slot);
      ahead_.push_back({e, slot});
    }
    if (ahead_.empty()) return;
    ahead_layer_ = next;
    try {
      const uint64_t bytes = fetch_->send(next, ahead_, step_seq);
      read_ahead_bytes_ += bytes;
      fetched_bytes_ += bytes;
      ++fetches_;
      ++read_ahead_requests_;
      read_ahead_experts_ += ahead_.size();
    } catch (const std::exception& e) {
      std::cerr << "cpu_expert_worker " << index_ << ": read-ahead of layer " << next << ": " << e.what() << "\n";
      for (const cpu_worker::FileFetch::Item& it : ahead_) cache_->abandon(it.slot);
      ahead_.clear();
    }
  }

  // The read-ahead in flight lands (or is dropped: the layer then reads those experts itself).
  void finish_read_ahead() {
    if (ahead_.empty()) return;
    try {
      fetch_->wait();
      for (const cpu_worker::FileFetch::Item& it : ahead_) cache_->end_fill(it.slot);
    } catch (const std::exception& e) {
      std::cerr << "cpu_expert_worker " << index_ << ": read-ahead: " << e.what() << "\n";
      for (const cpu_worker::FileFetch::Item& it : ahead_) cache_->abandon(it.slot);
    }
    ahead_.clear();
  }

  // Candidates for the read-ahead of layer `next` at a step of n_tokens rows: the guess when
  // one was made, all of the layer's experts by heat when the rows route to about every expert.
  const std::vector<int32_t>* read_ahead_candidates(int64_t next, uint32_t n_tokens, bool guessed) {
    if (!cache_ || !read_ahead_ || next == 0) return nullptr;
    if (guessed) return &guess_experts_;
    if (int64_t{n_tokens} * model_.hp.n_expert_used < model_.hp.n_expert) return nullptr;
    by_heat_.clear();
    for (int64_t e = index_; e < model_.hp.n_expert; e += man_.n_cpu_workers) {
      if (plan_.at(next, e) == group::Tier::kFile) by_heat_.push_back(static_cast<int32_t>(e));
    }
    std::stable_sort(by_heat_.begin(), by_heat_.end(),
                     [&](int32_t a, int32_t b) { return cache_->heat(next, a) > cache_->heat(next, b); });
    return &by_heat_;
  }

  // --ffn-prefetch-next-layer: while the GPU runs the rest of layer il and the next layer's
  // mixer (~41 us per layer at 12G), each pool thread pulls into its L2 the rows it would
  // compute of the experts this worker is likely to compute for layer il + 1: layer il + 1's
  // router applied to layer il's input (next_layer_guess.h; 84% right in the 12G group on the 30B
  // synth shape), best guess first. Where that guess cannot be made (after the last layer, the
  // next request is layer 0 of the next token; longer requests; a model the fold does not fit)
  // it takes the experts it computed for layer il + 1 at the previous token (16% right: as the
  // only guess it gave nothing, docs/perf-log.md, "--ffn-prefetch-guess last-token").
  // Ends as soon as the next request rings (polled every 1 KB per thread).
  void prefetch_next_layer(int64_t il, uint32_t n_tokens, const shm::Doorbell* req, uint64_t answered) {
    guessed_.clear();
    guess_layer_ = -1;
    if (!prefetch_ && !(read_ahead_ && cache_)) return;
    const int64_t next = (il + 1) % model_.hp.n_layer;
    prefetch_ptrs_.clear();
    const bool guessing = guess_ && next > 0 && n_tokens <= kMaxGuessRows;
    if (guessing) {
      // The request's rows of `hidden` are read after the answer: the gpu_worker writes the next
      // layer's rows only once it has routed that layer (tens of us later), and a row it had
      // begun to overwrite would only spoil the guess.
      guess_experts_.clear();
      guess_->guess(il, xl_.region("hidden").at<const float>(exchange_.data()), n_tokens, fast_pool_, guess_experts_);
    }
    if (const std::vector<int32_t>* ahead = read_ahead_candidates(next, n_tokens, guessing)) read_ahead(next, *ahead, answered);
    if (!prefetch_) return;
    if (guessing) {
      guessed_weights_.clear();
      for (const int32_t e : guess_experts_) {
        if (group::expert_owner(e, man_.n_cpu_workers) != index_ || resident(next, e)) continue;
        const group::Tier tier = plan_.at(next, e);
        if (tier == group::Tier::kFile) continue;   // the file cache's: read ahead above, not pulled into L2
        const std::array<model::Matrix, 3> t = in_memory(next, e, tier);
        if (!production_kernel_for(t)) continue;
        guessed_weights_.push_back(expert_weights(next, e, t));
        guessed_.push_back(e);
      }
      for (const cpu::ExpertWeights& w : guessed_weights_) prefetch_ptrs_.push_back(&w);
    } else {
      const std::vector<cpu::ExpertWeights>& ws = last_fast_[static_cast<size_t>(next)];
      for (const cpu::ExpertWeights& w : ws) prefetch_ptrs_.push_back(&w);
      guessed_.assign(last_experts_[static_cast<size_t>(next)].begin(), last_experts_[static_cast<size_t>(next)].end());
    }
    guess_layer_ = next;
    if (prefetch_ptrs_.empty()) return;
    struct Until {
      const shm::Doorbell* req;
      uint64_t answered;
    } until{req, answered};
    ++prefetch_runs_;
    const bool whole = ffn_.prefetch_experts(prefetch_ptrs_, 1, fast_pool_, [](const void* c) {
      const auto* u = static_cast<const Until*>(c);
      return u->req->load() > u->answered;
    }, &until);
    if (!whole) ++prefetch_cut_;
  }

  // Counts how many of the experts prefetched for layer il this request computes here
  // (Stats: prefetch_guessed, prefetch_guessed_right, prefetch_needed).
  void score_prefetch(int64_t il) {
    if (guess_layer_ != il) return;
    uint64_t right = 0;
    for (const Work& w : work_) right += std::find(guessed_.begin(), guessed_.end(), w.expert) != guessed_.end() ? 1 : 0;
    prefetch_guessed_ += guessed_.size();
    prefetch_right_ += right;
    prefetch_needed_ += work_.size();
  }

  // ZeroMQ path: one validated ExpertJobList.
  void serve_jobs(const jobs::ExpertJobList& list, jobs::JobReply& reply, group::StageRecorder& stage) {
    const auto t0 = Clock::now();
    std::lock_guard lock(compute_mu_);
    std::byte* outputs = exchange_.data() + list.outputs().offset();
    work_.clear();
    rows_.clear();
    for (const jobs::ExpertJob& job : list.jobs()) {
      const int64_t e = job.expert_id();
      if (group::expert_owner(e, man_.n_cpu_workers) != index_ || resident(list.layer(), e)) {
        throw std::runtime_error("expert " + std::to_string(e) + " of layer " + std::to_string(list.layer()) +
                                 " is not cpu worker " + std::to_string(index_) + "'s (another owner, or on the device)");
      }
      work_.push_back({static_cast<int32_t>(e), static_cast<int32_t>(rows_.size()), job.token_rows_size(),
                       reinterpret_cast<float*>(outputs + job.output_offset())});
      for (uint32_t t : job.token_rows()) rows_.push_back(static_cast<int32_t>(t));
    }
    run_work(list.layer(), reinterpret_cast<const float*>(exchange_.data() + list.activations().offset()), list.step_seq());
    reply.set_done_seq(list.done_seq());
    stage.record(list.n_tokens(), work_.size(), work_bytes(list.layer()), us_since(t0));
  }

  uint64_t shm_mapped() const { return exchange_.data_bytes() + arena_.data_bytes(); }

  void stats(control::StatsReply& r) const {
    r.set_shm_mapped_bytes(shm_mapped());
    auto& c = *r.mutable_counters();
    c["experts_ram"] = experts_ram_.load();
    c["experts_file"] = experts_file_.load();
    c["file_fetches"] = fetches_.load();
    c["file_bytes_fetched"] = fetched_bytes_.load();   // demand reads and read-ahead
    // The file cache (expert_cache.h): FILE-tier experts computed from a slot that held them
    // (hits) or after reading them (misses), hits found refilled under them (stale, computed
    // again), slots given to another expert, slots it has and slots holding an expert now.
    c["cache_hits"] = cache_hits_.load();
    c["cache_misses"] = cache_misses_.load();
    c["cache_stale"] = cache_stale_.load();
    c["cache_evictions"] = cache_evictions_.load();
    c["cache_slots"] = static_cast<uint64_t>(al_.cache_slots);
    c["cache_filled"] = cache_filled_.load();
    // --file-read-ahead: requests sent ahead of a layer, the experts and bytes they read, and how
    // many of those experts their layer then used.
    c["read_ahead_requests"] = read_ahead_requests_.load();
    c["read_ahead_experts"] = read_ahead_experts_.load();
    c["read_ahead_bytes"] = read_ahead_bytes_.load();
    c["read_ahead_used"] = read_ahead_used_.load();
    // Long steps whose device stages FILE-tier experts from the cache (gpu_worker/file_stage.h):
    // the fill requests served, the experts they named (the device's), and those they read.
    c["fill_requests"] = fill_requests_.load();
    c["fill_device_experts"] = fill_device_experts_.load();
    c["fill_reads"] = fill_reads_.load();
    // Futex sleeps of the doorbell thread before a request and of the expert threads between
    // job lists: while tokens are generated both should stay near zero (--spin-us).
    c["doorbell_sleeps"] = bell_sleeps_.load();
    c["pool_sleeps"] = fast_pool_.sleeps();
    c["spin_cut_short"] = cpu::spins_cut_short();
    // --ffn-prefetch-next-layer: experts prefetched before a layer's request, how many of them
    // it asked this worker for, and how many it asked for in all (at the layers guessed for).
    c["prefetch_guessed"] = prefetch_guessed_.load();
    c["prefetch_guessed_right"] = prefetch_right_.load();
    c["prefetch_needed"] = prefetch_needed_.load();
    // Prefetches started, and how many of them the next request stopped before every thread
    // had pulled all its rows (the GPU's part between two layers was shorter than the pull).
    c["prefetch_runs"] = prefetch_runs_.load();
    c["prefetch_cut_short"] = prefetch_cut_.load();
  }

 private:
  // One expert of the current layer: its token rows are rows_[first .. first + m), its output
  // rows go to y.
  struct Work {
    int32_t expert, first, m;
    float* y;
  };

  static double us_since(Clock::time_point t0) {
    return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  }
  shm::Doorbell* bell(size_t i) const {
    return shm::Doorbell::at(exchange_.data() + xl_.region("bells").offset + i * sizeof(shm::Doorbell));
  }
  uint64_t work_bytes(int64_t il) const { return work_.size() * expert_bytes_[static_cast<size_t>(il)]; }

  // RAM-tier experts straight from their arena slots, then FILE-tier ones from the file cache.
  void run_work(int64_t il, const float* hidden, uint64_t step_seq) {
    begin_compute();
    for (const Work& w : work_) {
      const group::Tier tier = plan_.at(il, w.expert);
      if (tier == group::Tier::kFile) continue;
      add_compute(il, in_memory(il, w.expert, tier), w, hidden);
      ++experts_ram_;
    }
    finish_compute();
    // What the next token's prefetch_next_layer reads for this layer (RAM / mapped experts: their
    // rows stay where they are; staged FILE experts' slots are reused).
    if (prefetch_) {
      last_fast_[static_cast<size_t>(il)].assign(fast_weights_.begin(), fast_weights_.end());
      last_experts_[static_cast<size_t>(il)].assign(fast_ids_.begin(), fast_ids_.end());
    }
    if (cache_) run_file_work(il, hidden, step_seq);
  }

  // FILE-tier experts from the file cache. The read-ahead in flight lands first; hits are
  // computed from their slots and checked against the slot's sequence number afterwards (a
  // refill in between would have changed the bytes: those are computed again as misses); misses
  // are read into the coldest slots, as many at a time as there are slots, then computed.
  void run_file_work(int64_t il, const float* hidden, uint64_t step_seq) {
    // A read-ahead of another layer (the next one, started after a long step's fill request)
    // stays in flight when this request has no FILE-tier expert: it needs no read of its own.
    const bool file_work = std::any_of(work_.begin(), work_.end(), [&](const Work& w) {
      return plan_.at(il, w.expert) == group::Tier::kFile;
    });
    if (!file_work && ahead_layer_ != il) return;
    finish_read_ahead();
    cache_->unpin_all();
    hits_.clear();
    misses_.clear();
    for (const Work& w : work_) {
      if (plan_.at(il, w.expert) != group::Tier::kFile) continue;
      cache_->touch(il, w.expert);
      const cpu_worker::ExpertCache::Found f = cache_->find(il, w.expert);
      if (f.slot < 0) {
        misses_.push_back(&w);
        continue;
      }
      cache_->pin(f.slot);
      hits_.push_back({&w, f});
    }
    if (!hits_.empty()) {
      begin_compute();
      for (const Hit& h : hits_) add_compute(il, bind(il, h.work->expert, cache_slot(il, h.found.slot)), *h.work, hidden);
      finish_compute();
      for (const Hit& h : hits_) {
        if (!cache_->still_valid(h.found)) {
          ++cache_stale_;
          cache_->drop(h.found.slot);
          misses_.push_back(h.work);
          continue;
        }
        ++cache_hits_;
        ++experts_file_;
        if (cache_->take_read_ahead(h.found.slot)) ++read_ahead_used_;
      }
    }
    cache_->unpin_all();
    for (size_t next = 0; next < misses_.size();) {
      batch_.clear();
      fills_.clear();
      for (; next < misses_.size(); ++next) {
        const int64_t slot = cache_->victim(il, misses_[next]->expert, false);
        if (slot < 0) break;   // every slot holds one of this batch
        if (cache_->holds_expert(slot)) ++cache_evictions_;
        cache_->begin_fill(slot, il, misses_[next]->expert);
        fills_.push_back({misses_[next]->expert, slot});
        batch_.push_back(misses_[next]);
      }
      if (fills_.empty()) throw std::logic_error("file cache: no slot free for layer " + std::to_string(il));
      fetch_now(il, step_seq);
      begin_compute();
      for (size_t j = 0; j < batch_.size(); ++j) add_compute(il, bind(il, batch_[j]->expert, cache_slot(il, fills_[j].slot)), *batch_[j], hidden);
      finish_compute();
      cache_misses_ += batch_.size();
      experts_file_ += batch_.size();
      cache_->unpin_all();
    }
    cache_filled_ = static_cast<uint64_t>(cache_->filled());
  }

  // Reads fills_ and waits for them; on failure the slots hold nothing and the error goes up.
  void fetch_now(int64_t il, uint64_t step_seq) {
    try {
      fetched_bytes_ += fetch_->send(il, fills_, step_seq);
      ++fetches_;
      fetch_->wait();
    } catch (...) {
      for (const cpu_worker::FileFetch::Item& it : fills_) cache_->abandon(it.slot);
      throw;
    }
    for (const cpu_worker::FileFetch::Item& it : fills_) cache_->end_fill(it.slot);
  }

  group::ArenaLayout::ExpertSlot cache_slot(int64_t il, int64_t slot) const { return al_.cache_slot(model_, il, index_, slot); }

  // This worker's part of the file cache: heat seeded from the census the placement read (the
  // manifest names it; none or unreadable: uniform), slots its predecessor left whole adopted.
  void open_file_cache() {
    const model::HParams& hp = model_.hp;
    group::Census seed;
    const std::string& census = man_.placement_census_path;
    if (!census.empty() && std::ifstream(census).good()) {
      try {
        seed = group::Census::read(census, hp.n_layer, hp.n_expert);
      } catch (const std::exception& e) {
        std::cerr << "cpu_expert_worker " << index_ << ": file cache starts without heat: " << e.what() << "\n";
      }
    }
    // Uses halve every 64 tokens' worth of routing (aging: heat follows what the prompt uses now).
    const auto aging = static_cast<uint64_t>(hp.n_layer * hp.n_expert_used * 64);
    cache_ = std::make_unique<cpu_worker::ExpertCache>(
        group::CacheDirectory(arena_.data() + al_.directory_of(index_), al_.cache_slots), hp.n_layer, hp.n_expert, seed, aging);
    if (const int64_t kept = cache_->adopt(); kept > 0) {
      std::cerr << "cpu_expert_worker " << index_ << ": file cache kept " << kept << " slots of its predecessor\n";
    }
    cache_filled_ = static_cast<uint64_t>(cache_->filled());
    fetch_ = std::make_unique<cpu_worker::FileFetch>(model_, al_, index_, io_endpoint_);
    hits_.reserve(static_cast<size_t>(hp.n_expert));
    misses_.reserve(static_cast<size_t>(hp.n_expert));
    misses_fill_.reserve(static_cast<size_t>(hp.n_expert));
    batch_.reserve(static_cast<size_t>(hp.n_expert));
    fills_.reserve(static_cast<size_t>(hp.n_expert));
    ahead_.reserve(static_cast<size_t>(hp.n_expert));
    by_heat_.reserve(static_cast<size_t>(hp.n_expert));
  }

  bool resident(int64_t il, int64_t e) const {
    return xl_.region("resident").at<const uint8_t>(exchange_.data())[il * model_.hp.n_expert + e] != 0;
  }
  std::array<model::Matrix, 3> mapped(int64_t il, int64_t e) const {
    const model::MoeWeights& W = model_.layers[static_cast<size_t>(il)].moe;
    return {W.gate.expert(e), W.up.expert(e), W.down.expert(e)};
  }
  std::array<model::Matrix, 3> bind(int64_t il, int64_t e, const group::ArenaLayout::ExpertSlot& slot) const {
    return group::ArenaLayout::bind(model_, il, e, slot, arena_.data());
  }
  // A RAM-tier expert's arena slot, or (a VRAM-tier expert the gpu_worker swapped out has no
  // arena slot) its rows in the model's own mapping: the page cache holds them since the upload
  // read them. Not for FILE-tier experts (staged on demand).
  std::array<model::Matrix, 3> in_memory(int64_t il, int64_t e, group::Tier tier) const {
    return tier == group::Tier::kRam ? bind(il, e, al_.ram_slot(il, e)) : mapped(il, e);
  }
  // Expert e of layer il on its bytes t, with the layer's expert biases and activation (gpt-oss).
  cpu::ExpertWeights expert_weights(int64_t il, int64_t e, const std::array<model::Matrix, 3>& t) const {
    cpu::ExpertWeights w{t[0].type, t[1].type, t[2].type, t[0].data, t[1].data, t[2].data, t[0].n_cols, t[0].n_rows};
    const model::LayerWeights& L = model_.layers[static_cast<size_t>(il)];
    const model::ExpertsPart& part = L.recipe.ffn.experts;
    if (part.biases && !L.moe.gate_bias.empty()) {
      w.gate_bias = L.moe.gate_bias.data() + e * w.ffn;
      w.up_bias = L.moe.up_bias.data() + e * w.ffn;
      w.down_bias = L.moe.down_bias.data() + e * w.hidden;
    }
    w.clamped_swiglu = part.act == model::Activation::SwiGluClamped;
    w.swiglu_alpha = static_cast<float>(part.swiglu_alpha);
    w.swiglu_limit = static_cast<float>(part.swiglu_limit);
    return w;
  }

  // Quantized experts go to the production kernels (kernels/cpu/expert_ffn.h), all of one pass
  // in one run_experts call (one pool job list per pass instead of two per expert: 8 Q4_K
  // experts at 1 token took 5.8 ms batched against 12.5 ms one by one on the loaded 2-core box),
  // reading their token rows in place in `hidden` (no gathering copy). Their
  // numbers are reference::swiglu_expert's bit for bit for the K-quants; for Q8_0 / MXFP4 each
  // dot is summed in another order (within twice the summation bound). Float experts (F32,
  // F16, BF16: test files, not what people run) keep the reference kernel, bit for bit.
  static bool production_kernel_for(const std::array<model::Matrix, 3>& t) {
    for (const model::Matrix& m : t) {
      if (m.type == TensorType::F32 || m.type == TensorType::F16 || m.type == TensorType::BF16) return false;
    }
    return true;
  }

  void begin_compute() {
    fast_weights_.clear();
    fast_ids_.clear();
    fast_jobs_.clear();
    fast_x_ = nullptr;
    fast_rows_ = 0;
  }

  void add_compute(int64_t il, const std::array<model::Matrix, 3>& t, const Work& w, const float* hidden) {
    const int32_t* rows = rows_.data() + w.first;
    if (!production_kernel_for(t)) {
      // The reference kernel takes contiguous rows: gather them.
      const int64_t d = model_.hp.n_embd;
      float* x = xg_.data();
      for (int32_t j = 0; j < w.m; ++j) std::copy_n(hidden + int64_t{rows[j]} * d, d, x + j * d);
      const model::LayerWeights& L = model_.layers[static_cast<size_t>(il)];
      reference::routed_expert(t, L.moe, w.expert, L.recipe.ffn.experts, x, w.m, w.y, scratch_, pool_);
      return;
    }
    // fast_weights_ has capacity n_expert (reserved), so the pointers jobs hold stay valid.
    fast_weights_.push_back(expert_weights(il, w.expert, t));
    fast_ids_.push_back(w.expert);
    fast_jobs_.push_back({&fast_weights_.back(), rows, w.m, w.y});
    fast_x_ = hidden;
    for (int32_t j = 0; j < w.m; ++j) fast_rows_ = std::max(fast_rows_, rows[j] + 1);
  }

  void finish_compute() {
    if (!fast_jobs_.empty()) ffn_.run_experts(fast_jobs_, fast_x_, fast_rows_, fast_pool_);
  }


  group::GroupManifest man_;
  int index_;
  const bool prefetch_;  // --ffn-prefetch-next-layer
  const bool read_ahead_;  // --file-read-ahead
  // Guesses a request for layer n_tokens rows at most (decode, short verify windows): a longer
  // one is a prefill step, whose calls are long and whose idle gaps are not the point.
  static constexpr uint32_t kMaxGuessRows = 4;
  std::vector<std::vector<cpu::ExpertWeights>> last_fast_;  // [layer] the RAM experts last computed (prefetch_)
  std::vector<std::vector<int32_t>> last_experts_;          // [layer] their ids
  std::unique_ptr<cpu_worker::NextLayerGuess> guess_;       // the router guess (nullptr: the last-token list)
  std::vector<int32_t> guess_experts_;                      // the router guess, before filtering
  std::vector<cpu::ExpertWeights> guessed_weights_;
  std::vector<int32_t> guessed_;                            // experts prefetched for guess_layer_
  int64_t guess_layer_ = -1;
  std::vector<const cpu::ExpertWeights*> prefetch_ptrs_;
  model::Model model_;   // shapes and types; the expert bytes used are the arena's
  shm::ShmSegment exchange_, arena_;
  group::ExchangeLayout xl_;
  group::PlacementPlan plan_;
  group::ArenaLayout al_;
  reference::ThreadPool pool_;     // float experts (reference kernel)
  cpu::ThreadPool fast_pool_;      // quantized experts: one pinned thread per core of --cpus, the first the doorbell thread's
  const std::chrono::microseconds spin_;  // --spin-us
  const bool watch_sharing_;              // !--exclusive-cpus: polls end early on a CPU found shared
  Clock::time_point last_answer_{};       // when the doorbell path last answered (the poll window starts there)
  cpu::MoeFfn ffn_;
  std::vector<cpu::ExpertWeights> fast_weights_;
  std::vector<int32_t> fast_ids_;   // their experts
  std::vector<cpu::MoeFfn::RowsJob> fast_jobs_;
  const float* fast_x_ = nullptr;  // the pass's activation rows (fast_jobs_ index them)
  int32_t fast_rows_ = 0;          // rows of fast_x_ the jobs reach
  group::ExpertPlan plan_exp_;
  std::vector<float> xg_;
  reference::ExpertScratch scratch_;
  std::vector<uint64_t> expert_bytes_;   // [layer]
  std::vector<int32_t> rows_;
  std::vector<Work> work_;
  std::mutex compute_mu_;
  std::string io_endpoint_;
  // The FILE tier (null when the plan has none): this worker's file cache and its reads.
  std::unique_ptr<cpu_worker::ExpertCache> cache_;
  std::unique_ptr<cpu_worker::FileFetch> fetch_;
  struct Hit {
    const Work* work;
    cpu_worker::ExpertCache::Found found;
  };
  std::vector<Hit> hits_;
  std::vector<const Work*> misses_, batch_;
  std::vector<cpu_worker::FileFetch::Item> fills_;   // batch_'s slots
  std::vector<cpu_worker::FileFetch::Item> ahead_;   // the read-ahead in flight
  int64_t ahead_layer_ = -1;                          // ... of this layer
  std::vector<int32_t> misses_fill_;                  // fill_marked's experts not cached
  std::atomic<uint64_t> fill_requests_{0}, fill_device_experts_{0}, fill_reads_{0};
  std::vector<int32_t> by_heat_;
  std::atomic<uint64_t> cache_hits_{0}, cache_misses_{0}, cache_stale_{0}, cache_evictions_{0}, cache_filled_{0};
  std::atomic<uint64_t> read_ahead_requests_{0}, read_ahead_experts_{0}, read_ahead_used_{0}, read_ahead_bytes_{0};
  std::atomic<uint64_t> prefetch_guessed_{0}, prefetch_right_{0}, prefetch_needed_{0}, prefetch_runs_{0}, prefetch_cut_{0};
  std::atomic<uint64_t> experts_ram_{0}, experts_file_{0}, fetches_{0}, fetched_bytes_{0}, bell_sleeps_{0};
};

int run(const std::string& socket_dir, int index, const std::string& cpus, int numa_node, int threads, int spin_us,
        bool exclusive_cpus, bool prefetch, bool read_ahead, const cpu::CpuKernelTuning& tuning) {
  std::vector<int> pinned;
  if (!cpus.empty()) {
    const std::vector<int> list = group::parse_cpu_list(cpus);
    pinned = list;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c : list) CPU_SET(c, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) throw std::runtime_error("--cpus " + cpus + ": sched_setaffinity failed");
    if (threads <= 0) threads = static_cast<int>(list.size());
  }
  if (numa_node >= 0) {
    if (numa_available() < 0 || numa_node > numa_max_node()) {
      throw std::runtime_error("--numa-node " + std::to_string(numa_node) + ": no such NUMA node on this host");
    }
    numa_run_on_node(numa_node);
    numa_set_preferred(numa_node);
  }
  group::install_stop_signals();
  const std::string instance = group::cpu_worker_instance(index);
  group::ControlServer control(control::ROLE_CPU_EXPERT_WORKER, instance, group::control_address(socket_dir, instance));
  // One stage for both ways in: a group uses one hand-off at a time.
  group::StageRecorder& doorbell_stage = control.add_stage("expert_cpu");
  group::StageRecorder& zmq_stage = doorbell_stage;
  control.set_state(control::LOADING);
  control.start();

  const group::GroupManifest man = group::GroupManifest::read(group::manifest_path(socket_dir));
  if (pinned.empty()) {
    // No --cpus: every CPU this process may run on (after --numa-node), one pool thread each.
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) != 0) throw std::runtime_error("sched_getaffinity failed");
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) pinned.push_back(c);
    }
  }
  if (threads > 0 && threads < static_cast<int>(pinned.size())) pinned.resize(static_cast<size_t>(threads));
  ExpertWorker worker(socket_dir, man, index, threads, pinned, spin_us, exclusive_cpus, prefetch, read_ahead, tuning);
  control.set_stats_hook([&](control::StatsReply& r) { worker.stats(r); });
  zmq::context_t ctx(1);
  messaging::JobServer server(ctx, group::jobs_endpoint(socket_dir, instance), worker.limits());
  control.set_state(control::SERVING);

  std::thread bells([&] {
    worker.pin_doorbell_thread();
    while (!control.shutdown_requested()) {
      if (!worker.serve_doorbell(std::chrono::milliseconds(100), doorbell_stage) &&
          !shm::process_alive(man.coordinator_pid, man.coordinator_start_ticks)) {
        std::cerr << instance << ": coordinator " << man.coordinator_pid << " is gone; exiting\n";
        control.request_shutdown();
      }
    }
  });
  const auto handler = [&](const jobs::JobEnvelope& job, jobs::JobReply& reply) {
    if (job.has_expert_jobs()) {
      worker.serve_jobs(job.expert_jobs(), reply, zmq_stage);
    } else if (!job.has_ping()) {
      throw std::runtime_error("a cpu_expert_worker takes expert_jobs and ping only");
    }
    reply.set_status(jobs::JOB_OK);
  };
  try {
    while (!control.shutdown_requested()) {
      if (group::signal_received()) control.request_shutdown();
      if (group::serve_one_job(server, handler, std::chrono::milliseconds(100)) == messaging::ServeResult::kRejected) {
        std::cerr << instance << ": rejected a job: " << server.last_error() << "\n";
      }
    }
  } catch (...) {
    control.request_shutdown();
    bells.join();
    throw;
  }
  bells.join();
  control.stop();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moraine-cpu-expert-worker: routed experts from the RAM arena and, via the io_worker, the model file"};
  std::string socket_dir, cpus;
  int index = 0, numa_node = -1, threads = 0;
  // The default is what the supervisor runs (it passes no --spin-us); why 2 ms: kDecodeSpinUs.
  int spin_us = moraine::cpu::kDecodeSpinUs;
  app.add_option("--socket-dir", socket_dir, "group socket directory (holds group.json)")->required();
  app.add_option("--index", index, "this worker's index in the group, 0-based (default 0; the supervisor passes it)");
  app.add_option("--cpus", cpus, "cores to pin the expert threads to, e.g. 0-3,8 (default: every CPU this process may run on)");
  app.add_option("--numa-node", numa_node, "NUMA node whose cores and memory to use (default: none, the OS's placement)");
  app.add_option("--threads", threads, "expert threads, one per CPU from the first (default: the --cpus count, else every CPU allowed)");
  app.add_option("--spin-us", spin_us,
                 "microseconds the request doorbell and the expert threads keep polling after a layer before they sleep "
                 "(default 2000: covers the gap between layers while tokens are generated; 0: sleep at once)")
      ->check(CLI::Range(0, 1000000));
  // Off by default: with it the polls stop being cut short in a VM, but 12G decode on the H200
  // host was no faster (123.5 vs 128.8 tok/s; docs/perf-log.md, "--exclusive-cpus").
  bool exclusive_cpus = false;
  app.add_flag("--exclusive-cpus,!--shared-cpus", exclusive_cpus,
               "the --cpus are this worker's alone: poll the whole --spin-us window even when a CPU looks shared "
               "(default --shared-cpus: such a poll sleeps early, so another task on the CPU is not starved)");
  // On by default: 12G decode on the H200 host 190 vs 167 tok/s (docs/perf-log.md, "prefetch_experts").
  bool prefetch_next_layer = true;
  app.add_flag("--ffn-prefetch-next-layer,!--no-ffn-prefetch-next-layer", prefetch_next_layer,
               "after answering layer L, pull into the expert threads' L2 the experts layer L+1's router guesses this worker "
               "will compute, until the next request rings (default on: the threads are idle then; off leaves the memory "
               "bandwidth of that gap to other work)");
  bool file_read_ahead = true;
  app.add_flag("--file-read-ahead,!--no-file-read-ahead", file_read_ahead,
               "after answering layer L, have the io_worker read into the file cache the FILE-tier experts layer L+1's router "
               "guesses this worker will compute (at a prefill step: all of that layer's, hottest first), while the GPU "
               "routes it (default on)");
  moraine::cpu::CpuKernelTuning tuning;
  // Each thread computes its share of every expert, so that a prefetched guess lands in the L2
  // that reads it (docs/perf-log.md, "FfnSliceOptions::per_expert").
  tuning.slices.per_expert = true;
  app.add_option("--amx-min-tokens", tuning.matvec.amx_min_tokens,
                 "rows of a request from which the expert matrices go through the AMX tiles on CPUs with AMX (default 32: "
                 "below it the VNNI tiles were faster on the one AMX host measured)")
      ->check(CLI::Range(1, 1 << 20));
  CLI11_PARSE(app, argc, argv);
  try {
    return run(socket_dir, index, cpus, numa_node, threads, spin_us, exclusive_cpus, prefetch_next_layer, file_read_ahead, tuning);
  } catch (const std::exception& e) {
    std::cerr << "moraine-cpu-expert-worker: " << e.what() << "\n";
    return 1;
  }
}
