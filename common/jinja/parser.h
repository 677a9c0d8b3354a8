// Jinja parser: tokens -> syntax tree. Throws TemplateError naming the line of a syntax error.
#pragma once
#include <string>

#include "common/jinja/ast.h"
#include "common/jinja/lexer.h"

namespace moraine::jinja {

// Nesting (of expressions and of blocks) past this depth is refused rather than recursed into.
inline constexpr int kMaxParseDepth = 200;

Program parse(const std::string& source, const LexOptions& options);

}  // namespace moraine::jinja
