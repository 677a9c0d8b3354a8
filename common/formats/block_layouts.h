// Quantized block layouts, byte for byte as ggml stores them in GGUF files (learned from ggml's
// ggml-common.h). Halves are raw IEEE binary16 bit patterns (uint16_t); all structs are packed by
// construction (only 1- and 2-byte members, or a leading float in Q8_K), and the static_asserts
// pin every size so a layout change cannot go unnoticed.
#pragma once
#include <cstddef>
#include <cstdint>

namespace moraine {

inline constexpr int kQK = 32;       // elements per legacy block (Q4_0, Q8_0, MXFP4)
inline constexpr int kQK_K = 256;    // elements per k-quant super-block
inline constexpr int kScaleBytesK = 12;  // packed 6-bit scales+mins of Q4_K/Q5_K (and Q3_K scales)

// x = d * (q - 8), q in 0..15; element j in low nibble of qs[j], element j+16 in the high one.
struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[kQK / 2];
};

// x = d * q, q in -127..127 (ggml never writes -128 but the format allows it).
struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[kQK];
};

// MXFP4 (OCP microscaling): x = e2m1(q) * 2^(e - 127); e is an E8M0 shared exponent. ggml
// stores E2M1 values doubled as integers (0,1,2,3,4,6,8,12 and negatives), so the scale it
// multiplies by is 2^(e - 128). Element j in the low nibble of qs[j], j+16 in the high one.
struct BlockMXFP4 {
  uint8_t e;
  uint8_t qs[kQK / 2];
};

// 16 sub-blocks of 16: x = d * (scales[j] & 15) * q - dmin * (scales[j] >> 4), q in 0..3.
// qs[32*h + l] holds elements 128*h + 32*s + l at bits 2s..2s+1.
struct BlockQ2_K {
  uint8_t scales[kQK_K / 16];
  uint8_t qs[kQK_K / 4];
  uint16_t d;
  uint16_t dmin;
};

// 16 sub-blocks of 16: x = d * (s6 - 32) * (q2 + 4*hbit - 4). Low 2 bits laid out as Q2_K;
// the high bit of element 32*s + l is bit s of hmask[l]. The sixteen 6-bit scales are packed
// into 12 bytes: low nibbles of scales 0..7 in bytes 0..7 (low half), 8..15 (high half), and
// the top 2 bits of scale j in byte 8 + j%4 at bit 2*(j/4).
struct BlockQ3_K {
  uint8_t hmask[kQK_K / 8];
  uint8_t qs[kQK_K / 4];
  uint8_t scales[kScaleBytesK];
  uint16_t d;
};

// 8 sub-blocks of 32: x = d * sc[j] * q - dmin * m[j], q in 0..15, sc/m 6-bit packed in 12 bytes.
// qs[32*p + l] holds element 64*p + l (low nibble) and 64*p + 32 + l (high nibble).
struct BlockQ4_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[kScaleBytesK];
  uint8_t qs[kQK_K / 2];
};

// As Q4_K with a fifth bit: bit 2p of qh[l] for element 64p + l, bit 2p+1 for 64p + 32 + l.
struct BlockQ5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[kScaleBytesK];
  uint8_t qh[kQK_K / 8];
  uint8_t qs[kQK_K / 2];
};

// 16 sub-blocks of 16: x = d * scales[j] * (q - 32), q in 0..63. For half h (128 elements):
// ql[64h + l] holds elements 128h + l (low nibble) and 128h + 64 + l (high nibble),
// ql[64h + 32 + l] holds 128h + 32 + l and 128h + 96 + l; qh[32h + l] bits 2s..2s+1 are the
// top bits of element 128h + 32s + l.
struct BlockQ6_K {
  uint8_t ql[kQK_K / 2];
  uint8_t qh[kQK_K / 4];
  int8_t scales[kQK_K / 16];
  uint16_t d;
};

// Activation format for the k-quant dots: x = d * q, plus the sum of every 16 quants so the
// dots can apply sub-block mins without touching the weights' quants again.
struct BlockQ8_K {
  float d;
  int8_t qs[kQK_K];
  int16_t bsums[kQK_K / 16];
};

static_assert(sizeof(BlockQ4_0) == 18, "q4_0 block must be 18 bytes");
static_assert(sizeof(BlockQ8_0) == 34, "q8_0 block must be 34 bytes");
static_assert(sizeof(BlockMXFP4) == 17, "mxfp4 block must be 17 bytes");
static_assert(sizeof(BlockQ2_K) == 84, "q2_K block must be 84 bytes");
static_assert(sizeof(BlockQ3_K) == 110, "q3_K block must be 110 bytes");
static_assert(sizeof(BlockQ4_K) == 144, "q4_K block must be 144 bytes");
static_assert(sizeof(BlockQ5_K) == 176, "q5_K block must be 176 bytes");
static_assert(sizeof(BlockQ6_K) == 210, "q6_K block must be 210 bytes");
static_assert(sizeof(BlockQ8_K) == 292, "q8_K block must be 292 bytes");
static_assert(offsetof(BlockQ2_K, d) == 80 && offsetof(BlockQ3_K, d) == 108 &&
                  offsetof(BlockQ6_K, d) == 208 && offsetof(BlockQ5_K, qs) == 48 &&
                  offsetof(BlockQ8_K, bsums) == 260,
              "field offsets must match ggml");

// E2M1 code -> doubled value, in code order (bit 3 is the sign; code 8 is -0).
inline constexpr int8_t kE2M1Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

}  // namespace moraine

#include "common/formats/block_layouts_legacy_iq4_tq.h"  // Q4_1, Q5_0, Q5_1, Q8_1, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0
