#include "kernels/cuda/rope.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"

namespace moraine::cuda {
namespace {

// One thread per rotated pair (row, head, i < n_rot/2).
__global__ void rope_neox_kernel(float* x, int64_t rows, int64_t n_heads, int64_t row_stride,
                                 int64_t head_stride, int64_t n_rot, int64_t pos0, double freq_base) {
  const int64_t half = n_rot / 2;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * n_heads * half) return;
  const int64_t i = idx % half;
  const int64_t h = (idx / half) % n_heads;
  const int64_t r = idx / (half * n_heads);
  const double theta = static_cast<double>(pos0 + r) *
                       pow(freq_base, -2.0 * static_cast<double>(i) / static_cast<double>(n_rot));
  const float c = static_cast<float>(cos(theta));
  const float s = static_cast<float>(sin(theta));
  float* head = x + r * row_stride + h * head_stride;
  const float x0 = head[i], x1 = head[i + half];
  head[i] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
  head[i + half] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

}  // namespace

void rope_neox(float* x, int64_t rows, int64_t n_heads, int64_t row_stride, int64_t head_stride, int64_t n_rot,
               int64_t pos0, double freq_base, cudaStream_t stream) {
  if (rows <= 0 || n_heads <= 0 || n_rot <= 0 || n_rot % 2 != 0 || n_rot > head_stride || pos0 < 0)
    throw std::invalid_argument("rope_neox: rows=" + std::to_string(rows) + ", n_heads=" + std::to_string(n_heads) +
                                ", n_rot=" + std::to_string(n_rot) + ", head_stride=" + std::to_string(head_stride) +
                                ", pos0=" + std::to_string(pos0) +
                                " (need positive counts, an even n_rot <= head_stride, pos0 >= 0)");
  const int64_t total = rows * n_heads * (n_rot / 2);
  constexpr int kThreads = 256;
  rope_neox_kernel<<<static_cast<unsigned>((total + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      x, rows, n_heads, row_stride, head_stride, n_rot, pos0, freq_base);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moraine::cuda
