"""DecoderTarget: a TargetModel over the decoder ladder (the lean and native backends)."""

from __future__ import annotations

import torch

from runtime.backends.base import KVCache
from runtime.backends.decoder import Decoder
from runtime.kernels import take_rows


class DecoderTarget:
    """A Decoder plus the LM head's weights, the input-embedding table and the EOS ids.

    `name` is the backend's name in reports (lean: fp32 weights; native: the GGUF's blocks).
    """

    def __init__(
        self,
        name: str,
        decoder: Decoder,
        embedding: object,
        head_weight: object,
        head_bias: torch.Tensor | None,
        eos_token_ids: set[int] | frozenset[int],
    ) -> None:
        self.name = name
        self.decoder = decoder
        self.embedding = embedding  # [V, d] fp32 tensor or QuantMatrix, unscaled
        self.head_weight = head_weight  # [V, d] fp32 tensor or QuantMatrix
        self.head_bias = head_bias  # [V] or None
        self.vocab_size, self.hidden_size = head_weight.shape
        self.eos_token_ids = frozenset(eos_token_ids)
        self.config = decoder.config

    @property
    def num_layers(self) -> int:
        return len(self.decoder.layers)

    @property
    def layers(self):
        return self.decoder.layers

    def new_cache(self) -> KVCache:
        return self.decoder.new_cache()

    def forward(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Append tokens [T] to the cache and return final-normed hidden states [T, d]."""
        return self.decoder.forward(tokens, cache)

    def crop(self, cache: KVCache, length: int) -> None:
        """Roll the cache back to its first `length` tokens."""
        cache.crop(length)

    def forward_tree(self, tokens: torch.Tensor, parents: torch.Tensor, cache: KVCache, start: int | None = None) -> torch.Tensor:
        """Append token-tree nodes; hidden states [n, d] equal to chain forwards over their paths (Decoder.forward_tree)."""
        return self.decoder.forward_tree(tokens, parents, cache, start)

    def compact(self, cache: KVCache, start: int, nodes: list[int]) -> None:
        """Keep the cached tree nodes `nodes` (an accepted path) as tokens start.., drop the rest."""
        cache.compact(start, nodes)

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows [k, d] of the input-embedding table for ids [k] (unscaled, as stored)."""
        return take_rows(self.embedding, ids)

    def with_decoder(self, decoder: Decoder) -> "DecoderTarget":
        """The same target (head, embeddings, EOS ids) over another decoder: a drafter's copy."""
        return DecoderTarget(self.name, decoder, self.embedding, self.head_weight, self.head_bias, self.eos_token_ids)

    def truncated(self, layers: int) -> "DecoderTarget":
        """The first `layers` layers + final norm, sharing every weight; its caches are its own."""
        return self.with_decoder(self.decoder.truncated(layers))
