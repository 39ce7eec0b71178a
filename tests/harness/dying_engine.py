"""A fake engine that starts well and dies on its first completion request, as llama.cpp did
when it segfaulted: `python dying_engine.py --port N --model NAME --die segv|exit1`.

It answers `/health` and `/v1/models` (all a managed target's startup and preflight ask),
prints a last line to its log, then kills itself with SIGSEGV or exits with code 1."""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def die(how: str) -> None:
    print(f"dying engine: the first completion request arrived; dying by {how}", flush=True)
    if how == "segv":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the test's cwd
        # to this thread, so it lands before the next line (os.kill to the whole process
        # may be delivered after this thread went on to exit)
        signal.raise_signal(signal.SIGSEGV)
    os._exit(1)  # from a handler thread: sys.exit would end only the thread


def handler_for(model: str, how: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
            else:
                self._json(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            die(how)

        def _json(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base's name)
            print(format % args, file=sys.stderr, flush=True)

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fake")
    parser.add_argument("--die", choices=("segv", "exit1"), default="segv")
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler_for(args.model, args.die))
    print(f"dying engine: listening on 127.0.0.1:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
