#include "common/jinja/parser.h"

#include <algorithm>
#include <initializer_list>

namespace moraine::jinja {
namespace {

using T = Token::Type;

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : t_(std::move(toks)) {}

  Program program() {
    Program p;
    p.body = body({});
    if (cur().type != T::Eof) fail("unexpected '" + end_tag_name_ + "' tag");
    return p;
  }

 private:
  struct DepthGuard {
    explicit DepthGuard(Parser& p) : p_(p) {
      if (++p_.depth_ > kMaxParseDepth) p_.fail("the template nests deeper than " + std::to_string(kMaxParseDepth) + " levels");
    }
    ~DepthGuard() { --p_.depth_; }
    Parser& p_;
  };

  const Token& cur() const { return t_[i_]; }
  const Token& peek(size_t n = 1) const { return t_[std::min(i_ + n, t_.size() - 1)]; }
  [[noreturn]] void fail(const std::string& msg) const {
    throw TemplateError("template line " + std::to_string(cur().line) + ": " + msg);
  }
  bool is_op(const char* op) const { return cur().type == T::Op && cur().text == op; }
  bool is_name(const char* n) const { return cur().type == T::Name && cur().text == n; }
  bool accept_op(const char* op) {
    if (!is_op(op)) return false;
    ++i_;
    return true;
  }
  bool accept_name(const char* n) {
    if (!is_name(n)) return false;
    ++i_;
    return true;
  }
  std::string describe(const Token& t) const {
    switch (t.type) {
      case T::Eof: return "end of template";
      case T::BlockEnd: return "end of block tag";
      case T::VarEnd: return "end of variable tag";
      case T::Text: return "text";
      default: return "'" + t.text + "'";
    }
  }
  void expect_op(const char* op) {
    if (!accept_op(op)) fail(std::string("expected '") + op + "', got " + describe(cur()));
  }
  std::string expect_name() {
    if (cur().type != T::Name) fail("expected a name, got " + describe(cur()));
    return t_[i_++].text;
  }
  void expect(T type, const char* what) {
    if (cur().type != type) fail(std::string("expected ") + what + ", got " + describe(cur()));
    ++i_;
  }

  ExprPtr make(Expr::Kind k, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->line = line;
    return e;
  }

  // Statements up to a block tag whose name is in `ends` (left unconsumed: cur() is that name).
  Body body(std::initializer_list<const char*> ends) {
    DepthGuard g(*this);
    Body out;
    while (true) {
      const Token& tk = cur();
      if (tk.type == T::Eof) {
        if (ends.size() != 0) fail(std::string("unexpected end of template: expected '") + *ends.begin() + "'");
        return out;
      }
      if (tk.type == T::Text) {
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::Text;
        n->line = tk.line;
        n->text = tk.text;
        out.push_back(std::move(n));
        ++i_;
      } else if (tk.type == T::VarBegin) {
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::Output;
        n->line = tk.line;
        ++i_;
        n->expr = tuple_or_expr();
        expect(T::VarEnd, "'}}'");
        out.push_back(std::move(n));
      } else if (tk.type == T::BlockBegin) {
        const Token& nm = peek();
        if (nm.type == T::Name) {
          for (const char* e : ends) {
            if (nm.text == e) {
              ++i_;
              return out;
            }
          }
          static const char* closers[] = {"endif", "endfor", "endmacro", "endset", "endcall", "endfilter", "else", "elif", "endgeneration"};
          for (const char* c : closers) {
            if (nm.text == c) {
              ++i_;
              end_tag_name_ = nm.text;
              if (ends.size() == 0) fail("unexpected '" + nm.text + "' tag");
              fail("unexpected '" + nm.text + "' tag: expected '" + *ends.begin() + "'");
            }
          }
        }
        ++i_;
        out.push_back(statement());
      } else {
        fail("unexpected " + describe(tk));
      }
    }
  }

  void end_block() { expect(T::BlockEnd, "'%}'"); }

  NodePtr statement() {
    auto n = std::make_unique<Node>();
    n->line = cur().line;
    const std::string kw = expect_name();
    if (kw == "if") return if_stmt(std::move(n));
    if (kw == "for") return for_stmt(std::move(n));
    if (kw == "set") return set_stmt(std::move(n));
    if (kw == "macro") return macro_stmt(std::move(n));
    if (kw == "call") return call_stmt(std::move(n));
    if (kw == "filter") {
      n->kind = Node::Kind::FilterBlock;
      n->expr = filters(nullptr, n->line);
      end_block();
      n->body = body({"endfilter"});
      ++i_;
      end_block();
      return n;
    }
    if (kw == "generation") {  // Hugging Face's AssistantTracker: renders its body as is
      n->kind = Node::Kind::Scope;
      end_block();
      n->body = body({"endgeneration"});
      ++i_;
      end_block();
      return n;
    }
    if (kw == "break" || kw == "continue") {
      if (loop_depth_ == 0) { --i_; fail("'" + kw + "' outside a for loop"); }
      n->kind = kw == "break" ? Node::Kind::Break : Node::Kind::Continue;
      end_block();
      return n;
    }
    --i_;
    fail("unknown tag '" + kw + "'");
  }

  NodePtr if_stmt(NodePtr n) {
    n->kind = Node::Kind::If;
    while (true) {
      ExprPtr cond = tuple_or_expr();
      end_block();
      Body b = body({"elif", "else", "endif"});
      n->branches.emplace_back(std::move(cond), std::move(b));
      const std::string which = t_[i_++].text;
      if (which == "elif") continue;
      if (which == "else") {
        end_block();
        n->else_body = body({"endif"});
        ++i_;
      }
      end_block();
      return n;
    }
  }

  NodePtr for_stmt(NodePtr n) {
    n->kind = Node::Kind::For;
    do {
      n->loop_vars.push_back(expect_name());
    } while (accept_op(","));
    if (!accept_name("in")) fail("expected 'in' in a for tag, got " + describe(cur()));
    n->expr = tuple_or_expr(false);
    if (accept_name("if")) n->loop_filter = expression(false);
    if (accept_name("recursive")) n->recursive = true;
    end_block();
    ++loop_depth_;
    n->body = body({"endfor", "else"});
    --loop_depth_;
    if (t_[i_++].text == "else") {
      end_block();
      n->else_body = body({"endfor"});
      ++i_;
    }
    end_block();
    return n;
  }

  NodePtr set_stmt(NodePtr n) {
    const int line = cur().line;
    std::string first = expect_name();
    if (is_op(".")) {
      ++i_;
      n->kind = Node::Kind::Set;
      n->target = make(Expr::Kind::Attr, line);
      n->target->a = make(Expr::Kind::Name, line);
      n->target->a->name = first;
      n->target->name = expect_name();
      expect_op("=");
      n->expr = tuple_or_expr();
      end_block();
      return n;
    }
    if (cur().type == T::BlockEnd) {  // {% set x %}...{% endset %}
      n->kind = Node::Kind::SetBlock;
      n->text = first;
      end_block();
      n->body = body({"endset"});
      ++i_;
      end_block();
      return n;
    }
    n->kind = Node::Kind::Set;
    n->target = make(Expr::Kind::TupleLit, line);
    auto add = [&](std::string nm) {
      auto e = make(Expr::Kind::Name, line);
      e->name = std::move(nm);
      n->target->items.push_back(std::move(e));
    };
    add(first);
    bool tuple = false;
    while (accept_op(",")) {
      tuple = true;
      add(expect_name());
    }
    if (!tuple) n->target = std::move(n->target->items[0]);
    expect_op("=");
    n->expr = tuple_or_expr();
    end_block();
    return n;
  }

  void param_list(std::vector<MacroParam>& params) {
    expect_op("(");
    while (!is_op(")")) {
      if (!params.empty()) expect_op(",");
      if (is_op(")")) break;
      MacroParam p;
      p.name = expect_name();
      if (accept_op("=")) p.default_value = expression();
      params.push_back(std::move(p));
    }
    ++i_;
  }

  NodePtr macro_stmt(NodePtr n) {
    n->kind = Node::Kind::Macro;
    n->text = expect_name();
    param_list(n->params);
    end_block();
    const int saved = loop_depth_;
    loop_depth_ = 0;
    n->body = body({"endmacro"});
    loop_depth_ = saved;
    ++i_;
    end_block();
    return n;
  }

  NodePtr call_stmt(NodePtr n) {
    n->kind = Node::Kind::CallBlock;
    if (is_op("(")) param_list(n->params);
    n->expr = expression();
    if (n->expr->kind != Expr::Kind::Call) fail("a call block needs a call expression");
    end_block();
    n->body = body({"endcall"});
    ++i_;
    end_block();
    return n;
  }

  // An expression, or several separated by commas (a tuple without parentheses).
  ExprPtr tuple_or_expr(bool with_cond = true) {
    const int line = cur().line;
    ExprPtr first = expression(with_cond);
    if (!is_op(",")) return first;
    auto t = make(Expr::Kind::TupleLit, line);
    t->items.push_back(std::move(first));
    while (accept_op(",")) {
      if (cur().type == T::BlockEnd || cur().type == T::VarEnd || is_op(")")) break;
      t->items.push_back(expression(with_cond));
    }
    return t;
  }

  ExprPtr expression(bool with_cond = true) {
    DepthGuard g(*this);
    ExprPtr e = or_expr();
    if (with_cond && is_name("if")) {
      const int line = cur().line;
      ++i_;
      auto c = make(Expr::Kind::Cond, line);
      c->b = std::move(e);
      c->a = or_expr();
      if (accept_name("else")) c->c = expression();
      return c;
    }
    return e;
  }

  ExprPtr binary(const std::string& op, ExprPtr l, ExprPtr r, int line) {
    auto b = make(Expr::Kind::Binary, line);
    b->name = op;
    b->a = std::move(l);
    b->b = std::move(r);
    return b;
  }

  ExprPtr or_expr() {
    ExprPtr l = and_expr();
    while (is_name("or")) {
      const int line = t_[i_++].line;
      l = binary("or", std::move(l), and_expr(), line);
    }
    return l;
  }

  ExprPtr and_expr() {
    ExprPtr l = not_expr();
    while (is_name("and")) {
      const int line = t_[i_++].line;
      l = binary("and", std::move(l), not_expr(), line);
    }
    return l;
  }

  ExprPtr not_expr() {
    if (is_name("not")) {
      DepthGuard g(*this);
      auto u = make(Expr::Kind::Unary, t_[i_++].line);
      u->name = "not";
      u->a = not_expr();
      return u;
    }
    return compare();
  }

  ExprPtr compare() {
    ExprPtr l = math1();
    while (true) {
      const int line = cur().line;
      std::string op;
      if (cur().type == T::Op && (cur().text == "==" || cur().text == "!=" || cur().text == "<" || cur().text == ">" ||
                                  cur().text == "<=" || cur().text == ">=")) {
        op = t_[i_++].text;
      } else if (is_name("in")) {
        ++i_;
        op = "in";
      } else if (is_name("not") && peek().type == T::Name && peek().text == "in") {
        i_ += 2;
        op = "not in";
      } else {
        return l;
      }
      l = binary(op, std::move(l), math1(), line);
    }
  }

  ExprPtr math1() {
    ExprPtr l = concat();
    while (is_op("+") || is_op("-")) {
      const Token& op = t_[i_++];
      l = binary(op.text, std::move(l), concat(), op.line);
    }
    return l;
  }

  ExprPtr concat() {
    ExprPtr l = math2();
    while (is_op("~")) {
      const int line = t_[i_++].line;
      l = binary("~", std::move(l), math2(), line);
    }
    return l;
  }

  ExprPtr math2() {
    ExprPtr l = power();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& op = t_[i_++];
      l = binary(op.text, std::move(l), power(), op.line);
    }
    return l;
  }

  ExprPtr power() {
    ExprPtr l = unary();
    while (is_op("**")) {
      const int line = t_[i_++].line;
      l = binary("**", std::move(l), unary(), line);
    }
    return l;
  }

  ExprPtr unary(bool with_filter = true) {
    DepthGuard g(*this);
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      e = make(Expr::Kind::Unary, cur().line);
      e->name = t_[i_++].text;
      e->a = unary(false);
    } else {
      e = postfix(primary());
    }
    return with_filter ? filters(std::move(e), e ? e->line : cur().line) : std::move(e);
  }

  void call_args(Expr& call) {
    expect_op("(");
    while (!is_op(")")) {
      if (!call.items.empty() || !call.kwargs.empty() || call.star_args || call.star_kwargs) expect_op(",");
      if (is_op(")")) break;
      if (accept_op("**")) {
        call.star_kwargs = expression();
      } else if (accept_op("*")) {
        call.star_args = expression();
      } else if (cur().type == T::Name && peek().type == T::Op && peek().text == "=") {
        std::string k = t_[i_].text;
        i_ += 2;
        call.kwargs.emplace_back(std::move(k), expression());
      } else {
        if (!call.kwargs.empty()) fail("a positional argument follows a keyword argument");
        call.items.push_back(expression());
      }
    }
    ++i_;
  }

  // `| name(args)` and `is [not] name(args)` chains after an operand (e null: a filter block).
  ExprPtr filters(ExprPtr e, int line) {
    bool first_bare = e == nullptr;
    while (true) {
      if (first_bare || is_op("|")) {
        if (!first_bare) ++i_;
        first_bare = false;
        auto f = make(Expr::Kind::Filter, cur().line);
        f->name = expect_name();
        while (accept_op(".")) f->name += "." + expect_name();
        if (is_op("(")) call_args(*f);
        f->a = std::move(e);
        e = std::move(f);
      } else if (is_name("is")) {
        auto t = make(Expr::Kind::Test, t_[i_++].line);
        t->negated = accept_name("not");
        t->name = expect_name();
        while (accept_op(".")) t->name += "." + expect_name();
        if (is_op("(")) {
          call_args(*t);
        } else if ((cur().type == T::Name || cur().type == T::String || cur().type == T::Int || cur().type == T::Float ||
                    is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and") && !is_name("if") && !is_name("in") &&
                   !is_name("not") && !is_name("is")) {
          t->items.push_back(postfix(primary()));
        }
        t->a = std::move(e);
        e = std::move(t);
      } else if (is_op("(") && e) {
        auto c = make(Expr::Kind::Call, cur().line);
        call_args(*c);
        c->a = std::move(e);
        e = postfix(std::move(c));
      } else {
        (void)line;
        return e;
      }
    }
  }

  ExprPtr postfix(ExprPtr e) {
    while (true) {
      const int line = cur().line;
      if (accept_op(".")) {
        auto a = make(Expr::Kind::Attr, line);
        if (cur().type == T::Int) {
          a->kind = Expr::Kind::Subscript;
          a->b = make(Expr::Kind::Literal, line);
          a->b->value = Value(static_cast<int64_t>(std::stoll(t_[i_++].text)));
        } else {
          a->name = expect_name();
        }
        a->a = std::move(e);
        e = std::move(a);
      } else if (is_op("[")) {
        ++i_;
        e = subscript(std::move(e), line);
      } else if (is_op("(")) {
        auto c = make(Expr::Kind::Call, line);
        call_args(*c);
        c->a = std::move(e);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  ExprPtr subscript(ExprPtr target, int line) {
    ExprPtr parts[3];
    int n = 0;
    bool slice = false;
    while (true) {
      if (is_op("]")) break;
      if (accept_op(":")) {
        slice = true;
        if (++n > 2) fail("a slice has at most three parts");
        continue;
      }
      if (parts[n]) fail("expected ':' or ']' in a subscript, got " + describe(cur()));
      parts[n] = expression();
    }
    ++i_;
    auto s = make(slice ? Expr::Kind::Slice : Expr::Kind::Subscript, line);
    s->a = std::move(target);
    if (!slice && !parts[0]) fail("an empty subscript");
    s->b = std::move(parts[0]);
    s->c = std::move(parts[1]);
    if (slice) s->star_args = std::move(parts[2]);  // the step
    return s;
  }

  ExprPtr primary() {
    DepthGuard g(*this);
    const Token& tk = cur();
    const int line = tk.line;
    if (tk.type == T::Name) {
      ++i_;
      auto e = make(Expr::Kind::Literal, line);
      if (tk.text == "true" || tk.text == "True") e->value = Value(true);
      else if (tk.text == "false" || tk.text == "False") e->value = Value(false);
      else if (tk.text == "none" || tk.text == "None") e->value = Value::none();
      else { e->kind = Expr::Kind::Name; e->name = tk.text; }
      return e;
    }
    if (tk.type == T::String) {
      std::string s;
      while (cur().type == T::String) s += t_[i_++].text;
      auto e = make(Expr::Kind::Literal, line);
      e->value = Value(std::move(s));
      return e;
    }
    if (tk.type == T::Int || tk.type == T::Float) {
      ++i_;
      auto e = make(Expr::Kind::Literal, line);
      try {
        e->value = tk.type == T::Int ? Value(static_cast<int64_t>(std::stoll(tk.text))) : Value(std::stod(tk.text));
      } catch (const std::exception&) {
        --i_;
        fail("number out of range: " + tk.text);
      }
      return e;
    }
    if (accept_op("(")) {
      if (accept_op(")")) return make(Expr::Kind::TupleLit, line);
      ExprPtr first = expression();
      if (accept_op(")")) return first;
      auto t = make(Expr::Kind::TupleLit, line);
      t->items.push_back(std::move(first));
      while (accept_op(",")) {
        if (is_op(")")) break;
        t->items.push_back(expression());
      }
      expect_op(")");
      return t;
    }
    if (accept_op("[")) {
      auto l = make(Expr::Kind::ListLit, line);
      while (!is_op("]")) {
        if (!l->items.empty()) expect_op(",");
        if (is_op("]")) break;
        l->items.push_back(expression());
      }
      ++i_;
      return l;
    }
    if (accept_op("{")) {
      auto d = make(Expr::Kind::DictLit, line);
      while (!is_op("}")) {
        if (!d->items.empty()) expect_op(",");
        if (is_op("}")) break;
        d->items.push_back(expression());
        expect_op(":");
        d->items.push_back(expression());
      }
      ++i_;
      return d;
    }
    fail("unexpected " + describe(tk));
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  int depth_ = 0, loop_depth_ = 0;
  std::string end_tag_name_;
};

}  // namespace

Program parse(const std::string& source, const LexOptions& options) {
  return Parser(lex(source, options)).program();
}

}  // namespace moraine::jinja
