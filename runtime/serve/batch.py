"""Continuous batching: the forwards decoding loops hand to the scheduler, and the one fused forward per
step that runs the next piece of each of them (Decoder.forward_feeds).

A request's loop runs on a ScheduledTarget (in a Fiber, runtime.serve.fiber): its `forward` and
`forward_tree` do not compute, they hand a Forward to the scheduler and wait. Each step the scheduler
feeds every waiting Forward's next piece in one forward over all their rows, each on its own cache.
The pieces are the calls the loop's forward would make alone: a prompt longer than PREFILL_CHUNK
in chunks of PREFILL_CHUNK from its start (Decoder.forward), a tree of more than SKINNY_MAX_ROWS
nodes in parts of SKINNY_MAX_ROWS (Decoder.forward_tree). So every piece is a Feed whose rows get
the bits its forward alone gives them, and the loop gets exactly the hidden states it would compute
itself. A long prompt's chunks go one per step (chunked prefill): the others wait one chunk, not a
whole prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from runtime.backends.base import KVCache
from runtime.backends.decoder import PREFILL_CHUNK, Decoder
from runtime.backends.rows import Feed
from runtime.backends.target import DecoderTarget
from runtime.kernels import SKINNY_MAX_ROWS, kernel_name

PREFILL_BUDGET = PREFILL_CHUNK  # prefill rows (pieces over SKINNY_MAX_ROWS) per step, beyond the first piece


@dataclass(eq=False)
class Forward:
    """A forward a loop handed over: its pieces (feed makers, in order) and the hidden states so far."""

    decoder: Decoder
    pieces: list[Callable[[], Feed]]  # each makes its Feed when its turn comes (the cache holds the pieces before)
    rows: list[int]  # rows of each piece
    parts: list[torch.Tensor] = field(default_factory=list)  # hidden states [T_i, d] of the pieces fed
    error: Exception | None = None  # what the forward raised (then it is done, and fails in the request's loop)

    @property
    def done(self) -> bool:
        return self.error is not None or len(self.parts) == len(self.pieces)

    @property
    def next_rows(self) -> int:
        return self.rows[len(self.parts)]

    @property
    def result(self) -> torch.Tensor:
        """Every piece's hidden states, in order: [T, d], what the loop's forward returns (or its error, raised)."""
        if self.error is not None:
            raise self.error
        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)


def chain_forward(decoder: Decoder, tokens: torch.Tensor, cache: KVCache) -> Forward:
    """Tokens [T] appended to the cache, in Decoder.forward's chunks."""
    chunks = tokens.view(-1).split(PREFILL_CHUNK)
    return Forward(decoder, [lambda chunk=chunk: decoder.chain_feed(chunk, cache) for chunk in chunks],
                   [chunk.numel() for chunk in chunks])


def tree_forward(decoder: Decoder, tokens: torch.Tensor, parents: torch.Tensor, cache: KVCache, start: int | None) -> Forward:
    """The last n of a token tree's nodes appended after the cache's first `start` tokens, in
    Decoder.forward_tree's parts."""
    tokens, parents = tokens.view(-1), parents.view(-1)
    start = cache.length if start is None else start
    first = parents.numel() - tokens.numel()
    offsets = range(0, tokens.numel(), SKINNY_MAX_ROWS)
    chunks = tokens.split(SKINNY_MAX_ROWS)
    return Forward(decoder, [lambda chunk=chunk, offset=offset: decoder.tree_feed(chunk, parents[: first + offset + chunk.numel()], cache, start)
                             for offset, chunk in zip(offsets, chunks)], [chunk.numel() for chunk in chunks])


class ScheduledTarget(DecoderTarget):
    """The target as a served request's loop sees it: forwards go to `post` (the scheduler runs them
    with the other requests' rows, then post returns), everything else is the target's.

    A thin wrapper, not a backend: drafters built on it (truncated, int8 copies) get plain
    DecoderTargets and run their own forwards in the loop's turn.
    """

    def __init__(self, target: DecoderTarget, post: Callable[[Forward], object]) -> None:
        super().__init__(target.name, target.decoder, target.embedding, target.head_weight, target.head_bias,
                         target.eos_token_ids)
        self._post = post

    def forward(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Hidden states [T, d] of tokens [T] appended to the cache, computed in the scheduler's steps."""
        forward = chain_forward(self.decoder, tokens, cache)
        self._post(forward)
        return forward.result

    def forward_tree(self, tokens: torch.Tensor, parents: torch.Tensor, cache: KVCache, start: int | None = None) -> torch.Tensor:
        """As DecoderTarget.forward_tree, computed in the scheduler's steps."""
        forward = tree_forward(self.decoder, tokens, parents, cache, start)
        self._post(forward)
        return forward.result


def fusable() -> bool:
    """Whether rows of several sequences may share a forward: the compiled kernels give each row its own
    bits whatever shares the call; torch's fallback GEMM makes no such promise, so it runs each alone."""
    return kernel_name() != "torch"


def run_step(forwards: list[Forward], budget: int = PREFILL_BUDGET) -> tuple[int, int]:
    """Feed each waiting forward's next piece, all in one forward per decoder; (rows, forwards) fed.

    Pieces of up to SKINNY_MAX_ROWS rows (decoding steps, verify chains, tree parts) always go;
    longer ones (prefill chunks) go while their rows stay within `budget`, the first one always.
    """
    batches: dict[int, list[Forward]] = {}
    prefill = 0
    for forward in forwards:
        rows = forward.next_rows
        if rows > SKINNY_MAX_ROWS:
            if prefill and prefill + rows > budget:
                continue
            prefill += rows
        batches.setdefault(id(forward.decoder), []).append(forward)
    rows_fed = fed = 0
    for batch in batches.values():
        groups = [batch] if fusable() else [[forward] for forward in batch]
        for group in groups:
            try:
                feeds = [forward.pieces[len(forward.parts)]() for forward in group]
                hidden = group[0].decoder.forward_feeds(feeds)
            except Exception as e:  # noqa: BLE001 - raised again in each request's loop (a 400 or 500 for it)
                for forward in group:
                    forward.error = e
                continue
            for forward, rows in zip(group, hidden):
                forward.parts.append(rows)
            rows_fed += sum(feed.tokens.numel() for feed in feeds)
            fed += len(feeds)
    return rows_fed, fed
