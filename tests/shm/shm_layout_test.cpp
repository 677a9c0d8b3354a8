// Layout carve-up: regions are aligned, disjoint, in order, inside total_bytes(); bad requests
// and hostile range queries are refused.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "common/shm/doorbell.h"
#include "common/shm/shm_error.h"
#include "common/shm/shm_layout.h"

namespace {

using moraine::shm::ShmError;
using moraine::shm::ShmLayout;

TEST(ShmLayout, RandomLayoutsAreAlignedDisjointAndInside) {
  std::mt19937_64 rng(20261129);
  for (int round = 0; round < 200; ++round) {
    ShmLayout layout;
    const int count = 1 + static_cast<int>(rng() % 12);
    for (int i = 0; i < count; ++i) {
      const std::size_t align = std::size_t{1} << (rng() % 22);  // 1 B .. 2 MiB
      const std::size_t bytes = rng() % (3u << 20);             // zero-sized regions allowed
      layout.add("r" + std::to_string(i), bytes, align);
    }
    const auto& regions = layout.regions();
    ASSERT_EQ(regions.size(), static_cast<std::size_t>(count));
    std::size_t end = 0;
    for (const auto& r : regions) {
      EXPECT_EQ(r.offset % r.align, 0u) << r.name;
      EXPECT_GE(r.offset, end) << r.name << " overlaps the previous region";
      EXPECT_LT(r.offset - end, r.align) << r.name << " wastes more than its alignment";
      end = r.offset + r.bytes;
      EXPECT_EQ(&layout.region(r.name), &r);
    }
    EXPECT_GE(layout.total_bytes(), end);
    EXPECT_EQ(layout.total_bytes() % layout.max_align(), 0u);
  }
}

TEST(ShmLayout, DoorbellsGetOneCacheLineEach) {
  ShmLayout layout;
  layout.add("activations", 12345, 4096).add_doorbells("handoff", 96).add("routing", 77, 64);
  const auto& bells = layout.region("handoff");
  EXPECT_EQ(bells.offset % 64, 0u);
  EXPECT_EQ(bells.bytes, 96u * 64u);
  EXPECT_GE(layout.region("routing").offset, bells.offset + bells.bytes);
}

TEST(ShmLayout, RefusesBadRequests) {
  ShmLayout layout;
  layout.add("a", 100);
  EXPECT_THROW(layout.add("a", 100), ShmError);
  EXPECT_THROW(layout.add("b", 100, 3), ShmError);
  EXPECT_THROW(layout.add("c", 100, 0), ShmError);
  EXPECT_THROW(layout.add("", 100), ShmError);
  EXPECT_THROW(layout.add("huge", SIZE_MAX - 10), ShmError);
  EXPECT_THROW(layout.region("missing"), ShmError);
  try {
    layout.region("missing");
  } catch (const ShmError& e) {
    EXPECT_NE(std::string(e.what()).find("'missing'"), std::string::npos);
  }
}

TEST(ShmLayout, ContainsIsOverflowSafe) {
  ShmLayout layout;
  layout.add("pad", 10).add("outputs", 4096, 256);
  const auto& r = layout.region("outputs");
  EXPECT_TRUE(r.contains(r.offset, r.bytes));
  EXPECT_TRUE(r.contains(r.offset + r.bytes, 0));
  EXPECT_FALSE(r.contains(r.offset + 1, r.bytes));
  EXPECT_FALSE(r.contains(r.offset - 1, 1));
  EXPECT_FALSE(r.contains(UINT64_MAX, 2));
  EXPECT_FALSE(r.contains(r.offset + 8, UINT64_MAX - 4));
}

}  // namespace
