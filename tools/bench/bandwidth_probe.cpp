#include "tools/bench/bandwidth_probe.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "kernels/cpu/cpu_topology.h"
#include "kernels/cpu/numa_memory.h"
#include "kernels/cpu/stream_read.h"
#include "kernels/cpu/thread_pool.h"

namespace moraine::bench {

Measured measure_dram_read(size_t bytes, const std::function<void(bool)>& around) {
  bytes = std::max<size_t>(bytes & ~size_t{(1u << 20) - 1}, size_t{1} << 20);
  const std::vector<int> cpus = cpu::physical_core_cpus();
  cpu::ThreadPool pool(cpus);
  cpu::NodeMemory buf(bytes, cpu::numa_node_of_cpu_id(cpus.front()));
  std::memset(buf.data(), 1, buf.size());  // fault every page in before timing
  if (around) around(true);
  const double bw = cpu::measure_read_bandwidth(pool, buf.data(), buf.size(), 3);
  if (around) around(false);
  return {bw, "stream_read, " + std::to_string(cpus.size()) + " threads (" + cpu::format_cpu_list(cpus) + "), " +
                  std::to_string(bytes >> 20) + " MiB, best of 3"};
}

Measured measure_disk_read(const std::string& path, size_t limit) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT);
  if (fd < 0) return {std::nullopt, "O_DIRECT open of " + path + " failed: " + std::strerror(errno)};
  const off_t size = ::lseek(fd, 0, SEEK_END);
  constexpr size_t kChunk = size_t{8} << 20;
  // O_DIRECT wants aligned offsets and lengths: read whole chunks only.
  const size_t total = std::min<size_t>(limit, static_cast<size_t>(std::max<off_t>(size, 0))) / kChunk * kChunk;
  if (total == 0) {
    ::close(fd);
    return {std::nullopt, path + " is smaller than one 8 MiB O_DIRECT request"};
  }
  constexpr int kThreads = 4;
  const size_t n_chunks = total / kChunk;
  std::atomic<size_t> next{0};
  std::atomic<int> error{0};
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> readers;
  for (int i = 0; i < kThreads; ++i) {
    readers.emplace_back([&] {
      void* raw = nullptr;
      if (posix_memalign(&raw, 4096, kChunk) != 0) {
        error = ENOMEM;
        return;
      }
      std::unique_ptr<void, decltype(&std::free)> buf(raw, &std::free);
      for (size_t c; (c = next.fetch_add(1)) < n_chunks;) {
        const ssize_t got = ::pread(fd, buf.get(), kChunk, static_cast<off_t>(c * kChunk));
        if (got != static_cast<ssize_t>(kChunk)) {
          error = got < 0 ? errno : EIO;
          return;
        }
      }
    });
  }
  for (std::thread& t : readers) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::close(fd);
  if (error != 0) return {std::nullopt, "O_DIRECT read of " + path + " failed: " + std::strerror(error.load())};
  return {static_cast<double>(total) / s, "O_DIRECT pread, " + std::to_string(kThreads) + " threads x 8 MiB, first " +
                                              std::to_string(total >> 20) + " MiB of the model file"};
}

}  // namespace moraine::bench
