// signal_host / wait_host (kernels/cuda/host_handoff.h): the flag the device raises reaches the
// host; a stream waiting on the host's flag does nothing after the wait until the host raises
// it (also replayed from a captured graph with a new sequence number); a host that never
// answers ends the wait at the timeout with the error flag set instead of a hang.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
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
  cuda::DeviceBuffer<int32_t> error{1}, after{1};
  Flags() {
    host[0] = host[1] = 0;
    EXPECT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), host.get(), 0), cudaSuccess);
    const int32_t zero = 0;
    error.upload(&zero, 1);
    after.upload(&zero, 1);
  }
  void set_seq(uint64_t s) { seq.upload(&s, 1); }
  int32_t read(const cuda::DeviceBuffer<int32_t>& b) {
    int32_t v = -1;
    EXPECT_EQ(cudaMemcpy(&v, b.get(), sizeof v, cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
};

// On `stream`: raise the device flag, wait for the host's, then write `value` into after.
void enqueue_round(Flags& f, int32_t value, uint64_t timeout_ns, cudaStream_t stream) {
  cuda::signal_host(f.dev, f.seq.get(), stream);
  cuda::wait_host(f.dev + 1, f.seq.get(), timeout_ns, f.error.get(), stream);
  ASSERT_EQ(cudaMemsetAsync(f.after.get(), value, sizeof(int32_t), stream), cudaSuccess);
}

TEST(CudaHostHandoff, StreamWaitsForTheHostThroughAGraph) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  Flags f;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  enqueue_round(f, 1, 10'000'000'000ull, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (uint64_t seq : {1, 2, 3}) {
    f.set_seq(seq);
    ASSERT_EQ(cudaMemset(f.after.get(), 0, sizeof(int32_t)), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    const auto start = std::chrono::steady_clock::now();
    while (std::atomic_ref<uint64_t>(f.host[0]).load(std::memory_order_acquire) < seq)
      ASSERT_LT(std::chrono::steady_clock::now() - start, 10s) << "the device's flag never arrived";
    std::this_thread::sleep_for(30ms);
    EXPECT_EQ(cudaStreamQuery(stream), cudaErrorNotReady) << "the stream went past the wait before the host answered";
    std::atomic_ref<uint64_t>(f.host[1]).store(seq, std::memory_order_release);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(f.read(f.after), 0x01010101);
    EXPECT_EQ(f.read(f.error), 0);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(CudaHostHandoff, NoAnswerEndsAtTheTimeoutWithTheErrorFlag) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  Flags f;
  f.set_seq(5);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const auto start = std::chrono::steady_clock::now();
  enqueue_round(f, 2, 20'000'000ull, stream);   // 20 ms
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, 15ms);
  EXPECT_LT(took, 5s);
  EXPECT_EQ(f.read(f.error), 1);
  EXPECT_EQ(f.read(f.after), 0x02020202) << "the stream goes on after a timeout";
  cudaStreamDestroy(stream);
}

// publish_to_host / fetch_from_host, captured once and replayed with new sequence numbers and
// new data: the host finds every span's bytes in its memory when the device's flag arrives; the
// stream stays at the fetch until the host's flag, and the device then holds the host's bytes
// (written after the device raised its flag); a fetch that times out copies nothing.
TEST(CudaHostHandoff, PublishAndFetchMoveTheSpansThroughAGraph) {
  MORAINE_SKIP_WITHOUT_CUDA_DEVICE();
  Flags f;
  // Sizes of a decode step's spans (8 slots x hidden 96 floats) plus odd word counts.
  const size_t words[3] = {8, 8, 96}, back_words[2] = {8 * 96 + 3, 8};
  std::vector<cuda::DeviceBuffer<uint32_t>> dev_out, dev_in;
  std::vector<cuda::PinnedBuffer<uint32_t>> host_out, host_in;
  cuda::HostSpan out[3], in[2];
  for (int i = 0; i < 3; ++i) {
    dev_out.emplace_back(words[i]);
    host_out.emplace_back(words[i]);
    void* mapped = nullptr;
    ASSERT_EQ(cudaHostGetDevicePointer(&mapped, host_out.back().get(), 0), cudaSuccess);
    out[i] = {mapped, dev_out.back().get(), words[i] * 4};
  }
  for (int i = 0; i < 2; ++i) {
    dev_in.emplace_back(back_words[i]);
    host_in.emplace_back(back_words[i]);
    void* mapped = nullptr;
    ASSERT_EQ(cudaHostGetDevicePointer(&mapped, host_in.back().get(), 0), cudaSuccess);
    in[i] = {dev_in.back().get(), mapped, back_words[i] * 4};
  }
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  cuda::publish_to_host(out, 3, f.dev, f.seq.get(), stream);
  cuda::fetch_from_host(f.dev + 1, f.seq.get(), 10'000'000'000ull, f.error.get(), in, 2, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  std::mt19937 rng(7);
  for (uint64_t seq : {1, 2, 3}) {
    std::vector<std::vector<uint32_t>> sent(3), answer(2);
    for (int i = 0; i < 3; ++i) {
      sent[i].resize(words[i]);
      for (uint32_t& w : sent[i]) w = rng();
      dev_out[i].upload(sent[i].data(), words[i]);
      std::fill_n(host_out[i].get(), words[i], 0u);
    }
    for (int i = 0; i < 2; ++i) {
      answer[i].resize(back_words[i]);
      for (uint32_t& w : answer[i]) w = rng();
      dev_in[i].fill_bytes(0);
    }
    f.set_seq(seq);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    const auto start = std::chrono::steady_clock::now();
    while (std::atomic_ref<uint64_t>(f.host[0]).load(std::memory_order_acquire) < seq)
      ASSERT_LT(std::chrono::steady_clock::now() - start, 10s) << "the device's flag never arrived";
    for (int i = 0; i < 3; ++i)
      EXPECT_TRUE(std::equal(sent[i].begin(), sent[i].end(), host_out[i].get())) << "span " << i << ", step " << seq;
    std::this_thread::sleep_for(20ms);
    EXPECT_EQ(cudaStreamQuery(stream), cudaErrorNotReady) << "the fetch went on before the host answered";
    for (int i = 0; i < 2; ++i) std::copy(answer[i].begin(), answer[i].end(), host_in[i].get());
    std::atomic_ref<uint64_t>(f.host[1]).store(seq, std::memory_order_release);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(f.read(f.error), 0);
    for (int i = 0; i < 2; ++i) {
      std::vector<uint32_t> got(back_words[i]);
      dev_in[i].download(got.data(), back_words[i]);
      EXPECT_EQ(got, answer[i]) << "span " << i << " back, step " << seq;
    }
  }
  // No answer: the fetch gives up at its timeout with the error flag and copies nothing.
  f.set_seq(9);
  for (int i = 0; i < 2; ++i) dev_in[i].fill_bytes(0);
  cuda::fetch_from_host(f.dev + 1, f.seq.get(), 20'000'000ull, f.error.get(), in, 2, stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(f.read(f.error), 1);
  std::vector<uint32_t> got(back_words[0]);
  dev_in[0].download(got.data(), back_words[0]);
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](uint32_t w) { return w == 0; })) << "a timed-out fetch copied";
  EXPECT_THROW(cuda::publish_to_host(out, 4, f.dev, f.seq.get(), stream), std::invalid_argument);
  cuda::HostSpan odd = out[0];
  odd.bytes = 6;
  EXPECT_THROW(cuda::publish_to_host(&odd, 1, f.dev, f.seq.get(), stream), std::invalid_argument);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace moraine
