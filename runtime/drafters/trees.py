"""Token trees: drafted tokens with parent indices, scored by the target in one forward (SWARM, MJSD).

The root is the last accepted token (already in the context, not a node); node i holds tokens[i]
and hangs under parents[i] (-1: under the root). Nodes are stored parents first (parents[i] < i),
so a node's ancestors always precede it and a forward can feed [root] + tokens in order with the
ancestor mask. A node at depth d (the root's children have depth 1) is the d-th token after the
root: its position is the root's position + d.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable

import torch

ROOT = -1


@dataclass(frozen=True)
class TokenTree:
    """Drafted tokens [N] with parent indices [N] and, optionally, a score per node [N]."""

    tokens: torch.Tensor  # [N] long
    parents: torch.Tensor  # [N] long, -1 = child of the root, parents[i] < i
    scores: torch.Tensor | None = None  # [N] float64: log score of the root-to-node path (e.g. log q), or None

    def __post_init__(self) -> None:
        n = self.tokens.numel()
        if self.tokens.dim() != 1 or self.parents.shape != (n,):
            raise ValueError(f"a token tree needs tokens [N] and parents [N], got {tuple(self.tokens.shape)} and "
                             f"{tuple(self.parents.shape)}")
        if n and not ((self.parents >= ROOT) & (self.parents < torch.arange(n))).all():
            raise ValueError("a token tree lists parents first: every parents[i] must be -1 or an earlier node")
        if self.scores is not None and self.scores.shape != (n,):
            raise ValueError(f"tree scores must be [N] = [{n}], got {tuple(self.scores.shape)}")

    @classmethod
    def chain(cls, tokens: list[int] | torch.Tensor) -> "TokenTree":
        """A tree with one path: each token under the one before it."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        return cls(tokens, torch.arange(tokens.numel()) - 1)

    @property
    def size(self) -> int:
        """Number of nodes N (the root not counted)."""
        return self.tokens.numel()

    def depths(self) -> torch.Tensor:
        """Depth of every node [N] (the root's children: 1)."""
        depth = [0] * self.size
        for i, parent in enumerate(self.parents.tolist()):
            depth[i] = 1 if parent == ROOT else depth[parent] + 1
        return torch.tensor(depth, dtype=torch.long)

    def positions(self, root_position: int) -> torch.Tensor:
        """Sequence position of every node [N], given the root's (the prefix length - 1)."""
        return root_position + self.depths()

    def ancestor_mask(self, with_root: bool = False) -> torch.Tensor:
        """[N, N] bool: mask[i, j] when node j is node i or one of its ancestors (what i attends to
        inside the tree). with_root: [N + 1, N + 1] over [root] + nodes, every row seeing the root."""
        n = self.size
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, parent in enumerate(self.parents.tolist()):
            if parent != ROOT:
                mask[i] = mask[parent]
            mask[i, i] = True
        if not with_root:
            return mask
        full = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        full[:, 0] = True
        full[1:, 1:] = mask
        return full

    def children(self) -> dict[int, list[int]]:
        """Children of every node that has some, in node order; key ROOT for the root's."""
        kids: dict[int, list[int]] = {}
        for i, parent in enumerate(self.parents.tolist()):
            kids.setdefault(parent, []).append(i)
        return kids

    def leaves(self) -> list[int]:
        """Nodes without children, in node order."""
        inner = set(self.parents.tolist())
        return [i for i in range(self.size) if i not in inner]

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node` (empty for ROOT)."""
        parents = self.parents.tolist()
        out = []
        while node != ROOT:
            out.append(node)
            node = parents[node]
        return out[::-1]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path, as node indices."""
        return [self.path(leaf) for leaf in self.leaves()]


def merge_sequences(
    sequences: list[list[int]], scores: list[list[float]] | None = None, budget: int | None = None
) -> tuple[TokenTree, list[int]]:
    """Prefix-merge token sequences into a tree; also the node each sequence ends at (ROOT if empty).

    scores: per sequence, the path score after each of its tokens; a shared prefix keeps the first
    sequence's (equal prefixes have equal scores when they come from one model).
    budget: at most this many nodes; a sequence that would add more is cut there (earlier ones win).
    """
    tokens, parents, node_scores, ends = [], [], [], []
    index: dict[tuple[int, ...], int] = {}
    for s, sequence in enumerate(sequences):
        node = ROOT
        for depth, token in enumerate(sequence):
            key = tuple(sequence[: depth + 1])
            if key not in index:
                if budget is not None and len(tokens) >= budget:
                    break
                index[key] = len(tokens)
                tokens.append(token)
                parents.append(node)
                node_scores.append(scores[s][depth] if scores is not None else 0.0)
            node = index[key]
        ends.append(node)
    tree = TokenTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                     torch.tensor(node_scores, dtype=torch.float64) if scores is not None else None)
    return tree, ends


Expand = Callable[[list[int]], tuple[list[int], list[float]]]  # path tokens -> candidates, confidences


def build_tree(expand: Expand, k: int, depth: int, budget: int) -> TokenTree:
    """The `budget` most confident nodes of the K-ary candidate tree, best first (as EAGLE-2 and Sequoia
    grow trees): a node's score is the product of its path's confidences, so a child never outscores
    its parent and every kept node's ancestors are kept too.

    expand(path) gives up to k candidates (best first, confidences in [0, 1]) after the root plus the
    path's tokens: a table's top-K for the path's last tokens, a drafter's top-K, or fixed per-slot
    candidates (Medusa-style: expand(path) = slots[len(path)]). Repeated tokens among one node's
    candidates are dropped. Ties go to the node found first, so the tree is deterministic.
    """
    if k < 1 or depth < 1 or budget < 0:
        raise ValueError(f"a tree needs k >= 1, depth >= 1 and a node budget >= 0, got {k}, {depth}, {budget}")
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    heap: list[tuple[float, int, int, int, list[int]]] = []  # (-log score, order, parent, token, path)
    order = 0

    def push(parent: int, path: list[int], log_score: float) -> None:
        nonlocal order
        candidates, confidences = expand(path)
        seen: set[int] = set()
        for token, confidence in list(zip(candidates, confidences))[:k]:
            if token in seen or confidence <= 0:
                continue
            seen.add(token)
            heapq.heappush(heap, (-(log_score + math.log(confidence)), order, parent, token, path + [token]))
            order += 1

    push(ROOT, [], 0.0)
    while heap and len(tokens) < budget:
        neg, _, parent, token, path = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        scores.append(-neg)
        if len(path) < depth:
            push(len(tokens) - 1, path, -neg)
    return TokenTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                     torch.tensor(scores, dtype=torch.float64))
