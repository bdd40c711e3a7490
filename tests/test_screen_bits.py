"""bench-screen's lower-bit screens: the codes they claim, and a candidate set that always holds the argmax."""

from __future__ import annotations

import pytest
import torch

from runtime.bench.screen_bits import FORMATS, bytes_per_weight, candidate_fractions, fake_quantize, greedy_candidates


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_fake_quantize_uses_at_most_two_to_the_bits_values_per_group(name: str) -> None:
    bits, group, affine = FORMATS[name]
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    quantized = fake_quantize(weight, bits, group, affine)  # [64, 128]
    groups = quantized.reshape(64, -1, group or 128)
    assert all(g.unique().numel() <= 2**bits for row in groups for g in row)
    # Round to nearest: within half a step (the group's scale) of the weight.
    span = (weight.reshape(64, -1, group or 128).amax(-1) - weight.reshape(64, -1, group or 128).amin(-1)).max()
    assert float((quantized - weight).abs().max()) <= float(span) / (2**bits - 2) + 1e-6


def test_candidates_always_hold_the_exact_argmax_and_shrink_with_more_bits() -> None:
    gen = torch.Generator().manual_seed(1)
    weight, hidden = torch.randn(4096, 64, generator=gen), torch.randn(32, 64, generator=gen) * 4  # [V, d], [B, d]
    exact = (hidden @ weight.T).argmax(1)  # [B]
    shares = []
    for name in ("q4_0", "q4_1", "q5_1", "q8_row"):
        candidates, _ = greedy_candidates(weight, fake_quantize(weight, *FORMATS[name]), hidden)  # [B, V]
        assert bool(candidates[torch.arange(32), exact].all()), name
        shares.append(float(candidates.double().mean()))
    assert shares[0] > shares[2] > shares[3] and shares[1] > shares[2]
    rows = candidate_fractions(weight, hidden, ["q4_1", "q8_row"])
    assert [row["format"] for row in rows] == ["q4_1", "q8_row"] and rows[0]["candidates_mean"] > rows[1]["candidates_mean"]
    assert bytes_per_weight(4, 32, True, 64) == 0.625 and bytes_per_weight(8, None, False, 64) == 1 + 2 / 64
