// Memory placed on one NUMA node, for the slice of the expert arena a worker's threads read:
// a CPU worker pinned to one node's cores reads its experts at that node's DRAM bandwidth only
// when the pages live there.
#pragma once
#include <cstddef>
#include <optional>

namespace moraine::cpu {

bool numa_available_here();  // libnuma works on this kernel (false in some containers)
int numa_node_count();       // 1 when NUMA is unavailable
// The node a CPU belongs to (0 when NUMA is unavailable). Throws for a CPU that does not exist.
int numa_node_of_cpu_id(int cpu);

// `bytes` of zeroed memory bound to `node` (libnuma numa_alloc_onnode: mmap + mbind; pages are
// faulted in here so they are placed now, not on first use by some other thread). Freed on
// destruction. Throws std::invalid_argument for a node that does not exist or zero bytes, and
// std::runtime_error when the allocation fails. huge_pages: madvise(MADV_HUGEPAGE) before the
// pages are faulted in, so transparent huge pages back them where the kernel allows it
// (THP "always" or "madvise"): a TLB entry then covers 2 MiB of streamed expert bytes instead
// of 4 KiB. A hint: without THP the memory is simply made of small pages.
class NodeMemory {
 public:
  NodeMemory(size_t bytes, int node, bool huge_pages = false);
  ~NodeMemory();
  NodeMemory(NodeMemory&& other) noexcept;
  NodeMemory& operator=(NodeMemory&& other) noexcept;
  NodeMemory(const NodeMemory&) = delete;
  NodeMemory& operator=(const NodeMemory&) = delete;

  void* data() const { return data_; }
  size_t size() const { return bytes_; }
  int node() const { return node_; }

 private:
  void release();
  void* data_ = nullptr;
  size_t bytes_ = 0;
  int node_ = 0;
  bool from_numa_ = false;
};

// The node the page holding `addr` is on (get_mempolicy MPOL_F_NODE|MPOL_F_ADDR); nullopt
// when it cannot be told (no NUMA support).
std::optional<int> numa_node_of_address(const void* addr);

}  // namespace moraine::cpu
