// The syntax tree the parser builds and the renderer walks.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/jinja/value.h"

namespace moraine::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    Literal,    // value
    Name,       // name
    ListLit,    // items
    TupleLit,   // items
    DictLit,    // items: key, value, key, value...
    Attr,       // a.name
    Subscript,  // a[b]
    Slice,      // a[b:c:d] (missing parts null)
    Call,       // a(items, kwargs)
    Filter,     // a | name(items, kwargs); a null inside a filter block
    Test,       // a is [not] name(items)
    Unary,      // name ("-", "+", "not") a
    Binary,     // a name b: + - * / // % ** ~ and or == != < > <= >= in "not in"
    Cond,       // b if a else c
  };
  Kind kind;
  int line;
  Value value;
  std::string name;
  std::vector<ExprPtr> items;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  ExprPtr a, b, c, star_args, star_kwargs;
  bool negated = false;
};

struct Node;
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

struct MacroParam {
  std::string name;
  ExprPtr default_value;  // null: required
};

struct Node {
  enum class Kind { Text, Output, If, For, Set, SetBlock, Macro, CallBlock, FilterBlock, Break, Continue, Scope };
  Kind kind;
  int line;
  std::string text;                             // Text; Macro name; SetBlock/Set target name
  ExprPtr expr;                                 // Output; For iterable; Set value; CallBlock call; FilterBlock filter
  ExprPtr target;                               // Set: a Name, a TupleLit of Names, or an Attr (ns.x)
  std::vector<std::pair<ExprPtr, Body>> branches;  // If: condition + body per if/elif
  std::vector<std::string> loop_vars;           // For
  ExprPtr loop_filter;                          // For ... if cond
  Body body, else_body;                         // For/Macro/CallBlock/SetBlock/FilterBlock/Scope; If/For else
  std::vector<MacroParam> params;               // Macro; CallBlock caller(...)
  bool recursive = false;                       // For ... recursive
};

struct Program {
  Body body;
};

}  // namespace moraine::jinja
