#pragma once
// Errors from shared-memory segments, layouts and doorbells. The message names the segment or
// region and the system call that failed, so a start-up failure is diagnosable from the log alone.
#include <stdexcept>
#include <string>

namespace moraine::shm {

class ShmError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// "<what>: <strerror(errno)>" for a failed system call.
[[noreturn]] void throw_errno(const std::string& what, int err);

}  // namespace moraine::shm
