// Shell helpers for tests that run the project's tools (moraine-convert, moraine-quantize, ...).
#pragma once
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>

namespace moraine::test_support {

// Runs `cmd` through the shell: (exit status or -1, its stdout, with stderr unless merge_stderr is
// false, when stderr is dropped).
inline std::pair<int, std::string> run_command(const std::string& cmd, bool merge_stderr = true) {
  std::string out;
  FILE* p = popen((cmd + (merge_stderr ? " 2>&1" : " 2>/dev/null")).c_str(), "r");
  if (p == nullptr) return {-1, "popen failed: " + cmd};
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// A path in single quotes for the shell (test paths hold no quote characters).
inline std::string quoted(const std::filesystem::path& p) {
  std::string s = "'";   // appended piecewise: "'" + str + "'" trips GCC 12's -Wrestrict
  s += p.string();
  s += '\'';
  return s;
}

}  // namespace moraine::test_support
