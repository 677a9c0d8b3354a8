// The corpus (corpus.h) tokenized by us and by llama.cpp through node-llama-cpp
// (corpus_oracle.mjs, started once for all vocabularies: the four stored ones and gpt-2's with
// the "default" pre-tokenizer), with special-token parsing off and on; plus
// decode(encode(x)) == x on every case.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/gguf/gguf.h"
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

class TokenizerCorpusOracle : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    corpus_ = handpicked_corpus();
    const std::vector<std::string> short_mixes = random_corpus(600, 12345);
    const std::vector<std::string> long_mixes = random_corpus(30, 54321, 200);
    corpus_.insert(corpus_.end(), short_mixes.begin(), short_mixes.end());
    corpus_.insert(corpus_.end(), long_mixes.begin(), long_mixes.end());

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

    // No stored vocabulary uses the "default" pre-tokenizer (four regexes in a row); make one
    // from gpt-2's by changing only tokenizer.ggml.pre.
    default_pre_vocab_ = dir + "/vocab-gpt-2-default-pre.gguf";
    {
      const gguf::GgufFile gpt2 = gguf::GgufFile::open(vocab_path("gpt-2"));
      gguf::GgufWriter w;
      for (const auto& [key, value] : gpt2.metadata()) w.set(key, value);
      w.set("tokenizer.ggml.pre", gguf::Value::string("default"));
      w.write(default_pre_vocab_);
    }
    vocabs_.clear();
    for (const char* v : kVocabs) vocabs_.push_back(vocab_path(v));
    vocabs_.push_back(default_pre_vocab_);

    std::string cmd = "cd " + shell_quote(oracle_dir()) + " && node " + shell_quote(script) + " " +
                      shell_quote(result_file) + " " + shell_quote(corpus_file);
    for (const std::string& v : vocabs_) cmd += " " + shell_quote(v);
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
  static std::vector<std::string> vocabs_;  // GGUF paths
  static std::string default_pre_vocab_;
  static nlohmann::json oracle_;
  static std::string setup_error_;
};

std::vector<std::string> TokenizerCorpusOracle::corpus_;
std::vector<std::string> TokenizerCorpusOracle::vocabs_;
std::string TokenizerCorpusOracle::default_pre_vocab_;
nlohmann::json TokenizerCorpusOracle::oracle_;
std::string TokenizerCorpusOracle::setup_error_;

TEST_F(TokenizerCorpusOracle, MatchesLlamaCppOnEveryVocabulary) {
  ASSERT_TRUE(setup_error_.empty()) << setup_error_;
  ASSERT_GT(corpus_.size(), 600u);
  for (const std::string& v : vocabs_) {
    const Tokenizer tok = Tokenizer::from_gguf_path(v);
    const nlohmann::json& expected = oracle_.at(v);
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
