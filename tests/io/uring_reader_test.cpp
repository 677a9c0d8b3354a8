// UringReader against pread: random ranges (aligned and unaligned file offsets, lengths and
// destinations, 1 byte to several MiB, many in flight) of fresh random files, O_DIRECT and
// buffered; bytes around every destination stay untouched; bad ranges, truncated files and
// missing shards give errors naming file and range, never a hang.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "io_worker/uring_reader.h"

namespace {

using moraine::io::IoError;
using moraine::io::ReadRange;
using moraine::io::UringReader;
using moraine::io::UringReaderOptions;
namespace fs = std::filesystem;

constexpr std::uint64_t kA = UringReader::kAlign;

// On the build machine's disk (not /dev/shm) so that O_DIRECT is what a model file gets.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> n{0};
    path_ = fs::temp_directory_path() / ("moraine-io-test-" + std::to_string(getpid()) + "-" + std::to_string(n++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

std::vector<std::byte> random_bytes(std::size_t n, std::mt19937_64& rng) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; i += 8) {
    const std::uint64_t x = rng();
    std::memcpy(v.data() + i, &x, std::min<std::size_t>(8, n - i));
  }
  return v;
}

void write_file(const std::string& path, const std::vector<std::byte>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

// 4 KiB-aligned memory, as an arena is.
struct AlignedBuffer {
  explicit AlignedBuffer(std::size_t n) : bytes(n) {
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
    data = static_cast<std::byte*>(p);
  }
  ~AlignedBuffer() { munmap(data, bytes); }
  std::byte* data;
  std::size_t bytes;
};

std::uint64_t pick_length(std::mt19937_64& rng, std::uint64_t max) {
  std::uint64_t n = 0;
  switch (rng() % 6) {
    case 0: n = 1 + rng() % 16; break;                              // a few bytes
    case 1: n = 1 + rng() % (3 * kA); break;                        // under a few blocks
    case 2: n = (1 + rng() % 64) * kA; break;                       // whole blocks
    case 3: n = (1 + rng() % 8) * kA + rng() % 2 - (rng() % 2); break;   // a block +- 1
    case 4: n = (1 << 20) + rng() % (2 << 20); break;               // expert-sized
    default: n = (3 << 20) + rng() % (3 << 20); break;              // several MiB
  }
  return std::max<std::uint64_t>(1, std::min(n, max));
}

struct Case {
  bool direct;
  unsigned depth;
  std::size_t chunk;
  bool uring = true;   // false: the pread fallback used where io_uring is forbidden
};

class RandomRanges : public ::testing::TestWithParam<Case> {};

TEST_P(RandomRanges, MatchPreadAndTouchNothingElse) {
  const Case c = GetParam();
  std::mt19937_64 rng(1234 + c.depth * 7 + c.chunk + c.direct);
  TempDir dir;
  // Two shards; sizes not a multiple of 4 KiB so ranges can end at an unaligned EOF.
  const std::vector<std::string> paths = {dir.file("m-00001-of-00002.gguf"), dir.file("m-00002-of-00002.gguf")};
  std::vector<std::vector<std::byte>> files = {random_bytes((24 << 20) + 1234, rng), random_bytes((9 << 20) + 77, rng)};
  for (std::size_t i = 0; i < paths.size(); ++i) write_file(paths[i], files[i]);

  UringReaderOptions o;
  o.direct = c.direct;
  o.queue_depth = c.depth;
  o.chunk_bytes = c.chunk;
  o.use_uring = c.uring;
  UringReader reader(paths, o);
  SCOPED_TRACE(reader.describe());
  ASSERT_EQ(reader.file_count(), 2u);
  EXPECT_EQ(reader.file_bytes(0), files[0].size());
  EXPECT_EQ(reader.file_bytes(1), files[1].size());
  if (!c.direct) {
    EXPECT_FALSE(reader.direct_io(0));
  }
  EXPECT_EQ(reader.uring(), c.uring);

  for (int round = 0; round < 2; ++round) {   // the reader is reused between batches
    const int n = 160;
    std::vector<ReadRange> ranges;
    std::vector<std::uint64_t> dest_at;
    std::uint64_t cursor = 0;
    for (int i = 0; i < n; ++i) {
      ReadRange r;
      r.file_index = static_cast<std::uint32_t>(rng() % 2);
      const std::uint64_t size = files[r.file_index].size();
      r.length = pick_length(rng, size);
      switch (rng() % 4) {
        case 0: r.offset = (rng() % ((size - r.length) / kA + 1)) * kA; break;   // aligned
        case 1: r.offset = size - r.length; break;                               // ends at EOF
        default: r.offset = rng() % (size - r.length + 1); break;                // anywhere
      }
      // Destination phase: aligned, the file offset's phase (the O_DIRECT body path) or any.
      const std::uint64_t base = (cursor + 2 * kA) / kA * kA;
      const std::uint64_t phase = rng() % 3 == 0 ? 0 : rng() % 3 == 0 ? r.offset % kA : rng() % kA;
      dest_at.push_back(base + phase);
      cursor = base + phase + r.length;
      ranges.push_back(r);
    }
    AlignedBuffer buf(cursor + 2 * kA);
    std::memset(buf.data, 0xA5, buf.bytes);
    for (int i = 0; i < n; ++i) ranges[i].dest = buf.data + dest_at[i];

    std::vector<double> latency(ranges.size(), -1);
    const auto before = reader.stats();
    const std::uint64_t got = reader.read(ranges, latency);

    std::uint64_t want = 0;
    std::vector<char> covered(buf.bytes, 0);
    for (int i = 0; i < n; ++i) {
      const ReadRange& r = ranges[i];
      want += r.length;
      std::vector<std::byte> expect(r.length);
      const int fd = ::open(paths[r.file_index].c_str(), O_RDONLY);
      ASSERT_EQ(pread(fd, expect.data(), r.length, static_cast<off_t>(r.offset)), static_cast<ssize_t>(r.length));
      ::close(fd);
      ASSERT_EQ(std::memcmp(r.dest, expect.data(), r.length), 0)
          << "range " << i << ": file " << r.file_index << " [" << r.offset << ", +" << r.length << ") into phase "
          << dest_at[i] % kA;
      std::fill_n(covered.begin() + static_cast<std::ptrdiff_t>(dest_at[i]), r.length, 1);
      EXPECT_GT(latency[i], 0.0) << "range " << i;
    }
    for (std::size_t b = 0; b < buf.bytes; ++b) {
      if (!covered[b]) {
        ASSERT_EQ(buf.data[b], std::byte{0xA5}) << "byte " << b << " outside every destination was written";
      }
    }
    EXPECT_EQ(got, want);
    EXPECT_EQ(reader.stats().bytes - before.bytes, want);
    EXPECT_EQ(reader.stats().requests - before.requests, static_cast<std::uint64_t>(n));
    if (reader.direct_io(0)) {
      EXPECT_GT(reader.stats().bounce_bytes - before.bounce_bytes, 0u) << "unaligned ranges must go through the bounce buffer";
    } else if (!reader.direct_io(1)) {
      EXPECT_EQ(reader.stats().bounce_bytes, 0u) << "buffered files are read straight into the destination";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, RandomRanges,
                         ::testing::Values(Case{true, 1, 64 << 10}, Case{true, 16, 1 << 20}, Case{true, 64, 256 << 10},
                                           Case{true, 4, 4 << 10}, Case{false, 8, 1 << 20}, Case{false, 1, 64 << 10},
                                           Case{true, 8, 1 << 20, false}, Case{false, 4, 64 << 10, false}),
                         [](const auto& test) {
                           return std::string(test.param.direct ? "direct" : "buffered") + "_qd" +
                                  std::to_string(test.param.depth) + "_chunk" + std::to_string(test.param.chunk >> 10) + "k" +
                                  (test.param.uring ? "" : "_pread");
                         });

TEST(UringReader, O_DirectOnTheBuildDisk) {
  // ext4/xfs allow O_DIRECT: if this fails the reader silently fell back and every number the
  // bench shows is the page cache's.
  TempDir dir;
  std::mt19937_64 rng(7);
  write_file(dir.file("f"), random_bytes(3 * kA, rng));
  UringReader reader({dir.file("f")});
  EXPECT_TRUE(reader.direct_io(0)) << reader.describe();
}

void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const IoError& e) {
    for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << " lacks " << p;
  }
}

TEST(UringReader, RangePastEndOfFileIsAnErrorNamingFileOffsetAndLength) {
  TempDir dir;
  std::mt19937_64 rng(11);
  const auto bytes = random_bytes(10000, rng);
  write_file(dir.file("a.gguf"), bytes);
  for (bool direct : {true, false}) {
    UringReaderOptions o;
    o.direct = direct;
    UringReader reader({dir.file("a.gguf")}, o);
    std::vector<std::byte> dest(20000);
    const std::uint64_t off = 9000 + rng() % 500, len = 1001 + rng() % 100;
    expect_error([&] { reader.read(std::vector<ReadRange>{{0, off, len, dest.data()}}); },
                 {dir.file("a.gguf"), std::to_string(off), std::to_string(len), "past the end", "10000"});
    // Offset + length wrapping around 2^64 is caught too.
    expect_error([&] { reader.read(std::vector<ReadRange>{{0, ~std::uint64_t{0} - 5, 10, dest.data()}}); },
                 {"past the end"});
    expect_error([&] { reader.read(std::vector<ReadRange>{{1, 0, 10, dest.data()}}); }, {"file index 1", "1 files"});
    // A bad range is found before anything is read: the good one before it did not land.
    std::vector<std::byte> good(100, std::byte{0});
    expect_error([&] { reader.read(std::vector<ReadRange>{{0, 0, 100, good.data()}, {0, 9990, 11, dest.data()}}); },
                 {"range 1"});
    EXPECT_EQ(good, std::vector<std::byte>(100, std::byte{0}));
    // Still usable afterwards.
    ASSERT_EQ(reader.read(std::vector<ReadRange>{{0, 9990, 10, dest.data()}}), 10u);
    EXPECT_EQ(std::memcmp(dest.data(), bytes.data() + 9990, 10), 0);
  }
}

TEST(UringReader, FileTruncatedAfterOpenIsAnErrorNotAHang) {
  TempDir dir;
  std::mt19937_64 rng(13);
  const std::string path = dir.file("t.gguf");
  const auto bytes = random_bytes(8 << 20, rng);
  for (int mode = 0; mode < 3; ++mode) {   // O_DIRECT, buffered, pread fallback
    write_file(path, bytes);
    UringReaderOptions o;
    o.direct = mode != 1;
    o.use_uring = mode != 2;
    o.queue_depth = 8;
    o.chunk_bytes = 256 << 10;
    UringReader reader({path}, o);
    ASSERT_EQ(::truncate(path.c_str(), (3 << 20) + 100), 0);
    AlignedBuffer buf(8 << 20);
    // Several ranges in flight, some past the new end: every read completes, then the error.
    std::vector<ReadRange> ranges = {{0, 0, 1 << 20, buf.data},
                                     {0, (2 << 20) + 5, 3 << 20, buf.data + (1 << 20) + 5},
                                     {0, 5 << 20, 1 << 20, buf.data + (6 << 20)}};
    expect_error([&] { reader.read(ranges); }, {path, "end of the file", "truncated"});
    // The reader drained its ring: a read inside the new size still works.
    ASSERT_EQ(reader.read(std::vector<ReadRange>{{0, 4096 + 3, 5000, buf.data + 1}}), 5000u);
    EXPECT_EQ(std::memcmp(buf.data + 1, bytes.data() + 4096 + 3, 5000), 0);
  }
}

TEST(UringReader, MissingShardOrNotAFileIsAnErrorNamingIt) {
  TempDir dir;
  std::mt19937_64 rng(17);
  write_file(dir.file("m-00001-of-00002.gguf"), random_bytes(5000, rng));
  const std::string missing = dir.file("m-00002-of-00002.gguf");
  expect_error([&] { UringReader r({dir.file("m-00001-of-00002.gguf"), missing}); }, {missing, "cannot open"});
  fs::create_directories(dir.file("sub"));
  expect_error([&] { UringReader r({dir.file("sub")}); }, {dir.file("sub")});
  expect_error([&] { UringReader r({}); }, {"no files"});
  UringReaderOptions o;
  o.queue_depth = 0;
  expect_error([&] { UringReader r({dir.file("m-00001-of-00002.gguf")}, o); }, {"queue depth 0"});
}

TEST(UringReader, EmptyRangesAndLatencySlotsMismatch) {
  TempDir dir;
  std::mt19937_64 rng(19);
  write_file(dir.file("e"), random_bytes(100, rng));
  UringReader reader({dir.file("e")});
  std::vector<double> lat(1, -1);
  EXPECT_EQ(reader.read(std::vector<ReadRange>{{0, 100, 0, nullptr}}, lat), 0u);
  EXPECT_EQ(lat[0], 0.0);
  std::vector<double> two(2);
  std::byte b[4];
  expect_error([&] { reader.read(std::vector<ReadRange>{{0, 0, 4, b}}, two); }, {"2 latency slots for 1 ranges"});
}

}  // namespace
