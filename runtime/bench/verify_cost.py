"""Verify cost T_V(n): one target forward over n new tokens after a warm cache, plus the head work a
greedy verifier needs (head.select on the n rows), relative to n = 1.

Speculative decoding pays T_V(gamma + 1) per round for up to gamma + 1 tokens, so the growth of
T_V(n) / T_V(1) with n decides whether drafting can pay at all and which gamma to pick
(`best_gamma`, the GP paper's closed form with a free drafter). `tree_verify_cost` does the same for
SWARM's token trees of 4..32 nodes (one tree forward plus the greedy tree verifier).
"""

from __future__ import annotations

import statistics
import time

import torch

from runtime.common.sampling import SamplingParams
from runtime.common.stats import expected_tokens
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
    "head_fallbacks" is the rows per forward the head sent to the full head (a certified head's
    near-ties): the same tokens are fed every repeat, so a near-tie position costs a full-head pass
    in every timing of that n, and this column says so.
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
    fallbacks = {n: 0 for n in sizes}
    for repeat in range(repeats + 1):  # the first pass warms up and is not recorded
        for n in sizes:
            t0 = time.perf_counter()
            hidden = target.forward(tokens[context : context + n], cache)  # [n, d]
            t1 = time.perf_counter()
            before = head.stats.fallbacks
            head.select(hidden, params)
            t2 = time.perf_counter()
            target.crop(cache, context)
            if repeat:
                fallbacks[n] += head.stats.fallbacks - before
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
            "head_fallbacks": fallbacks[n] / repeats,
        }
        for n in sizes
    ]


def best_gamma(rows: list[dict], alpha: float) -> tuple[int, float]:
    """(gamma, predicted speedup over one-token steps) maximizing expected_tokens / (T_V(gamma+1) / T_V(1)),
    for a drafter that costs nothing (n-gram, tables); gamma = 0 means drafting does not pay."""
    ratio = {row["n"]: row["ratio"] for row in rows}
    options = [(0, 1.0)] + [(g, expected_tokens(alpha, g) / ratio[g + 1]) for g in range(1, max(ratio))]
    return max(options, key=lambda option: option[1])


TREE_SIZES = (4, 8, 16, 32)
TREE_CONFIDENCES = (0.6, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005, 0.002)  # rank -> confidence: deep trees with side branches


def tree_verify_cost(
    target: TargetModel,
    head,
    tokens: torch.Tensor,
    context: int = CONTEXT,
    sizes: tuple[int, ...] = TREE_SIZES,
    k: int = 4,
    repeats: int = 10,
) -> list[dict]:
    """T_V of SWARM rounds: median seconds of one tree forward over the last token plus N nodes and the
    greedy tree verifier (head on N + 1 rows, in chunks of 16), and its ratio to a one-token step.

    tokens: [>= context + 1 + 8] real ids; the cache holds tokens[:context], the root is tokens[context].
    The trees are best-first (runtime.drafters.trees.build_tree) over K candidates per node, the text's next token
    first, with fixed confidences by rank, so each N gives one tree shape; rows carry its depth.
    """
    from runtime.loops.tree_speculative import MAX_DEPTH, score_tree, verify_scored_tree
    from runtime.common.sampling import NO_BAN
    from runtime.drafters.trees import build_tree

    if tokens.numel() < context + 1 + MAX_DEPTH:
        raise ValueError(f"need at least {context + 1 + MAX_DEPTH} tokens, got {tokens.numel()}: give more prompt text")
    ids = tokens.tolist()
    vocab = target.vocab_size

    def expand(path: list[int]) -> tuple[list[int], list[float]]:
        first = ids[context + 1 + len(path)]
        return [first] + [(first + 1 + i) % vocab for i in range(k - 1)], list(TREE_CONFIDENCES[:k])

    trees = {n: build_tree(expand, k, MAX_DEPTH, n) for n in sizes}
    cache = target.new_cache()
    target.forward(tokens[:context], cache)
    root = ids[context]
    params = SamplingParams()
    step_s: list[float] = []
    forward_s: dict[int, list[float]] = {n: [] for n in sizes}
    total_s: dict[int, list[float]] = {n: [] for n in sizes}
    for repeat in range(repeats + 1):  # the first pass warms up and is not recorded
        t0 = time.perf_counter()
        head.select(target.forward(tokens[context : context + 1], cache), params)
        step = time.perf_counter() - t0
        target.crop(cache, context)
        for n, tree in trees.items():
            t0 = time.perf_counter()
            hidden = score_tree(target, cache, root, tree)  # [n + 1, d]
            t1 = time.perf_counter()
            verify_scored_tree(head, hidden, tree, params, None, NO_BAN, context + 1)
            t2 = time.perf_counter()
            target.crop(cache, context)
            if repeat:
                forward_s[n].append(t1 - t0)
                total_s[n].append(t2 - t0)
        if repeat:
            step_s.append(step)
    base = statistics.median(step_s)
    return [
        {
            "nodes": n,
            "depth": int(trees[n].depths().max()),
            "forward_ms": 1e3 * statistics.median(forward_s[n]),
            "total_ms": 1e3 * statistics.median(total_s[n]),
            "ratio": statistics.median(total_s[n]) / base,
        }
        for n in sizes
    ]
