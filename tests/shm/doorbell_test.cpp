// Sequence-number doorbells across processes: every sequence number arrives, none is lost to a
// wakeup race, through both the spin path and the futex path, within a bounded time; a wait on a
// silent producer times out.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <random>

#include "common/shm/doorbell.h"
#include "common/shm/shm_layout.h"
#include "common/shm/shm_segment.h"
#include "tests/shm/child_process.h"

namespace {

using moraine::shm::Doorbell;
using moraine::shm::ShmLayout;
using moraine::shm::ShmSegment;
using moraine::shm::WaitResult;
using moraine::shm::WaitStats;
using moraine::test::Child;
using namespace std::chrono_literals;

struct PingPong {
  ShmLayout layout;
  ShmSegment segment;
  Doorbell* ping;
  Doorbell* pong;
  std::uint64_t* payload;   // the data a doorbell publishes

  explicit PingPong(const std::string& tag)
      : layout(ShmLayout().add_doorbells("ping", 1).add_doorbells("pong", 1).add("payload", 64 * 8, 64)),
        segment(ShmSegment::create({moraine::test::test_group_prefix(tag.c_str()), "bells", layout.total_bytes(), false, false})),
        ping(Doorbell::init_at(layout.region("ping").at<void>(segment.data()))),
        pong(Doorbell::init_at(layout.region("pong").at<void>(segment.data()))),
        payload(layout.region("payload").at<std::uint64_t>(segment.data())) {}
};

// Lock-step round trips: the parent publishes a random payload and rings ping=i; the child waits,
// answers payload*3+i in the next slot and rings pong=i. With spin 0 every wait that finds the
// bell silent goes through FUTEX_WAIT, which is where a lost wakeup would hang (and time out).
void round_trips(std::chrono::nanoseconds spin, std::uint64_t n, const char* tag) {
  PingPong pp(tag);
  Child child([&] {
    ShmSegment peer = ShmSegment::open(pp.segment.locator());
    Doorbell* ping = Doorbell::at(pp.layout.region("ping").at<void>(peer.data()));
    Doorbell* pong = Doorbell::at(pp.layout.region("pong").at<void>(peer.data()));
    auto* payload = pp.layout.region("payload").at<std::uint64_t>(peer.data());
    for (std::uint64_t i = 1; i <= n; ++i) {
      WaitStats stats;
      if (ping->wait_for(i, 5s, spin, &stats) != WaitResult::kReady) return 3;
      if (stats.observed != i) return 4;  // lock-step: the parent cannot be ahead
      payload[1] = payload[0] * 3 + i;
      pong->ring(i);
    }
    return 0;
  });
  std::mt19937_64 rng(99);
  std::uint64_t sleeps = 0;
  const auto start = std::chrono::steady_clock::now();
  for (std::uint64_t i = 1; i <= n; ++i) {
    const std::uint64_t value = rng();
    pp.payload[0] = value;
    pp.ping->ring(i);
    WaitStats stats;
    ASSERT_EQ(pp.pong->wait_for(i, 5s, spin, &stats), WaitResult::kReady) << "round trip " << i << " lost";
    ASSERT_EQ(stats.observed, i);
    ASSERT_EQ(pp.payload[1], value * 3 + i) << "payload not visible after the doorbell at " << i;
    sleeps += stats.slept;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(child.wait(10s), 0);
  std::printf("%s: %llu round trips in %.3f s (%.2f us each), parent slept %llu times\n", tag,
              static_cast<unsigned long long>(n), seconds, seconds * 1e6 / double(n),
              static_cast<unsigned long long>(sleeps));
  EXPECT_LT(seconds, 60.0);
  if (spin.count() == 0) {
    EXPECT_GT(sleeps, 0u) << "futex path never exercised";
  }
}

TEST(Doorbell, RoundTripsAcrossProcessesFutexOnly) { round_trips(0ns, 20000, "bell-futex"); }
TEST(Doorbell, RoundTripsAcrossProcessesSpinThenFutex) { round_trips(50us, 20000, "bell-spin"); }

// Free-running producer: the consumer may see jumps but must always reach the final number, and
// never see a number go backwards.
TEST(Doorbell, StreamReachesTheLastSequenceNumber) {
  PingPong pp("bell-stream");
  const std::uint64_t n = 200000;
  Child child([&] {
    ShmSegment peer = ShmSegment::open(pp.segment.locator());
    Doorbell* ping = Doorbell::at(pp.layout.region("ping").at<void>(peer.data()));
    for (std::uint64_t i = 1; i <= n; ++i) ping->ring(i);
    return 0;
  });
  std::uint64_t last = 0;
  std::uint64_t next = 1;
  while (last < n) {
    WaitStats stats;
    ASSERT_EQ(pp.ping->wait_for(next, 5s, 0ns, &stats), WaitResult::kReady) << "stuck at " << last;
    ASSERT_GE(stats.observed, next);
    ASSERT_GE(stats.observed, last);
    last = stats.observed;
    next = last + 1;
  }
  EXPECT_EQ(pp.ping->load(), n);
  EXPECT_EQ(child.wait(10s), 0);
}

TEST(Doorbell, SilentProducerTimesOut) {
  PingPong pp("bell-timeout");
  pp.ping->ring(5);
  EXPECT_EQ(pp.ping->wait_for(5, 1s), WaitResult::kReady);
  const auto start = std::chrono::steady_clock::now();
  WaitStats stats;
  EXPECT_EQ(pp.ping->wait_for(6, 200ms, 10us, &stats), WaitResult::kTimedOut);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_GE(elapsed, 200ms);
  EXPECT_LT(elapsed, 5s);
  EXPECT_EQ(stats.observed, 5u);
  EXPECT_TRUE(stats.slept);
}

}  // namespace
