#include "common/jinja/lexer.h"

#include <cctype>
#include <cstring>

#include "common/jinja/value.h"

namespace moraine::jinja {
namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string rstrip_all(std::string s) {
  while (!s.empty() && is_space(s.back())) s.pop_back();
  return s;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

class Lexer {
 public:
  Lexer(const std::string& src, const LexOptions& o) : src_(src), opt_(o) {}

  std::vector<Token> run() {
    bool line_starting = true;
    size_t pos = 0;
    while (pos < src_.size()) {
      const size_t open = find_open(pos);
      std::string text = src_.substr(pos, open - pos);
      if (open == src_.size()) {
        push_text(std::move(text), line_at(pos));
        break;
      }
      const char kind = src_[open + 1];  // '{', '%' or '#'
      const char mod = open + 2 < src_.size() ? src_[open + 2] : '\0';
      if (mod == '-') {
        text = rstrip_all(std::move(text));
      } else if (mod != '+' && kind != '{' && opt_.lstrip_blocks) {
        const size_t nl = text.rfind('\n');
        const size_t from = nl == std::string::npos ? 0 : nl + 1;
        if (from > 0 || line_starting) {
          bool blank = from < text.size();
          for (size_t i = from; i < text.size(); ++i) blank = blank && is_space(text[i]);
          if (blank) text.erase(from);
        }
      }
      push_text(std::move(text), line_at(pos));
      pos = open + 2 + ((mod == '-' || mod == '+') ? 1 : 0);
      if (kind == '#') {
        pos = end_comment(pos, open, line_starting);
      } else {
        pos = lex_tag(pos, kind == '%', line_starting);
      }
    }
    out_.push_back({Token::Type::Eof, "", line_at(src_.size())});
    return std::move(out_);
  }

 private:
  size_t find_open(size_t pos) const {
    for (size_t i = src_.find('{', pos); i != std::string::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    }
    return src_.size();
  }

  int line_at(size_t pos) {
    for (; line_pos_ < pos && line_pos_ < src_.size(); ++line_pos_) line_ += src_[line_pos_] == '\n';
    return line_;
  }

  void push_text(std::string text, int line) {
    if (!text.empty()) out_.push_back({Token::Type::Text, std::move(text), line});
  }

  // After a tag's closing delimiter: "-" eats all whitespace, trim_blocks one newline.
  size_t after_end(size_t pos, bool minus, bool plus, bool block, bool& line_starting) {
    line_starting = false;
    if (minus) {
      size_t p = pos;
      while (p < src_.size() && is_space(src_[p])) ++p;
      line_starting = p > pos && src_[p - 1] == '\n';
      return p;
    }
    if (block && !plus && opt_.trim_blocks && pos < src_.size() && src_[pos] == '\n') {
      line_starting = true;
      return pos + 1;
    }
    return pos;
  }

  size_t end_comment(size_t pos, size_t open, bool& line_starting) {
    const size_t close = src_.find("#}", pos);
    if (close == std::string::npos) throw TemplateError("line " + std::to_string(line_at(open)) + ": unterminated comment");
    const bool minus = close > pos && src_[close - 1] == '-', plus = close > pos && src_[close - 1] == '+';
    return after_end(close + 2, minus, plus, true, line_starting);
  }

  size_t lex_tag(size_t pos, bool block, bool& line_starting) {
    const int open_line = line_at(pos);
    out_.push_back({block ? Token::Type::BlockBegin : Token::Type::VarBegin, "", open_line});
    int balance = 0;
    const char* end = block ? "%}" : "}}";
    while (true) {
      while (pos < src_.size() && is_space(src_[pos])) ++pos;
      if (pos >= src_.size())
        throw TemplateError("line " + std::to_string(open_line) + ": unterminated " + (block ? "block tag" : "variable tag"));
      const int line = line_at(pos);
      if (balance == 0) {
        const bool minus = src_.compare(pos, 3, std::string("-") + end) == 0;
        const bool plus = block && src_.compare(pos, 3, std::string("+") + end) == 0;
        if (minus || plus || src_.compare(pos, 2, end) == 0) {
          out_.push_back({block ? Token::Type::BlockEnd : Token::Type::VarEnd, "", line});
          return after_end(pos + (minus || plus ? 3 : 2), minus, plus, block, line_starting);
        }
      }
      const char c = src_[pos];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = pos;
        while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        out_.push_back({Token::Type::Name, src_.substr(pos, e - pos), line});
        pos = e;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        pos = lex_number(pos, line);
      } else if (c == '\'' || c == '"') {
        pos = lex_string(pos, line);
      } else {
        static const char* two[] = {"//", "**", "==", "!=", "<=", ">="};
        std::string op(1, c);
        for (const char* t : two) {
          if (src_.compare(pos, 2, t) == 0) op = t;
        }
        if (op.size() == 1 && !std::strchr("+-*/%~<>=()[]{},.:|!", c))
          throw TemplateError("line " + std::to_string(line) + ": unexpected character '" + op + "' in a tag");
        if (op == "(" || op == "[" || op == "{") ++balance;
        if ((op == ")" || op == "]" || op == "}") && balance > 0) --balance;
        out_.push_back({Token::Type::Op, op, line});
        pos += op.size();
      }
    }
  }

  size_t lex_number(size_t pos, int line) {
    size_t e = pos;
    auto digits = [&] { while (e < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e; };
    digits();
    bool is_float = false;
    const bool after_dot = !out_.empty() && out_.back().type == Token::Type::Op && out_.back().text == ".";
    if (!after_dot && e + 1 < src_.size() && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
      ++e;
      digits();
      is_float = true;
    }
    if (!after_dot && e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
      size_t x = e + 1;
      if (x < src_.size() && (src_[x] == '+' || src_[x] == '-')) ++x;
      if (x < src_.size() && std::isdigit(static_cast<unsigned char>(src_[x]))) {
        e = x;
        digits();
        is_float = true;
      }
    }
    std::string text;
    for (size_t i = pos; i < e; ++i) if (src_[i] != '_') text += src_[i];
    out_.push_back({is_float ? Token::Type::Float : Token::Type::Int, text, line});
    return e;
  }

  // Python's escapes as jinja2 decodes them (unicode-escape); an unknown one is kept as written.
  size_t lex_string(size_t pos, int line) {
    const char q = src_[pos];
    std::string val;
    size_t i = pos + 1;
    for (; i < src_.size() && src_[i] != q; ++i) {
      if (src_[i] != '\\') {
        val += src_[i];
        continue;
      }
      if (++i >= src_.size()) break;
      const char e = src_[i];
      auto hex = [&](int n) {
        uint32_t cp = 0;
        for (int k = 0; k < n; ++k) {
          if (i + 1 >= src_.size() || !std::isxdigit(static_cast<unsigned char>(src_[i + 1])))
            throw TemplateError("line " + std::to_string(line) + ": bad \\x/\\u escape in a string literal");
          cp = cp * 16 + static_cast<uint32_t>(std::stoi(std::string(1, src_[++i]), nullptr, 16));
        }
        append_utf8(val, cp);
      };
      switch (e) {
        case 'n': val += '\n'; break;
        case 't': val += '\t'; break;
        case 'r': val += '\r'; break;
        case 'b': val += '\b'; break;
        case 'f': val += '\f'; break;
        case 'v': val += '\v'; break;
        case 'a': val += '\a'; break;
        case '0': val += '\0'; break;
        case '\\': val += '\\'; break;
        case '\'': val += '\''; break;
        case '"': val += '"'; break;
        case '\n': break;
        case 'x': hex(2); break;
        case 'u': hex(4); break;
        case 'U': hex(8); break;
        default: val += '\\'; val += e;
      }
    }
    if (i >= src_.size()) throw TemplateError("line " + std::to_string(line) + ": unterminated string literal");
    out_.push_back({Token::Type::String, std::move(val), line});
    return i + 1;
  }

  const std::string& src_;
  LexOptions opt_;
  std::vector<Token> out_;
  size_t line_pos_ = 0;
  int line_ = 1;
};

}  // namespace

std::vector<Token> lex(const std::string& source, const LexOptions& options) {
  return Lexer(source, options).run();
}

}  // namespace moraine::jinja
