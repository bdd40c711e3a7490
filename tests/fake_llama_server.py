"""A stand-in for llama.cpp's llama-server (tests/test_llamacpp_server.py): its flags, log lines and API.

It serves /health, /props and /completion on --port, and appends
every /completion body to FAKE_LLAMA_REQUESTS (JSON lines). Tokens are made up: prompt[-1] + 1, + 2, ...
(mod 100); prefill takes 10 ms and each further token 2 ms, as the reply's timings say.
With `-md HEAD --spec-type draft-eagle3` it speculates as llama-server reports it: of the n - 1 tokens after the
first, half (rounded down) were accepted drafts, each of the other forwards drafted --spec-draft-n-max (3).
FAKE_LLAMA_ARGV: write the command line there (JSON), to check the flags.
FAKE_LLAMA_FAIL: print it and exit 1 instead of serving (a model the server cannot load).
"""

from __future__ import annotations

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

PREFILL_MS, TOKEN_MS = 10.0, 2.0


class Handler(BaseHTTPRequestHandler):
    drafts_per_round = 0  # llama-server's --spec-draft-n-max under --spec-type draft-eagle3; 0: no speculation

    def log_message(self, *args) -> None:  # keep the log to the server's own lines
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._reply(200, {"build_info": "b4242-fake123"} if self.path == "/props" else {"status": "ok"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(os.environ["FAKE_LLAMA_REQUESTS"], "a") as log:
            log.write(json.dumps(body) + "\n")
        if len(body["prompt"]) > 64:
            self._reply(400, {"error": {"code": 400, "message": "the request exceeds the available context size",
                                        "type": "exceed_context_size_error"}})
            return
        n = body["n_predict"]
        tokens = [(body["prompt"][-1] + 1 + i) % 100 for i in range(n)]
        timings = {"prompt_n": len(body["prompt"]), "prompt_ms": PREFILL_MS, "predicted_n": n,
                   "predicted_ms": TOKEN_MS * (n - 1), "predicted_per_second": 1e3 / TOKEN_MS}
        if self.drafts_per_round:
            accepted = (n - 1) // 2
            timings.update(draft_n=self.drafts_per_round * (n - 1 - accepted), draft_n_accepted=accepted)
        self._reply(200, {"content": "", "tokens": tokens, "stop_type": "limit", "timings": timings})


def main(argv: list[str]) -> None:
    if os.environ.get("FAKE_LLAMA_FAIL"):
        print(f"main: {os.environ['FAKE_LLAMA_FAIL']}", file=sys.stderr)
        sys.exit(1)
    if os.environ.get("FAKE_LLAMA_ARGV"):
        with open(os.environ["FAKE_LLAMA_ARGV"], "w") as out:
            json.dump(argv, out)
    args = {flag: value for flag, value in zip(argv, argv[1:]) if flag.startswith("-")}
    if args.get("--spec-type") == "draft-eagle3" and "-md" in args:
        Handler.drafts_per_round = int(args.get("--spec-draft-n-max", 3))
    HTTPServer((args["--host"], int(args["--port"])), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
