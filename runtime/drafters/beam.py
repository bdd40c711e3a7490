"""MJSD's drafts: beam search of width M over gamma tokens in a drafter, the beams merged into a token tree.

MJSD (Qin et al.) drafts with beam decoding because it approximates the most likely continuation
under the drafter's joint q(x_{1:gamma}) better than a greedy chain, then verifies by joint
likelihood (runtime.loops.verify_tree.verify_joint). It is NOT distribution-preserving by design: the
output follows neither p nor its greedy choices; it trades that for output perplexity. Never count
it among the exact methods.

The search is deterministic (the paper's pseudocode names a beam *sample*; its experiments keep 8
beams and gamma 4): at each step every beam's M best next tokens are scored by the joint log q of
the extended prefix and the M best extensions overall survive (ties: the earlier beam, then the
smaller token id).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from runtime.drafters.trees import TokenTree, merge_sequences

# Given B prefixes (draft tokens after the context; [] = the context itself), the drafter's
# next-token log-probabilities after each: [B, V].
NextLogProbs = Callable[[list[list[int]]], torch.Tensor]


@dataclass(frozen=True)
class BeamDraft:
    """The beams as a prefix-merged tree (scores: joint log q per node) and where each beam ends."""

    tree: TokenTree
    beams: list[list[int]]  # best first
    log_q: list[float]  # joint log q of each beam, best first
    ends: list[int]  # the tree node each beam ends at

    @property
    def best(self) -> int:
        """The tree node the best beam ends at (what MJSD verifies)."""
        return self.ends[0]


def beam_search(next_log_probs: NextLogProbs, width: int = 4, gamma: int = 4) -> BeamDraft:
    """Width-M beam search over gamma draft tokens; one next_log_probs call per step (batched over beams)."""
    if width < 1 or gamma < 1:
        raise ValueError(f"beam drafts need width >= 1 and gamma >= 1, got {width} and {gamma}")
    beams: list[list[int]] = [[]]
    totals = torch.zeros(1, dtype=torch.float64)  # [B] joint log q of each beam
    steps: list[list[float]] = [[]]  # per beam, the joint log q after each of its tokens
    for _ in range(gamma):
        log_q = next_log_probs(beams).double()  # [B, V]
        if log_q.shape[0] != len(beams):
            raise ValueError(f"next_log_probs returned {log_q.shape[0]} rows for {len(beams)} prefixes")
        top = log_q.topk(min(width, log_q.shape[1]), dim=1)  # per beam, its M best next tokens
        score = totals[:, None] + top.values  # [B, M]
        beam = torch.arange(len(beams))[:, None].expand_as(score).flatten()
        token, score = top.indices.flatten(), score.flatten()
        # Candidates come beam by beam, tokens ascending within equal scores after this sort, so the
        # stable sort on the score breaks ties by earlier beam, then smaller token.
        order = torch.argsort(token, stable=True)
        order = order[torch.argsort(beam[order], stable=True)]
        order = order[torch.argsort(-score[order], stable=True)]
        keep = [int(i) for i in order if torch.isfinite(score[i])][:width]
        if not keep:
            break
        beams = [beams[int(beam[i])] + [int(token[i])] for i in keep]
        steps = [steps[int(beam[i])] + [float(score[i])] for i in keep]
        totals = score[keep]
    tree, ends = merge_sequences(beams, steps)
    return BeamDraft(tree, beams, totals.tolist(), ends)
