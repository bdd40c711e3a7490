"""The servers runtime bench-serve loads: ours (`runtime serve` in a child process) and llama.cpp's
llama-server (runtime.llamacpp.server's, with parallel slots), each on 127.0.0.1, stopped after use."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from runtime.bench.provenance import PACKAGE_ROOT
from runtime.llamacpp.server import START_SECONDS, LlamaServerDecoder, _free_port, _last_line, _stop

# llama-server splits -c among its slots: this many tokens per slot (prompt + completion) is plenty for the bench.
SLOT_CONTEXT = 2048
# Body fields llama-server needs to decode as ours does: no reuse of a slot's cached prompt between requests.
LLAMA_EXTRA = {"cache_prompt": False}


class ServerUnavailable(ValueError):
    """A server bench-serve was to load did not start; the message names the fix."""


@contextmanager
def our_server(artifact: str, threads: int, method: str | None, max_batch: int) -> Iterator[str]:
    """`runtime serve ARTIFACT` in a child process (this checkout's code) on a free port; yields its URL."""
    port = _free_port()
    command = [sys.executable, "-m", "runtime", "serve", artifact, "--port", str(port), "--threads", str(threads),
               "--max-batch", str(max_batch)] + (["--method", method] if method else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))}
    log_dir = tempfile.TemporaryDirectory(prefix="specvocab-serve-")
    log = Path(log_dir.name) / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)
    finalizer = weakref.finalize(process, _stop, process, log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_health(url, process, log)
        yield url
    finally:
        finalizer()


def _wait_for_health(url: str, process: subprocess.Popen, log: Path) -> None:
    """Poll /health until it answers 200; one line naming the server's last words when it exits or hangs."""
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerUnavailable(f"runtime serve exited before serving ({_last_line(log)}); run it alone to see why")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet
        time.sleep(0.2)
    raise ServerUnavailable(f"runtime serve did not answer /health in {START_SECONDS} s ({_last_line(log)})")


@contextmanager
def llama_server(gguf_path: Path, threads: int, parallel: int) -> Iterator[tuple[str, str]]:
    """llama-server on the GGUF with `parallel` slots (continuous batching); yields (URL, its build line)."""
    server = LlamaServerDecoder(gguf_path, frozenset(), SLOT_CONTEXT * parallel, threads, parallel=parallel)
    try:
        yield server.url, server.build
    finally:
        server._finalizer()
