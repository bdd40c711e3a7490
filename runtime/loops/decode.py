"""Decoding loops: prefill, then one token per step through a target backend and an LM head.

Every loop is a token stream: a generator that yields each new token as it is appended and returns
(tokens, stats) at the end. The caller's thread runs it, one token per `next`; the kernels' regions
run on their own pool whatever thread calls them (runtime/kernels/csrc/pool.h).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Generator

import torch

from runtime.common.sampling import SamplingParams, select_allowed
from runtime.common.stats import DecodeStats
from runtime.text.stopping import StopStrings
from runtime.backends.base import TargetModel


# Yields each new token as it is appended; returns the new tokens and the stats.
TokenStream = Generator[int, None, tuple[list[int], DecodeStats]]


def drive(stream: TokenStream) -> tuple[list[int], DecodeStats]:
    """Run a token stream to its end: its tokens and stats."""
    while True:
        try:
            next(stream)
        except StopIteration as done:
            return done.value


def generate_ar(*args, **kwargs) -> tuple[list[int], DecodeStats]:
    """stream_ar (same arguments) run to its end: the new tokens and the stats."""
    return drive(stream_ar(*args, **kwargs))


def stream_ar(
    target: TargetModel,
    head,
    prompt: torch.Tensor,
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    min_new_tokens: int = 0,
    stop: StopStrings | None = None,
) -> TokenStream:
    """Plain autoregressive decoding: one target forward and one head call per new token.

    prompt: [P] token ids. Returns the new tokens (EOS included if produced) and the stats.
    min_new_tokens: EOS is excluded from the first that many tokens (the min-response guard).
    stop: stop strings; the tokens end with the one that completes a stop string (included).
    """
    if prompt.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token")
    stats = DecodeStats(prompt_tokens=prompt.numel())
    head_before = replace(head.stats)
    started = time.perf_counter()
    cache = target.new_cache()
    hidden = target.forward(prompt, cache)[-1:]  # [1, d]
    stats.forwards += 1
    tokens: list[int] = []
    for step in range(max_new_tokens):
        banned = target.eos_token_ids if step < min_new_tokens else frozenset()
        token = int(select_allowed(head, hidden, params, generator, banned)[0])
        if step == 0:
            stats.seconds_prefill = time.perf_counter() - started
        tokens.append(token)
        yield token
        if token in target.eos_token_ids or step == max_new_tokens - 1:
            break
        if stop is not None and stop.hit(tokens):
            break
        hidden = target.forward(torch.tensor([token]), cache)  # [1, d]
        stats.forwards += 1
    stats.seconds_total = time.perf_counter() - started
    stats.new_tokens = len(tokens)
    stats.head = head.stats.since(head_before)
    return tokens, stats

