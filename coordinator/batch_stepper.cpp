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

BatchStepper::BatchStepper(int slots, Issue issue, int64_t chunk_rows)
    : issue_(std::move(issue)), chunk_rows_(chunk_rows), free_(static_cast<size_t>(std::max(slots, 0)), 1) {
  if (slots < 1 || static_cast<size_t>(slots) > kMaxRows)
    throw std::invalid_argument("batched decode: " + std::to_string(slots) + " slots, expected 1.." + std::to_string(kMaxRows));
  if (chunk_rows < 0) throw std::invalid_argument("batched decode: " + std::to_string(chunk_rows) + " prompt rows per step");
}

int BatchStepper::acquire_slot(const std::function<bool()>& cancelled) {
  std::unique_lock<std::mutex> l(mu_);
  const auto free_slot = std::find(free_.begin(), free_.end(), 1);
  if (queue_.empty() && free_slot != free_.end()) {
    *free_slot = 0;
    return static_cast<int>(free_slot - free_.begin());
  }
  if (queue_limit_ >= 0 && static_cast<int>(queue_.size()) >= queue_limit_) return kQueueFull;
  const uint64_t me = ++next_ticket_;
  queue_.push_back(me);
  for (;;) {
    const auto it = std::find(free_.begin(), free_.end(), 1);
    if (queue_.front() == me && it != free_.end()) {
      *it = 0;
      queue_.erase(queue_.begin());
      cv_.notify_all();   // the next in line may take another free slot
      return static_cast<int>(it - free_.begin());
    }
    if (cancelled && cancelled()) {
      queue_.erase(std::find(queue_.begin(), queue_.end(), me));
      cv_.notify_all();   // the one behind may be first now
      return kCancelled;
    }
    cv_.wait_for(l, kPoll);
  }
}

int BatchStepper::waiting() const {
  std::lock_guard<std::mutex> l(mu_);
  return static_cast<int>(queue_.size());
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

void BatchStepper::note_work() {
  if (!has_work()) work_since_ = std::chrono::steady_clock::now();
}

void BatchStepper::decode(Row& row) {
  std::unique_lock<std::mutex> l(mu_);
  row.done = false;
  row.error.clear();
  row.chunk = {};
  row.reset = false;
  note_work();
  pending_.push_back(&row);
  cv_.notify_all();
  serve_until(l, [&] { return row.done; });
  if (!row.error.empty()) throw std::runtime_error(row.error);
}

void BatchStepper::prefill(int slot, std::span<const int32_t> prompt, bool token_only, Row& out) {
  if (chunk_rows_ <= 0) throw std::logic_error("batched decode: prefill() without prompt rows per step");
  if (prompt.empty()) throw std::invalid_argument("batched decode: an empty prompt");
  Job job{slot, prompt, token_only, &out, 0, false, {}};
  std::unique_lock<std::mutex> l(mu_);
  note_work();
  jobs_.push_back(&job);
  cv_.notify_all();
  serve_until(l, [&] { return job.done; });
  if (!job.error.empty()) throw std::runtime_error(job.error);
}

void BatchStepper::serve_until(std::unique_lock<std::mutex>& l, const std::function<bool()>& done) {
  while (!done()) {
    // Lead a step: none in flight, no exclusive prefill waiting, and every decoding request's row
    // here or kGather gone by since work first waited.
    const bool all_in = static_cast<int>(pending_.size()) >= decoding_ || pending_.size() >= kMaxRows;
    if (!busy_ && exclusive_waiting_ == 0 && has_work() &&
        (all_in || std::chrono::steady_clock::now() - work_since_ >= kGather)) {
      lead(l);
      continue;
    }
    if (busy_ || exclusive_waiting_ > 0 || !has_work()) {
      cv_.wait(l);
    } else {
      cv_.wait_for(l, kGather / 5);
    }
  }
}

void BatchStepper::lead(std::unique_lock<std::mutex>& l) {
  // The decode rows first (one each), then the prompt chunks of the prefilling requests in arrival
  // order within chunk_rows_; every request holds its own slot, so the segments' slots differ.
  const size_t take = std::min(pending_.size(), kMaxRows);
  std::vector<Row*> rows(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(take));
  pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(take));
  std::vector<Row> chunks;
  std::vector<Job*> fed;
  chunks.reserve(jobs_.size());
  int64_t budget = chunk_rows_;
  for (Job* j : jobs_) {
    if (budget <= 0 || rows.size() + chunks.size() >= kMaxRows) break;
    const int64_t n = std::min<int64_t>(budget, static_cast<int64_t>(j->prompt.size()) - j->fed);
    Row c;
    c.slot = j->slot;
    c.position = j->fed;
    c.chunk = j->prompt.subspan(static_cast<size_t>(j->fed), static_cast<size_t>(n));
    c.reset = j->fed == 0;
    c.token_only = j->token_only;
    chunks.push_back(std::move(c));
    fed.push_back(j);
    budget -= n;
  }
  for (Row& c : chunks) rows.push_back(&c);
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
    if (!r->chunk.empty()) continue;
    r->error = error;
    r->done = true;
    ++rows_;
  }
  for (size_t i = 0; i < fed.size(); ++i) {
    Job& j = *fed[i];
    j.fed += static_cast<int64_t>(chunks[i].chunk.size());
    chunk_rows_fed_ += chunks[i].chunk.size();
    if (error.empty() && j.fed < static_cast<int64_t>(j.prompt.size())) continue;
    j.error = error;
    j.out->out_token = chunks[i].out_token;
    j.out->logits = std::move(chunks[i].logits);
    j.done = true;
    jobs_.erase(std::find(jobs_.begin(), jobs_.end(), &j));
  }
  ++steps_;
  if (!fed.empty() && take > 0) ++mixed_steps_;
  busy_ = false;
  // The prompts still going (and decode rows that came meanwhile) wait their gather window afresh.
  work_since_ = std::chrono::steady_clock::now();
  cv_.notify_all();
}

uint64_t BatchStepper::steps() const {
  std::lock_guard<std::mutex> l(mu_);
  return steps_;
}

uint64_t BatchStepper::rows() const {
  std::lock_guard<std::mutex> l(mu_);
  return rows_;
}

uint64_t BatchStepper::chunk_rows() const {
  std::lock_guard<std::mutex> l(mu_);
  return chunk_rows_fed_;
}

uint64_t BatchStepper::mixed_steps() const {
  std::lock_guard<std::mutex> l(mu_);
  return mixed_steps_;
}

void write_batched_step(std::byte* exchange, const ExchangeLayout& xl, std::uint64_t seq, std::span<BatchStepper::Row* const> rows) {
  if (rows.empty() || rows.size() > kMaxSegments)
    throw std::logic_error("batched decode: a step of " + std::to_string(rows.size()) + " segments, expected 1.." +
                           std::to_string(kMaxSegments));
  auto* hdr = xl.region("step").at<StepHeader>(exchange);
  int32_t* tokens = xl.region("tokens").at<int32_t>(exchange);
  const size_t capacity = xl.region("tokens").bytes / sizeof(int32_t);
  const bool greedy = std::all_of(rows.begin(), rows.end(), [](const BatchStepper::Row* r) { return r->token_only; });
  hdr->step_seq = seq;
  hdr->logit_rows = static_cast<uint32_t>(rows.size());   // each segment's last row
  hdr->reset = hdr->rewind = hdr->snapshot = hdr->check_finite = hdr->mtp = hdr->mtp_drafts = 0;
  hdr->first_position = static_cast<uint32_t>(rows[0]->position);   // what the step bell carries
  hdr->greedy_token = greedy ? 1 : 0;
  std::fill_n(hdr->state_drop, kMaxStateDrops, 0);
  hdr->state_save = hdr->state_load = 0;
  hdr->state_save_positions = 0;
  hdr->slot = 0;
  hdr->n_segments = static_cast<uint32_t>(rows.size());
  size_t n = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const BatchStepper::Row& r = *rows[i];
    const size_t m = static_cast<size_t>(r.n_rows());
    if (n + m > capacity)
      throw std::logic_error("batched decode: a step of more than " + std::to_string(capacity) + " rows (the exchange's tokens)");
    if (r.chunk.empty()) {
      tokens[n] = r.token;
    } else {
      std::copy(r.chunk.begin(), r.chunk.end(), tokens + n);
    }
    hdr->segments[i] = {static_cast<uint32_t>(r.slot), static_cast<uint32_t>(r.position), static_cast<uint32_t>(m), 1,
                        r.reset ? 1u : 0u, 0, 0};
    n += m;
  }
  hdr->n_tokens = static_cast<uint32_t>(n);
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
