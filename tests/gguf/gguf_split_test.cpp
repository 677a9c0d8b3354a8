// Split models: NAME-0000k-of-0000n.gguf opens all n shards as one model.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "tests/gguf/gguf_test_util.h"

namespace moraine::gguf {
namespace {

using ::testing::HasSubstr;
using testing::ScratchDir;

struct Shards {
  ScratchDir dir;
  std::vector<std::string> paths;
  std::vector<std::vector<std::vector<uint8_t>>> data;  // [shard][tensor]
};

std::string shard_name(const ScratchDir& dir, int k, int n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.gguf", k, n);
  return dir.file(buf);
}

// Three shards like gguf-split writes them: metadata in the first, split.* keys in each.
void write_shards(Shards& s, int n_shards, int tensors_per_shard, uint64_t seed,
                  std::optional<uint64_t> claimed_total = std::nullopt) {
  std::mt19937_64 rng(seed);
  s.data.assign(n_shards, {});
  for (int k = 0; k < n_shards; ++k) {
    GgufWriter w;
    if (k == 0) {
      w.set("general.architecture", Value::string("testarch"));
      w.set("testarch.block_count", Value::u32(static_cast<uint32_t>(n_shards * tensors_per_shard)));
    }
    w.set("split.no", Value::u16(static_cast<uint16_t>(k)));
    w.set("split.count", Value::u16(static_cast<uint16_t>(n_shards)));
    w.set("split.tensors.count",
          Value::i32(static_cast<int32_t>(claimed_total.value_or(n_shards * tensors_per_shard))));
    for (int i = 0; i < tensors_per_shard; ++i) {
      std::vector<uint8_t> bytes(static_cast<size_t>(32 + rng() % 64) * 4);
      for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
      s.data[k].push_back(bytes);
    }
    for (int i = 0; i < tensors_per_shard; ++i) {
      const auto& bytes = s.data[k][i];
      w.add_tensor("blk." + std::to_string(k * tensors_per_shard + i) + ".w",
                   {static_cast<int64_t>(bytes.size() / 4)}, TensorType::F32, bytes.data(), bytes.size());
    }
    s.paths.push_back(shard_name(s.dir, k + 1, n_shards));
    w.write(s.paths.back());
  }
}

TEST(GgufSplit, OpeningAnyShardOpensAllOfThem) {
  Shards s;
  write_shards(s, 3, 4, 99);
  for (int which = 0; which < 3; ++which) {
    const GgufFile f = GgufFile::open(s.paths[which]);
    EXPECT_EQ(f.paths(), s.paths);
    ASSERT_EQ(f.tensors().size(), 12u);
    uint64_t total = 0;
    for (const std::string& p : s.paths) total += std::filesystem::file_size(p);
    EXPECT_EQ(f.file_bytes(), total);
    // Metadata is the first shard's.
    EXPECT_EQ(f.get_string("general.architecture"), "testarch");
    EXPECT_EQ(f.get_u64("split.no"), 0u);
    for (int k = 0; k < 3; ++k) {
      for (int i = 0; i < 4; ++i) {
        const TensorInfo* t = f.find_tensor("blk." + std::to_string(k * 4 + i) + ".w");
        ASSERT_NE(t, nullptr);
        EXPECT_EQ(t->shard, static_cast<uint32_t>(k));
        ASSERT_EQ(t->n_bytes, s.data[k][i].size());
        EXPECT_EQ(std::memcmp(t->data, s.data[k][i].data(), t->n_bytes), 0);
      }
    }
  }
}

TEST(GgufSplit, MissingShardIsNamed) {
  Shards s;
  write_shards(s, 3, 2, 5);
  std::filesystem::remove(s.paths[2]);
  try {
    GgufFile::open(s.paths[1]);
    FAIL() << "expected GgufError";
  } catch (const GgufError& e) {
    EXPECT_THAT(e.what(), HasSubstr(s.paths[2]));
    EXPECT_THAT(e.what(), HasSubstr("cannot open"));
  }
}

TEST(GgufSplit, WrongTensorTotalIsRejected) {
  Shards s;
  write_shards(s, 3, 2, 6, 7);
  try {
    GgufFile::open(s.paths[0]);
    FAIL() << "expected GgufError";
  } catch (const GgufError& e) {
    EXPECT_THAT(e.what(), HasSubstr("'split.tensors.count' is 7 but the 3 shards hold 6 tensors"));
  }
}

TEST(GgufSplit, ShardNumberMustMatchItsName) {
  Shards s;
  write_shards(s, 2, 1, 7);
  // Swap the shards' contents: each file's split.no now disagrees with its name.
  const auto a = testing::read_bytes(s.paths[0]);
  const auto b = testing::read_bytes(s.paths[1]);
  testing::write_bytes(s.paths[0], b);
  testing::write_bytes(s.paths[1], a);
  try {
    GgufFile::open(s.paths[0]);
    FAIL() << "expected GgufError";
  } catch (const GgufError& e) {
    EXPECT_THAT(e.what(), HasSubstr(s.paths[0] + ": metadata 'split.no' is 1 but the file name says shard 1"));
  }
}

TEST(GgufSplit, ShardRenamedOutOfThePatternIsRejected) {
  Shards s;
  write_shards(s, 2, 1, 8);
  const std::string renamed = s.dir.file("renamed.gguf");
  std::filesystem::rename(s.paths[0], renamed);
  try {
    GgufFile::open(renamed);
    FAIL() << "expected GgufError";
  } catch (const GgufError& e) {
    EXPECT_THAT(e.what(), HasSubstr("shard 1 of 2"));
    EXPECT_THAT(e.what(), HasSubstr("NAME-0000k-of-0000n.gguf"));
  }
}

TEST(GgufSplit, DuplicateTensorAcrossShardsIsRejected) {
  ScratchDir dir;
  std::vector<uint8_t> bytes(64, 1);
  for (int k = 0; k < 2; ++k) {
    GgufWriter w;
    w.set("split.no", Value::u16(static_cast<uint16_t>(k)));
    w.set("split.count", Value::u16(2));
    w.add_tensor("same", {16}, TensorType::F32, bytes.data(), bytes.size());
    w.write(shard_name(dir, k + 1, 2));
  }
  try {
    GgufFile::open(shard_name(dir, 1, 2));
    FAIL() << "expected GgufError";
  } catch (const GgufError& e) {
    EXPECT_THAT(e.what(), HasSubstr("tensor 'same' also appears in shard"));
  }
}

TEST(GgufSplit, SingleShardNamedLikeASplitOpensAlone) {
  ScratchDir dir;
  GgufWriter w;
  w.set("split.no", Value::u16(0));
  w.set("split.count", Value::u16(1));
  w.write(shard_name(dir, 1, 1));
  const GgufFile f = GgufFile::open(shard_name(dir, 1, 1));
  EXPECT_EQ(f.paths().size(), 1u);
}

}  // namespace
}  // namespace moraine::gguf
