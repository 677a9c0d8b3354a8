// Pre-tokenizer: splits text into words before BPE with the regular expressions of a named
// scheme (`tokenizer.ggml.pre`), run through PCRE2 with Unicode properties and JIT compiled.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace moraine::tokenizer {

class PreTokenizer {
 public:
  // Throws TokenizerError naming the value when the scheme is not one we know.
  explicit PreTokenizer(const std::string& scheme);
  PreTokenizer(PreTokenizer&&) noexcept;
  PreTokenizer& operator=(PreTokenizer&&) noexcept;
  ~PreTokenizer();

  // The schemes we accept, and the regexes one of them runs (in order).
  static std::vector<std::string> known_schemes();
  static std::vector<std::string> regexes_for(const std::string& scheme);

  const std::string& scheme() const { return scheme_; }

  // Appends the words of `text` (valid UTF-8) to `out`, as views into `text`. Each regex in turn
  // splits every piece the previous one produced into its matches and the runs between them;
  // the pieces concatenate back to `text`.
  void split(std::string_view text, std::vector<std::string_view>& out) const;

  // The same words, handed to `sink` one at a time as they are found. With one regex (every
  // scheme but "default") no list of words is built; for 1 MB of text that list is ~4.5 MB of
  // views. Streaming them (with the one-byte shortcut in Tokenizer::encode) took qwen2 encode of
  // moraine-tokenizer-bench's text from 19.4 to 13.9 ms of CPU time.
  void for_each_word(std::string_view text,
                     const std::function<void(std::string_view)>& sink) const;

 private:
  struct Compiled;
  std::string scheme_;
  std::vector<std::unique_ptr<Compiled>> regexes_;
};

}  // namespace moraine::tokenizer
