// moraine-io-bench end to end on a small fresh file: every row reads what it should, the JSON
// has the rows it promises, and a missing file is a clear error.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace {

namespace fs = std::filesystem;

std::pair<int, std::string> run(const std::string& cmd) {
  std::string out;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  char buf[4096];
  std::size_t n = 0;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

const std::string kBench = (fs::path(MORAINE_BUILD_DIR) / "io_worker" / "moraine-io-bench").string();

TEST(IoBench, JsonRowsReadEveryRange) {
  const fs::path file = fs::temp_directory_path() / ("moraine-io-bench-test-" + std::to_string(getpid()));
  std::mt19937_64 rng(31);
  const std::uint64_t size = (24 << 20) + rng() % 4096;
  {
    std::ofstream out(file, std::ios::binary);
    for (std::uint64_t i = 0; i < size; i += 8) {
      const std::uint64_t x = rng();
      out.write(reinterpret_cast<const char*>(&x), static_cast<std::streamsize>(std::min<std::uint64_t>(8, size - i)));
    }
  }
  auto [rc, out] = run(kBench + " " + file.string() + " --json --repeat 1 --depths 1,8 --sizes-mib 1.5,4.5");
  fs::remove(file);
  ASSERT_EQ(rc, 0) << out;
  const nlohmann::json rows = nlohmann::json::parse(out);
  // Per size: pread and 2 depths, O_DIRECT and buffered.
  ASSERT_EQ(rows.size(), 2u * 2u * 3u) << out;
  for (const auto& r : rows) {
    const double mib = r["range_mib"].get<double>();
    const auto range = static_cast<std::uint64_t>(mib * 1048576);
    const std::uint64_t whole = (size - (4096 + 96)) / range;   // ranges that fit after --start
    EXPECT_EQ(r["bytes"].get<std::uint64_t>(), whole * range) << r.dump();
    EXPECT_GT(r["gb_per_s"].get<double>(), 0.0) << r.dump();
    EXPECT_GE(r["resident_before"].get<double>(), 0.0) << r.dump();
  }
}

TEST(IoBench, MissingFileIsAnError) {
  auto [rc, out] = run(kBench + " /nonexistent/model.gguf");
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("/nonexistent/model.gguf"), std::string::npos) << out;
}

}  // namespace
