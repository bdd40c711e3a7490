"""EAGLE-2's dynamic draft trees over the trained head (`swarm:eagle:K`).

Per round the head catches up on the verified positions (EagleDrafter.catch_up), then grows the
tree a level at a time: the root's K best tokens are level 1; each next level expands the K nodes
of the level before with the best path scores (the product of the head's probabilities along the
path, EAGLE-2's confidence) in one head step over K rows, each row seeing the verified prefix, its
ancestors and itself in the head's KV cache; each expanded node proposes its K best tokens. After
`depth` levels the tree keeps the `budget` best-scored nodes of all it proposed (a child never
outscores its parent, so the kept nodes' ancestors are kept). The head's cache is cropped back to
the verified prefix after the round.

Drafts are deterministic candidates, so the tree verifier stays exact (runtime.loops.verify_tree):
greedy decoding gives plain decoding's tokens, and sampling follows the target.
"""

from __future__ import annotations

import torch

from runtime.backends.rows import Rows
from runtime.common.sampling import NO_BAN
from runtime.drafters.base import Verdict
from runtime.drafters.eagle import EagleDrafter
from runtime.drafters.trees import ROOT, TokenTree


class Candidates:
    """The nodes a round proposed: token, parent (ROOT or an earlier node) and path score each."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []

    def add(self, parent: int, ids: list[int], probs: list[float]) -> list[int]:
        """Hang the tokens `ids` (head probabilities `probs`) under `parent`; the new nodes' indices."""
        score = 1.0 if parent == ROOT else self.scores[parent]
        new = []
        for token, prob in zip(ids, probs):
            if prob > 0:
                new.append(len(self.tokens))
                self.tokens.append(token)
                self.parents.append(parent)
                self.scores.append(score * prob)
        return new

    def ancestors(self, node: int) -> list[int]:
        """The node's ancestors, nearest first (the root not counted)."""
        out = []
        while (node := self.parents[node]) != ROOT:
            out.append(node)
        return out

    def best(self, budget: int) -> TokenTree:
        """The `budget` best-scored nodes as a tree, parents first. Ties go to the earlier node, and a
        child never outscores its parent, so every kept node's ancestors are kept."""
        kept = sorted(sorted(range(len(self.tokens)), key=lambda node: (-self.scores[node], node))[:budget])
        index = {node: i for i, node in enumerate(kept)}
        return TokenTree(torch.tensor([self.tokens[n] for n in kept], dtype=torch.long),
                         torch.tensor([ROOT if self.parents[n] == ROOT else index[self.parents[n]] for n in kept],
                                      dtype=torch.long),
                         torch.log(torch.tensor([self.scores[n] for n in kept], dtype=torch.float64)))


class EagleTrees:
    """A TreeDrafter growing EAGLE-2's confidence-ranked trees with an EagleDrafter's head."""

    def __init__(self, drafter: EagleDrafter, k: int) -> None:
        self.drafter, self.k = drafter, k

    def follow(self, cache) -> None:
        """Read the features of the target cache `cache` (the loop calls this before its prefill)."""
        self.drafter.follow(cache)

    def reset(self, prompt, params, generator, ban=NO_BAN) -> None:
        self.drafter.reset(prompt, params, generator, ban)

    @torch.inference_mode()
    def tree(self, context: list[int], depth: int, budget: int) -> TokenTree:
        drafter = self.drafter
        if drafter.cache is None or len(context) < 2 or budget < 1:
            return TokenTree.chain([])
        drafter.catch_up(context)
        head, fed = drafter.head, drafter.fed
        nodes = Candidates()
        ids, probs = head.top_k(drafter.out, drafter.embed, self.k)
        frontier = nodes.add(ROOT, ids[0], probs[0])
        outs: dict[int, torch.Tensor] = {ROOT: drafter.out}  # each expanded node's head output [1, d]
        rows: dict[int, int] = {}  # each expanded node's head cache row
        for level in range(1, depth):
            expand = sorted(frontier, key=lambda node: (-nodes.scores[node], node))[: self.k]
            first = head.length
            for i, node in enumerate(expand):
                rows[node] = first + i
            # Each node sees the verified prefix, then its path's rows, root side first (slots fed + j).
            paths = [[rows[a] - fed for a in reversed(nodes.ancestors(node))] + [rows[node] - fed] for node in expand]
            embeds = drafter.target.embedding_rows(torch.tensor([nodes.tokens[node] for node in expand]))  # [n, d]
            hidden = torch.cat([outs[nodes.parents[node]] for node in expand])  # [n, d]
            stepped = head.step(embeds, hidden, Rows(first, len(expand), fed, paths))  # [n, d]
            ids, probs = head.top_k(stepped, embeds, self.k)
            frontier = []
            for i, node in enumerate(expand):
                outs[node] = stepped[i : i + 1]
                frontier += nodes.add(node, ids[i], probs[i])
        head.crop(fed)
        return nodes.best(budget)

    def observe(self, verdict: Verdict) -> None:
        """Nothing to learn: the next tree catches up on the kept path."""
