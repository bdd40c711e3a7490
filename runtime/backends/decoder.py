"""The decoder ladder shared by the lean and native backends: one forward, two ways to hold weights.

A gemma3 / qwen2 / llama decoder as a ladder of a few kernel calls per layer: fused q/k/v and
gate/up projections, one preallocated KV buffer per layer (rollback = lowering the length), rotary
tables computed once by the model's own rotary module, and the fixed-order row-wise kernels of
runtime.kernels for RMSNorm, q/k preparation (head norms, rotary, K/V write) and attention.
Activations are transformers' own modules. Every projection is a callable [T, in] -> [T, out]:
`runtime.kernels.linear` over fp32 weights (lean) or over the GGUF's blocks (native). Both sum
each output in the same order (runtime/kernels), so the two backends give bit-identical hidden
states, and for T <= 16 each row gets the value a one-token step gives it (batch invariance: a
verify forward scores every position exactly as plain decoding would), because each query's
attention is computed alone over exactly the keys a one-token step reads.

Long prompts are fed in chunks of PREFILL_CHUNK tokens (attention: torch's SDPA with a causal
mask), so the attention scores and mask of a prefill stay [H, C, K] and [C, K] with
C <= PREFILL_CHUNK, whatever the prompt length.

Token trees (SWARM, MJSD): `forward_tree` feeds drafted nodes with parent indices; each node sits
at the prefix length + its depth - 1 and attends to the prefix, its ancestors and itself: the
attention kernel reads the prefix slots, then its path's slots, which hold the same keys in the
same order as a one-token step over its path reads, so every node's hidden state is torch.equal
to a chain forward over its path. `compact` then gathers the accepted path's K/V to the front.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from runtime.backends.base import INITIAL_CAPACITY, KVCache, check_truncation
from runtime.backends.layers import PROJECTIONS, DecoderLayer
from runtime.backends.rows import Feed, Rows, tree_paths
from runtime.kernels import SKINNY_MAX_ROWS, attend, prepare_qkv

PREFILL_CHUNK = 256  # tokens per prefill forward: bounds the [H, C, K] attention scores
PREFILL_PROGRESS_TOKENS = 2048  # a prefill this long takes seconds on these CPUs: it shows a bar on stderr


def _attention_mask(start: int, queries: int, keys_from: int, keys_to: int, window: int | None) -> torch.Tensor | None:
    """Boolean mask [queries, keys] for queries at positions start.. over keys keys_from..keys_to-1.

    None when every query may see every key (one query and no window cut), so SDPA takes its
    unmasked path.
    """
    q_pos = torch.arange(start, start + queries).unsqueeze(1)  # [n, 1]
    k_pos = torch.arange(keys_from, keys_to).unsqueeze(0)  # [1, K]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos < window
    return None if bool(allowed.all()) else allowed


class Decoder:
    """The ladder: embed -> layers -> final norm, over a KVCache."""

    def __init__(
        self,
        config,
        embed: Callable[[torch.Tensor], torch.Tensor],
        layers: list[DecoderLayer],
        norm: torch.nn.Module,
        rotary: torch.nn.Module,
        head_dim: int,
    ) -> None:
        self.config = config
        self.embed = embed  # ids [T] -> [T, d], embedding scale included
        self.layers = layers
        self.norm = norm
        self.rotary = rotary
        self.head_dim = head_dim
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.dtype = torch.float32
        self._rotary: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # kind -> (cos, sin) [P, hd]
        self._extend_rotary(INITIAL_CAPACITY)

    def _extend_rotary(self, positions: int) -> None:
        """Rotary cos/sin tables [positions, hd] from the model's own rotary module, per layer type."""
        ids = torch.arange(positions).unsqueeze(0)  # [1, P]
        probe = torch.zeros(1, dtype=self.dtype)
        per_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        with torch.inference_mode():
            for kind in {layer.rope for layer in self.layers}:
                cos, sin = self.rotary(probe, ids, kind) if per_type else self.rotary(probe, ids)
                self._rotary[kind] = (cos[0].contiguous(), sin[0].contiguous())

    def new_cache(self) -> KVCache:
        return KVCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype)

    def crop(self, cache: KVCache, length: int) -> None:
        """Roll back by forgetting everything after `length` tokens (the buffers stay allocated)."""
        cache.crop(length)

    def truncated(self, layers: int) -> "Decoder":
        """A copy running only the first `layers` layers (weights, norm and rotary tables shared)."""
        check_truncation(layers, len(self.layers))
        return self.with_layers(self.layers[:layers])

    def with_layers(self, layers: list[DecoderLayer]) -> "Decoder":
        """A copy with other layers (transformed projections), sharing everything else."""
        clone = object.__new__(Decoder)
        clone.__dict__.update(self.__dict__)
        clone.layers = layers
        return clone

    def _prefill(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """forward over tokens [T] in chunks of PREFILL_CHUNK, with a progress bar from PREFILL_PROGRESS_TOKENS on."""
        with tqdm(total=tokens.numel(), desc="prefill", unit="tok", file=sys.stderr, leave=False,
                  disable=tokens.numel() < PREFILL_PROGRESS_TOKENS) as bar:
            hidden = []
            for chunk in tokens.split(PREFILL_CHUNK):
                hidden.append(self.forward(chunk, cache))  # [C, d]
                bar.update(chunk.numel())
        return torch.cat(hidden)  # [T, d]

    def map_projections(self, transform: Callable[[str, int, Callable], Callable]) -> "Decoder":
        """A copy whose projection `name` of layer `index` is transform(name, index, projection)."""
        return self.with_layers([
            dataclasses.replace(layer, **{name: transform(name, index, getattr(layer, name)) for name in PROJECTIONS})
            for index, layer in enumerate(self.layers)
        ])

    def forward(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Append tokens [T] to the cache and return final-normed hidden states [T, d]."""
        tokens = tokens.view(-1)
        if tokens.numel() > PREFILL_CHUNK:
            return self._prefill(tokens, cache)
        return self.forward_feeds([self.chain_feed(tokens, cache)])[0]

    def forward_tree(self, tokens: torch.Tensor, parents: torch.Tensor, cache: KVCache, start: int | None = None) -> torch.Tensor:
        """Append token-tree nodes to the cache; their final-normed hidden states [n, d].

        parents: [N] every node's parent (an earlier node, or -1: hangs under the prefix's last
        token), parents first. The prefix is the cache's first `start` tokens (default: all of it);
        node j's K/V go to start + j, its position is start + depth(j) - 1. tokens: [n], the last n
        of the N nodes; the first N - n were fed by earlier calls (the cache holds start + N - n).
        Each node's hidden state is torch.equal to a chain forward over the prefix and its path.
        """
        tokens = tokens.view(-1)
        if tokens.numel() > SKINNY_MAX_ROWS:  # chunks the one-call layer (layer_plan) takes; every row keeps its bits
            parents = parents.view(-1).tolist()
            start = cache.length if start is None else start
            first = len(parents) - tokens.numel()
            return torch.cat([
                self.forward_tree(chunk, torch.tensor(parents[: first + offset + chunk.numel()]), cache, start)
                for offset, chunk in zip(range(0, tokens.numel(), SKINNY_MAX_ROWS), tokens.split(SKINNY_MAX_ROWS))
            ])
        return self.forward_feeds([self.tree_feed(tokens, parents, cache, start)])[0]

    def chain_feed(self, tokens: torch.Tensor, cache: KVCache) -> Feed:
        """The feed appending tokens [T] (T <= PREFILL_CHUNK) to the cache at its length."""
        start, count = cache.length, tokens.numel()
        return self._feed(tokens.view(-1), cache, Rows(start, count), start + count)

    def tree_feed(self, tokens: torch.Tensor, parents: torch.Tensor, cache: KVCache, start: int | None = None) -> Feed:
        """The feed appending the last n <= SKINNY_MAX_ROWS of a token tree's nodes (forward_tree's arguments)."""
        tokens, parents = tokens.view(-1), parents.view(-1).tolist()
        count, total = tokens.numel(), len(parents)
        start = cache.length if start is None else start
        if not 0 < count <= total or cache.length != start + total - count:
            raise ValueError(f"forward_tree feeds the last {count} of {total} nodes after {start} prefix tokens, "
                             f"but the cache holds {cache.length}")
        rows = Rows(start + total - count, count, start, tree_paths(parents)[total - count :])
        return self._feed(tokens, cache, rows, start + total)

    def _feed(self, tokens: torch.Tensor, cache: KVCache, rows: Rows, length: int) -> Feed:
        """A Feed, with the cache and the rotary tables grown to hold it."""
        cache.reserve(length)
        if int(rows.positions.max()) >= self._rotary[self.layers[0].rope][0].shape[0]:
            self._extend_rotary(cache.capacity)
        return Feed(tokens, cache, rows, length)

    @torch.inference_mode()
    def forward_feeds(self, feeds: list[Feed]) -> list[torch.Tensor]:
        """One forward over the rows of several feeds, each on its own cache: hidden states [T_i, d] per feed.

        Embedding, norms, projections and the MLP run over all rows at once; q/k preparation and
        attention run per feed on its cache, with the path its forward alone takes (per-query
        attention up to SKINNY_MAX_ROWS rows, SDPA for a longer prefill chunk). Every row-wise kernel
        gives a row the same bits whatever rows share its call (runtime.kernels.linear at any row
        count), so each feed's hidden states are torch.equal to its forward alone: a server's
        request does not depend on what else is in the batch.
        """
        counts = [feed.tokens.numel() for feed in feeds]
        x = self.embed(torch.cat([feed.tokens for feed in feeds]) if len(feeds) > 1 else feeds[0].tokens)  # [N, d]
        tapped = {index for feed in feeds for index in feed.cache.tapped}  # layers whose input some cache keeps
        for index, layer in enumerate(self.layers):
            if index in tapped:  # (a split per layer costs a small model's step ~3 %: only where it is read)
                for feed, part in zip(feeds, x.split(counts)):
                    self._tap(feed.cache, index, feed.rows.start, part)
            x = self._layer(layer, x, feeds, index)
        for feed in feeds:
            feed.cache.length = feed.length
        return list(self.norm(x).split(counts))

    @staticmethod
    def _tap(cache: KVCache, index: int, start: int, x: torch.Tensor) -> None:
        """Copy the residual stream x [T, d] entering layer `index` into a tapped cache's features."""
        for slot, tapped in enumerate(cache.tapped):
            if tapped == index:
                cache.write_features(slot, start, x)

    def _layer(self, layer: DecoderLayer, x: torch.Tensor, feeds: list[Feed], index: int) -> torch.Tensor:
        """One decoder layer over x [N, d] (the feeds' rows, in order); returns the new residual [N, d].

        One feed of up to SKINNY_MAX_ROWS rows takes the layer's compiled plan when it has one: the
        same calls below, in the same order, in one crossing into C++ (the same bits).
        """
        plan = layer.plan(self.num_heads, self.kv_heads, self.head_dim) if len(feeds) == 1 and x.shape[0] <= SKINNY_MAX_ROWS else None
        if plan is not None:
            cache, rows = feeds[0].cache, feeds[0].rows
            cos, sin = self._rotary[layer.rope]
            return plan.forward(x, cache.keys[index], cache.values[index], rows.positions, *rows.keys(layer.window),
                                rows.start, cos, sin)
        attended = self._attention(layer, layer.input_norm(x), feeds, index)  # [N, d]
        if layer.post_attention_norm is not None:
            attended = layer.post_attention_norm(attended)
        x = x + attended
        gate_up = layer.gate_up(layer.pre_mlp_norm(x))  # [N, 2 F]
        half = gate_up.shape[1] // 2
        mlp = layer.down(layer.activation(gate_up[:, :half]) * gate_up[:, half:])  # [N, d]
        if layer.post_mlp_norm is not None:
            mlp = layer.post_mlp_norm(mlp)
        return x + mlp

    def _attention(self, layer: DecoderLayer, h: torch.Tensor, feeds: list[Feed], index: int) -> torch.Tensor:
        """Self-attention of h [N, d] (the feeds' rows), each feed over its own cache; writes their K/V."""
        qkv = layer.qkv(h).view(h.shape[0], self.num_heads + 2 * self.kv_heads, self.head_dim)  # [N, H + 2 KV, hd]
        parts = qkv.split([feed.tokens.numel() for feed in feeds])
        out = [self._attend(layer, part, feed.cache, index, feed.rows) for feed, part in zip(feeds, parts)]
        return layer.o(torch.cat(out) if len(out) > 1 else out[0])

    def _attend(self, layer: DecoderLayer, qkv: torch.Tensor, cache: KVCache, index: int, rows: Rows) -> torch.Tensor:
        """Attention of one feed's qkv [T, H + 2 KV, hd] over its cached keys plus its own: [T, H hd].
        Writes its K/V to the cache at rows.start.. (a chain's positions, or a tree's slots after the prefix)."""
        count, hd, heads = qkv.shape[0], self.head_dim, self.num_heads
        head_norms = (layer.q_norm.factor, layer.k_norm.factor) if layer.q_norm is not None else None
        eps = layer.q_norm.eps if layer.q_norm is not None else 0.0
        keys, values = cache.keys[index], cache.values[index]
        prepare_qkv(qkv, heads, head_norms, eps, self._rotary[layer.rope], rows.positions, keys, values, rows.start)
        if rows.paths is not None or count <= SKINNY_MAX_ROWS:
            # Each query alone over exactly the keys a one-token step (over a node's path) reads.
            return attend(qkv, heads, keys, values, *rows.keys(layer.window), layer.scaling)  # [T, H hd]
        start, end = rows.start, rows.start + count
        first = max(0, start + 1 - layer.window) if layer.window else 0  # older keys are outside every query's window
        mask = _attention_mask(start, count, first, end, layer.window)
        return self._sdpa(layer, qkv[:, :heads], cache, index, first, end, mask)[0].transpose(0, 1).reshape(count, heads * hd)

    def _sdpa(self, layer: DecoderLayer, q: torch.Tensor, cache: KVCache, index: int, first: int, end: int,
              mask: torch.Tensor | None) -> torch.Tensor:
        """SDPA of queries q [T, H, hd] over cached keys first..end-1: [1, H, T, hd]."""
        return F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, T, hd]
            cache.keys[index][:, first:end].unsqueeze(0),  # [1, KV, K, hd]
            cache.values[index][:, first:end].unsqueeze(0),
            attn_mask=mask,
            scale=layer.scaling,
            enable_gqa=self.num_heads != self.kv_heads,
        )

