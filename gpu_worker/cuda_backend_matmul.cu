// The CUDA backend's matmuls (cuda_backend_impl.h): the batched matvec or cuBLAS.
#include "gpu_worker/cuda_backend_impl.h"

#include <stdexcept>

#include "common/formats/quant.h"
#include "kernels/cuda/matvec_float.h"
#include "kernels/cuda/quantize_activations_llama.h"
#include "kernels/cuda/residual_add.h"

namespace moraine::gpu_worker::cuda_impl {

// y[t] = W x[t] for n rows of x (device), one batched launch; quantized weights dot the rows
// quantized with llama.cpp's x86 rule, as the reference executor's matmul does.
// x_ += W x for n rows: the matvec adds into the residual itself (MatvecBatch::accumulate,
// the bits of matvec then residual_add); cuBLAS steps add afterwards.
void CudaBackend::matmul_into_residual(const DevMatrix& W, const float* x, int64_t n) {
  if (use_gemm(W, n)) {
    matmul(W, x, n, y_.get());
    cuda::residual_add(xw(), y_.get(), n * m_.hp.n_embd, stream_);
    return;
  }
  cuda::MatvecBatch b;
  b.count = static_cast<int>(n);
  b.out_stride = W.rows;
  b.accumulate = true;
  run_matvec(W, x, n, xw(), b);
}

void CudaBackend::matmul(const DevMatrix& W, const float* x, int64_t n, float* y) {
  if (use_gemm(W, n)) {
    gemm_->matmul(W.type, W.bytes.get(), W.rows, W.cols, x, n, y);
    return;
  }
  if (gemm_ != nullptr && n >= gemm_prefill_rows_ && W.type == TensorType::F32) {
    gemm_->matmul_f32(reinterpret_cast<const float*>(W.bytes.get()), W.rows, W.cols, x, n, y);
    return;
  }
  cuda::MatvecBatch b;
  b.count = static_cast<int>(n);
  b.out_stride = W.rows;
  run_matvec(W, x, n, y, b);
}

// Quantized weights of a long step go through cuBLAS with 16-bit inputs; F32 weights take
// cuBLAS in F32 (matmul above: the F32 golden bound is tighter than BF16 rounding).
bool CudaBackend::use_gemm(const DevMatrix& W, int64_t n) const {
  return gemm_ != nullptr && n >= gemm_prefill_rows_ && cuda::matvec_supported(W.type) &&
         cuda::prefill_gemm_supported(W.type) && W.cols % 32 == 0;
}

bool CudaBackend::gemm_experts(const DevLayer& L, int64_t n) const {
  return L.resident > 0 && use_gemm(L.gate, n) && use_gemm(L.up, n) && use_gemm(L.down, n);
}

// Row r of x through the slab matrix slab_ids[r] (device).
void CudaBackend::expert_matmul(const DevMatrix& W, const float* x, int64_t rows, const int32_t* slab_ids, float* y) {
  cuda::MatvecBatch b;
  b.count = static_cast<int>(rows);
  b.weight_stride_bytes = static_cast<int64_t>(W.matrix_bytes);
  b.out_stride = W.rows;
  b.expert_ids = slab_ids;
  run_matvec(W, x, rows, y, b);
}

void CudaBackend::run_matvec(const DevMatrix& W, const float* x, int64_t n, float* y, cuda::MatvecBatch& b) {
  if (cuda::matvec_float_supported(W.type)) {
    b.act_stride_bytes = W.cols * static_cast<int64_t>(sizeof(float));
    cuda::matvec_float_batched(W.type, W.bytes.get(), W.rows, W.cols, x, y, b, stream_);
    return;
  }
  const TensorType at = dot_activation_type(W.type);
  const size_t rb = row_bytes(at, W.cols);
  b.act_stride_bytes = static_cast<int64_t>(rb);
  const int64_t fit = static_cast<int64_t>(act_.size() / rb);
  if (fit < 1) throw std::logic_error("CUDA backend: activation scratch too small for one row of " + std::to_string(W.cols));
  if (n <= fit) {
    if (x != act_src_ || at != act_of_h_ || n != act_of_h_rows_) {
      cuda::quantize_activations_llama(at, x, act_.get(), W.cols, n, stream_);
      act_of_h_ = TensorType::F32;   // act_ no longer holds h_
    }
    cuda::matvec_quantized_batched(W.type, W.bytes.get(), W.rows, W.cols, act_.get(), y, b, stream_);
    return;
  }
  // More rows than act_ holds (a long step's matrix the PrefillGemm does not take): passes of
  // `fit` rows; each row's dots are its own, so the bits do not depend on the passes.
  act_of_h_ = TensorType::F32;
  for (int64_t r0 = 0; r0 < n; r0 += fit) {
    cuda::MatvecBatch p = b;
    p.count = static_cast<int>(std::min(fit, n - r0));
    if (p.expert_ids != nullptr) p.expert_ids += r0;
    cuda::quantize_activations_llama(at, x + r0 * W.cols, act_.get(), W.cols, p.count, stream_);
    cuda::matvec_quantized_batched(W.type, W.bytes.get(), W.rows, W.cols, act_.get(), y + r0 * b.out_stride, p, stream_);
  }
}

}  // namespace moraine::gpu_worker::cuda_impl
