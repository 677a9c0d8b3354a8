// The CUDA backend's sequence slots (BackendOptions::slots, Backend::set_segments; issue 33), as
// tests/group/backend_slots_test.cpp checks the CPU backend's: a step carrying rows of several
// slots at different positions (decode rows, prefill chunks, a verify window) gives each segment
// the logits and greedy tokens of the same rows run alone on a backend holding only that
// sequence, with snapshots, rewinds, a slot cancelled and reused, and a save / load of a slot's
// state in between. Each step is driven as the gpu_worker drives it: a captured graph
// (step_whole), layer by layer, and with half the experts off the device layer_begin / layer_end
// and the in-graph hand-off, each against its slots alone layer by layer.
// Bound: bit for bit (memcmp), as the CUDA-vs-CUDA tests of cuda_backend_golden_test (graph,
// hand-off, decode after prefill): below gemm_prefill_rows (64) every kernel a row meets is
// per row (matvec, norms, moe_fused's token groups, the combine, the head) or per segment with
// that segment's own shape (attention, DeltaNet), so batching moves no bit. A step of 64 rows or
// more multiplies the shared projections through cuBLAS (BF16 inputs) where the segments alone
// (decode rows) take the matvec: TwoDecodeRowsBesideALongPrefill measures and prints that gap and
// holds the tokens to the solo run's wherever its top two are more than 1% of max |logit| apart
// (cuda_arch_test.h's expect_clear_top_tokens, the rule of the long-prefill tests). H200, session
// 24 run 1: 0.013-0.018 of max |logit| on the Q4_K / Q8_0 files, 1.9e-7 with F32 weights (cuBLAS in
// F32); every step below 64 rows bit for bit.
// Models: moraine-synth's tiny shapes (vocabulary 512) with Q4_K experts and Q8_0 elsewhere
// (moe_fused, the captured step, the hand-off): qwen3moe (attention), qwen3next and qwen35moe
// (Gated DeltaNet + attention), glm4moe (a dense leading layer), gpt-oss (sinks, a sliding
// window, biases); an F16 KV cache on two of them; and F32 weights (the per-expert matvec path).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/sampling/sampler.h"
#include "coordinator/group_layout.h"
#include "gpu_worker/backend.h"
#include "gpu_worker/cuda_backend.h"
#include "gpu_worker/cuda_backend_impl.h"
#include "tests/cuda/cuda_arch_test.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

using cuda_arch_test::HandoffBuffers;
using cuda_arch_test::host_experts;
using cuda_arch_test::plan_of;

constexpr int kSlots = 4;
constexpr int kMaxTokens = 96;
constexpr int64_t kContext = 256;

struct Case {
  std::string name, shape, synth;
  model::KvType kv = model::KvType::F32;
  bool recurrent = false;   // DeltaNet layers: rewinds only to a snapshot
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

const std::string kQuant = "--map _exps.=q4_k --default q8_0";
std::vector<Case> cases() {
  return {
      {"qwen3moe_q4k", "qwen3moe-tiny", kQuant},
      {"qwen3moe_q4k_f16kv", "qwen3moe-tiny", kQuant, model::KvType::F16},
      {"qwen3moe_f32", "qwen3moe-tiny", "--map _exps.=f32 --map ffn_gate_inp=f32 --default f32"},
      {"qwen3next_q4k", "qwen3next-tiny", kQuant, model::KvType::F32, true},
      {"qwen3next_q4k_f16kv", "qwen3next-tiny", kQuant, model::KvType::F16, true},
      {"qwen35moe_q4k", "qwen35moe-tiny", kQuant, model::KvType::F32, true},
      {"glm4moe_q4k", "glm4moe-tiny", kQuant},
      {"gpt_oss_q4k", "gpt-oss-tiny", kQuant},
  };
}

std::vector<int32_t> toks(int first, int n, int vocab) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(static_cast<int32_t>((first * 31 + i * 7 + 3) % vocab));
  return t;
}

// The even experts of every layer on the device, the odd ones computed by the test (the cpu workers).
std::vector<std::vector<int32_t>> even_experts(const model::Model& m) {
  std::vector<std::vector<int32_t>> even(static_cast<size_t>(m.hp.n_layer));
  for (auto& l : even)
    for (int32_t e = 0; e < m.hp.n_expert; e += 2) l.push_back(e);
  return even;
}

// One segment of a batched step: `tokens` of slot `slot`, logits of its last logit_rows rows.
struct Part {
  int slot;
  std::vector<int32_t> tokens;
  int64_t logit_rows = 1;
};

enum class Drive { kLayers, kGraph, kSplit, kHandoff };

class SlotsFixture {
 public:
  // streams: the batched backend's BackendOptions::segment_streams (its attention segments forked
  // onto side streams, or in order with 0).
  SlotsFixture(const model::Model& m, model::KvType kv, bool split, int streams = gpu_worker::BackendOptions{}.segment_streams)
      : m_(m), split_(split), even_(even_experts(m)) {
    gpu_worker::BackendOptions o;
    o.segment_streams = streams;
    o.max_tokens = kMaxTokens;
    o.max_context = kContext;
    o.kv_type = kv;
    if (split) {
      o.all_experts = false;
      o.device_experts = even_;
    }
    o.slots = kSlots;
    batched_ = gpu_worker::make_cuda_backend(m, o);
    io_ = std::make_unique<HandoffBuffers>(m.hp, kMaxTokens);
    io_->pin(*batched_);
    o.slots = 1;
    for (int s = 0; s < kSlots; ++s) alone_.push_back(gpu_worker::make_cuda_backend(m, o));
  }

  // Runs the parts as one step on the batched backend (driven by `drive`; greedy: tokens only) and
  // each alone, layer by layer. exact: the same bits (and tokens); else the measured gap, printed,
  // and the solo run's clear top tokens. Returns the gap (max |diff| / max |logit|).
  double step(const std::vector<Part>& parts, Drive drive, bool greedy = false, bool exact = true) {
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
    std::vector<float> logits(static_cast<size_t>(logit_rows * V), NAN);
    std::vector<int32_t> greedy_ids(static_cast<size_t>(logit_rows), -1);
    batched_->set_token_output(greedy ? greedy_ids.data() : nullptr);
    batched_->set_segments(segs);
    run(*batched_, tokens, logit_rows, logits.data(), drive, true);
    batched_->set_token_output(nullptr);
    std::vector<float> want_all;
    int64_t r = 0;
    for (const Part& p : parts) {
      gpu_worker::Backend& a = *alone_[static_cast<size_t>(p.slot)];
      std::vector<float> want(static_cast<size_t>(p.logit_rows * V), NAN);
      run(a, p.tokens, p.logit_rows, want.data(), split_ ? Drive::kSplit : Drive::kLayers, false);
      if (greedy) {
        for (int64_t i = 0; i < p.logit_rows; ++i)
          EXPECT_EQ(sampling::argmax(std::span<const float>(want.data() + i * V, static_cast<size_t>(V))),
                    greedy_ids[static_cast<size_t>(r + i)])
              << "step " << steps_ << ", slot " << p.slot << " row " << i << ": the greedy token";
      } else if (exact) {
        EXPECT_EQ(0, std::memcmp(want.data(), logits.data() + r * V, want.size() * sizeof(float)))
            << "step " << steps_ << ", slot " << p.slot << ": logits differ from the slot run alone";
      }
      want_all.insert(want_all.end(), want.begin(), want.end());
      batched_->select_slot(p.slot);
      EXPECT_EQ(batched_->n_past(), a.n_past()) << "slot " << p.slot;
      r += p.logit_rows;
    }
    double max_ref = 0, max_diff = 0;
    for (size_t i = 0; i < want_all.size() && !greedy; ++i) {
      max_ref = std::max(max_ref, std::fabs(double(want_all[i])));
      max_diff = std::max(max_diff, std::isfinite(logits[i]) ? std::fabs(double(logits[i]) - want_all[i]) : INFINITY);
    }
    if (!exact && !greedy) {
      std::printf("[ slots ] step %d of %zu rows: max |diff| %.3g of max |logit| %.4f (%.3g of max)\n", steps_,
                  tokens.size(), max_diff, max_ref, max_diff / max_ref);
      cuda_arch_test::expect_clear_top_tokens(logits, want_all, V, 0.01 * max_ref);
    }
    ++steps_;
    return max_ref > 0 ? max_diff / max_ref : 0;
  }

  // The same per-sequence call on slot s of the batched backend and on its own backend.
  template <class F>
  void on(int s, F f) {
    batched_->select_slot(s);
    f(*batched_);
    f(*alone_[static_cast<size_t>(s)]);
  }
  gpu_worker::Backend& batched() { return *batched_; }
  bool split() const { return split_; }

 private:
  // One step of `tokens` through b: logits of its last logit_rows rows (a segmented step: the
  // segments' rows set_segments named) into out.
  void run(gpu_worker::Backend& b, const std::vector<int32_t>& tokens, int64_t logit_rows, float* out, Drive drive,
           bool pinned) {
    const model::HParams& hp = m_.hp;
    const int64_t n = static_cast<int64_t>(tokens.size()), k = hp.n_expert_used, d = hp.n_embd;
    if (drive == Drive::kGraph) {
      b.step_whole(tokens.data(), n, logit_rows, out, nullptr, 0);
      return;
    }
    HandoffBuffers own(hp, kMaxTokens);
    HandoffBuffers& io = pinned ? *io_ : own;
    if (drive == Drive::kHandoff) {
      ASSERT_TRUE(b.handoff_supported(n));
      ASSERT_TRUE(b.handoff_begin(tokens.data(), n, logit_rows, io.io()));
      for (int64_t il = 0; il < hp.n_layer; ++il) {
        if (b.layer_on_device(il)) continue;
        b.handoff_wait_routed(il);
        const group::ExpertPlan plan = plan_of(std::vector<int32_t>(io.chosen.begin(), io.chosen.begin() + n * k), hp.n_expert);
        host_experts(m_, il, plan, io.h.data(), even_[static_cast<size_t>(il)], io.host_rows.data());
        b.handoff_release(il, plan);
      }
      b.handoff_finish(out, nullptr, 0);
      return;
    }
    b.embed(tokens.data(), n);
    for (int64_t il = 0; il < hp.n_layer; ++il) {
      if (drive == Drive::kLayers || b.layer_on_device(il)) {
        b.layer_whole(il, n, nullptr);
        continue;
      }
      b.layer_begin(il, n, io.chosen.data(), io.weight.data(), io.h.data());
      const group::ExpertPlan plan = plan_of(std::vector<int32_t>(io.chosen.begin(), io.chosen.begin() + n * k), hp.n_expert);
      std::fill(io.host_rows.begin(), io.host_rows.begin() + n * k * d, NAN);
      host_experts(m_, il, plan, io.h.data(), even_[static_cast<size_t>(il)], io.host_rows.data());
      b.layer_end(il, n, plan, io.host_rows.data());
    }
    b.advance(n);
    b.logits(logit_rows, out);
  }

  const model::Model& m_;
  const bool split_;
  const std::vector<std::vector<int32_t>> even_;
  std::unique_ptr<gpu_worker::Backend> batched_;
  std::unique_ptr<HandoffBuffers> io_;
  std::vector<std::unique_ptr<gpu_worker::Backend>> alone_;
  int steps_ = 0;
};

// The schedule of backend_slots_test's, driven through the graph and layer by layer (every
// expert on the device) or layer_begin / layer_end and the hand-off (half of them off it).
void run_schedule(const model::Model& m, const Case& c, bool split, int streams = gpu_worker::BackendOptions{}.segment_streams) {
  const int V = static_cast<int>(m.hp.n_vocab);
  SlotsFixture f(m, c.kv, split, streams);
  // The hand-off step computes the device's experts with moe_fused only (F32 experts: layer by layer).
  const bool handoff = split && f.batched().handoff_supported(1);
  const Drive whole = split ? Drive::kSplit : Drive::kLayers;
  const Drive fast = !split ? Drive::kGraph : handoff ? Drive::kHandoff : Drive::kSplit;
  std::printf("[ slots ] %s: %s\n", c.name.c_str(),
              !split ? "graph and layer by layer" : handoff ? "split and hand-off" : "split only (no hand-off for these experts)");
  f.step({{0, toks(1, 7, V)}, {1, toks(2, 3, V)}}, whole);                         // two prefills
  f.step({{0, toks(3, 1, V)}, {1, toks(4, 1, V)}, {2, toks(5, 9, V)}}, fast);        // decode rows and a new prefill
  for (int i = 0; i < 4; ++i)   // decode rows of three slots, the same layout replayed at new positions
    f.step({{2, toks(6 + i, 1, V)}, {0, toks(9 + i, 1, V)}, {1, toks(12 + i, 1, V)}}, i % 2 == 0 ? fast : whole, i == 1);
  // A verify window on slot 1 (every row's logits) beside decode rows and a prefill, then its
  // rejection: back to the snapshot, the accepted token fed again.
  f.on(1, [](gpu_worker::Backend& b) { b.snapshot(); });
  int64_t at = 0;
  f.on(1, [&](gpu_worker::Backend& b) { at = b.n_past(); });
  f.step({{0, toks(20, 1, V)}, {1, toks(21, 4, V), 4}, {3, toks(22, 5, V)}, {2, toks(23, 1, V)}}, whole);
  f.on(1, [&](gpu_worker::Backend& b) { b.rewind(at); });
  f.step({{1, toks(21, 2, V), 2}, {0, toks(24, 1, V)}, {3, toks(25, 1, V)}}, fast);
  if (!c.recurrent) {   // attention caches rewind anywhere
    f.on(0, [](gpu_worker::Backend& b) { b.rewind(b.n_past() - 2); });
    f.step({{0, toks(26, 2, V)}, {3, toks(27, 1, V)}}, fast, true);
  }
  // Slot 2's sequence saved, the slot reset and used for another one, then loaded back.
  std::vector<uint8_t> saved;
  f.on(2, [&](gpu_worker::Backend& b) {
    saved.assign(b.state_bytes(), 0);
    b.save_state(saved);
  });
  f.on(2, [](gpu_worker::Backend& b) { b.reset(); });
  f.step({{2, toks(30, 6, V)}, {1, toks(31, 1, V)}}, whole);
  f.on(2, [&](gpu_worker::Backend& b) { b.load_state(saved); });
  f.step({{3, toks(32, 1, V)}, {2, toks(33, 1, V)}, {1, toks(34, 1, V)}, {0, toks(35, 1, V)}}, fast);
  // Slot 3's request cancelled mid-sequence (reset, nothing saved) and the slot taken by a new
  // one, whose prefill of 30 rows (past the decode kernels' 16-row passes) goes beside decode rows.
  f.on(3, [](gpu_worker::Backend& b) { b.reset(); });
  f.step({{0, toks(40, 1, V)}, {3, toks(41, 30, V)}, {1, toks(42, 1, V)}}, whole);
  for (int i = 0; i < 4; ++i)   // four decode rows a step, the same layout replayed
    f.step({{0, toks(50 + i, 1, V)}, {1, toks(54 + i, 1, V)}, {2, toks(58 + i, 1, V)}, {3, toks(62 + i, 1, V)}},
           i == 3 ? whole : fast, i == 2);
  // A step of one segment is a plain step of that slot.
  f.step({{2, toks(70, 1, V)}}, fast);
}

class CudaSlots : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
    const Case& c = GetParam();
    model_ = std::make_unique<model::Model>(
        model::Model::load(cuda_arch_test::arch_file("slots-" + c.name, c.shape, c.synth, "", "").string()));
  }
  std::unique_ptr<model::Model> model_;
};

TEST_P(CudaSlots, SegmentsEqualEachSlotAlone) { run_schedule(*model_, GetParam(), false); }

TEST_P(CudaSlots, SplitSegmentsEqualEachSlotAlone) { run_schedule(*model_, GetParam(), true); }

// The same with the segments' attention in order on the step's stream (segment_streams 0).
TEST_P(CudaSlots, SegmentsInOrderEqualEachSlotAlone) { run_schedule(*model_, GetParam(), false, 0); }
TEST_P(CudaSlots, SplitSegmentsInOrderEqualEachSlotAlone) { run_schedule(*model_, GetParam(), true, 0); }

// A step past gemm_prefill_rows: the projections shared by all rows go through cuBLAS, which the
// decode rows alone do not take (see the header): the gap is measured and printed, the tokens held.
TEST_P(CudaSlots, TwoDecodeRowsBesideALongPrefill) {
  const int V = static_cast<int>(model_->hp.n_vocab);
  SlotsFixture f(*model_, GetParam().kv, false);
  f.step({{0, toks(1, 9, V)}, {1, toks(2, 5, V)}}, Drive::kLayers);
  const double gap = f.step({{0, toks(3, 1, V)}, {2, toks(4, 70, V)}, {1, toks(5, 1, V)}}, Drive::kLayers, false, false);
  EXPECT_TRUE(std::isfinite(gap));
}

// Each slot's KV cache and states are allocated apart; the step scratch is still exactly the
// listed buffers (cuda_step_scratch.h, with a position word and a snapshot per slot).
TEST_P(CudaSlots, ScratchIsTheListedBuffersWithSlots) {
  gpu_worker::BackendOptions o;
  o.max_tokens = kMaxTokens;
  o.max_context = kContext;
  o.kv_type = GetParam().kv;
  o.slots = kSlots;
  auto b = gpu_worker::make_cuda_backend(*model_, o);
  const auto& cb = dynamic_cast<const gpu_worker::cuda_impl::CudaBackend&>(*b);
  EXPECT_EQ(cb.step_scratch_allocated_bytes(), cb.step_scratch().total(16));
  EXPECT_EQ(cb.step_scratch().bytes("pos"), kSlots * sizeof(int32_t));
  EXPECT_EQ(b->slots(), kSlots);
}

INSTANTIATE_TEST_SUITE_P(Files, CudaSlots, ::testing::ValuesIn(cases()),
                         [](const auto& param_info) { return param_info.param.name; });

// Bad segment lists are refused with the CPU backend's messages (backend_slots_test).
TEST(CudaSlotsRefusals, BadSegmentsAreRefused) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  const model::Model m = model::Model::load(cuda_arch_test::arch_file("slots-refusals", "qwen3next-tiny", kQuant, "", "").string());
  gpu_worker::BackendOptions o;
  o.max_tokens = 8;
  o.max_context = 64;
  o.slots = 2;
  auto b = gpu_worker::make_cuda_backend(m, o);
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
  // Nothing was cached by the refused step: both slots still start at 0.
  for (int s = 0; s < 2; ++s) {
    b->select_slot(s);
    EXPECT_EQ(b->n_past(), 0);
  }
  o.slots = static_cast<int>(group::kMaxSegments) + 1;
  EXPECT_THROW(gpu_worker::make_cuda_backend(m, o), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
