"""The int16 screen: h split exactly into 2^e a + r, integer dot products, and a sound radius.

Checked against integer and float64 references written here, not against the kernel itself: the
int8 x int16 dots are exact (both instruction paths give the same bits), the remainder's norm is
|h - 2^e a|, and every exact logit lies inside the radius the certified head uses.
"""

from __future__ import annotations

import math

import pytest
import torch

from factories import make_tiny_head
from head_factories import exact_logits, screen_bound
from prep.screen import quantize_int8
from runtime.heads.screen_bound import _SLACK
from runtime.kernels import build, screen_select


INT16_PATHS = ["avx512", "avx2"]  # the compiled paths with an int16 screen


def int16_module(path: str = "avx512"):
    """The module of `path`, skipping (with the reason) where this CPU cannot run it."""
    missing = build.missing_cpu_flags(path)
    if missing:
        pytest.skip(f"the {path} int16 screen cannot run here; this CPU lacks {', '.join(missing)}")
    return build.module(path)


def exact_centers(q: dict, hidden: torch.Tensor) -> torch.Tensor:
    """The kernel's centers [B, V] from the reference split: exact int64 dots, then its two float32 roundings."""
    rows = []
    for h in hidden:
        a, e = reference_split(h)
        rows.append((q["qweight"].long() @ a).float() * q["scales"][:, 0] * 2.0**e)
    return torch.stack(rows)


def reference_split(h: torch.Tensor, limit: int = 32767) -> tuple[torch.Tensor, int]:
    """(a [d] int64, e) with the smallest e such that max |h| 2^-e <= limit, a = round-half-even(h 2^-e)."""
    amax = float(h.abs().max())
    if amax == 0:
        return torch.zeros(h.shape, dtype=torch.long), 0
    e = math.frexp(amax / limit)[1] + 1
    while e > -1000 and amax * 2.0 ** -(e - 1) <= limit:
        e -= 1
    return torch.round(h.double() * 2.0**-e).long(), e


def adversarial_hidden(d: int) -> torch.Tensor:
    """Rows that stress the split: one massive coordinate, tiny values, a power of two at 32767's edge, zeros."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(6, d, generator=gen)
    rows[0, 5] = 4.0e3  # one outlier: every other coordinate gets few integer levels
    rows[1] *= 1e-12  # far below 1: a negative exponent
    rows[2] = torch.full((d,), 32767.0)  # exactly the int16 limit at e = 0
    rows[2, 1] = -32768.0  # just above it: e = 1
    rows[3] = 0.0
    rows[4] *= 1e6
    return rows


@pytest.mark.parametrize("path, vnni", [("avx512", False), ("avx512", True), ("avx2", False)],
                         ids=["avx512-vpmaddwd", "avx512-vpdpwssd", "avx2-vpmaddwd"])
def test_int16_screen_is_the_exact_integer_dot_product(path: str, vnni: bool):
    module = int16_module(path)
    if vnni and "avx512_vnni" not in build.cpu_flags():
        pytest.skip("this CPU does not report avx512_vnni")
    head = make_tiny_head(vocab=1027, dim=96, seed=5)  # 1027 rows: not a multiple of the kernel's row blocks
    q = quantize_int8(head.weight, 0)
    hidden = torch.cat([head.hidden[:3], adversarial_hidden(96)])  # [9, 96]: more rows than one batch pass
    center, remainder = module.screen_gemv_int16(q["qweight"], q["scales"], hidden, vnni)
    for count in range(1, hidden.shape[0]):  # every rows-per-pass shape gives the same bits as the whole batch
        assert torch.equal(module.screen_gemv_int16(q["qweight"], q["scales"], hidden[:count], vnni)[0], center[:count])
    for row in range(hidden.shape[0]):
        a, e = reference_split(hidden[row])
        assert int(a.abs().max()) <= 32767
        dots = q["qweight"].long() @ a  # [V], exact in int64
        expected = dots.float() * q["scales"][:, 0] * 2.0**e  # the kernel's two float32 roundings
        assert torch.equal(center[row], expected), row
        r = hidden[row].double() - a.double() * 2.0**e  # exact in float64
        assert float(remainder[row]) >= float(r.norm())
        assert float(remainder[row]) <= float(r.norm()) * (1 + 1e-9) + 1e-300


@pytest.mark.parametrize("path", INT16_PATHS)
def test_whole_row_dots_past_int32_stay_exact(path: str):
    """|<q, a>| reaches d * 128 * 32767: past 2^31 from d = 512 on (here 1024 columns of +-127 against a
    constant row, 4.26e9). The int32 lanes cannot overflow, and their sum is taken in int64."""
    module = int16_module(path)
    d = 1024
    qweight = torch.full((37, d), 127, dtype=torch.int8)
    qweight[1] = -127
    qweight[2, ::2] = -128
    qweight[3] = torch.randint(-128, 128, (d,), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    q = {"qweight": qweight, "scales": torch.full((37, 1), 0.01)}
    hidden = torch.stack([torch.full((d,), -3.5), torch.full((d,), 1.0), torch.randn(d, generator=torch.Generator().manual_seed(2))])
    center, _ = module.screen_gemv_int16(q["qweight"], q["scales"], hidden, False)
    assert torch.equal(center, exact_centers(q, hidden))
    assert float(center[0, 0]) < -3e3  # the true sign: an int32 total wraps to +1260


def test_the_avx2_screen_gives_the_avx512_bits():
    avx2, avx512 = int16_module("avx2"), int16_module("avx512")
    head = make_tiny_head(vocab=1027, dim=96, seed=5)
    q = quantize_int8(head.weight, 0)
    hidden = torch.cat([head.hidden, adversarial_hidden(96)])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            a = avx2.screen_gemv_int16(q["qweight"], q["scales"], hidden, False)
            b = avx512.screen_gemv_int16(q["qweight"], q["scales"], hidden, False)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="no VNNI path"):
        avx2.screen_gemv_int16(q["qweight"], q["scales"], hidden, True)


def test_both_instruction_paths_give_the_same_bits():
    module = int16_module()
    if "avx512_vnni" not in build.cpu_flags():
        pytest.skip("this CPU does not report avx512_vnni: only the vpmaddwd path can run here")
    head = make_tiny_head(vocab=515, dim=128, seed=6)
    q = quantize_int8(head.weight, 0)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        a = module.screen_gemv_int16(q["qweight"], q["scales"], head.hidden, False)
        b = module.screen_gemv_int16(q["qweight"], q["scales"], head.hidden, True)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("bad", ["nan", "inf", "tiny", "huge"])
def test_rows_the_split_cannot_serve_get_an_infinite_remainder_and_the_screen_falls_back(bad: str):
    """Non-finite rows, and rows whose float32 products after the integer dot could leave float32's
    normal range (max |h| outside [2^-60, 2^60]), are screened with float32 activations."""
    module = int16_module()
    head = make_tiny_head(seed=7)
    q = quantize_int8(head.weight, 0)
    hidden = head.hidden[:2].clone()
    if bad in ("nan", "inf"):
        hidden[1, 4] = float(bad)
    else:
        hidden[1] *= 1e-22 if bad == "tiny" else 1e22
    _, remainder = module.screen_gemv_int16(q["qweight"], q["scales"], hidden, False)
    assert math.isfinite(float(remainder[0])) and math.isinf(float(remainder[1]))
    bound = screen_bound(head)
    state = bound.prepare(hidden)
    assert state.remainder_norm is None  # float32 activations for this batch: the bound has no split term
    if bad in ("tiny", "huge"):  # and the float32 screen's bound holds for them
        error = (exact_logits(head, hidden)[1] - state.center[1]).abs()
        assert bool((error <= bound.radius(state, 1)).all())


def test_int16_screen_bound_contains_every_exact_logit_on_adversarial_rows():
    int16_module()
    head = make_tiny_head(seed=8)
    bound = screen_bound(head)
    hidden = adversarial_hidden(head.weight.shape[1])
    state = bound.prepare(hidden)
    assert state.remainder_norm is not None
    exact = exact_logits(head, hidden)  # [B, V] float32, the full head's values
    exact64 = hidden.double() @ head.weight.double().T  # [B, V]
    for row in range(hidden.shape[0]):
        radius = bound.radius(state, row).double()  # [V]
        center = state.center[row].double()
        assert bool(((exact[row].double() - center).abs() <= radius).all()), row
        assert bool(((exact64[row] - center).abs() <= radius).all()), row


@pytest.mark.parametrize("k", [1, 16])
def test_select_with_the_remainder_term_matches_the_bound_definition(k: int):
    """The kernel's candidates equal those of the radius computed here in float64, up to float32 rounding."""
    int16_module()
    head = make_tiny_head(seed=9)
    bound = screen_bound(head)
    hidden = head.hidden[:4] * 1e3  # a large remainder relative to the weight term
    state = bound.prepare(hidden)
    for row in range(4):
        rnorm, hnorm = float(state.remainder_norm[row]), float(state.hidden_norm[row])
        got = screen_select(state.center[row], bound.coefficients, hnorm, _SLACK, 0.0, None, k, bound.qrow_norms, rnorm)
        chosen = torch.zeros(head.weight.shape[0], dtype=torch.bool)
        chosen[got] = True
        base = bound.coefficients.double() * hnorm + bound.qrow_norms.double() * rnorm
        center = state.center[row].double()
        kth = torch.topk(center - base, k).values[-1]
        tolerance = 1e-4 * (1 + float(center.abs().max()))
        assert bool(((center + base)[chosen] >= kth - tolerance).all())
        assert bool(((center + base)[~chosen] < kth + tolerance).all())
        exact = head.weight.double() @ hidden[row].double()
        assert bool(chosen[torch.topk(exact, k).indices].all())
