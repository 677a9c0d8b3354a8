// The CUDA backend's captured steps (cuda_backend_impl.h): a whole step as a CUDA graph per
// token count, replayed for every step of that count.
#include "gpu_worker/cuda_backend_impl.h"

#include <stdexcept>

namespace moraine::gpu_worker::cuda_impl {

void CudaBackend::step_whole(const int32_t* tokens, int64_t n, int64_t logit_rows, float* logits_out,
                             int32_t* chosen_out, int64_t chosen_stride) {
  use_device();
  if (!graphs_ok_ || n > kDecodeRows || !all_on_device()) {
    Backend::step_whole(tokens, n, logit_rows, logits_out, chosen_out, chosen_stride);
    return;
  }
  if (logit_rows <= 0 || logit_rows > n)
    throw std::invalid_argument("CUDA backend: logits of " + std::to_string(logit_rows) + " rows of a step of " +
                                std::to_string(n));
  begin_step(tokens, n);
  if (segmented_) {   // as logits() checks a segmented step's rows
    int64_t want = 0;
    for (const Segment& seg : segments_) want += seg.logit_rows;
    if (logit_rows != want)
      throw std::invalid_argument("CUDA backend: logits of " + std::to_string(logit_rows) +
                                  " rows of a step whose segments ask for " + std::to_string(want));
  }
  StepGraph& g = graphs_[step_key({logit_rows})];
  if (g.exec == nullptr && !capture(g, n, logit_rows)) {
    if (segmented_) pending_ = segments_;   // the layer-by-layer step's embed takes them again
    Backend::step_whole(tokens, n, logit_rows, logits_out, chosen_out, chosen_stride);
    return;
  }
  CUDA_CHECK(cudaGraphLaunch(g.exec, stream_));
  advance_step(n);
  if (chosen_out != nullptr)
    for (int64_t il = 0; il < m_.hp.n_layer; ++il)
      pending_chosen_.push_back({chosen_pinned_.get() + il * n * m_.hp.n_expert_used, chosen_out + il * chosen_stride,
                                 n * m_.hp.n_expert_used});
  finish_step(logit_rows, logits_out);
}

bool CudaBackend::capture(StepGraph& g, int64_t n, int64_t rows) {
  graphs_ok_ = capture_into(g, [&] {
    enqueue_embed(n);
    for (int64_t il = 0; il < m_.hp.n_layer; ++il) enqueue_layer_whole(il, n, false);
    copy_to_host(chosen_pinned_.get(), chosen_.get(), static_cast<size_t>(m_.hp.n_layer * n * m_.hp.n_expert_used) *
                                                          sizeof(int32_t));
    enqueue_logits(rows);
  });
  return graphs_ok_;
}

}  // namespace moraine::gpu_worker::cuda_impl
