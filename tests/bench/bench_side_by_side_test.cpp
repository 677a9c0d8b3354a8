// bench/side-by-side sizes llama.cpp's --n-cpu-moe from the routed-expert bytes per layer that it
// reads from the GGUF header itself (Python, no moraine code). Checked here against moraine's own
// GGUF reader on synth models of both families with a non-default expert count: one entry per
// layer, each the layer's expert tensors' bytes plus at most the alignment padding after each.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "common/gguf/gguf.h"
#include "tests/bench/bench_test_support.h"

namespace {

using moraine::bench_test::Scratch;
using moraine::bench_test::slurp;

void check_shape(const std::string& shape, int experts) {
  Scratch s("side-by-side-sizes-");
  const std::string build = MORAINE_BUILD_DIR, source = MORAINE_SOURCE_DIR;
  const std::string model = (s.dir / (shape + ".gguf")).string();
  ASSERT_EQ(std::system((build + "/tools/synth/moraine-synth --shape " + shape + " --experts " + std::to_string(experts) +
                         " -o " + model + " --seed 11 2>" + (s.dir / "synth.err").string())
                            .c_str()),
            0)
      << slurp(s.dir / "synth.err");
  const auto out = s.dir / "sizes.json", err = s.dir / "sizes.err";
  ASSERT_EQ(std::system(("python3 " + source + "/bench/side-by-side --expert-bytes " + model + " >" + out.string() +
                         " 2>" + err.string())
                            .c_str()),
            0)
      << slurp(err);
  const nlohmann::json got = nlohmann::json::parse(slurp(out));

  const auto f = moraine::gguf::GgufFile::open(model);
  const std::string arch = *f.get_string("general.architecture");
  const uint64_t n_layer = *f.get_u64(arch + ".block_count");
  const uint64_t align = f.get_u64("general.alignment").value_or(32);
  std::map<uint64_t, uint64_t> bytes, tensors;
  for (const auto& t : f.tensors()) {
    if (t.name.rfind("blk.", 0) != 0 || t.name.find("_exps.") == std::string::npos) continue;
    const uint64_t il = std::stoull(t.name.substr(4, t.name.find('.', 4) - 4));
    bytes[il] += t.n_bytes;
    tensors[il] += 1;
  }
  ASSERT_EQ(got.size(), n_layer) << got.dump();
  for (uint64_t il = 0; il < n_layer; ++il) {
    ASSERT_EQ(tensors[il], 3u) << "layer " << il;   // gate, up, down
    const uint64_t g = got[il].get<uint64_t>();
    EXPECT_GE(g, bytes[il]) << "layer " << il;
    EXPECT_LT(g - bytes[il], tensors[il] * align) << "layer " << il;
  }
}

TEST(SideBySideSizes, Qwen3MoeExpertBytesPerLayer) { check_shape("qwen3moe-tiny", 12); }
TEST(SideBySideSizes, Qwen3NextExpertBytesPerLayer) { check_shape("qwen3next-tiny", 20); }

// A file that is not a GGUF is refused by name, not with a Python traceback.
TEST(SideBySideSizes, RefusesANonGguf) {
  Scratch s("side-by-side-sizes-");
  const auto bad = s.dir / "not.gguf", err = s.dir / "err";
  { std::ofstream(bad) << "GGUX and more bytes than a header"; }
  const int rc = std::system(("python3 " + std::string(MORAINE_SOURCE_DIR) + "/bench/side-by-side --expert-bytes " +
                              bad.string() + " >/dev/null 2>" + err.string())
                                 .c_str());
  EXPECT_NE(rc, 0);
  const std::string e = slurp(err);
  EXPECT_NE(e.find(bad.string() + ": not a GGUF file"), std::string::npos) << e;
  EXPECT_EQ(e.find("Traceback"), std::string::npos) << e;
}

}  // namespace
