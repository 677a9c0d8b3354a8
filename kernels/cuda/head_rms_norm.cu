#include "kernels/cuda/head_rms_norm.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"

namespace moraine::cuda {
namespace {

constexpr int kWarpsPerCta = 4;

// One warp per head. Each lane reads its elements before the warp-wide sum, and writes only its
// own elements after it, so in-place use is safe.
__global__ void head_rms_norm_kernel(const float* x, int64_t x_row_stride, int64_t x_head_stride,
                                     const float* __restrict__ w, float* out, int64_t heads_total,
                                     int64_t n_heads, int64_t hd, float eps) {
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int64_t head = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  if (head >= heads_total) return;
  const int lane = threadIdx.x % 32;
  const int64_t r = head / n_heads, h = head % n_heads;
  const float* xh = x + r * x_row_stride + h * x_head_stride;
  float* oh = out + head * hd;
  double ss = 0.0;
  for (int64_t i = lane; i < hd; i += 32) {
    const double v = xh[i];
    ss += v * v;
  }
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  const float mean = __double2float_rn(__ddiv_rn(ss, static_cast<double>(hd)));
  const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
  for (int64_t i = lane; i < hd; i += 32) oh[i] = __fmul_rn(__fmul_rn(xh[i], inv), w[i]);
}

}  // namespace

void head_rms_norm(const float* x, int64_t x_row_stride, int64_t x_head_stride, const float* w, float* out,
                   int64_t rows, int64_t n_heads, int64_t head_dim, float eps, cudaStream_t stream) {
  if (rows <= 0 || n_heads <= 0 || head_dim <= 0 || x_head_stride < head_dim || w == nullptr)
    throw std::invalid_argument("head_rms_norm: rows=" + std::to_string(rows) + ", n_heads=" +
                                std::to_string(n_heads) + ", head_dim=" + std::to_string(head_dim) +
                                ", head stride " + std::to_string(x_head_stride) +
                                " (need positive counts, head stride >= head_dim and a weight)");
  const int64_t total = rows * n_heads;
  launch_kernel(head_rms_norm_kernel, dim3(static_cast<unsigned>((total + kWarpsPerCta - 1) / kWarpsPerCta)),
                dim3(32 * kWarpsPerCta), 0, stream, x, x_row_stride, x_head_stride, w, out, total, n_heads, head_dim, eps);
}

}  // namespace moraine::cuda
