// publish_to_host / fetch_expert_rows (kernels/cuda/host_handoff.h): the spans the device writes
// and the flag it raises reach the host; the fetch waits for the host's flag, copies the map and
// the rows it names (also replayed from a captured graph with a new sequence number), skips the
// wait when every chosen expert is on the device, and a host that never answers ends the wait
// at the timeout with the error flag set instead of a hang.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/host_handoff.h"
#include "tests/cuda/cuda_test_support.h"

namespace moraine {
namespace {

using namespace std::chrono_literals;

struct Flags {
  cuda::PinnedBuffer<uint64_t> host{2};   // [0]: the device's flag, [1]: the host's
  uint64_t* dev = nullptr;
  cuda::DeviceBuffer<uint64_t> seq{1};
  cuda::DeviceBuffer<int32_t> error{1};
  Flags() {
    host[0] = host[1] = 0;
    EXPECT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), host.get(), 0), cudaSuccess);
    const int32_t zero = 0;
    error.upload(&zero, 1);
  }
  void set_seq(uint64_t s) { seq.upload(&s, 1); }
  int32_t read(const cuda::DeviceBuffer<int32_t>& b) {
    int32_t v = -1;
    EXPECT_EQ(cudaMemcpy(&v, b.get(), sizeof v, cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
};

// publish_to_host, captured once and replayed with new sequence numbers and new data: the host
// finds every span's bytes in its memory when the device's flag arrives.
TEST(CudaHostHandoff, PublishMovesTheSpansThroughAGraph) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  Flags f;
  const size_t words[3] = {8, 8, 96};   // a decode step's spans (8 slots x hidden 96 floats)
  std::vector<cuda::DeviceBuffer<uint32_t>> dev_out;
  std::vector<cuda::PinnedBuffer<uint32_t>> host_out;
  cuda::HostSpan out[3];
  for (int i = 0; i < 3; ++i) {
    dev_out.emplace_back(words[i]);
    host_out.emplace_back(words[i]);
    void* mapped = nullptr;
    ASSERT_EQ(cudaHostGetDevicePointer(&mapped, host_out.back().get(), 0), cudaSuccess);
    out[i] = {mapped, dev_out.back().get(), words[i] * 4};
  }
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  cuda::publish_to_host(out, 3, f.dev, f.seq.get(), stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  std::mt19937 rng(7);
  for (uint64_t seq : {1, 2, 3}) {
    std::vector<std::vector<uint32_t>> sent(3);
    for (int i = 0; i < 3; ++i) {
      sent[i].resize(words[i]);
      for (uint32_t& w : sent[i]) w = rng();
      dev_out[i].upload(sent[i].data(), words[i]);
      std::fill_n(host_out[i].get(), words[i], 0u);
    }
    f.set_seq(seq);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    const auto start = std::chrono::steady_clock::now();
    while (std::atomic_ref<uint64_t>(f.host[0]).load(std::memory_order_acquire) < seq)
      ASSERT_LT(std::chrono::steady_clock::now() - start, 10s) << "the device's flag never arrived";
    for (int i = 0; i < 3; ++i)
      EXPECT_TRUE(std::equal(sent[i].begin(), sent[i].end(), host_out[i].get())) << "span " << i << ", step " << seq;
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
  EXPECT_THROW(cuda::publish_to_host(out, 4, f.dev, f.seq.get(), stream), std::invalid_argument);
  cuda::HostSpan odd = out[0];
  odd.bytes = 6;
  EXPECT_THROW(cuda::publish_to_host(&odd, 1, f.dev, f.seq.get(), stream), std::invalid_argument);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// fetch_expert_rows: the host's map and the rows it names, in the host's memory (mapped), a
// device expert table and the step's chosen ids on the device.
struct RowFetchCase {
  static constexpr int kExperts = 16;
  int nk, row_floats;
  cuda::PinnedBuffer<int32_t> map_host;
  cuda::PinnedBuffer<float> rows_host;
  cuda::DeviceBuffer<int32_t> map_dev, chosen;
  cuda::DeviceBuffer<float> rows_dev;
  cuda::DeviceBuffer<cuda::MoeExpertSlot> slots{kExperts};
  cuda::ExpertRowFetch fetch;
  static constexpr float kPoison = -12345.0f;
  RowFetchCase(Flags& f, int nk_, int row_floats_, uint64_t timeout_ns)
      : nk(nk_), row_floats(row_floats_), map_host(static_cast<size_t>(nk_)),
        rows_host(static_cast<size_t>(nk_) * static_cast<size_t>(row_floats_)), map_dev(static_cast<size_t>(nk_)),
        chosen(static_cast<size_t>(nk_)), rows_dev(static_cast<size_t>(nk_) * static_cast<size_t>(row_floats_)) {
    // Experts 0..7 are on the device (any non-null gate), 8..15 are not.
    std::vector<cuda::MoeExpertSlot> table(kExperts);
    for (int e = 0; e < 8; ++e) table[static_cast<size_t>(e)].gate = rows_dev.get();
    slots.upload(table.data(), table.size());
    void* m = nullptr;
    void* r = nullptr;
    EXPECT_EQ(cudaHostGetDevicePointer(&m, map_host.get(), 0), cudaSuccess);
    EXPECT_EQ(cudaHostGetDevicePointer(&r, rows_host.get(), 0), cudaSuccess);
    fetch.flag = f.dev + 1;
    fetch.seq_dev = f.seq.get();
    fetch.timeout_ns = timeout_ns;
    fetch.error_dev = f.error.get();
    fetch.map_host = static_cast<const int32_t*>(m);
    fetch.rows_host = static_cast<const float*>(r);
    fetch.map_dev = map_dev.get();
    fetch.rows_dev = rows_dev.get();
    fetch.nk = nk;
    fetch.row_floats = row_floats;
    fetch.chosen = chosen.get();
    fetch.slots = slots.get();
    fetch.n_expert = kExperts;
  }
  void poison() {
    std::vector<float> p(static_cast<size_t>(nk) * static_cast<size_t>(row_floats), kPoison);
    rows_dev.upload(p.data(), p.size());
    std::vector<int32_t> m(static_cast<size_t>(nk), 77);
    map_dev.upload(m.data(), m.size());
  }
  std::vector<float> rows() const {
    std::vector<float> got(static_cast<size_t>(nk) * static_cast<size_t>(row_floats));
    rows_dev.download(got.data(), got.size());
    return got;
  }
  std::vector<int32_t> map() const {
    std::vector<int32_t> got(static_cast<size_t>(nk));
    map_dev.download(got.data(), got.size());
    return got;
  }
};

// Captured once, replayed with new sequence numbers, maps and rows: the stream stays at the fetch
// until the host's flag, then the device holds the host's map and exactly the rows it names
// (the others keep their poison), for rows that take the 16-byte path (2048 floats, the Qwen3
// width, and 96) and rows that do not (97 floats: odd addresses).
TEST(CudaHostHandoff, FetchCopiesTheMapAndTheRowsItNamesThroughAGraph) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  for (const int row_floats : {2048, 96, 97}) {
    SCOPED_TRACE("row_floats " + std::to_string(row_floats));
    Flags f;
    const int nk = 8;
    RowFetchCase c(f, nk, row_floats, 10'000'000'000ull);
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    cuda::fetch_expert_rows(c.fetch, stream);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    std::mt19937 rng(11 + row_floats);
    for (uint64_t seq : {1, 2, 3}) {
      // Slots 0..seq-1 chose experts off the device (rows in a shuffled order), the rest on it.
      std::vector<int32_t> chosen(nk), map(nk, -1), rows_order(nk);
      for (int i = 0; i < nk; ++i) chosen[i] = i < static_cast<int>(seq) ? 8 + i : i;
      std::iota(rows_order.begin(), rows_order.end(), 0);
      std::shuffle(rows_order.begin(), rows_order.end(), rng);
      for (int i = 0; i < static_cast<int>(seq); ++i) map[i] = rows_order[i];
      c.chosen.upload(chosen.data(), chosen.size());
      c.poison();
      std::uniform_real_distribution<float> u(-4.0f, 4.0f);
      std::vector<float> host_rows(static_cast<size_t>(nk) * row_floats);
      for (float& v : host_rows) v = u(rng);
      f.set_seq(seq);
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      std::this_thread::sleep_for(20ms);
      EXPECT_EQ(cudaStreamQuery(stream), cudaErrorNotReady) << "the fetch went on before the host answered";
      std::copy(map.begin(), map.end(), c.map_host.get());
      std::copy(host_rows.begin(), host_rows.end(), c.rows_host.get());
      std::atomic_ref<uint64_t>(f.host[1]).store(seq, std::memory_order_release);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      EXPECT_EQ(f.read(f.error), 0);
      EXPECT_EQ(c.map(), map) << "step " << seq;
      const std::vector<float> got = c.rows();
      for (int r = 0; r < nk; ++r) {
        const bool named = std::find(map.begin(), map.end(), r) != map.end();
        for (int j = 0; j < row_floats; ++j) {
          const size_t at = static_cast<size_t>(r) * row_floats + j;
          ASSERT_EQ(got[at], named ? host_rows[at] : RowFetchCase::kPoison)
              << "row " << r << (named ? " (named)" : " (not named)") << " float " << j << ", step " << seq;
        }
      }
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
}

// A step whose chosen experts are all on the device does not wait for the host (which never
// answers here): the map comes out all -1 and no row is touched. Without the table it waits.
TEST(CudaHostHandoff, FetchSkipsTheWaitWhenEveryChosenExpertIsOnTheDevice) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  Flags f;
  RowFetchCase c(f, 16, 2048, 2'000'000'000ull);   // 2 rows of 8 slots
  std::vector<int32_t> chosen(16);
  for (int i = 0; i < 16; ++i) chosen[i] = i % 8;
  c.chosen.upload(chosen.data(), chosen.size());
  c.poison();
  f.set_seq(4);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const auto start = std::chrono::steady_clock::now();
  cuda::fetch_expert_rows(c.fetch, stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s) << "it waited for a host with nothing to send";
  EXPECT_EQ(f.read(f.error), 0);
  EXPECT_EQ(c.map(), std::vector<int32_t>(16, -1));
  const std::vector<float> got = c.rows();
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float v) { return v == RowFetchCase::kPoison; }));
  // One slot off the device (expert 9): now it waits, here until its timeout.
  chosen[13] = 9;
  c.chosen.upload(chosen.data(), chosen.size());
  c.fetch.timeout_ns = 30'000'000ull;
  const auto start2 = std::chrono::steady_clock::now();
  cuda::fetch_expert_rows(c.fetch, stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_GE(std::chrono::steady_clock::now() - start2, 25ms) << "it did not wait though expert 9 is off the device";
  EXPECT_EQ(f.read(f.error), 1);
  cudaStreamDestroy(stream);
}

// No answer: the fetch gives up at its timeout with the error flag and copies nothing; bad
// arguments are refused on the host.
TEST(CudaHostHandoff, FetchTimesOutWithTheErrorFlagAndCopiesNothing) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  Flags f;
  RowFetchCase c(f, 8, 2048, 20'000'000ull);
  c.fetch.chosen = nullptr;   // always wait
  for (int i = 0; i < 8; ++i) c.map_host[static_cast<size_t>(i)] = i;
  c.poison();
  f.set_seq(9);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cuda::fetch_expert_rows(c.fetch, stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(f.read(f.error), 1);
  const std::vector<float> got = c.rows();
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float v) { return v == RowFetchCase::kPoison; }))
      << "a timed-out fetch copied";
  cuda::ExpertRowFetch bad = c.fetch;
  bad.nk = 0;
  EXPECT_THROW(cuda::fetch_expert_rows(bad, stream), std::invalid_argument);
  bad = c.fetch;
  bad.rows_host = nullptr;
  EXPECT_THROW(cuda::fetch_expert_rows(bad, stream), std::invalid_argument);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace moraine
