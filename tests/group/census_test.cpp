// The popularity census the gpu_worker records (coordinator/census.h): counts of random routings
// (fixed seeds, invalid ids mixed in) counted independently here and compared with what the file
// holds after flushes - two recorders, two processes at once, repeated flushes, a corrupt or
// mismatched file, a path that cannot be written yet - and then the placement planned from that
// file puts each layer's most routed experts in VRAM.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include <nlohmann/json.hpp>

#include "coordinator/census.h"
#include "coordinator/placement.h"
#include "tests/group/group_harness.h"

namespace moraine::group {
namespace {

namespace fs = std::filesystem;
using Counts = std::vector<std::vector<std::uint64_t>>;

// One layer step of routing: n_tokens x k ids, each token's k distinct, drawn with a skew (a
// per-layer hot set) so counts differ; `bad` of them replaced by out-of-range ids.
std::vector<std::int32_t> random_routing(std::mt19937_64& rng, std::int64_t n_expert, std::int64_t k, std::int64_t n_tokens,
                                         std::int64_t bad) {
  std::vector<std::int32_t> ids;
  std::vector<std::int32_t> pool(static_cast<size_t>(n_expert));
  std::iota(pool.begin(), pool.end(), 0);
  for (std::int64_t t = 0; t < n_tokens; ++t) {
    // Weighted pick without replacement: expert e has weight 1 / (1 + e % 7), so low residues are hot.
    std::vector<std::int32_t> left = pool;
    for (std::int64_t s = 0; s < k; ++s) {
      double total = 0;
      for (std::int32_t e : left) total += 1.0 / (1 + e % 7);
      double u = std::uniform_real_distribution<double>(0, total)(rng);
      size_t i = 0;
      for (; i + 1 < left.size(); ++i) {
        u -= 1.0 / (1 + left[i] % 7);
        if (u <= 0) break;
      }
      ids.push_back(left[i]);
      left.erase(left.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  for (std::int64_t b = 0; b < bad && !ids.empty(); ++b) {
    const size_t at = rng() % ids.size();
    ids[at] = rng() % 2 ? static_cast<std::int32_t>(-1 - static_cast<std::int64_t>(rng() % 5))
                        : static_cast<std::int32_t>(n_expert + static_cast<std::int64_t>(rng() % 5));
  }
  return ids;
}

void count_into(Counts& c, std::int64_t layer, const std::vector<std::int32_t>& ids, std::uint64_t& invalid) {
  for (std::int32_t e : ids) {
    if (e < 0 || e >= static_cast<std::int64_t>(c[static_cast<size_t>(layer)].size())) {
      ++invalid;
    } else {
      ++c[static_cast<size_t>(layer)][static_cast<size_t>(e)];
    }
  }
}

Counts zeros(std::int64_t L, std::int64_t E) { return Census::uniform(L, E).counts; }

// Records `steps` random layer steps into rec and into expected.
void record_steps(std::mt19937_64& rng, CensusRecorder& rec, Counts& expected, std::uint64_t& invalid, int steps, std::int64_t k) {
  for (int s = 0; s < steps; ++s) {
    const std::int64_t layer = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(rec.n_layer()));
    const std::int64_t n_tokens = 1 + static_cast<std::int64_t>(rng() % 6);
    const auto ids = random_routing(rng, rec.n_expert(), k, n_tokens, static_cast<std::int64_t>(rng() % 3));
    rec.add(layer, ids.data(), static_cast<std::int64_t>(ids.size()));
    count_into(expected, layer, ids, invalid);
  }
}

TEST(Census, TwoRecordersMergeToTheSumAndNothingIsCountedTwice) {
  std::mt19937_64 rng(20261129);
  for (int trial = 0; trial < 10; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const std::int64_t L = 1 + static_cast<std::int64_t>(rng() % 6), E = 4 + static_cast<std::int64_t>(rng() % 60);
    const std::int64_t k = 1 + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(std::min<std::int64_t>(E, 8)));
    const std::string path = group_test::temp_dir("census") + "/m.gguf.census.json";
    CensusRecorder a(L, E, path), b(L, E, path);
    Counts expected = zeros(L, E);
    std::uint64_t invalid_a = 0, invalid_b = 0;
    // Interleaved: a records and flushes, b records, a again, b flushes, both flush again with
    // nothing new (must add nothing), a records more and flushes at exit.
    record_steps(rng, a, expected, invalid_a, 40, k);
    ASSERT_TRUE(a.flush().wrote);
    record_steps(rng, b, expected, invalid_b, 40, k);
    record_steps(rng, a, expected, invalid_a, 20, k);
    const CensusFlush fb = b.flush();
    ASSERT_TRUE(fb.wrote) << fb.error;
    EXPECT_TRUE(fb.replaced.empty()) << fb.replaced;
    ASSERT_TRUE(a.flush().wrote);
    ASSERT_TRUE(a.flush().wrote);
    ASSERT_TRUE(b.flush().wrote);
    record_steps(rng, a, expected, invalid_a, 10, k);
    ASSERT_TRUE(a.flush().wrote);
    EXPECT_EQ(Census::read(path, L, E).counts, expected);
    EXPECT_EQ(a.ignored(), invalid_a);
    EXPECT_EQ(b.ignored(), invalid_b);
    std::uint64_t valid = 0;
    for (const auto& row : expected) valid += std::accumulate(row.begin(), row.end(), std::uint64_t{0});
    EXPECT_EQ(a.flushed_total() + b.flushed_total(), valid);
  }
}

TEST(Census, LayersOutOfRangeAreIgnored) {
  const std::string path = group_test::temp_dir("census") + "/c.json";
  CensusRecorder r(3, 8, path);
  const std::int32_t ids[] = {1, 2, 3};
  r.add(-1, ids, 3);
  r.add(3, ids, 3);
  r.add(2, ids, 3);
  EXPECT_EQ(r.ignored(), 6u);
  ASSERT_TRUE(r.flush().wrote);
  Counts want = zeros(3, 8);
  for (int e : {1, 2, 3}) want[2][static_cast<size_t>(e)] = 1;
  EXPECT_EQ(Census::read(path, 3, 8).counts, want);
}

TEST(Census, TwoProcessesFlushingAtOnceBothCount) {
  const std::string path = group_test::temp_dir("census") + "/shared.census.json";
  const std::int64_t L = 4, E = 32, k = 4;
  const int kFlushes = 60;
  // Each process records the same known routing per flush, so the sum is known without sharing memory.
  const auto run = [&](std::uint64_t seed, Counts& expected) {
    std::mt19937_64 rng(seed);
    CensusRecorder r(L, E, path);
    std::uint64_t invalid = 0;
    for (int i = 0; i < kFlushes; ++i) {
      record_steps(rng, r, expected, invalid, 3, k);
      const CensusFlush f = r.flush();
      if (!f.wrote || !f.replaced.empty()) return false;
    }
    return true;
  };
  Counts expected = zeros(L, E), child_counts = zeros(L, E);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) _exit(run(7, child_counts) ? 0 : 1);
  const bool parent_ok = run(8, expected);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child's flushes failed or saw a torn file";
  ASSERT_TRUE(parent_ok) << "a flush failed or saw a torn file";
  // Replay the child's routing here to know its counts.
  std::uint64_t invalid = 0;
  std::mt19937_64 rng(7);
  CensusRecorder replay(L, E, "");
  for (int i = 0; i < kFlushes; ++i) record_steps(rng, replay, expected, invalid, 3, k);
  EXPECT_EQ(Census::read(path, L, E).counts, expected);
}

TEST(Census, CorruptOrMismatchedFileIsReportedAndReplaced) {
  const std::string dir = group_test::temp_dir("census");
  const std::int64_t L = 3, E = 16;
  // A census of the right shape with one count made negative: valid JSON, not a count.
  nlohmann::json negative = {{"n_layer", L}, {"n_expert", E}, {"counts", zeros(L, E)}};
  negative["counts"][1][5] = -5;
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"truncated", R"({"n_layer": 3, "n_expert": 16, "counts": [[1, 2)"},
      {"not json", "\x01\x02 garbage"},
      {"other shape", R"({"n_layer": 4, "n_expert": 16, "counts": []})"},
      {"short row", R"({"n_layer": 3, "n_expert": 16, "counts": [[1], [2], [3]]})"},
      {"negative count", negative.dump()},
      {"empty", ""},
  };
  std::mt19937_64 rng(99);
  for (const auto& [what, text] : bad) {
    SCOPED_TRACE(what);
    const std::string path = dir + "/" + std::to_string(rng() % 100000) + ".census.json";
    std::ofstream(path) << text;
    CensusRecorder r(L, E, path);
    Counts expected = zeros(L, E);
    std::uint64_t invalid = 0;
    record_steps(rng, r, expected, invalid, 12, 3);
    const CensusFlush f = r.flush();
    EXPECT_TRUE(f.wrote) << f.error;
    EXPECT_NE(f.replaced.find(path), std::string::npos) << "the report must name the file: " << f.replaced;
    EXPECT_EQ(Census::read(path, L, E).counts, expected);
    // The replacement is a good file: the next flush merges into it without complaint.
    record_steps(rng, r, expected, invalid, 5, 3);
    const CensusFlush again = r.flush();
    EXPECT_TRUE(again.wrote && again.replaced.empty()) << again.replaced << again.error;
    EXPECT_EQ(Census::read(path, L, E).counts, expected);
  }
}

TEST(Census, AFailedFlushKeepsTheCountsForTheNext) {
  const std::string dir = group_test::temp_dir("census") + "/not-yet";
  const std::string path = dir + "/m.census.json";
  std::mt19937_64 rng(5);
  CensusRecorder r(2, 10, path);
  Counts expected = zeros(2, 10);
  std::uint64_t invalid = 0;
  record_steps(rng, r, expected, invalid, 8, 2);
  const CensusFlush f = r.flush();
  EXPECT_FALSE(f.wrote);
  EXPECT_NE(f.error.find(path), std::string::npos) << f.error;
  record_steps(rng, r, expected, invalid, 8, 2);
  fs::create_directories(dir);
  ASSERT_TRUE(r.flush().wrote);
  EXPECT_EQ(Census::read(path, 2, 10).counts, expected);
  for (const auto& entry : fs::directory_iterator(dir)) {   // no temp file left behind
    EXPECT_EQ(entry.path().string().find(".tmp"), std::string::npos) << entry.path();
  }
}

TEST(Census, FlushIfDueWaitsAndAnEmptyPathWritesNothing) {
  const std::string dir = group_test::temp_dir("census");
  const std::string path = dir + "/due.census.json";
  CensusRecorder r(1, 4, path);
  const std::int32_t ids[] = {0, 3};
  EXPECT_FALSE(r.flush_if_due(std::chrono::seconds(0)).wrote) << "nothing pending: nothing to write";
  r.add(0, ids, 2);
  EXPECT_FALSE(r.flush_if_due(std::chrono::hours(1)).wrote);
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(r.flush_if_due(std::chrono::seconds(0)).wrote);
  EXPECT_EQ(Census::read(path, 1, 4).counts, (Counts{{1, 0, 0, 1}}));

  const auto entries = [&] { return std::distance(fs::directory_iterator(dir), fs::directory_iterator()); };
  const auto before = entries();
  CensusRecorder off(1, 4, "");
  off.add(0, ids, 2);
  EXPECT_EQ(off.pending(0, 3), 1u);
  const CensusFlush f = off.flush();
  EXPECT_FALSE(f.wrote);
  EXPECT_TRUE(f.error.empty());
  EXPECT_EQ(entries(), before);
}

// The loop the issue asks for: a run records, the next start places by it.
TEST(Census, PlacementFromARecordedCensusPutsTheMostRoutedExpertsInVram) {
  std::mt19937_64 rng(4242);
  for (int trial = 0; trial < 20; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    ModelSizes s;
    s.n_layer = 2 + static_cast<std::int64_t>(rng() % 5);
    s.n_expert = 8 + static_cast<std::int64_t>(rng() % 40);
    s.n_expert_used = 1 + static_cast<std::int64_t>(rng() % 4);
    s.dense_bytes = 1 << 20;
    s.kv_bytes = 1 << 16;
    s.context = 1024;
    const std::uint64_t eb = 100'000 + rng() % 100'000;
    s.expert_bytes.assign(static_cast<size_t>(s.n_layer), eb);
    s.expert_slot_bytes.assign(static_cast<size_t>(s.n_layer), arena_align(eb / 3) * 3 + kArenaAlign);

    const std::string path = group_test::temp_dir("census") + "/m.census.json";
    CensusRecorder rec(s.n_layer, s.n_expert, path);
    Counts expected = zeros(s.n_layer, s.n_expert);
    std::uint64_t invalid = 0;
    record_steps(rng, rec, expected, invalid, 200, s.n_expert_used);
    ASSERT_TRUE(rec.flush().wrote);

    // Room in VRAM for exactly `per_layer` experts of every layer (the equal shares take it all).
    const std::int64_t per_layer = 1 + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(s.n_expert - 1));
    PlacementInput in;
    in.sizes = s;
    in.vram_budget = s.dense_bytes + s.kv_bytes + static_cast<std::uint64_t>(per_layer * s.n_layer) * eb;
    in.census = Census::read(path, s.n_layer, s.n_expert);
    const PlacementPlan p = plan_placement(in);
    for (std::int64_t il = 0; il < s.n_layer; ++il) {
      // The expected VRAM set from this test's own counts: the per_layer largest, ties by lower id.
      std::vector<std::int32_t> ids(static_cast<size_t>(s.n_expert));
      std::iota(ids.begin(), ids.end(), 0);
      const auto& n = expected[static_cast<size_t>(il)];
      std::sort(ids.begin(), ids.end(), [&](std::int32_t a, std::int32_t b) {
        return n[static_cast<size_t>(a)] != n[static_cast<size_t>(b)] ? n[static_cast<size_t>(a)] > n[static_cast<size_t>(b)] : a < b;
      });
      ids.resize(static_cast<size_t>(per_layer));
      std::sort(ids.begin(), ids.end());
      EXPECT_EQ(p.experts_in(il, Tier::kVram), ids) << "layer " << il;
    }
  }
}

}  // namespace
}  // namespace moraine::group
