// The codebooks of ggml's importance-matrix grid formats (generated into iq_grids_data.inc from
// llama.cpp's ggml-common.h by gen_iq_grids.py). A grid entry packs the magnitudes of 8 (or 4)
// consecutive elements, byte j = element j (little-endian), so `grid_bytes(kIq2xxsGrid, i)`
// reads entry i as bytes. IQ1_S/IQ1_M's entries are signed bytes in -1..1.
#pragma once
#include <cstdint>

namespace moraine::formats::iq {

extern const uint8_t kSignMask[8];      // 1 << j (ggml's kmask_iq2xs)
extern const uint8_t kSigns7[128];      // 7 sign bits + an 8th making the count even (ksigns_iq2xs)
extern const uint64_t kIq2xxsGrid[256]; // magnitudes 8, 25, 43
extern const uint64_t kIq2xsGrid[512];
extern const uint64_t kIq2sGrid[1024];
extern const uint32_t kIq3xxsGrid[256]; // 4 elements, magnitudes 4..62
extern const uint32_t kIq3sGrid[512];   // 4 elements, magnitudes 1..15
extern const uint64_t kIq1sGrid[2048];  // 8 signed bytes in -1..1

inline const uint8_t* grid_bytes(const uint64_t* grid, int i) { return reinterpret_cast<const uint8_t*>(grid + i); }
inline const uint8_t* grid_bytes(const uint32_t* grid, int i) { return reinterpret_cast<const uint8_t*>(grid + i); }

inline constexpr float kIq1Delta = 0.125f;  // IQ1_S / IQ1_M: element = scale * (grid + or - delta)

}  // namespace moraine::formats::iq
