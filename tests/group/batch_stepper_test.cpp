// The coordinator's batched decode scheduler (coordinator/batch_stepper.h) with a fake step: rows of
// concurrently decoding requests share steps and each gets its own output; a prefill (exclusive)
// never overlaps a step; a failed step fails each of its rows with the step's error; slots bound
// admission, a cancelled wait gives up, and a released slot is taken again.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "coordinator/batch_stepper.h"

namespace moraine::group_test {
namespace {

using Row = group::BatchStepper::Row;
int32_t out_of(int slot, int64_t position, int32_t token) { return static_cast<int32_t>(slot * 1000 + position * 10 + token % 10); }

TEST(BatchStepper, ConcurrentRowsShareStepsAndGetTheirOwnOutputs) {
  std::atomic<int> in_step{0}, overlaps{0};
  std::vector<size_t> sizes;
  group::BatchStepper s(4, [&](std::span<Row* const> rows) {
    if (in_step++ != 0) ++overlaps;
    sizes.push_back(rows.size());
    std::this_thread::sleep_for(std::chrono::microseconds(300));
    for (Row* r : rows) r->out_token = out_of(r->slot, r->position, r->token);
    --in_step;
  });
  constexpr int kThreads = 3, kSteps = 20;
  std::atomic<int> wrong{0}, prefills{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t)
    ts.emplace_back([&, t] {
      const int slot = s.acquire_slot(nullptr);
      s.exclusive([&] {   // a prefill: never beside a step
        if (in_step.load() != 0) ++overlaps;
        ++prefills;
      });
      s.begin_decoding();
      Row row;
      row.slot = slot;
      for (int i = 0; i < kSteps; ++i) {
        row.position = i;
        row.token = t + i;
        s.decode(row);
        if (row.out_token != out_of(slot, i, t + i)) ++wrong;
      }
      s.end_decoding();
      s.release_slot(slot);
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(overlaps.load(), 0);
  EXPECT_EQ(prefills.load(), kThreads);
  EXPECT_EQ(s.rows(), static_cast<uint64_t>(kThreads * kSteps));
  EXPECT_LT(s.steps(), static_cast<uint64_t>(kThreads * kSteps)) << "no step carried more than one row";
  for (size_t n : sizes) EXPECT_LE(n, static_cast<size_t>(kThreads));
}

TEST(BatchStepper, AFailedStepFailsItsRows) {
  group::BatchStepper s(2, [](std::span<Row* const>) { throw std::runtime_error("gpu_worker: step 7 failed"); });
  Row row;
  try {
    s.decode(row);
    ADD_FAILURE() << "a failed step returned";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "gpu_worker: step 7 failed");
  }
  EXPECT_EQ(s.steps(), 1u);
}

TEST(BatchStepper, SlotsBoundAdmission) {
  group::BatchStepper s(2, [](std::span<Row* const>) {});
  const int a = s.acquire_slot(nullptr), b = s.acquire_slot(nullptr);
  EXPECT_NE(a, b);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(s.acquire_slot([&] { return std::chrono::steady_clock::now() - t0 > std::chrono::milliseconds(60); }), -1);
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    s.release_slot(b);
  });
  EXPECT_EQ(s.acquire_slot(nullptr), b);
  releaser.join();
  EXPECT_THROW(group::BatchStepper(17, [](std::span<Row* const>) {}), std::invalid_argument);
}

}  // namespace
}  // namespace moraine::group_test
