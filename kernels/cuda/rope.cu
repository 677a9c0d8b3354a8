#include "kernels/cuda/rope.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"

namespace moraine::cuda {
namespace {

// One thread per rotated pair (row, head, i < n_rot/2). The position comes from pos0_dev when
// that is set (graph-safe variant), else from pos0; both paths run the same arithmetic.
__global__ void rope_neox_kernel(float* x, int64_t rows, int64_t n_heads, int64_t row_stride,
                                 int64_t head_stride, int64_t n_rot, int64_t pos0, const int32_t* pos0_dev,
                                 double freq_base) {
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int64_t half = n_rot / 2;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * n_heads * half) return;
  const int64_t i = idx % half;
  const int64_t h = (idx / half) % n_heads;
  const int64_t r = idx / (half * n_heads);
  float* head = x + r * row_stride + h * head_stride;
  if (pos0_dev != nullptr) {
    pos0 = *pos0_dev;
    if (pos0 < 0) {  // cannot throw from a graph replay: make the damage visible instead
      head[i] = head[i + half] = __int_as_float(0x7fc00000);
      return;
    }
  }
  const double theta = static_cast<double>(pos0 + r) *
                       pow(freq_base, -2.0 * static_cast<double>(i) / static_cast<double>(n_rot));
  const float c = static_cast<float>(cos(theta));
  const float s = static_cast<float>(sin(theta));
  const float x0 = head[i], x1 = head[i + half];
  head[i] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
  head[i + half] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

void check_shape(const char* what, int64_t rows, int64_t n_heads, int64_t head_stride, int64_t n_rot, int64_t pos0) {
  if (rows <= 0 || n_heads <= 0 || n_rot <= 0 || n_rot % 2 != 0 || n_rot > head_stride || pos0 < 0)
    throw std::invalid_argument(std::string(what) + ": rows=" + std::to_string(rows) +
                                ", n_heads=" + std::to_string(n_heads) + ", n_rot=" + std::to_string(n_rot) +
                                ", head_stride=" + std::to_string(head_stride) + ", pos0=" + std::to_string(pos0) +
                                " (need positive counts, an even n_rot <= head_stride, pos0 >= 0)");
}

void launch(float* x, int64_t rows, int64_t n_heads, int64_t row_stride, int64_t head_stride, int64_t n_rot,
            int64_t pos0, const int32_t* pos0_dev, double freq_base, cudaStream_t stream) {
  const int64_t total = rows * n_heads * (n_rot / 2);
  constexpr int kThreads = 256;
  launch_kernel(rope_neox_kernel, dim3(static_cast<unsigned>((total + kThreads - 1) / kThreads)), dim3(kThreads), 0, stream,
                x, rows, n_heads, row_stride, head_stride, n_rot, pos0, pos0_dev, freq_base);
}

}  // namespace

void rope_neox(float* x, int64_t rows, int64_t n_heads, int64_t row_stride, int64_t head_stride, int64_t n_rot,
               int64_t pos0, double freq_base, cudaStream_t stream) {
  check_shape("rope_neox", rows, n_heads, head_stride, n_rot, pos0);
  launch(x, rows, n_heads, row_stride, head_stride, n_rot, pos0, nullptr, freq_base, stream);
}

void rope_neox_at(float* x, int64_t rows, int64_t n_heads, int64_t row_stride, int64_t head_stride, int64_t n_rot,
                  const int32_t* pos0_dev, double freq_base, cudaStream_t stream) {
  check_shape("rope_neox_at", rows, n_heads, head_stride, n_rot, 0);
  if (pos0_dev == nullptr) throw std::invalid_argument("rope_neox_at: pos0_dev is null");
  launch(x, rows, n_heads, row_stride, head_stride, n_rot, 0, pos0_dev, freq_base, stream);
}

}  // namespace moraine::cuda
