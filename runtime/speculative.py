"""Speculative decoding loop: a drafter proposes, the target scores every draft in one forward, a
verifier keeps what the target would have said, and both KV caches roll back to the kept tokens.

Greedy outputs equal generate_ar's token for token; sampled outputs follow the warped target
exactly (runtime/verify.py), though not the same random stream as generate_ar's Gumbel sampler.
Both hold with the EOS min-response guard on (min_new_tokens), which bans EOS on both sides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from runtime.drafters.base import Drafter, Proposal
from runtime.heads.sampling import SamplingParams
from runtime.stats import DecodeStats
from runtime.stopping import StopStrings
from runtime.target import TargetModel
from runtime.verify import NO_BAN, TokenBan, Verdict, mask_banned, select_allowed, verify_exact, verify_greedy, warp

MAX_GAMMA = 8  # adaptive draft length stays in 1..MAX_GAMMA


@dataclass
class SpecStats:
    """What drafting and verification did over one generation."""

    rounds: int = 0  # target forwards after the prefill, drafted or not
    drafts: int = 0  # rounds that drafted at least one token
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: rounds with a draft at position i
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: rounds that accepted position i
    seconds_draft: float = 0.0  # drafter: propose + observe
    seconds_verify: float = 0.0  # target forward over the drafts + head + verifier

    def record(self, verdict: Verdict) -> None:
        """Count one round's drafts and acceptances."""
        self.rounds += 1
        if verdict.drafted == 0:
            return
        self.drafts += 1
        self.drafted += verdict.drafted
        self.accepted += verdict.accepted
        grow = verdict.drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(verdict.drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < verdict.accepted)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens appended per drafting round: 1 + accepted / drafts (vLLM's convention)."""
        return 1 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Fraction of drafts at each position that were accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def gamma_mean(self) -> float:
        """Tokens drafted per round, rounds without a draft included."""
        return self.drafted / self.rounds if self.rounds else 0.0

    @property
    def seconds_draft_per_token(self) -> float:
        """T_D: drafter seconds per drafted token (a round's drafting costs gamma T_D)."""
        return self.seconds_draft / self.drafted if self.drafted else 0.0

    @property
    def seconds_verify_per_round(self) -> float:
        """T_V(gamma + 1): one target forward over the drafts plus the head and the verifier."""
        return self.seconds_verify / self.rounds if self.rounds else 0.0

    @property
    def predicted_tokens_per_s(self) -> float:
        """Seed 002's closed form (1 - a^(g+1)) / ((1 - a)(g T_D + T_V)) from this run's own
        acceptance rate a, mean draft length g, drafter and verifier seconds.

        The numerator is the expected tokens per round if each draft passed independently with
        probability a; the measured mean accepted length shows how far that assumption holds.
        """
        if not self.rounds:
            return 0.0
        alpha, gamma = self.acceptance_rate, self.gamma_mean
        expected = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
        return expected * self.rounds / (self.seconds_draft + self.seconds_verify)

    @classmethod
    def combined(cls, runs: list["SpecStats"]) -> "SpecStats":
        """The counters and seconds of several runs added up (bench: all prompts of a method)."""
        total = cls()
        for run in runs:
            for name in ("rounds", "drafts", "drafted", "accepted", "seconds_draft", "seconds_verify"):
                setattr(total, name, getattr(total, name) + getattr(run, name))
            for mine, theirs in ((total.drafted_per_position, run.drafted_per_position),
                                 (total.accepted_per_position, run.accepted_per_position)):
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, count in enumerate(theirs):
                    mine[i] += count
        return total

    def summary(self) -> dict:
        return {
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_position": self.acceptance_per_position,
            "gamma_mean": self.gamma_mean,
            "seconds_draft_per_token": self.seconds_draft_per_token,
            "seconds_verify_per_round": self.seconds_verify_per_round,
            "predicted_tokens_per_s": self.predicted_tokens_per_s,
        }


@dataclass
class SpecDecodeStats(DecodeStats):
    """DecodeStats plus the speculative counters."""

    spec: SpecStats = field(default_factory=SpecStats)

    def to_json(self) -> dict:
        data = super().to_json()
        data["spec"] = {**data["spec"], **self.spec.summary()}
        return data


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


def next_gamma(gamma: int, verdict: Verdict) -> int:
    """Adaptive draft length: one more after a fully accepted draft, one fewer after a rejection."""
    if verdict.drafted == 0:
        return gamma
    return min(gamma + 1, MAX_GAMMA) if verdict.bonus else max(gamma - 1, 1)


def generate_speculative(
    target: TargetModel,
    head,
    drafter: Drafter,
    prompt: torch.Tensor,
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    gamma: int = 4,
    adaptive: bool = False,
    on_token: Callable[[int], None] | None = None,
    min_new_tokens: int = 0,
    stop: StopStrings | None = None,
) -> tuple[list[int], SpecDecodeStats]:
    """Speculative decoding with `drafter` proposing up to `gamma` tokens per target forward.

    prompt: [P] token ids. Returns the new tokens (EOS included if produced) and the stats. The
    first token comes from the prefill as in generate_ar, so prefill timings compare across methods.
    min_new_tokens: EOS is excluded from the first that many tokens, in drafts and in the
    target's choices (the min-response guard; generate_ar's parameter of the same name).
    stop: stop strings, checked after every appended token (accepted, recovered or bonus); the
    tokens end with the one that completes a stop string (included), as in generate_ar.
    """
    if prompt.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if not 1 <= gamma <= MAX_GAMMA:
        raise ValueError(f"gamma must be in 1..{MAX_GAMMA}, got {gamma}")
    stats = SpecDecodeStats(prompt_tokens=prompt.numel())
    head_before = replace(head.stats)
    started = time.perf_counter()
    cache = target.new_cache()
    hidden = target.forward(prompt, cache)[-1:]  # [1, d]
    stats.forwards += 1
    context = prompt.tolist()
    tokens: list[int] = []
    ban = TokenBan.min_response(target.eos_token_ids, len(context), min_new_tokens)

    def emit(new: list[int]) -> bool:
        """Append tokens until EOS, a stop string or the token limit; True when generation is over."""
        for token in new:
            tokens.append(token)
            context.append(token)
            if on_token is not None:
                on_token(token)
            if token in target.eos_token_ids or len(tokens) == max_new_tokens:
                return True
            if stop is not None and stop.hit(tokens):
                return True
        return False

    finished = max_new_tokens <= 0 or emit(
        [int(select_allowed(head, hidden, params, generator, ban.ids, ban.rows(len(context), 1))[0])]
    )
    stats.seconds_prefill = time.perf_counter() - started
    drafter.reset(prompt.tolist(), params, generator, ban)
    while not finished:
        # The cache holds context[:-1]; the last token is fed with the drafts.
        k = min(gamma, max_new_tokens - len(tokens) - 1)
        t0 = time.perf_counter()
        proposal = drop_banned(drafter.propose(context, k), ban, len(context))
        t1 = time.perf_counter()
        verdict = verify_round(target, head, cache, context[-1], proposal, params, generator, ban, len(context))
        target.crop(cache, len(context) + verdict.accepted)
        t2 = time.perf_counter()
        drafter.observe(verdict)
        stats.forwards += 1
        stats.spec.seconds_draft += (t1 - t0) + (time.perf_counter() - t2)
        stats.spec.seconds_verify += t2 - t1
        stats.spec.record(verdict)
        if adaptive:
            gamma = next_gamma(gamma, verdict)
        finished = emit(verdict.tokens)
    stats.seconds_total = time.perf_counter() - started
    stats.new_tokens = len(tokens)
    stats.head = head.stats.since(head_before)
    return tokens, stats
