// `moraine chat`: an interactive terminal chat against an OpenAI-compatible server (--url) or a
// group it starts itself (-m MODEL, served on a free loopback port). Answers stream as they are
// generated; the conversation is kept and sent whole each turn (the prefix cache makes that
// cheap); Ctrl-C stops the answer, not the program (Ctrl-D or /exit quits, /reset forgets).
#pragma once
#include <istream>
#include <optional>
#include <ostream>
#include <string>

#include "server/serve.h"

namespace moraine::server {

struct ChatOptions {
  std::string url;              // http://HOST:PORT (a trailing /v1 is fine); empty: serve -m
  std::string api_key, system;
  int max_tokens = 0;           // 0: the server's default (until the context is full)
  double temperature = 0.7;
  std::optional<ServeOptions> serve;   // -m MODEL: the group and server to start
};

int run_chat(ChatOptions o, std::istream& in, std::ostream& out);

}  // namespace moraine::server
