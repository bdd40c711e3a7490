"""Sampling helpers: the top-k / top-p allowed set against its definition on a full sort, and the greedy pick."""

from __future__ import annotations

import pytest
import torch

from runtime.common.sampling import TOP_SET_SIZES, SamplingParams, allowed_mask, first_argmax

VOCAB = 40_000  # more than the largest sorted prefix tried, so a flat row needs the full sort


def nucleus_by_definition(scaled: torch.Tensor, top_p: float, top_k: int = 0) -> set[int]:
    """The fewest most probable tokens (of the top k, when given) holding top_p of the mass, from a full sort."""
    values, ids = torch.sort(scaled.double(), descending=True)
    if top_k:
        values, ids = values[:top_k], ids[:top_k]
    cumulative = torch.softmax(values, 0).cumsum(0)
    n = int((cumulative < top_p).sum()) + 1
    return set(ids[: min(n, ids.numel())].tolist())


SPREADS, TOP_PS = (8.0, 4.0, 2.0, 0.5), (0.5, 0.9, 0.99)  # nuclei from one token to most of the vocabulary


def scaled_logits(spread: float, top_p: float) -> torch.Tensor:
    """Random logits [VOCAB] (distinct values) of one test case."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(int(spread * 100) + int(top_p * 1000))) * spread


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("top_p", TOP_PS)
def test_top_p_keeps_exactly_the_nucleus(spread: float, top_p: float):
    scaled = scaled_logits(spread, top_p)
    keep = allowed_mask(scaled, SamplingParams(temperature=1.0, top_p=top_p))
    assert set(torch.nonzero(keep).flatten().tolist()) == nucleus_by_definition(scaled, top_p)


def test_the_nuclei_tested_end_in_every_prefix():
    """The cases above end inside each sorted prefix and past the last (or they test less than they claim)."""
    sizes = [len(nucleus_by_definition(scaled_logits(s, p), p)) for s in SPREADS for p in TOP_PS]
    bounds = (*TOP_SET_SIZES, VOCAB + 1)
    assert {next(i for i, bound in enumerate(bounds) if size < bound) for size in sizes} == {0, 1, 2, 3}, sizes


@pytest.mark.parametrize("top_k", [1, 50, 5000])
def test_top_k_then_top_p_is_the_nucleus_of_the_top_k(top_k: int):
    scaled = torch.randn(VOCAB, generator=torch.Generator().manual_seed(top_k)) * 0.5
    only_k = allowed_mask(scaled, SamplingParams(temperature=1.0, top_k=top_k))
    assert set(torch.nonzero(only_k).flatten().tolist()) == set(torch.topk(scaled, top_k).indices.tolist())
    both = allowed_mask(scaled, SamplingParams(temperature=1.0, top_k=top_k, top_p=0.8))
    assert set(torch.nonzero(both).flatten().tolist()) == nucleus_by_definition(scaled, 0.8, top_k)


def test_no_restriction_keeps_every_token():
    assert bool(allowed_mask(torch.randn(100), SamplingParams(temperature=0.7)).all())


def test_first_argmax_is_torch_argmax_on_ties_infinities_and_nans():
    g = torch.Generator().manual_seed(3)
    cases = [torch.randint(0, 40, (49152,), generator=g).float() for _ in range(50)]  # many ties
    cases += [torch.full((1000,), float("-inf")), torch.tensor([1.0, float("nan"), 3.0, float("nan")]),
              torch.tensor([float("inf"), 2.0, float("inf")]), torch.tensor([-0.0, 0.0]), torch.tensor([7.0])]
    for values in cases:
        assert first_argmax(values) == int(torch.argmax(values))
