"""The 4-bit screen: its stage (codes, group steps and float16 minimums, the basis projection,
rounded-up norms), its kernel against the float64 reference on int8 residuals, and the soundness of its
radius on tiny heads, with hidden states that stress the int8 rounding and the basis.
"""

from __future__ import annotations

import pytest
import torch

from factories import make_tiny_head
from prep.screen4 import build_screen4, check_screen4_shape, hidden_basis, quantize_int4
from runtime.heads.screen4_bound import Screen4Bound, int8_rows
from runtime.kernels import build, screen4_gemv, screen4_reference, screen4_weight, unpack_int4
from test_screen_int16 import adversarial_hidden

VOCAB, DIM = 1031, 128  # 1031 rows: not a multiple of the kernel's row blocks


def calibration(dim: int, seed: int = 0) -> torch.Tensor:
    """Hidden-like rows [400, dim] (seed: the sample): a shared direction and a few strong ones, the same
    for every seed, on top of noise."""
    strong = torch.randn(4, dim, generator=torch.Generator().manual_seed(100)) * torch.tensor([40.0, 20.0, 10.0, 5.0])[:, None]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(400, dim, generator=gen) + torch.randn(400, 4, generator=gen) @ strong / 4 + strong[0]


def stage(group: int, rank: int = 16, seed: int = 1) -> tuple[torch.Tensor, dict]:
    head = make_tiny_head(vocab=VOCAB, dim=DIM, seed=seed)
    return head.weight, quantize_int4(head.weight, hidden_basis(calibration(DIM).double(), rank), group)


def dequantize4(t: dict) -> torch.Tensor:
    """Q [V, d] float64: row_step multiple q + m per group, the values the screen stands for (exact in float64)."""
    return screen4_weight(t["codes"], t["multiples"], t["row_step"], t["mins"])


@pytest.mark.parametrize("group", [32, 64])
def test_stage_codes_and_norms_are_what_the_bound_needs(group: int):
    weight, t = stage(group)
    q = unpack_int4(t["codes"], group)
    assert q.shape == (VOCAB, DIM) and int(q.max()) <= 15 and int(t["multiples"].max()) <= 15
    assert t["mins"].dtype == t["projection"].dtype == torch.float16 and t["multiples"].shape == (VOCAB, DIM // group)
    quantized = dequantize4(t)
    error = weight.double() - quantized
    projected = weight.double() @ t["basis"].double()  # B_i = U^T W_i
    stored = t["projection"].double()
    steps = t["row_step"].double()[:, None] * t["multiples"].double()  # [V, G]
    expected = {"error_norms": error.norm(dim=1), "qrow_norms": quantized.norm(dim=1), "row_norms": weight.double().norm(dim=1),
                "code_norms": (quantized - t["mins"].double().repeat_interleave(group, dim=1)).norm(dim=1),
                "projection_norms": stored.norm(dim=1), "projection_error_norms": (projected - stored).norm(dim=1)}
    for name, value in expected.items():
        assert bool((t[name].double() >= value).all()), f"{name} is not rounded up"
        assert torch.allclose(t[name].double(), value, rtol=1e-6), name
    # each weight within half a step of its group's grid (plus the float16 rounding of the minimum below it)
    below = (weight.double().view(VOCAB, -1, group).amin(-1) - t["mins"].double()).clamp(max=0).abs()  # [V, G]
    allowed = (steps / 2 + below).repeat_interleave(group, dim=1)
    assert bool((error.abs() <= allowed * (1 + 1e-3) + 1e-12).all())
    # the group steps are multiples 0..15 of the row's step, and cover each group's range
    ranges = weight.double().view(VOCAB, -1, group).amax(-1) - t["mins"].double()
    assert bool((15 * steps >= ranges * (1 - 1e-6)).all())


def test_shapes_the_kernel_cannot_take_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="divisible by 64.*int8 screen"):
        check_screen4_shape(96, 16, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        check_screen4_shape(128, 20, 64)
    with pytest.raises(ValueError, match="--group must be one of 32, 64"):
        check_screen4_shape(128, 16, 48)
    with pytest.raises(ValueError, match="float16 range"):
        quantize_int4(torch.full((4, 64), 1e5), torch.eye(64)[:, :16], 64)


def test_int8_rows_round_each_row_to_a_power_of_two_unit():
    rows = torch.cat([torch.randn(3, DIM, dtype=torch.float64) * torch.tensor([[1e-3], [1.0], [1e4]], dtype=torch.float64),
                      torch.full((1, DIM), float("nan"), dtype=torch.float64), torch.zeros(1, DIM, dtype=torch.float64)])
    unit, a, fits = int8_rows(rows)
    assert fits.tolist() == [True, True, True, False, False]
    for row in range(3):
        amax = float(rows[row].abs().max())
        assert float(unit[row]) == 2.0 ** round(torch.log2(unit[row]).item()) and 127 * float(unit[row]) / 2 <= amax < 127 * float(unit[row])
        assert bool(((rows[row] - a[row].double() * unit[row]).abs() <= unit[row] / 2).all())
    assert int(a[3:].abs().max()) == 0


def test_kernel_is_the_float64_reference():
    if "avx512_vnni" not in build.cpu_flags() or build.missing_cpu_flags("avx512"):
        pytest.skip("the 4-bit screen kernel needs AVX-512 with avx512_vnni (elsewhere the reference itself runs)")
    for group in (32, 64):
        weight, t = stage(group)
        hidden = torch.cat([calibration(DIM, seed=7)[:5], adversarial_hidden(DIM)[[0, 1, 2, 3]]])  # [9, d]: several passes of rows
        coords = hidden @ t["basis"]
        unit, a, fits = int8_rows(hidden.double() - coords.double() @ t["basis"].double().T)
        a[0, :] = 127  # the largest products the integer lanes take
        a[1, :] = -127
        parts = (t["codes"], t["multiples"], t["row_step"], t["mins"], t["projection"], a, unit.float(), coords)
        for module in (build.module(path) for path in ("avx512", "avx512vbmi") if not build.missing_cpu_flags(path)):
            center = module.screen4_gemv(*parts)
            quantized = dequantize4(t)
            for row in range(hidden.shape[0]):
                expected = quantized @ a[row].double() * float(unit[row]) + t["projection"].double() @ coords[row].double()  # [V]
                scale = quantized.abs() @ a[row].double().abs() * float(unit[row]) + t["projection"].double().abs() @ coords[row].double().abs()
                assert bool(((center[row].double() - expected).abs() <= 1e-5 * scale + 1e-30).all()), (group, row)
            assert torch.equal(center, screen4_gemv(*parts))  # the dispatcher runs the same kernel


def test_torch_reference_matches_the_float64_definition():
    weight, t = stage(32)
    hidden = calibration(DIM, seed=3)[:3].double()
    coords = torch.randn(3, 16, generator=torch.Generator().manual_seed(3))
    unit = torch.tensor([1.0, 0.5, 4.0])
    got = screen4_reference(t["codes"], t["multiples"], t["row_step"], t["mins"], t["projection"], hidden, unit, coords)
    expected = (hidden * unit.double()[:, None]) @ dequantize4(t).T + coords.double() @ t["projection"].double().T
    assert torch.allclose(got.double(), expected, rtol=1e-6, atol=1e-6)


def hidden_rows() -> torch.Tensor:
    """Calibration-like rows, rows off the calibration subspace, and rows with outliers and extremes."""
    gen = torch.Generator().manual_seed(11)
    off = torch.randn(3, DIM, generator=gen) * 30  # no shared direction: the basis helps little
    extreme = torch.randn(1, DIM, generator=gen) * 2.0**61  # beyond the int8 rounding's range: screened in float64
    return torch.cat([calibration(DIM, seed=9)[:6], off, adversarial_hidden(DIM)[:5], extreme])


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_every_exact_logit_lies_within_the_radius(group: int, bias: bool):
    head = make_tiny_head(vocab=VOCAB, dim=DIM, seed=2, bias=bias)
    tensors = quantize_int4(head.weight, hidden_basis(calibration(DIM).double(), 16), group)
    bound = Screen4Bound(head.weight, head.bias, tensors)
    hidden = hidden_rows()
    for start in range(0, hidden.shape[0], 5):  # batches of up to five rows
        batch = hidden[start : start + 5]
        state = bound.prepare(batch)
        exact = batch.double() @ head.weight.double().T + (head.bias.double() if bias else 0.0)  # [B, V]
        computed = torch.nn.functional.linear(batch, head.weight, head.bias).double()  # float32, as the full head
        for row in range(batch.shape[0]):
            radius = bound.radius(state, row).double()
            for logits in (exact, computed):
                assert bool(((logits[row] - state.center[row].double()).abs() <= radius).all()), (start + row)


def test_the_basis_tightens_the_radius_on_calibration_like_rows():
    head = make_tiny_head(vocab=VOCAB, dim=DIM, seed=4)
    calib = calibration(DIM).double()
    with_basis = Screen4Bound(head.weight, None, quantize_int4(head.weight, hidden_basis(calib, 16), 64))
    random_basis = torch.linalg.qr(torch.randn(DIM, 16, generator=torch.Generator().manual_seed(0)))[0].float()
    without = Screen4Bound(head.weight, None, quantize_int4(head.weight, random_basis, 64))
    hidden = calibration(DIM, seed=5)[:2]
    tight, loose = with_basis.prepare(hidden), without.prepare(hidden)
    assert float(with_basis.radius(tight, 0).mean()) < 0.5 * float(without.radius(loose, 0).mean())


def test_a_wide_batch_stays_sound_and_picks_the_exact_argmax():
    head = make_tiny_head(vocab=VOCAB, dim=DIM, seed=6)
    bound = Screen4Bound(head.weight, None, quantize_int4(head.weight, hidden_basis(calibration(DIM).double(), 16), 64))
    hidden = calibration(DIM, seed=8)[:11]  # more rows than one pass of the kernel takes
    state = bound.prepare(hidden)
    exact = hidden.double() @ head.weight.double().T
    for row in range(hidden.shape[0]):
        assert bool(((exact[row] - state.center[row].double()).abs() <= bound.radius(state, row).double()).all()), row
        picked = bound.open_topk(state, row, 1, 0.0, None)
        assert int(picked.ids[picked.logits.argmax()]) == int(exact[row].argmax())


def test_build_screen4_params():
    head = make_tiny_head(vocab=VOCAB, dim=DIM, seed=1)
    tensors, params = build_screen4(head.weight, calibration(DIM).double(), rank=32, group=64)
    assert params["bits"] == 4 and params["rank"] == 32 and params["group_size"] == 64
    assert params["calibration_positions"] == 400 and tensors["basis"].shape == (DIM, 32)
    assert 0 < params["mean_relative_error"] < 0.2
