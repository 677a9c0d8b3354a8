// Scalar reference: quantize_q8_0 (common/formats/quant_legacy.cpp) and quantize_q8_k
// (common/formats/kquant_quantize.cpp). Every rounding step uses the explicit round-to-nearest
// intrinsics (__fdiv_rn, __fmul_rn) so nvcc cannot contract or approximate them: the bytes must
// equal the reference's, which tests/cuda/quantize_activations_test.cpp checks.
#include "kernels/cuda/quantize_activations.h"

#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "common/formats/block_layouts.h"
#include "kernels/cuda/cuda_check.h"

namespace moraine::cuda {
namespace {

constexpr int kWarpsPerCta = 8;

// One warp per 32-element block, one element per lane: d = amax / 127, q = round(x / d) with
// the reference's safe inverse (0 when d is 0 or 1/d overflows) and round-half-away (roundf).
__global__ void quantize_q8_0_kernel(const float* __restrict__ x, BlockQ8_0* __restrict__ out,
                                     int64_t nblocks) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  if (b >= nblocks) return;  // whole warps leave together: b is uniform per warp
  const int lane = threadIdx.x % 32;
  const float v = x[b * kQK + lane];
  float amax = fabsf(v);
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float d = __fdiv_rn(amax, 127.0f);
  const float r = __fdiv_rn(1.0f, d);
  const float id = (d != 0.0f && isfinite(r)) ? r : 0.0f;
  out[b].qs[lane] = static_cast<int8_t>(roundf(__fmul_rn(v, id)));
  if (lane == 0) out[b].d = __half_as_ushort(__float2half_rn(d));
}

// One warp per 256-element block, 8 consecutive elements per lane. The reference keeps the
// first element of largest magnitude (strict >) as `max`, so ties go to the lowest index.
__global__ void quantize_q8_k_kernel(const float* __restrict__ x, BlockQ8_K* __restrict__ out,
                                     int64_t nblocks) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  if (b >= nblocks) return;
  const int lane = threadIdx.x % 32;
  const float4* src = reinterpret_cast<const float4*>(x + b * kQK_K + 8 * lane);
  const float4 lo = src[0], hi = src[1];
  const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  float amax = 0.0f;
  int idx = 8 * lane;
  float maxv = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (fabsf(v[i]) > amax) {
      amax = fabsf(v[i]);
      idx = 8 * lane + i;
      maxv = v[i];
    }
  }
  for (int off = 16; off > 0; off /= 2) {
    const float oa = __shfl_xor_sync(0xffffffffu, amax, off);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, off);
    const float ov = __shfl_xor_sync(0xffffffffu, maxv, off);
    if (oa > amax || (oa == amax && oi < idx)) {
      amax = oa;
      idx = oi;
      maxv = ov;
    }
  }
  BlockQ8_K& y = out[b];
  const float iscale = amax == 0.0f ? 0.0f : __fdiv_rn(-127.0f, maxv);
  if (amax == 0.0f || !isfinite(iscale)) {  // the reference writes an all-zero block
    reinterpret_cast<int*>(y.qs)[2 * lane] = 0;
    reinterpret_cast<int*>(y.qs)[2 * lane + 1] = 0;
    if (lane < 16) y.bsums[lane] = 0;
    if (lane == 0) y.d = 0.0f;
    return;
  }
  int q[8];
  int sum = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    q[i] = min(127, __float2int_rn(__fmul_rn(iscale, v[i])));  // lrint: ties to even
    sum += q[i];
  }
  int packed[2];
#pragma unroll
  for (int w = 0; w < 2; ++w)
    packed[w] = (q[4 * w] & 0xff) | ((q[4 * w + 1] & 0xff) << 8) | ((q[4 * w + 2] & 0xff) << 16) |
                ((q[4 * w + 3] & 0xff) << 24);
  // Q8_K blocks are 292 bytes: qs is only 4-byte aligned, so two int stores, not one int2.
  reinterpret_cast<int*>(y.qs)[2 * lane] = packed[0];
  reinterpret_cast<int*>(y.qs)[2 * lane + 1] = packed[1];
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // two lanes make one 16-element group
  if (lane % 2 == 0) y.bsums[lane / 2] = static_cast<int16_t>(sum);
  if (lane == 0) y.d = __fdiv_rn(1.0f, iscale);
}

}  // namespace

void quantize_activations(TensorType act_type, const float* x, void* out, int64_t n,
                          int64_t rows, cudaStream_t stream) {
  if (act_type != TensorType::Q8_0 && act_type != TensorType::Q8_K)
    throw std::invalid_argument("quantize_activations: activation type " +
                                std::string(type_name(act_type)) + " is not q8_0 or q8_K");
  const int64_t block = act_type == TensorType::Q8_0 ? kQK : kQK_K;
  if (n <= 0 || rows <= 0 || n % block != 0)
    throw std::invalid_argument("quantize_activations: n=" + std::to_string(n) + ", rows=" +
                                std::to_string(rows) + " (n must be a positive multiple of " +
                                std::to_string(block) + " for " + std::string(type_name(act_type)) + ")");
  const int64_t nblocks = n / block * rows;
  const unsigned grid = static_cast<unsigned>((nblocks + kWarpsPerCta - 1) / kWarpsPerCta);
  if (act_type == TensorType::Q8_0) {
    quantize_q8_0_kernel<<<grid, 32 * kWarpsPerCta, 0, stream>>>(x, static_cast<BlockQ8_0*>(out), nblocks);
  } else {
    quantize_q8_k_kernel<<<grid, 32 * kWarpsPerCta, 0, stream>>>(x, static_cast<BlockQ8_K*>(out), nblocks);
  }
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moraine::cuda
