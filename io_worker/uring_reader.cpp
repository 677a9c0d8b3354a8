#include "io_worker/uring_reader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <limits>

namespace moraine::io {

namespace {

using Clock = std::chrono::steady_clock;

std::uint64_t align_down(std::uint64_t x) { return x & ~std::uint64_t{UringReader::kAlign - 1}; }
std::uint64_t align_up(std::uint64_t x) { return align_down(x + UringReader::kAlign - 1); }
bool aligned(std::uint64_t x) { return x % UringReader::kAlign == 0; }

std::string range_text(std::uint64_t offset, std::uint64_t length) {
  return "[" + std::to_string(offset) + ", +" + std::to_string(length) + ")";
}

// A range is read as up to three segments: an unaligned head and tail through the bounce buffer
// and an aligned body straight into the destination (O_DIRECT, same 4 KiB phase), or as one
// segment, bounced (O_DIRECT, different phase) or straight (buffered file).
struct Segment {
  std::uint32_t range = 0;
  std::uint64_t start = 0, end = 0;   // file bytes this segment delivers
  bool bounce = false;
};

void split_range(const ReadRange& r, std::uint32_t index, bool direct, std::vector<Segment>& out) {
  const std::uint64_t end = r.offset + r.length;
  if (r.length == 0) return;
  if (!direct) {
    out.push_back({index, r.offset, end, false});
    return;
  }
  const auto dest_phase = reinterpret_cast<std::uintptr_t>(r.dest) % UringReader::kAlign;
  const std::uint64_t body0 = align_up(r.offset), body1 = align_down(end);
  if (dest_phase != r.offset % UringReader::kAlign || body0 >= body1) {
    out.push_back({index, r.offset, end, true});
    return;
  }
  if (r.offset < body0) out.push_back({index, r.offset, body0, true});
  out.push_back({index, body0, body1, false});
  if (body1 < end) out.push_back({index, body1, end, true});
}

}  // namespace

// One read in flight. Piece i owns bounce slot i.
struct UringReader::Piece {
  std::uint32_t range = 0;
  std::uint64_t read_start = 0;   // file offset of the first byte this piece reads
  std::uint64_t read_end = 0;     // one past the last byte it asks for (may pass EOF when bounced)
  std::uint64_t need_end = 0;     // it is complete once the file bytes up to here arrived
  std::uint64_t got = 0;          // bytes arrived so far, from read_start
  std::uint64_t copy_start = 0;   // bounced: file bytes [copy_start, need_end) go to the destination
  std::byte* buffer = nullptr;    // where read_start lands (destination or bounce slot)
  bool bounce = false;
};

UringReader::UringReader(const std::vector<std::string>& paths, UringReaderOptions options) : options_(options) {
  if (paths.empty()) throw IoError("UringReader: no files to read");
  if (options_.queue_depth < 1 || options_.queue_depth > 4096) {
    throw IoError("UringReader: queue depth " + std::to_string(options_.queue_depth) + " is outside [1, 4096]");
  }
  if (options_.chunk_bytes == 0 || options_.chunk_bytes > (std::size_t{1} << 30)) {
    throw IoError("UringReader: chunk size " + std::to_string(options_.chunk_bytes) + " is outside [1, 1 GiB]");
  }
  options_.chunk_bytes = static_cast<std::size_t>(align_up(options_.chunk_bytes));
  try {
    bounce_bytes_ = std::size_t{options_.queue_depth} * options_.chunk_bytes;
    void* p = mmap(nullptr, bounce_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      const std::string why = std::strerror(errno);
      throw IoError("UringReader: cannot map a " + std::to_string(bounce_bytes_ >> 20) + " MiB bounce buffer: " + why);
    }
    bounce_ = static_cast<std::byte*>(p);
    for (const std::string& path : paths) open_file(path);
    // Containers often forbid io_uring (Docker's default seccomp profile, kernel.io_uring_disabled):
    // then the same pieces are read with pread, one at a time, and describe() says so, rather
    // than the group failing to start.
    const int rc = options_.use_uring ? io_uring_queue_init(options_.queue_depth, &ring_, 0) : -ENOSYS;
    if (rc < 0) {
      ring_error_ = options_.use_uring ? std::string("io_uring_queue_init: ") + std::strerror(-rc) : "disabled by option";
    } else {
      ring_ready_ = true;
      // A registered buffer saves the kernel pinning the bounce pages on every read. It counts
      // against RLIMIT_MEMLOCK: when that refuses, plain reads into the same memory still work.
      iovec iov{bounce_, bounce_bytes_};
      registered_ = io_uring_register_buffers(&ring_, &iov, 1) == 0;
    }
  } catch (...) {
    release();
    throw;
  }
}

UringReader::~UringReader() { release(); }

void UringReader::release() noexcept {
  if (ring_ready_) io_uring_queue_exit(&ring_);
  ring_ready_ = false;
  for (File& f : files_) {
    if (f.fd >= 0) ::close(f.fd);
    f.fd = -1;
  }
  if (bounce_ != nullptr) munmap(bounce_, bounce_bytes_);
  bounce_ = nullptr;
}

void UringReader::open_file(const std::string& path) {
  File f;
  f.path = path;
  f.direct = options_.direct;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (f.direct ? O_DIRECT : 0));
  if (f.fd < 0 && f.direct && errno == EINVAL) {   // the filesystem has no O_DIRECT (e.g. older tmpfs)
    f.direct = false;
    f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  }
  if (f.fd < 0) throw IoError(path + ": cannot open: " + std::strerror(errno));
  files_.push_back(f);   // closed by the destructor from here on
  File& file = files_.back();
  struct stat st {};
  if (fstat(file.fd, &st) != 0) throw IoError(path + ": fstat failed: " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw IoError(path + ": not a regular file");
  file.bytes = static_cast<std::uint64_t>(st.st_size);
  // Some filesystems accept O_DIRECT at open and refuse the reads: try one aligned block.
  if (file.direct && file.bytes > 0 && pread(file.fd, bounce_, kAlign, 0) < 0) {
    if (errno != EINVAL) throw IoError(path + ": first read failed: " + std::strerror(errno));
    ::close(file.fd);
    file.direct = false;
    file.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (file.fd < 0) throw IoError(path + ": cannot reopen without O_DIRECT: " + std::strerror(errno));
  }
}

bool UringReader::all_direct() const {
  for (const File& f : files_) {
    if (!f.direct) return false;
  }
  return true;
}

std::string UringReader::describe() const {
  std::string s;
  for (const File& f : files_) {
    s += f.path + " (" + std::to_string(f.bytes) + " bytes, " + (f.direct ? "O_DIRECT" : "buffered") + "); ";
  }
  if (!ring_ready_) s += "io_uring unavailable (" + ring_error_ + "): synchronous pread, one read at a time; ";
  s += "queue depth " + std::to_string(options_.queue_depth) + ", chunk " + std::to_string(options_.chunk_bytes >> 10) +
       " KiB, bounce buffer " + std::to_string(bounce_bytes_ >> 10) + " KiB " +
       (registered_ ? "registered" : ring_ready_ ? "not registered (RLIMIT_MEMLOCK?)" : "");
  return s;
}

void UringReader::fail_range(const ReadRange& r, const std::string& why) const {
  const std::string file = r.file_index < files_.size() ? files_[r.file_index].path
                                                         : "file index " + std::to_string(r.file_index);
  throw IoError(file + ": read of " + range_text(r.offset, r.length) + ": " + why);
}

void UringReader::check_range(const ReadRange& r, std::size_t index) const {
  const std::string which = "range " + std::to_string(index);
  if (r.file_index >= files_.size()) {
    fail_range(r, which + " names file index " + std::to_string(r.file_index) + " but there are " +
                      std::to_string(files_.size()) + " files");
  }
  const std::uint64_t size = files_[r.file_index].bytes;
  if (r.length > size || r.offset > size - r.length) {
    fail_range(r, which + " runs past the end of the file (" + std::to_string(size) + " bytes)");
  }
  if (r.length > 0 && r.dest == nullptr) fail_range(r, which + " has no destination");
}

std::uint64_t UringReader::read(std::span<const ReadRange> ranges, std::span<double> latency_us) {
  if (!latency_us.empty() && latency_us.size() != ranges.size()) {
    throw IoError("UringReader::read: " + std::to_string(latency_us.size()) + " latency slots for " +
                  std::to_string(ranges.size()) + " ranges");
  }
  if (ranges.size() > std::numeric_limits<std::uint32_t>::max()) throw IoError("UringReader::read: too many ranges");
  std::vector<Segment> segments;
  segments.reserve(ranges.size());
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    check_range(ranges[i], i);
    split_range(ranges[i], static_cast<std::uint32_t>(i), files_[ranges[i].file_index].direct, segments);
  }
  // Pieces per range, so a range's latency ends when its last piece lands.
  const std::uint64_t chunk = options_.chunk_bytes;
  std::vector<std::uint64_t> left(ranges.size(), 0);
  std::vector<Clock::time_point> started(ranges.size());
  for (const Segment& s : segments) {
    const std::uint64_t a = s.bounce ? align_down(s.start) : s.start, b = s.bounce ? align_up(s.end) : s.end;
    left[s.range] += (b - a + chunk - 1) / chunk;
  }
  std::uint64_t delivered = 0;
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    if (left[i] == 0) {   // empty range: nothing to wait for
      ++stats_.requests;
      if (!latency_us.empty()) latency_us[i] = 0;
    }
  }

  std::vector<Piece> pieces(options_.queue_depth);
  std::vector<std::uint32_t> free_pieces;
  for (std::uint32_t i = options_.queue_depth; i-- > 0;) free_pieces.push_back(i);
  std::size_t seg = 0;
  std::uint64_t seg_pos = segments.empty() ? 0 : (segments[0].bounce ? align_down(segments[0].start) : segments[0].start);
  unsigned in_flight = 0;
  std::string error;   // the first failure; nothing new is issued after it

  std::vector<std::pair<std::uint32_t, int>> sync_done;   // without io_uring: finished preads
  const auto submit_piece = [&](std::uint32_t id) {
    Piece& p = pieces[id];
    const File& f = files_[ranges[p.range].file_index];
    const std::uint64_t at = p.read_start + p.got;
    const auto len = static_cast<unsigned>(p.read_end - at);
    std::byte* buf = p.buffer + p.got;
    ++stats_.reads;
    if (!ring_ready_) {
      const ssize_t n = pread(f.fd, buf, len, static_cast<off_t>(at));
      sync_done.emplace_back(id, n < 0 ? -errno : static_cast<int>(n));
      return;
    }
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);   // never null: at most queue_depth pieces exist
    if (p.bounce && registered_) {
      io_uring_prep_read_fixed(sqe, f.fd, buf, len, at, 0);
    } else {
      io_uring_prep_read(sqe, f.fd, buf, len, at);
    }
    io_uring_sqe_set_data64(sqe, id);
  };
  const auto next_piece = [&](std::uint32_t id) {
    const Segment& s = segments[seg];
    const ReadRange& r = ranges[s.range];
    Piece& p = pieces[id];
    p = Piece{};
    p.range = s.range;
    p.bounce = s.bounce;
    p.read_start = seg_pos;
    if (s.bounce) {
      p.read_end = std::min(seg_pos + chunk, align_up(s.end));
      p.copy_start = std::max(seg_pos, s.start);
      p.need_end = std::min(p.read_end, s.end);
      p.buffer = bounce_ + std::size_t{id} * chunk;
    } else {
      p.read_end = std::min(seg_pos + chunk, s.end);
      p.need_end = p.read_end;
      p.buffer = r.dest + (seg_pos - r.offset);
    }
    if (started[s.range] == Clock::time_point{}) started[s.range] = Clock::now();
    seg_pos = p.read_end;
    if (seg_pos >= (s.bounce ? align_up(s.end) : s.end) && ++seg < segments.size()) {
      seg_pos = segments[seg].bounce ? align_down(segments[seg].start) : segments[seg].start;
    }
    submit_piece(id);
    ++in_flight;
  };
  const auto finish_piece = [&](std::uint32_t id) {
    free_pieces.push_back(id);
    --in_flight;
  };
  const auto complete = [&](std::uint32_t id, int res) {
    Piece& p = pieces[id];
    const ReadRange& r = ranges[p.range];
    const File& f = files_[r.file_index];
    const std::uint64_t at = p.read_start + p.got;
    if (res == -EAGAIN || res == -EINTR) {
      if (!error.empty()) return finish_piece(id);
      return submit_piece(id);
    }
    if (res < 0) {
      if (error.empty()) {
        error = f.path + ": read of " + range_text(r.offset, r.length) + " failed at file offset " +
                std::to_string(at) + ": " + std::strerror(-res);
      }
      return finish_piece(id);
    }
    p.got += static_cast<std::uint64_t>(res);
    if (p.read_start + p.got < p.need_end) {
      // Short read. res == 0 is the end of the file: it shrank after it was opened. An O_DIRECT
      // continuation must start on a block boundary, which only the end of the file breaks.
      if (res == 0 || (f.direct && !aligned(p.read_start + p.got))) {
        if (error.empty()) {
          error = f.path + ": read of " + range_text(r.offset, r.length) + " hit the end of the file at offset " +
                  std::to_string(p.read_start + p.got) + " (the file was " + std::to_string(f.bytes) +
                  " bytes when opened: truncated since?)";
        }
        return finish_piece(id);
      }
      ++stats_.short_reads;
      if (!error.empty()) return finish_piece(id);
      return submit_piece(id);
    }
    std::uint64_t bytes = p.need_end - p.read_start;
    if (p.bounce) {
      bytes = p.need_end - p.copy_start;
      std::memcpy(r.dest + (p.copy_start - r.offset), p.buffer + (p.copy_start - p.read_start), bytes);
      stats_.bounce_bytes += bytes;
    }
    delivered += bytes;
    stats_.bytes += bytes;
    if (--left[p.range] == 0) {
      ++stats_.requests;
      if (!latency_us.empty()) {
        latency_us[p.range] = std::chrono::duration<double, std::micro>(Clock::now() - started[p.range]).count();
      }
    }
    finish_piece(id);
  };

  while (true) {
    while (error.empty() && seg < segments.size() && !free_pieces.empty()) {
      const std::uint32_t id = free_pieces.back();
      free_pieces.pop_back();
      next_piece(id);
    }
    if (in_flight == 0) break;
    if (!ring_ready_) {
      std::vector<std::pair<std::uint32_t, int>> done;
      done.swap(sync_done);
      for (const auto& [id, res] : done) complete(id, res);   // may read again into sync_done
      continue;
    }
    const int rc = io_uring_submit_and_wait(&ring_, 1);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
      // The ring itself failed: the reads already submitted may still land, so this reader is
      // unusable; say so rather than return with buffers being written.
      throw IoError("UringReader: io_uring_submit_and_wait failed: " + std::string(std::strerror(-rc)) +
                    " with " + std::to_string(in_flight) + " reads in flight");
    }
    io_uring_cqe* cqe = nullptr;
    while (io_uring_peek_cqe(&ring_, &cqe) == 0) {
      const auto id = static_cast<std::uint32_t>(io_uring_cqe_get_data64(cqe));
      const int res = cqe->res;
      io_uring_cqe_seen(&ring_, cqe);
      complete(id, res);
    }
  }
  if (!error.empty()) throw IoError(error);
  return delivered;
}

}  // namespace moraine::io
