// The pool: every job of every list runs exactly once, on a CPU of the pool's list; pools with
// disjoint lists run side by side; an idle pool sleeps; bad CPU lists are refused clearly.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <random>
#include <thread>
#include <vector>

#include "kernels/cpu/cpu_topology.h"
#include "kernels/cpu/thread_pool.h"

namespace moraine::cpu {
namespace {

double process_cpu_seconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) + 1e-6 * static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

bool contains(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }

TEST(ThreadPool, ManySmallJobListsRunEveryJobOnce) {
  ThreadPool pool(allowed_cpus());
  std::mt19937 rng(42);
  std::uniform_int_distribution<int> size(0, 64);
  std::vector<std::atomic<int>> hits(64);
  std::vector<std::atomic<int>> worker_seen(static_cast<size_t>(pool.size()));
  for (int list = 0; list < 5000; ++list) {
    const int n = size(rng);
    for (auto& h : hits) h.store(0, std::memory_order_relaxed);
    pool.run(n, [&](int64_t i, int w) {
      hits[static_cast<size_t>(i)].fetch_add(1, std::memory_order_relaxed);
      worker_seen[static_cast<size_t>(w)].fetch_add(1, std::memory_order_relaxed);
    });
    for (int i = 0; i < 64; ++i) {
      ASSERT_EQ(hits[static_cast<size_t>(i)].load(), i < n ? 1 : 0) << "list " << list << " of " << n << " jobs, job " << i;
    }
  }
  int total = 0;
  for (auto& w : worker_seen) total += w.load();
  EXPECT_GT(total, 0);
}

TEST(ThreadPool, JobsRunOnTheListedCpusWithWorkerIndices) {
  const std::vector<int> cpus = allowed_cpus();
  ThreadPool pool(cpus);
  ASSERT_EQ(pool.size(), static_cast<int>(cpus.size()));
  std::vector<int> cpu_of_job(2000, -1), worker_of_job(2000, -1);
  pool.run(2000, [&](int64_t i, int w) {
    cpu_of_job[static_cast<size_t>(i)] = sched_getcpu();
    worker_of_job[static_cast<size_t>(i)] = w;
    volatile double spin = 0;  // a little work so jobs spread over the workers
    for (int k = 0; k < 2000; ++k) spin = spin + k;
  });
  for (size_t i = 0; i < cpu_of_job.size(); ++i) {
    const int w = worker_of_job[i];
    ASSERT_GE(w, 0);
    ASSERT_LT(w, pool.size());
    EXPECT_EQ(cpu_of_job[i], cpus[static_cast<size_t>(w)]) << "worker " << w << " must be pinned to its CPU";
  }
}

TEST(ThreadPool, DisjointPoolsRunConcurrentlyOnTheirOwnCpus) {
  const std::vector<int> cpus = allowed_cpus();
  if (cpus.size() < 2) GTEST_SKIP() << "needs two CPUs";
  const std::vector<int> a(cpus.begin(), cpus.begin() + static_cast<long>(cpus.size() / 2));
  const std::vector<int> b(cpus.begin() + static_cast<long>(cpus.size() / 2), cpus.end());
  ThreadPool pa(a), pb(b);
  std::atomic<int> bad{0}, done_a{0}, done_b{0};
  auto drive = [&](ThreadPool& p, const std::vector<int>& mine, std::atomic<int>& done) {
    for (int list = 0; list < 300; ++list) {
      p.run(17, [&](int64_t, int) {
        if (!contains(mine, sched_getcpu())) bad.fetch_add(1);
        done.fetch_add(1);
      });
    }
  };
  std::thread ta([&] { drive(pa, a, done_a); }), tb([&] { drive(pb, b, done_b); });
  ta.join();
  tb.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(done_a.load(), 300 * 17);
  EXPECT_EQ(done_b.load(), 300 * 17);
}

// After a burst of work the workers spin for at most ~50 us, then sleep: over a 300 ms idle
// window the whole process may use only a few ms of CPU (one spinning thread would use 300).
TEST(ThreadPool, IdleWorkersSleep) {
  ThreadPool pool(allowed_cpus());
  std::atomic<int64_t> sum{0};
  for (int list = 0; list < 200; ++list) pool.run(64, [&](int64_t i, int) { sum.fetch_add(i); });
  EXPECT_EQ(sum.load(), 200 * (63 * 64 / 2));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // past the spin window
  const double before = process_cpu_seconds();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const double used = process_cpu_seconds() - before;
  EXPECT_LT(used, 0.015) << "idle pool of " << pool.size() << " threads used " << used * 1e3 << " ms CPU in 300 ms";
  // And it still works after sleeping.
  sum = 0;
  pool.run(10, [&](int64_t i, int) { sum.fetch_add(i); });
  EXPECT_EQ(sum.load(), 45);
}

TEST(ThreadPool, RefusesBadCpuLists) {
  EXPECT_THROW(ThreadPool(std::vector<int>{}), std::invalid_argument);
  const int c = allowed_cpus().front();
  EXPECT_THROW(ThreadPool(std::vector<int>{c, c}), std::invalid_argument);
  EXPECT_THROW(ThreadPool(std::vector<int>{100000}), std::invalid_argument);
}

TEST(CpuTopology, ParsesAndFormatsCpuLists) {
  EXPECT_EQ(parse_cpu_list("0-3,8,10-11"), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(parse_cpu_list("5,1,1"), (std::vector<int>{1, 5}));
  EXPECT_EQ(format_cpu_list({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  for (const char* bad : {"", "a", "3-1", "1,,2", "-1", "1-"}) EXPECT_THROW(parse_cpu_list(bad), std::invalid_argument) << bad;
}

TEST(CpuTopology, PhysicalCoresAreAllowedAndDistinct) {
  const std::vector<int> phys = physical_core_cpus(), allowed = allowed_cpus();
  ASSERT_FALSE(phys.empty());
  EXPECT_LE(phys.size(), allowed.size());
  for (int c : phys) EXPECT_TRUE(contains(allowed, c)) << c;
  EXPECT_TRUE(std::adjacent_find(phys.begin(), phys.end()) == phys.end());
}

}  // namespace
}  // namespace moraine::cpu
