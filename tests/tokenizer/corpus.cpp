#include "tests/tokenizer/corpus.h"

#include <random>

#include "common/tokenizer/utf8.h"

namespace moraine::tokenizer::test {

std::vector<std::string> handpicked_corpus() {
  using namespace std::string_literals;
  std::vector<std::string> c = {
      "",
      "Hello world",
      " Hello World!",
      "int main(int argc, char** argv) {\n    return argc > 1 ? 0 : -1;\n}\n",
      "def f(x):\n\tif x:\n\t\treturn [i ** 2 for i in range(x)]  # squares\n\treturn None\n",
      "{\"key\": [1, 2.5e-3, null, true], \"nested\": {\"a\": \"b\\n\"}}",
      "<div class=\"x\">&nbsp;<a href='https://example.com/path?q=1&r=2#frag'>link</a></div>",
      "$ ls -la | grep -v '^d' && echo \"done\" >> /tmp/log 2>&1",
      "我想在apple工作1314151天～",
      "東京都渋谷区でラーメンを食べました。とても美味しかった！",
      "안녕하세요, 세계! 한국어 토크나이저 테스트입니다.",
      "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 thumbs, 🇯🇵🇺🇸 flags, 1️⃣ keycap, 😶‍🌫️ fog",
      "🚀🚀🚀 multiple 😁😁 emoji ✅",
      "a    b",
      "   leading spaces",
      "trailing spaces   ",
      "\t\t\tindented with tabs",
      "\n\n\n",
      " \n \n ",
      "line one\r\nline two\r\n\r\n",
      "\t \n\t \n  \t  x",
      "nbsp\u00A0here\u3000ideographic\u2028line-sep\u0085nel",
      "\x01\x02\x03\x1f\x7f control",
      "a\0b\0\0c"s,
      "\u0301",
      "e\u0301 and \u0301x and \u0301\u0302\u0303",
      " \u0301\u0301 ",
      "नमस्ते दुनिया",
      "สวัสดีครับ",
      "مرحبا بالعالم ١٢٣٤",
      "Ελληνικά, Русский, עברית, ქართული, Հայերեն",
      "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
      "text<|endoftext|>more text",
      "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
      "</s> and <s> and <unk>",
      "<|im_start|><|im_start|><|im_end|>",
      "<|im_start without end",
      "<think>\nreasoning\n</think>\n\nanswer",
      "<tool_call>{\"name\": \"f\"}</tool_call>",
      "I'm sure DON'T won't it's they'LL we'VE you'D 's 'S",
      "1234567890 3.14159 1,000,000 -42 0x1F ½ Ⅻ",
      std::string(3000, 'a'),
      [] {
        std::string s;
        for (int i = 0; i < 2000; ++i) s += "ab";
        return s;
      }(),
      std::string(1000, '7'),
      std::string(800, '!'),
      std::string(300, ' ') + "x" + std::string(300, '\n'),
      [] {
        std::string s;
        for (int i = 0; i < 600; ++i) s += "字";
        return s;
      }(),
      "https://very.long.example.com/a/b/c/d/e/f/g?x=1234567890abcdef&y=zyxwvutsrqponmlkjihgfedcba",
  };
  return c;
}

namespace {

// Code point ranges assigned in Unicode 14 (the oldest table among PCRE2 10.42 and llama.cpp),
// so both sides agree on every character's category.
struct Range {
  uint32_t lo, hi;
};
constexpr Range kRanges[] = {
    {0x20, 0x7E},      {0x09, 0x0D},      {0x01, 0x1F},       {0xA0, 0xFF},
    {0x100, 0x17F},    {0x300, 0x36F},    {0x391, 0x3A1},     {0x410, 0x44F},
    {0x5D0, 0x5EA},    {0x627, 0x64A},    {0x660, 0x669},     {0x905, 0x939},
    {0x93E, 0x94D},    {0xE01, 0xE3A},    {0x2000, 0x2064},   {0x2070, 0x2071},
    {0x20A0, 0x20C0},  {0x2160, 0x2188},  {0x2190, 0x21FF},   {0x3000, 0x303F},
    {0x3041, 0x3096},  {0x30A1, 0x30FA},  {0x4E00, 0x9FEF},   {0xAC00, 0xD7A3},
    {0xFE00, 0xFE0F},  {0xFF01, 0xFF5E},  {0x1F300, 0x1F64F}, {0x1F680, 0x1F6D2},
    {0x1F900, 0x1F978}, {0x1F3FB, 0x1F3FF}, {0x200D, 0x200D}, {0x1D400, 0x1D454},
};

}  // namespace

std::vector<std::string> random_corpus(size_t n, uint32_t seed, size_t max_pieces) {
  const std::vector<std::string> hand = handpicked_corpus();
  std::mt19937 rng(seed);
  const auto uniform = [&](size_t lo, size_t hi) {
    return std::uniform_int_distribution<size_t>(lo, hi)(rng);
  };
  std::vector<std::string> out;
  out.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    std::string s;
    const size_t pieces = uniform(1, max_pieces);
    for (size_t p = 0; p < pieces; ++p) {
      switch (uniform(0, 3)) {
        case 0: {  // a slice of a hand-picked case, cut at code point boundaries
          const std::string& h = hand[uniform(0, hand.size() - 1)];
          if (h.empty()) break;
          size_t a = uniform(0, h.size() - 1), b = uniform(a, std::min(h.size(), a + 40));
          while (a > 0 && (static_cast<uint8_t>(h[a]) & 0xC0) == 0x80) --a;
          while (b < h.size() && (static_cast<uint8_t>(h[b]) & 0xC0) == 0x80) ++b;
          s += h.substr(a, b - a);
          break;
        }
        case 1:  // a run of one character class: spaces, newlines, tabs or letters
          s += std::string(uniform(1, 8), " \n\t\rx"[uniform(0, 4)]);
          break;
        default: {  // random code points from the ranges
          const size_t count = uniform(1, 6);
          for (size_t i = 0; i < count; ++i) {
            const Range& r = kRanges[uniform(0, std::size(kRanges) - 1)];
            append_utf8(s, static_cast<uint32_t>(uniform(r.lo, r.hi)));
          }
        }
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace moraine::tokenizer::test
