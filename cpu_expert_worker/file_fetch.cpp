#include "cpu_expert_worker/file_fetch.h"

namespace moraine::cpu_worker {

FileFetch::FileFetch(const model::Model& m, const group::ArenaLayout& al, int worker, std::string endpoint,
                     std::chrono::milliseconds attempt, std::chrono::milliseconds deadline)
    : model_(m), al_(al), worker_(worker), endpoint_(std::move(endpoint)), attempt_(attempt), deadline_(deadline) {}

std::uint64_t FileFetch::send(std::int64_t il, const std::vector<Item>& items, std::uint64_t step_seq) {
  if (in_flight_) throw std::logic_error("FileFetch: a request is already in flight");
  envelope_.Clear();
  envelope_.set_version(messaging::kJobProtocolVersion);
  envelope_.set_seq(++seq_);
  jobs::ReadJobList& list = *envelope_.mutable_read_jobs();
  list.set_step_seq(step_seq);
  list.set_layer(static_cast<std::uint32_t>(il));
  std::uint64_t bytes = 0;
  for (const Item& it : items) {
    const group::ArenaLayout::ExpertSlot slot = al_.cache_slot(model_, il, worker_, it.slot);
    for (int part = 0; part < 3; ++part) {
      const group::FileRange fr = group::expert_file_range(model_, il, it.expert, part);
      jobs::ReadRange* r = list.add_ranges();
      r->set_file_index(fr.file_index);
      r->set_file_offset(fr.offset);
      r->mutable_dest()->set_segment_id(group::kArenaSegmentId);
      r->mutable_dest()->set_offset(slot.offset[part]);
      r->mutable_dest()->set_length(fr.bytes);
      bytes += fr.bytes;
    }
  }
  sent_at_ = std::chrono::steady_clock::now();
  in_flight_ = true;
  post();
  return bytes;
}

void FileFetch::post() {
  if (!io_) io_ = std::make_unique<messaging::JobClient>(zmq_, endpoint_);
  // A send that fails leaves the socket to the next attempt's check in wait().
  if (!io_->send(envelope_, attempt_).empty()) io_.reset();
}

void FileFetch::wait() {
  if (!in_flight_) return;
  const auto until = sent_at_ + deadline_;
  std::string error = "not sent";
  while (std::chrono::steady_clock::now() < until) {
    if (io_) {
      error = io_->receive(reply_, seq_, attempt_);
      if (error.empty()) {
        in_flight_ = false;
        if (reply_.status() != jobs::JOB_OK) {
          throw FetchError(std::string(group::kIoWorkerInstance) + " failed layer " +
                           std::to_string(envelope_.read_jobs().layer()) + " reads: " + reply_.error());
        }
        return;
      }
    }
    io_.reset();   // timed out or never sent: a fresh socket, the request again
    post();
  }
  in_flight_ = false;
  throw std::runtime_error(std::string(group::kIoWorkerInstance) + ": " + error);
}

}  // namespace moraine::cpu_worker
