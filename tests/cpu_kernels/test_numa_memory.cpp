// NUMA placement: memory asked for on a node is usable, zeroed and (where the kernel tells)
// on that node; nodes that do not exist are refused. Works on one-node machines.
#include <gtest/gtest.h>

#include <cstring>
#include <utility>

#include "kernels/cpu/cpu_topology.h"
#include "kernels/cpu/numa_memory.h"

namespace moraine::cpu {
namespace {

TEST(NumaMemory, AllocatesOnEveryNodeAndPagesLiveThere) {
  const int nodes = numa_node_count();
  ASSERT_GE(nodes, 1);
  for (int node = 0; node < nodes; ++node) {
    constexpr size_t kBytes = (4u << 20) + 123;
    NodeMemory m(kBytes, node);
    ASSERT_NE(m.data(), nullptr);
    EXPECT_EQ(m.size(), kBytes);
    const auto* p = static_cast<const uint8_t*>(m.data());
    size_t nonzero = 0;
    for (size_t i = 0; i < kBytes; i += 1009) nonzero += p[i] != 0;
    EXPECT_EQ(nonzero, 0u);
    std::memset(m.data(), 0x5a, kBytes);
    if (numa_available_here()) {
      for (size_t off : {size_t{0}, kBytes / 2, kBytes - 1}) {
        EXPECT_EQ(numa_node_of_address(p + off), node) << "byte " << off;
      }
    }
  }
}

// The huge-page hint changes only the backing: the memory is still zeroed, writable and on
// its node (whether THP granted huge pages depends on the kernel's setting; not asserted).
TEST(NumaMemory, HugePageHintKeepsTheContract) {
  constexpr size_t kBytes = (8u << 20) + 4096 + 17;
  NodeMemory m(kBytes, 0, true);
  ASSERT_NE(m.data(), nullptr);
  auto* p = static_cast<uint8_t*>(m.data());
  size_t nonzero = 0;
  for (size_t i = 0; i < kBytes; i += 997) nonzero += p[i] != 0;
  EXPECT_EQ(nonzero, 0u);
  for (size_t i = 0; i < kBytes; i += 4093) p[i] = static_cast<uint8_t>(i * 31);
  for (size_t i = 0; i < kBytes; i += 4093) ASSERT_EQ(p[i], static_cast<uint8_t>(i * 31)) << "byte " << i;
  if (numa_available_here()) {
    EXPECT_EQ(numa_node_of_address(p + kBytes / 2), 0);
  }
}

TEST(NumaMemory, MovesAndRefusesBadRequests) {
  NodeMemory a(1 << 16, 0);
  void* p = a.data();
  NodeMemory b(std::move(a));
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from state is specified
  EXPECT_THROW(NodeMemory(1 << 16, numa_node_count()), std::invalid_argument);
  EXPECT_THROW(NodeMemory(1 << 16, -1), std::invalid_argument);
  EXPECT_THROW(NodeMemory(0, 0), std::invalid_argument);
}

TEST(NumaMemory, CpusBelongToExistingNodes) {
  for (int c : allowed_cpus()) {
    const int node = numa_node_of_cpu_id(c);
    EXPECT_GE(node, 0);
    EXPECT_LT(node, numa_node_count());
  }
  EXPECT_THROW(numa_node_of_cpu_id(1 << 20), std::invalid_argument);
}

}  // namespace
}  // namespace moraine::cpu
