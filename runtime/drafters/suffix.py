"""Suffix drafter (SuffixDecoding's idea): follow the longest suffix of the context found in the context
or in the session's earlier sequences, as its occurrences go on most often.

The lookup drafter (runtime.drafters.lookup) matches at most its max_ngram last tokens (4) and lets
every occurrence of that n-gram vote. This drafter finds the same occurrences, then compares each
backwards as far as it agrees with the context (up to max_match tokens): only the occurrences that
share the most context continue. So in code, where a short n-gram recurs with many continuations, the
draft follows the place that repeats the longest passage, and a match of L tokens may draft up to L
(lookup: at most its n). The draft takes, at each step, the token most of the remaining occurrences
go on with, and stops once the product of those shares falls below min_prob (SuffixDecoding's
frequency score). Drafts are point masses verified like any other, so outputs stay exact.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import takewhile

import torch

from runtime.drafters.base import Proposal, empty_proposal
from runtime.drafters.lookup import MAX_HISTORY_TOKENS, LookupDrafter
from runtime.drafters.arguments import number_text, positive, unit_number
from runtime.drafters.registry import DraftContext

INDEX_NGRAM = 4  # occurrences are found by the context's last 4 tokens (lookup's index), then compared backwards
# Starting points, not measured optima: `runtime bench` decides.
MAX_MATCH = 64  # compare at most this many tokens back
MIN_PROB = 0.1  # draft while the product of the chosen tokens' shares stays at or above this
SUFFIX_HELP = "suffix[:match=N][:prob=P] (the longest matching suffix of the context or the session, its most frequent continuation)"
SUFFIX_EXAMPLE = "e.g. suffix, suffix:match=32 or suffix:prob=0.2"


class SuffixDrafter(LookupDrafter):
    """The longest suffix of the context found earlier (context or session), followed by frequency; the
    session (reset, observe, history) is the lookup drafter's."""

    def __init__(self, max_match: int = MAX_MATCH, min_prob: float = MIN_PROB,
                 max_history_tokens: int = MAX_HISTORY_TOKENS) -> None:
        if max_match < 1 or not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"need max_match >= 1 and min_prob in [0, 1], got {max_match} and {min_prob}")
        super().__init__(INDEX_NGRAM, max_history_tokens)
        self.max_match, self.min_prob = max_match, min_prob

    def propose(self, context: list[int], k: int) -> Proposal:
        """At most min(k, L) tokens after the occurrences sharing the longest suffix, L tokens, with the context."""
        self._sequence = list(context)
        matches = self._matches(context)
        first = next(matches, None) if k > 0 else None
        if first is None:
            return empty_proposal()
        found = [(tokens, end) for _, tokens, end in [first, *takewhile(lambda match: match[0] == first[0], matches)]]
        lengths = [match_length(context, tokens, end, self.max_match) for tokens, end in found]
        longest = max(lengths)
        group = [occurrence for occurrence, length in zip(found, lengths) if length == longest]
        return Proposal(torch.tensor(follow(group, min(k, longest), self.min_prob), dtype=torch.long))


def match_length(context: list[int], tokens: list[int], end: int, limit: int) -> int:
    """How many tokens before `end` in `tokens` equal the context's last ones, at most `limit`."""
    length = 0
    while length < min(limit, end, len(context)) and tokens[end - 1 - length] == context[-1 - length]:
        length += 1
    return length


def follow(group: list[tuple[list[int], int]], limit: int, min_prob: float) -> list[int]:
    """Up to `limit` tokens after the occurrences (tokens, end) in `group`: at each step the token most of
    those still following the draft go on with (the first listed wins a tie), while the product of the
    chosen tokens' shares stays at or above `min_prob`."""
    draft: list[int] = []
    score = 1.0
    while len(draft) < limit:
        at = len(draft)
        tally = Counter(tokens[end + at] for tokens, end in group if end + at < len(tokens))
        if not tally:
            break
        token, count = tally.most_common(1)[0]
        score *= count / sum(tally.values())
        if score < min_prob:
            break
        draft.append(token)
        group = [(tokens, end) for tokens, end in group if end + at < len(tokens) and tokens[end + at] == token]
    return draft


@dataclass(frozen=True)
class SuffixOptions:
    """suffix[:match=N][:prob=P]: compare at most N tokens back; draft while the score stays >= P."""

    max_match: int = MAX_MATCH
    min_prob: float = MIN_PROB

    @classmethod
    def parse(cls, args: list[str]) -> SuffixOptions:
        given: dict[str, str] = {}
        for arg in args:
            key, eq, value = arg.partition("=")
            if not eq or key not in ("match", "prob") or key in given:
                raise ValueError(f"suffix takes match=N and prob=P, each at most once, not {arg!r}; {SUFFIX_EXAMPLE}")
            given[key] = value
        max_match = positive(given.get("match", str(MAX_MATCH)), "suffix's match", "suffix:match=32")
        min_prob = unit_number(given["prob"]) if "prob" in given else MIN_PROB
        if min_prob is None:
            raise ValueError(f"suffix's prob is a score in [0, 1], not {given['prob']!r}; e.g. suffix:prob=0.2")
        return cls(max_match, min_prob)

    def format(self) -> tuple[str, ...]:
        return (f"match={self.max_match}", f"prob={number_text(self.min_prob)}")

    def build(self, context: DraftContext) -> SuffixDrafter:
        return SuffixDrafter(self.max_match, self.min_prob)
