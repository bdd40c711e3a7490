"""Sampling exactness of the speculative loop on a mock Markov target whose next-token law is known
exactly: plain and with the EOS min-response guard (and how the guard cuts point-mass drafts).
"""

from __future__ import annotations

import pytest
import torch

from runtime.drafters import Proposal
from runtime.heads import FullHead
from runtime.loops.speculative import drop_banned, generate_speculative
from runtime.common.sampling import NO_BAN, SamplingParams, TokenBan, mask_banned, sample_from, warp

V = 12


class MarkovTarget:
    """A TargetModel whose hidden state is the one-hot token, so a head with weight L^T gives the
    logits row L[token]: the next-token law depends on the previous token only and is known exactly."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.head_weight = logits.T.contiguous()  # [V, V]
        self.head_bias = None
        self.vocab_size = self.hidden_size = logits.shape[0]
        self.eos_token_ids = frozenset()

    def new_cache(self) -> list[int]:
        return []

    def forward(self, tokens: torch.Tensor, cache: list[int]) -> torch.Tensor:
        cache.extend(tokens.tolist())
        return torch.nn.functional.one_hot(tokens, self.vocab_size).float()  # [T, V]

    def crop(self, cache: list[int], length: int) -> None:
        del cache[length:]


class MarkovDrafter:
    """Drafts from another Markov chain, sampled (with q) or as its argmax chain (point masses)."""

    def __init__(self, logits: torch.Tensor, point_mass: bool) -> None:
        self.logits, self.point_mass = logits, point_mass

    def reset(self, prompt, params, generator, ban=NO_BAN) -> None:
        self.q, self.generator, self.ban = warp(self.logits, params), generator, ban
        # The guard bans ids from q, as a model drafter does (point masses are cut by the loop).
        self.q_banned = warp(mask_banned(self.logits, ban.ids, V), params)

    def propose(self, context: list[int], k: int) -> Proposal:
        tokens, rows = [context[-1]], []
        for i in range(k):
            q = self.q_banned if self.ban.rows(len(context) + i, 1) else self.q
            row = self.logits[tokens[-1]] if self.point_mass else q[tokens[-1]]
            tokens.append(int(row.argmax()) if self.point_mass else sample_from(row, self.generator))
            rows.append(q[tokens[-2]])
        probs = None if self.point_mass or not rows else torch.stack(rows)
        return Proposal(torch.tensor(tokens[1:], dtype=torch.long), probs)

    def observe(self, verdict) -> None:
        pass


@pytest.mark.parametrize(
    "params, point_mass, gamma",
    [(SamplingParams(temperature=0.8, top_k=6, top_p=0.9), False, 3), (SamplingParams(temperature=1.0), True, 2),
     (SamplingParams(temperature=0.8, top_k=6, top_p=0.9), True, 3)],
    ids=["top-k+top-p", "point-mass", "point-mass-top-k+top-p"],
)
def test_sampled_loop_follows_the_target(params, point_mass, gamma):
    """Tokens 1..3 of generate_speculative follow rows of P, P^2, P^3 (P = warped target chain)
    within sampling error."""
    gen = torch.Generator().manual_seed(0)
    target_logits = torch.randn(V, V, generator=gen) * 2
    draft_logits = target_logits + torch.randn(V, V, generator=gen)
    target, drafter = MarkovTarget(target_logits), MarkovDrafter(draft_logits, point_mass)
    head, n, start = FullHead(target.head_weight), 2000, 0
    samples = torch.tensor([
        generate_speculative(target, head, drafter, torch.tensor([start]), 3, params, gen, gamma=gamma)[0]
        for _ in range(n)
    ])  # [n, 3]
    P = warp(target_logits, params)
    law = P[start]
    for position in range(3):
        empirical = torch.bincount(samples[:, position], minlength=V).double() / n
        distance = 0.5 * float((empirical - law.double()).abs().sum())
        assert distance < float((law.double() * (1 - law.double()) / n).sqrt().sum()), position
        law = law @ P


def test_drop_banned_cuts_point_mass_drafts_only():
    ban = TokenBan(frozenset({9}), until=12)
    draft = Proposal(torch.tensor([4, 9, 5, 9]))
    assert drop_banned(draft, ban, 10).tokens.tolist() == [4]  # positions 10, 11 guarded; 9 at 11 is cut
    assert drop_banned(draft, ban, 11) is draft  # only position 11 is guarded, and it drafts 4
    assert drop_banned(Proposal(torch.tensor([9, 4])), ban, 11).tokens.tolist() == []
    assert drop_banned(draft, ban, 12) is draft  # past the guard
    sampled = Proposal(torch.tensor([9]), torch.full((1, 16), 1 / 16))
    assert drop_banned(sampled, ban, 10) is sampled  # q-drafters ban inside q


@pytest.mark.parametrize("point_mass", [False, True], ids=["sampled-q", "point-mass"])
def test_guarded_sampled_loop_follows_the_guarded_target(point_mass):
    """With EOS banned for 2 tokens, tokens 1..3 follow rows of P_b, P_b^2, P_b^2 P (P_b = the chain
    with EOS masked out), and EOS never comes first or second."""
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(1)
    target_logits = torch.randn(V, V, generator=gen) * 2
    draft_logits = target_logits + torch.randn(V, V, generator=gen)
    start = 0
    eos = int(target_logits[start].argmax())  # the most likely first token is the EOS
    target, drafter = MarkovTarget(target_logits), MarkovDrafter(draft_logits, point_mass)
    target.eos_token_ids = frozenset({eos})
    head, n = FullHead(target.head_weight), 2000
    runs = [generate_speculative(target, head, drafter, torch.tensor([start]), 3, params, gen, gamma=2,
                                 min_new_tokens=2)[0] for _ in range(n)]
    assert all(len(run) == 3 and eos not in run[:2] for run in runs)
    samples = torch.tensor(runs)  # [n, 3]
    P, P_b = warp(target_logits, params), warp(mask_banned(target_logits, {eos}, V), params)
    law = P_b[start]
    for position, step in enumerate([P_b, P, None]):
        empirical = torch.bincount(samples[:, position], minlength=V).double() / n
        distance = 0.5 * float((empirical - law.double()).abs().sum())
        assert distance < float((law.double() * (1 - law.double()) / n).sqrt().sum()), position
        if step is not None:
            law = law @ step
