// Bandwidths measured on this machine for the bound: DRAM read with all cores, O_DIRECT read of
// the model file, and (CUDA builds with a GPU) pinned host-to-device and device memory.
#pragma once
#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <utility>

namespace moraine::bench {

struct Measured {
  std::optional<double> bytes_per_s;
  std::string note;  // how it was measured, or why it was not
};

// Streaming read of a `bytes` buffer on one pinned thread per physical core; best of 3 passes.
// `around` (optional) is called with true right before the timed passes and false after them.
Measured measure_dram_read(size_t bytes, const std::function<void(bool)>& around = {});
// O_DIRECT reads of the first min(limit, file size) bytes of `path` (page cache bypassed), 4
// threads with 8 MiB requests so an NVMe queue sees some depth.
Measured measure_disk_read(const std::string& path, size_t limit);
// cudaMemcpy from pinned host memory, and a device-to-device copy (counted as read + write).
// "n/a" notes when built without CUDA or when no GPU is present.
Measured measure_pinned_h2d(size_t bytes);
Measured measure_device_memory(size_t bytes);
// The DRAM read above while another thread copies pinned host memory to the device back to back
// (h2d_bytes a copy), and that copy's bandwidth meanwhile: {dram, pcie}. The bound treats the RAM
// and PCIe tiers as read at once, each at its own bandwidth; on a host whose DRAM the cores
// already saturate, the two share it (n/a notes without a GPU).
std::pair<Measured, Measured> measure_dram_beside_h2d(size_t dram_bytes, size_t h2d_bytes);

}  // namespace moraine::bench
