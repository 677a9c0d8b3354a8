#include "kernels/cuda/embed_rows.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/dequantize_blocks.cuh"
#include "kernels/cuda/launch.h"

namespace moraine::cuda {
namespace {

// The block formats: grid (slice blocks, token), one thread per 32-element slice of the row,
// decoded by the format's block decoder (dequantize_blocks.cuh): dequantize_row's floats bit for bit.
template <class F>
__global__ void embed_rows_kernel(const uint8_t* __restrict__ table, size_t row_bytes, int64_t slices,
                                  const int32_t* __restrict__ ids, float* __restrict__ out) {
  wait_for_prior_grids();   // PDL (launch.h): before any global access
  allow_dependent_grids();
  const int64_t t = blockIdx.y;
  const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= slices) return;
  const uint8_t* block = table + static_cast<size_t>(ids[t]) * row_bytes + (s / F::kSlices) * F::kBytes;
  float y[dequant::kSliceElems];
  F::slice(block, static_cast<int>(s % F::kSlices), y);
  float* dst = out + (t * slices + s) * dequant::kSliceElems;
#pragma unroll
  for (int l = 0; l < dequant::kSliceElems; ++l) dst[l] = y[l];
}

// The plain types, any width: one thread per element.
__device__ __forceinline__ uint16_t load_u16(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (p[1] << 8));  // little-endian, any alignment
}

__global__ void embed_plain_rows_kernel(TensorType type, const uint8_t* __restrict__ table, size_t row_bytes,
                                        int64_t n_cols, const int32_t* __restrict__ ids, float* __restrict__ out) {
  wait_for_prior_grids();
  allow_dependent_grids();
  const int64_t t = blockIdx.y;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_cols) return;
  const uint8_t* row = table + static_cast<size_t>(ids[t]) * row_bytes;
  float v;
  if (type == TensorType::F32) {
    const uint8_t* p = row + 4 * i;
    v = __uint_as_float(static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                        (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24));
  } else if (type == TensorType::F16) {
    v = __half2float(__ushort_as_half(load_u16(row + 2 * i)));
  } else {
    v = __bfloat162float(__ushort_as_bfloat16(load_u16(row + 2 * i)));
  }
  out[t * n_cols + i] = v;
}

bool plain(TensorType t) { return t == TensorType::F32 || t == TensorType::F16 || t == TensorType::BF16; }

}  // namespace

bool embed_rows_supported(TensorType t) {
  return dequant::with_block_decoder(t, []<class F>() {});
}

void embed_rows(TensorType t, const void* table, size_t row_bytes, int64_t n_cols, const int32_t* ids, int64_t n,
                float* out, cudaStream_t stream) {
  if (!embed_rows_supported(t))
    throw std::invalid_argument("embed_rows: no CUDA decoder for " + std::string(type_name(t)));
  const int64_t block = type_traits(t).block_elems;
  if (n > 0 && n <= 65535 && n_cols > 0 && plain(t)) {
    constexpr int kThreads = 256;
    const dim3 grid(static_cast<unsigned>((n_cols + kThreads - 1) / kThreads), static_cast<unsigned>(n));
    launch_kernel(embed_plain_rows_kernel, grid, dim3(kThreads), 0, stream, t, static_cast<const uint8_t*>(table), row_bytes,
                  n_cols, ids, out);
    return;
  }
  if (n_cols <= 0 || n_cols % block != 0 || n_cols % dequant::kSliceElems != 0 || n <= 0 || n > 65535)
    throw std::invalid_argument("embed_rows: n_cols=" + std::to_string(n_cols) + ", n=" + std::to_string(n) + " (" +
                                std::string(type_name(t)) + ": n_cols a positive multiple of " + std::to_string(block) +
                                " and of 32, n in 1..65535)");
  constexpr int kThreads = 128;
  const int64_t slices = n_cols / dequant::kSliceElems;
  const dim3 grid(static_cast<unsigned>((slices + kThreads - 1) / kThreads), static_cast<unsigned>(n));
  dequant::with_block_decoder(t, [&]<class F>() {
    launch_kernel(embed_rows_kernel<F>, grid, dim3(kThreads), 0, stream, static_cast<const uint8_t*>(table), row_bytes,
                  slices, ids, out);
  });
}

}  // namespace moraine::cuda
