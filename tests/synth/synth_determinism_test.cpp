// Same seed, same bytes, whatever the thread count; another seed, other weights.
#include <gtest/gtest.h>

#include <string>

#include "synth_run.h"
#include "tests/interop/llama_oracle.h"

namespace moraine::test {
namespace {

TEST(SynthDeterminism, SameSeedSameBytesForOneAndTwoThreads) {
  ScratchDir dir("synth-determinism");
  for (const char* shape : {"qwen3moe-tiny", "qwen3next-tiny"}) {
    SCOPED_TRACE(shape);
    const std::string common = std::string("--shape ") + shape + " --vocab-size 1024 --zipf 1.2";
    ASSERT_EQ(run_synth(common + " --seed 42 --threads 1 -o " + dir.file("a.gguf"), dir.path()).status, 0);
    ASSERT_EQ(run_synth(common + " --seed 42 --threads 2 -o " + dir.file("b.gguf"), dir.path()).status, 0);
    ASSERT_EQ(run_synth(common + " --seed 43 --threads 2 -o " + dir.file("c.gguf"), dir.path()).status, 0);
    const std::string a = read_file_bytes(dir.file("a.gguf"));
    const std::string b = read_file_bytes(dir.file("b.gguf"));
    const std::string c = read_file_bytes(dir.file("c.gguf"));
    ASSERT_GT(a.size(), 1000000u);
    EXPECT_TRUE(a == b) << "1 and 2 threads wrote different files";
    ASSERT_EQ(a.size(), c.size());
    // Another seed changes the weights: count differing bytes in the tensor data (the tail).
    size_t differ = 0;
    for (size_t i = a.size() / 2; i < a.size(); ++i) differ += a[i] != c[i];
    EXPECT_GT(differ, (a.size() / 2) / 2) << "seed 43 left most bytes as seed 42 wrote them";
  }
}

}  // namespace
}  // namespace moraine::test
