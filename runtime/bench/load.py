"""runtime bench-serve's clients: concurrent streaming completions against an OpenAI-style server, timed.

Each client is a thread that sends one streamed, greedy `POST /v1/completions` after another (the
prompts in turn) until the level's request bound or time bound is reached; requests in flight then
finish. The server may be ours or llama.cpp's llama-server: both speak the same API. Only the
standard library: the clients spend their time waiting on sockets, not computing.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

REQUEST_SECONDS = 600  # one request (queued and decoding); past it the request counts as an error


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it."""

    prompt: int  # index into the level's prompts (-1: the probe)
    error: str | None  # None when the stream ended with [DONE] and no error event
    ttft_s: float | None  # request sent -> first text
    seconds: float  # request sent -> stream over
    tokens: int  # completion tokens (the usage chunk's, else text chunks)
    text: str


def stream_completion(url: str, model: str, prompt: str, max_tokens: int, index: int, extra: dict | None = None) -> Outcome:
    """One streamed greedy completion (`extra`: the server's own body fields); never raises (a failure is
    the Outcome's error)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    started = time.perf_counter()
    first, text, chunks, usage, error = None, [], 0, None, None
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as reply:
            for raw in reply:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = str(chunk["error"].get("message", chunk["error"]))
                    continue
                usage = chunk.get("usage") or usage
                piece = "".join(choice.get("text") or "" for choice in chunk.get("choices") or [])
                if piece:
                    first = first if first is not None else time.perf_counter()
                    text.append(piece)
                    chunks += 1
    except urllib.error.HTTPError as exc:
        error = f"HTTP {exc.code}"
    except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - started
    tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else chunks
    return Outcome(index, error, first - started if first is not None else None, seconds, tokens, "".join(text))


def run_level(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, max_requests: int,
              duration_s: float, probe: str | None = None, extra: dict | None = None) -> tuple[list[Outcome], float]:
    """`concurrency` clients until `max_requests` are sent or `duration_s` passed; (outcomes, wall seconds).
    With `probe`, client 0 sends it first (its text is compared with the probe alone)."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    sent = [0]
    deadline = time.perf_counter() + duration_s

    def client(number: int) -> None:
        if number == 0 and probe is not None:
            result = stream_completion(url, model, probe, max_tokens, -1, extra)
            with lock:
                outcomes.append(result)
        while time.perf_counter() < deadline:
            with lock:
                if sent[0] >= max_requests:
                    return
                index = sent[0] % len(prompts)
                sent[0] += 1
            result = stream_completion(url, model, prompts[index], max_tokens, index, extra)
            with lock:
                outcomes.append(result)

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(number,), daemon=True) for number in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes, time.perf_counter() - started


def percentile(values: list[float], share: float) -> float | None:
    """The `share` quantile of values (linear between the nearest ranks); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = share * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(outcomes: list[Outcome], wall_s: float) -> dict:
    """A level's figures: aggregate and per-request tok/s, time to first token p50/p99, errors."""
    good = [o for o in outcomes if o.error is None]
    # Per request: tokens after the first over the time after the first (as runtime bench counts decoding).
    rates = [(o.tokens - 1) / (o.seconds - o.ttft_s) for o in good if o.ttft_s is not None and o.tokens > 1
             and o.seconds > o.ttft_s]
    ttfts = [o.ttft_s for o in good if o.ttft_s is not None]
    return {
        "requests": len(outcomes),
        "errors": len(outcomes) - len(good),
        "error_examples": sorted({o.error for o in outcomes if o.error})[:3],
        "completion_tokens": sum(o.tokens for o in good),
        "wall_s": wall_s,
        "aggregate_tokens_per_s": sum(o.tokens for o in good) / wall_s if wall_s > 0 else None,
        "per_request_tokens_per_s": statistics.median(rates) if rates else None,
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
    }
