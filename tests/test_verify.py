"""Verifiers: greedy cases with crafted tokens, warping against the heads' sampler, and the exactness
of modified rejection sampling measured on a small vocabulary with fixed seeds.

The statistical tests run the verifier on a Markov "model" (the next-token distribution depends on
the previous token only), so the exact law of the first and second output tokens is a row of P and
of P @ P. Tolerances come from sampling error: sum_i sqrt(p_i (1 - p_i) / N) is about 2.5x the
expected total variation of an exact sampler.
"""

from __future__ import annotations

import pytest
import torch

from factories import make_tiny_head
from prep.screen import build_screen
from runtime.heads import CertifiedHead, FullHead, ScreenBound
from runtime.common.sampling import SamplingParams, TokenBan, allowed_mask, gumbel_noise, mask_banned, sample_full, select_allowed, warp
from runtime.drafters.base import Verdict
from runtime.loops.verify import verify_exact, verify_greedy

V = 12
START = 0  # the token before the first draft


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    """Total variation distance between two distributions [V]."""
    return 0.5 * float((a.double() - b.double()).abs().sum())


def tolerance(reference: torch.Tensor, n: int) -> float:
    """Sampling-error tolerance for the total variation of n samples from `reference` [V]."""
    p = reference.double()
    return float((p * (1 - p) / n).sqrt().sum())


def histogram(samples: torch.Tensor) -> torch.Tensor:
    """Empirical distribution [V] of token samples [N]."""
    return torch.bincount(samples, minlength=V).double() / samples.numel()


# --- greedy verification --------------------------------------------------------------------


@pytest.mark.parametrize(
    "draft, accepted, tokens",
    [
        ([5, 7, 9], 3, [5, 7, 9, 2]),  # all accepted: the target's extra position gives the bonus
        ([5, 7, 3], 2, [5, 7, 9]),  # rejected at position 2: the target's token replaces it
        ([1, 7, 9], 0, [5]),  # later matches after a mismatch do not count
        ([], 0, [5]),  # nothing drafted: a plain target step
    ],
)
def test_verify_greedy(draft, accepted, tokens):
    target_tokens = torch.tensor([5, 7, 9, 2])[: len(draft) + 1]
    verdict = verify_greedy(target_tokens, torch.tensor(draft, dtype=torch.long))
    assert verdict == Verdict(len(draft), accepted, tokens)
    assert verdict.bonus == (accepted == len(draft))


def test_verify_exact_with_point_mass_target_is_greedy():
    """Greedy warping makes p one-hot; rejection sampling must then reduce to greedy verification."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(4, V, generator=gen)  # [k + 1, V]
        target_tokens = logits.argmax(dim=1)
        others = torch.randint(V, (3,), generator=gen)
        draft = torch.where(torch.rand(3, generator=gen) < 0.6, target_tokens[:3], others)
        p = warp(logits, SamplingParams())
        for q in (None, warp(torch.randn(3, V, generator=gen), SamplingParams(temperature=1.0))):
            assert verify_exact(p, q, draft, gen) == verify_greedy(target_tokens, draft)


def test_verify_exact_crafted():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, V, generator=gen), dim=1)  # [k + 1, V]
    draft = torch.tensor([3, 4])
    # q = p accepts everything: min(1, p/q) = 1.
    assert verify_exact(p, p[:2], draft, gen).accepted == 2
    # A draft the target gives probability 0 is always rejected, and the recovered token is not it.
    p_zero = p.clone()
    p_zero[0, 3] = 0.0
    p_zero[0] /= p_zero[0].sum()
    for q in (None, p[:2]):
        for _ in range(20):
            verdict = verify_exact(p_zero, q, draft, gen)
            assert verdict.accepted == 0 and verdict.tokens[0] != 3
    # Nothing drafted: the bonus token comes from p[0].
    empty = verify_exact(p[:1], None, torch.zeros(0, dtype=torch.long), gen)
    assert empty.drafted == 0 and len(empty.tokens) == 1 and empty.bonus


# --- warping --------------------------------------------------------------------------------

WARPS = {
    "temperature": SamplingParams(temperature=1.0),
    "low-temperature": SamplingParams(temperature=0.7),
    "top-k": SamplingParams(temperature=0.8, top_k=5),
    "top-p": SamplingParams(temperature=0.7, top_p=0.8),
    "top-k+top-p": SamplingParams(temperature=1.2, top_k=8, top_p=0.9),
}


@pytest.mark.parametrize("params", WARPS.values(), ids=WARPS.keys())
def test_warp_keeps_the_samplers_support_and_softmax(params):
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1)) * 2  # [n, V]
    probs = warp(logits, params)
    assert torch.allclose(probs.sum(dim=1), torch.ones(6))
    for row in range(6):
        keep = allowed_mask(logits[row] / params.temperature, params)
        assert torch.equal(probs[row] > 0, keep)
        expected = torch.softmax((logits[row] / params.temperature).masked_fill(~keep, float("-inf")), 0)
        assert torch.allclose(probs[row], expected)


def test_warp_top_p_boundary():
    """Top-p keeps the smallest prefix reaching p: 0.5 < 0.75 <= 0.5 + 0.3."""
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    probs = warp(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0]]))
    assert torch.equal(warp(logits, SamplingParams()), torch.tensor([[1.0, 0.0, 0.0]]))


@pytest.mark.parametrize("params", [WARPS["top-k+top-p"], WARPS["low-temperature"]], ids=["top-k+top-p", "temperature"])
def test_warp_is_what_the_heads_sample(params):
    """Gumbel-max samples of sample_full (the heads' sampler) follow warp's distribution."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(V, generator=gen) * 2
    n = 4000
    noise = gumbel_noise(n, V, gen)
    samples = torch.tensor([sample_full(logits, params, noise[i]) for i in range(n)])
    expected = warp(logits[None], params)[0]
    assert tv(histogram(samples), expected) < tolerance(expected, n)


# --- exactness of modified rejection sampling -----------------------------------------------


def markov_pair(params: SamplingParams, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Warped target and draft transition matrices [V, V] (row = previous token), and the draft's
    argmax table [V] for point-mass drafting. The draft is the target with noisy logits."""
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(V, V, generator=gen) * 2
    draft_logits = target_logits + torch.randn(V, V, generator=gen)
    return warp(target_logits, params), warp(draft_logits, params), draft_logits.argmax(dim=1)


def draft_chains(starts: torch.Tensor, gamma: int, Q, table, point_mass: bool, gen) -> torch.Tensor:
    """Per start token [n], it and gamma drafts after it (sampled from Q, or Q's argmax chain): [n, gamma + 1]."""
    chain = [starts]
    for _ in range(gamma):
        prev = chain[-1]
        chain.append(table[prev] if point_mass else torch.multinomial(Q[prev], 1, generator=gen)[:, 0])
    return torch.stack(chain, dim=1)


def verify_rounds(starts: torch.Tensor, gamma: int, P, Q, table, point_mass: bool, gen) -> list[list[int]]:
    """One draft-and-verify round after each start token [n]; the verdicts' tokens."""
    chains = draft_chains(starts, gamma, Q, table, point_mass, gen)
    p = P[chains]  # [n, gamma + 1, V]
    q = None if point_mass else Q[chains[:, :-1]]  # [n, gamma, V]
    return [
        verify_exact(p[i], None if q is None else q[i], chains[i, 1:], gen).tokens for i in range(len(chains))
    ]


def first_two_tokens(n: int, gamma: int, P, Q, table, point_mass: bool, seed: int) -> torch.Tensor:
    """n independent generations of two tokens after START, in as many rounds as they take: [n, 2]."""
    gen = torch.Generator().manual_seed(seed)
    rounds = verify_rounds(torch.full((n,), START), gamma, P, Q, table, point_mass, gen)
    short = [i for i, tokens in enumerate(rounds) if len(tokens) == 1]
    if short:
        starts = torch.tensor([rounds[i][0] for i in short])
        for i, more in zip(short, verify_rounds(starts, gamma, P, Q, table, point_mass, gen)):
            rounds[i] = rounds[i] + more
    return torch.tensor([tokens[:2] for tokens in rounds])


EXACT_CASES = {
    "gamma1-temperature": (1, WARPS["temperature"], False),
    "gamma2-top-k": (2, WARPS["top-k"], False),
    "gamma3-top-p": (3, WARPS["top-p"], False),
    "gamma4-top-k+top-p": (4, WARPS["top-k+top-p"], False),
    "gamma2-point-mass-temperature": (2, WARPS["low-temperature"], True),
    "gamma4-point-mass-top-p": (4, WARPS["top-p"], True),
}
SIZES = (10, 100, 1000, 10_000, 20_000)


@pytest.mark.parametrize("gamma, params, point_mass", EXACT_CASES.values(), ids=EXACT_CASES.keys())
def test_rejection_sampling_follows_the_warped_target(gamma, params, point_mass):
    """First and second output tokens converge to P[START] and (P @ P)[START] at the sampling-error
    rate, and at the largest N sit far closer to them than to the draft's law or random laws."""
    P, Q, table = markov_pair(params)
    samples = first_two_tokens(SIZES[-1], gamma, P, Q, table, point_mass, seed=gamma)
    exact = {0: P[START], 1: (P @ P)[START]}
    drafted = {0: Q[START], 1: (Q @ Q)[START]} if not point_mass else None
    uniform = torch.rand(50, V, generator=torch.Generator().manual_seed(3))
    randoms = -uniform.log() / (-uniform.log()).sum(dim=1, keepdim=True)  # [50, V] Dirichlet(1) laws
    for position, target in exact.items():
        distances = [tv(histogram(samples[:n, position]), target) for n in SIZES]
        for n, distance in zip(SIZES, distances):
            assert distance < tolerance(target, n), f"position {position}, N={n}: TV {distance:.4f}"
        assert distances[-1] < distances[0] / 10  # ~1/sqrt(N): 10 -> 2e4 samples is a factor ~45
        references = [tv(target, r) for r in randoms]
        if drafted is not None:
            references.append(tv(target, drafted[position]))
        assert distances[-1] < min(references) / 5, (distances[-1], min(references))


def test_rejection_sampling_converges_at_1e5():
    """The hardest case (gamma 4, top-k and top-p on both p and q) at N up to 10^5."""
    gamma, params, point_mass = EXACT_CASES["gamma4-top-k+top-p"]
    P, Q, table = markov_pair(params, seed=5)
    n = 100_000
    gen = torch.Generator().manual_seed(11)
    rounds = verify_rounds(torch.full((n,), START), gamma, P, Q, table, point_mass, gen)
    first = torch.tensor([tokens[0] for tokens in rounds])
    distances = [tv(histogram(first[:size]), P[START]) for size in (10, 100, 1000, 10_000, n)]
    assert distances[-1] < tolerance(P[START], n)
    assert distances[-1] < distances[0] / 20
    assert distances[-1] < 0.2 * tv(P[START], Q[START])


# --- EOS guard: banned ids on the target's side ----------------------------------------------


def test_token_ban_rows():
    ban = TokenBan.min_response({1, 7}, prompt_length=10, min_new_tokens=4)
    assert ban.ids == frozenset({1, 7}) and ban.until == 14
    assert [ban.rows(start, 5) for start in (8, 10, 12, 13, 14, 20)] == [5, 4, 2, 1, 0, 0]
    assert TokenBan.min_response(set(), 10, 4).rows(10, 3) == 0  # no EOS ids: nothing to guard
    assert TokenBan.min_response({1}, 10, 0).rows(10, 3) == 0


def test_mask_banned_only_touches_the_guarded_rows():
    logits = torch.randn(3, V)
    masked = mask_banned(logits, {2, 5}, 2)
    assert torch.isinf(masked[:2, [2, 5]]).all() and torch.equal(masked[2], logits[2])
    assert torch.equal(masked[:2, [0, 1, 3]], logits[:2, [0, 1, 3]])
    assert mask_banned(logits, {2}, 0) is logits and mask_banned(logits, set(), 3) is logits


def tiny_heads():
    """A full head and a certified (screen) head over the same tiny random weights, and hidden states."""
    tiny = make_tiny_head(bias=True, seed=7, vocab=512, rows=6)
    tensors, _ = build_screen(tiny.weight, group_size=0, progress=False)
    certified = CertifiedHead(tiny.weight, tiny.bias, ScreenBound.from_stage(tiny.weight, tiny.bias, tensors))
    return [FullHead(tiny.weight, tiny.bias), certified], tiny.hidden


SELECT_CASES = {
    "greedy": SamplingParams(),
    "temperature": SamplingParams(temperature=0.9),
    "top-k": SamplingParams(temperature=0.8, top_k=3),
    "top-p": SamplingParams(temperature=1.0, top_p=0.5),
}


@pytest.mark.parametrize("params", SELECT_CASES.values(), ids=SELECT_CASES.keys())
def test_select_allowed_equals_sampling_from_masked_logits(params):
    """Each head's guarded choice is sample_full on masked logits with the same Gumbel noise, on the
    guarded rows only, and the generator ends where an unguarded select leaves it."""
    heads, hidden = tiny_heads()
    B = hidden.shape[0]
    full_logits = heads[0].logits(hidden)  # [B, V]
    winners = full_logits.argmax(dim=1).tolist()
    # Ban some rows' own winners (the redo path) and a token that wins nowhere (the shortcut path).
    banned = {winners[0], winners[2], int(full_logits.sum(0).argmin())}
    for head in heads:
        for rows in (B, 3, 1):
            gen = torch.Generator().manual_seed(5)
            chosen = select_allowed(head, hidden, params, gen, banned, rows)
            after = gen.get_state()
            reference = torch.Generator().manual_seed(5)
            noise = None if params.greedy else gumbel_noise(B, head.vocab_size, reference)
            expected_rows = mask_banned(full_logits, banned, rows)
            expected = [sample_full(expected_rows[b], params, None if noise is None else noise[b]) for b in range(B)]
            assert chosen.tolist() == expected, (type(head).__name__, rows)
            assert not set(chosen[:rows].tolist()) & banned
            assert torch.equal(after, reference.get_state())


def test_select_allowed_without_a_ban_is_select():
    heads, hidden = tiny_heads()
    params = SamplingParams(temperature=0.7)
    for head in heads:
        a = select_allowed(head, hidden, params, torch.Generator().manual_seed(1), frozenset())
        b = head.select(hidden, params, torch.Generator().manual_seed(1))
        assert torch.equal(a, b)
        assert torch.equal(select_allowed(head, hidden, SamplingParams(), None, {1, 2}, 0), head.select(hidden, SamplingParams()))
