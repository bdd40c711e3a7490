"""Certified LM head on tiny random heads: token identity with the full head, exact Gumbel sampling,
epsilon mode, counters, and the near-tie limitation.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from factories import TinyHead, random_hidden
from head_factories import cluster_bound, exact_logits, hidden_sets, screen_bound
from runtime.heads import CertifiedHead, FullHead
from runtime.common.sampling import SamplingParams, gumbel_noise

SAMPLING_MODES = {
    "greedy": SamplingParams(),
    "temperature": SamplingParams(temperature=1.0),
    "low-temperature": SamplingParams(temperature=0.7),
    "top-k": SamplingParams(temperature=0.8, top_k=5),
    "top-p": SamplingParams(temperature=1.0, top_p=0.9),
    "top-k+top-p": SamplingParams(temperature=1.0, top_k=50, top_p=0.8),
}


# --- same tokens as the full head -----------------------------------------------------------


def mixed_hidden(head: TinyHead, rows: int = 24) -> torch.Tensor:
    """Hidden states from peaked (norm 100) to flat (norm 3) next-token distributions."""
    gen = torch.Generator().manual_seed(5)
    d = head.weight.shape[1]
    norms = torch.tensor([100.0, 30.0, 10.0, 3.0]).repeat(rows // 4)
    return random_hidden(rows, d, gen) / 100.0 * norms[:, None]


def certified_heads(head: TinyHead) -> dict[str, CertifiedHead]:
    return {
        "screen-per-row": CertifiedHead(head.weight, head.bias, screen_bound(head, 0)),
        "screen-group-32": CertifiedHead(head.weight, head.bias, screen_bound(head, 32)),
        "cluster": CertifiedHead(head.weight, head.bias, cluster_bound(head, max_open_fraction=1.0)),
        "cluster-budget": CertifiedHead(head.weight, head.bias, cluster_bound(head, max_open_fraction=0.25)),
    }


@pytest.mark.parametrize("mode", list(SAMPLING_MODES))
def test_certified_head_picks_the_full_heads_tokens(tiny_head: TinyHead, mode: str):
    params = SAMPLING_MODES[mode]
    hidden = mixed_hidden(tiny_head)
    full = FullHead(tiny_head.weight, tiny_head.bias)
    expected = full.select(hidden, params, torch.Generator().manual_seed(3))
    for name, head in certified_heads(tiny_head).items():
        got = head.select(hidden, params, torch.Generator().manual_seed(3))
        differing = torch.nonzero(got != expected).flatten().tolist()
        assert torch.equal(got, expected), f"{name} differs from the full head in rows {differing}"
    if not params.greedy:
        greedy = full.select(hidden, SamplingParams())
        assert bool((expected != greedy).any()), "the sampling test never left the argmax: it tests nothing"


def test_greedy_equals_argmax_of_exact_logits(tiny_head: TinyHead):
    for hidden in hidden_sets(tiny_head).values():
        argmax = exact_logits(tiny_head, hidden).argmax(dim=1)
        for name, head in certified_heads(tiny_head).items():
            assert torch.equal(head.select(hidden, SamplingParams()), argmax), name


# --- exact sampling -------------------------------------------------------------------------


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p.double() - q.double()).abs().sum())


def sampling_tolerance(vocab: int, n: int, failure: float = 1e-6) -> float:
    """A high-probability bound on TV(empirical of n exact samples, true distribution).

    E[TV] = 1/2 sum_i E|p^_i - p_i| <= 1/2 sum_i sqrt(p_i (1 - p_i) / n) <= 1/2 sqrt(V / n)
    (Jensen, then Cauchy-Schwarz over V terms). TV of the empirical distribution changes by at
    most 1/n when one sample changes, so McDiarmid gives P(TV > E[TV] + t) <= exp(-2 n t^2);
    t = sqrt(ln(1/failure) / (2n)). Both terms shrink like 1/sqrt(n).
    """
    return (0.5 * math.sqrt(vocab) + math.sqrt(math.log(1 / failure) / 2)) / math.sqrt(n)


def test_gumbel_sampling_converges_to_the_softmax():
    vocab, dim, temperature = 64, 16, 0.7
    gen = torch.Generator().manual_seed(21)
    weight = torch.randn(vocab, dim, generator=gen) * 0.25  # [V, d]
    hidden = torch.randn(dim, generator=gen)
    hidden = hidden / hidden.norm() * 6.0  # logits spread ~1.5: many tokens carry mass
    head = TinyHead(weight, None, hidden[None])
    logits = exact_logits(head, hidden[None])[0].double()
    target = torch.softmax(logits / temperature, 0)
    assert float(target.max()) < 0.5 and int((target > 1e-3).sum()) > 20  # a spread-out target

    certified = CertifiedHead(weight, None, screen_bound(head))
    n_max = 100_000
    tokens = certified.select(hidden.expand(n_max, dim).contiguous(), SamplingParams(temperature=temperature),
                              torch.Generator().manual_seed(0))
    # Gumbel scores closer than float32 rounding (~1e-4 of draws here) defer to the full head.
    assert certified.stats.certification_rate >= 0.999
    distances = {}
    for n in (1_000, 10_000, 100_000):  # prefixes of one fixed-seed stream = n fixed-seed draws
        empirical = torch.bincount(tokens[:n], minlength=vocab).double() / n
        distances[n] = total_variation(empirical, target)
        assert distances[n] <= sampling_tolerance(vocab, n), (n, distances[n])
    # Convergence: TV shrinks roughly like 1/sqrt(n) (x10 over x100 samples; allow x3).
    assert distances[100_000] < distances[1_000] / 3
    assert distances[10_000] < distances[1_000]

    empirical = torch.bincount(tokens, minlength=vocab).double() / n_max
    wrong = {
        "temperature 0.6": torch.softmax(logits / 0.6, 0),
        "temperature 0.8": torch.softmax(logits / 0.8, 0),
        "uniform": torch.full((vocab,), 1.0 / vocab, dtype=torch.float64),
        "top-2 swapped": _swap_top_two(target),
        "random logits": torch.softmax(torch.randn(vocab, generator=gen).double() * 1.5 / temperature, 0),
    }
    for name, reference in wrong.items():
        assert total_variation(empirical, reference) > 5 * distances[n_max], name


def _swap_top_two(p: torch.Tensor) -> torch.Tensor:
    """p with the probabilities of its two most likely tokens exchanged."""
    first, second = torch.topk(p, 2).indices.tolist()
    q = p.clone()
    q[first], q[second] = p[second], p[first]
    return q


class OpenedRecorder:
    """Wraps a bound and remembers the last opened set it returned."""

    def __init__(self, bound) -> None:
        self.bound, self.last = bound, None

    def __getattr__(self, name):
        return getattr(self.bound, name)

    def open_topk(self, *args, **kwargs):
        self.last = self.bound.open_topk(*args, **kwargs)
        return self.last


def popular_tokens_head() -> TinyHead:
    """A head where 64 tokens hold ~98 % of the mass: the top-64 set leaves some mass out."""
    vocab, dim = 4096, 64
    gen = torch.Generator().manual_seed(31)
    weight = torch.randn(vocab, dim, generator=gen) / dim**0.5
    popular = torch.randperm(vocab, generator=gen)[:64]
    bias = torch.zeros(vocab)
    bias[popular] = 8.0
    return TinyHead(weight, bias, random_hidden(8, dim, gen, norm=10.0))


@pytest.mark.parametrize("epsilon", [0.01, 0.05])
def test_epsilon_mode_total_variation_is_at_most_epsilon(epsilon: float):
    head = popular_tokens_head()
    recorder = OpenedRecorder(screen_bound(head, max_open_fraction=1.0))  # its top-1024 set is 25 % of this vocabulary
    certified = CertifiedHead(head.weight, head.bias, recorder)
    params = SamplingParams(temperature=1.0, epsilon=epsilon)
    full = torch.softmax(exact_logits(head, head.hidden).double(), dim=1)  # [B, V]
    generator = torch.Generator().manual_seed(0)
    for row in range(head.hidden.shape[0]):
        token = int(certified.select(head.hidden[row : row + 1], params, generator)[0])
        opened = recorder.last.ids
        assert token in opened.tolist()
        # Sampling exactly from softmax restricted to the opened set: TV to the full softmax is the
        # full softmax's mass outside that set.
        outside = 1.0 - float(full[row, opened].sum())
        assert 0 < outside <= epsilon, (row, outside)
        assert opened.numel() < head.weight.shape[0]
    assert certified.stats.fallbacks == 0


# --- counters -------------------------------------------------------------------------------


def test_screen_head_certifies_every_row_and_counts_what_it_opened(tiny_head: TinyHead):
    bound = screen_bound(tiny_head)
    certified = CertifiedHead(tiny_head.weight, tiny_head.bias, bound)
    hidden = tiny_head.hidden
    certified.select(hidden, SamplingParams())
    stats = certified.stats
    rows, vocab = hidden.shape[0], tiny_head.weight.shape[0]
    state = bound.prepare(hidden)
    opened = sum(int(bound.open_topk(state, r, 1, 0.0, None).ids.numel()) for r in range(rows))
    assert (stats.rows, stats.certified, stats.fallbacks) == (rows, rows, 0)
    assert stats.recomputed_tokens == opened
    assert stats.certification_rate == 1.0 and stats.fallback_rate == 0.0
    assert 0 < stats.recomputed_fraction == opened / (rows * vocab) < 0.05


def test_cluster_head_over_budget_falls_back_and_counts_it(tiny_head: TinyHead):
    hidden = mixed_hidden(tiny_head, rows=12)
    full = FullHead(tiny_head.weight, tiny_head.bias)
    certified = CertifiedHead(tiny_head.weight, tiny_head.bias, cluster_bound(tiny_head, max_open_fraction=1e-4))
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        expected = full.select(hidden, params, torch.Generator().manual_seed(1))
        assert torch.equal(certified.select(hidden, params, torch.Generator().manual_seed(1)), expected)
    stats = certified.stats
    assert stats.rows == 2 * hidden.shape[0]
    assert stats.fallbacks > 0 and stats.certified + stats.fallbacks == stats.rows
    assert stats.fallback_rate == stats.fallbacks / stats.rows
    assert math.isclose(stats.certification_rate + stats.fallback_rate, 1.0)
    # A fallback recomputes the whole vocabulary, after whatever the bound opened before giving up.
    assert stats.recomputed_tokens >= stats.fallbacks * tiny_head.weight.shape[0]
    assert stats.fallback_rate <= stats.recomputed_fraction <= 2.0
    assert stats.required_open_tokens > 0


def test_screen_head_past_its_budget_falls_back_without_recomputing(tiny_head: TinyHead):
    """A row whose candidates exceed the budget recomputes none of them and takes the full head: the
    same tokens, counted as fallbacks that recomputed the vocabulary once."""
    hidden = mixed_hidden(tiny_head, rows=12)
    vocab = tiny_head.weight.shape[0]
    unlimited, budgeted = screen_bound(tiny_head, max_open_fraction=1.0), screen_bound(tiny_head, max_open_fraction=1.5 / vocab)  # one candidate
    full = FullHead(tiny_head.weight, tiny_head.bias)
    for params in (SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)):
        generator = torch.Generator().manual_seed(2)
        noise = None if params.greedy else gumbel_noise(hidden.shape[0], vocab, generator)  # [B, V]
        state, wide = budgeted.prepare(hidden), unlimited.prepare(hidden)
        over = []
        for row in range(hidden.shape[0]):
            row_noise = None if noise is None else noise[row]
            candidates = unlimited.open_topk(wide, row, 1, params.temperature, row_noise).ids.numel()
            opened = budgeted.open_topk(state, row, 1, params.temperature, row_noise)
            assert opened.certified == (candidates <= budgeted.max_open_tokens)
            assert opened.ids.numel() == (candidates if opened.certified else 0) == opened.logits.numel()
            over.append(not opened.certified)
        if params.top_p == 1.0:
            assert any(over) and not all(over), "the budget should split these rows: it tests nothing"
        head = CertifiedHead(tiny_head.weight, tiny_head.bias, budgeted)
        expected = full.select(hidden, params, torch.Generator().manual_seed(2))
        assert torch.equal(head.select(hidden, params, torch.Generator().manual_seed(2)), expected)
        stats = head.stats
        assert stats.fallbacks >= sum(over) > 0 and stats.certified + stats.fallbacks == stats.rows == hidden.shape[0]
        assert stats.recomputed_tokens <= stats.fallbacks * vocab + stats.certified * budgeted.max_open_tokens


def test_full_head_recomputes_everything(tiny_head: TinyHead):
    full = FullHead(tiny_head.weight, tiny_head.bias)
    full.select(tiny_head.hidden, SamplingParams())
    assert full.stats.rows == tiny_head.hidden.shape[0]
    assert full.stats.recomputed_fraction == 1.0


# --- known limitation -----------------------------------------------------------------------


# Different float32 summation orders (gathered rows vs the full GEMV) can split a near-tie between
# the top two tokens differently; the certified head must then defer to the full head.
def test_greedy_near_tie_resolves_like_the_full_head():
    vocab, dim = 4096, 64
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(vocab, dim, generator=gen) / dim**0.5
    hidden = torch.randn(1, dim, generator=gen)
    hidden = hidden / hidden.norm() * 100
    top = int(F.linear(hidden, weight)[0].argmax())
    twin = (top + 1234) % vocab
    weight[twin] = weight[top] + torch.randn(dim, generator=gen) * 1e-7  # a near-duplicate row
    head = TinyHead(weight, None, hidden)
    expected = FullHead(weight).select(hidden, SamplingParams())
    got = CertifiedHead(weight, None, screen_bound(head)).select(hidden, SamplingParams())
    assert torch.equal(got, expected)


def test_tie_margins_from_the_screen_stage_are_the_computed_ones_rounded_up(tiny_head: TinyHead):
    """The screen stage's |W_i| (float64 rounded up to float32) replaces dequantizing the head for the
    near-tie margins: never below the computed ones, and at most a float32 step or two above."""
    from_stage = CertifiedHead(tiny_head.weight, tiny_head.bias, screen_bound(tiny_head)).tie_coefficients
    computed = CertifiedHead(tiny_head.weight, tiny_head.bias, cluster_bound(tiny_head)).tie_coefficients
    assert bool((from_stage >= computed).all())
    assert bool((from_stage <= computed * (1 + 2**-21)).all())
    assert not torch.equal(from_stage, computed)  # the stage's norms are in use, not recomputed
