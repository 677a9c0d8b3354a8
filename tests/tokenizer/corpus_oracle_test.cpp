// The corpus (corpus.h) tokenized by us and by llama.cpp through node-llama-cpp
// (corpus_oracle.mjs, started once for all four vocabularies), with special-token parsing off
// and on; plus decode(encode(x)) == x on every case.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/tokenizer/tokenizer.h"
#include "tests/tokenizer/corpus.h"
#include "tests/tokenizer/oracle_paths.h"

namespace moraine::tokenizer::test {
namespace {

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

class CorpusOracle : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    corpus_ = handpicked_corpus();
    const std::vector<std::string> random = random_corpus(200, 12345);
    corpus_.insert(corpus_.end(), random.begin(), random.end());

    for (const char* v : kVocabs) {
      if (!std::filesystem::exists(vocab_path(v))) {
        setup_error_ = missing_oracle_message(vocab_path(v));
        return;
      }
    }
    const std::string script = std::string(MORAINE_SOURCE_DIR) + "/tests/tokenizer/corpus_oracle.mjs";
    if (!std::filesystem::exists(oracle_dir() + "/node_modules/node-llama-cpp")) {
      setup_error_ = missing_oracle_message(oracle_dir() + "/node_modules/node-llama-cpp");
      return;
    }
    const std::string dir = std::string(MORAINE_BUILD_DIR) + "/tokenizer_corpus_oracle";
    std::filesystem::create_directories(dir);
    const std::string corpus_file = dir + "/corpus.json", log_file = dir + "/node.log",
                      result_file = dir + "/oracle.json";
    std::filesystem::remove(result_file);
    std::ofstream(corpus_file, std::ios::binary) << nlohmann::json(corpus_).dump();

    std::string cmd = "cd " + shell_quote(oracle_dir()) + " && node " + shell_quote(script) + " " +
                      shell_quote(result_file) + " " + shell_quote(corpus_file);
    for (const char* v : kVocabs) cmd += " " + shell_quote(vocab_path(v));
    cmd += " >" + shell_quote(log_file) + " 2>&1";
    const int status = std::system(cmd.c_str());
    if (status != 0) {
      std::ifstream log(log_file);
      setup_error_ = "node oracle failed (status " + std::to_string(status) + "): " + cmd + "\n" +
                     std::string(std::istreambuf_iterator<char>(log), std::istreambuf_iterator<char>());
      return;
    }
    try {
      oracle_ = nlohmann::json::parse(std::ifstream(result_file));
    } catch (const std::exception& e) {
      setup_error_ = "node oracle wrote no readable result to " + result_file + ": " + e.what();
    }
  }

  static std::vector<std::string> corpus_;
  static nlohmann::json oracle_;
  static std::string setup_error_;
};

std::vector<std::string> CorpusOracle::corpus_;
nlohmann::json CorpusOracle::oracle_;
std::string CorpusOracle::setup_error_;

TEST_F(CorpusOracle, MatchesLlamaCppOnEveryVocabulary) {
  ASSERT_TRUE(setup_error_.empty()) << setup_error_;
  ASSERT_GT(corpus_.size(), 200u);
  for (const char* v : kVocabs) {
    const Tokenizer tok = Tokenizer::from_gguf_path(vocab_path(v));
    const nlohmann::json& expected = oracle_.at(vocab_path(v));
    size_t failures = 0;
    for (const bool special : {false, true}) {
      const nlohmann::json& want = expected.at(special ? "special" : "plain");
      ASSERT_EQ(want.size(), corpus_.size());
      for (size_t i = 0; i < corpus_.size(); ++i) {
        const std::vector<TokenId> got = tok.encode(corpus_[i], false, special);
        const auto ref = want[i].get<std::vector<TokenId>>();
        if (got != ref && ++failures <= 5) {
          ADD_FAILURE() << v << (special ? " parse_special" : " plain") << " case " << i << ": "
                        << nlohmann::json(corpus_[i]).dump() << "\n  ours:  "
                        << nlohmann::json(got).dump() << "\n  llama: " << nlohmann::json(ref).dump();
        }
        EXPECT_EQ(tok.decode(got), corpus_[i]) << v << " round trip, case " << i;
      }
    }
    EXPECT_EQ(failures, 0u) << v << ": cases that differ from llama.cpp";
  }
}

}  // namespace
}  // namespace moraine::tokenizer::test
