// The coordinator's batched decode scheduler (coordinator/batch_stepper.h) with a fake step: rows of
// concurrently decoding requests share steps and each gets its own output; a prefill (exclusive)
// never overlaps a step; prompt chunks go beside decode rows within their budget; a failed step fails each of its rows with the step's error; slots bound
// admission, a cancelled wait gives up, and a released slot is taken again; waiters are served in
// arrival order within a queue limit.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
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

// Prompts in chunks (chunk_rows 8): a 30-token prompt goes in order, from a reset, in chunks that
// together stay within the budget beside a decoding request's rows, which keep coming meanwhile
// (the stream does not wait for the whole prompt); two prompts share the budget first come first;
// the last chunk's output is the prefill's.
TEST(BatchStepper, PromptChunksGoBesideDecodeRows) {
  std::mutex mu;
  std::vector<std::vector<int32_t>> fed(3);   // [slot] the prompt tokens each slot got, in order
  std::vector<int> resets(3, 0);
  int over_budget = 0, decode_beside_chunks = 0, bad_position = 0;
  group::BatchStepper s(3, [&](std::span<Row* const> rows) {
    std::lock_guard<std::mutex> l(mu);
    int64_t chunk = 0;
    bool decode = false;
    for (Row* r : rows) {
      if (r->chunk.empty()) {
        decode = true;
        r->out_token = out_of(r->slot, r->position, r->token);
        continue;
      }
      auto& f = fed[static_cast<size_t>(r->slot)];
      if (r->position != static_cast<int64_t>(f.size()) || r->reset != f.empty()) ++bad_position;
      resets[static_cast<size_t>(r->slot)] += r->reset;
      f.insert(f.end(), r->chunk.begin(), r->chunk.end());
      chunk += r->n_rows();
      r->out_token = out_of(r->slot, r->position + r->n_rows() - 1, r->chunk.back());
    }
    if (chunk > 8) ++over_budget;
    if (decode && chunk > 0) ++decode_beside_chunks;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }, 8);
  const int a = s.acquire_slot(nullptr);
  std::atomic<bool> prompts_done{false}, started{false};
  std::atomic<int> wrong{0}, decoded_during{0};
  std::thread decoder([&] {
    s.begin_decoding();
    Row row;
    row.slot = a;
    for (int i = 0; !prompts_done.load() || i < 5; ++i) {
      row.position = i;
      row.token = i;
      s.decode(row);
      if (row.out_token != out_of(a, i, i)) ++wrong;
      if (!prompts_done.load()) ++decoded_during;
      started = true;
    }
    s.end_decoding();
  });
  std::vector<int32_t> p1(30), p2(11);
  for (size_t i = 0; i < p1.size(); ++i) p1[i] = static_cast<int32_t>(100 + i);
  for (size_t i = 0; i < p2.size(); ++i) p2[i] = static_cast<int32_t>(200 + i);
  const int b = s.acquire_slot(nullptr), c = s.acquire_slot(nullptr);
  while (!started.load()) std::this_thread::yield();   // the stream runs before the prompts come
  Row out1, out2;
  std::thread second([&] { s.prefill(c, p2, true, out2); });
  s.prefill(b, p1, true, out1);
  second.join();
  prompts_done = true;
  decoder.join();
  EXPECT_EQ(fed[static_cast<size_t>(b)], p1);
  EXPECT_EQ(fed[static_cast<size_t>(c)], p2);
  EXPECT_EQ(resets[static_cast<size_t>(b)], 1);
  EXPECT_EQ(resets[static_cast<size_t>(c)], 1);
  EXPECT_EQ(out1.out_token, out_of(b, 29, p1.back()));
  EXPECT_EQ(out2.out_token, out_of(c, 10, p2.back()));
  EXPECT_EQ(over_budget, 0);
  EXPECT_EQ(bad_position, 0);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(decode_beside_chunks, 0);
  EXPECT_GE(decoded_during.load(), 3) << "the stream waited for the prompts";   // 41 rows: at least 6 steps
  EXPECT_EQ(s.chunk_rows(), p1.size() + p2.size());
  EXPECT_GT(s.mixed_steps(), 0u);
  Row bad;
  EXPECT_THROW(group::BatchStepper(1, [](std::span<Row* const>) {}).prefill(0, p1, true, bad), std::logic_error);
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

// More requests than slots: the waiting ones take the slots in arrival order (staggered arrivals,
// each released slot to the longest waiting), one that gives up leaves the line without taking a
// slot, and beyond queue_limit a request is refused at once.
TEST(BatchStepper, WaitersTakeSlotsInArrivalOrderWithinTheQueueLimit) {
  group::BatchStepper s(2, [](std::span<Row* const>) {});
  s.set_queue_limit(3);
  const int a = s.acquire_slot(nullptr), b = s.acquire_slot(nullptr);
  std::mutex mu;
  std::vector<int> order;
  std::atomic<bool> give_up{false};
  std::vector<std::thread> ts;
  for (int w = 0; w < 3; ++w) {
    ts.emplace_back([&, w] {
      const int slot = s.acquire_slot([&] { return w == 1 && give_up.load(); });
      std::lock_guard<std::mutex> l(mu);
      order.push_back(slot < 0 ? -10 - w : w);
      if (slot >= 0) s.release_slot(slot);
    });
    while (s.waiting() < w + 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));   // staggered: w waits behind w-1
  }
  EXPECT_EQ(s.acquire_slot(nullptr), group::BatchStepper::kQueueFull) << "a fourth waiter beyond a limit of 3";
  give_up = true;   // waiter 1 leaves the line
  while (s.waiting() > 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  s.release_slot(b);   // waiter 0 (first), then as each releases, waiter 2
  for (auto& t : ts) t.join();
  EXPECT_EQ(order, (std::vector<int>{-11, 0, 2}));
  EXPECT_EQ(s.waiting(), 0);
  s.release_slot(a);
  EXPECT_GE(s.acquire_slot(nullptr), 0);
}

}  // namespace
}  // namespace moraine::group_test
