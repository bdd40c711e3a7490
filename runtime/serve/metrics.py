"""Server counters, written by the scheduler and the routes, read as Prometheus text at /metrics."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

RATE_WINDOW_S = 10.0  # tokens/s is measured over this many recent seconds


class Metrics:
    """Requests by status, tokens, drafting, queue and batch; thread-safe (the scheduler writes from its thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.responses: Counter[int] = Counter()  # status code -> responses
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.drafted = 0
        self.accepted = 0
        self.queue_length = 0  # requests waiting for a slot
        self.batch_size = 0  # requests decoding now
        self.peak_batch_size = 0
        self.forwards = 0  # fused target forwards (one per step that had rows to feed)
        self.forward_rows = 0  # rows those forwards fed, every request's together
        self.peak_fused = 0  # the most requests whose rows shared one forward
        self.forward_seconds = 0.0  # time in those forwards (the rest of a step: the requests' own turns)
        self.head_call_count = 0  # LM-head calls the scheduler ran (runtime.heads.rowwise), each for one or more requests
        self.peak_head_fused = 0  # the most requests whose head rows shared one call
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent scheduler steps

    def responded(self, status: int) -> None:
        with self._lock:
            self.responses[status] += 1

    def step(self, tokens: int, queue_length: int, batch_size: int, rows: int = 0, fused: int = 0,
             forward_s: float = 0.0) -> None:
        """One scheduler step: tokens it produced, the queue and batch after it, and the rows its forward
        fed for how many requests, in how many seconds."""
        now = time.monotonic()
        with self._lock:
            self.forwards += rows > 0
            self.forward_rows += rows
            self.peak_fused = max(self.peak_fused, fused)
            self.forward_seconds += forward_s
            self.completion_tokens += tokens
            self.queue_length, self.batch_size = queue_length, batch_size
            self.peak_batch_size = max(self.peak_batch_size, batch_size)
            if tokens:
                self._recent.append((now, tokens))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()

    def head_calls(self, sizes: list[int]) -> None:
        """Head calls the scheduler ran: how many requests' rows each took."""
        with self._lock:
            self.head_call_count += len(sizes)
            self.peak_head_fused = max([self.peak_head_fused, *sizes])

    def finished(self, prompt_tokens: int, drafted: int, accepted: int) -> None:
        """One request decoded to its end."""
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.drafted += drafted
            self.accepted += accepted

    def tokens_per_s(self) -> float:
        """Tokens produced per second over the last RATE_WINDOW_S seconds."""
        now = time.monotonic()
        with self._lock:
            return sum(n for t, n in self._recent if t >= now - RATE_WINDOW_S) / RATE_WINDOW_S

    def prometheus(self) -> str:
        """The counters in Prometheus' text exposition format."""
        rate = self.tokens_per_s()
        with self._lock:
            rows = [
                ("requests_total", "counter", "HTTP responses by status code.",
                 [(f'{{code="{code}"}}', count) for code, count in sorted(self.responses.items())] or [("", 0)]),
                ("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [("", self.prompt_tokens)]),
                ("generation_tokens_total", "counter", "Tokens generated.", [("", self.completion_tokens)]),
                ("generation_tokens_per_second", "gauge", f"Tokens generated per second over the last {RATE_WINDOW_S:g} s.",
                 [("", round(rate, 3))]),
                ("queue_length", "gauge", "Requests waiting for a decoding slot.", [("", self.queue_length)]),
                ("batch_size", "gauge", "Requests decoding now.", [("", self.batch_size)]),
                ("batch_size_peak", "gauge", "The most requests decoding at once so far.", [("", self.peak_batch_size)]),
                ("forwards_total", "counter", "Fused target forwards (one per scheduler step with rows to feed).",
                 [("", self.forwards)]),
                ("forward_rows_total", "counter", "Rows those forwards fed, all requests' together.", [("", self.forward_rows)]),
                ("forward_seconds_total", "counter", "Seconds in those forwards (the rest: the requests' heads, "
                 "drafters and sampling).", [("", round(self.forward_seconds, 6))]),
                ("head_calls_total", "counter", "LM-head calls (logits or a certified head's screen), each over "
                 "one or more requests' rows.", [("", self.head_call_count)]),
                ("head_requests_peak", "gauge", "The most requests whose rows shared one head call so far.",
                 [("", self.peak_head_fused)]),
                ("forward_requests_peak", "gauge", "The most requests whose rows shared one forward so far.",
                 [("", self.peak_fused)]),
                ("drafted_tokens_total", "counter", "Draft tokens verified (speculative methods).", [("", self.drafted)]),
                ("accepted_tokens_total", "counter", "Draft tokens accepted.", [("", self.accepted)]),
                ("acceptance_rate", "gauge", "Accepted / drafted tokens so far (0 before any draft).",
                 [("", round(self.accepted / self.drafted, 6) if self.drafted else 0)]),
            ]
        lines = []
        for name, kind, help_text, samples in rows:
            lines += [f"# HELP specvocab_{name} {help_text}", f"# TYPE specvocab_{name} {kind}"]
            lines += [f"specvocab_{name}{labels} {value}" for labels, value in samples]
        return "\n".join(lines) + "\n"
