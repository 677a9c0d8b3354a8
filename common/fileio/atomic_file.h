// Every file the engine writes goes through here: the bytes go to a temp file beside the target
// (unique per process and call), which is fsync'd, renamed over the target, and the directory
// fsync'd. A reader (or a restart after a kill or a power cut) sees the complete old file or the
// complete new one, never a torn one. A writer killed mid-write leaves only its temp file
// (PATH.tmp.PID.N), which nothing reads.
//
//   moraine::fileio::write_file_atomic(path, json.dump());     // whole content at once
//   moraine::fileio::AtomicFile f(path);  f.write(p, n); ...;  f.commit();   // streamed (GGUF)
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace moraine::fileio {

// Owns the temp file until commit(); destroyed uncommitted (an exception), it removes the temp
// file and leaves the target as it was. Errors throw std::system_error naming the file and step.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path, unsigned mode = 0644);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  void write(const void* data, std::uint64_t n);
  void write(std::string_view s) { write(s.data(), s.size()); }
  std::uint64_t written() const { return written_; }
  const std::string& temp_path() const { return tmp_; }
  // fsync, close, rename over the target, fsync the directory. Call once.
  void commit();

 private:
  [[noreturn]] void fail(const std::string& what) const;
  std::string path_, tmp_;
  int fd_ = -1;
  std::uint64_t written_ = 0;
  bool committed_ = false;
};

void write_file_atomic(const std::string& path, std::string_view content, unsigned mode = 0644);

}  // namespace moraine::fileio
