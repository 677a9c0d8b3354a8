// AMX int8 matmul of a weight slice with a panel of tokens. Per 16-row weight panel, every block
// is unpacked once to signed (Q8_0, MXFP4) or unsigned (Q4_K, Q5_K) bytes, then reused by every
// 16-token panel; activations are packed once per call in the VNNI layout tile B expects
// (B[k][4n + i] = token n's element 4k + i). One tile product covers one 32-element group; its
// 16 x 16 int32 result goes to memory and the reference's per-block float expression is applied
// per (row, token).
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "common/formats/block_layouts.h"
#include "common/formats/half_float.h"
#include "common/formats/kquant_scales.h"
#include "kernels/cpu/amx_kernels.h"

namespace moraine::cpu::amx {
namespace {

constexpr int kTile = 16;   // rows of a weight panel, tokens of a token panel
constexpr int kGroup = 32;  // bytes of K per tile product

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0: C (16 x 16 int32), tmm1: A (16 rows x 32 bytes), tmm2: B (8 rows x 64 bytes).
void configure_tiles() {
  TileConfig cfg;
  cfg.colsb[0] = 64;
  cfg.rows[0] = 16;
  cfg.colsb[1] = kGroup;
  cfg.rows[1] = 16;
  cfg.colsb[2] = 64;
  cfg.rows[2] = kGroup / 4;
  _tile_loadconfig(&cfg);
}

bool is_kquant(TensorType t) { return t == TensorType::Q4_K || t == TensorType::Q5_K; }

// Per row of a panel and per block: what the epilogue needs besides the integer sums.
struct RowBlock {
  float d = 0, dmin = 0;  // legacy: d = weight scale (as the reference computes it); k-quant: fp16(d), fp16(dmin)
  uint8_t sc[8] = {}, mn[8] = {};
};

// Unpacks block b of one weight row into 32-byte groups at `out` (group g at out + 32 g).
void unpack_block(TensorType t, const uint8_t* row, int64_t b, uint8_t* out, RowBlock& rb) {
  switch (t) {
    case TensorType::Q8_0: {
      const auto& blk = reinterpret_cast<const BlockQ8_0*>(row)[b];
      std::memcpy(out, blk.qs, kQK);
      rb.d = half::fp16_to_fp32(blk.d);
      break;
    }
    case TensorType::MXFP4: {
      const auto& blk = reinterpret_cast<const BlockMXFP4*>(row)[b];
      for (int j = 0; j < kQK / 2; ++j) {
        out[j] = static_cast<uint8_t>(kE2M1Doubled[blk.qs[j] & 0x0f]);
        out[j + kQK / 2] = static_cast<uint8_t>(kE2M1Doubled[blk.qs[j] >> 4]);
      }
      rb.d = half::e8m0_to_fp32_half(blk.e);
      break;
    }
    case TensorType::Q4_K:
    case TensorType::Q5_K: {
      const bool q5 = t == TensorType::Q5_K;
      const uint8_t* qs = q5 ? reinterpret_cast<const BlockQ5_K*>(row)[b].qs : reinterpret_cast<const BlockQ4_K*>(row)[b].qs;
      const uint8_t* qh = q5 ? reinterpret_cast<const BlockQ5_K*>(row)[b].qh : nullptr;
      const uint8_t* scales = q5 ? reinterpret_cast<const BlockQ5_K*>(row)[b].scales : reinterpret_cast<const BlockQ4_K*>(row)[b].scales;
      const uint16_t d = q5 ? reinterpret_cast<const BlockQ5_K*>(row)[b].d : reinterpret_cast<const BlockQ4_K*>(row)[b].d;
      const uint16_t dmin = q5 ? reinterpret_cast<const BlockQ5_K*>(row)[b].dmin : reinterpret_cast<const BlockQ4_K*>(row)[b].dmin;
      for (int e = 0; e < kQK_K; ++e) {  // element e = 64p + 32t + l (block_layouts.h)
        const int p = e / 64, hi = (e / 32) % 2, l = e % 32;
        const uint8_t byte = qs[32 * p + l];
        int q = hi ? (byte >> 4) : (byte & 0x0f);
        if (qh) q += ((qh[l] >> (2 * p + hi)) & 1) << 4;
        out[e] = static_cast<uint8_t>(q);
      }
      for (int j = 0; j < 8; ++j) kquant::unpack_scale_min(scales, j, rb.sc[j], rb.mn[j]);
      rb.d = half::fp16_to_fp32(d);
      rb.dmin = half::fp16_to_fp32(dmin);
      break;
    }
    default: break;
  }
}

}  // namespace

bool supports(TensorType t) {
  return t == TensorType::Q8_0 || t == TensorType::MXFP4 || t == TensorType::Q4_K || t == TensorType::Q5_K;
}

void matmul_tokens(TensorType type, int64_t n_cols, const void* w, int64_t row_begin, int64_t row_end, const void* acts,
                   size_t act_row_bytes, const int32_t* tok, int n_tok, float* y, int64_t y_stride) {
  const bool kq = is_kquant(type);
  const int64_t block = kq ? kQK_K : kQK;
  const int64_t nb = n_cols / block;
  const int groups_per_block = static_cast<int>(block / kGroup);
  const int64_t n_groups = n_cols / kGroup;
  const int n_panels = (n_tok + kTile - 1) / kTile;
  const size_t wrb = row_bytes(type, n_cols);

  // Activations: VNNI-packed groups [panel][group][8][64], scales [token][block], and for the
  // k-quants the per-32 sums of the Q8_K bsums [token][block][8].
  thread_local std::vector<uint8_t> bpack;
  thread_local std::vector<float> ascale;
  thread_local std::vector<int32_t> asum32;
  thread_local std::vector<uint8_t> apanel;
  thread_local std::vector<RowBlock> rblocks;
  thread_local std::vector<int32_t> cbuf;
  bpack.assign(static_cast<size_t>(n_panels) * static_cast<size_t>(n_groups) * 512, 0);
  ascale.assign(static_cast<size_t>(n_panels * kTile) * static_cast<size_t>(nb), 0.0f);
  asum32.assign(kq ? static_cast<size_t>(n_panels * kTile) * static_cast<size_t>(nb) * 8 : 0, 0);
  for (int t = 0; t < n_tok; ++t) {
    const auto* arow = static_cast<const uint8_t*>(acts) + static_cast<size_t>(tok ? tok[t] : t) * act_row_bytes;
    const int panel = t / kTile, n = t % kTile;
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* qs;
      if (kq) {
        const auto& ab = reinterpret_cast<const BlockQ8_K*>(arow)[b];
        qs = ab.qs;
        ascale[static_cast<size_t>(t * nb + b)] = ab.d;
        for (int j = 0; j < 8; ++j) asum32[static_cast<size_t>((t * nb + b) * 8 + j)] = ab.bsums[2 * j] + ab.bsums[2 * j + 1];
      } else {
        const auto& ab = reinterpret_cast<const BlockQ8_0*>(arow)[b];
        qs = ab.qs;
        ascale[static_cast<size_t>(t * nb + b)] = half::fp16_to_fp32(ab.d);
      }
      for (int g = 0; g < groups_per_block; ++g) {
        uint8_t* dst = bpack.data() + (static_cast<size_t>(panel) * static_cast<size_t>(n_groups) + static_cast<size_t>(b * groups_per_block + g)) * 512;
        for (int k = 0; k < kGroup / 4; ++k) {
          for (int i = 0; i < 4; ++i) dst[k * 64 + 4 * n + i] = static_cast<uint8_t>(qs[g * kGroup + 4 * k + i]);
        }
      }
    }
  }

  apanel.resize(static_cast<size_t>(kTile) * static_cast<size_t>(n_cols));
  rblocks.resize(static_cast<size_t>(kTile) * static_cast<size_t>(nb));
  cbuf.resize(static_cast<size_t>(groups_per_block) * kTile * kTile);
  configure_tiles();
  for (int64_t r0 = row_begin; r0 < row_end; r0 += kTile) {
    const int rows = static_cast<int>(std::min<int64_t>(kTile, row_end - r0));
    // The weight panel, unpacked once: group g of row m at apanel[(g * 16 + m) * 32].
    std::memset(apanel.data(), 0, apanel.size());
    for (int m = 0; m < rows; ++m) {
      const auto* row = static_cast<const uint8_t*>(w) + static_cast<size_t>(r0 + m) * wrb;
      uint8_t tmp[kQK_K];
      for (int64_t b = 0; b < nb; ++b) {
        unpack_block(type, row, b, tmp, rblocks[static_cast<size_t>(m * nb + b)]);
        for (int g = 0; g < groups_per_block; ++g) {
          std::memcpy(apanel.data() + (static_cast<size_t>(b * groups_per_block + g) * kTile + static_cast<size_t>(m)) * kGroup, tmp + g * kGroup, kGroup);
        }
      }
    }
    for (int panel = 0; panel < n_panels; ++panel) {
      const int toks = std::min(kTile, n_tok - panel * kTile);
      float acc[kTile][kTile] = {};
      for (int64_t b = 0; b < nb; ++b) {
        for (int g = 0; g < groups_per_block; ++g) {
          const int64_t gi = b * groups_per_block + g;
          _tile_zero(0);
          _tile_loadd(1, apanel.data() + static_cast<size_t>(gi) * kTile * kGroup, kGroup);
          _tile_loadd(2, bpack.data() + (static_cast<size_t>(panel) * static_cast<size_t>(n_groups) + static_cast<size_t>(gi)) * 512, 64);
          if (kq) _tile_dpbusd(0, 1, 2);  // unsigned quants x signed activations
          else _tile_dpbssd(0, 1, 2);     // signed x signed
          _tile_stored(0, cbuf.data() + g * kTile * kTile, 64);
        }
        for (int m = 0; m < rows; ++m) {
          const RowBlock& rb = rblocks[static_cast<size_t>(m * nb + b)];
          for (int n = 0; n < toks; ++n) {
            const int t = panel * kTile + n;
            const float da = ascale[static_cast<size_t>(t * nb + b)];
            if (kq) {
              int isum = 0, msum = 0;
              for (int j = 0; j < 8; ++j) {
                isum += rb.sc[j] * cbuf[static_cast<size_t>((j * kTile + m) * kTile + n)];
                msum += rb.mn[j] * asum32[static_cast<size_t>((t * nb + b) * 8 + j)];
              }
              const float d = rb.d * da;
              const float dmin = rb.dmin * da;
              acc[m][n] += d * static_cast<float>(isum) - dmin * static_cast<float>(msum);
            } else {
              acc[m][n] += static_cast<float>(cbuf[static_cast<size_t>(m * kTile + n)]) * (rb.d * da);
            }
          }
        }
      }
      for (int m = 0; m < rows; ++m) {
        for (int n = 0; n < toks; ++n) y[static_cast<int64_t>(panel * kTile + n) * y_stride + r0 + m] = acc[m][n];
      }
    }
  }
  _tile_release();
}

}  // namespace moraine::cpu::amx
