"""Where the rows of one forward go: a chain's or a token tree's positions, cache slots and keys, and
the Feed that pairs them with a sequence's tokens and cache (several feeds make one fused forward)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.backends.base import KVCache


class Rows:
    """The tokens one forward feeds: where their K/V go, their positions, and the keys each reads.

    A chain feeds tokens at start, start + 1, ..; a tree feeds nodes whose paths hang under the
    prefix (the cache's first `prefix` tokens). The key lists are built once per forward and
    window length, not once per layer.
    """

    def __init__(self, start: int, count: int, prefix: int | None = None, paths: list[list[int]] | None = None) -> None:
        self.start = start  # the fed rows' K/V go to start .. start + count - 1
        self.count = count
        self.prefix, self.paths = prefix, paths  # trees only: node j's K/V sit at prefix + j
        if paths is None:
            self.positions = torch.arange(start, start + count)  # [T]
        else:
            self.positions = torch.tensor([prefix + len(path) - 1 for path in paths])  # [n]: prefix + depth - 1
        self._keys: dict[int | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def keys(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(first [T], end [T], extra [T, E]): row t reads cache slots first..end - 1, then extra[t]
        up to the first -1, exactly the keys a one-token step (over a node's path) reads."""
        if window not in self._keys:
            if self.paths is None:
                ends = self.positions + 1
                firsts = (ends - window).clamp(min=0) if window else torch.zeros_like(ends)
                self._keys[window] = (firsts, ends, torch.empty(self.count, 0, dtype=torch.long))
            else:
                self._keys[window] = self._tree_keys(window)
        return self._keys[window]

    def _tree_keys(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        prefix, firsts = self.prefix, []
        extra = torch.full((self.count, max(len(path) for path in self.paths)), -1, dtype=torch.long)
        for row, path in enumerate(self.paths):
            low = max(0, prefix + len(path) - window) if window else 0  # the window may start inside the path
            firsts.append(min(low, prefix))
            slots = [prefix + node for node in path][max(0, low - prefix) :]
            extra[row, : len(slots)] = torch.tensor(slots)
        return torch.tensor(firsts), torch.full((self.count,), prefix, dtype=torch.long), extra


def tree_paths(parents: list[int]) -> list[list[int]]:
    """Every node's path (node indices, the prefix's child first) for parents listed parents first."""
    paths: list[list[int]] = []
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise ValueError(f"a token tree lists parents first: node {node} has parent {parent}")
        paths.append((paths[parent] if parent >= 0 else []) + [node])
    return paths


@dataclass(frozen=True)
class Feed:
    """One sequence's part of a forward: its tokens, its cache, where their K/V go, and the cache's
    length once they are fed (Decoder.chain_feed / tree_feed make it, Decoder.forward_feeds runs it)."""

    tokens: torch.Tensor  # [T]
    cache: KVCache
    rows: Rows
    length: int
