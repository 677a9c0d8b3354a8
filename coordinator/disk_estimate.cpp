#include "coordinator/disk_estimate.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <memory>
#include <thread>
#include <vector>

#include "coordinator/group_layout.h"   // expert_owner

namespace moraine::group {

DiskEstimate estimate_disk_reads(const PlacementPlan& plan, const ModelSizes& s, const Census& census) {
  DiskEstimate d;
  d.from_census = !census.counts.empty();
  const double k = static_cast<double>(s.n_expert_used);
  struct Use {
    double p;
    std::uint64_t bytes;
  };
  std::vector<std::vector<Use>> per_worker(static_cast<std::size_t>(plan.n_cpu_workers));
  for (std::int64_t il = 0; il < plan.n_layer; ++il) {
    if (s.expert_bytes[static_cast<std::size_t>(il)] == 0) continue;   // a dense layer routes nothing
    d.routed_reads += k;
    double total = 0;
    if (d.from_census) {
      for (const std::uint64_t c : census.counts[static_cast<std::size_t>(il)]) total += static_cast<double>(c);
    }
    for (std::int64_t e = 0; e < plan.n_expert; ++e) {
      if (plan.at(il, e) != Tier::kFile) continue;
      const double p = total > 0 ? std::min(1.0, k * static_cast<double>(census.counts[static_cast<std::size_t>(il)][static_cast<std::size_t>(e)]) / total)
                                 : k / static_cast<double>(plan.n_expert);
      d.file_reads += p;
      per_worker[static_cast<std::size_t>(expert_owner(e, plan.n_cpu_workers))].push_back({p, s.expert_bytes[static_cast<std::size_t>(il)]});
    }
  }
  const std::size_t keep = static_cast<std::size_t>(std::max<std::int64_t>(0, plan.cache_slots - plan.staging_slots));
  for (std::vector<Use>& w : per_worker) {
    std::stable_sort(w.begin(), w.end(), [](const Use& a, const Use& b) { return a.p > b.p; });
    for (std::size_t i = 0; i < w.size(); ++i) {
      if (i < keep) {
        d.cache_hits += w[i].p;
      } else {
        d.disk_bytes += w[i].p * static_cast<double>(w[i].bytes);
      }
    }
  }
  return d;
}

DiskRate measure_disk_rate(const std::string& path, double seconds) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT);
  if (fd < 0) return {std::nullopt, "not measured: O_DIRECT open of " + path + " failed: " + std::strerror(errno)};
  const off_t size = ::lseek(fd, 0, SEEK_END);
  // Whole 4 KiB blocks only (O_DIRECT); 8 MiB requests, or the file's size when it is smaller.
  const std::size_t usable = static_cast<std::size_t>(std::max<off_t>(size, 0)) / kArenaAlign * kArenaAlign;
  const std::size_t chunk = std::min<std::size_t>(std::size_t{8} << 20, usable);
  if (chunk == 0) {
    ::close(fd);
    return {std::nullopt, "not measured: " + path + " is smaller than one 4 KiB block"};
  }
  const std::size_t n_slots = usable / chunk;
  const std::size_t max_reads = std::max<std::size_t>(1, (std::size_t{256} << 20) / chunk);
  constexpr int kThreads = 4;
  std::atomic<std::size_t> next{0}, done_bytes{0};
  std::atomic<int> error{0};
  const auto t0 = std::chrono::steady_clock::now();
  const auto until = t0 + std::chrono::duration<double>(seconds);
  const auto reader = [&] {
    void* raw = nullptr;
    if (posix_memalign(&raw, kArenaAlign, chunk) != 0) {
      error = ENOMEM;
      return;
    }
    std::unique_ptr<void, decltype(&std::free)> buf(raw, &std::free);
    for (std::size_t i; (i = next.fetch_add(1)) < max_reads && std::chrono::steady_clock::now() < until;) {
      // Spread over the file (a stride coprime to most slot counts), not its first MiB only.
      const std::size_t slot = (i * 7919) % n_slots;
      const ssize_t got = ::pread(fd, buf.get(), chunk, static_cast<off_t>(slot * chunk));
      if (got != static_cast<ssize_t>(chunk)) {
        error = got < 0 ? errno : EIO;
        return;
      }
      done_bytes += chunk;
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(reader);
  for (std::thread& t : threads) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::close(fd);
  if (error != 0) return {std::nullopt, "not measured: O_DIRECT read of " + path + " failed: " + std::strerror(error.load())};
  if (done_bytes == 0 || s <= 0) return {std::nullopt, "not measured: no O_DIRECT read finished"};
  char how[160];
  std::snprintf(how, sizeof how, "measured: O_DIRECT, %d threads x %s requests, %s in %.3f s", kThreads,
                format_bytes(chunk).c_str(), format_bytes(done_bytes).c_str(), s);
  return {static_cast<double>(done_bytes) / s, how};
}

std::string disk_line(const DiskEstimate& d, const DiskRate& rate) {
  char line[512];
  const char* routing = d.from_census ? "census routing" : "uniform routing";
  std::snprintf(line, sizeof line,
                "  disk reads: %.2f%% of routed-expert reads per token from the file (%s: %.2f of %.0f reads FILE-tier, "
                "%.2f of them file cache hits), %s/token",
                100.0 * d.fraction(), routing, d.file_reads, d.routed_reads, d.cache_hits,
                format_bytes(static_cast<std::uint64_t>(d.disk_bytes + 0.5)).c_str());
  std::string out = line;
  if (d.disk_bytes <= 0) return out + "; no disk bound (nothing read from the file per token)\n";
  if (!rate.bytes_per_s) return out + "; disk bound n/a (disk rate " + rate.how + "; give --disk-rate)\n";
  std::snprintf(line, sizeof line, "; at %.3f GB/s: at most %.2f tok/s (disk rate %s)\n", *rate.bytes_per_s / 1e9,
                *rate.bytes_per_s / d.disk_bytes, rate.how.c_str());
  return out + line;
}

std::string plan_disk_line(const std::string& rate_text, const model::Model& m, const PlacementPlan& plan, const Census& census) {
  DiskRate rate{std::nullopt, "not measured: no expert is FILE-tier"};
  if (rate_text != "auto") {
    const std::uint64_t r = parse_byte_budget(rate_text, "--disk-rate");
    if (r == 0 || r == kUnlimitedBytes) throw std::invalid_argument("--disk-rate '" + rate_text + "': give bytes per second, e.g. 1.5G");
    rate = {static_cast<double>(r), "given: --disk-rate " + rate_text};
  } else if (plan.file.experts > 0) {
    const std::vector<std::string>& paths = m.file.paths();   // the largest shard holds the experts' bytes
    rate = measure_disk_rate(*std::max_element(paths.begin(), paths.end(), [](const std::string& a, const std::string& b) {
      return std::filesystem::file_size(a) < std::filesystem::file_size(b);
    }));
  }
  return disk_line(estimate_disk_reads(plan, model_sizes(m, plan.context, plan.kv_type), census), rate);
}

}  // namespace moraine::group
