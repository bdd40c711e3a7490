"""Tree verification: greedy cases with crafted tokens, agreement with the chain verifiers, and the
exactness of multi-candidate tree sampling measured on a small vocabulary with fixed seeds.

As in test_verify.py, the "model" is Markov (the next-token law depends on the previous token only),
so the exact law of the first two emitted tokens is P[START, a] * P[a, b]. Trees of several shapes
are built from the draft's top-K candidates (deterministic, like a table's), and the first two
tokens' joint histogram must sit within sampling error of that law at every N.
"""

from __future__ import annotations

import pytest
import torch

from runtime.common.sampling import SamplingParams, sample_from, warp
from runtime.drafters.trees import ROOT, TokenTree, build_tree
from runtime.loops.verify import verify_exact, verify_greedy
from runtime.loops.verify_tree import TreeVerdict, verify_tree_exact, verify_tree_greedy
from test_trees import TREE
from test_verify import START, WARPS, V, histogram, markov_pair, tolerance, tv

# --- greedy ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target, path, tokens",
    [
        # rows: root, then after nodes 0..5 (tokens 5 6 7 8 9 3)
        ([5, 7, 1, 3, 1, 1, 4], (0, 2, 5), [5, 7, 3, 4]),  # the deepest path, then the bonus
        ([5, 8, 1, 1, 2, 1, 1], (0, 3), [5, 8, 2]),  # a leaf at depth 2: the bonus after it
        ([6, 1, 2, 1, 1, 1, 1], (1,), [6, 2]),  # second sibling, then a miss under it
        ([4, 5, 6, 7, 8, 9, 3], (), [4]),  # no root child matches: the target's token only
    ],
)
def test_verify_tree_greedy_crafted(target, path, tokens):
    verdict = verify_tree_greedy(TREE, torch.tensor(target))
    assert verdict == TreeVerdict(6, len(path), tokens, path, verdict.at_leaf)
    assert verdict.at_leaf == (bool(path) and path[-1] in TREE.leaves())
    assert verdict.bonus == verdict.at_leaf


def test_verify_tree_greedy_on_chains_is_verify_greedy():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        k = int(torch.randint(0, 6, (1,), generator=gen))
        target = torch.randint(4, (k + 1,), generator=gen)
        draft = torch.where(torch.rand(k, generator=gen) < 0.7, target[:k], torch.randint(4, (k,), generator=gen))
        chain = verify_greedy(target, draft)
        tree = verify_tree_greedy(TokenTree.chain(draft), target)
        assert (tree.drafted, tree.accepted, tree.tokens, tree.bonus) == (chain.drafted, chain.accepted, chain.tokens, chain.bonus)
    empty = verify_tree_greedy(TokenTree.chain([]), torch.tensor([3]))
    assert empty.tokens == [3] and empty.accepted == 0 and empty.bonus


def test_verify_tree_exact_with_one_hot_target_is_greedy():
    gen = torch.Generator().manual_seed(1)
    for _ in range(100):
        logits = torch.randn(TREE.size + 1, 10, generator=gen)  # [N + 1, V]
        logits[:, 5:10] += 3 * torch.rand(1, generator=gen)  # tree tokens 5..9 win sometimes
        p = warp(logits, SamplingParams())
        assert verify_tree_exact(TREE, p, gen) == verify_tree_greedy(TREE, logits.argmax(dim=1))


def test_verify_tree_exact_crafted():
    """Crafted: a sibling with p = 0 is never accepted, p = 1 always, and p is not modified."""
    p = torch.zeros(3, 6)
    p[0, 2], p[0, 4] = 1.0, 0.0  # root: all mass on 2
    p[1:, 1] = 1.0
    tree = TokenTree(torch.tensor([4, 2]), torch.tensor([ROOT, ROOT]))
    before = p.clone()
    for seed in range(20):
        verdict = verify_tree_exact(tree, p, torch.Generator().manual_seed(seed))
        assert verdict.path == (1,) and verdict.tokens == [2, 1]
    assert torch.equal(p, before)
    point_mass = verify_exact(p[:2], None, torch.tensor([2]), torch.Generator().manual_seed(0))
    assert point_mass.tokens == [2, 1]


# --- exactness of tree sampling ---------------------------------------------------------------


def candidate_trees(Q: torch.Tensor, k: int, depth: int, budget: int) -> dict[int, TokenTree]:
    """Per start token, the tree of the draft's top-k candidates (deterministic, confidence = q)."""
    def expand_from(start: int):
        def expand(path: list[int]):
            top = Q[path[-1] if path else start].topk(k)
            keep = top.values > 0
            return top.indices[keep].tolist(), top.values[keep].tolist()
        return expand
    return {s: build_tree(expand_from(s), k, depth, budget) for s in range(Q.shape[0])}


def first_two(n: int, trees: dict[int, TokenTree], P: torch.Tensor, seed: int, verify=verify_tree_exact) -> torch.Tensor:
    """n independent generations of two tokens after START, in as many tree rounds as they take: [n, 2]."""
    gen = torch.Generator().manual_seed(seed)
    rows = {s: P[torch.cat([torch.tensor([s]), tree.tokens])] for s, tree in trees.items()}  # [N + 1, V] each
    out = []
    for _ in range(n):
        tokens = verify(trees[START], rows[START], gen).tokens
        if len(tokens) == 1:
            tokens = tokens + verify(trees[tokens[0]], rows[tokens[0]], gen).tokens
        out.append(tokens[:2])
    return torch.tensor(out)


TREE_CASES = {
    "K2-depth3-budget7-temperature": (2, 3, 7, WARPS["temperature"]),
    "K4-depth4-budget16-top-k": (4, 4, 16, WARPS["top-k"]),
    "K8-depth1-budget8-top-p": (8, 1, 8, WARPS["top-p"]),
    "K8-depth3-budget32-top-k+top-p": (8, 3, 32, WARPS["top-k+top-p"]),
    "K1-chain-low-temperature": (1, 4, 4, WARPS["low-temperature"]),
}
SIZES = (10, 100, 1000, 10_000, 20_000)


def joint(P: torch.Tensor) -> torch.Tensor:
    """Exact law [V * V] of the first two tokens after START."""
    return (P[START][:, None] * P).flatten()


@pytest.mark.parametrize("k, depth, budget, params", TREE_CASES.values(), ids=TREE_CASES.keys())
def test_tree_sampling_follows_the_warped_target(k, depth, budget, params):
    """The first two tokens' joint histogram converges to the warped target's joint law at the
    sampling-error rate, and at the largest N sits far closer to it than to the draft's law."""
    P, Q, _ = markov_pair(params, seed=k)
    trees = candidate_trees(Q, k, depth, budget)
    assert 0 < trees[START].size <= budget
    samples = first_two(SIZES[-1], trees, P, seed=k + depth)
    codes = samples[:, 0] * V + samples[:, 1]
    exact = joint(P)
    distances = [tv(torch.bincount(codes[:n], minlength=V * V).double() / n, exact) for n in SIZES]
    for n, distance in zip(SIZES, distances):
        assert distance < tolerance(exact, n), f"N={n}: TV {distance:.4f} >= {tolerance(exact, n):.4f}"
    assert distances[-1] < distances[0] / 10
    assert distances[-1] < tv(exact, joint(Q)) / 5
    first = histogram(samples[:, 0])
    assert tv(first, P[START]) < tolerance(P[START], SIZES[-1])


def biased_verify(tree: TokenTree, p: torch.Tensor, gen) -> TreeVerdict:
    """A wrong sampler for the power check: rejected siblings are not removed from p afterwards."""
    kids, node, path = tree.children(), ROOT, []
    while True:
        row = p[node + 1]
        accepted = next((c for c in kids.get(node, []) if float(torch.rand(1, generator=gen)) < float(row[tree.tokens[c]])), None)
        if accepted is None:
            return TreeVerdict(tree.size, len(path), tree.tokens[path].tolist() + [sample_from(row, gen)], tuple(path))
        path.append(accepted)
        node = accepted


def test_the_statistical_test_catches_a_biased_sampler():
    k, depth, budget, params = TREE_CASES["K4-depth4-budget16-top-k"]
    P, Q, _ = markov_pair(params, seed=k)
    trees = candidate_trees(Q, k, depth, budget)
    n = SIZES[-1]
    samples = first_two(n, trees, P, seed=3, verify=biased_verify)
    exact = joint(P)
    distance = tv(torch.bincount(samples[:, 0] * V + samples[:, 1], minlength=V * V).double() / n, exact)
    assert distance > 3 * tolerance(exact, n)
