"""Bounds of the certified LM head on tiny random heads: the screen and cluster bounds are sound,
and the screening kernels agree with torch and float64 references.
"""

from __future__ import annotations

import pytest
import torch

from factories import TinyHead, compiled_module, make_tiny_head
from head_factories import cluster_bound, exact_logits, hidden_sets, screen_bound
from prep.screen import quantize_int8
from runtime.heads.opened import GATHER_CHUNK_ROWS
from runtime.heads.opened import exact_logits as opened_exact_logits
from runtime.heads.screen_bound import _SLACK
from runtime.common.numerics import dot_rounding_gamma
from runtime.kernels import _screen_gemv_torch, screen_gemv, screen_radius, screen_select


# --- bound soundness ------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [0, 16, 32], ids=["per-row", "group-16", "group-32"])
def test_screen_bound_contains_every_exact_logit(tiny_head: TinyHead, group_size: int):
    bound = screen_bound(tiny_head, group_size)
    for name, hidden in hidden_sets(tiny_head).items():
        state = bound.prepare(hidden)
        exact = exact_logits(tiny_head, hidden)  # [B, V]
        for row in range(hidden.shape[0]):
            radius = bound.radius(state, row)  # [V]
            error = (exact[row] - state.center[row]).abs()
            assert bool((error <= radius).all()), f"{name} row {row}: {int((error > radius).sum())} logits outside"
            # Sound and still useful: the interval is far narrower than the spread of the logits.
            assert float(radius.median()) < 0.1 * float(exact[row].std())


def test_screen_bound_radius_scales_with_the_hidden_norm(tiny_head: TinyHead):
    bound = screen_bound(tiny_head)
    hidden = tiny_head.hidden[:1]
    # x8, a power of two: the int16 split of 8h is the split of h with e + 3, so its remainder scales too.
    small, large = bound.prepare(hidden), bound.prepare(hidden * 8)
    ratio = bound.radius(large, 0) / bound.radius(small, 0)
    assert torch.allclose(ratio, torch.full_like(ratio, 8.0), rtol=1e-3)


def scaled_rows_head(bias: bool) -> TinyHead:
    """Raw, unnormalized rows whose norms span ~4 orders of magnitude (the cluster bound's hard case)."""
    head = make_tiny_head(bias=bias, seed=11)
    gen = torch.Generator().manual_seed(12)
    norms = torch.exp(torch.randn(head.weight.shape[0], generator=gen) * 1.5)  # [V]
    return TinyHead(head.weight * norms[:, None], head.bias, head.hidden)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_cluster_bound_is_above_every_logit_of_its_cluster(bias: bool):
    head = scaled_rows_head(bias)
    bound = cluster_bound(head)
    always_open = torch.zeros(head.weight.shape[0], dtype=torch.bool)
    if bias:
        # The m largest biases of each cluster are always opened; the bound covers the rest only.
        always_open[bound._always_open()] = True
        assert 0 < int(always_open.sum()) <= 3 * len(bound.sizes)
    for name, hidden in hidden_sets(head).items():
        state = bound.prepare(hidden)
        upper = state.upper[:, bound.cluster_of_token]  # [B, V] bound of each token's cluster
        exact = exact_logits(head, hidden).double()
        covered = exact[:, ~always_open] <= upper[:, ~always_open]
        assert bool(covered.all()), f"{name}: {int((~covered).sum())} logits above their cluster bound"
        # Per cluster: the bound is at or above the true maximum logit of the cluster.
        masked = exact.masked_fill(always_open, float("-inf"))
        cluster_max = torch.full_like(state.upper, float("-inf"))
        cluster_max.scatter_reduce_(1, bound.cluster_of_token.expand_as(masked), masked, reduce="amax")
        assert bool((cluster_max <= state.upper).all())


# --- kernels --------------------------------------------------------------------------------


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """Run with this many torch threads (the kernel splits rows across torch's thread pool)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("group_size", [0, 16, 32], ids=["per-row", "group-16", "group-32"])
@pytest.mark.parametrize("batch", [1, 3])
def test_screen_gemv_matches_the_torch_reference(group_size: int, batch: int, threads: int):
    # 4099 rows: not a multiple of the kernel's 4-row blocks nor of its 4096-row work chunks, so
    # with 2 threads a chunk starts mid-block.
    head = make_tiny_head(vocab=4099, seed=2)
    q = quantize_int8(head.weight, group_size)
    hidden = head.hidden[:batch]
    got = screen_gemv(q["qweight"], q["scales"], hidden)
    reference = _screen_gemv_torch(q["qweight"], q["scales"], hidden)
    assert got.shape == (batch, 4099) and got.dtype == torch.float32
    # Two float32 summation orders of the same products: 1e-4 absolute for logits up to 1 in size,
    # relative beyond (the 50x rows give logits ~600, whose float32 spacing alone is 6e-5).
    tolerance = 1e-4 * reference.abs().clamp(min=1.0)
    assert bool(((got - reference).abs() <= tolerance).all()), float((got - reference).abs().max())
    # And both against the float64 product with the dequantized head.
    group = group_size or head.weight.shape[1]
    dequant = (q["qweight"].double().view(4099, -1, group) * q["scales"].double()[..., None]).view(4099, -1)
    assert bool(((got.double() - hidden.double() @ dequant.T).abs() <= tolerance).all())


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("with_noise", [False, True], ids=["no-noise", "gumbel"])
@pytest.mark.parametrize("k", [1, 5, 64])
def test_screen_select_keeps_the_true_top_k_and_follows_the_bound_definition(temperature: float, with_noise: bool, k: int):
    """Checked against float64 brute force, not a copy of the kernel's fallback: (1) the exact top-k of
    l/T + noise (l from the fp32 weights in float64) is among the candidates; (2) a token is a
    candidate exactly when its upper bound reaches the k-th best lower bound, up to float32 rounding."""
    head = make_tiny_head(seed=4)
    bound = screen_bound(head)
    state = bound.prepare(head.hidden)
    gen = torch.Generator().manual_seed(9)
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    for row in range(4):
        noise = -torch.log(-torch.log(torch.rand(head.weight.shape[0], generator=gen))) if with_noise else None
        hidden_norm = float(state.hidden_norm[row])
        got = screen_select(state.center[row].contiguous(), bound.coefficients, hidden_norm, _SLACK, temperature, noise, k)
        assert got.numel() >= k
        chosen = torch.zeros(head.weight.shape[0], dtype=torch.bool)
        chosen[got] = True
        g = torch.zeros(head.weight.shape[0], dtype=torch.float64) if noise is None else noise.double()  # [V]
        exact = head.weight.double() @ head.hidden[row].double()  # [V]
        assert bool(chosen[torch.topk(exact * inv_t + g, k).indices].all())
        center = state.center[row].double()
        radius = bound.coefficients.double() * hidden_norm  # the bound's radius, before float32 slack
        lower, upper = (center - radius) * inv_t + g, (center + radius) * inv_t + g  # [V]
        kth = torch.topk(lower, k).values[-1]
        tolerance = 1e-4 * (1 + float(upper.abs().max()))  # float32 rounding and the kernel's slack
        assert bool((upper[chosen] >= kth - tolerance).all())
        assert bool((upper[~chosen] < kth + tolerance).all())


@pytest.mark.parametrize("k", [1, 5, 64])
def test_avx2_screen_select_is_the_torch_selection(k: int):
    """The AVX2 kernel computes the bounds in torch's float32 operations: the same candidates, at a
    vocabulary size that leaves a tail of one-at-a-time tokens, with and without noise, temperature
    and the remainder term."""
    module = compiled_module("avx2")
    gen = torch.Generator().manual_seed(11)
    V = 4099
    center, coef, qnorm = torch.randn(V, generator=gen) * 8, torch.rand(V, generator=gen), torch.rand(V, generator=gen)
    noise = -torch.log(-torch.log(torch.rand(V, generator=gen)))
    empty = torch.empty(0)
    for temperature, g, n, rnorm in [(0.0, None, None, 0.0), (0.7, noise, None, 0.0), (0.0, None, qnorm, 0.3), (1.3, noise, qnorm, 0.1)]:
        inv_t = 1.0 / temperature if temperature > 0 else 1.0
        radius = screen_radius(center, coef, 2.5, _SLACK, n, rnorm)
        lower, upper = (center - radius) * inv_t, (center + radius) * inv_t
        if g is not None:
            lower, upper = lower + g, upper + g
        expected = torch.nonzero(upper >= torch.topk(lower, k).values[-1]).flatten()
        got = module.screen_select(center, coef, 2.5, empty if n is None else n, rnorm, _SLACK, inv_t, empty if g is None else g, k)
        assert torch.equal(got, expected), (temperature, k)


def test_cluster_bound_with_the_whole_vocabulary_as_budget_always_certifies():
    # Regression: the budget check once counted the always-open top-bias tokens twice, so with a
    # bias even max_open_fraction=1.0 gave up just before opening the last clusters.
    head = make_tiny_head(bias=True)
    bound = cluster_bound(head, max_open_fraction=1.0)
    state = bound.prepare(head.hidden)
    vocab = head.weight.shape[0]
    for row in range(4):
        opened = bound.open_topk(state, row, vocab, 0.0, None)  # top-V: must open every cluster
        assert opened.certified and opened.ids.numel() == vocab
        assert torch.equal(torch.sort(opened.ids).values, torch.arange(vocab))


def test_exact_logits_in_chunks_are_float32_dots_of_every_row():
    """exact_logits gathers rows in chunks of GATHER_CHUNK_ROWS: every id, in order, each logit a float32
    dot product within its rounding bound (the certified head's tie margins assume no more)."""
    gen = torch.Generator().manual_seed(4)
    vocab, dim = 3 * GATHER_CHUNK_ROWS + 17, 64
    weight, bias, hidden = torch.randn(vocab, dim, generator=gen), torch.randn(vocab, generator=gen), torch.randn(dim, generator=gen)
    ids = torch.randperm(vocab, generator=gen)[: 2 * GATHER_CHUNK_ROWS + 5]  # more than two chunks, unsorted
    got = opened_exact_logits(weight, bias, hidden, ids)  # [n]
    reference = weight.double()[ids] @ hidden.double()  # [n]
    bound = dot_rounding_gamma(dim) * (weight.double()[ids].abs() @ hidden.double().abs())
    assert got.shape == ids.shape and got.dtype == torch.float32
    assert bool(((got - bias[ids] - reference).abs() <= bound + 1e-6).all())
    assert opened_exact_logits(weight, None, hidden, ids[:0]).numel() == 0
