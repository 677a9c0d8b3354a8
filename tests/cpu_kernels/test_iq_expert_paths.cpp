// The IQ grid formats through the paths the cpu_expert_worker and the reference executor use:
// matvec_tokens (every tier, batches 1..16 and a prefill size, gathered tokens, a row slice) is
// bitwise the scalar reference dot, and MoeFfn::run_expert on IQ experts (mixed with the
// k-quants, as hub "UD" files mix them) is bitwise reference::swiglu_expert. Weights are random
// blocks (moraine does not write IQ types).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/formats/quant.h"
#include "common/formats/quant_iq.h"
#include "common/reference/moe_parts.h"
#include "kernels/cpu/cpu_topology.h"
#include "kernels/cpu/expert_ffn.h"
#include "kernels/cpu/matvec.h"
#include "kernels/cpu/vec_dot.h"
#include "tests/cpu_kernels/tiers.h"
#include "tests/formats/random_iq_blocks.h"
#include "tests/formats/random_rows.h"

namespace moraine {
namespace {

using test::kIqGridTypes;

// Rows x cols of random blocks: IQ types from random bytes; others quantized from floats.
std::vector<uint8_t> random_matrix(TensorType t, int64_t rows, int64_t cols, uint32_t seed, float log2_lo, float log2_hi) {
  std::vector<uint8_t> m;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<uint8_t> row;
    if (formats::is_iq_grid_type(t)) {
      row = test::random_iq_row(t, cols, seed + static_cast<uint32_t>(r), log2_lo, log2_hi);
    } else {
      std::vector<float> x = test::random_row(test::kAllDists[r % 3], cols, seed + static_cast<uint32_t>(r));
      for (float& v : x) v *= 0.08f;
      row.resize(row_bytes(t, cols));
      quantize_row(t, x.data(), row.data(), cols);
    }
    m.insert(m.end(), row.begin(), row.end());
  }
  return m;
}

TEST(IqMatvecTokens, BitwiseReferenceEveryTierAndBatch) {
  constexpr int64_t kCols = 768, kRows = 37;  // three super-blocks; an odd row count
  constexpr int kMaxTok = 72;
  int checked = 0;
  for (TensorType t : kIqGridTypes) {
    const std::vector<uint8_t> w = random_matrix(t, kRows, kCols, 100 * static_cast<uint32_t>(t), -16.0f, -2.0f);
    const size_t rb = row_bytes(t, kCols);
    std::vector<uint8_t> acts;
    for (int i = 0; i < kMaxTok; ++i) {
      const std::vector<uint8_t> a = test::random_q8_k_row(kCols, 9000u + static_cast<uint32_t>(i));
      acts.insert(acts.end(), a.begin(), a.end());
    }
    const size_t arb = row_bytes(TensorType::Q8_K, kCols);
    std::vector<int32_t> tok(kMaxTok);
    for (int i = 0; i < kMaxTok; ++i) tok[static_cast<size_t>(i)] = (i * 7 + 3) % kMaxTok;
    for (cpu::CpuIsa isa : test::available_tiers()) {
      cpu::MatvecTuning tu;
      tu.max_isa = isa;
      for (int n_tok : {1, 2, 3, 4, 5, 8, 13, 16, kMaxTok}) {
        std::vector<float> y(static_cast<size_t>(n_tok * kRows), NAN);
        cpu::matvec_tokens(t, kCols, w.data(), 3, kRows, acts.data(), arb, tok.data(), n_tok, y.data(), kRows, tu);
        for (int i = 0; i < n_tok; ++i) {
          const size_t ti = static_cast<size_t>(tok[static_cast<size_t>(i)]);
          for (int64_t r = 3; r < kRows; ++r) {
            const float ref = vec_dot_reference(t, kCols, w.data() + static_cast<size_t>(r) * rb, acts.data() + ti * arb);
            ASSERT_EQ(y[static_cast<size_t>(i * kRows + r)], ref)
                << type_name(t) << " " << cpu::isa_name(isa) << " n_tok " << n_tok << " row " << r << " token " << ti;
            ++checked;
          }
          EXPECT_TRUE(std::isnan(y[static_cast<size_t>(i * kRows + 2)])) << "row 2 is outside the slice";
        }
      }
    }
  }
  EXPECT_GT(checked, 0);
}

model::Matrix as_matrix(TensorType t, const std::vector<uint8_t>& q, int64_t rows, int64_t cols) {
  model::Matrix m;
  m.type = t;
  m.n_cols = cols;
  m.n_rows = rows;
  m.row_bytes = row_bytes(t, cols);
  m.data = q.data();
  return m;
}

struct Triple {
  TensorType gate_up, down;
};

// The worker's per-expert call against the function it replaces: bitwise, on every tier.
TEST(IqMoeFfn, RunExpertEqualsReferenceSwigluExpert) {
  constexpr int64_t kHidden = 512, kFfn = 256;
  const Triple triples[] = {{TensorType::IQ2_XXS, TensorType::IQ2_XXS}, {TensorType::IQ2_XS, TensorType::IQ3_XXS},
                            {TensorType::IQ2_S, TensorType::IQ3_S},     {TensorType::IQ1_S, TensorType::IQ1_M},
                            {TensorType::IQ3_XXS, TensorType::Q4_K},    {TensorType::Q4_K, TensorType::IQ2_XXS},
                            {TensorType::IQ1_M, TensorType::Q6_K}};
  cpu::ThreadPool pool(cpu::allowed_cpus());
  reference::ThreadPool ref_pool(2, 0);
  reference::ExpertScratch scratch;
  scratch.reserve(72, kFfn);
  cpu::MoeFfn ffn;
  ffn.reserve(72, kHidden, kFfn);
  int compared = 0;
  for (const Triple& tr : triples) {
    const uint32_t seed = 31 * static_cast<uint32_t>(tr.gate_up) + static_cast<uint32_t>(tr.down);
    // Scales 2^-12..2^-8 keep the FFN's values O(1) (IQ2 elements reach 43 * 15.5 / 4 * d).
    const std::vector<uint8_t> gate = random_matrix(tr.gate_up, kFfn, kHidden, seed, -12.0f, -8.0f);
    const std::vector<uint8_t> up = random_matrix(tr.gate_up, kFfn, kHidden, seed + 1000, -12.0f, -8.0f);
    const std::vector<uint8_t> down = random_matrix(tr.down, kHidden, kFfn, seed + 2000, -12.0f, -8.0f);
    const cpu::ExpertWeights w{tr.gate_up, tr.gate_up, tr.down, gate.data(), up.data(), down.data(), kHidden, kFfn};
    for (int m : {1, 2, 5, 16, 72}) {
      std::vector<float> x(static_cast<size_t>(m * kHidden));
      for (int t = 0; t < m; ++t) {
        const std::vector<float> r = test::random_row(test::kAllDists[t % 3], kHidden, 7000 + static_cast<uint32_t>(t));
        std::copy(r.begin(), r.end(), x.begin() + t * kHidden);
      }
      std::vector<float> want(x.size(), NAN);
      reference::swiglu_expert(as_matrix(tr.gate_up, gate, kFfn, kHidden), as_matrix(tr.gate_up, up, kFfn, kHidden),
                               as_matrix(tr.down, down, kHidden, kFfn), x.data(), m, want.data(), scratch, ref_pool);
      double rms = 0;
      for (float v : want) rms += static_cast<double>(v) * v;
      EXPECT_GT(rms, 0.0) << "a zero expert output would compare trivially";
      for (cpu::CpuIsa isa : test::available_tiers()) {
        cpu::CpuKernelTuning tu;
        tu.matvec.max_isa = isa;
        ffn.set_tuning(tu);
        std::vector<float> y(x.size(), NAN);
        ffn.run_expert(w, x.data(), m, y.data(), pool);
        const std::string where = std::string(type_name(tr.gate_up)) + "/" + std::string(type_name(tr.down)) + " " +
                                  std::string(cpu::isa_name(isa)) + " m " + std::to_string(m);
        for (size_t k = 0; k < y.size(); ++k) {
          ASSERT_FALSE(std::isnan(want[k])) << where;
          ASSERT_EQ(y[k], want[k]) << where << " element " << k;
        }
        ++compared;
      }
    }
  }
  EXPECT_GT(compared, 0);
}

}  // namespace
}  // namespace moraine
