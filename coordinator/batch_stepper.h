// Batched decode across concurrent requests (coordinator --batch-decode, issue 33): each admitted
// request holds a sequence slot of the gpu_worker (GroupManifest::slots); its prompt goes in
// chunks of at most chunk_rows rows per step beside the running sequences' decode rows
// (prefill()), or with chunk_rows 0 as steps of its own between batched steps (exclusive()), and
// while several requests decode, one step carries one decode row per sequence
// (StepHeader::segments), so every chosen expert is read once for all of them. The request threads call decode() and block; whichever finds no step in
// flight issues one for every row waiting then (after at most kGather for the other decoding
// requests to submit theirs) and hands each its output. The rows' outputs do not depend on which
// rows share a step (the backend's batched rows equal each sequence alone), so the gathering is
// about speed only.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "coordinator/group_layout.h"

namespace moraine::group {

class BatchStepper {
 public:
  // One segment of a batched step, a decode row or a prompt chunk, and what the step gave it.
  struct Row {
    int slot = 0;
    int32_t token = -1;          // a decode row: fed at `position`
    int64_t position = 0;
    std::span<const int32_t> chunk;   // a prompt chunk (non-empty): these tokens from `position` on
    bool reset = false;          // the chunk starts the slot's sequence
    int64_t n_rows() const { return chunk.empty() ? 1 : static_cast<int64_t>(chunk.size()); }
    bool token_only = true;      // the request reads the greedy token (else the logits row)
    int32_t out_token = -1;      // the step's greedy token for this row (-1 without)
    std::vector<float> logits;   // its logits row when the step returned logits
    bool done = false;
    std::string error;           // the step failed: why
  };
  // Runs one batched step over rows (in order), filling each row's out_token / logits; throws
  // on failure (every row of the step then gets the error).
  using Issue = std::function<void(std::span<Row* const> rows)>;
  // How long a decode row waits for the other decoding requests' rows before its step goes out:
  // long beside a request thread's work between two steps (sampling, detokenizing, the stream:
  // ~20-40 us on the dev box), short beside a step (0.4-3 ms on the CPU backend).
  static constexpr std::chrono::microseconds kGather{500};

  // chunk_rows: prompt rows per batched step, shared by the prefilling requests in arrival order
  // (0: prefills run exclusive()).
  BatchStepper(int slots, Issue issue, int64_t chunk_rows = 0);
  int slots() const { return static_cast<int>(free_.size()); }
  // A free slot, blocking until one is (admission: at most `slots` requests at once, each slot
  // the KV cache and state of one sequence, charged to --vram); the waiting requests take the
  // slots in arrival order (FIFO). kCancelled when cancelled first (polled every 20 ms);
  // kQueueFull at once when queue_limit requests already wait.
  static constexpr int kCancelled = -1, kQueueFull = -2;
  int acquire_slot(const std::function<bool()>& cancelled);
  void set_queue_limit(int limit) { queue_limit_ = limit; }   // before any request; < 0: none
  int queue_limit() const { return queue_limit_; }
  int waiting() const;                                         // requests waiting for a slot
  void release_slot(int slot);
  // Runs fn with no batched step in flight and none starting (a prefill step): waiting batched
  // rows go after it.
  void exclusive(const std::function<void()>& fn);
  // The decoding requests: those whose rows a step waits for (at most kGather).
  void begin_decoding();
  void end_decoding();
  // A request's prompt on its slot, from a reset, in chunks of the batched steps (chunk_rows > 0);
  // blocks until its last chunk has run, whose output (out_token / logits) lands in `out`. Throws
  // std::runtime_error with a failed step's error.
  void prefill(int slot, std::span<const int32_t> prompt, bool token_only, Row& out);
  // One decode row: blocks until a step carrying it has run; throws std::runtime_error with the
  // step's error.
  void decode(Row& row);
  uint64_t steps() const;       // batched steps issued
  uint64_t rows() const;        // decode rows they carried
  uint64_t chunk_rows() const;  // prompt rows they carried
  uint64_t mixed_steps() const; // steps that carried a prompt chunk beside decode rows

 private:
  struct Job {                  // a prefilling request
    int slot;
    std::span<const int32_t> prompt;
    bool token_only;
    Row* out;
    int64_t fed = 0;
    bool done = false;
    std::string error;
  };
  bool has_work() const { return !pending_.empty() || !jobs_.empty(); }
  // Waits (lock held) until `done`, leading a step whenever none is in flight and the decoding
  // requests' rows are all in (or kGather went by since work was first waiting).
  void serve_until(std::unique_lock<std::mutex>& l, const std::function<bool()>& done);
  void lead(std::unique_lock<std::mutex>& l);   // one batched step of the waiting work
  void note_work();                             // work arrived: its gather window starts if none had

  Issue issue_;
  int64_t chunk_rows_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint8_t> free_;   // [slot]
  std::vector<Row*> pending_;
  std::vector<Job*> jobs_;      // arrival order
  std::vector<uint64_t> queue_; // tickets of the requests waiting for a slot, arrival order
  uint64_t next_ticket_ = 0;
  int queue_limit_ = -1;
  std::chrono::steady_clock::time_point work_since_{};
  bool busy_ = false;           // a step (batched or exclusive) is in flight
  int exclusive_waiting_ = 0, decoding_ = 0;
  uint64_t steps_ = 0, rows_ = 0, chunk_rows_fed_ = 0, mixed_steps_ = 0;
};

// The exchange side of a batched step (the coordinator's Issue): the step header (one segment per
// row: a decode row, or a prompt chunk with the logits of its last row; greedy tokens when every
// row takes them, else the logits rows) and the tokens; then each row's greedy token
// (StepReply::segment_token, checked against the vocabulary) or its logits row from the reply.
void write_batched_step(std::byte* exchange, const ExchangeLayout& xl, std::uint64_t seq, std::span<BatchStepper::Row* const> rows);
void read_batched_reply(std::byte* exchange, const ExchangeLayout& xl, std::int64_t n_vocab,
                        std::span<BatchStepper::Row* const> rows);

}  // namespace moraine::group
