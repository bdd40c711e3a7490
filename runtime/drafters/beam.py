"""MJSD's drafts: beam search of width M over gamma tokens in a drafter, the beams merged into a token tree.

MJSD (Qin et al.) drafts with beam decoding because it approximates the most likely continuation
under the drafter's joint q(x_{1:gamma}) better than a greedy chain, then verifies by joint
likelihood (runtime.loops.verify_tree.verify_joint). It is NOT distribution-preserving by design: the
output follows neither p nor its greedy choices; it trades that for output perplexity. Never count
it among the exact methods.

The search is deterministic (the paper's pseudocode names a beam *sample*; its experiments keep 8
beams and gamma 4): at each step every beam's M best next tokens are scored by the joint log q of
the extended prefix and the M best extensions overall survive (ties: the earlier beam, then the
smaller token id). BeamDrafts runs it in a backend drafter: the BeamDrafter (runtime.drafters.base)
the MJSD loop takes.
"""

from __future__ import annotations

from typing import Callable

import torch

from runtime.common.sampling import NO_BAN, SamplingParams, TokenBan, joint_probs, mask_banned
from runtime.drafters.base import BeamDraft
from runtime.drafters.layers import BackendDrafter
from runtime.drafters.trees import merge_sequences

# Given B prefixes (draft tokens after the context; [] = the context itself), the drafter's
# next-token log-probabilities after each: [B, V].
NextLogProbs = Callable[[list[list[int]]], torch.Tensor]
DEFAULT_WIDTH = 4  # beams kept per step (M)


def beam_search(next_log_probs: NextLogProbs, width: int = DEFAULT_WIDTH, gamma: int = 4) -> BeamDraft:
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


class BeamDrafts:
    """A BeamDrafter over a backend drafter; its cache keeps the best beam's fed prefix after a search."""

    def __init__(self, drafter: BackendDrafter, width: int = DEFAULT_WIDTH) -> None:
        if width < 1:
            raise ValueError(f"MJSD needs a beam width >= 1, got {width}")
        self.drafter, self.width = drafter, width
        self.params, self.ban = SamplingParams(), NO_BAN

    def reset(self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None,
              ban: TokenBan = NO_BAN) -> None:
        self.params, self.ban = params, ban
        self.drafter.reset(prompt, params, generator, ban)

    @torch.inference_mode()
    def draft(self, context: list[int], gamma: int) -> BeamDraft:
        """Width-M beam search over gamma tokens after `context` (one drafter tree forward per step)."""
        drafter = self.drafter
        hidden = {(): drafter.sync(context)[0]}  # prefix -> the drafter's hidden state [d] after it
        start = drafter.cache.length
        nodes: dict[tuple[int, ...], int] = {}  # prefix -> its node in the drafter's tree
        parents: list[int] = []

        def next_log_probs(beams: list[list[int]]) -> torch.Tensor:
            new = [tuple(beam) for beam in beams if tuple(beam) not in hidden]
            if new:
                for beam in new:
                    nodes[beam] = len(parents)
                    parents.append(nodes[beam[:-1]] if len(beam) > 1 else -1)
                fed = drafter.backend.forward_tree(torch.tensor([beam[-1] for beam in new]), torch.tensor(parents),
                                                   drafter.cache, start)  # [n, d]
                hidden.update(zip(new, fed))
            rows = torch.stack([hidden[tuple(beam)] for beam in beams])  # [B, d]
            guarded = self.ban.rows(len(context) + len(beams[0]), 1) * len(beams)
            logits = mask_banned(drafter.head.logits(rows), self.ban.ids, guarded)  # [B, V]
            return torch.log(joint_probs(logits, self.params))

        beam = beam_search(next_log_probs, self.width, gamma)
        # Keep the best beam's fed prefix (all its tokens but the last) for the next round's sync.
        best = beam.beams[0] if beam.beams else []
        kept = [nodes[tuple(best[: i + 1])] for i in range(len(best) - 1)]
        drafter.backend.compact(drafter.cache, start, kept)
        drafter.cached.extend(best[: len(kept)])
        return beam
