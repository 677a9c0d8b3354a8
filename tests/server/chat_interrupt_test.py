#!/usr/bin/env python3
"""`moraine chat --url` in a terminal (a pty): answers stream, Ctrl-C stops the answer and not
the program (the server sees the connection closed), the next turn carries the history.
The server is a stand-in that streams OpenAI chunks slowly and records what it was sent.
  chat_interrupt_test.py MORAINE_BINARY"""
import http.server, json, os, pty, select, sys, threading, time

requests, closed_early = [], []

class Slow(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        requests.append(body)
        index = len(requests)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n = 200 if index == 1 else 3   # the first answer is long: Ctrl-C stops it
        try:
            for i in range(n):
                c = {"choices": [{"index": 0, "delta": {"content": "w%d " % i}, "finish_reason": None}]}
                data = ("data: " + json.dumps(c) + "\n\n").encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                time.sleep(0.05)
            done = b"data: [DONE]\n\n"
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        except (BrokenPipeError, ConnectionResetError):
            closed_early.append(index)

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
threading.Thread(target=server.serve_forever, daemon=True).start()
url = "http://127.0.0.1:%d" % server.server_address[1]

pid, fd = pty.fork()
if pid == 0:
    os.execv(sys.argv[1], [sys.argv[1], "chat", "--url", url, "--system", "be brief"])
out = b""
def read_until(s, t):
    global out
    end = time.time() + t
    while s not in out and time.time() < end:
        if select.select([fd], [], [], 0.05)[0]:
            try:
                out += os.read(fd, 65536)
            except OSError:
                return
def fail(why):
    print("FAILED:", why, "\n--- terminal:\n" + out.decode(errors="replace"))
    sys.exit(1)

read_until(b"> ", 10)
os.write(fd, b"first question\n")
read_until(b"w5 ", 10)            # streaming: the answer shows up chunk by chunk
if b"w5 " not in out: fail("no streamed text")
os.write(fd, b"\x03")             # Ctrl-C, as the terminal sends it
read_until(b"[stopped]", 5)
if b"[stopped]" not in out: fail("Ctrl-C did not stop the answer")
read_until(b"> ", 5)
os.write(fd, b"second question\n")
read_until(b"w2 ", 10)
os.write(fd, b"/exit\n")
end = time.time() + 10
while time.time() < end:
    done, st = os.waitpid(pid, os.WNOHANG)
    if done: break
    read_until(b"\0", 0.1)
else:
    fail("chat did not exit after /exit")
if not (os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0): fail("exit status %r" % st)
time.sleep(0.3)
if closed_early != [1]: fail("the server did not see the first answer's connection closed: %r" % closed_early)
if len(requests) != 2: fail("%d requests" % len(requests))
second = requests[1]["messages"]
roles = [m["role"] for m in second]
if roles != ["system", "user", "assistant", "user"]: fail("history %r" % roles)
if not second[2]["content"].startswith("w0 w1 w2 w3 w4 w5"): fail("the stopped answer is not in the history: %r" % second[2])
if not requests[0]["stream"]: fail("not streamed")
print("ok: streamed, Ctrl-C stopped the answer (%d chars kept), history of %d messages" % (len(second[2]["content"]), len(second)))
