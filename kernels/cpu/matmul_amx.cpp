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

// Unpacks block b of one weight row into 32-byte groups at `out` (group g at out + 32 g), with
// 256-bit operations (every AMX CPU has AVX-512 BW/VL).
void unpack_block(TensorType t, const uint8_t* row, int64_t b, uint8_t* out, RowBlock& rb) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  switch (t) {
    case TensorType::Q8_0: {
      const auto& blk = reinterpret_cast<const BlockQ8_0*>(row)[b];
      std::memcpy(out, blk.qs, kQK);
      rb.d = half::fp16_to_fp32(blk.d);
      break;
    }
    case TensorType::MXFP4: {
      const auto& blk = reinterpret_cast<const BlockMXFP4*>(row)[b];
      const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2M1Doubled));
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.qs));
      const __m128i lo = _mm_and_si128(q, _mm_set1_epi8(0x0f)), hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0f));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_shuffle_epi8(lut, lo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm_shuffle_epi8(lut, hi));
      rb.d = half::e8m0_to_fp32_half(blk.e);
      break;
    }
    case TensorType::Q4_K:
    case TensorType::Q5_K: {
      const bool q5 = t == TensorType::Q5_K;
      const uint8_t* qs = q5 ? reinterpret_cast<const BlockQ5_K*>(row)[b].qs : reinterpret_cast<const BlockQ4_K*>(row)[b].qs;
      const uint8_t* scales = q5 ? reinterpret_cast<const BlockQ5_K*>(row)[b].scales : reinterpret_cast<const BlockQ4_K*>(row)[b].scales;
      const uint16_t d = q5 ? reinterpret_cast<const BlockQ5_K*>(row)[b].d : reinterpret_cast<const BlockQ4_K*>(row)[b].d;
      const uint16_t dmin = q5 ? reinterpret_cast<const BlockQ5_K*>(row)[b].dmin : reinterpret_cast<const BlockQ4_K*>(row)[b].dmin;
      const __m256i qh = q5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const BlockQ5_K*>(row)[b].qh))
                            : _mm256_setzero_si256();
      // qs[32p + l]: element 64p + l (low nibble, sub-block 2p), 64p + 32 + l (high, 2p + 1);
      // Q5_K's fifth bits are bits 2p and 2p + 1 of qh[l].
      for (int p = 0; p < 4; ++p) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p));
        __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        if (q5) {
          const __m256i sixteen = _mm256_set1_epi8(16);
          lo = _mm256_mask_add_epi8(lo, _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << (2 * p)))), lo, sixteen);
          hi = _mm256_mask_add_epi8(hi, _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << (2 * p + 1)))), hi, sixteen);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * p), lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * p + 32), hi);
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
  // Scales and per-32 sums with the 16 tokens of a panel as vector lanes: [panel][block][16]
  // and [panel][block][8][16]; padding tokens stay zero.
  bpack.assign(static_cast<size_t>(n_panels) * static_cast<size_t>(n_groups) * 512, 0);
  ascale.assign(static_cast<size_t>(n_panels) * static_cast<size_t>(nb) * kTile, 0.0f);
  asum32.assign(kq ? static_cast<size_t>(n_panels) * static_cast<size_t>(nb) * 8 * kTile : 0, 0);
  for (int t = 0; t < n_tok; ++t) {
    const auto* arow = static_cast<const uint8_t*>(acts) + static_cast<size_t>(tok ? tok[t] : t) * act_row_bytes;
    const int panel = t / kTile, n = t % kTile;
    for (int64_t b = 0; b < nb; ++b) {
      const size_t pb = static_cast<size_t>(panel) * static_cast<size_t>(nb) + static_cast<size_t>(b);
      const int8_t* qs;
      if (kq) {
        const auto& ab = reinterpret_cast<const BlockQ8_K*>(arow)[b];
        qs = ab.qs;
        ascale[pb * kTile + static_cast<size_t>(n)] = ab.d;
        for (int j = 0; j < 8; ++j) asum32[(pb * 8 + static_cast<size_t>(j)) * kTile + static_cast<size_t>(n)] = ab.bsums[2 * j] + ab.bsums[2 * j + 1];
      } else {
        const auto& ab = reinterpret_cast<const BlockQ8_0*>(arow)[b];
        qs = ab.qs;
        ascale[pb * kTile + static_cast<size_t>(n)] = half::fp16_to_fp32(ab.d);
      }
      for (int g = 0; g < groups_per_block; ++g) {
        uint8_t* dst = bpack.data() + (static_cast<size_t>(panel) * static_cast<size_t>(n_groups) + static_cast<size_t>(b * groups_per_block + g)) * 512;
        for (int k = 0; k < kGroup / 4; ++k) std::memcpy(dst + k * 64 + 4 * n, qs + g * kGroup + 4 * k, 4);
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
      alignas(32) uint8_t tmp[kQK_K];
      for (int64_t b = 0; b < nb; ++b) {
        unpack_block(type, row, b, tmp, rblocks[static_cast<size_t>(m * nb + b)]);
        for (int g = 0; g < groups_per_block; ++g) {
          std::memcpy(apanel.data() + (static_cast<size_t>(b * groups_per_block + g) * kTile + static_cast<size_t>(m)) * kGroup, tmp + g * kGroup, kGroup);
        }
      }
    }
    for (int panel = 0; panel < n_panels; ++panel) {
      const int toks = std::min(kTile, n_tok - panel * kTile);
      // acc[m]: row m's running sums for the panel's 16 tokens (one float lane per token). Each
      // lane sees exactly the reference's operations in the reference's order (mul and add
      // separately; the file is built with -ffp-contract=off), so results are bitwise equal.
      __m512 acc[kTile];
      for (__m512& v : acc) v = _mm512_setzero_ps();
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
        const size_t pb = static_cast<size_t>(panel) * static_cast<size_t>(nb) + static_cast<size_t>(b);
        const __m512 da = _mm512_loadu_ps(ascale.data() + pb * kTile);
        for (int m = 0; m < rows; ++m) {
          const RowBlock& rb = rblocks[static_cast<size_t>(m * nb + b)];
          if (kq) {
            __m512i isum = _mm512_setzero_si512(), msum = _mm512_setzero_si512();
            for (int j = 0; j < 8; ++j) {
              const __m512i c = _mm512_loadu_si512(cbuf.data() + (j * kTile + m) * kTile);
              isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(c, _mm512_set1_epi32(rb.sc[j])));
              const __m512i s32 = _mm512_loadu_si512(asum32.data() + (pb * 8 + static_cast<size_t>(j)) * kTile);
              msum = _mm512_add_epi32(msum, _mm512_mullo_epi32(s32, _mm512_set1_epi32(rb.mn[j])));
            }
            const __m512 d = _mm512_mul_ps(_mm512_set1_ps(rb.d), da);
            const __m512 dmin = _mm512_mul_ps(_mm512_set1_ps(rb.dmin), da);
            const __m512 term = _mm512_sub_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(isum)), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(msum)));
            acc[m] = _mm512_add_ps(acc[m], term);
          } else {
            const __m512 c = _mm512_cvtepi32_ps(_mm512_loadu_si512(cbuf.data() + m * kTile));
            acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(c, _mm512_mul_ps(_mm512_set1_ps(rb.d), da)));
          }
        }
      }
      for (int m = 0; m < rows; ++m) {
        alignas(64) float lanes[kTile];
        _mm512_store_ps(lanes, acc[m]);
        for (int n = 0; n < toks; ++n) y[static_cast<int64_t>(panel * kTile + n) * y_stride + r0 + m] = lanes[n];
      }
    }
  }
  _tile_release();
}

}  // namespace moraine::cpu::amx
