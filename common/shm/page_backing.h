#pragma once
// What a shared-memory mapping actually got from the kernel: huge pages are asked for, never
// assumed. The expert arena wants 2 MB pages (fewer TLB misses when the CPU pool streams experts,
// and cudaHostRegister pins fewer pages); whether it gets them depends on the host (a hugetlb pool,
// a hugetlbfs mount, /sys/kernel/mm/transparent_hugepage/shmem_enabled), so the segment reports
// what it got and the caller prints it.
#include <cstddef>
#include <string>

namespace moraine::shm {

enum class PageBacking {
  kSmallPages,          // ordinary shmem (4 KiB pages)
  kHugetlbfsFile,       // file on a hugetlbfs mount (MAP_HUGETLB semantics, reserved pages)
  kMemfdHugetlb,        // memfd_create(MFD_HUGETLB | MFD_HUGE_2MB)
  kShmemTransparent,    // /dev/shm + madvise(MADV_HUGEPAGE); huge_bytes says how much the kernel gave
};

const char* page_backing_name(PageBacking backing);

struct PageReport {
  bool huge_requested = false;
  PageBacking backing = PageBacking::kSmallPages;
  std::size_t mapped_bytes = 0;
  // Measured from /proc/self/smaps after the mapping was populated (KernelPageSize, *PmdMapped),
  // not inferred from which call succeeded. 0 when not populated or not measurable.
  std::size_t kernel_page_bytes = 0;
  std::size_t huge_bytes = 0;
  bool populated = false;
  std::string notes;    // why each huge-page attempt that failed, failed

  std::string describe() const;
};

// Reads /proc/self/smaps for the mapping that starts at `addr` and fills kernel_page_bytes and
// huge_bytes. Returns false when the mapping is not found (e.g. /proc not mounted).
bool measure_mapping(const void* addr, PageReport& report);

// /sys/kernel/mm/transparent_hugepage/shmem_enabled with the active choice, e.g. "never";
// empty when the file is absent.
std::string shmem_thp_mode();

// Mount point of a hugetlbfs with 2 MiB pages, or empty.
std::string find_hugetlbfs_2m_mount();

}  // namespace moraine::shm
