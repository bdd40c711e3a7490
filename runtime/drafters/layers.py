"""Drafters that run a copy of the target on its own backend, and the layer-truncated self-drafter.

A self-drafter (layers:N, int8, gp) is a slice or a transform of the target's own backend
(TargetModel.truncated, DecoderTarget.with_decoder), so a drafter and its target always run on
the same forward: transformers, lean or native.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.drafters.base import Proposal, empty_proposal
from runtime.drafters.arguments import positive
from runtime.drafters.registry import DraftContext
from runtime.sampling import NO_BAN, SamplingParams, TokenBan, mask_banned, sample_from, select_allowed, warp
from runtime.verify import Verdict


class BackendDrafter:
    """Drafts with a backend (a TargetModel: forward, crop, new_cache) and an LM head, keeping its own KV cache.

    The backend is some cheaper copy of the target (fewer layers, int8 or low-rank weights) or another
    model. Greedy drafts are the head's choices (`head.select`, so a certified head stays cheap);
    sampled drafts are drawn from the warped draft distribution q, which the proposal carries for
    exact verification.
    """

    def __init__(self, backend, head) -> None:
        self.backend = backend
        self.head = head  # its own instance: the drafter's rows must not count as the target's
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None
        self.ban = NO_BAN
        self.cache = self._new_cache()
        self.cached: list[int] = []  # the tokens in self.cache, in order
        self.context_length = 0  # length of the context the last proposal followed

    def reset(
        self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None, ban: TokenBan = NO_BAN
    ) -> None:
        """Fresh cache for a new sequence; the prompt is fed at the first proposal."""
        self.params, self.generator, self.ban = params, generator, ban
        self.cache = self._new_cache()
        self.cached = []

    def _new_cache(self):
        return self.backend.new_cache()

    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Append tokens to the cache; the final-normed hidden state [1, d] of the last one."""
        return self.forward(tokens)[-1:]

    @torch.inference_mode()
    def forward(self, tokens: list[int]) -> torch.Tensor:
        """Append tokens to the cache; the final-normed hidden states [T, d] of all of them."""
        hidden = self.backend.forward(torch.tensor(tokens), self.cache)  # [T, d]
        self.cached.extend(tokens)
        return hidden

    def _crop(self, length: int) -> None:
        self.backend.crop(self.cache, length)
        del self.cached[length:]

    def _sync(self, context: list[int]) -> list[int]:
        """Roll the cache back to its longest common prefix with `context`; the tokens still to feed."""
        common = len(self.cached)
        if self.cached != context[:common]:
            mismatches = (i for i, (a, b) in enumerate(zip(self.cached, context)) if a != b)
            common = next(mismatches, min(len(self.cached), len(context)))
        # Keep one token unfed: its hidden state is what the first draft comes from.
        common = min(common, len(context) - 1)
        self._crop(common)
        return context[common:]

    def propose(self, context: list[int], k: int) -> Proposal:
        """k tokens drawn one at a time from the drafter's decoder."""
        self.context_length = len(context)
        if k <= 0:
            return empty_proposal()
        hidden = self.feed(self._sync(context))  # [1, d]
        tokens, probs = [], []
        for i in range(k):
            guarded = self.ban.rows(len(context) + i, 1)
            if self.params.greedy:
                token = int(select_allowed(self.head, hidden, self.params, None, self.ban.ids, guarded)[0])
            else:
                q = warp(mask_banned(self.head.logits(hidden), self.ban.ids, guarded), self.params)[0]  # [V]
                token = sample_from(q, self.generator)
                probs.append(q)
            tokens.append(token)
            if i < k - 1:
                hidden = self.feed([token])
        return Proposal(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None)

    def observe(self, verdict: Verdict) -> None:
        """Drop the cached drafts the verifier rejected."""
        self._crop(min(len(self.cached), self.context_length + verdict.accepted))


class LayerDrafter(BackendDrafter):
    """Drafts with the target's first N layers + final norm + head, on the target's own backend."""

    def __init__(self, target, layers: int, head) -> None:
        super().__init__(target.truncated(layers), head)


@dataclass(frozen=True)
class LayersOptions:
    """layers:N: draft with the target's first N layers."""

    layers: int

    @classmethod
    def parse(cls, args: list[str]) -> LayersOptions:
        if len(args) != 1:
            raise ValueError(f"layers takes one layer count, layers:N, not layers:{':'.join(args)}; e.g. layers:6")
        return cls(positive(args[0], "layers:N", "layers:6"))

    def format(self) -> tuple[str, ...]:
        return (str(self.layers),)

    def build(self, context: DraftContext) -> LayerDrafter:
        return LayerDrafter(context.target, self.layers, context.head)
