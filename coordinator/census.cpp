#include "coordinator/census.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <system_error>

#include <nlohmann/json.hpp>

#include "common/fileio/atomic_file.h"
#include "coordinator/json_fields.h"

namespace moraine::group {

Census Census::uniform(std::int64_t n_layer, std::int64_t n_expert) {
  Census c;
  c.counts.assign(static_cast<std::size_t>(n_layer), std::vector<std::uint64_t>(static_cast<std::size_t>(n_expert), 0));
  return c;
}

Census Census::read(const std::string& path, std::int64_t n_layer, std::int64_t n_expert) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open census " + path);
  Census c;
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    const auto L = json_integer<std::int64_t>(j, "n_layer"), E = json_integer<std::int64_t>(j, "n_expert");
    if (L != n_layer || E != n_expert) {
      throw std::runtime_error("it is for " + std::to_string(L) + " layers x " + std::to_string(E) +
                               " experts, the model has " + std::to_string(n_layer) + " x " + std::to_string(n_expert));
    }
    // Checked element by element: nlohmann's get<uint64_t> would wrap a negative count around.
    const nlohmann::json& rows = j.at("counts");
    if (!rows.is_array()) throw std::runtime_error("counts is not an array");
    for (std::size_t il = 0; il < rows.size(); ++il) {
      if (!rows[il].is_array()) throw std::runtime_error("counts[" + std::to_string(il) + "] is not an array");
      for (std::size_t e = 0; e < rows[il].size(); ++e) {
        if (!rows[il][e].is_number_unsigned()) {
          throw std::runtime_error("counts[" + std::to_string(il) + "][" + std::to_string(e) + "] = " + rows[il][e].dump() +
                                   " is not a count (a non-negative integer)");
        }
      }
    }
    c.counts = rows.get<std::vector<std::vector<std::uint64_t>>>();
    if (static_cast<std::int64_t>(c.counts.size()) != n_layer) {
      throw std::runtime_error("counts has " + std::to_string(c.counts.size()) + " layers, expected " + std::to_string(n_layer));
    }
    for (std::size_t il = 0; il < c.counts.size(); ++il) {
      if (static_cast<std::int64_t>(c.counts[il].size()) != n_expert) {
        throw std::runtime_error("counts[" + std::to_string(il) + "] has " + std::to_string(c.counts[il].size()) +
                                 " experts, expected " + std::to_string(n_expert));
      }
    }
  } catch (const std::exception& e) {
    throw std::runtime_error("census " + path + ": " + e.what());
  }
  return c;
}

void Census::write(const std::string& path) const {
  nlohmann::json j;
  j["n_layer"] = counts.size();
  j["n_expert"] = counts.empty() ? 0 : counts[0].size();
  j["counts"] = counts;
  try {
    fileio::write_file_atomic(path, j.dump() + "\n");
  } catch (const std::system_error& e) {
    throw std::runtime_error(std::string("cannot write census: ") + e.what());
  }
}

std::string default_census_path(const std::string& model_path) { return model_path + ".census.json"; }

CensusRecorder::CensusRecorder(std::int64_t n_layer, std::int64_t n_expert, std::string path)
    : n_layer_(n_layer), n_expert_(n_expert), path_(std::move(path)), last_flush_(std::chrono::steady_clock::now()) {
  if (n_layer < 1 || n_expert < 1) {
    throw std::invalid_argument("census recorder: needs >= 1 layer and >= 1 expert (got " + std::to_string(n_layer) +
                                " x " + std::to_string(n_expert) + ")");
  }
  pending_.assign(static_cast<std::size_t>(n_layer * n_expert), 0);
}

namespace {

// An flock on "<path>.lock" for the read-add-write of one flush: without it two processes that
// read the same old file would each write old + their own, and one's counts would be lost.
class FlushLock {
 public:
  explicit FlushLock(const std::string& path) : fd_(::open((path + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)) {
    if (fd_ < 0) {
      error_ = "cannot open " + path + ".lock: " + std::strerror(errno);
      return;
    }
    while (::flock(fd_, LOCK_EX) != 0) {
      if (errno != EINTR) {
        error_ = "cannot lock " + path + ".lock: " + std::strerror(errno);
        return;
      }
    }
  }
  ~FlushLock() {
    if (fd_ >= 0) ::close(fd_);   // closing releases the lock
  }
  FlushLock(const FlushLock&) = delete;
  FlushLock& operator=(const FlushLock&) = delete;
  const std::string& error() const { return error_; }

 private:
  int fd_;
  std::string error_;
};

}  // namespace

CensusFlush CensusRecorder::flush() {
  CensusFlush r;
  last_flush_ = std::chrono::steady_clock::now();
  if (path_.empty()) return r;
  try {
    const FlushLock lock(path_);
    if (!lock.error().empty()) {
      r.error = lock.error();
      return r;
    }
    Census merged = Census::uniform(n_layer_, n_expert_);
    std::error_code ec;
    if (std::filesystem::exists(path_, ec)) {
      try {
        merged = Census::read(path_, n_layer_, n_expert_);
      } catch (const std::exception& e) {
        r.replaced = e.what();
        merged = Census::uniform(n_layer_, n_expert_);
      }
    }
    std::uint64_t added = 0;
    for (std::int64_t il = 0; il < n_layer_; ++il) {
      for (std::int64_t e = 0; e < n_expert_; ++e) {
        const std::uint64_t n = pending_[static_cast<std::size_t>(il * n_expert_ + e)];
        merged.counts[static_cast<std::size_t>(il)][static_cast<std::size_t>(e)] += n;
        added += n;
      }
    }
    merged.write(path_);
    // Only now forget them: a failed write keeps them for the next flush.
    std::fill(pending_.begin(), pending_.end(), 0);
    any_pending_ = false;
    flushed_total_ += added;
    r.wrote = true;
  } catch (const std::exception& e) {
    r.error = e.what();
  }
  return r;
}

CensusFlush CensusRecorder::flush_if_due(std::chrono::steady_clock::duration every) {
  if (!any_pending_ || path_.empty() || std::chrono::steady_clock::now() - last_flush_ < every) return {};
  return flush();
}

}  // namespace moraine::group
