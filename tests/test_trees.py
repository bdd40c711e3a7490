"""Token trees: structure (depths, positions, ancestor masks, paths), prefix merging, and best-first
building under a node budget against brute-force enumeration."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from runtime.drafters.trees import ROOT, TokenTree, build_tree, merge_sequences

#        root
#       /    \
#     0:5    1:6
#    /   \     \
#  2:7   3:8   4:9
#   |
#  5:3
TREE = TokenTree(torch.tensor([5, 6, 7, 8, 9, 3]), torch.tensor([-1, -1, 0, 0, 1, 2]))


def brute_ancestors(tree: TokenTree, i: int) -> set[int]:
    parents, out = tree.parents.tolist(), {i}
    while parents[i] != ROOT:
        i = parents[i]
        out.add(i)
    return out


def test_structure_of_a_crafted_tree():
    assert TREE.size == 6
    assert TREE.depths().tolist() == [1, 1, 2, 2, 2, 3]
    assert TREE.positions(10).tolist() == [11, 11, 12, 12, 12, 13]
    mask = TREE.ancestor_mask()
    assert mask.shape == (6, 6)
    for i in range(6):
        assert set(mask[i].nonzero().flatten().tolist()) == brute_ancestors(TREE, i)
    full = TREE.ancestor_mask(with_root=True)
    assert full.shape == (7, 7) and full[:, 0].all() and torch.equal(full[1:, 1:], mask) and not full[0, 1:].any()
    assert TREE.children() == {ROOT: [0, 1], 0: [2, 3], 1: [4], 2: [5]}
    assert TREE.leaves() == [3, 4, 5]
    assert TREE.path(5) == [0, 2, 5] and TREE.path(ROOT) == []
    assert TREE.paths() == [[0, 3], [1, 4], [0, 2, 5]]


def test_chain_is_a_causal_tree():
    chain = TokenTree.chain([4, 4, 2])
    assert chain.parents.tolist() == [-1, 0, 1] and chain.depths().tolist() == [1, 2, 3]
    assert torch.equal(chain.ancestor_mask(), torch.ones(3, 3, dtype=torch.bool).tril())
    assert chain.paths() == [[0, 1, 2]]
    empty = TokenTree.chain([])
    assert empty.size == 0 and empty.leaves() == [] and empty.ancestor_mask(with_root=True).shape == (1, 1)


@pytest.mark.parametrize("parents", [[0, -1], [-1, 1], [-2, -1], [-1]])
def test_bad_parents_are_refused(parents):
    with pytest.raises(ValueError):
        TokenTree(torch.tensor([1, 2]), torch.tensor(parents))


def test_merge_sequences_shares_prefixes():
    beams = [[1, 2, 3], [1, 2, 4], [1, 5, 6], [7]]
    scores = [[-0.1, -0.3, -0.6], [-0.1, -0.3, -0.9], [-0.1, -1.0, -1.2], [-2.0]]
    tree, ends = merge_sequences(beams, scores)
    assert tree.size == 7  # distinct prefixes: 1, 12, 123, 124, 15, 156, 7
    for beam, end, score in zip(beams, ends, scores):
        assert tree.tokens[tree.path(end)].tolist() == beam
        assert tree.scores[tree.path(end)].tolist() == score
    assert merge_sequences([[]])[1] == [ROOT]


def test_merge_sequences_cuts_later_sequences_at_the_budget():
    tree, ends = merge_sequences([[1, 2, 3], [1, 2, 4, 5], [6, 7], [1, 2]], budget=5)
    assert tree.size == 5  # 1, 12, 123, 124, 1245: the third sequence's 6 would be a sixth node
    assert [tree.tokens[tree.path(end)].tolist() if end != ROOT else [] for end in ends] == [[1, 2, 3], [1, 2, 4, 5], [], [1, 2]]
    assert merge_sequences([[1, 2, 3], [4]], budget=2)[0].tokens.tolist() == [1, 2]


def random_expand(k: int, seed: int):
    """Candidates after any path: k tokens with distinct pseudo-random confidences (a function of the path)."""
    def expand(path: list[int]) -> tuple[list[int], list[float]]:
        gen = torch.Generator().manual_seed(hash((seed, tuple(path))) % 2**31)
        conf = torch.rand(k, generator=gen, dtype=torch.float64).sort(descending=True).values
        return list(range(10, 10 + k)), conf.tolist()
    return expand


@pytest.mark.parametrize("k, depth, budget", [(2, 3, 5), (2, 4, 16), (4, 3, 16), (8, 2, 32), (4, 5, 32), (8, 3, 16)])
def test_build_tree_keeps_the_budget_best_paths(k, depth, budget):
    expand = random_expand(k, seed=k * 100 + budget)
    tree = build_tree(expand, k, depth, budget)
    # Brute force: every path of the full K-ary tree to `depth`, scored by its product of confidences.
    scored = {}
    for d in range(1, depth + 1):
        for path in itertools.product(range(k), repeat=d):
            tokens = [10 + i for i in path]
            scored[tuple(tokens)] = sum(math.log(expand(tokens[:j])[1][path[j]]) for j in range(d))
    best = sorted(scored, key=lambda t: -scored[t])[:budget]
    got = {tuple(tree.tokens[tree.path(i)].tolist()): float(tree.scores[i]) for i in range(tree.size)}
    assert tree.size == min(budget, len(scored))
    assert set(got) == set(best)
    assert all(got[t] == pytest.approx(scored[t]) for t in got)
    assert int(tree.depths().max()) <= depth
    # Siblings hold distinct tokens; every node's path is in the tree (parents listed first).
    for kids in tree.children().values():
        tokens = tree.tokens[kids].tolist()
        assert len(set(tokens)) == len(tokens)


def test_build_tree_from_fixed_slots_and_repeats():
    slots = [([3, 4, 3], [0.6, 0.3, 0.1]), ([5, 6], [0.9, 0.1])]  # a repeated 3 is dropped
    tree = build_tree(lambda path: slots[len(path)], k=3, depth=2, budget=10)
    paths = sorted(tuple(tree.tokens[p].tolist()) for p in tree.paths())
    assert paths == [(3, 5), (3, 6), (4, 5), (4, 6)]
    assert tree.size == 6
    assert build_tree(lambda path: ([], []), k=2, depth=3, budget=8).size == 0
    with pytest.raises(ValueError):
        build_tree(lambda path: slots[0], k=0, depth=2, budget=4)
