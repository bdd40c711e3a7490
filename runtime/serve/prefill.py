"""A prompt's prefill spread over scheduler steps, one PREFILL_CHUNK per step, with the same bits.

Decoder.forward feeds a prompt of more than PREFILL_CHUNK tokens as chunks of PREFILL_CHUNK from its
start. ChunkedPrefill makes the same calls on the same cache, one per step, for every whole chunk but
the last piece; PrefilledTarget then hands that cache to the decoding loop and feeds only the rest. So
each chunk is the forward `runtime generate` runs, and the cache and the first token are identical.
"""

from __future__ import annotations

import torch

from runtime.backends.base import KVCache
from runtime.backends.decoder import PREFILL_CHUNK
from runtime.backends.target import DecoderTarget


class ChunkedPrefill:
    """The leading whole chunks of a prompt, fed to a fresh cache one `step` at a time."""

    def __init__(self, target: DecoderTarget, ids: torch.Tensor) -> None:
        self.target = target
        self.ids = ids  # [P]
        self.cache = target.new_cache()
        # Whole chunks only, and at least one token left for the loop (it needs the last hidden state).
        self.end = PREFILL_CHUNK * ((ids.numel() - 1) // PREFILL_CHUNK)

    @property
    def done(self) -> bool:
        return self.cache.length >= self.end

    def step(self) -> None:
        """Feed the next chunk of PREFILL_CHUNK tokens."""
        start = self.cache.length
        self.target.forward(self.ids[start : start + PREFILL_CHUNK], self.cache)


class PrefilledTarget(DecoderTarget):
    """The target, whose first new cache is one a ChunkedPrefill filled; the loop's prompt forward on it
    feeds only the tokens after what the cache holds.

    A thin wrapper, not a backend: drafters built on it (truncated, int8 copies) get plain DecoderTargets.
    """

    def __init__(self, target: DecoderTarget, cache: KVCache) -> None:
        super().__init__(target.name, target.decoder, target.embedding, target.head_weight, target.head_bias,
                         target.eos_token_ids)
        self._prefilled: KVCache | None = cache
        self._handed = False

    def new_cache(self) -> KVCache:
        if self._prefilled is not None and not self._handed:
            self._handed = True
            return self._prefilled
        return super().new_cache()

    def forward(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """As DecoderTarget.forward; the prompt's first forward on the prefilled cache skips what it holds."""
        if cache is self._prefilled:
            self._prefilled = None  # the prompt's forward: the only one that skips
            tokens = tokens.view(-1)[cache.length :]
        return super().forward(tokens, cache)
