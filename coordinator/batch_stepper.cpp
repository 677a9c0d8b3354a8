#include "coordinator/batch_stepper.h"

#include "coordinator/group_layout.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace moraine::group {

namespace {
constexpr auto kPoll = std::chrono::milliseconds(20);
constexpr size_t kMaxRows = kMaxSegments;   // rows of one batched step: one segment each
}  // namespace

BatchStepper::BatchStepper(int slots, Issue issue) : issue_(std::move(issue)), free_(static_cast<size_t>(slots), 1) {
  if (slots < 1 || static_cast<size_t>(slots) > kMaxRows)
    throw std::invalid_argument("batched decode: " + std::to_string(slots) + " slots, expected 1.." + std::to_string(kMaxRows));
}

int BatchStepper::acquire_slot(const std::function<bool()>& cancelled) {
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    const auto it = std::find(free_.begin(), free_.end(), 1);
    if (it != free_.end()) {
      *it = 0;
      return static_cast<int>(it - free_.begin());
    }
    if (cancelled && cancelled()) return -1;
    cv_.wait_for(l, kPoll);
  }
}

void BatchStepper::release_slot(int slot) {
  std::lock_guard<std::mutex> l(mu_);
  free_.at(static_cast<size_t>(slot)) = 1;
  cv_.notify_all();
}

void BatchStepper::exclusive(const std::function<void()>& fn) {
  {
    std::unique_lock<std::mutex> l(mu_);
    ++exclusive_waiting_;
    cv_.wait(l, [&] { return !busy_; });
    --exclusive_waiting_;
    busy_ = true;
  }
  struct Done {
    BatchStepper& s;
    ~Done() {
      std::lock_guard<std::mutex> l(s.mu_);
      s.busy_ = false;
      s.cv_.notify_all();
    }
  } done{*this};
  fn();
}

void BatchStepper::begin_decoding() {
  std::lock_guard<std::mutex> l(mu_);
  ++decoding_;
}

void BatchStepper::end_decoding() {
  std::lock_guard<std::mutex> l(mu_);
  --decoding_;
  cv_.notify_all();
}

void BatchStepper::decode(Row& row) {
  std::unique_lock<std::mutex> l(mu_);
  row.done = false;
  row.error.clear();
  pending_.push_back(&row);
  cv_.notify_all();
  const auto since = std::chrono::steady_clock::now();
  for (;;) {
    if (row.done) {
      if (!row.error.empty()) throw std::runtime_error(row.error);
      return;
    }
    // Lead a step: none in flight, no prefill waiting, and every decoding request's row here or
    // kGather gone by.
    const bool all_in = static_cast<int>(pending_.size()) >= decoding_ || pending_.size() >= kMaxRows;
    if (!busy_ && exclusive_waiting_ == 0 && (all_in || std::chrono::steady_clock::now() - since >= kGather)) {
      const size_t take = std::min(pending_.size(), kMaxRows);
      std::vector<Row*> rows(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(take));
      pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(take));
      // In slot order: the same requests give the same segment layout step after step, which the
      // CUDA backend replays as one captured graph (keyed by its segments) instead of capturing
      // one per arrival order.
      std::sort(rows.begin(), rows.end(), [](const Row* a, const Row* b) { return a->slot < b->slot; });
      busy_ = true;
      l.unlock();
      std::string error;
      try {
        issue_(rows);
      } catch (const std::exception& e) {
        error = e.what();
      }
      l.lock();
      for (Row* r : rows) {
        r->error = error;
        r->done = true;
      }
      ++steps_;
      rows_ += rows.size();
      busy_ = false;
      cv_.notify_all();
      continue;
    }
    if (busy_ || exclusive_waiting_ > 0) {
      cv_.wait(l);
    } else {
      cv_.wait_for(l, kGather / 5);
    }
  }
}

uint64_t BatchStepper::steps() const {
  std::lock_guard<std::mutex> l(mu_);
  return steps_;
}

uint64_t BatchStepper::rows() const {
  std::lock_guard<std::mutex> l(mu_);
  return rows_;
}

void write_batched_step(std::byte* exchange, const ExchangeLayout& xl, std::uint64_t seq, std::span<BatchStepper::Row* const> rows) {
  if (rows.empty() || rows.size() > kMaxSegments)
    throw std::logic_error("batched decode: a step of " + std::to_string(rows.size()) + " rows, expected 1.." +
                           std::to_string(kMaxSegments));
  auto* hdr = xl.region("step").at<StepHeader>(exchange);
  int32_t* tokens = xl.region("tokens").at<int32_t>(exchange);
  const bool greedy = std::all_of(rows.begin(), rows.end(), [](const BatchStepper::Row* r) { return r->token_only; });
  hdr->step_seq = seq;
  hdr->n_tokens = hdr->logit_rows = static_cast<uint32_t>(rows.size());
  hdr->reset = hdr->rewind = hdr->snapshot = hdr->check_finite = hdr->mtp = hdr->mtp_drafts = 0;
  hdr->first_position = static_cast<uint32_t>(rows[0]->position);   // what the step bell carries
  hdr->greedy_token = greedy ? 1 : 0;
  std::fill_n(hdr->state_drop, kMaxStateDrops, 0);
  hdr->state_save = hdr->state_load = 0;
  hdr->state_save_positions = 0;
  hdr->slot = 0;
  hdr->n_segments = static_cast<uint32_t>(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    tokens[i] = rows[i]->token;
    hdr->segments[i] = {static_cast<uint32_t>(rows[i]->slot), static_cast<uint32_t>(rows[i]->position), 1, 1, 0, 0, 0};
  }
}

void read_batched_reply(std::byte* exchange, const ExchangeLayout& xl, std::int64_t n_vocab,
                        std::span<BatchStepper::Row* const> rows) {
  const auto* hdr = xl.region("step").at<const StepHeader>(exchange);
  const auto* reply = xl.region("step_reply").at<const StepReply>(exchange);
  const float* logits = xl.region("logits").at<const float>(exchange);
  for (size_t i = 0; i < rows.size(); ++i) {
    BatchStepper::Row& r = *rows[i];
    r.out_token = -1;
    if (!hdr->greedy_token) {
      r.logits.assign(logits + static_cast<int64_t>(i) * n_vocab, logits + static_cast<int64_t>(i + 1) * n_vocab);
      continue;
    }
    r.out_token = reply->segment_token[i];
    if (r.out_token < 0 || r.out_token >= n_vocab)
      throw std::runtime_error("gpu_worker: greedy token " + std::to_string(r.out_token) + " of segment " + std::to_string(i) +
                               " is outside the vocabulary");
  }
}

}  // namespace moraine::group
