"""Session lookup drafter: prompt lookup over the context, then over the sequences decoded before it.

llama.cpp's lookup decoding keeps a dynamic n-gram cache of what the model already generated; this is
that idea on top of runtime.drafters.ngram. The context's last n tokens (n = max_ngram down to 1) are
looked up in the context first (the most recent earlier occurrence), then, for n >= MIN_HISTORY_NGRAM,
in the earlier sequences of this drafter's session (prompt plus output, the most recent occurrence).
A match of n tokens drafts at most n tokens: a longer match is trusted further, and a one-token match
(often a space or a bracket) drafts one. For token trees (`swarm:lookup:K`), `continuations` gives
the K best distinct continuations instead, each as deep as the tree.

The session is the drafter object: a Method built once per Engine keeps it across generate calls and
bench prompts; a new process starts empty. Drafts are verified like any other, so outputs stay exact.
"""

from __future__ import annotations

from typing import Iterator

import torch

from runtime.drafters.base import Proposal, empty_proposal
from runtime.drafters.ngram import find_earlier
from runtime.sampling import NO_BAN, SamplingParams, TokenBan
from runtime.verify import Verdict

MIN_HISTORY_NGRAM = 2  # a single token matches everywhere in other sequences: not worth a draft
MAX_HISTORY_TOKENS = 1 << 16  # the session keeps (and indexes) at most this many tokens, the newest
MAX_HITS = 8  # the index keeps this many occurrences of each n-gram in the session, the newest


class LookupDrafter:
    """Prompt lookup plus the session's earlier sequences; a match of n tokens drafts at most n."""

    def __init__(self, max_ngram: int = 4, max_history_tokens: int = MAX_HISTORY_TOKENS) -> None:
        if max_ngram < 1:
            raise ValueError(f"need max_ngram >= 1, got {max_ngram}")
        self.max_ngram, self.max_history_tokens = max_ngram, max_history_tokens
        self.history: list[list[int]] = []  # earlier sequences, oldest first
        # n-gram (MIN_HISTORY_NGRAM <= n <= max_ngram) -> its occurrences (sequence index, position after
        # it), oldest first, at most MAX_HITS
        self._index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self._sequence: list[int] = []  # the current sequence as far as the verifier has seen it

    def reset(
        self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None, ban: TokenBan = NO_BAN
    ) -> None:
        """Add the sequence decoded before (if any) to the session, then start on `prompt`."""
        if self._sequence:
            self.remember(self._sequence)
        self._sequence = list(prompt)

    def remember(self, sequence: list[int]) -> None:
        """Index one finished sequence; past MAX_HISTORY_TOKENS the oldest sequences are dropped."""
        self.history.append(list(sequence))
        if sum(len(s) for s in self.history) > self.max_history_tokens:
            while len(self.history) > 1 and sum(len(s) for s in self.history) > self.max_history_tokens // 2:
                self.history.pop(0)
            self._index = {}
            for index in range(len(self.history)):
                self._add_to_index(index)
        else:
            self._add_to_index(len(self.history) - 1)

    def _add_to_index(self, index: int) -> None:
        sequence = self.history[index]
        for end in range(1, len(sequence)):
            for n in range(MIN_HISTORY_NGRAM, min(self.max_ngram, end) + 1):
                hits = self._index.setdefault(tuple(sequence[end - n : end]), [])
                hits.append((index, end))
                if len(hits) > MAX_HITS:
                    del hits[0]

    def _matches(self, context: list[int]) -> Iterator[tuple[int, list[int], int]]:
        """Every earlier occurrence of a suffix of the context, best first, as (n, tokens, end): the
        suffix's length n (max_ngram down to 1) and the sequence holding it, with the position after
        it (a following token always exists). For each n, the context's occurrences newest first,
        then (n >= MIN_HISTORY_NGRAM) the session's."""
        for n in range(min(self.max_ngram, len(context) - 1), 0, -1):
            for start in find_earlier(context, n):
                yield n, context, start + n
            if n >= MIN_HISTORY_NGRAM:
                for sequence, end in reversed(self._index.get(tuple(context[-n:]), ())):
                    yield n, self.history[sequence], end

    def propose(self, context: list[int], k: int) -> Proposal:
        """At most min(k, n) tokens after the longest matching suffix of n tokens: the context's own
        most recent earlier occurrence first, then the session's."""
        self._sequence = list(context)
        match = next(self._matches(context), None) if k > 0 else None
        if match is None:
            return empty_proposal()
        n, tokens, end = match
        return Proposal(torch.tensor(tokens[end : end + min(k, n)], dtype=torch.long))

    def continuations(self, context: list[int], depth: int, count: int) -> list[list[int]]:
        """Up to `count` continuations of at most `depth` tokens, best first (the order of the
        matches), none a prefix of an earlier one. Every match drafts `depth` tokens."""
        self._sequence = list(context)
        found: list[list[int]] = []
        covered: set[tuple[int, ...]] = set()  # every prefix of a continuation found so far
        for _, tokens, end in self._matches(context):
            if len(found) >= count:
                break
            follow = tokens[end : end + depth]
            if follow and tuple(follow) not in covered:
                found.append(follow)
                covered.update(tuple(follow[: i + 1]) for i in range(len(follow)))
        return found

    def observe(self, verdict: Verdict) -> None:
        """The verified tokens join the current sequence (what the session will remember)."""
        self._sequence.extend(int(t) for t in verdict.tokens)
