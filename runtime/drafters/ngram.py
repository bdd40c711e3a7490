"""Prompt-lookup drafter: continue the context the way its latest matching n-gram continued before."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from runtime.common.sampling import NO_BAN, SamplingParams, TokenBan
from runtime.drafters.base import Proposal, Verdict, empty_proposal
from runtime.drafters.arguments import MaxNgramOptions


class NgramDrafter:
    """Find the context's last n tokens earlier in the context (n = max_ngram down to min_ngram) and
    propose what followed the most recent such occurrence. No model, no distribution: drafts verify
    as point masses. The anchor is transformers' prompt lookup decoding."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_draft: int = 16) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        if max_draft < 1:
            raise ValueError("max_draft must be >= 1")
        self.max_ngram, self.min_ngram, self.max_draft = max_ngram, min_ngram, max_draft

    def reset(
        self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None, ban: TokenBan = NO_BAN
    ) -> None:
        """Nothing to prepare: the whole context is searched at every proposal (the loop applies `ban`)."""

    def propose(self, context: list[int], k: int) -> Proposal:
        """Tokens that followed the most recent earlier occurrence of the longest matching suffix."""
        k = min(k, self.max_draft)
        if k <= 0:
            return empty_proposal()
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            start = find_latest(context, n)
            if start is not None:
                follow = context[start + n : start + n + k]
                return Proposal(torch.tensor(follow, dtype=torch.long))
        return empty_proposal()

    def observe(self, verdict: Verdict) -> None:
        """Nothing to learn: the appended tokens reach the next proposal through the context."""


@dataclass(frozen=True)
class NgramOptions(MaxNgramOptions):
    """ngram[:MAX_NGRAM]."""

    NAME, EXAMPLE, DRAFTER = "ngram", 3, NgramDrafter


def find_latest(context: list[int], n: int) -> int | None:
    """Start of the most recent earlier occurrence of the last n tokens, or None."""
    return next(find_earlier(context, n), None)


def find_earlier(context: list[int], n: int) -> Iterator[int]:
    """Starts of the earlier occurrences of the last n tokens that leave a following token, newest first."""
    suffix = context[-n:]
    first = suffix[0]
    for start in range(len(context) - n - 1, -1, -1):
        if context[start] == first and context[start : start + n] == suffix:
            yield start
