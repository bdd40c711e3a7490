"""Verify cost T_V(n): one target forward over n new tokens after a warm cache, plus the head work a
greedy verifier needs (head.select on the n rows), relative to n = 1.

Speculative decoding pays T_V(gamma + 1) per round for up to gamma + 1 tokens, so the growth of
T_V(n) / T_V(1) with n decides whether drafting can pay at all and which gamma to pick
(`best_gamma`, the GP paper's closed form with a free drafter).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from runtime.sampling import SamplingParams
from runtime.stats import expected_tokens
from runtime.backends.base import TargetModel

CONTEXT = 180  # tokens in the cache before the verify forward (the reference setting)
MAX_N = 8


def verify_cost(
    target: TargetModel,
    head,
    tokens: torch.Tensor,
    context: int = CONTEXT,
    max_n: int = MAX_N,
    repeats: int = 10,
    params: SamplingParams = SamplingParams(),
) -> list[dict]:
    """Median seconds of forward and head for n = 1..max_n new tokens, and T_V(n) / T_V(1).

    tokens: [>= context + max_n] real token ids. The cache holds tokens[:context]; each measurement
    feeds tokens[context : context + n], selects n tokens, and crops the cache back to `context`.
    The n run interleaved within each repeat, so slow drifts of the machine hit every n alike.
    """
    if tokens.numel() < context + max_n:
        raise ValueError(f"need at least {context + max_n} tokens, got {tokens.numel()}: give more prompt text")
    if max_n < 1 or repeats < 1:
        raise ValueError("max_n and repeats must be >= 1")
    cache = target.new_cache()
    target.forward(tokens[:context], cache)
    sizes = list(range(1, max_n + 1))
    forward_s: dict[int, list[float]] = {n: [] for n in sizes}
    head_s: dict[int, list[float]] = {n: [] for n in sizes}
    total_s: dict[int, list[float]] = {n: [] for n in sizes}
    for repeat in range(repeats + 1):  # the first pass warms up and is not recorded
        for n in sizes:
            t0 = time.perf_counter()
            hidden = target.forward(tokens[context : context + n], cache)  # [n, d]
            t1 = time.perf_counter()
            head.select(hidden, params)
            t2 = time.perf_counter()
            target.crop(cache, context)
            if repeat:
                forward_s[n].append(t1 - t0)
                head_s[n].append(t2 - t1)
                total_s[n].append(t2 - t0)
    base = statistics.median(total_s[1])
    return [
        {
            "n": n,
            "forward_ms": 1e3 * statistics.median(forward_s[n]),
            "head_ms": 1e3 * statistics.median(head_s[n]),
            "total_ms": 1e3 * statistics.median(total_s[n]),
            "ratio": statistics.median(total_s[n]) / base,
        }
        for n in sizes
    ]


def best_gamma(rows: list[dict], alpha: float) -> tuple[int, float]:
    """(gamma, predicted speedup over one-token steps) maximizing expected_tokens / (T_V(gamma+1) / T_V(1)),
    for a drafter that costs nothing (n-gram, tables); gamma = 0 means drafting does not pay."""
    ratio = {row["n"]: row["ratio"] for row in rows}
    options = [(0, 1.0)] + [(g, expected_tokens(alpha, g) / ratio[g + 1]) for g in range(1, max(ratio))]
    return max(options, key=lambda option: option[1])
