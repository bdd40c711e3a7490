"""The rounds skeleton chains, token trees and MJSD share: prefill and a first token, then
draft-and-verify rounds until EOS, a stop string or the token limit."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import torch

from runtime.backends.base import TargetModel
from runtime.common.sampling import SamplingParams, TokenBan, select_allowed
from runtime.common.stats import DecodeStats, SpecStats
from runtime.drafters.base import FeatureReader, Verdict
from runtime.loops.decode import TokenStream
from runtime.text.stopping import StopStrings

# (context, tokens still to produce) -> the round's verdict. Before a round the target's cache holds
# context[:-1]; after it, context[:-1] plus the last token and the accepted drafts. A round adds its
# drafting and verifying seconds to the SpecStats it was begun with.
Round = Callable[[list[int], int], Verdict]


def stream_rounds(
    target: TargetModel,
    head,
    prompt: torch.Tensor,
    max_new_tokens: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    begin: Callable[[object, TokenBan, SpecStats], Round],
    min_new_tokens: int = 0,
    stop: StopStrings | None = None,
    drafter=None,
) -> TokenStream:
    """The loop chains and trees share: prefill and first token as in stream_ar, then draft-and-verify
    rounds, each verdict's tokens appended (and yielded) until EOS, a stop string or max_new_tokens.

    begin(cache, ban, spec): called once after the first token (drafter resets go here); gives the
    round function. ban: the EOS min-response guard over absolute context positions. drafter: the
    round's drafter; one that reads the target's features (FeatureReader) follows the new cache
    before the prefill, whose features the first round reads.
    """
    if prompt.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token")
    stats = DecodeStats(prompt_tokens=prompt.numel(), spec=SpecStats())
    head_before = replace(head.stats)
    started = time.perf_counter()
    cache = target.new_cache()
    if isinstance(drafter, FeatureReader):
        drafter.follow(cache)
    hidden = target.forward(prompt, cache)[-1:]  # [1, d]
    stats.forwards += 1
    context = prompt.tolist()
    tokens: list[int] = []
    ban = TokenBan.min_response(target.eos_token_ids, len(context), min_new_tokens)

    def kept(new: list[int]) -> tuple[list[int], bool]:
        """The prefix of `new` to append (up to EOS, a stop string or the token limit), and whether
        generation is then over; appended to tokens and context here."""
        for i, token in enumerate(new):
            tokens.append(token)
            context.append(token)
            if token in target.eos_token_ids or len(tokens) == max_new_tokens or (stop is not None and stop.hit(tokens)):
                return new[: i + 1], True
        return new, False

    new, finished = [], True
    if max_new_tokens > 0:
        new, finished = kept([int(select_allowed(head, hidden, params, generator, ban.ids, ban.rows(len(context), 1))[0])])
    stats.seconds_prefill = time.perf_counter() - started
    yield from new
    one_round = begin(cache, ban, stats.spec)
    while not finished:
        verdict = one_round(context, max_new_tokens - len(tokens))
        stats.forwards += 1
        stats.spec.record(verdict)
        new, finished = kept(verdict.tokens)
        yield from new
    stats.seconds_total = time.perf_counter() - started
    stats.new_tokens = len(tokens)
    stats.head = head.stats.since(head_before)
    return tokens, stats
