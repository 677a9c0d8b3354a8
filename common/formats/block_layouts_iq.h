// Block layouts of ggml's importance-matrix grid formats (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
// IQ3_S, IQ1_S, IQ1_M), byte for byte as ggml-common.h defines them. All are 256-element
// super-blocks of 32-element sub-blocks; each group of 8 (IQ3: 4) elements is one index into a
// codebook (iq_grids.h) plus, for IQ2/IQ3, 8 sign bits; scales are odd integers 2s+1.
// Decoding rules (the scalar reference, quant_iq.cpp) are noted per struct.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/formats/block_layouts.h"

namespace moraine {

// Sub-block s: 32-bit words qs[4s..4s+1] = w0 (4 grid indices, one byte each) and w1 (four
// 7-bit sign indices into kSigns7 at bits 7l, scale nibble at bits 28..31).
// x = d * (0.5 + scale) / 4 * grid * sign  (dot: d * sum(ls * grid * sign * a) / 8, ls = 2*scale+1)
struct BlockIQ2_XXS {
  uint16_t d;
  uint16_t qs[kQK_K / 8];
};

// Group g: qs[g] = 9-bit index into kIq2xsGrid | 7-bit sign index << 9. scales[s]: low nibble
// for the first 16 elements of sub-block s, high nibble for the second.
struct BlockIQ2_XS {
  uint16_t d;
  uint16_t qs[kQK_K / 8];
  uint8_t scales[kQK_K / 32];
};

// Group g = 4s + l: index qs[g] | ((qh[s] >> 2l) & 3) << 8 into kIq2sGrid; its 8 sign bits
// are qs[32 + g] directly. Scales as IQ2_XS.
struct BlockIQ2_S {
  uint16_t d;
  uint8_t qs[kQK_K / 4];
  uint8_t qh[kQK_K / 32];
  uint8_t scales[kQK_K / 32];
};

// qs[0..63]: one kIq3xxsGrid index per 4 elements; qs[64 + 4s..]: sub-block s's 32-bit word
// of four 7-bit sign indices (8 elements each) and the scale nibble at bits 28..31.
// x = d * (0.5 + scale) / 2 * grid * sign  (dot: d * sum(ls * ...) / 4)
struct BlockIQ3_XXS {
  uint16_t d;
  uint8_t qs[3 * kQK_K / 8];
};

// Quad q (4 elements) of sub-block s: index qs[8s + q] | ((qh[s] >> q) & 1) << 8 into
// kIq3sGrid; sign bits signs[4s + q/2] bits 4(q%2)..; scale nibble s%2 of scales[s/2];
// x = d * (2*scale + 1) * grid * sign.
struct BlockIQ3_S {
  uint16_t d;
  uint8_t qs[kQK_K / 4];
  uint8_t qh[kQK_K / 32];
  uint8_t signs[kQK_K / 8];
  uint8_t scales[kQK_K / 64];
};

// Group g = 4s + l: index qs[g] | ((qh[s] >> 3l) & 7) << 8 into kIq1sGrid (values -1..1);
// qh[s] bits 12..14 the scale, bit 15 the delta's sign: x = d * (2*scale+1) * (grid + delta),
// delta = +-1/8.
struct BlockIQ1_S {
  uint16_t d;
  uint8_t qs[kQK_K / 8];
  uint16_t qh[kQK_K / 32];
};

// Group g = 4s + l: index qs[g] | (qh[2s + l/2] >> 4(l%2) & 7) << 8, delta sign bit 3 (+4(l%2))
// of that byte. Sixteen 3-bit scales (two per sub-block, 16 elements each) in the low 12 bits
// of the four uint16 words of `scales`; the fp16 block scale is their top nibbles, word 0's
// lowest. x = d * (2*scale+1) * (grid + delta).
struct BlockIQ1_M {
  uint8_t qs[kQK_K / 8];
  uint8_t qh[kQK_K / 16];
  uint8_t scales[kQK_K / 32];
};

static_assert(sizeof(BlockIQ2_XXS) == 66 && sizeof(BlockIQ2_XS) == 74 && sizeof(BlockIQ2_S) == 82 &&
                  sizeof(BlockIQ3_XXS) == 98 && sizeof(BlockIQ3_S) == 110 && sizeof(BlockIQ1_S) == 50 &&
                  sizeof(BlockIQ1_M) == 56,
              "IQ block sizes must match ggml");
static_assert(offsetof(BlockIQ2_XS, scales) == 66 && offsetof(BlockIQ2_S, qh) == 66 && offsetof(BlockIQ3_S, signs) == 74 &&
                  offsetof(BlockIQ3_S, scales) == 106 && offsetof(BlockIQ1_S, qh) == 34 && offsetof(BlockIQ1_M, scales) == 48,
              "IQ field offsets must match ggml");

}  // namespace moraine
