"""Counters the heads and decoding loops fill in, reported by `generate` and `bench`: one model.

`Verdict` is one verify round's outcome, which the loops count (SpecStats.record) and drafters observe.

`DecodeStats` is what every loop returns: tokens, forwards and times, the target head's counters
(`head`; a certified head fills in its certification counters), and optional parts that are None
when the method has none: `spec` (drafting and verification) and `shortlist` (the drafter's
shortlist head, DynaSpec / FR-Spec).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft: how many drafts passed and what to append."""

    drafted: int
    accepted: int
    tokens: list[int]  # accepted drafts, then one recovered or bonus token

    @property
    def bonus(self) -> bool:
        """Every draft passed, so the last token came from the target's extra position."""
        return self.accepted == self.drafted


_COUNTERS = ("rows", "certified", "fallbacks", "near_ties", "recomputed_tokens", "required_open_tokens")


@dataclass
class HeadStats:
    """What a head did: rows decided, certified or fallen back, and how much it recomputed."""

    vocab_size: int = 0
    rows: int = 0
    certified: int = 0
    fallbacks: int = 0
    near_ties: int = 0  # fallbacks where the bound certified but the decision was within float32 rounding
    recomputed_tokens: int = 0  # exact logits computed (candidates, opened clusters or full head)
    required_open_tokens: int = 0  # cluster bound: tokens that certification would need to open

    def add(self, other: "HeadStats") -> None:
        """Accumulate another head's counters into this one."""
        for name in _COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.vocab_size = self.vocab_size or other.vocab_size

    def since(self, before: "HeadStats") -> "HeadStats":
        """Counters accumulated after the snapshot `before` (taken with dataclasses.replace)."""
        delta = HeadStats(vocab_size=self.vocab_size)
        for name in _COUNTERS:
            setattr(delta, name, getattr(self, name) - getattr(before, name))
        return delta

    @property
    def required_open_fraction(self) -> float:
        """Cluster bound: mean fraction of the vocabulary certification would have had to open."""
        return self.required_open_tokens / (self.fallbacks * self.vocab_size) if self.fallbacks else 0.0

    @property
    def certification_rate(self) -> float:
        return self.certified / self.rows if self.rows else 0.0

    @property
    def fallback_rate(self) -> float:
        return self.fallbacks / self.rows if self.rows else 0.0

    @property
    def recomputed_fraction(self) -> float:
        """Mean fraction of the vocabulary whose exact logit was computed per row."""
        return self.recomputed_tokens / (self.rows * self.vocab_size) if self.rows else 0.0

    def summary(self) -> dict:
        return {
            "certification_rate": self.certification_rate,
            "fallback_rate": self.fallback_rate,
            "near_tie_rate": self.near_ties / self.rows if self.rows else 0.0,
            "recomputed_fraction": self.recomputed_fraction,
            "required_open_fraction": self.required_open_fraction,
        }


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
        """The GP paper's closed form (1 - a^(g+1)) / ((1 - a)(g T_D + T_V)) from this run's own
        acceptance rate a, mean draft length g, drafter and verifier seconds.

        The numerator is the expected tokens per round if each draft passed independently with
        probability a; the measured mean accepted length shows how far that assumption holds.
        """
        seconds = self.seconds_draft + self.seconds_verify
        if not self.rounds or seconds <= 0:  # no rounds, or no phase times (llama.cpp's speculation reports none)
            return 0.0
        return expected_tokens(self.acceptance_rate, self.gamma_mean) * self.rounds / seconds

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


def expected_tokens(alpha: float, gamma: float) -> float:
    """Tokens per round when each of gamma drafts passes independently with probability alpha
    (the numerator of the GP paper's closed form)."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


@dataclass
class DecodeStats:
    """One generation: tokens, target forwards, wall time split by phase, and the head's counters."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    forwards: int = 0
    seconds_total: float = 0.0
    seconds_prefill: float = 0.0
    head: HeadStats = field(default_factory=HeadStats)
    spec: SpecStats | None = None  # speculative loops: drafting and verification
    shortlist: HeadStats | None = None  # shortlisted drafters: what the drafter's shortlist head scored

    @property
    def seconds_decode(self) -> float:
        """Time after the first new token (prefill and first head call excluded)."""
        return self.seconds_total - self.seconds_prefill

    @property
    def decode_tokens(self) -> int:
        """Tokens produced after the first one, i.e. during seconds_decode."""
        return max(self.new_tokens - 1, 0)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens after the first over the time after the first."""
        return self.decode_tokens / self.seconds_decode if self.seconds_decode > 0 else 0.0

    @property
    def shortlist_fraction(self) -> float | None:
        """Mean drafter shortlist size over the vocabulary, per drafted row (None without a shortlist)."""
        return None if self.shortlist is None else self.shortlist.recomputed_fraction

    def to_json(self) -> dict:
        data = asdict(self)
        data["tokens_per_s"] = self.tokens_per_s
        data["head"] = {**data["head"], **self.head.summary()}
        if self.spec is not None:
            data["spec"] = {**data["spec"], **self.spec.summary()}
        if self.shortlist is not None:
            data["shortlist_fraction"] = self.shortlist_fraction
        return data
