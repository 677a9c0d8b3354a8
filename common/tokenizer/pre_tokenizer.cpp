#include "common/tokenizer/pre_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <map>

#include "common/tokenizer/tokenizer_error.h"

namespace moraine::tokenizer {
namespace {

// The regexes of each scheme, as llama.cpp's vocabulary loader runs them. Case-insensitive
// contraction groups are spelled with explicit [sS] classes: PCRE2's caseless Unicode matching
// would also accept U+017F and U+212A as 's' and 'k', which the reference tokenizers do not.
const std::string kContractions = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])";

const std::map<std::string, std::vector<std::string>>& scheme_table() {
  static const std::map<std::string, std::vector<std::string>> table = [] {
    const std::vector<std::string> gpt2 = {
        R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))"};
    const std::vector<std::string> llama3 = {
        kContractions +
        R"(|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"};
    const std::vector<std::string> qwen2 = {
        kContractions +
        R"(|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"};
    // Qwen3.5: letter runs also take combining marks (\p{M}).
    const std::vector<std::string> qwen35 = {
        kContractions +
        R"(|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"};
    const std::vector<std::string> fallback = {
        R"([\p{P}\$\+<=>\^~\|]+)",
        R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))",
        R"(\p{N}+)",
        R"([0-9][0-9][0-9])",
    };
    return std::map<std::string, std::vector<std::string>>{
        {"default", fallback},
        {"gpt-2", gpt2},
        {"phi-2", gpt2},
        {"llama-bpe", llama3},
        {"llama3", llama3},
        {"llama-v3", llama3},
        {"qwen2", qwen2},
        {"deepseek-r1-qwen", qwen2},
        {"qwen35", qwen35},
    };
  }();
  return table;
}

// Per-thread match state: PCRE2 match data and a JIT stack larger than the 32 KiB default, so
// very long runs of one character class cannot exhaust it.
struct ThreadMatchState {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;
  ThreadMatchState() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    if (data == nullptr || context == nullptr || stack == nullptr) {
      throw TokenizerError("pre-tokenizer: out of memory creating PCRE2 match state");
    }
    pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~ThreadMatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
  ThreadMatchState(const ThreadMatchState&) = delete;
  ThreadMatchState& operator=(const ThreadMatchState&) = delete;
};

ThreadMatchState& thread_match_state() {
  thread_local ThreadMatchState state;
  return state;
}

}  // namespace

struct PreTokenizer::Compiled {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Compiled() { pcre2_code_free(code); }
};

PreTokenizer::PreTokenizer(const std::string& scheme) : scheme_(scheme) {
  for (const std::string& pattern : regexes_for(scheme)) {
    auto c = std::make_unique<Compiled>();
    int error = 0;
    PCRE2_SIZE offset = 0;
    c->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                            PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
    if (c->code == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(error, msg, sizeof msg);
      throw TokenizerError("pre-tokenizer '" + scheme + "': regex does not compile at offset " +
                           std::to_string(offset) + ": " + reinterpret_cast<const char*>(msg));
    }
    c->jit = pcre2_jit_compile(c->code, PCRE2_JIT_COMPLETE) == 0;
    regexes_.push_back(std::move(c));
  }
}

PreTokenizer::PreTokenizer(PreTokenizer&&) noexcept = default;
PreTokenizer& PreTokenizer::operator=(PreTokenizer&&) noexcept = default;
PreTokenizer::~PreTokenizer() = default;

std::vector<std::string> PreTokenizer::known_schemes() {
  std::vector<std::string> names;
  for (const auto& [name, regexes] : scheme_table()) names.push_back(name);
  return names;
}

std::vector<std::string> PreTokenizer::regexes_for(const std::string& scheme) {
  const auto& table = scheme_table();
  const auto it = table.find(scheme);
  if (it == table.end()) {
    std::string known;
    for (const auto& [name, regexes] : table) known += (known.empty() ? "" : ", ") + name;
    throw TokenizerError("unsupported pre-tokenizer (tokenizer.ggml.pre) '" + scheme +
                         "'; supported: " + known);
  }
  return it->second;
}

namespace {

// Splits one piece with one regex: matches and the runs between them, in order, to `emit`.
template <class Emit>
void split_one(const pcre2_code* code, bool jit, std::string_view piece, const Emit& emit) {
  ThreadMatchState& st = thread_match_state();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(piece.data());
  size_t pos = 0;
  size_t gap_start = 0;
  while (pos < piece.size()) {
    // The text was validated once up front; checking it again on every call would be quadratic.
    const int rc = jit ? pcre2_jit_match(code, subject, piece.size(), pos, PCRE2_NO_UTF_CHECK,
                                         st.data, st.context)
                       : pcre2_match(code, subject, piece.size(), pos, PCRE2_NO_UTF_CHECK,
                                     st.data, st.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      throw TokenizerError(std::string("pre-tokenizer: regex match failed at byte ") +
                           std::to_string(pos) + ": " + reinterpret_cast<const char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
    const size_t start = ov[0], end = ov[1];
    if (end == start) {
      // None of our regexes can match empty; step one code point to be safe anyway.
      ++pos;
      while (pos < piece.size() && (static_cast<uint8_t>(piece[pos]) & 0xC0) == 0x80) ++pos;
      continue;
    }
    if (start > gap_start) emit(piece.substr(gap_start, start - gap_start));
    emit(piece.substr(start, end - start));
    pos = gap_start = end;
  }
  if (gap_start < piece.size()) emit(piece.substr(gap_start));
}

}  // namespace

void PreTokenizer::for_each_word(std::string_view text,
                                 const std::function<void(std::string_view)>& sink) const {
  if (text.empty()) return;
  // Every regex but the last splits into a list; the last one streams its words to the sink.
  std::vector<std::string_view> current{text}, next;
  for (size_t r = 0; r + 1 < regexes_.size(); ++r) {
    next.clear();
    const auto push = [&](std::string_view w) { next.push_back(w); };
    for (std::string_view piece : current) split_one(regexes_[r]->code, regexes_[r]->jit, piece, push);
    current.swap(next);
  }
  const Compiled& last = *regexes_.back();
  for (std::string_view piece : current) split_one(last.code, last.jit, piece, sink);
}

void PreTokenizer::split(std::string_view text, std::vector<std::string_view>& out) const {
  for_each_word(text, [&](std::string_view w) { out.push_back(w); });
}

}  // namespace moraine::tokenizer
