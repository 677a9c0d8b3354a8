// NUMA placement through libnuma.
#include "kernels/cpu/numa_memory.h"

#include <numa.h>
#include <numaif.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace moraine::cpu {

bool numa_available_here() {
  static const bool ok = numa_available() >= 0;
  return ok;
}

int numa_node_count() { return numa_available_here() ? numa_max_node() + 1 : 1; }

int numa_node_of_cpu_id(int cpu) {
  if (cpu < 0 || cpu >= static_cast<int>(sysconf(_SC_NPROCESSORS_CONF))) {
    throw std::invalid_argument("numa_node_of_cpu_id: CPU " + std::to_string(cpu) + " does not exist");
  }
  if (!numa_available_here()) return 0;
  const int node = numa_node_of_cpu(cpu);
  return node < 0 ? 0 : node;
}

NodeMemory::NodeMemory(size_t bytes, int node, bool huge_pages) : bytes_(bytes), node_(node) {
  if (bytes == 0) throw std::invalid_argument("NodeMemory: zero bytes requested");
  if (node < 0 || node >= numa_node_count()) {
    throw std::invalid_argument("NodeMemory: NUMA node " + std::to_string(node) + " does not exist (this machine has " +
                                std::to_string(numa_node_count()) + ")");
  }
  if (numa_available_here()) {
    data_ = numa_alloc_onnode(bytes, node);
    from_numa_ = true;
  } else {
    // No NUMA support (single node by definition): plain anonymous pages.
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : p;
  }
  if (!data_) throw std::runtime_error("NodeMemory: allocating " + std::to_string(bytes) + " bytes on node " + std::to_string(node) + " failed");
  if (huge_pages) (void)madvise(data_, bytes, MADV_HUGEPAGE);  // a hint: failure leaves small pages
  std::memset(data_, 0, bytes);  // fault every page in now, under the node binding
}

NodeMemory::~NodeMemory() { release(); }

NodeMemory::NodeMemory(NodeMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)), node_(other.node_), from_numa_(other.from_numa_) {}

NodeMemory& NodeMemory::operator=(NodeMemory&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    node_ = other.node_;
    from_numa_ = other.from_numa_;
  }
  return *this;
}

void NodeMemory::release() {
  if (!data_) return;
  if (from_numa_) numa_free(data_, bytes_);
  else munmap(data_, bytes_);
  data_ = nullptr;
}

std::optional<int> numa_node_of_address(const void* addr) {
  if (!numa_available_here()) return std::nullopt;
  int node = -1;
  if (get_mempolicy(&node, nullptr, 0, const_cast<void*>(addr), MPOL_F_NODE | MPOL_F_ADDR) != 0) return std::nullopt;
  return node;
}

}  // namespace moraine::cpu
