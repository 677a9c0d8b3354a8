// Scalar reference for the importance-matrix grid formats. Every block is first unpacked to one
// signed small integer per element (grid magnitude times sign; IQ1: the grid value in -1..1) and
// one 4-bit scale per 16 elements, so the bit layouts (block_layouts_iq.h) are decoded in one
// place per format; decoding and dots then follow ggml's float expressions exactly.
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/formats/half_float.h"
#include "common/formats/iq_grids.h"
#include "common/formats/quant_iq.h"

namespace moraine::formats {
namespace {

using iq::grid_bytes;

struct Unpacked {
  int8_t v[kQK_K];        // signed grid values
  uint8_t scale[16];      // per 16 elements: the 3- or 4-bit scale field s (ls = 2s + 1)
  bool delta_neg[32];     // IQ1: per 8 elements, the delta is -1/8
};

// 8 elements from a grid entry with sign bits `signs` (bit j set: element j negative).
void put8(int8_t* v, const uint8_t* grid, uint8_t signs) {
  for (int j = 0; j < 8; ++j) v[j] = static_cast<int8_t>(signs & iq::kSignMask[j] ? -grid[j] : grid[j]);
}

void unpack(const BlockIQ2_XXS& b, Unpacked& u) {
  for (int s = 0; s < 8; ++s) {
    uint32_t w[2];
    std::memcpy(w, b.qs + 4 * s, 8);
    for (int l = 0; l < 4; ++l) {
      put8(u.v + 32 * s + 8 * l, grid_bytes(iq::kIq2xxsGrid, (w[0] >> (8 * l)) & 0xff), iq::kSigns7[(w[1] >> (7 * l)) & 127]);
    }
    u.scale[2 * s] = u.scale[2 * s + 1] = static_cast<uint8_t>(w[1] >> 28);
  }
}

void unpack(const BlockIQ2_XS& b, Unpacked& u) {
  for (int g = 0; g < 32; ++g) put8(u.v + 8 * g, grid_bytes(iq::kIq2xsGrid, b.qs[g] & 511), iq::kSigns7[b.qs[g] >> 9]);
  for (int s = 0; s < 8; ++s) {
    u.scale[2 * s] = b.scales[s] & 0x0f;
    u.scale[2 * s + 1] = b.scales[s] >> 4;
  }
}

void unpack(const BlockIQ2_S& b, Unpacked& u) {
  for (int g = 0; g < 32; ++g) {
    const int idx = b.qs[g] | (((b.qh[g / 4] >> (2 * (g % 4))) & 3) << 8);
    put8(u.v + 8 * g, grid_bytes(iq::kIq2sGrid, idx), b.qs[32 + g]);
  }
  for (int s = 0; s < 8; ++s) {
    u.scale[2 * s] = b.scales[s] & 0x0f;
    u.scale[2 * s + 1] = b.scales[s] >> 4;
  }
}

void unpack(const BlockIQ3_XXS& b, Unpacked& u) {
  for (int s = 0; s < 8; ++s) {
    uint32_t w;
    std::memcpy(&w, b.qs + 64 + 4 * s, 4);
    for (int l = 0; l < 4; ++l) {
      const uint8_t signs = iq::kSigns7[(w >> (7 * l)) & 127];
      uint8_t grid[8];
      std::memcpy(grid, grid_bytes(iq::kIq3xxsGrid, b.qs[8 * s + 2 * l]), 4);
      std::memcpy(grid + 4, grid_bytes(iq::kIq3xxsGrid, b.qs[8 * s + 2 * l + 1]), 4);
      put8(u.v + 32 * s + 8 * l, grid, signs);
    }
    u.scale[2 * s] = u.scale[2 * s + 1] = static_cast<uint8_t>(w >> 28);
  }
}

void unpack(const BlockIQ3_S& b, Unpacked& u) {
  for (int s = 0; s < 8; ++s) {
    for (int l = 0; l < 4; ++l) {
      uint8_t grid[8];
      for (int h = 0; h < 2; ++h) {
        const int q = 2 * l + h;
        std::memcpy(grid + 4 * h, grid_bytes(iq::kIq3sGrid, b.qs[8 * s + q] | (((b.qh[s] >> q) & 1) << 8)), 4);
      }
      put8(u.v + 32 * s + 8 * l, grid, b.signs[4 * s + l]);
    }
    u.scale[2 * s] = u.scale[2 * s + 1] = (b.scales[s / 2] >> (4 * (s % 2))) & 0x0f;
  }
}

void unpack(const BlockIQ1_S& b, Unpacked& u) {
  for (int s = 0; s < 8; ++s) {
    for (int l = 0; l < 4; ++l) {
      const int idx = b.qs[4 * s + l] | (((b.qh[s] >> (3 * l)) & 7) << 8);
      std::memcpy(u.v + 32 * s + 8 * l, grid_bytes(iq::kIq1sGrid, idx), 8);
      u.delta_neg[4 * s + l] = (b.qh[s] & 0x8000) != 0;
    }
    u.scale[2 * s] = u.scale[2 * s + 1] = (b.qh[s] >> 12) & 7;
  }
}

void unpack(const BlockIQ1_M& b, Unpacked& u) {
  uint16_t sc[4];
  std::memcpy(sc, b.scales, 8);
  for (int s = 0; s < 8; ++s) {
    for (int l = 0; l < 4; ++l) {
      const uint8_t h = static_cast<uint8_t>(b.qh[2 * s + l / 2] >> (4 * (l % 2)));
      std::memcpy(u.v + 32 * s + 8 * l, grid_bytes(iq::kIq1sGrid, b.qs[4 * s + l] | ((h & 7) << 8)), 8);
      u.delta_neg[4 * s + l] = (h & 8) != 0;
    }
    u.scale[2 * s] = (sc[s / 2] >> (6 * (s % 2))) & 7;
    u.scale[2 * s + 1] = (sc[s / 2] >> (6 * (s % 2) + 3)) & 7;
  }
}

// Exact integer sum over the 16 groups of 16: (2 * scale + 1) * sum(v * a).
int scaled_sum(const Unpacked& u, const int8_t* a) {
  int isum = 0;
  for (int j = 0; j < 16; ++j) {
    int s = 0;
    for (int i = 16 * j; i < 16 * j + 16; ++i) s += u.v[i] * a[i];
    isum += (2 * u.scale[j] + 1) * s;
  }
  return isum;
}

// ggml's per-32 multipliers: IQ2_* (0.5 + s) / 4, IQ3_XXS (0.5 + s) / 2, both as d * (0.5f + s) * k.
template <typename Block>
void dequantize_half_step(const Block* x, float* y, int64_t nb, float k) {
  Unpacked u;
  for (int64_t b = 0; b < nb; ++b, y += kQK_K) {
    unpack(x[b], u);
    const float d = half::fp16_to_fp32(x[b].d);
    for (int j = 0; j < 16; ++j) {
      const float db = d * (0.5f + static_cast<float>(u.scale[j])) * k;
      for (int i = 16 * j; i < 16 * j + 16; ++i) y[i] = db * static_cast<float>(u.v[i]);
    }
  }
}

// IQ3_S and IQ1: d * (2s + 1), IQ1 adding its delta to the grid value first.
template <typename Block>
void dequantize_odd_scale(const Block& blk, float d, float* y, bool with_delta) {
  Unpacked u;
  unpack(blk, u);
  for (int j = 0; j < 16; ++j) {
    const float dl = d * static_cast<float>(2 * u.scale[j] + 1);
    for (int i = 16 * j; i < 16 * j + 16; ++i) {
      if (with_delta) {
        const float delta = u.delta_neg[i / 8] ? -iq::kIq1Delta : iq::kIq1Delta;
        y[i] = dl * (static_cast<float>(u.v[i]) + delta);
      } else {
        y[i] = dl * static_cast<float>(u.v[i]);
      }
    }
  }
}

template <typename Block>
float dot_grid(const Block* w, const BlockQ8_K* a, int64_t nb, float factor) {
  Unpacked u;
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    unpack(w[b], u);
    const float d = half::fp16_to_fp32(w[b].d) * a[b].d;
    acc += d * static_cast<float>(scaled_sum(u, a[b].qs));
  }
  return factor == 1.0f ? acc : factor * acc;
}

}  // namespace

bool is_iq_grid_type(TensorType t) {
  switch (t) {
    case TensorType::IQ2_XXS:
    case TensorType::IQ2_XS:
    case TensorType::IQ2_S:
    case TensorType::IQ3_XXS:
    case TensorType::IQ3_S:
    case TensorType::IQ1_S:
    case TensorType::IQ1_M: return true;
    default: return false;
  }
}

uint16_t iq1_m_block_scale(const BlockIQ1_M& b) {
  uint16_t sc[4];
  std::memcpy(sc, b.scales, 8);
  return static_cast<uint16_t>((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000));
}

void dequantize_iq2_xxs(const BlockIQ2_XXS* x, float* y, int64_t nb) { dequantize_half_step(x, y, nb, 0.25f); }
void dequantize_iq2_xs(const BlockIQ2_XS* x, float* y, int64_t nb) { dequantize_half_step(x, y, nb, 0.25f); }
void dequantize_iq2_s(const BlockIQ2_S* x, float* y, int64_t nb) { dequantize_half_step(x, y, nb, 0.25f); }
void dequantize_iq3_xxs(const BlockIQ3_XXS* x, float* y, int64_t nb) { dequantize_half_step(x, y, nb, 0.5f); }

void dequantize_iq3_s(const BlockIQ3_S* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) dequantize_odd_scale(x[b], half::fp16_to_fp32(x[b].d), y + b * kQK_K, false);
}

void dequantize_iq1_s(const BlockIQ1_S* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) dequantize_odd_scale(x[b], half::fp16_to_fp32(x[b].d), y + b * kQK_K, true);
}

void dequantize_iq1_m(const BlockIQ1_M* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) dequantize_odd_scale(x[b], half::fp16_to_fp32(iq1_m_block_scale(x[b])), y + b * kQK_K, true);
}

float dot_iq2_xxs_q8_k(const BlockIQ2_XXS* w, const BlockQ8_K* a, int64_t nb) { return dot_grid(w, a, nb, 0.125f); }
float dot_iq2_xs_q8_k(const BlockIQ2_XS* w, const BlockQ8_K* a, int64_t nb) { return dot_grid(w, a, nb, 0.125f); }
float dot_iq2_s_q8_k(const BlockIQ2_S* w, const BlockQ8_K* a, int64_t nb) { return dot_grid(w, a, nb, 0.125f); }
float dot_iq3_xxs_q8_k(const BlockIQ3_XXS* w, const BlockQ8_K* a, int64_t nb) { return dot_grid(w, a, nb, 0.25f); }
float dot_iq3_s_q8_k(const BlockIQ3_S* w, const BlockQ8_K* a, int64_t nb) { return dot_grid(w, a, nb, 1.0f); }

// IQ1_S: the delta term uses the activations' bsums, as ggml's dot does.
float dot_iq1_s_q8_k(const BlockIQ1_S* w, const BlockQ8_K* a, int64_t nb) {
  Unpacked u;
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    unpack(w[b], u);
    const int isum = scaled_sum(u, a[b].qs);
    int dsum = 0;
    for (int s = 0; s < 8; ++s) {
      const int ls = 2 * u.scale[2 * s] + 1;
      dsum += ls * (u.delta_neg[4 * s] ? -1 : 1) * (a[b].bsums[2 * s] + a[b].bsums[2 * s + 1]);
    }
    acc += half::fp16_to_fp32(w[b].d) * a[b].d * (static_cast<float>(isum) + iq::kIq1Delta * static_cast<float>(dsum));
  }
  return acc;
}

// IQ1_M: per 8 elements its own delta sign, summed from the activations' quants (ggml does not
// use bsums here).
float dot_iq1_m_q8_k(const BlockIQ1_M* w, const BlockQ8_K* a, int64_t nb) {
  Unpacked u;
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    unpack(w[b], u);
    const int isum = scaled_sum(u, a[b].qs);
    int dsum = 0;
    for (int g = 0; g < 32; ++g) {
      int s = 0;
      for (int i = 8 * g; i < 8 * g + 8; ++i) s += a[b].qs[i];
      dsum += (2 * u.scale[g / 2] + 1) * (u.delta_neg[g] ? -s : s);
    }
    const float d = half::fp16_to_fp32(iq1_m_block_scale(w[b])) * a[b].d;
    acc += d * (static_cast<float>(isum) + iq::kIq1Delta * static_cast<float>(dsum));
  }
  return acc;
}

void dequantize_iq(TensorType t, const void* x, float* y, int64_t nb) {
  switch (t) {
    case TensorType::IQ2_XXS: return dequantize_iq2_xxs(static_cast<const BlockIQ2_XXS*>(x), y, nb);
    case TensorType::IQ2_XS: return dequantize_iq2_xs(static_cast<const BlockIQ2_XS*>(x), y, nb);
    case TensorType::IQ2_S: return dequantize_iq2_s(static_cast<const BlockIQ2_S*>(x), y, nb);
    case TensorType::IQ3_XXS: return dequantize_iq3_xxs(static_cast<const BlockIQ3_XXS*>(x), y, nb);
    case TensorType::IQ3_S: return dequantize_iq3_s(static_cast<const BlockIQ3_S*>(x), y, nb);
    case TensorType::IQ1_S: return dequantize_iq1_s(static_cast<const BlockIQ1_S*>(x), y, nb);
    case TensorType::IQ1_M: return dequantize_iq1_m(static_cast<const BlockIQ1_M*>(x), y, nb);
    default: throw std::logic_error("dequantize_iq: " + std::string(type_name(t)) + " is not an IQ grid type");
  }
}

float dot_iq_q8_k(TensorType t, const void* w, const BlockQ8_K* a, int64_t nb) {
  switch (t) {
    case TensorType::IQ2_XXS: return dot_iq2_xxs_q8_k(static_cast<const BlockIQ2_XXS*>(w), a, nb);
    case TensorType::IQ2_XS: return dot_iq2_xs_q8_k(static_cast<const BlockIQ2_XS*>(w), a, nb);
    case TensorType::IQ2_S: return dot_iq2_s_q8_k(static_cast<const BlockIQ2_S*>(w), a, nb);
    case TensorType::IQ3_XXS: return dot_iq3_xxs_q8_k(static_cast<const BlockIQ3_XXS*>(w), a, nb);
    case TensorType::IQ3_S: return dot_iq3_s_q8_k(static_cast<const BlockIQ3_S*>(w), a, nb);
    case TensorType::IQ1_S: return dot_iq1_s_q8_k(static_cast<const BlockIQ1_S*>(w), a, nb);
    case TensorType::IQ1_M: return dot_iq1_m_q8_k(static_cast<const BlockIQ1_M*>(w), a, nb);
    default: throw std::logic_error("dot_iq_q8_k: " + std::string(type_name(t)) + " is not an IQ grid type");
  }
}

}  // namespace moraine::formats
