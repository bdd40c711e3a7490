"""MJSD end to end (runtime.loops.mjsd) on the tiny Llama: the drafter's beam search over tree forwards gives
the beams and joint log q of a reference search over fresh chain forwards; with the target as its own
drafter every draft passes (p = q), width 1 is greedy decoding and width 4 appends the target's own
best beam then its argmax; token limits and EOS hold; it is registered as not distribution-preserving.
"""

from __future__ import annotations

import pytest
import torch

from runtime.backends.lean import lean_target
from runtime.common.sampling import SamplingParams, joint_probs
from runtime.drafters import LayerDrafter
from runtime.drafters.beam import BeamDrafts, beam_search
from runtime.drafters.layers import BackendDrafter
from runtime.heads import FullHead
from runtime.loops.decode import generate_ar
from runtime.loops.mjsd import generate_mjsd
from runtime.methods import METHODS, parse_method

PROMPT = [201, 17, 88, 4, 150, 9, 63, 240, 31, 77, 120, 5]


@pytest.fixture(scope="module")
def target(tiny_llama):
    return lean_target(tiny_llama, set())


def full_head(target) -> FullHead:
    return FullHead(target.head_weight, target.head_bias)


def chain_log_probs(backend, head, context: list[int], params: SamplingParams):
    """next_log_probs from a fresh chain forward per prefix (the reference for the tree forwards)."""

    def row(beam: list[int]) -> torch.Tensor:
        cache = backend.new_cache()
        hidden = backend.forward(torch.tensor(context), cache)  # the prefix as one forward, then the beam
        return (backend.forward(torch.tensor(beam), cache) if beam else hidden)[-1]  # [d]

    def next_log_probs(beams: list[list[int]]) -> torch.Tensor:
        return torch.log(joint_probs(head.logits(torch.stack([row(beam) for beam in beams])), params))  # [B, V]

    return next_log_probs


@pytest.mark.parametrize("width, gamma", [(1, 3), (2, 4), (4, 4), (8, 3)])
def test_beam_drafts_equal_a_search_over_chain_forwards(target, width, gamma) -> None:
    drafter = LayerDrafter(target, 1, full_head(target))
    drafts = BeamDrafts(drafter, width)
    drafts.reset(PROMPT, SamplingParams(), None)
    for context in (PROMPT, PROMPT + [7, 99]):  # the second call syncs the drafter's cache from the first
        beam = drafts.draft(context, gamma)
        reference = beam_search(chain_log_probs(drafter.backend, drafter.head, context, SamplingParams()), width, gamma)
        assert beam.beams == reference.beams and beam.log_q == reference.log_q
        assert drafter.cached == context + beam.beams[0][:-1]  # the best beam's fed prefix stays cached


def test_target_as_its_own_drafter_width_1_is_greedy(target) -> None:
    """p = q: every prefix passes any tau < 1, and a width-1 beam is the greedy chain."""
    drafts = BeamDrafts(BackendDrafter(target, full_head(target)), width=1)
    tokens, stats = generate_mjsd(target, full_head(target), drafts, torch.tensor(PROMPT), 25, gamma=4, tau=0.9)
    assert tokens == generate_ar(target, full_head(target), torch.tensor(PROMPT), 25)[0]
    assert stats.spec.accepted == stats.spec.drafted > 0


def test_target_as_its_own_drafter_width_4_appends_its_best_beam(target) -> None:
    """The first round appends the target's own best beam (a search over chain forwards), then its argmax."""
    head = full_head(target)
    drafts = BeamDrafts(BackendDrafter(target, head), width=4)
    tokens, stats = generate_mjsd(target, head, drafts, torch.tensor(PROMPT), 6, gamma=4, tau=0.5)
    first = generate_ar(target, head, torch.tensor(PROMPT), 1)[0]
    best = beam_search(chain_log_probs(target, head, PROMPT + first, SamplingParams()), 4, 4).beams[0]
    after = generate_ar(target, head, torch.tensor(PROMPT + first + best), 1)[0]
    assert tokens == first + best + after and stats.spec.accepted == 4


@pytest.mark.parametrize("tau", [0.0, 0.1, 0.5, 0.9])
def test_token_limit_and_eos(tiny_llama, tau) -> None:
    plain = lean_target(tiny_llama, set())
    drafter = LayerDrafter(plain, 1, full_head(plain))
    for n in (1, 2, 7):
        tokens, _ = generate_mjsd(plain, full_head(plain), BeamDrafts(drafter, 2), torch.tensor(PROMPT), n, tau=tau)
        assert len(tokens) == n
    tokens, _ = generate_mjsd(plain, full_head(plain), BeamDrafts(drafter, 2), torch.tensor(PROMPT), 20, tau=tau)
    eos = tokens[9]
    with_eos = lean_target(tiny_llama, {eos})
    ended, _ = generate_mjsd(with_eos, full_head(with_eos), BeamDrafts(LayerDrafter(with_eos, 1, full_head(with_eos)), 2),
                             torch.tensor(PROMPT), 20, tau=tau)
    assert ended == tokens[: tokens.index(eos) + 1]


def test_sampled_mjsd_runs_and_draws_from_the_generator(target) -> None:
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)  # the paper's warping, at T = 0.8
    drafter = LayerDrafter(target, 1, full_head(target))
    runs = [generate_mjsd(target, full_head(target), BeamDrafts(drafter, 4), torch.tensor(PROMPT), 16, params,
                          torch.Generator().manual_seed(seed))[0] for seed in (0, 0, 1)]
    assert runs[0] == runs[1] and len(runs[0]) == 16


def test_registered_as_not_distribution_preserving() -> None:
    assert not METHODS["mjsd"].distribution_preserving
    assert not parse_method("mjsd:int8:tau=0.5").distribution_preserving
    assert parse_method("swarm:int8:4").distribution_preserving
