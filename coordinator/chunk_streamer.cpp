#include "coordinator/chunk_streamer.h"

#include <utility>

namespace moraine::group {

ChunkStreamer::ChunkStreamer(grpc::ServerWriter<generate::GenerateChunk>* writer)
    : writer_(writer), thread_([this] { run(); }) {}

ChunkStreamer::~ChunkStreamer() { finish(); }

void ChunkStreamer::push(generate::GenerateChunk chunk) {
  {
    std::lock_guard lock(mu_);
    if (broken_ || closing_) return;
    queue_.push_back(std::move(chunk));
  }
  cv_.notify_one();
}

bool ChunkStreamer::finish() {
  {
    std::lock_guard lock(mu_);
    closing_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
  std::lock_guard lock(mu_);
  return !broken_;
}

bool ChunkStreamer::broken() const {
  std::lock_guard lock(mu_);
  return broken_;
}

void ChunkStreamer::run() {
  for (;;) {
    generate::GenerateChunk chunk;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return !queue_.empty() || closing_; });
      if (queue_.empty()) return;   // closing and everything written
      chunk = std::move(queue_.front());
      queue_.pop_front();
    }
    if (!writer_->Write(chunk)) {
      std::lock_guard lock(mu_);
      broken_ = true;
      queue_.clear();
      return;
    }
  }
}

}  // namespace moraine::group
