"""TargetModel: the backend protocol the decoding loops run on, and the one KV cache with rollback by length.

A backend turns tokens into final-normed hidden states [T, d] and keeps its own KV cache; the LM
head lives apart (runtime.heads) so the loops can swap a full head for a certified one. Rollback
is cropping the cache to a length. Backends are siblings behind this protocol:

- `transformers` (runtime.backends.hf): transformers' own forward, any architecture it knows;
- `lean` (runtime.backends.lean): the decoder ladder (runtime.backends.decoder) over fp32 weights;
- `native` (runtime.backends.native): the same ladder over the GGUF file's own quantized blocks.
"""

from __future__ import annotations

from typing import Protocol

import torch

INITIAL_CAPACITY = 512


class KVCache:
    """Preallocated per-layer K/V buffers [KV, capacity, hd]; the first `length` tokens are valid.

    Rolling back is lowering `length`: the buffers stay allocated and later writes overwrite them.
    A tapped cache (`tap`) also keeps, per token, the residual stream entering the tapped layers
    (`features` [capacity, len(tapped) d]): what an EAGLE head reads, rolled back with the rest.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int = INITIAL_CAPACITY):
        self.keys = [torch.zeros(kv_heads, capacity, head_dim, dtype=dtype) for _ in range(layers)]
        self.values = [torch.zeros(kv_heads, capacity, head_dim, dtype=dtype) for _ in range(layers)]
        self.length = 0
        self.tapped: tuple[int, ...] = ()  # layers whose input the forward writes into `features`
        self.features: torch.Tensor | None = None  # [capacity, len(tapped) d], allocated by the first tapped forward

    def tap(self, layers: tuple[int, ...]) -> None:
        """Keep the residual stream entering `layers` for every token fed from now on (before any is fed)."""
        if self.length:
            raise ValueError("tap a cache before its first forward: the features of fed tokens are gone")
        self.tapped, self.features = tuple(layers), None

    def write_features(self, slot: int, start: int, x: torch.Tensor) -> None:
        """Store tapped layer `slot`'s input rows x [T, d] at tokens start.."""
        width = x.shape[1]
        if self.features is None:
            self.features = x.new_zeros(self.capacity, len(self.tapped) * width)
        self.features[start : start + x.shape[0], slot * width : (slot + 1) * width] = x

    def __len__(self) -> int:
        return self.length

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def reserve(self, length: int) -> None:
        """Grow every buffer (doubling) so that `length` tokens fit."""
        if length <= self.capacity:
            return
        capacity = self.capacity
        while capacity < length:
            capacity *= 2
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = old.new_zeros(old.shape[0], capacity, old.shape[2])
                new[:, : self.length] = old[:, : self.length]
                buffers[i] = new
        if self.features is not None:
            grown = self.features.new_zeros(capacity, self.features.shape[1])
            grown[: self.length] = self.features[: self.length]
            self.features = grown

    def crop(self, length: int) -> None:
        """Forget everything after the first `length` tokens."""
        self.length = min(self.length, length)

    @torch.inference_mode()  # the forwards allocate buffers (features, grown K/V) as inference tensors
    def compact(self, start: int, nodes: list[int]) -> None:
        """Keep the entries start + node for `nodes` (a token tree's accepted path) as tokens start..
        in that order and forget the rest: a copying gather, never overlapping views."""
        if any(not 0 <= node < self.length - start for node in nodes):
            raise ValueError(f"compact keeps cached tree nodes 0..{self.length - start - 1}, got {nodes}")
        if nodes != list(range(len(nodes))):  # else already in place
            slots = torch.tensor(nodes, dtype=torch.long) + start  # [n]
            for buffers in (self.keys, self.values):
                for buffer in buffers:
                    picked = buffer.index_select(1, slots)  # [KV, n, hd], a new tensor
                    buffer[:, start : start + len(nodes)] = picked
            if self.features is not None:
                self.features[start : start + len(nodes)] = self.features.index_select(0, slots)
        self.length = start + len(nodes)


class TargetModel(Protocol):
    """A causal LM as the decoding loops see it."""

    name: str  # the backend's name in reports: transformers | lean | native
    vocab_size: int
    hidden_size: int
    num_layers: int
    head_weight: object  # [V, d]: a float32 tensor or a runtime.kernels QuantMatrix
    head_bias: torch.Tensor | None  # [V]
    eos_token_ids: frozenset[int]

    def new_cache(self): ...

    def forward(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        """Append tokens [T] to the cache and return their final-normed hidden states [T, d]."""
        ...

    def crop(self, cache, length: int) -> None:
        """Drop everything after the first `length` cached tokens."""
        ...

    def forward_tree(self, tokens: torch.Tensor, parents: torch.Tensor, cache, start: int | None = None) -> torch.Tensor:
        """Append token-tree nodes [n] (parents [N], -1: under the prefix) after the cache's first
        `start` tokens; hidden states [n, d], each equal to a chain forward over the node's path
        (runtime.backends.decoder.Decoder.forward_tree). Backends without trees raise ValueError."""
        ...

    def compact(self, cache, start: int, nodes: list[int]) -> None:
        """Keep the cached tree nodes `nodes` (an accepted path) as tokens start.., drop the rest."""
        ...

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The input-embedding table's rows [k, d] for ids [k], as stored (no embedding scale)."""
        ...

    def truncated(self, layers: int) -> "TargetModel":
        """The same backend running only the first `layers` decoder layers (shared weights, own cache)."""
        ...


def check_truncation(layers: int, total: int) -> None:
    """Refuse a layer count a truncated copy cannot have."""
    if not 1 <= layers < total:
        raise ValueError(f"layers:N needs 1 <= N < {total} (the target's layer count), got {layers}")


def eos_ids(config, generation_config, tokenizer) -> set[int]:
    """End-of-sequence ids from the generation config, model config and tokenizer."""
    ids: set[int] = set()
    for source in (generation_config, config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    vocab = tokenizer.get_vocab()
    for token in ("<end_of_turn>", "<|im_end|>", "<|endoftext|>"):
        if token in vocab:
            ids.add(int(tokenizer.convert_tokens_to_ids(token)))
    return ids
