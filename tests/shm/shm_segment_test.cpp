// Named shared-memory segments: mapping across processes, owner-only permissions, reclaim after
// the owner is SIGKILLed, removal on clean exit, and what huge-page request actually got.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "common/shm/shm_error.h"
#include "common/shm/shm_segment.h"
#include "tests/shm/child_process.h"

namespace {

using moraine::shm::PageBacking;
using moraine::shm::SegmentSpec;
using moraine::shm::ShmError;
using moraine::shm::ShmSegment;
using moraine::test::Child;
using moraine::test::Pipe;
using namespace std::chrono_literals;

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

std::vector<std::uint64_t> random_words(std::size_t count, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::uint64_t> words(count);
  for (auto& w : words) w = rng();
  return words;
}

TEST(ShmSegment, ChildMapsAndWritesParentReads) {
  const std::string prefix = moraine::test::test_group_prefix("map");
  ShmSegment segment = ShmSegment::create({prefix, "exchange", 3 * 4096 + 100, false, false});
  ASSERT_EQ(segment.header()->owner_pid, static_cast<std::uint32_t>(getpid()));
  ASSERT_EQ(segment.locator(), "/dev/shm/" + prefix + "-exchange");
  const std::size_t words = segment.data_bytes() / sizeof(std::uint64_t);
  const std::string locator = segment.locator();

  Child child([&] {
    ShmSegment peer = ShmSegment::open(locator);
    if (peer.owner() || peer.data_bytes() != 3 * 4096 + 100) return 2;
    const auto expected = random_words(words, 1234);
    std::memcpy(peer.data(), expected.data(), words * sizeof(std::uint64_t));
    return 0;
  });
  ASSERT_EQ(child.wait(10s), 0);
  const auto expected = random_words(words, 1234);
  EXPECT_EQ(std::memcmp(segment.data(), expected.data(), words * sizeof(std::uint64_t)), 0);
  // The child's mapping went away with it; the segment is still ours.
  EXPECT_TRUE(path_exists(locator));
}

TEST(ShmSegment, PermissionsAreOwnerOnlyWhateverTheUmask) {
  const std::string prefix = moraine::test::test_group_prefix("perm");
  const mode_t old_umask = umask(0);
  ShmSegment segment = ShmSegment::create({prefix, "perm", 4096, false, false});
  umask(old_umask);
  struct stat st {};
  ASSERT_EQ(::stat(segment.locator().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_uid, geteuid());
}

TEST(ShmSegment, RemovedOnCleanExitAndMoveKeepsOwnership) {
  const std::string prefix = moraine::test::test_group_prefix("clean");
  std::string locator;
  {
    ShmSegment first = ShmSegment::create({prefix, "clean", 8192, false, false});
    locator = first.locator();
    ShmSegment moved = std::move(first);
    EXPECT_TRUE(moved.owner());
    EXPECT_TRUE(path_exists(locator));
  }
  EXPECT_FALSE(path_exists(locator));
  // A peer's mapping does not unlink on its destruction.
  ShmSegment owner = ShmSegment::create({prefix, "clean", 8192, false, false});
  { ShmSegment peer = ShmSegment::open(owner.locator()); }
  EXPECT_TRUE(path_exists(owner.locator()));
}

TEST(ShmSegment, LiveOwnerBlocksSecondCreate) {
  const std::string prefix = moraine::test::test_group_prefix("live");
  ShmSegment segment = ShmSegment::create({prefix, "busy", 4096, false, false});
  try {
    ShmSegment::create({prefix, "busy", 4096, false, false});
    FAIL() << "second create of a live segment succeeded";
  } catch (const ShmError& e) {
    EXPECT_NE(std::string(e.what()).find("is alive"), std::string::npos) << e.what();
  }
}

// A child creates segments and is SIGKILLed (no destructors run): the files stay behind. The next
// start reclaims them, both by the explicit scan and by creating the same name again.
TEST(ShmSegment, ReclaimAfterOwnerIsKilled) {
  const std::string prefix = moraine::test::test_group_prefix("reclaim");
  Pipe ready;
  Pipe never;  // the child blocks reading this until it is killed
  Child child([&] {
    ShmSegment a = ShmSegment::create({prefix, "victim-a", 4096, false, false});
    ShmSegment b = ShmSegment::create({prefix, "victim-b", 4096, false, false});
    ready.write_line(a.locator() + " " + b.locator());
    std::string ignored;
    never.read_line(ignored, 60s);
    return 0;
  });
  never.close_read();
  std::string line;
  ASSERT_TRUE(ready.read_line(line, 10s)) << "child did not create its segments";
  const std::string path_a = line.substr(0, line.find(' '));
  const std::string path_b = line.substr(line.find(' ') + 1);
  ASSERT_TRUE(path_exists(path_a));
  ASSERT_TRUE(path_exists(path_b));

  // A live segment of ours under the same prefix must survive the scan.
  ShmSegment mine = ShmSegment::create({prefix, "mine", 4096, false, false});
  {
    const auto before = moraine::shm::reclaim_dead_segments(prefix);
    EXPECT_TRUE(before.removed.empty()) << "reclaimed while the owner is alive: " << before.removed.front();
  }

  child.kill_now();
  EXPECT_EQ(child.wait(10s), 128 + SIGKILL);
  ASSERT_TRUE(path_exists(path_a)) << "SIGKILL cannot run destructors: the file must still be there";

  // Recreating a dead owner's name reclaims it.
  ShmSegment again = ShmSegment::create({prefix, "victim-a", 4096, false, false});
  EXPECT_EQ(again.header()->owner_pid, static_cast<std::uint32_t>(getpid()));

  const auto result = moraine::shm::reclaim_dead_segments(prefix);
  ASSERT_EQ(result.removed.size(), 1u);
  EXPECT_EQ(result.removed[0], path_b);
  EXPECT_FALSE(path_exists(path_b));
  EXPECT_TRUE(path_exists(mine.locator()));
  EXPECT_TRUE(path_exists(again.locator()));
  EXPECT_EQ(result.kept.size(), 2u);
}

TEST(ShmSegment, OpenRejectsFilesThatAreNotSegments) {
  const std::string prefix = moraine::test::test_group_prefix("junk");
  const std::string path = "/dev/shm/" + prefix + "-junk";
  {
    std::ofstream junk(path, std::ios::binary);
    std::mt19937_64 rng(7);
    for (int i = 0; i < 1024; ++i) {
      const std::uint64_t w = rng();
      junk.write(reinterpret_cast<const char*>(&w), sizeof(w));
    }
  }
  try {
    ShmSegment::open(path);
    FAIL() << "opened random bytes as a segment";
  } catch (const ShmError& e) {
    EXPECT_NE(std::string(e.what()).find("bad magic"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  // The scan leaves it alone (not ours to delete) and says why.
  const auto result = moraine::shm::reclaim_dead_segments(prefix);
  EXPECT_TRUE(result.removed.empty());
  EXPECT_TRUE(path_exists(path));
  ::unlink(path.c_str());
  EXPECT_THROW(ShmSegment::open("/dev/shm/" + prefix + "-absent"), ShmError);
}

TEST(ShmSegment, RejectsBadNamesAndSizes) {
  EXPECT_THROW(ShmSegment::create({"moraine-test", "a/b", 4096, false, false}), ShmError);
  EXPECT_THROW(ShmSegment::create({"", "x", 4096, false, false}), ShmError);
  EXPECT_THROW(ShmSegment::create({"moraine-test", "..", 4096, false, false}), ShmError);
  EXPECT_THROW(ShmSegment::create({moraine::test::test_group_prefix("zero"), "x", 0, false, false}), ShmError);
}

// Huge pages are asked for; what came back is measured from /proc/self/smaps and reported.
TEST(ShmSegment, HugePageRequestReportsWhatItGot) {
  const std::string prefix = moraine::test::test_group_prefix("huge");
  const std::size_t bytes = 8u << 20;
  ShmSegment arena = ShmSegment::create({prefix, "arena", bytes, true, true});
  const auto& report = arena.page_report();
  std::printf("expert arena: %s\n", report.describe().c_str());
  EXPECT_TRUE(report.huge_requested);
  EXPECT_TRUE(report.populated);
  EXPECT_GE(report.mapped_bytes, bytes + (2u << 20));
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(arena.data()) % (2u << 20), 0u)
      << "arena data must keep 2 MiB alignment relative to the mapping";
  ASSERT_GT(report.kernel_page_bytes, 0u) << "mapping not found in /proc/self/smaps";
  if (report.backing == PageBacking::kHugetlbfsFile || report.backing == PageBacking::kMemfdHugetlb) {
    EXPECT_EQ(report.kernel_page_bytes, 2u << 20);
    EXPECT_EQ(report.huge_bytes, report.mapped_bytes);
  } else {
    EXPECT_FALSE(report.notes.empty()) << "fell back to shmem without saying why";
    EXPECT_LE(report.huge_bytes, report.mapped_bytes);
  }
  // A peer maps the same memory whatever the backing.
  std::memset(arena.data(), 0x5a, 4096);
  ShmSegment peer = ShmSegment::open(arena.locator());
  EXPECT_EQ(static_cast<unsigned char>(peer.data()[4095]), 0x5au);
}

}  // namespace
