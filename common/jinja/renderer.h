// Walks a parsed template and writes its output (jinja2's semantics: scoping, loops, macros,
// default Undefined). Built-in filters, tests, methods and globals are in builtins.cpp.
#pragma once
#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

#include "common/jinja/ast.h"
#include "common/jinja/value.h"

namespace moraine::jinja {

// Nested macro calls past this depth fail (Python's recursion limit stops jinja2 near here).
inline constexpr int kMaxCallDepth = 100;

struct Frame {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Frame> parent;
  const Value* find(const std::string& name) const;
};

class Renderer {
 public:
  Renderer(std::shared_ptr<Frame> globals, std::optional<std::time_t> now) : globals_(std::move(globals)), now_(now) {}

  std::string render(const Program& program);
  Value call(const Value& callee, CallArgs& args, int line);
  Value eval(const Expr& e, const std::shared_ptr<Frame>& f);
  std::time_t now() const { return now_ ? *now_ : std::time(nullptr); }

 private:
  enum class Flow { Normal, Break, Continue };
  Flow exec(const Body& body, const std::shared_ptr<Frame>& f, std::string& out);
  Flow exec_node(const Node& n, const std::shared_ptr<Frame>& f, std::string& out);
  Flow exec_for(const Node& n, const std::shared_ptr<Frame>& f, std::string& out);
  void exec_set(const Node& n, const std::shared_ptr<Frame>& f);
  Value define_macro(const Node& n, const std::shared_ptr<Frame>& f, const Body* body, std::string name);
  Value eval_inner(const Expr& e, const std::shared_ptr<Frame>& f);
  Value eval_binary(const Expr& e, const std::shared_ptr<Frame>& f);
  Value eval_filter(const Expr& e, const std::shared_ptr<Frame>& f, Value input);
  Value eval_filter_input(const Expr& e, const std::shared_ptr<Frame>& f, Value input);
  Value call_at(const Value& callee, CallArgs& args, int line);
  CallArgs eval_args(const Expr& e, const std::shared_ptr<Frame>& f);

  std::shared_ptr<Frame> globals_;
  std::optional<std::time_t> now_;
  int call_depth_ = 0;
};

// Builtins (builtins.cpp).
Value get_attr(const Value& obj, const std::string& name);
Value get_item(const Value& obj, const Value& key);
Value slice_of(const Value& obj, const Value& start, const Value& stop, const Value& step);
Value apply_filter(Renderer& r, const std::string& name, const Value& input, CallArgs& args);
bool apply_test(Renderer& r, const std::string& name, const Value& input, CallArgs& args);
bool has_filter(const std::string& name);
bool has_test(const std::string& name);
Value binary_op(const std::string& op, const Value& a, const Value& b);
bool contains(const Value& container, const Value& item);
// Python's iter(): a list's items, a dict's keys, a str's characters; Undefined gives nothing.
List iterate(const Value& v);
// Fails with the Undefined's message (jinja2's UndefinedError).
[[noreturn]] void fail_undefined(const Value& v);
// markupsafe.escape: a Markup string as it is, anything else as str() with & < > " ' escaped.
std::string html_escape(const Value& v);
void add_globals(Frame& globals);

}  // namespace moraine::jinja
