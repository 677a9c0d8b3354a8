// Grouped expert GEMM (expert_gemm.h). Both operands are K-contiguous ("TN"): W_g is rows x cols
// row-major, X is tokens x cols row-major, so mma's A (M x K, row) is a W tile and its B (K x N,
// col) is an X tile, and ldmatrix without .trans reads both from shared memory.
//
// Fragment maps (PTX ISA, mma.m16n8k16 with 16-bit A/B, F32 C), g = lane / 4, t = lane % 4:
//   A regs a0..a3: (row g, k 2t..2t+1), (row g+8, k 2t..), (row g, k 2t+8..), (row g+8, k 2t+8..)
//   B regs b0, b1: (k 2t..2t+1, n g), (k 2t+8.., n g)
//   C c0..c3:      (row g, n 2t), (row g, n 2t+1), (row g+8, n 2t), (row g+8, n 2t+1)
// ldmatrix.x4 gives register i the 8x8 matrix whose 8 row addresses lanes 8i..8i+7 supplied, lane
// holding (row lane/4, cols 2(lane%4)..+1); so lane l points at A row (l % 16), k (l / 16) * 8
// (matrices: rows 0-7 k 0-7, rows 8-15 k 0-7, rows 0-7 k 8-15, rows 8-15 k 8-15 = a0..a3), and
// for two n8 tiles of B at token (l % 8) + (l / 16) * 8, k ((l / 8) % 2) * 8 (matrices: n 0-7 k
// 0-7, n 0-7 k 8-15, n 8-15 k 0-7, n 8-15 k 8-15 = b0, b1 of the first tile, b0, b1 of the second).
#include "kernels/cuda/expert_gemm.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gemm_input_round.cuh"
#include "kernels/cuda/matvec_formats.cuh"
#include "kernels/cuda/mma_ptx.cuh"

namespace moraine::cuda {
namespace {

using namespace ptx;

constexpr int kTileK = 32;             // K per stage: 64 bytes of each tile row
constexpr int kSmemStride = kTileK + 8;  // 80-byte rows: the 8 rows of an ldmatrix hit 8 distinct bank quads
constexpr int kStages = 3;             // cp.async pipeline depth (two tiles in flight while one is used)

template <GemmInput T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (T == GemmInput::BF16) mma_bf16(c, a, b0, b1);
  else mma_f16(c, a, b0, b1);
}

// One k16 step of a warp's kMt x kNt block of m16n8 tiles: A from a_lane (this lane's ldmatrix
// row address, k already added), B from b_lane, both with row strides in elements.
template <GemmInput T, int kMt, int kNt>
__device__ __forceinline__ void warp_mma_k16(float (&acc)[kMt][kNt][4], const uint16_t* a_lane, int a_stride,
                                             const uint16_t* b_lane, int b_stride) {
  unsigned a[kMt][4];
#pragma unroll
  for (int i = 0; i < kMt; ++i) ldmatrix_x4(a[i], a_lane + i * 16 * a_stride);
  unsigned b[kNt][2];
#pragma unroll
  for (int j = 0; j < kNt; j += 2) {
    unsigned r[4];
    ldmatrix_x4(r, b_lane + j * 8 * b_stride);
    b[j][0] = r[0];
    b[j][1] = r[1];
    b[j + 1][0] = r[2];
    b[j + 1][1] = r[3];
  }
#pragma unroll
  for (int i = 0; i < kMt; ++i)
#pragma unroll
    for (int j = 0; j < kNt; ++j) mma_16816<T>(acc[i][j], a[i], b[j][0], b[j][1]);
}

// The C fragments of a warp into Y: (row g / g+8, tokens 2t, 2t+1). Eight lanes of one t write 8
// consecutive floats of one Y row: whole 32-byte sectors.
template <int kMt, int kNt>
__device__ __forceinline__ void store_warp_tile(const float (&acc)[kMt][kNt][4], float* yt, int64_t ldy, int warp_row,
                                                int warp_token, int m_valid, int n_valid, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < kMt; ++i)
#pragma unroll
    for (int j = 0; j < kNt; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int r = warp_row + i * 16 + g + (q / 2) * 8;
        const int n = warp_token + j * 8 + 2 * t + q % 2;
        if (r < m_valid && n < n_valid) yt[static_cast<int64_t>(n) * ldy + r] = acc[i][j][q];
      }
}

// Copies rows x (kChunks 16-byte pieces) of a K-contiguous operand into a shared tile with row
// stride `stride` elements; rows at or past `valid` are zero-filled.
template <int kRows, int kChunks, int kThreads>
__device__ __forceinline__ void load_rows(uint16_t* dst, int stride, const uint16_t* src, int64_t src_stride, int k0,
                                          int valid) {
#pragma unroll
  for (int c = static_cast<int>(threadIdx.x); c < kRows * kChunks; c += kThreads) {
    const int r = c / kChunks, kc = (c % kChunks) * 8;
    const bool ok = r < valid;
    copy_16_or_zero(dst + r * stride + kc, ok ? src + r * src_stride + k0 + kc : src, ok);
  }
}

// BM weight rows x BN tokens per CTA, WM x WN warps; weights already 16-bit in the workspace.
template <GemmInput T, int BM, int BN, int WM, int WN>
__global__ void __launch_bounds__(WM* WN * 32)
    expert_gemm_kernel(const uint16_t* __restrict__ weights, int64_t slot_stride, int rows, int cols,
                       const uint16_t* __restrict__ x, const ExpertGemmTile* __restrict__ tiles, float* __restrict__ y,
                       int64_t ldy) {
  constexpr int kThreads = WM * WN * 32;
  constexpr int kWarpRows = BM / WM, kWarpTokens = BN / WN;
  constexpr int kMt = kWarpRows / 16, kNt = kWarpTokens / 8;
  static_assert(kWarpRows % 16 == 0 && kWarpTokens % 16 == 0, "warp tile: m16 blocks, pairs of n8 blocks");
  extern __shared__ __align__(128) uint8_t smem[];
  uint16_t* sa = reinterpret_cast<uint16_t*>(smem);  // [kStages][BM * kSmemStride]
  uint16_t* sb = sa + kStages * BM * kSmemStride;     // [kStages][BN * kSmemStride]

  const ExpertGemmTile tile = tiles[blockIdx.x];
  const int row0 = static_cast<int>(blockIdx.y) * BM;
  const int m_valid = min(BM, rows - row0);
  const uint16_t* wa = weights + static_cast<int64_t>(tile.slot) * slot_stride + static_cast<int64_t>(row0) * cols;
  const uint16_t* xb = x + static_cast<int64_t>(tile.x_row) * cols;
  const auto load_stage = [&](int stage, int k0) {
    load_rows<BM, kTileK / 8, kThreads>(sa + stage * BM * kSmemStride, kSmemStride, wa, cols, k0, m_valid);
    load_rows<BN, kTileK / 8, kThreads>(sb + stage * BN * kSmemStride, kSmemStride, xb, cols, k0, tile.count);
  };

  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int warp_row = (warp % WM) * kWarpRows, warp_token = (warp / WM) * kWarpTokens;
  float acc[kMt][kNt][4] = {};
  const int k_tiles = cols / kTileK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s * kTileK);
    commit_group();
  }
  // This lane's ldmatrix row addresses within a stage (see the file comment).
  const int a_off = (warp_row + lane % 16) * kSmemStride + (lane / 16) * 8;
  const int b_off = (warp_token + lane % 8 + (lane / 16) * 8) * kSmemStride + ((lane / 8) % 2) * 8;
  for (int kt = 0; kt < k_tiles; ++kt) {
    // Groups committed so far: kStages - 1 + kt; all but the newest kStages - 2 done = tile kt.
    wait_group<kStages - 2>();
    __syncthreads();  // tile kt visible to all; every warp is past tile kt - 1, whose stage is refilled next
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_stage(next % kStages, next * kTileK);
    commit_group();
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16)
      warp_mma_k16<T>(acc, sa + (kt % kStages) * BM * kSmemStride + a_off + kk, kSmemStride,
                      sb + (kt % kStages) * BN * kSmemStride + b_off + kk, kSmemStride);
  }
  wait_group<0>();  // no copy may still target shared memory when the CTA exits
  store_warp_tile(acc, y + static_cast<int64_t>(tile.x_row) * ldy + row0, ldy, warp_row, warp_token, m_valid,
                  tile.count, lane);
}

// The same product with Q4_K weights decoded inside the kernel (no expansion pass): per stage of
// 64 K, each weight row's 16-byte block header (d, dmin, packed scales) and the 32 quant bytes of
// sub-blocks 2p, 2p+1 go to shared memory by cp.async; after the barrier each thread decodes one
// row's 32-element sub-block to dequantize_weights' float values (its __fmul_rn / __fsub_rn
// expressions, reached with fewer instructions: q4k_weight; round to nearest even, two elements
// per conversion), so the A tile holds exactly the expanded path's 16-bit values and the
// mma sequence (k16 steps in K order) is the same: the result equals the expanded path's bit
// for bit. weight_of[slot] is the slot's Q4_K matrix (rows x cols, 16-byte aligned).
// Measured (session 10 run B, ncu, H200, 128 x (768 x 2048), 32 tokens per expert, small
// tiles): 157.5 us with an int -> float and a float -> 16-bit conversion per weight, 113.7 us
// with this decode. What bounds it now is L2 (77% busy, DRAM 29%): every row tile re-reads its
// group's X, and ncu counts 38% of the L2 sectors as excess (the 16-byte header and quant
// pieces of rows 1152 bytes apart).
constexpr int kQ4TileK = 64;
constexpr int kQ4RawBytes = 48;  // header 16 + quants 32 per row and stage
constexpr int kQ4Stride = kQ4TileK + 8;  // 144-byte rows: conflict-free ldmatrix

// float(v) for v < 2^23 without the int -> float conversion instruction: 2^23 + v has v in its
// mantissa bits exactly, and subtracting 2^23 is exact. Same value as static_cast<float>(v).
__device__ __forceinline__ float small_int_as_float(unsigned v) {
  return __fsub_rn(__uint_as_float(0x4b000000u | v), 8388608.0f);
}
// float(byte e of `bytes`) (bytes holds values < 16 here) with one byte permute: 0x4b0000XX.
__device__ __forceinline__ float nibble_as_float(unsigned bytes, int e) {
  return __fsub_rn(__uint_as_float(__byte_perm(bytes, 0x4b000000u, 0x7440u | static_cast<unsigned>(e))), 8388608.0f);
}
// dequantize_weights' __fsub_rn(__fmul_rn(dl, q), ml) as one fma, bit for bit: dl = d * sc is
// exact in float (11-bit fp16 significand times a 6-bit scale), so dl * q (q < 16) has at most 21
// significant bits and is exact too; fma's single rounding of dl * q - ml is then the rounding
// of the subtraction alone.
__device__ __forceinline__ float q4k_weight(float dl, float ml, float q) { return __fmaf_rn(dl, q, -ml); }

template <int BM, int BN>
constexpr int q4k_smem_bytes() {
  return kStages * (BM * kQ4RawBytes + BN * kQ4Stride * 2) + BM * kQ4Stride * 2;
}

// (Measured and dropped, session 10 run B: an "overlapped" schedule with two A tiles, K tile
// kt + 1 decoded while tile kt is multiplied, one barrier a tile. Its extra A tile cut the CTAs
// per SM (Small: 5 instead of 7) and it ran slower: pp512 uniform 128 x (768 x 2048) 148.9 vs
// 136.7 us, R = 64 193.5 vs 177.6; at pp8192 within +-4%.)
template <GemmInput T, int BM, int BN, int WM, int WN>
__global__ void __launch_bounds__(WM* WN * 32)
    expert_gemm_q4k_kernel(const uint8_t* const* __restrict__ weight_of, int rows, int cols,
                           const uint16_t* __restrict__ x, const ExpertGemmTile* __restrict__ tiles,
                           float* __restrict__ y, int64_t ldy) {
  constexpr int kThreads = WM * WN * 32;
  constexpr int kWarpRows = BM / WM, kWarpTokens = BN / WN;
  constexpr int kMt = kWarpRows / 16, kNt = kWarpTokens / 8;
  static_assert(kWarpRows % 16 == 0 && kWarpTokens % 16 == 0, "warp tile: m16 blocks, pairs of n8 blocks");
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* raw = smem;                                                          // [kStages][BM][48]
  uint16_t* sb = reinterpret_cast<uint16_t*>(smem + kStages * BM * kQ4RawBytes);  // [kStages][BN][kQ4Stride]
  uint16_t* sa = sb + kStages * BN * kQ4Stride;                                  // [BM][kQ4Stride]

  const ExpertGemmTile tile = tiles[blockIdx.x];
  const int row0 = static_cast<int>(blockIdx.y) * BM;
  const int m_valid = min(BM, rows - row0);
  const int64_t row_bytes = static_cast<int64_t>(cols / 256) * 144;
  const uint8_t* wq = weight_of[tile.slot] + static_cast<int64_t>(row0) * row_bytes;
  const uint16_t* xb = x + static_cast<int64_t>(tile.x_row) * cols;
  // This thread's cp.async pieces are the same every stage up to an offset in K, so their source
  // pointers and destinations are worked out once (not per stage: division by 3, 64-bit row
  // products). Raw piece c = (row c / 3, piece c % 3): the header, or quant bytes 0-15 / 16-31
  // of the stage's sub-block pair; X piece c = (token c / 8, 8 elements at (c % 8) * 8).
  constexpr int kRawPieces = BM * 3, kXPieces = BN * kQ4TileK / 8;
  constexpr int kRawCopies = (kRawPieces + kThreads - 1) / kThreads, kXCopies = (kXPieces + kThreads - 1) / kThreads;
  const uint8_t* raw_src[kRawCopies];
  int raw_dst[kRawCopies], raw_quant[kRawCopies];  // byte offset in a stage; 1 for a quant piece
  bool raw_ok[kRawCopies];
#pragma unroll
  for (int i = 0; i < kRawCopies; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * kThreads, r = c / 3, piece = c % 3;
    raw_ok[i] = c < kRawPieces && r < m_valid;
    raw_src[i] = raw_ok[i] ? wq + static_cast<int64_t>(r) * row_bytes + (piece == 0 ? 0 : 16 * (piece - 1)) : wq;
    raw_dst[i] = r * kQ4RawBytes + 16 * piece;
    raw_quant[i] = piece == 0 ? 0 : 1;
  }
  const uint16_t* x_src[kXCopies];
  int x_dst[kXCopies];
  bool x_ok[kXCopies];
#pragma unroll
  for (int i = 0; i < kXCopies; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * kThreads, r = c / 8, kc = (c % 8) * 8;
    x_ok[i] = c < kXPieces && r < tile.count;
    x_src[i] = x_ok[i] ? xb + static_cast<int64_t>(r) * cols + kc : xb;
    x_dst[i] = r * kQ4Stride + kc;
  }
  const auto load_stage = [&](int stage, int kt) {
    const int64_t block = static_cast<int64_t>(kt / 4) * 144;  // super-block of K tile kt, quants 32p..32p+31
    const int quants = 16 + 32 * (kt % 4);
#pragma unroll
    for (int i = 0; i < kRawCopies; ++i) {
      if (kRawPieces % kThreads != 0 && static_cast<int>(threadIdx.x) + i * kThreads >= kRawPieces) continue;
      copy_16_or_zero(raw + stage * BM * kQ4RawBytes + raw_dst[i],
                      raw_ok[i] ? raw_src[i] + block + raw_quant[i] * quants : wq, raw_ok[i]);
    }
#pragma unroll
    for (int i = 0; i < kXCopies; ++i) {
      if (kXPieces % kThreads != 0 && static_cast<int>(threadIdx.x) + i * kThreads >= kXPieces) continue;
      copy_16_or_zero(sb + stage * BN * kQ4Stride + x_dst[i], x_ok[i] ? x_src[i] + kt * kQ4TileK : xb, x_ok[i]);
    }
  };

  // Decodes K tile kt (raw stage kt % kStages) into the A tile at a: task (row r, half h) =
  // sub-block j = 2p + h of the row, 32 elements.
  const auto decode = [&](int kt, uint16_t* a) {
    const int p = kt % 4;
#pragma unroll
    for (int task = static_cast<int>(threadIdx.x); task < BM * 2; task += kThreads) {
      const int r = task / 2, h = task % 2, j = 2 * p + h;
      const uint8_t* b = raw + ((kt % kStages) * BM + r) * kQ4RawBytes;
      const float d = __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(b)));
      const float dmin = __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(b + 2)));
      const uint8_t* packed = b + 4;
      int sc, m;
      matvec_detail::scale_min_k4(packed, j, sc, m);
      const float dl = __fmul_rn(d, small_int_as_float(static_cast<unsigned>(sc)));
      const float ml = __fmul_rn(dmin, small_int_as_float(static_cast<unsigned>(m)));
      const uint4* qv = reinterpret_cast<const uint4*>(b + 16);
      uint4* dst = reinterpret_cast<uint4*>(a + r * kQ4Stride + 32 * h);
#pragma unroll
      for (int v = 0; v < 2; ++v) {  // 16 quant bytes -> 16 elements -> two 16-byte stores
        const uint4 w = qv[v];
        const unsigned words[4] = {w.x, w.y, w.z, w.w};
        unsigned out[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const unsigned nibbles = (words[i] >> (4 * h)) & 0x0f0f0f0fu;  // element 4i + e in byte e
          float f[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) f[e] = q4k_weight(dl, ml, nibble_as_float(nibbles, e));
          out[2 * i] = round_pair_to_gemm_input<T>(f[0], f[1]);
          out[2 * i + 1] = round_pair_to_gemm_input<T>(f[2], f[3]);
        }
        dst[2 * v] = make_uint4(out[0], out[1], out[2], out[3]);
        dst[2 * v + 1] = make_uint4(out[4], out[5], out[6], out[7]);
      }
    }
  };

  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int warp_row = (warp % WM) * kWarpRows, warp_token = (warp / WM) * kWarpTokens;
  float acc[kMt][kNt][4] = {};
  const int k_tiles = cols / kQ4TileK;
  const int a_off = (warp_row + lane % 16) * kQ4Stride + (lane / 16) * 8;
  const int b_off = (warp_token + lane % 8 + (lane / 16) * 8) * kQ4Stride + ((lane / 8) % 2) * 8;
  const auto multiply = [&](int kt, const uint16_t* a) {
    const uint16_t* sb_s = sb + (kt % kStages) * BN * kQ4Stride;
#pragma unroll
    for (int kk = 0; kk < kQ4TileK; kk += 16)
      warp_mma_k16<T>(acc, a + a_off + kk, kQ4Stride, sb_s + b_off + kk, kQ4Stride);
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    commit_group();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    wait_group<kStages - 2>();
    __syncthreads();  // raw and X of tile kt visible; every warp is done with sa and with stage kt - 1
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_stage(next % kStages, next);
    commit_group();
    decode(kt, sa);
    __syncthreads();  // the decoded A tile complete
    multiply(kt, sa);
  }
  wait_group<0>();
  store_warp_tile(acc, y + static_cast<int64_t>(tile.x_row) * ldy + row0, ldy, warp_row, warp_token, m_valid,
                  tile.count, lane);
}

// The same with Q6_K weights (210-byte super-blocks of 256: ql[128] low nibbles, qh[64] high bit
// pairs, int8 scales[16] one per 16 elements, fp16 d; element 128h + 32s + l has low nibble
// ql[64h + 32(s % 2) + l] >> 4(s / 2), high bits qh[32h + l] >> 2s, scale scales[8h + 2s + l / 16]).
// Super-blocks are 210 bytes, so rows and blocks are only 2-byte aligned and cp.async (16-byte
// aligned sources) cannot fetch a block's fields: each row's whole super-block is fetched as the
// 14 aligned 16-byte pieces around it (src-size clipped to the block's last byte, so nothing past
// it is read), into one of two raw buffers (super-block b in buffer b % 2, issued with the X of
// K tile 4b, so it arrives with that tile; buffer b % 2 was last read by tile 4b - 5). The decode
// finds the block at its address's offset mod 16 in the window and reads its words by funnel
// shifts. Values: dequantize_weights' __fmul_rn(d * sc, float(q - 32)), float(q - 32) reached
// as (2^23 + q) - (2^23 + 32), exact (both within [2^23, 2^24), the difference an integer);
// d * sc is the same exact product: the same bits. Why: the expanded path writes and re-reads
// the layer's 16-bit weights; the q6_k 2048 x 768 down took 494 us vs q4_k's fused 129 us at
// pp512 (session 10 run B).
constexpr int kQ6BlockBytes = 210;
constexpr int kQ6Pieces = 14;  // 16-byte pieces covering a block at any even offset (14 + 210 <= 224)
constexpr int kQ6Window = kQ6Pieces * 16;

template <int BM, int BN>
constexpr int q6k_smem_bytes() {
  return 2 * BM * kQ6Window + kStages * BN * kQ4Stride * 2 + BM * kQ4Stride * 2;
}

// cp.async of the first `bytes` (0..16) of an aligned 16-byte piece; the rest of dst zero-filled.
__device__ __forceinline__ void copy_16_prefix(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes)
               : "memory");
}

// The 32-bit word at shared byte offset `at` (even) of a raw window, from the two aligned words
// around it.
__device__ __forceinline__ unsigned word_at(const uint8_t* window, int at) {
  const unsigned* w = reinterpret_cast<const unsigned*>(window + (at & ~3));
  return __funnelshift_r(w[0], w[1], 8 * (at & 3));
}

template <GemmInput T, int BM, int BN, int WM, int WN>
__global__ void __launch_bounds__(WM* WN * 32)
    expert_gemm_q6k_kernel(const uint8_t* const* __restrict__ weight_of, int rows, int cols,
                           const uint16_t* __restrict__ x, const ExpertGemmTile* __restrict__ tiles,
                           float* __restrict__ y, int64_t ldy) {
  constexpr int kThreads = WM * WN * 32;
  constexpr int kWarpRows = BM / WM, kWarpTokens = BN / WN;
  constexpr int kMt = kWarpRows / 16, kNt = kWarpTokens / 8;
  static_assert(kWarpRows % 16 == 0 && kWarpTokens % 16 == 0, "warp tile: m16 blocks, pairs of n8 blocks");
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* raw = smem;                                                          // [2][BM][kQ6Window]
  uint16_t* sb = reinterpret_cast<uint16_t*>(smem + 2 * BM * kQ6Window);         // [kStages][BN][kQ4Stride]
  uint16_t* sa = sb + kStages * BN * kQ4Stride;                                  // [BM][kQ4Stride]

  const ExpertGemmTile tile = tiles[blockIdx.x];
  const int row0 = static_cast<int>(blockIdx.y) * BM;
  const int m_valid = min(BM, rows - row0);
  const int64_t row_bytes = static_cast<int64_t>(cols / 256) * kQ6BlockBytes;
  const uint8_t* wq = weight_of[tile.slot] + static_cast<int64_t>(row0) * row_bytes;
  const uint16_t* xb = x + static_cast<int64_t>(tile.x_row) * cols;
  // Raw piece c = (row c / 14, piece c % 14) of a super-block window; X piece as the Q4_K kernel's.
  constexpr int kRawPieces = BM * kQ6Pieces, kXPieces = BN * kQ4TileK / 8;
  constexpr int kRawCopies = (kRawPieces + kThreads - 1) / kThreads, kXCopies = (kXPieces + kThreads - 1) / kThreads;
  const uint8_t* raw_row[kRawCopies];  // the row's first byte
  int raw_dst[kRawCopies], raw_piece[kRawCopies];
  bool raw_ok[kRawCopies];
#pragma unroll
  for (int i = 0; i < kRawCopies; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * kThreads, r = c / kQ6Pieces;
    raw_ok[i] = c < kRawPieces && r < m_valid;
    raw_row[i] = raw_ok[i] ? wq + static_cast<int64_t>(r) * row_bytes : wq;
    raw_piece[i] = c % kQ6Pieces;
    raw_dst[i] = c * 16;  // = r * kQ6Window + 16 * piece
  }
  const uint16_t* x_src[kXCopies];
  int x_dst[kXCopies];
  bool x_ok[kXCopies];
#pragma unroll
  for (int i = 0; i < kXCopies; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * kThreads, r = c / 8, kc = (c % 8) * 8;
    x_ok[i] = c < kXPieces && r < tile.count;
    x_src[i] = x_ok[i] ? xb + static_cast<int64_t>(r) * cols + kc : xb;
    x_dst[i] = r * kQ4Stride + kc;
  }
  const auto load_stage = [&](int stage, int kt) {
    if (kt % 4 == 0) {  // the super-block of tiles kt..kt+3
      const int b = kt / 4;
#pragma unroll
      for (int i = 0; i < kRawCopies; ++i) {
        if (kRawPieces % kThreads != 0 && static_cast<int>(threadIdx.x) + i * kThreads >= kRawPieces) continue;
        const uintptr_t block = reinterpret_cast<uintptr_t>(raw_row[i]) + static_cast<uintptr_t>(b) * kQ6BlockBytes;
        const int off = static_cast<int>(block & 15), at = 16 * raw_piece[i];
        const int bytes = raw_ok[i] ? min(16, off + kQ6BlockBytes - at) : 0;  // >= 2 when ok
        copy_16_prefix(raw + (b % 2) * BM * kQ6Window + raw_dst[i],
                       raw_ok[i] ? reinterpret_cast<const void*>((block & ~uintptr_t{15}) + at) : wq, bytes);
      }
    }
#pragma unroll
    for (int i = 0; i < kXCopies; ++i) {
      if (kXPieces % kThreads != 0 && static_cast<int>(threadIdx.x) + i * kThreads >= kXPieces) continue;
      copy_16_or_zero(sb + stage * BN * kQ4Stride + x_dst[i], x_ok[i] ? x_src[i] + kt * kQ4TileK : xb, x_ok[i]);
    }
  };

  // Decodes K tile kt (64 elements 64p.. of super-block kt / 4: h = p / 2, s = 2(p % 2) + t for
  // the task's half t) into the A tile: task (row r, half t), 32 elements.
  const auto decode = [&](int kt, uint16_t* a) {
    const int b = kt / 4, p = kt % 4, h = p / 2;
#pragma unroll
    for (int task = static_cast<int>(threadIdx.x); task < BM * 2; task += kThreads) {
      const int r = task / 2, t = task % 2, s = 2 * (p % 2) + t;
      const uint8_t* window = raw + ((b % 2) * BM + r) * kQ6Window;
      const int off = static_cast<int>((reinterpret_cast<uintptr_t>(wq) + static_cast<uintptr_t>(r) * row_bytes +
                                        static_cast<uintptr_t>(b) * kQ6BlockBytes) & 15);
      const float d = __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(window + off + 208)));
      const unsigned scales = *reinterpret_cast<const unsigned short*>(window + off + 192 + 8 * h + 2 * s);
      const float dl[2] = {__fmul_rn(d, static_cast<float>(static_cast<int8_t>(scales & 0xff))),
                           __fmul_rn(d, static_cast<float>(static_cast<int8_t>(scales >> 8)))};
      const int ql_at = off + 64 * h + 32 * t, qh_at = off + 128 + 32 * h;
      uint4* dst = reinterpret_cast<uint4*>(a + r * kQ4Stride + 32 * t);
#pragma unroll
      for (int v = 0; v < 4; ++v) {  // 8 elements 8v..8v+7 -> one 16-byte store
        unsigned out[4];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int word = 2 * v + i;  // elements 4 word .. 4 word + 3
          const unsigned lo = (word_at(window, ql_at + 4 * word) >> (4 * (s / 2))) & 0x0f0f0f0fu;
          const unsigned hi = ((word_at(window, qh_at + 4 * word) >> (2 * s)) & 0x03030303u) << 4;
          const unsigned q = lo | hi;  // element 4 word + e in byte e, 0..63
          float f[4];
#pragma unroll
          for (int e = 0; e < 4; ++e)
            f[e] = __fmul_rn(dl[word / 4],
                             __fsub_rn(__uint_as_float(__byte_perm(q, 0x4b000000u, 0x7440u | static_cast<unsigned>(e))),
                                       8388640.0f));
          out[2 * i] = round_pair_to_gemm_input<T>(f[0], f[1]);
          out[2 * i + 1] = round_pair_to_gemm_input<T>(f[2], f[3]);
        }
        dst[v] = make_uint4(out[0], out[1], out[2], out[3]);
      }
    }
  };

  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int warp_row = (warp % WM) * kWarpRows, warp_token = (warp / WM) * kWarpTokens;
  float acc[kMt][kNt][4] = {};
  const int k_tiles = cols / kQ4TileK;
  const int a_off = (warp_row + lane % 16) * kQ4Stride + (lane / 16) * 8;
  const int b_off = (warp_token + lane % 8 + (lane / 16) * 8) * kQ4Stride + ((lane / 8) % 2) * 8;
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < k_tiles) load_stage(st, st);
    commit_group();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    wait_group<kStages - 2>();
    __syncthreads();  // X of tile kt (and its super-block) visible; every warp is done with sa and stage kt - 1
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_stage(next % kStages, next);
    commit_group();
    decode(kt, sa);
    __syncthreads();  // the decoded A tile complete
    const uint16_t* sb_s = sb + (kt % kStages) * BN * kQ4Stride;
#pragma unroll
    for (int kk = 0; kk < kQ4TileK; kk += 16)
      warp_mma_k16<T>(acc, sa + a_off + kk, kQ4Stride, sb_s + b_off + kk, kQ4Stride);
  }
  wait_group<0>();
  store_warp_tile(acc, y + static_cast<int64_t>(tile.x_row) * ldy + row0, ldy, warp_row, warp_token, m_valid,
                  tile.count, lane);
}

// Launches with `bytes` of dynamic shared memory; above the 48 KiB default a kernel must opt in.
// The opt-in is set on every launch (a host call, no GPU work): a function-local static in a
// helper templated on the kernel's type is shared by every kernel of one signature and opted in
// only the first (session 9 run C's cudaErrorInvalidValue), and the attribute is per device.
template <class Kernel, class... Args>
void launch_with_smem(Kernel* kernel, int bytes, dim3 grid, int threads, cudaStream_t stream, Args... args) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  kernel<<<grid, threads, bytes, stream>>>(args...);
  CUDA_CHECK(cudaGetLastError());
}

template <GemmInput T, int BM, int BN, int WM, int WN>
void launch_shape(const void* weights, int64_t slot_stride, int64_t rows, int64_t cols, const void* x,
                  const ExpertGemmTile* tiles, int n_tiles, float* y, int64_t ldy, cudaStream_t stream) {
  constexpr int kBytes = kStages * (BM + BN) * kSmemStride * 2;
  const dim3 grid(static_cast<unsigned>(n_tiles), static_cast<unsigned>((rows + BM - 1) / BM));
  launch_with_smem(expert_gemm_kernel<T, BM, BN, WM, WN>, kBytes, grid, WM * WN * 32, stream,
                   static_cast<const uint16_t*>(weights), slot_stride, static_cast<int>(rows), static_cast<int>(cols),
                   static_cast<const uint16_t*>(x), tiles, y, ldy);
}

template <GemmInput T>
void launch(ExpertTiles shape, const void* weights, int64_t slot_stride, int64_t rows, int64_t cols, const void* x,
            const ExpertGemmTile* tiles, int n_tiles, float* y, int64_t ldy, cudaStream_t stream) {
  switch (shape) {
    case ExpertTiles::Wide:
      return launch_shape<T, 128, 128, 2, 2>(weights, slot_stride, rows, cols, x, tiles, n_tiles, y, ldy, stream);
    case ExpertTiles::Large:
      return launch_shape<T, 128, 64, 4, 2>(weights, slot_stride, rows, cols, x, tiles, n_tiles, y, ldy, stream);
    case ExpertTiles::Small:
      return launch_shape<T, 64, 32, 2, 2>(weights, slot_stride, rows, cols, x, tiles, n_tiles, y, ldy, stream);
    case ExpertTiles::Tall:
      return launch_shape<T, 128, 32, 4, 2>(weights, slot_stride, rows, cols, x, tiles, n_tiles, y, ldy, stream);
  }
}

// The fused kernels by weight type (q6_k or q4_k decoded in the tile loads) and tile shape.
template <GemmInput T, bool kQ6, int BM, int BN, int WM, int WN>
void launch_fused_shape(const void* const* weight_of, int64_t rows, int64_t cols, const void* x,
                        const ExpertGemmTile* tiles, int n_tiles, float* y, int64_t ldy, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(n_tiles), static_cast<unsigned>((rows + BM - 1) / BM));
  const auto* w = reinterpret_cast<const uint8_t* const*>(weight_of);
  const auto* xh = static_cast<const uint16_t*>(x);
  if constexpr (kQ6) {
    launch_with_smem(expert_gemm_q6k_kernel<T, BM, BN, WM, WN>, q6k_smem_bytes<BM, BN>(), grid, WM * WN * 32, stream, w,
                     static_cast<int>(rows), static_cast<int>(cols), xh, tiles, y, ldy);
  } else {
    launch_with_smem(expert_gemm_q4k_kernel<T, BM, BN, WM, WN>, q4k_smem_bytes<BM, BN>(), grid, WM * WN * 32, stream, w,
                     static_cast<int>(rows), static_cast<int>(cols), xh, tiles, y, ldy);
  }
}

template <GemmInput T, bool kQ6>
void launch_fused(ExpertTiles shape, const void* const* weight_of, int64_t rows, int64_t cols, const void* x,
                  const ExpertGemmTile* tiles, int n_tiles, float* y, int64_t ldy, cudaStream_t stream) {
  switch (shape) {
    case ExpertTiles::Wide:
      return launch_fused_shape<T, kQ6, 128, 128, 2, 2>(weight_of, rows, cols, x, tiles, n_tiles, y, ldy, stream);
    case ExpertTiles::Large:
      return launch_fused_shape<T, kQ6, 128, 64, 4, 2>(weight_of, rows, cols, x, tiles, n_tiles, y, ldy, stream);
    case ExpertTiles::Small:
      return launch_fused_shape<T, kQ6, 64, 32, 2, 2>(weight_of, rows, cols, x, tiles, n_tiles, y, ldy, stream);
    case ExpertTiles::Tall:
      return launch_fused_shape<T, kQ6, 128, 32, 4, 2>(weight_of, rows, cols, x, tiles, n_tiles, y, ldy, stream);
  }
}

}  // namespace

int expert_tile_rows(ExpertTiles shape) { return shape == ExpertTiles::Small ? 64 : 128; }
// Small and Tall (the launches' BN = 32) have the fewest tokens, which sizes the tile tables.
static_assert(kExpertMinTileTokens == 32, "gemm_prefill_limits.h: the smallest token tile is 32");
int expert_tile_tokens(ExpertTiles shape) {
  return shape == ExpertTiles::Wide ? 128 : shape == ExpertTiles::Large ? 64 : 32;  // Small, Tall: 32
}

const char* expert_tiles_name(ExpertTiles shape) {
  switch (shape) {
    case ExpertTiles::Large: return "large";
    case ExpertTiles::Small: return "small";
    case ExpertTiles::Wide: return "wide";
    case ExpertTiles::Tall: return "tall";
  }
  return "?";
}

void expert_gemm_tiles(ExpertTiles shape, int32_t slot, int64_t first_row, int64_t count,
                       std::vector<ExpertGemmTile>& out) {
  if (slot < 0 || first_row < 0 || count < 0 || first_row + count > (int64_t{1} << 31) - 1)
    throw std::invalid_argument("expert_gemm_tiles: slot " + std::to_string(slot) + ", rows " +
                                std::to_string(first_row) + " + " + std::to_string(count) +
                                ": need slot >= 0, first_row >= 0, count >= 0 and an end below 2^31");
  const int64_t bn = expert_tile_tokens(shape);
  for (int64_t t0 = 0; t0 < count; t0 += bn)
    out.push_back({slot, static_cast<int32_t>(first_row + t0), static_cast<int32_t>(std::min(bn, count - t0)), 0});
}

void expert_gemm(GemmInput type, ExpertTiles shape, const void* weights, int64_t slot_stride, int64_t rows,
                 int64_t cols, const void* x, const ExpertGemmTile* tiles, int n_tiles, float* y, int64_t ldy,
                 cudaStream_t stream) {
  const std::string shape_text = " (rows " + std::to_string(rows) + ", cols " + std::to_string(cols) + ", ldy " +
                                 std::to_string(ldy) + ", " + std::to_string(n_tiles) + " tiles)";
  if (rows < 1 || cols < kTileK || cols % kTileK != 0 || cols > (int64_t{1} << 30) || ldy < rows ||
      (rows + expert_tile_rows(shape) - 1) / expert_tile_rows(shape) > 65535 || n_tiles < 0)
    throw std::invalid_argument("expert_gemm: need rows >= 1 in at most 65535 row tiles, cols a positive multiple of 32, "
                                "ldy >= rows and n_tiles >= 0" + shape_text);
  if (slot_stride < rows * cols || slot_stride % 8 != 0)
    throw std::invalid_argument("expert_gemm: slot_stride " + std::to_string(slot_stride) +
                                " must be a multiple of 8 and at least rows * cols" + shape_text);
  if (n_tiles == 0) return;
  if (weights == nullptr || x == nullptr || y == nullptr || tiles == nullptr ||
      reinterpret_cast<uintptr_t>(weights) % 16 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0)
    throw std::invalid_argument("expert_gemm: null pointer, or weights / x not 16-byte aligned" + shape_text);
  if (type == GemmInput::BF16)
    launch<GemmInput::BF16>(shape, weights, slot_stride, rows, cols, x, tiles, n_tiles, y, ldy, stream);
  else
    launch<GemmInput::F16>(shape, weights, slot_stride, rows, cols, x, tiles, n_tiles, y, ldy, stream);
}

}  // namespace moraine::cuda

namespace moraine::cuda {

bool expert_gemm_fused_supported(TensorType weight) { return weight == TensorType::Q4_K || weight == TensorType::Q6_K; }

void expert_gemm_fused(TensorType weight, GemmInput type, ExpertTiles shape, const void* const* weight_of, int64_t rows,
                       int64_t cols, const void* x, const ExpertGemmTile* tiles, int n_tiles, float* y, int64_t ldy,
                       cudaStream_t stream) {
  const std::string shape_text = " (weight " + std::string(type_name(weight)) + ", rows " + std::to_string(rows) +
                                 ", cols " + std::to_string(cols) + ", ldy " + std::to_string(ldy) + ", " +
                                 std::to_string(n_tiles) + " tiles)";
  if (!expert_gemm_fused_supported(weight))
    throw std::invalid_argument("expert_gemm_fused: only q4_k and q6_k weights are decoded in the kernel" + shape_text);
  if (rows < 1 || cols < 256 || cols % 256 != 0 || cols > (int64_t{1} << 30) || ldy < rows ||
      (rows + expert_tile_rows(shape) - 1) / expert_tile_rows(shape) > 65535 || n_tiles < 0)
    throw std::invalid_argument("expert_gemm_fused: need rows >= 1 in at most 65535 row tiles, cols a positive "
                                "multiple of 256, ldy >= rows and n_tiles >= 0" + shape_text);
  if (n_tiles == 0) return;
  if (weight_of == nullptr || x == nullptr || y == nullptr || tiles == nullptr ||
      reinterpret_cast<uintptr_t>(x) % 16 != 0)
    throw std::invalid_argument("expert_gemm_fused: null pointer, or x not 16-byte aligned" + shape_text);
  const bool bf16 = type == GemmInput::BF16;
  if (weight == TensorType::Q6_K) {
    if (bf16) launch_fused<GemmInput::BF16, true>(shape, weight_of, rows, cols, x, tiles, n_tiles, y, ldy, stream);
    else launch_fused<GemmInput::F16, true>(shape, weight_of, rows, cols, x, tiles, n_tiles, y, ldy, stream);
    return;
  }
  if (bf16) launch_fused<GemmInput::BF16, false>(shape, weight_of, rows, cols, x, tiles, n_tiles, y, ldy, stream);
  else launch_fused<GemmInput::F16, false>(shape, weight_of, rows, cols, x, tiles, n_tiles, y, ldy, stream);
}

}  // namespace moraine::cuda
