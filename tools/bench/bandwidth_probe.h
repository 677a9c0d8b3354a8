// Bandwidths measured on this machine for the bound: DRAM read with all cores, O_DIRECT read of
// the model file, and (CUDA builds with a GPU) pinned host-to-device and device memory.
#pragma once
#include <cstddef>
#include <optional>
#include <string>

namespace moraine::bench {

struct Measured {
  std::optional<double> bytes_per_s;
  std::string note;  // how it was measured, or why it was not
};

// Streaming read of a `bytes` buffer on one pinned thread per physical core; best of 3 passes.
Measured measure_dram_read(size_t bytes);
// O_DIRECT reads of the first min(limit, file size) bytes of `path` (page cache bypassed), 4
// threads with 8 MiB requests so an NVMe queue sees some depth.
Measured measure_disk_read(const std::string& path, size_t limit);
// cudaMemcpy from pinned host memory, and a device-to-device copy (counted as read + write).
// "n/a" notes when built without CUDA or when no GPU is present.
Measured measure_pinned_h2d(size_t bytes);
Measured measure_device_memory(size_t bytes);

}  // namespace moraine::bench
