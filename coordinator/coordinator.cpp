// moraine-coordinator: owns the model description, tokenizer, sampling and the session; creates
// the group's shared memory (exchange segment, expert arena filled from the GGUF), writes the
// group manifest other processes start from, and drives steps: each prompt chunk or decode token
// is one step handed to the gpu_worker through the exchange segment's step doorbells
// (coordinator/step_bell.h; --step-channel zmq: a LayerStep over ZeroMQ), whose logits come back
// in shared memory, or for greedy decode only the token (StepHeader::greedy_token).
// A step that fails (a worker died and was not back in time) is re-issued by replaying the
// sequence from a reset: the forward is deterministic, so the tokens are the same.
#include <CLI/CLI.hpp>
#include <unordered_map>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>
#include <mutex>
#include <optional>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "common/chat/chat_template.h"
#include "common/messaging/job_channel.h"
#include "common/model/model.h"
#include "common/sampling/sampler.h"
#include "common/shm/doorbell.h"
#include "common/shm/shm_segment.h"
#include "common/tokenizer/streaming_decoder.h"
#include "common/tokenizer/tokenizer.h"
#include "common/tokenizer/utf8.h"
#include "coordinator/chunk_streamer.h"
#include "coordinator/control_server.h"
#include "coordinator/device_reserve.h"
#include "coordinator/group_layout.h"
#include "coordinator/placement.h"
#include "coordinator/process_util.h"
#include "coordinator/speculation.h"
#include "coordinator/conversation_cache.h"
#include "coordinator/coordinator_options.h"
#include "coordinator/disk_estimate.h"
#include "coordinator/sequence.h"
#include "coordinator/turn_queue.h"
#include "coordinator/batch_stepper.h"
#include "coordinator/batched_request.h"
#include "coordinator/step_bell.h"
#include "proto/generate.grpc.pb.h"

namespace {

using namespace moraine;
using Clock = std::chrono::steady_clock;

double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

using group::end_with_error;
using group::push_last_chunk;
using group::stream_status;

using Options = group::CoordinatorOptions;
using group::kv_type_for;
using group::long_step_rows_for;
using group::plan_for;
using group::window_rows_for;

class Coordinator final : public generate::Coordinator::Service {
 public:
  Coordinator(const Options& o, group::ControlServer& control)
      : o_(o), control_(control), model_(model::Model::load(o.model)), prefix_(group::group_prefix_for(o.socket_dir)),
        reclaimed_(shm::reclaim_dead_segments(prefix_)),
        long_rows_(long_step_rows_for(o, model_)),
        xl_(group::ExchangeLayout::build(model_.hp, o.max_tokens, o.cpu_workers, long_rows_)),
        plan_(plan_for(o, model_)), al_(group::ArenaLayout::build(model_, plan_)),
        exchange_(shm::ShmSegment::create({prefix_, "exchange", xl_.layout.total_bytes(), false, false})),
        // Never empty: a group with every expert in VRAM still maps an arena.
        arena_(shm::ShmSegment::create({prefix_, "arena", std::max<size_t>(al_.total_bytes, group::kArenaAlign), true, true})),
        prefill_(control.add_stage("prefill")), decode_(control.add_stage("decode")),
        sample_(control.add_stage("sample")), stream_write_(control.add_stage("stream_write")),
        gpu_(ctx_, group::jobs_endpoint(o.socket_dir, group::kGpuWorkerInstance)), bells_(exchange_.data(), xl_),
        conversations_(group::parse_byte_budget(o.cache_ram, "--cache-ram"),
                       std::any_of(model_.layers.begin(), model_.layers.end(), [](const auto& L) { return L.recurrent; })),
        turns_(o.parallel) {
    for (const std::string& r : reclaimed_.removed) std::cerr << "coordinator: reclaimed " << r << "\n";
    recurrent_ = std::any_of(model_.layers.begin(), model_.layers.end(), [](const auto& L) { return L.recurrent; });
    // The CUDA backend has no MTP head yet (Backend::can_mtp); a gpu_worker without one answers
    // no drafts (StepReply::mtp_n_drafts -1) and speculation falls back to the suffix drafter.
    mtp_ = o.speculate_mtp > 0 && !model_.nextn.empty() && o.backend == "cpu";
    if (o.speculate_mtp > 0 && !model_.nextn.empty() && !mtp_)
      std::cerr << "coordinator: --backend " << o.backend << " runs no MTP head yet; speculation drafts from the context "
                << "(the suffix drafter) instead\n";
    context_positions_ = group::planned_context(model_, o.ctx);
    try {
      tok_ = std::make_unique<tokenizer::Tokenizer>(tokenizer::Tokenizer::from_gguf(model_.file));
    } catch (const std::exception& e) {
      std::cerr << "coordinator: no tokenizer (" << e.what() << "); prompts must be token ids\n";
    }
    // The GGUF's chat template, parsed once; without one (or one that does not parse) the built-in ChatML.
    if (tok_) {
      std::string warning;
      chat_template_ = chat::ChatTemplate::from_gguf(model_.file, *tok_, &warning);
      if (!warning.empty()) std::cerr << "coordinator: warning: " << warning << "; using the built-in ChatML\n";
      else if (!chat_template_) std::cerr << "coordinator: the GGUF has no chat template; using the built-in ChatML\n";
    }
    // The RAM-tier experts, copied once into their compact slots.
    for (int64_t il = 0; il < plan_.n_layer; ++il) {
      const model::MoeWeights& W = model_.layers[static_cast<size_t>(il)].moe;
      const model::ExpertTensor* t[3] = {&W.gate, &W.up, &W.down};
      for (int32_t e : plan_.experts_in(il, group::Tier::kRam)) {
        const group::ArenaLayout::ExpertSlot& slot = al_.ram_slot(il, e);
        for (int w = 0; w < 3; ++w) std::memcpy(arena_.data() + slot.offset[w], t[w]->expert(e).data, slot.bytes[w]);
      }
    }
    std::cerr << "coordinator: arena " << al_.total_bytes << " bytes (" << al_.ram_slots.size() << " RAM-tier experts, "
              << plan_.cache_region_bytes() << " bytes of file cache: " << plan_.n_cpu_workers << " x " << plan_.cache_slots
              << " slots), " << arena_.page_report().describe() << "\n";
    const shm::Region& bells = xl_.region("bells");
    for (size_t i = 0; i < bells.bytes / sizeof(shm::Doorbell); ++i) shm::Doorbell::init_at(exchange_.data() + bells.offset + i * sizeof(shm::Doorbell));
    bells_.init();
    control.set_in_flight_hook([this] { return in_flight_.load(); });
    control.set_stats_hook([this](control::StatsReply& r) {
      r.set_shm_owned_bytes(exchange_.data_bytes() + arena_.data_bytes());
      r.set_shm_mapped_bytes(exchange_.data_bytes() + arena_.data_bytes());
      r.set_shm_huge_page_bytes(arena_.page_report().huge_bytes);
      (*r.mutable_counters())["steps_reissued"] = reissued_.load();
      // Tokens the gpu_worker picked (greedy decode without the logits crossing).
      (*r.mutable_counters())["greedy_worker_tokens"] = greedy_worker_tokens_.load();
      // Speculation (GenerateRequest::speculate): windows verified, tokens drafted and accepted.
      (*r.mutable_counters())["verify_steps"] = verify_steps_.load();
      (*r.mutable_counters())["drafted_tokens"] = drafted_tokens_.load();
      (*r.mutable_counters())["accepted_draft_tokens"] = accepted_draft_tokens_.load();
      // --speculate-mtp: drafts taken from the MTP head, and steps whose reply had none (the head
      // could not follow the sequence, or the backend has none: then suffix drafts).
      (*r.mutable_counters())["mtp_drafts_used"] = mtp_drafts_used_.load();
      (*r.mutable_counters())["mtp_no_drafts"] = mtp_no_drafts_.load();
      // The prefix cache (reuse_prefix): requests that reused cached positions, and how many.
      (*r.mutable_counters())["prefix_cache_hits"] = prefix_cache_hits_.load();
      (*r.mutable_counters())["prefix_cached_tokens"] = prefix_cached_tokens_.load();
      (*r.mutable_counters())["cancelled_requests"] = cancelled_.load();
      // The conversation cache (--cache-ram): requests that continued a saved conversation, the
      // saves, evictions, and what is held (the coordinator's bookkeeping, read under its lock).
      (*r.mutable_counters())["conversation_cache_hits"] = conversation_hits_.load();
      (*r.mutable_counters())["conversation_cache_saves"] = conversation_saves_.load();
      (*r.mutable_counters())["conversation_cache_evictions"] = conversation_evictions_.load();
      (*r.mutable_counters())["conversation_cache_entries"] = conversation_entries_.load();
      (*r.mutable_counters())["conversation_cache_bytes"] = conversation_bytes_.load();
      // --parallel: requests taking turns, those waiting to be admitted, and the turn switches.
      (*r.mutable_counters())["requests_running"] = static_cast<uint64_t>(turns_.admitted());
      (*r.mutable_counters())["requests_waiting"] = static_cast<uint64_t>(turns_.waiting());
      (*r.mutable_counters())["turn_switches"] = turn_switches_.load();
      (*r.mutable_counters())["lost_saves"] = lost_saves_.load();
      // --batch-decode: the batched decode steps and the rows they carried.
      (*r.mutable_counters())["batched_steps"] = stepper_ ? stepper_->steps() : 0;
      (*r.mutable_counters())["batched_rows"] = stepper_ ? stepper_->rows() : 0;
      (*r.mutable_counters())["batched_prompt_rows"] = stepper_ ? stepper_->chunk_rows() : 0;
      (*r.mutable_counters())["batched_mixed_steps"] = stepper_ ? stepper_->mixed_steps() : 0;
      (*r.mutable_counters())["batched_waiting"] = stepper_ ? static_cast<uint64_t>(stepper_->waiting()) : 0;
      (*r.mutable_counters())["context_tokens"] = static_cast<uint64_t>(context_positions_);
      // The placement, for `moraine stats` to print as a table.
      auto& c = *r.mutable_counters();
      for (auto [name, t] : {std::pair{"vram", &plan_.vram}, std::pair{"ram", &plan_.ram}, std::pair{"file", &plan_.file}}) {
        c[std::string("placement_") + name + "_experts"] = static_cast<uint64_t>(t->experts);
        c[std::string("placement_") + name + "_bytes"] = t->bytes;
      }
      c["placement_dense_bytes"] = plan_.dense_bytes;
      c["placement_kv_bytes"] = plan_.kv_bytes;
      c["placement_file_cache_bytes"] = plan_.cache_region_bytes();
      c["placement_file_cache_slots"] = static_cast<uint64_t>(plan_.n_cpu_workers * plan_.cache_slots);
    });
    group::GroupManifest man;
    man.model_path = o.model;
    man.group_prefix = prefix_;
    man.exchange_locator = exchange_.locator();
    man.arena_locator = arena_.locator();
    man.coordinator_pid = static_cast<uint32_t>(::getpid());
    man.coordinator_start_ticks = shm::process_start_ticks(man.coordinator_pid);
    man.n_cpu_workers = o.cpu_workers;
    man.max_tokens = o.max_tokens;
    man.long_step_rows = long_rows_;
    man.zmq_handoff = o.handoff == "zmq";
    man.placement_path = group::placement_path(o.socket_dir);
    man.census_path = o.no_census ? "" : o.census.empty() ? group::default_census_path(o.model) : o.census;
    man.placement_census_path = o.census.empty() ? group::default_census_path(o.model) : o.census;
    man.vram_adapt_every = o.vram_adapt_every;
    man.step_channel = o.step_channel;
    if (o.batch_decode) {
      if (o.step_channel != "doorbell" || o.parallel > static_cast<int>(group::kMaxSegments))
        throw std::invalid_argument("--batch-decode: the doorbell step channel and --parallel 1.." +
                                    std::to_string(group::kMaxSegments) + " (got --step-channel " + o.step_channel +
                                    ", --parallel " + std::to_string(o.parallel) + ")");
      man.slots = o.parallel;
      if (o.prefill_chunk < 0 || o.parallel + o.prefill_chunk > o.max_tokens)
        throw std::invalid_argument("--prefill-chunk " + std::to_string(o.prefill_chunk) + ": with --parallel " +
                                    std::to_string(o.parallel) + " decode rows a batched step must fit --max-tokens " +
                                    std::to_string(o.max_tokens) + " rows");
      stepper_ = std::make_unique<group::BatchStepper>(
          o.parallel, [this](std::span<group::BatchStepper::Row* const> rows) { run_batched(rows); }, o.prefill_chunk);
      stepper_->set_queue_limit(o.batch_queue);
    }
    plan_.write(man.placement_path);
    man.write(group::manifest_path(o.socket_dir));
    if (!o.logits_dump.empty()) logits_dump_.open(o.logits_dump, std::ios::binary | std::ios::trunc);
  }

  grpc::Status Generate(grpc::ServerContext* ctx, const generate::GenerateRequest* req,
                        grpc::ServerWriter<generate::GenerateChunk>* writer) override {
    // Counted before the lock, so that a Drain waits for queued requests too.
    struct InFlight {
      std::atomic<uint64_t>& n;
      explicit InFlight(std::atomic<uint64_t>& c) : n(c) { ++n; }
      ~InFlight() { --n; }
    } in_flight(in_flight_);
    if (!control_.accepting()) return {grpc::StatusCode::UNAVAILABLE, "the coordinator is draining: no new requests"};
    std::optional<group::Sequence> seq;
    try {
      seq.emplace(req->sampling(), tok_.get(), prompt_of(*req), context_positions_);
    } catch (const std::out_of_range& e) {
      return {grpc::StatusCode::OUT_OF_RANGE, e.what()};
    } catch (const std::exception& e) {
      return {grpc::StatusCode::INVALID_ARGUMENT, e.what()};
    }
    if (stepper_) return generate_batched(ctx, writer, *seq);
    // At most --parallel requests take turns on the gpu_worker (it holds one live sequence; the
    // others wait saved in its store); the rest wait here, and one that gives up leaves the queue.
    Running me;
    me.id = ++next_request_id_;
    me.context = &seq->context;
    if (!turns_.acquire(me.id, [&] { return ctx->IsCancelled(); })) {
      turns_.leave(me.id);
      return {grpc::StatusCode::CANCELLED, "the client went away while queued"};
    }
    running_[me.id] = &me;
    const generate::SamplingParams& sp = req->sampling();
    // Greedy decode without the logits: the gpu_worker returns the argmax, by the sampler's own
    // rule, so the tokens are the same. Not when the client checks the logits, needs them
    // (log-probabilities, penalties) or they are dumped. With check_logits the gpu_worker also
    // reports the first non-finite logit (StepHeader::check_finite).
    me.token_only = !seq->needs_logits() && !logits_dump_.is_open() && !o_.greedy_on_host;
    me.check_on_worker = me.token_only && sp.check_logits();
    token_only_ = me.token_only;
    group::ChunkStreamer stream(writer);   // the client reads at its own pace (chunk_streamer.h)
    generate::GenerateTiming timing;
    timing.set_prompt_tokens(static_cast<uint32_t>(seq->prompt_tokens()));
    timing.set_context_tokens(static_cast<uint32_t>(context_positions_));
    // Speculation (GenerateRequest::speculate): drafts verified by the gpu_worker's greedy tokens,
    // or with the logits on the host by speculative sampling (Sequence::speculate), the
    // distribution sampling gives. The MTP head drafts after a row's greedy token, which only a
    // greedy request is known to continue from: a sampled one drafts from the context.
    const bool speculate = req->speculate() && !logits_dump_.is_open() && (o_.speculate_draft > 0 || (mtp_ && token_only_));
    me.mtp = speculate && mtp_ && token_only_;
    mtp_request_ = me.mtp;
    mtp_drafts_.clear();
    mtp_follows_ = false;   // until the prefill's reply says
    mtp_ask_ = true;   // the prefill's drafts: the policy verifies its first windows
    DraftPolicies policy;   // this request's, one per drafter
    group::SuffixDrafter drafter;   // over this request's context, fed as it grows
    std::vector<int32_t>& context = seq->context;
    // unused: the tokens a verify window settled after the one that ended the sequence (an EOS or
    // a stop string among accepted drafts); their positions are cached too.
    const auto finished = [&](generate::GenerateChunk last, std::span<const int32_t> unused = {}) {
      push_last_chunk(stream, std::move(last), *seq, timing);
      // What the gpu_worker holds now: position_ can pass the context's end by the unused tokens.
      std::vector<int32_t> held(context);
      held.insert(held.end(), unused.begin(), unused.end());
      if (position_ > static_cast<int64_t>(held.size())) {   // not reached: the next step rewinds if so
        position_ = static_cast<int64_t>(held.size());
        rewind_pending_ = true;
      }
      cache_.assign(held.begin(), held.begin() + position_);
      leave_turns(me);   // the live sequence is an idle conversation now
      return stream_status(stream);
    };
    try {
      auto t0 = Clock::now();
      enter_turn(me);
      const int64_t cached = req->no_prompt_cache() ? 0 : reuse_prefix(context);
      timing.set_cached_tokens(static_cast<uint32_t>(cached));
      StepOutput out = feed(context.data() + cached, static_cast<int64_t>(context.size()) - cached, cached == 0, context);
      timing.set_prefill_us(static_cast<uint64_t>(us_since(t0)));
      prefill_.record(context.size() - static_cast<size_t>(cached), 0, 0, us_since(t0));
      const auto t1 = Clock::now();
      // The next token from a one-row step's output: the finite check, then the sampler (or the
      // gpu_worker's greedy token).
      const auto sample_one = [&](const StepOutput& o) {
        if (sp.check_logits()) {
          if (check_on_worker_) {
            report_nonfinite(o.nonfinite, context.size());
          } else {
            check_finite(o.logits, context.size());
          }
        }
        if (o.token < 0) return seq->sample(o.logits);
        ++greedy_worker_tokens_;
        return o.token;
      };
      std::vector<int32_t> decided{sample_one(out)};   // tokens the last step settled, in order
      int turn_steps = 0;   // decode steps since this turn began
      for (;;) {
        for (size_t i = 0; i < decided.size(); ++i) {
          const auto tsample = Clock::now();
          generate::GenerateChunk chunk;
          if (seq->accept(decided[i], chunk)) {
            timing.set_decode_us(static_cast<uint64_t>(us_since(t1)));
            return finished(std::move(chunk), std::span<const int32_t>(decided).subspan(i + 1));
          }
          const auto twrite = Clock::now();
          sample_.record(1, 0, 0, std::chrono::duration<double, std::micro>(twrite - tsample).count());
          stream.push(std::move(chunk));
          stream_write_.record(1, 0, 0, us_since(twrite));
        }
        if (ctx->IsCancelled() || stream.broken()) {
          ++cancelled_;
          timing.set_decode_us(static_cast<uint64_t>(us_since(t1)));
          return finished({});
        }
        // Another admitted request waits: after turn_tokens of this one's, it gets the gpu_worker.
        if (++turn_steps >= o_.turn_tokens && turns_.others_waiting()) {
          turns_.release(me.id);
          turns_.acquire(me.id, nullptr);   // never given up: the others may switch this sequence out
          enter_turn(me);
          turn_steps = 0;
        }
        decided = next_tokens(*seq, speculate, policy, drafter, timing, sample_one);
      }
    } catch (const std::exception& e) {
      cache_.clear();   // the gpu_worker's cache is not known: the next request starts from a reset
      position_ = 0;
      conversations_.forget_unpinned();   // nor is its store: the entries' keys are dropped
      conversations_.forget(me.saved_key);
      state_ops_ = {};
      publish_conversations();
      live_owner_ = 0;
      leave_turns(me);
      return end_with_error(stream, e.what());
    }
  }

 private:
  // A request's draft policies: the suffix drafter's and the MTP head's acceptance differ (measured
  // on the built-in model: 0 of 36 suffix drafts, 19 of 47 MTP ones; group_mtp_test).
  struct DraftPolicies {
    group::DraftPolicy suffix, mtp;
  };
  // --batch-decode (coordinator/batched_request.h): with --prefill-chunk 0 the prompt runs here, as
  // steps of its own on the slot from a reset (between batched steps).
  grpc::Status generate_batched(grpc::ServerContext* ctx, grpc::ServerWriter<generate::GenerateChunk>* writer,
                                group::Sequence& seq) {
    const bool token_only = !seq.needs_logits() && !logits_dump_.is_open() && !o_.greedy_on_host;
    group::BatchedRequestEnv env{*stepper_, o_.prefill_chunk > 0, {}, context_positions_, prefill_, decode_, cancelled_,
                                 greedy_worker_tokens_};
    env.exclusive_prefill = [this](int slot, const group::Sequence& s, bool only, std::vector<float>& logits) {
      token_only_ = only;
      check_on_worker_ = mtp_request_ = false;
      step_slot_ = slot;
      struct Slot0 {
        int& s;
        ~Slot0() { s = 0; }
      } slot0{step_slot_};
      const StepOutput out = run_steps(s.context.data(), static_cast<int64_t>(s.context.size()), true);
      cache_.clear();   // the slot-0 sequence is not a reusable conversation in this mode
      position_ = 0;
      if (out.token < 0) logits.assign(out.logits.begin(), out.logits.end());
      return out.token;
    };
    return group::generate_batched(env, ctx, writer, seq, token_only);
  }

  // One batched step (BatchStepper's Issue): a segment per decode row or prompt chunk, greedy
  // tokens when every request takes them, else the logits rows.
  void run_batched(std::span<group::BatchStepper::Row* const> rows) {
    int64_t n = 0;
    for (const group::BatchStepper::Row* r : rows) n += r->n_rows();
    if (n > o_.max_tokens)
      throw std::logic_error("coordinator: a batched step of " + std::to_string(n) + " rows, steps of " +
                             std::to_string(o_.max_tokens));
    group::write_batched_step(exchange_.data(), xl_, ++step_seq_, rows);
    try {
      bells_.call(step_seq_, kStepTimeout, std::chrono::microseconds(o_.step_spin_us));
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string("gpu_worker: ") + e.what());
    }
    group::read_batched_reply(exchange_.data(), xl_, model_.hp.n_vocab, rows);
  }

  // A request admitted to take turns (--parallel), and where its sequence is while another's is live.
  struct Running {
    uint64_t id = 0;
    uint64_t saved_key = 0;   // its sequence waits saved (pinned) under this key; 0: live or not started
    const std::vector<int32_t>* context = nullptr;
    bool token_only = false, check_on_worker = false;
    bool mtp = false;   // its steps run the MTP head (StepHeader::mtp)
  };
  // At the start of a turn: the gpu_worker's live sequence becomes this request's. Another running
  // request's live sequence is saved first (pinned; its tokens stay live too, so a new request may
  // still reuse their prefix), and this one's comes back from its save.
  void enter_turn(Running& me) {
    token_only_ = me.token_only;
    check_on_worker_ = me.check_on_worker;
    mtp_request_ = me.mtp;
    if (live_owner_ == me.id) return;
    mtp_drafts_.clear();   // another sequence's drafts
    mtp_follows_ = false;
    if (live_owner_ != 0) {
      Running& other = *running_.at(live_owner_);
      state_ops_.save = conversations_.new_key();
      state_ops_.save_positions = position_;
      state_ops_.save_tokens.assign(other.context->begin(), other.context->begin() + position_);
      state_ops_.save_pinned = true;
      other.saved_key = state_ops_.save;
      cache_ = state_ops_.save_tokens;
      ++turn_switches_;
    }
    if (me.saved_key != 0 && !conversations_.holds(me.saved_key)) {
      // Its save is gone (the step that carried it failed: a gpu_worker lost): the next step
      // rebuilds its sequence from a reset (was "conversation cache: no entry", serve_fault_test).
      cache_.clear();
      position_ = 0;
      rewind_pending_ = false;
      reset_pending_ = true;
      me.saved_key = 0;
      ++lost_saves_;
    }
    if (me.saved_key != 0) {
      state_ops_.load = me.saved_key;
      cache_ = conversations_.take(me.saved_key);
      position_ = static_cast<int64_t>(cache_.size());
      rewind_pending_ = false;
      me.saved_key = 0;
    }
    live_owner_ = me.id;
  }
  // A request is done (in its turn): its sequence, live, is an idle conversation from now on.
  void leave_turns(Running& me) {
    if (live_owner_ == me.id) live_owner_ = 0;
    running_.erase(me.id);
    turns_.leave(me.id);
  }

  // The prefix cache: the gpu_worker holds the KV (and recurrent state) of cache_, the tokens of
  // the live sequence up to position_, and with --cache-ram earlier conversations saved in its
  // host memory (conversations_). A prompt that begins with some of their tokens prefills only
  // the rest: from the live sequence (rewound to the common prefix; its tail saved first when
  // that is worth keeping), or from the saved one that covers most (the live one saved, that one
  // loaded, state_ops_ for the next step). Attention-only models rewind to any common prefix; a
  // model with recurrent layers only reuses a whole cached sequence. At least one token is always
  // fed, for the logits. Returns the reused positions (0: a reset).
  int64_t reuse_prefix(const std::vector<int32_t>& prompt) {
    if (static_cast<int64_t>(cache_.size()) != position_) cache_.clear();
    const size_t live = conversations_.usable_prefix(cache_, prompt);
    const group::ConversationCache::Match saved = conversations_.enabled() ? conversations_.best(prompt) : group::ConversationCache::Match{};
    // The live sequence is kept when a request leaves some of it behind (another conversation,
    // or an edit) and what it leaves is worth a save: at least kMinSavedTail tokens.
    const size_t kept = saved.common > live ? 0 : live;
    if (state_ops_.save == 0 && conversations_.enabled() && cache_.size() >= kept + kMinSavedTail) {
      state_ops_.save = conversations_.new_key();
      state_ops_.save_positions = position_;
      state_ops_.save_tokens = cache_;
    }
    size_t common = live;
    if (saved.common > live) {
      state_ops_.load = saved.key;
      cache_ = conversations_.take(saved.key);
      position_ = static_cast<int64_t>(cache_.size());
      rewind_pending_ = false;
      common = saved.common;
      ++conversation_hits_;
    }
    publish_conversations();
    if (common == 0) return 0;
    if (static_cast<int64_t>(common) < position_) {
      position_ = static_cast<int64_t>(common);
      rewind_pending_ = true;   // the next step drops the positions past it (StepHeader::rewind)
    }
    ++prefix_cache_hits_;
    prefix_cached_tokens_ += common;
    return static_cast<int64_t>(common);
  }
  // The conversation cache's operations for the next step's header (StepHeader::state_*).
  struct StateOps {
    uint64_t save = 0, load = 0;
    int64_t save_positions = 0;
    bool save_pinned = false;   // a running request's sequence, waiting for its turn
    std::vector<int32_t> save_tokens;
  };
  // A live tail shorter than this is not saved: a request that only drops a few of its last tokens
  // (a regenerated answer) would keep a near copy, and a save copies the whole sequence.
  static constexpr size_t kMinSavedTail = 16;
  void publish_conversations() {
    conversation_entries_ = conversations_.size();
    conversation_bytes_ = conversations_.bytes();
    conversation_evictions_ = conversations_.evictions();
  }

  // One decode step (or a verified speculation window) after the tokens the sequence has
  // accepted: the tokens it settles, in order.
  template <class SampleOne>
  std::vector<int32_t> next_tokens(group::Sequence& seq, bool speculate, DraftPolicies& policies,
                                   group::SuffixDrafter& drafter, generate::GenerateTiming& timing,
                                   const SampleOne& sample_one) {
    const generate::SamplingParams& sp = seq.sampling();
    std::vector<int32_t>& context = seq.context;
    // The tokens not cached yet: the last one, or after a rejected window on a model with
    // recurrent layers, the window's accepted tokens again (its state went back to before it).
    const int64_t pending = static_cast<int64_t>(context.size()) - position_;
    // A window emits up to draft + 1 tokens: no more than are left to generate, and no
    // position past the cache that a one-token step would not have needed.
    group::DraftOptions lo{mtp_request_ ? std::max(o_.speculate_mtp, o_.speculate_draft) : o_.speculate_draft,
                           o_.speculate_min_match};
    lo.max_draft = static_cast<int>(std::min<int64_t>({lo.max_draft, static_cast<int64_t>(seq.max_new() - seq.generated()) - 1,
                                                       context_positions_ - static_cast<int64_t>(context.size()),
                                                       o_.max_tokens - pending}));
    std::vector<int32_t> draft;
    // The MTP head's drafts after this context's last token (the last step's StepReply::mtp_draft),
    // while it follows the sequence; else the suffix drafter's.
    const bool from_mtp = speculate && mtp_request_ && mtp_follows_;
    group::DraftPolicy& policy = from_mtp ? policies.mtp : policies.suffix;
    if (from_mtp && !mtp_ask_) policy.declined_unmade();   // the last step made none: the policy declined them
    // Each drafter's window length: its measured acceptance against the measured step costs.
    if (from_mtp) {
      const int most = std::min(lo.max_draft, o_.speculate_mtp);
      draft = mtp_drafts_.after(static_cast<int64_t>(context.size()), most > 0 ? policy.draft_length(most) : 0);
      if (!draft.empty()) ++mtp_drafts_used_;
    } else if (speculate && lo.max_draft > 0 && o_.speculate_draft > 0) {
      lo.max_draft = policy.draft_length(std::min(lo.max_draft, o_.speculate_draft));
      drafter.sync(context);
      draft = drafter.draft(lo);
    }
    const auto ts = Clock::now();
    std::vector<int32_t> decided;
    const bool verify_now = !draft.empty() && policy.should_verify();
    // The MTP head drafts (a draft costs about half a one-token step on the CPU backend) only
    // where the policy will verify them: measured plain steps then carry no drafting.
    mtp_ask_ = policies.mtp.will_verify();
    if (verify_now) {
      std::vector<int32_t> window(context.begin() + position_, context.end());
      window.insert(window.end(), draft.begin(), draft.end());
      const int64_t at = position_;
      const StepOutput v = verify(window, static_cast<int64_t>(draft.size()) + 1, context);
      size_t j = 0;
      if (token_only_) {
        j = group::accepted_prefix(draft, v.row_tokens);
        if (sp.check_logits()) {   // the rows whose tokens are used
          for (size_t r = 0; r <= j; ++r) report_nonfinite(v.row_nonfinite[r], context.size() + r);
        }
        decided.assign(draft.begin(), draft.begin() + static_cast<std::ptrdiff_t>(j));
        decided.push_back(v.row_tokens[j]);
        greedy_worker_tokens_ += decided.size();
      } else {
        const size_t V = static_cast<size_t>(model_.hp.n_vocab);
        decided = seq.speculate(v.logits, V, draft);
        j = decided.size() - 1;
        if (sp.check_logits()) {
          for (size_t r = 0; r <= j; ++r) check_finite(v.logits.subspan(r * V, V), context.size() + r);
        }
        // Sequence::speculate accepts a draft only as itself: the first j are the drafts.
        if (!std::equal(draft.begin(), draft.begin() + static_cast<std::ptrdiff_t>(j), decided.begin()))
          throw std::logic_error("speculation: accepted tokens that are not the draft's");
      }
      rewind_pending_ = j < draft.size();
      // Cached now: the pending tokens and the accepted drafts; with recurrent layers after a
      // rejection, nothing of the window (the snapshot before it comes back).
      if (rewind_pending_) position_ = recurrent_ ? at : at + pending + static_cast<int64_t>(j);
      const double us = us_since(ts);
      policy.record_verify(us, static_cast<int64_t>(decided.size()), static_cast<int64_t>(draft.size()));
      decode_.record(decided.size(), 0, 0, us);
      ++verify_steps_;
      drafted_tokens_ += draft.size();
      accepted_draft_tokens_ += j;
      timing.set_drafted_tokens(timing.drafted_tokens() + static_cast<uint32_t>(draft.size()));
      timing.set_accepted_draft_tokens(timing.accepted_draft_tokens() + static_cast<uint32_t>(j));
      return decided;
    }
    const StepOutput out = feed(context.data() + position_, pending, false, context);
    decode_.record(1, 0, 0, us_since(ts));
    // The policies count the sampling as the step's, as a window's rows' (top-k 40 over 151,936
    // logits: ~240 us a row on the dev box, the same for a sample and a verified row).
    decided.push_back(sample_one(out));
    const double us = us_since(ts);
    if (speculate) {
      policies.suffix.record_decode(us);
      policies.mtp.record_decode(us);
    }
    return decided;
  }
  // A faulty step (a kernel bug, a lost expert output) shows as non-finite logits; a benchmark
  // asks for this check so that it never reports numbers from such a run.
  // check_finite's error for the gpu_worker's report (StepReply::nonfinite: index * 2 + is-NaN).
  static void report_nonfinite(int32_t code, size_t position) {
    if (code < 0) return;
    throw std::runtime_error("logit " + std::to_string(code / 2) + " of position " + std::to_string(position) + " is " +
                             (code % 2 ? "NaN" : "inf"));
  }

  static void check_finite(std::span<const float> logits, size_t position) {
    // x * 0 is 0 for a finite x and NaN otherwise: 16 independent sums say whether to look (39 us
    // per token over 151,936 logits as one early-exit loop, on the path between two steps).
    float lane[16] = {};
    const size_t n16 = logits.size() / 16 * 16;
    for (size_t i = 0; i < n16; i += 16) {
      for (size_t j = 0; j < 16; ++j) lane[j] += logits[i + j] * 0.0f;
    }
    float any = 0.0f;
    for (float x : lane) any += x;
    for (size_t i = n16; i < logits.size(); ++i) any += logits[i] * 0.0f;
    if (any == 0.0f) return;
    for (size_t i = 0; i < logits.size(); ++i) {
      if (!std::isfinite(logits[i])) {
        throw std::runtime_error("logit " + std::to_string(i) + " of position " + std::to_string(position) + " is " +
                                 (std::isnan(logits[i]) ? "NaN" : "inf"));
      }
    }
  }

  // A conversation (chat/chat_template.h) through the GGUF's template, else the built-in ChatML.
  std::string render_chat(const nlohmann::ordered_json& chat, const char* field) const {
    try {
      return chat_template_ ? chat_template_->render(chat) : chat::render_builtin_chatml(chat);
    } catch (const std::exception& e) {
      throw std::invalid_argument(std::string(field) + ": " + e.what());
    }
  }

  std::vector<int32_t> prompt_of(const generate::GenerateRequest& req) const {
    std::vector<int32_t> ids;
    if (req.has_token_ids()) {
      for (uint32_t id : req.token_ids().ids()) {
        if (id >= static_cast<uint32_t>(model_.hp.n_vocab)) {
          throw std::invalid_argument("token_ids: " + std::to_string(id) + " is outside the vocabulary [0, " +
                                      std::to_string(model_.hp.n_vocab) + ")");
        }
        ids.push_back(static_cast<int32_t>(id));
      }
    } else if (req.input_case() == generate::GenerateRequest::kPrompt) {
      if (!tok_) throw std::invalid_argument("this model has no usable tokenizer: send token_ids");
      ids = tok_->encode(req.prompt(), true, false);
    } else if (req.has_messages()) {
      // Special tokens in the rendered text are parsed as such, the users' text inside it too
      // (parse_special applies to the whole string, as in llama.cpp's server).
      if (!tok_) throw std::invalid_argument("this model has no usable tokenizer: send token_ids");
      nlohmann::ordered_json chat = {{"messages", nlohmann::ordered_json::array()}};
      for (const generate::ChatMessage& m : req.messages().messages())
        chat["messages"].push_back({{"role", m.role()}, {"content", m.content()}});
      ids = tok_->encode(render_chat(chat, "messages"), false, true);
    } else if (req.input_case() == generate::GenerateRequest::kChatJson) {
      if (!tok_) throw std::invalid_argument("this model has no usable tokenizer: send token_ids");
      const nlohmann::ordered_json chat = nlohmann::ordered_json::parse(req.chat_json(), nullptr, false);
      if (chat.is_discarded()) throw std::invalid_argument("chat_json: not valid JSON");
      ids = tok_->encode(render_chat(chat, "chat_json"), false, true);
    }
    if (ids.empty()) throw std::invalid_argument("the request has no input tokens (prompt or token_ids)");
    return ids;
  }

  // What a step leaves for sampling: the last row's logits, or with token_only_ the greedy token
  // (then the logits are not there).
  struct StepOutput {
    std::span<const float> logits;
    int32_t token = -1;
    int32_t nonfinite = -1;   // check_on_worker_: StepReply::nonfinite of the last step
    // A verify window (logit_rows > 1): with token_only_ every row's greedy token and first
    // non-finite logit, in the exchange's StepReply; else `logits` holds all its rows.
    std::span<const int32_t> row_tokens, row_nonfinite;
  };

  // Runs n tokens (after the cached ones, or from scratch when reset) and returns the last row's
  // output. On a failed step, replays `context` (everything up to and including these tokens)
  // from a reset, up to step_retries times.
  StepOutput feed(const int32_t* tokens, int64_t n, bool reset, const std::vector<int32_t>& context) {
    for (int attempt = 0;; ++attempt) {
      try {
        if (attempt == 0) return run_steps(tokens, n, reset);
        ++reissued_;
        return run_steps(context.data(), static_cast<int64_t>(context.size()), true);
      } catch (const std::exception& e) {
        if (attempt >= o_.step_retries) throw;
        std::cerr << "coordinator: step failed (" << e.what() << "); re-issuing from a reset\n";
      }
    }
  }

  // A verify window: `window` (the tokens not cached yet, then the draft) as one step, with the
  // greedy token of each of its last `rows` rows (the last pending token's and the drafts'); on a
  // model with recurrent layers the gpu_worker first saves their state (StepHeader::snapshot).
  // `context` ends with the pending tokens; a failed step replays the context before them from a
  // reset, then the window.
  StepOutput verify(const std::vector<int32_t>& window, int64_t rows, const std::vector<int32_t>& context) {
    const int64_t n = static_cast<int64_t>(window.size());
    const int64_t before = position_;
    for (int attempt = 0;; ++attempt) {
      try {
        if (attempt > 0) {
          ++reissued_;
          run_steps(context.data(), before, true);
        }
        return run_steps(window.data(), n, false, rows, recurrent_);
      } catch (const std::exception& e) {
        if (attempt >= o_.step_retries) throw;
        std::cerr << "coordinator: step failed (" << e.what() << "); re-issuing from a reset\n";
      }
    }
  }

  // logit_rows > 1 (a verify window): n <= max_tokens, the rows' greedy tokens (token_only_) or logits;
  // snapshot: StepHeader::snapshot of the (one) step.
  StepOutput run_steps(const int32_t* tokens, int64_t n, bool reset, int64_t logit_rows = 1, bool snapshot = false) {
    std::byte* base = exchange_.data();
    const int64_t V = model_.hp.n_vocab;
    const uint32_t row_bytes = static_cast<uint32_t>(model_.hp.n_embd * sizeof(float));
    if (logit_rows > 1 && (n > o_.max_tokens || logit_rows > n ||
                           (token_only_ && logit_rows > static_cast<int64_t>(group::kMaxTokenRows))))
      throw std::logic_error("coordinator: a verify window of " + std::to_string(n) + " rows with " +
                             std::to_string(logit_rows) + " logit rows is not a step it can issue");
    if (reset || reset_pending_) {   // reset_pending_: enter_turn found the request's save gone
      reset = true;
      reset_pending_ = false;
      position_ = 0;
      rewind_pending_ = false;
    }
    int32_t token = -1;
    // A long prompt goes in long steps (GroupManifest::long_step_rows), the rest in steps of max_tokens.
    const int64_t step_rows = logit_rows == 1 && long_rows_ > 0 ? long_rows_ : o_.max_tokens;
    int64_t last_first = 0, last_rows = 0;   // the last step's first position and rows
    for (int64_t at = 0; at < n; at += step_rows) {
      const int64_t m = std::min<int64_t>(step_rows, n - at);
      last_first = position_;
      last_rows = m;
      std::copy_n(tokens + at, m, xl_.region("tokens").at<int32_t>(base));
      auto* hdr = xl_.region("step").at<group::StepHeader>(base);
      hdr->step_seq = ++step_seq_;
      hdr->n_tokens = static_cast<uint32_t>(m);
      hdr->logit_rows = static_cast<uint32_t>(logit_rows);
      hdr->reset = reset && at == 0;
      hdr->rewind = rewind_pending_ && !hdr->reset ? 1 : 0;
      hdr->snapshot = snapshot ? 1 : 0;
      hdr->first_position = static_cast<uint32_t>(position_);
      hdr->greedy_token = token_only_ ? 1 : 0;
      hdr->check_finite = check_on_worker_ ? 1 : 0;
      hdr->mtp = mtp_request_ ? 1 : 0;
      hdr->mtp_drafts = mtp_request_ && token_only_ && mtp_ask_ ? static_cast<uint32_t>(o_.speculate_mtp) : 0;
      hdr->slot = static_cast<uint32_t>(step_slot_);   // one sequence (batched decode: StepHeader::segments)
      hdr->n_segments = 0;
      // The conversation cache's operations go with the first step after reuse_prefix; a failed
      // step forgets both keys (whatever the gpu_worker did with them, they are dropped).
      StateOps ops = std::move(state_ops_);
      state_ops_ = {};
      conversations_.pop_drops(hdr->state_drop);
      hdr->state_save = ops.save;
      hdr->state_save_positions = static_cast<uint32_t>(ops.save_positions);
      hdr->state_load = ops.load;
      const auto saved_state = [&](const group::StepReply& r) {
        if (ops.save == 0) return;
        conversations_.saved(ops.save, std::move(ops.save_tokens), r.state_saved_bytes, ops.save_pinned);
        ++conversation_saves_;
        publish_conversations();
      };
      struct ForgetOnFailure {
        group::ConversationCache& c;
        const StateOps& ops;
        bool done = false;
        ~ForgetOnFailure() {
          if (!done) c.forget(ops.save), c.forget(ops.load);
        }
      } forget_on_failure{conversations_, ops};
      if (o_.step_channel == "doorbell") {
        try {
          token = bells_.call(step_seq_, kStepTimeout, std::chrono::microseconds(o_.step_spin_us)).token;
        } catch (const std::exception& e) {
          throw std::runtime_error(std::string("gpu_worker: ") + e.what());
        }
        forget_on_failure.done = true;
        saved_state(*xl_.region("step_reply").at<const group::StepReply>(base));
        position_ += m;
        rewind_pending_ = false;
        continue;
      }
      envelope_.Clear();
      envelope_.set_version(messaging::kJobProtocolVersion);
      envelope_.set_seq(step_seq_);
      jobs::LayerStep& s = *envelope_.mutable_layer_step();
      s.set_step_seq(step_seq_);
      s.set_kind(logit_rows > 1 ? jobs::STEP_VERIFY : m > 1 ? jobs::STEP_PREFILL : jobs::STEP_DECODE);
      s.set_layer(0);
      s.set_n_tokens(static_cast<uint32_t>(m));
      s.set_first_position(static_cast<uint32_t>(position_));
      s.set_row_bytes(row_bytes);
      for (auto [ref, region] : {std::pair{s.mutable_activations(), "hidden"}, std::pair{s.mutable_output(), "logits"}}) {
        ref->set_segment_id(group::kExchangeSegmentId);
        ref->set_offset(xl_.region(region).offset);
        ref->set_length(uint64_t(m) * row_bytes);
      }
      const std::string error = gpu_.call(envelope_, reply_, kStepTimeout);
      if (!error.empty()) {
        gpu_ = messaging::JobClient(ctx_, group::jobs_endpoint(o_.socket_dir, group::kGpuWorkerInstance));
        throw std::runtime_error("gpu_worker: " + error);
      }
      if (reply_.status() != jobs::JOB_OK) throw std::runtime_error("gpu_worker: " + reply_.error());
      token = xl_.region("step_reply").at<const group::StepReply>(base)->token;
      forget_on_failure.done = true;
      saved_state(*xl_.region("step_reply").at<const group::StepReply>(base));
      position_ += m;
      rewind_pending_ = false;
    }
    if (token_only_) {
      // Both step channels leave the reply in the exchange; the last step's is the last row's.
      const group::StepReply& reply = *xl_.region("step_reply").at<const group::StepReply>(base);
      mtp_follows_ = mtp_request_ && mtp_drafts_.take(reply.mtp_n_drafts, reply.mtp_row, reply.mtp_draft, last_first,
                                                      last_rows, logit_rows, o_.speculate_mtp, V);
      if (mtp_request_ && !mtp_follows_) ++mtp_no_drafts_;
      const std::span<const int32_t> rows(reply.row_tokens, static_cast<size_t>(logit_rows));
      for (const int32_t t : rows)
        if (t < 0 || t >= V) throw std::runtime_error("gpu_worker: greedy token " + std::to_string(t) + " is outside the vocabulary");
      if (token != rows.back())
        throw std::runtime_error("gpu_worker: the step's token " + std::to_string(token) + " is not its last row's " +
                                 std::to_string(rows.back()));
      const int32_t nonfinite = check_on_worker_ ? reply.nonfinite : -1;
      return {{}, token, nonfinite, rows, {reply.row_nonfinite, static_cast<size_t>(logit_rows)}};
    }
    const float* logits = xl_.region("logits").at<const float>(base);
    if (logits_dump_.is_open()) {
      logits_dump_.write(reinterpret_cast<const char*>(logits), static_cast<std::streamsize>(V * sizeof(float)));
      logits_dump_.flush();
    }
    // A verify window's rows follow one another ("logits" holds max_tokens rows).
    return {{logits, static_cast<size_t>(V * logit_rows)}, -1, -1, {}, {}};
  }

  // A step's whole round trip, a long prefill chunk included.
  static constexpr std::chrono::milliseconds kStepTimeout{300'000};

  Options o_;
  group::ControlServer& control_;
  std::atomic<uint64_t> in_flight_{0};   // Generate calls inside (or queued for) a session
  model::Model model_;
  std::unique_ptr<tokenizer::Tokenizer> tok_;
  std::optional<chat::ChatTemplate> chat_template_;  // the GGUF's; none: the built-in ChatML
  std::string prefix_;
  shm::ReclaimResult reclaimed_;
  int long_rows_;   // GroupManifest::long_step_rows
  group::ExchangeLayout xl_;
  group::PlacementPlan plan_;
  group::ArenaLayout al_;
  shm::ShmSegment exchange_, arena_;
  group::StageRecorder& prefill_;
  group::StageRecorder& decode_;
  // Per generated token, between two steps: the finite check, sampling and detokenizing; then
  // handing the chunk to the stream's writer thread (chunk_streamer.h).
  group::StageRecorder& sample_;
  group::StageRecorder& stream_write_;
  zmq::context_t ctx_{1};
  messaging::JobClient gpu_;
  jobs::JobEnvelope envelope_;
  jobs::JobReply reply_;
  group::StepBellClient bells_;
  bool token_only_ = false;   // this request's steps return the greedy token, not the logits
  bool check_on_worker_ = false;   // ... and the first non-finite logit (check_logits)
  std::atomic<uint64_t> greedy_worker_tokens_{0};
  std::vector<int32_t> cache_;   // the tokens of the gpu_worker's cached positions [0, position_)
  uint64_t step_seq_ = 0;
  int64_t position_ = 0;
  // The previous verify step rejected drafts: the gpu_worker caches positions past position_,
  // which the next step drops (StepHeader::rewind).
  bool rewind_pending_ = false;
  bool reset_pending_ = false;   // the next step resets the sequence (a waiting request's save was lost)
  bool recurrent_ = false;           // the model has recurrent layers: rewinds go to a snapshot
  bool mtp_ = false;                 // speculation drafts with the model's MTP head (--speculate-mtp)
  bool mtp_request_ = false;         // ... for the request in its turn: its steps carry StepHeader::mtp
  group::MtpDrafts mtp_drafts_;      // the last step's
  bool mtp_follows_ = false;         // ... which the head made (StepReply::mtp_n_drafts >= 0)
  bool mtp_ask_ = true;              // the next step asks for drafts (StepHeader::mtp_drafts)
  std::atomic<uint64_t> mtp_drafts_used_{0}, mtp_no_drafts_{0};
  int64_t context_positions_ = 0;    // the KV cache's positions (group::planned_context)
  std::atomic<uint64_t> verify_steps_{0}, drafted_tokens_{0}, accepted_draft_tokens_{0};
  std::atomic<uint64_t> reissued_{0};
  std::atomic<uint64_t> prefix_cache_hits_{0}, prefix_cached_tokens_{0}, cancelled_{0};
  group::ConversationCache conversations_;   // --cache-ram: saved conversations
  StateOps state_ops_;                       // ... for the next step (reuse_prefix)
  std::atomic<uint64_t> conversation_hits_{0}, conversation_saves_{0}, conversation_evictions_{0};
  std::atomic<uint64_t> conversation_entries_{0}, conversation_bytes_{0};
  group::TurnQueue turns_;   // --parallel: who steps the gpu_worker
  std::unordered_map<uint64_t, Running*> running_;   // admitted requests, touched in a turn only
  uint64_t live_owner_ = 0;   // the running request whose sequence the gpu_worker holds (0: none)
  std::atomic<uint64_t> next_request_id_{0}, turn_switches_{0};
  std::atomic<uint64_t> lost_saves_{0};   // waiting requests rebuilt from a reset: their save was lost
  std::ofstream logits_dump_;
  std::unique_ptr<group::BatchStepper> stepper_;   // --batch-decode
  int step_slot_ = 0;   // the slot run_steps' steps run on (a batched request's prefill)
};

int run(const Options& given) {
  group::install_stop_signals();
  if (given.cpu_workers < 1 || given.max_tokens < 0)
    throw std::invalid_argument("--cpu-workers must be >= 1 and --max-tokens >= 0");
  Options o = given;
  if (o.long_step_rows < -1) throw std::invalid_argument("--long-step-rows must be >= 0");
  const auto resolve_window = [&] {
    if (o.max_tokens != 0) return;
    o.max_tokens = window_rows_for(o, model::Model::load(o.model));
    std::cerr << "coordinator: steps (long steps' windows) of " << o.max_tokens << " rows\n";
  };
  if (o.print_plan) {
    resolve_window();
    const model::Model m = model::Model::load(o.model);
    const int long_rows = long_step_rows_for(o, m);
    group::Census census;
    const group::PlacementPlan plan = plan_for(o, m, false, &census);   // a budget it refuses: nothing printed
    const std::string disk = group::plan_disk_line(o.disk_rate, m, plan, census);
    std::cout << "steps of " << o.max_tokens << " rows";
    if (long_rows > 0) std::cout << ", long steps of " << long_rows << " rows";
    std::cout << "\n" << plan.table() << disk;
    return 0;
  }
  // The control server first: it checks the socket directory before anything reads the model.
  group::ControlServer control(control::ROLE_COORDINATOR, group::kCoordinatorInstance,
                               group::control_address(o.socket_dir, group::kCoordinatorInstance));
  resolve_window();
  control.set_state(control::LOADING);
  auto coordinator = std::make_unique<Coordinator>(o, control);
  control.add_service(coordinator.get());
  control.start();
  control.set_state(control::SERVING);
  while (!control.wait_shutdown(std::chrono::milliseconds(100)) && !group::signal_received()) {
  }
  control.stop();
  std::remove(group::manifest_path(o.socket_dir).c_str());
  std::remove(group::placement_path(o.socket_dir).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moraine-coordinator: model description, sessions, sampling; drives the group's steps"};
  Options o;
  group::add_coordinator_options(app, o);
  CLI11_PARSE(app, argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::cerr << "moraine-coordinator: " << e.what() << "\n";
    return 1;
  }
}
