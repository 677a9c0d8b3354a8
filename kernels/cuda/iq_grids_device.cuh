// Device copies of the IQ codebooks (common/formats/iq_grids.h), made from the same generated
// iq_grids_data.inc as the host tables, so both hold the same values by construction.
//
// Global memory, read through the read-only cache (__ldg): lanes index different entries, which
// __constant__ would serialize. Why a header with internal linkage and not one .cu: the kernels
// library is built without relocatable device code, so a kernel can only name device data of its
// own translation unit; each .cu that instantiates an IQ format (matvec.cu, moe_fused.cu,
// moe_staged.cu, dequantize_weights.cu, the kernel bench) gets its own 33 KB copy, loaded with
// its module (as ggml-cuda does with ggml-common.h).
#pragma once
#include <cstdint>

namespace moraine::cuda::iq_device {

#define MORAINE_IQ_TABLE(type, name, count, ...) static __device__ const type name[count] = {__VA_ARGS__};
#include "common/formats/iq_grids_data.inc"
#undef MORAINE_IQ_TABLE

// Grid entry i of an 8-element codebook as two words (elements 0..3, 4..7, one byte each).
__device__ __forceinline__ uint2 grid8(const uint64_t* grid, int i) { return __ldg(reinterpret_cast<const uint2*>(grid) + i); }
// Entry i of a 4-element codebook (IQ3).
__device__ __forceinline__ uint32_t grid4(const uint32_t* grid, int i) { return __ldg(grid + i); }

}  // namespace moraine::cuda::iq_device
