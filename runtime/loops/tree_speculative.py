"""SWARM: token-tree speculative decoding. A drafter's top-K candidates per slot form a token tree under
a node budget; the target scores the last token and every node in one tree forward; the verifier keeps
the longest path the target agrees with (greedy) or samples through the tree exactly; the target's
cache is compacted to the kept path.

Greedy outputs equal generate_ar's token for token; sampled outputs follow the warped target exactly
(runtime.loops.verify_tree: the candidates are deterministic, so each sibling is tried at p, never at the
drafter's confidence). The loop skeleton (prefill, EOS, stop strings, stats) is runtime.loops.rounds'.

Tree sources (runtime.drafters.base.TreeDrafter), each beside the drafter it reads:
- TableTrees (runtime.drafters.onedecode): the OneDecode table's top-K at every node (the GP paper's OTT-SWARM);
- LookupTrees (runtime.drafters.lookup): the session lookup drafter's K best distinct continuations (no model);
- SlotTrees (runtime.drafters.layers): any backend drafter's (int8, layers:N, gp, model:) top-K per slot
  along its own greedy chain, Medusa-style: every node at depth d gets the candidates of the chain's slot d;
- EagleTrees (runtime.drafters.eagle_trees): EAGLE-2's dynamic trees over the trained draft head, each
  level's K best-scored nodes expanded in one head step.
"""

from __future__ import annotations

import time

import torch

from runtime.common.sampling import SamplingParams, TokenBan, mask_banned, select_allowed, warp
from runtime.drafters.base import TreeDrafter
from runtime.kernels import SKINNY_MAX_ROWS
from runtime.loops.decode import TokenStream, drive
from runtime.loops.rounds import Round, stream_rounds
from runtime.loops.speculative import DEFAULT_GAMMA
from runtime.common.stats import DecodeStats, SpecStats
from runtime.text.stopping import StopStrings
from runtime.backends.base import TargetModel
from runtime.drafters.trees import ROOT, TokenTree
from runtime.loops.verify_tree import TreeVerdict, verify_tree_exact, verify_tree_greedy

MAX_DEPTH = 8  # tree depth (gamma) stays in 1..MAX_DEPTH, as chain drafts do
MAX_NODES = 64


def drop_banned_nodes(tree: TokenTree, ban: TokenBan, start: int) -> TokenTree:
    """The tree without nodes holding a banned id at a guarded position (and their subtrees).

    start: the position of the root's children (the context's length). Candidates are deterministic,
    so leaving some out keeps verification exact.
    """
    if not ban.ids or ban.rows(start, 1) == 0 or tree.size == 0:
        return tree
    depths, parents, tokens = tree.depths().tolist(), tree.parents.tolist(), tree.tokens.tolist()
    index: dict[int, int] = {}
    for node in range(tree.size):
        parent = parents[node]
        if (parent != ROOT and parent not in index) or (tokens[node] in ban.ids and start + depths[node] - 1 < ban.until):
            continue
        index[node] = len(index)
    kept = list(index)
    return TokenTree(tree.tokens[kept], torch.tensor([ROOT if parents[n] == ROOT else index[parents[n]] for n in kept],
                                                     dtype=torch.long),
                     None if tree.scores is None else tree.scores[kept])


def score_tree(target: TargetModel, cache, last: int, tree: TokenTree) -> torch.Tensor:
    """One tree forward over [last] + the tree's nodes after the cache (which holds the context but its
    last token): hidden states [N + 1, d], row 0 the root's, row i + 1 node i's."""
    parents = torch.cat([torch.tensor([ROOT]), torch.where(tree.parents == ROOT, 0, tree.parents + 1)])  # [N + 1]
    return target.forward_tree(torch.cat([torch.tensor([last]), tree.tokens]), parents, cache)


class GreedyRows:
    """The target's greedy token per tree row (0: the root, i + 1: node i), scored when the walk asks.

    Asked for a row, the head scores it together with its first-child chain (the drafter's top-1
    continuation, the walk's likeliest way down) in one call, so a greedy walk costs head rows for
    the path it takes, not for every node. The rows of a call lie on one path, in position order,
    so the EOS-guarded ones lead as select_allowed expects; at most SKINNY_MAX_ROWS per call, so
    every row gets the bits a one-token step gets.
    """

    def __init__(self, head, hidden: torch.Tensor, tree: TokenTree, params: SamplingParams, ban: TokenBan,
                 start: int) -> None:
        self.head, self.hidden, self.params, self.ban = head, hidden, params, ban  # hidden [N + 1, d]
        self.positions = [start] + (start + tree.depths()).tolist()  # [N + 1]
        self.first_child: dict[int, int] = {}
        for node, parent in enumerate(tree.parents.tolist()):
            self.first_child.setdefault(parent + 1, node + 1)
        self.chosen: dict[int, int] = {}

    def __getitem__(self, row: int) -> int:
        if row not in self.chosen:
            rows = [row]
            while rows[-1] in self.first_child and len(rows) < SKINNY_MAX_ROWS:
                rows.append(self.first_child[rows[-1]])
            guarded = sum(self.positions[r] < self.ban.until for r in rows) if self.ban.ids else 0
            tokens = select_allowed(self.head, self.hidden[rows], self.params, None, self.ban.ids, guarded)  # [len(rows)]
            self.chosen.update(zip(rows, tokens.tolist()))
        return self.chosen[row]


def verify_scored_tree(head, hidden: torch.Tensor, tree: TokenTree, params: SamplingParams,
                       generator: torch.Generator | None, ban: TokenBan, start: int) -> TreeVerdict:
    """Greedy or exact verification of a tree from its target hidden states [N + 1, d].

    Greedy scores only the rows its walk reaches (GreedyRows). Sampling scores every row: the EOS
    guard covers rows by position (row 0 at `start`, node i's row at start + depth(i)), so the rows
    go to the head in position order, the guarded ones leading as select_allowed expects, and in
    chunks of SKINNY_MAX_ROWS, so every row's logits are the bits a one-token step gets.
    """
    if params.greedy:
        return verify_tree_greedy(tree, GreedyRows(head, hidden, tree, params, ban, start))
    positions = torch.cat([torch.tensor([start]), start + tree.depths()])  # [N + 1]
    order = torch.argsort(positions, stable=True)
    guarded = int((positions < ban.until).sum()) if ban.ids else 0
    chunks = list(zip(range(0, order.numel(), SKINNY_MAX_ROWS), hidden[order].split(SKINNY_MAX_ROWS)))
    p = torch.cat([warp(mask_banned(head.logits(rows), ban.ids, max(guarded - offset, 0)), params)
                   for offset, rows in chunks])  # [N + 1, V], position order
    return verify_tree_exact(tree, p[torch.argsort(order)], generator)


def generate_tree(*args, **kwargs) -> tuple[list[int], DecodeStats]:
    """stream_tree (same arguments) run to its end: the new tokens and the stats."""
    return drive(stream_tree(*args, **kwargs))


def stream_tree(
    target: TargetModel,
    head,
    drafter: TreeDrafter,
    prompt: torch.Tensor,
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    depth: int = DEFAULT_GAMMA,
    budget: int = 16,
    min_new_tokens: int = 0,
    stop: StopStrings | None = None,
) -> TokenStream:
    """Token-tree speculative decoding: trees of at most `budget` nodes and `depth` levels per target forward.

    Arguments and stream as runtime.loops.speculative.stream_speculative. In the stats a round's
    `drafted` is its tree's node count (gamma_mean: the mean tree size) and `accepted` the kept path's
    length; T_D is per drafted node, T_V per tree forward.
    """
    if not 1 <= depth <= MAX_DEPTH or not 1 <= budget <= MAX_NODES:
        raise ValueError(f"a token tree needs depth (gamma) in 1..{MAX_DEPTH} and a node budget in 1..{MAX_NODES}, "
                         f"got {depth} and {budget}")

    def begin(cache, ban: TokenBan, spec: SpecStats) -> Round:
        drafter.reset(prompt.tolist(), params, generator, ban)

        def one_round(context: list[int], left: int) -> TreeVerdict:
            t0 = time.perf_counter()
            levels = min(depth, left - 1)
            tree = drafter.tree(context, levels, budget) if levels > 0 else TokenTree.chain([])
            tree = drop_banned_nodes(tree, ban, len(context))
            t1 = time.perf_counter()
            hidden = score_tree(target, cache, context[-1], tree)  # [N + 1, d]
            verdict = verify_scored_tree(head, hidden, tree, params, generator, ban, len(context))
            target.compact(cache, len(context) - 1, [0] + [node + 1 for node in verdict.path])
            t2 = time.perf_counter()
            drafter.observe(verdict)
            spec.seconds_draft += (t1 - t0) + (time.perf_counter() - t2)
            spec.seconds_verify += t2 - t1
            return verdict

        return one_round

    return stream_rounds(target, head, prompt, max_new_tokens, params, generator, begin, min_new_tokens, stop, drafter)
