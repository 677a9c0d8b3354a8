// The gpu_worker's lookups in the FILE tier's cache (gpu_worker/file_stage.h): a layer's experts
// found in every cpu worker's directory only when whole, their copies checked after the fact
// against the slot's seqlock (a refill begun, finished or abandoned since the lookup marks the
// copy torn), and under threads that refill slots while a reader copies them, no copy the check
// passes holds another expert's bytes. Also ExpertRequest's marked-expert bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "coordinator/expert_cache_directory.h"
#include "coordinator/group_layout.h"
#include "gpu_worker/file_stage.h"

namespace moraine {
namespace {

using group::CacheDirectory;
using gpu_worker::FileStager;

constexpr int kSlots = 4;
constexpr int64_t kExperts = 6;

struct Dirs {
  explicit Dirs(int workers) : mem(static_cast<size_t>(workers * kSlots) * group::kCacheSlotHeaderBytes) {
    for (int w = 0; w < workers; ++w) dirs.emplace_back(mem.data() + static_cast<size_t>(w * kSlots) * group::kCacheSlotHeaderBytes, kSlots);
  }
  void fill(int w, int64_t s, int32_t layer, int32_t expert) {
    ASSERT_TRUE(dirs[static_cast<size_t>(w)].begin_fill(s, layer, expert));
    dirs[static_cast<size_t>(w)].end_fill(s);
  }
  alignas(64) std::vector<std::byte> mem;   // zero-filled: every slot empty
  std::vector<CacheDirectory> dirs;
};

TEST(FileStager, FindsOnlyWholeSlotsOfTheLayer) {
  Dirs d(2);
  FileStager st(d.dirs, kExperts);
  st.index_layer(3);
  for (int32_t e = 0; e < kExperts; ++e) EXPECT_EQ(st.find(e).slot, -1) << "an empty directory holds expert " << e;
  d.fill(0, 1, 3, 5);   // worker 0 slot 1: layer 3 expert 5
  d.fill(1, 2, 3, 0);   // worker 1 slot 2: layer 3 expert 0
  d.fill(1, 3, 2, 4);   // another layer
  ASSERT_TRUE(d.dirs[0].begin_fill(0, 3, 2));   // being filled: not whole yet
  st.index_layer(3);
  const FileStager::Hit a = st.find(5), b = st.find(0);
  EXPECT_EQ(a.expert, 5);
  EXPECT_EQ(a.worker, 0);
  EXPECT_EQ(a.slot, 1);
  EXPECT_NE(a.token, 0u);
  EXPECT_EQ(b.worker, 1);
  EXPECT_EQ(b.slot, 2);
  EXPECT_EQ(st.find(2).slot, -1) << "a slot mid-fill was found";
  EXPECT_EQ(st.find(4).slot, -1) << "another layer's expert was found";
  EXPECT_EQ(st.find(-1).slot, -1);
  EXPECT_EQ(st.find(kExperts).slot, -1);
  d.dirs[0].end_fill(0);
  EXPECT_EQ(st.find(2).slot, -1) << "found without a new index_layer";
  st.index_layer(3);
  EXPECT_EQ(st.find(2).slot, 0);
  st.index_layer(2);
  EXPECT_EQ(st.find(4).worker, 1);
  EXPECT_EQ(st.find(5).slot, -1);
}

// A slot refilled between index_layer and find is not found (the snapshot checks the identity).
TEST(FileStager, ASlotRefilledAfterTheIndexIsNotFound) {
  Dirs d(1);
  FileStager st(d.dirs, kExperts);
  d.fill(0, 0, 1, 3);
  st.index_layer(1);
  ASSERT_TRUE(d.dirs[0].begin_fill(0, 1, 4));
  EXPECT_EQ(st.find(3).slot, -1) << "mid-refill";
  d.dirs[0].end_fill(0);
  EXPECT_EQ(st.find(3).slot, -1) << "refilled with expert 4";
}

// After the copies: a refill begun, finished or abandoned since the lookup marks the copy torn;
// an untouched slot passes; the list empties.
TEST(FileStager, CopiesOfRefilledSlotsAreTorn) {
  Dirs d(2);
  FileStager st(d.dirs, kExperts);
  d.fill(0, 0, 0, 0);
  d.fill(0, 1, 0, 2);
  d.fill(1, 0, 0, 1);
  d.fill(1, 1, 0, 3);
  st.index_layer(0);
  for (int32_t e = 0; e < 4; ++e) {
    const FileStager::Hit h = st.find(e);
    ASSERT_GE(h.slot, 0) << e;
    st.add_pending(h);
  }
  EXPECT_TRUE(st.has_pending());
  ASSERT_TRUE(d.dirs[0].begin_fill(1, 0, 5));   // expert 2's slot: refill begun
  d.fill(1, 0, 0, 4);                           // expert 1's slot: refilled whole
  d.dirs[1].abandon(1);                         // expert 3's slot: nothing was being filled: no change
  EXPECT_EQ(st.torn(), (std::vector<int32_t>{1, 2}));
  EXPECT_FALSE(st.has_pending());
  EXPECT_TRUE(st.torn().empty());
  // An abandoned fill (a failed read) bumps the number too.
  st.index_layer(0);
  const FileStager::Hit h = st.find(0);
  ASSERT_GE(h.slot, 0);
  st.add_pending(h);
  ASSERT_TRUE(d.dirs[0].begin_fill(0, 0, 0));
  d.dirs[0].abandon(0);
  EXPECT_EQ(st.torn(), (std::vector<int32_t>{0}));
}

// Fault injection: the first force_first copies are torn whatever their slots say, the rest by them.
TEST(FileStager, ForcedTearsComeFirst) {
  Dirs d(1);
  FileStager st(d.dirs, kExperts);
  for (int32_t e = 0; e < 3; ++e) d.fill(0, e, 0, e);
  st.index_layer(0);
  for (int32_t e : {2, 0, 1}) st.add_pending(st.find(e));
  ASSERT_TRUE(d.dirs[0].begin_fill(1, 0, 5));   // expert 1's slot refilled
  EXPECT_EQ(st.torn(1), (std::vector<int32_t>{2, 1}));
  st.index_layer(0);
  st.add_pending(st.find(0));
  EXPECT_EQ(st.torn(4), (std::vector<int32_t>{0})) << "more forced than pending";
}

TEST(FileStager, ClearPendingForgetsALayerLeftHalfDone) {
  Dirs d(1);
  FileStager st(d.dirs, kExperts);
  d.fill(0, 0, 0, 1);
  st.index_layer(0);
  st.add_pending(st.find(1));
  ASSERT_TRUE(d.dirs[0].begin_fill(0, 2, 2));
  st.clear_pending();
  EXPECT_FALSE(st.has_pending());
  EXPECT_TRUE(st.torn().empty());
}

constexpr size_t kWords = 4096;   // 32 KiB a slot: copies are long enough to be caught mid-refill

uint64_t pattern(int32_t layer, int32_t expert, size_t i) {
  return (static_cast<uint64_t>(layer) << 40) ^ (static_cast<uint64_t>(expert) << 20) ^ i;
}

// A writer refills one worker's slots with random experts of two layers (as its cpu worker's
// read-ahead and demand reads do) while the reader does what the gpu_worker does per window:
// index the layer, look experts up, copy their slots (the device's copy), then ask which copies
// are torn. Every copy the check passes must be its expert's bytes; some must be caught torn.
TEST(FileStager, CopiesThatPassTheCheckAreNeverTorn) {
  Dirs d(1);
  std::vector<uint64_t> data(kSlots * kWords);
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    std::mt19937 rng(1);
    CacheDirectory dir = d.dirs[0];
    while (!stop.load(std::memory_order_relaxed)) {
      const int64_t s = static_cast<int64_t>(rng() % kSlots);
      const int32_t layer = static_cast<int32_t>(rng() % 2), expert = static_cast<int32_t>(rng() % kExperts);
      if (!dir.begin_fill(s, layer, expert)) continue;
      for (size_t i = 0; i < kWords; ++i)
        std::atomic_ref<uint64_t>(data[static_cast<size_t>(s) * kWords + i]).store(pattern(layer, expert, i), std::memory_order_relaxed);
      dir.end_fill(s);
    }
  });
  FileStager st(d.dirs, kExperts);
  uint64_t passed = 0, torn = 0, bad = 0;
  std::vector<std::vector<uint64_t>> copy(kExperts, std::vector<uint64_t>(kWords));
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < until && (passed < 2000 || torn < 100)) {
    const int32_t layer = static_cast<int32_t>(passed % 2);
    st.index_layer(layer);
    std::vector<FileStager::Hit> hits;
    for (int32_t e = 0; e < kExperts; ++e) {
      const FileStager::Hit h = st.find(e);
      if (h.slot < 0) continue;
      for (size_t i = 0; i < kWords; ++i)
        copy[static_cast<size_t>(e)][i] =
            std::atomic_ref<uint64_t>(data[static_cast<size_t>(h.slot) * kWords + i]).load(std::memory_order_relaxed);
      st.add_pending(h);
      hits.push_back(h);
    }
    const std::vector<int32_t> t = st.torn();
    torn += t.size();
    for (const FileStager::Hit& h : hits) {
      if (std::find(t.begin(), t.end(), h.expert) != t.end()) continue;
      ++passed;
      for (size_t i = 0; i < kWords; ++i) bad += copy[static_cast<size_t>(h.expert)][i] != pattern(layer, h.expert, i) ? 1 : 0;
    }
  }
  stop = true;
  writer.join();
  EXPECT_EQ(bad, 0u) << passed << " copies passed the check";
  EXPECT_GE(passed, 2000u);
  EXPECT_GE(torn, 100u) << "copies seldom overlapped a refill: the check was not exercised";
}

TEST(ExpertRequest, MarkedBits) {
  group::ExpertRequest r{};
  EXPECT_FALSE(group::expert_marked(r, 0));
  r.marked[0] = uint64_t{1} << 3;
  r.marked[7] = uint64_t{1} << 63;
  EXPECT_TRUE(group::expert_marked(r, 3));
  EXPECT_TRUE(group::expert_marked(r, group::kMaxMarkedExperts - 1));
  EXPECT_FALSE(group::expert_marked(r, 4));
  EXPECT_FALSE(group::expert_marked(r, 64 + 3));
  EXPECT_FALSE(group::expert_marked(r, -1));
  EXPECT_FALSE(group::expert_marked(r, group::kMaxMarkedExperts));
}

}  // namespace
}  // namespace moraine
