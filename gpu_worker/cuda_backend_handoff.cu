// The CUDA backend's in-graph GPU <-> CPU hand-off (cuda_backend_impl.h, backend.h).
#include "gpu_worker/cuda_backend_impl.h"

#include <immintrin.h>

#include <algorithm>
#include <stdexcept>

#include "kernels/cuda/host_handoff.h"

namespace moraine::gpu_worker::cuda_impl {

bool CudaBackend::handoff_supported(int64_t n) const {
  return handoff_ok_ && embed_on_device() && n <= kDecodeRows && !all_on_device();
}

bool CudaBackend::handoff_begin(const int32_t* tokens, int64_t n, int64_t logit_rows, const HandoffIo& io) {
  use_device();
  if (!handoff_supported(n))
    throw std::logic_error("CUDA backend: handoff_begin for a step of " + std::to_string(n) + " rows it cannot hand off");
  if (logit_rows <= 0 || logit_rows > n)
    throw std::invalid_argument("CUDA backend: logits of " + std::to_string(logit_rows) + " rows of a step of " +
                                std::to_string(n));
  const model::HParams& hp = m_.hp;
  const int64_t nk = n * hp.n_expert_used;
  const std::pair<const void*, size_t> ranges[] = {{io.chosen, nk * sizeof(int32_t)}, {io.weight, nk * sizeof(float)},
                                                   {io.h, n * hp.n_embd * sizeof(float)},
                                                   {io.host_rows, nk * hp.n_embd * sizeof(float)}};
  for (const auto& [p, bytes] : ranges)
    if (!pinned(p, bytes))
      throw std::invalid_argument("CUDA backend: handoff_begin's host buffers must lie in memory given to pin_host_memory");
  // The device reads and writes them itself (registered memory is mapped with unified addressing,
  // which every 64-bit CUDA 13 platform has); where it is not, the step goes layer by layer.
  for (const auto& [p, bytes] : ranges)
    if (mapped(p, bytes) == nullptr || alt_pinned_dev_ == nullptr) return false;
  begin_step(tokens, n);
  if (segmented_) {
    int64_t want = 0;
    for (const Segment& seg : segments_) want += seg.logit_rows;
    if (logit_rows != want)
      throw std::invalid_argument("CUDA backend: logits of " + std::to_string(logit_rows) +
                                  " rows of a step whose segments ask for " + std::to_string(want));
  }
  std::vector<char>& whole = handoff_whole_;   // reused: no allocation per step
  whole.resize(static_cast<size_t>(hp.n_layer));
  for (int64_t il = 0; il < hp.n_layer; ++il) whole[il] = layer_on_device(il) ? 1 : 0;
  HandoffGraph& g = handoff_graphs_[step_key({logit_rows})];
  if (g.step.exec == nullptr || g.whole != whole || g.io.chosen != io.chosen || g.io.weight != io.weight ||
      g.io.h != io.h || g.io.host_rows != io.host_rows) {
    g.step.reset();
    g.io = io;
    g.whole = whole;
    if (!capture_into(g.step, [&] { enqueue_handoff_step(n, logit_rows, io, whole); })) {
      handoff_ok_ = false;   // from now on steps hand off layer by layer
      handoff_graphs_.clear();
      if (segmented_) pending_ = segments_;   // the layer-by-layer step's embed takes them again
      return false;
    }
  }
  handoff_seq_pinned_[0] = ++handoff_seq_;
  handoff_rows_ = logit_rows;
  CUDA_CHECK(cudaGraphLaunch(g.step.exec, stream_));
  return true;
}

void CudaBackend::handoff_wait_routed(int64_t il) {
  check_layer(il);
  const uint64_t* flag = handoff_flags_.get() + il;
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t spins = 0; __atomic_load_n(flag, __ATOMIC_ACQUIRE) < handoff_seq_; ++spins) {
    _mm_pause();
    if (spins % 4096 != 0) continue;
    const cudaError_t q = cudaStreamQuery(stream_);
    if (q != cudaErrorNotReady && q != cudaSuccess) CUDA_CHECK(q);
    if (q == cudaSuccess && __atomic_load_n(flag, __ATOMIC_ACQUIRE) < handoff_seq_)
      throw std::logic_error("CUDA backend: the step finished without handing off layer " + std::to_string(il));
    if (std::chrono::steady_clock::now() - start > kHandoffTimeout)
      throw std::runtime_error("CUDA backend: layer " + std::to_string(il) + "'s routing did not arrive within " +
                               std::to_string(kHandoffTimeout.count()) + " s");
  }
}

void CudaBackend::handoff_release(int64_t il, const group::ExpertPlan& plan) {
  check_layer(il);
  const int64_t nk = step_n_ * m_.hp.n_expert_used;
  if (static_cast<int64_t>(plan.start.size()) != m_.hp.n_expert + 1 || plan.start.back() != nk)
    throw std::invalid_argument("handoff_release: the plan covers " +
                                std::to_string(plan.start.empty() ? 0 : plan.start.back()) + " slots, the step has " +
                                std::to_string(nk));
  const bool taken = take_layer_ == il;
  fill_alt_rows(il, plan, taken ? take_e_ : -1);   // read by the graph's copy once the flag is up
  // The taken expert's rows must be in dev_slots_ before the graph's combine reads them: the
  // flag goes up only after its kernel finished (its copy ran beside the cpu workers).
  if (taken) wait_taken();
  __atomic_store_n(handoff_flags_.get() + m_.hp.n_layer + il, handoff_seq_, __ATOMIC_RELEASE);
}

// One copy of the span from the gate's first byte to the down's last, the parts at the layer's
// arena offsets in it (each on a 4 KiB boundary, so each stays 16-byte aligned for moe_fused).
bool CudaBackend::handoff_can_take(int64_t il, int32_t e, const std::array<model::Matrix, 3>& parts) const {
  check_layer(il);
  if (take_stream_ == nullptr || e < 0 || e >= m_.hp.n_expert || take_layer_ >= 0) return false;
  const DevLayer& L = layers_[il];
  if (L.take_layout < 0 || L.slab_of[e] >= 0 || step_n_ > kDecodeRows) return false;
  const std::array<size_t, 3>& offsets = take_layouts_[static_cast<size_t>(L.take_layout)];
  const uint8_t* lo = parts[0].data;
  if (lo == nullptr) return false;
  for (size_t i = 0; i < 3; ++i)
    if (parts[i].data != lo + offsets[i]) return false;
  const size_t span = offsets[2] + parts[2].row_bytes * static_cast<size_t>(parts[2].n_rows);
  return span + 16 <= take_expert_.size() && pinned(lo, span);
}

void CudaBackend::handoff_take_expert(int64_t il, int32_t e, const std::array<model::Matrix, 3>& parts) {
  if (!handoff_can_take(il, e, parts))
    throw std::logic_error("CUDA backend: handoff_take_expert(" + std::to_string(il) + ", " + std::to_string(e) +
                           ") where handoff_can_take says no");
  use_device();
  const size_t span = take_layouts_[static_cast<size_t>(layers_[il].take_layout)][2] +
                      parts[2].row_bytes * static_cast<size_t>(parts[2].n_rows);
  CUDA_CHECK(cudaMemcpyAsync(take_expert_.get(), parts[0].data, span, cudaMemcpyHostToDevice, take_stream_));
  // h_, the routing and weight_ of layer il are final: the device published them before the host
  // saw the routed flag, and overwrites them only after this layer's ready flag, which waits for
  // take_done_. The kernel writes only e's slot rows of dev_slots_; the graph's moe_fused writes
  // the resident experts' rows beside it.
  fused_experts(take_weights(il, e), il, step_n_, false, take_ws_, take_stream_);
  CUDA_CHECK(cudaEventRecord(take_done_, take_stream_));
  take_layer_ = il;
  take_e_ = e;
}

void CudaBackend::wait_taken() {
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t spins = 0;; ++spins) {
    const cudaError_t q = cudaEventQuery(take_done_);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) CUDA_CHECK(q);
    _mm_pause();
    if (spins % 4096 == 0 && std::chrono::steady_clock::now() - start > kHandoffTimeout)
      throw std::runtime_error("CUDA backend: layer " + std::to_string(take_layer_) + "'s taken expert " +
                               std::to_string(take_e_) + " did not land within " + std::to_string(kHandoffTimeout.count()) + " s");
  }
  take_layer_ = -1;
  take_e_ = -1;
}

void CudaBackend::handoff_finish(float* logits_out, int32_t* chosen_out, int64_t chosen_stride) {
  use_device();
  advance_step(step_n_);
  if (chosen_out != nullptr)
    for (int64_t il = 0; il < m_.hp.n_layer; ++il)
      pending_chosen_.push_back({chosen_pinned_.get() + il * step_n_ * m_.hp.n_expert_used,
                                 chosen_out + il * chosen_stride, step_n_ * m_.hp.n_expert_used});
  finish_step(handoff_rows_, logits_out);
  check_handoff_error();
}

void CudaBackend::handoff_abort() {
  use_device();
  if (take_stream_ != nullptr) cudaStreamSynchronize(take_stream_);
  take_layer_ = -1;
  take_e_ = -1;
  for (int64_t il = 0; il < m_.hp.n_layer; ++il)
    __atomic_store_n(handoff_flags_.get() + m_.hp.n_layer + il, handoff_seq_, __ATOMIC_RELEASE);
  cudaStreamSynchronize(stream_);
  cudaGetLastError();
  pending_chosen_.clear();
}

void CudaBackend::check_handoff_error() {
  int32_t err = 0;
  CUDA_CHECK(cudaMemcpy(&err, handoff_error_.get(), sizeof err, cudaMemcpyDeviceToHost));
  if (err == 0) return;
  CUDA_CHECK(cudaMemset(handoff_error_.get(), 0, sizeof err));
  throw std::runtime_error("CUDA backend: the device waited " + std::to_string(kHandoffTimeout.count() * 2) +
                           " s for the host's expert rows and gave up; this step's results are void");
}

// The captured hand-off step: layers run whole on the device or hand off through the flags.
void CudaBackend::enqueue_handoff_step(int64_t n, int64_t rows, const HandoffIo& io, const std::vector<char>& whole) {
  const model::HParams& hp = m_.hp;
  const int64_t d = hp.n_embd, nk = n * hp.n_expert_used;
  const uint64_t* seq = handoff_seq_dev_.get();
  uint64_t* routed = handoff_flags_dev_;
  uint64_t* ready = routed + hp.n_layer;
  CUDA_CHECK(cudaMemcpyAsync(handoff_seq_dev_.get(), handoff_seq_pinned_.get(), sizeof(uint64_t),
                             cudaMemcpyHostToDevice, stream_));
  enqueue_embed(n);
  for (int64_t il = 0; il < hp.n_layer; ++il) {
    if (whole[il]) {
      enqueue_layer_whole(il, n, false);
      continue;
    }
    enqueue_mixer(il, n);
    enqueue_route(il, n);
    const uint64_t timeout_ns = static_cast<uint64_t>(kHandoffTimeout.count()) * 2'000'000'000ull;
    // The device writes the routing and h into the host's memory and, once the host's flag is
    // up, reads back the rows the host's map names (fetch_expert_rows; handoff_begin checked that
    // the memory is mapped): two launches where memcpy nodes took five and two flag kernels
    // (docs/perf-log.md).
    const size_t rows_bytes = static_cast<size_t>(nk * d) * sizeof(float);
    const cuda::HostSpan out[] = {{mapped(io.chosen, nk * sizeof(int32_t)), chosen_of(il, n), nk * sizeof(int32_t)},
                                  {mapped(io.weight, nk * sizeof(float)), weight_.get(), nk * sizeof(float)},
                                  {mapped(io.h, n * d * sizeof(float)), h_.get(), n * d * sizeof(float)}};
    cuda::publish_to_host(out, 3, routed + il, seq, stream_);
    if (layers_[il].fused) enqueue_fused_experts(il, n);
    enqueue_shared(il, n);
    cuda::ExpertRowFetch f;
    f.flag = ready + il;
    f.seq_dev = seq;
    f.timeout_ns = timeout_ns;
    f.error_dev = handoff_error_.get();
    f.map_host = alt_pinned_dev_;
    f.rows_host = static_cast<const float*>(mapped(io.host_rows, rows_bytes));
    f.map_dev = alt_row_.get();
    f.rows_dev = cpu_rows_.get();
    f.nk = static_cast<int>(nk);
    f.row_floats = static_cast<int>(d);
    if (layers_[il].fused) {   // the device's own slots are known: skip the wait when the host has none
      f.chosen = chosen_of(il, n);
      f.slots = slot_table_.get() + il * slot_stride();
      f.n_expert = static_cast<int>(hp.n_expert);
    }
    cuda::fetch_expert_rows(f, stream_);
    enqueue_combine(il, n, true);
  }
  copy_to_host(chosen_pinned_.get(), chosen_.get(), static_cast<size_t>(hp.n_layer * nk) * sizeof(int32_t));
  enqueue_logits(rows);
}

}  // namespace moraine::gpu_worker::cuda_impl
