"""Layer-truncated self-drafter: the target's first N decoder layers, its final norm and its head."""

from __future__ import annotations

import copy

import torch

from runtime.drafters.base import Proposal, empty_proposal
from runtime.heads.sampling import SamplingParams
from runtime.target import TorchCache, TorchTarget
from runtime.verify import NO_BAN, TokenBan, Verdict, mask_banned, sample_from, select_allowed, warp


def shallow_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of a module that shares its weights but has its own module, parameter and buffer tables."""
    clone = copy.copy(module)
    # copy.copy shares nn.Module's internal dicts; replace them before assigning anything.
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone


def truncated_decoder(body: torch.nn.Module, layers: int) -> torch.nn.Module:
    """A shallow copy of a transformers decoder that runs only its first `layers` layers.

    Weights are shared with `body`; the copy gets its own module table and config so that
    neither the original's layer list nor the cache layout it implies changes.
    """
    total = body.config.num_hidden_layers
    if not 1 <= layers < total:
        raise ValueError(f"layers:N needs 1 <= N < {total} (the target's layer count), got {layers}")
    clone = shallow_copy(body)
    clone.layers = torch.nn.ModuleList(list(body.layers)[:layers])
    config = copy.deepcopy(body.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:layers]
    clone.config = config
    return clone


class DecoderDrafter:
    """Drafts with a transformers decoder (final-normed output) and an LM head, keeping its own KV cache.

    The decoder is some cheaper copy of the target's (fewer layers, low-rank weights). Greedy drafts
    are the head's choices (`head.select`, so a certified head stays cheap); sampled drafts are drawn
    from the warped draft distribution q, which the proposal carries for exact verification.
    """

    def __init__(self, body: torch.nn.Module, head) -> None:
        self.body = body
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

    def _new_cache(self) -> TorchCache:
        return TorchCache(self.body.config)

    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Append tokens to the cache; the final-normed hidden state [1, d] of the last one."""
        return self.forward(tokens)[-1:]

    @torch.inference_mode()
    def forward(self, tokens: list[int]) -> torch.Tensor:
        """Append tokens to the cache; the final-normed hidden states [T, d] of all of them."""
        out = self.body(input_ids=torch.tensor([tokens]), past_key_values=self.cache.inner, use_cache=True)
        self.cache.length += len(tokens)
        self.cached.extend(tokens)
        return out.last_hidden_state[0]

    def _crop(self, length: int) -> None:
        if length < self.cache.length:
            self.cache.inner.crop(length - self.cache.length)  # negative, as TorchTarget.crop (sliding layers)
            self.cache.length = length
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


class LayerDrafter(DecoderDrafter):
    """Drafts with the target's first N layers + final norm + head (see DecoderDrafter)."""

    def __init__(self, target: TorchTarget, layers: int, head) -> None:
        super().__init__(truncated_decoder(target.body, layers), head)


class BackendDrafter(DecoderDrafter):
    """A DecoderDrafter whose decoder is a TargetModel backend (`self.backend`: forward, crop, new_cache).

    Subclasses set `self.backend` before calling DecoderDrafter.__init__ (which makes the first cache).
    """

    backend: TorchTarget

    def _new_cache(self):
        return self.backend.new_cache()

    @torch.inference_mode()
    def forward(self, tokens: list[int]) -> torch.Tensor:
        """Append tokens to the cache; the final-normed hidden states [T, d] of all of them."""
        hidden = self.backend.forward(torch.tensor(tokens), self.cache)  # [T, d]
        self.cached.extend(tokens)
        return hidden

    def _crop(self, length: int) -> None:
        self.backend.crop(self.cache, length)
        del self.cached[length:]
