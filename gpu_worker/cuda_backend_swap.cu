// The CUDA backend's adaptive VRAM tier (cuda_backend_impl.h): experts swapped into the
// device's slabs on a copy stream while steps run.
#include "gpu_worker/cuda_backend_impl.h"

#include <algorithm>
#include <cstring>

namespace moraine::gpu_worker::cuda_impl {

bool CudaBackend::begin_swap(int64_t il, int32_t out, int32_t in) {
  use_device();
  check_layer(il);
  DevLayer& L = layers_[il];
  const int64_t E = m_.hp.n_expert;
  if (out < 0 || out >= E || in < 0 || in >= E || L.slab_of[out] < 0 || L.slab_of[in] >= 0) return false;
  PendingSwap* free_swap = nullptr;
  for (PendingSwap& p : swaps_)
    if (!p.busy) free_swap = &p;
  if (free_swap == nullptr) return false;
  // Between steps stream_ is idle: once `out`'s table entry is null no kernel reads its slab,
  // and the copy stream can overwrite it while the next steps run.
  const int32_t slab = L.slab_of[out];
  L.slab_of[out] = -1;
  --L.resident;
  set_table_entry(il, out, {});
  const model::MoeWeights& W = m_.layers[il].moe;
  uint8_t* staging = free_swap->staging.get();
  size_t at = 0;
  for (const auto& [t, d] : {std::pair{&W.gate, &L.gate}, std::pair{&W.up, &L.up}, std::pair{&W.down, &L.down}}) {
    const size_t one = t->all.row_bytes * static_cast<size_t>(t->rows_per_expert);
    std::memcpy(staging + at, t->all.data + static_cast<size_t>(in) * one, one);
    CUDA_CHECK(cudaMemcpyAsync(d->bytes.get() + static_cast<size_t>(slab) * d->matrix_bytes, staging + at, one,
                               cudaMemcpyHostToDevice, copy_stream_));
    at += one;
  }
  CUDA_CHECK(cudaEventRecord(free_swap->landed, copy_stream_));
  free_swap->busy = true;
  free_swap->il = il;
  free_swap->in = in;
  free_swap->slab = slab;
  return true;
}

std::vector<std::pair<int64_t, int32_t>> CudaBackend::landed_swaps() {
  use_device();
  std::vector<std::pair<int64_t, int32_t>> done;
  for (PendingSwap& p : swaps_) {
    if (!p.busy) continue;
    const cudaError_t q = cudaEventQuery(p.landed);
    if (q == cudaErrorNotReady) continue;
    CUDA_CHECK(q);
    DevLayer& L = layers_[p.il];
    L.slab_of[p.in] = p.slab;
    ++L.resident;
    set_table_entry(p.il, p.in, {L.gate.matrix(p.slab), L.up.matrix(p.slab), L.down.matrix(p.slab)});
    p.busy = false;
    done.emplace_back(p.il, p.in);
  }
  return done;
}

void CudaBackend::setup_swaps(bool all_experts) {
  if (all_experts) return;
  size_t largest = 0;
  for (const model::LayerWeights& L : m_.layers) {
    size_t one = 0;
    for (const model::ExpertTensor* t : {&L.moe.gate, &L.moe.up, &L.moe.down})
      if (t->all) one += t->all.row_bytes * static_cast<size_t>(t->rows_per_expert);
    largest = std::max(largest, one);
  }
  if (largest == 0) return;
  CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  swaps_.resize(kMaxPendingSwaps);
  for (PendingSwap& p : swaps_) {
    CUDA_CHECK(cudaEventCreateWithFlags(&p.landed, cudaEventDisableTiming));
    p.staging = PinnedBuffer<uint8_t>(largest);
  }
}

void CudaBackend::set_table_entry(int64_t il, int32_t e, const cuda::MoeExpertSlot& v) {
  CUDA_CHECK(cudaMemcpy(slot_table_.get() + il * slot_stride() + e, &v, sizeof v, cudaMemcpyHostToDevice));
}

}  // namespace moraine::gpu_worker::cuda_impl
