"""Verifiers for token trees (SWARM) and for MJSD's joint acceptance: pure functions to a verdict.

Glossary as in runtime/loops/verify.py (p = target, q = draft; accepted, recovered, bonus). The target
scores [root] + the tree's nodes in one forward, so its rows are N + 1: row 0 is the distribution
after the context (the root's), row i + 1 the distribution after node i's path.

Exact tree sampling. The candidates are chosen deterministically (a table's or a drafter's top-K),
so each sibling's draft probability is 1, not the drafter's confidence. At a node the siblings are
tried in order, x accepted with probability p'(x), where p' is p with the siblings already rejected
zeroed and renormalized; on acceptance the walk descends, and when every sibling is rejected the
token is drawn from what is left of p (EAGLE-2 / SGLang). Why it is exact: the first sibling comes
out with probability p(x1); given its rejection, what remains is p conditioned on "not x1", and so
on, so the emitted token follows p at every step. Using a table's confidence as q instead would
bias the output (it is not the law the candidates were drawn from).

MJSD (Qin et al., "Multi-Token Joint Speculative Decoding") is not distribution-preserving by design:
it keeps the longest prefix of the best beam whose joint likelihood ratio passes a threshold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runtime.common.sampling import sample_from
from runtime.drafters.base import Verdict
from runtime.drafters.trees import ROOT, TokenTree


@dataclass(frozen=True)
class TreeVerdict(Verdict):
    """A verdict on a tree: drafted = its node count, accepted = the accepted path's length."""

    path: tuple[int, ...] = ()  # accepted node indices, root's child first
    at_leaf: bool = False  # the last accepted node has no children (or the tree is empty)

    @property
    def bonus(self) -> bool:
        """The last token came from after the end of a drafted path."""
        return self.at_leaf


def _verdict(tree: TokenTree, path: list[int], last: int, kids: dict[int, list[int]]) -> TreeVerdict:
    tokens = tree.tokens[path].tolist() if path else []
    end = path[-1] if path else ROOT
    return TreeVerdict(tree.size, len(path), tokens + [last], tuple(path), end not in kids)


def verify_tree_greedy(tree: TokenTree, target_tokens) -> TreeVerdict:
    """Follow the target's choices down the tree as far as a child matches, then the target's token.

    target_tokens: the target's greedy token at the root (row 0) and after each node (row i + 1),
    indexable by row: a tensor [N + 1], or a scorer that computes a row when the walk asks for it.
    The walk finds the longest root-to-leaf path prefix equal to the target's own greedy tokens; as
    siblings hold distinct tokens, at most one child can match at each step.
    """
    kids = tree.children()
    tokens = tree.tokens.tolist()
    path: list[int] = []
    node = ROOT
    while True:
        want = int(target_tokens[node + 1])
        match = next((c for c in kids.get(node, []) if tokens[c] == want), None)
        if match is None:
            return _verdict(tree, path, want, kids)
        path.append(match)
        node = match


def verify_tree_exact(tree: TokenTree, p: torch.Tensor, generator: torch.Generator | None) -> TreeVerdict:
    """Sample through the tree so that the appended tokens follow p exactly (see the module docstring).

    p: [N + 1, V] warped target probabilities, row 0 the root's, row i + 1 after node i.
    """
    kids = tree.children()
    tokens = tree.tokens.tolist()
    path: list[int] = []
    node = ROOT
    while True:
        row = p[node + 1]  # [V]
        left, total = row, float(row.double().sum())  # what is left of p here, unnormalized
        accepted = None
        for child in kids.get(node, []):
            x = tokens[child]
            mass = float(left[x])
            # Accept with probability mass / total, written without the division.
            if float(torch.rand(1, generator=generator, dtype=torch.float64)) * total < mass:
                accepted = child
                break
            if mass > 0:
                if left is row:  # copy before the first change: p is the caller's
                    left = row.double().clone()
                left[x] = 0.0
                total = float(left.sum())
        if accepted is None:
            # Every sibling rejected (or none): draw from what is left; if rounding cancelled all of
            # it (the siblings held all of p's mass to the last bit), p itself is the right law.
            return _verdict(tree, path, sample_from(left if total > 0 else row, generator), kids)
        path.append(accepted)
        node = accepted


def verify_joint(
    p: torch.Tensor, logq: torch.Tensor, draft: torch.Tensor, tau: float, generator: torch.Generator | None
) -> Verdict:
    """MJSD's acceptance (Algorithm 1 of the paper): keep the longest draft prefix x_{1:j} whose joint
    ratio min(1, p(x_{1:j}) / q(x_{1:j})) is strictly above tau, then one token drawn from p after it.

    p: [k + 1, V] target probabilities along the draft (row i after draft[:i]), warped as the caller
    chooses (the paper warps p and q with top-20 then top-p 0.9; a greedy one-hot p makes this
    verify_greedy); logq: [k] the drafter's joint log q(x_{1:j}) for j = 1..k (cumulative); draft: [k].
    The test is on every prefix, not up to the first failure: a prefix can fail and a longer one
    pass, and the longest passing one is kept, as in the paper's pseudocode. Not distribution-preserving.
    """
    if not 0.0 <= tau < 1.0:
        raise ValueError(f"MJSD's tau is in [0, 1), got {tau}")
    k = draft.numel()
    rows = torch.arange(k)
    logp = torch.log(p[rows, draft].double()).cumsum(0)  # [k] joint log p(x_{1:j})
    # min(1, r) > tau  <=>  r > tau for tau < 1; in logs, tau = 0 rejects only p(x_{1:j}) = 0.
    passed = (logp - logq.double() > (math.log(tau) if tau > 0 else -math.inf)).nonzero()
    accepted = int(passed[-1]) + 1 if passed.numel() else 0
    return Verdict(k, accepted, draft[:accepted].tolist() + [sample_from(p[accepted], generator)])


def verify_joint_tree(
    tree: TokenTree, p: torch.Tensor, leaf: int, tau: float, generator: torch.Generator | None
) -> TreeVerdict:
    """verify_joint on the path of one tree node (MJSD's best beam) in a tree the target scored whole.

    tree.scores: the joint log q of every node's path; p: [N + 1, V] as for verify_tree_exact.
    """
    if tree.scores is None:
        raise ValueError("verify_joint_tree needs the tree's joint log q per node (tree.scores)")
    path = tree.path(leaf)
    rows = torch.tensor([0] + [n + 1 for n in path])
    verdict = verify_joint(p[rows], tree.scores[path], tree.tokens[path], tau, generator)
    kept = path[: verdict.accepted]
    return _verdict(tree, kept, verdict.tokens[-1], tree.children())
