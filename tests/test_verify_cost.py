"""Verify-cost measurement (T_V(n) / T_V(1)) on a tiny random Llama, the gamma choice it implies, and
the GP paper's predicted throughput in the speculative stats."""

from __future__ import annotations

import pytest
import torch

from runtime.bench.verify_cost import best_gamma, verify_cost
from runtime.drafters import NgramDrafter
from runtime.heads import FullHead
from runtime.loops.speculative import generate_speculative
from runtime.common.stats import SpecStats, expected_tokens
from runtime.backends.hf import TransformersTarget
from runtime.drafters.base import Verdict


@pytest.fixture(scope="module")
def target(tiny_llama) -> TransformersTarget:
    return TransformersTarget(tiny_llama, set())


class CountingHead(FullHead):
    """A full head that records how many rows each select call decided."""

    def __init__(self, weight, bias=None) -> None:
        super().__init__(weight, bias)
        self.calls: list[int] = []

    def select(self, hidden, params, generator=None):
        self.calls.append(hidden.shape[0])
        return super().select(hidden, params, generator)


class RecordingTarget:
    """Delegates to a target and keeps its caches."""

    def __init__(self, target) -> None:
        self.target, self.caches = target, []

    def __getattr__(self, name):
        return getattr(self.target, name)

    def new_cache(self):
        self.caches.append(self.target.new_cache())
        return self.caches[-1]


def test_verify_cost_rows_and_cache(target):
    head = CountingHead(target.head_weight)
    recording = RecordingTarget(target)
    tokens = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(0))
    rows = verify_cost(recording, head, tokens, context=30, max_n=5, repeats=3)
    assert [row["n"] for row in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["ratio"] == 1.0
    for row in rows:
        assert row["total_ms"] > 0 and row["forward_ms"] > 0 and row["head_ms"] > 0
        assert row["ratio"] == pytest.approx(row["total_ms"] / rows[0]["total_ms"])
        assert row["head_fallbacks"] == 0  # the full head never falls back
    assert head.calls == [1, 2, 3, 4, 5] * 4  # one warm-up pass, then 3 recorded; the head sees the n rows
    cache = recording.caches[0]
    assert len(cache) == cache.inner.get_seq_length() == 30  # cropped back after every measurement
    with pytest.raises(ValueError, match="at least 35 tokens"):
        verify_cost(target, head, tokens[:34], context=30, max_n=5)


def test_best_gamma_trades_acceptance_against_verify_growth():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    flat = [{"n": n, "ratio": 1.0} for n in range(1, 9)]  # a free verify forward: draft as much as allowed
    assert best_gamma(flat, 0.5)[0] == 7
    linear = [{"n": n, "ratio": float(n)} for n in range(1, 9)]  # verify costs n steps: never draft
    assert best_gamma(linear, 0.9) == (0, 1.0)
    measured = [{"n": n, "ratio": r} for n, r in enumerate([1.0, 1.11, 1.4, 1.75, 2.0, 2.2, 2.35, 2.46], start=1)]
    gamma, speedup = best_gamma(measured, 0.7)
    assert 1 <= gamma < 7 and speedup == pytest.approx(expected_tokens(0.7, gamma) / measured[gamma]["ratio"])


def test_predicted_tokens_per_s_is_the_closed_form():
    stats = SpecStats()
    for verdict in (Verdict(4, 4, [0] * 5), Verdict(4, 1, [0] * 2), Verdict(0, 0, [0]), Verdict(4, 2, [0] * 3)):
        stats.record(verdict)
    stats.seconds_draft, stats.seconds_verify = 0.2, 0.6
    alpha, gamma = 7 / 12, 12 / 4
    expected = (1 - alpha ** (gamma + 1)) / (1 - alpha) / ((0.2 + 0.6) / 4)
    assert stats.rounds == 4 and stats.gamma_mean == gamma
    assert stats.predicted_tokens_per_s == pytest.approx(expected)
    assert stats.seconds_draft_per_token == pytest.approx(0.2 / 12)
    assert stats.seconds_verify_per_round == pytest.approx(0.15)
    assert SpecStats().predicted_tokens_per_s == 0.0
    combined = SpecStats.combined([stats, stats])
    assert combined.rounds == 8 and combined.accepted == 14 and combined.accepted_per_position == [6, 4, 2, 2]
    assert combined.predicted_tokens_per_s == pytest.approx(expected)


def test_generate_speculative_reports_the_prediction(target):
    prompt = torch.tensor([5, 6, 7, 8] * 5)
    _, stats = generate_speculative(target, FullHead(target.head_weight), NgramDrafter(), prompt, 24)
    spec = stats.to_json()["spec"]
    for key in ("predicted_tokens_per_s", "gamma_mean", "seconds_draft_per_token", "seconds_verify_per_round"):
        assert key in spec, key
    assert spec["predicted_tokens_per_s"] > 0
    assert stats.spec.rounds == stats.forwards - 1
