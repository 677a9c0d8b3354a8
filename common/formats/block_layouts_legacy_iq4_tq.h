// ggml block layouts of the hub types added for issue 26 (part A): the affine 32-element formats
// Q4_1 / Q5_0 / Q5_1 and their activation format Q8_1, the non-linear 4-bit IQ4_NL / IQ4_XS and
// the ternary TQ1_0 / TQ2_0. Byte for byte as ggml-common.h stores them; included by
// block_layouts.h (which defines kQK / kQK_K).
#pragma once
#include <cstddef>
#include <cstdint>

namespace moraine {

// x = d * q + m, q in 0..15; element j in the low nibble of qs[j], j+16 in the high one.
struct BlockQ4_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qs[32 / 2];
};

// x = d * (q - 16), q in 0..31: low 4 bits as Q4_0, bit 4 of element j is bit j of qh
// (read as a little-endian uint32).
struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[32 / 2];
};

// x = d * q + m, q in 0..31, bits as Q5_0.
struct BlockQ5_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qh[4];
  uint8_t qs[32 / 2];
};

// Activation format of Q4_1 / Q5_1: x = d * q, and s = fp16(d * sum(q)) so the dot applies the
// weight's min with one multiply per block.
struct BlockQ8_1 {
  uint16_t d;
  uint16_t s;
  int8_t qs[32];
};

// x = d * kIQ4NLValues[q]; nibbles as Q4_0.
struct BlockIQ4_NL {
  uint16_t d;
  uint8_t qs[32 / 2];
};

// 8 sub-blocks of 32: x = d * (ls - 32) * kIQ4NLValues[q], ls 6-bit: low 4 bits of sub-block j
// in scales_l[j/2] (nibble j%2), high 2 bits at bits 2j..2j+1 of scales_h. Sub-block j's
// nibbles in qs[16j..16j+15] as Q4_0.
struct BlockIQ4_XS {
  uint16_t d;
  uint16_t scales_h;
  uint8_t scales_l[256 / 64];
  uint8_t qs[256 / 2];
};

// Ternary x = d * (t - 1), t in 0..2. qs[0..31] hold 5 trits each of elements 32n + m (n the
// trit's position, most significant first), qs[32..47] 5 trits of elements 160 + 16n + m, qh[j]
// 4 trits of elements 240 + 4n + j; a byte of trits is stored as ceil(value * 256 / 243) so
// trit n is ((uint8_t)(byte * 3^n) * 3) >> 8.
struct BlockTQ1_0 {
  uint8_t qs[(256 - 4 * 256 / 64) / 5];
  uint8_t qh[256 / 64];
  uint16_t d;
};

// Ternary x = d * (t - 1): qs[32h + m] bits 2l..2l+1 hold element 128h + 32l + m.
struct BlockTQ2_0 {
  uint8_t qs[256 / 4];
  uint16_t d;
};

static_assert(sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24 && sizeof(BlockQ8_1) == 36,
              "legacy block sizes must match ggml");
static_assert(sizeof(BlockIQ4_NL) == 18 && sizeof(BlockIQ4_XS) == 136, "iq4 block sizes must match ggml");
static_assert(sizeof(BlockTQ1_0) == 54 && sizeof(BlockTQ2_0) == 66 && offsetof(BlockTQ1_0, d) == 52 &&
                  offsetof(BlockTQ2_0, d) == 64,
              "ternary block layouts must match ggml");

// IQ4_NL / IQ4_XS code -> value (ggml's non-linear grid).
inline constexpr int8_t kIQ4NLValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

}  // namespace moraine
