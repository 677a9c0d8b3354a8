// What a CUDA backend step enqueues on its stream (cuda_backend_impl.h).
#include "gpu_worker/cuda_backend_impl.h"

#include <algorithm>
#include <stdexcept>

#include "common/formats/quant.h"
#include "kernels/cuda/embed_rows.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/matvec_float.h"
#include "kernels/cuda/moe_combine.h"
#include "kernels/cuda/quantize_activations_llama.h"
#include "kernels/cuda/rms_norm.h"
#include "kernels/cuda/rms_norm_quantize.h"
#include "kernels/cuda/router.h"
#include "kernels/cuda/router_fused.h"
#include "kernels/cuda/row_gather.h"
#include "kernels/cuda/swiglu.h"

namespace moraine::gpu_worker::cuda_impl {

void CudaBackend::enqueue_embed(int64_t n) {
  const model::HParams& hp = m_.hp;
  const int64_t d = hp.n_embd;
  // The first position of each segment (a plain step: one), read by RoPE, the KV store and attention.
  CUDA_CHECK(cudaMemcpyAsync(pos_dev_.get(), pos_pinned_.get(), segments_.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                             stream_));
  if (tok_embd_.size() == 0) {  // a format without a device kernel: the scalar dequantizer
    std::vector<float> rows(static_cast<size_t>(n * d));
    for (int64_t t = 0; t < n; ++t) dequantize_row(m_.tok_embd.type, m_.tok_embd.row(tok_pinned_[t]), rows.data() + t * d, d);
    CUDA_CHECK(cudaMemcpyAsync(x_.get(), rows.data(), rows.size() * sizeof(float), cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));  // `rows` is pageable and about to go
    return;
  }
  CUDA_CHECK(cudaMemcpyAsync(token_ids_.get(), tok_pinned_.get(), static_cast<size_t>(n) * sizeof(int32_t),
                             cudaMemcpyHostToDevice, stream_));
  cuda::embed_rows(m_.tok_embd.type, tok_embd_.get(), m_.tok_embd.row_bytes, d, token_ids_.get(), n, x_.get(),
                   stream_);
}

// copy_chosen: the layer's routing goes to chosen_pinned_ now (a captured step copies every
// layer's at its end instead).
void CudaBackend::enqueue_layer_whole(int64_t il, int64_t n, bool copy_chosen) {
  enqueue_mixer(il, n);
  if (layers_[il].dense) {
    enqueue_dense_ffn(il, n);
  } else {
    enqueue_route(il, n);
  }
  if (copy_chosen)
    copy_to_host(chosen_pinned_.get() + (il * step_rows_ + window_first_) * m_.hp.n_expert_used, chosen_of(il, n),
                 static_cast<size_t>(n * m_.hp.n_expert_used) * sizeof(int32_t));
  if (layers_[il].dense) return;
  if (!layers_[il].shared_up) {
    enqueue_fused_experts(il, n, true);
    return;
  }
  enqueue_fused_experts(il, n);
  enqueue_shared(il, n);
  enqueue_combine(il, n, false);
}

namespace {

// Whether the FFN input's norm, the router matvec and the softmax top-k go out as one launch
// (rms_norm_router_fused, the bits of the three): a float router, no shared expert (whose
// quantized matrices want h_'s q8 activations from norm_h), and a decode-sized step: its CTAs
// read the router rows once per token (a grid of tokens x row blocks), where the batched matvec
// reads them once per step. With every step fused, prefill fell to 1741 tok/s at 512 tokens and
// 1394 at 8192 (30B all in VRAM, H200, bench/side-by-side run D, session 8); decode-sized only:
// 2240 / 1815 (run E; session 7's table had 2561 / 1819).
constexpr int64_t kNormRouteFusedMaxRows = 4;
bool norm_route_fused(const DevLayer& L, const model::HParams& hp, const model::RouterPart& router, int64_t n) {
  return router.kind == model::RouterKind::SoftmaxTopK && n <= kNormRouteFusedMaxRows && !L.shared_gate && L.router && L.router.cols == hp.n_embd &&
         L.router.rows == hp.n_expert &&
         cuda::rms_norm_router_fused_supported(L.router.type, L.router.rows, L.router.cols);
}

}  // namespace

void CudaBackend::enqueue_mixer(int64_t il, int64_t n) {
  DevLayer& L = layers_[il];
  norm_h(xw(), L.attn_norm.get(), n, L.recurrent ? L.qkv : L.attn_qkv ? L.attn_qkv : L.q);
  if (L.recurrent) {
    delta_net_block(L, n);
  } else {
    attention_block(L, n);
  }
  if (norm_route_fused(L, m_.hp, m_.layers[il].recipe.ffn.router, n)) {   // enqueue_route normalises as well
    act_of_h_ = TensorType::F32;
    return;
  }
  // The router is F32 in the files we know; the shared expert's (or dense FFN's) matrices are quantized.
  norm_h(xw(), L.ffn_norm.get(), n, L.dense ? L.dense_gate : L.shared_gate ? L.shared_gate : L.router);
}

// h_ = RMSNorm(x) * w for n rows, and act_ = h_ quantized for `consumer` when it dots q8
// activations; run_matvec then skips quantizing h_ again for every matrix of that activation
// type (q, k and v when not stacked) until act_ is overwritten. q8_0: one launch
// (rms_norm_quantize, the pair's bits, sliced over 256-element CTAs): 2.0 us per layer faster
// than rms_norm then quantize_activations_llama in the decode chain, where its single-CTA
// version was 0.5 us slower (moraine-kernel-bench cuda --mixer-only, H200, 2026-11-30).
void CudaBackend::norm_h(const float* x, const float* w, int64_t n, const DevMatrix& consumer) {
  const int64_t d = m_.hp.n_embd;
  const float eps = static_cast<float>(m_.hp.rms_eps);
  act_of_h_ = TensorType::F32;   // none
  if (consumer && consumer.cols == d && cuda::matvec_supported(consumer.type) && !use_gemm(consumer, n) &&
      row_bytes(dot_activation_type(consumer.type), d) * static_cast<size_t>(n) <= act_.size()) {
    const TensorType at = dot_activation_type(consumer.type);
    if (at == TensorType::Q8_0) {
      cuda::rms_norm_quantize(x, w, h_.get(), at, act_.get(), d, n, eps, stream_);
    } else {   // q8_K: the fused kernel's single-CTA path, not measured faster than the pair
      cuda::rms_norm(x, w, h_.get(), d, n, eps, stream_);
      cuda::quantize_activations_llama(at, h_.get(), act_.get(), d, n, stream_);
    }
    act_of_h_ = at;
    act_of_h_rows_ = n;
    act_src_ = h_.get();
    return;
  }
  cuda::rms_norm(x, w, h_.get(), d, n, eps, stream_);
}

void CudaBackend::enqueue_route(int64_t il, int64_t n) {
  const model::HParams& hp = m_.hp;
  const DevLayer& L = layers_[il];
  const model::RouterPart& router = m_.layers[il].recipe.ffn.router;
  const int64_t k = hp.n_expert_used;
  if (norm_route_fused(L, hp, router, n)) {
    cuda::rms_norm_router_fused(L.router.type, L.router.bytes.get(), hp.n_expert, hp.n_embd, xw(), L.ffn_norm.get(),
                                static_cast<float>(hp.rms_eps), n, h_.get(), k, hp.norm_topk_prob,
                                router_logits_.get(), chosen_of(il, n), weight_.get(), route_arrivals_.get(), stream_);
  } else {
    matmul(L.router, h_.get(), n, router_logits_.get());
    switch (router.kind) {
      case model::RouterKind::SoftmaxTopK:
        cuda::route_softmax_top_k(router_logits_.get(), n, hp.n_expert, k, hp.norm_topk_prob, chosen_of(il, n),
                                  weight_.get(), stream_);
        break;
      case model::RouterKind::TopKSoftmax:   // gpt-oss: top-k of the biased logits, softmax over k
        cuda::route_top_k_softmax(router_logits_.get(), L.router_bias.size() != 0 ? L.router_bias.get() : nullptr, n,
                                  hp.n_expert, k, chosen_of(il, n), weight_.get(), stream_);
        break;
      case model::RouterKind::SigmoidGroupTopK:   // glm4moe, deepseek v3: the routed scale in its weights
        cuda::route_sigmoid_group_top_k(router_logits_.get(), L.score_bias.size() != 0 ? L.score_bias.get() : nullptr,
                                        n, hp.n_expert, k, router.n_group, router.topk_group, router.renormalize,
                                        static_cast<float>(router.routed_scale), chosen_of(il, n), weight_.get(),
                                        stream_);
        return;
      default:
        throw std::logic_error("CUDA backend: router kind " + std::to_string(static_cast<int>(router.kind)) +
                               " has no kernel (cuda_backend_support should have refused the model)");
    }
  }
  // route_layer's routed_scale for the softmax routers (no launch at 1: qwen3, gpt-oss unchanged).
  if (router.routed_scale != 1.0)
    cuda::scale_router_weights(weight_.get(), n * k, static_cast<float>(router.routed_scale), stream_);
}

// The resident experts' unweighted rows into dev_slots_ (slot order), through moe_fused in
// groups of kMoeMaxTokens tokens: a token's rows come from the same kernel whatever the
// step's length, which keeps decode after prefill equal to a fresh prefill.
// into_residual: the route-weighted sum goes straight into x_ (MoeOutputs::sum_accumulate, the
// bits of moe_combine without the launch) instead of unweighted rows for enqueue_combine; only
// for a layer whose every expert is here and that has no shared expert.
void CudaBackend::enqueue_fused_experts(int64_t il, int64_t n, bool into_residual) {
  fused_experts(fused_weights(il), il, n, into_residual, fused_ws_, stream_);
}

void CudaBackend::fused_experts(const cuda::MoeLayerWeights& w, int64_t il, int64_t n, bool into_residual,
                                DeviceBuffer<uint8_t>& workspace, cudaStream_t stream) {
  const int64_t d = m_.hp.n_embd, k = m_.hp.n_expert_used;
  for (int64_t t0 = 0; t0 < n; t0 += cuda::kMoeMaxTokens) {
    cuda::MoeRouting routing;
    routing.n_tokens = static_cast<int>(std::min<int64_t>(cuda::kMoeMaxTokens, n - t0));
    routing.k = static_cast<int>(k);
    routing.chosen = chosen_of(il, n) + t0 * k;
    routing.weight = weight_.get() + t0 * k;
    cuda::MoeOutputs out;
    if (into_residual) {
      out.sum = xw() + t0 * d;
      out.sum_accumulate = true;
    } else {
      out.slot_rows = dev_slots_.get() + t0 * k * d;
    }
    cuda::moe_fused(w, h_.get() + t0 * d, routing, out, workspace.get(), workspace.size(), stream);
  }
}

// The resident experts of a layer moe_fused does not take: rows gathered per expert on the
// device from the host's plan, the batched matvec over slab ids, outputs scattered to slots.
// A long step's staged experts (stage_experts) follow the resident ones' rows in the same
// gather and scatter, through the PrefillGemm from their copies (enqueue_staged_experts).
void CudaBackend::enqueue_matvec_experts(int64_t il, int64_t n, const group::ExpertPlan& plan) {
  const model::HParams& hp = m_.hp;
  const DevLayer& L = layers_[il];
  const int64_t d = hp.n_embd, k = hp.n_expert_used, ff = hp.n_ff_exp, slots = n * k;
  int32_t* token = idx_pinned_.get();
  int32_t* slab = token + slots;
  int32_t* slot = slab + slots;
  int32_t* expert = slot + slots;   // the row's expert id (gpt-oss's per-expert biases)
  int64_t rows = 0;
  const auto add_rows = [&](int64_t e, int32_t slab_id) {
    for (int32_t r = plan.start[e]; r < plan.start[e + 1]; ++r) {
      if (plan.slot_of[r] < 0 || plan.slot_of[r] >= slots || rows >= slots)
        throw std::invalid_argument("layer_end: the plan names slot " + std::to_string(plan.slot_of[r]) +
                                    " outside the step's " + std::to_string(slots));
      token[rows] = plan.slot_of[r] / static_cast<int32_t>(k);
      slab[rows] = slab_id;
      slot[rows] = plan.slot_of[r];
      expert[rows] = static_cast<int32_t>(e);
      ++rows;
    }
  };
  // (moe_fused took the resident experts in layer_begin when the layer is fused and the step short)
  if (!L.fused || gemm_experts(L, n))
    for (int64_t e = 0; e < hp.n_expert; ++e)
      if (L.slab_of[e] >= 0) add_rows(e, L.slab_of[e]);
  const int64_t resident_rows = rows;
  if (staged_layer_ == il)
    for (const StagedExpert& x : staged_list_) add_rows(x.expert, -1);
  if (rows == 0) return;
  int32_t* dev = expert_idx_.get();
  const size_t S = static_cast<size_t>(max_tokens_ * k);
  CUDA_CHECK(cudaMemcpyAsync(dev, token, rows * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaMemcpyAsync(dev + S, slab, rows * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaMemcpyAsync(dev + 2 * S, slot, rows * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  if (oss_experts(L)) CUDA_CHECK(cudaMemcpyAsync(dev + 3 * S, expert, rows * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  cuda::gather_rows(h_.get(), dev, expert_in_.get(), rows, d, stream_);
  if (resident_rows == 0) {
    // only staged experts
  } else if (gemm_experts(L, n)) {   // one GEMM per expert over its rows (they are contiguous, by expert)
    std::vector<cuda::ExpertRows>& g = gemm_groups_;
    g.clear();
    for (int64_t r = 0; r < resident_rows;) {
      int64_t end = r;
      while (end < resident_rows && slab[end] == slab[r]) ++end;
      g.push_back({nullptr, r, end - r});
      r = end;
    }
    const auto run = [&](const DevMatrix& W, const float* x, float* y, bool reuse_input) {
      for (cuda::ExpertRows& e : g) e.weight = W.matrix(slab[e.first_row]);
      gemm_->matmul_experts(W.type, g, W.rows, W.cols, x, y, 1, 0, reuse_input);
    };
    // up reuses the 16-bit X that gate's call rounded (same expert_in_ rows): one rounding a layer.
    run(L.gate, expert_in_.get(), expert_g_.get(), false);
    run(L.up, expert_in_.get(), expert_u_.get(), true);
    expert_activation(il, 0, resident_rows);
    run(L.down, expert_g_.get(), expert_out_.get(), false);
  } else {
    expert_matmul(L.gate, expert_in_.get(), resident_rows, dev + S, expert_g_.get());
    expert_matmul(L.up, expert_in_.get(), resident_rows, dev + S, expert_u_.get());
    expert_activation(il, 0, resident_rows);
    expert_matmul(L.down, expert_g_.get(), resident_rows, dev + S, expert_out_.get());
  }
  expert_down_bias(il, 0, resident_rows);
  if (rows > resident_rows) enqueue_staged_experts(il, plan, resident_rows);
  cuda::scatter_rows(expert_out_.get(), dev + 2 * S, dev_slots_.get(), rows, d, stream_);
}

// Rows [first, first + rows) of expert_g_ / expert_u_ (enqueue_matvec_experts' order): SwiGLU, or
// for gpt-oss the biases and the clamped SwiGLU (the row's expert id in expert_idx_'s fourth part).
void CudaBackend::expert_activation(int64_t il, int64_t first, int64_t rows) {
  const int64_t ff = m_.hp.n_ff_exp;
  const DevLayer& L = layers_[il];
  if (!oss_experts(L)) {
    cuda::swiglu(expert_g_.get() + first * ff, expert_u_.get() + first * ff, rows * ff, stream_);
    return;
  }
  const model::ExpertsPart& part = m_.layers[il].recipe.ffn.experts;
  const int32_t* expert = expert_idx_.get() + 3 * max_tokens_ * m_.hp.n_expert_used + first;
  cuda::swiglu_experts(expert_g_.get() + first * ff, expert_u_.get() + first * ff, rows, ff, expert,
                       L.gate_bias.size() != 0 ? L.gate_bias.get() : nullptr, L.up_bias.size() != 0 ? L.up_bias.get() : nullptr,
                       part.act == model::Activation::SwiGluClamped, static_cast<float>(part.swiglu_alpha),
                       static_cast<float>(part.swiglu_limit), stream_);
}

// The experts' down bias (gpt-oss) on rows [first, first + rows) of expert_out_.
void CudaBackend::expert_down_bias(int64_t il, int64_t first, int64_t rows) {
  const DevLayer& L = layers_[il];
  if (L.down_bias.size() == 0 || rows == 0) return;
  const int64_t d = m_.hp.n_embd;
  cuda::add_expert_bias(expert_out_.get() + first * d, rows, d,
                        expert_idx_.get() + 3 * max_tokens_ * m_.hp.n_expert_used + first, L.down_bias.get(), stream_);
}

void CudaBackend::enqueue_staged_experts(int64_t il, const group::ExpertPlan& plan, int64_t first_row) {
  const model::MoeWeights& W = m_.layers[il].moe;
  const std::array<size_t, 3> off = group::ArenaLayout::part_offsets(W);
  const model::ExpertTensor* parts[3] = {&W.gate, &W.up, &W.down};
  std::vector<cuda::ExpertRows>& g = gemm_groups_;
  std::vector<const uint8_t*>& base = stage_bases_;   // g[j]'s slot
  // Gate, up and down of the experts in g from their copies; up reuses the 16-bit X that gate rounded.
  const auto run_round = [&](int64_t round_first, int64_t round_end) {
    const auto run = [&](int w, const float* x, float* y, bool reuse_input) {
      for (size_t j = 0; j < g.size(); ++j) g[j].weight = base[j] + off[static_cast<size_t>(w)];
      gemm_->matmul_experts(parts[w]->all.type, g, parts[w]->rows_per_expert, parts[w]->all.n_cols, x, y, 1, 0, reuse_input);
    };
    run(0, expert_in_.get(), expert_g_.get(), false);
    run(1, expert_in_.get(), expert_u_.get(), true);
    expert_activation(il, round_first, round_end - round_first);
    run(2, expert_g_.get(), expert_out_.get(), false);
    expert_down_bias(il, round_first, round_end - round_first);
  };
  int64_t r = first_row;
  // A long step's windows of one layer (set_window) keep the layer's copies: each expert crosses
  // PCIe once for the whole step, into its own slot, when the half holds every expert staged.
  const int h = stage_halves_ == 2 ? static_cast<int>(il % 2) : 0;
  StageHalf& half = stage_half_[static_cast<size_t>(h)];
  if (half.layer != il) {
    await_stage_half(half);   // a prefetch for a layer that staged nothing: done before its slots are reused
    reset_stage_half(half, il);
  }
  size_t uncached = 0;
  for (const StagedExpert& x : staged_list_) uncached += half.slot[static_cast<size_t>(x.expert)] < 0 ? 1 : 0;
  if (uncached <= static_cast<size_t>(stage_slots_ - half.used)) {
    await_stage_half(half);
    g.clear();
    base.clear();
    for (const StagedExpert& x : staged_list_) {
      int32_t& slot = half.slot[static_cast<size_t>(x.expert)];
      const bool fresh = slot < 0;
      if (fresh) slot = half.used++;
      uint8_t* to = stage_half_base(h) + static_cast<size_t>(slot) * stage_slot_bytes_;
      if (fresh) copy_staged(x, to, off, stream_);
      const int64_t count = plan.count(x.expert);
      base.push_back(to);
      g.push_back({nullptr, r, count});
      r += count;
    }
    record_stage_copied();
    run_round(first_row, r);
    CUDA_CHECK(cudaEventRecord(half.free, stream_));
    return;
  }
  // More experts than the half's free slots: rounds through half 0, which then holds no layer's.
  StageHalf& first_half = stage_half_[0];
  await_stage_half(first_half);
  first_half.layer = -1;
  for (size_t first = 0; first < staged_list_.size(); first += static_cast<size_t>(stage_slots_)) {
    const size_t last = std::min(staged_list_.size(), first + static_cast<size_t>(stage_slots_));
    const int64_t round_first = r;
    g.clear();
    base.clear();
    for (size_t j = first; j < last; ++j) {
      const StagedExpert& x = staged_list_[j];
      uint8_t* to = stage_.get() + (j - first) * stage_slot_bytes_;
      copy_staged(x, to, off, stream_);
      const int64_t count = plan.count(x.expert);
      base.push_back(to);
      g.push_back({nullptr, r, count});
      r += count;
    }
    if (last == staged_list_.size()) record_stage_copied();
    run_round(round_first, r);   // the next round's copies wait behind its GEMMs on the stream
  }
  CUDA_CHECK(cudaEventRecord(first_half.free, stream_));
}

void CudaBackend::copy_staged(const StagedExpert& x, uint8_t* to, const std::array<size_t, 3>& off, cudaStream_t stream) {
  const std::array<model::Matrix, 3>& p = x.parts;
  const size_t down_bytes = static_cast<size_t>(p[2].n_rows) * p[2].row_bytes;
  if (p[1].data == p[0].data + off[1] && p[2].data == p[0].data + off[2]) {   // an arena slot: one copy
    CUDA_CHECK(cudaMemcpyAsync(to, p[0].data, off[2] + down_bytes, cudaMemcpyHostToDevice, stream));
    return;
  }
  for (size_t w = 0; w < 3; ++w)
    CUDA_CHECK(cudaMemcpyAsync(to + off[w], p[w].data, static_cast<size_t>(p[w].n_rows) * p[w].row_bytes,
                               cudaMemcpyHostToDevice, stream));
}

void CudaBackend::prefetch_staged(int64_t il, std::span<const StagedExpert> experts) {
  use_device();
  check_layer(il);
  if (stage_halves_ < 2 || experts.empty() || !stage_supported(il, step_rows_)) return;
  StageHalf& half = stage_half_[static_cast<size_t>(il % 2)];
  if (half.layer == il) return;
  for (const StagedExpert& x : experts) check_staged(il, x);
  // The half's last reader (two layers back, already queued on stream_) must be done first.
  CUDA_CHECK(cudaStreamWaitEvent(stage_stream_, half.free, 0));
  reset_stage_half(half, il);
  const std::array<size_t, 3> off = group::ArenaLayout::part_offsets(m_.layers[il].moe);
  for (const StagedExpert& x : experts) {
    int32_t& slot = half.slot[static_cast<size_t>(x.expert)];
    if (slot >= 0 || half.used >= stage_slots_) continue;
    slot = half.used++;
    copy_staged(x, stage_half_base(static_cast<int>(il % 2)) + static_cast<size_t>(slot) * stage_slot_bytes_, off, stage_stream_);
  }
  CUDA_CHECK(cudaEventRecord(half.ready, stage_stream_));
  half.prefetched = true;
}

bool CudaBackend::stage_supported(int64_t il, int64_t n) const {
  if (stage_.size() == 0 || gemm_ == nullptr || n < gemm_prefill_rows_ || il < 0 || il >= m_.hp.n_layer) return false;
  const model::MoeWeights& W = m_.layers[il].moe;
  if (!W.down || group::ArenaLayout::slot_bytes(W) > stage_slot_bytes_) return false;
  for (const model::ExpertTensor* t : {&W.gate, &W.up, &W.down})
    if (!cuda::matvec_supported(t->all.type) || !cuda::prefill_gemm_supported(t->all.type) || t->all.n_cols % 32 != 0)
      return false;   // use_gemm's rule: the resident experts of such a layer take the matvec too
  return true;
}

void CudaBackend::stage_experts(int64_t il, std::span<const StagedExpert> experts) {
  check_layer(il);
  if (!stage_supported(il, step_rows_))
    throw std::logic_error("CUDA backend: stage_experts for layer " + std::to_string(il) + " of a " + std::to_string(step_rows_) +
                           "-row step, where stage_supported says no");
  if (staged_layer_ >= 0 && staged_layer_ != il)
    throw std::logic_error("CUDA backend: layer " + std::to_string(staged_layer_) + "'s staged experts were not computed");
  for (const StagedExpert& x : experts) {
    check_staged(il, x);
    if (staged_[static_cast<size_t>(x.expert)])
      throw std::logic_error("CUDA backend: layer " + std::to_string(il) + " expert " + std::to_string(x.expert) + " staged twice");
  }
  for (const StagedExpert& x : experts) {
    staged_[static_cast<size_t>(x.expert)] = 1;
    staged_list_.push_back(x);
  }
  staged_layer_ = il;
}

void CudaBackend::record_stage_copied() {
  CUDA_CHECK(cudaEventRecord(stage_copied_, stream_));
  stage_copied_pending_ = true;
}

bool CudaBackend::stage_held(int64_t il, int32_t e) const {
  if (stage_.size() == 0 || il < 0 || il >= m_.hp.n_layer || e < 0 || e >= m_.hp.n_expert) return false;
  const StageHalf& half = stage_half_of(il);
  return half.layer == il && half.slot[static_cast<size_t>(e)] >= 0;
}

void CudaBackend::await_staged_copies() {
  if (!stage_copied_pending_) return;
  use_device();
  CUDA_CHECK(cudaEventSynchronize(stage_copied_));
  stage_copied_pending_ = false;
}

void CudaBackend::unstage_expert(int64_t il, int32_t e) {
  check_layer(il);
  if (staged_layer_ != il || e < 0 || e >= m_.hp.n_expert || !staged_[static_cast<size_t>(e)])
    throw std::logic_error("CUDA backend: unstage_expert of layer " + std::to_string(il) + " expert " + std::to_string(e) +
                           ", which is not staged now");
  // Its GEMM may have run on the torn copy: layer_end's fill_alt_rows now gives its slots the
  // host's rows, and the half forgets the copy so that no later window reuses it.
  staged_[static_cast<size_t>(e)] = 0;
  StageHalf& half = stage_half_of(il);
  if (half.layer == il) half.slot[static_cast<size_t>(e)] = -1;
}

void CudaBackend::check_staged(int64_t il, const StagedExpert& x) const {
  const model::MoeWeights& W = m_.layers[il].moe;
  const model::ExpertTensor* want[3] = {&W.gate, &W.up, &W.down};
  const int32_t e = x.expert;
  if (e < 0 || e >= m_.hp.n_expert || layers_[il].slab_of[e] >= 0)
    throw std::logic_error("CUDA backend: layer " + std::to_string(il) + " expert " + std::to_string(e) +
                           " is on the device or outside the layer");
  for (size_t w = 0; w < 3; ++w) {
    const model::Matrix& p = x.parts[w];
    if (p.data == nullptr || p.type != want[w]->all.type || p.n_rows != want[w]->rows_per_expert ||
        p.n_cols != want[w]->all.n_cols || p.row_bytes != want[w]->all.row_bytes)
      throw std::invalid_argument("CUDA backend: staged expert " + std::to_string(e) + " of layer " + std::to_string(il) +
                                  ": part " + std::to_string(w) + " is not the layer's expert shape");
  }
}

void CudaBackend::enqueue_shared(int64_t il, int64_t n) {
  const DevLayer& L = layers_[il];
  if (!L.shared_up) return;
  const int64_t d = m_.hp.n_embd;
  matmul(L.shared_gate, h_.get(), n, shared_g_.get());
  matmul(L.shared_up, h_.get(), n, shared_u_.get());
  cuda::swiglu(shared_g_.get(), shared_u_.get(), n * m_.hp.n_ff_shexp, stream_);
  matmul(L.shared_down, shared_g_.get(), n, shared_out_.get());
  if (L.shared_router.size() == 0) return;   // ungated (glm4moe): enqueue_combine adds it as it is
  cuda::MatvecBatch b;  // the shared router: one F32 row dotted with each token's h
  b.count = static_cast<int>(n);
  b.act_stride_bytes = d * static_cast<int64_t>(sizeof(float));
  b.out_stride = 1;
  cuda::matvec_float_batched(TensorType::F32, L.shared_router.get(), 1, d, h_.get(), shared_logit_.get(), b, stream_);
}

void CudaBackend::enqueue_combine(int64_t il, int64_t n, bool with_cpu_rows) {
  const DevLayer& L = layers_[il];
  const bool shared = static_cast<bool>(L.shared_up), gated = shared && L.shared_router.size() != 0;
  cuda::moe_combine_mixed(xw(), dev_slots_.get(), with_cpu_rows ? cpu_rows_.get() : nullptr,
                          with_cpu_rows ? alt_row_.get() : nullptr, weight_.get(),
                          shared ? shared_out_.get() : nullptr, gated ? shared_logit_.get() : nullptr, n,
                          m_.hp.n_expert_used, m_.hp.n_embd, stream_);
}

// reference::dense_ffn on the device: gate and up from h_ (its quantized rows from norm_h), SwiGLU,
// down added into the residual; the layer's routing slots are -1 (no expert), as the CPU backend's.
void CudaBackend::enqueue_dense_ffn(int64_t il, int64_t n) {
  const DevLayer& L = layers_[il];
  matmul(L.dense_gate, h_.get(), n, dense_g_.get());
  matmul(L.dense_up, h_.get(), n, dense_u_.get());
  cuda::swiglu(dense_g_.get(), dense_u_.get(), n * L.dense_gate.rows, stream_);
  matmul_into_residual(L.dense_down, dense_g_.get(), n);
  CUDA_CHECK(cudaMemsetAsync(chosen_of(il, n), 0xff, static_cast<size_t>(n * m_.hp.n_expert_used) * sizeof(int32_t), stream_));
}

void CudaBackend::enqueue_head(const float* x, int64_t rows) {
  if (rows > logits_rows_) throw std::logic_error("CUDA backend: " + std::to_string(rows) + " logits rows at once");
  norm_h(x, output_norm_.get(), rows, output_);
  matmul(output_, h_.get(), rows, logits_.get());
}

}  // namespace moraine::gpu_worker::cuda_impl
