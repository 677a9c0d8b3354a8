// The bound arithmetic on cases computed by hand, and the size parser of --vram/--ram.
#include <gtest/gtest.h>

#include "tools/bench/bench_cli.h"
#include "tools/bench/bound.h"

namespace moraine::bench {
namespace {

constexpr int kVram = static_cast<int>(Tier::Vram);
constexpr int kPcie = static_cast<int>(Tier::Pcie);
constexpr int kRam = static_cast<int>(Tier::Ram);
constexpr int kDisk = static_cast<int>(Tier::Disk);

TEST(DecodeBound, RamOnlyIsBandwidthOverBytes) {
  std::array<double, kTierCount> bytes{};
  bytes[kRam] = 2e9;  // 2 GB per token at 50 GB/s: 40 ms per token, 25 tok/s
  TierBandwidth bw;
  bw[kRam] = 50e9;
  bw[kDisk] = 3e9;  // measured but unused: must not matter
  const Bound b = decode_bound(bytes, bw);
  ASSERT_TRUE(b.tok_s.has_value());
  EXPECT_DOUBLE_EQ(*b.tok_s, 25.0);
  EXPECT_EQ(b.limiting, Tier::Ram);
}

TEST(DecodeBound, SlowestTierSetsTheBoundNotTheSum) {
  std::array<double, kTierCount> bytes{};
  bytes[kVram] = 3e9;   // 3 GB at 4.8 TB/s  = 0.625 ms
  bytes[kPcie] = 0.5e9; // 0.5 GB at 50 GB/s = 10 ms   <- slowest
  bytes[kRam] = 0.4e9;  // 0.4 GB at 80 GB/s = 5 ms
  bytes[kDisk] = 1e6;   // 1 MB at 5 GB/s    = 0.2 ms
  TierBandwidth bw;
  bw[kVram] = 4.8e12;
  bw[kPcie] = 50e9;
  bw[kRam] = 80e9;
  bw[kDisk] = 5e9;
  const Bound b = decode_bound(bytes, bw);
  ASSERT_TRUE(b.tok_s.has_value());
  EXPECT_DOUBLE_EQ(*b.tok_s, 100.0);  // 1 / 10 ms
  EXPECT_EQ(b.limiting, Tier::Pcie);

  bytes[kDisk] = 0.1e9;  // now 20 ms from disk: 50 tok/s, disk-bound
  const Bound d = decode_bound(bytes, bw);
  EXPECT_DOUBLE_EQ(*d.tok_s, 50.0);
  EXPECT_EQ(d.limiting, Tier::Disk);
}

TEST(DecodeBound, UnmeasuredTierWithBytesGivesNoBound) {
  std::array<double, kTierCount> bytes{};
  bytes[kVram] = 1e9;
  bytes[kRam] = 1e9;
  TierBandwidth bw;
  bw[kRam] = 50e9;  // vram bandwidth n/a (no GPU)
  const Bound b = decode_bound(bytes, bw);
  EXPECT_FALSE(b.tok_s.has_value());
  EXPECT_NE(b.why_none.find("vram"), std::string::npos) << b.why_none;
}

TEST(DecodeBound, NoBytesGivesNoBound) {
  const Bound b = decode_bound({}, TierBandwidth{});
  EXPECT_FALSE(b.tok_s.has_value());
  EXPECT_FALSE(b.why_none.empty());
}

TEST(ParseSize, BinaryUnits) {
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_EQ(parse_size("512M"), 512ull << 20);
  EXPECT_EQ(parse_size("12G"), 12ull << 30);
  EXPECT_EQ(parse_size("12GiB"), 12ull << 30);
  EXPECT_EQ(parse_size("1.5G"), 3ull << 29);
  EXPECT_EQ(parse_size("2T"), 2ull << 40);
  for (const char* bad : {"", "G", "12X", "-1G", "twelve", "nanG"}) {
    EXPECT_THROW(parse_size(bad), std::invalid_argument) << bad;
  }
}

}  // namespace
}  // namespace moraine::bench
