// Every multi-token kernel path (each tier the CPU has, chosen through MatvecTuning::max_isa) against
// the scalar reference dot, for every expert format, every batch size 1..16 and a prefill size,
// odd row counts. K-quant kernels keep exact integer sums and the reference's float order, so
// they must match bitwise; the Q8_0/MXFP4 SIMD kernels sum block terms per lane instead of in
// block order, so they may differ by twice the recursive-summation bound
// (additions + slack) * 2^-24 * sum |block terms| (the same bound tests/formats uses).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "kernels/cpu/matvec.h"
#include "kernels/cpu/vec_dot.h"
#include "tests/cpu_kernels/tiers.h"
#include "tests/formats/dot_bounds.h"
#include "tests/formats/random_rows.h"

namespace moraine {
namespace {

constexpr double kU = 1.0 / (1 << 24);
constexpr TensorType kExpertFormats[] = {TensorType::Q4_K, TensorType::Q5_K, TensorType::Q6_K, TensorType::Q8_0,
                                         TensorType::Q2_K, TensorType::Q3_K, TensorType::MXFP4,
                                         TensorType::Q4_1, TensorType::Q5_0, TensorType::Q5_1, TensorType::IQ4_NL, TensorType::IQ4_XS,
                                         TensorType::TQ1_0, TensorType::TQ2_0};

bool exact_kernels(TensorType t) { return t != TensorType::Q8_0 && t != TensorType::MXFP4; }

struct Matrix {
  TensorType type;
  int64_t rows, cols;
  std::vector<uint8_t> q;       // rows x row_bytes
  std::vector<float> deq;       // rows x cols
  size_t rb;
};

Matrix random_matrix(TensorType t, int64_t rows, int64_t cols, uint32_t seed) {
  Matrix m{t, rows, cols, std::vector<uint8_t>(row_bytes(t, cols) * static_cast<size_t>(rows)), std::vector<float>(static_cast<size_t>(rows * cols)),
           row_bytes(t, cols)};
  for (int64_t r = 0; r < rows; ++r) {
    const auto dist = test::kAllDists[r % 3];
    const std::vector<float> x = test::random_row(dist, cols, seed + static_cast<uint32_t>(r));
    quantize_row(t, x.data(), m.q.data() + static_cast<size_t>(r) * m.rb, cols);
    dequantize_row(t, m.q.data() + static_cast<size_t>(r) * m.rb, m.deq.data() + r * cols, cols);
  }
  return m;
}

// y = weight row r of m . activation row a (its quantized bytes at act_row, its exact values in
// row a of a_deq) against the scalar reference dot: equal when `exact`, else within the float
// order bound of the block sums, 2 (blocks + 20) u sum |w x|.
void check_dot(const Matrix& m, int64_t r, const uint8_t* act_row, const std::vector<float>& a_deq, size_t a, bool exact,
               float y, const std::string& where) {
  const uint8_t* wrow = m.q.data() + static_cast<size_t>(r) * m.rb;
  const float ref = vec_dot_reference(m.type, m.cols, wrow, act_row);
  if (exact) {
    ASSERT_EQ(y, ref) << where;
    return;
  }
  const std::vector<uint8_t> wq(wrow, wrow + m.rb);
  const std::vector<float> wd(m.deq.begin() + r * m.cols, m.deq.begin() + (r + 1) * m.cols);
  const std::vector<float> ad(a_deq.begin() + static_cast<int64_t>(a) * m.cols, a_deq.begin() + static_cast<int64_t>(a + 1) * m.cols);
  const double adds = static_cast<double>(m.cols / type_traits(m.type).block_elems) + 16.0;
  ASSERT_NEAR(y, ref, 2.0 * (adds + 4.0) * kU * test::dot_magnitude(m.type, wq, wd, ad)) << where;
}

TEST(MatvecTokens, EqualsScalarReferenceEveryTierFormatAndBatch) {
  constexpr int64_t kCols = 512, kRows = 37;  // two super-blocks; an odd row count
  constexpr int kMaxTok = 72;  // 1..16 (decode, verify window) and 72 (prefill; > 64: two token chunks of the tiles)
  int checked = 0, amx_checked = 0;
  for (TensorType t : kExpertFormats) {
    const Matrix m = random_matrix(t, kRows, kCols, 100 * static_cast<uint32_t>(t));
    const TensorType at = dot_activation_type(t);
    // The kMaxTok activation rows the dot kernels take (quantized) and their exact values.
    const Matrix acts_m = random_matrix(at, kMaxTok, kCols, 9000);
    const size_t arb = acts_m.rb;
    const std::vector<uint8_t>& acts = acts_m.q;
    const std::vector<float>& a_deq = acts_m.deq;
    // Tokens gathered out of order, as an expert's routed subset is.
    std::vector<int32_t> tok(kMaxTok);
    for (int i = 0; i < kMaxTok; ++i) tok[static_cast<size_t>(i)] = (i * 7 + 3) % kMaxTok;
    // Each tier, and on the VNNI tiers both the newer tiles (MatvecTiles) and the older ones.
    for (int tiles = 0; tiles < 2; ++tiles)
    for (cpu::CpuIsa isa : test::available_tiers()) {
      if (tiles == 1 && isa < cpu::CpuIsa::Avx512Vnni) continue;
      cpu::MatvecTuning tu;
      tu.tiles = {tiles == 0, tiles == 0, tiles == 0};
      tu.max_isa = isa;
      std::vector<int> batches;
      for (int n = 1; n <= 16; ++n) batches.push_back(n);
      batches.push_back(kMaxTok);
      for (int n_tok : batches) {
        if (cpu::matvec_uses_amx(t, n_tok, tu)) ++amx_checked;
        std::vector<float> y(static_cast<size_t>(n_tok * kRows), NAN);
        // Rows [3, 36): a slice not starting at 0, of odd length.
        cpu::matvec_tokens(t, kCols, m.q.data(), 3, kRows, acts.data(), arb, tok.data(), n_tok, y.data(), kRows, tu);
        for (int i = 0; i < n_tok; ++i) {
          const size_t ti = static_cast<size_t>(tok[static_cast<size_t>(i)]);
          for (int64_t r = 3; r < kRows; ++r) {
            const std::string where = std::string(type_name(t)) + " " + std::string(cpu::isa_name(isa)) + (tiles ? " older tiles" : "") +
                                      " n_tok " + std::to_string(n_tok) +
                                      " row " + std::to_string(r) + " token " + std::to_string(ti);
            // The AMX prefill path is exact for every format it takes (integer tile sums, the
            // reference's float expression per block in block order).
            const bool exact = exact_kernels(t) || isa == cpu::CpuIsa::Scalar || cpu::matvec_uses_amx(t, n_tok, tu);
            ASSERT_NO_FATAL_FAILURE(
                check_dot(m, r, acts.data() + ti * arb, a_deq, ti, exact, y[static_cast<size_t>(i * kRows + r)], where));
            ++checked;
          }
          EXPECT_TRUE(std::isnan(y[static_cast<size_t>(i * kRows + 2)])) << "row 2 is outside the slice and must stay untouched";
        }
      }
    }
  }
  EXPECT_GT(checked, 0);
  if (cpu::hardware_cpu_isa() == cpu::CpuIsa::Amx) {
    EXPECT_GT(amx_checked, 0) << "this CPU has AMX: the prefill size must have gone through it";
  } else {
    std::printf("no AMX on this CPU: the AMX prefill path was not exercised\n");
  }
}

// The cap picks the tier: capped at scalar, the dispatched kernel is the reference kernel, and
// the AVX2 tier serves Q4_K, Q8_0 and MXFP4 when the CPU has it; no cap is the CPU's own tier.
TEST(IsaCap, SelectsTheTierAndFallsBack) {
  EXPECT_EQ(cpu::capped_isa(cpu::CpuIsa::Scalar), cpu::CpuIsa::Scalar);
  EXPECT_EQ(cpu::capped_isa(cpu::CpuIsa::Amx), cpu::hardware_cpu_isa());
  for (TensorType t : kExpertFormats) {
    EXPECT_EQ(cpu::best_vec_dot_fn(t, cpu::CpuIsa::Scalar), cpu::vec_dot_fn(t, cpu::CpuIsa::Scalar)) << type_name(t);
    EXPECT_EQ(cpu::best_vec_dot_fn(t), cpu::best_vec_dot_fn(t, cpu::hardware_cpu_isa())) << type_name(t);
    if (cpu::hardware_cpu_isa() >= cpu::CpuIsa::Avx2) {
      const bool has_avx2 = t == TensorType::Q4_K || t == TensorType::Q8_0 || t == TensorType::MXFP4 || t == TensorType::Q4_1 ||
                            t == TensorType::Q5_0 || t == TensorType::Q5_1 || t == TensorType::IQ4_NL || t == TensorType::IQ4_XS;
      EXPECT_EQ(cpu::vec_dot_fn(t, cpu::CpuIsa::Avx2) != nullptr, has_avx2) << type_name(t);
      EXPECT_EQ(cpu::best_vec_dot_fn(t, cpu::CpuIsa::Avx2), has_avx2 ? cpu::vec_dot_fn(t, cpu::CpuIsa::Avx2) : cpu::vec_dot_fn(t, cpu::CpuIsa::Scalar))
          << type_name(t);
    } else {
      EXPECT_EQ(cpu::vec_dot_fn(t, cpu::CpuIsa::Avx2), nullptr) << "a tier above the CPU's has no kernel";
    }
  }
  EXPECT_EQ(cpu::parse_isa("avx2"), cpu::CpuIsa::Avx2);
  EXPECT_EQ(cpu::parse_isa("sse9"), std::nullopt);
}

// Q8_0 / MXFP4 rows of any block count (the tiles step over two or four blocks and must take
// a last partial step), with each of their tiles (MatvecTiles: the VBMI four-block tiles when
// the CPU has VBMI; the block-pair tiles), against the reference within the bound.
TEST(MatvecTokens, LegacyFormatsAnyBlockCountEveryTile) {
  constexpr int64_t kRows = 11;
  constexpr int kMaxTok = 6;
  int checked = 0;
  for (TensorType t : {TensorType::MXFP4, TensorType::Q8_0}) {
    for (int64_t cols : {32, 64, 96, 128, 160, 224, 480}) {
      const Matrix m = random_matrix(t, kRows, cols, 7 * static_cast<uint32_t>(cols) + static_cast<uint32_t>(t));
      const TensorType at = dot_activation_type(t);
      // The kMaxTok activation rows the dot kernels take (quantized) and their exact values.
      const Matrix acts_m = random_matrix(at, kMaxTok, cols, 500 + 10 * static_cast<uint32_t>(cols));
      const size_t arb = acts_m.rb;
      const std::vector<uint8_t>& acts = acts_m.q;
      const std::vector<float>& a_deq = acts_m.deq;
      for (int tiles = 0; tiles < 2; ++tiles) {
        const bool vbmi = tiles == 0;
        for (cpu::CpuIsa isa : test::available_tiers()) {
          cpu::MatvecTuning tu;
          tu.tiles = {vbmi, vbmi, vbmi};
          tu.max_isa = isa;
          for (int n_tok = 1; n_tok <= kMaxTok; ++n_tok) {
            std::vector<float> y(static_cast<size_t>(n_tok * kRows), NAN);
            // Rows [1, 11): two tiles of four and two rows through the per-row kernel.
            cpu::matvec_tokens(t, cols, m.q.data(), 1, kRows, acts.data(), arb, nullptr, n_tok, y.data(), kRows, tu);
            for (int i = 0; i < n_tok; ++i) {
              for (int64_t r = 1; r < kRows; ++r) {
                const std::string where = std::string(type_name(t)) + " " + std::string(cpu::isa_name(isa)) + " cols " +
                                          std::to_string(cols) + " tiles " + std::to_string(tiles) + " n_tok " +
                                          std::to_string(n_tok) + " row " + std::to_string(r);
                ASSERT_NO_FATAL_FAILURE(check_dot(m, r, acts.data() + static_cast<size_t>(i) * arb, a_deq,
                                                  static_cast<size_t>(i), false, y[static_cast<size_t>(i * kRows + r)], where));
                ++checked;
              }
              EXPECT_TRUE(std::isnan(y[static_cast<size_t>(i * kRows)])) << "row 0 is outside the slice";
            }
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 0);
}

// The prefetch distances (none, short and long, the packed tiles' spread stream near and far)
// leave every result bitwise as it is without any software prefetch.
TEST(MatvecTokens, PrefetchDistancesChangeNothing) {
  constexpr int64_t kCols = 512, kRows = 21;
  for (TensorType t : kExpertFormats) {
    const Matrix m = random_matrix(t, kRows, kCols, 31 + static_cast<uint32_t>(t));
    const TensorType at = dot_activation_type(t);
    const size_t arb = row_bytes(at, kCols);
    std::vector<uint8_t> acts(arb * 3);
    for (int i = 0; i < 3; ++i) {
      const std::vector<float> x = test::random_row(test::kAllDists[i % 3], kCols, 40 + static_cast<uint32_t>(i));
      quantize_row(at, x.data(), acts.data() + static_cast<size_t>(i) * arb, kCols);
    }
    for (int n_tok = 1; n_tok <= 3; ++n_tok) {
      cpu::MatvecTuning none;
      none.prefetch = {0, 8192};
      std::vector<float> plain(static_cast<size_t>(n_tok * kRows)), prefetched(plain.size());
      cpu::matvec_tokens(t, kCols, m.q.data(), 2, kRows, acts.data(), arb, nullptr, n_tok, plain.data(), kRows, none);
      for (const cpu::MatvecPrefetch pf : {cpu::MatvecPrefetch{}, cpu::MatvecPrefetch{256, 256}, cpu::MatvecPrefetch{1024, 512},
                                           cpu::MatvecPrefetch{4096, 1024}, cpu::MatvecPrefetch{64, 65536}, cpu::MatvecPrefetch{65536, 64}}) {
        cpu::MatvecTuning tu;
        tu.prefetch = pf;
        std::fill(prefetched.begin(), prefetched.end(), 0.0f);
        cpu::matvec_tokens(t, kCols, m.q.data(), 2, kRows, acts.data(), arb, nullptr, n_tok, prefetched.data(), kRows, tu);
        for (size_t i = 0; i < plain.size(); ++i) {
          ASSERT_EQ(plain[i], prefetched[i]) << type_name(t) << " n_tok " << n_tok << " prefetch " << pf.l1_bytes << "/" << pf.spread_l1_bytes << " at " << i;
        }
      }
    }
  }
}

// matvec_tokens_runs (several runs walked side by side): every run's results are bitwise
// matvec_tokens' on that run alone and meet the scalar reference's contract (exact for the
// k-quants), with the runs interleaved (the spread prefetch at the default, a short and a long
// per-run distance) and taken one after the other (no software prefetch, older tiles, every
// tier); rows outside the runs stay untouched.
TEST(MatvecTokensRuns, EachRunEqualsMatvecTokensAndTheReference) {
  constexpr int64_t kCols = 512, kRows = 45;
  constexpr int kMaxTok = 5;
  int checked = 0;
  for (TensorType t : kExpertFormats) {
    const Matrix gate = random_matrix(t, kRows, kCols, 300 + static_cast<uint32_t>(t));
    const Matrix up = random_matrix(t, kRows, kCols, 600 + static_cast<uint32_t>(t));
    const TensorType at = dot_activation_type(t);
    // The kMaxTok activation rows the dot kernels take (quantized) and their exact values.
    const Matrix acts_m = random_matrix(at, kMaxTok, kCols, 1200);
    const size_t arb = acts_m.rb;
    const std::vector<uint8_t>& acts = acts_m.q;
    const std::vector<float>& a_deq = acts_m.deq;
    std::vector<int32_t> tok(kMaxTok);
    for (int i = 0; i < kMaxTok; ++i) tok[static_cast<size_t>(i)] = (i * 3 + 1) % kMaxTok;
    for (int variant = 0; variant < 5; ++variant) {
      for (cpu::CpuIsa isa : test::available_tiers()) {
        cpu::MatvecTuning tu;
        tu.max_isa = isa;
        if (variant == 1) tu.prefetch.spread_l1_bytes = 256;      // each run 2 KB ahead (the floor)
        if (variant == 2) tu.prefetch.spread_l1_bytes = 1 << 20;  // each run far ahead
        if (variant == 3) tu.prefetch.l1_bytes = 0;               // no software prefetch: one run after the other
        if (variant == 4) tu.tiles = {false, false, false};        // the older tiles: one run after the other
        for (int n_tok = 1; n_tok <= kMaxTok; ++n_tok) {
          std::vector<float> gy(static_cast<size_t>(n_tok * kRows), NAN), uy(gy.size(), NAN);
          // Runs of 13 (a partial last tile), 0, 45, 13, 8 and 1 rows; gate rows 0 and 44 outside.
          const cpu::MatvecRun runs[] = {{gate.q.data(), 1, 14, gy.data()}, {up.q.data(), 5, 5, uy.data()}, {up.q.data(), 0, kRows, uy.data()},
                                         {gate.q.data(), 14, 27, gy.data()}, {gate.q.data(), 27, 35, gy.data()}, {gate.q.data(), 43, 44, gy.data()},
                                         {gate.q.data(), 35, 43, gy.data()}};
          cpu::matvec_tokens_runs(t, kCols, runs, 7, acts.data(), arb, tok.data(), n_tok, kRows, tu);
          for (const cpu::MatvecRun& run : runs) {
            const Matrix& m = run.y == gy.data() ? gate : up;
            std::vector<float> alone(gy.size(), NAN);
            cpu::matvec_tokens(t, kCols, m.q.data(), run.row_begin, run.row_end, acts.data(), arb, tok.data(), n_tok, alone.data(), kRows, tu);
            for (int i = 0; i < n_tok; ++i) {
              const size_t ti = static_cast<size_t>(tok[static_cast<size_t>(i)]);
              for (int64_t r = run.row_begin; r < run.row_end; ++r) {
                const float got = run.y[i * kRows + r];
                const std::string where = std::string(type_name(t)) + " " + std::string(cpu::isa_name(isa)) + " variant " + std::to_string(variant) +
                                          " n_tok " + std::to_string(n_tok) + " run [" + std::to_string(run.row_begin) + ", " +
                                          std::to_string(run.row_end) + ") row " + std::to_string(r);
                ASSERT_EQ(got, alone[static_cast<size_t>(i * kRows + r)]) << where;
                ASSERT_NO_FATAL_FAILURE(check_dot(m, r, acts.data() + ti * arb, a_deq, ti,
                                                  exact_kernels(t) || isa == cpu::CpuIsa::Scalar, got, where));
                ++checked;
              }
            }
          }
          for (int i = 0; i < n_tok; ++i) {
            EXPECT_TRUE(std::isnan(gy[static_cast<size_t>(i * kRows)])) << "gate row 0 is in no run";
            EXPECT_TRUE(std::isnan(gy[static_cast<size_t>(i * kRows + 44)])) << "gate row 44 is in no run";
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 0);
  // More runs than it takes: a clear error, not an overrun.
  std::vector<uint8_t> w(row_bytes(TensorType::Q8_0, 32) * 4), a(row_bytes(TensorType::Q8_0, 32));
  std::vector<float> y(4);
  const std::vector<cpu::MatvecRun> many(17, cpu::MatvecRun{w.data(), 0, 4, y.data()});
  EXPECT_THROW(cpu::matvec_tokens_runs(TensorType::Q8_0, 32, many.data(), 17, a.data(), a.size(), nullptr, 1, 4, {}), std::invalid_argument);
}

TEST(MatvecTokens, RejectsTypesWithoutKernel) {
  std::vector<uint8_t> w(64), a(64);
  float y = 0.0f;
  EXPECT_THROW(cpu::matvec_tokens(TensorType::I32, 32, w.data(), 0, 1, a.data(), 34, nullptr, 1, &y, 1, {}), std::invalid_argument);
}

}  // namespace
}  // namespace moraine
