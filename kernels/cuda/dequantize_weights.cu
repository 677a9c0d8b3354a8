// One thread per 32 consecutive output elements (a Q8_0/MXFP4 block, a 32-element slice of a
// k-quant super-block, or 32 plain elements): it decodes them into registers with the float
// expressions of the scalar reference (common/formats/quant_legacy.cpp, kquant_reference.cpp),
// rounds them and writes 64 contiguous bytes as four 16-byte stores.
#include "kernels/cuda/dequantize_weights.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/dequantize_blocks.cuh"
#include "kernels/cuda/gemm_input_round.cuh"

namespace moraine::cuda {
namespace {

using dequant::kSliceElems;
constexpr int kMaxMatricesPerLaunch = 64;
constexpr int kThreads = 256;

struct MatrixList {
  const uint8_t* w[kMaxMatricesPerLaunch];
};

template <class F, GemmInput O>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(MatrixList list, int64_t slices_per_matrix, int64_t elems, unsigned short* __restrict__ out) {
  const int64_t s = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (s >= slices_per_matrix) return;
  const int m = blockIdx.y;
  const uint8_t* block = list.w[m] + (s / F::kSlices) * F::kBytes;
  float y[kSliceElems];
  F::slice(block, static_cast<int>(s % F::kSlices), y);
  uint4 packed[4];
  unsigned short* h = reinterpret_cast<unsigned short*>(packed);
#pragma unroll
  for (int l = 0; l < kSliceElems; ++l) h[l] = round_to_gemm_input<O>(y[l]);
  uint4* dst = reinterpret_cast<uint4*>(out + m * elems + s * kSliceElems);
#pragma unroll
  for (int i = 0; i < 4; ++i) dst[i] = packed[i];
}

template <GemmInput O>
__global__ void convert_kernel(const float4* __restrict__ x, int64_t quads, uint2* __restrict__ out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < quads;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 v = x[i];
    const unsigned a = round_to_gemm_input<O>(v.x), b = round_to_gemm_input<O>(v.y);
    const unsigned c = round_to_gemm_input<O>(v.z), d = round_to_gemm_input<O>(v.w);
    out[i] = make_uint2(a | (b << 16), c | (d << 16));
  }
}

template <class F, GemmInput O>
void launch(const void* const* weights, int count, int64_t elems, void* out, cudaStream_t stream) {
  const int64_t slices = elems / kSliceElems;
  for (int first = 0; first < count; first += kMaxMatricesPerLaunch) {
    const int here = std::min(kMaxMatricesPerLaunch, count - first);
    MatrixList list{};
    for (int i = 0; i < here; ++i) list.w[i] = static_cast<const uint8_t*>(weights[first + i]);
    const dim3 grid(static_cast<unsigned>((slices + kThreads - 1) / kThreads), static_cast<unsigned>(here));
    dequantize_kernel<F, O><<<grid, kThreads, 0, stream>>>(list, slices, elems,
                                                            static_cast<unsigned short*>(out) + first * elems);
    CUDA_CHECK(cudaGetLastError());
  }
}

template <GemmInput O>
void dispatch(TensorType t, const void* const* weights, int count, int64_t elems, void* out, cudaStream_t stream) {
  if (!dequant::with_block_decoder(t, [&]<class F>() { launch<F, O>(weights, count, elems, out, stream); }))
    throw std::invalid_argument("dequantize_weights: no GPU dequantizer for " + std::string(type_name(t)));
}

}  // namespace

bool dequantize_weights_supported(TensorType weight) {
  return dequant::with_block_decoder(weight, []<class F>() {});
}

void dequantize_weights(TensorType weight, const void* const* weights, int count, int64_t elems, GemmInput out_type,
                        void* out, cudaStream_t stream) {
  const std::string where = " (weight " + std::string(type_name(weight)) + ", " + std::to_string(count) +
                            " matrices of " + std::to_string(elems) + " elements)";
  if (!dequantize_weights_supported(weight))
    throw std::invalid_argument("dequantize_weights: unsupported weight type" + where +
                                "; supported: q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, mxfp4, q4_0, q4_1, q5_0, q5_1, iq4_nl, "
                                "iq4_xs, tq1_0, tq2_0, iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s, iq1_s, iq1_m, f16, bf16, f32");
  const int64_t block = type_traits(weight).block_elems;
  if (count < 0 || elems <= 0 || elems % kSliceElems != 0 || elems % block != 0 || elems / kSliceElems > (int64_t{1} << 40))
    throw std::invalid_argument("dequantize_weights: elements must be a positive multiple of 32 and of the block size " +
                                std::to_string(block) + where);
  if (count == 0) return;
  if (weights == nullptr || out == nullptr || reinterpret_cast<uintptr_t>(out) % 16 != 0)
    throw std::invalid_argument("dequantize_weights: null pointer list or output not 16-byte aligned" + where);
  const uintptr_t align = weight == TensorType::F32 ? 4 : 2;
  for (int i = 0; i < count; ++i)
    if (weights[i] == nullptr || reinterpret_cast<uintptr_t>(weights[i]) % align != 0)
      throw std::invalid_argument("dequantize_weights: matrix " + std::to_string(i) + " is null or not " +
                                  std::to_string(align) + "-byte aligned" + where);
  if (out_type == GemmInput::BF16) {
    dispatch<GemmInput::BF16>(weight, weights, count, elems, out, stream);
  } else {
    dispatch<GemmInput::F16>(weight, weights, count, elems, out, stream);
  }
}

void convert_gemm_input(const float* x, int64_t count, GemmInput out_type, void* out, cudaStream_t stream) {
  if (count < 0 || count % 4 != 0 || (count > 0 && (x == nullptr || out == nullptr)) ||
      reinterpret_cast<uintptr_t>(x) % 16 != 0 || reinterpret_cast<uintptr_t>(out) % 8 != 0)
    throw std::invalid_argument("convert_gemm_input: count " + std::to_string(count) +
                                " must be a multiple of 4, x 16-byte and out 8-byte aligned");
  if (count == 0) return;
  const int64_t quads = count / 4;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((quads + 255) / 256, 132 * 16));
  const auto* src = reinterpret_cast<const float4*>(x);
  auto* dst = static_cast<uint2*>(out);
  if (out_type == GemmInput::BF16) {
    convert_kernel<GemmInput::BF16><<<blocks, 256, 0, stream>>>(src, quads, dst);
  } else {
    convert_kernel<GemmInput::F16><<<blocks, 256, 0, stream>>>(src, quads, dst);
  }
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moraine::cuda
