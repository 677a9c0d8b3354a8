// Reads byte ranges of the model file(s) into memory with io_uring, several reads in flight.
// Files are opened with O_DIRECT when the filesystem allows it (bypassing the page cache: a
// model larger than RAM would otherwise evict itself), else buffered; direct_io() says which.
// O_DIRECT needs the file offset, the length and the memory address 4 KiB aligned: a range whose
// file offset and destination share the same 4 KiB phase is read straight into the destination
// (its unaligned head and tail through the bounce buffer); any other range is read as its
// 4 KiB-aligned bracket into a registered bounce buffer and copied out. Buffered files are read
// straight into the destination, whatever the alignment. Where io_uring is not allowed (some
// containers) the same reads go through pread, one at a time, and describe() says so.
#pragma once
#include <liburing.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace moraine::io {

// Every failure: names the file, the range (offset, length) and what went wrong.
class IoError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct UringReaderOptions {
  // Depth 32: NVMe drives want 32+ reads in flight to reach their rate (the dev box's virtual disk
  // read depth 16 within 6% of 64), and a prefill's read-ahead of a whole layer is hundreds of
  // chunks; 32 MiB of bounce memory. 1 MiB chunks sit in the flat 512 KiB-4 MiB range
  // (moraine-io-bench, docs/perf-log.md#io-uring-defaults).
  unsigned queue_depth = 32;            // reads in flight at most
  std::size_t chunk_bytes = 1 << 20;    // largest single read (rounded up to 4 KiB)
  bool direct = true;                   // try O_DIRECT (falls back to buffered per file)
  bool use_uring = true;                // false: synchronous pread (what it falls back to anyway)
};

struct ReadRange {
  std::uint32_t file_index = 0;   // index into the reader's files
  std::uint64_t offset = 0;       // byte offset in that file (any alignment)
  std::uint64_t length = 0;       // bytes to read (may be 0)
  std::byte* dest = nullptr;      // where they go (any alignment)
};

struct UringReaderStats {
  std::uint64_t bytes = 0;            // bytes delivered to destinations
  std::uint64_t requests = 0;         // ranges completed
  std::uint64_t reads = 0;            // io_uring reads submitted (chunks, retries of short reads)
  std::uint64_t bounce_bytes = 0;     // bytes read through the bounce buffer (then copied)
  std::uint64_t short_reads = 0;      // reads that returned less than asked and were continued
};

class UringReader {
 public:
  static constexpr std::size_t kAlign = 4096;

  // Opens every path (read-only); throws IoError naming a path that cannot be opened.
  UringReader(const std::vector<std::string>& paths, UringReaderOptions options = {});
  ~UringReader();
  UringReader(const UringReader&) = delete;
  UringReader& operator=(const UringReader&) = delete;

  // Reads every range; returns the bytes delivered. latency_us, when not empty, must have one
  // entry per range and receives, per range, the time from its first read's submission to its
  // last byte landing. Ranges are checked against the file sizes before any read is issued.
  // On a failed read no further reads are issued, the ones in flight are waited for, and an
  // IoError names the file, range and cause. Not thread-safe: one caller at a time.
  std::uint64_t read(std::span<const ReadRange> ranges, std::span<double> latency_us = {});

  std::size_t file_count() const { return files_.size(); }
  const std::string& path(std::size_t i) const { return files_.at(i).path; }
  std::uint64_t file_bytes(std::size_t i) const { return files_.at(i).bytes; }
  bool direct_io(std::size_t i) const { return files_.at(i).direct; }
  bool all_direct() const;
  // Whether the bounce buffer is registered with the ring (READ_FIXED) or plain (READ).
  bool bounce_registered() const { return registered_; }
  // False when io_uring could not be set up (or use_uring was off): reads go through pread.
  bool uring() const { return ring_ready_; }
  const UringReaderOptions& options() const { return options_; }
  // One line: files, O_DIRECT or buffered per file, depth, chunk, registered bounce buffer.
  std::string describe() const;
  const UringReaderStats& stats() const { return stats_; }

 private:
  struct File {
    std::string path;
    int fd = -1;
    std::uint64_t bytes = 0;
    bool direct = false;
  };
  struct Piece;   // one read in flight (uring_reader.cpp)

  void open_file(const std::string& path);
  void release() noexcept;
  void check_range(const ReadRange& r, std::size_t index) const;
  [[noreturn]] void fail_range(const ReadRange& r, const std::string& why) const;

  UringReaderOptions options_;
  std::vector<File> files_;
  io_uring ring_{};
  bool ring_ready_ = false;
  std::string ring_error_;            // why there is no ring
  std::byte* bounce_ = nullptr;       // queue_depth slots of chunk_bytes, 4 KiB aligned
  std::size_t bounce_bytes_ = 0;
  bool registered_ = false;
  UringReaderStats stats_;
};

}  // namespace moraine::io
