#include "common/shm/page_backing.h"

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace moraine::shm {

const char* page_backing_name(PageBacking backing) {
  switch (backing) {
    case PageBacking::kSmallPages: return "small pages (shmem)";
    case PageBacking::kHugetlbfsFile: return "hugetlbfs file (2 MiB pages)";
    case PageBacking::kMemfdHugetlb: return "memfd MFD_HUGETLB (2 MiB pages)";
    case PageBacking::kShmemTransparent: return "shmem + MADV_HUGEPAGE";
  }
  return "unknown";
}

std::string PageReport::describe() const {
  std::ostringstream out;
  out << page_backing_name(backing) << ", " << mapped_bytes << " bytes mapped";
  if (populated) {
    out << ", kernel page " << kernel_page_bytes / 1024 << " KiB, " << huge_bytes
        << " bytes on huge pages";
  } else {
    out << " (not populated: page use not measured)";
  }
  if (huge_requested && !notes.empty()) out << "; huge pages: " << notes;
  return out.str();
}

bool measure_mapping(const void* addr, PageReport& report) {
  std::ifstream smaps("/proc/self/smaps");
  if (!smaps) return false;
  const auto want = reinterpret_cast<std::uintptr_t>(addr);
  std::string line;
  bool in_mapping = false;
  bool found = false;
  std::size_t pmd_kb = 0;
  while (std::getline(smaps, line)) {
    unsigned long start = 0, end = 0;
    // A mapping header line is "start-end perms offset dev inode path"; field lines are "Key: v".
    if (std::sscanf(line.c_str(), "%lx-%lx ", &start, &end) == 2 && line.find(':') > line.find(' ')) {
      if (in_mapping) break;
      in_mapping = (start == want);
      continue;
    }
    if (!in_mapping) continue;
    found = true;
    unsigned long kb = 0;
    if (std::sscanf(line.c_str(), "KernelPageSize: %lu kB", &kb) == 1) {
      report.kernel_page_bytes = kb * 1024;
    } else if (std::sscanf(line.c_str(), "ShmemPmdMapped: %lu kB", &kb) == 1 ||
               std::sscanf(line.c_str(), "FilePmdMapped: %lu kB", &kb) == 1) {
      pmd_kb += kb;
    } else if (std::sscanf(line.c_str(), "Shared_Hugetlb: %lu kB", &kb) == 1 ||
               std::sscanf(line.c_str(), "Private_Hugetlb: %lu kB", &kb) == 1) {
      pmd_kb += kb;
    }
  }
  if (found) report.huge_bytes = pmd_kb * 1024;
  return found;
}

std::string shmem_thp_mode() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  std::string text;
  if (!in || !std::getline(in, text)) return {};
  const auto open = text.find('[');
  const auto close = text.find(']');
  if (open == std::string::npos || close == std::string::npos || close < open) return text;
  return text.substr(open + 1, close - open - 1);
}

std::string find_hugetlbfs_2m_mount() {
  std::ifstream mounts("/proc/mounts");
  std::string device, dir, type, options;
  std::string line;
  while (std::getline(mounts, line)) {
    std::istringstream fields(line);
    if (!(fields >> device >> dir >> type >> options)) continue;
    if (type != "hugetlbfs") continue;
    // No pagesize= option means the default huge page size, 2 MiB on x86-64.
    const auto at = options.find("pagesize=");
    if (at == std::string::npos || options.compare(at, 11, "pagesize=2M") == 0) return dir;
  }
  return {};
}

}  // namespace moraine::shm
