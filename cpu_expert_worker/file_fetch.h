// One cpu_expert_worker's reads of FILE-tier experts: ReadJobLists to io_worker-0 that put an
// expert's gate, up and down rows into one of this worker's file-cache slots. One request in
// flight at a time (a REQ socket); send and wait are apart, so that a read-ahead of the next
// layer's experts runs while the worker computes. A request the io_worker does not answer within
// an attempt (killed: the supervisor restarts it on the same endpoint) is sent again on a fresh
// socket until the deadline: its reads only write slots this worker is filling.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/messaging/job_channel.h"
#include "common/model/model.h"
#include "coordinator/group_layout.h"

namespace moraine::cpu_worker {

// The io_worker answered with an error (a read error, a truncated shard, a range it refused):
// sending it again cannot help, so the layer fails with this text (file, range, cause).
struct FetchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class FileFetch {
 public:
  struct Item {
    std::int32_t expert;
    std::int64_t slot;   // this worker's cache slot
  };
  // attempt: one wait for a reply; deadline: all attempts of one request.
  FileFetch(const model::Model& m, const group::ArenaLayout& al, int worker, std::string endpoint,
            std::chrono::milliseconds attempt = std::chrono::seconds(10),
            std::chrono::milliseconds deadline = std::chrono::seconds(60));

  // Sends the reads of `items` (experts of layer il) and returns their bytes; one request at a time.
  std::uint64_t send(std::int64_t il, const std::vector<Item>& items, std::uint64_t step_seq);
  bool in_flight() const { return in_flight_; }
  // Waits for the request in flight to land whole. Throws FetchError when the io_worker failed
  // it, std::runtime_error when no reply came by the deadline.
  void wait();

 private:
  void post();   // (re)sends envelope_ on the current socket, a fresh one if needed

  const model::Model& model_;
  const group::ArenaLayout& al_;
  int worker_;
  std::string endpoint_;
  std::chrono::milliseconds attempt_, deadline_;
  zmq::context_t zmq_{1};
  std::unique_ptr<messaging::JobClient> io_;
  jobs::JobEnvelope envelope_;
  jobs::JobReply reply_;
  std::uint64_t seq_ = 0;
  bool in_flight_ = false;
  std::chrono::steady_clock::time_point sent_at_{};
};

}  // namespace moraine::cpu_worker
