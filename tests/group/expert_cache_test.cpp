// The FILE tier's host cache on its own: the shared directory's seqlock (coordinator/
// expert_cache_directory.h) under threads and processes that read and refill slots at once, and
// one worker's slot policy (cpu_expert_worker/expert_cache.h): census-seeded heat, LFU victims,
// the read-ahead's admission test, pins, and a restarted worker adopting its predecessor's slots.
#include <gtest/gtest.h>

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "coordinator/expert_cache_directory.h"
#include "cpu_expert_worker/expert_cache.h"

namespace moraine {
namespace {

using cpu_worker::ExpertCache;
using group::CacheDirectory;

// Shared (MAP_SHARED) zeroed memory that forked children see too.
struct SharedMemory {
  explicit SharedMemory(size_t n) : bytes(n) {
    p = static_cast<std::byte*>(mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
    if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
  }
  ~SharedMemory() { munmap(p, bytes); }
  size_t bytes;
  std::byte* p;
};

constexpr int kSlots = 4;
constexpr size_t kWords = 2048;   // 16 KiB a slot: a fill takes long enough to be caught in it

// What slot bytes hold for (layer, expert): every word names them, so a torn read shows.
uint64_t pattern(int32_t layer, int32_t expert, size_t i) {
  return (static_cast<uint64_t>(layer) << 40) ^ (static_cast<uint64_t>(expert) << 20) ^ i;
}

struct Stress {
  std::atomic<uint64_t> checked{0}, torn{0}, stale{0}, fills{0};
  std::atomic<bool> stop_writers{false}, stop_readers{false};
  // Runs until reads were both checked and caught mid-refill many times (or 20 s passed), so
  // that a pass means the seqlock was exercised, then stops the writers, then the readers.
  void run_until_exercised(const std::function<void()>& join_writers, const std::function<void()>& join_readers) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < until && (stale.load() < 100 || checked.load() < 1000)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    stop_writers = true;
    join_writers();
    stop_readers = true;
    join_readers();
  }
};

// Refills slot `slot` over and over with experts of its own (a writer per slot, as a worker
// owns its slots; a second writer's begin_fill fails, which is counted as nothing).
void writer(CacheDirectory dir, uint64_t* data, int slot, const std::atomic<bool>* stop, Stress* st) {
  std::mt19937 rng(static_cast<unsigned>(slot));
  while (!stop->load(std::memory_order_relaxed)) {
    const int32_t layer = static_cast<int32_t>(rng() % 3), expert = static_cast<int32_t>(rng() % 5);
    if (!dir.begin_fill(slot, layer, expert)) continue;
    uint64_t* w = data + static_cast<size_t>(slot) * kWords;
    for (size_t i = 0; i < kWords; ++i) std::atomic_ref<uint64_t>(w[i]).store(pattern(layer, expert, i), std::memory_order_relaxed);
    dir.end_fill(slot);
    st->fills.fetch_add(1, std::memory_order_relaxed);
  }
}

// Reads whatever (layer, expert) a slot claims and checks the bytes when the seqlock says they
// were whole; until `stop`.
void reader(CacheDirectory dir, const uint64_t* data, const std::atomic<bool>* stop, Stress* st) {
  std::mt19937 rng(7);
  while (!stop->load(std::memory_order_relaxed)) {
    const int slot = static_cast<int>(rng() % kSlots);
    const int32_t layer = static_cast<int32_t>(rng() % 3), expert = static_cast<int32_t>(rng() % 5);
    const uint64_t token = dir.snapshot(slot, layer, expert);
    if (token == 0) continue;
    const uint64_t* w = data + static_cast<size_t>(slot) * kWords;
    bool whole = true;
    for (size_t i = 0; i < kWords; ++i) {
      whole &= std::atomic_ref<uint64_t>(const_cast<uint64_t&>(w[i])).load(std::memory_order_relaxed) == pattern(layer, expert, i);
    }
    if (!dir.still_valid(slot, token)) {
      st->stale.fetch_add(1, std::memory_order_relaxed);   // refilled under the read: not used
    } else {
      st->checked.fetch_add(1, std::memory_order_relaxed);
      if (!whole) st->torn.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

// Threads: two writers per slot race (one wins each begin_fill), four readers. A read the
// seqlock passes is never torn, and reads are caught mid-refill (stale > 0) so the check ran.
TEST(CacheDirectory, ValidatedReadsAreNeverTornUnderThreads) {
  SharedMemory mem(kSlots * group::kCacheSlotHeaderBytes + kSlots * kWords * sizeof(uint64_t));
  CacheDirectory dir(mem.p, kSlots);
  auto* data = reinterpret_cast<uint64_t*>(mem.p + kSlots * group::kCacheSlotHeaderBytes);
  Stress st;
  std::vector<std::thread> readers, writers;
  for (int i = 0; i < 4; ++i) readers.emplace_back(reader, dir, data, &st.stop_readers, &st);
  for (int s = 0; s < kSlots; ++s) {
    for (int twice = 0; twice < 2; ++twice) writers.emplace_back(writer, dir, data, s, &st.stop_writers, &st);
  }
  st.run_until_exercised([&] { for (auto& t : writers) t.join(); }, [&] { for (auto& t : readers) t.join(); });
  EXPECT_EQ(st.torn.load(), 0u) << st.checked.load() << " reads checked";
  EXPECT_GE(st.checked.load(), 1000u);
  EXPECT_GE(st.stale.load(), 100u) << "reads seldom overlapped a refill: the test did not test the seqlock";
  for (int s = 0; s < kSlots; ++s) EXPECT_EQ(dir.seq(s) % 2, 0u) << "slot " << s << " left mid-fill";
}

// Processes: the directory and slots in MAP_SHARED memory, a writer process per slot and two
// reader processes (the cpu workers, the io_worker and a GPU staging path map the arena so).
TEST(CacheDirectory, ValidatedReadsAreNeverTornAcrossProcesses) {
  SharedMemory mem(kSlots * group::kCacheSlotHeaderBytes + kSlots * kWords * sizeof(uint64_t) + 4096);
  CacheDirectory dir(mem.p, kSlots);
  auto* data = reinterpret_cast<uint64_t*>(mem.p + kSlots * group::kCacheSlotHeaderBytes);
  auto* st = new (mem.p + kSlots * group::kCacheSlotHeaderBytes + kSlots * kWords * sizeof(uint64_t)) Stress;
  std::vector<pid_t> readers, writers;
  const auto fork_child = [](auto&& body) {
    const pid_t pid = fork();
    if (pid == 0) {
      body();
      _exit(0);
    }
    return pid;
  };
  for (int i = 0; i < 2; ++i) readers.push_back(fork_child([&] { reader(dir, data, &st->stop_readers, st); }));
  for (int s = 0; s < kSlots; ++s) writers.push_back(fork_child([&, s] { writer(dir, data, s, &st->stop_writers, st); }));
  const auto join = [](const std::vector<pid_t>& pids) {
    for (pid_t p : pids) {
      int status = 0;
      ASSERT_EQ(waitpid(p, &status, 0), p);
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
  };
  st->run_until_exercised([&] { join(writers); }, [&] { join(readers); });
  EXPECT_EQ(st->torn.load(), 0u) << st->checked.load() << " reads checked";
  EXPECT_GE(st->checked.load(), 1000u);
  EXPECT_GE(st->stale.load(), 100u);
}

// A directory of n slots and one worker's cache over it (3 layers x 6 experts).
struct CacheFixture {
  explicit CacheFixture(int slots, group::Census seed = {}) : mem(static_cast<size_t>(slots) * group::kCacheSlotHeaderBytes) {
    cache = std::make_unique<ExpertCache>(CacheDirectory(mem.p, slots), 3, 6, seed, 1000);
  }
  void fill(int64_t slot, int64_t il, int64_t e) {
    cache->begin_fill(slot, il, e);
    cache->end_fill(slot);
  }
  SharedMemory mem;
  std::unique_ptr<ExpertCache> cache;
};

TEST(ExpertCache, MissEvictsTheColdestSlotNotPinned) {
  CacheFixture f(3);
  for (int i = 0; i < 5; ++i) f.cache->touch(0, 1);
  for (int i = 0; i < 3; ++i) f.cache->touch(0, 2);
  f.cache->touch(0, 3);
  EXPECT_EQ(f.cache->find(0, 1).slot, -1);
  // Empty slots first.
  for (int64_t e : {1, 2, 3}) {
    const int64_t s = f.cache->victim(0, e, false);
    ASSERT_GE(s, 0);
    f.fill(s, 0, e);
  }
  f.cache->unpin_all();
  EXPECT_EQ(f.cache->filled(), 3);
  const ExpertCache::Found one = f.cache->find(0, 1);
  ASSERT_GE(one.slot, 0);
  EXPECT_TRUE(f.cache->still_valid(one));
  // Full: the coldest (expert 3) goes; pinned, the next coldest (expert 2).
  const int64_t cold = f.cache->find(0, 3).slot;
  EXPECT_EQ(f.cache->victim(0, 4, false), cold);
  f.cache->pin(cold);
  EXPECT_EQ(f.cache->victim(0, 4, false), f.cache->find(0, 2).slot);
  // A refill of the slot expert 1 was found in invalidates that find; the new expert is found.
  f.cache->unpin_all();
  f.cache->begin_fill(one.slot, 1, 5);
  EXPECT_FALSE(f.cache->still_valid(one));
  EXPECT_EQ(f.cache->find(1, 5).slot, -1) << "found while being filled";
  f.cache->end_fill(one.slot);
  EXPECT_EQ(f.cache->find(1, 5).slot, one.slot);
  EXPECT_EQ(f.cache->find(0, 1).slot, -1);
  EXPECT_EQ(f.cache->filled(), 3);
}

// The read-ahead only takes a slot whose expert is no hotter than the one it would read, counting
// the use it reads for.
TEST(ExpertCache, ReadAheadAdmitsOnlyExpertsAsHot) {
  CacheFixture f(1);
  for (int i = 0; i < 4; ++i) f.cache->touch(2, 0);
  f.cache->touch(2, 1);
  EXPECT_EQ(f.cache->victim(2, 1, true), 0) << "an empty slot takes anything";
  f.fill(0, 2, 0);
  f.cache->unpin_all();
  EXPECT_EQ(f.cache->victim(2, 1, true), -1) << "expert 1 (heat 1, +1 for the read) would evict expert 0 (heat 4)";
  EXPECT_EQ(f.cache->victim(2, 1, false), 0) << "a miss takes it anyway";
  f.cache->touch(2, 1);
  EXPECT_EQ(f.cache->victim(2, 1, true), -1) << "heat 2 + 1 < 4";
  f.cache->touch(2, 1);
  EXPECT_EQ(f.cache->victim(2, 1, true), 0) << "heat 3 + 1 = 4";
}

// Heat starts from the census (kSeedHeat for a layer's most routed) and halves every aging period.
TEST(ExpertCache, HeatIsSeededFromTheCensusAndAges) {
  group::Census census = group::Census::uniform(3, 6);
  for (auto& layer : census.counts) std::fill(layer.begin(), layer.end(), 0);
  census.counts[1] = {0, 100, 50, 0, 0, 0};
  CacheFixture f(2, census);
  EXPECT_DOUBLE_EQ(f.cache->heat(1, 1), ExpertCache::kSeedHeat);
  EXPECT_DOUBLE_EQ(f.cache->heat(1, 2), ExpertCache::kSeedHeat / 2);
  EXPECT_DOUBLE_EQ(f.cache->heat(0, 0), 0.0);
  for (int i = 0; i < 999; ++i) f.cache->touch(0, 0);
  EXPECT_DOUBLE_EQ(f.cache->heat(0, 0), 999.0);
  f.cache->touch(0, 0);   // the 1000th use: everything halves
  EXPECT_DOUBLE_EQ(f.cache->heat(0, 0), 500.0);
  EXPECT_DOUBLE_EQ(f.cache->heat(1, 1), ExpertCache::kSeedHeat / 2);
}

// A restarted worker's cache over the same directory keeps whole slots and abandons a fill its
// predecessor died in; read-ahead marks count once.
TEST(ExpertCache, RestartAdoptsWholeSlotsAndDropsAnUnfinishedFill) {
  CacheFixture f(3);
  f.fill(0, 0, 1);
  f.fill(1, 2, 4);
  f.cache->begin_fill(2, 1, 3);   // never ended: the worker "dies" here
  ExpertCache next(CacheDirectory(f.mem.p, 3), 3, 6, {}, 1000);
  EXPECT_EQ(next.adopt(), 2);
  EXPECT_EQ(next.find(0, 1).slot, 0);
  EXPECT_EQ(next.find(2, 4).slot, 1);
  EXPECT_EQ(next.find(1, 3).slot, -1);
  EXPECT_EQ(next.victim(1, 3, false), 2) << "the abandoned slot is empty again";
  next.begin_fill(2, 1, 3);
  next.mark_read_ahead(2);
  next.end_fill(2);
  EXPECT_TRUE(next.take_read_ahead(2));
  EXPECT_FALSE(next.take_read_ahead(2));
}

}  // namespace
}  // namespace moraine
