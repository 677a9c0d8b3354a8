#include "common/shm/shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <type_traits>
#include <utility>

#include "common/shm/shm_error.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels answer EINVAL and we touch pages.
#endif
#ifndef MFD_HUGE_2MB
#define MFD_HUGE_2MB (21U << 26)
#endif

namespace moraine::shm {

static_assert(std::is_trivially_copyable_v<SegmentHeader>);

void throw_errno(const std::string& what, int err) {
  throw ShmError(what + ": " + std::strerror(err));
}

namespace {

constexpr std::size_t kSmallPage = 4096;
constexpr std::size_t kHugePage = 2u << 20;
constexpr const char* kShmDir = "/dev/shm";

std::size_t round_up(std::size_t value, std::size_t align, const std::string& what) {
  if (value > SIZE_MAX - align) throw ShmError(what + ": size " + std::to_string(value) + " overflows");
  return (value + align - 1) / align * align;
}

void check_name_part(const std::string& part, const char* what) {
  if (part.empty()) throw ShmError(std::string("shared-memory ") + what + " is empty");
  if (part.size() > 120) throw ShmError(std::string("shared-memory ") + what + " '" + part + "' is longer than 120 characters");
  for (char c : part) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) throw ShmError(std::string("shared-memory ") + what + " '" + part + "' has a character outside [A-Za-z0-9._-]");
  }
  if (part[0] == '.') throw ShmError(std::string("shared-memory ") + what + " '" + part + "' starts with '.'");
}

struct ProcStat {
  char state = 0;
  std::uint64_t start_ticks = 0;
};

bool read_proc_stat(std::uint32_t pid, ProcStat& out) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!in || !std::getline(in, text)) return false;
  // The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
  const auto close = text.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream fields(text.substr(close + 1));
  std::string field;
  for (int index = 0; fields >> field; ++index) {
    if (index == 0) out.state = field[0];                    // field 3
    if (index == 19) { out.start_ticks = std::stoull(field); return true; }  // field 22
  }
  return false;
}

// Reads a segment header from an open file without mapping it (hugetlbfs mappings must be whole
// huge pages). Returns an empty string on success, else why it is not a moraine segment.
std::string read_header(int fd, SegmentHeader& header) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return std::string("fstat: ") + std::strerror(errno);
  if (!S_ISREG(st.st_mode)) return "not a regular file";
  if (static_cast<std::size_t>(st.st_size) < sizeof(SegmentHeader)) {
    return "size " + std::to_string(st.st_size) + " is smaller than a segment header";
  }
  const ssize_t got = pread(fd, &header, sizeof(header), 0);
  if (got != static_cast<ssize_t>(sizeof(header))) return "short read of the segment header";
  if (header.magic != kSegmentMagic) return "no moraine segment header (bad magic)";
  if (header.version != kSegmentVersion) return "segment header version " + std::to_string(header.version);
  return {};
}

// Maps fd at an address aligned to `align`: THP for shmem only puts a huge page where the
// virtual address is 2 MiB aligned, and the kernel does not align the address for us when
// shmem THP is off or only advised (seen here: address 1.1 MiB past a 2 MiB boundary).
// Reserves align bytes more address space, then maps the file over the aligned part.
void* map_aligned(int fd, std::size_t bytes, std::size_t align) {
  if (align <= kSmallPage) return mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  void* reserve = mmap(nullptr, bytes + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reserve == MAP_FAILED) return MAP_FAILED;
  const auto start = reinterpret_cast<std::uintptr_t>(reserve);
  const auto aligned = (start + align - 1) & ~(std::uintptr_t{align} - 1);
  void* mapped = mmap(reinterpret_cast<void*>(aligned), bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
  if (mapped == MAP_FAILED) {
    const int err = errno;
    munmap(reserve, bytes + align);
    errno = err;
    return MAP_FAILED;
  }
  if (aligned > start) munmap(reserve, aligned - start);
  const std::uintptr_t tail = aligned + bytes;
  if (tail < start + bytes + align) munmap(reinterpret_cast<void*>(tail), start + bytes + align - tail);
  return mapped;
}

struct Attempt {
  int fd = -1;
  std::string locator;
  std::string unlink_path;
  PageBacking backing = PageBacking::kSmallPages;
  std::size_t page = kSmallPage;
};

// Creates name exclusively in /dev/shm with mode 0600. On EEXIST, reclaims the old file when its
// owner is dead and retries once; a live owner is an error.
int create_shm_exclusive(const std::string& full_name) {
  const std::string shm_name = "/" + full_name;
  for (int round = 0; round < 2; ++round) {
    const int fd = shm_open(shm_name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd >= 0) {
      // The umask can only clear bits, but be explicit: owner read/write, nobody else.
      if (fchmod(fd, 0600) != 0) {
        const int err = errno;
        close(fd);
        shm_unlink(shm_name.c_str());
        throw_errno("fchmod 0600 on /dev/shm/" + full_name, err);
      }
      return fd;
    }
    if (errno != EEXIST || round == 1) throw_errno("shm_open(O_CREAT|O_EXCL) of /dev/shm/" + full_name, errno);
    const int old = shm_open(shm_name.c_str(), O_RDONLY, 0);
    if (old < 0) continue;  // vanished meanwhile: retry
    SegmentHeader header{};
    const std::string why = read_header(old, header);
    close(old);
    if (!why.empty()) {
      throw ShmError("/dev/shm/" + full_name + " already exists and is not reclaimable: " + why);
    }
    if (process_alive(header.owner_pid, header.owner_start_ticks)) {
      throw ShmError("/dev/shm/" + full_name + " already exists and its owner pid " +
                     std::to_string(header.owner_pid) + " is alive");
    }
    shm_unlink(shm_name.c_str());
  }
  throw ShmError("could not create /dev/shm/" + full_name);
}

}  // namespace

bool process_alive(std::uint32_t pid, std::uint64_t start_ticks) {
  if (pid == 0) return false;
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM) return false;
  ProcStat stat;
  if (!read_proc_stat(pid, stat)) return true;  // exists but /proc unreadable: assume alive
  if (stat.state == 'Z' || stat.state == 'X') return false;  // killed, not yet reaped
  return start_ticks == 0 || stat.start_ticks == start_ticks;
}

std::uint64_t process_start_ticks(std::uint32_t pid) {
  ProcStat stat;
  return read_proc_stat(pid, stat) ? stat.start_ticks : 0;
}

ShmSegment ShmSegment::create(const SegmentSpec& spec) {
  check_name_part(spec.group_prefix, "group prefix");
  check_name_part(spec.name, "segment name");
  const std::string full_name = spec.group_prefix + "-" + spec.name;
  if (spec.data_bytes == 0) throw ShmError("segment " + full_name + ": data size is 0");

  ShmSegment segment;
  segment.report_.huge_requested = spec.huge_pages;
  const std::size_t data_offset = spec.huge_pages ? kHugePage : kSmallPage;
  const std::size_t total = round_up(round_up(spec.data_bytes, kSmallPage, full_name) + data_offset,
                                     spec.huge_pages ? kHugePage : kSmallPage, full_name);
  std::string notes;
  auto note = [&](const std::string& text) { notes += (notes.empty() ? "" : "; ") + text; };

  // Each attempt yields an fd sized to `total`, then is mapped; a failed mmap falls through to
  // the next kind of backing.
  void* base = MAP_FAILED;
  Attempt chosen;
  if (spec.huge_pages) {
    const std::string mount = find_hugetlbfs_2m_mount();
    if (mount.empty()) {
      note("no 2 MiB hugetlbfs mount");
    } else {
      const std::string path = mount + "/" + full_name;
      const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
      if (fd < 0) {
        note("open " + path + ": " + std::strerror(errno));
      } else if (ftruncate(fd, static_cast<off_t>(total)) != 0 ||
                 (base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
        note("hugetlbfs " + path + ": " + std::strerror(errno) + " (hugetlb pool too small?)");
        close(fd);
        unlink(path.c_str());
      } else {
        chosen = {fd, path, path, PageBacking::kHugetlbfsFile, kHugePage};
      }
    }
    if (base == MAP_FAILED) {
      const int fd = memfd_create(full_name.c_str(), MFD_CLOEXEC | MFD_HUGETLB | MFD_HUGE_2MB);
      if (fd < 0) {
        note(std::string("memfd_create(MFD_HUGETLB): ") + std::strerror(errno));
      } else if (ftruncate(fd, static_cast<off_t>(total)) != 0 ||
                 (base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
        note(std::string("memfd hugetlb mmap: ") + std::strerror(errno) + " (hugetlb pool too small?)");
        close(fd);
      } else {
        // A memfd has no name: peers open it through the owner's fd table, and the kernel frees
        // it when the last holder exits, so nothing is left behind to reclaim.
        chosen = {fd, "/proc/" + std::to_string(getpid()) + "/fd/" + std::to_string(fd), "",
                  PageBacking::kMemfdHugetlb, kHugePage};
      }
    }
  }
  if (base == MAP_FAILED) {
    const int fd = create_shm_exclusive(full_name);
    const std::string path = std::string(kShmDir) + "/" + full_name;
    if (ftruncate(fd, static_cast<off_t>(total)) != 0) {
      const int err = errno;
      close(fd);
      shm_unlink(("/" + full_name).c_str());
      throw_errno("ftruncate " + path + " to " + std::to_string(total) + " bytes", err);
    }
    base = map_aligned(fd, total, spec.huge_pages ? kHugePage : kSmallPage);
    if (base == MAP_FAILED) {
      const int err = errno;
      close(fd);
      shm_unlink(("/" + full_name).c_str());
      throw_errno("mmap " + path + " (" + std::to_string(total) + " bytes)", err);
    }
    chosen = {fd, path, path, PageBacking::kSmallPages, kSmallPage};
    if (spec.huge_pages) {
      if (madvise(base, total, MADV_HUGEPAGE) == 0) {
        chosen.backing = PageBacking::kShmemTransparent;
        const std::string mode = shmem_thp_mode();
        if (mode == "never" || mode == "deny") note("shmem_enabled=" + mode + " (THP for shmem off)");
      } else {
        note(std::string("madvise(MADV_HUGEPAGE): ") + std::strerror(errno));
      }
    }
  }

  segment.base_ = static_cast<std::byte*>(base);
  segment.mapped_bytes_ = total;
  segment.fd_ = chosen.fd;
  segment.owner_ = true;
  segment.locator_ = chosen.locator;
  segment.unlink_path_ = chosen.unlink_path;
  segment.report_.backing = chosen.backing;
  segment.report_.mapped_bytes = total;
  segment.report_.notes = notes;

  // Header: pid first, ready last, so reclaim never sees a ready header without an owner.
  auto* header = new (segment.base_) SegmentHeader{};
  header->magic = kSegmentMagic;
  header->version = kSegmentVersion;
  header->owner_pid = static_cast<std::uint32_t>(getpid());
  header->owner_start_ticks = process_start_ticks(header->owner_pid);
  header->total_bytes = total;
  header->data_offset = data_offset;
  header->data_bytes = spec.data_bytes;
  header->backing = static_cast<std::uint32_t>(chosen.backing);

  if (spec.populate) {
    if (madvise(base, total, MADV_POPULATE_WRITE) != 0) {
      // Older kernel: touch one byte per page (the memory is zero already; the write faults it in).
      for (std::size_t at = data_offset; at < total; at += kSmallPage) {
        reinterpret_cast<volatile std::byte*>(segment.base_)[at] = std::byte{0};
      }
    }
    segment.report_.populated = true;
    measure_mapping(base, segment.report_);
  }
  std::atomic_ref<std::uint32_t>(header->ready).store(1, std::memory_order_release);
  return segment;
}

ShmSegment ShmSegment::open(const std::string& locator) {
  const int fd = ::open(locator.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) throw_errno("open shared-memory segment " + locator, errno);
  SegmentHeader header{};
  const std::string why = read_header(fd, header);
  if (!why.empty()) {
    close(fd);
    throw ShmError("shared-memory segment " + locator + ": " + why);
  }
  struct stat st {};
  fstat(fd, &st);
  if (header.total_bytes != static_cast<std::uint64_t>(st.st_size) ||
      header.data_offset < sizeof(SegmentHeader) || header.data_offset > header.total_bytes ||
      header.data_bytes > header.total_bytes - header.data_offset) {
    close(fd);
    throw ShmError("shared-memory segment " + locator + ": header sizes (total " +
                   std::to_string(header.total_bytes) + ", data " + std::to_string(header.data_offset) +
                   "+" + std::to_string(header.data_bytes) + ") do not match the file size " +
                   std::to_string(st.st_size));
  }
  // A segment laid out for huge pages (data at 2 MiB) is mapped 2 MiB aligned in peers too.
  void* base = map_aligned(fd, header.total_bytes, header.data_offset % kHugePage == 0 ? kHugePage : kSmallPage);
  if (base == MAP_FAILED) {
    const int err = errno;
    close(fd);
    throw_errno("mmap shared-memory segment " + locator, err);
  }
  ShmSegment segment;
  segment.base_ = static_cast<std::byte*>(base);
  segment.mapped_bytes_ = header.total_bytes;
  segment.fd_ = fd;
  segment.owner_ = false;
  segment.locator_ = locator;
  segment.report_.backing = static_cast<PageBacking>(header.backing);
  segment.report_.mapped_bytes = header.total_bytes;
  const auto* mapped = reinterpret_cast<SegmentHeader*>(base);
  if (std::atomic_ref<std::uint32_t>(const_cast<SegmentHeader*>(mapped)->ready).load(std::memory_order_acquire) != 1) {
    throw ShmError("shared-memory segment " + locator + " is not initialised yet (owner pid " +
                   std::to_string(header.owner_pid) + ")");
  }
  return segment;
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept { *this = std::move(other); }

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    release();
    base_ = std::exchange(other.base_, nullptr);
    mapped_bytes_ = std::exchange(other.mapped_bytes_, 0);
    fd_ = std::exchange(other.fd_, -1);
    owner_ = std::exchange(other.owner_, false);
    locator_ = std::move(other.locator_);
    unlink_path_ = std::move(other.unlink_path_);
    report_ = std::move(other.report_);
  }
  return *this;
}

ShmSegment::~ShmSegment() { release(); }

void ShmSegment::release() noexcept {
  if (base_ != nullptr) {
    // A forked child inherits the object but not the ownership: only the creating pid unlinks.
    const bool unlink_it = owner_ && !unlink_path_.empty() &&
                           header()->owner_pid == static_cast<std::uint32_t>(getpid());
    munmap(base_, mapped_bytes_);
    base_ = nullptr;
    if (unlink_it) {
      const std::string shm_prefix = std::string(kShmDir) + "/";
      if (unlink_path_.rfind(shm_prefix, 0) == 0) {
        shm_unlink(("/" + unlink_path_.substr(shm_prefix.size())).c_str());
      } else {
        unlink(unlink_path_.c_str());
      }
    }
  }
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  owner_ = false;
}

ReclaimResult reclaim_dead_segments(const std::string& group_prefix) {
  check_name_part(group_prefix, "group prefix");
  ReclaimResult result;
  const std::string want = group_prefix + "-";
  std::vector<std::string> dirs{kShmDir};
  if (const std::string mount = find_hugetlbfs_2m_mount(); !mount.empty()) dirs.push_back(mount);
  for (const std::string& dir : dirs) {
    std::unique_ptr<DIR, int (*)(DIR*)> listing(opendir(dir.c_str()), closedir);
    if (!listing) continue;
    while (const dirent* entry = readdir(listing.get())) {
      const std::string name = entry->d_name;
      if (name.rfind(want, 0) != 0) continue;
      const std::string path = dir + "/" + name;
      const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
      if (fd < 0) {
        result.kept.push_back(path + ": open: " + std::strerror(errno));
        continue;
      }
      struct stat st {};
      const bool mine = fstat(fd, &st) == 0 && st.st_uid == geteuid();
      SegmentHeader header{};
      const std::string why = mine ? read_header(fd, header) : "owned by another user";
      close(fd);
      if (!why.empty()) {
        result.kept.push_back(path + ": " + why);
        continue;
      }
      if (process_alive(header.owner_pid, header.owner_start_ticks)) {
        result.kept.push_back(path + ": owner pid " + std::to_string(header.owner_pid) + " is alive");
        continue;
      }
      if (unlink(path.c_str()) == 0) {
        result.removed.push_back(path);
      } else {
        result.kept.push_back(path + ": unlink: " + std::strerror(errno));
      }
    }
  }
  return result;
}

}  // namespace moraine::shm
