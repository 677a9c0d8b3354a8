#include "common/jinja/renderer.h"

namespace moraine::jinja {
namespace {

// An error that already names its template line.
class LocatedError : public TemplateError {
 public:
  using TemplateError::TemplateError;
};

[[noreturn]] void fail_at(int line, const std::string& msg) {
  throw LocatedError("template line " + std::to_string(line) + ": " + msg);
}

}  // namespace

const Value* Frame::find(const std::string& name) const {
  for (const Frame* f = this; f; f = f->parent.get()) {
    auto it = f->vars.find(name);
    if (it != f->vars.end()) return &it->second;
  }
  return nullptr;
}

std::string Renderer::render(const Program& program) {
  auto top = std::make_shared<Frame>();
  top->parent = globals_;
  std::string out;
  exec(program.body, top, out);
  return out;
}

Renderer::Flow Renderer::exec(const Body& body, const std::shared_ptr<Frame>& f, std::string& out) {
  for (const NodePtr& n : body) {
    const Flow fl = exec_node(*n, f, out);
    if (out.size() > kMaxSequenceSize) fail_at(n->line, "rendered output of more than 2^28 bytes");
    if (fl != Flow::Normal) return fl;
  }
  return Flow::Normal;
}

Renderer::Flow Renderer::exec_node(const Node& n, const std::shared_ptr<Frame>& f, std::string& out) {
  try {
    switch (n.kind) {
      case Node::Kind::Text: out += n.text; return Flow::Normal;
      case Node::Kind::Output: out += eval(*n.expr, f).str(); return Flow::Normal;
      case Node::Kind::If:
        for (const auto& [cond, body] : n.branches) {
          if (eval(*cond, f).truthy()) return exec(body, f, out);
        }
        return exec(n.else_body, f, out);
      case Node::Kind::For: return exec_for(n, f, out);
      case Node::Kind::Set: exec_set(n, f); return Flow::Normal;
      case Node::Kind::SetBlock: {
        std::string s;
        exec(n.body, f, s);
        f->vars[n.text] = Value(std::move(s));
        return Flow::Normal;
      }
      case Node::Kind::Macro: f->vars[n.text] = define_macro(n, f, &n.body, n.text); return Flow::Normal;
      case Node::Kind::CallBlock: {
        const Expr& call = *n.expr;
        Value callee = eval(*call.a, f);
        CallArgs args = eval_args(call, f);
        args.keyword.emplace_back("caller", define_macro(n, f, &n.body, "caller"));
        out += call_at(callee, args, call.line).str();
        return Flow::Normal;
      }
      case Node::Kind::FilterBlock: {
        std::string s;
        exec(n.body, f, s);
        out += eval_filter(*n.expr, f, Value(std::move(s))).str();
        return Flow::Normal;
      }
      case Node::Kind::Break: return Flow::Break;
      case Node::Kind::Continue: return Flow::Continue;
      case Node::Kind::Scope: return exec(n.body, f, out);
    }
  } catch (const LocatedError&) {
    throw;
  } catch (const std::exception& e) {  // TemplateError, or e.g. std::out_of_range from a number too big
    fail_at(n.line, e.what());
  }
  return Flow::Normal;
}

Value Renderer::call_at(const Value& callee, CallArgs& args, int line) {
  try {
    return call(callee, args, line);
  } catch (const LocatedError&) {
    throw;
  } catch (const std::exception& e) {  // TemplateError, or e.g. std::out_of_range from a number too big
    fail_at(line, e.what());
  }
}

Renderer::Flow Renderer::exec_for(const Node& n, const std::shared_ptr<Frame>& f, std::string& out) {
  if (n.recursive) fail_at(n.line, "recursive for loops are not supported");
  Value seq = eval(*n.expr, f);
  if (!seq.is_undefined() && !seq.is_list() && !seq.is_dict() && !seq.is_string())
    fail_at(n.line, "'" + seq.type_name() + "' object is not iterable");
  List items = iterate(seq);
  auto bind = [&](Frame& fr, const Value& item) {
    if (n.loop_vars.size() == 1) {
      fr.vars[n.loop_vars[0]] = item;
      return;
    }
    List parts = iterate(item);
    if (parts.size() != n.loop_vars.size())
      fail_at(n.line, "cannot unpack " + std::to_string(parts.size()) + " values into " +
                          std::to_string(n.loop_vars.size()) + " loop variables");
    for (size_t k = 0; k < parts.size(); ++k) fr.vars[n.loop_vars[k]] = parts[k];
  };
  if (n.loop_filter) {
    List kept;
    for (const Value& item : items) {
      auto fr = std::make_shared<Frame>();
      fr->parent = f;
      bind(*fr, item);
      if (eval(*n.loop_filter, fr).truthy()) kept.push_back(item);
    }
    items = std::move(kept);
  }
  if (items.empty()) return exec(n.else_body, f, out);
  const int64_t len = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < len; ++i) {
    auto fr = std::make_shared<Frame>();
    fr->parent = f;
    bind(*fr, items[static_cast<size_t>(i)]);
    Dict loop;
    loop.set("index", Value(i + 1));
    loop.set("index0", Value(i));
    loop.set("revindex", Value(len - i));
    loop.set("revindex0", Value(len - i - 1));
    loop.set("first", Value(i == 0));
    loop.set("last", Value(i == len - 1));
    loop.set("length", Value(len));
    loop.set("depth", Value(1));
    loop.set("depth0", Value(0));
    if (i > 0) loop.set("previtem", items[static_cast<size_t>(i - 1)]);
    if (i + 1 < len) loop.set("nextitem", items[static_cast<size_t>(i + 1)]);
    loop.set("cycle", Value::function("cycle", [i](Renderer&, CallArgs& a) -> Value {
      if (a.positional.empty()) throw TemplateError("no items for cycling given");
      return a.positional[static_cast<size_t>(i) % a.positional.size()];
    }));
    fr->vars["loop"] = Value::dict(std::move(loop));
    if (exec(n.body, fr, out) == Flow::Break) break;
  }
  return Flow::Normal;
}

void Renderer::exec_set(const Node& n, const std::shared_ptr<Frame>& f) {
  Value v = eval(*n.expr, f);
  const Expr& t = *n.target;
  if (t.kind == Expr::Kind::Name) {
    f->vars[t.name] = std::move(v);
  } else if (t.kind == Expr::Kind::Attr) {
    Value obj = eval(*t.a, f);
    if (!obj.is_namespace()) fail_at(n.line, "cannot assign attribute on non-namespace object");
    obj.as_dict().set(t.name, std::move(v));
  } else {
    List parts = iterate(v);
    if (parts.size() != t.items.size())
      fail_at(n.line, "cannot unpack " + std::to_string(parts.size()) + " values into " + std::to_string(t.items.size()) +
                          " names");
    for (size_t k = 0; k < parts.size(); ++k) f->vars[t.items[k]->name] = parts[k];
  }
}

// A macro (or a call block's caller): renders its body in a frame under the one it was defined in.
Value Renderer::define_macro(const Node& n, const std::shared_ptr<Frame>& f, const Body* body, std::string name) {
  std::weak_ptr<Frame> defined_in = f;  // weak: the frame holds the macro, which must not keep it alive
  const Node* node = &n;
  return Value::function(name, [node, defined_in, body, name](Renderer& r, CallArgs& args) -> Value {
    if (r.call_depth_ >= kMaxCallDepth)
      throw TemplateError("macro '" + name + "': calls nest deeper than " + std::to_string(kMaxCallDepth));
    struct Depth {
      int& d;
      ~Depth() { --d; }
    } depth{++r.call_depth_};
    auto fr = std::make_shared<Frame>();
    fr->parent = defined_in.lock();
    if (!fr->parent) fr->parent = r.globals_;
    Value caller = Value::undefined("'caller' is undefined");
    std::vector<bool> used(args.keyword.size(), false);
    for (size_t k = 0; k < args.keyword.size(); ++k) {
      if (args.keyword[k].first == "caller") { caller = args.keyword[k].second; used[k] = true; }
    }
    for (size_t i = 0; i < node->params.size(); ++i) {
      const MacroParam& p = node->params[i];
      Value v;
      bool found = false;
      if (i < args.positional.size()) {
        v = args.positional[i];
        found = true;
      } else {
        for (size_t k = 0; k < args.keyword.size(); ++k) {
          if (!used[k] && args.keyword[k].first == p.name) { v = args.keyword[k].second; used[k] = found = true; }
        }
      }
      if (!found) v = p.default_value ? r.eval(*p.default_value, fr) : Value::undefined("'" + p.name + "' is undefined");
      fr->vars[p.name] = std::move(v);
    }
    List extra;
    for (size_t i = node->params.size(); i < args.positional.size(); ++i) extra.push_back(args.positional[i]);
    Dict kw;
    for (size_t k = 0; k < args.keyword.size(); ++k) {
      if (!used[k]) kw.set(args.keyword[k].first, args.keyword[k].second);
    }
    fr->vars["varargs"] = Value::list(std::move(extra), true);
    fr->vars["kwargs"] = Value::dict(std::move(kw));
    if (!caller.is_undefined()) fr->vars["caller"] = caller;
    std::string out;
    r.exec(*body, fr, out);
    return Value(std::move(out));
  });
}

Value Renderer::call(const Value& callee, CallArgs& args, int line) {
  (void)line;
  if (callee.is_function()) return callee.as_function().call(*this, args);
  if (callee.is_undefined()) fail_undefined(callee);
  throw TemplateError("'" + callee.type_name() + "' object is not callable");
}

CallArgs Renderer::eval_args(const Expr& e, const std::shared_ptr<Frame>& f) {
  CallArgs a;
  for (const ExprPtr& x : e.items) a.positional.push_back(eval(*x, f));
  if (e.star_args) {
    for (Value& v : iterate(eval(*e.star_args, f))) a.positional.push_back(std::move(v));
  }
  for (const auto& [k, x] : e.kwargs) a.keyword.emplace_back(k, eval(*x, f));
  if (e.star_kwargs) {
    Value d = eval(*e.star_kwargs, f);
    if (!d.is_dict()) throw TemplateError("argument after ** must be a mapping, not " + d.type_name());
    for (const auto& [k, v] : d.as_dict().items()) a.keyword.emplace_back(k, v);
  }
  return a;
}

Value Renderer::eval(const Expr& e, const std::shared_ptr<Frame>& f) {
  try {
    return eval_inner(e, f);
  } catch (const LocatedError&) {
    throw;
  } catch (const std::exception& x) {
    fail_at(e.line, x.what());
  }
}

Value Renderer::eval_filter(const Expr& e, const std::shared_ptr<Frame>& f, Value input) {
  // A filter block's chain: the innermost filter (a == null) takes the block's text.
  if (e.a) input = eval_filter_input(*e.a, f, std::move(input));
  CallArgs args = eval_args(e, f);
  return apply_filter(*this, e.name, input, args);
}

Value Renderer::eval_filter_input(const Expr& e, const std::shared_ptr<Frame>& f, Value input) {
  if (e.kind == Expr::Kind::Filter) return eval_filter(e, f, std::move(input));
  return eval(e, f);
}

Value Renderer::eval_inner(const Expr& e, const std::shared_ptr<Frame>& f) {
  switch (e.kind) {
    case Expr::Kind::Literal: return e.value;
    case Expr::Kind::Name: {
      const Value* v = f->find(e.name);
      return v ? *v : Value::undefined("'" + e.name + "' is undefined");
    }
    case Expr::Kind::ListLit:
    case Expr::Kind::TupleLit: {
      List items;
      for (const ExprPtr& x : e.items) items.push_back(eval(*x, f));
      return Value::list(std::move(items), e.kind == Expr::Kind::TupleLit);
    }
    case Expr::Kind::DictLit: {
      Dict d;
      for (size_t i = 0; i + 1 < e.items.size(); i += 2) {
        Value k = eval(*e.items[i], f);
        d.set_key(k, eval(*e.items[i + 1], f));
      }
      return Value::dict(std::move(d));
    }
    case Expr::Kind::Attr: {
      Value obj = eval(*e.a, f);
      return get_attr(obj, e.name);
    }
    case Expr::Kind::Subscript: {
      Value obj = eval(*e.a, f);
      return get_item(obj, eval(*e.b, f));
    }
    case Expr::Kind::Slice: {
      Value obj = eval(*e.a, f);
      return slice_of(obj, e.b ? eval(*e.b, f) : Value::none(), e.c ? eval(*e.c, f) : Value::none(),
                      e.star_args ? eval(*e.star_args, f) : Value::none());
    }
    case Expr::Kind::Call: {
      Value callee = eval(*e.a, f);
      CallArgs args = eval_args(e, f);
      return call(callee, args, e.line);
    }
    case Expr::Kind::Filter: {
      if (!e.a) throw TemplateError("a filter without input");
      return eval_filter(e, f, Value());
    }
    case Expr::Kind::Test: {
      Value input = eval(*e.a, f);
      CallArgs args = eval_args(e, f);
      return Value(apply_test(*this, e.name, input, args) != e.negated);
    }
    case Expr::Kind::Unary: {
      Value v = eval(*e.a, f);
      if (e.name == "not") return Value(!v.truthy());
      if (v.is_undefined()) fail_undefined(v);
      if (e.name == "+" && v.is_number()) return v.is_bool() ? Value(v.as_int()) : v;
      if (v.is_float()) return Value(-v.as_number());
      if (v.is_number()) return Value(-v.as_int());
      throw TemplateError("bad operand type for unary " + e.name + ": '" + v.type_name() + "'");
    }
    case Expr::Kind::Binary: return eval_binary(e, f);
    case Expr::Kind::Cond: {
      if (eval(*e.a, f).truthy()) return eval(*e.b, f);
      return e.c ? eval(*e.c, f) : Value::undefined("the inline if's condition was false and it has no else");
    }
  }
  return Value();
}

Value Renderer::eval_binary(const Expr& e, const std::shared_ptr<Frame>& f) {
  if (e.name == "and") {
    Value l = eval(*e.a, f);
    return l.truthy() ? eval(*e.b, f) : l;
  }
  if (e.name == "or") {
    Value l = eval(*e.a, f);
    return l.truthy() ? l : eval(*e.b, f);
  }
  Value l = eval(*e.a, f);
  Value r = eval(*e.b, f);
  return binary_op(e.name, l, r);
}

}  // namespace moraine::jinja
