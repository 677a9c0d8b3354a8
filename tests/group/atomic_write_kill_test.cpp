// Nothing written is lost (issue 31 item 7): a writer SIGKILLed at a random point leaves the
// complete old file or the complete new one, never a torn one. Each case forks a child that
// writes version 1, 2, 3, ... of one file through a real writer of the engine (the shared
// helper itself, the census recorder the gpu_worker flushes, the placement plan and the group
// manifest the coordinator writes, the GGUF writer moraine-convert / -quantize / -synth use),
// kills it after a random delay (fixed seed), and reads the file back with the engine's reader.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/fileio/atomic_file.h"
#include "common/gguf/gguf.h"
#include "coordinator/census.h"
#include "coordinator/group_layout.h"
#include "coordinator/placement.h"

namespace moraine {
namespace {

namespace fs = std::filesystem;

std::string make_temp_dir() {
  std::string tmpl = (fs::temp_directory_path() / "moraine-atomic-XXXXXX").string();
  if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  return tmpl;
}

struct KillCounts {
  int kills = 0;
  int mid_write = 0;        // the kill left a temp file: it landed between create and rename
  int new_versions = 0;     // the file held a later version than at the previous kill
  std::uint64_t last_version = 0;
};

// Forks `iterations` writers; each writes versions last+1, last+2, ... with write(path, v) until
// SIGKILLed 0..max_delay_us after it says (through a pipe) that it starts writing. After each kill read(path) must return the version the file
// holds (it fails the test itself for a torn or unreadable file), never an older one than before.
KillCounts kill_writers(const std::string& dir, const std::string& path, int iterations, int max_delay_us,
                        const std::function<void(const std::string&, std::uint64_t)>& write,
                        const std::function<std::uint64_t(const std::string&)>& read) {
  write(path, 0);
  KillCounts c;
  std::mt19937 rng(31);
  std::uniform_int_distribution<int> delay_us(0, max_delay_us);
  for (int it = 0; it < iterations; ++it) {
    const std::uint64_t base = c.last_version;
    int ready[2];
    if (::pipe(ready) != 0) throw std::runtime_error("pipe failed");
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      ::close(ready[0]);
      if (::write(ready[1], "r", 1) != 1) std::_Exit(5);
      try {
        for (std::uint64_t v = base + 1;; ++v) write(path, v);
      } catch (...) {
        std::_Exit(3);
      }
    }
    // Timed from the child's start of writing, not from fork (which took up to ~1 ms here):
    // then the kills fall inside the write loop.
    ::close(ready[1]);
    char byte = 0;
    if (::read(ready[0], &byte, 1) != 1) ADD_FAILURE() << "writer did not start";
    ::close(ready[0]);
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us(rng)));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)) {
      ADD_FAILURE() << "writer ended by itself (status " << status << ") at iteration " << it;
      break;
    }
    ++c.kills;
    bool temp_left = false;
    for (const auto& e : fs::directory_iterator(dir)) {
      const std::string name = e.path().filename().string();
      if (name.find(".tmp.") != std::string::npos) {
        temp_left = true;
        fs::remove(e.path());
      }
    }
    c.mid_write += temp_left;
    const std::uint64_t v = read(path);
    if (testing::Test::HasFailure()) {
      ADD_FAILURE() << "torn file after kill " << it << " (delay seed 31)";
      break;
    }
    EXPECT_GE(v, c.last_version) << "an older version came back after kill " << it;
    c.new_versions += v > c.last_version;
    c.last_version = v;
  }
  std::printf("[ counts ] %s: %d kills, %d mid-write (temp file left), %d saw a newer version, last version %llu\n",
              fs::path(path).filename().c_str(), c.kills, c.mid_write, c.new_versions,
              static_cast<unsigned long long>(c.last_version));
  return c;
}

// The kills must land inside writes, and writes must complete between kills, or the test
// proves nothing.
void expect_both_outcomes(const KillCounts& c, int iterations) {
  EXPECT_EQ(c.kills, iterations);
  EXPECT_GT(c.mid_write, 0);
  EXPECT_GT(c.new_versions, 0);
}

constexpr int kIterations = 150;
constexpr int kMaxDelayUs = 4000;

// 256 KiB, a header line with the version then bytes derived from it: any mix of two versions,
// or a short file, fails the comparison.
std::string raw_content(std::uint64_t v) {
  std::string s = "version " + std::to_string(v) + "\n";
  const std::size_t n = 256 * 1024;
  s.reserve(n);
  for (std::size_t i = s.size(); i < n; ++i) s.push_back(static_cast<char>((v * 131 + i * 7) & 0xff));
  return s;
}

TEST(AtomicWriteKill, SharedHelperNeverLeavesATornFile) {
  const std::string dir = make_temp_dir();
  const std::string path = dir + "/blob.bin";
  const KillCounts c = kill_writers(
      dir, path, kIterations, kMaxDelayUs, [](const std::string& p, std::uint64_t v) { fileio::write_file_atomic(p, raw_content(v)); },
      [](const std::string& p) -> std::uint64_t {
        std::ifstream in(p, std::ios::binary);
        const std::string got((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        std::uint64_t v = 0;
        if (std::sscanf(got.c_str(), "version %llu", reinterpret_cast<unsigned long long*>(&v)) != 1) {
          ADD_FAILURE() << p << ": no version line (" << got.size() << " bytes)";
          return 0;
        }
        EXPECT_TRUE(got == raw_content(v)) << p << ": " << got.size() << " bytes, not version " << v << " whole";
        return v;
      });
  expect_both_outcomes(c, kIterations);
  fs::remove_all(dir);
}

TEST(AtomicWriteKill, CensusFlushNeverLeavesATornFile) {
  // The gpu_worker's writer: a CensusRecorder that records one step (every expert once) and
  // flushes (read the file, add, write), so version v is the file with every count == v.
  constexpr std::int64_t kLayers = 48, kExperts = 128;
  const std::string dir = make_temp_dir();
  const std::string path = dir + "/model.census.json";
  std::vector<std::int32_t> ids(kExperts);
  for (std::int32_t e = 0; e < kExperts; ++e) ids[static_cast<std::size_t>(e)] = e;
  const KillCounts c = kill_writers(
      dir, path, kIterations, kMaxDelayUs,
      [&](const std::string& p, std::uint64_t v) {
        if (v == 0) {
          group::Census::uniform(kLayers, kExperts).write(p);
          return;
        }
        group::CensusRecorder r(kLayers, kExperts, p);
        for (std::int64_t il = 0; il < kLayers; ++il) r.add(il, ids.data(), kExperts);
        const group::CensusFlush f = r.flush();
        if (!f.wrote || !f.replaced.empty()) std::_Exit(4);   // a flush that found a torn file says so here
      },
      [&](const std::string& p) -> std::uint64_t {
        const group::Census cs = group::Census::read(p, kLayers, kExperts);
        const std::uint64_t v = cs.counts[0][0];
        for (const auto& layer : cs.counts) {
          for (std::uint64_t n : layer) {
            if (n != v) {
              ADD_FAILURE() << p << ": counts differ (" << n << " vs " << v << ")";
              return v;
            }
          }
        }
        return v;
      });
  expect_both_outcomes(c, kIterations);
  fs::remove_all(dir);
}

TEST(AtomicWriteKill, PlacementPlanNeverLeavesATornFile) {
  group::ModelSizes s;
  s.n_layer = 48;
  s.n_expert = 128;
  s.n_expert_used = 8;
  s.expert_bytes.assign(48, 1 << 20);
  s.expert_slot_bytes.assign(48, 1 << 20);
  const std::string dir = make_temp_dir();
  const std::string path = dir + "/placement.json";
  const KillCounts c = kill_writers(
      dir, path, kIterations, kMaxDelayUs,
      [&](const std::string& p, std::uint64_t v) {
        group::PlacementPlan plan;
        plan.n_layer = s.n_layer;
        plan.n_expert = s.n_expert;
        plan.tiers.assign(static_cast<std::size_t>(s.n_layer * s.n_expert), group::Tier::kRam);
        plan.dense_bytes = v;
        plan.write(p);
      },
      [&](const std::string& p) -> std::uint64_t { return group::PlacementPlan::read(p, s).dense_bytes; });
  expect_both_outcomes(c, kIterations);
  fs::remove_all(dir);
}

TEST(AtomicWriteKill, GroupManifestNeverLeavesATornFile) {
  const std::string dir = make_temp_dir();
  const std::string path = dir + "/group.json";
  const KillCounts c = kill_writers(
      dir, path, kIterations, kMaxDelayUs,
      [](const std::string& p, std::uint64_t v) {
        group::GroupManifest m;
        m.model_path = std::string(4096, 'm');   // a longer file: more of each write's time in the write
        m.coordinator_start_ticks = v;
        m.max_tokens = static_cast<int>(1 + v % 1000);
        m.write(p);
      },
      [](const std::string& p) -> std::uint64_t {
        const group::GroupManifest m = group::GroupManifest::read(p);
        EXPECT_EQ(m.model_path.size(), 4096u);
        EXPECT_EQ(static_cast<std::uint64_t>(m.max_tokens), 1 + m.coordinator_start_ticks % 1000);
        return m.coordinator_start_ticks;
      });
  expect_both_outcomes(c, kIterations);
  fs::remove_all(dir);
}

TEST(AtomicWriteKill, GgufWriterNeverLeavesATornFile) {
  // moraine-convert, moraine-quantize and moraine-synth write through GgufWriter (streamed).
  const std::string dir = make_temp_dir();
  const std::string path = dir + "/out.gguf";
  auto data_of = [](std::uint64_t v) {
    std::vector<std::uint8_t> d(512 * 1024);
    for (std::size_t i = 0; i < d.size(); ++i) d[i] = static_cast<std::uint8_t>((v * 17 + i * 5) & 0xff);
    return d;
  };
  const KillCounts c = kill_writers(
      dir, path, kIterations, kMaxDelayUs,
      [&](const std::string& p, std::uint64_t v) {
        const std::vector<std::uint8_t> d = data_of(v);
        gguf::GgufWriter w;
        w.set("test.version", gguf::Value::u64(v));
        w.add_tensor("blob", {static_cast<std::int64_t>(d.size())}, TensorType::I8, d.data(), d.size());
        w.write(p);
      },
      [&](const std::string& p) -> std::uint64_t {
        const gguf::GgufFile f = gguf::GgufFile::open(p);
        const std::uint64_t v = *f.find("test.version")->as_u64();
        const std::vector<std::uint8_t> want = data_of(v);
        const gguf::TensorInfo* t = f.find_tensor("blob");
        EXPECT_TRUE(t != nullptr && t->n_bytes == want.size() && std::equal(want.begin(), want.end(), t->data))
            << p << ": tensor data is not version " << v << "'s";
        return v;
      });
  expect_both_outcomes(c, kIterations);
  fs::remove_all(dir);
}

TEST(AtomicFile, UncommittedLeavesTheOldFileAndNoTemp) {
  const std::string dir = make_temp_dir();
  const std::string path = dir + "/f.txt";
  fileio::write_file_atomic(path, "old\n");
  {
    fileio::AtomicFile f(path);
    f.write("new, never committed\n");
    EXPECT_TRUE(fs::exists(f.temp_path()));
  }
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, "old");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);
  EXPECT_EQ(fs::status(path).permissions() & fs::perms::others_write, fs::perms::none);
  fs::remove_all(dir);
}

TEST(AtomicFile, ErrorsNameTheFileAndTheStep) {
  try {
    fileio::write_file_atomic("/nonexistent-dir-moraine/f.json", "x");
    FAIL() << "no error";
  } catch (const std::system_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir-moraine/f.json.tmp."), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cannot create"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moraine
