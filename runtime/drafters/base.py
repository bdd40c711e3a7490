"""The drafter protocols (chains, token trees, beams) and what passes between a drafter and a loop:
the proposal, and the verifier's verdict on it (runtime.common.stats.Verdict, which the stats count
too). Loops import these, never a concrete drafter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from runtime.common.sampling import NO_BAN, SamplingParams, TokenBan
from runtime.common.stats import Verdict
from runtime.drafters.trees import TokenTree


@dataclass(frozen=True)
class Proposal:
    """Drafted tokens and, for drafters that sample, the distributions they were drawn from."""

    tokens: torch.Tensor  # [k'] long, k' <= k (may be 0)
    probs: torch.Tensor | None = None  # [k', V] warped q, or None: verify as a point mass


def empty_proposal() -> Proposal:
    """A proposal of no tokens: the round degenerates to one plain target step."""
    return Proposal(torch.zeros(0, dtype=torch.long))


@dataclass(frozen=True)
class BeamDraft:
    """The beams as a prefix-merged tree (scores: joint log q per node) and where each beam ends."""

    tree: TokenTree
    beams: list[list[int]]  # best first
    log_q: list[float]  # joint log q of each beam, best first
    ends: list[int]  # the tree node each beam ends at

    @property
    def best(self) -> int:
        """The tree node the best beam ends at (what MJSD verifies)."""
        return self.ends[0]


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


class TreeDrafter(Protocol):
    """Proposes a token tree after a context (SWARM); the loop calls reset, then tree / observe per round."""

    def reset(
        self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None, ban: TokenBan = NO_BAN
    ) -> None:
        """Start a new sequence (as Drafter.reset)."""
        ...

    def tree(self, context: list[int], depth: int, budget: int) -> TokenTree:
        """At most `budget` nodes, at most `depth` deep, after `context` (its last token is the root)."""
        ...

    def observe(self, verdict: Verdict) -> None:
        """The verifier's verdict on the last tree (a TreeVerdict: its kept path's tokens)."""
        ...


class BeamDrafter(Protocol):
    """Proposes beams after a context (MJSD); the loop calls reset, then draft per round."""

    def reset(
        self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None, ban: TokenBan = NO_BAN
    ) -> None:
        """Start a new sequence (as Drafter.reset)."""
        ...

    def draft(self, context: list[int], gamma: int) -> BeamDraft:
        """Beams of up to gamma tokens after `context`, best first."""
        ...


@runtime_checkable
class FeatureReader(Protocol):
    """A drafter that reads the target's own hidden states (EAGLE): the loop hands it the target's cache."""

    def follow(self, cache) -> None:
        """Tap `cache` (runtime.backends.base.KVCache.tap) before its first forward and read its features."""
        ...
