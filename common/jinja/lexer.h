// Jinja lexer: template source -> tokens, with jinja2's whitespace control applied to the text
// between tags ("-" and "+" modifiers, trim_blocks, lstrip_blocks).
#pragma once
#include <string>
#include <vector>

namespace moraine::jinja {

struct Token {
  enum class Type { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof };
  Type type;
  std::string text;  // Text: the literal text; String: the decoded value; Name/Op/Int/Float: as written
  int line;
};

struct LexOptions {
  bool trim_blocks = true;    // drop the first newline after a block or comment tag
  bool lstrip_blocks = true;  // drop spaces and tabs from a line's start up to a block or comment tag
};

// Throws TemplateError naming the line for an unterminated tag, comment or string.
std::vector<Token> lex(const std::string& source, const LexOptions& options);

}  // namespace moraine::jinja
