// The CUDA backend's step scratch list (gpu_worker/cuda_step_scratch.h) and the coordinator's
// reserve built from it (coordinator/device_reserve.h), on the Qwen3-30B-A3B and Qwen3-Next-80B-A3B
// shapes (tools/synth/shapes.h), without a GPU. Sizes are checked against the kernels' documented
// layouts, written out here from their headers' descriptions: the split-KV records
// (attention.h, attention_decode.h), moe_fused's workspace (moe_fused.h), delta_net_mix's
// workspace (delta_net.h). Each of the three gaps the earlier formula had (session 9) has a case:
// the expert path's rows below 64-row steps, the split-KV records, moe_fused's workspace.
// tests/cuda/cuda_backend_golden_test's ScratchIsTheListedBuffers checks on the GPU that the
// backend allocates exactly this list.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/gguf/gguf.h"
#include "common/model/model.h"
#include "coordinator/device_reserve.h"
#include "coordinator/group_layout.h"
#include "gpu_worker/backend.h"
#include "gpu_worker/cuda_step_scratch.h"
#include "tools/synth/shapes.h"

namespace moraine::group {
namespace {

using gpu_worker::CudaStepScratch;
using gpu_worker::CudaStepScratchOptions;
using gpu_worker::cuda_step_scratch;

constexpr uint64_t kMiB2 = uint64_t{2} << 20;

// A model of a named shape with no weight data: what the scratch depends on is the
// hyperparameters, which layers are recurrent, the q projection's rows and the experts' formats.
struct ShapeModel {
  gguf::TensorInfo info;   // any non-null info makes a Matrix present
  model::HParams hp;
  std::vector<model::LayerWeights> layers;
};

std::unique_ptr<ShapeModel> shape_model(const std::string& name, const std::vector<TensorType>& down_types) {
  const synth::ShapeSpec s = synth::find_shape(name);
  auto out = std::make_unique<ShapeModel>();
  model::HParams& hp = out->hp;
  hp.n_layer = s.n_layer;
  hp.n_embd = s.hidden;
  hp.n_vocab = s.vocab;
  hp.n_head = s.n_head;
  hp.n_head_kv = s.n_head_kv;
  hp.head_dim = s.head_dim;
  hp.n_rot = s.n_rot;
  hp.n_expert = s.n_expert;
  hp.n_expert_used = s.n_expert_used;
  hp.n_ff_exp = s.ff_exp;
  hp.n_ff_shexp = s.ff_shexp;
  if (s.next()) {
    hp.ssm_conv_kernel = s.conv_kernel;
    hp.ssm_head_k_dim = s.ssm_head_dim;
    hp.ssm_head_v_dim = s.ssm_head_dim;
    hp.ssm_n_k_heads = s.ssm_k_heads;
    hp.ssm_n_v_heads = s.ssm_v_heads;
    hp.full_attention_interval = s.full_attn_interval;
  }
  out->layers.resize(static_cast<size_t>(s.n_layer));
  for (int64_t il = 0; il < s.n_layer; ++il) {
    model::LayerWeights& L = out->layers[il];
    L.recurrent = s.recurrent(il);
    hp.recurrent.push_back(L.recurrent);
    if (!L.recurrent) {
      L.attn.q.info = &out->info;
      L.attn.q.n_rows = s.n_head * s.head_dim * (s.next() ? 2 : 1);   // qwen3next: a gate beside each head
    }
    L.moe.down.all.info = &out->info;
    L.moe.down.all.type = down_types[static_cast<size_t>(il) % down_types.size()];
  }
  return out;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
uint64_t round_up(uint64_t v, uint64_t m) { return (v + m - 1) / m * m; }

// attention.h: a record of head_dim + 2 floats per (row, head, 256-position chunk); attention_decode.h:
// head_dim + 4 per (row, head, split), splits one per 32-position tile up to 32 tiles, 32 up to
// 128 tiles, 64 above. Rows: at most 16 at once (longer steps go in passes).
uint64_t split_kv_bytes(const model::HParams& hp, int64_t rows, int64_t ctx) {
  rows = std::min<int64_t>(rows, 16);
  const int64_t tiles = ceil_div(ctx, 32);
  const int64_t splits = tiles <= 32 ? tiles : tiles <= 128 ? 32 : 64;
  const int64_t chunked = rows * hp.n_head * ceil_div(ctx, 256) * (hp.head_dim + 2);
  const int64_t decode = rows * hp.n_head * splits * (hp.head_dim + 4);
  return static_cast<uint64_t>(std::max(chunked, decode)) * 4;
}

// moe_fused.h / .cu: completion counters for 16 x 32 slots per block of h's activation format
// and per 8 output rows, then h (floats), h quantized (padded blocks: Q8_K 304 bytes per 256
// values, Q8_0 48 per 32, rows rounded to 16 bytes plus a spare 16), the slots' outputs; each part
// 256-byte aligned; sized for 16 tokens of top-k.
uint64_t moe_workspace_bytes(const model::HParams& hp, TensorType down) {
  const bool q8k = down != TensorType::Q8_0 && down != TensorType::MXFP4 && down != TensorType::Q4_0;
  const uint64_t block = q8k ? 256 : 32, stride = q8k ? 304 : 48;
  const uint64_t ff = static_cast<uint64_t>(hp.n_ff_exp), d = static_cast<uint64_t>(hp.n_embd);
  const uint64_t slots = 16 * static_cast<uint64_t>(hp.n_expert_used);
  const uint64_t hq_row = round_up(ff / block * stride, 16) + 16;
  return round_up(4 * 512 * (ff / block), 256) + round_up(4 * static_cast<uint64_t>(ceil_div(hp.n_embd, 8)), 256) +
         round_up(4 * slots * ff, 256) + round_up(slots * hq_row, 256) + round_up(4 * slots * d, 256);
}

const char* const kShapes[] = {"qwen3moe-30b-a3b", "qwen3next-80b-a3b"};

// The reserve is the context, the listed scratch at 2 MiB per buffer, and the weights arena's
// rounding; the list has no buffer twice, none empty, and grows with the step's rows and the context.
TEST(CudaStepScratch, DeviceReserveIsTheListedScratch) {
  for (const char* name : kShapes) {
    const auto sm = shape_model(name, {TensorType::Q4_K});
    const ShapeModel& m = *sm;
    uint64_t last = 0;
    for (int64_t T : {1, 16, 63, 64, 512}) {
      for (int64_t ctx : {256, 4100, 32768}) {
        SCOPED_TRACE(std::string(name) + " T=" + std::to_string(T) + " ctx=" + std::to_string(ctx));
        const CudaStepScratch s = cuda_step_scratch(m.hp, cuda_reserve_scratch_options(m.layers, T, ctx));
        std::set<std::string> names;
        for (const gpu_worker::ScratchBuffer& b : s.buffers) {
          EXPECT_TRUE(names.insert(b.name).second) << b.name << " listed twice";
          EXPECT_GT(b.bytes, 0u) << b.name;
        }
        const uint64_t arena = static_cast<uint64_t>(m.hp.n_layer) * kMiB2 + (uint64_t{64} << 20);
        EXPECT_EQ(cuda_device_reserve_bytes(m.hp, m.layers, T, ctx), kCudaContextReserve + s.total(kMiB2) + arena);
        EXPECT_GE(s.total(kMiB2), s.total(16));
        if (ctx == 32768) {
          EXPECT_GT(s.total(16), last) << "more rows, more scratch";
          last = s.total(16);
        }
      }
    }
  }
}

// Gap 1: the per-expert path's gather / scatter rows exist whenever some layer's experts are not
// fused, at any step length (the earlier formula counted them from 64 rows only); the coordinator,
// not knowing which layers moe_fused takes, counts them always. Long steps have them for the
// PrefillGemm's per-expert path anyway.
TEST(CudaStepScratch, ExpertPathRowsAtEveryStepLength) {
  for (const char* name : kShapes) {
    const auto sm = shape_model(name, {TensorType::Q4_K});
    const model::HParams& hp = sm->hp;
    for (int64_t T : {1, 16, 63, 64, 512}) {
      SCOPED_TRACE(std::string(name) + " T=" + std::to_string(T));
      const uint64_t S = static_cast<uint64_t>(T * hp.n_expert_used);
      const CudaStepScratch reserve = cuda_step_scratch(hp, cuda_reserve_scratch_options(sm->layers, T, 4096));
      EXPECT_EQ(reserve.bytes("expert_in"), S * static_cast<uint64_t>(hp.n_embd) * 4);
      EXPECT_EQ(reserve.bytes("expert_g"), S * static_cast<uint64_t>(hp.n_ff_exp) * 4);
      EXPECT_EQ(reserve.bytes("expert_u"), S * static_cast<uint64_t>(hp.n_ff_exp) * 4);
      EXPECT_EQ(reserve.bytes("expert_out"), S * static_cast<uint64_t>(hp.n_embd) * 4);
      EXPECT_EQ(reserve.bytes("expert_idx"), 4 * S * 4);   // token, slab, slot, expert id
      CudaStepScratchOptions o;
      o.max_tokens = T;
      o.max_context = 4096;
      o.gemm_prefill_rows = 64;
      o.fused_down_types = {TensorType::Q4_K};   // every layer fused
      EXPECT_EQ(cuda_step_scratch(hp, o).has("expert_in"), T >= 64) << "all fused: only the PrefillGemm needs them";
      EXPECT_EQ(cuda_step_scratch(hp, o).has("gemm_weights"), T >= 64);
      o.expert_matvec = true;   // one layer on the batched matvec path
      EXPECT_EQ(cuda_step_scratch(hp, o).bytes("expert_in"), S * static_cast<uint64_t>(hp.n_embd) * 4);
    }
  }
}

// The PrefillGemm's buffers (gemm_prefill_limits.h, which gemm_prefill.cu's constructor
// allocates from), written out from gemm_prefill.h's description: a 20 Mi-element 16-bit weight
// workspace, X rounded to 16 bits for the larger of a window's rows at the widest matrix's
// columns and every expert slot at the experts' width (n_embd or n_ff), cuBLAS's
// 32 MiB, and a ring of 4 tile tables of 16-byte entries (one per expert plus one per 32 rows)
// followed by one weight pointer per expert. Only steps from gemm_prefill_rows have them.
TEST(CudaStepScratch, PrefillGemmBuffersFollowTheirLayout) {
  for (const char* name : kShapes) {
    const auto sm = shape_model(name, {TensorType::Q4_K});
    const model::HParams& hp = sm->hp;
    const uint64_t widest = static_cast<uint64_t>(
        std::max({hp.n_embd, hp.n_head * hp.head_dim, hp.n_ff_exp, hp.n_ff_shexp, hp.ssm_value_dim()}));
    for (int64_t T : {64, 100, 512, 2048}) {
      SCOPED_TRACE(std::string(name) + " T=" + std::to_string(T));
      CudaStepScratchOptions o;
      o.max_tokens = T;
      o.max_context = 4096;
      o.gemm_prefill_rows = 64;
      const CudaStepScratch s = cuda_step_scratch(hp, o);
      const uint64_t S = static_cast<uint64_t>(T * hp.n_expert_used), E = static_cast<uint64_t>(hp.n_expert);
      EXPECT_EQ(s.bytes("gemm_weights"), uint64_t{40} << 20);
      const uint64_t expert_cols = static_cast<uint64_t>(std::max(hp.n_embd, hp.n_ff_exp));
      EXPECT_EQ(s.bytes("gemm_inputs"), std::max(static_cast<uint64_t>(T) * widest, S * expert_cols) * 2);
      // The matvec path's activations: only steps below the GEMM's 64 rows (63 rows of k slots at
      // the widest matrix's floats); longer matvecs run in passes.
      EXPECT_EQ(s.bytes("act"), 63 * static_cast<uint64_t>(hp.n_expert_used) * widest * 4);
      EXPECT_EQ(s.bytes("gemm_cublas_workspace"), uint64_t{32} << 20);
      EXPECT_EQ(s.bytes("gemm_tile_tables"), 4 * (16 * (E + S / 32 + 1) + sizeof(void*) * E));
      const cuda::PrefillGemmLimits lim = gpu_worker::cuda_scratch_prefill_gemm_limits(hp, o);
      EXPECT_EQ(lim.max_tokens, static_cast<int64_t>(S));
      EXPECT_EQ(lim.max_experts, hp.n_expert);
    }
  }
}

// Gap 2: the split-KV records are the largest of the three kernels' needs for up to 16 rows,
// at contexts on both sides of each split rule's steps (random ones too, fixed seed).
TEST(CudaStepScratch, SplitKvRecordsAreTheKernelsLargest) {
  std::mt19937_64 rng(20261130);
  std::vector<int64_t> contexts = {16, 31, 32, 33, 256, 257, 1024, 1025, 4096, 4097, 32768, 262144};
  for (int i = 0; i < 20; ++i) contexts.push_back(std::uniform_int_distribution<int64_t>(16, 300000)(rng));
  for (const char* name : kShapes) {
    const auto sm = shape_model(name, {TensorType::Q4_K});
    for (int64_t ctx : contexts) {
      for (int64_t T : {1, 7, 16}) {
        if (T > ctx) continue;
        SCOPED_TRACE(std::string(name) + " T=" + std::to_string(T) + " ctx=" + std::to_string(ctx));
        const CudaStepScratch s = cuda_step_scratch(sm->hp, cuda_reserve_scratch_options(sm->layers, T, ctx));
        EXPECT_EQ(s.bytes("attn_scratch"), split_kv_bytes(sm->hp, T, ctx));
      }
    }
    // Longer steps reuse 16 rows' records.
    const CudaStepScratch s512 = cuda_step_scratch(sm->hp, cuda_reserve_scratch_options(sm->layers, 512, 32768));
    EXPECT_EQ(s512.bytes("attn_scratch"), split_kv_bytes(sm->hp, 16, 32768));
  }
}

// Gap 3: moe_fused's workspace is the largest over the fused layers' down formats (a mixed
// quantization map: Q4_K_M gives some layers Q6_K down experts; Q8_0 pads its blocks
// differently), not a flat 16 MiB.
TEST(CudaStepScratch, MoeWorkspaceFollowsTheDownFormats) {
  for (const char* name : kShapes) {
    for (const std::vector<TensorType>& downs : std::vector<std::vector<TensorType>>{
             {TensorType::Q4_K}, {TensorType::Q8_0}, {TensorType::Q4_K, TensorType::Q6_K}, {TensorType::Q6_K, TensorType::Q8_0}}) {
      const auto sm = shape_model(name, downs);
      uint64_t want = 0;
      for (TensorType t : downs) want = std::max(want, moe_workspace_bytes(sm->hp, t));
      const CudaStepScratch s = cuda_step_scratch(sm->hp, cuda_reserve_scratch_options(sm->layers, 16, 4096));
      EXPECT_EQ(s.bytes("moe_fused_ws"), want) << name << " " << downs.size() << " formats";
      EXPECT_LT(s.bytes("moe_fused_ws"), uint64_t{16} << 20);
    }
  }
}

// The family's own buffers: qwen3next's shared expert and Gated DeltaNet scratch (delta_net.h:
// conv output, beta and gate per token), the gated q | k | v rows; none of them for qwen3moe.
TEST(CudaStepScratch, FamilyBuffers) {
  const auto next = shape_model("qwen3next-80b-a3b", {TensorType::Q4_K});
  const model::HParams& hp = next->hp;
  const int64_t T = 64;
  const CudaStepScratch s = cuda_step_scratch(hp, cuda_reserve_scratch_options(next->layers, T, 4096));
  const int64_t conv = 2 * hp.ssm_n_k_heads * hp.ssm_head_k_dim + hp.ssm_n_v_heads * hp.ssm_head_v_dim;
  EXPECT_EQ(s.bytes("delta_ws"), static_cast<uint64_t>(T * (conv + 2 * hp.ssm_n_v_heads)) * 4);
  EXPECT_EQ(s.bytes("delta_mixed"), static_cast<uint64_t>(T * conv) * 4);
  EXPECT_EQ(s.bytes("shared_g"), static_cast<uint64_t>(T * hp.n_ff_shexp) * 4);
  EXPECT_EQ(s.bytes("qg"), static_cast<uint64_t>(T * (2 * hp.n_head * hp.head_dim + 2 * hp.n_head_kv * hp.head_dim)) * 4);
  const auto moe = shape_model("qwen3moe-30b-a3b", {TensorType::Q4_K});
  const CudaStepScratch m = cuda_step_scratch(moe->hp, cuda_reserve_scratch_options(moe->layers, T, 4096));
  for (const char* absent : {"delta_ws", "delta_mixed", "shared_g", "shared_logit"}) EXPECT_FALSE(m.has(absent)) << absent;
  EXPECT_EQ(m.bytes("qg"), static_cast<uint64_t>(T * (moe->hp.n_head + 2 * moe->hp.n_head_kv) * moe->hp.head_dim) * 4);
}

// glm4moe's leading dense layers (GLM-4.5-Air: one of width 10944): their gate and up rows, and the
// activation staging wide enough for the dense down projection's inputs; none for qwen3moe.
TEST(CudaStepScratch, DenseLayerBuffers) {
  const auto air = shape_model("glm4.5-air", {TensorType::Q4_K});
  const synth::ShapeSpec spec = synth::find_shape("glm4.5-air");
  for (int64_t il = 0; il < spec.n_dense_lead; ++il) {
    model::LayerWeights& L = air->layers[il];
    L.moe.down = {};
    L.dense.gate.info = &air->info;
    L.dense.gate.n_rows = spec.dense_ff;
  }
  const int64_t T = 64, S = T * air->hp.n_expert_used;
  const CudaStepScratch s = cuda_step_scratch(air->hp, cuda_reserve_scratch_options(air->layers, T, 4096));
  EXPECT_EQ(s.bytes("dense_g"), static_cast<uint64_t>(T * spec.dense_ff) * 4);
  EXPECT_EQ(s.bytes("dense_u"), static_cast<uint64_t>(T * spec.dense_ff) * 4);
  // act holds the matvec path's rows: steps below the GEMM's 64 rows, k slots each, at the widest input.
  EXPECT_EQ(s.bytes("act"), static_cast<uint64_t>((S - air->hp.n_expert_used) * std::max(spec.dense_ff, air->hp.n_head * air->hp.head_dim)) * 4);
  const auto moe = shape_model("qwen3moe-30b-a3b", {TensorType::Q4_K});
  const CudaStepScratch m = cuda_step_scratch(moe->hp, cuda_reserve_scratch_options(moe->layers, T, 4096));
  EXPECT_FALSE(m.has("dense_g") || m.has("dense_u"));
}

// Gives every layer's expert tensors their shapes (gate and up Q4_K, down as shape_model made it)
// and returns the largest arena slot (group::ArenaLayout::slot_bytes) among them.
uint64_t shape_experts(ShapeModel& sm) {
  const model::HParams& hp = sm.hp;
  uint64_t largest = 0;
  for (model::LayerWeights& L : sm.layers) {
    for (model::ExpertTensor* t : {&L.moe.gate, &L.moe.up, &L.moe.down}) {
      const bool down = t == &L.moe.down;
      if (!down) t->all.type = TensorType::Q4_K;
      t->all.info = &sm.info;
      t->rows_per_expert = down ? hp.n_embd : hp.n_ff_exp;
      t->all.row_bytes = row_bytes(t->all.type, down ? hp.n_ff_exp : hp.n_embd);
    }
    largest = std::max<uint64_t>(largest, group::ArenaLayout::slot_bytes(L.moe));
  }
  return largest;
}

// Long steps' staged experts (BackendOptions::stage_experts): the buffer of that many of the
// largest arena slots is listed whenever the PrefillGemm exists (steps of gemm_prefill_rows rows
// fit), nothing below that; the coordinator's reserve holds it when the gpu_worker's default
// stages.
TEST(CudaStepScratch, StagedExpertSlots) {
  constexpr int kSlots = 8;
  for (const char* name : kShapes) {
    auto sm = shape_model(name, {TensorType::Q4_K, TensorType::Q6_K});
    const model::HParams& hp = sm->hp;
    const uint64_t largest = shape_experts(*sm);
    ASSERT_GT(largest, 0u) << name;
    const int64_t gemm_rows = gpu_worker::BackendOptions{}.gemm_prefill_rows;
    CudaStepScratchOptions o = cuda_reserve_scratch_options(sm->layers, gemm_rows, 4096);
    EXPECT_EQ(o.stage_expert_bytes, static_cast<uint64_t>(gpu_worker::BackendOptions{}.stage_experts) * largest) << name;
    o.stage_expert_bytes = kSlots * largest;
    EXPECT_EQ(cuda_step_scratch(hp, o).bytes("stage_experts"), kSlots * largest) << name;
    CudaStepScratchOptions small = cuda_reserve_scratch_options(sm->layers, gemm_rows - 1, 4096);
    small.stage_expert_bytes = kSlots * largest;
    EXPECT_FALSE(cuda_step_scratch(hp, small).has("stage_experts")) << name;
  }
}

// The hand-off's taken expert (gpu_worker --device-takes-from, off by default): its copy (one
// arena slot, ArenaLayout::slot_bytes, plus the 16 bytes moe_fused may read past it), a slot
// table per (part layout, expert) and moe_fused's workspace; the coordinator's reserve holds them
// only when the gpu_worker's default takes experts.
TEST(CudaStepScratch, TakenExpertBuffers) {
  for (const char* name : kShapes) {
    auto sm = shape_model(name, {TensorType::Q4_K, TensorType::Q6_K});
    const model::HParams& hp = sm->hp;
    const uint64_t largest = shape_experts(*sm);
    CudaStepScratchOptions o = cuda_reserve_scratch_options(sm->layers, 16, 4096);
    const CudaStepScratch off = cuda_step_scratch(hp, o);
    EXPECT_EQ(o.take_expert_bytes > 0, gpu_worker::BackendOptions{}.take_expert_from > 0) << name;
    EXPECT_EQ(off.has("take_expert"), gpu_worker::BackendOptions{}.take_expert_from > 0) << name;
    o.take_expert_bytes = largest;
    o.take_down_types = {TensorType::Q4_K, TensorType::Q6_K};
    o.take_layouts = 1;   // gate and up Q4_K in every layer: down's format moves no offset
    const CudaStepScratch on = cuda_step_scratch(hp, o);
    EXPECT_EQ(on.bytes("take_expert"), largest + 16) << name;
    EXPECT_EQ(on.bytes("take_table"), static_cast<uint64_t>(hp.n_expert * ((hp.n_expert + 1) / 2 * 2)) * 24) << name;
    EXPECT_EQ(on.bytes("take_ws"), std::max(moe_workspace_bytes(hp, TensorType::Q4_K), moe_workspace_bytes(hp, TensorType::Q6_K)))
        << name;
    EXPECT_EQ(on.total(16), off.total(16) + round_up(largest + 16, 16) + round_up(on.bytes("take_table"), 16) +
                                round_up(on.bytes("take_ws"), 16))
        << name;
  }
  // The Qwen3-30B-A3B expert at Q4_K: three 864 KiB parts (2.65 MB), already 4 KiB multiples.
  model::MoeWeights moe;
  gguf::TensorInfo info;
  for (model::ExpertTensor* t : {&moe.gate, &moe.up, &moe.down}) {
    const bool down = t == &moe.down;
    t->all.info = &info;
    t->all.type = TensorType::Q4_K;
    t->all.row_bytes = row_bytes(TensorType::Q4_K, down ? 768 : 2048);
    t->rows_per_expert = down ? 2048 : 768;
  }
  EXPECT_EQ(group::ArenaLayout::slot_bytes(moe), uint64_t{3} * 884736);
  EXPECT_EQ(group::ArenaLayout::part_offsets(moe), (std::array<size_t, 3>{0, 884736, 2 * 884736}));
  moe.down.all.type = TensorType::Q6_K;   // 2048 rows of 630 bytes: 1290240, a 4 KiB multiple as well
  moe.down.all.row_bytes = row_bytes(TensorType::Q6_K, 768);
  EXPECT_EQ(group::ArenaLayout::slot_bytes(moe), uint64_t{2} * 884736 + 1290240);
  moe.gate.rows_per_expert = 767;   // a gate of 883584 bytes: up starts at the next 4 KiB
  EXPECT_EQ(group::ArenaLayout::part_offsets(moe)[1], 884736u);
}

TEST(CudaStepScratch, RejectsStepsLongerThanTheContext) {
  const auto sm = shape_model("qwen3moe-30b-a3b", {TensorType::Q4_K});
  CudaStepScratchOptions o;
  o.max_tokens = 0;
  EXPECT_THROW(cuda_step_scratch(sm->hp, o), std::invalid_argument);
  o.max_tokens = 512;
  o.max_context = 256;
  EXPECT_THROW(cuda_step_scratch(sm->hp, o), std::invalid_argument);
}

}  // namespace
}  // namespace moraine::group
