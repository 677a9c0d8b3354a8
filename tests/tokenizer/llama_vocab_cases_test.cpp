// llama.cpp's own tokenizer cases: models/ggml-vocab-NAME.gguf.inp holds inputs separated by
// "\n__ggml_vocab_test__\n", .out the expected ids (one line each, space separated). Like
// llama.cpp's test-tokenizer-0 we encode with add_special = false and parse_special = false.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/tokenizer/tokenizer.h"
#include "tests/tokenizer/oracle_paths.h"

namespace moraine::tokenizer::test {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(missing_oracle_message(path));
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

struct Case {
  std::string input;
  std::vector<TokenId> expected;
};

std::vector<Case> read_cases(const std::string& vocab) {
  const std::string inp = read_file(vocab + ".inp"), out = read_file(vocab + ".out");
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> inputs;
  for (size_t pos = 0; pos < inp.size();) {
    const size_t next = inp.find(sep, pos);
    if (next == std::string::npos) {
      inputs.push_back(inp.substr(pos));
      break;
    }
    inputs.push_back(inp.substr(pos, next - pos));
    pos = next + sep.size();
  }
  std::vector<Case> cases;
  std::istringstream lines(out);
  std::string line;
  for (size_t i = 0; std::getline(lines, line); ++i) {
    if (i >= inputs.size()) throw std::runtime_error(vocab + ".out has more lines than .inp cases");
    Case c{inputs[i], {}};
    std::istringstream ids(line);
    for (long id; ids >> id;) c.expected.push_back(static_cast<TokenId>(id));
    cases.push_back(std::move(c));
  }
  if (cases.size() != inputs.size()) throw std::runtime_error(vocab + ": .inp/.out case counts differ");
  return cases;
}

class TokenizerLlamaVocabCases : public ::testing::TestWithParam<const char*> {};

TEST_P(TokenizerLlamaVocabCases, EveryCaseMatchesAndRoundTrips) {
  const std::string path = vocab_path(GetParam());
  ASSERT_TRUE(std::filesystem::exists(path)) << missing_oracle_message(path);
  const Tokenizer tok = Tokenizer::from_gguf_path(path);
  const std::vector<Case> cases = read_cases(path);
  ASSERT_GT(cases.size(), 10u);
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const std::vector<TokenId> got = tok.encode(c.input, false, false);
    EXPECT_EQ(got, c.expected) << GetParam() << " case " << i << ": '" << c.input << "'";
    EXPECT_EQ(tok.decode(got), c.input) << GetParam() << " case " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Vocabs, TokenizerLlamaVocabCases, ::testing::ValuesIn(kVocabs),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

}  // namespace
}  // namespace moraine::tokenizer::test
