// The CUDA backend (see cuda_backend.h): the layer-by-layer calls, the expert path's setup and
// a step's host side. The class is in cuda_backend_impl.h, which lists the other files.
#include "gpu_worker/cuda_backend.h"

#include "gpu_worker/cuda_backend_impl.h"
#include "kernels/cuda/argmax.h"

#include <algorithm>
#include <stdexcept>

namespace moraine::gpu_worker {
namespace cuda_impl {

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  graphs_.clear();
  begin_graphs_.clear();
  handoff_graphs_.clear();
  if (copy_stream_ != nullptr) cudaStreamSynchronize(copy_stream_);
  for (PendingSwap& p : swaps_)
    if (p.landed != nullptr) cudaEventDestroy(p.landed);
  swaps_.clear();
  if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
  if (stage_stream_ != nullptr) {
    cudaStreamSynchronize(stage_stream_);
    cudaStreamDestroy(stage_stream_);
  }
  for (StageHalf& h : stage_half_) {
    if (h.ready != nullptr) cudaEventDestroy(h.ready);
    if (h.free != nullptr) cudaEventDestroy(h.free);
  }
  if (take_stream_ != nullptr) {
    cudaStreamSynchronize(take_stream_);
    cudaStreamDestroy(take_stream_);
  }
  if (take_done_ != nullptr) cudaEventDestroy(take_done_);
  if (stage_copied_ != nullptr) cudaEventDestroy(stage_copied_);
  for (void* p : pinned_) cudaHostUnregister(p);
  for (cudaStream_t s : segment_streams_) {
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
  for (cudaEvent_t e : join_) cudaEventDestroy(e);
  if (fork_ != nullptr) cudaEventDestroy(fork_);
  if (routed_ != nullptr) cudaEventDestroy(routed_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

uint64_t CudaBackend::device_bytes_in_use() const {
  cudaSetDevice(device_);
  size_t free_bytes = 0, total = 0;
  if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return total - free_bytes;
}

// One stderr line per setup stage (the supervisor keeps the gpu_worker's log): where the device
// memory above the --vram budget goes (context, weights, scratch).
void CudaBackend::log_device_memory(const char* stage) const {
  std::cerr << "gpu_worker: device memory in use after " << stage << ": " << (device_bytes_in_use() >> 20)
            << " MiB (device buffers " << (cuda::device_buffer_live_bytes().load() >> 20) << " MiB)\n";
}

void CudaBackend::pin_host_memory(void* p, size_t bytes) {
  use_device();
  const cudaError_t err = cudaHostRegister(p, bytes, cudaHostRegisterDefault);
  if (err == cudaSuccess) {
    pinned_.push_back(p);
    pinned_ranges_.emplace_back(static_cast<const char*>(p), bytes);
    // Registered memory is mapped on a system with unified addressing (cudaHostRegisterDefault):
    // the hand-off's kernels read and write it at this address.
    void* dev = nullptr;
    if (cudaHostGetDevicePointer(&dev, p, 0) != cudaSuccess) {
      cudaGetLastError();
      dev = nullptr;
    }
    pinned_dev_.push_back(static_cast<char*>(dev));
    return;
  }
  cudaGetLastError();  // not sticky; copies from pageable memory still work, only slower
  std::cerr << "CUDA backend: cannot pin " << bytes << " bytes of host memory (" << cudaGetErrorString(err)
            << "); host copies will be staged\n";
}

bool CudaBackend::layer_on_device(int64_t il) const {
  check_layer(il);
  return layers_[il].dense || layers_[il].resident == m_.hp.n_expert;   // a dense layer has no experts to miss
}

void CudaBackend::embed(const int32_t* tokens, int64_t n) {
  use_device();
  begin_step(tokens, n);
  enqueue_embed(n);
}

void CudaBackend::layer_whole(int64_t il, int64_t n, int32_t* chosen_out) {
  use_device();
  check_step(il, n);
  if (!layer_on_device(il))
    throw std::logic_error("CUDA backend: layer_whole(" + std::to_string(il) + ") but only " +
                           std::to_string(layers_[il].resident) + " of its experts are on the device");
  if (!layers_[il].dense && (!layers_[il].fused || gemm_experts(layers_[il], n))) {  // the per-expert path needs the host's plan
    layer_begin(il, n, host_chosen_.data(), host_weight_.data(), nullptr);
    if (chosen_out != nullptr) std::copy_n(host_chosen_.data(), n * m_.hp.n_expert_used, chosen_out);
    host_plan_.build(host_chosen_.data(), n * m_.hp.n_expert_used, m_.hp.n_expert);
    layer_end(il, n, host_plan_, nullptr);
    return;
  }
  enqueue_layer_whole(il, n, true);
  if (chosen_out != nullptr)
    pending_chosen_.push_back({chosen_pinned_.get() + (il * step_rows_ + window_first_) * m_.hp.n_expert_used, chosen_out,
                               n * m_.hp.n_expert_used});
}

void CudaBackend::layer_begin(int64_t il, int64_t n, int32_t* chosen, float* weight, float* h_out) {
  use_device();
  check_step(il, n);
  if (layers_[il].dense)
    throw std::logic_error("CUDA backend: layer_begin(" + std::to_string(il) + ") of a dense FFN layer, which has no "
                           "routing to hand off (layer_on_device says it runs whole)");
  const auto route = [&] {
    const int64_t d = m_.hp.n_embd, nk = n * m_.hp.n_expert_used;
    enqueue_mixer(il, n);
    enqueue_route(il, n);
    copy_to_host(chosen, chosen_of(il, n), nk * sizeof(int32_t));
    copy_to_host(weight, weight_.get(), nk * sizeof(float));
    if (h_out != nullptr) copy_to_host(h_out, h_.get(), n * d * sizeof(float));
  };
  // The resident experts and the shared expert run while the host plans and the cpu workers work.
  const auto experts = [&] {
    if (layers_[il].fused && !gemm_experts(layers_[il], n)) enqueue_fused_experts(il, n);
    enqueue_shared(il, n);
  };
  const int64_t nk = n * m_.hp.n_expert_used;
  // Captured copies need page-locked host memory (a pageable one would fail the capture).
  const bool host_pinned = pinned(chosen, nk * sizeof(int32_t)) && pinned(weight, nk * sizeof(float)) &&
                           (h_out == nullptr || pinned(h_out, n * m_.hp.n_embd * sizeof(float)));
  if (layer_graphs_ok_ && host_pinned && n <= kDecodeRows) {
    LayerBeginGraphs& g = begin_graphs_[step_key({il, n})];
    if (g.route.exec == nullptr || g.chosen != chosen || g.weight != weight || g.h_out != h_out) {
      g.route.reset();
      g.experts.reset();
      g.chosen = chosen;
      g.weight = weight;
      g.h_out = h_out;
      layer_graphs_ok_ = capture_into(g.route, route) && capture_into(g.experts, experts);
    }
    if (layer_graphs_ok_) {
      CUDA_CHECK(cudaGraphLaunch(g.route.exec, stream_));
      CUDA_CHECK(cudaEventRecord(routed_, stream_));
      CUDA_CHECK(cudaGraphLaunch(g.experts.exec, stream_));
      CUDA_CHECK(cudaEventSynchronize(routed_));
      return;
    }
    begin_graphs_.clear();
  }
  route();
  CUDA_CHECK(cudaEventRecord(routed_, stream_));
  experts();
  CUDA_CHECK(cudaEventSynchronize(routed_));
}

// layer_begin synchronised on the routing, so the previous layer's index copies (idx_pinned_)
// have run before enqueue_matvec_experts writes it again.
void CudaBackend::experts_planned(int64_t il, int64_t n, const group::ExpertPlan& plan) {
  use_device();
  check_step(il, n);
  const DevLayer& L = layers_[il];
  if (!L.fused || gemm_experts(L, n) || staged_layer_ == il) {
    enqueue_matvec_experts(il, n, plan);
    experts_queued_layer_ = il;
  }
}

void CudaBackend::layer_end(int64_t il, int64_t n, const group::ExpertPlan& plan, const float* host_rows) {
  use_device();
  check_step(il, n);
  const DevLayer& L = layers_[il];
  const int64_t d = m_.hp.n_embd, k = m_.hp.n_expert_used, nk = n * k;
  if (static_cast<int64_t>(plan.start.size()) != m_.hp.n_expert + 1 || plan.start.back() != nk)
    throw std::invalid_argument("layer_end: the plan covers " +
                                std::to_string(plan.start.empty() ? 0 : plan.start.back()) + " slots, the step has " +
                                std::to_string(nk));
  if (experts_queued_layer_ != il && (!L.fused || gemm_experts(L, n) || staged_layer_ == il)) enqueue_matvec_experts(il, n, plan);
  experts_queued_layer_ = -1;
  const auto [lo, hi] = fill_alt_rows(il, plan);
  if (staged_layer_ == il) clear_staged();   // their rows are in dev_slots_ now (stream order): the list is spent
  if (hi < 0) {
    enqueue_combine(il, n, false);
    return;
  }
  if (host_rows == nullptr)
    throw std::logic_error("CUDA backend: layer " + std::to_string(il) + " has slots off the device and no host rows");
  CUDA_CHECK(cudaMemcpyAsync(cpu_rows_.get() + int64_t{lo} * d, host_rows + int64_t{lo} * d,
                             static_cast<size_t>(hi - lo) * d * sizeof(float), cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaMemcpyAsync(alt_row_.get(), alt_pinned_.get(), static_cast<size_t>(nk) * sizeof(int32_t), cudaMemcpyHostToDevice,
                             stream_));
  enqueue_combine(il, n, true);
}

void CudaBackend::logits(int64_t rows, float* out) {
  use_device();
  if (rows <= 0 || rows > step_n_)
    throw std::invalid_argument("CUDA backend logits: " + std::to_string(rows) + " rows of a step of " +
                                std::to_string(step_n_));
  // A segmented step: each segment's last logit_rows rows (their sum must be `rows`), gathered
  // into y_ once, then read as a plain step reads its last rows.
  const int64_t V = m_.hp.n_vocab, d = m_.hp.n_embd;
  if (segmented_) {
    int64_t want = 0;
    for (const Segment& g : segments_) want += g.logit_rows;
    if (rows != want || window_first_ + step_n_ != step_rows_)
      throw std::invalid_argument("CUDA backend: logits of " + std::to_string(rows) + " rows of a step whose segments ask for " +
                                  std::to_string(want));
    enqueue_gather_logit_rows();
  }
  // The head in passes of logits_rows_ rows (a long prefill asking for every row's logits).
  for (int64_t r0 = 0; r0 < rows; r0 += logits_rows_) {
    const int64_t r = std::min(logits_rows_, rows - r0);
    if (segmented_) enqueue_head(y_.get() + r0 * d, r);
    else enqueue_logits(step_n_ - rows + r0, r);
    if (r0 + r < rows) copy_to_host(out + r0 * V, logits_.get(), static_cast<size_t>(r * V) * sizeof(float));
    else finish_step(r, out + r0 * V);
  }
}

bool CudaBackend::pinned(const void* p, size_t bytes) const {
  const char* c = static_cast<const char*>(p);
  for (const auto& [base, size] : pinned_ranges_)
    if (c >= base && c + bytes <= base + size) return true;
  return false;
}

void* CudaBackend::mapped(const void* p, size_t bytes) const {
  const char* c = static_cast<const char*>(p);
  for (size_t i = 0; i < pinned_ranges_.size(); ++i) {
    const auto& [base, size] = pinned_ranges_[i];
    if (c >= base && c + bytes <= base + size) return pinned_dev_[i] == nullptr ? nullptr : pinned_dev_[i] + (c - base);
  }
  return nullptr;
}

// Slots whose expert is off the device read row alt[slot] of the cpu workers' rows (plan
// order); -1 for the device's own. The rows' span [lo, hi), empty (hi < 0) when none.
std::pair<int32_t, int32_t> CudaBackend::fill_alt_rows(int64_t il, const group::ExpertPlan& plan, int32_t device_expert) {
  const DevLayer& L = layers_[il];
  const int64_t nk = step_n_ * m_.hp.n_expert_used;
  int32_t* alt = alt_pinned_.get();
  std::fill(alt, alt + nk, -1);
  int32_t lo = INT32_MAX, hi = -1;
  for (int64_t e = 0; e < m_.hp.n_expert; ++e) {
    if (plan.count(e) == 0 || L.slab_of[e] >= 0 || e == device_expert || (staged_layer_ == il && staged_[e])) continue;
    for (int32_t r = plan.start[e]; r < plan.start[e + 1]; ++r) {
      const int32_t slot = plan.slot_of[r];
      if (slot < 0 || slot >= nk)
        throw std::invalid_argument("layer " + std::to_string(il) + ": the plan names slot " + std::to_string(slot) +
                                    " outside the step's " + std::to_string(nk));
      alt[slot] = r;
    }
    lo = std::min(lo, plan.start[e]);
    hi = std::max(hi, plan.start[e + 1]);
  }
  return {lo, hi};
}

// Which layers' experts go through moe_fused, and whether steps can be captured as graphs
// (every layer fused, embedding on the device). Before the scratch is listed: the expert path
// decides which buffers it has (scratch_options).
void CudaBackend::choose_expert_paths() {
  const model::HParams& hp = m_.hp;
  graphs_ok_ = tok_embd_.size() != 0;
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    DevLayer& L = layers_[il];
    L.fused = false;
    L.take_layout = -1;
    if (L.dense) continue;   // no experts: the graph and the hand-off step run it whole (enqueue_dense_ffn)
    if (L.resident > 0 && hp.n_expert_used <= cuda::kMoeMaxTopK && fused_formats(L)) {
      try {
        cuda::moe_fused_check(fused_weights(il));
        L.fused = true;
      } catch (const std::invalid_argument&) {
        // a shape the fused kernel does not take: the batched matvec path serves it
      }
    }
    if (take_expert_from_ > 0 && L.resident < hp.n_expert && hp.n_expert_used <= cuda::kMoeMaxTopK &&
        m_.layers[il].moe.down) {
      try {
        cuda::MoeLayerWeights w = take_weights(il, 0);
        w.slots = slot_table_.get();   // take_tables_ come with the scratch, after this check of formats and shapes
        cuda::moe_fused_check(w);
        const std::array<size_t, 3> offsets = group::ArenaLayout::part_offsets(m_.layers[il].moe);
        auto at = std::find(take_layouts_.begin(), take_layouts_.end(), offsets);
        if (at == take_layouts_.end()) at = take_layouts_.insert(at, offsets);
        L.take_layout = static_cast<int>(at - take_layouts_.begin());
      } catch (const std::invalid_argument&) {
        // the cpu workers compute all of this layer's misses
      }
    }
    graphs_ok_ = graphs_ok_ && L.fused && L.resident == hp.n_expert;
    // The hand-off step computes the device's experts of a layer with moe_fused only.
    handoff_ok_ = handoff_ok_ && (L.resident == 0 || L.fused);
  }
}

CudaStepScratchOptions CudaBackend::scratch_options() const {
  CudaStepScratchOptions o;
  o.max_tokens = max_tokens_;
  o.long_step_rows = long_step_rows_;
  o.max_context = max_context_;
  o.gemm_prefill_rows = gemm_prefill_rows_;
  o.slots = slots_;
  for (int64_t il = 0; il < m_.hp.n_layer; ++il) {
    const DevLayer& L = layers_[il];
    if (L.recurrent) {
      o.recurrent = true;
      ++o.recurrent_layers;
    } else
      o.q_rows = std::max(o.q_rows, m_.layers[il].attn.q.n_rows);
    if (L.dense) o.dense_ff = std::max(o.dense_ff, L.dense_gate.rows);
    if (L.fused) o.fused_down_types.push_back(L.down.type);
    o.expert_matvec = o.expert_matvec || (!L.dense && L.resident > 0 && !L.fused);
    if (L.take_layout >= 0) {
      o.take_expert_bytes = std::max<uint64_t>(o.take_expert_bytes, group::ArenaLayout::slot_bytes(m_.layers[il].moe));
      o.take_down_types.push_back(m_.layers[il].moe.down.all.type);
    }
    if (stage_slots_ > 0 && m_.layers[il].moe.down && L.resident < m_.hp.n_expert)
      o.stage_expert_bytes = std::max<uint64_t>(o.stage_expert_bytes, static_cast<uint64_t>(stage_slots_ * stage_halves_) *
                                                                           group::ArenaLayout::slot_bytes(m_.layers[il].moe));
    o.take_layouts = static_cast<int64_t>(take_layouts_.size());
  }
  return o;
}

// The expert path's scratch (listed by cuda_step_scratch): moe_fused's workspace, the
// PrefillGemm and the per-expert path's gather / scatter rows.
void CudaBackend::setup_experts() {
  const model::HParams& hp = m_.hp;
  const size_t slots = static_cast<size_t>(max_tokens_ * hp.n_expert_used);
  if (scratch_.has("moe_fused_ws")) {
    fused_ws_ = DeviceBuffer<uint8_t>(scratch_.count<uint8_t>("moe_fused_ws"));
    cuda::moe_fused_workspace_init(fused_ws_.get(), fused_ws_.size(), stream_);
  }
  // Long steps multiply quantized weights through cuBLAS (and run the resident experts per
  // expert, from the host's plan, instead of moe_fused's 16-token groups).
  if (cuda_scratch_prefill_gemm(scratch_options())) {
    gemm_ = std::make_unique<cuda::PrefillGemm>(stream_, cuda_scratch_prefill_gemm_limits(hp, scratch_options()),
                                                prefill_gemm_f16_ ? cuda::GemmInput::F16 : cuda::GemmInput::BF16);
  }
  if (scratch_.has("stage_experts")) {
    stage_ = DeviceBuffer<uint8_t>(scratch_.count<uint8_t>("stage_experts"));
    stage_slot_bytes_ = stage_.size() / static_cast<size_t>(stage_slots_ * stage_halves_);
    staged_.assign(static_cast<size_t>(hp.n_expert), 0);
    for (StageHalf& h : stage_half_) {
      h.slot.assign(static_cast<size_t>(hp.n_expert), -1);
      CUDA_CHECK(cudaEventCreateWithFlags(&h.ready, cudaEventDisableTiming));
      CUDA_CHECK(cudaEventCreateWithFlags(&h.free, cudaEventDisableTiming));
    }
    if (stage_halves_ == 2) CUDA_CHECK(cudaStreamCreateWithFlags(&stage_stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&stage_copied_, cudaEventDisableTiming));
  }
  if (scratch_.has("take_expert")) {
    take_expert_ = DeviceBuffer<uint8_t>(scratch_.count<uint8_t>("take_expert"));
    take_ws_ = DeviceBuffer<uint8_t>(scratch_.count<uint8_t>("take_ws"));
    cuda::moe_fused_workspace_init(take_ws_.get(), take_ws_.size(), stream_);
    // Table (layout v, expert e): entry e names the copy's parts at layout v's offsets.
    std::vector<cuda::MoeExpertSlot> tables(scratch_.count<cuda::MoeExpertSlot>("take_table"));
    const int64_t E = hp.n_expert, stride = slot_stride();
    if (static_cast<int64_t>(tables.size()) != static_cast<int64_t>(take_layouts_.size()) * E * stride)
      throw std::logic_error("CUDA backend: the take tables' size does not match the listed scratch");
    for (size_t v = 0; v < take_layouts_.size(); ++v)
      for (int64_t e = 0; e < E; ++e)
        tables[(v * E + e) * stride + e] = {take_expert_.get() + take_layouts_[v][0], take_expert_.get() + take_layouts_[v][1],
                                            take_expert_.get() + take_layouts_[v][2]};
    take_tables_ = DeviceBuffer<cuda::MoeExpertSlot>(tables.size());
    take_tables_.upload(tables.data(), tables.size());
    CUDA_CHECK(cudaStreamCreateWithFlags(&take_stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&take_done_, cudaEventDisableTiming));
  }
  expert_in_ = DeviceBuffer<float>(scratch_.count<float>("expert_in"));   // empty: every layer fused, short steps
  expert_g_ = DeviceBuffer<float>(scratch_.count<float>("expert_g"));
  expert_u_ = DeviceBuffer<float>(scratch_.count<float>("expert_u"));
  expert_out_ = DeviceBuffer<float>(scratch_.count<float>("expert_out"));
  expert_idx_ = DeviceBuffer<int32_t>(scratch_.count<int32_t>("expert_idx"));
  host_chosen_.resize(slots);
  host_weight_.resize(slots);
  host_plan_.reserve(hp.n_expert, static_cast<int64_t>(slots));
}

// moe_fused takes every quantized expert format the matvec takes; it quantizes x and h with
// the reference executor's rules (Q8_0 with llama.cpp's x86 rule, as pack_activations), so Q8_0
// experts are fused too (tests/cuda/moe_fused_test checks both against the reference).
bool CudaBackend::fused_formats(const DevLayer& L) {
  for (const DevMatrix* w : {&L.gate, &L.up, &L.down})
    if (!cuda::matvec_supported(w->type)) return false;
  return true;
}

cuda::MoeLayerWeights CudaBackend::fused_weights(int64_t il) const {
  const DevLayer& L = layers_[il];
  cuda::MoeLayerWeights w;
  w.gate_type = L.gate.type;
  w.up_type = L.up.type;
  w.down_type = L.down.type;
  w.n_embd = m_.hp.n_embd;
  w.n_ff = m_.hp.n_ff_exp;
  w.n_expert = m_.hp.n_expert;
  w.slots = slot_table_.get() + il * slot_stride();
  // gpt-oss: the experts' biases (by expert id) and the clamped SwiGLU.
  const model::ExpertsPart& part = m_.layers[il].recipe.ffn.experts;
  w.gate_bias = L.gate_bias.size() != 0 ? L.gate_bias.get() : nullptr;
  w.up_bias = L.up_bias.size() != 0 ? L.up_bias.get() : nullptr;
  w.down_bias = L.down_bias.size() != 0 ? L.down_bias.get() : nullptr;
  w.swiglu_clamped = L.clamped;
  w.swiglu_alpha = static_cast<float>(part.swiglu_alpha);
  w.swiglu_limit = static_cast<float>(part.swiglu_limit);
  // The form (MoeLayerWeights::Form): kBest, the default, the staged kernels where they measured
  // faster and the tiled ones elsewhere.
  return w;
}

cuda::MoeLayerWeights CudaBackend::take_weights(int64_t il, int32_t e) const {
  const model::MoeWeights& W = m_.layers[il].moe;
  cuda::MoeLayerWeights w = fused_weights(il);
  w.gate_type = W.gate.all.type;   // the layer may have no expert on the device (DevLayer::gate empty)
  w.up_type = W.up.all.type;
  w.down_type = W.down.all.type;
  const int layout = std::max(layers_[il].take_layout, 0);
  w.slots = take_tables_.size() == 0 ? nullptr : take_tables_.get() + (layout * m_.hp.n_expert + e) * slot_stride();
  return w;
}

void CudaBackend::begin_step(const int32_t* tokens, int64_t n) {
  if (n <= 0 || n > max_step_rows())
    throw std::invalid_argument("CUDA backend step: " + std::to_string(n) + " rows, expected 1.." + std::to_string(max_step_rows()));
  const model::HParams& hp = m_.hp;
  // The step's segments: set_segments' (their rows must add up to n), else all n rows of the
  // selected slot. Taken even when the step is refused below, as the CPU backend does.
  segmented_ = !pending_.empty();
  segments_ = segmented_ ? std::move(pending_) : std::vector<Segment>{{selected_, past_[static_cast<size_t>(selected_)], n, 0}};
  pending_.clear();
  segment_first_.clear();
  int64_t sum = 0;
  for (const Segment& g : segments_) {
    segment_first_.push_back(sum);
    sum += g.rows;
  }
  if (sum != n)
    throw std::invalid_argument("CUDA backend: a step of " + std::to_string(n) + " rows whose segments hold " + std::to_string(sum));
  if (segmented_ && n > max_tokens_)
    throw std::invalid_argument("CUDA backend: a batched step of " + std::to_string(n) + " rows, at most " +
                                std::to_string(max_tokens_) + " (no long steps)");
  for (size_t i = 0; i < segments_.size(); ++i) {
    const int64_t past = segments_[i].first_position;
    for (int64_t t = segment_first_[i]; t < segment_first_[i] + segments_[i].rows; ++t) {
      if (tokens[t] < 0 || tokens[t] >= hp.n_vocab)
        throw std::invalid_argument("token id " + std::to_string(tokens[t]) + " at position " +
                                    std::to_string(past + t - segment_first_[i]) + (segmented_ ? " of slot " + std::to_string(segments_[i].slot) : std::string()) +
                                    " is outside the vocabulary [0, " + std::to_string(hp.n_vocab) + ")");
    }
    if (past + segments_[i].rows > max_context_)
      throw std::runtime_error("CUDA backend: positions " + std::to_string(past) + ".." +
                               std::to_string(past + segments_[i].rows - 1) + " do not fit the KV cache of " +
                               std::to_string(max_context_) + " positions");
    pos_pinned_[i] = static_cast<int32_t>(past);   // enqueue_embed copies a word per segment
  }
  std::copy_n(tokens, n, tok_pinned_.get());
  step_rows_ = n;
  window_first_ = 0;
  for (StageHalf& h : stage_half_) {   // a step's staged copies are its own (and none still landing)
    if (h.slot.empty()) continue;
    await_stage_half(h);
    h.layer = -1;
  }
  step_n_ = std::min(n, max_tokens_);   // a long step's first window (set_window)
  pending_chosen_.clear();
  clear_staged();   // a step that failed between stage_experts and layer_end leaves its list: not this step's
}

void CudaBackend::finish_step(int64_t rows, float* out) {
  const int64_t V = m_.hp.n_vocab;
  constexpr int64_t kRows = static_cast<int64_t>(group::kMaxTokenRows);
  if (token_out_ != nullptr) {
    // Greedy decode: each row's argmax on the device, written straight into pinned host memory
    // (mapped under unified addressing), instead of the rows' 607 KB copies (30B vocabulary) and
    // the coordinator's scan of them. Set up at the first such step.
    if (rows > kRows)
      throw std::invalid_argument("CUDA backend: greedy tokens of " + std::to_string(rows) + " rows, at most " +
                                  std::to_string(kRows));
    if (token_pinned_.size() == 0) {
      argmax_scratch_ = DeviceBuffer<uint8_t>(cuda::argmax_scratch_bytes(kRows));
      CUDA_CHECK(cudaMemsetAsync(argmax_scratch_.get(), 0, argmax_scratch_.bytes(), stream_));   // in order on stream_
      token_pinned_ = PinnedBuffer<int32_t>(2 * kRows);   // the tokens, then the first non-finite logits
      CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&token_dev_), token_pinned_.get(), 0));
    }
    cuda::argmax_rows(logits_.get(), rows, V, token_dev_, argmax_scratch_.get(), stream_,
                      nonfinite_out_ != nullptr ? token_dev_ + kRows : nullptr);
  } else {
    copy_to_host(out, logits_.get(), static_cast<size_t>(rows * V) * sizeof(float));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (token_out_ != nullptr) std::copy_n(token_pinned_.get(), rows, token_out_);
  if (nonfinite_out_ != nullptr) std::copy_n(token_pinned_.get() + kRows, rows, nonfinite_out_);
  for (const PendingChosen& p : pending_chosen_) std::copy_n(p.from, p.count, p.to);
  pending_chosen_.clear();
}

void CudaBackend::copy_to_host(void* dst, const void* src, size_t bytes) {
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
}

void CudaBackend::set_window(int64_t first, int64_t rows) {
  use_device();
  if (first < 0 || rows <= 0 || rows > max_tokens_ || first + rows > step_rows_ || first % max_tokens_ != 0)
    throw std::invalid_argument("CUDA backend: window of rows " + std::to_string(first) + ".." + std::to_string(first + rows - 1) +
                                " in a step of " + std::to_string(step_rows_) + " rows (windows of " +
                                std::to_string(max_tokens_) + " from a multiple of it)");
  if (first == window_first_ && rows == step_n_) return;
  if (segmented_) throw std::logic_error("CUDA backend: a batched step runs in one window (set_segments' rows at most max_tokens)");
  if (experts_queued_layer_ >= 0 || staged_layer_ >= 0)
    throw std::logic_error("CUDA backend: set_window between layer_begin and layer_end");
  window_first_ = first;
  step_n_ = rows;
  // The window's first position where RoPE and the KV store read it; one pinned word per window,
  // so an earlier window's copy still queued reads its own.
  int32_t* pos = pos_pinned_.get() + first / max_tokens_;
  *pos = static_cast<int32_t>(segments_.at(0).first_position + first);
  CUDA_CHECK(cudaMemcpyAsync(pos_dev_.get(), pos, sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
}

void CudaBackend::check_layer(int64_t il) const {
  if (il < 0 || il >= m_.hp.n_layer)
    throw std::invalid_argument("CUDA backend: layer " + std::to_string(il) + " outside [0, " +
                                std::to_string(m_.hp.n_layer) + ")");
}

void CudaBackend::check_step(int64_t il, int64_t n) const {
  check_layer(il);
  if (n != step_n_)
    throw std::invalid_argument("CUDA backend: layer " + std::to_string(il) + " asked for " + std::to_string(n) +
                                " rows in a step of " + std::to_string(step_n_) + " (embed starts a step)");
}

}  // namespace cuda_impl

std::unique_ptr<Backend> make_cuda_backend(const model::Model& m, const BackendOptions& o) {
  return std::make_unique<cuda_impl::CudaBackend>(m, o);
}

}  // namespace moraine::gpu_worker
