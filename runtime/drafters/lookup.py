"""Session lookup drafter: prompt lookup over the context, then over the sequences decoded before it.

llama.cpp's lookup decoding keeps a dynamic n-gram cache of what the model already generated; this is
that idea on top of runtime.drafters.ngram. The context's last n tokens (n = max_ngram down to 1) are
looked up in the context and, for n >= MIN_HISTORY_NGRAM, in the earlier sequences of this drafter's
session (prompt plus output). The longest n that matches anywhere drafts, and every occurrence of it
votes on what follows: one in the context counts CONTEXT_VOTES, one in the session 1 (the newest
wins a tie). The draft takes the leading token at each step and goes on while more than CONSENSUS of
the votes still following it agree. A match of n tokens drafts at most n tokens: a longer match is
trusted further, and a one-token match (often a space or a bracket) drafts one. For token trees
(`swarm:lookup:K`), `continuations` gives the K best distinct continuations instead, each as deep as
the tree.

The session is the drafter object: a Method built once per Engine keeps it across generate calls and
bench prompts; a new process starts empty. Drafts are verified like any other, so outputs stay exact.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from itertools import takewhile
from typing import Iterator

import torch

from runtime.common.sampling import NO_BAN, SamplingParams, TokenBan
from runtime.drafters.base import Proposal, Verdict, empty_proposal
from runtime.drafters.ngram import find_earlier
from runtime.drafters.trees import TokenTree, merge_sequences
from runtime.drafters.arguments import MaxNgramOptions

MIN_HISTORY_NGRAM = 2  # a single token matches everywhere in other sequences: not worth a draft
MAX_HISTORY_TOKENS = 1 << 16  # the session keeps (and indexes) at most this many tokens, the newest
MAX_HITS = 8  # the index keeps this many occurrences of each n-gram in the session, the newest
CONTEXT_VOTES = 2  # an occurrence in the context outweighs one in the session's other sequences
# A draft goes past its first token while more than this share of the votes agree. Chosen on an
# offline replay of recorded greedy outputs (development prompts; docs/speculative.md, "The lookup drafter's votes"):
# more than 2/3 with CONTEXT_VOTES = 2 sat on a plateau for all three packaged models.
CONSENSUS = Fraction(2, 3)


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
        """At most min(k, n) tokens after the longest matching suffix of n tokens, as its occurrences
        vote (module docstring)."""
        self._sequence = list(context)
        matches = self._matches(context)
        first = next(matches, None) if k > 0 else None
        if first is None:
            return empty_proposal()
        n = first[0]
        longest = [first, *takewhile(lambda match: match[0] == n, matches)]
        votes = [(tokens, end, CONTEXT_VOTES if tokens is context else 1) for _, tokens, end in longest]
        return Proposal(torch.tensor(consensus(votes, min(k, n)), dtype=torch.long))

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


@dataclass(frozen=True)
class LookupOptions(MaxNgramOptions):
    """lookup[:MAX_NGRAM]."""

    NAME, EXAMPLE, DRAFTER = "lookup", 4, LookupDrafter


def consensus(votes: list[tuple[list[int], int, int]], limit: int) -> list[int]:
    """Up to `limit` tokens agreed by weighted occurrences (tokens, end, weight), each voting for what
    follows tokens[end:]: the leading token at every step (the first listed wins a tie), for as long
    as it holds more than CONSENSUS of the weight still following the draft (the first token always)."""
    draft: list[int] = []
    while len(draft) < limit:
        tally: Counter[int] = Counter()
        for tokens, end, weight in votes:
            at = end + len(draft)
            if at < len(tokens) and tokens[end:at] == draft:
                tally[tokens[at]] += weight
        if not tally:
            break
        token, weight = tally.most_common(1)[0]
        if draft and weight <= CONSENSUS * sum(tally.values()):
            break
        draft.append(token)
    return draft


class LookupTrees:
    """SWARM over the session lookup drafter: its K best distinct continuations, each as deep as the
    tree, prefix-merged under the node budget (the best continuation is the first path)."""

    def __init__(self, drafter: LookupDrafter, k: int) -> None:
        self.drafter, self.k = drafter, k

    def reset(self, prompt, params, generator, ban=NO_BAN) -> None:
        self.drafter.reset(prompt, params, generator, ban)

    def tree(self, context: list[int], depth: int, budget: int) -> TokenTree:
        return merge_sequences(self.drafter.continuations(context, depth, self.k), budget=budget)[0]

    def observe(self, verdict: Verdict) -> None:
        self.drafter.observe(verdict)
