// The CPU backend's sequence slots (BackendOptions::slots, Backend::set_segments; issue 33): a
// step carrying rows of several slots at different positions (decode rows, prefill chunks, a
// verify window) gives each segment exactly the logits and greedy tokens of the same rows run
// alone, on a backend holding only that sequence, with snapshots, rewinds, a reset and a
// save / load of a slot's state in between. Each chosen expert runs once for all the rows that
// chose it, so this equality is what makes batching safe for greedy output. On an attention-only
// model, the built-in DeltaNet model and a deepseek2-style MLA model would be the same test; the
// first two are here (the MLA synthetic spec is not in tests/reference/synthetic_model.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "gpu_worker/backend.h"
#include "gpu_worker/step_segments.h"
#include "tests/reference/synthetic_model.h"

namespace moraine::group_test {
namespace {

namespace fs = std::filesystem;
const std::string kBuiltin = std::string(MORAINE_SOURCE_DIR) + "/models/moraine-tiny-qwen3next.gguf";
constexpr int kSlots = 4;

// One segment of a batched step: `tokens` of slot `slot`, logits of its last logit_rows rows.
struct Part {
  int slot;
  std::vector<int32_t> tokens;
  int64_t logit_rows = 1;
};

class SlotsFixture {
 public:
  SlotsFixture(const model::Model& m, int max_tokens, int long_step_rows = 0) : m_(m) {
    gpu_worker::BackendOptions o;
    o.max_tokens = max_tokens;
    o.long_step_rows = long_step_rows;
    o.threads = 1;
    o.slots = kSlots;
    batched_ = gpu_worker::make_backend("cpu", m, o);
    o.slots = 1;   // alone: each sequence's rows as one plain step
    o.max_tokens = std::max(max_tokens, long_step_rows);
    o.long_step_rows = 0;
    for (int s = 0; s < kSlots; ++s) alone_.push_back(gpu_worker::make_backend("cpu", m, o));
  }

  // Runs the parts as one step on the batched backend and each alone on its own; every segment's
  // logits rows must be the same bits, and its greedy tokens the same ids.
  void step(const std::vector<Part>& parts, int window = 0) {
    const int64_t V = m_.hp.n_vocab;
    std::vector<gpu_worker::Segment> segs;
    std::vector<int32_t> tokens;
    int64_t logit_rows = 0;
    for (const Part& p : parts) {
      batched_->select_slot(p.slot);
      segs.push_back({p.slot, batched_->n_past(), static_cast<int64_t>(p.tokens.size()), p.logit_rows});
      tokens.insert(tokens.end(), p.tokens.begin(), p.tokens.end());
      logit_rows += p.logit_rows;
    }
    batched_->select_slot(0);
    std::vector<float> logits(static_cast<size_t>(logit_rows * V));
    std::vector<int32_t> greedy(static_cast<size_t>(logit_rows), -1);
    batched_->set_token_output(greedy.data());
    batched_->set_segments(segs);
    const int64_t n = static_cast<int64_t>(tokens.size());
    if (window == 0) {
      batched_->step_whole(tokens.data(), n, logit_rows, logits.data(), nullptr, 0);
    } else {   // a long step: every layer over windows of `window` rows, which cut across segments
      batched_->embed(tokens.data(), n);
      for (int64_t il = 0; il < batched_->n_layer(); ++il)
        for (int64_t first = 0; first < n; first += window) {
          batched_->set_window(first, std::min<int64_t>(window, n - first));
          batched_->layer_whole(il, std::min<int64_t>(window, n - first), nullptr);
        }
      batched_->advance(n);
      batched_->logits(logit_rows, logits.data());
    }
    batched_->set_token_output(nullptr);
    int64_t r = 0;
    for (const Part& p : parts) {
      gpu_worker::Backend& a = *alone_[static_cast<size_t>(p.slot)];
      std::vector<float> want(static_cast<size_t>(p.logit_rows * V));
      std::vector<int32_t> want_greedy(static_cast<size_t>(p.logit_rows), -1);
      a.set_token_output(want_greedy.data());
      a.step_whole(p.tokens.data(), static_cast<int64_t>(p.tokens.size()), p.logit_rows, want.data(), nullptr, 0);
      a.set_token_output(nullptr);
      ASSERT_EQ(0, std::memcmp(want.data(), logits.data() + r * V, want.size() * sizeof(float)))
          << "step " << steps_ << ", slot " << p.slot << ": logits differ from the slot run alone";
      for (int64_t i = 0; i < p.logit_rows; ++i)
        EXPECT_EQ(want_greedy[static_cast<size_t>(i)], greedy[static_cast<size_t>(r + i)]) << "slot " << p.slot << " row " << i;
      batched_->select_slot(p.slot);
      EXPECT_EQ(batched_->n_past(), a.n_past()) << "slot " << p.slot;
      r += p.logit_rows;
    }
    ++steps_;
  }
  // The same per-sequence call on slot s of the batched backend and on its own backend.
  template <class F>
  void on(int s, F f) {
    batched_->select_slot(s);
    f(*batched_);
    f(*alone_[static_cast<size_t>(s)]);
  }
  gpu_worker::Backend& batched() { return *batched_; }

 private:
  const model::Model& m_;
  std::unique_ptr<gpu_worker::Backend> batched_;
  std::vector<std::unique_ptr<gpu_worker::Backend>> alone_;
  int steps_ = 0;
};

std::vector<int32_t> toks(int first, int n, int vocab) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(static_cast<int32_t>((first * 31 + i * 7 + 3) % vocab));
  return t;
}

void run_schedule(const model::Model& m, bool recurrent) {
  const int V = static_cast<int>(m.hp.n_vocab);
  SlotsFixture f(m, 32);
  f.step({{0, toks(1, 7, V)}, {1, toks(2, 3, V)}});                    // two prefills
  f.step({{0, toks(3, 1, V)}, {1, toks(4, 1, V)}, {2, toks(5, 9, V)}});   // decode rows and a new prefill
  for (int i = 0; i < 3; ++i) f.step({{2, toks(6 + i, 1, V)}, {0, toks(9 + i, 1, V)}, {1, toks(12 + i, 1, V)}});
  // A verify window on slot 1 (every row's logits) beside decode rows, then its rejection: back to
  // the snapshot, the accepted token fed again.
  f.on(1, [](gpu_worker::Backend& b) { b.snapshot(); });
  int64_t at = 0;
  f.on(1, [&](gpu_worker::Backend& b) { at = b.n_past(); });
  f.step({{0, toks(20, 1, V)}, {1, toks(21, 4, V), 4}, {3, toks(22, 5, V)}, {2, toks(23, 1, V)}});
  f.on(1, [&](gpu_worker::Backend& b) { b.rewind(at); });
  f.step({{1, toks(21, 2, V), 2}, {0, toks(24, 1, V)}, {3, toks(25, 1, V)}});
  if (!recurrent) {   // attention caches rewind anywhere
    f.on(0, [](gpu_worker::Backend& b) { b.rewind(b.n_past() - 2); });
    f.step({{0, toks(26, 2, V)}, {3, toks(27, 1, V)}});
  }
  // Slot 2's sequence saved, the slot reset and used for another one, then loaded back.
  std::vector<uint8_t> saved;
  f.on(2, [&](gpu_worker::Backend& b) {
    saved.assign(b.state_bytes(), 0);
    b.save_state(saved);
  });
  f.on(2, [](gpu_worker::Backend& b) { b.reset(); });
  f.step({{2, toks(30, 6, V)}, {1, toks(31, 1, V)}});
  f.on(2, [&](gpu_worker::Backend& b) { b.load_state(saved); });
  f.step({{3, toks(32, 1, V)}, {2, toks(33, 1, V)}, {1, toks(34, 1, V)}, {0, toks(35, 1, V)}});
  // A long step whose 4-row windows cut across three segments.
  SlotsFixture g(m, 4, 16);
  g.step({{1, toks(40, 3, V)}, {0, toks(41, 6, V)}}, 4);
  g.step({{0, toks(42, 1, V)}, {2, toks(43, 7, V)}, {1, toks(44, 2, V), 2}}, 4);
}

TEST(BackendSlots, AttentionModelSegmentsEqualEachSlotAlone) {
  const std::string path = testing::temp_path("backend-slots-attn");
  testing::SyntheticSpec spec;   // qwen3moe: attention layers, 6 experts top-2, a shared expert
  spec.n_layer = 3;
  testing::SyntheticModel(spec).write(path);
  const model::Model m = model::Model::load(path);
  run_schedule(m, false);
  fs::remove(path);
}

TEST(BackendSlots, BuiltinDeltaNetModelSegmentsEqualEachSlotAlone) {
  const model::Model m = model::Model::load(kBuiltin);
  run_schedule(m, true);
}

// Bad segment lists are refused, naming what is wrong.
TEST(BackendSlots, BadSegmentsAreRefused) {
  const model::Model m = model::Model::load(kBuiltin);
  gpu_worker::BackendOptions o;
  o.max_tokens = 8;
  o.threads = 1;
  o.slots = 2;
  auto b = gpu_worker::make_backend("cpu", m, o);
  using S = gpu_worker::Segment;
  const auto refused = [&](std::vector<S> segs, const char* what) {
    try {
      b->set_segments(segs);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused({{0, 0, 1, 1}, {0, 0, 1, 1}}, "named twice");
  refused({{2, 0, 1, 1}}, "out of range");
  refused({{1, 3, 1, 1}}, "the slot caches 0");
  refused({{0, 0, 2, 3}}, "2 rows with 3 logit rows");
  refused({{0, 0, 1, 1}, {1, 0, 1, 1}, {1, 0, 1, 1}}, "3 segments, it has 2 slots");
  b->set_segments(std::vector<S>{{0, 0, 2, 1}, {1, 0, 1, 1}});
  const int32_t t[4] = {1, 2, 3, 4};
  EXPECT_THROW(b->embed(t, 4), std::invalid_argument);   // the segments hold 3 rows
  EXPECT_THROW(b->select_slot(2), std::invalid_argument);
  // More slots than a step has segments: refused by either backend kind before anything is
  // allocated, naming them (tests/cuda/cuda_slots_test.cpp runs the CUDA backend's slots).
  o.slots = static_cast<int>(group::kMaxSegments) + 1;
  try {
    gpu_worker::make_backend("cuda", m, o);
    ADD_FAILURE() << "a CUDA backend with " << o.slots << " slots was made";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("sequence slots"), std::string::npos) << e.what();
  }
}

// The step protocol's batched header (StepHeader::segments) as the gpu_worker applies it
// (prepare_segments, segment_tokens): per-segment reset / rewind / snapshot, the tokens per
// segment, and the header refusals, against each sequence alone.
TEST(BackendSlots, BatchedStepHeaderAsTheGpuWorkerRunsIt) {
  const model::Model m = model::Model::load(kBuiltin);
  const int V = static_cast<int>(m.hp.n_vocab);
  gpu_worker::BackendOptions o;
  o.max_tokens = 16;
  o.threads = 1;
  o.slots = 3;
  auto b = gpu_worker::make_backend("cpu", m, o);
  o.slots = 1;
  std::vector<std::unique_ptr<gpu_worker::Backend>> alone;
  for (int s = 0; s < 3; ++s) alone.push_back(gpu_worker::make_backend("cpu", m, o));
  group::StepReply reply{};
  uint64_t seq = 0;
  // One batched step as the header says; the rows of segment i are toks(base + i, rows_i).
  const auto batched = [&](std::vector<group::StepSegment> segs, int base) {
    group::StepHeader h{};
    h.step_seq = ++seq;
    h.greedy_token = 1;
    h.n_segments = static_cast<uint32_t>(segs.size());
    std::vector<int32_t> tokens;
    for (size_t i = 0; i < segs.size(); ++i) {
      h.segments[i] = segs[i];
      const auto t = toks(base + static_cast<int>(i), static_cast<int>(segs[i].rows), V);
      tokens.insert(tokens.end(), t.begin(), t.end());
      h.n_tokens += segs[i].rows;
      h.logit_rows += segs[i].logit_rows;
    }
    b->set_segments(gpu_worker::prepare_segments(h, *b, o.max_tokens));
    std::vector<float> logits(static_cast<size_t>(h.logit_rows * V));
    b->set_token_output(reply.row_tokens);
    b->step_whole(tokens.data(), h.n_tokens, h.logit_rows, logits.data(), nullptr, 0);
    b->set_token_output(nullptr);
    gpu_worker::segment_tokens(h, reply);
    for (size_t i = 0; i < segs.size(); ++i) {   // the same per-sequence operations and rows alone
      const group::StepSegment& g = segs[i];
      gpu_worker::Backend& a = *alone[g.slot];
      if (g.reset) a.reset();
      if (g.rewind && !g.reset && g.first_position < a.n_past()) a.rewind(g.first_position);
      if (g.snapshot) a.snapshot();
      const auto t = toks(base + static_cast<int>(i), static_cast<int>(g.rows), V);
      int32_t want[group::kMaxTokenRows];
      std::vector<float> want_logits(static_cast<size_t>(g.logit_rows * V));
      a.set_token_output(want);
      a.step_whole(t.data(), g.rows, g.logit_rows, want_logits.data(), nullptr, 0);
      a.set_token_output(nullptr);
      EXPECT_EQ(want[g.logit_rows - 1], reply.segment_token[i]) << "step " << seq << " segment " << i;
    }
    for (size_t i = segs.size(); i < group::kMaxSegments; ++i) EXPECT_EQ(-1, reply.segment_token[i]);
  };
  batched({{0, 0, 5, 1, 1, 0, 0}, {2, 0, 3, 1, 1, 0, 0}}, 1);
  batched({{2, 3, 1, 1, 0, 0, 0}, {1, 0, 6, 1, 0, 0, 0}, {0, 5, 1, 1, 0, 0, 0}}, 4);
  batched({{1, 6, 4, 4, 0, 0, 1}, {0, 6, 1, 1, 0, 0, 0}}, 8);   // a verify window, snapshot first
  batched({{0, 7, 1, 1, 0, 0, 0}, {1, 6, 2, 2, 0, 1, 0}}, 9);   // ... rejected: back to its snapshot
  batched({{2, 0, 2, 1, 1, 0, 0}, {1, 8, 1, 1, 0, 0, 0}}, 12);  // slot 2 reset for another sequence
  // Refusals, naming the segment or the header's fields.
  const auto refused = [&](group::StepHeader h, const char* what) {
    h.step_seq = ++seq;
    try {
      gpu_worker::prepare_segments(h, *b, o.max_tokens);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  group::StepHeader h{};
  h.n_segments = 2;
  h.segments[0] = {0, 8, 1, 1, 0, 0, 0};
  h.segments[1] = {0, 8, 1, 1, 0, 0, 0};
  h.n_tokens = 2;
  h.logit_rows = 2;
  refused(h, "named twice");
  h.segments[1] = {1, 9, 1, 1, 0, 0, 0};
  h.n_tokens = 3;
  refused(h, "the header says 3");
  h.n_tokens = 2;
  h.reset = 1;
  refused(h, "per segment");
  h.reset = 0;
  h.n_segments = 4;
  refused(h, "4 segments, expected 1..3");
  h.n_segments = 2;
  h.segments[1].first_position = 5;
  refused(h, "starts at position 5 but 9");
}

}  // namespace
}  // namespace moraine::group_test
