"""Counters the heads and decoding loops fill in, reported by `generate` and `bench`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
class DecodeStats:
    """One generation: tokens, target forwards, wall time split by phase, and the head's counters."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    forwards: int = 0
    seconds_total: float = 0.0
    seconds_prefill: float = 0.0
    head: HeadStats = field(default_factory=HeadStats)

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

    def to_json(self) -> dict:
        data = asdict(self)
        data["tokens_per_s"] = self.tokens_per_s
        data["head"] = {**data["head"], **self.head.summary()}
        return data
