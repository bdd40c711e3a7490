"""llama.cpp's own binary as the bench reference (method `llamacpp:bin`): llama-server, as users run it.

The `llamacpp` method decodes through llama-cpp-python's per-token Python loop, which costs a few per
cent against llama.cpp's own tools (issue 43 measured llama-bench faster on the same build). This
method starts one `llama-server` per bench on the session model's GGUF, with the bench's thread count,
and sends each prompt's token ids to its `/completion` endpoint: greedy (or llama.cpp's own sampler),
no prompt cache, the generated ids returned. Its tok/s is the server's own `predicted_per_second`,
which counts what ours counts: tokens after the first over the time after the first (the first comes
from the prefill's logits), so the two rates compare directly.

`llamacpp:bin:eagle3=HEAD.gguf` runs the same server with llama.cpp's EAGLE-3 speculation on a head we
trained (`prep export-drafter`, then llama.cpp's convert_hf_to_gguf.py): the bench then reports llama.cpp's
acceptance beside ours, from the counts its replies carry (draft_n, draft_n_accepted).

The binary comes from SPECVOCAB_LLAMACPP_BIN (the llama-server file, or the folder holding it), else
from PATH; docs/llamacpp-reference.md says how to build it. Like `llamacpp`, it makes no identity
claim: llama.cpp quantizes activations, so the bench reports how often its tokens equal `ar`'s.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.common.sampling import SamplingParams
from runtime.common.stats import DecodeStats, SpecStats
from runtime.kernels import decode_threads
from runtime.llamacpp.bindings import LlamaCppUnavailable, features_line
from runtime.loops.decode import TokenStream

BIN_ENV = "SPECVOCAB_LLAMACPP_BIN"
SERVER = "llama-server"
MISSING = (f"method llamacpp:bin runs llama.cpp's own {SERVER}: build it (docs/llamacpp-reference.md), then set "
           f"{BIN_ENV}=/path/to/{SERVER} or put it on PATH")
# llama.cpp's llama_print_system_info(), the line llama-cpp-python's build_info reads too.
_SYSTEM_INFO = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); lib.llama_print_system_info.restype = ctypes.c_char_p; "
                "print(lib.llama_print_system_info().decode(errors='replace'))")
START_SECONDS = 300  # loading a GGUF on a busy 2-core machine; a server not up by then is refused
REQUEST_SECONDS = 3600


@dataclass(frozen=True)
class Eagle3Draft:
    """llama-server's EAGLE-3 speculation: `-md HEAD --spec-type draft-eagle3`, the head on the server's threads."""

    head: Path  # the head's GGUF: prep export-drafter's folder converted by llama.cpp's convert_hf_to_gguf.py
    max_drafts: int | None = None  # --spec-draft-n-max; None: llama.cpp's default
    min_probability: float | None = None  # --spec-draft-p-min; None: llama.cpp's default

    def arguments(self, threads: int) -> list[str]:
        """The server's flags for this speculation, or a one-line error where the head's file is missing."""
        if not self.head.is_file():
            raise LlamaCppUnavailable(f"llamacpp:bin:eagle3={self.head}: no such file; convert the head with llama.cpp's "
                                      "convert_hf_to_gguf.py (docs/draft-head.md, Export)")
        flags = ["-md", str(self.head), "--spec-type", "draft-eagle3", "-td", str(threads), "-tbd", str(threads)]
        if self.max_drafts is not None:
            flags += ["--spec-draft-n-max", str(self.max_drafts)]
        if self.min_probability is not None:
            flags += ["--spec-draft-p-min", str(self.min_probability)]
        return flags


def _draft_stats(timings: list[dict], decode_tokens: int) -> SpecStats | None:
    """What llama.cpp's speculation drafted and kept, from its replies' draft_n and draft_n_accepted (None: it
    drafted nothing, or did not run). llama.cpp reports no phase times and no counts by position: its rounds are
    the target forwards after the first token, decode_tokens - accepted, and every one is counted as drafting
    (with p-min 0, llama.cpp's default, every round drafts), so the mean accepted length is tokens per forward."""
    drafted = sum(t.get("draft_n", 0) for t in timings)
    if not drafted:
        return None
    accepted = sum(t.get("draft_n_accepted", 0) for t in timings)
    rounds = max(decode_tokens - accepted, 1)
    return SpecStats(rounds=rounds, drafts=rounds, drafted=drafted, accepted=accepted)


def find_server() -> Path:
    """The llama-server binary: SPECVOCAB_LLAMACPP_BIN (the file, or a folder holding it), else PATH."""
    given = os.environ.get(BIN_ENV)
    if given:
        path = Path(given).expanduser()
        path = path / SERVER if path.is_dir() else path
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise LlamaCppUnavailable(f"{BIN_ENV}={given} is not an executable {SERVER}; {MISSING}")
        return path
    found = shutil.which(SERVER)
    if found is None:
        raise LlamaCppUnavailable(MISSING)
    return Path(found)


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _last_line(log: Path) -> str:
    """The server log's last non-empty line (why it stopped), for one-line errors."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def _stop(process: subprocess.Popen, log_dir: tempfile.TemporaryDirectory) -> None:
    """End the server we started, then drop its log."""
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    log_dir.cleanup()


class LlamaServerDecoder:
    """Decoding by a llama-server process this object starts and owns (ended with it, or at exit).

    One server per bench: loading the model once keeps the timed runs to decoding; every request sends
    the prompt afresh (cache_prompt false), so no run reuses another's cache. `parallel` slots (-np;
    `context` is split among them) batch concurrent requests: runtime bench-serve's llama-server.
    """

    def __init__(self, gguf_path, eos_token_ids: frozenset[int], context: int = 4096, threads: int | None = None,
                 binary: Path | None = None, parallel: int = 1, eagle3: Eagle3Draft | None = None) -> None:
        if gguf_path is None:
            raise LlamaCppUnavailable("method llamacpp:bin decodes a .gguf file and this model has none (an HF directory)")
        binary = binary or find_server()
        self.threads = threads or decode_threads()
        speculation = eagle3.arguments(self.threads) if eagle3 is not None else []
        self.eos_token_ids = eos_token_ids
        self.url = f"http://127.0.0.1:{_free_port()}"
        log_dir = tempfile.TemporaryDirectory(prefix="specvocab-llama-server-")
        self.log = Path(log_dir.name) / "server.log"
        command = [str(binary), "-m", str(gguf_path), "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
                   "-t", str(self.threads), "-tb", str(self.threads), "-c", str(context), "-np", str(parallel), "--no-webui"]
        command += speculation
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        self._finalizer = weakref.finalize(self, _stop, self.process, log_dir)
        self._wait_until_ready(gguf_path)
        self.build = self._build_line(binary)

    def _wait_until_ready(self, gguf_path) -> None:
        """Poll /health until the model is loaded; a server that exits or hangs is refused in one line."""
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._finalizer.detach()
                raise LlamaCppUnavailable(f"{SERVER} cannot serve {gguf_path} ({_last_line(self.log)}); check the "
                                          f"build (docs/llamacpp-reference.md) or leave llamacpp:bin out of --methods")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while the model loads
            time.sleep(0.2)
        self._finalizer()
        raise LlamaCppUnavailable(f"{SERVER} did not load {gguf_path} in {START_SECONDS} s; leave llamacpp:bin out of --methods")

    def _build_line(self, binary: Path) -> str:
        """'llama-server b1-0c1e570: CPU : SSE3 = 1 | AVX2 = 1 | ...': the server's build and the instruction
        sets of the libllama beside it (the bench records it beside the tok/s)."""
        with urllib.request.urlopen(f"{self.url}/props", timeout=60) as reply:
            version = json.load(reply).get("build_info") or "unknown build"
        library = binary.resolve().parent / "libllama.so"
        features = "instruction sets not known (no libllama.so beside it)"
        if library.is_file():  # in a child: never a second libllama in this process beside llama-cpp-python's
            done = subprocess.run([sys.executable, "-c", _SYSTEM_INFO, str(library)], capture_output=True, text=True,
                                  timeout=60)
            features = features_line(done.stdout) if done.returncode == 0 else f"instruction sets not known ({library} did not load)"
        return f"{SERVER} {version}: {features}"

    def _complete(self, body: dict) -> dict:
        """One /completion request; the server's JSON reply, or its error message in one line."""
        request = urllib.request.Request(f"{self.url}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as reply:
                return json.load(reply)
        except urllib.error.HTTPError as exc:
            message = json.loads(exc.read() or b"{}").get("error", {}).get("message", exc.reason)
            raise LlamaCppUnavailable(f"{SERVER} refused a prompt of {len(body['prompt'])} tokens ({message})") from None
        except (urllib.error.URLError, ConnectionError) as exc:
            raise LlamaCppUnavailable(f"{SERVER} stopped answering ({_last_line(self.log)}; {exc})") from None

    def _guarded(self, body: dict, ids: list[int], guard: int) -> list[dict]:
        """The replies of a run with EOS banned from its first `guard` tokens: those tokens, then the rest on
        top of the server's cache of them (it re-reads the few tokens its sliding-window cache no longer holds,
        in the second reply's prompt time: such a run's decode time is a little long)."""
        ban = [[token, False] for token in sorted(self.eos_token_ids)]
        first = self._complete({**body, "prompt": ids, "n_predict": guard, "logit_bias": ban})
        rest = body["n_predict"] - len(first["tokens"])
        if rest <= 0 or first["stop_type"] == "word":
            return [first]
        return [first, self._complete({**body, "prompt": ids + first["tokens"], "n_predict": rest, "cache_prompt": True})]

    def __call__(self, prompt: torch.Tensor, max_new_tokens: int, params: SamplingParams, generator=None,
                 min_new_tokens: int = 0, stop=None) -> TokenStream:
        """Decode up to max_new_tokens after prompt [P]: a token stream (runtime.loops.decode) with the server's
        own timing. The tokens come when the request is done (the timing is the server's, not the stream's).

        min_new_tokens (the EOS guard): llama.cpp has none, so a run that put EOS among that many first tokens
        is redone with the guard (_guarded); greedy, any other run is already what the guard gives.
        """
        greedy = params.greedy
        body = {"n_predict": max_new_tokens, "temperature": 0.0 if greedy else params.temperature,
                "top_k": 1 if greedy else params.top_k, "top_p": 1.0 if greedy else params.top_p, "min_p": 0.0,
                "repeat_penalty": 1.0,  # llama.cpp seeds are 32-bit; 0xFFFFFFFF asks it for a random one
                "seed": (generator.initial_seed() if generator is not None else 0) % 0xFFFFFFFF,
                "stop": list(stop.stops) if stop is not None else [], "cache_prompt": False, "return_tokens": True}
        replies = [self._complete({**body, "prompt": prompt.tolist()})]
        if any(token in self.eos_token_ids for token in replies[0]["tokens"][:min_new_tokens]):
            replies = self._guarded(body, prompt.tolist(), min(min_new_tokens, max_new_tokens))
        tokens = [int(token) for reply in replies for token in reply["tokens"]]
        yield from tokens
        timings = [reply["timings"] for reply in replies]
        prefill = timings[0]["prompt_ms"] / 1e3  # the first token's; a guarded run's second prompt counts as decoding
        decode = (sum(t["predicted_ms"] for t in timings) + sum(t["prompt_ms"] for t in timings[1:])) / 1e3
        spec = _draft_stats(timings, max(len(tokens) - 1, 0))
        stats = DecodeStats(prompt_tokens=prompt.numel(), new_tokens=len(tokens),
                            forwards=len(tokens) if spec is None else spec.rounds + 1,
                            seconds_prefill=prefill, seconds_total=prefill + decode, spec=spec)
        return tokens, stats
