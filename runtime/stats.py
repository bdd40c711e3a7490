"""Counters the heads and decoding loops fill in, reported by `generate` and `bench`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class HeadStats:
    """What a head did: rows decided, certified or fallen back, and how much it recomputed."""

    vocab_size: int = 0
    rows: int = 0
    certified: int = 0
    fallbacks: int = 0
    recomputed_tokens: int = 0  # exact logits computed (candidates, opened clusters or full head)
    required_open_tokens: int = 0  # cluster bound: tokens that certification would need to open

    def add(self, other: "HeadStats") -> None:
        """Accumulate another head's counters into this one."""
        for name in ("rows", "certified", "fallbacks", "recomputed_tokens", "required_open_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.vocab_size = self.vocab_size or other.vocab_size

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
            "recomputed_fraction": self.recomputed_fraction,
        }


@dataclass
class DecodeStats:
    """One generation: tokens, target forwards, wall time split by phase, and the head's counters."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    forwards: int = 0
    seconds_total: float = 0.0
    seconds_prefill: float = 0.0
    head: HeadStats = field(default_factory=HeadStats)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: new tokens over the time after prefill."""
        decode = self.seconds_total - self.seconds_prefill
        return self.new_tokens / decode if decode > 0 else 0.0

    def to_json(self) -> dict:
        data = asdict(self)
        data["tokens_per_s"] = self.tokens_per_s
        data["head"] = {**data["head"], **self.head.summary()}
        return data
