// The CPU expert worker's thread pool: one pinned thread per listed CPU, fed one flat job list
// at a time. Workers spin for a while after a list (the next one usually follows: the next
// layer of the same token), then sleep on a futex (std::atomic::wait), so an idle pool costs no
// CPU. Optionally the calling thread takes part as worker 0 (Options::caller_joins), so that no
// thread waits on a CPU a worker needs. Running a list allocates nothing.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace moraine::cpu {

// The short spin every wait starts with: a list's phases and the caller's hand-over follow each
// other within a few microseconds.
inline constexpr int kShortSpinUs = 50;

// The spin window for decode, where the pool's lists are a model's layers, one every 0.15-0.5
// ms while tokens are generated (H200 host, 12 GB VRAM budget: expert_cpu 197-229 us p50 per
// layer, the GPU part between two layers 150-300 us). Any window shorter than that gap lets
// every worker fall asleep between two layers, and each layer then pays the futex wake-ups:
// the H200 host's KVM guest has no halt polling (cpuidle "none"), so waking a halted vCPU
// goes through the host. Measured there (moraine-kernel-bench cpu, 16 threads, a list of 16
// empty jobs issued 250 us after the last one): 4.5 us with this window and the caller
// joining, 92 us with a 50 us window, 156 us with 50 us and the caller only waiting (the
// session-3 pool). 2 ms covers the gap with margin and the gaps between tokens of a running
// generation, and costs at most 2 ms of CPU per thread once generation stops (the tests check
// the pool sleeps after it). A spinner that finds its CPU shared stops early (spin_poll): on
// an oversubscribed machine it sleeps as before.
inline constexpr int kDecodeSpinUs = 2000;

// Polls ready() until it is true (returns true), spin_us pass or the CPU turns out to be shared
// (false: sleep now). Shared: over 2% of the last >= 10 ms interval spent waiting for the CPU
// (the scheduler's run_delay for this thread, sampled at most once per interval), or an
// involuntary context switch while spinning (getrusage, read every ~30 us past kShortSpinUs)
// after over 100 us of such waiting. Another task then wants this CPU, and a spinner would
// take turns with it, reacting a scheduler slice late (the 2-core dev box under a parallel
// build: 2.3 ms per empty list after 250 us idle with a 2 ms spin that only yielded, 0.5 ms
// with this watch, 0.3 ms with a 50 us spin). A shared thread spins only kShortSpinUs until
// an interval shows its CPU free again.
// watch_sharing false: spin the whole window regardless (tests, or cores known to be exclusive).
bool spin_poll(bool (*ready)(const void* ctx), const void* ctx, int spin_us, bool watch_sharing = true);
// Polls of this process that gave up before their window because the CPU was found shared (and
// so went to sleep): tells a pool that sleeps because of another thread on its CPUs from one
// whose window simply ran out (the cpu worker reports it as `spin_cut_short`).
uint64_t spins_cut_short();
template <typename Ready>
bool spin_poll(Ready&& ready, int spin_us, bool watch_sharing = true) {
  using R = std::remove_reference_t<Ready>;
  return spin_poll([](const void* c) { return (*static_cast<R*>(const_cast<void*>(c)))(); }, static_cast<const void*>(&ready), spin_us,
                   watch_sharing);
}

class ThreadPool {
 public:
  struct Options {
    // How long a worker keeps polling for the next list after one, and the caller for the end
    // of its list, before sleeping on a futex (values < 0 become 0).
    int spin_us = kShortSpinUs;
    // The thread calling run() runs jobs as worker 0 on cpus[0]; threads are started for
    // cpus[1..] only. The caller should run on cpus[0] (pin_caller()): otherwise it shares a CPU
    // with a pinned worker, and a spinning worker and the caller then take turns on it.
    bool caller_joins = false;
    // Spinners stop early on a CPU found shared (spin_poll); false: always the whole window.
    bool watch_sharing = true;
  };

  // One worker per CPU in `cpus`, each pinned to its CPU (pthread_setaffinity_np); with
  // caller_joins, cpus[0] is the caller's. Two pools with disjoint lists split a node's cores
  // (the worker's --cpus). Throws std::invalid_argument for an empty list, a duplicate or a CPU
  // this process may not use.
  explicit ThreadPool(const std::vector<int>& cpus) : ThreadPool(cpus, Options{}) {}
  ThreadPool(const std::vector<int>& cpus, Options options);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Workers, the caller included when it joins.
  int size() const { return static_cast<int>(cpus_.size()); }
  bool caller_joins() const { return caller_joins_; }

  // Options::spin_us, changeable between lists (workers read it at their next wait).
  void set_spin_us(int us) { spin_us_.store(us < 0 ? 0 : us, std::memory_order_relaxed); }
  int spin_us() const { return spin_us_.load(std::memory_order_relaxed); }
  const std::vector<int>& cpus() const { return cpus_; }
  // Times a worker or the caller went to sleep on a futex (a wait outlasting its spin): at
  // decode, each one costs the next list a wake-up.
  uint64_t sleeps() const { return sleeps_.load(std::memory_order_relaxed); }

  // Pins the calling thread to cpus[0] (the caller's CPU with caller_joins). Throws
  // std::runtime_error when the kernel refuses.
  void pin_caller() const;

  // Calls job(i, worker) for every i in [0, n_jobs) on the workers (worker = 0..size()-1, the
  // index of the thread running it) and returns when all have finished. Jobs are claimed one
  // at a time from a shared counter, so uneven jobs balance. Jobs must not throw. One list at
  // a time: run() is not reentrant and must not be called concurrently on one pool.
  template <typename F>
  void run(int64_t n_jobs, F&& job) {
    using Fn = std::remove_reference_t<F>;
    run_erased(n_jobs, nullptr, 0, [](void* ctx, int64_t i, int w) { (*static_cast<Fn*>(ctx))(i, w); },
               const_cast<void*>(static_cast<const void*>(&job)));
  }

  // Like run(), with the jobs cut into size() slices: slice w is [slice_end[w-1], slice_end[w])
  // (slice_end[-1] = 0; slice_end[size()-1] = the number of jobs, non-decreasing, below 2^31).
  // Worker w runs its own slice's jobs in order from the front first, then helps with the other
  // slices (from w+1 on), taking each one's jobs from the BACK: a helper takes what the owner
  // would have reached last, so the owner's jobs stay one contiguous run of the list (jobs
  // laid out in memory order give each thread one long stream instead of every thread hopping
  // to the next free job) and only its tail moves to idle threads. A job that waits for another
  // one needs an order that keeps the wait deadlock-free (MoeFfn's sliced schedule argues its).
  template <typename F>
  void run_sliced(const int64_t* slice_end, F&& job) {
    run_sliced_phases(slice_end, 1, std::forward<F>(job));
  }

  // Like run_sliced, with the list in `n_phases` (1..kMaxSlicePhases) runs of size() slices each:
  // slice_end has n_phases x size() entries, phase p's slice w ending at slice_end[p * size() + w]
  // (cumulative over the whole list). A worker runs phase p's own slice, then helps with phase
  // p's other slices (from the back), and only then moves on to phase p + 1. So threads done
  // early with a phase take over the rest of that phase before they start on the next one (the
  // expert FFN's gate/up rows before the down rows that wait for them). Deadlock-free when a
  // job waits only for jobs of earlier phases, or of its own slice before it.
  static constexpr int kMaxSlicePhases = 2;
  template <typename F>
  void run_sliced_phases(const int64_t* slice_end, int n_phases, F&& job) {
    using Fn = std::remove_reference_t<F>;
    const bool valid = n_phases >= 1 && n_phases <= kMaxSlicePhases;  // run_erased throws otherwise
    run_erased(valid ? slice_end[n_phases * size() - 1] : 0, slice_end, n_phases, [](void* ctx, int64_t i, int w) { (*static_cast<Fn*>(ctx))(i, w); },
               const_cast<void*>(static_cast<const void*>(&job)));
  }

 private:
  using JobFn = void (*)(void* ctx, int64_t i, int worker);
  void run_erased(int64_t n_jobs, const int64_t* slice_end, int n_phases, JobFn fn, void* ctx);
  void worker_loop(int index);
  // Worker `index`'s part of the current list; the last one out publishes `gen` as finished.
  void work_on_list(int index, uint32_t gen);
  void shutdown();

  std::vector<int> cpus_;
  std::vector<std::thread> workers_;  // worker i + first_thread_ runs on cpus_[i + first_thread_]
  bool caller_joins_ = false;
  int first_thread_ = 0;  // 1 with caller_joins (worker 0 is the caller)
  std::atomic<int> spin_us_{kShortSpinUs};
  bool watch_sharing_ = true;
  std::atomic<uint64_t> sleeps_{0};
  // run_sliced's slices, one cache line each: the unclaimed jobs [next, end) as one word
  // (next in the low 32 bits, end in the high), so the owner's claims at the front and the
  // helpers' at the back are compare-exchanges on the same range and never hand out a job twice.
  struct alignas(64) Slice {
    std::atomic<uint64_t> range{0};
  };
  // The current list. Written by run() before `generation_` is bumped (release), read by the
  // workers after they see the bump (acquire).
  alignas(64) JobFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_jobs_ = 0;
  bool stop_ = false;
  int slice_phases_ = 0;  // 0: a plain list
  // (Beside the list's fields: a worker starting a list reads them all from this one line.)
  std::unique_ptr<Slice[]> slices_;  // run_sliced's: kMaxSlicePhases x size()
  alignas(64) std::atomic<int64_t> next_{0};
  alignas(64) std::atomic<uint32_t> generation_{0};
  alignas(64) std::atomic<int> active_{0};
  alignas(64) std::atomic<uint32_t> finished_generation_{0};
};

}  // namespace moraine::cpu
