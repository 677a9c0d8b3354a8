// The MoE block of moe_block.cpp cut into the pieces that run in different processes of the
// group: routing and the final sum on the gpu_worker, routed experts on the cpu_expert_workers.
// The arithmetic of ReferenceExecutor::moe_block (softmax router, top-k with ties to the lower
// id, renormalised weights, SwiGLU, sum in top-k order, shared expert last), so the group's
// logits are bit-identical to the reference (tests/group checks it); moe_block.cpp is built from
// these same functions.
// Scratch buffers are caller-owned and sized once, so a step allocates nothing of its own.
#pragma once
#include <array>
#include <cstdint>
#include <vector>

#include "common/model/model.h"
#include "common/reference/matmul.h"
#include "common/reference/thread_pool.h"

namespace moraine::reference {

struct RouterScratch {
  std::vector<float> logits, prob;   // [max_tokens * n_expert], [n_expert]
  std::vector<int64_t> order;        // [n_expert]
  std::vector<float> select, group_score;   // [n_expert]: the choice's scores, and per group
  std::vector<int64_t> group_order;         // [n_expert]
  void reserve(const model::HParams& hp, int64_t max_tokens);
};

// chosen[t * k + s] / weight[t * k + s]: the s-th expert of token t and its router weight.
void route_top_k(const model::HParams& hp, const model::MoeWeights& W, const float* h, int64_t n,
                 int32_t* chosen, float* weight, RouterScratch& scratch, ThreadPool& pool,
                 DotOrderSeed order = 0);

// The top-k-then-softmax router (gpt-oss): logits (+ the router's bias), the k largest (ties to
// the lower id), softmax over those k.
void route_top_k_softmax(const model::HParams& hp, const model::MoeWeights& W, const float* h, int64_t n,
                         int32_t* chosen, float* weight, RouterScratch& scratch, ThreadPool& pool,
                         DotOrderSeed order = 0);

// The sigmoid router of deepseek v3 / glm4moe: s = sigmoid(logits); the choice ranks s + the
// score bias (exp_probs_b, when bound): with n_group > 1 only the topk_group groups of experts
// (contiguous blocks) whose two best biased scores sum highest take part; the k largest (ties to
// the lower id); their weights are the unbiased s, renormalised when the part says so.
void route_sigmoid_group_top_k(const model::HParams& hp, const model::RouterPart& part, const model::MoeWeights& W,
                               const float* h, int64_t n, int32_t* chosen, float* weight, RouterScratch& scratch,
                               ThreadPool& pool, DotOrderSeed order = 0);

// The layer's router, as its FfnPart's RouterPart says, its weights times routed_scale (every
// kind: the combine needs no scale of its own) (the one entry the group's gpu_worker and
// the reference's moe_block call: a new router kind is added here once).
void route_layer(const model::HParams& hp, const model::FfnPart& part, const model::MoeWeights& W, const float* h,
                 int64_t n, int32_t* chosen, float* weight, RouterScratch& scratch, ThreadPool& pool,
                 DotOrderSeed order = 0);

struct ExpertScratch {
  std::vector<float> g, u;   // [max_rows * ff]
  void reserve(int64_t max_rows, int64_t ff);
};

// y[m][n_embd] = down(silu(gate x) * up x) for m rows of x.
void swiglu_expert(const model::Matrix& gate, const model::Matrix& up, const model::Matrix& down,
                   const float* x, int64_t m, float* y, ExpertScratch& scratch, ThreadPool& pool,
                   DotOrderSeed order = 0);

// Expert e of W as the ExpertsPart says, for the parts swiglu_expert does not cover: per-expert
// biases on gate, up and down, and gpt-oss's clamped SwiGLU
//   g = min(gate, limit); u = clamp(up, -limit, limit); act = g * sigmoid(alpha g) * (u + 1).
void biased_expert(const model::MoeWeights& W, int64_t e, const model::ExpertsPart& part, const float* x, int64_t m,
                   float* y, ExpertScratch& scratch, ThreadPool& pool, DotOrderSeed order = 0);
// The same on expert e's matrices given apart from W (a copy elsewhere: the group's hand-off), its
// biases still W's.
void biased_expert(const std::array<model::Matrix, 3>& gate_up_down, const model::MoeWeights& W, int64_t e,
                   const model::ExpertsPart& part, const float* x, int64_t m, float* y, ExpertScratch& scratch,
                   ThreadPool& pool, DotOrderSeed order = 0);

// Routed expert e of W on m rows, as the ExpertsPart says: swiglu_expert for plain SwiGLU without
// biases, else biased_expert (the one entry the reference and the group's backends call).
void routed_expert(const model::MoeWeights& W, int64_t e, const model::ExpertsPart& part, const float* x, int64_t m,
                   float* y, ExpertScratch& scratch, ThreadPool& pool, DotOrderSeed order = 0);
void routed_expert(const std::array<model::Matrix, 3>& gate_up_down, const model::MoeWeights& W, int64_t e,
                   const model::ExpertsPart& part, const float* x, int64_t m, float* y, ExpertScratch& scratch,
                   ThreadPool& pool, DotOrderSeed order = 0);

// A dense SwiGLU FFN layer (glm4moe's and deepseek2's leading ones): x[t] += down(silu(gate h) *
// up h) for n rows, y a caller's [n][n_embd] scratch; the reference's layer and the group's CPU
// backend both run it, so their sums are the same floats.
void dense_ffn(const model::DenseFfnWeights& W, const float* h, int64_t n, float* x, float* y, ExpertScratch& scratch,
               ThreadPool& pool, DotOrderSeed order = 0);

// x[t] += sum_s weight[t,s] * slot_rows[t * k + s] (+ sigmoid(h . shared_router) * shared[t]).
// slot_rows[i] points at slot i's expert output row; shared is null when the model has none. A
// shared expert without a gate (glm4moe: the recipe binds no shared_router) is added as it is.
void moe_combine(const model::HParams& hp, const model::MoeWeights& W, const float* h, int64_t n,
                 const float* weight, const float* const* slot_rows, const float* shared, float* x);

}  // namespace moraine::reference
