// moraine-tokenize: text on stdin -> token ids as a JSON array, or with --decode a JSON array of
// ids on stdin -> the text, using the tokenizer stored in a GGUF file.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/gguf/gguf.h"
#include "common/tokenizer/tokenizer.h"

namespace {

using moraine::tokenizer::TokenId;
using moraine::tokenizer::Tokenizer;

std::string read_stdin() {
  std::ios::sync_with_stdio(false);
  return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}

std::vector<TokenId> parse_ids(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw std::runtime_error(std::string("stdin is not JSON: ") + e.what());
  }
  if (!j.is_array()) throw std::runtime_error("stdin must hold a JSON array of token ids");
  std::vector<TokenId> ids;
  ids.reserve(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    const auto& v = j[i];
    if (!v.is_number_integer() || v.get<int64_t>() < INT32_MIN || v.get<int64_t>() > INT32_MAX) {
      throw std::runtime_error("element " + std::to_string(i) + " (" + v.dump() +
                               ") is not a token id");
    }
    ids.push_back(static_cast<TokenId>(v.get<int64_t>()));
  }
  return ids;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Tokenize stdin with a GGUF file's tokenizer and print the ids as JSON "
               "(or, with --decode, turn a JSON array of ids back into text)."};
  std::string model;
  bool no_special = false, no_bos = false, decode = false;
  app.add_option("-m,--model", model, "GGUF file (or first shard)")->required();
  app.add_flag("--no-special", no_special,
               "encode: do not match control tokens written in the text; "
               "decode: leave control tokens out of the text");
  app.add_flag("--no-bos", no_bos, "do not add the BOS/EOS tokens the vocabulary asks for");
  app.add_flag("--decode", decode, "read a JSON array of ids and print the text");
  CLI11_PARSE(app, argc, argv);

  try {
    const Tokenizer tok = Tokenizer::from_gguf_path(model);
    const std::string input = read_stdin();
    if (decode) {
      const std::string text = tok.decode(parse_ids(input), !no_special);
      std::fwrite(text.data(), 1, text.size(), stdout);
    } else {
      const std::vector<TokenId> ids = tok.encode(input, !no_bos, !no_special);
      std::cout << nlohmann::json(ids).dump() << "\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "moraine-tokenize: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
