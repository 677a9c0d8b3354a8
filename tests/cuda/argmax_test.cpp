// Greedy argmax on the device (kernels/cuda/argmax.h) against the coordinator's sampler
// (sampling::argmax) and against the definition written out as one scan (first index of the
// strict maximum, left to right; a NaN never compares greater, so a NaN at index 0 stays the
// answer): fresh random rows with a fixed seed, lengths around the kernel's 2048-element blocks
// and the 151,936-word vocabulary, planted ties, NaNs, infinities and signed zeros. Then the
// scratch contract (the same scratch over many calls and inside a replayed graph), the report of
// the first non-finite logit (and calls without it, which skip the scan, on the same scratch), and
// writing into mapped host memory as the CUDA backend does.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "common/sampling/sampler.h"
#include "kernels/cuda/argmax.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

int32_t argmax_by_definition(const float* x, size_t n) {
  size_t best = 0;
  for (size_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return static_cast<int32_t>(best);
}

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// A row of kind `variant` (0..9), Gaussian logits with special values planted.
std::vector<float> make_row(std::mt19937& rng, size_t n, int variant) {
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::uniform_int_distribution<size_t> at(0, n - 1);
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  switch (variant) {
    case 1: {   // the maximum twice: the lower index must win
      const float top = 1000.0f + normal(rng);
      const size_t a = at(rng), b = at(rng);
      x[a] = top;
      x[b] = top;
      break;
    }
    case 2: x[0] = kNan; break;                                   // answer 0
    case 3: for (int i = 0; i < 5; ++i) x[at(rng)] = kNan; break;   // NaNs never win
    case 4: x[at(rng)] = kInf; x[at(rng)] = kInf; break;           // first +inf
    case 5: for (float& v : x) v = -kInf; break;                   // all -inf: index 0
    case 6: {   // the maximum is zero, of both signs: the first zero wins
      for (float& v : x) v = -std::fabs(v) - 1.0f;
      x[at(rng)] = -0.0f;
      x[at(rng)] = 0.0f;
      x[at(rng)] = -0.0f;
      break;
    }
    case 7: for (float& v : x) v = kNan; break;                    // all NaN: 0
    case 8: {   // NaN everywhere but one finite value (not at 0)
      for (float& v : x) v = kNan;
      x[0] = -5.0f;
      x[at(rng)] = 3.0f;
      break;
    }
    case 9: for (float& v : x) v = std::round(v); break;           // many ties at integer values
    default: break;
  }
  return x;
}

class ArgmaxTest : public ::testing::Test {
 protected:
  void SetUp() override { MORAINE_SKIP_WITHOUT_CUDA_DEVICE(); }
};

TEST_F(ArgmaxTest, MatchesTheSamplerOnRandomRows) {
  std::mt19937 rng(20261130);
  const size_t lengths[] = {1, 2, 31, 255, 2047, 2048, 2049, 4097, 32000, 151936};
  int checked = 0;
  for (size_t n : lengths) {
    for (int rows : {1, 3}) {
      for (int variant = 0; variant < 10; ++variant) {
        std::vector<float> x;
        for (int r = 0; r < rows; ++r) {
          const std::vector<float> row = make_row(rng, n, (variant + r) % 10);
          x.insert(x.end(), row.begin(), row.end());
        }
        cuda::DeviceBuffer<float> dx = cuda::uploaded(x);
        cuda::DeviceBuffer<int32_t> out(static_cast<size_t>(rows));
        cuda::DeviceBuffer<uint8_t> scratch(cuda::argmax_scratch_bytes(rows));
        scratch.fill_bytes(0);
        out.fill_bytes(0x7f);
        cuda::argmax_rows(dx.get(), rows, static_cast<int64_t>(n), out.get(), scratch.get());
        std::vector<int32_t> got(static_cast<size_t>(rows));
        out.download(got.data(), got.size());
        for (int r = 0; r < rows; ++r) {
          const float* row = x.data() + static_cast<size_t>(r) * n;
          const int32_t want = sampling::argmax({row, n});
          ASSERT_EQ(want, argmax_by_definition(row, n)) << "the sampler's rule itself, n " << n;
          EXPECT_EQ(got[r], want) << "n " << n << " rows " << rows << " row " << r << " variant " << (variant + r) % 10;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 10 * 10 * 4);
}

// The first non-finite logit of each row (nonfinite), against a host scan, on the rows above (their
// planted NaNs and infinities, and finite rows answering -1), 3 rows at a time so one row's
// report cannot leak into another's, the same scratch for every call (left zeroed).
TEST_F(ArgmaxTest, ReportsTheFirstNonFiniteLogitOfEachRow) {
  std::mt19937 rng(99);
  const size_t n = 151936;
  const int rows = 3;
  cuda::DeviceBuffer<uint8_t> scratch(cuda::argmax_scratch_bytes(rows));
  scratch.fill_bytes(0);
  int with_bad = 0;
  for (int it = 0; it < 24; ++it) {
    std::vector<float> x;
    for (int r = 0; r < rows; ++r) {
      std::vector<float> row = make_row(rng, n, (it + 3 * r) % 10);
      if (it % 3 == 1) row[n - 1 - static_cast<size_t>(it)] = (r % 2) ? kInf : -kInf;   // a late infinity
      x.insert(x.end(), row.begin(), row.end());
    }
    cuda::DeviceBuffer<float> dx = cuda::uploaded(x);
    cuda::DeviceBuffer<int32_t> out(rows), bad(rows);
    bad.fill_bytes(0x7f);
    cuda::argmax_rows(dx.get(), rows, static_cast<int64_t>(n), out.get(), scratch.get(), nullptr, bad.get());
    std::vector<int32_t> got(rows), got_token(rows);
    bad.download(got.data(), got.size());
    out.download(got_token.data(), got_token.size());
    for (int r = 0; r < rows; ++r) {
      const float* row = x.data() + static_cast<size_t>(r) * n;
      int32_t want = -1;
      for (size_t i = 0; i < n && want < 0; ++i)
        if (!std::isfinite(row[i])) want = static_cast<int32_t>(2 * i + (std::isnan(row[i]) ? 1 : 0));
      with_bad += want >= 0;
      EXPECT_EQ(got[r], want) << "call " << it << " row " << r;
      EXPECT_EQ(got_token[r], sampling::argmax({row, n})) << "call " << it << " row " << r;
    }
  }
  EXPECT_GT(with_bad, 20) << "the rows must plant non-finite values";
  EXPECT_LT(with_bad, 72) << "and leave some rows finite";
}

// The report only where asked, calls of both kinds on one scratch: a call without it (greedy
// decode's usual token: no scan) on rows holding NaNs and infinities still answers the sampler's
// argmax, and leaves nothing behind for the next call that asks, which reports its own rows (-1
// for finite rows right after non-finite ones). Fails if the kernel's flag is wired backwards (no
// report where asked; a scan without a report, whose leftover would leak into the next report,
// or a report written through the null pointer) or if the NaN guard of the argmax hangs on it.
TEST_F(ArgmaxTest, ReportsOnlyWhenAskedOnASharedScratch) {
  std::mt19937 rng(4242);
  const size_t n = 151936;
  const int rows = 3;
  const int non_finite_kinds[] = {2, 3, 4, 5, 7, 8}, finite_kinds[] = {0, 1, 6, 9};   // make_row's variants
  cuda::DeviceBuffer<uint8_t> scratch(cuda::argmax_scratch_bytes(rows));
  scratch.fill_bytes(0);
  int asked_finite = 0, asked_bad = 0;
  for (int it = 0; it < 32; ++it) {
    const bool ask = it % 2 == 1;
    const bool finite = ask && it % 4 == 1;   // an asking call on finite rows right after a scan-free one on bad rows
    std::vector<float> x;
    for (int r = 0; r < rows; ++r) {
      const int kind = finite ? finite_kinds[(it + r) % 4] : non_finite_kinds[(it + r) % 6];
      const std::vector<float> row = make_row(rng, n, kind);
      x.insert(x.end(), row.begin(), row.end());
    }
    cuda::DeviceBuffer<float> dx = cuda::uploaded(x);
    cuda::DeviceBuffer<int32_t> out(rows), bad(rows);
    out.fill_bytes(0x7f);
    bad.fill_bytes(0x7f);
    cuda::argmax_rows(dx.get(), rows, static_cast<int64_t>(n), out.get(), scratch.get(), nullptr,
                      ask ? bad.get() : nullptr);
    std::vector<int32_t> got_token(rows), got_bad(rows);
    out.download(got_token.data(), got_token.size());
    bad.download(got_bad.data(), got_bad.size());
    for (int r = 0; r < rows; ++r) {
      const float* row = x.data() + static_cast<size_t>(r) * n;
      EXPECT_EQ(got_token[r], sampling::argmax({row, n}))
          << "call " << it << (ask ? " (asked)" : " (not asked)") << " row " << r;
      if (!ask) continue;
      int32_t want = -1;
      for (size_t i = 0; i < n && want < 0; ++i)
        if (!std::isfinite(row[i])) want = static_cast<int32_t>(2 * i + (std::isnan(row[i]) ? 1 : 0));
      ASSERT_EQ(want < 0, finite) << "the rows must be what the call plants";
      (finite ? asked_finite : asked_bad) += 1;
      EXPECT_EQ(got_bad[r], want) << "call " << it << " row " << r;
    }
  }
  EXPECT_EQ(asked_finite, 8 * rows);
  EXPECT_EQ(asked_bad, 8 * rows);
}

// The scratch is left zeroed by every call: many calls on one scratch, and the calls captured in
// a graph and replayed on new data, all answer right.
TEST_F(ArgmaxTest, ScratchServesRepeatedCallsAndGraphReplays) {
  const size_t n = 151936;
  std::mt19937 rng(7);
  cuda::DeviceBuffer<float> dx(n);
  cuda::DeviceBuffer<int32_t> out(1);
  cuda::DeviceBuffer<uint8_t> scratch(cuda::argmax_scratch_bytes(1));
  scratch.fill_bytes(0);
  CUDA_CHECK(cudaDeviceSynchronize());   // the legacy stream's memset landed
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  cuda::argmax_rows(dx.get(), 1, static_cast<int64_t>(n), out.get(), scratch.get(), stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int it = 0; it < 40; ++it) {
    const std::vector<float> x = make_row(rng, n, it % 10);
    // On the test's stream: a non-blocking stream does not wait for the legacy stream's cudaMemcpy,
    // whose pageable upload may still be landing when it returns (run B read the previous row).
    CUDA_CHECK(cudaMemcpyAsync(dx.get(), x.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream));
    if (it % 2 == 0) {
      cuda::argmax_rows(dx.get(), 1, static_cast<int64_t>(n), out.get(), scratch.get(), stream);
    } else {
      CUDA_CHECK(cudaGraphLaunch(exec, stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    int32_t got = -1;
    out.download(&got, 1);
    EXPECT_EQ(got, sampling::argmax(x)) << "call " << it << (it % 2 ? " (graph)" : " (stream)");
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_F(ArgmaxTest, RejectsBadShapes) {
  cuda::DeviceBuffer<float> dx(4);
  cuda::DeviceBuffer<int32_t> out(1);
  cuda::DeviceBuffer<uint8_t> scratch(cuda::argmax_scratch_bytes(1));
  EXPECT_THROW(cuda::argmax_rows(dx.get(), 0, 4, out.get(), scratch.get()), std::invalid_argument);
  EXPECT_THROW(cuda::argmax_rows(dx.get(), 1, 0, out.get(), scratch.get()), std::invalid_argument);
  EXPECT_THROW(cuda::argmax_rows(dx.get(), 1, int64_t{1} << 31, out.get(), scratch.get()), std::invalid_argument);
}

// The CUDA backend's use: the id and the non-finite report written straight into pinned host
// memory through its device address (no copy node), on a non-blocking stream, over many calls.
// (Its time against the 607 KB logits copy: moraine-kernel-bench cuda --backend-only.)
TEST_F(ArgmaxTest, WritesIntoMappedHostMemory) {
  const size_t n = 151936;
  std::mt19937 rng(11);
  cuda::DeviceBuffer<float> dx(n);
  cuda::DeviceBuffer<uint8_t> scratch(cuda::argmax_scratch_bytes(1));
  scratch.fill_bytes(0);
  cuda::PinnedBuffer<int32_t> host(2);
  int32_t* host_dev = nullptr;
  CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), host.get(), 0));
  CUDA_CHECK(cudaDeviceSynchronize());   // the legacy stream's memset landed
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int it = 0; it < 20; ++it) {
    const std::vector<float> x = make_row(rng, n, it % 10);
    CUDA_CHECK(cudaMemcpyAsync(dx.get(), x.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream));
    host[0] = host[1] = -7;
    cuda::argmax_rows(dx.get(), 1, static_cast<int64_t>(n), host_dev, scratch.get(), stream, host_dev + 1);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(host[0], sampling::argmax(x)) << "call " << it;
    int32_t want = -1;
    for (size_t i = 0; i < n && want < 0; ++i)
      if (!std::isfinite(x[i])) want = static_cast<int32_t>(2 * i + (std::isnan(x[i]) ? 1 : 0));
    EXPECT_EQ(host[1], want) << "call " << it;
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace moraine
