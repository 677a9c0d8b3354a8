// The pool: every job of every list runs exactly once, on a CPU of the pool's list; pools with
// disjoint lists run side by side; an idle pool sleeps; bad CPU lists are refused clearly.
#include <gtest/gtest.h>
#include <pthread.h>
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

// A long spin window (Options::spin_us, set_spin_us) changes only how workers and run() wait:
// every job still runs once, and run() returns only after all have finished (lists of uneven
// jobs, some longer than the short spin, some shorter), with or without the caller joining.
TEST(ThreadPool, LongSpinStillWaitsForEveryJob) {
  for (const bool joins : {false, true}) {
    ThreadPool pool(allowed_cpus(), {3000, joins});
    EXPECT_EQ(pool.spin_us(), 3000);
    std::mt19937 rng(7);
    std::uniform_int_distribution<int> size(1, 48), work(0, 20000);
    std::vector<std::atomic<int>> done(48);
    for (int list = 0; list < 300; ++list) {
      const int n = size(rng);
      std::vector<int> spins(static_cast<size_t>(n));
      for (int& v : spins) v = work(rng);
      for (auto& d : done) d.store(0, std::memory_order_relaxed);
      pool.run(n, [&](int64_t i, int) {
        volatile double acc = 0;
        for (int k = 0; k < spins[static_cast<size_t>(i)]; ++k) acc = acc + 1.0;
        done[static_cast<size_t>(i)].store(1, std::memory_order_relaxed);
      });
      for (int i = 0; i < n; ++i) ASSERT_EQ(done[static_cast<size_t>(i)].load(), 1) << "list " << list << " job " << i << " not finished";
    }
    pool.set_spin_us(-5);
    EXPECT_EQ(pool.spin_us(), 0);
  }
}

// Caller joins: the calling thread is worker 0 (pinned to cpus[0] by pin_caller), the threads
// take cpus[1..]; plain and sliced lists run every job once, each on its worker's CPU.
TEST(ThreadPool, CallerJoinsAsWorkerZeroOnTheFirstCpu) {
  const std::vector<int> cpus = allowed_cpus();
  std::vector<int> cpu_of_job(3000, -1), worker_of_job(3000, -1);
  std::thread caller([&] {
    ThreadPool pool(cpus, {ThreadPool::Options{}.spin_us, true});
    ASSERT_TRUE(pool.caller_joins());
    ASSERT_EQ(pool.size(), static_cast<int>(cpus.size()));
    pool.pin_caller();
    pool.run(2000, [&](int64_t i, int w) {
      cpu_of_job[static_cast<size_t>(i)] = sched_getcpu();
      worker_of_job[static_cast<size_t>(i)] = w;
      volatile double spin = 0;
      for (int k = 0; k < 2000; ++k) spin = spin + k;
    });
    // A sliced list of 1000 jobs, recorded after the plain list's 2000.
    std::vector<int64_t> ends(static_cast<size_t>(pool.size()));
    for (int w = 0; w < pool.size(); ++w) ends[static_cast<size_t>(w)] = 1000 * (w + 1) / pool.size();
    pool.run_sliced(ends.data(), [&](int64_t i, int w) {
      cpu_of_job[static_cast<size_t>(2000 + i)] = sched_getcpu();
      worker_of_job[static_cast<size_t>(2000 + i)] = w;
    });
  });
  caller.join();
  std::vector<int> per_worker(cpus.size(), 0);
  for (size_t i = 0; i < cpu_of_job.size(); ++i) {
    const int w = worker_of_job[i];
    ASSERT_GE(w, 0) << "job " << i << " did not run";
    ASSERT_LT(w, static_cast<int>(cpus.size()));
    ++per_worker[static_cast<size_t>(w)];
    EXPECT_EQ(cpu_of_job[i], cpus[static_cast<size_t>(w)]) << "job " << i << ": worker " << w << " must run on its CPU";
  }
  EXPECT_GT(per_worker[0], 0) << "the caller ran no job";
}

// run_sliced: every job once, on uneven slices (some empty); with jobs that take a while, each
// worker starts with its own slice's first job; a job waiting for the first job of every slice
// (the kind of wait MoeFfn's sliced schedule relies on) does not deadlock.
TEST(ThreadPool, SlicedListsRunEveryJobOnceOwnSliceFirst) {
  ThreadPool pool(allowed_cpus());
  const int n = pool.size();
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> len(0, 9);
  for (int list = 0; list < 500; ++list) {
    std::vector<int64_t> ends(static_cast<size_t>(n));
    int64_t total = 0;
    for (auto& e : ends) e = total += len(rng);
    std::vector<std::atomic<int>> hits(static_cast<size_t>(total));
    pool.run_sliced(ends.data(), [&](int64_t i, int) { hits[static_cast<size_t>(i)].fetch_add(1, std::memory_order_relaxed); });
    for (int64_t i = 0; i < total; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << "list " << list << " job " << i;
  }
  // Slices of 4 jobs of ~1 ms: worker w must run job 4w itself (it claims it before helping).
  std::vector<int64_t> ends(static_cast<size_t>(n));
  for (int w = 0; w < n; ++w) ends[static_cast<size_t>(w)] = 4 * (w + 1);
  std::vector<int> ran_by(static_cast<size_t>(4 * n), -1);
  std::vector<std::atomic<int>> started(static_cast<size_t>(4 * n));
  pool.run_sliced(ends.data(), [&](int64_t i, int w) {
    ran_by[static_cast<size_t>(i)] = w;
    started[static_cast<size_t>(i)].store(1, std::memory_order_release);
    if (i % 4 == 3) {
      // The last job of a slice waits until the first job of every slice has started.
      for (int s = 0; s < n; ++s) {
        while (!started[static_cast<size_t>(4 * s)].load(std::memory_order_acquire)) std::this_thread::yield();
      }
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(1000);
    while (std::chrono::steady_clock::now() < until) {
    }
  });
  for (int w = 0; w < n; ++w) EXPECT_EQ(ran_by[static_cast<size_t>(4 * w)], w) << "slice " << w << "'s first job";
}

// Helpers take a slice's jobs from its back: the owner's jobs stay one run from the slice's
// front (the stream its rows were laid out for) and the helpers' the rest. Slice 0 holds every
// job, ~1 ms each; the other workers have empty slices and help from the start.
TEST(ThreadPool, HelpersTakeASlicesJobsFromItsBack) {
  ThreadPool pool(allowed_cpus());
  const int n = pool.size();
  if (n < 2) GTEST_SKIP() << "needs two CPUs";
  const int64_t jobs = 4 * n;
  std::vector<int64_t> ends(static_cast<size_t>(n), jobs);
  std::vector<int> ran_by(static_cast<size_t>(jobs), -1);
  pool.run_sliced(ends.data(), [&](int64_t i, int w) {
    ran_by[static_cast<size_t>(i)] = w;
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(1000);
    while (std::chrono::steady_clock::now() < until) {
    }
  });
  int64_t owner_run = 0;
  while (owner_run < jobs && ran_by[static_cast<size_t>(owner_run)] == 0) ++owner_run;
  EXPECT_GE(owner_run, 1) << "the owner must run its slice's first job";
  for (int64_t i = owner_run; i < jobs; ++i) {
    EXPECT_GT(ran_by[static_cast<size_t>(i)], 0) << "job " << i << ": the owner's jobs must be one run from the front (it ran "
                                                 << owner_run << " first)";
  }
  EXPECT_LT(owner_run, jobs) << "no helper ran a job of " << jobs << " taking ~1 ms each";
}

// run_sliced_phases: no job of the second phase starts before every job of the first has
// started, though the first phase's jobs all sit in one slice (the other workers help there
// first), and a second-phase job waiting for every first-phase job to finish does not deadlock.
TEST(ThreadPool, PhasedListsStartEveryJobOfAPhaseBeforeTheNext) {
  ThreadPool pool(allowed_cpus());
  const int n = pool.size();
  const int64_t first = 4 * n, second = 2 * n;
  std::vector<int64_t> ends(2 * static_cast<size_t>(n));
  for (int w = 0; w < n; ++w) ends[static_cast<size_t>(w)] = first;  // phase 0: all in slice 0
  for (int w = 0; w < n; ++w) ends[static_cast<size_t>(n + w)] = first + 2 * (w + 1);
  for (int list = 0; list < 20; ++list) {
    std::atomic<int64_t> started0{0}, done0{0};
    std::vector<int64_t> seen_started(static_cast<size_t>(second), -1);
    std::vector<std::atomic<int>> hits(static_cast<size_t>(first + second));
    pool.run_sliced_phases(ends.data(), 2, [&](int64_t i, int) {
      hits[static_cast<size_t>(i)].fetch_add(1, std::memory_order_relaxed);
      if (i < first) {
        started0.fetch_add(1, std::memory_order_acq_rel);
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
        while (std::chrono::steady_clock::now() < until) {
        }
        done0.fetch_add(1, std::memory_order_acq_rel);
        return;
      }
      seen_started[static_cast<size_t>(i - first)] = started0.load(std::memory_order_acquire);
      while (done0.load(std::memory_order_acquire) < first) std::this_thread::yield();
    });
    for (int64_t i = 0; i < first + second; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << "list " << list << " job " << i;
    for (int64_t j = 0; j < second; ++j) {
      ASSERT_EQ(seen_started[static_cast<size_t>(j)], first) << "list " << list << ": second-phase job " << j << " began before every first-phase job had";
    }
  }
  std::vector<int64_t> more((ThreadPool::kMaxSlicePhases + 1) * static_cast<size_t>(n), 1);
  EXPECT_THROW(pool.run_sliced_phases(more.data(), ThreadPool::kMaxSlicePhases + 1, [](int64_t, int) {}), std::invalid_argument);
  EXPECT_THROW(pool.run_sliced_phases(more.data(), 0, [](int64_t, int) {}), std::invalid_argument);
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

// The decode window (spin_us, sharing watch off so a loaded test machine cannot shorten it): a
// list issued 30 ms after the last one, inside a 150 ms window, finds every worker still awake
// (no futex sleep in between); once the window has passed every worker sleeps (one sleep each)
// and the idle pool uses next to no CPU over 200 ms. With the window at 0 they sleep at once.
TEST(ThreadPool, SpinWindowIsHonouredThenWorkersSleep) {
  const std::vector<int> cpus = allowed_cpus();
  ThreadPool::Options opt;
  opt.spin_us = 150000;
  opt.watch_sharing = false;
  ThreadPool pool(cpus, opt);
  std::atomic<int64_t> sum{0};
  pool.run(64, [&](int64_t i, int) { sum.fetch_add(i); });
  const uint64_t sleeps0 = pool.sleeps();
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  pool.run(64, [&](int64_t i, int) { sum.fetch_add(i); });
  EXPECT_EQ(pool.sleeps(), sleeps0) << "a worker slept inside the 150 ms window";
  std::this_thread::sleep_for(std::chrono::milliseconds(400));  // window over (with a loaded machine's margin)
  EXPECT_EQ(pool.sleeps(), sleeps0 + cpus.size()) << "every worker sleeps once after the window";
  const double before = process_cpu_seconds();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const double used = process_cpu_seconds() - before;
  EXPECT_LT(used, 0.010) << "pool of " << pool.size() << " threads used " << used * 1e3 << " ms CPU in 200 ms after its spin window";
  EXPECT_EQ(sum.load(), 2 * (63 * 64 / 2));

  pool.set_spin_us(0);
  pool.run(64, [&](int64_t i, int) { sum.fetch_add(i); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // (The caller may sleep too, waiting for workers that had to be woken.)
  EXPECT_GE(pool.sleeps(), sleeps0 + 2 * cpus.size()) << "with no spin window every worker sleeps right after a list";
  EXPECT_LE(pool.sleeps(), sleeps0 + 2 * cpus.size() + 1);
}

// The sharing watch: a worker whose CPU is also wanted by a busy thread gives up a long spin
// window early and sleeps (here within 200 ms of a 2 s window), where a spinner would take
// turns with the busy thread for the whole window.
TEST(ThreadPool, SpinnerOnASharedCpuSleepsEarly) {
  const int c = allowed_cpus().front();
  ThreadPool pool(std::vector<int>{c}, {2000000, false});
  std::atomic<bool> stop{false};
  std::thread hog([&] {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(c, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    while (!stop.load(std::memory_order_relaxed)) {
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::atomic<int> ran{0};
  const uint64_t before = pool.sleeps(), cut_before = spins_cut_short();
  pool.run(1, [&](int64_t, int) { ran = 1; });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const uint64_t later = pool.sleeps(), cut_later = spins_cut_short();
  stop = true;
  hog.join();
  EXPECT_EQ(ran.load(), 1);
  EXPECT_GE(later, before + 1) << "the worker kept spinning on a CPU it shares with a busy thread";
  EXPECT_GE(cut_later, cut_before + 1) << "a poll given up for sharing is counted";
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
