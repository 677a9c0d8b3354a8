// The device decoders of every weight format the GPU reads as floats: one struct per format with
// kBytes per block, kSlices 32-element slices per block, and slice(block, k, y) writing elements
// 32k..32k+31 of the block into y with the float expressions of the scalar reference
// (common/formats/quant_legacy.cpp, kquant_reference.cpp, quant_iq.cpp): every float is
// dequantize_row's bit for bit. Blocks need only 2-byte alignment (4 for F32). Shared by the
// prefill GEMM's expansion (dequantize_weights.cu) and the embedding lookup (embed_rows.cu);
// with_block_decoder is the one list of formats both dispatch on.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/formats/block_layouts.h"
#include "common/formats/tensor_type.h"
#include "kernels/cuda/dequantize_weights_iq.cuh"

namespace moraine::cuda::dequant {

constexpr int kSliceElems = 32;

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

// Issue 26's formats, each as its CPU decoder (quant_legacy.cpp, quant_legacy_extra.cpp,
// quant_iq4_tq.cpp dequantize_*), left to right with _rn.
// Q4_0 / Q4_1 / Q5_0 / Q5_1: element j < 16 the low nibble of qs[j], j >= 16 the high one of
// qs[j - 16]; Q5's bit 4 is bit j of qh. kMin: x = q * d + m (else (q - kBias) * d).
template <int kQsOffset, int kQhOffset, bool kMin, int kBias, int kBlockBytes>
struct DequantLegacy {
  static constexpr int kBytes = kBlockBytes, kSlices = 1;
  __device__ static void slice(const uint8_t* b, int, float* y) {
    const float d = half_at(b);
    uint32_t qh = 0;
    if constexpr (kQhOffset >= 0)
      qh = static_cast<uint32_t>(b[kQhOffset]) | (static_cast<uint32_t>(b[kQhOffset + 1]) << 8) |
           (static_cast<uint32_t>(b[kQhOffset + 2]) << 16) | (static_cast<uint32_t>(b[kQhOffset + 3]) << 24);
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const uint8_t byte = b[kQsOffset + (j % 16)];
      int q = j < 16 ? (byte & 0x0f) : (byte >> 4);
      if constexpr (kQhOffset >= 0) q |= static_cast<int>((qh >> j) & 1u) << 4;
      if constexpr (kMin) {
        y[j] = __fadd_rn(__fmul_rn(static_cast<float>(q), d), half_at(b + 2));
      } else {
        y[j] = __fmul_rn(static_cast<float>(q - kBias), d);
      }
    }
  }
};
using DequantQ4_0 = DequantLegacy<2, -1, false, 8, sizeof(BlockQ4_0)>;
using DequantQ4_1 = DequantLegacy<4, -1, true, 0, sizeof(BlockQ4_1)>;
using DequantQ5_0 = DequantLegacy<6, 2, false, 16, sizeof(BlockQ5_0)>;
using DequantQ5_1 = DequantLegacy<8, 4, true, 0, sizeof(BlockQ5_1)>;

// IQ4_NL: d * grid[q]; IQ4_XS slice j = sub-block j: (d * (ls - 32)) * grid[q].
__device__ __forceinline__ float iq4_grid(int q) {
  constexpr int8_t kGrid[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};  // kIQ4NLValues
  return static_cast<float>(kGrid[q]);
}

struct DequantIQ4_NL {
  static constexpr int kBytes = sizeof(BlockIQ4_NL), kSlices = 1;
  __device__ static void slice(const uint8_t* b, int, float* y) {
    const float d = half_at(b);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      y[j] = __fmul_rn(d, iq4_grid(b[2 + j] & 0x0f));
      y[j + 16] = __fmul_rn(d, iq4_grid(b[2 + j] >> 4));
    }
  }
};

struct DequantIQ4_XS {
  static constexpr int kBytes = sizeof(BlockIQ4_XS), kSlices = 8;
  __device__ static void slice(const uint8_t* b, int k, float* y) {
    const float d = half_at(b);
    const int scales_h = b[2] | (b[3] << 8);
    const int ls = ((b[4 + k / 2] >> (4 * (k % 2))) & 0x0f) | (((scales_h >> (2 * k)) & 3) << 4);
    const float dl = __fmul_rn(d, static_cast<float>(ls - 32));
    const uint8_t* qs = b + 8 + 16 * k;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      y[j] = __fmul_rn(dl, iq4_grid(qs[j] & 0x0f));
      y[j + 16] = __fmul_rn(dl, iq4_grid(qs[j] >> 4));
    }
  }
};

// TQ1_0 slice k = elements 32k..32k+31 (matvec_formats_legacy.cuh's FormatTQ1_0 parts), trit n
// of a byte ((uint8_t)(byte * 3^n) * 3) >> 8; TQ2_0 slice k: bits 2(k%4) of qs[32(k/4) + m].
__device__ __forceinline__ int tq1_trit_at(uint8_t byte, int n) {
  constexpr uint8_t kPow3[5] = {1, 3, 9, 27, 81};
  return (static_cast<int>(static_cast<uint8_t>(byte * kPow3[n])) * 3) >> 8;
}

struct DequantTQ1_0 {
  static constexpr int kBytes = sizeof(BlockTQ1_0), kSlices = 8;
  __device__ static void slice(const uint8_t* b, int k, float* y) {
    const float d = half_at(b + 52);
#pragma unroll
    for (int m = 0; m < 32; ++m) {
      int t;
      if (k < 5) {
        t = tq1_trit_at(b[m], k);
      } else if (k < 7 || m < 16) {
        t = tq1_trit_at(b[32 + m % 16], 2 * (k - 5) + m / 16);
      } else {
        t = tq1_trit_at(b[48 + (m - 16) % 4], (m - 16) / 4);
      }
      y[m] = __fmul_rn(static_cast<float>(t - 1), d);
    }
  }
};

struct DequantTQ2_0 {
  static constexpr int kBytes = sizeof(BlockTQ2_0), kSlices = 8;
  __device__ static void slice(const uint8_t* b, int k, float* y) {
    const float d = half_at(b + 64);
    const int h = k / 4, l = k % 4;
#pragma unroll
    for (int m = 0; m < 32; ++m) y[m] = __fmul_rn(static_cast<float>(((b[32 * h + m] >> (2 * l)) & 3) - 1), d);
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

// Calls fn.template operator()<Decoder>() with the decoder of t and returns true, or returns
// false when the GPU has no decoder for t.
template <class Fn>
bool with_block_decoder(TensorType t, Fn&& fn) {
  switch (t) {
    case TensorType::Q8_0: fn.template operator()<DequantQ8_0>(); return true;
    case TensorType::MXFP4: fn.template operator()<DequantMXFP4>(); return true;
    case TensorType::Q2_K: fn.template operator()<DequantQ2_K>(); return true;
    case TensorType::Q3_K: fn.template operator()<DequantQ3_K>(); return true;
    case TensorType::Q4_K: fn.template operator()<DequantQ45_K<false>>(); return true;
    case TensorType::Q5_K: fn.template operator()<DequantQ45_K<true>>(); return true;
    case TensorType::Q6_K: fn.template operator()<DequantQ6_K>(); return true;
    case TensorType::F32: fn.template operator()<DequantPlain<TensorType::F32>>(); return true;
    case TensorType::F16: fn.template operator()<DequantPlain<TensorType::F16>>(); return true;
    case TensorType::BF16: fn.template operator()<DequantPlain<TensorType::BF16>>(); return true;
    case TensorType::Q4_0: fn.template operator()<DequantQ4_0>(); return true;
    case TensorType::Q4_1: fn.template operator()<DequantQ4_1>(); return true;
    case TensorType::Q5_0: fn.template operator()<DequantQ5_0>(); return true;
    case TensorType::Q5_1: fn.template operator()<DequantQ5_1>(); return true;
    case TensorType::IQ4_NL: fn.template operator()<DequantIQ4_NL>(); return true;
    case TensorType::IQ4_XS: fn.template operator()<DequantIQ4_XS>(); return true;
    case TensorType::TQ1_0: fn.template operator()<DequantTQ1_0>(); return true;
    case TensorType::TQ2_0: fn.template operator()<DequantTQ2_0>(); return true;
    // The importance-matrix grid formats (dequantize_weights_iq.cuh).
    case TensorType::IQ2_XXS: fn.template operator()<dequant_iq::DequantIQ2_XXS>(); return true;
    case TensorType::IQ2_XS: fn.template operator()<dequant_iq::DequantIQ2_XS>(); return true;
    case TensorType::IQ2_S: fn.template operator()<dequant_iq::DequantIQ2_S>(); return true;
    case TensorType::IQ3_XXS: fn.template operator()<dequant_iq::DequantIQ3_XXS>(); return true;
    case TensorType::IQ3_S: fn.template operator()<dequant_iq::DequantIQ3_S>(); return true;
    case TensorType::IQ1_S: fn.template operator()<dequant_iq::DequantIQ1_S>(); return true;
    case TensorType::IQ1_M: fn.template operator()<dequant_iq::DequantIQ1_M>(); return true;
    default: return false;
  }
}

}  // namespace moraine::cuda::dequant
