"""MJSD: joint-likelihood acceptance on crafted distributions (the paper's Algorithm 1: the longest
passing prefix, strict threshold), its greedy limit, and beam drafts against brute force."""

from __future__ import annotations

import itertools

import pytest
import torch

from runtime.common.sampling import SamplingParams, warp
from runtime.drafters.beam import beam_search
from runtime.drafters.trees import ROOT
from runtime.loops.verify import verify_greedy
from runtime.loops.verify_tree import verify_joint, verify_joint_tree

V = 6


def rows(*dists: dict[int, float]) -> torch.Tensor:
    """Probability rows [n, V] from {token: probability} (the rest of the mass on token 0)."""
    out = torch.zeros(len(dists), V, dtype=torch.float64)
    for i, d in enumerate(dists):
        for t, v in d.items():
            out[i, t] = v
        out[i, 0] += 1.0 - sum(d.values())
    return out


def joint_log(*q: float) -> torch.Tensor:
    """Cumulative joint log q [k] from per-token draft probabilities."""
    return torch.tensor(q, dtype=torch.float64).log().cumsum(0)


def test_longest_passing_prefix_not_the_first_failure():
    draft = torch.tensor([1, 2, 3])
    # p per token 0.2, 0.9, 0.9 against q 0.8, 0.2, 0.5: joint ratios 0.25, 1.125, 2.025.
    p = rows({1: 0.2}, {2: 0.9}, {3: 0.9}, {4: 1.0})
    logq = joint_log(0.8, 0.2, 0.5)
    verdict = verify_joint(p, logq, draft, tau=0.5, generator=None)
    assert verdict.accepted == 3 and verdict.tokens == [1, 2, 3, 4]  # prefix 1 fails, 1:2 and 1:3 pass
    # A chain verifier would stop at the first token; with tau 0.2 every prefix passes.
    assert verify_joint(p, logq, draft, tau=0.2, generator=None).accepted == 3
    # Ratios 0.25, 1.125, then 0.0225 with p(x3) = 0.009: the longest passing prefix is 2.
    p_low = rows({1: 0.2}, {2: 0.9}, {3: 0.009}, {5: 1.0})
    verdict = verify_joint(p_low, logq, draft, tau=0.5, generator=None)
    assert verdict.accepted == 2 and verdict.tokens == [1, 2, 0]  # the next token from p after x_{1:2}


def test_threshold_is_strict_and_in_range():
    draft = torch.tensor([1])
    p = rows({1: 0.5}, {2: 1.0})
    logq = joint_log(1.0)
    assert verify_joint(p, logq, draft, tau=0.5, generator=None).accepted == 0  # ratio 0.5 is not > 0.5
    assert verify_joint(p, logq, draft, tau=0.49, generator=None).accepted == 1
    zero = rows({}, {2: 1.0})  # p(x1) = 0: fails even tau = 0
    assert verify_joint(zero, logq, draft, tau=0.0, generator=None).accepted == 0
    for tau in (-0.1, 1.0):
        with pytest.raises(ValueError, match="tau"):
            verify_joint(p, logq, draft, tau=tau, generator=None)
    empty = verify_joint(p[:1], torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.long), 0.5, None)
    assert empty.accepted == 0 and len(empty.tokens) == 1 and empty.tokens[0] in (0, 1)


def test_one_hot_target_makes_it_greedy_verification():
    """Under greedy warping p is one-hot: p(x_{1:j}) is 1 up to the first mismatch and 0 after, so
    the longest passing prefix is the longest matching one, whatever q and tau are."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        k = int(torch.randint(1, 6, (1,), generator=gen))
        logits = torch.randn(k + 1, V, generator=gen)
        target = logits.argmax(dim=1)
        draft = torch.where(torch.rand(k, generator=gen) < 0.7, target[:k], torch.randint(V, (k,), generator=gen))
        logq = torch.rand(k, generator=gen, dtype=torch.float64).log().cumsum(0)
        tau = float(torch.rand(1, generator=gen)) * 0.99
        assert verify_joint(warp(logits, SamplingParams()), logq, draft, tau, gen) == verify_greedy(target, draft)


def markov_log_q(seed: int = 0, vocab: int = 5) -> torch.Tensor:
    """A drafter whose next-token law depends on the previous token: log q [vocab, vocab]."""
    return torch.log_softmax(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * 2, dim=1)


def scorer(log_q: torch.Tensor, start: int):
    """next_log_probs for beam_search over the Markov drafter after context [..., start]."""
    return lambda prefixes: torch.stack([log_q[p[-1] if p else start] for p in prefixes])  # [B, V]


def reference_beams(log_q: torch.Tensor, start: int, width: int, gamma: int) -> list[tuple[float, list[int]]]:
    """Textbook beam search: all extensions of all beams, keep the width best by joint log q."""
    beams = [(0.0, [])]
    for _ in range(gamma):
        ext = [(s + float(log_q[b[-1] if b else start, t]), b + [t]) for s, b in beams for t in range(log_q.shape[1])]
        beams = sorted(ext, key=lambda e: -e[0])[:width]
    return beams


@pytest.mark.parametrize("width, gamma", [(1, 4), (2, 3), (4, 4), (3, 2)])
def test_beam_search_matches_the_textbook_search(width, gamma):
    log_q = markov_log_q(seed=width)
    draft = beam_search(scorer(log_q, start=1), width, gamma)
    expected = reference_beams(log_q, 1, width, gamma)
    assert draft.beams == [b for _, b in expected]
    assert draft.log_q == pytest.approx([s for s, _ in expected])
    tree = draft.tree
    for beam, end, total in zip(draft.beams, draft.ends, draft.log_q):
        path = tree.path(end)
        assert tree.tokens[path].tolist() == beam and float(tree.scores[end]) == pytest.approx(total)
        # Per node: the joint log q of its own prefix.
        running = 0.0
        for node, (prev, token) in zip(path, zip([1] + beam, beam)):
            running += float(log_q[prev, token])
            assert float(tree.scores[node]) == pytest.approx(running)
    prefixes = {tuple(b[:d]) for b in draft.beams for d in range(1, gamma + 1)}
    assert tree.size == len(prefixes)  # prefix-merged
    if width == 1:  # a greedy chain
        chain, prev = [], 1
        for _ in range(gamma):
            prev = int(log_q[prev].argmax())
            chain.append(prev)
        assert draft.beams == [chain]


def test_exhaustive_beam_finds_the_most_likely_sequence():
    log_q = markov_log_q(seed=7, vocab=4)
    gamma = 3
    best = max(itertools.product(range(4), repeat=gamma),
               key=lambda s: sum(float(log_q[a, b]) for a, b in zip((2,) + s, s)))
    draft = beam_search(scorer(log_q, start=2), width=4**gamma, gamma=gamma)
    assert tuple(draft.beams[0]) == best and draft.tree.tokens[draft.tree.path(draft.best)].tolist() == list(best)


def test_verify_joint_tree_follows_the_best_beam():
    log_q = markov_log_q(seed=3)
    draft = beam_search(scorer(log_q, start=0), width=3, gamma=3)
    tree = draft.tree
    # The target agrees with the drafter exactly: every prefix has ratio 1 > tau, all of it is kept.
    p = torch.stack([log_q[0]] + [log_q[int(t)] for t in tree.tokens]).exp()  # [N + 1, V]
    verdict = verify_joint_tree(tree, p, draft.best, tau=0.5, generator=torch.Generator().manual_seed(0))
    assert list(verdict.path) == tree.path(draft.best) and verdict.tokens[:3] == draft.beams[0]
    assert verdict.drafted == tree.size and verdict.at_leaf
    # A target that gives the best beam's first token probability 0 keeps nothing of it.
    p[0, draft.beams[0][0]] = 0.0
    verdict = verify_joint_tree(tree, p, draft.best, tau=0.1, generator=torch.Generator().manual_seed(0))
    assert verdict.path == () and verdict.accepted == 0 and verdict.tokens[0] != draft.beams[0][0]
    assert not verdict.at_leaf and ROOT in tree.children()
    with pytest.raises(ValueError, match="width"):
        beam_search(scorer(log_q, 0), width=0)
