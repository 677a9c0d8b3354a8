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

#include "common/formats/block_layouts.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/dequantize_weights_iq.cuh"
#include "kernels/cuda/gemm_input_round.cuh"

namespace moraine::cuda {
namespace {

constexpr int kSliceElems = 32;
constexpr int kMaxMatricesPerLaunch = 64;
constexpr int kThreads = 256;

__device__ __forceinline__ float half_at(const uint8_t* p) {
  return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(p)));
}

// Each format: kBytes per block, kSlices 32-element slices per block, and slice(block, k, y)
// writing elements 32k..32k+31 of the block.
struct DequantQ8_0 {
  static constexpr int kBytes = sizeof(BlockQ8_0), kSlices = 1;
  __device__ static void slice(const uint8_t* b, int, float* y) {
    const float d = half_at(b);
#pragma unroll
    for (int l = 0; l < 32; ++l) y[l] = __fmul_rn(static_cast<float>(static_cast<int8_t>(b[2 + l])), d);
  }
};

struct DequantMXFP4 {
  static constexpr int kBytes = sizeof(BlockMXFP4), kSlices = 1;
  __device__ static void slice(const uint8_t* b, int, float* y) {
    const uint32_t e = b[0];
    const float d = __uint_as_float(e < 2 ? (0x00200000u << e) : ((e - 1) << 23));  // 2^(e - 128)
    constexpr int8_t kTable[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};  // kE2M1Doubled
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      y[j] = __fmul_rn(static_cast<float>(kTable[b[1 + j] & 0x0f]), d);
      y[j + 16] = __fmul_rn(static_cast<float>(kTable[b[1 + j] >> 4]), d);
    }
  }
};

// Slice k of Q2_K/Q3_K/Q6_K: elements 128h + 32s + l (h = k / 4, s = k % 4); 16-element
// sub-block 2k + l / 16.
struct DequantQ2_K {
  static constexpr int kBytes = sizeof(BlockQ2_K), kSlices = 8;
  __device__ static void slice(const uint8_t* b, int k, float* y) {
    const int h = k / 4, s = k % 4;
    const float d = half_at(b + 80), dmin = half_at(b + 82);
#pragma unroll
    for (int half16 = 0; half16 < 2; ++half16) {
      const uint8_t sc = b[2 * k + half16];
      const float dl = __fmul_rn(d, static_cast<float>(sc & 0x0f));
      const float ml = __fmul_rn(dmin, static_cast<float>(sc >> 4));
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int l = 16 * half16 + i;
        const int q = (b[16 + 32 * h + l] >> (2 * s)) & 3;
        y[l] = __fsub_rn(__fmul_rn(dl, static_cast<float>(q)), ml);
      }
    }
  }
};

__device__ __forceinline__ int q3k_scale_at(const uint8_t* packed, int j) {
  const int low = j < 8 ? (packed[j] & 0x0f) : (packed[j - 8] >> 4);
  const int high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
  return (low | (high << 4)) - 32;
}

struct DequantQ3_K {
  static constexpr int kBytes = sizeof(BlockQ3_K), kSlices = 8;
  __device__ static void slice(const uint8_t* b, int k, float* y) {
    const int h = k / 4, s = k % 4;
    const float d = half_at(b + 108);
#pragma unroll
    for (int half16 = 0; half16 < 2; ++half16) {
      const float dl = __fmul_rn(d, static_cast<float>(q3k_scale_at(b + 96, 2 * k + half16)));
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int l = 16 * half16 + i;
        const int low = (b[32 + 32 * h + l] >> (2 * s)) & 3;
        const int v = low - (((b[l] >> k) & 1) ? 0 : 4);
        y[l] = __fmul_rn(dl, static_cast<float>(v));
      }
    }
  }
};

// Q4_K/Q5_K slice j = sub-block j: elements 64p + 32t + l (p = j / 2, t = j % 2).
template <bool kHighBit>
struct DequantQ45_K {
  static constexpr int kBytes = kHighBit ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K), kSlices = 8;
  static constexpr int kQs = kHighBit ? 48 : 16;
  __device__ static void slice(const uint8_t* b, int j, float* y) {
    const int p = j / 2, t = j % 2;
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* packed = b + 4;
    int sc, m;
    if (j < 4) {
      sc = packed[j] & 63;
      m = packed[j + 4] & 63;
    } else {
      sc = (packed[j + 4] & 0x0f) | ((packed[j - 4] >> 6) << 4);
      m = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
    }
    const float dl = __fmul_rn(d, static_cast<float>(sc)), ml = __fmul_rn(dmin, static_cast<float>(m));
#pragma unroll
    for (int l = 0; l < 32; ++l) {
      const uint8_t byte = b[kQs + 32 * p + l];
      int q = t ? (byte >> 4) : (byte & 0x0f);
      if constexpr (kHighBit) q += ((b[16 + l] >> j) & 1) << 4;
      y[l] = __fsub_rn(__fmul_rn(dl, static_cast<float>(q)), ml);
    }
  }
};

struct DequantQ6_K {
  static constexpr int kBytes = sizeof(BlockQ6_K), kSlices = 8;
  __device__ static void slice(const uint8_t* b, int k, float* y) {
    const int h = k / 4, s = k % 4;
    const float d = half_at(b + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
#pragma unroll
    for (int half16 = 0; half16 < 2; ++half16) {
      const float dl = __fmul_rn(d, static_cast<float>(scales[2 * k + half16]));
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int l = 16 * half16 + i;
        const uint8_t lo_byte = b[64 * h + 32 * (s % 2) + l];
        const int lo = s < 2 ? (lo_byte & 0x0f) : (lo_byte >> 4);
        const int hi = (b[128 + 32 * h + l] >> (2 * s)) & 3;
        y[l] = __fmul_rn(dl, static_cast<float>((lo | (hi << 4)) - 32));
      }
    }
  }
};

// Plain types: a "block" is 32 elements.
template <TensorType T>
struct DequantPlain {
  static constexpr int kElemBytes = T == TensorType::F32 ? 4 : 2;
  static constexpr int kBytes = 32 * kElemBytes, kSlices = 1;
  __device__ static void slice(const uint8_t* b, int, float* y) {
#pragma unroll
    for (int l = 0; l < 32; ++l) {
      if constexpr (T == TensorType::F32) {
        y[l] = reinterpret_cast<const float*>(b)[l];
      } else if constexpr (T == TensorType::F16) {
        y[l] = half_at(b + 2 * l);
      } else {
        y[l] = __bfloat162float(__ushort_as_bfloat16(reinterpret_cast<const unsigned short*>(b)[l]));
      }
    }
  }
};

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
  switch (t) {
    case TensorType::Q8_0: return launch<DequantQ8_0, O>(weights, count, elems, out, stream);
    case TensorType::MXFP4: return launch<DequantMXFP4, O>(weights, count, elems, out, stream);
    case TensorType::Q2_K: return launch<DequantQ2_K, O>(weights, count, elems, out, stream);
    case TensorType::Q3_K: return launch<DequantQ3_K, O>(weights, count, elems, out, stream);
    case TensorType::Q4_K: return launch<DequantQ45_K<false>, O>(weights, count, elems, out, stream);
    case TensorType::Q5_K: return launch<DequantQ45_K<true>, O>(weights, count, elems, out, stream);
    case TensorType::Q6_K: return launch<DequantQ6_K, O>(weights, count, elems, out, stream);
    case TensorType::F32: return launch<DequantPlain<TensorType::F32>, O>(weights, count, elems, out, stream);
    case TensorType::F16: return launch<DequantPlain<TensorType::F16>, O>(weights, count, elems, out, stream);
    case TensorType::BF16: return launch<DequantPlain<TensorType::BF16>, O>(weights, count, elems, out, stream);
    // The importance-matrix grid formats (dequantize_weights_iq.cuh).
    case TensorType::IQ2_XXS: return launch<dequant_iq::DequantIQ2_XXS, O>(weights, count, elems, out, stream);
    case TensorType::IQ2_XS: return launch<dequant_iq::DequantIQ2_XS, O>(weights, count, elems, out, stream);
    case TensorType::IQ2_S: return launch<dequant_iq::DequantIQ2_S, O>(weights, count, elems, out, stream);
    case TensorType::IQ3_XXS: return launch<dequant_iq::DequantIQ3_XXS, O>(weights, count, elems, out, stream);
    case TensorType::IQ3_S: return launch<dequant_iq::DequantIQ3_S, O>(weights, count, elems, out, stream);
    case TensorType::IQ1_S: return launch<dequant_iq::DequantIQ1_S, O>(weights, count, elems, out, stream);
    case TensorType::IQ1_M: return launch<dequant_iq::DequantIQ1_M, O>(weights, count, elems, out, stream);
    default: break;
  }
  throw std::invalid_argument("dequantize_weights: no GPU dequantizer for " + std::string(type_name(t)));
}

}  // namespace

bool dequantize_weights_supported(TensorType weight) {
  switch (weight) {
    case TensorType::Q8_0:
    case TensorType::MXFP4:
    case TensorType::Q2_K:
    case TensorType::Q3_K:
    case TensorType::Q4_K:
    case TensorType::Q5_K:
    case TensorType::Q6_K:
    case TensorType::F32:
    case TensorType::F16:
    case TensorType::BF16:
      return true;
    // The importance-matrix grid formats (dequantize_weights_iq.cuh).
    case TensorType::IQ2_XXS:
    case TensorType::IQ2_XS:
    case TensorType::IQ2_S:
    case TensorType::IQ3_XXS:
    case TensorType::IQ3_S:
    case TensorType::IQ1_S:
    case TensorType::IQ1_M:
      return true;
    default:
      return false;
  }
}

void dequantize_weights(TensorType weight, const void* const* weights, int count, int64_t elems, GemmInput out_type,
                        void* out, cudaStream_t stream) {
  const std::string where = " (weight " + std::string(type_name(weight)) + ", " + std::to_string(count) +
                            " matrices of " + std::to_string(elems) + " elements)";
  if (!dequantize_weights_supported(weight))
    throw std::invalid_argument("dequantize_weights: unsupported weight type" + where +
                                "; supported: q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, mxfp4, iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s, "
                                "iq1_s, iq1_m, f16, bf16, f32");
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
