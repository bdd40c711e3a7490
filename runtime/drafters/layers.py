"""Drafters that run a copy of the target on its own backend, and the layer-truncated self-drafter.

A self-drafter (layers:N, int8, gp) is a slice or a transform of the target's own backend
(TargetModel.truncated, DecoderTarget.with_decoder), so a drafter and its target always run on
the same forward: transformers, lean or native. SlotTrees gives such a drafter's top-K per slot as
a token tree (swarm:DRAFTER:K).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.common.sampling import NO_BAN, SamplingParams, TokenBan, mask_banned, sample_from, select_allowed, warp
from runtime.drafters.base import Proposal, Verdict, empty_proposal
from runtime.drafters.trees import TokenTree, build_tree
from runtime.drafters.arguments import positive
from runtime.drafters.registry import DraftContext


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

    def sync(self, context: list[int]) -> torch.Tensor:
        """Bring the cache to `context`: roll it back to their longest common prefix, feed the rest; the
        hidden state [1, d] after the context, the one the next draft comes from."""
        common = len(self.cached)
        if self.cached != context[:common]:
            mismatches = (i for i, (a, b) in enumerate(zip(self.cached, context)) if a != b)
            common = next(mismatches, min(len(self.cached), len(context)))
        # Keep one token unfed: its hidden state is what the first draft comes from.
        common = min(common, len(context) - 1)
        self._crop(common)
        return self.feed(context[common:])

    def propose(self, context: list[int], k: int) -> Proposal:
        """k tokens drawn one at a time from the drafter's decoder."""
        self.context_length = len(context)
        if k <= 0:
            return empty_proposal()
        hidden = self.sync(context)  # [1, d]
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


class SlotTrees:
    """SWARM over a backend drafter: its greedy chain of `depth` tokens, the top-K of each slot as the
    candidates of every node at that depth, confidences from its softmax (they only rank nodes)."""

    def __init__(self, drafter: BackendDrafter, k: int) -> None:
        self.drafter, self.k = drafter, k
        self.ban = NO_BAN

    def reset(self, prompt, params, generator, ban=NO_BAN) -> None:
        self.ban = ban
        self.drafter.reset(prompt, params, generator, ban)

    @torch.inference_mode()
    def tree(self, context: list[int], depth: int, budget: int) -> TokenTree:
        drafter = self.drafter
        # The drafter's cache keeps its chain; the next round's sync rolls it back to the kept tokens.
        hidden = drafter.sync(context)  # [1, d]
        slots: list[tuple[list[int], list[float]]] = []
        for i in range(depth):
            logits = mask_banned(drafter.head.logits(hidden), self.ban.ids, self.ban.rows(len(context) + i, 1))  # [1, V]
            top = torch.softmax(logits[0].double(), 0).topk(self.k)
            slots.append((top.indices.tolist(), top.values.tolist()))
            if i < depth - 1:
                hidden = drafter.feed([slots[-1][0][0]])
        return build_tree(lambda path: slots[len(path)], self.k, depth, budget)

    def observe(self, verdict: Verdict) -> None:
        """Nothing to do: the next tree's sync keeps the cached chain's longest prefix of the context."""
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
