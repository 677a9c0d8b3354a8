// moraine-gpu-worker: runs the layer chain of each step the coordinator hands it (the step
// doorbells of the exchange segment, coordinator/step_bell.h, or with the manifest's step_channel
// "zmq" a LayerStep descriptor over ZeroMQ: one hop per step, not per layer). Per layer: mixer +
// router on the backend, routing published in the exchange segment, the cpu_expert_workers handed
// the layer (doorbells by default, ZeroMQ ExpertJobList with the manifest's zmq_handoff), their
// outputs summed with the shared expert. Experts the placement plan put in VRAM are computed here,
// by the backend, while the cpu workers compute theirs. Logits go to the exchange segment's logits
// rows, or for greedy decode (StepHeader::greedy_token) only each row's argmax to StepReply.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iostream>
#include <optional>

#include "common/messaging/job_channel.h"
#include "common/shm/doorbell.h"
#include "common/shm/shm_segment.h"
#include "coordinator/census.h"
#ifdef MORAINE_HAVE_CUDA
#include "gpu_worker/kernel_trace.h"
#endif
#include "coordinator/control_server.h"
#include "coordinator/device_reserve.h"
#include "coordinator/group_layout.h"
#include "coordinator/process_util.h"
#include "coordinator/step_bell.h"
#include "gpu_worker/backend.h"
#include "gpu_worker/file_stage.h"
#include "gpu_worker/sequence_store.h"
#include "gpu_worker/step_segments.h"

namespace {

using namespace moraine;
using Clock = std::chrono::steady_clock;

double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

// How long one layer waits for its experts. Long enough for a killed worker to be restarted by
// the supervisor and to load (seconds on the golden models), short enough to fail a step whose
// worker is gone for good.
constexpr auto kExpertDeadline = std::chrono::seconds(60);
constexpr auto kZmqAttempt = std::chrono::milliseconds(2000);
// How long the host thread spins on a cpu worker's answer before it sleeps: the answer takes
// ~50-300 us per layer during decode (expert_cpu, 12 GB budget, H200 machine), past the
// doorbell's default 20 us, and a futex wake-up adds tens of us per layer. The thread has a
// core of its own (supervisor --reserve-cores), so spinning costs nothing the workers need.
constexpr auto kExpertSpin = std::chrono::milliseconds(2);

class StepRunner {
 public:
  // base: the command line's backend options (device, threads, hand-off copies); the rest comes
  // from the manifest and the placement.
  StepRunner(const std::string& socket_dir, const group::GroupManifest& man, const std::string& backend_kind,
             const gpu_worker::BackendOptions& base, const model::Model& m, group::StageRecorder& step_stage,
             group::StageRecorder& handoff_stage, group::StageRecorder& routed_wait_stage)
      : man_(man), m_(m), exchange_(shm::ShmSegment::open(man.exchange_locator)),
        xl_(group::ExchangeLayout::build(m.hp, man.max_tokens, man.n_cpu_workers, man.long_step_rows)),
        placement_(group::PlacementPlan::read(man.placement_path, group::model_sizes(m, 0))),
        census_(m.hp.n_layer, m.hp.n_expert, man.census_path), step_stage_(step_stage), handoff_stage_(handoff_stage),
        routed_wait_stage_(routed_wait_stage) {
    if (exchange_.data_bytes() < xl_.layout.total_bytes()) throw std::runtime_error("exchange segment is smaller than this model's layout");
    for (int64_t il = 0; il < m.hp.n_layer; ++il) vram_experts_.push_back(placement_.experts_in(il, group::Tier::kVram));
    std::cerr << "gpu_worker: " << placement_.vram.experts << " VRAM-tier experts, "
              << model::kv_type_name(placement_.kv_type) << " KV cache\n";
    gpu_worker::BackendOptions o = base;
    o.max_tokens = man.max_tokens;
    o.long_step_rows = man.long_step_rows;
    o.slots = man.slots;
    o.max_context = std::max<int64_t>(placement_.context, std::max(man.max_tokens, man.long_step_rows));
    // A long step stages a layer's whole RAM tier (and FILE tier) at once: as many slots as its largest layer's
    // (the coordinator's reserve holds them, coordinator/device_reserve.h).
    if (man.long_step_rows > 0 && o.stage_experts > 0)
      o.stage_experts = static_cast<int>(std::max<int64_t>(o.stage_experts, group::long_step_stage_slots(placement_)));
    o.kv_type = placement_.kv_type;   // what the placement charged to --vram
    o.all_experts = placement_.vram.experts == m.hp.n_layer * m.hp.n_expert;
    if (!o.all_experts) o.device_experts = vram_experts_;
    backend_ = gpu_worker::make_backend(backend_kind, m, o);
    backend_->pin_host_memory(exchange_.data(), exchange_.data_bytes());
    if (const uint64_t used = backend_->device_bytes_in_use();
        placement_.vram_budget != group::kUnlimitedBytes && used > placement_.vram_budget) {
      std::cerr << "gpu_worker: device memory in use after setup, " << (used >> 20) << " MiB, is above --vram "
                << (placement_.vram_budget >> 20) << " MiB (the placement charged " << (placement_.device_reserve_bytes >> 20)
                << " MiB for context and scratch)\n";
    }
    all_on_device_ = backend_->all_on_device();
    // The RAM tier, pinned, for the experts the device takes over from the cpu workers
    // (handoff_take_expert and long steps' stage_experts copy them from here over PCIe).
    // (Staging only where the backend stages, Backend::stages_experts; taking an expert, any backend.)
    const bool stage = o.stage_experts > 0 && backend_->stages_experts();
    if ((o.take_expert_from > 0 || stage) && !all_on_device_ && !man.zmq_handoff && !man.arena_locator.empty()) {
      const auto t0 = Clock::now();
      arena_.emplace(shm::ShmSegment::open(man.arena_locator));
      al_.emplace(group::ArenaLayout::build(m, placement_));
      if (arena_->data_bytes() < al_->total_bytes) throw std::runtime_error("arena segment is smaller than this model's layout");
      backend_->pin_host_memory(arena_->data(), arena_->data_bytes());
      take_from_ = o.take_expert_from;
      stage_ = stage;
      stage_min_rows_ = o.stage_min_rows;
      stage_share_ = o.stage_share;
      tear_file_copies_ = o.fault_tear_file_copies;
      stage_rows_.reserve(static_cast<size_t>(m.hp.n_expert));
      // The FILE tier's cache slots, for long steps' staging of what they hold (file_stage.h).
      if (stage && o.stage_file && al_->cache_slots > 0 && placement_.file.experts > 0 && m.hp.n_expert <= group::kMaxMarkedExperts) {
        std::vector<group::CacheDirectory> dirs;
        for (int w = 0; w < man.n_cpu_workers; ++w) dirs.emplace_back(arena_->data() + al_->directory_of(w), al_->cache_slots);
        stager_ = gpu_worker::FileStager(std::move(dirs), m.hp.n_expert);
        file_candidates_.reserve(static_cast<size_t>(m.hp.n_expert));
      }
      std::cerr << "gpu_worker: the RAM tier (" << (arena_->data_bytes() >> 20) << " MiB) mapped for the device in "
                << static_cast<int64_t>(us_since(t0) / 1000) << " ms; "
                << (take_from_ > 0 ? "it takes one expert of a layer where a cpu worker has at least " + std::to_string(take_from_) + "; "
                                   : std::string())
                << (stage_ ? "long steps compute the RAM tier's experts on the device" : "")
                << (!stager_.empty() ? ", and the FILE tier's that the file cache holds" : "") << "\n";
    }
    resident_ = xl_.region("resident").at<uint8_t>(exchange_.data());
    for (int64_t il = 0; il < m.hp.n_layer; ++il)
      for (int64_t e = 0; e < m.hp.n_expert; ++e)
        resident_[il * m.hp.n_expert + e] = placement_.at(il, e) == group::Tier::kVram ? 1 : 0;
    use_.assign(static_cast<size_t>(m.hp.n_layer * m.hp.n_expert), 0.0f);
    layer_slots_ = std::vector<std::atomic<uint64_t>>(static_cast<size_t>(m.hp.n_layer));
    layer_vram_slots_ = std::vector<std::atomic<uint64_t>>(static_cast<size_t>(m.hp.n_layer));
    const int64_t k = m.hp.n_expert_used;
    chosen_stride_ = std::max(man.max_tokens, man.long_step_rows) * k;
    step_chosen_.resize(static_cast<size_t>(m.hp.n_layer * chosen_stride_));
    worker_busy_.resize(static_cast<size_t>(man.n_cpu_workers));
    worker_misses_.resize(static_cast<size_t>(man.n_cpu_workers));
    worker_ram_expert_.resize(static_cast<size_t>(man.n_cpu_workers));
    seen_.resize(static_cast<size_t>(m.hp.n_expert));
    plan_.reserve(m.hp.n_expert, man.max_tokens * k);
    for (int w = 0; w < man.n_cpu_workers; ++w) {
      expert_seq_ = std::max(expert_seq_, bell(group::ExchangeLayout::request_bell(w))->load());
      endpoints_.push_back(group::jobs_endpoint(socket_dir, group::cpu_worker_instance(w)));
      clients_.push_back(std::make_unique<messaging::JobClient>(ctx_, endpoints_.back()));
    }
  }

  uint64_t shm_mapped() const { return exchange_.data_bytes(); }
  // At exit: what is still counted goes into the census file.
  void flush_census() { report(census_.flush()); }
  uint64_t experts_vram() const { return experts_vram_.load(); }
  uint64_t experts_swapped_in() const { return experts_swapped_in_.load(); }
  uint64_t experts_taken() const { return experts_taken_.load(); }
  uint64_t experts_staged() const { return experts_staged_.load(); }
  // Long steps' FILE-tier experts (stage_file_experts): staged, not cached (the workers'), torn, fill rounds.
  void file_stage_counters(control::StatsReply& r) const {
    auto& c = *r.mutable_counters();
    c["experts_device_staged_file"] = experts_staged_file_.load(), c["file_stage_uncached"] = file_stage_uncached_.load();
    c["file_stage_torn"] = file_stage_torn_.load(), c["file_fill_requests"] = file_fill_requests_.load();
  }
  uint64_t handoff_steps() const { return handoff_steps_.load(); }
  const gpu_worker::SequenceStore& sequence_store() const { return store_; }
  // The most seen after a step, or now if more (Stats reads it after a run's last step).
  uint64_t device_used_peak() const { return std::max(device_used_peak_.load(), backend_->device_bytes_in_use()); }
  // Per layer: routed slots, and those computed on the device (the VRAM hit rate per layer).
  void layer_counters(control::StatsReply& r) const {
    char name[40];
    for (size_t il = 0; il < layer_slots_.size(); ++il) {
      std::snprintf(name, sizeof name, "layer_%03zu_slots", il);
      (*r.mutable_counters())[name] = layer_slots_[il].load();
      std::snprintf(name, sizeof name, "layer_%03zu_vram_slots", il);
      (*r.mutable_counters())[name] = layer_vram_slots_[il].load();
    }
  }

  std::byte* exchange() const { return exchange_.data(); }
  const group::ExchangeLayout& exchange_layout() const { return xl_; }

  messaging::JobLimits limits() const {
    return {{{group::kExchangeSegmentId, exchange_.data_bytes()}},
            static_cast<uint32_t>(m_.hp.n_layer), static_cast<uint32_t>(m_.hp.n_expert),
            static_cast<uint32_t>(man_.max_tokens), static_cast<uint32_t>(m_.hp.n_embd * sizeof(float)), {}};
  }

  // The step the StepHeader describes, which must be step `seq` of n_tokens tokens from
  // first_position (what the LayerStep or the step doorbell named). Returns the greedy token
  // (StepHeader::greedy_token) or -1.
  int32_t run(uint64_t seq, uint64_t n_tokens, uint64_t first_position) {
    const auto t0 = Clock::now();
    std::byte* base = exchange_.data();
    const auto* hdr = xl_.region("step").at<const group::StepHeader>(base);
    const int64_t n = hdr->n_tokens;
    if (hdr->step_seq != seq || static_cast<uint64_t>(n) != n_tokens || hdr->first_position != first_position) {
      throw std::runtime_error("step " + std::to_string(seq) + " does not match the step header in shared memory (seq " +
                               std::to_string(hdr->step_seq) + ", " + std::to_string(n) + " tokens)");
    }
    const int64_t most = std::max(man_.max_tokens, man_.long_step_rows);
    if (n < 1 || n > most)
      throw std::runtime_error("step header: " + std::to_string(n) + " tokens, expected 1.." + std::to_string(most));
    if (n > man_.max_tokens && hdr->logit_rows != 1)
      throw std::runtime_error("step header: a long step of " + std::to_string(n) + " rows with " +
                               std::to_string(hdr->logit_rows) + " logit rows (long steps give the last row's)");
    if (hdr->logit_rows == 0 || hdr->logit_rows > n) throw std::runtime_error("step header: logit_rows out of [1, n_tokens]");
    if (hdr->greedy_token && hdr->logit_rows > group::kMaxTokenRows)
      throw std::runtime_error("step header: greedy tokens of " + std::to_string(hdr->logit_rows) + " rows, at most " +
                               std::to_string(group::kMaxTokenRows));
    // Every row's token and first non-finite logit go straight into the step's reply
    // (StepHeader::greedy_token, check_finite); write_step_reply leaves those fields alone.
    group::StepReply& reply = *xl_.region("step_reply").at<group::StepReply>(base);
    std::fill_n(reply.row_tokens, group::kMaxTokenRows, -1);
    std::fill_n(reply.row_nonfinite, group::kMaxTokenRows, -1);
    std::fill_n(reply.segment_token, group::kMaxSegments, -1);
    reply.nonfinite = -1;
    reply.mtp_n_drafts = reply.mtp_row = -1;
    if (hdr->mtp_drafts > group::kMaxTokenRows || (hdr->mtp_drafts > 0 && (!hdr->mtp || !hdr->greedy_token)))
      throw std::runtime_error("step header: " + std::to_string(hdr->mtp_drafts) + " MTP drafts (at most " +
                               std::to_string(group::kMaxTokenRows) + ", with mtp and greedy_token set)");
    backend_->set_token_output(hdr->greedy_token ? reply.row_tokens : nullptr,
                               hdr->check_finite ? reply.row_nonfinite : nullptr);
    const bool batched = hdr->n_segments > 0;
    if (batched && n > man_.max_tokens)
      throw std::runtime_error("step header: a batched step of " + std::to_string(n) + " rows (at most " +
                               std::to_string(man_.max_tokens) + ": no long steps)");
    const auto last_row = [&] {
      if (batched) gpu_worker::segment_tokens(*hdr, reply);
      mtp_after_step(*hdr, tokens_of_step(), reply);
      reply.nonfinite = reply.row_nonfinite[hdr->logit_rows - 1];
      return hdr->greedy_token ? reply.row_tokens[hdr->logit_rows - 1] : -1;
    };
    if (hdr->state_save != 0 && broken_)
      throw std::runtime_error("step " + std::to_string(seq) + " saves a sequence that an earlier step left half-done");
    if (hdr->slot >= static_cast<uint32_t>(backend_->slots()))
      throw std::runtime_error("step header: slot " + std::to_string(hdr->slot) + ", the backend has " +
                               std::to_string(backend_->slots()) + " (GroupManifest::slots)");
    backend_->select_slot(static_cast<int>(hdr->slot));
    store_.apply(seq, *hdr, *backend_, reply);   // the conversation cache (sequence_store.h), on hdr->slot
    if (hdr->state_load != 0) broken_ = false;
    if (hdr->reset) {
      backend_->reset();
      broken_ = false;
    }
    if (batched && std::all_of(hdr->segments, hdr->segments + std::min<size_t>(hdr->n_segments, group::kMaxSegments),
                               [](const group::StepSegment& g) { return g.reset != 0; }))
      broken_ = false;   // every slot the failed step touched may be among them: the coordinator resets them all
    if (broken_) throw std::runtime_error("an earlier step failed half-way; the coordinator must reset the sequence");
    // A batched step's segments carry their own positions, resets, rewinds and snapshots.
    std::vector<gpu_worker::Segment> segments;
    if (batched) segments = gpu_worker::prepare_segments(*hdr, *backend_, man_.max_tokens);
    if (!batched && hdr->rewind && !hdr->reset && hdr->first_position < backend_->n_past()) {
      if (!backend_->can_rewind())
        throw std::runtime_error("step " + std::to_string(seq) + " drops cached positions from " +
                                 std::to_string(hdr->first_position) + " on, but this backend and model cannot");
      backend_->rewind(hdr->first_position);
    }
    if (!batched && hdr->first_position != backend_->n_past()) {
      throw std::runtime_error("step starts at position " + std::to_string(hdr->first_position) + " but " +
                               std::to_string(backend_->n_past()) + " positions are cached");
    }
    if (hdr->snapshot) {
      if (!backend_->can_rewind())
        throw std::runtime_error("step " + std::to_string(seq) + " asks for a snapshot of the recurrent state, but this "
                                 "backend cannot rewind");
      backend_->snapshot();
    }
    for (const auto& [il, e] : backend_->landed_swaps()) {   // between steps: no worker is computing
      resident_[il * m_.hp.n_expert + e] = 1;
      ++experts_swapped_in_;
    }
    broken_ = true;   // until the step completes: caches are appended layer by layer
    if (batched) backend_->set_segments(segments);   // the next embed (step_whole, handoff_begin) takes them
    const int64_t k = m_.hp.n_expert_used, nk = n * k;
    float* hidden = xl_.region("hidden").at<float>(base);
    int32_t* chosen = xl_.region("chosen").at<int32_t>(base);
    float* weights = xl_.region("weights").at<float>(base);
    float* expert_out = xl_.region("expert_out").at<float>(base);
    const int32_t* tokens = tokens_of_step();
    float* logits = xl_.region("logits").at<float>(base);
    if (n > man_.max_tokens) {
      run_long_step(seq, n, tokens, logits);
      finish_step(n, t0);
      return last_row();
    }
    if (all_on_device_) {   // no cpu worker takes part: the backend may replay a captured step
      backend_->step_whole(tokens, n, hdr->logit_rows, logits, step_chosen_.data(), chosen_stride_);
      finish_step(n, t0);
      return last_row();
    }
    // The whole step in one launch when the backend can: the device waits on flags in host
    // memory at each layer with cpu-worker experts while this thread hands the layers over.
    if (backend_->handoff_supported(n) && backend_->handoff_begin(tokens, n, hdr->logit_rows, {chosen, weights, hidden, expert_out})) {
      try {
        for (int64_t il = 0; il < m_.hp.n_layer; ++il) {
          if (backend_->layer_on_device(il)) continue;
          const auto tw = Clock::now();
          backend_->handoff_wait_routed(il);
          routed_wait_stage_.record(static_cast<uint64_t>(n), 0, 0, us_since(tw));
          hand_layer_to_workers(seq, il, n, chosen, true);
          backend_->handoff_release(il, plan_);
        }
        backend_->handoff_finish(logits, step_chosen_.data(), chosen_stride_);
        ++handoff_steps_;
      } catch (...) {
        backend_->handoff_abort();
        throw;
      }
      finish_step(n, t0);
      return last_row();
    }
    backend_->embed(tokens, n);
    for (int64_t il = 0; il < m_.hp.n_layer; ++il) {
      int32_t* layer_chosen = step_chosen_.data() + il * chosen_stride_;
      if (backend_->layer_on_device(il)) {   // no cpu worker can be involved: no host round trip
        backend_->layer_whole(il, n, layer_chosen);
        continue;
      }
      backend_->layer_begin(il, n, chosen, weights, hidden);
      std::copy_n(chosen, nk, layer_chosen);
      hand_layer_to_workers(seq, il, n, chosen);
      backend_->layer_end(il, n, plan_, expert_out);
    }
    backend_->advance(n);
    backend_->logits(hdr->logit_rows, logits);
    finish_step(n, t0);
    return last_row();
  }

 private:
  const int32_t* tokens_of_step() const { return xl_.region("tokens").at<const int32_t>(exchange_.data()); }

  // StepHeader::mtp, once the step's rows are done: the MTP head follows the sequence and drafts
  // after the row decode goes on from (a verify window's first rejected draft's row, else the last).
  // A backend without the head answers no drafts (-1): the coordinator falls back to its suffix drafts.
  void mtp_after_step(const group::StepHeader& h, const int32_t* tokens, group::StepReply& reply) {
    if (!h.mtp) {
      backend_->mtp_skip();
      return;
    }
    if (!backend_->can_mtp()) return;
    const int64_t n = h.n_tokens, R = h.logit_rows;
    int64_t a = R - 1;
    if (h.greedy_token) {
      a = 0;
      while (a < R - 1 && reply.row_tokens[a] == tokens[n - R + 1 + a]) ++a;
    }
    const int32_t base_token = h.greedy_token ? reply.row_tokens[a] : -1;
    reply.mtp_n_drafts = static_cast<int32_t>(backend_->mtp_step(tokens, n, n - R + a, base_token, h.mtp_drafts, reply.mtp_draft));
    reply.mtp_row = static_cast<int32_t>(a);
  }

  // Layer il's experts off the device: the plan of the routing in `chosen`, then the cpu
  // workers that own a chosen expert compute their rows into the exchange's expert_out (the
  // VRAM-tier experts are already running on the device).
  // may_take: the device may take one of the misses (between handoff_wait_routed and release).
  // A long step's layer il, ahead of its turn (Backend::prefetch_staged): every RAM-tier expert not
  // on the device, when the step stages them all (stage_ram_experts with the whole share; a long
  // step's windows route to nearly every expert: 8192 rows x 8 of 128 experts at the 30B shape).
  void prefetch_ram_tier(int64_t il, int64_t n) {
    if (!stage_ || stage_share_ < 1 || n < stage_min_rows_ || il >= m_.hp.n_layer || backend_->layer_on_device(il) ||
        !backend_->stage_supported(il, n))
      return;
    const int64_t E = m_.hp.n_expert;
    prefetch_.clear();
    for (int64_t e = 0; e < E; ++e)
      if (!resident_[il * E + e] && placement_.at(il, e) == group::Tier::kRam)
        prefetch_.push_back({static_cast<int32_t>(e), group::ArenaLayout::bind(m_, il, e, al_->ram_slot(il, e), arena_->data())});
    backend_->prefetch_staged(il, prefetch_);
  }

  // step_rows: the rows of the whole step when this is a window of a long step (staging is decided on them).
  // first_window: the layer's first window of the step (a step of one window: always).
  void hand_layer_to_workers(uint64_t step_seq, int64_t il, int64_t n, const int32_t* chosen, bool may_take = false,
                             int64_t step_rows = 0, bool first_window = true) {
    const int64_t nk = n * m_.hp.n_expert_used;
    plan_.build(chosen, nk, m_.hp.n_expert);
    const auto th = Clock::now();
    device_expert_ = may_take ? expert_to_take(il) : -1;
    std::fill(std::begin(marked_), std::end(marked_), 0);
    staged_.clear();
    stager_.clear_pending();
    file_uncached_now_ = false;
    stage_from_rows_ = 0;
    if (!may_take) {
      stage_from_rows_ = stage_ram_experts(il, std::max(n, step_rows));
      stage_file_experts(il, n, std::max(n, step_rows), first_window);
      submit_staged(il);
    }
    // Outside the in-graph hand-off (may_take) the step goes through layer_begin / layer_end: the
    // device's plan-dependent experts (a long step's GEMM over its resident and staged experts)
    // start now, beside the workers, instead of at layer_end after them.
    if (!may_take) backend_->experts_planned(il, n, plan_);
    // Workers reading FILE experts the device left may evict the slots just copied: settle those first.
    if (file_uncached_now_) settle_file_copies(il);
    if (man_.zmq_handoff) {
      handoff_zmq(step_seq, il, n);
    } else if (mark_busy_workers(il, chosen, nk)) {
      ring_workers(il, n);
      take_expert(il);   // after the ring: the workers start first (the CUDA calls take ~10 us)
      wait_workers(il);
    } else {
      take_expert(il);
    }
    if (!man_.zmq_handoff) check_file_copies(il, n);
    handoff_stage_.record(static_cast<uint64_t>(n), static_cast<uint64_t>(nk), 0, us_since(th));
  }

  // A long step (GroupManifest::long_step_rows): each layer over windows of max_tokens rows in
  // order, so the RAM-tier experts a layer stages cross PCIe once for the whole step (the backend
  // keeps a layer's staged copies for its next windows); the per-window exchange rows (h, routing,
  // the cpu workers' rows) are reused window after window. Staging is decided on the whole step's
  // rows: its last, shorter window uses the copies already made.
  void run_long_step(uint64_t seq, int64_t n, const int32_t* tokens, float* logits) {
    const int64_t k = m_.hp.n_expert_used, window = man_.max_tokens;
    std::byte* base = exchange_.data();
    float* hidden = xl_.region("hidden").at<float>(base);
    int32_t* chosen = xl_.region("chosen").at<int32_t>(base);
    float* weights = xl_.region("weights").at<float>(base);
    float* expert_out = xl_.region("expert_out").at<float>(base);
    backend_->embed(tokens, n);
    prefetch_ram_tier(0, n);
    for (int64_t il = 0; il < m_.hp.n_layer; ++il) {
      prefetch_ram_tier(il + 1, n);   // its copies land while this layer computes
      int32_t* layer_chosen = step_chosen_.data() + il * chosen_stride_;
      const bool whole = backend_->layer_on_device(il);
      for (int64_t first = 0; first < n; first += window) {
        const int64_t rows = std::min(window, n - first);
        backend_->set_window(first, rows);
        if (whole) {
          backend_->layer_whole(il, rows, layer_chosen + first * k);
          continue;
        }
        backend_->layer_begin(il, rows, chosen, weights, hidden);
        std::copy_n(chosen, rows * k, layer_chosen + first * k);
        hand_layer_to_workers(seq, il, rows, chosen, false, n, first == 0);
        backend_->layer_end(il, rows, plan_, expert_out);
      }
    }
    backend_->advance(n);
    backend_->logits(1, logits);
  }

  void finish_step(int64_t n, Clock::time_point t0) {
    // cudaMemGetInfo is a driver call: read it at most once a second, not on every decode step
    // (nothing the backend allocates is freed before it goes, so a later read still sees it).
    if (const auto now = Clock::now(); now - device_used_sampled_ >= std::chrono::seconds(1)) {
      device_used_sampled_ = now;
      const uint64_t used = backend_->device_bytes_in_use();
      if (used > device_used_peak_.load()) device_used_peak_.store(used);
    }
    record_routing(n);
    report(census_.flush_if_due());
    if (man_.vram_adapt_every > 0 && ++steps_since_adapt_ >= man_.vram_adapt_every) {
      steps_since_adapt_ = 0;
      adapt_vram_tier();
    }
    broken_ = false;
    step_stage_.record(static_cast<uint64_t>(n), 0, 0, us_since(t0));
  }

  // The adaptive VRAM tier: per layer, the most used expert off the device replaces the least used
  // one on it when it was used more than twice as often (plus one, so that noise in small counts
  // does not churn). The use counts halve every round, so they follow what is used now. At most
  // kSwapsPerRound copies start per round (each is a few MB over PCIe, overlapping the next steps).
  void adapt_vram_tier() {
    constexpr int kSwapsPerRound = 8;
    const int64_t E = m_.hp.n_expert;
    int started = 0;
    for (int64_t il = 0; il < m_.hp.n_layer && started < kSwapsPerRound; ++il) {
      float* use = use_.data() + il * E;
      const uint8_t* res = resident_ + il * E;
      int32_t in = -1, out = -1;
      for (int64_t e = 0; e < E; ++e) {
        if (res[e]) {
          if (out < 0 || use[e] < use[out]) out = static_cast<int32_t>(e);
        } else if (in < 0 || use[e] > use[in]) {
          in = static_cast<int32_t>(e);
        }
      }
      if (in < 0 || out < 0 || use[in] <= 2.0f * use[out] + 1.0f) continue;
      if (!backend_->begin_swap(il, out, in)) continue;
      resident_[il * E + out] = 0;   // the cpu workers compute it from the next step on
      ++started;
    }
    for (float& u : use_) u *= 0.5f;
  }

  static void report(const group::CensusFlush& f) {
    if (!f.replaced.empty()) std::cerr << "gpu_worker: census file replaced: " << f.replaced << "\n";
    if (!f.error.empty()) std::cerr << "gpu_worker: census not written (kept for the next try): " << f.error << "\n";
  }

  shm::Doorbell* bell(size_t i) const {
    return shm::Doorbell::at(exchange_.data() + xl_.region("bells").offset + i * sizeof(shm::Doorbell));
  }

  // worker_busy_[w]: worker w owns a chosen expert of layer il that is not in VRAM.
  bool mark_busy_workers(int64_t il, const int32_t* chosen, int64_t nk) {
    std::fill(worker_busy_.begin(), worker_busy_.end(), 0);
    bool any = false;
    for (int64_t i = 0; i < nk; ++i) {
      const int32_t e = chosen[i];
      if (e < 0 || e >= m_.hp.n_expert || resident_[il * m_.hp.n_expert + e] || e == device_expert_ ||
          staged_here(il, e) || marked(e))
        continue;
      worker_busy_[static_cast<size_t>(group::expert_owner(e, man_.n_cpu_workers))] = 1;
      any = true;
    }
    return any;
  }

  // A long step's layer il: the RAM-tier experts it uses that are not on the device now go to
  // the device (Backend::stage_experts: copied in over PCIe and run by its GEMM), those with the
  // most rows first, BackendOptions::stage_share of them (ties at the last one's row count go
  // too); the cpu workers compute the others meanwhile and skip the staged ones
  // (ExpertRequest::device_stages_from_rows: the same rule on the same routing). FILE-tier
  // experts: stage_file_experts. Returns the row count from which experts were staged (0: none);
  // the list goes to the backend in submit_staged.
  int32_t stage_ram_experts(int64_t il, int64_t n) {
    if (!stage_ || stage_share_ <= 0 || n < stage_min_rows_ || !backend_->stage_supported(il, n)) return 0;
    const int64_t E = m_.hp.n_expert;
    stage_rows_.clear();
    for (int64_t e = 0; e < E; ++e)
      if (staged_rule(il, e, 1)) stage_rows_.push_back(plan_.count(e));   // every candidate
    if (stage_rows_.empty()) return 0;
    const size_t take = std::clamp<size_t>(static_cast<size_t>(std::ceil(stage_share_ * static_cast<double>(stage_rows_.size()))), 1,
                                           stage_rows_.size());
    std::nth_element(stage_rows_.begin(), stage_rows_.begin() + static_cast<std::ptrdiff_t>(take - 1), stage_rows_.end(), std::greater<>());
    const int32_t from_rows = stage_rows_[take - 1];
    for (int64_t e = 0; e < E; ++e) {
      if (!staged_rule(il, e, from_rows)) continue;
      staged_.push_back({static_cast<int32_t>(e), group::ArenaLayout::bind(m_, il, e, al_->ram_slot(il, e), arena_->data())});
    }
    experts_staged_ += staged_.size();
    return from_rows;
  }

  // The staged RAM-tier and FILE-tier experts to the backend in one list, by expert id: the
  // order a step with all of them in RAM stages them in (the same GEMM rows, the same bits).
  void submit_staged(int64_t il) {
    if (staged_.empty()) return;
    std::sort(staged_.begin(), staged_.end(), [](const auto& a, const auto& b) { return a.expert < b.expert; });
    backend_->stage_experts(il, staged_);
  }

  // A long step's layer il (file_stage.h): its FILE experts with rows that the file cache holds
  // whole are staged from their slots and marked (their owners skip them); the rest stay with the
  // workers. At the first window the owners read the layer into their cache first (fill_file_cache):
  // mostly a wait for the read-ahead already in flight (a prefill routes to nearly every expert),
  // and the answer restarts the read-ahead of the next layer even where the device takes all a
  // worker has (workers read ahead after an answer only). Later windows reuse checked copies.
  void stage_file_experts(int64_t il, int64_t n, int64_t step_rows, bool first) {
    if (stager_.empty() || step_rows < stage_min_rows_ || !backend_->stage_supported(il, step_rows)) return;
    const int64_t E = m_.hp.n_expert;
    file_candidates_.clear();
    file_uncached_now_ = false;
    for (int64_t e = 0; e < E; ++e)
      if (plan_.count(e) > 0 && !resident_[il * E + e] && placement_.at(il, e) == group::Tier::kFile)
        file_candidates_.push_back(static_cast<int32_t>(e));
    if (file_candidates_.empty()) return;
    if (first) fill_file_cache(il, n);
    stager_.index_layer(static_cast<int32_t>(il));
    const model::MoeWeights& W = m_.layers[static_cast<size_t>(il)].moe;
    for (const int32_t e : file_candidates_) {
      if (backend_->stage_held(il, e)) {
        // Checked at an earlier window: no copy (the model's rows, read only if copied again).
        staged_.push_back({e, {W.gate.expert(e), W.up.expert(e), W.down.expert(e)}});
      } else if (const gpu_worker::FileStager::Hit h = stager_.find(e); h.slot >= 0) {
        staged_.push_back({e, group::ArenaLayout::bind(m_, il, e, al_->cache_slot(m_, il, h.worker, h.slot), arena_->data())});
        stager_.add_pending(h);
      } else {
        ++file_stage_uncached_;
        file_uncached_now_ = true;
        continue;
      }
      mark(e);
      ++experts_staged_file_;
    }
  }

  // The owners of file_candidates_ read them into their cache (kFillRequest); a read error fails the step.
  void fill_file_cache(int64_t il, int64_t n) {
    std::fill(worker_busy_.begin(), worker_busy_.end(), 0);
    for (const int32_t e : file_candidates_) {
      mark(e);
      worker_busy_[static_cast<size_t>(group::expert_owner(e, man_.n_cpu_workers))] = 1;
    }
    ring_workers(il, n, group::kFillRequest);
    wait_workers(il);
    std::fill(std::begin(marked_), std::end(marked_), 0);
    ++file_fill_requests_;
  }

  // After the workers answered: copies whose slot was refilled since the lookup may be torn; those
  // experts leave the device (layer_end takes host rows) and their owners compute them (kRedoRequest).
  void check_file_copies(int64_t il, int64_t n) {
    const std::vector<int32_t> torn = settle_file_copies(il);
    if (torn.empty()) return;
    std::fill(std::begin(marked_), std::end(marked_), 0);
    std::fill(worker_busy_.begin(), worker_busy_.end(), 0);
    for (const int32_t e : torn) {
      mark(e);
      worker_busy_[static_cast<size_t>(group::expert_owner(e, man_.n_cpu_workers))] = 1;
    }
    ring_workers(il, n, group::kRedoRequest);
    wait_workers(il);
  }
  // The pending copies once landed: the torn leave the device and the marks (owners compute them next).
  std::vector<int32_t> settle_file_copies(int64_t il) {
    if (!stager_.has_pending()) return {};
    backend_->await_staged_copies();
    std::vector<int32_t> torn = stager_.torn(tear_file_copies_);
    for (const int32_t e : torn) {
      backend_->unstage_expert(il, e);
      marked_[e / 64] &= ~(uint64_t{1} << (e % 64));
      ++file_stage_torn_;
    }
    return torn;
  }
  void mark(int64_t e) { marked_[e / 64] |= uint64_t{1} << (e % 64); }
  bool marked(int64_t e) const { return e < group::kMaxMarkedExperts && ((marked_[e / 64] >> (e % 64)) & 1) != 0; }
  // Whether the step's expert e of layer il is staged at from_rows: group::device_stages, the rule
  // the cpu workers skip by, for an expert not on the device now (those they skip anyway).
  bool staged_rule(int64_t il, int64_t e, int32_t from_rows) const {
    const int64_t E = m_.hp.n_expert;
    return !resident_[il * E + e] &&
           group::device_stages(static_cast<uint32_t>(from_rows), placement_.at(il, e), plan_.count(e));
  }
  bool staged_here(int64_t il, int64_t e) const { return staged_rule(il, e, stage_from_rows_); }

  // The expert of layer il the device computes itself this time (Backend::handoff_take_expert),
  // or -1: one RAM-tier expert of the cpu worker with the most experts to compute (plan_), when
  // that worker has at least take_from_ (BackendOptions::take_expert_from says why). FILE-tier
  // experts stay with the workers (their bytes are not in the arena yet).
  int32_t expert_to_take(int64_t il) {
    if (take_from_ <= 0) return -1;
    const int64_t E = m_.hp.n_expert;
    std::fill(worker_misses_.begin(), worker_misses_.end(), 0);
    std::fill(worker_ram_expert_.begin(), worker_ram_expert_.end(), -1);
    for (int64_t e = 0; e < E; ++e) {
      if (plan_.count(e) == 0 || resident_[il * E + e]) continue;
      const size_t w = static_cast<size_t>(group::expert_owner(e, man_.n_cpu_workers));
      ++worker_misses_[w];
      if (placement_.at(il, e) == group::Tier::kRam) worker_ram_expert_[w] = static_cast<int32_t>(e);
    }
    size_t best = 0;
    for (size_t w = 1; w < worker_misses_.size(); ++w)
      if (worker_misses_[w] > worker_misses_[best]) best = w;
    const int32_t e = worker_ram_expert_[best];
    if (worker_misses_[best] < take_from_ || e < 0) return -1;
    take_parts_ = group::ArenaLayout::bind(m_, il, e, al_->ram_slot(il, e), arena_->data());
    return backend_->handoff_can_take(il, e, take_parts_) ? e : -1;
  }

  void take_expert(int64_t il) {
    if (device_expert_ < 0) return;
    backend_->handoff_take_expert(il, device_expert_, take_parts_);
    ++experts_taken_;
  }

  // What the step's routing (every layer's, in step_chosen_ once logits returned) feeds, in one
  // pass: the census, the recent use counts of the adaptive VRAM tier, and the stats (slots per
  // layer, those on the device, distinct device experts used per layer).
  void record_routing(int64_t n) {
    const int64_t k = m_.hp.n_expert_used, E = m_.hp.n_expert;
    uint64_t hits = 0;
    for (int64_t il = 0; il < m_.hp.n_layer; ++il) {
      const int32_t* c = step_chosen_.data() + il * chosen_stride_;
      census_.add(il, c, n * k);
      uint64_t on_device = 0;
      for (int64_t i = 0; i < n * k; ++i) {
        const int32_t e = c[i];
        if (e < 0 || e >= E) continue;
        use_[il * E + e] += 1.0f;
        if (!resident_[il * E + e]) continue;
        ++on_device;
        if (!seen_[e]) {
          seen_[e] = 1;
          ++hits;
        }
      }
      for (int64_t i = 0; i < n * k; ++i)
        if (c[i] >= 0 && c[i] < E) seen_[c[i]] = 0;
      layer_slots_[il] += static_cast<uint64_t>(n * k);
      layer_vram_slots_[il] += on_device;
    }
    experts_vram_ += hits;
  }

  void ring_workers(int64_t il, int64_t n, group::ExpertRequestMode mode = group::kComputeRequest) {
    auto* req = xl_.region("expert_req").at<group::ExpertRequest>(exchange_.data());
    req->seq = ++expert_seq_;
    req->layer = static_cast<uint32_t>(il);
    req->n_tokens = static_cast<uint32_t>(n);
    req->device_expert = device_expert_;
    req->device_stages_from_rows = static_cast<uint32_t>(stage_from_rows_);
    req->mode = mode;
    std::copy(std::begin(marked_), std::end(marked_), req->marked);
    for (int w = 0; w < man_.n_cpu_workers; ++w)
      if (worker_busy_[w]) bell(group::ExchangeLayout::request_bell(w))->ring(expert_seq_);
  }

  void wait_workers(int64_t il) {
    for (int w = 0; w < man_.n_cpu_workers; ++w) {
      if (worker_busy_[w] &&
          bell(group::ExchangeLayout::done_bell(w))->wait_for(expert_seq_, kExpertDeadline, kExpertSpin) != shm::WaitResult::kReady) {
        throw std::runtime_error("layer " + std::to_string(il) + ": " + group::cpu_worker_instance(w) +
                                 " did not answer within " + std::to_string(kExpertDeadline.count()) + " s");
      }
    }
    // A worker that could not compute its experts said why (group::WorkerError) before it rang.
    const auto* errors = xl_.region("worker_errors").at<group::WorkerError>(exchange_.data());
    for (int w = 0; w < man_.n_cpu_workers; ++w) {
      const group::WorkerError& e = errors[w];
      if (worker_busy_[w] && std::atomic_ref<uint64_t>(const_cast<uint64_t&>(e.seq)).load(std::memory_order_acquire) == expert_seq_) {
        throw std::runtime_error(std::string(e.text, std::min<size_t>(e.bytes, group::kStepErrorBytes)));
      }
    }
  }

  // The reference path: one ExpertJobList per worker, its experts' rows packed as in the plan.
  // Workers are called one after the other (a REQ socket waits for its reply); the doorbell path
  // is the one that overlaps them.
  void handoff_zmq(uint64_t step_seq, int64_t il, int64_t n) {
    const int64_t d = m_.hp.n_embd, k = m_.hp.n_expert_used;
    const uint32_t row_bytes = static_cast<uint32_t>(d * sizeof(float));
    const shm::Region& hidden = xl_.region("hidden");
    const shm::Region& out = xl_.region("expert_out");
    for (int w = 0; w < man_.n_cpu_workers; ++w) {
      envelope_.Clear();
      jobs::ExpertJobList& list = *envelope_.mutable_expert_jobs();
      envelope_.set_version(messaging::kJobProtocolVersion);
      envelope_.set_seq(++expert_seq_);
      list.set_step_seq(step_seq);
      list.set_layer(static_cast<uint32_t>(il));
      list.set_n_tokens(static_cast<uint32_t>(n));
      list.set_row_bytes(row_bytes);
      auto set_ref = [](jobs::ShmRef* r, uint64_t off, uint64_t len) {
        r->set_segment_id(group::kExchangeSegmentId);
        r->set_offset(off);
        r->set_length(len);
      };
      set_ref(list.mutable_activations(), hidden.offset, uint64_t(n) * row_bytes);
      set_ref(list.mutable_routing(), xl_.region("chosen").offset, uint64_t(n * k) * sizeof(int32_t));
      set_ref(list.mutable_outputs(), out.offset, uint64_t(n * k) * row_bytes);
      list.set_done_seq(expert_seq_);
      for (int64_t e = 0; e < m_.hp.n_expert; ++e) {
        if (group::expert_owner(e, man_.n_cpu_workers) != w || plan_.count(e) == 0 || resident_[il * m_.hp.n_expert + e]) {
          continue;
        }
        jobs::ExpertJob* job = list.add_jobs();
        job->set_expert_id(static_cast<uint32_t>(e));
        job->set_output_offset(uint64_t(plan_.start[e]) * row_bytes);
        for (int32_t j = 0; j < plan_.count(e); ++j) job->add_token_rows(static_cast<uint32_t>(plan_.slot_of[plan_.start[e] + j] / k));
      }
      if (list.jobs_size() == 0) continue;
      call_with_retry(w, il);
    }
  }

  // A worker that died is restarted by the supervisor and binds the same endpoint: re-send the
  // same job list on a fresh socket until the deadline (the jobs only write their own rows).
  void call_with_retry(int w, int64_t il) {
    const auto until = Clock::now() + kExpertDeadline;
    std::string error;
    while (Clock::now() < until) {
      error = clients_[w]->call(envelope_, reply_, kZmqAttempt);
      if (error.empty() && reply_.status() == jobs::JOB_OK) return;
      if (error.empty()) {
        throw std::runtime_error("layer " + std::to_string(il) + ": " + group::cpu_worker_instance(w) + " refused its jobs: " +
                                 reply_.error());
      }
      clients_[w] = std::make_unique<messaging::JobClient>(ctx_, endpoints_[w]);
    }
    throw std::runtime_error("layer " + std::to_string(il) + ": " + error);
  }

  group::GroupManifest man_;
  const model::Model& m_;
  std::unique_ptr<gpu_worker::Backend> backend_;
  shm::ShmSegment exchange_;
  group::ExchangeLayout xl_;
  group::PlacementPlan placement_;
  std::vector<std::vector<int32_t>> vram_experts_;   // [layer] ascending
  std::atomic<uint64_t> experts_vram_{0};
  group::CensusRecorder census_;   // routing counts, merged into the census file beside the model
  group::StageRecorder& step_stage_;
  group::StageRecorder& handoff_stage_;
  // In a hand-off step: how long this thread waited for the device to route the next layer that
  // has cpu-worker experts (the device's mixer and own experts since the last release).
  group::StageRecorder& routed_wait_stage_;
  std::vector<int32_t> step_chosen_;   // [layer][chosen_stride_]: the step's routing
  int64_t chosen_stride_ = 0;          // rows of the longest step (max_tokens or long_step_rows) * k
  std::vector<uint8_t> worker_busy_, seen_;
  group::ExpertPlan plan_;
  uint64_t expert_seq_ = 0;
  bool broken_ = false;
  gpu_worker::SequenceStore store_;   // the conversation cache's saved sequences
  bool all_on_device_ = false;
  uint8_t* resident_ = nullptr;   // exchange "resident": [layer][expert] computed on the device now
  std::vector<float> use_;        // [layer][expert]: recent routing counts (halved every round)
  int steps_since_adapt_ = 0;
  std::atomic<uint64_t> experts_swapped_in_{0};
  // The experts the device takes over from the cpu workers (expert_to_take): the arena, pinned.
  std::optional<shm::ShmSegment> arena_;
  std::optional<group::ArenaLayout> al_;
  int take_from_ = 0;   // BackendOptions::take_expert_from, 0 without the arena
  bool stage_ = false;  // BackendOptions::stage_experts > 0 with the arena mapped
  int64_t stage_min_rows_ = 0;   // BackendOptions::stage_min_rows
  int32_t stage_from_rows_ = 0;   // this layer's RAM-tier experts with this many rows are the device's (stage_ram_experts; 0: none)
  std::vector<gpu_worker::StagedExpert> staged_, prefetch_;   // prefetch_: prefetch_ram_tier's list
  std::vector<int32_t> stage_rows_;   // stage_ram_experts' row counts (reserved: no allocation per layer)
  double stage_share_ = 1.0;          // BackendOptions::stage_share
  int32_t device_expert_ = -1;   // this layer's taken expert (ExpertRequest::device_expert)
  std::array<model::Matrix, 3> take_parts_{};   // its rows in the arena
  std::vector<int> worker_misses_;
  std::vector<int32_t> worker_ram_expert_;
  std::atomic<uint64_t> experts_taken_{0};
  std::atomic<uint64_t> experts_staged_{0};
  gpu_worker::FileStager stager_;          // empty: long steps stage no FILE-tier expert
  std::vector<int32_t> file_candidates_;   // stage_file_experts' experts of the layer
  uint64_t marked_[8] = {};                // ExpertRequest::marked of the next ring
  int64_t tear_file_copies_ = 0;           // --fault-tear-file-copies
  bool file_uncached_now_ = false;         // this window leaves FILE experts to the workers' own reads
  std::atomic<uint64_t> experts_staged_file_{0}, file_stage_uncached_{0}, file_stage_torn_{0}, file_fill_requests_{0};
  std::atomic<uint64_t> handoff_steps_{0};   // steps with cpu workers launched whole (handoff_begin)
  std::atomic<uint64_t> device_used_peak_{0};   // device memory in use after a step, the most seen
  Clock::time_point device_used_sampled_{};     // when it was last read
  std::vector<std::atomic<uint64_t>> layer_slots_, layer_vram_slots_;
  zmq::context_t ctx_{1};
  std::vector<std::string> endpoints_;
  std::vector<std::unique_ptr<messaging::JobClient>> clients_;
  jobs::JobEnvelope envelope_;
  jobs::JobReply reply_;
};

int run(const std::string& socket_dir, const std::string& backend_kind, const gpu_worker::BackendOptions& base,
        std::chrono::nanoseconds step_spin) {
  group::install_stop_signals();
  const std::string instance = group::kGpuWorkerInstance;
  group::ControlServer control(control::ROLE_GPU_WORKER, instance, group::control_address(socket_dir, instance));
  group::StageRecorder& step_stage = control.add_stage("layer_chain");
  group::StageRecorder& handoff_stage = control.add_stage("expert_handoff");
  group::StageRecorder& routed_wait_stage = control.add_stage("routed_wait");
  control.set_state(control::LOADING);
  control.start();

  const group::GroupManifest man = group::GroupManifest::read(group::manifest_path(socket_dir));
  const model::Model model = model::Model::load(man.model_path);
  StepRunner runner(socket_dir, man, backend_kind, base, model, step_stage, handoff_stage, routed_wait_stage);
  control.set_stats_hook([&](control::StatsReply& r) {
    r.set_shm_mapped_bytes(runner.shm_mapped());
    (*r.mutable_counters())["experts_vram"] = runner.experts_vram();
    (*r.mutable_counters())["experts_swapped_in"] = runner.experts_swapped_in();
    // Experts the device computed from the RAM tier instead of a cpu worker (--device-takes-from).
    (*r.mutable_counters())["experts_device_taken"] = runner.experts_taken();
    (*r.mutable_counters())["experts_device_staged"] = runner.experts_staged();
    runner.file_stage_counters(r);
    (*r.mutable_counters())["handoff_steps"] = runner.handoff_steps();
    (*r.mutable_counters())["conversation_cache_bytes"] = runner.sequence_store().bytes();
    (*r.mutable_counters())["conversation_cache_sequences"] = runner.sequence_store().size();
    // What the --vram budget is checked against (moraine-bench prints it beside the budget).
    (*r.mutable_counters())["device_used_bytes"] = runner.device_used_peak();
    runner.layer_counters(r);
  });
  zmq::context_t ctx(1);
  messaging::JobServer server(ctx, group::jobs_endpoint(socket_dir, instance), runner.limits());
  group::StepReply& step_reply = *runner.exchange_layout().region("step_reply").at<group::StepReply>(runner.exchange());
  const auto handler = [&](const jobs::JobEnvelope& job, jobs::JobReply& reply) {
    if (job.has_layer_step()) {
      const jobs::LayerStep& s = job.layer_step();
      const int32_t token = runner.run(s.step_seq(), s.n_tokens(), s.first_position());
      group::write_step_reply(step_reply, s.step_seq(), true, token, "");   // the greedy token travels there
      reply.set_done_seq(s.step_seq());
    } else if (!job.has_ping()) {
      throw std::runtime_error("a gpu_worker takes layer_step and ping only");
    }
    reply.set_status(jobs::JOB_OK);
  };
  // The step doorbells (coordinator/step_bell.h): registered once the backend is loaded, so the
  // coordinator rings only a gpu_worker that can serve.
  std::unique_ptr<group::StepBellServer> bells;
  if (man.step_channel == "doorbell") {
    bells = std::make_unique<group::StepBellServer>(runner.exchange(), runner.exchange_layout());
    bells->start();
  }
  const group::StepHeader& header = *runner.exchange_layout().region("step").at<const group::StepHeader>(runner.exchange());
  control.set_state(control::SERVING);
  auto zmq_polled = Clock::now();
  while (!control.shutdown_requested() && !group::signal_received()) {
    messaging::ServeResult r;
    if (bells) {
      // Steps from the bells; ZeroMQ (pings, stray jobs) and the coordinator's liveness when a
      // wait found none, or at least every kLivenessSlice during a run of steps.
      if (const uint64_t seq = bells->next(group::kLivenessSlice, step_spin)) {
        try {
          const int32_t token = runner.run(seq, header.n_tokens, header.first_position);
          bells->answer(seq, true, token, "");
        } catch (const std::exception& e) {
          std::cerr << instance << ": step " << seq << " failed: " << e.what() << "\n";
          bells->answer(seq, false, -1, e.what());
        }
        if (Clock::now() - zmq_polled < group::kLivenessSlice) continue;
      }
      zmq_polled = Clock::now();
      r = group::serve_one_job(server, handler, std::chrono::milliseconds(0));
    } else {
      r = group::serve_one_job(server, handler, std::chrono::milliseconds(100));
    }
    if (r == messaging::ServeResult::kRejected) {
      std::cerr << instance << ": rejected a job: " << server.last_error() << "\n";
    } else if (r == messaging::ServeResult::kIdle && !shm::process_alive(man.coordinator_pid, man.coordinator_start_ticks)) {
      std::cerr << instance << ": coordinator " << man.coordinator_pid << " is gone; exiting\n";
      break;
    }
  }
  if (bells) bells->withdraw();
  runner.flush_census();
  control.stop();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moraine-gpu-worker: dense layers, KV cache, routers; routed experts handed to cpu workers"};
  std::string socket_dir, backend = "cpu";
  moraine::gpu_worker::BackendOptions base;
  // Every flag: what, its default, why (the measurements behind the defaults: backend.h,
  // docs/perf-log.md).
  app.add_option("--socket-dir", socket_dir, "group socket directory (holds group.json)")->required();
  app.add_option("--backend", backend, "cpu or cuda (default cpu: the reference kernels, for machines without a GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--device", base.device, "cuda: GPU index")->capture_default_str();
  app.add_option("--threads", base.threads, "cpu backend: threads (default 0: all cores)");
  app.add_option("--prefill-stage-experts", base.stage_experts,
                 "cuda: long steps (prefill) compute the RAM tier's experts on the device, copied in over PCIe this many at a "
                 "time (0: the cpu workers compute them; 8: ~3.5x the 12G prefill at the 30B shape, backend.h)")
      ->check(CLI::Range(0, 256))
      ->capture_default_str();
  app.add_option("--prefill-stage-min-rows", base.stage_min_rows,
                 "cuda: ... from steps of this many rows (below ~100 rows the cpu workers are quicker)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--prefill-stage-share", base.stage_share,
                 "cuda: ... this share of a layer's RAM-tier experts, those with the most rows (the cpu workers compute the "
                 "rest at the same time; 1: all, since the device was the faster side at the 30B shape)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--segment-streams", base.segment_streams,
                 "cuda, batched steps (coordinator --batch-decode): the segments' attention on up to this many streams "
                 "at once (0: in order)")
      ->check(CLI::Range(0, 16))
      ->capture_default_str();
  app.add_flag("--prefill-stage-file,!--no-prefill-stage-file", base.stage_file,
               "cuda, long steps: also compute on the device the FILE tier's experts that the file cache holds, copied from "
               "their cache slots (a layer's are read into the cache first; a slot refilled during its copy goes back to "
               "its cpu worker); off: the cpu workers compute every FILE-tier expert")
      ->capture_default_str();
  app.add_option("--fault-tear-file-copies", base.fault_tear_file_copies,
                 "fault injection (tests): at every check of a window's FILE-tier copies, report this many as torn "
                 "(their slots refilled under the copy), so the device drops them and their cpu workers recompute them")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_flag("--cpu-backend-stages", base.cpu_stage,
               "cpu backend: stage long steps' experts as the cuda backend does, computed from copies taken when staged "
               "(the staging protocol without a GPU; tests)")
      ->capture_default_str();
  app.add_flag("--prefill-stage-prefetch,!--no-prefill-stage-prefetch", base.stage_prefetch,
               "cuda, long steps: copy layer L+1's RAM-tier experts in on their own stream while layer L computes "
               "(a stage buffer twice the size); off: each layer's copies before its GEMMs")
      ->capture_default_str();
  app.add_option("--prefill-gemm-rows", base.gemm_prefill_rows,
                 "cuda: steps of at least this many rows multiply through cuBLAS (BF16 inputs) instead of the per-row "
                 "matvec, and only such steps stage experts (0: never)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  app.add_option("--device-takes-from", base.take_expert_from,
                 "at a hand-off layer where a cpu worker has at least this many experts to compute, the device copies "
                 "one of them from the RAM tier over PCIe and computes it itself (0: never, the default: slower on the "
                 "H200 host, whose DRAM the cores already saturate; see BackendOptions::take_expert_from)")
      ->check(CLI::NonNegativeNumber);
  // No spin by default: the control plane shares its reserved core (supervisor --reserve-cores),
  // so a gpu_worker spinning for the next step takes the CPU the coordinator needs to sample it
  // (dev box, CPU backend: 33-47 us of step overhead without a spin, 39-53 spinning 200 us).
  int step_spin_us = 0;
  app.add_option("--step-spin-us", step_spin_us,
                 "how long the step doorbell wait spins before it sleeps, in microseconds (0: no spin, so the coordinator "
                 "keeps the core it shares with the control plane)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  std::string kernel_trace;
  uint64_t kernel_trace_rows = 2'000'000;
  app.add_option("--kernel-trace", kernel_trace,
                 "cuda: write every kernel, memcpy and memset with its device start and end (ns) to this CSV "
                 "(default: none; CUPTI, loaded only then; bench/kernel-trace-summary reads it)");
  app.add_option("--kernel-trace-rows", kernel_trace_rows,
                 "most rows --kernel-trace writes (bounds the trace's memory and file)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
#ifdef MORAINE_HAVE_CUDA
    std::unique_ptr<moraine::gpu_worker::KernelTrace> trace;
    if (!kernel_trace.empty()) trace = std::make_unique<moraine::gpu_worker::KernelTrace>(kernel_trace, kernel_trace_rows);
#else
    if (!kernel_trace.empty()) throw std::runtime_error("--kernel-trace: this build has no CUDA");
#endif
    return run(socket_dir, backend, base, std::chrono::microseconds(step_spin_us));
  } catch (const std::exception& e) {
    std::cerr << "moraine-gpu-worker: " << e.what() << "\n";
    return 1;
  }
}
