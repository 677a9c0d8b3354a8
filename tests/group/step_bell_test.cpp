// The step channel of coordinator/step_bell.h between two real processes (fork, the exchange
// segment in shared memory): tokens the coordinator writes before ringing reach the gpu_worker's
// side, its answers (the greedy token, or an error text) come back in order; a server that dies
// holding a step is named within a liveness slice; a restarted server answers the step its
// predecessor took with an error before it serves the next one; with no server registered (never,
// or withdrawn) a call fails at its deadline instead of ringing into nothing.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>

#include "common/shm/doorbell.h"
#include "common/shm/shm_segment.h"
#include "coordinator/group_layout.h"
#include "coordinator/step_bell.h"
#include "tests/shm/child_process.h"

namespace moraine::group {
namespace {

using namespace std::chrono_literals;
using test::Child;

model::HParams small_hparams() {
  model::HParams hp;
  hp.n_layer = 2;
  hp.n_embd = 8;
  hp.n_vocab = 1000;
  hp.n_expert = 4;
  hp.n_expert_used = 2;
  return hp;
}

// The exchange segment of a small model, its step doorbells initialised (the coordinator's part).
struct Exchange {
  ExchangeLayout xl = ExchangeLayout::build(small_hparams(), 4, 1);
  shm::ShmSegment segment;
  explicit Exchange(const char* tag)
      : segment(shm::ShmSegment::create({test::test_group_prefix(tag), "exchange", xl.layout.total_bytes(), false, false})) {
    StepBellClient(segment.data(), xl).init();
  }
  int32_t* tokens() { return xl.region("tokens").at<int32_t>(segment.data()); }
  StepHeader* header() { return xl.region("step").at<StepHeader>(segment.data()); }
  const StepReply& reply() { return *xl.region("step_reply").at<const StepReply>(segment.data()); }
  shm::Doorbell* step_bell(size_t i) {
    return shm::Doorbell::at(segment.data() + xl.region("step_bells").offset + i * sizeof(shm::Doorbell));
  }
};

// What the server side answers for a step: a function of what the coordinator wrote, so a token
// that arrived stale or torn shows.
int32_t answer_for(const int32_t* tokens) { return (tokens[0] * 7 + tokens[3]) % 1000; }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(StepBell, AnswersComeBackInOrderWithTheirTokensAndErrors) {
  Exchange x("stepbell-order");
  constexpr int kSteps = 300;
  Child server([&] {
    StepBellServer s(x.segment.data(), x.xl);
    s.start();
    for (int i = 1; i <= kSteps; ++i) {
      const uint64_t seq = s.next(10s, i % 2 ? 0us : 50us);   // the futex path and the spin path
      if (seq != static_cast<uint64_t>(i) || x.header()->step_seq != seq) return 3;
      if (i % 37 == 0) {
        s.answer(seq, false, -1, "step " + std::to_string(seq) + " refused");
      } else {
        s.answer(seq, true, answer_for(x.tokens()), "");
      }
    }
    return 0;
  });
  StepBellClient client(x.segment.data(), x.xl);
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int32_t> token(0, 999);
  for (int i = 1; i <= kSteps; ++i) {
    for (int t = 0; t < 4; ++t) x.tokens()[t] = token(rng);
    x.header()->step_seq = static_cast<uint64_t>(i);
    if (i % 37 == 0) {
      EXPECT_EQ(error_of([&] { client.call(i, 10s, 20us); }), "step " + std::to_string(i) + " refused");
    } else {
      const StepReply& r = client.call(i, 10s, 20us);
      ASSERT_EQ(r.seq, static_cast<uint64_t>(i));
      ASSERT_EQ(r.token, answer_for(x.tokens())) << "step " << i;
    }
  }
  EXPECT_EQ(server.wait(10s), 0);
}

TEST(StepBell, AServerDyingWithAStepIsNamedAndItsSuccessorAnswersTheOrphan) {
  Exchange x("stepbell-death");
  Child first([&] {
    StepBellServer s(x.segment.data(), x.xl);
    s.start();
    if (s.next(10s, 0us) != 1) return 3;
    return 0;   // gone without answering
  });
  StepBellClient client(x.segment.data(), x.xl);
  x.tokens()[0] = 5;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string died = error_of([&] { client.call(1, 30s, 20us); });
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(died, "gpu_worker-0 (pid " + std::to_string(first.pid()) + ") died during step 1");
  EXPECT_LT(took, 5 * kLivenessSlice) << "the death was noticed late";
  EXPECT_EQ(first.wait(10s), 0);

  // The successor: the orphaned step 1 gets an error reply, then step 2 is served.
  Child second([&] {
    StepBellServer s(x.segment.data(), x.xl);
    s.start();
    const uint64_t seq = s.next(10s, 0us);
    if (seq != 2) return 3;
    s.answer(seq, true, answer_for(x.tokens()), "");
    return 0;
  });
  ASSERT_EQ(x.step_bell(1)->wait_for(1, 10s), shm::WaitResult::kReady);
  EXPECT_EQ(x.reply().seq, 1u);
  EXPECT_EQ(x.reply().ok, 0u);
  EXPECT_EQ(std::string(x.reply().error, x.reply().error_bytes),
            "gpu_worker-0 restarted during step 1 (the process that took it is gone)");
  x.tokens()[0] = 11;
  x.tokens()[3] = 2;
  const StepReply& r = client.call(2, 10s, 20us);
  EXPECT_EQ(r.token, answer_for(x.tokens()));
  EXPECT_EQ(second.wait(10s), 0);
}

TEST(StepBell, NoRegisteredServerFailsAtTheDeadlineWithoutRinging) {
  Exchange x("stepbell-none");
  StepBellClient client(x.segment.data(), x.xl);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(error_of([&] { client.call(1, 300ms, 20us); }), "no gpu_worker-0 serves steps (none registered)");
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 300ms);
  EXPECT_EQ(x.step_bell(0)->load(), 0u) << "rang with no server";

  // One that registered and withdrew (a clean exit) counts as none; one that died is named.
  Child withdrawn([&] {
    StepBellServer s(x.segment.data(), x.xl);
    s.start();
    s.withdraw();
    return 0;
  });
  ASSERT_EQ(withdrawn.wait(10s), 0);
  EXPECT_EQ(error_of([&] { client.call(1, 200ms, 20us); }), "no gpu_worker-0 serves steps (none registered)");
  Child killed([&] {
    StepBellServer s(x.segment.data(), x.xl);
    s.start();
    return 0;
  });
  ASSERT_EQ(killed.wait(10s), 0);
  EXPECT_EQ(error_of([&] { client.call(1, 200ms, 20us); }),
            "gpu_worker-0 (pid " + std::to_string(killed.pid()) + ") is gone and no other serves steps");
  EXPECT_EQ(x.step_bell(0)->load(), 0u) << "rang with no live server";
}

}  // namespace
}  // namespace moraine::group
