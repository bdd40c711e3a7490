"""The ladder's row-wise kernels: RMSNorm, q/k preparation, single-query attention, fused projections.

Each is checked against an independent torch formulation (close: a different summation order),
for the property the ladder relies on (a row's bits do not depend on the other rows, the order
of keys is all that matters to attention) with torch.equal, and across every compiled path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from runtime.kernels import attend, prepare_qkv, quant_linear, quant_linear_parts, rms_norm
from runtime.kernels import build

from factories import compiled_module, needs_compiled_kernels, random_matrix


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cache(kv: int, capacity: int, hd: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(kv, capacity, hd, generator=g), torch.randn(kv, capacity, hd, generator=g)


@pytest.mark.parametrize("d", [640, 77, 16])
def test_rms_norm_matches_transformers_formula_and_rows_are_independent(d: int) -> None:
    g = _generator(d)
    x, factor = torch.randn(7, d, generator=g) * 3, torch.randn(d, generator=g)
    expected = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * factor
    together = rms_norm(x, factor, 1e-6)
    torch.testing.assert_close(together, expected, rtol=1e-6, atol=1e-6)
    for r in range(x.shape[0]):
        assert torch.equal(rms_norm(x[r : r + 1], factor, 1e-6), together[r : r + 1])
    assert torch.equal(rms_norm(x.view(7, 1, d), factor, 1e-6).view(7, d), together)  # any leading shape


@pytest.mark.parametrize("head_norms", [False, True], ids=["plain", "gemma-head-norms"])
def test_prepare_qkv_rotates_normalizes_and_caches(head_norms: bool) -> None:
    g = _generator(1)
    count, heads, kv, hd, start = 3, 4, 2, 32, 5
    qkv = torch.randn(count, heads + 2 * kv, hd, generator=g)
    cos, sin = torch.randn(40, hd, generator=g), torch.randn(40, hd, generator=g)
    positions = torch.tensor([7, 9, 8])
    factors = (torch.randn(hd, generator=g), torch.randn(hd, generator=g)) if head_norms else None
    keys, values = torch.zeros(kv, 16, hd), torch.zeros(kv, 16, hd)
    q, k, v = (part.clone() for part in qkv.split((heads, kv, kv), dim=1))
    if factors:
        q = (q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)) * factors[0]
        k = (k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6)) * factors[1]
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s

    prepare_qkv(qkv, heads, factors, 1e-6, (cos, sin), positions, keys, values, start)

    torch.testing.assert_close(qkv[:, :heads], q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys[:, start : start + count], k.transpose(0, 1), rtol=1e-5, atol=1e-5)
    assert torch.equal(values[:, start : start + count], v.transpose(0, 1))
    assert torch.equal(keys[:, :start], torch.zeros(kv, start, hd))  # nothing else written


@pytest.mark.parametrize("hd", [64, 128, 256, 4, 24])
def test_attend_matches_sdpa_and_depends_only_on_the_keys_it_reads(hd: int) -> None:
    g = _generator(2)
    count, heads, kv, scale = 4, 6, 2, 0.125
    qkv = torch.randn(count, heads + 2 * kv, hd, generator=g)
    keys, values = _cache(kv, 48, hd, g)
    # 9 to 41 keys: the softmax's 16-wide steps and its tail
    first, end, no_path = torch.tensor([0, 3, 0, 10]), torch.tensor([9, 35, 41, 12]), torch.empty(count, 0, dtype=torch.long)
    out = attend(qkv, heads, keys, values, first, end, no_path, scale)  # [T, H hd]
    for t in range(count):
        ref = F.scaled_dot_product_attention(
            qkv[t : t + 1, :heads].transpose(0, 1).unsqueeze(0),
            keys[:, int(first[t]) : int(end[t])].unsqueeze(0), values[:, int(first[t]) : int(end[t])].unsqueeze(0),
            scale=scale, enable_gqa=True,
        )[0, :, 0].reshape(-1)
        torch.testing.assert_close(out[t], ref, rtol=1e-5, atol=1e-6)
        alone = attend(qkv[t : t + 1], heads, keys, values, first[t : t + 1], end[t : t + 1], no_path[t : t + 1], scale)
        assert torch.equal(alone[0], out[t])  # a query's bits do not depend on the others
    # The same keys elsewhere in the cache, read through a path of slots, give the same bits.
    moved_k, moved_v = keys.clone(), values.clone()
    moved_k[:, 20:23], moved_v[:, 20:23] = keys[:, 9:12].flip(1), values[:, 9:12].flip(1)
    via_path = attend(qkv[3:4], heads, moved_k, moved_v, torch.tensor([0]), torch.tensor([9]), torch.tensor([[22, 21, 20, -1]]), scale)
    assert torch.equal(via_path, attend(qkv[3:4], heads, keys, values, torch.tensor([0]), torch.tensor([12]), no_path[:1], scale))
    # The query heads of a kv head go through the keys together; each keeps the bits it has alone.
    group = heads // kv
    for h in range(heads):
        g_kv = h // group
        single = torch.cat([qkv[:, h : h + 1], qkv[:, heads + g_kv : heads + g_kv + 1], qkv[:, heads + kv + g_kv : heads + kv + g_kv + 1]], dim=1)
        alone = attend(single, 1, keys[g_kv : g_kv + 1], values[g_kv : g_kv + 1], first, end, no_path, scale)  # [T, hd]
        assert torch.equal(alone, out[:, h * hd : (h + 1) * hd])


@needs_compiled_kernels
def test_quant_linear_parts_is_the_parts_side_by_side() -> None:
    parts = [random_matrix(T.Q5_0, 19, 256, seed=1), random_matrix(T.Q4_K, 7, 256, seed=2), random_matrix(T.Q8_0, 5, 256, seed=3)]
    x = torch.randn(9, 256, generator=_generator(3))
    for n in (1, 3, 9):
        expected = torch.cat([quant_linear(x[:n], w) for w in parts], dim=1)
        assert torch.equal(quant_linear_parts(x[:n], parts), expected)


@needs_compiled_kernels
@pytest.mark.parametrize("path", build.PATHS)
@pytest.mark.parametrize("hd", [40, 64, 128, 256])  # 64 / 128 / 256: attention's shared-key passes, as many heads as each path holds
def test_layer_ops_bit_identical_on_every_compiled_path(path: str, hd: int) -> None:
    other, active = compiled_module(path), build.active()[1]
    g = _generator(4)
    x, factor = torch.randn(5, 77, generator=g), torch.randn(77, generator=g)
    assert torch.equal(other.rms_norm(x, factor, 1e-6), active.rms_norm(x, factor, 1e-6))
    heads, kv = 8, 2
    qkv = torch.randn(3, heads + 2 * kv, hd, generator=g)
    cos, sin = torch.randn(20, hd, generator=g), torch.randn(20, hd, generator=g)
    norms = torch.randn(hd, generator=g), torch.randn(hd, generator=g)
    results = []
    for module in (other, active):
        cache, mine = _cache(kv, 40, hd, _generator(5)), qkv.clone()
        module.prepare_qkv(mine, heads, *norms, 1e-6, cos, sin, torch.tensor([3, 4, 5]), *cache, 3)
        out = module.attend(mine, heads, *cache, torch.tensor([0, 0, 1]), torch.tensor([4, 5, 6]), torch.tensor([[9, -1], [-1, -1], [8, 7]]), 0.2)
        long_rows = module.attend(mine[:2].contiguous(), heads, *cache, torch.tensor([0, 2]), torch.tensor([16, 33]), torch.tensor([[-1], [-1]]), 0.2)
        results.append((mine, *cache, out, long_rows))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@needs_compiled_kernels
@pytest.mark.parametrize("path", build.PATHS)
def test_softmax_exp_within_an_ulp_and_the_same_on_every_path(path: str) -> None:
    """Attention's exp is ours (simd ops, not the C library's): within 1 ulp of exp, the same bits on every path."""
    other, active = compiled_module(path), build.active()[1]
    x = -torch.linspace(0, 87, 100_001)  # exp's whole normal range below 0
    pairs = torch.stack([torch.zeros_like(x), x], dim=1)  # [R, 2]: weights 1 and exp(x)
    weights, sums = active.softmax(pairs, 1.0)
    exact = torch.exp(x.double())
    ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact).exponent - 24)  # float32's ulp, in float64 (no subnormals)
    assert torch.equal(weights[:, 0], torch.ones_like(x))
    assert ((weights[:, 1].double() - exact).abs() / ulp).max() <= 1.0
    assert torch.equal(sums, weights.sum(dim=1))  # two terms: one rounding either way
    assert torch.equal(other.softmax(pairs, 1.0)[0], weights)
    g = _generator(6)
    for n in (1, 15, 16, 17, 40):
        scores = torch.randn(3, n, generator=g) * 8
        mine, total = active.softmax(scores, 0.3)
        torch.testing.assert_close(mine / total[:, None], torch.softmax(scores * 0.3, dim=1), rtol=1e-6, atol=1e-7)
        theirs = other.softmax(scores, 0.3)
        assert torch.equal(theirs[0], mine) and torch.equal(theirs[1], total)
    nan_row = active.softmax(torch.tensor([[0.0, float("nan"), -1.0]]), 1.0)
    assert nan_row[0][0, 1].isnan() and nan_row[1][0].isnan()
