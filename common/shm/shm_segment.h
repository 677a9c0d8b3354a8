#pragma once
// Named shared-memory segments for the process group's data plane (activations, routing, expert
// outputs, the expert arena). The owner creates a segment under the group's name prefix with
// owner-only permissions (0600) and records its pid (and the pid's start time, so a recycled pid
// is not mistaken for the owner) in a small header; peers open it by locator. The owner unlinks it
// on destruction; segments left by an owner that died (SIGKILL, crash) are reclaimed by the next
// start with reclaim_dead_segments(). All sizes are fixed at creation: nothing is allocated later.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/shm/page_backing.h"

namespace moraine::shm {

inline constexpr std::uint64_t kSegmentMagic = 0x314D48533A524F4DULL;  // "MOR:SHM1" little-endian
inline constexpr std::uint32_t kSegmentVersion = 1;

// First bytes of every segment. Data starts at data_offset (4 KiB, or 2 MiB when huge pages were
// requested so the data keeps 2 MiB alignment).
struct SegmentHeader {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t owner_pid;
  std::uint64_t owner_start_ticks;  // field 22 of /proc/<pid>/stat: tells a recycled pid apart
  std::uint64_t total_bytes;
  std::uint64_t data_offset;
  std::uint64_t data_bytes;
  std::uint32_t backing;            // PageBacking
  std::uint32_t ready;              // stored last via std::atomic_ref (release): peers refuse a
                                    // half-made segment. Plain field so the header stays
                                    // trivially copyable for pread() during reclaim.
};

struct SegmentSpec {
  std::string group_prefix;   // e.g. "moraine-g1234"; [A-Za-z0-9._-], names are "<prefix>-<name>"
  std::string name;           // e.g. "activations", "arena"
  std::size_t data_bytes = 0;
  bool huge_pages = false;    // try 2 MiB pages (hugetlbfs, memfd hugetlb, then shmem THP)
  bool populate = false;      // fault every page in now (and measure what pages the kernel gave)
};

class ShmSegment {
 public:
  // Creates the segment (fails if a live owner already holds the name; a dead owner's segment
  // of that name is reclaimed first). Throws ShmError naming the segment and the failed call.
  static ShmSegment create(const SegmentSpec& spec);
  // Maps an existing segment by locator (a path: "/dev/shm/<name>", a hugetlbfs file, or
  // "/proc/<pid>/fd/<n>" for a memfd). Checks the header; throws ShmError when it is not one.
  static ShmSegment open(const std::string& locator);

  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();  // unmaps; the owner also unlinks the name

  std::byte* data() const { return base_ + header()->data_offset; }
  std::size_t data_bytes() const { return header()->data_bytes; }
  const SegmentHeader* header() const { return reinterpret_cast<const SegmentHeader*>(base_); }
  const std::string& locator() const { return locator_; }
  bool owner() const { return owner_; }
  const PageReport& page_report() const { return report_; }

 private:
  ShmSegment() = default;
  void release() noexcept;

  std::byte* base_ = nullptr;
  std::size_t mapped_bytes_ = 0;
  int fd_ = -1;
  bool owner_ = false;
  std::string locator_;
  std::string unlink_path_;   // empty for memfd (nothing to unlink)
  PageReport report_;
};

struct ReclaimResult {
  std::vector<std::string> removed;   // paths unlinked (owner dead or pid recycled)
  std::vector<std::string> kept;      // "<path>: <why>" for matches left alone (live owner, no header)
};

// Removes segments named "<group_prefix>-*" in /dev/shm (and on a 2 MiB hugetlbfs mount) whose
// recorded owner is dead. Only files owned by this uid are considered.
ReclaimResult reclaim_dead_segments(const std::string& group_prefix);

// Whether `pid` is alive and started at `start_ticks` (0 = do not compare start times).
bool process_alive(std::uint32_t pid, std::uint64_t start_ticks);
// Field 22 of /proc/<pid>/stat, or 0 when unreadable.
std::uint64_t process_start_ticks(std::uint32_t pid);

}  // namespace moraine::shm
