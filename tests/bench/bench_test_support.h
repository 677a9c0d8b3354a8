// Shared pieces of the bench tests that run moraine-bench as a process: a scratch directory and
// reading back what the process wrote.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace moraine::bench_test {

inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// A fresh directory under the temp dir, removed at the end unless the test failed (its logs
// then stay for reading).
struct Scratch {
  std::filesystem::path dir;
  explicit Scratch(const std::string& prefix) {
    dir = std::filesystem::temp_directory_path() / (prefix + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
  }
  ~Scratch() {
    if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir);
  }
};

}  // namespace moraine::bench_test
