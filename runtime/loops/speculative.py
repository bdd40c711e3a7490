"""Speculative decoding loop: a drafter proposes, the target scores every draft in one forward, a
verifier keeps what the target would have said, and both KV caches roll back to the kept tokens.

Greedy outputs equal generate_ar's token for token; sampled outputs follow the warped target
exactly (runtime/loops/verify.py), though not the same random stream as generate_ar's Gumbel sampler.
Both hold with the EOS min-response guard on (min_new_tokens), which bans EOS on both sides.
"""

from __future__ import annotations

import time

import torch

from runtime.drafters.base import Drafter, Proposal, Verdict
from runtime.common.sampling import NO_BAN, SamplingParams, TokenBan, mask_banned, select_allowed, warp
from runtime.loops.decode import TokenStream, drive
from runtime.loops.rounds import Round, stream_rounds
from runtime.common.stats import DecodeStats, SpecStats
from runtime.text.stopping import StopStrings
from runtime.backends.base import TargetModel
from runtime.loops.verify import verify_exact, verify_greedy

MAX_GAMMA = 8  # gamma=G, the adaptive draft length and the draft budget stay in 1..MAX_GAMMA (the grammar checks it too)
DEFAULT_GAMMA = 4  # drafts per round when the method names no gamma (within the DraftBudget)
# What one more verify row costs, as a share of a one-row round, T_V(n + 1) / T_V(1) - T_V(n) / T_V(1):
# a middle value of what `runtime bench-verify` measures on the packaged models (docs/results/).
VERIFY_ROW_COST = 0.15
BUDGET_WEIGHT = 1 / 16  # DraftBudget: weight of the newest round in each position's running share
BUDGET_PROBE_EVERY = 8  # DraftBudget: every this many cut rounds, one position more is drafted to re-measure it


def verify_round(
    target: TargetModel,
    head,
    cache,
    last: int,
    proposal: Proposal,
    params: SamplingParams,
    generator: torch.Generator | None,
    ban: TokenBan = NO_BAN,
    start: int = 0,
) -> Verdict:
    """Score the last accepted token and the drafts in one target forward, then verify the drafts.

    start: the context position the first verified row predicts (the context's length), which
    tells how many leading rows the EOS guard `ban` covers.
    """
    hidden = target.forward(torch.cat([torch.tensor([last]), proposal.tokens]), cache)  # [k + 1, d]
    guarded = ban.rows(start, hidden.shape[0])
    if params.greedy:
        # Only each row's choice is needed: a certified head computes exact logits for its candidates only.
        return verify_greedy(select_allowed(head, hidden, params, None, ban.ids, guarded), proposal.tokens)
    p = warp(mask_banned(head.logits(hidden), ban.ids, guarded), params)  # [k + 1, V]
    return verify_exact(p, proposal.probs, proposal.tokens, generator)


def drop_banned(proposal: Proposal, ban: TokenBan, start: int) -> Proposal:
    """Cut a point-mass proposal before its first banned token at a guarded position.

    Drafts that carry q are left alone: their drafter bans the ids in q itself, and cutting a
    sampled draft on what was drawn would bias the output away from p.
    """
    guarded = ban.rows(start, proposal.tokens.numel())
    if proposal.probs is not None or guarded == 0:
        return proposal
    hits = [i for i, token in enumerate(proposal.tokens[:guarded].tolist()) if token in ban.ids]
    return Proposal(proposal.tokens[: hits[0]]) if hits else proposal


def first_gamma(gamma: int | None) -> int:
    """The first round's draft length: the gamma the method names (checked to lie in 1..MAX_GAMMA), else DEFAULT_GAMMA."""
    if gamma is None:
        return DEFAULT_GAMMA
    if not 1 <= gamma <= MAX_GAMMA:
        raise ValueError(f"gamma must be in 1..{MAX_GAMMA}, got {gamma}")
    return gamma


class DraftBudget:
    """Cuts each round's draft to the positions worth their verify rows (chains whose method names no gamma).

    A draft at position i (0-based) adds a token only if the drafts 0..i are all accepted, and it costs
    one more verify row, VERIFY_ROW_COST of a one-row round. `passed[i]` follows the share of recent
    rounds drafting position i that accepted it (an exponential average, BUDGET_WEIGHT per round,
    starting at 1: a new sequence drafts as if every draft were accepted), and a round drafts position i
    only while every passed[j <= i] is at least VERIFY_ROW_COST. Every BUDGET_PROBE_EVERY-th cut round
    drafts one position more, so a position that stopped paying is measured again.

    The counts are the verifier's verdicts, not timings, so a seeded sampled run repeats itself (given
    the same earlier calls on the same budget).
    """

    def __init__(self, ceiling: int = MAX_GAMMA) -> None:
        self.passed = [1.0] * ceiling  # [i]: running share of drafts at position i accepted through i
        self.cuts = 0  # rounds this budget cut so far

    def allowed(self, k: int) -> int:
        """How many of k wanted drafts to draft this round."""
        keep = 0
        while keep < k and self.passed[keep] >= VERIFY_ROW_COST:
            keep += 1
        if keep < k:
            self.cuts += 1
            if self.cuts % BUDGET_PROBE_EVERY == 0:
                keep += 1
        return keep

    def record(self, verdict: Verdict) -> None:
        """Learn from one round's verdict: each drafted position, accepted through it or not."""
        for i in range(min(verdict.drafted, len(self.passed))):
            self.passed[i] += BUDGET_WEIGHT * (float(i < verdict.accepted) - self.passed[i])


def next_gamma(gamma: int, verdict: Verdict) -> int:
    """Adaptive draft length: one more after a fully accepted draft (at most MAX_GAMMA), one fewer after a rejection."""
    if verdict.drafted == 0:
        return gamma
    return min(gamma + 1, MAX_GAMMA) if verdict.bonus else max(gamma - 1, 1)


def generate_speculative(*args, **kwargs) -> tuple[list[int], DecodeStats]:
    """stream_speculative (same arguments) run to its end: the new tokens and the stats."""
    return drive(stream_speculative(*args, **kwargs))


def stream_speculative(
    target: TargetModel,
    head,
    drafter: Drafter,
    prompt: torch.Tensor,
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    gamma: int | None = None,
    adaptive: bool = False,
    min_new_tokens: int = 0,
    stop: StopStrings | None = None,
    budget: DraftBudget | None = None,
) -> TokenStream:
    """Speculative decoding with `drafter` proposing up to `gamma` tokens per target forward (None:
    DEFAULT_GAMMA within `budget`, a DraftBudget that learns across the calls given it, else a new one).

    prompt: [P] token ids. A token stream (runtime.loops.decode): the new tokens (EOS included if
    produced), then the stats. The
    first token comes from the prefill as in generate_ar, so prefill timings compare across methods.
    min_new_tokens: EOS is excluded from the first that many tokens, in drafts and in the
    target's choices (the min-response guard; generate_ar's parameter of the same name).
    stop: stop strings, checked after every appended token (accepted, recovered or bonus); the
    tokens end with the one that completes a stop string (included), as in generate_ar.
    """
    if gamma is not None:
        budget = None
    elif budget is None:
        budget = DraftBudget()
    gamma = first_gamma(gamma)

    def begin(cache, ban: TokenBan, spec: SpecStats) -> Round:
        drafter.reset(prompt.tolist(), params, generator, ban)

        def one_round(context: list[int], left: int) -> Verdict:
            nonlocal gamma
            # The cache holds context[:-1]; the last token is fed with the drafts.
            k = min(gamma, left - 1)
            if budget is not None:
                k = budget.allowed(k)
            t0 = time.perf_counter()
            proposal = drop_banned(drafter.propose(context, k), ban, len(context))
            t1 = time.perf_counter()
            verdict = verify_round(target, head, cache, context[-1], proposal, params, generator, ban, len(context))
            target.crop(cache, len(context) + verdict.accepted)
            t2 = time.perf_counter()
            drafter.observe(verdict)
            spec.seconds_draft += (t1 - t0) + (time.perf_counter() - t2)
            spec.seconds_verify += t2 - t1
            if budget is not None:
                budget.record(verdict)
            if adaptive:
                gamma = next_gamma(gamma, verdict)
            return verdict

        return one_round

    return stream_rounds(target, head, prompt, max_new_tokens, params, generator, begin, min_new_tokens, stop, drafter)
