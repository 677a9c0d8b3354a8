// The grouped expert GEMM (kernels/cuda/expert_gemm.h) against a scalar reference on fresh random
// 16-bit operands: many groups of uneven sizes (0, 1, 17, 130, 512 tokens, and Zipf-skewed),
// row counts that are no multiple of the tile, ldy > rows, gaps of X rows no group covers, every
// tile shape (large, small, wide, tall) and both 16-bit input types. The output is poisoned with
// NaN first: every output a tile owns must be written, every other float (the ldy gap, uncovered
// rows) left alone.
//
// Tolerance: the operands are 16-bit values, so each product is exact in float; the kernel adds
// them in float on the tensor cores. As in gemm_prefill_test.cpp each addition may err by 2
// units in float's last place (u_acc = 2^-22; tensor cores align a block of products to its
// largest addend, Fasi et al. 2021), over at most cols + 32 additions: |got - sum| <=
// gamma(cols + 32) * sum |x w|, the reference sum taken in double.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/expert_gemm.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

using cuda::ExpertGemmTile;
using cuda::ExpertTiles;
using cuda::GemmInput;

double gamma_u(int64_t k, double u) { return static_cast<double>(k) * u / (1.0 - static_cast<double>(k) * u); }
uint16_t bits_of(GemmInput t, float v) { return t == GemmInput::BF16 ? fp32_to_bf16(v) : fp32_to_fp16(v); }
float value_of(GemmInput t, uint16_t b) { return t == GemmInput::BF16 ? bf16_to_fp32(b) : fp16_to_fp32(b); }
const char* name_of(GemmInput t) { return t == GemmInput::BF16 ? "bf16" : "f16"; }
const char* name_of(ExpertTiles s) { return cuda::expert_tiles_name(s); }

// Random 16-bit operands and their float values. F16 keeps to |v| < 2^15 (no infinities).
struct Operand {
  std::vector<uint16_t> bits;
  std::vector<float> values;
};
Operand random_operand(GemmInput t, size_t n, std::mt19937& rng) {
  std::vector<float> src = cuda_test::random_values(rng, n);
  Operand o{std::vector<uint16_t>(n), std::vector<float>(n)};
  for (size_t i = 0; i < n; ++i) {
    const float v = t == GemmInput::F16 ? std::fmax(-30000.0f, std::fmin(30000.0f, src[i])) : src[i];
    o.bits[i] = bits_of(t, v);
    o.values[i] = value_of(t, o.bits[i]);
  }
  return o;
}

struct Group {
  int64_t first_row, count;
};

// Runs one launch over `groups` (slot = index) and checks every float of Y.
void check_grouped_gemm(GemmInput type, ExpertTiles shape, int64_t rows, int64_t cols, int64_t ldy,
                        const std::vector<Group>& groups, int64_t x_rows, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t slot_stride = rows * cols + 8;  // a gap between slots: the kernel must use the stride
  const Operand w = random_operand(type, static_cast<size_t>(slot_stride * static_cast<int64_t>(groups.size())), rng);
  const Operand x = random_operand(type, static_cast<size_t>(x_rows * cols), rng);
  std::vector<ExpertGemmTile> tiles;
  for (size_t g = 0; g < groups.size(); ++g)
    cuda::expert_gemm_tiles(shape, static_cast<int32_t>(g), groups[g].first_row, groups[g].count, tiles);
  // The table covers each group's tokens exactly once, in tiles of at most the tile's tokens.
  std::vector<int> covered(static_cast<size_t>(x_rows), 0);
  for (const ExpertGemmTile& t : tiles) {
    ASSERT_GE(t.count, 1);
    ASSERT_LE(t.count, cuda::expert_tile_tokens(shape));
    for (int32_t i = 0; i < t.count; ++i) ++covered[static_cast<size_t>(t.x_row + i)];
  }
  for (const Group& g : groups)
    for (int64_t i = g.first_row; i < g.first_row + g.count; ++i) ASSERT_EQ(covered[static_cast<size_t>(i)], 1) << "row " << i;

  cuda::DeviceBuffer<uint16_t> dw = cuda::uploaded(w.bits), dx = cuda::uploaded(x.bits);
  cuda::DeviceBuffer<ExpertGemmTile> dt = cuda::uploaded(tiles);
  cuda::DeviceBuffer<float> dy(static_cast<size_t>(x_rows * ldy));
  dy.fill_bytes(0xff);  // NaN
  cuda::expert_gemm(type, shape, dw.get(), slot_stride, rows, cols, dx.get(), dt.get(), static_cast<int>(tiles.size()),
                    dy.get(), ldy);
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> y(static_cast<size_t>(x_rows * ldy));
  dy.download(y.data(), y.size());

  std::vector<int> owner(static_cast<size_t>(x_rows), -1);
  for (size_t g = 0; g < groups.size(); ++g)
    for (int64_t i = groups[g].first_row; i < groups[g].first_row + groups[g].count; ++i)
      owner[static_cast<size_t>(i)] = static_cast<int>(g);
  const double u_acc = std::ldexp(1.0, -22);
  int64_t checked = 0, bad = 0;
  std::string first_bad;  // the first few mismatches, for debugging from a log
  for (int64_t i = 0; i < x_rows; ++i)
    for (int64_t r = 0; r < ldy; ++r) {
      const float got = y[static_cast<size_t>(i * ldy + r)];
      const int g = owner[static_cast<size_t>(i)];
      std::string why;
      double want = 0.0, tol = 0.0;
      if (g < 0 || r >= rows) {
        if (!std::isnan(got)) why = g < 0 ? "row of no group written" : "ldy gap written";
      } else {
        const float* xr = x.values.data() + i * cols;
        const float* wr = w.values.data() + static_cast<int64_t>(g) * slot_stride + r * cols;
        double abs_sum = 0.0;
        for (int64_t k = 0; k < cols; ++k) {
          const double p = static_cast<double>(xr[k]) * wr[k];
          want += p;
          abs_sum += std::fabs(p);
        }
        tol = gamma_u(cols + 32, u_acc) * abs_sum;
        if (!(std::fabs(static_cast<double>(got) - want) <= tol)) why = "outside the bound";
        ++checked;
      }
      if (why.empty()) continue;
      if (++bad <= 8)
        first_bad += "\n  Y[" + std::to_string(i) + "][" + std::to_string(r) + "] group " + std::to_string(g) +
                     " token " + std::to_string(g < 0 ? -1 : i - groups[static_cast<size_t>(g)].first_row) + ": " +
                     why + ", got " + std::to_string(got) + ", want " + std::to_string(want) + " +- " +
                     std::to_string(tol);
    }
  ASSERT_EQ(bad, 0) << name_of(type) << "/" << name_of(shape) << " rows=" << rows << " cols=" << cols << " ldy=" << ldy
                    << ": " << bad << " bad outputs of " << x_rows * ldy << "; the first:" << first_bad;
  std::printf("%s/%s rows=%lld cols=%lld ldy=%lld: %zu groups, %zu tiles, %lld outputs within bound\n", name_of(type),
              name_of(shape), static_cast<long long>(rows), static_cast<long long>(cols), static_cast<long long>(ldy),
              groups.size(), tiles.size(), static_cast<long long>(checked));
}

// Groups laid out back to back with a gap of `gap` uncovered rows after each.
std::vector<Group> lay_out(const std::vector<int64_t>& counts, int64_t gap, int64_t* x_rows) {
  std::vector<Group> g;
  int64_t at = 0;
  for (int64_t c : counts) {
    g.push_back({at, c});
    at += c + gap;
  }
  *x_rows = at;
  return g;
}

TEST(ExpertGemm, UnevenGroupsMatchReferenceForBothTypesAndTileShapes) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  // 200 rows: a partial last row tile for both shapes (128 + 72, 3 x 64 + 8); ldy 211 > rows.
  const std::vector<int64_t> counts = {0, 1, 17, 130, 512, 3, 64, 65, 33, 0, 31};
  int64_t x_rows = 0;
  const std::vector<Group> groups = lay_out(counts, 3, &x_rows);
  uint32_t seed = 1000;
  for (GemmInput type : {GemmInput::BF16, GemmInput::F16})
    for (ExpertTiles shape : {ExpertTiles::Large, ExpertTiles::Small, ExpertTiles::Wide, ExpertTiles::Tall})
      check_grouped_gemm(type, shape, 200, 256, 211, groups, x_rows, ++seed);
}

// A 30B-shaped down projection's K (768) and its gate/up rows (768) on a Zipf-skewed split of
// 1000 tokens over 24 experts (counts ~ 1 / rank, at least 0), as a router's uneven load.
TEST(ExpertGemm, ZipfSkewedGroupsMatchReference) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  constexpr int kGroups = 24;
  constexpr int64_t kTokens = 1000;
  double h = 0.0;
  for (int e = 0; e < kGroups; ++e) h += 1.0 / (e + 1);
  std::vector<int64_t> counts;
  for (int e = 0; e < kGroups; ++e) counts.push_back(static_cast<int64_t>(std::floor(kTokens / h / (e + 1))));
  std::shuffle(counts.begin(), counts.end(), std::mt19937(77));
  int64_t x_rows = 0;
  const std::vector<Group> groups = lay_out(counts, 0, &x_rows);
  check_grouped_gemm(GemmInput::BF16, ExpertTiles::Large, 96, 768, 96, groups, x_rows, 2001);
  check_grouped_gemm(GemmInput::BF16, ExpertTiles::Small, 96, 768, 96, groups, x_rows, 2002);
  check_grouped_gemm(GemmInput::BF16, ExpertTiles::Wide, 96, 768, 96, groups, x_rows, 2004);
  check_grouped_gemm(GemmInput::F16, ExpertTiles::Wide, 300, 512, 301, groups, x_rows, 2005);
  check_grouped_gemm(GemmInput::BF16, ExpertTiles::Tall, 300, 512, 300, groups, x_rows, 2006);
  check_grouped_gemm(GemmInput::F16, ExpertTiles::Small, 768, 96 * 8, 770, {{0, 40}, {40, 7}}, 47, 2003);
}

// Q4_K / Q6_K weights decoded inside the kernel (expert_gemm_fused) against the expanded path
// (dequantize_weights + expert_gemm with the same tiles) on the kType matrices `mats` (one per
// group, rows x cols, separate allocations: the pointer table): bit for bit, NaN poison left
// alone outside the tiles, and (check_bound) within the bound of the scalar reference on the
// expanded 16-bit values. Both input types, every tile shape.
void check_fused_equals_expanded(TensorType weight_type, const char* what, const std::vector<std::vector<uint8_t>>& mats,
                                 int64_t rows, int64_t cols, int64_t ldy, const std::vector<Group>& groups,
                                 int64_t x_rows, bool check_bound, std::mt19937& rng) {
  const int n_groups = static_cast<int>(groups.size());
  ASSERT_EQ(mats.size(), groups.size());
  std::vector<cuda::DeviceBuffer<uint8_t>> dw;
  std::vector<const void*> ptrs;
  for (const std::vector<uint8_t>& m : mats) {
    dw.push_back(cuda::uploaded(m));
    ptrs.push_back(dw.back().get());
  }
  cuda::DeviceBuffer<const void*> dptrs = cuda::uploaded(ptrs);
  const int64_t elems = rows * cols;
  for (GemmInput type : {GemmInput::BF16, GemmInput::F16}) {
    cuda::DeviceBuffer<uint16_t> expanded(static_cast<size_t>(elems * n_groups));
    cuda::dequantize_weights(weight_type, ptrs.data(), n_groups, elems, type, expanded.get());
    std::vector<uint16_t> wbits(expanded.size());
    expanded.download(wbits.data(), wbits.size());
    const Operand x = random_operand(type, static_cast<size_t>(x_rows * cols), rng);
    cuda::DeviceBuffer<uint16_t> dx = cuda::uploaded(x.bits);
    for (ExpertTiles shape : {ExpertTiles::Large, ExpertTiles::Small, ExpertTiles::Wide, ExpertTiles::Tall}) {
      const std::string name = std::string(name_of(type)) + "/" + name_of(shape);
      std::vector<ExpertGemmTile> tiles;
      for (int g = 0; g < n_groups; ++g) {
        const Group& gr = groups[static_cast<size_t>(g)];
        cuda::expert_gemm_tiles(shape, g, gr.first_row, gr.count, tiles);
      }
      cuda::DeviceBuffer<ExpertGemmTile> dt = cuda::uploaded(tiles);
      cuda::DeviceBuffer<float> y_expanded(static_cast<size_t>(x_rows * ldy)), y_fused(y_expanded.size());
      y_expanded.fill_bytes(0xff);
      y_fused.fill_bytes(0xff);
      cuda::expert_gemm(type, shape, expanded.get(), elems, rows, cols, dx.get(), dt.get(),
                        static_cast<int>(tiles.size()), y_expanded.get(), ldy);
      cuda::expert_gemm_fused(weight_type, type, shape, dptrs.get(), rows, cols, dx.get(), dt.get(),
                              static_cast<int>(tiles.size()), y_fused.get(), ldy);
      CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<float> a(y_expanded.size()), b(y_fused.size());
      y_expanded.download(a.data(), a.size());
      y_fused.download(b.data(), b.size());
      int64_t written = 0;
      for (int g = 0; check_bound && g < n_groups; ++g) {
        const Group& gr = groups[static_cast<size_t>(g)];
        for (int64_t i = gr.first_row; i < gr.first_row + gr.count; ++i)
          for (int64_t r = 0; r < rows; ++r) {
            const size_t at = static_cast<size_t>(i * ldy + r);
            double exact = 0.0, abs_sum = 0.0;
            for (int64_t k = 0; k < cols; ++k) {
              const double p = static_cast<double>(x.values[static_cast<size_t>(i * cols + k)]) *
                               value_of(type, wbits[static_cast<size_t>(g * elems + r * cols + k)]);
              exact += p;
              abs_sum += std::fabs(p);
            }
            const double tol = gamma_u(cols + 32, std::ldexp(1.0, -22)) * abs_sum;
            ASSERT_LE(std::fabs(static_cast<double>(b[at]) - exact), tol)
                << what << " fused " << name << ": first mismatch at Y[" << i
                << "][" << r << "] (group " << g << "): got " << b[at] << ", want " << exact << " +- " << tol
                << " (expanded path " << a[at] << ")";
            ++written;
          }
      }
      int64_t equal = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        if (std::isnan(a[i])) {
          ASSERT_TRUE(std::isnan(b[i])) << what << " fused " << name << " wrote flat index " << i
                                        << " outside every tile";
        } else {
          ASSERT_EQ(a[i], b[i]) << what << " fused vs expanded " << name << " at Y[" << i / ldy << "][" << i % ldy
                                << "]";
          ++equal;
        }
      }
      std::printf("%s fused %s %s: %lld outputs equal to the expanded path, %lld within bound\n", what,
                  std::string(type_name(weight_type)).c_str(), name.c_str(), static_cast<long long>(equal), static_cast<long long>(written));
    }
  }
}

// Uneven groups, partial row tile (200 rows), ldy > rows, weights quantized from random values.
void check_fused_on_quantized_values(TensorType type, int64_t cols, unsigned seed) {
  constexpr int64_t kRows = 200, kLdy = 203;
  const std::vector<int64_t> counts = {5, 0, 1, 17, 130, 64, 33};
  int64_t x_rows = 0;
  const std::vector<Group> groups = lay_out(counts, 2, &x_rows);
  std::mt19937 rng(seed);
  const size_t rb = row_bytes(type, cols);
  std::vector<std::vector<uint8_t>> mats;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::vector<float> src = cuda_test::random_values(rng, static_cast<size_t>(kRows * cols));
    std::vector<uint8_t> bytes(rb * kRows);
    for (int64_t r = 0; r < kRows; ++r) quantize_row(type, src.data() + r * cols, bytes.data() + r * rb, cols);
    mats.push_back(std::move(bytes));
  }
  check_fused_equals_expanded(type, "quantized", mats, kRows, cols, kLdy, groups, x_rows, true, rng);
}

TEST(ExpertGemm, FusedQ4KEqualsExpandedPathBitForBit) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  check_fused_on_quantized_values(TensorType::Q4_K, 512, 3001);
}

// Q4_K blocks of random BYTES: every 6-bit scale and min, and fp16 d / dmin of random sign over
// exponents 0..20 (subnormals up to 64, so the F16 expansion stays finite), so d * sc * q and
// dmin * m meet at every relative magnitude. The fused decode reaches the expanded path's
// values by other instructions (an fma for its multiply-then-subtract, float(q) without a
// conversion): this holds it to the same bits where roundings would show.
TEST(ExpertGemm, FusedQ4KEqualsExpandedPathOnRandomBlocks) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  constexpr int64_t kRows = 136, kCols = 768, kLdy = 136;
  const std::vector<int64_t> counts = {3, 40, 1, 70};
  int64_t x_rows = 0;
  const std::vector<Group> groups = lay_out(counts, 1, &x_rows);
  std::mt19937 rng(3002);
  std::uniform_int_distribution<int> byte(0, 255), exponent(0, 20), mantissa(0, 1023), sign(0, 1);
  const auto random_half = [&] {
    return static_cast<uint16_t>((sign(rng) << 15) | (exponent(rng) << 10) | mantissa(rng));
  };
  const size_t rb = row_bytes(TensorType::Q4_K, kCols);
  ASSERT_EQ(rb % 144, 0u);
  std::vector<std::vector<uint8_t>> mats;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<uint8_t> bytes(rb * kRows);
    for (size_t blk = 0; blk < bytes.size(); blk += 144) {
      const uint16_t d = random_half(), dmin = random_half();
      bytes[blk] = static_cast<uint8_t>(d & 0xff);
      bytes[blk + 1] = static_cast<uint8_t>(d >> 8);
      bytes[blk + 2] = static_cast<uint8_t>(dmin & 0xff);
      bytes[blk + 3] = static_cast<uint8_t>(dmin >> 8);
      for (size_t i = 4; i < 144; ++i) bytes[blk + i] = static_cast<uint8_t>(byte(rng));
    }
    mats.push_back(std::move(bytes));
  }
  check_fused_equals_expanded(TensorType::Q4_K, "random blocks", mats, kRows, kCols, kLdy, groups, x_rows, false, rng);
}

// Q6_K, quantized from random values: 768 columns make 630-byte rows, so rows and super-blocks
// sit at every even offset mod 16 (the kernel fetches aligned windows around them).
TEST(ExpertGemm, FusedQ6KEqualsExpandedPathBitForBit) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  ASSERT_NE(row_bytes(TensorType::Q6_K, 768) % 16, 0u);
  check_fused_on_quantized_values(TensorType::Q6_K, 768, 3003);
}

// Q6_K blocks of random BYTES: every quant, every int8 scale (-128..127), fp16 d of random sign
// over exponents 0..17 (|d * sc * (q - 32)| < 8 * 128 * 32, finite in F16), 1280 columns (rows
// of 1050 bytes, odd super-block counts per row): the fused decode (float(q - 32) without a
// conversion, words by funnel shifts from an aligned window) held to the expanded path's bits.
TEST(ExpertGemm, FusedQ6KEqualsExpandedPathOnRandomBlocks) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  constexpr int64_t kRows = 136, kCols = 1280, kLdy = 136;
  const std::vector<int64_t> counts = {3, 40, 1, 70};
  int64_t x_rows = 0;
  const std::vector<Group> groups = lay_out(counts, 1, &x_rows);
  std::mt19937 rng(3004);
  std::uniform_int_distribution<int> byte(0, 255), exponent(0, 17), mantissa(0, 1023), sign(0, 1);
  const size_t rb = row_bytes(TensorType::Q6_K, kCols);
  ASSERT_EQ(rb % 210, 0u);
  std::vector<std::vector<uint8_t>> mats;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<uint8_t> bytes(rb * kRows);
    for (size_t blk = 0; blk < bytes.size(); blk += 210) {
      for (size_t i = 0; i < 208; ++i) bytes[blk + i] = static_cast<uint8_t>(byte(rng));
      const auto d = static_cast<uint16_t>((sign(rng) << 15) | (exponent(rng) << 10) | mantissa(rng));
      bytes[blk + 208] = static_cast<uint8_t>(d & 0xff);
      bytes[blk + 209] = static_cast<uint8_t>(d >> 8);
    }
    mats.push_back(std::move(bytes));
  }
  check_fused_equals_expanded(TensorType::Q6_K, "random blocks", mats, kRows, kCols, kLdy, groups, x_rows, false, rng);
}

// Argument checks come before any CUDA call, so these run without a device too.
TEST(ExpertGemmArguments, RejectsBadShapesPointersAndTiles) {
  const void* p = reinterpret_cast<const void*>(uintptr_t{4096});
  const auto* t = reinterpret_cast<const ExpertGemmTile*>(uintptr_t{8192});
  float* y = reinterpret_cast<float*>(uintptr_t{16384});
  const auto call = [&](int64_t rows, int64_t cols, int64_t stride, const void* w, int64_t ldy) {
    cuda::expert_gemm(GemmInput::BF16, ExpertTiles::Large, w, stride, rows, cols, p, t, 1, y, ldy);
  };
  EXPECT_THROW(call(64, 48, 64 * 48, p, 64), std::invalid_argument);       // cols not a multiple of 32
  EXPECT_THROW(call(0, 64, 64, p, 64), std::invalid_argument);             // no rows
  EXPECT_THROW(call(64, 64, 64 * 64, p, 63), std::invalid_argument);       // ldy < rows
  EXPECT_THROW(call(64, 64, 64 * 64 - 8, p, 64), std::invalid_argument);   // slots overlap
  EXPECT_THROW(call(64, 64, 64 * 64 + 4, p, 64), std::invalid_argument);   // slot stride breaks 16-byte alignment
  EXPECT_THROW(call(64, 64, 64 * 64, reinterpret_cast<const void*>(uintptr_t{4098}), 64), std::invalid_argument);
  EXPECT_THROW(call(64, 64, 64 * 64, nullptr, 64), std::invalid_argument);
  std::vector<ExpertGemmTile> tiles;
  const auto* ptrs = reinterpret_cast<const void* const*>(uintptr_t{4096});
  EXPECT_THROW(cuda::expert_gemm_fused(TensorType::Q5_K, GemmInput::BF16, ExpertTiles::Large, ptrs, 64, 256, p, t, 1, y, 64),
               std::invalid_argument);  // only q4_k and q6_k decode in the kernel
  EXPECT_THROW(cuda::expert_gemm_fused(TensorType::Q6_K, GemmInput::BF16, ExpertTiles::Large, ptrs, 64, 320, p, t, 1, y, 64),
               std::invalid_argument);  // cols not whole super-blocks
  EXPECT_THROW(cuda::expert_gemm_fused(TensorType::Q4_K, GemmInput::BF16, ExpertTiles::Large, ptrs, 64, 320, p, t, 1, y, 64),
               std::invalid_argument);  // cols not whole super-blocks
  EXPECT_THROW(cuda::expert_gemm_tiles(ExpertTiles::Small, 0, -1, 5, tiles), std::invalid_argument);
  EXPECT_THROW(cuda::expert_gemm_tiles(ExpertTiles::Small, 0, int64_t{1} << 31, 5, tiles), std::invalid_argument);
  cuda::expert_gemm_tiles(ExpertTiles::Small, 3, 10, 0, tiles);
  EXPECT_TRUE(tiles.empty());
  cuda::expert_gemm_tiles(ExpertTiles::Large, 3, 10, 130, tiles);
  ASSERT_EQ(tiles.size(), 3u);
  EXPECT_EQ(tiles[2].x_row, 138);
  EXPECT_EQ(tiles[2].count, 2);
  EXPECT_EQ(tiles[2].slot, 3);
}

}  // namespace
}  // namespace moraine
