"""The Drafter protocol: propose tokens after a context, then learn the verifier's verdict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from runtime.common.sampling import NO_BAN, SamplingParams, TokenBan
from runtime.loops.verify import Verdict


@dataclass(frozen=True)
class Proposal:
    """Drafted tokens and, for drafters that sample, the distributions they were drawn from."""

    tokens: torch.Tensor  # [k'] long, k' <= k (may be 0)
    probs: torch.Tensor | None = None  # [k', V] warped q, or None: verify as a point mass


def empty_proposal() -> Proposal:
    """A proposal of no tokens: the round degenerates to one plain target step."""
    return Proposal(torch.zeros(0, dtype=torch.long))


class Drafter(Protocol):
    """Proposes up to k tokens after a context; the loop calls reset, then propose / observe per round."""

    def reset(
        self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None, ban: TokenBan = NO_BAN
    ) -> None:
        """Start a new sequence; drafters that sample draw from `params`-warped q with `generator`.

        ban: ids to leave out of drafts at guarded positions (the EOS guard). Drafters whose
        proposals carry q must exclude them from q; the loop cuts point-mass drafts itself.
        """
        ...

    def propose(self, context: list[int], k: int) -> Proposal:
        """Up to k tokens to follow `context` (prompt plus every token appended so far)."""
        ...

    def observe(self, verdict: Verdict) -> None:
        """The verifier's verdict on the last proposal (drafters with a cache roll it back here)."""
        ...


@runtime_checkable
class FeatureReader(Protocol):
    """A drafter that reads the target's own hidden states (EAGLE): the loop hands it the target's cache."""

    def follow(self, cache) -> None:
        """Tap `cache` (runtime.backends.base.KVCache.tap) before its first forward and read its features."""
        ...
